/* virtio 1.x modern PCI transport and split virtqueues (see virtio.h). */
#include "libcflat.h"
#include "virtio.h"

#define DMA_BASE_DEFAULT 0x800000	/* 8 MiB: above the image and per-CPU area */

static u64 dma_next, dma_limit;
int virtio_iommu, virtio_ir;

int virtio_iommu_setup(u16 sid)
{
	const char *m = param_str("iommu", "none");
	if (!strcmp(m, "none"))
		return 0;
	if (strcmp(m, "vtd")) {
		printf("virtio: iommu must be vtd or none\n");
		return -1;
	}
	if (iommu_dma_setup_for(sid))
		return -1;
	virtio_iommu = 1;
	if (param_u64("ir", 0)) {	/* MSI-X through IRTEs */
		if (vtd_ir_enable(256, 0))
			return -1;
		virtio_ir = 1;
		printf("virtio: interrupt remapping on: MSI-X entries in remappable format\n");
	}
	return 0;
}

/* program MSI-X entry e of v: compatibility format, or with ir=1 an IRTE
 * (next free index, source id checked) and the remappable format */
static void msix_set(struct virtio_dev *v, int e, u8 vector)
{
	static u32 next_irte = 16;
	if (!virtio_ir || next_irte >= vtd.irt_n) {
		pci_msix_set(&v->pci, e, v->apic_id, vector);
		return;
	}
	u32 idx = next_irte++;
	vtd_irte_set(idx, vector, v->apic_id, v->pci.bdf);
	u64 addr;
	u32 data;
	vtd_msi_remappable(idx, &addr, &data);
	u64 ent = v->pci.msix_table + 16 * e;
	mmio_write32(ent + 0, addr);
	mmio_write32(ent + 4, addr >> 32);
	mmio_write32(ent + 8, data);
}

void *dma_alloc(u64 size, u64 align)
{
	if (!dma_next) {
		dma_next = param_u64("dma_base", DMA_BASE_DEFAULT);
		dma_limit = ram_region_end(dma_next);
		if (!boot_memmap_entries)	/* no memory map: trust 64 MiB */
			dma_limit = 64 << 20;
	}
	if (align < 16)
		align = 16;
	u64 a = (dma_next + align - 1) & ~(align - 1);
	if (a + size > dma_limit) {
		printf("virtio: out of guest RAM for DMA (%#lx bytes at %#lx, RAM ends %#lx)\n",
		       size, a, dma_limit);
		exit(2);
	}
	dma_next = a + size;
	memset((void *)a, 0, size);
	return (void *)a;
}

u8 vc_read8(struct virtio_dev *v, u32 off) { return mmio_read8(v->common + off); }
u16 vc_read16(struct virtio_dev *v, u32 off) { return mmio_read16(v->common + off); }
u32 vc_read32(struct virtio_dev *v, u32 off) { return mmio_read32(v->common + off); }
void vc_write8(struct virtio_dev *v, u32 off, u8 x) { mmio_write8(v->common + off, x); }
void vc_write16(struct virtio_dev *v, u32 off, u16 x) { mmio_write16(v->common + off, x); }
void vc_write32(struct virtio_dev *v, u32 off, u32 x) { mmio_write32(v->common + off, x); }

u8 virtio_status(struct virtio_dev *v)
{
	return vc_read8(v, VC_STATUS);
}

static u64 tsc_per_ms(void)
{
	return tsc_khz() ? tsc_khz() : 3000000;
}

void virtio_reset(struct virtio_dev *v)
{
	vc_write8(v, VC_STATUS, 0);
	u64 t0 = rdtsc();
	while (virtio_status(v) != 0 && rdtsc() - t0 < 1000 * tsc_per_ms())
		cpu_relax();
}

static u64 mmio_window;

