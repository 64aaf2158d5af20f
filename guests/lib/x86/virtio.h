/*
 * A virtio 1.x modern PCI driver for probe guests (virtio 1.1, 4.1.4),
 * split virtqueues, running at CPL3. Memory for rings and buffers comes
 * from a bump allocator in guest RAM (identity map: physical == virtual).
 *
 * Interrupts: MSI-X entry 0 is the config vector (VIRTIO_MSI_NO_VECTOR
 * unless asked), entry q+1 is queue q, delivered to this CPU's LAPIC on
 * vector VIRTIO_IRQ_BASE + entry into the kit's CPL0 trampoline.
 * Polling: interrupts suppressed (VRING_AVAIL_F_NO_INTERRUPT, or with
 * EVENT_IDX a used_event that is never reached), the used ring spun on.
 * With EVENT_IDX the driver kicks only when avail_event says so, else only
 * when VRING_USED_F_NO_NOTIFY is clear; `kicks` counts notify writes.
 */
#ifndef LUCID_VIRTIO_H
#define LUCID_VIRTIO_H

#include "types.h"
#include "pci.h"
#include "iommu_dma.h"

#define VIRTIO_VENDOR		0x1af4
#define VIRTIO_DEV_NET		0x1041
#define VIRTIO_DEV_BLK		0x1042

/* device status */
#define VIRTIO_S_ACKNOWLEDGE	0x01
#define VIRTIO_S_DRIVER		0x02
#define VIRTIO_S_DRIVER_OK	0x04
#define VIRTIO_S_FEATURES_OK	0x08
#define VIRTIO_S_NEEDS_RESET	0x40
#define VIRTIO_S_FAILED		0x80

/* feature bits */
#define VIRTIO_F_INDIRECT_DESC	28
#define VIRTIO_F_EVENT_IDX	29
#define VIRTIO_F_VERSION_1	32
#define VIRTIO_F_ACCESS_PLATFORM 33
#define VIRTIO_F_RING_PACKED	34
#define VIRTIO_BLK_F_SIZE_MAX	1
#define VIRTIO_BLK_F_SEG_MAX	2
#define VIRTIO_BLK_F_RO		5
#define VIRTIO_BLK_F_BLK_SIZE	6
#define VIRTIO_BLK_F_FLUSH	9
#define VIRTIO_BLK_F_DISCARD	13
#define VIRTIO_BLK_F_WRITE_ZEROES 14
#define VIRTIO_NET_F_MAC	5
#define VIRTIO_NET_F_STATUS	16

/* virtio-blk requests: the header, then data, then a status byte the device writes */
#define BLK_T_IN		0
#define BLK_T_OUT		1
#define BLK_T_FLUSH		4
#define BLK_T_GET_ID		8
#define BLK_T_DISCARD		11
#define BLK_T_WRITE_ZEROES	13

struct blk_hdr {
	u32 type;
	u32 reserved;
	u64 sector;
};

/* the data of a DISCARD / WRITE_ZEROES request: one per range */
struct blk_dwz {
	u64 sector;
	u32 num_sectors;
	u32 flags;
};

/* PCI vendor capability cfg_type */
#define VIRTIO_PCI_CAP_COMMON	1
#define VIRTIO_PCI_CAP_NOTIFY	2
#define VIRTIO_PCI_CAP_ISR	3
#define VIRTIO_PCI_CAP_DEVICE	4
#define VIRTIO_PCI_CAP_PCI_CFG	5

/* common configuration offsets */
#define VC_DFSELECT	0x00
#define VC_DF		0x04
#define VC_GFSELECT	0x08
#define VC_GF		0x0c
#define VC_MSIX		0x10
#define VC_NUMQ		0x12
#define VC_STATUS	0x14
#define VC_CFGGEN	0x15
#define VC_Q_SELECT	0x16
#define VC_Q_SIZE	0x18
#define VC_Q_MSIX	0x1a
#define VC_Q_ENABLE	0x1c
#define VC_Q_NOFF	0x1e
#define VC_Q_DESCLO	0x20
#define VC_Q_DESCHI	0x24
#define VC_Q_AVAILLO	0x28
#define VC_Q_AVAILHI	0x2c
#define VC_Q_USEDLO	0x30
#define VC_Q_USEDHI	0x34

#define VIRTIO_MSI_NO_VECTOR	0xffff
#define VIRTIO_IRQ_BASE		0x40	/* CPU vector of MSI-X entry 0 */

/* split ring */
#define VRING_DESC_F_NEXT	1
#define VRING_DESC_F_WRITE	2
#define VRING_DESC_F_INDIRECT	4
#define VRING_AVAIL_F_NO_INTERRUPT 1
#define VRING_USED_F_NO_NOTIFY	1

struct vring_desc {
	u64 addr;
	u32 len;
	u16 flags;
	u16 next;
};

struct vring_avail {
	u16 flags;
	u16 idx;
	u16 ring[];	/* size entries, then used_event */
};

struct vring_used_elem {
	u32 id;
	u32 len;
};

struct vring_used {
	u16 flags;
	u16 idx;
	struct vring_used_elem ring[];	/* size entries, then avail_event */
};

