//! SwapBypass in the VMM (docs/symbiotic.md §6): the swap cache
//! (`lucid_sym::swapcache`) in front of a virtio-blk swap disk (`--blk ...,swapcache=MiB`),
//! through the device's [`BlockCache`] seam, on its worker thread.
//!
//! Before a dirty slot leaves the cache unwritten Lucid asks the guest whether the slot is still
//! live (with `liveness=spy` the SymSpy map below is asked first, the SymCall only when the
//! guest published none): first by SymCall `SLOT_LIVE` on vCPU 0 (from the worker thread, never a vCPU thread:
//! the option is refused on rung L0), else, when the call fails (no SymCall entry, the call
//! runtime not available, a timeout), from the swap map the guest publishes in SymSpy
//! (`G_SWAP_MAP`/`G_SWAP_MAP_LEN`, for the disk at PCI slot `G_SWAP_DEVICE`), read without an
//! exit; with neither the answer is "live" (a write-back: always safe), counted in
//! `sym.swap.liveness_unknown`.
//!
//! The swap map: `G_SWAP_MAP_LEN` little-endian u32 entries indexed by guest page number,
//! 0 = not swapped, else slot + 1.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::{Arc, Mutex, Weak};

use lucid_mem::vm_memory::{Bytes, GuestAddress};
use lucid_stats::{Counter, StatsRegistry};
use lucid_sym::abi;
use lucid_sym::swapcache::{Liveness, SwapBackend, SwapCache, SwapCacheStats, SLOT_SIZE};
use lucid_virtio::blk::BlockCache;

use super::{SymCallError, Symbiotic};

/// Largest swap map Lucid reads (entries): 4 GiB of guest pages.
const MAX_MAP_ENTRIES: u64 = 1 << 20;
/// Slots the SymSpy map can vouch for (64 GiB of swap; a 2 MiB bitset at most): a slot above
/// gets no answer from the map (so it is written back), whatever the guest wrote there.
const MAX_MAP_SLOTS: u64 = 1 << 24;

/// Declares the `sym.swap.*` counters that mirror [`SwapCacheStats`] fields of the same name,
/// once: their struct, registration and update.
macro_rules! mirrored_counters {
    ($($f:ident),* $(,)?) => {
        /// `sym.swap.*` counters mirroring the cache's own counts after each request.
        struct Mirrored {
            $($f: Arc<Counter>,)*
        }

        impl Mirrored {
            fn new(c: impl Fn(&str) -> Arc<Counter>) -> Self {
                Mirrored { $($f: c(stringify!($f)),)* }
            }

            fn set(&self, s: &SwapCacheStats) {
                $(self.$f.set(s.$f);)*
            }
        }
    };
}

mirrored_counters!(
    hits,
    misses,
    writes_cached,
    writebacks,
    writebacks_avoided,
    flush_writebacks,
    flush_writebacks_avoided,
    discards,
    evictions,
    bytes_read_cache,
    bytes_read_disk,
    bytes_written_disk,
    liveness_unknown,
);

/// `sym.swap.*` counters: the cache's own counts, mirrored after each request, and how
/// liveness questions were answered.
struct SwapCounters {
    cache: Mirrored,
    liveness_symcall: Arc<Counter>,
    liveness_spy: Arc<Counter>,
    symcall_errors: Arc<Counter>,
    flushes: Arc<Counter>,
    capacity_slots: Arc<Counter>,
    cached_slots: Arc<Counter>,
}

/// The swap cache of one disk; the device's [`BlockCache`].
pub struct SwapCacheDevice {
    cache: Mutex<State>,
    /// The VM's symbiotic state (weak: it outlives no VM).
    sym: Weak<Symbiotic>,
    /// The disk's PCI slot (what the guest publishes in `G_SWAP_DEVICE`).
    pci_slot: u32,
    /// Ask the SymSpy map before the SymCall (`liveness=spy`).
    spy_first: bool,
    c: SwapCounters,
}

struct State {
    cache: SwapCache,
    /// A 4 KiB-aligned slot for write-backs (the image may be open `O_DIRECT`).
    scratch: Vec<u8>,
    /// Reused buffer for the swap map.
    map: Vec<u8>,
    /// Live slots by the swap map, one bit each: built at a request's first liveness question
    /// and used for the rest of that request (a flush asks about every dirty slot); the guest
    /// may change its map between requests, so each request builds it afresh.
    live: Vec<u64>,
}

