//! `lucid bench io`: the exit ladder measured. For each workload (virtio-blk 4 KiB random reads at
//! queue depth 1 and 32; virtio-net request-response with 64 B and 1500 B frames) and each rung
//! (L0, L1, L2, L4, L4 with a polling guest, L1 with coalescing), the same probe-guest binary runs
//! under Lucid; then under QEMU (q35 with qboot, ioeventfd on, an iothread with adaptive polling);
//! then the same access pattern runs as a host process (the limit): random 4 KiB `pread`s of the
//! same file, or request-response of the same frames between two host threads. Figures come from inside the guest (TSC-timed ops/s) and from Lucid's counters.
//!
//! Exits per I/O are measured by difference: each configuration runs twice, with N and 2N
//! operations, so boot, PCI enumeration and printing cancel out.

use std::fmt::Write as _;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::time::Instant;

use lucid_pci::Rung;
use lucid_virtio::blk::BlockConfig;
use lucid_virtio::net::{NetBackend, NetConfig};
use lucid_virtio::Coalescing;
use lucid_vmm::{KernelSource, PciDeviceConfig, PciDeviceKind, SerialOutput, Vm, VmConfig};
use serde_json::{json, Value};

#[derive(clap::Args)]
pub struct IoArgs {
    #[arg(long)]
    json: bool,
    /// Operations per measured run (each configuration runs with N and 2N).
    #[arg(long, default_value_t = 2000)]
    count: u64,
    /// Write an SVG plot of ops/s and exits per I/O per rung to this file.
    #[arg(long)]
    plot: Option<PathBuf>,
    /// Skip the QEMU peer.
    #[arg(long)]
    no_qemu: bool,
    /// Repetitions of each measurement; medians are reported.
    #[arg(long, default_value_t = 3)]
    runs: usize,
}

/// What the guest does and against which device.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Device {
    /// virtio-blk on a disk image of `DISK_MIB`.
    Block,
    /// virtio-net with the echo back-end, frames of `size` bytes.
    Net { size: usize },
}

pub(crate) struct Workload {
    pub name: &'static str,
    pub guest: &'static str,
    /// Guest command line without `count` and `mode`.
    pub args: &'static str,
    pub device: Device,
}

pub(crate) const WORKLOADS: &[Workload] = &[
    Workload {
        name: "blk-randread-4k-qd1",
        guest: "virtio-blk",
        args: "op=read pattern=rand bs=4096 qd=1",
        device: Device::Block,
    },
    Workload {
        name: "blk-randread-4k-qd32",
        guest: "virtio-blk",
        args: "op=read pattern=rand bs=4096 qd=32",
        device: Device::Block,
    },
    Workload {
        name: "net-rr-64",
        guest: "virtio-net",
        args: "op=rr size=64",
        device: Device::Net { size: 64 },
    },
    Workload {
        name: "net-rr-1500",
        guest: "virtio-net",
        args: "op=rr size=1500",
        device: Device::Net { size: 1500 },
    },
];

impl Workload {
    /// The prefix of the guest's result line.
    fn result_prefix(&self) -> &'static str {
        match self.device {
            Device::Block => "virtio-blk op=",
            Device::Net { .. } => "virtio-net op=",
        }
    }

    /// The key of the guest's rate.
    pub fn rate_key(&self) -> &'static str {
        match self.device {
            Device::Block => "ops_per_s",
            Device::Net { .. } => "pps",
        }
    }
}

/// How the guest waits for completions.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum GuestMode {
    Irq,
    Poll,
}

impl GuestMode {
    pub fn arg(self) -> &'static str {
        match self {
            GuestMode::Irq => "irq",
            GuestMode::Poll => "poll",
        }
    }
}

/// One column of the table: a rung with its options, and how the guest waits.
pub(crate) struct RungSetup {
    pub label: &'static str,
    pub rung: Rung,
    pub coalescing: Coalescing,
    pub guest: GuestMode,
}

const NO_COALESCING: Coalescing = Coalescing {
    max_completions: 0,
    max_delay_us: 0,
};

