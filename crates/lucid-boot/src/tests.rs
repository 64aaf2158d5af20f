//! Tests with real files: small kernel images built here, written to a temporary directory and
//! loaded into a 64 MiB guest memory.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};

use kvm_bindings::{kvm_regs, kvm_sregs};
use linux_loader::loader::bootparam::boot_params;
use linux_loader::loader::elf::start_info::{
    hvm_memmap_table_entry, hvm_modlist_entry, hvm_start_info,
};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use crate::layout::*;
use crate::loader::{mbi_flags, HVM_START_MAGIC, MULTIBOOT_BOOTLOADER_MAGIC};
use crate::memmap::{memory_map, E820_RAM, E820_RESERVED};
use crate::regs::selectors;
use crate::*;

const MEM: u64 = 64 << 20;

/// A temporary directory removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new() -> TempDir {
        static N: AtomicU32 = AtomicU32::new(0);
        let p = std::env::temp_dir().join(format!(
            "lucid-boot-test-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }

    fn file(&self, name: &str, bytes: &[u8]) -> PathBuf {
        let p = self.0.join(name);
        std::fs::write(&p, bytes).unwrap();
        p
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn guest(mem_size: u64) -> GuestMemoryMmap {
    let ranges: Vec<(GuestAddress, usize)> = ram_regions(mem_size)
        .into_iter()
        .map(|(s, l)| (GuestAddress(s), l as usize))
        .collect();
    let mem = GuestMemoryMmap::from_ranges(&ranges).unwrap();
    // Garbage, so that tests see what the loader zeroes.
    mem.write_slice(&vec![0xcc; 0x20_0000], GuestAddress(0x10_0000))
        .unwrap();
    mem
}

fn read<const N: usize>(mem: &GuestMemoryMmap, addr: u64) -> [u8; N] {
    let mut b = [0u8; N];
    mem.read_slice(&mut b, GuestAddress(addr)).unwrap();
    b
}

fn r32(mem: &GuestMemoryMmap, addr: u64) -> u32 {
    mem.read_obj(GuestAddress(addr)).unwrap()
}

fn r64(mem: &GuestMemoryMmap, addr: u64) -> u64 {
    mem.read_obj(GuestAddress(addr)).unwrap()
}

fn cstr(mem: &GuestMemoryMmap, addr: u64) -> String {
    let b: [u8; 256] = read(mem, addr);
    let n = b.iter().position(|&c| c == 0).unwrap();
    String::from_utf8(b[..n].to_vec()).unwrap()
}

/// One program header for the ELF builders.
struct Ph {
    p_type: u32,
    paddr: u64,
    vaddr: u64,
    data: Vec<u8>,
    memsz: u64,
}

fn load_seg(paddr: u64, data: &[u8], memsz: u64) -> Ph {
    Ph {
        p_type: 1,
        paddr,
        vaddr: paddr,
        data: data.to_vec(),
        memsz,
    }
}

fn note(name: &[u8], ntype: u32, desc: &[u8]) -> Ph {
    let mut v = Vec::new();
    v.extend_from_slice(&(name.len() as u32).to_le_bytes());
    v.extend_from_slice(&(desc.len() as u32).to_le_bytes());
    v.extend_from_slice(&ntype.to_le_bytes());
    v.extend_from_slice(name);
    while v.len() & 3 != 0 {
        v.push(0);
    }
    v.extend_from_slice(desc);
    while v.len() & 3 != 0 {
        v.push(0);
    }
    Ph {
        p_type: 4,
        paddr: 0,
        vaddr: 0,
        memsz: 0,
        data: v,
    }
}

fn pvh_note(entry: u32) -> Ph {
    note(b"Xen\0", 18, &entry.to_le_bytes())
}

/// An ELF (64- or 32-bit) with the given program headers; segment data from file offset 0x1000.
fn elf(is_64: bool, entry: u64, phs: &[Ph]) -> Vec<u8> {
    let (ehsize, phentsize) = if is_64 { (64, 56) } else { (52, 32) };
    let mut f = vec![0u8; 0x1000];
    f[..4].copy_from_slice(b"\x7fELF");
    f[4] = if is_64 { 2 } else { 1 };
    f[5] = 1;
    f[6] = 1;
    let machine: u16 = if is_64 { 62 } else { 3 };
    let put16 = |f: &mut Vec<u8>, o: usize, v: u16| f[o..o + 2].copy_from_slice(&v.to_le_bytes());
    let put32 = |f: &mut Vec<u8>, o: usize, v: u32| f[o..o + 4].copy_from_slice(&v.to_le_bytes());
    let put64 = |f: &mut Vec<u8>, o: usize, v: u64| f[o..o + 8].copy_from_slice(&v.to_le_bytes());
    put16(&mut f, 16, 2); // ET_EXEC
    put16(&mut f, 18, machine);
    put32(&mut f, 20, 1);
    if is_64 {
        put64(&mut f, 24, entry);
        put64(&mut f, 32, ehsize as u64);
        put16(&mut f, 52, ehsize as u16);
        put16(&mut f, 54, phentsize as u16);
        put16(&mut f, 56, phs.len() as u16);
    } else {
        put32(&mut f, 24, entry as u32);
        put32(&mut f, 28, ehsize as u32);
        put16(&mut f, 40, ehsize as u16);
        put16(&mut f, 42, phentsize as u16);
        put16(&mut f, 44, phs.len() as u16);
    }
    for (i, ph) in phs.iter().enumerate() {
        let off = f.len();
        f.extend_from_slice(&ph.data);
        while f.len() & 15 != 0 {
            f.push(0);
        }
        let h = ehsize + i * phentsize;
        let filesz = ph.data.len() as u64;
        put32(&mut f, h, ph.p_type);
        if is_64 {
            put64(&mut f, h + 8, off as u64);
            put64(&mut f, h + 16, ph.vaddr);
            put64(&mut f, h + 24, ph.paddr);
            put64(&mut f, h + 32, filesz);
            put64(&mut f, h + 40, ph.memsz);
        } else {
            put32(&mut f, h + 4, off as u32);
            put32(&mut f, h + 8, ph.vaddr as u32);
            put32(&mut f, h + 12, ph.paddr as u32);
            put32(&mut f, h + 16, filesz as u32);
            put32(&mut f, h + 20, ph.memsz as u32);
        }
    }
    f
}

fn multiboot_header(flags: u32, aout: Option<[u32; 5]>) -> Vec<u8> {
    let mut v = Vec::new();
    let magic = 0x1BAD_B002u32;
    for x in [magic, flags, 0u32.wrapping_sub(magic).wrapping_sub(flags)] {
        v.extend_from_slice(&x.to_le_bytes());
    }
    for x in aout.iter().flatten() {
        v.extend_from_slice(&x.to_le_bytes());
    }
    v
}

fn params<'a>(
    kernel: &'a std::path::Path,
    initrd: Option<&'a std::path::Path>,
    cmdline: &'a str,
) -> BootParams<'a> {
    BootParams {
        kernel,
        initrd,
        cmdline,
        mem_size: MEM,
        acpi: Some(acpi_cfg()),
    }
}

fn acpi_cfg() -> &'static AcpiConfig {
    static CFG: std::sync::OnceLock<AcpiConfig> = std::sync::OnceLock::new();
    CFG.get_or_init(|| AcpiConfig::new(1))
}

fn initrd_bytes(n: usize) -> Vec<u8> {
    (0..n).map(|i| (i * 7 + 3) as u8).collect()
}

#[test]
fn pvh_elf64_start_info() {
    let d = TempDir::new();
    let code = b"PVH kernel code".to_vec();
    let k = d.file(
        "pvh",
        &elf(
            true,
            0xffff_ffff_8100_0000,
            &[pvh_note(0x10_0004), load_seg(0x10_0000, &code, 0x3000)],
        ),
    );
    let rd = initrd_bytes(5000);
    let i = d.file("initrd", &rd);
    let mem = guest(MEM);
    let s = load(&mem, params(&k, Some(&i), "console=ttyS0 quiet")).unwrap();
    assert_eq!(s.kind, KernelKind::PvhElf);
    assert_eq!(
        s.entry.mode,
        EntryMode::Protected32 {
            eip: 0x10_0004,
            eax: 0,
            ebx: BOOT_INFO
        }
    );
    assert_eq!(s.kernel_end, 0x10_3000);
    assert_eq!(read::<15>(&mem, 0x10_0000), code[..]);
    assert_eq!(read::<16>(&mem, 0x10_2ff0), [0u8; 16], "bss zeroed");

    let info: hvm_start_info = mem.read_obj(GuestAddress(BOOT_INFO)).unwrap();
    assert_eq!(info.magic, HVM_START_MAGIC);
    assert_eq!(info.version, 1);
    assert_eq!(info.cmdline_paddr, CMDLINE);
    assert_eq!(cstr(&mem, CMDLINE), "console=ttyS0 quiet");
    assert_eq!(info.rsdp_paddr, ACPI_START);
    let map = memory_map(MEM);
    assert_eq!(info.memmap_entries as usize, map.len());
    for (n, e) in map.iter().enumerate() {
        let m: hvm_memmap_table_entry = mem
            .read_obj(GuestAddress(info.memmap_paddr + 24 * n as u64))
            .unwrap();
        assert_eq!((m.addr, m.size, m.type_), (e.addr, e.size, e.kind));
    }
    assert_eq!(info.nr_modules, 1);
    let m: hvm_modlist_entry = mem.read_obj(GuestAddress(info.modlist_paddr)).unwrap();
    assert_eq!(m.size, 5000);
    assert_eq!(m.paddr % 4096, 0);
    assert!(m.paddr + m.size <= MEM && m.paddr > MEM - 0x3000);
    assert_eq!(s.initrd, Some((m.paddr, 5000)));
    let mut back = vec![0u8; 5000];
    mem.read_slice(&mut back, GuestAddress(m.paddr)).unwrap();
    assert_eq!(back, rd);
}

