//! A KVM VM: memory slots, the in-kernel irqchip and PIT, vCPU creation, and the paths that keep
//! a device's notifications and interrupts out of userspace (ioeventfd, irqfd, MSI routing).

use std::sync::{Arc, Mutex};

use kvm_bindings::{
    kvm_msi, kvm_pit_config, kvm_userspace_memory_region, KVM_MEM_READONLY, KVM_PIT_SPEAKER_DUMMY,
};
use kvm_ioctls::{IoEventAddress, Kvm, NoDatamatch, VmFd};
use vm_memory::{GuestMemoryBackend, GuestMemoryRegion};
use vmm_sys_util::eventfd::EventFd;

use crate::{HvError, Vcpu};

/// Where an ioeventfd listens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IoAddr {
    Pio(u16),
    Mmio(u64),
}

impl From<IoAddr> for IoEventAddress {
    fn from(a: IoAddr) -> Self {
        match a {
            IoAddr::Pio(p) => IoEventAddress::Pio(p as u64),
            IoAddr::Mmio(m) => IoEventAddress::Mmio(m),
        }
    }
}

/// The guest memory type KVM slots are made from (the one Lucid uses everywhere).
pub type GuestMemoryMmap = vm_memory::GuestMemoryMmap<()>;

/// One VM. Cheap to clone: device threads hold it to raise interrupts.
#[derive(Clone)]
pub struct Vm {
    inner: Arc<VmInner>,
    kvm: Arc<Kvm>,
}

/// Field order is drop order: the VM fd (and with it every memory slot) closes before the
/// guest memory the slots point into is released.
pub(crate) struct VmInner {
    fd: VmFd,
    /// Clones of the guest memory given to [`Vm::map_memory`]: they keep the host mappings
    /// alive for as long as a slot may point into them.
    memory: Mutex<Vec<GuestMemoryMmap>>,
    /// Slots added and removed while the VM runs ([`Vm::map_slot`]), with the memory each one
    /// points into (kept until the slot is gone).
    extra: Mutex<std::collections::HashMap<u32, GuestMemoryMmap>>,
}

/// Slot numbers from here up are [`Vm::map_slot`]'s; [`Vm::map_memory`] numbers from 0.
pub const EXTRA_SLOT_BASE: u32 = 256;

impl Vm {
    /// A new VM, with the TSS and identity-map pages (which VT-x needs for real mode) placed in a
    /// hole below 4 GiB that is not RAM.
    pub fn new(kvm: Arc<Kvm>) -> Result<Self, HvError> {
        let fd = kvm
            .create_vm()
            .map_err(|e| HvError::Ioctl("KVM_CREATE_VM", e))?;
        fd.set_identity_map_address(0xfeffc000)
            .map_err(|e| HvError::Ioctl("KVM_SET_IDENTITY_MAP_ADDR", e))?;
        fd.set_tss_address(0xfeffd000)
            .map_err(|e| HvError::Ioctl("KVM_SET_TSS_ADDR", e))?;
        Ok(Vm {
            inner: Arc::new(VmInner {
                fd,
                memory: Mutex::new(Vec::new()),
                extra: Mutex::new(std::collections::HashMap::new()),
            }),
            kvm,
        })
    }

    pub fn kvm(&self) -> &Kvm {
        &self.kvm
    }

    /// Makes every region of `mem` guest RAM at its guest-physical address, one read-write
    /// memory slot per region (numbered after the slots of earlier calls). The VM keeps a clone
    /// of `mem`, so the mappings outlive the slots. Remapping pages inside a region (MAP_FIXED)
    /// is fine: KVM follows them.
    pub fn map_memory(&self, mem: &GuestMemoryMmap) -> Result<(), HvError> {
        let mut kept = self.inner.memory.lock().unwrap_or_else(|e| e.into_inner());
        let first_slot: usize = kept.iter().map(|m| m.num_regions()).sum();
        for (i, r) in mem.iter().enumerate() {
            let host_addr = mem
                .get_host_address(r.start_addr())
                .map_err(|_| HvError::BadMemory(r.start_addr().0))?;
            let region = kvm_userspace_memory_region {
                slot: (first_slot + i) as u32,
                guest_phys_addr: r.start_addr().0,
                memory_size: r.len(),
                userspace_addr: host_addr as u64,
                flags: 0,
            };
            // SAFETY: the host range is this region's own mapping, and `kept` (dropped after the
            // VM fd, see `VmInner`) holds a clone of `mem`, so the mapping outlives the slot.
            unsafe { self.inner.fd.set_user_memory_region(region) }
                .map_err(|e| HvError::Ioctl("KVM_SET_USER_MEMORY_REGION", e))?;
        }
        kept.push(mem.clone());
        Ok(())
    }

