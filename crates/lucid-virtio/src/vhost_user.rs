//! A vhost-user front-end: a virtio device whose data path runs in another process (the
//! back-end: `qemu-storage-daemon`, `virtiofsd`, a vhost-user-net switch), reached over a Unix
//! socket. The protocol is the `vhost` crate's [`Frontend`]; this module decides what to send
//! and when.
//!
//! - Construction ([`VhostUser::new`]): connect, `GET_FEATURES`, protocol features
//!   (`GET/SET_PROTOCOL_FEATURES`), `SET_OWNER`, `GET_QUEUE_NUM` with MQ, and for blk the
//!   configuration space by `GET_CONFIG`. The features offered to the driver are the
//!   back-end's, less what the transport does not do (packed rings, ACCESS_PLATFORM, ...).
//! - DRIVER_OK ([`VirtioDevice::activate`]): `SET_FEATURES` (the driver's plus
//!   `VHOST_USER_F_PROTOCOL_FEATURES`), `SET_MEM_TABLE` with guest RAM's memfd regions, then per
//!   enabled queue `SET_VRING_NUM`, `SET_VRING_ADDR` (Lucid's addresses of the rings),
//!   `SET_VRING_BASE`, `SET_VRING_CALL`, `SET_VRING_KICK`, `SET_VRING_ENABLE`. The kick is the
//!   queue's kick eventfd, which the transport registers as the notify ioeventfd; the call is the
//!   irqfd of the queue's MSI-X vector. So a request goes guest → KVM → back-end → KVM → guest
//!   with no Lucid thread in between.
//! - Reset: `SET_VRING_ENABLE 0` and `GET_VRING_BASE` per queue (the back-end stops the ring).
//! - A watcher thread, `lucid-<name>-vu`, started with the device, waits for the socket to
//!   close: a dead back-end is logged, counted (`disconnects`), and the device asks the driver
//!   for a reset (`DEVICE_NEEDS_RESET`); the VM goes on. A back-end that leaves a message
//!   unanswered for [`REPLY_TIMEOUT`] is treated the same (the watcher shuts the socket down,
//!   which fails the waiting call: the vhost crate's reads retry timeouts forever). It also
//!   relays calls when a queue has no irqfd (rung L0, or INTx).
//!
//! Guest RAM must be a shared memfd (`--backing memfd`): the back-end maps it. Behind a vIOMMU
//! the back-end would need the IOTLB protocol, which Lucid does not speak: the configuration
//! refuses that combination.
//!
//! Counters, under `vhost_user.<name>.`: `connected` (1 while the socket is up), `disconnects`,
//! `activations`, `mem_table_updates`, `vrings_set_up`, `vrings_stopped`, `config_reads`,
//! `calls_relayed`, `errors` (messages that failed).

use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lucid_seccomp::Role;
use lucid_stats::{Counter, StatsRegistry, ThreadRole};
use lucid_thread::{Spawner, ThreadSpec};
use vhost::vhost_user::message::VhostUserConfigFlags;
use vhost::vhost_user::{
    Frontend, VhostUserFrontend, VhostUserProtocolFeatures, VhostUserVirtioFeatures,
};
use vhost::{VhostBackend, VhostUserMemoryRegionInfo, VringConfigData};
use virtio_queue::QueueT;
use vm_memory::{GuestAddress, GuestMemoryBackend, GuestMemoryRegion};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::features::{VIRTIO_F_VERSION_1, VIRTIO_RING_F_EVENT_IDX, VIRTIO_RING_F_INDIRECT_DESC};
use crate::{device_type, ActivateContext, ActivateError, VirtioDevice, VirtioInterrupt};

/// Most queues a vhost-user device has here (the transport's MSI-X table bounds it too).
pub const MAX_QUEUES: u16 = 16;
/// The largest queue size offered.
pub const MAX_QUEUE_SIZE: u16 = 1024;
/// How long a message may wait for the back-end's reply: a back-end that stops answering
/// fails the request instead of holding the thread that sent it (a vCPU, at DRIVER_OK).
pub const REPLY_TIMEOUT: Duration = Duration::from_secs(5);
/// virtio-fs: the tag's bytes in the configuration space.
pub const FS_TAG_LEN: usize = 36;
/// virtio-fs's device type (virtio 1.2, 5.11).
const FS_DEVICE_TYPE: u32 = 26;
/// virtio-blk's configuration space, as far as `num_queues` (offset 34) and what follows it.
const BLK_CONFIG_LEN: u32 = 60;
const BLK_NUM_QUEUES_OFFSET: usize = 34;
const VIRTIO_BLK_F_MQ: u64 = 1 << 12;
const VIRTIO_NET_F_MAC: u64 = 1 << 5;
const VIRTIO_NET_F_STATUS: u64 = 1 << 16;
const VIRTIO_NET_F_MQ: u64 = 1 << 22;

