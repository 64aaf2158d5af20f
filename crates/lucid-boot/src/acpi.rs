//! ACPI tables: RSDP (v2) -> XSDT -> FADT (-> FACS, DSDT), MADT, and MCFG when PCIe ECAM is
//! configured.
//!
//! Written into the BIOS area at [`ACPI_START`] with the RSDP first (16-byte aligned), so that a
//! legacy scan of 0xe0000..0x100000 finds it as well as the address passed in the boot info. A
//! kernel that loads into the BIOS area pushes the RSDP to the next free 16 bytes there, and the
//! tables, if they no longer fit, into free low RAM (reserved in the memory map).
//!
//! # FADT: full ACPI with PM1a blocks and a PM timer (default), or hardware-reduced
//!
//! With [`AcpiConfig::pm`] (the default) the FADT describes ACPI fixed hardware as QEMU's q35
//! does, at the ICH9 PM base 0x600 ([`ports::ACPI_PM_BASE`]; the VMM registers the device,
//! `lucid_devices::AcpiPm`): PM1a event block 0x600 (4 bytes), PM1a control 0x604 (2), PM timer
//! 0x608 (4, 32-bit: `TMR_VAL_EXT`), no GPE block, no SMI command port (always in ACPI mode:
//! `SCI_EN` reads 1), SCI on IRQ 9 (level, active high, the MADT override) routed through the
//! IOAPIC, a FACS (global lock, waking vector), and `\_S5_` in the DSDT ([`SLP_TYP_S5`]).
//! Sleep states S1-S4 are not offered (no `_S3_`/`_S4_`): the device refuses them with a logged
//! warning. Flags: WBINVD, PROC_C1, power and sleep buttons as control methods (no fixed-feature
//! buttons), FIX_RTC (no RTC wake status), TMR_VAL_EXT; C2/C3 latencies say "not supported".
//! A guest then takes the PC path: Linux uses the 8259 PIC and the PIT early (KVM's in-kernel
//! ones), installs its SCI handler on IRQ 9 and registers the `acpi_pm` clocksource.
//!
//! Without it the FADT is hardware-reduced (`HW_REDUCED_ACPI`, like Firecracker, Cloud
//! Hypervisor and QEMU's microvm): no fixed hardware at all, Linux uses the null legacy PIC and
//! the local APIC timer. Either way:
//!
//! - With [`AcpiConfig::i8042`], `IAPC_BOOT_ARCH` has the 8042 bit and the DSDT a `PNP0303`
//!   device, so Linux's `i8042` driver probes ports 0x60/0x64. Lucid's VMs leave it off: their
//!   i8042 is only a reset line, which `reboot=k` uses without asking ACPI. VGA-not-present and
//!   PCIe-ASPM-controls are set.
//! - The PCI root bridge's `_PRT` routes each slot's INTx to the IOAPIC GSI the VMM raises
//!   ([`crate::layout::pci_intx_gsi`]).
//! - COM1 is a `PNP0501` device with I/O 0x3f8-0x3ff and IRQ 4, which `8250_pnp` binds.
//! - With [`AcpiConfig::fw_cfg`], QEMU's fw_cfg is `FWCF` (`QEMU0002`, I/O 0x510-0x51b).
//!
//! With [`AcpiConfig::dmar`] a DMAR table announces one Intel VT-d unit ([`dmar`]).
//!
//! The MADT has the `PCAT_COMPAT` flag and the interrupt source overrides IRQ0 -> GSI2 and
//! IRQ9 level/active-high that KVM's in-kernel irqchip routing (and the SCI) expect.

use acpi_tables::aml::{
    AddressSpace, AddressSpaceCacheable, And, Device, EISAName, Field, FieldAccessType, FieldEntry,
    FieldLockRule, FieldUpdateRule, If, Interrupt, Local, Method, MethodCall, Name, Notify,
    OpRegion, OpRegionSpace, Package, PackageBuilder, Path, ResourceTemplate, Scope, ShiftLeft,
    Store, IO, ONE, ZERO,
};
use acpi_tables::facs::FACS;
use acpi_tables::fadt::{FADTBuilder, Flags};
use acpi_tables::gas::{AccessSize, AddressSpace as GasSpace, GAS};
use acpi_tables::madt::{
    EnabledStatus, IoApic, LocalInterruptController, ProcessorLocalApic, MADT,
};
use acpi_tables::mcfg::MCFG;
use acpi_tables::rsdp::Rsdp;
use acpi_tables::sdt::Sdt;
use acpi_tables::xsdt::XSDT;
use acpi_tables::{Aml, AmlSink};
use vm_memory::GuestMemoryMmap;
use zerocopy::{Immutable, IntoBytes};

