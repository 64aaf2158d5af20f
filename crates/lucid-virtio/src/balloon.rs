//! virtio-balloon (virtio 1.2, 5.5): the host asks the guest for memory back.
//!
//! The host sets a target, `num_pages` in config space (4 KiB pages, whatever the guest's page
//! size), through a [`BalloonControl`], which raises the configuration-change interrupt. The
//! driver inflates towards it by putting arrays of le32 page frame numbers on the inflate queue
//! (those pages are then given back to the host through a [`PageDiscard`]: their content is
//! dropped and they read as zeros when the guest uses them again), deflates by putting PFNs on
//! the deflate queue (nothing to do: a deflated page faults back in as a zero page), and writes
//! how many pages it holds to `actual`.
//!
//! Queues, numbered consecutively among those whose feature was negotiated, as Linux and QEMU
//! do: inflate (0), deflate (1), stats (`VIRTIO_BALLOON_F_STATS_VQ`), reporting
//! (`VIRTIO_BALLOON_F_PAGE_REPORTING`: free page reporting, device-writable descriptors whose
//! address and length are the free guest-physical ranges, each discarded). `FREE_PAGE_HINT` is
//! not offered, so no queue sits between them. Statistics: the driver's buffer of 10-byte
//! `(le16 tag, le64 value)` entries is read and kept; the device holds on to it until
//! [`BalloonControl::request_stats`] asks for fresh figures (it then gives the buffer back and
//! the driver refills it). `VIRTIO_BALLOON_F_DEFLATE_ON_OOM` is offered when configured: the
//! driver may then deflate below the target when the guest runs out of memory; the device has
//! nothing to do for it. `VIRTIO_BALLOON_F_MUST_TELL_HOST` is not offered: a guest may reuse a
//! deflated page before telling.
//!
//! Guest garbage is counted and ignored, never fatal: PFNs outside guest RAM or in its MMIO
//! holes (`balloon.bad_pfns`), descriptors of the wrong direction or a length that is not a
//! whole number of entries, or that cannot be read (`balloon.bad_descriptors`), reported ranges
//! that are not page aligned or not RAM (`balloon.bad_reports`), stats buffers that are not
//! whole entries (`balloon.bad_stats`). Only a broken ring stops the device (the worker's
//! `DEVICE_NEEDS_RESET`).
//!
//! Counters, under `balloon.`: `inflated_pages`, `deflated_pages`, `reported_pages` (pages
//! discarded by free page reporting), `bad_pfns`, `bad_descriptors`, `bad_reports`,
//! `bad_stats`, `discard_errors`, `reports_skipped_iommu`, `target_pages`, `actual_pages`
//! (gauges), `config_changes`, `stats_updates`, and the driver's latest statistics as gauges
//! `balloon.stats.<name>` (`swap_in`, `swap_out`, `major_faults`, `minor_faults`,
//! `free_memory`, `total_memory`, `available_memory`, `disk_caches`, `hugetlb_allocations`,
//! `hugetlb_failures`, `oom_kills`, `alloc_stalls`, ...), plus the worker's own (`kicks`, ...).

use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use lucid_mem::PageDiscard;
use lucid_stats::{Counter, StatsRegistry};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::blk::read_config_bytes;
use crate::worker::{Backend, Desc, Io, Pop, Served, WorkerSlot};
use crate::{device_type, features, ActivateContext, ActivateError, VirtioDevice, VirtioInterrupt};

/// Feature bits (virtio spec 5.5.3).
pub mod feature {
    pub const VIRTIO_BALLOON_F_MUST_TELL_HOST: u64 = 1 << 0;
    pub const VIRTIO_BALLOON_F_STATS_VQ: u64 = 1 << 1;
    pub const VIRTIO_BALLOON_F_DEFLATE_ON_OOM: u64 = 1 << 2;
    pub const VIRTIO_BALLOON_F_FREE_PAGE_HINT: u64 = 1 << 3;
    pub const VIRTIO_BALLOON_F_PAGE_POISON: u64 = 1 << 4;
    pub const VIRTIO_BALLOON_F_PAGE_REPORTING: u64 = 1 << 5;
}

