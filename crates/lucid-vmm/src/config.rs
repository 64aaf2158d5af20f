//! What a VM is made of, as the CLI (or a test, or later the API) describes it.

use std::path::PathBuf;

use lucid_devices::SerialOutput;
use lucid_mem::Backing;

/// The kernel to boot: a file, or a probe guest built into the binary.
#[derive(Clone, Debug)]
pub enum KernelSource {
    File(PathBuf),
    Builtin { name: String, bytes: &'static [u8] },
}

#[derive(Clone, Debug)]
pub struct VmConfig {
    pub kernel: KernelSource,
    pub initrd: Option<PathBuf>,
    /// The kernel command line; for Linux, empty means Lucid's default console line.
    pub cmdline: String,
    pub mem_mib: u64,
    pub vcpus: u8,
    pub serial: SerialOutput,
    /// Feed stdin to the serial console (only with `SerialOutput::Stdio`).
    pub serial_stdin: bool,
    pub backing: Backing,
    /// Let SIGINT/SIGTERM stop the VM (the CLI sets this; a library user may not want it).
    pub handle_signals: bool,
}

impl VmConfig {
    pub fn new(kernel: KernelSource) -> Self {
        VmConfig {
            kernel,
            initrd: None,
            cmdline: String::new(),
            mem_mib: 256,
            vcpus: 1,
            serial: SerialOutput::Stdio,
            serial_stdin: false,
            backing: Backing::Anonymous,
            handle_signals: false,
        }
    }
}

/// Largest VM this version builds: 254 vCPUs (APIC IDs 0..253, the I/O APIC takes the next) and
/// 1 TiB of RAM.
pub const MAX_VCPUS: u8 = 254;
pub const MAX_MEM_MIB: u64 = 1 << 20;
/// Smallest RAM that holds the boot structures below 1 MiB plus a kernel.
pub const MIN_MEM_MIB: u64 = 2;
