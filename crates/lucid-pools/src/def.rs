//! Pool definitions and the host-wide state directory every Lucid process on the host joins.
//!
//! A pool is a named set of host CPUs with a [`Policy`] for the Lucid threads placed in it.
//! The definition lives in a small state directory (default `/run/lucid/pools`, env
//! `LUCID_POOLS_DIR`), so there is no daemon: `lucid pools create` writes it and makes the
//! cgroups, each VM reads it, places its threads and publishes `vms/<pid>.json`:
//!
//! ```text
//! <dir>/pools.json          the PoolSet, the placement backend and the cgroup root
//! <dir>/vms/<pid>.json      one per running VM (name, pool, threads, monitor figures)
//! <dir>/slots/<pool>.<cpu>  no-op admission: flocked by the process holding that CPU
//! <dir>/slots/<pool>.queue  no-op waiting list: one record per waiter, held by an OFD lock
//! ```
//!
//! Liveness never relies on a process cleaning up: slots and waiting-list records are locked
//! by their holder (the kernel drops the lock when it dies) and a VM file names its pid and the
//! pid's start time, so files of crashed processes are recognised as stale, ignored and
//! removed by the next reader. `create`/`destroy` take an exclusive `flock` on the directory,
//! are idempotent and undo what they did when a step fails.
//!
//! Once a VM has opened its [`crate::place::Placer`] and [`VmPublisher`] (before its threads
//! confine themselves), placing threads, polling admission and publishing need no `open`,
//! `rename` or `unlink`: see [`crate::policy::Admission`] for the system calls.

use std::collections::BTreeSet;
use std::fmt;
use std::fs;
use std::io;
use std::os::fd::AsRawFd;
use std::path::{Component, Path, PathBuf};
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// Default state directory.
pub const DEFAULT_DIR: &str = "/run/lucid/pools";
/// Default cgroup directory name under the cpuset hierarchy.
pub const DEFAULT_CGROUP: &str = "lucid-pools";
/// Env var overriding [`DEFAULT_DIR`].
pub const ENV_DIR: &str = "LUCID_POOLS_DIR";
/// Env var overriding [`DEFAULT_CGROUP`].
pub const ENV_CGROUP: &str = "LUCID_POOLS_CGROUP";
/// Env var forcing a placement backend (`v1`, `v2` or `affinity`) instead of detecting one.
pub const ENV_BACKEND: &str = "LUCID_POOLS_BACKEND";

/// Scheduling policy of a pool (docs/scheduling.md, "Pools and policies").
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Policy {
    /// Dedicated CPUs for back-end threads: one thread per CPU, SCHED_FIFO, admission.
    Noop,
    /// I/O vCPUs: SCHED_OTHER with a short (3 ms) slice, wake boost, halt polling on.
    Io,
    /// CPU-bound vCPUs: SCHED_BATCH nice 10, halt polling off.
    Cpu,
    /// What Linux does: SCHED_OTHER nice 0.
    Default,
}

/// Halt polling for vCPUs of `io` pools: KVM's usual default window (200 µs).
pub const IO_HALT_POLL_NS: u32 = 200_000;

impl Policy {
    pub const ALL: [Policy; 4] = [Policy::Noop, Policy::Io, Policy::Cpu, Policy::Default];

    /// Halt polling the VMM should set (KVM_CAP_HALT_POLL) for vCPUs under this policy;
    /// `None` = leave KVM's default.
    pub fn halt_poll_ns(self) -> Option<u32> {
        match self {
            Policy::Io => Some(IO_HALT_POLL_NS),
            Policy::Cpu => Some(0),
            Policy::Noop | Policy::Default => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Policy::Noop => "noop",
            Policy::Io => "io",
            Policy::Cpu => "cpu",
            Policy::Default => "default",
        }
    }
}

impl fmt::Display for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Policy {
    type Err = DefError;
    fn from_str(s: &str) -> Result<Self, DefError> {
        Policy::ALL
            .into_iter()
            .find(|p| p.as_str() == s)
            .ok_or_else(|| DefError::BadPolicy(s.to_string()))
    }
}

/// `lucid pools create --def`: one pool.
pub const DEF: lucid_opts::OptSpec = lucid_opts::OptSpec {
    flag: "--def",
    about:
        "A pool (repeatable; e.g. --def name=be,cpus=1,policy=noop --def name=vm,cpus=0,policy=io).",
    head: None,
    keys: &[
        lucid_opts::OptKey::new(
            "name",
            "NAME",
            "1-32 of a-z A-Z 0-9 _ - (it names a cgroup)",
        )
        .required(),
        lucid_opts::OptKey::new("cpus", "LIST", "host CPUs, e.g. 1 or 0-3,6")
            .required()
            .list(),
        lucid_opts::OptKey::new(
            "policy",
            "noop|io|cpu|default",
            "the pool's scheduling policy",
        )
        .required(),
        lucid_opts::OptKey::new(
            "backends",
            "on|off",
            "device back-end threads go here (default: on for noop)",
        ),
        lucid_opts::OptKey::new(
            "slice_us",
            "N",
            "EEVDF slice for io, cpu or default pools, 100 to 100000 µs",
        ),
    ],
};

