/*
 * sym-swap: an application-level swapper at CPL3 over a virtio-blk swap
 * disk, the guest half of SwapBypass (docs/symbiotic.md §6).
 *
 * A working set of `mib` MiB of 4 KiB pages lives in `resident_mib` MiB of
 * frames; a page evicted from its frame (FIFO) is written to a swap slot
 * (from a free list) and read back on its next touch, which frees the slot.
 * Freed slots are discarded (virtio DISCARD) in batches of `discard_batch`
 * (as Linux discards swap clusters), and go back to the free list only
 * then, so a pending discard never hits reused data.
 *
 * Every page's content derives from its number and a version bumped on
 * each write (word 0 = page, word 1 = version, the rest mixed); each touch
 * verifies the whole page (a swap-in checks what came back from the disk),
 * then writes a new version. Workload: `passes` passes over the pages,
 * `pattern=seq|rand`.
 *
 * Symbiotic (when Lucid offers it): the swap map (u32 per page: 0 = not
 * swapped, else slot + 1) is published in SymSpy (G_SWAP_MAP, _LEN, and
 * G_SWAP_DEVICE = the disk's PCI slot), and SymCall handlers answer
 * SLOT_LIVE (arg0 slot: value0 = 1 if it holds a page the guest will read
 * again) and PAGE_STATE (arg0 page: value0 = SYM_PAGE_*, value1 = slot).
 * Without it ("sym: not offered") the same swapper runs: the baseline.
 *
 * flush=1: at the end, the pending discards go out, then a virtio FLUSH;
 * prints "sym-swap flushed swapped=N swapsum=S" (S = sum over swapped
 * pages of page * 2^32 + version, mod 2^64: what a reader of the image
 * must find in its non-zero slots). hold=1: then "sym-swap: holding" and
 * spin (kill -9 tests).
 *
 * Prints "sym-swap mib= resident_mib= swapouts= swapins= discards=
 * mismatches= ms=". Exit 0; 1 on a mismatch or I/O error; 2 on setup.
 * Params: mib=16 resident_mib=4 passes=2 pattern=seq seed=1 dev=0
 * discard_batch=32 flush=0 hold=0 timeout_ms=5000.
 */
#include "libcflat.h"
#include "virtio.h"
#include "sym.h"
#include "symcall.h"

#define PAGE		4096
#define SECT_PER_PAGE	(PAGE / 512)
#define MAX_SEG		16	/* Lucid's max_discard_seg */

static struct sym_global g_page;
static struct sym_vcpu v_page;

static struct virtio_dev dev;
static struct virtq *q;
static struct blk_hdr *hdr;
static volatile u8 *status;
static struct blk_dwz *segs;
static u64 timeout_tsc, io_errors;

static u64 npages, nframes, nslots;
static u8 *frames;		/* nframes * PAGE */
static s32 *page_frame;		/* frame of a resident page, -1 */
static volatile u32 *swap_map;	/* published: slot + 1, 0 = not swapped */
static u32 *page_ver;
static s64 *frame_page;		/* page in a frame, -1 */
static volatile u32 *slot_owner;	/* page + 1 while the slot is live, else 0 */
static u32 *free_slots, nfree;
static u32 *pending, npending, discard_batch;
static u64 fifo, frames_used;
static u64 swapouts, swapins, discards, mismatches;

static void fill(u64 *w, u64 page, u32 ver)
{
	u64 base = mix64(page * 0x100000001ull ^ ver);
	w[0] = page;
	w[1] = ver;
	for (int k = 2; k < PAGE / 8; k++)
		w[k] = base + k * 0x9e3779b97f4a7c15ull;
}

static void verify(const u64 *w, u64 page, u32 ver, const char *where)
{
	u64 base = mix64(page * 0x100000001ull ^ ver);
	int bad = w[0] != page || w[1] != ver;
	for (int k = 2; k < PAGE / 8 && !bad; k++)
		bad = w[k] != base + k * 0x9e3779b97f4a7c15ull;
	if (!bad)
		return;
	if (mismatches < 10)
		printf("MISMATCH page=%lu version=%u (%s): found page=%lu version=%lu\n", page, ver,
		       where, w[0], w[1]);
	mismatches++;
}

