//! Rate limiters of the blk, net and rng devices: two token buckets, one of bytes and one of
//! operations, each described as Cloud Hypervisor and Firecracker describe theirs
//! ([`TokenBucketConfig`]: `size` tokens, refilled from empty in `refill_time` ms, plus a
//! `one_time_burst` that is spent first and never refills). A bucket starts full.
//!
//! A request takes its bytes and its one operation from both buckets or from neither. A
//! request larger than a bucket goes when that bucket is full and leaves it in debt, so the
//! long-run rate holds whatever the request sizes. When a request cannot have its tokens the
//! device leaves it in the ring, stops consuming that queue and asks its worker to come back
//! when the buckets will hold it ([`Throttle::wake_at`], the worker's timerfd): it never spins
//! and never drops the request.
//!
//! The limits change while the device runs through its [`RateControl`] (the REST API's
//! `lucid.rate-limit`): the control stores the new configuration, bumps a generation and
//! writes an eventfd the worker watches; the worker takes the new buckets at its next look at
//! the queues, carrying over the tokens it had (at most the new size) or its debt, so a change
//! takes effect at once and a lowered limit does not start with a fresh burst.
//!
//! Counters, under `<dev>.rate_limited.`: `throttled_events` (spells of a request waiting for
//! tokens), `throttled_ns` (their total length), `bytes_deferred` and `ops_deferred` (the
//! requests that had to wait, counted once each), and the gauges of the limits in force:
//! `bw_bytes_per_s`, `bw_capacity`, `ops_per_s`, `ops_capacity` (0: no limit).

use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lucid_stats::{Counter, StatsRegistry};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

/// Longest refill time accepted (one hour), which keeps the token arithmetic in range.
pub const MAX_REFILL_MS: u64 = 3_600_000;
/// Largest bucket or burst accepted (2⁵⁰ tokens, a petabyte).
pub const MAX_TOKENS: u64 = 1 << 50;

const NS_PER_MS: u128 = 1_000_000;

/// One token bucket, in Cloud Hypervisor's `TokenBucketConfig` shape.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenBucketConfig {
    /// Tokens the bucket holds (bytes or operations).
    pub size: u64,
    /// Tokens given once, on top of `size`, spent before the bucket.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub one_time_burst: Option<u64>,
    /// Milliseconds to refill the bucket from empty: the rate is `size / refill_time`.
    pub refill_time: u64,
}

impl TokenBucketConfig {
    /// `rate` tokens a second, with one second of it in the bucket.
    pub fn per_second(rate: u64, burst: Option<u64>) -> Self {
        TokenBucketConfig {
            size: rate,
            one_time_burst: burst,
            refill_time: 1000,
        }
    }

    /// Tokens per second (rounded down).
    pub fn rate_per_s(&self) -> u64 {
        (u128::from(self.size) * 1000 / u128::from(self.refill_time.max(1))) as u64
    }

    fn check(&self, what: &'static str) -> Result<(), RateError> {
        let bad = |why: &'static str| Err(RateError::Bucket { what, why });
        if self.size == 0 || self.size > MAX_TOKENS {
            return bad("size must be 1 to 2^50");
        }
        if self.refill_time == 0 || self.refill_time > MAX_REFILL_MS {
            return bad("refill_time must be 1 to 3600000 ms");
        }
        if self.one_time_burst.is_some_and(|b| b > MAX_TOKENS) {
            return bad("one_time_burst must be at most 2^50");
        }
        Ok(())
    }
}

/// A device's limits, in Cloud Hypervisor's `RateLimiterConfig` shape: a bucket of bytes and
/// one of operations, each optional.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RateLimiterConfig {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bandwidth: Option<TokenBucketConfig>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ops: Option<TokenBucketConfig>,
}

impl RateLimiterConfig {
    pub fn validate(&self) -> Result<(), RateError> {
        if let Some(b) = &self.bandwidth {
            b.check("bandwidth")?;
        }
        if let Some(o) = &self.ops {
            o.check("ops")?;
        }
        Ok(())
    }

    /// Neither bucket: nothing is limited.
    pub fn is_unlimited(&self) -> bool {
        self.bandwidth.is_none() && self.ops.is_none()
    }
}

