/*
 * virtio-evil: a hostile virtio driver. Against the first virtio-blk
 * (and virtio-net, when present) function it builds broken descriptor
 * chains, bad queue configurations, MSI-X garbage, odd BAR values and
 * random common-config writes. Between cases the device is reset and set
 * up again (queue size 16, polling). After each case it reads the device
 * status and prints one line "evil: <case>: <what happened>", e.g.
 *   completed status=S        the request completed (S: virtio-blk status)
 *   needs reset (status 0x..) the device set DEVICE_NEEDS_RESET
 *   no completion (timeout)   nothing within timeout_ms
 * plus "buffer untouched" / "BUFFER WRITTEN" where the device must not
 * write a buffer. Every wait has a TSC timeout. The guest never points the
 * device at its own code or data: bad addresses are outside RAM, good ones
 * are scratch buffers. It ends with a sanity request on a fresh setup
 * ("evil: final: ...") and "virtio-evil: survived", exit 0.
 *
 * Params: timeout_ms=1000, seed=1, blk=1, net=1 (skip a device with 0),
 * rounds=200 (random common-config writes), skip=case1,case2 (cases not
 * to run: QEMU 7.2 aborts on net-tx-no-header, an iov_copy assertion).
 */
#include "libcflat.h"
#include "virtio.h"

#define FAR_ADDR	0xfff000000000ull	/* outside any guest memory */
#define QSZ		16

static struct virtio_dev blk, net;
static u64 timeout_tsc;
static u8 *scratch;		/* 64 KiB: hdr @0, status @64, data @4096, canary */
static u64 rng_state;
static int have_net;

static u64 rng(void)
{
	rng_state ^= rng_state << 13;
	rng_state ^= rng_state >> 7;
	rng_state ^= rng_state << 17;
	return rng_state;
}

#define HDR	((struct blk_hdr *)scratch)
#define STATUS	(scratch + 64)
#define DATA	(scratch + 4096)

/* reset + features + queues (polling, size QSZ) + DRIVER_OK */
static int setup(struct virtio_dev *v, int nq)
{
	if (virtio_init(v, 0))
		return -1;
	for (int i = 0; i < nq; i++)
		if (virtio_setup_queue(v, i, QSZ, 1))
			return -1;
	virtio_driver_ok(v);
	return 0;
}

static u16 raw_kicks;

/* put head on the avail ring and notify, whatever the device hints */
static void raw_submit(struct virtq *q, u16 head)
{
	q->avail->ring[q->avail_idx % q->size] = head;
	q->avail_idx++;
	barrier();
	*(volatile u16 *)&q->avail->idx = q->avail_idx;
	mb();
	mmio_write16(q->notify_addr, q->index);
	raw_kicks++;
}

static void notify(struct virtq *q)
{
	mmio_write16(q->notify_addr, q->index);
}

/* outcome of the last request on q: completed, needs reset or timeout */
static const char *outcome(struct virtio_dev *v, struct virtq *q, char *buf, int size)
{
	u64 t0 = rdtsc(), last_status = t0;
	u8 st = virtio_status(v);
	for (;;) {
		if (vq_has_used(q)) {
			u32 len;
			int id = vq_pop(q, &len);
			if (v == &blk)
				snprintf(buf, size, "completed id=%d len=%u status=%u (device status %#x)",
					 id, len, *STATUS, virtio_status(v));
			else
				snprintf(buf, size, "completed id=%d len=%u (device status %#x)", id, len,
					 virtio_status(v));
			return buf;
		}
		if (rdtsc() - last_status > timeout_tsc / 100) {
			st = virtio_status(v);
			last_status = rdtsc();
			if (st == 0xff) {
				snprintf(buf, size, "device unreachable (status reads 0xff)");
				return buf;
			}
			if (st & VIRTIO_S_NEEDS_RESET) {
				snprintf(buf, size, "needs reset (status %#x)", st);
				return buf;
			}
		}
		if (rdtsc() - t0 > timeout_tsc) {
			snprintf(buf, size, "no completion (timeout) (device status %#x)",
				 virtio_status(v));
			return buf;
		}
		cpu_relax();
	}
}

static void canary(u8 *p, u64 n)
{
	memset(p, 0xa5, n);
}

static const char *canary_ok(const u8 *p, u64 n)
{
	for (u64 i = 0; i < n; i++)
		if (p[i] != 0xa5)
			return "BUFFER WRITTEN";
	return "buffer untouched";
}

/* is case c in the comma-separated `skip=` list? */
static int skipped(const char *c)
{
	return list_has(param_str("skip", ""), c);
}

