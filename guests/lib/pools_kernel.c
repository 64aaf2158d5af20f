/* No includes beyond the kernel headers, no dependencies: built for the guest and the host. */
#include "pools_kernel.h"
#include "compute_kernel.h"

void pools_fill(unsigned long long *buf, unsigned long long words, unsigned long long seed)
{
	unsigned long long x = seed | 1;

	for (unsigned long long i = 0; i < words; i++) {
		x ^= x << 13;
		x ^= x >> 7;
		x ^= x << 17;
		buf[i] = x;
	}
}

unsigned long long pools_cpu_pass(unsigned long long *buf, unsigned long long words,
				  unsigned long long h)
{
	for (unsigned long long b = 0; b < words; b += 512) {
		unsigned long long end = b + 512 < words ? b + 512 : words;
		h ^= compute_kernel(16, h ^ buf[b]);
		for (unsigned long long i = b; i < end; i++) {
			unsigned long long w = buf[i];
			h = (h ^ w) * 0x100000001b3ULL;		/* FNV prime */
			buf[i] = w ^ (h >> 29);
		}
	}
	return h;
}
