//! The one DMA path. Every device reads and writes guest memory through a [`DmaPath`], so that a
//! vIOMMU can translate device addresses (IOVA to guest-physical, with permission checks and
//! faults) and observers such as the VSWAPPER Swap Mapper can see which guest pages a device
//! filled. With neither installed, an access is a bounds-checked copy.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};

use lucid_stats::{Counter, StatsRegistry};
use vm_memory::{Bytes, GuestAddress};

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

    /// Ends the bracket `access_begin` returned `_token` for.
    fn access_end(&self, _token: u64) {}
}

/// Sees every completed DMA access, by guest-physical range (the Swap Mapper's hook).
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
        *self.translator.write().unwrap_or_else(|e| e.into_inner()) = t;
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

    /// Splits the access into contiguous guest-physical chunks and runs `copy(gpa, offset, len)`
    /// on each.
    fn access(
        &self,
        dev: DeviceId,
        addr: u64,
        len: u64,
        access: Access,
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
        let translator = self
            .translator
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Backing, GuestRam};
    use std::sync::Mutex;

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
}
