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
//! placement alone and draws a ticket in `slots/<pool>.queue` (a record it holds an
//! open-file-description lock on, gone with its holder); [`Admission::poll`] admits the oldest
//! live ticket when a slot frees.

use std::fs::{self, File, OpenOptions};
use std::io;
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
/// Computed once per process (a [`Placer`] computes it when opened, so that confined threads
/// never read the files it comes from).
pub fn default_io_slice_ns() -> u64 {
    static SLICE: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *SLICE.get_or_init(|| {
        IO_SLICE_NS
            .min(host_default_slice_ns() / 2)
            .max(MIN_SLICE_NS)
    })
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

/// The pid argument for a scheduling call on `tid`: 0 (the caller) when `tid` is the calling
/// thread, so that seccomp can allow a thread to change itself and no other
/// (`sched_setaffinity(0, ..)`, `sched_setattr(0, ..)`: the placement hook on vCPU and back-end
/// threads).
pub(crate) fn sched_pid(tid: i32) -> i32 {
    // SAFETY: gettid has no preconditions.
    match tid == unsafe { libc::gettid() } {
        true => 0,
        false => tid,
    }
}

/// `sched_getattr(tid)`.
pub fn get_attr(tid: i32) -> io::Result<SchedAttr> {
    let tid = sched_pid(tid);
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
    let tid = sched_pid(tid);
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
    let who = sched_pid(tid) as libc::id_t;
    // SAFETY: setpriority on one thread id; no memory is passed.
    let r = unsafe { libc::setpriority(libc::PRIO_PROCESS, who, nice) };
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

fn queue_path(state: &StateDir, pool: &str) -> PathBuf {
    state.slots_dir().join(format!("{pool}.queue"))
}

/// Waiting list layout: `[0, 8)` the next ticket number (locked while a ticket is drawn),
/// then one 16-byte record per ticket (pid, tid), write-locked by its waiter.
const QUEUE_HEADER: u64 = 64;
const TICKET_LEN: u64 = 16;

fn ticket_start(ticket: u64) -> u64 {
    QUEUE_HEADER + ticket * TICKET_LEN
}

fn open_rw(path: &Path) -> io::Result<File> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
}

/// An open-file-description lock (`F_OFD_SETLK[W]`) of `kind` (F_WRLCK or F_UNLCK) on
/// `[start, start+len)` (len 0 = to the end). Returns false when another description holds it.
fn ofd_lock(f: &File, kind: i32, start: u64, len: u64, wait: bool) -> io::Result<bool> {
    // SAFETY: a zeroed flock is a valid request once its fields are set below.
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = kind as i16;
    fl.l_whence = libc::SEEK_SET as i16;
    fl.l_start = start as i64;
    fl.l_len = len as i64;
    let cmd = if wait {
        libc::F_OFD_SETLKW
    } else {
        libc::F_OFD_SETLK
    };
    // SAFETY: fcntl with a valid struct flock on an fd we own.
    if unsafe { libc::fcntl(f.as_raw_fd(), cmd, &mut fl) } == 0 {
        return Ok(true);
    }
    let e = io::Error::last_os_error();
    match e.raw_os_error() {
        Some(libc::EAGAIN) | Some(libc::EACCES) => Ok(false),
        _ => Err(e),
    }
}

/// The first write lock another description (or process) holds in `[start, start+len)`
/// (len 0 = to the end): its (start, len).
fn ofd_first_lock(f: &File, start: u64, len: u64) -> io::Result<Option<(u64, u64)>> {
    // SAFETY: a zeroed flock is a valid query once its fields are set below.
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = libc::F_WRLCK as i16;
    fl.l_whence = libc::SEEK_SET as i16;
    fl.l_start = start as i64;
    fl.l_len = len as i64;
    // SAFETY: fcntl F_OFD_GETLK with a valid struct flock on an fd we own.
    if unsafe { libc::fcntl(f.as_raw_fd(), libc::F_OFD_GETLK, &mut fl) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok((fl.l_type != libc::F_UNLCK as i16).then_some((fl.l_start as u64, fl.l_len as u64)))
}

/// `flock(LOCK_EX | LOCK_NB)`: false when another description holds it.
fn try_flock(f: &File) -> io::Result<bool> {
    // SAFETY: flock on an fd we own.
    if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
        return Ok(true);
    }
    let e = io::Error::last_os_error();
    match e.raw_os_error() {
        Some(libc::EWOULDBLOCK) => Ok(false),
        _ => Err(e),
    }
}

/// The descriptors one thread's admission to a `noop` pool uses: one per slot file and one on
/// the pool's waiting list, each its own open file description (locks belong to descriptions,
/// so two admissions never share one). Opened ahead with [`AdmissionFiles::open`] (before
/// seccomp confinement: the thread that will ask may not open files) and given back by
/// [`Admission::into_files`] for the next thread.
#[derive(Debug)]
pub struct AdmissionFiles {
    pool: String,
    slots: Vec<(u32, File)>,
    queue: File,
}

impl AdmissionFiles {
    /// Opens (creating them if needed) the slot files and the waiting list of `pool`.
    pub fn open(placer: &Placer, pool: &str) -> Result<AdmissionFiles, PlaceError> {
        let def = placer.pool(pool)?.clone();
        let dir = placer.state().slots_dir();
        fs::create_dir_all(&dir).map_err(|e| slots_err(&dir, e))?;
        let slots = def
            .cpus
            .iter()
            .map(|&cpu| {
                let p = slot_path(placer.state(), pool, cpu);
                open_rw(&p).map(|f| (cpu, f)).map_err(|e| slots_err(&p, e))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let qp = queue_path(placer.state(), pool);
        let queue = open_rw(&qp).map_err(|e| slots_err(&qp, e))?;
        Ok(AdmissionFiles {
            pool: pool.to_string(),
            slots,
            queue,
        })
    }

    pub fn pool(&self) -> &str {
        &self.pool
    }
}

#[derive(Debug)]
enum AdmState {
    /// Holds the flock on `files.slots[slot]`.
    Admitted { slot: usize, cpu: u32 },
    /// Holds the lock on its ticket's record in the pool's waiting list.
    Waiting { ticket: u64 },
    /// Gave its slot or ticket up (dropped or turned back into files).
    Gone,
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
///
/// [`Admission::request`] opens the files it needs ([`Admission::request_with`] takes files
/// opened ahead); [`Admission::poll`], drop and [`Admission::into_files`] then use only those
/// descriptors (flock, fcntl F_OFD_GETLK/F_OFD_SETLK/F_OFD_SETLKW, pread64, pwrite64,
/// ftruncate, close) plus the placement calls (write to a pre-opened cgroup file,
/// sched_setaffinity, sched_setattr), so a thread confined by seccomp without open/unlink can
/// request, poll and give up.
#[derive(Debug)]
pub struct Admission {
    placer: Placer,
    tid: i32,
    pool: String,
    files: Option<AdmissionFiles>,
    state: AdmState,
}

fn slots_err(path: &Path, e: io::Error) -> PlaceError {
    PlaceError::io(
        match crate::place::is_permission(&e) {
            true => "write",
            false => "use",
        },
        path,
        e,
    )
}

fn read_u64_at(f: &File, off: u64) -> u64 {
    use std::os::unix::fs::FileExt;
    let mut b = [0u8; 8];
    match f.read_exact_at(&mut b, off) {
        Ok(()) => u64::from_le_bytes(b),
        Err(_) => 0,
    }
}

/// How long a ticket draw waits for the waiting list's header: a drawing process holds it for
/// microseconds, longer only when it is stopped, and a back-end must not hang behind that.
const HEADER_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// Write-locks the waiting list's header (`[0, 8)`), polling for up to [`HEADER_WAIT`].
fn lock_header(queue: &File) -> io::Result<()> {
    let deadline = std::time::Instant::now() + HEADER_WAIT;
    while !ofd_lock(queue, libc::F_WRLCK, 0, 8, false)? {
        if std::time::Instant::now() >= deadline {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "another process has held the waiting list's lock for over 2 s (a stopped \
                 lucid?): resume or end it",
            ));
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    Ok(())
}

/// Draws the next ticket and write-locks its record (pid, tid). Tickets restart at 0 when
/// no live waiter is left, so the file stays small.
fn draw_ticket(queue: &File, path: &Path, tid: i32) -> Result<u64, PlaceError> {
    use std::os::unix::fs::FileExt;
    let err = |e| slots_err(path, e);
    lock_header(queue).map_err(err)?;
    let result = (|| {
        let mut next = match ofd_first_lock(queue, QUEUE_HEADER, 0).map_err(err)? {
            None => {
                queue.set_len(QUEUE_HEADER).map_err(err)?;
                0
            }
            Some(_) => read_u64_at(queue, 0),
        };
        // A record someone still locks (a writer that did not bump the counter) is skipped.
        while !ofd_lock(queue, libc::F_WRLCK, ticket_start(next), TICKET_LEN, false).map_err(err)? {
            next += 1;
        }
        // SAFETY: getpid has no preconditions.
        let pid = unsafe { libc::getpid() };
        let mut rec = [0u8; TICKET_LEN as usize];
        rec[..4].copy_from_slice(&pid.to_le_bytes());
        rec[4..8].copy_from_slice(&tid.to_le_bytes());
        queue.write_all_at(&rec, ticket_start(next)).map_err(err)?;
        queue
            .write_all_at(&(next + 1).to_le_bytes(), 0)
            .map_err(err)?;
        Ok(next)
    })();
    let _ = ofd_lock(queue, libc::F_UNLCK, 0, 8, false);
    result
}

impl Admission {
    /// Queues `tid` for a CPU of `pool` and admits it at once if it is first in line and a
    /// slot is free. A waiting thread is left where it is.
    pub fn request(placer: Placer, tid: i32, pool: &str) -> Result<Admission, PlaceError> {
        let files = AdmissionFiles::open(&placer, pool)?;
        Admission::request_with(placer, tid, files).map_err(|r| r.error)
    }

    /// [`Admission::request`] with files opened ahead (for their pool). On failure the files
    /// come back with the error: a confined caller cannot open new ones.
    pub fn request_with(
        placer: Placer,
        tid: i32,
        files: AdmissionFiles,
    ) -> Result<Admission, Refused> {
        if let Err(error) = placer.pool(&files.pool) {
            return Err(Refused { error, files });
        }
        let qp = queue_path(placer.state(), &files.pool);
        let ticket = match draw_ticket(&files.queue, &qp, tid) {
            Ok(t) => t,
            Err(error) => return Err(Refused { error, files }),
        };
        let mut adm = Admission {
            placer,
            tid,
            pool: files.pool.clone(),
            files: Some(files),
            state: AdmState::Waiting { ticket },
        };
        match adm.poll() {
            Ok(_) => Ok(adm),
            Err(error) => Err(Refused {
                error,
                files: adm.into_files(),
            }),
        }
    }

    pub fn tid(&self) -> i32 {
        self.tid
    }
    pub fn pool(&self) -> &str {
        &self.pool
    }
    pub fn is_admitted(&self) -> bool {
        matches!(self.state, AdmState::Admitted { .. })
    }
    pub fn status(&self) -> AdmissionStatus {
        match &self.state {
            AdmState::Admitted { cpu, .. } => AdmissionStatus::Admitted { cpu: *cpu },
            _ => AdmissionStatus::Waiting,
        }
    }
    /// Whether the thread has exited (sched_getattr says ESRCH): drop the admission then to
    /// free its slot for the next waiter.
    pub fn thread_exited(&self) -> bool {
        get_attr(self.tid).is_err_and(|e| e.raw_os_error() == Some(libc::ESRCH))
    }

    /// The CPU held when admitted.
    pub fn cpu(&self) -> Option<u32> {
        match &self.state {
            AdmState::Admitted { cpu, .. } => Some(*cpu),
            _ => None,
        }
    }

    /// Admits the thread if no older live waiter is queued and a slot is free: pins it to
    /// that CPU inside the pool and makes it SCHED_FIFO. Returns whether it is admitted.
    pub fn poll(&mut self) -> Result<bool, PlaceError> {
        use std::os::unix::fs::FileExt;
        let ticket = match self.state {
            AdmState::Waiting { ticket } => ticket,
            AdmState::Admitted { .. } => return Ok(true),
            AdmState::Gone => return Ok(false),
        };
        let files = self.files.as_ref().expect("files while waiting");
        let qp = || queue_path(self.placer.state(), &self.pool);
        // Waiters that died hold no lock any more: only live ones count.
        if ticket > 0
            && ofd_first_lock(&files.queue, QUEUE_HEADER, ticket * TICKET_LEN)
                .map_err(|e| slots_err(&qp(), e))?
                .is_some()
        {
            return Ok(false);
        }
        let Some(i) = files
            .slots
            .iter()
            .map(|(_, f)| try_flock(f))
            .position(|r| matches!(r, Ok(true)))
        else {
            return Ok(false);
        };
        let (cpu, file) = &files.slots[i];
        let cpu = *cpu;
        // SAFETY: getpid has no preconditions.
        let pid = unsafe { libc::getpid() };
        let _ = file.set_len(0);
        let _ = file.write_all_at(format!("{pid} {}\n", self.tid).as_bytes(), 0);
        let pinned = self
            .placer
            .place(self.tid, &self.pool)
            .and_then(|()| set_affinity(self.tid, &[cpu]))
            .and_then(|()| {
                apply(self.tid, Policy::Noop)
                    .map(drop)
                    .map_err(|e| PlaceError::sched("set the policy of", self.tid, e))
            });
        if let Err(e) = pinned {
            // Not admitted after all: the slot goes to the next waiter at once (a thread that
            // cannot be pinned must not keep a CPU idle), the ticket stays for a retry.
            let _ = file.set_len(0);
            // SAFETY: flock on an fd we own.
            unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_UN) };
            return Err(e);
        }
        // From here on the slot is ours: the ticket goes (its record is unlocked).
        let _ = ofd_lock(
            &files.queue,
            libc::F_UNLCK,
            ticket_start(ticket),
            TICKET_LEN,
            false,
        );
        self.state = AdmState::Admitted { slot: i, cpu };
        Ok(true)
    }

    /// Gives the slot (clearing its holder line) or the ticket up, keeping the files open.
    fn give_up(&mut self) {
        let Some(files) = &self.files else { return };
        match std::mem::replace(&mut self.state, AdmState::Gone) {
            AdmState::Admitted { slot, .. } => {
                let f = &files.slots[slot].1;
                let _ = f.set_len(0);
                // SAFETY: flock on an fd we own.
                unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_UN) };
            }
            AdmState::Waiting { ticket } => {
                let _ = ofd_lock(
                    &files.queue,
                    libc::F_UNLCK,
                    ticket_start(ticket),
                    TICKET_LEN,
                    false,
                );
            }
            AdmState::Gone => {}
        }
    }

    /// Gives the slot (or the ticket) up and takes the thread out of the pool (default
    /// policy, every CPU).
    pub fn release(mut self) -> Result<(), PlaceError> {
        let r = match self.state {
            AdmState::Admitted { .. } => self.placer.unplace(self.tid),
            _ => Ok(()),
        };
        self.give_up();
        r
    }

    /// Gives the slot (or the ticket) up without touching the thread (it exited, or its
    /// owner moves it elsewhere) and returns the files for another thread's
    /// [`Admission::request_with`]. Needs no `open`.
    pub fn into_files(mut self) -> AdmissionFiles {
        self.give_up();
        self.files.take().expect("files until into_files")
    }
}