use feature::*;

/// The balloon's page size: PFNs and `num_pages` count 4 KiB pages.
pub const PAGE_SHIFT: u32 = 12;
pub const PAGE_SIZE: u64 = 1 << PAGE_SHIFT;
/// Size of every queue.
pub const QUEUE_SIZE: u16 = 256;
/// `num_pages`, `actual`, `free_page_hint_cmd_id`, `poison_val`.
pub const CONFIG_SIZE: usize = 16;
/// Bytes of one statistics entry: le16 tag, le64 value, packed.
pub const STAT_ENTRY: usize = 10;
/// Most statistics bytes read from one buffer (the spec has 16 tags; room for more).
const STATS_MAX: usize = 64 * STAT_ENTRY;
/// PFN bytes read from guest memory at a time.
const PFN_CHUNK: usize = 4096;

/// Statistics tags (virtio 1.3, 5.5.6.3) and their counter names.
pub const STAT_NAMES: [&str; 16] = [
    "swap_in",
    "swap_out",
    "major_faults",
    "minor_faults",
    "free_memory",
    "total_memory",
    "available_memory",
    "disk_caches",
    "hugetlb_allocations",
    "hugetlb_failures",
    "oom_kills",
    "alloc_stalls",
    "async_scans",
    "direct_scans",
    "async_reclaims",
    "direct_reclaims",
];

/// What `--balloon` asks for.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct BalloonConfig {
    /// The initial target: how much memory the guest should give back, in MiB.
    pub size_mib: u64,
    /// Offer `VIRTIO_BALLOON_F_DEFLATE_ON_OOM`.
    pub deflate_on_oom: bool,
    /// Offer `VIRTIO_BALLOON_F_PAGE_REPORTING` (free page reporting).
    pub free_page_reporting: bool,
    /// Offer `VIRTIO_BALLOON_F_STATS_VQ`.
    pub stats: bool,
    /// Let the VMM's balloon manager set the target from host memory pressure.
    pub manager: bool,
}

impl BalloonConfig {
    /// Feature bits a balloon with this configuration offers.
    pub fn features(&self) -> u64 {
        let mut f = features::VIRTIO_F_VERSION_1;
        if self.stats {
            f |= VIRTIO_BALLOON_F_STATS_VQ;
        }
        if self.deflate_on_oom {
            f |= VIRTIO_BALLOON_F_DEFLATE_ON_OOM;
        }
        if self.free_page_reporting {
            f |= VIRTIO_BALLOON_F_PAGE_REPORTING;
        }
        f
    }
}

/// The driver's latest statistics.
#[derive(Clone, Debug)]
pub struct BalloonStats {
    /// (tag, value) as the driver sent them, in its order.
    pub entries: Vec<(u16, u64)>,
    /// When the device read them.
    pub at: Instant,
}

impl BalloonStats {
    /// The value of statistics tag `tag` (see [`STAT_NAMES`]), if the driver sent it.
    pub fn get(&self, tag: u16) -> Option<u64> {
        self.entries
            .iter()
            .rev()
            .find(|(t, _)| *t == tag)
            .map(|e| e.1)
    }
    /// `VIRTIO_BALLOON_S_MEMFREE`: bytes the guest does not use at all.
    pub fn free_memory(&self) -> Option<u64> {
        self.get(4)
    }
    /// `VIRTIO_BALLOON_S_MEMTOT`: bytes of RAM the guest has (the balloon included).
    pub fn total_memory(&self) -> Option<u64> {
        self.get(5)
    }
    /// `VIRTIO_BALLOON_S_AVAIL`: bytes the guest could use without swapping.
    pub fn available_memory(&self) -> Option<u64> {
        self.get(6)
    }
}

