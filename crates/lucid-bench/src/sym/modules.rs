//! `lucid bench sym`, part `modules` (docs/symbiotic.md §7): what loading a symbiotic module
//! into a running guest costs. One in-process VM runs the `sym-mod` guest (the kit's loader);
//! Lucid loads and unloads the kit's `quiet` module (no console output, so the figures are the
//! loader's and the mailbox's) repeatedly, in ordinary and in read-only placement, and calls
//! into it. Keys: `module_load_us`, `module_unload_us`, `module_ro_load_us`, `module_call_us`
//! (medians, microseconds, post to reply as the caller sees it), `module_load_exits` and
//! `module_unload_exits` (exits to userspace per request), `module_bytes` (the object's size),
//! and `module_load_hello_us`: the `hello` module, whose init prints a line (one exit per
//! console byte), for scale.

use std::time::{Duration, Instant};

use lucid_vmm::sym::ModuleOptions;
use lucid_vmm::{KernelSource, SerialOutput, StopReason, Vm, VmConfig};
use serde_json::Value;

use super::{Figures, Opts};

/// The median, 0 for no samples.
fn median_or_0(mut v: Vec<u64>) -> u64 {
    lucid_stats::median_by(&mut v, u64::cmp)
        .copied()
        .unwrap_or(0)
}

fn exits(vm: &Vm) -> u64 {
    // Exits to userspace, all vCPUs: `vcpuN.exits` (as `RunReport::total_exits`).
    vm.stats()
        .snapshot()
        .iter()
        .filter(|(k, _)| {
            k.starts_with("vcpu") && k.ends_with(".exits") && k.matches('.').count() == 1
        })
        .map(|(_, v)| *v)
        .sum()
}

pub fn run(opts: &Opts) -> Result<Figures, String> {
    let rounds = if opts.quick { 10 } else { 100 };
    let quiet = lucid_guests::module("quiet").ok_or("no built-in quiet module")?;
    let hello = lucid_guests::module("hello").ok_or("no built-in hello module")?;
    let mut c = VmConfig::new(KernelSource::Builtin {
        name: "sym-mod".into(),
        bytes: lucid_guests::get("sym-mod").ok_or("no built-in sym-mod guest")?,
    });
    c.symbiotic.enabled = true;
    // The modules print on the console: keep it out of the bench's output.
    let console =
        std::env::temp_dir().join(format!("lucid-bench-modules-{}.txt", std::process::id()));
    c.devices.serial = SerialOutput::File(console.clone());
    let mut vm = Vm::build(c).map_err(|e| format!("building the VM: {e}"))?;
    vm.start().map_err(|e| format!("starting the VM: {e}"))?;
    let sym = vm.sym().ok_or("the VM is not symbiotic")?.clone();
    let plain = ModuleOptions {
        timeout: Some(Duration::from_secs(10)),
        ..Default::default()
    };
    let ro = ModuleOptions {
        read_only: true,
        ..plain.clone()
    };
    let result = (|| {
        let (mut load, mut unload, mut ro_load, mut call) = (vec![], vec![], vec![], vec![]);
        let (mut load_exits, mut unload_exits, mut hello_load) = (vec![], vec![], vec![]);
        // A warm-up cycle: the loader is up and the guest's pages are touched.
        let m = sym.load_module(quiet, &plain).map_err(|e| e.to_string())?;
        sym.unload_module(m.id).map_err(|e| e.to_string())?;
        for _ in 0..rounds {
            let e0 = exits(&vm);
            let t = Instant::now();
            let m = sym.load_module(quiet, &plain).map_err(|e| e.to_string())?;
            load.push(t.elapsed().as_micros() as u64);
            load_exits.push(exits(&vm).saturating_sub(e0));
            let t = Instant::now();
            sym.call_module(m.id, 1).map_err(|e| e.to_string())?;
            call.push(t.elapsed().as_micros() as u64);
            let e0 = exits(&vm);
            let t = Instant::now();
            sym.unload_module(m.id).map_err(|e| e.to_string())?;
            unload.push(t.elapsed().as_micros() as u64);
            unload_exits.push(exits(&vm).saturating_sub(e0));
        }
        for _ in 0..rounds.min(20) {
            let t = Instant::now();
            let m = sym.load_module(hello, &plain).map_err(|e| e.to_string())?;
            hello_load.push(t.elapsed().as_micros() as u64);
            sym.unload_module(m.id).map_err(|e| e.to_string())?;
        }
        for _ in 0..rounds.min(20) {
            let t = Instant::now();
            let m = sym.load_module(quiet, &ro).map_err(|e| e.to_string())?;
            ro_load.push(t.elapsed().as_micros() as u64);
            sym.unload_module(m.id).map_err(|e| e.to_string())?;
        }
        Ok::<Figures, String>(vec![
            ("module_load_us".into(), Value::from(median_or_0(load))),
            ("module_unload_us".into(), Value::from(median_or_0(unload))),
            (
                "module_ro_load_us".into(),
                Value::from(median_or_0(ro_load)),
            ),
            ("module_call_us".into(), Value::from(median_or_0(call))),
            (
                "module_load_exits".into(),
                Value::from(median_or_0(load_exits)),
            ),
            (
                "module_unload_exits".into(),
                Value::from(median_or_0(unload_exits)),
            ),
            ("module_bytes".into(), Value::from(quiet.len() as u64)),
            (
                "module_load_hello_us".into(),
                Value::from(median_or_0(hello_load)),
            ),
        ])
    })();
    vm.stop(StopReason::Signal(15));
    vm.wait();
    let _ = std::fs::remove_file(console);
    result
}
