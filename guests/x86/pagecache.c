/*
 * pagecache: a guest OS with a page cache over virtio-blk, for the VSWAPPER
 * workloads (docs/vswapper.md). The guest believes it has all of --memory: 4 KiB
 * frames from cache_base up to the end of RAM hold cached disk blocks (and,
 * in mode=alloc, "process" memory), while the host may keep far less of it
 * resident (--memory-limit). Every byte the guest reads is checked.
 *
 * Block content (4 KiB logical blocks; the host twin is
 * lucid_guests::pagecache::block, used by the tests and the bench to make
 * the image): block b of version v with seed s holds u64 words
 * w[0]=b, w[1]=s, w[2]=v, w[3..512] an xorshift stream seeded from
 * (b, s, v) picking one of 16 seed-derived tokens (compressible, like
 * text). Version 0 is the image as made; version 0xffff means zeros
 * (discarded or write-zeroed). A misplaced, stale or torn block is seen.
 *
 * Params: mode=reread|alloc|compress|consistency|durable|hostile (reread),
 * mib=N (200: the file, blocks 0..N*256, at the start of the disk),
 * iters=N (3), seed=S (0x5eed), cache_base=A (32m: first cache frame),
 * ra=N (32: blocks per read request, the read-ahead), qd=N (4: requests
 * in flight), timeout_ms=N (60000 per wait), phases=0|1 (1: call
 * LUCID_HC_PHASE at each iteration start), balloon=0|1 (1: drive a
 * virtio-balloon: the top frames of the cache go to the balloon as its
 * target says, polled at every read-ahead window; deflate on OOM in
 * mode=alloc when negotiated, else FAIL as an out-of-memory guest would).
 *   reread: read the file sequentially iters times through the cache (the
 *     paper's Fig. 4.9): misses go to the disk, hits read the cached frame.
 *   alloc: one reread (phase 1), then (phase 2) the cache is dropped and a
 *     "process" allocates the mib MiB of frames that held it: zeroes each
 *     page (as an OS does), fills it, then reads it all back (Fig. 4.10).
 *   compress: iters passes, each reading the file through the cache in
 *     1 MiB chunks (copied out, as read() does), LZ-compressing each chunk
 *     and decompressing it again to check (the pbzip2 case, Fig. 4.11),
 *     effort=N (8) times per chunk: about bzip2's rate, tens of MB/s.
 *   consistency: rounds=N (8) of: read ops=N (256) random blocks of the
 *     file into fresh frames, partly as multi-frame requests; CPU stores
 *     into some frames (whole page or one word); write new versions of
 *     some blocks (from a bounce buffer, from the cached frame after
 *     changing it, write-zeroes, discard); flush; pressure_mib=N (64) of
 *     scratch memory written to push frames out of the host; then every
 *     frame must still hold what it read (never the block's new content),
 *     a sample of blocks read afresh must hold their current version, and
 *     the scratch memory its pattern. settle_ms=N (0): pause N ms after the
 *     stores and after the disk changes, for a host that pages the VM out.
 *   durable: rounds=N (1000000) over the file: round r writes every block
 *     with state(b, r) (version r; zeros by discard for even blocks when
 *     r % 3 == 0), flushes, prints "pagecache durable flushed round=r".
 *     For kill -9 tests: after the kill each block must be in state(b, R)
 *     or state(b, R+1), R the last round printed.
 *   hostile: unaligned, split, overlapping and out-of-range buffers and
 *     sectors (each case prints "pagecache hostile case=NAME ok|FAILED");
 *     the device must refuse what is outside RAM or the disk, write no
 *     wrong byte, touch nothing around the buffers and keep working.
 *
 * Prints "pagecache mode=M mib=N file_blocks=B frames=F ..." at start, per
 * iteration "pagecache iter=I ms=T disk_blocks=D hits=H mismatches=M",
 * at the end "pagecache done mode=M total_ms=T mismatches=M io_errors=E"
 * and "PASS" or "FAIL: reason". Exit 0 PASS, 1 FAIL, 2 setup error.
 * A mismatch prints "MISMATCH what=... block=B ver=V word=W expected=E got=G".
 */
#include "libcflat.h"
#include "virtio.h"

#define BS		4096ul
#define WORDS		(BS / 8)
#define VER_ZERO	0xffffu
#define NONE		0xffffffffu
#define QD_MAX		32
#define SEGS_MAX	64
#define PRIV_SALT	0x5a17c0de5a17c0deull

struct seg {
	u64 addr;
	u32 len;
};

struct req {
	struct blk_hdr *hdr;
	volatile u8 *status;
	struct blk_dwz *dwz;
	int busy;
	u16 head;
	u32 type;
	u64 sector;
};

static struct virtio_dev dev;
static struct virtq *q;
static struct req reqs[QD_MAX];
static u16 *head2req;
static int qd;
static u64 timeout_tsc, seed, io_errors, mismatches, cap_blocks;

/* ---------------- block content ---------------- */

static u64 tok_seed = 1, toks[16];

static void tokens(u64 s)
{
	if (tok_seed == s)
		return;
	for (int j = 0; j < 16; j++)
		toks[j] = mix64(s + (u64)(j + 1) * 0x9e3779b97f4a7c15ull);
	tok_seed = s;
}

static u64 stream_start(u64 b, u64 s, u64 v)
{
	return mix64(b ^ (s << 1) ^ (v << 48)) | 1;
}

static inline u64 xs(u64 x)
{
	x ^= x << 13;
	x ^= x >> 7;
	x ^= x << 17;
	return x;
}

static void fill(u64 *w, u64 b, u64 s, u64 v)
{
	if (v == VER_ZERO) {
		memset(w, 0, BS);
		return;
	}
	tokens(s);
	w[0] = b;
	w[1] = s;
	w[2] = v;
	u64 x = stream_start(b, s, v);
	for (u64 i = 3; i < WORDS; i++) {
		x = xs(x);
		w[i] = toks[x & 15];
	}
}

static u64 expected_word(u64 b, u64 s, u64 v, u64 i)
{
	if (v == VER_ZERO)
		return 0;
	if (i < 3)
		return i == 0 ? b : i == 1 ? s : v;
	tokens(s);
	u64 x = stream_start(b, s, v);
	for (u64 k = 3; k <= i; k++)
		x = xs(x);
	return toks[x & 15];
}