/* One request, waited for (poll mode): 0 or the status / -1 on timeout. */
static int blk_req(u32 type, u64 sector, void *data, u32 len, int dev_writes)
{
	int ndesc = data ? 3 : 2;
	int head = vq_alloc_chain(q, ndesc);
	if (head < 0) {
		printf("sym-swap: no free descriptors\n");
		exit(2);
	}
	hdr->type = type;
	hdr->reserved = 0;
	hdr->sector = sector;
	*status = 0xff;
	struct vring_desc *d = &q->desc[head];
	u64 hdr_iova = vmap(hdr, sizeof(*hdr), DMA_TO_DEVICE), data_iova = 0;
	d->addr = hdr_iova;
	d->len = sizeof(*hdr);
	d = &q->desc[d->next];
	if (data) {
		data_iova = vmap(data, len, dev_writes ? DMA_FROM_DEVICE : DMA_TO_DEVICE);
		d->addr = data_iova;
		d->len = len;
		d->flags |= dev_writes ? VRING_DESC_F_WRITE : 0;
		d = &q->desc[d->next];
	}
	u64 st_iova = vmap((const void *)status, 1, DMA_FROM_DEVICE);
	d->addr = st_iova;
	d->len = 1;
	d->flags = VRING_DESC_F_WRITE;
	vq_push(q, head);
	vq_kick(q);
	u64 t0 = rdtsc();
	while (!vq_has_used(q)) {
		if (rdtsc() - t0 > timeout_tsc) {
			printf("sym-swap: request type %u sector %lu: no completion\n", type, sector);
			exit(1);
		}
		cpu_relax();
	}
	u32 ulen;
	int id = vq_pop(q, &ulen);
	if (id != head) {
		printf("sym-swap: unexpected used id %d\n", id);
		exit(1);
	}
	vq_free_chain(q, head);
	vunmap(hdr_iova, sizeof(*hdr));
	if (data)
		vunmap(data_iova, len);
	vunmap(st_iova, 1);
	if (*status) {
		if (io_errors++ < 10)
			printf("sym-swap: request type %u sector %lu failed: status %u\n", type, sector,
			       *status);
		return *status;
	}
	return 0;
}

/* Discards the pending slots (up to MAX_SEG per request); then they are free. */
static void discard_pending(void)
{
	u32 done = 0;
	while (done < npending) {
		u32 n = npending - done < MAX_SEG ? npending - done : MAX_SEG;
		for (u32 i = 0; i < n; i++) {
			segs[i].sector = (u64)pending[done + i] * SECT_PER_PAGE;
			segs[i].num_sectors = SECT_PER_PAGE;
			segs[i].flags = 0;
		}
		if (virtio_has(&dev, VIRTIO_BLK_F_DISCARD))
			blk_req(BLK_T_DISCARD, 0, segs, n * sizeof(*segs), 0);
		for (u32 i = 0; i < n; i++)
			free_slots[nfree++] = pending[done + i];
		discards += n;
		done += n;
	}
	npending = 0;
}

static void free_slot(u32 slot)
{
	slot_owner[slot] = 0;
	pending[npending++] = slot;
	if (npending >= discard_batch)
		discard_pending();
}

/* Writes the page in frame f to a fresh slot: it is swapped out. */
static void swap_out(u64 f)
{
	s64 p = frame_page[f];
	if (p < 0)
		return;
	if (!nfree)
		discard_pending();
	if (!nfree) {
		printf("sym-swap: out of swap slots (%lu)\n", nslots);
		exit(2);
	}
	u32 slot = free_slots[--nfree];
	/* Live from before the write: Lucid may ask while the write runs. */
	slot_owner[slot] = p + 1;
	swap_map[p] = slot + 1;
	if (blk_req(BLK_T_OUT, (u64)slot * SECT_PER_PAGE, frames + f * PAGE, PAGE, 0))
		exit(1);
	page_frame[p] = -1;
	frame_page[f] = -1;
	swapouts++;
}

