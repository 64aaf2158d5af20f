/*
 * cpl0-insns: runs at CPL0 instructions that KVM's emulator lacks or gets
 * wrong on hosts that emulate guest kernel code (PVM), and prints what
 * they did, for a test to compare with the CPU's own result (the same
 * instruction run natively on the host, or the SDM's rules).
 *
 * Groups (param `run`, comma-separated, default all): cpuid, shift
 * (shld/shrd by cl and by immediate, 16/32/64-bit, register and memory
 * destinations, also run at CPL3 natively), xgetbv, clwb, rdpru, invpcid,
 * int (int n and int3 through the IDT: frame, stack switch, gate checks);
 * only when named: msr (rdmsr of MSR `msr`, then wrmsr of `value` to it and
 * rdmsr again; for an MSR the VMM hooks, all three exits reach the hook).
 * Param `xcr0` (3): the value xsetbv loads before xgetbv reads it.
 *
 * A fault at CPL0 is caught (vectors #UD, #NP, #GP, #PF) and printed as
 * `fault=VEC/ERR`; `fault=none` when the instruction completed.
 */
#include "libcflat.h"

/* ---- catching faults at CPL0: the handler resumes at catch_rip ---- */
#define NO_FAULT 0xffUL
volatile u64 catch_rip, caught_vec = NO_FAULT, caught_err, caught_cr2;
extern char catch_ud[], catch_np[], catch_gp[], catch_pf[];
asm(".text\n"
    "catch_ud: pushq $0\n pushq $6\n jmp catch_common\n"
    "catch_np: pushq $11\n jmp catch_common\n"
    "catch_gp: pushq $13\n jmp catch_common\n"
    "catch_pf: pushq $14\n jmp catch_common\n"
    "catch_common:\n"
    "	cmpq $0, catch_rip(%rip)\n"
    "	je 1f\n"
    "	popq caught_vec(%rip)\n"
    "	popq caught_err(%rip)\n"
    "	pushq %rax\n"
    "	movq %cr2, %rax\n"
    "	movq %rax, caught_cr2(%rip)\n"
    "	movq catch_rip(%rip), %rax\n"
    "	movq %rax, 8(%rsp)\n"		/* the frame's rip */
    "	movq $0, catch_rip(%rip)\n"
    "	popq %rax\n"
    "	iretq\n"
    "1:	movl $0x7e, %eax\n"		/* not armed: as the kit does */
    "	outl %eax, $0xf4\n"
    "	cli\n"
    "	hlt\n");

/* arm the catcher, run INSN, disarm; caught_vec says what happened */
#define TRY(insn) "leaq 9f(%%rip), %%r11\n\t" \
	"movq %%r11, catch_rip(%%rip)\n\t" insn "\n9:\tmovq $0, catch_rip(%%rip)\n\t"

static void arm(void)
{
	caught_vec = NO_FAULT;
	caught_err = 0;
}

struct idt_gate {
	u16 off0, sel;
	u8 ist, type;
	u16 off1;
	u32 off2, reserved;
};
extern struct idt_gate idt_table[256];

static void set_gate(int v, void *fn, int ist, u8 type)
{
	u64 a = (u64)fn;
	struct idt_gate *g = &idt_table[v];

	g->off0 = a & 0xffff;
	g->sel = SEL_KCODE64;
	g->ist = ist;
	g->type = type;
	g->off1 = (a >> 16) & 0xffff;
	g->off2 = a >> 32;
	g->reserved = 0;
}

static void print_fault(void)
{
	if (caught_vec == NO_FAULT)
		printf(" fault=none");
	else
		printf(" fault=%lu/%#lx", caught_vec, caught_err);
}

static int wanted(const char *group)
{
	const char *run = param_str("run", "all");

	return !strcmp(run, "all") || list_has(run, group);
}

/* ---- cpuid: what the guest sees at CPL0 (emulated) and at CPL3 ---- */
static void cpuid(u32 leaf, u32 sub, u32 r[4])
{
	asm volatile("cpuid" : "=a"(r[0]), "=b"(r[1]), "=c"(r[2]), "=d"(r[3]) : "a"(leaf), "c"(sub));
}

static const u32 cpuid_leaves[][2] = { { 1, 0 }, { 7, 0 }, { 0xd, 1 }, { 0x80000008, 0 } };
static u32 cpuid_cpl0[4][4];

