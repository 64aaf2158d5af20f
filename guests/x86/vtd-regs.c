/*
 * vtd-regs: read every VT-d register, check that VER/CAP/ECAP are sane and
 * that read-only registers survive writes, then read registers in a loop
 * so that the VMM can count exits per access (samecore: one per access;
 * sidecore: none on page 0, one per access on the FRO/IRO page).
 *
 * Params: reads=10000 (loop length), loop=both|page0|frcd|none (page0: GSTS;
 * frcd: the first fault-recording register's high half, at CAP.FRO),
 * settle_ms=100 (how long a read-only register may take to read back its
 * value after a write: a sidecore re-asserts it), ro=VER,CAP,ECAP,GSTS,IQH
 * (the read-only registers written).
 *
 * Prints "vtd-regs <NAME>=<value>" per register, "vtd-regs check <what>:
 * ok|BAD ...", "vtd-regs loop reg=.. off=.. page=P reads=N tsc_per_read=T
 * ns_per_read=X" and "vtd-regs: ok|FAILED (B bad)". Exit 0 ok, 1 a check
 * failed, 2 no VT-d.
 */
#include "libcflat.h"
#include "vtd.h"

static int bad;

static char detail[96];

/* prints the check with the text left in `detail` */
static void check(const char *what, int ok)
{
	printf("vtd-regs check %s: %s %s\n", what, ok ? "ok" : "BAD", detail);
	bad += !ok;
}
#define D(...) snprintf(detail, sizeof(detail), __VA_ARGS__)

struct reg {
	const char *name;
	u32 off;
	int size;
};

static const struct reg regs[] = {
	{ "VER", VTD_VER, 4 }, { "CAP", VTD_CAP, 8 }, { "ECAP", VTD_ECAP, 8 },
	{ "GCMD", VTD_GCMD, 4 }, { "GSTS", VTD_GSTS, 4 }, { "RTADDR", VTD_RTADDR, 8 },
	{ "CCMD", VTD_CCMD, 8 }, { "FSTS", VTD_FSTS, 4 }, { "FECTL", VTD_FECTL, 4 },
	{ "FEDATA", VTD_FEDATA, 4 }, { "FEADDR", VTD_FEADDR, 4 }, { "FEUADDR", VTD_FEUADDR, 4 },
	{ "AFLOG", VTD_AFLOG, 8 }, { "PMEN", VTD_PMEN, 4 }, { "PLMBASE", VTD_PLMBASE, 4 },
	{ "PLMLIMIT", VTD_PLMLIMIT, 4 }, { "PHMBASE", VTD_PHMBASE, 8 },
	{ "PHMLIMIT", VTD_PHMLIMIT, 8 }, { "IQH", VTD_IQH, 8 }, { "IQT", VTD_IQT, 8 },
	{ "IQA", VTD_IQA, 8 }, { "ICS", VTD_ICS, 4 }, { "IECTL", VTD_IECTL, 4 },
	{ "IEDATA", VTD_IEDATA, 4 }, { "IEADDR", VTD_IEADDR, 4 }, { "IEUADDR", VTD_IEUADDR, 4 },
	{ "IRTA", VTD_IRTA, 8 },
};

static u64 rd(u32 off, int size)
{
	return size == 8 ? vtd_read64(off) : vtd_read32(off);
}

static void wr(u32 off, int size, u64 v)
{
	if (size == 8)
		vtd_write64(off, v);
	else
		vtd_write32(off, v);
}

/* write ~v (and then v's complement of all ones) into a read-only register
 * and wait up to settle for it to read v again; returns microseconds
 * taken, or -1 if it never did */
static s64 ro_survives(u32 off, int size, u64 v, u64 settle)
{
	wr(off, size, ~v);
	wr(off, size, size == 8 ? ~0ul : 0xffffffffu);
	if (rd(off, size) == v)
		return 0;
	u64 t0 = rdtsc();
	for (;;) {
		if (rd(off, size) == v)
			return tsc_to_ns(rdtsc() - t0) / 1000;
		if (rdtsc() - t0 > settle)
			return -1;
		cpu_relax();
	}
}

/* name is one of the comma-separated words of list */
static void loop(const char *name, u32 off, u64 n)
{
	u64 t0 = rdtsc();
	for (u64 i = 0; i < n; i++)
		(void)vtd_read32(off);
	u64 t = rdtsc() - t0;
	char b[32];
	printf("vtd-regs loop reg=%s off=%#x page=%u reads=%lu tsc_per_read=%lu ns_per_read=%s\n",
	       name, off, off >> 12, n, n ? t / n : 0,
	       n && tsc_khz() ? fmt_milli(b, tsc_to_ns(t) * 1000 / n) : "unknown");
}

