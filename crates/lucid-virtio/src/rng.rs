//! virtio-rng (virtio 1.2, 5.4): the entropy device. One request queue; the driver offers
//! device-writable buffers and the device fills them from the host's `getrandom(2)` (the
//! kernel's CSPRNG, what `/dev/urandom` reads), written through the DMA path. No configuration
//! space, no feature of its own.
//!
//! With a rate ([`RngConfig::rate`], bytes per second) the device serves buffers behind a token
//! bucket ([`Bucket`]) that holds one second of the rate and starts full: a request takes as
//! many tokens as it is filled with (a buffer larger than the bucket is filled with a bucket's
//! worth: virtio-rng lets the device write less than the buffer). When the bucket cannot
//! cover the next request, the request stays in the ring and the worker comes back when it can:
//! nothing is lost, the guest waits.
//!
//! A chain with no device-writable descriptor is completed with length 0 and counted in
//! `errors`; a buffer the DMA path refuses likewise (what was written before it is reported).
//!
//! Counters, under `<name>.`: the worker's (`requests`, `bytes_written`: the random bytes
//! given, `kicks`, `irqs`, `errors`, ...), `throttled_ns` (time requests waited for tokens),
//! `throttled` (times the bucket ran dry with a request waiting), `getrandom_errors`, and the
//! gauge `rate_bytes_per_s` (0: unlimited).

use std::sync::Arc;
use std::time::{Duration, Instant};

use lucid_stats::{Counter, StatsRegistry};

use crate::worker::{scatter, split_off, Backend, DataError, Desc, Io, Pop, Region, WorkerSlot};
use crate::{device_type, features, ActivateContext, ActivateError, VirtioDevice};

pub const QUEUE_SIZE: u16 = 256;
/// Largest rate accepted (1 GiB/s); the token arithmetic is exact well beyond it.
pub const MAX_RATE: u64 = 1 << 30;
/// Most bytes put in one request: a larger buffer is filled this far.
pub const MAX_REQUEST: u64 = 1 << 20;
/// The bucket's depth: this long of the rate may be taken at once after an idle spell.
pub const BURST: Duration = Duration::from_secs(1);
/// Bytes drawn from `getrandom` at a time.
const CHUNK: usize = 4096;

/// What `--rng` asks for.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RngConfig {
    /// Bytes per second, with a one-second burst; none: as fast as the guest asks.
    pub rate: Option<u64>,
}

const NS_PER_S: u128 = 1_000_000_000;

/// A token bucket of bytes: tokens (bytes × 10⁹, so that a nanosecond of refill at any rate is
/// exact) grow at the rate up to [`BURST`]'s worth, and a request takes what it is filled with.
/// Pure: the caller passes the time.
#[derive(Debug, Clone)]
pub struct Bucket {
    rate: u64,
    tokens: u128,
    cap: u128,
    last: Instant,
}

impl Bucket {
    /// A full bucket for `rate` bytes per second (at least 1).
    pub fn new(rate: u64, now: Instant) -> Bucket {
        let rate = rate.max(1);
        let cap = u128::from(rate) * BURST.as_nanos();
        Bucket {
            rate,
            tokens: cap,
            cap,
            last: now,
        }
    }

    pub fn rate(&self) -> u64 {
        self.rate
    }

    /// The most one request may take: the bucket's depth in bytes.
    pub fn burst_bytes(&self) -> u64 {
        (self.cap / NS_PER_S) as u64
    }

    fn refill(&mut self, now: Instant) {
        let ns = now.saturating_duration_since(self.last).as_nanos();
        self.last = self.last.max(now);
        self.tokens = (self.tokens + ns * u128::from(self.rate)).min(self.cap);
    }

    /// Takes `bytes` (at most [`Bucket::burst_bytes`]) at `now` if the bucket holds them.
    pub fn take(&mut self, bytes: u64, now: Instant) -> bool {
        self.refill(now);
        let need = u128::from(bytes) * NS_PER_S;
        if self.tokens < need {
            return false;
        }
        self.tokens -= need;
        true
    }

