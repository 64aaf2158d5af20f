//! The guest-physical address map Lucid gives every x86-64 VM. One place, so that boot code, ACPI
//! tables, devices and the probe-guest kit agree.

/// Usual addresses of Lucid's boot structures (below 1 MiB). A structure moves to free memory
/// when the kernel or initrd asks for its usual place (`area.rs`); the boot information tells the
/// guest where each one is.
pub const BOOT_GDT: u64 = 0x500;
/// The GDT (4 entries) followed by an empty IDT (8 bytes).
pub const BOOT_GDT_SIZE: u64 = 0x28;
/// Offset of the empty boot IDT from the GDT.
pub const BOOT_IDT_OFFSET: u64 = 0x20;
/// PVH `hvm_start_info`, multiboot info or Linux `boot_params` (the zero page).
pub const BOOT_INFO: u64 = 0x7000;
/// Identity page tables for 64-bit entry: PML4, PDPT, then 4 page directories (4 GiB of 2 MiB
/// pages), one page each and in this order.
pub const PML4: u64 = 0x9000;
pub const PAGE_TABLES_SIZE: u64 = 0x6000;
/// e820 / memory map entries written next to the boot info when a protocol wants them apart.
pub const MEMMAP: u64 = 0x10000;
pub const CMDLINE: u64 = 0x20000;
pub const CMDLINE_MAX: usize = 0x10000;
/// Multiboot module list / PVH `hvm_modlist_entry` array, followed by their strings.
pub const MODLIST: u64 = 0x6000;
/// Strings referenced from the module list (module command lines, boot loader name).
pub const MODLIST_STRINGS: u64 = 0x6800;
/// Stack for entries that do not bring their own: 4 KiB, RSP 16 bytes below its top (0x8ff0).
pub const BOOT_STACK_BASE: u64 = 0x8000;
pub const BOOT_STACK_SIZE: u64 = 0x1000;
/// Start of the EBDA; RAM below 640 KiB ends here.
pub const EBDA_START: u64 = 0x9fc00;
/// ACPI tables live in the BIOS area so that a legacy RSDP scan finds them too (the tables move
/// out, reserved in the memory map, if the kernel leaves too little room there; the RSDP never).
pub const ACPI_START: u64 = 0xe0000;
pub const ACPI_END: u64 = 0x100000;
/// Kernels load at 1 MiB unless their headers say otherwise; RAM above it is "upper memory".
pub const HIGH_MEMORY: u64 = 0x10_0000;

/// The MMIO hole below 4 GiB: PCI BARs, ECAM, IOAPIC, LAPIC.
pub const MMIO_HOLE_START: u64 = 0xc000_0000;
pub const MMIO_HOLE_END: u64 = 0x1_0000_0000;
/// 32-bit PCI BAR window.
pub const PCI_MMIO_START: u64 = 0xc000_0000;
pub const PCI_MMIO_END: u64 = 0xd000_0000;
/// An unassigned MMIO page that probe guests use to measure MMIO exits (`mmio-ping`).
pub const PROBE_MMIO: u64 = 0xd000_0000;
/// PCI Express ECAM, 256 buses.
pub const PCI_ECAM_START: u64 = 0xe000_0000;
pub const PCI_ECAM_SIZE: u64 = 0x1000_0000;
pub const IOAPIC_START: u64 = 0xfec0_0000;
/// IOAPIC pins 16-23 carry PCI INTx (the ISA IRQs keep 0-15).
pub const PCI_INTX_FIRST_GSI: u32 = 16;
pub const PCI_INTX_PINS: u32 = 8;

/// The IOAPIC GSI of INTx pin `pin` (0 = INTA .. 3 = INTD) of the device in bus-0 slot `slot`
/// (1 and up; slot 0 is the host bridge): slots rotate over the 8 pins, and a slot's INTB-INTD
/// continue from its INTA, the usual swizzle. The VMM wires devices and the DSDT's `_PRT`
/// describes them with this one rule.
pub fn pci_intx_gsi(slot: u8, pin: u8) -> u32 {
    let n = u32::from(slot).wrapping_sub(1).wrapping_add(u32::from(pin)) % PCI_INTX_PINS;
    PCI_INTX_FIRST_GSI + n
}
pub const LAPIC_START: u64 = 0xfee0_0000;
/// RAM above the hole starts at 4 GiB.
pub const HIGH_RAM_START: u64 = 0x1_0000_0000;

