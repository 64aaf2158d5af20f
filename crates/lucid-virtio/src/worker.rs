//! The queue-worker core shared by every Lucid virtio device: one back-end thread per device
//! (named `lucid-<name>-io`) that learns of requests either from the queues' kick eventfds
//! ([`Notify::Kicks`]) or by polling the avail rings with guest notifications suppressed
//! ([`Notify::Poll`]), puts completions in the used rings, and raises interrupts honouring the
//! driver's suppression (`VRING_AVAIL_F_NO_INTERRUPT` / `used_event`) and the device's
//! [`Coalescing`].
//!
//! A device plugs in as a [`Backend`]; it sees the rings only through [`Io`] (pop a chain,
//! complete it) and moves buffer data only through `io.dma`. Every ring access goes through the
//! device's [`DeviceMemory`] (the DMA path's translator, when a vIOMMU is installed); a ring
//! access that fails (the driver unmapped or revoked a ring's IOVA) is fatal: the device needs a
//! reset.

use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{fence, AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use lucid_mem::vm_memory::{Bytes, GuestAddress, GuestMemory, GuestMemoryError};
use lucid_mem::{DeviceId, DeviceMemory, DmaError, DmaPath};
use lucid_seccomp::Role;
use lucid_stats::{Counter, StatsRegistry, ThreadRole};
use lucid_thread::ThreadSpec;
use virtio_queue::{Queue, QueueOwnedT, QueueT};
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::EventFd;
use vmm_sys_util::timerfd::TimerFd;

use crate::{features, ActivateContext, ActivateError, Coalescing, Notify, VirtioInterrupt};

/// Runs `$body` with `$m` bound to guest RAM itself while no translator is installed (one atomic
/// load, then the code virtio-queue generates for `GuestMemoryMmap`: the ring path costs what it
/// did before the vIOMMU), else to the device's translated view. A translator installed while a
/// call runs applies from the next call (Lucid installs it before any device is activated).
macro_rules! on_mem {
    ($mem:expr, |$m:ident| $body:expr) => {
        match $mem.physical_memory() {
            Some($m) => $body,
            None => {
                let $m = &$mem;
                $body
            }
        }
    };
}

/// Pops the next chain of `q` into `out`: its head and whether its last descriptor asks for a
/// next (a chain virtio-queue cut short).
fn pop_chain<M: GuestMemory>(
    q: &mut Queue,
    mem: &M,
    out: &mut Vec<Desc>,
) -> Result<Option<(u16, bool)>, virtio_queue::Error> {
    let Some(chain) = q.iter(mem)?.next() else {
        return Ok(None);
    };
    let head = chain.head_index();
    let mut dangling = true;
    for d in chain {
        dangling = d.has_next();
        out.push(d);
    }
    Ok(Some((head, dangling)))
}

/// A split-ring descriptor as read from the descriptor table.
pub(crate) type Desc = virtio_queue::desc::split::Descriptor;

const VRING_AVAIL_F_NO_INTERRUPT: u16 = 1;

/// The per-device counters every worker keeps, named `<device>.<counter>`.
pub(crate) struct Counters {
    /// Kick eventfd signals consumed.
    pub kicks: Arc<Counter>,
    /// Poll-mode iterations that found work.
    pub polls_found_work: Arc<Counter>,
    /// Descriptor chains completed (put in a used ring).
    pub requests: Arc<Counter>,
    /// Payload bytes the device read from guest buffers (blk writes, net tx).
    pub bytes_read: Arc<Counter>,
    /// Payload bytes the device wrote into guest buffers (blk reads and get-id, net rx).
    pub bytes_written: Arc<Counter>,
    /// Interrupts signalled.
    pub irqs: Arc<Counter>,
    /// Completions covered by an interrupt they did not raise themselves.
    pub irqs_coalesced: Arc<Counter>,
    /// Completions for which the driver asked for no interrupt.
    pub irqs_suppressed: Arc<Counter>,
    /// Coalescing: interrupts raised with fewer than `max_completions` pending (the time cap,
    /// the device going idle without one, a stop); every other one covers at least that many.
    pub irqs_early: Arc<Counter>,
    /// Requests failed, malformed chains, back-end errors.
    pub errors: Arc<Counter>,
}

impl Counters {
    pub fn new(stats: &StatsRegistry, name: &str) -> Self {
        let c = |n: &str| stats.counter(format!("{name}.{n}"));
        Counters {
            kicks: c("kicks"),
            polls_found_work: c("polls_found_work"),
            requests: c("requests"),
            bytes_read: c("bytes_read"),
            bytes_written: c("bytes_written"),
            irqs: c("irqs"),
            irqs_coalesced: c("irqs_coalesced"),
            irqs_suppressed: c("irqs_suppressed"),
            irqs_early: c("irqs_early"),
            errors: c("errors"),
        }
    }
}

struct WorkerQueue {
    /// The transport's queue index (what `signal_queue` takes).
    index: u16,
    queue: Queue,
    kick: EventFd,
    /// Completions since the last interrupt decision that will be covered by the next interrupt.
    pending: u32,
    /// The driver asked for an interrupt for one of the pending completions.
    wanted: bool,
    /// When the pending interrupt must go out at the latest (coalescing with a time cap).
    deadline: Option<Instant>,
    /// Completions since the last `end_batch`.
    batch: u32,
    /// Poll mode: the device position at which notifications were last suppressed.
    suppressed_at: Option<u16>,
}

/// What popping a chain found.
pub(crate) enum Pop {
    /// A well-formed chain with this head index; its descriptors are in the caller's vector.
    Chain(u16),
    /// No available chain.
    Empty,
    /// The ring or the chain is malformed; the device now needs a reset.
    Fatal,
}

/// What a request handler made of one chain.
pub(crate) enum Served {
    /// Put the chain in the used ring with this many bytes written.
    Used(u32),
    /// The chain cannot be completed (e.g. no place for a status byte): device needs reset.
    Fatal(Fault),
    /// The rate limiter holds the chain back: it stays in the ring, the queue is left alone
    /// (notifications off) until [`Backend::wake_at`].
    Defer,
}

/// Why a device stopped and needs a reset (DEVICE_NEEDS_RESET).
#[derive(Debug, thiserror::Error)]
pub(crate) enum Fault {
    #[error("queue {queue}: bad avail ring: {source}")]
    AvailRing {
        queue: u16,
        #[source]
        source: virtio_queue::Error,
    },
    #[error(
        "queue {queue}: descriptor chain at head {head} is malformed (loops, is longer than the \
         queue, leaves the descriptor table, or cannot be read)"
    )]
    MalformedChain { queue: u16, head: u16 },
    #[error("queue {queue}: cannot access the {what}: {source}")]
    Ring {
        queue: u16,
        what: &'static str,
        #[source]
        source: virtio_queue::Error,
    },
    #[error("queue {queue}: cannot put head {head} in the used ring: {source}")]
    UsedRing {
        queue: u16,
        head: u16,
        #[source]
        source: virtio_queue::Error,
    },
    #[error(
        "request whose last descriptor ({addr:#x}, {len} bytes) has no device-writable status byte"
    )]
    NoStatusByte { addr: u64, len: u32 },
    #[error("cannot write the status byte: {0}")]
    StatusByte(#[source] DmaError),
    #[error("back-end thread: {0}")]
    Thread(#[source] std::io::Error),
}

/// The worker's view of the device's queues and of guest memory.
pub(crate) struct Io {
    /// The rings, in the device's address space.
    mem: DeviceMemory,
    pub dma: Arc<DmaPath>,
    pub dev_id: DeviceId,
    pub c: Counters,
    name: String,
    queues: Vec<WorkerQueue>,
    interrupt: Arc<dyn VirtioInterrupt>,
    coalescing: Coalescing,
    poll: bool,
    needs_reset: Arc<AtomicBool>,
    halted: bool,
    /// Set by `Worker::stop`: long loops give up early so that a reset is not held up by a
    /// driver that keeps the queue full.
    stop: Arc<AtomicBool>,
    scratch: Vec<Desc>,
}

impl Io {
    /// The device's name, for log lines.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The device needs a reset or is being stopped: touch nothing more.
    pub fn halted(&self) -> bool {
        self.halted || self.stop.load(Ordering::Relaxed)
    }

    /// The device cannot go on: flag DEVICE_NEEDS_RESET (the transport reads it through
    /// [`crate::VirtioDevice::needs_reset`]), tell the driver by a configuration interrupt, and
    /// stop touching the rings until reset.
    pub fn fatal(&mut self, fault: Fault) {
        self.c.errors.inc();
        if !self.halted {
            log::error!("{}: device needs reset: {fault}", self.name);
            self.halted = true;
            self.needs_reset.store(true, Ordering::SeqCst);
            self.interrupt.signal_config();
        }
    }

    /// A ring access of queue `qi` failed: the device needs a reset.
    fn ring_fault(&mut self, qi: usize, what: &'static str, source: virtio_queue::Error) {
        let queue = self.queues[qi].index;
        self.fatal(Fault::Ring {
            queue,
            what,
            source,
        });
    }

    /// Whether the driver has made chains available that the device has not consumed.
    pub fn has_avail(&mut self, qi: usize) -> bool {
        let q = &self.queues[qi].queue;
        match on_mem!(self.mem, |m| q.avail_idx(m, Ordering::Acquire)) {
            Ok(idx) => idx.0 != q.next_avail(),
            Err(e) => {
                self.ring_fault(qi, "avail index", e);
                false
            }
        }
    }

    /// Pops the next available chain of queue `qi` into `out`. A chain is well formed when it has
    /// at least one descriptor and its last one does not ask for a next (virtio-queue stops a
    /// chain that loops, is longer than the queue, or names a descriptor outside the table
    /// without saying so; a dangling NEXT flag is how we see it).
    pub fn pop(&mut self, qi: usize, out: &mut Vec<Desc>) -> Pop {
        out.clear();
        if self.halted {
            return Pop::Empty;
        }
        let q = &mut self.queues[qi].queue;
        let popped = match on_mem!(self.mem, |m| pop_chain(q, m, out)) {
            Ok(None) if self.mem.dma().has_translator() => self.pop_again(qi, out),
            r => r,
        };
        let queue = self.queues[qi].index;
        match popped {
            Ok(None) => Pop::Empty,
            Ok(Some((head, dangling))) if out.is_empty() || dangling => {
                self.fatal(Fault::MalformedChain { queue, head });
                Pop::Fatal
            }
            Ok(Some((head, _))) => Pop::Chain(head),
            Err(source) => {
                self.fatal(Fault::AvailRing { queue, source });
                Pop::Fatal
            }
        }
    }

    /// The avail iterator gave nothing: the ring is empty, or (only possible with a translator:
    /// guest RAM does not shrink) the avail entry could not be read, which virtio-queue does not
    /// report. Reads the index again and retries once: nothing again while chains are published
    /// is a ring fault.
    #[cold]
    fn pop_again(
        &mut self,
        qi: usize,
        out: &mut Vec<Desc>,
    ) -> Result<Option<(u16, bool)>, virtio_queue::Error> {
        let q = &mut self.queues[qi].queue;
        if q.avail_idx(&self.mem, Ordering::Acquire)?.0 == q.next_avail() {
            return Ok(None);
        }
        match pop_chain(q, &self.mem, out)? {
            Some(c) => Ok(Some(c)),
            None => Err(virtio_queue::Error::GuestMemory(
                GuestMemoryError::InvalidGuestAddress(GuestAddress(q.avail_ring())),
            )),
        }
    }

    /// Gives back the chain just popped (for example an rx buffer too small for the frame).
    pub fn unpop(&mut self, qi: usize) {
        self.queues[qi].queue.go_to_previous_position();
    }

    /// Puts chain `head` in queue `qi`'s used ring with `len` bytes written.
    pub fn complete(&mut self, qi: usize, head: u16, len: u32) {
        let wq = &mut self.queues[qi];
        match on_mem!(self.mem, |m| wq.queue.add_used(m, head, len)) {
            Ok(()) => {
                wq.batch += 1;
                self.c.requests.inc();
            }
            Err(source) => {
                let queue = wq.index;
                self.fatal(Fault::UsedRing {
                    queue,
                    head,
                    source,
                });
            }
        }
    }

    /// Kicks mode: asks the driver for no notifications while the device is busy.
    pub fn disable_notify(&mut self, qi: usize) {
        if self.poll {
            return;
        }
        let q = &mut self.queues[qi].queue;
        if let Err(e) = on_mem!(self.mem, |m| q.disable_notification(m)) {
            self.ring_fault(qi, "used ring flags", e);
        }
    }

    /// Kicks mode: asks the driver to notify on its next chain; returns true if chains arrived in
    /// the meantime (the caller must look again, or it could sleep with work pending).
    pub fn enable_notify(&mut self, qi: usize) -> bool {
        if self.poll {
            self.suppress(qi);
            return self.has_avail(qi);
        }
        let q = &mut self.queues[qi].queue;
        match on_mem!(self.mem, |m| q.enable_notification(m)) {
            Ok(more) => more,
            Err(e) => {
                self.ring_fault(qi, "notification fields", e);
                false
            }
        }
    }

    /// Poll mode: keeps the driver from notifying. Without EVENT_IDX that is
    /// `VRING_USED_F_NO_NOTIFY`; with it, `avail_event` is set half the index space away from
    /// the device's position: the driver notifies when its index steps over `avail_event`, and
    /// it is never more than a queue's worth ahead of the device. (Just behind, `next_avail - 1`,
    /// would not do: a driver that publishes entry N and reads `avail_event` after the device
    /// consumed N and wrote N would still notify.)
    fn suppress(&mut self, qi: usize) {
        let wq = &mut self.queues[qi];
        if wq.suppressed_at == Some(wq.queue.next_avail()) {
            return;
        }
        wq.suppressed_at = Some(wq.queue.next_avail());
        let q = &mut wq.queue;
        let r = if q.event_idx_enabled() {
            let addr = q.used_ring() + 4 + 8 * u64::from(q.size());
            let v = q.next_avail().wrapping_add(0x8000);
            on_mem!(self.mem, |m| m.store(
                v.to_le(),
                GuestAddress(addr),
                Ordering::Relaxed
            ))
            .map_err(virtio_queue::Error::GuestMemory)
        } else {
            on_mem!(self.mem, |m| q.disable_notification(m))
        };
        fence(Ordering::SeqCst);
        if let Err(e) = r {
            self.ring_fault(qi, "avail_event / used ring flags", e);
        }
    }

    /// Whether the driver wants an interrupt for the completions since the last call (yes when
    /// its fields cannot be read: the device then needs a reset anyway).
    fn driver_wants_irq(&mut self, qi: usize) -> bool {
        let q = &mut self.queues[qi].queue;
        let r = if q.event_idx_enabled() {
            on_mem!(self.mem, |m| q.needs_notification(m))
        } else {
            fence(Ordering::SeqCst);
            on_mem!(self.mem, |m| m
                .load(GuestAddress(q.avail_ring()), Ordering::Relaxed))
            .map(|f: u16| u16::from_le(f) & VRING_AVAIL_F_NO_INTERRUPT == 0)
            .map_err(virtio_queue::Error::GuestMemory)
        };
        r.unwrap_or_else(|e| {
            self.ring_fault(qi, "used_event / avail ring flags", e);
            true
        })
    }

    fn coalescing_on(&self) -> bool {
        self.coalescing.max_completions > 1
    }

    /// Ends a batch of completions on queue `qi`: decides whether they need an interrupt and
    /// raises it now or leaves it pending for coalescing.
    pub fn end_batch(&mut self, qi: usize) {
        let n = self.queues[qi].batch;
        if self.poll {
            self.suppress(qi);
        }
        if n == 0 {
            return;
        }
        self.queues[qi].batch = 0;
        let wants = self.driver_wants_irq(qi);
        let coalescing_on = self.coalescing_on();
        let max = self.coalescing.max_completions;
        let delay = self.coalescing.max_delay_us;
        let wq = &mut self.queues[qi];
        if !wants && !wq.wanted {
            self.c.irqs_suppressed.add(u64::from(n));
            return;
        }
        wq.pending += n;
        if wants && !wq.wanted {
            wq.wanted = true;
            if coalescing_on && delay > 0 {
                wq.deadline = Some(Instant::now() + Duration::from_micros(u64::from(delay)));
            }
        }
        if !coalescing_on || wq.pending >= max {
            self.flush(qi);
        }
    }

    fn flush(&mut self, qi: usize) {
        let early =
            self.coalescing_on() && self.queues[qi].pending < self.coalescing.max_completions;
        let wq = &mut self.queues[qi];
        if wq.pending == 0 {
            return;
        }
        if wq.wanted {
            self.interrupt.signal_queue(wq.index);
            if early {
                self.c.irqs_early.inc();
            }
            self.c.irqs.inc();
            self.c.irqs_coalesced.add(u64::from(wq.pending - 1));
        } else {
            self.c.irqs_suppressed.add(u64::from(wq.pending));
        }
        wq.pending = 0;
        wq.wanted = false;
        wq.deadline = None;
    }

    /// Flushes every pending interrupt whose time cap has passed.
    fn flush_due(&mut self, now: Instant) {
        for qi in 0..self.queues.len() {
            if self.queues[qi].deadline.is_some_and(|d| d <= now) {
                self.flush(qi);
            }
        }
    }

    /// Coalescing without a time cap (`max_delay_us` = 0) flushes when the device goes idle.
    fn flush_idle(&mut self) {
        for qi in 0..self.queues.len() {
            if self.queues[qi].pending > 0 && self.queues[qi].deadline.is_none() {
                self.flush(qi);
            }
        }
    }

    fn next_deadline(&self) -> Option<Instant> {
        self.queues.iter().filter_map(|q| q.deadline).min()
    }

    /// The usual request/response loop over queue `qi`: pops each chain, lets `handle` serve it,
    /// completes it, and (in Kicks mode) re-enables notifications and looks again before
    /// returning so that no chain is left behind. Returns whether any chain was found.
    pub fn serve(&mut self, qi: usize, handle: &mut dyn FnMut(&Io, &[Desc]) -> Served) -> bool {
        let mut found = false;
        let mut descs = std::mem::take(&mut self.scratch);
        'outer: loop {
            self.disable_notify(qi);
            loop {
                match self.pop(qi, &mut descs) {
                    Pop::Empty => break,
                    Pop::Fatal => break 'outer,
                    Pop::Chain(head) => {
                        found = true;
                        if self.stop.load(Ordering::Relaxed) {
                            // Being reset: the chain is abandoned with the queue.
                            break 'outer;
                        }
                        match handle(self, &descs) {
                            Served::Used(len) => self.complete(qi, head, len),
                            Served::Fatal(fault) => {
                                self.fatal(fault);
                                break 'outer;
                            }
                            Served::Defer => {
                                self.unpop(qi);
                                self.end_batch(qi);
                                self.scratch = descs;
                                return found;
                            }
                        }
                    }
                }
            }
            self.end_batch(qi);
            if self.halted() || !self.enable_notify(qi) {
                break;
            }
        }
        self.scratch = descs;
        found
    }
}

