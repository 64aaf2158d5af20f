//! The Swap Mapper (VSWAPPER §4.5.1, our design B in research/vswapper.md §5.2): guest pages a
//! virtio-blk read fills are not copied but mapped, `MAP_PRIVATE`, from the disk image, so they
//! are *named* clean file pages: under the VM's memory limit the host drops them instead of
//! writing them to swap, and refaults them from the image (with read-around) instead of from
//! scattered swap slots.
//!
//! ## Mechanism
//! - **Read** (`BlockDataHook::read`): the part of a request that is 4 KiB-aligned in both guest
//!   address and image offset (and inside the image's size) is one run: `posix_fadvise(WILLNEED)`,
//!   `GuestRam::remap(gpa, len, Some((image, off)))` (`MAP_FIXED|MAP_PRIVATE`; KVM follows
//!   through its MMU notifier) and `MADV_POPULATE_READ`, which maps page-cache pages read-only
//!   *without* copy-on-write (never `MAP_POPULATE`: it would COW every page). Each page is
//!   recorded in the reverse map (page → block, block → pages). Unaligned heads and tails are
//!   copied by the mapper itself (`pread`); a request with nothing mappable returns `Ok(false)`
//!   and the device copies it.
//! - **Guest store**: KVM maps the read-faulted page read-only; the guest's first write COWs it
//!   into an anonymous page with the same bytes, so the association is broken by the kernel. The
//!   mapper notices lazily: `PAGEMAP_SCAN` over its file extents for pages present or swapped
//!   and not `PAGE_IS_FILE` (at most every [`SCAN_INTERVAL`] from the read path, in batches, or
//!   [`SwapMapper::scan`]), and device writes into guest pages through the `DmaObserver` (which
//!   only queues the pages, syscall-free on the DMA thread; the block worker checks them at its
//!   next read, change or scan).
//!   Dropped blocks no page maps any more are `POSIX_FADV_DONTNEED`ed, as VSWAPPER does.
//! - **Change of image bytes** (`before_change`, before every write, write-zeroes and discard
//!   reaches the file): every page still associated with a changed block and still backed by the
//!   file (present file page, or not present and not swapped: it would refault from the file) is
//!   broken with `MADV_POPULATE_WRITE`, which COWs the old content C0 in (re-reading it from the
//!   image if it was dropped) *before* the new content C1 is written. So no guest page ever shows
//!   image bytes it did not read. The result is checked in pagemap; a failure fails the request.
//! - **Discard** (`PageDiscard`, balloon and free-page reporting): the range is remapped
//!   anonymous (a `MADV_DONTNEED` inside a file mapping would bring the image block back) and
//!   its associations are forgotten.
//! - **Budget**: each run may split a VMA. The mapper counts guest RAM's VMAs exactly with
//!   `PROCMAP_QUERY` (6.11+) around every remap (a model of the layout where that is missing),
//!   predicts a run's effect from a model of its file extents (they merge when image offsets
//!   are contiguous, as the kernel merges them) and copies instead of mapping when a run would
//!   take the count above [`MapperBudget::max_vmas`] (default half of `vm.max_map_count`). The
//!   kernel can refuse a merge the model expects (different anon_vmas), so the count may pass
//!   the budget by one misprediction, never more. COW does not give a VMA back; discards can.
//!   A discard that would split VMAs past the budget zeroes the pages in place instead
//!   (anonymous pages dropped, file-extent pages COWed to zeros).
//!
//! ## Invariant (the consistency gate)
//! Every page inside a file extent of the layout either is associated with the block its offset
//! maps (and then shows that block's *current* bytes, which `before_change` keeps equal to what
//! the guest read), or is anonymous (present or swapped, not `PAGE_IS_FILE`) and can never show
//! file bytes again, because the mapper never `MADV_DONTNEED`s pages of a file extent.
//!
//! ## Vswapper mode: false-read prevention as far as stock KVM allows
//! - **Stale reads** (a device read into an evicted page faults the old content in from swap
//!   only for the DMA to overwrite it): mapping a run over swapped pages frees their slots unread
//!   (both modes, counted in `stale_reads_avoided`); on the copy path, whole pages of the buffer
//!   that pagemap shows swapped (and that lie outside file extents) are `MADV_DONTNEED`ed before
//!   the copy, so the copy finds a fresh zero page instead of reading swap. Exact for every
//!   page the request covers completely (pages of file extents, which only over-budget copies
//!   reach, are left alone: dropping them would refault image bytes).
//! - **Zero pages**: in vswapper mode, reads of image holes (`SEEK_DATA`) map fresh anonymous
//!   memory instead of
//!   the file (no disk read, no page cache, no old content read); discarded pages become zero
//!   pages (all modes). Both count in `zero_pages`; pages that were in swap when dropped count in
//!   `false_reads_avoided` (their content is never read back).
//! - **What stock KVM cannot do**: the paper's Preventer emulates guest stores to an evicted page
//!   into a buffer and skips the swap read when the page is fully overwritten. KVM never shows a
//!   VMM the data of a faulting store (the EPT violation is resolved in the kernel by
//!   faulting the page in), so CPU overwrites of evicted pages (zeroing on allocation, COW,
//!   compaction in the guest) still read swap. Doing it needs a kernel change: an
//!   "emulate-on-write-to-swapped-page" mode in KVM's fault path (or userfaultfd reporting the
//!   faulting instruction's data), as the paper's 1,964-line kernel part does.
//!
//! Counters `swap.mapper.{mapped_pages, runs, broken, fallbacks, vmas, remaps,
//! stale_reads_avoided, false_reads_avoided, zero_pages, metadata_bytes}` (`mapped_pages`, `vmas`
//! and `metadata_bytes` are gauges); [`SwapMapper::summary`] gives them as one line.
//!
//! Limits: requests are assumed serialized per image (one virtio-blk worker per device, one
//! device per image file); an image truncated under a running VM would make mapped pages beyond
//! the new end fault with SIGBUS. Guest RAM must be `Backing::Anonymous` (a shared memfd would
//! lose its sharing); with another backing, or in `Baseline` mode, the mapper only copies.
//!
//! Syscalls on the block worker (and on whichever thread calls `discard`): `statx`, `lseek`,
//! `fadvise64`, `mmap` (no `PROT_EXEC`), `madvise`, `pread64` (pagemap and the image),
//! `fcntl(F_DUPFD_CLOEXEC)` on an image's first use and `ioctl` [`MAPPER_IOCTLS`] on fds
//! [`SwapMapper::new`] opens.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use lucid_mem::{Access, Backing, DeviceId, DmaObserver, GuestRam, MemError, PageDiscard};
use lucid_stats::{Counter, StatsRegistry};
use lucid_virtio::blk::BlockDataHook;
use vm_memory::{Bytes, GuestAddress};

