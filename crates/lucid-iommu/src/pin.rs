//! Host pinning on the translation point.
//!
//! A guest page is pinned while anything can still make a device reach it: a mapping the unit
//! knows of (learnt from a Caching-Mode map invalidation or from a translation miss), a cached
//! IOTLB entry, or a device access that translated before an invalidation removed its mapping
//! and has not finished yet. [`PinBook`] keeps one reference count per guest page (mappings +
//! IOTLB slots); when it drops to zero the page waits for a grace period, [`Brackets`], which
//! ends once every access that began before the removal has ended. Then `PinPolicy::Map`
//! unpins it at once and `PinPolicy::Deferred` batches the unpin (256 pages or 10 ms, whichever
//! comes first, checked whenever the unit runs). `PinPolicy::All` pins all RAM at start and
//! never unpins: the bookkeeping still runs, for the stale-mapping counters.
//!
//! Grace periods use two in-flight counters and a phase bit (a two-phase epoch): an access
//! increments the counter of the current phase in `access_begin` and decrements it in
//! `access_end`. Pages whose last reference went away wait in `next`; a phase flip moves them
//! to `drain`, and once the previous phase's counter reads zero every access that could have
//! translated to them has ended. A flip happens only when the old phase has drained, so two
//! counters suffice. All the counter operations and the IOTLB's first load are SeqCst: an
//! access either sees the invalidation's removal or is seen by the grace check.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use vm_memory::{GuestAddress, GuestMemoryBackend, GuestMemoryRegion};

use crate::GuestMemoryMmap;

/// Host pinning seam (VFIO later). [`MlockPinner`] is the simulated one (mlock/munlock + counts).
pub trait Pinner: Send + Sync {
    /// Pins `len` bytes of guest-physical memory at `gpa`; false if the host refused.
    fn pin(&self, gpa: u64, len: u64) -> bool;
    fn unpin(&self, gpa: u64, len: u64);
}

/// Simulated pinning: `mlock`/`munlock` on the host mapping of the guest range, with counts.
/// A refused `mlock` (RLIMIT_MEMLOCK) is counted and logged once; it is not fatal.
pub struct MlockPinner {
    mem: GuestMemoryMmap,
    locked_bytes: AtomicU64,
    failures: AtomicU64,
    warned: AtomicBool,
}

impl MlockPinner {
    pub fn new(mem: GuestMemoryMmap) -> Self {
        MlockPinner {
            mem,
            locked_bytes: AtomicU64::new(0),
            failures: AtomicU64::new(0),
            warned: AtomicBool::new(false),
        }
    }

    /// Bytes currently locked through this pinner.
    pub fn locked_bytes(&self) -> u64 {
        self.locked_bytes.load(Ordering::Relaxed)
    }

    /// How many pin requests the host refused (or named memory outside guest RAM).
    pub fn failures(&self) -> u64 {
        self.failures.load(Ordering::Relaxed)
    }

    /// The host address of `gpa..gpa+len` if the range lies within one RAM region.
    fn host(&self, gpa: u64, len: u64) -> Option<*mut u8> {
        let r = self.mem.find_region(GuestAddress(gpa))?;
        let end = gpa.checked_add(len)?;
        if end > r.start_addr().0 + r.len() {
            return None;
        }
        self.mem.get_host_address(GuestAddress(gpa)).ok()
    }
}

impl Pinner for MlockPinner {
    fn pin(&self, gpa: u64, len: u64) -> bool {
        let ok = self.host(gpa, len).is_some_and(|p| {
            // SAFETY: `p..p+len` lies inside one mapped guest RAM region (checked by `host`);
            // mlock only changes the pages' residency, not their contents.
            unsafe { libc::mlock(p as *const libc::c_void, len as usize) == 0 }
        });
        if ok {
            self.locked_bytes.fetch_add(len, Ordering::Relaxed);
        } else {
            self.failures.fetch_add(1, Ordering::Relaxed);
            if !self.warned.swap(true, Ordering::Relaxed) {
                log::warn!(
                    "vtd: mlock of guest {gpa:#x}+{len:#x} failed ({}); pinning is simulated, \
                     continuing (further failures only counted)",
                    std::io::Error::last_os_error()
                );
            }
        }
        ok
    }

