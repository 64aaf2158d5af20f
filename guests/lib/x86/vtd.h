/*
 * An Intel VT-d driver for probe guests (legacy translation mode), running
 * at CPL3 like the other drivers: finds the remapping unit in the ACPI
 * DMAR table, locates the fault-recording registers through CAP.FRO and
 * the IOTLB registers through ECAP.IRO (Lucid puts both on the unit's
 * second page; QEMU keeps them on the first), builds root, context and
 * second-level tables (3 or 4 levels from CAP.SAGAW, 4 KiB and 2 MiB
 * pages), runs queued invalidation with wait descriptors whose status
 * write is polled, interrupt remapping (IRTA, IRTEs, remappable MSIs),
 * reads and clears fault records, and counts fault-event interrupts in a
 * tiny CPL0 handler.
 *
 * Every GCMD write waits for its GSTS bit before anything else is written,
 * and register-based invalidations wait for CCMD.ICC / IOTLB.IVT to clear:
 * the "synchronous writes" rule a sidecore emulation depends on.
 */
#ifndef LUCID_VTD_H
#define LUCID_VTD_H

#include "types.h"

#define VTD_DEFAULT_BASE 0xfed90000UL

/* register offsets (page 0) */
#define VTD_VER		0x00
#define VTD_CAP		0x08
#define VTD_ECAP	0x10
#define VTD_GCMD	0x18
#define VTD_GSTS	0x1c
#define VTD_RTADDR	0x20
#define VTD_CCMD	0x28
#define VTD_FSTS	0x34
#define VTD_FECTL	0x38
#define VTD_FEDATA	0x3c
#define VTD_FEADDR	0x40
#define VTD_FEUADDR	0x44
#define VTD_AFLOG	0x58
#define VTD_PMEN	0x64
#define VTD_PLMBASE	0x68
#define VTD_PLMLIMIT	0x6c
#define VTD_PHMBASE	0x70
#define VTD_PHMLIMIT	0x78
#define VTD_IQH		0x80
#define VTD_IQT		0x88
#define VTD_IQA		0x90
#define VTD_ICS		0x9c
#define VTD_IECTL	0xa0
#define VTD_IEDATA	0xa4
#define VTD_IEADDR	0xa8
#define VTD_IEUADDR	0xac
#define VTD_IRTA	0xb8
/* relative to the IOTLB register block (ECAP.IRO * 16) */
#define VTD_IVA		0x00
#define VTD_IOTLB	0x08

/* GCMD / GSTS */
#define VTD_GCMD_TE	(1u << 31)
#define VTD_GCMD_SRTP	(1u << 30)
#define VTD_GCMD_SFL	(1u << 29)
#define VTD_GCMD_EAFL	(1u << 28)
#define VTD_GCMD_WBF	(1u << 27)
#define VTD_GCMD_QIE	(1u << 26)
#define VTD_GCMD_IRE	(1u << 25)
#define VTD_GCMD_SIRTP	(1u << 24)
#define VTD_GCMD_CFI	(1u << 23)

/* FSTS */
#define VTD_FSTS_PFO	(1u << 0)
#define VTD_FSTS_PPF	(1u << 1)
#define VTD_FSTS_IQE	(1u << 4)
#define VTD_FSTS_ICE	(1u << 5)
#define VTD_FSTS_ITE	(1u << 6)
#define VTD_FECTL_IM	(1u << 31)
#define VTD_FECTL_IP	(1u << 30)

/* CAP / ECAP fields */
#define VTD_CAP_ND(c)	((c) & 7)
#define VTD_CAP_CM(c)	(((c) >> 7) & 1)
#define VTD_CAP_SAGAW(c) (((c) >> 8) & 0x1f)
#define VTD_CAP_MGAW(c)	((((c) >> 16) & 0x3f) + 1)
#define VTD_CAP_FRO(c)	((((c) >> 24) & 0x3ff) * 16)
#define VTD_CAP_SLLPS(c) (((c) >> 34) & 0xf)
#define VTD_CAP_PSI(c)	(((c) >> 39) & 1)
#define VTD_CAP_NFR(c)	((((c) >> 40) & 0xff) + 1)
#define VTD_CAP_MAMV(c)	(((c) >> 48) & 0x3f)
#define VTD_ECAP_QI(e)	(((e) >> 1) & 1)
#define VTD_ECAP_IR(e)	(((e) >> 3) & 1)
#define VTD_ECAP_EIM(e)	(((e) >> 4) & 1)
#define VTD_ECAP_IRO(e)	((((e) >> 8) & 0x3ff) * 16)