/// One pool: a name, its host CPUs and its policy. `backends` marks the pool device back-end
/// threads go to (at most one pool; a `noop` pool is a back-end pool by definition).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolDef {
    pub name: String,
    pub cpus: Vec<u32>,
    pub policy: Policy,
    #[serde(default)]
    pub backends: bool,
    /// The EEVDF slice (`sched_runtime`) for threads of a fair-class pool, in µs (100..=100000).
    /// None: `io` pools take [`crate::policy::default_io_slice_ns`], the others the kernel's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slice_us: Option<u32>,
}

/// Everything wrong with a definition or with the state directory, said so it can be fixed.
#[derive(Debug, thiserror::Error)]
pub enum DefError {
    #[error("bad pool definition {def:?}: {why} (expected {})", DEF.syntax())]
    Syntax { def: String, why: String },
    #[error(
        "bad pool name {0:?}: use 1-32 characters of a-z A-Z 0-9 _ - (it names a cgroup directory)"
    )]
    BadName(String),
    #[error("unknown policy {0:?}: expected noop, io, cpu or default")]
    BadPolicy(String),
    #[error("bad CPU list {0:?}: expected e.g. 1 or 0-3,6")]
    BadCpuList(String),
    #[error("pool {0:?} has no CPUs: give cpus=LIST")]
    Empty(String),
    #[error("pool {pool:?}: slice_us={us} is not allowed: give 100..=100000 µs, and only for io, cpu or default pools (noop threads are SCHED_FIFO)")]
    BadSlice { pool: String, us: u32 },
    #[error("no pools given: pass at least one --def")]
    NoPools,
    #[error("pool {0:?} is defined twice: pool names must be unique")]
    Duplicate(String),
    #[error("pool {pool:?}: CPU {cpu} is not online on this host (online: {online}); see /sys/devices/system/cpu/online")]
    OfflineCpu {
        pool: String,
        cpu: u32,
        online: String,
    },
    #[error("pools {a:?} and {b:?} overlap on CPU {cpu}: a CPU belongs to at most one pool")]
    Overlap { a: String, b: String, cpu: u32 },
    #[error("pools {0:?} and {1:?} both say backends=on: back-end threads go to one pool")]
    TwoBackendPools(String, String),
    #[error("bad pools JSON: {0}")]
    Json(String),
    #[error(
        "{path} is corrupt ({why}): `lucid pools destroy --force` removes it (then remove any \
         pool cgroup directory left by hand) and `lucid pools create` defines the pools again"
    )]
    Corrupt { path: PathBuf, why: String },
    #[error("pools are already defined in {dir} with a different definition; run `lucid pools destroy` first")]
    Exists { dir: PathBuf },
    #[error("{live} live VM(s) still use the pools ({pids}); stop them or pass --force")]
    InUse { live: usize, pids: String },
    #[error("no permission to {what} {path}: run as root (or with CAP_SYS_ADMIN/CAP_SYS_NICE) or set {ENV_DIR}/{ENV_CGROUP} to places you may write")]
    Permission { what: &'static str, path: PathBuf },
    #[error("cannot {what} {path}")]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error(transparent)]
    Place(#[from] crate::place::PlaceError),
}

impl DefError {
    /// An I/O error, or [`DefError::Permission`] when the kernel said EACCES/EPERM/EROFS.
    pub fn io(what: &'static str, path: &Path, source: io::Error) -> DefError {
        match crate::place::is_permission(&source) {
            true => DefError::Permission {
                what,
                path: path.to_path_buf(),
            },
            false => DefError::Io {
                what,
                path: path.to_path_buf(),
                source,
            },
        }
    }
}

fn valid_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 32
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// Parses a kernel-style CPU list (`0-3,6`) into sorted, unique CPU numbers.
pub fn parse_cpu_list(s: &str) -> Result<Vec<u32>, DefError> {
    let bad = || DefError::BadCpuList(s.to_string());
    let mut out = BTreeSet::new();
    for part in s.trim().split(',').filter(|p| !p.is_empty()) {
        let (a, b) = match part.split_once('-') {
            Some((a, b)) => (a, b),
            None => (part, part),
        };
        let a: u32 = a.trim().parse().map_err(|_| bad())?;
        let b: u32 = b.trim().parse().map_err(|_| bad())?;
        if a > b || b - a > 4096 {
            return Err(bad());
        }
        out.extend(a..=b);
    }
    Ok(out.into_iter().collect())
}

/// Formats CPUs as a kernel-style list (`0-3,6`).
pub fn format_cpu_list(cpus: &[u32]) -> String {
    let mut v: Vec<u32> = cpus.to_vec();
    v.sort_unstable();
    v.dedup();
    let mut out = Vec::new();
    let mut i = 0;
    while i < v.len() {
        let mut j = i;
        while j + 1 < v.len() && v[j + 1] == v[j] + 1 {
            j += 1;
        }
        out.push(match i == j {
            true => v[i].to_string(),
            false => format!("{}-{}", v[i], v[j]),
        });
        i = j + 1;
    }
    out.join(",")
}

/// The host's online CPUs (`/sys/devices/system/cpu/online`).
pub fn online_cpus() -> Result<Vec<u32>, DefError> {
    let p = Path::new("/sys/devices/system/cpu/online");
    let s = fs::read_to_string(p).map_err(|e| DefError::io("read", p, e))?;
    parse_cpu_list(&s)
}

impl PoolDef {
    /// Parses one `--def` by [`DEF`]. `cpus` takes a kernel-style list; since the list itself
    /// has commas, a key-less item after `cpus=` continues it (`cpus=0,2,policy=cpu`).
    pub fn parse(def: &str) -> Result<PoolDef, DefError> {
        let syntax = |why: String| DefError::Syntax {
            def: def.to_string(),
            why,
        };
        let p = DEF.parse(def).map_err(|e| syntax(e.to_string()))?;
        let (mut name, mut cpus, mut policy) = (String::new(), String::new(), Policy::Default);
        let (mut backends, mut slice_us) = (None, None);
        for (k, v) in &p.pairs {
            match *k {
                "name" => name = v.clone(),
                "cpus" => cpus = v.clone(),
                "policy" => policy = v.parse::<Policy>()?,
                "backends" => {
                    backends = Some(
                        lucid_opts::parse_bool(v)
                            .ok_or_else(|| syntax(format!("backends={v:?}: expected on or off")))?,
                    )
                }
                "slice_us" => {
                    slice_us =
                        Some(v.parse::<u32>().map_err(|_| {
                            syntax(format!("slice_us={v:?}: expected microseconds"))
                        })?)
                }
                _ => {}
            }
        }
        let cpus = parse_cpu_list(&cpus)?;
        Ok(PoolDef {
            backends: backends.unwrap_or(policy == Policy::Noop),
            name,
            cpus,
            policy,
            slice_us,
        })
    }

    /// The `--def` string that parses back to this pool.
    pub fn to_def_string(&self) -> String {
        format!(
            "name={},cpus={},policy={}{}",
            self.name,
            format_cpu_list(&self.cpus),
            self.policy,
            if self.backends { ",backends=on" } else { "" }
        ) + &self
            .slice_us
            .map(|s| format!(",slice_us={s}"))
            .unwrap_or_default()
    }

    /// The slice its threads ask for: `slice_us`, else for `io` the short default
    /// ([`crate::policy::default_io_slice_ns`]); None = the kernel's (and always for `noop`).
    pub fn slice_ns(&self) -> Option<u64> {
        match (self.policy, self.slice_us) {
            (Policy::Noop, _) => None,
            (_, Some(us)) => Some(u64::from(us) * 1000),
            (Policy::Io, None) => Some(crate::policy::default_io_slice_ns()),
            (_, None) => None,
        }
    }
}

/// A validated set of pools.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolSet {
    pub pools: Vec<PoolDef>,
}

