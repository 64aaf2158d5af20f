/*
 * PVH boot stub of the Lucid probe-guest kit.
 *
 * Entered in 32-bit protected mode, paging off, flat segments, with
 * EBX = physical address of struct hvm_start_info. Everything it needs is
 * prebuilt at assembly time (identity page tables for 4 GiB with 2 MiB
 * pages, GDT with one TSS descriptor per CPU), so the CPL0 part is about
 * 35 straight-line instructions: CPL0 code is emulated (~4 us each) on
 * PVM hosts. It then drops to CPL3 with IOPL=3 and calls cpu_user_entry()
 * (setup.c), which clears BSS, copies the boot data, fills the IDT and
 * calls main().
 *
 * Also here: the interrupt/exception stubs (a few instructions each), the
 * CPL3->CPL0 gates and the AP real-mode trampoline (smp.c copies it).
 */
#include "layout.h"

/* ---- PVH entry note: XEN_ELFNOTE_PHYS32_ENTRY (18), name "Xen" ---- */
	.section .note.pvh, "a", @note
	.balign 4
	.long 4			/* namesz */
	.long 4			/* descsz */
	.long 18		/* type */
	.asciz "Xen"
	.long pvh_start32

/* ---- 32-bit entry (BSP from PVH, APs from the trampoline) ---- */
	.section .text.boot, "ax"
	.code32
	.globl pvh_start32
pvh_start32:
	movl %ebx, boot_start_info
	xorl %ebp, %ebp			/* ebp = 0: bootstrap CPU */
	lgdt gdt_ptr
common32:
	movl $0x20, %eax		/* CR4.PAE (nothing else: no SMEP/SMAP) */
	movl %eax, %cr4
	movl $pml4, %eax
	movl %eax, %cr3
	movl $0xc0000080, %ecx		/* EFER.LME */
	movl $0x100, %eax
	xorl %edx, %edx
	wrmsr
	movl $0x80000031, %eax		/* PG | NE | ET | PE */
	movl %eax, %cr0
	ljmp $SEL_KCODE64, $start64

	.globl ap_start32
ap_start32:
	movl $1, %ebp			/* ebp = 1: application processor */
	jmp common32

	.code64
start64:
	movl $SEL_KDATA, %eax
	movl %eax, %ds
	movl %eax, %es
	movl %eax, %ss
	xorl %eax, %eax
	movl %eax, %fs
	movl %eax, %gs
	xorl %ecx, %ecx
	testl %ebp, %ebp
	jz 1f
	movl $1, %ecx
	lock xaddl %ecx, next_cpu(%rip)
	cmpl $MAX_CPUS, %ecx
	jae park
1:	movl %ecx, %ebx
	shll $CPU_BLOCK_SHIFT, %ebx
	addl $CPU_AREA, %ebx		/* rbx = this CPU's block */
	leaq PERCPU_OFF(%rbx), %rsp
	movq %rsp, TSS_OFF+4(%rbx)	/* rsp0 */
	movq %rsp, TSS_OFF+36(%rbx)	/* ist1: interrupts, gates */
	leaq IST2_TOP(%rbx), %rax
	movq %rax, TSS_OFF+44(%rbx)	/* ist2: exceptions */
	movw $IOMAP_OFF, TSS_OFF+102(%rbx) /* I/O bitmap (setup.c zeroes it) */
	movl %ecx, %eax
	shll $4, %eax
	addl $SEL_TSS0, %eax
	ltr %ax
	lidt idt_ptr(%rip)
	pushq $(SEL_UDATA | 3)
	leaq (USTACK_TOP - 8)(%rbx), %rax
	pushq %rax
	pushq $USER_RFLAGS
	pushq $(SEL_UCODE | 3)
	pushq $cpu_user_entry
	movl %ecx, %edi			/* cpu_user_entry(cpu index) */
	iretq

	.globl cpu_park
cpu_park:				/* CPL0: stop this CPU for good */
park:	cli
	hlt
	jmp park

/* ---- interrupt and exception stubs: 256 slots of 32 bytes ---- */
#define ERRMASK ((1<<8)|(1<<10)|(1<<11)|(1<<12)|(1<<13)|(1<<14)|(1<<17)|(1<<21)|(1<<29)|(1<<30))
/* offset of struct percpu from %rsp inside an IRQ stub: 5-word frame + saved rax */
#define PCPU_FROM_RSP 48

	.text
	.balign 32
	.globl isr_stubs
isr_stubs:
	.set vec, 0
	.rept 256
	.balign 32
	.if vec < 32
	.if ((ERRMASK >> vec) & 1) == 0
	pushq $0
	.endif
	pushq $vec
	jmp exc_common
	.else
	pushq %rax
	orb $(1 << (vec & 7)), (PCPU_FROM_RSP + PCPU_PENDING + (vec >> 3))(%rsp)
	incq (PCPU_FROM_RSP + PCPU_COUNT)(%rsp)
	.if vec != 0xff			/* spurious vector: no EOI */
	xorl %eax, %eax
	movabs %eax, 0xfee000b0		/* LAPIC EOI */
	.endif
	popq %rax
	iretq
	.endif
	.set vec, vec + 1
	.endr

