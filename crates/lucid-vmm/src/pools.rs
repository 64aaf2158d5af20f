//! A VM in the host's CPU pools (`--pool`, docs/scheduling.md) and in low-noise mode
//! (`--low-noise`).
//!
//! With pools, every vCPU and back-end thread places itself in the VM's pool as it registers
//! (the `ThreadRegistry` hook: it sets its own affinity and joins the pool's cgroup), and a
//! `lucid-monitor` thread, every window (1 s by default), samples the VM (the monitor of
//! `lucid_pools::monitor`), publishes `monitor.*` and `vms/<pid>.json` in the pools' state
//! directory, runs the classifier (`--pool auto`) and re-places the VM's threads when it moves the
//! VM, without pausing it; halt polling follows the pool's policy.
//!
//! In low-noise mode the vCPU threads are pinned one per CPU (the highest CPUs) and everything
//! else (back-ends, console, signals, the caller) on the other CPUs; there is no monitor thread
//! and no periodic work: statistics are read once, at exit.
//!
//! Also the guest's WORK hypercall (`guest.work.*`).

use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use lucid_hv::kvm_bindings::kvm_regs;
use lucid_pools::classify::{Classifier, ClassifierConfig, Decision, Label};
use lucid_pools::monitor::{self, Sample, Totals, Window};
use lucid_seccomp::{Role, Seccomp};
use lucid_stats::{StatsRegistry, ThreadInfo, ThreadRole};

use crate::hooks::{ExitHooks, HYPERCALL_UNKNOWN};
use crate::vm::hypercall;

/// Which pool a VM runs in (`--pool`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum PoolChoice {
    /// Not in any pool: Linux places the threads.
    None,
    /// The classifier's choice when the host has pools defined, else `None`.
    #[default]
    Auto,
    /// This pool, pinned by hand: the classifier still labels the VM but never moves it.
    Named(String),
}

impl FromStr for PoolChoice {
    type Err = PoolsError;
    fn from_str(s: &str) -> Result<Self, PoolsError> {
        match s {
            "none" => Ok(PoolChoice::None),
            "auto" => Ok(PoolChoice::Auto),
            "" => Err(PoolsError::BadChoice(s.into())),
            n if n
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_') =>
            {
                Ok(PoolChoice::Named(n.into()))
            }
            _ => Err(PoolsError::BadChoice(s.into())),
        }
    }
}

impl std::fmt::Display for PoolChoice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PoolChoice::None => f.write_str("none"),
            PoolChoice::Auto => f.write_str("auto"),
            PoolChoice::Named(n) => f.write_str(n),
        }
    }
}

/// The monitor's window and the classifier's thresholds and timing (tests shorten them).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MonitorTuning {
    pub window: Duration,
    pub classifier: ClassifierConfig,
}

impl Default for MonitorTuning {
    fn default() -> Self {
        MonitorTuning {
            window: Duration::from_secs(1),
            classifier: ClassifierConfig::default(),
        }
    }
}

/// What stops a VM from joining its pool or running low-noise, and how to fix it.
#[derive(Debug, thiserror::Error)]
pub enum PoolsError {
    #[error("--pool {0:?}: expected none, auto or a pool name (letters, digits, - and _)")]
    BadChoice(String),
    #[error(
        "--pool {name}: no such pool in {dir} (pools: {known}); create it with `lucid pools \
         create --def {name}=...` or choose --pool auto or none"
    )]
    NoPool {
        name: String,
        dir: PathBuf,
        known: String,
    },
    #[error("{path}: bad pool definitions: {reason}; recreate them with `lucid pools create`")]
    BadDefinition { path: PathBuf, reason: String },
    #[error("cannot read {path}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "--low-noise pins each vCPU to its own CPU and needs one more for everything else: \
         {vcpus} vCPUs, {cpus} usable host CPUs; use fewer --vcpus"
    )]
    LowNoiseCpus { vcpus: u8, cpus: usize },
    #[error("--low-noise and --pool {0} exclude each other (low-noise places threads itself)")]
    LowNoiseWithPool(String),
    #[error("cannot set the affinity of the calling thread for --low-noise")]
    Affinity(#[source] std::io::Error),
    #[error("cannot start the monitor thread")]
    Thread(#[source] std::io::Error),
}

// ---------------------------------------------------------------------------------------------
// Pool definitions and placement.
// LEAD: replace with lucid_pools::def (PoolSet/PoolDef/Policy and the state directory) and
// lucid_pools::place / lucid_pools::policy (Placer::place, policies, admission) at merge.
// ---------------------------------------------------------------------------------------------

/// A pool's policy, as far as the VMM needs it here.
// LEAD: replace with lucid_pools::policy::Policy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum LocalPolicy {
    Noop,
    Io,
    Cpu,
    Default,
}