    /// Adds memory slot `slot` (at least [`EXTRA_SLOT_BASE`]) for the single region of `mem`,
    /// while the VM runs. `read_only` makes it a `KVM_MEM_READONLY` slot: the guest reads and
    /// executes it, and its writes come to userspace as MMIO exits. Lucid keeps `mem` until
    /// [`Vm::unmap_slot`].
    pub fn map_slot(
        &self,
        slot: u32,
        mem: &GuestMemoryMmap,
        read_only: bool,
    ) -> Result<(), HvError> {
        let r = match (
            slot >= EXTRA_SLOT_BASE,
            mem.num_regions(),
            mem.iter().next(),
        ) {
            (true, 1, Some(r)) => r,
            _ => return Err(HvError::BadMemory(slot as u64)),
        };
        if read_only && !self.kvm.check_extension(kvm_ioctls::Cap::ReadonlyMem) {
            return Err(HvError::MissingCap("KVM_CAP_READONLY_MEM"));
        }
        let mut extra = self.inner.extra.lock().unwrap_or_else(|e| e.into_inner());
        let host_addr = mem
            .get_host_address(r.start_addr())
            .map_err(|_| HvError::BadMemory(r.start_addr().0))?;
        let region = kvm_userspace_memory_region {
            slot,
            guest_phys_addr: r.start_addr().0,
            memory_size: r.len(),
            userspace_addr: host_addr as u64,
            flags: if read_only { KVM_MEM_READONLY } else { 0 },
        };
        // SAFETY: the host range is the region's own mapping, kept alive by the clone stored in
        // `extra` until the slot is removed (and `VmInner` drops the VM fd first).
        unsafe { self.inner.fd.set_user_memory_region(region) }
            .map_err(|e| HvError::Ioctl("KVM_SET_USER_MEMORY_REGION", e))?;
        extra.insert(slot, mem.clone());
        Ok(())
    }

    /// Removes a slot [`Vm::map_slot`] added; false when there was none.
    pub fn unmap_slot(&self, slot: u32) -> Result<bool, HvError> {
        let mut extra = self.inner.extra.lock().unwrap_or_else(|e| e.into_inner());
        let Some(mem) = extra.get(&slot) else {
            return Ok(false);
        };
        let gpa = mem.iter().next().map(|r| r.start_addr().0).unwrap_or(0);
        let region = kvm_userspace_memory_region {
            slot,
            guest_phys_addr: gpa,
            memory_size: 0,
            userspace_addr: 0,
            flags: 0,
        };
        // SAFETY: size 0 deletes the slot; KVM stops using the old host range before returning.
        unsafe { self.inner.fd.set_user_memory_region(region) }
            .map_err(|e| HvError::Ioctl("KVM_SET_USER_MEMORY_REGION", e))?;
        extra.remove(&slot);
        Ok(true)
    }

    /// Slots added with [`Vm::map_slot`] and not removed.
    pub fn extra_slots(&self) -> Vec<u32> {
        let mut v: Vec<u32> = self
            .inner
            .extra
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .keys()
            .copied()
            .collect();
        v.sort_unstable();
        v
    }

    /// The in-kernel PIC, IOAPIC, LAPICs and PIT: the timer devices Linux needs, with no exits
    /// for their common paths.
    pub fn create_irqchip_and_pit(&self) -> Result<(), HvError> {
        self.inner
            .fd
            .create_irq_chip()
            .map_err(|e| HvError::Ioctl("KVM_CREATE_IRQCHIP", e))?;
        let pit = kvm_pit_config {
            flags: KVM_PIT_SPEAKER_DUMMY,
            ..Default::default()
        };
        self.inner
            .fd
            .create_pit2(pit)
            .map_err(|e| HvError::Ioctl("KVM_CREATE_PIT2", e))
    }

