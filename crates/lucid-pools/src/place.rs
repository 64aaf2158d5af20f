//! Putting threads into a pool and reading back what the kernel did.
//!
//! Three backends, chosen once at `lucid pools create` and recorded in `pools.json` so every
//! Lucid process on the host uses the same one:
//!
//! - [`Backend::CpusetV1`]: `<cpuset mount>/<root>/<pool>/` with `cpuset.cpus` and
//!   `cpuset.mems`; a thread moves by writing its tid to `tasks` (the kernel then narrows its
//!   affinity to the cpuset). v1 has no partitions, so other host tasks may still run on a
//!   pool's CPUs.
//! - [`Backend::CpusetV2`]: `<cgroup2>/<root>` is a threaded domain holding the VM processes;
//!   each pool is a `threaded` child (tids go to `cgroup.threads`) that is made a partition
//!   root (`cpuset.cpus.partition=root`) where the kernel accepts it, else left a member.
//! - [`Backend::Affinity`]: `sched_setaffinity` only, where no cpuset controller is usable.
//!
//! Detection prefers v2 when the unified hierarchy has the cpuset controller, then v1; env
//! `LUCID_POOLS_BACKEND=v1|v2|affinity` forces one.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::def::{format_cpu_list, online_cpus, HostPools, PoolDef, StateDir, ENV_BACKEND};
use crate::policy::{self, SchedPolicy};

/// How pools are realised on this host.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Backend {
    CpusetV1,
    CpusetV2,
    Affinity,
}

impl std::fmt::Display for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Backend::CpusetV1 => "cpuset-v1",
            Backend::CpusetV2 => "cpuset-v2",
            Backend::Affinity => "affinity",
        })
    }
}

/// What placing a thread can run into.
#[derive(Debug, thiserror::Error)]
pub enum PlaceError {
    #[error("no pools are defined in {0} (create them with `lucid pools create --def ...`)")]
    NoPools(PathBuf),
    #[error("no pool {0:?} (defined: {1})")]
    NoPool(String, String),
    #[error("thread {0} does not exist (it exited)")]
    NoThread(i32),
    #[error("{ENV_BACKEND}={0:?}: expected v1, v2 or affinity")]
    BadBackend(String),
    #[error("{ENV_BACKEND} asks for {0} but this host has no such cpuset hierarchy mounted")]
    NoHierarchy(Backend),
    #[error("no permission to {what} {path}: run as root (CAP_SYS_ADMIN for cgroups, CAP_SYS_NICE for policies)")]
    Permission { what: &'static str, path: PathBuf },
    #[error("cannot {what} {path}")]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot {what} thread {tid}")]
    Sched {
        what: &'static str,
        tid: i32,
        #[source]
        source: io::Error,
    },
}

/// Whether the kernel refused for want of permission (EACCES, EPERM, EROFS): the errors that
/// say "run as root" rather than "cannot".
pub(crate) fn is_permission(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EACCES) | Some(libc::EPERM) | Some(libc::EROFS)
    )
}

impl PlaceError {
    pub(crate) fn io(what: &'static str, path: &Path, source: io::Error) -> PlaceError {
        match is_permission(&source) {
            true => PlaceError::Permission {
                what,
                path: path.to_path_buf(),
            },
            false => PlaceError::Io {
                what,
                path: path.to_path_buf(),
                source,
            },
        }
    }
    pub(crate) fn sched(what: &'static str, tid: i32, source: io::Error) -> PlaceError {
        match source.raw_os_error() {
            Some(libc::ESRCH) => PlaceError::NoThread(tid),
            Some(libc::EPERM) | Some(libc::EACCES) => PlaceError::Permission {
                what,
                path: PathBuf::from(format!("/proc/{tid}")),
            },
            _ => PlaceError::Sched { what, tid, source },
        }
    }
}

/// The cpuset hierarchies mounted on this host: (v1 mount, v2 mount with cpuset enabled).
fn cpuset_mounts() -> (Option<PathBuf>, Option<PathBuf>) {
    let m = lucid_stats::cgroup::controller_mounts("cpuset").unwrap_or_default();
    (m.v1, m.v2.filter(|_| m.v2_offers))
}

