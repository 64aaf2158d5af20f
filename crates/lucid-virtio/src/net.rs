//! virtio-net with a tap, echo or sink back-end.
//!
//! Queues: rx0 (index 0) and tx0 (index 1); no control queue, no multiqueue, no offloads. Every
//! buffer starts with the 12-byte `virtio_net_hdr_v1`: on tx the device ignores it, on rx it
//! writes zeros with `num_buffers` = 1 (no `VIRTIO_NET_F_MRG_RXBUF`: each frame goes into one rx
//! chain, which must hold 12 bytes plus the frame).
//!
//! Back-ends:
//! - **tap**: `/dev/net/tun` with `IFF_TAP | IFF_NO_PI` (no vnet header: the device strips and
//!   adds it), non-blocking. The tap is read only while the rx queue has buffers; when it has
//!   none the device stops watching the tap (frames wait in the kernel's queue) until the driver
//!   adds buffers and kicks rx.
//! - **echo**: every transmitted frame comes back on rx unchanged (MAC addresses not swapped),
//!   in order. Up to [`ECHO_BACKLOG`] frames wait for rx buffers; more are dropped and counted in
//!   `rx_dropped_no_buffers`.
//! - **sink**: transmitted frames are counted (`<dev>.sink.{bytes,frames}`) and dropped. With a
//!   rate (`rate_mbit`) the sink is a paced "link": tx chains are consumed behind a token bucket
//!   (see [`Pacer`]), so a guest that offers more than the rate finds its tx queue full and
//!   waits, as behind a real NIC; the time frames waited is `<dev>.sink.throttled_ns`. Nothing
//!   is ever received.
//!
//! Chains of the wrong shape (a device-writable descriptor in a tx chain, a read-only one in an
//! rx chain, a tx chain shorter than the header or longer than [`MAX_FRAME`]) are completed with
//! length 0 and counted in `errors`; a DMA address outside guest memory likewise. An rx frame
//! larger than the rx chain is dropped (`rx_dropped_too_big`) and the chain kept for the next.
//! A buffer the DMA path refuses (a vIOMMU fault, an address outside guest memory) drops the
//! frame: a tx chain is consumed (`tx_dropped`, `tx_dropped_fault`), an rx chain is completed
//! with length 0 (`rx_dropped_fault`).

use std::collections::VecDeque;
use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::OpenOptionsExt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use lucid_stats::{Counter, StatsRegistry};

use crate::blk::read_config_bytes;
use crate::rate::{RateControl, RateCounters, Throttle, TokenBucket, TokenBucketConfig};
use crate::worker::{
    gather, scatter, split_off, Backend, DataError, Desc, Io, Pop, Region, Served, WorkerSlot,
};
use crate::{device_type, features, ActivateContext, ActivateError, VirtioDevice};

/// Feature bits (virtio spec 5.1.3).
pub mod feature {
    pub const VIRTIO_NET_F_MAC: u64 = 1 << 5;
}

/// Length of `virtio_net_hdr_v1` (with `num_buffers`).
pub const NET_HDR_LEN: usize = 12;
/// Largest frame (without the virtio header) the device moves.
pub const MAX_FRAME: usize = 65_536 + 14;
/// Frames the echo back-end holds while the rx queue has no buffers.
pub const ECHO_BACKLOG: usize = 1024;
/// Emptied echo buffers kept for reuse.
const SPARE_BUFFERS: usize = 64;
pub const QUEUE_SIZE: u16 = 256;
pub const RX_QUEUE: u16 = 0;
pub const TX_QUEUE: u16 = 1;

const TUNSETIFF: libc::c_ulong = 0x4004_54ca;
const IFF_TAP: libc::c_short = 0x0002;
const IFF_NO_PI: libc::c_short = 0x1000;

#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NetBackend {
    /// A tap interface by name (created if it does not exist).
    Tap(String),
    /// Transmitted frames come back on rx.
    Echo,
    /// Transmitted frames are counted and dropped; with `rate_mbit` (megabits per second of
    /// frame bytes, 1 Mbit = 125,000 bytes) no faster than that rate.
    Sink { rate_mbit: Option<u64> },
}