use crate::SwapMode;

const PAGE: u64 = 4096;

/// Least time between two lazy COW scans started from the read path.
pub const SCAN_INTERVAL: Duration = Duration::from_millis(250);

/// At most this many file extents (VMAs) are scanned per read-path scan.
const SCAN_BATCH: usize = 512;

// pagemap entry bits (Documentation/admin-guide/mm/pagemap.rst).
const PM_PRESENT: u64 = 1 << 63;
const PM_SWAP: u64 = 1 << 62;
const PM_FILE: u64 = 1 << 61;

// PAGEMAP_SCAN (linux/fs.h, 6.7+): the libc crate does not define it.
const PAGEMAP_SCAN: libc::c_ulong = 0xC060_6610; // _IOWR('f', 16, struct pm_scan_arg)
const PAGE_IS_FILE: u64 = 1 << 2;
const PAGE_IS_PRESENT: u64 = 1 << 3;
const PAGE_IS_SWAPPED: u64 = 1 << 4;

// PROCMAP_QUERY (linux/fs.h, 6.11+): asks the kernel for the VMA at or after an address.
const PROCMAP_QUERY: libc::c_ulong = 0xC068_6611; // _IOWR('f', 17, struct procmap_query)
const PROCMAP_QUERY_COVERING_OR_NEXT_VMA: u64 = 0x10;

#[repr(C)]
#[derive(Default)]
struct ProcmapQuery {
    size: u64,
    query_flags: u64,
    query_addr: u64,
    vma_start: u64,
    vma_end: u64,
    vma_flags: u64,
    vma_page_size: u64,
    vma_offset: u64,
    inode: u64,
    dev_major: u32,
    dev_minor: u32,
    vma_name_size: u32,
    build_id_size: u32,
    vma_name_addr: u64,
    build_id_addr: u64,
}

#[repr(C)]
#[derive(Default)]
struct PmScanArg {
    size: u64,
    flags: u64,
    start: u64,
    end: u64,
    walk_end: u64,
    vec: u64,
    vec_len: u64,
    max_pages: u64,
    category_inverted: u64,
    category_mask: u64,
    category_anyof_mask: u64,
    return_mask: u64,
}

#[repr(C)]
#[derive(Default, Clone, Copy)]
struct PageRegion {
    start: u64,
    end: u64,
    categories: u64,
}

/// The ioctls the mapper issues on the block worker (PAGEMAP_SCAN on /proc/self/pagemap,
/// PROCMAP_QUERY on /proc/self/maps, both opened in [`SwapMapper::new`]), for seccomp rules.
/// Refused ones degrade (pagemap reads, a modelled VMA count), they are not needed for safety.
pub const MAPPER_IOCTLS: [libc::c_ulong; 2] = [PAGEMAP_SCAN, PROCMAP_QUERY];

/// The page is backed by anonymous memory (a COWed or fresh page, present or in swap): it can
/// never show file bytes again.
fn anon_backed(e: u64) -> bool {
    e & (PM_PRESENT | PM_SWAP) != 0 && e & PM_FILE == 0
}

/// How many VMAs the mapper may have guest RAM split into.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MapperBudget {
    pub max_vmas: u64,
}

impl Default for MapperBudget {
    /// Half of `vm.max_map_count` (65530 by default), leaving the rest to the process.
    fn default() -> Self {
        let max = std::fs::read_to_string("/proc/sys/vm/max_map_count")
            .ok()
            .and_then(|s| s.trim().parse::<u64>().ok())
            .unwrap_or(65530);
        MapperBudget { max_vmas: max / 2 }
    }
}

impl MapperBudget {
    pub fn vmas(max_vmas: u64) -> Self {
        MapperBudget { max_vmas }
    }
}

struct Counters {
    mapped_pages: Arc<Counter>,
    runs: Arc<Counter>,
    broken: Arc<Counter>,
    fallbacks: Arc<Counter>,
    vmas: Arc<Counter>,
    remaps: Arc<Counter>,
    stale_reads_avoided: Arc<Counter>,
    false_reads_avoided: Arc<Counter>,
    zero_pages: Arc<Counter>,
    metadata_bytes: Arc<Counter>,
}

/// An image file the mapper has mapped from (kept open to drop its cache and to compare).
struct Image {
    dev: u64,
    ino: u64,
    file: File,
}

/// A maximal range of guest RAM mapped from one image at contiguous offsets: one VMA.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Extent {
    end: u64,
    image: u32,
    off: u64,
}

/// What backs a page in the VMA model: anonymous, or (image, offset − gpa): two neighbouring
/// pages share a VMA exactly when their keys are equal.
type Key = Option<(u32, u64)>;

#[derive(Default)]
struct State {
    images: Vec<Image>,
    /// Guest page → (image, block number).
    assoc: BTreeMap<u64, (u32, u64)>,
    /// (image, block, guest page): the reverse map.
    rev: BTreeSet<(u32, u64, u64)>,
    /// File extents by start gpa (everything else in guest RAM is anonymous).
    layout: BTreeMap<u64, Extent>,
    /// VMAs overlapping guest RAM: exact (counted by PROCMAP_QUERY around every change) while
    /// `exact`, else modelled from the layout.
    vmas: u64,
    exact: bool,
    last_scan: Option<Instant>,
    /// Where the next batched scan starts (a gpa).
    scan_cursor: u64,
    /// Associated pages a device wrote into (from the DMA observer), to check.
    suspects: BTreeSet<u64>,
    scan_unsupported: bool,
}

/// The Swap Mapper engine for one VM (see the module doc).
pub struct SwapMapper {
    ram: Arc<GuestRam>,
    mode: SwapMode,
    active: bool,
    budget: MapperBudget,
    pagemap: Option<File>,
    /// /proc/self/maps, for PROCMAP_QUERY.
    maps: Option<File>,
    /// Associations, readable without the lock (the DMA observer's fast path).
    mapped: AtomicU64,
    state: Mutex<State>,
    c: Counters,
}

/// A piece of a read request's aligned middle: mapped from the image, or a hole.
struct Piece {
    gpa: u64,
    end: u64,
    off: u64,
    hole: bool,
}

