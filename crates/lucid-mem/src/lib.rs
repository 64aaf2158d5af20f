//! Guest memory for Lucid VMs: RAM regions with pluggable backing, pages that can be remapped
//! while the VM runs, and the single DMA path through which every device touches guest memory.

#![warn(clippy::print_stdout, clippy::print_stderr)]

mod dma;
mod ram;

pub use dma::{
    Access, DeviceId, DeviceMemory, DmaError, DmaObserver, DmaPath, DmaTranslator, FaultReason,
};
pub use ram::{Backing, GuestRam, MemError, PageDiscard, RamRegion};
pub use vm_memory;

/// The guest memory type used across Lucid.
pub type GuestMemoryMmap = vm_memory::GuestMemoryMmap<()>;
