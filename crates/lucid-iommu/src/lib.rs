//! An emulated Intel VT-d remapping unit (legacy translation mode) for Lucid: the device's
//! register window, the translation point every device DMA goes through (with a VMM IOTLB),
//! queued and register-based invalidation, fault recording with the fault-event MSI, interrupt
//! remapping, host pin policies, and two ways to emulate the registers.
//!
//! # What the guest sees
//!
//! A two-page register window at [`VTD_BASE`]. Page 0 has the spec's layout (VER 1.0, CAP,
//! ECAP, GCMD/GSTS, RTADDR, CCMD, FSTS, FECTL/FEDATA/FEADDR/FEUADDR, IQH/IQT/IQA, ICS,
//! IECTL/IEDATA/IEADDR/IEUADDR, IRTA). Page 1 holds the eight 128-bit fault-recording registers
//! at 0x1000 (CAP.FRO = 0x100) and the IVA/IOTLB registers at 0x1100 (ECAP.IRO = 0x110): guests
//! must find them through FRO/IRO, as the spec requires. CAP advertises 16-bit domain ids,
//! 3- and 4-level tables (SAGAW 39 and 48 bits), MGAW 48, 2 MiB pages, Caching Mode,
//! page-selective invalidation (MAMV 9) and 8 fault records; ECAP advertises coherent walks,
//! queued invalidation and interrupt remapping (xAPIC format, EIM=0). There is no pass-through,
//! device-TLB, scalable mode, protected memory region or advanced fault logging.
//!
//! # Translation
//!
//! [`Vtd`] implements `lucid_mem::DmaTranslator`: requester id (low 16 bits of the `DeviceId`)
//! to context entry (root table latched by GCMD.SRTP), to domain and second-level tables, to the
//! guest-physical page. While GSTS.TES is clear, DMA is untranslated. A leaf outside guest RAM
//! gives `DmaError::Unbacked` and no fault record (hardware would end the access in an
//! unsupported request); it is not cached, pinned or counted as a map. Faults use the spec's
//! legacy reason codes (0x1 root not present ... 0xc reserved bit in a paging entry; see
//! `tables`), are recorded in the fault-recording registers (FRI, PPF, PFO on overflow; not
//! recorded when the context entry has FPD set) and raise the fault-event MSI through
//! [`MsiSink`] unless FECTL.IM, in which case FECTL.IP is set and the MSI goes out when IM is
//! cleared. The hit path reads the caches (see `iotlb`) without a lock; a miss takes the unit's
//! state lock, walks the tables and fills the caches.
//!
//! # Invalidation, maps and unmaps
//!
//! Context-cache (global, domain, device with function mask) and IOTLB (global, domain, page
//! with address mask) invalidations come by register (CCMD, IOTLB) or through the queue, which
//! also carries interrupt-entry-cache and wait descriptors (status write, IWC and the
//! invalidation-completion MSI). The queue is processed from IQH to IQT in order, wrapping; a
//! descriptor that is not understood, has reserved bits set, or cannot be fetched or completed
//! (status address outside RAM) sets FSTS.IQE and stops there with IQH pointing at it;
//! processing resumes when the guest clears IQE.
//!
//! With Caching Mode the guest invalidates after every map too. The unit keeps a shadow of the
//! mappings it knows ((domain, IOVA page) -> guest page), re-walks the invalidated range and
//! counts `iommu.maps` (a page that now translates and did not) and `iommu.unmaps` (a page that
//! no longer translates); domain and global invalidations re-walk the known mappings of the
//! domain (new mappings are then learnt at the first miss).
//!
//! # Assigned devices
//!
//! A device that does its own DMA (vfio-user, VFIO) registers a [`MapListener`] for its
//! requester id and is told its mappings, as QEMU's VT-d syncs a shadow page table (see
//! `listen`). Per listener the unit keeps what it told: the extents of its `map` calls.
//! A page-selective IOTLB invalidation in the requester's domain re-walks the invalidated
//! range of its tables; domain and global IOTLB invalidations, context-cache invalidations that
//! cover it, SRTP and enabling translation re-walk all its tables (present entries only, at
//! most 2^20 pages and 2^22 entries per walk, then it stops, logged once). The walk is diffed
//! with the shadow: `unmap` for extents that changed (always whole, as they were mapped), then
//! `map` for the new runs (pages contiguous in IOVA and guest address with one permission: one
//! call; a 2 MiB leaf is one run). A page is mapped when the walk ends with R or W set and the
//! page is guest RAM, with those permissions ([`Perm`]: a write-only mapping is told as such, and
//! the device must refuse its reads there). While translation is off the listener holds one identity mapping per RAM region; enabling
//! translation unmaps them and walks, disabling it unmaps every mapping and maps them again.
//!
//! The calls are made synchronously by the thread carrying out the invalidation (the vCPU in
//! samecore mode, the poller in sidecore mode), after the state lock is dropped, so a listener
//! may translate through the unit. Unit operations that can cause calls hold the `notify`
//! lock (taken before the state lock) until their calls are made: calls arrive in the order of
//! the state changes, a queued wait descriptor completes only after the calls of the
//! descriptors before it (the queue stops at the wait, the calls are made, the queue goes on),
//! and sidecore status (GSTS, IQH, ...) is published only after them. Trapped register
//! accesses from other vCPUs wait meanwhile; translations do not (they take only the state
//! lock, and the sidecore's guest writes are taken in by the poller alone).
//!
//! # Pinning and stale mappings
//!
//! See `pin`. `iommu.pinned.current`/`.peak` count 4 KiB pages the policy holds pinned.
//! A *stale mapping* here is the VMM-side one: a guest page that an invalidation removed from
//! every mapping and IOTLB entry while a device access that translated before the invalidation
//! may still be copying to or from it. It stays counted in `iommu.stale.current` until every
//! such access has ended (`access_begin`/`access_end`); `iommu.stale.max` is the largest count
//! seen after any unit operation, and `iommu.window_max_us` the longest time from the moment the
//! invalidation request reached the unit (the trapped register write in samecore mode; the poll
//! that noticed it in sidecore mode) to the end of that grace period. Pages released at once,
//! with no access in flight, are never counted as stale. The VMM cannot see the guest's own
//! deferral (a PTE cleared but not yet invalidated); guests report that themselves.
//!
//! # Interrupt remapping
//!
//! [`Vtd`] implements `lucid_hv::MsiRemapper`: with GSTS.IRES set, a remappable-format MSI
//! (address bit 4) selects an IRTE (handle plus subhandle when SHV) in the table IRTA named at
//! the last GCMD.SIRTP; the IRTE is validated (present, reserved bits, delivery mode, SVT/SQ/SID
//! source check) and turned into the message KVM delivers. Faults 0x20-0x26 are recorded like
//! DMA faults with the interrupt index in FI bits 63:48. Compatibility-format MSIs pass while IRE is
//! off or GSTS.CFIS is set, and fault with 0x25 otherwise. IRTEs are read at every remap (no
//! entry cache), so an interrupt-entry-cache invalidation only has to tell the VMM to re-route:
//! the [`Vtd::on_ir_change`] callbacks run after IEC invalidations, SIRTP and IRE/CFI changes.
//!
//! # Counters (stats registry, under `iommu.`)
//!
//! `maps`, `unmaps` (see above); `inv.context`, `inv.iotlb_global`, `inv.iotlb_domain`,
//! `inv.iotlb_page`, `inv.iec`, `inv.wait` (invalidations carried out, by register or queue);
//! `iotlb.hits` (translations served lock-free from the caches), `iotlb.misses` (slow path:
//! walk, or fault); `faults.dma`, `faults.ir` (every fault, recorded or not: FPD, PFO);
//! `pinned.current`, `pinned.peak` (pages); `stale.current`, `stale.max`, `window_max_us`
//! (see above); `sidecore.polls`, `sidecore.busy_polls`, `sidecore.cpu_ns`;
//! `listener.maps`, `listener.unmaps` (listener calls made), `listener.walks` (table walks for
//! listeners).
//!
//! # Limits
//!
//! The requester id is the low 16 bits of the `DeviceId`. While translation is off, DMA is
//! untranslated and nothing is pinned per page (a VFIO-backed unit would map all RAM then).
//! Page-selective invalidations walk at most 2^MAMV = 512 pages. The shadow of known mappings
//! holds at most 2^20 entries. The register-based invalidations work while the queue is on
//! (the spec leaves that undefined). Bits the unit has no mode for are ignored: RTADDR.TTM
//! (legacy root table always), IQA.DW (128-bit descriptors always), IRTA.EIME (xAPIC always).
//! A wait descriptor completes once the descriptors before it are carried out; it does not
//! wait for device accesses that translated before them (they keep their pages pinned and are
//! counted as stale until they end).
//!
//! # Samecore and sidecore
//!
//! Samecore: both pages trap and every access runs [`Vtd::read`]/[`Vtd::write`] on the vCPU
//! thread, so the queue is processed inside the IQT write. Sidecore: see `sidecore`.