impl std::fmt::Display for RateLimiterConfig {
    /// `unlimited`, or the rates and bucket sizes, e.g. `1048576 B/s (bucket 1048576), 100 ops/s
    /// (bucket 100)`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.is_unlimited() {
            return f.write_str("unlimited");
        }
        let parts = [("B/s", self.bandwidth), ("ops/s", self.ops)];
        let mut sep = "";
        for (unit, b) in parts {
            if let Some(b) = b {
                write!(f, "{sep}{} {unit} (bucket {}", b.rate_per_s(), b.size)?;
                if let Some(x) = b.one_time_burst {
                    write!(f, ", one-time burst {x}")?;
                }
                f.write_str(")")?;
                sep = ", ";
            }
        }
        Ok(())
    }
}

#[derive(Debug, thiserror::Error)]
pub enum RateError {
    #[error("rate limiter {what}: {why}")]
    Bucket {
        what: &'static str,
        why: &'static str,
    },
    #[error("rate limiter: cannot create its eventfd: {0}")]
    EventFd(#[source] std::io::Error),
}

/// A token bucket. Tokens are kept in units of 1/`refill_ns` so that a nanosecond of refill
/// adds exactly `size` units whatever the rate. Pure: the caller passes the time.
#[derive(Clone, Debug)]
pub struct TokenBucket {
    size: u64,
    refill_ns: u128,
    /// What is left of the one-time burst, in tokens.
    burst: u64,
    /// In units; below zero after a request larger than the bucket.
    budget: i128,
    last: Instant,
}

impl TokenBucket {
    /// A full bucket (plus its one-time burst) as of `now`.
    pub fn new(cfg: &TokenBucketConfig, now: Instant) -> Self {
        let size = cfg.size.max(1);
        let refill_ns = u128::from(cfg.refill_time.max(1)) * NS_PER_MS;
        TokenBucket {
            size,
            refill_ns,
            burst: cfg.one_time_burst.unwrap_or(0),
            budget: (u128::from(size) * refill_ns) as i128,
            last: now,
        }
    }

    fn cap(&self) -> i128 {
        (u128::from(self.size) * self.refill_ns) as i128
    }

    fn units(&self, tokens: u64) -> i128 {
        (u128::from(tokens) * self.refill_ns) as i128
    }

    fn refill(&mut self, now: Instant) {
        let ns = now.saturating_duration_since(self.last).as_nanos();
        self.last = self.last.max(now);
        // No more than it takes to fill the bucket (out of its debt too): no overflow.
        let missing = (self.cap() - self.budget).max(0) as u128;
        let size = u128::from(self.size);
        let add = ns.min(missing.div_ceil(size)) * size;
        self.budget = (self.budget + add as i128).min(self.cap());
    }

    /// Tokens the bucket holds when full.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Whole tokens in the bucket now (the one-time burst aside).
    pub fn tokens(&self) -> i64 {
        (self.budget / self.refill_ns as i128) as i64
    }

    /// The one-time burst not yet spent.
    pub fn burst_left(&self) -> u64 {
        self.burst
    }

    /// What the bucket must hold for `n` tokens to go (the burst spent first).
    fn need(&self, n: u64) -> i128 {
        let from_bucket = n.saturating_sub(self.burst);
        self.units(from_bucket.min(self.size))
    }

    /// Whether `n` tokens could be taken at `now`.
    pub fn ready(&mut self, n: u64, now: Instant) -> bool {
        self.refill(now);
        n <= self.burst || self.budget >= self.need(n)
    }

    /// Takes `n` tokens; the caller checked [`TokenBucket::ready`] at the same `now`.
    pub fn take(&mut self, n: u64) {
        let from_burst = n.min(self.burst);
        self.burst -= from_burst;
        self.budget -= self.units(n - from_burst);
    }

    /// Takes `n` tokens at `now` if the bucket holds them.
    pub fn try_take(&mut self, n: u64, now: Instant) -> bool {
        let ok = self.ready(n, now);
        if ok {
            self.take(n);
        }
        ok
    }

    /// When `n` tokens can go (`now` or earlier if they can already).
    pub fn ready_at(&self, n: u64) -> Instant {
        if n <= self.burst {
            return self.last;
        }
        let missing = (self.need(n) - self.budget).max(0) as u128;
        let ns = missing.div_ceil(u128::from(self.size));
        self.last + Duration::from_nanos(ns.min(u128::from(u64::MAX)) as u64)
    }

