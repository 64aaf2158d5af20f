//! Loading a detected kernel, its initrd and command line into guest memory, and writing the
//! boot information of its protocol (PVH `hvm_start_info`, multiboot info, Linux zero page).

use std::fs::File;
use std::path::Path;

use linux_loader::loader::bootparam::{boot_e820_entry, boot_params, setup_header};
use linux_loader::loader::elf::start_info::{
    hvm_memmap_table_entry, hvm_modlist_entry, hvm_start_info,
};
use vm_memory::{ByteValued, Bytes, GuestAddress, GuestMemoryMmap};

use crate::area::BootArea;
use crate::error::ImageDefect;
use crate::file::open_regular;
use crate::kernel::{bzhdr, ElfInfo, KernelImage, KernelKind, MULTIBOOT_AOUT_KLUDGE};
use crate::layout::{
    BOOT_GDT, BOOT_GDT_SIZE, BOOT_INFO, BOOT_STACK_BASE, BOOT_STACK_SIZE, CMDLINE, CMDLINE_MAX,
    EBDA_START, HIGH_MEMORY, MEMMAP, MODLIST, MODLIST_STRINGS, PAGE_TABLES_SIZE, PML4,
};
use crate::memmap::{check_load_range, low_ram_end, memory_map_with, mib_up, MemEntry};
use crate::{BootError, BootParams, BootSetup, EntryMode, EntryState};

/// PVH `hvm_start_info.magic`.
pub const HVM_START_MAGIC: u32 = 0x336e_c578;
/// Value of EAX at a multiboot entry.
pub const MULTIBOOT_BOOTLOADER_MAGIC: u32 = 0x2BAD_B002;
/// Multiboot info flags this crate sets.
pub mod mbi_flags {
    pub const MEMORY: u32 = 1 << 0;
    pub const CMDLINE: u32 = 1 << 2;
    pub const MODS: u32 = 1 << 3;
    pub const MMAP: u32 = 1 << 6;
    pub const LOADER_NAME: u32 = 1 << 9;
}
const PAGE: u64 = 0x1000;
/// Linux boot protocol constants.
const KERNEL_LOADER_OTHER: u8 = 0xff;
const LOADED_HIGH: u8 = 0x01;
const XLF_KERNEL_64: u16 = 0x01;
const HDRS: u32 = 0x5372_6448;
const BOOT_FLAG: u16 = 0xaa55;
/// Where a 64-bit Linux decompresses itself when the header does not say (CONFIG_PHYSICAL_START).
const DEFAULT_PREF_ADDRESS: u64 = 0x100_0000;

fn align_up(x: u64, a: u64) -> u64 {
    x.div_ceil(a) * a
}

pub(crate) fn write_bytes(
    mem: &GuestMemoryMmap,
    addr: u64,
    bytes: &[u8],
    what: &'static str,
) -> Result<(), BootError> {
    mem.write_slice(bytes, GuestAddress(addr))
        .map_err(|source| BootError::GuestWrite {
            what,
            addr,
            len: bytes.len(),
            source,
        })
}

pub(crate) fn write_obj<T: ByteValued>(
    mem: &GuestMemoryMmap,
    addr: u64,
    obj: &T,
    what: &'static str,
) -> Result<(), BootError> {
    write_bytes(mem, addr, obj.as_slice(), what)
}

fn zero(mem: &GuestMemoryMmap, addr: u64, len: u64, what: &'static str) -> Result<(), BootError> {
    const CHUNK: u64 = 1 << 20;
    let zeros = vec![0u8; CHUNK.min(len) as usize];
    let mut done = 0;
    while done < len {
        let n = CHUNK.min(len - done);
        write_bytes(mem, addr + done, &zeros[..n as usize], what)?;
        done += n;
    }
    Ok(())
}

