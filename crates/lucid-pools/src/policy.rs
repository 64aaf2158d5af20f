//! The per-pool policies applied to a thread, the I/O boost ladder and no-op admission.
//!
//! | policy    | kernel setting                                              | halt polling |
//! |-----------|-------------------------------------------------------------|--------------|
//! | `noop`    | SCHED_FIFO prio 10, pinned to the one CPU of its slot       | (default)    |
//! | `io`      | SCHED_OTHER, short EEVDF slice (`sched_runtime`), else nice -5 | on        |
//! | `cpu`     | SCHED_BATCH nice 10                                          | off          |
//! | `default` | SCHED_OTHER nice 0, default slice                            | (default)    |
//!
//! No-op admission (thesis §4.2, with the waiting list it left unimplemented): a `noop` pool
//! admits one thread per CPU, host-wide. Slot `slots/<pool>.<cpu>` is held by an exclusive
//! `flock` for as long as its thread's [`Admission`] lives (the kernel drops it if the process
//! dies), so no stale state survives a crash. A thread that finds every slot taken leaves its
//! placement alone and takes a ticket in `slots/<pool>.wait/` (named by time, flocked by its
//! holder); [`Admission::poll`] admits the oldest live ticket when a slot frees.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::def::{PoolDef, StateDir};
use crate::place::{set_affinity, PlaceError, Placer};

/// The longest slice `io` threads ask for by default (thesis §4.3.1: 30 -> 3 ms).
pub const IO_SLICE_NS: u64 = 3_000_000;
/// The kernel's floor for `sched_runtime` of fair tasks.
pub const MIN_SLICE_NS: u64 = 100_000;

/// The kernel's default EEVDF slice on this host: `base_slice_ns` (debugfs, else the 0.7 ms
/// default) scaled by 1 + log2(min(online CPUs, 8)) as the kernel's default tunable scaling does.
pub fn host_default_slice_ns() -> u64 {
    let base = fs::read_to_string("/sys/kernel/debug/sched/base_slice_ns")
        .ok()
        .and_then(|s| s.trim().parse().ok());
    if let Some(b) = base {
        // debugfs shows the scaled value already.
        return b;
    }
    let n = crate::def::online_cpus().map_or(1, |c| c.len().clamp(1, 8)) as u64;
    700_000 * (1 + u64::from(n.ilog2()))
}

/// The slice of `io` threads when the pool gives none: 3 ms as in the thesis, but never more
/// than half the host's default slice (EEVDF's default is already short, 1.4 ms on 2 CPUs: an
/// `io` slice must be shorter than what CPU-bound threads get to favour the I/O threads).
pub fn default_io_slice_ns() -> u64 {
    IO_SLICE_NS
        .min(host_default_slice_ns() / 2)
        .max(MIN_SLICE_NS)
}
/// Nice of `io` threads where the kernel has no per-task slice.
pub const IO_FALLBACK_NICE: i32 = -5;
/// Nice of `cpu` threads.
pub const CPU_NICE: i32 = 10;
/// SCHED_FIFO priority of admitted `noop` threads.
pub const NOOP_FIFO_PRIO: u32 = 10;

pub use crate::def::Policy;

/// A Linux scheduling class as read back from the kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum SchedPolicy {
    Other,
    Fifo,
    Rr,
    Batch,
    Idle,
    Deadline,
    Ext,
    Unknown(u32),
}

impl SchedPolicy {
    fn from_raw(v: u32) -> SchedPolicy {
        match v {
            0 => SchedPolicy::Other,
            1 => SchedPolicy::Fifo,
            2 => SchedPolicy::Rr,
            3 => SchedPolicy::Batch,
            5 => SchedPolicy::Idle,
            6 => SchedPolicy::Deadline,
            7 => SchedPolicy::Ext,
            n => SchedPolicy::Unknown(n),
        }
    }
    fn raw(self) -> u32 {
        match self {
            SchedPolicy::Other => 0,
            SchedPolicy::Fifo => 1,
            SchedPolicy::Rr => 2,
            SchedPolicy::Batch => 3,
            SchedPolicy::Idle => 5,
            SchedPolicy::Deadline => 6,
            SchedPolicy::Ext => 7,
            SchedPolicy::Unknown(n) => n,
        }
    }
}

