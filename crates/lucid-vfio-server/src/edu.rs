//! QEMU's edu as a vfio-user device: Lucid's own [`EduDevice`] behind the `vfio_user` crate's
//! [`ServerBackend`], its DMA through a [`DmaTable`] and its interrupts on the client's
//! eventfds.

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;

use lucid_hv::{HvError, MsiMessage};
use lucid_pci::config::{CAP_ID_MSI, LEGACY_CONFIG_SIZE};
use lucid_pci::edu::{EDU_BAR, EDU_BAR_SIZE};
use lucid_pci::msi::MSI_ENABLE;
use lucid_pci::{EduDevice, PciDevice};
use lucid_stats::StatsRegistry;
use vfio_bindings::bindings::vfio::{
    vfio_region_info, VFIO_IRQ_INFO_EVENTFD, VFIO_IRQ_INFO_MASKABLE, VFIO_IRQ_INFO_NORESIZE,
    VFIO_IRQ_SET_ACTION_MASK, VFIO_IRQ_SET_ACTION_TRIGGER, VFIO_IRQ_SET_ACTION_TYPE_MASK,
    VFIO_IRQ_SET_ACTION_UNMASK, VFIO_IRQ_SET_DATA_EVENTFD, VFIO_IRQ_SET_DATA_NONE,
    VFIO_IRQ_SET_DATA_TYPE_MASK, VFIO_REGION_INFO_FLAG_READ, VFIO_REGION_INFO_FLAG_WRITE,
};
use vfio_user::{DmaMapFlags, DmaUnmapFlags, IrqInfo, ServerBackend, ServerRegion};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::dma::{DmaTable, FAULT_LOG_SIZE};
use crate::{
    BAR0_REGION, CONFIG_REGION, ERR_IRQ, FAULT_LOG_REGION, INTX_IRQ, MSIX_IRQ, MSI_IRQ, NUM_IRQS,
    NUM_REGIONS,
};

/// The regions the edu offers: BAR0 (1 MiB), config space (256 bytes) and the fault log
/// (4096 bytes, read-only); the others are empty. None is mappable.
pub fn edu_regions() -> Vec<ServerRegion> {
    (0..NUM_REGIONS)
        .map(|index| {
            let (size, flags) = match index {
                BAR0_REGION => (EDU_BAR_SIZE, READ_WRITE),
                CONFIG_REGION => (LEGACY_CONFIG_SIZE as u64, READ_WRITE),
                FAULT_LOG_REGION => (FAULT_LOG_SIZE as u64, VFIO_REGION_INFO_FLAG_READ),
                _ => (0, 0),
            };
            ServerRegion {
                region_info: vfio_region_info {
                    argsz: std::mem::size_of::<vfio_region_info>() as u32,
                    flags,
                    index,
                    size,
                    ..Default::default()
                },
                sparse_areas: Vec::new(),
                mmap_fd: None,
            }
        })
        .collect()
}

const READ_WRITE: u32 = VFIO_REGION_INFO_FLAG_READ | VFIO_REGION_INFO_FLAG_WRITE;

/// The interrupts the edu offers: INTx, MSI (one vector) and ERR; no MSI-X.
pub fn edu_irqs() -> Vec<IrqInfo> {
    (0..NUM_IRQS)
        .map(|index| {
            let (count, flags) = match index {
                INTX_IRQ => (1, VFIO_IRQ_INFO_EVENTFD | VFIO_IRQ_INFO_MASKABLE),
                MSI_IRQ => (1, VFIO_IRQ_INFO_EVENTFD | VFIO_IRQ_INFO_NORESIZE),
                ERR_IRQ => (1, VFIO_IRQ_INFO_EVENTFD),
                _ => (0, 0),
            };
            IrqInfo {
                index,
                flags,
                count,
            }
        })
        .collect()
}

/// Interrupts signalled, for the summary and tests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IrqStats {
    /// INTx trigger writes (rising level, and unmasks while high).
    pub intx: u64,
    /// MSI trigger writes.
    pub msi: u64,
}

#[derive(Default)]
struct IntxState {
    trigger: Option<File>,
    masked: bool,
}

