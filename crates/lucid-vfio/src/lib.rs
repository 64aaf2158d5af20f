//! The kernel VFIO path: a PCI function on the host, bound to `vfio-pci`, assigned to a guest
//! with the host IOMMU confining its DMA to what the guest may reach. docs/vfio.md ("The kernel
//! VFIO path") has what was and was not run, and the steps on a host with a device.
//!
//! - [`VfioOps`] is the only code that touches the kernel (the VFIO ioctls and the region
//!   pread/pwrite); [`KernelVfio`] makes the real calls, the tests a mock.
//! - [`VfioDevice::open`] runs the container/group/device setup with an error that says what
//!   to fix, then reads the BAR regions (sizes checked) and the INTx/MSI/MSI-X vector counts.
//! - [`Dma`] programs the host IOMMU: [`Dma::map_all_ram`] maps all guest RAM at iova = gpa
//!   (no vIOMMU), and as a [`lucid_iommu::MapListener`] it follows the vIOMMU's mappings
//!   (`VFIO_IOMMU_MAP_DMA`/`UNMAP_DMA` with the mapping's read/write permission).
//!
//! Not wired into `lucid run`: a library for a host with an IOMMU and a device to pass through.

#![warn(clippy::print_stdout, clippy::print_stderr)]

mod dma;
mod kernel;
#[cfg(test)]
mod mock;
mod ops;

use std::io;
use std::os::fd::RawFd;
use std::sync::Arc;

use vfio_bindings::bindings::vfio::{
    VFIO_TYPE1v2_IOMMU, VFIO_API_VERSION, VFIO_DEVICE_FLAGS_PCI, VFIO_GROUP_FLAGS_VIABLE,
    VFIO_IRQ_SET_ACTION_TRIGGER, VFIO_IRQ_SET_ACTION_UNMASK, VFIO_IRQ_SET_DATA_EVENTFD,
    VFIO_IRQ_SET_DATA_NONE, VFIO_PCI_CONFIG_REGION_INDEX, VFIO_PCI_INTX_IRQ_INDEX,
    VFIO_PCI_MSIX_IRQ_INDEX, VFIO_PCI_MSI_IRQ_INDEX, VFIO_REGION_INFO_FLAG_MMAP,
};

pub use dma::{Dma, RamRegions};
pub use kernel::KernelVfio;
pub use ops::{DeviceInfo, IrqInfo, RegionInfo, VfioOps};

/// BAR regions 0-5 (`VFIO_PCI_BAR0_REGION_INDEX`..).
pub const NUM_BARS: usize = 6;
/// The PCI config space region.
pub const CONFIG_REGION: u32 = VFIO_PCI_CONFIG_REGION_INDEX;

#[derive(Debug, thiserror::Error)]
pub enum VfioError {
    #[error("/dev/vfio/vfio is missing: the host needs an IOMMU turned on (intel_iommu=on or amd_iommu=on) and the vfio-pci module loaded")]
    NoContainer,
    #[error("cannot open /dev/vfio/vfio: {0}")]
    OpenContainer(#[source] io::Error),
    #[error("the host's VFIO API version is {got}, Lucid speaks version {want}")]
    ApiVersion { got: u32, want: u32 },
    #[error("the host's VFIO container offers no TYPE1v2 IOMMU (VFIO_TYPE1v2_IOMMU): no usable host IOMMU driver")]
    NoType1v2,
    #[error("no /dev/vfio/{0}: IOMMU group {0} does not exist or none of its devices is bound to vfio-pci")]
    NoGroup(u32),
    #[error("cannot open /dev/vfio/{group}: {source}")]
    OpenGroup {
        group: u32,
        #[source]
        source: io::Error,
    },
    #[error("IOMMU group {0} is not viable: bind every device of IOMMU group {0} to vfio-pci")]
    NotViable(u32),
    #[error("no device {name} in IOMMU group {group}: {source}")]
    NoDevice {
        name: String,
        group: u32,
        #[source]
        source: io::Error,
    },
    #[error("{op} failed: {source}")]
    Ioctl {
        op: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("{name} is not a PCI device (VFIO device flags {flags:#x})")]
    NotPci { name: String, flags: u32 },
    #[error(
        "{name} has {regions} regions; a PCI function has at least {want} (BARs, ROM, config)"
    )]
    TooFewRegions {
        name: String,
        regions: u32,
        want: u32,
    },
    #[error("BAR {index} of {name} is {size:#x} bytes, not a power of two")]
    BarSize {
        name: String,
        index: usize,
        size: u64,
    },
    #[error("access {offset:#x}+{len} outside region {index} ({size:#x} bytes)")]
    OutOfRegion {
        index: u32,
        offset: u64,
        len: usize,
        size: u64,
    },
    #[error("irq index {index} has {count} vectors, {wanted} given")]
    IrqCount {
        index: u32,
        count: u32,
        wanted: usize,
    },
}

type Result<T> = std::result::Result<T, VfioError>;

