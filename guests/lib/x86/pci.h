/*
 * PCI for probe guests: configuration space through ports 0xCF8/0xCFC
 * (32-bit dword accesses only, from CPL3 through the TSS I/O bitmap), or
 * ECAM from the ACPI MCFG table when the ports find no host bridge (param
 * pci=auto|cf8|ecam),
 * bus 0 enumeration, BARs as the firmware/VMM assigned them, the
 * capability list, and MSI-X (table in a memory BAR, identity-mapped).
 */
#ifndef LUCID_PCI_H
#define LUCID_PCI_H

#include "types.h"

#define PCI_BDF(b, d, f)	(((u32)(b) << 8) | ((u32)(d) << 3) | (u32)(f))

/* configuration header offsets */
#define PCI_VENDOR_ID		0x00
#define PCI_DEVICE_ID		0x02
#define PCI_COMMAND		0x04
#define PCI_STATUS		0x06
#define PCI_CLASS_REV		0x08
#define PCI_HEADER_TYPE		0x0e
#define PCI_BAR0		0x10
#define PCI_SUBSYS_ID		0x2e
#define PCI_CAP_PTR		0x34
#define PCI_INTERRUPT_LINE	0x3c

#define PCI_CMD_IO		0x0001
#define PCI_CMD_MEM		0x0002
#define PCI_CMD_MASTER		0x0004
#define PCI_CMD_INTX_DISABLE	0x0400
#define PCI_STATUS_CAP_LIST	0x0010

#define PCI_CAP_MSI		0x05
#define PCI_CAP_VENDOR		0x09
#define PCI_CAP_MSIX		0x11

#define PCI_MSIX_ENABLE		0x8000	/* message control bit 15 */
#define PCI_MSIX_MASKALL	0x4000	/* message control bit 14 */

struct pci_dev {
	u32 bdf;
	u16 vendor, device;
	u16 subsys_id;
	u8 class_code, subclass, prog_if, header_type;
	u64 bar[6];		/* base (memory or I/O), 0 when unassigned */
	u8 bar_io[6];		/* 1: I/O space BAR */
	u8 bar_64[6];		/* 1: low half of a 64-bit BAR (bar[i+1] is its high half) */
	/* MSI-X (pci_msix_init) */
	u8 msix_cap;		/* config offset of the MSI-X capability, 0 if none */
	u16 msix_size;		/* table entries */
	u64 msix_table, msix_pba;	/* addresses, 0 if the BAR is unassigned */
};

/* "cf8" or "ecam": the configuration mechanism in use */
const char *pci_cfg_mechanism(void);
u32 pci_cfg_read32(u32 bdf, u32 off);
u16 pci_cfg_read16(u32 bdf, u32 off);
u8 pci_cfg_read8(u32 bdf, u32 off);
void pci_cfg_write32(u32 bdf, u32 off, u32 v);
/* 8/16-bit writes are read-modify-write of the dword; PCI_STATUS's
 * write-1-to-clear bits are written as 0 */
void pci_cfg_write16(u32 bdf, u32 off, u16 v);
void pci_cfg_write8(u32 bdf, u32 off, u8 v);

/* 0 if a function answers at bdf (vendor != 0xffff), filling *d */
int pci_probe(u32 bdf, struct pci_dev *d);
/* every function on bus 0, up to max; returns the number found */
int pci_scan(struct pci_dev *out, int max);
/* the index-th function (0 = first) with vendor/device; 0 on success */
int pci_find(u16 vendor, u16 device, int index, struct pci_dev *d);
/* re-read the BARs into d (after a BAR write) */
void pci_read_bars(struct pci_dev *d);
/* size of BAR i (probes with all ones, memory decode off, then restores) */
u64 pci_bar_size(struct pci_dev *d, int i);
/* config offset of the first capability with id after offset `after`
 * (0: from the start of the list), 0 if none; loop-safe */
u8 pci_find_cap(u32 bdf, u8 id, u8 after);
/* memory space + bus master (+ I/O if it has I/O BARs), INTx off */
void pci_enable(struct pci_dev *d);
/* give unassigned (0) or above-4-GiB memory BARs an address in
 * [*window, ...): only for firmware that leaves BARs alone (qboot);
 * returns the number of BARs assigned */
int pci_assign_bars(struct pci_dev *d, u64 *window);

/* MSI-X: find the capability and table; all entries masked, function
 * masked, MSI-X enabled. -1 if the device has no MSI-X */
int pci_msix_init(struct pci_dev *d);
/* program entry: fixed delivery of vector to the CPU with apic_id */
void pci_msix_set(struct pci_dev *d, int entry, u32 apic_id, u8 vector);
void pci_msix_mask(struct pci_dev *d, int entry, int masked);
/* set/clear message control bits (PCI_MSIX_ENABLE, PCI_MSIX_MASKALL) */
void pci_msix_ctrl(struct pci_dev *d, u16 set, u16 clear);
/* pending bit of entry in the PBA */
int pci_msix_pending(struct pci_dev *d, int entry);
/* plain MSI through the capability at cap: program address/data (one
 * vector) and enable it; -1 if cap is 0 */
int pci_msi_set(struct pci_dev *d, u8 cap, u64 addr, u32 data);

#endif
