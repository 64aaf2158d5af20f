/*
 * virtio-blk: block workload over a modern virtio-blk PCI device.
 *
 * Params: op=read|write|rw (read), pattern=seq|rand (rand), bs=4096 (multiple
 * of 512), qd=1 (requests in flight), count=1000, mode=irq|poll (irq),
 * verify=0|1, flush=0|1, seed=0x5eed, span=bytes of the disk used (all),
 * prefill=0|1 (write the span with the pattern first, untimed), qsize=256,
 * event_idx=1 (negotiate VIRTIO_F_EVENT_IDX if offered), timeout_ms=2000
 * (per wait), dev=0 (which virtio-blk function), hold=0 (1: after the
 * report print "virtio-blk: holding" and spin, for kill -9 durability tests),
 * iommu=vtd (every buffer mapped through the VT-d, strategy=strict|shared|
 * async|deferred|teardown256|teardown4096; prints an "iommu-dma ..." line;
 * exit 1 if the unit recorded faults), isolation=1 (with iommu=vtd: see
 * isolation() below), phases=0|1 (1: LUCID_HC_PHASE 0 as the timed run
 * starts and 1 as the final read-back starts, for Lucid's swap.phase.*).
 *
 * Data: every 512-byte sector written carries a pattern made of its sector
 * number and the seed (word 0 = sector, word 1 = seed, the rest mixed), so
 * a misplaced, stale or corrupted sector is detected. verify=1 checks
 * reads: op=read checks every block read (the disk was written before with
 * the same seed, or prefill=1); op=write and op=rw check reads of blocks
 * written in this run, and re-read every written block at the end.
 * A mismatch prints "MISMATCH sector=S offset=O expected=E got=G".
 *
 * Prints "virtio-blk id=... capacity=..." at start, "virtio-blk flush
 * status=S" when flush=1, then "virtio-blk op=.. pattern=.. bs=.. qd=..
 * ops=N bytes=B tsc=T ops_per_s=X kicks=K irqs=I mismatches=M" and
 * "virtio-blk detail: ...". Exit 0; 1 on mismatch, I/O error or timeout;
 * 2 when setup fails.
 */
#include "libcflat.h"
#include "virtio.h"

struct slot {
	struct blk_hdr *hdr;
	volatile u8 *status;
	u8 *data;
	u64 block;
	int write, busy, check;
	u16 head;
	u64 hdr_iova, data_iova, status_iova, data_len;	/* iommu=vtd: this request's mappings */
};

static struct virtio_dev dev;
static struct virtq *q;
static u64 bs, nblocks, seed, timeout_tsc, mismatches, io_errors;
static int verify;
static u8 *written;		/* bitmap: block written (completed) in this run */
static struct slot *slots;
static u16 *head2slot;
static int nslots;

static void fill(u64 *w, u64 sector, u64 nsect)
{
	for (u64 s = 0; s < nsect; s++, w += 64) {
		u64 sec = sector + s;
		w[0] = sec;
		w[1] = seed;
		u64 base = mix64(sec ^ (seed << 1));
		for (int k = 2; k < 64; k++)
			w[k] = base + k * 0x9e3779b97f4a7c15ull;
	}
}

static void check(const u64 *w, u64 sector, u64 nsect)
{
	u64 exp[64];
	for (u64 s = 0; s < nsect; s++, w += 64) {
		fill(exp, sector + s, 1);
		for (int k = 0; k < 64; k++) {
			if (w[k] == exp[k])
				continue;
			const u8 *a = (const u8 *)&exp[k], *b = (const u8 *)&w[k];
			int i = 0;
			while (a[i] == b[i])
				i++;
			if (mismatches < 10)
				printf("MISMATCH sector=%lu offset=%d expected=%#x got=%#x\n",
				       sector + s, k * 8 + i, a[i], b[i]);
			mismatches++;
			break;
		}
	}
}

static u64 rng_state;

static u64 rng(void)
{
	return xorshift64(&rng_state);
}

