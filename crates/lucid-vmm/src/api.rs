//! The control API's VMM side (docs/api.md): the socket it is served on ([`ApiSocket`]: mode
//! 0600, a stale socket replaced, a live one refused, the file removed when it goes) and
//! Lucid's own operations on a running VM, which the REST server of the `lucid` command serves
//! as `/api/v1/lucid.*`: SymCalls ([`symcall`]), symbiotic modules ([`module_load`],
//! [`module_unload`], [`modules`]) and the SymSpy pages ([`spy`]). Their request and answer
//! types are in [`proto`], shared with the client (`lucid sym`).
//!
//! Module objects go by path (or built-in name), not inline: Lucid opens the file read-only
//! and reads at most [`MAX_MODULE_BYTES`].

use std::ffi::CString;
use std::io::{ErrorKind, Read};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;

use crate::report::error_chain;
use crate::sym::{ModuleOptions, Symbiotic};
use crate::Vm;

pub mod proto;
use proto::{ModuleInfo, ModuleList, ModuleLoad, SymReturn, Symcall, Unloaded};

/// The largest module file [`module_load`] reads.
pub const MAX_MODULE_BYTES: u64 = 16 << 20;
/// The longest `timeout_ms` a SymCall may ask for: the API serves one request at a time, so
/// one call must not hold the other clients for long (`lucid sym` waits 30 s for a reply).
pub const MAX_SYMCALL_TIMEOUT_MS: u64 = 10_000;

/// Finds a built-in module object by name (`lucid_guests::module` in the CLI): lucid-vmm does
/// not embed the guest kit.
pub type BuiltinModules = fn(&str) -> Option<&'static [u8]>;

/// Why the API socket could not be bound.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error(
        "--api-socket {0}: another process is listening there (a running VM?): stop it or \
         choose another path"
    )]
    InUse(PathBuf),
    #[error("--api-socket {0}: the path exists and is not a socket: Lucid will not replace it")]
    NotSocket(PathBuf),
    #[error("--api-socket {0}: the path names no file")]
    NoFileName(PathBuf),
    #[error("--api-socket {path}: cannot {what}")]
    Io {
        path: PathBuf,
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
}

/// The bound socket, before its thread starts. Dropping it removes the socket file (when it is
/// still the one bound here).
pub struct ApiSocket {
    listener: UnixListener,
    path: PathBuf,
    /// The socket's directory (`O_PATH`): the file is removed through it, so that the file
    /// removed is the one in the directory bound, whatever the working directory is by then.
    dir: OwnedFd,
    name: CString,
    /// (device, inode) of the socket file bound here.
    id: (u64, u64),
}

impl ApiSocket {
    /// Binds `path`: replaces a socket file nobody listens on (a dead run's), refuses a live
    /// one and anything that is not a socket.
    pub fn bind(path: &Path) -> Result<Self, ApiError> {
        let io = |what| {
            let path = path.to_path_buf();
            move |source| ApiError::Io { path, what, source }
        };
        let name = path
            .file_name()
            .ok_or_else(|| ApiError::NoFileName(path.into()))?;
        let name = CString::new(name.as_bytes()).map_err(|_| ApiError::NoFileName(path.into()))?;
        match std::fs::symlink_metadata(path) {
            Err(e) if e.kind() == ErrorKind::NotFound => {}
            Err(e) => return Err(io("look at the path")(e)),
            Ok(m) if !m.file_type().is_socket() => return Err(ApiError::NotSocket(path.into())),
            Ok(_) => match UnixStream::connect(path) {
                Ok(_) => return Err(ApiError::InUse(path.into())),
                Err(e) if e.kind() == ErrorKind::ConnectionRefused => {
                    log::info!(
                        "--api-socket {}: replacing a stale socket (nobody listens on it)",
                        path.display()
                    );
                    std::fs::remove_file(path).map_err(io("remove the stale socket"))?;
                }
                Err(e) => return Err(io("check whether another process listens there")(e)),
            },
        }
        let dir = match path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d,
            _ => Path::new("."),
        };
        let dir: OwnedFd = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_PATH | libc::O_DIRECTORY)
            .open(dir)
            .map_err(io("open its directory"))?
            .into();
        let listener = UnixListener::bind(path).map_err(io("bind"))?;
        let mut sock = ApiSocket {
            listener,
            path: path.into(),
            dir,
            name,
            id: (0, 0),
        };
        // From here a failure drops `sock`, which removes the file once `id` names it.
        let meta = std::fs::symlink_metadata(path).map_err(io("look at the bound socket"))?;
        sock.id = (meta.dev(), meta.ino());
        // Only this user: the API can read files and change the guest.
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
            .map_err(io("make the socket private (mode 0600)"))?;
        sock.listener
            .set_nonblocking(true)
            .map_err(io("make the socket non-blocking"))?;
        log::info!("control API on {}", path.display());
        Ok(sock)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The listening socket (non-blocking).
    pub fn listener(&self) -> &UnixListener {
        &self.listener
    }
}

