/*
 * virtio-net: packet workload over a modern virtio-net PCI device
 * (queue 0 receive, queue 1 transmit, 12-byte virtio_net_hdr).
 *
 * Params: op=rr|tx (rr), size=64 (Ethernet frame bytes without FCS,
 * 22-1514), count=1000, mode=irq|poll (irq), qd=32 (tx: frames in flight;
 * rr is always one), qsize=256, event_idx=1, rxbufs=64, timeout_ms=2000,
 * mac=52:54:00:12:34:56 (used when the device offers no MAC), dst=
 * (destination MAC, default our own), dev=0, preempt_us=0 (rr: spin this
 * long between reaping tx completions and looking for the reply, as a vCPU
 * preempted there would: the reply then overtakes its tx completion),
 * reap_late=0 (rr: 1 looks for each reply before reaping its request's tx
 * completion, so that every reply overtakes it), iommu=vtd (every buffer
 * mapped through the VT-d per frame, strategy= as for virtio-blk; prints an
 * "iommu-dma ..." line after the result; exit 1 if the unit recorded faults).
 * reflect=0 (rr: 1 expects each reply with its MAC addresses swapped, as a
 * reflector returns it, e.g. `lucid device-server net`; with dst= another
 * MAC that proves the swap, with the default dst it changes nothing).
 *
 * Frames: dst, src = our MAC, ethertype 0x88b5 (local experimental), then
 * u32 sequence number, u32 0x4c554349 ('LUCI'), then bytes derived from the
 * sequence number. rr sends one frame, waits for a frame with ethertype
 * 0x88b5 to come back (others are counted as `other` and dropped) and
 * compares it byte for byte with what was sent: the device's back-end (or
 * its peer) must echo. tx sends as fast as the queue allows and reclaims;
 * received frames are recycled and counted.
 *
 * op=ping: IPv4 from src=10.0.2.15 to dst=10.0.2.2; resolves dst's MAC
 * with ARP (3 tries), answers ARP requests for src, then sends count ICMP
 * echo requests of size bytes (frame, >= 42) one at a time and checks each
 * reply's id, sequence and payload; `lost` replies fail the run.
 *
 * Prints "virtio-net mac=... features=..." then "virtio-net op=.. size=..
 * packets=N bytes=B tsc=T pps=X kicks=K irqs=I mismatches=M" and
 * "virtio-net detail: ..." (overtaken = replies seen before their tx
 * completion; work_tsc = TSC ticks spent building and checking frames).
 * On a timeout it prints both rings' indices and event fields.
 * Exit 0; 1 on mismatch or timeout; 2 setup.
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
/* rr: replies seen before their request's tx completion; preempt_us as ticks */
static u64 overtaken, preempt_tsc;
static int reap_late;
/* rr: replies come with destination and source swapped (reflect=1) */
static int reflected;
/* rr and tx: TSC ticks spent building and checking frames (the guest's own CPL3 work) */
static u64 work_tsc;

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
static u64 *rx_iova, *tx_iova;	/* iommu=vtd: the mapping of each descriptor's buffer */

/* done with descriptor id: unmap its buffer (iommu=vtd) and free it */
static void rx_free(int id)
{
	vunmap(rx_iova[id], BUF_SIZE);
	vq_free_chain(rxq, id);
}

static void tx_free(int id)
{
	vunmap(tx_iova[id], BUF_SIZE);
	vq_free_chain(txq, id);
}

static u64 tx_map(int head)
{
	return tx_iova[head] = vmap(txbuf[head], BUF_SIZE, DMA_TO_DEVICE);
}

static void post_rx_buf(u16 b)
{
	int head = vq_alloc_chain(rxq, 1);
	if (head < 0)
		return;
	rxhead2buf[head] = b;
	rxq->desc[head].addr = rx_iova[head] = vmap(rxbuf[b], BUF_SIZE, DMA_FROM_DEVICE);
	rxq->desc[head].len = BUF_SIZE;
	rxq->desc[head].flags = VRING_DESC_F_WRITE;
	vq_push(rxq, head);
}

