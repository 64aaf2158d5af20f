//! Reading the guest's translation structures: root table, legacy context entries and
//! second-level page tables (3 or 4 levels, 4 KiB and 2 MiB leaves). Every read goes through
//! guest RAM with a bounds check; a walk is at most four reads, so a looping or hostile table
//! can only produce a fault reason, never a hang.

use vm_memory::{Bytes, GuestAddress};

use crate::GuestMemoryMmap;

/// Host address width the unit supports (CAP.MGAW+1): address bits above it are reserved.
pub const HAW: u32 = 48;
pub const ADDR_MASK: u64 = ((1u64 << HAW) - 1) & !0xfff;

// Legacy-mode DMA-remapping fault reasons (VT-d spec, appendix A).
pub const FR_ROOT_P: u8 = 0x1;
pub const FR_CTX_P: u8 = 0x2;
pub const FR_CTX_INV: u8 = 0x3;
pub const FR_ADDR_WIDTH: u8 = 0x4;
pub const FR_WRITE: u8 = 0x5;
pub const FR_READ: u8 = 0x6;
pub const FR_PTE_ACCESS: u8 = 0x7;
pub const FR_ROOT_ACCESS: u8 = 0x8;
pub const FR_CTX_ACCESS: u8 = 0x9;
pub const FR_ROOT_RSVD: u8 = 0xa;
pub const FR_CTX_RSVD: u8 = 0xb;
pub const FR_PTE_RSVD: u8 = 0xc;

pub fn read_u64(mem: &GuestMemoryMmap, addr: u64) -> Option<u64> {
    mem.read_obj::<u64>(GuestAddress(addr)).ok()
}

/// A present, valid legacy context entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Context {
    pub did: u16,
    /// Second-level page-table pointer (4 KiB aligned).
    pub slpt: u64,
    /// 3 or 4.
    pub levels: u8,
    /// Fault processing disable: faults are not recorded.
    pub fpd: bool,
}

/// A failed context lookup: the reason, and whether the context entry asked for faults not to
/// be recorded (FPD).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CtxFault {
    pub reason: u8,
    pub fpd: bool,
}

/// Reads the context entry of requester `sid` under the root table at `rta`.
pub fn context(mem: &GuestMemoryMmap, rta: u64, sid: u16) -> Result<Context, CtxFault> {
    let fault = |reason| CtxFault { reason, fpd: false };
    let root = rta.wrapping_add(u64::from(sid >> 8) * 16);
    let (rlo, rhi) = match (read_u64(mem, root), read_u64(mem, root.wrapping_add(8))) {
        (Some(l), Some(h)) => (l, h),
        _ => return Err(fault(FR_ROOT_ACCESS)),
    };
    if rlo & 1 == 0 {
        return Err(fault(FR_ROOT_P));
    }
    if rlo & (0xffe | !((1u64 << HAW) - 1)) != 0 || rhi != 0 {
        return Err(fault(FR_ROOT_RSVD));
    }
    let ce = (rlo & ADDR_MASK) + u64::from(sid & 0xff) * 16;
    let (clo, chi) = match (read_u64(mem, ce), read_u64(mem, ce + 8)) {
        (Some(l), Some(h)) => (l, h),
        _ => return Err(fault(FR_CTX_ACCESS)),
    };
    if clo & 1 == 0 {
        return Err(fault(FR_CTX_P));
    }
    let fpd = clo & 2 != 0;
    // Low: bits 11:4 and address bits above HAW; high: bit 7 and 63:24.
    if clo & (0xff0 | !((1u64 << HAW) - 1)) != 0 || chi & (0x80 | !0xff_ffff) != 0 {
        return Err(CtxFault {
            reason: FR_CTX_RSVD,
            fpd,
        });
    }
    // Only translation type 00 (untranslated requests through the tables): no device-TLB
    // (ECAP.DT=0), no pass-through (ECAP.PT=0).
    let tt = (clo >> 2) & 3;
    let levels = match chi & 7 {
        1 => 3,
        2 => 4,
        _ => 0,
    };
    if tt != 0 || levels == 0 {
        return Err(CtxFault {
            reason: FR_CTX_INV,
            fpd,
        });
    }
    Ok(Context {
        did: (chi >> 8) as u16,
        slpt: clo & ADDR_MASK,
        levels,
        fpd,
    })
}

/// The leaf a page walk found for one 4 KiB IOVA page.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Leaf {
    /// Guest-physical address of the 4 KiB page the IOVA page maps to.
    pub gpa: u64,
    pub read: bool,
    pub write: bool,
    /// The leaf is a 2 MiB page.
    pub large: bool,
}

/// Bits a second-level entry ignores: 63 and 61:52 (bit 62, TM, is reserved without DT).
const SL_IGNORED: u64 = 0xbff0_0000_0000_0000;

