/* PCI configuration, enumeration, BARs, capabilities and MSI-X (see pci.h). */
#include "libcflat.h"
#include "pci.h"

#define PCI_CONFIG_ADDR 0xcf8
#define PCI_CONFIG_DATA 0xcfc

/*
 * Two configuration mechanisms: ports 0xCF8/0xCFC (default) and ECAM from
 * the ACPI MCFG table (or param ecam=<base> for buses 0-255), used when
 * port 0xCF8 finds nothing at 00:00.0 (QEMU microvm's PCIe host has ECAM
 * only, and QEMU 7.2 gives it no MCFG: ecam=0xe0000000) or with pci=ecam.
 */
static int cfg_mode;		/* 0 not chosen, 1 ports, 2 ECAM */
static u64 ecam_base;
static u8 ecam_bus0, ecam_bus1;

/* port 0xCF8 then 0xCFC is two accesses: keep them together across CPUs */
static volatile int cfg_lock;

static void lock(void)
{
	while (__atomic_exchange_n(&cfg_lock, 1, __ATOMIC_ACQUIRE))
		while (cfg_lock)
			cpu_relax();
}

static void unlock(void)
{
	__atomic_store_n(&cfg_lock, 0, __ATOMIC_RELEASE);
}

static u32 cfg_addr(u32 bdf, u32 off)
{
	return 0x80000000u | (bdf << 8) | (off & 0xfc);
}

static u32 port_read(u32 bdf, u32 off)
{
	lock();
	outl(PCI_CONFIG_ADDR, cfg_addr(bdf, off));
	u32 v = inl(PCI_CONFIG_DATA);
	unlock();
	return v;
}

static int ecam_find(void)
{
	if (param_present("ecam")) {	/* no MCFG (QEMU 7.2 microvm): give the base */
		ecam_base = param_u64("ecam", 0);
		ecam_bus0 = 0;
		ecam_bus1 = 255;
		return 0;
	}
	const u8 *t = acpi_find_table("MCFG");
	if (!t || *(const u32 *)(t + 4) < 44 + 16)
		return -1;
	ecam_base = *(const u64 *)(t + 44);
	ecam_bus0 = t[44 + 10];
	ecam_bus1 = t[44 + 11];
	return 0;
}

static void choose(void)
{
	const char *m = param_str("pci", "auto");
	cfg_mode = 1;
	if (!strcmp(m, "ecam") || (strcmp(m, "cf8") && port_read(0, 0) == 0xffffffff)) {
		if (ecam_find() == 0)
			cfg_mode = 2;
	}
}

/* ECAM address of (bdf, off), 0 when outside the MCFG bus range */
static u64 ecam_addr(u32 bdf, u32 off)
{
	u32 bus = bdf >> 8;
	if (bus < ecam_bus0 || bus > ecam_bus1)
		return 0;
	return ecam_base + (((u64)(bus - ecam_bus0) << 20) | ((u64)(bdf & 0xff) << 12) |
			    (off & 0xffc));
}

const char *pci_cfg_mechanism(void)
{
	if (!cfg_mode)
		choose();
	return cfg_mode == 2 ? "ecam" : "cf8";
}

u32 pci_cfg_read32(u32 bdf, u32 off)
{
	if (!cfg_mode)
		choose();
	if (cfg_mode == 2) {
		u64 a = ecam_addr(bdf, off);
		return a ? mmio_read32(a) : 0xffffffff;
	}
	return port_read(bdf, off);
}

void pci_cfg_write32(u32 bdf, u32 off, u32 v)
{
	if (!cfg_mode)
		choose();
	if (cfg_mode == 2) {
		u64 a = ecam_addr(bdf, off);
		if (a)
			mmio_write32(a, v);
		return;
	}
	lock();
	outl(PCI_CONFIG_ADDR, cfg_addr(bdf, off));
	outl(PCI_CONFIG_DATA, v);
	unlock();
}

u16 pci_cfg_read16(u32 bdf, u32 off)
{
	return pci_cfg_read32(bdf, off) >> ((off & 2) * 8);
}

u8 pci_cfg_read8(u32 bdf, u32 off)
{
	return pci_cfg_read32(bdf, off) >> ((off & 3) * 8);
}

static void cfg_rmw(u32 bdf, u32 off, u32 mask, u32 v)
{
	u32 d = off & ~3u;
	u32 old = pci_cfg_read32(bdf, d);
	if (d == PCI_COMMAND)		/* don't clear status bits by writing them back */
		old &= 0xffff;
	pci_cfg_write32(bdf, d, (old & ~mask) | (v & mask));
}

void pci_cfg_write16(u32 bdf, u32 off, u16 v)
{
	u32 sh = (off & 2) * 8;
	cfg_rmw(bdf, off, 0xffffu << sh, (u32)v << sh);
}

void pci_cfg_write8(u32 bdf, u32 off, u8 v)
{
	u32 sh = (off & 3) * 8;
	cfg_rmw(bdf, off, 0xffu << sh, (u32)v << sh);
}