/// The client's interrupt eventfds, as the edu's [`lucid_pci::edu::IrqSink`].
#[derive(Default)]
pub struct Irqs {
    intx: Mutex<IntxState>,
    /// The level the edu drives on INTx.
    level: AtomicBool,
    msi: Mutex<Option<File>>,
    intx_signals: AtomicU64,
    msi_signals: AtomicU64,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn signal(f: &mut File) -> std::io::Result<()> {
    f.write_all(&1u64.to_ne_bytes())
}

fn eventfd_error(e: std::io::Error) -> HvError {
    let errno = e.raw_os_error().unwrap_or(libc::EIO);
    HvError::Ioctl(
        "write to the interrupt eventfd",
        vmm_sys_util::errno::Error::new(errno),
    )
}

impl Irqs {
    pub fn stats(&self) -> IrqStats {
        IrqStats {
            intx: self.intx_signals.load(Ordering::Relaxed),
            msi: self.msi_signals.load(Ordering::Relaxed),
        }
    }

    /// Signals INTx if the level is high and the line unmasked.
    fn resignal_intx(&self, intx: &mut IntxState) -> std::io::Result<()> {
        if !self.level.load(Ordering::SeqCst) || intx.masked {
            return Ok(());
        }
        if let Some(t) = intx.trigger.as_mut() {
            signal(t)?;
            self.intx_signals.fetch_add(1, Ordering::Relaxed);
        }
        Ok(())
    }

    /// The client's unmask (its resamplefd fired, or `SET_IRQS` UNMASK with no data).
    fn unmask(&self) {
        let mut intx = lock(&self.intx);
        intx.masked = false;
        if let Err(e) = self.resignal_intx(&mut intx) {
            log::warn!("INTx trigger: {e}");
        }
    }
}

impl lucid_pci::edu::IrqSink for Irqs {
    fn msi(&self, _source: u16, _msg: MsiMessage) -> Result<(), HvError> {
        // The client routes the eventfd to the message the guest programmed.
        match lock(&self.msi).as_mut() {
            Some(f) => {
                signal(f).map_err(eventfd_error)?;
                self.msi_signals.fetch_add(1, Ordering::Relaxed);
                Ok(())
            }
            None => Err(eventfd_error(std::io::Error::from_raw_os_error(
                libc::ENODEV,
            ))),
        }
    }

