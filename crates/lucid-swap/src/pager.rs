//! The pager: keeps a VM's memory cgroup under its limit by paging guest RAM out itself
//! (`MADV_PAGEOUT`), because on some hosts the kernel's own limit reclaim cannot.
//!
//! Why: KVM faults guest memory in through GUP, and on this PVM host the kernel's reclaim finds
//! every guest page recently used (active_anon holds everything, inactive_anon nothing), so
//! direct reclaim at the limit fails and the memcg OOM killer ends the VM instead of swapping
//! it. `MADV_PAGEOUT` reclaims the pages it names whatever their referenced bits say.
//!
//! How: a `lucid-pager` thread sleeps until the cgroup's usage crosses a high-water mark
//! (limit − headroom; cgroup v1 `cgroup.event_control` threshold eventfd, with a short poll as
//! fallback and on v2), then pages guest RAM out in 2 MiB chunks, in clock order over the RAM
//! regions (a FIFO-like sweep, not the kernel's LRU: it does not know which pages the guest
//! uses), until usage is under a low-water mark (limit − 2 × headroom). While it runs, v1's
//! `memory.oom_control` is 1 (`oom_kill_disable`): a vCPU that outruns the pager waits in the
//! kernel until the pager frees memory instead of being killed. If the pager frees nothing for
//! [`PagerConfig::stall`] *and* has paged out every chunk of guest RAM in that time (a whole
//! fruitless sweep: swap full, nothing left to move), it sets `oom_control` back to 0, so the VM
//! gets a clear OOM kill instead of a hang, and counts a stall. Time alone is no evidence: a
//! pager thread that a busy host did not run for seconds has not tried. In mapper modes, `MADV_PAGEOUT` drops clean
//! file-backed guest pages without writing swap.
//!
//! The thread allocates nothing in its loop and touches its stack first: it runs in the same
//! cgroup it reclaims, and a charge of its own at the limit would wait like the vCPUs.
//!
//! After a sweep that freed nothing it also drops the disk images' page cache that no guest page
//! maps any more (`POSIX_FADV_DONTNEED`): in the mapper modes, a guest overwriting pages it read
//! leaves their page-cache pages charged to the cgroup and out of `madvise`'s reach.
//!
//! Counters `swap.pager.{wakeups, chunks, bytes, stalls, cache_drops}` (`bytes`: usage freed
//! while paging, a lower bound while vCPUs refill).

use std::fs::File;
use std::io::{self, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use lucid_seccomp::Role;
use lucid_stats::{Counter, StatsRegistry, ThreadRole};
use lucid_thread::{Background, Spawner, ThreadSpec};

use crate::limit::MemoryLimit;

/// The pager's marks and pace.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PagerConfig {
    /// The cgroup's limit in bytes.
    pub limit: u64,
    /// Paging starts at `limit - headroom` and stops under `limit - 2 * headroom`.
    pub headroom: u64,
    /// Bytes of guest RAM per `MADV_PAGEOUT`.
    pub chunk: u64,
    /// Time without freeing anything, at or above the high mark, after which the OOM killer is
    /// turned back on, provided the pager paged out all of guest RAM in that time
    /// ([`PagerConfig::stalled`]).
    pub stall: Duration,
    /// The longest sleep between two usage checks.
    pub poll: Duration,
}

impl PagerConfig {
    /// Headroom max(4 MiB, limit / 16), 2 MiB chunks, a 3 s stall, a 20 ms poll.
    pub fn for_limit(limit: u64) -> PagerConfig {
        PagerConfig {
            limit,
            headroom: (4 << 20).max(limit / 16),
            chunk: 2 << 20,
            stall: Duration::from_secs(3),
            poll: Duration::from_millis(20),
        }
    }

    /// Usage at which paging starts.
    pub fn high(&self) -> u64 {
        self.limit.saturating_sub(self.headroom)
    }