impl SwapCacheDevice {
    pub fn new(
        mib: u32,
        pci_slot: u32,
        spy_first: bool,
        stats: &StatsRegistry,
        sym: &Arc<Symbiotic>,
    ) -> Arc<Self> {
        let c = |n: &str| stats.counter(format!("sym.swap.{n}"));
        let slots = (u64::from(mib) << 20) / SLOT_SIZE as u64;
        let dev = SwapCacheDevice {
            cache: Mutex::new(State {
                cache: SwapCache::new(slots as usize),
                scratch: vec![0; 2 * SLOT_SIZE],
                map: Vec::new(),
                live: Vec::new(),
            }),
            sym: Arc::downgrade(sym),
            pci_slot,
            spy_first,
            c: SwapCounters {
                cache: Mirrored::new(c),
                liveness_symcall: c("liveness_symcall"),
                liveness_spy: c("liveness_spy"),
                symcall_errors: c("symcall_errors"),
                flushes: c("flushes"),
                capacity_slots: c("capacity_slots"),
                cached_slots: c("cached_slots"),
            },
        };
        dev.c.capacity_slots.set(slots);
        Arc::new(dev)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.cache.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Runs `f` on the cache with a backend over `file`, then mirrors the counts.
    fn with<T>(
        &self,
        file: &File,
        f: impl FnOnce(&mut SwapCache, &mut Be<'_>) -> std::io::Result<T>,
    ) -> std::io::Result<T> {
        let sym = self.sym.upgrade();
        let mut st = self.lock();
        let State {
            cache,
            scratch,
            map,
            live,
        } = &mut *st;
        let mut be = Be {
            file,
            sym: sym.as_deref(),
            pci_slot: self.pci_slot,
            spy_first: self.spy_first,
            scratch,
            map,
            live,
            live_built: None,
            calls_off: false,
            c: &self.c,
        };
        let r = f(cache, &mut be);
        self.mirror(cache.stats(), cache.len());
        r
    }

    fn mirror(&self, s: SwapCacheStats, len: usize) {
        self.c.cache.set(&s);
        self.c.cached_slots.set(len as u64);
    }
}

/// The cache's view of the disk and the guest during one request.
struct Be<'a> {
    file: &'a File,
    sym: Option<&'a Symbiotic>,
    pci_slot: u32,
    spy_first: bool,
    scratch: &'a mut Vec<u8>,
    map: &'a mut Vec<u8>,
    live: &'a mut Vec<u64>,
    /// Whether `live` was built in this request (`Some(false)`: no usable map).
    live_built: Option<bool>,
    /// A SymCall was cut off in this request (timeout, too many exits, vCPU gone): ask no
    /// more by SymCall until the next request, or a flush of many dirty slots would wait the
    /// call timeout once per slot.
    calls_off: bool,
    c: &'a SwapCounters,
}

impl Be<'_> {
    /// A 4 KiB-aligned slot inside `scratch`.
    fn aligned(&mut self) -> &mut [u8] {
        let start = (SLOT_SIZE - self.scratch.as_ptr() as usize % SLOT_SIZE) % SLOT_SIZE;
        &mut self.scratch[start..start + SLOT_SIZE]
    }

    /// Liveness from the swap map in SymSpy, read without an exit; `None` if the guest
    /// published none for this disk.
    fn live_from_spy(&mut self, sym: &Symbiotic, slot: u64) -> Option<Liveness> {
        if self.live_built.is_none() {
            self.live_built = Some(self.build_live(sym).is_some());
        }
        if self.live_built != Some(true) || slot >= MAX_MAP_SLOTS {
            return None;
        }
        let word = self.live.get((slot / 64) as usize).copied().unwrap_or(0);
        Some(if word >> (slot % 64) & 1 != 0 {
            Liveness::Live
        } else {
            Liveness::Dead
        })
    }