static u64 cpuid_fn(u64 unused)
{
	for (int i = 0; i < 4; i++)
		cpuid(cpuid_leaves[i][0], cpuid_leaves[i][1], cpuid_cpl0[i]);
	return 0;
}

static void run_cpuid(void)
{
	cpl0_call(cpuid_fn, 0);
	for (int i = 0; i < 4; i++) {
		u32 r[4];
		cpuid(cpuid_leaves[i][0], cpuid_leaves[i][1], r);
		printf("cpuid leaf=%#x sub=%u cpl0=%#x,%#x,%#x,%#x cpl3=%#x,%#x,%#x,%#x\n",
		       cpuid_leaves[i][0], cpuid_leaves[i][1], cpuid_cpl0[i][0], cpuid_cpl0[i][1],
		       cpuid_cpl0[i][2], cpuid_cpl0[i][3], r[0], r[1], r[2], r[3]);
	}
}

/* ---- shld/shrd ---- */
/* every arithmetic flag set, so a count of 0 shows flags left alone (IF stays 0) */
#define FLAGS_IN 0x8d7UL
typedef void (*shift_fn)(u64 *d, u64 s, u64 c, u64 *f);

/* register forms work on the full 64-bit registers, so the upper bits a
 * 16-bit (kept) or 32-bit (zeroed) destination leaves are visible */
#define SHIFT_REG(name, insn)							\
static void name(u64 *d, u64 s, u64 c, u64 *f)					\
{										\
	u64 dv = *d, fl = FLAGS_IN;						\
	asm volatile("pushq %[fl]; popfq; " insn "; pushfq; popq %[fl]"	\
		     : [d] "+r"(dv), [fl] "+r"(fl) : [s] "r"(s), "c"(c) : "cc");	\
	*d = dv;								\
	*f = fl;								\
}
#define SHIFT_MEM(name, insn, type)						\
static void name(u64 *d, u64 s, u64 c, u64 *f)					\
{										\
	volatile type dv = *d;							\
	type sv = s;								\
	u64 fl = FLAGS_IN;							\
	asm volatile("pushq %[fl]; popfq; " insn "; pushfq; popq %[fl]"	\
		     : [d] "+m"(dv), [fl] "+r"(fl) : [s] "r"(sv), "c"(c) : "cc");	\
	*d = dv;								\
	*f = fl;								\
}
SHIFT_REG(shld16_cl, "shld %%cl, %w[s], %w[d]")
SHIFT_REG(shld32_cl, "shld %%cl, %k[s], %k[d]")
SHIFT_REG(shld64_cl, "shld %%cl, %q[s], %q[d]")
SHIFT_REG(shrd16_cl, "shrd %%cl, %w[s], %w[d]")
SHIFT_REG(shrd32_cl, "shrd %%cl, %k[s], %k[d]")
SHIFT_REG(shrd64_cl, "shrd %%cl, %q[s], %q[d]")
SHIFT_MEM(shld16_mem, "shld %%cl, %[s], %[d]", u16)
SHIFT_MEM(shld32_mem, "shld %%cl, %[s], %[d]", u32)
SHIFT_MEM(shld64_mem, "shld %%cl, %[s], %[d]", u64)
SHIFT_MEM(shrd16_mem, "shrd %%cl, %[s], %[d]", u16)
SHIFT_MEM(shrd32_mem, "shrd %%cl, %[s], %[d]", u32)
SHIFT_MEM(shrd64_mem, "shrd %%cl, %[s], %[d]", u64)
SHIFT_REG(shld16_imm, "shld $5, %w[s], %w[d]")
SHIFT_REG(shld32_imm, "shld $5, %k[s], %k[d]")
SHIFT_REG(shld64_imm, "shld $5, %q[s], %q[d]")
SHIFT_REG(shrd16_imm, "shrd $5, %w[s], %w[d]")
SHIFT_REG(shrd32_imm, "shrd $5, %k[s], %k[d]")
SHIFT_REG(shrd64_imm, "shrd $5, %q[s], %q[d]")

