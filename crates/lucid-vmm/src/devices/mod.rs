//! The device manager: every device of a VM and the one place each device decision is made.
//!
//! - The legacy devices every VM has (serial, debug-exit, i8042, CMOS, ACPI PM, POST, the
//!   probes): [`legacy`].
//! - The PCI bus, when the VM has PCI devices: its slots (one allocator; a slot comes with its
//!   INTx line) and its functions, virtio transports and plain PCI functions (not virtio:
//!   edu): [`pci`]. [`DeviceManager::attach`] and [`DeviceManager::detach`] put a function on
//!   the bus and take it off, at build time and while the VM runs.
//! - The device names (`blk0`, `net0`, `balloon`, `edu`): [`virtio_names`].
//!
//! [`DeviceManager::build`] attaches what the configuration lists, in a fixed order: the virtio
//! devices in their order, the balloon, then the plain PCI functions.

mod legacy;
mod pci;

use std::sync::Arc;

use lucid_devices::{ConsoleOut, Lifecycle};
use lucid_hv::GsiRouter;
use lucid_mem::DmaPath;
use lucid_stats::StatsRegistry;
use lucid_thread::Spawner;
use lucid_virtio::balloon::BalloonControl;

pub use pci::{AttachedPci, NewPciFunction, PciFunction, PciSlot};

use crate::builder::VmBuilder;
use crate::config::{PciDeviceConfig, PciDeviceKind, VmConfig};
use crate::hooks::ExitHooks;
use crate::swap::VmSwap;
use crate::sym::{SwapCacheDevice, Symbiotic};
use crate::VmmError;
use legacy::LegacyDevices;
use pci::{PciBus, PciParts};

/// The virtio-balloon's name.
pub const BALLOON: &str = "balloon";

/// The names of the virtio devices `pci` lists, in its order: `blkN` and `netN`, each kind
/// numbered on its own.
pub fn virtio_names(pci: &[PciDeviceConfig]) -> Vec<String> {
    let (mut nblk, mut nnet) = (0, 0);
    pci.iter()
        .map(|d| match d.kind {
            PciDeviceKind::Block(_) => {
                nblk += 1;
                format!("blk{}", nblk - 1)
            }
            PciDeviceKind::Net(_) => {
                nnet += 1;
                format!("net{}", nnet - 1)
            }
        })
        .collect()
}

/// A VM's devices.
pub struct DeviceManager {
    legacy: LegacyDevices,
    pci: Option<PciBus>,
    /// The virtio-balloon's control (`VmConfig::balloon`).
    balloon: Option<BalloonControl>,
}

/// What the devices need from the VM being built.
pub(crate) struct DeviceParts<'a> {
    pub config: &'a VmConfig,
    pub builder: &'a VmBuilder,
    /// The GSI router; without one the VM has no PCI bus.
    pub router: Option<&'a Arc<GsiRouter>>,
    pub dma: &'a Arc<DmaPath>,
    pub hooks: &'a ExitHooks,
    pub lifecycle: &'a Arc<Lifecycle>,
    pub stats: &'a Arc<StatsRegistry>,
    pub spawner: &'a Spawner,
    /// The Swap Mapper on the disks, and what gives the balloon's pages back.
    pub swap: &'a VmSwap,
    /// SwapBypass's swap cache asks it about live swap slots.
    pub sym: Option<&'a Arc<Symbiotic>>,
}

impl DeviceManager {
    /// Whether `config` puts anything on a PCI bus.
    pub(crate) fn wants_pci(config: &VmConfig) -> bool {
        !config.devices.pci.is_empty()
            || !config.devices.platform_pci.is_empty()
            || config.devices.balloon.is_some()
    }

    /// The legacy devices, then the PCI bus with the devices the configuration lists.
    pub(crate) fn build(p: DeviceParts<'_>) -> Result<Self, VmmError> {
        let legacy = LegacyDevices::attach(
            p.config,
            p.builder.vm(),
            p.hooks,
            p.lifecycle,
            p.stats,
            p.spawner,
        )?;
        let mut dm = DeviceManager {
            legacy,
            pci: None,
            balloon: None,
        };
        let Some(router) = p.router.filter(|_| Self::wants_pci(p.config)) else {
            return Ok(dm);
        };
        dm.pci = Some(PciBus::new(PciParts {
            builder: p.builder,
            router,
            dma: p.dma,
            hooks: p.hooks,
            stats: p.stats,
            spawner: p.spawner,
            rungs: p.config.devices.pci.iter().map(|d| d.rung).collect(),
        })?);
        dm.attach_configured(&p)?;
        Ok(dm)
    }

