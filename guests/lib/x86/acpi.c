/* Minimal ACPI: find the RSDP and list the enabled CPUs in the MADT. */
#include "libcflat.h"

struct sdt_header {
	char sig[4];
	u32 length;
	u8 revision, checksum;
	char oem[6], oem_table[8];
	u32 oem_rev, creator, creator_rev;
} __attribute__((packed));

static int checksum_ok(const void *p, u32 len)
{
	u8 sum = 0;
	for (u32 i = 0; i < len; i++)
		sum += ((const u8 *)p)[i];
	return sum == 0;
}

static int is_rsdp(u64 a)
{
	return !memcmp((void *)a, "RSD PTR ", 8) && checksum_ok((void *)a, 20);
}

u64 acpi_find_rsdp(void)
{
	if (boot_rsdp_paddr && is_rsdp(boot_rsdp_paddr))
		return boot_rsdp_paddr;
	/* EBDA (segment at 0x40e), then the BIOS area 0xe0000-0xfffff */
	u64 bda = 0x40e;
	asm("" : "+r"(bda));	/* hide the constant address from -Warray-bounds */
	u64 ebda = (u64)*(volatile u16 *)bda << 4;
	if (ebda >= 0x80000 && ebda < 0xa0000)
		for (u64 a = ebda; a < ebda + 1024; a += 16)
			if (is_rsdp(a))
				return a;
	for (u64 a = 0xe0000; a < 0x100000; a += 16)
		if (is_rsdp(a))
			return a;
	return 0;
}

static const struct sdt_header *find_table(u64 rsdp, const char *sig)
{
	u8 rev = *(u8 *)(rsdp + 15);
	u64 xsdt = rev >= 2 ? *(u64 *)(rsdp + 24) : 0;
	u64 root = xsdt ? xsdt : *(u32 *)(rsdp + 16);
	int esz = xsdt ? 8 : 4;

	if (!root)
		return NULL;
	const struct sdt_header *h = (void *)root;
	u32 n = (h->length - sizeof(*h)) / esz;
	for (u32 i = 0; i < n; i++) {
		u64 a = esz == 8 ? *(u64 *)(root + sizeof(*h) + 8 * i)
				 : *(u32 *)(root + sizeof(*h) + 4 * i);
		const struct sdt_header *t = (void *)a;
		if (a && !memcmp(t->sig, sig, 4))
			return t;
	}
	return NULL;
}

int acpi_madt_cpus(u32 *ids, int max)
{
	u64 rsdp = acpi_find_rsdp();
	if (!rsdp)
		return -1;
	const struct sdt_header *madt = find_table(rsdp, "APIC");
	if (!madt)
		return -2;
	const u8 *p = (const u8 *)madt + 44, *end = (const u8 *)madt + madt->length;
	int n = 0;
	while (p + 2 <= end && p[1] >= 2) {
		if (p[0] == 0 && p[1] >= 8) {		/* processor local APIC */
			u32 flags = *(u32 *)(p + 4);
			if ((flags & 1) && n < max)
				ids[n++] = p[3];
		} else if (p[0] == 9 && p[1] >= 16) {	/* processor local x2APIC */
			u32 flags = *(u32 *)(p + 8);
			if ((flags & 1) && n < max)
				ids[n++] = *(u32 *)(p + 4);
		}
		p += p[1];
	}
	return n;
}

const void *acpi_find_table(const char *sig)
{
	u64 rsdp = acpi_find_rsdp();
	return rsdp ? find_table(rsdp, sig) : NULL;
}