impl SwapMapper {
    /// The engine for `ram`. In `Baseline` mode, or when guest RAM is not anonymous memory, or
    /// when /proc/self/pagemap cannot be opened, it never maps (reads return `Ok(false)`,
    /// discards are plain).
    pub fn new(
        ram: Arc<GuestRam>,
        mode: SwapMode,
        stats: &StatsRegistry,
        budget: MapperBudget,
    ) -> Arc<SwapMapper> {
        let c = |n: &str| stats.counter(format!("swap.mapper.{n}"));
        let counters = Counters {
            mapped_pages: c("mapped_pages"),
            runs: c("runs"),
            broken: c("broken"),
            fallbacks: c("fallbacks"),
            vmas: c("vmas"),
            remaps: c("remaps"),
            stale_reads_avoided: c("stale_reads_avoided"),
            false_reads_avoided: c("false_reads_avoided"),
            zero_pages: c("zero_pages"),
            metadata_bytes: c("metadata_bytes"),
        };
        let pagemap = match File::open("/proc/self/pagemap") {
            Ok(f) => Some(f),
            Err(e) => {
                log::warn!("swap mapper: cannot open /proc/self/pagemap ({e}): copying only");
                None
            }
        };
        let anon = *ram.backing() == Backing::Anonymous;
        if mode != SwapMode::Baseline && !anon {
            log::warn!(
                "swap mapper: guest RAM is {:?}, not anonymous memory: copying only",
                ram.backing()
            );
        }
        let active = mode != SwapMode::Baseline && anon && pagemap.is_some();
        let mut m = SwapMapper {
            ram,
            mode,
            active,
            budget,
            pagemap,
            maps: File::open("/proc/self/maps").ok(),
            mapped: AtomicU64::new(0),
            state: Mutex::new(State::default()),
            c: counters,
        };
        let exact = m.count_ram_vmas();
        let st = m.state.get_mut().unwrap_or_else(|e| e.into_inner());
        st.exact = exact.is_some();
        st.vmas = exact.unwrap_or(m.ram.regions().len() as u64);
        m.c.vmas.set(st.vmas);
        Arc::new(m)
    }

    /// The VMA at or after host address `addr`, as (start, end).
    fn vma_at_or_after(&self, addr: u64) -> Option<(u64, u64)> {
        let maps = self.maps.as_ref()?;
        let mut q = ProcmapQuery {
            size: std::mem::size_of::<ProcmapQuery>() as u64,
            query_flags: PROCMAP_QUERY_COVERING_OR_NEXT_VMA,
            query_addr: addr,
            ..Default::default()
        };
        // SAFETY: PROCMAP_QUERY reads and writes only `q` (no name or build-id buffers are
        // passed: their sizes are 0).
        let r = unsafe { libc::ioctl(maps.as_raw_fd(), PROCMAP_QUERY, &mut q) };
        (r == 0).then_some((q.vma_start, q.vma_end))
    }

    /// How many VMAs overlap host addresses `a..b` (None without PROCMAP_QUERY).
    fn count_vmas(&self, a: u64, b: u64) -> Option<u64> {
        let mut n = 0;
        let mut at = a;
        while at < b {
            let Some((s, e)) = self.vma_at_or_after(at) else {
                // ENOENT (nothing after) is an answer; anything else is not.
                let err = io::Error::last_os_error().raw_os_error();
                return (err == Some(libc::ENOENT)).then_some(n);
            };
            if s >= b {
                break;
            }
            n += 1;
            at = e;
        }
        Some(n)
    }

    /// Guest RAM's host address ranges, with regions placed back to back merged.
    fn host_spans(&self) -> Vec<(u64, u64)> {
        let mut spans: Vec<(u64, u64)> = self
            .ram
            .regions()
            .iter()
            .map(|r| (r.host_addr, r.host_addr + r.size))
            .collect();
        spans.sort_unstable();
        let mut out: Vec<(u64, u64)> = Vec::new();
        for (a, b) in spans {
            match out.last_mut() {
                Some(last) if last.1 == a => last.1 = b,
                _ => out.push((a, b)),
            }
        }
        out
    }

    fn host_span(&self, host: u64) -> (u64, u64) {
        self.host_spans()
            .into_iter()
            .find(|&(a, b)| host >= a && host < b)
            .unwrap_or((host, host))
    }

    /// VMAs overlapping guest RAM, counted per host span (a VMA bridging two spans counts twice:
    /// only possible when other mappings fill the gap between regions and merge with both).
    fn count_ram_vmas(&self) -> Option<u64> {
        self.host_spans()
            .into_iter()
            .try_fold(0, |n, (a, b)| Some(n + self.count_vmas(a, b)?))
    }

    /// Remaps guest pages `s..e` of region `(lo, hi)` (from `src`'s image at an offset, or
    /// anonymous), keeping the layout model and the VMA count up to date.
    fn remap_tracked(
        &self,
        st: &mut State,
        s: u64,
        e: u64,
        (lo, hi): (u64, u64),
        src: Option<(&File, u64, u32)>,
    ) -> Result<(), MemError> {
        let _ = hi;
        // A page either side, clamped to the host span of guest RAM around it (regions the
        // kernel placed back to back can share a VMA, so the span, not the region, bounds it).
        let (hs, he) = (self.host(s), self.host(s) + (e - s));
        let span = self.host_span(hs);
        let w = (hs.saturating_sub(PAGE).max(span.0), (he + PAGE).min(span.1));
        let before = if st.exact {
            self.count_vmas(w.0, w.1)
        } else {
            None
        };
        self.ram.remap(s, e - s, src.map(|(f, off, _)| (f, off)))?;
        self.c.remaps.inc();
        let old = st.vmas;
        let key = src.map(|(_, off, image)| (image, off.wrapping_sub(s)));
        Self::set_layout(st, s, e, lo, hi, key);
        if st.exact {
            match (before, self.count_vmas(w.0, w.1)) {
                (Some(b), Some(a)) => st.vmas = (old + a).saturating_sub(b),
                _ => st.exact = false,
            }
        }
        Ok(())
    }

    pub fn mode(&self) -> SwapMode {
        self.mode
    }

    /// Whether reads are mapped (a mapper mode on anonymous guest RAM).
    pub fn is_active(&self) -> bool {
        self.active
    }

    /// Guest pages currently associated with image blocks (COWs not yet scanned included).
    pub fn mapped_pages(&self) -> u64 {
        self.mapped.load(Ordering::Relaxed)
    }

