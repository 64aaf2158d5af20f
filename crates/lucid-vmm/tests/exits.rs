//! The exit-hook registry on real KVM: an MSR hook reached through KVM's MSR filter, and the
//! internal-error slot consulted ahead of the instruction completer. The `cpl0-insns` guest
//! runs the instructions at CPL0, where KVM (not the CPU) decides about them on every host.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use lucid_hv::{InternalError, Vcpu};
use lucid_vmm::{
    ExitAction, InternalErrorHook, KernelSource, MsrHook, RunReport, SerialOutput, StopReason, Vm,
    VmConfig,
};

/// An MSR index no CPU has: without a hook every access is a #GP.
const MSR: u32 = 0x4c55_0000;

fn vm(tag: &str, cmdline: &str) -> (Vm, std::path::PathBuf) {
    let serial = std::env::temp_dir().join(format!("lucid-exits-{}-{tag}.txt", std::process::id()));
    let mut c = VmConfig::new(KernelSource::Builtin {
        name: "cpl0-insns".into(),
        bytes: lucid_guests::get("cpl0-insns").expect("built-in guest"),
    });
    c.payload.cmdline = cmdline.into();
    c.devices.serial = SerialOutput::File(serial.clone());
    (Vm::build(c).unwrap(), serial)
}

fn run(mut vm: Vm, serial: std::path::PathBuf) -> (RunReport, String) {
    vm.start().unwrap();
    let report = vm.wait();
    let out = std::fs::read_to_string(&serial).unwrap_or_default();
    let _ = std::fs::remove_file(serial);
    (report, out)
}

/// The guest's `msr ...` line.
fn msr_line(out: &str) -> &str {
    out.lines()
        .find(|l| l.starts_with("msr "))
        .unwrap_or_else(|| panic!("no msr line: {out}"))
}

/// Reads as the last value written (0x77 at first); refuses writes of 0xbad.
struct Register {
    value: Mutex<u64>,
    accesses: Mutex<Vec<(&'static str, u32, u64)>>,
}

impl MsrHook for Register {
    fn read(&self, _vcpu: u32, index: u32) -> Option<u64> {
        let v = *self.value.lock().unwrap();
        self.accesses.lock().unwrap().push(("read", index, v));
        Some(v)
    }
    fn write(&self, _vcpu: u32, index: u32, value: u64) -> bool {
        self.accesses.lock().unwrap().push(("write", index, value));
        if value == 0xbad {
            return false;
        }
        *self.value.lock().unwrap() = value;
        true
    }
}

#[test]
fn a_hooked_msr_reaches_its_hook() {
    let (vm, serial) = vm("msr", &format!("run=msr msr={MSR:#x} value=0x1234"));
    let reg = Arc::new(Register {
        value: Mutex::new(0x77),
        accesses: Mutex::new(Vec::new()),
    });
    vm.hooks().add_msr(MSR, reg.clone()).unwrap();
    let (report, out) = run(vm, serial);
    assert_eq!(report.stop, StopReason::DebugExit(0), "{out}");
    assert_eq!(
        msr_line(&out),
        "msr index=0x4c550000 read=0x77 fault=none write=0x1234 fault=none reread=0x1234 \
         fault=none"
    );
    assert_eq!(
        *reg.accesses.lock().unwrap(),
        [
            ("read", MSR, 0x77),
            ("write", MSR, 0x1234),
            ("read", MSR, 0x1234)
        ]
    );
    assert_eq!(report.counters["vcpu0.exit.msr_read"], 2);
    assert_eq!(report.counters["vcpu0.exit.msr_write"], 1);
}

/// A write the hook refuses is a #GP in the guest, as on a CPU.
#[test]
fn a_write_the_hook_refuses_is_a_gp() {
    let (vm, serial) = vm("msr-gp", &format!("run=msr msr={MSR:#x} value=0xbad"));
    let reg = Arc::new(Register {
        value: Mutex::new(5),
        accesses: Mutex::new(Vec::new()),
    });
    vm.hooks().add_msr(MSR, reg).unwrap();
    let (report, out) = run(vm, serial);
    assert_eq!(report.stop, StopReason::DebugExit(0), "{out}");
    assert_eq!(
        msr_line(&out),
        "msr index=0x4c550000 read=0x5 fault=none write=0xbad fault=13/0x0 reread=0x5 fault=none"
    );
}

/// Without a hook, KVM keeps every MSR: the unknown one is a #GP and nothing exits.
#[test]
fn without_a_hook_kvm_keeps_the_msr() {
    let (vm, serial) = vm("msr-none", &format!("run=msr msr={MSR:#x}"));
    let (report, out) = run(vm, serial);
    assert_eq!(report.stop, StopReason::DebugExit(0), "{out}");
    assert!(
        msr_line(&out).starts_with("msr index=0x4c550000 read=0x0 fault=13/0x0"),
        "{out}"
    );
    assert_eq!(report.counters["vcpu0.exit.msr_read"], 0);
}

/// Counts internal errors and answers with a fixed action.
struct Count(AtomicU64, fn() -> ExitAction);

impl InternalErrorHook for Count {
    fn internal_error(&self, _vcpu: &mut Vcpu, _error: &InternalError) -> ExitAction {
        self.0.fetch_add(1, Ordering::SeqCst);
        (self.1)()
    }
}

/// The hook sees every internal error first; `Default` leaves it to the completer, so the guest
/// runs as without the hook.
#[test]
fn the_internal_error_hook_comes_before_the_completer() {
    let (vm, serial) = vm("ie-default", "run=clwb");
    let hook = Arc::new(Count(AtomicU64::new(0), || ExitAction::Default));
    vm.hooks().set_internal_error(hook.clone()).unwrap();
    assert!(matches!(
        vm.hooks().set_internal_error(hook.clone()),
        Err(lucid_vmm::HookError::SlotTaken { .. })
    ));
    let (report, out) = run(vm, serial);
    assert_eq!(report.stop, StopReason::DebugExit(0), "{out}");
    assert!(out.contains("cpl0-insns: done"), "{out}");
    let seen = hook.0.load(Ordering::SeqCst);
    assert_eq!(seen, report.counters["vcpu0.exit.internal_error"]);
    assert_eq!(seen, report.counters["vcpu0.emulated_insns"]);
    if out.contains("backend=pvm") {
        // clwb at CPL0 is one of the instructions KVM's emulator lacks there.
        assert!(seen >= 1, "{out}");
    }
}

/// A hook that stops the VM does so before the completer runs.
#[test]
fn an_internal_error_hook_can_stop_the_vm() {
    let (vm, serial) = vm("ie-stop", "run=clwb");
    if vm.backend() != lucid_hv::Backend::Pvm {
        eprintln!("skipped: guest kernel code is not emulated on this host, no internal errors");
        return;
    }
    let hook = Arc::new(Count(AtomicU64::new(0), || {
        ExitAction::Stop(StopReason::Reset)
    }));
    vm.hooks().set_internal_error(hook.clone()).unwrap();
    let (report, out) = run(vm, serial);
    assert_eq!(report.stop, StopReason::Reset, "{out}");
    assert_eq!(hook.0.load(Ordering::SeqCst), 1);
    assert_eq!(report.counters["vcpu0.emulated_insns"], 0);
}