int virtio_probe(struct virtio_dev *v, u16 device_id, int index)
{
	memset(v, 0, sizeof(*v));
	if (pci_find(VIRTIO_VENDOR, device_id, index, &v->pci)) {
		struct pci_dev t;
		u16 legacy = device_id == VIRTIO_DEV_NET ? 0x1000 : 0x1001;
		if (!pci_find(VIRTIO_VENDOR, legacy, index, &t))
			printf("virtio: only a transitional device %04x:%04x (QEMU: disable-legacy=on)\n",
			       VIRTIO_VENDOR, legacy);
		else
			printf("virtio: no device %04x:%04x #%d\n", VIRTIO_VENDOR, device_id, index);
		return -1;
	}
	struct pci_dev *d = &v->pci;
	if (!mmio_window)
		mmio_window = param_u64("pci_mmio", 0xc0000000);
	int n = pci_assign_bars(d, &mmio_window);
	if (n)
		printf("virtio: %02x:%02x.%x: firmware left %d BAR(s) unassigned; assigned from %#lx\n",
		       d->bdf >> 8, (d->bdf >> 3) & 31, d->bdf & 7, n, param_u64("pci_mmio", 0xc0000000));
	pci_enable(d);

	for (u8 p = pci_find_cap(d->bdf, PCI_CAP_VENDOR, 0); p;
	     p = pci_find_cap(d->bdf, PCI_CAP_VENDOR, p)) {
		u8 type = pci_cfg_read8(d->bdf, p + 3);
		u8 bar = pci_cfg_read8(d->bdf, p + 4);
		u32 off = pci_cfg_read32(d->bdf, p + 8);
		u32 len = pci_cfg_read32(d->bdf, p + 12);
		if (bar > 5 || d->bar_io[bar] || !d->bar[bar])
			continue;
		u64 a = d->bar[bar] + off;
		switch (type) {
		case VIRTIO_PCI_CAP_COMMON:
			if (!v->common)
				v->common = a;
			break;
		case VIRTIO_PCI_CAP_NOTIFY:
			if (!v->notify) {
				v->notify = a;
				v->notify_mult = pci_cfg_read32(d->bdf, p + 16);
			}
			break;
		case VIRTIO_PCI_CAP_ISR:
			if (!v->isr)
				v->isr = a;
			break;
		case VIRTIO_PCI_CAP_DEVICE:
			if (!v->devcfg) {
				v->devcfg = a;
				v->devcfg_len = len;
			}
			break;
		}
	}
	if (!v->common || !v->notify) {
		printf("virtio: %04x: no common/notify capability (common=%#lx notify=%#lx)\n",
		       device_id, v->common, v->notify);
		return -1;
	}
	v->msix = pci_msix_init(d) == 0;
	v->apic_id = lapic_id();
	return 0;
}

int virtio_init(struct virtio_dev *v, u64 want)
{
	virtio_reset(v);
	vc_write8(v, VC_STATUS, VIRTIO_S_ACKNOWLEDGE);
	vc_write8(v, VC_STATUS, VIRTIO_S_ACKNOWLEDGE | VIRTIO_S_DRIVER);
	vc_write32(v, VC_DFSELECT, 0);
	u64 f = vc_read32(v, VC_DF);
	vc_write32(v, VC_DFSELECT, 1);
	f |= (u64)vc_read32(v, VC_DF) << 32;
	v->dev_features = f;
	if (!(f & (1ull << VIRTIO_F_VERSION_1))) {
		printf("virtio: device lacks VERSION_1 (features %#lx)\n", f);
		vc_write8(v, VC_STATUS, VIRTIO_S_FAILED);
		return -1;
	}
	if (virtio_iommu && !(f & (1ull << VIRTIO_F_ACCESS_PLATFORM))) {
		printf("virtio: iommu=vtd but the device does not offer ACCESS_PLATFORM (QEMU: "
		       "iommu_platform=on)\n");
		vc_write8(v, VC_STATUS, VIRTIO_S_FAILED);
		return -1;
	}
	want |= (1ull << VIRTIO_F_VERSION_1) | (1ull << VIRTIO_F_ACCESS_PLATFORM);
	v->features = f & want;
	vc_write32(v, VC_GFSELECT, 0);
	vc_write32(v, VC_GF, (u32)v->features);
	vc_write32(v, VC_GFSELECT, 1);
	vc_write32(v, VC_GF, v->features >> 32);
	vc_write8(v, VC_STATUS, VIRTIO_S_ACKNOWLEDGE | VIRTIO_S_DRIVER | VIRTIO_S_FEATURES_OK);
	u8 s = virtio_status(v);
	if (!(s & VIRTIO_S_FEATURES_OK)) {
		printf("virtio: FEATURES_OK not accepted (status %#x, features %#lx)\n", s,
		       v->features);
		vc_write8(v, VC_STATUS, VIRTIO_S_FAILED);
		return -1;
	}
	v->num_queues = vc_read16(v, VC_NUMQ);
	v->q = dma_alloc(sizeof(struct virtq) * (v->num_queues ? v->num_queues : 1), 64);
	vc_write16(v, VC_MSIX, VIRTIO_MSI_NO_VECTOR);
	return 0;
}

