//! The OOM guard: a small process outside the VM's memory cgroup that frees guest RAM when
//! every Lucid thread that could free it is itself asleep waiting for memory (cgroup v1).
//!
//! Why: under a v1 limit the pager sets `oom_kill_disable`, so a thread whose own user-mode
//! fault is refused a charge sleeps in the kernel (`mem_cgroup_oom_synchronize`) until memory is
//! freed. The limit reclaim swaps Lucid's own heap and stack pages out first (guest pages all
//! look recently used on PVM hosts), so the pager itself can fault on one; if the vCPUs are
//! asleep too, nothing in the process frees memory again and the VM hangs for good (about one
//! run in ten of the over-limit test without this guard). A thread cannot escape: a process's
//! charges go to the cgroup of its address space. So the guard is another process, in the
//! parent cgroup, that pages the VM's guest RAM out with `process_madvise(MADV_PAGEOUT)`,
//! which uncharges it and wakes the sleepers.
//!
//! How: `lucid` re-executes itself as `lucid __oom-guard ARGS` ([`ARGV1`], [`serve`]) for each
//! VM with a v1 limit and a pager. The guard moves itself to the parent cgroup, then sleeps on
//! the cgroup's OOM notification (`cgroup.event_control` on `memory.oom_control`) and on a pidfd
//! of the VM. When the cgroup is still under OOM after a grace period (the pager's own work
//! usually ends it first), it pages a 2 MiB chunk of guest RAM out (clock order), then raises
//! the limit by the headroom for a moment and sets it back, until no thread waits. Raising the
//! limit wakes the sleepers with room to charge; setting it back makes the kernel reclaim in the
//! guard's own context. Both matter: what `MADV_PAGEOUT` wrote to swap stays charged (unmapped
//! swap cache) until some reclaim frees it, and a sleeper's own reclaim may have run while that
//! write-back was still in flight. If nothing is freed for the stall time, it turns the OOM
//! killer back on (a clear kill beats a hang). It exits with the VM (pidfd, and `PR_SET_PDEATHSIG`).
//!
//! It reports events as single bytes on its stdout ([`Event`]), which the VM folds into the
//! counters `swap.guard.{rescues, chunks, oom_kill_enabled}` when the stats are read.

use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lucid_stats::{Counter, StatsRegistry};

/// The hidden first argument that makes `lucid` serve as a guard.
pub const ARGV1: &str = "__oom-guard";

/// What the guard watches and frees.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GuardConfig {
    /// The VM's process (the guard's parent).
    pub pid: u32,
    /// The VM's memory cgroup directory (v1).
    pub memcg: PathBuf,
    /// A cgroup.procs outside the limit that the guard moves itself into.
    pub home_procs: PathBuf,
    /// The cgroup's limit in bytes, and how far the guard raises it for a moment to wake the
    /// sleepers.
    pub limit: u64,
    pub headroom: u64,
    /// Guest RAM in the VM's address space, as (address, length) chunks in clock order.
    pub chunks: Vec<(u64, u64)>,
    /// How long the cgroup must stay under OOM before the guard acts.
    pub grace: Duration,
    /// Time without freeing anything after which the OOM killer is turned back on.
    pub stall: Duration,
}

impl GuardConfig {
    /// The arguments after [`ARGV1`].
    pub fn to_args(&self) -> Vec<String> {
        let mut v = vec![
            self.pid.to_string(),
            self.memcg.display().to_string(),
            self.home_procs.display().to_string(),
            self.limit.to_string(),
            self.headroom.to_string(),
            self.grace.as_millis().to_string(),
            self.stall.as_millis().to_string(),
        ];
        v.extend(self.chunks.iter().map(|(a, l)| format!("{a:x}:{l:x}")));
        v
    }

