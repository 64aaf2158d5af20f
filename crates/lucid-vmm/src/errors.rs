//! What can fail while a VM is built or started ([`VmmError`]), and the configurations this
//! version refuses ([`ConfigError`], found by [`check_config`] before anything is built).

use crate::config::{PlatformPciDevice, VmConfig, MAX_MEM_MIB, MAX_VCPUS, MIN_MEM_MIB};

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
    #[error("{device}: cannot open its back-end")]
    Block {
        device: String,
        #[source]
        source: lucid_virtio::blk::BlockError,
    },
    #[error("{device}: cannot open its back-end")]
    Net {
        device: String,
        #[source]
        source: lucid_virtio::net::NetError,
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
    Api(#[from] crate::api::ApiError),
    #[error("no PCI device named {0}")]
    NoSuchDevice(String),
    #[error("a PCI device named {0} is already attached")]
    DeviceExists(String),
    #[error("{0}: the VM has no PCI bus")]
    NoPciBus(String),
}

/// A VM configuration this version cannot build.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    #[error("--vcpus {0} is out of range 1..={MAX_VCPUS}")]
    Vcpus(u8),
    #[error("--memory {0} MiB is out of range {MIN_MEM_MIB}..={MAX_MEM_MIB}")]
    Memory(u64),
    #[error("the kernel command line contains a NUL byte at offset {0}")]
    CmdlineNul(usize),
    #[error("--device edu given {0} times: a VM has one edu device at most")]
    EduCount(usize),
    #[error(
        "--swap-mode {mode} maps 4096-byte disk blocks over guest pages, and blk{disk} has \
         {block_size}-byte logical blocks: add bs=4096 to its --blk option, or use \
         --swap-mode baseline"
    )]
    SwapBlockSize {
        mode: lucid_swap::SwapMode,
        disk: usize,
        block_size: u32,
    },
    #[error(
        "blk{0}: swapcache= is SwapBypass, a symbiotic interface: add --symbiotic (or drop \
         swapcache=)"
    )]
    SwapCacheNotSymbiotic(usize),
    #[error(
        "blk{0}: swapcache= needs a back-end thread (its liveness SymCalls must not run on a \
         vCPU thread), and rung L0 serves requests on the vCPU thread: use rung=L1 or above"
    )]
    SwapCacheRung(usize),
    #[error("swapcache= given on {0} disks: a VM has one swap-cached disk at most")]
    SwapCacheCount(usize),
}

/// The configuration rules the VM builder checks before it builds anything.
pub(crate) fn check_config(c: &VmConfig) -> Result<(), ConfigError> {
    if c.vcpus == 0 || c.vcpus > MAX_VCPUS {
        return Err(ConfigError::Vcpus(c.vcpus));
    }
    if c.mem_mib < MIN_MEM_MIB || c.mem_mib > MAX_MEM_MIB {
        return Err(ConfigError::Memory(c.mem_mib));
    }
    if let Some(offset) = c.cmdline.find('\0') {
        return Err(ConfigError::CmdlineNul(offset));
    }
    // Its counters (edu.*) are one set.
    let edus = c
        .platform_pci
        .iter()
        .filter(|d| **d == PlatformPciDevice::Edu)
        .count();
    if edus > 1 {
        return Err(ConfigError::EduCount(edus));
    }
    crate::sym::check_swapcache(c)?;
    if let Some((disk, block_size)) = crate::swap::disk_refused_by(c) {
        return Err(ConfigError::SwapBlockSize {
            mode: c.swap_mode,
            disk,
            block_size,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::KernelSource;

    #[test]
    fn bad_configurations_are_typed_errors() {
        let mut c = VmConfig::new(KernelSource::File("/k".into()));
        c.vcpus = 0;
        assert_eq!(check_config(&c), Err(ConfigError::Vcpus(0)));
        c.vcpus = 1;
        c.mem_mib = 1;
        assert_eq!(check_config(&c), Err(ConfigError::Memory(1)));
        c.mem_mib = 64;
        c.cmdline = "a\0b".into();
        assert_eq!(check_config(&c), Err(ConfigError::CmdlineNul(1)));
        c.cmdline = "ok".into();
        assert_eq!(check_config(&c), Ok(()));
        c.platform_pci = vec![PlatformPciDevice::Edu; 2];
        assert_eq!(check_config(&c), Err(ConfigError::EduCount(2)));
        c.platform_pci.pop();
        assert_eq!(check_config(&c), Ok(()));
    }

    #[test]
    fn swapcache_needs_symbiotic_a_worker_and_one_disk() {
        let disk = |rung| {
            let mut d = crate::config::parse_blk("path=/tmp/x.img,swapcache=8").unwrap();
            d.rung = rung;
            d
        };
        let mut c = VmConfig::new(KernelSource::File("/k".into()));
        c.pci = vec![disk(lucid_pci::Rung::L1)];
        assert_eq!(check_config(&c), Err(ConfigError::SwapCacheNotSymbiotic(0)));
        c.symbiotic = true;
        assert_eq!(check_config(&c), Ok(()));
        c.pci = vec![disk(lucid_pci::Rung::L0)];
        assert_eq!(check_config(&c), Err(ConfigError::SwapCacheRung(0)));
        c.pci = vec![
            disk(lucid_pci::Rung::L1),
            disk(lucid_pci::Rung::L4 { guest_polls: false }),
        ];
        assert_eq!(check_config(&c), Err(ConfigError::SwapCacheCount(2)));
    }
}
