//! The seam: every VFIO ioctl Lucid makes, and nothing else. [`crate::KernelVfio`] makes them on
//! the real `/dev/vfio` files; the tests replay scripted answers.

use std::io;
use std::os::fd::RawFd;

use lucid_iommu::Perm;

/// `VFIO_DEVICE_GET_INFO`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeviceInfo {
    pub flags: u32,
    pub num_regions: u32,
    pub num_irqs: u32,
}

/// `VFIO_DEVICE_GET_REGION_INFO`: where region `index` lies in the device file.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RegionInfo {
    pub flags: u32,
    pub size: u64,
    pub offset: u64,
}

/// `VFIO_DEVICE_GET_IRQ_INFO`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IrqInfo {
    pub flags: u32,
    pub count: u32,
}

/// The VFIO ioctls (and the region pread/pwrite) on a container, its groups and their devices.
///
/// Handles are the implementation's: open files for the kernel, tokens for a mock.
pub trait VfioOps: Send + Sync {
    type Container: Send + Sync;
    type Group: Send + Sync;
    type Device: Send + Sync;

    /// Opens `/dev/vfio/vfio`.
    fn open_container(&self) -> io::Result<Self::Container>;
    /// `VFIO_GET_API_VERSION`.
    fn api_version(&self, c: &Self::Container) -> io::Result<u32>;
    /// `VFIO_CHECK_EXTENSION`: whether the container supports IOMMU type `ext`.
    fn check_extension(&self, c: &Self::Container, ext: u32) -> io::Result<bool>;
    /// Opens `/dev/vfio/<group>`.
    fn open_group(&self, group: u32) -> io::Result<Self::Group>;
    /// `VFIO_GROUP_GET_STATUS`: the group's flags (`VFIO_GROUP_FLAGS_*`).
    fn group_status(&self, g: &Self::Group) -> io::Result<u32>;
    /// `VFIO_GROUP_SET_CONTAINER`.
    fn set_container(&self, g: &Self::Group, c: &Self::Container) -> io::Result<()>;
    /// `VFIO_SET_IOMMU`.
    fn set_iommu(&self, c: &Self::Container, kind: u32) -> io::Result<()>;
    /// `VFIO_GROUP_GET_DEVICE_FD` for the device named `name` (its PCI address, `0000:01:00.0`).
    fn device(&self, g: &Self::Group, name: &str) -> io::Result<Self::Device>;
    /// `VFIO_DEVICE_GET_INFO`.
    fn device_info(&self, d: &Self::Device) -> io::Result<DeviceInfo>;
    /// `VFIO_DEVICE_GET_REGION_INFO`.
    fn region_info(&self, d: &Self::Device, index: u32) -> io::Result<RegionInfo>;
    /// `pread` of the device file at `offset` (a region's offset plus the offset within it).
    fn region_read(&self, d: &Self::Device, offset: u64, buf: &mut [u8]) -> io::Result<()>;
    /// `pwrite` of the device file at `offset`.
    fn region_write(&self, d: &Self::Device, offset: u64, buf: &[u8]) -> io::Result<()>;
    /// `VFIO_DEVICE_GET_IRQ_INFO`.
    fn irq_info(&self, d: &Self::Device, index: u32) -> io::Result<IrqInfo>;
    /// `VFIO_DEVICE_SET_IRQS` of vectors `start..start+fds.len()` of irq `index` with `flags`
    /// (`VFIO_IRQ_SET_DATA_*` | `VFIO_IRQ_SET_ACTION_*`); `fds` are eventfds (DATA_EVENTFD, -1
    /// unbinds one) or empty (DATA_NONE with count 0 disables the index).
    fn set_irqs(
        &self,
        d: &Self::Device,
        index: u32,
        flags: u32,
        start: u32,
        fds: &[RawFd],
    ) -> io::Result<()>;
    /// `VFIO_DEVICE_RESET`.
    fn reset(&self, d: &Self::Device) -> io::Result<()>;
    /// `VFIO_IOMMU_MAP_DMA`: the device may reach `vaddr..vaddr+size` of this process at
    /// `iova`, for the accesses `perm` allows. The kernel pins the pages.
    ///
    /// # Safety
    ///
    /// `vaddr..vaddr+size` must stay mapped until `unmap_dma` removes the IOVA range (or the
    /// container closes), and this process must touch it only as memory a device can write at
    /// any moment (guest RAM through volatile accesses): the device reads and writes it
    /// behind the compiler's back.
    unsafe fn map_dma(
        &self,
        c: &Self::Container,
        iova: u64,
        size: u64,
        vaddr: u64,
        perm: Perm,
    ) -> io::Result<()>;
    /// `VFIO_IOMMU_UNMAP_DMA`: returns the bytes the kernel unmapped.
    fn unmap_dma(&self, c: &Self::Container, iova: u64, size: u64) -> io::Result<u64>;
}