/// Largest sink rate accepted (100 Gbit/s): the token arithmetic and the timer resolution are
/// meant for link-like rates.
pub const SINK_MAX_RATE_MBIT: u64 = 100_000;
/// Token-bucket depth of a paced sink: this much of the rate may be sent at once after an idle
/// spell (1 ms worth), on top of the frame that takes the bucket below zero.
pub const SINK_BURST: Duration = Duration::from_millis(1);
/// The window over which a paced sink records the most bytes it moved
/// (`<dev>.sink.window_max_bytes`): at most `rate × (SINK_WINDOW + SINK_BURST)` plus one frame.
pub const SINK_WINDOW: Duration = Duration::from_millis(10);

#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct NetConfig {
    pub backend: NetBackend,
    pub mac: [u8; 6],
}

#[derive(Debug, thiserror::Error)]
pub enum NetError {
    #[error("tap name {0:?} is empty or longer than 15 bytes")]
    TapName(String),
    #[error("cannot open /dev/net/tun for tap {ifname}: {err}{hint}")]
    TunOpen {
        ifname: String,
        err: std::io::Error,
        hint: &'static str,
    },
    #[error("cannot create tap {ifname}: {err}{hint}")]
    TapCreate {
        ifname: String,
        err: std::io::Error,
        hint: &'static str,
    },
    #[error("bad MAC address {0:02x?}: multicast or all zeros")]
    BadMac([u8; 6]),
    #[error("sink rate {0} Mbit/s: give 1-{SINK_MAX_RATE_MBIT} (e.g. rate=1000 for 1 Gbit/s)")]
    SinkRate(u64),
}

/// A virtio-net device.
pub struct Net {
    name: String,
    cfg: NetConfig,
    tap: Option<Arc<File>>,
    config: [u8; 8],
    limits: Option<Arc<RateControl>>,
    worker: WorkerSlot,
}

fn hint_for(err: &std::io::Error) -> &'static str {
    match err.raw_os_error() {
        Some(libc::EPERM) | Some(libc::EACCES) => " (needs root or CAP_NET_ADMIN)",
        Some(libc::ENOENT) | Some(libc::ENODEV) => " (no tun driver: modprobe tun)",
        Some(libc::EBUSY) => " (the tap is already in use by another process)",
        Some(libc::EINVAL) => " (an interface of that name exists and is not a tap)",
        _ => "",
    }
}

/// Opens (creating if needed) tap `ifname`, non-blocking, without packet info or vnet header.
fn open_tap(ifname: &str) -> Result<File, NetError> {
    if ifname.is_empty() || ifname.len() > 15 || ifname.contains('\0') {
        return Err(NetError::TapName(ifname.to_string()));
    }
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open("/dev/net/tun")
        .map_err(|err| NetError::TunOpen {
            ifname: ifname.to_string(),
            hint: hint_for(&err),
            err,
        })?;
    #[repr(C)]
    struct IfReq {
        name: [u8; 16],
        flags: libc::c_short,
        _pad: [u8; 22],
    }
    let mut req = IfReq {
        name: [0; 16],
        flags: IFF_TAP | IFF_NO_PI,
        _pad: [0; 22],
    };
    req.name[..ifname.len()].copy_from_slice(ifname.as_bytes());
    // SAFETY: TUNSETIFF reads and writes a `struct ifreq` (40 bytes on Linux), which `req` is,
    // laid out as the kernel expects; it lives for the whole call.
    let r = unsafe { libc::ioctl(file.as_raw_fd(), TUNSETIFF, &mut req as *mut IfReq) };
    if r < 0 {
        let err = std::io::Error::last_os_error();
        return Err(NetError::TapCreate {
            ifname: ifname.to_string(),
            hint: hint_for(&err),
            err,
        });
    }
    Ok(file)
}

impl Net {
    pub fn new(name: String, cfg: NetConfig) -> Result<Net, NetError> {
        if cfg.mac[0] & 1 != 0 || cfg.mac == [0; 6] {
            return Err(NetError::BadMac(cfg.mac));
        }
        if let NetBackend::Sink { rate_mbit: Some(r) } = cfg.backend {
            if r == 0 || r > SINK_MAX_RATE_MBIT {
                return Err(NetError::SinkRate(r));
            }
        }
        let tap = match &cfg.backend {
            NetBackend::Tap(ifname) => Some(Arc::new(open_tap(ifname)?)),
            _ => None,
        };
        let mut config = [0u8; 8];
        config[..6].copy_from_slice(&cfg.mac);
        Ok(Net {
            name,
            cfg,
            tap,
            config,
            limits: None,
            worker: WorkerSlot::default(),
        })
    }

