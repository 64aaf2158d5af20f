//! `lucid top`: every VMM on the host whose REST API socket lies in one run directory, live,
//! the way `top` shows processes (docs/api.md). Each interval it asks each socket for
//! `vmm.ping`, `vm.info` and `vm.counters` (Cloud Hypervisor's shape, device -> counter ->
//! value) and shows the counters' rates between the last two samples: exits per second by
//! reason, interrupts, I/O per device and the rung each device runs on, and the vIOMMU, swap
//! and pool state where the VM exports those counters.
//!
//! A socket nothing listens on (a VMM that died without removing it) or one that does not
//! answer in time is listed as skipped; it never stops the others being shown.

use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, FileTypeExt};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use lucid_bench::http::{request, HttpError};
use serde_json::{json, Map, Value};

/// How long one VMM has to answer one request: a VMM busy booting may be slow, but one that
/// hangs must not freeze the display.
const PATIENCE: Duration = Duration::from_secs(2);

#[derive(clap::Args)]
pub struct TopArgs {
    /// The directory whose API sockets (`lucid run --api-socket DIR/NAME.sock`, or
    /// `--api-socket auto`) are polled. Default: $LUCID_RUN_DIR if set, else /run/lucid for
    /// root, else $XDG_RUNTIME_DIR/lucid.
    #[arg(long, value_name = "DIR")]
    run_dir: Option<PathBuf>,
    /// One snapshot (the rates over two samples one interval apart), then exit.
    #[arg(long)]
    once: bool,
    /// One JSON object per snapshot, one line each, instead of the display.
    #[arg(long)]
    json: bool,
    /// Seconds between samples.
    #[arg(long, value_name = "SECS", default_value_t = 1.0, value_parser = interval)]
    interval: f64,
}

fn interval(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if (0.05..=3600.0).contains(&v) => Ok(v),
        _ => Err(format!("{s:?}: give seconds from 0.05 to 3600")),
    }
}

/// Why `lucid top` stopped.
#[derive(Debug, thiserror::Error)]
pub enum TopError {
    #[error(
        "cannot read the run directory {path} (VMMs are found by their API sockets there: \
         `lucid run --api-socket {path}/NAME.sock`)",
        path = .path.display()
    )]
    RunDir {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("--api-socket auto: cannot create the run directory {path}", path = .path.display())]
    RunDirCreate {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot write to standard output")]
    Stdout(#[source] std::io::Error),
}

/// The environment variable that overrides [`default_run_dir`] (tests, or VMMs grouped apart).
pub const RUN_DIR_ENV: &str = "LUCID_RUN_DIR";

/// Where `lucid top` looks by default and `--api-socket auto` puts its socket: `$LUCID_RUN_DIR`
/// when set, else /run/lucid for root (system VMMs), else the user's runtime directory.
pub fn default_run_dir() -> PathBuf {
    if let Some(d) = std::env::var_os(RUN_DIR_ENV).filter(|d| !d.is_empty()) {
        return PathBuf::from(d);
    }
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    match std::env::var_os("XDG_RUNTIME_DIR") {
        Some(d) if !root && !d.is_empty() => PathBuf::from(d).join("lucid"),
        // SAFETY: as above.
        _ if !root => PathBuf::from(format!("/run/user/{}/lucid", unsafe { libc::geteuid() })),
        _ => PathBuf::from("/run/lucid"),
    }
}

/// The `--api-socket` value that picks the socket's path itself ([`api_socket_path`]).
pub const AUTO_SOCKET: &str = "auto";

/// The path `lucid run --api-socket` serves on: `auto` means `lucid-<pid>.sock` in
/// [`default_run_dir`] (created, mode 0700, if missing), where `lucid top` finds it; any other
/// value is the path itself.
pub fn api_socket_path(given: &Path) -> Result<PathBuf, TopError> {
    if given != Path::new(AUTO_SOCKET) {
        return Ok(given.to_path_buf());
    }
    let dir = default_run_dir();
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(&dir)
        .map_err(|source| TopError::RunDirCreate {
            path: dir.clone(),
            source,
        })?;
    let path = dir.join(format!("lucid-{}.sock", std::process::id()));
    log::info!("--api-socket auto: serving on {}", path.display());
    Ok(path)
}

/// One VMM's answers at one moment.
struct Sample {
    at: Instant,
    pid: Option<u64>,
    /// `vm.info`, or `None` when no VM is created.
    info: Option<Value>,
    /// `vm.counters` flattened to Lucid's dotted names (`blk0.requests`).
    counters: BTreeMap<String, u64>,
}

/// The API sockets in `dir`, by name; `Ok(None)` when `dir` does not exist.
fn sockets(dir: &Path) -> Result<Option<Vec<PathBuf>>, TopError> {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => {
            return Err(TopError::RunDir {
                path: dir.into(),
                source,
            })
        }
    };
    let mut out: Vec<PathBuf> = entries
        .flatten()
        .filter(|e| e.file_type().is_ok_and(|t| t.is_socket()))
        .map(|e| e.path())
        .collect();
    out.sort();
    Ok(Some(out))
}

