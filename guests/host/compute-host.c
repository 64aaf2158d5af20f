/* Host twin of the `compute` guest: same kernel, same output format. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "compute_kernel.h"

int main(int argc, char **argv)
{
	unsigned long long iters = 100000000ULL;
	struct timespec a, b;

	for (int i = 1; i < argc; i++)
		if (!strncmp(argv[i], "iters=", 6))
			iters = strtoull(argv[i] + 6, NULL, 0);
	clock_gettime(CLOCK_MONOTONIC, &a);
	unsigned long long sum = compute_kernel(iters, 0x5eed);
	clock_gettime(CLOCK_MONOTONIC, &b);
	unsigned long long ns = (b.tv_sec - a.tv_sec) * 1000000000ULL + b.tv_nsec - a.tv_nsec;
	printf("compute iters=%llu\n", iters);
	printf("checksum=0x%016llx\n", sum);
	if (iters)
		printf("ns_per_iter=%llu.%03llu\n", ns / iters, ns * 1000 / iters % 1000);
	return 0;
}
