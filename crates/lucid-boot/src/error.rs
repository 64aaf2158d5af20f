//! The one error type of this crate.

use std::path::PathBuf;

/// Everything that can go wrong while loading a kernel or writing boot tables. Each variant says
/// what failed and with which input.
#[derive(Debug, thiserror::Error)]
pub enum BootError {
    /// Opening or reading a kernel or initrd file failed.
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A kernel or initrd path names something other than a regular file (a device, a FIFO, a
    /// directory): refused before reading, as reading `/dev/zero` or a FIFO would never end.
    #[error("{what} {path} is {kind}, not a regular file")]
    NotARegularFile {
        path: PathBuf,
        what: &'static str,
        kind: crate::file::FileKind,
    },
    /// A kernel or initrd file is larger than Lucid reads for it.
    #[error("{what} {path} is {size} bytes, more than the {max} bytes Lucid reads for it")]
    FileTooLarge {
        path: PathBuf,
        what: &'static str,
        size: u64,
        max: u64,
    },
    /// The file is none of the formats this crate boots.
    #[error("not a kernel: {path}: {why}")]
    NotAKernel { path: PathBuf, why: NotAKernel },
    /// The file looks like a kernel of a known format but is malformed (truncated ELF, bad
    /// header fields, ...).
    #[error("bad kernel image {path}: {why}")]
    BadImage { path: PathBuf, why: ImageDefect },
    /// Guest RAM is too small for the kernel (and initrd).
    #[error("memory too small: {what} needs {need_mib} MiB, guest has {have_mib} MiB")]
    MemoryTooSmall {
        what: &'static str,
        need_mib: u64,
        have_mib: u64,
    },
    /// A range the kernel asks for is not guest RAM at all (in the MMIO hole, or above any RAM
    /// the layout can provide).
    #[error("{path}: {what} {start:#x}..{end:#x} is not usable guest RAM ({why})")]
    OutsideRam {
        path: PathBuf,
        what: &'static str,
        start: u64,
        end: u64,
        why: &'static str,
    },
    /// A boot structure with a fixed home (the ACPI RSDP in the BIOS area), or one that found
    /// no free low RAM at all, collides with what the kernel or initrd asked for.
    #[error("no room for {what} ({size} bytes) in {start:#x}..{end:#x}: {taken}")]
    NoRoom {
        what: &'static str,
        size: u64,
        start: u64,
        end: u64,
        taken: crate::area::Claims,
    },
    /// linux-loader failed to copy a kernel that this crate's parser accepted.
    #[error("loading {path} into guest memory failed: {source}")]
    Loader {
        path: PathBuf,
        #[source]
        source: linux_loader::loader::Error,
    },
    /// The kernel command line does not fit.
    #[error("kernel command line is {len} bytes, at most {max} are allowed")]
    CmdlineTooLong { len: usize, max: usize },
    /// The kernel command line contains a NUL byte.
    #[error("kernel command line contains a NUL byte at offset {offset}")]
    CmdlineNul { offset: usize },
    /// Writing guest memory failed (the address is not backed by a memory region).
    #[error("writing {len} bytes of {what} to guest memory at {addr:#x} failed: {source}")]
    GuestWrite {
        what: &'static str,
        addr: u64,
        len: usize,
        #[source]
        source: vm_memory::GuestMemoryError,
    },
    /// Reading a file into guest memory failed.
    #[error("reading {len} bytes of {path} into guest memory at {addr:#x} failed: {source}")]
    GuestLoad {
        path: PathBuf,
        addr: u64,
        len: usize,
        #[source]
        source: vm_memory::GuestMemoryError,
    },
    /// A vCPU count this crate cannot describe (APIC IDs are 8 bits and one is the I/O APIC's).
    #[error("vcpu count {0} is not in 1..=254")]
    BadVcpuCount(u8),
}

/// Why a file is not a kernel of any format this crate boots.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum NotAKernel {
    #[error("the file is empty")]
    Empty,
    #[error("32-bit ELF with neither a PVH note (Xen, type 18) nor a multiboot header")]
    Elf32WithoutProtocol,
    #[error("multiboot header without the address fields (flag bit 16) in a non-ELF file")]
    MultibootWithoutAddresses,
    #[error("no ELF magic, multiboot header or bzImage \"HdrS\" signature at 0x202")]
    UnknownFormat,
}