    /// Parses [`GuardConfig::to_args`]'s output.
    pub fn from_args(args: &[String]) -> Result<GuardConfig, String> {
        let bad = |what: &str, v: &str| format!("oom guard: bad {what} {v:?}");
        let [pid, memcg, home, limit, headroom, grace, stall, chunks @ ..] = args else {
            return Err(
                "oom guard: usage: PID MEMCG HOME_PROCS LIMIT HEADROOM GRACE_MS STALL_MS \
                 ADDR:LEN..."
                    .into(),
            );
        };
        let ms = |what: &str, v: &str| {
            v.parse::<u64>()
                .map(Duration::from_millis)
                .map_err(|_| bad(what, v))
        };
        let chunks = chunks
            .iter()
            .map(|c| {
                let (a, l) = c.split_once(':').ok_or_else(|| bad("chunk", c))?;
                let a = u64::from_str_radix(a, 16).map_err(|_| bad("chunk", c))?;
                let l = u64::from_str_radix(l, 16).map_err(|_| bad("chunk", c))?;
                Ok((a, l))
            })
            .collect::<Result<Vec<_>, String>>()?;
        Ok(GuardConfig {
            pid: pid.parse().map_err(|_| bad("pid", pid))?,
            memcg: memcg.into(),
            home_procs: home.into(),
            limit: limit.parse().map_err(|_| bad("limit", limit))?,
            headroom: headroom.parse().map_err(|_| bad("headroom", headroom))?,
            grace: ms("grace", grace)?,
            stall: ms("stall", stall)?,
            chunks,
        })
    }
}

/// One byte on the guard's stdout per event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Event {
    /// The cgroup stayed under OOM past the grace period: the guard stepped in.
    Rescue = b'r',
    /// One chunk of guest RAM paged out by the guard.
    Chunk = b'c',
    /// Nothing freed for the stall time: the OOM killer is back on.
    OomKillEnabled = b'k',
}

/// The running guard process; dropping it closes the guard's stdin, which ends it (and, on an
/// unconfined thread, reaps it: a confined one may not wait).
pub struct OomGuard {
    child: Child,
}

impl OomGuard {
    /// Starts the guard: `cmd` must run [`serve`] with the arguments appended (the `lucid`
    /// binary with [`ARGV1`]). Its events land in `swap.guard.*` of `stats`. Call it from an
    /// unconfined thread (it forks and execs).
    pub fn spawn(
        mut cmd: Command,
        config: &GuardConfig,
        stats: &StatsRegistry,
    ) -> io::Result<OomGuard> {
        let mut child = cmd
            .args(config.to_args())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()?;
        let out = child.stdout.take().expect("piped stdout");
        // SAFETY: fcntl on a descriptor we own; no memory is involved.
        unsafe {
            let fd = out.as_raw_fd();
            let fl = libc::fcntl(fd, libc::F_GETFL);
            libc::fcntl(fd, libc::F_SETFL, fl | libc::O_NONBLOCK);
        }
        let c = |n: &str| stats.counter(format!("swap.guard.{n}"));
        let counters = [c("rescues"), c("chunks"), c("oom_kill_enabled")];
        let events = Mutex::new(out);
        // Folds the events into the counters whenever the stats are read; returns no pairs
        // of its own (the counters are in the registry).
        stats.probe(
            "swap.guard.events",
            Box::new(move || {
                drain_events(&events, &counters);
                Vec::new()
            }),
        );
        Ok(OomGuard { child })
    }

    /// The guard's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for OomGuard {
    fn drop(&mut self) {
        drop(self.child.stdin.take());
        if lucid_seccomp::Seccomp::of_this_thread().is_none() {
            let _ = self.child.wait();
        }
    }
}

fn drain_events(events: &Mutex<std::process::ChildStdout>, counters: &[Arc<Counter>; 3]) {
    let mut out = events.lock().unwrap_or_else(|e| e.into_inner());
    let mut buf = [0u8; 256];
    while let Ok(n @ 1..) = out.read(&mut buf) {
        for &b in &buf[..n] {
            match b {
                b'r' => counters[0].inc(),
                b'c' => counters[1].inc(),
                b'k' => counters[2].inc(),
                _ => {}
            }
        }
    }
}

/// The guard process's main: runs until the VM exits; returns the exit status.
pub fn serve(args: &[String]) -> i32 {
    let config = match GuardConfig::from_args(args) {
        Ok(c) => c,
        Err(e) => {
            log::error!("{e}");
            return 2;
        }
    };
    match Guard::open(&config).and_then(|g| g.run(&config)) {
        Ok(()) => 0,
        Err(e) => {
            log::error!(
                "oom guard for VM process {}: {e}; a VM whose every thread waits for memory at \
                 its limit will hang",
                config.pid
            );
            1
        }
    }
}