/// Places and writes the command line, NUL-terminated (preferably at [`CMDLINE`]); `max` counts
/// the bytes without NUL. Returns its address.
fn write_cmdline(
    mem: &GuestMemoryMmap,
    area: &mut BootArea,
    cmdline: &str,
    max: usize,
) -> Result<u64, BootError> {
    if let Some(offset) = cmdline.bytes().position(|b| b == 0) {
        return Err(BootError::CmdlineNul { offset });
    }
    let max = max.min(CMDLINE_MAX - 1);
    if cmdline.len() > max {
        return Err(BootError::CmdlineTooLong {
            len: cmdline.len(),
            max,
        });
    }
    let mut bytes = Vec::with_capacity(cmdline.len() + 1);
    bytes.extend_from_slice(cmdline.as_bytes());
    bytes.push(0);
    let what = "kernel command line";
    let addr = area.place(what, CMDLINE, bytes.len() as u64, 16)?;
    write_bytes(mem, addr, &bytes, what)?;
    Ok(addr)
}

/// Places and writes a structure (preferably at `pref`); returns its address.
fn place_bytes(
    mem: &GuestMemoryMmap,
    area: &mut BootArea,
    what: &'static str,
    pref: u64,
    align: u64,
    bytes: &[u8],
) -> Result<u64, BootError> {
    let addr = area.place(what, pref, bytes.len() as u64, align)?;
    write_bytes(mem, addr, bytes, what)?;
    Ok(addr)
}

/// Places what the boot vCPU's entry state points at: the GDT (and IDT), a stack, and for a
/// 64-bit entry the identity page tables. [`crate::setup_boot_regs`] writes them.
fn entry_state(area: &mut BootArea, mode: EntryMode) -> Result<EntryState, BootError> {
    let gdt = area.place("boot GDT", BOOT_GDT, BOOT_GDT_SIZE, 8)?;
    let stack = area.place("boot stack", BOOT_STACK_BASE, BOOT_STACK_SIZE, 16)?;
    let page_tables = match mode {
        EntryMode::Long64 { .. } => area.place("boot page tables", PML4, PAGE_TABLES_SIZE, PAGE)?,
        EntryMode::Protected32 { .. } => 0,
    };
    Ok(EntryState {
        mode,
        gdt,
        stack_top: stack + BOOT_STACK_SIZE - 16,
        page_tables,
    })
}

/// Writes the ACPI tables (when asked for) where the kernel left room; returns the RSDP address
/// and the memory map, which reserves the tables when they had to leave the BIOS area.
fn acpi_and_memory_map(
    mem: &GuestMemoryMmap,
    area: &mut BootArea,
    p: &BootParams,
) -> Result<(Option<u64>, Vec<MemEntry>), BootError> {
    let Some(cfg) = p.acpi else {
        return Ok((None, memory_map_with(p.mem_size, None)));
    };
    let acpi = crate::acpi::write_acpi(mem, area, cfg)?;
    let map = memory_map_with(p.mem_size, acpi.outside_bios_area());
    Ok((Some(acpi.rsdp), map))
}