#![warn(clippy::print_stdout, clippy::print_stderr)]

mod iotlb;
mod ir;
mod listen;
mod pin;
mod regs;
mod sidecore;
mod tables;
#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use lucid_mem::{Access, DeviceId, DmaError, DmaTranslator, FaultReason, GuestMemoryMmap};
use lucid_stats::{Counter, StatsRegistry};
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryRegion};

use iotlb::{ContextCache, Entry, Iotlb, SLOTS};
use listen::{Listened, Op, Sel};
use pin::{lock, Brackets, PinBook, PinCtx};
pub use pin::{MlockPinner, Pinner};
use regs::*;
use tables::{Context, Leaf};

/// Where the register window sits (QEMU q35's address, so guests written for it work).
pub const VTD_BASE: u64 = 0xfed9_0000;
/// Two pages: page 0 = the spec's register layout; page 1 = fault-recording registers
/// (CAP.FRO points here) and the IOTLB registers (ECAP.IRO points here), so that in sidecore
/// mode page 0 can be shared memory and page 1 still traps.
pub const VTD_SIZE: u64 = 0x2000;

/// How the register window is emulated.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EmulationMode {
    /// Every register access traps to the VMM on the vCPU thread.
    Samecore,
    /// Page 0 is shared memory polled by a thread; page 1 traps.
    Sidecore,
}

/// When guest pages are pinned on the host.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PinPolicy {
    /// All guest RAM at start (what VMMs do with VFIO and no vIOMMU).
    All,
    /// A page while a mapping, IOTLB entry or in-flight access can reach it.
    Map,
    /// As `Map`, with the unpins batched (256 pages or 10 ms).
    Deferred,
}

#[derive(Clone, Copy, Debug, serde::Serialize, serde::Deserialize)]
pub struct VtdConfig {
    pub mode: EmulationMode,
    pub pin: PinPolicy,
}

/// Raw MSI out (the unit's own fault-event and invalidation-completion MSIs are not remapped).
pub trait MsiSink: Send + Sync {
    fn send(&self, address: u64, data: u32);
}

/// Most mappings the shadow keeps (bounds the memory a guest can make the VMM use); beyond it
/// mappings are not tracked for map/unmap counts and are pinned only while cached.
const SHADOW_MAX: usize = 1 << 20;

struct Counters {
    maps: Arc<Counter>,
    unmaps: Arc<Counter>,
    inv_context: Arc<Counter>,
    inv_iotlb_global: Arc<Counter>,
    inv_iotlb_domain: Arc<Counter>,
    inv_iotlb_page: Arc<Counter>,
    inv_iec: Arc<Counter>,
    inv_wait: Arc<Counter>,
    hits: Arc<Counter>,
    misses: Arc<Counter>,
    faults_dma: Arc<Counter>,
    faults_ir: Arc<Counter>,
    pinned_current: Arc<Counter>,
    pinned_peak: Arc<Counter>,
    stale_current: Arc<Counter>,
    stale_max: Arc<Counter>,
    window_max_us: Arc<Counter>,
    sc_polls: Arc<Counter>,
    sc_busy_polls: Arc<Counter>,
    sc_cpu_ns: Arc<Counter>,
    l_maps: Arc<Counter>,
    l_unmaps: Arc<Counter>,
    l_walks: Arc<Counter>,
}

impl Counters {
    fn new(s: &StatsRegistry) -> Self {
        let c = |n: &str| s.counter(format!("iommu.{n}"));
        Counters {
            maps: c("maps"),
            unmaps: c("unmaps"),
            inv_context: c("inv.context"),
            inv_iotlb_global: c("inv.iotlb_global"),
            inv_iotlb_domain: c("inv.iotlb_domain"),
            inv_iotlb_page: c("inv.iotlb_page"),
            inv_iec: c("inv.iec"),
            inv_wait: c("inv.wait"),
            hits: c("iotlb.hits"),
            misses: c("iotlb.misses"),
            faults_dma: c("faults.dma"),
            faults_ir: c("faults.ir"),
            pinned_current: c("pinned.current"),
            pinned_peak: c("pinned.peak"),
            stale_current: c("stale.current"),
            stale_max: c("stale.max"),
            window_max_us: c("window_max_us"),
            sc_polls: c("sidecore.polls"),
            sc_busy_polls: c("sidecore.busy_polls"),
            sc_cpu_ns: c("sidecore.cpu_ns"),
            l_maps: c("listener.maps"),
            l_unmaps: c("listener.unmaps"),
            l_walks: c("listener.walks"),
        }
    }
}

