#!/usr/bin/env python3
"""Writes the seeds of the register-level fuzz targets (pci_config, virtio_pci, virtqueue) in the
16-byte access encoding of fuzz/src/lib.rs. Run from fuzz/: python3 seeds/make.py"""
import os
import struct


def acc(kind, size=4, write=False, sel=0, addr=0, val=0):
    flags = {1: 0, 2: 1, 4: 2, 8: 3}[size] | (4 if write else 0)
    return struct.pack("<BBHIQ", kind, flags, sel, addr & 0xffffffff, val & (2**64 - 1))


def save(target, name, records):
    os.makedirs(f"seeds/{target}", exist_ok=True)
    with open(f"seeds/{target}/{name}", "wb") as f:
        f.write(b"".join(records))


# pci_config: kind 0 = CF8 write, 1 = port 0xCF8 + sel, 2 = ECAM at addr, 3 = BAR sel of dev sel>>8.
def cf8(slot, reg):
    return acc(0, write=True, val=0x8000_0000 | slot << 11 | reg)


def cfc_read(size=4, byte=0):
    return acc(1, size=size, sel=4 + byte)


def cfc_write(val, size=4, byte=0):
    return acc(1, size=size, write=True, sel=4 + byte, val=val)


def ecam(slot, reg, size=4, write=False, val=0):
    return acc(2, size=size, write=write, addr=slot << 15 | reg, val=val)


# A firmware's enumeration through 0xCF8/0xCFC: IDs, then each BAR sized and programmed.
enum = []
for slot in range(4):
    enum += [cf8(slot, 0), cfc_read()]
for slot in (1, 2):
    for bar in range(6):
        enum += [cf8(slot, 0x10 + 4 * bar), cfc_write(0xffffffff), cfc_read(),
                 cfc_write(0xc0800000 + 0x100000 * bar + 0x200000 * slot)]
    enum += [cf8(slot, 0x04), cfc_write(0x0007, size=2)]
save("pci_config", "enumerate-cf8", enum)

# The same through ECAM, with the capability list walked and MSI-X enabled, then an MSI-X entry
# written through BAR 1 and unmasked, the PBA read, and a BAR moved.
msix = [ecam(1, 0x34, size=1), ecam(1, 0x40, size=2), ecam(1, 0x50, size=4)]
msix += [ecam(1, 0x52, size=2, write=True, val=0xc000), ecam(1, 0x52, size=2, write=True, val=0x8000)]
msix += [acc(3, sel=1, addr=0, write=True, val=0xfee00000), acc(3, sel=1, addr=4, write=True, val=0),
         acc(3, sel=1, addr=8, write=True, val=0x4041), acc(3, sel=1, addr=12, write=True, val=0),
         acc(3, size=8, sel=1, addr=16, write=True, val=0xfee01000),
         acc(3, sel=1, addr=0x800, size=8), acc(3, sel=1, addr=12)]
msix += [ecam(1, 0x14, write=True, val=0xc0f00000), ecam(1, 0x14), acc(3, sel=1, addr=12)]
msix += [ecam(2, 0x20, write=True, val=0xffffffff), ecam(2, 0x24, write=True, val=0xffffffff),
         ecam(2, 0x20), ecam(2, 0x24), ecam(2, 0x20, write=True, val=0xc0e00000),
         ecam(2, 0x24, write=True, val=0), acc(3, sel=0x104, addr=0x10, size=8, write=True, val=7)]
save("pci_config", "msix-ecam", msix)


# edu: kind 0 = CF8 write, 1 = port, 2 = ECAM, 3 = BAR 0 at addr, 4 = translator on (val odd) / off.
def edu_reg(off, val=None, size=4):
    return acc(3, size=size, write=val is not None, addr=off, val=val or 0)


def edu_dma(src, dst, count, cmd):
    return [edu_reg(0x80, src, 8), edu_reg(0x88, dst, 8), edu_reg(0x90, count, 8),
            edu_reg(0x98, cmd | 1, 8), edu_reg(0x98, size=8)]