impl Io {
    /// The worker's view of `ctx`'s queues (each must be valid on `ctx.mem`), and the idle sleep
    /// of poll mode.
    fn new(
        name: &str,
        ctx: ActivateContext,
        needs_reset: Arc<AtomicBool>,
    ) -> Result<(Io, u32), ActivateError> {
        let event_idx = ctx.features & features::VIRTIO_RING_F_EVENT_IDX != 0;
        let mut queues = Vec::new();
        for (index, mut queue, kick) in ctx.queues {
            queue.set_event_idx(event_idx);
            if !queue.is_valid(&ctx.mem) {
                return Err(ActivateError::QueueInvalid {
                    device: name.to_string(),
                    queue: index,
                });
            }
            queues.push(WorkerQueue {
                index,
                queue,
                kick,
                pending: 0,
                wanted: false,
                deadline: None,
                batch: 0,
                suppressed_at: None,
            });
        }
        let (poll, idle_sleep_us) = match ctx.notify {
            Notify::Kicks | Notify::Inline => (false, 0),
            Notify::Poll { idle_sleep_us } => (true, idle_sleep_us),
        };
        let io = Io {
            dma: ctx.mem.dma().clone(),
            dev_id: ctx.mem.device(),
            mem: ctx.mem,
            c: Counters::new(&ctx.stats, name),
            name: name.to_string(),
            queues,
            interrupt: ctx.interrupt,
            coalescing: ctx.coalescing,
            poll,
            needs_reset,
            halted: false,
            stop: Arc::new(AtomicBool::new(false)),
            scratch: Vec::new(),
        };
        Ok((io, idle_sleep_us))
    }

