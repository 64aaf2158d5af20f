//! The per-VM memory limit: a memory cgroup holding the whole VMM process, with host swap behind
//! it. The guest still believes it has all of `--memory`; what does not fit under the limit is
//! reclaimed by the host (swapped, or dropped when the Swap Mapper made it a clean file page).
//!
//! cgroup v1 (this host): `<current memory cgroup>/lucid/<name>-<pid>` with
//! `memory.limit_in_bytes`; `memory.memsw.limit_in_bytes` is left unlimited so host swap is the
//! backstop. cgroup v2: `memory.max` (and `memory.swap.max` left at `max`) in
//! `<current cgroup>/lucid/<name>-<pid>` when the current cgroup can delegate the memory
//! controller, else under the v2 root. The new cgroup nests under the one the process is in, so
//! limits above it (a session's, a slice's) keep applying and the process returns there on drop.
//!
//! Once the VM's threads are confined (seccomp) none may open a file by path, unlink or rmdir:
//! every file a [`MemoryLimit`] reads or writes later (usage, memory.stat, the parent's
//! cgroup.procs, v1's oom_control) is opened in [`MemoryLimit::apply`] and read with `pread`;
//! a drop on a confined thread leaves the empty directory, which the next `apply` prunes (the
//! `lucid/*-<pid>` cgroups of dead processes).
//!
//! [`SwapFile`] makes a small swap file for tests (fallocate + mkswap + swapon; swapoff and
//! removal on drop).

use std::collections::BTreeMap;
use std::ffi::CString;
use std::fs::{self, File};
use std::io::{self, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::FileExt;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};

/// Commands that add a swap file (printed in [`LimitError::NoSwap`]).
pub const ADD_SWAP_HELP: &str = "add a swap file as root: `fallocate -l 4G /swapfile && \
chmod 600 /swapfile && mkswap /swapfile && swapon /swapfile` (on ext4 or xfs; mkswap is in \
util-linux)";

/// What failed while setting up a memory limit or a swap file, and how to fix it.
#[derive(Debug, thiserror::Error)]
pub enum LimitError {
    #[error(
        "this host has no memory cgroup controller ({detail}): mount cgroup v1's \
         (`mkdir -p /sys/fs/cgroup/memory && mount -t cgroup -o memory cgroup \
         /sys/fs/cgroup/memory`) or enable it on cgroup v2 (`echo +memory > \
         /sys/fs/cgroup/cgroup.subtree_control`)"
    )]
    NoMemoryController { detail: String },
    #[error(
        "the host has no swap (/proc/swaps lists none), so memory above the limit cannot go \
         anywhere and the VM would be OOM-killed: {ADD_SWAP_HELP}"
    )]
    NoSwap,
    #[error(
        "no permission to {what} {path}: a memory limit needs root (or a delegated cgroup \
         writable by this user)"
    )]
    Permission {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot {what} {path}")]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("memory limit of {0} bytes is too small: give at least 4 MiB")]
    TooSmall(u64),
    #[error("cgroup name {0:?} must be non-empty and use only letters, digits, '-', '_' or '.'")]
    BadName(String),
    #[error("mkswap not found in PATH, /sbin or /usr/sbin: install util-linux")]
    NoMkswap,
    #[error("`{cmd}` failed ({status}): {stderr}")]
    Command {
        cmd: String,
        status: String,
        stderr: String,
    },
    #[error(
        "swapon {path} failed: swap files need a filesystem that supports them (ext4, xfs; not \
         tmpfs or overlayfs) and root"
    )]
    Swapon {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

fn io_err<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> LimitError + 'a {
    move |source| {
        if matches!(
            source.kind(),
            io::ErrorKind::PermissionDenied | io::ErrorKind::ReadOnlyFilesystem
        ) || source.raw_os_error() == Some(libc::EPERM)
        {
            LimitError::Permission {
                what,
                path: path.to_path_buf(),
                source,
            }
        } else {
            LimitError::Io {
                what,
                path: path.to_path_buf(),
                source,
            }
        }
    }
}