edu = [ecam(1, 0), ecam(1, 0x10, write=True, val=0xffffffff), ecam(1, 0x10),
       ecam(1, 0x10, write=True, val=0xc0000000), ecam(1, 0x04, size=2, write=True, val=0x0006)]
edu += [edu_reg(0x00), edu_reg(0x04, 0x12345678), edu_reg(0x04), edu_reg(0x20, 0x80),
        edu_reg(0x08, 12), edu_reg(0x20), edu_reg(0x08), edu_reg(0x24), edu_reg(0x64, 1)]
edu += [edu_reg(0x60, 0x30), edu_reg(0x64, 0x10), ecam(1, 0x04, size=2, write=True, val=0x0406),
        ecam(1, 0x04, size=2, write=True, val=0x0006), edu_reg(0x64, 0x20)]
edu += edu_dma(0x1000, 0x40000, 0x100, 4) + edu_dma(0x40010, 0x2ff0, 0x40, 2 | 4)
edu += edu_dma(0x1000, 0x40fff, 2, 0) + edu_dma(0x40000, 0x1000_3000, 8, 2)
save("edu", "intx-dma-factorial", edu)
msi = [ecam(1, 0x10, write=True, val=0xc0000000), ecam(1, 0x04, size=2, write=True, val=0x0006),
       ecam(1, 0x34, size=1), ecam(1, 0x40), ecam(1, 0x44, write=True, val=0xfee00000),
       ecam(1, 0x48, write=True, val=0), ecam(1, 0x4c, size=2, write=True, val=0x41),
       ecam(1, 0x42, size=2, write=True, val=0x0001), edu_reg(0x60, 1), edu_reg(0x64, 1)]
msi += [acc(4, val=1)] + edu_dma(0x10_1000, 0x40000, 0x20, 4) + edu_dma(0x40000, 0x1f_fff0, 0x20, 6)
msi += edu_dma(0x5000, 0x40000, 8, 4) + [acc(4, val=0), ecam(1, 0x04, size=2, write=True, val=0x0002)]
msi += edu_dma(0x1000, 0x40000, 8, 4) + [edu_reg(0x98, 5, 2), edu_reg(0x81, 1, 4), edu_reg(0xffffc)]
save("edu", "msi-iommu-garbage", msi)

# virtio_pci: kind 0 = CF8 write, 1 = port,
# 2 = ECAM (bus 0), 3 = BAR sel at addr, 4 = the device raises queue sel's interrupt.
def common(off, val=None, size=4):
    return acc(3, size=size, write=val is not None, sel=4, addr=off, val=val or 0)


def driver_init(queues=((0, 256, 0x10000), (1, 64, 0x20000)), features_hi=1, msix=True):
    r = [ecam(1, 0x34, size=1), ecam(1, 0x40), ecam(1, 0x9a, size=2)]
    if msix:
        r += [ecam(1, 0x9a, size=2, write=True, val=0x8000)]
        for v in range(3):
            r += [acc(3, sel=1, addr=16 * v, write=True, val=0xfee00000),
                  acc(3, sel=1, addr=16 * v + 8, write=True, val=0x40 + v),
                  acc(3, sel=1, addr=16 * v + 12, write=True, val=0)]
    r += [common(0x14, 0, size=1), common(0x14, 1, size=1), common(0x14, 3, size=1)]
    r += [common(0x00, 0), common(0x04), common(0x00, 1), common(0x04)]
    r += [common(0x08, 0), common(0x0c, 0x20000020), common(0x08, 1), common(0x0c, features_hi)]
    r += [common(0x14, 0xb, size=1), common(0x14, size=1), common(0x10, 2, size=2)]
    for q, size, base in queues:
        r += [common(0x16, q, size=2), common(0x18, size=2), common(0x18, size, size=2),
              common(0x1a, q, size=2), common(0x20, base, size=8), common(0x28, base + 0x1000),
              common(0x2c, 0), common(0x30, base + 0x2000, size=8), common(0x1c, 1, size=2)]
    r += [common(0x14, 0xf, size=1), common(0x14, size=1)]
    return r