    /// Puts the NIC behind a rate limiter ([`crate::rate`]): tx and rx each have the buckets
    /// `limits` describes (as Cloud Hypervisor's NICs do); a frame takes its length in bytes
    /// (without the virtio header) and one operation. It applies from the next activation,
    /// and then follows every change made through `limits`.
    pub fn set_rate_control(&mut self, limits: Arc<RateControl>) {
        self.limits = Some(limits);
    }
}

impl VirtioDevice for Net {
    fn name(&self) -> &str {
        &self.name
    }

    fn device_type(&self) -> u32 {
        device_type::NET
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &[QUEUE_SIZE, QUEUE_SIZE]
    }

    fn features(&self) -> u64 {
        features::VIRTIO_F_VERSION_1
            | features::VIRTIO_F_ACCESS_PLATFORM
            | features::VIRTIO_RING_F_EVENT_IDX
            | feature::VIRTIO_NET_F_MAC
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        read_config_bytes(&self.config, offset, data);
    }

    fn write_config(&mut self, _offset: u64, _data: &[u8]) {
        // The MAC is writable only in legacy devices; nothing else is writable.
    }

    fn activate(&mut self, mut ctx: ActivateContext) -> Result<(), ActivateError> {
        ctx.queues
            .retain(|(i, _, _)| *i == RX_QUEUE || *i == TX_QUEUE);
        let pos = |idx: u16| ctx.queues.iter().position(|(i, _, _)| *i == idx);
        let kind = match (&self.cfg.backend, &self.tap) {
            (NetBackend::Tap(_), Some(t)) => Kind::Tap(t.clone()),
            (NetBackend::Echo, _) => Kind::Echo,
            (NetBackend::Sink { rate_mbit }, _) => Kind::Sink(SinkState {
                pacer: rate_mbit.map(|r| Pacer::new(r * 125_000, Instant::now())),
                c: SinkCounters::new(&ctx.stats, &self.name),
            }),
            // A tap back-end always has its file (opened in `new`).
            (NetBackend::Tap(_), None) => Kind::Sink(SinkState {
                pacer: None,
                c: SinkCounters::new(&ctx.stats, &self.name),
            }),
        };
        let throttle = |l: &Arc<RateControl>| {
            Throttle::new(l.clone(), RateCounters::new(&ctx.stats, &self.name))
        };
        let backend = NetWorker {
            tx_throttle: self.limits.as_ref().map(throttle),
            rx_throttle: self.limits.as_ref().map(throttle),
            rx_pending: None,
            kind,
            rx: pos(RX_QUEUE),
            tx: pos(TX_QUEUE),
            echo: VecDeque::new(),
            spare: Vec::new(),
            rx_waiting: false,
            frame: vec![0; MAX_FRAME],
            chain: Chain::default(),
            c: NetCounters::new(&ctx.stats, &self.name),
        };
        self.worker.start(&self.name, ctx, backend)
    }

    fn reset(&mut self) {
        self.worker.stop();
    }

    fn needs_reset(&self) -> bool {
        self.worker.needs_reset()
    }
}

struct NetCounters {
    tx_packets: Arc<Counter>,
    tx_bytes: Arc<Counter>,
    tx_dropped: Arc<Counter>,
    /// Tx frames dropped because the DMA path refused their buffer (also in `tx_dropped`).
    tx_dropped_fault: Arc<Counter>,
    rx_packets: Arc<Counter>,
    rx_bytes: Arc<Counter>,
    rx_dropped_no_buffers: Arc<Counter>,
    rx_dropped_too_big: Arc<Counter>,
    /// Rx frames dropped because the DMA path refused the rx buffer.
    rx_dropped_fault: Arc<Counter>,
}

impl NetCounters {
    fn new(stats: &StatsRegistry, name: &str) -> Self {
        let c = |n: &str| stats.counter(format!("{name}.{n}"));
        NetCounters {
            tx_packets: c("tx_packets"),
            tx_bytes: c("tx_bytes"),
            tx_dropped: c("tx_dropped"),
            tx_dropped_fault: c("tx_dropped_fault"),
            rx_packets: c("rx_packets"),
            rx_bytes: c("rx_bytes"),
            rx_dropped_no_buffers: c("rx_dropped_no_buffers"),
            rx_dropped_too_big: c("rx_dropped_too_big"),
            rx_dropped_fault: c("rx_dropped_fault"),
        }
    }
}

enum Kind {
    Tap(Arc<File>),
    Echo,
    Sink(SinkState),
}

