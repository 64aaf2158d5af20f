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
//!   close: a lost back-end is logged and counted (`disconnects`). A back-end that leaves a
//!   message unanswered for [`REPLY_TIMEOUT`] is treated the same (the watcher shuts the socket
//!   down, which fails the waiting call: the vhost crate's reads retry timeouts forever). It
//!   also relays calls when a queue has no irqfd (rung L0, or INTx).
//! - Reconnection: a thread started with the device, `lucid-<name>-rc` (seccomp role
//!   `vhost-user`: a Unix stream socket, `connect`, and the messages), re-dials the same path
//!   every [`RECONNECT_EVERY`] for [`RECONNECT_FOR`] and replays the set-up on the new
//!   back-end: the negotiation, and when the device is active `SET_FEATURES` with the features
//!   the driver acked, `SET_MEM_TABLE`, and per ring its size, addresses, eventfds and as base
//!   the used ring's index read from guest memory (requests the old back-end had taken but not
//!   completed are taken again). A new back-end that lacks an acked feature, or none within
//!   the bound, leaves the device asking the driver for a reset (`DEVICE_NEEDS_RESET`); the VM
//!   goes on.
//!
//! Guest RAM must be a shared memfd (`--backing memfd`): the back-end maps it. Behind a vIOMMU
//! the back-end would need the IOTLB protocol, which Lucid does not speak: the configuration
//! refuses that combination.
//!
//! Counters, under `vhost_user.<name>.`: `connected` (1 while the socket is up), `disconnects`,
//! `activations`, `mem_table_updates`, `vrings_set_up`, `vrings_stopped`, `config_reads`,
//! `calls_relayed`, `errors` (messages that failed), `reconnects`, `reconnect_failures`.

use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use lucid_mem::DeviceMemory;
use lucid_seccomp::Role;
use lucid_stats::{Counter, StatsRegistry, ThreadRole};
use lucid_thread::{Spawner, ThreadSpec};
use vhost::vhost_user::message::VhostUserConfigFlags;
use vhost::vhost_user::{
    Frontend, VhostUserFrontend, VhostUserProtocolFeatures, VhostUserVirtioFeatures,
};
use vhost::{VhostBackend, VhostUserMemoryRegionInfo, VringConfigData};
use virtio_queue::QueueT;
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryRegion};
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
/// How often a lost back-end's socket is dialled again.
pub const RECONNECT_EVERY: Duration = Duration::from_millis(100);
/// How long a lost back-end is waited for before the device asks for a reset.
pub const RECONNECT_FOR: Duration = Duration::from_secs(10);
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
    #[error(
        "{device}: the reconnected vhost-user back-end lacks {what} {missing:#x}, which the \
         driver acked"
    )]
    LacksAcked {
        device: String,
        what: &'static str,
        missing: u64,
    },
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
    reconnects: Arc<Counter>,
    reconnect_failures: Arc<Counter>,
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
            reconnects: c("reconnects"),
            reconnect_failures: c("reconnect_failures"),
        }
    }
}

/// A ring handed to the back-end, as the reconnect thread hands it to the next one.
struct Vring {
    index: u16,
    size: u16,
    addrs: VringConfigData,
    used_ring: GuestAddress,
    kick: EventFd,
    call: EventFd,
}

/// What an activation told the back-end.
struct Replay {
    /// What `SET_FEATURES` said (with `VHOST_USER_F_PROTOCOL_FEATURES` when negotiated).
    features: u64,
    mem: DeviceMemory,
    vrings: Vec<Vring>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// What the watcher, the reconnect thread and the device share.
struct Shared {
    name: String,
    socket_path: PathBuf,
    queues: u64,
    frontend: Mutex<Frontend>,
    /// The connected socket's descriptor, for the watcher.
    socket: AtomicI32,
    /// The socket closed; the reconnect thread dials again.
    down: AtomicBool,
    /// Given up: the device needs a reset.
    dead: AtomicBool,
    /// The back-end's features and protocol features at construction, and what the device
    /// offers the driver (a new back-end must have these).
    backend_features: AtomicU64,
    protocol: AtomicU64,
    offered: AtomicU64,
    /// The active set-up, for a reconnection to replay.
    replay: Mutex<Option<Replay>>,
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

