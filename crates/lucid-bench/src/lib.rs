//! `lucid bench`: benchmarks that print ratios measured side by side in one run. Not tests: no
//! pass/fail on speed, only figures.
//!
//! `exits` runs the same probe guest (`pio-ping`, which times N `out` instructions with the TSC)
//! three ways: under Lucid, under a minimal harness that only re-enters KVM after each exit (the
//! floor), and under QEMU. All three report TSC ticks per exit from inside the guest, converted
//! with the host's TSC frequency, so boot time does not enter the figure.
//!
//! The benchmarks spawn `lucid` itself (`std::env::current_exe`) for the runs that need a
//! process of their own, so they are called from the `lucid` binary.

mod api;
mod assigned;
pub mod http;
mod io;
mod iommu;
mod pools;
mod swap;
mod sym;

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use lucid_stats::median;
use lucid_vmm::{KernelSource, SerialOutput, Vm, VmConfig};
use serde_json::json;

#[derive(clap::Subcommand)]
pub enum BenchCmd {
    /// PIO-exit round trip: Lucid vs the raw KVM floor vs QEMU, on the same probe guest; and
    /// time from process start to the guest's first output from CPL3.
    Exits {
        #[arg(long)]
        json: bool,
        /// Exits per run.
        #[arg(long, default_value_t = 20000)]
        count: u64,
        /// Runs of each; the median is reported.
        #[arg(long, default_value_t = 3)]
        runs: usize,
    },
    /// The exit ladder: every rung on block and network workloads, against QEMU and native.
    Io(crate::io::IoArgs),
    /// The vIOMMU: no IOMMU vs samecore and sidecore VT-d emulation, each with the guest's
    /// mapping strategies (the paper's Table 1), plus map cost, risk bounds and pinning.
    Iommu(crate::iommu::IommuArgs),
    /// Scheduling pools: configurations D, P2, P3', PS for N I/O + N CPU guests,
    /// link utilisation, CPU passes/s, ms lost per MB both ways, the low-noise probe.
    Pools(crate::pools::PoolsArgs),
    /// VSWAPPER: baseline, mapper, vswapper, balloon and balloon+vswapper under memory limits,
    /// on the page-cache workloads (re-read, re-read + allocate, compress).
    Swap(crate::swap::SwapArgs),
    /// Symbiotic virtualization: SymSpy exits per update, SymCall cold and warm against one
    /// exit round trip, SwapBypass against plain swap to a virtio-blk disk, module load time.
    Sym(crate::sym::SymArgs),
    /// The REST API: vm.create to the guest's first serial output (create, boot, first output)
    /// beside `lucid run --guest` from process start to its first output.
    Api(crate::api::ApiArgs),
}

pub fn run(cmd: BenchCmd) -> Result<ExitCode, String> {
    match cmd {
        BenchCmd::Exits { json, count, runs } => exits(json, count, runs.max(1)),
        BenchCmd::Io(args) => crate::io::run(args),
        BenchCmd::Iommu(args) => crate::iommu::run(args),
        BenchCmd::Pools(args) => crate::pools::run(args),
        BenchCmd::Swap(args) => crate::swap::run(args),
        BenchCmd::Sym(args) => crate::sym::run(args),
        BenchCmd::Api(args) => crate::api::run(args),
    }
}

/// `tsc_per_exit=X` from the guest's output.
fn parse_tsc_per_exit(out: &str) -> Option<f64> {
    out.split_whitespace()
        .find_map(|w| w.strip_prefix("tsc_per_exit="))
        .and_then(|v| v.parse().ok())
}

fn tsc_khz() -> Result<f64, String> {
    let kvm = lucid_hv::open_kvm().map_err(|e| e.to_string())?;
    let vm = lucid_hv::Vm::new(kvm).map_err(|e| e.to_string())?;
    let vcpu = vm.create_vcpu(0).map_err(|e| e.to_string())?;
    Ok(vcpu.tsc_khz().map_err(|e| e.to_string())? as f64)
}

fn guest_file(name: &str) -> Result<PathBuf, String> {
    let bytes = lucid_guests::get(name).ok_or(format!("no built-in guest {name}"))?;
    let path = std::env::temp_dir().join(format!("lucid-bench-{}-{name}.elf", std::process::id()));
    std::fs::write(&path, bytes).map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(path)
}

