/*
 * sym-spy: SymSpy end to end (docs/symbiotic.md §4).
 *
 * Discovers Lucid through both paths and prints
 *   "sym-spy discover_hc=F discover_cpuid=F backend=B" (feature bits, 0 =
 *   not found; B: Lucid's backend, pvm where CPUID is not intercepted);
 * without a symbiotic Lucid it prints "sym: not offered", does the same
 * updates on a private record and exits 0 like a plain guest.
 *
 * Otherwise it registers its global page and one per-vCPU page per CPU
 * (cpus=2: the AP registers its own page from its own vCPU), then updates
 * its per-vCPU record `updates` times at CPL3 under the sequence count
 * (counter = i, task = ~i: the pair lets a reader check consistency), then
 * reads Lucid's lines and prints them:
 *   "sym-spy lucid pressure=P available_kib=K rung=R iommu=M runq_wait_ns=W
 *    publishes=N vcpu_publishes=N features=F"
 *   "sym-spy updates=N counter=C registered=1 loop_ns=T"
 * Params: cpus=1|2, updates=N (1000000), hold_ms=T (0: after the updates,
 * keep updating, paced by pace=N pause loops (200) per update, for T ms,
 * so Lucid can read the records meanwhile), wrong_vcpu=1 (the AP's page
 * claims vCPU 0: Lucid must refuse it), bad=1 (try an unaligned page, a
 * page outside RAM and a page without magic: prints their results),
 * report=0 (skip Lucid's lines), via=hc (each update also tells Lucid by
 * an HC_NOTIFY hypercall: the contrast in `lucid bench sym`).
 * Exit: 0 pass, 1 a check failed, 2 registration refused.
 */
#include "libcflat.h"
#include "lucid.h"
#include "sym.h"

/* HC_NOTIFY event of via=hc (Lucid answers 0 to events it does not use) */
#define SYM_NOTIFY_SPY_BENCH 0x5359

static struct sym_global g;
static struct sym_vcpu vp[2];
static struct sym_vcpu scratch;	/* the bad registrations' page */
static volatile long ap_reg = 1;	/* the AP's registration result */
static volatile u32 ap_vcpu;
static u32 wrong_vcpu;

static void ap_register(u32 idx)
{
	(void)idx;
	u32 id = lapic_id();
	ap_vcpu = id;
	/* wrong_vcpu=1: the page says vCPU 0 but registers from this vCPU */
	ap_reg = sym_register_vcpu(&vp[1], wrong_vcpu ? 0 : id);
	if (ap_reg == 0) {
		sym_seq_begin(&vp[1].seq);
		vp[1].counter = 1;
		vp[1].task = ~1u;
		sym_seq_end(&vp[1].seq);
	}
}

static inline void update(struct sym_vcpu *v, u64 i)
{
	sym_seq_begin(&v->seq);
	v->counter = i;
	v->task = ~(u32)i;
	sym_seq_end(&v->seq);
}

static void bad_registrations(void)
{
	/* raw hypercalls: the kit's helpers would fill a valid header */
	scratch.h.magic = SYM_PAGE_MAGIC;
	scratch.h.version = SYM_VERSION;
	scratch.h.kind = SYM_REGISTER_GLOBAL;
	long unaligned = (long)lucid_hypercall(SYM_HC_REGISTER, SYM_REGISTER_GLOBAL,
					       (u64)&scratch + 8, 0);
	long outside = (long)lucid_hypercall(SYM_HC_REGISTER, SYM_REGISTER_GLOBAL,
					     LUCID_MMIO_HOLE, 0);
	scratch.h.magic = 0;
	long magic = (long)lucid_hypercall(SYM_HC_REGISTER, SYM_REGISTER_GLOBAL,
					   (u64)&scratch, 0);
	long kind = (long)lucid_hypercall(SYM_HC_REGISTER, 5, (u64)&scratch, 0);
	printf("sym-spy bad unaligned=%ld outside=%ld magic=%ld kind=%ld\n",
	       unaligned, outside, magic, kind);
}

