/*
 * smp: starts every AP listed in the ACPI MADT (RSDP from hvm_start_info
 * or a scan of 0xe0000-0xfffff) with INIT-SIPI-SIPI; each prints
 * "cpu N up (apic_id=A)". Prints "smp: N of M cpus up"; exit 0 if all
 * came up within timeout_ms=T (5000), else 1. No ACPI: assumes 1 cpu.
 */
#include "libcflat.h"

static void ap_report(u32 idx)
{
	printf("cpu %u up (apic_id=%u)\n", idx, this_cpu()->apic_id);
}

int main(void)
{
	u32 ids[MAX_CPUS];
	int n = acpi_madt_cpus(ids, MAX_CPUS);
	u32 self = lapic_id();

	if (n == -1)
		printf("smp: no ACPI RSDP found; assuming 1 cpu\n");
	else if (n == -2)
		printf("smp: ACPI tables have no MADT; assuming 1 cpu\n");
	else if (n == 0)
		printf("smp: MADT lists no enabled cpu; assuming 1 cpu\n");
	if (n <= 0) {
		ids[0] = self;
		n = 1;
	}
	printf("cpu 0 up (apic_id=%u, bsp)\n", self);
	int up = smp_bringup(ids, n, ap_report, param_u64("timeout_ms", 5000));
	printf("smp: %d of %d cpus up\n", up, n);
	return up == n ? 0 : 1;
}
