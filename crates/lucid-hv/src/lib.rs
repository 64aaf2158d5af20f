//! Lucid's narrow seam to KVM: opening the device, which backend it is, VMs, vCPUs,
//! capabilities and KVM's binary statistics. Nothing above this crate calls a KVM ioctl directly.

#![warn(clippy::print_stdout, clippy::print_stderr)]

pub mod host;
pub mod irq;
mod kvm_stats;
mod vcpu;
mod vm;

use std::sync::Arc;

pub use host::{detect_backend, posted_interrupts_available, Backend, KvmOpenError};
pub use irq::{GsiRouter, MsiMessage, MsiRemapper};
pub use kvm_bindings;
pub use kvm_ioctls::Kvm;
pub use kvm_stats::KvmStats;
pub use vcpu::{Exit, ExitKind, ImmediateExit, InternalError, Vcpu};
pub use vm::{GuestMemoryMmap, IoAddr, Vm, EXTRA_SLOT_BASE};

/// What failed at the seam to KVM, and with what.
#[derive(Debug, thiserror::Error)]
pub enum HvError {
    /// A KVM ioctl (named) failed.
    #[error("{0} failed")]
    Ioctl(&'static str, #[source] kvm_ioctls::Error),
    #[error(transparent)]
    Open(#[from] KvmOpenError),
    #[error("KVM lacks a capability Lucid needs: {0}")]
    MissingCap(&'static str),
    #[error("guest memory region at {0:#x} has no host mapping")]
    BadMemory(u64),
    #[error("cannot trap {count} MSRs: KVM's MSR filter takes at most {max}")]
    TooManyMsrs { count: usize, max: usize },
    #[error("no free GSI: the routing table has {max} entries, all in use")]
    GsiExhausted { max: u32 },
    #[error("GSI {0} was not allocated by this router")]
    GsiNotAllocated(u32),
    #[error("a GSI routing table of {0} entries cannot be built")]
    RoutingTableTooLarge(usize),
}

/// Opens `/dev/kvm` (with the probe's one-line errors) and checks the capabilities every Lucid
/// VM relies on.
pub fn open_kvm() -> Result<Arc<Kvm>, HvError> {
    let kvm = host::open_device(host::KVM_PATH)?;
    use kvm_ioctls::Cap;
    for (cap, name) in [
        (Cap::Irqchip, "KVM_CAP_IRQCHIP"),
        (Cap::UserMemory, "KVM_CAP_USER_MEMORY"),
        (Cap::ImmediateExit, "KVM_CAP_IMMEDIATE_EXIT"),
        (Cap::Irqfd, "KVM_CAP_IRQFD"),
        (Cap::Ioeventfd, "KVM_CAP_IOEVENTFD"),
    ] {
        if !kvm.check_extension(cap) {
            return Err(HvError::MissingCap(name));
        }
    }
    Ok(Arc::new(kvm))
}

/// The CPUID KVM supports on this host, the starting point of every vCPU's CPUID.
pub fn supported_cpuid(kvm: &Kvm) -> Result<kvm_bindings::CpuId, HvError> {
    kvm.get_supported_cpuid(kvm_bindings::KVM_MAX_CPUID_ENTRIES)
        .map_err(|e| HvError::Ioctl("KVM_GET_SUPPORTED_CPUID", e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vcpu_stats_count_exits() {
        let kvm = open_kvm().expect("KVM");
        let vm = Vm::new(kvm).unwrap();
        let mut vcpu = vm.create_vcpu(0).unwrap();
        let stats = vcpu.stats().expect("binary stats");
        assert!(stats.get("exits").is_some());
        let _ = vcpu.immediate_exit();
    }
}