    /// [`Notify::Inline`]: serves what the rings hold now on the caller's thread, a few rounds
    /// (an echo's frames go from tx to rx and free tx room), then raises what is still pending.
    fn serve_inline(mut self, mut backend: impl Backend) {
        backend.init(&mut self);
        for _ in 0..4 {
            let mut found = false;
            for qi in 0..self.queues.len() {
                if !self.halted {
                    found |= backend.process_queue(&mut self, qi);
                }
            }
            if !found || self.halted {
                break;
            }
        }
        for qi in 0..self.queues.len() {
            self.flush(qi);
        }
    }
}

/// A device's request handling, run on the worker thread.
pub(crate) trait Backend: Send + 'static {
    /// Queue `qi` (a position in the worker's queue list) may have new chains.
    /// Returns whether it found work.
    fn process_queue(&mut self, io: &mut Io, qi: usize) -> bool;
    /// A file descriptor of the back-end (a tap) to watch for input.
    fn extra_fd(&self) -> Option<RawFd> {
        None
    }
    /// Whether the extra fd should be watched now (false while there is nowhere to put input).
    fn extra_wanted(&self) -> bool {
        false
    }
    /// The extra fd is readable (or, in poll mode, may be). Returns whether it found work.
    fn on_extra(&mut self, _io: &mut Io) -> bool {
        false
    }
    /// Called once on the worker thread before the first request.
    fn init(&mut self, _io: &mut Io) {}
    /// When the back-end wants to be called again without a kick (a request waiting for
    /// tokens); the worker then calls [`Backend::process_queue`] on every queue.
    fn wake_at(&self) -> Option<Instant> {
        None
    }
    /// An eventfd that says the back-end's rate limits changed ([`crate::rate::RateControl`]).
    fn limits_fd(&self) -> Option<RawFd> {
        None
    }
    /// The limits changed: take them (then every queue is looked at again).
    fn on_limits(&mut self, _io: &mut Io) {}
}