pub(crate) const RUNGS: &[RungSetup] = &[
    RungSetup {
        label: "L0",
        rung: Rung::L0,
        coalescing: NO_COALESCING,
        guest: GuestMode::Irq,
    },
    RungSetup {
        label: "L1",
        rung: Rung::L1,
        coalescing: NO_COALESCING,
        guest: GuestMode::Irq,
    },
    RungSetup {
        label: "L2",
        rung: Rung::L2,
        coalescing: NO_COALESCING,
        guest: GuestMode::Irq,
    },
    RungSetup {
        label: "L4",
        rung: Rung::L4 { guest_polls: false },
        coalescing: NO_COALESCING,
        guest: GuestMode::Irq,
    },
    RungSetup {
        label: "L4p",
        rung: Rung::L4 { guest_polls: true },
        coalescing: NO_COALESCING,
        guest: GuestMode::Poll,
    },
    RungSetup {
        label: "L1+coalesce",
        rung: Rung::L1,
        coalescing: Coalescing {
            max_completions: 8,
            max_delay_us: 50,
        },
        guest: GuestMode::Irq,
    },
];

const DISK_MIB: u64 = 64;

/// What the guest's result line says.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct GuestResult {
    pub ops_per_s: f64,
    irqs: f64,
    kicks: f64,
}

impl GuestResult {
    /// From the line starting with the workload's prefix; `None` when there is none or it has
    /// no rate.
    pub fn parse(w: &Workload, out: &str) -> Option<GuestResult> {
        let line = out.lines().find(|l| l.starts_with(w.result_prefix()))?;
        let field = |key: &str| {
            line.split_whitespace()
                .find_map(|f| f.strip_prefix(key).and_then(|v| v.strip_prefix('=')))
                .and_then(|v| v.parse::<f64>().ok())
        };
        Some(GuestResult {
            ops_per_s: field(w.rate_key())?,
            irqs: field("irqs").unwrap_or(0.0),
            kicks: field("kicks").unwrap_or(0.0),
        })
    }
}

pub(crate) fn guest_path(name: &str, dir: &Path) -> Result<PathBuf, String> {
    let p = dir.join(format!("{name}.elf"));
    std::fs::write(
        &p,
        lucid_guests::get(name).ok_or(format!("no guest {name}"))?,
    )
    .map_err(|e| e.to_string())?;
    Ok(p)
}

/// The device of workload `w` on rung `r`.
pub(crate) fn device_config(w: &Workload, r: &RungSetup, disk: &Path) -> PciDeviceConfig {
    let kind = match w.device {
        Device::Block => PciDeviceKind::Block(BlockConfig {
            path: disk.to_path_buf(),
            read_only: false,
            logical_block_size: 512,
            id: String::new(),
            direct: false,
        }),
        Device::Net { .. } => PciDeviceKind::Net(NetConfig {
            backend: NetBackend::Echo,
            mac: [0x52, 0x54, 0x00, 0x12, 0x34, 0x56],
        }),
    };
    PciDeviceConfig {
        rung: r.rung,
        coalescing: r.coalescing,
        ..PciDeviceConfig::new(kind)
    }
}

/// What one Lucid run gave: the guest's figures and Lucid's counts.
struct LucidRun {
    guest: GuestResult,
    user_exits: u64,
    kvm_exits: u64,
    irqs: u64,
}

/// Runs workload `w` (`count` operations) on rung `r` under Lucid with the VM `c` describes
/// (its kernel, and whatever else the caller sets: `c.payload.cmdline` holds extra guest arguments, put
/// after the workload's), its disk `disk` and its console in `dir`. The guest's result and
/// Lucid's report; `label` follows the rung in errors.
pub(crate) fn run_guest(
    w: &Workload,
    r: &RungSetup,
    disk: &Path,
    count: u64,
    dir: &Path,
    mut c: VmConfig,
    label: &str,
) -> Result<(GuestResult, lucid_vmm::RunReport), String> {
    let serial = dir.join("serial.txt");
    c.payload.cmdline = format!(
        "{} mode={} count={count}{}",
        w.args,
        r.guest.arg(),
        c.payload.cmdline
    );
    c.devices.serial = SerialOutput::File(serial.clone());
    c.devices.pci.push(device_config(w, r, disk));
    let report = Vm::run(c).map_err(|e| lucid_vmm::error_chain(&e))?;
    let out = std::fs::read_to_string(&serial).unwrap_or_default();
    if report.stop != lucid_vmm::StopReason::DebugExit(0) {
        return Err(format!(
            "{} on {}{label}: {} — guest said: {out}",
            w.name,
            r.label,
            report.stop_text()
        ));
    }
    let guest = GuestResult::parse(w, &out).ok_or(format!("no {} in: {out}", w.rate_key()))?;
    Ok((guest, report))
}

fn lucid_run(
    w: &Workload,
    r: &RungSetup,
    kernel: &Path,
    disk: &Path,
    count: u64,
    dir: &Path,
) -> Result<LucidRun, String> {
    let c = VmConfig::new(KernelSource::File(kernel.into()));
    let (guest, report) = run_guest(w, r, disk, count, dir, c, "")?;
    Ok(LucidRun {
        guest,
        user_exits: report.total_exits(),
        kvm_exits: report.kvm_exits(),
        irqs: report.devices().iter().map(|d| d.irqs).sum(),
    })
}