/* the count register as destination or source, and REX registers */
static void shld64_rcx_dst(u64 *d, u64 s, u64 c, u64 *f)
{
	u64 fl = FLAGS_IN, cx = (*d & ~0xffUL) | (c & 0xff);
	asm volatile("pushq %[fl]; popfq; shld %%cl, %[s], %%rcx; pushfq; popq %[fl]"
		     : "+c"(cx), [fl] "+r"(fl) : [s] "r"(s) : "cc");
	*d = cx;
	*f = fl;
}
static void shrd32_rcx_src(u64 *d, u64 s, u64 c, u64 *f)
{
	u64 fl = FLAGS_IN, dv = *d, cx = (s & ~0xffUL) | (c & 0xff);
	asm volatile("pushq %[fl]; popfq; shrd %%cl, %%ecx, %k[d]; pushfq; popq %[fl]"
		     : [d] "+r"(dv), [fl] "+r"(fl) : "c"(cx) : "cc");
	*d = dv;
	*f = fl;
}
static void shld16_r9_r10(u64 *d, u64 s, u64 c, u64 *f)
{
	register u64 r9 asm("r9") = *d;
	register u64 r10 asm("r10") = s;
	u64 fl = FLAGS_IN;
	asm volatile("pushq %[fl]; popfq; shld %%cl, %%r10w, %%r9w; pushfq; popq %[fl]"
		     : "+r"(r9), [fl] "+r"(fl) : "r"(r10), "c"(c) : "cc");
	*d = r9;
	*f = fl;
}

static const struct {
	const char *op, *form;
	int width;
	shift_fn fn;
} shift_fns[] = {
	{ "shld", "cl", 16, shld16_cl }, { "shld", "cl", 32, shld32_cl }, { "shld", "cl", 64, shld64_cl },
	{ "shrd", "cl", 16, shrd16_cl }, { "shrd", "cl", 32, shrd32_cl }, { "shrd", "cl", 64, shrd64_cl },
	{ "shld", "mem", 16, shld16_mem }, { "shld", "mem", 32, shld32_mem }, { "shld", "mem", 64, shld64_mem },
	{ "shrd", "mem", 16, shrd16_mem }, { "shrd", "mem", 32, shrd32_mem }, { "shrd", "mem", 64, shrd64_mem },
	{ "shld", "imm", 16, shld16_imm }, { "shld", "imm", 32, shld32_imm }, { "shld", "imm", 64, shld64_imm },
	{ "shrd", "imm", 16, shrd16_imm }, { "shrd", "imm", 32, shrd32_imm }, { "shrd", "imm", 64, shrd64_imm },
	{ "shld", "cl-rcx-dst", 64, shld64_rcx_dst }, { "shrd", "cl-ecx-src", 32, shrd32_rcx_src },
	{ "shld", "cl-r9w-r10w", 16, shld16_r9_r10 },
};
/* counts with a defined result for each width (masked to 5 or 6 bits) */
static const u64 counts16[] = { 0, 1, 4, 15, 16, 33, 0x101 };
static const u64 counts32[] = { 0, 1, 5, 31, 32, 37, 0x121 };
static const u64 counts64[] = { 0, 1, 13, 63, 64, 65, 0x7f };
#define NCOUNTS 7
static const u64 shift_inputs[][2] = {
	{ 0x8123456789abcdefUL, 0xf0e1d2c3b4a59687UL },
	{ 0x0000000000000001UL, 0x8000000000000000UL },
};
#define NSHIFT (ARRAY_SIZE(shift_fns) * NCOUNTS * ARRAY_SIZE(shift_inputs))
static u64 shift_out[NSHIFT][2];

static u64 shift_count(int width, int k)
{
	return width == 16 ? counts16[k] : width == 32 ? counts32[k] : counts64[k];
}

static u64 shift_all(u64 cpl)
{
	int n = 0;
	for (size_t i = 0; i < ARRAY_SIZE(shift_fns); i++)
		for (int k = 0; k < NCOUNTS; k++)
			for (size_t j = 0; j < ARRAY_SIZE(shift_inputs); j++, n++) {
				u64 d = shift_inputs[j][0];
				shift_fns[i].fn(&d, shift_inputs[j][1], shift_count(shift_fns[i].width, k),
						&shift_out[n][1]);
				shift_out[n][0] = d;
			}
	return 0;
}

