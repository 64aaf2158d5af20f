/* DMA mapping strategies over the VT-d driver (see iommu_dma.h). */
#include "libcflat.h"
#include "iommu_dma.h"

struct iommu_dma_stats iommu_stats;
struct vtd_domain iommu_domain;
int iommu_strategy;

static const char *const names[] = {
	"strict", "shared", "async", "deferred", "teardown256", "teardown4096",
};

int iommu_strategy_parse(const char *s)
{
	for (u32 i = 0; i < ARRAY_SIZE(names); i++)
		if (!strcmp(s, names[i]))
			return i;
	return -1;
}

const char *iommu_strategy_name(int s)
{
	return s >= 0 && s < (int)ARRAY_SIZE(names) ? names[s] : "?";
}

/* ---- IOVA space: pages [IOVA_FIRST, IOVA_FIRST + IOVA_PAGES), next fit ----
 * Below 256 MiB: QEMU's edu masks DMA addresses to 28 bits. */
#define IOVA_FIRST	0x100			/* 1 MiB: IOVA 0 is never handed out */
#define IOVA_PAGES	(0x10000 - IOVA_FIRST)
static u8 iova_used[IOVA_PAGES / 8];
static u32 iova_next;

static int used(u32 i) { return (iova_used[i / 8] >> (i % 8)) & 1; }

static u64 iova_alloc(u32 n)
{
	for (u32 scanned = 0; scanned < IOVA_PAGES;) {
		if (iova_next + n > IOVA_PAGES) {
			scanned += IOVA_PAGES - iova_next;
			iova_next = 0;
		}
		u32 k = 0;
		while (k < n && !used(iova_next + k))
			k++;
		if (k == n) {
			for (u32 j = 0; j < n; j++)
				iova_used[(iova_next + j) / 8] |= 1 << ((iova_next + j) % 8);
			u64 pg = IOVA_FIRST + iova_next;
			iova_next += n;
			return pg;
		}
		iova_next += k + 1;
		scanned += k + 1;
	}
	return 0;
}

static void iova_free(u64 pg, u32 n)
{
	for (u32 j = 0; j < n; j++) {
		u32 i = pg - IOVA_FIRST + j;
		if (i < IOVA_PAGES)
			iova_used[i / 8] &= ~(1 << (i % 8));
	}
}

/* ---- time ---- */
static u64 tsc_ms;		/* TSC ticks per ms */
#define LIMIT_US	9000		/* 10 ms less 1 ms of slack for the check and the flush */
#define DEFER_MAX	250

u64 iommu_poll_tsc(void)
{
	int timed = iommu_strategy == IOMMU_ASYNC || iommu_strategy == IOMMU_DEFERRED ||
		    iommu_strategy == IOMMU_TEARDOWN256 || iommu_strategy == IOMMU_TEARDOWN4096;
	return timed ? tsc_ms : 0;
}

static void window(u64 t_unmap)
{
	u64 us = tsc_to_ns(rdtsc() - t_unmap) / 1000;
	if (us > iommu_stats.window_max_us)
		iommu_stats.window_max_us = us;
}

/* Every check of the limits (a poll, or a flush decided anywhere) notes its
 * time: a check leaves only mappings younger than LIMIT_US, so a flush is
 * decided at most LIMIT_US + one gap between checks after the oldest unmap,
 * however long the vCPU was not running in that gap. */
static u64 checked_at;

static void checked(u64 now)
{
	if (checked_at) {
		u64 us = tsc_to_ns(now - checked_at) / 1000;
		if (us > iommu_stats.check_gap_max_us)
			iommu_stats.check_gap_max_us = us;
	}
	checked_at = now;
}

/* a flush of stale mappings whose oldest was unmapped at t_oldest, decided now */
static void decided(u64 t_oldest, u64 now)
{
	u64 us = tsc_to_ns(now - t_oldest) / 1000;
	if (us > iommu_stats.decide_max_us)
		iommu_stats.decide_max_us = us;
	checked(now);
}

static void stale_inc(void)
{
	if (++iommu_stats.stale > iommu_stats.stale_max)
		iommu_stats.stale_max = iommu_stats.stale;
}

/* ---- PTEs and invalidation ---- */

static u64 perm_of(int dir)
{
	return (dir & DMA_TO_DEVICE ? VTD_PTE_R : 0) | (dir & DMA_FROM_DEVICE ? VTD_PTE_W : 0);
}

/* invalidate n pages from iova page pg: one descriptor when n is a
 * naturally aligned power of two, one per page up to 16, else the domain */
