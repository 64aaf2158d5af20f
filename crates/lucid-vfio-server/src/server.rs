//! `lucid device-server edu|blk`: binds the socket, confines the process, and serves one vfio-user
//! client. When the client goes away the process ends (exit 0), as an assigned device goes with
//! the VM it was given to: a new VM gets a fresh device process, with no state or mappings left
//! from the last. `--reconnect` instead serves the next client with a fresh device (for tests
//! and development). SIGTERM/SIGINT stop it; its counters are the last line it prints.

use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

pub use lucid_devserver::bind;
use lucid_devserver::{block_stop_signals, wait_signal, BindError};
use lucid_seccomp::{Role, Seccomp, SeccompError};
use lucid_stats::StatsRegistry;
use vfio_user::Server;

use crate::blk::{blk_irqs, blk_regions, BlkCounters, BlkServer, BlkStats, Disk};
use crate::dma::{DmaStats, DmaTable};
use crate::edu::{edu_irqs, edu_regions, EduServer, EduServerError};

#[derive(clap::Subcommand)]
pub enum DeviceServerCmd {
    /// QEMU's edu device over vfio-user (docs/devices.md), for `lucid run --user-device`: its
    /// DMA reaches only what the VMM maps, refusals go to the fault log.
    Edu(EduArgs),
    /// virtio-blk (virtio 1.x over PCI) over a disk file, for `lucid run --user-device`: its
    /// DMA reaches only what the VMM maps, refusals go to the fault log.
    Blk(BlkArgs),
}

#[derive(clap::Args)]
pub struct BlkArgs {
    #[command(flatten)]
    pub common: EduArgs,
    /// The disk image (raw; its size rounded down to 512-byte sectors is the capacity).
    #[arg(long, value_name = "FILE")]
    pub disk: PathBuf,
    /// Open the disk read-only and offer VIRTIO_BLK_F_RO.
    #[arg(long)]
    pub readonly: bool,
}

