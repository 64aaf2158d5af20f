/*
 * balloon: a guest with a virtio-balloon that manages a pool of its own
 * pages: it fills them, inflates the balloon to the host's target with
 * pages it does not use, reports statistics, keeps following the target
 * (deflating when it drops), free-page-reports pages it frees, uses the
 * deflate-on-OOM permission when it runs short, and checks its own data in
 * every page it kept.
 *
 * Params: pool_base=32m (the pool: from there to the end of that RAM
 * region), keep_mib=16 (pool pages holding data that must survive),
 * stats=1, report=1 (free page reporting of report_mib=4 of kept pages the
 * guest frees), oom=1 (after inflating, need oom_mib=8 more than is free:
 * deflate below the target if DEFLATE_ON_OOM was negotiated, else the
 * allocation fails), garbage=1 (bad PFNs and descriptors first), hold_ms=0
 * (pause after the "touched" and "inflated" lines, for the host to look),
 * follow_ms=0 (then follow target changes this long), until_zero=0 (1:
 * stop following once target and balloon are both 0), timeout_ms=5000.
 *
 * Prints "balloon: features=.. target=.." at start, "balloon: touched
 * pool_pages=N", "balloon: inflated actual=A target=T", "balloon: garbage
 * sent ok", "balloon: reported pages=N", "balloon: oom ...", "balloon:
 * deflated actual=A target=T" while following, and at the end "balloon:
 * PASS"/"balloon: FAIL" with "data_errors=E zero_errors=Z inflated=I
 * deflated=D reported=R stats_sent=S". Exit 0 on PASS, 1 on FAIL, 2 when
 * setup fails.
 */
#include "libcflat.h"
#include "balloon.h"

enum { P_FREE = 0, P_DATA = 1, P_BALLOON = 2 };

static struct balloon b;
static u8 *state;			/* per pool page */
static u64 pool_pfn, pool_pages;
static u64 nfree, nballoon, ndata;
static u64 data_errors, zero_errors, inflated, deflated, reported;

static u64 pat(u64 pfn, u64 i)
{
	u64 x = (pfn << 9 | i) * 0x9e3779b97f4a7c15ull;
	return x ^ (x >> 29) ^ 0x5eed;
}

static void fill(u64 pfn)
{
	u64 *w = (u64 *)(pfn << 12);
	for (u64 i = 0; i < 512; i++)
		w[i] = pat(pfn, i);
}

static int check(u64 pfn)
{
	const u64 *w = (const u64 *)(pfn << 12);
	for (u64 i = 0; i < 512; i++)
		if (w[i] != pat(pfn, i)) {
			if (data_errors < 5)
				printf("balloon: MISMATCH pfn=%#lx word=%lu\n", pfn, i);
			data_errors++;
			return 0;
		}
	return 1;
}

static int is_zero(u64 pfn)
{
	const u64 *w = (const u64 *)(pfn << 12);
	for (u64 i = 0; i < 512; i++)
		if (w[i])
			return 0;
	return 1;
}

static void set_state(u64 i, u8 s)
{
	u8 old = state[i];
	nfree -= old == P_FREE;
	nballoon -= old == P_BALLOON;
	ndata -= old == P_DATA;
	state[i] = s;
	nfree += s == P_FREE;
	nballoon += s == P_BALLOON;
	ndata += s == P_DATA;
}

static void update_stats(void)
{
	balloon_stat_set(&b, VIRTIO_BALLOON_S_MEMTOT, (pool_pages + (pool_pfn)) << 12);
	balloon_stat_set(&b, VIRTIO_BALLOON_S_MEMFREE, nfree << 12);
	balloon_stat_set(&b, VIRTIO_BALLOON_S_AVAIL, nfree << 12);
	balloon_stat_set(&b, VIRTIO_BALLOON_S_MAJFLT, 0);
	balloon_stat_set(&b, VIRTIO_BALLOON_S_MINFLT, inflated + deflated);
	balloon_stats_poll(&b);
}

/* take up to n free pages (from the top of the pool) into the balloon */
static int inflate(u64 n)
{
	u32 pfns[BALLOON_PFNS_PER_BUF];
	u64 i = pool_pages;
	while (n) {
		int k = 0;
		while (k < BALLOON_PFNS_PER_BUF && (u64)k < n && i > 0) {
			i--;
			if (state[i] != P_FREE)
				continue;
			pfns[k++] = pool_pfn + i;
			set_state(i, P_BALLOON);
		}
		if (!k)
			break;
		if (balloon_pfns(&b, 0, pfns, k))
			return -1;
		inflated += k;
		n -= k;
		balloon_set_actual(&b, nballoon);
	}
	return 0;
}

