/*
 * sym-call: the SymCall test guest (docs/symbiotic.md §5).
 * Discovers Lucid's symbiotic interfaces, registers the global page and one
 * page per CPU (on that CPU), publishes the SymCall entry and each CPU's
 * stack, registers the misbehaving test handlers (TEST_LOOP spins forever,
 * TEST_FAULT reads an unmapped address, TEST_SMASH overwrites its return
 * address and returns through it) and TEST_DONE (ends the workload early),
 * then runs a workload at CPL3 on every CPU for ms=N (10000) milliseconds:
 * a loop that keeps rbx, rbp, r12-r15 holding a pattern and checks them on
 * every iteration, plus a checksum over a buffer, optionally with a PIO
 * exit every exits_every=K iterations, so SymCalls land both in the middle
 * of guest compute and right after an exit. Any difference: "corrupt" and
 * exit 1. Parameters: cpus=1|2 (1), ms, exits_every (0), register=0 (run
 * without registering SymCall: every call must be refused), selfcall=N
 * (hypercall N once before the workload, for a test hook), stray=1 (an
 * HC_RETURN outside any call first).
 * Prints "sym-call ready cpus=N" once the calls may start and at the end
 * "sym-call done checks=N corrupt=0 symcalls_seen=M faults_seen=F".
 */
#include "libcflat.h"
#include "symcall.h"

/* this guest's own calls */
#define SYMCALL_TEST_DONE  0x1f0	/* ends the workload */
#define SYMCALL_TEST_EXITS 0x1f1	/* PIO exits forever (the exit bound) */
#define SYMCALL_TEST_HC    0x1f2	/* value 0 = hypercall arg0's result (a hook
					 * the test installs, which calls back) */
#define SYMCALL_TEST_TOUCH 0x1f3	/* the workload writes arg0 MiB of RAM from
					 * 32 MiB on, then bumps its page's counter */

static struct sym_global global;
static struct sym_vcpu vpages[2];
static volatile u64 counters[4];	/* READ_COUNTER: checks cpu0, cpu1, rounds, 0x5eed */
static volatile int done_flag;
static volatile u64 touch_mib;
static volatile u64 corrupt_total;
static volatile u32 ap_state;		/* 1 registered, 2 finished */
static u64 run_ms, exits_every;
static int do_register = 1;

#define BUF_WORDS 4096
static u64 buf[2][BUF_WORDS];

static u64 test_loop(const u64 a[5], u64 out[2])
{
	for (;;)
		asm volatile("pause" ::: "memory");
	return SYM_OK;
}

static u64 test_fault(const u64 a[5], u64 out[2])
{
	/* beyond the kit's identity map of 0-4 GiB: #PF */
	out[0] = *(volatile u64 *)0x100000000000ULL;
	return SYM_OK;
}

static u64 __attribute__((noinline)) test_smash(const u64 a[5], u64 out[2])
{
	volatile u64 *frame = __builtin_frame_address(0);
	/* return address and the caller's frame: a non-canonical address,
	 * so the ret raises #GP */
	for (int i = 0; i < 8; i++)
		frame[i] = 0xdead00000000dea0ULL + i;
	return SYM_OK;
}

static u64 test_exits(const u64 a[5], u64 out[2])
{
	for (;;)
		outb(LUCID_NOP_PORT, 0);
	return SYM_OK;
}

static u64 test_hc(const u64 a[5], u64 out[2])
{
	out[0] = lucid_hypercall(a[0], 0, 0, 0);
	return SYM_OK;
}

static u64 test_touch(const u64 a[5], u64 out[2])
{
	touch_mib = a[0];
	return SYM_OK;
}

/* Writes touch_mib MiB from 32 MiB on (what RAM there is), one word per
 * 4 KiB page, then publishes the count of touches in the vCPU page's
 * counter (Lucid reads it without a call, so the next call is cold). */
static void touch_memory(void)
{
	u64 start = 32ULL << 20, end = ram_region_end(start), n = touch_mib << 20;
	if (end && start + n > end)
		n = end - start;
	for (u64 a = start; end && a < start + n; a += 4096)
		*(volatile u64 *)a = a;
	touch_mib = 0;
	sym_seq_begin(&vpages[0].seq);
	vpages[0].counter++;
	sym_seq_end(&vpages[0].seq);
}