    pub fn create_vcpu(&self, id: u32) -> Result<Vcpu, HvError> {
        let fd = self
            .inner
            .fd
            .create_vcpu(id as u64)
            .map_err(|e| HvError::Ioctl("KVM_CREATE_VCPU", e))?;
        // KVM_CHECK_EXTENSION answers with the state KVM can mirror in kvm_run.
        let all = u64::from(
            kvm_bindings::KVM_SYNC_X86_REGS
                | kvm_bindings::KVM_SYNC_X86_SREGS
                | kvm_bindings::KVM_SYNC_X86_EVENTS,
        );
        let offered = self
            .inner
            .fd
            .check_extension_raw(u64::from(kvm_bindings::KVM_CAP_SYNC_REGS));
        let can_sync = offered > 0 && (offered as u64) & all == all;
        Ok(Vcpu::new(id, fd, self.inner.clone(), can_sync))
    }

    /// A guest write of `len` bytes (or any size for `len == 0`) to `addr` signals `fd` in the
    /// kernel, without an exit to userspace.
    pub fn register_ioeventfd(&self, fd: &EventFd, addr: IoAddr) -> Result<(), HvError> {
        self.inner
            .fd
            .register_ioevent(fd, &IoEventAddress::from(addr), NoDatamatch)
            .map_err(|e| HvError::Ioctl("KVM_IOEVENTFD", e))
    }

    pub fn unregister_ioeventfd(&self, fd: &EventFd, addr: IoAddr) -> Result<(), HvError> {
        self.inner
            .fd
            .unregister_ioevent(fd, &IoEventAddress::from(addr), NoDatamatch)
            .map_err(|e| HvError::Ioctl("KVM_IOEVENTFD(deassign)", e))
    }

    /// Writing to `fd` raises `gsi` in the in-kernel irqchip.
    pub fn register_irqfd(&self, fd: &EventFd, gsi: u32) -> Result<(), HvError> {
        self.inner
            .fd
            .register_irqfd(fd, gsi)
            .map_err(|e| HvError::Ioctl("KVM_IRQFD", e))
    }

    pub fn unregister_irqfd(&self, fd: &EventFd, gsi: u32) -> Result<(), HvError> {
        self.inner
            .fd
            .unregister_irqfd(fd, gsi)
            .map_err(|e| HvError::Ioctl("KVM_IRQFD(deassign)", e))
    }

    pub fn set_irq_line(&self, irq: u32, active: bool) -> Result<(), HvError> {
        self.inner
            .fd
            .set_irq_line(irq, active)
            .map_err(|e| HvError::Ioctl("KVM_IRQ_LINE", e))
    }

    /// Injects one MSI from userspace (the ladder's L0 interrupt path).
    pub fn signal_msi(&self, address: u64, data: u32) -> Result<(), HvError> {
        let msi = kvm_msi {
            address_lo: address as u32,
            address_hi: (address >> 32) as u32,
            data,
            ..Default::default()
        };
        self.inner
            .fd
            .signal_msi(msi)
            .map(|_| ())
            .map_err(|e| HvError::Ioctl("KVM_SIGNAL_MSI", e))
    }

    /// The VM's KVM statistics file, if the kernel has `KVM_CAP_BINARY_STATS_FD`.
    pub fn stats(&self) -> Option<crate::KvmStats> {
        crate::kvm_stats::KvmStats::open(&self.inner.fd)
    }

    /// Sends guest RDMSR/WRMSR of `indices` to userspace (as `Exit::RdMsr`/`Exit::WrMsr`); all
    /// other MSRs stay with KVM. Replaces the previous set.
    pub fn trap_msrs(&self, indices: &[u32]) -> Result<(), HvError> {
        use kvm_bindings::{
            kvm_enable_cap, KVM_CAP_X86_USER_SPACE_MSR, KVM_MSR_EXIT_REASON_FILTER,
        };
        use kvm_ioctls::{MsrFilterDefaultAction, MsrFilterRange, MsrFilterRangeFlags};
        if indices.len() > kvm_bindings::KVM_MSR_FILTER_MAX_RANGES as usize {
            return Err(HvError::TooManyMsrs {
                count: indices.len(),
                max: kvm_bindings::KVM_MSR_FILTER_MAX_RANGES as usize,
            });
        }
        let cap = kvm_enable_cap {
            cap: KVM_CAP_X86_USER_SPACE_MSR,
            args: [KVM_MSR_EXIT_REASON_FILTER as u64, 0, 0, 0],
            ..Default::default()
        };
        self.inner
            .fd
            .enable_cap(&cap)
            .map_err(|e| HvError::Ioctl("KVM_ENABLE_CAP(X86_USER_SPACE_MSR)", e))?;
        // A clear bit denies the access in the kernel, which with the FILTER reason enabled
        // becomes an exit to userspace.
        let deny = [0u8; 1];
        let ranges: Vec<MsrFilterRange> = indices
            .iter()
            .map(|&i| MsrFilterRange {
                flags: MsrFilterRangeFlags::READ | MsrFilterRangeFlags::WRITE,
                base: i,
                msr_count: 1,
                bitmap: &deny,
            })
            .collect();
        self.inner
            .fd
            .set_msr_filter(MsrFilterDefaultAction::ALLOW, &ranges)
            .map_err(|e| HvError::Ioctl("KVM_X86_SET_MSR_FILTER", e))
    }