struct SinkState {
    /// None: an unpaced sink (frames dropped as fast as they come).
    pacer: Option<Pacer>,
    c: SinkCounters,
}

/// The sink's counters, `<dev>.sink.*`.
struct SinkCounters {
    /// Frame bytes consumed (without the virtio header).
    bytes: Arc<Counter>,
    frames: Arc<Counter>,
    /// Time tx chains waited in the queue for tokens, summed over the spells of waiting.
    throttled_ns: Arc<Counter>,
    /// Gauges of a paced sink: its rate, the window length and the most bytes moved in one
    /// window (aligned windows of [`SINK_WINDOW`] on the device's clock).
    rate_bytes_per_s: Arc<Counter>,
    window_ns: Arc<Counter>,
    window_max_bytes: Arc<Counter>,
    /// Paced sink: token-bucket depth in bytes (the burst allowed after an idle spell).
    burst_bytes: Arc<Counter>,
}

impl SinkCounters {
    fn new(stats: &StatsRegistry, name: &str) -> Self {
        let c = |n: &str| stats.counter(format!("{name}.sink.{n}"));
        SinkCounters {
            bytes: c("bytes"),
            frames: c("frames"),
            throttled_ns: c("throttled_ns"),
            rate_bytes_per_s: c("rate_bytes_per_s"),
            window_ns: c("window_ns"),
            window_max_bytes: c("window_max_bytes"),
            burst_bytes: c("burst_bytes"),
        }
    }
}

/// A paced sink's link: [`crate::rate`]'s token bucket holding [`SINK_BURST`] of the rate; a
/// frame may go while the bucket holds a token and takes its whole length, possibly into debt,
/// so frames of any size pass and the long-run rate is exact. It also records the most bytes
/// moved in one window. Pure: the caller passes the time, so it is unit-tested without
/// sleeping.
#[derive(Debug, Clone)]
pub struct Pacer {
    rate: u64,
    bucket: TokenBucket,
    epoch: Instant,
    /// Since when chains have waited for tokens (None: not waiting).
    held_since: Option<Instant>,
    window: u64,
    window_bytes: u64,
    window_max: u64,
}

impl Pacer {
    /// A full bucket for `rate` bytes per second (> 0; whole thousands are exact).
    pub fn new(rate: u64, now: Instant) -> Pacer {
        let ms = SINK_BURST.as_millis() as u64;
        let cfg = TokenBucketConfig {
            size: (rate * ms / 1000).max(1),
            one_time_burst: None,
            refill_time: ms,
        };
        Pacer {
            rate: rate.max(1),
            bucket: TokenBucket::new(&cfg, now),
            epoch: now,
            held_since: None,
            window: 0,
            window_bytes: 0,
            window_max: 0,
        }
    }

    /// Bytes per second.
    pub fn rate(&self) -> u64 {
        self.rate
    }

    /// The bucket depth in bytes.
    pub fn burst_bytes(&self) -> u64 {
        self.bucket.size()
    }

    /// Whether a frame may go at `now`.
    pub fn ready(&mut self, now: Instant) -> bool {
        self.bucket.ready(1, now)
    }

    /// When the bucket next holds a token (now if it does).
    pub fn ready_at(&self) -> Instant {
        self.bucket.ready_at(1)
    }

    /// Takes `len` bytes for a frame sent at `now`; returns the nanoseconds it waited for tokens
    /// (since [`Pacer::hold`]), 0 if it did not.
    pub fn spend(&mut self, len: u64, now: Instant) -> u64 {
        self.bucket.ready(0, now);
        self.bucket.take(len);
        let w =
            (now.saturating_duration_since(self.epoch).as_nanos() / SINK_WINDOW.as_nanos()) as u64;
        if w != self.window {
            self.window = w;
            self.window_bytes = 0;
        }
        self.window_bytes += len;
        self.window_max = self.window_max.max(self.window_bytes);
        self.held_since
            .take()
            .map_or(0, |t| now.saturating_duration_since(t).as_nanos() as u64)
    }

    /// Chains are waiting for tokens from `now` on (kept if already waiting).
    pub fn hold(&mut self, now: Instant) {
        self.held_since.get_or_insert(now);
    }

    /// Chains are waiting: when the worker should look again.
    pub fn wake_at(&self) -> Option<Instant> {
        self.held_since.map(|_| self.ready_at())
    }

    /// The most bytes sent within one aligned [`SINK_WINDOW`].
    pub fn window_max_bytes(&self) -> u64 {
        self.window_max
    }
}

