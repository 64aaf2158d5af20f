//! The control API (`--api-socket PATH`, docs/symbiotic.md): a Unix stream socket served by the
//! thread `lucid-api`, one JSON object per line each way. It issues SymCalls, loads and unloads
//! symbiotic modules, shows the SymSpy pages and the statistics of a running VM, and will grow
//! into the management API.
//!
//! Requests (`op`): `symcall` (`vcpu`, `call`: a name or a number, `args`: up to 5),
//! `module_load` (`path` of a file Lucid reads, or `builtin`; `read_only`), `module_unload`
//! (`id`), `modules`, `spy`, `stats`, `stop`. Replies: `{"ok":true,...}` or
//! `{"ok":false,"error":"..."}`; the types of both are in [`proto`]. A client's bad input (not JSON, an unknown op, a line over
//! [`MAX_LINE`] bytes, a disconnect mid-line) costs it an error reply or its connection, never
//! the VM. Up to [`MAX_CLIENTS`] clients at once; requests are served one at a time.
//!
//! Module objects go by path (or built-in name), not inline: the thread opens the file
//! read-only (its seccomp role allows `openat` without write access) and reads at most
//! [`MAX_MODULE_BYTES`]. The socket file is created mode 0600, replaced when a dead run left it
//! (nobody listening), refused when another process listens there, and removed at VM exit.

