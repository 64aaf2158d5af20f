//! A VM in the host's CPU pools (`--pool`, docs/scheduling.md) and in low-noise mode
//! (`--low-noise`).
//!
//! The pools are `lucid_pools`' (`lucid pools create`): this module opens their [`Placer`], the
//! VM's [`VmPublisher`] (`vms/<pid>.json`) and, when back-ends go to a `noop` pool, the files of
//! their admissions ([`AdmissionFiles`]) while the VM is built, before any thread confines
//! itself. Every vCPU and back-end thread then places itself in the VM's pool as it starts
//! (the spawner's placer, with [`Placer::place_thread`], which applies the pool's policy:
//! `io` slice, `cpu` SCHED_BATCH (not for back-ends, which keep the default policy there),
//! `noop` FIFO through admission), and a `lucid-monitor` thread,
//! every window (1 s by default), samples the VM (`lucid_pools::monitor`), publishes
//! `monitor.*` and `vms/<pid>.json`, runs the classifier (`--pool auto`) and re-places the VM's
//! threads with their new pool's policy when it moves the VM, without pausing it; it also polls
//! the no-op admissions (a waiting back-end is admitted when a slot frees, host-wide), gives up
//! the slots of exited threads and steps the `io` pool's boost ladder. Halt polling follows the
//! pool's policy.
//!
//! In low-noise mode the vCPU threads are pinned one per CPU (the highest CPUs) and everything
//! else (back-ends, console, signals, the caller) on the other CPUs; there is no monitor thread
//! and no periodic work: statistics are read once, at exit.
//!
//! Also the guest's WORK hypercall (`guest.work.*`).

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use lucid_hv::kvm_bindings::kvm_regs;
use lucid_pools::classify::{Classifier, ClassifierConfig, Decision, Label};
use lucid_pools::def::{DefError, Policy, PoolDef, StateDir, VmPublisher, VmRecord, VmThread};
use lucid_pools::monitor::{self, Sample, Totals, Window};
use lucid_pools::place::{PlaceError, Placed, Placer};
use lucid_pools::policy::{apply_boost, Admission, AdmissionFiles, Applied, BoostLadder};
use lucid_seccomp::Role;
use lucid_stats::{StatsRegistry, ThreadInfo, ThreadRole};
use lucid_thread::ThreadSpec;

use crate::hooks::{ExitHooks, HookError, HYPERCALL_UNKNOWN};
use crate::hypercall;

