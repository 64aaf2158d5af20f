//! `lucid bench io`: the exit ladder measured. For each workload (virtio-blk 4 KiB random reads at
//! queue depth 1 and 32; virtio-net request-response with 64 B and 1500 B frames) and each rung
//! (L0, L1, L2, L4, L4 with a polling guest, L1 with coalescing), the same probe-guest binary runs
//! under Lucid; then under QEMU (q35 with qboot, ioeventfd on, an iothread with adaptive polling);
//! then the same access pattern runs as a host process (the limit): random 4 KiB `pread`s of the
//! same file, or request-response of the same frames between two host threads. Figures come from inside the guest (TSC-timed ops/s) and from Lucid's counters.
//!
//! Exits per I/O are measured by difference: each configuration runs twice, with N and 2N
//! operations, so boot, PCI enumeration and printing cancel out.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::time::Instant;

use lucid_vmm::{KernelSource, SerialOutput, Vm, VmConfig};
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

struct Workload {
    name: &'static str,
    guest: &'static str,
    /// Guest command line without `count` and `mode`.
    args: &'static str,
    net: bool,
}

const WORKLOADS: &[Workload] = &[
    Workload {
        name: "blk-randread-4k-qd1",
        guest: "virtio-blk",
        args: "op=read pattern=rand bs=4096 qd=1",
        net: false,
    },
    Workload {
        name: "blk-randread-4k-qd32",
        guest: "virtio-blk",
        args: "op=read pattern=rand bs=4096 qd=32",
        net: false,
    },
    Workload {
        name: "net-rr-64",
        guest: "virtio-net",
        args: "op=rr size=64",
        net: true,
    },
    Workload {
        name: "net-rr-1500",
        guest: "virtio-net",
        args: "op=rr size=1500",
        net: true,
    },
];

/// (label, device options, guest mode)
const RUNGS: &[(&str, &str, &str)] = &[
    ("L0", "rung=L0", "irq"),
    ("L1", "rung=L1", "irq"),
    ("L2", "rung=L2", "irq"),
    ("L4", "rung=L4", "irq"),
    ("L4p", "rung=L4p", "poll"),
    ("L1+coalesce", "rung=L1,coalesce=8:50", "irq"),
];

const DISK_MIB: u64 = 64;

/// `key=value` from the guest's result line (the one starting with `prefix`).
fn field(out: &str, prefix: &str, key: &str) -> Option<f64> {
    let line = out.lines().find(|l| l.starts_with(prefix))?;
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(key).and_then(|v| v.strip_prefix('=')))
        .and_then(|v| v.parse().ok())
}

fn guest_path(name: &str, dir: &Path) -> Result<PathBuf, String> {
    let p = dir.join(format!("{name}.elf"));
    std::fs::write(
        &p,
        lucid_guests::get(name).ok_or(format!("no guest {name}"))?,
    )
    .map_err(|e| e.to_string())?;
    Ok(p)
}

struct LucidRun {
    out: String,
    counters: BTreeMap<String, u64>,
}

fn lucid_run(
    w: &Workload,
    kernel: &Path,
    disk: &Path,
    dev: &str,
    mode: &str,
    count: u64,
    dir: &Path,
) -> Result<LucidRun, String> {
    let serial = dir.join("serial.txt");
    let mut c = VmConfig::new(KernelSource::File(kernel.into()));
    c.cmdline = format!("{} mode={mode} count={count}", w.args);
    c.serial = SerialOutput::File(serial.clone());
    let dev_cfg = if w.net {
        lucid_vmm::parse_net(&format!("backend=echo,{dev}"), 0).map_err(|e| e.to_string())?
    } else {
        lucid_vmm::parse_blk(&format!("path={},{dev}", disk.display()))
            .map_err(|e| e.to_string())?
    };
    c.pci.push(dev_cfg);
    let report = Vm::run(c).map_err(|e| e.to_string())?;
    let out = std::fs::read_to_string(&serial).unwrap_or_default();
    if report.stop != lucid_vmm::StopReason::DebugExit(0) {
        return Err(format!(
            "{} on {dev}: {} — guest said: {out}",
            w.name,
            report.stop_text()
        ));
    }
    Ok(LucidRun {
        out,
        counters: report.counters,
    })
}

