//! Boots kernels in a Lucid VM: detects the kernel format, loads it with its initrd and command
//! line into guest memory, writes the boot information its protocol wants, the ACPI tables and
//! the entry registers, and adjusts CPUID per vCPU.
//!
//! # Kernel formats ([`KernelKind`], detected by content)
//!
//! | kind | detected by | entry |
//! |---|---|---|
//! | [`KernelKind::PvhElf`] | ELF32/64 with a `XEN_ELFNOTE_PHYS32_ENTRY` (18, "Xen") note; wins over multiboot | 32-bit flat protected mode, paging off, EBX = `hvm_start_info` |
//! | [`KernelKind::Multiboot`] | multiboot v1 header (0x1BADB002, checksum valid, 4-aligned, first 8 KiB); ELF, or any binary with the a.out kludge (flag 16) | 32-bit protected mode, EAX = 0x2BADB002, EBX = multiboot info |
//! | [`KernelKind::LinuxElf`] | any other ELF64 (a `vmlinux`) | 64-bit boot protocol: long mode, RIP = e_entry (physical), RSI = zero page |
//! | [`KernelKind::BzImage`] | "HdrS" at 0x202 | 64-bit boot protocol: RIP = load address + 0x200, RSI = zero page |
//!
//! All formats get the same memory map ([`memmap::memory_map`]): RAM below the EBDA, reserved
//! EBDA..1 MiB (BIOS area with the ACPI tables), RAM 1 MiB..end of low RAM, the PCIe ECAM window
//! reserved, RAM above 4 GiB (and the ACPI tables reserved wherever they had to go instead).
//!
//! # Guest-physical placement ([`layout`], `area.rs`)
//!
//! The kernel goes where it asks, anywhere in RAM, below 1 MiB too (as under QEMU: ELF segments
//! to their physical addresses, ELF headers at 0xff000 included; a multiboot a.out image to its
//! `load_addr`; a bzImage to its `code32_start` with RAM up to `pref_address + init_size`). The
//! initrd is placed page-aligned as high as possible below the end of low RAM (and below
//! `initrd_addr_max` for Linux), except for multiboot where it is module 0 right after the kernel.
//! Then Lucid's own structures are placed around them, each at its usual address if free, else
//! in the lowest free range: ACPI RSDP in 0xe0000..0x100000 ([`layout::ACPI_START`]; the one
//! structure that cannot go anywhere else, so the one real overlap), the ACPI tables after it,
//! boot info (start_info / multiboot info / zero page) at [`layout::BOOT_INFO`], memory map at
//! [`layout::MEMMAP`] (PVH, multiboot), module list at [`layout::MODLIST`], command line at
//! [`layout::CMDLINE`], GDT at [`layout::BOOT_GDT`], stack at [`layout::BOOT_STACK_BASE`], page
//! tables at [`layout::PML4`]. A moved structure is logged (info).
//!
//! # How the VMM boots a guest
//!
//! ```text
//! let mem = GuestMemoryMmap::from_ranges(&layout::ram_regions(mem_size) ...)?;
//! let acpi = AcpiConfig::new(vcpus);
//! let setup = lucid_boot::load(&mem, BootParams {                    // 1-2. kernel, ACPI
//!     kernel: &kernel_path, initrd: initrd_path.as_deref(), cmdline: &cmdline,
//!     mem_size, acpi: Some(&acpi) })?;
//! for each vCPU i:                                                          // 3. CPUID
//!     let mut cpuid = kvm.get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)?;
//!     lucid_boot::filter_cpuid(&mut cpuid, i, vcpus); vcpu.set_cpuid2(&cpuid)?;
//! on the boot vCPU (0):                                                     // 4. registers
//!     let (mut regs, mut sregs) = (vcpu.get_regs()?, vcpu.get_sregs()?);
//!     lucid_boot::setup_boot_regs(&setup.entry, &mut regs, &mut sregs, &mem)?;
//!     vcpu.set_sregs(&sregs)?; vcpu.set_regs(&regs)?;
//! ```
//!
//! The other vCPUs stay in their reset state and are started by the guest with INIT/SIPI.

