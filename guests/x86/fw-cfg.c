/*
 * fw-cfg: reads QEMU's fw_cfg as a guest written for QEMU does: the
 * selector at 0x510, the data port at 0x511, the DMA interface at 0x514.
 *
 * Params: cpus (expected FW_CFG_NB_CPUS; default: the MADT's CPU count),
 * ram_mib (expected FW_CFG_RAM_SIZE in MiB; default: not checked),
 * bad_addr=0x7f00000000 (a DMA destination outside RAM: the transfer must
 * end with the error bit).
 *
 * Checks: the signature "QEMU"; the ID has the DMA bit; the DMA signature
 * "QEMU CFG" at 0x514; NB_CPUS = MAX_CPUS = cpus; CMDLINE_SIZE/DATA are the
 * command line this guest booted with; the file directory (read with one
 * `rep insb`) lists etc/e820, whose RAM adds up to RAM_SIZE; a DMA read of
 * etc/e820 (select + read) equals the port read and clears the control
 * word; a DMA read to bad_addr and a DMA write end with the error bit; the
 * DSDT has the QEMU0002 device.
 *
 * Prints "fw-cfg: file key=K size=S name=N" per file, then "fw-cfg: sig=ok
 * id=I dma_sig=ok|BAD cpus=N max_cpus=M ram_mib=R cmdline=ok|BAD files=F
 * e820=ok|BAD dma=ok|BAD dma_bad=error|BAD dma_write=error|BAD acpi=ok|BAD".
 * Exit 0; 1 a check failed; 2 no fw_cfg (no signature).
 */
#include "libcflat.h"

#define FW_CFG_SEL	0x510
#define FW_CFG_DATA	0x511
#define FW_CFG_DMA	0x514

#define KEY_SIGNATURE	0x00
#define KEY_ID		0x01
#define KEY_RAM_SIZE	0x03
#define KEY_NB_CPUS	0x05
#define KEY_MAX_CPUS	0x0f
#define KEY_CMDLINE_SIZE 0x14
#define KEY_CMDLINE_DATA 0x15
#define KEY_FILE_DIR	0x19

#define DMA_ERROR	0x01
#define DMA_READ	0x02
#define DMA_SELECT	0x08
#define DMA_WRITE	0x10

struct dma_access {
	u32 control, length;
	u64 address;
} __attribute__((packed, aligned(16)));

struct file_entry {
	u32 size;
	u16 select, reserved;
	char name[56];
} __attribute__((packed));

static struct dma_access acc;
static u8 dir[4 + 64 * 64];
static u8 e820_pio[20 * 32], e820_dma[20 * 32];
static char cmdline[4096];

static u32 be32(u32 v) { return __builtin_bswap32(v); }
static u16 be16(u16 v) { return __builtin_bswap16(v); }

static void select(u16 key) { outw(FW_CFG_SEL, key); }

static void read_bytes(void *buf, u64 n)
{
	u8 *p = buf;
	for (u64 i = 0; i < n; i++)
		p[i] = inb(FW_CFG_DATA);
}

/* one string instruction: the VMM sees it as one exit of many elements */
static void read_rep(void *buf, u64 n)
{
	asm volatile("rep insb" : "+D"(buf), "+c"(n) : "d"(FW_CFG_DATA) : "memory");
}

static u64 read_le(u16 key, int n)
{
	u64 v = 0;
	select(key);
	read_bytes(&v, n);
	return v;
}

/* runs one DMA transfer; returns the control word the device stored back */
static u32 dma(u32 control, u32 len, u64 addr)
{
	acc.control = be32(control);
	acc.length = be32(len);
	acc.address = __builtin_bswap64(addr);
	u64 a = (u64)&acc;
	outl(FW_CFG_DMA, be32(a >> 32));
	outl(FW_CFG_DMA + 4, be32((u32)a));
	return be32(*(volatile u32 *)&acc.control);
}

static int dsdt_has(const char *s)
{
	const u8 *fadt = acpi_find_table("FACP");
	if (!fadt)
		return 0;
	const u8 *dsdt = (const u8 *)*(const u64 *)(fadt + 140);
	if (!dsdt)
		dsdt = (const u8 *)(u64)*(const u32 *)(fadt + 40);
	u32 len = *(const u32 *)(dsdt + 4);
	size_t n = strlen(s);
	for (u32 i = 0; i + n <= len; i++)
		if (!memcmp(dsdt + i, s, n))
			return 1;
	return 0;
}