/* queue one request on slot s; data NULL for flush */
static void submit(struct slot *s, u32 type, u64 block)
{
	int ndesc = type == BLK_T_FLUSH ? 2 : 3;
	int head = vq_alloc_chain(q, ndesc);
	if (head < 0) {
		printf("virtio-blk: no free descriptors\n");
		exit(2);
	}
	s->head = head;
	s->busy = 1;
	s->block = block;
	s->write = type == BLK_T_OUT;
	s->hdr->type = type;
	s->hdr->reserved = 0;
	s->hdr->sector = type == BLK_T_FLUSH ? 0 : block * (bs / 512);
	*s->status = 0xff;
	head2slot[head] = s - slots;
	struct vring_desc *d = &q->desc[head];
	d->addr = s->hdr_iova = vmap(s->hdr, sizeof(struct blk_hdr), DMA_TO_DEVICE);
	d->len = sizeof(struct blk_hdr);
	d = &q->desc[d->next];
	s->data_len = 0;
	if (type != BLK_T_FLUSH) {
		d->len = type == BLK_T_GET_ID ? 20 : bs;
		d->addr = s->data_iova =
			vmap(s->data, d->len, type == BLK_T_OUT ? DMA_TO_DEVICE : DMA_FROM_DEVICE);
		s->data_len = d->len;
		d->flags |= type == BLK_T_OUT ? 0 : VRING_DESC_F_WRITE;
		d = &q->desc[d->next];
	}
	d->addr = s->status_iova = vmap((const void *)s->status, 1, DMA_FROM_DEVICE);
	d->len = 1;
	d->flags = VRING_DESC_F_WRITE;
	vq_push(q, head);
}

/* iommu=vtd: drop the request's mappings once it completed */
static void slot_unmap(struct slot *s)
{
	if (!virtio_iommu)
		return;
	vunmap(s->hdr_iova, sizeof(struct blk_hdr));
	if (s->data_len)
		vunmap(s->data_iova, s->data_len);
	vunmap(s->status_iova, 1);
}

/* wait until the used ring has entries; -1 on timeout */
static int wait_used(void)
{
	u64 t0 = rdtsc();
	for (;;) {
		if (vq_has_used(q))
			return 0;
		if (virtio_iommu)	/* deferred / teardown time limits while idle */
			iommu_dma_poll();
		if (q->poll) {
			cpu_relax();
		} else {
			if (vq_arm(q))
				return 0;
			/* iommu=vtd: wake at least every ms to apply the time limits */
			irq_wait(virtio_iommu && iommu_poll_tsc() ? iommu_poll_tsc() : timeout_tsc);
		}
		if (rdtsc() - t0 > timeout_tsc)
			return -1;
	}
}

/* reap completions; returns the number reaped */
static int reap(int *done_slots)
{
	int n = 0;
	u32 len;
	int id;
	while ((id = vq_pop(q, &len)) >= 0) {
		if (id >= q->size || head2slot[id] >= nslots || !slots[head2slot[id]].busy) {
			printf("virtio-blk: bogus used id %d\n", id);
			exit(1);
		}
		struct slot *s = &slots[head2slot[id]];
		vq_free_chain(q, s->head);
		slot_unmap(s);
		s->busy = 0;
		if (*s->status != 0) {
			if (io_errors < 10)
				printf("virtio-blk: request failed status=%u sector=%lu %s\n", *s->status,
				       s->block * (bs / 512), s->write ? "write" : "read");
			io_errors++;
		} else if (s->write) {
			if (written)
				written[s->block / 8] |= 1 << (s->block % 8);
		} else if (s->check) {
			check((const u64 *)s->data, s->block * (bs / 512), bs / 512);
		}
		if (done_slots)
			done_slots[n] = s - slots;
		n++;
	}
	return n;
}

static int is_written(u64 b)
{
	return written && (written[b / 8] >> (b % 8)) & 1;
}

/* run count ops; op: 0 read, 1 write, 2 mixed; pat: 0 seq, 1 rand; or a
 * read-back of every written block (readback=1) */
static int run(u64 count, int op, int pat, int qd, int readback)
{
	u64 issued = 0, done = 0, next_seq = 0;
	int free_list[qd], nfree = qd, done_slots[qd];
	for (int i = 0; i < qd; i++)
		free_list[i] = i;
	u64 rb_block = 0;
	while (done < count) {
		int pushed = 0;
		while (issued < count && nfree > 0) {
			u64 block;
			int w;
			if (readback) {
				while (!is_written(rb_block))
					rb_block++;
				block = rb_block++;
				w = 0;
			} else {
				block = pat ? rng() % nblocks : next_seq++ % nblocks;
				w = op == 2 ? (int)((rng() >> 11) & 1) : op;
			}
			struct slot *s = &slots[free_list[--nfree]];
			if (w && verify)
				fill((u64 *)s->data, block * (bs / 512), bs / 512);
			s->check = verify && !w && (op == 0 || is_written(block));
			submit(s, w ? BLK_T_OUT : BLK_T_IN, block);
			issued++;
			pushed++;
		}
		if (pushed)
			vq_kick(q);
		int n = reap(done_slots);
		if (!n) {
			if (wait_used()) {
				printf("virtio-blk: no completion (timeout) with %lu in flight\n",
				       issued - done);
				return -1;
			}
			continue;
		}
		for (int i = 0; i < n; i++)
			free_list[nfree++] = done_slots[i];
		done += n;
	}
	return 0;
}

