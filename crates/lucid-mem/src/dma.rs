//! The one DMA path. Every device reads and writes guest memory through a [`DmaPath`], so that a
//! vIOMMU can translate device addresses (IOVA to guest-physical, with permission checks and
//! faults) and observers such as the VSWAPPER Swap Mapper can see which guest pages a device
//! filled. With neither installed, an access is a bounds-checked copy.
//!
//! Two ways in: [`DmaPath::read`]/[`DmaPath::write`] copy a device's data, and
//! [`DmaPath::device_memory`] gives a device a [`DeviceMemory`], a `vm_memory::GuestMemory` in
//! that device's address space for virtio-queue's rings. Both translate through the same
//! translator, so there is one translation point for every guest-memory access a device makes.

use std::collections::HashSet;
use std::iter::FusedIterator;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};

use lucid_stats::{Counter, StatsRegistry};
use vm_memory::bitmap::BS;
use vm_memory::guest_memory::{GuestMemoryBackendSliceIterator, GuestMemorySliceIterator};
use vm_memory::{
    Bytes, GuestAddress, GuestMemory, GuestMemoryBackend, GuestMemoryError, GuestMemoryResult,
    Permissions, VolatileSlice,
};

use crate::GuestMemoryMmap;

/// Who is doing DMA: a PCI requester ID (bus << 8 | devfn) or a platform device number.
pub type DeviceId = u32;

/// Direction from the device's point of view.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    /// The device reads guest memory (e.g. a disk write request's data).
    Read,
    /// The device writes guest memory (e.g. a disk read request's data).
    Write,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DmaError {
    #[error("device {dev:#x}: DMA {access:?} at {addr:#x}+{len:#x} is outside guest memory")]
    OutOfRange {
        dev: DeviceId,
        addr: u64,
        len: u64,
        access: Access,
    },
    #[error("device {dev:#x}: DMA while bus mastering is disabled")]
    BusMasterOff { dev: DeviceId },
    #[error("device {dev:#x}: DMA {access:?} at {addr:#x}+{len:#x} translates to {gpa:#x}, which is not guest RAM")]
    Unbacked {
        dev: DeviceId,
        addr: u64,
        len: u64,
        gpa: u64,
        access: Access,
    },
    #[error("device {dev:#x}: DMA {access:?} at IOVA {iova:#x} faulted: {reason}")]
    Fault {
        dev: DeviceId,
        iova: u64,
        access: Access,
        reason: FaultReason,
    },
}

/// Why a translator refused an address.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FaultReason {
    #[error("not mapped")]
    NotMapped,
    #[error("access not permitted")]
    Denied,
}

/// Translates a device address to guest-physical (the vIOMMU's hook).
pub trait DmaTranslator: Send + Sync {
    /// Returns the guest-physical address of `iova` and how many bytes from there are contiguous
    /// (at least 1, at most `len`).
    fn translate(
        &self,
        dev: DeviceId,
        iova: u64,
        len: u64,
        access: Access,
    ) -> Result<(u64, u64), DmaError>;

    /// Brackets one device access (translate + copy). The pin policy must not unpin a page
    /// translated inside a bracket until that bracket ends. Default: no tracking.
    fn access_begin(&self) -> u64 {
        0
    }

    /// Ends the bracket `access_begin` returned `token` for.
    fn access_end(&self, _token: u64) {}
}

/// One open access bracket; ends it when dropped, so early returns and `?` end it too.
struct Bracket<'t> {
    translator: &'t dyn DmaTranslator,
    token: u64,
}

impl<'t> Bracket<'t> {
    fn begin(translator: &'t dyn DmaTranslator) -> Self {
        Bracket {
            translator,
            token: translator.access_begin(),
        }
    }
}

impl Drop for Bracket<'_> {
    fn drop(&mut self) {
        self.translator.access_end(self.token);
    }
}

/// Sees every completed data access through [`DmaPath::read`]/[`DmaPath::write`], by
/// guest-physical range (the Swap Mapper's hook). Ring accesses through [`DeviceMemory`] are not
/// reported.
pub trait DmaObserver: Send + Sync {
    fn observe(&self, dev: DeviceId, gpa: u64, len: u64, access: Access);
}

struct DmaCounters {
    reads: Arc<Counter>,
    writes: Arc<Counter>,
    bytes_read: Arc<Counter>,
    bytes_written: Arc<Counter>,
    errors: Arc<Counter>,
}

