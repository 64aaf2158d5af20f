//! The jail (`--jail uid=N,gid=N[,chroot=DIR]`, docs/jail.md): once a VM is built (its
//! `/dev/kvm`, files, taps and sockets open) and before its guest runs, the VMM process gives up
//! what it no longer needs. [`enter`] chroots, drops the capability bounding set, sets
//! no-new-privileges, changes to the unprivileged user and group, clears every capability set
//! and, where the kernel has Landlock, limits file access to the paths it is given.
//!
//! Credentials are per thread in Linux. The user and group change through glibc, which makes
//! every thread of the process take them (and the kernel then clears each thread's effective,
//! permitted and ambient capabilities); the bounding set, the inheritable set and the Landlock
//! domain are the calling thread's, and the threads it starts from then on inherit them.
//! [`before_threads`], called before the process starts any thread, gives every thread
//! no-new-privileges and an empty bounding set.

#![warn(clippy::print_stdout, clippy::print_stderr)]

use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// Whom the VMM becomes, and where its root is.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JailConfig {
    /// The user the process drops to (not 0).
    pub uid: u32,
    /// Its group, and its only supplementary group.
    pub gid: u32,
    /// A directory that becomes the process's root before the drop.
    #[serde(default)]
    pub chroot: Option<PathBuf>,
}

/// A step of the drop that failed. Every step before it took effect: the process must not go
/// on to run the guest.
#[derive(Debug, thiserror::Error)]
pub enum JailError {
    #[error("jail: {step} failed")]
    Step {
        step: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("jail: chroot={0} is not a directory")]
    ChrootNotDir(PathBuf),
    #[error("jail: {path}: cannot open it to allow it under Landlock")]
    LandlockPath {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("jail: the process still has capabilities after the drop (effective {0:#x})")]
    CapsRemain(u64),
    #[error("jail: the process runs as uid {got}, not {want}, after the drop")]
    UidRemains { got: u32, want: u32 },
}

fn step(step: &'static str) -> impl FnOnce(std::io::Error) -> JailError {
    move |source| JailError::Step { step, source }
}

/// `-1` from a libc call as the thread's errno.
fn check(r: libc::c_long) -> std::io::Result<libc::c_long> {
    match r {
        -1 => Err(std::io::Error::last_os_error()),
        r => Ok(r),
    }
}

/// What a path allowed under Landlock may be used for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    /// Read a file (a read-only disk image).
    ReadFile,
    /// Read and write a file (a disk image).
    ReadWriteFile,
    /// Read files and list directories below a directory (`/proc`).
    ReadTree,
    /// Remove names in a directory (an API socket's, at VM exit).
    RemoveIn,
}

/// A path the jailed process may still use, and how.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Allow {
    pub path: PathBuf,
    pub access: Access,
}

/// What [`enter`] did, for the log.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Entered {
    /// The Landlock ABI version enforced, `None` where the kernel has no Landlock.
    pub landlock_abi: Option<u32>,
}

/// What [`enter`] can do before the process starts any thread, so that every thread has it (the
/// drop's glibc broadcast reaches threads started earlier, but not their bounding set or
/// Landlock domain): no-new-privileges, and with `drop_bounding` (when the process will not run
/// a program that needs root's capabilities) the bounding set dropped.
pub fn before_threads(drop_bounding: bool) -> Result<(), JailError> {
    no_new_privs()?;
    if drop_bounding && effective_caps()? & CAP_SETPCAP != 0 {
        drop_bounding_set()?;
    }
    Ok(())
}

/// Sets no-new-privileges on the calling thread (and the threads it starts from then on).
fn no_new_privs() -> Result<(), JailError> {
    // SAFETY: prctl with integer arguments only.
    check(unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) }.into())
        .map(drop)
        .map_err(step("prctl(PR_SET_NO_NEW_PRIVS)"))
}

/// Checks what [`enter`] can check before anything is built: uid and gid are not root's, the
/// chroot directory exists.
pub fn check_config(c: &JailConfig) -> Result<(), JailError> {
    if let Some(dir) = &c.chroot {
        if !dir.is_dir() {
            return Err(JailError::ChrootNotDir(dir.clone()));
        }
    }
    Ok(())
}

