//! SwapBypass's swap cache, the pure logic (docs/symbiotic.md §6): a
//! write-back LRU cache of 4 KiB swap slots in front of a swap disk.
//!
//! Writes land in the cache (dirty); reads hit it or miss (the caller reads the disk; misses are
//! not inserted, as in Palacios's cache); a slot read from the cache moves to the cold end of
//! the LRU list (a swap slot is read once: the guest frees it after the swap-in, so it is the
//! best victim, and a dead one costs no write); discards drop cached slots; when the cache is full
//! the least recently used slot is evicted, and a dirty one is written back only if the guest
//! still needs it (asked through [`SwapBackend::live`]: a SymCall in the VMM, a mock in tests):
//! a dead slot is dropped unwritten, a write-back avoided. [`SwapCache::flush`] writes back
//! every dirty live slot, so what a guest flushed survives a `kill -9` of the VMM.
//!
//! No I/O or guest access here: the caller supplies both through [`SwapBackend`].

use std::collections::{BTreeMap, HashMap};

/// Bytes per slot: the swap disk's block size and the guest's page size.
pub const SLOT_SIZE: usize = 4096;
/// Slots per arena chunk (1 MiB).
const CHUNK_SLOTS: usize = 256;

/// What the guest says about a slot's content.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Liveness {
    /// The guest will read the slot again: its content must reach the disk.
    Live,
    /// The guest freed the slot: its content may be dropped.
    Dead,
    /// No answer (no SymCall, a timeout): treated as live, which is always safe.
    Unknown,
}

/// The cache's outside world: the disk (write-back) and the guest (liveness).
pub trait SwapBackend {
    /// Writes one slot's `SLOT_SIZE` bytes to the disk.
    fn write_back(&mut self, slot: u64, data: &[u8]) -> std::io::Result<()>;
    /// Whether the guest will read `slot` again.
    fn live(&mut self, slot: u64) -> Liveness;
}

/// Counts since the cache was made (all monotonic).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SwapCacheStats {
    /// Reads served from the cache, in slots.
    pub hits: u64,
    /// Reads the cache could not serve (the caller read the disk), in slots.
    pub misses: u64,
    /// Slot writes that landed in the cache.
    pub writes_cached: u64,
    /// Dirty slots written to the disk (evictions and flushes).
    pub writebacks: u64,
    /// Dirty slots the guest said were dead, dropped without a write (evictions and flushes).
    pub writebacks_avoided: u64,
    /// Of `writebacks`, those made by flushes (the rest by evictions).
    pub flush_writebacks: u64,
    /// Of `writebacks_avoided`, those at flushes.
    pub flush_writebacks_avoided: u64,
    /// Cached slots dropped by a guest discard or write-zeroes.
    pub discards: u64,
    /// Slots evicted to make room (clean or dirty).
    pub evictions: u64,
    /// Liveness questions left unanswered (treated as live).
    pub liveness_unknown: u64,
    pub bytes_read_cache: u64,
    pub bytes_read_disk: u64,
    pub bytes_written_disk: u64,
}

struct Entry {
    /// Index of the slot's buffer in the arena.
    buf: usize,
    dirty: bool,
    /// Last use; the key of `lru`.
    tick: u64,
}

/// A write-back LRU cache of `capacity` swap slots.
pub struct SwapCache {
    capacity: usize,
    /// Slot buffers in chunks of `CHUNK_SLOTS`, each allocated when first used, so a large
    /// cache costs host memory only as it fills.
    chunks: Vec<Vec<u8>>,
    free: Vec<usize>,
    map: HashMap<u64, Entry>,
    /// tick → slot, oldest first.
    lru: BTreeMap<u64, u64>,
    /// Next tick of a use (grows from the middle of the range).
    tick: u64,
    /// Next tick of a demotion (shrinks from the middle: older than any use).
    cold: u64,
    stats: SwapCacheStats,
}

