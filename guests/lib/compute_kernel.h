#ifndef COMPUTE_KERNEL_H
#define COMPUTE_KERNEL_H
/* CPU-bound integer mixing loop shared by the `compute` guest and the
 * compute-host program: same source, same checksum. */
unsigned long long compute_kernel(unsigned long long iters, unsigned long long seed);
#endif