static u64 test_done(const u64 a[5], u64 out[2])
{
	done_flag = 1;
	return SYM_OK;
}

/*
 * One round: loads the pattern derived from seed into rbx, rbp, r12-r15
 * and checks it n times; an `out` to the no-op port every `every`
 * iterations (0: never). Returns the number of iterations that saw a
 * difference.
 */
static u64 check_regs(u64 seed, u64 n, u64 every)
{
	u64 bad = 0;
	asm volatile(
		"push %%rbp\n\t"
		"mov %[seed], %%rbx\n\t"
		"lea 1(%%rbx), %%r12\n\t"
		"mov %%rbx, %%r13\n\t"
		"not %%r13\n\t"
		"lea (%%rbx,%%rbx,2), %%r14\n\t"
		"mov %%rbx, %%r15\n\t"
		"rol $17, %%r15\n\t"
		"mov %%rbx, %%rbp\n\t"
		"xor $0x5a5a5a5a, %%rbp\n\t"
		"mov %[every], %%r11\n\t"
		"1:\n\t"
		"cmp %[seed], %%rbx\n\t"
		"jne 2f\n\t"
		"lea 1(%%rbx), %%rax\n\t"
		"cmp %%rax, %%r12\n\t"
		"jne 2f\n\t"
		"mov %%rbx, %%rax\n\t"
		"not %%rax\n\t"
		"cmp %%rax, %%r13\n\t"
		"jne 2f\n\t"
		"lea (%%rbx,%%rbx,2), %%rax\n\t"
		"cmp %%rax, %%r14\n\t"
		"jne 2f\n\t"
		"mov %%rbx, %%rax\n\t"
		"rol $17, %%rax\n\t"
		"cmp %%rax, %%r15\n\t"
		"jne 2f\n\t"
		"mov %%rbx, %%rax\n\t"
		"xor $0x5a5a5a5a, %%rax\n\t"
		"cmp %%rax, %%rbp\n\t"
		"jne 2f\n\t"
		"jmp 3f\n\t"
		"2:\n\t"
		"inc %[bad]\n\t"
		"3:\n\t"
		"test %[every], %[every]\n\t"
		"jz 4f\n\t"
		"dec %%r11\n\t"
		"jnz 4f\n\t"
		"mov %[every], %%r11\n\t"
		"outb %%al, $0x80\n\t"
		"4:\n\t"
		"dec %[n]\n\t"
		"jnz 1b\n\t"
		"pop %%rbp\n\t"
		: [bad] "+r"(bad), [n] "+r"(n)
		: [seed] "r"(seed), [every] "r"(every)
		: "rax", "rbx", "r11", "r12", "r13", "r14", "r15", "cc", "memory");
	return bad;
}

static u64 fill(u64 *b, u64 seed)
{
	u64 sum = 0;
	for (int i = 0; i < BUF_WORDS; i++) {
		b[i] = seed * 0x9e3779b97f4a7c15ULL + i;
		sum += b[i] ^ (b[i] >> 7);
	}
	return sum;
}

static u64 checksum(const u64 *b)
{
	u64 sum = 0;
	for (int i = 0; i < BUF_WORDS; i++)
		sum += b[i] ^ (b[i] >> 7);
	return sum;
}

/* The workload on CPU `cpu` until done or ms elapsed; returns the checks made. */
static u64 workload(u32 cpu)
{
	u64 k = tsc_khz() ? tsc_khz() : 2000000;
	u64 end = rdtsc() + run_ms * k;
	u64 checks = 0, round = 0;

	while (!done_flag && rdtsc() < end && !corrupt_total) {
		u64 seed = (round++ << 8) ^ (0x1234567ULL * (cpu + 1));
		u64 sum = fill(buf[cpu], seed);
		u64 bad = check_regs(seed, 20000, exits_every);
		if (bad || checksum(buf[cpu]) != sum) {
			printf("corrupt cpu=%u round=%lu bad_iterations=%lu\n", cpu, round, bad);
			__atomic_fetch_add(&corrupt_total, 1, __ATOMIC_SEQ_CST);
			break;
		}
		checks += 20000;
		if (cpu == 0 && touch_mib)
			touch_memory();
		counters[cpu] = checks;
		counters[2] = round;
	}
	return checks;
}