fn ioctl(op: &'static str) -> impl FnOnce(io::Error) -> VfioError {
    move |source| VfioError::Ioctl { op, source }
}

/// A container (one host IOMMU domain) and the calls that reach it; shared by the device and
/// its [`Dma`].
pub(crate) struct Container<O: VfioOps> {
    pub(crate) ops: Arc<O>,
    pub(crate) fd: O::Container,
}

/// A BAR as the device reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BarInfo {
    pub size: u64,
    /// The region may be mmapped into the guest instead of trapped.
    pub mappable: bool,
}

/// Vectors per interrupt kind.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IrqCounts {
    pub intx: u32,
    pub msi: u32,
    pub msix: u32,
}

/// An assigned PCI function: its group in a container of its own, its regions and interrupts.
pub struct VfioDevice<O: VfioOps> {
    // Dropped in this order: the device file, then the group, then the container.
    dev: O::Device,
    /// Kept open: closing the group detaches it from the container.
    _group_fd: O::Group,
    container: Arc<Container<O>>,
    group: u32,
    name: String,
    info: DeviceInfo,
    /// Regions 0..=CONFIG_REGION.
    regions: Vec<RegionInfo>,
    bars: [Option<BarInfo>; NUM_BARS],
    irqs: IrqCounts,
}

