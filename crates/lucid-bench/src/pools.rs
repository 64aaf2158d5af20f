//! `lucid bench pools`: co-existing scheduling policies measured on this host
//! (docs/scheduling.md).
//!
//! For N = 1..4, N I/O guests (`stream` over virtio-net into a sink paced to the link rate) and
//! N CPU guests (`cpu`) run as separate `lucid run` processes under each configuration:
//! - **D**: everything default (SCHED_OTHER, any CPU);
//! - **P2**: the back-ends alone on the last CPU (no-op pool: SCHED_FIFO), every vCPU on the
//!   others;
//! - **P3′**: the last CPU holds the back-ends (FIFO) and the I/O vCPUs (`io` policy), the others
//!   the CPU vCPUs (`cpu` policy: SCHED_BATCH);
//! - **PS**: the policies without partitioning (no CPU sets).
//!
//! P2 and P3′ use `lucid pools create/destroy` and `lucid run --pool NAME` (a pools state
//! directory and cgroup root unique to this run); PS applies the policies to the threads by name
//! (pools are CPU sets and cannot express "policies only"); `--manual` does the same placement
//! for P2 and P3′ (affinity + policy by thread name), for hosts or builds without pools.
//!
//! The link is shared: each of the N I/O guests gets a sink of `rate/N` Mbit/s (a real shared
//! NIC would let one guest use another's idle share; these do not). Figures: link utilisation
//! (the I/O guests' bytes per second over the link rate), CPU passes per second (and over the
//! native capacity: the host twin's passes per second per core × cores), ms lost per MB both
//! ways (from each VM's `monitor.*` figures in `--stats-json` when the VMM has the monitor, and
//! always from the bench's own `schedstat` samples of the VMs' threads: back-end run-queue wait
//! per MB for guest → back-end, I/O vCPUs' wait per MB for back-end → guest), and the low-noise
//! probe (`noise` under `--low-noise` against `noise-host` on the same CPU).
//!
//! A figure that cannot be measured (no pools in this build, no `--low-noise`, too few CPUs) is
//! `null` in the JSON with the reason in `missing`.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use crate::field;
use serde_json::{json, Map, Value};

#[derive(clap::Args)]
pub struct PoolsArgs {
    #[arg(long)]
    json: bool,
    /// A smoke run: N = 1 only, 1 s per point, a short noise probe.
    #[arg(long)]
    quick: bool,
    /// Seconds each guest runs per point.
    #[arg(long, default_value_t = 5)]
    seconds: u64,
    /// Largest N (N I/O + N CPU guests).
    #[arg(long, default_value_t = 4)]
    max_n: u32,
    /// The link rate in Mbit/s, shared by the I/O guests.
    #[arg(long, default_value_t = 1000)]
    rate: u64,
    /// Place threads from the bench (affinity and policy by thread name) instead of `lucid
    /// pools` / `--pool` / `--low-noise`.
    #[arg(long)]
    manual: bool,
    /// Configurations to run (comma-separated: D,P2,P3',PS; P3 = P3′).
    #[arg(long, default_value = "D,P2,P3',PS")]
    configs: String,
    /// Write an SVG plot (link utilisation, CPU over native, guest → back-end ms/MB against N,
    /// one line per configuration) to this file.
    #[arg(long)]
    plot: Option<PathBuf>,
    /// The guests of a point: N I/O + N CPU (both), or N of one kind (io, cpu: Fig. 5.1a).
    #[arg(long, default_value = "both", value_parser = ["both", "io", "cpu"])]
    mix: String,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Config {
    D,
    P2,
    P3,
    Ps,
}

impl Config {
    fn name(self) -> &'static str {
        match self {
            Config::D => "D",
            Config::P2 => "P2",
            Config::P3 => "P3'",
            Config::Ps => "PS",
        }
    }

    fn parse(s: &str) -> Result<Config, String> {
        match s.trim() {
            "D" | "d" => Ok(Config::D),
            "P2" | "p2" => Ok(Config::P2),
            "P3'" | "P3′" | "P3" | "p3" => Ok(Config::P3),
            "PS" | "ps" => Ok(Config::Ps),
            o => Err(format!(
                "unknown configuration {o:?}: give D, P2, P3' or PS"
            )),
        }
    }
}

/// What the lucid binary in use offers (lanes P1/P2 add pools, `--pool`, `--low-noise`).
struct Features {
    pools: bool,
    pool_flag: bool,
    low_noise: bool,
}

fn lucid_exe() -> Result<PathBuf, String> {
    std::env::current_exe().map_err(|e| format!("cannot find the lucid executable: {e}"))
}

fn features(exe: &Path) -> Features {
    let help = |args: &[&str]| {
        Command::new(exe)
            .args(args)
            .stdin(Stdio::null())
            .stderr(Stdio::null())
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
    };
    let run = help(&["run", "--help"]).unwrap_or_default();
    Features {
        pools: help(&["pools", "--help"]).is_some(),
        pool_flag: run.contains("--pool"),
        low_noise: run.contains("--low-noise"),
    }
}

/// The kind of a guest in a mix.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Io,
    Cpu,
}

/// One `lucid run` of the mix.
struct VmRun {
    kind: Kind,
    child: Child,
    out: PathBuf,
    stats: PathBuf,
    /// Latest schedstat per thread: tid -> (comm, cpu ns, wait ns, involuntary switches).
    threads: BTreeMap<u32, (String, u64, u64, u64)>,
    placed: Vec<u32>,
}