pub struct DmaPath {
    mem: GuestMemoryMmap,
    translator: RwLock<Option<Arc<dyn DmaTranslator>>>,
    /// Mirrors `translator.is_some()`: without a translator, data and rings pay this one load.
    translating: AtomicBool,
    observers: RwLock<Vec<Arc<dyn DmaObserver>>>,
    /// Devices whose bus mastering is off (PCI command register): their DMA fails.
    blocked: RwLock<HashSet<DeviceId>>,
    /// Fast path: false while no device is blocked, so the common case takes no lock.
    any_blocked: AtomicBool,
    counters: DmaCounters,
}

impl DmaPath {
    pub fn new(mem: GuestMemoryMmap, stats: &StatsRegistry) -> Arc<Self> {
        Arc::new(DmaPath {
            mem,
            translator: RwLock::new(None),
            translating: AtomicBool::new(false),
            observers: RwLock::new(Vec::new()),
            blocked: RwLock::new(HashSet::new()),
            any_blocked: AtomicBool::new(false),
            counters: DmaCounters {
                reads: stats.counter("dma.reads"),
                writes: stats.counter("dma.writes"),
                bytes_read: stats.counter("dma.bytes_read"),
                bytes_written: stats.counter("dma.bytes_written"),
                errors: stats.counter("dma.errors"),
            },
        })
    }

    /// Installs (or removes) the translator; takes effect for the next access.
    pub fn set_translator(&self, t: Option<Arc<dyn DmaTranslator>>) {
        let mut slot = self.translator.write().unwrap_or_else(|e| e.into_inner());
        self.translating.store(t.is_some(), Ordering::Release);
        *slot = t;
    }

    /// Whether a translator is installed (device addresses are IOVAs, not guest-physical).
    #[inline]
    pub fn has_translator(&self) -> bool {
        self.translating.load(Ordering::Acquire)
    }

    /// A per-device view of guest memory in that device's IOVA space, for virtio-queue's rings.
    pub fn device_memory(self: &Arc<Self>, dev: DeviceId) -> DeviceMemory {
        DeviceMemory {
            dma: self.clone(),
            dev,
        }
    }