/// The running back-end thread of one device.
pub(crate) struct Worker {
    stop: Arc<AtomicBool>,
    stop_evt: EventFd,
    thread: Option<JoinHandle<()>>,
}

/// A device's back-end thread, started at activation and stopped at reset, with the flag the
/// worker raises when the driver broke its rings.
#[derive(Default)]
pub(crate) struct WorkerSlot {
    worker: Option<Worker>,
    needs_reset: Arc<AtomicBool>,
}

impl WorkerSlot {
    pub fn is_running(&self) -> bool {
        self.worker.is_some()
    }

    pub fn start(
        &mut self,
        name: &str,
        ctx: ActivateContext,
        backend: impl Backend,
    ) -> Result<(), ActivateError> {
        if self.is_running() {
            return Err(ActivateError::AlreadyActive {
                device: name.to_string(),
            });
        }
        self.needs_reset.store(false, Ordering::SeqCst);
        if ctx.notify == Notify::Inline {
            Io::new(name, ctx, self.needs_reset.clone())?
                .0
                .serve_inline(backend);
            return Ok(());
        }
        self.worker = Some(Worker::spawn(name, ctx, self.needs_reset.clone(), backend)?);
        Ok(())
    }

    /// Returns once the thread no longer touches guest memory.
    pub fn stop(&mut self) {
        if let Some(w) = self.worker.take() {
            w.stop();
        }
        self.needs_reset.store(false, Ordering::SeqCst);
    }