    /// Turns off KVM's "fix hypercall instruction" quirk (`KVM_X86_QUIRK_FIX_HYPERCALL_INSN`):
    /// when KVM's instruction emulator meets `vmcall`/`vmmcall` it then injects #UD instead of
    /// rewriting the instruction to the host vendor's and re-running it. Where all guest kernel
    /// code goes through that emulator (PVM), the rewritten instruction comes straight back to it,
    /// and the vCPU spins in the kernel for good (docs/linux.md, "The ptp_kvm_init hang").
    /// Returns whether KVM offers the switch; without it the quirk stays on.
    pub fn disable_hypercall_patching(&self) -> Result<bool, HvError> {
        use kvm_bindings::{
            kvm_enable_cap, KVM_CAP_DISABLE_QUIRKS2, KVM_X86_QUIRK_FIX_HYPERCALL_INSN,
        };
        let quirk = u64::from(KVM_X86_QUIRK_FIX_HYPERCALL_INSN);
        // KVM_CHECK_EXTENSION answers with the quirks that may be disabled.
        let offered = self
            .fd()
            .check_extension_raw(u64::from(KVM_CAP_DISABLE_QUIRKS2)) as u64;
        if offered & quirk == 0 {
            log::debug!("KVM cannot disable the fix-hypercall quirk (offers {offered:#x})");
            return Ok(false);
        }
        let cap = kvm_enable_cap {
            cap: KVM_CAP_DISABLE_QUIRKS2,
            args: [quirk, 0, 0, 0],
            ..Default::default()
        };
        self.fd()
            .enable_cap(&cap)
            .map_err(|e| HvError::Ioctl("KVM_ENABLE_CAP(DISABLE_QUIRKS2)", e))?;
        Ok(true)
    }

    /// Whether KVM lets this VM set its own halt-polling interval (`KVM_CAP_HALT_POLL`, 5.7+).
    pub fn has_halt_poll(&self) -> bool {
        self.fd()
            .check_extension_raw(u64::from(kvm_bindings::KVM_CAP_HALT_POLL))
            > 0
    }

    /// How long (ns) a halted vCPU of this VM polls for a wake-up before it sleeps, overriding
    /// the `halt_poll_ns` module parameter: 0 turns polling off. May be changed while the VM
    /// runs (the pools do, per policy).
    pub fn set_halt_poll_ns(&self, ns: u32) -> Result<(), HvError> {
        let cap = kvm_bindings::kvm_enable_cap {
            cap: kvm_bindings::KVM_CAP_HALT_POLL,
            args: [u64::from(ns), 0, 0, 0],
            ..Default::default()
        };
        self.fd()
            .enable_cap(&cap)
            .map_err(|e| HvError::Ioctl("KVM_ENABLE_CAP(HALT_POLL)", e))
    }

    /// The raw fd, for capabilities this seam does not wrap yet.
    pub fn fd(&self) -> &VmFd {
        &self.inner.fd
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vm_memory::GuestAddress;

    #[test]
    fn read_only_slots_come_and_go() {
        let kvm = crate::open_kvm().expect("KVM");
        let vm = Vm::new(kvm).unwrap();
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0x7000_0000), 0x10_0000)]).unwrap();
        // Below the extra range, or not one region: refused.
        assert!(vm.map_slot(3, &mem, true).is_err());
        vm.map_slot(EXTRA_SLOT_BASE + 1, &mem, true).unwrap();
        assert_eq!(vm.extra_slots(), vec![EXTRA_SLOT_BASE + 1]);
        assert!(vm.unmap_slot(EXTRA_SLOT_BASE + 1).unwrap());
        assert!(!vm.unmap_slot(EXTRA_SLOT_BASE + 1).unwrap());
        assert!(vm.extra_slots().is_empty());
        // The same window again, after removal.
        vm.map_slot(EXTRA_SLOT_BASE + 1, &mem, true).unwrap();
    }
}
