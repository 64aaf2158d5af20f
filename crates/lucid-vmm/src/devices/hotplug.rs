//! ACPI PCI hotplug and the ACPI power button: the controller whose registers
//! (`lucid_boot::layout::pci_hotplug`) the DSDT's AML reads when the Generic Event Device's
//! interrupt fires (`lucid_boot::acpi`, docs/api.md).
//!
//! Adding a device: the VMM attaches it to a free slot, sets the slot's bit in `UP` and
//! `EVENT_PCI`, and pulses the GED line; the guest's `_EVT` runs `PCNT`, which sends Device Check
//! to the slot, and Linux's `acpiphp` scans it. Removing one: the VMM sets the slot's bit in
//! `DOWN`; `PCNT` sends Eject Request, Linux releases the device and runs the slot's `_EJ0`,
//! which writes the bit to `EJECT`; then, on the vCPU that wrote it, the device is detached
//! (its back-end thread joined, its files closed). A guest that never ejects keeps the device.

use std::sync::{Arc, Mutex, MutexGuard, Weak};

use lucid_boot::layout::pci_hotplug as regs;
use lucid_devices::BusDevice;
use lucid_stats::{Counter, StatsRegistry};
use vmm_sys_util::eventfd::EventFd;

use super::pci::PciBus;

/// The controller's state, shared by the VMM side and the guest's port accesses.
pub(crate) struct PciHotplug {
    regs: Mutex<Regs>,
    /// Signals the GED's GSI (an irqfd: each write is an edge).
    ged: EventFd,
    /// The bus whose slots the guest ejects.
    bus: Weak<PciBus>,
    counters: HotplugCounters,
}

#[derive(Default)]
struct Regs {
    up: u32,
    down: u32,
    events: u32,
}

struct HotplugCounters {
    added: Arc<Counter>,
    removal_requests: Arc<Counter>,
    ejected: Arc<Counter>,
    refused_ejects: Arc<Counter>,
    power_button: Arc<Counter>,
}

impl PciHotplug {
    pub(crate) fn new(ged: EventFd, bus: Weak<PciBus>, stats: &StatsRegistry) -> Self {
        PciHotplug {
            regs: Mutex::new(Regs::default()),
            ged,
            bus,
            counters: HotplugCounters {
                added: stats.counter("hotplug.added"),
                removal_requests: stats.counter("hotplug.removal_requests"),
                ejected: stats.counter("hotplug.ejected"),
                refused_ejects: stats.counter("hotplug.refused_ejects"),
                power_button: stats.counter("hotplug.power_button"),
            },
        }
    }

    fn lock(&self) -> MutexGuard<'_, Regs> {
        self.regs.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn signal(&self, mut regs: MutexGuard<'_, Regs>, event: u32) {
        regs.events |= event;
        drop(regs);
        if let Err(e) = self.ged.write(1) {
            log::error!("PCI hotplug: cannot signal the GED interrupt: {e}");
        }
    }

    /// Tells the guest that `slot` has a new device.
    pub(crate) fn plugged(&self, slot: u8) {
        let mut r = self.lock();
        r.up |= 1 << slot;
        r.down &= !(1 << slot);
        self.counters.added.inc();
        self.signal(r, regs::EVENT_PCI);
    }

    /// Asks the guest to release the device in `slot`.
    pub(crate) fn unplug_requested(&self, slot: u8) {
        let mut r = self.lock();
        r.down |= 1 << slot;
        self.counters.removal_requests.inc();
        self.signal(r, regs::EVENT_PCI);
    }

    /// Whether the guest has been asked to release `slot` and has not yet.
    pub(crate) fn removal_pending(&self, slot: u8) -> bool {
        self.lock().down & (1 << slot) != 0
    }

    /// Presses the ACPI power button.
    pub(crate) fn press_power_button(&self) {
        let r = self.lock();
        self.counters.power_button.inc();
        self.signal(r, regs::EVENT_POWER_BUTTON);
    }

    /// The guest ejected the slots in `mask`: detach their devices. Slot 0 (the host bridge)
    /// and empty slots are ignored; a device is dropped here, so its back-end's files close.
    fn ejected(&self, mask: u32) {
        let Some(bus) = self.bus.upgrade() else {
            return;
        };
        for slot in (1..32u8).filter(|s| mask & (1 << s) != 0) {
            self.lock().down &= !(1 << slot);
            match bus.detach_slot(slot) {
                Some(a) => {
                    self.counters.ejected.inc();
                    log::info!("{}: ejected by the guest from slot {slot}", a.name);
                }
                None => self.counters.refused_ejects.inc(),
            }
        }
    }
}

/// The controller's ports on the I/O bus.
pub(crate) struct HotplugPorts(pub Arc<PciHotplug>);

impl BusDevice for HotplugPorts {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        let mut r = self.0.lock();
        let value = match offset {
            regs::UP => std::mem::take(&mut r.up),
            regs::DOWN => r.down,
            regs::EVENT => std::mem::take(&mut r.events),
            _ => 0,
        };
        let bytes = value.to_le_bytes();
        let n = data.len().min(4);
        data[..n].copy_from_slice(&bytes[..n]);
        data[n..].fill(0);
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        if offset != regs::EJECT || data.len() != 4 {
            return;
        }
        let mask = u32::from_le_bytes([data[0], data[1], data[2], data[3]]);
        self.0.ejected(mask);
    }
}
