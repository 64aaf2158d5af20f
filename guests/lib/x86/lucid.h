/*
 * The Lucid guest ABI: ports and hypercall numbers. Single source of truth
 * for the probe guests; the VMM side mirrors these numbers.
 *
 * Hypercall: `out %eax, %dx` with dx = LUCID_HC_PORT, eax = call number,
 * rdi/rsi/r8 = arguments. Lucid writes the result into rax. Under another
 * VMM the port is unassigned, the write is dropped and rax keeps the call
 * number, so LUCID_HC_DISCOVER returns 0 there and discovery fails cleanly.
 */
#ifndef LUCID_H
#define LUCID_H

#define LUCID_HC_PORT        0x599      /* hypercall port */
#define LUCID_IOEVENTFD_PORT 0x598      /* write absorbed in the kernel (ioeventfd) */
#define LUCID_NOP_PORT       0x80       /* accepted no-op port (userspace exit) */
#define LUCID_EXIT_PORT      0xf4       /* 32-bit write: exit status (v << 1) | 1 */
#define LUCID_SERIAL_PORT    0x3f8      /* COM1, 16550 */
#define LUCID_MMIO_PROBE     0xd0000000UL /* unassigned MMIO page (exit probe) */
#define LUCID_LAPIC_BASE     0xfee00000UL
#define LUCID_IOAPIC_BASE    0xfec00000UL
#define LUCID_MMIO_HOLE      0xc0000000UL /* MMIO hole: 0xc0000000-0x100000000 */

/* hypercall numbers */
#define LUCID_HC_DISCOVER    0          /* returns LUCID_MAGIC */
#define LUCID_HC_TSC_KHZ     1          /* returns the TSC frequency in kHz */
#define LUCID_HC_BACKEND     2          /* returns a LUCID_BACKEND_* value */
#define LUCID_HC_REPORT      3          /* rdi = LUCID_REPORT_* key, rsi = value; returns 0 */
#define LUCID_HC_PHASE       4          /* rdi = phase number: the guest starts phase rdi (e.g. an
                                         * iteration); Lucid snapshots its host-side counters per
                                         * phase (swap.phase.<n>.*); returns 0 */
#define LUCID_HC_WORK        5          /* rdi = LUCID_WORK_* kind, rsi = amount done since the
                                         * last call: counters guest.work.<kind>; returns 0 */
#define LUCID_WORK_ITERATIONS 0         /* compute iterations */
#define LUCID_WORK_BYTES      1         /* bytes streamed */

/* LUCID_HC_REPORT keys: guest-side iommu_dma figures, kept by Lucid as
 * counters `iommu.guest.<name>` (the name after LUCID_REPORT_, lower case) */
#define LUCID_REPORT_MAPS          0
#define LUCID_REPORT_UNMAPS        1
#define LUCID_REPORT_MAP_CYCLES    2    /* rdtsc cycles spent in map, summed */
#define LUCID_REPORT_UNMAP_CYCLES  3
#define LUCID_REPORT_REUSE_HITS    4    /* maps served by an existing mapping */
#define LUCID_REPORT_STALE_MAX     5    /* most mappings logically unmapped but reachable */
#define LUCID_REPORT_WINDOW_MAX_US 6    /* longest logical unmap -> invalidation complete */
#define LUCID_REPORT_FAULTS_SEEN   7    /* VT-d fault records the guest read */

#define LUCID_MAGIC          0x4C554349 /* 'LUCI' */

#define LUCID_BACKEND_UNKNOWN 0
#define LUCID_BACKEND_VMX     1
#define LUCID_BACKEND_SVM     2
#define LUCID_BACKEND_PVM     3

#ifndef __ASSEMBLER__
static inline unsigned long lucid_hypercall(unsigned long nr, unsigned long a0,
					    unsigned long a1, unsigned long a2)
{
	register unsigned long r8 asm("r8") = a2;
	unsigned long ret = nr;

	asm volatile("outl %%eax, %%dx"
		     : "+a"(ret)
		     : "d"(LUCID_HC_PORT), "D"(a0), "S"(a1), "r"(r8)
		     : "memory");
	return ret;
}

/* 1 when running under Lucid (cached after the first call) */
int lucid_present(void);
/* "vmx", "svm", "pvm" or "unknown" */
const char *lucid_backend_name(void);
#endif

#endif