    /// The modelled number of VMAs guest RAM is split into.
    pub fn vmas(&self) -> u64 {
        self.lock().vmas
    }

    /// The guest page (gpa) → image block associations, sorted (for tests and reports).
    pub fn associations(&self) -> Vec<(u64, u64)> {
        self.lock()
            .assoc
            .iter()
            .map(|(&g, &(_, b))| (g, b))
            .collect()
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn image_id(st: &mut State, file: &File, create: bool) -> io::Result<Option<u32>> {
        let m = file.metadata()?;
        if let Some(i) = st
            .images
            .iter()
            .position(|i| i.dev == m.dev() && i.ino == m.ino())
        {
            return Ok(Some(i as u32));
        }
        if !create {
            return Ok(None);
        }
        st.images.push(Image {
            dev: m.dev(),
            ino: m.ino(),
            file: file.try_clone()?,
        });
        Ok(Some(st.images.len() as u32 - 1))
    }

    /// The host address of `gpa..gpa+len` and the RAM region's bounds, if it lies in one region.
    fn region_of(&self, gpa: u64, len: u64) -> Option<(u64, u64, u64)> {
        self.ram
            .regions()
            .iter()
            .find(|r| gpa >= r.gpa && gpa.checked_add(len).is_some_and(|e| e <= r.gpa + r.size))
            .map(|r| (r.host_addr + (gpa - r.gpa), r.gpa, r.gpa + r.size))
    }

    fn host(&self, gpa: u64) -> u64 {
        self.region_of(gpa, 1).map(|r| r.0).unwrap_or(0)
    }

    /// pagemap entries of the pages at `gpa..gpa+len` (page aligned, inside one region).
    fn pagemap(&self, gpa: u64, len: u64) -> io::Result<Vec<u64>> {
        let pm = self
            .pagemap
            .as_ref()
            .ok_or_else(|| io::Error::other("pagemap is not open"))?;
        let n = (len / PAGE) as usize;
        let mut raw = vec![0u8; n * 8];
        pm.read_exact_at(&mut raw, self.host(gpa) / PAGE * 8)?;
        Ok(raw
            .chunks_exact(8)
            .map(|c| u64::from_ne_bytes(c.try_into().unwrap_or_default()))
            .collect())
    }

    /// How many anonymous pages of `gpa..gpa+len` are in host swap now (0 when pagemap
    /// cannot tell).
    fn swapped_out(&self, gpa: u64, len: u64) -> u64 {
        self.pagemap(gpa, len)
            .map(|v| {
                v.iter()
                    .filter(|&&e| e & PM_SWAP != 0 && e & PM_FILE == 0)
                    .count() as u64
            })
            .unwrap_or(0)
    }

    fn madvise(&self, gpa: u64, len: u64, advice: libc::c_int) -> io::Result<()> {
        let host = self.host(gpa);
        // SAFETY: `host..host+len` is guest RAM this mapper's GuestRam owns (callers pass
        // ranges inside one region); madvise changes no Rust-visible memory invariants: the
        // populate advices only fault pages in, DONTNEED replaces anonymous pages by zero pages.
        let r = unsafe { libc::madvise(host as *mut libc::c_void, len as usize, advice) };
        if r != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    fn publish(&self, st: &State) {
        let n = st.assoc.len() as u64;
        self.mapped.store(n, Ordering::Relaxed);
        self.c.mapped_pages.set(n);
        self.c.vmas.set(st.vmas);
        self.c.metadata_bytes.set(Self::metadata_bytes(st));
    }

    /// Estimated bytes of mapper metadata (B-tree entries with their share of node overhead):
    /// the paper's "~200 B per mapping" figure, here per page and per extent.
    fn metadata_bytes(st: &State) -> u64 {
        st.assoc.len() as u64 * 40 + st.rev.len() as u64 * 40 + st.layout.len() as u64 * 48
    }

    /// One line for a run summary.
    pub fn summary(&self) -> String {
        let st = self.lock();
        let c = &self.c;
        format!(
            "{}: {} pages mapped ({} runs, {} remaps), {} broken, {} fallbacks, {} VMAs              (budget {}), {} stale reads avoided, {} false reads avoided, {} zero pages,              {} KiB metadata",
            self.mode,
            st.assoc.len(),
            c.runs.get(),
            c.remaps.get(),
            c.broken.get(),
            c.fallbacks.get(),
            st.vmas,
            self.budget.max_vmas,
            c.stale_reads_avoided.get(),
            c.false_reads_avoided.get(),
            c.zero_pages.get(),
            Self::metadata_bytes(&st) / 1024
        )
    }

    // ---- the VMA model ----

    fn key_at(st: &State, gpa: u64) -> Key {
        st.layout
            .range(..=gpa)
            .next_back()
            .filter(|(_, e)| e.end > gpa)
            .map(|(&s, e)| (e.image, e.off.wrapping_sub(s)))
    }

    /// Distinct extent boundaries in `[s, e]` strictly inside the region `(lo, hi)`: each is a
    /// VMA boundary because extents are kept maximal.
    fn boundaries(st: &State, s: u64, e: u64, lo: u64, hi: u64) -> u64 {
        let mut pts = Vec::new();
        for (&start, ext) in st.layout.range(..=e).rev() {
            if ext.end < s {
                break;
            }
            for p in [start, ext.end] {
                if p >= s && p <= e && p > lo && p < hi {
                    pts.push(p);
                }
            }
        }
        pts.sort_unstable();
        pts.dedup();
        pts.len() as u64
    }

    /// The VMA count after giving pages `s..e` of region `(lo, hi)` the key `key`.
    fn vmas_after(st: &State, s: u64, e: u64, lo: u64, hi: u64, key: Key) -> u64 {
        let before = Self::boundaries(st, s, e, lo, hi);
        let after = u64::from(s > lo && Self::key_at(st, s - PAGE) != key)
            + u64::from(e < hi && Self::key_at(st, e) != key);
        (st.vmas + after).saturating_sub(before)
    }

    /// Records that pages `s..e` are now anonymous (`key` None) or mapped from an image.
    fn set_layout(st: &mut State, s: u64, e: u64, lo: u64, hi: u64, key: Key) {
        st.vmas = Self::vmas_after(st, s, e, lo, hi, key);
        let overlapping: Vec<(u64, Extent)> = st
            .layout
            .range(..e)
            .rev()
            .take_while(|(_, x)| x.end > s)
            .map(|(&k, &x)| (k, x))
            .collect();
        for (start, x) in overlapping {
            st.layout.remove(&start);
            if start < s {
                st.layout.insert(start, Extent { end: s, ..x });
            }
            if x.end > e {
                st.layout.insert(
                    e,
                    Extent {
                        off: x.off + (e - start),
                        ..x
                    },
                );
            }
        }
        let Some((image, delta)) = key else { return };
        let mut start = s;
        let mut ext = Extent {
            end: e,
            image,
            off: delta.wrapping_add(s),
        };
        // Merge with neighbours of the same key, as the kernel merges the VMAs.
        if let Some((&ls, l)) = st.layout.range(..s).next_back() {
            if l.end == s && l.image == image && l.off.wrapping_sub(ls) == delta {
                start = ls;
                ext.off = l.off;
                st.layout.remove(&ls);
            }
        }
        if let Some(r) = st.layout.get(&e).copied() {
            if r.image == image && r.off.wrapping_sub(e) == delta {
                ext.end = r.end;
                st.layout.remove(&e);
            }
        }
        st.layout.insert(start, ext);
    }

    // ---- associations ----

    fn forget(st: &mut State, gpa: u64) -> Option<(u32, u64)> {
        let (i, b) = st.assoc.remove(&gpa)?;
        st.rev.remove(&(i, b, gpa));
        Some((i, b))
    }

    /// Forgets a page found anonymous (COWed): a broken association; drops the block from the
    /// host page cache when no other page maps it.
    fn broke(&self, st: &mut State, gpa: u64, drop_cache: bool) {
        if let Some((i, b)) = Self::forget(st, gpa) {
            self.c.broken.inc();
            if drop_cache && st.rev.range((i, b, 0)..=(i, b, u64::MAX)).next().is_none() {
                if let Some(img) = st.images.get(i as usize) {
                    // SAFETY: fadvise on an fd we own; no memory is touched.
                    unsafe {
                        libc::posix_fadvise(
                            img.file.as_raw_fd(),
                            (b * PAGE) as libc::off_t,
                            PAGE as libc::off_t,
                            libc::POSIX_FADV_DONTNEED,
                        )
                    };
                }
            }
        }
    }

    // ---- read ----

    fn read_impl(&self, file: &File, off: u64, gpa: u64, len: u64) -> io::Result<bool> {
        if !self.active || len == 0 {
            return Ok(false);
        }
        let Some((_, lo, hi)) = self.region_of(gpa, len) else {
            // Outside guest RAM or across regions: the device copies (and reports errors).
            self.c.fallbacks.inc();
            return Ok(false);
        };
        let Some(end_off) = off.checked_add(len) else {
            return Ok(false);
        };
        let mut st = self.lock();
        let r = self.read_locked(&mut st, file, off, gpa, len, (lo, hi), end_off);
        // Whatever happened, publish what the state now is (before_change relies on it only
        // through the lock, the DMA observer's fast path through `mapped`).
        self.publish(&st);
        r
    }

    #[allow(clippy::too_many_arguments)]
    fn read_locked(
        &self,
        st: &mut State,
        file: &File,
        off: u64,
        gpa: u64,
        len: u64,
        (lo, hi): (u64, u64),
        end_off: u64,
    ) -> io::Result<bool> {
        self.maybe_scan(st);
        let size = file.metadata()?.len();
        // The aligned middle: whole pages, aligned alike in guest and image, inside the file.
        let m_start = gpa.next_multiple_of(PAGE);
        let mut m_end = (gpa + len) / PAGE * PAGE;
        if !(gpa ^ off).is_multiple_of(PAGE) {
            m_end = m_start;
        }
        let file_end_gpa = (size / PAGE * PAGE)
            .checked_sub(off)
            .map(|d| gpa.saturating_add(d));
        m_end = m_end.min(file_end_gpa.unwrap_or(0));
        if end_off > size {
            // Past the image's end: the device copies and reports the error.
            return Ok(false);
        }
        if m_end <= m_start {
            self.prepare_copy(st, gpa, len);
            self.c.fallbacks.inc();
            return Ok(false);
        }
        let image = Self::image_id(st, file, true)?.unwrap_or(0);
        let m_off = off + (m_start - gpa);
        let pieces = self.pieces(file, m_off, m_start, m_end);
        // Nothing placed yet: if the first piece does not fit, let the device copy it all.
        let first = &pieces[0];
        let key = |p: &Piece| (!p.hole).then(|| (image, p.off.wrapping_sub(p.gpa)));
        if Self::vmas_after(st, first.gpa, first.end, lo, hi, key(first)) > self.budget.max_vmas {
            self.prepare_copy(st, gpa, len);
            self.c.fallbacks.inc();
            return Ok(false);
        }
        if m_start > gpa {
            self.copy_in(st, file, off, gpa, m_start - gpa)?;
        }
        for p in &pieces {
            let fits = Self::vmas_after(st, p.gpa, p.end, lo, hi, key(p)) <= self.budget.max_vmas;
            let placed = fits
                && if p.hole {
                    self.zero_piece(st, p, lo, hi).is_ok()
                } else {
                    self.map_piece(st, image, file, p, lo, hi).is_ok()
                };
            if !placed {
                self.c.fallbacks.inc();
                self.prepare_copy(st, p.gpa, p.end - p.gpa);
                self.copy_in(st, file, p.off, p.gpa, p.end - p.gpa)?;
            }
        }
        if gpa + len > m_end {
            self.copy_in(st, file, off + (m_end - gpa), m_end, gpa + len - m_end)?;
        }
        Ok(true)
    }

    /// Splits the aligned middle at image holes (vswapper) into pieces.
    fn pieces(&self, file: &File, off: u64, gpa: u64, end: u64) -> Vec<Piece> {
        let whole = |g: u64, e: u64, hole: bool| Piece {
            gpa: g,
            end: e,
            off: off + (g - gpa),
            hole,
        };
        if self.mode != SwapMode::Vswapper {
            return vec![whole(gpa, end, false)];
        }
        let fd = file.as_raw_fd();
        let off_end = off + (end - gpa);
        let mut out = Vec::new();
        let mut pos = off;
        while pos < off_end {
            // SAFETY: lseek on a borrowed fd: no memory is touched. The position it moves is
            // not used by the device (pread/pwrite take explicit offsets).
            let data = unsafe { libc::lseek(fd, pos as libc::off_t, libc::SEEK_DATA) };
            let data = if data >= 0 {
                data as u64
            } else if io::Error::last_os_error().raw_os_error() == Some(libc::ENXIO) {
                // No data at or after `pos`: the rest is a hole.
                off_end
            } else {
                // SEEK_DATA unsupported or failing: take it all as data.
                pos
            };
            // Hole pages: only those entirely before the data.
            let hole_end = (data / PAGE * PAGE).min(off_end);
            if hole_end > pos {
                out.push(whole(gpa + (pos - off), gpa + (hole_end - off), true));
                pos = hole_end;
                continue;
            }
            // SAFETY: as above.
            let hole = unsafe { libc::lseek(fd, data.max(pos) as libc::off_t, libc::SEEK_HOLE) };
            let data_end = if hole < 0 {
                off_end
            } else {
                (hole as u64).next_multiple_of(PAGE).min(off_end)
            };
            let data_end = data_end.max(pos + PAGE);
            out.push(whole(gpa + (pos - off), gpa + (data_end - off), false));
            pos = data_end;
        }
        if out.is_empty() {
            out.push(whole(gpa, end, false));
        }
        out
    }

    /// Maps one aligned piece from the image; on failure nothing stays mapped.
    fn map_piece(
        &self,
        st: &mut State,
        image: u32,
        file: &File,
        p: &Piece,
        lo: u64,
        hi: u64,
    ) -> io::Result<()> {
        let len = p.end - p.gpa;
        let swapped = self.swapped_out(p.gpa, len);
        // SAFETY: fadvise on a borrowed fd; no memory is touched.
        unsafe {
            libc::posix_fadvise(
                file.as_raw_fd(),
                p.off as libc::off_t,
                len as libc::off_t,
                libc::POSIX_FADV_WILLNEED,
            )
        };
        self.remap_tracked(st, p.gpa, p.end, (lo, hi), Some((file, p.off, image)))
            .map_err(io::Error::other)?;
        let populated = self.madvise(p.gpa, len, libc::MADV_POPULATE_READ);
        if let Err(e) = &populated {
            // EIO, EINTR, ENOMEM...: go back to anonymous memory; the caller copies (and so
            // reports a real I/O error to the guest).
            match self.remap_tracked(st, p.gpa, p.end, (lo, hi), None) {
                Ok(()) => {
                    for g in (p.gpa..p.end).step_by(PAGE as usize) {
                        Self::forget(st, g);
                    }
                    return Err(io::Error::new(e.kind(), e.to_string()));
                }
                // Still mapped from the image: record the association below (so a change to
                // the blocks still breaks it first) and report the failure.
                Err(e2) => log::error!(
                    "swap mapper: cannot undo the mapping of {:#x}+{len:#x}: {e2}",
                    p.gpa
                ),
            }
        }
        for g in (p.gpa..p.end).step_by(PAGE as usize) {
            Self::forget(st, g);
            let b = (p.off + (g - p.gpa)) / PAGE;
            st.assoc.insert(g, (image, b));
            st.rev.insert((image, b, g));
        }
        populated?;
        self.c.runs.inc();
        self.c.stale_reads_avoided.add(swapped);
        Ok(())
    }

    /// A piece that is an image hole: fresh anonymous zero pages, nothing read.
    fn zero_piece(&self, st: &mut State, p: &Piece, lo: u64, hi: u64) -> io::Result<()> {
        let len = p.end - p.gpa;
        let swapped = self.swapped_out(p.gpa, len);
        self.remap_tracked(st, p.gpa, p.end, (lo, hi), None)
            .map_err(io::Error::other)?;
        for g in (p.gpa..p.end).step_by(PAGE as usize) {
            Self::forget(st, g);
        }
        self.c.zero_pages.add(len / PAGE);
        self.c.stale_reads_avoided.add(swapped);
        Ok(())
    }

    /// Vswapper: before a copy into `gpa..gpa+len`, drops the whole pages it covers that are in
    /// swap (outside file extents), so the copy does not read their old content back first.
    fn prepare_copy(&self, st: &State, gpa: u64, len: u64) {
        if self.mode != SwapMode::Vswapper {
            return;
        }
        let s = gpa.next_multiple_of(PAGE);
        let e = (gpa + len) / PAGE * PAGE;
        if e <= s || self.region_of(s, e - s).is_none() {
            return;
        }
        let Ok(entries) = self.pagemap(s, e - s) else {
            return;
        };
        for (i, ent) in entries.iter().enumerate() {
            let g = s + i as u64 * PAGE;
            if ent & PM_SWAP != 0 && ent & PM_FILE == 0 && Self::key_at(st, g).is_none() {
                // Anonymous VMA: DONTNEED frees the swap slot unread and leaves a zero page.
                if self.madvise(g, PAGE, libc::MADV_DONTNEED).is_ok() {
                    self.c.stale_reads_avoided.inc();
                }
            }
        }
    }

    /// Copies image bytes into guest memory itself (unaligned heads and tails, fallbacks), and
    /// forgets the pages it wrote (the write COWed any mapped page).
    fn copy_in(&self, st: &mut State, file: &File, off: u64, gpa: u64, len: u64) -> io::Result<()> {
        // In bounded chunks: a hostile request may name gigabytes.
        const CHUNK: u64 = 1 << 20;
        let mut buf = vec![0u8; len.min(CHUNK) as usize];
        let mut done = 0;
        while done < len {
            let n = (len - done).min(CHUNK) as usize;
            file.read_exact_at(&mut buf[..n], off + done)?;
            self.ram
                .memory()
                .write_slice(&buf[..n], GuestAddress(gpa + done))
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e.to_string()))?;
            done += n as u64;
        }
        let first = gpa / PAGE * PAGE;
        for g in (first..gpa + len).step_by(PAGE as usize) {
            if st.assoc.contains_key(&g) {
                self.broke(st, g, true);
            }
        }
        Ok(())
    }

