//! Unit tests of the unit's logic against real guest memory (`GuestRam`), with an MSI sink and a
//! pinner that record what they are asked to do.

use std::cell::Cell;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lucid_hv::{MsiMessage, MsiRemapper};
use lucid_mem::{Access, Backing, DmaError, DmaTranslator, FaultReason, GuestRam};
use lucid_stats::StatsRegistry;
use vm_memory::{Bytes, GuestAddress};

use crate::regs::*;
use crate::*;

const RAM: u64 = 8 << 20;
const RTA: u64 = 0x10000;
/// Context tables: one page per bus from here.
const CTX: u64 = 0x100000;
const IQ: u64 = 0x20000;
const IRT: u64 = 0x30000;
const STATUS: u64 = 0x38000;
const TABLES: u64 = 0x200000;
const DATA: u64 = 0x400000;
const FE_ADDR: u32 = 0xfee0_1000;
const FE_DATA: u32 = 0x41;
const IE_ADDR: u32 = 0xfee0_2000;
const IE_DATA: u32 = 0x42;

#[derive(Default)]
struct Msis(Mutex<Vec<(u64, u32)>>);
impl MsiSink for Msis {
    fn send(&self, address: u64, data: u32) {
        self.0.lock().unwrap().push((address, data));
    }
}
impl Msis {
    fn take(&self) -> Vec<(u64, u32)> {
        std::mem::take(&mut *self.0.lock().unwrap())
    }
}

/// Records pins; an unpin of a page an in-flight test access still uses is a violation.
#[derive(Default)]
struct TestPinner {
    pinned: Mutex<HashSet<u64>>,
    ranges: Mutex<Vec<(u64, u64)>>,
    inflight: Mutex<HashMap<u64, u32>>,
    violations: Mutex<Vec<String>>,
}
impl Pinner for TestPinner {
    fn pin(&self, gpa: u64, len: u64) -> bool {
        if len == 4096 {
            if !self.pinned.lock().unwrap().insert(gpa) {
                self.violations
                    .lock()
                    .unwrap()
                    .push(format!("double pin {gpa:#x}"));
            }
        } else {
            self.ranges.lock().unwrap().push((gpa, len));
        }
        true
    }
    fn unpin(&self, gpa: u64, _len: u64) {
        // Lock order: inflight, then pinned (as the device threads in the concurrent test).
        let inflight = self.inflight.lock().unwrap();
        if inflight.get(&gpa).copied().unwrap_or(0) > 0 {
            self.violations
                .lock()
                .unwrap()
                .push(format!("unpin of {gpa:#x} while an access is in flight"));
        }
        if !self.pinned.lock().unwrap().remove(&gpa) {
            self.violations
                .lock()
                .unwrap()
                .push(format!("unpin of unpinned {gpa:#x}"));
        }
    }
}
impl TestPinner {
    fn has(&self, gpa: u64) -> bool {
        self.pinned.lock().unwrap().contains(&gpa)
    }
}

struct Env {
    _ram: GuestRam,
    mem: GuestMemoryMmap,
    vtd: Arc<Vtd>,
    msi: Arc<Msis>,
    pins: Arc<TestPinner>,
    stats: Arc<StatsRegistry>,
    next_table: Cell<u64>,
    gcmd: Cell<u32>,
}

fn samecore(pin: PinPolicy) -> VtdConfig {
    VtdConfig {
        mode: EmulationMode::Samecore,
        pin,
    }
}

impl Env {
    fn new(cfg: VtdConfig) -> Env {
        let ram = GuestRam::new(&[(0, RAM)], Backing::Anonymous).unwrap();
        let mem = ram.memory().clone();
        let msi = Arc::new(Msis::default());
        let pins = Arc::new(TestPinner::default());
        let stats = StatsRegistry::new();
        let vtd = Vtd::new(cfg, mem.clone(), msi.clone(), pins.clone(), &stats);
        let e = Env {
            _ram: ram,
            mem,
            vtd,
            msi,
            pins,
            stats,
            next_table: Cell::new(TABLES),
            gcmd: Cell::new(0),
        };
        e.w32(FEADDR, FE_ADDR);
        e.w32(FEDATA, FE_DATA);
        e.w32(FECTL, 0);
        e.w32(IEADDR, IE_ADDR);
        e.w32(IEDATA, IE_DATA);
        e.w32(IECTL, 0);
        e
    }
    fn w32(&self, off: u64, v: u32) {
        self.vtd.write(off, &v.to_le_bytes());
    }
    fn w64(&self, off: u64, v: u64) {
        self.vtd.write(off, &v.to_le_bytes());
    }
    fn r32(&self, off: u64) -> u32 {
        let mut b = [0u8; 4];
        self.vtd.read(off, &mut b);
        u32::from_le_bytes(b)
    }
    fn r64(&self, off: u64) -> u64 {
        let mut b = [0u8; 8];
        self.vtd.read(off, &mut b);
        u64::from_le_bytes(b)
    }
    fn put(&self, a: u64, v: u64) {
        self.mem.write_obj(v, GuestAddress(a)).unwrap();
    }
    fn get(&self, a: u64) -> u64 {
        self.mem.read_obj(GuestAddress(a)).unwrap()
    }
    fn alloc(&self) -> u64 {
        let t = self.next_table.get();
        self.next_table.set(t + 0x1000);
        t
    }
    fn counter(&self, n: &str) -> u64 {
        self.stats.snapshot()[&format!("iommu.{n}")]
    }
    /// Context entry for `sid` in domain `did` with fresh `levels`-level tables.
    fn ctx(&self, sid: u16, did: u16, levels: u8) -> u64 {
        let bus = u64::from(sid >> 8);
        let ct = CTX + bus * 0x1000;
        self.put(RTA + bus * 16, ct | 1);
        self.put(RTA + bus * 16 + 8, 0);
        let slpt = self.alloc();
        let ce = ct + u64::from(sid & 0xff) * 16;
        self.put(ce, slpt | 1);
        self.put(ce + 8, u64::from(levels - 2) | u64::from(did) << 8);
        slpt
    }
    fn pte_slot(&self, slpt: u64, levels: u8, iova: u64, leaf_level: u32) -> u64 {
        let mut t = slpt;
        for level in (leaf_level + 1..=u32::from(levels)).rev() {
            let a = t + ((iova >> (12 + 9 * (level - 1))) & 511) * 8;
            let e = self.get(a);
            t = if e & 3 == 0 {
                let n = self.alloc();
                self.put(a, n | 3);
                n
            } else {
                e & 0xffff_ffff_f000
            };
        }
        t + ((iova >> (12 + 9 * (leaf_level - 1))) & 511) * 8
    }
    fn map(&self, slpt: u64, levels: u8, iova: u64, gpa: u64, r: bool, w: bool) {
        let a = self.pte_slot(slpt, levels, iova, 1);
        self.put(a, gpa | u64::from(r) | u64::from(w) << 1);
    }
    fn map2m(&self, slpt: u64, levels: u8, iova: u64, gpa: u64) {
        let a = self.pte_slot(slpt, levels, iova, 2);
        self.put(a, gpa | 3 | 0x80);
    }
    fn unmap(&self, slpt: u64, levels: u8, iova: u64) {
        let a = self.pte_slot(slpt, levels, iova, 1);
        self.put(a, 0);
    }
    fn cmd(&self, bits: u32) {
        self.w32(GCMD, self.gcmd.get() | bits);
    }
    fn set(&self, persistent: u32) {
        self.gcmd.set(self.gcmd.get() | persistent);
        self.cmd(0);
    }
    fn enable(&self) {
        self.w64(RTADDR, RTA);
        self.cmd(G_SRTP);
        self.set(G_TE);
        assert_eq!(self.r32(GSTS) & (G_TE | G_SRTP), G_TE | G_SRTP);
    }
    fn enable_qi(&self, qs: u64) {
        self.w64(IQT, 0);
        self.w64(IQA, IQ | qs);
        self.set(G_QIE);
        assert_ne!(self.r32(GSTS) & G_QIE, 0);
    }
    fn submit(&self, descs: &[(u64, u64)]) {
        let len = 256u64 << (self.r64(IQA) & 7);
        let mut tail = self.r64(IQT) >> 4;
        for &(lo, hi) in descs {
            self.put(IQ + tail * 16, lo);
            self.put(IQ + tail * 16 + 8, hi);
            tail = (tail + 1) % len;
        }
        self.w64(IQT, tail << 4);
    }
    fn psi(&self, did: u16, iova: u64, am: u64) {
        self.w64(IVA, iova | am);
        self.w64(IOTLB, IOTLB_IVT | 3 << 60 | u64::from(did) << 32);
        assert_eq!(self.r64(IOTLB) & IOTLB_IVT, 0);
    }
    fn dma(&self, sid: u16, iova: u64, access: Access) -> Result<u64, DmaError> {
        self.vtd
            .translate(u32::from(sid), iova, 8, access)
            .map(|r| r.0)
    }
    fn frcd(&self, i: u64) -> (u64, u64) {
        (self.r64(FRCD + 16 * i), self.r64(FRCD + 16 * i + 8))
    }
    fn clear_frcd(&self, i: u64) {
        self.w32(FRCD + 16 * i + 12, 1 << 31);
    }
}

fn wait_desc(data: u32, addr: u64, sw: bool, intr: bool) -> (u64, u64) {
    (
        5 | u64::from(intr) << 4 | u64::from(sw) << 5 | u64::from(data) << 32,
        addr,
    )
}

fn iotlb_desc(g: u64, did: u16, addr: u64, am: u64) -> (u64, u64) {
    (2 | g << 4 | u64::from(did) << 16, addr | am)
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    fn chance(&mut self, pct: u64) -> bool {
        self.below(100) < pct
    }
}