static int setup_cpu(u32 cpu)
{
	long r = sym_register_vcpu(&vpages[cpu], cpu);
	if (r) {
		printf("sym-call: cpu %u page refused (%ld)\n", cpu, r);
		return -1;
	}
	if (do_register)
		symcall_attach_cpu(&vpages[cpu], cpu);
	return 0;
}

static u64 ap_checks;

static void ap_main(u32 idx)
{
	if (idx != 1 || setup_cpu(1)) {
		ap_state = 3;
		return;
	}
	ap_state = 1;
	ap_checks = workload(1);
	ap_state = 2;
	for (;;)		/* stay at CPL3: calls to this vCPU keep landing there */
		cpu_relax();
}

int main(void)
{
	u32 cpus = param_u64("cpus", 1);
	run_ms = param_u64("ms", 10000);
	exits_every = param_u64("exits_every", 0);
	do_register = param_u64("register", 1) != 0;
	if (cpus < 1 || cpus > 2) {
		printf("sym-call: cpus must be 1 or 2\n");
		return 2;
	}
	u32 f = sym_discover();
	if (!f) {
		printf("sym: not offered\n");
		return 2;
	}
	if (!(f & SYM_FEAT_SYMCALL)) {
		printf("sym-call: SymCall not offered (features %#x)\n", f);
		return 2;
	}
	long r = sym_register_global(&global);
	if (r) {
		printf("sym-call: global page refused (%ld)\n", r);
		return 2;
	}
	if (setup_cpu(0))
		return 2;
	counters[3] = 0x5eed;
	symcall_set_counters(counters, 4);
	symcall_register(SYMCALL_TEST_LOOP, test_loop);
	symcall_register(SYMCALL_TEST_FAULT, test_fault);
	symcall_register(SYMCALL_TEST_SMASH, test_smash);
	symcall_register(SYMCALL_TEST_DONE, test_done);
	symcall_register(SYMCALL_TEST_EXITS, test_exits);
	symcall_register(SYMCALL_TEST_HC, test_hc);
	symcall_register(SYMCALL_TEST_TOUCH, test_touch);
	if (do_register)
		symcall_init(&global);
	tsc_khz();
	if (cpus == 2) {
		u32 ids[MAX_CPUS];
		int n = acpi_madt_cpus(ids, MAX_CPUS);
		if (n < 2) {
			printf("sym-call: cpus=2 but the MADT lists %d\n", n);
			return 2;
		}
		smp_bringup(ids, 2, ap_main, 1);
		u64 k = tsc_khz() ? tsc_khz() : 2000000, t0 = rdtsc();
		while (ap_state == 0 && rdtsc() - t0 < 5000 * k)
			cpu_relax();
		if (ap_state != 1 && ap_state != 2) {
			printf("sym-call: cpu 1 did not come up\n");
			return 2;
		}
	}
	/* selfcall=N: hypercall N once, before the workload (a test's hook calls
	 * back into this vCPU from its own thread and reports what it got) */
	if (param_present("selfcall"))
		printf("sym-call selfcall=%lu\n",
		       lucid_hypercall(param_u64("selfcall", 0), 0, 0, 0));
	/* stray=1: an HC_RETURN outside any call (Lucid refuses it: -EINVAL) */
	if (param_u64("stray", 0))
		printf("sym-call stray=%ld\n",
		       (long)lucid_hypercall(SYM_HC_RETURN, SYM_OK, 0, 0));
	printf("sym-call ready cpus=%u registered=%d\n", cpus, do_register);
	u64 checks = workload(0);
	if (cpus == 2) {
		done_flag = 1;
		while (ap_state != 2)
			cpu_relax();
		checks += ap_checks;
	}
	printf("sym-call done checks=%lu corrupt=%lu symcalls_seen=%lu faults_seen=%lu\n", checks,
	       corrupt_total, symcall_count, symcall_faults);
	return corrupt_total ? 1 : 0;
}