/* second-level PTE permissions (iommu_dma directions map onto these) */
#define VTD_PTE_R	1ul
#define VTD_PTE_W	2ul
#define VTD_PTE_PS	(1ul << 7)
#define VTD_PTE_ADDR	0x000ffffffffff000ul

/* fault reasons (VT-d spec, appendix) */
#define VTD_FR_ROOT_NP		0x01
#define VTD_FR_CTX_NP		0x02
#define VTD_FR_CTX_INVALID	0x03
#define VTD_FR_ADDR_MGAW	0x04
#define VTD_FR_WRITE		0x05	/* write: not present or no W */
#define VTD_FR_READ		0x06	/* read: not present or no R */
#define VTD_FR_PT_ACCESS	0x07
#define VTD_FR_ROOT_ACCESS	0x08
#define VTD_FR_CTX_ACCESS	0x09
#define VTD_FR_ROOT_RSVD	0x0a
#define VTD_FR_CTX_RSVD		0x0b
#define VTD_FR_PTE_RSVD		0x0c
#define VTD_FR_IR_REQ_RSVD	0x20
#define VTD_FR_IR_INDEX		0x21
#define VTD_FR_IR_NP		0x22
#define VTD_FR_IR_ACCESS	0x23
#define VTD_FR_IR_RSVD		0x24
#define VTD_FR_IR_COMPAT	0x25
#define VTD_FR_IR_SID		0x26

/* queued-invalidation descriptor types */
#define VTD_QI_CC	0x1
#define VTD_QI_IOTLB	0x2
#define VTD_QI_DEVTLB	0x3
#define VTD_QI_IEC	0x4
#define VTD_QI_WAIT	0x5

struct vtd_domain {
	u16 did;
	int levels;		/* 3 (39-bit) or 4 (48-bit) */
	u64 *pgd;		/* top-level table */
};

struct vtd_fault {
	u64 addr;		/* faulting page (DMA) or IR index << 48 (IR: FI field) */
	u16 sid;		/* requester id bus << 8 | devfn */
	u8 reason;
	u8 write;		/* 1 write request, 0 read (T bit clear = write) */
};

struct vtd {
	u64 base;
	u32 ver;
	u64 cap, ecap;
	u32 fro, iro, nfr;	/* fault-recording and IOTLB register offsets, record count */
	int cm, psi;
	int levels;		/* chosen from SAGAW: 4 when possible, else 3 */
	u32 gcmd;		/* persistent GCMD bits we have set: TE, QIE, IRE, CFI */
	u64 *root;
	u64 *ctx[256];		/* context table per bus, allocated on attach */
	/* queued invalidation */
	u64 *iq;		/* 2 words per 128-bit descriptor */
	u32 iq_n, iq_tail;	/* entries, next free index */
	u32 iq_kicked;		/* tail last written to IQT */
	volatile u32 *wait_status;	/* status word written by wait descriptors */
	u32 wait_seq;		/* last sequence number posted */
	u64 qi_submitted, qi_waits, qi_timeouts;
	/* interrupt remapping */
	u64 *irt;
	u32 irt_n;
	/* faults */
	int fault_vector;	/* -1: fault events not set up */
	u64 faults_read;	/* records read and cleared */
};

extern struct vtd vtd;
/* fault-event interrupts seen (bumped by the CPL0 handler) */
extern volatile u64 vtd_fault_irqs;

u32 vtd_read32(u32 off);
u64 vtd_read64(u32 off);
void vtd_write32(u32 off, u32 v);
void vtd_write64(u32 off, u64 v);

/* find the DRHD (DMAR table, or param vtd_base=), read VER/CAP/ECAP and
 * locate FRO/IRO; prints "vtd: ..." and returns -1 if there is none */