static void report(const char *c, const char *what)
{
	printf("evil: %s: %s\n", c, what);
}

/* ---- broken descriptor chains on virtio-blk ---- */

enum { C_LOOP, C_SELF, C_FAR_DATA, C_FAR_HDR, C_FAR_STATUS, C_PAST_RAM, C_STRADDLE,
       C_ZERO_DATA, C_ZERO_HDR, C_ZERO_STATUS, C_RO_DATA, C_RO_STATUS, C_NO_STATUS,
       C_HDR_ONLY, C_HUGE_LEN, C_BAD_HEAD, C_IDX_JUMP, C_NEXT_OOB, C_SECTOR_OOB,
       C_BAD_TYPE, C_INDIRECT_FAR, C_INDIRECT_ODD, C_NCASES };
static const char *const chain_names[] = {
	"loop", "self-loop", "data-outside-memory", "header-outside-memory",
	"status-outside-memory", "data-past-ram-end", "data-straddles-ram-end",
	"zero-length-data", "zero-length-header", "zero-length-status",
	"read-into-read-only-data", "read-only-status", "missing-status", "header-only",
	"huge-length", "head-out-of-range", "avail-idx-jump", "next-out-of-range",
	"sector-beyond-capacity", "bad-request-type", "indirect-outside-memory",
	"indirect-odd-length",
};

static void blk_chain_case(int c, u64 ram_end)
{
	char buf[160], line[200];
	if (skipped(chain_names[c])) {
		report(chain_names[c], "skipped");
		return;
	}
	if (c == C_INDIRECT_FAR || c == C_INDIRECT_ODD) {
		if (!(blk.dev_features & (1ull << VIRTIO_F_INDIRECT_DESC))) {
			report(chain_names[c], "skipped (no INDIRECT_DESC)");
			return;
		}
		if (virtio_init(&blk, 1ull << VIRTIO_F_INDIRECT_DESC) ||
		    virtio_setup_queue(&blk, 0, QSZ, 1)) {
			report(chain_names[c], "setup failed");
			return;
		}
		virtio_driver_ok(&blk);
	} else if (setup(&blk, 1)) {
		report(chain_names[c], "setup failed");
		return;
	}
	struct virtq *q = &blk.q[0];
	struct vring_desc *d = q->desc;
	memset(scratch, 0, 4096);
	canary(DATA, 8192);
	HDR->type = 0;		/* read */
	HDR->sector = 0;
	*STATUS = 0xff;
	/* the well-formed read: 0 header, 1 data (write), 2 status (write) */
	d[0] = (struct vring_desc){ (u64)HDR, 16, VRING_DESC_F_NEXT, 1 };
	d[1] = (struct vring_desc){ (u64)DATA, 4096, VRING_DESC_F_NEXT | VRING_DESC_F_WRITE, 2 };
	d[2] = (struct vring_desc){ (u64)STATUS, 1, VRING_DESC_F_WRITE, 0 };
	int check_canary = 0;
	u16 head = 0;
	switch (c) {
	case C_LOOP: d[2].flags |= VRING_DESC_F_NEXT; d[2].next = 0; break;
	case C_SELF: d[1].next = 1; break;
	case C_FAR_DATA: d[1].addr = FAR_ADDR; break;
	case C_FAR_HDR: d[0].addr = FAR_ADDR; break;
	case C_FAR_STATUS: d[2].addr = FAR_ADDR; break;
	case C_PAST_RAM: d[1].addr = ram_end + 0x100000; break;
	case C_STRADDLE: d[1].addr = ram_end - 2048; break;
	case C_ZERO_DATA: d[1].len = 0; check_canary = 1; break;
	case C_ZERO_HDR: d[0].len = 0; break;
	case C_ZERO_STATUS: d[2].len = 0; break;
	case C_RO_DATA: d[1].flags = VRING_DESC_F_NEXT; check_canary = 1; break;
	case C_RO_STATUS: d[2].flags = 0; break;
	case C_NO_STATUS: d[1].flags = VRING_DESC_F_WRITE; break;
	case C_HDR_ONLY: d[0].flags = 0; break;
	case C_HUGE_LEN: d[1].len = 0xffffffff; break;
	case C_BAD_HEAD: head = 0x7fff; break;
	case C_NEXT_OOB: d[1].next = 0x1234; break;
	case C_SECTOR_OOB: HDR->sector = 0x7fffffffffffffffull; check_canary = 1; break;
	case C_BAD_TYPE: HDR->type = 0x7777; check_canary = 1; break;
	case C_INDIRECT_FAR:
		d[3] = (struct vring_desc){ FAR_ADDR, 48, VRING_DESC_F_INDIRECT, 0 };
		head = 3;
		break;
	case C_INDIRECT_ODD: {
		struct vring_desc *t = (struct vring_desc *)(scratch + 256);
		t[0] = d[0], t[1] = d[1], t[2] = d[2];
		d[3] = (struct vring_desc){ (u64)t, 47, VRING_DESC_F_INDIRECT, 0 };
		head = 3;
		break;
	}
	}
	if (c == C_IDX_JUMP) {
		q->avail->ring[0] = 0;
		q->avail_idx += 1000;
		barrier();
		q->avail->idx = q->avail_idx;
		mb();
		notify(q);
	} else {
		raw_submit(q, head);
	}
	const char *o = outcome(&blk, q, buf, sizeof(buf));
	snprintf(line, sizeof(line), "%s%s%s", o, check_canary ? ", " : "",
		 check_canary ? canary_ok(DATA, 8192) : "");
	report(chain_names[c], line);
}

