/* QEMU edu device driver (see edu.h). */
#include "libcflat.h"
#include "edu.h"

u32 edu_read(struct edu_dev *e, u32 reg)
{
	return mmio_read32(e->mmio + reg);
}

/* 32-bit accesses only: QEMU's edu takes 4-byte writes everywhere (a
 * 4-byte write to a DMA register sets the whole 64-bit field), and every
 * bus address we use is below 4 GiB (QEMU's edu masks them to 28 bits). */
void edu_write(struct edu_dev *e, u32 reg, u32 v)
{
	mmio_write32(e->mmio + reg, v);
}

int edu_probe(struct edu_dev *e, int index)
{
	memset(e, 0, sizeof(*e));
	if (pci_find(EDU_VENDOR, EDU_DEVICE, index, &e->pci)) {
		printf("edu: no device %04x:%04x #%d (QEMU: -device edu; Lucid: --device edu)\n",
		       EDU_VENDOR, EDU_DEVICE, index);
		return -1;
	}
	u64 window = param_u64("pci_mmio", 0xc0000000);
	if (pci_assign_bars(&e->pci, &window))
		printf("edu: firmware left BAR0 unassigned; assigned %#lx\n", e->pci.bar[0]);
	if (!e->pci.bar[0] || e->pci.bar_io[0]) {
		printf("edu: BAR0 unusable (%#lx)\n", e->pci.bar[0]);
		return -1;
	}
	e->mmio = e->pci.bar[0];
	pci_enable(&e->pci);
	e->msi_cap = pci_find_cap(e->pci.bdf, PCI_CAP_MSI, 0);
	return 0;
}

static u64 ms_ticks(u64 ms)
{
	return ms * (tsc_khz() ? tsc_khz() : 3000000);
}

s64 edu_factorial(struct edu_dev *e, u32 n, u64 timeout_ms)
{
	edu_write(e, EDU_FACTORIAL, n);
	u64 t0 = rdtsc(), lim = ms_ticks(timeout_ms);
	while (edu_read(e, EDU_STATUS) & EDU_STATUS_COMPUTING) {
		if (rdtsc() - t0 > lim)
			return -1;
		cpu_relax();
	}
	return edu_read(e, EDU_FACTORIAL);
}

void edu_dma_start(struct edu_dev *e, u64 bus, u32 off, u32 len, int to_ram, int irq)
{
	u64 dev = EDU_BUF_ADDR + off;
	edu_write(e, EDU_DMA_SRC, to_ram ? dev : bus);
	edu_write(e, EDU_DMA_DST, to_ram ? bus : dev);
	edu_write(e, EDU_DMA_COUNT, len);
	edu_write(e, EDU_DMA_CMD, EDU_DMA_START | (to_ram ? EDU_DMA_TO_RAM : 0) |
				  (irq ? EDU_DMA_IRQ : 0));
}

int edu_dma_wait(struct edu_dev *e, u64 timeout_ms)
{
	u64 t0 = rdtsc(), lim = ms_ticks(timeout_ms);
	while (edu_read(e, EDU_DMA_CMD) & EDU_DMA_START) {
		if (rdtsc() - t0 > lim)
			return -1;
		cpu_relax();
	}
	return 0;
}

int edu_msi_set(struct edu_dev *e, u64 addr, u32 data)
{
	return pci_msi_set(&e->pci, e->msi_cap, addr, data);
}

void edu_msi_disable(struct edu_dev *e)
{
	if (e->msi_cap)
		pci_cfg_write16(e->pci.bdf, e->msi_cap + 2,
				pci_cfg_read16(e->pci.bdf, e->msi_cap + 2) & ~1u);
}
