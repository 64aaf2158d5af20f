//! The device's view of guest memory: exactly the ranges its VMM mapped with `DMA_MAP`, each an
//! `mmap` of the descriptor that came with the message, gone at `DMA_UNMAP`. What the VMM did
//! not map, or mapped read-only and the device writes, is refused (no byte moved), recorded in
//! the fault log (region 9) and signalled on the ERR eventfd, before the reply to the message
//! that started the DMA.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Write;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};

use lucid_mem::{Access, DeviceId, DmaError, FaultReason};
use lucid_pci::EduDma;
use vfio_user::{DmaMapFlags, DmaUnmapFlags};
use vm_memory::VolatileSlice;

/// The fault log region's size.
pub const FAULT_LOG_SIZE: usize = 4096;
/// Records in the fault log's ring.
pub const FAULT_RECORDS: usize = 64;
/// Where the ring starts (after the u32 `total` and 4 bytes of padding).
pub const FAULT_RING: usize = 8;
/// Bytes per record: u64 iova, u32 len, u32 flags.
pub const FAULT_RECORD_SIZE: usize = 16;
/// Fault flag: the device wanted to write RAM.
pub const FAULT_WRITE: u32 = 1 << 0;
/// Fault flag: the IOVA was mapped, read-only.
pub const FAULT_READ_ONLY: u32 = 1 << 1;

/// One refused access as the fault log has it: the first refused byte's IOVA and the bytes
/// from there to the end of the access.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FaultRecord {
    pub iova: u64,
    pub len: u32,
    pub flags: u32,
}

/// What the table did, for the server's summary and for tests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DmaStats {
    /// `DMA_MAP`s that mapped.
    pub maps: u64,
    /// `DMA_UNMAP`s that unmapped.
    pub unmaps: u64,
    /// Bytes the device read from RAM.
    pub bytes_read: u64,
    /// Bytes the device wrote to RAM.
    pub bytes_written: u64,
    /// Accesses refused (outside the mappings, to a read-only mapping, or with bus mastering
    /// off).
    pub refused: u64,
}

impl std::fmt::Display for DmaStats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "maps={} unmaps={} bytes_read={} bytes_written={} refused={}",
            self.maps, self.unmaps, self.bytes_read, self.bytes_written, self.refused
        )
    }
}

/// Why a `DMA_MAP` or `DMA_UNMAP` was refused (the client gets an error reply).
#[derive(Debug, thiserror::Error)]
pub enum MapError {
    #[error("DMA_MAP of {iova:#x}+{size:#x} without a file descriptor (DMA_READ/DMA_WRITE messages are not supported)")]
    NoFd { iova: u64, size: u64 },
    #[error("DMA_MAP of {iova:#x}+{size:#x} with flags {flags:#x}: READ and/or WRITE only")]
    Flags { iova: u64, size: u64, flags: u32 },
    #[error("DMA_MAP of {iova:#x}+{size:#x} at file offset {offset:#x}: empty, wrapping, or an offset not page-aligned")]
    Range { iova: u64, size: u64, offset: u64 },
    #[error("DMA_MAP of {iova:#x}+{size:#x} at file offset {offset:#x} runs past the file's {file_size} bytes")]
    PastEnd {
        iova: u64,
        size: u64,
        offset: u64,
        file_size: u64,
    },
    #[error("DMA_MAP of {iova:#x}+{size:#x} overlaps the mapping at {at:#x}")]
    Overlap { iova: u64, size: u64, at: u64 },
    #[error("DMA_MAP of {iova:#x}+{size:#x}: mmap failed")]
    Mmap {
        iova: u64,
        size: u64,
        #[source]
        source: std::io::Error,
    },
    #[error("DMA_UNMAP of {iova:#x}+{size:#x}: nothing is mapped there")]
    NotMapped { iova: u64, size: u64 },
    #[error("DMA_UNMAP of {iova:#x}+{size:#x} splits the mapping at {at:#x} off a page boundary")]
    Split { iova: u64, size: u64, at: u64 },
    #[error("DMA_UNMAP with flags {0:#x}: only UNMAP_ALL is supported")]
    UnmapFlags(u32),
}