/* ---- queue configuration ---- */

static void queue_case(const char *name, int kind)
{
	char buf[160], line[240];
	struct virtio_dev *v = &blk;
	if (skipped(name)) {
		report(name, "skipped");
		return;
	}
	if (virtio_init(v, 0)) {
		report(name, "setup failed");
		return;
	}
	vc_write16(v, VC_Q_SELECT, 0);
	u16 max = vc_read16(v, VC_Q_SIZE);
	/* rings for the largest size, in scratch-like fresh memory */
	u16 big = max > 4096 ? 4096 : max;
	struct vring_desc *desc = dma_alloc(16ul * big, 4096);
	struct vring_avail *avail = dma_alloc(6 + 2ul * big, 4096);
	struct vring_used *used = dma_alloc(6 + 8ul * big, 4096);
	u64 a_desc = (u64)desc, a_avail = (u64)avail, a_used = (u64)used;
	u16 size = QSZ;
	switch (kind) {
	case 0: size = 0; break;
	case 1: size = 3; break;
	case 2: size = max + 1; break;
	case 3: size = 0xffff; break;
	case 4: a_desc = FAR_ADDR; a_avail = FAR_ADDR + 0x10000; a_used = FAR_ADDR + 0x20000; break;
	case 5: a_used = FAR_ADDR; break;
	case 6: a_desc += 1; a_avail += 1; a_used += 2; break;
	case 7: a_used = 0xd0000000; break;	/* used ring in unassigned MMIO */
	}
	vc_write16(v, VC_Q_SIZE, size);
	u16 rb = vc_read16(v, VC_Q_SIZE);
	vc_write32(v, VC_Q_DESCLO, a_desc);
	vc_write32(v, VC_Q_DESCHI, a_desc >> 32);
	vc_write32(v, VC_Q_AVAILLO, a_avail);
	vc_write32(v, VC_Q_AVAILHI, a_avail >> 32);
	vc_write32(v, VC_Q_USEDLO, a_used);
	vc_write32(v, VC_Q_USEDHI, a_used >> 32);
	vc_write16(v, VC_Q_MSIX, VIRTIO_MSI_NO_VECTOR);
	vc_write16(v, VC_Q_ENABLE, 1);
	u16 en = vc_read16(v, VC_Q_ENABLE);
	virtio_driver_ok(v);
	/* one read request at ring slot 0 */
	memset(scratch, 0, 128);
	*STATUS = 0xff;
	desc[0] = (struct vring_desc){ (u64)HDR, 16, VRING_DESC_F_NEXT, 1 };
	desc[1] = (struct vring_desc){ (u64)DATA, 512, VRING_DESC_F_NEXT | VRING_DESC_F_WRITE, 2 };
	desc[2] = (struct vring_desc){ (u64)STATUS, 1, VRING_DESC_F_WRITE, 0 };
	avail->ring[0] = 0;
	barrier();
	avail->idx = 1;
	mb();
	u16 noff = vc_read16(v, VC_Q_NOFF);
	mmio_write16(v->notify + (u64)noff * v->notify_mult, 0);
	/* wait on our own used ring (it may not be the one the device uses) */
	struct virtq fake = { .size = size ? size : 1, .used = used };
	fake.last_used = 0;
	const char *o = outcome(v, &fake, buf, sizeof(buf));
	snprintf(line, sizeof(line), "size %u -> reads %u, enable=%u, %s", size, rb, en, o);
	report(name, line);
	virtio_reset(v);
}

/* ---- MSI-X ---- */

