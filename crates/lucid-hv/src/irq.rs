//! GSI routing for the in-kernel irqchip: the default PIC/IOAPIC routes plus one MSI route per
//! device interrupt vector that goes out by irqfd.
//!
//! `KVM_SET_GSI_ROUTING` replaces the whole table, so [`GsiRouter`] owns the table: it keeps the
//! routes `KVM_CREATE_IRQCHIP` installs (GSIs 0-15 to the PICs and the IOAPIC, 16-23 to the
//! IOAPIC) and adds, changes and drops MSI routes for GSIs it hands out from 24 up.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use kvm_bindings::{
    kvm_irq_routing_entry, KvmIrqRouting, KVM_IRQCHIP_IOAPIC, KVM_IRQCHIP_PIC_MASTER,
    KVM_IRQCHIP_PIC_SLAVE, KVM_IRQ_ROUTING_IRQCHIP, KVM_IRQ_ROUTING_MSI,
};

use crate::{HvError, Vm};

/// IOAPIC pins (and GSIs) the in-kernel IOAPIC has.
pub const IOAPIC_PINS: u32 = 24;
/// The first GSI [`GsiRouter::allocate`] hands out.
pub const FIRST_MSI_GSI: u32 = IOAPIC_PINS;

/// An MSI message: what a device writes, where.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MsiMessage {
    pub address: u64,
    pub data: u32,
}

/// Interrupt remapping seam: an IOMMU that rewrites (or blocks) the MSIs devices write.
pub trait MsiRemapper: Send + Sync {
    /// The message KVM should deliver for `msg` as written by requester `source`
    /// (bus << 8 | devfn); None blocks it (the remapper records its own fault).
    fn remap(&self, source: u16, msg: MsiMessage) -> Option<MsiMessage>;
}

struct Table {
    /// GSI -> its MSI route; a GSI handed out but without a route is present with `None`.
    msi: BTreeMap<u32, Option<MsiMessage>>,
    /// Which GSIs from [`FIRST_MSI_GSI`] up are handed out (lowest free first).
    ids: vm_allocator::IdAllocator,
    /// One past the highest GSI KVM routes.
    max_gsi: u32,
}

/// The VM's GSI routing table. Shared (`Arc`) by every device that routes MSIs.
pub struct GsiRouter {
    vm: Vm,
    table: Mutex<Table>,
}

impl GsiRouter {
    /// A router for `vm`, whose in-kernel irqchip must exist already. Installs nothing until the
    /// first MSI route is set.
    pub fn new(vm: Vm) -> Arc<Self> {
        let max = vm
            .fd()
            .check_extension_raw(kvm_bindings::KVM_CAP_IRQ_ROUTING.into());
        // KVM_CAP_IRQ_ROUTING reports the number of GSIs (KVM_MAX_IRQ_ROUTES, 4096 today).
        let max_gsi = if max > FIRST_MSI_GSI as i32 {
            max as u32
        } else {
            1024
        };
        Arc::new(GsiRouter {
            vm,
            table: Mutex::new(Table {
                msi: BTreeMap::new(),
                ids: vm_allocator::IdAllocator::new(FIRST_MSI_GSI, max_gsi - 1)
                    .expect("FIRST_MSI_GSI < max_gsi"),
                max_gsi,
            }),
        })
    }

    /// Hands out a free GSI (no route yet: an irqfd on it raises nothing until [`set_msi`]).
    ///
    /// [`set_msi`]: GsiRouter::set_msi
    pub fn allocate(&self) -> Result<u32, HvError> {
        let mut t = self.table.lock().unwrap_or_else(|e| e.into_inner());
        let gsi = t
            .ids
            .allocate_id()
            .map_err(|_| HvError::GsiExhausted { max: t.max_gsi })?;
        t.msi.insert(gsi, None);
        Ok(gsi)
    }

    /// Routes `gsi` to `msg`; commits the table only when the route changed.
    pub fn set_msi(&self, gsi: u32, msg: MsiMessage) -> Result<(), HvError> {
        let mut t = self.table.lock().unwrap_or_else(|e| e.into_inner());
        let slot = t.msi.get_mut(&gsi).ok_or(HvError::GsiNotAllocated(gsi))?;
        if *slot == Some(msg) {
            return Ok(());
        }
        let old = slot.replace(msg);
        if let Err(e) = self.commit(&t) {
            *t.msi.get_mut(&gsi).expect("present above") = old;
            return Err(e);
        }
        Ok(())
    }

    /// Drops `gsi`'s route (it stays allocated).
    pub fn clear(&self, gsi: u32) -> Result<(), HvError> {
        let mut t = self.table.lock().unwrap_or_else(|e| e.into_inner());
        match t.msi.get_mut(&gsi) {
            Some(slot) if slot.is_some() => {
                *slot = None;
                self.commit(&t)
            }
            _ => Ok(()),
        }
    }