static void run_shift(void)
{
	static u64 cpl3[NSHIFT][2];
	int n = 0;

	shift_all(3);
	memcpy(cpl3, shift_out, sizeof(cpl3));
	cpl0_call(shift_all, 0);
	for (size_t i = 0; i < ARRAY_SIZE(shift_fns); i++)
		for (int k = 0; k < NCOUNTS; k++)
			for (size_t j = 0; j < ARRAY_SIZE(shift_inputs); j++, n++) {
				int w = shift_fns[i].width;
				printf("shift op=%s form=%s width=%d d=%#lx s=%#lx count=%lu cpl0=%#lx/%#lx cpl3=%#lx/%#lx\n",
				       shift_fns[i].op, shift_fns[i].form, w, shift_inputs[j][0],
				       shift_inputs[j][1],
				       shift_fns[i].form[0] == 'i' ? 5 : shift_count(w, k),
				       shift_out[n][0], shift_out[n][1], cpl3[n][0], cpl3[n][1]);
			}
}

/* ---- xgetbv ---- */
#define CR4_OSFXSR (1UL << 9)
#define CR4_OSXMMEXCPT (1UL << 10)
#define CR4_OSXSAVE (1UL << 18)
static struct {
	u64 val[4], vec[4], err[4];
	u64 set_vec, set_err;
} xg;

static void xgetbv_try(int i, u32 ecx)
{
	u32 lo = 0, hi = 0;
	arm();
	asm volatile(TRY("xgetbv") : "=a"(lo), "=d"(hi) : "c"(ecx) : "r11", "memory");
	xg.val[i] = (u64)hi << 32 | lo;
	xg.vec[i] = caught_vec;
	xg.err[i] = caught_err;
}

static u64 xgetbv_fn(u64 xcr0)
{
	u64 cr4;
	asm volatile("mov %%cr4, %0" : "=r"(cr4));
	asm volatile("mov %0, %%cr4" :: "r"(cr4 & ~CR4_OSXSAVE));
	xgetbv_try(0, 0);				/* CR4.OSXSAVE=0: #UD */
	asm volatile("mov %0, %%cr4" :: "r"(cr4 | CR4_OSFXSR | CR4_OSXMMEXCPT | CR4_OSXSAVE));
	arm();
	asm volatile(TRY("xsetbv") :: "a"((u32)xcr0), "d"((u32)(xcr0 >> 32)), "c"(0) : "r11", "memory");
	xg.set_vec = caught_vec;
	xg.set_err = caught_err;
	xgetbv_try(1, 0);				/* XCR0 */
	/* SSE state out of its initial configuration: XINUSE[1] is 1 */
	asm volatile("movq %0, %%xmm0" :: "r"(0x1234UL));
	xgetbv_try(2, 1);
	xgetbv_try(3, 2);				/* no XCR2: #GP(0) */
	return 0;
}

static void run_xgetbv(void)
{
	static const char *const what[] = { "osxsave0", "xcr0", "xinuse", "ecx2" };
	static const u32 ecx[] = { 0, 0, 1, 2 };
	u64 xcr0 = param_u64("xcr0", 3);

	cpl0_call(xgetbv_fn, xcr0);
	for (int i = 0; i < 4; i++) {
		if (i == 1) {
			caught_vec = xg.set_vec;
			caught_err = xg.set_err;
			printf("xsetbv value=%#lx", xcr0);
			print_fault();
			printf("\n");
		}
		caught_vec = xg.vec[i];
		caught_err = xg.err[i];
		printf("xgetbv case=%s ecx=%u", what[i], ecx[i]);
		print_fault();
		printf(" value=%#lx\n", xg.val[i]);
	}
}

/* ---- clwb ---- */
static u64 clwb_line[8] __attribute__((aligned(64))) = { 0x1122334455667788UL };
static u64 clwb_out[3][3];
/* the identity map covers 0-4 GiB: 4 GiB is not mapped */
#define UNMAPPED 0x100000000UL

static u64 clwb_fn(u64 unused)
{
	u64 addrs[3] = { (u64)clwb_line, 0x8000000000000000UL, UNMAPPED + 0x40 };
	for (int i = 0; i < 3; i++) {
		arm();
		caught_cr2 = 0;
		asm volatile(TRY("clwb (%0)") :: "r"(addrs[i]) : "r11", "memory");
		clwb_out[i][0] = caught_vec;
		clwb_out[i][1] = caught_err;
		clwb_out[i][2] = caught_cr2;
	}
	return 0;
}

