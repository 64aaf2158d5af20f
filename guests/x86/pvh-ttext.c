/*
 * pvh-ttext: the kit linked as most PVH kernels are, with `ld -Ttext=0x100000`
 * and no linker script of its own (Makefile), so the first PT_LOAD holds the
 * ELF headers and the PVH note one page below 1 MiB, at 0xff000. Checks that
 * whether the VMM loaded that segment (the headers in memory where ld put
 * them: `magic=ok`) and that the boot data and ACPI tables are intact around
 * it. Under QEMU microvm 0xff000 is qboot's BIOS ROM, which keeps its own
 * bytes there: `magic=MISSING`, not an error.
 */
#include "libcflat.h"

extern const unsigned char __ehdr_start[];

int main(void)
{
	const unsigned char *eh = __ehdr_start;
	int magic = eh[0] == 0x7f && eh[1] == 'E' && eh[2] == 'L' && eh[3] == 'F';
	u32 cpus[8];
	int ncpus = acpi_madt_cpus(cpus, 8);

	printf("pvh-ttext: ehdr=%#lx magic=%s rsdp=%#lx cpus=%d memmap=%u\n",
	       (u64)eh, magic ? "ok" : "MISSING", acpi_find_rsdp(), ncpus,
	       boot_memmap_entries);
	if (ncpus < 1 || !boot_memmap_entries)
		return 1;
	return param_u64("code", 0);
}
