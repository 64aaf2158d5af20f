/*
 * virtio-net: packet workload over a modern virtio-net PCI device
 * (queue 0 receive, queue 1 transmit, 12-byte virtio_net_hdr).
 *
 * Params: op=rr|tx (rr), size=64 (Ethernet frame bytes without FCS,
 * 22-1514), count=1000, mode=irq|poll (irq), qd=32 (tx: frames in flight;
 * rr is always one), qsize=256, event_idx=1, rxbufs=64, timeout_ms=2000,
 * mac=52:54:00:12:34:56 (used when the device offers no MAC), dst=
 * (destination MAC, default our own), dev=0.
 *
 * Frames: dst, src = our MAC, ethertype 0x88b5 (local experimental), then
 * u32 sequence number, u32 0x4c554349 ('LUCI'), then bytes derived from the
 * sequence number. rr sends one frame, waits for a frame with ethertype
 * 0x88b5 to come back (others are counted as `other` and dropped) and
 * compares it byte for byte with what was sent: the device's back-end (or
 * its peer) must echo. tx sends as fast as the queue allows and reclaims;
 * received frames are recycled and counted.
 *
 * Prints "virtio-net mac=... features=..." then "virtio-net op=.. size=..
 * packets=N bytes=B tsc=T pps=X kicks=K irqs=I mismatches=M" and
 * "virtio-net detail: ...". Exit 0; 1 on mismatch or timeout; 2 setup.
 */
#include "libcflat.h"
#include "virtio.h"

#define NET_HDR		12
#define BUF_SIZE	2048
#define ETHERTYPE	0x88b5
#define MAGIC		0x4c554349

static struct virtio_dev dev;
static struct virtq *rxq, *txq;
static u8 mac[6], dst[6];
static u8 **rxbuf, **txbuf;
static u64 timeout_tsc, mismatches, other, received;

static void parse_mac(const char *s, u8 *m)
{
	for (int i = 0; i < 6 && *s; i++) {
		u8 v = 0;
		for (int k = 0; k < 2 && *s && *s != ':'; k++, s++) {
			char c = *s;
			v = v * 16 + (c >= 'a' ? c - 'a' + 10 : c >= 'A' ? c - 'A' + 10 : c - '0');
		}
		m[i] = v;
		if (*s == ':')
			s++;
	}
}

static u16 *rxhead2buf;

static void post_rx_buf(u16 b)
{
	int head = vq_alloc_chain(rxq, 1);
	if (head < 0)
		return;
	rxhead2buf[head] = b;
	rxq->desc[head].addr = (u64)rxbuf[b];
	rxq->desc[head].len = BUF_SIZE;
	rxq->desc[head].flags = VRING_DESC_F_WRITE;
	vq_push(rxq, head);
}

static void build(u8 *f, u64 seq, u64 size)
{
	memcpy(f, dst, 6);
	memcpy(f + 6, mac, 6);
	f[12] = ETHERTYPE >> 8;
	f[13] = ETHERTYPE & 0xff;
	u32 s32 = seq, m = MAGIC;
	memcpy(f + 14, &s32, 4);
	memcpy(f + 18, &m, 4);
	u64 x = seq * 0x9e3779b97f4a7c15ull + 1;
	for (u64 i = 22; i < size; i++) {
		x ^= x << 13;
		x ^= x >> 7;
		x ^= x << 17;
		f[i] = x;
	}
}

/* wait until one of the queues has used entries; -1 on timeout */
static int wait_any(struct virtq *a, struct virtq *b)
{
	u64 t0 = rdtsc();
	for (;;) {
		if ((a && vq_has_used(a)) || (b && vq_has_used(b)))
			return 0;
		int irq = (a && !a->poll) || (b && !b->poll);
		if (irq) {
			int r = (a && vq_arm(a)) | (b && vq_arm(b));
			if (r)
				return 0;
			irq_wait(timeout_tsc);
		} else {
			cpu_relax();
		}
		if (rdtsc() - t0 > timeout_tsc)
			return -1;
	}
}

