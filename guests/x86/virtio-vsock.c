/*
 * virtio-vsock: stream sockets over a modern virtio-vsock PCI device
 * (virtio device id 19, PCI 1af4:1053; queues rx 0, tx 1, event 2), polled
 * (interrupts suppressed, the used rings spun on). Each packet goes out as
 * one device-readable descriptor (44-byte header, then payload); rx
 * buffers are 44 + 16 KiB device-writable descriptors.
 *
 * Params: mode=echo|connect|many|bad (echo), port (echo: 1234, the port it
 * listens on; connect/many/bad: 5000, the host port it connects to),
 * conns (echo: 1, connections served before it exits; many: 64, held
 * open at once), bytes=1m (connect: the pattern sent and read back),
 * timeout_ms=30000 (for the whole run), iommu=vtd (buffers mapped once
 * through the VT-d, strategy= as for virtio-blk).
 *
 * echo: accepts connections to `port` and sends every byte back; a
 * connection ends when the host closes it (SHUTDOWN, answered with RST).
 * Prints "virtio-vsock: mode=echo conns=N bytes=B sha256=H" (B: bytes
 * echoed over all connections, H: SHA-256 of the first connection's).
 * connect: connects to host `port`, sends `bytes` bytes of a pattern and
 * reads as many back (the host end echoes), compares, shuts down.
 * Prints "virtio-vsock: mode=connect bytes=B mismatches=M sha256=H tsc_ms=T"
 * (T: TSC milliseconds from the connection's start to the last byte back, 0
 * if the TSC rate is unknown).
 * many: opens `conns` connections to host `port`, then on each sends
 * "conn N\n" and reads it back; all are open at once; then closes them.
 * Prints "virtio-vsock: mode=many conns=N ok=K".
 * bad: sends what a broken driver would (RW on no connection, an unknown
 * op, a packet whose length is beyond its buffer, a REQUEST to a host port
 * nobody listens on) and counts the RSTs that come back.
 * Prints "virtio-vsock: mode=bad sent=N rst=R".
 *
 * All modes first print "virtio-vsock cid=C features=F". Exit 0; 1 on a
 * mismatch, a refused connection or timeout; 2 when setup fails.
 */
#include "libcflat.h"
#include "virtio.h"

#define VIRTIO_DEV_VSOCK	0x1053
#define HDR			44
#define RXDATA			16384
#define RXBUF			(HDR + RXDATA)
#define TXDATA			4096
#define TXBUF			(HDR + TXDATA)
#define QSIZE			128
#define NRX			64
#define MAXCONN			80
#define BUF_ALLOC		32768	/* what each connection may hold un-echoed */
#define HOST_CID		2

#define OP_REQUEST		1
#define OP_RESPONSE		2
#define OP_RST			3
#define OP_SHUTDOWN		4
#define OP_RW			5
#define OP_CREDIT_UPDATE	6
#define OP_CREDIT_REQUEST	7

struct hdr {
	u64 src_cid, dst_cid;
	u32 src_port, dst_port, len;
	u16 type, op;
	u32 flags, buf_alloc, fwd_cnt;
} __attribute__((packed));

enum { FREE, CONNECTING, OPEN, CLOSED, REFUSED };

struct conn {
	int state;
	u32 port, peer;		/* ours, the host's */
	u32 fwd_cnt, fwd_sent;	/* bytes consumed, as last told */
	u32 tx_cnt, peer_buf_alloc, peer_fwd_cnt;
	u8 *buf;		/* echo: bytes not yet sent back; connect: read back */
	u32 have;
	u64 got;		/* bytes received */
};

static struct virtio_dev dev;
static struct virtq *rxq, *txq;
static u8 *rxbuf[QSIZE], *txbuf[QSIZE];
static u64 rx_iova[QSIZE], tx_iova[QSIZE];
static int rxhead2buf[QSIZE];
static u64 cid, deadline, rst_seen, bytes_echoed;
static struct conn conns[MAXCONN];
static int mode_echo, first_conn = -1;
/* connect: the connection whose bytes are checked as they arrive */
static struct conn *verify;
static u64 checked, mismatches;
static u32 listen_port;

/* ---- SHA-256 (FIPS 180-4) ---- */
struct sha256 {
	u32 h[8];
	u8 block[64];
	u64 len;
};
static const u32 K[64] = {
	0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
	0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
	0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
	0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
	0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
	0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
	0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
	0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2,
};
#define ROR(x, n) (((x) >> (n)) | ((x) << (32 - (n))))

