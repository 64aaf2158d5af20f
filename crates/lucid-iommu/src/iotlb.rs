//! The VMM's translation caches, read without a lock on the hit path.
//!
//! * The context cache maps a requester id to its domain and tables: one `AtomicU64` per
//!   possible source id (64 Ki entries, zero pages until touched).
//! * The IOTLB is a direct-mapped array of slots keyed by (domain id, 4 KiB IOVA page). Each
//!   slot is a small seqlock: a reader loads the sequence, the key and the value, and the
//!   sequence again, and takes the entry only if the sequence was even and unchanged. Writers
//!   (fills and invalidations) are serialized by the unit's state lock, so there is one writer
//!   at a time.
//!
//! A 2 MiB leaf is cached per 4 KiB page with a "large" flag, so that an invalidation of any part
//! of the 2 MiB page drops every slot it produced.

use std::sync::atomic::{fence, AtomicU64, Ordering};

use crate::tables::{Context, Leaf};

/// IOTLB slots (a power of two).
pub const SLOTS: usize = 1024;

const VALID: u64 = 1 << 63;

pub struct ContextCache {
    entries: Box<[AtomicU64]>,
}

impl ContextCache {
    pub fn new() -> Self {
        ContextCache {
            entries: (0..65536).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    pub fn get(&self, sid: u16) -> Option<Context> {
        let v = self.entries[usize::from(sid)].load(Ordering::Acquire);
        (v & VALID != 0).then_some(Context {
            did: v as u16,
            levels: if v & (1 << 62) != 0 { 4 } else { 3 },
            slpt: ((v >> 16) & ((1 << 36) - 1)) << 12,
            fpd: v & (1 << 61) != 0,
        })
    }

    pub fn set(&self, sid: u16, c: Context) {
        let v = VALID
            | if c.levels == 4 { 1 << 62 } else { 0 }
            | if c.fpd { 1 << 61 } else { 0 }
            | ((c.slpt >> 12) & ((1 << 36) - 1)) << 16
            | u64::from(c.did);
        self.entries[usize::from(sid)].store(v, Ordering::Release);
    }

    pub fn clear(&self, sid: u16) {
        self.entries[usize::from(sid)].store(0, Ordering::Release);
    }
}

struct Slot {
    seq: AtomicU64,
    key: AtomicU64,
    val: AtomicU64,
}

/// A cached translation, as packed into a slot's value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Entry {
    pub did: u16,
    /// IOVA page number (IOVA >> 12).
    pub page: u64,
    pub leaf: Leaf,
}

pub struct Iotlb {
    slots: Box<[Slot]>,
}

fn key(did: u16, page: u64) -> u64 {
    VALID | u64::from(did) << 36 | (page & ((1 << 36) - 1))
}

pub fn index(did: u16, page: u64) -> usize {
    let h = (page ^ (u64::from(did) << 40)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    (h >> (64 - SLOTS.trailing_zeros())) as usize
}

fn pack(l: &Leaf) -> u64 {
    (l.gpa & !0xfff) | u64::from(l.read) | u64::from(l.write) << 1 | u64::from(l.large) << 2
}

fn unpack(v: u64) -> Leaf {
    Leaf {
        gpa: v & !0xfff,
        read: v & 1 != 0,
        write: v & 2 != 0,
        large: v & 4 != 0,
    }
}

impl Iotlb {
    pub fn new() -> Self {
        Iotlb {
            slots: (0..SLOTS)
                .map(|_| Slot {
                    seq: AtomicU64::new(0),
                    key: AtomicU64::new(0),
                    val: AtomicU64::new(0),
                })
                .collect(),
        }
    }

    /// The hit path: no lock, no write. The first load is SeqCst so that it is ordered after
    /// the caller's access-bracket increment (see `pin`): an access either sees an
    /// invalidation's removal or is counted by the invalidation's grace check.
    #[inline]
    pub fn lookup(&self, did: u16, page: u64) -> Option<Leaf> {
        let s = &self.slots[index(did, page)];
        let s1 = s.seq.load(Ordering::SeqCst);
        if s1 & 1 != 0 {
            return None;
        }
        let k = s.key.load(Ordering::Relaxed);
        let v = s.val.load(Ordering::Relaxed);
        fence(Ordering::Acquire);
        if s.seq.load(Ordering::Relaxed) != s1 || k != key(did, page) {
            return None;
        }
        Some(unpack(v))
    }

    /// What slot `i` holds (writer side: call with the state lock held).
    pub fn slot(&self, i: usize) -> Option<Entry> {
        let s = &self.slots[i];
        let k = s.key.load(Ordering::Relaxed);
        (k & VALID != 0).then(|| Entry {
            did: (k >> 36) as u16,
            page: k & ((1 << 36) - 1),
            leaf: unpack(s.val.load(Ordering::Relaxed)),
        })
    }

    /// Writes slot `i` (state lock held). `None` empties it.
    pub fn store(&self, i: usize, e: Option<&Entry>) {
        let s = &self.slots[i];
        let seq = s.seq.load(Ordering::Relaxed);
        s.seq.store(seq.wrapping_add(1), Ordering::SeqCst);
        fence(Ordering::Release);
        match e {
            Some(e) => {
                s.key.store(key(e.did, e.page), Ordering::Relaxed);
                s.val.store(pack(&e.leaf), Ordering::Relaxed);
            }
            None => {
                s.key.store(0, Ordering::Relaxed);
                s.val.store(0, Ordering::Relaxed);
            }
        }
        s.seq.store(seq.wrapping_add(2), Ordering::SeqCst);
    }
}