static void report_lucid(struct sym_vcpu *v)
{
	u64 pressure, avail, publishes, wait, vpub;
	u32 rung, iommu, features, s;

	do {
		s = sym_read_begin(&g.l_seq);
		pressure = g.mem_pressure;
		avail = g.mem_available_kib;
		rung = g.rung;
		iommu = g.iommu_mode;
		features = g.l_features;
		publishes = g.publishes;
	} while (sym_read_retry(&g.l_seq, s));
	do {
		s = sym_read_begin(&v->w_seq);
		wait = v->runq_wait_ns;
		vpub = v->publishes;
	} while (sym_read_retry(&v->w_seq, s));
	printf("sym-spy lucid pressure=%lu available_kib=%lu rung=%u iommu=%u runq_wait_ns=%lu "
	       "publishes=%lu vcpu_publishes=%lu features=%#x\n",
	       pressure, avail, rung, iommu, wait, publishes, vpub, features);
}

int main(void)
{
	u64 updates = param_u64("updates", 1000000);
	u64 cpus = param_u64("cpus", 1);
	u64 hold_ms = param_u64("hold_ms", 0);
	u64 pace = param_u64("pace", 200);
	int via_hc = !strcmp(param_str("via", "page"), "hc");
	wrong_vcpu = (u32)param_u64("wrong_vcpu", 0);

	u32 hc = sym_discover();
	u32 cp = sym_discover_cpuid();
	printf("sym-spy discover_hc=%#x discover_cpuid=%#x backend=%s\n", hc, cp,
	       lucid_present() ? lucid_backend_name() : "none");

	if (!hc || !(hc & SYM_FEAT_SYMSPY)) {
		/* a plain guest: the same work on a private record */
		printf("sym: not offered\n");
		for (u64 i = 1; i <= updates; i++)
			update(&scratch, i);
		printf("sym-spy updates=%lu counter=%lu registered=0\n", updates,
		       scratch.counter);
		return 0;
	}
	if (param_u64("bad", 0))
		bad_registrations();

	long r = sym_register_global(&g);
	long r0 = sym_register_vcpu(&vp[0], lapic_id());
	printf("sym-spy register global=%ld vcpu0=%ld\n", r, r0);
	if (r || r0)
		return 2;

	if (cpus > 1) {
		u32 ids[MAX_CPUS];
		int n = acpi_madt_cpus(ids, MAX_CPUS);
		int up = n >= 2 ? smp_bringup(ids, 2, ap_register, 5000) : 1;
		printf("sym-spy ap up=%d vcpu=%u register=%ld\n", up, ap_vcpu, ap_reg);
		if (up < 2)
			return 1;
		if (ap_reg != 0 && !wrong_vcpu)
			return 2;
	}

	struct sym_vcpu *v = &vp[0];
	u64 t0 = rdtsc();
	if (via_hc) {
		/* the contrast: the same update told to Lucid by a hypercall each time */
		for (u64 i = 1; i <= updates; i++) {
			update(v, i);
			lucid_hypercall(SYM_HC_NOTIFY, SYM_NOTIFY_SPY_BENCH, i, 0);
		}
	} else {
		for (u64 i = 1; i <= updates; i++)
			update(v, i);
	}
	u64 loop_ns = tsc_to_ns(rdtsc() - t0);
	u64 done = updates;

	if (hold_ms) {
		printf("sym-spy holding ms=%lu\n", hold_ms);
		u64 k = tsc_khz() ? tsc_khz() : 3000000;
		u64 end = rdtsc() + hold_ms * k;
		while (rdtsc() < end) {
			update(v, ++done);
			for (u64 p = 0; p < pace; p++)
				cpu_relax();
		}
	}

	if (param_u64("report", 1))
		report_lucid(v);
	printf("sym-spy updates=%lu counter=%lu registered=1 loop_ns=%lu\n", done, v->counter,
	       loop_ns);
	return v->counter == done && v->task == ~(u32)done ? 0 : 1;
}