/* the frame's first 22 bytes: addresses, ethertype, sequence number, magic */
static void frame_head(u8 *h, u64 seq)
{
	memcpy(h, dst, 6);
	memcpy(h + 6, mac, 6);
	h[12] = ETHERTYPE >> 8;
	h[13] = ETHERTYPE & 0xff;
	u32 s32 = seq, m = MAGIC;
	memcpy(h + 14, &s32, 4);
	memcpy(h + 18, &m, 4);
}

/* the payload: xorshift64 of the sequence number, 8 bytes per step (a step per byte cost
 * ~6 us per 1500-byte round trip at CPL3, most of an L4p round trip) */
static u64 payload_word(u64 *x)
{
	*x ^= *x << 13;
	*x ^= *x >> 7;
	*x ^= *x << 17;
	return *x;
}

#define PAYLOAD 22

static void build(u8 *f, u64 seq, u64 size)
{
	frame_head(f, seq);
	u64 x = seq * 0x9e3779b97f4a7c15ull + 1, i = PAYLOAD;
	for (; i + 8 <= size; i += 8) {
		u64 v = payload_word(&x);
		__builtin_memcpy(f + i, &v, 8);
	}
	u64 v = payload_word(&x);
	for (; i < size; i++, v >>= 8)
		f[i] = v;
}

/* offset of the first byte of f[0..size) that differs from build(seq, size), or size */
static u64 check(const u8 *f, u64 seq, u64 size)
{
	u8 h[PAYLOAD];
	frame_head(h, seq);
	if (reflected) {
		memcpy(h, mac, 6);
		memcpy(h + 6, dst, 6);
	}
	for (u64 i = 0; i < PAYLOAD; i++)
		if (f[i] != h[i])
			return i;
	u64 x = seq * 0x9e3779b97f4a7c15ull + 1, i = PAYLOAD;
	for (; i + 8 <= size; i += 8) {
		u64 v = payload_word(&x), got;
		__builtin_memcpy(&got, f + i, 8);
		if (got != v)
			return i + __builtin_ctzll(got ^ v) / 8;
	}
	u64 v = payload_word(&x);
	for (; i < size; i++, v >>= 8)
		if (f[i] != (u8)v)
			return i;
	return size;
}

/* wait until one of the queues has used entries; -1 on timeout */
static int wait_any(struct virtq *a, struct virtq *b)
{
	u64 t0 = rdtsc();
	for (;;) {
		if ((a && vq_has_used(a)) || (b && vq_has_used(b)))
			return 0;
		if (virtio_iommu)	/* deferred / teardown time limits while idle */
			iommu_dma_poll();
		int irq = (a && !a->poll) || (b && !b->poll);
		if (irq) {
			int r = (a && vq_arm(a)) | (b && vq_arm(b));
			if (r)
				return 0;
			/* iommu=vtd: wake at least every ms to apply the time limits */
			irq_wait(virtio_iommu && iommu_poll_tsc() ? iommu_poll_tsc() : timeout_tsc);
		} else {
			cpu_relax();
		}
		if (rdtsc() - t0 > timeout_tsc)	/* late is not lost: look once more */
			return (a && vq_has_used(a)) || (b && vq_has_used(b)) ? 0 : -1;
	}
}

static void spin_tsc(u64 ticks)
{
	u64 t0 = rdtsc();
	while (ticks && rdtsc() - t0 < ticks)
		cpu_relax();
}

static void dump_q(const char *n, struct virtq *q)
{
	printf("virtio-net: %s used.idx=%u last_used=%u avail.idx=%u used_event=%u avail_event=%u "
	       "used.flags=%u avail.flags=%u\n", n, q->used->idx, q->last_used, q->avail->idx,
	       *(volatile u16 *)&q->avail->ring[q->size],
	       *(volatile u16 *)((u64)q->used + 4 + 8ul * q->size), q->used->flags, q->avail->flags);
}

static void dump_queues(void)
{
	dump_q("rx", rxq);
	dump_q("tx", txq);
	printf("virtio-net: irq_count=%lu pending=%d\n", this_cpu()->irq_count, irq_pending());
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
		tx_free(id);
		inflight--;
		n++;
	}
	return n;
}