impl std::fmt::Display for SchedPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SchedPolicy::Unknown(n) => write!(f, "policy{n}"),
            p => f.write_str(match p {
                SchedPolicy::Other => "SCHED_OTHER",
                SchedPolicy::Fifo => "SCHED_FIFO",
                SchedPolicy::Rr => "SCHED_RR",
                SchedPolicy::Batch => "SCHED_BATCH",
                SchedPolicy::Idle => "SCHED_IDLE",
                SchedPolicy::Deadline => "SCHED_DEADLINE",
                _ => "SCHED_EXT",
            }),
        }
    }
}

/// The kernel's `struct sched_attr` (SCHED_ATTR_SIZE_VER1, 56 bytes).
#[repr(C)]
#[derive(Default)]
struct RawAttr {
    size: u32,
    policy: u32,
    flags: u64,
    nice: i32,
    priority: u32,
    runtime: u64,
    deadline: u64,
    period: u64,
    util_min: u32,
    util_max: u32,
}

/// The parts of `sched_attr` the policies use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SchedAttr {
    pub policy: SchedPolicy,
    pub nice: i32,
    pub priority: u32,
    /// `sched_runtime`: the requested slice for fair policies (0 = default).
    pub runtime_ns: u64,
}

/// `sched_getattr(tid)`.
pub fn get_attr(tid: i32) -> io::Result<SchedAttr> {
    let mut a = RawAttr::default();
    // SAFETY: the kernel writes at most `size` bytes into `a`, a sched_attr of that size.
    let r = unsafe {
        libc::syscall(
            libc::SYS_sched_getattr,
            tid,
            &mut a as *mut RawAttr,
            std::mem::size_of::<RawAttr>() as u32,
            0u32,
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(SchedAttr {
        policy: SchedPolicy::from_raw(a.policy),
        nice: a.nice,
        priority: a.priority,
        runtime_ns: a.runtime,
    })
}

/// `sched_setattr(tid)`.
pub fn set_attr(tid: i32, attr: &SchedAttr) -> io::Result<()> {
    let a = RawAttr {
        size: std::mem::size_of::<RawAttr>() as u32,
        policy: attr.policy.raw(),
        nice: attr.nice,
        priority: attr.priority,
        runtime: attr.runtime_ns,
        ..Default::default()
    };
    // SAFETY: `a` is a complete sched_attr whose size field matches its size.
    let r = unsafe { libc::syscall(libc::SYS_sched_setattr, tid, &a as *const RawAttr, 0u32) };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// What [`apply`] set, to build boosts on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Applied {
    pub policy: SchedPolicy,
    pub priority: u32,
    /// The base nice (boosts step from it).
    pub nice: i32,
    /// The per-task slice when the kernel took it.
    pub slice_ns: Option<u64>,
}

/// Applies `policy` to thread `tid` with the policy's default slice: see [`apply_slice`].
pub fn apply(tid: i32, policy: Policy) -> io::Result<Applied> {
    apply_slice(tid, policy, None)
}

/// Applies `policy` to thread `tid` (for `noop` only the FIFO class: admission and the
/// one-CPU pin are [`Admission`]'s). `slice_ns` (None: `io` takes [`default_io_slice_ns`],
/// the others the kernel's) is the EEVDF slice; when the kernel does not keep it (before
/// custom slices, 6.12) `io` falls back to nice -5 and the others ignore it.
pub fn apply_slice(tid: i32, policy: Policy, slice_ns: Option<u64>) -> io::Result<Applied> {
    let fair = |policy, nice, runtime_ns| SchedAttr {
        policy,
        nice,
        priority: 0,
        runtime_ns,
    };
    match policy {
        Policy::Noop => {
            set_attr(
                tid,
                &SchedAttr {
                    policy: SchedPolicy::Fifo,
                    nice: 0,
                    priority: NOOP_FIFO_PRIO,
                    runtime_ns: 0,
                },
            )?;
            Ok(Applied {
                policy: SchedPolicy::Fifo,
                priority: NOOP_FIFO_PRIO,
                nice: 0,
                slice_ns: None,
            })
        }
        Policy::Io => {
            let want = slice_ns.unwrap_or_else(default_io_slice_ns);
            let slice = set_attr(tid, &fair(SchedPolicy::Other, 0, want))
                .ok()
                .and_then(|_| get_attr(tid).ok())
                .is_some_and(|a| a.runtime_ns == want);
            if slice {
                return Ok(Applied {
                    policy: SchedPolicy::Other,
                    priority: 0,
                    nice: 0,
                    slice_ns: Some(want),
                });
            }
            set_attr(tid, &fair(SchedPolicy::Other, IO_FALLBACK_NICE, 0))?;
            Ok(Applied {
                policy: SchedPolicy::Other,
                priority: 0,
                nice: IO_FALLBACK_NICE,
                slice_ns: None,
            })
        }
        Policy::Cpu | Policy::Default => {
            let (class, nice) = match policy {
                Policy::Cpu => (SchedPolicy::Batch, CPU_NICE),
                _ => (SchedPolicy::Other, 0),
            };
            set_attr(tid, &fair(class, nice, slice_ns.unwrap_or(0)))?;
            let kept = slice_ns.filter(|&s| get_attr(tid).is_ok_and(|a| a.runtime_ns == s));
            Ok(Applied {
                policy: class,
                priority: 0,
                nice,
                slice_ns: kept,
            })
        }
    }
}

/// Back to what Linux does: SCHED_OTHER, nice 0, default slice.
pub fn reset(tid: i32) -> io::Result<()> {
    set_attr(
        tid,
        &SchedAttr {
            policy: SchedPolicy::Other,
            nice: 0,
            priority: 0,
            runtime_ns: 0,
        },
    )
}

/// Sets the nice of a thread under a fair policy to `base.nice + level.nice_delta()`,
/// keeping its class and slice (what the monitor calls each window for `io` threads).
pub fn apply_boost(tid: i32, base: &Applied, level: BoostLevel) -> io::Result<()> {
    let nice = (base.nice + level.nice_delta()).clamp(-20, 19);
    // SAFETY: setpriority on one thread id; no memory is passed.
    let r = unsafe { libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, nice) };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Priority levels of the anticipatory boost (thesis §4.3.2), lowest first: a thread over its
/// share, under it, and three boost levels above.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub enum BoostLevel {
    Over,
    Under,
    Boost1,
    Boost2,
    Boost3,
}

impl BoostLevel {
    /// Nice step relative to the policy's base nice (one nice step ≈ 10% CPU weight).
    pub fn nice_delta(self) -> i32 {
        match self {
            BoostLevel::Over => 2,
            BoostLevel::Under => 0,
            BoostLevel::Boost1 => -1,
            BoostLevel::Boost2 => -2,
            BoostLevel::Boost3 => -3,
        }
    }
    fn up(self) -> BoostLevel {
        match self {
            BoostLevel::Under => BoostLevel::Boost1,
            BoostLevel::Boost1 => BoostLevel::Boost2,
            BoostLevel::Boost2 | BoostLevel::Boost3 => BoostLevel::Boost3,
            BoostLevel::Over => BoostLevel::Over,
        }
    }
    fn down(self) -> BoostLevel {
        match self {
            BoostLevel::Boost3 => BoostLevel::Boost2,
            BoostLevel::Boost2 => BoostLevel::Boost1,
            BoostLevel::Boost1 | BoostLevel::Under => BoostLevel::Under,
            BoostLevel::Over => BoostLevel::Over,
        }
    }
}

/// Inputs to the boost ladder.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BoostEvent {
    /// The thread woke (I/O completion): UNDER -> BOOST1, boosted -> one level up.
    /// OVER threads are not boosted (as in Credit).
    Wake,
    /// The thread went to sleep: one level down.
    Sleep,
    /// Accounting tick: boosts decay one level.
    Tick,
    /// The thread used its whole slice: back to UNDER (a CPU hog loses its boost).
    FullSlice,
    /// The thread used more than its share: OVER.
    OverShare,
    /// The thread is within its share again: OVER -> UNDER.
    UnderShare,
}