    /// Drops `gsi`'s route and returns it to the pool.
    pub fn release(&self, gsi: u32) -> Result<(), HvError> {
        let mut t = self.table.lock().unwrap_or_else(|e| e.into_inner());
        let Some(route) = t.msi.remove(&gsi) else {
            return Ok(());
        };
        let _ = t.ids.free_id(gsi);
        if route.is_some() {
            return self.commit(&t);
        }
        Ok(())
    }

    /// The current MSI route of `gsi`.
    pub fn route(&self, gsi: u32) -> Option<MsiMessage> {
        let t = self.table.lock().unwrap_or_else(|e| e.into_inner());
        t.msi.get(&gsi).copied().flatten()
    }

    /// The whole table as it is (or would be) installed: default irqchip routes, then MSIs.
    pub fn entries(&self) -> Vec<kvm_irq_routing_entry> {
        let t = self.table.lock().unwrap_or_else(|e| e.into_inner());
        table_entries(&t)
    }

    fn commit(&self, t: &Table) -> Result<(), HvError> {
        self.vm.set_gsi_routing(&table_entries(t))
    }
}

/// The routes `KVM_CREATE_IRQCHIP` installs (the kernel's `kvm_setup_default_irq_routing`).
pub fn default_irqchip_routes() -> Vec<kvm_irq_routing_entry> {
    let mut v = Vec::new();
    let chip = |gsi: u32, irqchip: u32, pin: u32| {
        let mut e = kvm_irq_routing_entry {
            gsi,
            type_: KVM_IRQ_ROUTING_IRQCHIP,
            ..Default::default()
        };
        e.u.irqchip.irqchip = irqchip;
        e.u.irqchip.pin = pin;
        e
    };
    for gsi in 0..IOAPIC_PINS {
        if gsi < 8 {
            v.push(chip(gsi, KVM_IRQCHIP_PIC_MASTER, gsi));
        } else if gsi < 16 {
            v.push(chip(gsi, KVM_IRQCHIP_PIC_SLAVE, gsi - 8));
        }
        v.push(chip(gsi, KVM_IRQCHIP_IOAPIC, gsi));
    }
    v
}

fn table_entries(t: &Table) -> Vec<kvm_irq_routing_entry> {
    let mut v = default_irqchip_routes();
    for (&gsi, msg) in &t.msi {
        if let Some(m) = msg {
            let mut e = kvm_irq_routing_entry {
                gsi,
                type_: KVM_IRQ_ROUTING_MSI,
                ..Default::default()
            };
            e.u.msi.address_lo = m.address as u32;
            e.u.msi.address_hi = (m.address >> 32) as u32;
            e.u.msi.data = m.data;
            v.push(e);
        }
    }
    v
}

impl Vm {
    /// `KVM_SET_GSI_ROUTING`: replaces the VM's whole routing table with `entries`. Use
    /// [`GsiRouter`] rather than calling this directly, so that routes are not lost.
    pub fn set_gsi_routing(&self, entries: &[kvm_irq_routing_entry]) -> Result<(), HvError> {
        let mut routing = KvmIrqRouting::new(entries.len())
            .map_err(|_| HvError::RoutingTableTooLarge(entries.len()))?;
        routing.as_mut_slice().copy_from_slice(entries);
        self.fd()
            .set_gsi_routing(&routing)
            .map_err(|e| HvError::Ioctl("KVM_SET_GSI_ROUTING", e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vmm_sys_util::eventfd::EventFd;

    #[test]
    fn defaults_match_the_kernel() {
        let d = default_irqchip_routes();
        // 16 PIC routes + 24 IOAPIC routes.
        assert_eq!(d.len(), 40);
        assert!(d.iter().all(|e| e.type_ == KVM_IRQ_ROUTING_IRQCHIP));
    }

    #[test]
    fn msi_routes_allocate_update_and_release() {
        let kvm = crate::open_kvm().expect("KVM");
        let vm = Vm::new(kvm).unwrap();
        vm.create_irqchip_and_pit().unwrap();
        let r = GsiRouter::new(vm.clone());
        let a = r.allocate().unwrap();
        let b = r.allocate().unwrap();
        assert_eq!((a, b), (24, 25));
        let efd = EventFd::new(0).unwrap();
        vm.register_irqfd(&efd, a).unwrap();
        let m = MsiMessage {
            address: 0xfee0_0000,
            data: 0x41,
        };
        r.set_msi(a, m).unwrap();
        r.set_msi(a, m).unwrap();
        assert_eq!(r.route(a), Some(m));
        assert_eq!(r.entries().len(), 41);
        r.release(a).unwrap();
        assert_eq!(r.allocate().unwrap(), 24);
        assert!(r.set_msi(99, m).is_err());
        // Legacy irqfds keep working: GSI 4 still routes to the PIC/IOAPIC.
        let serial = EventFd::new(0).unwrap();
        vm.register_irqfd(&serial, 4).unwrap();
    }
}