/// Copies the ELF's `PT_LOAD` segments to their physical addresses and zeroes their bss; claims
/// them in `area`. Returns the end of the highest segment.
///
/// ELF64 images are copied by linux-loader's `Elf` loader; it reads ELF64 only and leaves bss
/// alone (guest RAM backed by a file is not zero), so ELF32 images (PVH and multiboot kernels)
/// are copied here and every segment's bss is zeroed here. This crate's parser has already
/// checked every segment against the file and guest RAM, which linux-loader does not.
fn load_elf_segments(
    mem: &GuestMemoryMmap,
    image: &KernelImage,
    elf: &ElfInfo,
    mem_size: u64,
    area: &mut BootArea,
) -> Result<u64, BootError> {
    // Check everything before writing anything. If RAM is short, report what the whole kernel
    // needs, not only the first segment that does not fit.
    let max_end = elf
        .segments
        .iter()
        .map(|s| s.paddr + s.memsz)
        .max()
        .unwrap_or(0);
    for s in &elf.segments {
        check_load_range(mem_size, &image.path, "kernel", s.paddr, s.paddr + s.memsz).map_err(
            |e| match e {
                BootError::MemoryTooSmall { what, have_mib, .. } => BootError::MemoryTooSmall {
                    what,
                    need_mib: mib_up(max_end),
                    have_mib,
                },
                e => e,
            },
        )?;
        area.claim("kernel", s.paddr, s.paddr + s.memsz);
    }
    if elf.is_64 {
        use linux_loader::loader::{Elf, KernelLoader};
        Elf::load(mem, None, &mut std::io::Cursor::new(&image.bytes[..]), None).map_err(
            |source| BootError::Loader {
                path: image.path.clone(),
                source,
            },
        )?;
    } else {
        for s in &elf.segments {
            // Bounds of the file range were checked by the parser.
            let data = &image.bytes[s.offset as usize..(s.offset + s.filesz) as usize];
            write_bytes(mem, s.paddr, data, "kernel segment")?;
        }
    }
    for s in &elf.segments {
        zero(mem, s.paddr + s.filesz, s.memsz - s.filesz, "kernel bss")?;
    }
    Ok(max_end)
}

/// Reads the initrd at `path` into guest memory at `addr` (checked to be RAM).
fn load_initrd_at(
    mem: &GuestMemoryMmap,
    path: &Path,
    file: &mut File,
    size: u64,
    addr: u64,
) -> Result<(), BootError> {
    mem.read_exact_volatile_from(GuestAddress(addr), file, size as usize)
        .map_err(|source| BootError::GuestLoad {
            path: path.to_path_buf(),
            addr,
            len: size as usize,
            source,
        })
}

/// Places an initrd of `size` bytes page-aligned as high as possible below `limit` (exclusive),
/// above `kernel_end`; loads it and returns (address, size).
fn load_initrd_high(
    mem: &GuestMemoryMmap,
    area: &mut BootArea,
    path: &Path,
    kernel_end: u64,
    limit: u64,
    mem_size: u64,
) -> Result<(u64, u64), BootError> {
    let (mut file, size) = open_regular(path, "initrd", mem_size)?;
    let floor = align_up(kernel_end, PAGE);
    let addr = limit.checked_sub(size).map(|a| a & !(PAGE - 1));
    match addr {
        Some(addr) if addr >= floor => {
            check_load_range(mem_size, path, "initrd", addr, addr + size)?;
            area.claim("initrd", addr, addr + size);
            load_initrd_at(mem, path, &mut file, size, addr)?;
            Ok((addr, size))
        }
        _ => Err(BootError::MemoryTooSmall {
            what: "kernel with initrd",
            need_mib: mib_up(floor + align_up(size, PAGE) + (mem_size.saturating_sub(limit))),
            have_mib: mem_size >> 20,
        }),
    }
}

/// Loads an initrd right after the kernel (page-aligned), as QEMU does for multiboot modules; from
/// 1 MiB instead when the kernel ends below 1 MiB and the initrd would run into the BIOS area.
fn load_initrd_after(
    mem: &GuestMemoryMmap,
    area: &mut BootArea,
    path: &Path,
    kernel_end: u64,
    mem_size: u64,
) -> Result<(u64, u64), BootError> {
    let (mut file, size) = open_regular(path, "initrd", mem_size)?;
    let mut addr = align_up(kernel_end, PAGE);
    if addr < HIGH_MEMORY && addr + size > EBDA_START {
        log::info!(
            "multiboot module {} ({size} bytes) does not fit between the kernel's end {addr:#x} \
             and the BIOS area: loaded at {HIGH_MEMORY:#x} instead",
            path.display()
        );
        addr = HIGH_MEMORY;
    }
    check_load_range(mem_size, path, "kernel with initrd", addr, addr + size)?;
    area.claim("initrd", addr, addr + size);
    load_initrd_at(mem, path, &mut file, size, addr)?;
    Ok((addr, size))
}

