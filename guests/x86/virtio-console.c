/*
 * virtio-console: writes a known text on port 0 of a modern virtio-console
 * PCI device (virtio device id 3, PCI 1af4:1043), then reads input if asked,
 * polled (the used rings spun on).
 *
 * Params: text (default "hello from the virtio-console probe"; '_' is sent
 * as a space, since the command line splits at spaces), lines=1 (how many
 * times the text is sent, one chain per line, "N: text\n"), read=0 (bytes
 * of input to wait for on the receive queue; each chunk read is echoed
 * back on port 0 as "echo: ...\n"), timeout_ms=10000 (for output
 * completions and for the input).
 *
 * Multiport (when the device offers F_MULTIPORT): the driver's side of the
 * control protocol, as Linux's: DEVICE_READY, then PORT_READY for each
 * DEVICE_ADD; it records CONSOLE_PORT, PORT_NAME and PORT_OPEN, and once
 * every port is open writes "N: port P text\n" on each port P > 0 too.
 *
 * Prints "virtio-console: ports=N console=C opened=O names=a,b" with
 * multiport, "virtio-console: features=F wrote=N read=M" (M: input bytes)
 * and "virtio-console: input=<the bytes read>" when read > 0. Exit 0; 1 an
 * output chain did not complete, the ports did not open or the input did
 * not come in time; 2 setup.
 */
#include "libcflat.h"
#include "virtio.h"

#define VIRTIO_DEV_CONSOLE	0x1043
#define RXQ	0
#define TXQ	1
#define RX_BUFS	4
#define RX_SIZE	256
#define CTRL_RXQ	2
#define CTRL_TXQ	3
#define F_MULTIPORT	1
#define MAX_PORTS	16

#define EV_DEVICE_READY	0
#define EV_DEVICE_ADD	1
#define EV_PORT_READY	3
#define EV_CONSOLE_PORT	4
#define EV_PORT_OPEN	6
#define EV_PORT_NAME	7

static struct virtio_dev dev;
static char line[512];
static char input[4096];
static u8 *txbuf;
static u8 *rx_of[4][64];	/* the buffer of each posted receive chain, by queue and head */

/* sends one chain of `len` bytes on queue `qi` and waits for it */
static int send_on(int qi, const char *s, u32 len, u64 timeout_tsc)
{
	struct virtq *q = &dev.q[qi];
	u8 *buf = txbuf;
	if (len > sizeof(line))
		len = sizeof(line);
	memcpy(buf, s, len);
	int head = vq_alloc_chain(q, 1);
	if (head < 0)
		return -1;
	u64 iova = vmap(buf, len, DMA_TO_DEVICE);
	q->desc[head].addr = iova;
	q->desc[head].len = len;
	q->desc[head].flags = 0;
	vq_push(q, head);
	vq_kick(q);
	u64 t0 = rdtsc();
	while (!vq_has_used(q)) {
		if (rdtsc() - t0 > timeout_tsc)
			return -1;
		cpu_relax();
	}
	u32 used = 0;
	int id = vq_pop(q, &used);
	vq_free_chain(q, head);
	vunmap(iova, len);
	return id == head ? 0 : -1;
}

static int send(const char *s, u32 len, u64 timeout_tsc)
{
	return send_on(TXQ, s, len, timeout_tsc);
}

static void post_on(int qi, u8 *buf)
{
	struct virtq *q = &dev.q[qi];
	int head = vq_alloc_chain(q, 1);
	if (head < 0)
		return;
	rx_of[qi][head] = buf;
	q->desc[head].addr = vmap(buf, RX_SIZE, DMA_FROM_DEVICE);
	q->desc[head].len = RX_SIZE;
	q->desc[head].flags = VRING_DESC_F_WRITE;
	vq_push(q, head);
}

static void post_rx(u8 *buf)
{
	post_on(RXQ, buf);
}

static int control_send(u32 id, u16 ev, u16 value, u64 timeout_tsc)
{
	u8 m[8];
	memcpy(m, &id, 4);
	memcpy(m + 4, &ev, 2);
	memcpy(m + 6, &value, 2);
	return send_on(CTRL_TXQ, (const char *)m, 8, timeout_tsc);
}

static char names[MAX_PORTS][64];
static int opened[MAX_PORTS];

/* the control protocol until every port is open; returns the console port or -1 */
static int multiport_up(u32 nports, u64 timeout_tsc, u32 *nopen)
{
	struct virtq *q = &dev.q[CTRL_RXQ];
	int console = -1;
	*nopen = 0;
	if (control_send(0, EV_DEVICE_READY, 1, timeout_tsc))
		return -1;
	u64 t0 = rdtsc();
	while (*nopen < nports && rdtsc() - t0 < timeout_tsc) {
		if (!vq_has_used(q)) {
			cpu_relax();
			continue;
		}
		u32 len = 0;
		int id = vq_pop(q, &len);
		if (id < 0 || id >= 64)
			continue;
		u8 *m = rx_of[CTRL_RXQ][id];
		vunmap(q->desc[id].addr, RX_SIZE);
		vq_free_chain(q, id);
		u32 port;
		u16 ev, value;
		memcpy(&port, m, 4);
		memcpy(&ev, m + 4, 2);
		memcpy(&value, m + 6, 2);
		if (len >= 8 && port < MAX_PORTS) {
			if (ev == EV_DEVICE_ADD)
				control_send(port, EV_PORT_READY, 1, timeout_tsc);
			else if (ev == EV_CONSOLE_PORT && value)
				console = port;
			else if (ev == EV_PORT_NAME) {
				u32 n = len - 8 < 63 ? len - 8 : 63;
				memcpy(names[port], m + 8, n);
				names[port][n] = 0;
			} else if (ev == EV_PORT_OPEN && value && !opened[port]) {
				opened[port] = 1;
				(*nopen)++;
			}
		}
		post_on(CTRL_RXQ, m);
		vq_kick(q);
	}
	return console;
}