struct virtq {
	u16 index, size;
	u16 msix_entry;			/* VIRTIO_MSI_NO_VECTOR if none */
	int vector;			/* CPU vector, -1 if none */
	struct vring_desc *desc;
	struct vring_avail *avail;
	volatile struct vring_used *used;
	u64 notify_addr;
	u16 free_head, num_free;
	u16 avail_idx;			/* next avail->idx to publish */
	u16 kicked_idx;			/* avail idx at the last kick decision */
	u16 last_used;
	int event_idx, poll;
	u64 kicks, kicks_suppressed;
	u64 desc_iova, avail_iova, used_iova;	/* bus addresses given to the device */
};

struct virtio_dev {
	struct pci_dev pci;
	u64 common, notify, isr, devcfg;	/* addresses, 0 if absent */
	u32 notify_mult, devcfg_len;
	u64 dev_features, features;
	u16 num_queues;
	u32 apic_id;
	struct virtq *q;		/* num_queues entries once set up */
	int msix;			/* MSI-X usable */
};

/*
 * DMA through the VT-d (the guests' `iommu=vtd`): set by the guest after
 * iommu_dma_setup_for(); virtio_init then requires ACCESS_PLATFORM, the
 * rings are mapped once in virtio_setup_queue, and drivers map every
 * buffer with vmap() and unmap it with vunmap() on completion. When 0
 * vmap() is the identity and vunmap() does nothing.
 */
extern int virtio_iommu;
/* ir=1 with iommu=vtd: interrupt remapping on, queue MSI-X entries go
 * through IRTEs (index 16 up, source id checked) in remappable format */
extern int virtio_ir;
static inline u64 vmap(const void *p, u64 len, int dir)
{
	return virtio_iommu ? iommu_map((u64)p, len, dir) : (u64)p;
}
static inline void vunmap(u64 iova, u64 len)
{
	if (virtio_iommu)
		iommu_unmap(iova, len);
}
/* iommu=vtd on the command line: set up the unit and strategy= for the
 * device at sid and set virtio_iommu; 0 when not asked or done, -1 error */
int virtio_iommu_setup(u16 sid);

/* bump allocator: zeroed, aligned memory in guest RAM (from 8 MiB by
 * default, param `dma_base`). Exits the guest (code 2) when RAM runs out. */
void *dma_alloc(u64 size, u64 align);

/* common config accessors */
u8 vc_read8(struct virtio_dev *v, u32 off);
u16 vc_read16(struct virtio_dev *v, u32 off);
u32 vc_read32(struct virtio_dev *v, u32 off);
void vc_write8(struct virtio_dev *v, u32 off, u8 x);
void vc_write16(struct virtio_dev *v, u32 off, u16 x);
void vc_write32(struct virtio_dev *v, u32 off, u32 x);
u8 virtio_status(struct virtio_dev *v);

/*
 * Find the index-th modern virtio function with this PCI device id, make
 * its BARs usable (assigning them if the firmware did not), enable memory
 * space + bus master, locate the four capabilities and MSI-X. 0 on success;
 * prints "virtio: ..." and returns -1 otherwise.
 */
int virtio_probe(struct virtio_dev *v, u16 device_id, int index);
/*
 * Reset, ACKNOWLEDGE|DRIVER, negotiate: VERSION_1 (required) and, of
 * `want`, what the device offers; ACCESS_PLATFORM is accepted if offered.
 * FEATURES_OK is checked. 0 on success.
 */
int virtio_init(struct virtio_dev *v, u64 want);
static inline int virtio_has(struct virtio_dev *v, int bit)
{
	return (v->features >> bit) & 1;
}
/*
 * Set up queue q with size min(device max, qsize) (power of two),
 * and an MSI-X vector unless poll. 0 on success.
 */
int virtio_setup_queue(struct virtio_dev *v, int q, u16 qsize, int poll);
void virtio_driver_ok(struct virtio_dev *v);
/* reset the device (status 0) and wait until it reads back 0 */
void virtio_reset(struct virtio_dev *v);

/* ---- queue operations ---- */
/* take n chained free descriptors; head index, or -1 if fewer are free */
int vq_alloc_chain(struct virtq *q, int n);
/* put the chain starting at head back on the free list */
void vq_free_chain(struct virtq *q, u16 head);
/* add head to the avail ring (not yet visible to notification logic) */
void vq_push(struct virtq *q, u16 head);
/* publish pushed entries and notify the device unless it suppresses
 * notifications; returns 1 if a kick was written */
int vq_kick(struct virtq *q);
/* next used element (id, len) or -1 when none */
int vq_pop(struct virtq *q, u32 *len);
/* poll mode: keep interrupts suppressed; irq mode: ask for the next one.
 * Returns 1 if used entries are pending (check again before waiting). */
int vq_arm(struct virtq *q);
static inline int vq_has_used(struct virtq *q)
{
	return q->used->idx != q->last_used;
}
/* n events in tsc ticks -> events per second x 1000 (0 if TSC unknown) */
u64 rate_milli(u64 n, u64 tsc);

static inline void mb(void)
{
	asm volatile("mfence" ::: "memory");
}

#endif
