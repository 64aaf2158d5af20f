//! Lucid's PCI: a root complex with a host bridge, configuration access through ports
//! 0xCF8/0xCFC and ECAM, firmware-style BAR assignment and guest BAR moves, MSI-X routed to KVM
//! (GSI routing + irqfd, or `KVM_SIGNAL_MSI`), INTx, and the virtio-pci modern transport that
//! puts each [`lucid_virtio::VirtioDevice`] on its rung of the exit ladder.
//!
//! The VMM builds a [`PciRoot`] over its MMIO and PIO buses, calls [`PciRoot::register`], then
//! for each device builds a [`VirtioPciDevice`] and attaches it with [`PciRoot::add_device`].

pub mod config;
pub mod msix;
pub mod root;
pub mod virtio;

pub use config::{Bar, BarKind, ConfigSpace, PciIds};
pub use msix::{Interrupts, MsiPath, MsixTable};
pub use root::{PciAddress, PciDevice, PciRoot, PciWindows};
pub use virtio::{
    plan_rung, HostCaps, RungPlan, TransportEnv, TransportOptions, VirtioPciDevice,
    VirtioPciInterrupt,
};

#[derive(Debug, thiserror::Error)]
pub enum PciError {
    #[error("BAR {0}: {1}")]
    BadBar(usize, String),
    #[error("capability: {0}")]
    Capability(String),
    #[error("PCI bus 0 has no free slot")]
    BusFull,
    #[error("{0}: no room for BAR {1} in the PCI window")]
    NoSpace(String, usize),
    #[error(transparent)]
    Bus(#[from] lucid_devices::BusError),
    #[error(transparent)]
    Hv(#[from] lucid_hv::HvError),
    #[error("{0}")]
    Io(std::io::Error),
    #[error("{0}")]
    Config(String),
    #[error("rung: {0}")]
    Rung(String),
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