void pci_read_bars(struct pci_dev *d)
{
	int nbars = (d->header_type & 0x7f) == 0 ? 6 : (d->header_type & 0x7f) == 1 ? 2 : 0;
	for (int i = 0; i < 6; i++) {
		d->bar[i] = 0;
		d->bar_io[i] = d->bar_64[i] = 0;
	}
	for (int i = 0; i < nbars; i++) {
		u32 lo = pci_cfg_read32(d->bdf, PCI_BAR0 + 4 * i);
		if (lo & 1) {
			d->bar_io[i] = 1;
			d->bar[i] = lo & ~3u;
		} else if (((lo >> 1) & 3) == 2 && i + 1 < nbars) {
			u32 hi = pci_cfg_read32(d->bdf, PCI_BAR0 + 4 * (i + 1));
			d->bar_64[i] = 1;
			d->bar[i] = ((u64)hi << 32) | (lo & ~0xfu);
			i++;
		} else {
			d->bar[i] = lo & ~0xfu;
		}
	}
}

int pci_probe(u32 bdf, struct pci_dev *d)
{
	u32 id = pci_cfg_read32(bdf, PCI_VENDOR_ID);
	if ((id & 0xffff) == 0xffff || (id & 0xffff) == 0)
		return -1;
	memset(d, 0, sizeof(*d));
	d->bdf = bdf;
	d->vendor = id & 0xffff;
	d->device = id >> 16;
	u32 cr = pci_cfg_read32(bdf, PCI_CLASS_REV);
	d->class_code = cr >> 24;
	d->subclass = cr >> 16;
	d->prog_if = cr >> 8;
	d->header_type = pci_cfg_read8(bdf, PCI_HEADER_TYPE);
	d->subsys_id = pci_cfg_read16(bdf, PCI_SUBSYS_ID);
	pci_read_bars(d);
	return 0;
}

int pci_scan(struct pci_dev *out, int max)
{
	int n = 0;
	for (u32 dev = 0; dev < 32; dev++) {
		for (u32 fn = 0; fn < 8; fn++) {
			struct pci_dev d;
			if (pci_probe(PCI_BDF(0, dev, fn), &d)) {
				if (fn == 0)
					break;
				continue;
			}
			if (n < max)
				out[n] = d;
			n++;
			if (fn == 0 && !(d.header_type & 0x80))
				break;	/* single-function device */
		}
	}
	return n < max ? n : max;
}

int pci_find(u16 vendor, u16 device, int index, struct pci_dev *d)
{
	struct pci_dev all[64];
	int n = pci_scan(all, 64);
	for (int i = 0; i < n; i++) {
		if (all[i].vendor == vendor && all[i].device == device && index-- == 0) {
			*d = all[i];
			return 0;
		}
	}
	return -1;
}

u64 pci_bar_size(struct pci_dev *d, int i)
{
	u32 off = PCI_BAR0 + 4 * i;
	u16 cmd = pci_cfg_read16(d->bdf, PCI_COMMAND);
	pci_cfg_write16(d->bdf, PCI_COMMAND, cmd & ~(PCI_CMD_IO | PCI_CMD_MEM));
	u32 lo = pci_cfg_read32(d->bdf, off);
	pci_cfg_write32(d->bdf, off, 0xffffffff);
	u32 slo = pci_cfg_read32(d->bdf, off);
	pci_cfg_write32(d->bdf, off, lo);
	u64 size;
	if (lo & 1) {
		size = (u16)~(slo & ~3u) + 1;
		if (!(slo & ~3u))
			size = 0;
	} else if (d->bar_64[i]) {
		u32 hi = pci_cfg_read32(d->bdf, off + 4);
		pci_cfg_write32(d->bdf, off + 4, 0xffffffff);
		u32 shi = pci_cfg_read32(d->bdf, off + 4);
		pci_cfg_write32(d->bdf, off + 4, hi);
		u64 m = ((u64)shi << 32) | (slo & ~0xfu);
		size = m ? ~m + 1 : 0;
	} else {
		u32 m = slo & ~0xfu;
		size = m ? (u32)(~m + 1) : 0;
	}
	pci_cfg_write16(d->bdf, PCI_COMMAND, cmd);
	return size;
}

int pci_assign_bars(struct pci_dev *d, u64 *window)
{
	int n = 0;
	for (int i = 0; i < 6; i++) {
		if (d->bar_io[i] || (d->bar[i] && d->bar[i] + 1 < (1ull << 32)))
			goto next;
		u64 size = pci_bar_size(d, i);
		if (!size || size > (1u << 30))
			goto next;
		u64 a = (*window + size - 1) & ~(size - 1);
		u16 cmd = pci_cfg_read16(d->bdf, PCI_COMMAND);
		pci_cfg_write16(d->bdf, PCI_COMMAND, cmd & ~PCI_CMD_MEM);
		pci_cfg_write32(d->bdf, PCI_BAR0 + 4 * i, (u32)a);
		if (d->bar_64[i])
			pci_cfg_write32(d->bdf, PCI_BAR0 + 4 * (i + 1), 0);
		pci_cfg_write16(d->bdf, PCI_COMMAND, cmd);
		*window = a + size;
		n++;
	next:
		if (d->bar_64[i])
			i++;
	}
	pci_read_bars(d);
	return n;
}

