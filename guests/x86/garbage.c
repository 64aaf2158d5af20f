/*
 * garbage: a hostile guest. Writes pseudo-random values (1, 2 or 4 bytes)
 * to every I/O port 0..0xffff and reads each back, then writes and reads
 * one address per stride=S (0x10000) bytes across the MMIO hole
 * 0xc0000000-0xffffffff. Prints "garbage: survived" and exits 0.
 * Skipped ports, each documented:
 *   0xf4-0xf7  the exit device (a write would end the run)
 *   0x64       i8042: 0xfe pulses the reset line
 *   0x92       port A: bit 0 is a fast reset
 *   0xcf9      reset control register (PIIX/ICH)
 *   the FADT's PM1a control block (0x604-0x605 under Lucid and q35):
 *              SLP_TYP|SLP_EN powers the machine off
 *   0x510-0x51b QEMU fw_cfg (its DMA register writes guest memory), only
 *              when not running under Lucid
 * The UART is reset afterwards (garbage may set DLAB or loopback) and the
 * console shows some garbage bytes. Params: ports=0 / mmio=0 to skip a part,
 * port_first/port_last (0/0xffff), stride, seed=N.
 */
#include "libcflat.h"

static u64 rng = 0x9e3779b97f4a7c15UL;

static u32 next(void)
{
	rng ^= rng << 13;
	rng ^= rng >> 7;
	rng ^= rng << 17;
	return rng >> 16;
}

static const struct { u32 first, last; int qemu_only; } skip[] = {
	{ 0xf4, 0xf7, 0 }, { 0x64, 0x64, 0 }, { 0x92, 0x92, 0 }, { 0xcf9, 0xcf9, 0 },
	{ 0x510, 0x51b, 1 },
};

/* the FADT's PM1a control block, [pm1a_cnt, pm1a_cnt + len) */
static u32 pm1a_cnt, pm1a_cnt_len;

/* does an access of size bytes at port p touch a skipped port? */
static int skip_port(u32 p, u32 size, int lucid)
{
	for (u32 i = 0; i < ARRAY_SIZE(skip); i++)
		if (p <= skip[i].last && p + size - 1 >= skip[i].first &&
		    !(lucid && skip[i].qemu_only))
			return 1;
	return pm1a_cnt_len && p < pm1a_cnt + pm1a_cnt_len && p + size > pm1a_cnt;
}

int main(void)
{
	int lucid = lucid_present();
	u64 stride = param_u64("stride", 0x10000);
	u64 ports = 0, mmios = 0;
	u32 sink = 0;

	rng ^= param_u64("seed", 1);
	const u8 *fadt = acpi_find_table("FACP");
	if (fadt) {
		pm1a_cnt = *(const u32 *)(fadt + 64);
		pm1a_cnt_len = fadt[89];
	}
	printf("garbage: writing to every I/O port and across the MMIO hole\n");
	if (param_u64("ports", 1)) {
		u32 first = param_u64("port_first", 0), last = param_u64("port_last", 0xffff);
		for (u32 p = first; p <= last && p <= 0xffff; p++) {
			u32 v = next();
			u32 size = (v & 3) == 0 ? 2 : (v & 3) == 1 ? 4 : 1;
			if (p + size - 1 > 0xffff)	/* stay inside the port space */
				v |= 2, size = 1;
			if (skip_port(p, size, lucid))
				continue;
			switch (v & 3) {
			case 0: outw(p, v >> 8); sink += inw(p); break;
			case 1: outl(p, v); sink += inl(p); break;
			default: outb(p, v >> 8); sink += inb(p); break;
			}
			ports++;
		}
	}
	serial_reset();
	printf("\ngarbage: %lu ports done\n", ports);
	if (param_u64("mmio", 1) && stride) {
		for (u64 a = 0xc0000000UL; a < 0x100000000UL; a += stride) {
			u32 v = next();
			mmio_write32(a, v);
			sink += mmio_read32(a);
			mmios++;
		}
	}
	serial_reset();
	printf("\ngarbage: %lu mmio addresses done (sink %#x)\n", mmios, sink);
	printf("garbage: survived\n");
	return 0;
}