int main(void)
{
	const char *text = param_str("text", "hello from the virtio-console probe");
	u64 lines = param_u64("lines", 1);
	u64 want = param_u64("read", 0);
	u64 k = tsc_khz() ? tsc_khz() : 3000000;
	u64 timeout_tsc = param_u64("timeout_ms", 10000) * k;
	if (want >= sizeof(input))
		want = sizeof(input) - 1;
	if (virtio_probe(&dev, VIRTIO_DEV_CONSOLE, 0))
		return 2;
	if (virtio_iommu_setup(dev.pci.bdf))
		return 2;
	if (virtio_init(&dev, 1ull << VIRTIO_F_EVENT_IDX | 1ull << F_MULTIPORT))
		return 2;
	int multiport = virtio_has(&dev, F_MULTIPORT);
	u32 nports = multiport ? vc_read32(&dev, 4) : 1;
	if (!nports || nports > MAX_PORTS) {
		printf("virtio-console: max_nr_ports=%u\n", nports);
		return 2;
	}
	u32 nq = multiport ? 2 + 2 * nports : 2;
	for (u32 qi = 0; qi < nq; qi++)
		if (virtio_setup_queue(&dev, qi, 64, 1))
			return 2;
	txbuf = dma_alloc(sizeof(line), 16);
	u8 *rx[RX_BUFS];
	for (int i = 0; i < RX_BUFS; i++) {
		rx[i] = dma_alloc(RX_SIZE, 16);
		post_rx(rx[i]);
		if (multiport)
			post_on(CTRL_RXQ, dma_alloc(RX_SIZE, 16));
	}
	virtio_driver_ok(&dev);
	if (virtio_status(&dev) & (VIRTIO_S_NEEDS_RESET | VIRTIO_S_FAILED)) {
		printf("virtio-console: device status %#x after DRIVER_OK\n", virtio_status(&dev));
		return 2;
	}
	vq_kick(&dev.q[RXQ]);
	if (multiport) {
		vq_kick(&dev.q[CTRL_RXQ]);
		u32 nopen = 0;
		int console = multiport_up(nports, timeout_tsc, &nopen);
		printf("virtio-console: ports=%u console=%d opened=%u names=", nports, console,
		       nopen);
		for (u32 p = 1; p < nports; p++)
			printf("%s%s", p > 1 ? "," : "", names[p]);
		printf("\n");
		if (nopen != nports) {
			printf("virtio-console: only %u of %u ports opened\n", nopen, nports);
			return 1;
		}
	}

	char t[256];
	u32 tl = 0;
	for (; text[tl] && tl < sizeof(t) - 1; tl++)
		t[tl] = text[tl] == '_' ? ' ' : text[tl];
	t[tl] = 0;
	u64 wrote = 0;
	for (u64 i = 0; i < lines; i++) {
		int n = snprintf(line, sizeof(line), "%lu: %s\n", i, t);
		if (send(line, n, timeout_tsc)) {
			printf("virtio-console: line %lu: no completion\n", i);
			return 1;
		}
		wrote += n;
		for (u32 p = 1; multiport && p < nports; p++) {
			n = snprintf(line, sizeof(line), "%lu: port %u %s\n", i, p, t);
			if (send_on(2 * p + 3, line, n, timeout_tsc)) {
				printf("virtio-console: port %u line %lu: no completion\n", p, i);
				return 1;
			}
		}
	}

	u64 got = 0;
	struct virtq *q = &dev.q[RXQ];
	u64 t0 = rdtsc();
	while (got < want) {
		if (!vq_has_used(q)) {
			if (rdtsc() - t0 > timeout_tsc) {
				printf("virtio-console: features=%#lx wrote=%lu read=%lu\n",
				       dev.features, wrote, got);
				printf("virtio-console: input timed out after %lu of %lu bytes\n", got,
				       want);
				return 1;
			}
			cpu_relax();
			continue;
		}
		u32 len = 0;
		int id = vq_pop(q, &len);
		if (id < 0 || id >= 64)
			continue;
		u8 *buf = rx_of[RXQ][id];
		vunmap(q->desc[id].addr, RX_SIZE);
		vq_free_chain(q, id);
		if (len > RX_SIZE)
			len = RX_SIZE;
		u32 take = len < want - got ? len : want - got;
		memcpy(input + got, buf, take);
		got += take;
		memcpy(line, "echo: ", 6);
		memcpy(line + 6, buf, take);
		line[6 + take] = '\n';
		send(line, 7 + take, timeout_tsc);
		post_rx(buf);
		vq_kick(q);
	}
	input[got] = 0;
	printf("virtio-console: features=%#lx wrote=%lu read=%lu\n", dev.features, wrote, got);
	if (want)
		printf("virtio-console: input=%s\n", input);
	return 0;
}
