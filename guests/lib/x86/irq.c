/* Interrupt consumption at CPL3 and the LAPIC accessors (see libcflat.h). */
#include "libcflat.h"

extern char cpl0_set_if[], cpl0_clear_if[];

void irq_enable(void)
{
	cpl0_call((u64 (*)(u64))cpl0_set_if, 0);
}

void irq_disable(void)
{
	cpl0_call((u64 (*)(u64))cpl0_clear_if, 0);
}

int irq_pending(void)
{
	struct percpu *p = this_cpu();
	for (int i = 0; i < 32; i++)
		if (p->pending[i])
			return i * 8 + __builtin_ctz(p->pending[i]);
	return -1;
}

int irq_take(void)
{
	struct percpu *p = this_cpu();
	int v = irq_pending();
	if (v >= 0) /* one RMW instruction: atomic against this CPU's stubs */
		__atomic_fetch_and(&p->pending[v >> 3], (u8)~(1 << (v & 7)), __ATOMIC_SEQ_CST);
	return v;
}

int irq_wait(u64 timeout_tsc)
{
	u64 start = rdtsc();
	for (;;) {
		int v = irq_take();
		if (v >= 0)
			return v;
		if (timeout_tsc && rdtsc() - start > timeout_tsc)
			return -1;
		cpu_relax();
	}
}

u32 lapic_read(u32 reg)
{
	return mmio_read32(LUCID_LAPIC_BASE + reg);
}

void lapic_write(u32 reg, u32 v)
{
	mmio_write32(LUCID_LAPIC_BASE + reg, v);
}

u32 lapic_id(void)
{
	return lapic_read(0x20) >> 24;
}