/// Why a socket was skipped, for its note.
fn skip_reason(e: &HttpError) -> String {
    match e {
        HttpError::Connect { source, .. }
            if source.kind() == std::io::ErrorKind::ConnectionRefused =>
        {
            "stale: nothing listens on it (a VMM that ended without removing it)".into()
        }
        e => lucid_vmm::error_chain(e),
    }
}

fn sample(socket: &Path) -> Result<Sample, String> {
    let get = |what: &str| {
        request(socket, "GET", &format!("/api/v1/{what}"), None, PATIENCE)
            .map_err(|e| skip_reason(&e))
    };
    let ping = get("vmm.ping")?;
    if !ping.ok() {
        return Err(format!(
            "not a Lucid or Cloud Hypervisor API: vmm.ping answered {}",
            ping.status
        ));
    }
    let info = get("vm.info")?;
    let info = info.ok().then(|| info.json());
    let mut counters = BTreeMap::new();
    if info.is_some() {
        let c = get("vm.counters")?;
        if let Value::Object(devs) = c.json() {
            for (dev, cs) in devs {
                for (name, v) in cs.as_object().into_iter().flatten() {
                    if let Some(v) = v.as_u64() {
                        counters.insert(format!("{dev}.{name}"), v);
                    }
                }
            }
        }
    }
    Ok(Sample {
        at: Instant::now(),
        pid: ping.json()["pid"].as_u64(),
        info,
        counters,
    })
}

/// Rates between two samples of one VMM.
struct Rates<'a> {
    prev: &'a Sample,
    cur: &'a Sample,
    secs: f64,
}

impl Rates<'_> {
    fn now(&self, k: &str) -> Option<u64> {
        self.cur.counters.get(k).copied()
    }

    /// Per second; a counter that went down (a new VM) counts from zero.
    fn rate(&self, k: &str) -> f64 {
        let now = self.now(k).unwrap_or(0);
        let before = self.prev.counters.get(k).copied().unwrap_or(0);
        let delta = match now >= before {
            true => now - before,
            false => now,
        };
        delta as f64 / self.secs
    }

    /// The rates of the counters `f` names (a group key per counter, or none), summed by key.
    fn summed(&self, f: impl Fn(&str) -> Option<String>) -> BTreeMap<String, f64> {
        let mut out = BTreeMap::new();
        for k in self.cur.counters.keys() {
            if let Some(key) = f(k) {
                *out.entry(key).or_insert(0.0) += self.rate(k);
            }
        }
        out
    }
}

/// `rest` of `vcpuN.rest` (a per-vCPU counter), under `prefix` (`""` or `kvm.`).
fn per_vcpu<'a>(k: &'a str, prefix: &str) -> Option<&'a str> {
    let k = k.strip_prefix(prefix)?.strip_prefix("vcpu")?;
    let (n, rest) = k.split_once('.')?;
    n.bytes().all(|b| b.is_ascii_digit()).then_some(rest)
}

/// The rung's name from its counter (`lucid_pci::ladder::Rung::code`).
fn rung_name(code: u64) -> String {
    match code {
        0..=4 => format!("L{code}"),
        5 => "L4p".into(),
        c => format!("rung {c}"),
    }
}

fn swap_mode_name(code: u64) -> String {
    match code {
        0 => "baseline".into(),
        1 => "mapper".into(),
        2 => "vswapper".into(),
        c => format!("mode {c}"),
    }
}