#[test]
fn capability_registers_and_commands() {
    let e = Env::new(samecore(PinPolicy::Map));
    assert_eq!(e.r32(VER), 0x10);
    let cap = e.r64(CAP);
    assert_eq!(cap & 7, 6, "16-bit domain ids");
    assert_ne!(cap & 1 << 7, 0, "caching mode");
    assert_eq!((cap >> 8) & 0x1f, 0b110, "SAGAW 39 and 48 bits");
    assert_eq!((cap >> 16) & 0x3f, 47, "MGAW 48");
    assert_eq!(((cap >> 24) & 0x3ff) * 16, FRCD, "FRO");
    assert_eq!((cap >> 34) & 0xf, 1, "2 MiB pages");
    assert_eq!((cap >> 40) & 0xff, NFR as u64 - 1);
    assert_eq!((cap >> 48) & 0x3f, MAMV);
    assert_ne!(cap & 1 << 39, 0, "PSI");
    let ecap = e.r64(ECAP);
    assert_eq!(ecap & 0b11010, 0b01010, "QI and IR, no EIM");
    assert_eq!(((ecap >> 8) & 0x3ff) * 16, IVA, "IRO");
    // One-shot SRTP latches RTADDR; TE is persistent; GCMD reads 0.
    e.w64(RTADDR, 0x1234_5000);
    e.w32(GCMD, G_SRTP);
    assert_eq!(e.r32(GSTS), G_SRTP);
    assert_eq!(e.r32(GCMD), 0);
    e.w32(GCMD, G_TE);
    assert_eq!(e.r32(GSTS), G_TE | G_SRTP);
    e.w32(GCMD, 0);
    assert_eq!(e.r32(GSTS) & G_TE, 0);
    // CCMD: global invalidation, ICC clears, CAIG reports global.
    e.w64(CCMD, CCMD_ICC | 1 << 61);
    let c = e.r64(CCMD);
    assert_eq!(c & CCMD_ICC, 0);
    assert_eq!((c >> 59) & 3, 1);
    // IOTLB: domain invalidation by register, IVT clears, IAIG reports domain. Split
    // 32-bit writes: the high half starts it.
    e.w32(IOTLB, 0);
    e.w32(IOTLB + 4, (IOTLB_IVT >> 32) as u32 | 2 << 28 | 5);
    let t = e.r64(IOTLB);
    assert_eq!(t & IOTLB_IVT, 0);
    assert_eq!((t >> 57) & 3, 2);
    assert_eq!(e.counter("inv.context"), 1);
    assert_eq!(e.counter("inv.iotlb_domain"), 1);
    // Odd sizes and offsets are ignored, reads give 0.
    e.vtd.write(0x18, &[0xff; 2]);
    e.vtd.write(0x1ffc, &[0xff; 8]);
    e.vtd.write(0x19, &[0xff; 4]);
    let mut b = [0xaa; 3];
    e.vtd.read(0x0, &mut b);
    assert_eq!(b, [0; 3]);
    assert_eq!(e.r32(GSTS) & G_TE, 0);
}

#[test]
fn walks_3_and_4_levels_2m_pages_and_permissions() {
    let e = Env::new(samecore(PinPolicy::Map));
    let t3 = e.ctx(0x0008, 1, 3);
    let t4 = e.ctx(0x0110, 2, 4);
    e.map(t3, 3, 0x1000, DATA, true, true);
    e.map(t3, 3, 0x7f_ffff_f000, DATA + 0x1000, true, false);
    e.map(t4, 4, 0xffff_ffff_e000, DATA + 0x2000, false, true);
    e.map2m(t4, 4, 0x4000_0000, 0x60_0000);
    e.enable();
    assert_eq!(e.dma(0x0008, 0x1234, Access::Read), Ok(DATA + 0x234));
    assert_eq!(
        e.dma(0x0008, 0x7f_ffff_f008, Access::Read),
        Ok(DATA + 0x1008)
    );
    assert_eq!(
        e.dma(0x0110, 0xffff_ffff_e010, Access::Write),
        Ok(DATA + 0x2010)
    );
    assert_eq!(e.dma(0x0110, 0x4012_3456, Access::Write), Ok(0x72_3456));
    // Contiguity ends at the 4 KiB page.
    assert_eq!(
        e.vtd.translate(0x0008, 0x1ff0, 0x100, Access::Read),
        Ok((DATA + 0xff0, 0x10))
    );
    // Cached now: same answers from the IOTLB.
    let hits = e.counter("iotlb.hits");
    assert_eq!(e.dma(0x0110, 0x401f_f000, Access::Read), Ok(0x7f_f000));
    assert_eq!(e.dma(0x0110, 0x401f_f000, Access::Read), Ok(0x7f_f000));
    assert!(e.counter("iotlb.hits") > hits);
    // Permissions, from the IOTLB too.
    let denied = |r: Result<u64, DmaError>| {
        matches!(
            r,
            Err(DmaError::Fault {
                reason: FaultReason::Denied,
                ..
            })
        )
    };
    assert!(denied(e.dma(0x0008, 0x7f_ffff_f000, Access::Write)));
    assert!(denied(e.dma(0x0110, 0xffff_ffff_e000, Access::Read)));
    // A 39-bit domain refuses 40-bit addresses; the 48-bit one walks them.
    assert!(e.dma(0x0008, 1 << 39, Access::Read).is_err());
    assert!(e.dma(0x0110, 1 << 39, Access::Read).is_err());
    assert_eq!(e.frcd(2).1 >> 32 & 0xff, 0x4);
    assert_eq!(e.frcd(3).1 >> 32 & 0xff, 0x6);
}

/// Found by the `vtd` fuzz target: a leaf pointing outside guest RAM (minimized: a 2 MiB leaf at
/// 0x2_0120_0000, IOVA 0x20_1ff8 to 0x2_0120_1ff8) must not translate, be cached, be handed to
/// the pinner or count as a map. It is `Unbacked`: nothing recorded (hardware would end the
/// access in an unsupported request).
#[test]
fn a_leaf_outside_guest_ram_does_not_translate() {
    let e = Env::new(samecore(PinPolicy::Map));
    let t = e.ctx(0x0008, 1, 4);
    e.map(t, 4, 0x1000, 0x9090_0020_1000, true, true);
    e.map(t, 4, 0x2000, RAM, true, true);
    e.map(t, 4, 0x3000, DATA, true, true);
    e.map2m(t, 4, 0x20_0000, 0x2_0120_0000);
    e.enable();
    for _ in 0..2 {
        for iova in [0x1234, 0x2000, 0x20_1ff8] {
            let r = e.vtd.translate(0x0008, iova, 0x100, Access::Read);
            assert!(
                matches!(r, Err(DmaError::Unbacked { .. })),
                "{iova:#x}: {r:?}"
            );
        }
    }
    assert_eq!(e.frcd(0).1 & FRCD_F, 0, "no fault recorded");
    assert!(e.msi.take().is_empty());
    assert_eq!(e.counter("faults.dma"), 0);
    assert_eq!(e.counter("pinned.current"), 0);
    assert_eq!(e.counter("iotlb.hits"), 0, "never cached");
    // A page invalidation over all three re-walks them: only the page in RAM is a mapping.
    e.psi(1, 0, 2);
    assert_eq!(e.counter("maps"), 1);
    assert_eq!(e.dma(0x0008, 0x3010, Access::Write), Ok(DATA + 0x10));
    assert!(e.pins.has(DATA) && !e.pins.has(RAM));
    assert!(e.pins.violations.lock().unwrap().is_empty());
}

/// Sets up one scenario, makes one DMA from `sid`, and checks the fault record and MSI.
fn expect_fault(reason: u8, sid: u16, iova: u64, access: Access, setup: impl Fn(&Env)) {
    let e = Env::new(samecore(PinPolicy::Map));
    e.enable();
    setup(&e);
    let r = e.dma(sid, iova, access);
    assert!(
        matches!(r, Err(DmaError::Fault { .. })),
        "reason {reason:#x}: {r:?}"
    );
    let (lo, hi) = e.frcd(0);
    assert_ne!(hi & FRCD_F, 0, "reason {reason:#x}: recorded");
    assert_eq!((hi >> 32) & 0xff, u64::from(reason), "reason");
    assert_eq!(hi & 0xffff, u64::from(sid));
    assert_eq!(lo, iova & !0xfff);
    assert_eq!(hi & FRCD_T != 0, access == Access::Read);
    assert_eq!(e.r32(FSTS) & (FS_PPF | 0xff00), FS_PPF);
    assert_eq!(e.msi.take(), vec![(u64::from(FE_ADDR), FE_DATA)]);
    assert_eq!(e.counter("faults.dma"), 1);
}

#[test]
fn every_dma_fault_reason_is_recorded_with_an_msi() {
    let out = 0x7000_0000u64; // beyond RAM
    expect_fault(0x1, 0x0108, 0x1000, Access::Read, |_| {});
    expect_fault(0x2, 0x0009, 0x1000, Access::Read, |e| {
        e.ctx(0x0008, 1, 3);
    });
    expect_fault(0x3, 0x0008, 0x1000, Access::Read, |e| {
        e.ctx(0x0008, 1, 3);
        e.put(CTX + 8 * 16 + 8, 1 << 8); // AW = 0
    });
    expect_fault(0x4, 0x0008, 1 << 39, Access::Read, |e| {
        e.ctx(0x0008, 1, 3);
    });
    expect_fault(0x5, 0x0008, 0x1000, Access::Write, |e| {
        let t = e.ctx(0x0008, 1, 3);
        e.map(t, 3, 0x1000, DATA, true, false);
    });
    expect_fault(0x6, 0x0008, 0x1000, Access::Read, |e| {
        let t = e.ctx(0x0008, 1, 3);
        e.map(t, 3, 0x1000, DATA, false, true);
    });
    expect_fault(0x6, 0x0008, 0x5000, Access::Read, |e| {
        e.ctx(0x0008, 1, 3); // not present at all: a read fault
    });
    expect_fault(0x7, 0x0008, 0x1000, Access::Read, |e| {
        let t = e.ctx(0x0008, 1, 3);
        e.put(t, out | 3);
    });
    expect_fault(0x8, 0x0008, 0x1000, Access::Read, |e| {
        e.w64(RTADDR, out);
        e.cmd(G_SRTP);
    });
    expect_fault(0x9, 0x0008, 0x1000, Access::Read, |e| {
        e.ctx(0x0008, 1, 3);
        e.put(RTA, out | 1);
    });
    expect_fault(0xa, 0x0008, 0x1000, Access::Read, |e| {
        e.ctx(0x0008, 1, 3);
        e.put(RTA, CTX | 1 | 2);
    });
    expect_fault(0xb, 0x0008, 0x1000, Access::Read, |e| {
        let t = e.ctx(0x0008, 1, 3);
        e.put(CTX + 8 * 16, t | 1 | 0x10);
    });
    expect_fault(0xc, 0x0008, 0x1000, Access::Write, |e| {
        let t = e.ctx(0x0008, 1, 3);
        e.map(t, 3, 0x1000, DATA | 0x800, true, true);
    });
}

