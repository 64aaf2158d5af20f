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
    NotAKernel { path: PathBuf, why: String },
    /// The file looks like a kernel of a known format but is malformed (truncated ELF, bad
    /// header fields, ...).
    #[error("bad kernel image {path}: {why}")]
    BadImage { path: PathBuf, why: String },
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