/* reclaim transmitted buffers; returns how many */
static u64 inflight;

static int reap_tx(void)
{
	int n = 0, id;
	while ((id = vq_pop(txq, NULL)) >= 0) {
		if (id >= txq->size || !inflight) {
			printf("virtio-net: bogus tx used id %d\n", id);
			exit(1);
		}
		vq_free_chain(txq, id);
		inflight--;
		n++;
	}
	return n;
}

int main(void)
{
	const char *ops = param_str("op", "rr");
	const char *modes = param_str("mode", "irq");
	u64 size = param_u64("size", 64);
	u64 count = param_u64("count", 1000);
	int poll = !strcmp(modes, "poll");
	int rr = strcmp(ops, "tx") != 0;
	char b[32];

	if (strcmp(ops, "rr") && strcmp(ops, "tx")) {
		printf("virtio-net: op must be rr or tx\n");
		return 2;
	}
	if (size < 22 || size > 1514) {
		printf("virtio-net: size must be 22-1514\n");
		return 2;
	}
	u64 k = tsc_khz() ? tsc_khz() : 3000000;
	timeout_tsc = param_u64("timeout_ms", 2000) * k;

	if (virtio_probe(&dev, VIRTIO_DEV_NET, param_u64("dev", 0)))
		return 2;
	u64 want = 1ull << VIRTIO_NET_F_MAC;
	if (param_u64("event_idx", 1))
		want |= 1ull << VIRTIO_F_EVENT_IDX;
	if (virtio_init(&dev, want))
		return 2;
	u16 qsize = param_u64("qsize", 256);
	if (virtio_setup_queue(&dev, 0, qsize, poll) || virtio_setup_queue(&dev, 1, qsize, poll))
		return 2;
	rxq = &dev.q[0];
	txq = &dev.q[1];

	parse_mac(param_str("mac", "52:54:00:12:34:56"), mac);
	if (virtio_has(&dev, VIRTIO_NET_F_MAC) && dev.devcfg)
		for (int i = 0; i < 6; i++)
			mac[i] = mmio_read8(dev.devcfg + i);
	memcpy(dst, mac, 6);
	if (param_present("dst"))
		parse_mac(param_str("dst", ""), dst);

	/* buffers: rx (rxbufs of them), tx (one per tx descriptor) */
	int nrx = param_u64("rxbufs", 64);
	if (nrx > rxq->size)
		nrx = rxq->size;
	if (nrx < 1)
		nrx = 1;
	rxbuf = dma_alloc(8ul * nrx, 64);
	rxhead2buf = dma_alloc(2ul * rxq->size, 64);
	for (int i = 0; i < nrx; i++)
		rxbuf[i] = dma_alloc(BUF_SIZE, 4096);
	txbuf = dma_alloc(8ul * txq->size, 64);
	int qd = rr ? 1 : param_u64("qd", 32);
	if (qd > txq->size)
		qd = txq->size;
	if (qd < 1)
		qd = 1;
	for (int i = 0; i < txq->size; i++)	/* one buffer per descriptor */
		txbuf[i] = dma_alloc(BUF_SIZE, 4096);

	virtio_driver_ok(&dev);
	if (virtio_status(&dev) & (VIRTIO_S_NEEDS_RESET | VIRTIO_S_FAILED)) {
		printf("virtio-net: device status %#x after DRIVER_OK\n", virtio_status(&dev));
		return 2;
	}
	for (int i = 0; i < nrx; i++)
		post_rx_buf(i);
	vq_kick(rxq);
	printf("virtio-net mac=%02x:%02x:%02x:%02x:%02x:%02x features=%#lx qsize=%u msix=%d\n",
	       mac[0], mac[1], mac[2], mac[3], mac[4], mac[5], dev.features, txq->size,
	       txq->vector >= 0);

	u64 irq0 = this_cpu()->irq_count;
	u64 sent = 0, done = 0;
	u64 t0 = rdtsc();
	int rc = 0;
	while (done < count) {
		/* transmit */
		int pushed = 0;
		while (sent < count && inflight < (u64)qd && (!rr || sent == done)) {
			int head = vq_alloc_chain(txq, 1);
			if (head < 0)
				break;
			memset(txbuf[head], 0, NET_HDR);
			build(txbuf[head] + NET_HDR, sent, size);
			txq->desc[head].addr = (u64)txbuf[head];
			txq->desc[head].len = NET_HDR + size;
			txq->desc[head].flags = 0;
			vq_push(txq, head);
			sent++;
			inflight++;
			pushed++;
		}
		if (pushed)
			vq_kick(txq);

		if (!rr) {
			int n = reap_tx();
			/* recycle anything received (an echoing back-end) */
			u32 len;
			int id, nr = 0;
			while ((id = vq_pop(rxq, &len)) >= 0) {
				vq_free_chain(rxq, id);
				post_rx_buf(rxhead2buf[id]);
				received++;
				nr++;
			}
			if (nr)
				vq_kick(rxq);
			done += n;
			if (!n && done < count && wait_any(txq, NULL)) {
				printf("virtio-net: no tx completion (timeout) packet=%lu\n", done);
				rc = 1;
				break;
			}
			continue;
		}

		/* request-response: wait for the echo of packet `done` */
		reap_tx();
		u32 len;
		int id = vq_pop(rxq, &len);
		if (id < 0) {
			if (wait_any(rxq, NULL)) {
				printf("virtio-net: no reply (timeout) packet=%lu\n", done);
				rc = 1;
				break;
			}
			continue;
		}
		if (id >= rxq->size) {
			printf("virtio-net: bogus rx used id %d\n", id);
			return 1;
		}
		u16 bi = rxhead2buf[id];
		u8 *f = rxbuf[bi] + NET_HDR;
		u64 flen = len >= NET_HDR ? len - NET_HDR : 0;
		vq_free_chain(rxq, id);
		received++;
		if (flen < 14 || f[12] != (ETHERTYPE >> 8) || f[13] != (ETHERTYPE & 0xff)) {
			other++;
			post_rx_buf(bi);
			vq_kick(rxq);
			continue;
		}
		u8 expect[1514];
		build(expect, done, size);
		int bad = flen < size;
		u64 off = 0;
		for (; !bad && off < size; off++)
			if (f[off] != expect[off])
				bad = 1;
		if (bad) {
			if (mismatches < 10)
				printf("MISMATCH packet=%lu len=%lu offset=%lu\n", done, flen,
				       off ? off - 1 : 0);
			mismatches++;
		}
		post_rx_buf(bi);
		vq_kick(rxq);
		done++;
	}
	u64 t = rdtsc() - t0;
	/* let the last transmissions complete */
	while (inflight && !wait_any(txq, NULL))
		reap_tx();
	u64 irqs = this_cpu()->irq_count - irq0;

	printf("virtio-net op=%s size=%lu packets=%lu bytes=%lu tsc=%lu pps=%s kicks=%lu irqs=%lu "
	       "mismatches=%lu\n",
	       rr ? "rr" : "tx", size, done, done * size, t,
	       tsc_khz() && t ? fmt_milli(b, rate_milli(done, t)) : "unknown",
	       rxq->kicks + txq->kicks, irqs, mismatches);
	printf("virtio-net detail: mode=%s event_idx=%d tx_kicks=%lu rx_kicks=%lu "
	       "kicks_suppressed=%lu received=%lu other=%lu status=%#x\n",
	       txq->poll ? "poll" : "irq", txq->event_idx, txq->kicks, rxq->kicks,
	       txq->kicks_suppressed + rxq->kicks_suppressed, received, other,
	       virtio_status(&dev));
	return rc || mismatches ? 1 : 0;
}