int vtd_probe(void);
/* set a persistent GCMD bit on/off (TE, QIE, IRE, CFI) or issue a one-shot
 * command (SRTP, SIRTP, WBF, SFL), then wait for GSTS to agree; 0 ok, -1 timeout */
int vtd_gcmd(u32 bit, int on);
/* allocate the root table and program RTADDR + SRTP */
int vtd_set_root(void);
/* allocate the invalidation queue (2^qs pages), program IQA, IQT=0, QIE on */
int vtd_qi_enable(u32 qs);
int vtd_qi_disable(void);
/* append a raw descriptor and move IQT (waits while the queue is full) */
int vtd_qi_submit(u64 lo, u64 hi);
/* append without moving IQT: the next submit or wait tells the unit */
int vtd_qi_append(u64 lo, u64 hi);
/* post a wait descriptor that writes a new sequence number; returns it */
u32 vtd_qi_post_wait(void);
/* 1 once the wait descriptor with this sequence number completed */
int vtd_qi_done(u32 seq);
/* poll until seq completes; 0, or -1 on timeout or invalidation queue error */
int vtd_qi_wait(u32 seq);
/* post a wait and poll for it */
int vtd_qi_sync(void);

/* invalidations: by QI when it is on, else through CCMD / the IOTLB
 * registers. Queued ones are only appended: the wait that must follow
 * (vtd_qi_post_wait / vtd_qi_sync) moves IQT once for all of them, one
 * register write (one exit when trapped) per batch. Register-based ones
 * wait for their own completion. */
void vtd_inv_context_global(void);
void vtd_inv_context_device(u16 did, u16 sid);
void vtd_inv_iotlb_global(void);
void vtd_inv_iotlb_domain(u16 did);
/* 2^am pages from iova (aligned); falls back to domain-selective without PSI */
void vtd_inv_iotlb_pages(u16 did, u64 iova, u32 am);
void vtd_inv_iec_global(void);
void vtd_inv_iec_index(u32 index);

/* domains and second-level tables */
int vtd_domain_init(struct vtd_domain *d, u16 did);
/* point bus:devfn's context entry at the domain (and invalidate it) */
int vtd_attach(u16 sid, struct vtd_domain *d);
void vtd_detach(u16 sid);
/* leaf PTE for iova (4 KiB level), allocating tables; NULL if iova is too
 * large or a 2 MiB mapping covers it */
volatile u64 *vtd_pte(struct vtd_domain *d, u64 iova, int alloc);
int vtd_map_4k(struct vtd_domain *d, u64 iova, u64 phys, u64 perm);
void vtd_unmap_4k(struct vtd_domain *d, u64 iova);
/* 2 MiB mapping (needs CAP.SLLPS bit 0); both aligned; -1 if unsupported */
int vtd_map_2m(struct vtd_domain *d, u64 iova, u64 phys, u64 perm);
void vtd_unmap_2m(struct vtd_domain *d, u64 iova);

/* fault reporting: program FEDATA/FEADDR to vector on this CPU, install
 * the counting handler, unmask */
void vtd_fault_irq_setup(int vector);
/* read and clear up to max fault records (and PFO); returns how many */
int vtd_read_faults(struct vtd_fault *out, int max);
const char *vtd_fault_name(u8 reason);

/* interrupt remapping: a table of n (power of two, 2..65536) entries,
 * IRTA + SIRTP, IEC invalidated, IRE on (cfi: also let compatibility-format
 * interrupts through) */
int vtd_ir_enable(u32 n, int cfi);
int vtd_ir_disable(void);
/* IRTE index: fixed, edge, physical destination apic_id, vector; sid != 0:
 * only requester sid may use it (SVT=1, SQ=0). Invalidates the IEC entry. */
void vtd_irte_set(u32 index, u8 vector, u32 apic_id, u16 sid);
void vtd_irte_clear(u32 index);
/* remappable-format MSI address/data for handle index (SHV=0) */
void vtd_msi_remappable(u32 index, u64 *addr, u32 *data);

/* everything for the usual case: probe, root table, QI (if offered),
 * fault events on fault_vector (-1: none); translation still off */
int vtd_setup(int fault_vector);

#endif