    /// The translator, if one is installed: one atomic load and no lock while there is none
    /// (every data access and ring access asks).
    #[inline]
    fn translator(&self) -> Option<Arc<dyn DmaTranslator>> {
        if !self.has_translator() {
            return None;
        }
        self.translator
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    pub fn add_observer(&self, o: Arc<dyn DmaObserver>) {
        self.observers
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .push(o);
    }

    /// Allows or refuses DMA by `dev` (a PCI function's bus-master enable).
    pub fn set_bus_master(&self, dev: DeviceId, enabled: bool) {
        let mut blocked = self.blocked.write().unwrap_or_else(|e| e.into_inner());
        if enabled {
            blocked.remove(&dev);
        } else {
            blocked.insert(dev);
        }
        self.any_blocked
            .store(!blocked.is_empty(), Ordering::Release);
    }

    /// Guest memory as the VMM itself sees it (for boot and for devices' own structures that the
    /// spec places in guest-physical space). Devices' data transfers use `read`/`write`.
    pub fn memory(&self) -> &GuestMemoryMmap {
        &self.mem
    }

    /// Device `dev` reads `buf.len()` bytes at device address `addr`.
    pub fn read(&self, dev: DeviceId, addr: u64, buf: &mut [u8]) -> Result<(), DmaError> {
        self.counters.reads.inc();
        self.access(dev, addr, buf.len() as u64, Access::Read, |gpa, off, n| {
            self.mem
                .read_slice(&mut buf[off..off + n], GuestAddress(gpa))
                .is_ok()
        })?;
        self.counters.bytes_read.add(buf.len() as u64);
        Ok(())
    }

    /// Device `dev` writes `buf` at device address `addr`.
    pub fn write(&self, dev: DeviceId, addr: u64, buf: &[u8]) -> Result<(), DmaError> {
        self.counters.writes.inc();
        self.access(dev, addr, buf.len() as u64, Access::Write, |gpa, off, n| {
            self.mem
                .write_slice(&buf[off..off + n], GuestAddress(gpa))
                .is_ok()
        })?;
        self.counters.bytes_written.add(buf.len() as u64);
        Ok(())
    }

    /// Device `dev` reads guest-physical `addr`, never translated: for platform devices whose
    /// DMA no vIOMMU sits in front of (QEMU's fw_cfg), still checked, counted and observed.
    pub fn read_physical(&self, dev: DeviceId, addr: u64, buf: &mut [u8]) -> Result<(), DmaError> {
        self.counters.reads.inc();
        let len = buf.len() as u64;
        self.access_as(dev, addr, len, Access::Read, false, |gpa, off, n| {
            self.mem
                .read_slice(&mut buf[off..off + n], GuestAddress(gpa))
                .is_ok()
        })?;
        self.counters.bytes_read.add(len);
        Ok(())
    }

    /// Device `dev` writes `buf` at guest-physical `addr`, never translated (see
    /// [`DmaPath::read_physical`]).
    pub fn write_physical(&self, dev: DeviceId, addr: u64, buf: &[u8]) -> Result<(), DmaError> {
        self.counters.writes.inc();
        let len = buf.len() as u64;
        self.access_as(dev, addr, len, Access::Write, false, |gpa, off, n| {
            self.mem
                .write_slice(&buf[off..off + n], GuestAddress(gpa))
                .is_ok()
        })?;
        self.counters.bytes_written.add(len);
        Ok(())
    }

    /// Splits the access into contiguous guest-physical chunks and runs `copy(gpa, offset, len)`
    /// on each.
    fn access(
        &self,
        dev: DeviceId,
        addr: u64,
        len: u64,
        access: Access,
        copy: impl FnMut(u64, usize, usize) -> bool,
    ) -> Result<(), DmaError> {
        self.access_as(dev, addr, len, access, true, copy)
    }

    /// [`DmaPath::access`], through the translator only when `translate` is set.
    fn access_as(
        &self,
        dev: DeviceId,
        addr: u64,
        len: u64,
        access: Access,
        translate: bool,
        mut copy: impl FnMut(u64, usize, usize) -> bool,
    ) -> Result<(), DmaError> {
        let out_of_range = || DmaError::OutOfRange {
            dev,
            addr,
            len,
            access,
        };
        if addr.checked_add(len).is_none() {
            self.counters.errors.inc();
            return Err(out_of_range());
        }
        if self.any_blocked.load(Ordering::Acquire)
            && self
                .blocked
                .read()
                .unwrap_or_else(|e| e.into_inner())
                .contains(&dev)
        {
            self.counters.errors.inc();
            return Err(DmaError::BusMasterOff { dev });
        }
        let translator = self.translator().filter(|_| translate);
        // Begins before the first translation, ends after the last copy (or the error).
        let _bracket = translator.as_deref().map(Bracket::begin);
        let observers = self.observers.read().unwrap_or_else(|e| e.into_inner());
        let mut done = 0u64;
        while done < len {
            let (gpa, n) = match &translator {
                Some(t) => t
                    .translate(dev, addr + done, len - done, access)
                    .inspect_err(|_| self.counters.errors.inc())?,
                None => (addr + done, len - done),
            };
            let n = n.clamp(1, len - done);
            if !copy(gpa, done as usize, n as usize) {
                self.counters.errors.inc();
                return Err(if translator.is_some() {
                    DmaError::Unbacked {
                        dev,
                        addr,
                        len,
                        gpa,
                        access,
                    }
                } else {
                    out_of_range()
                });
            }
            for o in observers.iter() {
                o.observe(dev, gpa, n, access);
            }
            done += n;
        }
        Ok(())
    }
}

/// A device's view of guest memory in its own address space (IOVAs when a translator is
/// installed, guest-physical otherwise), for virtio-queue's rings: it implements
/// `vm_memory::GuestMemory` (vm-memory 0.18's IOVA-aware trait), so `Bytes<GuestAddress>`
/// (`read_obj`, `load`, `store`, ...) and virtio-queue's `Queue` work on it directly.
///
/// Without a translator an access costs one atomic load, then guest RAM's own slices; hot code
/// that wants exactly the `GuestMemoryMmap` code (the virtio worker) calls `physical_memory()`,
/// which gives guest RAM only while no translator is installed. With one, `get_slices`
/// translates the range piece by piece (splitting wherever the translator's contiguous length
/// ends), asks for the access's permission, and yields slices of the underlying guest RAM; a translation fault ends the iteration with
/// `GuestMemoryError::InvalidGuestAddress(iova)` and counts in `dma.errors`.
///
/// Access bracket: one `get_slices` (or `check_range`) call is one bracket. It begins before the
/// first translation and ends when the returned iterator is dropped, so every use of the slices
/// made while iterating is inside it: all of vm-memory's `Bytes` methods and so every
/// virtio-queue ring access. A slice kept after its iterator is dropped is outside the bracket
/// (virtio-queue keeps none).
///
/// Ring accesses are not [`DmaObserver`] events: observers (the Swap Mapper) are for the data a
/// device moves through [`DmaPath::read`]/[`DmaPath::write`], and the rings' few bytes per
/// request would only add cost. Bus mastering is likewise checked on data only.
#[derive(Clone)]
pub struct DeviceMemory {
    dma: Arc<DmaPath>,
    dev: DeviceId,
}

impl std::fmt::Debug for DeviceMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceMemory")
            .field("dev", &self.dev)
            .field("translated", &self.dma.has_translator())
            .finish()
    }
}