/// Whether second-level entry `e` at `level` has reserved bits set: address bits above HAW,
/// SNP (no snoop control), and per level: PS where no large page exists, the low address bits
/// of a 2 MiB leaf.
fn sl_reserved(e: u64, level: u32) -> bool {
    let ps = e & 0x80 != 0;
    let mut rsvd = (e & !SL_IGNORED & !((1u64 << HAW) - 1)) | (e & 0x800);
    match level {
        4 | 3 if ps => rsvd |= 0x80,
        2 if ps => rsvd |= e & 0x1f_f000,
        _ => {}
    }
    rsvd != 0
}

/// Walks the second-level tables at `slpt` for `iova`. `Ok(None)`: an entry on the way is not
/// present (R=W=0), which the caller reports as a read or write fault.
pub fn walk(mem: &GuestMemoryMmap, slpt: u64, levels: u8, iova: u64) -> Result<Option<Leaf>, u8> {
    let width = 12 + 9 * u32::from(levels);
    if !(3..=4).contains(&levels) || iova >> width != 0 {
        return Err(FR_ADDR_WIDTH);
    }
    let mut table = slpt;
    let (mut r, mut w) = (true, true);
    for level in (1..=u32::from(levels)).rev() {
        let shift = 12 + 9 * (level - 1);
        let idx = (iova >> shift) & 511;
        let e = read_u64(mem, table + idx * 8).ok_or(FR_PTE_ACCESS)?;
        let (er, ew) = (e & 1 != 0, e & 2 != 0);
        if !er && !ew {
            return Ok(None);
        }
        let ps = e & 0x80 != 0;
        if sl_reserved(e, level) {
            return Err(FR_PTE_RSVD);
        }
        r &= er;
        w &= ew;
        if level == 1 || (level == 2 && ps) {
            let large = level == 2;
            let base = e & ADDR_MASK;
            let gpa = if large {
                (base & !0x1f_ffff) + (iova & 0x1f_f000)
            } else {
                base
            };
            return Ok(Some(Leaf {
                gpa,
                read: r,
                write: w,
                large,
            }));
        }
        table = e & ADDR_MASK;
    }
    Ok(None)
}

/// What a range walk may still do: leaf pages to visit and table entries to read.
pub struct Budget {
    pub pages: u64,
    pub reads: u64,
}

/// Visits, in IOVA order, the pages `first..end` (4 KiB page numbers) that the second-level
/// tables at `slpt` map readable or writable: `f(page, gpa_page, permission)`. Entries that are not present
/// or have reserved bits are skipped with what they cover. `Err(page)`: the budget ran out at
/// IOVA page `page`, which and what follows were not visited.
pub fn walk_range(
    mem: &GuestMemoryMmap,
    slpt: u64,
    levels: u8,
    (first, end): (u64, u64),
    budget: &mut Budget,
    f: &mut dyn FnMut(u64, u64, crate::Perm),
) -> Result<(), u64> {
    if !(3..=4).contains(&levels) {
        return Ok(());
    }
    let end = end.min(1 << (9 * u32::from(levels)));
    if first >= end {
        return Ok(());
    }
    walk_table(
        mem,
        slpt,
        u32::from(levels),
        0,
        (first, end),
        (true, true),
        budget,
        f,
    )
}

#[allow(clippy::too_many_arguments)]
fn walk_table(
    mem: &GuestMemoryMmap,
    table: u64,
    level: u32,
    base: u64,
    (first, end): (u64, u64),
    (r, w): (bool, bool),
    budget: &mut Budget,
    f: &mut dyn FnMut(u64, u64, crate::Perm),
) -> Result<(), u64> {
    let shift = 9 * (level - 1);
    let lo = first.saturating_sub(base) >> shift;
    let hi = ((end - 1 - base) >> shift).min(511);
    for idx in lo..=hi {
        let ebase = base + (idx << shift);
        if budget.reads == 0 {
            return Err(ebase.max(first));
        }
        budget.reads -= 1;
        let Some(e) = read_u64(mem, table + idx * 8) else {
            continue;
        };
        let (er, ew) = (e & 1 != 0, e & 2 != 0);
        if (!er && !ew) || sl_reserved(e, level) {
            continue;
        }
        let (r, w) = (r && er, w && ew);
        let ps = e & 0x80 != 0;
        if level == 1 || (level == 2 && ps) {
            let gpa_page = (e & ADDR_MASK) >> 12;
            for page in ebase.max(first)..(ebase + (1 << shift)).min(end) {
                if budget.pages == 0 {
                    return Err(page);
                }
                budget.pages -= 1;
                if r || w {
                    let perm = crate::Perm { read: r, write: w };
                    f(page, gpa_page + (page - ebase), perm);
                }
            }
        } else {
            walk_table(
                mem,
                e & ADDR_MASK,
                level - 1,
                ebase,
                (first, end),
                (r, w),
                budget,
                f,
            )?;
        }
    }
    Ok(())
}