/// The backend forced by `LUCID_POOLS_BACKEND` (`v1`, `v2` or `affinity`), if any.
pub fn backend_from_env() -> Result<Option<Backend>, PlaceError> {
    match std::env::var(ENV_BACKEND)
        .ok()
        .filter(|s| !s.is_empty())
        .as_deref()
    {
        None => Ok(None),
        Some("v1") => Ok(Some(Backend::CpusetV1)),
        Some("v2") => Ok(Some(Backend::CpusetV2)),
        Some("affinity") => Ok(Some(Backend::Affinity)),
        Some(other) => Err(PlaceError::BadBackend(other.to_string())),
    }
}

/// Chooses the backend (`forced`, else v2 with cpuset, else v1, else affinity) and the cgroup
/// directory for `cgroup_name`.
pub fn detect(
    cgroup_name: &str,
    forced: Option<Backend>,
) -> Result<(Backend, Option<PathBuf>), PlaceError> {
    let (v1, v2) = cpuset_mounts();
    let pick = |b: Backend, m: Option<PathBuf>| match m {
        Some(m) => Ok((b, Some(m.join(cgroup_name)))),
        None => Err(PlaceError::NoHierarchy(b)),
    };
    match forced {
        Some(Backend::CpusetV1) => pick(Backend::CpusetV1, v1),
        Some(Backend::CpusetV2) => pick(Backend::CpusetV2, v2),
        Some(Backend::Affinity) => Ok((Backend::Affinity, None)),
        None if v2.is_some() => pick(Backend::CpusetV2, v2),
        None if v1.is_some() => pick(Backend::CpusetV1, v1),
        None => Ok((Backend::Affinity, None)),
    }
}

/// Removes a cgroup root left by a crashed `create` (no pools.json): its sub-directories
/// and itself, only if no task is in any of them.
pub(crate) fn remove_leftover_root(backend: Backend, root: &Path) -> Result<(), PlaceError> {
    if !root.exists() {
        return Ok(());
    }
    let subdirs: Vec<PathBuf> = fs::read_dir(root)
        .map_err(|e| PlaceError::io("read", root, e))?
        .flatten()
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .map(|e| e.path())
        .collect();
    for d in subdirs.iter().chain(std::iter::once(&root.to_path_buf())) {
        if !cgroup_tids(d, backend).is_empty() {
            return Err(PlaceError::io(
                "reuse the leftover cgroup",
                d,
                io::Error::from_raw_os_error(libc::EBUSY),
            ));
        }
    }
    for d in &subdirs {
        fs::remove_dir(d).map_err(|e| PlaceError::io("remove cgroup", d, e))?;
    }
    fs::remove_dir(root).map_err(|e| PlaceError::io("remove cgroup", root, e))
}

fn write(path: &Path, value: &str) -> Result<(), PlaceError> {
    fs::write(path, value).map_err(|e| PlaceError::io("write", path, e))
}

fn read(path: &Path) -> Result<String, PlaceError> {
    fs::read_to_string(path).map_err(|e| PlaceError::io("read", path, e))
}

/// Tids listed in a cgroup's `tasks` / `cgroup.threads` (empty when it cannot be read).
pub fn cgroup_tids(dir: &Path, backend: Backend) -> Vec<i32> {
    let file = match backend {
        Backend::CpusetV2 => "cgroup.threads",
        _ => "tasks",
    };
    fs::read_to_string(dir.join(file))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect()
}

