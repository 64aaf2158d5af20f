#ifndef POOLS_KERNEL_H
#define POOLS_KERNEL_H
/* Work loops of the pools workloads, shared by the `cpu` and `noise` guests
 * and their host twin noise-host: same source, same checksums. */

/* fill words of buf with xorshift64 output from seed */
void pools_fill(unsigned long long *buf, unsigned long long words, unsigned long long seed);
/* one pass of the CPU-bound workload over buf (the paper's "compress an 8 MiB random buffer"
 * stand-in): per 4 KiB block the compute kernel seeded from the block, then every word mixed
 * into the hash and rewritten; returns the new hash */
unsigned long long pools_cpu_pass(unsigned long long *buf, unsigned long long words,
				  unsigned long long h);
#endif