static void msix_cases(void)
{
	char buf[160], line[240];
	struct virtio_dev *v = &blk;
	if (!v->msix) {
		report("msix", "skipped (no MSI-X)");
		return;
	}
	/* out-of-range vector numbers */
	if (virtio_init(v, 0)) {
		report("msix-vector-range", "setup failed");
		return;
	}
	static const u16 vecs[] = { 0x7ff, 0x800, 0xfffe, 0 };
	for (u32 i = 0; i < ARRAY_SIZE(vecs); i++) {
		u16 val = i == 3 ? v->pci.msix_size : vecs[i];
		vc_write16(v, VC_Q_SELECT, 0);
		vc_write16(v, VC_Q_MSIX, val);
		u16 qr = vc_read16(v, VC_Q_MSIX);
		vc_write16(v, VC_MSIX, val);
		u16 cr = vc_read16(v, VC_MSIX);
		snprintf(line, sizeof(line), "queue_msix_vector=%#x reads %#x, msix_config=%#x reads %#x "
			 "(table size %u, device status %#x)", val, qr, val, cr, v->pci.msix_size,
			 virtio_status(v));
		report("msix-vector-range", line);
	}
	vc_write16(v, VC_Q_SELECT, 0x7fff);	/* a queue that does not exist */
	vc_write16(v, VC_Q_MSIX, 1);
	snprintf(line, sizeof(line), "queue_select=0x7fff: queue_size reads %u, queue_msix_vector "
		 "reads %#x (device status %#x)", vc_read16(v, VC_Q_SIZE), vc_read16(v, VC_Q_MSIX),
		 virtio_status(v));
	report("msix-vector-range", line);

	/* table garbage: random destinations and data, then a request that
	 * signals through entry 1; the guest polls for the completion */
	if (virtio_init(v, 0) || virtio_setup_queue(v, 0, QSZ, 1)) {
		report("msix-table-garbage", "setup failed");
		return;
	}
	u64 irq0 = this_cpu()->irq_count;
	for (int e = 0; e < v->pci.msix_size; e++) {
		u64 t = v->pci.msix_table + 16 * e;
		u32 r = rng();
		u64 addr;
		switch (r & 3) {
		case 0: addr = 0xfee00000u | (rng() & 0xff00c); break;	/* odd dest, RH/DM bits */
		case 1: addr = FAR_ADDR | (rng() & 0xffffc); break;
		case 2: addr = 0xd0000000u | (rng() & 0xffc); break;	/* unassigned MMIO */
		default: addr = 0xfee00003u; break;			/* unaligned */
		}
		/* data: vector 0x20-0xfe, fixed or lowest priority, reserved bits set */
		u32 data = (0x20 + rng() % 0xdf) | ((rng() & 1) << 8) | (rng() & 0xffff0000u) |
			   ((rng() & 1) << 15);
		mmio_write32(t, addr);
		mmio_write32(t + 4, addr >> 32);
		mmio_write32(t + 8, data);
		mmio_write32(t + 12, rng() & 1 ? 0 : 0xfffffffe);	/* unmask, reserved bits */
	}
	/* random writes into the PBA (read-only) */
	if (v->pci.msix_pba)
		mmio_write32(v->pci.msix_pba, 0xffffffff);
	vc_write16(v, VC_Q_SELECT, 0);
	vc_write16(v, VC_Q_MSIX, 1);
	vc_write16(v, VC_MSIX, 0);
	struct virtq *q = &v->q[0];
	q->avail->flags = 0;
	virtio_driver_ok(v);
	memset(scratch, 0, 128);
	*STATUS = 0xff;
	q->desc[0] = (struct vring_desc){ (u64)HDR, 16, VRING_DESC_F_NEXT, 1 };
	q->desc[1] = (struct vring_desc){ (u64)DATA, 512, VRING_DESC_F_NEXT | VRING_DESC_F_WRITE, 2 };
	q->desc[2] = (struct vring_desc){ (u64)STATUS, 1, VRING_DESC_F_WRITE, 0 };
	raw_submit(q, 0);
	const char *o = outcome(v, q, buf, sizeof(buf));
	udelay(1000);
	snprintf(line, sizeof(line), "%s, interrupts seen %lu", o, this_cpu()->irq_count - irq0);
	report("msix-table-garbage", line);
	/* MSI-X enable off while a vector is assigned, then a request */
	pci_msix_ctrl(&v->pci, 0, PCI_MSIX_ENABLE);
	*STATUS = 0xff;
	raw_submit(q, 0);
	o = outcome(v, q, buf, sizeof(buf));
	report("msix-disabled-with-vectors", o);
	pci_msix_ctrl(&v->pci, PCI_MSIX_ENABLE | PCI_MSIX_MASKALL, 0);
	for (int e = 0; e < v->pci.msix_size; e++)
		pci_msix_mask(&v->pci, e, 1);
	pci_msix_ctrl(&v->pci, 0, PCI_MSIX_MASKALL);
	virtio_reset(v);
	/* drain whatever garbage interrupts arrived */
	while (irq_take() >= 0)
		;
}