/* give n balloon pages back to the guest (lowest first); use them */
static int deflate(u64 n)
{
	u32 pfns[BALLOON_PFNS_PER_BUF];
	u64 i = 0;
	while (n) {
		int k = 0;
		while (k < BALLOON_PFNS_PER_BUF && (u64)k < n && i < pool_pages) {
			if (state[i] == P_BALLOON) {
				pfns[k++] = pool_pfn + i;
				set_state(i, P_FREE);
			}
			i++;
		}
		if (!k)
			break;
		if (balloon_pfns(&b, 1, pfns, k))
			return -1;
		deflated += k;
		n -= k;
		balloon_set_actual(&b, nballoon);
		/* the pages are the guest's again: they read as zeros, and hold data */
		for (int j = 0; j < k; j++) {
			if (!is_zero(pfns[j]))
				zero_errors++;
			fill(pfns[j]);
			if (!check(pfns[j]))
				break;
		}
	}
	return 0;
}

/* follow the target once; returns 1 if it changed something */
static int follow(void)
{
	u64 t = balloon_target(&b);
	if (t > nballoon && nfree) {
		inflate(t - nballoon);
		return 1;
	}
	if (t < nballoon) {
		deflate(nballoon - t);
		printf("balloon: deflated actual=%lu target=%lu\n", nballoon, t);
		return 1;
	}
	return 0;
}

static void hold(void)
{
	u64 ms = param_u64("hold_ms", 0);
	if (ms)
		udelay(ms * 1000);
}

static int garbage(void)
{
	u32 *bad = dma_alloc(64, 64);
	u64 ram_end = ram_region_end(pool_pfn << 12);
	bad[0] = 0xffffffff;
	bad[1] = 0xc0000;			/* the MMIO hole */
	bad[2] = (u32)(ram_end >> 12) + 16;	/* past RAM */
	bad[3] = 0xfee00;			/* the LAPIC */
	u64 a[5] = {(u64)bad, (u64)bad, (u64)bad, (u64)bad, 0xfffff000ull};
	u32 l[5] = {16, 6, 0, 16, 4096};
	u8 w[5] = {0, 0, 0, 1, 0};
	if (balloon_chain(&b, b.inflq, a, l, w, 5) || balloon_chain(&b, b.deflq, a, l, w, 2))
		return -1;
	if (b.repq) {
		u64 ra[3] = {(pool_pfn << 12) + 8, 0xc0000000ull, ram_end};
		u32 rl[3] = {4096, 4096, 1 << 20};
		u8 rw[3] = {1, 1, 1};
		if (balloon_chain(&b, b.repq, ra, rl, rw, 3))
			return -1;
	}
	return 0;
}

/* free report_mib of the kept data pages and report them */
static int report(u64 mib)
{
	u64 n = mib << 8, first = 0, cnt = 0;
	for (u64 i = 0; i < pool_pages && cnt < n; i++)
		if (state[i] == P_DATA) {
			if (!cnt)
				first = i;
			else if (i != first + cnt)
				break;
			cnt++;
		}
	if (!cnt)
		return 0;
	/* 2 MiB ranges, device-writable, as Linux reports them */
	u64 a[64];
	u32 l[64];
	u8 w[64];
	int nd = 0;
	for (u64 off = 0; off < cnt && nd < 64; off += 512, nd++) {
		a[nd] = (pool_pfn + first + off) << 12;
		l[nd] = (cnt - off < 512 ? cnt - off : 512) << 12;
		w[nd] = 1;
	}
	for (u64 i = first; i < first + cnt; i++)
		set_state(i, P_FREE);
	if (balloon_chain(&b, b.repq, a, l, w, nd))
		return -1;
	reported += cnt;
	/* reported pages read zero, then hold data again */
	for (u64 i = first; i < first + cnt; i++) {
		if (!is_zero(pool_pfn + i))
			zero_errors++;
		fill(pool_pfn + i);
		set_state(i, P_DATA);
	}
	printf("balloon: reported pages=%lu\n", cnt);
	return 0;
}

