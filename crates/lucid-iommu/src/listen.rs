//! Assigned devices' copies of their requester's mappings (see "Assigned devices" in the crate
//! docs): per listener, a shadow of what it was told, as the extents of the `map` calls made;
//! re-walks of the requester's tables that invalidations trigger; the diff that turns a walk
//! into `unmap`/`map` calls.
//!
//! An `unmap` always covers exactly one earlier `map` call's range (a device server may refuse
//! to split a mapping), so a change inside a coalesced extent unmaps the whole extent and maps
//! again the parts that did not change.

use std::collections::BTreeMap;
use std::sync::Arc;

use vm_memory::{GuestMemoryBackend, GuestMemoryRegion};

use crate::regs::G_TE;
use crate::tables::{self, Budget, Context};
use crate::{Fx, MapListener, Perm, State, Vtd};

/// Most leaf pages one walk visits, and table entries it reads; then it stops (logged once).
const WALK_PAGES: u64 = 1 << 20;
const WALK_READS: u64 = 1 << 22;
/// Every IOVA page (48-bit IOVAs).
pub(crate) const ALL: (u64, u64) = (0, 1 << 36);

/// One `map` call as the listener was told it, keyed by its first IOVA page.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Ext {
    pub pages: u64,
    /// First guest page.
    pub gpa: u64,
    pub perm: Perm,
}

pub(crate) struct Listened {
    l: Arc<dyn MapListener>,
    /// Domain of the requester at the last walk.
    did: Option<u16>,
    ext: BTreeMap<u64, Ext>,
    /// Told the identity mapping of every RAM region (translation off).
    identity: bool,
}

/// A listener call, made after the state lock is dropped.
pub(crate) enum Op {
    Map {
        iova: u64,
        gpa: u64,
        len: u64,
        perm: Perm,
    },
    Unmap {
        iova: u64,
        len: u64,
    },
}

/// Which listeners an invalidation concerns.
#[derive(Clone, Copy)]
pub(crate) enum Sel {
    All,
    Domain(u16),
    Device { sid: u16, mask: u16 },
    Pages { did: u16, first: u64, n: u64 },
}

impl Vtd {
    /// Registers `l` for `rid` and tells it the current state (state lock held).
    pub(crate) fn listener_add(
        &self,
        st: &mut State,
        fx: &mut Fx,
        rid: u16,
        l: Arc<dyn MapListener>,
    ) {
        st.listeners.insert(
            rid,
            Listened {
                l,
                did: None,
                ext: BTreeMap::new(),
                identity: false,
            },
        );
        self.listener_mode(st, fx, rid, st.gsts & G_TE != 0);
    }

    /// Translation was just turned on or off (or the listener is new): swap the identity maps
    /// for a walk of the tables, or every mapping for the identity maps.
    pub(crate) fn listeners_te(&self, st: &mut State, fx: &mut Fx, on: bool) {
        let rids: Vec<u16> = st.listeners.keys().copied().collect();
        for rid in rids {
            self.listener_mode(st, fx, rid, on);
        }
    }

    fn listener_mode(&self, st: &mut State, fx: &mut Fx, rid: u16, on: bool) {
        let regions: Vec<(u64, u64)> = self
            .mem
            .iter()
            .map(|r| (r.start_addr().0, r.len()))
            .collect();
        let Some(li) = st.listeners.get_mut(&rid) else {
            return;
        };
        if on {
            if li.identity {
                li.identity = false;
                for &(a, len) in &regions {
                    fx.calls.push((li.l.clone(), Op::Unmap { iova: a, len }));
                }
            }
            let ctx = tables::context(&self.mem, st.rta, rid).ok();
            self.listener_walk(st, fx, rid, ctx, ALL);
        } else {
            for (s, e) in std::mem::take(&mut li.ext) {
                fx.calls.push((
                    li.l.clone(),
                    Op::Unmap {
                        iova: s << 12,
                        len: e.pages << 12,
                    },
                ));
            }
            li.did = None;
            if !li.identity {
                li.identity = true;
                for &(a, len) in &regions {
                    let op = Op::Map {
                        iova: a,
                        gpa: a,
                        len,
                        perm: Perm::READ_WRITE,
                    };
                    fx.calls.push((li.l.clone(), op));
                }
            }
        }
    }

    /// An invalidation (`sel`) may have changed what listeners' requesters translate: re-walk
    /// what it covers and queue the calls. Nothing while translation is off.
    pub(crate) fn listeners_sync(&self, st: &mut State, fx: &mut Fx, sel: Sel) {
        if st.gsts & G_TE == 0 || st.listeners.is_empty() {
            return;
        }
        let rids: Vec<u16> = st.listeners.keys().copied().collect();
        for rid in rids {
            let ctx = tables::context(&self.mem, st.rta, rid).ok();
            let old = st.listeners[&rid].did;
            let new = ctx.map(|c| c.did);
            let range = match sel {
                Sel::All => ALL,
                Sel::Domain(d) if old == Some(d) || new == Some(d) => ALL,
                Sel::Device { sid, mask } if rid & mask == sid & mask => ALL,
                Sel::Pages { did, first, n } if new == Some(did) => (first, first + n),
                // The requester left the domain without a context-cache invalidation.
                Sel::Pages { did, .. } if old == Some(did) => ALL,
                _ => continue,
            };
            self.listener_walk(st, fx, rid, ctx, range);
        }
    }

