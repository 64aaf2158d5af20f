//! API stub of the VT-d model (the vIOMMU contract's public surface, no logic). Lane A's crate
//! replaces this one wholesale at merge; it exists so the VMM wiring compiles meanwhile.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use lucid_hv::{MsiMessage, MsiRemapper};
use lucid_mem::{Access, DeviceId, DmaError, DmaTranslator, GuestMemoryMmap};
use lucid_stats::StatsRegistry;

pub const VTD_BASE: u64 = 0xfed9_0000;
/// Two pages: page 0 = the spec's register layout; page 1 = fault-recording and IOTLB registers.
pub const VTD_SIZE: u64 = 0x2000;

const VER: u64 = 0x10;
const CAP: u64 = 0x1_0000_0000;
const ECAP: u64 = 0x1_0000_0000;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EmulationMode {
    Samecore,
    Sidecore,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PinPolicy {
    All,
    Map,
    Deferred,
}

#[derive(Clone, Copy, Debug)]
pub struct VtdConfig {
    pub mode: EmulationMode,
    pub pin: PinPolicy,
}

/// Raw MSI out (the unit's own fault-event and invalidation-completion MSIs are not remapped).
pub trait MsiSink: Send + Sync {
    fn send(&self, address: u64, data: u32);
}

/// Host pinning seam.
pub trait Pinner: Send + Sync {
    fn pin(&self, gpa: u64, len: u64) -> bool;
    fn unpin(&self, gpa: u64, len: u64);
}

pub struct MlockPinner {
    _mem: GuestMemoryMmap,
}

impl MlockPinner {
    pub fn new(mem: GuestMemoryMmap) -> Self {
        MlockPinner { _mem: mem }
    }
}

impl Pinner for MlockPinner {
    fn pin(&self, _gpa: u64, _len: u64) -> bool {
        true
    }
    fn unpin(&self, _gpa: u64, _len: u64) {}
}

pub struct Vtd {
    _cfg: VtdConfig,
}

impl Vtd {
    pub fn new(
        cfg: VtdConfig,
        _mem: GuestMemoryMmap,
        _msi: Arc<dyn MsiSink>,
        _pinner: Arc<dyn Pinner>,
        _stats: &StatsRegistry,
    ) -> Arc<Vtd> {
        Arc::new(Vtd { _cfg: cfg })
    }

    pub fn read(&self, offset: u64, data: &mut [u8]) {
        let v = match offset {
            0x00 => VER,
            0x08 => CAP,
            0x10 => ECAP,
            _ => 0,
        };
        let b = v.to_le_bytes();
        if data.len() == 4 || data.len() == 8 {
            data.copy_from_slice(&b[..data.len()]);
        } else {
            data.fill(0);
        }
    }

    pub fn write(&self, _offset: u64, _data: &[u8]) {}

    /// # Safety
    /// `page` points to 4096 bytes mapped for the Vtd's lifetime.
    pub unsafe fn attach_shared_page(&self, _page: *mut u8) {}

    pub fn run_sidecore(&self, stop: &AtomicBool) {
        while !stop.load(Ordering::Acquire) {
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    pub fn on_ir_change(&self, _f: Box<dyn Fn() + Send + Sync>) {}
}

impl DmaTranslator for Vtd {
    fn translate(
        &self,
        _dev: DeviceId,
        iova: u64,
        len: u64,
        _access: Access,
    ) -> Result<(u64, u64), DmaError> {
        Ok((iova, len))
    }
}

impl MsiRemapper for Vtd {
    fn remap(&self, _source: u16, msg: MsiMessage) -> Option<MsiMessage> {
        Some(msg)
    }
}