pub mod acpi;
mod area;
pub mod cpuid;
mod error;
pub mod file;
pub mod kernel;
pub mod layout;
pub mod loader;
pub mod memmap;
pub mod regs;

use std::path::Path;

pub use acpi::{write_acpi_tables, AcpiConfig, DmarUnit};
pub use area::{Claim, Claims};
pub use cpuid::filter_cpuid;
pub use error::{BootError, ImageDefect, NotAKernel};
pub use kernel::{KernelImage, KernelKind};
pub use regs::setup_boot_regs;
use vm_memory::GuestMemoryMmap;

/// What to boot.
#[derive(Clone, Copy, Debug)]
pub struct BootParams<'a> {
    /// Kernel image (PVH ELF, multiboot, vmlinux or bzImage).
    pub kernel: &'a Path,
    /// Initial ramdisk: PVH module 0, multiboot module 0, or the Linux initrd.
    pub initrd: Option<&'a Path>,
    /// Kernel command line (no NUL bytes).
    pub cmdline: &'a str,
    /// Guest RAM size in bytes; the memory must be laid out by [`layout::ram_regions`].
    pub mem_size: u64,
    /// ACPI tables to write where the kernel leaves room; the RSDP's address is passed to PVH
    /// and Linux kernels (multiboot kernels scan the BIOS area for it). `None`: no ACPI.
    pub acpi: Option<&'a AcpiConfig>,
}

/// The CPU mode and registers a protocol enters the kernel with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EntryMode {
    /// 32-bit protected mode, flat segments, paging off (PVH, multiboot).
    Protected32 { eip: u64, eax: u64, ebx: u64 },
    /// 64-bit long mode with identity-mapped low 4 GiB (Linux 64-bit boot protocol).
    Long64 { rip: u64, rsi: u64 },
}

/// The entry state of the boot vCPU, for [`setup_boot_regs`]: the mode and registers, and where
/// the boot GDT, stack and (64-bit entries) page tables go, clear of the kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EntryState {
    pub mode: EntryMode,
    /// The boot GDT, with an empty IDT after it ([`layout::BOOT_GDT_SIZE`] bytes).
    pub gdt: u64,
    /// Initial RSP.
    pub stack_top: u64,
    /// PML4 of the identity map ([`layout::PAGE_TABLES_SIZE`] bytes); 0 for 32-bit entries.
    pub page_tables: u64,
}

/// The result of [`load`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BootSetup {
    pub kind: KernelKind,
    pub entry: EntryState,
    /// End (exclusive) of the memory the kernel occupies, bss (and for bzImage the
    /// decompression area) included.
    pub kernel_end: u64,
    /// Guest-physical address and size of the initrd.
    pub initrd: Option<(u64, u64)>,
    /// Guest-physical address of the boot information (start_info, multiboot info, zero page).
    pub boot_info: u64,
    /// Guest-physical address of the ACPI RSDP, when [`BootParams::acpi`] asked for tables.
    pub acpi_rsdp: Option<u64>,
}

/// Reads and detects `p.kernel`, then loads it (see [`load_image`]).
pub fn load(mem: &GuestMemoryMmap, p: BootParams) -> Result<BootSetup, BootError> {
    let image = KernelImage::open(p.kernel)?;
    load_image(mem, &image, &p)
}

/// Loads an already detected kernel image, its initrd and command line into `mem` and writes the
/// boot information of its protocol.
pub fn load_image(
    mem: &GuestMemoryMmap,
    image: &KernelImage,
    p: &BootParams,
) -> Result<BootSetup, BootError> {
    loader::load(mem, image, p)
}

#[cfg(test)]
mod tests;