/// The anticipatory boost ladder as a pure state machine. Brief I/O gets brief boosts;
/// sustained wake-ups (random I/O) climb to BOOST3; a full slice or the decay brings it down.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BoostLadder {
    level: BoostLevel,
}

impl Default for BoostLadder {
    fn default() -> Self {
        BoostLadder {
            level: BoostLevel::Under,
        }
    }
}

impl BoostLadder {
    pub fn level(&self) -> BoostLevel {
        self.level
    }

    /// Applies one event and returns the new level.
    pub fn on(&mut self, ev: BoostEvent) -> BoostLevel {
        self.level = match (ev, self.level) {
            (BoostEvent::Wake, l) => l.up(),
            (BoostEvent::Sleep | BoostEvent::Tick, l) => l.down(),
            (BoostEvent::FullSlice, BoostLevel::Over) => BoostLevel::Over,
            (BoostEvent::FullSlice, _) => BoostLevel::Under,
            (BoostEvent::OverShare, _) => BoostLevel::Over,
            (BoostEvent::UnderShare, BoostLevel::Over) => BoostLevel::Under,
            (BoostEvent::UnderShare, l) => l,
        };
        self.level
    }

    /// One monitor window (note §4: raise one step per active window, max 3, decay one per
    /// quiet window): a window where the thread ran its slices out counts as [`FullSlice`],
    /// one where it woke as [`Wake`], else [`Tick`].
    ///
    /// [`FullSlice`]: BoostEvent::FullSlice
    /// [`Wake`]: BoostEvent::Wake
    /// [`Tick`]: BoostEvent::Tick
    pub fn window(&mut self, woke: bool, used_full_slices: bool) -> BoostLevel {
        match (used_full_slices, woke) {
            (true, _) => self.on(BoostEvent::FullSlice),
            (false, true) => self.on(BoostEvent::Wake),
            (false, false) => self.on(BoostEvent::Tick),
        }
    }
}

