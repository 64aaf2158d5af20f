/* Intel VT-d driver for probe guests (see vtd.h). */
#include "libcflat.h"
#include "virtio.h"		/* dma_alloc */
#include "vtd.h"

struct vtd vtd = { .fault_vector = -1 };
volatile u64 vtd_fault_irqs;

/* The fault-event handler: one counter bump and the EOI, nothing else
 * (CPL0 is emulated and slow); CPL3 code reads the fault records. */
asm(".text\n"
    ".globl vtd_fault_isr\n"
    "vtd_fault_isr:\n"
    "	lock incq vtd_fault_irqs(%rip)\n"
    "	pushq %rax\n"
    "	xorl %eax, %eax\n"
    "	movabs %eax, 0xfee000b0\n"
    "	popq %rax\n"
    "	iretq\n");
extern char vtd_fault_isr[];

u32 vtd_read32(u32 off) { return mmio_read32(vtd.base + off); }
u64 vtd_read64(u32 off) { return *(volatile u64 *)(vtd.base + off); }
void vtd_write32(u32 off, u32 v) { mmio_write32(vtd.base + off, v); }
void vtd_write64(u32 off, u64 v) { *(volatile u64 *)(vtd.base + off) = v; }

static u64 timeout_ticks(void)
{
	static u64 t;
	if (!t)
		t = param_u64("vtd_timeout_ms", 1000) * (tsc_khz() ? tsc_khz() : 3000000);
	return t;
}

int vtd_probe(void)
{
	u64 base = param_u64("vtd_base", 0);
	if (!base) {
		const u8 *t = acpi_find_table("DMAR");
		if (!t) {
			printf("vtd: no DMAR table\n");
			return -1;
		}
		u32 len = *(const u32 *)(t + 4);
		printf("vtd: DMAR haw=%u flags=%#x len=%u\n", t[36] + 1, t[37], len);
		for (u32 off = 48; off + 4 <= len;) {
			u16 type = *(const u16 *)(t + off), slen = *(const u16 *)(t + off + 2);
			if (slen < 4)
				break;
			if (type == 0 && slen >= 16) {
				base = *(const u64 *)(t + off + 8);
				printf("vtd: DRHD flags=%#x segment=%u base=%#lx\n", t[off + 4],
				       *(const u16 *)(t + off + 6), base);
				break;
			}
			off += slen;
		}
		if (!base) {
			printf("vtd: DMAR has no DRHD\n");
			return -1;
		}
	}
	if (base >> 32 || base < 0xc0000000) {
		printf("vtd: register base %#lx outside the identity-mapped MMIO hole\n", base);
		return -1;
	}
	vtd.base = base;
	vtd.ver = vtd_read32(VTD_VER);
	vtd.cap = vtd_read64(VTD_CAP);
	vtd.ecap = vtd_read64(VTD_ECAP);
	vtd.fro = VTD_CAP_FRO(vtd.cap);
	vtd.nfr = VTD_CAP_NFR(vtd.cap);
	vtd.iro = VTD_ECAP_IRO(vtd.ecap);
	vtd.cm = VTD_CAP_CM(vtd.cap);
	vtd.psi = VTD_CAP_PSI(vtd.cap);
	u32 sagaw = VTD_CAP_SAGAW(vtd.cap);
	u64 want = param_u64("levels", 0);
	if ((want == 4 || !want) && (sagaw & 4))
		vtd.levels = 4;
	else if ((want == 3 || !want) && (sagaw & 2))
		vtd.levels = 3;
	else
		vtd.levels = 0;
	vtd.gcmd = vtd_read32(VTD_GSTS) & (VTD_GCMD_TE | VTD_GCMD_QIE | VTD_GCMD_IRE | VTD_GCMD_CFI);
	printf("vtd: ver=%u.%u cap=%#lx ecap=%#lx cm=%d sagaw=%#x mgaw=%lu fro=%#x nfr=%u iro=%#x "
	       "qi=%lu ir=%lu psi=%d sllps=%#lx levels=%d\n",
	       (vtd.ver >> 4) & 0xf, vtd.ver & 0xf, vtd.cap, vtd.ecap, vtd.cm, sagaw,
	       VTD_CAP_MGAW(vtd.cap), vtd.fro, vtd.nfr, vtd.iro, VTD_ECAP_QI(vtd.ecap),
	       VTD_ECAP_IR(vtd.ecap), vtd.psi, VTD_CAP_SLLPS(vtd.cap), vtd.levels);
	if (!vtd.levels) {
		printf("vtd: SAGAW %#x offers neither 3- nor 4-level tables\n", sagaw);
		return -1;
	}
	if (vtd.fro + 16 * vtd.nfr > 0x2000 || vtd.iro + 16 > 0x2000) {
		printf("vtd: FRO/IRO point past the register window\n");
		return -1;
	}
	return 0;
}