impl LocalPolicy {
    fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "noop" => LocalPolicy::Noop,
            "io" => LocalPolicy::Io,
            "cpu" => LocalPolicy::Cpu,
            "default" => LocalPolicy::Default,
            _ => return None,
        })
    }

    /// Halt polling for VMs in the pool: `io` polls (KVM's usual 200 µs), `cpu` never does,
    /// the others keep the host's default.
    fn halt_poll_ns(self) -> Option<u32> {
        match self {
            LocalPolicy::Io => Some(200_000),
            LocalPolicy::Cpu => Some(0),
            LocalPolicy::Noop | LocalPolicy::Default => None,
        }
    }

    /// The classifier label a pool of this policy serves.
    fn label(self) -> Label {
        match self {
            LocalPolicy::Io => Label::IoBound,
            LocalPolicy::Cpu => Label::CpuBound,
            LocalPolicy::Noop | LocalPolicy::Default => Label::Unknown,
        }
    }
}

/// One pool as read from the state directory.
// LEAD: replace with lucid_pools::def::PoolDef.
#[derive(Clone, Debug, PartialEq, Eq)]
struct LocalPoolDef {
    name: String,
    cpus: Vec<u32>,
    policy: LocalPolicy,
    backends: bool,
}

/// The state directory every Lucid process on the host joins (`LUCID_POOLS_DIR`).
// LEAD: replace with lucid_pools::def's state-dir function.
fn state_dir() -> PathBuf {
    std::env::var_os("LUCID_POOLS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/run/lucid/pools"))
}

/// The pools' cgroup root name (`LUCID_POOLS_CGROUP`).
// LEAD: replace with lucid_pools::def's cgroup root.
fn cgroup_root() -> String {
    std::env::var("LUCID_POOLS_CGROUP").unwrap_or_else(|_| "lucid-pools".into())
}

/// Parses `0-2,5` or a JSON array of CPU numbers.
fn parse_cpus(v: &serde_json::Value) -> Option<Vec<u32>> {
    if let Some(a) = v.as_array() {
        return a
            .iter()
            .map(|c| c.as_u64().and_then(|c| u32::try_from(c).ok()))
            .collect();
    }
    let mut cpus = Vec::new();
    for part in v.as_str()?.split(',').filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b) = (a.trim().parse::<u32>().ok()?, b.trim().parse::<u32>().ok()?);
                if b < a || b - a > 4096 {
                    return None;
                }
                cpus.extend(a..=b);
            }
            None => cpus.push(part.trim().parse().ok()?),
        }
    }
    Some(cpus)
}

/// `pools.json`: `{"pools": [{"name", "cpus", "policy", "backends"}]}` (or the bare array).
// LEAD: replace with lucid_pools::def::PoolSet's reader.
fn parse_pools(text: &str) -> Result<Vec<LocalPoolDef>, String> {
    let v: serde_json::Value = serde_json::from_str(text).map_err(|e| e.to_string())?;
    let list = v
        .get("pools")
        .unwrap_or(&v)
        .as_array()
        .ok_or("no \"pools\" array")?;
    let mut out: Vec<LocalPoolDef> = Vec::new();
    for p in list {
        let name = p["name"]
            .as_str()
            .ok_or("a pool without a name")?
            .to_string();
        let cpus = parse_cpus(&p["cpus"])
            .filter(|c| !c.is_empty() && c.iter().all(|&c| c < libc::CPU_SETSIZE as u32))
            .ok_or_else(|| format!("pool {name}: bad cpus"))?;
        let policy = match &p["policy"] {
            serde_json::Value::Null => LocalPolicy::Default,
            v => v
                .as_str()
                .and_then(LocalPolicy::parse)
                .ok_or_else(|| format!("pool {name}: bad policy {v}"))?,
        };
        if out.iter().any(|o| o.name == name) {
            return Err(format!("pool {name} defined twice"));
        }
        out.push(LocalPoolDef {
            name,
            cpus,
            policy,
            backends: p["backends"].as_bool().unwrap_or(false),
        });
    }
    Ok(out)
}