impl From<MapError> for std::io::Error {
    fn from(e: MapError) -> Self {
        let kind = match e {
            MapError::Mmap { ref source, .. } => source.kind(),
            _ => std::io::ErrorKind::InvalidInput,
        };
        std::io::Error::new(kind, e)
    }
}

/// One `mmap` of a client's descriptor; unmapped when dropped.
struct Mapping {
    addr: usize,
    len: usize,
    readable: bool,
    writable: bool,
}

// SAFETY: the mapping is process memory shared with the VMM; it is touched only through
// volatile copies made while the table's lock is held, from any thread.
unsafe impl Send for Mapping {}

impl Mapping {
    fn new(
        fd: &File,
        offset: u64,
        size: u64,
        readable: bool,
        writable: bool,
    ) -> std::io::Result<Self> {
        let len = usize::try_from(size).map_err(|_| std::io::ErrorKind::InvalidInput)?;
        let off = libc::off_t::try_from(offset).map_err(|_| std::io::ErrorKind::InvalidInput)?;
        let prot = libc::PROT_READ | if writable { libc::PROT_WRITE } else { 0 };
        // SAFETY: a fresh shared mapping of the client's descriptor at an address the kernel
        // picks; nothing else in the process refers to it.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                prot,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                off,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Mapping {
            addr: p as usize,
            len,
            readable,
            writable,
        })
    }

    /// `len` bytes from `off` in the mapping, which the caller checked are inside it.
    fn slice(&self, off: usize, len: usize) -> VolatileSlice<'_> {
        debug_assert!(off + len <= self.len);
        // SAFETY: `off..off + len` is inside the live mapping, which outlives the slice.
        unsafe { VolatileSlice::new((self.addr + off) as *mut u8, len) }
    }

    /// Splits off `[at, len)` (a page-aligned `at`) into a mapping of its own.
    fn split_off(&mut self, at: usize) -> Mapping {
        let tail = Mapping {
            addr: self.addr + at,
            len: self.len - at,
            readable: self.readable,
            writable: self.writable,
        };
        self.len = at;
        tail
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: this struct alone owns `addr..addr + len` of a mapping this table made.
        if unsafe { libc::munmap(self.addr as *mut libc::c_void, self.len) } != 0 {
            log::warn!(
                "munmap of {:#x}+{:#x}: {}",
                self.addr,
                self.len,
                std::io::Error::last_os_error()
            );
        }
    }
}

struct Inner {
    /// Mappings by IOVA; none overlap.
    maps: BTreeMap<u64, Mapping>,
    log: Box<[u8; FAULT_LOG_SIZE]>,
    total: u32,
    err: Option<File>,
}

#[derive(Default)]
struct Counters {
    maps: AtomicU64,
    unmaps: AtomicU64,
    bytes_read: AtomicU64,
    bytes_written: AtomicU64,
    refused: AtomicU64,
}

/// The DMA mappings a vfio-user client gave the device, its fault log and its ERR eventfd.
pub struct DmaTable {
    inner: Mutex<Inner>,
    bus_master: AtomicBool,
    counters: Counters,
}

impl Default for DmaTable {
    fn default() -> Self {
        Self::new()
    }
}

fn page_size() -> u64 {
    // SAFETY: sysconf reads a constant.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    u64::try_from(p).unwrap_or(4096)
}

