//! The per-VM monitor (docs/scheduling.md): every window it samples each of the VM's
//! threads' `schedstat` (CPU time, run-queue wait, timeslices) and context switches, and the
//! VM's stats registry (back-end bytes, kicks, interrupts, KVM's exit statistics), and turns two
//! samples into a [`Window`]: rates, the vCPUs' demand, and **ms lost per MB** both ways:
//!
//! - guest → back-end: the back-end threads' run-queue wait per MB moved (a kick waits for its
//!   back-end to win a CPU);
//! - back-end → guest: the vCPU threads' run-queue wait per MB (a completion waits for its vCPU).
//!
//! Parsing and the window arithmetic are pure functions; only [`read_thread`] and
//! [`Sample::take`] read procfs.

use std::collections::BTreeMap;
use std::io;

use lucid_stats::{StatsRegistry, ThreadInfo, ThreadRole};

use crate::classify::Observation;

/// `/proc/<pid>/task/<tid>/schedstat`: time on a CPU, time waiting on a run queue (both ns) and
/// the number of timeslices run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SchedStat {
    pub cpu_ns: u64,
    pub wait_ns: u64,
    pub timeslices: u64,
}

/// Parses a `schedstat` line: three decimal numbers.
pub fn parse_schedstat(s: &str) -> Option<SchedStat> {
    let mut it = s.split_whitespace().map(|w| w.parse::<u64>().ok());
    Some(SchedStat {
        cpu_ns: it.next()??,
        wait_ns: it.next()??,
        timeslices: it.next()??,
    })
}

/// Context switches from `/proc/<pid>/task/<tid>/status`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CtxSwitches {
    pub voluntary: u64,
    pub nonvoluntary: u64,
}

/// Parses the `voluntary_ctxt_switches` and `nonvoluntary_ctxt_switches` lines of a `status`
/// file; `None` if either is missing.
pub fn parse_ctxt_switches(status: &str) -> Option<CtxSwitches> {
    let mut v = None;
    let mut nv = None;
    for line in status.lines() {
        let (key, value) = line.split_once(':')?;
        let value = value.trim().parse::<u64>().ok();
        match key {
            "voluntary_ctxt_switches" => v = value,
            "nonvoluntary_ctxt_switches" => nv = value,
            _ => {}
        }
    }
    Some(CtxSwitches {
        voluntary: v?,
        nonvoluntary: nv?,
    })
}

/// Reads one thread of this process.
pub fn read_thread(tid: i32) -> io::Result<(SchedStat, CtxSwitches)> {
    let bad = |what: &str| io::Error::new(io::ErrorKind::InvalidData, format!("{what} of {tid}"));
    let sched = std::fs::read_to_string(format!("/proc/self/task/{tid}/schedstat"))?;
    let sched = parse_schedstat(&sched).ok_or_else(|| bad("schedstat"))?;
    let status = std::fs::read_to_string(format!("/proc/self/task/{tid}/status"))?;
    let ctxt = parse_ctxt_switches(&status).ok_or_else(|| bad("status"))?;
    Ok((sched, ctxt))
}

/// One thread's cumulative figures at a sample.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ThreadSample {
    pub info: ThreadInfo,
    pub sched: SchedStat,
    pub ctxt: CtxSwitches,
}

/// Everything the monitor reads at one instant.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Sample {
    /// Monotonic time of the sample, ns (any origin, the same for every sample of a VM).
    pub at_ns: u64,
    pub threads: Vec<ThreadSample>,
    /// The stats registry's snapshot (counters and probes, `kvm.*` included).
    pub counters: BTreeMap<String, u64>,
}

impl Sample {
    /// Reads every registered thread (threads that ended meanwhile are left out) and the
    /// registry. `at_ns` is the caller's monotonic clock.
    pub fn take(stats: &StatsRegistry, at_ns: u64) -> Sample {
        let threads = stats
            .threads()
            .list()
            .into_iter()
            .filter_map(|info| {
                let (sched, ctxt) = read_thread(info.tid).ok()?;
                Some(ThreadSample { info, sched, ctxt })
            })
            .collect();
        Sample {
            at_ns,
            threads,
            counters: stats.snapshot(),
        }
    }
}

