//! Lucid's virtio devices and the seam between a device and its transport (virtio-pci in
//! `lucid-pci`). A device sees queues, kick eventfds, an interrupt and the DMA path; it never knows
//! whether a kick came through a userspace exit or an ioeventfd, nor whether its interrupt goes out
//! by `KVM_SIGNAL_MSI` or an irqfd: that is the transport's rung of the exit ladder.
//!
//! Devices: [`blk::Block`] (raw image file), [`net::Net`] (tap, echo, sink),
//! [`balloon::Balloon`] (memory given back by the guest), [`rng::Rng`] (entropy from the
//! host's `getrandom`) and [`vsock::Vsock`] (sockets to host programs over a Unix socket). Each runs one
//! back-end thread, `lucid-<name>-io` (Linux keeps the first 15 bytes of a thread name, so keep
//! device names to 6 bytes), started by `activate` and joined by `reset`. The thread waits on the
//! kick eventfds ([`Notify::Kicks`]) or polls the avail rings with the driver's notifications
//! suppressed ([`Notify::Poll`]); it raises interrupts only when the driver asks for them
//! (`VRING_AVAIL_F_NO_INTERRUPT`, or `used_event` with EVENT_IDX) and at most as often as
//! [`Coalescing`] allows (a time cap of 0 means: flush when the device goes idle). The transport
//! must hand over queues that are `ready`, with EVENT_IDX as negotiated (the device sets it again
//! from `features`); rings are accessed on `mem` (the device's [`DeviceMemory`] view), buffer
//! data only through the DMA path: both translate through the DMA path's translator when a vIOMMU
//! is installed. A ring that cannot be accessed makes the device need a reset; a buffer that
//! cannot be is the request's error (blk: `IOERR`; net: the frame is dropped and counted in
//! `tx_dropped_fault` / `rx_dropped_fault`).
//!
//! Counters, under `<name>.`: `kicks` (kick eventfd signals consumed), `polls_found_work`,
//! `requests` (chains completed), `bytes_read` / `bytes_written` (payload the device read from /
//! wrote into guest buffers: blk writes / blk reads, net tx / net rx), `irqs` (signalled),
//! `irqs_coalesced` (completions covered by another's interrupt), `irqs_suppressed` (completions
//! for which the driver asked for none), `irqs_early` (coalescing: interrupts raised with fewer
//! than its count pending, by the time cap, at idle or at a stop), `errors`; net adds `tx_packets`, `tx_bytes`,
//! `tx_dropped`, `tx_dropped_fault`, `rx_packets`, `rx_bytes`, `rx_dropped_no_buffers`,
//! `rx_dropped_too_big`, `rx_dropped_fault`.
//! Every completion is counted in exactly one of `irqs`, `irqs_coalesced`, `irqs_suppressed`
//! once its interrupt decision is made.

use std::sync::Arc;

use lucid_mem::DeviceMemory;
use lucid_stats::StatsRegistry;
use vmm_sys_util::eventfd::EventFd;

pub use virtio_queue;

pub mod balloon;
pub mod blk;
pub mod console;
pub mod net;
pub mod rate;
pub mod rng;
pub mod vhost_user;
pub mod vsock;
mod worker;

#[doc(hidden)]
pub mod fuzz_api;

/// Feature bits every Lucid virtio device may offer (virtio 1.x).
pub mod features {
    pub const VIRTIO_F_VERSION_1: u64 = 1 << 32;
    pub const VIRTIO_F_ACCESS_PLATFORM: u64 = 1 << 33;
    pub const VIRTIO_RING_F_EVENT_IDX: u64 = 1 << 29;
    pub const VIRTIO_RING_F_INDIRECT_DESC: u64 = 1 << 28;
}

/// Device types (virtio spec 5).
pub mod device_type {
    pub const NET: u32 = 1;
    pub const BLOCK: u32 = 2;
    pub const CONSOLE: u32 = 3;
    pub const RNG: u32 = 4;
    pub const BALLOON: u32 = 5;
    pub const VSOCK: u32 = 19;
}