/* first word of w that differs from block b version v (seed s), or -1 */
static int diff(const volatile u64 *w, u64 b, u64 s, u64 v)
{
	if (v == VER_ZERO) {
		for (u64 i = 0; i < WORDS; i++)
			if (w[i])
				return i;
		return -1;
	}
	tokens(s);
	if (w[0] != b || w[1] != s || w[2] != v)
		return w[0] != b ? 0 : w[1] != s ? 1 : 2;
	u64 x = stream_start(b, s, v);
	for (u64 i = 3; i < WORDS; i++) {
		x = xs(x);
		if (w[i] != toks[x & 15])
			return i;
	}
	return -1;
}

/* check a page against block b version v; prints and counts a mismatch */
static int check(const char *what, const volatile u64 *w, u64 b, u64 s, u64 v)
{
	int i = diff(w, b, s, v);
	if (i < 0)
		return 0;
	if (mismatches < 10)
		printf("MISMATCH what=%s block=%lu ver=%lu word=%d expected=%#lx got=%#lx "
		       "(got block=%lu ver=%lu)\n", what, b, v, i, expected_word(b, s, v, i), w[i],
		       w[0], w[2]);
	mismatches++;
	return 1;
}

/* ---------------- a tiny virtio-blk driver ---------------- */

static void complete(struct req *r)
{
	vq_free_chain(q, r->head);
	r->busy = 0;
	if (*r->status != 0) {
		if (io_errors < 10)
			printf("pagecache: request type=%u sector=%lu failed status=%u\n", r->type,
			       r->sector, *r->status);
		io_errors++;
	}
}

/* reap completions; returns how many */
static int reap(void)
{
	int n = 0, id;
	u32 len;
	while ((id = vq_pop(q, &len)) >= 0) {
		if (id >= q->size || head2req[id] >= qd || !reqs[head2req[id]].busy) {
			printf("pagecache: bogus used id %d\n", id);
			exit(1);
		}
		complete(&reqs[head2req[id]]);
		n++;
	}
	return n;
}

static int busy_count(void)
{
	int n = 0;
	for (int i = 0; i < qd; i++)
		n += reqs[i].busy;
	return n;
}

static void wait_some(void)
{
	u64 t0 = rdtsc();
	while (!reap()) {
		if (rdtsc() - t0 > timeout_tsc) {
			printf("pagecache: no completion within timeout_ms with %d in flight\n",
			       busy_count());
			printf("FAIL: device timeout\n");
			exit(1);
		}
		cpu_relax();
	}
}

static void wait_all(void)
{
	while (busy_count())
		wait_some();
}

/*
 * Queue a request (waiting for a free slot): IN/OUT with data segments,
 * FLUSH without, DISCARD/WRITE_ZEROES of nblk blocks at sector. Returns
 * the request (status valid once it is no longer busy).
 */
static struct req *submit(u32 type, u64 sector, const struct seg *sg, int nseg, u64 nblk)
{
	int ndata = type == BLK_T_FLUSH ? 0 : (type == BLK_T_DISCARD || type == BLK_T_WRITE_ZEROES)
							? 1 : nseg;
	struct req *r = NULL;
	for (;;) {
		for (int i = 0; i < qd; i++)
			if (!reqs[i].busy) {
				r = &reqs[i];
				break;
			}
		if (r && q->num_free >= ndata + 2)
			break;
		r = NULL;
		wait_some();
	}
	int head = vq_alloc_chain(q, ndata + 2);
	r->head = head;
	r->busy = 1;
	r->type = type;
	r->sector = sector;
	r->hdr->type = type;
	r->hdr->reserved = 0;
	r->hdr->sector = type == BLK_T_FLUSH ? 0 : sector;
	*r->status = 0xff;
	head2req[head] = r - reqs;
	struct vring_desc *d = &q->desc[head];
	d->addr = (u64)r->hdr;
	d->len = sizeof(struct blk_hdr);
	d = &q->desc[d->next];
	if (type == BLK_T_DISCARD || type == BLK_T_WRITE_ZEROES) {
		r->dwz->sector = sector;
		r->dwz->num_sectors = nblk * (BS / 512);
		r->dwz->flags = 0;
		d->addr = (u64)r->dwz;
		d->len = sizeof(struct blk_dwz);
		d = &q->desc[d->next];
	} else {
		for (int i = 0; i < ndata; i++) {
			d->addr = sg[i].addr;
			d->len = sg[i].len;
			if (type == BLK_T_IN)
				d->flags |= VRING_DESC_F_WRITE;
			d = &q->desc[d->next];
		}
	}
	d->addr = (u64)r->status;
	d->len = 1;
	d->flags = VRING_DESC_F_WRITE;
	vq_push(q, head);
	vq_kick(q);
	return r;
}

/* one request, waited for; returns its status */
static int sync_req(u32 type, u64 sector, const struct seg *sg, int nseg, u64 nblk)
{
	wait_all();
	u64 errs = io_errors;
	struct req *r = submit(type, sector, sg, nseg, nblk);
	wait_all();
	io_errors = errs;	/* the caller judges the status */
	return *r->status;
}

static int setup_device(void)
{
	u64 want = (1ull << VIRTIO_BLK_F_FLUSH) | (1ull << VIRTIO_BLK_F_BLK_SIZE) |
		   (1ull << VIRTIO_BLK_F_DISCARD) | (1ull << VIRTIO_BLK_F_WRITE_ZEROES) |
		   (1ull << VIRTIO_F_EVENT_IDX);
	if (virtio_probe(&dev, VIRTIO_DEV_BLK, 0))
		return -1;
	if (virtio_init(&dev, want))
		return -1;
	if (virtio_setup_queue(&dev, 0, 256, 1))
		return -1;
	q = &dev.q[0];
	virtio_driver_ok(&dev);
	if (virtio_status(&dev) & (VIRTIO_S_NEEDS_RESET | VIRTIO_S_FAILED)) {
		printf("pagecache: device status %#x after DRIVER_OK\n", virtio_status(&dev));
		return -1;
	}
	u64 cap = 0;
	u8 g;
	do {
		g = vc_read8(&dev, VC_CFGGEN);
		cap = mmio_read32(dev.devcfg) | (u64)mmio_read32(dev.devcfg + 4) << 32;
	} while (g != vc_read8(&dev, VC_CFGGEN));
	cap_blocks = cap / (BS / 512);
	u32 lbs = virtio_has(&dev, VIRTIO_BLK_F_BLK_SIZE) ? mmio_read32(dev.devcfg + 20) : 512;
	printf("pagecache: disk capacity=%lu sectors logical_block_size=%u discard=%d "
	       "write_zeroes=%d\n", cap, lbs, virtio_has(&dev, VIRTIO_BLK_F_DISCARD),
	       virtio_has(&dev, VIRTIO_BLK_F_WRITE_ZEROES));
	head2req = dma_alloc(2ul * q->size, 64);
	u8 *hdrs = dma_alloc(64ul * QD_MAX, 64);
	for (int i = 0; i < QD_MAX; i++) {
		reqs[i].hdr = (struct blk_hdr *)(hdrs + 64 * i);
		reqs[i].status = hdrs + 64 * i + 16;
		reqs[i].dwz = (struct blk_dwz *)(hdrs + 64 * i + 32);
	}
	return 0;
}