int vtd_gcmd(u32 bit, int on)
{
	const u32 persistent = VTD_GCMD_TE | VTD_GCMD_QIE | VTD_GCMD_IRE | VTD_GCMD_CFI |
			       VTD_GCMD_EAFL;
	u32 want_set;		/* GSTS bit value meaning "done" */
	if (bit & persistent) {
		vtd.gcmd = on ? vtd.gcmd | bit : vtd.gcmd & ~bit;
		vtd_write32(VTD_GCMD, vtd.gcmd);
		want_set = on;
	} else {
		vtd_write32(VTD_GCMD, vtd.gcmd | bit);
		want_set = bit != VTD_GCMD_WBF;	/* WBFS clears when done; others set */
	}
	u64 t0 = rdtsc();
	for (;;) {
		u32 s = vtd_read32(VTD_GSTS);
		if (!!(s & bit) == want_set)
			return 0;
		if (rdtsc() - t0 > timeout_ticks()) {
			printf("vtd: GCMD %#x (%s) not acknowledged: GSTS=%#x\n", bit, on ? "on" : "off",
			       s);
			return -1;
		}
		cpu_relax();
	}
}

int vtd_set_root(void)
{
	if (!vtd.root)
		vtd.root = dma_alloc(4096, 4096);
	vtd_write64(VTD_RTADDR, (u64)vtd.root);	/* legacy mode: TTM = 0 */
	return vtd_gcmd(VTD_GCMD_SRTP, 1);
}

/* ---- queued invalidation ---- */

static u32 iq_head_cache;

int vtd_qi_enable(u32 qs)
{
	if (!VTD_ECAP_QI(vtd.ecap)) {
		printf("vtd: no queued invalidation\n");
		return -1;
	}
	if (qs > 7)
		qs = 7;
	vtd.iq_n = 256u << qs;
	if (!vtd.iq)
		vtd.iq = dma_alloc(4096ul << qs, 4096);
	else
		memset(vtd.iq, 0, 4096ul << qs);
	if (!vtd.wait_status)
		vtd.wait_status = dma_alloc(64, 64);
	vtd.iq_tail = vtd.iq_kicked = 0;
	iq_head_cache = 0;
	vtd_write64(VTD_IQT, 0);
	vtd_write64(VTD_IQA, (u64)vtd.iq | qs);	/* 128-bit descriptors (DW = 0) */
	return vtd_gcmd(VTD_GCMD_QIE, 1);
}

int vtd_qi_disable(void)
{
	return vtd_gcmd(VTD_GCMD_QIE, 0);
}

/* tell the unit about every appended descriptor (one IQT write) */
static void qi_kick(void)
{
	if (vtd.iq_kicked == vtd.iq_tail)
		return;
	barrier();			/* descriptors before the tail (x86: stores in order) */
	vtd_write64(VTD_IQT, (u64)vtd.iq_tail << 4);
	vtd.iq_kicked = vtd.iq_tail;
}