static void inv_pages(u64 pg, u32 n)
{
	if (!(n & (n - 1)) && !(pg & (n - 1)))
		vtd_inv_iotlb_pages(iommu_domain.did, pg << 12, __builtin_ctz(n));
	else if (n <= 16)
		for (u32 i = 0; i < n; i++)
			vtd_inv_iotlb_pages(iommu_domain.did, (pg + i) << 12, 0);
	else
		vtd_inv_iotlb_domain(iommu_domain.did);
}

static int set_ptes(u64 pg, u64 ppg, u32 n, u64 perm)
{
	for (u32 i = 0; i < n; i++)
		if (vtd_map_4k(&iommu_domain, (pg + i) << 12, (ppg + i) << 12, perm))
			return -1;
	if (vtd.cm) {		/* Caching Mode: fresh PTEs are announced, and we wait */
		inv_pages(pg, n);
		vtd_qi_sync();
	}
	return 0;
}

static void clear_ptes(u64 pg, u32 n)
{
	for (u32 i = 0; i < n; i++)
		vtd_unmap_4k(&iommu_domain, (pg + i) << 12);
}

/* ---- mapping records (shared, teardown) ----
 * Found by IOVA page (for unmap) and, while cached, by physical page (for
 * reuse). Shared: an LRU list bounds the cached ones. Teardown: idle
 * mappings (refs 0, PTE live) wait in a FIFO. */
#define NREC	8192
#define NHASH	8192
#define NIL	(-1)
struct rec {
	u64 ppg, pg;
	u32 n, refs;
	u64 perm, t_unmap;
	int cached;
	int next_p, next_i;		/* hash chains */
	int prev_l, next_l;		/* LRU (shared) or idle FIFO (teardown) */
};
static struct rec recs[NREC];
static int hash_p[NHASH], hash_i[NHASH];
static int free_rec;
static int list_head, list_tail, list_len;	/* LRU: head = most recent; FIFO: head = oldest */
static u64 cache_cap, quota;

static u32 hp(u64 ppg) { return (ppg * 0x9e3779b97f4a7c15ull) >> 51; }

static void list_del(int r)
{
	struct rec *e = &recs[r];
	if (e->prev_l != NIL) recs[e->prev_l].next_l = e->next_l; else list_head = e->next_l;
	if (e->next_l != NIL) recs[e->next_l].prev_l = e->prev_l; else list_tail = e->prev_l;
	e->prev_l = e->next_l = NIL;
	list_len--;
}

static void list_push_tail(int r)
{
	struct rec *e = &recs[r];
	e->next_l = NIL;
	e->prev_l = list_tail;
	if (list_tail != NIL) recs[list_tail].next_l = r; else list_head = r;
	list_tail = r;
	list_len++;
}

static void list_push_head(int r)
{
	struct rec *e = &recs[r];
	e->prev_l = NIL;
	e->next_l = list_head;
	if (list_head != NIL) recs[list_head].prev_l = r; else list_tail = r;
	list_head = r;
	list_len++;
}

static void unhash_p(int r)
{
	int *p = &hash_p[hp(recs[r].ppg) & (NHASH - 1)];
	while (*p != NIL && *p != r)
		p = &recs[*p].next_p;
	if (*p == r)
		*p = recs[r].next_p;
	recs[r].cached = 0;
}

static void unhash_i(int r)
{
	int *p = &hash_i[recs[r].pg & (NHASH - 1)];
	while (*p != NIL && *p != r)
		p = &recs[*p].next_i;
	if (*p == r)
		*p = recs[r].next_i;
}

static int find_by_iova(u64 pg)
{
	for (int r = hash_i[pg & (NHASH - 1)]; r != NIL; r = recs[r].next_i)
		if (recs[r].pg == pg)
			return r;
	return NIL;
}

static int find_cached(u64 ppg, u32 n, u64 perm)
{
	for (int r = hash_p[hp(ppg) & (NHASH - 1)]; r != NIL; r = recs[r].next_p) {
		struct rec *e = &recs[r];
		if (e->ppg == ppg && e->n == n && (e->perm & perm) == perm)
			return r;
	}
	return NIL;
}