fn label_name(code: u64) -> &'static str {
    match code {
        1 => "cpu",
        2 => "io",
        _ => "unknown",
    }
}

/// Nonzero rates only, rounded to a tenth.
fn nonzero(m: BTreeMap<String, f64>) -> Map<String, Value> {
    m.into_iter()
        .filter(|(_, v)| *v > 0.0)
        .map(|(k, v)| (k, json!(round(v))))
        .collect()
}

fn round(v: f64) -> f64 {
    (v * 10.0).round() / 10.0
}

/// One VM's block, as JSON (the display is drawn from it).
fn vm_view(socket: &Path, r: &Rates) -> Value {
    let name = socket
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    let info = r.cur.info.as_ref();
    let state = info
        .and_then(|i| i["state"].as_str())
        .unwrap_or("NotCreated");
    let config = info.map(|i| &i["config"]);
    let mut v = json!({
        "name": name,
        "socket": socket,
        "pid": r.cur.pid,
        "state": state,
        "vcpus": config.and_then(|c| c["cpus"]["boot_vcpus"].as_u64()).unwrap_or(1),
        "memory_mib": info.and_then(|i| i["memory_actual_size"].as_u64()).map(|b| b >> 20),
        "interval_s": round(r.secs * 10.0) / 10.0,
    });
    if r.cur.counters.is_empty() {
        return v;
    }
    let exits = r.summed(|k| per_vcpu(k, "").filter(|&c| c == "exits").map(Into::into));
    v["exits_per_s"] = json!(round(exits.values().sum()));
    v["exits_by_reason_per_s"] = Value::Object(nonzero(
        r.summed(|k| per_vcpu(k, "")?.strip_prefix("exit.").map(Into::into)),
    ));
    // KVM's own counts: every exit, including those KVM handles without Lucid.
    if r.cur.counters.keys().any(|k| per_vcpu(k, "kvm.").is_some()) {
        let kvm = r.summed(|k| {
            per_vcpu(k, "kvm.")
                .filter(|&c| c == "exits")
                .map(Into::into)
        });
        v["kvm_exits_per_s"] = json!(round(kvm.values().sum()));
        v["kvm_exits_by_reason_per_s"] =
            Value::Object(nonzero(r.summed(|k| {
                per_vcpu(k, "kvm.")?.strip_suffix("_exits").map(Into::into)
            })));
    }
    let device_irqs = r.summed(|k| {
        let (dev, c) = k.split_once('.')?;
        (c == "irqs").then(|| dev.into())
    });
    let injected = r.summed(|k| {
        per_vcpu(k, "kvm.")
            .filter(|&c| c == "irq_injections")
            .map(Into::into)
    });
    v["interrupts_per_s"] = json!(round(match injected.is_empty() {
        true => device_irqs.values().sum(),
        false => injected.values().sum(),
    }));
    v["interrupts_by_device_per_s"] = Value::Object(nonzero(device_irqs));

    // Devices: the virtio functions, each with its rung.
    let mut devices = Map::new();
    for k in r.cur.counters.keys() {
        let Some(dev) = k.strip_suffix(".rung") else {
            continue;
        };
        let sum = |names: &[&str]| -> f64 {
            names
                .iter()
                .map(|n| r.rate(&format!("{dev}.{n}")))
                .sum::<f64>()
        };
        devices.insert(
            dev.into(),
            json!({
                "rung": rung_name(r.now(k).unwrap_or(0)),
                "ops_per_s": round(sum(&["requests", "rx_packets", "tx_packets"])),
                "bytes_per_s": round(sum(&["bytes_read", "bytes_written", "rx_bytes", "tx_bytes"])),
                "kicks_per_s": round(sum(&["kicks"])),
                "irqs_per_s": round(sum(&["irqs"])),
            }),
        );
    }
    v["devices"] = Value::Object(devices);
    v["serial_bytes_per_s"] = json!(round(r.rate("serial.tx_bytes") + r.rate("serial.rx_bytes")));

    if r.cur.counters.keys().any(|k| k.starts_with("iommu.")) {
        let sum = |names: &[&str]| round(names.iter().map(|n| r.rate(n)).sum());
        let inv = r.summed(|k| k.starts_with("iommu.inv.").then(|| "inv".into()));
        v["iommu"] = json!({
            "maps_per_s": sum(&["iommu.maps"]),
            "unmaps_per_s": sum(&["iommu.unmaps"]),
            "iotlb_hits_per_s": sum(&["iommu.iotlb.hits"]),
            "iotlb_misses_per_s": sum(&["iommu.iotlb.misses"]),
            "invalidations_per_s": round(inv.values().sum()),
            "faults_per_s": sum(&["iommu.faults.dma", "iommu.faults.ir"]),
            "pinned_pages": r.now("iommu.pinned.current"),
            "stale_mappings": r.now("iommu.stale.current"),
        });
    }
    if let Some(mode) = r.now("swap.mode") {
        v["swap"] = json!({
            "mode": swap_mode_name(mode),
            "limit_bytes": r.now("swap.limit_bytes"),
            "usage_bytes": r.now("swap.cgroup.usage_bytes"),
            "swap_in_pages_per_s": round(r.rate("swap.host.pswpin")),
            "swap_out_pages_per_s": round(r.rate("swap.host.pswpout")),
            "major_faults_per_s": round(r.rate("swap.host.majflt")),
            "mapped_pages": r.now("swap.mapper.mapped_pages"),
        });
    }
    if let Some(current) = r.now("pools.current") {
        v["pool"] = json!({
            "current": current,
            "label": r.now("monitor.label").map(label_name),
            "moves": r.now("monitor.moves"),
            "boosted": r.now("pools.boosted"),
            "low_noise": r.now("pools.low_noise").map(|n| n != 0),
        });
    } else if r.now("pools.low_noise").is_some() {
        v["pool"] = json!({"low_noise": true});
    }
    v
}