int vtd_qi_append(u64 lo, u64 hi)
{
	u32 next = (vtd.iq_tail + 1) & (vtd.iq_n - 1);
	if (next == iq_head_cache) {	/* looks full: ask the unit where it is */
		qi_kick();
		u64 t0 = rdtsc();
		while ((iq_head_cache = (vtd_read64(VTD_IQH) >> 4) & (vtd.iq_n - 1)) == next) {
			if ((vtd_read32(VTD_FSTS) & VTD_FSTS_IQE) || rdtsc() - t0 > timeout_ticks()) {
				vtd.qi_timeouts++;
				return -1;
			}
			cpu_relax();
		}
	}
	vtd.iq[2 * vtd.iq_tail] = lo;
	vtd.iq[2 * vtd.iq_tail + 1] = hi;
	vtd.iq_tail = next;
	vtd.qi_submitted++;
	return 0;
}

int vtd_qi_submit(u64 lo, u64 hi)
{
	int r = vtd_qi_append(lo, hi);
	qi_kick();
	return r;
}

u32 vtd_qi_post_wait(void)
{
	u32 seq = ++vtd.wait_seq;
	vtd_qi_submit(VTD_QI_WAIT | (1ul << 5) | ((u64)seq << 32), (u64)vtd.wait_status);
	return seq;
}

int vtd_qi_done(u32 seq)
{
	return (s32)(*vtd.wait_status - seq) >= 0;
}

int vtd_qi_wait(u32 seq)
{
	u64 t0 = rdtsc();
	vtd.qi_waits++;
	for (u32 spins = 1;; spins++) {
		if (vtd_qi_done(seq))
			return 0;
		/* the status word is the fast path; FSTS (a register access, an exit
		 * when trapped) only now and then, for a queue error */
		if (!(spins & 1023) && (vtd_read32(VTD_FSTS) & VTD_FSTS_IQE))
			return -1;
		if (rdtsc() - t0 > timeout_ticks()) {
			vtd.qi_timeouts++;
			return -1;
		}
		cpu_relax();
	}
}

int vtd_qi_sync(void)
{
	return vtd_qi_wait(vtd_qi_post_wait());
}

/* ---- invalidation ---- */

static int qi_on(void)
{
	return (vtd.gcmd & VTD_GCMD_QIE) != 0;
}

static void ccmd(u32 g, u16 did, u16 sid)
{
	vtd_write64(VTD_CCMD, (1ul << 63) | ((u64)g << 61) | ((u64)sid << 16) | did);
	u64 t0 = rdtsc();
	while (vtd_read64(VTD_CCMD) >> 63 && rdtsc() - t0 < timeout_ticks())
		cpu_relax();
}

static void iotlb_reg(u32 g, u16 did, u64 iva)
{
	if (g == 3)
		vtd_write64(vtd.iro + VTD_IVA, iva);
	vtd_write64(vtd.iro + VTD_IOTLB, (1ul << 63) | ((u64)g << 60) | ((u64)did << 32));
	u64 t0 = rdtsc();
	while (vtd_read64(vtd.iro + VTD_IOTLB) >> 63 && rdtsc() - t0 < timeout_ticks())
		cpu_relax();
}

void vtd_inv_context_global(void)
{
	if (qi_on())
		vtd_qi_append(VTD_QI_CC | (1 << 4), 0);
	else
		ccmd(1, 0, 0);
}

void vtd_inv_context_device(u16 did, u16 sid)
{
	if (qi_on())
		vtd_qi_append(VTD_QI_CC | (3 << 4) | ((u64)did << 16) | ((u64)sid << 32), 0);
	else
		ccmd(3, did, sid);
}

void vtd_inv_iotlb_global(void)
{
	if (qi_on())
		vtd_qi_append(VTD_QI_IOTLB | (1 << 4), 0);
	else
		iotlb_reg(1, 0, 0);
}

