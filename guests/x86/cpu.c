/*
 * cpu: the CPU-bound guest of the pools workloads (the paper's bzip2 over
 * 8 MiB of random data in a loop): passes of lib/pools_kernel.c over a
 * random buffer, reporting the passes rarely through LUCID_HC_WORK
 * (iterations), so that the VMM sees almost no exits.
 *
 * Params: mib=8 (buffer), seed=0x5eed, seconds=0 (run this long by the
 * TSC), passes=0 (or this many passes; with both 0: 100 passes),
 * report=64 (passes per LUCID_HC_WORK report).
 *
 * Prints "cpu mib=M passes=N checksum=0x.. tsc=T passes_per_s=X
 * ns_per_pass=Y reports=R". Exit 0; 2 setup.
 */
#include "libcflat.h"
#include "virtio.h"
#include "pools_kernel.h"

int main(void)
{
	u64 mib = param_u64("mib", 8);
	u64 seconds = param_u64("seconds", 0);
	u64 passes = param_u64("passes", 0);
	u64 report = param_u64("report", 64);
	char b[32], c[32];

	if (!mib || mib > 1024) {
		printf("cpu: mib must be 1-1024\n");
		return 2;
	}
	if (!seconds && !passes)
		passes = 100;
	if (!report)
		report = 64;
	u64 k = tsc_khz() ? tsc_khz() : 3000000;
	u64 words = mib << 17;
	unsigned long long *buf = dma_alloc(mib << 20, 4096);
	pools_fill(buf, words, param_u64("seed", 0x5eed));

	u64 n = 0, unreported = 0, reports = 0;
	unsigned long long h = 0xcbf29ce484222325ULL;
	u64 t0 = rdtsc();
	for (;;) {
		if (passes && n >= passes)
			break;
		if (seconds && rdtsc() - t0 >= seconds * 1000 * k)
			break;
		h = pools_cpu_pass(buf, words, h);
		n++;
		if (++unreported >= report) {
			lucid_hypercall(LUCID_HC_WORK, LUCID_WORK_ITERATIONS, unreported, 0);
			unreported = 0;
			reports++;
		}
	}
	u64 t = rdtsc() - t0;
	if (unreported) {
		lucid_hypercall(LUCID_HC_WORK, LUCID_WORK_ITERATIONS, unreported, 0);
		reports++;
	}
	printf("cpu mib=%lu passes=%lu checksum=0x%016lx tsc=%lu passes_per_s=%s ns_per_pass=%s "
	       "reports=%lu\n",
	       mib, n, (u64)h, t, tsc_khz() && t ? fmt_milli(b, rate_milli(n, t)) : "unknown",
	       tsc_khz() && n ? fmt_milli(c, tsc_to_ns(t) * 1000 / n) : "unknown", reports);
	return 0;
}