/// Drops the calling process into the jail `c`, allowing the paths `allow` under Landlock. In
/// order: the Landlock rules are made (their paths opened before a chroot hides them), the
/// chroot, no-new-privileges, the bounding set and the ambient set dropped (while
/// `CAP_SETPCAP` is held), the groups, gid and uid changed (every thread), every capability set
/// of this thread cleared, then the Landlock domain entered. Each later thread this one starts
/// inherits all of it.
pub fn enter(c: &JailConfig, allow: &[Allow]) -> Result<Entered, JailError> {
    check_config(c)?;
    let abi = landlock_abi();
    let ruleset = match abi {
        Some(abi) => Some(ruleset(abi, allow)?),
        None => None,
    };
    if let Some(dir) = &c.chroot {
        let path = cstring(dir)?;
        // SAFETY: chroot and chdir with NUL-terminated paths that outlive the calls.
        unsafe {
            check(libc::chroot(path.as_ptr()).into()).map_err(step("chroot"))?;
            check(libc::chdir(c"/".as_ptr()).into()).map_err(step("chdir(\"/\")"))?;
        }
    }
    no_new_privs()?;
    // A caller without root's capabilities (a member of group kvm jailing itself) has none to
    // drop: its bounding set cannot change, and its groups stay if they are the jail's already.
    let held = effective_caps()?;
    if held & CAP_SETPCAP != 0 {
        drop_bounding_set()?;
    }
    // SAFETY: prctl with integer arguments only.
    let r = unsafe {
        libc::prctl(
            libc::PR_CAP_AMBIENT,
            libc::PR_CAP_AMBIENT_CLEAR_ALL,
            0,
            0,
            0,
        )
    };
    check(r.into()).map_err(step("prctl(PR_CAP_AMBIENT_CLEAR_ALL)"))?;
    // glibc's set*id calls make every thread of the process take the change.
    // SAFETY: setgroups reads one gid from a live local; setresgid/setresuid take integers.
    unsafe {
        if held & CAP_SETGID != 0 || !groups_within(c.gid)? {
            check(libc::setgroups(1, &c.gid).into()).map_err(step("setgroups"))?;
        }
        check(libc::setresgid(c.gid, c.gid, c.gid).into()).map_err(step("setresgid"))?;
        check(libc::setresuid(c.uid, c.uid, c.uid).into()).map_err(step("setresuid"))?;
    }
    clear_caps()?;
    let eff = effective_caps()?;
    if eff != 0 {
        return Err(JailError::CapsRemain(eff));
    }
    // SAFETY: getuid has no preconditions.
    let uid = unsafe { libc::getuid() };
    if uid != c.uid {
        return Err(JailError::UidRemains {
            got: uid,
            want: c.uid,
        });
    }
    if let Some(fd) = ruleset {
        // SAFETY: landlock_restrict_self on a ruleset descriptor we own, no flags.
        check(unsafe { libc::syscall(libc::SYS_landlock_restrict_self, fd.as_raw_fd(), 0u32) })
            .map_err(step("landlock_restrict_self"))?;
    }
    Ok(Entered { landlock_abi: abi })
}

fn cstring(p: &Path) -> Result<CString, JailError> {
    CString::new(p.as_os_str().as_bytes()).map_err(|_| JailError::ChrootNotDir(p.into()))
}

/// `CAP_SETGID` and `CAP_SETPCAP` (linux/capability.h) as bits of a set.
const CAP_SETGID: u64 = 1 << 6;
const CAP_SETPCAP: u64 = 1 << 8;

/// Whether the process's supplementary groups are none or only `gid`.
fn groups_within(gid: u32) -> Result<bool, JailError> {
    let mut groups = vec![0; 65536];
    // SAFETY: getgroups writes at most `groups.len()` ids into the live buffer.
    let n = check(unsafe { libc::getgroups(groups.len() as i32, groups.as_mut_ptr()) }.into())
        .map_err(step("getgroups"))?;
    groups.truncate(n as usize);
    Ok(groups.iter().all(|&g| g == gid))
}