/* ---------------- the page cache ---------------- */

static u64 cache_base, nframes, file_blocks;
static u32 *blk2frame, *frame2blk;
static u64 clock_hand;
static u64 disk_blocks_read, cache_hits;
static int ra;

static inline u64 *frame_ptr(u64 f)
{
	return (u64 *)(cache_base + f * BS);
}

/* ---- balloon=1: a cooperative guest (virtio-balloon, device 0x1045) ----
 * The balloon holds the top `ballooned` frames of the cache: the cache uses
 * [0, nframes - ballooned). The target is read at every read-ahead window
 * and iteration start (polling the config; the manager may change it). */
#define VIRTIO_DEV_BALLOON	0x1045
#define BALLOON_F_DEFLATE_ON_OOM 2
#define BALLOON_BATCH		256
static struct virtio_dev bdev;
static int balloon_on;
static u64 ballooned, balloon_gen = ~0ul;
static u32 *pfns;
static u16 balloon_head;
static u64 inflated_total, deflated_total;

static u64 usable_frames(void)
{
	return nframes - ballooned;
}

static void balloon_send(int qi, u64 first_frame, u64 n)
{
	struct virtq *bq = &bdev.q[qi];
	for (u64 i = 0; i < n; i += BALLOON_BATCH) {
		u64 k = n - i < BALLOON_BATCH ? n - i : BALLOON_BATCH;
		for (u64 j = 0; j < k; j++)
			pfns[j] = (u32)((cache_base >> 12) + first_frame + i + j);
		int head = vq_alloc_chain(bq, 1);
		if (head < 0) {
			printf("FAIL: balloon queue full\n");
			exit(1);
		}
		balloon_head = head;
		bq->desc[head].addr = (u64)pfns;
		bq->desc[head].len = k * 4;
		bq->desc[head].flags = 0;
		vq_push(bq, head);
		vq_kick(bq);
		u64 t0 = rdtsc();
		while (!vq_has_used(bq)) {
			if (rdtsc() - t0 > timeout_tsc) {
				printf("FAIL: the balloon device did not take a page list\n");
				exit(1);
			}
			cpu_relax();
		}
		vq_pop(bq, NULL);
		vq_free_chain(bq, head);
	}
}

static void balloon_set_actual(void)
{
	mmio_write32(bdev.devcfg + 4, (u32)ballooned);
}

/* move the balloon to `want` frames (bounded by the cache) */
static void balloon_resize(u64 want)
{
	if (want > nframes - 256)	/* leave the cache at least 1 MiB */
		want = nframes - 256;
	if (want > ballooned) {	/* inflate: the top frames, their cache entries dropped */
		u64 lo = nframes - want, hi = nframes - ballooned;
		for (u64 f = lo; f < hi; f++) {
			if (frame2blk[f] != NONE)
				blk2frame[frame2blk[f]] = NONE;
			frame2blk[f] = NONE;
		}
		balloon_send(0, lo, hi - lo);
		inflated_total += hi - lo;
		ballooned = want;
		if (clock_hand >= usable_frames())
			clock_hand = 0;
	} else if (want < ballooned) {
		u64 lo = nframes - ballooned, hi = nframes - want;
		balloon_send(1, lo, hi - lo);
		deflated_total += hi - lo;
		ballooned = want;
	}
	balloon_set_actual();
}

static void balloon_poll(void)
{
	if (!balloon_on)
		return;
	u8 g = vc_read8(&bdev, VC_CFGGEN);
	if (g == balloon_gen)
		return;
	u32 target;
	do {
		g = vc_read8(&bdev, VC_CFGGEN);
		target = mmio_read32(bdev.devcfg);
	} while (g != vc_read8(&bdev, VC_CFGGEN));
	balloon_gen = g;
	if (target != ballooned)
		balloon_resize(target);
}

static int balloon_setup(void)
{
	if (virtio_probe(&bdev, VIRTIO_DEV_BALLOON, 0))
		return -1;
	if (virtio_init(&bdev, 1ull << BALLOON_F_DEFLATE_ON_OOM))
		return -1;
	if (virtio_setup_queue(&bdev, 0, 64, 1) || virtio_setup_queue(&bdev, 1, 64, 1))
		return -1;
	virtio_driver_ok(&bdev);
	pfns = dma_alloc(BALLOON_BATCH * 4, 4096);
	balloon_on = 1;
	balloon_gen = ~0ul;
	balloon_poll();
	printf("pagecache balloon target_pages=%lu deflate_on_oom=%d\n", ballooned,
	       virtio_has(&bdev, BALLOON_F_DEFLATE_ON_OOM));
	return 0;
}

/* a frame for a new cache entry: the next one round the clock, evicting */
static u64 frame_alloc(void)
{
	u64 f = clock_hand;
	clock_hand = (clock_hand + 1) % usable_frames();
	if (frame2blk[f] != NONE)
		blk2frame[frame2blk[f]] = NONE;
	frame2blk[f] = NONE;
	return f;
}

/* queue reads of the uncached blocks among [b, b+n) into new frames;
 * contiguous frames of one run go in one descriptor */
