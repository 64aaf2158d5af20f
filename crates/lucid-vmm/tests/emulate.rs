//! The instruction completer's KVM side on real KVM: the TLB flush that completes INVPCID.

use std::time::{Duration, Instant};

use lucid_vmm::emulate::{CpuState, KvmCpu};
use lucid_vmm::{KernelSource, SerialOutput, StopReason, Vm, VmConfig};

fn serial_path(name: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("lucid-emulate-{}-{name}.txt", std::process::id()))
}

fn wait_for(path: &std::path::Path, text: &str, limit: Duration) -> String {
    let start = Instant::now();
    loop {
        let out = std::fs::read_to_string(path).unwrap_or_default();
        if out.contains(text) || start.elapsed() > limit {
            return out;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The guest rewrites a page-table entry at CPL3 without invalidating it and keeps reading
/// through the old translation (shadow paging leaves it in place); only Lucid's flush, run on
/// the vCPU thread, makes the new page appear. A plain trip through userspace does not.
#[test]
fn flush_tlb_drops_a_stale_translation() {
    let serial = serial_path("stale");
    let mut c = VmConfig::new(KernelSource::Builtin {
        name: "cpl0-insns".into(),
        bytes: lucid_guests::get("cpl0-insns").expect("built-in guest"),
    });
    c.cmdline = "run=stale timeout_ms=20000".into();
    c.serial = SerialOutput::File(serial.clone());
    let mut vm = Vm::build(c).unwrap();
    vm.start().unwrap();
    let out = wait_for(&serial, "stale: waiting", Duration::from_secs(30));
    assert!(
        out.contains("first=0xaaaa after_pte_write=0xaaaa"),
        "the old translation should still be in use: {out}"
    );
    let h = vm.vcpus()[0].clone();
    // An exit to userspace and back, without a flush: still the old page.
    h.call(|_| ()).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let out = std::fs::read_to_string(&serial).unwrap_or_default();
    assert!(!out.contains("stale: seen"), "{out}");
    h.call(|ctx| KvmCpu::new(&ctx.vcpu, None, &[]).flush_tlb())
        .unwrap()
        .unwrap();
    let out = wait_for(&serial, "cpl0-insns: done", Duration::from_secs(30));
    let report = vm.wait();
    let _ = std::fs::remove_file(&serial);
    assert!(out.contains("stale: seen value=0xbbbb"), "{out}");
    assert_eq!(report.stop, StopReason::DebugExit(0));
}
