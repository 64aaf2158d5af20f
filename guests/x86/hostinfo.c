/*
 * hostinfo: what this host costs, as key=value lines: cpl3_ns_per_iter
 * (dec;jnz at CPL3), cpl0_ns_per_iter (the same loop at CPL0 through the
 * int $0x80 gate), pio_exit_us (port 0x80), mmio_exit_us (0xd0000000),
 * ioeventfd_exit_us (port 0x598, a byte write), backend, tsc_khz.
 * Params: cpl3_iters (50000000), cpl0_iters (2000), n (2000).
 */
#include "libcflat.h"

static u64 cpl0_loop(u64 n)
{
	u64 t0 = rdtsc();
	asm volatile("1: dec %0; jnz 1b" : "+r"(n) :: "cc");
	return rdtsc() - t0;
}

static void report(const char *key, u64 ticks, u64 n, u64 scale)
{
	char b[32];
	/* scale 1: ns, 1000: us; printed with 3 decimals */
	if (tsc_khz() && n)
		printf("%s=%s\n", key, fmt_milli(b, tsc_to_ns(ticks * 1000 / scale) / n));
	else
		printf("%s=unknown\n", key);
}

int main(void)
{
	u64 cpl3_iters = param_u64("cpl3_iters", 50000000);
	u64 cpl0_iters = param_u64("cpl0_iters", 2000);
	u64 n = param_u64("n", 2000);
	u64 t0, t;

	u64 khz = tsc_khz();
	printf("tsc_khz=%lu\n", khz);
	printf("tsc_khz_source=%s\n", tsc_khz_source());
	printf("vmm=%s\n", lucid_present() ? "lucid" : "other");
	printf("backend=%s\n", lucid_backend_name());

	if (cpl3_iters) {
		u64 i = cpl3_iters;
		t0 = rdtsc();
		asm volatile("1: dec %0; jnz 1b" : "+r"(i) :: "cc");
		report("cpl3_ns_per_iter", rdtsc() - t0, cpl3_iters, 1);
	}
	if (cpl0_iters)
		report("cpl0_ns_per_iter", cpl0_call(cpl0_loop, cpl0_iters), cpl0_iters, 1);

	outb(LUCID_NOP_PORT, 0);
	t0 = rdtsc();
	for (u64 i = 0; i < n; i++)
		outb(LUCID_NOP_PORT, 0);
	t = rdtsc() - t0;
	report("pio_exit_us", t, n, 1000);

	mmio_write32(LUCID_MMIO_PROBE, 0);
	t0 = rdtsc();
	for (u64 i = 0; i < n; i++)
		mmio_write32(LUCID_MMIO_PROBE, i);
	t = rdtsc() - t0;
	report("mmio_exit_us", t, n, 1000);

	outb(LUCID_IOEVENTFD_PORT, 0);
	t0 = rdtsc();
	for (u64 i = 0; i < n; i++)
		outb(LUCID_IOEVENTFD_PORT, 0);
	t = rdtsc() - t0;
	report("ioeventfd_exit_us", t, n, 1000);
	return 0;
}