impl PoolSet {
    /// Parses the CLI's `--def` strings and validates them against the host's online CPUs.
    pub fn parse_defs<S: AsRef<str>>(defs: &[S]) -> Result<PoolSet, DefError> {
        let pools = defs
            .iter()
            .map(|d| PoolDef::parse(d.as_ref()))
            .collect::<Result<Vec<_>, _>>()?;
        PoolSet::new(pools, &online_cpus()?)
    }

    /// Parses `{"pools":[{"name":..,"cpus":[..],"policy":..,"backends":..}]}` (or the bare
    /// array) and validates it against the host's online CPUs.
    pub fn from_json(text: &str) -> Result<PoolSet, DefError> {
        let v: serde_json::Value =
            serde_json::from_str(text).map_err(|e| DefError::Json(e.to_string()))?;
        let arr = match v {
            serde_json::Value::Object(mut o) => o
                .remove("pools")
                .ok_or_else(|| DefError::Json("no \"pools\" array".into()))?,
            a => a,
        };
        let pools: Vec<PoolDef> =
            serde_json::from_value(arr).map_err(|e| DefError::Json(e.to_string()))?;
        PoolSet::new(pools, &online_cpus()?)
    }

    /// Validates `pools` against `online` CPUs (sorting each pool's CPUs).
    pub fn new(mut pools: Vec<PoolDef>, online: &[u32]) -> Result<PoolSet, DefError> {
        if pools.is_empty() {
            return Err(DefError::NoPools);
        }
        for p in &mut pools {
            if !valid_name(&p.name) {
                return Err(DefError::BadName(p.name.clone()));
            }
            p.cpus.sort_unstable();
            p.cpus.dedup();
            // No-op pools exist for back-end threads, whatever the definition said.
            if p.policy == Policy::Noop {
                p.backends = true;
            }
            if p.cpus.is_empty() {
                return Err(DefError::Empty(p.name.clone()));
            }
            if let Some(us) = p.slice_us {
                if p.policy == Policy::Noop || !(100..=100_000).contains(&us) {
                    return Err(DefError::BadSlice {
                        pool: p.name.clone(),
                        us,
                    });
                }
            }
            if let Some(&cpu) = p.cpus.iter().find(|c| !online.contains(c)) {
                return Err(DefError::OfflineCpu {
                    pool: p.name.clone(),
                    cpu,
                    online: format_cpu_list(online),
                });
            }
        }
        for (i, a) in pools.iter().enumerate() {
            for b in &pools[i + 1..] {
                if a.name == b.name {
                    return Err(DefError::Duplicate(a.name.clone()));
                }
                if let Some(&cpu) = a.cpus.iter().find(|c| b.cpus.contains(c)) {
                    return Err(DefError::Overlap {
                        a: a.name.clone(),
                        b: b.name.clone(),
                        cpu,
                    });
                }
                if a.backends && b.backends {
                    return Err(DefError::TwoBackendPools(a.name.clone(), b.name.clone()));
                }
            }
        }
        Ok(PoolSet { pools })
    }

    pub fn pool(&self, name: &str) -> Option<&PoolDef> {
        self.pools.iter().find(|p| p.name == name)
    }

    /// The pool device back-end threads go to, if one says `backends=on`.
    pub fn backend_pool(&self) -> Option<&PoolDef> {
        self.pools.iter().find(|p| p.backends)
    }
}