/* Makes page p resident; returns its frame. */
static u64 fault_in(u64 p)
{
	u64 f;
	if (frames_used < nframes) {
		f = frames_used++;
	} else {
		f = fifo;
		fifo = (fifo + 1) % nframes;
		swap_out(f);
	}
	u64 *w = (u64 *)(frames + f * PAGE);
	u32 s = swap_map[p];
	if (s) {
		u32 slot = s - 1;
		if (blk_req(BLK_T_IN, (u64)slot * SECT_PER_PAGE, w, PAGE, 1))
			exit(1);
		verify(w, p, page_ver[p], "swap-in");
		swap_map[p] = 0;
		free_slot(slot);
		swapins++;
	} else {
		fill(w, p, page_ver[p]);	/* first touch */
	}
	page_frame[p] = f;
	frame_page[f] = p;
	return f;
}

/* Reads the page (verifies it) and writes a new version. */
static void touch(u64 p)
{
	s32 f = page_frame[p];
	if (f < 0)
		f = fault_in(p);
	u64 *w = (u64 *)(frames + (u64)f * PAGE);
	verify(w, p, page_ver[p], "resident");
	fill(w, p, ++page_ver[p]);
}

static u64 slot_live(const u64 a[5], u64 out[2])
{
	if (a[0] >= nslots)
		return SYM_EINVAL;
	out[0] = slot_owner[a[0]] != 0;
	out[1] = slot_owner[a[0]];
	return SYM_OK;
}

static u64 page_state(const u64 a[5], u64 out[2])
{
	if (a[0] >= npages)
		return SYM_EINVAL;
	u32 s = swap_map[a[0]];
	out[0] = s ? SYM_PAGE_SWAPPED : page_frame[a[0]] >= 0 ? SYM_PAGE_RESIDENT : SYM_PAGE_UNKNOWN;
	out[1] = s ? s - 1 : 0;
	return SYM_OK;
}

/* Offers the swap map and the handlers to a symbiotic Lucid; 0 if not offered. */
static int go_symbiotic(void)
{
	u32 f = sym_discover();
	if (!f) {
		printf("sym: not offered\n");
		return 0;
	}
	if (!(f & SYM_FEAT_SYMSPY)) {
		printf("sym: no SymSpy offered (features %#x)\n", f);
		return 0;
	}
	symcall_register(SYMCALL_SLOT_LIVE, slot_live);
	symcall_register(SYMCALL_PAGE_STATE, page_state);
	if (f & SYM_FEAT_SYMCALL)
		symcall_init(&g_page);
	sym_seq_begin(&g_page.seq);
	g_page.swap_map = (u64)swap_map;
	g_page.swap_map_len = npages;
	g_page.swap_device = (dev.pci.bdf >> 3) & 0x1f;
	sym_seq_end(&g_page.seq);
	long r = sym_register_global(&g_page);
	if (r) {
		printf("sym-swap: global page refused: %ld\n", r);
		exit(2);
	}
	symcall_attach_cpu(&v_page, 0);
	r = sym_register_vcpu(&v_page, 0);
	if (r) {
		printf("sym-swap: vCPU page refused: %ld\n", r);
		exit(2);
	}
	printf("sym: offered features=%#x swap_device=%u\n", f, g_page.swap_device);
	return 1;
}

static u64 rng_state;

static u64 rng(void)
{
	return xorshift64(&rng_state);
}