    fn unpin(&self, gpa: u64, len: u64) {
        if let Some(p) = self.host(gpa, len) {
            // SAFETY: as in `pin`; munlock of a locked range only lifts the lock.
            if unsafe { libc::munlock(p as *const libc::c_void, len as usize) } == 0 {
                self.locked_bytes.fetch_sub(len, Ordering::Relaxed);
            }
        }
    }
}

/// In-flight access brackets (see the module doc).
pub struct Brackets {
    phase: AtomicUsize,
    inflight: [AtomicU64; 2],
    /// Some page waits for a grace period: `access_end` must try to release it.
    pub waiting: AtomicBool,
}

impl Brackets {
    pub fn new() -> Self {
        Brackets {
            phase: AtomicUsize::new(0),
            inflight: [AtomicU64::new(0), AtomicU64::new(0)],
            waiting: AtomicBool::new(false),
        }
    }

    pub fn begin(&self) -> u64 {
        let p = self.phase.load(Ordering::SeqCst);
        self.inflight[p].fetch_add(1, Ordering::SeqCst);
        p as u64
    }

    /// True if this was the last access of its phase and a release is waiting.
    pub fn end(&self, token: u64) -> bool {
        let c = &self.inflight[(token & 1) as usize];
        // Saturating: an unmatched end must not wrap the count and block releases forever.
        let prev = c
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |v| v.checked_sub(1))
            .unwrap_or(0);
        prev == 1 && self.waiting.load(Ordering::SeqCst)
    }

    fn old_drained(&self) -> bool {
        let p = self.phase.load(Ordering::SeqCst);
        self.inflight[1 - p].load(Ordering::SeqCst) == 0
    }

    fn flip(&self) {
        let p = self.phase.load(Ordering::SeqCst);
        self.phase.store(1 - p, Ordering::SeqCst);
    }

    #[cfg(test)]
    pub fn in_flight(&self) -> u64 {
        self.inflight[0].load(Ordering::SeqCst) + self.inflight[1].load(Ordering::SeqCst)
    }
}

#[derive(Default)]
struct PageRef {
    refs: u32,
    /// This book counts the page as pinned (per-page policies).
    held: bool,
    /// The pinner accepted the pin (so an unpin is owed).
    pinned: bool,
    /// How many times the references dropped to zero: a queued release is for the latest
    /// drop only (an earlier one's grace period does not cover accesses made since).
    drops: u64,
}

/// Deferred-unpin limits.
pub const DEFER_MAX_PAGES: usize = 256;
pub const DEFER_MAX_AGE: Duration = Duration::from_millis(10);

/// What a release pass did, for the counters.
#[derive(Default, Debug)]
pub struct Released {
    /// Longest time a released page waited since the invalidation that removed its last
    /// reference reached the unit.
    pub window: Duration,
}

/// Per-guest-page reference counts and the pages waiting to be released (state lock held).
#[derive(Default)]
pub struct PinBook {
    pages: HashMap<u64, PageRef>,
    next: Vec<(u64, Instant, u64)>,
    drain: Vec<(u64, Instant, u64)>,
    deferred: Vec<u64>,
    deferred_since: Option<Instant>,
    /// Pages this book holds pinned (logical: counted even if the pinner refused).
    pub pinned: u64,
}

pub struct PinCtx<'a> {
    pub pinner: &'a dyn Pinner,
    /// Pins per page (Map, Deferred) or not at all (All: everything is pinned already).
    pub per_page: bool,
    pub deferred: bool,
}

