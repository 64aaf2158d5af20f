//! `lucid device-server net`: binds the socket, confines the process, serves one front-end at
//! a time with rust-vmm's `VhostUserDaemon`, and stops on SIGTERM/SIGINT or when the front-end
//! goes (unless `--reconnect`).

use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use lucid_devserver::{block_stop_signals, wait_signal, BindError};
use lucid_seccomp::{Role, Seccomp, SeccompError};
use lucid_stats::StatsRegistry;
use vhost::vhost_user::{Error as VhostUserError, Listener};
use vhost_user_backend::{ShutdownHandle, VhostUserDaemon};
use vm_memory::{GuestMemoryAtomic, GuestMemoryMmap};

use crate::backend::{Counters, NetBackend};
use crate::reflect::parse_mac;

/// The MAC address the device reports when `--mac` is not given (locally administered).
pub const DEFAULT_MAC: &str = "52:54:00:76:68:01";

/// How long a stop waits for the connection being served to wind down.
const STOP_GRACE: Duration = Duration::from_secs(2);

#[derive(clap::Subcommand)]
pub enum DeviceServerCmd {
    /// A vhost-user-net back-end for tests (docs/devices.md): with `--mode echo`, every frame
    /// the guest transmits comes back on its receive queue with the MAC addresses swapped.
    Net(NetArgs),
}