static void sha_init(struct sha256 *s)
{
	static const u32 h0[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
				  0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
	memcpy(s->h, h0, sizeof(h0));
	s->len = 0;
}

static void sha_block(struct sha256 *s, const u8 *p)
{
	u32 w[64], v[8];
	for (int i = 0; i < 16; i++)
		w[i] = (u32)p[4 * i] << 24 | (u32)p[4 * i + 1] << 16 | (u32)p[4 * i + 2] << 8 | p[4 * i + 3];
	for (int i = 16; i < 64; i++) {
		u32 s0 = ROR(w[i - 15], 7) ^ ROR(w[i - 15], 18) ^ (w[i - 15] >> 3);
		u32 s1 = ROR(w[i - 2], 17) ^ ROR(w[i - 2], 19) ^ (w[i - 2] >> 10);
		w[i] = w[i - 16] + s0 + w[i - 7] + s1;
	}
	memcpy(v, s->h, sizeof(v));
	for (int i = 0; i < 64; i++) {
		u32 t1 = v[7] + (ROR(v[4], 6) ^ ROR(v[4], 11) ^ ROR(v[4], 25)) +
			 ((v[4] & v[5]) ^ (~v[4] & v[6])) + K[i] + w[i];
		u32 t2 = (ROR(v[0], 2) ^ ROR(v[0], 13) ^ ROR(v[0], 22)) +
			 ((v[0] & v[1]) ^ (v[0] & v[2]) ^ (v[1] & v[2]));
		for (int j = 7; j > 0; j--)
			v[j] = v[j - 1];
		v[4] += t1;
		v[0] = t1 + t2;
	}
	for (int i = 0; i < 8; i++)
		s->h[i] += v[i];
}

static void sha_update(struct sha256 *s, const u8 *p, u64 n)
{
	while (n--) {
		s->block[s->len++ % 64] = *p++;
		if (s->len % 64 == 0)
			sha_block(s, s->block);
	}
}

static void sha_final(struct sha256 *s, char *hex)
{
	u64 bits = s->len * 8;
	u8 pad = 0x80, zero = 0;
	sha_update(s, &pad, 1);
	while (s->len % 64 != 56)
		sha_update(s, &zero, 1);
	for (int i = 7; i >= 0; i--) {
		u8 b = bits >> (8 * i);
		sha_update(s, &b, 1);
	}
	static const char digits[] = "0123456789abcdef";
	for (int i = 0; i < 32; i++) {
		u8 b = s->h[i / 4] >> (24 - 8 * (i % 4));
		hex[2 * i] = digits[b >> 4];
		hex[2 * i + 1] = digits[b & 15];
	}
	hex[64] = 0;
}

static struct sha256 sha;

/* ---- the device ---- */
static void timeout_check(const char *what)
{
	if (rdtsc() > deadline) {
		printf("virtio-vsock: timeout (%s)\n", what);
		exit(1);
	}
}

static void post_rx(int b)
{
	int head = vq_alloc_chain(rxq, 1);
	if (head < 0)
		return;
	rxhead2buf[head] = b;
	rxq->desc[head].addr = rx_iova[b];
	rxq->desc[head].len = RXBUF;
	rxq->desc[head].flags = VRING_DESC_F_WRITE;
	vq_push(rxq, head);
}

static void reap_tx(void)
{
	u32 len;
	int id;
	while ((id = vq_pop(txq, &len)) >= 0)
		vq_free_chain(txq, id);
}

/* sends one packet (header fields from c, or the given ports when c is 0) */
static void send_raw(const struct hdr *h, const void *data, u32 n, u32 desc_len)
{
	int head;
	while ((head = vq_alloc_chain(txq, 1)) < 0) {
		reap_tx();
		timeout_check("tx ring full");
		cpu_relax();
	}
	memcpy(txbuf[head], h, HDR);
	if (n)
		memcpy(txbuf[head] + HDR, data, n);
	txq->desc[head].addr = tx_iova[head];
	txq->desc[head].len = desc_len;
	txq->desc[head].flags = 0;
	vq_push(txq, head);
	vq_kick(txq);
}

static void send_pkt(struct conn *c, u16 op, u32 flags, const void *data, u32 n)
{
	struct hdr h = {
		.src_cid = cid, .dst_cid = HOST_CID, .src_port = c->port, .dst_port = c->peer,
		.len = n, .type = 1, .op = op, .flags = flags, .buf_alloc = BUF_ALLOC,
		.fwd_cnt = c->fwd_cnt,
	};
	c->fwd_sent = c->fwd_cnt;
	c->tx_cnt += n;
	send_raw(&h, data, n, HDR + n);
}

static u32 credit(struct conn *c)
{
	u32 in_flight = c->tx_cnt - c->peer_fwd_cnt;
	return c->peer_buf_alloc > in_flight ? c->peer_buf_alloc - in_flight : 0;
}

/* echo: send back what the credit allows */
static void echo_out(struct conn *c)
{
	u32 off = 0;
	while (off < c->have && c->state == OPEN) {
		u32 n = c->have - off;
		if (n > TXDATA)
			n = TXDATA;
		if (n > credit(c))
			n = credit(c);
		if (!n)
			break;
		c->fwd_cnt += n;	/* consumed once it is on its way back */
		send_pkt(c, OP_RW, 0, c->buf + off, n);
		off += n;
		bytes_echoed += n;
	}
	if (off) {
		memcpy(c->buf, c->buf + off, c->have - off);
		c->have -= off;
	}
}

static struct conn *find(u32 port, u32 peer)
{
	for (int i = 0; i < MAXCONN; i++)
		if (conns[i].state != FREE && conns[i].port == port && conns[i].peer == peer)
			return &conns[i];
	return 0;
}

static struct conn *alloc_conn(void)
{
	for (int i = 0; i < MAXCONN; i++)
		if (conns[i].state == FREE || conns[i].state == CLOSED) {
			struct conn *c = &conns[i];
			u8 *buf = c->buf;
			memset(c, 0, sizeof(*c));
			c->buf = buf ? buf : dma_alloc(BUF_ALLOC, 64);
			return c;
		}
	return 0;
}

static u64 served;

static void on_packet(struct hdr *h, u8 *data)
{
	if (h->op == OP_RST)
		rst_seen++;
	struct conn *c = find(h->dst_port, h->src_port);
	if (!c) {
		if (h->op == OP_REQUEST && mode_echo && h->dst_port == listen_port) {
			c = alloc_conn();
			if (!c)
				return;
			c->state = OPEN;
			c->port = h->dst_port;
			c->peer = h->src_port;
			c->peer_buf_alloc = h->buf_alloc;
			c->peer_fwd_cnt = h->fwd_cnt;
			if (first_conn < 0)
				first_conn = c - conns;
			send_pkt(c, OP_RESPONSE, 0, 0, 0);
		} else if (h->op != OP_RST) {
			struct conn tmp = {.port = h->dst_port, .peer = h->src_port};
			send_pkt(&tmp, OP_RST, 0, 0, 0);
		}
		return;
	}
	c->peer_buf_alloc = h->buf_alloc;
	c->peer_fwd_cnt = h->fwd_cnt;
	switch (h->op) {
	case OP_RESPONSE:
		if (c->state == CONNECTING)
			c->state = OPEN;
		break;
	case OP_RST:
		c->state = c->state == CONNECTING ? REFUSED : CLOSED;
		if (mode_echo)
			served++;
		break;
	case OP_SHUTDOWN:
		send_pkt(c, OP_RST, 0, 0, 0);
		c->state = CLOSED;
		if (mode_echo)
			served++;
		break;
	case OP_RW:
		c->got += h->len;
		if (c == verify) {
			for (u32 i = 0; i < h->len; i++, checked++)
				mismatches += data[i] != (u8)(checked * 131 + (checked >> 9));
			c->fwd_cnt += h->len;
			break;
		}
		if (c->have + h->len > BUF_ALLOC) {
			printf("virtio-vsock: the device overran our credit\n");
			exit(1);
		}
		memcpy(c->buf + c->have, data, h->len);
		c->have += h->len;
		if (mode_echo) {
			if (c - conns == first_conn)
				sha_update(&sha, data, h->len);
			echo_out(c);
		} else {
			c->fwd_cnt += h->len;	/* the reader consumes as it compares */
		}
		break;
	case OP_CREDIT_REQUEST:
		send_pkt(c, OP_CREDIT_UPDATE, 0, 0, 0);
		break;
	case OP_CREDIT_UPDATE:
		break;
	}
	if (mode_echo && c->state == OPEN)
		echo_out(c);
	if (c->state == OPEN && c->fwd_cnt - c->fwd_sent >= BUF_ALLOC / 2)
		send_pkt(c, OP_CREDIT_UPDATE, 0, 0, 0);
}

/* handles what the device put in the rx ring; returns packets seen */
static int poll_rx(void)
{
	int n = 0, id;
	u32 len;
	reap_tx();
	while ((id = vq_pop(rxq, &len)) >= 0) {
		int b = rxhead2buf[id];
		vq_free_chain(rxq, id);
		if (len >= HDR) {
			struct hdr h;
			memcpy(&h, rxbuf[b], HDR);
			if (h.len <= len - HDR)
				on_packet(&h, rxbuf[b] + HDR);
		}
		post_rx(b);
		n++;
	}
	if (n)
		vq_kick(rxq);
	return n;
}

static struct conn *connect(u32 port, u32 local)
{
	struct conn *c = alloc_conn();
	if (!c)
		return 0;
	c->state = CONNECTING;
	c->port = local;
	c->peer = port;
	send_pkt(c, OP_REQUEST, 0, 0, 0);
	return c;
}

static void wait_state(struct conn *c, int not)
{
	while (c->state == not) {
		poll_rx();
		timeout_check("waiting for the host");
		cpu_relax();
	}
}

static int mode_connect(u32 port, u64 bytes)
{
	struct conn *c = connect(port, 40000);
	wait_state(c, CONNECTING);
	if (c->state != OPEN) {
		printf("virtio-vsock: host port %u refused the connection\n", port);
		return 1;
	}
	static u8 chunk[TXDATA];
	u64 sent = 0, t0 = rdtsc();
	verify = c;
	sha_init(&sha);
	while (checked < bytes) {
		while (sent < bytes && credit(c) > 0) {
			u32 n = bytes - sent < TXDATA ? bytes - sent : TXDATA;
			if (n > credit(c))
				n = credit(c);
			for (u32 i = 0; i < n; i++)
				chunk[i] = (u8)((sent + i) * 131 + ((sent + i) >> 9));
			sha_update(&sha, chunk, n);
			send_pkt(c, OP_RW, 0, chunk, n);
			sent += n;
		}
		poll_rx();
		if (c->state != OPEN && checked < bytes) {
			printf("virtio-vsock: the connection closed after %lu bytes\n", checked);
			return 1;
		}
		timeout_check("echo from the host");
	}
	u64 t = rdtsc() - t0;
	send_pkt(c, OP_SHUTDOWN, 3, 0, 0);
	wait_state(c, OPEN);
	char hex[65];
	sha_final(&sha, hex);
	printf("virtio-vsock: mode=connect bytes=%lu mismatches=%lu sha256=%s tsc_ms=%lu\n",
	       checked, mismatches, hex, tsc_khz() ? t / tsc_khz() : 0);
	return mismatches ? 1 : 0;
}

static int mode_many(u32 port, int n)
{
	struct conn *cs[MAXCONN];
	if (n > MAXCONN)
		n = MAXCONN;
	for (int i = 0; i < n; i++)
		cs[i] = connect(port, 41000 + i);
	for (int i = 0; i < n; i++)
		wait_state(cs[i], CONNECTING);
	int open = 0;
	for (int i = 0; i < n; i++)
		open += cs[i]->state == OPEN;
	for (int i = 0; i < n; i++) {
		char msg[32];
		int len = snprintf(msg, sizeof(msg), "conn %d\n", i);
		if (cs[i]->state == OPEN)
			send_pkt(cs[i], OP_RW, 0, msg, len);
	}
	int ok = 0;
	for (int i = 0; i < n; i++) {
		char msg[32];
		int len = snprintf(msg, sizeof(msg), "conn %d\n", i);
		while (cs[i]->state == OPEN && cs[i]->have < (u32)len) {
			poll_rx();
			timeout_check("echoes of the connections");
		}
		ok += cs[i]->have == (u32)len && !memcmp(cs[i]->buf, msg, len);
	}
	/* every one was open together: only now are they closed */
	int still = 0;
	for (int i = 0; i < n; i++)
		still += cs[i]->state == OPEN;
	for (int i = 0; i < n; i++)
		if (cs[i]->state == OPEN)
			send_pkt(cs[i], OP_SHUTDOWN, 3, 0, 0);
	for (int i = 0; i < n; i++)
		wait_state(cs[i], OPEN);
	printf("virtio-vsock: mode=many conns=%d open=%d ok=%d held=%d\n", n, open, ok, still);
	return ok == n && still == n ? 0 : 1;
}

static int mode_bad(u32 port)
{
	u64 before = rst_seen;
	int sent = 0;
	struct hdr h = {.src_cid = cid, .dst_cid = HOST_CID, .src_port = 42000, .dst_port = port,
			.type = 1, .buf_alloc = BUF_ALLOC};
	/* data on no connection */
	h.op = OP_RW;
	h.len = 4;
	send_raw(&h, "abcd", 4, HDR + 4), sent++;
	/* an unknown op */
	h.op = 99, h.len = 0, h.src_port++;
	send_raw(&h, 0, 0, HDR), sent++;
	/* a length beyond the buffer */
	h.op = OP_RW, h.len = 60000, h.src_port++;
	send_raw(&h, "xy", 2, HDR + 2), sent++;
	/* a stream type that does not exist */
	h.op = OP_REQUEST, h.type = 7, h.len = 0, h.src_port++;
	send_raw(&h, 0, 0, HDR), sent++;
	/* a host port nobody listens on */
	struct conn *c = connect(port + 1, 42100);
	sent++;
	while (rst_seen - before < (u64)sent) {
		poll_rx();
		timeout_check("RSTs for bad packets");
	}
	printf("virtio-vsock: mode=bad sent=%d rst=%lu refused=%d\n", sent, rst_seen - before,
	       c->state == REFUSED);
	return c->state == REFUSED ? 0 : 1;
}

static int mode_echo_run(u32 port, u64 n)
{
	mode_echo = 1;
	listen_port = port;
	sha_init(&sha);
	printf("virtio-vsock: listening on port %u\n", port);
	while (served < n) {
		poll_rx();
		timeout_check("echo connections");
		cpu_relax();
	}
	char hex[65];
	sha_final(&sha, hex);
	printf("virtio-vsock: mode=echo conns=%lu bytes=%lu sha256=%s\n", served, bytes_echoed, hex);
	return 0;
}

int main(void)
{
	const char *mode = param_str("mode", "echo");
	u64 k = tsc_khz() ? tsc_khz() : 3000000;
	deadline = rdtsc() + param_u64("timeout_ms", 30000) * k;
	if (virtio_probe(&dev, VIRTIO_DEV_VSOCK, param_u64("dev", 0)))
		return 2;
	if (virtio_iommu_setup(dev.pci.bdf))
		return 2;
	if (virtio_init(&dev, 1ull << VIRTIO_F_EVENT_IDX))
		return 2;
	for (int q = 0; q < 3; q++)
		if (virtio_setup_queue(&dev, q, QSIZE, 1))
			return 2;
	rxq = &dev.q[0];
	txq = &dev.q[1];
	cid = dev.devcfg ? mmio_read32(dev.devcfg) | (u64)mmio_read32(dev.devcfg + 4) << 32 : 0;
	for (int i = 0; i < QSIZE; i++) {
		txbuf[i] = dma_alloc(TXBUF, 64);
		tx_iova[i] = vmap(txbuf[i], TXBUF, DMA_TO_DEVICE);
	}
	for (int i = 0; i < NRX; i++) {
		rxbuf[i] = dma_alloc(RXBUF, 64);
		rx_iova[i] = vmap(rxbuf[i], RXBUF, DMA_FROM_DEVICE);
		post_rx(i);
	}
	virtio_driver_ok(&dev);
	vq_kick(rxq);
	if (virtio_status(&dev) & (VIRTIO_S_NEEDS_RESET | VIRTIO_S_FAILED)) {
		printf("virtio-vsock: device status %#x after DRIVER_OK\n", virtio_status(&dev));
		return 2;
	}
	printf("virtio-vsock cid=%lu features=%#lx\n", cid, dev.features);
	int r;
	if (!strcmp(mode, "echo"))
		r = mode_echo_run(param_u64("port", 1234), param_u64("conns", 1));
	else if (!strcmp(mode, "connect"))
		r = mode_connect(param_u64("port", 5000), param_u64("bytes", 1 << 20));
	else if (!strcmp(mode, "many"))
		r = mode_many(param_u64("port", 5000), param_u64("conns", 64));
	else if (!strcmp(mode, "bad"))
		r = mode_bad(param_u64("port", 5000));
	else {
		printf("virtio-vsock: mode=%s: echo, connect, many or bad\n", mode);
		return 2;
	}
	if (virtio_iommu) {
		iommu_dma_drain();
		iommu_dma_report();
	}
	return r;
}