    /// Usage under which paging stops.
    pub fn low(&self) -> u64 {
        self.limit.saturating_sub(2 * self.headroom)
    }

    /// Whether paging cannot progress: nothing freed for `stall` and, in that time,
    /// `fruitless_chunks` paged out without freeing anything, at least every one of the
    /// `clock_chunks` of guest RAM (a whole sweep).
    pub fn stalled(
        &self,
        since_progress: Duration,
        fruitless_chunks: usize,
        clock_chunks: usize,
    ) -> bool {
        since_progress >= self.stall && fruitless_chunks >= clock_chunks
    }
}

/// The host ranges `(address, length)` of guest RAM cut into chunks of at most `chunk` bytes, in
/// address order: the clock's positions.
pub fn chunks(ranges: &[(u64, u64)], chunk: u64) -> Vec<(u64, u64)> {
    let chunk = chunk.max(4096);
    let mut v = Vec::new();
    for &(addr, len) in ranges {
        let mut off = 0;
        while off < len {
            let n = chunk.min(len - off);
            v.push((addr + off, n));
            off += n;
        }
    }
    v
}

/// memory.stat keys logged at a stall: what holds the memory the pager cannot move.
const STALL_KEYS: [&str; 12] = [
    "rss",
    "cache",
    "anon",
    "file",
    "kernel",
    "sock",
    "shmem",
    "mapped_file",
    "swap",
    "active_anon",
    "inactive_anon",
    "unevictable",
];

struct Counters {
    wakeups: Arc<Counter>,
    chunks: Arc<Counter>,
    bytes: Arc<Counter>,
    stalls: Arc<Counter>,
    cache_drops: Arc<Counter>,
}

/// What the thread reads and writes, all opened before it is confined.
struct Files {
    usage: File,
    /// memory.stat, for the log line of a stall.
    stat: Option<File>,
    /// The VM's disk images.
    images: Vec<File>,
    threshold: Option<OwnedFd>,
    oom_control: Option<File>,
}

impl Files {
    fn usage(&self) -> Option<u64> {
        crate::limit::pread_u64(&self.usage)
    }

    /// Drops the disk images' page cache that no guest page maps any more (`FADV_DONTNEED`
    /// skips mapped pages and writes dirty ones back first): what the mapper modes leave behind
    /// when the guest overwrites pages it read, charged to the cgroup and out of `madvise`'s
    /// reach.
    fn drop_image_cache(&self) {
        for f in &self.images {
            // SAFETY: fadvise on a descriptor we own; no memory is involved.
            unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        }
    }

    /// v1's `oom_kill_disable`; nothing on v2.
    fn set_oom_kill_disable(&self, disable: bool) {
        if let Some(f) = &self.oom_control {
            let v: &[u8] = if disable { b"1" } else { b"0" };
            if let Err(e) = (&*f).write_all(v) {
                log::warn!(
                    "pager: cannot set oom_kill_disable={}: {e}",
                    u8::from(disable)
                );
            }
        }
    }