#[derive(clap::Args)]
pub struct NetArgs {
    /// The Unix socket to listen on (a stale socket file is replaced; one a process listens
    /// on is refused).
    #[arg(long, value_name = "PATH")]
    pub socket: PathBuf,
    #[arg(long, value_enum, default_value_t = Mode::Echo)]
    pub mode: Mode,
    /// The MAC address in the configuration space.
    #[arg(long, default_value = DEFAULT_MAC)]
    pub mac: String,
    /// Serve the next front-end when one disconnects, instead of exiting.
    #[arg(long)]
    pub reconnect: bool,
    /// Run without the seccomp filter (to debug a violation).
    #[arg(long)]
    pub no_seccomp: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Mode {
    /// Reflect: each transmitted frame is received back with source and destination swapped.
    Echo,
}

impl Mode {
    pub fn name(self) -> &'static str {
        match self {
            Mode::Echo => "echo",
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("--mac {0:?} is not a MAC address (aa:bb:cc:dd:ee:ff)")]
    Mac(String),
    #[error(transparent)]
    Bind(#[from] BindError),
    #[error(transparent)]
    Seccomp(#[from] SeccompError),
    #[error("cannot start the server thread")]
    Thread(#[source] std::io::Error),
    #[error("vhost-user daemon: {0}")]
    Daemon(String),
    #[error("the front-end broke the protocol: {0}")]
    Frontend(String),
}

impl ServerError {
    /// A command line the server refuses, rather than a failure while serving.
    pub fn is_usage(&self) -> bool {
        matches!(self, ServerError::Mac(_))
    }
}

/// What the server did, printed as its last line.
pub struct Summary {
    pub counters: Counters,
    /// The signal that stopped it, if one did.
    pub signal: Option<i32>,
    /// The last front-end broke the protocol (logged as it happened), rather than
    /// disconnecting.
    pub frontend_error: bool,
}

impl Summary {
    /// Failure when the front-end broke the protocol, success otherwise.
    pub fn exit_code(&self) -> std::process::ExitCode {
        match self.frontend_error {
            true => std::process::ExitCode::FAILURE,
            false => std::process::ExitCode::SUCCESS,
        }
    }
}

impl std::fmt::Display for Summary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let why = match (self.signal, self.frontend_error) {
            (Some(libc::SIGTERM), _) => "SIGTERM",
            (Some(libc::SIGINT), _) => "SIGINT",
            (Some(_), _) => "signal",
            (None, true) => "frontend-error",
            (None, false) => "disconnect",
        };
        write!(
            f,
            "lucid device-server net: stopped={why} {}",
            self.counters
        )
    }
}

/// Runs a device server until it stops; its counters are in the summary.
pub fn run(cmd: DeviceServerCmd) -> Result<Summary, ServerError> {
    match cmd {
        DeviceServerCmd::Net(args) => serve_net(&args),
    }
}

fn serve_net(args: &NetArgs) -> Result<Summary, ServerError> {
    let mac = parse_mac(&args.mac).ok_or_else(|| ServerError::Mac(args.mac.clone()))?;
    let listener = lucid_devserver::bind(&args.socket)?;
    let signals = block_stop_signals();
    let stats = StatsRegistry::new();
    let counters = Counters::new(&stats);
    // Confined from here on, with every thread the daemon starts (they inherit the filter):
    // nothing after this point opens a file or makes a socket.
    if !args.no_seccomp {
        let token = Seccomp::prepare(&stats)?;
        lucid_seccomp::confine(Some(&token), Role::DeviceServer)?;
    }
    log::info!(
        "vhost-user-net ({}) listening on {} (mac {})",
        args.mode.name(),
        args.socket.display(),
        args.mac
    );
    let stop = Arc::new(AtomicBool::new(false));
    let current: Arc<Mutex<Option<ShutdownHandle>>> = Arc::default();
    let server = {
        let (counters, stop, current) = (counters.clone(), stop.clone(), current.clone());
        let reconnect = args.reconnect;
        std::thread::Builder::new()
            .name("lucid-vhnet".into())
            .spawn(move || serve(listener, mac, counters, reconnect, &stop, &current))
            .map_err(ServerError::Thread)?
    };
    let mut signal = None;
    while !server.is_finished() {
        if let Some(sig) = wait_signal(&signals, Duration::from_millis(100)) {
            signal = Some(sig);
            break;
        }
    }
    let result = match signal {
        None => join(server),
        Some(sig) => {
            log::info!("signal {sig}: stopping");
            stop.store(true, Ordering::SeqCst);
            if let Some(h) = lock(&current).take() {
                h.shutdown();
            }
            // Waiting for a front-end in accept: nothing to wind down, the exit ends it.
            let t0 = Instant::now();
            while !server.is_finished() && t0.elapsed() < STOP_GRACE {
                std::thread::sleep(Duration::from_millis(10));
            }
            match server.is_finished() {
                true => join(server),
                false => Ok(()),
            }
        }
    };
    let frontend_error = match result {
        Err(ServerError::Frontend(_)) => true,
        Err(e) => return Err(e),
        Ok(()) => false,
    };
    Ok(Summary {
        counters,
        signal,
        frontend_error,
    })
}

fn join(server: JoinHandle<Result<(), ServerError>>) -> Result<(), ServerError> {
    server
        .join()
        .unwrap_or_else(|_| Err(ServerError::Daemon("the server thread panicked".into())))
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Serves front-ends one after the other, each with a fresh device, until one disconnects
/// (unless `reconnect`) or `stop` is set.
fn serve(
    listener: UnixListener,
    mac: [u8; 6],
    counters: Counters,
    reconnect: bool,
    stop: &AtomicBool,
    current: &Mutex<Option<ShutdownHandle>>,
) -> Result<(), ServerError> {
    // From a listener without a path: the socket file stays when it is dropped (a confined
    // process may not unlink); the next server replaces it.
    let mut listener = Listener::from(listener);
    loop {
        let backend = Arc::new(RwLock::new(NetBackend::new(mac, counters.clone())));
        let mem = GuestMemoryAtomic::new(GuestMemoryMmap::new());
        let mut daemon = VhostUserDaemon::new("lucid-vhnet-req".into(), backend, mem)
            .map_err(|e| ServerError::Daemon(e.to_string()))?;
        daemon
            .start(&mut listener)
            .map_err(|e| ServerError::Daemon(e.to_string()))?;
        counters.connections.inc();
        log::info!("front-end connected");
        *lock(current) = daemon.shutdown_handle();
        if stop.load(Ordering::SeqCst) {
            daemon.request_shutdown();
        }
        let ended = daemon.wait();
        *lock(current) = None;
        for h in daemon.get_epoll_handlers() {
            h.send_exit_event();
        }
        // Joins the vring worker, which the exit event above ended.
        drop(daemon);
        let ended = match ended {
            Ok(())
            | Err(vhost_user_backend::Error::HandleRequest(
                VhostUserError::Disconnected | VhostUserError::PartialMessage,
            )) => {
                log::info!("front-end disconnected");
                Ok(())
            }
            Err(e) => {
                counters.errors.inc();
                log::warn!("front-end connection ended: {e}");
                Err(ServerError::Frontend(e.to_string()))
            }
        };
        if stop.load(Ordering::SeqCst) || !reconnect {
            return ended;
        }
    }
}