    /// Reads the guest's swap map into the `live` bitset (one pass over the map).
    fn build_live(&mut self, sym: &Symbiotic) -> Option<()> {
        let (gpa, len) = {
            let spy = sym.spy();
            let g = spy.global()?;
            if g.load_u32(abi::page::G_SWAP_DEVICE) != self.pci_slot {
                return None;
            }
            (
                g.load_u64(abi::page::G_SWAP_MAP),
                u64::from(g.load_u32(abi::page::G_SWAP_MAP_LEN)),
            )
        };
        if gpa == 0 || len == 0 || len > MAX_MAP_ENTRIES {
            return None;
        }
        self.map.resize(len as usize * 4, 0);
        // A map outside RAM is the guest's error: no answer, so the slot is written back.
        sym.memory().read_slice(self.map, GuestAddress(gpa)).ok()?;
        self.live.clear();
        for e in self.map.chunks_exact(4) {
            let v = u32::from_le_bytes([e[0], e[1], e[2], e[3]]);
            if v == 0 || u64::from(v) > MAX_MAP_SLOTS {
                continue;
            }
            let s = (v - 1) as usize;
            if self.live.len() <= s / 64 {
                self.live.resize(s / 64 + 1, 0);
            }
            self.live[s / 64] |= 1 << (s % 64);
        }
        Some(())
    }
}

impl SwapBackend for Be<'_> {
    fn write_back(&mut self, slot: u64, data: &[u8]) -> std::io::Result<()> {
        let file = self.file;
        let buf = self.aligned();
        buf.copy_from_slice(data);
        file.write_all_at(buf, slot * SLOT_SIZE as u64)
    }

    fn live(&mut self, slot: u64) -> Liveness {
        let Some(sym) = self.sym else {
            return Liveness::Unknown;
        };
        if self.spy_first {
            if let Some(l) = self.live_from_spy(sym, slot) {
                self.c.liveness_spy.inc();
                return l;
            }
        }
        // No polling: a write-back asks in bulk, and a polling back-end takes a CPU from the
        // vCPUs (of this VM and others) on a small host.
        let limits = super::CallLimits {
            poll: std::time::Duration::ZERO,
            ..sym.call_limits()
        };
        let call = match self.calls_off {
            true => Err(SymCallError::Unavailable),
            false => sym.call_with(0, abi::call::SLOT_LIVE, [slot, 0, 0, 0, 0], limits),
        };
        match call {
            Ok(r) if r.status == abi::SYM_OK => {
                self.c.liveness_symcall.inc();
                return if r.values[0] != 0 {
                    Liveness::Live
                } else {
                    Liveness::Dead
                };
            }
            Ok(r) => {
                self.c.symcall_errors.inc();
                log::debug!("sym.swap: SLOT_LIVE({slot}) returned status {}", r.status);
            }
            Err(SymCallError::Unavailable) if self.calls_off => {}
            Err(e) => {
                self.c.symcall_errors.inc();
                log::debug!("sym.swap: SLOT_LIVE({slot}): {e}");
                self.calls_off = matches!(
                    e,
                    SymCallError::Timeout { .. }
                        | SymCallError::TooManyExits { .. }
                        | SymCallError::Gone(_)
                        | SymCallError::Stopped
                );
            }
        }
        if self.spy_first {
            return Liveness::Unknown;
        }
        match self.live_from_spy(sym, slot) {
            Some(l) => {
                self.c.liveness_spy.inc();
                l
            }
            None => Liveness::Unknown,
        }
    }
}

impl BlockCache for SwapCacheDevice {
    fn read(&self, file: &File, off: u64, buf: &mut [u8]) -> std::io::Result<()> {
        self.with(file, |cache, _| {
            let mut disk = 0u64;
            for (i, chunk) in buf.chunks_mut(SLOT_SIZE).enumerate() {
                let at = off + (i * SLOT_SIZE) as u64;
                if chunk.len() == SLOT_SIZE && cache.read(at / SLOT_SIZE as u64, chunk) {
                    continue;
                }
                // Chunks stay 4 KiB-aligned in the device's aligned bounce buffer.
                file.read_exact_at(chunk, at)?;
                disk += chunk.len() as u64;
            }
            cache.read_disk(disk);
            Ok(())
        })
    }

    fn write(&self, file: &File, off: u64, data: &[u8]) -> std::io::Result<()> {
        self.with(file, |cache, be| {
            for (i, chunk) in data.chunks(SLOT_SIZE).enumerate() {
                let slot = (off + (i * SLOT_SIZE) as u64) / SLOT_SIZE as u64;
                cache.write(slot, chunk, be)?;
            }
            Ok(())
        })
    }

    fn discard(&self, file: &File, off: u64, len: u64) {
        let _ = self.with(file, |cache, _| {
            let s = SLOT_SIZE as u64;
            cache.discard(off / s, len.div_ceil(s));
            Ok(())
        });
    }

    fn flush(&self, file: &File) -> std::io::Result<()> {
        self.c.flushes.inc();
        self.with(file, |cache, be| cache.flush(be))
    }
}