#[test]
fn fault_event_masking_overflow_and_fpd() {
    let e = Env::new(samecore(PinPolicy::Map));
    e.enable();
    e.ctx(0x0008, 1, 3);
    e.w32(FECTL, CTL_IM);
    assert!(e.dma(0x0008, 0x1000, Access::Read).is_err());
    assert_eq!(e.r32(FECTL), CTL_IM | CTL_IP);
    assert!(e.msi.take().is_empty());
    e.w32(FECTL, 0);
    assert_eq!(e.r32(FECTL), 0);
    assert_eq!(e.msi.take().len(), 1);
    // PPF already pending: further faults record without a new event, until overflow.
    for i in 1..NFR as u64 {
        assert!(e.dma(0x0008, i << 12, Access::Read).is_err());
    }
    assert!(e.msi.take().is_empty());
    assert_eq!(e.r32(FSTS) & FS_PFO, 0);
    assert!(e.dma(0x0008, 0x99000, Access::Read).is_err());
    assert_eq!(e.r32(FSTS) & (FS_PFO | FS_PPF), FS_PFO | FS_PPF);
    assert_eq!(e.frcd(0).0, 0x1000, "the oldest record is kept");
    // Software drains: clear all F, then PFO; the next fault records at the next index.
    for i in 0..NFR as u64 {
        e.clear_frcd(i);
    }
    e.w32(FSTS, FS_PFO);
    assert_eq!(e.r32(FSTS) & 0xff, 0);
    assert!(e.dma(0x0008, 0xaa000, Access::Read).is_err());
    assert_eq!(e.r32(FSTS) & 0xff00, 0, "FRI = 0 (wrapped)");
    assert_eq!(e.frcd(0).0, 0xaa000);
    assert_eq!(e.msi.take().len(), 1);
    // FPD: blocked, not recorded.
    let t = e.ctx(0x0010, 3, 3);
    e.put(CTX + 0x10 * 16, t | 1 | 2);
    assert!(e.dma(0x0010, 0x1000, Access::Read).is_err());
    assert_eq!(e.frcd(1).1 & FRCD_F, 0);
}

#[test]
fn queue_wraps_and_stops_at_a_bad_descriptor() {
    let e = Env::new(samecore(PinPolicy::Map));
    e.enable();
    e.enable_qi(0); // 256 entries
    let batch: Vec<_> = (0..200)
        .map(|i| wait_desc(i, STATUS, true, false))
        .collect();
    e.submit(&batch);
    assert_eq!(e.r64(IQH), 200 << 4);
    let batch: Vec<_> = (200..300)
        .map(|i| wait_desc(i, STATUS, true, false))
        .collect();
    e.submit(&batch);
    assert_eq!(e.r64(IQH), 44 << 4, "wrapped");
    assert_eq!(e.get(STATUS) as u32, 299);
    assert_eq!(e.counter("inv.wait"), 300);
    // A bad descriptor: IQE, the fault event, IQH stays on it.
    e.submit(&[
        wait_desc(1, STATUS, true, false),
        (0x7, 0),
        wait_desc(2, STATUS, true, false),
    ]);
    assert_eq!(e.r64(IQH), 45 << 4);
    assert_ne!(e.r32(FSTS) & FS_IQE, 0);
    assert_eq!(e.get(STATUS) as u32, 1);
    assert_eq!(e.msi.take(), vec![(u64::from(FE_ADDR), FE_DATA)]);
    // Reserved bits are bad too; software fixes the descriptor, clears IQE, processing resumes.
    e.put(IQ + 45 * 16, wait_desc(3, STATUS, true, false).0 | 1 << 20);
    e.w32(FSTS, FS_IQE);
    assert_ne!(e.r32(FSTS) & FS_IQE, 0, "still bad");
    e.put(IQ + 45 * 16, wait_desc(3, STATUS, true, false).0);
    e.w32(FSTS, FS_IQE);
    assert_eq!(e.r32(FSTS) & FS_IQE, 0);
    assert_eq!(e.r64(IQH), 47 << 4);
    assert_eq!(e.get(STATUS) as u32, 2);
    // A tail beyond the queue is an IQE as well; so is a device-TLB descriptor (no DT).
    e.w64(IQT, 300 << 4);
    assert_ne!(e.r32(FSTS) & FS_IQE, 0);
    e.w64(IQT, 47 << 4);
    e.w32(FSTS, FS_IQE);
    e.submit(&[(0x3, 0)]);
    assert_ne!(e.r32(FSTS) & FS_IQE, 0);
}

#[test]
fn wait_descriptor_status_and_completion_interrupt() {
    let e = Env::new(samecore(PinPolicy::Map));
    e.enable();
    e.enable_qi(1);
    e.submit(&[wait_desc(0xabcd, STATUS + 8, true, true)]);
    assert_eq!(e.get(STATUS + 8) as u32, 0xabcd);
    assert_eq!(e.r32(ICS), ICS_IWC);
    assert_eq!(e.msi.take(), vec![(u64::from(IE_ADDR), IE_DATA)]);
    // IWC already set: no second interrupt.
    e.submit(&[wait_desc(1, 0, false, true)]);
    assert!(e.msi.take().is_empty());
    e.w32(ICS, ICS_IWC);
    assert_eq!(e.r32(ICS), 0);
    // Masked: IP, then the MSI when unmasked.
    e.w32(IECTL, CTL_IM);
    e.submit(&[wait_desc(1, 0, false, true)]);
    assert_eq!(e.r32(IECTL), CTL_IM | CTL_IP);
    assert!(e.msi.take().is_empty());
    e.w32(IECTL, 0);
    assert_eq!(e.msi.take(), vec![(u64::from(IE_ADDR), IE_DATA)]);
    // A status address outside RAM is a queue error, not a write anywhere.
    e.submit(&[wait_desc(5, 0x7000_0000, true, false)]);
    assert_ne!(e.r32(FSTS) & FS_IQE, 0);
    assert_eq!(e.counter("inv.wait"), 3);
}

#[test]
fn iotlb_invalidations_really_flush() {
    let e = Env::new(samecore(PinPolicy::Map));
    let t = e.ctx(0x0008, 1, 3);
    let t2 = e.ctx(0x0010, 2, 3);
    e.map(t, 3, 0x1000, DATA, true, true);
    e.map(t2, 3, 0x1000, DATA + 0x8000, true, true);
    e.enable();
    e.enable_qi(0);
    assert_eq!(e.dma(0x0008, 0x1000, Access::Read), Ok(DATA));
    assert_eq!(e.dma(0x0010, 0x1000, Access::Read), Ok(DATA + 0x8000));
    // Changed without invalidation: the cached translation stays.
    e.map(t, 3, 0x1000, DATA + 0x1000, true, true);
    assert_eq!(e.dma(0x0008, 0x1000, Access::Read), Ok(DATA));
    e.psi(1, 0x2000, 0); // another page: no effect
    assert_eq!(e.dma(0x0008, 0x1000, Access::Read), Ok(DATA));
    e.psi(2, 0x1000, 0); // another domain: no effect
    assert_eq!(e.dma(0x0008, 0x1000, Access::Read), Ok(DATA));
    assert_eq!(e.dma(0x0010, 0x1000, Access::Read), Ok(DATA + 0x8000));
    e.psi(1, 0x1000, 0);
    assert_eq!(e.dma(0x0008, 0x1000, Access::Read), Ok(DATA + 0x1000));
    assert_eq!((e.counter("maps"), e.counter("unmaps")), (1, 1));
    // Page range with a mask, through the queue.
    e.map(t, 3, 0x1000, DATA + 0x2000, true, true);
    e.submit(&[iotlb_desc(3, 1, 0x0, 2)]);
    assert_eq!(e.dma(0x0008, 0x1000, Access::Read), Ok(DATA + 0x2000));
    // Domain.
    e.map(t, 3, 0x1000, DATA + 0x3000, true, true);
    e.map(t2, 3, 0x1000, DATA + 0x9000, true, true);
    e.submit(&[iotlb_desc(2, 1, 0, 0)]);
    assert_eq!(e.dma(0x0008, 0x1000, Access::Read), Ok(DATA + 0x3000));
    assert_eq!(e.dma(0x0010, 0x1000, Access::Read), Ok(DATA + 0x8000));
    // Global.
    e.submit(&[iotlb_desc(1, 0, 0, 0)]);
    assert_eq!(e.dma(0x0010, 0x1000, Access::Read), Ok(DATA + 0x9000));
    // Unmap + PSI: the page no longer translates and counts as an unmap.
    let unmaps = e.counter("unmaps");
    e.unmap(t, 3, 0x1000);
    e.submit(&[iotlb_desc(3, 1, 0x1000, 0)]);
    assert!(e.dma(0x0008, 0x1000, Access::Read).is_err());
    assert_eq!(e.counter("unmaps"), unmaps + 1);
    // A 2 MiB leaf is dropped by an invalidation of any of its 4 KiB pages' range.
    e.map2m(t, 3, 0x20_0000, 0x60_0000);
    e.submit(&[iotlb_desc(3, 1, 0x20_0000, 9)]);
    assert_eq!(e.dma(0x0008, 0x20_5000, Access::Read), Ok(0x60_5000));
    e.map2m(t, 3, 0x20_0000, 0x40_0000);
    e.submit(&[iotlb_desc(3, 1, 0x20_0000, 9)]);
    assert_eq!(e.dma(0x0008, 0x20_5000, Access::Read), Ok(0x40_5000));
    // Context cache: the device moves to domain 2's tables; only a context invalidation
    // makes the unit see it.
    e.put(CTX + 8 * 16, t2 | 1);
    e.put(CTX + 8 * 16 + 8, 1 | 2 << 8);
    assert!(e.dma(0x0008, 0x1000, Access::Read).is_err());
    e.submit(&[(1 | 3 << 4 | 0x0008 << 32, 0), iotlb_desc(1, 0, 0, 0)]);
    assert_eq!(e.dma(0x0008, 0x1000, Access::Read), Ok(DATA + 0x9000));
    assert_eq!(e.counter("inv.iotlb_global"), 2);
    assert_eq!(e.counter("inv.iotlb_domain"), 1);
    assert!(e.counter("inv.iotlb_page") >= 6);
    assert_eq!(e.counter("inv.context"), 1);
}

