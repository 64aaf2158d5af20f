/*
 * The probe-guest library: everything a guest's main() may call.
 * main() runs at CPL3 with IOPL=3 (in/out allowed), interrupts off, on
 * the bootstrap CPU's 48 KiB stack; its return value is the exit code.
 */
#ifndef LUCID_LIBCFLAT_H
#define LUCID_LIBCFLAT_H

#include "types.h"
#include "io.h"
#include "lucid.h"
#include "layout.h"

int main(void);

/* ---- console (COM1) ---- */
int printf(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
int snprintf(char *buf, size_t size, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
int vsnprintf(char *buf, size_t size, const char *fmt, va_list ap);
void puts(const char *s);			/* no newline added */
void serial_reset(void);			/* 8N1, DLAB=0, no loopback */

/* ---- exit: 32-bit write to port 0xf4; status (code << 1) | 1 ---- */
void exit(int code) __attribute__((noreturn));

/* ---- string ---- */
void *memset(void *d, int c, size_t n);
void *memcpy(void *d, const void *s, size_t n);
void *memmove(void *d, const void *s, size_t n);
int memcmp(const void *a, const void *b, size_t n);
size_t strlen(const char *s);
int strcmp(const char *a, const char *b);
int strncmp(const char *a, const char *b, size_t n);

/* ---- kernel command line: "key=value key2=value2 flag" ---- */
const char *boot_cmdline(void);
/* value of key, or def when absent; decimal or 0x-hex, optional k/m/g (x1024^n) */
u64 param_u64(const char *key, u64 def);
const char *param_str(const char *key, const char *def);
int param_present(const char *key);
/* whether the comma-separated list (a parameter's value, e.g. "a,b,c") names name */
int list_has(const char *list, const char *name);

/* ---- boot information (copied from hvm_start_info at start) ---- */
struct memmap_entry {
	u64 addr, size;
	u32 type, reserved;		/* type 1 = usable RAM */
};
extern struct memmap_entry boot_memmap[];
extern u32 boot_memmap_entries;
extern u64 boot_rsdp_paddr;		/* 0 if the VMM gave none */
extern u32 boot_start_info_valid;
/* end of the usable RAM region containing addr, or 0 if not RAM */
u64 ram_region_end(u64 addr);

/* ---- time ---- */
static inline u64 rdtsc(void)
{
	u32 lo, hi;
	asm volatile("rdtsc" : "=a"(lo), "=d"(hi) :: "memory");
	return ((u64)hi << 32) | lo;
}
u64 tsc_khz(void);			/* 0 if unknown; cached */
const char *tsc_khz_source(void);	/* "lucid", "pit", "param" or "none" */
u64 tsc_to_ns(u64 ticks);		/* 0 if TSC frequency unknown */
void udelay(u64 us);			/* busy wait (needs tsc_khz) */
/* print v/1000 as a decimal with 3 digits after the point, into buf */
const char *fmt_milli(char *buf, u64 v_milli);

/* ---- test patterns ---- */
/* a 64-bit finalizer (splitmix-style): the block guests' data-pattern hash */
static inline u64 mix64(u64 x)
{
	x ^= x >> 31;
	x *= 0x7fb5d329728ea185ull;
	x ^= x >> 27;
	x *= 0x81dadef4bc2dd44dull;
	x ^= x >> 33;
	return x;
}

/* xorshift64: the next value of *state (never 0 if it starts non-zero) */
static inline u64 xorshift64(u64 *state)
{
	u64 x = *state;
	x ^= x << 13;
	x ^= x >> 7;
	x ^= x << 17;
	return *state = x;
}

/* ---- CPL0 gates ---- */
/* run fn(arg) at CPL0 (interrupts off) and return its result; keep fn tiny.
 * Implemented with int3 (vector 3 is the gate, not a debug trap). */
u64 cpl0_call(u64 (*fn)(u64), u64 arg);
/* point IDT vector v at fn (64-bit interrupt gate, CPL0 code, IST ist, callable from CPL dpl);
 * exceptions use IST 2. fn runs at CPL0 and must end with iretq. */
void idt_set_gate(int v, void *fn, int ist, int dpl);
void cpu_park(void);			/* CPL0 only: cli; hlt forever */

/* ---- interrupts ----
 * The IDT stubs run at CPL0 for a few instructions: they set the vector's
 * bit in this CPU's pending bitmap, bump irq_count, write the LAPIC EOI
 * (vectors 0x20-0xfe) and iretq. CPL3 code polls and consumes.
 * irq_enable()/irq_disable() run a CPL0 gate function that sets/clears
 * rflags.IF in the gate's iretq frame (cli/sti/popf at CPL3 are not used).
 * Note: PVM's emulated iretq to CPL3 forces IF=1 (and IOPL=0) whatever
 * the frame says, so under PVM CPL3 code always runs interruptible; the
 * library masks LAPIC LINT0/LINT1 at start so nothing arrives unasked. */
struct percpu {
	volatile u8 pending[32];	/* PCPU_PENDING */
	volatile u64 irq_count;		/* PCPU_COUNT */
	u32 cpu_index;
	u32 apic_id;
};
struct percpu *this_cpu(void);
void irq_enable(void);
void irq_disable(void);
int irq_pending(void);			/* lowest pending vector or -1; not consumed */
int irq_take(void);			/* consume lowest pending vector or -1 */
int irq_wait(u64 timeout_tsc);		/* spin at CPL3; vector or -1 (0 = forever) */

/* exception record filled by the CPL0 exception stub */
struct exc_info {
	u64 vector, error, rip, cs, rflags, rsp, ss, cr2;
};
extern volatile struct exc_info exc_info;

/* ---- LAPIC (xAPIC MMIO at 0xfee00000, reachable from CPL3) ---- */
u32 lapic_read(u32 reg);
void lapic_write(u32 reg, u32 v);
u32 lapic_id(void);

/* ---- ACPI ---- */
u64 acpi_find_rsdp(void);		/* 0 if none */
/* fill apic_ids with enabled CPUs from the MADT; -1 no RSDP, -2 no MADT */
int acpi_madt_cpus(u32 *apic_ids, int max);
/* the table with this 4-byte signature (header first), NULL if none */
const void *acpi_find_table(const char *sig);

/* ---- SMP ---- */
extern volatile u32 smp_cpus_up;	/* CPUs that reported in, BSP included */
/* start the given APs (INIT-SIPI-SIPI); each runs ap_fn(index) at CPL3
 * and then parks. Returns the number of CPUs up (BSP included). */
int smp_bringup(const u32 *apic_ids, int n, void (*ap_fn)(u32 idx), u64 timeout_ms);

#endif