static int rec_new(u64 ppg, u64 pg, u32 n, u64 perm)
{
	if (free_rec == NIL)
		return NIL;
	int r = free_rec;
	struct rec *e = &recs[r];
	free_rec = e->next_i;
	e->ppg = ppg;
	e->pg = pg;
	e->n = n;
	e->perm = perm;
	e->refs = 1;
	e->prev_l = e->next_l = NIL;
	e->next_i = hash_i[pg & (NHASH - 1)];
	hash_i[pg & (NHASH - 1)] = r;
	e->next_p = hash_p[hp(ppg) & (NHASH - 1)];
	hash_p[hp(ppg) & (NHASH - 1)] = r;
	e->cached = 1;
	return r;
}

static void rec_free(int r)
{
	if (recs[r].cached)
		unhash_p(r);
	unhash_i(r);
	recs[r].next_i = free_rec;
	free_rec = r;
}

/* ---- async: posted invalidations not yet complete ---- */
#define NPEND	4096
static struct pend {
	u64 pg, t;
	u32 n, seq;
} pend[NPEND];
static u32 pend_head, pend_tail;	/* ring: [head, tail) */

static void async_reap(int wait_oldest)
{
	while (pend_head != pend_tail) {
		struct pend *p = &pend[pend_head % NPEND];
		if (!vtd_qi_done(p->seq)) {
			if (!wait_oldest)
				break;
			vtd_qi_wait(p->seq);
			wait_oldest = 0;
			continue;
		}
		window(p->t);
		iova_free(p->pg, p->n);
		iommu_stats.stale--;
		pend_head++;
	}
}

/* ---- deferred: cleared PTEs whose IOTLB flush is pending ---- */
static void deferred_flush(void)
{
	if (pend_head == pend_tail)
		return;
	decided(pend[pend_head % NPEND].t, rdtsc());
	vtd_inv_iotlb_domain(iommu_domain.did);
	vtd_qi_sync();
	iommu_stats.flushes++;
	window(pend[pend_head % NPEND].t);	/* the oldest waited longest */
	for (; pend_head != pend_tail; pend_head++) {
		struct pend *p = &pend[pend_head % NPEND];
		iova_free(p->pg, p->n);
		iommu_stats.stale--;
	}
}

/* ---- teardown: evict idle mappings past 10 ms or over the quota ---- */
static void teardown_evict(int all)
{
	u64 now = rdtsc();
	int evicted[64], k = 0;
	if (list_head == NIL)
		return;
	decided(recs[list_head].t_unmap, now);
	while (list_head != NIL) {
		struct rec *e = &recs[list_head];
		if (!all && (u64)list_len <= quota && now - e->t_unmap < LIMIT_US * tsc_ms / 1000)
			break;
		int r = list_head;
		list_del(r);
		if (e->cached)
			unhash_p(r);	/* no reuse from here on */
		clear_ptes(e->pg, e->n);
		inv_pages(e->pg, e->n);
		evicted[k++] = r;
		if (k == (int)ARRAY_SIZE(evicted))
			break;
	}
	if (!k)
		return;
	vtd_qi_sync();
	iommu_stats.flushes++;
	for (int i = 0; i < k; i++) {
		struct rec *e = &recs[evicted[i]];
		window(e->t_unmap);
		iova_free(e->pg, e->n);
		iommu_stats.stale--;
		rec_free(evicted[i]);
	}
	/* a full batch may leave mappings past the quota or the time limit */
	if (list_head != NIL && (all || (u64)list_len > quota ||
				 rdtsc() - recs[list_head].t_unmap >= LIMIT_US * tsc_ms / 1000))
		teardown_evict(all);
}

void iommu_dma_poll(void)
{
	switch (iommu_strategy) {
	case IOMMU_ASYNC:
		async_reap(0);
		break;
	case IOMMU_DEFERRED: {
		u64 now = rdtsc();
		if (pend_tail - pend_head >= DEFER_MAX ||
		    (pend_head != pend_tail && now - pend[pend_head % NPEND].t >= LIMIT_US * tsc_ms / 1000))
			deferred_flush();
		else
			checked(now);
		break;
	}
	case IOMMU_TEARDOWN256:
	case IOMMU_TEARDOWN4096: {
		u64 now = rdtsc();
		if (list_head != NIL &&
		    ((u64)list_len > quota || now - recs[list_head].t_unmap >= LIMIT_US * tsc_ms / 1000))
			teardown_evict(0);
		else
			checked(now);
		break;
	}
	}
}

void iommu_dma_drain(void)
{
	switch (iommu_strategy) {
	case IOMMU_ASYNC:
		while (pend_head != pend_tail)
			async_reap(1);
		break;
	case IOMMU_DEFERRED:
		deferred_flush();
		break;
	case IOMMU_TEARDOWN256:
	case IOMMU_TEARDOWN4096:
		teardown_evict(1);
		break;
	}
}