/// What `pools.json` holds: the pools and how they were realised on this host.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostPools {
    pub pools: Vec<PoolDef>,
    /// `cpuset-v1`, `cpuset-v2` or `affinity`.
    pub backend: crate::place::Backend,
    /// Absolute path of the cgroup directory holding one sub-directory per pool (none for
    /// the affinity backend).
    pub cgroup: Option<PathBuf>,
    /// Unix time the pools were created.
    pub created: u64,
}

impl HostPools {
    /// Whether a pool's cgroup directory is missing (never for the affinity backend).
    pub fn cgroups_missing(&self) -> bool {
        self.cgroup
            .as_ref()
            .is_some_and(|root| self.pools.iter().any(|p| !root.join(&p.name).is_dir()))
    }

    /// What `create` guarantees of a definition, checked again on a file read back: pool
    /// names and the cgroup root become paths (never `..` or `/`), every pool has CPUs, no
    /// CPU or name is in two pools. CPUs are not checked against those online (a CPU taken
    /// offline since must not make the pools impossible to destroy).
    fn check(&self) -> Result<(), String> {
        let cpus: Vec<u32> = self.pools.iter().flat_map(|p| p.cpus.clone()).collect();
        PoolSet::new(self.pools.clone(), &cpus).map_err(|e| e.to_string())?;
        let cgroup_ok = match (&self.cgroup, self.backend) {
            (None, crate::place::Backend::Affinity) => true,
            (Some(root), b) if b != crate::place::Backend::Affinity => {
                root.is_absolute()
                    && root.parent().is_some_and(|p| p != Path::new("/"))
                    && root
                        .components()
                        .all(|c| matches!(c, Component::RootDir | Component::Normal(_)))
            }
            _ => false,
        };
        match cgroup_ok {
            true => Ok(()),
            false => Err(format!(
                "cgroup {:?} does not fit backend {}: expected a directory under a cpuset \
                 mount (none for affinity)",
                self.cgroup, self.backend
            )),
        }
    }

    pub fn set(&self) -> PoolSet {
        PoolSet {
            pools: self.pools.clone(),
        }
    }
}

/// One thread of a VM as published in `vms/<pid>.json`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct VmThread {
    pub tid: i32,
    pub name: String,
    /// `vcpu0`, `backend`, `other`.
    pub role: String,
    /// The pool the thread was placed in (none = left where it was).
    pub pool: Option<String>,
    /// For no-op admission: `admitted` or `waiting`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub admission: Option<String>,
}

/// `vms/<pid>.json`: what a running VM publishes every monitor window. Every field but `pid`
/// may be missing; fields this struct does not know are kept in `extra` (and shown).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct VmRecord {
    pub pid: i32,
    /// The pid's start time (clock ticks after boot, `/proc/<pid>/stat` field 22): tells a live
    /// VM from a reused pid. 0 = not recorded (the pid alone decides).
    #[serde(default)]
    pub start_time: u64,
    #[serde(default)]
    pub name: String,
    /// The pool of the VM's vCPUs.
    #[serde(default)]
    pub pool: Option<String>,
    #[serde(default)]
    pub threads: Vec<VmThread>,
    /// The latest monitor figures (free-form, written by the monitor).
    #[serde(default)]
    pub monitor: serde_json::Value,
    /// Anything else the VM published (e.g. the classifier's label).
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

impl VmRecord {
    /// A record for this process.
    pub fn for_self(name: &str) -> VmRecord {
        // SAFETY: getpid has no preconditions.
        let pid = unsafe { libc::getpid() };
        VmRecord {
            pid,
            start_time: pid_start_time(pid).unwrap_or(0),
            name: name.to_string(),
            pool: None,
            threads: Vec::new(),
            monitor: serde_json::Value::Null,
            extra: serde_json::Map::new(),
        }
    }

    /// Whether the process that wrote this record still runs.
    pub fn is_live(&self) -> bool {
        pid_start_time(self.pid).is_some_and(|t| self.start_time == 0 || t == self.start_time)
    }
}

/// A pid's start time (field 22 of `/proc/<pid>/stat`), or None when it does not exist.
pub fn pid_start_time(pid: i32) -> Option<u64> {
    let s = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may hold spaces and parentheses: fields follow the last ')'.
    let rest = &s[s.rfind(')')? + 1..];
    rest.split_whitespace().nth(19)?.parse().ok()
}

/// The host-wide state directory and cgroup root name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StateDir {
    pub dir: PathBuf,
    pub cgroup_name: String,
}

/// An exclusive `flock` on the state directory, released on drop.
pub struct DirLock {
    _file: fs::File,
}

