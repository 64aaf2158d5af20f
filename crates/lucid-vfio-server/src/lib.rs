//! Out-of-process PCI devices over vfio-user, on the rust-vmm `vfio_user` crate's server side:
//! `lucid device-server edu --socket PATH` serves QEMU's edu device (Lucid's own
//! [`lucid_pci::EduDevice`]) to a VMM in another process; `lucid device-server blk --socket
//! PATH --disk FILE` a modern virtio-blk over a disk file ([`blk`]).
//!
//! The device's DMA reaches only what the VMM mapped with `DMA_MAP` ([`DmaTable`]); anything
//! else is refused, recorded in the fault log (region 9) and signalled on the ERR eventfd before
//! the reply to the message that started it, so the VMM can replay it through its vIOMMU.
//!
//! Regions: the BARs (edu: 0, 1 MiB of registers; blk: 1, MSI-X, and 4, virtio), 7 = PCI config
//! space (256 bytes), 9 = the fault log (4096 bytes, read-only: u32 `total` at 0, then a ring
//! of [`dma::FAULT_RECORDS`] records of 16 bytes at 8: u64 iova, u32 len, u32 flags).
//! Interrupts: edu 0 INTx, 1 MSI, 3 ERR; blk 2 MSI-X, 3 ERR.

#![warn(clippy::print_stdout, clippy::print_stderr)]

pub mod blk;
pub mod dma;
pub mod edu;
pub mod server;

pub use blk::{BlkServer, BlkStats, Disk};
pub use dma::{DmaStats, DmaTable, FaultRecord, MapError};
pub use edu::{edu_irqs, edu_regions, EduServer, EduServerError, IrqStats};
pub use server::{run, BlkArgs, DeviceServerCmd, EduArgs, ServerError, Summary};

/// vfio-user region indexes (VFIO PCI's, plus the fault log after them).
pub const BAR0_REGION: u32 = 0;
pub const CONFIG_REGION: u32 = 7;
pub const FAULT_LOG_REGION: u32 = 9;
pub const NUM_REGIONS: u32 = 10;

/// vfio-user interrupt indexes (VFIO PCI's).
pub const INTX_IRQ: u32 = 0;
pub const MSI_IRQ: u32 = 1;
pub const MSIX_IRQ: u32 = 2;
pub const ERR_IRQ: u32 = 3;
pub const NUM_IRQS: u32 = 4;