    /// A bucket for `cfg` that keeps this one's tokens (at most the new size, and its debt),
    /// with `cfg`'s one-time burst.
    fn reshaped(&self, cfg: &TokenBucketConfig, now: Instant) -> Self {
        let mut old = self.clone();
        old.refill(now);
        let mut b = TokenBucket::new(cfg, now);
        let tokens = old.budget / old.refill_ns as i128;
        b.budget = (tokens * b.refill_ns as i128).min(b.cap());
        b
    }
}

/// The two buckets of a device (or of one direction of a NIC).
#[derive(Clone, Debug, Default)]
pub struct Limiter {
    pub bandwidth: Option<TokenBucket>,
    pub ops: Option<TokenBucket>,
}

impl Limiter {
    pub fn new(cfg: &RateLimiterConfig, now: Instant) -> Self {
        Limiter {
            bandwidth: cfg.bandwidth.as_ref().map(|c| TokenBucket::new(c, now)),
            ops: cfg.ops.as_ref().map(|c| TokenBucket::new(c, now)),
        }
    }

    /// The limiter for `cfg`, carrying over the tokens of the buckets it had.
    fn reshaped(&self, cfg: &RateLimiterConfig, now: Instant) -> Self {
        let shape = |old: &Option<TokenBucket>, c: &Option<TokenBucketConfig>| match (old, c) {
            (Some(o), Some(c)) => Some(o.reshaped(c, now)),
            (None, Some(c)) => Some(TokenBucket::new(c, now)),
            (_, None) => None,
        };
        Limiter {
            bandwidth: shape(&self.bandwidth, &cfg.bandwidth),
            ops: shape(&self.ops, &cfg.ops),
        }
    }

    /// Takes `bytes` and one operation at `now` from both buckets, or nothing.
    pub fn try_take(&mut self, bytes: u64, now: Instant) -> bool {
        let bw_ok = self.bandwidth.as_mut().is_none_or(|b| b.ready(bytes, now));
        let ops_ok = self.ops.as_mut().is_none_or(|b| b.ready(1, now));
        if !(bw_ok && ops_ok) {
            return false;
        }
        if let Some(b) = &mut self.bandwidth {
            b.take(bytes);
        }
        if let Some(b) = &mut self.ops {
            b.take(1);
        }
        true
    }

    /// When a request of `bytes` can go.
    pub fn ready_at(&self, bytes: u64) -> Option<Instant> {
        let bw = self.bandwidth.as_ref().map(|b| b.ready_at(bytes));
        let ops = self.ops.as_ref().map(|b| b.ready_at(1));
        bw.into_iter().chain(ops).max()
    }
}

/// The run-time handle of a device's limits: the VMM sets them, the device's worker follows.
#[derive(Debug)]
pub struct RateControl {
    cfg: Mutex<RateLimiterConfig>,
    generation: AtomicU64,
    wake: EventFd,
}

impl RateControl {
    pub fn new(cfg: RateLimiterConfig) -> Result<Arc<Self>, RateError> {
        cfg.validate()?;
        Ok(Arc::new(RateControl {
            cfg: Mutex::new(cfg),
            generation: AtomicU64::new(0),
            wake: EventFd::new(EFD_NONBLOCK).map_err(RateError::EventFd)?,
        }))
    }

    /// The limits in force.
    pub fn get(&self) -> RateLimiterConfig {
        *self.cfg.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Replaces the limits (all of them: a bucket left out is removed) and wakes the worker.
    pub fn set(&self, cfg: RateLimiterConfig) -> Result<(), RateError> {
        cfg.validate()?;
        *self.cfg.lock().unwrap_or_else(|e| e.into_inner()) = cfg;
        self.generation.fetch_add(1, Ordering::SeqCst);
        // A full counter already wakes the worker.
        let _ = self.wake.write(1);
        Ok(())
    }

    fn generation(&self) -> u64 {
        self.generation.load(Ordering::SeqCst)
    }

    /// Written when the limits change; the worker watches it.
    pub(crate) fn wake_fd(&self) -> RawFd {
        self.wake.as_raw_fd()
    }

    /// Empties the wake-up eventfd.
    pub(crate) fn drain(&self) {
        let _ = self.wake.read();
    }
}

/// The counters of a device's limiter, `<dev>.rate_limited.*`.
#[derive(Clone)]
pub(crate) struct RateCounters {
    throttled_events: Arc<Counter>,
    throttled_ns: Arc<Counter>,
    bytes_deferred: Arc<Counter>,
    ops_deferred: Arc<Counter>,
    bw_bytes_per_s: Arc<Counter>,
    bw_capacity: Arc<Counter>,
    ops_per_s: Arc<Counter>,
    ops_capacity: Arc<Counter>,
}

impl RateCounters {
    pub fn new(stats: &StatsRegistry, name: &str) -> Self {
        let c = |n: &str| stats.counter(format!("{name}.rate_limited.{n}"));
        RateCounters {
            throttled_events: c("throttled_events"),
            throttled_ns: c("throttled_ns"),
            bytes_deferred: c("bytes_deferred"),
            ops_deferred: c("ops_deferred"),
            bw_bytes_per_s: c("bw_bytes_per_s"),
            bw_capacity: c("bw_capacity"),
            ops_per_s: c("ops_per_s"),
            ops_capacity: c("ops_capacity"),
        }
    }

