/*
 * AP bring-up from CPL3: copy the real-mode trampoline (boot.S) to
 * AP_TRAMPOLINE, then INIT-SIPI-SIPI through the LAPIC ICR, which the
 * user-accessible identity map reaches. Each AP goes real -> protected ->
 * long mode -> CPL3 through the same boot stub as the BSP, takes the next
 * CPU index with lock xadd and lands in ap_entry() on its own stack.
 */
#include "libcflat.h"

extern char ap_tramp_start[], ap_tramp_end[];
void percpu_init(u32 idx);

volatile u32 smp_cpus_up;
static void (*volatile ap_hook)(u32);

static u64 park_fn(u64 arg)
{
	(void)arg;
	cpu_park();
	return 0;
}

void ap_entry(u32 idx) __attribute__((noreturn));
void ap_entry(u32 idx)
{
	percpu_init(idx);
	this_cpu()->apic_id = lapic_id();
	if (ap_hook)
		ap_hook(idx);
	__atomic_add_fetch(&smp_cpus_up, 1, __ATOMIC_SEQ_CST);
	cpl0_call(park_fn, 0);		/* hlt with IF=0: costs nothing */
	for (;;)
		cpu_relax();
}

#define ICR_LO 0x300
#define ICR_HI 0x310

static void send_ipi(u32 apic_id, u32 lo)
{
	lapic_write(ICR_HI, apic_id << 24);
	lapic_write(ICR_LO, lo);
	for (int i = 0; i < 1000 && (lapic_read(ICR_LO) & (1 << 12)); i++)
		cpu_relax();			/* delivery status */
}

int smp_bringup(const u32 *ids, int n, void (*fn)(u32 idx), u64 timeout_ms)
{
	u32 targets[MAX_CPUS];
	int nt = 0;
	u32 self = lapic_id();

	this_cpu()->apic_id = self;
	smp_cpus_up = 1;
	ap_hook = fn;
	for (int i = 0; i < n && nt < MAX_CPUS - 1; i++)
		if (ids[i] != self)
			targets[nt++] = ids[i];
	if (!nt)
		return 1;
	memcpy((void *)AP_TRAMPOLINE, ap_tramp_start, ap_tramp_end - ap_tramp_start);
	tsc_khz();				/* calibrate before timing */
	for (int i = 0; i < nt; i++)
		send_ipi(targets[i], 0x4500);	/* INIT, level assert */
	udelay(10000);
	for (int rep = 0; rep < 2; rep++) {
		for (int i = 0; i < nt; i++)
			send_ipi(targets[i], 0x4600 | (AP_TRAMPOLINE >> 12));	/* SIPI */
		udelay(200);
	}
	u64 k = tsc_khz() ? tsc_khz() : 3000000;
	u64 start = rdtsc(), limit = timeout_ms * k;
	while (smp_cpus_up < (u32)nt + 1 && rdtsc() - start < limit)
		cpu_relax();
	return smp_cpus_up;
}