/* iommu=vtd: finish pending invalidations, print the iommu-dma line;
 * 1 when the unit recorded faults */
static int iommu_done(void)
{
	if (!virtio_iommu)
		return 0;
	iommu_dma_drain();
	iommu_dma_report();
	return iommu_stats.faults_seen != 0;
}

/* ---- op=ping: ARP resolution and ICMP echo over IPv4 ---- */

static u64 ping_inflight;

static int parse_ip(const char *s, u8 *ip)
{
	for (int i = 0; i < 4; i++) {
		u32 v = 0;
		if (*s < '0' || *s > '9')
			return -1;
		while (*s >= '0' && *s <= '9')
			v = v * 10 + (*s++ - '0');
		ip[i] = v;
		if (i < 3 && *s++ != '.')
			return -1;
	}
	return 0;
}

static u16 csum(const u8 *p, u64 n)
{
	u32 s = 0;
	for (u64 i = 0; i + 1 < n; i += 2)
		s += (p[i] << 8) | p[i + 1];
	if (n & 1)
		s += p[n - 1] << 8;
	while (s >> 16)
		s = (s & 0xffff) + (s >> 16);
	return ~s;
}

/* transmit frame f of len bytes (copied), reclaiming finished ones */
static int send_frame(const u8 *f, u64 len)
{
	u64 t0 = rdtsc();
	int head;
	for (;;) {
		int id;
		while ((id = vq_pop(txq, NULL)) >= 0) {
			tx_free(id);
			ping_inflight--;
		}
		head = vq_alloc_chain(txq, 1);
		if (head >= 0)
			break;
		if (rdtsc() - t0 > timeout_tsc)
			return -1;
		cpu_relax();
	}
	memset(txbuf[head], 0, NET_HDR);
	memcpy(txbuf[head] + NET_HDR, f, len);
	txq->desc[head].addr = tx_map(head);
	txq->desc[head].len = NET_HDR + len;
	txq->desc[head].flags = 0;
	vq_push(txq, head);
	vq_kick(txq);
	ping_inflight++;
	return 0;
}

static u8 my_ip[4], peer_ip[4], peer_mac[6];

static void put16(u8 *p, u16 v) { p[0] = v >> 8; p[1] = v; }
static u16 get16(const u8 *p) { return (p[0] << 8) | p[1]; }

static void send_arp(int oper, const u8 *tmac, const u8 *tip)
{
	u8 f[60];
	memset(f, 0, sizeof(f));
	if (oper == 1)
		memset(f, 0xff, 6);
	else
		memcpy(f, tmac, 6);
	memcpy(f + 6, mac, 6);
	put16(f + 12, 0x0806);
	put16(f + 14, 1);
	put16(f + 16, 0x0800);
	f[18] = 6;
	f[19] = 4;
	put16(f + 20, oper);
	memcpy(f + 22, mac, 6);
	memcpy(f + 28, my_ip, 4);
	if (oper == 2)
		memcpy(f + 32, tmac, 6);
	memcpy(f + 38, tip, 4);
	send_frame(f, sizeof(f));
}

/* receive one frame into out (returns its length) within the timeout, -1
 * on timeout; answers ARP requests for our address on the way */
static int recv_frame(u8 *out, u64 max)
{
	for (;;) {
		u32 len;
		int id = vq_pop(rxq, &len);
		if (id < 0) {
			if (wait_any(rxq, NULL))
				return -1;
			continue;
		}
		if (id >= rxq->size)
			return -1;
		u16 bi = rxhead2buf[id];
		rx_free(id);
		u64 flen = len >= NET_HDR ? len - NET_HDR : 0;
		if (flen > max)
			flen = max;
		memcpy(out, rxbuf[bi] + NET_HDR, flen);
		post_rx_buf(bi);
		vq_kick(rxq);
		received++;
		if (flen >= 42 && get16(out + 12) == 0x0806 && get16(out + 20) == 1 &&
		    !memcmp(out + 38, my_ip, 4)) {
			send_arp(2, out + 22, out + 28);
			continue;
		}
		return flen;
	}
}