/* ---- BARs ---- */

/* a read on a fresh setup: "ok" if it completes with status 0 */
static const char *works(struct virtio_dev *v, char *buf, int size)
{
	if (setup(v, 1))
		return "setup failed";
	struct virtq *q = &v->q[0];
	memset(scratch, 0, 128);
	*STATUS = 0xff;
	q->desc[0] = (struct vring_desc){ (u64)HDR, 16, VRING_DESC_F_NEXT, 1 };
	q->desc[1] = (struct vring_desc){ (u64)DATA, 512, VRING_DESC_F_NEXT | VRING_DESC_F_WRITE, 2 };
	q->desc[2] = (struct vring_desc){ (u64)STATUS, 1, VRING_DESC_F_WRITE, 0 };
	raw_submit(q, 0);
	return outcome(v, q, buf, size);
}

static void relocate(struct virtio_dev *v, u64 old, u64 size, u64 delta)
{
	if (v->pci.msix_table >= old && v->pci.msix_table < old + size)
		v->pci.msix_table += delta;
	if (v->pci.msix_pba >= old && v->pci.msix_pba < old + size)
		v->pci.msix_pba += delta;
	/* the capability addresses move with their BARs */
	v->common += delta;
	v->notify += delta;
	if (v->isr)
		v->isr += delta;
	if (v->devcfg)
		v->devcfg += delta;
}

