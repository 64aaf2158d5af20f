/*
 * mb-lowmem: a multiboot v1 kernel (ELF32) linked in low memory, 0x1000 up
 * to about 0x7c00 (lib/x86/low.lds), as real-mode test kernels are. Checks:
 * its bss (which covers the boot information's usual place, 0x7000) is zero,
 * so nothing was written into it; none of the boot information (info block,
 * command line, memory map, loader name, modules) overlaps the image; the
 * memory map calls the image RAM; and a round trip through real mode reads
 * the multiboot header through a real-mode segment.
 * 32-bit CPL0 code, no kit library: prints on COM1, exits through port 0xf4.
 * Exit code 0 all good, 1 a check failed, 2 not started by a multiboot loader.
 */
typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

#define MB_BOOT_MAGIC 0x2BADB002u

extern u8 __image_start[], __image_end[];
extern const u32 mb_header[];
u32 realmode_read_header(void);
void mb_main(u32 magic, const u32 *info);

/* Zero at entry if the loader cleared bss and wrote nothing into it. */
u8 scratch[0x5400];
static int failed;

static inline void outb(u16 port, u8 v) { asm volatile("outb %0, %1" :: "a"(v), "Nd"(port)); }
static inline void outl(u16 port, u32 v) { asm volatile("outl %0, %1" :: "a"(v), "Nd"(port)); }

static void puts(const char *s)
{
	while (*s)
		outb(0x3f8, *s++);
}

static void puthex(u32 v)
{
	char b[11] = "0x";
	for (int i = 0; i < 8; i++)
		b[2 + i] = "0123456789abcdef"[(v >> (28 - 4 * i)) & 15];
	b[10] = 0;
	puts(b);
}

static u32 strlen(const char *s)
{
	u32 n = 0;
	while (s[n])
		n++;
	return n;
}

static void mb_exit(u32 code)
{
	outl(0xf4, code);
	for (;;)
		asm volatile("cli; hlt");
}

/* Reports [start, end) and fails if it overlaps the image. */
static void check_outside(const char *what, u32 start, u32 end)
{
	u32 is = (u32)__image_start, ie = (u32)__image_end;
	puts(" ");
	puts(what);
	puts("=");
	puthex(start);
	if (start < ie && end > is) {
		puts(" OVERLAPS-IMAGE");
		failed = 1;
	}
}

void mb_main(u32 magic, const u32 *info)
{
	u32 dirty = 0;
	for (u32 i = 0; i < sizeof(scratch); i++)
		dirty += ((volatile u8 *)scratch)[i] != 0;

	puts("mb-lowmem: image=");
	puthex((u32)__image_start);
	puts("-");
	puthex((u32)__image_end);
	puts(" bss_dirty_bytes=");
	puthex(dirty);
	puts("\n");
	if (magic != MB_BOOT_MAGIC) {
		puts("mb-lowmem: eax=");
		puthex(magic);
		puts(", not the multiboot magic\n");
		mb_exit(2);
	}
	if (dirty)
		failed = 1;

	u32 flags = info[0];
	puts("mb-lowmem: flags=");
	puthex(flags);
	check_outside("info", (u32)info, (u32)info + 88);
	if (flags & (1 << 2)) {
		const char *c = (const char *)info[4];
		check_outside("cmdline", (u32)c, (u32)c + strlen(c) + 1);
	}
	if (flags & (1 << 9)) {
		const char *n = (const char *)info[16];
		check_outside("loader", (u32)n, (u32)n + strlen(n) + 1);
		puts(" \"");
		puts(n);
		puts("\"");
	}
	if (flags & (1 << 3)) {
		const u32 *mods = (const u32 *)info[6];
		check_outside("mods", (u32)mods, (u32)mods + 16 * info[5]);
		for (u32 i = 0; i < info[5]; i++)
			check_outside("module", mods[4 * i], mods[4 * i + 1]);
	}
	int image_in_ram = 0;
	if (flags & (1 << 6)) {
		u32 addr = info[12], len = info[11];
		check_outside("mmap", addr, addr + len);
		for (u32 off = 0; off < len;) {
			const u32 *e = (const u32 *)(addr + off);
			u64 base = e[1] | (u64)e[2] << 32, size = e[3] | (u64)e[4] << 32;
			if (e[5] == 1 && base <= (u32)__image_start &&
			    base + size >= (u32)__image_end)
				image_in_ram = 1;
			off += e[0] + 4;
		}
	}
	puts("\n");
	if (!image_in_ram) {
		puts("mb-lowmem: the memory map does not call the image RAM\n");
		failed = 1;
	}
	if (!(flags & 1) || info[1] < 600) {
		puts("mb-lowmem: mem_lower missing or small\n");
		failed = 1;
	}

	u32 rm = realmode_read_header();
	puts("mb-lowmem: real mode read ");
	puthex(rm);
	puts(" at 0100:");
	puthex((u32)mb_header - 0x1000);
	puts("\n");
	if (rm != mb_header[0])
		failed = 1;

	puts(failed ? "mb-lowmem: FAILED\n" : "mb-lowmem: ok\n");
	mb_exit(failed);
}