/// A point that ends early (an error) leaves no VM running and no file behind.
impl Drop for VmRun {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        let _ = std::fs::remove_file(&self.out);
        let _ = std::fs::remove_file(&self.stats);
    }
}

/// `cpu_ns wait_ns` of a thread from `/proc/<pid>/task/<tid>/schedstat`.
fn schedstat(pid: u32, tid: u32) -> Option<(u64, u64)> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/schedstat")).ok()?;
    let mut it = s.split_whitespace().map(|v| v.parse::<u64>().ok());
    Some((it.next()??, it.next()??))
}

/// `nonvoluntary_ctxt_switches` of a thread (a no-op pool's back-end should see none).
fn involuntary(pid: u32, tid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("nonvoluntary_ctxt_switches:"))
                .and_then(|v| v.trim().parse().ok())
        })
        .unwrap_or(0)
}

fn tasks(pid: u32) -> Vec<(u32, String)> {
    let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return Vec::new();
    };
    dir.flatten()
        .filter_map(|e| {
            let tid = e.file_name().to_string_lossy().parse().ok()?;
            let comm = std::fs::read_to_string(e.path().join("comm")).ok()?;
            Some((tid, comm.trim().to_string()))
        })
        .collect()
}

fn is_vcpu(comm: &str) -> bool {
    comm.starts_with("lucid-vcpu")
}

fn is_backend(comm: &str) -> bool {
    comm.starts_with("lucid-") && comm.ends_with("-io")
}

/// Affinity and scheduling policy for one thread (the manual placement).
struct Place {
    cpus: Option<Vec<usize>>,
    /// SCHED_FIFO priority, or a nice value under SCHED_OTHER/SCHED_BATCH.
    fifo: Option<i32>,
    batch: bool,
    nice: i32,
}

fn apply(tid: u32, p: &Place) -> Result<(), String> {
    let tid = tid as libc::pid_t;
    if let Some(cpus) = &p.cpus {
        // SAFETY: cpu_set_t is plain data; CPU_SET and sched_setaffinity get a valid pointer to
        // it and its size. A thread that has exited makes the call fail, harmlessly.
        let r = unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            for &c in cpus {
                libc::CPU_SET(c, &mut set);
            }
            libc::sched_setaffinity(tid, std::mem::size_of::<libc::cpu_set_t>(), &set)
        };
        if r != 0 {
            return Err(format!(
                "sched_setaffinity({tid}): {}",
                std::io::Error::last_os_error()
            ));
        }
    }
    let (policy, prio) = match (p.fifo, p.batch) {
        (Some(prio), _) => (libc::SCHED_FIFO, prio),
        (None, true) => (libc::SCHED_BATCH, 0),
        (None, false) => (libc::SCHED_OTHER, 0),
    };
    let param = libc::sched_param {
        sched_priority: prio,
    };
    // SAFETY: sched_setscheduler reads a valid sched_param for the duration of the call.
    if unsafe { libc::sched_setscheduler(tid, policy, &param) } != 0 {
        return Err(format!(
            "sched_setscheduler({tid}): {} (needs root or CAP_SYS_NICE)",
            std::io::Error::last_os_error()
        ));
    }
    if p.fifo.is_none() {
        // SAFETY: setpriority on a thread id (PRIO_PROCESS applies to one thread on Linux).
        unsafe { libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, p.nice) };
    }
    Ok(())
}

/// The manual placement of a thread of a VM of `kind` under `config` on `ncpu` CPUs.
fn manual_place(config: Config, kind: Kind, comm: &str, ncpu: usize) -> Option<Place> {
    let last = vec![ncpu - 1];
    let rest: Vec<usize> = (0..ncpu - 1).collect();
    let fifo = |cpus| Place {
        cpus,
        fifo: Some(10),
        batch: false,
        nice: 0,
    };
    let other = |cpus, batch, nice| Place {
        cpus,
        fifo: None,
        batch,
        nice,
    };
    let vcpu = is_vcpu(comm);
    let backend = is_backend(comm);
    match config {
        Config::D => None,
        Config::P2 if backend => Some(fifo(Some(last))),
        Config::P2 if vcpu => Some(other(Some(rest), false, 0)),
        Config::P3 if backend => Some(fifo(Some(last))),
        Config::P3 if vcpu && kind == Kind::Io => Some(other(Some(last), false, -5)),
        Config::P3 if vcpu => Some(other(Some(rest), true, 10)),
        Config::Ps if backend => Some(fifo(None)),
        Config::Ps if vcpu && kind == Kind::Io => Some(other(None, false, -5)),
        Config::Ps if vcpu => Some(other(None, true, 10)),
        _ => None,
    }
}

/// A pools state directory and cgroup root for this run, destroyed on drop.
struct Pools {
    exe: PathBuf,
    dir: PathBuf,
    cgroup: String,
}

impl Pools {
    fn create(exe: &Path, defs: &[String]) -> Result<Pools, String> {
        let pid = std::process::id();
        let p = Pools {
            exe: exe.into(),
            dir: std::env::temp_dir().join(format!("lucid-bench-pools-{pid}")),
            cgroup: format!("lucid-bench-{pid}"),
        };
        let mut c = p.cmd();
        c.args(["pools", "create"]);
        for d in defs {
            c.args(["--def", d]);
        }
        let o = c.output().map_err(|e| format!("lucid pools create: {e}"))?;
        if !o.status.success() {
            return Err(format!(
                "lucid pools create {}: {}",
                defs.join(" "),
                String::from_utf8_lossy(&o.stderr).trim()
            ));
        }
        Ok(p)
    }