static void bar_cases(void)
{
	char buf[160], line[300];
	struct pci_dev *d = &blk.pci;
	int vb = -1;		/* BAR holding the common config */
	for (int i = 0; i < 6; i++)
		if (d->bar[i] && !d->bar_io[i] && blk.common >= d->bar[i] &&
		    blk.common < d->bar[i] + pci_bar_size(d, i))
			vb = i;
	if (vb < 0) {
		report("bar", "skipped (common config BAR not found)");
		return;
	}
	u32 off = PCI_BAR0 + 4 * vb;
	u32 orig_lo = pci_cfg_read32(d->bdf, off);
	u32 orig_hi = d->bar_64[vb] ? pci_cfg_read32(d->bdf, off + 4) : 0;
	u64 size = pci_bar_size(d, vb);
	struct {
		const char *name;
		u32 lo, hi;
	} cases[] = {
		{ "bar-all-ones", 0xffffffff, 0xffffffff },
		{ "bar-unaligned", orig_lo + 0x123, orig_hi },
		{ "bar-zero", 0, 0 },
		{ "bar-overlap-msix", 0, 0 },
		{ "bar-overlap-other-device", 0, 0 },
		{ "bar-over-lapic", 0xfee00000, 0 },
	};
	/* overlap the MSI-X table BAR (when it is another BAR) */
	for (int i = 0; i < 6; i++)
		if (i != vb && d->bar[i] && !d->bar_io[i])
			cases[3].lo = d->bar[i], cases[3].hi = d->bar[i] >> 32;
	if (have_net) {
		for (int i = 0; i < 6; i++)
			if (net.pci.bar[i] && !net.pci.bar_io[i])
				cases[4].lo = net.pci.bar[i], cases[4].hi = net.pci.bar[i] >> 32;
	}
	for (u32 c = 0; c < ARRAY_SIZE(cases); c++) {
		if ((c == 3 || c == 4) && !cases[c].lo) {
			report(cases[c].name, "skipped (nothing to overlap)");
			continue;
		}
		/* with memory decode on: the VMM must follow the move */
		pci_cfg_write32(d->bdf, off, cases[c].lo);
		if (d->bar_64[vb])
			pci_cfg_write32(d->bdf, off + 4, cases[c].hi);
		u32 rlo = pci_cfg_read32(d->bdf, off);
		u32 rhi = d->bar_64[vb] ? pci_cfg_read32(d->bdf, off + 4) : 0;
		/* touch the device at its new place if that is a sane address */
		u64 nb = ((u64)rhi << 32) | (rlo & ~0xfu);
		u8 st = 0xee;
		if (nb >= 0xc0000000ull && nb + size <= 0xfec00000ull && (c == 1 || c == 3 || c == 4))
			st = mmio_read8(nb + (blk.common - d->bar[vb]) + VC_STATUS);
		pci_cfg_write32(d->bdf, off, orig_lo);
		if (d->bar_64[vb])
			pci_cfg_write32(d->bdf, off + 4, orig_hi);
		const char *o = works(&blk, buf, sizeof(buf));
		snprintf(line, sizeof(line), "wrote %#x:%#x, reads %#x:%#x%s%s; restored: %s", cases[c].hi,
			 cases[c].lo, rhi, rlo, st != 0xee ? ", status at new place " : "",
			 st != 0xee ? (st == 0xff ? "0xff" : "read") : "", o);
		report(cases[c].name, line);
	}
	/* a legitimate move while the device runs: requests follow the BAR */
	/* 1 MiB above: past the BARs assigned from the same window */
	u64 nb = (d->bar[vb] + 0x100000) & ~(size - 1);
	if (setup(&blk, 1) == 0) {
		pci_cfg_write32(d->bdf, off, (u32)nb | (orig_lo & 0xf));
		if (d->bar_64[vb])
			pci_cfg_write32(d->bdf, off + 4, nb >> 32);
		u64 old = d->bar[vb];
		pci_read_bars(d);
		relocate(&blk, old, size, d->bar[vb] - old);
		/* the queue notify address moved too */
		struct virtq *q = &blk.q[0];
		q->notify_addr += d->bar[vb] - old;
		memset(scratch, 0, 128);
		*STATUS = 0xff;
		q->desc[0] = (struct vring_desc){ (u64)HDR, 16, VRING_DESC_F_NEXT, 1 };
		q->desc[1] = (struct vring_desc){ (u64)DATA, 512, VRING_DESC_F_NEXT | VRING_DESC_F_WRITE, 2 };
		q->desc[2] = (struct vring_desc){ (u64)STATUS, 1, VRING_DESC_F_WRITE, 0 };
		raw_submit(q, 0);
		const char *o = outcome(&blk, q, buf, sizeof(buf));
		snprintf(line, sizeof(line), "moved %#lx -> %#lx while running: %s", old, d->bar[vb], o);
		report("bar-move", line);
		/* move back */
		pci_cfg_write32(d->bdf, off, orig_lo);
		if (d->bar_64[vb])
			pci_cfg_write32(d->bdf, off + 4, orig_hi);
		u64 moved = d->bar[vb];
		pci_read_bars(d);
		relocate(&blk, moved, size, d->bar[vb] - moved);
	}
	/* memory decode off: device must not answer, then on again */
	u16 cmd = pci_cfg_read16(d->bdf, PCI_COMMAND);
	pci_cfg_write16(d->bdf, PCI_COMMAND, cmd & ~PCI_CMD_MEM);
	u32 r = mmio_read32(blk.common + VC_NUMQ - 2);
	pci_cfg_write16(d->bdf, PCI_COMMAND, cmd);
	snprintf(line, sizeof(line), "common config reads %#x with decode off; on again: %s", r,
		 works(&blk, buf, sizeof(buf)));
	report("bar-decode-off", line);
	/* bus master off: the device must not DMA */
	if (setup(&blk, 1) == 0) {
		pci_cfg_write16(d->bdf, PCI_COMMAND, cmd & ~PCI_CMD_MASTER);
		struct virtq *q = &blk.q[0];
		memset(scratch, 0, 128);
		*STATUS = 0xff;
		canary(DATA, 8192);
		q->desc[0] = (struct vring_desc){ (u64)HDR, 16, VRING_DESC_F_NEXT, 1 };
		q->desc[1] = (struct vring_desc){ (u64)DATA, 512, VRING_DESC_F_NEXT | VRING_DESC_F_WRITE, 2 };
		q->desc[2] = (struct vring_desc){ (u64)STATUS, 1, VRING_DESC_F_WRITE, 0 };
		raw_submit(q, 0);
		const char *o = outcome(&blk, q, buf, sizeof(buf));
		snprintf(line, sizeof(line), "%s, %s", o, canary_ok(DATA, 8192));
		pci_cfg_write16(d->bdf, PCI_COMMAND, cmd);
		report("bus-master-off", line);
	}
	pci_read_bars(d);
}

/* ---- device status sequence and random common-config writes ---- */