/// What the device is to the guest.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum VhostUserKind {
    /// virtio-blk (type 2); its configuration space comes from the back-end (`GET_CONFIG`).
    Blk,
    /// virtio-fs (type 26): queue 0 is the high-priority queue, the rest request queues.
    Fs { tag: String },
    /// virtio-net (type 1): rx/tx pairs.
    Net { mac: [u8; 6] },
}

/// A vhost-user device's configuration.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct VhostUserConfig {
    pub kind: VhostUserKind,
    /// The back-end's listening socket.
    pub socket: PathBuf,
    /// Queues the device has (virtio-fs: request queues, plus the high-priority one).
    pub num_queues: u16,
    pub queue_size: u16,
}

impl VhostUserConfig {
    /// The virtio queues the device exposes.
    pub fn queues(&self) -> u16 {
        match self.kind {
            VhostUserKind::Fs { .. } => self.num_queues + 1,
            _ => self.num_queues,
        }
    }

    pub fn device_type(&self) -> u32 {
        match self.kind {
            VhostUserKind::Blk => device_type::BLOCK,
            VhostUserKind::Fs { .. } => FS_DEVICE_TYPE,
            VhostUserKind::Net { .. } => device_type::NET,
        }
    }
}

/// Why a vhost-user device could not be made or started.
#[derive(Debug, thiserror::Error)]
pub enum VhostUserError {
    #[error("{device}: cannot connect to the vhost-user back-end at {socket}: {source}")]
    Connect {
        device: String,
        socket: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{device}: vhost-user {step} failed: {source}")]
    Message {
        device: String,
        step: &'static str,
        #[source]
        source: vhost::Error,
    },
    #[error("{device}: the back-end offers {offered} queues, the device needs {needed}")]
    Queues {
        device: String,
        offered: u64,
        needed: u16,
    },
    #[error("{device}: the back-end lacks {what}")]
    Lacks { device: String, what: &'static str },
    #[error(
        "{device}: guest RAM at {gpa:#x} is not shared with the back-end: run with \
         --backing memfd (REST: memory.shared=true)"
    )]
    NotShared { device: String, gpa: u64 },
    #[error("{device}: queue {queue}: its rings are not in guest RAM")]
    Rings { device: String, queue: u16 },
    #[error("{device}: cannot make a call eventfd: {source}")]
    EventFd {
        device: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{device}: the vhost-user back-end is gone (socket closed)")]
    Dead { device: String },
}

struct Counters {
    connected: Arc<Counter>,
    disconnects: Arc<Counter>,
    activations: Arc<Counter>,
    mem_table_updates: Arc<Counter>,
    vrings_set_up: Arc<Counter>,
    vrings_stopped: Arc<Counter>,
    config_reads: Arc<Counter>,
    calls_relayed: Arc<Counter>,
    errors: Arc<Counter>,
}

impl Counters {
    fn new(name: &str, stats: &StatsRegistry) -> Self {
        let c = |n: &str| stats.counter(format!("vhost_user.{name}.{n}"));
        Counters {
            connected: c("connected"),
            disconnects: c("disconnects"),
            activations: c("activations"),
            mem_table_updates: c("mem_table_updates"),
            vrings_set_up: c("vrings_set_up"),
            vrings_stopped: c("vrings_stopped"),
            config_reads: c("config_reads"),
            calls_relayed: c("calls_relayed"),
            errors: c("errors"),
        }
    }
}

/// What the watcher and the device share.
struct Shared {
    name: String,
    dead: AtomicBool,
    counters: Counters,
    /// The driver's interrupt, to ask for a reset when the back-end dies.
    interrupt: Mutex<Option<Arc<dyn VirtioInterrupt>>>,
    /// Calls the watcher relays (queues without an irqfd), for the current activation.
    relayed: Mutex<Vec<(u16, EventFd)>>,
    /// When the message in flight was sent, in ms since `epoch` (0: none in flight).
    busy_since_ms: AtomicU64,
    epoch: Instant,
}

impl Shared {
    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64 + 1
    }