/* need n more pages than are free */
static int oom(u64 n)
{
	u64 short_by = n > nfree ? n - nfree : 0;
	if (!short_by) {
		printf("balloon: oom: not short of memory (free %lu pages)\n", nfree);
		return 0;
	}
	if (!balloon_has(&b, VIRTIO_BALLOON_F_DEFLATE_ON_OOM)) {
		printf("balloon: oom: short by %lu pages, allocation fails (no deflate-on-oom)\n",
		       short_by);
		return 0;
	}
	u64 before = nballoon;
	if (deflate(short_by))
		return -1;
	/* allocate: the free pages become data */
	u64 got = 0;
	for (u64 i = 0; i < pool_pages && got < n; i++)
		if (state[i] == P_FREE) {
			fill(pool_pfn + i);
			set_state(i, P_DATA);
			got++;
		}
	printf("balloon: oom deflated %lu pages below target=%u (actual %lu), allocated %lu\n",
	       before - nballoon, balloon_target(&b), nballoon, got);
	return 0;
}

int main(void)
{
	u64 base = param_u64("pool_base", 32 << 20) & ~0xfffull;
	u64 end = ram_region_end(base);
	if (!end || end > 0xc0000000ull) {
		printf("balloon: no RAM at pool_base=%#lx\n", base);
		return 2;
	}
	pool_pfn = base >> 12;
	pool_pages = (end - base) >> 12;
	u64 keep = param_u64("keep_mib", 16) << 8;
	if (keep > pool_pages)
		keep = pool_pages;
	if (balloon_init(&b, 0, param_u64("stats", 1), 1, param_u64("report", 1)))
		return 2;
	state = dma_alloc(pool_pages, 64);
	printf("balloon: features=%#lx target=%u pool=%#lx+%lu pages queues=%d%s%s\n",
	       b.dev.features, balloon_target(&b), base, pool_pages, b.dev.num_queues,
	       b.statsq ? " stats" : "", b.repq ? " reporting" : "");

	/* every pool page is touched (the host backs it); the first keep hold data */
	for (u64 i = 0; i < pool_pages; i++) {
		fill(pool_pfn + i);
		state[i] = i < keep ? P_DATA : P_FREE;
	}
	nfree = pool_pages - keep;
	ndata = keep;
	update_stats();
	printf("balloon: touched pool_pages=%lu\n", pool_pages);
	hold();

	if (param_u64("garbage", 1)) {
		if (garbage()) {
			printf("balloon: FAIL: the device stopped after garbage\n");
			return 1;
		}
		printf("balloon: garbage sent ok\n");
	}

	u64 t = balloon_target(&b);
	if (inflate(t > nballoon ? t - nballoon : 0))
		return 1;
	update_stats();
	printf("balloon: inflated actual=%lu target=%u\n", nballoon, balloon_target(&b));
	hold();
	/* a sample of the ballooned pages: the host dropped their content */
	for (u64 i = 0; i < pool_pages; i += 256)
		if (state[i] == P_BALLOON && !is_zero(pool_pfn + i))
			zero_errors++;

	if (b.repq && param_u64("report", 1))
		if (report(param_u64("report_mib", 4)))
			return 1;
	if (param_u64("oom", 1))
		if (oom(nfree + (param_u64("oom_mib", 8) << 8)))
			return 1;

	u64 follow_ms = param_u64("follow_ms", 0);
	if (follow_ms) {
		u64 k = tsc_khz() ? tsc_khz() : 3000000;
		u64 t0 = rdtsc(), lim = follow_ms * k;
		int until_zero = param_u64("until_zero", 0);
		while (rdtsc() - t0 < lim) {
			update_stats();
			if (!follow())
				udelay(1000);
			if (until_zero && !nballoon && !balloon_target(&b))
				break;
		}
		printf("balloon: followed actual=%lu target=%u\n", nballoon, balloon_target(&b));
	}

	u64 checked = 0;
	for (u64 i = 0; i < pool_pages; i++)
		if (state[i] == P_DATA) {
			check(pool_pfn + i);
			checked++;
		}
	int ok = !data_errors && !zero_errors && !(virtio_status(&b.dev) & VIRTIO_S_NEEDS_RESET);
	printf("balloon: %s data_pages=%lu data_errors=%lu zero_errors=%lu inflated=%lu deflated=%lu "
	       "reported=%lu stats_sent=%lu actual=%lu\n",
	       ok ? "PASS" : "FAIL", checked, data_errors, zero_errors, inflated, deflated, reported,
	       b.stats_sent, nballoon);
	return ok ? 0 : 1;
}