impl DeviceMemory {
    /// The requester this view translates for.
    pub fn device(&self) -> DeviceId {
        self.dev
    }

    /// The DMA path behind this view.
    #[inline]
    pub fn dma(&self) -> &Arc<DmaPath> {
        &self.dma
    }

    /// `get_slices` with a translator, out of line so that the fast path stays small.
    #[cold]
    #[inline(never)]
    fn translated_slices(
        &self,
        addr: GuestAddress,
        count: usize,
        perm: Permissions,
    ) -> DeviceSlices<'_> {
        // Removed since the caller looked: guest RAM it is.
        let Some(translator) = self.dma.translator() else {
            return DeviceSlices {
                piece: GuestMemoryBackend::get_slices(&self.dma.mem, addr, count),
                translated: None,
            };
        };
        let token = translator.access_begin();
        DeviceSlices {
            piece: GuestMemoryBackend::get_slices(&self.dma.mem, GuestAddress(0), 0),
            translated: Some(Box::new(Translated {
                mem: self,
                translator,
                token,
                iova: addr.0,
                left: count as u64,
                perm,
            })),
        }
    }

    /// Translates `[addr, addr + count)` piece by piece with the permission `perm` asks for,
    /// calling `f(gpa, len)` on each piece; stops at the first fault or `false` from `f`.
    fn translate_range(
        &self,
        t: &dyn DmaTranslator,
        addr: u64,
        count: u64,
        perm: Permissions,
        mut f: impl FnMut(u64, u64) -> bool,
    ) -> bool {
        let mut done = 0u64;
        while done < count {
            match translate_piece(t, self.dev, addr + done, count - done, perm) {
                Ok((gpa, n)) => {
                    if !f(gpa, n) {
                        return false;
                    }
                    done += n;
                }
                Err(_) => {
                    self.dma.counters.errors.inc();
                    return false;
                }
            }
        }
        true
    }
}

/// One translation for `perm`: both directions for `ReadWrite`, which must agree; `No` asks
/// only that the page be mapped (checked as a read).
fn translate_piece(
    t: &dyn DmaTranslator,
    dev: DeviceId,
    iova: u64,
    len: u64,
    perm: Permissions,
) -> Result<(u64, u64), DmaError> {
    let access = match perm {
        Permissions::Write | Permissions::ReadWrite => Access::Write,
        Permissions::Read | Permissions::No => Access::Read,
    };
    let (gpa, n) = t.translate(dev, iova, len, access)?;
    let mut n = n.clamp(1, len);
    if perm == Permissions::ReadWrite {
        let (gpa_r, n_r) = t.translate(dev, iova, n, Access::Read)?;
        if gpa_r != gpa {
            return Err(DmaError::Fault {
                dev,
                iova,
                access: Access::Read,
                reason: FaultReason::Denied,
            });
        }
        n = n.min(n_r.max(1));
    }
    Ok((gpa, n))
}

impl GuestMemory for DeviceMemory {
    type PhysicalMemory = GuestMemoryMmap;
    type Bitmap = ();

    fn check_range(&self, addr: GuestAddress, count: usize, access: Permissions) -> bool {
        let Some(t) = self.dma.translator() else {
            return GuestMemoryBackend::check_range(&self.dma.mem, addr, count);
        };
        if addr.0.checked_add(count as u64).is_none() {
            return false;
        }
        let _bracket = Bracket::begin(&*t);
        self.translate_range(&*t, addr.0, count as u64, access, |gpa, n| {
            GuestMemoryBackend::check_range(&self.dma.mem, GuestAddress(gpa), n as usize)
        })
    }