int iommu_dma_init(int strategy)
{
	iommu_strategy = strategy;
	tsc_ms = tsc_khz() ? tsc_khz() : 3000000;
	memset(&iommu_stats, 0, sizeof(iommu_stats));
	for (int i = 0; i < NHASH; i++)
		hash_p[i] = hash_i[i] = NIL;
	for (int i = 0; i < NREC; i++)
		recs[i].next_i = i + 1 < NREC ? i + 1 : NIL;
	free_rec = 0;
	checked_at = 0;
	list_head = list_tail = NIL;
	list_len = 0;
	cache_cap = param_u64("shared_cache", 256);
	quota = strategy == IOMMU_TEARDOWN4096 ? 4096 : 256;
	return vtd_domain_init(&iommu_domain, 1);
}

int iommu_dma_attach(u16 sid)
{
	return vtd_attach(sid, &iommu_domain);
}

u64 iommu_map(u64 phys, u64 len, int dir)
{
	u64 t0 = rdtsc();
	u64 ppg = phys >> 12, off = phys & 0xfff;
	u32 n = (off + (len ? len : 1) + 0xfff) >> 12;
	u64 perm = perm_of(dir), pg = 0;
	int s = iommu_strategy;

	iommu_stats.maps++;
	if (s == IOMMU_SHARED || s == IOMMU_TEARDOWN256 || s == IOMMU_TEARDOWN4096) {
		if (s != IOMMU_SHARED)
			iommu_dma_poll();
		int r = find_cached(ppg, n, perm);
		if (r != NIL) {
			struct rec *e = &recs[r];
			if (e->refs++ == 0) {		/* idle (teardown): live again */
				list_del(r);
				iommu_stats.stale--;
			} else if (s == IOMMU_SHARED) {
				list_del(r);		/* most recently used */
				list_push_head(r);
			}
			iommu_stats.reuse_hits++;
			pg = e->pg;
			goto out;
		}
		pg = iova_alloc(n);
		if (!pg || set_ptes(pg, ppg, n, perm))
			goto fail;
		r = rec_new(ppg, pg, n, perm);
		if (r == NIL) {
			printf("iommu-dma: out of mapping records\n");
			goto fail;
		}
		if (s == IOMMU_SHARED) {
			list_push_head(r);
			if ((u64)list_len > cache_cap) {	/* forget the least recent */
				int old = list_tail;
				list_del(old);
				unhash_p(old);
			}
		}
		goto out;
	}
	if (s == IOMMU_ASYNC || s == IOMMU_DEFERRED)
		iommu_dma_poll();
	pg = iova_alloc(n);
	if (!pg && s == IOMMU_ASYNC && pend_head != pend_tail) {	/* space is coming back */
		iommu_dma_drain();
		pg = iova_alloc(n);
	}
	if (!pg && s == IOMMU_DEFERRED) {
		deferred_flush();
		pg = iova_alloc(n);
	}
	if (!pg || set_ptes(pg, ppg, n, perm))
		goto fail;
out:
	iommu_stats.map_cycles += rdtsc() - t0;
	return (pg << 12) | off;
fail:
	printf("iommu-dma: map of %#lx+%#lx failed (IOVA space or page tables)\n", phys, len);
	iommu_stats.map_cycles += rdtsc() - t0;
	return 0;
}

void iommu_unmap(u64 iova, u64 len)
{
	u64 t0 = rdtsc();
	u64 pg = iova >> 12;
	u32 n = ((iova & 0xfff) + (len ? len : 1) + 0xfff) >> 12;
	int s = iommu_strategy;

	iommu_stats.unmaps++;
	switch (s) {
	case IOMMU_STRICT:
		clear_ptes(pg, n);
		inv_pages(pg, n);
		vtd_qi_sync();
		iova_free(pg, n);
		break;
	case IOMMU_SHARED:
	case IOMMU_TEARDOWN256:
	case IOMMU_TEARDOWN4096: {
		int r = find_by_iova(pg);
		if (r == NIL || !recs[r].refs) {
			printf("iommu-dma: unmap of unknown IOVA %#lx\n", iova);
			break;
		}
		struct rec *e = &recs[r];
		if (--e->refs)
			break;
		if (s == IOMMU_SHARED) {
			if (e->cached)
				list_del(r);
			clear_ptes(e->pg, e->n);
			inv_pages(e->pg, e->n);
			vtd_qi_sync();
			iova_free(e->pg, e->n);
			rec_free(r);
		} else {
			e->t_unmap = rdtsc();
			list_push_tail(r);
			stale_inc();
			iommu_dma_poll();
		}
		break;
	}
	case IOMMU_ASYNC:
	case IOMMU_DEFERRED: {
		if (pend_tail - pend_head >= NPEND) {
			if (s == IOMMU_ASYNC)
				async_reap(1);
			else
				deferred_flush();
		}
		clear_ptes(pg, n);
		struct pend *p = &pend[pend_tail % NPEND];
		p->pg = pg;
		p->n = n;
		p->t = rdtsc();
		if (s == IOMMU_ASYNC) {
			inv_pages(pg, n);
			p->seq = vtd_qi_post_wait();
		}
		pend_tail++;
		stale_inc();
		iommu_dma_poll();
		break;
	}
	}
	iommu_stats.unmap_cycles += rdtsc() - t0;
}