struct Guard {
    pidfd: OwnedFd,
    oom_event: OwnedFd,
    oom_control: File,
    usage: File,
    limit: File,
    out: io::Stdout,
}

fn ctx(what: &str, e: io::Error) -> io::Error {
    io::Error::new(e.kind(), format!("{what}: {e}"))
}

fn cvt(r: libc::c_long) -> io::Result<libc::c_long> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

impl Guard {
    fn open(config: &GuardConfig) -> io::Result<Guard> {
        // SAFETY: prctl with integer arguments only.
        unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) };
        // SAFETY: getppid has no preconditions.
        if unsafe { libc::getppid() } as u32 != config.pid {
            return Err(io::Error::other("the VM process is gone already"));
        }
        // Out of the limit first: from here on our own faults never wait on the VM's cgroup.
        std::fs::write(&config.home_procs, std::process::id().to_string()).map_err(|e| {
            io::Error::new(
                e.kind(),
                format!("cannot move to {}: {e}", config.home_procs.display()),
            )
        })?;
        // SAFETY: pidfd_open takes a pid and flags; the fd returned is ours.
        let pidfd = cvt(unsafe {
            libc::syscall(
                libc::SYS_pidfd_open,
                config.pid as libc::c_long,
                0 as libc::c_long,
            )
        })
        .map_err(|e| ctx("pidfd_open", e))?;
        // SAFETY: a fresh descriptor nothing else owns.
        let pidfd = unsafe { OwnedFd::from_raw_fd(pidfd as i32) };
        let oom_control = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(config.memcg.join("memory.oom_control"))?;
        let usage = File::open(config.memcg.join("memory.usage_in_bytes"))?;
        let limit = std::fs::OpenOptions::new()
            .write(true)
            .open(config.memcg.join("memory.limit_in_bytes"))?;
        // SAFETY: eventfd takes no pointers; the fd returned is ours.
        let efd = cvt(unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) }.into())?;
        // SAFETY: a fresh descriptor nothing else owns.
        let oom_event = unsafe { OwnedFd::from_raw_fd(efd as i32) };
        let mut ctl = std::fs::OpenOptions::new()
            .write(true)
            .open(config.memcg.join("cgroup.event_control"))?;
        // One write: the kernel parses each write whole.
        ctl.write_all(format!("{} {}", oom_event.as_raw_fd(), oom_control.as_raw_fd()).as_bytes())
            .map_err(|e| ctx("register for OOM notices in cgroup.event_control", e))?;
        // SAFETY: fcntl on our stdout; no memory is involved. Events are dropped rather than
        // block the guard when nobody reads them.
        unsafe {
            let fl = libc::fcntl(1, libc::F_GETFL);
            libc::fcntl(1, libc::F_SETFL, fl | libc::O_NONBLOCK);
        }
        Ok(Guard {
            pidfd,
            oom_event,
            oom_control,
            usage,
            limit,
            out: io::stdout(),
        })
    }

    fn emit(&self, e: Event) {
        let mut out = self.out.lock();
        let _ = out.write_all(&[e as u8]);
        let _ = out.flush();
    }

    fn under_oom(&self) -> bool {
        let mut buf = [0u8; 128];
        let n = self.oom_control.read_at(&mut buf, 0).unwrap_or(0);
        std::str::from_utf8(&buf[..n])
            .unwrap_or("")
            .lines()
            .any(|l| l.trim() == "under_oom 1")
    }

    fn usage(&self) -> Option<u64> {
        crate::limit::pread_u64(&self.usage)
    }

    /// Waits for an OOM notification (or a second, as a fallback); false when the VM exited
    /// or closed our stdin.
    fn wait(&self) -> bool {
        let mut p = [
            libc::pollfd {
                fd: 0,
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: self.pidfd.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: self.oom_event.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        // SAFETY: three pollfds that live across the call.
        let r = unsafe { libc::poll(p.as_mut_ptr(), 3, 1000) };
        if r > 0 && (p[0].revents != 0 || p[1].revents != 0) {
            return false;
        }
        if p[2].revents != 0 {
            let mut v = [0u8; 8];
            // SAFETY: reads 8 bytes into `v` from our non-blocking eventfd (drains it).
            unsafe { libc::read(self.oom_event.as_raw_fd(), v.as_mut_ptr().cast(), 8) };
        }
        true
    }

    fn page_out(&self, (addr, len): (u64, u64)) {
        let iov = libc::iovec {
            iov_base: addr as *mut libc::c_void,
            iov_len: len as usize,
        };
        // SAFETY: the iovec names memory in the VM's address space, not ours; the kernel only
        // reclaims those pages (their contents stay what they were).
        unsafe {
            libc::syscall(
                libc::SYS_process_madvise,
                self.pidfd.as_raw_fd(),
                &iov as *const libc::iovec,
                1usize,
                libc::MADV_PAGEOUT,
                0u32,
            )
        };
    }

    fn set_limit(&self, bytes: u64) -> io::Result<()> {
        (&self.limit).write_all(bytes.to_string().as_bytes())
    }

    /// Raises the limit by the headroom (the kernel wakes the sleepers), then sets it back
    /// (the kernel reclaims down to it here; EBUSY when it cannot yet: tried again next time).
    fn nudge(&self, config: &GuardConfig) {
        let _ = self.set_limit(config.limit + config.headroom);
        std::thread::sleep(Duration::from_millis(2));
        let _ = self.set_limit(config.limit);
    }

    /// The limit back where the VM set it, however long the kernel's reclaim takes.
    fn restore_limit(&self, config: &GuardConfig) {
        let start = Instant::now();
        while let Err(e) = self.set_limit(config.limit) {
            if start.elapsed() >= config.stall {
                log::warn!(
                    "oom guard: cannot set the limit back to {} MiB: {e}",
                    config.limit >> 20
                );
                return;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    fn run(&self, config: &GuardConfig) -> io::Result<()> {
        if config.chunks.is_empty() {
            return Err(io::Error::other("no guest RAM to page out"));
        }
        let mut hand = 0usize;
        while self.wait() {
            if !self.under_oom() {
                continue;
            }
            std::thread::sleep(config.grace);
            if !self.under_oom() {
                continue;
            }
            self.emit(Event::Rescue);
            log::warn!(
                "oom guard: the VM's threads wait for memory at its limit and none is freeing \
                 any: paging guest RAM out from outside"
            );
            let mut low = self.usage().unwrap_or(u64::MAX);
            let mut progress = Instant::now();
            while self.under_oom() {
                self.page_out(config.chunks[hand]);
                hand = (hand + 1) % config.chunks.len();
                self.emit(Event::Chunk);
                self.nudge(config);
                let now = self.usage().unwrap_or(u64::MAX);
                if now < low {
                    low = now;
                    progress = Instant::now();
                }
                if progress.elapsed() >= config.stall {
                    log::error!(
                        "oom guard: nothing freed for {:?} (is swap full?): turning the OOM killer \
                         back on",
                        config.stall
                    );
                    self.emit(Event::OomKillEnabled);
                    (&self.oom_control).write_all(b"0")?;
                    break;
                }
                if hand == 0 {
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
            self.restore_limit(config);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn args_round_trip_and_bad_ones_are_refused() {
        let c = GuardConfig {
            pid: 42,
            memcg: "/sys/fs/cgroup/memory/lucid/vm-42".into(),
            home_procs: "/sys/fs/cgroup/memory/cgroup.procs".into(),
            limit: 48 << 20,
            headroom: 4 << 20,
            chunks: vec![(0x7f00_0000_0000, 2 << 20), (0x7f00_0020_0000, 4096)],
            grace: Duration::from_millis(100),
            stall: Duration::from_secs(3),
        };
        assert_eq!(GuardConfig::from_args(&c.to_args()), Ok(c.clone()));
        let mut a = c.to_args();
        a[7] = "zz:1".into();
        assert!(GuardConfig::from_args(&a)
            .unwrap_err()
            .contains("bad chunk"));
        assert!(GuardConfig::from_args(&a[..3])
            .unwrap_err()
            .contains("usage"));
    }
}