#[test]
fn pin_on_map_waits_for_in_flight_accesses() {
    let e = Env::new(samecore(PinPolicy::Map));
    let t = e.ctx(0x0008, 1, 3);
    e.enable();
    e.map(t, 3, 0x1000, DATA, true, true);
    e.psi(1, 0x1000, 0);
    assert!(e.pins.has(DATA), "pinned at the map invalidation");
    assert_eq!(e.counter("maps"), 1);
    assert_eq!(e.counter("pinned.current"), 1);
    let tok = e.vtd.access_begin();
    assert_eq!(e.dma(0x0008, 0x1000, Access::Write), Ok(DATA));
    e.unmap(t, 3, 0x1000);
    e.psi(1, 0x1000, 0);
    assert!(e.dma(0x0008, 0x1000, Access::Write).is_err());
    assert!(
        e.pins.has(DATA),
        "an access that translated before is still in flight"
    );
    assert_eq!(e.counter("stale.current"), 1);
    e.vtd.access_end(tok);
    assert!(!e.pins.has(DATA));
    assert_eq!(e.counter("stale.current"), 0);
    assert_eq!(e.counter("stale.max"), 1);
    assert_eq!(e.counter("pinned.current"), 0);
    assert_eq!(e.counter("pinned.peak"), 1);
    // Strict unmap with nothing in flight: never stale.
    let e = Env::new(samecore(PinPolicy::Map));
    let t = e.ctx(0x0008, 1, 3);
    e.enable();
    e.map(t, 3, 0x1000, DATA, true, true);
    e.psi(1, 0x1000, 0);
    let tok = e.vtd.access_begin();
    e.dma(0x0008, 0x1000, Access::Write).unwrap();
    e.vtd.access_end(tok);
    e.unmap(t, 3, 0x1000);
    e.psi(1, 0x1000, 0);
    assert!(!e.pins.has(DATA));
    assert_eq!(e.counter("stale.max"), 0);
    assert!(e.pins.violations.lock().unwrap().is_empty());
}

#[test]
fn deferred_unpins_batch_256_or_10ms_and_pin_all() {
    let e = Env::new(samecore(PinPolicy::Deferred));
    let t = e.ctx(0x0008, 1, 3);
    e.enable();
    for i in 0..300u64 {
        e.map(t, 3, i << 12, DATA + (i << 12), true, true);
    }
    e.psi(1, 0, 9);
    assert_eq!(e.counter("pinned.current"), 300);
    for i in 0..3u64 {
        e.unmap(t, 3, i << 12);
    }
    e.psi(1, 0, 2);
    assert_eq!(e.counter("unmaps"), 3);
    assert_eq!(e.counter("pinned.current"), 300, "unpins deferred");
    std::thread::sleep(Duration::from_millis(11));
    e.r32(GSTS);
    assert_eq!(e.counter("pinned.current"), 297, "10 ms passed");
    for i in 3..300u64 {
        e.unmap(t, 3, i << 12);
    }
    e.psi(1, 0, 9);
    assert!(
        e.counter("pinned.current") <= 297 - 256,
        "a full batch of 256 goes at once"
    );
    assert_eq!(e.counter("pinned.peak"), 300);

    let e = Env::new(samecore(PinPolicy::All));
    assert_eq!(*e.pins.ranges.lock().unwrap(), vec![(0, RAM)]);
    assert_eq!(e.counter("pinned.current"), RAM / 4096);
    let t = e.ctx(0x0008, 1, 3);
    e.enable();
    e.map(t, 3, 0x1000, DATA, true, true);
    e.psi(1, 0x1000, 0);
    e.unmap(t, 3, 0x1000);
    e.psi(1, 0x1000, 0);
    assert!(e.pins.pinned.lock().unwrap().is_empty());
    assert_eq!(e.counter("pinned.current"), RAM / 4096);
}

#[test]
fn mlock_pinner_locks_guest_pages() {
    let ram = GuestRam::new(&[(0, 1 << 20)], Backing::Anonymous).unwrap();
    let p = MlockPinner::new(ram.memory().clone());
    if p.pin(0x3000, 4096) {
        assert_eq!(p.locked_bytes(), 4096);
        p.unpin(0x3000, 4096);
        assert_eq!(p.locked_bytes(), 0);
    } else {
        assert_eq!(p.failures(), 1, "a refused mlock is counted");
    }
    let before = p.failures();
    assert!(!p.pin(1 << 20, 4096), "outside RAM");
    assert!(!p.pin((1 << 20) - 4096, 8192), "crossing the end of RAM");
    assert_eq!(p.failures(), before + 2);
}

fn irte(vector: u64, apic: u64, dlm: u64, svt: u64, sq: u64, sid: u64) -> (u64, u64) {
    (
        1 | dlm << 5 | vector << 16 | apic << 40,
        sid | sq << 16 | svt << 18,
    )
}

fn remappable(handle: u64, shv: bool) -> u64 {
    0xfee0_0000 | (handle & 0x7fff) << 5 | (handle >> 15) << 2 | 0x10 | u64::from(shv) << 3
}

#[test]
fn interrupt_remapping_and_its_faults() {
    let e = Env::new(samecore(PinPolicy::Map));
    let changes = Arc::new(AtomicUsize::new(0));
    let c2 = changes.clone();
    e.vtd.on_ir_change(Box::new(move || {
        c2.fetch_add(1, Ordering::SeqCst);
    }));
    let compat = MsiMessage {
        address: 0xfee0_3000,
        data: 0x25,
    };
    // IR off: everything passes unchanged.
    assert_eq!(e.vtd.remap(8, compat), Some(compat));
    let put_irte = |i: u64, (lo, hi): (u64, u64)| {
        e.put(IRT + i * 16, lo);
        e.put(IRT + i * 16 + 8, hi);
    };
    put_irte(5, irte(0x31, 2, 0, 1, 0, 0x0008));
    put_irte(7, irte(0x40, 1, 1, 2, 0, 0x0003)); // buses 0..=3
    e.w64(IRTA, IRT | 7); // 256 entries
    e.enable();
    e.cmd(G_SIRTP);
    e.set(G_IRE);
    assert_eq!(changes.load(Ordering::SeqCst), 2);
    assert_ne!(e.r32(GSTS) & (G_IRE | G_SIRTP), 0);
    let msg = |address, data| MsiMessage { address, data };
    assert_eq!(
        e.vtd.remap(0x0008, msg(remappable(5, false), 0)),
        Some(msg(0xfee0_2000, 0x31))
    );
    assert_eq!(
        e.vtd.remap(0x0008, msg(remappable(4, true), 1)),
        Some(msg(0xfee0_2000, 0x31)),
        "handle + subhandle"
    );
    assert_eq!(
        e.vtd.remap(0x0310, msg(remappable(7, false), 0)),
        Some(msg(0xfee0_1000, 0x140)),
        "bus range, lowest priority"
    );
    let faults: Vec<(u8, u16, MsiMessage, u64)> = {
        put_irte(9, (irte(0x31, 2, 0, 0, 0, 0).0 | 1 << 12, 0));
        put_irte(10, irte(0x31, 2, 3, 0, 0, 0));
        vec![
            (0x20, 8, msg(remappable(5, true), 0x10000), 5),
            (0x21, 8, msg(remappable(300, false), 0), 300),
            (0x22, 8, msg(remappable(6, false), 0), 6),
            (0x24, 8, msg(remappable(9, false), 0), 9),
            (0x24, 8, msg(remappable(10, false), 0), 10),
            (0x25, 8, compat, 0),
            (0x26, 0x0010, msg(remappable(5, false), 0), 5),
        ]
    };
    for (i, (reason, sid, m, index)) in faults.iter().enumerate() {
        assert_eq!(e.vtd.remap(*sid, *m), None, "reason {reason:#x}");
        let (lo, hi) = e.frcd(i as u64);
        assert_eq!((hi >> 32) & 0xff, u64::from(*reason));
        assert_eq!(hi & 0xffff, u64::from(*sid));
        assert_eq!(lo >> 48, *index);
    }
    assert_eq!(e.counter("faults.ir"), 7);
    assert_eq!(e.msi.take().len(), 1, "one fault event for the run");
    // CFI lets compatibility-format interrupts through.
    e.set(G_CFI);
    assert_eq!(e.vtd.remap(8, compat), Some(compat));
    // IEC invalidation tells the VMM.
    e.enable_qi(0);
    let before = changes.load(Ordering::SeqCst);
    e.submit(&[(0x4, 0), (0x4 | 1 << 4 | 5 << 32, 0)]);
    assert_eq!(changes.load(Ordering::SeqCst), before + 1);
    assert_eq!(e.counter("inv.iec"), 2);
    // A table outside RAM.
    e.w64(IRTA, 0x7000_0000 | 7);
    e.cmd(G_SIRTP);
    for i in 0..NFR as u64 {
        e.clear_frcd(i);
    }
    assert_eq!(e.vtd.remap(8, msg(remappable(5, false), 0)), None);
    assert_eq!((e.frcd(7).1 >> 32) & 0xff, 0x23);
}