/// Which cgroup hierarchy holds the memory controller.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CgroupVersion {
    V1,
    V2,
}

/// Where this process's memory controller lives: its mount point and the process's cgroup in it.
#[derive(Clone, Debug)]
pub struct MemoryController {
    pub version: CgroupVersion,
    /// Mount point of the hierarchy (v1: the memory controller's; v2: the unified one).
    pub mount: PathBuf,
    /// This process's cgroup relative to `mount` ("/" for the root).
    pub current: String,
}

impl MemoryController {
    /// Finds the memory controller from /proc/self/mountinfo and /proc/self/cgroup (v1 preferred
    /// where both exist, since a controller can be bound to only one).
    pub fn detect() -> Result<MemoryController, LimitError> {
        let mounts =
            lucid_stats::cgroup::controller_mounts("memory").map_err(|source| LimitError::Io {
                what: "read",
                path: lucid_stats::cgroup::MOUNTINFO.into(),
                source,
            })?;
        let cgroups = fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
        if let Some(mount) = mounts.v1 {
            let current = cgroups
                .lines()
                .filter_map(|l| l.split_once(':'))
                .filter_map(|(_, rest)| rest.split_once(':'))
                .find(|(ctrls, _)| ctrls.split(',').any(|c| c == "memory"))
                .map(|(_, p)| p.to_string())
                .unwrap_or_else(|| "/".into());
            return Ok(MemoryController {
                version: CgroupVersion::V1,
                mount,
                current,
            });
        }
        let Some(mount) = mounts.v2 else {
            return Err(LimitError::NoMemoryController {
                detail: "neither a cgroup v1 memory hierarchy nor cgroup2 is mounted".into(),
            });
        };
        if !mounts.v2_offers {
            return Err(LimitError::NoMemoryController {
                detail: format!(
                    "cgroup2 at {} does not offer the memory controller",
                    mount.display()
                ),
            });
        }
        let current = cgroups
            .lines()
            .find_map(|l| l.strip_prefix("0::"))
            .unwrap_or("/")
            .to_string();
        Ok(MemoryController {
            version: CgroupVersion::V2,
            mount,
            current,
        })
    }

    fn current_dir(&self) -> PathBuf {
        self.mount.join(self.current.trim_start_matches('/'))
    }
}

/// Total host swap in bytes (the sum of /proc/swaps' sizes; 0 when there is none).
pub fn swap_total_bytes() -> u64 {
    fs::read_to_string("/proc/swaps")
        .unwrap_or_default()
        .lines()
        .skip(1)
        .filter_map(|l| l.split_whitespace().nth(2)?.parse::<u64>().ok())
        .sum::<u64>()
        * 1024
}

/// A memory cgroup holding this whole process under a limit; dropping it moves the process back
/// to the cgroup it came from and removes the directory.
#[derive(Debug)]
pub struct MemoryLimit {
    version: CgroupVersion,
    dir: PathBuf,
    parent: PathBuf,
    limit: u64,
    /// Opened in `apply`: read or written later without `open` (see the module doc).
    files: Option<LimitFiles>,
}

#[derive(Debug)]
struct LimitFiles {
    /// The parent's cgroup.procs, for going back on drop.
    parent_procs: File,
    /// memory.usage_in_bytes (v1) or memory.current (v2).
    usage: File,
    stat: File,
    /// v1's memory.oom_control (read-write).
    oom_control: Option<File>,
}

impl MemoryLimit {
    /// Creates the cgroup `<name>-<pid>` with a limit of `limit_bytes` and moves this process
    /// into it. Memory charged before the move stays where it was, so call this before guest RAM
    /// is touched. Refuses when the host has no swap (the limit would OOM-kill the VM).
    pub fn apply(name: &str, limit_bytes: u64) -> Result<MemoryLimit, LimitError> {
        if swap_total_bytes() == 0 {
            return Err(LimitError::NoSwap);
        }
        Self::apply_allow_no_swap(name, limit_bytes)
    }