/// One rung of one workload: ops/s (from the 2N run), and per-I/O figures by difference.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
struct RungResult {
    ops_per_s: f64,
    exits_per_io: f64,
    kvm_exits_per_io: f64,
    irqs_per_io: f64,
    guest_irqs_per_io: f64,
    guest_kicks_per_io: f64,
}

impl RungResult {
    /// Per-I/O figures by difference of a run of `n` and a run of `2n` operations.
    fn from_runs(a: &LucidRun, b: &LucidRun, n: u64) -> RungResult {
        let n = n as f64;
        let per = |x: u64, y: u64| (y as f64 - x as f64).max(0.0) / n;
        let per_f = |x: f64, y: f64| (y - x).max(0.0) / n;
        RungResult {
            ops_per_s: b.guest.ops_per_s,
            exits_per_io: per(a.user_exits, b.user_exits),
            kvm_exits_per_io: per(a.kvm_exits, b.kvm_exits),
            irqs_per_io: per(a.irqs, b.irqs),
            guest_irqs_per_io: per_f(a.guest.irqs, b.guest.irqs),
            guest_kicks_per_io: per_f(a.guest.kicks, b.guest.kicks),
        }
    }

    /// The median of each figure over `samples` (not empty).
    fn medians(samples: &[RungResult]) -> RungResult {
        let med = |f: fn(&RungResult) -> f64| {
            let mut v: Vec<f64> = samples.iter().map(f).collect();
            lucid_stats::median(&mut v).unwrap_or(f64::NAN)
        };
        RungResult {
            ops_per_s: med(|r| r.ops_per_s),
            exits_per_io: med(|r| r.exits_per_io),
            kvm_exits_per_io: med(|r| r.kvm_exits_per_io),
            irqs_per_io: med(|r| r.irqs_per_io),
            guest_irqs_per_io: med(|r| r.guest_irqs_per_io),
            guest_kicks_per_io: med(|r| r.guest_kicks_per_io),
        }
    }
}

fn measure(
    w: &Workload,
    r: &RungSetup,
    kernel: &Path,
    disk: &Path,
    count: u64,
    dir: &Path,
) -> Result<RungResult, String> {
    let a = lucid_run(w, r, kernel, disk, count, dir)?;
    let b = lucid_run(w, r, kernel, disk, 2 * count, dir)?;
    Ok(RungResult::from_runs(&a, &b, count))
}

fn qemu_cmd(
    w: &Workload,
    kernel: &Path,
    disk: &Path,
    count: u64,
    iothread_poll: bool,
    guest: GuestMode,
) -> Command {
    let append = format!("{} mode={} count={count}", w.args, guest.arg());
    let mut c = crate::qemu_command(crate::QEMU_Q35, kernel, &append);
    let poll = if iothread_poll { "" } else { ",poll-max-ns=0" };
    c.args(["-object", &format!("iothread,id=io0{poll}")]);
    match w.device {
        Device::Net { .. } => {
            // A UDP socket netdev that sends to its own address: every frame comes back (echo).
            let port = 20000 + (std::process::id() % 20000) as u16;
            c.args([
                "-netdev",
                &format!("socket,id=n0,udp=127.0.0.1:{port},localaddr=127.0.0.1:{port}"),
                "-device",
                "virtio-net-pci,netdev=n0,disable-legacy=on",
            ]);
        }
        Device::Block => {
            c.args([
                "-drive",
                &format!(
                    "file={},if=none,id=d0,format=raw,cache=writeback,aio=threads",
                    disk.display()
                ),
                "-device",
                "virtio-blk-pci,drive=d0,disable-legacy=on,iothread=io0",
            ]);
        }
    }
    c
}

/// QEMU's best of (iothread with adaptive polling, without) x (guest waits for interrupts,
/// guest polls): ops/s.
fn qemu_best(w: &Workload, kernel: &Path, disk: &Path, count: u64) -> Result<f64, String> {
    let mut best: Option<f64> = None;
    let mut last_err = String::new();
    for (poll, mode) in [
        (true, GuestMode::Irq),
        (false, GuestMode::Irq),
        (true, GuestMode::Poll),
        (false, GuestMode::Poll),
    ] {
        let out = qemu_cmd(w, kernel, disk, 2 * count, poll, mode)
            .output()
            .map_err(|e| format!("qemu-system-x86_64: {e}"))?;
        let text = String::from_utf8_lossy(&out.stdout);
        match GuestResult::parse(w, &text) {
            Some(g) => best = Some(best.map_or(g.ops_per_s, |b: f64| b.max(g.ops_per_s))),
            None => last_err = format!("QEMU printed no result: {}", text.trim()),
        }
    }
    best.ok_or(last_err)
}