struct NetWorker {
    /// The rate limiter of each direction (with the same limits).
    tx_throttle: Option<Throttle>,
    rx_throttle: Option<Throttle>,
    /// Tap: a frame read while rx was held by its limiter; it goes first.
    rx_pending: Option<Vec<u8>>,
    kind: Kind,
    /// Positions of rx0 and tx0 in the worker's queue list, if the driver enabled them.
    rx: Option<usize>,
    tx: Option<usize>,
    /// Echo: frames waiting for rx buffers, in order, and emptied buffers to reuse (no
    /// allocation per frame in a steady state; at most [`SPARE_BUFFERS`] are kept, so a burst
    /// that filled the backlog does not hold its memory for the VM's life).
    echo: VecDeque<Vec<u8>>,
    spare: Vec<Vec<u8>>,
    /// Tap: the rx queue ran out of buffers; the tap is not watched until the driver adds some.
    rx_waiting: bool,
    /// Tap and sink: one frame at a time.
    frame: Vec<u8>,
    chain: Chain,
    c: NetCounters,
}

/// Descriptor and region lists kept between frames (no allocation per frame).
#[derive(Default)]
struct Chain {
    descs: Vec<Desc>,
    regions: Vec<Region>,
    body: Vec<Region>,
}

/// Why a chain was completed without moving its frame. A guest can cause these at will, so they
/// are counted (`errors`, `tx_dropped`, `rx_dropped_too_big`) and logged at debug level.
#[derive(Debug, thiserror::Error)]
enum ChainError {
    #[error("tx chain with a device-writable descriptor")]
    WritableTx,
    #[error("tx chain of {len} bytes, shorter than the {NET_HDR_LEN}-byte header")]
    ShortTx { len: u64 },
    #[error("tx frame of {len} bytes, more than {MAX_FRAME}")]
    LongTx { len: u64 },
    #[error("rx chain with a device-readable descriptor")]
    ReadOnlyRx,
    #[error("rx chain of {room} bytes for a {len}-byte frame and its header")]
    SmallRx { room: u64, len: usize },
    #[error(transparent)]
    Data(#[from] DataError),
}

fn chain_error(io: &Io, e: ChainError) {
    io.c.errors.inc();
    log::debug!("{}: {e}", io.name());
}

/// What became of one frame offered to the rx queue.
enum Delivery {
    Delivered,
    /// The frame is gone (dropped: too big, or the buffer was bad).
    Dropped,
    /// No rx buffer (or the device needs reset); the frame was not consumed.
    NoBuffer,
}

impl Backend for NetWorker {
    fn process_queue(&mut self, io: &mut Io, qi: usize) -> bool {
        if Some(qi) == self.tx && self.paced() {
            self.paced_tx(io, qi)
        } else if Some(qi) == self.tx {
            let found = io.serve(qi, &mut |io, descs| self.transmit(io, descs));
            if !self.echo.is_empty() {
                self.receive(io);
            }
            found
        } else if Some(qi) == self.rx {
            match self.kind {
                Kind::Echo if !self.echo.is_empty() => self.receive(io),
                Kind::Tap(_) if self.rx_held() && !self.rx_waiting => self.receive(io),
                Kind::Tap(_) if self.rx_waiting && io.has_avail(qi) => {
                    self.rx_waiting = false;
                    io.disable_notify(qi);
                    self.receive(io)
                }
                _ => false,
            }
        } else {
            false
        }
    }

    fn extra_fd(&self) -> Option<RawFd> {
        match &self.kind {
            Kind::Tap(t) => Some(t.as_raw_fd()),
            _ => None,
        }
    }

    fn extra_wanted(&self) -> bool {
        self.rx.is_some() && !self.rx_waiting && !self.rx_held()
    }

    fn on_extra(&mut self, io: &mut Io) -> bool {
        self.receive(io)
    }

    fn wake_at(&self) -> Option<Instant> {
        let pacer = match &self.kind {
            Kind::Sink(SinkState { pacer: Some(p), .. }) => p.wake_at(),
            _ => None,
        };
        let tx = self.tx_throttle.as_ref().and_then(Throttle::wake_at);
        let rx = self.rx_throttle.as_ref().and_then(Throttle::wake_at);
        [pacer, tx, rx].into_iter().flatten().min()
    }

    fn limits_fd(&self) -> Option<RawFd> {
        self.tx_throttle.as_ref().map(Throttle::wake_fd)
    }