static void run_clwb(void)
{
	static const char *const what[] = { "line", "noncanonical", "unmapped" };
	cpl0_call(clwb_fn, 0);
	for (int i = 0; i < 3; i++) {
		caught_vec = clwb_out[i][0];
		caught_err = clwb_out[i][1];
		printf("clwb case=%s", what[i]);
		print_fault();
		printf(" cr2=%#lx value=%#lx\n", clwb_out[i][2], clwb_line[0]);
	}
}

/* ---- rdpru ---- */
static u64 rdpru_out[3];

static u64 rdpru_fn(u64 unused)
{
	u32 lo = 0, hi = 0;
	arm();
	asm volatile(TRY(".byte 0x0f, 0x01, 0xfd") : "=a"(lo), "=d"(hi) : "c"(0) : "r11", "memory");
	rdpru_out[0] = (u64)hi << 32 | lo;
	rdpru_out[1] = caught_vec;
	rdpru_out[2] = caught_err;
	return 0;
}

/* ---- msr: rdmsr, wrmsr, rdmsr of one MSR (a VMM's MSR hook answers them) ---- */
static u64 msr_val[3], msr_vec[3], msr_err[3];

static u64 msr_fn(u64 value)
{
	u32 index = param_u64("msr", 0x4c550000), lo, hi;

	for (int i = 0; i < 3; i++) {
		arm();
		lo = hi = 0;
		if (i == 1)
			asm volatile(TRY("wrmsr") :: "a"((u32)value), "d"((u32)(value >> 32)),
				     "c"(index) : "r11", "memory");
		else
			asm volatile(TRY("rdmsr") : "+a"(lo), "+d"(hi) : "c"(index) : "r11", "memory");
		msr_val[i] = i == 1 ? value : (u64)hi << 32 | lo;
		msr_vec[i] = caught_vec;
		msr_err[i] = caught_err;
	}
	return 0;
}

static void run_msr(void)
{
	static const char *const what[3] = { "read", "write", "reread" };

	cpl0_call(msr_fn, param_u64("value", 0x1234));
	printf("msr index=%#lx", param_u64("msr", 0x4c550000));
	for (int i = 0; i < 3; i++) {
		printf(" %s=%#lx", what[i], msr_val[i]);
		caught_vec = msr_vec[i];
		caught_err = msr_err[i];
		print_fault();
	}
	printf("\n");
}

static void run_rdpru(void)
{
	cpl0_call(rdpru_fn, 0);
	caught_vec = rdpru_out[1];
	caught_err = rdpru_out[2];
	printf("rdpru ecx=0");
	print_fault();
	printf(" value=%#lx\n", rdpru_out[0]);
}

/* ---- invpcid ----
 * A 2 MiB window at WIN is remapped through a 4 KiB page table: its first
 * page points at page A or page B; after the PTE changes and INVPCID, a
 * read through the window must see the new page. */
#define WIN 0x40000000UL
extern u64 pml4[];
static u64 pt[512] __attribute__((aligned(4096)));
static u64 page_a[512] __attribute__((aligned(4096)));
static u64 page_b[512] __attribute__((aligned(4096)));
static struct {
	u64 type, pcid, addr;
	u64 before, after, vec, err;
} inv[8];
static int ninv;

static void reload_cr3(void)
{
	u64 cr3;
	asm volatile("mov %%cr3, %0; mov %0, %%cr3" : "=r"(cr3) :: "memory");
}

static u64 invpcid_fn(u64 unused)
{
	static const u64 cases[][3] = {
		/* type, pcid, address */
		{ 0, 0, WIN }, { 1, 0, 0 }, { 2, 0, 0 }, { 3, 0, 0 },
		{ 4, 0, 0 },			/* no such type: #GP(0) */
		{ 0, 1, WIN },			/* PCID != 0 with CR4.PCIDE=0: #GP(0) */
		{ 2, 1UL << 12, 0 },		/* reserved descriptor bits: #GP(0) */
		{ 0, 0, 0x8000000000000000UL },	/* non-canonical address: #GP(0) */
	};
	u64 *pdpt = (u64 *)(pml4[0] & ~0xfffUL);
	u64 *pde = (u64 *)(pdpt[WIN >> 30] & ~0xfffUL) + ((WIN >> 21) & 511);
	u64 saved = *pde;

	pt[0] = (u64)page_a | 0x7;
	*pde = (u64)pt | 0x7;
	reload_cr3();
	for (ninv = 0; ninv < (int)ARRAY_SIZE(cases); ninv++) {
		struct { u64 pcid, addr; } desc = { cases[ninv][1], cases[ninv][2] };
		volatile u64 *win = (volatile u64 *)WIN;
		u64 next = (ninv & 1) ? (u64)page_a : (u64)page_b;

		inv[ninv].type = cases[ninv][0];
		inv[ninv].pcid = desc.pcid;
		inv[ninv].addr = desc.addr;
		(void)*win;			/* the old page is in the TLB */
		pt[0] = next | 0x7;
		inv[ninv].before = *win;
		arm();
		asm volatile(TRY("invpcid %1, %0") :: "r"(cases[ninv][0]), "m"(desc) : "r11", "memory");
		inv[ninv].after = *win;
		inv[ninv].vec = caught_vec;
		inv[ninv].err = caught_err;
		reload_cr3();
	}
	*pde = saved;
	reload_cr3();
	return 0;
}