/// Makes the cgroups for `pools` under `root`. On failure removes what it made and returns
/// the first error.
pub(crate) fn create_cgroups(
    backend: Backend,
    root: &Path,
    pools: &[PoolDef],
) -> Result<(), PlaceError> {
    let parent = root.parent().expect("cgroup root under a mount");
    let mut made: Vec<PathBuf> = Vec::new();
    let result = (|| {
        fs::create_dir(root).map_err(|e| PlaceError::io("create cgroup", root, e))?;
        made.push(root.to_path_buf());
        let all: Vec<u32> = pools.iter().flat_map(|p| p.cpus.clone()).collect();
        let all = format_cpu_list(&all);
        match backend {
            Backend::CpusetV1 => {
                let mems = read(&parent.join("cpuset.mems"))?;
                write(&root.join("cpuset.cpus"), &all)?;
                write(&root.join("cpuset.mems"), mems.trim())?;
                for p in pools {
                    let d = root.join(&p.name);
                    fs::create_dir(&d).map_err(|e| PlaceError::io("create cgroup", &d, e))?;
                    made.push(d.clone());
                    write(&d.join("cpuset.cpus"), &format_cpu_list(&p.cpus))?;
                    write(&d.join("cpuset.mems"), mems.trim())?;
                }
            }
            Backend::CpusetV2 => {
                // The parent must hand cpuset down; "+cpuset" is idempotent.
                write(&parent.join("cgroup.subtree_control"), "+cpuset")?;
                write(&root.join("cpuset.cpus"), &all)?;
                write(&root.join("cgroup.subtree_control"), "+cpuset")?;
                for p in pools {
                    let d = root.join(&p.name);
                    fs::create_dir(&d).map_err(|e| PlaceError::io("create cgroup", &d, e))?;
                    made.push(d.clone());
                    write(&d.join("cgroup.type"), "threaded")?;
                    write(&d.join("cpuset.cpus"), &format_cpu_list(&p.cpus))?;
                    // Keep other tasks off the pool's CPUs where the kernel allows it
                    // (partitions in threaded subtrees need a recent kernel).
                    let part = d.join("cpuset.cpus.partition");
                    if part.exists() {
                        let _ = fs::write(&part, "root");
                        let got = fs::read_to_string(&part).unwrap_or_default();
                        if got.trim() != "root" {
                            log::info!(
                                "pool {}: the kernel refused a cpuset partition ({}): CPUs shared with other tasks",
                                p.name,
                                got.trim()
                            );
                            let _ = fs::write(&part, "member");
                        }
                    }
                }
            }
            Backend::Affinity => unreachable!("no cgroups for the affinity backend"),
        }
        Ok(())
    })();
    if result.is_err() {
        for d in made.iter().rev() {
            let _ = fs::remove_dir(d);
        }
    }
    result
}

/// Moves every task out of the pool cgroups (to the hierarchy's top) and removes them.
/// Moved threads get the default policy and every online CPU back.
pub(crate) fn remove_cgroups(
    backend: Backend,
    root: &Path,
    pools: &[PoolDef],
) -> Result<(), PlaceError> {
    if !root.exists() {
        return Ok(());
    }
    let top = root.parent().expect("cgroup root under a mount");
    let all = online_cpus().unwrap_or_default();
    let evict = |dir: &Path| {
        for tid in cgroup_tids(dir, backend) {
            let _ = policy::reset(tid);
            match backend {
                Backend::CpusetV2 => {
                    // Threads go back to the threaded domain, processes to the top below.
                    let _ = fs::write(root.join("cgroup.threads"), tid.to_string());
                }
                _ => {
                    let _ = fs::write(top.join("tasks"), tid.to_string());
                }
            }
            let _ = set_affinity(tid, &all);
        }
    };
    for p in pools {
        let d = root.join(&p.name);
        if d.exists() {
            evict(&d);
            fs::remove_dir(&d).map_err(|e| PlaceError::io("remove cgroup", &d, e))?;
        }
    }
    if backend == Backend::CpusetV2 {
        for pid in fs::read_to_string(root.join("cgroup.procs"))
            .unwrap_or_default()
            .lines()
        {
            let _ = fs::write(top.join("cgroup.procs"), pid.trim());
        }
    } else {
        evict(root);
    }
    fs::remove_dir(root).map_err(|e| PlaceError::io("remove cgroup", root, e))
}

