/*
 * Symbiotic modules, guest side (docs/symbiotic.md §7): the loader that
 * takes a relocatable ELF object Lucid copied into the object buffer, links
 * it in the module arena against the guest's exports and runs its init;
 * later runs its exit and frees it. Requests come through the module
 * mailbox of the global SymSpy page; the guest's main loop polls.
 *
 * A module is `gcc -c` output (-mcmodel=small -fno-pic) defining
 *   long module_init(void); void module_exit(void);
 * and optionally  u64 module_call(u64 arg);
 * calling only exported guest functions.
 */
#ifndef LUCID_SYMMOD_H
#define LUCID_SYMMOD_H

#include "sym.h"

/* Publishes the exports table (G_EXPORTS) and the arena [arena, arena+size)
 * (its last quarter, at most 1 MiB, is the buffer Lucid copies objects
 * into), then marks the loader ready. The global page must be registered. */
void symmod_init(struct sym_global *g, void *arena, u64 size);
/* Adds an export (before symmod_init; 0 when the table is full). */
int symmod_export(const char *name, const void *addr);
/* Handles a pending request, if any; returns 1 when it handled one. */
int symmod_poll(void);
/* Arena bytes in use, modules loaded. */
u64 symmod_arena_used(void);
u32 symmod_loaded(void);
/* Called after a module's init ran (id, code base, code size, read-only). */
extern void (*symmod_on_load)(u32 id, u64 base, u64 size, int read_only);

/* Exported to modules: adds v to the guest's module counter, returns it. */
u64 sym_export_counter_add(u64 v);
/* Exported to modules: FNV-1a 64 of n bytes. */
u64 sym_export_hash(const void *p, u64 n);

#endif