static void run_invpcid(void)
{
	page_a[0] = 0xaaaa;
	page_b[0] = 0xbbbb;
	cpl0_call(invpcid_fn, 0);
	for (int i = 0; i < ninv; i++) {
		caught_vec = inv[i].vec;
		caught_err = inv[i].err;
		printf("invpcid type=%lu pcid=%#lx addr=%#lx", inv[i].type, inv[i].pcid, inv[i].addr);
		print_fault();
		printf(" expect=%#lx before=%#lx after=%#lx\n", (i & 1) ? 0xaaaaUL : 0xbbbbUL,
		       inv[i].before, inv[i].after);
	}
}


static u64 reload_cr3_fn(u64 unused)
{
	reload_cr3();
	return 0;
}

/* ---- stale (only when named): a PTE rewritten at CPL3 without invalidation
 * leaves the old translation in use (shadow paging: the leaf table is not
 * write-protected); the guest then waits, reading through the window, until
 * something outside flushes its TLB (a test calls Lucid's flush), or until
 * timeout_ms (10000) passes. */
static void run_stale(void)
{
	u64 *pdpt = (u64 *)(pml4[0] & ~0xfffUL);
	u64 *pde = (u64 *)(pdpt[WIN >> 30] & ~0xfffUL) + ((WIN >> 21) & 511);
	volatile u64 *win = (volatile u64 *)WIN;
	u64 timeout = param_u64("timeout_ms", 10000) * (tsc_khz() ? tsc_khz() : 1000000);
	u64 first, v, t0;

	page_a[0] = 0xaaaa;
	page_b[0] = 0xbbbb;
	pt[0] = (u64)page_a | 0x7;
	*pde = (u64)pt | 0x7;
	cpl0_call(reload_cr3_fn, 0);
	first = *win;
	pt[0] = (u64)page_b | 0x7;
	v = *win;
	printf("stale first=%#lx after_pte_write=%#lx\n", first, v);
	printf("stale: waiting\n");
	t0 = rdtsc();
	while ((v = *win) != 0xbbbb && rdtsc() - t0 < timeout)
		cpu_relax();
	printf("stale: %s value=%#lx\n", v == 0xbbbb ? "seen" : "timeout", v);
	cpl0_call(reload_cr3_fn, 0);
}

/* ---- xmm: an SSE register written by a completion, read back natively at CPL3 ---- */
static u64 xmm_set_fn(u64 v)
{
	u64 cr4;
	asm volatile("mov %%cr4, %0" : "=r"(cr4));
	asm volatile("mov %0, %%cr4" :: "r"(cr4 | CR4_OSFXSR | CR4_OSXMMEXCPT));
	asm volatile("movq %0, %%xmm1" :: "r"(v));
	return 0;
}