static void read_ahead(u64 b, u64 n)
{
	struct seg sg[SEGS_MAX];
	u64 end = b + n;
	while (b < end) {
		if (blk2frame[b] != NONE) {
			b++;
			continue;
		}
		u64 start = b;
		int nseg = 0;
		while (b < end && blk2frame[b] == NONE && b - start < (u64)ra && nseg < SEGS_MAX) {
			u64 f = frame_alloc();
			u64 a = (u64)frame_ptr(f);
			if (nseg && sg[nseg - 1].addr + sg[nseg - 1].len == a && sg[nseg - 1].len < (1u << 20))
				sg[nseg - 1].len += BS;
			else
				sg[nseg++] = (struct seg){ a, BS };
			blk2frame[b] = f;
			frame2blk[f] = b;
			b++;
		}
		disk_blocks_read += b - start;
		submit(BLK_T_IN, start * (BS / 512), sg, nseg, 0);
	}
}

/* read the whole file once through the cache, checking every block */
static void read_file_pass(void)
{
	u64 window = (u64)ra * qd;
	for (u64 b = 0; b < file_blocks; b += window) {
		u64 n = file_blocks - b < window ? file_blocks - b : window;
		balloon_poll();
		u64 before = disk_blocks_read;
		read_ahead(b, n);
		wait_all();
		cache_hits += n - (disk_blocks_read - before);
		for (u64 k = b; k < b + n; k++)
			check("reread", frame_ptr(blk2frame[k]), k, seed, 0);
	}
}

static int use_phases;

static void balloon_poll(void);

static void phase(u64 n)
{
	balloon_poll();
	if (use_phases && lucid_present())
		lucid_hypercall(LUCID_HC_PHASE, n, 0, 0);
}

static u64 ms_since(u64 t0)
{
	return tsc_to_ns(rdtsc() - t0) / 1000000;
}

static void iter_line(u64 it, const char *what, u64 t0, u64 d0, u64 h0, u64 m0)
{
	printf("pagecache iter=%lu what=%s ms=%lu disk_blocks=%lu hits=%lu mismatches=%lu\n", it,
	       what, ms_since(t0), disk_blocks_read - d0, cache_hits - h0, mismatches - m0);
}

static void mode_reread(u64 iters)
{
	for (u64 it = 1; it <= iters; it++) {
		phase(it);
		u64 t0 = rdtsc(), d0 = disk_blocks_read, h0 = cache_hits, m0 = mismatches;
		read_file_pass();
		iter_line(it, "reread", t0, d0, h0, m0);
	}
}

static inline u64 anon_word(u64 f, u64 i)
{
	return mix64((f << 9 | i) ^ seed ^ 0xa11c);
}

static void mode_alloc(u64 mib)
{
	phase(1);
	u64 t0 = rdtsc(), d0 = disk_blocks_read, h0 = cache_hits, m0 = mismatches;
	read_file_pass();
	iter_line(1, "reread", t0, d0, h0, m0);

	phase(2);
	t0 = rdtsc();
	d0 = disk_blocks_read;
	h0 = cache_hits;
	m0 = mismatches;
	u64 n = mib * 256;
	if (n > nframes)
		n = nframes;
	balloon_poll();
	if (n > usable_frames()) {	/* the balloon holds memory the process needs */
		if (balloon_on && virtio_has(&bdev, BALLOON_F_DEFLATE_ON_OOM)) {
			printf("pagecache alloc: deflating the balloon by %lu pages (deflate on OOM)\n",
			       n - usable_frames());
			balloon_resize(nframes - n);
			balloon_on = 0;	/* keep what the process holds: no reinflation */
		} else {
			printf("FAIL: out of memory: the process needs %lu pages, the balloon leaves %lu "
			       "(the paper's balloon crash, Fig. 4.10)\n", n, usable_frames());
			exit(1);
		}
	}
	/* the OS drops the cache and hands its frames to a process */
	for (u64 f = 0; f < n; f++) {
		if (frame2blk[f] != NONE)
			blk2frame[frame2blk[f]] = NONE;
		frame2blk[f] = NONE;
	}
	for (u64 f = 0; f < n; f++) {
		u64 *w = frame_ptr(f);
		memset(w, 0, BS);	/* zeroing on allocation: a whole-page overwrite */
		for (u64 i = 0; i < WORDS; i += 8)	/* the process fills its memory */
			w[i] = anon_word(f, i);
	}
	for (u64 f = 0; f < n; f++) {
		volatile u64 *w = frame_ptr(f);
		for (u64 i = 0; i < WORDS; i++) {
			u64 e = i % 8 ? 0 : anon_word(f, i);
			if (w[i] != e) {
				if (mismatches < 10)
					printf("MISMATCH what=alloc frame=%lu word=%lu expected=%#lx got=%#lx\n",
					       f, i, e, w[i]);
				mismatches++;
				break;
			}
		}
	}
	iter_line(2, "alloc", t0, d0, h0, m0);
}

/* ---- compress: a small LZ77 (4-byte hash, 64 KiB window) ---- */

#define CHUNK	(1ul << 20)
static u32 *lz_table;

static u64 lz_compress(const u8 *in, u64 n, u8 *out)
{
	memset(lz_table, 0, 4096 * 4);
	u64 i = 0, o = 0, lit = 0;
	while (i + 4 <= n) {
		u32 x = in[i] | in[i + 1] << 8 | in[i + 2] << 16 | (u32)in[i + 3] << 24;
		u32 h = (x * 2654435761u) >> 20;
		u64 cand = lz_table[h];
		lz_table[h] = i + 1;
		if (cand && i + 1 - cand <= 65535 && !memcmp(in + cand - 1, in + i, 4)) {
			u64 p = cand - 1, len = 4;
			while (i + len < n && len < 255 + 4 && in[p + len] == in[i + len])
				len++;
			/* flush literals: 0x00 count(1..128) bytes */
			while (lit) {
				u64 k = lit > 128 ? 128 : lit;
				out[o++] = (u8)(k - 1);
				memcpy(out + o, in + i - lit, k);
				o += k;
				lit -= k;
			}
			u64 dist = i - p;
			out[o++] = 0x80;
			out[o++] = (u8)(len - 4);
			out[o++] = (u8)dist;
			out[o++] = (u8)(dist >> 8);
			i += len;
		} else {
			i++;
			lit++;
		}
	}
	lit += n - i;
	i = n;
	while (lit) {
		u64 k = lit > 128 ? 128 : lit;
		out[o++] = (u8)(k - 1);
		memcpy(out + o, in + i - lit, k);
		o += k;
		lit -= k;
	}
	return o;
}