static void interrupts_on(void)
{
	static int done;
	if (done)
		return;
	done = 1;
	lapic_write(0xf0, 0x1ff);	/* SVR: APIC software-enabled, spurious 0xff */
	irq_enable();
}

int virtio_setup_queue(struct virtio_dev *v, int qi, u16 qsize, int poll)
{
	if (qi >= v->num_queues) {
		printf("virtio: queue %d of %u\n", qi, v->num_queues);
		return -1;
	}
	struct virtq *q = &v->q[qi];
	memset(q, 0, sizeof(*q));
	vc_write16(v, VC_Q_SELECT, qi);
	u16 max = vc_read16(v, VC_Q_SIZE);
	if (!max) {
		printf("virtio: queue %d not available\n", qi);
		return -1;
	}
	u16 size = qsize && qsize < max ? qsize : max;
	while (size & (size - 1))	/* largest power of two <= size */
		size &= size - 1;
	q->index = qi;
	q->size = size;
	q->poll = poll;
	q->event_idx = virtio_has(v, VIRTIO_F_EVENT_IDX);
	q->desc = dma_alloc(16ul * size, 4096);
	q->avail = dma_alloc(6 + 2ul * size, 4096);
	q->used = dma_alloc(6 + 8ul * size, 4096);
	for (u16 i = 0; i < size; i++)
		q->desc[i].next = i + 1 < size ? i + 1 : 0;
	q->free_head = 0;
	q->num_free = size;
	/* rings: mapped once, for the life of the queue (the used ring both ways:
	 * devices read back its flags) */
	q->desc_iova = vmap(q->desc, 16ul * size, DMA_TO_DEVICE);
	q->avail_iova = vmap(q->avail, 6 + 2ul * size, DMA_TO_DEVICE);
	q->used_iova = vmap((void *)q->used, 6 + 8ul * size, DMA_BIDIR);
	if (!q->desc_iova || !q->avail_iova || !q->used_iova)
		return -1;
	vc_write16(v, VC_Q_SIZE, size);
	vc_write32(v, VC_Q_DESCLO, q->desc_iova);
	vc_write32(v, VC_Q_DESCHI, q->desc_iova >> 32);
	vc_write32(v, VC_Q_AVAILLO, q->avail_iova);
	vc_write32(v, VC_Q_AVAILHI, q->avail_iova >> 32);
	vc_write32(v, VC_Q_USEDLO, q->used_iova);
	vc_write32(v, VC_Q_USEDHI, q->used_iova >> 32);

	q->msix_entry = VIRTIO_MSI_NO_VECTOR;
	q->vector = -1;
	if (!poll && v->msix && qi + 1 < v->pci.msix_size && VIRTIO_IRQ_BASE + qi + 1 < 0xff) {
		u16 e = qi + 1;
		msix_set(v, e, VIRTIO_IRQ_BASE + e);
		pci_msix_mask(&v->pci, e, 0);
		vc_write16(v, VC_Q_MSIX, e);
		if (vc_read16(v, VC_Q_MSIX) == e) {
			q->msix_entry = e;
			q->vector = VIRTIO_IRQ_BASE + e;
			interrupts_on();
		} else {
			printf("virtio: queue %d: device refused MSI-X vector %u\n", qi, e);
		}
	} else {
		vc_write16(v, VC_Q_MSIX, VIRTIO_MSI_NO_VECTOR);
	}
	if (!poll && q->vector < 0)
		printf("virtio: queue %d: no interrupt (MSI-X %s); polling\n", qi,
		       v->msix ? "vector refused" : "absent");
	if (poll || q->vector < 0) {
		q->poll = 1;
		q->avail->flags = VRING_AVAIL_F_NO_INTERRUPT;
		q->avail->ring[size] = (u16)-1;	/* used_event: never reached */
	}
	u16 noff = vc_read16(v, VC_Q_NOFF);
	q->notify_addr = v->notify + (u64)noff * v->notify_mult;
	vc_write16(v, VC_Q_ENABLE, 1);
	return 0;
}