#[test]
fn pvh_elf32_and_pvh_wins_over_multiboot() {
    let d = TempDir::new();
    let mut code = multiboot_header(0, None);
    code.extend_from_slice(b"code");
    let k = d.file(
        "pvh32",
        &elf(
            false,
            0x10_0000,
            &[
                note(b"GNU\0", 3, &[1, 2, 3, 4, 5]),
                pvh_note(0x10_0010),
                load_seg(0x10_0000, &code, 0x1000),
            ],
        ),
    );
    let img = KernelImage::open(&k).unwrap();
    assert_eq!(img.kind(), KernelKind::PvhElf);
    let mem = guest(MEM);
    let s = load_image(&mem, &img, &params(&k, None, "")).unwrap();
    assert!(matches!(
        s.entry.mode,
        EntryMode::Protected32 { eip: 0x10_0010, .. }
    ));
    let info: hvm_start_info = mem.read_obj(GuestAddress(BOOT_INFO)).unwrap();
    assert_eq!((info.nr_modules, info.modlist_paddr), (0, 0));
}

/// A multiboot ELF32 (flags: page-align modules, memory info) of `nops` NOPs after the header,
/// one segment at `addr` of `memsz` bytes, entered right after the header.
fn multiboot_elf(
    d: &TempDir,
    name: &str,
    addr: u64,
    nops: usize,
    memsz: u64,
) -> (PathBuf, Vec<u8>) {
    let mut code = multiboot_header(0x3, None);
    code.extend(std::iter::repeat_n(0x90, nops));
    let k = d.file(
        name,
        &elf(false, addr + 12, &[load_seg(addr, &code, memsz)]),
    );
    (k, code)
}

#[test]
fn multiboot_elf32_info() {
    let d = TempDir::new();
    let (k, _) = multiboot_elf(&d, "mb", 0x10_0000, 32, 0x5000);
    let rd = initrd_bytes(10000);
    let i = d.file("initrd.img", &rd);
    let mem = guest(MEM);
    let s = load(&mem, params(&k, Some(&i), "mb cmdline")).unwrap();
    assert_eq!(s.kind, KernelKind::Multiboot);
    assert_eq!(
        s.entry.mode,
        EntryMode::Protected32 {
            eip: 0x10_000c,
            eax: u64::from(MULTIBOOT_BOOTLOADER_MAGIC),
            ebx: BOOT_INFO
        }
    );
    let flags = r32(&mem, BOOT_INFO);
    assert_eq!(
        flags,
        mbi_flags::MEMORY
            | mbi_flags::CMDLINE
            | mbi_flags::MODS
            | mbi_flags::MMAP
            | mbi_flags::LOADER_NAME
    );
    assert_eq!(r32(&mem, BOOT_INFO + 4), 639);
    assert_eq!(r32(&mem, BOOT_INFO + 8), ((MEM - (1 << 20)) / 1024) as u32);
    assert_eq!(
        cstr(&mem, u64::from(r32(&mem, BOOT_INFO + 16))),
        "mb cmdline"
    );
    assert_eq!(r32(&mem, BOOT_INFO + 20), 1);
    let mods = u64::from(r32(&mem, BOOT_INFO + 24));
    let (start, end) = (r32(&mem, mods), r32(&mem, mods + 4));
    assert_eq!(
        u64::from(start),
        0x10_5000,
        "module 0 right after the kernel"
    );
    assert_eq!(end - start, 10000);
    assert!(cstr(&mem, u64::from(r32(&mem, mods + 8))).ends_with("initrd.img"));
    let mut back = vec![0u8; 10000];
    mem.read_slice(&mut back, GuestAddress(start.into()))
        .unwrap();
    assert_eq!(back, rd);
    // mmap entries with the size field.
    let len = r32(&mem, BOOT_INFO + 44) as u64;
    let addr = u64::from(r32(&mem, BOOT_INFO + 48));
    let map = memory_map(MEM);
    assert_eq!(len, 24 * map.len() as u64);
    for (n, e) in map.iter().enumerate() {
        let a = addr + 24 * n as u64;
        assert_eq!(r32(&mem, a), 20);
        assert_eq!(r64(&mem, a + 4), e.addr);
        assert_eq!(r64(&mem, a + 12), e.size);
        assert_eq!(r32(&mem, a + 20), e.kind);
    }
    assert_eq!(cstr(&mem, u64::from(r32(&mem, BOOT_INFO + 64))), "lucid");
}

#[test]
fn multiboot_aout_kludge_flat_binary() {
    let d = TempDir::new();
    // Header at file offset 8, loaded at 0x200000: file offset 0 -> 0x1ffff8.
    let mut img = vec![0xf4u8; 8];
    img.extend(multiboot_header(
        1 << 16,
        Some([0x20_0000, 0x1f_fff8, 0, 0x20_4000, 0x20_0100]),
    ));
    img.extend_from_slice(&[0xaa; 100]);
    let k = d.file("flat", &img);
    let mem = guest(MEM);
    let s = load(&mem, params(&k, None, "")).unwrap();
    assert_eq!(s.kind, KernelKind::Multiboot);
    assert!(matches!(
        s.entry.mode,
        EntryMode::Protected32 { eip: 0x20_0100, .. }
    ));
    assert_eq!(s.kernel_end, 0x20_4000);
    assert_eq!(read::<8>(&mem, 0x1f_fff8), [0xf4; 8]);
    assert_eq!(r32(&mem, 0x20_0000), 0x1BAD_B002);
    assert_eq!(read::<4>(&mem, 0x20_3000), [0; 4], "bss zeroed");
    assert_eq!(r32(&mem, BOOT_INFO) & mbi_flags::MODS, 0);
}

#[test]
fn multiboot_without_kludge_in_flat_binary_is_not_a_kernel() {
    let d = TempDir::new();
    let k = d.file("flat", &multiboot_header(0, None));
    let e = load(&guest(MEM), params(&k, None, "")).unwrap_err();
    assert!(matches!(e, BootError::NotAKernel { .. }), "{e}");
}

fn read_zero_page(mem: &GuestMemoryMmap) -> boot_params {
    mem.read_obj(GuestAddress(BOOT_INFO)).unwrap()
}