fn sum(c: &BTreeMap<String, u64>, pred: impl Fn(&str) -> bool) -> u64 {
    c.iter().filter(|(k, _)| pred(k)).map(|(_, v)| v).sum()
}

fn user_exits(c: &BTreeMap<String, u64>) -> u64 {
    sum(c, |k| k.starts_with("vcpu") && k.ends_with(".exits"))
}

fn kvm_exits(c: &BTreeMap<String, u64>) -> u64 {
    sum(c, |k| k.starts_with("kvm.vcpu") && k.ends_with(".exits"))
}

fn irqs(c: &BTreeMap<String, u64>) -> u64 {
    sum(c, |k| {
        k.contains(".irq.msi_signal") || k.contains(".irq.irqfd") || k.contains(".irq.intx")
    })
}

/// One rung of one workload: ops/s (from the 2N run), and per-I/O figures by difference.
fn measure(
    w: &Workload,
    kernel: &Path,
    disk: &Path,
    dev: &str,
    mode: &str,
    count: u64,
    dir: &Path,
) -> Result<Value, String> {
    let a = lucid_run(w, kernel, disk, dev, mode, count, dir)?;
    let b = lucid_run(w, kernel, disk, dev, mode, 2 * count, dir)?;
    let prefix = if w.net {
        "virtio-net op="
    } else {
        "virtio-blk op="
    };
    let rate_key = if w.net { "pps" } else { "ops_per_s" };
    let ops_per_s =
        field(&b.out, prefix, rate_key).ok_or(format!("no {rate_key} in: {}", b.out))?;
    let n = count as f64;
    let per = |f: fn(&BTreeMap<String, u64>) -> u64| {
        (f(&b.counters) as f64 - f(&a.counters) as f64).max(0.0) / n
    };
    let guest_irqs =
        field(&b.out, prefix, "irqs").unwrap_or(0.0) - field(&a.out, prefix, "irqs").unwrap_or(0.0);
    let guest_kicks = field(&b.out, prefix, "kicks").unwrap_or(0.0)
        - field(&a.out, prefix, "kicks").unwrap_or(0.0);
    Ok(json!({
        "ops_per_s": ops_per_s,
        "exits_per_io": per(user_exits),
        "kvm_exits_per_io": per(kvm_exits),
        "irqs_per_io": per(irqs),
        "guest_irqs_per_io": guest_irqs.max(0.0) / n,
        "guest_kicks_per_io": guest_kicks.max(0.0) / n,
    }))
}

/// Runs `f` `runs` times and returns, for every numeric key, the median.
fn median_of(runs: usize, mut f: impl FnMut() -> Result<Value, String>) -> Result<Value, String> {
    let samples: Vec<Value> = (0..runs).map(|_| f()).collect::<Result<_, _>>()?;
    let mut out = serde_json::Map::new();
    for key in samples[0]
        .as_object()
        .map(|o| o.keys().cloned().collect::<Vec<_>>())
        .unwrap_or_default()
    {
        let mut v: Vec<f64> = samples.iter().filter_map(|s| s[&key].as_f64()).collect();
        v.sort_by(|a, b| a.partial_cmp(b).expect("no NaN"));
        if let Some(m) = v.get(v.len() / 2) {
            out.insert(key, json!(m));
        }
    }
    Ok(Value::Object(out))
}