/// Sets a thread's CPU affinity.
pub fn set_affinity(tid: i32, cpus: &[u32]) -> Result<(), PlaceError> {
    // SAFETY: cpu_set_t is plain data; zeroed is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    for &c in cpus {
        if (c as usize) < libc::CPU_SETSIZE as usize {
            // SAFETY: CPU_SET on a local set; c is below CPU_SETSIZE.
            unsafe { libc::CPU_SET(c as usize, &mut set) };
        }
    }
    let pid = policy::sched_pid(tid);
    // SAFETY: the set is a valid cpu_set_t of the size given.
    let r = unsafe { libc::sched_setaffinity(pid, std::mem::size_of_val(&set), &set) };
    if r != 0 {
        return Err(PlaceError::sched(
            "set the affinity of",
            tid,
            io::Error::last_os_error(),
        ));
    }
    Ok(())
}

/// A thread's CPU affinity.
pub fn affinity(tid: i32) -> Result<Vec<u32>, PlaceError> {
    // SAFETY: cpu_set_t is plain data.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: the kernel writes at most size_of(set) bytes into it.
    let r = unsafe { libc::sched_getaffinity(tid, std::mem::size_of_val(&set), &mut set) };
    if r != 0 {
        return Err(PlaceError::sched(
            "read the affinity of",
            tid,
            io::Error::last_os_error(),
        ));
    }
    Ok((0..libc::CPU_SETSIZE as usize)
        // SAFETY: CPU_ISSET reads the local set within its size.
        .filter(|&c| unsafe { libc::CPU_ISSET(c, &set) })
        .map(|c| c as u32)
        .collect())
}

/// The cpuset cgroup of a thread from `/proc/<tid>/cgroup` (v1 `cpuset` line, else the v2
/// line), e.g. `/lucid-pools/io`.
pub fn cpuset_cgroup(tid: i32) -> Result<String, PlaceError> {
    let p = PathBuf::from(format!("/proc/{tid}/cgroup"));
    let s = fs::read_to_string(&p).map_err(|e| match e.kind() {
        io::ErrorKind::NotFound => PlaceError::NoThread(tid),
        _ => PlaceError::io("read", &p, e),
    })?;
    let mut v2 = None;
    for line in s.lines() {
        let mut f = line.splitn(3, ':');
        let (_, ctl, path) = (f.next(), f.next().unwrap_or(""), f.next().unwrap_or(""));
        if ctl.split(',').any(|c| c == "cpuset") {
            return Ok(path.to_string());
        }
        if ctl.is_empty() {
            v2 = Some(path.to_string());
        }
    }
    Ok(v2.unwrap_or_else(|| "/".to_string()))
}

/// What the kernel says about a thread's placement and policy.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ReadBack {
    pub affinity: Vec<u32>,
    /// The cpuset cgroup path as in `/proc/<tid>/cgroup` (relative to the hierarchy's mount).
    pub cgroup: String,
    pub policy: SchedPolicy,
    /// RT priority (FIFO/RR), else 0.
    pub priority: u32,
    pub nice: i32,
    /// The slice (`sched_runtime` as sched_getattr reports it: under EEVDF (6.12+) the
    /// thread's effective slice, the default one unless it asked for its own; 0 before).
    pub slice_ns: u64,
}

/// Reads back affinity (sched_getaffinity), cpuset cgroup (`/proc/<tid>/cgroup`) and
/// policy (sched_getattr) of a thread.
pub fn read_back(tid: i32) -> Result<ReadBack, PlaceError> {
    let affinity = affinity(tid)?;
    let cgroup = cpuset_cgroup(tid)?;
    let a = policy::get_attr(tid).map_err(|e| PlaceError::sched("read the policy of", tid, e))?;
    Ok(ReadBack {
        affinity,
        cgroup,
        policy: a.policy,
        priority: a.priority,
        nice: a.nice,
        slice_ns: a.runtime_ns,
    })
}

fn tgid_of(tid: i32) -> Result<i32, PlaceError> {
    let s =
        fs::read_to_string(format!("/proc/{tid}/status")).map_err(|_| PlaceError::NoThread(tid))?;
    s.lines()
        .find_map(|l| l.strip_prefix("Tgid:"))
        .and_then(|v| v.trim().parse().ok())
        .ok_or(PlaceError::NoThread(tid))
}

