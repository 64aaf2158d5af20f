/*
 * stream: the I/O-bound guest of the pools workloads (the paper's
 * `dd if=/dev/zero bs=64k | netcat`): transmits frames over virtio-net as
 * fast as the device takes them, in 64 KiB "writes", and blocks (hlt) while
 * the tx queue is full, as a guest kernel's socket write would. Meant for
 * `--net backend=sink,rate=MBIT` (a paced link) but runs against any back-end
 * (received frames are recycled and ignored).
 *
 * Params: size=1514 (frame bytes without the virtio header, 60-1514),
 * chunk=64k (bytes per write: frames are pushed and kicked a chunk at a
 * time), mib=64 (stop after this many MiB; 0 = no limit), seconds=0 (stop
 * after this long by the TSC; 0 = no limit; with both 0 it never stops),
 * report_mb=10 (LUCID_HC_WORK bytes report every this many MiB), halt=1
 * (0: spin instead of hlt while waiting), tick_ms=10 (a LAPIC timer tick
 * that bounds every hlt; 0 = none), qsize=256, timeout_ms=5000 (no
 * progress for this long fails the run), dev=0.
 *
 * Prints "stream mac=.. size= chunk= qsize= halt=" at start and at the end
 * "stream bytes=B frames=F tsc=T mb_per_s=X kicks=K irqs=I waits=W
 * reports=R reported_bytes=RB". Exit 0; 1 timeout; 2 setup.
 */
#include "libcflat.h"
#include "virtio.h"

#define NET_HDR		12
#define ETHERTYPE	0x88b5
#define TICK_VECTOR	0x30

static struct virtio_dev dev;
static struct virtq *txq;
static volatile u64 *irq_counter;

/*
 * CPL0 (through cpl0_call): sleep until an interrupt unless one came since
 * `seen` (checked with IF=0, so none is lost between the check and the hlt:
 * sti's shadow covers the hlt). The interrupt that ends the hlt nests inside
 * the int3 gate and, like it, switches to the top of IST1 (the interrupt
 * stubs find the per-CPU block from there), overwriting the gate's iretq
 * frame and its pad: 48 bytes, saved before and restored after.
 */
static u64 *ist1_top;

static u64 halt_fn(u64 seen)
{
	u64 saved[6];

	if (*irq_counter != seen)
		return 1;
	for (int i = 0; i < 6; i++)
		saved[i] = ist1_top[i - 6];
	asm volatile("sti; hlt; cli" ::: "memory");
	for (int i = 0; i < 6; i++)
		ist1_top[i - 6] = saved[i];
	return 0;
}

/* ask for an interrupt after k more completions (EVENT_IDX), else after the next;
 * returns 1 if completions arrived meanwhile */
static int arm_after(struct virtq *q, u16 k)
{
	if (!q->event_idx || k <= 1)
		return vq_arm(q);
	*(volatile u16 *)&q->avail->ring[q->size] = (u16)(q->last_used + k - 1);
	mb();
	return vq_has_used(q);
}

static u64 waits, inflight;

