//! The vIOMMU's wiring in a whole VM on real KVM (`VmConfig`'s `iommu`): the DMAR table as the guest
//! finds it in its memory, the register window trapping (samecore) or shared (sidecore: page 0
//! without exits, page 1 trapping), the sidecore thread's lifetime, the REPORT hypercall and the
//! `--iommu` option. These check the wiring; the VT-d model's semantics have their own tests in
//! crates/lucid-iommu.

use std::path::PathBuf;
use std::sync::Mutex;

use lucid_mem::vm_memory::{Bytes, GuestAddress};
use lucid_pci::Rung;
use lucid_virtio::blk::BlockConfig;
use lucid_vmm::hypercall;
use lucid_vmm::lucid_hv::kvm_bindings::kvm_regs;
use lucid_vmm::lucid_iommu::{EmulationMode, PinPolicy, VtdConfig, VTD_BASE};
use lucid_vmm::{
    parse_iommu, DeviceOptionError, KernelSource, PciDeviceConfig, PciDeviceKind, SerialOutput,
    StopReason, Vm, VmConfig,
};

/// Tests that start a sidecore thread or look for one run one at a time: the thread check reads
/// the whole process's thread names.
static SIDECORE: Mutex<()> = Mutex::new(());

fn tmp(tag: &str) -> PathBuf {
    std::env::temp_dir().join(format!("lucid-vtd-{}-{tag}", std::process::id()))
}

fn config(guest: &str, cmdline: &str, tag: &str, mode: Option<EmulationMode>) -> VmConfig {
    let mut c = VmConfig::new(KernelSource::Builtin {
        name: guest.into(),
        bytes: lucid_guests::get(guest).expect("built-in guest"),
    });
    c.payload.cmdline = cmdline.into();
    c.devices.serial = SerialOutput::File(tmp(&format!("{tag}.txt")));
    c.iommu = mode.map(|mode| VtdConfig {
        mode,
        pin: PinPolicy::All,
    });
    c
}

/// `mmio-ping` reads `count` times at `addr`; returns the MMIO read exits of vCPU 0.
fn mmio_reads(mode: EmulationMode, addr: u64, count: u64) -> u64 {
    let tag = format!("ping-{addr:x}-{mode:?}");
    let c = config(
        "mmio-ping",
        &format!("count={count} addr={addr:#x} op=read"),
        &tag,
        Some(mode),
    );
    let report = Vm::run(c).unwrap();
    let out = std::fs::read_to_string(tmp(&format!("{tag}.txt"))).unwrap_or_default();
    let _ = std::fs::remove_file(tmp(&format!("{tag}.txt")));
    assert_eq!(report.stop, StopReason::DebugExit(0), "{out}");
    assert!(out.contains(&format!("count={count}")), "{out}");
    report.counters["vcpu0.exit.mmio_read"]
}

fn r32(mem: &lucid_mem::GuestMemoryMmap, a: u64) -> u32 {
    mem.read_obj(GuestAddress(a)).unwrap()
}

fn r64(mem: &lucid_mem::GuestMemoryMmap, a: u64) -> u64 {
    mem.read_obj(GuestAddress(a)).unwrap()
}

/// Every table the XSDT lists, found as a guest would: the RSDP by a scan of the BIOS area.
fn acpi_tables(vm: &Vm) -> Vec<Vec<u8>> {
    let mem = vm.ram().memory();
    let rsdp = (0xe0000u64..0x100000)
        .step_by(16)
        .find(|&a| r64(mem, a) == u64::from_le_bytes(*b"RSD PTR "))
        .expect("an RSDP in the BIOS area");
    let xsdt = r64(mem, rsdp + 24);
    let n = (r32(mem, xsdt + 4) as u64 - 36) / 8;
    (0..n)
        .map(|i| {
            let t = r64(mem, xsdt + 36 + 8 * i);
            let mut b = vec![0u8; r32(mem, t + 4) as usize];
            mem.read_slice(&mut b, GuestAddress(t)).unwrap();
            assert_eq!(b.iter().fold(0u8, |a, x| a.wrapping_add(*x)), 0, "checksum");
            b
        })
        .collect()
}