    // ---- breaking ----

    fn before_change_impl(&self, file: &File, off: u64, len: u64) -> io::Result<()> {
        if !self.active || len == 0 {
            return Ok(());
        }
        // Always under the lock, never on the `mapped` hint: a stale hint here would be a
        // consistency bug.
        let mut st = self.lock();
        self.check_suspects(&mut st);
        let Some(image) = Self::image_id(&mut st, file, false)? else {
            return Ok(());
        };
        let b0 = off / PAGE;
        let b1 = off.saturating_add(len).div_ceil(PAGE);
        let pages: Vec<u64> = st
            .rev
            .range((image, b0, 0)..(image, b1, 0))
            .map(|&(_, _, g)| g)
            .collect();
        let mut result = Ok(());
        for g in pages {
            match self.break_page(g) {
                // The block is about to change: no point dropping its cache.
                Ok(()) => self.broke(&mut st, g, false),
                Err(e) => {
                    log::error!("swap mapper: cannot break the mapping of page {g:#x}: {e}");
                    result = Err(e);
                }
            }
        }
        self.publish(&st);
        result
    }

    /// Makes page `gpa` anonymous with its current (old) content, if it is still file-backed.
    fn break_page(&self, gpa: u64) -> io::Result<()> {
        for _ in 0..4 {
            let e = self.pagemap(gpa, PAGE)?[0];
            if anon_backed(e) {
                return Ok(());
            }
            // A present file page, a file page under migration, or not present (it would
            // refault from the file): COW the old content in now.
            match self.madvise(gpa, PAGE, libc::MADV_POPULATE_WRITE) {
                Ok(()) => {}
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => {}
                Err(e) => return Err(e),
            }
        }
        let e = self.pagemap(gpa, PAGE)?[0];
        if anon_backed(e) {
            Ok(())
        } else {
            Err(io::Error::other(format!(
                "page still file-backed after MADV_POPULATE_WRITE (pagemap {e:#x})"
            )))
        }
    }

