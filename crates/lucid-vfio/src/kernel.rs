//! [`VfioOps`] on the kernel's VFIO files: `/dev/vfio/vfio` (the container, one host IOMMU
//! domain), `/dev/vfio/<group>` and the device file the group hands out.

use std::ffi::CString;
use std::fs::{File, OpenOptions};
use std::io;
use std::mem::size_of;
use std::os::fd::{AsRawFd, FromRawFd, RawFd};
use std::os::unix::fs::FileExt;

use lucid_iommu::Perm;
use vfio_bindings::bindings::vfio::{
    vfio_device_info, vfio_group_status, vfio_iommu_type1_dma_map, vfio_iommu_type1_dma_unmap,
    vfio_irq_info, vfio_irq_set, vfio_region_info, VFIO_BASE, VFIO_DMA_MAP_FLAG_READ,
    VFIO_DMA_MAP_FLAG_WRITE, VFIO_IRQ_SET_DATA_EVENTFD, VFIO_TYPE,
};
use vmm_sys_util::ioctl::{ioctl, ioctl_with_mut_ref, ioctl_with_ptr, ioctl_with_ref};
use vmm_sys_util::ioctl_io_nr;

use crate::ops::{DeviceInfo, IrqInfo, RegionInfo, VfioOps};

// The VFIO ioctls are all _IO(VFIO_TYPE, VFIO_BASE + n) (linux/vfio.h).
ioctl_io_nr!(VFIO_GET_API_VERSION, VFIO_TYPE as u32, VFIO_BASE);
ioctl_io_nr!(VFIO_CHECK_EXTENSION, VFIO_TYPE as u32, VFIO_BASE + 1);
ioctl_io_nr!(VFIO_SET_IOMMU, VFIO_TYPE as u32, VFIO_BASE + 2);
ioctl_io_nr!(VFIO_GROUP_GET_STATUS, VFIO_TYPE as u32, VFIO_BASE + 3);
ioctl_io_nr!(VFIO_GROUP_SET_CONTAINER, VFIO_TYPE as u32, VFIO_BASE + 4);
ioctl_io_nr!(VFIO_GROUP_GET_DEVICE_FD, VFIO_TYPE as u32, VFIO_BASE + 6);
ioctl_io_nr!(VFIO_DEVICE_GET_INFO, VFIO_TYPE as u32, VFIO_BASE + 7);
ioctl_io_nr!(VFIO_DEVICE_GET_REGION_INFO, VFIO_TYPE as u32, VFIO_BASE + 8);
ioctl_io_nr!(VFIO_DEVICE_GET_IRQ_INFO, VFIO_TYPE as u32, VFIO_BASE + 9);
ioctl_io_nr!(VFIO_DEVICE_SET_IRQS, VFIO_TYPE as u32, VFIO_BASE + 10);
ioctl_io_nr!(VFIO_DEVICE_RESET, VFIO_TYPE as u32, VFIO_BASE + 11);
ioctl_io_nr!(VFIO_IOMMU_MAP_DMA, VFIO_TYPE as u32, VFIO_BASE + 13);
ioctl_io_nr!(VFIO_IOMMU_UNMAP_DMA, VFIO_TYPE as u32, VFIO_BASE + 14);

/// A `vfio_irq_set` for `VFIO_DEVICE_SET_IRQS`: five u32s, then one s32 per vector when the data
/// is eventfds. Built as u32 words so the buffer has the struct's alignment.
fn irq_set(index: u32, flags: u32, start: u32, fds: &[RawFd]) -> Vec<u32> {
    let header = size_of::<vfio_irq_set>() / 4;
    let data = if flags & VFIO_IRQ_SET_DATA_EVENTFD != 0 {
        fds.len()
    } else {
        0
    };
    let mut words = vec![0u32; header + data];
    words[0] = ((header + data) * 4) as u32;
    words[1] = flags;
    words[2] = index;
    words[3] = start;
    words[4] = fds.len() as u32;
    for (w, fd) in words[header..].iter_mut().zip(fds) {
        *w = *fd as u32;
    }
    words
}

/// The real VFIO ioctls.
#[derive(Clone, Copy, Debug, Default)]
pub struct KernelVfio;

fn rw(path: &str) -> io::Result<File> {
    OpenOptions::new().read(true).write(true).open(path)
}

/// An ioctl's return value as a result (negative: errno).
fn check(ret: i32) -> io::Result<i32> {
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret)
    }
}