/// One snapshot of every VMM: the sockets with two samples, and the skipped ones.
fn snapshot(
    dir: &Path,
    last: &mut HashMap<PathBuf, Sample>,
    secs_wanted: f64,
) -> Result<Value, TopError> {
    let mut vms = Vec::new();
    let mut skipped = Vec::new();
    let mut notes = Vec::new();
    let found = sockets(dir)?;
    if found.is_none() {
        notes.push(format!("{} does not exist: no VMMs", dir.display()));
    }
    let found = found.unwrap_or_default();
    last.retain(|p, _| found.contains(p));
    for socket in found {
        match sample(&socket) {
            Ok(cur) => {
                let prev = last.remove(&socket).filter(|p| p.pid == cur.pid);
                if let Some(prev) = &prev {
                    let secs = (cur.at - prev.at).as_secs_f64().max(secs_wanted / 100.0);
                    vms.push(vm_view(
                        &socket,
                        &Rates {
                            prev,
                            cur: &cur,
                            secs,
                        },
                    ));
                }
                last.insert(socket, cur);
            }
            Err(reason) => {
                last.remove(&socket);
                skipped.push(json!({"socket": socket, "reason": reason}));
            }
        }
    }
    Ok(json!({
        "run_dir": dir,
        "vms": vms,
        "skipped": skipped,
        "notes": notes,
    }))
}

/// A rate for the display: 12, 3.4k, 5.6M.
fn si(v: f64) -> String {
    match v {
        v if v >= 1e9 => format!("{:.1}G", v / 1e9),
        v if v >= 1e6 => format!("{:.1}M", v / 1e6),
        v if v >= 1e4 => format!("{:.1}k", v / 1e3),
        v if v == v.trunc() => format!("{v:.0}"),
        v => format!("{v:.1}"),
    }
}

fn f(v: &Value) -> f64 {
    v.as_f64().unwrap_or(0.0)
}

/// `a 12, b 3.4k` of a map of rates, largest first.
fn by(m: &Value) -> String {
    let mut items: Vec<(&String, f64)> = m
        .as_object()
        .into_iter()
        .flatten()
        .map(|(k, v)| (k, f(v)))
        .collect();
    items.sort_by(|a, b| b.1.total_cmp(&a.1));
    items
        .iter()
        .map(|(k, v)| format!("{k} {}", si(*v)))
        .collect::<Vec<_>>()
        .join(", ")
}

