/*
 * Guest-physical layout and descriptor constants shared by boot.S, the
 * linker script (by value, see flat.lds) and the C library.
 */
#ifndef LUCID_GUEST_LAYOUT_H
#define LUCID_GUEST_LAYOUT_H

#define LOAD_ADDR        0x100000     /* image link/load address (1 MiB) */

/*
 * Per-CPU area: MAX_CPUS blocks of CPU_BLOCK bytes at CPU_AREA (outside
 * the ELF image; the stub never relies on it being zero). Block layout:
 *   0x0000-0x2000  IST1 stack: interrupts and the CPL3->CPL0 gates
 *   0x2000         struct percpu (user-visible; sits at the IST1 top)
 *   0x2100         64-bit TSS, followed by its I/O permission bitmap
 *                  (8 KiB of zeros + 0xff: every port allowed at CPL3)
 *   0x4200-0x5000  IST2 stack: exceptions
 *   0x5000-0x10000 CPL3 stack of this CPU (44 KiB)
 * CPL3 code finds its percpu struct from its stack pointer:
 *   (rsp & ~(CPU_BLOCK-1)) + PERCPU_OFF.
 */
#define CPU_AREA         0x400000
#define CPU_BLOCK_SHIFT  16
#define CPU_BLOCK        (1 << CPU_BLOCK_SHIFT)
#define MAX_CPUS         32
#define PERCPU_OFF       0x2000
#define TSS_OFF          0x2100
#define IOMAP_OFF        0x68         /* bitmap offset inside the TSS */
#define TSS_LIMIT        (IOMAP_OFF + 8192)   /* includes the 0xff byte */
#define IST2_TOP         0x5000
#define USTACK_TOP       0x10000

/* struct percpu field offsets (the interrupt stubs use them) */
#define PCPU_PENDING     0            /* u8 pending[32]: bitmap of vectors */
#define PCPU_COUNT       32           /* u64 irq_count */

/* GDT selectors */
#define SEL_KCODE32      0x08
#define SEL_KDATA        0x10
#define SEL_KCODE64      0x18
#define SEL_UDATA        0x20
#define SEL_UCODE        0x28
#define SEL_TSS0         0x30         /* 16-byte TSS descriptor per CPU */

/* AP real-mode trampoline: copied here by smp_bringup(); SIPI vector 8 */
#define AP_TRAMPOLINE    0x8000

/* CPL3->CPL0 gate: int3 (#BP, vector 3) with rax = fn, rdi = arg */
#define VEC_CPL0_CALL    3

/* rflags given to CPL3 code: IOPL=3, reserved bit 1, IF=0 */
#define USER_RFLAGS      0x3002

#define EXIT_EXCEPTION   0x7e         /* exit code after an exception */

#endif
