/*
 * triplefault: loads an empty IDT at CPL0 and executes ud2: #UD cannot be
 * delivered, nor #GP, nor #DF: the CPU shuts down (triple fault). Never
 * returns; QEMU -no-reboot exits, Lucid should report a shutdown.
 */
#include "libcflat.h"

static u64 fault(u64 arg)
{
	static const struct {
		u16 limit;
		u64 base;
	} __attribute__((packed)) empty = { 0, 0 };
	asm volatile("lidt %0; ud2" :: "m"(empty));
	return 0;
}

int main(void)
{
	printf("triplefault: loading an empty IDT and faulting\n");
	cpl0_call(fault, 0);
	printf("triplefault: still alive?!\n");
	return 3;
}
