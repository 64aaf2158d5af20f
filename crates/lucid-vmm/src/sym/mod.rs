//! Symbiotic virtualization in the VMM (`--symbiotic`, docs/symbiotic.md): discovery and SymSpy
//! registration hypercalls, the SymCall runtime, SwapBypass's swap cache on a virtio-blk disk
//! and the module loader's mailbox. The ABI and pure logic live in `lucid-sym`; this module
//! meets the rest of Lucid only through the exit-hook registry, the vCPU handles and the stats
//! registry.
//!
//! Files: `mod.rs` (state, discovery, registration), `publish.rs` (Lucid's half of SymSpy),
//! `symcall.rs` (upcalls), `modules.rs` (module injection), `swapcache.rs` (SwapBypass wiring).

use std::sync::{Arc, Mutex, Weak};

use lucid_hv::kvm_bindings::kvm_regs;
use lucid_mem::GuestMemoryMmap;
use lucid_stats::{Counter, StatsRegistry};
use lucid_sym::abi;
use lucid_sym::Registrations;

mod modules;
mod publish;
mod swapcache;
mod symcall;

pub use modules::{LoaderInfo, ModCounters, ModuleError, ModuleInfo, ModuleOptions};
pub use publish::{
    GlobalRecord, GuestGlobal, GuestVcpu, HostMemory, LucidGlobal, LucidVcpu, PublishSources,
    SpySnapshot, VcpuRecord,
};
pub use swapcache::SwapCacheDevice;
pub use symcall::{CallCounters, CallLimits, SymCallError, SymReturn};

use crate::hooks::{ExitHooks, HookError};
use crate::vcpu::VcpuHandle;

/// Feature bits this version offers.
pub const FEATURES: u64 =
    abi::FEAT_SYMSPY | abi::FEAT_SYMCALL | abi::FEAT_SWAPBYPASS | abi::FEAT_MODULES;

/// One VM's symbiotic state. Shared (`Arc`) by the hypercall hooks, the vCPU threads and the
/// control API; reached through [`crate::Vm::sym`].
pub struct Symbiotic {
    mem: GuestMemoryMmap,
    spy: Mutex<Registrations>,
    /// The vCPUs SymCalls run on.
    vcpus: Vec<Arc<VcpuHandle>>,
    vcpu_count: u32,
    counters: SymCounters,
    publisher: publish::Publisher,
    /// Module injection's state (modules.rs).
    modules: modules::Modules,
    /// SymCall: per-vCPU call slots, limits, `sym.call.*` counters.
    calls: symcall::Calls,
    /// This VM's own `Arc`, for the closures a SymCall runs on a vCPU thread.
    me: Weak<Symbiotic>,
}

/// `sym.*` counters.
pub struct SymCounters {
    pub discoveries: Arc<Counter>,
    pub registrations: Arc<Counter>,
    pub registrations_refused: Arc<Counter>,
    pub notifies: Arc<Counter>,
}

/// Everything the VM's symbiotic state is built from.
pub struct SymParts<'a> {
    pub hooks: &'a ExitHooks,
    pub mem: &'a GuestMemoryMmap,
    pub stats: &'a StatsRegistry,
    /// The VM's vCPU count (the per-vCPU state is sized by it).
    pub vcpu_count: u32,
    /// The vCPUs SymCalls run on (created before the symbiotic state, without their threads).
    pub vcpus: Vec<Arc<VcpuHandle>>,
    /// What SymSpy publishes about the VM and where it reads host pressure.
    pub sources: PublishSources,
    /// The KVM VM, for read-only module windows (memory slots); `None` refuses them.
    pub hv: Option<lucid_hv::Vm>,
}

impl Symbiotic {
    /// Creates the VM's symbiotic state and registers its hypercalls.
    pub fn new(p: SymParts<'_>) -> Result<Arc<Self>, HookError> {
        let SymParts {
            hooks,
            mem,
            stats,
            vcpu_count: vcpus,
            vcpus: handles,
            sources,
            hv,
        } = p;
        let c = |n: &str| stats.counter(format!("sym.{n}"));
        let sym = Arc::new_cyclic(|me| Symbiotic {
            me: me.clone(),
            calls: symcall::Calls::new(vcpus, stats),
            mem: mem.clone(),
            spy: Mutex::new(Registrations::new(vcpus)),
            vcpus: handles,
            vcpu_count: vcpus,
            publisher: publish::Publisher::new(vcpus, sources, stats),
            counters: SymCounters {
                discoveries: c("discoveries"),
                registrations: c("spy.registrations"),
                registrations_refused: c("spy.registrations_refused"),
                notifies: c("notifies"),
            },
            modules: modules::Modules::new(stats, hooks.mmio.clone(), hv),
        });
        let s = sym.clone();
        hooks.add_hypercall(
            abi::HC_DISCOVER,
            Arc::new(move |_: u32, r: &kvm_regs| s.discover(r.rdi)),
        )?;
        let s = sym.clone();
        hooks.add_hypercall(
            abi::HC_REGISTER,
            Arc::new(move |vcpu: u32, r: &kvm_regs| s.register(vcpu, r.rdi, r.rsi)),
        )?;
        let s = sym.clone();
        hooks.add_hypercall(
            abi::HC_RETURN,
            Arc::new(move |vcpu: u32, r: &kvm_regs| s.symcall_return(vcpu, r.rdi, r.rsi, r.r8)),
        )?;
        let s = sym.clone();
        hooks.add_hypercall(
            abi::HC_NOTIFY,
            Arc::new(move |_: u32, r: &kvm_regs| s.notify(r.rdi)),
        )?;
        Ok(sym)
    }

