//! `lucid bench sym`, part `spy`: what a SymSpy update costs. The `sym-spy` guest updates its
//! per-vCPU record N and 2N times at CPL3; the exits per update are the difference of the two
//! runs' userspace exits (the console's bytes, one exit each, taken off) over N (goal 0). For
//! contrast, the same update told to Lucid by a hypercall each time (`via=hc`: 1 exit each).

use std::path::PathBuf;

use lucid_vmm::{KernelSource, RunReport, SerialOutput, StopReason, Vm, VmConfig};
use serde_json::Value;

use super::{Figures, Opts};

pub fn run(opts: &Opts) -> Result<Figures, String> {
    let (n_page, n_hc) = match opts.quick {
        true => (1_000_000, 2_000),
        false => (10_000_000, 20_000),
    };
    let page = per_update(n_page, "")?;
    let hc = per_update(n_hc, " via=hc")?;
    Ok(vec![
        ("symspy_exits_per_update".into(), num(page.exits_per_update)),
        ("symspy_updates_per_s".into(), num(page.updates_per_s)),
        (
            "hypercall_exits_per_update".into(),
            num(hc.exits_per_update),
        ),
        ("hypercall_updates_per_s".into(), num(hc.updates_per_s)),
        ("symspy_updates".into(), Value::from(n_page)),
    ])
}

fn num(v: f64) -> Value {
    serde_json::Number::from_f64((v * 1000.0).round() / 1000.0).map_or(Value::Null, Value::Number)
}

struct PerUpdate {
    exits_per_update: f64,
    /// From the 2N run's loop time (the guest's TSC).
    updates_per_s: f64,
}

fn per_update(n: u64, extra: &str) -> Result<PerUpdate, String> {
    let (a, _) = run_guest(&format!("updates={n} report=0{extra}"))?;
    let (b, out) = run_guest(&format!("updates={} report=0{extra}", 2 * n))?;
    let exits = |r: &RunReport| {
        r.total_exits()
            .saturating_sub(r.counters.get("serial.tx_bytes").copied().unwrap_or(0))
    };
    let loop_ns: f64 = crate::field(&out, "sym-spy updates", "loop_ns")
        .ok_or(format!("sym-spy printed no loop_ns: {out}"))?;
    Ok(PerUpdate {
        exits_per_update: (exits(&b) as f64 - exits(&a) as f64) / n as f64,
        updates_per_s: match loop_ns {
            0.0 => 0.0,
            ns => (2 * n) as f64 * 1e9 / ns,
        },
    })
}

fn run_guest(cmdline: &str) -> Result<(RunReport, String), String> {
    let serial: PathBuf =
        std::env::temp_dir().join(format!("lucid-bench-spy-{}.txt", std::process::id()));
    let mut c = VmConfig::new(KernelSource::Builtin {
        name: "sym-spy".into(),
        bytes: lucid_guests::get("sym-spy").ok_or("no built-in sym-spy guest")?,
    });
    c.payload.cmdline = cmdline.into();
    c.symbiotic.enabled = true;
    c.devices.serial = SerialOutput::File(serial.clone());
    let report = Vm::run(c).map_err(|e| lucid_vmm::error_chain(&e))?;
    let out = std::fs::read_to_string(&serial).unwrap_or_default();
    let _ = std::fs::remove_file(&serial);
    if report.stop != StopReason::DebugExit(0) {
        return Err(format!("sym-spy {cmdline}: {} — {out}", report.stop_text()));
    }
    Ok((report, out))
}