/// What is wrong with a kernel image of a known format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ImageDefect {
    #[error("ELF header truncated: file is {len} bytes, the header needs {need}")]
    ElfHeaderTruncated { len: u64, need: u64 },
    #[error("ELF class {0} is neither 32-bit (1) nor 64-bit (2)")]
    ElfClass(u8),
    #[error("ELF is not little-endian")]
    ElfBigEndian,
    #[error("ELF machine {0} is not x86 (3) or x86-64 (62)")]
    ElfMachine(u16),
    #[error("ELF has no program headers")]
    NoProgramHeaders,
    #[error("ELF program header size {size} is smaller than {min}")]
    ProgramHeaderSize { size: u16, min: u16 },
    #[error("ELF program header offset overflows")]
    ProgramHeaderOverflow,
    #[error(
        "ELF program headers ({count} at offset {offset:#x}) end at {end:#x}, past the end of \
         the file ({len:#x} bytes): truncated?"
    )]
    ProgramHeadersPastEnd {
        count: u16,
        offset: u64,
        end: u64,
        len: u64,
    },
    #[error(
        "ELF segment {index} (file offset {offset:#x}, {size:#x} bytes) runs past the end of \
         the file ({len:#x} bytes): truncated?"
    )]
    SegmentPastEnd {
        index: u64,
        offset: u64,
        size: u64,
        len: u64,
    },
    #[error("ELF segment {index} has p_memsz {memsz:#x} smaller than p_filesz {filesz:#x}")]
    MemszBelowFilesz { index: u64, memsz: u64, filesz: u64 },
    #[error("ELF segment {index} at {paddr:#x} with {memsz:#x} bytes wraps around")]
    SegmentWraps { index: u64, paddr: u64, memsz: u64 },
    #[error("ELF has no PT_LOAD segment")]
    NoLoadSegment,
    #[error("ELF entry point {0:#x} is outside every PT_LOAD segment")]
    EntryOutsideSegments(u64),
    #[error("PVH entry point {0:#x} is not a 32-bit address")]
    PvhEntryAbove4G(u64),
    #[error(
        "multiboot header requires features {unknown:#x} (flags {flags:#x}) this loader lacks"
    )]
    MultibootFlags { unknown: u32, flags: u32 },
    #[error("multiboot load_addr {load:#x} is above header_addr {header:#x}")]
    MultibootLoadAboveHeader { load: u64, header: u64 },
    #[error(
        "multiboot header at file offset {offset:#x} cannot be {back:#x} bytes past load_addr"
    )]
    MultibootHeaderOffset { offset: u64, back: u64 },
    #[error("multiboot load_end_addr {load_end:#x} is below load_addr {load:#x}")]
    MultibootLoadEndBelowLoad { load_end: u32, load: u64 },
    #[error(
        "multiboot load range {load:#x}..{end:#x} needs {size:#x} bytes from file offset \
         {offset:#x}, the file has {have:#x}: truncated?"
    )]
    MultibootTruncated {
        load: u64,
        end: u64,
        size: u64,
        offset: u64,
        have: u64,
    },
    #[error("multiboot header without address fields in a non-ELF file")]
    MultibootWithoutAddresses,
    #[error("multiboot kernel must lie below 4 GiB (entry {entry:#x}, end {end:#x})")]
    MultibootAbove4G { entry: u64, end: u64 },
    #[error(
        "bzImage boot protocol {}.{:02} (xloadflags {xloadflags:#x}) has no 64-bit entry point; \
         2.12 with XLF_KERNEL_64 is needed",
        version >> 8,
        version & 0xff
    )]
    BzImageNo64BitEntry { version: u16, xloadflags: u16 },
    #[error("bzImage is not LOADED_HIGH (a zImage?)")]
    BzImageNotLoadedHigh,
    #[error("bzImage setup is {setup:#x} bytes but the file has only {len:#x}: truncated?")]
    BzImageSetupTruncated { setup: u64, len: u64 },
    #[error(
        "bzImage protected-mode part is {syssize:#x} bytes (syssize) but only {have:#x} follow \
         the setup: truncated?"
    )]
    BzImagePayloadTruncated { syssize: u64, have: u64 },
    #[error(
        "bzImage decompression area at pref_address {pref:#x} with init_size {init_size:#x} \
         wraps around"
    )]
    BzImageDecompressionWraps { pref: u64, init_size: u32 },
}