    /// The back-end is gone: said once, counted once.
    fn died(&self) {
        if self.dead.swap(true, Ordering::AcqRel) {
            return;
        }
        self.counters.connected.set(0);
        self.counters.disconnects.inc();
        log::error!(
            "{}: the vhost-user back-end closed its socket; the device needs a reset and \
             the rest of the VM goes on",
            self.name
        );
        let irq = self
            .interrupt
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        if let Some(irq) = irq {
            irq.signal_config();
        }
    }
}

/// A vhost-user virtio device.
pub struct VhostUser {
    cfg: VhostUserConfig,
    shared: Arc<Shared>,
    frontend: Frontend,
    /// The back-end's virtio features (with `VHOST_USER_F_PROTOCOL_FEATURES`).
    backend_features: u64,
    protocol: VhostUserProtocolFeatures,
    offered: u64,
    queue_sizes: Vec<u16>,
    config: Vec<u8>,
    /// Queues handed to the back-end by the last activation.
    active: Vec<u16>,
    activated: bool,
    watcher: Option<lucid_thread::Background>,
}

impl VhostUser {
    /// Connects to the back-end and negotiates what can be before the driver comes.
    pub fn new(
        name: String,
        cfg: VhostUserConfig,
        stats: &StatsRegistry,
        spawner: &Spawner,
    ) -> Result<Self, VhostUserError> {
        let queues = cfg.queues();
        let sock = connect(&cfg.socket).map_err(|source| VhostUserError::Connect {
            device: name.clone(),
            socket: cfg.socket.clone(),
            source,
        })?;
        let shared = Arc::new(Shared {
            name: name.clone(),
            dead: AtomicBool::new(false),
            counters: Counters::new(&name, stats),
            interrupt: Mutex::new(None),
            relayed: Mutex::new(Vec::new()),
            // Busy from the start: the negotiation below is messages too.
            busy_since_ms: AtomicU64::new(1),
            epoch: Instant::now(),
        });
        let socket = sock.as_raw_fd();
        let mut frontend = Frontend::from_stream(sock, u64::from(queues));
        // Declared after `frontend`, so dropped (stopped) before the socket closes.
        let watcher = {
            let shared = shared.clone();
            let spec =
                ThreadSpec::new(format!("lucid-{name}-vu"), ThreadRole::Other, Role::Backend);
            spawner
                .spawn_background(spec, move |confined, stop| {
                    if let Err(e) = confined {
                        log::error!("{}: vhost-user watcher not started: {e}", shared.name);
                        return;
                    }
                    watch(&shared, socket, stop);
                })
                .map_err(|e| VhostUserError::Connect {
                    device: name.clone(),
                    socket: cfg.socket.clone(),
                    source: std::io::Error::other(e),
                })?
        };
        let counters = &shared.counters;
        let msg = |step| {
            let device = name.clone();
            move |source| VhostUserError::Message {
                device,
                step,
                source,
            }
        };
        let backend_features = frontend.get_features().map_err(msg("GET_FEATURES"))?;
        let mut protocol = VhostUserProtocolFeatures::empty();
        if backend_features & VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits() != 0 {
            let theirs = frontend
                .get_protocol_features()
                .map_err(msg("GET_PROTOCOL_FEATURES"))?;
            protocol = theirs & (VhostUserProtocolFeatures::MQ | VhostUserProtocolFeatures::CONFIG);
            frontend
                .set_protocol_features(protocol)
                .map_err(msg("SET_PROTOCOL_FEATURES"))?;
        }
        frontend.set_owner().map_err(msg("SET_OWNER"))?;
        if protocol.contains(VhostUserProtocolFeatures::MQ) {
            let offered = frontend.get_queue_num().map_err(msg("GET_QUEUE_NUM"))?;
            if offered < u64::from(queues) {
                return Err(VhostUserError::Queues {
                    device: name,
                    offered,
                    needed: queues,
                });
            }
        }
        // What Lucid's transport and queues do: split rings, no ACCESS_PLATFORM, no packed
        // rings, notification data or queue reset; the device's own bits (0..24) pass.
        let mut offered = backend_features
            & (0xff_ffff
                | VIRTIO_RING_F_INDIRECT_DESC
                | VIRTIO_RING_F_EVENT_IDX
                | VIRTIO_F_VERSION_1);
        let config = match &cfg.kind {
            VhostUserKind::Blk => {
                if !protocol.contains(VhostUserProtocolFeatures::CONFIG) {
                    return Err(VhostUserError::Lacks {
                        device: name,
                        what: "the CONFIG protocol feature (a vhost-user-blk needs GET_CONFIG)",
                    });
                }
                let buf = vec![0u8; BLK_CONFIG_LEN as usize];
                let (_, mut config) = frontend
                    .get_config(0, BLK_CONFIG_LEN, VhostUserConfigFlags::WRITABLE, &buf)
                    .map_err(msg("GET_CONFIG"))?;
                counters.config_reads.inc();
                if queues > 1 {
                    if offered & VIRTIO_BLK_F_MQ == 0 {
                        return Err(VhostUserError::Lacks {
                            device: name,
                            what: "VIRTIO_BLK_F_MQ (num_queues above 1)",
                        });
                    }
                    config[BLK_NUM_QUEUES_OFFSET..BLK_NUM_QUEUES_OFFSET + 2]
                        .copy_from_slice(&queues.to_le_bytes());
                } else {
                    offered &= !VIRTIO_BLK_F_MQ;
                }
                config
            }
            VhostUserKind::Fs { tag } => {
                let mut config = vec![0u8; FS_TAG_LEN + 4];
                config[..tag.len().min(FS_TAG_LEN)]
                    .copy_from_slice(&tag.as_bytes()[..tag.len().min(FS_TAG_LEN)]);
                config[FS_TAG_LEN..].copy_from_slice(&u32::from(cfg.num_queues).to_le_bytes());
                config
            }
            VhostUserKind::Net { mac } => {
                // mac, status (link up), max_virtqueue_pairs.
                let mut config = mac.to_vec();
                config.extend_from_slice(&1u16.to_le_bytes());
                config.extend_from_slice(&(queues / 2).max(1).to_le_bytes());
                offered |= VIRTIO_NET_F_MAC;
                offered &= !VIRTIO_NET_F_STATUS;
                if queues <= 2 {
                    offered &= !VIRTIO_NET_F_MQ;
                }
                config
            }
        };
        shared.busy_since_ms.store(0, Ordering::Release);
        counters.connected.set(1);
        log::info!(
            "{name}: vhost-user back-end at {} (features {backend_features:#x}, protocol \
             features {:#x}), {queues} queue(s) of {}",
            cfg.socket.display(),
            protocol.bits(),
            cfg.queue_size
        );
        Ok(VhostUser {
            queue_sizes: vec![cfg.queue_size; queues as usize],
            shared,
            cfg,
            frontend,
            backend_features,
            protocol,
            offered,
            config,
            active: Vec::new(),
            activated: false,
            watcher: Some(watcher),
        })
    }

