/*
 * Driver for QEMU's `edu` teaching device (PCI 1234:11e8; QEMU
 * docs/specs/edu.rst), which Lucid also offers (`--device edu`): an
 * identification and liveness register, a factorial unit, an interrupt
 * raise/ack pair, MSI, and a DMA engine between guest memory (at a bus
 * address: an IOVA when an IOMMU translates) and a 4 KiB device buffer
 * at device address 0x40000. The probe guests aim its DMA at chosen IOVAs.
 */
#ifndef LUCID_EDU_H
#define LUCID_EDU_H

#include "types.h"
#include "pci.h"

#define EDU_VENDOR		0x1234
#define EDU_DEVICE		0x11e8

#define EDU_IDENT		0x00	/* 0xRRrr00ed: major, minor, 0xed */
#define EDU_LIVENESS		0x04	/* reads back ~written */
#define EDU_FACTORIAL		0x08
#define EDU_STATUS		0x20	/* bit 0 computing, bit 7 irq after factorial */
#define EDU_IRQ_STATUS		0x24
#define EDU_IRQ_RAISE		0x60
#define EDU_IRQ_ACK		0x64
#define EDU_DMA_SRC		0x80
#define EDU_DMA_DST		0x88
#define EDU_DMA_COUNT		0x90
#define EDU_DMA_CMD		0x98

#define EDU_STATUS_COMPUTING	0x01
#define EDU_STATUS_IRQFACT	0x80
#define EDU_DMA_START		0x01
#define EDU_DMA_TO_RAM		0x02	/* direction: device buffer -> RAM */
#define EDU_DMA_IRQ		0x04	/* raise irq 0x100 when done */
#define EDU_IRQ_DMA		0x100
#define EDU_IRQ_FACT		0x001

#define EDU_BUF_ADDR		0x40000	/* device address of the buffer */
#define EDU_BUF_SIZE		4096

struct edu_dev {
	struct pci_dev pci;
	u64 mmio;		/* BAR0 */
	u8 msi_cap;		/* 0: no MSI capability */
};

/* find the index-th edu, assign BAR0 if the firmware did not, enable
 * memory space and bus mastering; 0 on success */
int edu_probe(struct edu_dev *e, int index);
u32 edu_read(struct edu_dev *e, u32 reg);
void edu_write(struct edu_dev *e, u32 reg, u32 v);
/* ~1 ms granularity timeouts; -1 on timeout, else the result */
s64 edu_factorial(struct edu_dev *e, u32 n, u64 timeout_ms);
/* start a DMA of len bytes between bus address `bus` and device offset
 * `off` in the buffer; to_ram: device -> RAM. irq: raise EDU_IRQ_DMA at the end.
 * Does not wait. */
void edu_dma_start(struct edu_dev *e, u64 bus, u32 off, u32 len, int to_ram, int irq);
/* wait until the DMA engine is idle; 0 done, -1 timeout */
int edu_dma_wait(struct edu_dev *e, u64 timeout_ms);
/* program and enable MSI with this address/data (compatibility or
 * remappable format); -1 if the device has no MSI capability */
int edu_msi_set(struct edu_dev *e, u64 addr, u32 data);
void edu_msi_disable(struct edu_dev *e);

#endif