static u64 lz_decompress(const u8 *in, u64 n, u8 *out, u64 cap)
{
	u64 i = 0, o = 0;
	while (i < n) {
		u8 c = in[i++];
		if (c & 0x80) {
			if (i + 3 > n)
				return ~0ul;
			u64 len = in[i] + 4, dist = in[i + 1] | in[i + 2] << 8;
			i += 3;
			if (!dist || dist > o || o + len > cap)
				return ~0ul;
			for (u64 k = 0; k < len; k++, o++)
				out[o] = out[o - dist];
		} else {
			u64 k = (u64)c + 1;
			if (i + k > n || o + k > cap)
				return ~0ul;
			memcpy(out + o, in + i, k);
			i += k;
			o += k;
		}
	}
	return o;
}

static void mode_compress(u64 iters, u64 effort)
{
	u8 *chunk = dma_alloc(CHUNK, 4096);
	u8 *packed = dma_alloc(CHUNK + CHUNK / 64 + 64, 4096);
	u8 *back = dma_alloc(CHUNK, 4096);
	lz_table = dma_alloc(4096 * 4, 64);
	u64 per = CHUNK / BS;
	for (u64 it = 1; it <= iters; it++) {
		phase(it);
		u64 t0 = rdtsc(), d0 = disk_blocks_read, h0 = cache_hits, m0 = mismatches;
		u64 in_bytes = 0, out_bytes = 0;
		for (u64 b = 0; b < file_blocks; b += per) {
			u64 n = file_blocks - b < per ? file_blocks - b : per;
			balloon_poll();
			for (u64 w = b; w < b + n; w += (u64)ra * qd) {
				u64 k = b + n - w < (u64)ra * qd ? b + n - w : (u64)ra * qd;
				u64 before = disk_blocks_read;
				read_ahead(w, k);
				wait_all();
				cache_hits += k - (disk_blocks_read - before);
			}
			for (u64 k = 0; k < n; k++) {	/* read(): copy out of the cache */
				const u64 *src = frame_ptr(blk2frame[b + k]);
				check("compress", src, b + k, seed, 0);
				memcpy(chunk + k * BS, src, BS);
			}
			u64 len = 0, got = 0;
			for (u64 e = 0; e < effort; e++) {	/* bzip2 works harder than this LZ */
				len = lz_compress(chunk, n * BS, packed);
				got = lz_decompress(packed, len, back, CHUNK);
			}
			if (got != n * BS || memcmp(back, chunk, n * BS)) {
				if (mismatches < 10)
					printf("MISMATCH what=lz chunk_block=%lu packed=%lu unpacked=%lu\n", b,
					       len, got);
				mismatches++;
			}
			in_bytes += n * BS;
			out_bytes += len;
		}
		iter_line(it, "compress", t0, d0, h0, m0);
		printf("pagecache compress iter=%lu in_bytes=%lu out_bytes=%lu\n", it, in_bytes,
		       out_bytes);
	}
}

/* ---- consistency ---- */

static u64 rng_state;

static u64 rng(void)
{
	rng_state = xs(rng_state);
	return rng_state;
}

struct fstate {
	u32 blk;
	u16 ver;
	u8 priv;	/* 1: overwritten by the CPU with block blk's version ver of seed^PRIV_SALT */
	u8 poked;	/* word 100 inverted by a CPU store */
};

static u16 *ver;		/* current version of each file block */
static struct fstate *fst;	/* what each frame must hold; blk NONE: free */

static int check_frame(const char *what, u64 f)
{
	struct fstate *s = &fst[f];
	if (s->blk == NONE)
		return 0;
	volatile u64 *w = frame_ptr(f);
	u64 sd = s->priv ? seed ^ PRIV_SALT : seed;
	if (s->poked) {
		u64 saved = w[100];
		u64 e = expected_word(s->blk, sd, s->ver, 100);
		if (saved != ~e) {
			if (mismatches < 10)
				printf("MISMATCH what=%s-poke frame=%lu block=%u expected=%#lx got=%#lx\n",
				       what, f, s->blk, ~e, saved);
			mismatches++;
			return 1;
		}
		/* compare the rest: a copy with word 100 restored */
		static u64 tmp[WORDS];
		for (u64 i = 0; i < WORDS; i++)
			tmp[i] = w[i];
		tmp[100] = e;
		return check(what, tmp, s->blk, sd, s->ver);
	}
	return check(what, w, s->blk, sd, s->ver);
}

static u64 settle_ms;

/* give the host time to push pages out (the tests page the VM out from outside) */
static void settle(void)
{
	if (!settle_ms)
		return;
	u64 t0 = rdtsc();
	while (rdtsc() - t0 < settle_ms * tsc_khz())
		cpu_relax();
}

static void pressure(u64 mib, u64 base, u64 round)
{
	for (u64 a = 0; a < mib << 20; a += 64)
		*(volatile u64 *)(base + a) = mix64(a ^ round ^ seed);
}

static void pressure_check(u64 mib, u64 base, u64 round)
{
	for (u64 a = 0; a < mib << 20; a += 64) {
		u64 got = *(volatile u64 *)(base + a), e = mix64(a ^ round ^ seed);
		if (got != e) {
			if (mismatches < 10)
				printf("MISMATCH what=scratch addr=%#lx expected=%#lx got=%#lx\n", base + a,
				       e, got);
			mismatches++;
			return;
		}
	}
}