    // ---- lazy COW detection ----

    fn maybe_scan(&self, st: &mut State) {
        self.check_suspects(st);
        if st.assoc.is_empty() {
            return;
        }
        if st.last_scan.is_some_and(|t| t.elapsed() < SCAN_INTERVAL) {
            return;
        }
        self.scan_locked(st, Some(SCAN_BATCH));
    }

    /// Finds COWed pages (present or swapped, not file) in the mapper's file extents now and
    /// drops their associations.
    pub fn scan(&self) {
        if !self.active {
            return;
        }
        let mut st = self.lock();
        self.check_suspects(&mut st);
        self.scan_locked(&mut st, None);
        self.publish(&st);
    }

    /// Scans the extents that still hold associations: all of them, or (from the read path)
    /// `batch` of them from where the last batch stopped, so a read never pays for a scan of
    /// tens of thousands of VMAs.
    fn scan_locked(&self, st: &mut State, batch: Option<usize>) {
        st.last_scan = Some(Instant::now());
        let from = if batch.is_some() { st.scan_cursor } else { 0 };
        let extents: Vec<(u64, u64)> = st
            .layout
            .range(from..)
            .map(|(&s, e)| (s, e.end))
            .filter(|&(s, e)| st.assoc.range(s..e).next().is_some())
            .take(batch.unwrap_or(usize::MAX))
            .collect();
        if let Some(b) = batch {
            st.scan_cursor = match extents.last() {
                Some(&(_, e)) if extents.len() == b => e,
                _ => 0,
            };
        }
        let mut cowed = Vec::new();
        for (s, e) in extents {
            if st.scan_unsupported {
                self.scan_pread(st, s, e, &mut cowed);
            } else if let Err(err) = self.scan_ioctl(s, e, &mut cowed) {
                log::info!("swap mapper: PAGEMAP_SCAN unavailable ({err}): reading pagemap");
                st.scan_unsupported = true;
                self.scan_pread(st, s, e, &mut cowed);
            }
        }
        for g in cowed {
            if st.assoc.contains_key(&g) {
                self.broke(st, g, true);
            }
        }
    }