/// One thread over a window.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ThreadWindow {
    pub info: ThreadInfo,
    pub cpu_ns: u64,
    pub wait_ns: u64,
    pub timeslices: u64,
    pub voluntary: u64,
    pub nonvoluntary: u64,
}

/// KVM's exit statistics over a window, summed over the vCPUs (`kvm.vcpuN.*` probes).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KvmWindow {
    pub exits: u64,
    pub io_exits: u64,
    pub mmio_exits: u64,
    pub halt_exits: u64,
    pub halt_wakeup: u64,
    pub irq_injections: u64,
}

/// The figures of one window, as differences of two samples.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Window {
    pub wall_ns: u64,
    pub threads: Vec<ThreadWindow>,
    /// Bytes each back-end moved (both directions), by device name (`blk0`, `net0`, ...).
    pub device_bytes: BTreeMap<String, u64>,
    /// Guest notifications to back-ends (`<dev>.kicks`), summed.
    pub kicks: u64,
    /// Back-end interrupts to the guest (`<dev>.irqs`), summed.
    pub irqs: u64,
    pub kvm: KvmWindow,
}

/// The device of a back-end byte counter and whether it is the worker's own: `blk0.bytes_read`
/// → (`blk0`, true). Every virtio worker counts `bytes_read` (from guest buffers) and
/// `bytes_written` (into them); virtio-net also counts `tx_bytes`/`rx_bytes`, the same bytes,
/// used only for a device without the worker's counters.
pub fn device_bytes_counter(name: &str) -> Option<(&str, bool)> {
    let (dev, what) = name.split_once('.')?;
    let primary = match what {
        "bytes_read" | "bytes_written" => true,
        "tx_bytes" | "rx_bytes" => false,
        _ => return None,
    };
    is_device(dev).then_some((dev, primary))
}

/// `blk0`, `net1`, ...: a virtio device's counter prefix.
fn is_device(dev: &str) -> bool {
    let digits = dev.trim_start_matches(|c: char| c.is_ascii_alphabetic());
    !digits.is_empty() && digits.len() < dev.len() && digits.chars().all(|c| c.is_ascii_digit())
}

/// The KVM statistic `name` summed over the vCPUs.
fn kvm_sum(counters: &BTreeMap<String, u64>, stat: &str) -> u64 {
    counters
        .iter()
        .filter(|(k, _)| {
            k.strip_prefix("kvm.vcpu")
                .and_then(|rest| rest.split_once('.'))
                .is_some_and(|(n, s)| n.chars().all(|c| c.is_ascii_digit()) && s == stat)
        })
        .map(|(_, v)| *v)
        .sum()
}

/// Sums `<dev>.<suffix>` over the devices.
fn device_sum(counters: &BTreeMap<String, u64>, suffix: &str) -> u64 {
    counters
        .iter()
        .filter(|(k, _)| {
            k.split_once('.')
                .is_some_and(|(dev, s)| s == suffix && is_device(dev))
        })
        .map(|(_, v)| *v)
        .sum()
}

fn kvm_window(c: &BTreeMap<String, u64>) -> KvmWindow {
    KvmWindow {
        exits: kvm_sum(c, "exits"),
        io_exits: kvm_sum(c, "io_exits"),
        mmio_exits: kvm_sum(c, "mmio_exits"),
        halt_exits: kvm_sum(c, "halt_exits"),
        halt_wakeup: kvm_sum(c, "halt_wakeup"),
        irq_injections: kvm_sum(c, "irq_injections"),
    }
}

