/*
 * What a symbiotic module sees of the guest: only the functions the
 * guest's loader exports (guests/lib/x86/symmod.c's table). Modules are
 * built with `gcc -c` (the kit's CFLAGS) and never linked with the kit.
 */
#ifndef LUCID_MODULE_H
#define LUCID_MODULE_H

typedef unsigned long u64;
typedef unsigned long size_t;

int printf(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
int snprintf(char *buf, size_t size, const char *fmt, ...);
void *memcpy(void *d, const void *s, size_t n);
void *memset(void *d, int c, size_t n);
size_t strlen(const char *s);
typedef u64 (*symcall_fn)(const u64 args[5], u64 out[2]);
int symcall_register(u64 nr, symcall_fn fn);
u64 sym_export_counter_add(u64 v);
u64 sym_export_hash(const void *p, u64 n);

long module_init(void);
void module_exit(void);
u64 module_call(u64 arg);

#endif