/// Loads the kernel, then the initrd, then places Lucid's boot structures around them: the ACPI
/// tables first (the RSDP has the narrowest home), then the protocol's boot information, the
/// command line, and what the entry registers point at.
pub(crate) fn load(
    mem: &GuestMemoryMmap,
    image: &KernelImage,
    p: &BootParams,
) -> Result<BootSetup, BootError> {
    let mut area = BootArea::new(p.mem_size);
    match image.kind {
        KernelKind::PvhElf => load_pvh(mem, image, p, &mut area),
        KernelKind::Multiboot => load_multiboot(mem, image, p, &mut area),
        KernelKind::LinuxElf | KernelKind::BzImage => load_linux(mem, image, p, &mut area),
    }
}

fn load_pvh(
    mem: &GuestMemoryMmap,
    image: &KernelImage,
    p: &BootParams,
    area: &mut BootArea,
) -> Result<BootSetup, BootError> {
    let elf = image.elf.as_ref().expect("PVH kernels are ELF");
    let entry = elf.pvh_entry.expect("PVH kernels have an entry note");
    if entry >= 1 << 32 {
        return Err(BootError::BadImage {
            path: image.path.clone(),
            why: ImageDefect::PvhEntryAbove4G(entry),
        });
    }
    let kernel_end = load_elf_segments(mem, image, elf, p.mem_size, area)?;
    let initrd = match p.initrd {
        Some(path) => Some(load_initrd_high(
            mem,
            area,
            path,
            kernel_end,
            low_ram_end(p.mem_size),
            p.mem_size,
        )?),
        None => None,
    };
    let (rsdp, map) = acpi_and_memory_map(mem, area, p)?;
    let cmdline = write_cmdline(mem, area, p.cmdline, CMDLINE_MAX - 1)?;

    let entries: Vec<u8> = map
        .iter()
        .flat_map(|e| {
            hvm_memmap_table_entry {
                addr: e.addr,
                size: e.size,
                type_: e.kind,
                reserved: 0,
            }
            .as_slice()
            .to_vec()
        })
        .collect();
    let memmap = place_bytes(mem, area, "PVH memory map", MEMMAP, 8, &entries)?;
    let mut info = hvm_start_info {
        magic: HVM_START_MAGIC,
        version: 1,
        cmdline_paddr: cmdline,
        rsdp_paddr: rsdp.unwrap_or(0),
        memmap_paddr: memmap,
        memmap_entries: map.len() as u32,
        ..Default::default()
    };
    if let Some((addr, size)) = initrd {
        let m = hvm_modlist_entry {
            paddr: addr,
            size,
            cmdline_paddr: 0,
            reserved: 0,
        };
        info.nr_modules = 1;
        info.modlist_paddr = place_bytes(mem, area, "PVH module list", MODLIST, 8, m.as_slice())?;
    }
    let boot_info = place_bytes(
        mem,
        area,
        "PVH hvm_start_info",
        BOOT_INFO,
        8,
        info.as_slice(),
    )?;
    let mode = EntryMode::Protected32 {
        eip: entry,
        eax: 0,
        ebx: boot_info,
    };
    Ok(BootSetup {
        kind: KernelKind::PvhElf,
        entry: entry_state(area, mode)?,
        kernel_end,
        initrd,
        boot_info,
        acpi_rsdp: rsdp,
    })
}

