//! Lucid's PCI: a root complex with a host bridge, configuration access through ports
//! 0xCF8/0xCFC and ECAM, firmware-style BAR assignment and guest BAR moves, MSI-X routed to KVM
//! (GSI routing + irqfd, or `KVM_SIGNAL_MSI`), INTx, and the virtio-pci modern transport that
//! puts each [`lucid_virtio::VirtioDevice`] on its rung of the exit ladder.
//!
//! The VMM builds a [`PciRoot`] over its MMIO and PIO buses, calls [`PciRoot::register`], then
//! for each device builds a [`VirtioPciDevice`] and attaches it with [`PciRoot::add_device`].
//! Besides virtio, [`edu`] is QEMU's `edu` DMA test device (with plain [`msi`]).

pub mod config;
pub mod edu;
pub mod ladder;
pub mod msi;
pub mod msix;
pub mod root;
pub mod virtio;

pub use config::{Bar, BarKind, ConfigSpace, PciIds};
pub use edu::{EduDevice, EduDma};
pub use ladder::{HostCaps, Rung, RungPlan};
pub use msix::{Interrupts, MsiPath, MsixTable};
pub use root::{PciAddress, PciDevice, PciRoot, PciWindows};
pub use virtio::{TransportEnv, TransportOptions, VirtioPciDevice, VirtioPciInterrupt};

#[derive(Debug, thiserror::Error)]
pub enum PciError {
    #[error("BAR {bar}: {problem}")]
    Bar { bar: usize, problem: BarProblem },
    #[error("capability {id:#04x} ({len} bytes): {problem}")]
    Capability {
        id: u8,
        len: usize,
        problem: CapProblem,
    },
    #[error("MSI-X with {vectors} vectors, table at {table:#x} and PBA at {pba:#x}: 1-2048 vectors, 8-byte aligned offsets")]
    MsixLayout { vectors: u16, table: u32, pba: u32 },
    #[error("PCI bus 0 has no free slot")]
    BusFull,
    #[error("PCI slot {0} is taken or out of range")]
    SlotTaken(u8),
    #[error("{device}: no room for BAR {bar} ({size:#x} bytes) in the PCI window {window:#x?}: {source}")]
    NoSpace {
        device: String,
        bar: usize,
        size: u64,
        window: std::ops::Range<u64>,
        #[source]
        source: vm_allocator::Error,
    },

    #[error("{device}: BAR {bar} at {base:#x} overlaps another range on its bus")]
    BarOverlaps {
        device: String,
        bar: usize,
        base: u64,
    },
    #[error(transparent)]
    Bus(#[from] lucid_devices::BusError),
    #[error(transparent)]
    Hv(#[from] lucid_hv::HvError),
    #[error("cannot create an eventfd: {0}")]
    EventFd(#[source] std::io::Error),
    #[error("{device}: {queues} queues; 1 to {max} supported")]
    QueueCount {
        device: String,
        queues: usize,
        max: usize,
    },
    #[error("{device}: queue maximum size {size}; a power of two up to 32768")]
    QueueMaxSize { device: String, size: u16 },
    #[error("irqfd interrupts need a GSI router")]
    NoGsiRouter,
    #[error(transparent)]
    Rung(#[from] ladder::RungRefused),
}

/// What is wrong with a BAR declaration or placement.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum BarProblem {
    #[error("index out of range (a 64-bit BAR takes two)")]
    IndexOutOfRange,
    #[error("size {size:#x}: a power of two, at least {min}")]
    BadSize { size: u64, min: u64 },
    #[error("size {size:#x} too large for its kind")]
    TooLarge { size: u64 },
    #[error("already in use")]
    InUse,
    #[error("not implemented")]
    NotImplemented,
    #[error("address {addr:#x} not aligned to the BAR's size {size:#x}")]
    Misaligned { addr: u64, size: u64 },
    #[error("address {addr:#x} above 4 GiB in a 32-bit BAR")]
    Above4G { addr: u64 },
}

/// What is wrong with a capability.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CapProblem {
    #[error("write mask of {mask} bytes for a {body}-byte body")]
    MaskLength { mask: usize, body: usize },
    #[error("no room left in configuration space (next free offset {offset:#x})")]
    NoRoom { offset: usize },
    #[error("{vectors} MSI vectors: 1, 2, 4, 8, 16 or 32")]
    Vectors { vectors: u8 },
}

/// Builds the virtio-pci transport for `device` and attaches it to `root`; returns its address
/// and the shared transport.
pub fn attach_virtio(
    root: &PciRoot,
    device: Box<dyn lucid_virtio::VirtioDevice>,
    env: TransportEnv,
    opts: TransportOptions,
) -> Result<
    (
        PciAddress,
        std::sync::Arc<std::sync::Mutex<VirtioPciDevice>>,
    ),
    PciError,
> {
    let name = device.name().to_string();
    let dev = virtio::shared(VirtioPciDevice::new(device, env, opts)?);
    let addr = root.add_device(&name, dev.clone())?;
    Ok((addr, dev))
}

/// Builds QEMU's `edu` device on the VM's DMA path and interrupts (INTx on `intx_gsi`, which
/// must be the GSI the platform routes the slot it lands in to) and attaches it to `root`.
pub fn attach_edu(
    root: &PciRoot,
    env: &TransportEnv,
    intx_gsi: Option<u32>,
) -> Result<(PciAddress, std::sync::Arc<std::sync::Mutex<EduDevice>>), PciError> {
    let irq = edu::KvmIrq::new(env.vm.clone(), env.router.clone(), intx_gsi);
    let dev = EduDevice::new(
        env.dma.clone(),
        std::sync::Arc::new(irq),
        intx_gsi,
        &env.stats,
    )?;
    let dev = std::sync::Arc::new(std::sync::Mutex::new(dev));
    let addr = root.add_device("edu", dev.clone())?;
    Ok((addr, dev))
}