/// The balloon's counters, shared by the device, its worker and its control.
#[derive(Clone)]
struct Counters {
    inflated: Arc<Counter>,
    deflated: Arc<Counter>,
    reported: Arc<Counter>,
    bad_pfns: Arc<Counter>,
    bad_descriptors: Arc<Counter>,
    bad_reports: Arc<Counter>,
    bad_stats: Arc<Counter>,
    discard_errors: Arc<Counter>,
    reports_skipped_iommu: Arc<Counter>,
    target: Arc<Counter>,
    actual: Arc<Counter>,
    config_changes: Arc<Counter>,
    stats_updates: Arc<Counter>,
    stat_values: Vec<Arc<Counter>>,
}

impl Counters {
    fn new(stats: &StatsRegistry, name: &str) -> Self {
        let c = |n: &str| stats.counter(format!("{name}.{n}"));
        Counters {
            inflated: c("inflated_pages"),
            deflated: c("deflated_pages"),
            reported: c("reported_pages"),
            bad_pfns: c("bad_pfns"),
            bad_descriptors: c("bad_descriptors"),
            bad_reports: c("bad_reports"),
            bad_stats: c("bad_stats"),
            discard_errors: c("discard_errors"),
            reports_skipped_iommu: c("reports_skipped_iommu"),
            target: c("target_pages"),
            actual: c("actual_pages"),
            config_changes: c("config_changes"),
            stats_updates: c("stats_updates"),
            stat_values: STAT_NAMES
                .iter()
                .map(|s| c(&format!("stats.{s}")))
                .collect(),
        }
    }
}

/// What the device, its worker and every [`BalloonControl`] share.
struct Shared {
    /// `num_pages`: the target.
    target: AtomicU32,
    /// `actual`: what the driver says it holds.
    actual: AtomicU32,
    /// Guest RAM in 4 KiB pages: the largest sensible target.
    ram_pages: u64,
    /// The transport's interrupt while the device is active.
    irq: Mutex<Option<Arc<dyn VirtioInterrupt>>>,
    stats: Mutex<Option<BalloonStats>>,
    /// Written by `request_stats`; the worker watches it.
    stats_request: EventFd,
    c: Counters,
}

/// A cloneable handle on a balloon: sets its target and reads what the guest did.
#[derive(Clone)]
pub struct BalloonControl {
    shared: Arc<Shared>,
}

impl BalloonControl {
    /// Sets the target to `pages` 4 KiB pages (at most guest RAM) and, if it changed and the
    /// driver is running, raises the configuration-change interrupt.
    pub fn set_target_pages(&self, pages: u64) {
        let s = &self.shared;
        let pages = pages.min(s.ram_pages).min(u64::from(u32::MAX)) as u32;
        let old = s.target.swap(pages, Ordering::AcqRel);
        s.c.target.set(u64::from(pages));
        if old == pages {
            return;
        }
        s.c.config_changes.inc();
        let irq = s.irq.lock().unwrap_or_else(|e| e.into_inner()).clone();
        if let Some(irq) = irq {
            irq.signal_config();
        }
    }

    /// The target, in 4 KiB pages.
    pub fn target_pages(&self) -> u64 {
        u64::from(self.shared.target.load(Ordering::Acquire))
    }

    /// The pages the driver says the balloon holds (`actual`).
    pub fn actual_pages(&self) -> u64 {
        u64::from(self.shared.actual.load(Ordering::Acquire))
    }

    /// Guest RAM in 4 KiB pages.
    pub fn ram_pages(&self) -> u64 {
        self.shared.ram_pages
    }

