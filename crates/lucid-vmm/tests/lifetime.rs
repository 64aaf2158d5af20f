//! A VM's lifetime on real KVM: dropping a running VM leaves no thread of it behind. Alone in its
//! test binary, so that the threads counted are this test's only.

use std::time::Duration;

use lucid_virtio::net::{NetBackend, NetConfig};
use lucid_vmm::{KernelSource, PciDeviceConfig, PciDeviceKind, SerialOutput, Vm, VmConfig};

/// Names of this process's threads that start with `prefix`.
fn threads(prefix: &str) -> Vec<String> {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .map(|c| c.trim().to_string())
        .filter(|c| c.starts_with(prefix))
        .collect()
}

#[test]
fn dropping_a_running_vm_joins_vcpus_and_device_back_ends() {
    let mut c = VmConfig::new(KernelSource::Builtin {
        name: "virtio-net".into(),
        bytes: lucid_guests::get("virtio-net").expect("built-in guest"),
    });
    // Far more round trips than the test waits for: the guest is mid-run when the VM drops.
    c.payload.cmdline = "op=rr size=64 count=100000000".into();
    c.devices.serial = SerialOutput::File(
        std::env::temp_dir().join(format!("lucid-lifetime-{}.txt", std::process::id())),
    );
    c.devices
        .pci
        .push(PciDeviceConfig::new(PciDeviceKind::Net(NetConfig {
            backend: NetBackend::Echo,
            mac: [0x52, 0x54, 0, 0x12, 0x34, 0x56],
        })));
    let mut vm = Vm::build(c).unwrap();
    vm.start().unwrap();
    // Wait (up to a minute) until the guest's driver has started the device's back-end thread.
    let stats = vm.stats().clone();
    let requests = || stats.snapshot().get("net0.requests").copied().unwrap_or(0);
    for _ in 0..600 {
        if requests() > 100 {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(requests() > 100, "the guest is exchanging frames");
    assert_eq!(threads("lucid-vcpu"), ["lucid-vcpu0"]);
    assert_eq!(threads("lucid-net0"), ["lucid-net0-io"]);
    drop(vm);
    assert_eq!(threads("lucid-vcpu"), Vec::<String>::new());
    assert_eq!(threads("lucid-net0"), Vec::<String>::new());
}