run = driver_init() + [acc(3, sel=4, addr=0x3000, write=True, val=0), acc(4, sel=0),
                       acc(4, sel=1), acc(4, sel=0xffff), acc(3, size=1, sel=4, addr=0x1000),
                       acc(3, sel=4, addr=0x2000, size=8), acc(3, sel=4, addr=0x2000, write=True, val=2),
                       common(0x14, size=1), common(0x14, 0, size=1)]
save("virtio_pci", "driver-init-msix", run)
save("virtio_pci", "driver-init-intx", driver_init(msix=False) + [acc(4, sel=0),
                                                                        acc(3, size=1, sel=4, addr=0x1000)])
# Refused: features without VERSION_1, rings outside RAM; then a BAR move and the PCI_CFG window.
bad = driver_init(queues=((0, 256, 0x7ff000),), features_hi=0) + driver_init(queues=((1, 64, 0x1ff000),))
bad += [ecam(1, 0x20, write=True, val=0xc0c00000), ecam(1, 0x24, write=True, val=0),
        ecam(1, 0x88, size=1, write=True, val=4), ecam(1, 0x8c, write=True, val=0x14),
        ecam(1, 0x90, write=True, val=1), ecam(1, 0x94), ecam(1, 0x94, write=True, val=0)]
save("virtio_pci", "refused-and-moved", bad)


