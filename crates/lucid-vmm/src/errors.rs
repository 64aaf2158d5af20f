//! What can fail while a VM is built or started. A configuration this version refuses is a
//! [`ConfigError`], found by [`crate::VmConfig::validate`] before anything is built.

use crate::config::ConfigError;

/// What failed while building or starting a VM, and with what.
#[derive(Debug, thiserror::Error)]
pub enum VmmError {
    #[error(transparent)]
    Hv(#[from] lucid_hv::HvError),
    #[error(transparent)]
    Mem(#[from] lucid_mem::MemError),
    #[error(transparent)]
    Boot(#[from] lucid_boot::BootError),
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Hooks(#[from] crate::hooks::HookError),
    #[error("cannot open the serial console --serial {output}")]
    Serial {
        output: lucid_devices::SerialOutput,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot create the eventfd of {what}")]
    EventFd {
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
    /// A platform device's range clashes with another.
    #[error("cannot place a platform device")]
    Bus(#[from] lucid_devices::BusError),
    #[error("cannot set up the PCI root complex")]
    PciRoot(#[source] lucid_pci::PciError),
    /// A device's back-end (its image, its tap) cannot be opened. One variant for every kind of
    /// device, so that a new device brings its own error type and no new variant here.
    #[error("{device}: cannot open its back-end")]
    BackEnd {
        device: String,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    #[error("cannot create the virtio-balloon")]
    Balloon(#[source] lucid_virtio::balloon::BalloonError),
    #[error("cannot start the balloon manager's thread")]
    BalloonManager(#[source] std::io::Error),
    #[error("{device}: cannot attach it to PCI")]
    PciAttach {
        device: String,
        #[source]
        source: lucid_pci::PciError,
    },
    #[error(transparent)]
    Thread(#[from] lucid_thread::SpawnError),
    #[error(transparent)]
    Seccomp(#[from] lucid_seccomp::SeccompError),
    #[error(transparent)]
    Pools(#[from] crate::pools::PoolsError),
    #[error(transparent)]
    Swap(#[from] crate::swap::SwapError),
    #[error(transparent)]
    Jail(#[from] lucid_jail::JailError),
    #[error("no PCI device named {0}")]
    NoSuchDevice(String),
    #[error("a PCI device named {0} is already attached")]
    DeviceExists(String),
    #[error("{0}: the VM has no PCI bus")]
    NoPciBus(String),
    #[error("{0}: the VM was built without PCI hotplug (--hotplug)")]
    NoHotplug(String),
    #[error("{0}: {1}")]
    HotplugRefused(String, &'static str),
}