    /// [`MemoryLimit::apply`] without the swap check (memory above the limit is then only
    /// reclaimable if it is clean file memory).
    pub fn apply_allow_no_swap(name: &str, limit_bytes: u64) -> Result<MemoryLimit, LimitError> {
        if name.is_empty()
            || !name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
            || name.starts_with('.')
        {
            return Err(LimitError::BadName(name.into()));
        }
        if limit_bytes < 4 << 20 {
            return Err(LimitError::TooSmall(limit_bytes));
        }
        let ctl = MemoryController::detect()?;
        let parent = ctl.current_dir();
        let base = parent.join("lucid");
        let dir = base.join(format!("{name}-{}", std::process::id()));
        if ctl.version == CgroupVersion::V2 {
            // v2 needs the memory controller enabled in every ancestor's subtree_control; the
            // current cgroup may hold processes (no-internal-process rule), so a non-root
            // current cgroup cannot delegate and we say so.
            enable_v2_memory(&parent)?;
        }
        prune_dead(&base);
        // Another VM's drop may remove `base` between our two mkdirs: retry once.
        for attempt in 0..2 {
            mkdir_if_missing(&base)?;
            if ctl.version == CgroupVersion::V2 {
                enable_v2_memory(&base)?;
            }
            match mkdir_if_missing(&dir) {
                Err(LimitError::Io { source, .. })
                    if attempt == 0 && source.kind() == io::ErrorKind::NotFound => {}
                r => {
                    r?;
                    break;
                }
            }
        }
        let mut limit = MemoryLimit {
            version: ctl.version,
            dir: dir.clone(),
            parent,
            limit: limit_bytes,
            files: None,
        };
        // From here on, dropping `limit` cleans up.
        let file = match ctl.version {
            CgroupVersion::V1 => "memory.limit_in_bytes",
            CgroupVersion::V2 => "memory.max",
        };
        let p = dir.join(file);
        fs::write(&p, limit_bytes.to_string()).map_err(io_err("write the limit to", &p))?;
        let open = |p: PathBuf, write: bool| {
            fs::OpenOptions::new()
                .read(true)
                .write(write)
                .open(&p)
                .map_err(|e| io_err("open", &p)(e))
        };
        let usage_file = match ctl.version {
            CgroupVersion::V1 => "memory.usage_in_bytes",
            CgroupVersion::V2 => "memory.current",
        };
        limit.files = Some(LimitFiles {
            parent_procs: fs::OpenOptions::new()
                .write(true)
                .open(limit.parent.join("cgroup.procs"))
                .map_err(|e| io_err("open", &limit.parent.join("cgroup.procs"))(e))?,
            usage: open(dir.join(usage_file), false)?,
            stat: open(dir.join("memory.stat"), false)?,
            oom_control: match ctl.version {
                CgroupVersion::V1 => open(dir.join("memory.oom_control"), true).ok(),
                CgroupVersion::V2 => None,
            },
        });
        let procs = dir.join("cgroup.procs");
        fs::write(&procs, std::process::id().to_string())
            .map_err(io_err("move this process into", &procs))?;
        log::info!(
            "memory limit {} MiB: process {} in {}",
            limit_bytes >> 20,
            std::process::id(),
            dir.display()
        );
        Ok(limit)
    }

    /// The cgroup's directory.
    pub fn path(&self) -> &Path {
        &self.dir
    }

    /// The cgroup.procs of the cgroup this process came from (outside the limit).
    pub fn home_procs(&self) -> PathBuf {
        self.parent.join("cgroup.procs")
    }

    pub fn version(&self) -> CgroupVersion {
        self.version
    }

    pub fn limit_bytes(&self) -> u64 {
        self.limit
    }