static void run_xmm(void)
{
	u64 zero = 0, got, mxcsr = 0;
	for (int i = 0; i < 3; i++) {
		u64 want = 0x1111111111111111UL * (i + 1);
		/* every XMM register zero first: the SSE state in its initial configuration */
		asm volatile("movq %0, %%xmm0; movq %0, %%xmm1; movq %0, %%xmm2; movq %0, %%xmm3;"
			     "movq %0, %%xmm4; movq %0, %%xmm5; movq %0, %%xmm6; movq %0, %%xmm7;"
			     "movq %0, %%xmm8; movq %0, %%xmm9; movq %0, %%xmm10; movq %0, %%xmm11;"
			     "movq %0, %%xmm12; movq %0, %%xmm13; movq %0, %%xmm14; movq %0, %%xmm15"
			     :: "r"(zero));
		for (volatile int k = 0; k < 100000; k++)
			;
		cpl0_call(xmm_set_fn, want);
		asm volatile("movq %%xmm1, %0; stmxcsr %1" : "=r"(got), "=m"(mxcsr));
		printf("xmm round=%d want=%#lx got=%#lx mxcsr=%#lx\n", i, want, got, mxcsr);
	}
}

/* ---- xmm-wait (only when named): xmm1 zeroed at CPL3, then read until it
 * changes; a test writes it from outside through Lucid's FPU path ---- */
static void run_xmm_wait(void)
{
	u64 tsc = tsc_khz() ? tsc_khz() : 1000000;
	u64 timeout = param_u64("timeout_ms", 10000) * tsc, t0, v = 0;

	asm volatile("movq %0, %%xmm1" :: "r"(v));
	printf("xmm: waiting\n");
	t0 = rdtsc();
	do {
		asm volatile("movq %%xmm1, %0" : "=r"(v));
	} while (!v && rdtsc() - t0 < timeout);
	printf("xmm: %s value=%#lx\n", v ? "seen" : "timeout", v);
}

/* ---- int n / int3 through the IDT ---- */
volatile u64 int_frame[5], int_rsp, int_flags, int_count;
extern char int_rec[], gate_cpl0_call[];
asm(".text\n"
    "int_rec:\n"
    "	movq %rsp, int_rsp(%rip)\n"
    "	pushfq\n"
    "	popq int_flags(%rip)\n"
    "	pushq %rax\n"
    "	movq 8(%rsp), %rax\n	movq %rax, int_frame+0(%rip)\n"
    "	movq 16(%rsp), %rax\n	movq %rax, int_frame+8(%rip)\n"
    "	movq 24(%rsp), %rax\n	movq %rax, int_frame+16(%rip)\n"
    "	movq 32(%rsp), %rax\n	movq %rax, int_frame+24(%rip)\n"
    "	movq 40(%rsp), %rax\n	movq %rax, int_frame+32(%rip)\n"
    "	popq %rax\n"
    "	incq int_count(%rip)\n"
    "	iretq\n");

#define IST3_OFF (TSS_OFF + 52)
static u64 ist3_stack[512] __attribute__((aligned(16)));

struct int_case {
	const char *name;
	u64 vec;
	u64 next_rip, rsp, rflags, ss, cs;	/* before */
	u64 frame[5], handler_rsp, handler_flags, count;
	u64 fvec, ferr;
};
static struct int_case ints[8];
static int nints;

/* runs `int $V` (or int3) with the catcher armed; records the state before */
#define INT_CASE(next_case, insn)						\
	do {									\
		struct int_case *c = (next_case);				\
		u64 before = int_count;						\
		arm();								\
		asm volatile("pushfq; popq %[f]; movq %%rsp, %[sp]; "		\
			     "movq %%ss, %[ss]; movq %%cs, %[cs]; "		\
			     "leaq 9f(%%rip), %[ip]; " TRY(insn)			\
			     : [f] "=&r"(c->rflags), [sp] "=&r"(c->rsp),	\
			       [ss] "=&r"(c->ss), [cs] "=&r"(c->cs),	\
			       [ip] "=&r"(c->next_rip)			\
			     :: "r11", "memory", "cc");				\
		for (int _i = 0; _i < 5; _i++)					\
			c->frame[_i] = int_frame[_i];				\
		c->handler_rsp = int_rsp;					\
		c->handler_flags = int_flags;					\
		c->count = int_count - before;				\
		c->fvec = caught_vec;						\
		c->ferr = caught_err;						\
	} while (0)

static struct int_case *int_next(const char *name, u64 vec)
{
	struct int_case *c = &ints[nints++];
	c->name = name;
	c->vec = vec;
	int_frame[0] = int_rsp = int_flags = 0;
	return c;
}