static int single(u32 type, struct slot *s)
{
	submit(s, type, 0);
	vq_kick(q);
	if (wait_used())
		return -1;
	u32 len;
	int id = vq_pop(q, &len);
	if (id != s->head)
		printf("virtio-blk: unexpected used id %d\n", id);
	else
		vq_free_chain(q, s->head);
	slot_unmap(s);
	s->busy = 0;
	return *s->status;
}

static int setup_device(int poll)
{
	u64 want = (1ull << VIRTIO_BLK_F_FLUSH) | (1ull << VIRTIO_BLK_F_BLK_SIZE);
	if (param_u64("event_idx", 1))
		want |= 1ull << VIRTIO_F_EVENT_IDX;
	if (virtio_init(&dev, want))
		return -1;
	if (virtio_setup_queue(&dev, 0, param_u64("qsize", 256), poll))
		return -1;
	q = &dev.q[0];
	virtio_driver_ok(&dev);
	if (virtio_status(&dev) & (VIRTIO_S_NEEDS_RESET | VIRTIO_S_FAILED)) {
		printf("virtio-blk: device status %#x after DRIVER_OK\n", virtio_status(&dev));
		return -1;
	}
	return 0;
}

/*
 * isolation=1 (with iommu=vtd): a read whose data buffer's IOVA was never
 * mapped (it equals the target buffer's physical address), and one whose
 * IOVA was just unmapped (strict only: other strategies keep it live on
 * purpose). Lucid completes such a request with VIRTIO_BLK_S_IOERR and
 * records a write fault for the device; the target must stay untouched.
 * QEMU 7.2 differs: its DMA mapping of an untranslatable buffer falls
 * back to a bounce buffer whose contents go nowhere, so the request
 * completes with status OK (the fault is recorded, the target untouched);
 * accepted when not under Lucid, and printed. Should a device give up
 * instead (NEEDS_RESET, no completion), that is accepted there too and
 * the device is set up again.
 * Returns the number of failed cases.
 */