    /// The driver's latest statistics, if it sent any.
    pub fn stats(&self) -> Option<BalloonStats> {
        self.shared
            .stats
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Asks the driver for fresh statistics: the device gives back the buffer it holds.
    pub fn request_stats(&self) {
        let _ = self.shared.stats_request.write(1);
    }
}

/// Why a balloon could not be created.
#[derive(Debug, thiserror::Error)]
pub enum BalloonError {
    #[error("balloon: cannot create its eventfd: {0}")]
    EventFd(#[source] std::io::Error),
    #[error("balloon: size {size_mib} MiB is more than the guest's {ram_mib} MiB of RAM")]
    TooBig { size_mib: u64, ram_mib: u64 },
}

/// A virtio-balloon device.
pub struct Balloon {
    name: String,
    cfg: BalloonConfig,
    shared: Arc<Shared>,
    discard: Arc<dyn PageDiscard>,
    /// Guest RAM as (guest-physical start, length), sorted.
    ram: Arc<Vec<(u64, u64)>>,
    queue_sizes: Vec<u16>,
    worker: WorkerSlot,
}

impl Balloon {
    /// A balloon named `name` (its counters' prefix) over guest RAM `ram` (guest-physical
    /// start, length), giving pages back through `discard`, with `cfg.size_mib` as the first
    /// target.
    pub fn new(
        name: String,
        cfg: BalloonConfig,
        ram: &[(u64, u64)],
        discard: Arc<dyn PageDiscard>,
        stats: &StatsRegistry,
    ) -> Result<Balloon, BalloonError> {
        let mut ranges: Vec<(u64, u64)> = ram.iter().copied().filter(|r| r.1 > 0).collect();
        ranges.sort_unstable();
        let ram_bytes: u64 = ranges.iter().map(|r| r.1).sum();
        if cfg.size_mib.saturating_mul(1 << 20) > ram_bytes {
            return Err(BalloonError::TooBig {
                size_mib: cfg.size_mib,
                ram_mib: ram_bytes >> 20,
            });
        }
        let c = Counters::new(stats, &name);
        let target = (cfg.size_mib << (20 - PAGE_SHIFT)) as u32;
        c.target.set(u64::from(target));
        let shared = Arc::new(Shared {
            target: AtomicU32::new(target),
            actual: AtomicU32::new(0),
            ram_pages: ram_bytes >> PAGE_SHIFT,
            irq: Mutex::new(None),
            stats: Mutex::new(None),
            stats_request: EventFd::new(EFD_NONBLOCK).map_err(BalloonError::EventFd)?,
            c,
        });
        let queues = 2 + usize::from(cfg.stats) + usize::from(cfg.free_page_reporting);
        Ok(Balloon {
            name,
            cfg,
            shared,
            discard,
            ram: Arc::new(ranges),
            queue_sizes: vec![QUEUE_SIZE; queues],
            worker: WorkerSlot::default(),
        })
    }

    /// A handle that sets the target and reads what the guest did.
    pub fn control(&self) -> BalloonControl {
        BalloonControl {
            shared: self.shared.clone(),
        }
    }

    pub fn config(&self) -> &BalloonConfig {
        &self.cfg
    }

    fn config_bytes(&self) -> [u8; CONFIG_SIZE] {
        let mut c = [0u8; CONFIG_SIZE];
        let t = self.shared.target.load(Ordering::Acquire);
        let a = self.shared.actual.load(Ordering::Acquire);
        c[0..4].copy_from_slice(&t.to_le_bytes());
        c[4..8].copy_from_slice(&a.to_le_bytes());
        c
    }
}

/// What a queue of the worker is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum QueueRole {
    Inflate,
    Deflate,
    Stats,
    Reporting,
}

/// The role of each transport queue index under the negotiated `features`: consecutive among
/// the queues that exist (virtio 1.2 numbers them 0..4 with gaps; every driver and device in
/// use numbers them without gaps, and `FREE_PAGE_HINT` is never offered here).
fn queue_roles(features: u64) -> Vec<QueueRole> {
    let mut r = vec![QueueRole::Inflate, QueueRole::Deflate];
    if features & VIRTIO_BALLOON_F_STATS_VQ != 0 {
        r.push(QueueRole::Stats);
    }
    if features & VIRTIO_BALLOON_F_PAGE_REPORTING != 0 {
        r.push(QueueRole::Reporting);
    }
    r
}

impl VirtioDevice for Balloon {
    fn name(&self) -> &str {
        &self.name
    }

    fn device_type(&self) -> u32 {
        device_type::BALLOON
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &self.queue_sizes
    }

    fn features(&self) -> u64 {
        // Not VIRTIO_F_ACCESS_PLATFORM: PFNs and reported ranges are guest-physical, and Linux's
        // driver refuses the feature (virtballoon_validate clears it).
        self.cfg.features()
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        read_config_bytes(&self.config_bytes(), offset, data);
    }

