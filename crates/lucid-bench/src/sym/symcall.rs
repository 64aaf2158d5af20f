//! `lucid bench sym`, part `symcall`: SymCall latency, cold and warm, against one userspace exit
//! round trip on the same host (docs/symbiotic.md §5). VMs in this process, one after the
//! other: `pio-ping` (the exit round trip, measured by the guest), `sym-call` (its workload runs
//! at CPL3 while this thread issues `echo` calls, timed here, on the calling thread), and
//! `pio-ping` again; the exit round trip is the mean of the two.

use std::time::{Duration, Instant};

use lucid_sym::abi::{self, call, page};
use lucid_vmm::sym::SymCallError;
use lucid_vmm::{KernelSource, SerialOutput, Vm, VmConfig};
use serde_json::json;

use super::{Figures, Opts};

/// The `sym-call` guest's own calls: end the workload; touch arg0 MiB of RAM (then bump the
/// vCPU page's `V_COUNTER`).
const TEST_DONE: u64 = 0x1f0;
const TEST_TOUCH: u64 = 0x1f3;
/// What the guest touches before the "cold after touching memory" call.
const TOUCH_MIB: u64 = 128;

fn config(
    guest: &str,
    cmdline: &str,
    symbiotic: bool,
    serial: &std::path::Path,
) -> Result<VmConfig, String> {
    let bytes = lucid_guests::get(guest).ok_or(format!("no built-in guest {guest}"))?;
    let mut c = VmConfig::new(KernelSource::Builtin {
        name: guest.into(),
        bytes,
    });
    c.payload.cmdline = cmdline.into();
    c.symbiotic.enabled = symbiotic;
    c.devices.serial = SerialOutput::File(serial.to_path_buf());
    Ok(c)
}

fn serial_path(tag: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!(
        "lucid-bench-symcall-{}-{tag}.txt",
        std::process::id()
    ))
}

/// One userspace exit round trip (ns), as the `pio-ping` guest measures it.
fn exit_round_trip_ns(count: u64) -> Result<f64, String> {
    let serial = serial_path("ping");
    let mut vm = Vm::build(config(
        "pio-ping",
        &format!("count={count}"),
        false,
        &serial,
    )?)
    .map_err(|e| format!("pio-ping: {e}"))?;
    vm.start().map_err(|e| format!("pio-ping: {e}"))?;
    vm.wait();
    let out = std::fs::read_to_string(&serial).unwrap_or_default();
    let _ = std::fs::remove_file(&serial);
    crate::field(&out, "pio-ping", "ns_per_exit")
        .ok_or(format!("pio-ping printed no ns_per_exit: {out}"))
}

fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

fn us(ns: f64) -> f64 {
    (ns / 10.0).round() / 100.0
}