u8 pci_find_cap(u32 bdf, u8 id, u8 after)
{
	if (!(pci_cfg_read16(bdf, PCI_STATUS) & PCI_STATUS_CAP_LIST))
		return 0;
	u8 p = after ? pci_cfg_read8(bdf, after + 1) : pci_cfg_read8(bdf, PCI_CAP_PTR);
	for (int guard = 0; guard < 48 && p >= 0x40; guard++) {
		p &= 0xfc;
		u16 h = pci_cfg_read16(bdf, p);
		if ((h & 0xff) == id)
			return p;
		p = h >> 8;
	}
	return 0;
}

void pci_enable(struct pci_dev *d)
{
	u16 cmd = pci_cfg_read16(d->bdf, PCI_COMMAND);
	cmd |= PCI_CMD_MEM | PCI_CMD_MASTER | PCI_CMD_INTX_DISABLE;
	for (int i = 0; i < 6; i++)
		if (d->bar_io[i] && d->bar[i])
			cmd |= PCI_CMD_IO;
	pci_cfg_write16(d->bdf, PCI_COMMAND, cmd);
}

static u64 bar_addr(struct pci_dev *d, u32 bir, u32 off)
{
	if (bir > 5 || d->bar_io[bir] || !d->bar[bir])
		return 0;
	return d->bar[bir] + off;
}

void pci_msix_ctrl(struct pci_dev *d, u16 set, u16 clear)
{
	u16 ctl = pci_cfg_read16(d->bdf, d->msix_cap + 2);
	pci_cfg_write16(d->bdf, d->msix_cap + 2, (ctl & ~clear) | set);
}

int pci_msix_init(struct pci_dev *d)
{
	d->msix_cap = pci_find_cap(d->bdf, PCI_CAP_MSIX, 0);
	if (!d->msix_cap)
		return -1;
	u16 ctl = pci_cfg_read16(d->bdf, d->msix_cap + 2);
	d->msix_size = (ctl & 0x7ff) + 1;
	u32 t = pci_cfg_read32(d->bdf, d->msix_cap + 4);
	u32 p = pci_cfg_read32(d->bdf, d->msix_cap + 8);
	d->msix_table = bar_addr(d, t & 7, t & ~7u);
	d->msix_pba = bar_addr(d, p & 7, p & ~7u);
	if (!d->msix_table)
		return -1;
	/* enable with the function masked, mask every entry, unmask the function */
	pci_msix_ctrl(d, PCI_MSIX_ENABLE | PCI_MSIX_MASKALL, 0);
	for (int i = 0; i < d->msix_size; i++)
		pci_msix_mask(d, i, 1);
	pci_msix_ctrl(d, 0, PCI_MSIX_MASKALL);
	return 0;
}

void pci_msix_set(struct pci_dev *d, int entry, u32 apic_id, u8 vector)
{
	u64 e = d->msix_table + 16 * entry;
	mmio_write32(e + 0, 0xfee00000u | ((apic_id & 0xff) << 12));
	mmio_write32(e + 4, 0);
	mmio_write32(e + 8, vector);	/* fixed, edge */
}

void pci_msix_mask(struct pci_dev *d, int entry, int masked)
{
	u64 e = d->msix_table + 16 * entry + 12;
	u32 v = mmio_read32(e);
	mmio_write32(e, masked ? (v | 1) : (v & ~1u));
}

int pci_msix_pending(struct pci_dev *d, int entry)
{
	if (!d->msix_pba)
		return 0;
	return (mmio_read32(d->msix_pba + 4 * (entry / 32)) >> (entry % 32)) & 1;
}

int pci_msi_set(struct pci_dev *d, u8 cap, u64 addr, u32 data)
{
	if (!cap)
		return -1;
	u16 ctl = pci_cfg_read16(d->bdf, cap + 2);
	pci_cfg_write16(d->bdf, cap + 2, ctl & ~1u);	/* off while reprogramming */
	pci_cfg_write32(d->bdf, cap + 4, (u32)addr);
	if (ctl & 0x80) {				/* 64-bit address capable */
		pci_cfg_write32(d->bdf, cap + 8, addr >> 32);
		pci_cfg_write16(d->bdf, cap + 12, data);
	} else {
		pci_cfg_write16(d->bdf, cap + 8, data);
	}
	ctl &= ~0x70u;					/* one vector (MME = 0) */
	pci_cfg_write16(d->bdf, cap + 2, ctl | 1);
	return 0;
}
