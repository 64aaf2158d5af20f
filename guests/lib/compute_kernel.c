/* No includes, no dependencies: built for the guest and for the host. */
#include "compute_kernel.h"

unsigned long long compute_kernel(unsigned long long iters, unsigned long long seed)
{
	unsigned long long x = seed | 1;			/* xorshift64 state */
	unsigned long long h = 0xcbf29ce484222325ULL;		/* FNV-1a offset basis */

	for (unsigned long long i = 0; i < iters; i++) {
		x ^= x << 13;
		x ^= x >> 7;
		x ^= x << 17;
		h = (h ^ (x & 0xffff)) * 0x100000001b3ULL;	/* FNV prime */
	}
	return h ^ x;
}
