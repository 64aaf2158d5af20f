#include "libcflat.h"
#include "sym.h"

_Static_assert(__builtin_offsetof(struct sym_global, seq) == 0x40, "G_SEQ");
_Static_assert(__builtin_offsetof(struct sym_global, swap_device) == 0x74, "G_SWAP_DEVICE");
_Static_assert(__builtin_offsetof(struct sym_global, l_seq) == 0x80, "L_SEQ");
_Static_assert(__builtin_offsetof(struct sym_global, publishes) == 0xa8, "L_PUBLISHES");
_Static_assert(__builtin_offsetof(struct sym_global, mailbox) == 0x100, "MAILBOX");
_Static_assert(__builtin_offsetof(struct sym_global, mailbox_reply) == 0x200, "MAILBOX_REPLY");
_Static_assert(sizeof(struct sym_global) == 4096, "global page");
_Static_assert(__builtin_offsetof(struct sym_vcpu, seq) == 0x40, "V_SEQ");
_Static_assert(__builtin_offsetof(struct sym_vcpu, in_symcall) == 0x60, "V_IN_SYMCALL");
_Static_assert(__builtin_offsetof(struct sym_vcpu, w_seq) == 0x80, "W_SEQ");
_Static_assert(__builtin_offsetof(struct sym_vcpu, publishes) == 0x98, "W_PUBLISHES");
_Static_assert(sizeof(struct sym_vcpu) == 4096, "vcpu page");
/* module mailbox: offsets from the page start (abi::module) */
#define MB_REQ(f) (0x100 + __builtin_offsetof(struct sym_mod_request, f))
#define MB_REP(f) (0x200 + __builtin_offsetof(struct sym_mod_reply, f))
_Static_assert(MB_REQ(op) == 0x104 && MB_REQ(id) == 0x10c && MB_REQ(size) == 0x110, "R_*");
_Static_assert(MB_REQ(ro_gpa) == 0x118 && MB_REQ(ro_size) == 0x120, "R_RO_*");
_Static_assert(MB_REQ(name) == 0x128 && MB_REQ(arg) == 0x148, "R_NAME, R_ARG");
_Static_assert(sizeof(struct sym_mod_request) <= 0x100, "request");
_Static_assert(MB_REP(status) == 0x204 && MB_REP(stage) == 0x20c, "P_STATUS, P_STAGE");
_Static_assert(MB_REP(base) == 0x210 && MB_REP(init) == 0x220, "P_BASE, P_INIT");
_Static_assert(MB_REP(staged) == 0x228 && MB_REP(staged_size) == 0x230, "P_STAGED*");
_Static_assert(MB_REP(message) == 0x240 && MB_REP(magic) == 0x2c0, "P_MESSAGE, A_MAGIC");
_Static_assert(MB_REP(arena) == 0x2c8 && MB_REP(object) == 0x2d8, "A_ARENA, A_OBJECT");
_Static_assert(MB_REP(arena_used) == 0x2e8 && MB_REP(polls) == 0x2f0, "A_ARENA_USED, A_POLLS");
_Static_assert(sizeof(struct sym_mod_reply) == 0x100, "reply");
_Static_assert(sizeof(struct sym_export) == 32, "EXPORT_ENTRY");

u32 sym_discover(void)
{
	if (!lucid_present())
		return 0;
	if (lucid_hypercall(SYM_HC_DISCOVER, SYM_DISCOVER_SIGNATURE, 0, 0) != SYM_SIGNATURE)
		return 0;
	if (lucid_hypercall(SYM_HC_DISCOVER, SYM_DISCOVER_VERSION, 0, 0) != SYM_VERSION)
		return 0;
	return (u32)lucid_hypercall(SYM_HC_DISCOVER, SYM_DISCOVER_FEATURES, 0, 0);
}

static void cpuid4(u32 leaf, u32 r[4])
{
	asm volatile("cpuid" : "=a"(r[0]), "=b"(r[1]), "=c"(r[2]), "=d"(r[3]) : "a"(leaf), "c"(0));
}

u32 sym_discover_cpuid(void)
{
	u32 r[4];
	cpuid4(1, r);
	if (!(r[2] & (1u << 31)))	/* no hypervisor bit: bare metal */
		return 0;
	cpuid4(0x40000100, r);
	/* "LucidSymbiot" in ebx, ecx, edx */
	if (r[1] != 0x6963754c || r[2] != 0x6d795364 || r[3] != 0x746f6962 ||
	    r[0] < 0x40000101)
		return 0;
	cpuid4(0x40000101, r);
	return r[0] == SYM_VERSION ? r[1] : 0;
}

static void sym_fill_header(struct sym_header *h, u16 kind, u32 vcpu)
{
	h->magic = SYM_PAGE_MAGIC;
	h->version = SYM_VERSION;
	h->kind = kind;
	h->vcpu = vcpu;
	asm volatile("" ::: "memory");
}

long sym_register_global(struct sym_global *g)
{
	sym_fill_header(&g->h, SYM_REGISTER_GLOBAL, 0);
	return (long)lucid_hypercall(SYM_HC_REGISTER, SYM_REGISTER_GLOBAL, (u64)g, 0);
}

long sym_register_vcpu(struct sym_vcpu *v, u32 cpu)
{
	sym_fill_header(&v->h, SYM_REGISTER_VCPU, cpu);
	return (long)lucid_hypercall(SYM_HC_REGISTER, SYM_REGISTER_VCPU, (u64)v, 0);
}