impl Drop for ApiSocket {
    fn drop(&mut self) {
        let dir = self.dir.as_raw_fd();
        // SAFETY: fstatat and unlinkat on a directory descriptor we own and a NUL-terminated
        // name; `st` is plain data the kernel fills.
        unsafe {
            let mut st: libc::stat = std::mem::zeroed();
            let ours = libc::fstatat(dir, self.name.as_ptr(), &mut st, libc::AT_SYMLINK_NOFOLLOW)
                == 0
                && (st.st_dev, st.st_ino) == self.id;
            // Another run may have replaced a socket it found dead: leave its file alone.
            if ours && libc::unlinkat(dir, self.name.as_ptr(), 0) != 0 {
                log::warn!(
                    "cannot remove the API socket {}: {}",
                    self.path.display(),
                    std::io::Error::last_os_error()
                );
            }
        }
    }
}

/// Why a `lucid.*` operation was not done.
#[derive(Debug, thiserror::Error)]
pub enum OpError {
    /// The request cannot be served as asked (a vCPU the VM lacks, an unknown call, a module
    /// file Lucid cannot read): nothing was tried.
    #[error("{0}")]
    Request(String),
    /// The operation needs `--symbiotic` (`lucid.symbiotic` in `vm.create`).
    #[error("{0} needs the symbiotic interfaces: this VM runs without --symbiotic")]
    NotSymbiotic(&'static str),
    /// It was tried and failed (the guest's loader refused a module, a call timed out).
    #[error("{0}")]
    Failed(String),
}

fn sym<'a>(vm: &'a Vm, what: &'static str) -> Result<&'a Arc<Symbiotic>, OpError> {
    vm.sym().ok_or(OpError::NotSymbiotic(what))
}

/// Runs a SymCall on a vCPU of `vm` and waits for its return (at most its time bound).
pub fn symcall(vm: &Vm, req: &Symcall) -> Result<SymReturn, OpError> {
    let sym = sym(vm, "lucid.symcall")?;
    let nr = req.call.number().map_err(OpError::Request)?;
    if req.args.len() > 5 {
        return Err(OpError::Request(format!(
            "lucid.symcall takes at most 5 args (rdi, rsi, rdx, r10, r8), got {}",
            req.args.len()
        )));
    }
    let vcpus = u32::from(vm.config().machine.vcpus);
    if req.vcpu >= vcpus {
        return Err(OpError::Request(format!(
            "no vCPU {}: the VM has {vcpus} (0..={})",
            req.vcpu,
            vcpus - 1
        )));
    }
    let mut limits = sym.call_limits();
    if let Some(ms) = req.timeout_ms {
        if !(1..=MAX_SYMCALL_TIMEOUT_MS).contains(&ms) {
            return Err(OpError::Request(format!(
                "lucid.symcall timeout_ms must be 1..={MAX_SYMCALL_TIMEOUT_MS}, got {ms}"
            )));
        }
        limits.timeout = Duration::from_millis(ms);
    }
    let mut a = [0u64; 5];
    a[..req.args.len()].copy_from_slice(&req.args);
    sym.call_with(req.vcpu, nr, a, limits).map_err(|e| {
        OpError::Failed(format!(
            "SymCall {nr:#x} on vCPU {}: {}",
            req.vcpu,
            error_chain(&e)
        ))
    })
}

/// Loads a module, from a file Lucid reads or built in (`RuntimeConfig::builtin_modules`).
pub fn module_load(vm: &Vm, req: &ModuleLoad) -> Result<ModuleInfo, OpError> {
    let sym = sym(vm, "lucid.module-load")?;
    let bytes: std::borrow::Cow<[u8]> = match (&req.path, &req.builtin) {
        (Some(p), None) => read_module(p).map_err(OpError::Request)?.into(),
        (None, Some(name)) => {
            let find = vm.config().runtime.builtin_modules.ok_or_else(|| {
                OpError::Request("this Lucid has no built-in modules: load one by path".into())
            })?;
            find(name)
                .ok_or_else(|| OpError::Request(format!("no built-in module {name:?}")))?
                .into()
        }
        _ => {
            return Err(OpError::Request(
                "lucid.module-load takes one of `path` or `builtin`".into(),
            ))
        }
    };
    let opts = ModuleOptions {
        read_only: req.read_only,
        ..ModuleOptions::default()
    };
    sym.load_module(&bytes, &opts)
        .map_err(|e| OpError::Failed(format!("module_load: {}", error_chain(&e))))
}

/// Unloads module `id`.
pub fn module_unload(vm: &Vm, id: u32) -> Result<Unloaded, OpError> {
    sym(vm, "lucid.module-unload")?
        .unload_module(id)
        .map_err(|e| OpError::Failed(format!("module_unload {id}: {}", error_chain(&e))))?;
    Ok(Unloaded { id })
}

/// The modules loaded now.
pub fn modules(vm: &Vm) -> Result<ModuleList, OpError> {
    Ok(ModuleList {
        modules: sym(vm, "lucid.modules")?.modules(),
    })
}

/// The SymSpy pages the guest registered, and their fields.
pub fn spy(vm: &Vm) -> Result<Value, OpError> {
    serde_json::to_value(sym(vm, "lucid.spy")?.spy_snapshot())
        .map_err(|e| OpError::Failed(format!("lucid.spy: {e}")))
}

/// Reads a module file: a regular file of at most [`MAX_MODULE_BYTES`].
fn read_module(path: &Path) -> Result<Vec<u8>, String> {
    let what = |e: std::io::Error| format!("module {}: {e}", path.display());
    // O_NONBLOCK: opening a FIFO must not wait for a writer.
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .map_err(what)?;
    let m = f.metadata().map_err(what)?;
    if !m.is_file() {
        return Err(format!("module {}: not a regular file", path.display()));
    }
    if m.len() > MAX_MODULE_BYTES {
        return Err(format!(
            "module {}: {} bytes, more than the {MAX_MODULE_BYTES} Lucid reads",
            path.display(),
            m.len()
        ));
    }
    let mut bytes = Vec::with_capacity(m.len() as usize);
    f.take(MAX_MODULE_BYTES)
        .read_to_end(&mut bytes)
        .map_err(what)?;
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmp(name: &str) -> PathBuf {
        std::env::temp_dir().join(format!("lucid-api-{}-{name}", std::process::id()))
    }

    #[test]
    fn a_stale_socket_is_replaced_a_live_one_refused_and_the_file_removed_on_drop() {
        let p = tmp("sock");
        let _ = std::fs::remove_file(&p);
        // A dead run's socket: bound, then its listener closed.
        drop(UnixListener::bind(&p).unwrap());
        assert!(p.exists());
        let s = ApiSocket::bind(&p).unwrap();
        let mode = std::fs::metadata(&p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        // Live: refused, and the file stays.
        let e = ApiSocket::bind(&p).err().unwrap().to_string();
        assert!(e.contains("another process is listening"), "{e}");
        assert!(p.exists());
        drop(s);
        assert!(!p.exists(), "removed on drop");
        // Not a socket: refused and left alone.
        std::fs::write(&p, b"data").unwrap();
        let e = ApiSocket::bind(&p).err().unwrap().to_string();
        assert!(e.contains("not a socket"), "{e}");
        assert_eq!(std::fs::read(&p).unwrap(), b"data");
        std::fs::remove_file(&p).unwrap();
    }

    #[test]
    fn module_files_must_be_small_regular_files() {
        assert!(read_module(Path::new("/dev/zero"))
            .unwrap_err()
            .contains("not a regular file"));
        assert!(read_module(Path::new("/nonexistent/x.o")).is_err());
        let p = tmp("mod.o");
        std::fs::write(&p, b"\x7fELF").unwrap();
        assert_eq!(read_module(&p).unwrap(), b"\x7fELF");
        std::fs::remove_file(&p).unwrap();
    }
}
