//! The per-vCPU handle and the run-time hook registry, on real KVM with the probe kit's guests.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use lucid_hv::kvm_bindings::kvm_regs;
use lucid_vmm::{KernelSource, SerialOutput, StopReason, Vm, VmConfig};

fn config(guest: &str, cmdline: &str) -> VmConfig {
    let mut c = VmConfig::new(KernelSource::Builtin {
        name: guest.into(),
        bytes: lucid_guests::get(guest).expect("built-in guest"),
    });
    c.payload.cmdline = cmdline.into();
    c.devices.serial = SerialOutput::File(
        std::env::temp_dir().join(format!("lucid-handle-{}-{guest}.txt", std::process::id())),
    );
    c
}

/// Waits (up to 60 s) until the serial file `path` has `line`: the guest got that far.
fn wait_serial(path: &std::path::Path, line: &str) {
    let end = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let out = std::fs::read_to_string(path).unwrap_or_default();
        if out.contains(line) {
            return;
        }
        assert!(
            std::time::Instant::now() < end,
            "no `{line}` on serial: {out}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn pause_read_write_registers_and_resume() {
    let mut c = config("spin", "");
    // Its own serial file: other tests here run the spin guest at the same time.
    let serial = std::env::temp_dir().join(format!(
        "lucid-handle-{}-spin-pause.txt",
        std::process::id()
    ));
    c.devices.serial = SerialOutput::File(serial.clone());
    let mut vm = Vm::build(c).unwrap();
    vm.start().unwrap();
    // In its CPL3 loop once it said so (every byte it prints is an exit, at CPL3 too).
    wait_serial(&serial, "spin: looping forever\n");
    let h = vm.vcpus()[0].clone();
    h.pause().unwrap();
    let r1 = h.get_regs().unwrap();
    std::thread::sleep(Duration::from_millis(100));
    let r2 = h.get_regs().unwrap();
    // Paused: the guest does not move.
    assert_eq!(r1.rip, r2.rip);
    assert_eq!(r1.rcx, r2.rcx);
    let sregs = h.get_sregs().unwrap();
    assert_eq!(sregs.cs.dpl, 3, "probe guests run at CPL3");
    // A register written while paused is what the guest sees.
    let mut w = r2;
    w.r15 = 0x1234_5678;
    h.set_regs(w).unwrap();
    assert_eq!(h.get_regs().unwrap().r15, 0x1234_5678);
    h.resume().unwrap();
    std::thread::sleep(Duration::from_millis(100));
    // Code run on the vCPU thread sees the live vCPU.
    let id = h.call(|ctx| ctx.id()).unwrap();
    assert_eq!(id, 0);
    vm.stop(StopReason::Signal(15));
    let report = vm.wait();
    assert_eq!(report.stop, StopReason::Signal(15));
    // After the VM stopped, the handle says so instead of blocking.
    assert!(h.get_regs().is_err());
    let _ = std::fs::remove_file(serial);
}

/// A paused vCPU sleeps until a request comes: each call is served on its wake-up, none waits
/// for the safety-net timeout (before the queue notified, every one of them did).
#[test]
fn calls_on_a_paused_vcpu_are_served_without_timeouts() {
    let mut vm = Vm::build(config("spin", "")).unwrap();
    vm.start().unwrap();
    let h = vm.vcpus()[0].clone();
    h.pause().unwrap();
    const CALLS: u64 = 20;
    for i in 0..CALLS {
        assert_eq!(h.call(move |_| i).unwrap(), i);
    }
    let timeouts = vm.stats().snapshot()["vcpu0.paused_wait_timeouts"];
    vm.stop(StopReason::Signal(15));
    let report = vm.wait();
    assert_eq!(timeouts, 0, "{CALLS} calls on a paused vCPU");
    assert_eq!(report.counters["vcpu0.paused_wait_timeouts"], 0);
}

/// Dropping a started VM stops and joins its vCPU threads: the handle reports the vCPU gone.
#[test]
fn dropping_a_running_vm_joins_its_vcpus() {
    let mut vm = Vm::build(config("spin", "")).unwrap();
    vm.start().unwrap();
    let h = vm.vcpus()[0].clone();
    h.call(|_| ()).unwrap();
    drop(vm);
    assert!(matches!(h.get_regs(), Err(lucid_vmm::VcpuError::Gone(0))));
}

/// A number that has a handler is refused; once removed, a new handler takes it.
#[test]
fn a_builtin_hypercall_is_replaced_only_after_its_removal() {
    let vm = Vm::build(config("pio-ping", "count=10")).unwrap();
    let calls = Arc::new(AtomicU64::new(0));
    let c = calls.clone();
    let hook = Arc::new(move |_vcpu: u32, _r: &kvm_regs| {
        c.fetch_add(1, Ordering::SeqCst);
        lucid_vmm::hypercall::MAGIC
    });
    let nr = lucid_vmm::hypercall::DISCOVER;
    assert!(matches!(
        vm.hooks().add_hypercall(nr, hook.clone()),
        Err(lucid_vmm::HookError::HypercallTaken { nr: 0 })
    ));
    assert!(vm.hooks().remove_hypercall(nr));
    vm.hooks().add_hypercall(nr, hook).unwrap();
    let mut vm = vm;
    vm.start().unwrap();
    let report = vm.wait();
    assert_eq!(report.stop, StopReason::DebugExit(0));
    // The probe kit discovers Lucid with hypercall 0 before it asks for the TSC frequency.
    assert!(calls.load(Ordering::SeqCst) >= 1);
    assert!(report.counters["vcpu0.hypercalls"] >= calls.load(Ordering::SeqCst));
}