impl DmaTable {
    /// An empty table; bus mastering off until the config space's command register enables it.
    pub fn new() -> Self {
        DmaTable {
            inner: Mutex::new(Inner {
                maps: BTreeMap::new(),
                log: Box::new([0; FAULT_LOG_SIZE]),
                total: 0,
                err: None,
            }),
            bus_master: AtomicBool::new(false),
            counters: Counters::default(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// `DMA_MAP`: maps `size` bytes of `fd` at `offset` as IOVA `iova`, writable only with
    /// [`DmaMapFlags::WRITE`].
    pub fn map(
        &self,
        flags: DmaMapFlags,
        offset: u64,
        iova: u64,
        size: u64,
        fd: Option<&File>,
    ) -> Result<(), MapError> {
        let bits = flags.bits();
        let rw = DmaMapFlags::READ_WRITE.bits();
        if bits & !rw != 0 || bits == 0 {
            return Err(MapError::Flags {
                iova,
                size,
                flags: bits,
            });
        }
        let fd = fd.ok_or(MapError::NoFd { iova, size })?;
        let end = iova.checked_add(size);
        if size == 0 || end.is_none() || !offset.is_multiple_of(page_size()) {
            return Err(MapError::Range { iova, size, offset });
        }
        // An access past a file's end would fault the server (SIGBUS): refused at the map.
        if let Ok(m) = fd.metadata() {
            if m.is_file() && offset.checked_add(size).is_none_or(|e| e > m.len()) {
                return Err(MapError::PastEnd {
                    iova,
                    size,
                    offset,
                    file_size: m.len(),
                });
            }
        }
        let mut inner = self.lock();
        if let Some(at) = overlapping(&inner.maps, iova, size).next() {
            return Err(MapError::Overlap { iova, size, at });
        }
        let readable = flags.contains(DmaMapFlags::READ);
        let writable = flags.contains(DmaMapFlags::WRITE);
        let m = Mapping::new(fd, offset, size, readable, writable)
            .map_err(|source| MapError::Mmap { iova, size, source })?;
        inner.maps.insert(iova, m);
        self.counters.maps.fetch_add(1, Ordering::Relaxed);
        log::debug!("DMA_MAP {iova:#x}+{size:#x} fd offset {offset:#x} {flags:?}");
        Ok(())
    }

    /// `DMA_UNMAP`: unmaps `[iova, iova + size)`, or everything with
    /// [`DmaUnmapFlags::UNMAP_ALL`]. A mapping the range covers in part is split at page
    /// boundaries (its rest stays mapped); a range that splits one off a page boundary, or
    /// covers no mapping, is refused and unmaps nothing.
    pub fn unmap(&self, flags: DmaUnmapFlags, iova: u64, size: u64) -> Result<(), MapError> {
        let mut inner = self.lock();
        if flags == DmaUnmapFlags::UNMAP_ALL {
            inner.maps.clear();
            self.counters.unmaps.fetch_add(1, Ordering::Relaxed);
            return Ok(());
        }
        if flags.bits() != 0 {
            return Err(MapError::UnmapFlags(flags.bits()));
        }
        let end = iova
            .checked_add(size)
            .filter(|_| size > 0)
            .ok_or(MapError::NotMapped { iova, size })?;
        let hit: Vec<u64> = overlapping(&inner.maps, iova, size).collect();
        if hit.is_empty() {
            return Err(MapError::NotMapped { iova, size });
        }
        let page = page_size();
        for &at in &hit {
            let m_end = at + inner.maps[&at].len as u64;
            let cut_head = iova > at && !(iova - at).is_multiple_of(page);
            let cut_tail = end < m_end && !(end - at).is_multiple_of(page);
            if cut_head || cut_tail {
                return Err(MapError::Split { iova, size, at });
            }
        }
        for at in hit {
            let Some(mut m) = inner.maps.remove(&at) else {
                continue;
            };
            let m_end = at + m.len as u64;
            // Keep what lies outside the range; `m` is then the middle, dropped (unmapped).
            if end < m_end {
                let tail = m.split_off((end - at) as usize);
                inner.maps.insert(end, tail);
            }
            if iova > at {
                let middle = m.split_off((iova - at) as usize);
                inner.maps.insert(at, m);
                m = middle;
            }
            drop(m);
        }
        self.counters.unmaps.fetch_add(1, Ordering::Relaxed);
        log::debug!("DMA_UNMAP {iova:#x}+{size:#x}");
        Ok(())
    }

    /// Drops every mapping, the ERR eventfd and the fault log (a client went away).
    pub fn clear(&self) {
        let mut inner = self.lock();
        inner.maps.clear();
        inner.err = None;
        inner.log.fill(0);
        inner.total = 0;
        self.bus_master.store(false, Ordering::SeqCst);
    }

    /// The ERR eventfd (SET_IRQS on index 3), signalled at each fault.
    pub fn set_err_eventfd(&self, fd: Option<File>) {
        self.lock().err = fd;
    }

    /// The mappings as (IOVA, size, writable).
    pub fn mappings(&self) -> Vec<(u64, u64, bool)> {
        let inner = self.lock();
        inner
            .maps
            .iter()
            .map(|(&a, m)| (a, m.len as u64, m.writable))
            .collect()
    }

    /// Reads the fault log region (region 9); bytes past its end read as zero.
    pub fn read_fault_log(&self, offset: u64, data: &mut [u8]) {
        let inner = self.lock();
        for (i, b) in data.iter_mut().enumerate() {
            *b = usize::try_from(offset)
                .ok()
                .and_then(|o| o.checked_add(i))
                .and_then(|o| inner.log.get(o).copied())
                .unwrap_or(0);
        }
    }

    /// Faults ever recorded (wrapping), as the log's `total`.
    pub fn fault_total(&self) -> u32 {
        self.lock().total
    }

    /// The records still in the ring, oldest first.
    pub fn faults(&self) -> Vec<FaultRecord> {
        let inner = self.lock();
        let n = (inner.total as usize).min(FAULT_RECORDS);
        (inner.total as usize - n..inner.total as usize)
            .map(|i| {
                let o = FAULT_RING + (i % FAULT_RECORDS) * FAULT_RECORD_SIZE;
                let b = &inner.log[o..o + FAULT_RECORD_SIZE];
                FaultRecord {
                    iova: u64::from_le_bytes(b[0..8].try_into().unwrap_or_default()),
                    len: u32::from_le_bytes(b[8..12].try_into().unwrap_or_default()),
                    flags: u32::from_le_bytes(b[12..16].try_into().unwrap_or_default()),
                }
            })
            .collect()
    }

    pub fn stats(&self) -> DmaStats {
        let c = &self.counters;
        DmaStats {
            maps: c.maps.load(Ordering::Relaxed),
            unmaps: c.unmaps.load(Ordering::Relaxed),
            bytes_read: c.bytes_read.load(Ordering::Relaxed),
            bytes_written: c.bytes_written.load(Ordering::Relaxed),
            refused: c.refused.load(Ordering::Relaxed),
        }
    }

    /// Whether the device may access `len` bytes at `iova` (`write`: RAM-bound), without
    /// recording anything: a device that must check a whole request before it moves a byte.
    pub fn permits(&self, iova: u64, len: u64, write: bool) -> bool {
        if !self.bus_master.load(Ordering::SeqCst) {
            return false;
        }
        let inner = self.lock();
        let mut cur = iova;
        let Some(end) = iova.checked_add(len) else {
            return false;
        };
        while cur < end {
            let found = inner
                .maps
                .range(..=cur)
                .next_back()
                .filter(|(&at, m)| cur - at < m.len as u64);
            match found {
                Some((&at, m)) if (write && m.writable) || (!write && m.readable) => {
                    cur = at + m.len as u64;
                }
                _ => return false,
            }
        }
        true
    }

    /// Copies between the mappings at `iova` and the device, `len` bytes, all or nothing.
    fn access(
        &self,
        dev: DeviceId,
        iova: u64,
        len: usize,
        access: Access,
        mut copy: impl FnMut(VolatileSlice<'_>, usize),
    ) -> Result<(), DmaError> {
        if !self.bus_master.load(Ordering::SeqCst) {
            self.counters.refused.fetch_add(1, Ordering::Relaxed);
            return Err(DmaError::BusMasterOff { dev });
        }
        let mut inner = self.lock();
        let write = access == Access::Write;
        // Every byte is checked before any moves.
        let mut chunks = Vec::new();
        let mut done = 0usize;
        while done < len {
            let cur = iova.wrapping_add(done as u64);
            let found = inner
                .maps
                .range(..=cur)
                .next_back()
                .filter(|(&at, m)| cur - at < m.len as u64);
            let refused = match found {
                None => Some((FaultReason::NotMapped, 0)),
                Some((_, m)) if write && !m.writable => {
                    Some((FaultReason::Denied, FAULT_READ_ONLY))
                }
                Some((_, m)) if !write && !m.readable => Some((FaultReason::Denied, 0)),
                Some(_) => None,
            };
            if let Some((reason, ro)) = refused {
                let flags = ro | if write { FAULT_WRITE } else { 0 };
                let rest = u32::try_from(len - done).unwrap_or(u32::MAX);
                self.fault(&mut inner, cur, rest, flags);
                return Err(DmaError::Fault {
                    dev,
                    iova: cur,
                    access,
                    reason,
                });
            }
            let Some((&at, m)) = found else { break };
            let off = (cur - at) as usize;
            let n = (m.len - off).min(len - done);
            chunks.push((at, off, n, done));
            done += n;
        }
        for (at, off, n, done) in chunks {
            copy(inner.maps[&at].slice(off, n), done);
        }
        let c = match write {
            true => &self.counters.bytes_written,
            false => &self.counters.bytes_read,
        };
        c.fetch_add(len as u64, Ordering::Relaxed);
        Ok(())
    }

    /// Records a refused access and signals ERR, with the table locked.
    fn fault(&self, inner: &mut Inner, iova: u64, len: u32, flags: u32) {
        self.counters.refused.fetch_add(1, Ordering::Relaxed);
        let o = FAULT_RING + (inner.total as usize % FAULT_RECORDS) * FAULT_RECORD_SIZE;
        inner.log[o..o + 8].copy_from_slice(&iova.to_le_bytes());
        inner.log[o + 8..o + 12].copy_from_slice(&len.to_le_bytes());
        inner.log[o + 12..o + 16].copy_from_slice(&flags.to_le_bytes());
        inner.total = inner.total.wrapping_add(1);
        let total = inner.total;
        inner.log[0..4].copy_from_slice(&total.to_le_bytes());
        log::debug!("DMA refused: IOVA {iova:#x}+{len:#x} flags {flags:#x}");
        if let Some(err) = inner.err.as_mut() {
            if let Err(e) = err.write_all(&1u64.to_ne_bytes()) {
                log::warn!("cannot signal the ERR eventfd: {e}");
            }
        }
    }
}

/// The IOVAs of the mappings that overlap `[iova, iova + size)`.
fn overlapping(
    maps: &BTreeMap<u64, Mapping>,
    iova: u64,
    size: u64,
) -> impl Iterator<Item = u64> + '_ {
    let end = iova.saturating_add(size);
    let before = maps
        .range(..iova)
        .next_back()
        .filter(move |(&at, m)| at + m.len as u64 > iova)
        .map(|(&at, _)| at);
    before
        .into_iter()
        .chain(maps.range(iova..end).map(|(&at, _)| at))
}

impl EduDma for DmaTable {
    fn read(&self, dev: DeviceId, addr: u64, buf: &mut [u8]) -> Result<(), DmaError> {
        self.access(dev, addr, buf.len(), Access::Read, |s, at| {
            s.copy_to(&mut buf[at..at + s.len()]);
        })
    }
    fn write(&self, dev: DeviceId, addr: u64, buf: &[u8]) -> Result<(), DmaError> {
        self.access(dev, addr, buf.len(), Access::Write, |s, at| {
            s.copy_from(&buf[at..at + s.len()]);
        })
    }
    fn set_bus_master(&self, _dev: DeviceId, enabled: bool) {
        self.bus_master.store(enabled, Ordering::SeqCst);
    }
}