    fn set_intx(&self, level: bool) -> Result<(), HvError> {
        let mut intx = lock(&self.intx);
        self.level.store(level, Ordering::SeqCst);
        self.resignal_intx(&mut intx).map_err(eventfd_error)
    }
}

/// The thread that waits on the client's INTx unmask eventfd (Lucid's KVM resamplefd): at each
/// unmask while the level is still high, INTx is signalled again.
struct Unmasker {
    stop: EventFd,
    thread: Option<JoinHandle<()>>,
}

impl Unmasker {
    fn start(unmask: File, irqs: Arc<Irqs>) -> std::io::Result<Self> {
        let stop = EventFd::new(EFD_NONBLOCK)?;
        let stop_fd = stop.try_clone()?;
        let thread = std::thread::Builder::new()
            .name("edu-unmask".into())
            .spawn(move || unmask_loop(unmask, &stop_fd, &irqs))?;
        Ok(Unmasker {
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for Unmasker {
    fn drop(&mut self) {
        let _ = self.stop.write(1);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn unmask_loop(mut unmask: File, stop: &EventFd, irqs: &Irqs) {
    loop {
        let mut fds = [
            libc::pollfd {
                fd: unmask.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: stop.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        // SAFETY: `fds` is a valid array of two pollfds for the call's duration.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), 2, -1) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            log::warn!("INTx unmask poll: {e}");
            return;
        }
        if fds[1].revents != 0 {
            return;
        }
        if fds[0].revents & (libc::POLLERR | libc::POLLHUP | libc::POLLNVAL) != 0 {
            log::warn!("INTx unmask eventfd failed");
            return;
        }
        if fds[0].revents & libc::POLLIN != 0 {
            let mut b = [0u8; 8];
            if unmask.read(&mut b).is_ok() {
                irqs.unmask();
            }
        }
    }
}

/// Why a region access or `SET_IRQS` was refused (the client gets an error reply).
#[derive(Debug, thiserror::Error)]
pub enum EduServerError {
    #[error("region {region}: {len} bytes at {offset:#x} are outside its {size} bytes")]
    Outside {
        region: u32,
        offset: u64,
        len: usize,
        size: u64,
    },
    #[error("region {0} is read-only")]
    ReadOnly(u32),
    #[error("region {0} does not exist on this device")]
    NoRegion(u32),
    #[error("SET_IRQS index {index} flags {flags:#x} start {start} count {count} with {fds} fds: not supported by this device")]
    SetIrqs {
        index: u32,
        flags: u32,
        start: u32,
        count: u32,
        fds: usize,
    },
    #[error("cannot start the INTx unmask thread")]
    Unmasker(#[source] std::io::Error),
    #[error(transparent)]
    Pci(#[from] lucid_pci::PciError),
}

impl From<EduServerError> for std::io::Error {
    fn from(e: EduServerError) -> Self {
        std::io::Error::new(std::io::ErrorKind::InvalidInput, e)
    }
}

/// The edu device served over vfio-user: register and config accesses go to an
/// [`EduDevice`], DMA through the shared [`DmaTable`], interrupts to the client's eventfds.
pub struct EduServer {
    edu: EduDevice,
    dma: Arc<DmaTable>,
    irqs: Arc<Irqs>,
    unmasker: Option<Unmasker>,
    stats: Arc<StatsRegistry>,
}

impl EduServer {
    /// A fresh edu whose DMA goes through `dma`; its counters go to `stats` under `edu.`.
    pub fn new(dma: Arc<DmaTable>, stats: Arc<StatsRegistry>) -> Result<Self, EduServerError> {
        let irqs = Arc::new(Irqs::default());
        let edu = EduDevice::with_dma(dma.clone(), irqs.clone(), None, &stats)?;
        Ok(EduServer {
            edu,
            dma,
            irqs,
            unmasker: None,
            stats,
        })
    }

    pub fn dma(&self) -> &Arc<DmaTable> {
        &self.dma
    }

    pub fn irq_stats(&self) -> IrqStats {
        self.irqs.stats()
    }

    /// The edu itself (its config space, buffer and interrupt status).
    pub fn device(&self) -> &EduDevice {
        &self.edu
    }

    /// Turns the edu's MSI on or off, as the host's VFIO driver does when the client sets or
    /// clears the MSI eventfd: the message itself is the client's business.
    fn set_msi_enable(&mut self, on: bool) {
        let Some(&(cap, _)) = self
            .edu
            .config()
            .capabilities()
            .iter()
            .find(|&&(_, id)| id == CAP_ID_MSI)
        else {
            return;
        };
        let ctrl_off = cap + 2;
        let cfg = self.edu.config_mut();
        let ctrl = cfg.u16_at(ctrl_off);
        let ctrl = if on {
            ctrl | MSI_ENABLE
        } else {
            ctrl & !MSI_ENABLE
        };
        cfg.set_u16(ctrl_off, ctrl);
        self.edu.config_written(ctrl_off, 2);
    }

    fn check(region: u32, offset: u64, len: usize, size: u64) -> Result<(), EduServerError> {
        match offset.checked_add(len as u64) {
            Some(end) if end <= size => Ok(()),
            _ => Err(EduServerError::Outside {
                region,
                offset,
                len,
                size,
            }),
        }
    }

    fn set_irqs_inner(
        &mut self,
        index: u32,
        flags: u32,
        start: u32,
        count: u32,
        mut fds: Vec<File>,
    ) -> Result<(), EduServerError> {
        let refused = EduServerError::SetIrqs {
            index,
            flags,
            start,
            count,
            fds: fds.len(),
        };
        let data = flags & VFIO_IRQ_SET_DATA_TYPE_MASK;
        let action = flags & VFIO_IRQ_SET_ACTION_TYPE_MASK;
        let max = edu_irqs()
            .get(index as usize)
            .map_or(0, |i: &IrqInfo| i.count);
        let fds_ok = match data {
            VFIO_IRQ_SET_DATA_EVENTFD => fds.len() == count as usize,
            VFIO_IRQ_SET_DATA_NONE => fds.is_empty(),
            _ => false,
        };
        if start != 0 || count > max || !fds_ok {
            return Err(refused);
        }
        let fd = fds.pop();
        let eventfd = data == VFIO_IRQ_SET_DATA_EVENTFD;
        match (index, action) {
            (INTX_IRQ, VFIO_IRQ_SET_ACTION_TRIGGER) if eventfd || count == 0 => {
                let mut intx = lock(&self.irqs.intx);
                intx.trigger = fd;
                // A level already high is signalled at once, as VFIO does.
                self.irqs
                    .resignal_intx(&mut intx)
                    .map_err(EduServerError::Unmasker)?;
            }
            (INTX_IRQ, VFIO_IRQ_SET_ACTION_TRIGGER) if count == 1 => {
                if let Some(t) = lock(&self.irqs.intx).trigger.as_mut() {
                    signal(t).map_err(EduServerError::Unmasker)?;
                }
            }
            (INTX_IRQ, VFIO_IRQ_SET_ACTION_UNMASK) if eventfd || count == 0 => {
                self.unmasker = None;
                if let Some(f) = fd {
                    self.unmasker = Some(
                        Unmasker::start(f, self.irqs.clone()).map_err(EduServerError::Unmasker)?,
                    );
                }
            }
            (INTX_IRQ, VFIO_IRQ_SET_ACTION_UNMASK) if count == 1 => self.irqs.unmask(),
            (INTX_IRQ, VFIO_IRQ_SET_ACTION_MASK) if !eventfd && count == 1 => {
                lock(&self.irqs.intx).masked = true;
            }
            (MSI_IRQ, VFIO_IRQ_SET_ACTION_TRIGGER) if eventfd || count == 0 => {
                let on = fd.is_some();
                *lock(&self.irqs.msi) = fd;
                self.set_msi_enable(on);
            }
            (MSI_IRQ, VFIO_IRQ_SET_ACTION_TRIGGER) => {
                if let Some(t) = lock(&self.irqs.msi).as_mut() {
                    signal(t).map_err(EduServerError::Unmasker)?;
                }
            }
            (ERR_IRQ, VFIO_IRQ_SET_ACTION_TRIGGER) if eventfd || count == 0 => {
                self.dma.set_err_eventfd(fd);
            }
            (MSIX_IRQ, VFIO_IRQ_SET_ACTION_TRIGGER) if count == 0 => {}
            _ => return Err(refused),
        }
        log::debug!("SET_IRQS index {index} flags {flags:#x} count {count}");
        Ok(())
    }
}

impl ServerBackend for EduServer {
    fn region_read(&mut self, region: u32, offset: u64, data: &mut [u8]) -> std::io::Result<()> {
        match region {
            BAR0_REGION => {
                Self::check(region, offset, data.len(), EDU_BAR_SIZE)?;
                self.edu.bar_read(EDU_BAR, offset, data);
            }
            CONFIG_REGION => {
                Self::check(region, offset, data.len(), LEGACY_CONFIG_SIZE as u64)?;
                let off = offset as usize;
                self.edu.config_reading(off, data.len());
                self.edu.config().read(off, data);
            }
            FAULT_LOG_REGION => {
                Self::check(region, offset, data.len(), FAULT_LOG_SIZE as u64)?;
                self.dma.read_fault_log(offset, data);
            }
            _ => return Err(EduServerError::NoRegion(region).into()),
        }
        Ok(())
    }

    fn region_write(&mut self, region: u32, offset: u64, data: &[u8]) -> std::io::Result<()> {
        match region {
            // A DMA command runs here, synchronously: its faults are logged and ERR signalled
            // before the reply.
            BAR0_REGION => {
                Self::check(region, offset, data.len(), EDU_BAR_SIZE)?;
                self.edu.bar_write(EDU_BAR, offset, data);
            }
            CONFIG_REGION => {
                Self::check(region, offset, data.len(), LEGACY_CONFIG_SIZE as u64)?;
                let off = offset as usize;
                self.edu.config_mut().write(off, data);
                self.edu.config_written(off, data.len());
            }
            FAULT_LOG_REGION => return Err(EduServerError::ReadOnly(region).into()),
            _ => return Err(EduServerError::NoRegion(region).into()),
        }
        Ok(())
    }

    fn dma_map(
        &mut self,
        flags: DmaMapFlags,
        offset: u64,
        address: u64,
        size: u64,
        fd: Option<File>,
    ) -> std::io::Result<()> {
        self.dma
            .map(flags, offset, address, size, fd.as_ref())
            .inspect_err(|e| log::warn!("{e}"))?;
        Ok(())
    }

    fn dma_unmap(&mut self, flags: DmaUnmapFlags, address: u64, size: u64) -> std::io::Result<()> {
        self.dma
            .unmap(flags, address, size)
            .inspect_err(|e| log::warn!("{e}"))?;
        Ok(())
    }

    /// A fresh edu (registers, buffer, config space); the DMA mappings and interrupt eventfds
    /// stay, as over VFIO's device reset.
    fn reset(&mut self) -> std::io::Result<()> {
        let msi_on = lock(&self.irqs.msi).is_some();
        // The old device's drop lowers its INTx level.
        self.edu = EduDevice::with_dma(self.dma.clone(), self.irqs.clone(), None, &self.stats)
            .map_err(EduServerError::from)?;
        // The new edu's command register has bus mastering off.
        lucid_pci::EduDma::set_bus_master(&*self.dma, 0, false);
        if msi_on {
            self.set_msi_enable(true);
        }
        log::info!("device reset");
        Ok(())
    }

    fn set_irqs(
        &mut self,
        index: u32,
        flags: u32,
        start: u32,
        count: u32,
        fds: Vec<File>,
    ) -> std::io::Result<()> {
        self.set_irqs_inner(index, flags, start, count, fds)
            .inspect_err(|e| log::warn!("{e}"))?;
        Ok(())
    }
}