static int do_ping(u64 count, u64 size, char *b)
{
	if (parse_ip(param_str("src", "10.0.2.15"), my_ip) ||
	    parse_ip(param_str("dst", "10.0.2.2"), peer_ip)) {
		printf("virtio-net: src=/dst= must be dotted IPv4 addresses\n");
		return 2;
	}
	if (size < 42)
		size = 42;
	u8 f[1514], r[1514];
	int resolved = 0;
	for (int tries = 0; tries < 3 && !resolved; tries++) {
		send_arp(1, NULL, peer_ip);
		int n;
		while (!resolved && (n = recv_frame(r, sizeof(r))) >= 0) {
			if (n >= 42 && get16(r + 12) == 0x0806 && get16(r + 20) == 2 &&
			    !memcmp(r + 28, peer_ip, 4)) {
				memcpy(peer_mac, r + 22, 6);
				resolved = 1;
			} else {
				other++;
			}
		}
	}
	if (!resolved) {
		printf("virtio-net: no ARP reply from %u.%u.%u.%u (timeout)\n", peer_ip[0],
		       peer_ip[1], peer_ip[2], peer_ip[3]);
		return 1;
	}
	printf("virtio-net arp %u.%u.%u.%u is-at %02x:%02x:%02x:%02x:%02x:%02x\n", peer_ip[0],
	       peer_ip[1], peer_ip[2], peer_ip[3], peer_mac[0], peer_mac[1], peer_mac[2],
	       peer_mac[3], peer_mac[4], peer_mac[5]);
	u64 irq0 = this_cpu()->irq_count, done = 0, lost = 0;
	u16 ident = rdtsc();
	u64 t0 = rdtsc();
	for (u64 seq = 0; seq < count; seq++) {
		memcpy(f, peer_mac, 6);
		memcpy(f + 6, mac, 6);
		put16(f + 12, 0x0800);
		u8 *ip = f + 14, *icmp = f + 34;
		u64 iplen = size - 14;
		memset(ip, 0, 20);
		ip[0] = 0x45;
		put16(ip + 2, iplen);
		put16(ip + 4, seq);
		put16(ip + 6, 0x4000);
		ip[8] = 64;
		ip[9] = 1;
		memcpy(ip + 12, my_ip, 4);
		memcpy(ip + 16, peer_ip, 4);
		put16(ip + 10, csum(ip, 20));
		icmp[0] = 8;
		icmp[1] = 0;
		put16(icmp + 2, 0);
		put16(icmp + 4, ident);
		put16(icmp + 6, seq);
		for (u64 i = 8; i < iplen - 20; i++)
			icmp[i] = seq * 7 + i;
		put16(icmp + 2, csum(icmp, iplen - 20));
		if (send_frame(f, size)) {
			printf("virtio-net: tx stuck (timeout)\n");
			return 1;
		}
		int got = 0, n;
		while (!got && (n = recv_frame(r, sizeof(r))) >= 0) {
			if ((u64)n < 42 || get16(r + 12) != 0x0800 || r[23] != 1 ||
			    memcmp(r + 26, peer_ip, 4) || r[34] != 0 || get16(r + 38) != ident ||
			    get16(r + 40) != (u16)seq) {
				other++;
				continue;
			}
			got = 1;
			if ((u64)n < size || memcmp(r + 42, f + 42, size - 42)) {
				if (mismatches < 10)
					printf("MISMATCH packet=%lu len=%d\n", seq, n);
				mismatches++;
			}
		}
		if (got)
			done++;
		else
			lost++;
	}
	u64 t = rdtsc() - t0;
	printf("virtio-net op=ping size=%lu packets=%lu bytes=%lu tsc=%lu pps=%s kicks=%lu irqs=%lu "
	       "mismatches=%lu\n",
	       size, done, done * size, t,
	       tsc_khz() && t ? fmt_milli(b, rate_milli(done, t)) : "unknown",
	       rxq->kicks + txq->kicks, this_cpu()->irq_count - irq0, mismatches);
	printf("virtio-net detail: mode=%s event_idx=%d lost=%lu received=%lu other=%lu status=%#x\n",
	       txq->poll ? "poll" : "irq", txq->event_idx, lost, received, other,
	       virtio_status(&dev));
	return lost || mismatches || iommu_done() ? 1 : 0;
}