/// The limit: the same access pattern by a host process, without a VM. For the block workloads,
/// random 4 KiB `pread`s of the same file; for the network workloads, request-response of the
/// same frames between two threads, the better of a blocking exchange over a socket pair and a
/// polling exchange through shared memory (the design of L4 with a polling guest).
fn native(w: &Workload, disk: &Path) -> Result<f64, String> {
    if let Device::Net { size } = w.device {
        return Ok(native_rr_blocking(size)?.max(native_rr_polling(size)));
    }
    let n = 200_000u64;
    let f = std::fs::File::open(disk).map_err(|e| e.to_string())?;
    let blocks = (DISK_MIB << 20) / 4096;
    let mut buf = vec![0u8; 4096];
    let mut x = 0x5eedu64;
    let start = Instant::now();
    for _ in 0..n {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        f.read_exact_at(&mut buf, (x % blocks) * 4096)
            .map_err(|e| e.to_string())?;
    }
    Ok(n as f64 / start.elapsed().as_secs_f64())
}

fn native_rr_blocking(size: usize) -> Result<f64, String> {
    use std::os::unix::net::UnixDatagram;
    let n = 20_000u64;
    let (a, b) = UnixDatagram::pair().map_err(|e| e.to_string())?;
    let echo = std::thread::spawn(move || {
        let mut buf = vec![0u8; 2048];
        while let Ok(got) = b.recv(&mut buf) {
            if got == 0 || b.send(&buf[..got]).is_err() {
                break;
            }
        }
    });
    let mut tx: Vec<u8> = (0..size).map(|i| i as u8).collect();
    let mut rx = vec![0u8; 2048];
    let start = Instant::now();
    for i in 0..n {
        tx[0] = i as u8;
        a.send(&tx).map_err(|e| e.to_string())?;
        let got = a.recv(&mut rx).map_err(|e| e.to_string())?;
        if rx[..got] != tx[..] {
            return Err("native echo returned a different frame".into());
        }
    }
    let elapsed = start.elapsed();
    a.send(&[]).map_err(|e| e.to_string())?;
    let _ = echo.join();
    Ok(n as f64 / elapsed.as_secs_f64())
}

fn native_rr_polling(size: usize) -> f64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::{Arc, Mutex};
    let n = 200_000u64;
    // seq odd: a request is waiting; even: the reply is there. u64::MAX: stop.
    let seq = Arc::new(AtomicU64::new(0));
    let request = Arc::new(Mutex::new(vec![0u8; size]));
    let reply = Arc::new(Mutex::new(vec![0u8; size]));
    let (s, req, rep) = (seq.clone(), request.clone(), reply.clone());
    let echo = std::thread::spawn(move || loop {
        let v = s.load(Ordering::Acquire);
        if v == u64::MAX {
            break;
        }
        if v % 2 == 1 {
            rep.lock().unwrap().copy_from_slice(&req.lock().unwrap());
            s.store(v + 1, Ordering::Release);
        }
        std::hint::spin_loop();
    });
    let mut frame: Vec<u8> = (0..size).map(|i| i as u8).collect();
    let start = Instant::now();
    for i in 0..n {
        frame[0] = i as u8;
        request.lock().unwrap().copy_from_slice(&frame);
        seq.store(2 * i + 1, Ordering::Release);
        while seq.load(Ordering::Acquire) != 2 * i + 2 {
            std::hint::spin_loop();
        }
        assert_eq!(reply.lock().unwrap()[0], i as u8);
    }
    let elapsed = start.elapsed();
    seq.store(u64::MAX, Ordering::Release);
    let _ = echo.join();
    n as f64 / elapsed.as_secs_f64()
}

/// One workload's figures: each rung's (or why it failed), QEMU's best and the native limit.
struct WorkloadResult {
    workload: &'static Workload,
    rungs: Vec<(&'static RungSetup, Result<RungResult, String>)>,
    qemu_best: Result<f64, String>,
    native_ops_per_s: f64,
}

impl WorkloadResult {
    fn rung(&self, label: &str) -> Option<&RungResult> {
        self.rungs
            .iter()
            .find(|(r, _)| r.label == label)
            .and_then(|(_, res)| res.as_ref().ok())
    }

