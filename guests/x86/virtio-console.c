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
 * Prints "virtio-console: features=F wrote=N read=M" (M: input bytes) and
 * "virtio-console: input=<the bytes read>" when read > 0. Exit 0; 1 an
 * output chain did not complete or the input did not come in time; 2 setup.
 */
#include "libcflat.h"
#include "virtio.h"

#define VIRTIO_DEV_CONSOLE	0x1043
#define RXQ	0
#define TXQ	1
#define RX_BUFS	4
#define RX_SIZE	256

static struct virtio_dev dev;
static char line[512];
static char input[4096];
static u8 *txbuf;
static u8 *rx_of[64];		/* the buffer of each posted receive chain, by head */

/* sends one chain of `len` bytes on port 0 and waits for it */
static int send(const char *s, u32 len, u64 timeout_tsc)
{
	struct virtq *q = &dev.q[TXQ];
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

static void post_rx(u8 *buf)
{
	struct virtq *q = &dev.q[RXQ];
	int head = vq_alloc_chain(q, 1);
	if (head < 0)
		return;
	rx_of[head] = buf;
	q->desc[head].addr = vmap(buf, RX_SIZE, DMA_FROM_DEVICE);
	q->desc[head].len = RX_SIZE;
	q->desc[head].flags = VRING_DESC_F_WRITE;
	vq_push(q, head);
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
	if (virtio_init(&dev, 1ull << VIRTIO_F_EVENT_IDX))
		return 2;
	if (virtio_setup_queue(&dev, RXQ, 64, 1) || virtio_setup_queue(&dev, TXQ, 64, 1))
		return 2;
	txbuf = dma_alloc(sizeof(line), 16);
	u8 *rx[RX_BUFS];
	for (int i = 0; i < RX_BUFS; i++) {
		rx[i] = dma_alloc(RX_SIZE, 16);
		post_rx(rx[i]);
	}
	virtio_driver_ok(&dev);
	if (virtio_status(&dev) & (VIRTIO_S_NEEDS_RESET | VIRTIO_S_FAILED)) {
		printf("virtio-console: device status %#x after DRIVER_OK\n", virtio_status(&dev));
		return 2;
	}
	vq_kick(&dev.q[RXQ]);

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
		u8 *buf = rx_of[id];
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
