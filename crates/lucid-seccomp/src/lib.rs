//! Lucid's seccomp filters: one per thread role ([`Role::Vcpu`], [`Role::Backend`],
//! [`Role::Main`], [`Role::Iommu`], [`Role::Monitor`], [`Role::Pager`], [`Role::Vsock`]), built with seccompiler
//! and installed by each thread on itself once it has opened what it needs. A forbidden call traps into a handler that reports the thread, its role
//! and the call, and ends the process (the VM) with [`VIOLATION_EXIT_STATUS`]: see
//! docs/security.md for the lists, the reasons and how to debug a violation.
//!
//! [`Seccomp::prepare`] (on the main thread, before any thread confines itself) installs the
//! handler and checks that the filters build and install here; its token is what turns
//! confinement on. A thread confines itself with [`confine`]; the VM's threads do so through
//! `lucid_thread::Spawner`, which holds the token. A thread started by a confined thread
//! inherits its creator's filter and confines itself to its own role, which narrows what it
//! inherited; [`Seccomp::of_this_thread`] tells code whether the calling thread is confined.

mod names;
mod report;
mod rules;

use std::cell::RefCell;
use std::sync::Arc;

use lucid_stats::{Counter, StatsRegistry};
use seccompiler::{BpfProgram, SeccompAction, SeccompFilter, TargetArch};

pub use report::VIOLATION_EXIT_STATUS;

/// The environment variable that makes a thread of the named role (`vcpu`, `backend`, `main`,
/// `iommu`, `monitor`, `pager`, `device-server`, `vsock`, `vhost-user`) call `socket(2)`, which every role forbids, right after it confined itself: how the tests
/// show that a violation is caught and reported. It does nothing else; with seccomp off the
/// call succeeds and the socket is closed.
pub const SELFTEST_ENV: &str = "LUCID_SECCOMP_SELFTEST";

/// What a thread does, and so which system calls it may make.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// `lucid-vcpuN`: runs the guest and handles its exits.
    Vcpu,
    /// A device back-end: `lucid-<dev>-io` and the console's input threads.
    Backend,
    /// The main thread once the VM runs, and the signal thread.
    Main,
    /// `lucid-vtd-sc`: the vIOMMU's sidecore, which polls its shared register page.
    Iommu,
    /// `lucid-monitor`: the scheduling pools' per-VM monitor, which reads its threads'
    /// `schedstat`, places them in pools and sets halt polling.
    Monitor,
    /// `lucid-pager`: keeps the VM's memory cgroup under its limit with `MADV_PAGEOUT` (reads
    /// usage and writes oom_control through descriptors opened before confinement).
    Pager,
    /// `lucid device-server`, a vhost-user back-end or vfio-user device process: every thread,
    /// from the moment its socket is bound (requests from the front-end or client, the vring
    /// worker or the INTx unmask thread, the signal wait).
    DeviceServer,
    /// `lucid-<dev>-cn`: a vsock device's connect thread, which opens the Unix stream sockets
    /// of guest connections to host ports (`socket(AF_UNIX, SOCK_STREAM)` and `connect`).
    Vsock,
    /// `lucid-<dev>-rc`: a vhost-user device's reconnect thread, which re-dials the back-end's
    /// Unix socket (`socket(AF_UNIX, SOCK_STREAM)`, `connect`) and replays the set-up over it
    /// (`sendmsg`, `recvmsg`: the messages carry descriptors).
    VhostUser,
}