fn argsz<T>() -> u32 {
    size_of::<T>() as u32
}

impl VfioOps for KernelVfio {
    type Container = File;
    type Group = File;
    type Device = File;

    fn open_container(&self) -> io::Result<File> {
        rw("/dev/vfio/vfio")
    }

    fn api_version(&self, c: &File) -> io::Result<u32> {
        // SAFETY: VFIO_GET_API_VERSION takes no argument; `c` is an open file.
        check(unsafe { ioctl(c, VFIO_GET_API_VERSION()) }).map(|v| v as u32)
    }

    fn check_extension(&self, c: &File, ext: u32) -> io::Result<bool> {
        // SAFETY: VFIO_CHECK_EXTENSION takes its argument by value; no memory is passed.
        let ret =
            unsafe { vmm_sys_util::ioctl::ioctl_with_val(c, VFIO_CHECK_EXTENSION(), ext.into()) };
        check(ret).map(|v| v == 1)
    }

    fn open_group(&self, group: u32) -> io::Result<File> {
        rw(&format!("/dev/vfio/{group}"))
    }

    fn group_status(&self, g: &File) -> io::Result<u32> {
        let mut st = vfio_group_status {
            argsz: argsz::<vfio_group_status>(),
            flags: 0,
        };
        // SAFETY: the kernel writes at most `argsz` bytes into `st`, which is that large.
        check(unsafe { ioctl_with_mut_ref(g, VFIO_GROUP_GET_STATUS(), &mut st) })?;
        Ok(st.flags)
    }

    fn set_container(&self, g: &File, c: &File) -> io::Result<()> {
        let fd: RawFd = c.as_raw_fd();
        // SAFETY: the kernel reads one int (the container fd) from the pointer.
        check(unsafe { ioctl_with_ref(g, VFIO_GROUP_SET_CONTAINER(), &fd) }).map(drop)
    }

    fn set_iommu(&self, c: &File, kind: u32) -> io::Result<()> {
        // SAFETY: VFIO_SET_IOMMU takes its argument by value; no memory is passed.
        let ret = unsafe { vmm_sys_util::ioctl::ioctl_with_val(c, VFIO_SET_IOMMU(), kind.into()) };
        check(ret).map(drop)
    }

    fn device(&self, g: &File, name: &str) -> io::Result<File> {
        let name =
            CString::new(name).map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
        // SAFETY: the kernel reads a NUL-terminated string from the pointer, which `name` is.
        let fd = check(unsafe { ioctl_with_ptr(g, VFIO_GROUP_GET_DEVICE_FD(), name.as_ptr()) })?;
        // SAFETY: the ioctl returned a new file descriptor that nothing else owns.
        Ok(unsafe { File::from_raw_fd(fd) })
    }

    fn device_info(&self, d: &File) -> io::Result<DeviceInfo> {
        let mut info = vfio_device_info {
            argsz: argsz::<vfio_device_info>(),
            ..Default::default()
        };
        // SAFETY: the kernel writes at most `argsz` bytes into `info`, which is that large.
        check(unsafe { ioctl_with_mut_ref(d, VFIO_DEVICE_GET_INFO(), &mut info) })?;
        Ok(DeviceInfo {
            flags: info.flags,
            num_regions: info.num_regions,
            num_irqs: info.num_irqs,
        })
    }

    fn region_info(&self, d: &File, index: u32) -> io::Result<RegionInfo> {
        let mut info = vfio_region_info {
            argsz: argsz::<vfio_region_info>(),
            index,
            ..Default::default()
        };
        // SAFETY: the kernel writes at most `argsz` bytes into `info` (capabilities that do not
        // fit are only announced through a larger `argsz`, which is ignored here).
        check(unsafe { ioctl_with_mut_ref(d, VFIO_DEVICE_GET_REGION_INFO(), &mut info) })?;
        Ok(RegionInfo {
            flags: info.flags,
            size: info.size,
            offset: info.offset,
        })
    }

    fn region_read(&self, d: &File, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        d.read_exact_at(buf, offset)
    }

    fn region_write(&self, d: &File, offset: u64, buf: &[u8]) -> io::Result<()> {
        d.write_all_at(buf, offset)
    }