    #[inline]
    fn get_slices<'a>(
        &'a self,
        addr: GuestAddress,
        count: usize,
        access: Permissions,
    ) -> GuestMemoryResult<impl GuestMemorySliceIterator<'a, BS<'a, Self::Bitmap>>> {
        if self.dma.has_translator() {
            return Ok(self.translated_slices(addr, count, access));
        }
        Ok(DeviceSlices {
            piece: GuestMemoryBackend::get_slices(&self.dma.mem, addr, count),
            translated: None,
        })
    }

    /// Guest RAM itself, only while no translator is installed (with one, the device's
    /// addresses are not guest-physical). virtio-queue 0.18 does not call it.
    #[inline]
    fn physical_memory(&self) -> Option<&Self::PhysicalMemory> {
        if self.dma.has_translator() {
            None
        } else {
            Some(&self.dma.mem)
        }
    }
}

/// The slices of one `DeviceMemory::get_slices` call: guest RAM's own iterator over the
/// current piece (the whole range without a translator), and the translation state, boxed so
/// that the fast path's iterator stays as small as guest RAM's.
struct DeviceSlices<'a> {
    piece: GuestMemoryBackendSliceIterator<'a, GuestMemoryMmap>,
    translated: Option<Box<Translated<'a>>>,
}

/// The rest of a translated range, inside one access bracket that ends on drop.
struct Translated<'a> {
    mem: &'a DeviceMemory,
    translator: Arc<dyn DmaTranslator>,
    token: u64,
    /// The next IOVA to translate and how many bytes are left from it.
    iova: u64,
    left: u64,
    perm: Permissions,
}

impl<'a> DeviceSlices<'a> {
    /// The fast path's continuation: the current piece is done or failed.
    #[cold]
    fn next_piece(
        &mut self,
        ended: Option<GuestMemoryError>,
    ) -> Option<GuestMemoryResult<VolatileSlice<'a, ()>>> {
        let t = self.translated.as_mut()?;
        if let Some(e) = ended {
            // Translated to a guest-physical address that is not RAM.
            return t.fail(e);
        }
        if t.left == 0 {
            return None;
        }
        let iova = t.iova;
        if iova.checked_add(t.left).is_none() {
            return t.fail(GuestMemoryError::GuestAddressOverflow);
        }
        let (gpa, n) = match translate_piece(&*t.translator, t.mem.dev, iova, t.left, t.perm) {
            Ok(r) => r,
            Err(e) => {
                log::debug!("{e}");
                return t.fail(GuestMemoryError::InvalidGuestAddress(GuestAddress(iova)));
            }
        };
        t.iova += n;
        t.left -= n;
        self.piece = GuestMemoryBackend::get_slices(&t.mem.dma.mem, GuestAddress(gpa), n as usize);
        match self.piece.next() {
            Some(Ok(s)) => Some(Ok(s)),
            Some(Err(e)) => self.translated.as_mut()?.fail(e),
            // A piece is at least 1 byte.
            None => None,
        }
    }
}

impl<'a> Translated<'a> {
    fn fail(&mut self, e: GuestMemoryError) -> Option<GuestMemoryResult<VolatileSlice<'a, ()>>> {
        self.mem.dma.counters.errors.inc();
        self.left = 0;
        Some(Err(e))
    }
}

impl<'a> Iterator for DeviceSlices<'a> {
    type Item = GuestMemoryResult<VolatileSlice<'a, ()>>;

    #[inline]
    fn next(&mut self) -> Option<Self::Item> {
        match self.piece.next() {
            Some(Ok(s)) => Some(Ok(s)),
            Some(Err(e)) if self.translated.is_none() => Some(Err(e)),
            Some(Err(e)) => self.next_piece(Some(e)),
            None => self.next_piece(None),
        }
    }
}

impl FusedIterator for DeviceSlices<'_> {}
impl<'a> GuestMemorySliceIterator<'a, ()> for DeviceSlices<'a> {}

