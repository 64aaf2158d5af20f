//! Symbiotic virtualization in the VMM (`--symbiotic`, docs/symbiotic.md): discovery and SymSpy
//! registration hypercalls, the SymCall runtime, SwapBypass's swap cache on a virtio-blk disk
//! and the module loader's mailbox. The ABI and pure logic live in `lucid-sym`; this module
//! meets the rest of Lucid only through the exit-hook registry, the vCPU handles and the stats
//! registry.
//!
//! Files: `mod.rs` (state, discovery, registration), `publish.rs` (Lucid's half of SymSpy),
//! `symcall.rs` (upcalls), `modules.rs` (module injection), `swapcache.rs` (SwapBypass wiring).

use std::sync::{Arc, Mutex, OnceLock};

use lucid_hv::kvm_bindings::kvm_regs;
use lucid_mem::GuestMemoryMmap;
use lucid_stats::{Counter, StatsRegistry};
use lucid_sym::abi;
use lucid_sym::Registrations;

mod modules;
mod swapcache;
mod symcall;

pub use modules::{ModuleError, ModuleInfo, ModuleOptions};
pub(crate) use swapcache::check_swapcache;
pub use swapcache::SwapCacheDevice;
pub use symcall::{SymCallError, SymReturn};

use crate::hooks::ExitHooks;
use crate::vcpu::VcpuHandle;

/// Feature bits this version offers.
pub const FEATURES: u64 =
    abi::FEAT_SYMSPY | abi::FEAT_SYMCALL | abi::FEAT_SWAPBYPASS | abi::FEAT_MODULES;

/// One VM's symbiotic state. Shared (`Arc`) by the hypercall hooks, the vCPU threads and the
/// control API; reached through [`crate::Vm::sym`].
pub struct Symbiotic {
    mem: GuestMemoryMmap,
    spy: Mutex<Registrations>,
    vcpus: OnceLock<Vec<Arc<VcpuHandle>>>,
    counters: SymCounters,
}

/// `sym.*` counters.
pub struct SymCounters {
    pub discoveries: Arc<Counter>,
    pub registrations: Arc<Counter>,
    pub registrations_refused: Arc<Counter>,
    pub notifies: Arc<Counter>,
}

impl Symbiotic {
    /// Creates the VM's symbiotic state and registers its hypercalls.
    pub fn install(
        hooks: &ExitHooks,
        mem: &GuestMemoryMmap,
        vcpus: u32,
        stats: &StatsRegistry,
    ) -> Arc<Self> {
        let c = |n: &str| stats.counter(format!("sym.{n}"));
        let sym = Arc::new(Symbiotic {
            mem: mem.clone(),
            spy: Mutex::new(Registrations::new(vcpus)),
            vcpus: OnceLock::new(),
            counters: SymCounters {
                discoveries: c("discoveries"),
                registrations: c("spy.registrations"),
                registrations_refused: c("spy.registrations_refused"),
                notifies: c("notifies"),
            },
        });
        let s = sym.clone();
        hooks.add_hypercall(
            abi::HC_DISCOVER,
            Arc::new(move |_: u32, r: &kvm_regs| s.discover(r.rdi)),
        );
        let s = sym.clone();
        hooks.add_hypercall(
            abi::HC_REGISTER,
            Arc::new(move |vcpu: u32, r: &kvm_regs| s.register(vcpu, r.rdi, r.rsi)),
        );
        let s = sym.clone();
        hooks.add_hypercall(
            abi::HC_NOTIFY,
            Arc::new(move |_: u32, r: &kvm_regs| s.notify(r.rdi)),
        );
        sym
    }

    /// The vCPU handles, once the vCPUs exist (SymCalls go through them).
    pub(crate) fn set_vcpus(&self, handles: Vec<Arc<VcpuHandle>>) {
        let _ = self.vcpus.set(handles);
    }

    pub fn vcpu_handle(&self, vcpu: u32) -> Option<&Arc<VcpuHandle>> {
        self.vcpus.get()?.get(vcpu as usize)
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
        match self.spy().register(&self.mem, vcpu, kind, gpa) {
            Ok(()) => {
                self.counters.registrations.inc();
                log::debug!("sym: vCPU {vcpu} registered SymSpy page kind {kind} at {gpa:#x}");
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
        let _ = event;
        0
    }

    /// The VM reset: registrations no longer hold.
    pub fn reset(&self) {
        self.spy().clear();
    }
}