    pub fn show(&self, cfg: &RateLimiterConfig) {
        let b = cfg.bandwidth.unwrap_or_default();
        let o = cfg.ops.unwrap_or_default();
        self.bw_bytes_per_s
            .set(cfg.bandwidth.map_or(0, |b| b.rate_per_s()));
        self.bw_capacity.set(b.size);
        self.ops_per_s.set(cfg.ops.map_or(0, |o| o.rate_per_s()));
        self.ops_capacity.set(o.size);
    }
}

/// A device worker's side of its limits: the buckets, whether a request waits, and when to
/// come back for it.
pub(crate) struct Throttle {
    control: Arc<RateControl>,
    seen: u64,
    limiter: Option<Limiter>,
    /// Since when the first request waits (None: nothing waits).
    held_since: Option<Instant>,
    /// When the waiting request can go.
    wake: Option<Instant>,
    c: RateCounters,
}

impl Throttle {
    pub fn new(control: Arc<RateControl>, c: RateCounters) -> Self {
        let seen = control.generation();
        let cfg = control.get();
        c.show(&cfg);
        let now = Instant::now();
        Throttle {
            control,
            seen,
            limiter: (!cfg.is_unlimited()).then(|| Limiter::new(&cfg, now)),
            held_since: None,
            wake: None,
            c,
        }
    }

    /// Takes the limits the control holds if they changed.
    fn follow(&mut self, now: Instant) {
        let g = self.control.generation();
        if g == self.seen {
            return;
        }
        self.seen = g;
        let cfg = self.control.get();
        self.c.show(&cfg);
        self.limiter = match (&self.limiter, cfg.is_unlimited()) {
            (_, true) => None,
            (Some(l), false) => Some(l.reshaped(&cfg, now)),
            (None, false) => Some(Limiter::new(&cfg, now)),
        };
        self.wake = None;
    }

    /// Whether a request of `bytes` may be served now; if not it waits (the caller leaves it in
    /// the ring) and [`Throttle::wake_at`] says when to try again.
    pub fn admit(&mut self, bytes: u64) -> bool {
        // The unlimited device's fast path: one atomic load, no clock.
        if self.limiter.is_none()
            && self.held_since.is_none()
            && self.control.generation() == self.seen
        {
            return true;
        }
        let now = Instant::now();
        self.follow(now);
        let Some(l) = &mut self.limiter else {
            self.release(now);
            return true;
        };
        if l.try_take(bytes, now) {
            self.release(now);
            return true;
        }
        if self.held_since.is_none() {
            self.held_since = Some(now);
            self.c.throttled_events.inc();
            self.c.bytes_deferred.add(bytes);
            self.c.ops_deferred.inc();
        }
        self.wake = l.ready_at(bytes);
        false
    }

    fn release(&mut self, now: Instant) {
        self.wake = None;
        if let Some(t) = self.held_since.take() {
            self.c
                .throttled_ns
                .add(now.saturating_duration_since(t).as_nanos() as u64);
        }
    }

    /// The size of the bytes bucket in force, if there is one.
    pub fn bytes_bucket(&mut self) -> Option<u64> {
        self.follow(Instant::now());
        let b = self.limiter.as_ref()?.bandwidth.as_ref()?;
        Some(b.size)
    }

    /// A request waits for tokens.
    pub fn holding(&self) -> bool {
        self.held_since.is_some()
    }