    fn cmd(&self) -> Command {
        let mut c = Command::new(&self.exe);
        c.env("LUCID_POOLS_DIR", &self.dir)
            .env("LUCID_POOLS_CGROUP", &self.cgroup)
            .stdin(Stdio::null());
        c
    }
}

impl Drop for Pools {
    fn drop(&mut self) {
        let _ = self
            .cmd()
            .args(["pools", "destroy", "--force"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The pool definitions of a configuration and the pool of each kind of VM.
fn pool_defs(config: Config, ncpu: usize) -> Option<(Vec<String>, &'static str, &'static str)> {
    let last = ncpu - 1;
    let rest = if last == 1 {
        "0".to_string()
    } else {
        format!("0-{}", last - 1)
    };
    match config {
        // One default pool over every CPU: D's placement, with the VMM's monitor running.
        Config::D => Some((
            vec![format!("name=all,cpus=0-{last},policy=default")],
            "all",
            "all",
        )),
        Config::P2 => Some((
            vec![
                format!("name=backends,cpus={last},policy=noop,backends=on"),
                format!("name=vms,cpus={rest},policy=default"),
            ],
            "vms",
            "vms",
        )),
        Config::P3 => Some((
            vec![
                format!("name=io,cpus={last},policy=io,backends=on"),
                format!("name=cpu,cpus={rest},policy=cpu"),
            ],
            "io",
            "cpu",
        )),
        _ => None,
    }
}

fn tmpfile(tag: &str) -> PathBuf {
    std::env::temp_dir().join(format!("lucid-bench-pools-{}-{tag}", std::process::id()))
}

/// Runs one point: N I/O + N CPU guests under `config`. Returns the point's JSON.
fn point(
    a: &PoolsArgs,
    exe: &Path,
    f: &Features,
    config: Config,
    n: u32,
    seconds: u64,
    ncpu: usize,
) -> Result<Value, String> {
    let manual = a.manual || config == Config::Ps;
    let pools = match (manual, pool_defs(config, ncpu)) {
        // D needs no pools; with them its VMs run the monitor.
        (false, Some(_)) if config == Config::D && !(f.pools && f.pool_flag) => None,
        (false, Some((defs, io_pool, cpu_pool))) => {
            if !f.pools || !f.pool_flag {
                return Err(format!(
                    "{}: this lucid has no `lucid pools` / `run --pool` (lanes P1/P2 of issue \
                     10); run with --manual for the bench's own placement",
                    config.name()
                ));
            }
            Some((Pools::create(exe, &defs)?, io_pool, cpu_pool))
        }
        _ => None,
    };
    let n_io = if a.mix == "cpu" { 0 } else { n };
    let n_cpu = if a.mix == "io" { 0 } else { n };
    let share = (a.rate / u64::from(n)).max(1);
    let mut vms = Vec::new();
    for i in 0..n_io + n_cpu {
        let kind = if i < n_io { Kind::Io } else { Kind::Cpu };
        let tag = format!("{}-{n}-{i}", config.name().replace('\'', "q"));
        let out = tmpfile(&format!("{tag}.out"));
        let stats = tmpfile(&format!("{tag}.json"));
        let mut c = match &pools {
            Some((p, _, _)) => p.cmd(),
            None => {
                let mut c = Command::new(exe);
                c.stdin(Stdio::null());
                c
            }
        };
        c.arg("run");
        match kind {
            Kind::Io => c.args([
                "--guest",
                "stream",
                "--net",
                &format!("backend=sink,rate={share}"),
                "--cmdline",
                &format!("mib=0 seconds={seconds}"),
            ]),
            Kind::Cpu => c.args(["--guest", "cpu", "--cmdline", &format!("seconds={seconds}")]),
        };
        if let Some((_, io_pool, cpu_pool)) = &pools {
            c.args(["--pool", if kind == Kind::Io { io_pool } else { cpu_pool }]);
        } else if f.pool_flag {
            c.args(["--pool", "none"]);
        }
        c.args(["--memory", "64", "--stats-json"]).arg(&stats);
        let file = std::fs::File::create(&out).map_err(|e| format!("{}: {e}", out.display()))?;
        c.stdout(file).stderr(Stdio::null());
        let child = c.spawn().map_err(|e| format!("spawn lucid run: {e}"))?;
        vms.push(VmRun {
            kind,
            child,
            out,
            stats,
            threads: BTreeMap::new(),
            placed: Vec::new(),
        });
    }
    // Sample the threads until every VM is done (placing them by hand where asked).
    let deadline = Instant::now() + Duration::from_secs(seconds + 60);
    let mut place_errors = Vec::new();
    loop {
        let mut live = 0;
        for vm in &mut vms {
            if vm.child.try_wait().ok().flatten().is_some() {
                continue;
            }
            live += 1;
            let pid = vm.child.id();
            for (tid, comm) in tasks(pid) {
                if manual && !vm.placed.contains(&tid) {
                    if let Some(p) = manual_place(config, vm.kind, &comm, ncpu) {
                        if let Err(e) = apply(tid, &p) {
                            place_errors.push(e);
                        }
                    }
                    vm.placed.push(tid);
                }
                if let Some((cpu, wait)) = schedstat(pid, tid) {
                    let inv = if is_backend(&comm) {
                        involuntary(pid, tid)
                    } else {
                        0
                    };
                    vm.threads.insert(tid, (comm, cpu, wait, inv));
                }
            }
        }
        if live == 0 {
            break;
        }
        if Instant::now() > deadline {
            for vm in &mut vms {
                let _ = vm.child.kill();
                let _ = vm.child.wait();
            }
            return Err(format!("{} N={n}: guests did not finish", config.name()));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let pools_used = pools.is_some();
    drop(pools);
    if let Some(e) = place_errors.first() {
        return Err(format!("{} N={n}: placement: {e}", config.name()));
    }
    // Collect.
    let (mut io_mb_s, mut cpu_pass_s, mut io_mb, mut be_wait, mut vcpu_wait) =
        (0.0, 0.0, 0.0, 0u64, 0u64);
    let (mut be_involuntary, mut kicks, mut irqs) = (0u64, 0u64, 0u64);
    let mut monitor = (0.0, 0.0, 0usize, Vec::new());
    let mut per_vm = Vec::new();
    for vm in &mut vms {
        let out = std::fs::read_to_string(&vm.out).unwrap_or_default();
        let stats: Option<Value> = std::fs::read_to_string(&vm.stats)
            .ok()
            .and_then(|s| serde_json::from_str(&s).ok());
        let _ = std::fs::remove_file(&vm.out);
        let _ = std::fs::remove_file(&vm.stats);
        let status = vm.child.wait().ok().and_then(|s| s.code());
        if status != Some(1) {
            return Err(format!(
                "{} N={n}: a {} guest failed (status {status:?}): {}",
                config.name(),
                if vm.kind == Kind::Io { "stream" } else { "cpu" },
                out.trim()
            ));
        }
        let counters = stats.as_ref().map(|s| &s["counters"]);
        match vm.kind {
            Kind::Io => {
                let r = field(&out, "stream bytes", "mb_per_s").unwrap_or(0.0);
                io_mb_s += r;
                let bytes = counters
                    .and_then(|c| c["net0"]["sink"]["bytes"].as_u64())
                    .unwrap_or(0);
                io_mb += bytes as f64 / 1e6;
                kicks += counters
                    .and_then(|c| c["net0"]["kicks"].as_u64())
                    .unwrap_or(0);
                irqs += counters
                    .and_then(|c| c["net0"]["irqs"].as_u64())
                    .unwrap_or(0);
                for (comm, _, wait, inv) in vm.threads.values() {
                    if is_backend(comm) {
                        be_wait += wait;
                        be_involuntary += inv;
                    } else if is_vcpu(comm) {
                        vcpu_wait += wait;
                    }
                }
                match counters.map(monitor_figures) {
                    Some(Ok((g2b, b2g))) => {
                        monitor.0 += g2b * bytes as f64 / 1e6;
                        monitor.1 += b2g * bytes as f64 / 1e6;
                        monitor.2 += 1;
                    }
                    Some(Err(e)) => monitor.3.push(e),
                    None => monitor.3.push("no --stats-json written".into()),
                }
                per_vm.push(json!({"kind": "io", "mb_per_s": r, "sink_bytes": bytes}));
            }
            Kind::Cpu => {
                let r = field(&out, "cpu mib", "passes_per_s").unwrap_or(0.0);
                cpu_pass_s += r;
                per_vm.push(json!({"kind": "cpu", "passes_per_s": r}));
            }
        }
    }
    let link = a.rate as f64 * 0.125; // MB/s
    let per_mb = |ns: u64| (io_mb > 0.0).then(|| ns as f64 / 1e6 / io_mb);
    let io_vms = n_io as usize;
    let monitor_json = if monitor.2 == io_vms && io_mb > 0.0 {
        json!({"guest_to_backend": monitor.0 / io_mb, "backend_to_guest": monitor.1 / io_mb})
    } else {
        Value::Null
    };
    let if_io = |v: f64| (n_io > 0).then_some(v);
    Ok(json!({
        "link_utilisation": if_io(io_mb_s / link),
        "io_mb_per_s": if_io(io_mb_s),
        "cpu_passes_per_s": (n_cpu > 0).then_some(cpu_pass_s),
        "ms_per_mb_monitor": monitor_json,
        "ms_per_mb_monitor_missing": monitor.3.first(),
        "ms_per_mb_schedstat": {
            "guest_to_backend": per_mb(be_wait),
            "backend_to_guest": per_mb(vcpu_wait),
        },
        "kicks_per_mb": (io_mb > 0.0).then(|| kicks as f64 / io_mb),
        "irqs_per_mb": (io_mb > 0.0).then(|| irqs as f64 / io_mb),
        "backend_nonvoluntary_ctxt_switches": if_io(be_involuntary as f64),
        "placement": match (manual, &pools_used) {
            (true, _) => "manual",
            (false, true) => "pools",
            (false, false) => "default",
        },
        "vms": per_vm,
    }))
}

/// ms lost per MB both ways from a VM's `monitor.*` counters. The key names are matched loosely
/// (`guest_to_backend` / `backend_to_guest`; a `_us`/`_ns`/`_milli` scale in the name is undone)
/// so that the bench does not depend on the monitor's exact key names.
fn monitor_figures(counters: &Value) -> Result<(f64, f64), String> {
    let Some(m) = counters.get("monitor") else {
        return Err("this lucid has no monitor (monitor.* in --stats-json)".into());
    };
    let flat: BTreeMap<String, f64> = lucid_stats::flatten(m)
        .into_iter()
        .map(|(k, v)| (k, v as f64))
        .collect();
    let find = |dir: &str| {
        // The whole run's figure before a last window's (`last.*`).
        let mut keys: Vec<_> = flat
            .iter()
            .filter(|(k, _)| k.contains(dir) && k.contains("per_mb"))
            .collect();
        keys.sort_by_key(|(k, _)| k.starts_with("last."));
        keys.into_iter()
            .map(|(k, v)| {
                let per = if k.contains("_ns") {
                    1e6
                } else if k.contains("_us") || k.contains("milli") || k.contains("x1000") {
                    1e3
                } else {
                    1.0
                };
                v / per
            })
            .next()
    };
    match (find("guest_to_backend"), find("backend_to_guest")) {
        (Some(a), Some(b)) => Ok((a, b)),
        _ => Err(format!(
            "monitor.* has no guest_to_backend/backend_to_guest per-MB figures (keys: {})",
            flat.keys().cloned().collect::<Vec<_>>().join(", ")
        )),
    }
}

/// The noise lines (`min_ns`.. `total_ns`, spreads) as JSON.
fn noise_json(out: &str) -> Option<Value> {
    let g = |k| field::<f64>(out, "noise min_ns", k);
    let s = |k| field::<f64>(out, "noise spread", k);
    Some(json!({
        "min_ns": g("min_ns")?, "median_ns": g("median_ns")?, "p99_ns": g("p99_ns")?,
        "max_ns": g("max_ns")?, "total_ns": g("total_ns")?,
        "spread_p99": s("spread_p99")?, "spread_max": s("spread_max")?,
    }))
}

fn run_to_string(mut c: Command, what: &str) -> Result<String, String> {
    let o = c
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("{what}: {e}"))?;
    Ok(String::from_utf8_lossy(&o.stdout).into_owned())
}

/// The host twin on the last CPU, and the noise guest with `--low-noise` (its vCPU pinned to
/// the last CPU: the highest, as the VMM's low-noise mode does), or placed by the bench.
fn noise_probe(
    exe: &Path,
    f: &Features,
    manual: bool,
    quanta: u64,
    ncpu: usize,
) -> (Option<Value>, Result<Value, String>) {
    let args = format!("quanta={quanta} iters=100000");
    let mut host = Command::new(lucid_guests::noise_host_path());
    host.args(args.split(' ')).arg(format!("cpu={}", ncpu - 1));
    let native = run_to_string(host, "noise-host")
        .ok()
        .and_then(|o| noise_json(&o));
    let guest = (|| {
        let mut c = Command::new(exe);
        c.args([
            "run",
            "--guest",
            "noise",
            "--cmdline",
            &args,
            "--memory",
            "64",
        ]);
        if manual {
            // Pin the vCPU ourselves as soon as it appears: the closest this build can do.
            c.stdout(Stdio::piped())
                .stderr(Stdio::null())
                .stdin(Stdio::null());
            let child = c.spawn().map_err(|e| format!("spawn lucid run: {e}"))?;
            let pid = child.id();
            let t0 = Instant::now();
            while t0.elapsed() < Duration::from_secs(1) {
                if let Some((tid, _)) = tasks(pid).into_iter().find(|(_, c)| is_vcpu(c)) {
                    let p = Place {
                        cpus: Some(vec![ncpu - 1]),
                        fifo: None,
                        batch: false,
                        nice: 0,
                    };
                    apply(tid, &p)?;
                    break;
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            let o = child
                .wait_with_output()
                .map_err(|e| format!("lucid run noise: {e}"))?;
            return noise_json(&String::from_utf8_lossy(&o.stdout))
                .ok_or("the noise guest printed no figures".to_string());
        }
        if !f.low_noise {
            return Err(
                "this lucid has no `run --low-noise` (see docs/scheduling.md); run with \
                        --manual to pin the vCPU from the bench"
                    .to_string(),
            );
        }
        c.arg("--low-noise");
        let o = run_to_string(c, "lucid run --low-noise")?;
        noise_json(&o).ok_or(format!("the noise guest printed no figures: {o}"))
    })();
    (native, guest)
}

pub fn run(a: PoolsArgs) -> Result<ExitCode, String> {
    let exe = lucid_exe()?;
    let f = features(&exe);
    let ncpu = std::thread::available_parallelism().map_or(1, |n| n.get());
    if ncpu < 2 {
        return Err("lucid bench pools needs at least 2 CPUs (one for the pools' last CPU)".into());
    }
    let configs = a
        .configs
        .split(',')
        .map(Config::parse)
        .collect::<Result<Vec<_>, _>>()?;
    let (seconds, max_n, quanta) = if a.quick {
        (1, 1, 300)
    } else {
        (a.seconds.max(1), a.max_n.clamp(1, 8), 3000)
    };
    let mut missing = Map::new();

    // Native limits: the cpu guest's passes on one core (the capacity is that × cores), the
    // link itself, the noise loop.
    let mut host = Command::new(lucid_guests::noise_host_path());
    host.args(["mode=cpu", &format!("seconds={}", seconds.min(2))]);
    let native_pass = run_to_string(host, "noise-host mode=cpu")
        .ok()
        .and_then(|o| field::<f64>(&o, "cpu mib", "passes_per_s"));
    let capacity = native_pass.map(|p| p * ncpu as f64);

    let mut table: BTreeMap<&str, BTreeMap<u32, Value>> = BTreeMap::new();
    for &c in &configs {
        for n in 1..=max_n {
            eprintln!("lucid bench pools: {} N={n} ({seconds} s)", c.name());
            let v = match point(&a, &exe, &f, c, n, seconds, ncpu) {
                Ok(mut v) => {
                    if let (Some(cap), Some(p)) = (capacity, v["cpu_passes_per_s"].as_f64()) {
                        v["cpu_over_native"] = json!(p / cap);
                    }
                    v
                }
                Err(e) => {
                    eprintln!("lucid bench pools: {e}");
                    json!({"error": e})
                }
            };
            table.entry(c.name()).or_default().insert(n, v);
        }
    }

    // Headline figures at the largest N: the best pool configuration against D.
    // ms/MB from one source for D and the pools alike: the VMM's monitor where D and a pool
    // configuration both have it, else the bench's schedstat samples.
    let g2b_of = |c: &str, src: &str| -> Option<f64> {
        table.get(c)?.get(&max_n)?[format!("ms_per_mb_{src}")]["guest_to_backend"].as_f64()
    };
    let pool_names = ["P2", "P3'", "PS"];
    let g2b_source = ["monitor", "schedstat"]
        .into_iter()
        .find(|src| {
            g2b_of("D", src).is_some() && pool_names.iter().any(|c| g2b_of(c, src).is_some())
        })
        .unwrap_or("schedstat");
    let at = |c: &str, key: &str| -> Option<f64> {
        let p = table.get(c)?.get(&max_n)?;
        match key {
            "g2b" => g2b_of(c, g2b_source),
            k => p[k].as_f64(),
        }
    };
    let best = |key: &str, lower: bool| {
        pool_names
            .iter()
            .filter_map(|c| at(c, key).map(|v| (*c, v)))
            .min_by(|x, y| {
                let o = x.1.partial_cmp(&y.1).expect("no NaN");
                if lower {
                    o
                } else {
                    o.reverse()
                }
            })
    };
    let g2b_ratio = match (best("g2b", true), at("D", "g2b")) {
        (Some((c, p)), Some(d)) if d > 0.0 => Some((c, p / d)),
        (_, Some(d)) if d <= 0.0 => {
            missing.insert(
                "guest_to_backend_ms_per_mb_pools_over_default".into(),
                json!("D lost no time (0 ms/MB): the ratio is undefined"),
            );
            None
        }
        _ => {
            missing.insert(
                "guest_to_backend_ms_per_mb_pools_over_default".into(),
                json!(format!(
                    "no D and pool figures at N={max_n} (see configs.*.error)"
                )),
            );
            None
        }
    };
    let link_pools = best("link_utilisation", false);
    if link_pools.is_none() {
        missing.insert(
            "link_utilisation_pools".into(),
            json!(format!("no pool configuration ran at N={max_n}")),
        );
    }
    let (native_noise, guest_noise) = noise_probe(&exe, &f, a.manual, quanta, ncpu);
    let low_noise = match (&native_noise, &guest_noise) {
        (Some(n), Ok(g)) => match (n["total_ns"].as_f64(), g["total_ns"].as_f64()) {
            (Some(nt), Some(gt)) if gt > 0.0 => Some(nt / gt),
            _ => None,
        },
        (None, _) => {
            missing.insert(
                "low_noise_compute_over_native".into(),
                json!("noise-host gave no figures"),
            );
            None
        }
        (_, Err(e)) => {
            missing.insert("low_noise_compute_over_native".into(), json!(e));
            None
        }
    };
    let mut configs_json = Map::new();
    for (c, pts) in &table {
        let m: Map<String, Value> = pts
            .iter()
            .map(|(n, v)| (n.to_string(), v.clone()))
            .collect();
        configs_json.insert(c.to_string(), Value::Object(m));
    }
    let out = json!({
        "host": {"cpus": ncpu, "model": cpu_model(), "kernel": kernel_release()},
        "quick": a.quick,
        "seconds": seconds,
        "max_n": max_n,
        "mix": a.mix,
        "link_mbit": a.rate,
        "placement": if a.manual { "manual" } else { "pools" },
        "features": {"pools": f.pools, "run_pool": f.pool_flag, "run_low_noise": f.low_noise},
        "native": {
            "cpu_passes_per_s_per_core": native_pass,
            "cpu_capacity_passes_per_s": capacity,
            "link_mb_per_s": a.rate as f64 * 0.125,
            "noise": native_noise,
        },
        "configs": configs_json,
        "guest_to_backend_ms_per_mb_pools_over_default": g2b_ratio.map(|x| x.1),
        "guest_to_backend_best_pool_config": g2b_ratio.map(|x| x.0),
        "guest_to_backend_source": g2b_source,
        "link_utilisation_pools": link_pools.map(|x| x.1),
        "link_utilisation_best_pool_config": link_pools.map(|x| x.0),
        "link_utilisation_default": at("D", "link_utilisation"),
        "low_noise_compute_over_native": low_noise,
        "noise": {"native": native_noise, "low_noise": guest_noise.as_ref().ok()},
        "missing": missing,
    });
    if let Some(path) = &a.plot {
        std::fs::write(path, svg_plot(&table, max_n, &out))
            .map_err(|e| format!("--plot {}: {e}", path.display()))?;
    }
    if a.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&out).expect("JSON values serialize")
        );
    } else {
        print!("{}", text(&out, &table, max_n));
    }
    Ok(ExitCode::SUCCESS)
}

/// Reads one figure of a point.
type Figure = dyn Fn(&Value) -> Option<f64>;

/// Three panels against N, a line per configuration: link utilisation, CPU ÷ native (both
/// 0-1.2), guest → back-end ms/MB from the bench's schedstat samples (log scale).
fn svg_plot(table: &BTreeMap<&str, BTreeMap<u32, Value>>, max_n: u32, out: &Value) -> String {
    let (w, h) = (960.0, 360.0);
    let title = format!(
        "lucid bench pools: {} CPUs, link {} Mbit/s, placement {} (x: N I/O + N CPU guests)",
        out["host"]["cpus"],
        out["link_mbit"],
        out["placement"].as_str().unwrap_or("?")
    );
    let mut s = crate::svg_start(w, h, 11, &title);
    let colours = [
        ("D", "#444"),
        ("P2", "#4a7fb5"),
        ("P3'", "#d0542c"),
        ("PS", "#3a9a4a"),
    ];
    let panels: [(&str, &Figure, bool); 3] = [
        (
            "link utilisation",
            &|p: &Value| p["link_utilisation"].as_f64(),
            false,
        ),
        (
            "CPU / native",
            &|p: &Value| p["cpu_over_native"].as_f64(),
            false,
        ),
        (
            "guest -> back-end ms/MB (log)",
            &|p: &Value| p["ms_per_mb_schedstat"]["guest_to_backend"].as_f64(),
            true,
        ),
    ];
    let pw = (w - 40.0) / 3.0;
    let (top, bottom) = (50.0, h - 60.0);
    for (i, (name, get, log)) in panels.iter().enumerate() {
        let x0 = 40.0 + i as f64 * pw;
        let x1 = x0 + pw - 40.0;
        let xs = |n: u32| x0 + (x1 - x0) * f64::from(n - 1) / f64::from(max_n.max(2) - 1);
        let (lo, hi) = if *log { (-3.0, 2.0) } else { (0.0, 1.2) };
        let ys = |v: f64| {
            let v = if *log { v.max(1e-3).log10() } else { v };
            bottom - (v.clamp(lo, hi) - lo) / (hi - lo) * (bottom - top)
        };
        let _ = writeln!(
            s,
            r##"<text x="{x0}" y="{}" font-size="12">{name}</text><line x1="{x0}" x2="{x0}" y1="{top}" y2="{bottom}" stroke="#999"/><line x1="{x0}" x2="{x1}" y1="{bottom}" y2="{bottom}" stroke="#999"/>"##,
            top - 10.0
        );
        let ticks: Vec<f64> = if *log {
            (-3..=2).map(|e| 10f64.powi(e)).collect()
        } else {
            vec![0.0, 0.5, 1.0]
        };
        for t in ticks {
            let y = ys(t);
            let _ = writeln!(
                s,
                r##"<line x1="{x0}" x2="{x1}" y1="{y}" y2="{y}" stroke="#eee"/><text x="{}" y="{}" font-size="9">{t}</text>"##,
                x0 - 30.0,
                y + 3.0
            );
        }
        for n in 1..=max_n {
            let _ = writeln!(
                s,
                r#"<text x="{}" y="{}">{n}</text>"#,
                xs(n) - 3.0,
                bottom + 14.0
            );
        }
        for (c, colour) in colours {
            let Some(pts) = table.get(c) else { continue };
            let line: Vec<String> = (1..=max_n)
                .filter_map(|n| get(pts.get(&n)?).map(|v| format!("{},{}", xs(n), ys(v))))
                .collect();
            if line.is_empty() {
                continue;
            }
            let _ = writeln!(
                s,
                r#"<polyline fill="none" stroke="{colour}" stroke-width="2" points="{}"/>"#,
                line.join(" ")
            );
            for p in &line {
                let (x, y) = p.split_once(',').expect("x,y");
                let _ = writeln!(s, r#"<circle cx="{x}" cy="{y}" r="3" fill="{colour}"/>"#);
            }
        }
    }
    for (k, (c, colour)) in colours.iter().enumerate() {
        let x = 40.0 + k as f64 * 70.0;
        let _ = writeln!(
            s,
            r#"<rect x="{x}" y="{}" width="12" height="12" fill="{colour}"/><text x="{}" y="{}">{c}</text>"#,
            h - 28.0,
            x + 16.0,
            h - 18.0
        );
    }
    s.push_str("</svg>\n");
    s
}

fn num(v: &Value) -> String {
    v.as_f64()
        .map_or_else(|| "-".to_string(), |x| format!("{x:.3}"))
}

fn text(out: &Value, table: &BTreeMap<&str, BTreeMap<u32, Value>>, max_n: u32) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "pools bench: {} CPUs ({}), link {} Mbit/s, {} s per point, placement {}",
        out["host"]["cpus"],
        out["host"]["model"].as_str().unwrap_or("?"),
        out["link_mbit"],
        out["seconds"],
        out["placement"].as_str().unwrap_or("?")
    );
    let _ = writeln!(
        s,
        "native: {} cpu passes/s per core; link {} MB/s",
        num(&out["native"]["cpu_passes_per_s_per_core"]),
        num(&out["native"]["link_mb_per_s"])
    );
    let _ = writeln!(
        s,
        "{:<5} {:>2} {:>8} {:>10} {:>9} {:>11} {:>11} {:>11} {:>11}",
        "conf",
        "N",
        "link",
        "cpu pass/s",
        "cpu/nat",
        "g2b ms/MB",
        "b2g ms/MB",
        "g2b mon",
        "b2g mon"
    );
    for (c, pts) in table {
        for n in 1..=max_n {
            let Some(p) = pts.get(&n) else { continue };
            if let Some(e) = p["error"].as_str() {
                let _ = writeln!(s, "{c:<5} {n:>2} error: {e}");
                continue;
            }
            let _ = writeln!(
                s,
                "{c:<5} {n:>2} {:>8} {:>10} {:>9} {:>11} {:>11} {:>11} {:>11}",
                num(&p["link_utilisation"]),
                num(&p["cpu_passes_per_s"]),
                num(&p["cpu_over_native"]),
                num(&p["ms_per_mb_schedstat"]["guest_to_backend"]),
                num(&p["ms_per_mb_schedstat"]["backend_to_guest"]),
                num(&p["ms_per_mb_monitor"]["guest_to_backend"]),
                num(&p["ms_per_mb_monitor"]["backend_to_guest"]),
            );
        }
    }
    for k in [
        "guest_to_backend_ms_per_mb_pools_over_default",
        "link_utilisation_pools",
        "low_noise_compute_over_native",
    ] {
        let _ = writeln!(s, "{k}: {}", num(&out[k]));
    }
    let spread = |v: &Value| {
        format!(
            "p99 {} max {}",
            num(&v["spread_p99"]),
            num(&v["spread_max"])
        )
    };
    let _ = writeln!(
        s,
        "noise spread: native {}; low-noise guest {}",
        spread(&out["noise"]["native"]),
        spread(&out["noise"]["low_noise"])
    );
    if let Some(m) = out["missing"].as_object() {
        for (k, v) in m {
            let _ = writeln!(s, "missing {k}: {}", v.as_str().unwrap_or("?"));
        }
    }
    s
}

fn cpu_model() -> Option<String> {
    let s = std::fs::read_to_string("/proc/cpuinfo").ok()?;
    s.lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split_once(':'))
        .map(|(_, v)| v.trim().to_string())
}

fn kernel_release() -> Option<String> {
    std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .ok()
        .map(|s| s.trim().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn monitor_figures_follow_the_monitors_naming_and_scale() {
        let c = json!({"monitor": {"ms_lost_per_mb": {
            "guest_to_backend_us": 11, "backend_to_guest_us": 500}}});
        assert_eq!(monitor_figures(&c).unwrap(), (0.011, 0.5));
        let c =
            json!({"monitor": {"guest_to_backend_ms_per_mb": 2, "backend_to_guest_ms_per_mb": 3}});
        assert_eq!(monitor_figures(&c).unwrap(), (2.0, 3.0));
        // P2's naming: whole-run figures and the last window's; the whole run's win.
        let c = json!({"monitor": {"guest_to_backend_us_per_mb": 691, "backend_to_guest_us_per_mb": 9,
            "last": {"guest_to_backend_us_per_mb": 1, "backend_to_guest_us_per_mb": 1}}});
        assert_eq!(monitor_figures(&c).unwrap(), (0.691, 0.009));
        let e = monitor_figures(&json!({"net0": {}})).unwrap_err();
        assert!(e.contains("no monitor"), "{e}");
        let e = monitor_figures(&json!({"monitor": {"windows": 3}})).unwrap_err();
        assert!(e.contains("windows"), "{e}");
    }

    #[test]
    fn manual_placement_matches_the_research_notes_layouts() {
        let p = |c, k, comm| manual_place(c, k, comm, 2);
        assert!(p(Config::D, Kind::Io, "lucid-net0-io").is_none());
        let be = p(Config::P2, Kind::Io, "lucid-net0-io").unwrap();
        assert_eq!((be.cpus, be.fifo), (Some(vec![1]), Some(10)));
        let v = p(Config::P2, Kind::Cpu, "lucid-vcpu0").unwrap();
        assert_eq!((v.cpus, v.fifo, v.batch), (Some(vec![0]), None, false));
        let v = p(Config::P3, Kind::Io, "lucid-vcpu0").unwrap();
        assert_eq!((v.cpus, v.nice), (Some(vec![1]), -5));
        let v = p(Config::P3, Kind::Cpu, "lucid-vcpu0").unwrap();
        assert_eq!((v.cpus, v.batch, v.nice), (Some(vec![0]), true, 10));
        let be = p(Config::Ps, Kind::Io, "lucid-net0-io").unwrap();
        assert_eq!((be.cpus, be.fifo), (None, Some(10)));
        assert!(p(Config::Ps, Kind::Io, "lucid").is_none());
        let (defs, io, cpu) = pool_defs(Config::P3, 4).unwrap();
        assert_eq!(defs[0], "name=io,cpus=3,policy=io,backends=on");
        assert_eq!(defs[1], "name=cpu,cpus=0-2,policy=cpu");
        assert_eq!((io, cpu), ("io", "cpu"));
        assert!(pool_defs(Config::Ps, 2).is_none());
        assert_eq!(
            pool_defs(Config::D, 2).unwrap().0,
            ["name=all,cpus=0-1,policy=default"]
        );
        assert_eq!(Config::parse("P3′").unwrap(), Config::P3);
        assert!(Config::parse("P4").is_err());
    }

    #[test]
    fn guest_lines_parse() {
        let out = "stream bytes=10 frames=1 tsc=5 mb_per_s=124.566 kicks=9\n\
                   noise min_ns=1 median_ns=2 p99_ns=3 max_ns=4 total_ns=10\n\
                   noise spread_p99=2.000 spread_max=3.000\n";
        assert_eq!(field(out, "stream bytes", "mb_per_s"), Some(124.566));
        assert_eq!(field::<f64>(out, "stream bytes", "nope"), None);
        let n = noise_json(out).unwrap();
        assert_eq!(n["total_ns"], 10.0);
        assert_eq!(n["spread_max"], 3.0);
    }
}
