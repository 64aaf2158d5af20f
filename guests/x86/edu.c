/*
 * edu: exercise QEMU's edu device (Lucid: --device edu): identification,
 * liveness, factorial, a DMA round trip RAM -> device -> RAM with a data
 * check, and an MSI raised and acknowledged (then one at the end of a DMA).
 *
 * Params: iommu=vtd (DMA through the VT-d with strategy=, default strict;
 * also irq_remap=1: the MSI in remappable format through an IRTE),
 * len=4032 (DMA bytes, 1-4095: QEMU 7.2's edu aborts on a transfer that
 * reaches the end of its buffer, an off-by-one), rounds=1, vector=0x50, timeout_ms=2000.
 *
 * Prints "edu ident=.. liveness=ok|BAD factorial=ok|BAD dma=ok|BAD
 * irq=ok|BAD dma_irq=ok|BAD" (and the iommu-dma line with iommu=vtd), after
 * "edu dma rounds=N tsc=T rounds_per_s=X" (a round: map, DMA in, unmap, map, DMA out, unmap).
 * Exit 0 all ok; 1 a check failed; 2 no device / setup failed.
 */
#include "libcflat.h"
#include "edu.h"
#include "iommu_dma.h"
#include "virtio.h"		/* dma_alloc */

static struct edu_dev edu;
static int use_iommu;

static u64 map(void *p, u64 len, int dir)
{
	return use_iommu ? iommu_map((u64)p, len, dir) : (u64)p;
}

static void unmap(u64 iova, u64 len)
{
	if (use_iommu)
		iommu_unmap(iova, len);
}

/* edu_dma_wait, applying the mapping strategy's time limits meanwhile */
static int dma_wait(u64 timeout_ms)
{
	u64 t0 = rdtsc(), lim = timeout_ms * (tsc_khz() ? tsc_khz() : 3000000);
	while (edu_read(&edu, EDU_DMA_CMD) & EDU_DMA_START) {
		if (rdtsc() - t0 > lim)
			return -1;
		if (use_iommu)
			iommu_dma_poll();
		cpu_relax();
	}
	return 0;
}

/* irq_wait, applying the strategy's time limits meanwhile */
static int wait_irq(u64 ticks)
{
	u64 t0 = rdtsc();
	for (;;) {
		int v = irq_take();
		if (v >= 0 || rdtsc() - t0 > ticks)
			return v;
		if (use_iommu)
			iommu_dma_poll();
		cpu_relax();
	}
}

int main(void)
{
	u64 len = param_u64("len", 4032), rounds = param_u64("rounds", 1);
	u64 timeout = param_u64("timeout_ms", 2000);
	int vector = param_u64("vector", 0x50);
	int bad = 0;

	if (!len || len >= EDU_BUF_SIZE) {
		printf("edu: len must be 1-4095\n");
		return 2;
	}
	if (edu_probe(&edu, 0))
		return 2;
	use_iommu = !strcmp(param_str("iommu", "none"), "vtd");
	if (use_iommu && iommu_dma_setup_for(edu.pci.bdf))
		return 2;

	u32 ident = edu_read(&edu, EDU_IDENT);
	edu_write(&edu, EDU_LIVENESS, 0x12345678);
	int live = edu_read(&edu, EDU_LIVENESS) == ~0x12345678u;
	s64 f = edu_factorial(&edu, 10, timeout);
	int fact = f == 3628800;
	bad |= (ident & 0xff) != 0xed || !live || !fact;

	/* DMA round trip */
	u8 *src = dma_alloc(4096, 4096), *dst = dma_alloc(4096, 4096);
	int dma_ok = 1;
	u64 t0 = rdtsc();
	for (u64 r = 0; r < rounds && dma_ok; r++) {
		for (u64 i = 0; i < len; i++) {
			src[i] = (u8)(i * 7 + r * 13 + 1);
			dst[i] = 0;
		}
		u64 a = map(src, len, DMA_TO_DEVICE);
		edu_dma_start(&edu, a, 0, len, 0, 0);
		if (dma_wait(timeout)) {
			printf("edu: DMA to the device timed out\n");
			dma_ok = 0;
		}
		unmap(a, len);
		u64 b = map(dst, len, DMA_FROM_DEVICE);
		edu_dma_start(&edu, b, 0, len, 1, 0);
		if (dma_wait(timeout)) {
			printf("edu: DMA to RAM timed out\n");
			dma_ok = 0;
		}
		unmap(b, len);
		for (u64 i = 0; i < len && dma_ok; i++) {
			if (dst[i] != src[i]) {
				printf("MISMATCH round=%lu offset=%lu expected=%#x got=%#x\n", r, i,
				       src[i], dst[i]);
				dma_ok = 0;
			}
		}
	}
	u64 t = rdtsc() - t0;
	char b[32];
	printf("edu dma rounds=%lu tsc=%lu rounds_per_s=%s\n", rounds, t,
	       dma_ok && tsc_khz() && t ? fmt_milli(b, rate_milli(rounds, t)) : "unknown");
	bad |= !dma_ok;

	/* MSI: raised by a register write, then at the end of a DMA */
	int irq_ok = 0, dma_irq_ok = 0;
	u64 tt = timeout * (tsc_khz() ? tsc_khz() : 3000000);
	if (!edu.msi_cap) {
		printf("edu: no MSI capability\n");
	} else {
		u64 addr = 0xfee00000u | (lapic_id() << 12);
		u32 data = vector;
		if (use_iommu && param_u64("irq_remap", 0)) {
			if (vtd_ir_enable(256, 0))
				return 2;
			vtd_irte_set(5, vector, lapic_id(), edu.pci.bdf);
			vtd_msi_remappable(5, &addr, &data);
			printf("edu: MSI through IRTE 5 (addr=%#lx data=%#x)\n", addr, data);
		}
		lapic_write(0xf0, 0x1ff);
		irq_enable();
		edu_msi_set(&edu, addr, data);
		edu_write(&edu, EDU_IRQ_RAISE, 0x1234);
		int v = wait_irq(tt);
		u32 st = edu_read(&edu, EDU_IRQ_STATUS);
		edu_write(&edu, EDU_IRQ_ACK, st);
		irq_ok = v == vector && st == 0x1234 && edu_read(&edu, EDU_IRQ_STATUS) == 0;
		if (!irq_ok)
			printf("edu: irq vector=%d (want %d) status=%#x\n", v, vector, st);

		u64 a = map(src, 64, DMA_TO_DEVICE);
		edu_dma_start(&edu, a, 0, 64, 0, 1);
		v = wait_irq(tt);
		dma_wait(timeout);
		unmap(a, 64);
		st = edu_read(&edu, EDU_IRQ_STATUS);
		edu_write(&edu, EDU_IRQ_ACK, st);
		dma_irq_ok = v == vector && st == EDU_IRQ_DMA;
		if (!dma_irq_ok)
			printf("edu: dma irq vector=%d (want %d) status=%#x\n", v, vector, st);
	}
	bad |= !irq_ok || !dma_irq_ok;

	if (use_iommu) {
		iommu_dma_drain();
		iommu_dma_report();
		bad |= iommu_stats.faults_seen != 0;
	}
	printf("edu ident=%#x liveness=%s factorial=%s dma=%s irq=%s dma_irq=%s\n", ident,
	       live ? "ok" : "BAD", fact ? "ok" : "BAD", dma_ok ? "ok" : "BAD",
	       irq_ok ? "ok" : "BAD", dma_irq_ok ? "ok" : "BAD");
	return bad ? 1 : 0;
}