/// Side effects gathered under the state lock and carried out after it is released (an MSI
/// sink, an IR callback or a map listener may call back into the unit).
#[derive(Default)]
struct Fx {
    msis: Vec<(u64, u32)>,
    ir_changed: bool,
    /// Listener calls, in the order the state changed.
    calls: Vec<(Arc<dyn MapListener>, Op)>,
    /// The queue stopped at a wait descriptor until `calls` are made.
    qi_resume: bool,
}

/// Sidecore bookkeeping: for each polled register, the value last seen or published in the
/// shared page. A page value that differs is a guest write.
#[derive(Default)]
struct ScBase {
    gcmd: u32,
    ccmd: u64,
    iqt: u32,
    fsts: u32,
    fectl: u32,
    ics: u32,
    iectl: u32,
}

/// The register file and everything the slow paths share (behind `Vtd::st`).
struct State {
    gsts: u32,
    rtaddr: u64,
    /// Root table latched by SRTP.
    rta: u64,
    ccmd: u64,
    /// Write-1-to-clear bits and FRI; PPF is derived from the records.
    fsts: u32,
    fectl: u32,
    fedata: u32,
    feaddr: u32,
    feuaddr: u32,
    iqh: u64,
    iqt: u64,
    iqa: u64,
    iq_base: u64,
    iq_len: u64,
    ics: u32,
    iectl: u32,
    iedata: u32,
    ieaddr: u32,
    ieuaddr: u32,
    irta: u64,
    frcd: [[u64; 2]; NFR],
    next_fr: usize,
    iva: u64,
    iotlb_reg: u64,
    /// Source ids with a context-cache entry.
    ctx_sids: BTreeSet<u16>,
    /// Domain id -> its tables, learnt from context entries; `None`: looked for, not found.
    domains: HashMap<u16, Option<Context>>,
    /// One full root/context scan allowed per unit operation (bounds a hostile guest).
    scan_budget: bool,
    shadow: BTreeMap<(u16, u64), Leaf>,
    large_slots: usize,
    book: PinBook,
    /// When the request being processed reached the unit.
    arrival: Instant,
    sc: ScBase,
    /// Assigned devices that keep their own copy of their requester id's mappings.
    listeners: BTreeMap<u16, Listened>,
    walk_warned: bool,
    /// Listener calls are being made with the lock dropped: the sidecore page is not
    /// published meanwhile (status must not run ahead of the notifications).
    delivering: bool,
}

/// A device that does its own DMA outside Lucid (an assigned device: vfio-user, VFIO) and so
/// must hold a copy of its requester id's mappings, as a host IOMMU would be programmed: the
/// unit tells it every change an invalidation reveals, before the invalidation completes.
/// While translation is off every RAM region is mapped at its guest-physical address.
///
/// Every `unmap` covers exactly the range of one earlier `map`. Calls come from the thread
/// carrying out the guest's invalidation, one at a time, without the unit's state lock: a
/// listener may call `DmaTranslator::translate` (and so replay a fault), but must not call
/// [`Vtd::read`], [`Vtd::write`], [`Vtd::add_listener`] or [`Vtd::remove_listener`] (they
/// wait for the calls in progress), nor wait for a thread that does.
pub trait MapListener: Send + Sync {
    /// `iova..iova+len` now translates to `gpa..gpa+len`, for the accesses `perm` allows.
    fn map(&self, iova: u64, gpa: u64, len: u64, perm: Perm);
    /// `iova..iova+len` no longer translates.
    fn unmap(&self, iova: u64, len: u64);
}

/// What a mapping lets a device do: the R and W bits of its second-level entries, each
/// cleared by any table above it that clears it. At least one is set.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Perm {
    pub read: bool,
    pub write: bool,
}

impl Perm {
    pub const READ_WRITE: Perm = Perm {
        read: true,
        write: true,
    };
}

/// The emulated VT-d unit.
pub struct Vtd {
    cfg: VtdConfig,
    mem: GuestMemoryMmap,
    msi: Arc<dyn MsiSink>,
    pinner: Arc<dyn Pinner>,
    st: Mutex<State>,
    ctx: ContextCache,
    iotlb: Iotlb,
    br: Brackets,
    /// GSTS, readable without the lock (TES on the DMA path; IRES, CFIS for remapping).
    gsts: AtomicU32,
    /// Latched interrupt-remapping table: base | S (bits 3:0) | IRT_VALID.
    irt: AtomicU64,
    shared: AtomicPtr<u8>,
    /// Copies of `State::sc`'s GCMD, IQT, FSTS, FECTL, ICS, IECTL and CCMD (low, high) bases,
    /// for the sidecore's lock-free idle check.
    sc_watch: [AtomicU32; 8],
    ir_cbs: Mutex<Vec<Box<dyn Fn() + Send + Sync>>>,
    /// Held (taken before `st`) by every unit operation that may make listener calls, from
    /// before its state change until its calls are made: calls are made in state-change order,
    /// and an operation's effects are visible only after its calls.
    notify: Mutex<()>,
    /// An IR change whose callbacks have not run yet.
    ir_pending: AtomicBool,
    c: Counters,
}

const IRT_VALID: u64 = 1 << 4;

fn set_lo(r: &mut u64, v: u32) {
    *r = (*r & !0xffff_ffff) | u64::from(v);
}

fn set_hi(r: &mut u64, v: u32) {
    *r = (*r & 0xffff_ffff) | u64::from(v) << 32;
}

fn lo(r: u64) -> u32 {
    r as u32
}

fn hi(r: u64) -> u32 {
    (r >> 32) as u32
}

impl Vtd {
    pub fn new(
        cfg: VtdConfig,
        mem: GuestMemoryMmap,
        msi: Arc<dyn MsiSink>,
        pinner: Arc<dyn Pinner>,
        stats: &StatsRegistry,
    ) -> Arc<Vtd> {
        let c = Counters::new(stats);
        let mut all_pages = 0;
        for r in mem.iter() {
            all_pages += r.len() / 4096;
            if cfg.pin == PinPolicy::All {
                pinner.pin(r.start_addr().0, r.len());
            }
        }
        if cfg.pin == PinPolicy::All {
            c.pinned_current.set(all_pages);
            c.pinned_peak.set(all_pages);
        }
        Arc::new(Vtd {
            cfg,
            mem,
            msi,
            pinner,
            st: Mutex::new(State {
                gsts: 0,
                rtaddr: 0,
                rta: 0,
                ccmd: 0,
                fsts: 0,
                fectl: CTL_IM,
                fedata: 0,
                feaddr: 0,
                feuaddr: 0,
                iqh: 0,
                iqt: 0,
                iqa: 0,
                iq_base: 0,
                iq_len: 256,
                ics: 0,
                iectl: CTL_IM,
                iedata: 0,
                ieaddr: 0,
                ieuaddr: 0,
                irta: 0,
                frcd: [[0; 2]; NFR],
                next_fr: 0,
                iva: 0,
                iotlb_reg: 0,
                ctx_sids: BTreeSet::new(),
                domains: HashMap::new(),
                scan_budget: true,
                shadow: BTreeMap::new(),
                large_slots: 0,
                book: PinBook::default(),
                arrival: Instant::now(),
                sc: ScBase::default(),
                listeners: BTreeMap::new(),
                walk_warned: false,
                delivering: false,
            }),
            ctx: ContextCache::new(),
            iotlb: Iotlb::new(),
            br: Brackets::new(),
            gsts: AtomicU32::new(0),
            irt: AtomicU64::new(0),
            shared: AtomicPtr::new(std::ptr::null_mut()),
            sc_watch: Default::default(),
            ir_cbs: Mutex::new(Vec::new()),
            notify: Mutex::new(()),
            ir_pending: AtomicBool::new(false),
            c,
        })
    }