static int reap(void)
{
	int n = 0, id;
	while ((id = vq_pop(txq, NULL)) >= 0) {
		if (id >= txq->size || !inflight) {
			printf("stream: bogus tx used id %d\n", id);
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
	u64 size = param_u64("size", 1514);
	u64 chunk = param_u64("chunk", 64 * 1024);
	u64 max_bytes = param_u64("mib", 64) << 20;
	u64 seconds = param_u64("seconds", 0);
	u64 report = param_u64("report_mb", 10) << 20;
	int halt = param_u64("halt", 1) != 0;
	u64 tick_ms = param_u64("tick_ms", 10);
	char b[32];

	if (size < 60 || size > 1514) {
		printf("stream: size must be 60-1514\n");
		return 2;
	}
	u64 k = tsc_khz() ? tsc_khz() : 3000000;
	u64 timeout_tsc = param_u64("timeout_ms", 5000) * k;
	u64 end_tsc = seconds ? seconds * 1000 * k : 0;
	if (!report)
		report = 10 << 20;

	if (virtio_probe(&dev, VIRTIO_DEV_NET, param_u64("dev", 0)))
		return 2;
	if (virtio_init(&dev, (1ull << VIRTIO_NET_F_MAC) | (1ull << VIRTIO_F_EVENT_IDX)))
		return 2;
	u16 qsize = param_u64("qsize", 256);
	if (virtio_setup_queue(&dev, 0, qsize, 0) || virtio_setup_queue(&dev, 1, qsize, 0))
		return 2;
	txq = &dev.q[1];
	u8 mac[6] = { 0x52, 0x54, 0, 0x12, 0x34, 0x56 };
	if (virtio_has(&dev, VIRTIO_NET_F_MAC) && dev.devcfg)
		for (int i = 0; i < 6; i++)
			mac[i] = mmio_read8(dev.devcfg + i);

	/* one prebuilt buffer per descriptor: header, our MAC both ways, ethertype, zeros */
	u8 **buf = dma_alloc(8ul * txq->size, 64);
	for (int i = 0; i < txq->size; i++) {
		buf[i] = dma_alloc(NET_HDR + size, 64);
		memcpy(buf[i] + NET_HDR, mac, 6);
		memcpy(buf[i] + NET_HDR + 6, mac, 6);
		buf[i][NET_HDR + 12] = ETHERTYPE >> 8;
		buf[i][NET_HDR + 13] = ETHERTYPE & 0xff;
	}
	u64 per_chunk = (chunk + size - 1) / size;
	if (per_chunk < 1)
		per_chunk = 1;
	if (per_chunk > txq->size)
		per_chunk = txq->size;

	virtio_driver_ok(&dev);
	if (virtio_status(&dev) & (VIRTIO_S_NEEDS_RESET | VIRTIO_S_FAILED)) {
		printf("stream: device status %#x after DRIVER_OK\n", virtio_status(&dev));
		return 2;
	}
	irq_counter = &this_cpu()->irq_count;
	ist1_top = (u64 *)this_cpu();	/* rsp0 = IST1 = the per-CPU block (boot.S) */
	if (halt) {
		if (txq->vector < 0) {
			printf("stream: no MSI-X vector for tx; use halt=0\n");
			return 2;
		}
		if (tick_ms) {
			/* a periodic LAPIC timer (KVM's APIC bus: 1 GHz) bounds every hlt */
			lapic_write(0x3e0, 0xb);			/* divide by 1 */
			lapic_write(0x320, (1 << 17) | TICK_VECTOR);	/* periodic */
			lapic_write(0x380, tick_ms * 1000000);
		}
	}
	printf("stream mac=%02x:%02x:%02x:%02x:%02x:%02x size=%lu chunk=%lu frames_per_chunk=%lu "
	       "qsize=%u halt=%d\n", mac[0], mac[1], mac[2], mac[3], mac[4], mac[5], size,
	       chunk, per_chunk, txq->size, halt);

	u64 irq0 = this_cpu()->irq_count;
	u64 bytes = 0, frames = 0, unreported = 0, reports = 0, reported = 0;
	u64 t0 = rdtsc(), progress = t0;
	int rc = 0;
	for (;;) {
		u64 now = rdtsc();
		if ((max_bytes && bytes >= max_bytes) || (end_tsc && now - t0 >= end_tsc))
			break;
		/* a 64 KiB write: wait until the queue has room for the whole chunk */
		if (reap())
			progress = now;
		if (txq->num_free < per_chunk) {
			if (now - progress > timeout_tsc) {
				printf("stream: no tx completion for %lu ms (timeout)\n",
				       (now - progress) / k);
				rc = 1;
				break;
			}
			if (arm_after(txq, per_chunk - txq->num_free))
				continue;
			waits++;
			if (!halt) {
				cpu_relax();
				continue;
			}
			u64 seen = *irq_counter;
			while (irq_take() >= 0)
				;
			if (vq_has_used(txq))
				continue;
			cpl0_call(halt_fn, seen);
			while (irq_take() >= 0)
				;
			continue;
		}
		for (u64 i = 0; i < per_chunk; i++) {
			int head = vq_alloc_chain(txq, 1);
			if (head < 0)
				break;
			txq->desc[head].addr = (u64)buf[head];
			txq->desc[head].len = NET_HDR + size;
			txq->desc[head].flags = 0;
			vq_push(txq, head);
			inflight++;
			frames++;
			bytes += size;
			unreported += size;
		}
		vq_kick(txq);
		if (unreported >= report) {
			lucid_hypercall(LUCID_HC_WORK, LUCID_WORK_BYTES, unreported, 0);
			reported += unreported;
			unreported = 0;
			reports++;
		}
	}
	u64 t = rdtsc() - t0;
	if (unreported) {
		lucid_hypercall(LUCID_HC_WORK, LUCID_WORK_BYTES, unreported, 0);
		reported += unreported;
		reports++;
	}
	if (halt && tick_ms)
		lapic_write(0x380, 0);		/* stop the tick */
	/* mb_per_s: MB (10^6 bytes) per second x 1000 */
	u64 mbps = tsc_khz() && t ? bytes * tsc_khz() / t : 0;
	printf("stream bytes=%lu frames=%lu tsc=%lu mb_per_s=%s kicks=%lu irqs=%lu waits=%lu "
	       "reports=%lu reported_bytes=%lu\n",
	       bytes, frames, t, tsc_khz() ? fmt_milli(b, mbps) : "unknown", txq->kicks,
	       this_cpu()->irq_count - irq0, waits, reports, reported);
	return rc;
}
