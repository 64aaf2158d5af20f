//! GSI routing for the in-kernel irqchip: the default PIC/IOAPIC routes plus one MSI route per
//! device interrupt vector that goes out by irqfd.
//!
//! `KVM_SET_GSI_ROUTING` replaces the whole table, so [`GsiRouter`] owns the table: it keeps the
//! routes `KVM_CREATE_IRQCHIP` installs (GSIs 0-15 to the PICs and the IOAPIC, 16-23 to the
//! IOAPIC) and adds, changes and drops MSI routes for GSIs it hands out from 24 up.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

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

/// Interrupt remapping (a vIOMMU's): turns the message a device wrote into the one KVM should
/// deliver, or blocks it.
pub trait MsiRemapper: Send + Sync {
    /// The message KVM should deliver for `msg` as written by requester `source`
    /// (bus << 8 | devfn); None blocks it (the remapper records its own fault).
    fn remap(&self, source: u16, msg: MsiMessage) -> Option<MsiMessage>;
}

/// One MSI route: what the guest programmed, by whom, and what is installed in KVM for it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Route {
    /// The requester ID (bus << 8 | devfn) of the device that owns the GSI.
    source: u16,
    /// The message as the guest wrote it (in the device's MSI-X table or MSI capability).
    msg: MsiMessage,
    /// What KVM routes the GSI to: `msg` remapped, or None while the remapper blocks it.
    installed: Option<MsiMessage>,
}

struct Table {
    /// GSI -> its MSI route; a GSI handed out but without a route is present with `None`.
    msi: BTreeMap<u32, Option<Route>>,
    /// Which GSIs from [`FIRST_MSI_GSI`] up are handed out (lowest free first).
    ids: vm_allocator::IdAllocator,
    /// One past the highest GSI KVM routes.
    max_gsi: u32,
}

/// The VM's GSI routing table. Shared (`Arc`) by every device that routes MSIs.
///
/// With a [`MsiRemapper`] installed the router keeps each GSI's guest-written message and
/// installs the remapped one; a blocked message installs no route for its GSI.
pub struct GsiRouter {
    vm: Vm,
    table: Mutex<Table>,
    remapper: RwLock<Option<Arc<dyn MsiRemapper>>>,
    /// Fast path: false while no remapper is installed, so unremapped MSIs take no lock.
    remapping: AtomicBool,
    /// Messages the remapper blocked: guest-written routes it refused, installed routes a refresh
    /// withdrew, and signalled MSIs it dropped.
    blocked: AtomicU64,
}