impl PinBook {
    /// One more reference to guest page `gpa` (4 KiB aligned); pins it unless already held.
    pub fn add_ref(&mut self, cx: &PinCtx, gpa: u64) {
        let e = self.pages.entry(gpa).or_default();
        e.refs += 1;
        if e.refs != 1 || !cx.per_page {
            return;
        }
        if !e.held {
            e.pinned = cx.pinner.pin(gpa, 4096);
            e.held = true;
            self.pinned += 1;
        } else if !self.deferred.is_empty() {
            // Re-referenced while its deferred unpin was queued: it stays pinned.
            self.deferred.retain(|&p| p != gpa);
        }
    }

    /// One reference fewer; the page waits for a grace period once none is left. `since` is
    /// when the request that removed the reference reached the unit.
    pub fn drop_ref(&mut self, gpa: u64, since: Instant) {
        let Some(e) = self.pages.get_mut(&gpa) else {
            return;
        };
        e.refs = e.refs.saturating_sub(1);
        if e.refs == 0 {
            e.drops += 1;
            self.next.push((gpa, since, e.drops));
        }
    }

    pub fn refs(&self, gpa: u64) -> u32 {
        self.pages.get(&gpa).map_or(0, |e| e.refs)
    }

    /// Pages waiting for a grace period: the VMM-side stale mappings.
    pub fn stale(&self) -> usize {
        self.next.len() + self.drain.len()
    }

    /// Releases what the grace periods allow, flipping phases as needed.
    pub fn release(&mut self, cx: &PinCtx, br: &Brackets, now: Instant) -> Released {
        let mut out = Released::default();
        loop {
            if !br.old_drained() {
                break;
            }
            for (gpa, since, drop) in std::mem::take(&mut self.drain) {
                out.window = out.window.max(now.saturating_duration_since(since));
                self.retire(cx, gpa, drop, now);
            }
            if self.next.is_empty() {
                break;
            }
            self.drain = std::mem::take(&mut self.next);
            br.flip();
        }
        br.waiting.store(
            !self.next.is_empty() || !self.drain.is_empty(),
            Ordering::SeqCst,
        );
        self.flush_deferred(cx, now, false);
        out
    }

    /// The page's grace period is over: unpin it now or queue the unpin.
    fn retire(&mut self, cx: &PinCtx, gpa: u64, drop: u64, now: Instant) {
        let Some(e) = self.pages.get(&gpa) else {
            return;
        };
        if e.refs != 0 || e.drops != drop {
            return;
        }
        if !cx.per_page {
            self.pages.remove(&gpa);
            return;
        }
        if cx.deferred {
            if !self.deferred.contains(&gpa) {
                self.deferred.push(gpa);
                self.deferred_since.get_or_insert(now);
            }
            return;
        }
        self.unpin_now(cx, gpa);
    }

    fn unpin_now(&mut self, cx: &PinCtx, gpa: u64) {
        if let Some(e) = self.pages.remove(&gpa) {
            if e.pinned {
                cx.pinner.unpin(gpa, 4096);
            }
            if e.held {
                self.pinned = self.pinned.saturating_sub(1);
            }
        }
    }

    /// Deferred policy: unpins the batch once it holds 256 pages or is 10 ms old (or `force`).
    pub fn flush_deferred(&mut self, cx: &PinCtx, now: Instant, force: bool) {
        let due = force
            || self.deferred.len() >= DEFER_MAX_PAGES
            || self
                .deferred_since
                .is_some_and(|t| now.saturating_duration_since(t) >= DEFER_MAX_AGE);
        if !due || self.deferred.is_empty() {
            return;
        }
        for gpa in std::mem::take(&mut self.deferred) {
            if self.refs(gpa) == 0 {
                self.unpin_now(cx, gpa);
            }
        }
        self.deferred_since = None;
    }
}

/// Serializes nothing; here so that `Mutex` poisoning handling has one spelling.
pub fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