    pub fn needs_reset(&self) -> bool {
        self.needs_reset.load(Ordering::SeqCst)
    }
}

impl Worker {
    /// Takes the queues of `ctx` and starts `lucid-<name>-io`.
    pub fn spawn(
        name: &str,
        ctx: ActivateContext,
        needs_reset: Arc<AtomicBool>,
        backend: impl Backend,
    ) -> Result<Worker, ActivateError> {
        let spawner = ctx.spawner.clone();
        let (io, idle_sleep_us) = Io::new(name, ctx, needs_reset)?;
        let poll = io.poll;
        let stop = io.stop.clone();
        let thread_err = |source| ActivateError::Thread {
            device: name.to_string(),
            source,
        };
        let stop_evt = EventFd::new(0).map_err(thread_err)?;
        let thread_stop = stop.clone();
        let thread_evt = stop_evt.try_clone().map_err(thread_err)?;
        // Activation returns once the thread is registered and placed: a VM that stops right
        // after an activation never leaves a back-end the pools did not see (they stop placing
        // threads as the VM stops). After every reset the thread confines itself again, as at
        // the first activation.
        let spec = ThreadSpec::new(
            format!("lucid-{name}-io"),
            ThreadRole::Backend,
            Role::Backend,
        );
        let thread = spawner.spawn(spec, move |confined| {
            let mut run = Run {
                io,
                backend,
                stop: thread_stop,
                stop_evt: thread_evt,
            };
            let result = match confined {
                Err(e) => Err(std::io::Error::other(e)),
                Ok(()) if poll => run.poll_loop(idle_sleep_us),
                Ok(()) => run.kick_loop(),
            };
            if let Err(e) = result {
                run.io.fatal(Fault::Thread(e));
                run.wait_stop();
            }
        })?;
        Ok(Worker {
            stop,
            stop_evt,
            thread: Some(thread),
        })
    }

