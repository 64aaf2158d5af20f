/*
 * irq-self: exercises the interrupt trampoline. Enables the LAPIC, sends
 * count=N (1000) self-IPIs on vector=V (0x40) through the ICR and waits for
 * each at CPL3 with irq_wait(). Prints "irq-self count=N received=M
 * us_per_irq=X"; exit 0 if every IPI arrived, 1 otherwise.
 */
#include "libcflat.h"

int main(void)
{
	u64 count = param_u64("count", 1000);
	u32 vec = param_u64("vector", 0x40);
	u64 received = 0, wrong = 0;
	char b[32];

	if (vec < 0x20 || vec > 0xfe) {
		printf("irq-self: vector must be 0x20-0xfe\n");
		return 2;
	}
	u64 k = tsc_khz() ? tsc_khz() : 3000000;
	lapic_write(0xf0, 0x1ff);		/* SVR: APIC on, spurious 0xff */
	irq_enable();
	u64 t0 = rdtsc();
	for (u64 i = 0; i < count; i++) {
		lapic_write(0x300, 0x40000 | vec);	/* self, fixed */
		int v = irq_wait(100 * k);	/* 100 ms */
		if (v == (int)vec)
			received++;
		else if (v >= 0)
			wrong++;
	}
	u64 t = rdtsc() - t0;
	irq_disable();
	printf("irq-self count=%lu received=%lu wrong=%lu irq_count=%lu us_per_irq=%s\n", count,
	       received, wrong, this_cpu()->irq_count,
	       tsc_khz() && count ? fmt_milli(b, tsc_to_ns(t) / count) : "unknown");
	return received == count ? 0 : 1;
}