    /// When the waiting request can go, if one waits.
    pub fn wake_at(&self) -> Option<Instant> {
        self.held_since.and(self.wake)
    }

    /// The eventfd that says the limits changed.
    pub fn wake_fd(&self) -> RawFd {
        self.control.wake_fd()
    }

    /// The limits changed (the worker saw the eventfd): forget the wait so that the next look
    /// at the queue asks the new buckets.
    pub fn on_change(&mut self) {
        self.control.drain();
        self.follow(Instant::now());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bucket(size: u64, burst: Option<u64>, refill_ms: u64) -> TokenBucketConfig {
        TokenBucketConfig {
            size,
            one_time_burst: burst,
            refill_time: refill_ms,
        }
    }

    #[test]
    fn a_bucket_starts_full_and_refills_at_its_rate() {
        let t0 = Instant::now();
        let mut b = TokenBucket::new(&bucket(1000, None, 1000), t0);
        assert!(b.try_take(600, t0));
        assert!(!b.try_take(600, t0));
        // 400 left; 200 more take 200 ms.
        assert_eq!(b.ready_at(600), t0 + Duration::from_millis(200));
        assert!(!b.try_take(600, t0 + Duration::from_millis(199)));
        assert!(b.try_take(600, t0 + Duration::from_millis(200)));
        // Never more than the bucket, however long it waits.
        let later = t0 + Duration::from_secs(60);
        assert!(b.try_take(1000, later));
        assert!(!b.try_take(1, later));
    }

    #[test]
    fn the_one_time_burst_goes_first_and_does_not_refill() {
        let t0 = Instant::now();
        let mut b = TokenBucket::new(&bucket(100, Some(250), 100), t0);
        assert!(b.try_take(200, t0));
        assert_eq!(b.burst_left(), 50);
        // 50 from the burst, 100 from the bucket.
        assert!(b.try_take(150, t0));
        assert_eq!((b.burst_left(), b.tokens()), (0, 0));
        assert!(!b.try_take(1, t0));
        let later = t0 + Duration::from_secs(10);
        assert!(b.try_take(100, later));
        assert_eq!(b.burst_left(), 0);
        assert!(!b.try_take(1, later));
    }

    #[test]
    fn a_request_larger_than_the_bucket_waits_for_a_full_one_and_leaves_debt() {
        let t0 = Instant::now();
        let mut b = TokenBucket::new(&bucket(1000, None, 1000), t0);
        assert!(b.try_take(1, t0));
        assert!(!b.try_take(3000, t0));
        assert_eq!(b.ready_at(3000), t0 + Duration::from_millis(1));
        let t1 = t0 + Duration::from_millis(1);
        assert!(b.try_take(3000, t1));
        assert_eq!(b.tokens(), -2000);
        // The debt and a token more: 2.001 s.
        assert_eq!(b.ready_at(1), t1 + Duration::from_millis(2001));
    }

    /// Requests of every size, on a simulated clock, for 10 s: the tokens taken stay within
    /// one bucket (and one request) of the rate, for several rates and refill times.
    #[test]
    fn the_long_run_rate_is_exact() {
        for (size, refill_ms, req) in [
            (125_000u64, 1000u64, 1514u64),
            (1 << 20, 1000, 65536),
            (100, 1000, 1),
            (12_345, 7, 4096),
            (1000, 100, 3000),
        ] {
            let t0 = Instant::now();
            let mut b = TokenBucket::new(&bucket(size, None, refill_ms), t0);
            let (mut now, mut taken) = (t0, 0u64);
            let end = t0 + Duration::from_secs(10);
            while now < end {
                if b.try_take(req, now) {
                    taken += req;
                } else {
                    now = b.ready_at(req);
                }
            }
            let ideal = (u128::from(size) * 10_000 / u128::from(refill_ms)) as u64;
            assert!(
                taken <= ideal + size + req,
                "{size}/{refill_ms}: {taken} > {ideal}"
            );
            assert!(
                taken + 2 * req >= ideal,
                "{size}/{refill_ms}: {taken} < {ideal}"
            );
        }
    }

    #[test]
    fn a_limiter_takes_from_both_buckets_or_neither() {
        let t0 = Instant::now();
        let cfg = RateLimiterConfig {
            bandwidth: Some(bucket(10_000, None, 1000)),
            ops: Some(bucket(2, None, 1000)),
        };
        let mut l = Limiter::new(&cfg, t0);
        assert!(l.try_take(4000, t0));
        assert!(l.try_take(4000, t0));
        // Bytes would do (2000 left) but operations are out.
        assert!(!l.try_take(1000, t0));
        assert_eq!(l.bandwidth.as_ref().unwrap().tokens(), 2000);
        assert_eq!(l.ready_at(1000), Some(t0 + Duration::from_millis(500)));
        // Bytes are short: 2000 + 500 ms × 10 kB/s = 7000 < 8000; an op is there.
        let t1 = t0 + Duration::from_millis(500);
        assert!(!l.try_take(8000, t1));
        assert_eq!(l.ops.as_ref().unwrap().tokens(), 1);
        assert_eq!(l.ready_at(8000), Some(t1 + Duration::from_millis(100)));
        assert!(l.try_take(8000, t1 + Duration::from_millis(100)));
    }

    #[test]
    fn reshaping_keeps_tokens_up_to_the_new_size() {
        let t0 = Instant::now();
        let l = Limiter::new(
            &RateLimiterConfig {
                bandwidth: Some(bucket(10_000, None, 1000)),
                ops: None,
            },
            t0,
        );
        let lower = RateLimiterConfig {
            bandwidth: Some(bucket(1000, Some(0), 1000)),
            ops: Some(bucket(5, None, 1000)),
        };
        let r = l.reshaped(&lower, t0);
        assert_eq!(r.bandwidth.as_ref().unwrap().tokens(), 1000);
        assert_eq!(r.ops.as_ref().unwrap().tokens(), 5);
        let mut l = l;
        assert!(l.try_take(9000, t0));
        let higher = RateLimiterConfig {
            bandwidth: Some(bucket(100_000, None, 1000)),
            ops: None,
        };
        let r = l.reshaped(&higher, t0);
        assert_eq!(r.bandwidth.as_ref().unwrap().tokens(), 1000);
        assert!(r.ops.is_none());
    }

    #[test]
    fn configs_are_checked() {
        let ok = RateLimiterConfig {
            bandwidth: Some(TokenBucketConfig::per_second(1 << 20, None)),
            ops: Some(bucket(100, Some(10), 1000)),
        };
        ok.validate().unwrap();
        assert_eq!(ok.bandwidth.unwrap().rate_per_s(), 1 << 20);
        for bad in [
            bucket(0, None, 1000),
            bucket(1, None, 0),
            bucket(1, None, 3_600_001),
        ] {
            let c = RateLimiterConfig {
                bandwidth: None,
                ops: Some(bad),
            };
            assert!(c.validate().is_err(), "{bad:?}");
        }
        assert_eq!(
            ok.to_string(),
            "1048576 B/s (bucket 1048576), 100 ops/s (bucket 100, one-time burst 10)"
        );
        assert_eq!(RateLimiterConfig::default().to_string(), "unlimited");
        let json = r#"{"bandwidth": {"size": 1000, "refill_time": 100}, "ops": null}"#;
        let c: RateLimiterConfig = serde_json::from_str(json).unwrap();
        assert_eq!(c.bandwidth.unwrap().rate_per_s(), 10_000);
        assert!(serde_json::from_str::<RateLimiterConfig>(r#"{"bw": {}}"#).is_err());
    }

    #[test]
    fn a_control_change_reaches_the_throttle() {
        let stats = StatsRegistry::default();
        let ctl = RateControl::new(RateLimiterConfig {
            bandwidth: None,
            ops: Some(bucket(1, None, 3_600_000)),
        })
        .unwrap();
        let mut t = Throttle::new(ctl.clone(), RateCounters::new(&stats, "d"));
        assert!(t.admit(10));
        assert!(!t.admit(10));
        assert!(t.holding() && t.wake_at().is_some());
        assert_eq!(stats.counter("d.rate_limited.throttled_events").get(), 1);
        assert_eq!(stats.counter("d.rate_limited.ops_per_s").get(), 0);
        ctl.set(RateLimiterConfig::default()).unwrap();
        t.on_change();
        assert!(t.admit(10));
        assert!(!t.holding());
        assert_eq!(stats.counter("d.rate_limited.ops_capacity").get(), 0);
        assert_eq!(stats.counter("d.rate_limited.ops_deferred").get(), 1);
    }
}