impl Role {
    pub const ALL: [Role; 9] = [
        Role::Vcpu,
        Role::Backend,
        Role::Main,
        Role::Iommu,
        Role::Monitor,
        Role::Pager,
        Role::DeviceServer,
        Role::Vsock,
        Role::VhostUser,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Role::Vcpu => "vcpu",
            Role::Backend => "backend",
            Role::Main => "main",
            Role::Iommu => "iommu",
            Role::Monitor => "monitor",
            Role::Pager => "pager",
            Role::DeviceServer => "device-server",
            Role::Vsock => "vsock",
            Role::VhostUser => "vhost-user",
        }
    }

    /// The names of the system calls this role may make (some only with certain arguments),
    /// in number order.
    pub fn allowed_calls(self) -> Result<Vec<&'static str>, SeccompError> {
        let allowed = rules::allowed(self, std::process::id(), libc::SIGRTMIN())
            .map_err(|source| SeccompError::Build { role: self, source })?;
        Ok(allowed.numbers().filter_map(names::name).collect())
    }
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SeccompError {
    #[error("cannot build the seccomp filter of role {role}: {source}")]
    Build {
        role: Role,
        #[source]
        source: seccompiler::BackendError,
    },
    #[error("cannot install the seccomp filter of role {role} on thread {thread}: {source}")]
    Install {
        role: Role,
        thread: String,
        #[source]
        source: seccompiler::Error,
    },
    #[error("cannot install the SIGSYS handler that reports seccomp violations: {0}")]
    Handler(#[source] std::io::Error),
    #[error("this kernel refuses seccomp filters ({0}); run with --no-seccomp")]
    Unsupported(#[source] seccompiler::Error),
    #[error("{SELFTEST_ENV}={0:?}: expected vcpu, backend, main, iommu, monitor, pager, device-server, vsock or vhost-user")]
    BadSelftest(String),
}

/// Confinement is on for this VM: the SIGSYS handler is installed and the filters work here.
/// Counts confined threads per role as `seccomp.confined.<role>`.
#[derive(Clone)]
pub struct Seccomp {
    confined: Arc<[Arc<Counter>; Role::ALL.len()]>,
    /// The jail's (uid, gid) ([`Seccomp::allow_jail_drop`]).
    jail: Option<(u32, u32)>,
}

thread_local! {
    /// The token of a confined thread, for the threads it starts.
    static TOKEN: RefCell<Option<Seccomp>> = const { RefCell::new(None) };
}

impl Seccomp {
    /// Turns confinement on: installs the violation handler, checks the environment's self-test
    /// request and that every role's filter builds and installs on this kernel (on a scratch
    /// thread), and lets libc read what it would otherwise read lazily under a filter (the time
    /// zone, which `gmtime_r` loads on first use from `/etc/localtime`).
    pub fn prepare(stats: &StatsRegistry) -> Result<Seccomp, SeccompError> {
        if let Some(v) = std::env::var_os(SELFTEST_ENV) {
            if !Role::ALL.iter().any(|r| v == r.name()) {
                return Err(SeccompError::BadSelftest(v.to_string_lossy().into_owned()));
            }
        }
        for role in Role::ALL {
            program(role)?;
        }
        std::thread::spawn(|| -> Result<(), seccompiler::Error> {
            prime_heap_trim();
            seccompiler::apply_filter(&clone3_filter()?)
        })
        .join()
        .unwrap_or(Ok(()))
        .map_err(SeccompError::Unsupported)?;
        report::install_handler().map_err(SeccompError::Handler)?;
        // SAFETY: tzset has no preconditions; it only fills libc's time-zone state.
        unsafe { tzset() };
        fix_arena_limit();
        let c = |r: Role| stats.counter(format!("seccomp.confined.{r}"));
        Ok(Seccomp {
            confined: Arc::new(Role::ALL.map(c)),
            jail: None,
        })
    }

    /// Lets every role take the jail's drop to `uid` and `gid` (lucid-jail): glibc makes each
    /// thread call `setgroups(1, ..)`, `setresgid(gid, gid, gid)` and `setresuid(uid, uid, uid)`
    /// from a signal handler, so threads confined before the drop must allow exactly those
    /// (a thread can only give up privilege with them). Set before any thread confines itself.
    pub fn allow_jail_drop(mut self, uid: u32, gid: u32) -> Self {
        self.jail = Some((uid, gid));
        self
    }

    /// The token of the calling thread if it is confined: a thread it starts should confine
    /// itself too (it inherits this thread's filter anyway).
    pub fn of_this_thread() -> Option<Seccomp> {
        TOKEN.with(|t| t.borrow().clone())
    }
}

/// Confines the calling thread to `role` when `seccomp` is on (and is a no-op otherwise), then
/// honours [`SELFTEST_ENV`]. Call at the start of the thread's body, after it opened what it
/// needs; every later system call is checked. A failure is also logged: the thread must not go
/// on unconfined, and not every caller has a way to report it.
pub fn confine(seccomp: Option<&Seccomp>, role: Role) -> Result<(), SeccompError> {
    if let Some(s) = seccomp {
        install(s, role).inspect_err(|e| log::error!("{e}"))?;
        log::debug!("{}: confined to seccomp role {role}", thread_name());
    }
    if std::env::var_os(SELFTEST_ENV).is_some_and(|v| v == role.name()) {
        log::warn!(
            "{SELFTEST_ENV}: {} calls socket(2), which role {role} may not",
            thread_name()
        );
        // SAFETY: socket(2) with constant arguments; a returned fd is ours to close.
        unsafe {
            let fd = libc::socket(libc::AF_UNIX, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0);
            if fd >= 0 {
                libc::close(fd);
            }
        }
    }
    Ok(())
}

fn thread_name() -> String {
    std::thread::current()
        .name()
        .unwrap_or("unnamed")
        .to_string()
}

/// glibc reads `/proc/sys/vm/overcommit_memory` the first time it shrinks a thread arena's heap
/// (in `free`, once the arena's top chunk passes the trim threshold) and caches the answer: a
/// confined thread freeing a big buffer would otherwise die on that `openat`. Allocating and
/// freeing a few hundred KiB in small blocks on a fresh thread (its own arena) makes glibc ask
/// now.
fn prime_heap_trim() {
    let blocks: Vec<Vec<u8>> = (0..16).map(|_| vec![1u8; 48 << 10]).collect();
    std::hint::black_box(&blocks);
    drop(blocks);
}

/// glibc's malloc counts the host's CPUs (`get_nprocs`, an `openat` of
/// `/sys/devices/system/cpu/online`) the first time a thread needs an arena beyond the eighth,
/// to cap them: with a dozen device threads that is a confined back-end thread, which would die
/// on it. Setting the cap now, to glibc's own default (8 per CPU on 64-bit), leaves it nothing
/// to read.
fn fix_arena_limit() {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let arenas = i32::try_from(cpus * 8).unwrap_or(i32::MAX);
    // SAFETY: mallopt only sets a malloc parameter; M_ARENA_MAX takes any positive count.
    unsafe { libc::mallopt(libc::M_ARENA_MAX, arenas) };
}

/// Installs the role's filter (after the clone3 one) on the calling thread.
fn install(s: &Seccomp, role: Role) -> Result<(), SeccompError> {
    let prog = program_with(role, s.jail)?;
    let clone3 = clone3_filter().map_err(|source| SeccompError::Build { role, source })?;
    report::set_identity(role);
    // A new task must be a thread: clone3 (whose flags seccomp cannot read) fails with ENOSYS,
    // and glibc falls back to clone, whose flags the role's filter checks.
    for p in [clone3, prog] {
        seccompiler::apply_filter(&p).map_err(|source| SeccompError::Install {
            role,
            thread: thread_name(),
            source,
        })?;
    }
    TOKEN.with(|t| *t.borrow_mut() = Some(s.clone()));
    s.confined[role as usize].inc();
    Ok(())
}

/// The role's filter: its calls are allowed, any other traps.
fn program(role: Role) -> Result<BpfProgram, SeccompError> {
    program_with(role, Some((1, 1)))
}

/// The role's filter with the jail's drop to (uid, gid) allowed when `jail` is set.
fn program_with(role: Role, jail: Option<(u32, u32)>) -> Result<BpfProgram, SeccompError> {
    let build = |source| SeccompError::Build { role, source };
    let mut allowed = rules::allowed(role, std::process::id(), libc::SIGRTMIN()).map_err(build)?;
    if let Some((uid, gid)) = jail {
        rules::jail_drop(&mut allowed, uid, gid).map_err(build)?;
    }
    SeccompFilter::new(
        allowed.into_rules(),
        SeccompAction::Trap,
        SeccompAction::Allow,
        TargetArch::x86_64,
    )
    .and_then(BpfProgram::try_from)
    .map_err(build)
}

/// clone3 fails with ENOSYS; everything else is left to the other filters.
fn clone3_filter() -> Result<BpfProgram, seccompiler::BackendError> {
    SeccompFilter::new(
        [(libc::SYS_clone3, vec![])].into_iter().collect(),
        SeccompAction::Allow,
        SeccompAction::Errno(libc::ENOSYS as u32),
        TargetArch::x86_64,
    )
    .and_then(BpfProgram::try_from)
}

extern "C" {
    /// POSIX `tzset` (not in the libc crate): loads the time zone.
    fn tzset();
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;

    const CHILD_ENV: &str = "LUCID_SECCOMP_TEST_CHILD";

    /// Runs test `name` of this binary in a child process (a violation ends the whole process)
    /// and returns its exit status and stderr.
    fn run_child(name: &str) -> (Option<i32>, String) {
        let out = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", name, "--nocapture", "--test-threads=1"])
            .env(CHILD_ENV, name)
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }

    /// In the child process running test `name`: the stats and confinement turned on.
    fn as_child(name: &str) -> Option<(Arc<StatsRegistry>, Seccomp)> {
        std::env::var(CHILD_ENV).ok().filter(|v| v == name)?;
        let stats = StatsRegistry::new();
        let s = Seccomp::prepare(&stats).unwrap();
        Some((stats, s))
    }

    #[test]
    fn child_confined_backend_works_then_opens_a_file() {
        let Some((_, s)) = as_child("tests::child_confined_backend_works_then_opens_a_file") else {
            return;
        };
        std::thread::Builder::new()
            .name("lucid-test-io".into())
            .spawn(move || {
                confine(Some(&s), Role::Backend).unwrap();
                // Allowed: memory, time, eventfds, writing.
                let v = vec![0u8; 1 << 20];
                let _ = std::time::Instant::now();
                let e = vmm_sys_util::eventfd::EventFd::new(0).unwrap();
                e.write(1).unwrap();
                assert_eq!(e.read().unwrap(), 1);
                drop(v);
                eprintln!("allowed calls went through");
                // Forbidden: opening a file traps, reports and ends the process.
                let _ = std::fs::File::open("/etc/hostname");
                eprintln!("not reached");
            })
            .unwrap()
            .join()
            .unwrap();
    }

    #[test]
    fn a_violation_is_reported_and_ends_the_process_with_148() {
        let (status, stderr) = run_child("tests::child_confined_backend_works_then_opens_a_file");
        assert_eq!(status, Some(VIOLATION_EXIT_STATUS), "{stderr}");
        assert!(stderr.contains("allowed calls went through"), "{stderr}");
        assert!(
            stderr.contains(
                "lucid: seccomp: thread lucid-test-io (role backend) made a forbidden system \
                 call: openat (257)"
            ),
            "{stderr}"
        );
        assert!(!stderr.contains("not reached"), "{stderr}");
    }

    #[test]
    fn child_thread_of_a_confined_thread() {
        let Some((stats, s)) = as_child("tests::child_thread_of_a_confined_thread") else {
            return;
        };
        std::thread::spawn(move || {
            confine(Some(&s), Role::Vcpu).unwrap();
            // A vCPU may start threads, but only through clone: clone3 (whose flags seccomp
            // cannot read) fails with ENOSYS, and glibc falls back to clone.
            // SAFETY: clone3 with a null argument only returns an error here.
            let r = unsafe { libc::syscall(libc::SYS_clone3, 0usize, 0usize) };
            let err = std::io::Error::last_os_error().raw_os_error();
            assert_eq!((r, err), (-1, Some(libc::ENOSYS)));
            let token = Seccomp::of_this_thread();
            assert!(token.is_some());
            std::thread::spawn(move || confine(token.as_ref(), Role::Backend).unwrap())
                .join()
                .unwrap();
        })
        .join()
        .unwrap();
        let snap = stats.snapshot();
        eprintln!(
            "confined vcpu={} backend={} main={}",
            snap["seccomp.confined.vcpu"],
            snap["seccomp.confined.backend"],
            snap["seccomp.confined.main"]
        );
    }

    #[test]
    fn a_thread_started_by_a_confined_thread_confines_itself_too() {
        let (status, stderr) = run_child("tests::child_thread_of_a_confined_thread");
        assert_eq!(status, Some(0), "{stderr}");
        assert!(
            stderr.contains("confined vcpu=1 backend=1 main=0"),
            "{stderr}"
        );
    }

    #[test]
    fn without_the_token_nothing_is_confined() {
        confine(None, Role::Vcpu).unwrap();
        assert!(Seccomp::of_this_thread().is_none());
        assert!(std::fs::File::open("/proc/self/status").is_ok());
    }

    #[test]
    fn docs_name_every_call_a_role_may_make() {
        let page = include_str!("../../../docs/security.md");
        for role in Role::ALL {
            for call in role.allowed_calls().unwrap() {
                assert!(
                    page.contains(&format!("`{call}`")),
                    "docs/security.md does not name `{call}` ({role})"
                );
            }
        }
    }
}