    fn scan_ioctl(&self, s: u64, e: u64, out: &mut Vec<u64>) -> io::Result<()> {
        let pm = self
            .pagemap
            .as_ref()
            .ok_or_else(|| io::Error::other("pagemap is not open"))?;
        let host = self.host(s);
        let end = host + (e - s);
        let mut regions = [PageRegion::default(); 256];
        let mut start = host;
        while start < end {
            let mut arg = PmScanArg {
                size: std::mem::size_of::<PmScanArg>() as u64,
                start,
                end,
                vec: regions.as_mut_ptr() as u64,
                vec_len: regions.len() as u64,
                category_inverted: PAGE_IS_FILE,
                category_mask: PAGE_IS_FILE,
                category_anyof_mask: PAGE_IS_PRESENT | PAGE_IS_SWAPPED,
                return_mask: PAGE_IS_PRESENT | PAGE_IS_SWAPPED | PAGE_IS_FILE,
                ..Default::default()
            };
            // SAFETY: PAGEMAP_SCAN reads `arg` and writes at most `vec_len` PageRegions into
            // `regions` (which outlives the call) and `arg.walk_end`; it only inspects our page
            // tables.
            let n = unsafe { libc::ioctl(pm.as_raw_fd(), PAGEMAP_SCAN, &mut arg) };
            if n < 0 {
                return Err(io::Error::last_os_error());
            }
            for r in &regions[..n as usize] {
                for h in (r.start..r.end).step_by(PAGE as usize) {
                    out.push(s + (h - host));
                }
            }
            if arg.walk_end <= start {
                break;
            }
            start = arg.walk_end;
        }
        Ok(())
    }

    fn scan_pread(&self, st: &State, s: u64, e: u64, out: &mut Vec<u64>) {
        let pages: Vec<u64> = st.assoc.range(s..e).map(|(&g, _)| g).collect();
        for g in pages {
            if self.pagemap(g, PAGE).is_ok_and(|v| anon_backed(v[0])) {
                out.push(g);
            }
        }
    }

    // ---- device writes into guest pages ----

    /// Runs on whichever thread did the DMA (any device, maybe a vCPU): no syscalls here (that
    /// thread's seccomp role may not allow them) and no waiting for the lock. The pages written
    /// are queued and checked on the block worker at its next read, change or scan.
    fn observe_write(&self, gpa: u64, len: u64) {
        let Ok(mut st) = self.state.try_lock() else {
            return;
        };
        let first = gpa / PAGE * PAGE;
        let pages: Vec<u64> = st
            .assoc
            .range(first..gpa.saturating_add(len))
            .map(|(&g, _)| g)
            .collect();
        // Bounded: past it, the periodic scan finds the same COWs.
        if st.suspects.len() < 65536 {
            st.suspects.extend(pages);
        }
    }

    /// Checks the pages device writes were reported into: the copy COWed them, but check
    /// rather than trust (a racing remap may have replaced one after the copy).
    fn check_suspects(&self, st: &mut State) {
        if st.suspects.is_empty() {
            return;
        }
        for g in std::mem::take(&mut st.suspects) {
            if st.assoc.contains_key(&g) && self.pagemap(g, PAGE).is_ok_and(|v| anon_backed(v[0])) {
                self.broke(st, g, true);
            }
        }
    }