impl StateDir {
    /// From `LUCID_POOLS_DIR` / `LUCID_POOLS_CGROUP`, else the defaults.
    pub fn from_env() -> StateDir {
        let dir = std::env::var_os(ENV_DIR)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(DEFAULT_DIR));
        let cgroup_name = std::env::var(ENV_CGROUP)
            .ok()
            .filter(|v| !v.is_empty())
            .unwrap_or_else(|| DEFAULT_CGROUP.to_string());
        StateDir { dir, cgroup_name }
    }

    pub fn new(dir: impl Into<PathBuf>, cgroup_name: &str) -> StateDir {
        StateDir {
            dir: dir.into(),
            cgroup_name: cgroup_name.to_string(),
        }
    }

    pub fn pools_json(&self) -> PathBuf {
        self.dir.join("pools.json")
    }
    pub fn vms_dir(&self) -> PathBuf {
        self.dir.join("vms")
    }
    pub fn slots_dir(&self) -> PathBuf {
        self.dir.join("slots")
    }
    pub fn vm_file(&self, pid: i32) -> PathBuf {
        self.vms_dir().join(format!("{pid}.json"))
    }

    /// The pools defined on this host, or None when none are.
    pub fn load(&self) -> Result<Option<HostPools>, DefError> {
        let p = self.pools_json();
        let corrupt = |why: String| DefError::Corrupt {
            path: p.clone(),
            why,
        };
        let host: HostPools = match fs::read_to_string(&p) {
            Ok(s) => serde_json::from_str(&s).map_err(|e| corrupt(e.to_string()))?,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(DefError::io("read", &p, e)),
        };
        host.check().map_err(corrupt)?;
        Ok(Some(host))
    }

    /// Takes the directory's exclusive lock (waits for another create/destroy to finish).
    pub fn lock(&self) -> Result<DirLock, DefError> {
        let f = fs::File::open(&self.dir).map_err(|e| DefError::io("open", &self.dir, e))?;
        // SAFETY: flock on an fd we own.
        if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) } != 0 {
            return Err(DefError::io("lock", &self.dir, io::Error::last_os_error()));
        }
        Ok(DirLock { _file: f })
    }

    /// Every VM file: live ones returned; stale ones (emptied at exit, the pid is gone or
    /// runs another program since: its start time differs; names that are no pid) removed when `clean`
    /// (else skipped). A live VM's file that does not parse (caught mid-rewrite) is skipped,
    /// never removed.
    pub fn vms(&self, clean: bool) -> Vec<VmRecord> {
        let mut out = Vec::new();
        let Ok(rd) = fs::read_dir(self.vms_dir()) else {
            return out;
        };
        for e in rd.flatten() {
            let path = e.path();
            let name = e.file_name();
            let name = name.to_string_lossy();
            // Temporaries of a writer mid-rename are `.<pid>.json.tmp`: leave them.
            if name.starts_with('.') {
                continue;
            }
            let pid = name
                .strip_suffix(".json")
                .and_then(|p| p.parse::<i32>().ok())
                .filter(|&p| p > 0);
            // An empty file is one its publisher emptied at exit (a rewrite never is).
            let empty = e.metadata().is_ok_and(|m| m.len() == 0);
            let stale = match pid.and_then(pid_start_time) {
                _ if empty => true,
                None => true,
                Some(started) => {
                    let parse = || {
                        fs::read_to_string(&path)
                            .ok()
                            .and_then(|s| serde_json::from_str::<VmRecord>(&s).ok())
                    };
                    let rec = parse().or_else(|| {
                        std::thread::sleep(std::time::Duration::from_millis(2));
                        parse()
                    });
                    match rec {
                        Some(r)
                            if r.pid == pid.unwrap_or(0)
                                && (r.start_time == 0 || r.start_time == started) =>
                        {
                            out.push(r);
                            false
                        }
                        Some(_) => true,
                        None => false,
                    }
                }
            };
            if stale && clean {
                log::debug!("removing stale VM file {}", path.display());
                let _ = fs::remove_file(&path);
            }
        }
        out.sort_by_key(|r| r.pid);
        out
    }

    /// Writes `rec` atomically to `vms/<pid>.json` (temp file + rename).
    pub fn write_vm(&self, rec: &VmRecord) -> Result<(), DefError> {
        let dir = self.vms_dir();
        fs::create_dir_all(&dir).map_err(|e| DefError::io("create", &dir, e))?;
        let tmp = dir.join(format!(".{}.json.tmp", rec.pid));
        let text = serde_json::to_string_pretty(rec).expect("JSON of plain values");
        fs::write(&tmp, text).map_err(|e| DefError::io("write", &tmp, e))?;
        let path = self.vm_file(rec.pid);
        fs::rename(&tmp, &path).map_err(|e| {
            let _ = fs::remove_file(&tmp);
            DefError::io("rename", &path, e)
        })
    }

    /// Removes this pid's VM file (no error if there is none).
    pub fn remove_vm(&self, pid: i32) {
        let _ = fs::remove_file(self.vm_file(pid));
    }
}

/// Publishes this process's `vms/<pid>.json`. The file is opened once, in [`VmPublisher::new`];
/// [`VmPublisher::publish`] rewrites it in place (pwrite64 + ftruncate) and drop empties it
/// (ftruncate), so a thread confined by seccomp without open/rename/unlink can publish. An
/// emptied or stale file is removed by the next reader ([`StateDir::vms`] with `clean`:
/// `lucid pools show`, create, destroy); [`VmPublisher::remove`] removes it at once where
/// unlink is allowed.
#[derive(Debug)]
pub struct VmPublisher {
    file: fs::File,
    path: PathBuf,
}