int main(void)
{
	const char *ops = param_str("op", "rr");
	const char *modes = param_str("mode", "irq");
	u64 size = param_u64("size", 64);
	u64 count = param_u64("count", 1000);
	int poll = !strcmp(modes, "poll");
	int rr = strcmp(ops, "tx") != 0;
	int ping = !strcmp(ops, "ping");
	char b[32];

	if (strcmp(ops, "rr") && strcmp(ops, "tx") && !ping) {
		printf("virtio-net: op must be rr, tx or ping\n");
		return 2;
	}
	if (size < 22 || size > 1514) {
		printf("virtio-net: size must be 22-1514\n");
		return 2;
	}
	u64 k = tsc_khz() ? tsc_khz() : 3000000;
	timeout_tsc = param_u64("timeout_ms", 2000) * k;
	preempt_tsc = param_u64("preempt_us", 0) * k / 1000;
	reap_late = param_u64("reap_late", 0) != 0;
	reflected = param_u64("reflect", 0) != 0;

	if (virtio_probe(&dev, VIRTIO_DEV_NET, param_u64("dev", 0)))
		return 2;
	if (virtio_iommu_setup(dev.pci.bdf))
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
	if (param_present("dst") && !ping)
		parse_mac(param_str("dst", ""), dst);

	/* buffers: rx (rxbufs of them), tx (one per tx descriptor) */
	int nrx = param_u64("rxbufs", 64);
	if (nrx > rxq->size)
		nrx = rxq->size;
	if (nrx < 1)
		nrx = 1;
	rxbuf = dma_alloc(8ul * nrx, 64);
	rxhead2buf = dma_alloc(2ul * rxq->size, 64);
	rx_iova = dma_alloc(8ul * rxq->size, 64);
	tx_iova = dma_alloc(8ul * txq->size, 64);
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

	if (ping)
		return do_ping(count, size, b);
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
			u64 w0 = rdtsc();
			memset(txbuf[head], 0, NET_HDR);
			build(txbuf[head] + NET_HDR, sent, size);
			work_tsc += rdtsc() - w0;
			txq->desc[head].addr = tx_map(head);
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
				rx_free(id);
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
		if (!reap_late)
			reap_tx();
		if (sent == done) {
			/* The last reply was seen before its request's tx completion (the device
			 * completes tx first, but both can land between reap_tx and vq_pop), so
			 * the send above was held back: reap it, then send; there is no reply
			 * to wait for. */
			overtaken++;
			while (inflight && !reap_tx()) {
				if (wait_any(txq, NULL)) {
					printf("virtio-net: no tx completion (timeout) packet=%lu\n",
					       done);
					dump_queues();
					rc = 1;
					break;
				}
			}
			if (rc)
				break;
			continue;
		}
		spin_tsc(preempt_tsc);
		u32 len;
		int id = vq_pop(rxq, &len);
		if (id < 0) {
			if (wait_any(rxq, NULL)) {
				printf("virtio-net: no reply (timeout) packet=%lu\n", done);
				dump_queues();
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
		rx_free(id);
		received++;
		if (flen < 14 || f[12] != (ETHERTYPE >> 8) || f[13] != (ETHERTYPE & 0xff)) {
			other++;
			post_rx_buf(bi);
			vq_kick(rxq);
			continue;
		}
		u64 w0 = rdtsc();
		u64 off = check(f, done, flen < size ? flen : size);
		work_tsc += rdtsc() - w0;
		if (flen < size || off < size) {
			if (mismatches < 10)
				printf("MISMATCH packet=%lu len=%lu offset=%lu\n", done, flen, off);
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
	       "kicks_suppressed=%lu received=%lu other=%lu overtaken=%lu work_tsc=%lu status=%#x\n",
	       txq->poll ? "poll" : "irq", txq->event_idx, txq->kicks, rxq->kicks,
	       txq->kicks_suppressed + rxq->kicks_suppressed, received, other, overtaken,
	       work_tsc, virtio_status(&dev));
	return rc || mismatches || iommu_done() ? 1 : 0;
}