    fn irq_info(&self, d: &File, index: u32) -> io::Result<IrqInfo> {
        let mut info = vfio_irq_info {
            argsz: argsz::<vfio_irq_info>(),
            index,
            ..Default::default()
        };
        // SAFETY: the kernel writes at most `argsz` bytes into `info`, which is that large.
        check(unsafe { ioctl_with_mut_ref(d, VFIO_DEVICE_GET_IRQ_INFO(), &mut info) })?;
        Ok(IrqInfo {
            flags: info.flags,
            count: info.count,
        })
    }

    fn set_irqs(
        &self,
        d: &File,
        index: u32,
        flags: u32,
        start: u32,
        fds: &[RawFd],
    ) -> io::Result<()> {
        let words = irq_set(index, flags, start, fds);
        // SAFETY: `words` holds a vfio_irq_set header and `argsz - header` bytes of data, which
        // is all the kernel reads.
        let ret = unsafe {
            ioctl_with_ptr(
                d,
                VFIO_DEVICE_SET_IRQS(),
                words.as_ptr().cast::<vfio_irq_set>(),
            )
        };
        check(ret).map(drop)
    }

    fn reset(&self, d: &File) -> io::Result<()> {
        // SAFETY: VFIO_DEVICE_RESET takes no argument.
        check(unsafe { ioctl(d, VFIO_DEVICE_RESET()) }).map(drop)
    }

    unsafe fn map_dma(
        &self,
        c: &File,
        iova: u64,
        size: u64,
        vaddr: u64,
        perm: Perm,
    ) -> io::Result<()> {
        let mut flags = 0;
        if perm.read {
            flags |= VFIO_DMA_MAP_FLAG_READ;
        }
        if perm.write {
            flags |= VFIO_DMA_MAP_FLAG_WRITE;
        }
        let map = vfio_iommu_type1_dma_map {
            argsz: argsz::<vfio_iommu_type1_dma_map>(),
            flags,
            vaddr,
            iova,
            size,
        };
        // SAFETY: the kernel reads `map`; what the device may then do to `vaddr..vaddr+size`
        // is the caller's contract (this function's safety section).
        check(unsafe { ioctl_with_ref(c, VFIO_IOMMU_MAP_DMA(), &map) }).map(drop)
    }

    fn unmap_dma(&self, c: &File, iova: u64, size: u64) -> io::Result<u64> {
        let mut unmap = vfio_iommu_type1_dma_unmap {
            argsz: argsz::<vfio_iommu_type1_dma_unmap>(),
            flags: 0,
            iova,
            size,
            ..Default::default()
        };
        // SAFETY: the kernel reads `unmap` and writes back its `size` field (bytes unmapped).
        check(unsafe { ioctl_with_mut_ref(c, VFIO_IOMMU_UNMAP_DMA(), &mut unmap) })?;
        Ok(unmap.size)
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;
    use std::sync::Arc;

    use super::*;
    use crate::{VfioDevice, VfioError};

    #[test]
    fn ioctl_numbers_match_linux() {
        // _IO(';', 100 + n) from linux/vfio.h.
        assert_eq!(VFIO_GET_API_VERSION(), 0x3b64);
        assert_eq!(VFIO_SET_IOMMU(), 0x3b66);
        assert_eq!(VFIO_GROUP_GET_DEVICE_FD(), 0x3b6a);
        assert_eq!(VFIO_DEVICE_SET_IRQS(), 0x3b6e);
        assert_eq!(VFIO_DEVICE_RESET(), 0x3b6f);
        assert_eq!(VFIO_IOMMU_MAP_DMA(), 0x3b71);
        assert_eq!(VFIO_IOMMU_UNMAP_DMA(), 0x3b72);
    }

    #[test]
    fn irq_set_layout() {
        assert_eq!(size_of::<vfio_irq_set>(), 20);
        let flags = VFIO_IRQ_SET_DATA_EVENTFD | 32;
        assert_eq!(
            irq_set(1, flags, 0, &[7, -1]),
            [28, flags, 1, 0, 2, 7, u32::MAX]
        );
        // DATA_NONE with count 0 disables: no data.
        assert_eq!(irq_set(2, 1 | 32, 0, &[]), [20, 33, 2, 0, 0]);
    }

    /// The one kernel path this host can run: it has no /dev/vfio.
    #[test]
    fn host_without_vfio_says_so() {
        if Path::new("/dev/vfio/vfio").exists() {
            return;
        }
        let e = VfioDevice::open(Arc::new(KernelVfio), 0, "0000:00:00.0").err();
        assert!(matches!(e, Some(VfioError::NoContainer)), "{e:?}");
    }
}
