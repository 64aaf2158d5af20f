//! The device manager: every device of a VM and the one place each device decision is made.
//!
//! - The legacy devices every VM has (serial, debug-exit, i8042, CMOS, ACPI PM, POST, the
//!   probes): [`legacy`].
//! - The PCI bus, when the VM has PCI devices: its slots (one allocator; a slot comes with its
//!   INTx line) and its functions, virtio transports and plain PCI functions (not virtio:
//!   edu): [`pci`]. [`DeviceManager::attach`] and [`DeviceManager::detach`] put a function on
//!   the bus and take it off, at build time and while the VM runs.
//! - ACPI PCI hotplug and the power button ([`hotplug`]), with `VmConfig::devices.hotplug`:
//!   [`DeviceManager::hot_add`], [`DeviceManager::hot_remove`],
//!   [`DeviceManager::press_power_button`].
//! - The device names (`blk0`, `net0`, `balloon`, `rng`, `edu`): [`virtio_names`].
//!
//! [`DeviceManager::build`] attaches what the configuration lists, in a fixed order: the virtio
//! devices in their order, the balloon, the rng, then the plain PCI functions.

mod fw_cfg;
mod hotplug;
mod legacy;
mod pci;
pub mod user;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use lucid_boot::layout;
use lucid_devices::{ConsoleOut, Lifecycle};
use lucid_hv::GsiRouter;
use lucid_mem::DmaPath;
use lucid_stats::StatsRegistry;
use lucid_thread::Spawner;
use lucid_virtio::balloon::BalloonControl;
use lucid_virtio::blk::BlockDataHook;
use lucid_virtio::rate::{RateControl, RateError, RateLimiterConfig};
use lucid_virtio::vhost_user::VhostUserKind;

pub use pci::{AttachedPci, NewPciFunction, PciFunction, PciSlot};

use crate::builder::VmBuilder;
use crate::config::{PciDeviceConfig, PciDeviceKind, VmConfig};
use crate::hooks::ExitHooks;
use crate::swap::VmSwap;
use crate::sym::{SwapCacheDevice, Symbiotic};
use crate::VmmError;
use hotplug::{HotplugPorts, PciHotplug};
use legacy::LegacyDevices;
use pci::{PciBus, PciParts};

/// The virtio-balloon's name.
pub const BALLOON: &str = "balloon";
/// The virtio-rng's name.
pub const RNG: &str = "rng";
/// The virtio-console's name.
pub const CONSOLE: &str = "console";

/// The names of the virtio devices `pci` lists, in its order: each device's own `name`, else
/// `blkN` and `netN`, each kind numbered on its own, skipping numbers a named device took.
pub fn virtio_names(pci: &[PciDeviceConfig]) -> Vec<String> {
    let taken: Vec<&str> = pci.iter().filter_map(|d| d.name.as_deref()).collect();
    let (mut nblk, mut nnet, mut nfs, mut nvsock) = (0, 0, 0, 0);
    pci.iter()
        .map(|d| {
            if let Some(n) = &d.name {
                return n.clone();
            }
            let (prefix, next) = match &d.kind {
                PciDeviceKind::Block(_) => ("blk", &mut nblk),
                PciDeviceKind::Net(_) => ("net", &mut nnet),
                PciDeviceKind::VhostUser(v) => match v.kind {
                    VhostUserKind::Blk => ("blk", &mut nblk),
                    VhostUserKind::Net { .. } => ("net", &mut nnet),
                    VhostUserKind::Fs { .. } => ("fs", &mut nfs),
                },
                PciDeviceKind::Vsock(_) => ("vsock", &mut nvsock),
            };
            loop {
                let name = format!("{prefix}{next}");
                *next += 1;
                if !taken.contains(&name.as_str()) {
                    return name;
                }
            }
        })
        .collect()
}

/// A VM's devices.
pub struct DeviceManager {
    legacy: LegacyDevices,
    pci: Option<Arc<PciBus>>,
    /// The virtio-balloon's control (`VmConfig::balloon`).
    balloon: Option<BalloonControl>,
    /// The hotplug controller (`VmConfig::devices.hotplug`).
    hotplug: Option<Arc<PciHotplug>>,
    /// The Swap Mapper on disks, for disks added while the VM runs too.
    blk_hook: Option<Arc<dyn BlockDataHook>>,
    /// QEMU's fw_cfg (`VmConfig::devices.fw_cfg`).
    fw_cfg: Option<Arc<std::sync::Mutex<lucid_devices::FwCfg>>>,
    /// The rate limiters of the blk, net and rng devices, by device name.
    limits: Mutex<BTreeMap<String, Arc<RateControl>>>,
    /// For devices that count or start threads of their own as they are made (vsock).
    stats: Arc<StatsRegistry>,
    spawner: Spawner,
}

