/*
 * memtouch: writes an address-dependent pattern to every 8 bytes of mib=N
 * (64) MiB starting at base=A (16 MiB), reads it back. Prints
 * "memtouch mib=N errors=E ..."; exit 0 if no errors, 1 if errors, 2 if
 * the memory map (PVH memmap) shows too little RAM or is missing.
 */
#include "libcflat.h"

static inline u64 pattern(u64 a)
{
	return (a * 0x9e3779b97f4a7c15UL) ^ (a >> 7) ^ 0xa5a5a5a55a5a5a5aUL;
}

int main(void)
{
	u64 mib = param_u64("mib", 64);
	u64 base = param_u64("base", 16 << 20);
	u64 end = base + (mib << 20);
	char b1[32], b2[32];

	if (!boot_memmap_entries) {
		printf("memtouch: no memory map from the VMM (hvm_start_info memmap); cannot check RAM size\n");
		return 2;
	}
	u64 ram_end = ram_region_end(base);
	if (end > 0xc0000000UL || ram_end < end) {
		printf("memtouch: not enough memory: need %#lx-%#lx (mib=%lu), usable RAM there ends at %#lx\n",
		       base, end, mib, ram_end);
		return 2;
	}
	tsc_khz();
	u64 t0 = rdtsc();
	for (u64 a = base; a < end; a += 8)
		*(volatile u64 *)a = pattern(a);
	u64 t1 = rdtsc();
	u64 errors = 0, first = 0;
	for (u64 a = base; a < end; a += 8)
		if (*(volatile u64 *)a != pattern(a))
			if (!errors++)
				first = a;
	u64 t2 = rdtsc();
	printf("memtouch mib=%lu errors=%lu", mib, errors);
	if (errors)
		printf(" first_bad=%#lx", first);
	if (tsc_khz())
		printf(" write_ms=%s read_ms=%s", fmt_milli(b1, tsc_to_ns(t1 - t0) / 1000),
		       fmt_milli(b2, tsc_to_ns(t2 - t1) / 1000));
	printf("\n");
	return errors ? 1 : 0;
}