fn display(snap: &Value) -> String {
    let mut s = String::new();
    let vms = snap["vms"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default();
    s += &format!(
        "lucid top: {} VMM(s) in {}\n",
        vms.len(),
        snap["run_dir"].as_str().unwrap_or_default()
    );
    for v in vms {
        s += &format!(
            "\n{}  pid {}  {}  {} vCPU  {}\n",
            v["name"].as_str().unwrap_or_default(),
            v["pid"],
            v["state"].as_str().unwrap_or_default(),
            v["vcpus"],
            match v["memory_mib"].as_u64() {
                Some(m) => format!("{m} MiB"),
                None => "no VM created".into(),
            }
        );
        if v.get("exits_per_s").is_none() {
            continue;
        }
        s += &format!(
            "  exits/s   {:>8}  to Lucid: {}\n",
            si(f(&v["exits_per_s"])),
            by(&v["exits_by_reason_per_s"])
        );
        if v.get("kvm_exits_per_s").is_some() {
            s += &format!(
                "            {:>8}  in KVM:   {}\n",
                si(f(&v["kvm_exits_per_s"])),
                by(&v["kvm_exits_by_reason_per_s"])
            );
        }
        s += &format!(
            "  irqs/s    {:>8}  {}\n",
            si(f(&v["interrupts_per_s"])),
            by(&v["interrupts_by_device_per_s"])
        );
        for (name, d) in v["devices"].as_object().into_iter().flatten() {
            s += &format!(
                "  {name:<9} {:<4} ops/s {:>7}  B/s {:>7}  kicks/s {:>7}  irqs/s {:>7}\n",
                d["rung"].as_str().unwrap_or_default(),
                si(f(&d["ops_per_s"])),
                si(f(&d["bytes_per_s"])),
                si(f(&d["kicks_per_s"])),
                si(f(&d["irqs_per_s"]))
            );
        }
        if let Some(i) = v.get("iommu") {
            s += &format!(
                "  iommu     maps/s {}  unmaps/s {}  iotlb hit/miss/s {}/{}  inv/s {}  faults/s {}  pinned {} pages  stale {}\n",
                si(f(&i["maps_per_s"])),
                si(f(&i["unmaps_per_s"])),
                si(f(&i["iotlb_hits_per_s"])),
                si(f(&i["iotlb_misses_per_s"])),
                si(f(&i["invalidations_per_s"])),
                si(f(&i["faults_per_s"])),
                i["pinned_pages"],
                i["stale_mappings"]
            );
        }
        if let Some(w) = v.get("swap") {
            let mib = |x: &Value| match x.as_u64() {
                Some(b) => format!("{} MiB", b >> 20),
                None => "-".into(),
            };
            s += &format!(
                "  swap      {}  limit {}  usage {}  in/s {}  out/s {}  majflt/s {}\n",
                w["mode"].as_str().unwrap_or_default(),
                mib(&w["limit_bytes"]),
                mib(&w["usage_bytes"]),
                si(f(&w["swap_in_pages_per_s"])),
                si(f(&w["swap_out_pages_per_s"])),
                si(f(&w["major_faults_per_s"]))
            );
        }
        if let Some(p) = v.get("pool") {
            s += &format!(
                "  pool      #{}  label {}  moves {}  boosted {}  low-noise {}\n",
                p["current"],
                p["label"].as_str().unwrap_or("-"),
                p["moves"],
                p["boosted"],
                p["low_noise"]
            );
        }
    }
    for k in snap["skipped"].as_array().into_iter().flatten() {
        s += &format!(
            "\nskipped {}: {}\n",
            k["socket"].as_str().unwrap_or_default(),
            k["reason"].as_str().unwrap_or_default()
        );
    }
    for n in snap["notes"].as_array().into_iter().flatten() {
        s += &format!("\n{}\n", n.as_str().unwrap_or_default());
    }
    // An empty by-reason list leaves a line's padding behind.
    s.lines().map(|l| l.trim_end().to_string() + "\n").collect()
}

pub fn run(args: TopArgs) -> Result<ExitCode, TopError> {
    let dir = args.run_dir.clone().unwrap_or_else(default_run_dir);
    let every = Duration::from_secs_f64(args.interval);
    let mut last = HashMap::new();
    // SAFETY: isatty on fd 1 has no preconditions.
    let tty = unsafe { libc::isatty(1) } == 1;
    // The first sample has nothing to take rates against.
    snapshot(&dir, &mut last, args.interval)?;
    loop {
        std::thread::sleep(every);
        let snap = snapshot(&dir, &mut last, args.interval)?;
        let text = match args.json {
            true => format!("{snap}\n"),
            // Home and clear, as top redraws.
            false if tty && !args.once => format!("\x1b[H\x1b[2J{}", display(&snap)),
            false => display(&snap),
        };
        let mut out = std::io::stdout().lock();
        out.write_all(text.as_bytes())
            .and_then(|()| out.flush())
            .map_err(TopError::Stdout)?;
        if args.once {
            return Ok(ExitCode::SUCCESS);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(at: Instant, counters: &[(&str, u64)]) -> Sample {
        Sample {
            at,
            pid: Some(1),
            info: Some(
                json!({"state": "Running", "config": {}, "memory_actual_size": 256u64 << 20}),
            ),
            counters: counters.iter().map(|(k, v)| (k.to_string(), *v)).collect(),
        }
    }

    #[test]
    fn rates_by_reason_device_and_rung() {
        let t = Instant::now();
        let prev = sample(
            t,
            &[
                ("vcpu0.exits", 100),
                ("vcpu0.exit.io_out", 90),
                ("vcpu1.exits", 0),
                ("vcpu1.exit.io_out", 0),
                ("kvm.vcpu0.exits", 1000),
                ("kvm.vcpu0.io_exits", 90),
                ("kvm.vcpu0.irq_injections", 5),
                ("blk0.rung", 5),
                ("blk0.requests", 10),
                ("blk0.bytes_read", 4096),
                ("blk0.irqs", 3),
                ("swap.mode", 2),
                ("swap.limit_bytes", 64 << 20),
            ],
        );
        let cur = sample(
            t + Duration::from_secs(2),
            &[
                ("vcpu0.exits", 300),
                ("vcpu0.exit.io_out", 290),
                ("vcpu1.exits", 100),
                ("vcpu1.exit.io_out", 100),
                ("kvm.vcpu0.exits", 3000),
                ("kvm.vcpu0.io_exits", 290),
                ("kvm.vcpu0.irq_injections", 25),
                ("blk0.rung", 5),
                ("blk0.requests", 30),
                ("blk0.bytes_read", 4096 * 21),
                ("blk0.irqs", 13),
                ("swap.mode", 2),
                ("swap.limit_bytes", 64 << 20),
            ],
        );
        let r = Rates {
            prev: &prev,
            cur: &cur,
            secs: 2.0,
        };
        let v = vm_view(Path::new("/run/lucid/a.sock"), &r);
        assert_eq!(v["name"], "a");
        assert_eq!(v["state"], "Running");
        assert_eq!(v["exits_per_s"], 150.0);
        assert_eq!(v["exits_by_reason_per_s"], json!({"io_out": 150.0}));
        assert_eq!(v["kvm_exits_per_s"], 1000.0);
        assert_eq!(v["kvm_exits_by_reason_per_s"], json!({"io": 100.0}));
        assert_eq!(v["interrupts_per_s"], 10.0);
        assert_eq!(v["devices"]["blk0"]["rung"], "L4p");
        assert_eq!(v["devices"]["blk0"]["ops_per_s"], 10.0);
        assert_eq!(v["devices"]["blk0"]["bytes_per_s"], 40960.0);
        assert_eq!(v["swap"]["mode"], "vswapper");
        assert!(v.get("iommu").is_none() && v.get("pool").is_none());
        assert!(
            display(&json!({"run_dir": "/d", "vms": [v], "skipped": [], "notes": []}))
                .contains("blk0      L4p")
        );
    }

    #[test]
    fn a_stale_socket_is_skipped_with_a_note() {
        let dir = std::env::temp_dir().join(format!("lucid-top-unit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("dead.sock");
        let _ = std::fs::remove_file(&path);
        drop(std::os::unix::net::UnixListener::bind(&path).unwrap());
        std::fs::write(dir.join("not-a-socket.sock"), b"x").unwrap();
        let snap = snapshot(&dir, &mut HashMap::new(), 1.0).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(snap["vms"], json!([]));
        let skipped = snap["skipped"].as_array().unwrap();
        assert_eq!(skipped.len(), 1, "{snap}");
        assert!(skipped[0]["reason"].as_str().unwrap().contains("stale"));
    }
}