/// Sets the affinity of thread `tid` (0: the calling thread).
// LEAD: replace with lucid_pools::place (Affinity backend).
fn set_affinity(tid: i32, cpus: &[u32]) -> std::io::Result<()> {
    // SAFETY: cpu_set_t is plain data; CPU_SET gets indices below CPU_SETSIZE (checked when the
    // pools were read or the CPUs chosen) and sched_setaffinity a valid pointer and its size.
    let rc = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        for &c in cpus {
            if (c as usize) < libc::CPU_SETSIZE as usize {
                libc::CPU_SET(c as usize, &mut set);
            }
        }
        libc::sched_setaffinity(tid, std::mem::size_of::<libc::cpu_set_t>(), &set)
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// The CPUs the calling thread may run on.
fn allowed_cpus() -> Vec<u32> {
    // SAFETY: as in `set_affinity`; CPU_ISSET reads the set the kernel filled.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return Vec::new();
        }
        (0..libc::CPU_SETSIZE as usize)
            .filter(|&c| libc::CPU_ISSET(c, &set))
            .map(|c| c as u32)
            .collect()
    }
}

/// The pool's cgroup task list, opened for writing when the pool has a cgroup (cpuset v1
/// `tasks`, or v2 `cgroup.threads`); `None` places by affinity alone.
// LEAD: replace with lucid_pools::place (CpusetV1/CpusetV2 backends).
fn open_tasks(pool: &str) -> Option<File> {
    let root = cgroup_root();
    [
        format!("/sys/fs/cgroup/cpuset/{root}/{pool}/tasks"),
        format!("/sys/fs/cgroup/{root}/{pool}/cgroup.threads"),
    ]
    .iter()
    .find_map(|p| std::fs::OpenOptions::new().write(true).open(p).ok())
}

/// A pool, ready to take threads.
struct Pool {
    def: LocalPoolDef,
    tasks: Option<File>,
}

impl Pool {
    /// Puts `tid` (its real TID, also when it is the caller) in the pool: the cgroup first (a
    /// cpuset move resets the affinity), then the affinity.
    // LEAD: replace with lucid_pools::place::Placer::place + the pool's policy.
    fn place(&self, tid: i32, self_call: bool) -> std::io::Result<()> {
        if let Some(f) = &self.tasks {
            f.write_all_at(tid.to_string().as_bytes(), 0)?;
        }
        set_affinity(if self_call { 0 } else { tid }, &self.def.cpus)
    }
}

// ---------------------------------------------------------------------------------------------

/// What the placement hook and the monitor share.
struct Shared {
    pools: Vec<Pool>,
    /// The pool of the VM's back-ends when a pool takes them (`backends=on`).
    backend_pool: Option<usize>,
    state: Mutex<State>,
    stats: Arc<StatsRegistry>,
    vm: lucid_hv::Vm,
    /// The host's halt polling (the module parameter), for pools whose policy keeps it.
    default_halt_poll_ns: Option<u32>,
    has_halt_poll: bool,
}

struct State {
    /// The pool of the VM's vCPUs.
    current: usize,
    /// Where each thread was put.
    placed: HashMap<i32, usize>,
}

impl Shared {
    /// The pool a thread of `role` belongs in while the VM is in pool `current`; `None` leaves
    /// it where it is.
    fn target(&self, role: &ThreadRole, current: usize) -> Option<usize> {
        match role {
            ThreadRole::Vcpu(_) => Some(current),
            ThreadRole::Backend => Some(self.backend_pool.unwrap_or(current)),
            ThreadRole::Other => None,
        }
    }

    /// Places thread `t` if it is not where it belongs; `self_call` when `t` is the caller.
    fn place(&self, t: &ThreadInfo, self_call: bool) {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let Some(target) = self.target(&t.role, st.current) else {
            return;
        };
        if st.placed.get(&t.tid) == Some(&target) {
            return;
        }
        match self.pools[target].place(t.tid, self_call) {
            Ok(()) => {
                st.placed.insert(t.tid, target);
                self.stats.counter("pools.placements").inc();
            }
            Err(e) => {
                self.stats.counter("pools.place_errors").inc();
                log::warn!(
                    "{} (tid {}): cannot place it in pool {}: {e}",
                    t.name,
                    t.tid,
                    self.pools[target].def.name
                );
            }
        }
    }

