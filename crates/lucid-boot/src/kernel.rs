//! Kernel image detection by content, and parsing of the ELF, multiboot and bzImage headers.
//! Every offset read from the file is bounds-checked: a truncated or corrupt image gives a
//! [`BootError`], never a panic.

use std::path::{Path, PathBuf};

use crate::error::{ImageDefect, NotAKernel};
use crate::file::{read_regular, MAX_KERNEL_FILE};
use crate::BootError;

/// The boot protocol a kernel image is started with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KernelKind {
    /// An ELF (32- or 64-bit) with a `XEN_ELFNOTE_PHYS32_ENTRY` note: PVH boot, 32-bit
    /// protected mode entry with `hvm_start_info` in EBX.
    PvhElf,
    /// A multiboot v1 kernel (ELF, or any binary using the a.out kludge address fields):
    /// 32-bit protected mode entry with EAX = 0x2BADB002 and the multiboot info in EBX.
    Multiboot,
    /// An ELF64 `vmlinux` without a PVH note: Linux 64-bit boot protocol, zero page in RSI.
    LinuxElf,
    /// A Linux bzImage: 64-bit boot protocol at load address + 0x200, zero page in RSI.
    BzImage,
}

/// A loadable ELF segment (`PT_LOAD`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Segment {
    pub offset: u64,
    pub vaddr: u64,
    pub paddr: u64,
    pub filesz: u64,
    pub memsz: u64,
}

#[derive(Clone, Debug)]
pub(crate) struct ElfInfo {
    pub is_64: bool,
    pub entry: u64,
    pub segments: Vec<Segment>,
    /// `XEN_ELFNOTE_PHYS32_ENTRY`, if present.
    pub pvh_entry: Option<u64>,
}

/// A multiboot v1 header found in the first 8 KiB of the image.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct MultibootHeader {
    /// File offset of the header.
    pub offset: u64,
    pub flags: u32,
    /// The a.out kludge fields (flag bit 16): header_addr, load_addr, load_end_addr,
    /// bss_end_addr, entry_addr.
    pub aout: Option<[u32; 5]>,
}

pub(crate) const MULTIBOOT_MAGIC: u32 = 0x1BAD_B002;
pub(crate) const MULTIBOOT_AOUT_KLUDGE: u32 = 1 << 16;
const MULTIBOOT_SEARCH: usize = 8192;
const XEN_ELFNOTE_PHYS32_ENTRY: u32 = 18;
const PT_LOAD: u32 = 1;
const PT_NOTE: u32 = 4;
const EM_386: u16 = 3;
const EM_X86_64: u16 = 62;

/// A kernel image read into memory, with its format detected.
#[derive(Clone, Debug)]
pub struct KernelImage {
    pub(crate) path: PathBuf,
    pub(crate) bytes: Vec<u8>,
    pub(crate) kind: KernelKind,
    pub(crate) elf: Option<ElfInfo>,
    pub(crate) multiboot: Option<MultibootHeader>,
}

fn rd_u16(b: &[u8], off: u64) -> Option<u16> {
    let off = usize::try_from(off).ok()?;
    Some(u16::from_le_bytes(
        b.get(off..off.checked_add(2)?)?.try_into().ok()?,
    ))
}

fn rd_u32(b: &[u8], off: u64) -> Option<u32> {
    let off = usize::try_from(off).ok()?;
    Some(u32::from_le_bytes(
        b.get(off..off.checked_add(4)?)?.try_into().ok()?,
    ))
}

fn rd_u64(b: &[u8], off: u64) -> Option<u64> {
    let off = usize::try_from(off).ok()?;
    Some(u64::from_le_bytes(
        b.get(off..off.checked_add(8)?)?.try_into().ok()?,
    ))
}

impl KernelImage {
    /// Reads `path` (a regular file of at most [`MAX_KERNEL_FILE`] bytes) and detects its format.
    pub fn open(path: &Path) -> Result<KernelImage, BootError> {
        let bytes = read_regular(path, "kernel", MAX_KERNEL_FILE)?;
        Self::from_bytes(path, bytes)
    }

