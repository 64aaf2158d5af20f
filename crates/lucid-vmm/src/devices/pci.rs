//! The VM's PCI bus: the root complex, the one slot allocator (a slot comes with the INTx line
//! the platform routes it to) and the functions on the bus, virtio transports and plain PCI
//! functions (those that are not virtio, such as edu), attached and detached one at a time.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex, MutexGuard};

use lucid_boot::layout;
use lucid_hv::GsiRouter;
use lucid_mem::DmaPath;
use lucid_pci::{
    HostCaps, PciDevice, PciError, PciRoot, PciWindows, Rung, TransportEnv, TransportOptions,
    VirtioPciDevice,
};
use lucid_stats::StatsRegistry;

use crate::builder::VmBuilder;
use crate::hooks::ExitHooks;
use crate::VmmError;

/// A PCI slot on bus 0 and the GSI its INTx line (pin A) reaches: the DSDT's `_PRT` routes
/// every slot by the same rule, `lucid_boot::layout::pci_intx_gsi`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PciSlot {
    pub slot: u8,
    pub intx_gsi: u32,
}

impl PciSlot {
    fn new(slot: u8) -> Self {
        PciSlot {
            slot,
            intx_gsi: layout::pci_intx_gsi(slot, 0),
        }
    }

    pub fn address(self) -> lucid_pci::PciAddress {
        lucid_pci::PciAddress { slot: self.slot }
    }
}

/// A function on the bus.
#[derive(Clone)]
pub enum PciFunction {
    /// A virtio device behind its virtio-pci transport.
    Virtio(Arc<Mutex<VirtioPciDevice>>),
    /// A PCI function that is not virtio (`--device`, e.g. edu).
    Plain(Arc<Mutex<dyn PciDevice>>),
}

/// One attached function: its name (`blk0`, `net1`, `balloon`, `edu`), slot and function.
#[derive(Clone)]
pub struct AttachedPci {
    pub name: String,
    pub slot: PciSlot,
    pub function: PciFunction,
}

/// A function to attach, built once its slot is known.
pub enum NewPciFunction {
    /// A virtio device and its transport's options (the manager sets `intx_gsi` to the slot's).
    Virtio {
        device: Box<dyn lucid_virtio::VirtioDevice>,
        options: TransportOptions,
    },
    /// QEMU's edu DMA test device.
    Edu,
    /// A function built whole for its slot (a vfio-user device).
    Plain(Arc<Mutex<dyn PciDevice>>),
}

/// Slots 1 to 31 (0 is the host bridge), lowest free first.
struct SlotAllocator {
    used: BTreeSet<u8>,
}

impl SlotAllocator {
    fn allocate(&mut self) -> Option<PciSlot> {
        let slot = (1..lucid_pci::root::MAX_SLOTS).find(|s| !self.used.contains(s))?;
        self.used.insert(slot);
        Some(PciSlot::new(slot))
    }

    fn release(&mut self, slot: u8) {
        self.used.remove(&slot);
    }
}

struct State {
    slots: SlotAllocator,
    /// In attach order.
    attached: Vec<AttachedPci>,
}

/// The bus and what is on it.
pub(crate) struct PciBus {
    root: Arc<PciRoot>,
    env: TransportEnv,
    state: Mutex<State>,
}

/// What the bus's functions share with the rest of the VM.
pub(crate) struct PciParts<'a> {
    pub builder: &'a VmBuilder,
    pub router: &'a Arc<GsiRouter>,
    pub dma: &'a Arc<DmaPath>,
    pub hooks: &'a ExitHooks,
    pub stats: &'a Arc<StatsRegistry>,
    pub spawner: &'a lucid_thread::Spawner,
    /// The rungs the configured virtio devices ask for (which host capabilities to probe).
    pub rungs: Vec<Rung>,
}