fn slot_path(state: &StateDir, pool: &str, cpu: u32) -> PathBuf {
    state.slots_dir().join(format!("{pool}.{cpu}"))
}

fn wait_dir(state: &StateDir, pool: &str) -> PathBuf {
    state.slots_dir().join(format!("{pool}.wait"))
}

/// Opens (creating) `path` and takes an exclusive flock without waiting; None if held.
fn try_lock(path: &Path, create: bool) -> io::Result<Option<File>> {
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(create)
        .truncate(false)
        .open(path)?;
    // SAFETY: flock on an fd we own.
    if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
        return Ok(Some(f));
    }
    let e = io::Error::last_os_error();
    match e.raw_os_error() {
        Some(libc::EWOULDBLOCK) => Ok(None),
        _ => Err(e),
    }
}

/// A held no-op CPU slot (released on drop).
#[derive(Debug)]
pub struct Slot {
    file: File,
    pub cpu: u32,
}

impl Drop for Slot {
    fn drop(&mut self) {
        // Clear the holder line; the lock goes with the fd.
        let _ = self.file.set_len(0);
    }
}

/// A waiting thread's ticket (removed on drop).
#[derive(Debug)]
struct Ticket {
    _file: File,
    path: PathBuf,
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let _ = fs::remove_file(&self.path);
    }
}

#[derive(Debug)]
enum AdmState {
    Admitted(Slot),
    Waiting(Ticket),
}

/// Where a thread stands in a `noop` pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum AdmissionStatus {
    /// Holds `cpu`: pinned there, SCHED_FIFO.
    Admitted { cpu: u32 },
    /// Every slot is taken (or an older waiter is first): left where it was.
    Waiting,
}

/// A thread's admission to a `noop` pool: admitted (holding one CPU) or waiting.
#[derive(Debug)]
pub struct Admission {
    placer: Placer,
    tid: i32,
    pool: String,
    state: AdmState,
}

fn slots_err(path: &Path, e: io::Error) -> PlaceError {
    match e.raw_os_error() {
        Some(libc::EACCES) | Some(libc::EPERM) | Some(libc::EROFS) => PlaceError::Permission {
            what: "write",
            path: path.to_path_buf(),
        },
        _ => PlaceError::Io {
            what: "use",
            path: path.to_path_buf(),
            source: e,
        },
    }
}