impl Window {
    /// The window from `a` to `b`. A thread that started after `a` counts from zero (its
    /// `schedstat` did); counters that went backwards count as zero.
    pub fn between(a: &Sample, b: &Sample) -> Window {
        let threads = b
            .threads
            .iter()
            .map(|t| {
                let before = a
                    .threads
                    .iter()
                    .find(|p| p.info.tid == t.info.tid)
                    .map(|p| (p.sched, p.ctxt))
                    .unwrap_or_default();
                ThreadWindow {
                    info: t.info.clone(),
                    cpu_ns: t.sched.cpu_ns.saturating_sub(before.0.cpu_ns),
                    wait_ns: t.sched.wait_ns.saturating_sub(before.0.wait_ns),
                    timeslices: t.sched.timeslices.saturating_sub(before.0.timeslices),
                    voluntary: t.ctxt.voluntary.saturating_sub(before.1.voluntary),
                    nonvoluntary: t.ctxt.nonvoluntary.saturating_sub(before.1.nonvoluntary),
                }
            })
            .collect();
        let delta = |name: &str| {
            let old = a.counters.get(name).copied().unwrap_or(0);
            b.counters
                .get(name)
                .copied()
                .unwrap_or(0)
                .saturating_sub(old)
        };
        // Per device: (worker's counters, the fallback's).
        let mut both: BTreeMap<String, (Option<u64>, u64)> = BTreeMap::new();
        for name in b.counters.keys() {
            if let Some((dev, primary)) = device_bytes_counter(name) {
                let e = both.entry(dev.to_string()).or_default();
                match primary {
                    true => *e.0.get_or_insert(0) += delta(name),
                    false => e.1 += delta(name),
                }
            }
        }
        let device_bytes = both
            .into_iter()
            .map(|(dev, (primary, fallback))| (dev, primary.unwrap_or(fallback)))
            .collect();
        let (ka, kb) = (kvm_window(&a.counters), kvm_window(&b.counters));
        Window {
            wall_ns: b.at_ns.saturating_sub(a.at_ns),
            threads,
            device_bytes,
            kicks: device_sum(&b.counters, "kicks")
                .saturating_sub(device_sum(&a.counters, "kicks")),
            irqs: device_sum(&b.counters, "irqs").saturating_sub(device_sum(&a.counters, "irqs")),
            kvm: KvmWindow {
                exits: kb.exits.saturating_sub(ka.exits),
                io_exits: kb.io_exits.saturating_sub(ka.io_exits),
                mmio_exits: kb.mmio_exits.saturating_sub(ka.mmio_exits),
                halt_exits: kb.halt_exits.saturating_sub(ka.halt_exits),
                halt_wakeup: kb.halt_wakeup.saturating_sub(ka.halt_wakeup),
                irq_injections: kb.irq_injections.saturating_sub(ka.irq_injections),
            },
        }
    }

    /// Bytes moved by every back-end.
    pub fn bytes(&self) -> u64 {
        self.device_bytes.values().sum()
    }

    fn sum(&self, vcpu: bool, f: impl Fn(&ThreadWindow) -> u64) -> u64 {
        self.threads
            .iter()
            .filter(|t| matches!(t.info.role, ThreadRole::Vcpu(_)) == vcpu)
            .filter(|t| vcpu || t.info.role == ThreadRole::Backend)
            .map(f)
            .sum()
    }

    pub fn vcpu_cpu_ns(&self) -> u64 {
        self.sum(true, |t| t.cpu_ns)
    }
    pub fn vcpu_wait_ns(&self) -> u64 {
        self.sum(true, |t| t.wait_ns)
    }
    pub fn backend_cpu_ns(&self) -> u64 {
        self.sum(false, |t| t.cpu_ns)
    }
    pub fn backend_wait_ns(&self) -> u64 {
        self.sum(false, |t| t.wait_ns)
    }

    /// Guest → back-end: the back-ends' run-queue wait, ms per MB moved (`None` with no bytes).
    pub fn guest_to_backend_ms_per_mb(&self) -> Option<f64> {
        ms_per_mb(self.backend_wait_ns(), self.bytes())
    }