static void mode_consistency(u64 rounds, u64 ops, u64 pmib)
{
	u64 scratch = cache_base + nframes * BS;	/* pressure memory after the frames */
	u8 *bounce = dma_alloc(BS * 8, 4096);
	ver = dma_alloc(file_blocks * 2, 64);
	fst = dma_alloc(nframes * sizeof(*fst), 64);
	for (u64 f = 0; f < nframes; f++)
		fst[f].blk = NONE;
	int can_discard = virtio_has(&dev, VIRTIO_BLK_F_DISCARD);
	int can_wz = virtio_has(&dev, VIRTIO_BLK_F_WRITE_ZEROES);
	u64 hand = 0, writes = 0, discards = 0, stores = 0, fresh = 0, flushes = 0;
	for (u64 r = 1; r <= rounds; r++) {
		phase(r);
		u64 t0 = rdtsc(), m0 = mismatches;
		/* reads into fresh frames; runs of up to 8 blocks into scattered frames */
		for (u64 i = 0; i < ops;) {
			u64 n = 1 + rng() % 8, b = rng() % file_blocks;
			if (b + n > file_blocks)
				n = file_blocks - b;
			struct seg sg[8];
			int nseg = 0;
			for (u64 k = 0; k < n; k++) {
				u64 f = hand;
				hand = (hand + 1 + (rng() % 3 == 0)) % nframes;	/* gaps: scattered */
				fst[f] = (struct fstate){ (u32)(b + k), ver[b + k], 0, 0 };
				u64 a = (u64)frame_ptr(f);
				if (nseg && sg[nseg - 1].addr + sg[nseg - 1].len == a)
					sg[nseg - 1].len += BS;
				else
					sg[nseg++] = (struct seg){ a, BS };
			}
			submit(BLK_T_IN, b * 8, sg, nseg, 0);
			i += n;
		}
		wait_all();
		/* CPU stores into some cached frames */
		for (u64 i = 0; i < ops / 8; i++) {
			u64 f = rng() % nframes;
			struct fstate *s = &fst[f];
			if (s->blk == NONE)
				continue;
			if (check_frame("before-store", f))
				continue;
			if (rng() & 1) {
				fill(frame_ptr(f), s->blk, seed ^ PRIV_SALT, s->ver);
				s->priv = 1;
				s->poked = 0;
			} else if (!s->poked) {
				volatile u64 *w = frame_ptr(f);
				w[100] = ~w[100];
				s->poked = 1;
			}
			stores++;
		}
		pressure(pmib, scratch, r);
		settle();
		/* change blocks on the disk */
		for (u64 i = 0; i < ops / 4; i++) {
			u64 b = rng() % file_blocks, kind = rng() % 8;
			u16 nv = (u16)(r * 16 + i % 16) % VER_ZERO;
			if (kind == 6 && can_discard) {
				u64 n = 1 + rng() % 4;
				if (b + n > file_blocks)
					n = file_blocks - b;
				submit(BLK_T_DISCARD, b * 8, NULL, 0, n);
				for (u64 k = 0; k < n; k++)
					ver[b + k] = VER_ZERO;
				discards++;
			} else if (kind == 7 && can_wz) {
				submit(BLK_T_WRITE_ZEROES, b * 8, NULL, 0, 1);
				ver[b] = VER_ZERO;
				discards++;
			} else if (kind == 5) {
				/* write back from a cached frame the CPU changed: the frame now
				 * holds the new version (the OS's write-back path) */
				u64 f = rng() % nframes;
				struct fstate *s = &fst[f];
				if (s->blk == NONE)
					continue;
				wait_all();
				fill(frame_ptr(f), s->blk, seed, nv);
				*s = (struct fstate){ s->blk, nv, 0, 0 };
				struct seg sg = { (u64)frame_ptr(f), BS };
				submit(BLK_T_OUT, (u64)s->blk * 8, &sg, 1, 0);
				ver[s->blk] = nv;
				writes++;
			} else {
				wait_all();	/* the bounce buffer is reused */
				fill((u64 *)bounce, b, seed, nv);
				struct seg sg = { (u64)bounce, BS };
				submit(BLK_T_OUT, b * 8, &sg, 1, 0);
				ver[b] = nv;
				writes++;
			}
		}
		wait_all();
		if (rng() % 2) {
			submit(BLK_T_FLUSH, 0, NULL, 0, 0);
			wait_all();
			flushes++;
		}
		pressure(pmib, scratch, r + 1000);
		settle();
		/* every frame still holds what it read or the CPU stored */
		for (u64 f = 0; f < nframes; f++)
			check_frame("frame", f);
		pressure_check(pmib, scratch, r + 1000);
		/* a sample read afresh shows the current version */
		for (u64 i = 0; i < ops / 4; i++) {
			u64 b = rng() % file_blocks;
			struct seg sg = { (u64)bounce + BS * (i % 8), BS };
			submit(BLK_T_IN, b * 8, &sg, 1, 0);
			wait_all();
			check("fresh", (u64 *)((u64)bounce + BS * (i % 8)), b, seed, ver[b]);
			fresh++;
		}
		printf("pagecache iter=%lu what=consistency ms=%lu mismatches=%lu\n", r, ms_since(t0),
		       mismatches - m0);
	}
	printf("pagecache consistency rounds=%lu writes=%lu discards=%lu stores=%lu fresh_reads=%lu "
	       "flushes=%lu\n", rounds, writes, discards, stores, fresh, flushes);
}

/* ---- durable ---- */

static u64 dstate(u64 b, u64 r)
{
	return r % 3 == 0 && b % 2 == 0 ? VER_ZERO : r % VER_ZERO;
}

static void mode_durable(u64 rounds)
{
	u8 *buf = dma_alloc(BS * 32, 4096);
	int can_discard = virtio_has(&dev, VIRTIO_BLK_F_DISCARD);
	for (u64 r = 1; r <= rounds; r++) {
		for (u64 b = 0; b < file_blocks; b += 32) {
			u64 n = file_blocks - b < 32 ? file_blocks - b : 32;
			wait_all();
			for (u64 k = 0; k < n; k++)
				fill((u64 *)(buf + k * BS), b + k, seed, dstate(b + k, r));
			struct seg sg = { (u64)buf, n * BS };
			submit(BLK_T_OUT, b * 8, &sg, 1, 0);
			if (r % 3 == 0 && can_discard) {	/* even blocks (written as zeros): holes */
				wait_all();
				for (u64 k = 0; k < n; k++)
					if ((b + k) % 2 == 0)
						submit(BLK_T_DISCARD, (b + k) * 8, NULL, 0, 1);
			}
		}
		wait_all();
		submit(BLK_T_FLUSH, 0, NULL, 0, 0);
		wait_all();
		if (io_errors) {
			printf("FAIL: I/O errors in durable round %lu\n", r);
			exit(1);
		}
		printf("pagecache durable flushed round=%lu\n", r);
		if (r == rounds) {	/* read everything back */
			for (u64 b = 0; b < file_blocks; b++) {
				struct seg sg = { (u64)buf, BS };
				submit(BLK_T_IN, b * 8, &sg, 1, 0);
				wait_all();
				check("durable", (u64 *)buf, b, seed, dstate(b, r));
			}
		}
	}
}

/* ---- hostile ---- */

static int hostile_failed;