    /// Walks `rid`'s tables over IOVA pages `first..end`, diffs with its shadow, queues calls.
    fn listener_walk(
        &self,
        st: &mut State,
        fx: &mut Fx,
        rid: u16,
        ctx: Option<Context>,
        (first, mut end): (u64, u64),
    ) {
        self.c.l_walks.inc();
        let mut new = Vec::new();
        if let Some(c) = ctx {
            let mut b = Budget {
                pages: WALK_PAGES,
                reads: WALK_READS,
            };
            let mut f = |page, gpa: u64, w| {
                // What translate would call Unbacked is not a mapping a device can have.
                if self.in_ram(gpa << 12) {
                    new.push((page, gpa, w));
                }
            };
            if let Err(stop) =
                tables::walk_range(&self.mem, c.slpt, c.levels, (first, end), &mut b, &mut f)
            {
                // What follows `stop` stays as the listener was told.
                end = stop;
                if !st.walk_warned {
                    st.walk_warned = true;
                    log::warn!(
                        "vtd: requester {rid:#x}: table walk stopped at IOVA {:#x} (more than \
                         {WALK_PAGES} pages or {WALK_READS} entries); later mappings not shown \
                         to the device",
                        stop << 12
                    );
                }
            }
        }
        let Some(li) = st.listeners.get_mut(&rid) else {
            return;
        };
        li.did = ctx.map(|c| c.did);
        // A run never crosses from one RAM region into the next (each has its own backing).
        let starts: Vec<u64> = self.mem.iter().map(|r| r.start_addr().0 >> 12).collect();
        let region_start = |g: u64| starts.contains(&g);
        let (unmaps, maps) = diff(&mut li.ext, (first, end), &new, &region_start);
        for (s, pages) in unmaps {
            let op = Op::Unmap {
                iova: s << 12,
                len: pages << 12,
            };
            fx.calls.push((li.l.clone(), op));
        }
        for (s, e) in maps {
            let op = Op::Map {
                iova: s << 12,
                gpa: e.gpa << 12,
                len: e.pages << 12,
                perm: e.perm,
            };
            fx.calls.push((li.l.clone(), op));
        }
    }

    /// Makes the calls (state lock not held), counting them.
    pub(crate) fn listener_calls(&self, calls: Vec<(Arc<dyn MapListener>, Op)>) {
        for (l, op) in calls {
            match op {
                Op::Map {
                    iova,
                    gpa,
                    len,
                    perm,
                } => {
                    self.c.l_maps.inc();
                    l.map(iova, gpa, len, perm);
                }
                Op::Unmap { iova, len } => {
                    self.c.l_unmaps.inc();
                    l.unmap(iova, len);
                }
            }
        }
    }
}

/// Extents to unmap (first page, pages), then extents to map.
pub(crate) type Changes = (Vec<(u64, u64)>, Vec<(u64, Ext)>);

/// Brings shadow `ext` to what a walk of pages `first..end` found (`new`: sorted
/// (page, gpa page, permission)); returns the extents to unmap (first page, pages), then those to
/// map. An extent that a change touches is unmapped whole; its unchanged pages, inside or
/// outside the range, are mapped again. Runs of pages contiguous in IOVA and guest address with
/// one permission become one extent, unless `brk(gpa page)` says a new one starts there.
pub(crate) fn diff(
    ext: &mut BTreeMap<u64, Ext>,
    (first, end): (u64, u64),
    new: &[(u64, u64, Perm)],
    brk: &dyn Fn(u64) -> bool,
) -> Changes {
    let mut affected: Vec<u64> = Vec::new();
    if let Some((&s, e)) = ext.range(..first).next_back() {
        if s + e.pages > first {
            affected.push(s);
        }
    }
    affected.extend(ext.range(first..end).map(|(&s, _)| s));
    // What every page of the affected extents and the range should translate to.
    let mut want: Vec<(u64, u64, Perm)> = Vec::with_capacity(new.len());
    if let Some(&s) = affected.first().filter(|&&s| s < first) {
        let e = ext[&s];
        want.extend((s..first).map(|p| (p, e.gpa + p - s, e.perm)));
    }
    want.extend_from_slice(new);
    if let Some(&s) = affected.last() {
        let e = ext[&s];
        want.extend((end.max(s)..s + e.pages).map(|p| (p, e.gpa + p - s, e.perm)));
    }
    let mut kept = vec![false; want.len()];
    let mut unmaps = Vec::new();
    for s in affected {
        let e = ext[&s];
        let i = want.partition_point(|w| w.0 < s);
        let same = (0..e.pages).all(|k| {
            want.get(i + k as usize)
                .is_some_and(|&w| w == (s + k, e.gpa + k, e.perm))
        });
        if same {
            kept[i..i + e.pages as usize].fill(true);
        } else {
            ext.remove(&s);
            unmaps.push((s, e.pages));
        }
    }
    let mut maps: Vec<(u64, Ext)> = Vec::new();
    let mut prev_kept = true;
    for (i, &(p, g, w)) in want.iter().enumerate() {
        if kept[i] {
            prev_kept = true;
            continue;
        }
        match maps.last_mut() {
            Some((s, e))
                if !prev_kept
                    && *s + e.pages == p
                    && e.gpa + e.pages == g
                    && e.perm == w
                    && !brk(g) =>
            {
                e.pages += 1
            }
            _ => maps.push((
                p,
                Ext {
                    pages: 1,
                    gpa: g,
                    perm: w,
                },
            )),
        }
        prev_kept = false;
    }
    for &(s, e) in &maps {
        ext.insert(s, e);
    }
    (unmaps, maps)
}