    fn write_config(&mut self, offset: u64, data: &[u8]) {
        // Only `actual` (bytes 4..8) is the driver's to write; any width, byte by byte.
        let mut bytes = self.shared.actual.load(Ordering::Acquire).to_le_bytes();
        let mut touched = false;
        for (i, b) in data.iter().enumerate() {
            let Some(o) = offset.checked_add(i as u64) else {
                break;
            };
            if (4..8).contains(&o) {
                bytes[(o - 4) as usize] = *b;
                touched = true;
            }
        }
        if touched {
            let a = u32::from_le_bytes(bytes);
            self.shared.actual.store(a, Ordering::Release);
            self.shared.c.actual.set(u64::from(a));
        }
    }

    fn activate(&mut self, mut ctx: ActivateContext) -> Result<(), ActivateError> {
        let roles_by_index = queue_roles(ctx.features);
        ctx.queues
            .retain(|(i, _, _)| usize::from(*i) < roles_by_index.len());
        for q in 0..2u16 {
            if !ctx.queues.iter().any(|(i, _, _)| *i == q) {
                return Err(ActivateError::QueueMissing {
                    device: self.name.clone(),
                    queue: q,
                });
            }
        }
        let roles = ctx
            .queues
            .iter()
            .map(|(i, _, _)| roles_by_index[usize::from(*i)])
            .collect();
        *self.shared.irq.lock().unwrap_or_else(|e| e.into_inner()) = Some(ctx.interrupt.clone());
        // Reports name guest-physical ranges; behind a vIOMMU they would be IOVAs.
        let translated = ctx.mem.dma().has_translator();
        let backend = BalloonBackend {
            roles,
            shared: self.shared.clone(),
            discard: self.discard.clone(),
            ram: self.ram.clone(),
            held_stats: None,
            translated,
            buf: vec![0; PFN_CHUNK],
        };
        let r = self.worker.start(&self.name, ctx, backend);
        if r.is_err() {
            *self.shared.irq.lock().unwrap_or_else(|e| e.into_inner()) = None;
        }
        r
    }

    fn reset(&mut self) {
        self.worker.stop();
        *self.shared.irq.lock().unwrap_or_else(|e| e.into_inner()) = None;
        // A new driver starts from an empty balloon (its pages were already discarded).
        self.shared.actual.store(0, Ordering::Release);
        self.shared.c.actual.set(0);
    }

    fn needs_reset(&self) -> bool {
        self.worker.needs_reset()
    }
}

struct BalloonBackend {
    /// Per worker queue position.
    roles: Vec<QueueRole>,
    shared: Arc<Shared>,
    discard: Arc<dyn PageDiscard>,
    ram: Arc<Vec<(u64, u64)>>,
    /// The stats buffer the device holds until fresh figures are wanted: (queue position, head).
    held_stats: Option<(usize, u16)>,
    translated: bool,
    buf: Vec<u8>,
}

/// A run of consecutive guest pages inside one RAM range, being built from a PFN list.
#[derive(Default)]
struct Run {
    start: u64,
    len: u64,
    /// The RAM range holding the run: it may not grow out of it.
    base: u64,
    limit: u64,
}

impl Backend for BalloonBackend {
    fn process_queue(&mut self, io: &mut Io, qi: usize) -> bool {
        match self.roles.get(qi) {
            Some(QueueRole::Inflate) => io.serve(qi, &mut |io, d| self.pfns(io, d, true)),
            Some(QueueRole::Deflate) => io.serve(qi, &mut |io, d| self.pfns(io, d, false)),
            Some(QueueRole::Reporting) => io.serve(qi, &mut |io, d| self.report(io, d)),
            Some(QueueRole::Stats) => self.stats_queue(io, qi),
            None => false,
        }
    }

    fn extra_fd(&self) -> Option<RawFd> {
        Some(self.shared.stats_request.as_raw_fd())
    }

    fn extra_wanted(&self) -> bool {
        true
    }

