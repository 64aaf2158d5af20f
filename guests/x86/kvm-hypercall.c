/*
 * kvm-hypercall: one KVM hypercall made at CPL0 the way Linux's kvm_hypercall2() makes it
 * (rax = number, rbx/rcx = arguments, `vmcall` or `vmmcall`), to see where the host sends it:
 * KVM answers it in the kernel (rax = result, -1000 = -KVM_ENOSYS), or the VMM gets an exit.
 * Prints the instruction's bytes before and after (KVM's emulator may rewrite them) and rax.
 * A #UD at the call site (a KVM that refuses the instruction) is caught, the instruction
 * skipped, and reported as `ud=1`.
 * With a second vCPU, that one watches the call site from CPL3 and ends the run (exit code 3)
 * when the call has not returned within watch_ms, printing the bytes it sees there.
 * Params: insn (vmmcall|vmcall; vmmcall), nr (9 = KVM_HC_CLOCK_PAIRING), watch_ms (2000).
 */
#include "libcflat.h"

/* The two call sites, so their bytes can be read back; and a #UD handler that notes the
 * fault and resumes after the 3-byte instruction. */
extern u8 hc_vmcall[], hc_vmmcall[], ud_handler[];
static volatile u64 ud_seen, ud_cs;
asm(".pushsection .text\n"
    "hc_vmcall: vmcall\n ret\n"
    "hc_vmmcall: vmmcall\n ret\n"
    "ud_handler: movq $1, ud_seen(%rip)\n pushq %rax\n movq 16(%rsp), %rax\n"
    " movq %rax, ud_cs(%rip)\n popq %rax\n addq $3, (%rsp)\n iretq\n"
    ".popsection\n");

static void catch_ud(void)
{
	idt_set_gate(6, ud_handler, 2, 0);
}

static u64 nr_arg;
static volatile int returned;
static const u8 *watched;
static u64 watch_ms;

/* On the second vCPU: the caller may never come back (a host that spins on the instruction). */
static void watch(u32 idx)
{
	for (u64 ms = 0; ms < watch_ms && !returned; ms++)
		udelay(1000);
	if (returned)
		return;
	printf("kvm-hypercall: no return after %lu ms; bytes at the call site now: %02x %02x %02x\n",
	       watch_ms, watched[0], watched[1], watched[2]);
	exit(3);
}

static u64 call_vmcall(u64 gpa)
{
	u64 rax = nr_arg;
	asm volatile("call hc_vmcall" : "+a"(rax) : "b"(gpa), "c"(0) : "memory");
	return rax;
}

static u64 call_vmmcall(u64 gpa)
{
	u64 rax = nr_arg;
	asm volatile("call hc_vmmcall" : "+a"(rax) : "b"(gpa), "c"(0) : "memory");
	return rax;
}

static void show(const char *when, const u8 *p)
{
	printf("kvm-hypercall: bytes %s: %02x %02x %02x\n", when, p[0], p[1], p[2]);
}

/* struct kvm_clock_pairing: sec, nsec, tsc, flags, pad[9] */
static u64 clock_pairing[16] __attribute__((aligned(64)));

int main(void)
{
	const char *insn = param_str("insn", "vmmcall");
	int vmm = strcmp(insn, "vmcall") != 0;
	u8 *site = vmm ? hc_vmmcall : hc_vmcall;
	nr_arg = param_u64("nr", 9);

	printf("kvm-hypercall: %s nr=%lu at cpl0\n", vmm ? "vmmcall" : "vmcall", nr_arg);
	show("before", site);
	catch_ud();
	watched = site;
	watch_ms = param_u64("watch_ms", 2000);
	u32 ids[MAX_CPUS];
	int n = acpi_madt_cpus(ids, MAX_CPUS);
	if (n >= 2) {
		/* ids[0] is the BSP; start only the first AP as the watcher. */
		smp_bringup(ids, 2, watch, 1000);
	}
	u64 rax = cpl0_call(vmm ? call_vmmcall : call_vmcall, (u64)clock_pairing);
	returned = 1;
	show("after", site);
	printf("kvm-hypercall: ud=%lu rax=%ld\n", ud_seen, (long)rax);
	if (ud_seen)
		printf("kvm-hypercall: #UD frame cs=%#lx (rpl %lu)\n", ud_cs, ud_cs & 3);
	return 0;
}