/// Why `lucid.rate-limit` could not change a device's limits.
#[derive(Debug, thiserror::Error)]
pub enum RateLimitError {
    #[error("no device {0:?} on the PCI bus")]
    NoSuchDevice(String),
    #[error("device {0:?} has no rate limiter (only blk, net and rng devices have one)")]
    NotLimited(String),
    #[error("device {0:?}: {1}")]
    Invalid(String, #[source] RateError),
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
    /// The vIOMMU, whose mappings a vfio-user device's DMA follows.
    pub vtd: Option<&'a Arc<lucid_iommu::Vtd>>,
}

impl DeviceManager {
    /// Whether `config` puts anything on a PCI bus.
    pub(crate) fn wants_pci(config: &VmConfig) -> bool {
        !config.devices.pci.is_empty()
            || !config.devices.platform_pci.is_empty()
            || config.devices.balloon.is_some()
            || config.devices.rng.is_some()
            || config.devices.hotplug
            || config.devices.console.is_some()
            || !config.devices.user_devices.is_empty()
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
            hotplug: None,
            blk_hook: p.swap.blk_hook(),
            fw_cfg: None,
            limits: Mutex::default(),
            stats: p.stats.clone(),
            spawner: p.spawner.clone(),
        };
        if p.config.devices.fw_cfg {
            dm.fw_cfg = Some(fw_cfg::attach(
                p.config, p.builder, p.dma, p.hooks, p.stats,
            )?);
        }
        let Some(router) = p.router.filter(|_| Self::wants_pci(p.config)) else {
            return Ok(dm);
        };
        let bus = Arc::new(PciBus::new(PciParts {
            builder: p.builder,
            router,
            dma: p.dma,
            hooks: p.hooks,
            stats: p.stats,
            spawner: p.spawner,
            rungs: p.config.devices.pci.iter().map(|d| d.rung).collect(),
        })?);
        if p.config.devices.hotplug {
            let ged = legacy::eventfd("the GED interrupt")?;
            p.builder.vm().register_irqfd(&ged, layout::GED_GSI)?;
            let hp = Arc::new(PciHotplug::new(ged, Arc::downgrade(&bus), p.stats));
            p.hooks.pio.insert(
                layout::ports::PCI_HOTPLUG.into(),
                layout::pci_hotplug::LEN,
                "pci-hotplug",
                Arc::new(std::sync::Mutex::new(HotplugPorts(hp.clone()))),
            )?;
            dm.hotplug = Some(hp);
        }
        dm.pci = Some(bus);
        dm.attach_configured(&p)?;
        Ok(dm)
    }

    /// The virtio device `d` describes, named `name`, for `slot`.
    fn virtio_function(
        &self,
        name: &str,
        d: &PciDeviceConfig,
        slot: PciSlot,
        swap_cache: Option<(&Arc<StatsRegistry>, &Arc<Symbiotic>)>,
    ) -> Result<NewPciFunction, VmmError> {
        let limits = RateControl::new(d.rate_limiter.unwrap_or_default())
            .map_err(|e| back_end(name.to_string(), e))?;
        if let Some(l) = &d.rate_limiter {
            log::info!("{name}: rate limit {l}");
        }
        let device: Box<dyn lucid_virtio::VirtioDevice> = match &d.kind {
            PciDeviceKind::Block(b) => {
                let mut blk = lucid_virtio::blk::Block::new(name.to_string(), b.clone())
                    .map_err(|e| back_end(name.to_string(), e))?;
                blk.set_rate_control(limits.clone());
                if let Some(h) = &self.blk_hook {
                    blk.set_data_hook(h.clone());
                }
                // SwapBypass's swap cache (`--blk ...,swapcache=MiB`).
                if let Some((stats, sym)) = swap_cache.filter(|_| d.swapcache_mib > 0) {
                    blk.set_cache(SwapCacheDevice::new(
                        d.swapcache_mib,
                        slot.slot.into(),
                        d.swapcache_spy_first,
                        stats,
                        sym,
                    ));
                }
                Box::new(blk)
            }
            PciDeviceKind::Net(n) => {
                let mut net = lucid_virtio::net::Net::new(name.to_string(), n.clone())
                    .map_err(|e| back_end(name.to_string(), e))?;
                net.set_rate_control(limits.clone());
                Box::new(net)
            }
            PciDeviceKind::VhostUser(v) => {
                let bus = self.pci.as_ref().ok_or_else(|| {
                    VmmError::HotplugRefused(name.to_string(), "no PCI bus for a vhost-user device")
                })?;
                Box::new(
                    lucid_virtio::vhost_user::VhostUser::new(
                        name.to_string(),
                        v.clone(),
                        bus.stats(),
                        bus.spawner(),
                    )
                    .map_err(|e| back_end(name.to_string(), e))?,
                )
            }
            PciDeviceKind::Vsock(v) => Box::new(
                lucid_virtio::vsock::Vsock::new(
                    name.to_string(),
                    v.clone(),
                    &self.stats,
                    &self.spawner,
                )
                .map_err(|e| back_end(name.to_string(), e))?,
            ),
        };
        self.track_limits(name, limits);
        Ok(NewPciFunction::Virtio {
            device,
            options: lucid_pci::TransportOptions {
                rung: d.rung,
                coalescing: d.coalescing,
                poll_idle_us: d.poll_idle_us,
                intx_gsi: None,
            },
        })
    }

