//! ACPI tables: RSDP (v2) -> XSDT -> FADT (-> DSDT), MADT, and MCFG when PCIe ECAM is configured.
//!
//! Written into the BIOS area at [`ACPI_START`] with the RSDP first (16-byte aligned), so that a
//! legacy scan of 0xe0000..0x100000 finds it as well as the address passed in the boot info.
//!
//! # FADT choice: hardware-reduced ACPI
//!
//! The FADT (revision 6.5) sets `HW_REDUCED_ACPI`, like Firecracker, Cloud Hypervisor and QEMU's
//! microvm. Lucid has no PM1/PM-timer/GPE blocks and no SMI command port; a full (non-reduced)
//! FADT without them makes ACPICA report missing required registers and makes Linux install an
//! SCI handler on registers at address 0. With hardware-reduced ACPI Linux skips all of that, and
//! on x86 it also uses the null legacy PIC and does not set up the PIT as a clock event; it runs
//! on the local APIC timer (calibrated against the TSC / kvm-clock), and takes ISA interrupts
//! through the I/O APIC with the GSIs from the DSDT `_CRS` resources. The legacy devices are
//! still found:
//!
//! - With [`AcpiConfig::i8042`], `IAPC_BOOT_ARCH` has the 8042 bit and the DSDT a `PNP0303`
//!   device, so Linux's `i8042` driver probes ports 0x60/0x64. Lucid's VMs leave it off: their
//!   i8042 is only a reset line, which `reboot=k` uses without asking ACPI. VGA-not-present and
//!   PCIe-ASPM-controls are set.
//! - The PCI root bridge's `_PRT` routes each slot's INTx to the IOAPIC GSI the VMM raises
//!   ([`crate::layout::pci_intx_gsi`]).
//! - COM1 is a `PNP0501` device with I/O 0x3f8-0x3ff and IRQ 4, which `8250_pnp` binds.
//! - The PIT (ports 0x40-0x43) is not described and Linux does not register it as a clock event
//!   device on a hardware-reduced platform; the guest still may program it directly.
//!
//! If a guest ever needs the PIT/8259 path, switch to a full FADT: that needs PM1a event/control
//! and PM timer blocks emulated by the VMM (QEMU's q35 style), not just a flag flip.
//!
//! The MADT still has the `PCAT_COMPAT` flag and the interrupt source overrides IRQ0 -> GSI2 and
//! IRQ9 level/active-high that KVM's in-kernel irqchip routing (and a non-reduced guest) expects.

use acpi_tables::aml::{
    AddressSpace, AddressSpaceCacheable, Device, EISAName, Interrupt, Name, Package,
    PackageBuilder, Path, ResourceTemplate, Scope, IO,
};
use acpi_tables::fadt::{FADTBuilder, Flags};
use acpi_tables::mcfg::MCFG;
use acpi_tables::rsdp::Rsdp;
use acpi_tables::sdt::Sdt;
use acpi_tables::xsdt::XSDT;
use acpi_tables::Aml;
use vm_memory::GuestMemoryMmap;

use crate::layout::{
    pci_intx_gsi, ports, ACPI_END, ACPI_START, IOAPIC_START, LAPIC_START, PCI_MMIO_END,
    PCI_MMIO_START,
};
use crate::loader::write_bytes;
use crate::BootError;

/// OEM ID in every table header.
pub const OEM_ID: [u8; 6] = *b"LUCID ";
const OEM_REVISION: u32 = 1;

/// What the ACPI tables describe.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AcpiConfig {
    /// Number of vCPUs; APIC IDs are 0..vcpus, the I/O APIC gets ID `vcpus`.
    pub vcpus: u8,
    /// PCIe ECAM window: (base, first bus, last bus). Adds an MCFG table and a `PNP0A08` root
    /// bridge with bus range, I/O ports 0xcf8/0xd00-0xffff and the 32-bit BAR window.
    pub pci_ecam: Option<(u64, u8, u8)>,
    /// Describe COM1 (0x3f8, IRQ 4) in the DSDT.
    pub com1: bool,
    /// Describe the i8042 (0x60/0x64, IRQ 1) in the DSDT and set the 8042 boot flag.
    pub i8042: bool,
}

impl AcpiConfig {
    /// `vcpus` vCPUs with COM1 and the i8042, no PCI.
    pub fn new(vcpus: u8) -> Self {
        AcpiConfig {
            vcpus,
            pci_ecam: None,
            com1: true,
            i8042: true,
        }
    }
}

/// FADT `IAPC_BOOT_ARCH` bits.
const IAPC_8042: u16 = 1 << 1;
const IAPC_VGA_NOT_PRESENT: u16 = 1 << 2;
const IAPC_PCIE_ASPM_CONTROLS: u16 = 1 << 4;
/// MADT flag: the system also has dual 8259s.
const MADT_PCAT_COMPAT: u32 = 1;