    fn name(&self) -> &str {
        &self.shared.name
    }

    fn failed(&self, step: &'static str) -> impl FnOnce(vhost::Error) -> VhostUserError + '_ {
        move |source| {
            self.shared.counters.errors.inc();
            VhostUserError::Message {
                device: self.name().to_string(),
                step,
                source,
            }
        }
    }

    /// Runs `f`, a message exchange, under the watcher's reply deadline.
    fn guarded<T>(&mut self, f: impl FnOnce(&mut Self) -> T) -> T {
        let now = self.shared.now_ms();
        self.shared.busy_since_ms.store(now, Ordering::Release);
        let out = f(self);
        self.shared.busy_since_ms.store(0, Ordering::Release);
        out
    }

    /// The setup DRIVER_OK asks for; returns the queues that need their calls relayed.
    fn set_up(&mut self, ctx: &ActivateContext) -> Result<Vec<(u16, EventFd)>, VhostUserError> {
        let name = self.name().to_string();
        if self.shared.dead.load(Ordering::Acquire) {
            return Err(VhostUserError::Dead { device: name });
        }
        let features = ctx.features
            | (self.backend_features & VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits());
        self.frontend
            .set_features(features)
            .map_err(self.failed("SET_FEATURES"))?;
        let mem = ctx.mem.dma().memory();
        let mut regions = Vec::new();
        for r in mem.iter() {
            let info = VhostUserMemoryRegionInfo::from_guest_region(r).map_err(|_| {
                VhostUserError::NotShared {
                    device: name.clone(),
                    gpa: r.start_addr().0,
                }
            })?;
            regions.push(info);
        }
        self.frontend
            .set_mem_table(&regions)
            .map_err(self.failed("SET_MEM_TABLE"))?;
        self.shared.counters.mem_table_updates.inc();
        let host = |a: GuestAddress, queue: u16| {
            mem.get_host_address(a)
                .map(|p| p as u64)
                .map_err(|_| VhostUserError::Rings {
                    device: name.clone(),
                    queue,
                })
        };
        let mut relayed = Vec::new();
        for (index, queue, kick) in &ctx.queues {
            let (index, i) = (*index, usize::from(*index));
            let addrs = VringConfigData {
                queue_max_size: queue.max_size(),
                queue_size: queue.size(),
                flags: 0,
                desc_table_addr: host(GuestAddress(queue.desc_table()), index)?,
                used_ring_addr: host(GuestAddress(queue.used_ring()), index)?,
                avail_ring_addr: host(GuestAddress(queue.avail_ring()), index)?,
                log_addr: None,
            };
            self.frontend
                .set_vring_num(i, queue.size())
                .map_err(self.failed("SET_VRING_NUM"))?;
            self.frontend
                .set_vring_addr(i, &addrs)
                .map_err(self.failed("SET_VRING_ADDR"))?;
            self.frontend
                .set_vring_base(i, queue.next_avail())
                .map_err(self.failed("SET_VRING_BASE"))?;
            let call = match ctx.interrupt.queue_irqfd(index) {
                Some(irqfd) => irqfd,
                None => {
                    // No irqfd for this queue's vector: the watcher relays the calls.
                    let call = EventFd::new(EFD_NONBLOCK)
                        .and_then(|c| Ok((c.try_clone()?, c)))
                        .map_err(|source| VhostUserError::EventFd {
                            device: name.clone(),
                            source,
                        })?;
                    relayed.push((index, call.1));
                    call.0
                }
            };
            self.frontend
                .set_vring_call(i, &call)
                .map_err(self.failed("SET_VRING_CALL"))?;
            self.frontend
                .set_vring_kick(i, kick)
                .map_err(self.failed("SET_VRING_KICK"))?;
            if features & VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits() != 0 {
                self.frontend
                    .set_vring_enable(i, true)
                    .map_err(self.failed("SET_VRING_ENABLE"))?;
            }
            self.active.push(index);
            self.shared.counters.vrings_set_up.inc();
        }
        Ok(relayed)
    }

    /// Stops the back-end's rings (a reset, or a failed activation).
    fn stop_vrings(&mut self) {
        let active = std::mem::take(&mut self.active);
        if self.shared.dead.load(Ordering::Acquire) {
            return;
        }
        let protocol = self.backend_features & VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits();
        for q in active {
            let i = usize::from(q);
            let mut ok = protocol == 0 || self.frontend.set_vring_enable(i, false).is_ok();
            ok &= self.frontend.get_vring_base(i).is_ok();
            if ok {
                self.shared.counters.vrings_stopped.inc();
            } else {
                self.shared.counters.errors.inc();
                log::warn!(
                    "{}: queue {q}: the back-end did not stop its ring",
                    self.name()
                );
            }
        }
    }
}

/// Dials `socket`, retrying briefly while the back-end starts listening.
fn connect(socket: &std::path::Path) -> std::io::Result<UnixStream> {
    let mut tries = 0;
    let sock = loop {
        match UnixStream::connect(socket) {
            Ok(s) => break s,
            Err(e)
                if tries < 20
                    && matches!(
                        e.kind(),
                        std::io::ErrorKind::ConnectionRefused | std::io::ErrorKind::NotFound
                    ) =>
            {
                tries += 1;
                std::thread::sleep(Duration::from_millis(100));
            }
            Err(e) => return Err(e),
        }
    };
    Ok(sock)
}

/// The watcher's loop: waits for the socket to close, shuts it down when a reply is overdue,
/// relays calls that have no irqfd.
fn watch(shared: &Shared, socket: RawFd, stop: &AtomicBool) {
    let lock = |m: &'_ Mutex<Vec<(u16, EventFd)>>| {
        m.lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .map(|(q, e)| (*q, e.as_raw_fd()))
            .collect::<Vec<_>>()
    };
    let mut gone = false;
    while !stop.load(Ordering::Acquire) {
        let relayed = lock(&shared.relayed);
        let mut fds: Vec<libc::pollfd> = std::iter::once(libc::pollfd {
            fd: socket,
            events: if gone { 0 } else { libc::POLLRDHUP },
            revents: 0,
        })
        .chain(relayed.iter().map(|&(_, fd)| libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        }))
        .collect();
        // SAFETY: `fds` is a valid array of `fds.len()` pollfd structures that outlives the
        // call; the socket stays open while the watcher runs (the device stops it before it
        // closes the socket), and an eventfd closed meanwhile only makes poll report POLLNVAL.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, 100) };
        let since = shared.busy_since_ms.load(Ordering::Acquire);
        if !gone && since != 0 && shared.now_ms() - since > REPLY_TIMEOUT.as_millis() as u64 {
            log::error!(
                "{}: the vhost-user back-end left a message unanswered for {:?}: Lucid closes \
                 the connection",
                shared.name,
                REPLY_TIMEOUT
            );
            // SAFETY: shutdown(2) on a socket descriptor the device owns; the blocked reader
            // then sees end-of-file.
            unsafe { libc::shutdown(socket, libc::SHUT_RDWR) };
        }
        if n <= 0 {
            continue;
        }
        if !gone && fds[0].revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0 {
            shared.died();
            gone = true;
        }
        for (pfd, &(q, fd)) in fds[1..].iter().zip(&relayed) {
            let mut v = 0u64;
            // SAFETY: reads 8 bytes into `v` from an eventfd the device keeps open.
            let read = pfd.revents & libc::POLLIN != 0
                && unsafe { libc::read(fd, (&mut v as *mut u64).cast(), 8) } == 8;
            if read {
                shared.counters.calls_relayed.inc();
                let irq = shared
                    .interrupt
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .clone();
                if let Some(irq) = irq {
                    irq.signal_queue(q);
                }
            }
        }
    }
}