    fn on_extra(&mut self, io: &mut Io) -> bool {
        if self.shared.stats_request.read().is_err() {
            return false;
        }
        // Fresh figures wanted: give the held buffer back; the driver refills and returns it.
        if let Some((qi, head)) = self.held_stats.take() {
            io.complete(qi, head, 0);
            io.end_batch(qi);
            return true;
        }
        false
    }
}

impl BalloonBackend {
    /// The RAM range holding guest-physical `gpa`: (start, end); the run may grow within it.
    fn ram_range(&self, gpa: u64) -> Option<(u64, u64)> {
        let i = self.ram.partition_point(|r| r.0 <= gpa);
        let (start, len) = *self.ram.get(i.checked_sub(1)?)?;
        (gpa - start < len).then_some((start, start + len))
    }

    /// An inflate (`inflate`) or deflate chain: device-readable arrays of le32 PFNs.
    fn pfns(&mut self, io: &Io, descs: &[Desc], inflate: bool) -> Served {
        let mut buf = std::mem::take(&mut self.buf);
        let shared = self.shared.clone();
        let c = &shared.c;
        let mut run = Run::default();
        for d in descs {
            let len = u64::from(d.len());
            if d.is_write_only() || len == 0 || len % 4 != 0 {
                c.bad_descriptors.inc();
                continue;
            }
            let mut off = 0u64;
            while off < len && !io.halted() {
                let n = ((len - off) as usize).min(PFN_CHUNK);
                if io
                    .dma
                    .read(io.dev_id, d.addr().0.wrapping_add(off), &mut buf[..n])
                    .is_err()
                {
                    c.bad_descriptors.inc();
                    break;
                }
                off += n as u64;
                for e in buf[..n].chunks_exact(4) {
                    let pfn = u32::from_le_bytes([e[0], e[1], e[2], e[3]]);
                    let gpa = u64::from(pfn) << PAGE_SHIFT;
                    let Some((start, end)) = self.ram_range(gpa) else {
                        c.bad_pfns.inc();
                        continue;
                    };
                    if !inflate {
                        c.deflated.inc();
                        continue;
                    }
                    // A page of the run again (a driver repeating itself): discarded already.
                    if gpa >= run.start && gpa < run.start + run.len {
                        c.inflated.inc();
                        continue;
                    }
                    // Extend the run when the page follows or precedes it in the same RAM range
                    // (drivers hand out pages in either order).
                    if run.len > 0 && gpa == run.start + run.len && gpa < run.limit {
                        run.len += PAGE_SIZE;
                    } else if run.len > 0 && gpa + PAGE_SIZE == run.start && gpa >= run.base {
                        run.start = gpa;
                        run.len += PAGE_SIZE;
                    } else {
                        self.give_back(&run, &c.inflated);
                        run = Run {
                            start: gpa,
                            len: PAGE_SIZE,
                            base: start,
                            limit: end,
                        };
                    }
                }
            }
        }
        self.give_back(&run, &c.inflated);
        self.buf = buf;
        Served::Used(0)
    }

    /// Discards `run` and counts its pages in `counter`.
    fn give_back(&self, run: &Run, counter: &Counter) {
        if run.len == 0 {
            return;
        }
        match self.discard.discard(run.start, run.len) {
            Ok(()) => counter.add(run.len >> PAGE_SHIFT),
            Err(e) => {
                self.shared.c.discard_errors.inc();
                log::debug!(
                    "balloon: cannot discard {:#x}+{:#x}: {e}",
                    run.start,
                    run.len
                );
            }
        }
    }

