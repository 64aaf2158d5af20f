/*
 * Symbiotic virtualization, guest side (docs/symbiotic.md): discovery,
 * SymSpy page registration and records. The numbers and offsets are
 * crates/lucid-sym/src/abi.rs's; change both together.
 */
#ifndef LUCID_SYM_H
#define LUCID_SYM_H

#include "libcflat.h"

#define SYM_HC_DISCOVER   6   /* rdi = SYM_DISCOVER_*                         */
#define SYM_HC_REGISTER   7   /* rdi = SYM_REGISTER_*, rsi = page GPA (0: off) */
#define SYM_HC_RETURN     8   /* end a SymCall: rdi = status, rsi, r8 = values */
#define SYM_HC_NOTIFY     9   /* rdi = SYM_NOTIFY_*                            */

#define SYM_DISCOVER_SIGNATURE 0
#define SYM_DISCOVER_VERSION   1
#define SYM_DISCOVER_FEATURES  2
#define SYM_SIGNATURE   0x4d5953444943554cULL /* "LUCIDSYM" */
#define SYM_VERSION     1

#define SYM_FEAT_SYMSPY     (1u << 0)
#define SYM_FEAT_SYMCALL    (1u << 1)
#define SYM_FEAT_SWAPBYPASS (1u << 2)
#define SYM_FEAT_MODULES    (1u << 3)

#define SYM_REGISTER_GLOBAL 0
#define SYM_REGISTER_VCPU   1
#define SYM_NOTIFY_MODULE_REPLY 0

#define SYM_OK          0
#define SYM_EWOULDBLOCK 11
#define SYM_EFAULT      14
#define SYM_EBUSY       16
#define SYM_ENODEV      19
#define SYM_EINVAL      22
#define SYM_ENOSYS      38
#define SYM_ETIMEDOUT   110

/* SymCall numbers (rax at the entry; args rdi, rsi, rdx, r10, r8) */
#define SYMCALL_ECHO         0
#define SYMCALL_PAGE_STATE   1
#define SYMCALL_READ_COUNTER 2
#define SYMCALL_SLOT_LIVE    3
#define SYMCALL_TEST_LOOP    0x100
#define SYMCALL_TEST_FAULT   0x101
#define SYMCALL_TEST_SMASH   0x102
#define SYM_PAGE_RESIDENT 0
#define SYM_PAGE_SWAPPED  1
#define SYM_PAGE_UNKNOWN  2

#define SYM_PAGE_MAGIC  0x59505353u /* "SSPY" */

/* Lucid's lines: iommu_mode values, and rung without any device */
#define SYM_IOMMU_NONE          0
#define SYM_IOMMU_VTD_SAMECORE  1
#define SYM_IOMMU_VTD_SIDECORE  2
#define SYM_RUNG_NONE           0xff

/* The SymSpy page layout: offsets fixed by the ABI (static asserts in sym.c). */
struct sym_header {
	u32 magic;
	u16 version;
	u16 kind;
	u32 vcpu;
	u32 reserved;
	u64 generation;
	u8 pad[0x40 - 0x18];
};

struct sym_global {
	struct sym_header h;
	/* 0x40: guest -> Lucid */
	volatile u32 seq;
	volatile u32 phase;
	volatile u64 symcall_entry;
	volatile u32 symcall_cs;
	volatile u32 symcall_ss;
	volatile u64 symcall_flags;
	volatile u64 exports;
	volatile u64 swap_map;
	volatile u32 swap_map_len;
	volatile u32 swap_device;
	u8 pad1[0x80 - 0x78];
	/* 0x80: Lucid -> guest */
	volatile u32 l_seq;
	volatile u32 l_features;
	volatile u64 mem_pressure;	/* per mille */
	volatile u64 mem_available_kib;
	volatile u32 iommu_mode;
	volatile u32 rung;
	volatile u64 symcalls;
	volatile u64 publishes;
	u8 pad2[0x100 - 0xb0];
	/* 0x100: module mailbox request (Lucid -> guest), 0x200: reply */
	volatile u8 mailbox[0x100];
	volatile u8 mailbox_reply[0x100];
	u8 rest[4096 - 0x300];
} __attribute__((aligned(4096)));