fn check_e820(bp: &boot_params) {
    let map = memory_map(MEM);
    assert_eq!(bp.e820_entries as usize, map.len());
    for (n, e) in map.iter().enumerate() {
        let t = bp.e820_table[n];
        let (a, s, k) = (t.addr, t.size, t.r#type);
        assert_eq!((a, s, k), (e.addr, e.size, e.kind));
    }
    let (t0, t1, t2) = (bp.e820_table[0], bp.e820_table[1], bp.e820_table[2]);
    assert_eq!({ t0.r#type }, E820_RAM);
    assert_eq!(({ t1.addr }, { t1.r#type }), (EBDA_START, E820_RESERVED));
    assert_eq!(({ t2.addr }, { t2.r#type }), (HIGH_MEMORY, E820_RAM));
}

#[test]
fn linux_elf_zero_page() {
    let d = TempDir::new();
    let code = b"startup_64".to_vec();
    // A vmlinux: physical 16 MiB, virtual __START_KERNEL_map + 16 MiB, e_entry physical.
    let seg = Ph {
        vaddr: 0xffff_ffff_8100_0000,
        ..load_seg(0x100_0000, &code, 0x20_0000)
    };
    let k = d.file(
        "vmlinux",
        &elf(true, 0x100_0000, &[note(b"GNU\0", 3, b"id"), seg]),
    );
    let rd = initrd_bytes(0x12345);
    let i = d.file("initrd", &rd);
    let mem = guest(MEM);
    let s = load(&mem, params(&k, Some(&i), "console=ttyS0")).unwrap();
    assert_eq!(s.kind, KernelKind::LinuxElf);
    assert_eq!(
        s.entry.mode,
        EntryMode::Long64 {
            rip: 0x100_0000,
            rsi: BOOT_INFO
        }
    );
    let bp = read_zero_page(&mem);
    let h = bp.hdr;
    assert_eq!(({ h.header }, { h.boot_flag }), (0x5372_6448, 0xaa55));
    assert_eq!({ h.version }, 0x020c);
    assert_eq!(h.type_of_loader, 0xff);
    assert_eq!({ h.cmd_line_ptr } as u64, CMDLINE);
    assert_eq!(cstr(&mem, CMDLINE), "console=ttyS0");
    let (ri, rs) = ({ h.ramdisk_image }, { h.ramdisk_size });
    assert_eq!(rs, 0x12345);
    assert_eq!(ri % 4096, 0);
    assert!(u64::from(ri) + u64::from(rs) <= MEM);
    assert!(u64::from(ri) >= s.kernel_end);
    let mut back = vec![0u8; rd.len()];
    mem.read_slice(&mut back, GuestAddress(ri.into())).unwrap();
    assert_eq!(back, rd);
    assert_eq!({ bp.acpi_rsdp_addr }, ACPI_START);
    check_e820(&bp);

    // A virtual e_entry is translated through its segment.
    let seg = Ph {
        vaddr: 0xffff_ffff_8100_0000,
        ..load_seg(0x100_0000, &code, 0x1000)
    };
    let k = d.file("vmlinux-virt", &elf(true, 0xffff_ffff_8100_0040, &[seg]));
    let s = load(&guest(MEM), params(&k, None, "")).unwrap();
    assert!(matches!(
        s.entry.mode,
        EntryMode::Long64 {
            rip: 0x100_0040,
            ..
        }
    ));
}

/// A synthetic bzImage: 4 setup sectors, `payload` after them, a 2.15 header.
fn bzimage(payload: &[u8], init_size: u32) -> Vec<u8> {
    let mut b = vec![0u8; 5 * 512];
    let put16 = |b: &mut Vec<u8>, o: usize, v: u16| b[o..o + 2].copy_from_slice(&v.to_le_bytes());
    let put32 = |b: &mut Vec<u8>, o: usize, v: u32| b[o..o + 4].copy_from_slice(&v.to_le_bytes());
    b[0x1f1] = 4;
    put32(&mut b, 0x1f4, payload.len().div_ceil(16) as u32);
    put16(&mut b, 0x1fe, 0xaa55);
    b[0x202..0x206].copy_from_slice(b"HdrS");
    put16(&mut b, 0x206, 0x020f);
    b[0x211] = 0x01; // LOADED_HIGH
    put32(&mut b, 0x214, 0x10_0000);
    put32(&mut b, 0x22c, 0x7fff_ffff);
    put32(&mut b, 0x230, 0x20_0000);
    b[0x234] = 1;
    put16(&mut b, 0x236, 0x3); // XLF_KERNEL_64 | XLF_CAN_BE_LOADED_ABOVE_4G
    put32(&mut b, 0x238, 2047);
    b[0x258..0x260].copy_from_slice(&0x100_0000u64.to_le_bytes());
    put32(&mut b, 0x260, init_size);
    b.extend_from_slice(payload);
    b.resize(5 * 512 + payload.len().div_ceil(16) * 16, 0);
    b
}

#[test]
fn bzimage_zero_page() {
    let d = TempDir::new();
    let payload: Vec<u8> = (0..4096u32).map(|i| i as u8).collect();
    let k = d.file("bzImage", &bzimage(&payload, 0x80_0000));
    let i = d.file("initrd", &initrd_bytes(4096));
    let mem = guest(MEM);
    let s = load(&mem, params(&k, Some(&i), "root=/dev/vda")).unwrap();
    assert_eq!(s.kind, KernelKind::BzImage);
    assert_eq!(
        s.entry.mode,
        EntryMode::Long64 {
            rip: 0x10_0200,
            rsi: BOOT_INFO
        }
    );
    assert_eq!(s.kernel_end, 0x180_0000, "pref_address + init_size");
    assert_eq!(read::<16>(&mem, 0x10_0000), payload[..16]);
    let bp = read_zero_page(&mem);
    let h = bp.hdr;
    assert_eq!({ h.version }, 0x020f);
    assert_eq!(h.setup_sects, 4);
    assert_eq!({ h.code32_start }, 0x10_0000);
    assert_eq!({ h.cmdline_size }, 2047, "kept from the image");
    assert_eq!(h.type_of_loader, 0xff);
    assert_eq!({ h.cmd_line_ptr } as u64, CMDLINE);
    assert_eq!(cstr(&mem, CMDLINE), "root=/dev/vda");
    assert_eq!({ h.ramdisk_size }, 4096);
    assert_eq!(u64::from(h.ramdisk_image), MEM - 4096);
    assert_eq!({ bp.acpi_rsdp_addr }, ACPI_START);
    check_e820(&bp);

    // Too long a command line for this kernel.
    let long = "x".repeat(3000);
    let e = load(&guest(MEM), params(&k, None, &long)).unwrap_err();
    assert!(
        matches!(
            e,
            BootError::CmdlineTooLong {
                len: 3000,
                max: 2047
            }
        ),
        "{e}"
    );

    // A kernel that decompresses into 128 MiB does not fit in 64 MiB.
    let k = d.file("big", &bzimage(&payload, 112 << 20));
    let e = load(&guest(MEM), params(&k, None, "")).unwrap_err();
    assert_eq!(
        e.to_string(),
        "memory too small: kernel needs 128 MiB, guest has 64 MiB"
    );

    // Protocol 2.10 has no 64-bit entry point.
    let mut old = bzimage(&payload, 0x80_0000);
    old[0x206..0x208].copy_from_slice(&0x020au16.to_le_bytes());
    let k = d.file("old", &old);
    let e = load(&guest(MEM), params(&k, None, "")).unwrap_err();
    assert!(e.to_string().contains("no 64-bit entry point"), "{e}");
}

#[test]
fn initrd_limit_respects_initrd_addr_max() {
    let d = TempDir::new();
    let payload = vec![0u8; 512];
    let mut b = bzimage(&payload, 0x10_0000);
    b[0x22c..0x230].copy_from_slice(&(0x200_0000u32 - 1).to_le_bytes());
    let k = d.file("bz", &b);
    let i = d.file("initrd", &initrd_bytes(0x3000));
    let s = load(&guest(MEM), params(&k, Some(&i), "")).unwrap();
    assert_eq!(s.initrd, Some((0x200_0000 - 0x3000, 0x3000)));
}

#[test]
fn bad_images_give_clear_errors() {
    let d = TempDir::new();
    let mem = guest(MEM);
    // Random bytes.
    let rnd: Vec<u8> = (0..10000u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    let k = d.file("random", &rnd);
    let e = load(&mem, params(&k, None, "")).unwrap_err();
    assert!(
        e.to_string()
            .starts_with(&format!("not a kernel: {}: ", k.display())),
        "{e}"
    );
    // Empty.
    let k = d.file("empty", &[]);
    assert!(matches!(
        load(&mem, params(&k, None, "")),
        Err(BootError::NotAKernel {
            why: NotAKernel::Empty,
            ..
        })
    ));
    // Missing file.
    let missing = d.0.join("nope");
    assert!(matches!(
        load(&mem, params(&missing, None, "")),
        Err(BootError::Io { .. })
    ));

    let good = elf(true, 0x10_0000, &[load_seg(0x10_0000, &[1; 64], 64)]);
    // Program headers past EOF.
    let k = d.file("trunc-ph", &good[..100]);
    let e = load(&mem, params(&k, None, "")).unwrap_err();
    assert!(
        matches!(
            e,
            BootError::BadImage {
                why: ImageDefect::ProgramHeadersPastEnd {
                    count: 1,
                    offset: 64,
                    end: 120,
                    len: 100
                },
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("program headers"), "{e}");
    // Segment past EOF.
    let k = d.file("trunc-seg", &good[..0x1010]);
    let e = load(&mem, params(&k, None, "")).unwrap_err();
    assert!(e.to_string().contains("past the end of the file"), "{e}");
    assert!(e.to_string().contains("truncated"), "{e}");
    // Truncated ELF header.
    let k = d.file("trunc-eh", &good[..20]);
    assert!(matches!(
        load(&mem, params(&k, None, "")),
        Err(BootError::BadImage { .. })
    ));
    // Every prefix of a good image: errors, never a panic.
    let pvh = elf(
        true,
        0x10_0000,
        &[pvh_note(0x10_0000), load_seg(0x10_0000, &[1; 64], 64)],
    );
    for n in (0..pvh.len()).step_by(7) {
        let _ = KernelImage::from_bytes(&k, pvh[..n].to_vec());
    }
    // Kernel too big for memory.
    let k = d.file(
        "huge",
        &elf(true, 0x10_0000, &[load_seg(0x10_0000, &[1; 16], 100 << 20)]),
    );
    let e = load(&mem, params(&k, None, "")).unwrap_err();
    assert_eq!(
        e.to_string(),
        "memory too small: kernel needs 101 MiB, guest has 64 MiB"
    );
    // A kernel in the MMIO hole.
    let k = d.file(
        "hole",
        &elf(true, 0xd000_0000, &[load_seg(0xd000_0000, &[1; 16], 16)]),
    );
    let mut big = params(&k, None, "");
    big.mem_size = 4 << 30;
    let e = load(&guest(4 << 30), big).unwrap_err();
    assert!(matches!(e, BootError::OutsideRam { .. }), "{e}");
    // Initrd too big.
    let k = d.file("ok", &good);
    let i = d.file("initrd", &vec![0u8; 63 << 20]);
    let e = load(&mem, params(&k, Some(&i), "")).unwrap_err();
    assert!(
        e.to_string()
            .starts_with("memory too small: kernel with initrd"),
        "{e}"
    );
    // A NUL in the command line.
    let e = load(&mem, params(&k, None, "a\0b")).unwrap_err();
    assert!(matches!(e, BootError::CmdlineNul { offset: 1 }), "{e}");
    // A 32-bit ELF with no boot protocol.
    let k = d.file(
        "elf32",
        &elf(false, 0x10_0000, &[load_seg(0x10_0000, &[1; 16], 16)]),
    );
    assert!(matches!(
        load(&mem, params(&k, None, "")),
        Err(BootError::NotAKernel { .. })
    ));
}

/// Everything Lucid wrote for `s`: (what, start, end) of the boot information it points at.
fn lucid_structures(mem: &GuestMemoryMmap, s: &BootSetup) -> Vec<(&'static str, u64, u64)> {
    let mut v = vec![
        ("gdt", s.entry.gdt, s.entry.gdt + BOOT_GDT_SIZE),
        (
            "stack",
            s.entry.stack_top + 16 - BOOT_STACK_SIZE,
            s.entry.stack_top + 16,
        ),
    ];
    if s.entry.page_tables != 0 {
        v.push((
            "page tables",
            s.entry.page_tables,
            s.entry.page_tables + PAGE_TABLES_SIZE,
        ));
    }
    if let Some(rsdp) = s.acpi_rsdp {
        v.push(("rsdp", rsdp, rsdp + 36));
    }
    match s.kind {
        KernelKind::Multiboot => {
            let b = s.boot_info;
            v.push(("mbi", b, b + 88));
            let cmd = u64::from(r32(mem, b + 16));
            v.push(("cmdline", cmd, cmd + cstr(mem, cmd).len() as u64 + 1));
            let mmap = u64::from(r32(mem, b + 48));
            v.push(("mmap", mmap, mmap + u64::from(r32(mem, b + 44))));
            let name = u64::from(r32(mem, b + 64));
            v.push(("loader name", name, name + 6));
        }
        KernelKind::PvhElf => {
            let info: hvm_start_info = mem.read_obj(GuestAddress(s.boot_info)).unwrap();
            v.push(("start_info", s.boot_info, s.boot_info + 56));
            let cmd = info.cmdline_paddr;
            v.push(("cmdline", cmd, cmd + cstr(mem, cmd).len() as u64 + 1));
            let mm = info.memmap_paddr;
            v.push(("memmap", mm, mm + 24 * u64::from(info.memmap_entries)));
        }
        _ => {
            let bp = read_zero_page(mem);
            v.push(("zero page", s.boot_info, s.boot_info + 4096));
            let cmd = u64::from(bp.hdr.cmd_line_ptr);
            v.push(("cmdline", cmd, cmd + cstr(mem, cmd).len() as u64 + 1));
        }
    }
    v
}

fn assert_clear_of(structs: &[(&str, u64, u64)], start: u64, end: u64) {
    for &(what, s, e) in structs {
        assert!(
            e <= start || s >= end,
            "{what} {s:#x}..{e:#x} overlaps the kernel {start:#x}..{end:#x}"
        );
    }
    for (i, a) in structs.iter().enumerate() {
        for b in &structs[i + 1..] {
            assert!(a.2 <= b.1 || b.2 <= a.1, "{a:x?} overlaps {b:x?}");
        }
    }
}

/// A PVH ELF linked with `ld -Ttext=0x100000`: ld puts the ELF headers (and here the note) in a
/// PT_LOAD at 0xff000, below 1 MiB. It loads as under QEMU; the ACPI tables at 0xe0000 stay.
#[test]
fn pvh_headers_at_0xff000_load() {
    let d = TempDir::new();
    let mut hdr_seg = load_seg(0xf_f000, b"\x7fELF headers", 0x1a4);
    hdr_seg.vaddr = 0xf_f000;
    let k = d.file(
        "ttext",
        &elf(
            true,
            0x10_0000,
            &[
                pvh_note(0x10_0000),
                hdr_seg,
                load_seg(0x10_0000, b"text", 0x8000),
            ],
        ),
    );
    let mem = guest(MEM);
    let s = load(&mem, params(&k, None, "x")).unwrap();
    assert_eq!(read::<4>(&mem, 0xf_f000), *b"\x7fELF");
    assert_eq!(s.acpi_rsdp, Some(ACPI_START));
    assert_eq!(s.boot_info, BOOT_INFO, "nothing had to move");
    assert_clear_of(&lucid_structures(&mem, &s), 0xf_f000, 0x10_8000);
}

/// A multiboot kernel linked at 4 KiB with bss up to 0x7b90 (a real-mode style test kernel)
/// covers the usual places of the module list (0x6000) and the multiboot info (0x7000): they
/// move, the kernel's bytes stay as loaded and its bss zero.
#[test]
fn multiboot_in_low_memory_gets_its_structures_elsewhere() {
    let d = TempDir::new();
    let (k, code) = multiboot_elf(&d, "low", 0x1000, 0x700, 0x6b90);
    let rd = initrd_bytes(3000);
    let i = d.file("initrd", &rd);
    let mem = guest(MEM);
    mem.write_slice(&[0xcc; 0x1_0000], GuestAddress(0)).unwrap();
    let s = load(&mem, params(&k, Some(&i), "low=1")).unwrap();
    assert_eq!(s.kind, KernelKind::Multiboot);
    let structs = lucid_structures(&mem, &s);
    assert_clear_of(&structs, 0x1000, 0x7b90);
    assert_ne!(s.boot_info, BOOT_INFO);
    // Module 0 right after the kernel, clear of the rest.
    let (start, size) = s.initrd.unwrap();
    assert_eq!(start, 0x8000);
    assert_clear_of(&structs, start, start + size);
    // The kernel as the file has it, bss zeroed: nothing of Lucid's in between.
    let mut back = vec![0u8; 0x6b90];
    mem.read_slice(&mut back, GuestAddress(0x1000)).unwrap();
    assert_eq!(back[..code.len()], code[..]);
    assert!(back[code.len()..].iter().all(|&b| b == 0));
    assert_eq!(cstr(&mem, u64::from(r32(&mem, s.boot_info + 16))), "low=1");
    assert_eq!(
        s.entry.mode,
        EntryMode::Protected32 {
            eip: 0x100c,
            eax: u64::from(MULTIBOOT_BOOTLOADER_MAGIC),
            ebx: s.boot_info
        }
    );
}

/// A vmlinux linked into low memory: the zero page, command line, GDT, stack and page tables all
/// move out of its way.
#[test]
fn linux_elf_in_low_memory_moves_the_zero_page_and_page_tables() {
    let d = TempDir::new();
    let k = d.file(
        "low",
        &elf(true, 0x5000, &[load_seg(0x500, &[1; 16], 0xf000)]),
    );
    let mem = guest(MEM);
    let s = load(&mem, params(&k, None, "console=ttyS0")).unwrap();
    assert_clear_of(&lucid_structures(&mem, &s), 0x500, 0xf500);
    assert_eq!(s.entry.page_tables % 0x1000, 0);
    assert_eq!(s.boot_info % 0x1000, 0);
}

/// The one structure with a fixed home: an image that fills the BIOS area leaves the RSDP no
/// room, and the error says what is there.
#[test]
fn image_over_the_whole_bios_area_is_a_real_overlap() {
    let d = TempDir::new();
    // a.out kludge: load at 0xe0000, bss to 1 MiB.
    let mut img = multiboot_header(1 << 16, Some([0xe_0000, 0xe_0000, 0, 0x10_0000, 0xe_0020]));
    img.extend_from_slice(&[0x90; 64]);
    let k = d.file("bios", &img);
    let e = load(&guest(MEM), params(&k, None, "")).unwrap_err();
    assert!(
        matches!(
            e,
            BootError::NoRoom {
                what: "ACPI RSDP",
                ..
            }
        ),
        "{e}"
    );
    assert_eq!(
        e.to_string(),
        "no room for ACPI RSDP (36 bytes) in 0xe0000..0x100000: kernel 0xe0000..0x100000"
    );
    // Without ACPI the same image loads.
    let s = load(
        &guest(MEM),
        BootParams {
            acpi: None,
            ..params(&k, None, "")
        },
    )
    .unwrap();
    assert_eq!(s.acpi_rsdp, None);
}

/// An image that leaves the RSDP its 16 bytes at 0xe0000 but not the tables after it: the
/// tables go to free low RAM, reserved in the memory map, and the RSDP points at them.
#[test]
fn acpi_tables_move_out_of_a_crowded_bios_area() {
    let d = TempDir::new();
    let mut img = multiboot_header(1 << 16, Some([0xe_0100, 0xe_0100, 0, 0x10_0000, 0xe_0120]));
    img.extend_from_slice(&[0x90; 64]);
    let k = d.file("bios", &img);
    let mem = guest(MEM);
    let s = load(&mem, params(&k, None, "")).unwrap();
    assert_eq!(s.acpi_rsdp, Some(ACPI_START));
    let xsdt = r64(&mem, ACPI_START + 24);
    assert!(xsdt < EBDA_START, "tables moved to low RAM: {xsdt:#x}");
    assert_eq!(&read::<4>(&mem, xsdt), b"XSDT");
    // The memory map given to the guest reserves them.
    let b = s.boot_info;
    let (len, addr) = (u64::from(r32(&mem, b + 44)), u64::from(r32(&mem, b + 48)));
    let reserved = (0..len / 24).any(|n| {
        let a = addr + 24 * n;
        let (base, size, kind) = (r64(&mem, a + 4), r64(&mem, a + 12), r32(&mem, a + 20));
        kind == E820_RESERVED && base <= xsdt && xsdt < base + size
    });
    assert!(reserved, "ACPI tables not reserved in the memory map");
    assert_clear_of(&lucid_structures(&mem, &s), 0xe_0100, 0x10_0000);
}

/// Kernels and initrds that are not regular files, or are too big, are refused before a byte is
/// read: reading /dev/zero or a FIFO without a writer never ends.
#[test]
fn non_regular_and_oversized_files_are_refused() {
    use crate::file::{FileKind, MAX_KERNEL_FILE};
    let d = TempDir::new();
    let mem = guest(MEM);
    let fifo = d.0.join("fifo");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: mkfifo with a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let zero = std::path::Path::new("/dev/zero");
    for (path, kind) in [
        (zero, FileKind::CharDevice),
        (fifo.as_path(), FileKind::Fifo),
        (d.0.as_path(), FileKind::Directory),
    ] {
        let e = load(&mem, params(path, None, "")).unwrap_err();
        assert!(
            matches!(e, BootError::NotARegularFile { what: "kernel", kind: k, .. } if k == kind),
            "{e}"
        );
        assert!(e.to_string().contains("not a regular file"), "{e}");
    }
    let good = d.file(
        "ok",
        &elf(true, 0x10_0000, &[load_seg(0x10_0000, &[1; 64], 64)]),
    );
    for (path, kind) in [
        (zero, FileKind::CharDevice),
        (fifo.as_path(), FileKind::Fifo),
    ] {
        let e = load(&mem, params(&good, Some(path), "")).unwrap_err();
        assert!(
            matches!(e, BootError::NotARegularFile { what: "initrd", kind: k, .. } if k == kind),
            "{e}"
        );
    }
    // Sparse files: sizes from metadata, nothing read.
    let sparse = |name: &str, len: u64| {
        let p = d.0.join(name);
        std::fs::File::create(&p).unwrap().set_len(len).unwrap();
        p
    };
    let huge = sparse("huge", MAX_KERNEL_FILE + 1);
    let e = load(&mem, params(&huge, None, "")).unwrap_err();
    assert!(
        matches!(e, BootError::FileTooLarge { what: "kernel", size, max, .. }
            if size == MAX_KERNEL_FILE + 1 && max == MAX_KERNEL_FILE),
        "{e}"
    );
    let big_initrd = sparse("big-initrd", MEM + 1);
    let e = load(&mem, params(&good, Some(&big_initrd), "")).unwrap_err();
    assert!(
        matches!(
            e,
            BootError::FileTooLarge {
                what: "initrd",
                max: MEM,
                ..
            }
        ),
        "{e}"
    );
}

#[test]
fn long64_regs_and_page_tables() {
    let mem = guest(MEM);
    let mut regs = kvm_regs::default();
    let mut sregs = kvm_sregs {
        apic_base: 0xfee0_0900,
        ..Default::default()
    };
    sregs.tr.type_ = 11;
    let entry = EntryState {
        mode: EntryMode::Long64 {
            rip: 0x100_0000,
            rsi: BOOT_INFO,
        },
        gdt: BOOT_GDT,
        stack_top: 0x8ff0,
        page_tables: PML4,
    };
    setup_boot_regs(&entry, &mut regs, &mut sregs, &mem).unwrap();
    assert_eq!(
        (regs.rip, regs.rsi, regs.rflags),
        (0x100_0000, BOOT_INFO, 2)
    );
    assert_eq!(regs.rsp, 0x8ff0);
    assert_eq!(sregs.cr3, PML4);
    assert_eq!(sregs.cr0, 0x8000_0031);
    assert_eq!(sregs.cr4, 0x20);
    assert_eq!(sregs.efer, 0x500);
    assert_eq!(sregs.apic_base, 0xfee0_0900, "kept");
    assert_eq!(sregs.tr.type_, 11, "kept");
    assert_eq!(sregs.cs.selector, selectors::CODE64);
    assert_eq!(
        (sregs.cs.l, sregs.cs.db, sregs.cs.present, sregs.cs.s),
        (1, 0, 1, 1)
    );
    assert_eq!(sregs.cs.type_, 0xb);
    for s in [sregs.ds, sregs.es, sregs.fs, sregs.gs, sregs.ss] {
        assert_eq!(s.selector, selectors::DATA);
        assert_eq!(
            (s.type_, s.db, s.g, s.limit, s.base),
            (3, 1, 1, 0xffff_ffff, 0)
        );
    }
    assert_eq!((sregs.gdt.base, sregs.gdt.limit), (BOOT_GDT, 31));
    // GDT as Linux wants it: __BOOT_CS 0x10, __BOOT_DS 0x18.
    assert_eq!(r64(&mem, BOOT_GDT), 0);
    assert_eq!(r64(&mem, BOOT_GDT + 0x10), 0x00af_9b00_0000_ffff);
    assert_eq!(r64(&mem, BOOT_GDT + 0x18), 0x00cf_9300_0000_ffff);
    // Identity map of 4 GiB.
    let (pdpt, pd) = (PML4 + 0x1000, PML4 + 0x2000);
    assert_eq!(r64(&mem, PML4), pdpt | 3);
    assert_eq!(r64(&mem, PML4 + 8), 0);
    for i in 0..4 {
        assert_eq!(r64(&mem, pdpt + 8 * i), (pd + 0x1000 * i) | 3);
    }
    assert_eq!(r64(&mem, pdpt + 32), 0);
    assert_eq!(r64(&mem, pd), 0x83);
    assert_eq!(r64(&mem, pd + 8), 0x20_0083);
    assert_eq!(r64(&mem, pd + 8 * 2047), 0xffe0_0083);
}

#[test]
fn protected32_regs() {
    let mem = guest(MEM);
    let mut regs = kvm_regs {
        rcx: 5,
        ..Default::default()
    };
    let mut sregs = kvm_sregs {
        cr0: 0x6000_0010,
        efer: 0x500,
        ..Default::default()
    };
    let entry = EntryState {
        mode: EntryMode::Protected32 {
            eip: 0x10_000c,
            eax: 0x2BAD_B002,
            ebx: BOOT_INFO,
        },
        gdt: BOOT_GDT,
        stack_top: 0x8ff0,
        page_tables: 0,
    };
    setup_boot_regs(&entry, &mut regs, &mut sregs, &mem).unwrap();
    assert_eq!(
        (regs.rip, regs.rax, regs.rbx),
        (0x10_000c, 0x2BAD_B002, BOOT_INFO)
    );
    assert_eq!((regs.rcx, regs.rflags), (0, 2));
    assert_eq!((sregs.cr0, sregs.cr4, sregs.efer), (0x11, 0, 0));
    assert_eq!(sregs.cs.selector, selectors::CODE32);
    assert_eq!(
        (sregs.cs.db, sregs.cs.l, sregs.cs.limit),
        (1, 0, 0xffff_ffff)
    );
    assert_eq!(r64(&mem, BOOT_GDT + 8), 0x00cf_9b00_0000_ffff);
    assert_eq!(sregs.ss.selector, selectors::DATA);
}

fn checksum_ok(b: &[u8]) -> bool {
    b.iter().fold(0u8, |a, x| a.wrapping_add(*x)) == 0
}

/// Reads a whole table at `addr` (length from its header), checks its checksum.
fn table(mem: &GuestMemoryMmap, addr: u64) -> Vec<u8> {
    let len = r32(mem, addr + 4) as usize;
    assert!((36..0x10000).contains(&len));
    let mut b = vec![0u8; len];
    mem.read_slice(&mut b, GuestAddress(addr)).unwrap();
    assert!(
        checksum_ok(&b),
        "checksum of {:?}",
        String::from_utf8_lossy(&b[..4])
    );
    b
}

#[test]
fn acpi_tables_walk() {
    let mem = guest(MEM);
    let cfg = AcpiConfig {
        pci_ecam: Some((PCI_ECAM_START, 0, 255)),
        i8042: true,
        ..AcpiConfig::new(3)
    };
    let rsdp = write_acpi_tables(&mem, &cfg).unwrap();
    assert_eq!(rsdp, ACPI_START);
    // A legacy scan: "RSD PTR " on a 16-byte boundary in 0xe0000..0x100000.
    let found = (ACPI_START..ACPI_END)
        .step_by(16)
        .find(|&a| read::<8>(&mem, a) == *b"RSD PTR ")
        .unwrap();
    assert_eq!(found, rsdp);
    let r: [u8; 36] = read(&mem, rsdp);
    assert!(checksum_ok(&r[..20]) && checksum_ok(&r));
    assert_eq!(r[15], 2, "revision");
    let xsdt_addr = u64::from_le_bytes(r[24..32].try_into().unwrap());
    let xsdt = table(&mem, xsdt_addr);
    assert_eq!(&xsdt[..4], b"XSDT");
    let mut sigs = Vec::new();
    for e in xsdt[36..].chunks(8) {
        let a = u64::from_le_bytes(e.try_into().unwrap());
        assert!((ACPI_START..ACPI_END).contains(&a));
        let t = table(&mem, a);
        sigs.push(String::from_utf8(t[..4].to_vec()).unwrap());
        match &t[..4] {
            b"FACP" => {
                let u16_at = |o: usize| u16::from_le_bytes(t[o..o + 2].try_into().unwrap());
                let u32_at = |o: usize| u32::from_le_bytes(t[o..o + 4].try_into().unwrap());
                let flags = u32_at(112);
                assert_eq!(flags & (1 << 20), 0, "not HW_REDUCED_ACPI");
                assert_ne!(flags & (1 << 8), 0, "TMR_VAL_EXT: 32-bit PM timer");
                assert_eq!(u16_at(46), 9, "SCI_INT");
                assert_eq!(u32_at(48), 0, "no SMI_CMD: always in ACPI mode");
                assert_eq!(
                    (u32_at(56), u32_at(64), u32_at(76)),
                    (0x600, 0x604, 0x608),
                    "PM1a_EVT, PM1a_CNT, PM_TMR"
                );
                assert_eq!((t[88], t[89], t[91], t[92]), (4, 2, 4, 0), "block lengths");
                // X_PM_TMR_BLK: GAS, system I/O, 32 bits, dword access, 0x608.
                assert_eq!(t[208..212], [1, 32, 0, 3]);
                assert_eq!(u64::from_le_bytes(t[212..220].try_into().unwrap()), 0x608);
                let facs = u64::from(u32_at(36));
                assert_eq!(facs % 64, 0, "FACS 64-byte aligned");
                let f: [u8; 64] = read(&mem, facs);
                assert_eq!(&f[..4], b"FACS");
                assert_eq!(u32::from_le_bytes(f[4..8].try_into().unwrap()), 64);
                assert_eq!(f[32], 2, "FACS version");
                let iapc = u16::from_le_bytes(t[109..111].try_into().unwrap());
                assert_ne!(iapc & 2, 0, "8042 present");
                let x_dsdt = u64::from_le_bytes(t[140..148].try_into().unwrap());
                let dsdt = table(&mem, x_dsdt);
                assert_eq!(&dsdt[..4], b"DSDT");
                let aml = &dsdt[36..];
                let has = |s: &[u8]| aml.windows(s.len()).any(|w| w == s);
                assert!(has(b"_SB_") && has(b"COM1") && has(b"PS2K") && has(b"PCI0"));
                // Name(_S5_, Package(4) {0, 0, 0, 0}): NameOp, name, PackageOp, len, 4 elements.
                assert!(has(&[
                    0x08, b'_', b'S', b'5', b'_', 0x12, 0x06, 0x04, 0, 0, 0, 0
                ]));
                assert!(!has(b"_S3_"), "no suspend offered");
                // EISAID("PNP0501") = 0x0105d041 little-endian.
                assert!(has(&0x0105_d041u32.to_le_bytes()));
            }
            b"APIC" => {
                assert_eq!(
                    u32::from_le_bytes(t[36..40].try_into().unwrap()),
                    0xfee0_0000
                );
                assert_eq!(u32::from_le_bytes(t[40..44].try_into().unwrap()) & 1, 1);
                let mut off = 44;
                let mut lapics = Vec::new();
                let mut ioapic = None;
                let mut isos = Vec::new();
                while off < t.len() {
                    let (ty, len) = (t[off], t[off + 1] as usize);
                    assert!(len >= 2);
                    match ty {
                        0 => lapics.push((t[off + 2], t[off + 3], t[off + 4] & 1)),
                        1 => {
                            ioapic = Some((
                                t[off + 2],
                                u32::from_le_bytes(t[off + 4..off + 8].try_into().unwrap()),
                                u32::from_le_bytes(t[off + 8..off + 12].try_into().unwrap()),
                            ))
                        }
                        2 => isos.push((
                            t[off + 3],
                            u32::from_le_bytes(t[off + 4..off + 8].try_into().unwrap()),
                            u16::from_le_bytes(t[off + 8..off + 10].try_into().unwrap()),
                        )),
                        _ => {}
                    }
                    off += len;
                }
                assert_eq!(off, t.len());
                assert_eq!(lapics, vec![(0, 0, 1), (1, 1, 1), (2, 2, 1)]);
                assert_eq!(ioapic, Some((3, 0xfec0_0000, 0)));
                assert_eq!(isos, vec![(0, 2, 0), (9, 9, 0xd)]);
            }
            b"MCFG" => {
                assert_eq!(t.len(), 44 + 16);
                assert_eq!(
                    u64::from_le_bytes(t[44..52].try_into().unwrap()),
                    PCI_ECAM_START
                );
                assert_eq!((t[54], t[55]), (0, 255));
            }
            _ => {}
        }
    }
    assert_eq!(sigs, ["FACP", "APIC", "MCFG"]);

    // Without PCI: no MCFG, no PCI0.
    let mem = guest(MEM);
    let rsdp = write_acpi_tables(&mem, &AcpiConfig::new(1)).unwrap();
    let xsdt = table(&mem, r64(&mem, rsdp + 24));
    assert_eq!(xsdt.len(), 36 + 16);

    // Without PM: a hardware-reduced FADT, no FACS, no _S5_.
    let mem = guest(MEM);
    let cfg = AcpiConfig {
        pm: false,
        ..AcpiConfig::new(1)
    };
    let rsdp = write_acpi_tables(&mem, &cfg).unwrap();
    let fadt = table(&mem, r64(&mem, r64(&mem, rsdp + 24) + 36));
    assert_eq!(&fadt[..4], b"FACP");
    let flags = u32::from_le_bytes(fadt[112..116].try_into().unwrap());
    assert_ne!(flags & (1 << 20), 0, "HW_REDUCED_ACPI");
    assert_eq!(fadt[36..40], [0; 4], "no FACS");
    assert_eq!(fadt[76..80], [0; 4], "no PM timer");

    assert!(matches!(
        write_acpi_tables(&mem, &AcpiConfig::new(0)),
        Err(BootError::BadVcpuCount(0))
    ));
    // The largest vCPU count still fits the ACPI area.
    write_acpi_tables(&mem, &AcpiConfig::new(254)).unwrap();
}

#[test]
fn pci_intx_gsis_rotate_over_the_eight_pci_pins() {
    assert_eq!(pci_intx_gsi(1, 0), PCI_INTX_FIRST_GSI);
    assert_eq!(pci_intx_gsi(8, 0), 23);
    assert_eq!(pci_intx_gsi(9, 0), 16);
    assert_eq!(
        pci_intx_gsi(2, 3),
        20,
        "INTD of slot 2 shares slot 5's INTA"
    );
    assert_eq!(pci_intx_gsi(31, 3), 16 + (30 + 3) % 8);
    for slot in 1..32 {
        for pin in 0..4 {
            assert!((16..24).contains(&pci_intx_gsi(slot, pin)));
        }
    }
}

/// The root bridge has a `_PRT` that routes every slot's INTA-INTD to the GSI the VMM raises
/// (before it, Linux printed `PCI INT A: no GSI` for every device).
#[test]
fn dsdt_routes_pci_intx_to_the_vmm_gsis() {
    let mem = guest(MEM);
    let cfg = AcpiConfig {
        pci_ecam: Some((PCI_ECAM_START, 0, 255)),
        ..AcpiConfig::new(1)
    };
    let rsdp = write_acpi_tables(&mem, &cfg).unwrap();
    let xsdt = table(&mem, r64(&mem, rsdp + 24));
    let fadt = table(&mem, u64::from_le_bytes(xsdt[36..44].try_into().unwrap()));
    let dsdt = table(&mem, u64::from_le_bytes(fadt[140..148].try_into().unwrap()));
    let aml = &dsdt[36..];
    let at = |s: &[u8]| aml.windows(s.len()).position(|w| w == s);
    let prt = at(b"_PRT").expect("_PRT in the DSDT");
    assert!(at(b"PCI0").unwrap() < prt, "_PRT belongs to PCI0");
    // Package (4) { 0xSSSSFFFF, pin, Zero, GSI }: PackageOp, length, count, DWordConst, pin
    // (Zero/One/BytePrefix n), source Zero, GSI (BytePrefix n).
    let entry = |slot: u8, pin: u8| {
        let mut e = vec![0x12, 0, 4, 0x0c, 0xff, 0xff, slot, 0];
        match pin {
            0 => e.push(0x00),
            1 => e.push(0x01),
            p => e.extend([0x0a, p]),
        }
        e.extend([0x00, 0x0a, pci_intx_gsi(slot, pin) as u8]);
        e[1] = (e.len() - 1) as u8;
        e
    };
    let mut entries = 0;
    for slot in 1..32u8 {
        for pin in 0..4u8 {
            assert!(at(&entry(slot, pin)).is_some(), "slot {slot} pin {pin}");
            entries += 1;
        }
    }
    assert_eq!(entries, 124);
    assert!(at(&entry(1, 0)).unwrap() > prt);

    // Without PCI there is no root bridge and no _PRT.
    let mem = guest(MEM);
    let rsdp = write_acpi_tables(&mem, &AcpiConfig::new(1)).unwrap();
    let xsdt = table(&mem, r64(&mem, rsdp + 24));
    let fadt = table(&mem, u64::from_le_bytes(xsdt[36..44].try_into().unwrap()));
    let dsdt = table(&mem, u64::from_le_bytes(fadt[140..148].try_into().unwrap()));
    assert!(!dsdt.windows(4).any(|w| w == b"_PRT"));
}

/// Loads a real kernel: `LUCID_TEST_BZIMAGE=/path/vmlinuz` and/or
/// `LUCID_TEST_VMLINUX=/path/vmlinux` (e.g. Debian's linux-image-*-cloud-amd64; its bzImage
/// payload decompressed with `lz4 -d` is a PVH ELF).
#[test]
#[ignore]
fn real_kernels() {
    let mem_size = 256 << 20;
    if let Ok(p) = std::env::var("LUCID_TEST_BZIMAGE") {
        let mem = guest(mem_size);
        let k = PathBuf::from(p);
        let s = load(
            &mem,
            BootParams {
                mem_size,
                ..params(&k, None, "console=ttyS0")
            },
        )
        .unwrap();
        assert_eq!(s.kind, KernelKind::BzImage);
        assert!(matches!(
            s.entry.mode,
            EntryMode::Long64 { rip: 0x10_0200, .. }
        ));
        let bp = read_zero_page(&mem);
        assert_eq!({ bp.hdr.header }, 0x5372_6448);
        eprintln!("bzImage: {s:?}");
    }
    if let Ok(p) = std::env::var("LUCID_TEST_VMLINUX") {
        let mem = guest(mem_size);
        let k = PathBuf::from(p);
        let s = load(
            &mem,
            BootParams {
                mem_size,
                ..params(&k, None, "console=ttyS0")
            },
        )
        .unwrap();
        assert_eq!(s.kind, KernelKind::PvhElf);
        eprintln!("vmlinux: {s:?}");
        let e = load(
            &guest(16 << 20),
            BootParams {
                mem_size: 16 << 20,
                ..params(&k, None, "")
            },
        )
        .unwrap_err();
        eprintln!("16 MiB: {e}");
        assert!(matches!(e, BootError::MemoryTooSmall { .. }));
    }
}

/// Boots tiny guests on /dev/kvm through the first stages of Lucid's `VmBuilder` (which loads
/// with this crate's `load_image`, `setup_boot_regs` and `filter_cpuid`) and checks what they
/// report on port 0xf4. Skipped on a host without /dev/kvm.
mod kvm {
    use super::*;
    use lucid_vmm::lucid_boot as boot;
    use lucid_vmm::lucid_hv::Exit;
    use lucid_vmm::{KernelLoad, VmBuilder};

    /// Runs the boot vCPU of a VM without interrupt controllers until HLT; returns the dwords
    /// written to port 0xf4. `before` may prepare guest memory before the kernel is loaded.
    fn run(kernel: &std::path::Path, before: impl FnOnce(&GuestMemoryMmap)) -> Option<Vec<u32>> {
        // Only a host without KVM skips (not in CI); any other failure to build the VM fails.
        if !std::path::Path::new("/dev/kvm").exists() {
            lucid_guests::skip_or_fail("no /dev/kvm");
            return None;
        }
        let b = VmBuilder::new(MEM, Default::default()).expect("build the VM on /dev/kvm");
        before(b.memory());
        let image = boot::KernelImage::open(kernel).unwrap();
        let load = KernelLoad {
            image: &image,
            initrd: None,
            cmdline: "",
            acpi: None,
        };
        let setup = b.load_kernel(&load).unwrap();
        let mut vcpu = b.vcpu(0, 1, Some(&setup), |_| {}).unwrap();
        let mut out = Vec::new();
        for _ in 0..20 {
            match vcpu.run() {
                Ok(Exit::IoOut(0xf4, data)) => {
                    out.push(u32::from_le_bytes(data.try_into().unwrap()))
                }
                Ok(Exit::Hlt) => return Some(out),
                other => {
                    let s = format!("{other:?}");
                    panic!(
                        "unexpected exit {s}, regs {:x?}, out {out:x?}",
                        vcpu.get_regs().unwrap()
                    )
                }
            }
        }
        panic!("guest did not halt; out {out:x?}");
    }

    const OUT_HLT: [u8; 6] = [0x66, 0xba, 0xf4, 0x00, 0xef, 0xf4]; // mov dx,0xf4; out dx,eax; hlt

    #[test]
    fn pvh_guest_sees_start_info() {
        let d = TempDir::new();
        // mov eax,[ebx]; push eax; pop ecx; mov eax,ecx; mov dx,0xf4; out dx,eax; mov eax,ebx;
        // out dx,eax; hlt
        let code = [
            0x8b, 0x03, 0x50, 0x59, 0x89, 0xc8, 0x66, 0xba, 0xf4, 0x00, 0xef, 0x89, 0xd8, 0xef,
            0xf4,
        ];
        let k = d.file(
            "pvh",
            &elf(
                true,
                0,
                &[pvh_note(0x10_0000), load_seg(0x10_0000, &code, 0x1000)],
            ),
        );
        if let Some(out) = run(&k, |_| {}) {
            assert_eq!(out, vec![HVM_START_MAGIC, BOOT_INFO as u32]);
        }
    }

    #[test]
    fn multiboot_guest_sees_magic_and_info() {
        let d = TempDir::new();
        let mut seg = multiboot_header(0x2, None);
        // mov dx,0xf4; out dx,eax; mov eax,[ebx]; out dx,eax; hlt
        seg.extend_from_slice(&[0x66, 0xba, 0xf4, 0x00, 0xef, 0x8b, 0x03, 0xef, 0xf4]);
        let k = d.file(
            "mb",
            &elf(false, 0x10_000c, &[load_seg(0x10_0000, &seg, 0x1000)]),
        );
        if let Some(out) = run(&k, |_| {}) {
            assert_eq!(out[0], MULTIBOOT_BOOTLOADER_MAGIC);
            assert_eq!(out[1] & mbi_flags::MMAP, mbi_flags::MMAP);
        }
    }

    #[test]
    fn linux_elf_guest_runs_in_long_mode() {
        let d = TempDir::new();
        // mov eax,[rsi+0x202]; push rax; pop rcx; mov eax,ecx; mov dx,0xf4; out dx,eax;
        // mov eax,[0x3fffff0]; out dx,eax; mov rax,0x123456789; shr rax,4; out dx,eax; hlt
        let mut code = vec![
            0x8b, 0x86, 0x02, 0x02, 0x00, 0x00, 0x50, 0x59, 0x89, 0xc8, 0x66, 0xba, 0xf4, 0x00,
            0xef, 0x8b, 0x04, 0x25, 0xf0, 0xff, 0xff, 0x03, 0xef,
        ];
        code.extend_from_slice(&[0x48, 0xb8]);
        code.extend_from_slice(&0x1_2345_6789u64.to_le_bytes());
        code.extend_from_slice(&[0x48, 0xc1, 0xe8, 0x04, 0xef]);
        code.extend_from_slice(&OUT_HLT[5..]);
        let seg = Ph {
            vaddr: 0xffff_ffff_8100_0000,
            ..load_seg(0x100_0000, &code, 0x1000)
        };
        let k = d.file("vmlinux", &elf(true, 0x100_0000, &[seg]));
        let out = run(&k, |mem| {
            mem.write_obj(0xfeed_f00du32, GuestAddress(0x3ff_fff0))
                .unwrap()
        });
        if let Some(out) = out {
            assert_eq!(out, vec![0x5372_6448, 0xfeed_f00d, 0x1234_5678]);
        }
    }

    /// Boots a real kernel until it prints `Linux version`, the e820 map and the ACPI tables on
    /// the serial port
    /// (`LUCID_TEST_BZIMAGE` / `LUCID_TEST_VMLINUX`, see `real_kernels`). COM1 is faked just enough
    /// (LSR says "transmitter empty"); everything else reads as 0xff / is ignored.
    #[test]
    #[ignore]
    fn real_kernel_prints_banner() {
        for var in ["LUCID_TEST_BZIMAGE", "LUCID_TEST_VMLINUX"] {
            let Ok(p) = std::env::var(var) else { continue };
            let mem_size = 256 << 20;
            let Ok(mut b) = VmBuilder::new(mem_size, Default::default()) else {
                return;
            };
            b.irqchip().unwrap();
            let image = boot::KernelImage::open(std::path::Path::new(&p)).unwrap();
            let s = b
                .load_kernel(&KernelLoad {
                    image: &image,
                    initrd: None,
                    cmdline: "console=ttyS0 earlyprintk=serial,ttyS0,115200 noxsave \
                              clearcpuid=141,154,156",
                    acpi: Some(&boot::AcpiConfig::new(1)),
                })
                .unwrap();
            let mut vcpu = b.vcpu(0, 1, Some(&s), |_| {}).unwrap();
            let mut console = Vec::new();
            let start = std::time::Instant::now();
            let done = |c: &[u8]| {
                let t = String::from_utf8_lossy(c);
                // Linux lists the ACPI tables it found: RSDP, XSDT, FACP, DSDT, APIC.
                t.contains("Linux version") && t.contains("ACPI: APIC")
            };
            // A bzImage decompresses itself under instruction emulation on PVM hosts: minutes.
            while !done(&console) && start.elapsed().as_secs() < 400 {
                match vcpu.run() {
                    Ok(Exit::IoOut(0x3f8, data)) => console.extend_from_slice(data),
                    Ok(Exit::IoOut(..)) | Ok(Exit::MmioWrite(..)) | Ok(Exit::Interrupted) => {}
                    Ok(Exit::IoIn(port, data)) => {
                        let v = if port == 0x3fd { 0x60 } else { 0xff };
                        data.fill(v);
                    }
                    Ok(Exit::MmioRead(_, data)) => data.fill(0xff),
                    other => {
                        let s = format!("{other:?}");
                        eprintln!("{}", String::from_utf8_lossy(&console));
                        panic!("{var}: exit {s} at {:#x}", vcpu.get_regs().unwrap().rip);
                    }
                }
            }
            let text = String::from_utf8_lossy(&console);
            eprintln!("--- {var} ({:?}) ---\n{text}", start.elapsed());
            assert!(
                done(&console),
                "{var}: no banner and ACPI tables within 400 s"
            );
            assert!(text.contains("BIOS-e820: [mem 0x0000000000100000-0x000000000fffffff] usable"));
        }
    }
}

/// The kernel-loader fuzz targets' seeds (`fuzz/seeds/boot_*`, image then an options byte) are
/// the kernels they are named after and load.
#[test]
fn fuzz_seeds_load() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../../fuzz/seeds");
    for (seed, kind) in [
        ("boot_elf/hello.elf", KernelKind::PvhElf),
        ("boot_elf/pvh-ttext.elf", KernelKind::PvhElf),
        ("boot_elf/mb-lowmem.elf", KernelKind::Multiboot),
        ("boot_elf/vmlinux-shaped", KernelKind::LinuxElf),
        ("boot_multiboot/aout-kludge-flat", KernelKind::Multiboot),
        (
            "boot_multiboot/aout-low-memory-mem-info",
            KernelKind::Multiboot,
        ),
        ("boot_bzimage/setup-header-2.15", KernelKind::BzImage),
        ("boot_bzimage/pref-address-high", KernelKind::BzImage),
    ] {
        let mut bytes = std::fs::read(format!("{dir}/{seed}")).unwrap();
        bytes.pop();
        let image = KernelImage::from_bytes(seed.as_ref(), bytes).unwrap();
        assert_eq!(image.kind(), kind, "{seed}");
        let mem = guest(16 << 20);
        let p = BootParams {
            mem_size: 16 << 20,
            ..params(image.path(), None, "")
        };
        load_image(&mem, &image, &p).unwrap_or_else(|e| panic!("{seed}: {e}"));
    }
}

/// Found by fuzzing (`boot_bzimage`): a bzImage whose `pref_address` + `init_size` wraps around
/// 2^64 made the loader panic on the overflow (debug builds) or wrap past its RAM check.
#[test]
fn bzimage_decompression_area_that_wraps_is_refused() {
    // The fuzz input: the image, then the target's options byte.
    let input = include_bytes!("fuzz-regressions/bzimage-pref-address-wraps");
    let (_, bytes) = input.split_last().unwrap();
    let image = KernelImage::from_bytes("wraps".as_ref(), bytes.to_vec()).unwrap();
    assert_eq!(image.kind(), KernelKind::BzImage);
    let mem = guest(16 << 20);
    let p = BootParams {
        mem_size: 16 << 20,
        ..params(image.path(), None, "")
    };
    let err = load_image(&mem, &image, &p).unwrap_err();
    assert!(
        matches!(
            err,
            BootError::BadImage {
                why: ImageDefect::BzImageDecompressionWraps {
                    pref: 0xffff_ffff_fff0_0000,
                    init_size: 0x40_00ff
                },
                ..
            }
        ),
        "{err}"
    );
}

/// A DMAR table as a guest's parser reads it (Intel VT-d spec 8.1-8.3, Linux's dmar.c): the
/// header fields, then each remapping structure and each DRHD's device scopes.
#[derive(Debug, PartialEq, Eq)]
struct ParsedDmar {
    haw: u8,
    flags: u8,
    drhds: Vec<Drhd>,
}

/// A device scope: (type, enumeration id, start bus, path of (device, function)).
type Scope = (u8, u8, u8, Vec<(u8, u8)>);
/// A DRHD: (flags, size, segment, register base, scopes).
type Drhd = (u8, u8, u16, u64, Vec<Scope>);

fn parse_dmar(t: &[u8]) -> Result<ParsedDmar, String> {
    if t.len() < 48 || &t[..4] != b"DMAR" {
        return Err("not a DMAR".into());
    }
    if u32::from_le_bytes(t[4..8].try_into().unwrap()) as usize != t.len() {
        return Err("length".into());
    }
    if !checksum_ok(t) {
        return Err("checksum".into());
    }
    let mut out = ParsedDmar {
        haw: t[36],
        flags: t[37],
        drhds: Vec::new(),
    };
    let mut off = 48;
    while off < t.len() {
        let hdr = t.get(off..off + 4).ok_or("truncated structure header")?;
        let ty = u16::from_le_bytes([hdr[0], hdr[1]]);
        let len = u16::from_le_bytes([hdr[2], hdr[3]]) as usize;
        let s = t.get(off..off + len).ok_or("structure past the end")?;
        if len < 16 {
            return Err(format!("structure length {len}"));
        }
        if ty == 0 {
            let mut scopes = Vec::new();
            let mut so = 16;
            while so < len {
                let sc = s.get(so..).ok_or("scope")?;
                let slen = *sc.get(1).ok_or("scope length")? as usize;
                if slen < 6 || !(slen - 6).is_multiple_of(2) || sc.len() < slen {
                    return Err(format!("scope length {slen}"));
                }
                let path = sc[6..slen].chunks(2).map(|p| (p[0], p[1])).collect();
                scopes.push((sc[0], sc[4], sc[5], path));
                so += slen;
            }
            out.drhds.push((
                s[4],
                s[5],
                u16::from_le_bytes([s[6], s[7]]),
                u64::from_le_bytes(s[8..16].try_into().unwrap()),
                scopes,
            ));
        }
        off += len;
    }
    Ok(out)
}

#[test]
fn dmar_table_fields_and_checksum() {
    let cfg = AcpiConfig {
        dmar: Some(acpi::DmarUnit {
            base: 0xfed9_0000,
            pages: 2,
        }),
        ..AcpiConfig::new(2)
    };
    let t = acpi::dmar(&cfg, cfg.dmar.as_ref().unwrap());
    if let Some(p) = std::env::var_os("LUCID_DUMP_DMAR") {
        std::fs::write(p, &t).unwrap();
    }
    assert_eq!(&t[..4], b"DMAR");
    assert_eq!(t[8], 1, "revision 1");
    assert!(checksum_ok(&t));
    assert_eq!(t.len(), 48 + 16 + 8);
    let d = parse_dmar(&t).unwrap();
    assert_eq!(
        d,
        ParsedDmar {
            haw: 47,
            flags: 1,
            // INCLUDE_PCI_ALL, 2^1 pages, segment 0, the base; the I/O APIC (ID 2 = vcpus, as
            // in the MADT) at ff:00.0.
            drhds: vec![(1, 1, 0, 0xfed9_0000, vec![(3, 2, 0xff, vec![(0, 0)])])],
        }
    );
    // Sizes round up to a power of two, within the 4-bit field.
    for (pages, n) in [(0, 0), (1, 0), (3, 2), (u32::MAX, 15)] {
        let t = acpi::dmar(&cfg, &acpi::DmarUnit { base: 0, pages });
        assert_eq!(parse_dmar(&t).unwrap().drhds[0].1, n, "{pages} pages");
    }
    // The parser catches what a broken table would do.
    let mut bad = t.clone();
    bad[50] = 0xff;
    assert!(parse_dmar(&bad).is_err());
}

#[test]
fn dmar_table_in_the_xsdt_only_with_an_iommu() {
    let sigs = |cfg: &AcpiConfig| {
        let mem = guest(MEM);
        let rsdp = write_acpi_tables(&mem, cfg).unwrap();
        let xsdt = table(&mem, r64(&mem, rsdp + 24));
        xsdt[36..]
            .chunks(8)
            .map(|e| table(&mem, u64::from_le_bytes(e.try_into().unwrap())))
            .collect::<Vec<_>>()
    };
    assert!(sigs(&AcpiConfig::new(1)).iter().all(|t| &t[..4] != b"DMAR"));
    let cfg = AcpiConfig {
        pci_ecam: Some((PCI_ECAM_START, 0, 0)),
        dmar: Some(acpi::DmarUnit {
            base: 0xfed9_0000,
            pages: 2,
        }),
        ..AcpiConfig::new(1)
    };
    let tables = sigs(&cfg);
    let dmar = tables.iter().find(|t| &t[..4] == b"DMAR").unwrap();
    let d = parse_dmar(dmar).unwrap();
    assert_eq!(d.drhds.len(), 1);
    assert_eq!(d.drhds[0].3, 0xfed9_0000);
    // The scope's enumeration ID is the MADT's I/O APIC ID.
    let madt = tables.iter().find(|t| &t[..4] == b"APIC").unwrap();
    let mut off = 44;
    let mut ioapic_id = None;
    while off + 2 <= madt.len() {
        if madt[off] == 1 {
            ioapic_id = Some(madt[off + 2]);
        }
        off += madt[off + 1] as usize;
    }
    assert_eq!(ioapic_id, Some(d.drhds[0].4[0].1));
}

/// With hotplug the DSDT has the controller's fields in `PCI0`, a slot device with `_EJ0` for
/// slots 1-31, the GED (`ACPI0013`) on its GSI and the power button (`PNP0C0C`, EISA id
/// 0x0c0cd041); without it, none of them.
#[test]
fn dsdt_describes_pci_hotplug_and_the_power_button() {
    let dsdt = |hotplug: bool| {
        let mem = guest(MEM);
        let cfg = AcpiConfig {
            pci_ecam: Some((PCI_ECAM_START, 0, 255)),
            hotplug,
            ..AcpiConfig::new(1)
        };
        let rsdp = write_acpi_tables(&mem, &cfg).unwrap();
        let xsdt = table(&mem, r64(&mem, rsdp + 24));
        let fadt = table(&mem, u64::from_le_bytes(xsdt[36..44].try_into().unwrap()));
        table(&mem, u64::from_le_bytes(fadt[140..148].try_into().unwrap()))
    };
    let with = dsdt(true);
    let has = |t: &[u8], s: &[u8]| t.windows(s.len()).any(|w| w == s);
    for name in [
        &b"PCIU"[..],
        b"PCID",
        b"B0EJ",
        b"GEVT",
        b"PCNT",
        b"PCEJ",
        b"_EVT",
        b"PWRB",
    ] {
        assert!(has(&with, name), "{}", String::from_utf8_lossy(name));
    }
    for slot in 1..32u8 {
        assert!(
            has(&with, format!("S{slot:02X}_").as_bytes()),
            "slot {slot}"
        );
    }
    assert!(!has(&with, b"S00_"), "slot 0 is the host bridge");
    assert!(has(&with, b"ACPI0013\0"));
    assert!(has(&with, &0x0c0c_d041u32.to_le_bytes()));
    // The GED's extended interrupt descriptor: consumer, edge, active high, exclusive.
    let mut irq = vec![0x89, 6, 0, 0x03, 1];
    irq.extend(crate::layout::GED_GSI.to_le_bytes());
    assert!(has(&with, &irq));
    let without = dsdt(false);
    for name in [&b"PCIU"[..], b"GEVT", b"_EVT", b"PWRB", b"S01_"] {
        assert!(!has(&without, name));
    }
}

/// With fw_cfg, the DSDT has QEMU's `FWCF` (`QEMU0002`, I/O 0x510-0x51b); without, none.
#[test]
fn dsdt_describes_fw_cfg_as_qemu_does() {
    let dsdt_of = |cfg: &AcpiConfig| {
        let mem = guest(MEM);
        let rsdp = write_acpi_tables(&mem, cfg).unwrap();
        let xsdt = table(&mem, r64(&mem, rsdp + 24));
        let fadt = table(&mem, u64::from_le_bytes(xsdt[36..44].try_into().unwrap()));
        table(&mem, u64::from_le_bytes(fadt[140..148].try_into().unwrap()))
    };
    let has = |t: &[u8], s: &[u8]| t.windows(s.len()).any(|w| w == s);
    let cfg = AcpiConfig {
        fw_cfg: true,
        ..AcpiConfig::new(1)
    };
    let dsdt = dsdt_of(&cfg);
    assert!(has(&dsdt, b"FWCF") && has(&dsdt, b"QEMU0002\0"));
    // IO(Decode16, 0x510, 0x510, 1, 12).
    assert!(has(
        &dsdt,
        &[0x47, 0x01, 0x10, 0x05, 0x10, 0x05, 0x01, 0x0c]
    ));
    assert!(!has(&dsdt_of(&AcpiConfig::new(1)), b"QEMU0002"));
}