impl VmPublisher {
    pub fn new(state: &StateDir) -> Result<VmPublisher, DefError> {
        // SAFETY: getpid has no preconditions.
        let pid = unsafe { libc::getpid() };
        let dir = state.vms_dir();
        fs::create_dir_all(&dir).map_err(|e| DefError::io("create", &dir, e))?;
        let path = state.vm_file(pid);
        let file = fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .map_err(|e| DefError::io("create", &path, e))?;
        Ok(VmPublisher { file, path })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Rewrites the file with `rec`.
    pub fn publish(&self, rec: &VmRecord) -> Result<(), DefError> {
        use std::os::unix::fs::FileExt;
        let text = serde_json::to_string(rec).expect("JSON of plain values") + "\n";
        self.file
            .write_all_at(text.as_bytes(), 0)
            .and_then(|_| self.file.set_len(text.len() as u64))
            .map_err(|e| DefError::io("write", &self.path, e))
    }

    /// Removes the file now (needs unlink: not from a seccomp-confined thread).
    pub fn remove(self) {
        let _ = fs::remove_file(&self.path);
    }
}

impl Drop for VmPublisher {
    fn drop(&mut self) {
        let _ = self.file.set_len(0);
    }
}

/// What [`create`] did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Created {
    /// The pools were made now.
    New(HostPools),
    /// The same pools already existed: nothing changed.
    Existing(HostPools),
    /// The same pools were defined but their cgroups were gone: made again.
    Repaired(HostPools),
}

impl Created {
    pub fn host(&self) -> &HostPools {
        match self {
            Created::New(h) | Created::Existing(h) | Created::Repaired(h) => h,
        }
    }
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Creates the directory and the ancestors that are missing; returns those it made, deepest
/// last, so a failure can remove exactly them.
fn create_dirs(dir: &Path) -> Result<Vec<PathBuf>, DefError> {
    let mut missing = Vec::new();
    let mut p = dir.to_path_buf();
    while !p.exists() {
        missing.push(p.clone());
        if !p.pop() {
            break;
        }
    }
    missing.reverse();
    let mut made = Vec::new();
    for d in missing {
        if let Err(e) = fs::create_dir(&d) {
            if e.kind() == io::ErrorKind::AlreadyExists {
                continue;
            }
            for m in made.iter().rev() {
                let _ = fs::remove_dir(m);
            }
            return Err(DefError::io("create", &d, e));
        }
        made.push(d);
    }
    Ok(made)
}

/// Writes `pools.json` atomically (temp file + rename).
fn write_pools_json(state: &StateDir, host: &HostPools) -> Result<(), DefError> {
    let tmp = state.dir.join(".pools.json.tmp");
    let text = serde_json::to_string_pretty(host).expect("JSON of plain values");
    fs::write(&tmp, text + "\n").map_err(|e| DefError::io("write", &tmp, e))?;
    fs::rename(&tmp, state.pools_json()).map_err(|e| {
        let _ = fs::remove_file(&tmp);
        DefError::io("write", &state.pools_json(), e)
    })
}

/// Creates the host's pools: validates `set` against the online CPUs, makes the state
/// directory and the cgroups (backend `forced`, else detected), then writes `pools.json`.
/// Idempotent: the same set again is [`Created::Existing`]; a different one is refused.
/// On any error everything made so far is removed.
pub fn create(
    state: &StateDir,
    set: &PoolSet,
    forced: Option<crate::place::Backend>,
) -> Result<Created, DefError> {
    let set = PoolSet::new(set.pools.clone(), &online_cpus()?)?;
    if !valid_name(&state.cgroup_name) {
        return Err(DefError::BadName(state.cgroup_name.clone()));
    }
    let same = |h: &HostPools| h.pools == set.pools;
    match state.load()? {
        Some(h) if same(&h) && !h.cgroups_missing() => return Ok(Created::Existing(h)),
        Some(h) if !same(&h) => {
            return Err(DefError::Exists {
                dir: state.dir.clone(),
            })
        }
        _ => {}
    }
    let (backend, cgroup) = crate::place::detect(&state.cgroup_name, forced)?;
    let made_dirs = create_dirs(&state.dir)?;
    let undo_dirs = || {
        for d in made_dirs.iter().rev() {
            let _ = fs::remove_dir(d);
        }
    };
    let lock = match state.lock() {
        Ok(l) => l,
        Err(e) => {
            undo_dirs();
            return Err(e);
        }
    };
    // Another `create` may have won the race while we waited for the lock.
    match state.load() {
        Ok(Some(h)) if same(&h) && h.cgroups_missing() => {
            // The cgroups went away under pools.json (a reboot with a persistent state dir,
            // someone's rmdir): make them again.
            let root = h.cgroup.as_ref().expect("cgroups_missing implies a root");
            crate::place::remove_leftover_root(h.backend, root)?;
            crate::place::create_cgroups(h.backend, root, &h.pools)?;
            return Ok(Created::Repaired(h));
        }
        Ok(Some(h)) if same(&h) => return Ok(Created::Existing(h)),
        Ok(Some(_)) => {
            return Err(DefError::Exists {
                dir: state.dir.clone(),
            })
        }
        Ok(None) => {}
        Err(e) => return Err(e),
    }
    let host = HostPools {
        pools: set.pools.clone(),
        backend,
        cgroup: cgroup.clone(),
        created: unix_now(),
    };
    let result = (|| {
        if let Some(root) = &cgroup {
            crate::place::remove_leftover_root(backend, root)?;
            crate::place::create_cgroups(backend, root, &set.pools)?;
        }
        if let Err(e) = write_pools_json(state, &host) {
            if let Some(root) = &cgroup {
                let _ = crate::place::remove_cgroups(backend, root, &set.pools);
            }
            return Err(e);
        }
        Ok(())
    })();
    drop(lock);
    match result {
        Ok(()) => Ok(Created::New(host)),
        Err(e) => {
            undo_dirs();
            Err(e)
        }
    }
}

/// What [`destroy`] did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Destroyed {
    /// No pools were defined: nothing changed (stale files cleaned).
    Nothing,
    /// Removed; `evicted_vms` live VMs were moved out (`--force`).
    Removed { evicted_vms: usize },
}