int main(void)
{
	int bad = 0;
	char sig[5] = {0};
	select(KEY_SIGNATURE);
	read_bytes(sig, 4);
	if (memcmp(sig, "QEMU", 4)) {
		printf("fw-cfg: no fw_cfg (signature %02x %02x %02x %02x)\n", (u8)sig[0],
		       (u8)sig[1], (u8)sig[2], (u8)sig[3]);
		return 2;
	}
	u32 id = read_le(KEY_ID, 4);
	char dsig[9] = {0};
	for (int i = 0; i < 8; i++)
		dsig[i] = inb(FW_CFG_DMA + i);
	int dsig_ok = !memcmp(dsig, "QEMU CFG", 8);
	bad |= !(id & 2) || !dsig_ok;

	u32 ids[64];
	int madt = acpi_madt_cpus(ids, 64);
	u64 want_cpus = param_u64("cpus", madt > 0 ? (u64)madt : 1);
	u64 cpus = read_le(KEY_NB_CPUS, 2), max_cpus = read_le(KEY_MAX_CPUS, 2);
	bad |= cpus != want_cpus || max_cpus != want_cpus;
	u64 ram = read_le(KEY_RAM_SIZE, 8);
	if (param_present("ram_mib"))
		bad |= ram != param_u64("ram_mib", 0) << 20;

	u32 clen = read_le(KEY_CMDLINE_SIZE, 4);
	int cmdline_ok = 0;
	if (clen > 0 && clen <= sizeof(cmdline)) {
		select(KEY_CMDLINE_DATA);
		read_bytes(cmdline, clen);
		cmdline_ok = cmdline[clen - 1] == 0 && !strcmp(cmdline, boot_cmdline());
	}
	bad |= !cmdline_ok;

	select(KEY_FILE_DIR);
	read_rep(dir, 4);
	u32 files = be32(*(u32 *)dir);
	if (files > 64)
		files = 64;
	read_rep(dir + 4, files * 64);
	const struct file_entry *e820 = NULL;
	for (u32 i = 0; i < files; i++) {
		const struct file_entry *f = (const void *)(dir + 4 + 64 * i);
		printf("fw-cfg: file key=%#x size=%u name=%s\n", be16(f->select), be32(f->size),
		       f->name);
		if (!strcmp(f->name, "etc/e820"))
			e820 = f;
	}

	int e820_ok = 0, dma_ok = 0;
	u32 esize = e820 ? be32(e820->size) : 0;
	if (e820 && esize % 20 == 0 && esize <= sizeof(e820_pio)) {
		select(be16(e820->select));
		read_bytes(e820_pio, esize);
		u64 total = 0;
		for (u32 off = 0; off < esize; off += 20)
			if (*(u32 *)(e820_pio + off + 16) == 1)
				total += *(u64 *)(e820_pio + off + 8);
		e820_ok = esize > 0 && total == ram;
		memset(e820_dma, 0xaa, sizeof(e820_dma));
		u32 ctl = ((u32)be16(e820->select) << 16) | DMA_SELECT | DMA_READ;
		u32 r = dma(ctl, esize, (u64)e820_dma);
		dma_ok = r == 0 && !memcmp(e820_pio, e820_dma, esize) && e820_dma[esize] == 0xaa;
	}
	bad |= !e820_ok || !dma_ok;

	u64 bad_addr = param_u64("bad_addr", 0x7f00000000ull);
	u32 r = dma(((u32)KEY_SIGNATURE << 16) | DMA_SELECT | DMA_READ, 4, bad_addr);
	int dma_bad_ok = r == DMA_ERROR;
	r = dma(DMA_WRITE, 4, (u64)e820_dma);
	int dma_write_ok = r == DMA_ERROR;
	bad |= !dma_bad_ok || !dma_write_ok;
	int acpi_ok = dsdt_has("QEMU0002");
	bad |= !acpi_ok;

	printf("fw-cfg: sig=ok id=%#x dma_sig=%s cpus=%lu max_cpus=%lu ram_mib=%lu cmdline=%s "
	       "files=%u e820=%s dma=%s dma_bad=%s dma_write=%s acpi=%s\n",
	       id, dsig_ok ? "ok" : "BAD", cpus, max_cpus, ram >> 20, cmdline_ok ? "ok" : "BAD",
	       files, e820_ok ? "ok" : "BAD", dma_ok ? "ok" : "BAD",
	       dma_bad_ok ? "error" : "BAD", dma_write_ok ? "error" : "BAD",
	       acpi_ok ? "ok" : "BAD");
	return bad ? 1 : 0;
}