pub fn run(opts: &Opts) -> Result<Figures, String> {
    let n: usize = if opts.quick { 1000 } else { 10_000 };
    let pings = if opts.quick { 10_000 } else { 100_000 };
    // The exit round trip before and after the calls (the host's load drifts): their mean.
    let exit_before = exit_round_trip_ns(pings)?;

    let serial = serial_path("call");
    let mut vm = Vm::build(config("sym-call", "ms=300000", true, &serial)?)
        .map_err(|e| format!("sym-call: {e}"))?;
    vm.start().map_err(|e| format!("sym-call: {e}"))?;
    let sym = vm.sym().ok_or("no symbiotic state")?.clone();
    let result = (|| -> Result<Figures, String> {
        // Cold: the first call once the guest registered (it polls until then).
        let start = Instant::now();
        let (cold_ns, cold_exits) = loop {
            let t = Instant::now();
            match sym.call(0, call::ECHO, [1, 2, 3, 4, 5]) {
                Ok(r) => break (t.elapsed().as_nanos() as f64, r.exits),
                Err(SymCallError::NotRegistered(_))
                    if start.elapsed() < Duration::from_secs(20) =>
                {
                    std::thread::sleep(Duration::from_millis(2))
                }
                Err(e) => return Err(format!("sym-call: {e}")),
            }
        };
        let mut wall = Vec::with_capacity(n);
        let mut inside = Vec::with_capacity(n);
        let mut exits = 0u64;
        for i in 0..n as u64 {
            let t = Instant::now();
            let r = sym
                .call(0, call::ECHO, [i, 0, 0, 0, 0])
                .map_err(|e| format!("sym-call: {e}"))?;
            wall.push(t.elapsed().as_nanos() as f64);
            if r.status != abi::SYM_OK || r.values != [i, i] {
                return Err(format!("echo {i} returned {r:?}"));
            }
            inside.push(r.ns as f64);
            exits += r.exits;
        }
        wall.sort_by(f64::total_cmp);
        inside.sort_by(f64::total_cmp);
        let warm = quantile(&wall, 0.5);
        // The same calls without KVM's kvm_run state mirror (GET/SET ioctls: hosts without
        // KVM_CAP_SYNC_REGS), to show what the mirror saves.
        sym.set_state_mirror(false);
        let mut ioctl = Vec::with_capacity(n / 4);
        for i in 0..(n / 4) as u64 {
            let t = Instant::now();
            sym.call(0, call::ECHO, [i, 0, 0, 0, 0])
                .map_err(|e| format!("sym-call: {e}"))?;
            ioctl.push(t.elapsed().as_nanos() as f64);
        }
        sym.set_state_mirror(true);
        ioctl.sort_by(f64::total_cmp);
        // Cold again: the guest writes TOUCH_MIB MiB (its TLB and KVM's shadow/EPT state for the
        // handler's pages go cold), which it reports in its page without a call; then one call.
        let vpage = sym
            .spy()
            .vcpu(0)
            .cloned()
            .ok_or("the guest registered no vCPU page")?;
        let touched = vpage.load_u64(page::V_COUNTER);
        sym.call(0, TEST_TOUCH, [TOUCH_MIB, 0, 0, 0, 0])
            .map_err(|e| format!("sym-call: {e}"))?;
        let start = Instant::now();
        while vpage.load_u64(page::V_COUNTER) == touched {
            if start.elapsed() > Duration::from_secs(20) {
                return Err("the guest never finished touching its memory".into());
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        let t = Instant::now();
        let r = sym
            .call(0, call::ECHO, [1, 0, 0, 0, 0])
            .map_err(|e| format!("sym-call: {e}"))?;
        let cold_touch_ns = t.elapsed().as_nanos() as f64;
        Ok(vec![
            (
                "symcall_cold_after_touch_us".into(),
                json!(us(cold_touch_ns)),
            ),
            ("symcall_cold_after_touch_exits".into(), json!(r.exits)),
            (
                "symcall_warm_ioctl_path_us".into(),
                json!(us(quantile(&ioctl, 0.5))),
            ),
            ("symcall_cold_us".into(), json!(us(cold_ns))),
            ("symcall_cold_exits".into(), json!(cold_exits)),
            ("symcall_warm_us".into(), json!(us(warm))),
            ("symcall_p99_us".into(), json!(us(quantile(&wall, 0.99)))),
            (
                "symcall_warm_vcpu_us".into(),
                json!(us(quantile(&inside, 0.5))),
            ),
            ("symcall_calls".into(), json!(n)),
            (
                "symcall_exits_per_call".into(),
                json!((exits as f64 / n as f64 * 100.0).round() / 100.0),
            ),
        ])
    })();
    let _ = sym.call(0, TEST_DONE, [0; 5]);
    vm.wait();
    let out = std::fs::read_to_string(&serial).unwrap_or_default();
    let _ = std::fs::remove_file(&serial);
    let exit_after = exit_round_trip_ns(pings)?;
    let exit_ns = (exit_before + exit_after) / 2.0;
    let mut figures = result?;
    let warm = figures
        .iter()
        .find(|(k, _)| k == "symcall_warm_us")
        .and_then(|(_, v)| v.as_f64())
        .unwrap_or(0.0);
    figures.extend([
        ("exit_round_trip_us".into(), json!(us(exit_ns))),
        ("exit_round_trip_before_us".into(), json!(us(exit_before))),
        ("exit_round_trip_after_us".into(), json!(us(exit_after))),
        (
            "symcall_warm_over_exit".into(),
            json!((warm * 1000.0 / exit_ns * 100.0).round() / 100.0),
        ),
    ]);
    if !out.contains(" corrupt=0 ") {
        return Err(format!("the sym-call guest did not end cleanly: {out}"));
    }
    figures.push(("symcall_guest_corrupt".into(), json!(0)));
    Ok(figures)
}