void vtd_inv_iotlb_domain(u16 did)
{
	if (qi_on())
		vtd_qi_append(VTD_QI_IOTLB | (2 << 4) | ((u64)did << 16), 0);
	else
		iotlb_reg(2, did, 0);
}

void vtd_inv_iotlb_pages(u16 did, u64 iova, u32 am)
{
	if (!vtd.psi || am > VTD_CAP_MAMV(vtd.cap)) {
		vtd_inv_iotlb_domain(did);
		return;
	}
	if (qi_on())
		vtd_qi_append(VTD_QI_IOTLB | (3 << 4) | ((u64)did << 16), (iova & ~0xfffUL) | am);
	else
		iotlb_reg(3, did, (iova & ~0xfffUL) | am);
}

void vtd_inv_iec_global(void)
{
	vtd_qi_append(VTD_QI_IEC, 0);
}

void vtd_inv_iec_index(u32 index)
{
	vtd_qi_append(VTD_QI_IEC | (1 << 4) | ((u64)index << 32), 0);
}

/* ---- domains and page tables ---- */

int vtd_domain_init(struct vtd_domain *d, u16 did)
{
	d->did = did;
	d->levels = vtd.levels;
	d->pgd = dma_alloc(4096, 4096);
	return 0;
}

int vtd_attach(u16 sid, struct vtd_domain *d)
{
	u32 bus = sid >> 8, devfn = sid & 0xff;
	if (!vtd.root && vtd_set_root())
		return -1;
	if (!vtd.ctx[bus]) {
		vtd.ctx[bus] = dma_alloc(4096, 4096);
		vtd.root[2 * bus + 1] = 0;
		barrier();
		vtd.root[2 * bus] = (u64)vtd.ctx[bus] | 1;
	}
	u64 *ce = &vtd.ctx[bus][2 * devfn];
	ce[0] = 0;
	barrier();
	ce[1] = (d->levels == 4 ? 2 : 1) | ((u64)d->did << 8);	/* AW, DID */
	barrier();
	ce[0] = (u64)d->pgd | 1;	/* present, FPD = 0, T = 0 (untranslated only) */
	/* a not-present -> present change: with Caching Mode the unit may have
	 * cached the absence; invalidate globally (context and IOTLB) */
	vtd_inv_context_global();
	vtd_inv_iotlb_global();
	if (qi_on())
		return vtd_qi_sync();
	return 0;
}

void vtd_detach(u16 sid)
{
	u32 bus = sid >> 8, devfn = sid & 0xff;
	if (!vtd.ctx[bus])
		return;
	u16 did = (vtd.ctx[bus][2 * devfn + 1] >> 8) & 0xffff;
	vtd.ctx[bus][2 * devfn] = 0;
	vtd_inv_context_device(did, sid);
	vtd_inv_iotlb_domain(did);
	if (qi_on())
		vtd_qi_sync();
}

static int iova_ok(struct vtd_domain *d, u64 iova)
{
	u32 bits = 12 + 9 * d->levels;
	u32 mgaw = VTD_CAP_MGAW(vtd.cap);
	if (mgaw < bits)
		bits = mgaw;
	return iova < (1ul << bits);
}

/* entry at `level` (1 = 4 KiB leaf, 2 = 2 MiB) for iova, allocating tables */
static volatile u64 *walk(struct vtd_domain *d, u64 iova, int level, int alloc)
{
	if (!iova_ok(d, iova))
		return NULL;
	u64 *t = d->pgd;
	for (int l = d->levels; l > level; l--) {
		volatile u64 *e = &t[(iova >> (12 + 9 * (l - 1))) & 511];
		if (!(*e & (VTD_PTE_R | VTD_PTE_W))) {
			if (!alloc)
				return NULL;
			u64 *n = dma_alloc(4096, 4096);
			*e = (u64)n | VTD_PTE_R | VTD_PTE_W;
		} else if (*e & VTD_PTE_PS) {
			return NULL;	/* a large page covers it */
		}
		t = (u64 *)(*e & VTD_PTE_ADDR);
	}
	return &t[(iova >> (12 + 9 * (level - 1))) & 511];
}