impl Drop for Translated<'_> {
    fn drop(&mut self) {
        self.translator.access_end(self.token);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Backing, GuestRam};
    use std::sync::Mutex;

    /// `GuestMemory::check_range` of `dm` at `addr`.
    fn can(dm: &DeviceMemory, addr: u64, len: usize, perm: Permissions) -> bool {
        GuestMemory::check_range(dm, GuestAddress(addr), len, perm)
    }

    /// Maps IOVA page N to guest page N+1, 4 KiB at a time; page 7 faults.
    struct ShiftByOnePage;
    impl DmaTranslator for ShiftByOnePage {
        fn translate(
            &self,
            dev: DeviceId,
            iova: u64,
            len: u64,
            access: Access,
        ) -> Result<(u64, u64), DmaError> {
            if iova >> 12 == 7 {
                return Err(DmaError::Fault {
                    dev,
                    iova,
                    access,
                    reason: FaultReason::NotMapped,
                });
            }
            let in_page = 0x1000 - (iova & 0xfff);
            Ok((iova + 0x1000, len.min(in_page)))
        }
    }

    #[derive(Default)]
    struct Log(Mutex<Vec<(u64, u64, Access)>>);
    impl DmaObserver for Log {
        fn observe(&self, _dev: DeviceId, gpa: u64, len: u64, access: Access) {
            self.0.lock().unwrap().push((gpa, len, access));
        }
    }

    #[test]
    fn identity_translation_and_bounds() {
        let ram = GuestRam::new(&[(0, 1 << 20)], Backing::Anonymous).unwrap();
        let stats = StatsRegistry::new();
        let dma = DmaPath::new(ram.memory().clone(), &stats);
        dma.write(1, 0x100, b"hello").unwrap();
        let mut b = [0u8; 5];
        dma.read(1, 0x100, &mut b).unwrap();
        assert_eq!(&b, b"hello");
        assert!(dma.write(1, (1 << 20) - 2, b"abcd").is_err());
        assert!(dma.read(1, u64::MAX - 1, &mut b).is_err());
        assert_eq!(stats.snapshot()["dma.errors"], 2);
        assert_eq!(stats.snapshot()["dma.bytes_written"], 5);
        dma.set_bus_master(1, false);
        assert_eq!(
            dma.read(1, 0x100, &mut b),
            Err(DmaError::BusMasterOff { dev: 1 })
        );
        dma.read(2, 0x100, &mut b).unwrap();
        dma.set_bus_master(1, true);
        dma.read(1, 0x100, &mut b).unwrap();
    }

    #[test]
    fn translator_splits_and_observers_see_gpas() {
        let ram = GuestRam::new(&[(0, 1 << 20)], Backing::Anonymous).unwrap();
        let dma = DmaPath::new(ram.memory().clone(), &StatsRegistry::new());
        let log = Arc::new(Log::default());
        dma.set_translator(Some(Arc::new(ShiftByOnePage)));
        dma.add_observer(log.clone());
        dma.write(3, 0x1ff0, &[7u8; 0x20]).unwrap();
        assert_eq!(
            *log.0.lock().unwrap(),
            vec![(0x2ff0, 0x10, Access::Write), (0x3000, 0x10, Access::Write)]
        );
        let mut b = [0u8; 1];
        dma.set_translator(None);
        dma.read(3, 0x3000, &mut b).unwrap();
        assert_eq!(b[0], 7);
        dma.set_translator(Some(Arc::new(ShiftByOnePage)));
        assert!(matches!(
            dma.read(3, 0x7000, &mut b),
            Err(DmaError::Fault { .. })
        ));
    }
    /// A page table for DeviceMemory tests: IOVA page -> (guest page, writable), with open and
    /// total bracket counts.
    #[derive(Default)]
    struct PageTable {
        pages: Mutex<std::collections::HashMap<u64, (u64, bool)>>,
        begun: std::sync::atomic::AtomicU64,
        ended: std::sync::atomic::AtomicU64,
        /// Translations made outside any bracket.
        unbracketed: std::sync::atomic::AtomicU64,
    }

    impl PageTable {
        fn map(&self, iova_page: u64, gpa_page: u64, writable: bool) {
            self.pages
                .lock()
                .unwrap()
                .insert(iova_page, (gpa_page, writable));
        }
        fn open(&self) -> u64 {
            self.begun.load(Ordering::SeqCst) - self.ended.load(Ordering::SeqCst)
        }
    }

    impl DmaTranslator for PageTable {
        fn translate(
            &self,
            dev: DeviceId,
            iova: u64,
            len: u64,
            access: Access,
        ) -> Result<(u64, u64), DmaError> {
            if self.open() == 0 {
                self.unbracketed.fetch_add(1, Ordering::SeqCst);
            }
            let fault = |reason| DmaError::Fault {
                dev,
                iova,
                access,
                reason,
            };
            let (gpa_page, writable) = *self
                .pages
                .lock()
                .unwrap()
                .get(&(iova >> 12))
                .ok_or(fault(FaultReason::NotMapped))?;
            if access == Access::Write && !writable {
                return Err(fault(FaultReason::Denied));
            }
            let in_page = 0x1000 - (iova & 0xfff);
            Ok(((gpa_page << 12) | (iova & 0xfff), len.min(in_page)))
        }
        fn access_begin(&self) -> u64 {
            self.begun.fetch_add(1, Ordering::SeqCst) + 1
        }
        fn access_end(&self, token: u64) {
            assert_ne!(token, 0, "a bracket ended that never began");
            self.ended.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn translated() -> (GuestRam, Arc<DmaPath>, Arc<PageTable>, Arc<StatsRegistry>) {
        let ram = GuestRam::new(&[(0, 1 << 20)], Backing::Anonymous).unwrap();
        let stats = StatsRegistry::new();
        let dma = DmaPath::new(ram.memory().clone(), &stats);
        let pt = Arc::new(PageTable::default());
        // IOVA 0x100000.. (outside RAM) -> scattered guest pages; 0x102000 read-only.
        pt.map(0x100, 0x20, true);
        pt.map(0x101, 0x10, true);
        pt.map(0x102, 0x30, false);
        // Maps to a guest-physical page that is not RAM.
        pt.map(0x104, 0x400, true);
        dma.set_translator(Some(pt.clone()));
        (ram, dma, pt, stats)
    }

    #[test]
    fn device_memory_without_translator_is_guest_ram() {
        let ram = GuestRam::new(&[(0, 1 << 20)], Backing::Anonymous).unwrap();
        let dma = DmaPath::new(ram.memory().clone(), &StatsRegistry::new());
        let dm = dma.device_memory(5);
        assert!(!dma.has_translator());
        assert!(dm.physical_memory().is_some());
        dm.write_obj(0xabcdu16, GuestAddress(0x2000)).unwrap();
        assert_eq!(
            ram.memory().read_obj::<u16>(GuestAddress(0x2000)).unwrap(),
            0xabcd
        );
        assert!(can(&dm, 0xff000, 0x1000, Permissions::Write));
        assert!(!can(&dm, 0xff000, 0x1001, Permissions::Read));
        assert!(dm.read_obj::<u64>(GuestAddress(1 << 20)).is_err());
    }

    #[test]
    fn device_memory_splits_at_translation_boundaries() {
        let (ram, dma, pt, stats) = translated();
        let dm = dma.device_memory(5);
        assert!(dma.has_translator());
        assert!(dm.physical_memory().is_none());
        // 0x20 bytes across IOVA pages 0x100 and 0x101: two slices, in two guest pages.
        let data: Vec<u8> = (0..0x20).collect();
        let mut it = dm
            .get_slices(GuestAddress(0x100ff0), 0x20, Permissions::Write)
            .unwrap();
        let lens: Vec<usize> = it.by_ref().map(|s| s.unwrap().len()).collect();
        assert_eq!(lens, [0x10, 0x10]);
        assert!(it.next().is_none());
        assert_eq!(pt.open(), 1, "the bracket lasts as long as the iterator");
        drop(it);
        assert_eq!(pt.open(), 0);
        dm.write_slice(&data, GuestAddress(0x100ff0)).unwrap();
        let mem = ram.memory();
        let mut lo = [0u8; 0x10];
        let mut hi = [0u8; 0x10];
        mem.read_slice(&mut lo, GuestAddress(0x20ff0)).unwrap();
        mem.read_slice(&mut hi, GuestAddress(0x10000)).unwrap();
        assert_eq!(&lo[..], &data[..0x10]);
        assert_eq!(&hi[..], &data[0x10..]);
        let mut back = [0u8; 0x20];
        dm.read_slice(&mut back, GuestAddress(0x100ff0)).unwrap();
        assert_eq!(&back[..], &data[..]);
        assert_eq!(stats.snapshot()["dma.errors"], 0);
        assert_eq!(pt.open(), 0);
        assert_eq!(pt.unbracketed.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn device_memory_permissions_and_faults() {
        let (ram, dma, pt, stats) = translated();
        let dm = dma.device_memory(5);
        ram.memory()
            .write_obj(0x1234u16, GuestAddress(0x30010))
            .unwrap();
        // Read-only page: reads work, writes are denied and leave memory alone.
        assert_eq!(dm.read_obj::<u16>(GuestAddress(0x102010)).unwrap(), 0x1234);
        assert!(matches!(
            dm.write_obj(0u16, GuestAddress(0x102010)),
            Err(GuestMemoryError::InvalidGuestAddress(GuestAddress(
                0x102010
            )))
        ));
        assert!(dm
            .store(
                0u16,
                GuestAddress(0x102010),
                std::sync::atomic::Ordering::Relaxed
            )
            .is_err());
        assert!(dm
            .get_slices(GuestAddress(0x102000), 4, Permissions::ReadWrite)
            .unwrap()
            .next()
            .unwrap()
            .is_err());
        assert_eq!(
            ram.memory().read_obj::<u16>(GuestAddress(0x30010)).unwrap(),
            0x1234
        );
        assert!(can(&dm, 0x102000, 0x1000, Permissions::Read));
        assert!(!can(&dm, 0x102000, 0x1000, Permissions::Write));
        // Unmapped IOVA (inside guest RAM's physical range: no identity fallback), and a
        // mapping onto non-RAM.
        assert!(dm.read_obj::<u32>(GuestAddress(0x1000)).is_err());
        assert!(dm.read_obj::<u32>(GuestAddress(0x103000)).is_err());
        assert!(dm.read_obj::<u32>(GuestAddress(0x104000)).is_err());
        assert!(dm.read_obj::<u32>(GuestAddress(u64::MAX - 1)).is_err());
        // A range that runs from a mapped page into an unmapped one: the first slice is
        // given, then the fault ends the iteration.
        let items: Vec<_> = dm
            .get_slices(GuestAddress(0x102ff8), 0x10, Permissions::Read)
            .unwrap()
            .collect();
        assert_eq!(items.len(), 2);
        assert!(items[0].is_ok() && items[1].is_err());
        drop(items);
        let mut buf = [0u8; 0x10];
        assert!(matches!(
            dm.read_slice(&mut buf, GuestAddress(0x102ff8)),
            Err(GuestMemoryError::PartialBuffer { completed: 8, .. })
        ));
        assert_eq!(stats.snapshot()["dma.errors"], 10);
        // Every bracket ended, on the error paths too, and no translation was outside one.
        assert_eq!(pt.open(), 0);
        assert!(pt.begun.load(Ordering::SeqCst) >= 10);
        assert_eq!(pt.unbracketed.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn ring_through_device_memory() {
        // A split-ring used ring (flags, idx, 4 elements of id/len) at an IOVA that crosses
        // from page 0x100 into page 0x101, written and read with vm-memory's Bytes API.
        let (ram, dma, pt, _stats) = translated();
        let dm = dma.device_memory(9);
        let used = GuestAddress(0x100ff8);
        dm.write_obj(0u16, used).unwrap();
        for i in 0..4u32 {
            let e = used.0 + 4 + 8 * u64::from(i);
            dm.write_obj(i.to_le(), GuestAddress(e)).unwrap();
            dm.write_obj((100 + i).to_le(), GuestAddress(e + 4))
                .unwrap();
        }
        dm.store(
            4u16.to_le(),
            GuestAddress(used.0 + 2),
            std::sync::atomic::Ordering::Release,
        )
        .unwrap();
        let mem = ram.memory();
        // idx at IOVA 0x100ffa -> 0x20ffa; element 1 (IOVA 0x101004) -> 0x10004.
        assert_eq!(mem.read_obj::<u16>(GuestAddress(0x20ffa)).unwrap(), 4);
        assert_eq!(mem.read_obj::<u32>(GuestAddress(0x10004)).unwrap(), 1);
        assert_eq!(mem.read_obj::<u32>(GuestAddress(0x10008)).unwrap(), 101);
        assert_eq!(
            dm.load::<u16>(
                GuestAddress(used.0 + 2),
                std::sync::atomic::Ordering::Acquire
            )
            .unwrap(),
            4
        );
        // Element 0 spans the page boundary (IOVA 0x100ffc..0x101004): read_obj splits it.
        assert_eq!(
            dm.read_obj::<u64>(GuestAddress(0x100ffc)).unwrap(),
            100 << 32
        );
        assert_eq!(pt.open(), 0);
    }

    #[test]
    fn dma_path_brackets_every_access() {
        let (_ram, dma, pt, _stats) = translated();
        dma.write(5, 0x100ff0, &[1u8; 0x20]).unwrap();
        let mut b = [0u8; 0x20];
        dma.read(5, 0x100ff0, &mut b).unwrap();
        assert!(dma.write(5, 0x101ff0, &[1u8; 0x20]).is_err()); // read-only second page
        assert!(dma.read(5, 0x103000, &mut b).is_err()); // unmapped
        assert!(dma.read(5, 0x104000, &mut b).is_err()); // not RAM
        assert_eq!(pt.begun.load(Ordering::SeqCst), 5);
        assert_eq!(pt.open(), 0);
        assert_eq!(pt.unbracketed.load(Ordering::SeqCst), 0);
        // No translator: no bracket.
        dma.set_translator(None);
        dma.read(5, 0x1000, &mut b).unwrap();
        assert_eq!(pt.begun.load(Ordering::SeqCst), 5);
    }
}