#[derive(clap::Args)]
pub struct EduArgs {
    /// The Unix socket to listen on (a stale socket file is replaced; one a process listens
    /// on, or any other file, is refused).
    #[arg(long, value_name = "PATH")]
    pub socket: PathBuf,
    /// Serve the next client, with a fresh device, when one disconnects, instead of exiting.
    #[arg(long)]
    pub reconnect: bool,
    /// Run without the seccomp filter (to debug a violation).
    #[arg(long)]
    pub no_seccomp: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error(transparent)]
    Bind(#[from] BindError),
    #[error(transparent)]
    Seccomp(#[from] SeccompError),
    #[error(transparent)]
    Device(#[from] EduServerError),
    #[error("cannot start the server thread")]
    Thread(#[source] std::io::Error),
    #[error("the server thread panicked")]
    Panicked,
    #[error("cannot open the disk {path}")]
    Disk {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("the client broke the protocol: {0}")]
    Client(#[source] vfio_user::Error),
}

impl ServerError {
    /// A command line the server refuses, rather than a failure while serving.
    pub fn is_usage(&self) -> bool {
        matches!(
            self,
            ServerError::Bind(BindError::NotSocket(_)) | ServerError::Disk { .. }
        )
    }
}

/// What the server did, printed as its last line.
pub struct Summary {
    /// The device served ("edu", "blk").
    pub device: &'static str,
    pub dma: DmaStats,
    /// The block device's counters, for `blk`.
    pub blk: Option<BlkStats>,
    /// Clients served.
    pub clients: u64,
    /// The signal that stopped it, if one did.
    pub signal: Option<i32>,
    /// The last client broke the protocol (logged as it happened), rather than disconnecting.
    pub client_error: bool,
}

impl Summary {
    /// Failure when the client broke the protocol, success otherwise.
    pub fn exit_code(&self) -> std::process::ExitCode {
        match self.client_error {
            true => std::process::ExitCode::FAILURE,
            false => std::process::ExitCode::SUCCESS,
        }
    }
}

impl std::fmt::Display for Summary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let why = match (self.signal, self.client_error) {
            (Some(libc::SIGTERM), _) => "SIGTERM",
            (Some(libc::SIGINT), _) => "SIGINT",
            (Some(_), _) => "signal",
            (None, true) => "client-error",
            (None, false) => "disconnect",
        };
        write!(
            f,
            "lucid device-server {}: stopped={why} clients={} {}",
            self.device, self.clients, self.dma
        )?;
        if let Some(b) = &self.blk {
            write!(f, " {b}")?;
        }
        Ok(())
    }
}

/// Runs a device server until it stops.
pub fn run(cmd: DeviceServerCmd) -> Result<Summary, ServerError> {
    match cmd {
        DeviceServerCmd::Edu(args) => serve_edu(&args),
        DeviceServerCmd::Blk(args) => serve_blk(&args),
    }
}

fn serve_edu(args: &EduArgs) -> Result<Summary, ServerError> {
    let listener = bind(&args.socket)?;
    confined(args, "edu", None, move |dma, stats, clients, reconnect| {
        serve(listener, dma, stats, clients, reconnect)
    })
}

fn serve_blk(args: &BlkArgs) -> Result<Summary, ServerError> {
    // Opened before confinement, which allows no open.
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(!args.readonly)
        .open(&args.disk)
        .map_err(|source| ServerError::Disk {
            path: args.disk.clone(),
            source,
        })?;
    let disk = Disk::new(file, args.readonly).map_err(|source| ServerError::Disk {
        path: args.disk.clone(),
        source,
    })?;
    let disk = Arc::new(disk);
    let listener = bind(&args.common.socket)?;
    let counters = Arc::new(BlkCounters::default());
    let c = counters.clone();
    confined(
        &args.common,
        "blk",
        Some(counters),
        move |dma, _stats, clients, reconnect| {
            serve_blk_clients(listener, dma, &disk, &c, clients, reconnect)
        },
    )
}

/// Confines the process and serves in a thread until the client goes or a signal comes.
fn confined(
    args: &EduArgs,
    device: &'static str,
    blk: Option<Arc<BlkCounters>>,
    serve_fn: impl FnOnce(
            &Arc<DmaTable>,
            &Arc<StatsRegistry>,
            &std::sync::atomic::AtomicU64,
            bool,
        ) -> Result<(), ServerError>
        + Send
        + 'static,
) -> Result<Summary, ServerError> {
    let signals = block_stop_signals();
    let stats = StatsRegistry::new();
    // Confined from here on, with the threads it starts: nothing after this point opens a file
    // or makes a socket.
    if !args.no_seccomp {
        let token = Seccomp::prepare(&stats)?;
        lucid_seccomp::confine(Some(&token), Role::DeviceServer)?;
    }
    log::info!("vfio-user {device} listening on {}", args.socket.display());
    let dma = Arc::new(DmaTable::new());
    let clients = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let server = {
        let (dma, clients, stats) = (dma.clone(), clients.clone(), stats.clone());
        let reconnect = args.reconnect;
        std::thread::Builder::new()
            .name(format!("lucid-vfio-{device}"))
            .spawn(move || serve_fn(&dma, &stats, &clients, reconnect))
            .map_err(ServerError::Thread)?
    };
    let mut signal = None;
    while !server.is_finished() {
        if let Some(sig) = wait_signal(&signals, Duration::from_millis(100)) {
            log::info!("signal {sig}: stopping");
            signal = Some(sig);
            break;
        }
    }
    // On a signal the server thread is left in its accept or read: the exit ends it.
    let result = match signal {
        Some(_) => Ok(()),
        None => server.join().unwrap_or(Err(ServerError::Panicked)),
    };
    let client_error = match result {
        Err(ServerError::Client(_)) => true,
        Err(e) => return Err(e),
        Ok(()) => false,
    };
    let summary = Summary {
        device,
        dma: dma.stats(),
        blk: blk.map(|b| b.stats()),
        clients: clients.load(std::sync::atomic::Ordering::Relaxed),
        signal,
        client_error,
    };
    log::info!("{summary}");
    Ok(summary)
}

/// Serves clients one after the other, each with a fresh edu and no mappings, until one
/// disconnects (unless `reconnect`).
pub fn serve(
    listener: UnixListener,
    dma: &Arc<DmaTable>,
    stats: &Arc<StatsRegistry>,
    clients: &std::sync::atomic::AtomicU64,
    reconnect: bool,
) -> Result<(), ServerError> {
    // From a descriptor, so the socket file stays when the server is dropped (a confined
    // process may not unlink); the next server replaces it.
    let server = Server::from_owned_fd(listener.into(), true, edu_irqs(), edu_regions());
    loop {
        let mut edu = EduServer::new(dma.clone(), stats.clone())?;
        let ended = server.run(&mut edu);
        clients.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        // The unmask thread ends, the mappings go.
        drop(edu);
        dma.clear();
        let ended = match ended {
            Ok(()) => {
                log::info!("client disconnected; {}", dma.stats());
                Ok(())
            }
            Err(e) => {
                log::warn!("client connection ended: {e}");
                Err(ServerError::Client(e))
            }
        };
        if !reconnect {
            return ended;
        }
    }
}

/// Serves clients one after the other, each with a fresh virtio-blk over `disk` and no
/// mappings, until one disconnects (unless `reconnect`).
pub fn serve_blk_clients(
    listener: UnixListener,
    dma: &Arc<DmaTable>,
    disk: &Arc<Disk>,
    counters: &Arc<BlkCounters>,
    clients: &std::sync::atomic::AtomicU64,
    reconnect: bool,
) -> Result<(), ServerError> {
    let server = Server::from_owned_fd(listener.into(), true, blk_irqs(), blk_regions());
    loop {
        let mut blk = BlkServer::new(dma.clone(), disk.clone(), counters.clone())?;
        let ended = server.run(&mut blk);
        clients.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        drop(blk);
        dma.clear();
        let ended = match ended {
            Ok(()) => {
                log::info!("client disconnected; {} {}", dma.stats(), counters.stats());
                Ok(())
            }
            Err(e) => {
                log::warn!("client connection ended: {e}");
                Err(ServerError::Client(e))
            }
        };
        if !reconnect {
            return ended;
        }
    }
}