fn load_multiboot(
    mem: &GuestMemoryMmap,
    image: &KernelImage,
    p: &BootParams,
    area: &mut BootArea,
) -> Result<BootSetup, BootError> {
    let mb = image.multiboot.expect("multiboot kernels have a header");
    let bad = |why| BootError::BadImage {
        path: image.path.clone(),
        why,
    };
    // Bits 0-15 are requirements: refuse the ones we do not know (bit 2, video mode, is a
    // request we may ignore as QEMU does).
    let unknown = mb.flags & 0xfff8;
    if unknown != 0 {
        return Err(bad(ImageDefect::MultibootFlags {
            unknown,
            flags: mb.flags,
        }));
    }
    let (entry, kernel_end) = if mb.flags & MULTIBOOT_AOUT_KLUDGE != 0 {
        let [header_addr, load_addr, load_end_addr, bss_end_addr, entry_addr] =
            mb.aout.expect("kludge fields parsed with the flag");
        let (header_addr, load_addr) = (u64::from(header_addr), u64::from(load_addr));
        let back = header_addr.checked_sub(load_addr).ok_or_else(|| {
            bad(ImageDefect::MultibootLoadAboveHeader {
                load: load_addr,
                header: header_addr,
            })
        })?;
        let file_start = mb.offset.checked_sub(back).ok_or_else(|| {
            bad(ImageDefect::MultibootHeaderOffset {
                offset: mb.offset,
                back,
            })
        })?;
        let file_len = image.bytes.len() as u64 - file_start;
        let load_len = if load_end_addr == 0 {
            file_len
        } else {
            u64::from(load_end_addr)
                .checked_sub(load_addr)
                .ok_or_else(|| {
                    bad(ImageDefect::MultibootLoadEndBelowLoad {
                        load_end: load_end_addr,
                        load: load_addr,
                    })
                })?
        };
        if load_len > file_len {
            return Err(bad(ImageDefect::MultibootTruncated {
                load: load_addr,
                end: load_addr + load_len,
                size: load_len,
                offset: file_start,
                have: file_len,
            }));
        }
        let load_end = load_addr + load_len;
        let bss_end = u64::from(bss_end_addr).max(load_end);
        check_load_range(p.mem_size, &image.path, "kernel", load_addr, bss_end)?;
        area.claim("kernel", load_addr, bss_end);
        let data = &image.bytes[file_start as usize..(file_start + load_len) as usize];
        write_bytes(mem, load_addr, data, "multiboot kernel")?;
        zero(mem, load_end, bss_end - load_end, "multiboot bss")?;
        (u64::from(entry_addr), bss_end)
    } else {
        let elf = image
            .elf
            .as_ref()
            .ok_or_else(|| bad(ImageDefect::MultibootWithoutAddresses))?;
        let end = load_elf_segments(mem, image, elf, p.mem_size, area)?;
        (image.elf_entry_paddr(elf)?, end)
    };
    if entry >= 1 << 32 || kernel_end > 1 << 32 {
        return Err(bad(ImageDefect::MultibootAbove4G {
            entry,
            end: kernel_end,
        }));
    }

    let initrd = match p.initrd {
        Some(path) => Some(load_initrd_after(mem, area, path, kernel_end, p.mem_size)?),
        None => None,
    };
    // Multiboot v1 has no field for the RSDP: the guest scans the BIOS area, where it is.
    let (rsdp, map) = acpi_and_memory_map(mem, area, p)?;
    let cmdline = write_cmdline(mem, area, p.cmdline, CMDLINE_MAX - 1)?;

    // mmap: entries of { size: u32 (of the rest, 20), base: u64, length: u64, type: u32 }.
    let mut mmap = Vec::with_capacity(map.len() * 24);
    for e in &map {
        mmap.extend_from_slice(&20u32.to_le_bytes());
        mmap.extend_from_slice(&e.addr.to_le_bytes());
        mmap.extend_from_slice(&e.size.to_le_bytes());
        mmap.extend_from_slice(&e.kind.to_le_bytes());
    }
    let mmap_addr = place_bytes(mem, area, "multiboot memory map", MEMMAP, 8, &mmap)?;
    let loader_name = place_bytes(
        mem,
        area,
        "multiboot boot loader name",
        MODLIST_STRINGS + 0x100,
        1,
        b"lucid\0",
    )?;

    let mem_lower = EBDA_START / 1024;
    let mem_upper = (low_ram_end(p.mem_size) - HIGH_MEMORY) / 1024;
    let mut flags =
        mbi_flags::MEMORY | mbi_flags::CMDLINE | mbi_flags::MMAP | mbi_flags::LOADER_NAME;
    let mut info = [0u32; 22]; // 88 bytes: up to and including vbe fields we leave zero.
    info[1] = mem_lower as u32;
    info[2] = mem_upper as u32;
    info[4] = cmdline as u32;
    if let Some((addr, size)) = initrd {
        // Module 0: { mod_start, mod_end, string, reserved }.
        let mut s = p
            .initrd
            .map(|x| x.display().to_string())
            .unwrap_or_default()
            .into_bytes();
        s.truncate(0xff);
        s.push(0);
        let name = place_bytes(mem, area, "multiboot module string", MODLIST_STRINGS, 1, &s)?;
        let mut m = Vec::with_capacity(16);
        for v in [addr as u32, (addr + size) as u32, name as u32, 0] {
            m.extend_from_slice(&v.to_le_bytes());
        }
        flags |= mbi_flags::MODS;
        info[5] = 1;
        info[6] = place_bytes(mem, area, "multiboot module list", MODLIST, 8, &m)? as u32;
    }
    info[11] = mmap.len() as u32;
    info[12] = mmap_addr as u32;
    info[16] = loader_name as u32;
    info[0] = flags;
    let bytes: Vec<u8> = info.iter().flat_map(|v| v.to_le_bytes()).collect();
    let boot_info = place_bytes(mem, area, "multiboot info", BOOT_INFO, 8, &bytes)?;
    let mode = EntryMode::Protected32 {
        eip: entry,
        eax: u64::from(MULTIBOOT_BOOTLOADER_MAGIC),
        ebx: boot_info,
    };
    Ok(BootSetup {
        kind: KernelKind::Multiboot,
        entry: entry_state(area, mode)?,
        kernel_end,
        initrd,
        boot_info,
        acpi_rsdp: rsdp,
    })
}
fn load_linux(
    mem: &GuestMemoryMmap,
    image: &KernelImage,
    p: &BootParams,
    area: &mut BootArea,
) -> Result<BootSetup, BootError> {
    let bad = |why| BootError::BadImage {
        path: image.path.clone(),
        why,
    };
    let low_end = low_ram_end(p.mem_size);
    let (mut hdr, rip, kernel_end, cmdline_max, initrd_max) = match image.kind {
        KernelKind::BzImage => {
            let b = &image.bytes;
            let hdr_len = std::mem::size_of::<setup_header>();
            let mut hdr = setup_header::default();
            // Headers of old protocol versions are shorter; missing bytes stay zero.
            let avail = b.len().saturating_sub(bzhdr::HEADER_START).min(hdr_len);
            hdr.as_mut_slice()[..avail]
                .copy_from_slice(&b[bzhdr::HEADER_START..bzhdr::HEADER_START + avail]);
            let (version, xloadflags) = (hdr.version, hdr.xloadflags);
            if version < 0x020c || xloadflags & XLF_KERNEL_64 == 0 {
                return Err(bad(ImageDefect::BzImageNo64BitEntry {
                    version,
                    xloadflags,
                }));
            }
            if hdr.loadflags & LOADED_HIGH == 0 {
                return Err(bad(ImageDefect::BzImageNotLoadedHigh));
            }
            let setup_sects = match b[bzhdr::SETUP_SECTS] {
                0 => 4,
                n => u64::from(n),
            };
            let payload_off = (setup_sects + 1) * 512;
            if payload_off >= b.len() as u64 {
                return Err(bad(ImageDefect::BzImageSetupTruncated {
                    setup: payload_off,
                    len: b.len() as u64,
                }));
            }
            let syssize = u64::from(hdr.syssize) * 16;
            let payload = &b[payload_off as usize..];
            if syssize > payload.len() as u64 {
                return Err(bad(ImageDefect::BzImagePayloadTruncated {
                    syssize,
                    have: payload.len() as u64,
                }));
            }
            let load = u64::from(hdr.code32_start).max(HIGH_MEMORY);
            let load_end = load + payload.len() as u64;
            // The kernel decompresses itself to pref_address and needs init_size bytes there.
            let pref = match hdr.pref_address {
                0 => DEFAULT_PREF_ADDRESS,
                a => a,
            };
            let decompress_end =
                pref.max(load)
                    .checked_add(u64::from(hdr.init_size))
                    .ok_or(bad(ImageDefect::BzImageDecompressionWraps {
                        pref,
                        init_size: hdr.init_size,
                    }))?;
            let need_end = load_end.max(decompress_end);
            check_load_range(p.mem_size, &image.path, "kernel", load, need_end)?;
            area.claim("kernel", load, need_end);
            // linux-loader copies the protected-mode part to code32_start (checked above).
            hdr.code32_start = load as u32;
            use linux_loader::loader::{BzImage, KernelLoader};
            BzImage::load(
                mem,
                Some(GuestAddress(load)),
                &mut std::io::Cursor::new(&image.bytes[..]),
                None,
            )
            .map_err(|source| BootError::Loader {
                path: image.path.clone(),
                source,
            })?;
            let cmdline_max = match hdr.cmdline_size {
                0 => 255,
                n => n as usize,
            };
            let initrd_max = match hdr.initrd_addr_max {
                0 => 0x37ff_ffff,
                n => u64::from(n),
            };
            (hdr, load + 0x200, need_end, cmdline_max, initrd_max)
        }
        _ => {
            let elf = image.elf.as_ref().expect("Linux ELF kernels are ELF");
            let kernel_end = load_elf_segments(mem, image, elf, p.mem_size, area)?;
            let rip = image.elf_entry_paddr(elf)?;
            let hdr = setup_header {
                boot_flag: BOOT_FLAG,
                header: HDRS,
                version: 0x020c,
                loadflags: LOADED_HIGH,
                kernel_alignment: 0x0100_0000,
                xloadflags: XLF_KERNEL_64,
                cmdline_size: (CMDLINE_MAX - 1) as u32,
                initrd_addr_max: (low_end - 1) as u32,
                ..Default::default()
            };
            (hdr, rip, kernel_end, CMDLINE_MAX - 1, low_end - 1)
        }
    };

    let initrd = match p.initrd {
        Some(path) => {
            let limit = (initrd_max + 1).min(low_end);
            Some(load_initrd_high(
                mem, area, path, kernel_end, limit, p.mem_size,
            )?)
        }
        None => None,
    };
    let (rsdp, map) = acpi_and_memory_map(mem, area, p)?;
    // The zero page first: it is the largest of the low structures.
    let boot_info = area.place("Linux zero page", BOOT_INFO, PAGE, PAGE)?;
    let cmdline = write_cmdline(mem, area, p.cmdline, cmdline_max)?;

    hdr.type_of_loader = KERNEL_LOADER_OTHER;
    hdr.cmd_line_ptr = cmdline as u32;
    if let Some((addr, size)) = initrd {
        hdr.ramdisk_image = addr as u32;
        hdr.ramdisk_size = size as u32;
    }
    let mut bp = boot_params {
        hdr,
        ..Default::default()
    };
    bp.ext_ramdisk_size = initrd.map_or(0, |(_, s)| (s >> 32) as u32);
    bp.acpi_rsdp_addr = rsdp.unwrap_or(0);
    if map.len() > bp.e820_table.len() {
        unreachable!("the layout has few memory map entries");
    }
    for (slot, e) in bp.e820_table.iter_mut().zip(&map) {
        let MemEntry { addr, size, kind } = *e;
        *slot = boot_e820_entry {
            addr,
            size,
            r#type: kind,
        };
    }
    bp.e820_entries = map.len() as u8;
    write_obj(mem, boot_info, &bp, "Linux zero page")?;
    let mode = EntryMode::Long64 {
        rip,
        rsi: boot_info,
    };
    Ok(BootSetup {
        kind: image.kind,
        entry: entry_state(area, mode)?,
        kernel_end,
        initrd,
        boot_info,
        acpi_rsdp: rsdp,
    })
}