    /// Sets halt polling for the policy of pool `i`.
    fn halt_poll(&self, i: usize) {
        if !self.has_halt_poll {
            return;
        }
        let Some(ns) = self.pools[i]
            .def
            .policy
            .halt_poll_ns()
            .or(self.default_halt_poll_ns)
        else {
            return;
        };
        match self.vm.set_halt_poll_ns(ns) {
            Ok(()) => self.stats.counter("pools.halt_poll_ns").set(ns.into()),
            Err(e) => log::warn!(
                "halt polling {ns} ns for pool {}: {e}",
                self.pools[i].def.name
            ),
        }
    }

    fn current(&self) -> usize {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).current
    }
}

/// The VM's part in the pools: the hook that places threads as they start, and the monitor.
pub(crate) struct Pools {
    shared: Arc<Shared>,
    auto: bool,
    tuning: MonitorTuning,
    /// `vms/<pid>.json` in the state directory, opened before confinement.
    json: Option<(File, PathBuf)>,
    vm_name: String,
    stop: Arc<(Mutex<bool>, Condvar)>,
    monitor: Option<JoinHandle<()>>,
    /// The VM's threads confine themselves (then this one may not unlink at drop).
    confined: bool,
}

impl Pools {
    /// Joins the host's pools as `choice` says: `Ok(None)` when the VM runs in none. Installs the
    /// placement hook, so threads that register from now on place themselves.
    pub fn join(
        choice: &PoolChoice,
        tuning: MonitorTuning,
        vm: &lucid_hv::Vm,
        stats: &Arc<StatsRegistry>,
        vm_name: &str,
    ) -> Result<Option<Self>, PoolsError> {
        if *choice == PoolChoice::None {
            return Ok(None);
        }
        let dir = state_dir();
        let path = dir.join("pools.json");
        let defs = match std::fs::read_to_string(&path) {
            Ok(text) => parse_pools(&text).map_err(|reason| PoolsError::BadDefinition {
                path: path.clone(),
                reason,
            })?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(source) => return Err(PoolsError::Io { path, source }),
        };
        // Pools that take VMs (not the back-ends' own pool).
        let vm_pools: Vec<usize> = (0..defs.len()).filter(|&i| !defs[i].backends).collect();
        let (current, auto) = match choice {
            PoolChoice::Named(name) => match defs.iter().position(|d| &d.name == name) {
                Some(i) => (i, false),
                None => {
                    return Err(PoolsError::NoPool {
                        name: name.clone(),
                        dir,
                        known: match defs.is_empty() {
                            true => "none defined".into(),
                            false => defs
                                .iter()
                                .map(|d| d.name.as_str())
                                .collect::<Vec<_>>()
                                .join(", "),
                        },
                    })
                }
            },
            _ if vm_pools.is_empty() => {
                log::info!(
                    "--pool auto: no pools defined on this host ({}): the VM runs in none",
                    path.display()
                );
                return Ok(None);
            }
            // Auto starts in the default-policy pool if there is one, else the first.
            _ => (
                vm_pools
                    .iter()
                    .copied()
                    .find(|&i| defs[i].policy == LocalPolicy::Default)
                    .unwrap_or(vm_pools[0]),
                true,
            ),
        };
        let backend_pool = defs.iter().position(|d| d.backends);
        let pools: Vec<Pool> = defs
            .into_iter()
            .map(|def| Pool {
                tasks: open_tasks(&def.name),
                def,
            })
            .collect();
        let json = open_vm_json(&dir);
        let default_halt_poll_ns =
            std::fs::read_to_string("/sys/module/kvm/parameters/halt_poll_ns")
                .ok()
                .and_then(|s| s.trim().parse().ok());
        let has_halt_poll = vm.has_halt_poll();
        if !has_halt_poll {
            log::info!("pools: this KVM cannot set halt polling per VM (KVM_CAP_HALT_POLL)");
        }
        let shared = Arc::new(Shared {
            pools,
            backend_pool,
            state: Mutex::new(State {
                current,
                placed: HashMap::new(),
            }),
            stats: stats.clone(),
            vm: vm.clone(),
            default_halt_poll_ns,
            has_halt_poll,
        });
        shared.halt_poll(current);
        stats.counter("pools.current").set(current as u64);
        log::info!(
            "pools: the VM runs in pool {} ({}){}",
            shared.pools[current].def.name,
            shared.pools[current]
                .def
                .cpus
                .iter()
                .map(u32::to_string)
                .collect::<Vec<_>>()
                .join(","),
            if auto {
                ", moved by the classifier"
            } else {
                ", pinned"
            }
        );
        // Weak: the hook lives in the stats registry, which `Shared` holds.
        let weak: Weak<Shared> = Arc::downgrade(&shared);
        stats
            .threads()
            .set_on_register(Some(Arc::new(move |t: &ThreadInfo| {
                if let Some(s) = weak.upgrade() {
                    s.place(t, true);
                }
            })));
        Ok(Some(Pools {
            shared,
            auto,
            tuning,
            json,
            vm_name: vm_name.into(),
            stop: Arc::new((Mutex::new(false), Condvar::new())),
            monitor: None,
            confined: false,
        }))
    }