static void verdict(const char *name, int ok, const char *detail)
{
	printf("pagecache hostile case=%s %s%s%s\n", name, ok ? "ok" : "FAILED", *detail ? " " : "",
	       detail);
	hostile_failed += !ok;
}

static int all_bytes(const u8 *p, u64 n, u8 v)
{
	for (u64 i = 0; i < n; i++)
		if (p[i] != v)
			return 0;
	return 1;
}

/* bytes [off, off+len) of block b version v equal p? */
static int same_as_block(const u8 *p, u64 b, u64 v, u64 off, u64 len)
{
	static u64 tmp[WORDS];
	fill(tmp, b, seed, v);
	return !memcmp(p, (u8 *)tmp + off, len);
}

static void mode_hostile(u64 ram_end)
{
	/* an 8-page area with sentinels around every buffer */
	u8 *area = dma_alloc(BS * 8, 4096);
	u64 b = 5 % file_blocks, b2 = 9 % file_blocks;
	struct seg sg[2];
	int st;

	/* 1: a block read to a buffer straddling two pages at an odd offset */
	memset(area, 0xa5, BS * 8);
	sg[0] = (struct seg){ (u64)area + 100, BS };
	st = sync_req(BLK_T_IN, b * 8, sg, 1, 0);
	verdict("unaligned-gpa", st == 0 && same_as_block(area + 100, b, 0, 0, BS) &&
		all_bytes(area, 100, 0xa5) && all_bytes(area + 100 + BS, BS * 7 - 100, 0xa5), "");

	/* 2: one block split in two odd descriptors */
	memset(area, 0xa5, BS * 8);
	sg[0] = (struct seg){ (u64)area + 7, 512 };
	sg[1] = (struct seg){ (u64)area + 2 * BS + 513, BS - 512 };
	st = sync_req(BLK_T_IN, b * 8, sg, 2, 0);
	verdict("split-descriptors", st == 0 && same_as_block(area + 7, b, 0, 0, 512) &&
		same_as_block(area + 2 * BS + 513, b, 0, 512, BS - 512) &&
		all_bytes(area, 7, 0xa5) && all_bytes(area + 7 + 512, 2 * BS + 513 - 519, 0xa5) &&
		all_bytes(area + 3 * BS + 1, BS * 5 - 1, 0xa5), "");

	/* 3: two blocks into overlapping descriptors of one request: where only one
	 * descriptor lands the bytes are its block's; in the overlap, per sector,
	 * either block's (the device's order decides) */
	memset(area, 0xa5, BS * 8);
	sg[0] = (struct seg){ (u64)area, BS };
	sg[1] = (struct seg){ (u64)area + BS / 2, BS };
	st = sync_req(BLK_T_IN, b * 8, sg, 2, 0);
	int ok = st == 0 && same_as_block(area, b, 0, 0, BS / 2) &&
		 same_as_block(area + BS, b + 1, 0, BS / 2, BS / 2) &&
		 all_bytes(area + BS + BS / 2, BS * 6 + BS / 2, 0xa5);
	for (u64 s = 0; s < BS / 2; s += 512)
		ok &= same_as_block(area + BS / 2 + s, b, 0, BS / 2 + s, 512) ||
		      same_as_block(area + BS / 2 + s, b + 1, 0, s, 512);
	verdict("overlapping-descriptors", ok, "");

	/* 4: two requests in flight into the same page: it ends as one block or the
	 * other, per sector */
	memset(area, 0xa5, BS * 8);
	sg[0] = (struct seg){ (u64)area + BS, BS };
	wait_all();
	submit(BLK_T_IN, b * 8, sg, 1, 0);
	submit(BLK_T_IN, b2 * 8, sg, 1, 0);
	wait_all();
	ok = !io_errors && all_bytes(area, BS, 0xa5) && all_bytes(area + 2 * BS, BS * 6, 0xa5);
	for (u64 s = 0; s < BS; s += 512)
		ok &= same_as_block(area + BS + s, b, 0, s, 512) ||
		      same_as_block(area + BS + s, b2, 0, s, 512);
	verdict("overlapping-requests", ok, "");

	/* 5-6: buffers outside guest RAM: past its end, in the MMIO hole */
	char d[96];
	if (ram_end && ram_end < LUCID_MMIO_HOLE) {
		sg[0] = (struct seg){ ram_end - BS / 2, BS };
		st = sync_req(BLK_T_IN, b * 8, sg, 1, 0);
		snprintf(d, sizeof(d), "status=%d", st);
		verdict("buffer-past-ram-end", st != 0, d);
	}
	sg[0] = (struct seg){ LUCID_MMIO_PROBE, BS };
	st = sync_req(BLK_T_IN, b * 8, sg, 1, 0);
	snprintf(d, sizeof(d), "status=%d", st);
	verdict("buffer-in-mmio-hole", st != 0, d);

	/* 7-8: sectors past the end, straddling it, huge, not block-aligned */
	sg[0] = (struct seg){ (u64)area, BS };
	u64 sectors[4] = { cap_blocks * 8, cap_blocks * 8 - 4, 1ull << 62, b * 8 + 1 };
	const char *names[4] = { "sector-at-end", "sector-straddling-end", "sector-huge",
				 "sector-unaligned" };
	for (int i = 0; i < 4; i++) {
		memset(area, 0xa5, BS);
		st = sync_req(BLK_T_IN, sectors[i], sg, 1, 0);
		int ok2 = st != 0;
		if (i == 3 && st == 0)	/* a 512-byte-block disk may accept it: data must be right */
			ok2 = same_as_block(area, b, 0, 512, BS - 512);
		snprintf(d, sizeof(d), "status=%d", st);
		verdict(names[i], ok2, d);
	}
	/* 9: a length that is not a sector multiple; a write past the end */
	sg[0] = (struct seg){ (u64)area, 1000 };
	st = sync_req(BLK_T_IN, b * 8, sg, 1, 0);
	snprintf(d, sizeof(d), "status=%d", st);
	verdict("length-not-sector-multiple", st != 0, d);
	sg[0] = (struct seg){ (u64)area, BS };
	st = sync_req(BLK_T_OUT, cap_blocks * 8, sg, 1, 0);
	snprintf(d, sizeof(d), "status=%d", st);
	verdict("write-past-end", st != 0, d);

	/* 10: a cached read of b2, then a write of b2 from an unaligned buffer: the
	 * disk has the new block, the cached page still the old one */
	u64 f = frame_alloc();
	sg[0] = (struct seg){ (u64)frame_ptr(f), BS };
	st = sync_req(BLK_T_IN, b2 * 8, sg, 1, 0);
	fill((u64 *)(area + BS + 40), b2, seed, 7);	/* an unaligned source */
	sg[0] = (struct seg){ (u64)area + BS + 40, BS };
	int st2 = sync_req(BLK_T_OUT, b2 * 8, sg, 1, 0);
	memset(area, 0, BS);
	sg[0] = (struct seg){ (u64)area, BS };
	int st3 = sync_req(BLK_T_IN, b2 * 8, sg, 1, 0);
	ok = st == 0 && st2 == 0 && st3 == 0 && diff((u64 *)area, b2, seed, 7) < 0 &&
	     diff(frame_ptr(f), b2, seed, 0) < 0;
	verdict("unaligned-write-then-cached-page", ok, "");
	/* put b2 back as the image had it */
	fill((u64 *)area, b2, seed, 0);
	sync_req(BLK_T_OUT, b2 * 8, sg, 1, 0);

	/* 11: the device still works */
	memset(area, 0, BS);
	st = sync_req(BLK_T_IN, b * 8, sg, 1, 0);
	int stf = sync_req(BLK_T_FLUSH, 0, NULL, 0, 0);
	verdict("device-still-works", st == 0 && stf == 0 && diff((u64 *)area, b, seed, 0) < 0 &&
		!(virtio_status(&dev) & (VIRTIO_S_NEEDS_RESET | VIRTIO_S_FAILED)), "");
	printf("pagecache hostile failed=%d\n", hostile_failed);
}