impl SwapCache {
    /// A cache of `capacity` slots (`capacity * SLOT_SIZE` bytes once filled); 0 caches nothing
    /// (every write goes straight to the disk).
    pub fn new(capacity: usize) -> SwapCache {
        SwapCache {
            capacity,
            chunks: Vec::new(),
            free: (0..capacity).rev().collect(),
            map: HashMap::new(),
            lru: BTreeMap::new(),
            tick: 1 << 62,
            cold: 1 << 62,
            stats: SwapCacheStats::default(),
        }
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Slots held now.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Dirty slots held now.
    pub fn dirty(&self) -> usize {
        self.map.values().filter(|e| e.dirty).count()
    }

    pub fn contains(&self, slot: u64) -> bool {
        self.map.contains_key(&slot)
    }

    pub fn stats(&self) -> SwapCacheStats {
        self.stats
    }

    fn buf(&mut self, i: usize) -> &mut [u8] {
        let (c, o) = (i / CHUNK_SLOTS, i % CHUNK_SLOTS * SLOT_SIZE);
        while self.chunks.len() <= c {
            self.chunks.push(vec![0; CHUNK_SLOTS * SLOT_SIZE]);
        }
        &mut self.chunks[c][o..o + SLOT_SIZE]
    }

    fn touch(&mut self, slot: u64) {
        self.tick += 1;
        let tick = self.tick;
        self.set_tick(slot, tick);
    }

    /// Makes `slot` the next victim.
    fn demote(&mut self, slot: u64) {
        self.cold -= 1;
        let tick = self.cold;
        self.set_tick(slot, tick);
    }

    fn set_tick(&mut self, slot: u64, tick: u64) {
        if let Some(e) = self.map.get_mut(&slot) {
            self.lru.remove(&e.tick);
            e.tick = tick;
            self.lru.insert(tick, slot);
        }
    }

    /// Asks the guest about a dirty slot about to leave the cache: writes it back unless dead.
    fn write_back_if_live(
        &mut self,
        slot: u64,
        buf: usize,
        be: &mut dyn SwapBackend,
    ) -> std::io::Result<bool> {
        match be.live(slot) {
            Liveness::Dead => {
                self.stats.writebacks_avoided += 1;
                Ok(false)
            }
            l => {
                if l == Liveness::Unknown {
                    self.stats.liveness_unknown += 1;
                }
                let (c, o) = (buf / CHUNK_SLOTS, buf % CHUNK_SLOTS * SLOT_SIZE);
                be.write_back(slot, &self.chunks[c][o..o + SLOT_SIZE])?;
                self.stats.writebacks += 1;
                self.stats.bytes_written_disk += SLOT_SIZE as u64;
                Ok(true)
            }
        }
    }

    /// Evicts the least recently used slot (writing it back if dirty and live). On a write-back
    /// error the slot stays cached and dirty.
    fn evict_one(&mut self, be: &mut dyn SwapBackend) -> std::io::Result<()> {
        let Some((&tick, &slot)) = self.lru.iter().next() else {
            return Ok(());
        };
        let (buf, dirty) = {
            let e = &self.map[&slot];
            (e.buf, e.dirty)
        };
        if dirty {
            self.write_back_if_live(slot, buf, be)?;
        }
        self.lru.remove(&tick);
        self.map.remove(&slot);
        self.free.push(buf);
        self.stats.evictions += 1;
        Ok(())
    }

    /// A guest write of one slot (`data` is `SLOT_SIZE` bytes). It lands in the cache; with no
    /// capacity it goes straight to the disk. Evicts the LRU slot first when full.
    pub fn write(
        &mut self,
        slot: u64,
        data: &[u8],
        be: &mut dyn SwapBackend,
    ) -> std::io::Result<()> {
        assert_eq!(data.len(), SLOT_SIZE, "swap cache writes whole slots");
        if self.capacity == 0 {
            be.write_back(slot, data)?;
            self.stats.bytes_written_disk += SLOT_SIZE as u64;
            return Ok(());
        }
        let buf = if let Some(e) = self.map.get_mut(&slot) {
            e.dirty = true;
            e.buf
        } else {
            if self.free.is_empty() {
                self.evict_one(be)?;
            }
            let buf = self.free.pop().expect("a free buffer after an eviction");
            self.map.insert(
                slot,
                Entry {
                    buf,
                    dirty: true,
                    tick: 0,
                },
            );
            buf
        };
        self.buf(buf).copy_from_slice(data);
        self.touch(slot);
        self.stats.writes_cached += 1;
        Ok(())
    }

    /// A guest read of one slot into `out` (`SLOT_SIZE` bytes): true on a hit, and the slot
    /// becomes the next victim. On a miss `out` is untouched; the caller reads the disk and
    /// reports it with [`Self::read_disk`].
    pub fn read(&mut self, slot: u64, out: &mut [u8]) -> bool {
        assert_eq!(out.len(), SLOT_SIZE, "swap cache reads whole slots");
        let Some(buf) = self.map.get(&slot).map(|e| e.buf) else {
            self.stats.misses += 1;
            return false;
        };
        out.copy_from_slice(self.buf(buf));
        self.demote(slot);
        self.stats.hits += 1;
        self.stats.bytes_read_cache += SLOT_SIZE as u64;
        true
    }

    /// Counts `bytes` the caller read from the disk after misses.
    pub fn read_disk(&mut self, bytes: u64) {
        self.stats.bytes_read_disk += bytes;
    }

    /// A guest discard or write-zeroes of slots `first..first+count`: they read as zeros on the
    /// disk afterwards, so cached copies are dropped (dirty or not). Returns the slots dropped.
    pub fn discard(&mut self, first: u64, count: u64) -> u64 {
        let mut dropped = 0;
        let end = first.saturating_add(count);
        let slots: Vec<u64> = if count as usize > self.map.len() {
            self.map
                .keys()
                .copied()
                .filter(|s| (first..end).contains(s))
                .collect()
        } else {
            (first..end).filter(|s| self.map.contains_key(s)).collect()
        };
        for s in slots {
            if let Some(e) = self.map.remove(&s) {
                self.lru.remove(&e.tick);
                self.free.push(e.buf);
                dropped += 1;
            }
        }
        self.stats.discards += dropped;
        dropped
    }

    /// A guest flush: every dirty slot the guest still needs reaches the disk (the caller then
    /// syncs the file); dead dirty slots are dropped. Slots stay cached, clean. On an error the
    /// slots not yet written stay dirty.
    pub fn flush(&mut self, be: &mut dyn SwapBackend) -> std::io::Result<()> {
        let mut dirty: Vec<(u64, u64)> = self
            .map
            .iter()
            .filter(|(_, e)| e.dirty)
            .map(|(&s, e)| (s, e.tick))
            .collect();
        // In disk order: sequential writes are cheaper.
        dirty.sort_unstable();
        for (slot, _) in dirty {
            let buf = self.map[&slot].buf;
            let written = self.write_back_if_live(slot, buf, be)?;
            if written {
                self.stats.flush_writebacks += 1;
            } else {
                self.stats.flush_writebacks_avoided += 1;
            }
            if written {
                if let Some(e) = self.map.get_mut(&slot) {
                    e.dirty = false;
                }
            } else if let Some(e) = self.map.remove(&slot) {
                self.lru.remove(&e.tick);
                self.free.push(e.buf);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    /// A disk in memory and a guest whose dead slots are a set.
    #[derive(Default)]
    struct Mock {
        disk: HashMap<u64, Vec<u8>>,
        dead: HashSet<u64>,
        unknown: bool,
        asked: Vec<u64>,
        fail: bool,
    }

    impl SwapBackend for Mock {
        fn write_back(&mut self, slot: u64, data: &[u8]) -> std::io::Result<()> {
            if self.fail {
                return Err(std::io::Error::other("disk gone"));
            }
            self.disk.insert(slot, data.to_vec());
            Ok(())
        }
        fn live(&mut self, slot: u64) -> Liveness {
            self.asked.push(slot);
            if self.unknown {
                Liveness::Unknown
            } else if self.dead.contains(&slot) {
                Liveness::Dead
            } else {
                Liveness::Live
            }
        }
    }

    fn page(v: u8) -> Vec<u8> {
        vec![v; SLOT_SIZE]
    }

    #[test]
    fn write_then_read_hits() {
        let mut c = SwapCache::new(4);
        let mut m = Mock::default();
        c.write(7, &page(1), &mut m).unwrap();
        let mut out = page(0);
        assert!(c.read(7, &mut out));
        assert_eq!(out, page(1));
        assert!(!c.read(8, &mut out));
        let s = c.stats();
        assert_eq!((s.hits, s.misses, s.writes_cached), (1, 1, 1));
        assert_eq!(s.bytes_read_cache, SLOT_SIZE as u64);
        assert!(m.disk.is_empty(), "nothing written back yet");
    }

    #[test]
    fn rewrite_updates_in_place() {
        let mut c = SwapCache::new(2);
        let mut m = Mock::default();
        c.write(1, &page(1), &mut m).unwrap();
        c.write(1, &page(2), &mut m).unwrap();
        assert_eq!(c.len(), 1);
        let mut out = page(0);
        assert!(c.read(1, &mut out));
        assert_eq!(out, page(2));
    }

    #[test]
    fn lru_eviction_writes_back_live_dirty() {
        let mut c = SwapCache::new(2);
        let mut m = Mock::default();
        c.write(1, &page(1), &mut m).unwrap();
        c.write(2, &page(2), &mut m).unwrap();
        // Rewrite 1: 2 becomes the LRU.
        c.write(1, &page(1), &mut m).unwrap();
        c.write(3, &page(3), &mut m).unwrap();
        assert!(!c.contains(2) && c.contains(1) && c.contains(3));
        assert_eq!(m.disk.get(&2), Some(&page(2)));
        assert_eq!(m.asked, vec![2]);
        let s = c.stats();
        assert_eq!((s.evictions, s.writebacks, s.writebacks_avoided), (1, 1, 0));
        assert_eq!(s.bytes_written_disk, SLOT_SIZE as u64);
    }

    #[test]
    fn a_read_slot_is_the_next_victim() {
        let mut c = SwapCache::new(3);
        let mut m = Mock::default();
        for s in 1..=3 {
            c.write(s, &page(s as u8), &mut m).unwrap();
        }
        let mut out = page(0);
        assert!(c.read(3, &mut out));
        m.dead.insert(3); // the guest freed it after the swap-in
        c.write(4, &page(4), &mut m).unwrap();
        assert!(!c.contains(3) && c.contains(1) && c.contains(2));
        assert_eq!(m.asked, vec![3]);
        assert_eq!(c.stats().writebacks_avoided, 1);
    }

    #[test]
    fn dead_slots_are_dropped_unwritten() {
        let mut c = SwapCache::new(1);
        let mut m = Mock::default();
        m.dead.insert(1);
        c.write(1, &page(1), &mut m).unwrap();
        c.write(2, &page(2), &mut m).unwrap();
        assert!(m.disk.is_empty());
        let s = c.stats();
        assert_eq!((s.evictions, s.writebacks, s.writebacks_avoided), (1, 0, 1));
    }

    #[test]
    fn unknown_liveness_writes_back_and_counts() {
        let mut c = SwapCache::new(1);
        let mut m = Mock {
            unknown: true,
            ..Mock::default()
        };
        m.dead.insert(1);
        c.write(1, &page(1), &mut m).unwrap();
        c.write(2, &page(2), &mut m).unwrap();
        assert_eq!(m.disk.get(&1), Some(&page(1)));
        assert_eq!(c.stats().liveness_unknown, 1);
    }

    #[test]
    fn clean_evictions_do_not_ask() {
        let mut c = SwapCache::new(1);
        let mut m = Mock::default();
        c.write(1, &page(1), &mut m).unwrap();
        c.flush(&mut m).unwrap();
        m.asked.clear();
        c.write(2, &page(2), &mut m).unwrap();
        assert!(m.asked.is_empty());
        assert_eq!(c.stats().writebacks, 1, "only the flush wrote");
    }

    #[test]
    fn discard_drops_dirty_and_clean() {
        let mut c = SwapCache::new(8);
        let mut m = Mock::default();
        for s in 0..6 {
            c.write(s, &page(s as u8), &mut m).unwrap();
        }
        assert_eq!(c.discard(2, 3), 3);
        assert_eq!(c.len(), 3);
        assert!(!c.contains(3));
        // A huge range takes the scan path.
        assert_eq!(c.discard(0, u64::MAX), 3);
        assert!(c.is_empty());
        c.flush(&mut m).unwrap();
        assert!(m.disk.is_empty(), "discarded slots never reach the disk");
        assert_eq!(c.stats().discards, 6);
        // Freed buffers are reused.
        for s in 0..8 {
            c.write(s, &page(1), &mut m).unwrap();
        }
        assert_eq!(c.stats().evictions, 0);
    }

    #[test]
    fn flush_writes_live_dirty_and_drops_dead() {
        let mut c = SwapCache::new(8);
        let mut m = Mock::default();
        for s in 0..4 {
            c.write(s, &page(s as u8 + 1), &mut m).unwrap();
        }
        m.dead.insert(2);
        c.flush(&mut m).unwrap();
        assert_eq!(m.disk.len(), 3);
        assert!(!m.disk.contains_key(&2));
        assert_eq!(c.dirty(), 0);
        assert_eq!(c.len(), 3);
        let s = c.stats();
        assert_eq!((s.writebacks, s.writebacks_avoided), (3, 1));
        assert_eq!((s.flush_writebacks, s.flush_writebacks_avoided), (3, 1));
        // A second flush has nothing to do.
        c.flush(&mut m).unwrap();
        assert_eq!(c.stats().writebacks, 3);
        // Still readable after the flush.
        let mut out = page(0);
        assert!(c.read(3, &mut out));
        assert_eq!(out, page(4));
    }

    #[test]
    fn write_back_error_keeps_the_slot() {
        let mut c = SwapCache::new(1);
        let mut m = Mock::default();
        c.write(1, &page(1), &mut m).unwrap();
        m.fail = true;
        assert!(c.write(2, &page(2), &mut m).is_err());
        assert!(c.contains(1) && !c.contains(2));
        assert!(c.flush(&mut m).is_err());
        m.fail = false;
        c.flush(&mut m).unwrap();
        assert_eq!(m.disk.get(&1), Some(&page(1)));
    }

    #[test]
    fn zero_capacity_writes_through() {
        let mut c = SwapCache::new(0);
        let mut m = Mock::default();
        c.write(5, &page(5), &mut m).unwrap();
        assert_eq!(m.disk.get(&5), Some(&page(5)));
        let mut out = page(0);
        assert!(!c.read(5, &mut out));
        assert_eq!(c.stats().bytes_written_disk, SLOT_SIZE as u64);
    }

    /// A random workload against a model: every read returns the last write (from the cache
    /// or the mock disk), and the counters add up.
    #[test]
    fn model_check() {
        let mut c = SwapCache::new(16);
        let mut m = Mock::default();
        let mut model: HashMap<u64, u8> = HashMap::new();
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut rnd = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for i in 0..20_000u64 {
            let slot = rnd() % 64;
            match rnd() % 4 {
                0 | 1 => {
                    let v = (i % 251) as u8 + 1;
                    m.dead.remove(&slot);
                    c.write(slot, &page(v), &mut m).unwrap();
                    model.insert(slot, v);
                }
                2 => {
                    let mut out = page(0);
                    if !c.read(slot, &mut out) {
                        out = m.disk.get(&slot).cloned().unwrap_or_else(|| page(0));
                    }
                    if let Some(&v) = model.get(&slot) {
                        assert_eq!(out[0], v, "slot {slot} at step {i}");
                    }
                }
                _ => {
                    // The guest frees the slot: dead, sometimes discarded too.
                    model.remove(&slot);
                    m.dead.insert(slot);
                    if rnd() % 2 == 0 {
                        c.discard(slot, 1);
                        m.disk.remove(&slot);
                    }
                }
            }
        }
        c.flush(&mut m).unwrap();
        for (slot, v) in &model {
            assert_eq!(m.disk[slot][0], *v);
        }
        let s = c.stats();
        assert!(s.writebacks_avoided > 0 && s.writebacks > 0);
        assert!(
            s.writebacks - s.flush_writebacks + s.writebacks_avoided - s.flush_writebacks_avoided
                <= s.evictions
        );
        assert!(c.len() <= 16);
    }
}