use std::ops::Range;

use crate::area::BootArea;
use crate::layout::{
    pci_hotplug, pci_intx_gsi, ports, ACPI_END, ACPI_SCI_IRQ, ACPI_START, EBDA_START, GED_GSI,
    IOAPIC_START, LAPIC_START, PCI_MMIO_END, PCI_MMIO_START,
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
    /// A full FADT with PM1a event/control blocks, the PM timer, the SCI, a FACS and `\_S5_`
    /// (the VMM must register `lucid_devices::AcpiPm` at [`ports::ACPI_PM_BASE`]); `false` gives
    /// a hardware-reduced FADT.
    pub pm: bool,
    /// An Intel VT-d remapping unit: adds a DMAR table (see [`DmarUnit`]).
    pub dmar: Option<DmarUnit>,
    /// ACPI PCI hotplug and the power button ([`hotplug_aml`]); needs `pci_ecam`.
    pub hotplug: bool,
    /// QEMU's fw_cfg at [`ports::FW_CFG`]: a `QEMU0002` device, which Linux's `qemu_fw_cfg`
    /// (`FW_CFG_SYSFS`) binds.
    pub fw_cfg: bool,
}

/// The one VT-d remapping unit the DMAR table describes: a DRHD with `INCLUDE_PCI_ALL` (every PCI
/// function of segment 0 is behind it) and the I/O APIC in its device scope, so that a guest may
/// enable interrupt remapping.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DmarUnit {
    /// Guest-physical base of the register window (4 KiB aligned).
    pub base: u64,
    /// Size of the register window in 4 KiB pages, a power of two from 1 to 32768.
    pub pages: u32,
}

/// The SLP_TYP value of S5 (soft off) in `\_S5_`, as QEMU's PIIX4 and ICH9 PM use it, so that
/// a guest written for q35 (`outw(0x604, 0x2000)`) powers off Lucid too.
pub const SLP_TYP_S5: u8 = 0;

impl AcpiConfig {
    /// `vcpus` vCPUs with COM1 and the PM blocks; no i8042 (Lucid's is only a reset line,
    /// which `reboot=k` uses without asking ACPI: a described PS/2 controller makes Linux probe
    /// it and fail with `Can't read CTR`), no PCI.
    pub fn new(vcpus: u8) -> Self {
        AcpiConfig {
            vcpus,
            pci_ecam: None,
            com1: true,
            i8042: false,
            pm: true,
            dmar: None,
            hotplug: false,
            fw_cfg: false,
        }
    }
}

/// FADT `IAPC_BOOT_ARCH` bits.
const IAPC_8042: u16 = 1 << 1;
const IAPC_VGA_NOT_PRESENT: u16 = 1 << 2;
const IAPC_PCIE_ASPM_CONTROLS: u16 = 1 << 4;
/// CMOS register with the century (BCD), which the RTC (`lucid_devices::Cmos`) keeps.
const CMOS_CENTURY: u8 = 0x32;
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
    let hotplug = cfg.hotplug.then(HotplugAml::new);
    let mut pci_children: Vec<&dyn Aml> = vec![
        &pci_hid, &pci_cid, &pci_adr, &pci_seg, &pci_uid, &pci_bbn, &pci_crs, &pci_prt,
    ];
    if let Some(h) = &hotplug {
        pci_children.push(&h.pci0);
    }
    let pci = Device::new(Path::new("PCI0"), pci_children);

    // As QEMU describes it: present, enabled, not shown in the UI.
    let fwcf_hid = Name::new(Path::new("_HID"), &"QEMU0002");
    let fwcf_sta = Name::new(Path::new("_STA"), &0x0bu8);
    let fwcf_io = IO::new(ports::FW_CFG, ports::FW_CFG, 1, ports::FW_CFG_LEN);
    let fwcf_crs = Name::new(Path::new("_CRS"), &ResourceTemplate::new(vec![&fwcf_io]));
    let fwcf = Device::new(Path::new("FWCF"), vec![&fwcf_hid, &fwcf_sta, &fwcf_crs]);

    let mut children: Vec<&dyn Aml> = Vec::new();
    if cfg.fw_cfg {
        children.push(&fwcf);
    }
    if cfg.com1 {
        children.push(&com1);
    }
    if cfg.i8042 {
        children.push(&kbd);
    }
    if cfg.pci_ecam.is_some() {
        children.push(&pci);
        if let Some(h) = &hotplug {
            children.push(&h.sb);
        }
    }
    to_bytes(&Scope::new(Path::new("\\_SB_"), children))
}