/// I/O ports of Lucid's platform devices.
pub mod ports {
    pub const SERIAL_COM1: u16 = 0x3f8;
    pub const I8042: u16 = 0x60;
    pub const I8042_CMD: u16 = 0x64;
    pub const RTC: u16 = 0x70;
    /// QEMU-compatible `isa-debug-exit`: the process exits with `(value << 1) | 1`.
    pub const DEBUG_EXIT: u16 = 0xf4;
    /// POST code port; accepted and ignored, as firmware and Linux write it for delays.
    pub const POST: u16 = 0x80;
    /// Lucid's hypercall port: `out dx, eax` with eax = call number, rdi/rsi/r8 = arguments;
    /// the result is returned in rax. Unclaimed on other VMMs, so a guest can detect Lucid.
    pub const HYPERCALL: u16 = 0x599;
    /// A port the probe kit writes to measure an exit that an ioeventfd absorbs in the kernel.
    pub const IOEVENTFD_PROBE: u16 = 0x598;
    /// ACPI fixed hardware, at QEMU q35's (ICH9) PM base: PM1a event block (status, enable)
    /// 0x600-0x603, PM1a control 0x604-0x605, PM timer 0x608-0x60b.
    pub const ACPI_PM_BASE: u16 = 0x600;
    pub const ACPI_PM1A_EVT: u16 = ACPI_PM_BASE;
    pub const ACPI_PM1A_CNT: u16 = ACPI_PM_BASE + 4;
    pub const ACPI_PM_TMR: u16 = ACPI_PM_BASE + 8;
    /// The PCI hotplug controller's registers ([`super::pci_hotplug`]), at the port QEMU's
    /// PIIX4 hotplug block uses.
    pub const PCI_HOTPLUG: u16 = 0xae00;
    /// QEMU's fw_cfg at QEMU's x86 ports: selector 0x510, data 0x511, DMA address 0x514-0x51b.
    pub const FW_CFG: u16 = 0x510;
    pub const FW_CFG_LEN: u8 = 0x0c;
}

/// The PCI hotplug controller: four 32-bit registers at [`ports::PCI_HOTPLUG`], one bit per
/// bus-0 slot, that the DSDT's AML reads when the Generic Event Device ([`GED_GSI`]) fires.
pub mod pci_hotplug {
    /// Length of the register block in bytes.
    pub const LEN: u64 = 16;
    /// Read: slots with a new device for the guest to check (cleared by the read).
    pub const UP: u64 = 0;
    /// Read: slots whose device the VMM asks the guest to release.
    pub const DOWN: u64 = 4;
    /// Write: slots the guest ejected (`_EJ0`): the VMM detaches their devices.
    pub const EJECT: u64 = 8;
    /// Read: which events fired since the last read (cleared by the read).
    pub const EVENT: u64 = 12;
    /// [`EVENT`] bit: a slot changed ([`UP`] or [`DOWN`]).
    pub const EVENT_PCI: u32 = 1;
    /// [`EVENT`] bit: the ACPI power button was pressed.
    pub const EVENT_POWER_BUTTON: u32 = 2;
}

/// The Generic Event Device's interrupt (edge, active high): a free ISA IRQ.
pub const GED_GSI: u32 = 5;

/// The ACPI SCI: ISA IRQ 9, level-triggered, active high (the MADT overrides IRQ 9 so), through
/// the IOAPIC pin of the same number.
pub const ACPI_SCI_IRQ: u8 = 9;

/// The RAM ranges (guest-physical start, length) for `mem_size` bytes of guest memory: low RAM up to
/// the MMIO hole, the rest from 4 GiB.
pub fn ram_regions(mem_size: u64) -> Vec<(u64, u64)> {
    if mem_size <= MMIO_HOLE_START {
        vec![(0, mem_size)]
    } else {
        vec![
            (0, MMIO_HOLE_START),
            (HIGH_RAM_START, mem_size - MMIO_HOLE_START),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ram_splits_around_hole() {
        assert_eq!(ram_regions(256 << 20), vec![(0, 256 << 20)]);
        let r = ram_regions(4 << 30);
        assert_eq!(r, vec![(0, 3 << 30), (4 << 30, 1 << 30)]);
    }
}
