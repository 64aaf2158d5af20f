//! Assembles a Lucid VM from a [`VmConfig`]: memory, devices, boot, vCPU threads and the exit
//! loop, and reports what happened in a [`RunReport`].

mod acpi_pm;
mod config;
pub mod emulate;
pub mod hooks;
mod report;
mod vcpu;
mod vm;

pub use config::{
    parse_blk, parse_net, KernelSource, PciDeviceConfig, PciDeviceKind, VmConfig, MAX_MEM_MIB,
    MAX_VCPUS,
};
pub use emulate::Emulator;
pub use hooks::{ExitHooks, HypercallHook, MsrHook};
pub use report::RunReport;
pub use vcpu::{LoopEnd, VcpuCtx, VcpuError, VcpuHandle};
pub use vm::{hypercall, PciBus, Vm, VmmError, DEFAULT_LINUX_CMDLINE, PVM_LINUX_CMDLINE};

pub use lucid_devices::{SerialOutput, StopReason};
pub use lucid_mem::Backing;