/// Cgroup files a [`Placer`] writes tids to, opened once so that re-placing threads later
/// needs no `open` (a seccomp-confined monitor thread can do it with `write`).
#[derive(Debug, Default)]
struct Attach {
    /// Per pool: v1 `tasks`, v2 `cgroup.threads`.
    pools: std::collections::HashMap<String, fs::File>,
    /// Where `unplace` sends a thread: v1 the hierarchy's top `tasks`, v2 the pools' root
    /// `cgroup.threads`.
    out: Option<fs::File>,
    /// v2: the pools' root `cgroup.procs` (a process joins the threaded domain there).
    procs: Option<fs::File>,
    /// v2: whether this process has joined the domain.
    joined: std::sync::atomic::AtomicBool,
    /// The online CPUs when opened (for `unplace`).
    online: Vec<u32>,
    /// Set by [`Placer::forbid_open`]: a file that could not be opened ahead is an error, never
    /// opened now (the caller may be confined by seccomp without `open`).
    no_open: std::sync::atomic::AtomicBool,
}

fn open_w(path: &Path) -> Option<fs::File> {
    match fs::OpenOptions::new().write(true).open(path) {
        Ok(f) => Some(f),
        Err(e) => {
            log::debug!(
                "cannot open {} now ({e}): will try again when used",
                path.display()
            );
            None
        }
    }
}

/// Writes `tid` to a pre-opened cgroup file, or opens `path` when it could not be opened
/// earlier (that open then reports the real error) unless `no_open`.
fn write_tid(f: Option<&fs::File>, path: &Path, tid: i32, no_open: bool) -> Result<(), PlaceError> {
    use std::io::Write;
    let r = match f {
        Some(mut f) => f.write_all(tid.to_string().as_bytes()),
        None if no_open => Err(io::Error::new(
            io::ErrorKind::NotFound,
            "could not be opened before the threads were confined",
        )),
        None => fs::write(path, tid.to_string()),
    };
    r.map_err(|e| match e.raw_os_error() {
        Some(libc::ESRCH) => PlaceError::NoThread(tid),
        _ => PlaceError::io("write", path, e),
    })
}

/// Places threads into the host's pools. Cheap to clone; one per VM process. Opening it
/// reads `pools.json` and opens the cgroup files it will write, so after that placing
/// threads needs only write, sched_setaffinity, sched_setattr and setpriority.
#[derive(Clone, Debug)]
pub struct Placer {
    state: StateDir,
    host: HostPools,
    attach: std::sync::Arc<Attach>,
}

impl Placer {
    /// The placer for the pools defined in `state`, or None when no pools are defined.
    pub fn open(state: &StateDir) -> Result<Option<Placer>, crate::def::DefError> {
        let Some(host) = state.load()? else {
            return Ok(None);
        };
        policy::default_io_slice_ns();
        let mut attach = Attach {
            online: online_cpus().unwrap_or_default(),
            ..Default::default()
        };
        if let Some(root) = &host.cgroup {
            let (file, out) = match host.backend {
                Backend::CpusetV2 => ("cgroup.threads", root.join("cgroup.threads")),
                _ => ("tasks", root.parent().expect("under a mount").join("tasks")),
            };
            for p in &host.pools {
                if let Some(f) = open_w(&root.join(&p.name).join(file)) {
                    attach.pools.insert(p.name.clone(), f);
                }
            }
            attach.out = open_w(&out);
            if host.backend == Backend::CpusetV2 {
                attach.procs = open_w(&root.join("cgroup.procs"));
            }
        }
        Ok(Some(Placer {
            state: state.clone(),
            host,
            attach: std::sync::Arc::new(attach),
        }))
    }

    pub fn state(&self) -> &StateDir {
        &self.state
    }