/// Which pool a VM runs in (`--pool`).
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
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
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
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
         create --def name={name},...` or choose --pool auto or none"
    )]
    NoPool {
        name: String,
        dir: PathBuf,
        known: String,
    },
    #[error(
        "--pool {0}: a noop pool takes device back-end threads only (one per CPU); choose a pool \
         with policy io, cpu or default, or --pool auto"
    )]
    NoopPool(String),
    #[error("cannot join the pools in {dir}; recreate them with `lucid pools destroy` and `lucid pools create`")]
    Def {
        dir: PathBuf,
        #[source]
        source: DefError,
    },
    #[error(
        "--low-noise pins each vCPU to its own CPU and needs one more for everything else: \
         {vcpus} vCPUs, {cpus} usable host CPUs; use fewer --vcpus"
    )]
    LowNoiseCpus { vcpus: u8, cpus: usize },
    #[error("cannot set the affinity of the calling thread for --low-noise")]
    Affinity(#[source] PlaceError),
    #[error(transparent)]
    Thread(#[from] lucid_thread::SpawnError),
}

/// How a thread was placed.
enum How {
    /// With its pool's policy; `base` for the `io` boost ladder.
    Policy { base: Applied, ladder: BoostLadder },
    /// In a `noop` pool: admitted or waiting.
    Noop(Admission),
}

/// Where a thread was put.
struct Placement {
    pool: usize,
    how: How,
}

/// What the placer and the monitor share.
struct Shared {
    placer: Placer,
    /// The pool of the VM's back-ends when a pool takes them (`backends=on`).
    backend_pool: Option<usize>,
    state: Mutex<State>,
    /// No-op admission files opened ahead (a confined thread may not open them).
    spare: Mutex<Vec<AdmissionFiles>>,
    /// Whether admission files may still be opened when none are spare (no seccomp).
    may_open: bool,
    /// `vms/<pid>.json`; the monitor empties it at its end (drop).
    publisher: Mutex<Option<VmPublisher>>,
    stats: Arc<StatsRegistry>,
    vm: lucid_hv::Vm,
    /// The host's halt polling (the module parameter), for pools whose policy keeps it.
    default_halt_poll_ns: Option<u32>,
    has_halt_poll: bool,
}

struct State {
    /// The pool of the VM's vCPUs.
    current: usize,
    placed: HashMap<i32, Placement>,
    /// (tid, pool) that failed to place: said once, retried quietly each window.
    failed: HashSet<(i32, usize)>,
    /// The monitor has ended: nothing is placed any more.
    closed: bool,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Shared {
    fn pools(&self) -> &[PoolDef] {
        self.placer.pools()
    }

    /// The pool a thread of `role` belongs in while the VM is in pool `current`; `None` leaves
    /// it where it is.
    fn target(&self, role: &ThreadRole, current: usize) -> Option<usize> {
        match role {
            ThreadRole::Vcpu(_) => Some(current),
            ThreadRole::Backend => Some(self.backend_pool.unwrap_or(current)),
            ThreadRole::Other => None,
        }
    }

    /// Admission files for `pool`: a spare set, else (without seccomp) newly opened ones.
    fn admission_files(&self, pool: &str) -> Option<AdmissionFiles> {
        let mut spare = lock(&self.spare);
        if let Some(i) = spare.iter().position(|f| f.pool() == pool) {
            return Some(spare.swap_remove(i));
        }
        drop(spare);
        if !self.may_open {
            return None;
        }
        AdmissionFiles::open(&self.placer, pool)
            .inspect_err(|e| log::warn!("pools: no-op admission in pool {pool}: {e}"))
            .ok()
    }

    /// Gives a no-op slot or ticket up and keeps its files for the next back-end.
    fn recycle(&self, a: Admission) {
        if a.is_admitted() {
            self.stats.counter("pools.noop_released").inc();
        }
        lock(&self.spare).push(a.into_files());
    }

    /// Forgets threads that left the registry (a back-end ends at a device reset): no-op
    /// slots and tickets they held go to the next waiter.
    fn reap(&self, st: &mut State) {
        let live: HashSet<i32> = self.stats.threads().list().iter().map(|t| t.tid).collect();
        let gone: Vec<i32> = st
            .placed
            .keys()
            .copied()
            .filter(|tid| !live.contains(tid))
            .collect();
        for tid in gone {
            if let Some(Placement {
                how: How::Noop(a), ..
            }) = st.placed.remove(&tid)
            {
                self.recycle(a);
            }
        }
        st.failed.retain(|(tid, _)| live.contains(tid));
    }

    /// Places thread `t` (with its pool's policy) if it is not where it belongs.
    fn place(&self, t: &ThreadInfo) {
        let mut st = lock(&self.state);
        // The monitor places the threads of a sample taken at its window's start: one that has
        // ended since may already be reaped (its no-op slot given on), and must not ask again.
        // Checked under the state lock: a live thread has not been reaped.
        if !self.stats.threads().is_registered(t.tid) {
            return;
        }
        let Some(target) = self.target(&t.role, st.current) else {
            return;
        };
        if st.closed || st.placed.get(&t.tid).is_some_and(|p| p.pool == target) {
            return;
        }
        // Leaving a no-op pool (a VM without a back-end pool moved): its slot goes.
        if let Some(Placement {
            how: How::Noop(a), ..
        }) = st.placed.remove(&t.tid)
        {
            self.recycle(a);
        }
        let def = &self.pools()[target];
        let result = match def.policy {
            Policy::Noop => {
                self.reap(&mut st);
                match self.admission_files(&def.name) {
                    Some(files) => {
                        self.stats.counter("pools.noop_requests").inc();
                        Admission::request_with(self.placer.clone(), t.tid, files)
                            .map(How::Noop)
                            .map_err(|r| {
                                lock(&self.spare).push(r.files);
                                r.error
                            })
                    }
                    None => {
                        if st.failed.insert((t.tid, target)) {
                            self.stats.counter("pools.noop_no_files").inc();
                            log::warn!(
                                "{} (tid {}): no no-op admission files left for pool {} (opened \
                                 before confinement, one per back-end): it stays where it is",
                                t.name,
                                t.tid,
                                def.name
                            );
                        }
                        return;
                    }
                }
            }
            // Back-ends are I/O threads: SCHED_BATCH (no wake-up preemption) would keep a
            // back-end waiting behind its VM's busy vCPU, starving the VM's I/O so much that
            // the classifier could no longer see it is I/O-bound. They take the pool's CPUs
            // with the default policy.
            Policy::Cpu if t.role == ThreadRole::Backend => {
                self.placer.place(t.tid, &def.name).and_then(|()| {
                    lucid_pools::policy::apply(t.tid, Policy::Default)
                        .map(|base| How::Policy {
                            base,
                            ladder: BoostLadder::default(),
                        })
                        .map_err(|source| PlaceError::Sched {
                            what: "set the policy of",
                            tid: t.tid,
                            source,
                        })
                })
            }
            _ => self.placer.place_thread(t.tid, &def.name).map(|p| match p {
                Placed::Policy(base) => How::Policy {
                    base,
                    ladder: BoostLadder::default(),
                },
                Placed::Noop(a) => How::Noop(a),
            }),
        };
        match result {
            Ok(how) => {
                if let How::Noop(a) = &how {
                    let c = match a.is_admitted() {
                        true => "pools.noop_admitted",
                        false => "pools.noop_waiting",
                    };
                    self.stats.counter(c).inc();
                }
                st.placed.insert(t.tid, Placement { pool: target, how });
                st.failed.remove(&(t.tid, target));
                self.stats.counter("pools.placements").inc();
            }
            Err(e) => {
                self.stats.counter("pools.place_errors").inc();
                if st.failed.insert((t.tid, target)) {
                    log::warn!(
                        "{} (tid {}): cannot place it in pool {}: {e}",
                        t.name,
                        t.tid,
                        def.name
                    );
                }
            }
        }
    }

    /// One window of no-op admission: admissions of threads that ended are given up, waiting
    /// back-ends are admitted when a slot freed (here or in another VM).
    fn poll_admissions(&self) {
        let mut st = lock(&self.state);
        self.reap(&mut st);
        let mut exited = Vec::new();
        for (&tid, p) in st.placed.iter_mut() {
            let How::Noop(a) = &mut p.how else { continue };
            if a.thread_exited() {
                exited.push(tid);
                continue;
            }
            if a.is_admitted() {
                continue;
            }
            match a.poll() {
                Ok(true) => {
                    self.stats.counter("pools.noop_admitted").inc();
                    let cpu = a.cpu().map_or("?".into(), |c| c.to_string());
                    log::info!(
                        "pools: back-end tid {tid} admitted to CPU {cpu} of pool {}",
                        a.pool()
                    );
                }
                Ok(false) => {}
                Err(e) => log::warn!("pools: admission of tid {tid}: {e}"),
            }
        }
        for tid in exited {
            if let Some(Placement {
                how: How::Noop(a), ..
            }) = st.placed.remove(&tid)
            {
                self.recycle(a);
            }
        }
        let waiting = st
            .placed
            .values()
            .filter(|p| matches!(&p.how, How::Noop(a) if !a.is_admitted()))
            .count();
        self.stats
            .counter("pools.noop_waiting_now")
            .set(waiting as u64);
    }

    /// One window of the `io` boost ladder (docs/scheduling.md): a thread that woke in the window
    /// climbs one step (nice -1, max -3), one that ran its slices out loses its boost, a quiet
    /// one decays a step.
    fn boost(&self, w: &Window) {
        let mut st = lock(&self.state);
        let mut boosted = 0;
        for t in &w.threads {
            let Some(p) = st.placed.get_mut(&t.info.tid) else {
                continue;
            };
            if self.placer.pools()[p.pool].policy != Policy::Io {
                continue;
            }
            let How::Policy { base, ladder } = &mut p.how else {
                continue;
            };
            let before = ladder.level();
            let after = ladder.window(t.voluntary > 0, t.nonvoluntary > t.voluntary);
            if after != before {
                match apply_boost(t.info.tid, base, after) {
                    Ok(()) => self.stats.counter("pools.boost_steps").inc(),
                    Err(e) => log::debug!("pools: boost of {}: {e}", t.info.name),
                }
            }
            if after > lucid_pools::policy::BoostLevel::Under {
                boosted += 1;
            }
        }
        self.stats.counter("pools.boosted").set(boosted);
    }

    /// Sets halt polling for the policy of pool `i`.
    fn halt_poll(&self, i: usize) {
        if !self.has_halt_poll {
            return;
        }
        let Some(ns) = self.pools()[i]
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
                self.pools()[i].name
            ),
        }
    }

    fn current(&self) -> usize {
        lock(&self.state).current
    }

    /// The end: gives every no-op slot and ticket up and empties `vms/<pid>.json` (on the
    /// monitor thread, whose role may truncate; the main thread's may not).
    fn close(&self) {
        let mut st = lock(&self.state);
        st.closed = true;
        for (_, p) in st.placed.drain() {
            if let How::Noop(a) = p.how {
                self.recycle(a);
            }
        }
        drop(st);
        drop(lock(&self.publisher).take());
    }
}

/// The VM's part in the pools: the hook that places threads as they start, and the monitor.
pub(crate) struct Pools {
    shared: Arc<Shared>,
    auto: bool,
    tuning: MonitorTuning,
    /// This VM's record (name, pid and start time), filled in by the monitor.
    record: VmRecord,
    /// `vms/<pid>.json`, removed at drop where the VM may unlink.
    json_path: Option<PathBuf>,
    stop: Arc<(Mutex<bool>, Condvar)>,
    monitor: Option<JoinHandle<()>>,
    /// The VM's threads confine themselves (then this one may not unlink at drop).
    confined: bool,
    /// Starts the monitor; its placer is this VM's until [`Pools::stop`].
    spawner: lucid_thread::Spawner,
}

/// What the VM brings to the pools besides its choice.
pub(crate) struct JoinArgs<'a> {
    pub tuning: MonitorTuning,
    pub vm: &'a lucid_hv::Vm,
    pub stats: &'a Arc<StatsRegistry>,
    pub vm_name: &'a str,
    /// Threads will confine themselves (`MachineConfig::seccomp`): no file is opened after `join`.
    pub seccomp: bool,
    /// How many back-end threads may run at once (one per device): admission files to open.
    pub backends: usize,
    /// Gets the placer.
    pub spawner: &'a lucid_thread::Spawner,
}

impl Pools {
    /// Joins the host's pools as `choice` says: `Ok(None)` when the VM runs in none. Installs the
    /// spawner's placer, so threads that start from now on place themselves.
    pub fn join(choice: &PoolChoice, args: JoinArgs<'_>) -> Result<Option<Self>, PoolsError> {
        if *choice == PoolChoice::None {
            return Ok(None);
        }
        let state = StateDir::from_env();
        let def_err = |source| PoolsError::Def {
            dir: state.dir.clone(),
            source,
        };
        let placer = Placer::open(&state).map_err(def_err)?;
        let defs: &[PoolDef] = placer.as_ref().map_or(&[], |p| p.pools());
        // Pools that take VMs (not the back-ends' own pool).
        let vm_pools: Vec<usize> = (0..defs.len()).filter(|&i| !defs[i].backends).collect();
        let (current, auto) = match choice {
            PoolChoice::Named(name) => match defs.iter().position(|d| &d.name == name) {
                Some(i) if defs[i].policy == Policy::Noop => {
                    return Err(PoolsError::NoopPool(name.clone()))
                }
                Some(i) => (i, false),
                None => {
                    return Err(PoolsError::NoPool {
                        name: name.clone(),
                        dir: state.dir.clone(),
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
                    "--pool auto: no pools for VMs defined on this host ({}): the VM runs in none",
                    state.pools_json().display()
                );
                return Ok(None);
            }
            // Auto starts in the default-policy pool if there is one, else the first.
            _ => (
                vm_pools
                    .iter()
                    .copied()
                    .find(|&i| defs[i].policy == Policy::Default)
                    .unwrap_or(vm_pools[0]),
                true,
            ),
        };
        let placer = placer.expect("a pool was chosen, so pools are defined");
        if args.seccomp {
            // Threads place themselves (and the monitor re-places them) confined: a cgroup
            // file that could not be opened now is a placement error, never an `open`.
            if !placer.files_ready() {
                log::warn!(
                    "pools: some of the pools' cgroup files in {} cannot be opened (run as \
                     root?): threads of those pools will not be placed",
                    placer
                        .host()
                        .cgroup
                        .as_ref()
                        .map_or(String::new(), |c| c.display().to_string())
                );
            }
            placer.forbid_open();
        }
        let backend_pool = placer.pools().iter().position(|d| d.backends);
        // No-op admission files for every back-end that may run at once, plus one for a
        // back-end restarted by a reset before the monitor noticed the old one end.
        let mut spare = Vec::new();
        if let Some(be) = backend_pool.map(|i| &placer.pools()[i]) {
            if be.policy == Policy::Noop {
                for _ in 0..args.backends + 1 {
                    match AdmissionFiles::open(&placer, &be.name) {
                        Ok(f) => spare.push(f),
                        Err(e) => {
                            log::warn!("pools: back-ends cannot join no-op pool {}: {e}", be.name);
                            break;
                        }
                    }
                }
            }
        }
        let publisher = VmPublisher::new(&state)
            .inspect_err(|e| {
                log::warn!("pools: {e}: `lucid pools show` will not list this VM");
            })
            .ok();
        let json_path = publisher.as_ref().map(|p| p.path().to_path_buf());
        let default_halt_poll_ns =
            std::fs::read_to_string("/sys/module/kvm/parameters/halt_poll_ns")
                .ok()
                .and_then(|s| s.trim().parse().ok());
        let has_halt_poll = args.vm.has_halt_poll();
        if !has_halt_poll {
            log::info!("pools: this KVM cannot set halt polling per VM (KVM_CAP_HALT_POLL)");
        }
        let shared = Arc::new(Shared {
            placer,
            backend_pool,
            state: Mutex::new(State {
                current,
                placed: HashMap::new(),
                failed: HashSet::new(),
                closed: false,
            }),
            spare: Mutex::new(spare),
            may_open: !args.seccomp,
            publisher: Mutex::new(publisher),
            stats: args.stats.clone(),
            vm: args.vm.clone(),
            default_halt_poll_ns,
            has_halt_poll,
        });
        shared.halt_poll(current);
        args.stats.counter("pools.current").set(current as u64);
        let def = &shared.pools()[current];
        log::info!(
            "pools: the VM runs in pool {} (CPUs {}, policy {}){}",
            def.name,
            lucid_pools::def::format_cpu_list(&def.cpus),
            def.policy,
            if auto {
                ", moved by the classifier"
            } else {
                ", pinned"
            }
        );
        // Weak: the placer lives in the spawner, which outlives the pools.
        let weak: Weak<Shared> = Arc::downgrade(&shared);
        args.spawner
            .set_placer(Some(Arc::new(move |t: &ThreadInfo| {
                if let Some(s) = weak.upgrade() {
                    s.place(t);
                }
            })));
        Ok(Some(Pools {
            shared,
            auto,
            tuning: args.tuning,
            record: VmRecord::for_self(args.vm_name),
            json_path,
            stop: Arc::new((Mutex::new(false), Condvar::new())),
            monitor: None,
            confined: false,
            spawner: args.spawner.clone(),
        }))
    }

    /// Starts `lucid-monitor`.
    pub fn start_monitor(&mut self) -> Result<(), PoolsError> {
        let confined = self.spawner.seccomp().is_some();
        let mut m = Monitor {
            shared: self.shared.clone(),
            auto: self.auto,
            tuning: self.tuning,
            record: self.record.clone(),
            stop: self.stop.clone(),
        };
        let spec = ThreadSpec::new("lucid-monitor", ThreadRole::Other, Role::Monitor);
        let t = self.spawner.spawn(spec, move |confined| {
            if let Err(e) = confined {
                // Never run unconfined; the VM runs on where it was placed.
                log::error!("lucid-monitor: {e}");
                m.shared.close();
                return;
            }
            m.run();
            m.shared.close();
        })?;
        // Only a running monitor closes (confined) at the end: without one, drop does.
        self.confined = confined;
        self.monitor = Some(t);
        Ok(())
    }

    /// Stops placing threads, then the monitor after a last window, and joins it.
    pub fn stop(&mut self) {
        self.spawner.set_placer(None);
        let (lock_, cv) = &*self.stop;
        *lock(lock_) = true;
        cv.notify_all();
        if let Some(t) = self.monitor.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Pools {
    fn drop(&mut self) {
        self.stop();
        if !self.confined {
            // Never started (or no seccomp): nothing here is confined.
            self.shared.close();
            // A confined thread cannot unlink: the monitor left the file empty, which readers
            // (and `lucid pools`' stale-pid cleanup) take as gone; unconfined, remove it.
            if let Some(path) = &self.json_path {
                let _ = std::fs::remove_file(path);
            }
        }
    }
}

/// The pools as one of the VM's techniques: the monitor starts after the vCPU threads and takes
/// its last window while they are still listed (quiesce); the VM leaves the pools when this is
/// dropped.
impl crate::technique::Technique for Pools {
    fn name(&self) -> &'static str {
        "pools"
    }

    fn start(&mut self, _cx: &crate::technique::StartContext<'_>) -> Result<(), crate::VmmError> {
        Ok(self.start_monitor()?)
    }

    fn quiesce(&mut self) {
        Pools::stop(self);
    }

    fn counters(&self) -> &'static [&'static str] {
        &["pools.", "monitor."]
    }

    fn summary(&self) -> Vec<String> {
        let def = &self.shared.pools()[self.shared.current()];
        vec![format!(
            "pool {} ({})",
            def.name,
            if self.auto { "auto" } else { "pinned" }
        )]
    }
}

/// The `lucid-monitor` thread's state.
struct Monitor {
    shared: Arc<Shared>,
    auto: bool,
    tuning: MonitorTuning,
    record: VmRecord,
    stop: Arc<(Mutex<bool>, Condvar)>,
}

impl Monitor {
    /// Waits one window; `true` once asked to stop.
    fn wait(&self) -> bool {
        let (lock_, cv) = &*self.stop;
        let stopped = lock(lock_);
        let (stopped, _) = cv
            .wait_timeout_while(stopped, self.tuning.window, |s| !*s)
            .unwrap_or_else(|e| e.into_inner());
        *stopped
    }

    fn run(&mut self) {
        let s = self.shared.clone();
        let origin = Instant::now();
        let at = |t: Instant| t.duration_since(origin).as_nanos() as u64;
        let mut last = Sample::take(&s.stats, 0);
        let mut totals = Totals::default();
        let current_label = label_of(s.pools()[s.current()].policy);
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
                    .pools()
                    .iter()
                    .position(|p| label_of(p.policy) == to && !p.backends)
                {
                    self.move_to(i, to);
                    moves.inc();
                    s.stats
                        .counter("monitor.moved_at_ms")
                        .set(now.duration_since(origin).as_millis() as u64);
                }
            }
            if !stopping {
                // Threads that started since (or whose hook could not place them) join now.
                for t in &sample.threads {
                    s.place(&t.info);
                }
                s.poll_admissions();
                s.boost(&window);
            }
            self.publish_json(&window, &totals, &classifier);
            last = sample;
            if stopping {
                break;
            }
        }
    }

    /// Moves the VM to pool `i`: no pause, its threads are placed one by one, each with the
    /// new pool's policy, while it runs.
    fn move_to(&self, i: usize, why: Label) {
        let s = &self.shared;
        let from = std::mem::replace(&mut lock(&s.state).current, i);
        log::info!(
            "pools: the VM looks {why}-bound: moving it from pool {} to {}",
            s.pools()[from].name,
            s.pools()[i].name
        );
        s.stats.counter("pools.current").set(i as u64);
        for t in s.stats.threads().list() {
            s.place(&t);
        }
        s.halt_poll(i);
    }

    /// Rewrites `vms/<pid>.json` ([`VmPublisher::publish`]: pwrite + ftruncate).
    fn publish_json(&mut self, w: &Window, totals: &Totals, c: &Classifier) {
        let s = &self.shared;
        let publisher = lock(&s.publisher);
        let Some(publisher) = publisher.as_ref() else {
            return;
        };
        let st = lock(&s.state);
        let rec = &mut self.record;
        rec.pool = Some(s.pools()[st.current].name.clone());
        rec.threads = s
            .stats
            .threads()
            .list()
            .iter()
            .map(|t| {
                let placed = st.placed.get(&t.tid);
                VmThread {
                    tid: t.tid,
                    name: t.name.clone(),
                    role: match t.role {
                        ThreadRole::Vcpu(n) => format!("vcpu{n}"),
                        ThreadRole::Backend => "backend".into(),
                        ThreadRole::Other => "other".into(),
                    },
                    pool: placed.map(|p| s.pools()[p.pool].name.clone()),
                    admission: placed.and_then(|p| match &p.how {
                        How::Noop(a) if a.is_admitted() => Some("admitted".into()),
                        How::Noop(_) => Some("waiting".into()),
                        How::Policy { .. } => None,
                    }),
                }
            })
            .collect();
        drop(st);
        rec.monitor = monitor::to_json(w, totals);
        let extra = &mut rec.extra;
        extra.insert("pinned".into(), (!self.auto).into());
        extra.insert("label".into(), c.label().name().into());
        extra.insert(
            "updated_unix_ms".into(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_millis() as u64)
                .unwrap_or(0)
                .into(),
        );
        if let Err(e) = publisher.publish(rec) {
            log::debug!("pools: {e}");
        }
    }
}

/// The classifier label a pool of this policy serves.
fn label_of(p: Policy) -> Label {
    match p {
        Policy::Io => Label::IoBound,
        Policy::Cpu => Label::CpuBound,
        Policy::Noop | Policy::Default => Label::Unknown,
    }
}

// ---------------------------------------------------------------------------------------------
// Low-noise mode.

/// Pins the caller (and so every thread it starts from now on) to the CPUs left after the
/// vCPUs take the highest ones, one each, and installs the placer that puts each vCPU on its
/// CPU and every other thread (a back-end started by a vCPU inherits its CPU) back on the others.
pub(crate) fn low_noise(
    vcpus: u8,
    stats: &Arc<StatsRegistry>,
    spawner: &lucid_thread::Spawner,
) -> Result<(), PoolsError> {
    let cpus = lucid_pools::place::affinity(0).unwrap_or_default();
    let (vcpu_cpus, rest) = split_low_noise(&cpus, vcpus).ok_or(PoolsError::LowNoiseCpus {
        vcpus,
        cpus: cpus.len(),
    })?;
    lucid_pools::place::set_affinity(0, &rest).map_err(PoolsError::Affinity)?;
    log::info!("--low-noise: vCPUs on CPUs {vcpu_cpus:?}, everything else on {rest:?}");
    stats.counter("pools.low_noise").set(1);
    spawner.set_placer(Some(Arc::new(move |t: &ThreadInfo| {
        let cpus = match t.role {
            ThreadRole::Vcpu(n) => match vcpu_cpus.get(n as usize) {
                Some(&c) => vec![c],
                None => return,
            },
            _ => rest.clone(),
        };
        if let Err(e) = lucid_pools::place::set_affinity(0, &cpus) {
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
    let names = crate::devices::virtio_names(&config.devices.pci);
    for (name, d) in names.iter().zip(&config.devices.pci) {
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
pub(crate) fn add_work_hypercall(
    hooks: &ExitHooks,
    stats: &Arc<StatsRegistry>,
) -> Result<(), HookError> {
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
    )
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
    fn pools_serve_the_classifier_labels() {
        assert_eq!(label_of(Policy::Cpu), Label::CpuBound);
        assert_eq!(label_of(Policy::Io), Label::IoBound);
        assert_eq!(label_of(Policy::Default), Label::Unknown);
        assert_eq!(label_of(Policy::Noop), Label::Unknown);
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
        c.devices
            .pci
            .push(crate::config::parse_blk("path=/x").unwrap());
        c.devices
            .pci
            .push(crate::config::parse_blk("path=/y,rung=L4").unwrap());
        let p = low_noise_pollers(&c);
        assert_eq!(p.len(), 1);
        assert!(p[0].starts_with("blk1 on rung L4"), "{p:?}");
    }

    #[test]
    fn the_work_hypercall_counts_iterations_and_bytes() {
        let hooks = ExitHooks::new();
        let stats = StatsRegistry::new();
        add_work_hypercall(&hooks, &stats).unwrap();
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