    /// A free page reporting chain: each descriptor is a free guest-physical range.
    fn report(&mut self, _io: &Io, descs: &[Desc]) -> Served {
        let shared = self.shared.clone();
        let c = &shared.c;
        for d in descs {
            if self.translated {
                c.reports_skipped_iommu.inc();
                continue;
            }
            let (addr, len) = (d.addr().0, u64::from(d.len()));
            let whole_pages = len > 0 && addr % PAGE_SIZE == 0 && len % PAGE_SIZE == 0;
            // The whole range must be RAM; it may span adjacent RAM ranges.
            let mut pieces = Vec::new();
            let mut at = addr;
            let end = addr.checked_add(len);
            let ok = whole_pages
                && end.is_some_and(|end| {
                    while at < end {
                        let Some((r_start, r_end)) = self.ram_range(at) else {
                            return false;
                        };
                        let e = r_end.min(end);
                        pieces.push(Run {
                            start: at,
                            len: e - at,
                            base: r_start,
                            limit: r_end,
                        });
                        at = e;
                    }
                    true
                });
            if !ok {
                c.bad_reports.inc();
                continue;
            }
            for p in &pieces {
                self.give_back(p, &c.reported);
            }
        }
        Served::Used(0)
    }

    /// The stats queue: read each buffer the driver gives and hold the last one.
    fn stats_queue(&mut self, io: &mut Io, qi: usize) -> bool {
        let mut found = false;
        let mut descs = Vec::new();
        loop {
            io.disable_notify(qi);
            loop {
                match io.pop(qi, &mut descs) {
                    Pop::Empty => break,
                    Pop::Fatal => return found,
                    Pop::Chain(head) => {
                        found = true;
                        self.read_stats(io, &descs);
                        // A driver that sends another buffer while the device holds one gets the
                        // older back.
                        if let Some((q, h)) = self.held_stats.replace((qi, head)) {
                            io.complete(q, h, 0);
                        }
                    }
                }
            }
            io.end_batch(qi);
            if io.halted() || !io.enable_notify(qi) {
                return found;
            }
        }
    }

    fn read_stats(&mut self, io: &Io, descs: &[Desc]) {
        let c = &self.shared.c;
        let mut bytes = Vec::new();
        for d in descs {
            let len = d.len() as usize;
            if d.is_write_only() {
                c.bad_stats.inc();
                continue;
            }
            let n = len.min(STATS_MAX.saturating_sub(bytes.len()));
            let at = bytes.len();
            bytes.resize(at + n, 0);
            if io
                .dma
                .read(io.dev_id, d.addr().0, &mut bytes[at..])
                .is_err()
            {
                c.bad_stats.inc();
                bytes.truncate(at);
            }
        }
        if bytes.len() % STAT_ENTRY != 0 {
            c.bad_stats.inc();
        }
        let entries: Vec<(u16, u64)> = bytes
            .chunks_exact(STAT_ENTRY)
            .map(|e| {
                let tag = u16::from_le_bytes([e[0], e[1]]);
                let mut v = [0u8; 8];
                v.copy_from_slice(&e[2..10]);
                (tag, u64::from_le_bytes(v))
            })
            .collect();
        for &(tag, v) in &entries {
            if let Some(counter) = c.stat_values.get(usize::from(tag)) {
                counter.set(v);
            }
        }
        c.stats_updates.inc();
        *self.shared.stats.lock().unwrap_or_else(|e| e.into_inner()) = Some(BalloonStats {
            entries,
            at: Instant::now(),
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queues_are_numbered_without_gaps() {
        use QueueRole::*;
        assert_eq!(queue_roles(0), vec![Inflate, Deflate]);
        assert_eq!(
            queue_roles(VIRTIO_BALLOON_F_PAGE_REPORTING),
            vec![Inflate, Deflate, Reporting]
        );
        assert_eq!(
            queue_roles(VIRTIO_BALLOON_F_STATS_VQ | VIRTIO_BALLOON_F_PAGE_REPORTING),
            vec![Inflate, Deflate, Stats, Reporting]
        );
    }

    #[test]
    fn features_follow_the_config() {
        let mut c = BalloonConfig::default();
        assert_eq!(c.features(), features::VIRTIO_F_VERSION_1);
        c.stats = true;
        c.deflate_on_oom = true;
        c.free_page_reporting = true;
        assert_eq!(
            c.features() & 0xff,
            VIRTIO_BALLOON_F_STATS_VQ
                | VIRTIO_BALLOON_F_DEFLATE_ON_OOM
                | VIRTIO_BALLOON_F_PAGE_REPORTING
        );
    }
}