impl<O: VfioOps> VfioDevice<O> {
    /// Opens device `name` (its PCI address, `0000:01:00.0`) of IOMMU group `group`: container,
    /// API version, TYPE1v2, group, viability, group into container, IOMMU type, device, then
    /// its regions and interrupt counts. Each step's failure says what to fix.
    pub fn open(ops: Arc<O>, group: u32, name: &str) -> Result<Self> {
        let c = ops.open_container().map_err(|e| match e.kind() {
            io::ErrorKind::NotFound => VfioError::NoContainer,
            _ => VfioError::OpenContainer(e),
        })?;
        let got = ops.api_version(&c).map_err(ioctl("VFIO_GET_API_VERSION"))?;
        if got != VFIO_API_VERSION {
            return Err(VfioError::ApiVersion {
                got,
                want: VFIO_API_VERSION,
            });
        }
        if !ops
            .check_extension(&c, VFIO_TYPE1v2_IOMMU)
            .map_err(ioctl("VFIO_CHECK_EXTENSION"))?
        {
            return Err(VfioError::NoType1v2);
        }
        let g = ops.open_group(group).map_err(|e| match e.kind() {
            io::ErrorKind::NotFound => VfioError::NoGroup(group),
            _ => VfioError::OpenGroup { group, source: e },
        })?;
        let status = ops
            .group_status(&g)
            .map_err(ioctl("VFIO_GROUP_GET_STATUS"))?;
        if status & VFIO_GROUP_FLAGS_VIABLE == 0 {
            return Err(VfioError::NotViable(group));
        }
        ops.set_container(&g, &c)
            .map_err(ioctl("VFIO_GROUP_SET_CONTAINER"))?;
        // The IOMMU type can be set only once a group is in the container.
        ops.set_iommu(&c, VFIO_TYPE1v2_IOMMU)
            .map_err(ioctl("VFIO_SET_IOMMU"))?;
        let dev = ops.device(&g, name).map_err(|source| VfioError::NoDevice {
            name: name.to_string(),
            group,
            source,
        })?;
        let info = ops
            .device_info(&dev)
            .map_err(ioctl("VFIO_DEVICE_GET_INFO"))?;
        if info.flags & VFIO_DEVICE_FLAGS_PCI == 0 {
            return Err(VfioError::NotPci {
                name: name.to_string(),
                flags: info.flags,
            });
        }
        if info.num_regions <= CONFIG_REGION {
            return Err(VfioError::TooFewRegions {
                name: name.to_string(),
                regions: info.num_regions,
                want: CONFIG_REGION + 1,
            });
        }
        let regions = (0..=CONFIG_REGION)
            .map(|i| ops.region_info(&dev, i))
            .collect::<io::Result<Vec<_>>>()
            .map_err(ioctl("VFIO_DEVICE_GET_REGION_INFO"))?;
        let mut bars = [None; NUM_BARS];
        for (index, (bar, r)) in bars.iter_mut().zip(&regions).enumerate() {
            // Size 0: no BAR there (or the upper half of a 64-bit BAR).
            if r.size == 0 {
                continue;
            }
            if !r.size.is_power_of_two() {
                return Err(VfioError::BarSize {
                    name: name.to_string(),
                    index,
                    size: r.size,
                });
            }
            *bar = Some(BarInfo {
                size: r.size,
                mappable: r.flags & VFIO_REGION_INFO_FLAG_MMAP != 0,
            });
        }
        let count = |index: u32| -> Result<u32> {
            if index >= info.num_irqs {
                return Ok(0);
            }
            ops.irq_info(&dev, index)
                .map(|i| i.count)
                .map_err(ioctl("VFIO_DEVICE_GET_IRQ_INFO"))
        };
        let irqs = IrqCounts {
            intx: count(VFIO_PCI_INTX_IRQ_INDEX)?,
            msi: count(VFIO_PCI_MSI_IRQ_INDEX)?,
            msix: count(VFIO_PCI_MSIX_IRQ_INDEX)?,
        };
        Ok(VfioDevice {
            container: Arc::new(Container { ops, fd: c }),
            group,
            _group_fd: g,
            dev,
            name: name.to_string(),
            info,
            regions,
            bars,
            irqs,
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn group(&self) -> u32 {
        self.group
    }

    pub fn info(&self) -> DeviceInfo {
        self.info
    }

    /// BAR `index` (0-5), if the device has one there.
    pub fn bar(&self, index: usize) -> Option<BarInfo> {
        self.bars.get(index).copied().flatten()
    }

    pub fn irq_counts(&self) -> IrqCounts {
        self.irqs
    }

    /// Region `index` (0-5 BARs, 6 ROM, 7 config space).
    pub fn region(&self, index: u32) -> Option<RegionInfo> {
        self.regions.get(index as usize).copied()
    }

    /// Where `offset..offset+len` of region `index` lies in the device file.
    fn at(&self, index: u32, offset: u64, len: usize) -> Result<u64> {
        let r = self.region(index).unwrap_or_default();
        let end = offset.checked_add(len as u64);
        if !matches!(end, Some(e) if e <= r.size) {
            return Err(VfioError::OutOfRegion {
                index,
                offset,
                len,
                size: r.size,
            });
        }
        Ok(r.offset + offset)
    }

    /// Reads `buf.len()` bytes at `offset` of region `index` (a trapped BAR access, config space).
    pub fn read(&self, index: u32, offset: u64, buf: &mut [u8]) -> Result<()> {
        let at = self.at(index, offset, buf.len())?;
        self.container
            .ops
            .region_read(&self.dev, at, buf)
            .map_err(ioctl("region read"))
    }

    /// Writes `buf` at `offset` of region `index`.
    pub fn write(&self, index: u32, offset: u64, buf: &[u8]) -> Result<()> {
        let at = self.at(index, offset, buf.len())?;
        self.container
            .ops
            .region_write(&self.dev, at, buf)
            .map_err(ioctl("region write"))
    }

    fn set_irqs(&self, index: u32, flags: u32, fds: &[RawFd]) -> Result<()> {
        self.container
            .ops
            .set_irqs(&self.dev, index, flags, 0, fds)
            .map_err(ioctl("VFIO_DEVICE_SET_IRQS"))
    }

    /// Gives the device one trigger eventfd per vector of irq `index` (KVM irqfds, so an
    /// interrupt reaches the guest without a Lucid thread).
    fn enable(&self, index: u32, count: u32, fds: &[RawFd]) -> Result<()> {
        if fds.is_empty() || fds.len() > count as usize {
            return Err(VfioError::IrqCount {
                index,
                count,
                wanted: fds.len(),
            });
        }
        self.set_irqs(
            index,
            VFIO_IRQ_SET_DATA_EVENTFD | VFIO_IRQ_SET_ACTION_TRIGGER,
            fds,
        )
    }

    pub fn enable_msi(&self, fds: &[RawFd]) -> Result<()> {
        self.enable(VFIO_PCI_MSI_IRQ_INDEX, self.irqs.msi, fds)
    }

    pub fn enable_msix(&self, fds: &[RawFd]) -> Result<()> {
        self.enable(VFIO_PCI_MSIX_IRQ_INDEX, self.irqs.msix, fds)
    }

    /// INTx: `trigger` is signalled when the line rises (a KVM irqfd), and the kernel unmasks
    /// the line when `unmask` fires (the irqfd's resamplefd, at the guest's EOI).
    pub fn enable_intx(&self, trigger: RawFd, unmask: RawFd) -> Result<()> {
        self.enable(VFIO_PCI_INTX_IRQ_INDEX, self.irqs.intx, &[trigger])?;
        self.set_irqs(
            VFIO_PCI_INTX_IRQ_INDEX,
            VFIO_IRQ_SET_DATA_EVENTFD | VFIO_IRQ_SET_ACTION_UNMASK,
            &[unmask],
        )
    }

    /// Turns irq `index` off (DATA_NONE, count 0).
    pub fn disable_irq(&self, index: u32) -> Result<()> {
        self.set_irqs(
            index,
            VFIO_IRQ_SET_DATA_NONE | VFIO_IRQ_SET_ACTION_TRIGGER,
            &[],
        )
    }

    /// `VFIO_DEVICE_RESET` (a function-level reset when the device has one).
    pub fn reset(&self) -> Result<()> {
        self.container
            .ops
            .reset(&self.dev)
            .map_err(ioctl("VFIO_DEVICE_RESET"))
    }

    /// The host IOMMU of this device's container, over guest RAM `ram`.
    pub fn dma(&self, ram: RamRegions) -> Dma<O> {
        Dma::new(self.container.clone(), ram)
    }
}

#[cfg(test)]
mod tests;
