/*
 * SymCall, guest side: Lucid enters symcall_entry on a vCPU with interrupts
 * off, rax = call number, rdi, rsi, rdx, r10, r8 = arguments, rsp = that
 * vCPU's SymCall stack; the handler's status and two values go back with
 * SYM_HC_RETURN, and Lucid restores the interrupted context.
 */
#ifndef LUCID_SYMCALL_H
#define LUCID_SYMCALL_H

#include "sym.h"

/* A handler: returns a SYM_* status, fills out[0], out[1]. Runs like an NMI
 * handler: no locks (trylock only), no printf, no waiting. */
typedef u64 (*symcall_fn)(const u64 args[5], u64 out[2]);

/* Publishes the entry in the global page (which must be registered or
 * about to be) and bumps its generation. */
void symcall_init(struct sym_global *g);
/* Gives CPU `cpu` its SymCall stack (in its per-vCPU page record). */
void symcall_attach_cpu(struct sym_vcpu *v, u32 cpu);
/* Handler for call `nr` (replaces an earlier one; 0 if the table is full). */
int symcall_register(u64 nr, symcall_fn fn);
/* Counters READ_COUNTER returns (index < n). */
void symcall_set_counters(volatile u64 *counters, u32 n);
/* Calls completed by this guest's handlers (any CPU), and those its
 * exception path ended with SYM_EFAULT. */
extern volatile u64 symcall_count;
extern volatile u64 symcall_faults;
/* Called first by the kit's exception path (setup.c): if the fault hit a
 * SymCall handler, ends the call with SYM_EFAULT and never returns.
 * Interrupts: under PVM CPL3 runs with IF=1 whatever the entry's RFLAGS
 * say, so an interrupt may arrive during a handler; the kit's stubs take
 * it on the IST1 stack at CPL0, note it pending and return, so the handler
 * only loses time (the vector is seen by the interrupted code later). */
void symcall_exception(void);

#endif