    /// Register window, `offset` in 0..VTD_SIZE, 4- or 8-byte accesses (others: reads give 0,
    /// writes are ignored, never a panic). Samecore: both pages trap here. Sidecore: page 1
    /// only (a page-0 access that arrives here anyway reads or writes the shared page).
    pub fn read(&self, offset: u64, data: &mut [u8]) {
        data.fill(0);
        let n = data.len() as u64;
        if !(n == 4 || n == 8) || !offset.is_multiple_of(n) || offset.saturating_add(n) > VTD_SIZE {
            return;
        }
        if let (Some(p), true) = (self.sc_page(), offset < 0x1000) {
            for (i, chunk) in data.chunks_mut(4).enumerate() {
                let v = sidecore::p32(p, offset + 4 * i as u64).load(Ordering::Acquire);
                chunk.copy_from_slice(&v.to_le_bytes());
            }
            return;
        }
        self.with_state(|st, _| {
            for (i, chunk) in data.chunks_mut(4).enumerate() {
                let v = self.read32(st, offset + 4 * i as u64);
                chunk.copy_from_slice(&v.to_le_bytes());
            }
        });
    }

    /// See [`Vtd::read`]. An 8-byte write is the low then the high dword.
    pub fn write(&self, offset: u64, data: &[u8]) {
        let n = data.len() as u64;
        if !(n == 4 || n == 8) || !offset.is_multiple_of(n) || offset.saturating_add(n) > VTD_SIZE {
            return;
        }
        let dword = |i: usize| {
            let mut b = [0u8; 4];
            b.copy_from_slice(&data[4 * i..4 * i + 4]);
            u32::from_le_bytes(b)
        };
        if let (Some(p), true) = (self.sc_page(), offset < 0x1000) {
            for i in 0..(n / 4) as usize {
                sidecore::p32(p, offset + 4 * i as u64).store(dword(i), Ordering::Release);
            }
            return;
        }
        self.with_state(|st, fx| {
            st.arrival = Instant::now();
            st.scan_budget = true;
            for i in 0..(n / 4) as usize {
                self.write32(st, fx, offset + 4 * i as u64, dword(i));
            }
        });
    }

    /// Called after an interrupt-entry-cache invalidation and when IR is enabled/disabled, so
    /// the VMM can `GsiRouter::refresh()`.
    pub fn on_ir_change(&self, f: Box<dyn Fn() + Send + Sync>) {
        lock(&self.ir_cbs).push(f);
    }

    /// Keeps `l` told of requester `rid`'s mappings from now on (see [`MapListener`]): before
    /// returning, it is given the identity maps (translation off) or what the tables map now.
    /// Replaces an earlier listener of `rid` (which is not told anything more).
    pub fn add_listener(&self, rid: u16, l: Arc<dyn MapListener>) {
        self.with_state(|st, fx| self.listener_add(st, fx, rid, l));
    }

    /// Stops telling requester `rid`'s listener (the device left); it is not told to unmap.
    pub fn remove_listener(&self, rid: u16) {
        self.with_state(|st, _| {
            st.listeners.remove(&rid);
        });
    }

    /// A unit operation (register access, sidecore poll, listener change): runs `f` under the
    /// state lock; in sidecore mode it first takes in the guest's pending register writes.
    /// Then pins are released as grace periods allow and the counters are updated. Listener
    /// calls are made with the lock dropped (and `notify` held); a queue stopped at a wait
    /// descriptor for them then goes on, until no calls remain. Then, in sidecore mode, the
    /// status registers are published. MSIs and IR callbacks run last, without the lock.
    fn with_state<R>(&self, f: impl FnOnce(&mut State, &mut Fx) -> R) -> R {
        self.with_state_cb(true, f)
    }

    /// As `with_state`; with `op` false (the DMA and remapping paths, on device threads or
    /// inside `remap`, whose caller may hold the GSI router's lock that an IR callback takes):
    /// the guest's sidecore writes are left to the next poll (so no listener calls arise), and
    /// IR-change callbacks to the next operation.
    fn with_state_cb<R>(&self, op: bool, f: impl FnOnce(&mut State, &mut Fx) -> R) -> R {
        let _notify = op.then(|| lock(&self.notify));
        let mut fx = Fx::default();
        let r = {
            let mut st = lock(&self.st);
            let page = self.sc_page();
            if let (Some(p), true) = (page, op) {
                self.sc_sync(&mut st, &mut fx, p);
            }
            let r = f(&mut st, &mut fx);
            self.maintain(&mut st);
            while !fx.calls.is_empty() {
                let calls = std::mem::take(&mut fx.calls);
                st.delivering = true;
                drop(st);
                self.listener_calls(calls);
                st = lock(&self.st);
                st.delivering = false;
                if std::mem::take(&mut fx.qi_resume) {
                    self.qi_run(&mut st, &mut fx);
                }
                self.maintain(&mut st);
            }
            if let (Some(p), false) = (page, st.delivering) {
                self.sc_publish(&mut st, p);
            }
            r
        };
        for (a, d) in fx.msis {
            self.msi.send(a, d);
        }
        if fx.ir_changed {
            self.ir_pending.store(true, Ordering::SeqCst);
        }
        if op && self.ir_pending.swap(false, Ordering::SeqCst) {
            for cb in lock(&self.ir_cbs).iter() {
                cb();
            }
        }
        r
    }