/// AML already serialised, to put beside other objects.
struct RawAml(Vec<u8>);

impl Aml for RawAml {
    fn to_aml_bytes(&self, sink: &mut dyn AmlSink) {
        sink.vec(&self.0);
    }
}

/// ACPI PCI hotplug, the scheme of QEMU's PIIX4 (what Linux's `acpiphp` drives), signalled
/// through a Generic Event Device as Cloud Hypervisor does:
///
/// - in `PCI0`: the controller's registers ([`pci_hotplug`]) as fields `PCIU`, `PCID`, `B0EJ`,
///   `GEVT`; a device `Sxx` per slot 1-31 with `_ADR`, `_SUN` and `_EJ0` (writes the slot's bit
///   to `B0EJ`, so the VMM detaches it); `PCNT`, which notifies each slot in `PCIU` with Device
///   Check (1: Linux scans it) and each slot in `PCID` with Eject Request (3: Linux releases the
///   device and calls `_EJ0`);
/// - in `\_SB`: `GED_` (`ACPI0013`, edge interrupt [`GED_GSI`]), whose `_EVT` reads `GEVT` and
///   calls `PCNT` or notifies the power button; `PWRB` (`PNP0C0C`), the power button Linux's
///   `button` driver binds (0x80: pressed).
pub(crate) struct HotplugAml {
    pci0: RawAml,
    sb: RawAml,
}

