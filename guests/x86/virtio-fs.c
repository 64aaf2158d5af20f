/*
 * virtio-fs: talks FUSE to a modern virtio-fs PCI device (virtio device id
 * 26, PCI 1af4:105a) over its first request queue (queue 1; queue 0 is the
 * high-priority queue, set up and left idle), polled.
 *
 * Params: file=NAME (a file in the share's root to look up, open and read;
 * none: FUSE_INIT only), bytes=4096 (read at most this much of it, 1 to
 * 65536), timeout_ms=5000 (per request), dev=0 (which virtio-fs),
 * rounds=1 (reset the device and do it all again this many times: the
 * second and later rounds send no FUSE_INIT, the session being the
 * back-end's, and print their lines with "round=N").
 *
 * Prints "virtio-fs tag=T request_queues=N" from the configuration space,
 * "virtio-fs init major=M minor=m max_write=W" from FUSE_INIT's reply, and
 * with file=: "virtio-fs file=NAME size=S read=R fnv=H" (H: FNV-1a 64 of
 * the bytes read, in hex). Exit 0; 1 when a request fails (the FUSE error
 * is printed) or times out; 2 when setup fails.
 */
#include "libcflat.h"
#include "virtio.h"

#define VIRTIO_DEV_FS	0x105a

#define FUSE_LOOKUP	1
#define FUSE_OPEN	14
#define FUSE_READ	15
#define FUSE_INIT	26
#define FUSE_ROOT_ID	1

struct fuse_in_header {
	u32 len, opcode;
	u64 unique, nodeid;
	u32 uid, gid, pid;
	u16 total_extlen, padding;
};

struct fuse_out_header {
	u32 len;
	s32 error;
	u64 unique;
};

struct fuse_init_in {
	u32 major, minor, max_readahead, flags;
};

struct fuse_init_out {
	u32 major, minor, max_readahead, flags;
	u16 max_background, congestion_threshold;
	u32 max_write, time_gran;
	u16 max_pages, map_alignment;
	u32 flags2, unused[7];
};

struct fuse_attr {
	u64 ino, size, blocks, atime, mtime, ctime;
	u32 atimensec, mtimensec, ctimensec, mode, nlink, uid, gid, rdev, blksize, flags;
};

struct fuse_entry_out {
	u64 nodeid, generation, entry_valid, attr_valid;
	u32 entry_valid_nsec, attr_valid_nsec;
	struct fuse_attr attr;
};

struct fuse_open_in {
	u32 flags, open_flags;
};

struct fuse_open_out {
	u64 fh;
	u32 open_flags, padding;
};

struct fuse_read_in {
	u64 fh, offset;
	u32 size, read_flags;
	u64 lock_owner;
	u32 flags, padding;
};

static struct virtio_dev dev;
static struct virtq *q;
static u64 timeout_tsc, unique;
static u8 *req, *rsp;

/* One request: header + `arg` out, reply header + up to `out_len` bytes
 * in. Returns the reply's payload length, or -1 (printed). */
static long fuse(u32 opcode, u64 nodeid, const void *arg, u32 arg_len, u32 out_len)
{
	struct fuse_in_header *h = (void *)req;
	memset(h, 0, sizeof(*h));
	h->len = sizeof(*h) + arg_len;
	h->opcode = opcode;
	h->unique = ++unique;
	h->nodeid = nodeid;
	memcpy(req + sizeof(*h), arg, arg_len);
	memset(rsp, 0, sizeof(struct fuse_out_header) + out_len);
	int head = vq_alloc_chain(q, 2);
	if (head < 0) {
		printf("virtio-fs: no free descriptor\n");
		return -1;
	}
	u16 next = q->desc[head].next;
	q->desc[head].addr = (u64)req;
	q->desc[head].len = h->len;
	q->desc[head].flags = VRING_DESC_F_NEXT;
	q->desc[next].addr = (u64)rsp;
	q->desc[next].len = sizeof(struct fuse_out_header) + out_len;
	q->desc[next].flags = VRING_DESC_F_WRITE;
	vq_push(q, head);
	vq_kick(q);
	u64 w0 = rdtsc();
	while (!vq_has_used(q)) {
		if (rdtsc() - w0 > timeout_tsc) {
			printf("virtio-fs: opcode %u: no reply (timeout, status %#x)\n", opcode,
			       virtio_status(&dev));
			return -1;
		}
		cpu_relax();
	}
	u32 len = 0;
	int id = vq_pop(q, &len);
	vq_free_chain(q, head);
	struct fuse_out_header *o = (void *)rsp;
	if (id != head || len < sizeof(*o) || o->unique != h->unique) {
		printf("virtio-fs: opcode %u: used id %d len %u unique %lu (head %d, unique %lu)\n",
		       opcode, id, len, o->unique, head, h->unique);
		return -1;
	}
	if (o->error) {
		printf("virtio-fs: opcode %u: FUSE error %d\n", opcode, o->error);
		return -1;
	}
	return o->len - sizeof(*o);
}

