/*
 * noise: the low-noise probe (Palacios' fixed-work-quantum benchmark): runs
 * `quanta` quanta of `iters` compute-kernel iterations at CPL3, timing each
 * with the TSC, and prints the spread of the per-quantum times. No exits,
 * no interrupts and no hypercalls while it measures: whatever stretches a
 * quantum is the host's (and the VMM's) noise. guests/host/noise-host.c runs
 * the same loop natively with the same output.
 *
 * Params: quanta=2000, iters=100000, warmup=20 (quanta not recorded).
 *
 * Prints "noise quanta=N iters=I checksum=0x.. min_tsc= median_tsc= p99_tsc=
 * max_tsc= total_tsc=" then (TSC frequency known) "noise min_ns= median_ns=
 * p99_ns= max_ns= total_ns=", and "noise spread_p99=X spread_max=Y" where a
 * spread is (p99 or max - min) / min. Reports the quanta through
 * LUCID_HC_WORK (iterations) once, at the end. Exit 0; 2 setup.
 */
#include "libcflat.h"
#include "virtio.h"
#include "compute_kernel.h"

static void sort(u64 *a, u64 n)
{
	/* shell sort: no recursion, no allocation */
	for (u64 gap = n / 2; gap; gap /= 2)
		for (u64 i = gap; i < n; i++) {
			u64 v = a[i], j = i;
			for (; j >= gap && a[j - gap] > v; j -= gap)
				a[j] = a[j - gap];
			a[j] = v;
		}
}

int main(void)
{
	u64 quanta = param_u64("quanta", 2000);
	u64 iters = param_u64("iters", 100000);
	u64 warmup = param_u64("warmup", 20);
	char b[32], c[32];

	if (!quanta || quanta > (1 << 22)) {
		printf("noise: quanta must be 1-4194304\n");
		return 2;
	}
	tsc_khz();		/* asked before measuring: its hypercall is an exit */
	u64 *t = dma_alloc(8 * quanta, 64);
	unsigned long long sum = 0;
	for (u64 q = 0; q < warmup; q++)
		sum ^= compute_kernel(iters, q + 1);
	u64 start = rdtsc();
	for (u64 q = 0; q < quanta; q++) {
		u64 a = rdtsc();
		sum ^= compute_kernel(iters, q + 1);
		t[q] = rdtsc() - a;
	}
	u64 total = rdtsc() - start;
	lucid_hypercall(LUCID_HC_WORK, LUCID_WORK_ITERATIONS, quanta, 0);
	sort(t, quanta);
	u64 min = t[0], med = t[quanta / 2], p99 = t[(quanta * 99) / 100], max = t[quanta - 1];
	printf("noise quanta=%lu iters=%lu checksum=0x%016lx min_tsc=%lu median_tsc=%lu "
	       "p99_tsc=%lu max_tsc=%lu total_tsc=%lu\n",
	       quanta, iters, (u64)sum, min, med, p99, max, total);
	if (tsc_khz())
		printf("noise min_ns=%lu median_ns=%lu p99_ns=%lu max_ns=%lu total_ns=%lu\n",
		       tsc_to_ns(min), tsc_to_ns(med), tsc_to_ns(p99), tsc_to_ns(max),
		       tsc_to_ns(total));
	printf("noise spread_p99=%s spread_max=%s\n",
	       fmt_milli(b, min ? (p99 - min) * 1000 / min : 0),
	       fmt_milli(c, min ? (max - min) * 1000 / min : 0));
	return 0;
}