impl Admission {
    /// Queues `tid` for a CPU of `pool` and admits it at once if it is first in line and a
    /// slot is free. A waiting thread is left where it is.
    pub fn request(placer: Placer, tid: i32, pool: &str) -> Result<Admission, PlaceError> {
        placer.pool(pool)?;
        let wdir = wait_dir(placer.state(), pool);
        fs::create_dir_all(&wdir).map_err(|e| slots_err(&wdir, e))?;
        // SAFETY: getpid has no preconditions.
        let pid = unsafe { libc::getpid() };
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos();
        let path = wdir.join(format!("{now:020}-{pid}-{tid}"));
        let file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&path)
            .map_err(|e| slots_err(&path, e))?;
        // SAFETY: flock on an fd we own.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            let e = io::Error::last_os_error();
            let _ = fs::remove_file(&path);
            return Err(slots_err(&path, e));
        }
        let mut adm = Admission {
            placer,
            tid,
            pool: pool.to_string(),
            state: AdmState::Waiting(Ticket { _file: file, path }),
        };
        adm.poll()?;
        Ok(adm)
    }

    pub fn tid(&self) -> i32 {
        self.tid
    }
    pub fn pool(&self) -> &str {
        &self.pool
    }
    pub fn is_admitted(&self) -> bool {
        matches!(self.state, AdmState::Admitted(_))
    }
    pub fn status(&self) -> AdmissionStatus {
        match &self.state {
            AdmState::Admitted(s) => AdmissionStatus::Admitted { cpu: s.cpu },
            AdmState::Waiting(_) => AdmissionStatus::Waiting,
        }
    }
    /// The CPU held when admitted.
    pub fn cpu(&self) -> Option<u32> {
        match &self.state {
            AdmState::Admitted(s) => Some(s.cpu),
            AdmState::Waiting(_) => None,
        }
    }

    /// Admits the thread if it is the oldest live waiter and a slot is free: pins it to that
    /// CPU inside the pool and makes it SCHED_FIFO. Returns whether it is admitted.
    pub fn poll(&mut self) -> Result<bool, PlaceError> {
        let AdmState::Waiting(ticket) = &self.state else {
            return Ok(true);
        };
        let state = self.placer.state().clone();
        let mine = ticket
            .path
            .file_name()
            .map(|n| n.to_string_lossy().to_string())
            .unwrap_or_default();
        for older in waiting_tickets(&state, &self.pool) {
            if older >= mine {
                break;
            }
            // A ticket whose lock is free belongs to a thread that is gone.
            let p = wait_dir(&state, &self.pool).join(&older);
            match try_lock(&p, false) {
                Ok(Some(_stale)) => {
                    let _ = fs::remove_file(&p);
                }
                Ok(None) => return Ok(false),
                Err(_) => {}
            }
        }
        let def: PoolDef = self.placer.pool(&self.pool)?.clone();
        for &cpu in &def.cpus {
            let p = slot_path(&state, &self.pool, cpu);
            let Some(mut file) = try_lock(&p, true).map_err(|e| slots_err(&p, e))? else {
                continue;
            };
            // SAFETY: getpid has no preconditions.
            let pid = unsafe { libc::getpid() };
            let _ = file.set_len(0);
            let _ = writeln!(file, "{pid} {}", self.tid);
            let slot = Slot { file, cpu };
            self.placer.place(self.tid, &self.pool)?;
            set_affinity(self.tid, &[cpu])?;
            apply(self.tid, Policy::Noop)
                .map_err(|e| PlaceError::sched("set the policy of", self.tid, e))?;
            self.state = AdmState::Admitted(slot);
            return Ok(true);
        }
        Ok(false)
    }

    /// Gives the slot (or the ticket) up and takes the thread out of the pool (default
    /// policy, every CPU).
    pub fn release(self) -> Result<(), PlaceError> {
        let r = match self.state {
            AdmState::Admitted(_) => self.placer.unplace(self.tid),
            AdmState::Waiting(_) => Ok(()),
        };
        drop(self.state);
        r
    }
}

