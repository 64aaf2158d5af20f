/*
 * mmio-ping: count=N (10000) 32-bit accesses to addr=A (0xd0000000, an
 * unassigned MMIO page under Lucid), op=write (default) or op=read.
 * Prints "mmio-ping count=N addr=A op=OP tsc_per_exit=T ns_per_exit=X".
 */
#include "libcflat.h"

int main(void)
{
	u64 count = param_u64("count", 10000);
	u64 addr = param_u64("addr", LUCID_MMIO_PROBE);
	int rd = !strcmp(param_str("op", "write"), "read");
	u32 sink = 0;
	char b[32];

	tsc_khz();
	/* Exactly `count` accesses; the first one (which also maps the page) is not timed. */
	u64 timed = count > 1 ? count - 1 : 0;
	if (count) {
		if (rd)
			sink += mmio_read32(addr);
		else
			mmio_write32(addr, 0);
	}
	u64 t0 = rdtsc();
	if (rd)
		for (u64 i = 0; i < timed; i++)
			sink += mmio_read32(addr);
	else
		for (u64 i = 0; i < timed; i++)
			mmio_write32(addr, i);
	u64 t = rdtsc() - t0;
	(void)sink;
	printf("mmio-ping count=%lu addr=%#lx op=%s tsc_per_exit=%lu ns_per_exit=%s\n", count, addr,
	       rd ? "read" : "write", timed ? t / timed : 0,
	       tsc_khz() && timed ? fmt_milli(b, tsc_to_ns(t * 1000) / timed) : "unknown");
	return 0;
}