static int isolation(int poll)
{
	if (!virtio_iommu) {
		printf("virtio-blk: isolation=1 needs iommu=vtd\n");
		return 1;
	}
	u8 *target = dma_alloc(bs, 4096);
	struct vtd_fault f[4];
	int failed = 0;
	vtd_read_faults(f, 4);
	for (int c = 0; c < 2; c++) {
		const char *name = c ? "after-unmap" : "never-mapped";
		if (c && iommu_strategy != IOMMU_STRICT) {
			printf("virtio-blk isolation %s: skipped (strategy=%s keeps unmapped IOVAs live)\n",
			       name, iommu_strategy_name(iommu_strategy));
			continue;
		}
		memset(target, 0x5a, bs);
		u64 bad = (u64)target;
		if (c) {
			bad = iommu_map((u64)target, bs, DMA_FROM_DEVICE);
			iommu_unmap(bad, bs);
		}
		struct slot *s = &slots[0];
		u64 irq_faults0 = vtd_fault_irqs;
		submit(s, BLK_T_IN, 0);
		/* point the data descriptor at the bad IOVA before publishing */
		struct vring_desc *d = &q->desc[q->desc[s->head].next];
		vunmap(s->data_iova, s->data_len);
		s->data_len = 0;
		d->addr = bad;
		vq_kick(q);
		u64 t0 = rdtsc(), lim = timeout_tsc / 4;
		while (!vq_has_used(q) && !(virtio_status(&dev) & VIRTIO_S_NEEDS_RESET) &&
		       rdtsc() - t0 < lim)
			cpu_relax();
		int completed = vq_has_used(q);
		u8 st = *s->status, dst = virtio_status(&dev);
		if (completed) {
			vq_pop(q, NULL);
			vq_free_chain(q, s->head);
			slot_unmap(s);
			s->busy = 0;
		}
		t0 = rdtsc();
		while (vtd_fault_irqs == irq_faults0 && rdtsc() - t0 < lim)
			cpu_relax();
		int n = vtd_read_faults(f, 4);
		iommu_stats.faults_seen += n;
		int untouched = 1;
		for (u64 i = 0; i < bs; i++)
			untouched &= target[i] == 0x5a;
		int fault_ok = n >= 1 && f[0].reason == VTD_FR_WRITE && f[0].sid == dev.pci.bdf &&
			       f[0].addr == (bad & ~0xfffUL);
		int ioerr = completed && st == 1;
		int qemu_ok = !lucid_present() && completed && st == 0;
		int qemu_reset = !lucid_present() && !completed && (dst & VIRTIO_S_NEEDS_RESET);
		int qemu_way = qemu_ok || qemu_reset;
		int ok = fault_ok && untouched && vtd_fault_irqs != irq_faults0 && (ioerr || qemu_way);
		printf("virtio-blk isolation %s: iova=%#lx %s (device status %#x); faults=%d reason=%#x "
		       "sid=%#x addr=%#lx fault_irq=%s; target %s; %s%s\n",
		       name, bad, completed ? (ioerr ? "completed IOERR" : st ? "completed, status NOT IOERR"
								 : "completed OK, NOT IOERR")
					   : "no completion",
		       dst, n, n ? f[0].reason : 0, n ? f[0].sid : 0, n ? f[0].addr : 0,
		       vtd_fault_irqs != irq_faults0 ? "yes" : "NO", untouched ? "untouched" : "WRITTEN",
		       ok ? "ok" : "FAILED",
		       !ok ? ""
		       : qemu_ok ? " (QEMU 7.2: completes OK, the data dropped, instead of IOERR)"
		       : qemu_reset ? " (QEMU: needs-reset instead of IOERR)" : "");
		failed += !ok;
		if (!completed) {	/* the device gave up on the queue: start it again */
			virtio_reset(&dev);
			s->busy = 0;
			if (setup_device(poll))
				return failed + 1;
		}
	}
	/* and the device still works */
	int st = single(BLK_T_IN, &slots[0]);
	printf("virtio-blk isolation after: read status=%d %s\n", st, st == 0 ? "ok" : "FAILED");
	return failed + (st != 0);
}