    fn on_limits(&mut self, _io: &mut Io) {
        for t in [&mut self.tx_throttle, &mut self.rx_throttle]
            .into_iter()
            .flatten()
        {
            t.on_change();
        }
    }

    fn init(&mut self, io: &mut Io) {
        if let Kind::Sink(s) = &self.kind {
            if let Some(p) = &s.pacer {
                s.c.rate_bytes_per_s.set(p.rate());
                s.c.window_ns.set(SINK_WINDOW.as_nanos() as u64);
                s.c.burst_bytes.set(p.burst_bytes());
            }
        }
        // rx kicks matter only when the device ran out of buffers (it then re-enables them).
        if let Some(rx) = self.rx {
            io.disable_notify(rx);
        }
    }
}

impl NetWorker {
    /// Rx waits for its limiter's tokens.
    fn rx_held(&self) -> bool {
        self.rx_throttle.as_ref().is_some_and(Throttle::holding)
    }

    /// Whether rx may take a frame of `len` bytes now (else it waits for tokens).
    fn rx_admit(&mut self, len: usize) -> bool {
        self.rx_throttle
            .as_mut()
            .is_none_or(|t| t.admit(len as u64))
    }

    fn paced(&self) -> bool {
        matches!(&self.kind, Kind::Sink(SinkState { pacer: Some(_), .. }))
    }

    /// A paced sink's tx queue: chains are taken only while the bucket has tokens. When it runs
    /// dry with chains waiting, guest notifications stay off and the worker comes back at
    /// [`Pacer::wake_at`] (the chains wait in the ring: the guest sees a busy link).
    fn paced_tx(&mut self, io: &mut Io, qi: usize) -> bool {
        let mut found = false;
        let mut descs = std::mem::take(&mut self.chain.descs);
        'outer: loop {
            io.disable_notify(qi);
            loop {
                if io.halted() {
                    break 'outer;
                }
                if !io.has_avail(qi) {
                    break;
                }
                let now = Instant::now();
                let Kind::Sink(SinkState { pacer: Some(p), .. }) = &mut self.kind else {
                    break 'outer;
                };
                if !p.ready(now) {
                    p.hold(now);
                    io.end_batch(qi);
                    self.chain.descs = descs;
                    return found;
                }
                let head = match io.pop(qi, &mut descs) {
                    Pop::Chain(h) => h,
                    Pop::Empty => break,
                    Pop::Fatal => break 'outer,
                };
                found = true;
                match self.transmit(io, &descs) {
                    Served::Used(len) => io.complete(qi, head, len),
                    Served::Fatal(f) => {
                        io.fatal(f);
                        break 'outer;
                    }
                    Served::Defer => {
                        io.unpop(qi);
                        break 'outer;
                    }
                }
            }
            io.end_batch(qi);
            if io.halted() || !io.enable_notify(qi) {
                break;
            }
        }
        io.end_batch(qi);
        self.chain.descs = descs;
        found
    }

    fn transmit(&mut self, io: &Io, descs: &[Desc]) -> Served {
        if descs.iter().any(|d| d.is_write_only()) {
            return self.tx_drop(io, ChainError::WritableTx);
        }
        let ch = &mut self.chain;
        ch.regions.clear();
        ch.regions
            .extend(descs.iter().map(|d| (d.addr().0, u64::from(d.len()))));
        let total: u64 = ch.regions.iter().map(|r| r.1).sum();
        if !split_off(&ch.regions, NET_HDR_LEN as u64, &mut ch.body) {
            return self.tx_drop(io, ChainError::ShortTx { len: total });
        }
        let len = (total - NET_HDR_LEN as u64) as usize;
        if len > MAX_FRAME {
            return self.tx_drop(io, ChainError::LongTx { len: len as u64 });
        }
        if let Some(t) = &mut self.tx_throttle {
            if !t.admit(len as u64) {
                return Served::Defer;
            }
        }
        // The echo gathers straight into the buffer that waits for rx; the others into `frame`.
        let mut echoed = match self.kind {
            Kind::Echo => {
                let mut v = self.spare.pop().unwrap_or_default();
                v.resize(len, 0);
                Some(v)
            }
            _ => None,
        };
        let buf = match &mut echoed {
            Some(v) => &mut v[..],
            None => &mut self.frame[..len],
        };
        if let Err(e) = gather(io, &self.chain.body, buf) {
            if let Some(v) = echoed {
                recycle(&mut self.spare, v);
            }
            if matches!(e, DataError::Dma(_)) {
                self.c.tx_dropped_fault.inc();
            }
            return self.tx_drop(io, e.into());
        }
        io.c.bytes_read.add(len as u64);
        self.c.tx_packets.inc();
        self.c.tx_bytes.add(len as u64);
        match &mut self.kind {
            Kind::Sink(s) => {
                s.c.bytes.add(len as u64);
                s.c.frames.inc();
                if let Some(p) = &mut s.pacer {
                    s.c.throttled_ns.add(p.spend(len as u64, Instant::now()));
                    s.c.window_max_bytes.set(p.window_max_bytes());
                }
            }
            Kind::Echo => {
                let v = echoed.expect("echo gathered into a buffer");
                if self.rx.is_none() || self.echo.len() >= ECHO_BACKLOG {
                    self.c.rx_dropped_no_buffers.inc();
                    recycle(&mut self.spare, v);
                } else {
                    self.echo.push_back(v);
                }
            }
            Kind::Tap(t) => {
                // A tap write does not block (the frame enters the host stack or is dropped).
                if let Err(e) = (&**t).write(&self.frame[..len]) {
                    self.c.tx_dropped.inc();
                    io.c.errors.inc();
                    log::debug!("{}: tap write of {len} bytes: {e}", io.name());
                }
            }
        }
        Served::Used(0)
    }