# virtqueue: byte 0 device (0 blk, 1 blk ro, 2 blk 4k, 3 net echo, 4 net sink), byte 1 flags
# (1 EVENT_IDX, 2 coalescing, 4 no bus master), byte 2 log2 queue size, then guest memory from 0.
def rings(i, size):
    a4 = lambda x: (x + 3) // 4 * 4
    per = a4(16 * size + 6 + 2 * size) + 6 + 8 * size
    desc = i * ((per + 15) // 16 * 16)
    avail = desc + 16 * size
    return desc, avail, a4(avail + 6 + 2 * size)


def vq(device, flags, size_log2, queues, data):
    """queues: per queue (descriptors [(addr, len, flags, next)], avail heads); data: {addr: bytes}"""
    size = 1 << size_log2
    mem = bytearray(0x4000)
    for i, (descs, heads) in enumerate(queues):
        d, a, _ = rings(i, size)
        for n, (addr, ln, fl, nx) in enumerate(descs):
            mem[d + 16 * n:d + 16 * n + 16] = struct.pack("<QIHH", addr, ln, fl, nx)
        mem[a:a + 4] = struct.pack("<HH", 0, len(heads))
        for n, h in enumerate(heads):
            mem[a + 4 + 2 * n:a + 6 + 2 * n] = struct.pack("<H", h)
    for addr, b in data.items():
        mem[addr:addr + len(b)] = b
    return bytes([device, flags, size_log2]) + bytes(mem).rstrip(b"\0")


NEXT, WRITE = 1, 2
hdr = lambda t, sector: struct.pack("<IIQ", t, 0, sector)
blk_descs = [(0x1000, 16, NEXT, 1), (0x1100, 512, NEXT, 2), (0x1400, 1, WRITE, 0),
             (0x1010, 16, NEXT, 4), (0x1600, 512, NEXT | WRITE, 5), (0x1401, 1, WRITE, 0),
             (0x1020, 16, NEXT, 7), (0x1800, 20, NEXT | WRITE, 8), (0x1402, 1, WRITE, 0),
             (0x1030, 16, NEXT, 10), (0x1403, 1, WRITE, 0),
             (0x1040, 16, NEXT, 12), (0x1050, 16, NEXT, 13), (0x1404, 1, WRITE, 0)]
blk_data = {0x1000: hdr(1, 0) + hdr(0, 0) + hdr(8, 0) + hdr(4, 0) + hdr(11, 0)
            + struct.pack("<QII", 1, 1, 0), 0x1100: bytes(range(256)) * 2}
save("virtqueue", "blk-out-in-id-flush-discard", [vq(0, 0, 4, [(blk_descs, [0, 3, 6, 9, 11])], blk_data)])
save("virtqueue", "blk-4k-event-idx", [vq(2, 1, 4, [(blk_descs, [3, 0])], blk_data)])
save("virtqueue", "blk-ro-write-refused", [vq(1, 2, 3, [(blk_descs[:3], [0])], blk_data)])
frame = bytes(12) + bytes.fromhex("525400123456525400123457") + b"\x08\x00" + bytes(range(46))
rx = ([(0x3000, 1526, WRITE, 0), (0x3800, 1526, WRITE, 0)], [0, 1])
save("virtqueue", "net-echo-tx-rx", [vq(3, 1, 4, [rx, ([(0x2000, len(frame), 0, 0)], [0])], {0x2000: frame})])
save("virtqueue", "net-sink-split-header", [vq(4, 0, 4, [([], []), ([(0x2000, 12, NEXT, 1), (0x200c, 60, 0, 0)], [0])],
                                                 {0x2000: frame})])


# completer: mode, feature to clear, 15 instruction bytes, 17 GPRs/RFLAGS, 16 XMM, RAM from 0.
def completer(name, insn, mode=0, feature=0, regs=(), xmm=(), ram=b""):
    r = list(regs) + [0] * (17 - len(regs))
    x = list(xmm) + [0] * (16 - len(xmm))
    body = bytes([mode, feature]) + bytes.fromhex(insn).ljust(15, b"\x90")
    body += b"".join(struct.pack("<Q", v & (2**64 - 1)) for v in r)
    body += b"".join(struct.pack("<QQ", v & (2**64 - 1), v >> 64) for v in x)
    save("completer", name, [body + ram])


# An IDT at 0x1000 whose gate 0x80 goes to 0x9000 (code selector 0x08, DPL 3) and gate 3 too.
def gate(offset, dpl=3, kind=0xe):
    return struct.pack("<HHBBHII", offset & 0xffff, 0x08, 0, 0x80 | dpl << 5 | kind,
                       (offset >> 16) & 0xffff, offset >> 32, 0)


idt = bytearray(0x1000)
idt[0x80 * 16:0x81 * 16] = gate(0x9000)
idt[3 * 16:4 * 16] = gate(0x9100, kind=0xf)
gdt = struct.pack("<QQQQQ", 0, 0x00af9b000000ffff, 0x00cf93000000ffff, 0x00affb000000ffff, 0x00cff3000000ffff)
ram = bytes(0x1000) + bytes(idt) + gdt.ljust(0x1000, b"\0") + struct.pack("<IQ", 0, 0xf000)
rsp = 0xe000
completer("xgetbv", "0f01d0", regs=[0, 0, 0])
completer("xgetbv-ecx1", "0f01d0", regs=[0, 0, 1])
completer("clwb", "660fae30", regs=[0x4000])
completer("rdpru", "0f01fd", regs=[0, 0, 1])
completer("invpcid", "660f388208", regs=[0, 0x4000], ram=bytes(0x4000) + struct.pack("<QQ", 1, 0x1000))
completer("int80-cpl3", "cd80", mode=1 | 8, regs=[0] * 6 + [rsp], ram=ram)
completer("int3", "cc", regs=[0] * 6 + [rsp], ram=ram)
completer("crc32", "f2480f38f1c3", regs=[0xffffffff, 0x1122334455667788])
completer("popcnt-lzcnt", "f3480fb8c3", regs=[0, 0xf0f0])
completer("rdrand-no-feature", "480fc7f0", feature=5)
completer("wrfsbase", "f3480faed0", regs=[0x7fff_0000_1000])
completer("movdqu-store", "f30f7f00", regs=[0x5000], xmm=[0x0123456789abcdef_fedcba9876543210])
completer("ldmxcsr", "0fae10", regs=[0, 0, 0x6000], ram=bytes(0x6000) + struct.pack("<I", 0x1f80))
completer("stac-smap", "0f01cb", mode=4)
completer("lock-misuse", "f00f01d0")
completer("compat-clwb", "660fae30", mode=2, regs=[0x4000])


# Kernel loaders: the image, then an options byte (1 initrd, 2 no ACPI).
# The probe-guest ELFs come from a build (LUCID_GUESTS=<cargo out dir>/guests), stripped.
guests = os.environ.get("LUCID_GUESTS")
if guests:
    import subprocess
    for name, opts in [("hello", 0), ("pvh-ttext", 1), ("mb-lowmem", 1)]:
        out = f"/tmp/lucid-seed-{name}.elf"
        subprocess.run(["strip", "-o", out, f"{guests}/{name}.elf"], check=True)
        target = "boot_multiboot" if name.startswith("mb") else "boot_elf"
        save(target, f"{name}.elf", [open(out, "rb").read(), bytes([opts])])
        if target == "boot_multiboot":
            save("boot_elf", f"{name}.elf", [open(out, "rb").read(), bytes([opts])])


def elf64(entry, segs):
    """A minimal ELF64 executable (a vmlinux's shape): PT_LOAD segments (paddr, data, memsz)."""
    ph_off, n = 64, len(segs)
    data_off = ph_off + 56 * n
    eh = b"\x7fELF" + bytes([2, 1, 1]) + bytes(9)
    eh += struct.pack("<HHIQQQIHHHHHH", 2, 62, 1, entry, ph_off, 0, 0, 64, 56, n, 64, 0, 0)
    phs, body = b"", b""
    for paddr, d, memsz in segs:
        phs += struct.pack("<IIQQQQQQ", 1, 7, data_off + len(body), paddr | 0xffffffff80000000,
                           paddr, len(d), memsz, 0x1000)
        body += d
    return eh + phs + body


save("boot_elf", "vmlinux-shaped", [elf64(0x100000, [(0x100000, b"\xf4" * 64, 0x2000),
                                                     (0x200000, b"Linux version 6.1" * 4, 0x1000)]),
                                    b"\x01"])
mb_magic = 0x1BADB002
aout = [0x20_0000, 0x1f_fff8, 0, 0x20_4000, 0x20_0100]
flat = bytes([0xf4] * 8) + struct.pack("<III", mb_magic, 1 << 16, (-(mb_magic + (1 << 16))) & 0xffffffff)
flat += struct.pack("<5I", *aout) + bytes([0xaa] * 100)
save("boot_multiboot", "aout-kludge-flat", [flat, b"\x01"])
low = bytes([0xf4] * 8) + struct.pack("<III", mb_magic, 3 | 1 << 16, (-(mb_magic + (3 | 1 << 16))) & 0xffffffff)
low += struct.pack("<5I", 0x8000, 0x7ff8, 0x8060, 0xa000, 0x8040) + bytes([0x90] * 64)
save("boot_multiboot", "aout-low-memory-mem-info", [low, b"\x02"])


def bzimage(payload, init_size, pref=0x100000):
    b = bytearray(5 * 512)
    b[0x1f1] = 4
    struct.pack_into("<I", b, 0x1f4, (len(payload) + 15) // 16)
    struct.pack_into("<H", b, 0x1fe, 0xaa55)
    b[0x202:0x206] = b"HdrS"
    struct.pack_into("<H", b, 0x206, 0x020f)
    b[0x211] = 1
    struct.pack_into("<I", b, 0x214, 0x100000)
    struct.pack_into("<I", b, 0x22c, 0x7fffffff)
    struct.pack_into("<I", b, 0x230, 0x200000)
    b[0x234] = 1
    struct.pack_into("<H", b, 0x236, 3)
    struct.pack_into("<I", b, 0x238, 2047)
    struct.pack_into("<Q", b, 0x258, pref)
    struct.pack_into("<I", b, 0x260, init_size)
    return bytes(b) + payload + bytes(-len(payload) % 16)


save("boot_bzimage", "setup-header-2.15", [bzimage(b"\xf4" * 256, 0x10000), b"\x01"])
save("boot_bzimage", "pref-address-high", [bzimage(b"\x90" * 64, 0x400000, pref=0x800000), b"\x00"])


# vtd: a header record (pin policy = kind % 3: Map, Deferred, All; `sel` bytes follow, copied to
# guest RAM at 0), then kind 0 = register access at addr, 1 = translation (sel = requester, val =
# IOVA, addr = length, write, size >= 4 leaves the bracket open), 2 = MSI remap (sel = source,
# addr = data, val = address bits 19:0, or the whole address with bit 63), 3 = guest RAM write
# at addr, 4 = end the oldest open bracket (all with sel odd).
def vreg(off, val=None, size=4):
    return acc(0, size=size, write=val is not None, addr=off, val=val or 0)


def vmem(gpa, val):
    return acc(3, size=8, write=True, addr=gpa, val=val)


def vdma(rid, iova, length=0x100, write=False, keep=False):
    return acc(1, size=4 if keep else 1, write=write, sel=rid, addr=length, val=iova)


def vmsi(source, address, data, raw=False):
    return acc(2, sel=source, addr=data, val=address | (1 << 63 if raw else 0))


# Root table 0x10000 (bus 0), context table 0x11000: requester 8 in domain 1 with 4-level tables
# at 0x12000 (IOVA 0x1000 -> 0x200000 read-write, IOVA 2 MiB -> a 2 MiB page at 2 MiB),
# requester 0x10 in domain 2 with 3-level tables at 0x16000 (IOVA 0x2000 -> 0x300000 read-only).
vtd_tables = [vmem(0x10000, 0x11000 | 1),
              vmem(0x11080, 0x12000 | 1), vmem(0x11088, 2 | 1 << 8),
              vmem(0x12000, 0x13000 | 3), vmem(0x13000, 0x14000 | 3), vmem(0x14000, 0x15000 | 3),
              vmem(0x15008, 0x200000 | 3), vmem(0x14008, 0x200000 | 0x83),
              vmem(0x11100, 0x16000 | 1), vmem(0x11108, 1 | 2 << 8),
              vmem(0x16000, 0x17000 | 3), vmem(0x17000, 0x18000 | 3), vmem(0x18010, 0x300000 | 1)]
vtd_fault_msi = [vreg(0x40, 0xfee01000), vreg(0x3c, 0x41), vreg(0x38, 0)]
vtd_on = [vreg(0x20, 0x10000, 8), vreg(0x18, 1 << 30), vreg(0x1c), vreg(0x18, 1 << 31), vreg(0x1c)]
vt = [acc(0)] + vtd_tables + vtd_fault_msi + [vreg(0x00), vreg(0x08, size=8), vreg(0x10, size=8)]
vt += vtd_on + [vdma(8, 0x1000), vdma(8, 0x1ff8, write=True, keep=True), vdma(8, 0x201234),
                vdma(0x10, 0x2010), vdma(0x10, 0x2010, write=True), vdma(8, 0x5000), acc(4)]
vt += [vreg(0x34), vreg(0x1000, size=8), vreg(0x1008, size=8), vreg(0x100c, 1 << 31), vreg(0x34, 0x7d)]
vt += [vmem(0x15008, 0), vreg(0x1100, 0x1000, 8), vreg(0x1108, 1 << 63 | 3 << 60 | 1 << 32, 8),
       vreg(0x1108, size=8), vdma(8, 0x1000), vreg(0x28, 1 << 63 | 1 << 61, 8), vdma(8, 0x201000)]
vt += [vmsi(8, 0x1000, 0x41), vreg(0x18, 0)]
save("vtd", "translate-3-and-4-level", vt)

# Queued invalidation: a context-cache and an IOTLB global invalidation and a wait descriptor
# (status write and completion interrupt) while an access is in flight; then a bad descriptor
# (IQE), rewritten and resumed.
qi = [acc(1)] + vtd_tables + vtd_fault_msi + vtd_on
qi += [vreg(0xa8, 0xfee02000), vreg(0xa4, 0x42), vreg(0xa0, 0),
       vreg(0x88, 0, 8), vreg(0x90, 0x20000, 8), vreg(0x18, 1 << 31 | 1 << 26), vreg(0x1c)]
qi += [vdma(8, 0x1010, keep=True), vmem(0x15008, 0x210000 | 3),
       vmem(0x20000, 1 | 1 << 4), vmem(0x20008, 0),
       vmem(0x20010, 2 | 1 << 4), vmem(0x20018, 0),
       vmem(0x20020, 5 | 1 << 4 | 1 << 5 | 0x1234 << 32), vmem(0x20028, 0x38000),
       vreg(0x88, 3 << 4, 8), vreg(0x80, size=8), vreg(0x9c), vreg(0x34), vdma(8, 0x1010), acc(4)]
qi += [vmem(0x20030, 0xf), vmem(0x20038, 0), vreg(0x88, 4 << 4, 8), vreg(0x34), vreg(0x80, size=8),
       vmem(0x20030, 5 | 1 << 5 | 0x99 << 32), vmem(0x20038, 0x38008), vreg(0x34, 1 << 4),
       vreg(0x80, size=8), vreg(0x9c, 1)]
save("vtd", "qi-invalidate-wait", qi)

# Interrupt remapping (pin-all policy, the root and context tables in the RAM prefix): IRTA with
# 16 entries, SIRTP, IRE; an IRTE checked against requester 8 by SID; remaps that pass and fault,
# then compatibility format allowed by CFI.
prefix = bytearray(0x1090)
struct.pack_into("<Q", prefix, 0, 0x1000 | 1)
struct.pack_into("<QQ", prefix, 0x1080, 0x12000 | 1, 2 | 1 << 8)
ir = [acc(2, sel=len(prefix)), bytes(prefix)] + vtd_tables[3:8] + vtd_fault_msi
ir += [vreg(0x20, 0, 8), vreg(0x18, 1 << 30), vreg(0x18, 1 << 31), vdma(8, 0x1000)]
ir += [vmem(0x30010, 1 | 0x31 << 16 | 1 << 40), vmem(0x30018, 8 | 1 << 18),
       vreg(0xb8, 0x30000 | 3, 8), vreg(0x18, 1 << 31 | 1 << 24), vreg(0x18, 1 << 31 | 1 << 25),
       vreg(0x1c), vmsi(8, 0xfee00000 | 1 << 5 | 0x10, 0, raw=True),
       vmsi(9, 0xfee00000 | 1 << 5 | 0x10, 0, raw=True), vmsi(8, 0x1000, 0x41),
       vmsi(8, 0xfee00000 | 0x10 | 1 << 3, 1, raw=True), vmsi(8, 0xfee00000 | 20 << 5 | 0x10, 0, raw=True),
       vreg(0x34), vreg(0x1000, size=8), vreg(0x1008, size=8),
       vreg(0x18, 1 << 31 | 1 << 25 | 1 << 23), vmsi(8, 0x1000, 0x41)]
save("vtd", "interrupt-remapping", ir)

# fw_cfg: kind 0 = port at offset addr (0 selector, 1 data, 4/8 DMA address), 1 = RAM store at addr
# (big-endian val, as a FWCfgDmaAccess holds it).
def fw_port(off, val=None, size=1):
    return acc(0, size=size, write=val is not None, addr=off, val=val or 0)


def fw_dma(at, control, length, dst):
    return [acc(1, size=4, write=True, addr=at, val=control), acc(1, size=4, write=True, addr=at + 4, val=length),
            acc(1, size=8, write=True, addr=at + 8, val=dst),
            fw_port(4, struct.unpack("<I", struct.pack(">I", at >> 32))[0], 4),
            fw_port(8, struct.unpack("<I", struct.pack(">I", at & 0xffffffff))[0], 4)]


fw = [fw_port(0, 0x0000, 2)] + [fw_port(1)] * 4 + [fw_port(0, 0x0001, 2), fw_port(1, size=4)]
fw += [fw_port(4, size=4), fw_port(8, size=4), fw_port(0, 0x0019, 2)] + [fw_port(1)] * 68
fw += fw_dma(0x1000, 0x0020 << 16 | 8 | 2, 20, 0x2000) + fw_dma(0x1000, 4, 8, 0)
fw += fw_dma(0x1000, 2, 16, 0x7f00000000) + fw_dma(0x1000, 0x10, 4, 0x2000) + fw_dma(0xfffff8, 2, 4, 0)
save("fw_cfg", "probe-dir-dma", fw)