/// One pio-ping run under Lucid, in this process; TSC ticks per exit.
fn lucid_run(kernel: &Path, count: u64) -> Result<f64, String> {
    let out = std::env::temp_dir().join(format!("lucid-bench-{}.serial", std::process::id()));
    let mut c = VmConfig::new(KernelSource::File(kernel.into()));
    c.payload.cmdline = format!("count={count}");
    c.devices.serial = SerialOutput::File(out.clone());
    let report = Vm::run(c).map_err(|e| e.to_string())?;
    let text = std::fs::read_to_string(&out).unwrap_or_default();
    let _ = std::fs::remove_file(&out);
    parse_tsc_per_exit(&text).ok_or(format!(
        "Lucid run of pio-ping printed no tsc_per_exit ({}): {text}",
        report.stop_text()
    ))
}

/// The floor: the same guest booted the same way (the first stages of Lucid's `VmBuilder`), but
/// the exit loop only collects serial bytes and re-enters KVM; no buses, no counters, no hooks.
fn floor_run(kernel: &Path, count: u64) -> Result<f64, String> {
    use lucid_boot::{layout, AcpiConfig, KernelImage};
    use lucid_hv::Exit;
    use lucid_vmm::{KernelLoad, VmBuilder};
    let e = |e: &(dyn std::error::Error + 'static)| lucid_vmm::error_chain(e);
    let mut b = VmBuilder::new(256 << 20, Default::default()).map_err(|x| e(&x))?;
    b.irqchip().map_err(|x| e(&x))?;
    let image = KernelImage::open(kernel).map_err(|x| e(&x))?;
    let setup = b
        .load_kernel(&KernelLoad {
            image: &image,
            initrd: None,
            cmdline: &format!("count={count}"),
            acpi: Some(&AcpiConfig::new(1)),
        })
        .map_err(|x| e(&x))?;
    let mut vcpu = b.vcpu(0, 1, Some(&setup), |_| {}).map_err(|x| e(&x))?;
    let mut serial = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        match vcpu.run().map_err(|x| e(&x))? {
            Exit::IoOut(layout::ports::SERIAL_COM1, d) => serial.push(d[0]),
            Exit::IoOut(layout::ports::DEBUG_EXIT, _) => break,
            Exit::IoIn(_, d) => d.fill(0xff),
            Exit::Shutdown | Exit::InternalError(_) | Exit::FailEntry(_) => {
                return Err("floor harness: guest crashed".into())
            }
            _ => {}
        }
        if Instant::now() > deadline {
            return Err("floor harness: guest did not finish in 120 s".into());
        }
    }
    let text = String::from_utf8_lossy(&serial).into_owned();
    parse_tsc_per_exit(&text).ok_or(format!("floor run printed no tsc_per_exit: {text}"))
}

/// QEMU as the benchmarks compare with ([`lucid_guests::qemu_command`]), its standard error
/// discarded.
/// `key=`'s value on the first line of a guest's output that starts with `prefix`.
pub(crate) fn field<T: std::str::FromStr>(out: &str, prefix: &str, key: &str) -> Option<T> {
    out.lines()
        .find(|l| l.starts_with(prefix))?
        .split_whitespace()
        .find_map(|w| w.strip_prefix(key)?.strip_prefix('='))?
        .parse()
        .ok()
}

pub fn qemu_command(machine: &[&str], kernel: &Path, append: &str) -> Command {
    let mut c = lucid_guests::qemu_command(machine, kernel, append);
    c.stdin(Stdio::null()).stderr(Stdio::null());
    c
}

pub use lucid_guests::{QEMU_MICROVM, QEMU_Q35};

/// The start of a benchmark's SVG plot: a `w` x `h` canvas on white, text at `font_size`, and
/// `title` across the top. The caller draws the rest and closes the `<svg>`.
pub fn svg_start(w: f64, h: f64, font_size: u32, title: &str) -> String {
    format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" \
         font-family=\"sans-serif\" font-size=\"{font_size}\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <text x=\"10\" y=\"18\" font-size=\"14\">{title}</text>\n"
    )
}

fn qemu_cmd(kernel: &Path, append: &str) -> Command {
    qemu_command(QEMU_MICROVM, kernel, append)
}