void virtio_driver_ok(struct virtio_dev *v)
{
	vc_write8(v, VC_STATUS, VIRTIO_S_ACKNOWLEDGE | VIRTIO_S_DRIVER | VIRTIO_S_FEATURES_OK |
				       VIRTIO_S_DRIVER_OK);
}

int vq_alloc_chain(struct virtq *q, int n)
{
	if (n <= 0 || q->num_free < n)
		return -1;
	u16 head = q->free_head, d = head;
	for (int i = 0; i < n; i++) {
		q->desc[d].flags = i + 1 < n ? VRING_DESC_F_NEXT : 0;
		if (i + 1 < n)
			d = q->desc[d].next;
	}
	q->free_head = q->desc[d].next;
	q->num_free -= n;
	return head;
}

void vq_free_chain(struct virtq *q, u16 head)
{
	u16 d = head;
	int n = 1;
	while ((q->desc[d].flags & VRING_DESC_F_NEXT) && n < q->size) {
		d = q->desc[d].next;
		n++;
	}
	q->desc[d].next = q->free_head;
	q->desc[d].flags = 0;
	q->free_head = head;
	q->num_free += n;
}

void vq_push(struct virtq *q, u16 head)
{
	q->avail->ring[q->avail_idx & (q->size - 1)] = head;
	q->avail_idx++;
}

static int need_event(u16 event, u16 new_idx, u16 old)
{
	return (u16)(new_idx - event - 1) < (u16)(new_idx - old);
}

int vq_kick(struct virtq *q)
{
	barrier();			/* ring entries before idx (x86: stores in order) */
	*(volatile u16 *)&q->avail->idx = q->avail_idx;
	mb();				/* idx visible before reading the device's hints */
	u16 old = q->kicked_idx, new_idx = q->avail_idx;
	q->kicked_idx = new_idx;
	int kick;
	if (q->event_idx)
		kick = need_event(*(volatile u16 *)((u64)q->used + 4 + 8ul * q->size), new_idx, old);
	else
		kick = !(q->used->flags & VRING_USED_F_NO_NOTIFY);
	if (kick) {
		mmio_write16(q->notify_addr, q->index);
		q->kicks++;
	} else {
		q->kicks_suppressed++;
	}
	return kick;
}

int vq_pop(struct virtq *q, u32 *len)
{
	if (q->used->idx == q->last_used)
		return -1;
	barrier();			/* idx before the element (x86: loads in order) */
	volatile struct vring_used_elem *e = &q->used->ring[q->last_used & (q->size - 1)];
	u32 id = e->id;
	if (len)
		*len = e->len;
	q->last_used++;
	if (q->poll && q->event_idx)	/* keep used_event behind us: no interrupt */
		*(volatile u16 *)&q->avail->ring[q->size] = q->last_used - 1;
	return id;
}

int vq_arm(struct virtq *q)
{
	if (q->poll) {
		if (q->event_idx)
			*(volatile u16 *)&q->avail->ring[q->size] = q->last_used - 1;
		return vq_has_used(q);
	}
	if (q->event_idx)
		*(volatile u16 *)&q->avail->ring[q->size] = q->last_used;
	else
		q->avail->flags = 0;
	mb();
	return vq_has_used(q);
}

u64 rate_milli(u64 n, u64 tsc)
{
	u64 ns = tsc_to_ns(tsc);
	if (!ns)
		return 0;
	if (n < 18000000)
		return n * 1000000000000ull / ns;
	return n * 1000000000ull / ns * 1000;
}
