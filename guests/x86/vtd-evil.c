/*
 * vtd-evil: a hostile VT-d driver. It writes garbage into every register,
 * points the root, context and page tables outside RAM, into MMIO and at
 * themselves, sets reserved bits, wraps the invalidation queue, submits
 * bad descriptor types and wait descriptors whose status address is
 * outside RAM or in the MMIO hole, and writes IRTEs with reserved bits;
 * between cases it brings the unit back to a known state. Last, a normal
 * setup (tables, QI, IR, translation) with an edu DMA round trip and a
 * remapped MSI must work: that proves the unit recovered.
 *
 * With an edu device (QEMU -device edu, Lucid --device edu) the table
 * cases are exercised by DMA and the IR cases by MSIs; without one they
 * only program the unit, and the final check is the setup alone.
 *
 * Params: seed=1, rounds=2 (passes of garbage over the register window),
 * timeout_ms=1000, skip=a,b (case names).
 * Prints "evil: <case>: <what happened>" per case and "vtd-evil: final
 * setup ok|FAILED". Exit 0 when the final setup worked, 1 if not, 2 no VT-d.
 */
#include "libcflat.h"
#include "vtd.h"
#include "edu.h"
#include "virtio.h"

#define OUTSIDE_RAM	0x7f00000000ul	/* 508 GiB: below a 39-bit MGAW, no RAM there */
#define MMIO_UNASSIGNED	0xd0000000ul
#define FAULT_VECTOR	0xe0
#define EDU_VECTOR	0x50

static struct edu_dev edu;
static int have_edu;
static u64 rng_state, tt;

static u64 rng(void)
{
	rng_state ^= rng_state << 13;
	rng_state ^= rng_state >> 7;
	rng_state ^= rng_state << 17;
	return rng_state;
}

static int skipped(const char *name)
{
	return list_has(param_str("skip", ""), name);
}

static void sync_gcmd(void)
{
	vtd.gcmd = vtd_read32(VTD_GSTS) & (VTD_GCMD_TE | VTD_GCMD_QIE | VTD_GCMD_IRE | VTD_GCMD_CFI);
}

static void clear_faults(void)
{
	struct vtd_fault f[8];
	vtd_read_faults(f, 8);
	vtd_write32(VTD_FSTS, 0x7d);	/* PFO AFO APF IQE ICE ITE: write 1 to clear */
}

/* the queue in use is ours (vtd.iq, 256 entries): end it with a wait
 * descriptor at the head (over whatever stopped it) so that it drains, its
 * last descriptor is a wait (QEMU refuses to turn QI off otherwise) and
 * head == tail */
static int qi_drain(void)
{
	vtd_write32(VTD_FSTS, VTD_FSTS_IQE | VTD_FSTS_ITE | VTD_FSTS_ICE);
	u32 h = (vtd_read64(VTD_IQH) >> 4) & 255;
	u32 seq = ++vtd.wait_seq;
	vtd.iq[2 * h] = VTD_QI_WAIT | (1ul << 5) | ((u64)seq << 32);
	vtd.iq[2 * h + 1] = (u64)vtd.wait_status;
	barrier();
	vtd.iq_tail = vtd.iq_kicked = (h + 1) & 255;
	vtd_write64(VTD_IQT, (u64)vtd.iq_tail << 4);
	return vtd_qi_wait(seq);
}

/* back to: translation, IR and QI off, no faults pending; fault events
 * masked. Returns a short description of what it took. */
static const char *unit_reset(void)
{
	static char what[128];
	int n = 0;
	what[0] = 0;
	vtd_write32(VTD_FECTL, VTD_FECTL_IM);
	sync_gcmd();
	if (vtd.gcmd & VTD_GCMD_TE)
		vtd_gcmd(VTD_GCMD_TE, 0);
	if (vtd.gcmd & VTD_GCMD_IRE)
		vtd_gcmd(VTD_GCMD_IRE, 0);
	if (vtd.gcmd & VTD_GCMD_QIE) {
		if (vtd_read32(VTD_FSTS) & (VTD_FSTS_IQE | VTD_FSTS_ITE))
			n += snprintf(what + n, sizeof(what) - n, "queue-error-cleared ");
		if (qi_drain())
			n += snprintf(what + n, sizeof(what) - n, "drain-failed ");
		if (vtd_gcmd(VTD_GCMD_QIE, 0))
			n += snprintf(what + n, sizeof(what) - n, "QIE-STUCK ");
	}
	if (vtd.gcmd & VTD_GCMD_CFI)
		vtd_gcmd(VTD_GCMD_CFI, 0);
	sync_gcmd();
	clear_faults();
	/* the queue address back to ours, for whatever turns QI on next */
	vtd_write64(VTD_IQT, 0);
	vtd_write64(VTD_IQA, (u64)vtd.iq);
	snprintf(what + n, sizeof(what) - n, "gsts=%#x fsts=%#x", vtd_read32(VTD_GSTS),
		 vtd_read32(VTD_FSTS));
	return what;
}

