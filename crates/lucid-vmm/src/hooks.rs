//! The registry of exit hooks, in the spirit of Palacios: I/O-port ranges, MMIO ranges, MSRs and
//! hypercalls. Devices and mechanisms register here, before boot or while the VM runs; the exit
//! loop consults it on every exit to userspace.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};

use lucid_devices::Bus;
use lucid_hv::kvm_bindings::kvm_regs;

/// A hypercall handler. `regs` are the caller's registers (rax = call number, rdi/rsi/r8 =
/// arguments); the handler returns the value placed in rax.
pub trait HypercallHook: Send + Sync {
    fn call(&self, vcpu: u32, regs: &kvm_regs) -> u64;
}

impl<F: Fn(u32, &kvm_regs) -> u64 + Send + Sync> HypercallHook for F {
    fn call(&self, vcpu: u32, regs: &kvm_regs) -> u64 {
        self(vcpu, regs)
    }
}

/// An MSR handler for MSRs that KVM is told to send to userspace.
pub trait MsrHook: Send + Sync {
    /// `None` makes the guest take a #GP.
    fn read(&self, vcpu: u32, index: u32) -> Option<u64>;
    /// `false` makes the guest take a #GP.
    fn write(&self, vcpu: u32, index: u32, value: u64) -> bool;
}

/// Returned to the guest for a hypercall number nobody registered.
pub const HYPERCALL_UNKNOWN: u64 = u64::MAX;

#[derive(Default)]
pub struct ExitHooks {
    /// Shared (`Arc`) so that the PCI root can move BAR ranges while the VM runs.
    pub pio: Arc<Bus>,
    pub mmio: Arc<Bus>,
    hypercalls: RwLock<HashMap<u64, Arc<dyn HypercallHook>>>,
    msrs: RwLock<HashMap<u32, Arc<dyn MsrHook>>>,
    memory_fault: RwLock<Option<Arc<dyn MemoryFaultHook>>>,
}

/// Called when `KVM_RUN` fails with `EFAULT` because the host could not fault a guest page in
/// (a memory cgroup at its limit refuses the charge on KVM's fault path instead of waiting).
/// The VM's memory limit installs one that waits for its pager to free memory.
pub trait MemoryFaultHook: Send + Sync {
    /// Waits (briefly) for host memory; true when there is some again and the vCPU should
    /// re-enter the guest, false when none came.
    fn wait_for_memory(&self) -> bool;
}

impl ExitHooks {
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    /// Registers hypercall `nr`; replaces an earlier handler of the same number.
    pub fn add_hypercall(&self, nr: u64, hook: Arc<dyn HypercallHook>) {
        self.hypercalls
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(nr, hook);
    }

    pub fn remove_hypercall(&self, nr: u64) -> bool {
        self.hypercalls
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&nr)
            .is_some()
    }

    pub fn hypercall(&self, vcpu: u32, regs: &kvm_regs) -> Option<u64> {
        let hook = self
            .hypercalls
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(&regs.rax)
            .cloned()?;
        Some(hook.call(vcpu, regs))
    }

    /// Installs the hook that absorbs `KVM_RUN`'s `EFAULT` under memory pressure.
    pub fn set_memory_fault(&self, hook: Arc<dyn MemoryFaultHook>) {
        *self.memory_fault.write().unwrap_or_else(|e| e.into_inner()) = Some(hook);
    }

    pub fn memory_fault(&self) -> Option<Arc<dyn MemoryFaultHook>> {
        self.memory_fault
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    pub fn add_msr(&self, index: u32, hook: Arc<dyn MsrHook>) {
        self.msrs
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(index, hook);
    }

    pub fn msr(&self, index: u32) -> Option<Arc<dyn MsrHook>> {
        self.msrs
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(&index)
            .cloned()
    }

    pub fn msr_indices(&self) -> Vec<u32> {
        let mut v: Vec<u32> = self
            .msrs
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .keys()
            .copied()
            .collect();
        v.sort_unstable();
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hypercalls_register_and_dispatch_by_rax() {
        let hooks = ExitHooks::new();
        hooks.add_hypercall(7, Arc::new(|_vcpu: u32, r: &kvm_regs| r.rdi + r.rsi));
        let regs = kvm_regs {
            rax: 7,
            rdi: 2,
            rsi: 3,
            ..Default::default()
        };
        assert_eq!(hooks.hypercall(0, &regs), Some(5));
        assert!(hooks.remove_hypercall(7));
        assert_eq!(hooks.hypercall(0, &regs), None);
    }
}
