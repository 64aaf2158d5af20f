#include "libcflat.h"
#include "symcall.h"

#define SYMCALL_STACK 8192
#define SYMCALL_MAX_HANDLERS 16

static u8 symcall_stacks[MAX_CPUS][SYMCALL_STACK] __attribute__((aligned(64)));
static struct sym_vcpu *symcall_vcpu[MAX_CPUS];
/* CPU c runs a handler (the exception path's test: v->in_symcall needs a page) */
static volatile u8 symcall_active[MAX_CPUS];
static struct {
	u64 nr;
	symcall_fn fn;
} handlers[SYMCALL_MAX_HANDLERS];
static volatile u64 *counters;
static u32 ncounters;
volatile u64 symcall_count;
volatile u64 symcall_faults;

void symcall_entry(void);
void symcall_dispatch(u64 nr, u64 a0, u64 a1, u64 a2, u64 a3, u64 a4)
	__attribute__((noreturn, used));

/* rax, rdi, rsi, rdx, r10, r8 -> the C arguments (r8 moves before it is
 * overwritten); the stack Lucid loaded is this CPU's SymCall stack. */
asm(".pushsection .text\n"
    ".globl symcall_entry\n"
    "symcall_entry:\n"
    "	mov %r8, %r9\n"
    "	mov %r10, %r8\n"
    "	mov %rdx, %rcx\n"
    "	mov %rsi, %rdx\n"
    "	mov %rdi, %rsi\n"
    "	mov %rax, %rdi\n"
    "	and $-16, %rsp\n"
    "	call symcall_dispatch\n"
    "	ud2\n"
    ".popsection\n");

static u64 echo(const u64 a[5], u64 out[2])
{
	out[0] = a[0] + a[1] + a[2] + a[3] + a[4];
	out[1] = a[0];
	return SYM_OK;
}

static u64 read_counter(const u64 a[5], u64 out[2])
{
	if (!counters || a[0] >= ncounters)
		return SYM_EINVAL;
	out[0] = counters[a[0]];
	return SYM_OK;
}

void symcall_dispatch(u64 nr, u64 a0, u64 a1, u64 a2, u64 a3, u64 a4)
{
	u64 sp = (u64)__builtin_frame_address(0);
	u64 cpu = (sp - (u64)symcall_stacks) / SYMCALL_STACK;
	struct sym_vcpu *v = cpu < MAX_CPUS ? symcall_vcpu[cpu] : 0;
	const u64 args[5] = { a0, a1, a2, a3, a4 };
	u64 out[2] = { 0, 0 };
	u64 status = SYM_ENOSYS;

	if (cpu < MAX_CPUS)
		symcall_active[cpu] = 1;
	if (v)
		v->in_symcall = 1;
	for (int i = 0; i < SYMCALL_MAX_HANDLERS; i++) {
		if (handlers[i].fn && handlers[i].nr == nr) {
			status = handlers[i].fn(args, out);
			break;
		}
	}
	if (v)
		v->in_symcall = 0;
	if (cpu < MAX_CPUS)
		symcall_active[cpu] = 0;
	__atomic_fetch_add(&symcall_count, 1, __ATOMIC_RELAXED);
	lucid_hypercall(SYM_HC_RETURN, status, out[0], out[1]);
	for (;;)		/* Lucid restored the interrupted context */
		cpu_relax();
}

int symcall_register(u64 nr, symcall_fn fn)
{
	int free = -1;
	for (int i = 0; i < SYMCALL_MAX_HANDLERS; i++) {
		if (handlers[i].fn && handlers[i].nr == nr) {
			handlers[i].fn = fn;
			return 1;
		}
		if (!handlers[i].fn && free < 0)
			free = i;
	}
	if (free < 0)
		return 0;
	handlers[free].nr = nr;
	handlers[free].fn = fn;
	return 1;
}

void symcall_set_counters(volatile u64 *c, u32 n)
{
	counters = c;
	ncounters = n;
}

void symcall_init(struct sym_global *g)
{
	symcall_register(SYMCALL_ECHO, echo);
	symcall_register(SYMCALL_READ_COUNTER, read_counter);
	sym_seq_begin(&g->seq);
	g->symcall_entry = (u64)symcall_entry;
	g->symcall_cs = SEL_UCODE | 3;
	g->symcall_ss = SEL_UDATA | 3;
	g->symcall_flags = USER_RFLAGS;
	sym_seq_end(&g->seq);
	g->h.generation++;
}

void symcall_attach_cpu(struct sym_vcpu *v, u32 cpu)
{
	if (cpu >= MAX_CPUS)
		return;
	symcall_vcpu[cpu] = v;
	sym_seq_begin(&v->seq);
	v->symcall_stack = (u64)&symcall_stacks[cpu][SYMCALL_STACK];
	sym_seq_end(&v->seq);
}

/*
 * The exception path (setup.c exception_report, at CPL3 on the exception
 * stack): a fault whose stack pointer lies in a CPU's SymCall stack while
 * that CPU runs a handler ends the call with SYM_EFAULT (value 0 = vector,
 * value 1 = faulting rip) instead of the guest; Lucid then restores the
 * interrupted context. A handler that left its stack altogether (rsp
 * elsewhere) is not recognised: the guest reports the exception and exits.
 * exc_info and the exception stack are shared: two CPUs faulting at once
 * would mix their records (the kit's exception path is single-CPU).
 */
void symcall_exception(void)
{
	u64 rsp = exc_info.rsp, base = (u64)symcall_stacks;

	if (rsp <= base || rsp > base + sizeof(symcall_stacks))
		return;
	u64 cpu = (rsp - 1 - base) / SYMCALL_STACK;
	if (!symcall_active[cpu])
		return;
	symcall_active[cpu] = 0;
	if (symcall_vcpu[cpu])
		symcall_vcpu[cpu]->in_symcall = 0;
	__atomic_fetch_add(&symcall_faults, 1, __ATOMIC_RELAXED);
	lucid_hypercall(SYM_HC_RETURN, SYM_EFAULT, exc_info.vector, exc_info.rip);
	for (;;)		/* Lucid restored the interrupted context */
		cpu_relax();
}