    fn pcx(&self) -> PinCtx<'_> {
        PinCtx {
            pinner: &*self.pinner,
            per_page: self.cfg.pin != PinPolicy::All,
            deferred: self.cfg.pin == PinPolicy::Deferred,
        }
    }

    /// Releases what grace periods allow and refreshes the pin and stale counters.
    fn maintain(&self, st: &mut State) {
        let now = Instant::now();
        let rel = st.book.release(&self.pcx(), &self.br, now);
        let us = rel.window.as_micros() as u64;
        if us > self.c.window_max_us.get() {
            self.c.window_max_us.set(us);
        }
        let stale = st.book.stale() as u64;
        self.c.stale_current.set(stale);
        if stale > self.c.stale_max.get() {
            self.c.stale_max.set(stale);
        }
        if self.cfg.pin != PinPolicy::All {
            self.c.pinned_current.set(st.book.pinned);
            if st.book.pinned > self.c.pinned_peak.get() {
                self.c.pinned_peak.set(st.book.pinned);
            }
        }
    }

    // ---- registers ----

    fn fsts_value(&self, st: &State) -> u32 {
        let ppf = st.frcd.iter().any(|r| r[1] & FRCD_F != 0);
        st.fsts | if ppf { FS_PPF } else { 0 }
    }

    /// A page-0 value register as the guest last wrote it (the shared page in sidecore mode).
    fn val32(&self, st: &State, off: u64) -> u32 {
        match self.sc_page() {
            Some(p) if off < 0x1000 => sidecore::p32(p, off).load(Ordering::Acquire),
            _ => self.read32(st, off),
        }
    }

    fn val64(&self, st: &State, off: u64) -> u64 {
        u64::from(self.val32(st, off)) | u64::from(self.val32(st, off + 4)) << 32
    }

    fn read32(&self, st: &State, off: u64) -> u32 {
        match off {
            VER => VER_VALUE,
            CAP => lo(CAP_VALUE),
            0x0c => hi(CAP_VALUE),
            ECAP => lo(ECAP_VALUE),
            0x14 => hi(ECAP_VALUE),
            GSTS => st.gsts,
            RTADDR => lo(st.rtaddr),
            0x24 => hi(st.rtaddr),
            CCMD => lo(st.ccmd),
            0x2c => hi(st.ccmd),
            FSTS => self.fsts_value(st),
            FECTL => st.fectl,
            FEDATA => st.fedata,
            FEADDR => st.feaddr,
            FEUADDR => st.feuaddr,
            IQH => lo(st.iqh),
            0x84 => hi(st.iqh),
            IQT => lo(st.iqt),
            0x8c => hi(st.iqt),
            IQA => lo(st.iqa),
            0x94 => hi(st.iqa),
            ICS => st.ics,
            IECTL => st.iectl,
            IEDATA => st.iedata,
            IEADDR => st.ieaddr,
            IEUADDR => st.ieuaddr,
            IRTA => lo(st.irta),
            0xbc => hi(st.irta),
            o if (FRCD..FRCD + 16 * NFR as u64).contains(&o) => {
                let r = st.frcd[((o - FRCD) / 16) as usize][((o % 16) / 8) as usize];
                if o % 8 == 0 {
                    lo(r)
                } else {
                    hi(r)
                }
            }
            IVA => lo(st.iva),
            0x1104 => hi(st.iva),
            IOTLB => lo(st.iotlb_reg),
            0x110c => hi(st.iotlb_reg),
            _ => 0,
        }
    }

    fn write32(&self, st: &mut State, fx: &mut Fx, off: u64, v: u32) {
        match off {
            GCMD => self.gcmd(st, fx, v),
            RTADDR => set_lo(&mut st.rtaddr, v & !0x3ff),
            0x24 => set_hi(&mut st.rtaddr, v),
            CCMD => set_lo(&mut st.ccmd, v),
            0x2c => {
                set_hi(&mut st.ccmd, v);
                if st.ccmd & CCMD_ICC != 0 {
                    self.ccmd_exec(st, fx);
                }
            }
            FSTS => {
                st.fsts &= !(v & FS_RW1C);
                self.fault_ip_check(st);
                if v & FS_IQE != 0 {
                    self.qi_run(st, fx);
                }
            }
            FECTL => {
                st.fectl = (st.fectl & CTL_IP) | (v & CTL_IM);
                if st.fectl == CTL_IP {
                    st.fectl = 0;
                    fx.msis.push(self.fe_msg(st));
                }
            }
            FEDATA => st.fedata = v,
            FEADDR => st.feaddr = v & !3,
            FEUADDR => st.feuaddr = v,
            IQT => {
                st.iqt = u64::from(v & 0x7fff0);
                self.qi_run(st, fx);
            }
            IQA => set_lo(&mut st.iqa, v & !0xff8),
            0x94 => set_hi(&mut st.iqa, v),
            ICS if v & ICS_IWC != 0 => {
                st.ics &= !ICS_IWC;
                st.iectl &= !CTL_IP;
            }
            IECTL => {
                st.iectl = (st.iectl & CTL_IP) | (v & CTL_IM);
                if st.iectl == CTL_IP {
                    st.iectl = 0;
                    fx.msis.push(self.ie_msg(st));
                }
            }
            IEDATA => st.iedata = v,
            IEADDR => st.ieaddr = v & !3,
            IEUADDR => st.ieuaddr = v,
            IRTA => set_lo(&mut st.irta, v & !0x7f0),
            0xbc => set_hi(&mut st.irta, v),
            // Only F (bit 127, write 1 to clear) is writable in a fault record.
            o if (FRCD..FRCD + 16 * NFR as u64).contains(&o)
                && o % 16 == 12
                && v & (1 << 31) != 0 =>
            {
                st.frcd[((o - FRCD) / 16) as usize][1] &= !FRCD_F;
                self.fault_ip_check(st);
            }
            IVA => set_lo(&mut st.iva, v & !0xf80),
            0x1104 => set_hi(&mut st.iva, v),
            IOTLB => set_lo(&mut st.iotlb_reg, v),
            0x110c => {
                set_hi(&mut st.iotlb_reg, v);
                if st.iotlb_reg & IOTLB_IVT != 0 {
                    self.iotlb_reg_exec(st, fx);
                }
            }
            _ => {}
        }
    }

    fn publish_gsts(&self, st: &State) {
        self.gsts.store(st.gsts, Ordering::Release);
    }

    fn gcmd(&self, st: &mut State, fx: &mut Fx, v: u32) {
        let old = st.gsts;
        if v & G_SRTP != 0 {
            // RTADDR is read after the GCMD write was seen (see sidecore ordering).
            st.rta = self.val64(st, RTADDR) & tables::ADDR_MASK;
            st.gsts |= G_SRTP;
            self.flush_caches(st);
            self.listeners_sync(st, fx, Sel::All);
        }
        if (v ^ old) & G_TE != 0 {
            st.gsts ^= G_TE;
            self.flush_caches(st);
            self.listeners_te(st, fx, st.gsts & G_TE != 0);
        }
        if (v ^ old) & G_QIE != 0 {
            if v & G_QIE != 0 {
                let iqa = self.val64(st, IQA);
                st.iq_base = iqa & tables::ADDR_MASK;
                st.iq_len = 1 << ((iqa & 7) + 8);
                st.iqh = 0;
                st.gsts |= G_QIE;
                self.publish_gsts(st);
                self.qi_run(st, fx);
            } else {
                st.gsts &= !G_QIE;
                st.iqh = 0;
            }
        }
        if v & G_SIRTP != 0 {
            let irta = self.val64(st, IRTA);
            self.irt.store(
                (irta & tables::ADDR_MASK) | (irta & 0xf) | IRT_VALID,
                Ordering::Release,
            );
            st.gsts |= G_SIRTP;
            fx.ir_changed = true;
        }
        for bit in [G_IRE, G_CFI] {
            if (v ^ old) & bit != 0 {
                st.gsts ^= bit;
                fx.ir_changed = true;
            }
        }
        self.publish_gsts(st);
    }

    fn fe_msg(&self, st: &State) -> (u64, u32) {
        let a = u64::from(self.val32(st, FEADDR) & !3) | u64::from(self.val32(st, FEUADDR)) << 32;
        (a, self.val32(st, FEDATA))
    }

    fn ie_msg(&self, st: &State) -> (u64, u32) {
        let a = u64::from(self.val32(st, IEADDR) & !3) | u64::from(self.val32(st, IEUADDR)) << 32;
        (a, self.val32(st, IEDATA))
    }

    /// Raises the fault event: the MSI, or FECTL.IP while masked.
    fn fault_event(&self, st: &mut State, fx: &mut Fx) {
        if st.fectl & CTL_IM != 0 {
            st.fectl |= CTL_IP;
        } else {
            fx.msis.push(self.fe_msg(st));
        }
    }

    /// IP clears once software has cleared every fault status.
    fn fault_ip_check(&self, st: &mut State) {
        if self.fsts_value(st) & FS_EVENT == 0 {
            st.fectl &= !CTL_IP;
        }
    }

    fn fsts_set(&self, st: &mut State, fx: &mut Fx, bit: u32) {
        let before = self.fsts_value(st);
        st.fsts |= bit;
        if before & FS_EVENT == 0 {
            self.fault_event(st, fx);
        }
    }

    /// Records a primary fault (VT-d spec 7.3.1): not while PFO is set; PFO when the next
    /// record is still pending; FRI names the first record of a pending run; the fault event
    /// fires only when no fault status was pending.
    fn record_fault(&self, st: &mut State, fx: &mut Fx, sid: u16, fi: u64, reason: u8, read: bool) {
        let before = self.fsts_value(st);
        if st.fsts & FS_PFO != 0 {
            return;
        }
        let i = st.next_fr % NFR;
        if st.frcd[i][1] & FRCD_F != 0 {
            st.fsts |= FS_PFO;
        } else {
            let t = if read { FRCD_T } else { 0 };
            st.frcd[i] = [fi, FRCD_F | t | u64::from(reason) << 32 | u64::from(sid)];
            if before & FS_PPF == 0 {
                st.fsts = (st.fsts & !0xff00) | (i as u32) << 8;
            }
            st.next_fr = (i + 1) % NFR;
        }
        if before & FS_EVENT == 0 {
            self.fault_event(st, fx);
        }
    }

    // ---- caches and invalidation ----

    /// Empties IOTLB slot `i`, dropping its page reference.
    fn drop_slot(&self, st: &mut State, i: usize, since: Instant) {
        if let Some(e) = self.iotlb.slot(i) {
            self.iotlb.store(i, None);
            if e.leaf.large {
                st.large_slots -= 1;
            }
            st.book.drop_ref(e.leaf.gpa, since);
        }
    }

    fn clear_slots(&self, st: &mut State, pred: impl Fn(&Entry) -> bool) {
        let since = st.arrival;
        for i in 0..SLOTS {
            if self.iotlb.slot(i).is_some_and(|e| pred(&e)) {
                self.drop_slot(st, i, since);
            }
        }
    }

    fn clear_ctx_cache(&self, st: &mut State, pred: impl Fn(u16, &Context) -> bool) {
        let sids: Vec<u16> = st.ctx_sids.iter().copied().collect();
        for sid in sids {
            match self.ctx.get(sid) {
                Some(c) if !pred(sid, &c) => {}
                _ => {
                    self.ctx.clear(sid);
                    st.ctx_sids.remove(&sid);
                }
            }
        }
    }

    /// Root pointer or TE changed: nothing cached is valid any more (the shadow stays; the
    /// guest's following invalidations re-walk it).
    fn flush_caches(&self, st: &mut State) {
        self.clear_ctx_cache(st, |_, _| true);
        st.domains.clear();
        self.clear_slots(st, |_| true);
    }

    fn ccmd_exec(&self, st: &mut State, fx: &mut Fx) {
        let g = ((st.ccmd >> 61) & 3) as u8;
        let did = st.ccmd as u16;
        let sid = (st.ccmd >> 16) as u16;
        let fm = ((st.ccmd >> 32) & 3) as u8;
        let done = self.ctx_inv(st, fx, g, did, sid, fm);
        st.ccmd &= !(CCMD_ICC | 3 << 59);
        if done {
            st.ccmd |= u64::from(g) << 59;
        }
    }

    /// Context-cache invalidation: 1 global, 2 domain, 3 device (function mask `fm`).
    fn ctx_inv(&self, st: &mut State, fx: &mut Fx, g: u8, did: u16, sid: u16, fm: u8) -> bool {
        match g {
            1 => {
                self.clear_ctx_cache(st, |_, _| true);
                st.domains.clear();
                self.listeners_sync(st, fx, Sel::All);
            }
            2 => {
                self.clear_ctx_cache(st, |_, c| c.did == did);
                st.domains.clear();
                self.listeners_sync(st, fx, Sel::Domain(did));
            }
            3 => {
                let mask: u16 = match fm {
                    0 => 0xffff,
                    1 => !4,
                    2 => !6,
                    _ => !7,
                };
                self.clear_ctx_cache(st, |s, _| s & mask == sid & mask);
                // Learn the (possibly new) domain of the device, for map counting.
                for f in 0..8u16 {
                    let s = (sid & mask) | (f & !mask & 7);
                    if let Ok(c) = tables::context(&self.mem, st.rta, s) {
                        st.domains.insert(c.did, Some(c));
                    }
                }
                self.listeners_sync(st, fx, Sel::Device { sid, mask });
            }
            _ => return false,
        }
        self.c.inv_context.inc();
        true
    }

    fn iotlb_reg_exec(&self, st: &mut State, fx: &mut Fx) {
        let mut g = ((st.iotlb_reg >> 60) & 3) as u8;
        let did = (st.iotlb_reg >> 32) as u16;
        let am = st.iva & 0x3f;
        if g == 3 && am > MAMV {
            g = 2;
        }
        let done = self.iotlb_inv(st, fx, g, did, st.iva & !0xfff, am);
        st.iotlb_reg &= !(IOTLB_IVT | 3 << 57);
        if done {
            st.iotlb_reg |= u64::from(g) << 57;
        }
    }

    /// IOTLB invalidation: 1 global, 2 domain, 3 page range (2^am pages at `addr`).
    fn iotlb_inv(&self, st: &mut State, fx: &mut Fx, g: u8, did: u16, addr: u64, am: u64) -> bool {
        match g {
            1 => {
                self.c.inv_iotlb_global.inc();
                self.clear_slots(st, |_| true);
                self.rewalk(st, None);
                self.listeners_sync(st, fx, Sel::All);
            }
            2 => {
                self.c.inv_iotlb_domain.inc();
                self.clear_slots(st, |e| e.did == did);
                self.rewalk(st, Some(did));
                self.listeners_sync(st, fx, Sel::Domain(did));
            }
            3 if am <= MAMV => {
                self.c.inv_iotlb_page.inc();
                let n = 1u64 << am;
                let first = (addr >> 12) & !(n - 1) & ((1 << 36) - 1);
                let since = st.arrival;
                if st.large_slots == 0 && n <= 16 {
                    for page in first..first + n {
                        let i = iotlb::index(did, page);
                        if self
                            .iotlb
                            .slot(i)
                            .is_some_and(|e| e.did == did && e.page == page)
                        {
                            self.drop_slot(st, i, since);
                        }
                    }
                } else {
                    self.clear_slots(st, |e| {
                        let (s, len) = if e.leaf.large {
                            (e.page & !511, 512)
                        } else {
                            (e.page, 1)
                        };
                        e.did == did && s < first + n && first < s + len
                    });
                }
                let ctx = self.domain_ctx(st, did);
                for page in first..first + n {
                    let new = ctx.and_then(|c| self.walk_page(&c, page));
                    self.shadow_update(st, did, page, new);
                }
                self.listeners_sync(st, fx, Sel::Pages { did, first, n });
            }
            _ => return false,
        }
        true
    }

    fn walk_page(&self, c: &Context, page: u64) -> Option<Leaf> {
        tables::walk(&self.mem, c.slpt, c.levels, page << 12)
            .ok()
            .flatten()
            .filter(|l| (l.read || l.write) && self.in_ram(l.gpa))
    }

    /// Whether the 4 KiB guest page at `gpa` is guest RAM (what a mapping may translate to).
    fn in_ram(&self, gpa: u64) -> bool {
        self.mem.address_in_range(GuestAddress(gpa))
            && self.mem.address_in_range(GuestAddress(gpa | 0xfff))
    }

    /// The tables of domain `did`, scanning the root and context tables once per operation if
    /// no context entry seen so far named it.
    fn domain_ctx(&self, st: &mut State, did: u16) -> Option<Context> {
        if let Some(c) = st.domains.get(&did) {
            return *c;
        }
        if !st.scan_budget {
            return None;
        }
        st.scan_budget = false;
        for bus in 0..256u64 {
            let root = st.rta + bus * 16;
            if tables::read_u64(&self.mem, root).is_none_or(|r| r & 1 == 0) {
                continue;
            }
            for devfn in 0..256u16 {
                if let Ok(c) = tables::context(&self.mem, st.rta, (bus as u16) << 8 | devfn) {
                    st.domains.entry(c.did).or_insert(Some(c));
                }
            }
        }
        *st.domains.entry(did).or_insert(None)
    }

    /// Re-walks the known mappings (of one domain, or all) after a domain or global
    /// invalidation and drops those that no longer translate.
    fn rewalk(&self, st: &mut State, did: Option<u16>) {
        let keys: Vec<(u16, u64)> = match did {
            Some(d) => st
                .shadow
                .range((d, 0)..=(d, u64::MAX))
                .map(|(k, _)| *k)
                .collect(),
            None => st.shadow.keys().copied().collect(),
        };
        let mut ctxs: HashMap<u16, Option<Context>> = HashMap::new();
        for (d, page) in keys {
            let c = match ctxs.get(&d) {
                Some(c) => *c,
                None => {
                    let c = self.domain_ctx(st, d);
                    ctxs.insert(d, c);
                    c
                }
            };
            let new = c.and_then(|c| self.walk_page(&c, page));
            if new.is_none() || st.shadow.get(&(d, page)) != new.as_ref() {
                self.shadow_update(st, d, page, new);
            }
        }
    }

    /// Compares what (`did`, `page`) translates to now with the shadow: counts a map or an
    /// unmap and moves the page references.
    fn shadow_update(&self, st: &mut State, did: u16, page: u64, new: Option<Leaf>) {
        let old = st.shadow.get(&(did, page)).copied();
        if old == new {
            return;
        }
        if let Some(o) = old {
            self.c.unmaps.inc();
            st.shadow.remove(&(did, page));
            let since = st.arrival;
            if let Some(n) = new {
                self.shadow_insert(st, did, page, n);
            }
            st.book.drop_ref(o.gpa, since);
        } else if let Some(n) = new {
            self.shadow_insert(st, did, page, n);
        }
        if new.is_some() {
            self.c.maps.inc();
        }
    }

    fn shadow_insert(&self, st: &mut State, did: u16, page: u64, l: Leaf) {
        if st.shadow.len() < SHADOW_MAX && st.shadow.insert((did, page), l).is_none() {
            st.book.add_ref(&self.pcx(), l.gpa);
        }
    }

    // ---- queued invalidation ----

    /// Processes descriptors from IQH to IQT in order (one lap at most), stopping at IQE.
    fn qi_run(&self, st: &mut State, fx: &mut Fx) {
        if st.gsts & G_QIE == 0 || st.fsts & FS_IQE != 0 {
            return;
        }
        let tail = st.iqt >> 4;
        if tail >= st.iq_len {
            self.fsts_set(st, fx, FS_IQE);
            return;
        }
        let mut budget = st.iq_len;
        while st.iqh >> 4 != tail && budget > 0 {
            budget -= 1;
            let idx = st.iqh >> 4;
            let a = st.iq_base + idx * 16;
            let ok = match (
                tables::read_u64(&self.mem, a),
                tables::read_u64(&self.mem, a + 8),
            ) {
                // A wait completes only after the listener calls the descriptors before it
                // caused: stop here until they are made (`with_state_cb` resumes).
                (Some(lo), Some(_)) if lo & 0xf == 5 && !fx.calls.is_empty() => {
                    fx.qi_resume = true;
                    return;
                }
                (Some(lo), Some(hi)) => self.descriptor(st, fx, lo, hi),
                _ => false,
            };
            if !ok {
                self.fsts_set(st, fx, FS_IQE);
                return;
            }
            st.iqh = ((idx + 1) % st.iq_len) << 4;
        }
    }

    /// Carries out one 128-bit descriptor; false if it is invalid (IQE).
    fn descriptor(&self, st: &mut State, fx: &mut Fx, lo: u64, hi: u64) -> bool {
        let g = ((lo >> 4) & 3) as u8;
        match lo & 0xfff {
            // Context-cache invalidate.
            t if t & 0xfcf == 0x1 => {
                if lo >> 50 != 0 || lo & 0xf000 != 0 || hi != 0 {
                    return false;
                }
                self.ctx_inv(
                    st,
                    fx,
                    g,
                    (lo >> 16) as u16,
                    (lo >> 32) as u16,
                    ((lo >> 48) & 3) as u8,
                )
            }
            // IOTLB invalidate (DR, DW accepted and ignored: nothing is buffered).
            t if t & 0xf0f == 0x2 => {
                if lo >> 32 != 0 || lo & 0xf000 != 0 || hi & 0xf80 != 0 {
                    return false;
                }
                self.iotlb_inv(st, fx, g, (lo >> 16) as u16, hi & !0xfff, hi & 0x3f)
            }
            // Interrupt-entry-cache invalidate: no entry cache, the VMM re-routes.
            t if t & 0xfef == 0x4 => {
                if lo & 0x07ff_f000 != 0 || lo >> 48 != 0 || hi != 0 {
                    return false;
                }
                self.c.inv_iec.inc();
                fx.ir_changed = true;
                true
            }
            // Wait: status write (SW), interrupt (IF), fence (FN: processing is in order).
            t if t & 0xf8f == 0x5 => {
                if lo & 0xffff_ff00 != 0 || hi & 3 != 0 {
                    return false;
                }
                if lo & (1 << 5) != 0
                    && self
                        .mem
                        .write_obj((lo >> 32) as u32, GuestAddress(hi))
                        .is_err()
                {
                    return false;
                }
                if lo & (1 << 4) != 0 && st.ics & ICS_IWC == 0 {
                    st.ics |= ICS_IWC;
                    if st.iectl & CTL_IM != 0 {
                        st.iectl |= CTL_IP;
                    } else {
                        fx.msis.push(self.ie_msg(st));
                    }
                }
                self.c.inv_wait.inc();
                true
            }
            _ => false,
        }
    }

    // ---- translation ----

    fn dma_fault(
        &self,
        st: &mut State,
        fx: &mut Fx,
        (dev, iova, access): (DeviceId, u64, Access),
        reason: u8,
        fpd: bool,
    ) -> DmaError {
        self.c.faults_dma.inc();
        log::debug!("vtd: DMA fault {reason:#x}: device {dev:#x} {access:?} at IOVA {iova:#x}");
        if !fpd {
            self.record_fault(
                st,
                fx,
                dev as u16,
                iova & !0xfff,
                reason,
                access == Access::Read,
            );
        }
        DmaError::Fault {
            dev,
            iova,
            access,
            reason: if reason == tables::FR_READ || reason == tables::FR_WRITE {
                FaultReason::Denied
            } else {
                FaultReason::NotMapped
            },
        }
    }

    fn translate_slow(
        &self,
        st: &mut State,
        fx: &mut Fx,
        dev: DeviceId,
        iova: u64,
        len: u64,
        access: Access,
    ) -> Result<(u64, u64), DmaError> {
        if st.gsts & G_TE == 0 {
            return Ok((iova, len));
        }
        let sid = dev as u16;
        let ctx = match self.ctx.get(sid) {
            Some(c) => c,
            None => match tables::context(&self.mem, st.rta, sid) {
                Ok(c) => {
                    self.ctx.set(sid, c);
                    st.ctx_sids.insert(sid);
                    st.domains.insert(c.did, Some(c));
                    c
                }
                Err(f) => return Err(self.dma_fault(st, fx, (dev, iova, access), f.reason, f.fpd)),
            },
        };
        let page = iova >> 12;
        let leaf = match self.iotlb.lookup(ctx.did, page) {
            Some(l) => l,
            None => match tables::walk(&self.mem, ctx.slpt, ctx.levels, iova) {
                Err(r) => return Err(self.dma_fault(st, fx, (dev, iova, access), r, ctx.fpd)),
                Ok(None) => {
                    let r = perm_reason(access);
                    return Err(self.dma_fault(st, fx, (dev, iova, access), r, ctx.fpd));
                }
                // A leaf outside guest RAM (an MMIO hole, past the end) is not translated: the
                // access would end in an unsupported request, which the unit does not record.
                // Never cached, so nothing outside RAM is pinned or handed out.
                Ok(Some(l)) if !self.in_ram(l.gpa) => {
                    return Err(DmaError::Unbacked {
                        dev,
                        addr: iova,
                        len,
                        gpa: l.gpa | (iova & 0xfff),
                        access,
                    });
                }
                Ok(Some(l)) => {
                    self.fill(st, ctx.did, page, l);
                    l
                }
            },
        };
        if !permits(&leaf, access) {
            let r = perm_reason(access);
            return Err(self.dma_fault(st, fx, (dev, iova, access), r, ctx.fpd));
        }
        Ok(span(&leaf, iova, len))
    }

    /// Caches a walk's result, pinning its page; evicts what the slot held.
    fn fill(&self, st: &mut State, did: u16, page: u64, leaf: Leaf) {
        let i = iotlb::index(did, page);
        let old = self.iotlb.slot(i);
        st.book.add_ref(&self.pcx(), leaf.gpa);
        if !st.shadow.contains_key(&(did, page)) {
            self.shadow_insert(st, did, page, leaf);
        }
        if old.is_some() {
            self.drop_slot(st, i, Instant::now());
        }
        self.iotlb.store(i, Some(&Entry { did, page, leaf }));
        if leaf.large {
            st.large_slots += 1;
        }
    }
}