    /// A tx chain that cannot be sent: completed with length 0, counted.
    fn tx_drop(&self, io: &Io, why: ChainError) -> Served {
        chain_error(io, why);
        self.c.tx_dropped.inc();
        Served::Used(0)
    }

    /// Moves frames from the back-end (echo backlog or tap) into rx buffers while both last.
    fn receive(&mut self, io: &mut Io) -> bool {
        let Some(rx) = self.rx else {
            return false;
        };
        let mut found = false;
        loop {
            if io.halted() {
                break;
            }
            if !io.has_avail(rx) {
                // Out of buffers: ask for a kick when the driver adds some, then look again.
                if io.enable_notify(rx) {
                    continue;
                }
                if matches!(self.kind, Kind::Tap(_)) {
                    self.rx_waiting = true;
                }
                break;
            }
            let outcome = match &self.kind {
                Kind::Echo => {
                    let Some(len) = self.echo.front().map(Vec::len) else {
                        break;
                    };
                    if !self.rx_admit(len) {
                        break;
                    }
                    let Some(f) = self.echo.pop_front() else {
                        break;
                    };
                    let outcome = self.chain.deliver(io, rx, &f, &self.c);
                    if let Delivery::NoBuffer = outcome {
                        self.echo.push_front(f);
                    } else {
                        recycle(&mut self.spare, f);
                    }
                    outcome
                }
                Kind::Tap(_) if self.rx_pending.is_some() => {
                    let len = self.rx_pending.as_ref().map_or(0, Vec::len);
                    if !self.rx_admit(len) {
                        break;
                    }
                    let f = self.rx_pending.take().unwrap_or_default();
                    let outcome = self.chain.deliver(io, rx, &f, &self.c);
                    if let Delivery::NoBuffer = outcome {
                        self.c.rx_dropped_no_buffers.inc();
                    }
                    outcome
                }
                Kind::Tap(t) => match (&**t).read(&mut self.frame) {
                    Ok(n) if !self.rx_throttle.as_mut().is_none_or(|t| t.admit(n as u64)) => {
                        // Read already: it waits beside the tap for the tokens.
                        self.rx_pending = Some(self.frame[..n].to_vec());
                        break;
                    }
                    Ok(n) => {
                        let outcome = self.chain.deliver(io, rx, &self.frame[..n], &self.c);
                        if let Delivery::NoBuffer = outcome {
                            // The frame was read from the tap already and has nowhere to go.
                            self.c.rx_dropped_no_buffers.inc();
                        }
                        outcome
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                    Err(e) => {
                        io.c.errors.inc();
                        log::warn!("{}: tap read: {e}", io.name());
                        break;
                    }
                },
                Kind::Sink(_) => break,
            };
            found = true;
            if let Delivery::NoBuffer = outcome {
                break;
            }
        }
        io.end_batch(rx);
        found
    }
}

impl Chain {
    /// Puts `frame` behind a virtio header in the next rx chain.
    fn deliver(&mut self, io: &mut Io, rx: usize, frame: &[u8], c: &NetCounters) -> Delivery {
        let head = loop {
            let head = match io.pop(rx, &mut self.descs) {
                Pop::Chain(h) => h,
                Pop::Empty | Pop::Fatal => return Delivery::NoBuffer,
            };
            if self.descs.iter().all(|d| d.is_write_only()) {
                break head;
            }
            // A read-only descriptor in an rx chain: give it back unused; the frame waits for
            // the next buffer.
            chain_error(io, ChainError::ReadOnlyRx);
            io.complete(rx, head, 0);
        };
        self.regions.clear();
        self.regions
            .extend(self.descs.iter().map(|d| (d.addr().0, u64::from(d.len()))));
        let room: u64 = self.regions.iter().map(|r| r.1).sum();
        if room < (NET_HDR_LEN + frame.len()) as u64 {
            io.unpop(rx);
            c.rx_dropped_too_big.inc();
            let len = frame.len();
            chain_error(io, ChainError::SmallRx { room, len });
            return Delivery::Dropped;
        }
        let mut hdr = [0u8; NET_HDR_LEN];
        hdr[10..12].copy_from_slice(&1u16.to_le_bytes()); // num_buffers
        split_off(&self.regions, NET_HDR_LEN as u64, &mut self.body);
        let written =
            scatter(io, &self.regions, &hdr).and_then(|()| scatter(io, &self.body, frame));
        if let Err(e) = written {
            if matches!(e, DataError::Dma(_)) {
                c.rx_dropped_fault.inc();
            }
            chain_error(io, e.into());
            io.complete(rx, head, 0);
            return Delivery::Dropped;
        }
        io.complete(rx, head, (NET_HDR_LEN + frame.len()) as u32);
        io.c.bytes_written.add(frame.len() as u64);
        c.rx_packets.inc();
        c.rx_bytes.add(frame.len() as u64);
        Delivery::Delivered
    }
}

/// Keeps an emptied echo buffer for the next frame, up to [`SPARE_BUFFERS`] of them.
fn recycle(spare: &mut Vec<Vec<u8>>, v: Vec<u8>) {
    if spare.len() < SPARE_BUFFERS {
        spare.push(v);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A sender that sends a 1514-byte frame whenever the bucket allows, on a simulated clock:
    /// over 10 s it moves the rate's bytes to within a bucket and a frame, and never more than
    /// that in any window.
    #[test]
    fn pacer_long_run_rate_is_exact() {
        for rate in [125_000u64, 12_500_000, 125_000_000] {
            let t0 = Instant::now();
            let mut p = Pacer::new(rate, t0);
            let (mut now, mut sent) = (t0, 0u64);
            let end = t0 + Duration::from_secs(10);
            while now < end {
                if p.ready(now) {
                    p.spend(1514, now);
                    sent += 1514;
                } else {
                    p.hold(now);
                    now = p.wake_at().expect("held");
                }
            }
            let ideal = rate * 10;
            let slack = p.burst_bytes() + 1514;
            assert!(
                sent <= ideal + slack,
                "rate {rate}: {sent} > {ideal} + {slack}"
            );
            assert!(sent + 2 * 1514 >= ideal, "rate {rate}: {sent} < {ideal}");
            let w = rate as u128 * (SINK_WINDOW + SINK_BURST).as_nanos() / 1_000_000_000;
            assert!(u128::from(p.window_max_bytes()) <= w + 1514);
        }
    }

    #[test]
    fn pacer_waits_and_reports_waiting_time() {
        let t0 = Instant::now();
        let mut p = Pacer::new(1_000_000, t0); // 1 MB/s: 1000-byte bucket
        assert_eq!(p.burst_bytes(), 1000);
        assert!(p.ready(t0));
        assert_eq!(p.spend(3000, t0), 0); // 2000 bytes of debt: 2 ms
        assert!(!p.ready(t0));
        assert_eq!(p.wake_at(), None, "nothing held yet");
        p.hold(t0);
        let at = p.wake_at().unwrap();
        // 2000 bytes of debt and one token, at 1000 bytes a millisecond.
        assert_eq!(at - t0, Duration::from_micros(2001));
        assert!(!p.ready(at - Duration::from_nanos(2)));
        assert!(p.ready(at));
        assert_eq!(p.spend(10, at), 2_001_000);
        assert_eq!(p.wake_at(), None);
        // Idle time refills only up to the bucket.
        let later = at + Duration::from_secs(5);
        assert!(p.ready(later));
        p.spend(1000, later);
        assert!(!p.ready(later));
    }
}