impl HotplugAml {
    fn new() -> Self {
        let mut pci0 = Vec::new();
        let base = u32::from(ports::PCI_HOTPLUG);
        let len = pci_hotplug::LEN as u32;
        OpRegion::new(Path::new("PCST"), OpRegionSpace::SystemIO, &base, &len)
            .to_aml_bytes(&mut pci0);
        let field = |name: &[u8; 4]| FieldEntry::Named(*name, 32);
        Field::new(
            Path::new("PCST"),
            FieldAccessType::DWord,
            FieldLockRule::NoLock,
            FieldUpdateRule::WriteAsZeroes,
            vec![
                field(b"PCIU"),
                field(b"PCID"),
                field(b"B0EJ"),
                field(b"GEVT"),
            ],
        )
        .to_aml_bytes(&mut pci0);
        let b0ej = Path::new("B0EJ");
        let eject_bit = ShiftLeft::new(&b0ej, &ONE, &acpi_tables::aml::Arg(0));
        Method::new(Path::new("PCEJ"), 1, true, vec![&eject_bit]).to_aml_bytes(&mut pci0);
        let (up, down) = (Local(0), Local(1));
        let (pciu, pcid) = (Path::new("PCIU"), Path::new("PCID"));
        let read_up = Store::new(&up, &pciu);
        let read_down = Store::new(&down, &pcid);
        let mut notifies = Vec::new();
        for slot in 1..PCI_SLOTS {
            let name = slot_name(slot);
            let adr = Name::new(Path::new("_ADR"), &(u32::from(slot) << 16));
            let sun = Name::new(Path::new("_SUN"), &slot);
            let call = MethodCall::new(Path::new("PCEJ"), vec![&slot]);
            let ej0 = Method::new(Path::new("_EJ0"), 1, false, vec![&call]);
            Device::new(Path::new(&name), vec![&adr, &sun, &ej0]).to_aml_bytes(&mut pci0);
            let bit = 1u32 << slot;
            let path = Path::new(&name);
            let (check, eject) = (1u8, 3u8);
            let in_up = And::new(&ZERO, &up, &bit);
            let notify_up = Notify::new(&path, &check);
            If::new(&in_up, vec![&notify_up]).to_aml_bytes(&mut notifies);
            let in_down = And::new(&ZERO, &down, &bit);
            let notify_down = Notify::new(&path, &eject);
            If::new(&in_down, vec![&notify_down]).to_aml_bytes(&mut notifies);
        }
        let notifies = RawAml(notifies);
        Method::new(
            Path::new("PCNT"),
            0,
            true,
            vec![&read_up, &read_down, &notifies],
        )
        .to_aml_bytes(&mut pci0);

        let mut sb = Vec::new();
        let hid = Name::new(Path::new("_HID"), &"ACPI0013");
        let uid = Name::new(Path::new("_UID"), &ZERO);
        let irq = Interrupt::new(true, true, false, false, GED_GSI);
        let crs = Name::new(Path::new("_CRS"), &ResourceTemplate::new(vec![&irq]));
        let events = Local(0);
        let gevt = Path::new("\\_SB_.PCI0.GEVT");
        let read_events = Store::new(&events, &gevt);
        let pci_bit = pci_hotplug::EVENT_PCI;
        let is_pci = And::new(&ZERO, &events, &pci_bit);
        let scan = MethodCall::new(Path::new("\\_SB_.PCI0.PCNT"), vec![]);
        let on_pci = If::new(&is_pci, vec![&scan]);
        let button_bit = pci_hotplug::EVENT_POWER_BUTTON;
        let is_button = And::new(&ZERO, &events, &button_bit);
        let pressed = 0x80u8;
        let pwrb = Path::new("\\_SB_.PWRB");
        let press = Notify::new(&pwrb, &pressed);
        let on_button = If::new(&is_button, vec![&press]);
        let evt = Method::new(
            Path::new("_EVT"),
            1,
            true,
            vec![&read_events, &on_pci, &on_button],
        );
        Device::new(Path::new("GED_"), vec![&hid, &uid, &crs, &evt]).to_aml_bytes(&mut sb);
        let pwrb_hid = Name::new(Path::new("_HID"), &EISAName::new("PNP0C0C"));
        Device::new(Path::new("PWRB"), vec![&pwrb_hid, &uid]).to_aml_bytes(&mut sb);
        HotplugAml {
            pci0: RawAml(pci0),
            sb: RawAml(sb),
        }
    }
}