#[test]
fn the_guest_finds_a_dmar_table_only_with_an_iommu() {
    let vm = Vm::build(config("hello", "", "dmar", Some(EmulationMode::Samecore))).unwrap();
    let tables = acpi_tables(&vm);
    let dmar = tables
        .iter()
        .find(|t| &t[..4] == b"DMAR")
        .expect("a DMAR table");
    assert_eq!(dmar[8], 1, "revision");
    assert_eq!((dmar[36], dmar[37]), (47, 1), "HAW 48 bits, INTR_REMAP");
    // One DRHD: INCLUDE_PCI_ALL, 2 pages, segment 0, at VTD_BASE, with the I/O APIC in scope.
    let drhd = &dmar[48..];
    assert_eq!(u16::from_le_bytes([drhd[0], drhd[1]]), 0);
    let len = u16::from_le_bytes([drhd[2], drhd[3]]) as usize;
    assert_eq!(48 + len, dmar.len());
    assert_eq!((drhd[4], drhd[5]), (1, 1));
    assert_eq!(u16::from_le_bytes([drhd[6], drhd[7]]), 0);
    assert_eq!(
        u64::from_le_bytes(drhd[8..16].try_into().unwrap()),
        VTD_BASE
    );
    let scope = &drhd[16..len];
    assert_eq!(
        (scope[0], scope[1]),
        (3, 8),
        "an I/O APIC scope with one path entry"
    );
    // Its enumeration ID is the MADT's I/O APIC ID (one vCPU: ID 1).
    let madt = tables.iter().find(|t| &t[..4] == b"APIC").unwrap();
    let mut off = 44;
    let mut ioapic = None;
    while off + 2 <= madt.len() && madt[off + 1] > 0 {
        if madt[off] == 1 {
            ioapic = Some(madt[off + 2]);
        }
        off += madt[off + 1] as usize;
    }
    assert_eq!(ioapic, Some(scope[4]));
    // The router exists without PCI devices: MSIs of the unit's clients are remapped through it.
    assert!(vm.gsi_router().is_some() && !vm.devices().has_pci() && vm.iommu().is_some());
    drop(vm);

    let vm = Vm::build(config("hello", "", "nodmar", None)).unwrap();
    assert!(acpi_tables(&vm).iter().all(|t| &t[..4] != b"DMAR"));
    assert!(vm.gsi_router().is_none() && vm.iommu().is_none());
}

/// Samecore: every register access is an MMIO exit, on both pages.
#[test]
fn samecore_traps_every_register_access() {
    assert_eq!(mmio_reads(EmulationMode::Samecore, VTD_BASE, 200), 200);
    assert_eq!(mmio_reads(EmulationMode::Samecore, VTD_BASE + 8, 50), 50);
    assert_eq!(
        mmio_reads(EmulationMode::Samecore, VTD_BASE + 0x1000, 50),
        50
    );
}

/// Sidecore: page 0 is memory (no exits), page 1 still traps.
#[test]
fn sidecore_page_zero_is_memory_and_page_one_traps() {
    let _one = SIDECORE.lock().unwrap_or_else(|e| e.into_inner());
    assert_eq!(mmio_reads(EmulationMode::Sidecore, VTD_BASE, 200), 0);
    assert_eq!(mmio_reads(EmulationMode::Sidecore, VTD_BASE + 0x10, 200), 0);
    assert_eq!(
        mmio_reads(EmulationMode::Sidecore, VTD_BASE + 0x1000, 50),
        50
    );
}

fn sidecore_threads() -> usize {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .filter(|comm| comm.trim() == "lucid-vtd-sc")
        .count()
}