    fn lucid_best(&self) -> f64 {
        self.rungs
            .iter()
            .filter_map(|(_, r)| r.as_ref().ok())
            .map(|r| r.ops_per_s)
            .fold(0.0, f64::max)
    }

    fn to_json(&self) -> Value {
        let best = self.lucid_best();
        let rungs: serde_json::Map<String, Value> = self
            .rungs
            .iter()
            .map(|(r, res)| {
                let v = match res {
                    Ok(x) => json!(x),
                    Err(e) => json!({ "error": e }),
                };
                (r.label.to_string(), v)
            })
            .collect();
        let mut entry = json!({
            "rungs": rungs,
            "lucid_best_ops_per_s": best,
            "native_ops_per_s": self.native_ops_per_s,
            "lucid_best_over_native": best / self.native_ops_per_s,
        });
        match &self.qemu_best {
            Ok(q) => {
                entry["qemu_best_ops_per_s"] = json!(q);
                entry["lucid_best_over_qemu_best"] = json!(best / q);
            }
            Err(e) => entry["qemu_error"] = json!(e),
        }
        entry
    }
}

fn svg_plot(results: &[WorkloadResult]) -> String {
    let (w, h) = (900.0, 520.0);
    let mut s = crate::svg_start(
        w,
        h,
        11,
        "lucid bench io: ops/s (bars, left axis, log) and userspace exits per I/O (dots, right \
         axis) per rung",
    );
    let panel_w = (w - 60.0) / results.len().max(1) as f64;
    let (top, bottom) = (40.0, h - 90.0);
    let max_ops = results
        .iter()
        .flat_map(|r| r.rungs.iter().filter_map(|(_, x)| x.as_ref().ok()))
        .map(|r| r.ops_per_s)
        .fold(1.0, f64::max);
    let log_top = max_ops.log10().ceil();
    let y_ops = |v: f64| bottom - (v.max(1.0).log10() / log_top) * (bottom - top);
    let max_exits = 3.0;
    let y_exits = |v: f64| bottom - (v.min(max_exits) / max_exits) * (bottom - top);
    for d in 0..=(log_top as i32) {
        let y = y_ops(10f64.powi(d));
        let _ = writeln!(
            s,
            r##"<line x1="40" x2="{}" y1="{y}" y2="{y}" stroke="#eee"/><text x="4" y="{}">1e{d}</text>"##,
            w - 20.0,
            y + 4.0
        );
    }
    for v in 0..=(max_exits as i32) {
        let y = y_exits(v as f64);
        let _ = writeln!(
            s,
            r##"<text x="{}" y="{}" fill="#d0542c">{v}</text>"##,
            w - 14.0,
            y + 4.0
        );
    }
    for (i, result) in results.iter().enumerate() {
        let name = result.workload.name;
        let x0 = 45.0 + i as f64 * panel_w;
        let _ = writeln!(
            s,
            r#"<text x="{}" y="{}" font-size="12">{name}</text>"#,
            x0 + 5.0,
            h - 20.0
        );
        let bar_w = panel_w / (RUNGS.len() as f64 + 1.5);
        for (j, setup) in RUNGS.iter().enumerate() {
            let label = setup.label;
            let x = x0 + j as f64 * bar_w;
            if let Some(r) = result.rung(label) {
                let y = y_ops(r.ops_per_s);
                let _ = writeln!(
                    s,
                    r##"<rect x="{x}" y="{y}" width="{}" height="{}" fill="#4a7fb5"/>"##,
                    bar_w * 0.8,
                    bottom - y
                );
                let _ = writeln!(
                    s,
                    r##"<circle cx="{}" cy="{}" r="3.5" fill="#d0542c"/>"##,
                    x + bar_w * 0.4,
                    y_exits(r.exits_per_io)
                );
            }
            let _ = writeln!(
                s,
                r#"<text x="{}" y="{}" transform="rotate(60 {} {})">{label}</text>"#,
                x,
                bottom + 12.0,
                x,
                bottom + 12.0
            );
        }
        if let Ok(q) = result.qemu_best {
            let x = x0 + RUNGS.len() as f64 * bar_w;
            let y = y_ops(q);
            let _ = writeln!(
                s,
                r##"<rect x="{x}" y="{y}" width="{}" height="{}" fill="#999"/><text x="{x}" y="{}" transform="rotate(60 {x} {})">QEMU</text>"##,
                bar_w * 0.8,
                bottom - y,
                bottom + 12.0,
                bottom + 12.0
            );
        }
    }
    let _ = writeln!(
        s,
        r##"<text x="{}" y="{}" fill="#d0542c">exits per I/O (right axis, clipped at {max_exits})</text>"##,
        w - 190.0,
        top - 4.0
    );
    s.push_str("</svg>\n");
    s
}

/// A disk image of `DISK_MIB` with data in it (the page cache holds it for every reader alike).
pub(crate) fn make_disk(dir: &Path) -> Result<PathBuf, String> {
    let disk = dir.join("disk.img");
    let block: Vec<u8> = (0..1 << 20)
        .map(|i: u32| (i.wrapping_mul(2654435761) >> 24) as u8)
        .collect();
    let mut data = Vec::with_capacity((DISK_MIB << 20) as usize);
    for _ in 0..DISK_MIB {
        data.extend_from_slice(&block);
    }
    std::fs::write(&disk, &data).map_err(|e| e.to_string())?;
    Ok(disk)
}

const QSD: &str = "/usr/bin/qemu-storage-daemon";

/// `qemu-storage-daemon` exporting `disk` as vhost-user-blk on a socket in `dir`; killed when
/// dropped.
struct Qsd {
    child: std::process::Child,
    socket: PathBuf,
}

impl Qsd {
    fn start(dir: &Path, disk: &Path) -> Result<Qsd, String> {
        let socket = dir.join("qsd.sock");
        let _ = std::fs::remove_file(&socket);
        let child = Command::new(QSD)
            .arg("--blockdev")
            .arg(format!(
                "driver=file,node-name=f,filename={}",
                disk.display()
            ))
            .arg("--export")
            .arg(format!(
                "type=vhost-user-blk,id=e,node-name=f,addr.type=unix,addr.path={},writable=on",
                socket.display()
            ))
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .map_err(|e| format!("{QSD}: {e}"))?;
        let q = Qsd { child, socket };
        let t0 = Instant::now();
        while !q.socket.exists() {
            if t0.elapsed().as_secs() > 10 {
                return Err(format!("{QSD} made no socket"));
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        Ok(q)
    }
}

impl Drop for Qsd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.socket);
    }
}