impl GsiRouter {
    /// A router for `vm`, whose in-kernel irqchip must exist already. Installs nothing until the
    /// first MSI route is set.
    pub fn new(vm: Vm) -> Arc<Self> {
        let max = vm
            .fd()
            .check_extension_raw(kvm_bindings::KVM_CAP_IRQ_ROUTING.into());
        // KVM_CAP_IRQ_ROUTING reports the number of GSIs (KVM_MAX_IRQ_ROUTES, e.g. 4096).
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
            remapper: RwLock::new(None),
            remapping: AtomicBool::new(false),
            blocked: AtomicU64::new(0),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn remapper(&self) -> Option<Arc<dyn MsiRemapper>> {
        if !self.remapping.load(Ordering::Acquire) {
            return None;
        }
        self.remapper
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// `msg` from `source` as KVM should deliver it (counts a block).
    fn resolve(
        &self,
        remapper: Option<&dyn MsiRemapper>,
        source: u16,
        msg: MsiMessage,
    ) -> Option<MsiMessage> {
        let out = resolve(remapper, source, msg);
        if out.is_none() {
            self.blocked.fetch_add(1, Ordering::Relaxed);
        }
        out
    }

    /// Hands out a free GSI (no route yet: an irqfd on it raises nothing until [`set_msi`]).
    ///
    /// [`set_msi`]: GsiRouter::set_msi
    pub fn allocate(&self) -> Result<u32, HvError> {
        let mut t = self.lock();
        let gsi = t
            .ids
            .allocate_id()
            .map_err(|_| HvError::GsiExhausted { max: t.max_gsi })?;
        t.msi.insert(gsi, None);
        Ok(gsi)
    }

    /// Routes `gsi` to `msg` as written by requester `source` (bus << 8 | devfn), remapped when
    /// a remapper is installed; commits the table only when the installed route changed.
    pub fn set_msi(&self, gsi: u32, source: u16, msg: MsiMessage) -> Result<(), HvError> {
        let remapper = self.remapper();
        let mut t = self.lock();
        let slot = t.msi.get_mut(&gsi).ok_or(HvError::GsiNotAllocated(gsi))?;
        let old = *slot;
        if matches!(old, Some(r) if r.source == source && r.msg == msg) {
            return Ok(());
        }
        let installed = self.resolve(remapper.as_deref(), source, msg);
        *slot = Some(Route {
            source,
            msg,
            installed,
        });
        if old.and_then(|r| r.installed) == installed {
            return Ok(());
        }
        if let Err(e) = self.commit(&t) {
            *t.msi.get_mut(&gsi).expect("present above") = old;
            return Err(e);
        }
        Ok(())
    }

    /// Drops `gsi`'s route (it stays allocated).
    pub fn clear(&self, gsi: u32) -> Result<(), HvError> {
        let mut t = self.lock();
        match t.msi.get_mut(&gsi) {
            Some(slot) if slot.is_some() => {
                let was_installed = slot.and_then(|r| r.installed).is_some();
                *slot = None;
                if was_installed {
                    self.commit(&t)
                } else {
                    Ok(())
                }
            }
            _ => Ok(()),
        }
    }

    /// Drops `gsi`'s route and returns it to the pool.
    pub fn release(&self, gsi: u32) -> Result<(), HvError> {
        let mut t = self.lock();
        let Some(route) = t.msi.remove(&gsi) else {
            return Ok(());
        };
        let _ = t.ids.free_id(gsi);
        if route.and_then(|r| r.installed).is_some() {
            return self.commit(&t);
        }
        Ok(())
    }

    /// Installs (or removes) the interrupt remapper and re-translates every route. A failure to
    /// commit the new table is logged; [`refresh`](GsiRouter::refresh) retries it.
    pub fn set_remapper(&self, r: Option<Arc<dyn MsiRemapper>>) {
        {
            let mut slot = self.remapper.write().unwrap_or_else(|e| e.into_inner());
            self.remapping.store(r.is_some(), Ordering::Release);
            *slot = r;
        }
        if let Err(e) = self.refresh() {
            log::warn!("GSI routes after a remapper change: {e}");
        }
    }

    /// Re-translates every route (after an interrupt-entry-cache invalidation or IR enable) and
    /// commits the table once, if any installed route changed.
    pub fn refresh(&self) -> Result<(), HvError> {
        let remapper = self.remapper();
        let mut t = self.lock();
        let mut changed = false;
        let gsis: Vec<u32> = t.msi.keys().copied().collect();
        for gsi in gsis {
            let Some(Some(r)) = t.msi.get(&gsi).copied() else {
                continue;
            };
            // Counted only when a route becomes blocked, not at every refresh that keeps it so.
            let installed = resolve(remapper.as_deref(), r.source, r.msg);
            if installed.is_none() && r.installed.is_some() {
                self.blocked.fetch_add(1, Ordering::Relaxed);
            }
            if installed != r.installed {
                changed = true;
                if let Some(Some(slot)) = t.msi.get_mut(&gsi) {
                    slot.installed = installed;
                }
            }
        }
        if changed {
            self.commit(&t)?;
        }
        Ok(())
    }

    /// `KVM_SIGNAL_MSI` of `msg` from requester `source`, through the remapper when one is
    /// installed (the L0 rung and devices without an irqfd). A blocked message is dropped and
    /// counted, not an error.
    pub fn signal_msi(&self, source: u16, msg: MsiMessage) -> Result<(), HvError> {
        let msg = if self.remapping.load(Ordering::Acquire) {
            let remapper = self.remapper();
            match self.resolve(remapper.as_deref(), source, msg) {
                Some(m) => m,
                None => return Ok(()),
            }
        } else {
            msg
        };
        self.vm.signal_msi(msg.address, msg.data)
    }

    /// The MSI route of `gsi` as the guest programmed it.
    pub fn route(&self, gsi: u32) -> Option<MsiMessage> {
        self.lock().msi.get(&gsi).copied().flatten().map(|r| r.msg)
    }

    /// The message KVM routes `gsi` to (None: no route, or blocked by the remapper).
    pub fn installed(&self, gsi: u32) -> Option<MsiMessage> {
        self.lock()
            .msi
            .get(&gsi)
            .copied()
            .flatten()
            .and_then(|r| r.installed)
    }

    /// How many messages the remapper has blocked (routes and signalled MSIs).
    pub fn blocked(&self) -> u64 {
        self.blocked.load(Ordering::Relaxed)
    }

    /// The whole table as it is (or would be) installed: default irqchip routes, then MSIs.
    pub fn entries(&self) -> Vec<kvm_irq_routing_entry> {
        table_entries(&self.lock())
    }

    fn commit(&self, t: &Table) -> Result<(), HvError> {
        self.vm.set_gsi_routing(&table_entries(t))
    }
}

/// What KVM should deliver for `msg` from `source`: itself without a remapper.
fn resolve(remapper: Option<&dyn MsiRemapper>, source: u16, msg: MsiMessage) -> Option<MsiMessage> {
    match remapper {
        Some(r) => r.remap(source, msg),
        None => Some(msg),
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
    for (&gsi, route) in &t.msi {
        if let Some(m) = route.and_then(|r| r.installed) {
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

    /// A VM with an irqchip (so the default routes exist) and its router.
    fn vm_and_router() -> (Vm, Arc<GsiRouter>) {
        let vm = Vm::new(crate::open_kvm().expect("KVM")).unwrap();
        vm.create_irqchip_and_pit().unwrap();
        let r = GsiRouter::new(vm.clone());
        (vm, r)
    }

    #[test]
    fn msi_routes_allocate_update_and_release() {
        let (vm, r) = vm_and_router();
        let a = r.allocate().unwrap();
        let b = r.allocate().unwrap();
        assert_eq!((a, b), (24, 25));
        let efd = EventFd::new(0).unwrap();
        vm.register_irqfd(&efd, a).unwrap();
        let m = MsiMessage {
            address: 0xfee0_0000,
            data: 0x41,
        };
        r.set_msi(a, 0x08, m).unwrap();
        r.set_msi(a, 0x08, m).unwrap();
        assert_eq!(r.route(a), Some(m));
        assert_eq!(r.entries().len(), 41);
        r.release(a).unwrap();
        assert_eq!(r.allocate().unwrap(), 24);
        assert!(r.set_msi(99, 0x08, m).is_err());
        // Legacy irqfds keep working: GSI 4 still routes to the PIC/IOAPIC.
        let serial = EventFd::new(0).unwrap();
        vm.register_irqfd(&serial, 4).unwrap();
    }

    /// Remaps by adding the source to the vector; blocks source 0xdead and, once `block_all`
    /// is set, everything.
    struct Double {
        block_all: AtomicBool,
    }

    impl MsiRemapper for Double {
        fn remap(&self, source: u16, msg: MsiMessage) -> Option<MsiMessage> {
            if source == 0xdead || self.block_all.load(Ordering::Relaxed) {
                return None;
            }
            Some(MsiMessage {
                address: msg.address,
                data: msg.data + u32::from(source),
            })
        }
    }

    #[test]
    fn resolve_without_remapper_is_the_identity() {
        let m = MsiMessage {
            address: 0xfee0_1000,
            data: 0x33,
        };
        assert_eq!(resolve(None, 7, m), Some(m));
        let d = Double {
            block_all: AtomicBool::new(false),
        };
        assert_eq!(
            resolve(Some(&d), 2, m),
            Some(MsiMessage {
                address: m.address,
                data: 0x35
            })
        );
        assert_eq!(resolve(Some(&d), 0xdead, m), None);
    }

    #[test]
    fn remapper_installs_remapped_routes_and_blocks() {
        let (_vm, r) = vm_and_router();
        let a = r.allocate().unwrap();
        let b = r.allocate().unwrap();
        let m = MsiMessage {
            address: 0xfee0_0000,
            data: 0x40,
        };
        // Before a remapper: installed as written.
        r.set_msi(a, 1, m).unwrap();
        assert_eq!(r.installed(a), Some(m));
        let d = Arc::new(Double {
            block_all: AtomicBool::new(false),
        });
        r.set_remapper(Some(d.clone()));
        // set_remapper re-translated the existing route.
        assert_eq!(r.route(a), Some(m));
        assert_eq!(r.installed(a).map(|m| m.data), Some(0x41));
        // A blocked source: the guest's message is kept, no route installed, counted.
        r.set_msi(b, 0xdead, m).unwrap();
        assert_eq!(r.route(b), Some(m));
        assert_eq!(r.installed(b), None);
        assert_eq!(r.blocked(), 1);
        assert_eq!(r.entries().len(), 41);
        // refresh picks up the remapper's new answers.
        d.block_all.store(true, Ordering::Relaxed);
        r.refresh().unwrap();
        assert_eq!(r.installed(a), None);
        assert_eq!(r.entries().len(), 40);
        // Only the route that became blocked counts; a second refresh counts nothing.
        assert_eq!(r.blocked(), 2);
        r.refresh().unwrap();
        assert_eq!(r.blocked(), 2);
        // Signalled MSIs go through the remapper too: blocked ones are dropped, not errors.
        let before = r.blocked();
        r.signal_msi(1, m).unwrap();
        assert_eq!(r.blocked(), before + 1);
        // Removing the remapper restores the guest's messages.
        r.set_remapper(None);
        assert_eq!(r.installed(a), Some(m));
        assert_eq!(r.installed(b), Some(m));
        // (KVM refuses an MSI no vCPU accepts: this VM has none; only the count matters.)
        let blocked = r.blocked();
        let _ = r.signal_msi(1, m);
        assert_eq!(r.blocked(), blocked);
        assert_eq!(r.entries().len(), 42);
    }
}