    fn hotplug(&self, what: &str) -> Result<&Arc<PciHotplug>, VmmError> {
        self.hotplug
            .as_ref()
            .ok_or_else(|| VmmError::NoHotplug(what.to_string()))
    }

    /// Adds virtio device `d` while the VM runs, named `d.name` (else the next free `blkN`
    /// or `netN`), and tells the guest through ACPI: Linux's `acpiphp` scans the slot.
    pub fn hot_add(&self, d: &PciDeviceConfig) -> Result<AttachedPci, VmmError> {
        let name = match &d.name {
            Some(n) if !crate::config::device_name_ok(n) => {
                return Err(VmmError::HotplugRefused(
                    n.clone(),
                    "a device name is 1 to 32 letters, digits, `_` or `-`",
                ))
            }
            Some(n) => n.clone(),
            None => self.free_name(&d.kind),
        };
        let hp = self.hotplug(&name)?;
        if d.swapcache_mib > 0 {
            return Err(VmmError::HotplugRefused(
                name,
                "a swap cache (swapcache=) is set up at boot only",
            ));
        }
        if matches!(d.kind, PciDeviceKind::VhostUser(_)) {
            // A running VM's threads are confined: none may open a new connection.
            return Err(VmmError::HotplugRefused(
                name,
                "a vhost-user device connects to its back-end at boot only",
            ));
        }
        let a = self.attach(&name, |slot| self.virtio_function(&name, d, slot, None))?;
        hp.plugged(a.slot.slot);
        Ok(a)
    }

    /// Asks the guest to release device `name`; it is detached when the guest ejects it.
    pub fn hot_remove(&self, name: &str) -> Result<(), VmmError> {
        let hp = self.hotplug(name)?;
        let a = self
            .pci_devices()
            .into_iter()
            .find(|a| a.name == name)
            .ok_or_else(|| VmmError::NoSuchDevice(name.to_string()))?;
        hp.unplug_requested(a.slot.slot);
        Ok(())
    }

    /// Whether device `name` waits for the guest to eject it.
    pub fn removal_pending(&self, name: &str) -> bool {
        let slot = self
            .pci_devices()
            .into_iter()
            .find(|a| a.name == name)
            .map(|a| a.slot.slot);
        matches!((&self.hotplug, slot), (Some(hp), Some(s)) if hp.removal_pending(s))
    }

    /// Presses the ACPI power button (Linux's `button` driver reports it).
    pub fn press_power_button(&self) -> Result<(), VmmError> {
        self.hotplug("power button")?.press_power_button();
        Ok(())
    }

    /// The first `blkN` or `netN` no attached function has.
    fn free_name(&self, kind: &PciDeviceKind) -> String {
        let prefix = match kind {
            PciDeviceKind::Block(_) => "blk",
            PciDeviceKind::Net(_) => "net",
            PciDeviceKind::VhostUser(v) => match v.kind {
                VhostUserKind::Blk => "blk",
                VhostUserKind::Net { .. } => "net",
                VhostUserKind::Fs { .. } => "fs",
            },
            PciDeviceKind::Vsock(_) => "vsock",
        };
        let taken: Vec<String> = self.pci_devices().into_iter().map(|a| a.name).collect();
        (0..)
            .map(|i| format!("{prefix}{i}"))
            .find(|n| !taken.contains(n))
            .unwrap_or_default()
    }