    /// Detects the format of `bytes`; `path` is only used in messages.
    pub fn from_bytes(path: &Path, bytes: Vec<u8>) -> Result<KernelImage, BootError> {
        let not_kernel = |why| BootError::NotAKernel {
            path: path.to_path_buf(),
            why,
        };
        if bytes.is_empty() {
            return Err(not_kernel(NotAKernel::Empty));
        }
        let multiboot = find_multiboot(&bytes);
        let mut image = KernelImage {
            path: path.to_path_buf(),
            bytes: Vec::new(),
            kind: KernelKind::BzImage,
            elf: None,
            multiboot,
        };
        if bytes.starts_with(b"\x7fELF") {
            let elf = parse_elf(&bytes).map_err(|why| BootError::BadImage {
                path: path.to_path_buf(),
                why,
            })?;
            image.kind = if elf.pvh_entry.is_some() {
                KernelKind::PvhElf
            } else if multiboot.is_some() {
                KernelKind::Multiboot
            } else if elf.is_64 {
                KernelKind::LinuxElf
            } else {
                return Err(not_kernel(NotAKernel::Elf32WithoutProtocol));
            };
            image.elf = Some(elf);
        } else if let Some(mb) = multiboot {
            if mb.aout.is_none() {
                return Err(not_kernel(NotAKernel::MultibootWithoutAddresses));
            }
            image.kind = KernelKind::Multiboot;
        } else if bytes.get(0x202..0x206) == Some(b"HdrS") {
            image.kind = KernelKind::BzImage;
        } else {
            return Err(not_kernel(NotAKernel::UnknownFormat));
        }
        image.bytes = bytes;
        Ok(image)
    }

    /// The detected format.
    pub fn kind(&self) -> KernelKind {
        self.kind
    }

    /// Whether this is a Linux kernel: a bzImage, a 64-bit vmlinux, or a vmlinux with a PVH note
    /// (recognised by the kernel's banner, `Linux version `, which every vmlinux carries).
    pub fn is_linux(&self) -> bool {
        const BANNER: &[u8] = b"Linux version ";
        match self.kind {
            KernelKind::BzImage | KernelKind::LinuxElf => true,
            KernelKind::Multiboot => false,
            KernelKind::PvhElf => self.bytes.windows(BANNER.len()).any(|w| w == BANNER),
        }
    }

    /// The file this image was read from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Translates an ELF entry point to a physical address: kept if it lies in a segment's
    /// physical range, else mapped through the segment whose virtual range holds it.
    pub(crate) fn elf_entry_paddr(&self, elf: &ElfInfo) -> Result<u64, BootError> {
        let e = elf.entry;
        if elf
            .segments
            .iter()
            .any(|s| e >= s.paddr && e < s.paddr.saturating_add(s.memsz))
        {
            return Ok(e);
        }
        if let Some(s) = elf
            .segments
            .iter()
            .find(|s| e >= s.vaddr && e < s.vaddr.saturating_add(s.memsz))
        {
            return Ok(e - s.vaddr + s.paddr);
        }
        Err(BootError::BadImage {
            path: self.path.clone(),
            why: ImageDefect::EntryOutsideSegments(e),
        })
    }
}

fn find_multiboot(b: &[u8]) -> Option<MultibootHeader> {
    let limit = b.len().min(MULTIBOOT_SEARCH);
    (0..limit).step_by(4).find_map(|off| {
        let off = off as u64;
        if rd_u32(b, off)? != MULTIBOOT_MAGIC {
            return None;
        }
        let flags = rd_u32(b, off + 4)?;
        let sum = rd_u32(b, off + 8)?;
        if MULTIBOOT_MAGIC.wrapping_add(flags).wrapping_add(sum) != 0 {
            return None;
        }
        let aout = if flags & MULTIBOOT_AOUT_KLUDGE != 0 {
            let mut f = [0u32; 5];
            for (i, v) in f.iter_mut().enumerate() {
                *v = rd_u32(b, off + 12 + 4 * i as u64)?;
            }
            Some(f)
        } else {
            None
        };
        Some(MultibootHeader {
            offset: off,
            flags,
            aout,
        })
    })
}

