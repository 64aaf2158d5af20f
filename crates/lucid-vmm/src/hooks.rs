//! The registry of exit hooks, in the spirit of Palacios: I/O-port ranges, MMIO ranges, MSRs,
//! hypercalls, and one slot each for HLT and KVM internal errors. Devices and mechanisms register
//! here, before boot or (ports, MMIO, hypercalls) while the VM runs; the exit loop consults it on
//! every exit to userspace.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};

use lucid_devices::{Bus, StopReason};
use lucid_hv::kvm_bindings::kvm_regs;
use lucid_hv::{HvError, InternalError, Vcpu};

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

/// An MSR handler. KVM sends guest RDMSR/WRMSR of every MSR with a hook to userspace once the
/// VM starts ([`ExitHooks::install_msr_filter`]); KVM keeps all others.
pub trait MsrHook: Send + Sync {
    /// `None` makes the guest take a #GP.
    fn read(&self, vcpu: u32, index: u32) -> Option<u64>;
    /// `false` makes the guest take a #GP.
    fn write(&self, vcpu: u32, index: u32, value: u64) -> bool;
}

/// What an HLT or internal-error hook made of the exit.
#[derive(Debug)]
pub enum ExitAction {
    /// Not handled: Lucid's own handling runs (after HLT the guest resumes; an internal error
    /// goes to the instruction completer, [`crate::emulate`]).
    Default,
    /// Handled: the guest resumes.
    Resume,
    /// The VM stops for this reason.
    Stop(StopReason),
}

/// Called when a vCPU exits to userspace for HLT (KVM keeps HLT in the kernel with its
/// in-kernel LAPIC, so this is rare).
pub trait HltHook: Send + Sync {
    fn hlt(&self, vcpu: &mut Vcpu) -> ExitAction;
}

/// Called for `KVM_EXIT_INTERNAL_ERROR` ahead of the instruction completer, for instance to
/// finish an instruction the completer does not know.
pub trait InternalErrorHook: Send + Sync {
    fn internal_error(&self, vcpu: &mut Vcpu, error: &InternalError) -> ExitAction;
}

/// Returned to the guest for a hypercall number nobody registered.
pub const HYPERCALL_UNKNOWN: u64 = u64::MAX;

/// A registration the registry refused.
#[derive(Debug, thiserror::Error)]
pub enum HookError {
    #[error("hypercall {nr} ({}) already has a handler", crate::hypercall::name(*nr))]
    HypercallTaken { nr: u64 },
    #[error("MSR {index:#x} already has a hook")]
    MsrTaken { index: u32 },
    #[error(
        "MSR {index:#x}: hooks must be added before the VM starts (KVM's MSR filter is set then)"
    )]
    MsrFilterInstalled { index: u32 },
    #[error("the {slot} hook is already set")]
    SlotTaken { slot: &'static str },
}

#[derive(Default)]
pub struct ExitHooks {
    /// Shared (`Arc`) so that the PCI root can move BAR ranges while the VM runs.
    pub pio: Arc<Bus>,
    pub mmio: Arc<Bus>,
    hypercalls: RwLock<HashMap<u64, Arc<dyn HypercallHook>>>,
    msrs: RwLock<HashMap<u32, Arc<dyn MsrHook>>>,
    /// Set once KVM's MSR filter holds the hooked MSRs: later hooks could never fire.
    msr_filter_installed: AtomicBool,
    memory_fault: RwLock<Option<Arc<dyn MemoryFaultHook>>>,
    hlt: RwLock<Option<Arc<dyn HltHook>>>,
    internal_error: RwLock<Option<Arc<dyn InternalErrorHook>>>,
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