    /// Sleeps until the usage threshold fires or `timeout` passes.
    fn wait(&self, timeout: Duration) {
        let Some(efd) = &self.threshold else {
            std::thread::sleep(timeout);
            return;
        };
        let mut p = libc::pollfd {
            fd: efd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = timeout.as_millis().min(i32::MAX as u128) as i32;
        // SAFETY: one pollfd that lives across the call.
        let r = unsafe { libc::poll(&mut p, 1, ms) };
        if r > 0 {
            let mut v = [0u8; 8];
            // SAFETY: reads 8 bytes into `v` from our non-blocking eventfd (drains it).
            unsafe { libc::read(efd.as_raw_fd(), v.as_mut_ptr().cast(), 8) };
        }
    }
}

/// The running `lucid-pager` thread; dropping it stops it (and turns the OOM killer back on).
pub struct Pager {
    thread: Background,
}

impl Pager {
    /// Starts `lucid-pager` over guest RAM's host `ranges` for the cgroup of `limit`; `images`
    /// are the VM's disk images, whose unmapped page cache it drops when guest RAM has nothing
    /// left to page out. The thread confines itself to the pager's seccomp role (an error ends
    /// it with a log line). Sets `oom_kill_disable` (v1) while it runs.
    pub fn spawn(
        limit: &MemoryLimit,
        ranges: Vec<(u64, u64)>,
        images: Vec<File>,
        config: PagerConfig,
        stats: &StatsRegistry,
        spawner: &Spawner,
    ) -> io::Result<Pager> {
        let threshold = match limit.usage_threshold(config.high()) {
            Ok(fd) => Some(fd),
            Err(e) => {
                log::debug!(
                    "pager: no usage threshold ({e}): polling every {:?}",
                    config.poll
                );
                None
            }
        };
        let files = Files {
            usage: limit.usage_file()?,
            stat: limit.stat_file().ok(),
            images,
            threshold,
            oom_control: limit.oom_control_file(),
        };
        if files.oom_control.is_none() {
            log::info!(
                "pager: no memory.oom_control (cgroup v2): a vCPU that outruns the pager meets the \
                 OOM killer"
            );
        }
        let c = |n: &str| stats.counter(format!("swap.pager.{n}"));
        let counters = Counters {
            wakeups: c("wakeups"),
            chunks: c("chunks"),
            bytes: c("bytes"),
            stalls: c("stalls"),
            cache_drops: c("cache_drops"),
        };
        let clock = chunks(&ranges, config.chunk);
        files.set_oom_kill_disable(true);
        log::info!(
            "pager: pages guest RAM out from {} MiB of usage down to {} MiB (limit {} MiB)",
            config.high() >> 20,
            config.low() >> 20,
            config.limit >> 20
        );
        let spec = ThreadSpec::new("lucid-pager", ThreadRole::Other, Role::Pager)
            .before_confine(touch_stack);
        let thread = spawner
            .spawn_background(spec, move |confined, thread_stop| {
                if let Err(e) = confined {
                    log::error!("pager: {e}");
                    files.set_oom_kill_disable(false);
                    return;
                }
                run(&files, &clock, &config, &counters, thread_stop);
                files.set_oom_kill_disable(false);
            })
            .map_err(io::Error::other)?;
        Ok(Pager { thread })
    }