    /// Starts `lucid-monitor`.
    pub fn start_monitor(&mut self, seccomp: &Option<Seccomp>) -> Result<(), PoolsError> {
        self.confined = seccomp.is_some();
        let mut m = Monitor {
            shared: self.shared.clone(),
            auto: self.auto,
            tuning: self.tuning,
            json: self.json.as_ref().and_then(|(f, _)| f.try_clone().ok()),
            vm_name: self.vm_name.clone(),
            stop: self.stop.clone(),
        };
        let seccomp = seccomp.clone();
        let stats = self.shared.stats.clone();
        let t = std::thread::Builder::new()
            .name("lucid-monitor".into())
            .spawn(move || {
                let _registered = stats.threads().register_current(ThreadRole::Other);
                if let Err(e) = lucid_seccomp::confine(seccomp.as_ref(), Role::Monitor) {
                    // Never run unconfined; the VM runs on where it was placed.
                    log::error!("lucid-monitor: {e}");
                    return;
                }
                m.run()
            })
            .map_err(PoolsError::Thread)?;
        self.monitor = Some(t);
        Ok(())
    }

    /// Stops the monitor after a last window and joins it.
    pub fn stop(&mut self) {
        let (lock, cv) = &*self.stop;
        *lock.lock().unwrap_or_else(|e| e.into_inner()) = true;
        cv.notify_all();
        if let Some(t) = self.monitor.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Pools {
    fn drop(&mut self) {
        self.stop();
        self.shared.stats.threads().set_on_register(None);
        // A confined thread cannot unlink (nor this one truncate): the monitor left the file
        // empty, which readers (and `lucid pools`' stale-pid cleanup) take as gone; unconfined,
        // remove it.
        if let (Some((_, path)), false) = (&self.json, self.confined) {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// `<dir>/vms/<pid>.json`, created (with `vms/`) now, before any thread is confined.
fn open_vm_json(dir: &Path) -> Option<(File, PathBuf)> {
    let vms = dir.join("vms");
    let path = vms.join(format!("{}.json", std::process::id()));
    let opened = std::fs::create_dir_all(&vms).and_then(|()| {
        std::fs::OpenOptions::new()
            .create(true)
            .truncate(true)
            .write(true)
            .open(&path)
    });
    match opened {
        Ok(f) => Some((f, path)),
        Err(e) => {
            log::warn!(
                "pools: cannot write {} ({e}): `lucid pools show` will not list this VM",
                path.display()
            );
            None
        }
    }
}

/// The `lucid-monitor` thread's state.
struct Monitor {
    shared: Arc<Shared>,
    auto: bool,
    tuning: MonitorTuning,
    json: Option<File>,
    vm_name: String,
    stop: Arc<(Mutex<bool>, Condvar)>,
}

impl Monitor {
    /// Waits one window; `true` once asked to stop.
    fn wait(&self) -> bool {
        let (lock, cv) = &*self.stop;
        let stopped = lock.lock().unwrap_or_else(|e| e.into_inner());
        let (stopped, _) = cv
            .wait_timeout_while(stopped, self.tuning.window, |s| !*s)
            .unwrap_or_else(|e| e.into_inner());
        *stopped
    }

    fn run(&mut self) {
        let s = &self.shared;
        let origin = Instant::now();
        let at = |t: Instant| t.duration_since(origin).as_nanos() as u64;
        let mut last = Sample::take(&s.stats, 0);
        let mut totals = Totals::default();
        let current_label = s.pools[s.current()].def.policy.label();
        let mut classifier = Classifier::new(self.tuning.classifier, current_label, Duration::ZERO);
        let (moves, label) = (
            s.stats.counter("monitor.moves"),
            s.stats.counter("monitor.label"),
        );
        loop {
            let stopping = self.wait();
            let now = Instant::now();
            let sample = Sample::take(&s.stats, at(now));
            let window = Window::between(&last, &sample);
            totals.add(&window);
            monitor::publish(&s.stats, &window, &totals, &sample);
            // The last window is cut short by the VM's end (its vCPUs gone): not a workload.
            let decision = match stopping {
                true => Decision::Stay,
                false => classifier.observe(window.observation(), now.duration_since(origin)),
            };
            label.set(classifier.label().code());
            if let (Decision::Move(to), true) = (decision, self.auto) {
                if let Some(i) = s
                    .pools
                    .iter()
                    .position(|p| p.def.policy.label() == to && !p.def.backends)
                {
                    self.move_to(i, to);
                    moves.inc();
                    s.stats
                        .counter("monitor.moved_at_ms")
                        .set(now.duration_since(origin).as_millis() as u64);
                }
            }
            // Threads that started since (or whose hook could not place them) join now.
            // LEAD: with lucid_pools::policy, also run the no-op pool's `Admission::poll()` (a
            // waiting back-end is admitted when a slot frees) and one tick of the io policy's
            // boost ladder for the VM's threads here, once per window.
            for t in &sample.threads {
                s.place(&t.info, false);
            }
            self.publish_json(&window, &totals, &classifier);
            last = sample;
            if stopping {
                break;
            }
        }
        // The VM is going: an empty file is a VM gone (the drop removes it where it may).
        if let Some(f) = &self.json {
            let _ = f.set_len(0);
        }
    }

    /// Moves the VM to pool `i`: no pause, its threads are placed one by one while it runs.
    fn move_to(&self, i: usize, why: Label) {
        let s = &self.shared;
        let from = {
            let mut st = s.state.lock().unwrap_or_else(|e| e.into_inner());
            std::mem::replace(&mut st.current, i)
        };
        log::info!(
            "pools: the VM looks {why}-bound: moving it from pool {} to {}",
            s.pools[from].def.name,
            s.pools[i].def.name
        );
        s.stats.counter("pools.current").set(i as u64);
        for t in s.stats.threads().list() {
            s.place(&t, false);
        }
        s.halt_poll(i);
    }

    /// Rewrites `vms/<pid>.json` (one `pwrite` and a truncate: readers retry a torn read).
    fn publish_json(&self, w: &Window, totals: &Totals, c: &Classifier) {
        let Some(f) = &self.json else { return };
        let s = &self.shared;
        let st = s.state.lock().unwrap_or_else(|e| e.into_inner());
        let pool_of = |i: Option<&usize>| i.map(|&i| s.pools[i].def.name.clone());
        let threads: Vec<_> = s
            .stats
            .threads()
            .list()
            .iter()
            .map(|t| {
                serde_json::json!({
                    "tid": t.tid,
                    "name": t.name,
                    "role": match t.role {
                        ThreadRole::Vcpu(_) => "vcpu",
                        ThreadRole::Backend => "backend",
                        ThreadRole::Other => "other",
                    },
                    "pool": pool_of(st.placed.get(&t.tid)),
                })
            })
            .collect();
        let doc = serde_json::json!({
            "pid": std::process::id(),
            "name": self.vm_name,
            "pool": s.pools[st.current].def.name,
            "pinned": !self.auto,
            "label": c.label().name(),
            "threads": threads,
            "monitor": monitor::to_json(w, totals),
            "updated_unix_ms": std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_millis() as u64)
                .unwrap_or(0),
        });
        drop(st);
        let text = doc.to_string() + "\n";
        if f.write_all_at(text.as_bytes(), 0).is_ok() {
            let _ = f.set_len(text.len() as u64);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Low-noise mode.

/// Pins the caller (and so every thread it starts from now on) to the CPUs left after the
/// vCPUs take the highest ones, one each, and installs the hook that puts each vCPU on its CPU
/// and every other thread (a back-end started by a vCPU inherits its CPU) back on the others.
pub(crate) fn low_noise(
    vcpus: u8,
    choice: &PoolChoice,
    stats: &Arc<StatsRegistry>,
) -> Result<(), PoolsError> {
    if let PoolChoice::Named(n) = choice {
        return Err(PoolsError::LowNoiseWithPool(n.clone()));
    }
    let cpus = allowed_cpus();
    let (vcpu_cpus, rest) = split_low_noise(&cpus, vcpus).ok_or(PoolsError::LowNoiseCpus {
        vcpus,
        cpus: cpus.len(),
    })?;
    set_affinity(0, &rest).map_err(PoolsError::Affinity)?;
    log::info!("--low-noise: vCPUs on CPUs {vcpu_cpus:?}, everything else on {rest:?}");
    stats.counter("pools.low_noise").set(1);
    stats
        .threads()
        .set_on_register(Some(Arc::new(move |t: &ThreadInfo| {
            let cpus = match t.role {
                ThreadRole::Vcpu(n) => match vcpu_cpus.get(n as usize) {
                    Some(&c) => vec![c],
                    None => return,
                },
                _ => rest.clone(),
            };
            if let Err(e) = set_affinity(0, &cpus) {
                log::warn!("--low-noise: {} stays where it is: {e}", t.name);
            }
        })));
    Ok(())
}

/// What in `config` still wakes up on its own in low-noise mode (said once, as warnings): the
/// polling rungs (L4, L4p) and the vIOMMU's sidecore spin or sleep-poll on the non-vCPU CPUs.
/// Everything else in Lucid blocks until there is work: the virtio workers on L0-L3 wait in
/// `epoll_wait(-1)` (their timerfd is armed only for an interrupt-coalescing deadline), the
/// console writer on a condition variable, the input threads in `read`/`accept`, the signal
/// thread in `sigwait`, a paused vCPU on a condition variable (a 1 s safety net only while
/// paused), and statistics are read once, at exit.
pub(crate) fn low_noise_pollers(config: &crate::config::VmConfig) -> Vec<String> {
    let mut out = Vec::new();
    let (mut nblk, mut nnet) = (0, 0);
    for d in &config.pci {
        let name = match d.kind {
            crate::config::PciDeviceKind::Block(_) => {
                nblk += 1;
                format!("blk{}", nblk - 1)
            }
            crate::config::PciDeviceKind::Net(_) => {
                nnet += 1;
                format!("net{}", nnet - 1)
            }
        };
        if let lucid_pci::Rung::L4 { .. } = d.rung {
            out.push(format!(
                "{name} on rung {:?} polls its rings (on the non-vCPU CPUs)",
                d.rung
            ));
        }
    }
    if config
        .iommu
        .is_some_and(|c| c.mode == lucid_iommu::EmulationMode::Sidecore)
    {
        out.push("the vIOMMU's sidecore polls its register page (on the non-vCPU CPUs)".into());
    }
    out
}

/// vCPU i on the i-th highest CPU; the rest on the others. `None` without a CPU to spare.
fn split_low_noise(cpus: &[u32], vcpus: u8) -> Option<(Vec<u32>, Vec<u32>)> {
    let n = usize::from(vcpus);
    if n == 0 || cpus.len() <= n {
        return None;
    }
    let mut sorted = cpus.to_vec();
    sorted.sort_unstable();
    let rest = sorted[..sorted.len() - n].to_vec();
    let vcpu_cpus = sorted[sorted.len() - n..].iter().rev().copied().collect();
    Some((vcpu_cpus, rest))
}

// ---------------------------------------------------------------------------------------------

/// Hypercall WORK (rdi = kind, rsi = amount since the last call): the guest's own progress,
/// added to `guest.work.iterations` or `guest.work.bytes`. Unknown kinds return
/// `HYPERCALL_UNKNOWN`.
pub(crate) fn add_work_hypercall(hooks: &ExitHooks, stats: &Arc<StatsRegistry>) {
    let iterations = stats.counter("guest.work.iterations");
    let bytes = stats.counter("guest.work.bytes");
    let calls = stats.counter("guest.work.calls");
    hooks.add_hypercall(
        hypercall::WORK,
        Arc::new(move |_: u32, regs: &kvm_regs| {
            match regs.rdi {
                hypercall::WORK_ITERATIONS => iterations.add(regs.rsi),
                hypercall::WORK_BYTES => bytes.add(regs.rsi),
                _ => return HYPERCALL_UNKNOWN,
            }
            calls.inc();
            0
        }),
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pool_choices_parse() {
        assert_eq!("none".parse::<PoolChoice>().unwrap(), PoolChoice::None);
        assert_eq!("auto".parse::<PoolChoice>().unwrap(), PoolChoice::Auto);
        assert_eq!(
            "io-1".parse::<PoolChoice>().unwrap(),
            PoolChoice::Named("io-1".into())
        );
        for bad in ["", "a/b", "../x", "a b"] {
            assert!(bad.parse::<PoolChoice>().is_err(), "{bad:?}");
        }
        assert_eq!(PoolChoice::Named("x".into()).to_string(), "x");
    }

    #[test]
    fn pool_definitions_parse_and_bad_ones_are_refused() {
        let p = parse_pools(
            r#"{"pools":[{"name":"be","cpus":[1],"policy":"noop","backends":true},
                {"name":"io","cpus":"0-1","policy":"io"},{"name":"d","cpus":"0"}]}"#,
        )
        .unwrap();
        assert_eq!(p.len(), 3);
        assert!(p[0].backends && p[0].policy == LocalPolicy::Noop);
        assert_eq!(p[1].cpus, vec![0, 1]);
        assert_eq!(p[2].policy, LocalPolicy::Default);
        for bad in [
            "[",
            "{}",
            r#"[{"cpus":[0]}]"#,
            r#"[{"name":"a","cpus":[]}]"#,
            r#"[{"name":"a","cpus":"3-1"}]"#,
            r#"[{"name":"a","cpus":[99999]}]"#,
            r#"[{"name":"a","cpus":[0],"policy":"fast"}]"#,
            r#"[{"name":"a","cpus":[0]},{"name":"a","cpus":[1]}]"#,
        ] {
            assert!(parse_pools(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn policies_set_halt_polling_and_labels() {
        assert_eq!(LocalPolicy::Io.halt_poll_ns(), Some(200_000));
        assert_eq!(LocalPolicy::Cpu.halt_poll_ns(), Some(0));
        assert_eq!(LocalPolicy::Default.halt_poll_ns(), None);
        assert_eq!(LocalPolicy::Cpu.label(), Label::CpuBound);
        assert_eq!(LocalPolicy::Io.label(), Label::IoBound);
    }

    #[test]
    fn low_noise_takes_the_highest_cpus_for_vcpus() {
        assert_eq!(split_low_noise(&[0, 1], 1), Some((vec![1], vec![0])));
        assert_eq!(
            split_low_noise(&[3, 0, 2, 1], 2),
            Some((vec![3, 2], vec![0, 1]))
        );
        assert_eq!(split_low_noise(&[0, 1], 2), None);
        assert_eq!(split_low_noise(&[0], 1), None);
    }

    #[test]
    fn low_noise_names_what_still_polls() {
        let mut c = crate::config::VmConfig::new(crate::config::KernelSource::File("/k".into()));
        assert!(low_noise_pollers(&c).is_empty());
        c.pci.push(crate::config::parse_blk("path=/x").unwrap());
        c.pci
            .push(crate::config::parse_blk("path=/y,rung=L4").unwrap());
        let p = low_noise_pollers(&c);
        assert_eq!(p.len(), 1);
        assert!(p[0].starts_with("blk1 on rung L4"), "{p:?}");
    }

    #[test]
    fn the_work_hypercall_counts_iterations_and_bytes() {
        let hooks = ExitHooks::new();
        let stats = StatsRegistry::new();
        add_work_hypercall(&hooks, &stats);
        let call = |kind, amount| {
            let regs = kvm_regs {
                rax: hypercall::WORK,
                rdi: kind,
                rsi: amount,
                ..Default::default()
            };
            hooks.hypercall(0, &regs)
        };
        assert_eq!(call(hypercall::WORK_ITERATIONS, 5), Some(0));
        assert_eq!(call(hypercall::WORK_ITERATIONS, 7), Some(0));
        assert_eq!(call(hypercall::WORK_BYTES, 1 << 20), Some(0));
        assert_eq!(call(9, 1), Some(HYPERCALL_UNKNOWN));
        let snap = stats.snapshot();
        assert_eq!(snap["guest.work.iterations"], 12);
        assert_eq!(snap["guest.work.bytes"], 1 << 20);
        assert_eq!(snap["guest.work.calls"], 3);
    }
}