use std::ffi::CString;
use std::io::{ErrorKind, Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use lucid_devices::{Lifecycle, StopReason};
use lucid_stats::{Counter, StatsRegistry};
use serde::Serialize;
use serde_json::Value;
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::report::error_chain;
use crate::sym::{ModuleOptions, Symbiotic};

pub mod proto;
use proto::{Counters, ModuleList, Reply, Request, Stopping, Unloaded};

/// The longest request line, newline excluded: module objects go by path, so requests are
/// small.
pub const MAX_LINE: usize = 64 << 10;
/// Clients served at once; more wait in the listen backlog.
pub const MAX_CLIENTS: usize = 8;
/// The largest module file `module_load` reads.
pub const MAX_MODULE_BYTES: u64 = 16 << 20;
/// How long a reply may wait for a client that does not read before the client is dropped.
const WRITE_PATIENCE: Duration = Duration::from_secs(2);
/// The longest `timeout_ms` a `symcall` request may ask for: requests are served one at a time,
/// so one call must not hold the other clients for long (`lucid sym` waits 30 s for a reply).
pub const MAX_SYMCALL_TIMEOUT_MS: u64 = 10_000;

/// Finds a built-in module object by name (`lucid_guests::module` in the CLI): lucid-vmm does
/// not embed the guest kit.
pub type BuiltinModules = fn(&str) -> Option<&'static [u8]>;

/// Why the control API could not start.
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
    #[error(transparent)]
    Thread(#[from] lucid_thread::SpawnError),
}

/// The bound socket, before its thread starts. Dropping it removes the socket file (when it is
/// still the one bound here).
pub struct ApiSocket {
    listener: UnixListener,
    path: PathBuf,
    /// The socket's directory (`O_PATH`): the file is removed through it, which is all the
    /// API thread's seccomp role allows.
    dir: Arc<OwnedFd>,
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
            dir: Arc::new(dir),
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

    /// The listening socket (non-blocking), for a server other than the JSON-lines one (the
    /// REST API of `lucid run --api-socket` with no payload).
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

/// What the API thread serves.
pub struct ApiContext {
    /// The VM's symbiotic state (`--symbiotic`), for SymCalls, modules and SymSpy.
    pub sym: Option<Arc<Symbiotic>>,
    pub stats: Arc<StatsRegistry>,
    /// For `stop`.
    pub lifecycle: Arc<Lifecycle>,
    pub vcpus: u32,
    pub builtin_modules: Option<BuiltinModules>,
}

/// `api.*` counters.
struct ApiCounters {
    connections: Arc<Counter>,
    requests: Arc<Counter>,
    errors: Arc<Counter>,
    /// Clients dropped for bad framing (a line too long, a disconnect mid-line, a stalled
    /// reader).
    dropped: Arc<Counter>,
}

/// The running API thread.
pub struct ApiServer {
    thread: Option<JoinHandle<()>>,
    shutdown: EventFd,
}

impl ApiServer {
    /// Starts `lucid-api` on `sock`; it confines itself to the `api` seccomp role.
    pub fn spawn(
        sock: ApiSocket,
        ctx: ApiContext,
        spawner: &lucid_thread::Spawner,
    ) -> Result<Self, ApiError> {
        let shutdown = EventFd::new(EFD_NONBLOCK).map_err(|source| ApiError::Io {
            path: sock.path.clone(),
            what: "create the API thread's shutdown eventfd",
            source,
        })?;
        let wake = shutdown.try_clone().map_err(|source| ApiError::Io {
            path: sock.path.clone(),
            what: "create the API thread's shutdown eventfd",
            source,
        })?;
        let c = |n: &str| ctx.stats.counter(format!("api.{n}"));
        let counters = ApiCounters {
            connections: c("connections"),
            requests: c("requests"),
            errors: c("errors"),
            dropped: c("clients_dropped"),
        };
        let lifecycle = ctx.lifecycle.clone();
        let spec = lucid_thread::ThreadSpec::new(
            "lucid-api",
            lucid_stats::ThreadRole::Other,
            lucid_seccomp::Role::Api,
        )
        .api_socket_dir(sock.dir.clone());
        let thread = spawner.spawn(spec, move |confined| {
            if let Err(e) = confined {
                return lifecycle.stop(StopReason::error(e));
            }
            Server {
                sock,
                ctx,
                counters,
                wake,
            }
            .run()
        })?;
        Ok(ApiServer {
            thread: Some(thread),
            shutdown,
        })
    }

    /// Asks the thread to stop (it closes its clients and removes the socket file).
    pub fn signal_stop(&self) {
        let _ = self.shutdown.write(1);
    }

    /// Stops the thread and waits for it.
    pub fn stop(&mut self) {
        self.signal_stop();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The control API (`--api-socket`) as one of the VM's techniques: the socket is bound while
/// the VM is built (a path in use fails the build), `lucid-api` starts after the vCPU threads,
/// takes no new request once the VM stops (quiesce) and removes its socket file when it stops.
pub(crate) struct ApiTechnique {
    socket: Option<ApiSocket>,
    ctx: Option<ApiContext>,
    server: Option<ApiServer>,
}

impl ApiTechnique {
    pub(crate) fn new(socket: ApiSocket, ctx: ApiContext) -> Self {
        ApiTechnique {
            socket: Some(socket),
            ctx: Some(ctx),
            server: None,
        }
    }
}

impl crate::technique::Technique for ApiTechnique {
    fn name(&self) -> &'static str {
        "api"
    }

    fn start(&mut self, cx: &crate::technique::StartContext<'_>) -> Result<(), crate::VmmError> {
        if let (Some(sock), Some(ctx)) = (self.socket.take(), self.ctx.take()) {
            self.server = Some(ApiServer::spawn(sock, ctx, cx.spawner)?);
        }
        Ok(())
    }

    fn quiesce(&mut self) {
        // No new requests; one in progress ends when its vCPU stops.
        if let Some(s) = &self.server {
            s.signal_stop();
        }
    }

    fn stop(&mut self) {
        // Its socket file goes with it.
        if let Some(mut s) = self.server.take() {
            s.stop();
        }
    }

    fn counters(&self) -> &'static [&'static str] {
        &["api."]
    }

    fn summary(&self) -> Vec<String> {
        self.socket
            .iter()
            .map(|s| format!("control API on {}", s.path().display()))
            .collect()
    }
}

struct Client {
    stream: UnixStream,
    buf: Vec<u8>,
}

struct Server {
    sock: ApiSocket,
    ctx: ApiContext,
    counters: ApiCounters,
    wake: EventFd,
}

impl Server {
    fn run(self) {
        let mut clients: Vec<Client> = Vec::new();
        loop {
            let mut fds = vec![pollfd(self.wake.as_raw_fd())];
            let listening = clients.len() < MAX_CLIENTS;
            if listening {
                fds.push(pollfd(self.sock.listener.as_raw_fd()));
            }
            fds.extend(clients.iter().map(|c| pollfd(c.stream.as_raw_fd())));
            // SAFETY: poll on a valid array of pollfds of descriptors we hold.
            let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, -1) };
            if n < 0 {
                let e = std::io::Error::last_os_error();
                if e.kind() == ErrorKind::Interrupted {
                    continue;
                }
                log::error!("control API: poll: {e}; the API stops (the VM goes on)");
                break;
            }
            if fds[0].revents != 0 {
                break;
            }
            let first_client = 1 + usize::from(listening);
            // Clients first, from the last, so that removing one keeps the others' indices.
            for i in (0..clients.len()).rev() {
                if fds[first_client + i].revents != 0 && !self.serve(&mut clients[i]) {
                    clients.swap_remove(i);
                }
            }
            if listening && fds[1].revents != 0 {
                self.accept(&mut clients);
            }
        }
        log::debug!("control API: stopping");
    }

    fn accept(&self, clients: &mut Vec<Client>) {
        match self.sock.listener.accept() {
            Ok((stream, _)) => {
                if let Err(e) = stream.set_nonblocking(true) {
                    log::warn!("control API: a client: {e}");
                    return;
                }
                self.counters.connections.inc();
                clients.push(Client {
                    stream,
                    buf: Vec::new(),
                });
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => {}
            Err(e) => log::warn!("control API: accept: {e}"),
        }
    }

    /// Reads what `c` sent and answers each complete line; false drops the client.
    fn serve(&self, c: &mut Client) -> bool {
        let mut chunk = [0u8; 16 << 10];
        loop {
            match c.stream.read(&mut chunk) {
                Ok(0) => {
                    if c.buf.iter().any(|b| !b.is_ascii_whitespace()) {
                        // It may have shut only its sending side: tell it.
                        self.counters.dropped.inc();
                        let _ = self.reply(
                            c,
                            &self.error(
                                "connection closed mid-line: end each request with a newline",
                            ),
                        );
                    }
                    return false;
                }
                Ok(n) => c.buf.extend_from_slice(&chunk[..n]),
                Err(e) if e.kind() == ErrorKind::WouldBlock => return true,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(_) => return false,
            }
            while let Some(end) = c.buf.iter().position(|&b| b == b'\n') {
                let line: Vec<u8> = c.buf.drain(..=end).collect();
                let text = &line[..end];
                if text.iter().all(u8::is_ascii_whitespace) {
                    continue;
                }
                let reply = self.handle(text);
                if !self.reply(c, &reply) {
                    return false;
                }
            }
            if c.buf.len() > MAX_LINE {
                self.counters.dropped.inc();
                let e = self.error(&format!(
                    "request line longer than {MAX_LINE} bytes: send module objects by path; \
                     closing the connection"
                ));
                let _ = self.reply(c, &e);
                return false;
            }
        }
    }

    /// Writes one reply line; false when the client cannot take it.
    fn reply(&self, c: &mut Client, v: &Value) -> bool {
        let mut out = v.to_string().into_bytes();
        out.push(b'\n');
        let deadline = Instant::now() + WRITE_PATIENCE;
        let mut at = 0;
        while at < out.len() {
            match c.stream.write(&out[at..]) {
                Ok(0) => return false,
                Ok(n) => at += n,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        self.counters.dropped.inc();
                        log::warn!("control API: a client does not read its replies: dropped");
                        return false;
                    }
                    let mut fd = pollfd(c.stream.as_raw_fd());
                    fd.events = libc::POLLOUT;
                    // SAFETY: poll on one valid pollfd.
                    unsafe { libc::poll(&mut fd, 1, left.as_millis().max(1) as libc::c_int) };
                }
                Err(_) => return false,
            }
        }
        true
    }

    fn error(&self, msg: &str) -> Value {
        self.counters.errors.inc();
        serde_json::to_value(Reply::<Stopping>::error(msg)).expect("JSON of plain values")
    }

    fn handle(&self, line: &[u8]) -> Value {
        self.counters.requests.inc();
        let req: Request = match serde_json::from_slice(line) {
            Ok(r) => r,
            Err(e) => return self.error(&format!("bad request: {e}")),
        };
        match self.dispatch(req) {
            Ok(v) => v,
            Err(e) => self.error(&e),
        }
    }

    fn sym(&self, what: &str) -> Result<&Arc<Symbiotic>, String> {
        self.ctx.sym.as_ref().ok_or_else(|| {
            format!("{what} needs the symbiotic interfaces: this VM runs without --symbiotic")
        })
    }

    /// The reply to `req`, or why it failed.
    fn dispatch(&self, req: Request) -> Result<Value, String> {
        match req {
            Request::Symcall {
                vcpu,
                call,
                args,
                timeout_ms,
            } => {
                let sym = self.sym("symcall")?;
                let nr = call.number()?;
                if args.len() > 5 {
                    return Err(format!(
                        "symcall takes at most 5 args (rdi, rsi, rdx, r10, r8), got {}",
                        args.len()
                    ));
                }
                if vcpu >= self.ctx.vcpus {
                    return Err(format!(
                        "no vCPU {vcpu}: the VM has {} (0..={})",
                        self.ctx.vcpus,
                        self.ctx.vcpus - 1
                    ));
                }
                let mut limits = sym.call_limits();
                if let Some(ms) = timeout_ms {
                    if !(1..=MAX_SYMCALL_TIMEOUT_MS).contains(&ms) {
                        return Err(format!(
                            "symcall timeout_ms must be 1..={MAX_SYMCALL_TIMEOUT_MS}, got {ms}"
                        ));
                    }
                    limits.timeout = Duration::from_millis(ms);
                }
                let mut a = [0u64; 5];
                a[..args.len()].copy_from_slice(&args);
                let r = sym
                    .call_with(vcpu, nr, a, limits)
                    .map_err(|e| format!("symcall {nr:#x} on vCPU {vcpu}: {}", error_chain(&e)))?;
                answer(r)
            }
            Request::ModuleLoad {
                path,
                builtin,
                read_only,
            } => {
                let sym = self.sym("module_load")?;
                let bytes: std::borrow::Cow<[u8]> = match (path, builtin) {
                    (Some(p), None) => read_module(&p)?.into(),
                    (None, Some(name)) => self.builtin(&name)?.into(),
                    _ => return Err("module_load takes one of `path` or `builtin`".into()),
                };
                let opts = ModuleOptions {
                    read_only,
                    ..ModuleOptions::default()
                };
                let info = sym
                    .load_module(&bytes, &opts)
                    .map_err(|e| format!("module_load: {}", error_chain(&e)))?;
                answer(info)
            }
            Request::ModuleUnload { id } => {
                self.sym("module_unload")?
                    .unload_module(id)
                    .map_err(|e| format!("module_unload {id}: {}", error_chain(&e)))?;
                answer(Unloaded { id })
            }
            Request::Modules => answer(ModuleList {
                modules: self.sym("modules")?.modules(),
            }),
            Request::Spy => answer(self.sym("spy")?.spy_snapshot()),
            Request::Stats => answer(Counters {
                counters: lucid_stats::nest(&self.ctx.stats.snapshot()),
            }),
            Request::Stop => {
                log::info!("control API: stop requested");
                self.ctx.lifecycle.stop(StopReason::Shutdown);
                answer(Stopping {})
            }
        }
    }

    fn builtin(&self, name: &str) -> Result<&'static [u8], String> {
        let find = self
            .ctx
            .builtin_modules
            .ok_or("this Lucid has no built-in modules: load one by path")?;
        find(name).ok_or_else(|| format!("no built-in module {name:?}"))
    }
}

/// `{"ok":true}` beside the fields of `a`.
fn answer(a: impl Serialize) -> Result<Value, String> {
    serde_json::to_value(Reply::answer(a)).map_err(|e| e.to_string())
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

fn pollfd(fd: i32) -> libc::pollfd {
    libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    }
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
