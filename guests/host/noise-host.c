/*
 * Host twin of the pools workloads: the `noise` guest's loop (mode=noise,
 * the default) and the `cpu` guest's passes (mode=cpu), with the same
 * output lines, timed with CLOCK_MONOTONIC: the native limits `lucid bench
 * pools` compares the guests with. cpu=N pins the process to CPU N first.
 *
 * noise: quanta=2000 iters=100000 warmup=20; prints "noise quanta= iters=
 * checksum=", "noise min_ns= median_ns= p99_ns= max_ns= total_ns=",
 * "noise spread_p99= spread_max=".
 * cpu: mib=8 seed=0x5eed seconds=0 passes=0 (both 0: 100); prints "cpu mib=
 * passes= checksum= passes_per_s= ns_per_pass=".
 */
#define _GNU_SOURCE
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "compute_kernel.h"
#include "pools_kernel.h"

static int argc_;
static char **argv_;

static unsigned long long param(const char *key, unsigned long long def)
{
	size_t n = strlen(key);
	for (int i = 1; i < argc_; i++)
		if (!strncmp(argv_[i], key, n) && argv_[i][n] == '=')
			return strtoull(argv_[i] + n + 1, NULL, 0);
	return def;
}

static unsigned long long now_ns(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec * 1000000000ULL + t.tv_nsec;
}

static int cmp(const void *a, const void *b)
{
	unsigned long long x = *(const unsigned long long *)a, y = *(const unsigned long long *)b;
	return x < y ? -1 : x > y;
}

static const char *milli(char *b, unsigned long long v)
{
	snprintf(b, 32, "%llu.%03llu", v / 1000, v % 1000);
	return b;
}

static int noise(void)
{
	unsigned long long quanta = param("quanta", 2000), iters = param("iters", 100000);
	unsigned long long warmup = param("warmup", 20), sum = 0;
	char b[32], c[32];

	if (!quanta || quanta > (1 << 22)) {
		printf("noise: quanta must be 1-4194304\n");
		return 2;
	}
	unsigned long long *t = calloc(quanta, sizeof(*t));
	if (!t)
		return 2;
	for (unsigned long long q = 0; q < warmup; q++)
		sum ^= compute_kernel(iters, q + 1);
	unsigned long long start = now_ns();
	for (unsigned long long q = 0; q < quanta; q++) {
		unsigned long long a = now_ns();
		sum ^= compute_kernel(iters, q + 1);
		t[q] = now_ns() - a;
	}
	unsigned long long total = now_ns() - start;
	qsort(t, quanta, sizeof(*t), cmp);
	unsigned long long min = t[0], med = t[quanta / 2], p99 = t[quanta * 99 / 100];
	unsigned long long max = t[quanta - 1];
	printf("noise quanta=%llu iters=%llu checksum=0x%016llx\n", quanta, iters, sum);
	printf("noise min_ns=%llu median_ns=%llu p99_ns=%llu max_ns=%llu total_ns=%llu\n", min, med,
	       p99, max, total);
	printf("noise spread_p99=%s spread_max=%s\n",
	       milli(b, min ? (p99 - min) * 1000 / min : 0),
	       milli(c, min ? (max - min) * 1000 / min : 0));
	return 0;
}

static int cpu(void)
{
	unsigned long long mib = param("mib", 8), seconds = param("seconds", 0);
	unsigned long long passes = param("passes", 0), n = 0;
	unsigned long long h = 0xcbf29ce484222325ULL;
	char b[32], c[32];

	if (!mib || mib > 1024) {
		printf("cpu: mib must be 1-1024\n");
		return 2;
	}
	if (!seconds && !passes)
		passes = 100;
	unsigned long long words = mib << 17;
	unsigned long long *buf = malloc(mib << 20);
	if (!buf)
		return 2;
	pools_fill(buf, words, param("seed", 0x5eed));
	unsigned long long t0 = now_ns(), t;
	for (;;) {
		t = now_ns() - t0;
		if ((passes && n >= passes) || (seconds && t >= seconds * 1000000000ULL))
			break;
		h = pools_cpu_pass(buf, words, h);
		n++;
	}
	printf("cpu mib=%llu passes=%llu checksum=0x%016llx passes_per_s=%s ns_per_pass=%s\n", mib,
	       n, h, milli(b, t ? n * 1000000000000ULL / t : 0), milli(c, n ? t * 1000 / n : 0));
	return 0;
}

int main(int argc, char **argv)
{
	argc_ = argc;
	argv_ = argv;
	const char *mode = "noise";
	for (int i = 1; i < argc; i++)
		if (!strncmp(argv[i], "mode=", 5))
			mode = argv[i] + 5;
	for (int i = 1; i < argc; i++)
		if (!strncmp(argv[i], "cpu=", 4)) {
			cpu_set_t s;
			CPU_ZERO(&s);
			CPU_SET(atoi(argv[i] + 4), &s);
			if (sched_setaffinity(0, sizeof(s), &s)) {
				perror("noise-host: sched_setaffinity");
				return 2;
			}
		}
	if (!strcmp(mode, "noise"))
		return noise();
	if (!strcmp(mode, "cpu"))
		return cpu();
	printf("noise-host: mode must be noise or cpu\n");
	return 2;
}