    fn files(&self) -> io::Result<&LimitFiles> {
        self.files
            .as_ref()
            .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, "cgroup not set up"))
    }

    /// Memory charged to the cgroup now (anonymous, page cache, kernel), in bytes. Reads a
    /// descriptor opened by `apply` (no `open`: callable on confined threads).
    pub fn usage(&self) -> io::Result<u64> {
        parse_u64(&pread_to_string(&self.files()?.usage)?)
    }

    /// memory.stat as a map (v1: this cgroup's own keys such as `rss`, `cache`, `swap`,
    /// `mapped_file`, `pgmajfault`; v2: `anon`, `file`, `file_mapped`, `pgmajfault`,
    /// `workingset_refault_anon`, ...). Reads a descriptor opened by `apply`.
    pub fn stat(&self) -> io::Result<BTreeMap<String, u64>> {
        Ok(parse_stat(&pread_to_string(&self.files()?.stat)?))
    }

    /// A new descriptor of the usage file (for a thread that reads usage with `pread`, or for a
    /// v1 usage threshold).
    pub fn usage_file(&self) -> io::Result<File> {
        self.files()?.usage.try_clone()
    }

    /// memory.stat's descriptor, duplicated.
    pub fn stat_file(&self) -> io::Result<File> {
        self.files()?.stat.try_clone()
    }

    /// cgroup v1's memory.oom_control, duplicated (`None` on v2, which has no
    /// `oom_kill_disable`).
    pub fn oom_control_file(&self) -> Option<File> {
        self.files.as_ref()?.oom_control.as_ref()?.try_clone().ok()
    }

    /// v1: an eventfd that the kernel signals each time usage crosses `bytes` (either way),
    /// registered through cgroup.event_control. Call before confinement (it opens a file).
    pub fn usage_threshold(&self, bytes: u64) -> io::Result<OwnedFd> {
        if self.version != CgroupVersion::V1 {
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                "usage thresholds are cgroup v1's (cgroup.event_control)",
            ));
        }
        // SAFETY: eventfd takes no pointers; the fd returned is ours.
        let efd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if efd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `efd` is a fresh descriptor nothing else owns.
        let efd = unsafe { OwnedFd::from_raw_fd(efd) };
        let ufd = self.usage_file()?;
        let mut ctl = fs::OpenOptions::new()
            .write(true)
            .open(self.dir.join("cgroup.event_control"))?;
        // The kernel keeps its own reference to the usage file; ours may close. One write:
        // the kernel parses each write whole (`write!` would split it at the spaces).
        ctl.write_all(format!("{} {} {bytes}", efd.as_raw_fd(), ufd.as_raw_fd()).as_bytes())?;
        Ok(efd)
    }
}

/// The whole of a procfs or cgroup file through an open descriptor, from offset 0.
pub fn pread_to_string(f: &File) -> io::Result<String> {
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let n = f.read_at(&mut buf, out.len() as u64)?;
        if n == 0 {
            break;
        }
        out.extend_from_slice(&buf[..n]);
    }
    Ok(String::from_utf8_lossy(&out).into_owned())
}

/// A number file such as memory.usage_in_bytes through an open descriptor, from offset 0. It
/// allocates nothing: the pager and the vCPUs' fault hook call it at the limit, where a fresh
/// page of their own would wait for memory like the guest's.
pub fn pread_u64(f: &File) -> Option<u64> {
    let mut buf = [0u8; 32];
    let n = f.read_at(&mut buf, 0).ok()?;
    std::str::from_utf8(&buf[..n]).ok()?.trim().parse().ok()
}

/// `key value` lines (memory.stat, /proc/vmstat) as a map.
pub fn parse_stat(s: &str) -> BTreeMap<String, u64> {
    s.lines()
        .filter_map(|l| {
            let (k, v) = l.split_once(' ')?;
            Some((k.to_string(), v.trim().parse().ok()?))
        })
        .collect()
}