static int session(int round, const char *file, u64 bytes);

int main(void)
{
	const char *file = param_str("file", "");
	u64 bytes = param_u64("bytes", 4096);
	u64 rounds = param_u64("rounds", 1);
	u64 k = tsc_khz() ? tsc_khz() : 3000000;
	timeout_tsc = param_u64("timeout_ms", 5000) * k;
	if (!bytes || bytes > 65536) {
		printf("virtio-fs: bytes=%lu: give 1 to 65536\n", bytes);
		return 2;
	}
	if (virtio_probe(&dev, VIRTIO_DEV_FS, param_u64("dev", 0)))
		return 2;
	req = dma_alloc(4096, 4096);
	rsp = dma_alloc(65536 + 4096, 4096);
	for (u64 r = 0; r < rounds; r++) {
		int e = session(r, file, bytes);
		if (e)
			return e;
	}
	return 0;
}

/* Reset, negotiate, set up the queues, DRIVER_OK; FUSE_INIT in round 0; the
 * file's lookup, open and read. 0, or the exit code. */
static int session(int round, const char *file, u64 bytes)
{
	if (round)
		printf("virtio-fs round=%d\n", round);
	if (virtio_init(&dev, 0))
		return 2;
	if (dev.num_queues < 2 || !dev.devcfg || dev.devcfg_len < 40) {
		printf("virtio-fs: %u queues, config of %u bytes\n", dev.num_queues, dev.devcfg_len);
		return 2;
	}
	char tag[37];
	for (int i = 0; i < 36; i++)
		tag[i] = mmio_read8(dev.devcfg + i);
	tag[36] = 0;
	printf("virtio-fs tag=%s request_queues=%u\n", tag, mmio_read32(dev.devcfg + 36));
	if (virtio_setup_queue(&dev, 0, 64, 1) || virtio_setup_queue(&dev, 1, 64, 1))
		return 2;
	q = &dev.q[1];
	virtio_driver_ok(&dev);
	if (virtio_status(&dev) & (VIRTIO_S_NEEDS_RESET | VIRTIO_S_FAILED)) {
		printf("virtio-fs: device status %#x after DRIVER_OK\n", virtio_status(&dev));
		return 2;
	}

	if (!round) {
		struct fuse_init_in init = { .major = 7, .minor = 31 };
		if (fuse(FUSE_INIT, 0, &init, sizeof(init), sizeof(struct fuse_init_out)) < 0)
			return 1;
		struct fuse_init_out *io = (void *)(rsp + sizeof(struct fuse_out_header));
		printf("virtio-fs init major=%u minor=%u max_write=%u\n", io->major, io->minor,
		       io->max_write);
		if (io->major != 7)
			return 1;
	}
	if (!file[0])
		return 0;

	u32 nlen = strlen(file) + 1;
	if (nlen > 256) {
		printf("virtio-fs: file name too long\n");
		return 2;
	}
	if (fuse(FUSE_LOOKUP, FUSE_ROOT_ID, file, nlen, sizeof(struct fuse_entry_out)) < 0)
		return 1;
	struct fuse_entry_out *e = (void *)(rsp + sizeof(struct fuse_out_header));
	u64 node = e->nodeid, size = e->attr.size;
	struct fuse_open_in oi = { .flags = 0 };
	if (fuse(FUSE_OPEN, node, &oi, sizeof(oi), sizeof(struct fuse_open_out)) < 0)
		return 1;
	u64 fh = ((struct fuse_open_out *)(rsp + sizeof(struct fuse_out_header)))->fh;
	struct fuse_read_in ri = { .fh = fh, .offset = 0, .size = bytes };
	long got = fuse(FUSE_READ, node, &ri, sizeof(ri), bytes);
	if (got < 0)
		return 1;
	u64 h = 0xcbf29ce484222325ull;
	const u8 *d = rsp + sizeof(struct fuse_out_header);
	for (long i = 0; i < got; i++)
		h = (h ^ d[i]) * 0x100000001b3ull;
	printf("virtio-fs file=%s size=%lu read=%ld fnv=%lx\n", file, size, got, h);
	return 0;
}
