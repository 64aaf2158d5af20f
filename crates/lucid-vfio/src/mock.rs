//! A [`VfioOps`] that records every call and answers from a script.

use std::collections::HashMap;
use std::io;
use std::os::fd::RawFd;
use std::sync::Mutex;

use lucid_iommu::Perm;

use crate::ops::{DeviceInfo, IrqInfo, RegionInfo, VfioOps};

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Call {
    OpenContainer,
    ApiVersion,
    CheckExtension(u32),
    OpenGroup(u32),
    GroupStatus,
    SetContainer,
    SetIommu(u32),
    Device(String),
    DeviceInfo,
    RegionInfo(u32),
    RegionRead(u64, usize),
    RegionWrite(u64, Vec<u8>),
    IrqInfo(u32),
    SetIrqs {
        index: u32,
        flags: u32,
        start: u32,
        fds: Vec<RawFd>,
    },
    Reset,
    MapDma {
        iova: u64,
        size: u64,
        vaddr: u64,
        perm: Perm,
    },
    UnmapDma {
        iova: u64,
        size: u64,
    },
}

/// The answers: a healthy PCI device unless a field says otherwise.
pub struct Script {
    pub api_version: u32,
    pub type1v2: bool,
    pub group_flags: u32,
    pub device: DeviceInfo,
    pub regions: HashMap<u32, RegionInfo>,
    pub irqs: HashMap<u32, u32>,
    /// Calls (by `Call` variant name) that fail, with the errno they fail with.
    pub errno: HashMap<&'static str, i32>,
    /// `MapDma` at this IOVA fails with EFAULT.
    pub refuse_iova: Option<u64>,
}

impl Default for Script {
    fn default() -> Self {
        let region = |flags, size, offset| RegionInfo {
            flags,
            size,
            offset,
        };
        Script {
            api_version: 0,
            type1v2: true,
            group_flags: 1,
            device: DeviceInfo {
                flags: 2,
                num_regions: 9,
                num_irqs: 5,
            },
            regions: HashMap::from([
                (0, region(7, 1 << 20, 0)),
                (2, region(3, 0x4000, 2 << 40)),
                (7, region(3, 256, 7 << 40)),
            ]),
            irqs: HashMap::from([(0, 1), (1, 1), (2, 0)]),
            errno: HashMap::new(),
            refuse_iova: None,
        }
    }
}

#[derive(Default)]
pub struct Mock {
    pub script: Script,
    pub calls: Mutex<Vec<Call>>,
}

impl Mock {
    pub fn new(script: Script) -> Self {
        Mock {
            script,
            calls: Mutex::new(Vec::new()),
        }
    }

    pub fn calls(&self) -> Vec<Call> {
        self.calls.lock().unwrap().clone()
    }

    pub fn clear(&self) {
        self.calls.lock().unwrap().clear()
    }

    /// Records `call`; fails if the script says so.
    fn rec(&self, call: Call) -> io::Result<()> {
        let name = format!("{call:?}");
        let name = name
            .split(['(', ' '])
            .next()
            .unwrap_or_default()
            .to_string();
        self.calls.lock().unwrap().push(call);
        match self.script.errno.get(name.as_str()) {
            Some(&e) => Err(io::Error::from_raw_os_error(e)),
            None => Ok(()),
        }
    }
}

impl VfioOps for Mock {
    type Container = ();
    type Group = ();
    type Device = ();

    fn open_container(&self) -> io::Result<()> {
        self.rec(Call::OpenContainer)
    }
    fn api_version(&self, _: &()) -> io::Result<u32> {
        self.rec(Call::ApiVersion)?;
        Ok(self.script.api_version)
    }
    fn check_extension(&self, _: &(), ext: u32) -> io::Result<bool> {
        self.rec(Call::CheckExtension(ext))?;
        Ok(self.script.type1v2)
    }
    fn open_group(&self, group: u32) -> io::Result<()> {
        self.rec(Call::OpenGroup(group))
    }
    fn group_status(&self, _: &()) -> io::Result<u32> {
        self.rec(Call::GroupStatus)?;
        Ok(self.script.group_flags)
    }
    fn set_container(&self, _: &(), _: &()) -> io::Result<()> {
        self.rec(Call::SetContainer)
    }
    fn set_iommu(&self, _: &(), kind: u32) -> io::Result<()> {
        self.rec(Call::SetIommu(kind))
    }
    fn device(&self, _: &(), name: &str) -> io::Result<()> {
        self.rec(Call::Device(name.to_string()))
    }
    fn device_info(&self, _: &()) -> io::Result<DeviceInfo> {
        self.rec(Call::DeviceInfo)?;
        Ok(self.script.device)
    }
    fn region_info(&self, _: &(), index: u32) -> io::Result<RegionInfo> {
        self.rec(Call::RegionInfo(index))?;
        Ok(self.script.regions.get(&index).copied().unwrap_or_default())
    }
    fn region_read(&self, _: &(), offset: u64, buf: &mut [u8]) -> io::Result<()> {
        self.rec(Call::RegionRead(offset, buf.len()))?;
        buf.fill(0xab);
        Ok(())
    }
    fn region_write(&self, _: &(), offset: u64, buf: &[u8]) -> io::Result<()> {
        self.rec(Call::RegionWrite(offset, buf.to_vec()))
    }
    fn irq_info(&self, _: &(), index: u32) -> io::Result<IrqInfo> {
        self.rec(Call::IrqInfo(index))?;
        Ok(IrqInfo {
            flags: 0,
            count: self.script.irqs.get(&index).copied().unwrap_or(0),
        })
    }
    fn set_irqs(
        &self,
        _: &(),
        index: u32,
        flags: u32,
        start: u32,
        fds: &[RawFd],
    ) -> io::Result<()> {
        self.rec(Call::SetIrqs {
            index,
            flags,
            start,
            fds: fds.to_vec(),
        })
    }
    fn reset(&self, _: &()) -> io::Result<()> {
        self.rec(Call::Reset)
    }
    unsafe fn map_dma(
        &self,
        _: &(),
        iova: u64,
        size: u64,
        vaddr: u64,
        perm: Perm,
    ) -> io::Result<()> {
        self.rec(Call::MapDma {
            iova,
            size,
            vaddr,
            perm,
        })?;
        if self.script.refuse_iova == Some(iova) {
            return Err(io::Error::from_raw_os_error(libc::EFAULT));
        }
        Ok(())
    }
    fn unmap_dma(&self, _: &(), iova: u64, size: u64) -> io::Result<u64> {
        self.rec(Call::UnmapDma { iova, size })?;
        Ok(size)
    }
}