    /// Back-end → guest: the vCPUs' run-queue wait, ms per MB moved (`None` with no bytes).
    pub fn backend_to_guest_ms_per_mb(&self) -> Option<f64> {
        ms_per_mb(self.vcpu_wait_ns(), self.bytes())
    }

    /// (CPU + run-queue wait) / wall, averaged over the vCPU threads.
    pub fn demand(&self) -> f64 {
        let vcpus = self
            .threads
            .iter()
            .filter(|t| matches!(t.info.role, ThreadRole::Vcpu(_)))
            .count();
        if vcpus == 0 || self.wall_ns == 0 {
            return 0.0;
        }
        (self.vcpu_cpu_ns() + self.vcpu_wait_ns()) as f64 / self.wall_ns as f64 / vcpus as f64
    }

    /// What the classifier gets from this window.
    pub fn observation(&self) -> Observation {
        let secs = self.wall_ns as f64 / 1e9;
        if secs <= 0.0 {
            return Observation::default();
        }
        Observation {
            demand: self.demand(),
            io_bytes_per_s: self.bytes() as f64 / secs,
            events_per_s: (self.kicks + self.irqs) as f64 / secs,
        }
    }
}

/// `wait_ns` per MB of `bytes`, in ms.
pub fn ms_per_mb(wait_ns: u64, bytes: u64) -> Option<f64> {
    (bytes > 0).then(|| (wait_ns as f64 / 1e6) / (bytes as f64 / 1e6))
}

/// Running totals over every window of a VM, and their publication in the registry under
/// `monitor.*`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Totals {
    pub windows: u64,
    pub wall_ns: u64,
    pub bytes: u64,
    pub kicks: u64,
    pub irqs: u64,
    pub vcpu_cpu_ns: u64,
    pub vcpu_wait_ns: u64,
    pub backend_cpu_ns: u64,
    pub backend_wait_ns: u64,
    pub kvm: KvmWindow,
}

impl Totals {
    pub fn add(&mut self, w: &Window) {
        self.windows += 1;
        self.wall_ns += w.wall_ns;
        self.bytes += w.bytes();
        self.kicks += w.kicks;
        self.irqs += w.irqs;
        self.vcpu_cpu_ns += w.vcpu_cpu_ns();
        self.vcpu_wait_ns += w.vcpu_wait_ns();
        self.backend_cpu_ns += w.backend_cpu_ns();
        self.backend_wait_ns += w.backend_wait_ns();
        self.kvm.exits += w.kvm.exits;
        self.kvm.io_exits += w.kvm.io_exits;
        self.kvm.mmio_exits += w.kvm.mmio_exits;
        self.kvm.halt_exits += w.kvm.halt_exits;
        self.kvm.halt_wakeup += w.kvm.halt_wakeup;
        self.kvm.irq_injections += w.kvm.irq_injections;
    }

    /// Guest → back-end ms per MB over the whole run so far.
    pub fn guest_to_backend_ms_per_mb(&self) -> Option<f64> {
        ms_per_mb(self.backend_wait_ns, self.bytes)
    }

    /// Back-end → guest ms per MB over the whole run so far.
    pub fn backend_to_guest_ms_per_mb(&self) -> Option<f64> {
        ms_per_mb(self.vcpu_wait_ns, self.bytes)
    }
}

/// µs per MB as a whole number, for a registry gauge (which holds integers).
fn us(ms_per_mb: Option<f64>) -> u64 {
    ms_per_mb.map(|m| (m * 1000.0).round() as u64).unwrap_or(0)
}