    fn attach_configured(&mut self, p: &DeviceParts<'_>) -> Result<(), VmmError> {
        let config = p.config;
        // The Swap Mapper on every disk (none in baseline mode); pages the balloon gives back
        // go through it when there is one (it forgets the image blocks they showed), else
        // through guest RAM itself (fresh anonymous memory over them).
        for (name, d) in virtio_names(&config.devices.pci)
            .into_iter()
            .zip(&config.devices.pci)
        {
            let swap_cache = p.sym.map(|sym| (p.stats, sym));
            self.attach(&name, |slot| {
                self.virtio_function(&name, d, slot, swap_cache)
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
        if let Some(cfg) = &config.devices.rng {
            let dev = lucid_virtio::rng::Rng::new(RNG.into(), cfg.clone(), p.stats)
                .map_err(|e| back_end(RNG.into(), e))?;
            self.track_limits(RNG, dev.rate_control());
            let a = self.attach(RNG, |_| {
                Ok(NewPciFunction::Virtio {
                    device: Box::new(dev),
                    options: lucid_pci::TransportOptions::default(),
                })
            })?;
            log::info!("{RNG}: PCI {}, rate {}", a.slot.address(), cfg.limits());
        }
        if let Some(cfg) = &config.devices.console {
            let dev = lucid_virtio::console::Console::new(CONSOLE.into(), cfg.clone(), p.stats)
                .map_err(|e| back_end(CONSOLE.into(), e))?;
            let a = self.attach(CONSOLE, |_| {
                Ok(NewPciFunction::Virtio {
                    device: Box::new(dev),
                    options: lucid_pci::TransportOptions::default(),
                })
            })?;
            log::info!(
                "{CONSOLE}: PCI {}, output {:?}",
                a.slot.address(),
                cfg.output
            );
        }
        for d in &config.devices.platform_pci {
            match d {
                crate::config::PlatformPciDevice::Edu => {
                    self.attach(d.name(), |_| Ok(NewPciFunction::Edu))?
                }
            };
        }
        let users = &config.devices.user_devices;
        for (name, u) in crate::config::user_device_names(users).iter().zip(users) {
            let router = self.pci_router().cloned().ok_or_else(|| {
                VmmError::HotplugRefused(name.clone(), "no PCI bus for a vfio-user device")
            })?;
            self.attach(name, |slot| {
                let dev = user::UserDevice::new(
                    name,
                    &u.socket,
                    user::UserDeviceParts {
                        vm: p.builder.vm(),
                        router: &router,
                        stats: p.stats,
                        ram: p.builder.ram().regions(),
                        vtd: p.vtd,
                        intx_gsi: slot.intx_gsi,
                    },
                )
                .map_err(|e| back_end(name.clone(), e))?;
                Ok(NewPciFunction::Plain(Arc::new(Mutex::new(dev))))
            })?;
        }
        Ok(())
    }

    fn track_limits(&self, name: &str, limits: Arc<RateControl>) {
        self.limits
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(name.to_string(), limits);
    }

    /// Replaces the rate limiter of device `name` (none: unlimited) while the VM runs; its
    /// back-end thread takes the new limits at once.
    pub fn set_rate_limit(
        &self,
        name: &str,
        cfg: Option<RateLimiterConfig>,
    ) -> Result<(), RateLimitError> {
        if !self.pci_devices().iter().any(|a| a.name == name) {
            return Err(RateLimitError::NoSuchDevice(name.to_string()));
        }
        let limits = self.limits.lock().unwrap_or_else(|e| e.into_inner());
        let control = limits
            .get(name)
            .ok_or_else(|| RateLimitError::NotLimited(name.to_string()))?;
        let cfg = cfg.unwrap_or_default();
        control
            .set(cfg)
            .map_err(|e| RateLimitError::Invalid(name.to_string(), e))?;
        log::info!("{name}: rate limit now {cfg}");
        Ok(())
    }

    /// The rate limits of device `name` now, if it has a limiter.
    pub fn rate_limit(&self, name: &str) -> Option<RateLimiterConfig> {
        let limits = self.limits.lock().unwrap_or_else(|e| e.into_inner());
        limits.get(name).map(|c| c.get())
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
        self.pci.as_ref().map(|b| b.attached()).unwrap_or_default()
    }

    /// Whether the VM has a PCI bus.
    pub fn has_pci(&self) -> bool {
        self.pci.is_some()
    }

    /// The GSI router the PCI functions' interrupts go through, with a PCI bus.
    pub fn pci_router(&self) -> Option<&Arc<GsiRouter>> {
        self.pci.as_ref().map(|b| b.router())
    }

    /// The virtio-balloon's control, when the VM has one (`VmConfig::balloon`).
    pub fn balloon(&self) -> Option<&BalloonControl> {
        self.balloon.as_ref()
    }

    /// The serial console's output.
    pub(crate) fn console(&self) -> &Arc<ConsoleOut> {
        &self.legacy.console
    }

    /// QEMU's fw_cfg, unless the configuration turned it off.
    pub(crate) fn fw_cfg(&self) -> Option<&Arc<std::sync::Mutex<lucid_devices::FwCfg>>> {
        self.fw_cfg.as_ref()
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
        let named = |name: &str| PciDeviceConfig {
            name: Some(name.into()),
            ..blk()
        };
        let names = virtio_names(&[blk(), named("blk1"), blk(), named("root"), net()]);
        assert_eq!(names, ["blk0", "blk1", "blk2", "root", "net0"]);
    }
}