#[test]
fn garbage_never_panics() {
    for seed in 1..=12u64 {
        let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
        let mode = if seed % 2 == 0 {
            PinPolicy::Map
        } else {
            PinPolicy::Deferred
        };
        let e = Env::new(samecore(mode));
        let checks = [Checker::new(), Checker::new()];
        e.vtd.add_listener(0x0008, checks[0].clone());
        e.vtd.add_listener(0x0010, checks[1].clone());
        // Random tables, queue and IRT contents in the low megabyte.
        for _ in 0..4000 {
            let a = rng.below(0x40000) & !7;
            let v = match rng.below(4) {
                0 => rng.next(),
                1 => (rng.below(RAM + 0x10000) & !0xfff) | rng.below(4),
                2 => rng.below(0x40000) & !0xfff | 1,
                _ => rng.below(16),
            };
            e.put(a, v);
        }
        let offs = [
            GCMD,
            RTADDR,
            CCMD,
            CCMD + 4,
            FSTS,
            FECTL,
            IQT,
            IQA,
            ICS,
            IECTL,
            IRTA,
            IVA,
            IOTLB,
            IOTLB + 4,
        ];
        let mut tokens = Vec::new();
        for _ in 0..3000 {
            match rng.below(10) {
                0..=3 => {
                    let off = if rng.chance(70) {
                        offs[rng.below(offs.len() as u64) as usize]
                    } else {
                        rng.below(VTD_SIZE + 8)
                    };
                    let v = match rng.below(3) {
                        0 => rng.next(),
                        1 => rng.below(0x40000) | rng.below(8),
                        _ => 1u64 << rng.below(64),
                    };
                    let len = [4usize, 8, 4, 8, 1, 2, 3][rng.below(7) as usize];
                    e.vtd.write(off, &v.to_le_bytes()[..len]);
                    let mut b = vec![0u8; len];
                    e.vtd.read(rng.below(VTD_SIZE + 8), &mut b);
                }
                4..=6 => {
                    let acc = if rng.chance(50) {
                        Access::Read
                    } else {
                        Access::Write
                    };
                    let sid = if rng.chance(50) {
                        rng.below(32) as u32
                    } else {
                        rng.next() as u32
                    };
                    let _ = e
                        .vtd
                        .translate(sid, rng.next() >> rng.below(64), rng.next(), acc);
                }
                7 => {
                    let m = MsiMessage {
                        address: if rng.chance(80) {
                            0xfee0_0000 | rng.below(0x10_0000)
                        } else {
                            rng.next()
                        },
                        data: rng.next() as u32,
                    };
                    let _ = e.vtd.remap(rng.next() as u16, m);
                }
                8 => tokens.push(e.vtd.access_begin()),
                _ => {
                    if let Some(t) = tokens.pop() {
                        e.vtd.access_end(t);
                    } else {
                        e.vtd.access_end(rng.next());
                    }
                }
            }
        }
        for t in tokens {
            e.vtd.access_end(t);
        }
        for c in &checks {
            let errs = c.errors.lock().unwrap();
            assert!(errs.is_empty(), "seed {seed}: {errs:?}");
        }
        assert!(
            e.pins.violations.lock().unwrap().is_empty(),
            "{:?}",
            e.pins.violations.lock().unwrap()
        );
    }
}

/// A DMA in flight in the property test.
struct InFlight {
    token: u64,
    gpa: u64,
}

/// Random map/unmap/invalidate/DMA steps with accesses in flight, strict invalidation: a page
/// is never unpinned while an IOTLB entry or an in-flight access refers to it, and every
/// translation matches the guest's mapping at that moment.
fn property_run(seed: u64, policy: PinPolicy, steps: usize) {
    let mut rng = Rng(seed);
    let e = Env::new(samecore(policy));
    let t = e.ctx(0x0008, 1, 3);
    e.enable();
    e.enable_qi(2);
    // An assigned device's listener holds exactly the readable mappings after each step.
    let check = Checker::new();
    e.vtd.add_listener(0x0008, check.clone());
    // IOVA pages that share a few IOTLB slots, so that evictions happen.
    let mut iovas = Vec::new();
    let mut p = 1u64;
    while iovas.len() < 48 {
        if iotlb::index(1, p) % 128 < 3 {
            iovas.push(p);
        }
        p += 1;
    }
    let gpas: Vec<u64> = (0..24).map(|i| DATA + i * 0x1000).collect();
    let mut model: HashMap<u64, (u64, bool, bool)> = HashMap::new();
    let mut inflight: Vec<InFlight> = Vec::new();
    let via_queue = |e: &Env, rng: &mut Rng, page: u64| {
        if rng.chance(50) {
            e.submit(&[
                iotlb_desc(3, 1, page << 12, 0),
                wait_desc(1, STATUS, true, false),
            ]);
        } else {
            e.psi(1, page << 12, 0);
        }
    };
    for step in 0..steps {
        match rng.below(12) {
            0..=2 => {
                let page = iovas[rng.below(iovas.len() as u64) as usize];
                let gpa = gpas[rng.below(gpas.len() as u64) as usize];
                let (r, w) = match rng.below(3) {
                    0 => (true, false),
                    1 => (false, true),
                    _ => (true, true),
                };
                e.map(t, 3, page << 12, gpa, r, w);
                model.insert(page, (gpa, r, w));
                via_queue(&e, &mut rng, page);
            }
            3..=4 => {
                if let Some(&page) = model
                    .keys()
                    .nth(rng.below(model.len().max(1) as u64) as usize)
                {
                    e.unmap(t, 3, page << 12);
                    model.remove(&page);
                    via_queue(&e, &mut rng, page);
                }
            }
            5 => {
                if rng.chance(50) {
                    e.submit(&[iotlb_desc(2, 1, 0, 0)]);
                } else {
                    e.submit(&[iotlb_desc(1, 0, 0, 0)]);
                }
            }
            6..=9 => {
                let page = iovas[rng.below(iovas.len() as u64) as usize];
                let acc = if rng.chance(50) {
                    Access::Read
                } else {
                    Access::Write
                };
                let token = e.vtd.access_begin();
                let r = e.dma(0x0008, page << 12 | 0x10, acc);
                let want = model.get(&page).and_then(|&(gpa, r, w)| {
                    let ok = if acc == Access::Read { r } else { w };
                    ok.then_some(gpa | 0x10)
                });
                assert_eq!(r.as_ref().ok().copied(), want, "seed {seed} step {step}");
                match r {
                    Ok(gpa) => {
                        let gpa = gpa & !0xfff;
                        *e.pins.inflight.lock().unwrap().entry(gpa).or_default() += 1;
                        inflight.push(InFlight { token, gpa });
                    }
                    Err(_) => e.vtd.access_end(token),
                }
            }
            _ => {
                if !inflight.is_empty() {
                    let a = inflight.swap_remove(rng.below(inflight.len() as u64) as usize);
                    *e.pins.inflight.lock().unwrap().get_mut(&a.gpa).unwrap() -= 1;
                    e.vtd.access_end(a.token);
                }
            }
        }
        // Everything an IOTLB entry or an in-flight access refers to is pinned.
        if policy != PinPolicy::All {
            for i in 0..iotlb::SLOTS {
                if let Some(en) = e.vtd.iotlb.slot(i) {
                    assert!(e.pins.has(en.leaf.gpa), "seed {seed} step {step}: slot");
                }
            }
            for a in &inflight {
                assert!(e.pins.has(a.gpa), "seed {seed} step {step}: in flight");
            }
        }
        let v = e.pins.violations.lock().unwrap();
        assert!(v.is_empty(), "seed {seed} step {step}: {v:?}");
        let told: HashMap<u64, (u64, Perm)> = model
            .iter()
            .filter(|(_, &(_, r, w))| r || w)
            .map(|(&p, &(g, read, write))| (p, (g, Perm { read, write })))
            .collect();
        assert_eq!(check.pages(), told, "seed {seed} step {step}");
        let errs = check.errors.lock().unwrap();
        assert!(errs.is_empty(), "seed {seed} step {step}: {errs:?}");
    }
    // Drain: end every access, unmap everything; no pin may be left (after the deferral).
    for a in inflight.drain(..) {
        *e.pins.inflight.lock().unwrap().get_mut(&a.gpa).unwrap() -= 1;
        e.vtd.access_end(a.token);
    }
    for page in model.keys().copied().collect::<Vec<_>>() {
        e.unmap(t, 3, page << 12);
        e.psi(1, page << 12, 0);
    }
    e.submit(&[iotlb_desc(1, 0, 0, 0)]);
    if policy == PinPolicy::Deferred {
        std::thread::sleep(Duration::from_millis(11));
        e.r32(GSTS);
    }
    if policy != PinPolicy::All {
        assert!(e.pins.pinned.lock().unwrap().is_empty(), "seed {seed}");
        assert_eq!(e.counter("pinned.current"), 0);
    }
    assert_eq!(e.vtd.br.in_flight(), 0);
}

#[test]
fn property_no_unpin_under_a_live_translation() {
    for (i, seed) in [0x1234_5678u64, 0xdead_beef, 0x0bad_cafe, 0x7777_1111]
        .into_iter()
        .enumerate()
    {
        let policy = if i % 2 == 0 {
            PinPolicy::Map
        } else {
            PinPolicy::Deferred
        };
        property_run(seed, policy, 20_000);
    }
}

#[test]
fn iotlb_hit_cost() {
    let e = Env::new(samecore(PinPolicy::Map));
    let t = e.ctx(0x0008, 1, 4);
    e.map(t, 4, 0x1000, DATA, true, true);
    e.enable();
    e.dma(0x0008, 0x1000, Access::Read).unwrap();
    let n = 200_000u64;
    let start = Instant::now();
    for i in 0..n {
        let r = e.vtd.translate(8, 0x1000 + (i & 0xff), 64, Access::Read);
        std::hint::black_box(r).unwrap();
    }
    let ns = start.elapsed().as_nanos() as f64 / n as f64;
    println!("iotlb hit: {ns:.1} ns per translate (this build's optimization level)");
    assert!(e.counter("iotlb.hits") >= n);
}

// ---- sidecore ----

/// The shared page for sidecore tests, leaked: the unit and its thread may outlive a failed
/// test's stack frame.
fn shared_page() -> *mut u8 {
    Box::leak(Box::new([0u64; 512])).as_mut_ptr().cast()
}

#[derive(Clone, Copy)]
struct GuestView(sidecore::SharedPage);
// SAFETY: the page is leaked (`shared_page`), so it outlives every thread using it.
unsafe impl Send for GuestView {}
impl GuestView {
    fn new(page: *mut u8) -> Self {
        // SAFETY: `page` comes from `shared_page`: 4096 bytes of u64s, leaked.
        GuestView(unsafe { sidecore::SharedPage::new(page) })
    }
    fn r32(&self, off: u64) -> u32 {
        sidecore::p32(self.0, off).load(Ordering::Acquire)
    }
    fn w32(&self, off: u64, v: u32) {
        sidecore::p32(self.0, off).store(v, Ordering::Release)
    }
    fn r64(&self, off: u64) -> u64 {
        sidecore::p64(self.0, off).load(Ordering::Acquire)
    }
    fn w64(&self, off: u64, v: u64) {
        sidecore::p64(self.0, off).store(v, Ordering::Release)
    }
    fn wait(&self, what: &str, f: impl Fn(&Self) -> bool) {
        let t = Instant::now();
        while !f(self) {
            assert!(t.elapsed() < Duration::from_secs(10), "timed out: {what}");
            std::hint::spin_loop();
        }
    }
}