impl VirtioDevice for VhostUser {
    fn name(&self) -> &str {
        &self.shared.name
    }

    fn device_type(&self) -> u32 {
        self.cfg.device_type()
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &self.queue_sizes
    }

    fn features(&self) -> u64 {
        self.offered
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        data.fill(0);
        let Ok(off) = usize::try_from(offset) else {
            return;
        };
        if let Some(src) = self.config.get(off..) {
            let n = src.len().min(data.len());
            data[..n].copy_from_slice(&src[..n]);
        }
    }

    fn write_config(&mut self, offset: u64, data: &[u8]) {
        // Only blk's writeback flag is writable; the back-end keeps its own copy.
        if self.cfg.kind == VhostUserKind::Blk
            && self.protocol.contains(VhostUserProtocolFeatures::CONFIG)
            && !self.shared.dead.load(Ordering::Acquire)
        {
            let Ok(off) = u32::try_from(offset) else {
                return;
            };
            if self
                .frontend
                .set_config(off, VhostUserConfigFlags::WRITABLE, data)
                .is_err()
            {
                self.shared.counters.errors.inc();
            }
        }
    }

    fn activate(&mut self, ctx: ActivateContext) -> Result<(), ActivateError> {
        if self.activated {
            return Err(ActivateError::AlreadyActive {
                device: self.name().to_string(),
            });
        }
        *self
            .shared
            .interrupt
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = Some(ctx.interrupt.clone());
        match self.guarded(|d| d.set_up(&ctx)) {
            Ok(relayed) => {
                *self
                    .shared
                    .relayed
                    .lock()
                    .unwrap_or_else(|e| e.into_inner()) = relayed;
            }
            Err(e) => {
                self.guarded(Self::stop_vrings);
                return Err(ActivateError::VhostUser(Box::new(e)));
            }
        }
        self.activated = true;
        self.shared.counters.activations.inc();
        Ok(())
    }

    fn reset(&mut self) {
        self.guarded(Self::stop_vrings);
        self.shared
            .relayed
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
        self.activated = false;
    }

    fn needs_reset(&self) -> bool {
        self.shared.dead.load(Ordering::Acquire)
    }
}

impl Drop for VhostUser {
    fn drop(&mut self) {
        // Before the socket closes with the device (the back-end sees the front-end leave).
        if let Some(mut w) = self.watcher.take() {
            w.stop();
        }
    }
}