/// Tears the pools down: refuses while live VMs (or threads in the pool cgroups, or no-op
/// slot holders) remain unless `force`, which moves their threads back to the default policy
/// on every CPU. Removes the cgroups, `pools.json`, the slot files, stale VM files and the
/// directory itself when nothing live is left in it. Idempotent.
pub fn destroy(state: &StateDir, force: bool) -> Result<Destroyed, DefError> {
    if !state.dir.exists() {
        return Ok(Destroyed::Nothing);
    }
    let lock = state.lock()?;
    let live = state.vms(true);
    let host = match state.load() {
        // Nothing in it can be trusted to name cgroups: remove only the state files.
        Err(DefError::Corrupt { path, why }) if force => {
            log::warn!("removing corrupt {} ({why})", path.display());
            fs::remove_file(&path).map_err(|e| DefError::io("remove", &path, e))?;
            let _ = fs::remove_dir_all(state.slots_dir());
            remove_if_empty(state);
            drop(lock);
            return Ok(Destroyed::Removed {
                evicted_vms: live.len(),
            });
        }
        r => r?,
    };
    let Some(host) = host else {
        remove_if_empty(state);
        drop(lock);
        return Ok(Destroyed::Nothing);
    };
    let tasks: usize = match &host.cgroup {
        Some(root) => std::iter::once(root.clone())
            .chain(host.pools.iter().map(|p| root.join(&p.name)))
            .map(|d| crate::place::cgroup_tids(&d, host.backend).len())
            .sum(),
        None => 0,
    };
    let slots = crate::policy::any_admission_live(state, &host.pools);
    if !force && (!live.is_empty() || tasks > 0 || slots) {
        let mut pids: Vec<String> = live.iter().map(|v| v.pid.to_string()).collect();
        if tasks > 0 {
            pids.push(format!("{tasks} thread(s) in the pool cgroups"));
        }
        if slots {
            pids.push("no-op slots held".into());
        }
        return Err(DefError::InUse {
            live: live.len(),
            pids: pids.join(", "),
        });
    }
    // pools.json goes first: if the directory is read-only nothing has changed yet, and if
    // the cgroups then cannot be removed it is written back.
    let pj = state.pools_json();
    fs::remove_file(&pj).map_err(|e| DefError::io("remove", &pj, e))?;
    if let Some(root) = &host.cgroup {
        if let Err(e) = crate::place::remove_cgroups(host.backend, root, &host.pools) {
            let _ = write_pools_json(state, &host);
            return Err(e.into());
        }
    }
    if force {
        // The affinity backend has no cgroup to evict from: reset the threads VMs listed.
        let all = online_cpus().unwrap_or_default();
        // Only threads of the VM process itself: a corrupt or forged record (tid 0 is the
        // caller, another tid any process) must not reset threads that are not the VM's.
        let threads = live.iter().flat_map(|v| {
            v.threads
                .iter()
                .filter(move |t| t.tid > 0 && is_thread_of(v.pid, t.tid))
        });
        for t in threads {
            let _ = crate::policy::reset(t.tid);
            let _ = crate::place::set_affinity(t.tid, &all);
        }
    }
    let slots_dir = state.slots_dir();
    if slots_dir.exists() {
        // The pools are gone already: a slot file left behind is only clutter.
        if let Err(e) = fs::remove_dir_all(&slots_dir) {
            log::warn!("cannot remove {}: {e}", slots_dir.display());
        }
    }
    remove_if_empty(state);
    drop(lock);
    Ok(Destroyed::Removed {
        evicted_vms: live.len(),
    })
}

/// Whether `tid` is a thread of process `pid` (`/proc/<pid>/task/<tid>`).
pub fn is_thread_of(pid: i32, tid: i32) -> bool {
    pid > 0 && tid > 0 && Path::new(&format!("/proc/{pid}/task/{tid}")).exists()
}