/// How a device's back-end thread learns of new requests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Notify {
    /// Wait on the kick eventfds (the guest notifies; the transport delivers by exit or
    /// ioeventfd).
    #[default]
    Kicks,
    /// L4: a polling back-end thread ("sidecore") watches the avail rings and keeps guest
    /// notifications suppressed; `idle_sleep_us` = 0 spins.
    Poll { idle_sleep_us: u32 },
    /// No thread: `activate` serves what the rings hold on the caller's thread and returns (the
    /// fuzz targets' mode, deterministic; a transport never asks for it).
    Inline,
}

/// Interrupt coalescing: at most one interrupt per `max_completions` used buffers, or per
/// `max_delay_us` since the first unsignalled completion, whichever comes first
/// (in the spirit of `VIRTIO_NET_F_NOTF_COAL`). `max_completions <= 1` disables it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Coalescing {
    pub max_completions: u32,
    pub max_delay_us: u32,
}

/// Raises a device's interrupts. The transport implements it (MSI-X vector per queue).
pub trait VirtioInterrupt: Send + Sync {
    /// The device put buffers in queue `queue`'s used ring.
    fn signal_queue(&self, queue: u16);
    /// The device's configuration changed.
    fn signal_config(&self);
    /// An eventfd that raises queue `queue`'s interrupt without a VMM thread (the irqfd of its
    /// MSI-X vector), for a back-end in another process; `None` when there is none.
    fn queue_irqfd(&self, _queue: u16) -> Option<EventFd> {
        None
    }
}

/// Everything a device gets when the driver sets DRIVER_OK.
pub struct ActivateContext {
    /// The device's view of memory (IOVAs when the DMA path has a translator): the rings, for
    /// virtio-queue, and through `mem.dma()` with requester `mem.device()` the buffer data.
    pub mem: DeviceMemory,
    /// One per queue the driver enabled, with its kick eventfd.
    pub queues: Vec<(u16, virtio_queue::Queue, EventFd)>,
    pub interrupt: Arc<dyn VirtioInterrupt>,
    /// Negotiated features.
    pub features: u64,
    pub notify: Notify,
    pub coalescing: Coalescing,
    pub stats: Arc<StatsRegistry>,
    /// Starts the device's back-end thread.
    pub spawner: lucid_thread::Spawner,
}

/// Why a device refused DRIVER_OK.
#[derive(Debug, thiserror::Error)]
pub enum ActivateError {
    #[error("{device}: activated twice without a reset")]
    AlreadyActive { device: String },
    #[error("{device}: the driver enabled no queue {queue}, which the device needs")]
    QueueMissing { device: String, queue: u16 },
    #[error("{device}: queue {queue} is not ready or its rings are outside guest memory")]
    QueueInvalid { device: String, queue: u16 },
    #[error("{device}: cannot start the back-end thread: {source}")]
    Thread {
        device: String,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Spawn(#[from] lucid_thread::SpawnError),
    #[error(transparent)]
    VhostUser(Box<vhost_user::VhostUserError>),
}

/// A virtio device, transport-independent.
pub trait VirtioDevice: Send {
    /// Short name for counters and threads, e.g. `blk0`.
    fn name(&self) -> &str;
    fn device_type(&self) -> u32;
    /// Maximum size of each queue; its length is the number of queues.
    fn queue_max_sizes(&self) -> &[u16];
    /// Feature bits offered.
    fn features(&self) -> u64;
    /// Device-specific configuration space.
    fn read_config(&self, offset: u64, data: &mut [u8]);
    fn write_config(&mut self, offset: u64, data: &[u8]);
    /// DRIVER_OK: start the back-end.
    fn activate(&mut self, ctx: ActivateContext) -> Result<(), ActivateError>;
    /// The driver reset the device: stop the back-end and forget the queues. Returns once the
    /// back-end thread no longer touches guest memory.
    fn reset(&mut self);
    /// The device met something it cannot recover from without a reset (a malformed ring or
    /// descriptor chain, a request with nowhere to put its status): the transport should set
    /// `DEVICE_NEEDS_RESET` (0x40) in the device status it reports. The device has already
    /// stopped processing its queues and signalled a configuration change
    /// (`VirtioInterrupt::signal_config`). Cleared by [`VirtioDevice::reset`].
    fn needs_reset(&self) -> bool {
        false
    }
}