    /// When the bucket will hold `bytes` (at most [`Bucket::burst_bytes`]).
    pub fn ready_at(&self, bytes: u64) -> Instant {
        let need = (u128::from(bytes) * NS_PER_S).min(self.cap);
        let missing = need.saturating_sub(self.tokens);
        let ns = missing.div_ceil(u128::from(self.rate));
        self.last + Duration::from_nanos(ns.min(u128::from(u64::MAX)) as u64)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum RngError {
    #[error("rng rate {0} bytes/s: give 1-{MAX_RATE}")]
    Rate(u64),
}

#[derive(Clone)]
struct Counters {
    throttled_ns: Arc<Counter>,
    throttled: Arc<Counter>,
    getrandom_errors: Arc<Counter>,
    rate: Arc<Counter>,
}

/// A virtio-rng device.
pub struct Rng {
    name: String,
    cfg: RngConfig,
    queue_sizes: [u16; 1],
    c: Counters,
    worker: WorkerSlot,
}

impl Rng {
    pub fn new(name: String, cfg: RngConfig, stats: &StatsRegistry) -> Result<Rng, RngError> {
        if let Some(r) = cfg.rate {
            if r == 0 || r > MAX_RATE {
                return Err(RngError::Rate(r));
            }
        }
        let c = |n: &str| stats.counter(format!("{name}.{n}"));
        let c = Counters {
            throttled_ns: c("throttled_ns"),
            throttled: c("throttled"),
            getrandom_errors: c("getrandom_errors"),
            rate: c("rate_bytes_per_s"),
        };
        c.rate.set(cfg.rate.unwrap_or(0));
        Ok(Rng {
            name,
            cfg,
            queue_sizes: [QUEUE_SIZE],
            c,
            worker: WorkerSlot::default(),
        })
    }

    pub fn config(&self) -> &RngConfig {
        &self.cfg
    }
}

impl VirtioDevice for Rng {
    fn name(&self) -> &str {
        &self.name
    }

    fn device_type(&self) -> u32 {
        device_type::RNG
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &self.queue_sizes
    }

    fn features(&self) -> u64 {
        features::VIRTIO_F_VERSION_1
            | features::VIRTIO_F_ACCESS_PLATFORM
            | features::VIRTIO_RING_F_EVENT_IDX
    }

    fn read_config(&self, _offset: u64, data: &mut [u8]) {
        data.fill(0);
    }

    fn write_config(&mut self, _offset: u64, _data: &[u8]) {}

    fn activate(&mut self, mut ctx: ActivateContext) -> Result<(), ActivateError> {
        ctx.queues.retain(|(i, _, _)| *i == 0);
        if ctx.queues.is_empty() {
            return Err(ActivateError::QueueMissing {
                device: self.name.clone(),
                queue: 0,
            });
        }
        let backend = RngBackend {
            bucket: self.cfg.rate.map(|r| Bucket::new(r, Instant::now())),
            held_since: None,
            wake: None,
            c: self.c.clone(),
            buf: vec![0; CHUNK],
            regions: Vec::new(),
            descs: Vec::new(),
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

struct RngBackend {
    bucket: Option<Bucket>,
    /// Since when a request has waited for tokens.
    held_since: Option<Instant>,
    /// When the waiting request can be served.
    wake: Option<Instant>,
    c: Counters,
    buf: Vec<u8>,
    regions: Vec<Region>,
    descs: Vec<Desc>,
}

impl Backend for RngBackend {
    fn process_queue(&mut self, io: &mut Io, qi: usize) -> bool {
        self.wake = None;
        let mut found = false;
        let mut descs = std::mem::take(&mut self.descs);
        'outer: loop {
            io.disable_notify(qi);
            loop {
                if io.halted() {
                    break 'outer;
                }
                let head = match io.pop(qi, &mut descs) {
                    Pop::Chain(h) => h,
                    Pop::Empty => break,
                    Pop::Fatal => break 'outer,
                };
                found = true;
                self.regions.clear();
                self.regions.extend(
                    descs
                        .iter()
                        .filter(|d| d.is_write_only())
                        .map(|d| (d.addr().0, u64::from(d.len()))),
                );
                let room: u64 = self.regions.iter().map(|r| r.1).sum();
                let mut want = room.min(MAX_REQUEST);
                if let Some(b) = &mut self.bucket {
                    want = want.min(b.burst_bytes());
                    let now = Instant::now();
                    if !b.take(want, now) {
                        // Wait in the ring; the worker comes back when the bucket holds it.
                        io.unpop(qi);
                        if self.held_since.is_none() {
                            self.held_since = Some(now);
                            self.c.throttled.inc();
                        }
                        self.wake = Some(b.ready_at(want));
                        break 'outer;
                    }
                    if let Some(t) = self.held_since.take() {
                        self.c
                            .throttled_ns
                            .add(now.saturating_duration_since(t).as_nanos() as u64);
                    }
                }
                let len = self.fill(io, want);
                io.complete(qi, head, len);
            }
            io.end_batch(qi);
            if io.halted() || !io.enable_notify(qi) {
                break;
            }
        }
        io.end_batch(qi);
        self.descs = descs;
        found
    }

    fn wake_at(&self) -> Option<Instant> {
        self.wake
    }
}

impl RngBackend {
    /// Writes `want` random bytes at the start of the chain's writable regions; returns how
    /// many were written.
    fn fill(&mut self, io: &Io, want: u64) -> u32 {
        if want == 0 {
            io.c.errors.inc();
            log::debug!("{}: a request with no device-writable buffer", io.name());
            return 0;
        }
        let mut done = 0u64;
        let mut rest = Vec::new();
        while done < want {
            let n = ((want - done) as usize).min(CHUNK);
            if let Err(e) = getrandom(&mut self.buf[..n]) {
                self.c.getrandom_errors.inc();
                io.c.errors.inc();
                log::warn!("{}: getrandom: {e}", io.name());
                break;
            }
            if !split_off(&self.regions, done, &mut rest) {
                break;
            }
            match scatter(io, &rest, &self.buf[..n]) {
                Ok(()) => done += n as u64,
                Err(DataError::Dma(e)) => {
                    io.c.errors.inc();
                    log::debug!("{}: buffer at byte {done}: {e}", io.name());
                    break;
                }
                Err(DataError::Short { .. }) => break,
            }
        }
        io.c.bytes_written.add(done);
        done as u32
    }
}

/// Fills `buf` from the kernel's CSPRNG (`getrandom(2)`, no flags: it blocks only until the
/// pool is first seeded, long past at any VMM's start).
fn getrandom(buf: &mut [u8]) -> std::io::Result<()> {
    let mut at = 0;
    while at < buf.len() {
        let rest = &mut buf[at..];
        // SAFETY: getrandom writes at most `rest.len()` bytes into the buffer it is given.
        let n = unsafe { libc::getrandom(rest.as_mut_ptr().cast(), rest.len(), 0) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        at += n as usize;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bucket_holds_one_second_and_refills_at_the_rate() {
        let t0 = Instant::now();
        let mut b = Bucket::new(1000, t0);
        assert_eq!(b.burst_bytes(), 1000);
        assert!(b.take(600, t0));
        assert!(!b.take(600, t0));
        // 400 left; 200 more take 200 ms.
        assert_eq!(b.ready_at(600), t0 + Duration::from_millis(200));
        assert!(!b.take(600, t0 + Duration::from_millis(199)));
        assert!(b.take(600, t0 + Duration::from_millis(200)));
        // Never more than the burst, however long it waits.
        let later = t0 + Duration::from_secs(60);
        assert!(b.take(1000, later));
        assert!(!b.take(1, later));
    }

    #[test]
    fn bytes_over_time_stay_under_rate_plus_burst() {
        let t0 = Instant::now();
        let mut b = Bucket::new(16384, t0);
        let mut now = t0;
        let mut given = 0u64;
        while given < 64 * 1024 {
            if b.take(4096, now) {
                given += 4096;
            } else {
                now = b.ready_at(4096);
            }
        }
        // 64 KiB at 16 KiB/s with a 16 KiB burst: 3 s at least.
        assert!(now.duration_since(t0) >= Duration::from_secs(3));
        assert!(now.duration_since(t0) < Duration::from_millis(3100));
    }

    #[test]
    fn getrandom_fills_a_buffer() {
        let mut buf = vec![0u8; 65536];
        getrandom(&mut buf).unwrap();
        let mut seen = [false; 256];
        for b in &buf {
            seen[usize::from(*b)] = true;
        }
        assert_eq!(seen.iter().filter(|s| **s).count(), 256);
    }
}