/// Drops every capability from the calling thread's bounding set.
fn drop_bounding_set() -> Result<(), JailError> {
    for cap in 0.. {
        // SAFETY: prctl with integer arguments only.
        match check(unsafe { libc::prctl(libc::PR_CAPBSET_DROP, cap, 0, 0, 0) }.into()) {
            Ok(_) => {}
            // Past the last capability this kernel knows.
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) && cap > 0 => return Ok(()),
            Err(e) => return Err(step("prctl(PR_CAPBSET_DROP)")(e)),
        }
    }
    Ok(())
}

/// `struct __user_cap_header_struct` (linux/capability.h).
#[repr(C)]
struct CapHeader {
    version: u32,
    pid: libc::c_int,
}

/// `struct __user_cap_data_struct`: one per 32 capabilities.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

/// `_LINUX_CAPABILITY_VERSION_3`: 64-bit sets in two [`CapData`].
const CAP_V3: u32 = 0x2008_0522;

/// Empties the calling thread's effective, permitted and inheritable sets.
fn clear_caps() -> Result<(), JailError> {
    let mut h = CapHeader {
        version: CAP_V3,
        pid: 0,
    };
    let d = [CapData::default(); 2];
    // SAFETY: capset reads a valid v3 header and two data structs.
    check(unsafe { libc::syscall(libc::SYS_capset, &mut h, d.as_ptr()) })
        .map(drop)
        .map_err(step("capset"))
}

/// The calling thread's effective set.
fn effective_caps() -> Result<u64, JailError> {
    let mut h = CapHeader {
        version: CAP_V3,
        pid: 0,
    };
    let mut d = [CapData::default(); 2];
    // SAFETY: capget writes two data structs for a valid v3 header.
    check(unsafe { libc::syscall(libc::SYS_capget, &mut h, d.as_mut_ptr()) })
        .map_err(step("capget"))?;
    Ok(u64::from(d[0].effective) | (u64::from(d[1].effective) << 32))
}

// Landlock (linux/landlock.h).
const LANDLOCK_CREATE_RULESET_VERSION: u32 = 1;
const LANDLOCK_RULE_PATH_BENEATH: u32 = 1;
const FS_EXECUTE: u64 = 1 << 0;
const FS_WRITE_FILE: u64 = 1 << 1;
const FS_READ_FILE: u64 = 1 << 2;
const FS_READ_DIR: u64 = 1 << 3;
const FS_REMOVE_FILE: u64 = 1 << 5;
/// ABI 1's rights: execute, write, read, read dir, remove dir/file, make char/dir/reg/sock/
/// fifo/block/sym.
const FS_ABI1: u64 = (1 << 13) - 1;
const FS_REFER: u64 = 1 << 13;
const FS_TRUNCATE: u64 = 1 << 14;
const FS_IOCTL_DEV: u64 = 1 << 15;
const NET_BIND_TCP: u64 = 1 << 0;
const NET_CONNECT_TCP: u64 = 1 << 1;

/// `struct landlock_ruleset_attr` up to ABI 4's `handled_access_net`.
#[repr(C)]
struct RulesetAttr {
    handled_access_fs: u64,
    handled_access_net: u64,
}

/// `struct landlock_path_beneath_attr` (packed in the kernel's header).
#[repr(C, packed)]
struct PathBeneath {
    allowed_access: u64,
    parent_fd: i32,
}

/// The Landlock ABI version this kernel offers, `None` without Landlock (not built in, or not
/// enabled at boot).
pub fn landlock_abi() -> Option<u32> {
    // SAFETY: the documented version query: a null attribute, size 0, the VERSION flag.
    let r = unsafe {
        libc::syscall(
            libc::SYS_landlock_create_ruleset,
            std::ptr::null::<RulesetAttr>(),
            0usize,
            LANDLOCK_CREATE_RULESET_VERSION,
        )
    };
    u32::try_from(r).ok().filter(|&v| v > 0)
}