    /// Stops the thread and waits for it.
    pub fn stop(mut self) {
        self.thread.stop();
    }
}

/// Faults in 64 KiB of this thread's stack, so that the loop never charges a page to the
/// cgroup it is reclaiming.
#[inline(never)]
fn touch_stack() {
    let mut buf = [0u8; 64 << 10];
    // SAFETY: a volatile write into our own stack array; it keeps the compiler from eliding it.
    unsafe { std::ptr::write_volatile(buf.as_mut_ptr().add(buf.len() - 1), 1) };
    for b in buf.iter_mut().step_by(4096) {
        // SAFETY: as above, one byte per page of the array.
        unsafe { std::ptr::write_volatile(b, 1) };
    }
}

fn pageout(addr: u64, len: u64) {
    // SAFETY: `addr..addr+len` is guest RAM this process maps for the VM's life; MADV_PAGEOUT
    // only reclaims (the contents stay what they were, read back from swap or the file).
    unsafe { libc::madvise(addr as *mut libc::c_void, len as usize, libc::MADV_PAGEOUT) };
}

fn run(files: &Files, clock: &[(u64, u64)], cfg: &PagerConfig, c: &Counters, stop: &AtomicBool) {
    if clock.is_empty() {
        return;
    }
    let mut hand = 0usize;
    let mut oom_kill_on = false;
    while !stop.load(Ordering::Acquire) {
        files.wait(cfg.poll);
        let Some(mut usage) = files.usage() else {
            continue;
        };
        if usage < cfg.high() {
            continue;
        }
        c.wakeups.inc();
        let mut last_progress = Instant::now();
        // Chunks paged out since the last progress (for a stall), and since then or the last
        // fruitless sweep (for the next cache drop).
        let mut fruitless = 0usize;
        let mut idle_sweep = 0usize;
        while usage > cfg.low() && !stop.load(Ordering::Acquire) {
            let (addr, len) = clock[hand];
            hand = (hand + 1) % clock.len();
            pageout(addr, len);
            c.chunks.inc();
            let Some(now) = files.usage() else {
                break;
            };
            if now < usage {
                c.bytes.add(usage - now);
                last_progress = Instant::now();
                fruitless = 0;
                idle_sweep = 0;
            } else {
                fruitless += 1;
                idle_sweep += 1;
            }
            usage = now;
            if usage < cfg.high() {
                last_progress = Instant::now();
                fruitless = 0;
            }
            if !oom_kill_on && cfg.stalled(last_progress.elapsed(), fruitless, clock.len()) {
                // Nothing freed for a while at the limit, though every chunk of guest RAM was
                // paged out since: swap is full or nothing is left to page out. A clear OOM
                // kill beats a VM hung in the kernel.
                c.stalls.inc();
                let stat = files
                    .stat
                    .as_ref()
                    .and_then(|f| crate::limit::pread_to_string(f).ok())
                    .map(|s| {
                        crate::limit::parse_stat(&s)
                            .into_iter()
                            .filter(|(k, _)| STALL_KEYS.contains(&k.as_str()))
                            .map(|(k, v)| format!("{k}={}K", v >> 10))
                            .collect::<Vec<_>>()
                            .join(" ")
                    })
                    .unwrap_or_default();
                log::warn!(
                    "pager: {} MiB in use, nothing freed for {:?} over {fruitless} chunks (all \
                     of guest RAM): turning the OOM killer back on (is swap full?) [{stat}]",
                    usage >> 20,
                    last_progress.elapsed()
                );
                files.set_oom_kill_disable(false);
                oom_kill_on = true;
            }
            if idle_sweep >= clock.len() {
                files.drop_image_cache();
                c.cache_drops.inc();
                // A whole sweep freed nothing. Under the high mark, what is left is not guest
                // RAM the pager can move: wait for the next crossing. Above it, let the vCPUs
                // (and swap I/O) move, and try again.
                if usage < cfg.high() {
                    break;
                }
                idle_sweep = 0;
                std::thread::sleep(Duration::from_millis(5));
            }
        }
        if oom_kill_on && usage <= cfg.low() {
            files.set_oom_kill_disable(true);
            oom_kill_on = false;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn marks_and_chunks() {
        let c = PagerConfig::for_limit(64 << 20);
        assert_eq!(c.headroom, 4 << 20);
        assert_eq!(c.high(), 60 << 20);
        assert_eq!(c.low(), 56 << 20);
        // A stall needs the time and a whole fruitless sweep: a pager that was not run for
        // seconds has not tried, and one that freed nothing in one pass may see writeback end.
        let s = Duration::from_secs(3);
        assert!(!c.stalled(s, 10, 32), "the pager did not get to try");
        assert!(!c.stalled(s - Duration::from_millis(1), 32, 32));
        assert!(c.stalled(s, 32, 32));
        assert!(c.stalled(s * 2, 500, 32));
        let c = PagerConfig::for_limit(1 << 30);
        assert_eq!(c.headroom, 64 << 20);
        let v = chunks(&[(0x1000_0000, 5 << 20), (0x2000_0000, 1 << 20)], 2 << 20);
        assert_eq!(
            v,
            vec![
                (0x1000_0000, 2 << 20),
                (0x1020_0000, 2 << 20),
                (0x1040_0000, 1 << 20),
                (0x2000_0000, 1 << 20)
            ]
        );
    }
}