fn sidecore_env() -> (Env, *mut u8, Arc<AtomicBool>, std::thread::JoinHandle<()>) {
    let e = Env::new(VtdConfig {
        mode: EmulationMode::Sidecore,
        pin: PinPolicy::Map,
    });
    let page = shared_page();
    // SAFETY: the page is leaked, so it outlives the unit and the sidecore thread.
    unsafe { e.vtd.attach_shared_page(page) };
    let stop = Arc::new(AtomicBool::new(false));
    let (v, s) = (e.vtd.clone(), stop.clone());
    let h = std::thread::spawn(move || v.run_sidecore(&s));
    (e, page, stop, h)
}

#[test]
fn sidecore_serves_a_guest_through_shared_memory() {
    let (e, page, stop, h) = sidecore_env();
    let g = GuestView::new(page);
    assert_eq!(g.r32(VER), 0x10);
    assert_eq!(g.r64(CAP), CAP_VALUE);
    let t = e.ctx(0x0008, 1, 3);
    e.map(t, 3, 0x1000, DATA, true, true);
    let gv = g;
    let guest = std::thread::spawn(move || {
        let g = gv;
        g.w32(FEADDR, FE_ADDR);
        g.w32(FEDATA, FE_DATA);
        g.w32(FECTL, 0);
        g.w32(IEADDR, IE_ADDR);
        g.w32(IEDATA, IE_DATA);
        g.w32(IECTL, 0);
        g.w64(RTADDR, RTA);
        g.w32(GCMD, G_SRTP);
        g.wait("RTPS", |g| g.r32(GSTS) & G_SRTP != 0);
        g.w32(GCMD, G_TE);
        g.wait("TES", |g| g.r32(GSTS) & G_TE != 0);
        g.w64(IQT, 0);
        g.w64(IQA, IQ);
        g.w32(GCMD, G_TE | G_QIE);
        g.wait("QIES", |g| g.r32(GSTS) & G_QIE != 0);
    });
    guest.join().unwrap();
    assert_eq!(e.dma(0x0008, 0x1000, Access::Read), Ok(DATA));
    // Queued invalidation with a wait descriptor: status in memory, IWC, the MSI.
    e.map(t, 3, 0x1000, DATA + 0x1000, true, true);
    for (i, d) in [
        iotlb_desc(3, 1, 0x1000, 0),
        wait_desc(0x5a5a, STATUS, true, true),
    ]
    .into_iter()
    .enumerate()
    {
        e.put(IQ + 16 * i as u64, d.0);
        e.put(IQ + 16 * i as u64 + 8, d.1);
    }
    g.w64(IQT, 2 << 4);
    g.wait("status write", |_| e.get(STATUS) as u32 == 0x5a5a);
    g.wait("IQH", |g| g.r64(IQH) == 2 << 4);
    g.wait("IWC", |g| g.r32(ICS) & ICS_IWC != 0);
    assert_eq!(e.dma(0x0008, 0x1000, Access::Read), Ok(DATA + 0x1000));
    // The MSI goes out just after the status is published (outside the unit's lock).
    g.wait("IE MSI", |_| e.msi.0.lock().unwrap().len() == 1);
    assert_eq!(e.msi.take(), vec![(u64::from(IE_ADDR), IE_DATA)]);
    // Write-1-to-clear of exactly the set bit is seen (the published value carries the mark).
    g.w32(ICS, ICS_IWC);
    g.wait("IWC clear", |g| g.r32(ICS) == 0);
    // A bad descriptor: IQE shows in FSTS, and the guest clears it the same way.
    e.put(IQ + 32, 0xf);
    e.put(IQ + 40, 0);
    g.w64(IQT, 3 << 4);
    g.wait("IQE", |g| g.r32(FSTS) & FS_IQE != 0);
    g.wait("FE MSI", |_| e.msi.0.lock().unwrap().len() == 1);
    assert_eq!(e.msi.take(), vec![(u64::from(FE_ADDR), FE_DATA)]);
    let w = wait_desc(7, STATUS, true, false);
    e.put(IQ + 32, w.0);
    e.put(IQ + 40, w.1);
    g.w32(FSTS, FS_IQE);
    g.wait("IQE clear", |g| g.r32(FSTS) == 0);
    g.wait("resumed", |g| g.r64(IQH) == 3 << 4);
    assert_eq!(e.get(STATUS) as u32, 7);
    // A DMA fault from a device thread shows in the page at once; the CCMD command bit clears.
    assert!(e.dma(0x0008, 0x9000, Access::Read).is_err());
    assert_ne!(g.r32(FSTS) & FS_PPF, 0);
    g.w64(CCMD, CCMD_ICC | 1 << 61);
    g.wait("ICC", |g| g.r64(CCMD) & CCMD_ICC == 0);
    assert_eq!((g.r64(CCMD) >> 59) & 3, 1);
    // Page 1 still traps: the fault record is read and cleared through `read`/`write`.
    assert_eq!((e.frcd(0).1 >> 32) & 0xff, 0x6);
    e.clear_frcd(0);
    g.wait("PPF clear", |g| g.r32(FSTS) & FS_PPF == 0);
    stop.store(true, Ordering::SeqCst);
    h.join().unwrap();
    assert!(e.counter("sidecore.polls") > 0);
    assert!(e.counter("sidecore.busy_polls") > 0);
    assert!(e.counter("sidecore.cpu_ns") > 0);
}

/// The guest writes RTADDR and then GCMD.SRTP back to back; the unit must latch the RTADDR
/// written before the command it acts on, never an older one.
#[test]
fn sidecore_srtp_latches_the_rtaddr_written_before_it() {
    let (e, page, stop, h) = sidecore_env();
    let g = GuestView::new(page);
    // Two root tables: A maps IOVA 0x1000 of device 8 to DATA, B to DATA + 0x1000.
    let (rta_a, rta_b) = (RTA, 0x60000);
    let ta = e.ctx(0x0008, 1, 3);
    e.map(ta, 3, 0x1000, DATA, true, true);
    let ctb = 0x61000;
    let tb = e.alloc();
    e.put(rta_b, ctb | 1);
    e.put(ctb + 8 * 16, tb | 1);
    e.put(ctb + 8 * 16 + 8, 1 | 1 << 8);
    e.map(tb, 3, 0x1000, DATA + 0x1000, true, true);
    g.w32(GCMD, G_TE);
    g.wait("TES", |g| g.r32(GSTS) & G_TE != 0);
    for i in 0..2000u32 {
        let (rta, want) = if i % 2 == 0 {
            (rta_a, DATA)
        } else {
            (rta_b, DATA + 0x1000)
        };
        g.w64(RTADDR, rta);
        // A varying gap, so that a poller that snapshots RTADDR before it looks at GCMD
        // would sometimes take the old value with the new command.
        for _ in 0..(i % 64) * 8 {
            std::hint::spin_loop();
        }
        g.w32(GCMD, G_TE | G_SRTP);
        g.wait("GCMD consumed", |g| g.r32(GCMD) == SC_GCMD_CONSUMED);
        assert_eq!(e.dma(0x0008, 0x1000, Access::Read), Ok(want), "round {i}");
    }
    stop.store(true, Ordering::SeqCst);
    h.join().unwrap();
}

/// Device threads translate and copy inside access brackets while the guest maps, unmaps and
/// invalidates (strict): at the moment a device holds a translation its page is pinned, and no
/// page is unpinned while a device still uses it.
#[test]
fn concurrent_devices_never_use_an_unpinned_page() {
    let e = Env::new(samecore(PinPolicy::Map));
    let t = e.ctx(0x0008, 1, 3);
    e.enable();
    let stop = Arc::new(AtomicBool::new(false));
    let mut devs = Vec::new();
    for d in 0..2u64 {
        let (vtd, pins, stop) = (e.vtd.clone(), e.pins.clone(), stop.clone());
        devs.push(std::thread::spawn(move || {
            let mut rng = Rng(0x5555 + d);
            let mut ok = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let tok = vtd.access_begin();
                let iova = (1 + rng.below(16)) << 12;
                if let Ok((gpa, _)) = vtd.translate(8, iova, 64, Access::Read) {
                    let page = gpa & !0xfff;
                    {
                        let mut inf = pins.inflight.lock().unwrap();
                        *inf.entry(page).or_default() += 1;
                        if !pins.pinned.lock().unwrap().contains(&page) {
                            pins.violations
                                .lock()
                                .unwrap()
                                .push(format!("translated to unpinned {page:#x}"));
                        }
                    }
                    ok += 1;
                    for _ in 0..rng.below(200) {
                        std::hint::spin_loop();
                    }
                    *pins.inflight.lock().unwrap().get_mut(&page).unwrap() -= 1;
                }
                vtd.access_end(tok);
            }
            ok
        }));
    }
    let mut rng = Rng(99);
    let deadline = Instant::now() + Duration::from_millis(1500);
    let mut mapped = HashSet::new();
    while Instant::now() < deadline {
        let page = 1 + rng.below(16);
        if mapped.remove(&page) {
            e.unmap(t, 3, page << 12);
        } else {
            e.map(t, 3, page << 12, DATA + rng.below(8) * 0x1000, true, true);
            mapped.insert(page);
        }
        e.psi(1, page << 12, 0);
    }
    stop.store(true, Ordering::Relaxed);
    let done: u64 = devs.into_iter().map(|h| h.join().unwrap()).sum();
    assert!(done > 100, "devices translated {done} times");
    let v = e.pins.violations.lock().unwrap();
    assert!(v.is_empty(), "{v:?}");
}

