/*
 * CPL3 start-up: the boot stub iretq's here with the CPU index in rdi.
 * The bootstrap CPU clears BSS, copies the VMM's boot data out of low
 * memory (before anything can overwrite it), fills the IDT and calls
 * main(); application processors go to smp.c.
 */
#include "libcflat.h"
#include "symcall.h"

struct hvm_start_info {
	u32 magic, version, flags, nr_modules;
	u64 modlist_paddr, cmdline_paddr, rsdp_paddr, memmap_paddr;
	u32 memmap_entries, reserved;
};
#define HVM_START_MAGIC 0x336ec578

extern u32 boot_start_info;		/* boot.S (.data) */
extern char __bss_start[], __bss_end[];
extern char isr_stubs[], gate_cpl0_call[];
extern struct idt_gate {
	u16 off0, sel;
	u8 ist, type;
	u16 off1;
	u32 off2, reserved;
} idt_table[256];

#define MAX_MEMMAP 64
#define CMDLINE_MAX 4096
struct memmap_entry boot_memmap[MAX_MEMMAP];
u32 boot_memmap_entries;
u64 boot_rsdp_paddr;
u32 boot_start_info_valid;
char boot_cmdline_buf[CMDLINE_MAX];
volatile struct exc_info exc_info;

void params_init(void);
void ap_entry(u32 idx) __attribute__((noreturn));

void idt_set_gate(int v, void *fn, int ist, int dpl)
{
	u64 a = (u64)fn;
	struct idt_gate *g = &idt_table[v];

	g->off0 = a & 0xffff;
	g->sel = SEL_KCODE64;
	g->ist = ist;
	g->type = 0x8e | (dpl << 5);	/* present 64-bit interrupt gate */
	g->off1 = (a >> 16) & 0xffff;
	g->off2 = a >> 32;
	g->reserved = 0;
}

static void copy_boot_info(void)
{
	const struct hvm_start_info *si = (void *)(u64)boot_start_info;

	if (!si || si->magic != HVM_START_MAGIC)
		return;
	boot_start_info_valid = 1;
	if (si->cmdline_paddr) {
		const char *s = (const char *)si->cmdline_paddr;
		size_t i;
		for (i = 0; i < CMDLINE_MAX - 1 && s[i]; i++)
			boot_cmdline_buf[i] = s[i];
		boot_cmdline_buf[i] = 0;
	}
	boot_rsdp_paddr = si->rsdp_paddr;
	if (si->version >= 1 && si->memmap_paddr) {
		u32 n = si->memmap_entries;
		if (n > MAX_MEMMAP)
			n = MAX_MEMMAP;
		memcpy(boot_memmap, (void *)si->memmap_paddr, n * sizeof(boot_memmap[0]));
		boot_memmap_entries = n;
	}
}

u64 ram_region_end(u64 addr)
{
	for (u32 i = 0; i < boot_memmap_entries; i++) {
		const struct memmap_entry *e = &boot_memmap[i];
		if (e->type == 1 && addr >= e->addr && addr < e->addr + e->size)
			return e->addr + e->size;
	}
	return 0;
}

struct percpu *this_cpu(void)
{
	u64 sp;
	asm volatile("mov %%rsp, %0" : "=r"(sp));
	return (struct percpu *)((sp & ~(u64)(CPU_BLOCK - 1)) + PERCPU_OFF);
}

void percpu_init(u32 idx)
{
	struct percpu *p = this_cpu();

	memset((void *)p->pending, 0, sizeof(p->pending));
	p->irq_count = 0;
	p->cpu_index = idx;
	p->apic_id = 0xffffffff;
}

void cpu_user_entry(u64 idx) __attribute__((noreturn, used));
void cpu_user_entry(u64 idx)
{
	if (idx != 0)
		ap_entry(idx);

	/* allow every port in each CPU's TSS I/O bitmap: PVM's emulated
	 * iretq to CPL3 leaves IOPL=0, so in/out at CPL3 rely on the bitmap */
	for (int c = 0; c < MAX_CPUS; c++) {
		u8 *map = (u8 *)(u64)(CPU_AREA + c * CPU_BLOCK + TSS_OFF + IOMAP_OFF);
		memset(map, 0, 8192);
		map[8192] = 0xff;
	}
	memset(__bss_start, 0, __bss_end - __bss_start);
	copy_boot_info();
	params_init();
	for (int v = 0; v < 256; v++)
		idt_set_gate(v, isr_stubs + 32 * v, v < 32 ? 2 : 1, 0);
	idt_set_gate(VEC_CPL0_CALL, gate_cpl0_call, 1, 3);
	percpu_init(0);
	/* mask LINT0 (ExtINT from the 8259) and LINT1: no stray interrupts,
	 * also on hosts that run CPL3 with IF=1 whatever the iretq frame says */
	lapic_write(0x350, 0x10000);
	lapic_write(0x360, 0x10000);
	exit(main());
}

static const char *exc_name(u64 v)
{
	static const char *const names[32] = {
		"#DE", "#DB", "NMI", "#BP", "#OF", "#BR", "#UD", "#NM",
		"#DF", "?", "#TS", "#NP", "#SS", "#GP", "#PF", "?",
		"#MF", "#AC", "#MC", "#XM", "#VE", "#CP",
	};
	return v < 32 && names[v] ? names[v] : "?";
}

/* reached from the CPL0 exception stub at CPL3 on exc_stack */
void exception_report(void) __attribute__((noreturn, used));
void exception_report(void)
{
	extern volatile int print_lock;
	static int nested;
	symcall_exception();		/* a SymCall handler's fault ends the call */
	if (nested++)			/* faulted while reporting: just exit */
		outl(LUCID_EXIT_PORT, EXIT_EXCEPTION);
	print_lock = 0;			/* the faulting code may have held it */
	printf("EXCEPTION %s vector=%lu error=%#lx rip=%#lx cs=%#lx rflags=%#lx rsp=%#lx cr2=%#lx\n",
	       exc_name(exc_info.vector), exc_info.vector, exc_info.error, exc_info.rip,
	       exc_info.cs, exc_info.rflags, exc_info.rsp, exc_info.cr2);
	exit(EXIT_EXCEPTION);
}

static u64 park_fn(u64 arg)
{
	(void)arg;
	cpu_park();
	return 0;
}

void exit(int code)
{
	outl(LUCID_EXIT_PORT, (u32)code);
	/* no exit device: stop this CPU (hlt at CPL0) */
	cpl0_call(park_fn, 0);
	for (;;)
		cpu_relax();
}

u64 cpl0_call(u64 (*fn)(u64), u64 arg)
{
	u64 ret;
	asm volatile("int3"
		     : "=a"(ret), "+D"(arg)
		     : "a"(fn)
		     : "rcx", "rdx", "rsi", "r8", "r9", "r10", "r11", "memory", "cc");
	return ret;
}