/// Publishes the latest window and the totals as `monitor.*` gauges (integers: ms/MB figures
/// as µs per MB, demand in thousandths), and each thread's cumulative figures as
/// `monitor.thread.<name>.*`.
pub fn publish(stats: &StatsRegistry, latest: &Window, totals: &Totals, last: &Sample) {
    let set = |name: &str, v: u64| stats.counter(format!("monitor.{name}")).set(v);
    set("windows", totals.windows);
    set("wall_ms", totals.wall_ns / 1_000_000);
    set("bytes", totals.bytes);
    set("kicks", totals.kicks);
    set("irqs", totals.irqs);
    set("vcpu_cpu_ns", totals.vcpu_cpu_ns);
    set("vcpu_wait_ns", totals.vcpu_wait_ns);
    set("backend_cpu_ns", totals.backend_cpu_ns);
    set("backend_wait_ns", totals.backend_wait_ns);
    set("kvm.exits", totals.kvm.exits);
    set("kvm.io_exits", totals.kvm.io_exits);
    set("kvm.mmio_exits", totals.kvm.mmio_exits);
    set("kvm.halt_exits", totals.kvm.halt_exits);
    set("kvm.halt_wakeup", totals.kvm.halt_wakeup);
    set("kvm.irq_injections", totals.kvm.irq_injections);
    set(
        "guest_to_backend_us_per_mb",
        us(totals.guest_to_backend_ms_per_mb()),
    );
    set(
        "backend_to_guest_us_per_mb",
        us(totals.backend_to_guest_ms_per_mb()),
    );
    set("last.wall_ms", latest.wall_ns / 1_000_000);
    set("last.bytes", latest.bytes());
    set("last.kicks", latest.kicks);
    set("last.irqs", latest.irqs);
    set(
        "last.demand_milli",
        (latest.demand() * 1000.0).round() as u64,
    );
    set(
        "last.guest_to_backend_us_per_mb",
        us(latest.guest_to_backend_ms_per_mb()),
    );
    set(
        "last.backend_to_guest_us_per_mb",
        us(latest.backend_to_guest_ms_per_mb()),
    );
    for t in &last.threads {
        let name = t.info.name.replace('.', "_");
        let tset = |k: &str, v: u64| stats.counter(format!("monitor.thread.{name}.{k}")).set(v);
        tset("cpu_ns", t.sched.cpu_ns);
        tset("wait_ns", t.sched.wait_ns);
        tset("timeslices", t.sched.timeslices);
        tset("nonvoluntary_ctxt_switches", t.ctxt.nonvoluntary);
        tset("voluntary_ctxt_switches", t.ctxt.voluntary);
    }
}