static void status_cases(void)
{
	char line[200];
	struct virtio_dev *v = &blk;
	virtio_reset(v);
	vc_write8(v, VC_STATUS, VIRTIO_S_ACKNOWLEDGE | VIRTIO_S_DRIVER | VIRTIO_S_DRIVER_OK);
	snprintf(line, sizeof(line), "DRIVER_OK without FEATURES_OK: status %#x", virtio_status(v));
	report("status-order", line);
	virtio_reset(v);
	vc_write8(v, VC_STATUS, VIRTIO_S_ACKNOWLEDGE | VIRTIO_S_DRIVER);
	vc_write32(v, VC_GFSELECT, 0);
	vc_write32(v, VC_GF, 0xffffffff);
	vc_write32(v, VC_GFSELECT, 1);
	vc_write32(v, VC_GF, 0xffffffff);
	vc_write8(v, VC_STATUS, VIRTIO_S_ACKNOWLEDGE | VIRTIO_S_DRIVER | VIRTIO_S_FEATURES_OK);
	snprintf(line, sizeof(line), "all feature bits then FEATURES_OK: status %#x",
		 virtio_status(v));
	report("features-all-ones", line);
	virtio_reset(v);
	vc_write8(v, VC_STATUS, VIRTIO_S_ACKNOWLEDGE | VIRTIO_S_DRIVER);
	vc_write32(v, VC_GFSELECT, 0);
	vc_write32(v, VC_GF, 0);
	vc_write32(v, VC_GFSELECT, 1);
	vc_write32(v, VC_GF, 0);
	vc_write8(v, VC_STATUS, VIRTIO_S_ACKNOWLEDGE | VIRTIO_S_DRIVER | VIRTIO_S_FEATURES_OK);
	snprintf(line, sizeof(line), "no VERSION_1 then FEATURES_OK: status %#x", virtio_status(v));
	report("features-none", line);
	if (setup(v, 1) == 0) {
		vc_write32(v, VC_GFSELECT, 1);
		vc_write32(v, VC_GF, 0);
		vc_write32(v, VC_GFSELECT, 7);
		vc_write32(v, VC_GF, 0xdeadbeef);
		vc_write8(v, VC_STATUS, VIRTIO_S_ACKNOWLEDGE);	/* clears bits without reset */
		snprintf(line, sizeof(line), "features changed and status bits cleared after DRIVER_OK: "
			 "status %#x", virtio_status(v));
		report("status-after-driver-ok", line);
	}
	/* notify garbage: unknown queue indexes, odd widths, past the region */
	if (setup(v, 1) == 0) {
		struct virtq *q = &v->q[0];
		mmio_write16(q->notify_addr, 0x7fff);
		mmio_write32(q->notify_addr, 0xffffffff);
		mmio_write8(q->notify_addr + 1, 0xff);
		mmio_write16(v->notify + 0x100 * (v->notify_mult ? v->notify_mult : 4), 0);
		if (v->isr) {
			u8 isr = mmio_read8(v->isr);
			mmio_write8(v->isr, 0xff);
			snprintf(line, sizeof(line), "isr read %#x, written; status %#x", isr,
				 virtio_status(v));
			report("isr-write", line);
		}
		if (v->devcfg) {
			u32 c0 = mmio_read32(v->devcfg);
			mmio_write32(v->devcfg, ~c0);
			snprintf(line, sizeof(line), "capacity low dword %#x -> wrote %#x -> reads %#x", c0,
				 ~c0, mmio_read32(v->devcfg));
			report("devcfg-write", line);
		}
		snprintf(line, sizeof(line), "status %#x", virtio_status(v));
		report("notify-garbage", line);
	}
	/* random writes to the common config; queue addresses only ever point
	 * at scratch memory or outside RAM */
	u64 rounds = param_u64("rounds", 200);
	u8 *sink = dma_alloc(65536, 4096);
	for (u64 i = 0; i < rounds; i++) {
		u32 r = rng();
		u32 off = r % 0x38;
		u64 val = rng();
		if (off >= VC_Q_DESCLO) {	/* address registers */
			off &= ~3u;
			val = (off & 4) ? (rng() & 1 ? 0 : 0xfff0) : (u64)sink + (rng() & 0xf000);
		}
		if (off == VC_STATUS && (val & 0xff) == 0)
			val = 1;
		switch ((r >> 8) % 3) {
		case 0: vc_write8(v, off, val); break;
		case 1: vc_write16(v, off & ~1u, val); break;
		default: vc_write32(v, off & ~3u, val); break;
		}
		if (rng() % 8 == 0)
			mmio_write16(v->notify + (rng() % 4) * v->notify_mult, rng() % 4);
	}
	snprintf(line, sizeof(line), "%lu random writes: status %#x", rounds, virtio_status(v));
	report("common-random", line);
	virtio_reset(v);
	snprintf(line, sizeof(line), "status %#x after reset", virtio_status(v));
	report("reset-after-random", line);
}