static u64 int_fn(u64 unused)
{
	struct idt_gate saved3 = idt_table[3];
	struct { u16 limit; u64 base; } __attribute__((packed)) idtr, small;

	/* interrupt gate, no stack switch: frame on the current stack, aligned */
	INT_CASE(int_next("int-gate", 0x90), "int $0x90");
	/* IST3: the frame goes on the IST3 stack */
	INT_CASE(int_next("ist", 0x91), "int $0x91");
	/* trap gate with IF=1: the handler runs with IF still set */
	asm volatile("sti");
	INT_CASE(int_next("trap-gate-if1", 0x92), "int $0x92");
	INT_CASE(int_next("int-gate-if1", 0x90), "int $0x90");
	asm volatile("cli");
	/* a gate that is not present: #NP(vector * 8 + 2) */
	INT_CASE(int_next("not-present", 0x93), "int $0x93");
	/* a gate of a type that is not an interrupt or trap gate: #GP(vector * 8 + 2) */
	INT_CASE(int_next("bad-type", 0x94), "int $0x94");
	/* a vector past the IDT limit: #GP(vector * 8 + 2) */
	asm volatile("sidt %0" : "=m"(idtr));
	small = idtr;
	small.limit = 0x95 * 16 - 1;
	asm volatile("lidt %0" :: "m"(small));
	INT_CASE(int_next("past-limit", 0x95), "int $0x95");
	asm volatile("lidt %0" :: "m"(idtr));
	/* int3 at CPL0 goes the same way (vector 3 pointed at the recorder) */
	set_gate(3, int_rec, 0, 0x8e);
	INT_CASE(int_next("int3", 3), "int3");
	idt_table[3] = saved3;
	return 0;
}

static void run_int(void)
{
	u64 *tss_ist3 = (u64 *)(u64)(CPU_AREA + IST3_OFF);

	set_gate(0x90, int_rec, 0, 0x8e);
	set_gate(0x91, int_rec, 3, 0x8e);
	set_gate(0x92, int_rec, 0, 0x8f);
	set_gate(0x93, int_rec, 0, 0x0e);	/* P=0 */
	set_gate(0x94, int_rec, 0, 0x8c);	/* a call gate in a 64-bit IDT */
	set_gate(0x95, int_rec, 0, 0x8e);
	/* an odd top: the CPU aligns it down to 16 bytes */
	*tss_ist3 = (u64)&ist3_stack[512] - 8;
	cpl0_call(int_fn, 0);
	for (int i = 0; i < nints; i++) {
		struct int_case *c = &ints[i];
		caught_vec = c->fvec;
		caught_err = c->ferr;
		printf("int case=%s vector=%#lx", c->name, c->vec);
		print_fault();
		printf(" delivered=%lu next_rip=%#lx rsp=%#lx rflags=%#lx cs=%#lx ss=%#lx "
		       "frame_rip=%#lx frame_cs=%#lx frame_rflags=%#lx frame_rsp=%#lx frame_ss=%#lx "
		       "handler_rsp=%#lx handler_rflags=%#lx ist_top=%#lx\n",
		       c->count, c->next_rip, c->rsp, c->rflags, c->cs, c->ss, c->frame[0],
		       c->frame[1], c->frame[2], c->frame[3], c->frame[4], c->handler_rsp,
		       c->handler_flags, *tss_ist3);
	}
}

int main(void)
{
	set_gate(6, catch_ud, 2, 0x8e);
	set_gate(11, catch_np, 2, 0x8e);
	set_gate(13, catch_gp, 2, 0x8e);
	set_gate(14, catch_pf, 2, 0x8e);
	/* on "pvm" CPL0 code is emulated by KVM: these instructions reach the VMM */
	printf("cpl0-insns backend=%s\n", lucid_backend_name());
	if (wanted("cpuid"))
		run_cpuid();
	if (wanted("shift"))
		run_shift();
	if (wanted("xgetbv"))
		run_xgetbv();
	if (wanted("clwb"))
		run_clwb();
	if (wanted("rdpru"))
		run_rdpru();
	if (wanted("invpcid"))
		run_invpcid();
	if (strcmp(param_str("run", "all"), "all") && wanted("stale"))
		run_stale();
	if (strcmp(param_str("run", "all"), "all") && wanted("xmm-wait"))
		run_xmm_wait();
	if (strcmp(param_str("run", "all"), "all") && wanted("msr"))
		run_msr();
	if (wanted("xmm"))
		run_xmm();
	if (wanted("int"))
		run_int();
	printf("cpl0-insns: done\n");
	return 0;
}