/// Every filesystem right ABI `abi` knows: what the ruleset handles (denies unless allowed).
fn fs_rights(abi: u32) -> u64 {
    let mut r = FS_ABI1;
    if abi >= 2 {
        r |= FS_REFER;
    }
    if abi >= 3 {
        r |= FS_TRUNCATE;
    }
    if abi >= 5 {
        r |= FS_IOCTL_DEV;
    }
    r
}

/// The rights `a` grants, within `handled`.
fn rights(a: Access, handled: u64) -> u64 {
    let r = match a {
        Access::ReadFile => FS_READ_FILE,
        Access::ReadWriteFile => FS_READ_FILE | FS_WRITE_FILE | FS_TRUNCATE,
        Access::ReadTree => FS_READ_FILE | FS_READ_DIR,
        Access::RemoveIn => FS_REMOVE_FILE,
    };
    r & handled & !FS_EXECUTE
}

/// A ruleset that handles every filesystem right (and, from ABI 4, TCP bind and connect) and
/// allows `allow`.
fn ruleset(abi: u32, allow: &[Allow]) -> Result<OwnedFd, JailError> {
    let attr = RulesetAttr {
        handled_access_fs: fs_rights(abi),
        handled_access_net: match abi >= 4 {
            true => NET_BIND_TCP | NET_CONNECT_TCP,
            false => 0,
        },
    };
    let size = match abi >= 4 {
        true => std::mem::size_of::<RulesetAttr>(),
        false => std::mem::size_of::<u64>(),
    };
    // SAFETY: landlock_create_ruleset reads `size` bytes of a live attribute struct.
    let fd = check(unsafe {
        libc::syscall(
            libc::SYS_landlock_create_ruleset,
            &attr as *const RulesetAttr,
            size,
            0u32,
        )
    })
    .map_err(step("landlock_create_ruleset"))?;
    // SAFETY: a new descriptor the call just returned, owned by nothing else.
    let ruleset = unsafe { OwnedFd::from_raw_fd(fd as i32) };
    for a in allow {
        let path =
            CString::new(a.path.as_os_str().as_bytes()).map_err(|_| JailError::LandlockPath {
                path: a.path.clone(),
                source: std::io::ErrorKind::InvalidInput.into(),
            })?;
        // SAFETY: open with a NUL-terminated path; O_PATH opens no file for I/O.
        let fd = check(unsafe { libc::open(path.as_ptr(), libc::O_PATH | libc::O_CLOEXEC) }.into())
            .map_err(|source| JailError::LandlockPath {
                path: a.path.clone(),
                source,
            })?;
        // SAFETY: a new descriptor open just returned.
        let parent = unsafe { OwnedFd::from_raw_fd(fd as i32) };
        let rule = PathBeneath {
            allowed_access: rights(a.access, attr.handled_access_fs),
            parent_fd: parent.as_raw_fd(),
        };
        // SAFETY: landlock_add_rule reads a live path-beneath attribute on our ruleset.
        check(unsafe {
            libc::syscall(
                libc::SYS_landlock_add_rule,
                ruleset.as_raw_fd(),
                LANDLOCK_RULE_PATH_BENEATH,
                &rule as *const PathBeneath,
                0u32,
            )
        })
        .map_err(|source| JailError::LandlockPath {
            path: a.path.clone(),
            source,
        })?;
    }
    Ok(ruleset)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rights_stay_within_what_the_abi_handles() {
        assert_eq!(fs_rights(1), FS_ABI1);
        assert_eq!(fs_rights(3) & FS_TRUNCATE, FS_TRUNCATE);
        assert_eq!(fs_rights(7), (1 << 16) - 1);
        // A regular file takes only file rights; TRUNCATE is unknown before ABI 3.
        assert_eq!(
            rights(Access::ReadWriteFile, fs_rights(1)),
            FS_READ_FILE | FS_WRITE_FILE
        );
        assert_eq!(rights(Access::ReadTree, fs_rights(7)) & FS_WRITE_FILE, 0);
        assert_eq!(std::mem::size_of::<PathBeneath>(), 12);
    }

    #[test]
    fn config_round_trips_and_checks_the_chroot() {
        let c: JailConfig = serde_json::from_str(r#"{"uid":65534,"gid":65534}"#).unwrap();
        assert_eq!(c.chroot, None);
        assert!(check_config(&c).is_ok());
        let missing = JailConfig {
            chroot: Some("/nonexistent/lucid-jail".into()),
            ..c
        };
        assert!(matches!(
            check_config(&missing),
            Err(JailError::ChrootNotDir(_))
        ));
        assert!(serde_json::from_str::<JailConfig>(r#"{"uid":1,"gid":1,"user":"x"}"#).is_err());
    }

    #[test]
    fn landlock_version_is_a_number_or_none() {
        // Linux 5.13+ built with Landlock answers 1 or more; others fail the call.
        if let Some(v) = landlock_abi() {
            assert!((1..100).contains(&v));
        }
    }
}

/// The drop itself, in a child process (it cannot be undone): as root only.
#[cfg(test)]
mod drop_tests {
    use super::*;
    use std::io::Write;

    const CHILD_ENV: &str = "LUCID_JAIL_TEST_CHILD";
    const NAME: &str = "drop_tests::child_enters_the_jail";

    fn status_field(key: &str) -> String {
        let s = std::fs::read_to_string("/proc/thread-self/status").unwrap();
        s.lines()
            .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))
            .unwrap_or_default()
            .trim()
            .to_string()
    }

    #[test]
    fn child_enters_the_jail() {
        let Some(dir) = std::env::var_os(CHILD_ENV) else {
            return;
        };
        let dir = PathBuf::from(dir);
        let allowed = dir.join("allowed");
        let c = JailConfig {
            uid: 65534,
            gid: 65534,
            chroot: None,
        };
        let allow = [
            Allow {
                path: allowed.clone(),
                access: Access::ReadWriteFile,
            },
            Allow {
                path: "/proc/self".into(),
                access: Access::ReadTree,
            },
        ];
        let e = enter(&c, &allow).unwrap();
        let (mut r, mut eu, mut s) = (0, 0, 0);
        // SAFETY: getresuid writes three ids through valid pointers.
        unsafe { libc::getresuid(&mut r, &mut eu, &mut s) };
        assert_eq!((r, eu, s), (65534, 65534, 65534));
        for key in ["CapEff", "CapPrm", "CapInh", "CapBnd", "CapAmb"] {
            assert_eq!(status_field(key), "0000000000000000", "{key}");
        }
        assert_eq!(status_field("NoNewPrivs"), "1");
        assert_eq!(status_field("Groups"), "65534");
        // The allowed file opens for writing (it is world-writable, so only Landlock could
        // refuse); a world-readable file elsewhere does not, where Landlock is enforced.
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .open(&allowed)
            .unwrap();
        f.write_all(b"jailed").unwrap();
        let other = std::fs::read(dir.join("other"));
        match e.landlock_abi {
            Some(_) => assert_eq!(
                other.map_err(|e| e.kind()),
                Err(std::io::ErrorKind::PermissionDenied)
            ),
            None => assert!(other.is_ok()),
        }
        eprintln!("jail entered: landlock {:?}", e.landlock_abi);
    }

    #[test]
    fn the_drop_leaves_no_privilege() {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("skipped: the drop needs root");
            return;
        }
        let dir = std::env::temp_dir().join(format!("lucid-jail-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for name in ["allowed", "other"] {
            let p = dir.join(name);
            std::fs::write(&p, b"x").unwrap();
            std::fs::set_permissions(&p, std::os::unix::fs::PermissionsExt::from_mode(0o666))
                .unwrap();
        }
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", NAME, "--nocapture", "--test-threads=1"])
            .env(CHILD_ENV, &dir)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{stdout}\n{stderr}");
        assert!(stderr.contains("jail entered"), "{stdout}\n{stderr}");
        assert_eq!(std::fs::read(dir.join("allowed")).unwrap(), b"jailed");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