    /// Stops the thread and waits for it: when this returns it no longer touches guest memory.
    pub fn stop(mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = self.stop_evt.write(1);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = self.stop_evt.write(1);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

struct Run<B: Backend> {
    io: Io,
    backend: B,
    stop: Arc<AtomicBool>,
    stop_evt: EventFd,
}

const EV_STOP: u64 = u64::MAX;
const EV_TIMER: u64 = u64::MAX - 1;
const EV_EXTRA: u64 = u64::MAX - 2;
const EV_LIMITS: u64 = u64::MAX - 3;

impl<B: Backend> Run<B> {
    fn stopping(&self) -> bool {
        self.stop.load(Ordering::SeqCst)
    }

    /// After a fatal error: touch nothing until the transport resets the device.
    fn wait_stop(&mut self) {
        while !self.stopping() {
            let _ = self.stop_evt.read();
        }
    }

    fn all_queues(&mut self) -> bool {
        let mut found = false;
        for qi in 0..self.io.queues.len() {
            if self.io.halted {
                break;
            }
            found |= self.backend.process_queue(&mut self.io, qi);
        }
        found
    }

    fn kick_loop(&mut self) -> std::io::Result<()> {
        let epoll = Epoll::new()?;
        let mut timer = TimerFd::new()?;
        let add = |fd: RawFd, data: u64| {
            epoll.ctl(
                ControlOperation::Add,
                fd,
                EpollEvent::new(EventSet::IN, data),
            )
        };
        add(self.stop_evt.as_raw_fd(), EV_STOP)?;
        add(timer.as_raw_fd(), EV_TIMER)?;
        for (qi, q) in self.io.queues.iter().enumerate() {
            add(q.kick.as_raw_fd(), qi as u64)?;
        }
        let extra = self.backend.extra_fd();
        let mut extra_armed = false;
        if let Some(fd) = extra {
            epoll.ctl(
                ControlOperation::Add,
                fd,
                EpollEvent::new(EventSet::empty(), EV_EXTRA),
            )?;
        }
        if let Some(fd) = self.backend.limits_fd() {
            add(fd, EV_LIMITS)?;
        }
        self.backend.init(&mut self.io);
        // Chains made available before the thread started got no kick we will see.
        self.all_queues();
        let mut events = vec![EpollEvent::default(); self.io.queues.len() + 4];
        let mut timer_at: Option<Instant> = None;
        loop {
            if self.stopping() {
                return Ok(());
            }
            if self.io.halted {
                self.wait_stop();
                return Ok(());
            }
            self.io.flush_idle();
            let deadline = match (self.io.next_deadline(), self.backend.wake_at()) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
            if deadline != timer_at {
                match deadline {
                    Some(d) => {
                        let left = d
                            .saturating_duration_since(Instant::now())
                            .max(Duration::from_nanos(1000));
                        timer.reset(left, None)?;
                    }
                    None => timer.clear()?,
                }
                timer_at = deadline;
            }
            if let Some(fd) = extra {
                let want = self.backend.extra_wanted();
                if want != extra_armed {
                    let ev = if want {
                        EventSet::IN
                    } else {
                        EventSet::empty()
                    };
                    epoll.ctl(ControlOperation::Modify, fd, EpollEvent::new(ev, EV_EXTRA))?;
                    extra_armed = want;
                }
            }
            let n = match epoll.wait(-1, &mut events) {
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            };
            for ev in &events[..n] {
                match ev.data() {
                    EV_STOP => return Ok(()),
                    EV_TIMER => {
                        // Readable: the read does not block.
                        let _ = timer.wait();
                        timer_at = None;
                        if self.backend.wake_at().is_some_and(|w| w <= Instant::now()) {
                            self.all_queues();
                        }
                    }
                    EV_EXTRA => {
                        if !self.io.halted {
                            self.backend.on_extra(&mut self.io);
                        }
                    }
                    EV_LIMITS => {
                        self.backend.on_limits(&mut self.io);
                        self.all_queues();
                    }
                    qi => {
                        let qi = qi as usize;
                        if let Ok(v) = self.io.queues[qi].kick.read() {
                            self.io.c.kicks.add(v);
                        }
                        if !self.io.halted {
                            self.backend.process_queue(&mut self.io, qi);
                        }
                    }
                }
            }
            self.io.flush_due(Instant::now());
        }
    }

    fn poll_loop(&mut self, idle_sleep_us: u32) -> std::io::Result<()> {
        // Kicks that arrive anyway (a driver that ignores suppression) are drained and counted.
        let epoll = Epoll::new()?;
        for (qi, q) in self.io.queues.iter().enumerate() {
            epoll.ctl(
                ControlOperation::Add,
                q.kick.as_raw_fd(),
                EpollEvent::new(EventSet::IN, qi as u64),
            )?;
        }
        for qi in 0..self.io.queues.len() {
            self.io.suppress(qi);
        }
        self.backend.init(&mut self.io);
        let mut events = vec![EpollEvent::default(); self.io.queues.len().max(1)];
        let mut idle_rounds = 0u32;
        loop {
            if self.stopping() {
                return Ok(());
            }
            if self.io.halted {
                self.wait_stop();
                return Ok(());
            }
            // A limiter follows a change of its limits by itself at its next request.
            let mut found = self.all_queues();
            if self.backend.extra_fd().is_some() && self.backend.extra_wanted() && !self.io.halted {
                found |= self.backend.on_extra(&mut self.io);
            }
            let now = Instant::now();
            self.io.flush_due(now);
            if found {
                self.io.c.polls_found_work.inc();
                idle_rounds = 0;
                continue;
            }
            self.io.flush_idle();
            idle_rounds = idle_rounds.wrapping_add(1);
            // Drain stray kicks now and then (always when sleeping anyway).
            if idle_sleep_us > 0 || idle_rounds.is_multiple_of(64) {
                if let Ok(n) = epoll.wait(0, &mut events) {
                    for ev in &events[..n] {
                        let qi = ev.data() as usize;
                        if let Ok(v) = self.io.queues[qi].kick.read() {
                            self.io.c.kicks.add(v);
                        }
                    }
                }
            }
            if idle_sleep_us > 0 {
                let mut d = Duration::from_micros(u64::from(idle_sleep_us));
                if let Some(dl) = self.io.next_deadline() {
                    d = d.min(dl.saturating_duration_since(now));
                }
                if let Some(w) = self.backend.wake_at() {
                    d = d.min(w.saturating_duration_since(now));
                }
                std::thread::sleep(d);
            } else {
                std::hint::spin_loop();
            }
        }
    }
}

/// A guest-memory region of a chain: device address and length.
pub(crate) type Region = (u64, u64);

/// Why a chain's data could not be moved.
#[derive(Debug, thiserror::Error)]
pub(crate) enum DataError {
    #[error(transparent)]
    Dma(#[from] DmaError),
    #[error("the chain's buffers hold {have} bytes, {need} needed")]
    Short { need: usize, have: usize },
}

/// Puts in `out` the regions of `regions` after its first `skip` bytes; false if it is shorter.
pub(crate) fn split_off(regions: &[Region], mut skip: u64, out: &mut Vec<Region>) -> bool {
    out.clear();
    for &(addr, len) in regions {
        if skip >= len {
            skip -= len;
            continue;
        }
        out.push((addr.wrapping_add(skip), len - skip));
        skip = 0;
    }
    skip == 0
}

/// Reads `buf.len()` bytes from the start of `regions` through the DMA path.
pub(crate) fn gather(io: &Io, regions: &[Region], buf: &mut [u8]) -> Result<(), DataError> {
    let mut done = 0usize;
    for &(addr, len) in regions {
        if done == buf.len() {
            break;
        }
        let n = (len as usize).min(buf.len() - done);
        io.dma.read(io.dev_id, addr, &mut buf[done..done + n])?;
        done += n;
    }
    short(done, buf.len())
}

fn short(have: usize, need: usize) -> Result<(), DataError> {
    if have == need {
        Ok(())
    } else {
        Err(DataError::Short { need, have })
    }
}

/// Writes `buf` at the start of `regions` through the DMA path.
pub(crate) fn scatter(io: &Io, regions: &[Region], buf: &[u8]) -> Result<(), DataError> {
    let mut done = 0usize;
    for &(addr, len) in regions {
        if done == buf.len() {
            break;
        }
        let n = (len as usize).min(buf.len() - done);
        io.dma.write(io.dev_id, addr, &buf[done..done + n])?;
        done += n;
    }
    short(done, buf.len())
}