/*
 * Exceptions: record vector, error code and the hardware frame in
 * exc_info (user-visible), then if the fault came from CPL3 continue in
 * exception_report() at CPL3 on its own stack (it prints and exits with
 * EXIT_EXCEPTION); a fault at CPL0 exits at once through port 0xf4.
 */
exc_common:
	popq exc_info+0(%rip)		/* vector */
	popq exc_info+8(%rip)		/* error code */
	popq exc_info+16(%rip)		/* rip */
	popq exc_info+24(%rip)		/* cs */
	popq exc_info+32(%rip)		/* rflags */
	popq exc_info+40(%rip)		/* rsp */
	popq exc_info+48(%rip)		/* ss */
	movq %cr2, %rax
	movq %rax, exc_info+56(%rip)
	testb $3, exc_info+24(%rip)
	jz 1f
	pushq $(SEL_UDATA | 3)
	pushq $(exc_stack + 8192 - 8)
	pushq $USER_RFLAGS
	pushq $(SEL_UCODE | 3)
	pushq $exception_report
	iretq
1:	movl $EXIT_EXCEPTION, %eax
	outl %eax, $0xf4
	jmp park

/*
 * ---- CPL3 -> CPL0 gate: int3 (vector 3, DPL3, IST1) ----
 * rax = fn, rdi = arg; runs fn(arg) at CPL0 with IF=0 and returns its rax.
 * int3 and not `int $n`: PVM emulates `int $n` from CPL3 as #UD, while
 * int3 is a hardware #BP trap that it reflects into the guest IDT.
 */
	.globl gate_cpl0_call, cpl0_set_if, cpl0_clear_if
gate_cpl0_call:
	subq $8, %rsp
	call *%rax
	addq $8, %rsp
	iretq
/* gate functions: rflags of the iretq frame is at 32(%rsp) (ret, pad, rip, cs) */
cpl0_set_if:
	orl $0x200, 32(%rsp)
	ret
cpl0_clear_if:
	andl $~0x200, 32(%rsp)
	ret

/* ---- AP trampoline: copied to AP_TRAMPOLINE, started by SIPI vector 8 ---- */
	.section .rodata
	.globl ap_tramp_start, ap_tramp_end
	.code16
ap_tramp_start:
	cli
	movw %cs, %ax
	movw %ax, %ds
	lgdtl ap_gdt_ptr - ap_tramp_start
	movl $0x11, %eax		/* PE | ET */
	movl %eax, %cr0
	ljmpl $SEL_KCODE32, $ap_start32
	.balign 4
ap_gdt_ptr:
	.word gdt_end - gdt - 1
	.long gdt
ap_tramp_end:
	.code64

/* ---- data ---- */
	.data
	.globl boot_start_info, next_cpu
	.balign 8
boot_start_info:
	.long 0
next_cpu:
	.long 1

	.balign 16
gdt:
	.quad 0
	.quad 0x00cf9a000000ffff	/* 0x08 kernel code, 32-bit */
	.quad 0x00cf92000000ffff	/* 0x10 kernel data */
	.quad 0x00af9a000000ffff	/* 0x18 kernel code, 64-bit */
	.quad 0x00cff2000000ffff	/* 0x20 user data */
	.quad 0x00affa000000ffff	/* 0x28 user code, 64-bit */
	.set i, 0			/* 0x30 + 16*i: TSS of CPU i */
	.rept MAX_CPUS
	.set tb, CPU_AREA + i * CPU_BLOCK + TSS_OFF
	.word TSS_LIMIT, tb & 0xffff
	.byte (tb >> 16) & 0xff, 0x89, 0x00, (tb >> 24) & 0xff
	.long 0, 0
	.set i, i + 1
	.endr
gdt_end:

	.balign 8
gdt_ptr:
	.word gdt_end - gdt - 1
	.long gdt
	.balign 8
	.word 0, 0, 0
idt_ptr:
	.word 4095
	.quad idt_table

/* identity map of 0-4 GiB, 2 MiB pages, user+writable; UC on the MMIO hole */
	.balign 4096
	.globl pml4
pml4:
	.quad pdpt + 0x7
	.fill 511, 8, 0
pdpt:
	.quad pd + 0x0007, pd + 0x1007, pd + 0x2007, pd + 0x3007
	.fill 508, 8, 0
pd:
	.set a, 0
	.rept 2048
	.if a >= 0xc0000000
	.quad a + 0x9f			/* P RW US PWT PCD PS */
	.else
	.quad a + 0x87			/* P RW US PS */
	.endif
	.set a, a + 0x200000
	.endr

	.bss
	.balign 4096
	.globl idt_table, exc_stack
idt_table:
	.space 4096
exc_stack:
	.space 8192

	.section .note.GNU-stack, "", @progbits