/// The number of `lucid-vtd-sc` threads once it is `want` (or after 30 s): a thread names
/// itself once it runs, and one joined can linger in /proc/self/task until the kernel reaps it.
fn sidecore_threads_settle(want: usize) -> usize {
    let end = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let n = sidecore_threads();
        if n == want || std::time::Instant::now() > end {
            return n;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

#[test]
fn the_sidecore_thread_lives_as_long_as_the_vm() {
    let _one = SIDECORE.lock().unwrap_or_else(|e| e.into_inner());
    assert_eq!(sidecore_threads_settle(0), 0);
    let mut vm = Vm::build(config("spin", "", "sc-life", Some(EmulationMode::Sidecore))).unwrap();
    vm.start().unwrap();
    assert_eq!(sidecore_threads_settle(1), 1);
    // Exactly one, and it stays while the VM runs.
    std::thread::sleep(std::time::Duration::from_millis(50));
    assert_eq!(sidecore_threads(), 1);
    drop(vm);
    assert_eq!(sidecore_threads_settle(0), 0);
    // Samecore has none.
    let vm = Vm::build(config(
        "hello",
        "",
        "sc-none",
        Some(EmulationMode::Samecore),
    ))
    .unwrap();
    assert_eq!(sidecore_threads(), 0);
    drop(vm);
    let _ = std::fs::remove_file(tmp("sc-life.txt"));
}

/// A VM with both PCI devices and the unit: one router, shared by the bus and the remapper.
#[test]
fn pci_devices_and_the_iommu_share_the_router() {
    let img = tmp("disk.img");
    std::fs::File::create(&img)
        .unwrap()
        .set_len(1 << 20)
        .unwrap();
    let mut c = config("hello", "", "pci", Some(EmulationMode::Samecore));
    let mut d = PciDeviceConfig::new(PciDeviceKind::Block(BlockConfig {
        path: img.clone(),
        read_only: false,
        logical_block_size: 512,
        id: "vtd".into(),
        direct: false,
    }));
    d.rung = Rung::L1;
    c.devices.pci.push(d);
    let vm = Vm::build(c).unwrap();
    assert!(std::sync::Arc::ptr_eq(
        vm.devices().pci_router().unwrap(),
        vm.gsi_router().unwrap()
    ));
    drop(vm);
    let _ = std::fs::remove_file(img);
}

/// Hypercall 3 (REPORT) sets `iommu.guest.<key>`; an unknown key is refused.
#[test]
fn report_hypercall_sets_guest_counters() {
    let vm = Vm::build(config("hello", "", "report", None)).unwrap();
    let call = |key: u64, value: u64| {
        let regs = kvm_regs {
            rax: hypercall::REPORT,
            rdi: key,
            rsi: value,
            ..Default::default()
        };
        vm.hooks().hypercall(0, &regs)
    };
    assert_eq!(call(hypercall::REPORT_STALE_MAX, 7), Some(0));
    assert_eq!(call(hypercall::REPORT_STALE_MAX, 5), Some(0));
    assert_eq!(call(hypercall::REPORT_FAULTS_SEEN, 2), Some(0));
    assert_eq!(call(8, 1), Some(u64::MAX));
    assert_eq!(call(u64::MAX, 1), Some(u64::MAX));
    let s = vm.stats().snapshot();
    assert_eq!(s["iommu.guest.stale_max"], 5, "set, not added");
    assert_eq!(s["iommu.guest.faults_seen"], 2);
    for k in 0..8 {
        assert!(hypercall::report_key(k).is_some());
    }
}

#[test]
fn iommu_option_errors_name_the_problem() {
    let e = parse_iommu("amd").unwrap_err();
    assert!(matches!(e, DeviceOptionError::BadHead { .. }), "{e}");
    let e = parse_iommu("vtd,mode=fast").unwrap_err();
    assert_eq!(
        e.to_string(),
        "--iommu mode=fast: expected samecore or sidecore"
    );
    let e = parse_iommu("vtd,pin=some").unwrap_err();
    assert_eq!(
        e.to_string(),
        "--iommu pin=some: expected all, map or deferred"
    );
    let e = parse_iommu("vtd,cache=on").unwrap_err();
    assert!(e.to_string().contains("unknown option \"cache\""), "{e}");
    let e = parse_iommu("vtd,sidecore").unwrap_err();
    assert!(matches!(e, DeviceOptionError::NotKeyValue { .. }), "{e}");
    let c = parse_iommu("vtd,mode=sidecore,pin=map").unwrap();
    assert_eq!((c.mode, c.pin), (EmulationMode::Sidecore, PinPolicy::Map));
}
