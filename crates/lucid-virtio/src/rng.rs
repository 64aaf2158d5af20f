//! virtio-rng (virtio 1.2, 5.4): the entropy device. One request queue; the driver offers
//! device-writable buffers and the device fills them from the host's `getrandom(2)` (the
//! kernel's CSPRNG, what `/dev/urandom` reads), written through the DMA path. No configuration
//! space, no feature of its own.
//!
//! With a rate limiter ([`RngConfig::rate_limiter`], or [`RngConfig::rate`] bytes per second
//! with a one-second bucket) the device serves buffers behind [`crate::rate`]'s buckets: a
//! request takes as many byte tokens as it is filled with (a buffer larger than the bytes
//! bucket is filled with a bucket's worth: virtio-rng lets the device write less than the
//! buffer) and one operation. When the buckets cannot cover the next request, the request
//! stays in the ring and the worker comes back when they can: nothing is lost, the guest waits.
//!
//! A chain with no device-writable descriptor is completed with length 0 and counted in
//! `errors`; a buffer the DMA path refuses likewise (what was written before it is reported).
//!
//! Counters, under `<name>.`: the worker's (`requests`, `bytes_written`: the random bytes
//! given, `kicks`, `irqs`, `errors`, ...), `getrandom_errors`, and the limiter's
//! `rate_limited.*` ([`crate::rate`]).

use std::os::fd::RawFd;
use std::sync::Arc;
use std::time::Instant;

use lucid_stats::{Counter, StatsRegistry};

use crate::rate::{
    RateControl, RateCounters, RateError, RateLimiterConfig, Throttle, TokenBucketConfig,
};

use crate::worker::{scatter, split_off, Backend, DataError, Desc, Io, Pop, Region, WorkerSlot};
use crate::{device_type, features, ActivateContext, ActivateError, VirtioDevice};

pub const QUEUE_SIZE: u16 = 256;
/// Largest rate accepted (1 GiB/s); the token arithmetic is exact well beyond it.
pub const MAX_RATE: u64 = 1 << 30;
/// Most bytes put in one request: a larger buffer is filled this far.
pub const MAX_REQUEST: u64 = 1 << 20;
/// Bytes drawn from `getrandom` at a time.
const CHUNK: usize = 4096;

/// What `--rng` asks for.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RngConfig {
    /// Bytes per second, with a one-second bucket; none: as fast as the guest asks (or as
    /// `rate_limiter` says).
    pub rate: Option<u64>,
    /// Cloud Hypervisor's rate limiter; takes the place of `rate`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rate_limiter: Option<RateLimiterConfig>,
}

impl RngConfig {
    /// The limits the device starts with: `rate_limiter`, else `rate` as a bytes bucket.
    pub fn limits(&self) -> RateLimiterConfig {
        self.rate_limiter.unwrap_or(RateLimiterConfig {
            bandwidth: self.rate.map(|r| TokenBucketConfig::per_second(r, None)),
            ops: None,
        })
    }
}

#[derive(Debug, thiserror::Error)]
pub enum RngError {
    #[error("rng rate {0} bytes/s: give 1-{MAX_RATE}")]
    Rate(u64),
    #[error(transparent)]
    Limits(#[from] RateError),
}

#[derive(Clone)]
struct Counters {
    getrandom_errors: Arc<Counter>,
    rate: RateCounters,
}

/// A virtio-rng device.
pub struct Rng {
    name: String,
    cfg: RngConfig,
    queue_sizes: [u16; 1],
    c: Counters,
    limits: Arc<RateControl>,
    worker: WorkerSlot,
}

impl Rng {
    pub fn new(name: String, cfg: RngConfig, stats: &StatsRegistry) -> Result<Rng, RngError> {
        if let Some(r) = cfg.rate {
            if r == 0 || r > MAX_RATE {
                return Err(RngError::Rate(r));
            }
        }
        let limits = RateControl::new(cfg.limits())?;
        let c = Counters {
            getrandom_errors: stats.counter(format!("{name}.getrandom_errors")),
            rate: RateCounters::new(stats, &name),
        };
        c.rate.show(&limits.get());
        Ok(Rng {
            name,
            cfg,
            queue_sizes: [QUEUE_SIZE],
            c,
            limits,
            worker: WorkerSlot::default(),
        })
    }

    pub fn config(&self) -> &RngConfig {
        &self.cfg
    }

    /// The handle that changes the device's limits while it runs.
    pub fn rate_control(&self) -> Arc<RateControl> {
        self.limits.clone()
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
            throttle: Throttle::new(self.limits.clone(), self.c.rate.clone()),
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
    throttle: Throttle,
    c: Counters,
    buf: Vec<u8>,
    regions: Vec<Region>,
    descs: Vec<Desc>,
}

impl Backend for RngBackend {
    fn process_queue(&mut self, io: &mut Io, qi: usize) -> bool {
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
                let want = room
                    .min(MAX_REQUEST)
                    .min(self.throttle.bytes_bucket().unwrap_or(u64::MAX));
                if !self.throttle.admit(want) {
                    // Wait in the ring; the worker comes back when the buckets hold it.
                    io.unpop(qi);
                    break 'outer;
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
        self.throttle.wake_at()
    }

    fn limits_fd(&self) -> Option<RawFd> {
        Some(self.throttle.wake_fd())
    }

    fn on_limits(&mut self, _io: &mut Io) {
        self.throttle.on_change();
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