    fn attach_configured(&mut self, p: &DeviceParts<'_>) -> Result<(), VmmError> {
        let config = p.config;
        // The Swap Mapper on every disk (none in baseline mode); pages the balloon gives back
        // go through it when there is one (it forgets the image blocks they showed), else
        // through guest RAM itself (fresh anonymous memory over them).
        let blk_hook = p.swap.blk_hook();
        for (name, d) in virtio_names(&config.devices.pci)
            .into_iter()
            .zip(&config.devices.pci)
        {
            self.attach(&name.clone(), |slot| {
                let device: Box<dyn lucid_virtio::VirtioDevice> = match &d.kind {
                    PciDeviceKind::Block(b) => {
                        let mut blk = lucid_virtio::blk::Block::new(name.clone(), b.clone())
                            .map_err(|e| back_end(name, e))?;
                        if let Some(h) = &blk_hook {
                            blk.set_data_hook(h.clone());
                        }
                        // SwapBypass's swap cache (`--blk ...,swapcache=MiB`).
                        if let Some(sym) = p.sym.filter(|_| d.swapcache_mib > 0) {
                            blk.set_cache(SwapCacheDevice::new(
                                d.swapcache_mib,
                                slot.slot.into(),
                                d.swapcache_spy_first,
                                p.stats,
                                sym,
                            ));
                        }
                        Box::new(blk)
                    }
                    PciDeviceKind::Net(n) => Box::new(
                        lucid_virtio::net::Net::new(name.clone(), n.clone())
                            .map_err(|e| back_end(name, e))?,
                    ),
                };
                Ok(NewPciFunction::Virtio {
                    device,
                    options: lucid_pci::TransportOptions {
                        rung: d.rung,
                        coalescing: d.coalescing,
                        poll_idle_us: d.poll_idle_us,
                        intx_gsi: None,
                    },
                })
            })?;
        }
        if let Some(cfg) = &config.devices.balloon {
            let ram = p.builder.ram();
            let ranges: Vec<(u64, u64)> = ram.regions().iter().map(|r| (r.gpa, r.size)).collect();
            let dev = lucid_virtio::balloon::Balloon::new(
                BALLOON.into(),
                cfg.clone(),
                &ranges,
                p.swap.page_discard(ram),
                p.stats,
            )
            .map_err(VmmError::Balloon)?;
            self.balloon = Some(dev.control());
            let a = self.attach(BALLOON, |_| {
                Ok(NewPciFunction::Virtio {
                    device: Box::new(dev),
                    options: lucid_pci::TransportOptions::default(),
                })
            })?;
            log::info!(
                "{BALLOON}: PCI {}, target {} MiB, features {:#x}",
                a.slot.address(),
                cfg.size_mib,
                cfg.features()
            );
        }
        for d in &config.devices.platform_pci {
            match d {
                crate::config::PlatformPciDevice::Edu => {
                    self.attach(d.name(), |_| Ok(NewPciFunction::Edu))?
                }
            };
        }
        Ok(())
    }

    /// Puts a function on the PCI bus, in the lowest free slot: `build` makes it for that slot
    /// (a virtio transport's INTx line is the slot's). For the build and for hotplug.
    pub fn attach(
        &self,
        name: &str,
        build: impl FnOnce(PciSlot) -> Result<NewPciFunction, VmmError>,
    ) -> Result<AttachedPci, VmmError> {
        self.pci
            .as_ref()
            .ok_or_else(|| VmmError::NoPciBus(name.to_string()))?
            .attach(name, build)
    }

    /// Takes function `name` off the PCI bus: it is reset and its slot released. Returns it;
    /// dropping the last hold on it joins its back-end thread.
    pub fn detach(&self, name: &str) -> Result<AttachedPci, VmmError> {
        self.pci
            .as_ref()
            .ok_or_else(|| VmmError::NoSuchDevice(name.to_string()))?
            .detach(name)
    }

    /// The functions on the PCI bus, in attach order (none without a bus).
    pub fn pci_devices(&self) -> Vec<AttachedPci> {
        self.pci.as_ref().map(PciBus::attached).unwrap_or_default()
    }

    /// Whether the VM has a PCI bus.
    pub fn has_pci(&self) -> bool {
        self.pci.is_some()
    }

    /// The GSI router the PCI functions' interrupts go through, with a PCI bus.
    pub fn pci_router(&self) -> Option<&Arc<GsiRouter>> {
        self.pci.as_ref().map(PciBus::router)
    }

    /// The virtio-balloon's control, when the VM has one (`VmConfig::balloon`).
    pub fn balloon(&self) -> Option<&BalloonControl> {
        self.balloon.as_ref()
    }

    /// The serial console's output.
    pub(crate) fn console(&self) -> &Arc<ConsoleOut> {
        &self.legacy.console
    }
}

/// A device whose back-end cannot be opened, with that back-end's own error.
fn back_end(device: String, e: impl std::error::Error + Send + Sync + 'static) -> VmmError {
    VmmError::BackEnd {
        device,
        source: Box::new(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_kind_is_numbered_on_its_own() {
        let blk = || {
            PciDeviceConfig::new(PciDeviceKind::Block(lucid_virtio::blk::BlockConfig {
                path: "/x".into(),
                read_only: false,
                logical_block_size: 512,
                id: String::new(),
                direct: false,
            }))
        };
        let net = || crate::config::parse_net("backend=echo", 0).unwrap();
        let names = virtio_names(&[blk(), net(), blk(), net(), net()]);
        assert_eq!(names, ["blk0", "net0", "blk1", "net1", "net2"]);
    }
}