    pub fn vcpu_handle(&self, vcpu: u32) -> Option<&Arc<VcpuHandle>> {
        self.vcpus.get(vcpu as usize)
    }

    pub fn memory(&self) -> &GuestMemoryMmap {
        &self.mem
    }

    pub fn counters(&self) -> &SymCounters {
        &self.counters
    }

    /// The SymSpy registrations (the lock is held briefly: hypercalls take it).
    pub fn spy(&self) -> std::sync::MutexGuard<'_, Registrations> {
        self.spy.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn discover(&self, what: u64) -> u64 {
        self.counters.discoveries.inc();
        match what {
            abi::DISCOVER_SIGNATURE => abi::SIGNATURE,
            abi::DISCOVER_VERSION => abi::VERSION,
            abi::DISCOVER_FEATURES => FEATURES,
            _ => abi::neg(abi::SYM_EINVAL),
        }
    }

    fn register(&self, vcpu: u32, kind: u64, gpa: u64) -> u64 {
        let mut spy = self.spy();
        match spy.register(&self.mem, vcpu, kind, gpa) {
            Ok(()) => {
                self.counters.registrations.inc();
                log::debug!("sym: vCPU {vcpu} registered SymSpy page kind {kind} at {gpa:#x}");
                // Lucid's lines are filled before the guest's first look at them.
                match kind {
                    abi::REGISTER_GLOBAL => spy.global().map(|p| self.publish_global(p)),
                    _ => spy.vcpu(vcpu).map(|p| self.publish_vcpu(vcpu, p)),
                };
                0
            }
            Err(e) => {
                self.counters.registrations_refused.inc();
                log::warn!("sym: vCPU {vcpu}: {e}");
                abi::neg(e.errno())
            }
        }
    }

    fn notify(&self, event: u64) -> u64 {
        self.counters.notifies.inc();
        if event == abi::NOTIFY_MODULE_REPLY {
            self.modules.notify();
        }
        0
    }

    /// The VM reset: registrations no longer hold. Lucid has no in-place reset (a guest's
    /// reset request, i8042 or ACPI, stops the VM with `StopReason::Reset`), so the VM calls
    /// this when it stops.
    pub fn reset(&self) {
        self.spy().clear();
    }
}

/// The symbiotic interfaces as one of the VM's techniques: `lucid-symspy` runs while the VM
/// does (not with `--low-noise`), and the SymSpy registrations end with the VM.
pub(crate) struct SymTechnique {
    pub sym: Arc<Symbiotic>,
    /// Whether to start `lucid-symspy`.
    pub publish: bool,
}

impl crate::technique::Technique for SymTechnique {
    fn name(&self) -> &'static str {
        "symbiotic"
    }

    fn start(&mut self, cx: &crate::technique::StartContext<'_>) -> Result<(), crate::VmmError> {
        if self.publish {
            self.sym.start_publisher(cx.lifecycle.clone(), cx.spawner)?;
        }
        Ok(())
    }

    fn stop(&mut self) {
        self.sym.stop_publisher();
        // A guest reset stops the VM: its SymSpy registrations go with it.
        self.sym.reset();
    }

    fn counters(&self) -> &'static [&'static str] {
        &["sym."]
    }

    fn summary(&self) -> Vec<String> {
        vec![format!(
            "features {FEATURES:#x}, {}",
            if self.publish {
                "SymSpy republished every 100 ms"
            } else {
                "SymSpy published at registration only"
            }
        )]
    }
}

/// Adds the symbiotic CPUID leaves (`lucid_sym::cpuid::leaves`: 0x40000100 signature,
/// 0x40000101 version, features and hypercall port) to a vCPU's CPUID, replacing any already
/// there. For hosts that intercept CPUID; on PVM the guest's CPUID never sees them and
/// discovery goes through `HC_DISCOVER`.
pub fn add_cpuid_leaves(cpuid: &mut lucid_hv::kvm_bindings::CpuId) {
    use lucid_hv::kvm_bindings::kvm_cpuid_entry2;
    let port = lucid_boot::layout::ports::HYPERCALL;
    for leaf in lucid_sym::cpuid::leaves(FEATURES, port) {
        let entry = kvm_cpuid_entry2 {
            function: leaf.function,
            index: 0,
            flags: 0,
            eax: leaf.eax,
            ebx: leaf.ebx,
            ecx: leaf.ecx,
            edx: leaf.edx,
            ..Default::default()
        };
        match cpuid
            .as_mut_slice()
            .iter_mut()
            .find(|e| e.function == leaf.function)
        {
            Some(e) => *e = entry,
            None => {
                if cpuid.push(entry).is_err() {
                    log::warn!(
                        "sym: no room for CPUID leaf {:#x}: CPUID discovery unavailable",
                        leaf.function
                    );
                }
            }
        }
    }
}

/// A VM's symbiotic state with no vCPUs and no KVM VM behind it, for unit tests.
#[cfg(test)]
mod tests_support {
    use super::*;

    pub(crate) fn sym(mem: &GuestMemoryMmap, vcpus: u32, stats: &StatsRegistry) -> Arc<Symbiotic> {
        Symbiotic::new(SymParts {
            hooks: &ExitHooks::new(),
            mem,
            stats,
            vcpu_count: vcpus,
            vcpus: Vec::new(),
            sources: PublishSources::default(),
            hv: None,
        })
        .unwrap()
    }
}