/// The name of slot `slot`'s device in `PCI0`: `S01_`..`S1F_` (AML names are 4 characters).
fn slot_name(slot: u8) -> String {
    format!("S{slot:02X}_")
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

/// The DSDT's sleep-state objects at root scope: `\_S5_` = {SLP_TYPa, SLP_TYPb, 0, 0} when the
/// PM1 blocks exist. S1-S4 are not offered: Lucid cannot suspend (`lucid_devices::AcpiPm`).
fn sleep_states_aml(cfg: &AcpiConfig) -> Vec<u8> {
    if !cfg.pm {
        return Vec::new();
    }
    let zero = 0u8;
    let s5 = Package::new(vec![&SLP_TYP_S5, &SLP_TYP_S5, &zero, &zero]);
    to_bytes(&Name::new(Path::new("_S5_"), &s5))
}

/// MADT Interrupt Source Override (type 2), which acpi_tables 0.2 does not have.
#[repr(C, packed)]
#[derive(Clone, Copy, IntoBytes, Immutable)]
struct InterruptSourceOverride {
    r#type: u8,
    length: u8,
    bus: u8,
    source: u8,
    gsi: u32,
    flags: u16,
}

/// MADT Local APIC NMI (type 4), which acpi_tables 0.2 does not have.
#[repr(C, packed)]
#[derive(Clone, Copy, IntoBytes, Immutable)]
struct LocalApicNmi {
    r#type: u8,
    length: u8,
    processor_uid: u8,
    flags: u16,
    lint: u8,
}

acpi_tables::aml_as_bytes!(InterruptSourceOverride);
acpi_tables::aml_as_bytes!(LocalApicNmi);

/// MPS INTI flags of the IRQ 9 override: active high (01), level-triggered (11).
const INTI_LEVEL_HIGH: u16 = 0x000d;
/// Offsets in the MADT header: checksum, flags.
const SDT_CHECKSUM: usize = 9;
const MADT_FLAGS: usize = 40;

fn madt(cfg: &AcpiConfig) -> Vec<u8> {
    let lapic = LocalInterruptController::Address(LAPIC_START as u32);
    let mut t = MADT::new(OEM_ID, table_id(b"APIC"), OEM_REVISION, lapic);
    for i in 0..cfg.vcpus {
        t.add_structure(ProcessorLocalApic::new(i, i, EnabledStatus::Enabled));
    }
    t.add_structure(IoApic::new(cfg.vcpus, IOAPIC_START as u32, 0));
    // ISA IRQ 0 -> GSI 2 (the PIT on the IOAPIC), IRQ 9 (the SCI) level, active high.
    for (source, gsi, flags) in [(0u8, 2u32, 0u16), (ACPI_SCI_IRQ, 9, INTI_LEVEL_HIGH)] {
        t.add_structure(InterruptSourceOverride {
            r#type: 2,
            length: 10,
            bus: 0,
            source,
            gsi,
            flags,
        });
    }
    // NMI on LINT1 of every processor (UID 0xff).
    t.add_structure(LocalApicNmi {
        r#type: 4,
        length: 6,
        processor_uid: 0xff,
        flags: 0,
        lint: 1,
    });
    let mut bytes = to_bytes(&t);
    // acpi_tables 0.2 has no setter for the MADT flags: set PCAT_COMPAT (dual 8259s present)
    // and fix the checksum by the bytes added.
    bytes[MADT_FLAGS..MADT_FLAGS + 4].copy_from_slice(&MADT_PCAT_COMPAT.to_le_bytes());
    let sum = bytes.iter().fold(0u8, |a, b| a.wrapping_add(*b));
    bytes[SDT_CHECKSUM] = bytes[SDT_CHECKSUM].wrapping_sub(sum);
    bytes
}

/// DMAR flag: the platform supports interrupt remapping.
pub const DMAR_INTR_REMAP: u8 = 1 << 0;
/// DRHD flag: the unit covers every PCI function of its segment not claimed by another DRHD.
pub const DRHD_INCLUDE_PCI_ALL: u8 = 1 << 0;
/// DMAR host address width field: the width minus one (48-bit guest addresses).
pub const DMAR_HAW: u8 = 48 - 1;
/// Device scope type of an I/O APIC.
pub const SCOPE_IOAPIC: u8 = 3;
/// The I/O APIC's requester ID in the device scope: bus 0xff, device 0, function 0, the
/// pseudo-bus QEMU's q35 uses for platform devices (so a guest sees the same source ID on both
/// VMMs, and it can never collide with a function on Lucid's PCI bus 0). Linux takes it as the
/// source ID it programs into the I/O APIC's remapping entries.
pub const IOAPIC_SCOPE_BUS: u8 = 0xff;
pub const IOAPIC_SCOPE_DEVFN: u8 = 0x00;

/// The DMAR table (Intel VT-d spec chapter 8, revision 1): host address width, flags, then one
/// DRHD (type 0) whose device scope names the I/O APIC (its MADT ID, `cfg.vcpus`). Linux's
/// interrupt remapping refuses to start unless every I/O APIC of the MADT appears in some DRHD's
/// scope.
pub fn dmar(cfg: &AcpiConfig, unit: &DmarUnit) -> Vec<u8> {
    let pages = unit.pages.clamp(1, 1 << 15).next_power_of_two();
    // Device scope: type, length, flags, reserved, enumeration ID, start bus, path (dev, fn).
    let scope = [
        SCOPE_IOAPIC,
        8,
        0,
        0,
        cfg.vcpus,
        IOAPIC_SCOPE_BUS,
        IOAPIC_SCOPE_DEVFN >> 3,
        IOAPIC_SCOPE_DEVFN & 7,
    ];
    let drhd_len = 16 + scope.len() as u16;
    let mut drhd = Vec::with_capacity(drhd_len as usize);
    drhd.extend_from_slice(&0u16.to_le_bytes()); // type 0: DRHD
    drhd.extend_from_slice(&drhd_len.to_le_bytes());
    drhd.push(DRHD_INCLUDE_PCI_ALL);
    // "Size": bits 3:0 = N, the register set is 2^N 4 KiB pages (VT-d spec 2.5 on; Linux reads
    // it to size its mapping).
    drhd.push(pages.trailing_zeros() as u8);
    drhd.extend_from_slice(&0u16.to_le_bytes()); // segment 0
    drhd.extend_from_slice(&unit.base.to_le_bytes());
    drhd.extend_from_slice(&scope);

    let mut t = Sdt::new(*b"DMAR", 48, 1, OEM_ID, table_id(b"DMAR"), OEM_REVISION);
    t.write_u8(36, DMAR_HAW);
    t.write_u8(37, DMAR_INTR_REMAP);
    t.append_slice(&drhd);
    t.as_slice().to_vec()
}

/// The FACS (version 2): no hardware signature, waking vector 0 (Lucid does not resume).
fn facs() -> Vec<u8> {
    let mut f = FACS::new();
    f.version = 2;
    to_bytes(&f)
}

/// An I/O-port register block for the FADT's extended (GAS) fields.
fn io_gas(port: u16, len: u8, access: AccessSize) -> GAS {
    GAS::new(GasSpace::SystemIo, len * 8, 0, access, u64::from(port))
}

fn fadt(cfg: &AcpiConfig, dsdt: u64, facs: Option<u64>) -> Vec<u8> {
    let mut f = FADTBuilder::new(OEM_ID, table_id(b"FACP"), OEM_REVISION)
        .dsdt_64(dsdt)
        .flag(Flags::PwrButton)
        .flag(Flags::SlpButton);
    let mut iapc = IAPC_VGA_NOT_PRESENT | IAPC_PCIE_ASPM_CONTROLS;
    if cfg.i8042 {
        iapc |= IAPC_8042;
    }
    f.iapc_boot_arch = iapc.into();
    f.sci_int = u16::from(ACPI_SCI_IRQ).into();
    f.hypervisor_vendor_identity = u64::from_le_bytes(*b"LUCIDVMM").into();
    match facs {
        Some(facs) => {
            // Below 4 GiB always: the 32-bit field, which every OS reads.
            f = f
                .firmware_ctrl_32(facs as u32)
                .flag(Flags::Wbinvd)
                .flag(Flags::ProcC1)
                .flag(Flags::FixRtc)
                .flag(Flags::TmrValExt);
            const PM1_EVT_LEN: u8 = 4;
            const PM1_CNT_LEN: u8 = 2;
            const PM_TMR_LEN: u8 = 4;
            f.pm1a_evt_blk = u32::from(ports::ACPI_PM1A_EVT).into();
            f.pm1a_cnt_blk = u32::from(ports::ACPI_PM1A_CNT).into();
            f.pm_tmr_blk = u32::from(ports::ACPI_PM_TMR).into();
            f.pm1_evt_len = PM1_EVT_LEN;
            f.pm1_cnt_len = PM1_CNT_LEN;
            f.pm_tmr_len = PM_TMR_LEN;
            f.x_pm1a_evt_blk = io_gas(ports::ACPI_PM1A_EVT, PM1_EVT_LEN, AccessSize::WordAccess);
            f.x_pm1a_cnt_blk = io_gas(ports::ACPI_PM1A_CNT, PM1_CNT_LEN, AccessSize::WordAccess);
            f.x_pm_tmr_blk = io_gas(ports::ACPI_PM_TMR, PM_TMR_LEN, AccessSize::DwordAccess);
            // Latencies above 100 / 1000 us: C2 and C3 are not supported.
            f.p_lvl2_lat = 0x0fffu16.into();
            f.p_lvl3_lat = 0xffffu16.into();
            f.century = CMOS_CENTURY;
        }
        None => f = f.flag(Flags::HwReducedAcpi),
    }
    to_bytes(&f.finalize())
}

/// Length of the ACPI 2.0 RSDP.
const RSDP_LEN: u64 = 36;

/// Where [`write_acpi`] put the tables.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct AcpiPlacement {
    pub rsdp: u64,
    pub tables: Range<u64>,
}

impl AcpiPlacement {
    /// The tables' range when it lies outside the BIOS area (which the memory map always
    /// reserves): the memory map must reserve it too.
    pub fn outside_bios_area(&self) -> Option<Range<u64>> {
        (self.tables.end <= EBDA_START || self.tables.start >= ACPI_END)
            .then(|| self.tables.clone())
    }
}

/// Lays the tables out from `base` (FACS first, 64-byte aligned; the rest 16-byte aligned).
/// Returns each table's address and bytes, the XSDT's address, and the end of the last table.
fn build_tables(cfg: &AcpiConfig, base: u64) -> (Vec<(u64, Vec<u8>)>, u64, u64) {
    let mut cursor = base;
    let mut tables: Vec<(u64, Vec<u8>)> = Vec::new();
    let mut place = |bytes: Vec<u8>, tables: &mut Vec<(u64, Vec<u8>)>| {
        let addr = cursor;
        cursor = (cursor + bytes.len() as u64).next_multiple_of(16);
        tables.push((addr, bytes));
        addr
    };
    // The FACS first: `base` is 64-byte aligned, as the FACS must be.
    let facs_addr = cfg.pm.then(|| place(facs(), &mut tables));
    let mut dsdt = Sdt::new(*b"DSDT", 36, 2, OEM_ID, table_id(b"DSDT"), OEM_REVISION);
    dsdt.append_slice(&dsdt_aml(cfg));
    dsdt.append_slice(&sleep_states_aml(cfg));
    let dsdt_addr = place(dsdt.as_slice().to_vec(), &mut tables);
    let fadt_addr = place(fadt(cfg, dsdt_addr, facs_addr), &mut tables);
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
    if let Some(unit) = &cfg.dmar {
        let a = place(dmar(cfg, unit), &mut tables);
        xsdt.add_entry(a);
    }
    let xsdt_addr = place(to_bytes(&xsdt), &mut tables);
    (tables, xsdt_addr, cursor)
}

/// Places and writes the ACPI tables for `cfg`: the RSDP in the BIOS area (where a legacy scan
/// finds it), the tables after it if they fit there, else in free low RAM.
pub(crate) fn write_acpi(
    mem: &GuestMemoryMmap,
    area: &mut BootArea,
    cfg: &AcpiConfig,
) -> Result<AcpiPlacement, BootError> {
    if cfg.vcpus == 0 || cfg.vcpus == u8::MAX {
        return Err(BootError::BadVcpuCount(cfg.vcpus));
    }
    let bios_area = ACPI_START..ACPI_END;
    let rsdp = area.place_in("ACPI RSDP", ACPI_START, RSDP_LEN, 16, bios_area.clone())?;
    let size = build_tables(cfg, 0).2;
    let what = "ACPI tables";
    let pref = ACPI_START + 0x40;
    let base = match area.place_in(what, pref, size, 64, bios_area) {
        Ok(base) => base,
        Err(_) => area.place(what, pref, size, 64)?,
    };
    let (tables, xsdt_addr, end) = build_tables(cfg, base);
    for (addr, bytes) in &tables {
        write_bytes(mem, *addr, bytes, "ACPI table")?;
    }
    write_bytes(
        mem,
        rsdp,
        &to_bytes(&Rsdp::new(OEM_ID, xsdt_addr)),
        "ACPI RSDP",
    )?;
    Ok(AcpiPlacement {
        rsdp,
        tables: base..end,
    })
}

/// Writes the ACPI tables for `cfg` at their usual place ([`ACPI_START`]), with no kernel to
/// avoid, and returns the RSDP's address. [`crate::load`] writes them itself when
/// [`crate::BootParams::acpi`] is set, around the kernel.
pub fn write_acpi_tables(mem: &GuestMemoryMmap, cfg: &AcpiConfig) -> Result<u64, BootError> {
    let mut area = BootArea::new(crate::layout::MMIO_HOLE_START);
    Ok(write_acpi(mem, &mut area, cfg)?.rsdp)
}