fn to_bytes(t: &dyn Aml) -> Vec<u8> {
    let mut v = Vec::new();
    t.to_aml_bytes(&mut v);
    v
}

fn table_id(sig: &[u8; 4]) -> [u8; 8] {
    let mut id = *b"LUCID   ";
    id[4..].copy_from_slice(sig);
    id
}

/// The DSDT's AML.
fn dsdt_aml(cfg: &AcpiConfig) -> Vec<u8> {
    let com1_hid = Name::new(Path::new("_HID"), &EISAName::new("PNP0501"));
    let com1_uid = Name::new(Path::new("_UID"), &1u8);
    let com1_io = IO::new(ports::SERIAL_COM1, ports::SERIAL_COM1, 1, 8);
    let com1_irq = Interrupt::new(true, true, false, false, 4);
    let com1_crs = Name::new(
        Path::new("_CRS"),
        &ResourceTemplate::new(vec![&com1_io, &com1_irq]),
    );
    let com1 = Device::new(Path::new("COM1"), vec![&com1_hid, &com1_uid, &com1_crs]);

    let kbd_hid = Name::new(Path::new("_HID"), &EISAName::new("PNP0303"));
    let kbd_io0 = IO::new(ports::I8042, ports::I8042, 1, 1);
    let kbd_io1 = IO::new(ports::I8042_CMD, ports::I8042_CMD, 1, 1);
    let kbd_irq = Interrupt::new(true, true, false, false, 1);
    let kbd_crs = Name::new(
        Path::new("_CRS"),
        &ResourceTemplate::new(vec![&kbd_io0, &kbd_io1, &kbd_irq]),
    );
    let kbd = Device::new(Path::new("PS2K"), vec![&kbd_hid, &kbd_crs]);

    let (first_bus, last_bus) = cfg.pci_ecam.map_or((0, 0), |(_, f, l)| (f, l));
    let pci_hid = Name::new(Path::new("_HID"), &EISAName::new("PNP0A08"));
    let pci_cid = Name::new(Path::new("_CID"), &EISAName::new("PNP0A03"));
    let pci_adr = Name::new(Path::new("_ADR"), &0u8);
    let pci_seg = Name::new(Path::new("_SEG"), &0u8);
    let pci_uid = Name::new(Path::new("_UID"), &0u8);
    let pci_bbn = Name::new(Path::new("_BBN"), &first_bus);
    let bus = AddressSpace::new_bus_number(u16::from(first_bus), u16::from(last_bus));
    let cfg_io = IO::new(0xcf8, 0xcf8, 1, 8);
    let io_lo = AddressSpace::new_io(0u16, 0xcf7u16, None);
    let io_hi = AddressSpace::new_io(0xd00u16, 0xffffu16, None);
    let mmio = AddressSpace::new_memory(
        AddressSpaceCacheable::NotCacheable,
        true,
        PCI_MMIO_START as u32,
        (PCI_MMIO_END - 1) as u32,
        None,
    );
    let pci_crs = Name::new(
        Path::new("_CRS"),
        &ResourceTemplate::new(vec![&bus, &cfg_io, &io_lo, &io_hi, &mmio]),
    );
    let pci_prt = pci_routing_table();
    let pci = Device::new(
        Path::new("PCI0"),
        vec![
            &pci_hid, &pci_cid, &pci_adr, &pci_seg, &pci_uid, &pci_bbn, &pci_crs, &pci_prt,
        ],
    );

    let mut children: Vec<&dyn Aml> = Vec::new();
    if cfg.com1 {
        children.push(&com1);
    }
    if cfg.i8042 {
        children.push(&kbd);
    }
    if cfg.pci_ecam.is_some() {
        children.push(&pci);
    }
    to_bytes(&Scope::new(Path::new("\\_SB_"), children))
}

/// Bus-0 device numbers a `_PRT` covers (slot 0 is the host bridge, which raises no INTx).
const PCI_SLOTS: u8 = 32;

/// The root bridge's `_PRT`: INTA-INTD of every slot to the IOAPIC GSI the VMM raises for it
/// ([`pci_intx_gsi`]). Without it Linux finds no route (`PCI INT A: no GSI`) and a driver that
/// falls back to INTx (no MSI-X, or `pci=nomsi`) never gets an interrupt.
fn pci_routing_table() -> Name {
    let mut prt = PackageBuilder::new();
    for slot in 1..PCI_SLOTS {
        // _ADR form: device in the high word, 0xFFFF = any function.
        let addr = (u32::from(slot) << 16) | 0xffff;
        for pin in 0..4u8 {
            let gsi = pci_intx_gsi(slot, pin);
            // Source 0: the last field is a GSI, not an index into a link device.
            prt.add_element(&Package::new(vec![&addr, &pin, &0u8, &gsi]));
        }
    }
    Name::new(Path::new("_PRT"), &prt)
}