/// Removes empty `vms/`, `slots/` and the state directory itself (each only if empty).
fn remove_if_empty(state: &StateDir) {
    let _ = fs::remove_dir(state.vms_dir());
    let _ = fs::remove_dir(state.slots_dir());
    let _ = fs::remove_file(state.dir.join(".pools.json.tmp"));
    let _ = fs::remove_dir(&state.dir);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists() {
        assert_eq!(parse_cpu_list("0-3,6").unwrap(), vec![0, 1, 2, 3, 6]);
        assert_eq!(parse_cpu_list("1").unwrap(), vec![1]);
        assert_eq!(parse_cpu_list("").unwrap(), Vec::<u32>::new());
        assert!(parse_cpu_list("3-1").is_err());
        assert!(parse_cpu_list("x").is_err());
        assert_eq!(format_cpu_list(&[6, 0, 1, 2, 3]), "0-3,6");
        assert_eq!(format_cpu_list(&[]), "");
    }

    #[test]
    fn parse_defs() {
        let p = PoolDef::parse("name=io,cpus=1,policy=io").unwrap();
        assert_eq!(p.cpus, vec![1]);
        assert_eq!(p.policy, Policy::Io);
        assert!(!p.backends);
        let p = PoolDef::parse("name=be,cpus=0,2-3,policy=noop").unwrap();
        assert_eq!(p.cpus, vec![0, 2, 3]);
        assert!(p.backends, "noop pools take back-ends by default");
        assert_eq!(PoolDef::parse(&p.to_def_string()).unwrap(), p);
        assert!(matches!(
            PoolDef::parse("name=a,cpus=1,policy=rt"),
            Err(DefError::BadPolicy(_))
        ));
        assert!(matches!(
            PoolDef::parse("name=a,cpus=1"),
            Err(DefError::Syntax { .. })
        ));
        assert!(matches!(
            PoolDef::parse("name=a,cpus=1,policy=io,color=red"),
            Err(DefError::Syntax { .. })
        ));
        let p = PoolDef::parse("name=a,cpus=1,policy=io,slice_us=3000").unwrap();
        assert_eq!(p.slice_ns(), Some(3_000_000));
        assert_eq!(PoolDef::parse(&p.to_def_string()).unwrap(), p);
        let dflt = PoolDef::parse("name=a,cpus=1,policy=io")
            .unwrap()
            .slice_ns();
        assert!(dflt.is_some_and(|s| (100_000..=3_000_000).contains(&s)));
        assert_eq!(
            PoolDef::parse("name=a,cpus=1,policy=cpu")
                .unwrap()
                .slice_ns(),
            None
        );
        assert!(matches!(
            PoolDef::parse("name=a,name=b,cpus=1,policy=io"),
            Err(DefError::Syntax { .. })
        ));
    }

    #[test]
    fn validation() {
        let online = [0, 1];
        let d = |s: &str| PoolDef::parse(s).unwrap();
        assert!(PoolSet::new(
            vec![d("name=a,cpus=0,policy=io"), d("name=b,cpus=1,policy=cpu")],
            &online
        )
        .is_ok());
        let e = PoolSet::new(
            vec![
                d("name=a,cpus=0-1,policy=io"),
                d("name=b,cpus=1,policy=cpu"),
            ],
            &online,
        );
        assert!(matches!(e, Err(DefError::Overlap { cpu: 1, .. })), "{e:?}");
        let e = PoolSet::new(vec![d("name=a,cpus=7,policy=io")], &online);
        assert!(
            matches!(e, Err(DefError::OfflineCpu { cpu: 7, .. })),
            "{e:?}"
        );
        let e = PoolSet::new(vec![d("name=a,cpus=,policy=io")], &online);
        assert!(matches!(e, Err(DefError::Empty(_))), "{e:?}");
        let e = PoolSet::new(
            vec![d("name=a,cpus=0,policy=io"), d("name=a,cpus=1,policy=io")],
            &online,
        );
        assert!(matches!(e, Err(DefError::Duplicate(_))), "{e:?}");
        let e = PoolSet::new(vec![d("name=../x,cpus=0,policy=io")], &online);
        assert!(matches!(e, Err(DefError::BadName(_))), "{e:?}");
        assert!(matches!(
            PoolSet::new(vec![], &online),
            Err(DefError::NoPools)
        ));
        for bad in [
            "name=a,cpus=0,policy=io,slice_us=5",
            "name=a,cpus=0,policy=noop,slice_us=1000",
        ] {
            let e = PoolSet::new(vec![d(bad)], &online);
            assert!(matches!(e, Err(DefError::BadSlice { .. })), "{e:?}");
        }
        let e = PoolSet::new(
            vec![
                d("name=a,cpus=0,policy=noop"),
                d("name=b,cpus=1,policy=noop"),
            ],
            &online,
        );
        assert!(matches!(e, Err(DefError::TwoBackendPools(..))), "{e:?}");
    }

    #[test]
    fn json_round_trip() {
        let v = serde_json::json!({"pools":[{"name":"io","cpus":[0],"policy":"io"},
                                            {"name":"be","cpus":[1],"policy":"noop"}]});
        let s = PoolSet::from_json(&v.to_string()).unwrap();
        assert_eq!(s.pools[0].policy, Policy::Io);
        assert!(!s.pools[0].backends);
        assert!(s.pools[1].backends, "noop pools hold back-ends");
        assert!(
            PoolSet::from_json(r#"{"pools":[{"name":"io","cpus":[0],"policy":"rt"}]}"#).is_err()
        );
        assert!(PoolSet::from_json("nope").is_err());
    }

    #[test]
    fn halt_poll_is_data() {
        assert_eq!(Policy::Io.halt_poll_ns(), Some(IO_HALT_POLL_NS));
        assert_eq!(Policy::Cpu.halt_poll_ns(), Some(0));
        assert_eq!(Policy::Default.halt_poll_ns(), None);
    }

    #[test]
    fn vm_records_tolerate_missing_and_extra_fields() {
        let r: VmRecord = serde_json::from_str(
            r#"{"pid": 7, "label": "io-bound", "threads": [{"tid": 8, "name": "lucid-vcpu0",
                "role": "vcpu", "pool": "io"}]}"#,
        )
        .unwrap();
        assert_eq!((r.pid, r.start_time, r.threads[0].tid), (7, 0, 8));
        assert_eq!(r.extra["label"], "io-bound");
        let back = serde_json::to_value(&r).unwrap();
        assert_eq!(back["label"], "io-bound");
    }

    #[test]
    fn start_time_of_self() {
        let r = VmRecord::for_self("t");
        assert!(r.start_time > 0);
        assert!(r.is_live());
        let dead = VmRecord {
            start_time: r.start_time + 1,
            ..r
        };
        assert!(!dead.is_live());
    }
}