    /// From now on this placer (and its clones) never opens a file: a cgroup file it could not
    /// open ahead makes placing fail instead (for threads confined by seccomp without `open`).
    pub fn forbid_open(&self) {
        self.attach
            .no_open
            .store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether [`Placer::open`] opened every cgroup file placing will write (always true for
    /// the affinity backend).
    pub fn files_ready(&self) -> bool {
        self.host.cgroup.is_none()
            || self
                .host
                .pools
                .iter()
                .all(|p| self.attach.pools.contains_key(&p.name))
    }
    pub fn host(&self) -> &HostPools {
        &self.host
    }
    pub fn backend(&self) -> Backend {
        self.host.backend
    }
    pub fn pools(&self) -> &[PoolDef] {
        &self.host.pools
    }

    pub fn pool(&self, name: &str) -> Result<&PoolDef, PlaceError> {
        self.host
            .pools
            .iter()
            .find(|p| p.name == name)
            .ok_or_else(|| {
                PlaceError::NoPool(
                    name.to_string(),
                    self.host
                        .pools
                        .iter()
                        .map(|p| p.name.as_str())
                        .collect::<Vec<_>>()
                        .join(", "),
                )
            })
    }

    /// The pool device back-end threads go to (`backends=on`, implied by `noop`), if any.
    pub fn backend_pool(&self) -> Option<&PoolDef> {
        self.host.pools.iter().find(|p| p.backends)
    }

    /// What the kernel says about `tid`: see [`read_back`].
    pub fn read_back(&self, tid: i32) -> Result<ReadBack, PlaceError> {
        read_back(tid)
    }

    /// The cgroup directory of a pool (None for the affinity backend).
    pub fn pool_dir(&self, pool: &str) -> Option<PathBuf> {
        self.host.cgroup.as_ref().map(|c| c.join(pool))
    }

    /// Moves thread `tid` into `pool`'s CPUs (cgroup and affinity). The policy is applied
    /// separately ([`crate::policy::apply`]) or by [`Placer::place_thread`].
    pub fn place(&self, tid: i32, pool: &str) -> Result<(), PlaceError> {
        use std::sync::atomic::Ordering;
        let def = self.pool(pool)?;
        let pre = self.attach.pools.get(pool);
        let no_open = self.attach.no_open.load(Ordering::Relaxed);
        match (self.host.backend, self.pool_dir(pool)) {
            (Backend::CpusetV1, Some(dir)) => write_tid(pre, &dir.join("tasks"), tid, no_open)?,
            (Backend::CpusetV2, Some(dir)) => {
                let root = self.host.cgroup.as_ref().expect("v2 has a cgroup root");
                let procs = root.join("cgroup.procs");
                let threads = dir.join("cgroup.threads");
                // Threads may only spread over the threaded subtree of their process's
                // domain: this process joins the pools' root once.
                if !self.attach.joined.swap(true, Ordering::Relaxed) {
                    // SAFETY: getpid has no preconditions.
                    let pid = unsafe { libc::getpid() };
                    write_tid(self.attach.procs.as_ref(), &procs, pid, no_open)?;
                }
                if let Err(e) = write_tid(pre, &threads, tid, no_open) {
                    // A thread of another process (the CLI, tests): its process joins first.
                    if no_open {
                        return Err(e);
                    }
                    let tgid = tgid_of(tid)?;
                    // SAFETY: getpid has no preconditions.
                    if tgid == unsafe { libc::getpid() } {
                        return Err(e);
                    }
                    write_tid(self.attach.procs.as_ref(), &procs, tgid, no_open)?;
                    write_tid(pre, &threads, tid, no_open)?;
                }
            }
            _ => {}
        }
        // For cpusets the kernel already narrowed the affinity; setting it again undoes a
        // one-CPU pin from an earlier no-op admission and is the whole job for `Affinity`.
        set_affinity(tid, &def.cpus)
    }

    /// Moves a thread out of every pool: top cgroup (v2: the pools' root, which spans every
    /// pool CPU), every online CPU, default policy.
    pub fn unplace(&self, tid: i32) -> Result<(), PlaceError> {
        if let Some(root) = &self.host.cgroup {
            let out = self.attach.out.as_ref();
            let no_open = self
                .attach
                .no_open
                .load(std::sync::atomic::Ordering::Relaxed);
            match self.host.backend {
                Backend::CpusetV1 => write_tid(
                    out,
                    &root.parent().expect("under a mount").join("tasks"),
                    tid,
                    no_open,
                )?,
                Backend::CpusetV2 => write_tid(out, &root.join("cgroup.threads"), tid, no_open)?,
                Backend::Affinity => {}
            }
        }
        policy::reset(tid).map_err(|e| PlaceError::sched("reset the policy of", tid, e))?;
        set_affinity(tid, &self.attach.online)
    }

    /// Places `tid` into `pool` and applies the pool's policy. Threads for a `noop` pool go
    /// through admission: the result holds the CPU slot (keep it while the thread lives) or
    /// the ticket of a waiting thread ([`crate::policy::Admission::poll`] admits it later).
    pub fn place_thread(&self, tid: i32, pool: &str) -> Result<Placed, PlaceError> {
        let def = self.pool(pool)?.clone();
        if def.policy == crate::def::Policy::Noop {
            let adm = policy::Admission::request(self.clone(), tid, &def.name)?;
            return Ok(Placed::Noop(adm));
        }
        self.place(tid, pool)?;
        let applied = policy::apply_slice(tid, def.policy, def.slice_ns())
            .map_err(|e| PlaceError::sched("set the policy of", tid, e))?;
        Ok(Placed::Policy(applied))
    }
}

/// What [`Placer::place_thread`] did.
#[derive(Debug)]
pub enum Placed {
    /// Placed with a policy applied.
    Policy(policy::Applied),
    /// A no-op pool thread: admitted (holds its CPU) or waiting.
    Noop(policy::Admission),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn affinity_round_trip_on_self() {
        // SAFETY: gettid has no preconditions.
        let tid = unsafe { libc::gettid() };
        let before = affinity(tid).unwrap();
        assert!(!before.is_empty());
        set_affinity(tid, &before[..1]).unwrap();
        assert_eq!(affinity(tid).unwrap(), before[..1].to_vec());
        set_affinity(tid, &before).unwrap();
        assert!(cpuset_cgroup(tid).unwrap().starts_with('/'));
    }

    /// The v2 write sequence on a stand-in directory (this host's cgroup2 has no cpuset):
    /// what is written where, not the kernel's answer.
    #[test]
    fn v2_layout_and_place_sequence() {
        let base = std::env::temp_dir().join(format!("lucid-p1-v2-{}", std::process::id()));
        let _ = fs::remove_dir_all(&base);
        fs::create_dir_all(&base).unwrap();
        let root = base.join("pools");
        let pools = vec![
            PoolDef::parse("name=be,cpus=1,policy=noop").unwrap(),
            PoolDef::parse("name=vm,cpus=0,policy=io").unwrap(),
        ];
        create_cgroups(Backend::CpusetV2, &root, &pools).unwrap();
        let rd = |p: &str| fs::read_to_string(root.join(p)).unwrap();
        assert_eq!(
            fs::read_to_string(base.join("cgroup.subtree_control")).unwrap(),
            "+cpuset"
        );
        assert_eq!(rd("cpuset.cpus"), "0-1");
        assert_eq!(rd("cgroup.subtree_control"), "+cpuset");
        assert_eq!(rd("be/cgroup.type"), "threaded");
        assert_eq!(rd("be/cpuset.cpus"), "1");
        assert_eq!(rd("vm/cpuset.cpus"), "0");
        let placer = Placer {
            state: StateDir::new(base.join("state"), "pools"),
            host: HostPools {
                pools,
                backend: Backend::CpusetV2,
                cgroup: Some(root.clone()),
                created: 0,
            },
            attach: Default::default(),
        };
        // SAFETY: gettid/getpid have no preconditions.
        let (tid, pid) = unsafe { (libc::gettid(), libc::getpid()) };
        let before = affinity(tid).unwrap();
        placer.place(tid, "vm").unwrap();
        assert_eq!(
            rd("cgroup.procs"),
            pid.to_string(),
            "the process joins the domain"
        );
        assert_eq!(rd("vm/cgroup.threads"), tid.to_string());
        assert_eq!(affinity(tid).unwrap(), vec![0]);
        set_affinity(tid, &before).unwrap();
        fs::remove_dir_all(&base).unwrap();
    }

    #[test]
    fn gone_thread_is_named() {
        assert!(matches!(
            read_back(i32::MAX - 1),
            Err(PlaceError::NoThread(_))
        ));
    }
}
