//! Assembles a Lucid VM from a [`VmConfig`]: memory, devices, boot, vCPU threads and the exit
//! loop, and reports what happened in a [`RunReport`].

#![warn(clippy::print_stdout, clippy::print_stderr)]

mod acpi_pm;
pub mod api;
pub mod balloon;
mod boot;
pub mod builder;
pub mod config;
pub mod devices;
pub mod emulate;
mod errors;
pub mod hooks;
pub mod hypercall;
mod iommu;
mod jail;
mod pools;
mod report;
mod signals;
pub mod swap;
pub mod sym;
pub mod technique;
mod vcpu;
mod vm;

pub use boot::{DEFAULT_LINUX_CMDLINE, PVM_LINUX_CMDLINE};
pub use builder::{KernelLoad, VmBuilder};
pub use config::options;
pub use config::{
    parse_backing, parse_balloon, parse_blk, parse_console_virtio, parse_device, parse_fs,
    parse_iommu, parse_jail, parse_net, parse_pool, parse_rng, parse_serial, parse_user_device,
    parse_vsock, user_device_names, ApiConfig, ConfigError, DeviceOptionError, DevicesConfig,
    JailConfig, KernelSource, MachineConfig, MemoryConfig, PayloadConfig, PciDeviceConfig,
    PciDeviceKind, PlatformPciDevice, PoolsConfig, RuntimeConfig, SymbioticConfig,
    UserDeviceConfig, VmConfig, MAX_MEM_MIB, MAX_VCPUS, MIN_MEMORY_LIMIT_MIB, MIN_MEM_MIB,
    MIN_MONITOR_WINDOW,
};
pub use devices::{
    AttachedPci, DeviceManager, NewPciFunction, PciFunction, PciSlot, RateLimitError,
};
pub use emulate::Emulator;
pub use errors::VmmError;
pub use hooks::{
    ExitAction, ExitHooks, HltHook, HookError, HypercallHook, InternalErrorHook, MsrHook,
};
pub use lucid_virtio::rate::{RateLimiterConfig, TokenBucketConfig};
pub use pools::{MonitorTuning, PoolChoice, PoolsError};
pub use report::{error_chain, DeviceCounts, RunReport};
pub use technique::{StartContext, Technique};
pub use vcpu::{LoopEnd, VcpuCtx, VcpuError, VcpuFault, VcpuHandle};
pub use vm::Vm;

pub use {lucid_boot, lucid_hv, lucid_iommu, lucid_pools, lucid_swap};

pub use lucid_devices::{BadSerialOption, SerialOutput, StopReason, EXIT_FAILURE, EXIT_USAGE};
pub use lucid_mem::Backing;
pub use lucid_swap::SwapMode;
pub use lucid_virtio::console::{ConsoleConfig, ConsoleOutput};