/// Removes `base/<name>-<pid>` cgroups whose process is gone: what a confined exit leaves
/// (rmdir is forbidden there). A cgroup still holding tasks refuses rmdir (EBUSY): kept.
fn prune_dead(base: &Path) {
    let Ok(entries) = fs::read_dir(base) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(pid) = name
            .rsplit_once('-')
            .and_then(|(_, p)| p.parse::<u32>().ok())
        else {
            continue;
        };
        if pid != std::process::id() && !Path::new(&format!("/proc/{pid}")).exists() {
            match fs::remove_dir(e.path()) {
                Ok(()) => log::debug!("removed {} (process {pid} is gone)", e.path().display()),
                Err(err) => log::debug!("cannot prune {}: {err}", e.path().display()),
            }
        }
    }
}

fn parse_u64(s: &str) -> io::Result<u64> {
    s.trim()
        .parse()
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, format!("{s:?}: {e}")))
}

fn mkdir_if_missing(p: &Path) -> Result<(), LimitError> {
    match fs::create_dir(p) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(io_err("create the cgroup", p)(e)),
    }
}

fn enable_v2_memory(dir: &Path) -> Result<(), LimitError> {
    let ctl = dir.join("cgroup.subtree_control");
    if fs::read_to_string(&ctl)
        .unwrap_or_default()
        .split_whitespace()
        .any(|c| c == "memory")
    {
        return Ok(());
    }
    fs::write(&ctl, "+memory").map_err(|e| {
        if e.raw_os_error() == Some(libc::EBUSY) {
            LimitError::NoMemoryController {
                detail: format!(
                    "{} holds processes, so cgroup v2 cannot enable memory for its children; \
                     start Lucid from a cgroup that can delegate it (e.g. `systemd-run \
                     --scope -p Delegate=yes lucid ...`)",
                    dir.display()
                ),
            }
        } else {
            io_err("enable the memory controller in", &ctl)(e)
        }
    })
}

impl Drop for MemoryLimit {
    fn drop(&mut self) {
        let back = self.parent.join("cgroup.procs");
        let Some(files) = &self.files else {
            // `apply` failed before the move: only the directory to remove.
            let _ = fs::remove_dir(&self.dir);
            return;
        };
        if let Err(e) = (&files.parent_procs).write_all(std::process::id().to_string().as_bytes()) {
            log::warn!("cannot move back to {}: {e}", back.display());
        }
        // A confined thread may not rmdir: the next `apply` prunes the empty directory.
        if lucid_seccomp::Seccomp::of_this_thread().is_some() {
            return;
        }
        // rmdir fails while tasks remain (e.g. threads that raced a move): retry briefly.
        for _ in 0..50 {
            match fs::remove_dir(&self.dir) {
                Ok(()) => break,
                Err(e) if e.kind() == io::ErrorKind::NotFound => break,
                Err(e) if e.raw_os_error() == Some(libc::EBUSY) => {
                    std::thread::sleep(std::time::Duration::from_millis(10))
                }
                Err(e) => {
                    log::warn!("cannot remove {}: {e}", self.dir.display());
                    break;
                }
            }
        }
        if let Some(base) = self.dir.parent() {
            // Other VMs may still use it: EBUSY is fine.
            let _ = fs::remove_dir(base);
        }
    }
}

/// Finds `mkswap` (util-linux) in PATH, /sbin or /usr/sbin.
pub fn find_mkswap() -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/sbin".into(), "/usr/sbin".into()])
        .map(|d| d.join("mkswap"))
        .find(|p| p.is_file())
}

/// A swap file for tests: created with fallocate + mkswap, enabled with swapon; dropping it runs
/// swapoff (pulling any swapped pages back in) and removes the file.
#[derive(Debug)]
pub struct SwapFile {
    path: PathBuf,
    bytes: u64,
}

static SWAP_SEQ: AtomicU32 = AtomicU32::new(0);