/// The random-read workloads (QD1, QD32) on rung L1 with Lucid's own virtio-blk and with
/// `qemu-storage-daemon`'s vhost-user-blk on the same file, guest RAM a shared memfd for both:
/// ops/s (medians of `args.runs`) and their ratio.
fn vhost_user_blk(args: &IoArgs, dir: &Path, disk: &Path) -> Value {
    let one = |w: &Workload, vhost_user: bool| -> Result<f64, String> {
        let kernel = guest_path(w.guest, dir)?;
        let r = &RUNGS[1];
        let count = args.count * 2;
        let mut c = VmConfig::new(KernelSource::File(kernel));
        c.machine.backing = lucid_vmm::Backing::SharedMemfd;
        let serial = dir.join("serial-vu.txt");
        c.devices.serial = SerialOutput::File(serial.clone());
        c.payload.cmdline = format!("{} mode={} count={count}", w.args, r.guest.arg());
        let qsd = match vhost_user {
            true => Some(Qsd::start(dir, disk)?),
            false => None,
        };
        let device = match &qsd {
            Some(q) => lucid_vmm::parse_blk(&format!(
                "vhost_user=on,socket={},queue_size=256",
                q.socket.display()
            ))
            .map_err(|e| e.to_string())?,
            None => device_config(w, r, disk),
        };
        c.devices.pci.push(device);
        let report = Vm::run(c).map_err(|e| lucid_vmm::error_chain(&e))?;
        drop(qsd);
        let out = std::fs::read_to_string(&serial).unwrap_or_default();
        if report.stop != lucid_vmm::StopReason::DebugExit(0) {
            return Err(format!(
                "{}: {} — guest said: {out}",
                w.name,
                report.stop_text()
            ));
        }
        Ok(GuestResult::parse(w, &out)
            .ok_or(format!("no {} in: {out}", w.rate_key()))?
            .ops_per_s)
    };
    if !Path::new(QSD).exists() {
        return json!({ "error": format!("no {QSD}") });
    }
    let mut v = serde_json::Map::new();
    for (key, w) in [("qd1", &WORKLOADS[0]), ("qd32", &WORKLOADS[1])] {
        let median = |vu: bool| -> Result<f64, String> {
            let mut s = (0..args.runs.max(1))
                .map(|_| one(w, vu))
                .collect::<Result<Vec<f64>, String>>()?;
            lucid_stats::median(&mut s).ok_or("no sample".to_string())
        };
        let entry = match (median(false), median(true)) {
            (Ok(b), Ok(u)) => json!({
                "builtin_ops_per_s": b,
                "vhost_user_ops_per_s": u,
                "ratio": u / b,
            }),
            (Err(e), _) | (_, Err(e)) => json!({ "error": e }),
        };
        if !args.json {
            log::info!("vhost-user-blk {key}: {entry}");
        }
        v.insert(key.into(), entry);
    }
    Value::Object(v)
}