/// The latest window and the totals as JSON (for the state directory's `vms/<pid>.json`).
pub fn to_json(latest: &Window, totals: &Totals) -> serde_json::Value {
    serde_json::json!({
        "windows": totals.windows,
        "window_ms": latest.wall_ns as f64 / 1e6,
        "demand": latest.demand(),
        "bytes_per_s": latest.observation().io_bytes_per_s,
        "events_per_s": latest.observation().events_per_s,
        "device_bytes": latest.device_bytes,
        "kicks": latest.kicks,
        "irqs": latest.irqs,
        "halt_exits": latest.kvm.halt_exits,
        "exits": latest.kvm.exits,
        "guest_to_backend_ms_per_mb": latest.guest_to_backend_ms_per_mb(),
        "backend_to_guest_ms_per_mb": latest.backend_to_guest_ms_per_mb(),
        "total": {
            "bytes": totals.bytes,
            "wall_ms": totals.wall_ns as f64 / 1e6,
            "guest_to_backend_ms_per_mb": totals.guest_to_backend_ms_per_mb(),
            "backend_to_guest_ms_per_mb": totals.backend_to_guest_ms_per_mb(),
        },
        "threads": latest.threads.iter().map(|t| serde_json::json!({
            "tid": t.info.tid,
            "name": t.info.name,
            "cpu_ns": t.cpu_ns,
            "wait_ns": t.wait_ns,
            "nonvoluntary_ctxt_switches": t.nonvoluntary,
        })).collect::<Vec<_>>(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(tid: i32, name: &str, role: ThreadRole) -> ThreadInfo {
        ThreadInfo {
            tid,
            name: name.into(),
            role,
        }
    }

    fn ts(tid: i32, name: &str, role: ThreadRole, cpu: u64, wait: u64) -> ThreadSample {
        ThreadSample {
            info: info(tid, name, role),
            sched: SchedStat {
                cpu_ns: cpu,
                wait_ns: wait,
                timeslices: cpu / 1000,
            },
            ctxt: CtxSwitches {
                voluntary: 1,
                nonvoluntary: 2,
            },
        }
    }

    #[test]
    fn parses_schedstat_and_status() {
        assert_eq!(
            parse_schedstat("808392 227519 1\n"),
            Some(SchedStat {
                cpu_ns: 808392,
                wait_ns: 227519,
                timeslices: 1
            })
        );
        assert_eq!(parse_schedstat("1 2"), None);
        assert_eq!(parse_schedstat("a b c"), None);
        let status = "Name:\tlucid-vcpu0\nState:\tS (sleeping)\nvoluntary_ctxt_switches:\t12\n\
                      nonvoluntary_ctxt_switches:\t3\n";
        assert_eq!(
            parse_ctxt_switches(status),
            Some(CtxSwitches {
                voluntary: 12,
                nonvoluntary: 3
            })
        );
        assert_eq!(parse_ctxt_switches("Name:\tx\n"), None);
    }

    #[test]
    fn reads_its_own_thread() {
        // SAFETY: gettid has no arguments and cannot fail.
        let tid = unsafe { libc::gettid() };
        // Burn a few ticks' worth: the kernel folds CPU time in at ticks and switches.
        let start = std::time::Instant::now();
        while start.elapsed() < std::time::Duration::from_millis(30) {
            std::hint::black_box(0u64);
        }
        let (s, c) = read_thread(tid).expect("schedstat of this thread");
        assert!(
            s.cpu_ns > 0 || s.timeslices > 0 || c.voluntary > 0,
            "{s:?} {c:?}"
        );
        assert!(read_thread(i32::MAX).is_err());
    }

    #[test]
    fn device_counters_are_recognised() {
        assert_eq!(
            device_bytes_counter("blk0.bytes_read"),
            Some(("blk0", true))
        );
        assert_eq!(
            device_bytes_counter("net12.tx_bytes"),
            Some(("net12", false))
        );
        assert_eq!(device_bytes_counter("dma.bytes_read"), None);
        assert_eq!(device_bytes_counter("serial.tx_bytes"), None);
        assert_eq!(device_bytes_counter("blk0.irq.intx"), None);
        assert_eq!(device_bytes_counter("0.tx_bytes"), None);
    }

    #[test]
    fn a_window_gives_rates_waits_and_ms_lost_per_mb_both_ways() {
        let mut a = Sample {
            at_ns: 1_000_000_000,
            threads: vec![
                ts(10, "lucid-vcpu0", ThreadRole::Vcpu(0), 1_000, 0),
                ts(11, "lucid-blk0-io", ThreadRole::Backend, 500, 100),
                ts(12, "lucid-serial", ThreadRole::Other, 0, 0),
            ],
            counters: BTreeMap::new(),
        };
        a.counters.insert("blk0.bytes_read".into(), 1_000_000);
        a.counters.insert("blk0.kicks".into(), 10);
        a.counters.insert("kvm.vcpu0.halt_exits".into(), 5);
        let mut b = a.clone();
        b.at_ns += 1_000_000_000;
        b.threads = vec![
            // 0.6 s on a CPU + 0.2 s waiting.
            ts(
                10,
                "lucid-vcpu0",
                ThreadRole::Vcpu(0),
                600_001_000,
                200_000_000,
            ),
            ts(
                11,
                "lucid-blk0-io",
                ThreadRole::Backend,
                100_000_500,
                4_000_100,
            ),
            ts(12, "lucid-serial", ThreadRole::Other, 9_000_000, 9_000_000),
            // Started during the window: counted from zero.
            ts(13, "lucid-net0-io", ThreadRole::Backend, 1_000, 1_000_000),
        ];
        b.counters.insert("blk0.bytes_read".into(), 2_000_000);
        b.counters.insert("blk0.bytes_written".into(), 1_000_000);
        b.counters.insert("net0.tx_bytes".into(), 2_000_000);
        // The same bytes as the worker's counters: not counted twice.
        b.counters.insert("net1.bytes_read".into(), 0);
        b.counters.insert("net1.tx_bytes".into(), 7_000_000);
        b.counters.insert("blk0.kicks".into(), 30);
        b.counters.insert("net0.irqs".into(), 70);
        b.counters.insert("kvm.vcpu0.halt_exits".into(), 25);
        b.counters.insert("kvm.vm.exits".into(), 999);
        let w = Window::between(&a, &b);
        assert_eq!(w.wall_ns, 1_000_000_000);
        assert_eq!(w.bytes(), 4_000_000);
        assert_eq!(w.device_bytes["blk0"], 2_000_000);
        assert_eq!(w.device_bytes["net0"], 2_000_000);
        assert_eq!(w.device_bytes["net1"], 0);
        assert_eq!((w.kicks, w.irqs), (20, 70));
        assert_eq!(w.kvm.halt_exits, 20);
        assert_eq!(w.kvm.exits, 0, "kvm.vm.* is not a vCPU's");
        assert_eq!(w.vcpu_wait_ns(), 200_000_000);
        // The Other thread is neither.
        assert_eq!(w.backend_wait_ns(), 4_000_000 + 1_000_000);
        assert!((w.demand() - 0.8).abs() < 1e-9);
        // 5 ms of back-end wait over 4 MB; 200 ms of vCPU wait over 4 MB.
        assert!((w.guest_to_backend_ms_per_mb().unwrap() - 1.25).abs() < 1e-9);
        assert!((w.backend_to_guest_ms_per_mb().unwrap() - 50.0).abs() < 1e-9);
        let o = w.observation();
        assert!((o.io_bytes_per_s - 4e6).abs() < 1e-6);
        assert!((o.events_per_s - 90.0).abs() < 1e-9);

        let mut totals = Totals::default();
        totals.add(&w);
        totals.add(&w);
        assert_eq!(totals.bytes, 8_000_000);
        assert!((totals.guest_to_backend_ms_per_mb().unwrap() - 1.25).abs() < 1e-9);
        let stats = StatsRegistry::new();
        publish(&stats, &w, &totals, &b);
        let snap = stats.snapshot();
        assert_eq!(snap["monitor.windows"], 2);
        assert_eq!(snap["monitor.guest_to_backend_us_per_mb"], 1250);
        assert_eq!(snap["monitor.backend_to_guest_us_per_mb"], 50_000);
        assert_eq!(snap["monitor.last.demand_milli"], 800);
        assert_eq!(snap["monitor.thread.lucid-vcpu0.wait_ns"], 200_000_000);
        let j = to_json(&w, &totals);
        assert_eq!(j["kicks"], 20);
        assert_eq!(j["threads"].as_array().unwrap().len(), 4);
    }

    #[test]
    fn no_bytes_no_ms_per_mb_and_counters_going_back_count_zero() {
        let a = Sample {
            at_ns: 5,
            threads: vec![ts(1, "v", ThreadRole::Vcpu(0), 100, 100)],
            counters: [("blk0.bytes_read".to_string(), 50)].into(),
        };
        let b = Sample {
            at_ns: 3,
            threads: vec![ts(1, "v", ThreadRole::Vcpu(0), 50, 50)],
            counters: [("blk0.bytes_read".to_string(), 10)].into(),
        };
        let w = Window::between(&a, &b);
        assert_eq!(w.wall_ns, 0);
        assert_eq!(w.bytes(), 0);
        assert_eq!(w.guest_to_backend_ms_per_mb(), None);
        assert_eq!(w.demand(), 0.0);
        assert_eq!(w.observation(), Observation::default());
    }
}