/// Sidecore: a masked fault event shows as FECTL.IP in the page and the MSI goes out when the
/// guest unmasks; an IR change noticed by the poll runs the VMM's callback.
#[test]
fn sidecore_fault_event_mask_and_ir_callback() {
    let (e, page, stop, h) = sidecore_env();
    let g = GuestView::new(page);
    let changes = Arc::new(AtomicUsize::new(0));
    let c2 = changes.clone();
    e.vtd.on_ir_change(Box::new(move || {
        c2.fetch_add(1, Ordering::SeqCst);
    }));
    e.ctx(0x0008, 1, 3);
    g.w32(FEADDR, FE_ADDR);
    g.w32(FEDATA, FE_DATA);
    g.w32(FECTL, CTL_IM);
    g.w64(RTADDR, RTA);
    g.w32(GCMD, G_SRTP);
    g.wait("RTPS", |g| g.r32(GSTS) & G_SRTP != 0);
    g.w32(GCMD, G_TE);
    g.wait("TES", |g| g.r32(GSTS) & G_TE != 0);
    g.wait("IM seen", |g| {
        g.r32(FECTL) == CTL_IM && g.r32(GCMD) == SC_GCMD_CONSUMED
    });
    assert!(e.dma(0x0008, 0x1000, Access::Write).is_err());
    assert_eq!(g.r32(FECTL), CTL_IM | CTL_IP);
    assert!(e.msi.take().is_empty());
    g.w32(FECTL, 0);
    g.wait("IP clear", |g| g.r32(FECTL) == 0);
    g.wait("FE MSI", |_| e.msi.0.lock().unwrap().len() == 1);
    assert_eq!(e.msi.take(), vec![(u64::from(FE_ADDR), FE_DATA)]);
    // IR enable through the page: the callback runs from the polling thread.
    g.w64(IRTA, IRT | 7);
    g.w32(GCMD, G_TE | G_SIRTP);
    g.wait("IRTPS", |g| g.r32(GSTS) & G_SIRTP != 0);
    g.w32(GCMD, G_TE | G_IRE);
    g.wait("IRES", |g| g.r32(GSTS) & G_IRE != 0);
    g.wait("callbacks", |_| changes.load(Ordering::SeqCst) >= 2);
    stop.store(true, Ordering::SeqCst);
    h.join().unwrap();
}

/// Sidecore: garbage written into the shared page (and the trapping page) while the polling
/// thread runs and devices translate: nothing panics, the thread keeps polling and stops.
#[test]
fn sidecore_garbage_never_panics() {
    let (e, page, stop, h) = sidecore_env();
    let g = GuestView::new(page);
    let mut rng = Rng(0xfeed_f00d);
    for _ in 0..2000 {
        let a = rng.below(0x40000) & !7;
        e.put(
            a,
            if rng.chance(50) {
                rng.next()
            } else {
                rng.below(0x40000) | 1
            },
        );
    }
    let deadline = Instant::now() + Duration::from_millis(400);
    while Instant::now() < deadline {
        match rng.below(4) {
            0 | 1 => {
                let off = if rng.chance(60) {
                    [
                        GCMD,
                        CCMD,
                        CCMD + 4,
                        IQT,
                        FSTS,
                        FECTL,
                        ICS,
                        IECTL,
                        RTADDR,
                        IQA,
                        IRTA,
                    ][rng.below(11) as usize]
                } else {
                    rng.below(0x1000) & !3
                };
                g.w32(off, rng.next() as u32);
            }
            2 => {
                let v = rng.next();
                e.vtd
                    .write(0x1000 + (rng.below(0x1000) & !3), &v.to_le_bytes()[..4]);
            }
            _ => {
                let t = e.vtd.access_begin();
                let _ = e
                    .vtd
                    .translate(rng.below(64) as u32, rng.next(), 64, Access::Write);
                e.vtd.access_end(t);
            }
        }
    }
    stop.store(true, Ordering::SeqCst);
    h.join().unwrap();
    assert!(e.counter("sidecore.busy_polls") > 0);
}

// ---- map listeners (assigned devices) ----

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Call {
    /// A readable mapping, writable or not.
    Map(u64, u64, u64, bool),
    /// A write-only mapping.
    MapWriteOnly(u64, u64, u64),
    Unmap(u64, u64),
}

/// Records the calls, and with each the wait-descriptor status word in guest memory at that
/// moment (to check that a wait completes only after the calls before it).
struct Rec {
    mem: GuestMemoryMmap,
    calls: Mutex<Vec<(Call, u32)>>,
}
impl Rec {
    fn new(mem: &GuestMemoryMmap) -> Arc<Rec> {
        Arc::new(Rec {
            mem: mem.clone(),
            calls: Mutex::new(Vec::new()),
        })
    }
    fn push(&self, c: Call) {
        let status = self.mem.read_obj::<u32>(GuestAddress(STATUS)).unwrap();
        self.calls.lock().unwrap().push((c, status));
    }
    fn take(&self) -> Vec<Call> {
        let v = std::mem::take(&mut *self.calls.lock().unwrap());
        v.into_iter().map(|(c, _)| c).collect()
    }
}
impl MapListener for Rec {
    fn map(&self, iova: u64, gpa: u64, len: u64, perm: Perm) {
        self.push(match perm.read {
            true => Call::Map(iova, gpa, len, perm.write),
            false => Call::MapWriteOnly(iova, gpa, len),
        });
    }
    fn unmap(&self, iova: u64, len: u64) {
        self.push(Call::Unmap(iova, len));
    }
}

use Call::{Map as M, Unmap as U};

#[test]
fn listener_follows_page_invalidations() {
    let e = Env::new(samecore(PinPolicy::Map));
    let t = e.ctx(0x0008, 1, 3);
    let t2 = e.ctx(0x0010, 2, 3);
    let rec = Rec::new(&e.mem);
    let other = Rec::new(&e.mem);
    e.vtd.add_listener(0x0008, rec.clone());
    e.vtd.add_listener(0x0018, other.clone());
    // Translation off: all RAM at its own address.
    assert_eq!(rec.take(), vec![M(0, 0, RAM, true)]);
    e.enable();
    assert_eq!(rec.take(), vec![U(0, RAM)]);
    // Requester 0x18 has no context entry: nothing mapped once translation is on.
    assert_eq!(other.take(), vec![M(0, 0, RAM, true), U(0, RAM)]);
    e.map(t, 3, 0x1000, DATA, true, true);
    e.psi(1, 0x1000, 0);
    assert_eq!(rec.take(), vec![M(0x1000, DATA, 0x1000, true)]);
    // Read-only, write-only; another requester's map is not told.
    e.map(t, 3, 0x5000, DATA + 0x5000, true, false);
    e.map(t, 3, 0x6000, DATA + 0x6000, false, true);
    e.psi(1, 0x4000, 2);
    assert_eq!(
        rec.take(),
        vec![
            M(0x5000, DATA + 0x5000, 0x1000, false),
            Call::MapWriteOnly(0x6000, DATA + 0x6000, 0x1000)
        ]
    );
    e.map(t2, 3, 0x1000, DATA + 0x9000, true, true);
    e.psi(2, 0x1000, 0);
    assert!(rec.take().is_empty());
    // Unmap.
    e.unmap(t, 3, 0x1000);
    e.psi(1, 0x1000, 0);
    assert_eq!(rec.take(), vec![U(0x1000, 0x1000)]);
    // Contiguous pages: one call; a change inside unmaps the whole extent, maps it again.
    for i in 0..4 {
        e.map(
            t,
            3,
            0x10000 + i * 0x1000,
            DATA + 0x10000 + i * 0x1000,
            true,
            true,
        );
    }
    e.psi(1, 0x10000, 2);
    assert_eq!(rec.take(), vec![M(0x10000, DATA + 0x10000, 0x4000, true)]);
    e.map(t, 3, 0x11000, DATA + 0x11000, true, false);
    e.psi(1, 0x11000, 0);
    assert_eq!(
        rec.take(),
        vec![
            U(0x10000, 0x4000),
            M(0x10000, DATA + 0x10000, 0x1000, true),
            M(0x11000, DATA + 0x11000, 0x1000, false),
            M(0x12000, DATA + 0x12000, 0x2000, true),
        ]
    );
    // A 2 MiB leaf: one call.
    e.map2m(t, 3, 0x20_0000, 0x60_0000);
    e.psi(1, 0x20_0000, 9);
    assert_eq!(rec.take(), vec![M(0x20_0000, 0x60_0000, 0x20_0000, true)]);
    // A leaf outside guest RAM is not a mapping.
    e.map(t, 3, 0x7000, 0x4000_0000, true, true);
    e.psi(1, 0x7000, 0);
    assert!(rec.take().is_empty());
    assert!(other.take().is_empty());
    assert_eq!(e.counter("listener.maps"), 10);
    assert_eq!(e.counter("listener.unmaps"), 4);
    assert!(e.counter("listener.walks") >= 8);
}

#[test]
fn listener_domain_context_and_queued_invalidations() {
    let e = Env::new(samecore(PinPolicy::Map));
    let t = e.ctx(0x0008, 1, 4);
    e.map(t, 4, 0x1000, DATA, true, true);
    e.enable();
    e.enable_qi(0);
    // Added with translation on: told at once.
    let rec = Rec::new(&e.mem);
    e.vtd.add_listener(0x0008, rec.clone());
    assert_eq!(rec.take(), vec![M(0x1000, DATA, 0x1000, true)]);
    // Domain invalidation through the queue finds new mappings (anywhere in the 48-bit
    // space); the wait after it completes only after the listener was told.
    e.map(t, 4, 0x7f_0000_0000, DATA + 0x3000, true, false);
    e.unmap(t, 4, 0x1000);
    e.put(STATUS, 0);
    e.submit(&[iotlb_desc(2, 1, 0, 0), wait_desc(0x77, STATUS, true, false)]);
    assert_eq!(e.get(STATUS) as u32, 0x77);
    let calls = std::mem::take(&mut *rec.calls.lock().unwrap());
    assert_eq!(
        calls,
        vec![
            (U(0x1000, 0x1000), 0),
            (M(0x7f_0000_0000, DATA + 0x3000, 0x1000, false), 0)
        ]
    );
    // Another domain's invalidation: nothing. Global: no change, nothing.
    e.submit(&[iotlb_desc(2, 5, 0, 0), iotlb_desc(1, 0, 0, 0)]);
    assert!(rec.take().is_empty());
    // The device moves to a new domain (context entry rewritten) with other tables: a
    // device-selective context invalidation re-walks them.
    let t9 = e.alloc();
    e.map(t9, 3, 0x2000, DATA + 0x8000, true, true);
    let ce = CTX + 8 * 16;
    e.put(ce, t9 | 1);
    e.put(ce + 8, 1 | 9 << 8);
    e.submit(&[
        (1 | 3 << 4 | 0x0008 << 32, 0),
        wait_desc(0x78, STATUS, true, false),
    ]);
    assert_eq!(
        rec.take(),
        vec![
            U(0x7f_0000_0000, 0x1000),
            M(0x2000, DATA + 0x8000, 0x1000, true)
        ]
    );
    // Page invalidation in the new domain; the old domain's is ignored.
    e.map(t9, 3, 0x3000, DATA + 0x9000, true, true);
    e.submit(&[iotlb_desc(3, 1, 0x3000, 0)]);
    assert!(rec.take().is_empty());
    e.submit(&[iotlb_desc(3, 9, 0x3000, 0)]);
    assert_eq!(rec.take(), vec![M(0x3000, DATA + 0x9000, 0x1000, true)]);
    // Removed: no calls, ever.
    e.vtd.remove_listener(0x0008);
    e.unmap(t9, 3, 0x3000);
    e.submit(&[iotlb_desc(1, 0, 0, 0)]);
    assert!(rec.take().is_empty());
}