/// Ticket names of a pool's waiting list, oldest first (stale ones included).
fn waiting_tickets(state: &StateDir, pool: &str) -> Vec<String> {
    let mut v: Vec<String> = fs::read_dir(wait_dir(state, pool))
        .map(|rd| {
            rd.flatten()
                .map(|e| e.file_name().to_string_lossy().to_string())
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// Who holds a no-op slot, for `lucid pools show`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct SlotInfo {
    pub cpu: u32,
    /// (pid, tid) of the holder; None when free.
    pub holder: Option<(i32, i32)>,
}

/// The slots of a `noop` pool and its live waiters (pid, tid), oldest first.
pub fn admission_state(state: &StateDir, pool: &PoolDef) -> (Vec<SlotInfo>, Vec<(i32, i32)>) {
    let slots = pool
        .cpus
        .iter()
        .map(|&cpu| {
            let p = slot_path(state, &pool.name, cpu);
            let holder = match try_lock(&p, false) {
                Ok(None) => fs::read_to_string(&p).ok().and_then(|s| {
                    let mut it = s.split_whitespace().map(|x| x.parse::<i32>());
                    match (it.next(), it.next()) {
                        (Some(Ok(a)), Some(Ok(b))) => Some((a, b)),
                        _ => None,
                    }
                }),
                _ => None,
            };
            SlotInfo { cpu, holder }
        })
        .collect();
    let waiters = waiting_tickets(state, &pool.name)
        .into_iter()
        .filter(|t| {
            matches!(
                try_lock(&wait_dir(state, &pool.name).join(t), false),
                Ok(None)
            )
        })
        .filter_map(|t| {
            let mut it = t.split('-').skip(1).map(|x| x.parse::<i32>());
            match (it.next(), it.next()) {
                (Some(Ok(a)), Some(Ok(b))) => Some((a, b)),
                _ => None,
            }
        })
        .collect();
    (slots, waiters)
}

/// Whether any slot of any pool is held or any ticket is live (destroy refuses then).
pub fn any_admission_live(state: &StateDir, pools: &[PoolDef]) -> bool {
    pools.iter().any(|p| {
        let (slots, waiters) = admission_state(state, p);
        !waiters.is_empty() || slots.iter().any(|s| s.holder.is_some())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use BoostEvent::*;
    use BoostLevel::*;

    #[test]
    fn ladder_follows_the_thesis() {
        let mut l = BoostLadder::default();
        assert_eq!(l.level(), Under);
        // Wake: UNDER -> BOOST1, then up one level each wake, capped at BOOST3.
        assert_eq!(l.on(Wake), Boost1);
        assert_eq!(l.on(Wake), Boost2);
        assert_eq!(l.on(Wake), Boost3);
        assert_eq!(l.on(Wake), Boost3);
        // Sleep and ticks: down one level each, floor at UNDER.
        assert_eq!(l.on(Sleep), Boost2);
        assert_eq!(l.on(Tick), Boost1);
        assert_eq!(l.on(Tick), Under);
        assert_eq!(l.on(Tick), Under);
        // A full slice drops any boost straight to UNDER.
        l.on(Wake);
        l.on(Wake);
        assert_eq!(l.on(FullSlice), Under);
        // OVER is not boosted by waking; back to UNDER when within its share.
        assert_eq!(l.on(OverShare), Over);
        assert_eq!(l.on(Wake), Over);
        assert_eq!(l.on(Tick), Over);
        assert_eq!(l.on(FullSlice), Over);
        assert_eq!(l.on(UnderShare), Under);
        assert_eq!(l.on(UnderShare), Under);
    }

    #[test]
    fn ladder_windows_and_nice() {
        let mut l = BoostLadder::default();
        // Brief I/O: one active window, then quiet: a brief boost.
        assert_eq!(l.window(true, false), Boost1);
        assert_eq!(l.window(false, false), Under);
        // Sustained I/O climbs to the top and stays.
        for _ in 0..5 {
            l.window(true, false);
        }
        assert_eq!(l.level(), Boost3);
        assert_eq!(l.level().nice_delta(), -3);
        // A CPU hog window loses it.
        assert_eq!(l.window(true, true), Under);
        assert_eq!(Under.nice_delta(), 0);
        assert!(Over.nice_delta() > 0);
    }

    #[test]
    fn attr_struct_is_ver1() {
        assert_eq!(std::mem::size_of::<RawAttr>(), 56);
    }
}
