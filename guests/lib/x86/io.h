/* Port and MMIO accessors (port I/O works at CPL3: IOPL=3). */
#ifndef LUCID_IO_H
#define LUCID_IO_H

#include "types.h"

static inline void outb(u16 port, u8 v) { asm volatile("outb %0, %1" :: "a"(v), "Nd"(port)); }
static inline void outw(u16 port, u16 v) { asm volatile("outw %0, %1" :: "a"(v), "Nd"(port)); }
static inline void outl(u16 port, u32 v) { asm volatile("outl %0, %1" :: "a"(v), "Nd"(port)); }
static inline u8 inb(u16 port) { u8 v; asm volatile("inb %1, %0" : "=a"(v) : "Nd"(port)); return v; }
static inline u16 inw(u16 port) { u16 v; asm volatile("inw %1, %0" : "=a"(v) : "Nd"(port)); return v; }
static inline u32 inl(u16 port) { u32 v; asm volatile("inl %1, %0" : "=a"(v) : "Nd"(port)); return v; }

static inline void mmio_write8(u64 a, u8 v) { *(volatile u8 *)a = v; }
static inline void mmio_write16(u64 a, u16 v) { *(volatile u16 *)a = v; }
static inline void mmio_write32(u64 a, u32 v) { *(volatile u32 *)a = v; }
static inline u8 mmio_read8(u64 a) { return *(volatile u8 *)a; }
static inline u16 mmio_read16(u64 a) { return *(volatile u16 *)a; }
static inline u32 mmio_read32(u64 a) { return *(volatile u32 *)a; }

static inline void cpu_relax(void) { asm volatile("pause" ::: "memory"); }
static inline void barrier(void) { asm volatile("" ::: "memory"); }

#endif