fn permits(l: &Leaf, access: Access) -> bool {
    match access {
        Access::Read => l.read,
        Access::Write => l.write,
    }
}

fn perm_reason(access: Access) -> u8 {
    match access {
        Access::Read => tables::FR_READ,
        Access::Write => tables::FR_WRITE,
    }
}

/// Guest-physical address of `iova` and the contiguous bytes to the end of its 4 KiB page.
fn span(l: &Leaf, iova: u64, len: u64) -> (u64, u64) {
    let off = iova & 0xfff;
    (l.gpa + off, len.min(0x1000 - off))
}

impl DmaTranslator for Vtd {
    fn translate(
        &self,
        dev: DeviceId,
        iova: u64,
        len: u64,
        access: Access,
    ) -> Result<(u64, u64), DmaError> {
        let len = len.max(1);
        if self.gsts.load(Ordering::Acquire) & G_TE == 0 {
            return Ok((iova, len));
        }
        if let Some(c) = self.ctx.get(dev as u16) {
            if let Some(l) = self.iotlb.lookup(c.did, iova >> 12) {
                if permits(&l, access) {
                    self.c.hits.inc();
                    return Ok(span(&l, iova, len));
                }
            }
        }
        self.c.misses.inc();
        // No IR callbacks from a device thread (it may hold locks the VMM's re-routing takes);
        // the next register operation or sidecore poll runs them.
        self.with_state_cb(false, |st, fx| {
            self.translate_slow(st, fx, dev, iova, len, access)
        })
    }

    fn access_begin(&self) -> u64 {
        self.br.begin()
    }

    fn access_end(&self, token: u64) {
        if self.br.end(token) {
            self.with_state_cb(false, |_, _| {});
        }
    }
}