/* print a case's line (its arguments, dma_probe() included, are evaluated
 * before the reset), then reset the unit and say what that took */
static void done(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void done(const char *fmt, ...)
{
	char b[256];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(b, sizeof(b), fmt, ap);
	va_end(ap);
	printf("%s; reset: %s\n", b, unit_reset());
}

/* edu writes 8 bytes to iova; the faults that follow, as text */
static const char *dma_probe(u64 iova)
{
	static char out[128];
	if (!have_edu)
		return "no edu: not exercised";
	struct vtd_fault f[4];
	clear_faults();
	vtd_fault_irq_setup(FAULT_VECTOR);	/* the reset masked it; garbage moved it */
	u64 irq0 = vtd_fault_irqs;
	edu_dma_start(&edu, iova, 0, 8, 1, 0);
	int to = edu_dma_wait(&edu, tt / (tsc_khz() ? tsc_khz() : 3000000));
	u64 t0 = rdtsc();
	while (vtd_fault_irqs == irq0 && rdtsc() - t0 < tt / 10)
		cpu_relax();
	int n = vtd_read_faults(f, 4);
	if (n)
		snprintf(out, sizeof(out), "dma %s, fault reason=%#x (%s) sid=%#x addr=%#lx, irqs=%lu",
			 to ? "timeout" : "done", f[0].reason, vtd_fault_name(f[0].reason), f[0].sid,
			 f[0].addr, vtd_fault_irqs - irq0);
	else
		snprintf(out, sizeof(out), "dma %s, no fault recorded, fsts=%#x gsts=%#x",
			 to ? "timeout" : "done", vtd_read32(VTD_FSTS), vtd_read32(VTD_GSTS));
	return out;
}

/* root table at rt (RTADDR + SRTP), register-based global invalidation, TE on */
static int set_root_at(u64 rt)
{
	vtd_write64(VTD_RTADDR, rt);
	int r = vtd_gcmd(VTD_GCMD_SRTP, 1);
	vtd_inv_context_global();
	vtd_inv_iotlb_global();
	r |= vtd_gcmd(VTD_GCMD_TE, 1);
	return r;
}

static u64 *page(void)
{
	return dma_alloc(4096, 4096);
}

/* a root table whose bus-0 entry points at ctx; ctx's edu entry at pgd */
static u64 *tables(u64 ctx_addr, u64 *ctx, u64 pgd_addr, u64 ctx_hi)
{
	u64 *root = page();
	root[0] = ctx_addr | 1;
	if (ctx && have_edu) {
		u32 devfn = edu.pci.bdf & 0xff;
		ctx[2 * devfn + 1] = ctx_hi;
		ctx[2 * devfn] = pgd_addr | 1;
	}
	return root;
}

static u64 ctx_hi_ok(void)
{
	return (vtd.levels == 4 ? 2 : 1) | (7ul << 8);	/* AW, DID 7 */
}

static void case_garbage(void)
{
	u64 rounds = param_u64("rounds", 2);
	u32 writes = 0;
	for (u64 r = 0; r < rounds; r++) {
		/* QI turned on by a garbage GCMD uses our (zeroed) queue: QEMU
		 * cannot turn QI off again once a fetch from elsewhere failed */
		memset(vtd.iq, 0, 4096);
		vtd_write64(VTD_IQA, (u64)vtd.iq);
		for (u32 off = 0; off < 0x2000; off += 4) {
			u32 v = rng();
			switch (off) {
			/* MSI address registers keep an MSI address: a garbage one
			 * would make the unit's own interrupts write guest RAM */
			case VTD_FEADDR: case VTD_IEADDR:
				v = 0xfee00000u | (v & 0xff000);
				break;
			case VTD_FEUADDR: case VTD_IEUADDR:
				v = 0;
				break;
			/* table addresses stay out of RAM (a random high half) */
			case VTD_RTADDR + 4: case VTD_IRTA + 4:
				v |= 0x100;
				break;
			}
			vtd_write32(off, v);
			writes++;
		}
		/* and 64-bit garbage on the 64-bit registers */
		const u32 r64[] = { VTD_RTADDR, VTD_CCMD, VTD_IQT, VTD_IRTA, VTD_IQH,
				    vtd.iro + VTD_IVA, vtd.iro + VTD_IOTLB };
		for (u32 i = 0; i < ARRAY_SIZE(r64); i++) {
			vtd_write64(r64[i], rng() | (1ul << 40));
			writes++;
		}
	}
	u32 gsts = vtd_read32(VTD_GSTS), fsts = vtd_read32(VTD_FSTS);
	done("evil: garbage: %u writes over 0x0-0x2000, then gsts=%#x fsts=%#x cap=%s",
	       writes, gsts, fsts, vtd_read64(VTD_CAP) == vtd.cap ? "intact" : "CHANGED");
}

static void case_tables(void)
{
	if (!have_edu)
		printf("evil: tables: no edu device: tables programmed, no DMA to translate\n");
	struct { const char *name; u64 root; } roots[] = {
		{ "root-outside-ram", OUTSIDE_RAM },
		{ "root-in-mmio-hole", MMIO_UNASSIGNED },
		{ "root-is-the-unit", vtd.base },
	};
	for (u32 i = 0; i < ARRAY_SIZE(roots); i++) {
		if (skipped(roots[i].name))
			continue;
		set_root_at(roots[i].root);
		done("evil: %s: rtaddr=%#lx: %s", roots[i].name, roots[i].root, dma_probe(0x1000));
	}
	if (!skipped("root-reserved")) {
		u64 *root = page();
		root[0] = (u64)page() | 1 | (0x7ul << 1);	/* reserved bits 11:1 */
		root[1] = ~0ul;				/* reserved high half */
		set_root_at((u64)root);
		done("evil: root-reserved: %s", dma_probe(0x1000));
	}
	if (!skipped("context-outside-ram")) {
		set_root_at((u64)tables(OUTSIDE_RAM, NULL, 0, 0));
		done("evil: context-outside-ram: %s", dma_probe(0x1000));
	}
	if (!skipped("context-reserved")) {
		u64 *ctx = page();
		set_root_at((u64)tables((u64)ctx, ctx, (u64)page(), ctx_hi_ok() | (0xfful << 24) | 7));
		done("evil: context-reserved (AW 7, high reserved bits): %s",
		       dma_probe(0x1000));
	}
	if (!skipped("pt-outside-ram")) {
		u64 *ctx = page();
		set_root_at((u64)tables((u64)ctx, ctx, OUTSIDE_RAM, ctx_hi_ok()));
		done("evil: pt-outside-ram: %s", dma_probe(0x1000));
	}
	if (!skipped("pt-in-mmio-hole")) {
		u64 *ctx = page();
		set_root_at((u64)tables((u64)ctx, ctx, MMIO_UNASSIGNED, ctx_hi_ok()));
		done("evil: pt-in-mmio-hole: %s", dma_probe(0x1000));
	}
	if (!skipped("pt-loop")) {
		/* every entry of the table points at the table itself: a walk is
		 * bounded by the level count, so the leaf is the table page (a
		 * writable mapping of it); the walk must end */
		u64 *ctx = page(), *pt = page();
		for (int i = 0; i < 512; i++)
			pt[i] = (u64)pt | VTD_PTE_R | VTD_PTE_W;
		set_root_at((u64)tables((u64)ctx, ctx, (u64)pt, ctx_hi_ok()));
		const char *r = dma_probe(0x1000);
		done("evil: pt-loop: %s; table entry 0 now %#lx", r, pt[0]);
	}
	if (!skipped("pt-large-top")) {
		u64 *ctx = page(), *pt = page();
		/* PS in the top-level entry: reserved with 4 levels; with 3 a 1 GiB
		 * page where SLLPS allows it, so it points outside RAM */
		pt[0] = OUTSIDE_RAM | VTD_PTE_R | VTD_PTE_W | VTD_PTE_PS;
		set_root_at((u64)tables((u64)ctx, ctx, (u64)pt, ctx_hi_ok()));
		done("evil: pt-large-top: %s", dma_probe(0x1000));
	}
	if (!skipped("pte-reserved")) {
		struct vtd_domain d;
		vtd_domain_init(&d, 7);
		u64 *tgt = page();
		vtd_map_4k(&d, 0x1000, (u64)tgt, VTD_PTE_R | VTD_PTE_W);
		*vtd_pte(&d, 0x1000, 0) |= 1ul << 51;	/* above any HAW up to 51: reserved */
		u64 *ctx = page();
		set_root_at((u64)tables((u64)ctx, ctx, (u64)d.pgd, ctx_hi_ok()));
		const char *r = dma_probe(0x1000);
		done("evil: pte-reserved: %s; target %s", r,
		       tgt[0] ? "WRITTEN" : "untouched");
	}
}

/* QI on a fresh 256-entry queue */
static void qi_fresh(void)
{
	unit_reset();
	vtd_qi_enable(0);
}

static const char *qi_state(void)
{
	static char s[96];
	snprintf(s, sizeof(s), "iqh=%#lx iqt=%#lx fsts=%#x", vtd_read64(VTD_IQH), vtd_read64(VTD_IQT),
		 vtd_read32(VTD_FSTS));
	return s;
}

/* submit one raw descriptor then a wait; what happened */
static void qi_bad(const char *name, u64 lo, u64 hi)
{
	if (skipped(name))
		return;
	qi_fresh();
	vtd_qi_submit(lo, hi);
	u32 seq = vtd_qi_post_wait();
	int r = vtd_qi_wait(seq);
	done("evil: %s: lo=%#lx hi=%#lx: wait %s, %s", name, lo, hi,
	       r ? "not completed" : "completed", qi_state());
}

static void case_qi(void)
{
	if (!VTD_ECAP_QI(vtd.ecap)) {
		printf("evil: qi: no queued invalidation\n");
		return;
	}
	if (!skipped("iq-wrap")) {
		qi_fresh();
		int fails = 0;
		for (int i = 0; i < 700; i++)		/* 256 entries: wraps twice */
			fails += vtd_qi_sync() != 0;
		/* and a burst that fills the queue up to one short */
		for (int i = 0; i < 254; i++)
			vtd_qi_submit(VTD_QI_IOTLB | (1 << 4), 0);
		fails += vtd_qi_sync() != 0;
		done("evil: iq-wrap: 955 descriptors through 256 slots, %d waits failed, %s",
		       fails, qi_state());
	}
	if (!skipped("iq-tail-beyond")) {
		qi_fresh();
		vtd_write64(VTD_IQT, 300ul << 4);	/* past a 256-entry queue */
		u64 t0 = rdtsc();
		while (!(vtd_read32(VTD_FSTS) & (VTD_FSTS_IQE | VTD_FSTS_ITE)) && rdtsc() - t0 < tt / 10)
			cpu_relax();
		done("evil: iq-tail-beyond: iqt=300 of 256: %s", qi_state());
	}
	if (!lucid_present() && !skipped("iq-outside-ram")) {
		printf("evil: iq-outside-ram: skipped: QEMU 7.2 cannot turn QI off after a failed "
		       "descriptor fetch (and would keep the bad queue)\n");
	} else if (!skipped("iq-outside-ram")) {
		unit_reset();
		vtd_write64(VTD_IQT, 0);
		vtd_write64(VTD_IQA, OUTSIDE_RAM);
		vtd_gcmd(VTD_GCMD_QIE, 1);
		vtd_write64(VTD_IQT, 5ul << 4);
		udelay(1000);
		done("evil: iq-outside-ram: %s", qi_state());
	}
	qi_bad("desc-type-0", 0, 0);
	qi_bad("desc-type-15", 0xf, 0);
	qi_bad("desc-type-7-garbage", 0xdeadbeef00000007ul, 0xfffffffffffffffful);
	qi_bad("desc-devtlb", VTD_QI_DEVTLB | (0x8ul << 32), 0x1000);
	qi_bad("desc-cc-reserved", VTD_QI_CC | (1 << 4) | (0xful << 50), 0);
	qi_bad("desc-iotlb-reserved", VTD_QI_IOTLB | (3 << 4) | (0xfful << 8), 0x1000 | 0x3f);
	qi_bad("desc-iotlb-bad-am", VTD_QI_IOTLB | (3 << 4) | (1ul << 16), 0x1000 | 0x3f);
	qi_bad("desc-iec-reserved", VTD_QI_IEC | (0xfful << 5), 0);
	qi_bad("wait-no-sw-reserved", VTD_QI_WAIT | (0xful << 8), 0);
	qi_bad("wait-status-outside-ram", VTD_QI_WAIT | (1 << 5) | (1ul << 32), OUTSIDE_RAM);
	qi_bad("wait-status-mmio-hole", VTD_QI_WAIT | (1 << 5) | (1ul << 32), MMIO_UNASSIGNED);
	qi_bad("wait-status-unit-itself", VTD_QI_WAIT | (1 << 5) | (1ul << 32), vtd.base + 0xff0);
	qi_bad("wait-status-unaligned", VTD_QI_WAIT | (1 << 5) | (1ul << 32),
	       (u64)vtd.wait_status + 1);
	qi_bad("wait-interrupt", VTD_QI_WAIT | (1 << 4), 0);
}

/* Raises the edu's interrupt as a remappable MSI through IRTE `index` and describes in `b` what
 * came of it: delivered or blocked, and the fault records the unit made. */
static const char *edu_irq_through(u32 index, char *b, size_t size)
{
	u64 a;
	u32 d;
	vtd_msi_remappable(index, &a, &d);
	edu_msi_set(&edu, a, d);
	while (irq_take() >= 0)
		;
	edu_write(&edu, EDU_IRQ_RAISE, 1);
	int v = irq_wait(tt / 10);
	edu_write(&edu, EDU_IRQ_ACK, 1);
	struct vtd_fault f[4];
	int n = vtd_read_faults(f, 4);
	snprintf(b, size, "interrupt %s, %d records%s%s", v < 0 ? "blocked" : "delivered", n,
		 n ? ", reason " : "", n ? vtd_fault_name(f[0].reason) : "");
	edu_msi_disable(&edu);
	return b;
}

static void case_ir(void)
{
	if (!VTD_ECAP_IR(vtd.ecap) || !VTD_ECAP_QI(vtd.ecap)) {
		printf("evil: ir: no interrupt remapping\n");
		return;
	}
	struct { const char *name; u64 lo, hi; u32 index; } c[] = {
		{ "irte-reserved-lo", 1 | (7ul << 12) | ((u64)EDU_VECTOR << 16), 0, 3 },
		{ "irte-reserved-hi", 1 | ((u64)EDU_VECTOR << 16), ~0ul << 20, 3 },
		{ "irte-bad-sid", 1 | ((u64)EDU_VECTOR << 16), 0xfff0 | (1ul << 18), 3 },
		{ "irte-posted", 1 | (1ul << 15) | ((u64)EDU_VECTOR << 16), 0, 3 },
		{ "irte-index-beyond", 1 | ((u64)EDU_VECTOR << 16), 0, 300 },
	};
	lapic_write(0xf0, 0x1ff);
	irq_enable();
	for (u32 i = 0; i < ARRAY_SIZE(c); i++) {
		if (skipped(c[i].name))
			continue;
		qi_fresh();
		vtd_fault_irq_setup(FAULT_VECTOR);
		if (vtd_ir_enable(256, 0)) {
			done("evil: %s: IR would not turn on", c[i].name);
			continue;
		}
		if (c[i].index < 256) {
			vtd.irt[2 * c[i].index + 1] = c[i].hi;
			vtd.irt[2 * c[i].index] = c[i].lo | ((u64)lapic_id() << 40);
			vtd_inv_iec_index(c[i].index);
			vtd_qi_sync();
		}
		const char *what = "no edu: entry written, no MSI sent";
		char b[128];
		if (have_edu)
			what = edu_irq_through(c[i].index, b, sizeof(b));
		done("evil: %s: %s", c[i].name, what);
	}
	if (!skipped("irta-outside-ram")) {
		qi_fresh();
		vtd_write64(VTD_IRTA, OUTSIDE_RAM | 7);
		int r = vtd_gcmd(VTD_GCMD_SIRTP, 1) | vtd_gcmd(VTD_GCMD_IRE, 1);
		const char *what = "no edu";
		char b[96];
		if (have_edu && !r)
			what = edu_irq_through(1, b, sizeof(b));
		done("evil: irta-outside-ram: ire %s, %s", r ? "refused" : "on", what);
	}
}

/* a normal setup from scratch, exercised end to end */
static int final_setup(void)
{
	unit_reset();
	memset(vtd.ctx, 0, sizeof(vtd.ctx));
	vtd.root = NULL;
	vtd.irt = NULL;
	if (vtd_setup(FAULT_VECTOR)) {
		printf("evil: final: vtd_setup failed\n");
		return -1;
	}
	struct vtd_domain d;
	vtd_domain_init(&d, 1);
	if (!have_edu) {
		int ok = vtd_gcmd(VTD_GCMD_TE, 1) == 0 && vtd_qi_sync() == 0 &&
			 vtd_ir_enable(256, 0) == 0;
		printf("evil: final: no edu: setup %s\n", ok ? "ok" : "FAILED");
		return ok ? 0 : -1;
	}
	if (vtd_attach(edu.pci.bdf, &d) || vtd_gcmd(VTD_GCMD_TE, 1) || vtd_ir_enable(256, 0))
		return -1;
	u8 *a = (u8 *)page(), *b = (u8 *)page();
	for (int i = 0; i < 4095; i++)
		a[i] = i * 3 + 1;
	vtd_map_4k(&d, 0x10000, (u64)a, VTD_PTE_R);
	vtd_map_4k(&d, 0x20000, (u64)b, VTD_PTE_W);
	vtd_inv_iotlb_domain(1);
	vtd_qi_sync();
	edu_dma_start(&edu, 0x10000, 0, 4095, 0, 0);
	int r = edu_dma_wait(&edu, 2000);
	edu_dma_start(&edu, 0x20000, 0, 4095, 1, 0);
	r |= edu_dma_wait(&edu, 2000);
	int data = !r && !memcmp(a, b, 4095);
	vtd_irte_set(4, EDU_VECTOR, lapic_id(), edu.pci.bdf);
	u64 ma;
	u32 md;
	vtd_msi_remappable(4, &ma, &md);
	edu_msi_set(&edu, ma, md);
	while (irq_take() >= 0)
		;
	edu_write(&edu, EDU_IRQ_RAISE, 1);
	int v = irq_wait(tt);
	edu_write(&edu, EDU_IRQ_ACK, 1);
	struct vtd_fault f[4];
	int n = vtd_read_faults(f, 4);
	printf("evil: final: dma round trip %s, msi through IRTE %s, %d faults\n",
	       data ? "ok" : "FAILED", v == EDU_VECTOR ? "ok" : "FAILED", n);
	return data && v == EDU_VECTOR && n == 0 ? 0 : -1;
}

int main(void)
{
	rng_state = param_u64("seed", 1) * 2 + 1;
	tt = param_u64("timeout_ms", 1000) * (tsc_khz() ? tsc_khz() : 3000000);
	if (vtd_probe())
		return 2;
	vtd.iq = page();		/* our queue, reused by every case (256 entries) */
	vtd.iq_n = 256;
	vtd.wait_status = dma_alloc(64, 64);
	have_edu = edu_probe(&edu, 0) == 0;
	if (have_edu)
		printf("evil: edu at %02x:%02x.%x\n", edu.pci.bdf >> 8, (edu.pci.bdf >> 3) & 31,
		       edu.pci.bdf & 7);
	if (have_edu) {	/* a known pattern in the device buffer (translation off) */
		u8 *p = (u8 *)page();
		memset(p, 0x11, 4096);
		edu_dma_start(&edu, (u64)p, 0, 4095, 0, 0);
		edu_dma_wait(&edu, 2000);
	}
	vtd_fault_irq_setup(FAULT_VECTOR);
	if (!skipped("garbage"))
		case_garbage();
	vtd_fault_irq_setup(FAULT_VECTOR);
	case_tables();
	case_qi();
	case_ir();
	int ok = final_setup() == 0;
	printf("vtd-evil: final setup %s\n", ok ? "ok" : "FAILED");
	return ok ? 0 : 1;
}
