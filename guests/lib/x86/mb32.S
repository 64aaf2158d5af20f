/*
 * Multiboot v1 runtime for 32-bit probe guests linked in low memory
 * (low.lds): the multiboot header, the entry (own GDT and stack, then
 * mb_main(magic, info)), and a round trip through real mode, which is why
 * such kernels live below 1 MiB. Everything here runs at CPL0: keep it short
 * (CPL0 code is emulated instruction by instruction on PVM hosts).
 */
#define MB_MAGIC	0x1BADB002
#define MB_FLAGS	0x00000003	/* page-align modules, memory info */

#define SEL_CODE32	0x08
#define SEL_DATA32	0x10
#define SEL_CODE16	0x18
#define SEL_DATA16	0x20

	.section .multiboot, "a"
	.balign 4
	.globl mb_header
mb_header:
	.long MB_MAGIC
	.long MB_FLAGS
	.long -(MB_MAGIC + MB_FLAGS)

	.text
	.code32
	.globl mb_entry
mb_entry:
	cli
	lgdt gdt_ptr
	ljmp $SEL_CODE32, $1f
1:	movw $SEL_DATA32, %cx
	movw %cx, %ds
	movw %cx, %es
	movw %cx, %fs
	movw %cx, %gs
	movw %cx, %ss
	movl $stack_top, %esp
	pushl %ebx			/* multiboot info */
	pushl %eax			/* magic */
	call mb_main
	/* mb_exit never returns; park if it somehow does */
2:	hlt
	jmp 2b

/*
 * u32 realmode_read_header(void): drops to real mode, reads the multiboot
 * magic through segment 0x100 (base 0x1000, where low.lds puts the image)
 * and comes back to 32-bit protected mode. Returns what it read.
 */
	.globl realmode_read_header
realmode_read_header:
	pushl %ebx
	movl %esp, saved_esp
	ljmp $SEL_CODE16, $1f
	.code16
1:	movw $SEL_DATA16, %ax
	movw %ax, %ds
	movw %ax, %es
	movw %ax, %ss
	movl %cr0, %eax
	andl $~1, %eax
	movl %eax, %cr0			/* PE off: real mode */
	ljmp $0, $2f
2:	xorw %ax, %ax
	movw %ax, %ds
	movw $0x100, %ax
	movw %ax, %es
	movl %es:(mb_header - 0x1000), %ebx
	movl %ebx, rm_result
	movl %cr0, %eax
	orl $1, %eax
	movl %eax, %cr0			/* PE on */
	ljmpl $SEL_CODE32, $3f
	.code32
3:	movw $SEL_DATA32, %ax
	movw %ax, %ds
	movw %ax, %es
	movw %ax, %ss
	movl saved_esp, %esp
	movl rm_result, %eax
	popl %ebx
	ret

	.data
	.balign 8
gdt:
	.quad 0
	.quad 0x00cf9b000000ffff	/* 0x08 code32 flat */
	.quad 0x00cf93000000ffff	/* 0x10 data32 flat */
	.quad 0x00009b000000ffff	/* 0x18 code16, base 0, limit 64 KiB */
	.quad 0x000093000000ffff	/* 0x20 data16, base 0, limit 64 KiB */
gdt_end:
gdt_ptr:
	.word gdt_end - gdt - 1
	.long gdt
saved_esp:
	.long 0
rm_result:
	.long 0

	.bss
	.balign 16
	.space 4096
stack_top:
