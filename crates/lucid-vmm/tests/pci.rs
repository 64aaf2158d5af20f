//! PCI and the virtio-pci transport in a whole VM on real KVM: the bus seen from the host side
//! through the VM's own exit hooks (as a guest's `in`/`out` would reach them), and the probe
//! kit's `pci-scan` and `virtio-blk` guests on the exit-ladder rungs, with exit counts.

use std::path::PathBuf;

use lucid_pci::Rung;
use lucid_virtio::blk::BlockConfig;
use lucid_virtio::net::{NetBackend, NetConfig};
use lucid_vmm::{
    KernelSource, PciDeviceConfig, PciDeviceKind, SerialOutput, StopReason, Vm, VmConfig,
};

fn disk(tag: &str, size: u64) -> PathBuf {
    let p = std::env::temp_dir().join(format!("lucid-pci-{}-{tag}.img", std::process::id()));
    let f = std::fs::File::create(&p).unwrap();
    f.set_len(size).unwrap();
    p
}

fn blk(path: PathBuf, rung: Rung) -> PciDeviceConfig {
    let mut d = PciDeviceConfig::new(PciDeviceKind::Block(BlockConfig {
        path,
        read_only: false,
        logical_block_size: 512,
        id: "lucid-test".into(),
        direct: false,
    }));
    d.rung = rung;
    d
}

fn config(guest: &str, cmdline: &str, tag: &str) -> (VmConfig, PathBuf) {
    let mut c = VmConfig::new(KernelSource::Builtin {
        name: guest.into(),
        bytes: lucid_guests::get(guest).expect("built-in guest"),
    });
    c.payload.cmdline = cmdline.into();
    let out = std::env::temp_dir().join(format!("lucid-pci-{}-{tag}.txt", std::process::id()));
    c.devices.serial = SerialOutput::File(out.clone());
    (c, out)
}

fn cf8(vm: &Vm, slot: u8, reg: u32) -> u32 {
    let a = 0x8000_0000u32 | (slot as u32) << 11 | reg;
    assert!(vm.hooks().pio.write(0xcf8, &a.to_le_bytes()));
    let mut d = [0u8; 4];
    assert!(vm.hooks().pio.read(0xcfc, &mut d));
    u32::from_le_bytes(d)
}

#[test]
fn the_bus_enumerates_through_the_vms_port_hooks() {
    let (mut c, _) = config("hello", "", "enum");
    let img = disk("enum", 1 << 20);
    c.devices.pci.push(blk(img.clone(), Rung::L1));
    let mut net = PciDeviceConfig::new(PciDeviceKind::Net(NetConfig {
        backend: NetBackend::Echo,
        mac: [0x52, 0x54, 0, 0x12, 0x34, 0x56],
    }));
    net.rung = Rung::L0;
    c.devices.pci.push(net);
    let vm = Vm::build(c).unwrap();
    assert_eq!(cf8(&vm, 0, 0), 0x0008_1b36, "host bridge");
    assert_eq!(cf8(&vm, 1, 0), 0x1042_1af4, "virtio-blk");
    assert_eq!(cf8(&vm, 2, 0), 0x1041_1af4, "virtio-net");
    assert_eq!(cf8(&vm, 3, 0), u32::MAX);
    // ECAM gives the same, on the MMIO hooks.
    let mut d = [0u8; 4];
    assert!(vm
        .hooks()
        .mmio
        .read(lucid_boot::layout::PCI_ECAM_START + (2 << 15), &mut d));
    assert_eq!(u32::from_le_bytes(d), 0x1041_1af4);
    // BARs are assigned in the window, memory decoding is on.
    let bar4 = cf8(&vm, 1, 0x20) as u64 & !0xf | (cf8(&vm, 1, 0x24) as u64) << 32;
    assert!((lucid_boot::layout::PCI_MMIO_START..lucid_boot::layout::PCI_MMIO_END).contains(&bar4));
    assert_ne!(cf8(&vm, 1, 4) & 2, 0);
    let pci = vm.devices().pci_devices();
    assert_eq!(pci.len(), 2);
    assert_eq!(pci[1].name, "net0");
    assert_eq!((pci[0].slot.slot, pci[1].slot.slot), (1, 2));
    let _ = std::fs::remove_file(img);
}

/// Hotplug's two halves: a function detached from its slot is reset and stops decoding, and
/// the slot (with its INTx line) is the next one attached.
#[test]
fn a_detached_slot_is_free_for_the_next_attach() {
    let (mut c, _) = config("hello", "", "detach");
    let img = disk("detach", 1 << 20);
    c.devices.pci.push(blk(img.clone(), Rung::L1));
    c.devices
        .platform_pci
        .push(lucid_vmm::PlatformPciDevice::Edu);
    let vm = Vm::build(c).unwrap();
    assert_eq!(cf8(&vm, 1, 0), 0x1042_1af4, "virtio-blk");
    assert_eq!(cf8(&vm, 2, 0), 0x11e8_1234, "edu");
    let bar4 = cf8(&vm, 1, 0x20) as u64 & !0xf | (cf8(&vm, 1, 0x24) as u64) << 32;
    let mut d = [0u8; 4];
    assert!(vm.hooks().mmio.read(bar4, &mut d), "the BAR decodes");
    let devices = vm.devices();
    let gone = devices.detach("blk0").unwrap();
    assert_eq!(gone.slot.slot, 1);
    assert_eq!(cf8(&vm, 1, 0), u32::MAX, "slot 1 is empty");
    assert!(
        !vm.hooks().mmio.read(bar4, &mut d),
        "its BAR no longer decodes"
    );
    assert!(matches!(gone.function, lucid_vmm::PciFunction::Virtio(_)));
    assert_eq!(vm.stats().snapshot()["blk0.virtio.resets"], 1, "reset");
    drop(gone);
    assert!(devices.detach("blk0").is_err());
    // The next attach takes slot 1 again, with its INTx line, and decodes.
    let again = devices
        .attach("edu1", |_| Ok(lucid_vmm::NewPciFunction::Edu))
        .unwrap();
    assert_eq!(again.slot.slot, 1);
    assert_eq!(again.slot.intx_gsi, lucid_boot::layout::pci_intx_gsi(1, 0));
    assert_eq!(cf8(&vm, 1, 0), 0x11e8_1234, "edu in slot 1");
    assert_eq!(
        cf8(&vm, 1, 0x3c) & 0xff,
        again.slot.intx_gsi,
        "its interrupt line"
    );
    let names: Vec<_> = devices.pci_devices().into_iter().map(|a| a.name).collect();
    assert_eq!(names, ["edu", "edu1"]);
    // And off and on once more: the BAR space it had is reused.
    devices.detach("edu1").unwrap();
    let third = devices
        .attach("edu1", |_| Ok(lucid_vmm::NewPciFunction::Edu))
        .unwrap();
    assert_eq!(third.slot.slot, 1);
    drop(vm);
    let _ = std::fs::remove_file(img);
}

#[test]
fn no_devices_no_bus() {
    let (c, _) = config("hello", "", "nobus");
    let vm = Vm::build(c).unwrap();
    assert!(!vm.devices().has_pci());
    let mut d = [0u8; 4];
    assert!(!vm.hooks().pio.read(0xcfc, &mut d));
}

#[test]
fn pci_scan_guest_sees_the_devices() {
    let (mut c, out) = config("pci-scan", "", "scan");
    let img = disk("scan", 1 << 20);
    c.devices.pci.push(blk(img.clone(), Rung::L1));
    let report = Vm::run(c).unwrap();
    let text = std::fs::read_to_string(&out).unwrap();
    assert_eq!(report.stop, StopReason::DebugExit(0), "{text}");
    assert!(text.contains("1af4:1042"), "{text}");
    assert!(text.contains("pci-scan: 2 functions"), "{text}");
    let _ = std::fs::remove_file(img);
    let _ = std::fs::remove_file(out);
}

/// The virtio-blk guest writes, reads back and verifies on `rung`; returns the counters.
fn blk_run(rung: Rung, tag: &str) -> std::collections::BTreeMap<String, u64> {
    let (mut c, out) = config(
        "virtio-blk",
        "op=rw count=200 verify=1 prefill=1 span=1048576",
        tag,
    );
    let img = disk(tag, 16 << 20);
    c.devices.pci.push(blk(img.clone(), rung));
    let report = Vm::run(c).unwrap();
    let text = std::fs::read_to_string(&out).unwrap();
    assert_eq!(report.stop, StopReason::DebugExit(0), "{rung:?}: {text}");
    assert!(text.contains("mismatches=0"), "{text}");
    let _ = std::fs::remove_file(img);
    let _ = std::fs::remove_file(out);
    report.counters
}

#[test]
fn virtio_blk_guest_on_l0_kicks_by_exit_and_signals_msi() {
    let c = blk_run(Rung::L0, "l0");
    assert!(c["blk0.notify.exit"] >= 200, "{c:?}");
    assert_eq!(c["blk0.notify.ioeventfds_registered"], 0);
    assert_eq!(c["blk0.irq.irqfd"], 0);
    assert_eq!(c["blk0.virtio.activations"], 1);
}

#[test]
fn virtio_blk_guest_on_l1_kicks_never_exit() {
    let c = blk_run(Rung::L1, "l1");
    assert_eq!(c["blk0.notify.exit"], 0, "kicks absorbed by the ioeventfd");
    assert_eq!(c["blk0.notify.ioeventfds_registered"], 1);
    assert_eq!(c["blk0.irq.msi_signal"], 0);
    assert_eq!(c["blk0.virtio.needs_reset"], 0);
}

#[test]
fn virtio_blk_guest_on_l4_polls() {
    let c = blk_run(Rung::L4 { guest_polls: false }, "l4");
    assert_eq!(c["blk0.notify.exit"], 0);
    assert_eq!(c["blk0.rung"], 4);
}

#[test]
fn l3_is_refused_without_posted_interrupts() {
    if lucid_hv::posted_interrupts_available() {
        return;
    }
    let (mut c, _) = config("hello", "", "l3");
    let img = disk("l3", 1 << 20);
    c.devices.pci.push(blk(img.clone(), Rung::L3));
    let e = Vm::build(c).err().expect("refused");
    let text = lucid_vmm::error_chain(&e);
    assert!(text.contains("posted interrupts"), "{text}");
    let _ = std::fs::remove_file(img);
}

/// The hostile driver (broken chains, queue garbage, MSI-X garbage, odd and overlapping BARs)
/// against blk and net on the userspace-exit and the ioeventfd rungs: Lucid survives, the final
/// sane request completes.
#[test]
fn virtio_evil_guest_cannot_break_the_transport() {
    for rung in [Rung::L0, Rung::L1] {
        let (mut c, out) = config("virtio-evil", "", &format!("evil-{rung:?}"));
        let img = disk(&format!("evil-{rung:?}"), 1 << 20);
        c.devices.pci.push(blk(img.clone(), rung));
        let mut net = PciDeviceConfig::new(PciDeviceKind::Net(NetConfig {
            backend: NetBackend::Echo,
            mac: [0x52, 0x54, 0, 0x12, 0x34, 0x56],
        }));
        net.rung = rung;
        c.devices.pci.push(net);
        let report = Vm::run(c).unwrap();
        let text = std::fs::read_to_string(&out).unwrap();
        assert_eq!(report.stop, StopReason::DebugExit(0), "{rung:?}: {text}");
        assert!(text.contains("virtio-evil: survived"), "{text}");
        assert!(text.contains("evil: final: completed"), "{text}");
        assert!(report.counters["pci.bar_refused"] > 0);
        let _ = std::fs::remove_file(img);
        let _ = std::fs::remove_file(out);
    }
}
