/*
 * virtio-rng: reads entropy from a modern virtio-rng PCI device (virtio
 * device id 4, PCI 1af4:1044), one device-writable buffer per request,
 * polled (interrupts suppressed, the used ring spun on).
 *
 * Params: bytes=65536 (how many to read), chunk=4096 (buffer size of one
 * request; the device may fill less), timeout_ms=10000 (per request: a
 * rate-limited device makes a request wait), dev=0 (which virtio-rng),
 * iommu=vtd (each buffer mapped through the VT-d for its request,
 * strategy= as for virtio-blk; prints an "iommu-dma ..." line; exit 1 if
 * the unit recorded faults).
 *
 * Checks: every completion is of the request's buffer, 1..chunk bytes; the
 * bytes are not all zero, and with 4 KiB or more read at least 200 of the
 * 256 byte values occur (a stuck or repeating source fails).
 *
 * Prints "virtio-rng: bytes=N requests=R distinct=D tsc_ms=T" (T: TSC
 * milliseconds from the first request to the last completion, 0 if the
 * TSC frequency is unknown). Exit 0; 1 when a check fails or a request
 * times out; 2 when setup fails.
 */
#include "libcflat.h"
#include "virtio.h"

#define VIRTIO_DEV_RNG	0x1044

static struct virtio_dev dev;

int main(void)
{
	u64 bytes = param_u64("bytes", 65536);
	u64 chunk = param_u64("chunk", 4096);
	u64 k = tsc_khz() ? tsc_khz() : 3000000;
	u64 timeout_tsc = param_u64("timeout_ms", 10000) * k;
	if (!chunk || chunk > (1 << 20)) {
		printf("virtio-rng: chunk=%lu: give 1 to 1m\n", chunk);
		return 2;
	}
	if (virtio_probe(&dev, VIRTIO_DEV_RNG, param_u64("dev", 0)))
		return 2;
	if (virtio_iommu_setup(dev.pci.bdf))
		return 2;
	if (virtio_init(&dev, 1ull << VIRTIO_F_EVENT_IDX))
		return 2;
	if (virtio_setup_queue(&dev, 0, 64, 1))
		return 2;
	struct virtq *q = &dev.q[0];
	u8 *buf = dma_alloc(chunk, 64);
	virtio_driver_ok(&dev);
	if (virtio_status(&dev) & (VIRTIO_S_NEEDS_RESET | VIRTIO_S_FAILED)) {
		printf("virtio-rng: device status %#x after DRIVER_OK\n", virtio_status(&dev));
		return 2;
	}

	u64 seen[256 / 64] = {0}, done = 0, requests = 0, nonzero = 0;
	u64 t0 = rdtsc();
	while (done < bytes) {
		int head = vq_alloc_chain(q, 1);
		if (head < 0) {
			printf("virtio-rng: no free descriptor\n");
			return 1;
		}
		memset(buf, 0, chunk);
		u64 iova = vmap(buf, chunk, DMA_FROM_DEVICE);
		q->desc[head].addr = iova;
		q->desc[head].len = chunk;
		q->desc[head].flags = VRING_DESC_F_WRITE;
		vq_push(q, head);
		vq_kick(q);
		u64 w0 = rdtsc();
		while (!vq_has_used(q)) {
			if (rdtsc() - w0 > timeout_tsc) {
				printf("virtio-rng: request %lu: no completion (timeout, status %#x)\n",
				       requests, virtio_status(&dev));
				return 1;
			}
			cpu_relax();
		}
		u32 len = 0;
		int id = vq_pop(q, &len);
		if (id != head || len == 0 || len > chunk) {
			printf("virtio-rng: request %lu: used id %d len %u (head %d, chunk %lu)\n",
			       requests, id, len, head, chunk);
			return 1;
		}
		vq_free_chain(q, head);
		vunmap(iova, chunk);
		requests++;
		if (len > bytes - done)
			len = bytes - done;
		for (u32 i = 0; i < len; i++) {
			seen[buf[i] >> 6] |= 1ull << (buf[i] & 63);
			nonzero += buf[i] != 0;
		}
		done += len;
	}
	u64 t = rdtsc() - t0;
	if (virtio_iommu) {
		iommu_dma_drain();
		iommu_dma_report();
	}
	u64 distinct = 0;
	for (int i = 0; i < 256; i++)
		distinct += (seen[i >> 6] >> (i & 63)) & 1;
	printf("virtio-rng: bytes=%lu requests=%lu distinct=%lu tsc_ms=%lu\n", done, requests,
	       distinct, tsc_khz() ? t / tsc_khz() : 0);
	if (virtio_iommu && iommu_stats.faults_seen) {
		printf("virtio-rng: FAIL: the VT-d recorded %lu faults\n", iommu_stats.faults_seen);
		return 1;
	}
	if (!nonzero || (done >= 4096 && distinct <= 200)) {
		printf("virtio-rng: FAIL: the bytes do not look random (nonzero=%lu)\n", nonzero);
		return 1;
	}
	return 0;
}