int main(void)
{
	if (vtd_probe())
		return 2;
	u64 settle = param_u64("settle_ms", 100) * (tsc_khz() ? tsc_khz() : 3000000);

	for (u32 i = 0; i < ARRAY_SIZE(regs); i++)
		printf("vtd-regs %s=%#lx\n", regs[i].name, rd(regs[i].off, regs[i].size));
	printf("vtd-regs IVA=%#lx IOTLB=%#lx (at %#x)\n", vtd_read64(vtd.iro + VTD_IVA),
	       vtd_read64(vtd.iro + VTD_IOTLB), vtd.iro);
	for (u32 i = 0; i < vtd.nfr && i < 16; i++)
		printf("vtd-regs FRCD%u=%#lx:%#lx (at %#x)\n", i, vtd_read64(vtd.fro + 16 * i + 8),
		       vtd_read64(vtd.fro + 16 * i), vtd.fro + 16 * i);

	u32 major = (vtd.ver >> 4) & 0xf;
	D("major=%u minor=%u", major, vtd.ver & 0xf);
	check("version", major >= 1 && major <= 7);
	D("sagaw=%#lx", VTD_CAP_SAGAW(vtd.cap));
	check("sagaw", (VTD_CAP_SAGAW(vtd.cap) & 6) != 0);
	u64 mgaw = VTD_CAP_MGAW(vtd.cap);
	D("mgaw=%lu levels=%d", mgaw, vtd.levels);
	check("mgaw", mgaw >= 39 && mgaw <= 57);
	D("nd=%lu (%lu domain-id bits)", VTD_CAP_ND(vtd.cap), 4 + 2 * VTD_CAP_ND(vtd.cap));
	check("nd", VTD_CAP_ND(vtd.cap) <= 6);
	/* both blocks past the architectural registers we use (0x00-0xbf) */
	D("fro=%#x nfr=%u", vtd.fro, vtd.nfr);
	check("fro", vtd.fro >= 0xc0 && !(vtd.fro & 15) && vtd.fro + 16 * vtd.nfr <= 0x2000);
	D("iro=%#x", vtd.iro);
	check("iro", vtd.iro >= 0xc0 && !(vtd.iro & 15) && vtd.iro + 16 <= 0x2000);
	D("iro=%#x fro=%#x", vtd.iro, vtd.fro);
	check("fro-iro-apart", vtd.iro + 16 <= vtd.fro || vtd.fro + 16 * vtd.nfr <= vtd.iro);
	D("ecap=%#lx", vtd.ecap);
	check("qi", VTD_ECAP_QI(vtd.ecap));
	D("cm=%d", vtd.cm);
	check("caching-mode", 1);
	D("ir=%lu eim=%lu", VTD_ECAP_IR(vtd.ecap), VTD_ECAP_EIM(vtd.ecap));
	check("ir", 1);
	u32 gsts = vtd_read32(VTD_GSTS);
	D("gsts=%#x", gsts);
	check("gsts-at-reset", !(gsts & (VTD_GCMD_TE | VTD_GCMD_QIE | VTD_GCMD_IRE)));

	/* read-only registers: VER, CAP, ECAP, GSTS, IQH (QI off: 0) */
	u64 iqh = vtd_read64(VTD_IQH);
	const struct { const char *n; u32 off; int size; u64 v; } ro[] = {
		{ "VER", VTD_VER, 4, vtd.ver }, { "CAP", VTD_CAP, 8, vtd.cap },
		{ "ECAP", VTD_ECAP, 8, vtd.ecap }, { "GSTS", VTD_GSTS, 4, gsts },
		{ "IQH", VTD_IQH, 8, iqh },
	};
	const char *ro_list = param_str("ro", "VER,CAP,ECAP,GSTS,IQH");
	for (u32 i = 0; i < ARRAY_SIZE(ro); i++) {
		if (!list_has(ro_list, ro[i].n))
			continue;
		s64 us = ro_survives(ro[i].off, ro[i].size, ro[i].v, settle);
		char what[32];
		snprintf(what, sizeof(what), "read-only-%s", ro[i].n);
		if (us > 0)
			D("restored after %ld us", us);
		else
			D("%s", us ? "CHANGED" : "unchanged");
		check(what, us >= 0);
	}

	/* the unit still works after all that */
	int set_ok = vtd_set_root() == 0;
	D("gsts=%#x", vtd_read32(VTD_GSTS));
	check("srtp-after-writes", set_ok);

	u64 n = param_u64("reads", 10000);
	const char *which = param_str("loop", "both");
	if (!strcmp(which, "both") || !strcmp(which, "page0"))
		loop("GSTS", VTD_GSTS, n);
	if (!strcmp(which, "both") || !strcmp(which, "frcd"))
		loop("FRCD0.hi", vtd.fro + 12, n);
	printf("vtd-regs: %s (%d bad)\n", bad ? "FAILED" : "ok", bad);
	return bad ? 1 : 0;
}
