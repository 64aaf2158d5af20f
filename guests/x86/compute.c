/*
 * compute: CPU-bound integer loop (lib/compute_kernel.c, shared with the
 * host program compute-host). Params: iters=N (100000000), seed=N (0x5eed).
 * Prints "checksum=0x..." and, with a known TSC frequency, "ns_per_iter=".
 */
#include "libcflat.h"
#include "compute_kernel.h"

int main(void)
{
	u64 iters = param_u64("iters", 100000000);
	u64 seed = param_u64("seed", 0x5eed);
	char b[32];

	tsc_khz();
	u64 t0 = rdtsc();
	u64 sum = compute_kernel(iters, seed);
	u64 t1 = rdtsc();
	printf("compute iters=%lu\n", iters);
	printf("checksum=0x%016lx\n", sum);
	if (iters) {
		printf("tsc_per_iter=%s\n", fmt_milli(b, (t1 - t0) * 1000 / iters));
		if (tsc_khz())
			printf("ns_per_iter=%s\n", fmt_milli(b, tsc_to_ns((t1 - t0) * 1000) / iters));
	}
	return 0;
}