fn madt(cfg: &AcpiConfig) -> Vec<u8> {
    let mut t = Sdt::new(*b"APIC", 44, 5, OEM_ID, table_id(b"APIC"), OEM_REVISION);
    t.write_u32(36, LAPIC_START as u32);
    t.write_u32(40, MADT_PCAT_COMPAT);
    for i in 0..cfg.vcpus {
        // Processor Local APIC: type 0, len 8, UID, APIC ID, flags (enabled).
        t.append_slice(&[0, 8, i, i, 1, 0, 0, 0]);
    }
    // I/O APIC: type 1, len 12, ID, reserved, address, GSI base.
    let mut ioapic = vec![1, 12, cfg.vcpus, 0];
    ioapic.extend_from_slice(&(IOAPIC_START as u32).to_le_bytes());
    ioapic.extend_from_slice(&0u32.to_le_bytes());
    t.append_slice(&ioapic);
    // Interrupt Source Overrides: type 2, len 10, bus 0 (ISA), source IRQ, GSI, MPS flags.
    for (irq, gsi, flags) in [(0u8, 2u32, 0u16), (9, 9, 0x000d)] {
        let mut iso = vec![2, 10, 0, irq];
        iso.extend_from_slice(&gsi.to_le_bytes());
        iso.extend_from_slice(&flags.to_le_bytes());
        t.append_slice(&iso);
    }
    // Local APIC NMI: type 4, len 6, all processors (0xff), flags, LINT1.
    t.append_slice(&[4, 6, 0xff, 0, 0, 1]);
    t.as_slice().to_vec()
}

fn fadt(cfg: &AcpiConfig, dsdt: u64) -> Vec<u8> {
    let mut f = FADTBuilder::new(OEM_ID, table_id(b"FACP"), OEM_REVISION)
        .dsdt_64(dsdt)
        .flag(Flags::HwReducedAcpi)
        .flag(Flags::PwrButton)
        .flag(Flags::SlpButton);
    let mut iapc = IAPC_VGA_NOT_PRESENT | IAPC_PCIE_ASPM_CONTROLS;
    if cfg.i8042 {
        iapc |= IAPC_8042;
    }
    f.iapc_boot_arch = iapc.into();
    f.sci_int = 9u16.into();
    f.hypervisor_vendor_identity = u64::from_le_bytes(*b"LUCIDVMM").into();
    to_bytes(&f.finalize())
}

/// Writes the ACPI tables for `cfg` at [`ACPI_START`] and returns the RSDP's guest-physical
/// address (for `hvm_start_info.rsdp_paddr` / `boot_params.acpi_rsdp_addr`).
pub fn write_acpi_tables(mem: &GuestMemoryMmap, cfg: &AcpiConfig) -> Result<u64, BootError> {
    if cfg.vcpus == 0 || cfg.vcpus == u8::MAX {
        return Err(BootError::BadVcpuCount(cfg.vcpus));
    }
    let rsdp_addr = ACPI_START;
    let mut cursor = ACPI_START + 0x40;
    let mut tables: Vec<(u64, Vec<u8>)> = Vec::new();
    let mut place = |bytes: Vec<u8>, tables: &mut Vec<(u64, Vec<u8>)>| {
        let addr = cursor;
        cursor = (cursor + bytes.len() as u64).next_multiple_of(16);
        tables.push((addr, bytes));
        addr
    };

    let mut dsdt = Sdt::new(*b"DSDT", 36, 2, OEM_ID, table_id(b"DSDT"), OEM_REVISION);
    dsdt.append_slice(&dsdt_aml(cfg));
    let dsdt_addr = place(dsdt.as_slice().to_vec(), &mut tables);
    let fadt_addr = place(fadt(cfg, dsdt_addr), &mut tables);
    let madt_addr = place(madt(cfg), &mut tables);
    let mut xsdt = XSDT::new(OEM_ID, table_id(b"XSDT"), OEM_REVISION);
    xsdt.add_entry(fadt_addr);
    xsdt.add_entry(madt_addr);
    if let Some((base, first, last)) = cfg.pci_ecam {
        let mut mcfg = MCFG::new(OEM_ID, table_id(b"MCFG"), OEM_REVISION);
        // The ECAM base in MCFG is that of bus 0, even when the range starts later.
        mcfg.add_ecam(base, 0, first, last);
        let a = place(to_bytes(&mcfg), &mut tables);
        xsdt.add_entry(a);
    }
    let xsdt_addr = place(to_bytes(&xsdt), &mut tables);
    if cursor > ACPI_END {
        return Err(BootError::AcpiTooBig {
            need: cursor - ACPI_START,
            start: ACPI_START,
            end: ACPI_END,
        });
    }
    for (addr, bytes) in &tables {
        write_bytes(mem, *addr, bytes, "ACPI table")?;
    }
    let rsdp = to_bytes(&Rsdp::new(OEM_ID, xsdt_addr));
    write_bytes(mem, rsdp_addr, &rsdp, "ACPI RSDP")?;
    Ok(rsdp_addr)
}