struct sym_vcpu {
	struct sym_header h;
	/* 0x40: guest -> Lucid */
	volatile u32 seq;
	volatile u32 task;
	volatile u64 counter;
	volatile u64 if_enabled;
	volatile u64 symcall_stack;
	volatile u64 in_symcall;
	u8 pad1[0x80 - 0x68];
	/* 0x80: Lucid -> guest */
	volatile u32 w_seq;
	volatile u32 rung;
	volatile u64 runq_wait_ns;
	volatile u64 symcalls;
	volatile u64 publishes;
	u8 rest[4096 - 0xa0];
} __attribute__((aligned(4096)));

/* The module mailbox inside the global page (crates/lucid-sym/src/abi.rs
 * `module`): the request at 0x100 (Lucid -> guest, seq written last), the
 * reply at 0x200 (guest -> Lucid, seq written last, then HC_NOTIFY), the
 * loader's description at 0x2c0. Static asserts in sym.c. */
#define SYM_MOD_OP_NONE   0
#define SYM_MOD_OP_LOAD   1
#define SYM_MOD_OP_UNLOAD 2
#define SYM_MOD_OP_SEAL   3
#define SYM_MOD_OP_CALL   4
#define SYM_MOD_FLAG_READ_ONLY 1
#define SYM_MOD_STAGE_DONE   0
#define SYM_MOD_STAGE_STAGED 1
#define SYM_MOD_LOADER_MAGIC 0x444f4d53u /* "SMOD" */
#define SYM_MOD_NAME_LEN 32
#define SYM_MOD_MESSAGE_LEN 128
#define SYM_ENOENT  2
#define SYM_E2BIG   7
#define SYM_ENOEXEC 8
#define SYM_ENOMEM  12
#define SYMCALL_MODULE_COUNTER 0x200
#define SYM_EXPORTS_MAGIC 0x50584553u /* "SEXP" */
#define SYM_EXPORT_NAME_LEN 24

struct sym_mod_request {		/* at global page + 0x100 */
	volatile u32 seq;
	volatile u32 op;
	volatile u32 flags;
	volatile u32 id;
	volatile u64 size;
	volatile u64 ro_gpa;
	volatile u64 ro_size;
	volatile char name[SYM_MOD_NAME_LEN];
	volatile u64 arg;
};

struct sym_mod_reply {			/* at global page + 0x200 */
	volatile u32 seq;
	volatile u32 status;
	volatile u32 id;
	volatile u32 stage;
	volatile u64 base;
	volatile u64 size;
	volatile u64 init;
	volatile u64 staged;
	volatile u64 staged_size;
	u64 reserved;
	volatile char message[SYM_MOD_MESSAGE_LEN];
	/* 0x2c0: the loader */
	volatile u32 magic;
	volatile u32 loaded;
	volatile u64 arena;
	volatile u64 arena_size;
	volatile u64 object;
	volatile u64 object_size;
	volatile u64 arena_used;
	volatile u64 polls;
	u64 reserved2;
};

struct sym_export {			/* the table at G_EXPORTS: header, then entries */
	u64 addr;
	char name[SYM_EXPORT_NAME_LEN];
};
struct sym_exports {
	u32 magic;
	u32 count;
	struct sym_export e[];
};

/* Discovery through the hypercall port (works on every host). Returns the
 * feature bits, or 0 when the VMM is not a symbiotic Lucid (or is too new). */
u32 sym_discover(void);
/* The same through CPUID leaf 0x40000100 (hosts that intercept CPUID);
 * 0 when absent. */
u32 sym_discover_cpuid(void);

/* Registers the global page / this CPU's page (fills the header first).
 * Returns 0 or a negative errno from Lucid. */
long sym_register_global(struct sym_global *g);
long sym_register_vcpu(struct sym_vcpu *v, u32 cpu);

/* Writes a guest -> Lucid record under its sequence count. */
static inline void sym_seq_begin(volatile u32 *seq)
{
	*seq = *seq + 1;
	asm volatile("" ::: "memory");
}
static inline void sym_seq_end(volatile u32 *seq)
{
	asm volatile("" ::: "memory");
	*seq = *seq + 1;
}
/* Reads a Lucid -> guest record: retry while odd or changed. */
static inline u32 sym_read_begin(volatile u32 *seq)
{
	u32 s;
	while ((s = *seq) & 1)
		cpu_relax();
	asm volatile("" ::: "memory");
	return s;
}
static inline int sym_read_retry(volatile u32 *seq, u32 s)
{
	asm volatile("" ::: "memory");
	return *seq != s;
}

#endif