void iommu_dma_report(void)
{
	struct vtd_fault f[16];
	int n;
	while ((n = vtd_read_faults(f, 16)) > 0) {
		for (int i = 0; i < n && i < 16; i++)
			if (iommu_stats.faults_seen + i < 5)
				printf("iommu-dma: fault reason=%#x (%s) sid=%#x addr=%#lx %s\n",
				       f[i].reason, vtd_fault_name(f[i].reason), f[i].sid, f[i].addr,
				       f[i].write ? "write" : "read");
		iommu_stats.faults_seen += n;
	}
	struct iommu_dma_stats *s = &iommu_stats;
	printf("iommu-dma strategy=%s maps=%lu unmaps=%lu map_cycles=%lu unmap_cycles=%lu "
	       "cycles_per_map=%lu cycles_per_unmap=%lu reuse_hits=%lu stale=%lu stale_max=%lu "
	       "window_max_us=%lu decide_max_us=%lu check_gap_max_us=%lu flushes=%lu faults_seen=%lu "
	       "qi_descs=%lu qi_waits=%lu qi_timeouts=%lu fault_irqs=%lu\n",
	       iommu_strategy_name(iommu_strategy), s->maps, s->unmaps, s->map_cycles,
	       s->unmap_cycles, s->maps ? s->map_cycles / s->maps : 0,
	       s->unmaps ? s->unmap_cycles / s->unmaps : 0, s->reuse_hits, s->stale, s->stale_max,
	       s->window_max_us, s->decide_max_us, s->check_gap_max_us, s->flushes, s->faults_seen, vtd.qi_submitted, vtd.qi_waits,
	       vtd.qi_timeouts, vtd_fault_irqs);
	if (lucid_present()) {
		lucid_hypercall(LUCID_HC_REPORT, LUCID_REPORT_MAPS, s->maps, 0);
		lucid_hypercall(LUCID_HC_REPORT, LUCID_REPORT_UNMAPS, s->unmaps, 0);
		lucid_hypercall(LUCID_HC_REPORT, LUCID_REPORT_MAP_CYCLES, s->map_cycles, 0);
		lucid_hypercall(LUCID_HC_REPORT, LUCID_REPORT_UNMAP_CYCLES, s->unmap_cycles, 0);
		lucid_hypercall(LUCID_HC_REPORT, LUCID_REPORT_REUSE_HITS, s->reuse_hits, 0);
		lucid_hypercall(LUCID_HC_REPORT, LUCID_REPORT_STALE_MAX, s->stale_max, 0);
		lucid_hypercall(LUCID_HC_REPORT, LUCID_REPORT_WINDOW_MAX_US, s->window_max_us, 0);
		lucid_hypercall(LUCID_HC_REPORT, LUCID_REPORT_FAULTS_SEEN, s->faults_seen, 0);
	}
}

int iommu_dma_setup_for(u16 sid)
{
	int s = iommu_strategy_parse(param_str("strategy", "strict"));
	if (s < 0) {
		printf("iommu-dma: strategy must be strict, shared, async, deferred, teardown256 or "
		       "teardown4096\n");
		return -1;
	}
	if (vtd_setup(0xe0))
		return -1;
	if (iommu_dma_init(s) || iommu_dma_attach(sid))
		return -1;
	if (vtd_gcmd(VTD_GCMD_TE, 1))
		return -1;
	printf("iommu-dma: strategy=%s sid=%02x:%02x.%x levels=%d cm=%d translation on\n",
	       iommu_strategy_name(s), sid >> 8, (sid >> 3) & 31, sid & 7, iommu_domain.levels,
	       vtd.cm);
	return 0;
}
