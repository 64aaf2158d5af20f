//! `lucid bench iommu`'s assigned devices: a device served by `lucid device-server` in a process
//! of its own and assigned to the guest over vfio-user, so that only the mappings Lucid sends it
//! (`DMA_MAP`/`DMA_UNMAP`, each an `mmap`/`munmap` in the device process) let it reach guest
//! memory: the vIOMMU paper's premise. Two devices, each with no IOMMU ("off") and behind the
//! VT-d in each mode with each mapping strategy, side by side in one run:
//! - `blk`: virtio-blk over PCI (`lucid device-server blk`), the virtio-blk probe guest's 4 KiB
//!   random reads at QD1 (the `blk-randread-4k-qd1` workload); the goal keys come from it;
//! - `edu`: QEMU's edu (`lucid device-server edu`), the `edu` guest's DMA round trips (map, DMA
//!   to the device, unmap, map, DMA back, unmap).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use lucid_iommu::{EmulationMode, PinPolicy, VtdConfig};
use lucid_vmm::config::{Backing, UserDeviceConfig};
use lucid_vmm::{KernelSource, SerialOutput, StopReason, Vm, VmConfig};
use serde_json::{json, Value};

/// One setup: no IOMMU (`mode` None) or a mode with a guest strategy.
pub(crate) type Setup = (Option<EmulationMode>, &'static str);

/// An assigned device and the guest that drives it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Device {
    Blk,
    Edu,
}

impl Device {
    pub(crate) const ALL: [Device; 2] = [Device::Blk, Device::Edu];

    fn name(self) -> &'static str {
        match self {
            Device::Blk => "blk",
            Device::Edu => "edu",
        }
    }

    fn guest(self) -> &'static str {
        match self {
            Device::Blk => "virtio-blk",
            Device::Edu => "edu",
        }
    }

    /// The guest's command line for `count` operations, and its result line and rate key.
    fn cmdline(self, count: u64) -> String {
        match self {
            Device::Blk => format!("op=read pattern=rand bs=4096 qd=1 mode=irq count={count}"),
            Device::Edu => format!("rounds={count}"),
        }
    }

    fn rate(self) -> (&'static str, &'static str) {
        match self {
            Device::Blk => ("virtio-blk op=", "ops_per_s"),
            Device::Edu => ("edu dma ", "rounds_per_s"),
        }
    }
}

/// Each setup with its best run, or why every run failed.
pub(crate) type Row = Vec<(Setup, Result<Figures, String>)>;

/// What one run gave.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub(crate) struct Figures {
    pub ops_per_s: f64,
    /// `DMA_MAP`/`DMA_UNMAP` messages Lucid sent per round trip.
    pub dma_maps_per_op: f64,
    pub dma_unmaps_per_op: f64,
    pub pinned_peak: u64,
    pub faults: u64,
}

/// The device server, killed when dropped.
struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn start_server(d: Device, socket: &Path, disk: &Path) -> Result<Server, String> {
    let _ = std::fs::remove_file(socket);
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut cmd = Command::new(exe);
    cmd.args(["device-server", d.name(), "--socket"])
        .arg(socket);
    if d == Device::Blk {
        cmd.arg("--disk").arg(disk);
    }
    let child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("lucid device-server {}: {e}", d.name()))?;
    let mut server = Server(child);
    let start = Instant::now();
    while !socket.exists() {
        if let Ok(Some(st)) = server.0.try_wait() {
            return Err(format!("lucid device-server {} exited: {st}", d.name()));
        }
        if start.elapsed() > Duration::from_secs(10) {
            return Err(format!(
                "lucid device-server {}: no socket after 10 s",
                d.name()
            ));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    Ok(server)
}

fn field<'a>(out: &'a str, line: &str, key: &str) -> Option<&'a str> {
    let l = out.lines().find(|l| l.starts_with(line))?;
    let k = format!("{key}=");
    l.split_whitespace()
        .find_map(|w| w.strip_prefix(k.as_str()))
}

/// One run of `count` operations on device `d` in setup `s`.
fn run(
    d: Device,
    s: Setup,
    kernel: &Path,
    count: u64,
    dir: &Path,
    disk: &Path,
) -> Result<Figures, String> {
    let socket = dir.join(format!("{}.sock", d.name()));
    let _server = start_server(d, &socket, disk)?;
    let serial = dir.join("assigned-serial.txt");
    let mut c = VmConfig::new(KernelSource::File(kernel.into()));
    c.machine.backing = Backing::SharedMemfd;
    c.devices.serial = SerialOutput::File(serial.clone());
    c.devices.user_devices.push(UserDeviceConfig {
        socket: socket.clone(),
        id: Some(d.name().into()),
    });
    c.payload.cmdline = d.cmdline(count);
    if let (Some(mode), strategy) = s {
        c.payload.cmdline += &format!(" iommu=vtd strategy={strategy}");
        c.iommu = Some(VtdConfig {
            mode,
            pin: PinPolicy::Map,
        });
    }
    let report = Vm::run(c).map_err(|e| lucid_vmm::error_chain(&e))?;
    let out = std::fs::read_to_string(&serial).unwrap_or_default();
    let label = format!("{} {}", d.name(), label(s));
    // The guests exit 0 when every check passed.
    if report.stop != StopReason::DebugExit(0) {
        return Err(format!(
            "assigned {label}: {} — guest said: {out}",
            report.stop_text()
        ));
    }
    let (line, key) = d.rate();
    let ops_per_s: f64 = field(&out, line, key)
        .and_then(|v| v.parse().ok())
        .ok_or(format!("assigned {label}: no {key} in: {out}"))?;
    let k = &report.counters;
    let get = |n: &str| k.get(n).copied().unwrap_or(0);
    let per_op = |n: &str| get(n) as f64 / count.max(1) as f64;
    let dev = d.name();
    Ok(Figures {
        ops_per_s,
        dma_maps_per_op: per_op(&format!("user_device.{dev}.dma_maps")),
        dma_unmaps_per_op: per_op(&format!("user_device.{dev}.dma_unmaps")),
        pinned_peak: get("iommu.pinned.peak"),
        faults: get("iommu.faults.dma"),
    })
}