impl SwapFile {
    /// Creates and enables a swap file of `bytes` in `dir` (which must be on ext4 or xfs),
    /// named after this process and a sequence number so parallel tests do not collide.
    pub fn create(dir: &Path, bytes: u64) -> Result<SwapFile, LimitError> {
        let mkswap = find_mkswap().ok_or(LimitError::NoMkswap)?;
        let path = dir.join(format!(
            "lucid-swap-{}-{}.swap",
            std::process::id(),
            SWAP_SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        let bytes = bytes.max(1 << 20) & !4095;
        let f = fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&path)
            .map_err(io_err("create the swap file", &path))?;
        // Owns the path from here: dropping it on an error below removes the file.
        let mut swap = SwapFile {
            path: path.clone(),
            bytes,
        };
        f.set_permissions(fs::Permissions::from_mode(0o600))
            .map_err(io_err("chmod the swap file", &path))?;
        // SAFETY: fallocate on an fd we own, no pointers involved.
        let r = unsafe {
            libc::fallocate(
                std::os::fd::AsRawFd::as_raw_fd(&f),
                0,
                0,
                bytes as libc::off_t,
            )
        };
        if r != 0 {
            return Err(io_err("fallocate the swap file", &path)(
                io::Error::last_os_error(),
            ));
        }
        drop(f);
        let out = Command::new(&mkswap)
            .arg(&path)
            .output()
            .map_err(io_err("run mkswap on", &path))?;
        if !out.status.success() {
            return Err(LimitError::Command {
                cmd: format!("{} {}", mkswap.display(), path.display()),
                status: out.status.to_string(),
                stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
            });
        }
        let c = CString::new(path.as_os_str().as_bytes()).map_err(|_| LimitError::Io {
            what: "name",
            path: path.clone(),
            source: io::Error::new(io::ErrorKind::InvalidInput, "NUL in path"),
        })?;
        // SAFETY: swapon with a valid NUL-terminated path.
        if unsafe { libc::swapon(c.as_ptr(), 0) } != 0 {
            return Err(LimitError::Swapon {
                path: path.clone(),
                source: io::Error::last_os_error(),
            });
        }
        swap.bytes = bytes;
        Ok(swap)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    fn is_active(&self) -> bool {
        let me = fs::canonicalize(&self.path).unwrap_or_else(|_| self.path.clone());
        fs::read_to_string("/proc/swaps")
            .unwrap_or_default()
            .lines()
            .skip(1)
            .filter_map(|l| l.split_whitespace().next())
            .any(|p| Path::new(&lucid_stats::cgroup::unescape(p)) == me)
    }
}

impl Drop for SwapFile {
    fn drop(&mut self) {
        if self.is_active() {
            if let Ok(c) = CString::new(self.path.as_os_str().as_bytes()) {
                // SAFETY: swapoff with a valid NUL-terminated path.
                if unsafe { libc::swapoff(c.as_ptr()) } != 0 {
                    log::warn!(
                        "swapoff {} failed: {}",
                        self.path.display(),
                        io::Error::last_os_error()
                    );
                }
            }
        }
        let _ = fs::remove_file(&self.path);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refuses_bad_names_and_tiny_limits() {
        assert!(matches!(
            MemoryLimit::apply_allow_no_swap("../x", 64 << 20),
            Err(LimitError::BadName(_))
        ));
        assert!(matches!(
            MemoryLimit::apply_allow_no_swap("ok", 1 << 20),
            Err(LimitError::TooSmall(_))
        ));
    }

    #[test]
    fn no_swap_error_says_how_to_add_one() {
        let msg = LimitError::NoSwap.to_string();
        assert!(msg.contains("mkswap") && msg.contains("swapon") && msg.contains("fallocate"));
    }

    #[test]
    fn detects_a_controller_here() {
        // This host has one (v1); elsewhere the error must name the fix.
        match MemoryController::detect() {
            Ok(c) => assert!(c.mount.is_dir(), "{c:?}"),
            Err(e) => assert!(e.to_string().contains("mount")),
        }
    }
}