int main(void)
{
	const char *ops = param_str("op", "read");
	const char *pats = param_str("pattern", "rand");
	const char *modes = param_str("mode", "irq");
	u64 count = param_u64("count", 1000);
	int qd = param_u64("qd", 1);
	bs = param_u64("bs", 4096);
	verify = param_u64("verify", 0);
	seed = param_u64("seed", 0x5eed);
	int op = !strcmp(ops, "write") ? 1 : !strcmp(ops, "rw") ? 2 : 0;
	int pat = strcmp(pats, "seq") != 0;
	int poll = !strcmp(modes, "poll");
	char b[32];

	if (strcmp(ops, "read") && strcmp(ops, "write") && strcmp(ops, "rw")) {
		printf("virtio-blk: op must be read, write or rw\n");
		return 2;
	}
	if (!bs || bs % 512 || bs > (1 << 20) || qd < 1 || qd > 1024) {
		printf("virtio-blk: bs must be a multiple of 512 up to 1 MiB, qd 1-1024\n");
		return 2;
	}
	u64 k = tsc_khz() ? tsc_khz() : 3000000;
	timeout_tsc = param_u64("timeout_ms", 2000) * k;

	if (virtio_probe(&dev, VIRTIO_DEV_BLK, param_u64("dev", 0)))
		return 2;
	if (virtio_iommu_setup(dev.pci.bdf))
		return 2;
	if (setup_device(poll))
		return 2;
	if (qd * 3 > q->size) {
		printf("virtio-blk: qd=%d needs %d descriptors, queue has %u: qd=%u\n", qd, qd * 3,
		       q->size, q->size / 3);
		qd = q->size / 3;
	}

	u64 cap = 0;
	if (dev.devcfg) {
		u8 g;
		do {
			g = vc_read8(&dev, VC_CFGGEN);
			cap = mmio_read32(dev.devcfg) | (u64)mmio_read32(dev.devcfg + 4) << 32;
		} while (g != vc_read8(&dev, VC_CFGGEN));
	}
	u64 span = param_u64("span", cap * 512);
	if (span > cap * 512)
		span = cap * 512;
	nblocks = span / bs;
	if (!nblocks) {
		printf("virtio-blk: disk too small (capacity %lu sectors, bs %lu)\n", cap, bs);
		return 2;
	}

	nslots = qd;
	slots = dma_alloc(sizeof(struct slot) * qd, 64);
	head2slot = dma_alloc(2ul * q->size, 64);
	u8 *hdrs = dma_alloc(32ul * qd, 64);
	for (int i = 0; i < qd; i++) {
		slots[i].hdr = (struct blk_hdr *)(hdrs + 32 * i);
		slots[i].status = hdrs + 32 * i + 16;
		slots[i].data = dma_alloc(bs, 4096);
	}
	if (verify && op != 0)
		written = dma_alloc((nblocks + 7) / 8, 64);
	rng_state = seed * 2 + 1;

	/* GET_ID */
	memset(slots[0].data, 0, 21);
	int st = single(BLK_T_GET_ID, &slots[0]);
	char id[21];
	memcpy(id, slots[0].data, 20);
	id[20] = 0;
	for (int i = 0; i < 20 && id[i]; i++)
		if (id[i] < 0x20 || id[i] > 0x7e)
			id[i] = '?';
	printf("virtio-blk id=\"%s\" id_status=%d capacity=%lu features=%#lx qsize=%u msix=%d\n",
	       id, st, cap, dev.features, q->size, q->vector >= 0);

	if (param_u64("prefill", 0)) {
		u8 *saved = written;
		written = NULL;
		int v = verify;
		verify = 1;
		if (run(nblocks, 1, 0, qd, 0))
			return 1;
		verify = v;
		written = saved;
		q->kicks = q->kicks_suppressed = 0;
	}

	int phases = param_u64("phases", 0) && lucid_present();
	if (phases)
		lucid_hypercall(LUCID_HC_PHASE, 0, 0, 0);
	u64 irq0 = this_cpu()->irq_count;
	u64 t0 = rdtsc();
	int rc = run(count, op, pat, qd, 0);
	u64 t = rdtsc() - t0;
	u64 irqs = this_cpu()->irq_count - irq0;
	u64 kicks = q->kicks, supp = q->kicks_suppressed;

	if (rc == 0 && param_u64("flush", 0)) {
		if (virtio_has(&dev, VIRTIO_BLK_F_FLUSH))
			printf("virtio-blk flush status=%d\n", single(BLK_T_FLUSH, &slots[0]));
		else
			printf("virtio-blk flush unsupported\n");
	}
	if (rc == 0 && written) {
		u64 nw = 0;
		for (u64 i = 0; i < nblocks; i++)
			nw += is_written(i);
		if (phases)
			lucid_hypercall(LUCID_HC_PHASE, 1, 0, 0);
		if (nw)
			rc = run(nw, 0, 0, qd, 1);
		printf("virtio-blk readback blocks=%lu\n", nw);
	}

	int iso_failed = 0;
	if (virtio_iommu)	/* nothing left stale once the workload is over */
		iommu_dma_drain();
	if (rc == 0 && param_u64("isolation", 0))
		iso_failed = isolation(poll);
	if (virtio_iommu) {
		iommu_dma_drain();
		iommu_dma_report();
	}
	printf("virtio-blk op=%s pattern=%s bs=%lu qd=%d ops=%lu bytes=%lu tsc=%lu ops_per_s=%s "
	       "kicks=%lu irqs=%lu mismatches=%lu\n",
	       ops, pat ? "rand" : "seq", bs, qd, count, count * bs, t,
	       tsc_khz() && t ? fmt_milli(b, rate_milli(count, t)) : "unknown", kicks,
	       irqs, mismatches);
	printf("virtio-blk detail: mode=%s event_idx=%d kicks_suppressed=%lu io_errors=%lu "
	       "status=%#x\n",
	       q->poll ? "poll" : "irq", q->event_idx, supp, io_errors, virtio_status(&dev));
	if (param_u64("hold", 0)) {	/* for kill -9 tests: stay up after the report */
		printf("virtio-blk: holding\n");
		for (;;)
			cpu_relax();
	}
	if (rc || io_errors || mismatches || iso_failed)
		return 1;
	if (virtio_iommu && !param_u64("isolation", 0) && iommu_stats.faults_seen)
		return 1;
	return 0;
}