    /// Registers hypercall `nr` (Lucid's own are listed in [`crate::hypercall::TABLE`]); a
    /// number that already has a handler is refused.
    pub fn add_hypercall(&self, nr: u64, hook: Arc<dyn HypercallHook>) -> Result<(), HookError> {
        let mut calls = self.hypercalls.write().unwrap_or_else(|e| e.into_inner());
        if calls.contains_key(&nr) {
            return Err(HookError::HypercallTaken { nr });
        }
        calls.insert(nr, hook);
        Ok(())
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

    /// Hooks MSR `index`, before the VM starts; an MSR that already has a hook is refused.
    pub fn add_msr(&self, index: u32, hook: Arc<dyn MsrHook>) -> Result<(), HookError> {
        let mut msrs = self.msrs.write().unwrap_or_else(|e| e.into_inner());
        // Checked under the lock `install_msr_filter` reads the set under.
        if self.msr_filter_installed.load(Ordering::SeqCst) {
            return Err(HookError::MsrFilterInstalled { index });
        }
        if msrs.contains_key(&index) {
            return Err(HookError::MsrTaken { index });
        }
        msrs.insert(index, hook);
        Ok(())
    }

    /// Tells KVM to send guest accesses to the hooked MSRs to userspace (its MSR filter), once,
    /// before the vCPUs first run; with no MSR hooked KVM is left as it is. Later
    /// [`ExitHooks::add_msr`] calls are refused.
    pub fn install_msr_filter(&self, vm: &lucid_hv::Vm) -> Result<(), HvError> {
        let msrs = self.msrs.read().unwrap_or_else(|e| e.into_inner());
        if self.msr_filter_installed.swap(true, Ordering::SeqCst) || msrs.is_empty() {
            return Ok(());
        }
        let mut indices: Vec<u32> = msrs.keys().copied().collect();
        indices.sort_unstable();
        vm.trap_msrs(&indices)
    }

    pub fn msr(&self, index: u32) -> Option<Arc<dyn MsrHook>> {
        self.msrs
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(&index)
            .cloned()
    }

    /// Installs the HLT hook; there is one slot.
    pub fn set_hlt(&self, hook: Arc<dyn HltHook>) -> Result<(), HookError> {
        set_slot(&self.hlt, hook, "HLT")
    }

    pub fn hlt(&self) -> Option<Arc<dyn HltHook>> {
        self.hlt.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Installs the internal-error hook, consulted ahead of the instruction completer; there is
    /// one slot.
    pub fn set_internal_error(&self, hook: Arc<dyn InternalErrorHook>) -> Result<(), HookError> {
        set_slot(&self.internal_error, hook, "internal-error")
    }

    pub fn internal_error(&self) -> Option<Arc<dyn InternalErrorHook>> {
        self.internal_error
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

fn set_slot<T: ?Sized>(
    slot: &RwLock<Option<Arc<T>>>,
    hook: Arc<T>,
    name: &'static str,
) -> Result<(), HookError> {
    let mut s = slot.write().unwrap_or_else(|e| e.into_inner());
    if s.is_some() {
        return Err(HookError::SlotTaken { slot: name });
    }
    *s = Some(hook);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hypercalls_register_and_dispatch_by_rax() {
        let hooks = ExitHooks::new();
        hooks
            .add_hypercall(7, Arc::new(|_vcpu: u32, r: &kvm_regs| r.rdi + r.rsi))
            .unwrap();
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

    #[test]
    fn a_number_registered_twice_is_refused_and_the_first_handler_stays() {
        let hooks = ExitHooks::new();
        hooks
            .add_hypercall(3, Arc::new(|_: u32, _: &kvm_regs| 1))
            .unwrap();
        let err = hooks
            .add_hypercall(3, Arc::new(|_: u32, _: &kvm_regs| 2))
            .unwrap_err();
        assert!(matches!(err, HookError::HypercallTaken { nr: 3 }));
        assert_eq!(
            err.to_string(),
            "hypercall 3 (LUCID_HC_REPORT) already has a handler"
        );
        let regs = kvm_regs {
            rax: 3,
            ..Default::default()
        };
        assert_eq!(hooks.hypercall(0, &regs), Some(1));
    }

    struct NoMsr;
    impl MsrHook for NoMsr {
        fn read(&self, _: u32, _: u32) -> Option<u64> {
            None
        }
        fn write(&self, _: u32, _: u32, _: u64) -> bool {
            false
        }
    }

    #[test]
    fn an_msr_hooked_twice_or_after_the_filter_is_refused() {
        let hooks = ExitHooks::new();
        hooks.add_msr(0x10, Arc::new(NoMsr)).unwrap();
        assert!(matches!(
            hooks.add_msr(0x10, Arc::new(NoMsr)),
            Err(HookError::MsrTaken { index: 0x10 })
        ));
        let vm = lucid_hv::Vm::new(lucid_hv::open_kvm().expect("KVM")).unwrap();
        hooks.install_msr_filter(&vm).expect("KVM's MSR filter");
        assert!(matches!(
            hooks.add_msr(0x11, Arc::new(NoMsr)),
            Err(HookError::MsrFilterInstalled { index: 0x11 })
        ));
    }
}