int main(void)
{
	u64 mib = param_u64("mib", 16), resident = param_u64("resident_mib", 4);
	u64 passes = param_u64("passes", 2);
	const char *pat = param_str("pattern", "seq");
	int rnd = !strcmp(pat, "rand");
	discard_batch = param_u64("discard_batch", 32);
	rng_state = param_u64("seed", 1) * 2 + 1;
	if (!mib || !resident || resident > mib || !discard_batch || discard_batch > 4096 ||
	    (strcmp(pat, "seq") && !rnd)) {
		printf("sym-swap: need 0 < resident_mib <= mib, discard_batch 1-4096, "
		       "pattern=seq|rand\n");
		return 2;
	}
	u64 k = tsc_khz() ? tsc_khz() : 3000000;
	timeout_tsc = param_u64("timeout_ms", 5000) * k;

	if (virtio_probe(&dev, VIRTIO_DEV_BLK, param_u64("dev", 0)))
		return 2;
	if (virtio_iommu_setup(dev.pci.bdf))
		return 2;
	if (virtio_init(&dev, (1ull << VIRTIO_BLK_F_FLUSH) | (1ull << VIRTIO_BLK_F_DISCARD) |
				      (1ull << VIRTIO_BLK_F_BLK_SIZE)))
		return 2;
	if (virtio_setup_queue(&dev, 0, 64, 1))
		return 2;
	q = &dev.q[0];
	virtio_driver_ok(&dev);
	u64 cap = mmio_read32(dev.devcfg) | (u64)mmio_read32(dev.devcfg + 4) << 32;

	npages = mib * 256;
	nframes = resident * 256;
	nslots = cap / SECT_PER_PAGE;
	if (nslots > 1u << 24)
		nslots = 1u << 24;
	if (nslots < npages - nframes + discard_batch) {
		printf("sym-swap: the swap disk holds %lu slots; %lu needed: make it bigger\n",
		       nslots, npages - nframes + discard_batch);
		return 2;
	}
	hdr = dma_alloc(64, 64);
	status = (u8 *)hdr + 32;
	segs = dma_alloc(sizeof(*segs) * MAX_SEG, 64);
	frames = dma_alloc(nframes * PAGE, PAGE);
	page_frame = dma_alloc(npages * 4, 64);
	swap_map = dma_alloc(npages * 4, 64);
	page_ver = dma_alloc(npages * 4, 64);
	frame_page = dma_alloc(nframes * 8, 64);
	slot_owner = dma_alloc(nslots * 4, 64);
	free_slots = dma_alloc(nslots * 4, 64);
	pending = dma_alloc((u64)discard_batch * 4, 64);
	for (u64 p = 0; p < npages; p++)
		page_frame[p] = -1;
	for (u64 f = 0; f < nframes; f++)
		frame_page[f] = -1;
	/* Lowest slots first: the disk fills from its start. */
	for (u64 s = 0; s < nslots; s++)
		free_slots[nfree++] = nslots - 1 - s;

	int sym = go_symbiotic();
	printf("sym-swap: start mib=%lu resident_mib=%lu slots=%lu pattern=%s passes=%lu "
	       "symbiotic=%d\n", mib, resident, nslots, pat, passes, sym);

	u64 t0 = rdtsc();
	for (u64 pass = 0; pass < passes; pass++)
		for (u64 i = 0; i < npages; i++)
			touch(rnd ? rng() % npages : i);
	u64 t = rdtsc() - t0;

	if (param_u64("flush", 0)) {
		discard_pending();
		int st = blk_req(BLK_T_FLUSH, 0, 0, 0, 0);
		u64 swapped = 0, sum = 0;
		for (u64 p = 0; p < npages; p++)
			if (swap_map[p]) {
				swapped++;
				sum += (p << 32) + page_ver[p];
			}
		printf("sym-swap flushed status=%d swapped=%lu swapsum=%lu\n", st, swapped, sum);
	}
	printf("sym-swap mib=%lu resident_mib=%lu swapouts=%lu swapins=%lu discards=%lu "
	       "mismatches=%lu ms=%lu\n", mib, resident, swapouts, swapins, discards, mismatches,
	       t / k);
	printf("sym-swap detail: pattern=%s passes=%lu io_errors=%lu kicks=%lu symbiotic=%d\n", pat,
	       passes, io_errors, q->kicks, sym);
	if (param_u64("hold", 0)) {
		printf("sym-swap: holding\n");
		for (;;)
			cpu_relax();
	}
	return mismatches || io_errors ? 1 : 0;
}
