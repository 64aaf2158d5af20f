/*
 * acpi-pm: the ACPI fixed hardware of a full FADT. Prints the FADT's PM1a
 * event and control blocks, PM timer, SCI and FACS; checks SCI_EN (ACPI
 * mode); reads the PM timer `reads` times back to back (it must never go
 * backwards) and across `ms` TSC-milliseconds (3.579545 MHz is 3579.545
 * ticks per ms; the check accepts 2500-5000; `check_rate=0` reports without
 * checking, for VMMs where the TSC frequency is only the guest's own PIT
 * estimate, which a loaded host skews). Then, with `sleep=s5`, writes
 * the DSDT's \_S5_ SLP_TYP with SLP_EN to PM1a_CNT: the machine must power
 * off. With `sleep=N` it writes SLP_TYP=N|SLP_EN, a sleep state the platform
 * may refuse, and reports that it is still running.
 * Exit: 0 checks passed; 1 a check failed; 2 no FADT, PM blocks or \_S5_;
 * 3 still running 100 ms after writing S5.
 */
#include "libcflat.h"

#define SLP_EN (1 << 13)
#define TMR_VAL_EXT (1 << 8)
#define HW_REDUCED (1 << 20)

static u32 fadt_u32(const u8 *f, u32 off) { return *(const u32 *)(f + off); }

/* SLP_TYPa of \_S5_: NameOp "_S5_" PackageOp PkgLength NumElements, then
 * the first element as ZeroOp, OneOp or BytePrefix n. */
static int dsdt_s5(const u8 *dsdt, u32 *typ)
{
	u32 len = *(const u32 *)(dsdt + 4);
	for (u32 i = 36; i + 9 <= len; i++) {
		if (memcmp(dsdt + i, "_S5_", 4) || dsdt[i + 4] != 0x12)
			continue;
		const u8 *p = dsdt + i + 5;
		p += 1 + (*p >> 6);	/* PkgLength: lead byte + bytes it announces */
		p++;			/* NumElements */
		if (*p == 0x0a)
			*typ = p[1];
		else if (*p <= 1)
			*typ = *p;
		else
			continue;
		return 1;
	}
	return 0;
}

static void spin_ms(u64 ms)
{
	u64 khz = tsc_khz() ? tsc_khz() : 1000000, t0 = rdtsc();
	while (rdtsc() - t0 < khz * ms)
		cpu_relax();
}

int main(void)
{
	const u8 *fadt = acpi_find_table("FACP");
	if (!fadt) {
		printf("acpi-pm: no FADT\n");
		return 2;
	}
	u32 flags = fadt_u32(fadt, 112), len = fadt_u32(fadt, 4);
	u32 evt = fadt_u32(fadt, 56), cnt = fadt_u32(fadt, 64), tmr = fadt_u32(fadt, 76);
	u64 facs = fadt_u32(fadt, 36);
	if (!facs && len >= 140)
		facs = *(const u64 *)(fadt + 132);
	u64 dsdt = len >= 148 && *(const u64 *)(fadt + 140) ? *(const u64 *)(fadt + 140)
							      : fadt_u32(fadt, 40);
	int ext = !!(flags & TMR_VAL_EXT);
	printf("acpi-pm: pm1a_evt=%#x pm1a_cnt=%#x pm_tmr=%#x tmr_len=%u ext=%d sci=%u "
	       "hw_reduced=%d facs=%#lx facs_sig=%s\n",
	       evt, cnt, tmr, fadt[91], ext, *(const u16 *)(fadt + 46),
	       !!(flags & HW_REDUCED), facs,
	       facs && !memcmp((const void *)facs, "FACS", 4) ? "ok" : "MISSING");
	if (!evt || !cnt || !tmr || (flags & HW_REDUCED))
		return 2;

	int failed = 0;
	u32 sci_en = inw(cnt) & 1;
	if (!sci_en)
		failed = 1;

	u32 mask = ext ? 0xffffffffu : 0xffffffu;
	u64 reads = param_u64("reads", 1000), backwards = 0;
	u32 prev = inl(tmr) & mask;
	for (u64 i = 0; i < reads; i++) {
		u32 cur = inl(tmr) & mask;
		if (((cur - prev) & mask) > mask / 2)
			backwards++;
		prev = cur;
	}
	char rate[32] = "unknown";
	u64 khz = tsc_khz();
	if (khz) {
		u64 ms = param_u64("ms", 50);
		u64 t0 = rdtsc();
		u32 p0 = inl(tmr);
		while (rdtsc() - t0 < khz * ms)
			cpu_relax();
		u32 p1 = inl(tmr);
		u64 t1 = rdtsc();
		u64 ticks = (p1 - p0) & mask;
		u64 tsc_us = (t1 - t0) * 1000 / khz;
		u64 per_ms_milli = ticks * 1000000 / (tsc_us ? tsc_us : 1);
		fmt_milli(rate, per_ms_milli);
		if (param_u64("check_rate", 1) &&
		    (per_ms_milli < 2500000 || per_ms_milli > 5000000))
			failed = 1;
	}
	if (backwards)
		failed = 1;
	printf("acpi-pm: sci_en=%u timer reads=%lu backwards=%lu ticks_per_tsc_ms=%s (tsc %s)\n",
	       sci_en, reads, backwards, rate, tsc_khz_source());

	const char *sleep = param_str("sleep", "");
	if (!strcmp(sleep, "s5")) {
		u32 typ;
		if (!dsdt || !dsdt_s5((const u8 *)dsdt, &typ)) {
			printf("acpi-pm: no \\_S5_ in the DSDT\n");
			return 2;
		}
		printf("acpi-pm: writing SLP_TYP=%u|SLP_EN to %#x (S5)\n", typ, cnt);
		outw(cnt, (typ << 10) | SLP_EN);
		spin_ms(100);
		printf("acpi-pm: still running after S5\n");
		return 3;
	}
	if (*sleep) {
		u32 typ = param_u64("sleep", 0) & 7;
		printf("acpi-pm: writing SLP_TYP=%u|SLP_EN to %#x\n", typ, cnt);
		outw(cnt, (typ << 10) | SLP_EN);
		spin_ms(10);
		printf("acpi-pm: still running after SLP_TYP=%u\n", typ);
	}
	printf("acpi-pm: %s\n", failed ? "FAILED" : "ok");
	return failed;
}