    // ---- discard ----

    fn discard_impl(&self, gpa: u64, len: u64) -> Result<(), MemError> {
        let Some((_, lo, hi)) = self
            .region_of(gpa, len)
            .filter(|_| gpa.is_multiple_of(PAGE) && len.is_multiple_of(PAGE) && len > 0)
        else {
            return Err(MemError::BadRemap { gpa, len });
        };
        let mut st = self.lock();
        let swapped = self.swapped_out(gpa, len);
        if Self::vmas_after(&st, gpa, gpa + len, lo, hi, None) <= self.budget.max_vmas.max(st.vmas)
        {
            self.remap_tracked(&mut st, gpa, gpa + len, (lo, hi), None)?;
        } else {
            // Remapping would split file VMAs past the budget (a guest ballooning every other
            // page of large mapped runs could push the process to vm.max_map_count): zero the
            // pages in place instead. Anonymous ones are dropped; file-extent ones are COWed
            // into zero-filled anonymous pages (no VMA change; the kernel swaps zero pages
            // without I/O).
            let zeros = vec![0u8; PAGE as usize];
            for g in (gpa..gpa + len).step_by(PAGE as usize) {
                if Self::key_at(&st, g).is_none() {
                    self.madvise(g, PAGE, libc::MADV_DONTNEED)
                        .map_err(|source| MemError::RemapFailed {
                            gpa: g,
                            len: PAGE,
                            source,
                        })?;
                } else {
                    self.ram
                        .memory()
                        .write_slice(&zeros, GuestAddress(g))
                        .map_err(|_| MemError::BadRemap { gpa: g, len: PAGE })?;
                }
            }
        }
        let pages: Vec<u64> = st.assoc.range(gpa..gpa + len).map(|(&g, _)| g).collect();
        for g in pages {
            Self::forget(&mut st, g);
        }
        self.c.zero_pages.add(len / PAGE);
        self.c.false_reads_avoided.add(swapped);
        self.publish(&st);
        Ok(())
    }

    /// Counts guest RAM's VMAs afresh with PROCMAP_QUERY (None where it is missing).
    pub fn recount_vmas(&self) -> Option<u64> {
        let _st = self.lock();
        self.count_ram_vmas()
    }

    /// The VMAs guest RAM really has now, from /proc/self/maps (slow: for tests and reports).
    pub fn actual_vmas(&self) -> io::Result<u64> {
        let maps = std::fs::read_to_string("/proc/self/maps")?;
        let vmas: Vec<(u64, u64)> = maps
            .lines()
            .filter_map(|l| {
                let (a, b) = l.split_whitespace().next()?.split_once('-')?;
                Some((
                    u64::from_str_radix(a, 16).ok()?,
                    u64::from_str_radix(b, 16).ok()?,
                ))
            })
            .collect();
        // Per host span, like `vmas()`: a VMA bridging two spans (other mappings placed in the
        // gap between two regions can merge with both) counts once for each.
        Ok(self
            .host_spans()
            .iter()
            .map(|&(s, e)| vmas.iter().filter(|&&(a, b)| a < e && b > s).count() as u64)
            .sum())
    }
}

impl BlockDataHook for SwapMapper {
    fn read(&self, file: &File, off: u64, gpa: u64, len: u64) -> io::Result<bool> {
        self.read_impl(file, off, gpa, len)
    }

    fn before_change(&self, file: &File, off: u64, len: u64) -> io::Result<()> {
        self.before_change_impl(file, off, len)
    }
}

impl PageDiscard for SwapMapper {
    fn discard(&self, gpa: u64, len: u64) -> Result<(), MemError> {
        if !self.active {
            return self.ram.discard(gpa, len);
        }
        self.discard_impl(gpa, len)
    }
}

impl DmaObserver for SwapMapper {
    fn observe(&self, _dev: DeviceId, gpa: u64, len: u64, access: Access) {
        if access == Access::Write && self.active && self.mapped.load(Ordering::Relaxed) > 0 {
            self.observe_write(gpa, len);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LO: u64 = 0;
    const HI: u64 = 64 * PAGE;

    fn set(st: &mut State, s: u64, e: u64, key: Key) {
        SwapMapper::set_layout(st, s * PAGE, e * PAGE, LO, HI, key);
    }

    /// The layout model (used to predict VMA counts where PROCMAP_QUERY is missing and for the
    /// budget check): extents merge like the kernel merges VMAs.
    #[test]
    fn vma_model_splits_and_merges() {
        let mut st = State {
            vmas: 1,
            ..Default::default()
        };
        // One page mapped in the middle: anon | file | anon.
        set(&mut st, 10, 11, Some((0, 100 * PAGE - 10 * PAGE)));
        assert_eq!(st.vmas, 3);
        // The next page at the next offset merges.
        set(&mut st, 11, 12, Some((0, 100 * PAGE - 10 * PAGE)));
        assert_eq!(st.vmas, 3);
        assert_eq!(st.layout.len(), 1);
        // Another offset right after: a new VMA.
        set(&mut st, 12, 13, Some((0, 5 * PAGE)));
        assert_eq!(st.vmas, 4);
        // Another image at the region start: no anon VMA before it.
        set(&mut st, 0, 2, Some((1, 0)));
        assert_eq!(st.vmas, 5);
        // Anonymous over the first page of the first extent joins the anonymous VMA before it.
        set(&mut st, 10, 11, None);
        assert_eq!(st.vmas, 5);
        // Anonymous inside an extent splits it.
        set(&mut st, 30, 40, Some((3, 0)));
        assert_eq!(st.vmas, 7);
        set(&mut st, 34, 35, None);
        assert_eq!(st.vmas, 9);
        // Everything anonymous again: one VMA.
        set(&mut st, 0, 64, None);
        assert_eq!(st.vmas, 1);
        assert!(st.layout.is_empty());
        // The same remap twice changes nothing the second time.
        set(&mut st, 20, 30, Some((2, 0)));
        let v = st.vmas;
        set(&mut st, 22, 25, Some((2, 0)));
        assert_eq!(st.vmas, v);
        assert_eq!(st.layout.len(), 1);
        assert_eq!(SwapMapper::key_at(&st, 24 * PAGE), Some((2, 0)));
        assert_eq!(SwapMapper::key_at(&st, 30 * PAGE), None);
    }
}