pub fn run(args: IoArgs) -> Result<ExitCode, String> {
    let dir = std::env::temp_dir().join(format!("lucid-bench-io-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let disk = make_disk(&dir)?;
    let mut results = Vec::new();
    for w in WORKLOADS {
        let kernel = guest_path(w.guest, &dir)?;
        let mut rungs = Vec::new();
        for r in RUNGS {
            // Block I/O beyond L0 is fast enough for twice the operations.
            let count = match (w.device, r.rung) {
                (Device::Block, rung) if rung != Rung::L0 => args.count * 2,
                _ => args.count,
            };
            let samples: Result<Vec<RungResult>, String> = (0..args.runs.max(1))
                .map(|_| measure(w, r, &kernel, &disk, count, &dir))
                .collect();
            let result = samples.map(|s| RungResult::medians(&s));
            if !args.json {
                match &result {
                    Ok(x) => log::info!("{:<22} {:<12} {x:?}", w.name, r.label),
                    Err(e) => log::warn!("{:<22} {:<12} {e}", w.name, r.label),
                }
            }
            rungs.push((r, result));
        }
        let qemu_best = if args.no_qemu {
            Err("skipped".to_string())
        } else {
            qemu_best(w, &kernel, &disk, args.count)
        };
        results.push(WorkloadResult {
            workload: w,
            rungs,
            qemu_best,
            native_ops_per_s: native(w, &disk)?,
        });
    }
    let vhost_user = vhost_user_blk(&args, &dir, &disk);
    let vsock = vsock_stream(&dir);
    let _ = std::fs::remove_dir_all(&dir);
    if let Some(p) = &args.plot {
        std::fs::write(p, svg_plot(&results)).map_err(|e| format!("{}: {e}", p.display()))?;
    }
    if args.json {
        let all: serde_json::Map<String, Value> = results
            .iter()
            .map(|r| (r.workload.name.to_string(), r.to_json()))
            .collect();
        let vsock_mb = vsock.as_ref().ok().copied();
        println!(
            "{}",
            json!({
                "count": args.count,
                "workloads": all,
                "vhost_user_blk_over_builtin": vhost_user,
                "vsock_mb_per_s": vsock_mb,
            })
        );
        return Ok(ExitCode::SUCCESS);
    }
    println!("lucid bench io (ops/s from inside the guest; exits and interrupts per I/O by difference of N and 2N runs)");
    for result in &results {
        println!("{}:", result.workload.name);
        for (setup, r) in &result.rungs {
            let label = setup.label;
            match r {
                Ok(r) => println!(
                    "  {label:<12} {:>10.0} ops/s  exits/IO {:>6.3}  KVM exits/IO {:>6.2}  irqs/IO {:>5.3}",
                    r.ops_per_s, r.exits_per_io, r.kvm_exits_per_io, r.irqs_per_io
                ),
                Err(e) => println!("  {label:<12} error: {e}"),
            }
        }
        let best = result.lucid_best();
        println!(
            "  QEMU best    {}   native {:.0} ops/s   Lucid best / QEMU best {}   Lucid best / native {:.3}",
            match &result.qemu_best {
                Ok(q) => format!("{q:.0} ops/s"),
                Err(e) => format!("n/a ({e})"),
            },
            result.native_ops_per_s,
            result
                .qemu_best
                .as_ref()
                .map_or("n/a".into(), |q| format!("{:.2}", best / q)),
            best / result.native_ops_per_s,
        );
    }
    println!(
        "vhost-user-blk (qemu-storage-daemon) over Lucid's virtio-blk, same file, L1: {vhost_user}"
    );
    match vsock {
        Ok(mb) => println!(
            "vsock stream: {mb:.1} MB/s ({} MiB through the guest and back, host echo on a Unix socket)",
            VSOCK_BYTES >> 20
        ),
        Err(e) => println!("vsock stream: error: {e}"),
    }
    Ok(ExitCode::SUCCESS)
}

const VSOCK_BYTES: u64 = 16 << 20;

/// vsock stream throughput: the `virtio-vsock` guest connects to host port 5000 (a thread here
/// echoing on `<socket>_5000`) and sends 16 MiB, reading each byte back. MB/s of payload one
/// way, from the guest's TSC time (every byte crosses the device twice).
fn vsock_stream(dir: &Path) -> Result<f64, String> {
    let kernel = guest_path("virtio-vsock", dir)?;
    let sock = dir.join("vsock.sock");
    let listen = dir.join("vsock.sock_5000");
    let _ = std::fs::remove_file(&listen);
    let l = std::os::unix::net::UnixListener::bind(&listen).map_err(|e| e.to_string())?;
    let echo = std::thread::spawn(move || {
        use std::io::{Read, Write};
        let Ok((mut s, _)) = l.accept() else { return };
        let mut buf = vec![0u8; 1 << 16];
        while let Ok(n @ 1..) = s.read(&mut buf) {
            if s.write_all(&buf[..n]).is_err() {
                return;
            }
        }
    });
    let serial = dir.join("vsock-serial.txt");
    let mut c = VmConfig::new(KernelSource::File(kernel));
    c.payload.cmdline = format!("mode=connect port=5000 bytes={VSOCK_BYTES} timeout_ms=120000");
    c.devices.serial = SerialOutput::File(serial.clone());
    c.devices.pci.push(
        lucid_vmm::parse_vsock(&format!("cid=3,socket={}", sock.display()))
            .map_err(|e| e.to_string())?,
    );
    let report = Vm::run(c).map_err(|e| lucid_vmm::error_chain(&e))?;
    let _ = echo.join();
    let out = std::fs::read_to_string(&serial).unwrap_or_default();
    if report.stop != lucid_vmm::StopReason::DebugExit(0) {
        return Err(format!("{} — guest said: {out}", report.stop_text()));
    }
    let line = out
        .lines()
        .find(|l| l.starts_with("virtio-vsock: mode=connect"))
        .ok_or(format!("no result in: {out}"))?;
    let ms: f64 = line
        .split_whitespace()
        .find_map(|w| w.strip_prefix("tsc_ms="))
        .and_then(|v| v.parse().ok())
        .filter(|&ms: &f64| ms > 0.0)
        .ok_or(format!("no TSC time in: {line}"))?;
    Ok(VSOCK_BYTES as f64 / 1e6 / (ms / 1e3))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guest_result_lines_parse_into_figures() {
        let net = &WORKLOADS[2];
        let out = "virtio-net mac=52:54:00:12:34:56 features=0x1\n\
                   virtio-net op=rr size=64 packets=10 bytes=640 tsc=1 pps=1234.5 kicks=3 irqs=9 mismatches=0\n";
        assert_eq!(
            GuestResult::parse(net, out),
            Some(GuestResult {
                ops_per_s: 1234.5,
                irqs: 9.0,
                kicks: 3.0
            })
        );
        assert_eq!(
            GuestResult::parse(net, "virtio-net op=rr pps=unknown"),
            None
        );
        assert_eq!(GuestResult::parse(&WORKLOADS[0], out), None);
    }

    #[test]
    fn per_io_figures_by_difference_and_medians() {
        let run = |n: u64, ops: f64| LucidRun {
            guest: GuestResult {
                ops_per_s: ops,
                irqs: n as f64,
                kicks: 0.0,
            },
            user_exits: 100 + n,
            kvm_exits: 200 + 3 * n,
            irqs: 5 + n / 2,
        };
        let r = RungResult::from_runs(&run(1000, 1.0), &run(2000, 7.0), 1000);
        assert_eq!(r.ops_per_s, 7.0);
        assert_eq!(r.exits_per_io, 1.0);
        assert_eq!(r.kvm_exits_per_io, 3.0);
        assert_eq!(r.irqs_per_io, 0.5);
        assert_eq!(r.guest_irqs_per_io, 1.0);
        let m = RungResult::medians(&[
            RungResult {
                ops_per_s: 3.0,
                ..r
            },
            RungResult {
                ops_per_s: 1.0,
                ..r
            },
            RungResult {
                ops_per_s: 2.0,
                ..r
            },
        ]);
        assert_eq!(m.ops_per_s, 2.0);
    }

    #[test]
    fn devices_are_built_from_the_rung_table() {
        let d = device_config(&WORKLOADS[0], &RUNGS[5], Path::new("/tmp/d.img"));
        assert_eq!(d.rung, Rung::L1);
        assert_eq!(d.coalescing.max_completions, 8);
        assert!(matches!(d.kind, PciDeviceKind::Block(ref b) if b.path == Path::new("/tmp/d.img")));
        let d = device_config(&WORKLOADS[3], &RUNGS[4], Path::new("/unused"));
        assert_eq!(d.rung, Rung::L4 { guest_polls: true });
        assert!(matches!(d.kind, PciDeviceKind::Net(_)));
    }
}
