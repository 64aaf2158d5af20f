/*
 * pio-ping: count=N (10000) one-byte `out` writes to port=P (0x80), each a
 * VM exit. Prints "pio-ping count=N port=P tsc_per_exit=T ns_per_exit=X".
 */
#include "libcflat.h"

int main(void)
{
	u64 count = param_u64("count", 10000);
	u16 port = param_u64("port", LUCID_NOP_PORT);
	char b[32];

	tsc_khz();
	u64 t0 = rdtsc();
	for (u64 i = 0; i < count; i++)
		outb(port, i);
	u64 t = rdtsc() - t0;
	u64 per = count ? t / count : 0;
	printf("pio-ping count=%lu port=%#x tsc_per_exit=%lu ns_per_exit=%s\n", count, port, per,
	       tsc_khz() && count ? fmt_milli(b, tsc_to_ns(t * 1000) / count) : "unknown");
	return 0;
}