volatile u64 *vtd_pte(struct vtd_domain *d, u64 iova, int alloc)
{
	return walk(d, iova, 1, alloc);
}

int vtd_map_4k(struct vtd_domain *d, u64 iova, u64 phys, u64 perm)
{
	volatile u64 *e = walk(d, iova, 1, 1);
	if (!e)
		return -1;
	*e = (phys & VTD_PTE_ADDR) | (perm & (VTD_PTE_R | VTD_PTE_W));
	return 0;
}

void vtd_unmap_4k(struct vtd_domain *d, u64 iova)
{
	volatile u64 *e = walk(d, iova, 1, 0);
	if (e)
		*e = 0;
}

int vtd_map_2m(struct vtd_domain *d, u64 iova, u64 phys, u64 perm)
{
	if (!(VTD_CAP_SLLPS(vtd.cap) & 1) || (iova | phys) & 0x1fffff)
		return -1;
	volatile u64 *e = walk(d, iova, 2, 1);
	if (!e)
		return -1;
	*e = (phys & VTD_PTE_ADDR) | VTD_PTE_PS | (perm & (VTD_PTE_R | VTD_PTE_W));
	return 0;
}

void vtd_unmap_2m(struct vtd_domain *d, u64 iova)
{
	volatile u64 *e = walk(d, iova, 2, 0);
	if (e && (*e & VTD_PTE_PS))
		*e = 0;
}

/* ---- faults ---- */

static int irqs_on;

static void interrupts_on(void)
{
	if (irqs_on)
		return;
	irqs_on = 1;
	lapic_write(0xf0, 0x1ff);	/* SVR: APIC software-enabled, spurious 0xff */
	irq_enable();
}

void vtd_fault_irq_setup(int vector)
{
	idt_set_gate(vector, vtd_fault_isr, 1, 0);
	vtd.fault_vector = vector;
	vtd_write32(VTD_FECTL, VTD_FECTL_IM);
	vtd_write32(VTD_FEDATA, vector);
	vtd_write32(VTD_FEADDR, 0xfee00000u | (lapic_id() << 12));
	vtd_write32(VTD_FEUADDR, 0);
	interrupts_on();
	vtd_write32(VTD_FECTL, 0);
}

int vtd_read_faults(struct vtd_fault *out, int max)
{
	int n = 0;
	u32 fsts = vtd_read32(VTD_FSTS);
	u32 first = (fsts >> 8) & 0xff;
	for (u32 k = 0; k < vtd.nfr; k++) {
		u32 i = (first + k) % vtd.nfr;
		u32 off = vtd.fro + 16 * i;
		u64 hi = vtd_read64(off + 8);
		if (!(hi >> 63))
			continue;
		u64 lo = vtd_read64(off);
		if (n < max) {
			out[n].addr = lo & ~0xfffUL;
			out[n].sid = hi & 0xffff;
			out[n].reason = (hi >> 32) & 0xff;
			out[n].write = !((hi >> 62) & 1);
		}
		n++;
		vtd_write32(off + 12, 1u << 31);	/* F: write 1 to clear */
	}
	if (fsts & VTD_FSTS_PFO)
		vtd_write32(VTD_FSTS, VTD_FSTS_PFO);
	vtd.faults_read += n;
	return n;
}

