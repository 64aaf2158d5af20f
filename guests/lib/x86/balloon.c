/* virtio-balloon driver for probe guests (see balloon.h). */
#include "libcflat.h"
#include "balloon.h"

static int wait_used(struct balloon *b, struct virtq *q)
{
	u64 t0 = rdtsc(), k = tsc_khz() ? tsc_khz() : 3000000, next = t0 + k;
	while (!vq_has_used(q)) {
		/* the status is an MMIO exit: look once a millisecond */
		if (rdtsc() < next) {
			cpu_relax();
			continue;
		}
		next = rdtsc() + k;
		if (virtio_status(&b->dev) & VIRTIO_S_NEEDS_RESET) {
			printf("balloon: device needs reset (status %#x)\n", virtio_status(&b->dev));
			return -1;
		}
		if (rdtsc() - t0 > b->timeout_tsc) {
			printf("balloon: queue %u: no completion (timeout)\n", q->index);
			return -1;
		}
		cpu_relax();
	}
	return 0;
}

int balloon_init(struct balloon *b, int index, int want_stats, int want_deflate_on_oom,
		 int want_reporting)
{
	memset(b, 0, sizeof(*b));
	u64 k = tsc_khz() ? tsc_khz() : 3000000;
	b->timeout_tsc = param_u64("timeout_ms", 5000) * k;
	if (virtio_probe(&b->dev, VIRTIO_DEV_BALLOON, index))
		return -1;
	u64 want = 0;
	if (want_stats)
		want |= 1ull << VIRTIO_BALLOON_F_STATS_VQ;
	if (want_deflate_on_oom)
		want |= 1ull << VIRTIO_BALLOON_F_DEFLATE_ON_OOM;
	if (want_reporting)
		want |= 1ull << VIRTIO_BALLOON_F_REPORTING;
	if (virtio_init(&b->dev, want))
		return -1;
	int qi = 0;
	struct virtq **qs[4] = {&b->inflq, &b->deflq, &b->statsq, &b->repq};
	int present[4] = {1, 1, balloon_has(b, VIRTIO_BALLOON_F_STATS_VQ),
			  balloon_has(b, VIRTIO_BALLOON_F_REPORTING)};
	for (int i = 0; i < 4; i++) {
		if (!present[i])
			continue;
		if (virtio_setup_queue(&b->dev, qi, 64, 1))
			return -1;
		*qs[i] = &b->dev.q[qi];
		qi++;
	}
	b->pfns = dma_alloc(4 * BALLOON_PFNS_PER_BUF, 64);
	b->stats = dma_alloc(sizeof(struct balloon_stat) * BALLOON_NSTATS, 64);
	for (int i = 0; i < BALLOON_NSTATS; i++)
		b->stats[i].tag = i;
	virtio_driver_ok(&b->dev);
	if (virtio_status(&b->dev) & (VIRTIO_S_NEEDS_RESET | VIRTIO_S_FAILED)) {
		printf("balloon: device status %#x after DRIVER_OK\n", virtio_status(&b->dev));
		return -1;
	}
	return 0;
}

u32 balloon_target(struct balloon *b)
{
	return mmio_read32(b->dev.devcfg);
}

u32 balloon_actual(struct balloon *b)
{
	return mmio_read32(b->dev.devcfg + 4);
}

void balloon_set_actual(struct balloon *b, u32 pages)
{
	mmio_write32(b->dev.devcfg + 4, pages);
}

int balloon_chain(struct balloon *b, struct virtq *q, const u64 *addr, const u32 *len,
		  const u8 *writable, int n)
{
	int head = vq_alloc_chain(q, n);
	if (head < 0) {
		printf("balloon: queue %u: no %d free descriptors\n", q->index, n);
		return -1;
	}
	u16 d = head;
	for (int i = 0; i < n; i++) {
		q->desc[d].addr = addr[i];
		q->desc[d].len = len[i];
		if (writable && writable[i])
			q->desc[d].flags |= VRING_DESC_F_WRITE;
		d = q->desc[d].next;
	}
	vq_push(q, head);
	vq_kick(q);
	if (wait_used(b, q))
		return -1;
	int id = vq_pop(q, NULL);
	if (id != head) {
		printf("balloon: queue %u: used id %d, expected %d\n", q->index, id, head);
		return -1;
	}
	vq_free_chain(q, head);
	return 0;
}

int balloon_pfns(struct balloon *b, int deflate, const u32 *pfns, int n)
{
	if (n <= 0 || n > BALLOON_PFNS_PER_BUF)
		return -1;
	memcpy(b->pfns, pfns, 4ul * n);
	u64 a = (u64)b->pfns;
	u32 l = 4 * n;
	return balloon_chain(b, deflate ? b->deflq : b->inflq, &a, &l, NULL, 1);
}

void balloon_stat_set(struct balloon *b, u16 tag, u64 val)
{
	if (tag < BALLOON_NSTATS)
		b->stats[tag].val = val;
}

int balloon_stats_poll(struct balloon *b)
{
	struct virtq *q = b->statsq;
	if (!q)
		return 0;
	if (b->stats_held) {
		if (!vq_has_used(q))
			return 0;
		int id = vq_pop(q, NULL);
		vq_free_chain(q, id);
		b->stats_held = 0;
	}
	int head = vq_alloc_chain(q, 1);
	if (head < 0)
		return 0;
	q->desc[head].addr = (u64)b->stats;
	q->desc[head].len = sizeof(struct balloon_stat) * BALLOON_NSTATS;
	vq_push(q, head);
	vq_kick(q);
	b->stats_held = 1;
	b->stats_sent++;
	return 1;
}
