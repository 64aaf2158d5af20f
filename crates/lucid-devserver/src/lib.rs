//! What every out-of-process device server (`lucid device-server ...`) does around serving:
//! listen on its Unix socket (a stale socket file is replaced, a live one or a file of another
//! kind refused) and take the signals that stop it.

use std::os::unix::fs::FileTypeExt;
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::time::Duration;

#[derive(Debug, thiserror::Error)]
pub enum BindError {
    #[error("{0}: another process listens on this socket")]
    InUse(PathBuf),
    #[error("{0}: exists and is not a socket")]
    NotSocket(PathBuf),
    #[error("cannot listen on {path}")]
    Bind {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// The socket at `path`, listening.
pub fn bind(path: &Path) -> Result<UnixListener, BindError> {
    if let Ok(m) = std::fs::symlink_metadata(path) {
        if !m.file_type().is_socket() {
            return Err(BindError::NotSocket(path.into()));
        }
        if listened_on(path) {
            return Err(BindError::InUse(path.into()));
        }
        let _ = std::fs::remove_file(path);
    }
    UnixListener::bind(path).map_err(|source| BindError::Bind {
        path: path.into(),
        source,
    })
}

/// Whether a socket listens at `path`, from `/proc/net/unix` rather than by connecting: a
/// connection would be a client to the server listening there.
fn listened_on(path: &Path) -> bool {
    /// `__SO_ACCEPTCON` in the table's flags: a listening socket.
    const ACCEPTING: u32 = 0x1_0000;
    let Ok(table) = std::fs::read_to_string("/proc/net/unix") else {
        return false;
    };
    let abs = std::path::absolute(path).ok();
    table.lines().skip(1).any(|line| {
        let f: Vec<&str> = line.split_whitespace().collect();
        f.len() == 8
            && u32::from_str_radix(f[3], 16).is_ok_and(|flags| flags & ACCEPTING != 0)
            && (Path::new(f[7]) == path || abs.as_deref() == Some(Path::new(f[7])))
    })
}

/// The signals that stop the server, blocked in the calling thread (and so in every thread it
/// starts) to be taken with `sigtimedwait`.
pub fn block_stop_signals() -> libc::sigset_t {
    // SAFETY: sigset_t is plain data that sigemptyset initialises; pthread_sigmask only changes
    // this thread's mask.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        set
    }
}

/// A stop signal taken within `timeout`, if one came.
pub fn wait_signal(set: &libc::sigset_t, timeout: Duration) -> Option<i32> {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: `set` and `ts` are valid for the call; no siginfo is asked for.
    let sig = unsafe { libc::sigtimedwait(set, std::ptr::null_mut(), &ts) };
    (sig > 0).then_some(sig)
}