#[test]
fn listener_identity_maps_follow_te() {
    let ram = GuestRam::new(&[(0, 5 << 20), (6 << 20, 2 << 20)], Backing::Anonymous).unwrap();
    let mem = ram.memory().clone();
    let stats = StatsRegistry::new();
    let vtd = Vtd::new(
        samecore(PinPolicy::Map),
        mem.clone(),
        Arc::new(Msis::default()),
        Arc::new(TestPinner::default()),
        &stats,
    );
    let put = |a: u64, v: u64| mem.write_obj(v, GuestAddress(a)).unwrap();
    // Requester 8: root at RTA, context table at CTX, 3-level tables mapping IOVA 0x1000 and
    // 0x2000 to DATA..DATA+0x2000 (one run).
    let (l3, l2, l1) = (TABLES, TABLES + 0x1000, TABLES + 0x2000);
    put(RTA, CTX | 1);
    put(CTX + 8 * 16, l3 | 1);
    put(CTX + 8 * 16 + 8, 1 | 1 << 8);
    put(l3, l2 | 3);
    put(l2, l1 | 3);
    put(l1 + 8, DATA | 3);
    put(l1 + 16, (DATA + 0x1000) | 3);
    let rec = Rec::new(&mem);
    vtd.add_listener(0x0008, rec.clone());
    assert_eq!(
        rec.take(),
        vec![M(0, 0, 5 << 20, true), M(6 << 20, 6 << 20, 2 << 20, true)]
    );
    let w32 = |off: u64, v: u32| vtd.write(off, &v.to_le_bytes());
    vtd.write(RTADDR, &RTA.to_le_bytes());
    w32(GCMD, G_SRTP);
    assert!(rec.take().is_empty());
    w32(GCMD, G_TE);
    assert_eq!(
        rec.take(),
        vec![
            U(0, 5 << 20),
            U(6 << 20, 2 << 20),
            M(0x1000, DATA, 0x2000, true)
        ]
    );
    // SRTP with translation on re-walks: nothing changed, nothing told.
    w32(GCMD, G_TE | G_SRTP);
    assert!(rec.take().is_empty());
    w32(GCMD, 0);
    assert_eq!(
        rec.take(),
        vec![
            U(0x1000, 0x2000),
            M(0, 0, 5 << 20, true),
            M(6 << 20, 6 << 20, 2 << 20, true)
        ]
    );
    // Invalidations while translation is off tell nothing.
    vtd.write(CCMD, &(CCMD_ICC | 1 << 61).to_le_bytes());
    assert!(rec.take().is_empty());
}

/// A listener that calls back into the unit (translates what it is told) does not deadlock.
struct Reenter(Arc<Vtd>, AtomicUsize);
impl MapListener for Reenter {
    fn map(&self, iova: u64, gpa: u64, _len: u64, _perm: Perm) {
        assert_eq!(
            self.0.translate(8, iova, 8, Access::Read).map(|r| r.0),
            Ok(gpa)
        );
        self.1.fetch_add(1, Ordering::SeqCst);
    }
    fn unmap(&self, _iova: u64, _len: u64) {}
}

#[test]
fn listener_may_call_into_the_unit() {
    let e = Env::new(samecore(PinPolicy::Map));
    let t = e.ctx(0x0008, 1, 3);
    e.enable();
    let l = Arc::new(Reenter(e.vtd.clone(), AtomicUsize::new(0)));
    e.vtd.add_listener(0x0008, l.clone());
    e.map(t, 3, 0x1000, DATA, true, true);
    e.psi(1, 0x1000, 0);
    assert_eq!(l.1.load(Ordering::SeqCst), 1);
    e.vtd.remove_listener(0x0008);
}

#[test]
fn sidecore_listener_told_before_the_wait_completes() {
    let (e, page, stop, h) = sidecore_env();
    let g = GuestView::new(page);
    let t = e.ctx(0x0008, 1, 3);
    e.map(t, 3, 0x1000, DATA, true, true);
    let rec = Rec::new(&e.mem);
    e.vtd.add_listener(0x0008, rec.clone());
    g.w64(RTADDR, RTA);
    g.w32(GCMD, G_SRTP);
    g.wait("RTPS", |g| g.r32(GSTS) & G_SRTP != 0);
    g.w32(GCMD, G_TE);
    g.wait("TES", |g| g.r32(GSTS) & G_TE != 0);
    // TES is published only after the listener was told.
    assert_eq!(
        rec.take(),
        vec![M(0, 0, RAM, true), U(0, RAM), M(0x1000, DATA, 0x1000, true)]
    );
    g.w64(IQT, 0);
    g.w64(IQA, IQ);
    g.w32(GCMD, G_TE | G_QIE);
    g.wait("QIES", |g| g.r32(GSTS) & G_QIE != 0);
    e.map(t, 3, 0x2000, DATA + 0x1000, true, false);
    for (i, d) in [
        iotlb_desc(3, 1, 0x2000, 0),
        wait_desc(0x5a5a, STATUS, true, false),
    ]
    .into_iter()
    .enumerate()
    {
        e.put(IQ + 16 * i as u64, d.0);
        e.put(IQ + 16 * i as u64 + 8, d.1);
    }
    g.w64(IQT, 2 << 4);
    g.wait("status write", |_| e.get(STATUS) as u32 == 0x5a5a);
    let calls = std::mem::take(&mut *rec.calls.lock().unwrap());
    assert_eq!(calls, vec![(M(0x2000, DATA + 0x1000, 0x1000, false), 0)]);
    stop.store(true, Ordering::SeqCst);
    h.join().unwrap();
}

#[test]
fn diff_splits_only_changed_extents() {
    use crate::listen::{diff, Ext};
    let x = |pages, gpa, perm| Ext { pages, gpa, perm };
    const RW: Perm = Perm::READ_WRITE;
    const RO: Perm = Perm {
        read: true,
        write: false,
    };
    let mut ext = std::collections::BTreeMap::new();
    ext.insert(0, x(8, 100, RW));
    ext.insert(20, x(2, 300, RW));
    // Page 3 of the first extent changes; the second is outside the range and stays.
    let (u, m) = diff(&mut ext, (2, 4), &[(2, 102, RW), (3, 200, RW)], &|_| false);
    assert_eq!(u, vec![(0, 8)]);
    assert_eq!(
        m,
        vec![(0, x(3, 100, RW)), (3, x(1, 200, RW)), (4, x(4, 104, RW))]
    );
    assert_eq!(ext.len(), 4);
    // Nothing changed: nothing told.
    let (u, m) = diff(
        &mut ext,
        (0, 30),
        &[
            (0, 100, RW),
            (1, 101, RW),
            (2, 102, RW),
            (3, 200, RW),
            (4, 104, RW),
            (5, 105, RW),
            (6, 106, RW),
            (7, 107, RW),
            (20, 300, RW),
            (21, 301, RW),
        ],
        &|_| false,
    );
    assert!(u.is_empty() && m.is_empty());
    // Everything gone.
    let (u, m) = diff(&mut ext, crate::listen::ALL, &[], &|_| false);
    assert_eq!(u.len(), 4);
    assert!(m.is_empty() && ext.is_empty());
    // A run stops where a RAM region starts.
    let new: Vec<(u64, u64, Perm)> = (0..4).map(|p| (p, 100 + p, RO)).collect();
    let (_, m) = diff(&mut ext, crate::listen::ALL, &new, &|g| g == 102);
    assert_eq!(m, vec![(0, x(2, 100, RO)), (2, x(2, 102, RO))]);
}

/// A listener that checks the calls make sense: maps never overlap what is mapped, an unmap
/// is exactly an earlier map.
#[derive(Default)]
struct Checker {
    /// iova -> (len, gpa, permission)
    mapped: Mutex<std::collections::BTreeMap<u64, (u64, u64, Perm)>>,
    errors: Mutex<Vec<String>>,
}
impl Checker {
    fn new() -> Arc<Checker> {
        Arc::new(Checker::default())
    }
    /// What the listener holds, by 4 KiB page: page -> (gpa, permission).
    fn pages(&self) -> HashMap<u64, (u64, Perm)> {
        let mut out = HashMap::new();
        for (&iova, &(len, gpa, w)) in self.mapped.lock().unwrap().iter() {
            for k in 0..len >> 12 {
                out.insert((iova >> 12) + k, (gpa + (k << 12), w));
            }
        }
        out
    }
}
impl MapListener for Checker {
    fn map(&self, iova: u64, gpa: u64, len: u64, perm: Perm) {
        let mut m = self.mapped.lock().unwrap();
        let overlaps = m
            .range(..iova + len)
            .next_back()
            .is_some_and(|(&s, &(l, _, _))| s + l > iova);
        if overlaps || len == 0 || (iova | gpa | len) & 0xfff != 0 {
            self.errors
                .lock()
                .unwrap()
                .push(format!("map {iova:#x}+{len:#x} -> {gpa:#x}"));
        }
        m.insert(iova, (len, gpa, perm));
    }
    fn unmap(&self, iova: u64, len: u64) {
        if self.mapped.lock().unwrap().remove(&iova).map(|m| m.0) != Some(len) {
            self.errors
                .lock()
                .unwrap()
                .push(format!("unmap {iova:#x}+{len:#x}"));
        }
    }
}