const char *vtd_fault_name(u8 r)
{
	switch (r) {
	case VTD_FR_ROOT_NP: return "root-not-present";
	case VTD_FR_CTX_NP: return "context-not-present";
	case VTD_FR_CTX_INVALID: return "context-invalid";
	case VTD_FR_ADDR_MGAW: return "address-beyond-mgaw";
	case VTD_FR_WRITE: return "write-denied";
	case VTD_FR_READ: return "read-denied";
	case VTD_FR_PT_ACCESS: return "page-table-access";
	case VTD_FR_ROOT_ACCESS: return "root-table-access";
	case VTD_FR_CTX_ACCESS: return "context-table-access";
	case VTD_FR_ROOT_RSVD: return "root-reserved";
	case VTD_FR_CTX_RSVD: return "context-reserved";
	case VTD_FR_PTE_RSVD: return "pte-reserved";
	case VTD_FR_IR_REQ_RSVD: return "ir-request-reserved";
	case VTD_FR_IR_INDEX: return "ir-index-beyond-table";
	case VTD_FR_IR_NP: return "irte-not-present";
	case VTD_FR_IR_ACCESS: return "irt-access";
	case VTD_FR_IR_RSVD: return "irte-reserved";
	case VTD_FR_IR_COMPAT: return "ir-compat-blocked";
	case VTD_FR_IR_SID: return "ir-source-id";
	default: return "other";
	}
}

/* ---- interrupt remapping ---- */

int vtd_ir_enable(u32 n, int cfi)
{
	if (!VTD_ECAP_IR(vtd.ecap)) {
		printf("vtd: no interrupt remapping\n");
		return -1;
	}
	if (n < 2 || n > 65536 || (n & (n - 1)))
		n = 256;
	u32 s = __builtin_ctz(n) - 1;
	vtd.irt_n = n;
	if (!vtd.irt)
		vtd.irt = dma_alloc(16ul * n < 4096 ? 4096 : 16ul * n, 4096);
	vtd_write64(VTD_IRTA, (u64)vtd.irt | s);	/* xAPIC format (EIME = 0) */
	if (vtd_gcmd(VTD_GCMD_SIRTP, 1))
		return -1;
	vtd_inv_iec_global();
	if (vtd_qi_sync())
		return -1;
	if (cfi && vtd_gcmd(VTD_GCMD_CFI, 1))
		return -1;
	return vtd_gcmd(VTD_GCMD_IRE, 1);
}

int vtd_ir_disable(void)
{
	return vtd_gcmd(VTD_GCMD_IRE, 0);
}

void vtd_irte_set(u32 index, u8 vector, u32 apic_id, u16 sid)
{
	volatile u64 *e = &vtd.irt[2 * index];
	e[0] = 0;
	barrier();
	e[1] = sid ? (sid | (1ul << 18)) : 0;	/* SVT = 1: verify the full requester id */
	barrier();
	/* present, physical destination, edge, fixed; xAPIC: APIC ID in DST[15:8] */
	e[0] = 1 | ((u64)vector << 16) | ((u64)(apic_id & 0xff) << 40);
	vtd_inv_iec_index(index);
	vtd_qi_sync();
}

void vtd_irte_clear(u32 index)
{
	vtd.irt[2 * index] = 0;
	vtd_inv_iec_index(index);
	vtd_qi_sync();
}

void vtd_msi_remappable(u32 index, u64 *addr, u32 *data)
{
	*addr = 0xfee00000u | ((index & 0x7fff) << 5) | (1 << 4) | (((index >> 15) & 1) << 2);
	*data = 0;
}

int vtd_setup(int fault_vector)
{
	if (vtd_probe())
		return -1;
	if (VTD_ECAP_QI(vtd.ecap) && !(vtd.gcmd & VTD_GCMD_QIE) &&
	    vtd_qi_enable(param_u64("iq_order", 0)))
		return -1;
	if (vtd_set_root())
		return -1;
	vtd_inv_context_global();
	vtd_inv_iotlb_global();
	if (qi_on() && vtd_qi_sync()) {
		printf("vtd: first invalidation wait did not complete (FSTS=%#x)\n",
		       vtd_read32(VTD_FSTS));
		return -1;
	}
	if (fault_vector >= 0)
		vtd_fault_irq_setup(fault_vector);
	return 0;
}