impl Drop for Admission {
    fn drop(&mut self) {
        // Closing the descriptors would drop the locks too; the holder line is cleared here.
        self.give_up();
    }
}

/// [`Admission::request_with`] failed: why, and the files it was given, for the next try.
#[derive(Debug, thiserror::Error)]
#[error("{error}")]
pub struct Refused {
    #[source]
    pub error: PlaceError,
    pub files: AdmissionFiles,
}

/// Who holds a no-op slot, for `lucid pools show`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct SlotInfo {
    pub cpu: u32,
    /// Whether some process holds the slot's lock.
    pub held: bool,
    /// (pid, tid) of the holder as it recorded them (None when free or not recorded).
    pub holder: Option<(i32, i32)>,
}

/// The slots of a `noop` pool and its live waiters (pid, tid), oldest first.
pub fn admission_state(state: &StateDir, pool: &PoolDef) -> (Vec<SlotInfo>, Vec<(i32, i32)>) {
    use std::os::unix::fs::FileExt;
    let slots = pool
        .cpus
        .iter()
        .map(|&cpu| {
            let p = slot_path(state, &pool.name, cpu);
            let held = File::open(&p)
                .ok()
                .filter(|f| matches!(try_flock(f), Ok(false)));
            let is_held = held.is_some();
            let holder = held.and_then(|_| {
                let s = fs::read_to_string(&p).ok()?;
                let mut it = s.split_whitespace().map(|x| x.parse::<i32>());
                match (it.next(), it.next()) {
                    (Some(Ok(a)), Some(Ok(b))) => Some((a, b)),
                    _ => None,
                }
            });
            SlotInfo {
                cpu,
                held: is_held,
                holder,
            }
        })
        .collect();
    let mut waiters = Vec::new();
    if let Ok(q) = File::open(queue_path(state, &pool.name)) {
        let mut at = QUEUE_HEADER;
        while let Ok(Some((start, len))) = ofd_first_lock(&q, at, 0) {
            let mut rec = [0u8; 8];
            if q.read_exact_at(&mut rec, start).is_ok() {
                let pid = i32::from_le_bytes(rec[..4].try_into().expect("4 bytes"));
                let tid = i32::from_le_bytes(rec[4..].try_into().expect("4 bytes"));
                waiters.push((pid, tid));
            }
            at = start + len.max(1);
        }
    }
    (slots, waiters)
}

/// Whether any slot of any pool is held or any waiter is live (destroy refuses then).
pub fn any_admission_live(state: &StateDir, pools: &[PoolDef]) -> bool {
    pools.iter().any(|p| {
        let (slots, waiters) = admission_state(state, p);
        !waiters.is_empty() || slots.iter().any(|s| s.held)
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
        let steps = [
            // Wake: UNDER -> BOOST1, then up one level each wake, capped at BOOST3.
            (Wake, Boost1),
            (Wake, Boost2),
            (Wake, Boost3),
            (Wake, Boost3),
            // Sleep and ticks: down one level each, floor at UNDER.
            (Sleep, Boost2),
            (Tick, Boost1),
            (Tick, Under),
            (Tick, Under),
            // A full slice drops any boost straight to UNDER.
            (Wake, Boost1),
            (Wake, Boost2),
            (FullSlice, Under),
            // OVER is not boosted by waking; back to UNDER when within its share.
            (OverShare, Over),
            (Wake, Over),
            (Tick, Over),
            (FullSlice, Over),
            (UnderShare, Under),
            (UnderShare, Under),
        ];
        for (i, (ev, want)) in steps.into_iter().enumerate() {
            assert_eq!(l.on(ev), want, "step {i}: {ev:?}");
        }
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
