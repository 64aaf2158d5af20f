//! The host IOMMU of an assigned device's container, programmed from guest RAM: all of it at
//! iova = gpa without a vIOMMU, or what the vIOMMU's tables map as a [`MapListener`].
//!
//! The listener, not a [`lucid_iommu::Pinner`], programs the host IOMMU: a `Pinner` is told
//! guest pages (pin this gpa range), while the host IOMMU needs IOVA -> host address entries,
//! which only the listener is told. `VFIO_IOMMU_MAP_DMA` pins the pages it maps itself, so the
//! listener's map/unmap are the pin/unpin of an assigned device; the vIOMMU's `Pinner` keeps
//! doing its own bookkeeping beside them.

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use lucid_iommu::{MapListener, Perm};

use crate::{Container, VfioError, VfioOps};

/// One guest RAM region: guest-physical start, size, and where this process maps it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Ram {
    gpa: u64,
    size: u64,
    host: u64,
}

/// Guest RAM as the host IOMMU may map it.
#[derive(Clone, Debug)]
pub struct RamRegions(Vec<Ram>);

impl RamRegions {
    /// `regions`: (gpa, size, host address) of each guest RAM region.
    ///
    /// # Safety
    ///
    /// Each `host..host+size` must be this process's mapping of that guest RAM, stay mapped
    /// while any container mapping made from it lives (until its unmap, or the container
    /// closes), and be touched by this process only through volatile accesses: an assigned
    /// device reads and writes it at any moment.
    pub unsafe fn new(regions: &[(u64, u64, u64)]) -> Self {
        RamRegions(
            regions
                .iter()
                .map(|&(gpa, size, host)| Ram { gpa, size, host })
                .collect(),
        )
    }

    /// The pieces of `gpa..gpa+len` in RAM: (offset into the range, host address, length).
    fn split(&self, gpa: u64, len: u64) -> Vec<(u64, u64, u64)> {
        let end = gpa.saturating_add(len);
        self.0
            .iter()
            .filter_map(|r| {
                let start = gpa.max(r.gpa);
                let stop = end.min(r.gpa.saturating_add(r.size));
                (start < stop).then(|| (start - gpa, r.host + (start - r.gpa), stop - start))
            })
            .collect()
    }
}

/// A container's host IOMMU over guest RAM, with counts.
pub struct Dma<O: VfioOps> {
    c: Arc<Container<O>>,
    ram: RamRegions,
    maps: AtomicU64,
    unmaps: AtomicU64,
    failures: AtomicU64,
    warned: AtomicBool,
}

impl<O: VfioOps> Dma<O> {
    pub(crate) fn new(c: Arc<Container<O>>, ram: RamRegions) -> Self {
        Dma {
            c,
            ram,
            maps: AtomicU64::new(0),
            unmaps: AtomicU64::new(0),
            failures: AtomicU64::new(0),
            warned: AtomicBool::new(false),
        }
    }

    /// Maps every RAM region at iova = gpa, readable and writable (no vIOMMU: the device may
    /// reach all of the guest, as on bare metal; the kernel pins all of it).
    pub fn map_all_ram(&self) -> Result<(), VfioError> {
        for r in &self.ram.0 {
            // SAFETY: `r` is guest RAM as `RamRegions::new`'s contract describes it.
            unsafe {
                self.c
                    .ops
                    .map_dma(&self.c.fd, r.gpa, r.size, r.host, Perm::READ_WRITE)
            }
            .map_err(|source| VfioError::Ioctl {
                op: "VFIO_IOMMU_MAP_DMA",
                source,
            })?;
            self.maps.fetch_add(1, Ordering::Relaxed);
        }
        Ok(())
    }

    /// `VFIO_IOMMU_MAP_DMA` calls that succeeded.
    pub fn maps(&self) -> u64 {
        self.maps.load(Ordering::Relaxed)
    }

    /// `VFIO_IOMMU_UNMAP_DMA` calls that succeeded.
    pub fn unmaps(&self) -> u64 {
        self.unmaps.load(Ordering::Relaxed)
    }

    /// Mappings the host refused (or that named memory outside guest RAM) and failed unmaps:
    /// the device cannot reach such a range, so its DMA there faults on the host.
    pub fn failures(&self) -> u64 {
        self.failures.load(Ordering::Relaxed)
    }

    /// Counts a failure; the first is a warning, the rest debug lines.
    fn fail(&self, what: fmt::Arguments) {
        self.failures.fetch_add(1, Ordering::Relaxed);
        if self.warned.swap(true, Ordering::Relaxed) {
            log::debug!("vfio: {what}");
        } else {
            log::warn!("vfio: {what} (further failures logged at debug level)");
        }
    }
}

impl<O: VfioOps> MapListener for Dma<O> {
    fn map(&self, iova: u64, gpa: u64, len: u64, perm: Perm) {
        let pieces = self.ram.split(gpa, len);
        let in_ram: u64 = pieces.iter().map(|p| p.2).sum();
        if in_ram < len {
            self.fail(format_args!(
                "iova {iova:#x}+{len:#x} -> gpa {gpa:#x}: {:#x} bytes outside guest RAM not mapped",
                len - in_ram
            ));
        }
        for (off, host, n) in pieces {
            // SAFETY: `host..host+n` lies in one region of `self.ram`, guest RAM as
            // `RamRegions::new`'s contract describes it.
            let r = unsafe { self.c.ops.map_dma(&self.c.fd, iova + off, n, host, perm) };
            match r {
                Ok(()) => {
                    self.maps.fetch_add(1, Ordering::Relaxed);
                }
                Err(e) => self.fail(format_args!(
                    "VFIO_IOMMU_MAP_DMA iova {:#x}+{n:#x} ({perm:?}) refused: {e}",
                    iova + off
                )),
            }
        }
    }

    fn unmap(&self, iova: u64, len: u64) {
        if len == 0 {
            return;
        }
        // One call covers every piece `map` made of this range: TYPE1v2 unmaps all mappings
        // inside it (the vIOMMU unmaps exactly what one `map` call mapped, never a part).
        match self.c.ops.unmap_dma(&self.c.fd, iova, len) {
            Ok(_) => {
                self.unmaps.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => self.fail(format_args!(
                "VFIO_IOMMU_UNMAP_DMA iova {iova:#x}+{len:#x} failed: {e}"
            )),
        }
    }
}
