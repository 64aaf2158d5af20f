/*
 * TSC frequency: "tsc_khz=" on the command line, else Lucid's TSC_KHZ
 * hypercall, else a ~10 ms calibration against PIT channel 2 (ports
 * 0x42/0x43/0x61, gate on, speaker off, mode 0, poll OUT2 in port 0x61);
 * where port 0x61 is absent (QEMU microvm), PIT channel 0 read back.
 */
#include "libcflat.h"

static u64 khz;
static const char *source = "none";
static int done;

#define PIT_HZ 1193182
#define CAL_TICKS 11932			/* 10 ms */

/* channel 2, gated through port 0x61, OUT2 polled in port 0x61 bit 5 */
static u64 pit_calibrate_ch2(void)
{
	u8 p61 = inb(0x61);

	if (p61 == 0xff)			/* no port 0x61 (e.g. QEMU microvm) */
		return 0;
	outb(0x61, (p61 & ~0x02) | 0x01);	/* gate 2 on, speaker off */
	outb(0x43, 0xb0);			/* ch 2, lo/hi byte, mode 0, binary */
	outb(0x42, CAL_TICKS & 0xff);
	outb(0x42, CAL_TICKS >> 8);
	u64 t0 = rdtsc();
	if (inb(0x61) & 0x20)			/* OUT2 already high: no PIT */
		goto fail;
	for (u32 n = 0; n < 200000; n++) {
		if (inb(0x61) & 0x20) {
			u64 t1 = rdtsc();
			outb(0x61, p61);
			return (t1 - t0) * PIT_HZ / ((u64)CAL_TICKS * 1000);
		}
	}
fail:
	outb(0x61, p61);
	return 0;
}

static u32 pit_read_ch0(void)
{
	outb(0x43, 0x00);			/* latch channel 0 */
	u32 lo = inb(0x40);
	return lo | (u32)inb(0x40) << 8;
}

/* without port 0x61: channel 0 in mode 0 from 0xffff, read back by latching
 * (its IRQ 0 reaches nothing: LINT0 and the IOAPIC pins are masked) */
static u64 pit_calibrate_ch0(void)
{
	outb(0x43, 0x30);			/* ch 0, lo/hi byte, mode 0, binary */
	outb(0x40, 0xff);
	outb(0x40, 0xff);
	u32 c0 = pit_read_ch0();
	u64 t0 = rdtsc();
	if (c0 == 0xffff && pit_read_ch0() == 0xffff)
		return 0;			/* not counting: no PIT */
	for (u32 n = 0; n < 100000; n++) {
		u32 c = pit_read_ch0();
		u64 t1 = rdtsc();
		if (c > c0)
			return 0;		/* wrapped: can't be, give up */
		if (c0 - c >= CAL_TICKS)
			return (t1 - t0) * PIT_HZ / ((u64)(c0 - c) * 1000);
	}
	return 0;
}

static u64 pit_calibrate(void)
{
	u64 k = pit_calibrate_ch2();
	return k ? k : pit_calibrate_ch0();
}

u64 tsc_khz(void)
{
	if (done)
		return khz;
	done = 1;
	if ((khz = param_u64("tsc_khz", 0))) {
		source = "param";
	} else if (lucid_present() && (khz = lucid_hypercall(LUCID_HC_TSC_KHZ, 0, 0, 0))) {
		source = "lucid";
	} else if ((khz = pit_calibrate())) {
		source = "pit";
	}
	return khz;
}

const char *tsc_khz_source(void)
{
	tsc_khz();
	return source;
}

u64 tsc_to_ns(u64 t)
{
	u64 k = tsc_khz();
	if (!k)
		return 0;
	/* t * 1e6 / k without overflowing for t up to ~1.8e13 */
	if (t < (~0UL) / 1000000)
		return t * 1000000 / k;
	return t / k * 1000000;
}

void udelay(u64 us)
{
	u64 k = tsc_khz();
	if (!k)
		k = 3000000;		/* unknown: assume 3 GHz */
	u64 end = rdtsc() + us * k / 1000;
	while ((s64)(rdtsc() - end) < 0)
		cpu_relax();
}

const char *fmt_milli(char *buf, u64 v)
{
	snprintf(buf, 32, "%lu.%03lu", v / 1000, v % 1000);
	return buf;
}