pub(crate) fn label(s: Setup) -> String {
    match s {
        (None, _) => "off".into(),
        (Some(EmulationMode::Samecore), t) => format!("samecore/{t}"),
        (Some(EmulationMode::Sidecore), t) => format!("sidecore/{t}"),
    }
}

/// Every setup on device `d`, best of `runs` each; an `Err` cell says why every run failed.
pub(crate) fn measure(
    d: Device,
    setups: &[Setup],
    count: u64,
    runs: usize,
    dir: &Path,
    disk: &Path,
) -> Result<Row, String> {
    let kernel: PathBuf = crate::io::guest_path(d.guest(), dir)?;
    let mut row = Vec::new();
    for &s in setups {
        let mut best: Option<Figures> = None;
        let mut err = String::new();
        for _ in 0..runs.max(1) {
            match run(d, s, &kernel, count, dir, disk) {
                Ok(f) if best.as_ref().is_none_or(|b| f.ops_per_s > b.ops_per_s) => best = Some(f),
                Ok(_) => {}
                Err(e) => err = e,
            }
        }
        match &best {
            Some(f) => log::info!(
                "assigned edu {:<22} {:.0} round trips/s",
                label(s),
                f.ops_per_s
            ),
            None => log::warn!("assigned edu {:<22} {err}", label(s)),
        }
        row.push((s, best.ok_or(err)));
    }
    Ok(row)
}

fn over_off(row: &Row, s: Setup) -> Option<f64> {
    let off = row.iter().find(|(x, _)| x.0.is_none())?.1.as_ref().ok()?;
    let this = row.iter().find(|(x, _)| *x == s)?.1.as_ref().ok()?;
    (off.ops_per_s > 0.0).then(|| this.ops_per_s / off.ops_per_s)
}

/// The best of both modes for the strategies named.
fn best_over_off(row: &Row, strategies: &[&str]) -> Option<f64> {
    row.iter()
        .filter(|(s, _)| s.0.is_some() && strategies.contains(&s.1))
        .filter_map(|(s, _)| over_off(row, *s))
        .fold(None, |a: Option<f64>, b| Some(a.map_or(b, |a| a.max(b))))
}

fn cells(row: &Row) -> Value {
    let mut cells = serde_json::Map::new();
    for (s, c) in row {
        let v = match c {
            Ok(f) => {
                let mut v = json!(f);
                v["over_off"] = json!(over_off(row, *s));
                v
            }
            Err(e) => json!({ "error": e }),
        };
        cells.insert(label(*s), v);
    }
    Value::Object(cells)
}

fn show(x: Option<f64>) -> String {
    x.map_or("-".into(), |r| format!("{r:.2}"))
}

/// The goal keys (from the block device) and the tables, for `--json`.
pub(crate) fn to_json(rows: &[(Device, Row)], count: u64) -> Value {
    let blk = rows.iter().find(|(d, _)| *d == Device::Blk).map(|(_, r)| r);
    let mut devices = serde_json::Map::new();
    for (d, row) in rows {
        devices.insert(
            d.name().into(),
            json!({
                "teardown_over_off": best_over_off(row, &["teardown256", "teardown4096"]),
                "strict_over_off": best_over_off(row, &["strict"]),
                "setups": cells(row),
            }),
        );
    }
    json!({
        "assigned_teardown_over_off": blk.and_then(|r| best_over_off(r, &["teardown256", "teardown4096"])),
        "assigned_strict_over_off": blk.and_then(|r| best_over_off(r, &["strict"])),
        "assigned": {
            "server": "lucid device-server, vfio-user",
            "count": count,
            "blk_workload": "op=read pattern=rand bs=4096 qd=1",
            "devices": devices,
        },
    })
}

pub(crate) fn print(rows: &[(Device, Row)]) {
    for (d, row) in rows {
        println!(
            "assigned {} (out of process, vfio-user): ops/s as a fraction of off; \
             DMA_MAP/DMA_UNMAP messages per operation",
            d.name()
        );
        for (s, c) in row {
            match c {
                Ok(f) => println!(
                    "  {:<22} {:>9.0}/s {:>6} maps {:.2} unmaps {:.2} pinned_peak {}",
                    label(*s),
                    f.ops_per_s,
                    show(over_off(row, *s)),
                    f.dma_maps_per_op,
                    f.dma_unmaps_per_op,
                    f.pinned_peak
                ),
                Err(e) => println!("  {:<22} failed: {e}", label(*s)),
            }
        }
        println!(
            "  {}: teardown_over_off {}  strict_over_off {}",
            d.name(),
            show(best_over_off(row, &["teardown256", "teardown4096"])),
            show(best_over_off(row, &["strict"]))
        );
    }
    let blk = rows.iter().find(|(d, _)| *d == Device::Blk).map(|(_, r)| r);
    println!(
        "assigned_teardown_over_off {} (goal >= 0.9)  assigned_strict_over_off {}",
        show(blk.and_then(|r| best_over_off(r, &["teardown256", "teardown4096"]))),
        show(blk.and_then(|r| best_over_off(r, &["strict"])))
    );
}