    /// The socket closed: said once, counted once per connection.
    fn lost(&self) {
        if self.down.swap(true, Ordering::AcqRel) {
            return;
        }
        self.counters.connected.set(0);
        self.counters.disconnects.inc();
        log::error!(
            "{}: the vhost-user back-end closed its socket; Lucid dials {} again for {:?}",
            self.name,
            self.socket_path.display(),
            RECONNECT_FOR
        );
    }

    /// Given up on the back-end: the device needs a reset.
    fn died(&self, why: &str) {
        if self.dead.swap(true, Ordering::AcqRel) {
            return;
        }
        self.counters.connected.set(0);
        log::error!(
            "{}: {why}; the device needs a reset and the rest of the VM goes on",
            self.name
        );
        let irq = lock(&self.interrupt).clone();
        if let Some(irq) = irq {
            irq.signal_config();
        }
    }

    fn unusable(&self) -> bool {
        self.dead.load(Ordering::Acquire) || self.down.load(Ordering::Acquire)
    }
}

/// A vhost-user virtio device.
pub struct VhostUser {
    cfg: VhostUserConfig,
    shared: Arc<Shared>,
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
    reconnector: Option<lucid_thread::Background>,
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
        let socket = sock.as_raw_fd();
        let mut frontend = Frontend::from_stream(sock, u64::from(queues));
        let shared = Arc::new(Shared {
            name: name.clone(),
            socket_path: cfg.socket.clone(),
            queues: u64::from(queues),
            // A handle on the same connection: the device and the reconnect thread message
            // through this one.
            frontend: Mutex::new(frontend.clone()),
            socket: AtomicI32::new(socket),
            down: AtomicBool::new(false),
            dead: AtomicBool::new(false),
            backend_features: AtomicU64::new(0),
            protocol: AtomicU64::new(0),
            offered: AtomicU64::new(0),
            replay: Mutex::new(None),
            counters: Counters::new(&name, stats),
            interrupt: Mutex::new(None),
            relayed: Mutex::new(Vec::new()),
            // Busy from the start: the negotiation below is messages too.
            busy_since_ms: AtomicU64::new(1),
            epoch: Instant::now(),
        });
        // Stopped by the device's drop, before the socket closes.
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
                    watch(&shared, stop);
                })
                .map_err(|e| VhostUserError::Connect {
                    device: name.clone(),
                    socket: cfg.socket.clone(),
                    source: std::io::Error::other(e),
                })?
        };
        // Started here, with its own filter: a thread started by a vCPU would stack the
        // vCPU's filter on it, which forbids the socket.
        let reconnector = {
            let shared = shared.clone();
            let spec = ThreadSpec::new(
                format!("lucid-{name}-rc"),
                ThreadRole::Other,
                Role::VhostUser,
            );
            spawner
                .spawn_background(spec, move |confined, stop| {
                    if let Err(e) = confined {
                        log::error!(
                            "{}: vhost-user reconnect thread not started: {e}",
                            shared.name
                        );
                        return;
                    }
                    reconnect_loop(&shared, stop);
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
        shared
            .backend_features
            .store(backend_features, Ordering::Release);
        shared.protocol.store(protocol.bits(), Ordering::Release);
        shared.offered.store(offered, Ordering::Release);
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
            backend_features,
            protocol,
            offered,
            config,
            active: Vec::new(),
            activated: false,
            watcher: Some(watcher),
            reconnector: Some(reconnector),
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

    /// The setup DRIVER_OK asks for; returns the queues that need their calls relayed, and
    /// what a reconnection replays.
    fn set_up(
        &mut self,
        ctx: &ActivateContext,
    ) -> Result<(Vec<(u16, EventFd)>, Replay), VhostUserError> {
        let name = self.name().to_string();
        if self.shared.unusable() {
            return Err(VhostUserError::Dead { device: name });
        }
        let features = ctx.features
            | (self.backend_features & VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits());
        let shared = self.shared.clone();
        let mut fe = lock(&shared.frontend);
        fe.set_features(features)
            .map_err(self.failed("SET_FEATURES"))?;
        let (step, e) = match set_mem_table(&mut fe, &ctx.mem, &name) {
            Ok(()) => (None, None),
            Err(MemTableError::Setup(e)) => return Err(e),
            Err(MemTableError::Message(e)) => (Some("SET_MEM_TABLE"), Some(e)),
        };
        if let (Some(step), Some(e)) = (step, e) {
            return Err(self.failed(step)(e));
        }
        self.shared.counters.mem_table_updates.inc();
        let mem = ctx.mem.dma().memory();
        let host = |a: GuestAddress, queue: u16| {
            mem.get_host_address(a)
                .map(|p| p as u64)
                .map_err(|_| VhostUserError::Rings {
                    device: name.clone(),
                    queue,
                })
        };
        let eventfd_err = |source| VhostUserError::EventFd {
            device: name.clone(),
            source,
        };
        let enable = features & VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits() != 0;
        let mut relayed = Vec::new();
        let mut vrings = Vec::new();
        for (index, queue, kick) in &ctx.queues {
            let index = *index;
            let addrs = VringConfigData {
                queue_max_size: queue.max_size(),
                queue_size: queue.size(),
                flags: 0,
                desc_table_addr: host(GuestAddress(queue.desc_table()), index)?,
                used_ring_addr: host(GuestAddress(queue.used_ring()), index)?,
                avail_ring_addr: host(GuestAddress(queue.avail_ring()), index)?,
                log_addr: None,
            };
            let call = match ctx.interrupt.queue_irqfd(index) {
                Some(irqfd) => irqfd,
                None => {
                    // No irqfd for this queue's vector: the watcher relays the calls.
                    let call = EventFd::new(EFD_NONBLOCK)
                        .and_then(|c| Ok((c.try_clone()?, c)))
                        .map_err(eventfd_err)?;
                    relayed.push((index, call.1));
                    call.0
                }
            };
            let vring = Vring {
                index,
                size: queue.size(),
                addrs,
                used_ring: GuestAddress(queue.used_ring()),
                kick: kick.try_clone().map_err(eventfd_err)?,
                call,
            };
            if let Err((step, e)) = set_vring(&mut fe, &vring, queue.next_avail(), enable) {
                return Err(self.failed(step)(e));
            }
            self.active.push(index);
            self.shared.counters.vrings_set_up.inc();
            vrings.push(vring);
        }
        Ok((
            relayed,
            Replay {
                features,
                mem: ctx.mem.clone(),
                vrings,
            },
        ))
    }

    /// Stops the back-end's rings (a reset, or a failed activation).
    fn stop_vrings(&mut self) {
        let active = std::mem::take(&mut self.active);
        if self.shared.unusable() {
            return;
        }
        let protocol = self.backend_features & VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits();
        let shared = self.shared.clone();
        let mut fe = lock(&shared.frontend);
        for q in active {
            let i = usize::from(q);
            let mut ok = protocol == 0 || fe.set_vring_enable(i, false).is_ok();
            ok &= fe.get_vring_base(i).is_ok();
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

enum MemTableError {
    Setup(VhostUserError),
    Message(vhost::Error),
}

/// `SET_MEM_TABLE` with guest RAM's memfd regions.
fn set_mem_table(fe: &mut Frontend, dm: &DeviceMemory, name: &str) -> Result<(), MemTableError> {
    let mem = dm.dma().memory();
    let mut regions = Vec::new();
    for r in mem.iter() {
        let info = VhostUserMemoryRegionInfo::from_guest_region(r).map_err(|_| {
            MemTableError::Setup(VhostUserError::NotShared {
                device: name.to_string(),
                gpa: r.start_addr().0,
            })
        })?;
        regions.push(info);
    }
    fe.set_mem_table(&regions)
        .map(|_| ())
        .map_err(MemTableError::Message)
}

/// Hands a ring to the back-end, starting at `base`.
fn set_vring(
    fe: &mut Frontend,
    v: &Vring,
    base: u16,
    enable: bool,
) -> Result<(), (&'static str, vhost::Error)> {
    let i = usize::from(v.index);
    fe.set_vring_num(i, v.size)
        .map_err(|e| ("SET_VRING_NUM", e))?;
    fe.set_vring_addr(i, &v.addrs)
        .map_err(|e| ("SET_VRING_ADDR", e))?;
    fe.set_vring_base(i, base)
        .map_err(|e| ("SET_VRING_BASE", e))?;
    fe.set_vring_call(i, &v.call)
        .map_err(|e| ("SET_VRING_CALL", e))?;
    fe.set_vring_kick(i, &v.kick)
        .map_err(|e| ("SET_VRING_KICK", e))?;
    if enable {
        fe.set_vring_enable(i, true)
            .map_err(|e| ("SET_VRING_ENABLE", e))?;
    }
    Ok(())
}

/// Why a reconnection failed: the new back-end cannot take the device's state (give up), or
/// the exchange failed (dial again).
enum ReplayError {
    GiveUp(String),
    Retry(String),
}

fn retry(step: &'static str) -> impl FnOnce(vhost::Error) -> ReplayError {
    move |e| ReplayError::Retry(format!("{step}: {e}"))
}

/// The reconnect thread: while the back-end is lost, dials its socket every
/// [`RECONNECT_EVERY`] and replays the set-up on the first that answers; gives up after
/// [`RECONNECT_FOR`].
fn reconnect_loop(shared: &Shared, stop: &AtomicBool) {
    let mut since: Option<Instant> = None;
    let mut tries = 0u64;
    while !stop.load(Ordering::Acquire) {
        std::thread::sleep(RECONNECT_EVERY);
        if !shared.down.load(Ordering::Acquire) || shared.dead.load(Ordering::Acquire) {
            since = None;
            continue;
        }
        let t0 = *since.get_or_insert_with(|| {
            tries = 0;
            Instant::now()
        });
        tries += 1;
        let why = match UnixStream::connect(&shared.socket_path) {
            Ok(sock) => match replay(shared, sock) {
                Ok(()) => {
                    shared.counters.reconnects.inc();
                    shared.counters.connected.set(1);
                    shared.down.store(false, Ordering::Release);
                    log::info!(
                        "{}: reconnected to the vhost-user back-end at {} after {:?} ({tries} \
                         dial(s))",
                        shared.name,
                        shared.socket_path.display(),
                        t0.elapsed()
                    );
                    since = None;
                    continue;
                }
                Err(ReplayError::GiveUp(why)) => {
                    shared.counters.reconnect_failures.inc();
                    shared.died(&why);
                    continue;
                }
                Err(ReplayError::Retry(why)) => why,
            },
            Err(e) => e.to_string(),
        };
        if tries % 10 == 1 {
            log::warn!(
                "{}: vhost-user back-end at {} not back yet: {why}",
                shared.name,
                shared.socket_path.display()
            );
        }
        if t0.elapsed() >= RECONNECT_FOR {
            shared.counters.reconnect_failures.inc();
            shared.died(&format!(
                "the vhost-user back-end at {} did not come back within {RECONNECT_FOR:?} \
                 ({why})",
                shared.socket_path.display()
            ));
        }
    }
}

/// Negotiates with a new back-end as with the first, then hands it the active set-up: the
/// acked features, the memory table, and each ring from the used index the guest sees.
fn replay(shared: &Shared, sock: UnixStream) -> Result<(), ReplayError> {
    let socket = sock.as_raw_fd();
    let mut fe = Frontend::from_stream(sock, shared.queues);
    // The watcher holds the new back-end to the reply deadline too.
    shared.socket.store(socket, Ordering::Release);
    shared
        .busy_since_ms
        .store(shared.now_ms(), Ordering::Release);
    let saved = lock(&shared.replay);
    let out = (|| {
        let theirs = fe.get_features().map_err(retry("GET_FEATURES"))?;
        let offered = shared.offered.load(Ordering::Acquire);
        let protocol_bit = VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits();
        let need = match &*saved {
            Some(r) => r.features,
            None => offered | (shared.backend_features.load(Ordering::Acquire) & protocol_bit),
        };
        let lacks = |what, missing| {
            ReplayError::GiveUp(
                VhostUserError::LacksAcked {
                    device: shared.name.clone(),
                    what,
                    missing,
                }
                .to_string(),
            )
        };
        if need & !theirs != 0 {
            return Err(lacks("virtio features", need & !theirs));
        }
        let protocol =
            VhostUserProtocolFeatures::from_bits_truncate(shared.protocol.load(Ordering::Acquire));
        if need & protocol_bit != 0 {
            let theirs = fe
                .get_protocol_features()
                .map_err(retry("GET_PROTOCOL_FEATURES"))?;
            if !theirs.contains(protocol) {
                return Err(lacks("protocol features", protocol.bits() & !theirs.bits()));
            }
            fe.set_protocol_features(protocol)
                .map_err(retry("SET_PROTOCOL_FEATURES"))?;
        }
        fe.set_owner().map_err(retry("SET_OWNER"))?;
        if protocol.contains(VhostUserProtocolFeatures::MQ) {
            let offered = fe.get_queue_num().map_err(retry("GET_QUEUE_NUM"))?;
            if offered < shared.queues {
                return Err(ReplayError::GiveUp(format!(
                    "the reconnected vhost-user back-end offers {offered} queues, the device \
                     has {}",
                    shared.queues
                )));
            }
        }
        let Some(r) = &*saved else {
            return Ok(());
        };
        fe.set_features(r.features).map_err(retry("SET_FEATURES"))?;
        match set_mem_table(&mut fe, &r.mem, &shared.name) {
            Ok(()) => {}
            Err(MemTableError::Setup(e)) => return Err(ReplayError::GiveUp(e.to_string())),
            Err(MemTableError::Message(e)) => return Err(retry("SET_MEM_TABLE")(e)),
        }
        shared.counters.mem_table_updates.inc();
        let mem = r.mem.dma().memory();
        for v in &r.vrings {
            // The used index: what the driver has seen completed. The old back-end's requests
            // past it are taken again by the new one.
            let used: u16 = mem
                .read_obj(GuestAddress(v.used_ring.0 + 2))
                .map_err(|e| ReplayError::GiveUp(format!("queue {}: used ring: {e}", v.index)))?;
            set_vring(&mut fe, v, used, r.features & protocol_bit != 0)
                .map_err(|(step, e)| retry(step)(e))?;
            shared.counters.vrings_set_up.inc();
            // The old back-end may have drained a kick it never acted on, and a driver waiting
            // for a completion kicks no more: the new one looks at the ring once unasked.
            let _ = v.kick.write(1);
        }
        Ok(())
    })();
    shared.busy_since_ms.store(0, Ordering::Release);
    if out.is_ok() {
        // The device's messages go to the new back-end; the old connection closes.
        *lock(&shared.frontend) = fe;
    }
    drop(saved);
    out
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
fn watch(shared: &Shared, stop: &AtomicBool) {
    let fds_of = |m: &'_ Mutex<Vec<(u16, EventFd)>>| {
        m.lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .map(|(q, e)| (*q, e.as_raw_fd()))
            .collect::<Vec<_>>()
    };
    while !stop.load(Ordering::Acquire) {
        let relayed = fds_of(&shared.relayed);
        let socket = shared.socket.load(Ordering::Acquire);
        // A lost socket is left out (poll skips negative descriptors) until a new one is up.
        let gone = shared.down.load(Ordering::Acquire) || shared.dead.load(Ordering::Acquire);
        let mut fds: Vec<libc::pollfd> = std::iter::once(libc::pollfd {
            fd: if gone { -1 } else { socket },
            events: libc::POLLRDHUP,
            revents: 0,
        })
        .chain(relayed.iter().map(|&(_, fd)| libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        }))
        .collect();
        // SAFETY: `fds` is a valid array of `fds.len()` pollfd structures that outlives the
        // call; a connected socket stays open until a reconnection replaces it, which happens
        // only once it was lost (and then it is left out), and a descriptor closed meanwhile
        // only makes poll report POLLNVAL.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, 100) };
        let since = shared.busy_since_ms.load(Ordering::Acquire);
        if since != 0 && shared.now_ms() - since > REPLY_TIMEOUT.as_millis() as u64 {
            log::error!(
                "{}: the vhost-user back-end left a message unanswered for {:?}: Lucid closes \
                 the connection",
                shared.name,
                REPLY_TIMEOUT
            );
            // SAFETY: shutdown(2) on the socket descriptor of the exchange in flight, which
            // stays open while it waits; the blocked reader then sees end-of-file.
            unsafe { libc::shutdown(socket, libc::SHUT_RDWR) };
        }
        if n <= 0 {
            continue;
        }
        if !gone && fds[0].revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0 {
            shared.lost();
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
        crate::blk::read_config_bytes(&self.config, offset, data);
    }

    fn write_config(&mut self, offset: u64, data: &[u8]) {
        // Only blk's writeback flag is writable; the back-end keeps its own copy.
        if self.cfg.kind == VhostUserKind::Blk
            && self.protocol.contains(VhostUserProtocolFeatures::CONFIG)
            && !self.shared.unusable()
        {
            let Ok(off) = u32::try_from(offset) else {
                return;
            };
            if lock(&self.shared.frontend)
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
            Ok((relayed, replay)) => {
                *lock(&self.shared.relayed) = relayed;
                *lock(&self.shared.replay) = Some(replay);
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
        *lock(&self.shared.replay) = None;
        lock(&self.shared.relayed).clear();
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
        if let Some(mut r) = self.reconnector.take() {
            r.stop();
        }
    }
}