fn parse_elf(b: &[u8]) -> Result<ElfInfo, ImageDefect> {
    let len = b.len() as u64;
    let is_64 = match b.get(4).copied() {
        None => return Err(ImageDefect::ElfHeaderTruncated { len, need: 52 }),
        Some(1) => false,
        Some(2) => true,
        Some(c) => return Err(ImageDefect::ElfClass(c)),
    };
    if b.get(5) != Some(&1) {
        return Err(ImageDefect::ElfBigEndian);
    }
    let ehdr_size = if is_64 { 64 } else { 52 };
    if len < ehdr_size {
        return Err(ImageDefect::ElfHeaderTruncated {
            len,
            need: ehdr_size,
        });
    }
    let machine = rd_u16(b, 18).unwrap_or(0);
    if machine != EM_X86_64 && machine != EM_386 {
        return Err(ImageDefect::ElfMachine(machine));
    }
    let (entry, phoff, phentsize, phnum) = if is_64 {
        (
            rd_u64(b, 24).unwrap_or(0),
            rd_u64(b, 32).unwrap_or(0),
            rd_u16(b, 54).unwrap_or(0),
            rd_u16(b, 56).unwrap_or(0),
        )
    } else {
        (
            u64::from(rd_u32(b, 24).unwrap_or(0)),
            u64::from(rd_u32(b, 28).unwrap_or(0)),
            rd_u16(b, 42).unwrap_or(0),
            rd_u16(b, 44).unwrap_or(0),
        )
    };
    let min_phent = if is_64 { 56 } else { 32 };
    if phnum == 0 {
        return Err(ImageDefect::NoProgramHeaders);
    }
    if phentsize < min_phent {
        return Err(ImageDefect::ProgramHeaderSize {
            size: phentsize,
            min: min_phent,
        });
    }
    let ph_end = phoff
        .checked_add(u64::from(phentsize) * u64::from(phnum))
        .ok_or(ImageDefect::ProgramHeaderOverflow)?;
    if ph_end > len {
        return Err(ImageDefect::ProgramHeadersPastEnd {
            count: phnum,
            offset: phoff,
            end: ph_end,
            len,
        });
    }
    let mut segments = Vec::new();
    let mut pvh_entry = None;
    for i in 0..u64::from(phnum) {
        let ph = phoff + i * u64::from(phentsize);
        // All reads below are within ph..ph_end, checked above.
        let p_type = rd_u32(b, ph).unwrap_or(0);
        let (offset, vaddr, paddr, filesz, memsz) = if is_64 {
            (
                rd_u64(b, ph + 8).unwrap_or(0),
                rd_u64(b, ph + 16).unwrap_or(0),
                rd_u64(b, ph + 24).unwrap_or(0),
                rd_u64(b, ph + 32).unwrap_or(0),
                rd_u64(b, ph + 40).unwrap_or(0),
            )
        } else {
            (
                u64::from(rd_u32(b, ph + 4).unwrap_or(0)),
                u64::from(rd_u32(b, ph + 8).unwrap_or(0)),
                u64::from(rd_u32(b, ph + 12).unwrap_or(0)),
                u64::from(rd_u32(b, ph + 16).unwrap_or(0)),
                u64::from(rd_u32(b, ph + 20).unwrap_or(0)),
            )
        };
        if p_type != PT_LOAD && p_type != PT_NOTE {
            continue;
        }
        let file_end = offset.checked_add(filesz).filter(|&e| e <= len);
        let Some(file_end) = file_end else {
            return Err(ImageDefect::SegmentPastEnd {
                index: i,
                offset,
                size: filesz,
                len,
            });
        };
        if p_type == PT_NOTE {
            if pvh_entry.is_none() {
                pvh_entry = find_pvh_note(&b[offset as usize..file_end as usize]);
            }
            continue;
        }
        if memsz < filesz {
            return Err(ImageDefect::MemszBelowFilesz {
                index: i,
                memsz,
                filesz,
            });
        }
        if memsz == 0 {
            continue;
        }
        if paddr.checked_add(memsz).is_none() {
            return Err(ImageDefect::SegmentWraps {
                index: i,
                paddr,
                memsz,
            });
        }
        segments.push(Segment {
            offset,
            vaddr,
            paddr,
            filesz,
            memsz,
        });
    }
    if segments.is_empty() {
        return Err(ImageDefect::NoLoadSegment);
    }
    Ok(ElfInfo {
        is_64,
        entry,
        segments,
        pvh_entry,
    })
}

/// Walks the notes of one `PT_NOTE` segment looking for the PVH entry (name "Xen", type 18).
fn find_pvh_note(notes: &[u8]) -> Option<u64> {
    let align4 = |x: u64| x.checked_add(3).map(|v| v & !3);
    let mut off = 0u64;
    while off + 12 <= notes.len() as u64 {
        let namesz = u64::from(rd_u32(notes, off)?);
        let descsz = u64::from(rd_u32(notes, off + 4)?);
        let ntype = rd_u32(notes, off + 8)?;
        let name_off = off + 12;
        let desc_off = name_off.checked_add(align4(namesz)?)?;
        let next = desc_off.checked_add(align4(descsz)?)?;
        if ntype == XEN_ELFNOTE_PHYS32_ENTRY && namesz == 4 {
            let name = notes.get(name_off as usize..name_off as usize + 4)?;
            if name == b"Xen\0" {
                return match descsz {
                    4..=7 => rd_u32(notes, desc_off).map(u64::from),
                    8.. => rd_u64(notes, desc_off),
                    _ => None,
                };
            }
        }
        off = next;
    }
    None
}

/// The bzImage setup header fields this crate uses (offsets from the start of the file).
pub(crate) mod bzhdr {
    pub const SETUP_SECTS: usize = 0x1f1;
    pub const HEADER_START: usize = 0x1f1;
}