fn qemu_run(kernel: &Path, count: u64) -> Result<f64, String> {
    let out = qemu_cmd(kernel, &format!("count={count}"))
        .output()
        .map_err(|e| format!("qemu-system-x86_64: {e} (apt-get install qemu-system-x86)"))?;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    parse_tsc_per_exit(&text).ok_or(format!("QEMU run printed no tsc_per_exit: {text}"))
}

/// Wall time from spawning `cmd` to the first byte on its stdout (the guest's first serial
/// output, which the probe kit prints from CPL3), then waits for it to exit.
fn time_to_first_byte(mut cmd: Command) -> Result<f64, String> {
    let start = Instant::now();
    let mut child = cmd
        .stdout(Stdio::piped())
        .spawn()
        .map_err(|e| format!("{cmd:?}: {e}"))?;
    let mut stdout = child.stdout.take().expect("piped");
    let mut b = [0u8; 1];
    let got = stdout.read(&mut b).map_err(|e| e.to_string())?;
    let t = start.elapsed().as_secs_f64() * 1e3;
    let mut rest = Vec::new();
    let _ = stdout.read_to_end(&mut rest);
    let _ = child.wait();
    if got == 0 {
        return Err(format!("{cmd:?} printed nothing"));
    }
    Ok(t)
}

fn exits(json: bool, count: u64, runs: usize) -> Result<ExitCode, String> {
    let khz = tsc_khz()?;
    let to_us = |ticks: f64| ticks / khz * 1e3;
    let ping = guest_file("pio-ping")?;
    let hello = guest_file("hello")?;
    let mut lucid = Vec::new();
    let mut floor = Vec::new();
    let mut qemu = Vec::new();
    let mut qemu_error = None;
    // Interleaved, so that drift in the machine's load hits all three alike.
    for _ in 0..runs {
        lucid.push(to_us(lucid_run(&ping, count)?));
        floor.push(to_us(floor_run(&ping, count)?));
        match qemu_run(&ping, count) {
            Ok(t) => qemu.push(to_us(t)),
            Err(e) => qemu_error = Some(e),
        }
    }
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut lucid_start = Vec::new();
    let mut qemu_start = Vec::new();
    for _ in 0..runs {
        let mut c = Command::new(&exe);
        c.args(["run", "--quiet", "--kernel"])
            .arg(&hello)
            .stdin(Stdio::null())
            .stderr(Stdio::null());
        lucid_start.push(time_to_first_byte(c)?);
        if qemu_error.is_none() {
            match time_to_first_byte(qemu_cmd(&hello, "")) {
                Ok(t) => qemu_start.push(t),
                Err(e) => qemu_error = Some(e),
            }
        }
    }
    let _ = std::fs::remove_file(&ping);
    let _ = std::fs::remove_file(&hello);
    let (l, f) = (
        median(&mut lucid).expect("runs >= 1"),
        median(&mut floor).expect("runs >= 1"),
    );
    let q = median(&mut qemu);
    let ls = median(&mut lucid_start).expect("runs >= 1");
    let qs = median(&mut qemu_start);
    let result = json!({
        "count": count,
        "runs": runs,
        "tsc_khz": khz,
        "lucid_us": l,
        "floor_us": f,
        "qemu_us": q,
        "lucid_over_floor": l / f,
        "qemu_over_lucid": q.map(|q| q / l),
        "start_to_first_output_ms": { "lucid": ls, "qemu_microvm": qs },
        "qemu_error": qemu_error,
    });
    if json {
        println!("{result}");
    } else {
        println!("lucid bench exits: {count} PIO exits per run, median of {runs} runs, guest-timed (TSC {khz} kHz)");
        println!("  Lucid          {l:8.2} us per exit");
        println!(
            "  KVM floor      {f:8.2} us per exit   (Lucid / floor = {:.3})",
            l / f
        );
        match q {
            Some(q) => println!(
                "  QEMU           {q:8.2} us per exit   (QEMU / Lucid = {:.3})",
                q / l
            ),
            None => println!(
                "  QEMU           not measured: {}",
                qemu_error.as_deref().unwrap_or("?")
            ),
        }
        println!("  process start to the guest's first output (from CPL3):");
        println!("  Lucid          {ls:8.1} ms");
        if let Some(qs) = qs {
            println!(
                "  QEMU microvm   {qs:8.1} ms   (QEMU / Lucid = {:.2})",
                qs / ls
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}