impl PciBus {
    /// The root complex (0xCF8 ports and ECAM) with no function yet.
    pub(crate) fn new(p: PciParts<'_>) -> Result<Self, VmmError> {
        let b = p.builder;
        let host = HostCaps::probe(
            p.rungs.iter().copied(),
            lucid_hv::posted_interrupts_available,
            || lucid_probe::cpuid_intercepted(b.kvm()).unwrap_or(false),
        );
        let root = PciRoot::new(
            p.hooks.mmio.clone(),
            p.hooks.pio.clone(),
            PciWindows {
                mmio: layout::PCI_MMIO_START..layout::PCI_MMIO_END,
                io: 0xc000..0x1_0000,
                ecam: (layout::PCI_ECAM_START, layout::PCI_ECAM_SIZE),
            },
            p.stats,
        );
        root.register().map_err(VmmError::PciRoot)?;
        let env = TransportEnv {
            vm: b.vm().clone(),
            router: p.router.clone(),
            mem: b.memory().clone(),
            dma: p.dma.clone(),
            stats: p.stats.clone(),
            spawner: p.spawner.clone(),
            host,
        };
        Ok(PciBus {
            root,
            env,
            state: Mutex::new(State {
                slots: SlotAllocator {
                    used: BTreeSet::new(),
                },
                attached: Vec::new(),
            }),
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn stats(&self) -> &Arc<StatsRegistry> {
        &self.env.stats
    }

    pub(crate) fn spawner(&self) -> &lucid_thread::Spawner {
        &self.env.spawner
    }

    pub(crate) fn router(&self) -> &Arc<GsiRouter> {
        &self.env.router
    }

    pub(crate) fn attached(&self) -> Vec<AttachedPci> {
        self.lock().attached.clone()
    }

    /// Takes the lowest free slot, builds the function `build` makes for it and attaches it
    /// there; the slot is given back if either fails.
    pub(crate) fn attach(
        &self,
        name: &str,
        build: impl FnOnce(PciSlot) -> Result<NewPciFunction, VmmError>,
    ) -> Result<AttachedPci, VmmError> {
        let attach_err = |source| VmmError::PciAttach {
            device: name.to_string(),
            source,
        };
        let mut st = self.lock();
        if st.attached.iter().any(|a| a.name == name) {
            return Err(VmmError::DeviceExists(name.to_string()));
        }
        let slot = st.slots.allocate().ok_or(attach_err(PciError::BusFull))?;
        let attached = build(slot).and_then(|f| self.attach_at(name, slot, f));
        match attached {
            Ok(a) => {
                st.attached.push(a.clone());
                Ok(a)
            }
            Err(e) => {
                st.slots.release(slot.slot);
                Err(e)
            }
        }
    }

    fn attach_at(
        &self,
        name: &str,
        slot: PciSlot,
        f: NewPciFunction,
    ) -> Result<AttachedPci, VmmError> {
        let attach_err = |source| VmmError::PciAttach {
            device: name.to_string(),
            source,
        };
        let function = match f {
            NewPciFunction::Virtio {
                device,
                mut options,
            } => {
                options.intx_gsi = Some(slot.intx_gsi);
                let dev =
                    VirtioPciDevice::new(device, self.env.clone(), options).map_err(attach_err)?;
                let dev = lucid_pci::virtio::shared(dev);
                self.root
                    .add_device_at(slot.slot, name, dev.clone())
                    .map_err(attach_err)?;
                let plan = dev.lock().unwrap_or_else(|e| e.into_inner()).plan();
                if let Some(w) = plan.warning() {
                    log::warn!("{name}: {w}");
                }
                log::info!(
                    "{name}: PCI {} on rung {:?}: kicks by {}, interrupts by {:?}, back-end {:?}",
                    slot.address(),
                    plan.rung,
                    if plan.ioeventfd {
                        "ioeventfd"
                    } else {
                        "userspace exit"
                    },
                    plan.msi,
                    plan.notify,
                );
                PciFunction::Virtio(dev)
            }
            NewPciFunction::Edu => {
                let env = &self.env;
                let irq = lucid_pci::edu::KvmIrq::new(
                    env.vm.clone(),
                    env.router.clone(),
                    Some(slot.intx_gsi),
                );
                let dev = lucid_pci::EduDevice::new(
                    env.dma.clone(),
                    Arc::new(irq),
                    Some(slot.intx_gsi),
                    &env.stats,
                )
                .map_err(attach_err)?;
                let dev: Arc<Mutex<dyn PciDevice>> = Arc::new(Mutex::new(dev));
                self.root
                    .add_device_at(slot.slot, name, dev.clone())
                    .map_err(attach_err)?;
                log::info!(
                    "{name}: PCI {}, interrupts by MSI or INTx on GSI {}",
                    slot.address(),
                    slot.intx_gsi
                );
                PciFunction::Plain(dev)
            }
            NewPciFunction::Plain(dev) => {
                self.root
                    .add_device_at(slot.slot, name, dev.clone())
                    .map_err(attach_err)?;
                log::info!("{name}: PCI {}", slot.address());
                PciFunction::Plain(dev)
            }
        };
        Ok(AttachedPci {
            name: name.to_string(),
            slot,
            function,
        })
    }

    /// Takes the function in `slot` off the bus (see [`Self::detach`]), if there is one.
    pub(crate) fn detach_slot(&self, slot: u8) -> Option<AttachedPci> {
        let name = self
            .lock()
            .attached
            .iter()
            .find(|a| a.slot.slot == slot)
            .map(|a| a.name.clone())?;
        self.detach(&name).ok()
    }

    /// Takes function `name` off the bus: its BARs stop decoding, it is reset (a virtio
    /// device's back-end stops) and its slot is free for the next attach.
    pub(crate) fn detach(&self, name: &str) -> Result<AttachedPci, VmmError> {
        let mut st = self.lock();
        let i = st
            .attached
            .iter()
            .position(|a| a.name == name)
            .ok_or_else(|| VmmError::NoSuchDevice(name.to_string()))?;
        let a = st.attached.remove(i);
        self.root.remove_device(a.slot.slot);
        st.slots.release(a.slot.slot);
        log::info!("{name}: detached from PCI {}", a.slot.address());
        Ok(a)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_come_with_their_intx_line_lowest_free_first() {
        let mut a = SlotAllocator {
            used: BTreeSet::new(),
        };
        let s1 = a.allocate().unwrap();
        let s2 = a.allocate().unwrap();
        assert_eq!((s1.slot, s2.slot), (1, 2));
        for s in [s1, s2] {
            assert_eq!(s.intx_gsi, layout::pci_intx_gsi(s.slot, 0));
        }
        a.release(1);
        assert_eq!(a.allocate(), Some(s1));
        let rest = std::iter::from_fn(|| a.allocate()).count();
        assert_eq!(rest, usize::from(lucid_pci::root::MAX_SLOTS) - 3);
    }
}