int main(void)
{
	const char *mode = param_str("mode", "reread");
	u64 mib = param_u64("mib", 200);
	u64 iters = param_u64("iters", 3);
	seed = param_u64("seed", 0x5eed);
	cache_base = param_u64("cache_base", 32 << 20);
	ra = param_u64("ra", 32);
	qd = param_u64("qd", 4);
	use_phases = param_u64("phases", 1);
	rng_state = seed * 2 + 1;
	int m = !strcmp(mode, "reread") ? 0 : !strcmp(mode, "alloc") ? 1
		: !strcmp(mode, "compress") ? 2 : !strcmp(mode, "consistency") ? 3
		: !strcmp(mode, "durable") ? 4 : !strcmp(mode, "hostile") ? 5 : -1;
	if (m < 0) {
		printf("pagecache: mode must be reread, alloc, compress, consistency, durable or "
		       "hostile\n");
		return 2;
	}
	if (ra < 1 || ra > SEGS_MAX || qd < 1 || qd > QD_MAX || cache_base % BS ||
	    cache_base < (16 << 20)) {
		printf("pagecache: ra must be 1-%d, qd 1-%d, cache_base 4 KiB aligned and >= 16 MiB\n",
		       SEGS_MAX, QD_MAX);
		return 2;
	}
	if (!tsc_khz()) {
		printf("pagecache: unknown TSC frequency\n");
		return 2;
	}
	timeout_tsc = param_u64("timeout_ms", 60000) * tsc_khz();
	u64 ram_end = ram_region_end(cache_base);
	if (!ram_end || ram_end > LUCID_MMIO_HOLE) {
		printf("pagecache: no RAM at cache_base %#lx (memory map)\n", cache_base);
		return 2;
	}
	u64 pmib = m == 3 ? param_u64("pressure_mib", 64) : 0;
	settle_ms = param_u64("settle_ms", 0);
	if (ram_end < cache_base + ((pmib + 1) << 20)) {
		printf("pagecache: RAM ends at %#lx: too little for cache_base and pressure_mib\n",
		       ram_end);
		return 2;
	}
	nframes = (ram_end - cache_base - (pmib << 20)) / BS;
	if (param_present("cache_mib") && param_u64("cache_mib", 0) * 256 < nframes)
		nframes = param_u64("cache_mib", 0) * 256;
	if (setup_device())
		return 2;
	file_blocks = mib * 256;
	if (!file_blocks || file_blocks > cap_blocks) {
		printf("pagecache: file of %lu MiB does not fit the disk (%lu blocks)\n", mib,
		       cap_blocks);
		return 2;
	}
	blk2frame = dma_alloc(file_blocks * 4, 64);
	frame2blk = dma_alloc(nframes * 4, 64);
	memset(blk2frame, 0xff, file_blocks * 4);
	memset(frame2blk, 0xff, nframes * 4);
	if (m <= 2 && param_u64("balloon", 0) && balloon_setup())
		return 2;
	printf("pagecache mode=%s mib=%lu file_blocks=%lu frames=%lu cache_base=%#lx ram_end=%#lx "
	       "ra=%d qd=%d seed=%#lx\n", mode, mib, file_blocks, nframes, cache_base, ram_end, ra,
	       qd, seed);

	u64 t0 = rdtsc();
	switch (m) {
	case 0:
		mode_reread(iters);
		break;
	case 1:
		mode_alloc(mib);
		break;
	case 2:
		mode_compress(iters, param_u64("effort", 8) ? param_u64("effort", 8) : 1);
		break;
	case 3:
		mode_consistency(param_u64("rounds", 8), param_u64("ops", 256), pmib);
		break;
	case 4:
		mode_durable(param_u64("rounds", 1000000));
		break;
	case 5:
		mode_hostile(ram_region_end(cache_base));
		break;
	}
	wait_all();
	u64 dma_end = (u64)dma_alloc(64, 64);
	if (dma_end >= cache_base) {
		printf("FAIL: the driver's memory (up to %#lx) ran into the cache at %#lx: raise "
		       "cache_base\n", dma_end, cache_base);
		return 1;
	}
	printf("pagecache done mode=%s total_ms=%lu mismatches=%lu io_errors=%lu disk_blocks=%lu "
	       "hits=%lu balloon_pages=%lu inflated=%lu deflated=%lu\n", mode, ms_since(t0),
	       mismatches, io_errors, disk_blocks_read, cache_hits, ballooned, inflated_total,
	       deflated_total);
	if (mismatches || io_errors || hostile_failed) {
		printf("FAIL: mismatches=%lu io_errors=%lu hostile_failed=%d\n", mismatches, io_errors,
		       hostile_failed);
		return 1;
	}
	printf("PASS\n");
	return 0;
}