/* ---- virtio-net ---- */

static void net_cases(void)
{
	char buf[160], line[240];
	static const char *const names[] = {
		"net-tx-loop", "net-tx-outside-memory", "net-tx-zero-length", "net-tx-huge",
		"net-tx-no-header", "net-rx-outside-memory", "net-rx-read-only", "net-rx-tiny",
	};
	for (u32 c = 0; c < ARRAY_SIZE(names); c++) {
		if (skipped(names[c])) {
			report(names[c], "skipped");
			continue;
		}
		if (setup(&net, 2)) {
			report(names[c], "setup failed");
			continue;
		}
		struct virtq *rx = &net.q[0], *tx = &net.q[1];
		u8 *frame = scratch + 8192;	/* 12-byte header + 64-byte frame */
		memset(frame, 0, 12);
		u8 *f = frame + 12;
		for (int i = 0; i < 6; i++)
			f[i] = f[6 + i] = 0x52 + i;
		f[0] = 0x52; f[12] = 0x88; f[13] = 0xb5;
		memset(f + 14, 0x5a, 50);
		canary(DATA, 4096);
		/* one rx buffer (the echo, if any, lands there) */
		rx->desc[0] = (struct vring_desc){ (u64)DATA, 2048, VRING_DESC_F_WRITE, 0 };
		int rxcase = c >= 5;
		if (c == 5)
			rx->desc[0].addr = FAR_ADDR;
		if (c == 6)
			rx->desc[0].flags = 0;
		if (c == 7)
			rx->desc[0].len = 4;
		raw_submit(rx, 0);
		struct vring_desc *d = tx->desc;
		d[0] = (struct vring_desc){ (u64)frame, 76, 0, 0 };
		switch (c) {
		case 0: d[0].flags = VRING_DESC_F_NEXT; d[0].next = 0; break;
		case 1: d[0].addr = FAR_ADDR; break;
		case 2: d[0].len = 0; break;
		case 3: d[0].len = 0x100000; d[0].addr = (u64)dma_alloc(0x100000, 4096); break;
		case 4: d[0].len = 6; break;
		}
		raw_submit(tx, 0);
		const char *o = outcome(&net, tx, buf, sizeof(buf));
		if (!rxcase) {
			report(names[c], o);
			continue;
		}
		snprintf(line, sizeof(line), "tx %s; rx ", o);
		o = outcome(&net, rx, buf, sizeof(buf));
		int n = strlen(line);
		snprintf(line + n, sizeof(line) - n, "%s, %s", o,
			 c == 5 ? "(no buffer)" : canary_ok(DATA + (c == 7 ? 4 : 0), 2048 - (c == 7 ? 4 : 0)));
		report(names[c], line);
	}
	virtio_reset(&net);
}

int main(void)
{
	char buf[160];
	rng_state = param_u64("seed", 1) * 0x9e3779b97f4a7c15ull | 1;
	u64 k = tsc_khz() ? tsc_khz() : 3000000;
	timeout_tsc = param_u64("timeout_ms", 1000) * k;
	scratch = dma_alloc(65536, 4096);
	u64 ram_end = ram_region_end((u64)scratch);
	if (!ram_end)
		ram_end = 64 << 20;
	int do_blk = param_u64("blk", 1), do_net = param_u64("net", 1);
	int have_blk = do_blk && virtio_probe(&blk, VIRTIO_DEV_BLK, 0) == 0;
	have_net = do_net && virtio_probe(&net, VIRTIO_DEV_NET, 0) == 0;
	printf("virtio-evil: blk=%d net=%d ram_end=%#lx timeout_ms=%lu\n", have_blk, have_net,
	       ram_end, param_u64("timeout_ms", 1000));
	if (have_blk) {
		for (int c = 0; c < C_NCASES; c++)
			blk_chain_case(c, ram_end);
		static const char *const qn[] = {
			"queue-size-0", "queue-size-3", "queue-size-max+1", "queue-size-0xffff",
			"queue-rings-outside-memory", "queue-used-outside-memory",
			"queue-rings-unaligned", "queue-used-in-mmio-hole",
		};
		for (u32 i = 0; i < ARRAY_SIZE(qn); i++)
			queue_case(qn[i], i);
		msix_cases();
		bar_cases();
		status_cases();
	}
	if (have_net)
		net_cases();
	if (have_blk)
		report("final", works(&blk, buf, sizeof(buf)));
	printf("virtio-evil: survived\n");
	return 0;
}