fn qemu_cmd(
    w: &Workload,
    kernel: &Path,
    disk: &Path,
    count: u64,
    iothread_poll: bool,
    guest_mode: &str,
) -> Command {
    let append = format!("{} mode={guest_mode} count={count}", w.args);
    let mut c = crate::bench::qemu_command(crate::bench::QEMU_Q35, kernel, &append);
    let poll = if iothread_poll { "" } else { ",poll-max-ns=0" };
    c.args(["-object", &format!("iothread,id=io0{poll}")]);
    if w.net {
        // A UDP socket netdev that sends to its own address: every frame comes back (echo).
        let port = 20000 + (std::process::id() % 20000) as u16;
        c.args([
            "-netdev",
            &format!("socket,id=n0,udp=127.0.0.1:{port},localaddr=127.0.0.1:{port}"),
            "-device",
            "virtio-net-pci,netdev=n0,disable-legacy=on",
        ]);
    } else {
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
    c
}

/// QEMU's best of (iothread with adaptive polling, without) x (guest waits for interrupts,
/// guest polls): ops/s.
fn qemu_best(w: &Workload, kernel: &Path, disk: &Path, count: u64) -> Result<f64, String> {
    let mut best: Option<f64> = None;
    let mut last_err = String::new();
    for (poll, mode) in [
        (true, "irq"),
        (false, "irq"),
        (true, "poll"),
        (false, "poll"),
    ] {
        let out = qemu_cmd(w, kernel, disk, 2 * count, poll, mode)
            .output()
            .map_err(|e| format!("qemu-system-x86_64: {e}"))?;
        let text = String::from_utf8_lossy(&out.stdout);
        let prefix = if w.net {
            "virtio-net op="
        } else {
            "virtio-blk op="
        };
        match field(&text, prefix, if w.net { "pps" } else { "ops_per_s" }) {
            Some(v) => best = Some(best.map_or(v, |b: f64| b.max(v))),
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
    if w.net {
        let size = if w.name.ends_with("64") { 64 } else { 1500 };
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

fn svg_plot(results: &Value) -> String {
    let (w, h) = (900.0, 520.0);
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="11">"#
    );
    let _ = writeln!(s, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        s,
        r#"<text x="10" y="18" font-size="14">lucid bench io: ops/s (bars, left axis, log) and userspace exits per I/O (dots, right axis) per rung</text>"#
    );
    let workloads: Vec<&str> = WORKLOADS.iter().map(|w| w.name).collect();
    let panel_w = (w - 60.0) / workloads.len() as f64;
    let (top, bottom) = (40.0, h - 90.0);
    let max_ops = results["workloads"]
        .as_object()
        .map(|m| {
            m.values()
                .flat_map(|v| v["rungs"].as_object().into_iter().flat_map(|r| r.values()))
                .filter_map(|r| r["ops_per_s"].as_f64())
                .fold(1.0, f64::max)
        })
        .unwrap_or(1.0);
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
    for (i, name) in workloads.iter().enumerate() {
        let x0 = 45.0 + i as f64 * panel_w;
        let _ = writeln!(
            s,
            r#"<text x="{}" y="{}" font-size="12">{name}</text>"#,
            x0 + 5.0,
            h - 20.0
        );
        let rungs = &results["workloads"][*name]["rungs"];
        let bar_w = panel_w / (RUNGS.len() as f64 + 1.5);
        for (j, (label, _, _)) in RUNGS.iter().enumerate() {
            let x = x0 + j as f64 * bar_w;
            if let Some(ops) = rungs[*label]["ops_per_s"].as_f64() {
                let y = y_ops(ops);
                let _ = writeln!(
                    s,
                    r##"<rect x="{x}" y="{y}" width="{}" height="{}" fill="#4a7fb5"/>"##,
                    bar_w * 0.8,
                    bottom - y
                );
            }
            if let Some(e) = rungs[*label]["exits_per_io"].as_f64() {
                let _ = writeln!(
                    s,
                    r##"<circle cx="{}" cy="{}" r="3.5" fill="#d0542c"/>"##,
                    x + bar_w * 0.4,
                    y_exits(e)
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
        if let Some(q) = results["workloads"][*name]["qemu_best_ops_per_s"].as_f64() {
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

pub fn run(args: IoArgs) -> Result<ExitCode, String> {
    let dir = std::env::temp_dir().join(format!("lucid-bench-io-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let disk = dir.join("disk.img");
    // A disk with data in it (the page cache holds it for every reader alike).
    let block: Vec<u8> = (0..1 << 20)
        .map(|i: u32| (i.wrapping_mul(2654435761) >> 24) as u8)
        .collect();
    let mut data = Vec::with_capacity((DISK_MIB << 20) as usize);
    for _ in 0..DISK_MIB {
        data.extend_from_slice(&block);
    }
    std::fs::write(&disk, &data).map_err(|e| e.to_string())?;
    let mut all = serde_json::Map::new();
    for w in WORKLOADS {
        let kernel = guest_path(w.guest, &dir)?;
        let mut rungs = serde_json::Map::new();
        for (label, dev, mode) in RUNGS {
            let count = if w.net || *label == "L0" {
                args.count
            } else {
                args.count * 2
            };
            let r = median_of(args.runs.max(1), || {
                measure(w, &kernel, &disk, dev, mode, count, &dir)
            })
            .unwrap_or_else(|e| json!({ "error": e }));
            if !args.json {
                eprintln!("{:<22} {:<12} {}", w.name, label, r);
            }
            rungs.insert(label.to_string(), r);
        }
        let best = rungs
            .values()
            .filter_map(|r| r["ops_per_s"].as_f64())
            .fold(0.0, f64::max);
        let qemu = if args.no_qemu {
            Err("skipped".to_string())
        } else {
            qemu_best(w, &kernel, &disk, args.count)
        };
        let native = native(w, &disk)?;
        let mut entry = json!({
            "rungs": rungs,
            "lucid_best_ops_per_s": best,
            "native_ops_per_s": native,
            "lucid_best_over_native": best / native,
        });
        match qemu {
            Ok(q) => {
                entry["qemu_best_ops_per_s"] = json!(q);
                entry["lucid_best_over_qemu_best"] = json!(best / q);
            }
            Err(e) => entry["qemu_error"] = json!(e),
        }
        all.insert(w.name.to_string(), entry);
    }
    let _ = std::fs::remove_dir_all(&dir);
    let result = json!({ "count": args.count, "workloads": all });
    if let Some(p) = &args.plot {
        std::fs::write(p, svg_plot(&result)).map_err(|e| format!("{}: {e}", p.display()))?;
    }
    if args.json {
        println!("{result}");
    } else {
        println!("lucid bench io (ops/s from inside the guest; exits and interrupts per I/O by difference of N and 2N runs)");
        for w in WORKLOADS {
            let e = &result["workloads"][w.name];
            println!("{}:", w.name);
            for (label, _, _) in RUNGS {
                let r = &e["rungs"][*label];
                match r["ops_per_s"].as_f64() {
                    Some(ops) => println!(
                        "  {label:<12} {ops:>10.0} ops/s  exits/IO {:>6.3}  KVM exits/IO {:>6.2}  irqs/IO {:>5.3}",
                        r["exits_per_io"].as_f64().unwrap_or(f64::NAN),
                        r["kvm_exits_per_io"].as_f64().unwrap_or(f64::NAN),
                        r["irqs_per_io"].as_f64().unwrap_or(f64::NAN)
                    ),
                    None => println!("  {label:<12} error: {}", r["error"]),
                }
            }
            println!(
                "  QEMU best    {}   native {:.0} ops/s   Lucid best / QEMU best {}   Lucid best / native {:.3}",
                e["qemu_best_ops_per_s"].as_f64().map_or(format!("n/a ({})", e["qemu_error"]), |q| format!("{q:.0} ops/s")),
                e["native_ops_per_s"].as_f64().unwrap_or(0.0),
                e["lucid_best_over_qemu_best"].as_f64().map_or("n/a".into(), |r| format!("{r:.2}")),
                e["lucid_best_over_native"].as_f64().unwrap_or(0.0),
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}
