//! What a VM is made of, as the CLI, a test or the control API describes it: one typed,
//! serialisable configuration in sections, the syntax of every sub-option (declared once, in
//! [`lucid_opts::OptSpec`] tables that the CLI's help text is generated from), and
//! [`VmConfig::validate`], which holds every rule that crosses options.

use std::path::PathBuf;

use lucid_devices::SerialOutput;
use lucid_iommu::{EmulationMode, PinPolicy, VtdConfig};
pub use lucid_mem::Backing;
use lucid_opts::{parse_bool, Parsed};

pub use self::options::*;
pub use lucid_jail::JailConfig;
use lucid_pci::Rung;
use lucid_swap::SwapMode;
use lucid_virtio::balloon::BalloonConfig;
use lucid_virtio::blk::BlockConfig;
use lucid_virtio::console::{ConsoleConfig, ConsoleOutput};
use lucid_virtio::net::NetConfig;
use lucid_virtio::rate::{RateLimiterConfig, TokenBucketConfig};
use lucid_virtio::rng::RngConfig;
use lucid_virtio::vhost_user::{VhostUserConfig, VhostUserKind};
use lucid_virtio::vsock::VsockConfig;
use lucid_virtio::Coalescing;
use serde::{Deserialize, Serialize};

use crate::pools::{MonitorTuning, PoolChoice};

/// A virtio device on the PCI bus.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PciDeviceKind {
    Block(BlockConfig),
    Net(NetConfig),
    /// A vhost-user device (blk, fs or net) whose back-end is another process.
    VhostUser(VhostUserConfig),
    Vsock(VsockConfig),
}

/// One PCI device: what it is and its rung of the exit ladder.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PciDeviceConfig {
    pub kind: PciDeviceKind,
    /// The device's name (Cloud Hypervisor's `id`), in counters, `vm.info` and
    /// `vm.remove-device`; none: `blkN`/`netN` ([`crate::devices::virtio_names`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(default)]
    pub rung: Rung,
    #[serde(default)]
    pub coalescing: Coalescing,
    /// L4: the polling thread sleeps this long when its rings are idle (0 spins).
    #[serde(default)]
    pub poll_idle_us: u32,
    /// `swapcache=MiB` on a `--blk`: SwapBypass's swap cache of this many MiB in front of the
    /// disk (docs/symbiotic.md §6); 0 = none. Needs `--symbiotic`, 4096-byte blocks and a
    /// rung with a worker thread (L1 or above).
    #[serde(default)]
    pub swapcache_mib: u32,
    /// `liveness=spy`: the swap cache asks the SymSpy swap map before SymCall `SLOT_LIVE`
    /// (no exit per question); default SymCall first.
    #[serde(default)]
    pub swapcache_spy_first: bool,
    /// `bw=`, `ops=` (Cloud Hypervisor's `rate_limiter_config`): the device's rate limiter,
    /// changeable while the VM runs (`lucid.rate-limit`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate_limiter: Option<RateLimiterConfig>,
}

/// Whether `name` can name a device: it becomes a counter prefix (no `.`), a `vm.info` key
/// and an argument of `vm.remove-device`.
pub fn device_name_ok(name: &str) -> bool {
    (1..=32).contains(&name.len())
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
        && ![
            "balloon", "edu", "iommu", "serial", "hotplug", "kvm", "rest", "rng", "console",
        ]
        .contains(&name)
        && !name.starts_with("vcpu")
}

impl PciDeviceConfig {
    pub fn new(kind: PciDeviceKind) -> Self {
        PciDeviceConfig {
            kind,
            name: None,
            rung: Rung::default(),
            coalescing: Coalescing::default(),
            poll_idle_us: 0,
            swapcache_mib: 0,
            swapcache_spy_first: false,
            rate_limiter: None,
        }
    }
}

/// A device on the PCI bus that is not virtio (`--device`). They take the slots after the virtio
/// devices.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PlatformPciDevice {
    /// QEMU's `edu` DMA test device (PCI 1234:11e8), counters under `edu.`.
    Edu,
}

impl PlatformPciDevice {
    /// Its name on the command line and in the log.
    pub fn name(self) -> &'static str {
        match self {
            PlatformPciDevice::Edu => "edu",
        }
    }
}

/// A PCI function served by another process over vfio-user (`--user-device`, Cloud
/// Hypervisor's `UserDeviceConfig`; docs/vfio.md).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UserDeviceConfig {
    /// The device server's Unix socket.
    pub socket: PathBuf,
    /// The device's name (`userN` when none), in counters (`user_device.<id>.*`) and the log.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
}

/// Whether `name` can name a user device: its counters are under `user_device.<name>.`, so only
/// the syntax binds it here, and [`VmConfig::validate`] that no other PCI function has it
/// (`edu` is a fine name for an out-of-process edu when the VM has no `--device edu`).
fn user_device_name_ok(name: &str) -> bool {
    (1..=32).contains(&name.len())
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
}

/// The names of `user` in order: each one's `id`, else `userN` (numbers a named one took are
/// skipped).
pub fn user_device_names(user: &[UserDeviceConfig]) -> Vec<String> {
    let taken: Vec<&str> = user.iter().filter_map(|d| d.id.as_deref()).collect();
    let mut next = 0;
    user.iter()
        .map(|d| match &d.id {
            Some(id) => id.clone(),
            None => loop {
                let name = format!("user{next}");
                next += 1;
                if !taken.contains(&name.as_str()) {
                    break name;
                }
            },
        })
        .collect()
}

/// The kernel to boot: a file, or a probe guest built into the binary.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KernelSource {
    File(PathBuf),
    Builtin {
        name: String,
        /// The image is part of the binary, not of the description: whoever deserialises a
        /// `Builtin` fills it in by name (the CLI from `lucid_guests::get`); validate() refuses
        /// one left empty.
        #[serde(skip)]
        bytes: &'static [u8],
    },
}

/// The VM itself: its size and how Lucid runs it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MachineConfig {
    /// 1..=[`MAX_VCPUS`].
    pub vcpus: u8,
    /// Guest RAM, [`MIN_MEM_MIB`]..=[`MAX_MEM_MIB`].
    pub mem_mib: u64,
    pub backing: Backing,
    /// Confine Lucid's threads with a seccomp filter per role (docs/security.md).
    pub seccomp: bool,
    /// Let SIGINT/SIGTERM stop the VM (the CLI sets this; a library user may not want it).
    pub handle_signals: bool,
}

impl Default for MachineConfig {
    fn default() -> Self {
        MachineConfig {
            vcpus: 1,
            mem_mib: 256,
            backing: Backing::Anonymous,
            seccomp: true,
            handle_signals: false,
        }
    }
}

/// What the VM boots.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PayloadConfig {
    pub kernel: KernelSource,
    #[serde(default)]
    pub initrd: Option<PathBuf>,
    /// The kernel command line; for Linux, empty means Lucid's default console line.
    #[serde(default)]
    pub cmdline: String,
}

/// The VM's devices.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DevicesConfig {
    pub serial: SerialOutput,
    /// Feed stdin to the serial console (only with `SerialOutput::Stdio`).
    pub serial_stdin: bool,
    /// virtio devices on PCI (bus 0, slots from 1 in this order; named blk0.., net0..). With
    /// none of these and no `platform_pci`, the VM has no PCI bus at all.
    pub pci: Vec<PciDeviceConfig>,
    /// Other PCI devices, in the slots after the virtio devices, in this order.
    pub platform_pci: Vec<PlatformPciDevice>,
    /// A virtio-balloon (`--balloon`), on PCI after the devices of `pci`, named `balloon`.
    pub balloon: Option<BalloonConfig>,
    /// A virtio-rng (`--rng`), on PCI after the balloon, named `rng`.
    pub rng: Option<RngConfig>,
    /// ACPI PCI hotplug and the ACPI power button (`--hotplug`; always on for a VM made by
    /// the REST API): the VM gets a PCI bus even with no device.
    pub hotplug: bool,
    /// QEMU's fw_cfg at ports 0x510-0x51b with its ACPI device (on unless `--fw-cfg off`):
    /// guests written for QEMU read their CPU count there.
    pub fw_cfg: bool,
    /// A virtio-console (`--console-virtio`), on PCI after the rng, named `console`.
    pub console: Option<ConsoleConfig>,
    /// vfio-user devices (`--user-device`), on PCI after the platform devices, in this order.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub user_devices: Vec<UserDeviceConfig>,
}

impl Default for DevicesConfig {
    fn default() -> Self {
        DevicesConfig {
            serial: SerialOutput::Stdio,
            serial_stdin: false,
            pci: Vec::new(),
            platform_pci: Vec::new(),
            balloon: None,
            rng: None,
            hotplug: false,
            fw_cfg: true,
            console: None,
            user_devices: Vec::new(),
        }
    }
}

/// Host memory: the limit and how the VM is swapped over it (docs/vswapper.md).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MemoryConfig {
    /// `--memory-limit`: the host memory the VM's process may use (a memory cgroup with host
    /// swap behind it), at least [`MIN_MEMORY_LIMIT_MIB`]; the guest still has
    /// `machine.mem_mib`. It moves the whole calling process into the cgroup (`lucid/vm-<pid>`)
    /// until the `Vm` is dropped.
    pub limit_mib: Option<u64>,
    /// `--swap-mode`: how the VM's memory is swapped when it is over its limit.
    pub swap_mode: SwapMode,
    /// `--swap-pager`: with a memory limit, a `lucid-pager` thread keeps usage under it with
    /// `MADV_PAGEOUT` (the kernel's limit reclaim fails on PVM hosts); off leaves reclaim to the
    /// kernel.
    pub pager: bool,
}

impl Default for MemoryConfig {
    fn default() -> Self {
        MemoryConfig {
            limit_mib: None,
            swap_mode: SwapMode::Baseline,
            pager: true,
        }
    }
}

/// The host CPU pools (docs/scheduling.md).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PoolsConfig {
    /// `--pool`: the pool the VM runs in.
    pub pool: PoolChoice,
    /// `--low-noise`: vCPUs pinned one per CPU, everything else elsewhere, no periodic work.
    pub low_noise: bool,
    /// The pools' monitor window and classifier settings.
    pub monitor: MonitorTuning,
}

/// The symbiotic interfaces (docs/symbiotic.md).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SymbioticConfig {
    /// `--symbiotic`: offer discovery, SymSpy, SymCall, SwapBypass and modules. Off, their
    /// hypercalls are unknown to the guest.
    pub enabled: bool,
}

/// The control API (docs/api.md), which the embedding program serves beside the VM (the
/// `lucid` command's REST server); [`crate::Vm::build`] does not bind it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ApiConfig {
    /// `--api-socket`: serve the REST API on this Unix socket.
    pub socket: Option<PathBuf>,
}

/// What the embedding program supplies as code, not as data: never serialised.
#[derive(Clone, Debug, Default)]
pub struct RuntimeConfig {
    /// Where `lucid.module-load` finds the modules `{"builtin":NAME}` names (the CLI gives
    /// the guest kit's).
    pub builtin_modules: Option<crate::api::BuiltinModules>,
    /// The command that runs `lucid_swap::guard::serve` (the CLI: `lucid __oom-guard`): with a
    /// cgroup v1 limit and the pager, a process outside the limit that frees guest RAM when
    /// every Lucid thread waits for memory. None: no guard.
    pub oom_guard: Option<fn() -> std::process::Command>,
}

/// A whole VM. `runtime` holds function pointers and is skipped by serde; everything else is
/// what `--config FILE` and the control API describe.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VmConfig {
    #[serde(default)]
    pub machine: MachineConfig,
    pub payload: PayloadConfig,
    #[serde(default)]
    pub devices: DevicesConfig,
    /// An emulated Intel VT-d (`--iommu vtd`): every device's DMA and MSIs go through it.
    #[serde(default)]
    pub iommu: Option<VtdConfig>,
    #[serde(default)]
    pub memory: MemoryConfig,
    #[serde(default)]
    pub pools: PoolsConfig,
    #[serde(default)]
    pub symbiotic: SymbioticConfig,
    #[serde(default)]
    pub api: ApiConfig,
    /// `--jail`: once built, the process drops to this user (docs/jail.md).
    #[serde(default)]
    pub jail: Option<JailConfig>,
    #[serde(skip)]
    pub runtime: RuntimeConfig,
}

impl VmConfig {
    pub fn new(kernel: KernelSource) -> Self {
        VmConfig {
            machine: MachineConfig::default(),
            payload: PayloadConfig {
                kernel,
                initrd: None,
                cmdline: String::new(),
            },
            devices: DevicesConfig::default(),
            iommu: None,
            memory: MemoryConfig::default(),
            pools: PoolsConfig::default(),
            symbiotic: SymbioticConfig::default(),
            api: ApiConfig::default(),
            jail: None,
            runtime: RuntimeConfig::default(),
        }
    }

    /// Every rule that crosses options (each option's own syntax is its parser's): what this
    /// version cannot build, refused before anything is built.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let m = &self.machine;
        if !(1..=MAX_VCPUS).contains(&m.vcpus) {
            return Err(ConfigError::Vcpus(m.vcpus));
        }
        if !(MIN_MEM_MIB..=MAX_MEM_MIB).contains(&m.mem_mib) {
            return Err(ConfigError::Memory(m.mem_mib));
        }
        if let KernelSource::Builtin { name, bytes: [] } = &self.payload.kernel {
            return Err(ConfigError::BuiltinEmpty(name.clone()));
        }
        let mut names = std::collections::BTreeSet::new();
        for name in self.devices.pci.iter().filter_map(|d| d.name.as_deref()) {
            if !device_name_ok(name) {
                return Err(ConfigError::DeviceName(name.into()));
            }
            if !names.insert(name) {
                return Err(ConfigError::DeviceNameTwice(name.into()));
            }
        }
        if let Some(offset) = self.payload.cmdline.find('\0') {
            return Err(ConfigError::CmdlineNul(offset));
        }
        // Its counters (edu.*) are one set.
        let edus = self
            .devices
            .platform_pci
            .iter()
            .filter(|d| **d == PlatformPciDevice::Edu)
            .count();
        if edus > 1 {
            return Err(ConfigError::EduCount(edus));
        }
        if let Some(b) = &self.devices.balloon {
            if b.size_mib > MAX_MEM_MIB {
                return Err(ConfigError::BalloonSize(b.size_mib));
            }
        }
        self.check_swapcache()?;
        self.check_vhost_user()?;
        self.check_user_devices()?;
        if let Some(mib) = self.memory.limit_mib {
            if mib < MIN_MEMORY_LIMIT_MIB {
                return Err(ConfigError::MemoryLimitTooSmall(mib));
            }
        }
        if let Some((disk, block_size)) = self.swap_disk_refused() {
            return Err(ConfigError::SwapBlockSize {
                mode: self.memory.swap_mode,
                disk,
                block_size,
            });
        }
        if let (true, PoolChoice::Named(n)) = (self.pools.low_noise, &self.pools.pool) {
            return Err(ConfigError::LowNoiseWithPool(n.clone()));
        }
        let mon = &self.pools.monitor;
        if mon.window < MIN_MONITOR_WINDOW {
            return Err(ConfigError::MonitorWindow(mon.window));
        }
        if mon.classifier.agree == 0 {
            return Err(ConfigError::ClassifyWindows);
        }
        if let Some(j) = &self.jail {
            check_jail(j)?;
        }
        Ok(())
    }

    /// A vhost-user back-end maps guest RAM, so RAM must be a shared memfd; behind a vIOMMU it
    /// would need the IOTLB protocol, which Lucid does not speak.
    fn check_vhost_user(&self) -> Result<(), ConfigError> {
        let Some(i) = self
            .devices
            .pci
            .iter()
            .position(|d| matches!(d.kind, PciDeviceKind::VhostUser(_)))
        else {
            return Ok(());
        };
        if self.machine.backing != Backing::SharedMemfd {
            return Err(ConfigError::VhostUserNotShared(i));
        }
        if self.iommu.is_some() {
            return Err(ConfigError::VhostUserIommu(i));
        }
        Ok(())
    }

    /// A vfio-user device maps guest RAM in its server, so RAM must be a shared memfd; its
    /// name joins the others'.
    fn check_user_devices(&self) -> Result<(), ConfigError> {
        if self.devices.user_devices.is_empty() {
            return Ok(());
        }
        if self.machine.backing != Backing::SharedMemfd {
            return Err(ConfigError::UserDeviceNotShared);
        }
        // Every other PCI function's name.
        let d = &self.devices;
        let mut names: std::collections::BTreeSet<String> =
            crate::devices::virtio_names(&d.pci).into_iter().collect();
        names.extend(d.platform_pci.iter().map(|p| p.name().to_string()));
        for (on, name) in [
            (d.balloon.is_some(), crate::devices::BALLOON),
            (d.rng.is_some(), crate::devices::RNG),
            (d.console.is_some(), crate::devices::CONSOLE),
        ] {
            if on {
                names.insert(name.to_string());
            }
        }
        for name in user_device_names(&self.devices.user_devices) {
            if !user_device_name_ok(&name) {
                return Err(ConfigError::DeviceName(name));
            }
            if !names.insert(name.clone()) {
                return Err(ConfigError::DeviceNameTwice(name));
            }
        }
        Ok(())
    }

    /// `swapcache=` where it cannot work: without `--symbiotic`, on rung L0, or on more than
    /// one disk (its counters are one set).
    fn check_swapcache(&self) -> Result<(), ConfigError> {
        let disks: Vec<(usize, &PciDeviceConfig)> = self
            .devices
            .pci
            .iter()
            .filter(|d| matches!(d.kind, PciDeviceKind::Block(_)))
            .enumerate()
            .filter(|(_, d)| d.swapcache_mib > 0)
            .collect();
        if disks.len() > 1 {
            return Err(ConfigError::SwapCacheCount(disks.len()));
        }
        if let Some(&(i, d)) = disks.first() {
            if !self.symbiotic.enabled {
                return Err(ConfigError::SwapCacheNotSymbiotic(i));
            }
            if d.rung == Rung::L0 {
                return Err(ConfigError::SwapCacheRung(i));
            }
        }
        Ok(())
    }

    /// The first disk (index among the disks, logical block size) whose blocks the swap mode
    /// cannot map over guest pages: mapper and vswapper need 4096-byte blocks.
    fn swap_disk_refused(&self) -> Option<(usize, u32)> {
        if self.memory.swap_mode == SwapMode::Baseline {
            return None;
        }
        self.devices
            .pci
            .iter()
            .filter_map(|d| match &d.kind {
                PciDeviceKind::Block(b) => Some(b.logical_block_size),
                _ => None,
            })
            .enumerate()
            .find(|&(_, bs)| bs != 4096)
    }
}

/// A jail that drops to root is none; a chroot must be a directory.
fn check_jail(j: &JailConfig) -> Result<(), ConfigError> {
    if j.uid == 0 || j.gid == 0 {
        return Err(ConfigError::JailRoot);
    }
    match &j.chroot {
        Some(dir) if !dir.is_dir() => Err(ConfigError::JailChroot(dir.clone())),
        _ => Ok(()),
    }
}

/// Largest VM this version builds: 254 vCPUs (APIC IDs 0..253, the I/O APIC takes the next) and
/// 1 TiB of RAM.
pub const MAX_VCPUS: u8 = 254;
pub const MAX_MEM_MIB: u64 = 1 << 20;
/// Smallest RAM that holds the boot structures below 1 MiB plus a kernel.
pub const MIN_MEM_MIB: u64 = 2;
/// Smallest `--memory-limit`: below it Lucid's own threads and page tables do not fit.
pub const MIN_MEMORY_LIMIT_MIB: u64 = 16;
/// Shortest pools' monitor window: shorter windows measure scheduler noise.
pub const MIN_MONITOR_WINDOW: std::time::Duration = std::time::Duration::from_millis(10);

/// A VM configuration this version cannot build.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    #[error(
        "device name {0:?}: 1 to 32 letters, digits, `_` or `-`, and not a name Lucid gives \
         its own devices (balloon, edu, iommu, serial)"
    )]
    DeviceName(String),
    #[error("device name {0:?} is given to two devices")]
    DeviceNameTwice(String),
    #[error("--vcpus {0} is out of range 1..={MAX_VCPUS}")]
    Vcpus(u8),
    #[error("--memory {0} MiB is out of range {MIN_MEM_MIB}..={MAX_MEM_MIB}")]
    Memory(u64),
    #[error("built-in guest {0:?} has no image: fill in its bytes by name before building")]
    BuiltinEmpty(String),
    #[error("the kernel command line contains a NUL byte at offset {0}")]
    CmdlineNul(usize),
    #[error("--device edu given {0} times: a VM has one edu device at most")]
    EduCount(usize),
    #[error("--balloon size={0} MiB is above the largest guest ({MAX_MEM_MIB} MiB)")]
    BalloonSize(u64),
    #[error("--memory-limit {0} MiB is too small: give at least {MIN_MEMORY_LIMIT_MIB} MiB")]
    MemoryLimitTooSmall(u64),
    #[error(
        "--swap-mode {mode} maps 4096-byte disk blocks over guest pages, and blk{disk} has \
         {block_size}-byte logical blocks: add bs=4096 to its --blk option, or use \
         --swap-mode baseline"
    )]
    SwapBlockSize {
        mode: SwapMode,
        disk: usize,
        block_size: u32,
    },
    #[error(
        "blk{0}: swapcache= is SwapBypass, a symbiotic interface: add --symbiotic (or drop \
         swapcache=)"
    )]
    SwapCacheNotSymbiotic(usize),
    #[error(
        "blk{0}: swapcache= needs a back-end thread (its liveness SymCalls must not run on a \
         vCPU thread), and rung L0 serves requests on the vCPU thread: use rung=L1 or above"
    )]
    SwapCacheRung(usize),
    #[error("swapcache= given on {0} disks: a VM has one swap-cached disk at most")]
    SwapCacheCount(usize),
    #[error("--low-noise and --pool {0} exclude each other (low-noise places threads itself)")]
    LowNoiseWithPool(String),
    #[error("the pools' monitor window {0:?} is shorter than {MIN_MONITOR_WINDOW:?}")]
    MonitorWindow(std::time::Duration),
    #[error("the classifier needs at least 1 agreeing window")]
    ClassifyWindows,
    #[error("--jail uid=0 or gid=0 is root's: give an unprivileged user and group")]
    JailRoot,
    #[error("--jail chroot={} is not a directory", .0.display())]
    JailChroot(PathBuf),
    #[error(
        "PCI device {0} is vhost-user: its back-end maps guest RAM, which must then be a \
         shared memfd: add --backing memfd (REST: \"memory\": {{\"shared\": true}})"
    )]
    VhostUserNotShared(usize),
    #[error(
        "PCI device {0} is vhost-user, and a vhost-user back-end behind --iommu would need the \
         IOTLB protocol, which Lucid does not speak: drop --iommu or the vhost-user device"
    )]
    VhostUserIommu(usize),
    #[error(
        "a vfio-user device (--user-device) maps guest RAM in its server, which must then be \
         a shared memfd: add --backing memfd (REST: \"memory\": {{\"shared\": true}})"
    )]
    UserDeviceNotShared,
}

/// A sub-option string Lucid cannot use, saying which part and why.
pub type DeviceOptionError = lucid_opts::OptError;

/// The sub-option tables: each option's syntax, declared once; the parsers below and the CLI's
/// help text both come from them. A new option's table goes here.
pub mod options {
    pub use lucid_opts::{OptError, OptSpec};
    use lucid_opts::{OptHead, OptKey};

    const RUNG: OptKey = OptKey::new(
        "rung",
        "L0|L1|L2|L3|L4|L4p",
        "the device's rung of the exit ladder (default L1)",
    );
    const COALESCE: OptKey = OptKey::new(
        "coalesce",
        "N:USEC",
        "at most N completions or USEC µs per interrupt",
    );
    const POLL_US: OptKey = OptKey::new(
        "poll_us",
        "N",
        "L4: µs the polling thread sleeps when its rings are idle (0 spins)",
    );
    const BW: OptKey = OptKey::new(
        "bw",
        "BYTES_PER_S",
        "rate limit: at most this many bytes a second, with a one-second bucket",
    );
    const BW_BURST: OptKey = OptKey::new(
        "bw_burst",
        "BYTES",
        "rate limit: bytes given once on top of the bucket (with bw=)",
    );
    const OPS: OptKey = OptKey::new(
        "ops",
        "OPS_PER_S",
        "rate limit: at most this many requests a second, with a one-second bucket",
    );
    const OPS_BURST: OptKey = OptKey::new(
        "ops_burst",
        "OPS",
        "rate limit: requests given once on top of the bucket (with ops=)",
    );

    const VHOST_USER: OptKey = OptKey::new(
        "vhost_user",
        "on|off",
        "served by a vhost-user back-end at socket= (needs --backing memfd)",
    );
    const SOCKET: OptKey = OptKey::new("socket", "PATH", "the vhost-user back-end's socket");
    const NUM_QUEUES: OptKey = OptKey::new("num_queues", "N", "vhost-user: queues (default 1)");
    const QUEUE_SIZE: OptKey = OptKey::new(
        "queue_size",
        "N",
        "vhost-user: queue size, a power of 2 (default 128)",
    );

    /// `--fs`.
    pub const FS: OptSpec = OptSpec {
        flag: "--fs",
        about: "A virtio-fs share served by a vhost-user back-end such as virtiofsd (repeatable; \
                needs --backing memfd).",
        head: None,
        keys: &[
            OptKey::new("tag", "TAG", "the tag the guest mounts, 1 to 36 bytes").required(),
            OptKey::new("socket", "PATH", "virtiofsd's socket").required(),
            OptKey::new("num_queues", "N", "request queues (default 1)"),
            QUEUE_SIZE,
            OptKey::new("id", "NAME", "the device's name (default fsN)"),
        ],
    };

    /// `--blk`.
    pub const BLK: OptSpec = OptSpec {
        flag: "--blk",
        about: "A virtio-blk disk on PCI (repeatable).",
        head: None,
        keys: &[
            OptKey::new("path", "FILE", "the disk image (required unless vhost_user=on)")
                .aliases(&["file"]),
            OptKey::new("ro", "on|off", "read-only").aliases(&["readonly"]),
            OptKey::new("bs", "512|4096", "logical block size in bytes").aliases(&["block_size"]),
            OptKey::new("id", "STR", "serial number the guest reads, at most 20 bytes"),
            OptKey::new("cache", "none|writeback", "none opens the image O_DIRECT"),
            RUNG,
            COALESCE,
            POLL_US,
            OptKey::new(
                "swapcache",
                "MiB",
                "SwapBypass's swap cache in front of the disk, 1 to 65536 MiB (needs --symbiotic; implies bs=4096)",
            ),
            OptKey::new(
                "liveness",
                "symcall|spy",
                "what the swap cache asks first whether a slot is live",
            ),
            VHOST_USER,
            SOCKET,
            NUM_QUEUES,
            QUEUE_SIZE,
            BW,
            BW_BURST,
            OPS,
            OPS_BURST,
        ],
    };

    /// `--net`.
    pub const NET: OptSpec = OptSpec {
        flag: "--net",
        about: "A virtio-net NIC on PCI (repeatable).",
        head: None,
        keys: &[
            OptKey::new(
                "backend",
                "tap:IFNAME|echo|sink",
                "a tap device, a loopback that echoes frames, or a sink that drops them \
                 (required unless vhost_user=on)",
            ),
            OptKey::new(
                "rate",
                "MBIT",
                "sink only: paced to MBIT Mbit/s, 1 to 100000 (the pools benchmark's link)",
            ),
            OptKey::new(
                "mac",
                "52:54:00:12:34:56",
                "unicast MAC address (default ends in 56 + index)",
            ),
            RUNG,
            COALESCE,
            POLL_US,
            VHOST_USER,
            SOCKET,
            NUM_QUEUES,
            QUEUE_SIZE,
            BW,
            BW_BURST,
            OPS,
            OPS_BURST,
        ],
    };

    /// `--balloon`.
    pub const BALLOON: OptSpec = OptSpec {
        flag: "--balloon",
        about: "A virtio-balloon on PCI, after the other virtio devices.",
        head: None,
        keys: &[
            OptKey::new(
                "size",
                "MiB",
                "the first target: how much memory the guest gives back",
            )
            .required(),
            OptKey::new(
                "deflate_on_oom",
                "on|off",
                "the guest may deflate under memory pressure",
            ),
            OptKey::new(
                "free_page_reporting",
                "on|off",
                "the guest reports free pages",
            ),
            OptKey::new("stats", "on|off", "the guest reports memory statistics"),
            OptKey::new(
                "manager",
                "on|off",
                "Lucid sizes the balloon from host memory pressure every 200 ms",
            ),
        ],
    };

    /// `--rng`.
    pub const RNG: OptSpec = OptSpec {
        flag: "--rng",
        about: "A virtio-rng on PCI fed from the host's getrandom, after the balloon.",
        head: None,
        keys: &[
            OptKey::new(
                "rate",
                "BYTES_PER_S",
                "at most this many bytes a second, with a one-second burst (default unlimited)",
            ),
            BW,
            BW_BURST,
            OPS,
            OPS_BURST,
        ],
    };

    /// `--console-virtio`.
    pub const CONSOLE_VIRTIO: OptSpec = OptSpec {
        flag: "--console-virtio",
        about: "A virtio-console on PCI, after the rng: port 0's output to stdout, a file, or \
                the client of a Unix socket Lucid listens on (which also gives input).",
        head: Some(OptHead {
            name: "OUTPUT",
            choices: &["tty", "file:PATH", "socket:PATH", "off"],
        }),
        keys: &[
            OptKey::new(
                "port1",
                "PATH",
                "a second port (multiport), its output to this file",
            ),
            OptKey::new("port2", "PATH", "a third port, likewise"),
            OptKey::new("port3", "PATH", "a fourth port, likewise"),
        ],
    };

    /// `--vsock`.
    pub const VSOCK: OptSpec = OptSpec {
        flag: "--vsock",
        about: "A virtio-vsock on PCI whose host end is a Unix socket (hybrid vsock): host \
                programs connect to SOCKET and write `CONNECT <port>\\n`; guest connections \
                to host port P go to SOCKET_P.",
        head: None,
        keys: &[
            OptKey::new("cid", "N", "the guest's context ID, 3 to 4294967294").required(),
            OptKey::new("socket", "PATH", "the Unix socket Lucid listens on").required(),
            OptKey::new("id", "NAME", "the device's name (default vsockN)"),
        ],
    };

    /// `--user-device`.
    pub const USER_DEVICE: OptSpec = OptSpec {
        flag: "--user-device",
        about: "A PCI device served by another process over vfio-user, such as `lucid \
                device-server edu` (repeatable; needs --backing memfd; docs/vfio.md).",
        head: None,
        keys: &[
            OptKey::new("socket", "PATH", "the device server's Unix socket").required(),
            OptKey::new("id", "NAME", "the device's name (default userN)"),
        ],
    };

    /// `--iommu`.
    pub const IOMMU: OptSpec = OptSpec {
        flag: "--iommu",
        about: "An emulated Intel VT-d IOMMU (DMA translation and interrupt remapping).",
        head: Some(OptHead {
            name: "MODEL",
            choices: &["vtd"],
        }),
        keys: &[
            OptKey::new(
                "mode",
                "samecore|sidecore",
                "registers emulated on the vCPU's exit (default) or by a side-core thread",
            ),
            OptKey::new(
                "pin",
                "all|map|deferred",
                "when guest pages are pinned: all at start (default), at map, or deferred",
            ),
        ],
    };

    /// `--device`.
    pub const DEVICE: OptSpec = OptSpec {
        flag: "--device",
        about: "Another PCI device, in the slots after the virtio devices (repeatable): edu is \
                QEMU's edu DMA test device (PCI 1234:11e8; at most one).",
        head: Some(OptHead {
            name: "NAME",
            choices: &["edu"],
        }),
        keys: &[],
    };

    /// `--serial`.
    pub const SERIAL: OptSpec = OptSpec {
        flag: "--serial",
        about: "The console: stdio, a file, or a Unix socket Lucid listens on.",
        head: Some(OptHead {
            name: "OUTPUT",
            choices: &["stdio", "file:PATH", "unix:PATH"],
        }),
        keys: &[],
    };

    /// `--backing`.
    pub const BACKING: OptSpec = OptSpec {
        flag: "--backing",
        about:
            "Guest RAM backing: anonymous memory, a shared memfd, or a private mapping of a file.",
        head: Some(OptHead {
            name: "BACKING",
            choices: &["anon", "memfd", "file:PATH"],
        }),
        keys: &[],
    };

    /// `--jail`.
    pub const JAIL: OptSpec = OptSpec {
        flag: "--jail",
        about: "Once the VM is built, run as this user: no capabilities, no new privileges, \
                file access limited by Landlock where the kernel has it (docs/jail.md).",
        head: None,
        keys: &[
            OptKey::new("uid", "N", "the user to run as (not 0)").required(),
            OptKey::new("gid", "N", "its group (not 0), the only group kept").required(),
            OptKey::new("chroot", "DIR", "the process's root directory from then on"),
        ],
    };

    /// `--pool`.
    pub const POOL: OptSpec = OptSpec {
        flag: "--pool",
        about:
            "The host CPU pool to run in (see `lucid pools`): a pool's name (pinned there), auto \
                (the classifier picks and moves the VM; no pools defined means none) or none.",
        head: Some(OptHead {
            name: "POOL",
            choices: &["NAME", "auto", "none"],
        }),
        keys: &[],
    };
}

/// Parses `--backing` by [`BACKING`].
pub fn parse_backing(s: &str) -> Result<Backing, DeviceOptionError> {
    match BACKING.parse_whole(s)? {
        ("anon", _) => Ok(Backing::Anonymous),
        ("memfd", _) => Ok(Backing::SharedMemfd),
        (_, path) => Ok(Backing::FilePrivate(path.into())),
    }
}

/// Parses `--console-virtio` by [`CONSOLE_VIRTIO`]: `None` for `off`.
pub fn parse_console_virtio(s: &str) -> Result<Option<ConsoleConfig>, DeviceOptionError> {
    let p = CONSOLE_VIRTIO.parse(s)?;
    let head = p.head.unwrap_or_default();
    let output = match CONSOLE_VIRTIO.parse_whole(head)? {
        ("off", _) => return Ok(None),
        ("file:PATH", path) => ConsoleOutput::File(path.into()),
        ("socket:PATH", path) => ConsoleOutput::Socket(path.into()),
        _ => ConsoleOutput::Tty,
    };
    let mut ports = Vec::new();
    for key in ["port1", "port2", "port3"] {
        if let Some(path) = p.get(key) {
            if ports.len() + 1 != key[4..].parse::<usize>().unwrap_or(0) {
                return Err(CONSOLE_VIRTIO.bad(key, path, "the ports before it given too"));
            }
            ports.push(PathBuf::from(path));
        }
    }
    Ok(Some(ConsoleConfig { output, ports }))
}

/// Parses `--serial` by [`SERIAL`].
pub fn parse_serial(s: &str) -> Result<SerialOutput, DeviceOptionError> {
    match SERIAL.parse_whole(s)? {
        ("stdio", _) => Ok(SerialOutput::Stdio),
        ("file:PATH", path) => Ok(SerialOutput::File(path.into())),
        (_, path) => Ok(SerialOutput::Unix(path.into())),
    }
}

/// Parses `--pool` by [`POOL`]; a pool's name is what a cgroup directory may be called.
pub fn parse_pool(s: &str) -> Result<PoolChoice, DeviceOptionError> {
    let (choice, _) = POOL.parse_whole(s)?;
    let bad = || lucid_opts::OptError::BadHead {
        opt: POOL.flag,
        value: s.into(),
        choices: "none, auto or a pool name (a-z A-Z 0-9 _ -)".into(),
    };
    match choice {
        "auto" => Ok(PoolChoice::Auto),
        "none" => Ok(PoolChoice::None),
        _ => s.parse().map_err(|_| bad()),
    }
}

/// Parses `--jail` by [`JAIL`]. Never panics, whatever the input.
pub fn parse_jail(s: &str) -> Result<JailConfig, DeviceOptionError> {
    let spec = &JAIL;
    let p = spec.parse(s)?;
    let id = |key: &'static str| {
        let v = p.get(key).unwrap_or_default();
        v.parse::<u32>()
            .ok()
            .filter(|&n| n != u32::MAX)
            .ok_or_else(|| spec.bad(key, v, "a numeric id below 4294967295"))
    };
    let chroot = match p.get("chroot") {
        Some("") => return Err(spec.bad("chroot", "", "a directory")),
        c => c.map(PathBuf::from),
    };
    Ok(JailConfig {
        uid: id("uid")?,
        gid: id("gid")?,
        chroot,
    })
}

/// Parses `--device NAME`. Never panics, whatever the input (a fuzz target calls it).
pub fn parse_device(s: &str) -> Result<PlatformPciDevice, DeviceOptionError> {
    let p = DEVICE.parse(s)?;
    match p.head {
        Some("edu") => Ok(PlatformPciDevice::Edu),
        h => Err(DEVICE.bad("name", h.unwrap_or_default(), "edu")),
    }
}

/// Parses `--blk` by [`BLK`]. Never panics, whatever the input (a fuzz target calls it).
pub fn parse_blk(s: &str) -> Result<PciDeviceConfig, DeviceOptionError> {
    let spec = &BLK;
    let p = spec.parse(s)?;
    if let Some(d) = vhost_user(spec, &p, || VhostUserKind::Blk)? {
        return Ok(d);
    }
    let mut cfg = BlockConfig {
        path: PathBuf::new(),
        read_only: false,
        logical_block_size: 512,
        id: String::new(),
        direct: false,
    };
    let mut swapcache_mib = 0u32;
    let mut spy_first = None;
    for (k, v) in &p.pairs {
        let v = v.as_str();
        let bad = |key, expected: &str| spec.bad(key, v, expected);
        match *k {
            "path" => cfg.path = PathBuf::from(v),
            "swapcache" => {
                swapcache_mib = v
                    .parse()
                    .ok()
                    .filter(|&m| (1..=65536).contains(&m))
                    .ok_or(bad("swapcache", "a cache size in MiB, 1 to 65536"))?
            }
            "liveness" => {
                spy_first = Some(match v {
                    "symcall" => false,
                    "spy" => true,
                    _ => return Err(bad("liveness", "symcall or spy")),
                })
            }
            "ro" => cfg.read_only = parse_bool(v).ok_or(bad("ro", "on or off"))?,
            "bs" => {
                cfg.logical_block_size = match v {
                    "512" => 512,
                    "4096" | "4k" | "4K" => 4096,
                    _ => return Err(bad("bs", "512 or 4096")),
                }
            }
            "id" if v.len() > 20 => return Err(bad("id", "at most 20 bytes")),
            "id" => cfg.id = v.to_string(),
            "cache" => {
                cfg.direct = match v {
                    "none" | "direct" => true,
                    "writeback" | "host" => false,
                    _ => return Err(bad("cache", "none or writeback")),
                }
            }
            _ => {}
        }
    }
    if cfg.path.as_os_str().is_empty() {
        return Err(spec.bad("path", "", "a file name"));
    }
    if swapcache_mib > 0 {
        // Swap slots are 4 KiB: the cache sees only whole, aligned slots.
        if p.get("bs").is_some() && cfg.logical_block_size != 4096 {
            return Err(spec.bad(
                "bs",
                "512",
                "4096 with swapcache= (the swap cache's slots are 4 KiB)",
            ));
        }
        if cfg.read_only {
            return Err(spec.bad("ro", "on", "off with swapcache= (a swap disk is written)"));
        }
        cfg.logical_block_size = 4096;
    }
    if let (Some(v), 0) = (p.get("liveness"), swapcache_mib) {
        return Err(spec.bad("liveness", v, "given only with swapcache="));
    }
    let mut d = common(spec, &p, PciDeviceKind::Block(cfg))?;
    d.swapcache_mib = swapcache_mib;
    d.swapcache_spy_first = spy_first.unwrap_or(false);
    Ok(d)
}

/// Parses `--net` by [`NET`]. `index` picks the default MAC (52:54:00:12:34:56 + index). Never
/// panics, whatever the input (a fuzz target calls it).
pub fn parse_net(s: &str, index: usize) -> Result<PciDeviceConfig, DeviceOptionError> {
    use lucid_virtio::net::NetBackend;
    let spec = &NET;
    let p = spec.parse(s)?;
    let mut backend = NetBackend::Echo;
    let mut mac = [
        0x52,
        0x54,
        0x00,
        0x12,
        0x34,
        0x56u8.wrapping_add(index as u8),
    ];
    if let Some(v) = p.get("mac") {
        mac = parse_mac(v)?;
    }
    if let Some(d) = vhost_user(spec, &p, || VhostUserKind::Net { mac })? {
        if let Some(b) = p.get("backend") {
            return Err(spec.bad("backend", b, "no backend= with vhost_user=on"));
        }
        return Ok(d);
    }
    if p.get("backend").is_none() {
        return Err(spec.bad("backend", "", "tap:IFNAME, echo or sink"));
    }
    let mut rate = None;
    for (k, v) in &p.pairs {
        let v = v.as_str();
        match *k {
            "rate" => {
                const EXPECTED: &str = "Mbit/s, 1-100000 (e.g. rate=1000 for 1 Gbit/s)";
                let r: u64 = v.parse().map_err(|_| spec.bad("rate", v, EXPECTED))?;
                if r == 0 || r > lucid_virtio::net::SINK_MAX_RATE_MBIT {
                    return Err(spec.bad("rate", v, EXPECTED));
                }
                rate = Some(r);
            }
            "backend" => {
                backend = match v.split_once(':') {
                    Some(("tap", ifname)) if !ifname.is_empty() && ifname.len() < 16 => {
                        NetBackend::Tap(ifname.to_string())
                    }
                    None if v == "echo" => NetBackend::Echo,
                    None if v == "sink" => NetBackend::Sink { rate_mbit: None },
                    _ => {
                        return Err(spec.bad("backend", v, "tap:IFNAME (1-15 bytes), echo or sink"))
                    }
                }
            }
            "mac" => mac = parse_mac(v)?,
            _ => {}
        }
    }
    if let Some(r) = rate {
        match &mut backend {
            NetBackend::Sink { rate_mbit } => *rate_mbit = Some(r),
            _ => {
                return Err(spec.bad(
                    "rate",
                    &format!("{r} with a backend other than sink"),
                    "rate=MBIT only with backend=sink",
                ))
            }
        }
    }
    common(spec, &p, PciDeviceKind::Net(NetConfig { backend, mac }))
}

/// `vhost_user=on,socket=S[,num_queues=N,queue_size=M]` on a `--blk` or `--net`: the
/// vhost-user device, or `None` without `vhost_user=on` (then none of its keys may be given).
fn vhost_user(
    spec: &OptSpec,
    p: &Parsed<'_>,
    kind: impl FnOnce() -> VhostUserKind,
) -> Result<Option<PciDeviceConfig>, DeviceOptionError> {
    let on = match p.get("vhost_user") {
        Some(v) => parse_bool(v).ok_or(spec.bad("vhost_user", v, "on or off"))?,
        None => false,
    };
    if !on {
        for key in ["socket", "num_queues", "queue_size"] {
            if let Some(v) = p.get(key) {
                return Err(spec.bad(key, v, "given only with vhost_user=on"));
            }
        }
        return Ok(None);
    }
    // The device's own data path options are the back-end's business.
    for key in [
        "path",
        "ro",
        "bs",
        "id",
        "cache",
        "swapcache",
        "liveness",
        "coalesce",
        "poll_us",
    ] {
        if let Some(v) = p.get(key) {
            return Err(spec.bad(key, v, "not with vhost_user=on (the back-end decides)"));
        }
    }
    let socket = p.get("socket").filter(|s| !s.is_empty()).ok_or(spec.bad(
        "socket",
        "",
        "the back-end's socket path",
    ))?;
    let kind = kind();
    let net = matches!(kind, VhostUserKind::Net { .. });
    let num_queues = match (net, p.get("num_queues")) {
        // One rx/tx pair.
        (true, None) => 2,
        (true, Some(v)) => v
            .parse::<u16>()
            .ok()
            .filter(|n| n % 2 == 0 && (2..lucid_virtio::vhost_user::MAX_QUEUES).contains(n))
            .ok_or(spec.bad("num_queues", v, "an even number of queues (rx/tx pairs)"))?,
        (false, _) => queue_count(spec, p, "num_queues")?,
    };
    let cfg = VhostUserConfig {
        kind,
        socket: PathBuf::from(socket),
        num_queues,
        queue_size: queue_size(spec, p)?,
    };
    let d = common(spec, p, PciDeviceKind::VhostUser(cfg))?;
    Ok(Some(d))
}

fn queue_count(
    spec: &OptSpec,
    p: &Parsed<'_>,
    key: &'static str,
) -> Result<u16, DeviceOptionError> {
    let max = lucid_virtio::vhost_user::MAX_QUEUES - 1;
    match p.get(key) {
        None => Ok(1),
        Some(v) => v
            .parse::<u16>()
            .ok()
            .filter(|n| (1..=max).contains(n))
            .ok_or(spec.bad(key, v, format!("1 to {max}"))),
    }
}

fn queue_size(spec: &OptSpec, p: &Parsed<'_>) -> Result<u16, DeviceOptionError> {
    let max = lucid_virtio::vhost_user::MAX_QUEUE_SIZE;
    match p.get("queue_size") {
        None => Ok(128),
        Some(v) => v
            .parse::<u16>()
            .ok()
            .filter(|n| n.is_power_of_two() && *n <= max)
            .ok_or(spec.bad("queue_size", v, format!("a power of 2 up to {max}"))),
    }
}

/// Parses `--fs` by [`FS`]: a virtio-fs device on a vhost-user back-end. Never panics,
/// whatever the input.
pub fn parse_fs(s: &str) -> Result<PciDeviceConfig, DeviceOptionError> {
    let spec = &FS;
    let p = spec.parse(s)?;
    let tag = p.get("tag").unwrap_or_default();
    if tag.is_empty() || tag.len() > lucid_virtio::vhost_user::FS_TAG_LEN {
        return Err(spec.bad("tag", tag, "1 to 36 bytes"));
    }
    let socket = p.get("socket").unwrap_or_default();
    if socket.is_empty() {
        return Err(spec.bad("socket", socket, "virtiofsd's socket path"));
    }
    let mut d = PciDeviceConfig::new(PciDeviceKind::VhostUser(VhostUserConfig {
        kind: VhostUserKind::Fs {
            tag: tag.to_string(),
        },
        socket: PathBuf::from(socket),
        num_queues: queue_count(spec, &p, "num_queues")?,
        queue_size: queue_size(spec, &p)?,
    }));
    d.name = p.get("id").map(str::to_string);
    Ok(d)
}

/// Parses `--balloon` by [`BALLOON`]. Never panics, whatever the input.
pub fn parse_balloon(s: &str) -> Result<BalloonConfig, DeviceOptionError> {
    let spec = &BALLOON;
    let p = spec.parse(s)?;
    let mut cfg = BalloonConfig::default();
    for (k, v) in &p.pairs {
        let v = v.as_str();
        let flag = |key| parse_bool(v).ok_or(spec.bad(key, v, "on or off"));
        match *k {
            "size" => {
                cfg.size_mib = v
                    .parse::<u64>()
                    .ok()
                    .filter(|&m| m <= MAX_MEM_MIB)
                    .ok_or(spec.bad("size", v, "MiB, a decimal number"))?
            }
            "deflate_on_oom" => cfg.deflate_on_oom = flag("deflate_on_oom")?,
            "free_page_reporting" => cfg.free_page_reporting = flag("free_page_reporting")?,
            "stats" => cfg.stats = flag("stats")?,
            "manager" => cfg.manager = flag("manager")?,
            _ => {}
        }
    }
    Ok(cfg)
}

/// Parses `--rng` by [`RNG`] (`""` for no options). Never panics, whatever the input.
pub fn parse_rng(s: &str) -> Result<RngConfig, DeviceOptionError> {
    let spec = &RNG;
    let p = spec.parse(s)?;
    let mut cfg = RngConfig::default();
    if let Some(v) = p.get("rate") {
        let max = lucid_virtio::rng::MAX_RATE;
        cfg.rate = Some(
            v.parse::<u64>()
                .ok()
                .filter(|r| (1..=max).contains(r))
                .ok_or(spec.bad("rate", v, format!("bytes per second, 1 to {max}")))?,
        );
    }
    cfg.rate_limiter = rate_limits(spec, &p)?;
    if let (Some(r), Some(_)) = (cfg.rate, cfg.rate_limiter) {
        return Err(spec.bad("rate", &r.to_string(), "rate= or bw=/ops=, not both"));
    }
    Ok(cfg)
}

/// The rate limiter of `bw=`, `bw_burst=`, `ops=`, `ops_burst=` (buckets of one second).
fn rate_limits(
    spec: &OptSpec,
    p: &Parsed<'_>,
) -> Result<Option<RateLimiterConfig>, DeviceOptionError> {
    use lucid_virtio::rate::MAX_TOKENS;
    let num = |key: &'static str, min: u64| -> Result<Option<u64>, DeviceOptionError> {
        p.get(key)
            .map(|v| {
                v.parse::<u64>()
                    .ok()
                    .filter(|n| (min..=MAX_TOKENS).contains(n))
                    .ok_or(spec.bad(key, v, format!("a number, {min} to 2^50")))
            })
            .transpose()
    };
    let bucket = |rate: &'static str, burst: &'static str| match (num(rate, 1)?, num(burst, 0)?) {
        (Some(r), b) => Ok(Some(TokenBucketConfig::per_second(r, b))),
        (None, Some(_)) => Err(spec.bad(burst, "", format!("given only with {rate}="))),
        (None, None) => Ok(None),
    };
    let cfg = RateLimiterConfig {
        bandwidth: bucket("bw", "bw_burst")?,
        ops: bucket("ops", "ops_burst")?,
    };
    Ok((!cfg.is_unlimited()).then_some(cfg))
}

/// Parses `--vsock` by [`VSOCK`]. Never panics, whatever the input.
pub fn parse_vsock(s: &str) -> Result<PciDeviceConfig, DeviceOptionError> {
    let spec = &VSOCK;
    let p = spec.parse(s)?;
    let mut cfg = VsockConfig {
        cid: 0,
        socket: PathBuf::new(),
    };
    let mut name = None;
    for (k, v) in &p.pairs {
        let v = v.as_str();
        match *k {
            "cid" => {
                cfg.cid = v
                    .parse()
                    .ok()
                    .filter(|&c| lucid_virtio::vsock::cid_ok(c))
                    .ok_or(spec.bad("cid", v, "3 to 4294967294"))?
            }
            "socket" if v.is_empty() => return Err(spec.bad("socket", v, "a path")),
            "socket" => cfg.socket = PathBuf::from(v),
            "id" if !device_name_ok(v) => {
                return Err(spec.bad(
                    "id",
                    v,
                    "1 to 32 letters, digits, `_` or `-`, not a reserved name",
                ))
            }
            "id" => name = Some(v.to_string()),
            _ => {}
        }
    }
    let mut d = PciDeviceConfig::new(PciDeviceKind::Vsock(cfg));
    d.name = name;
    Ok(d)
}

/// Parses `--user-device` by [`USER_DEVICE`]. Never panics, whatever the input.
pub fn parse_user_device(s: &str) -> Result<UserDeviceConfig, DeviceOptionError> {
    let spec = &USER_DEVICE;
    let p = spec.parse(s)?;
    let socket = p.get("socket").unwrap_or_default();
    if socket.is_empty() {
        return Err(spec.bad("socket", socket, "the device server's socket path"));
    }
    let id = match p.get("id") {
        Some(v) if !user_device_name_ok(v) => {
            return Err(spec.bad("id", v, "1 to 32 letters, digits, `_` or `-`"))
        }
        v => v.map(str::to_string),
    };
    Ok(UserDeviceConfig {
        socket: PathBuf::from(socket),
        id,
    })
}

/// Parses `--iommu` by [`IOMMU`] (defaults: samecore, pin=all). Never panics, whatever the
/// input (a fuzz target calls it).
pub fn parse_iommu(s: &str) -> Result<VtdConfig, DeviceOptionError> {
    let spec = &IOMMU;
    let p = spec.parse(s)?;
    let mut cfg = VtdConfig {
        mode: EmulationMode::Samecore,
        pin: PinPolicy::All,
    };
    for (k, v) in &p.pairs {
        let v = v.as_str();
        match *k {
            "mode" => {
                cfg.mode = match v {
                    "samecore" => EmulationMode::Samecore,
                    "sidecore" => EmulationMode::Sidecore,
                    _ => return Err(spec.bad("mode", v, "samecore or sidecore")),
                }
            }
            "pin" => {
                cfg.pin = match v {
                    "all" => PinPolicy::All,
                    "map" => PinPolicy::Map,
                    "deferred" => PinPolicy::Deferred,
                    _ => return Err(spec.bad("pin", v, "all, map or deferred")),
                }
            }
            _ => {}
        }
    }
    Ok(cfg)
}

/// The keys every virtio device takes: `rung`, `coalesce`, `poll_us`.
fn common(
    spec: &OptSpec,
    p: &Parsed<'_>,
    kind: PciDeviceKind,
) -> Result<PciDeviceConfig, DeviceOptionError> {
    let mut d = PciDeviceConfig::new(kind);
    if let Some(v) = p.get("rung") {
        d.rung = v
            .parse()
            .map_err(|_| spec.bad("rung", v, "L0, L1, L2, L3, L4 or L4p"))?;
    }
    if let Some(v) = p.get("coalesce") {
        const EXPECTED: &str =
            "N:USEC (at most N completions or USEC µs per interrupt, decimal numbers)";
        let bad = || spec.bad("coalesce", v, EXPECTED);
        let (n, us) = v.split_once(':').ok_or_else(bad)?;
        d.coalescing = Coalescing {
            max_completions: n.parse().map_err(|_| bad())?,
            max_delay_us: us.parse().map_err(|_| bad())?,
        };
    }
    if let Some(v) = p.get("poll_us") {
        d.poll_idle_us = v
            .parse()
            .map_err(|_| spec.bad("poll_us", v, "a number of microseconds"))?;
    }
    d.rate_limiter = rate_limits(spec, p)?;
    Ok(d)
}

fn parse_mac(v: &str) -> Result<[u8; 6], DeviceOptionError> {
    let bad = |expected| NET.bad("mac", v, expected);
    const SIX_BYTES: &str = "six hex bytes like 52:54:00:12:34:56";
    let parts: Vec<&str> = v.split([':', '-']).collect();
    if parts.len() != 6 {
        return Err(bad(SIX_BYTES));
    }
    let mut mac = [0u8; 6];
    for (m, p) in mac.iter_mut().zip(parts) {
        if p.len() != 2 || !p.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(bad(SIX_BYTES));
        }
        *m = u8::from_str_radix(p, 16).map_err(|_| bad(SIX_BYTES))?;
    }
    if mac[0] & 1 != 0 || mac == [0; 6] {
        return Err(bad("a unicast, non-zero address"));
    }
    Ok(mac)
}

#[cfg(test)]
mod tests {
    use super::*;
    use lucid_pci::Rung;
    use lucid_virtio::net::NetBackend;

    #[test]
    fn parses_vhost_user_devices() {
        let PciDeviceKind::VhostUser(v) =
            parse_blk("vhost_user=on,socket=/s,num_queues=2,queue_size=256")
                .unwrap()
                .kind
        else {
            panic!()
        };
        assert_eq!(
            (v.kind, v.socket, v.num_queues, v.queue_size),
            (VhostUserKind::Blk, "/s".into(), 2, 256)
        );
        for bad in [
            "vhost_user=on",
            "vhost_user=on,socket=/s,path=/x",
            "vhost_user=on,socket=/s,queue_size=100",
            "vhost_user=on,socket=/s,num_queues=0",
            "path=/x,socket=/s",
            "vhost_user=maybe,socket=/s",
        ] {
            assert!(parse_blk(bad).is_err(), "{bad}");
        }
        assert!(parse_blk("path=/x,vhost_user=off").is_ok());
        let d = parse_fs("tag=share,socket=/v,id=root,num_queues=2").unwrap();
        assert_eq!(d.name.as_deref(), Some("root"));
        let PciDeviceKind::VhostUser(v) = d.kind else {
            panic!()
        };
        assert_eq!(
            v.queues(),
            3,
            "the high-priority queue and two request queues"
        );
        assert!(parse_fs("tag=,socket=/v").is_err());
        assert!(parse_fs(&format!("tag={},socket=/v", "t".repeat(37))).is_err());
        let PciDeviceKind::VhostUser(v) = parse_net("vhost_user=on,socket=/n", 1).unwrap().kind
        else {
            panic!()
        };
        assert_eq!(
            v.kind,
            VhostUserKind::Net {
                mac: [0x52, 0x54, 0, 0x12, 0x34, 0x57]
            }
        );
        assert_eq!(v.num_queues, 2);
        assert!(parse_net("vhost_user=on,socket=/n,backend=echo", 0).is_err());
        assert!(parse_net("vhost_user=on,socket=/n,num_queues=3", 0).is_err());
        assert!(
            parse_net("mac=52:54:00:12:34:56", 0).is_err(),
            "backend= is required"
        );

        let mut c = VmConfig::new(KernelSource::File("/k".into()));
        c.devices.pci.push(parse_fs("tag=t,socket=/v").unwrap());
        assert_eq!(c.validate(), Err(ConfigError::VhostUserNotShared(0)));
        c.machine.backing = Backing::SharedMemfd;
        assert_eq!(c.validate(), Ok(()));
        c.iommu = Some(parse_iommu("vtd").unwrap());
        assert_eq!(c.validate(), Err(ConfigError::VhostUserIommu(0)));
    }

    #[test]
    fn rate_limit_options() {
        let d = parse_blk("path=/d,bw=1048576,ops=100,ops_burst=50").unwrap();
        let rl = d.rate_limiter.expect("limits");
        assert_eq!(
            rl.bandwidth,
            Some(TokenBucketConfig::per_second(1 << 20, None))
        );
        assert_eq!(rl.ops, Some(TokenBucketConfig::per_second(100, Some(50))));
        let n = parse_net("backend=echo,bw=125000,bw_burst=0", 0).unwrap();
        assert_eq!(
            n.rate_limiter.and_then(|r| r.bandwidth).map(|b| b.size),
            Some(125_000)
        );
        assert_eq!(parse_blk("path=/d").unwrap().rate_limiter, None);
        let r = parse_rng("ops=10").unwrap();
        assert_eq!(r.limits().ops.map(|o| o.rate_per_s()), Some(10));
        assert_eq!(
            parse_rng("rate=4096")
                .unwrap()
                .limits()
                .bandwidth
                .map(|b| b.size),
            Some(4096)
        );
        for bad in [
            "path=/d,bw=0",
            "path=/d,bw=x",
            "path=/d,ops=-1",
            "path=/d,bw_burst=10",
            "path=/d,ops=1,ops_burst=y",
        ] {
            assert!(parse_blk(bad).is_err(), "{bad}");
        }
        assert!(parse_rng("rate=1,bw=1").is_err());
    }

    #[test]
    fn rng_options() {
        assert_eq!(parse_rng("").unwrap(), RngConfig::default());
        assert_eq!(parse_rng("rate=16384").unwrap().rate, Some(16384));
        for bad in [
            "rate=0",
            "rate=x",
            "rate=1073741825",
            "size=1",
            "rate=1,rate=2",
            "on",
        ] {
            assert!(parse_rng(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn vsock_options() {
        let d = parse_vsock("cid=3,socket=/run/v.sock,id=agent").unwrap();
        assert_eq!(d.name.as_deref(), Some("agent"));
        let PciDeviceKind::Vsock(v) = d.kind else {
            panic!("not a vsock")
        };
        assert_eq!((v.cid, v.socket), (3, PathBuf::from("/run/v.sock")));
        assert_eq!(parse_vsock("socket=s,cid=4294967294").unwrap().name, None);
        for bad in [
            "",
            "cid=3",
            "socket=s",
            "cid=2,socket=s",
            "cid=4294967295,socket=s",
            "cid=x,socket=s",
            "cid=3,socket=",
            "cid=3,socket=s,id=rng",
            "cid=3,socket=s,id=a.b",
            "cid=3,socket=s,rung=L1",
        ] {
            assert!(parse_vsock(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn balloon_options() {
        let b =
            parse_balloon("size=128,deflate_on_oom=on,free_page_reporting=on,stats=on,manager=on")
                .unwrap();
        assert_eq!(
            b,
            BalloonConfig {
                size_mib: 128,
                deflate_on_oom: true,
                free_page_reporting: true,
                stats: true,
                manager: true,
            }
        );
        assert_eq!(parse_balloon("size=0").unwrap(), BalloonConfig::default());
        for bad in [
            "",
            "stats=on",
            "size=-1",
            "size=1M",
            "size=99999999999",
            "size=1,stats=maybe",
            "size=1,foo=1",
            "size",
        ] {
            assert!(parse_balloon(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn blk_swapcache_option() {
        let d = parse_blk("path=/tmp/s.img,swapcache=64,cache=none").unwrap();
        assert_eq!(d.swapcache_mib, 64);
        let PciDeviceKind::Block(b) = d.kind else {
            panic!()
        };
        assert_eq!(b.logical_block_size, 4096, "swapcache implies bs=4096");
        assert!(b.direct);
        assert!(parse_blk("path=/tmp/s.img,swapcache=8,bs=4096").is_ok());
        assert_eq!(parse_blk("path=/tmp/s.img").unwrap().swapcache_mib, 0);
        let d = parse_blk("path=/tmp/s.img,swapcache=8,liveness=spy").unwrap();
        assert!(d.swapcache_spy_first);
        assert!(
            !parse_blk("path=/tmp/s.img,swapcache=8")
                .unwrap()
                .swapcache_spy_first
        );
        for bad in [
            "path=/tmp/s.img,swapcache=0",
            "path=/tmp/s.img,swapcache=x",
            "path=/tmp/s.img,swapcache=99999999",
            "path=/tmp/s.img,swapcache=8,bs=512",
            "path=/tmp/s.img,swapcache=8,ro=on",
            "path=/tmp/s.img,liveness=spy",
            "path=/tmp/s.img,swapcache=8,liveness=maybe",
        ] {
            assert!(parse_blk(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn blk_options() {
        let d = parse_blk("path=/tmp/x.img,ro=on,bs=4096,id=disk1,rung=L4p,coalesce=8:50").unwrap();
        assert_eq!(d.rung, Rung::L4 { guest_polls: true });
        assert_eq!(
            d.coalescing,
            Coalescing {
                max_completions: 8,
                max_delay_us: 50
            }
        );
        let PciDeviceKind::Block(b) = d.kind else {
            panic!()
        };
        assert!(b.read_only);
        assert_eq!(b.logical_block_size, 4096);
        assert_eq!(b.id, "disk1");
        assert!(!b.direct, "the page cache by default");
        let d = parse_blk("path=a").unwrap();
        assert_eq!(d.rung, Rung::L1);
        for (opt, direct) in [("cache=none", true), ("cache=writeback", false)] {
            let PciDeviceKind::Block(b) = parse_blk(&format!("path=a,{opt}")).unwrap().kind else {
                panic!()
            };
            assert_eq!(b.direct, direct, "{opt}");
        }
        for bad in [
            "",
            "ro=on",
            "path=a,bs=1024",
            "path=a,ro=maybe",
            "path=a,rung=L9",
            "path=a,coalesce=8",
            "path=a,coalesce=x:1",
            "path=a,colour=red",
            "path",
            "path=a,id=123456789012345678901",
            "path=a,cache=sometimes",
        ] {
            assert!(parse_blk(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn net_options() {
        let d = parse_net("backend=tap:lucid0,mac=02:00:00:00:00:01,rung=L0", 0).unwrap();
        assert_eq!(d.rung, Rung::L0);
        let PciDeviceKind::Net(n) = d.kind else {
            panic!()
        };
        assert_eq!(n.backend, NetBackend::Tap("lucid0".into()));
        assert_eq!(n.mac, [2, 0, 0, 0, 0, 1]);
        let PciDeviceKind::Net(n) = parse_net("backend=echo", 1).unwrap().kind else {
            panic!()
        };
        assert_eq!((n.backend, n.mac[5]), (NetBackend::Echo, 0x57));
        let PciDeviceKind::Net(n) = parse_net("rate=1000,backend=sink", 0).unwrap().kind else {
            panic!()
        };
        assert_eq!(
            n.backend,
            NetBackend::Sink {
                rate_mbit: Some(1000)
            }
        );
        let PciDeviceKind::Net(n) = parse_net("backend=sink", 0).unwrap().kind else {
            panic!()
        };
        assert_eq!(n.backend, NetBackend::Sink { rate_mbit: None });
        for bad in [
            "backend=sink,rate=0",
            "backend=sink,rate=-5",
            "backend=sink,rate=1e3",
            "backend=sink,rate=100001",
            "backend=echo,rate=1000",
            "backend=tap:t0,rate=1000",
            "",
            "backend=tap:",
            "backend=tap:waytoolonginterfacename",
            "backend=udp",
            "backend=sink,mac=01:00:00:00:00:00",
            "backend=sink,mac=zz:00:00:00:00:00",
            "backend=sink,mac=1:2:3",
            "backend=sink,rung=L5",
            // Also found by fuzzing (cli_devices): a sign is not a hex digit.
            "backend=sink,mac=+1:02:03:04:05:06",
        ] {
            assert!(parse_net(bad, 0).is_err(), "{bad}");
        }
    }

    #[test]
    fn iommu_options() {
        let c = parse_iommu("vtd").unwrap();
        assert_eq!((c.mode, c.pin), (EmulationMode::Samecore, PinPolicy::All));
        let c = parse_iommu("vtd,mode=sidecore,pin=deferred").unwrap();
        assert_eq!(
            (c.mode, c.pin),
            (EmulationMode::Sidecore, PinPolicy::Deferred)
        );
        let c = parse_iommu("vtd,pin=map,mode=samecore").unwrap();
        assert_eq!((c.mode, c.pin), (EmulationMode::Samecore, PinPolicy::Map));
        for bad in [
            "",
            "amd",
            "mode=sidecore",
            "vtd,mode=othercore",
            "vtd,pin=some",
            "vtd,mode",
            "vtd,colour=red",
            "VTD",
        ] {
            assert!(parse_iommu(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn device_options() {
        assert_eq!(parse_device("edu"), Ok(PlatformPciDevice::Edu));
        assert_eq!(parse_device("edu,"), Ok(PlatformPciDevice::Edu));
        assert!(matches!(
            parse_device("edu,dma_mask=1"),
            Err(DeviceOptionError::UnknownKey { .. })
        ));
        for bad in ["", ",", "EDU", "edu2", "virtio-blk", "=edu", "edu=1"] {
            assert!(
                matches!(parse_device(bad), Err(DeviceOptionError::BadHead { .. })),
                "{bad}"
            );
        }
        let msg = parse_device("ed").unwrap_err().to_string();
        assert_eq!(msg, "--device \"ed\": expected edu");
    }

    #[test]
    fn whole_value_options() {
        assert_eq!(parse_serial("stdio"), Ok(SerialOutput::Stdio));
        assert_eq!(
            parse_serial("file:/a,b"),
            Ok(SerialOutput::File("/a,b".into()))
        );
        assert_eq!(parse_serial("unix:/s"), Ok(SerialOutput::Unix("/s".into())));
        assert_eq!(parse_backing("memfd"), Ok(Backing::SharedMemfd));
        assert_eq!(
            parse_backing("file:/m"),
            Ok(Backing::FilePrivate("/m".into()))
        );
        assert_eq!(parse_pool("io"), Ok(PoolChoice::Named("io".into())));
        assert_eq!(parse_pool("auto"), Ok(PoolChoice::Auto));
        for bad in ["", "tcp:1", "file:", "unix:"] {
            assert!(parse_serial(bad).is_err(), "{bad}");
        }
        for bad in ["", "floppy", "file:"] {
            assert!(parse_backing(bad).is_err(), "{bad}");
        }
        for bad in ["", "../etc", "a b"] {
            assert!(parse_pool(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn jail_options() {
        let j = parse_jail("uid=65534,gid=65533").unwrap();
        assert_eq!((j.uid, j.gid, j.chroot), (65534, 65533, None));
        let j = parse_jail("gid=2,chroot=/var/empty,uid=1").unwrap();
        assert_eq!(j.chroot, Some(PathBuf::from("/var/empty")));
        for bad in [
            "",
            "uid=1",
            "gid=1",
            "uid=nobody,gid=1",
            "uid=1,gid=-1",
            "uid=1,gid=4294967295",
            "uid=1,gid=99999999999",
            "uid=1,gid=1,chroot=",
            "uid=1,gid=1,user=x",
            "uid=1,uid=2,gid=1",
        ] {
            assert!(parse_jail(bad).is_err(), "{bad}");
        }
        let msg = parse_jail("uid=nobody,gid=1").unwrap_err().to_string();
        assert!(
            msg.contains("--jail uid=nobody: expected a numeric id"),
            "{msg}"
        );
        let mut c = VmConfig::new(kernel());
        c.jail = Some(parse_jail("uid=0,gid=1").unwrap());
        assert_eq!(c.validate(), Err(ConfigError::JailRoot));
        c.jail = Some(parse_jail("uid=1,gid=1,chroot=/nonexistent/lucid").unwrap());
        assert!(matches!(c.validate(), Err(ConfigError::JailChroot(_))));
        c.jail = Some(parse_jail("uid=1,gid=1,chroot=/").unwrap());
        assert_eq!(c.validate(), Ok(()));
    }

    #[test]
    fn repeated_keys_are_refused() {
        assert!(parse_blk("path=a,file=b").is_err());
        assert!(parse_net("backend=echo,backend=sink", 0).is_err());
    }

    #[test]
    fn help_is_generated_from_the_tables() {
        let h = BLK.help();
        assert!(h.contains("path=FILE (also file): the disk image"), "{h}");
        assert!(h.contains("swapcache=MiB"), "{h}");
        let net = NET.syntax();
        assert!(net.contains("backend=tap:IFNAME|echo|sink"), "{net}");
        assert!(net.contains("[,rate=MBIT]"), "{net}");
        assert!(net.contains("[,vhost_user=on|off]"), "{net}");
        assert_eq!(
            IOMMU.syntax(),
            "vtd[,mode=samecore|sidecore][,pin=all|map|deferred]"
        );
        // Every key a parser takes is in its table (an unknown key is refused by the table).
        assert!(parse_blk("path=a,colour=red")
            .unwrap_err()
            .to_string()
            .contains(&BLK.known()));
    }

    fn kernel() -> KernelSource {
        KernelSource::File("/k".into())
    }

    #[test]
    fn bad_configurations_are_typed_errors() {
        let mut c = VmConfig::new(kernel());
        c.machine.vcpus = 0;
        assert_eq!(c.validate(), Err(ConfigError::Vcpus(0)));
        c.machine.vcpus = 255;
        assert_eq!(c.validate(), Err(ConfigError::Vcpus(255)));
        c.machine.vcpus = 1;
        c.machine.mem_mib = 1;
        assert_eq!(c.validate(), Err(ConfigError::Memory(1)));
        c.machine.mem_mib = 64;
        c.payload.cmdline = "a\0b".into();
        assert_eq!(c.validate(), Err(ConfigError::CmdlineNul(1)));
        c.payload.cmdline = "ok".into();
        assert_eq!(c.validate(), Ok(()));
        c.devices.platform_pci = vec![PlatformPciDevice::Edu; 2];
        assert_eq!(c.validate(), Err(ConfigError::EduCount(2)));
        c.devices.platform_pci.pop();
        assert_eq!(c.validate(), Ok(()));
        c.memory.limit_mib = Some(15);
        assert_eq!(c.validate(), Err(ConfigError::MemoryLimitTooSmall(15)));
        c.memory.limit_mib = Some(16);
        assert_eq!(c.validate(), Ok(()));
        c.pools.low_noise = true;
        c.pools.pool = PoolChoice::Named("io".into());
        assert_eq!(
            c.validate(),
            Err(ConfigError::LowNoiseWithPool("io".into()))
        );
        c.pools.pool = PoolChoice::Auto;
        assert_eq!(c.validate(), Ok(()));
        c.pools.monitor.window = std::time::Duration::from_millis(9);
        assert!(matches!(c.validate(), Err(ConfigError::MonitorWindow(_))));
        c.pools.monitor.window = MIN_MONITOR_WINDOW;
        c.pools.monitor.classifier.agree = 0;
        assert_eq!(c.validate(), Err(ConfigError::ClassifyWindows));
        let c = VmConfig::new(KernelSource::Builtin {
            name: "x".into(),
            bytes: &[],
        });
        assert_eq!(c.validate(), Err(ConfigError::BuiltinEmpty("x".into())));
    }

    #[test]
    fn swapcache_needs_symbiotic_a_worker_and_one_disk() {
        let disk = |rung| {
            let mut d = parse_blk("path=/tmp/x.img,swapcache=8").unwrap();
            d.rung = rung;
            d
        };
        let mut c = VmConfig::new(kernel());
        c.devices.pci = vec![disk(Rung::L1)];
        assert_eq!(c.validate(), Err(ConfigError::SwapCacheNotSymbiotic(0)));
        c.symbiotic.enabled = true;
        assert_eq!(c.validate(), Ok(()));
        c.devices.pci = vec![disk(Rung::L0)];
        assert_eq!(c.validate(), Err(ConfigError::SwapCacheRung(0)));
        c.devices.pci = vec![disk(Rung::L1), disk(Rung::L4 { guest_polls: false })];
        assert_eq!(c.validate(), Err(ConfigError::SwapCacheCount(2)));
    }

    #[test]
    fn mapper_modes_need_4k_blocks_and_baseline_does_not() {
        for (mode, bs, refused) in [
            (SwapMode::Mapper, "512", true),
            (SwapMode::Vswapper, "512", true),
            (SwapMode::Mapper, "4096", false),
            (SwapMode::Baseline, "512", false),
        ] {
            let mut c = VmConfig::new(kernel());
            c.memory.swap_mode = mode;
            c.devices.pci = vec![parse_blk(&format!("path=/x,bs={bs}")).unwrap()];
            let want = match refused {
                true => Err(ConfigError::SwapBlockSize {
                    mode,
                    disk: 0,
                    block_size: 512,
                }),
                false => Ok(()),
            };
            assert_eq!(c.validate(), want, "{mode} bs={bs}");
        }
    }

    /// The control API and `--config FILE` read exactly these types: a full configuration
    /// survives JSON, and a short one takes the defaults.
    #[test]
    fn json_round_trip() {
        let mut c = VmConfig::new(kernel());
        c.machine.vcpus = 2;
        c.machine.backing = Backing::FilePrivate("/ram".into());
        c.payload.cmdline = "console=ttyS0".into();
        c.devices.serial = SerialOutput::Unix("/s".into());
        c.devices.pci = vec![
            parse_blk("path=/d,swapcache=8,rung=L4p,coalesce=4:10").unwrap(),
            parse_net("backend=sink,rate=1000", 0).unwrap(),
        ];
        c.devices.platform_pci = vec![PlatformPciDevice::Edu];
        c.devices.balloon = Some(parse_balloon("size=64,stats=on").unwrap());
        c.iommu = Some(parse_iommu("vtd,mode=sidecore,pin=map").unwrap());
        c.memory.limit_mib = Some(128);
        c.memory.swap_mode = SwapMode::Vswapper;
        c.pools.pool = PoolChoice::Named("io".into());
        c.symbiotic.enabled = true;
        c.api.socket = Some("/api".into());
        c.jail = Some(parse_jail("uid=65534,gid=65534,chroot=/").unwrap());
        c.runtime.oom_guard = Some(|| std::process::Command::new("true"));
        let json = serde_json::to_string(&c).unwrap();
        let back: VmConfig = serde_json::from_str(&json).unwrap();
        assert_eq!(serde_json::to_string(&back).unwrap(), json);
        assert_eq!(back.devices, c.devices);
        assert_eq!(back.machine, c.machine);
        assert_eq!(back.memory, c.memory);
        assert_eq!(back.pools, c.pools);
        assert_eq!(back.jail, c.jail);
        assert!(back.runtime.oom_guard.is_none(), "code is not data");

        let short: VmConfig =
            serde_json::from_str(r#"{"payload":{"kernel":{"file":"/k"}},"machine":{"vcpus":2}}"#)
                .unwrap();
        assert_eq!(short.machine.vcpus, 2);
        assert_eq!(short.machine.mem_mib, 256);
        assert_eq!(short.validate(), Ok(()));
        assert!(serde_json::from_str::<VmConfig>(
            r#"{"payload":{"kernel":{"file":"/k"}},"machine":{"cpus":2}}"#
        )
        .is_err());
    }

    /// Option soup from the pieces the parsers look for (and bytes they do not expect): every
    /// string gets a clean Ok or Err, never a panic. The fuzz target does the same at scale.
    #[test]
    fn any_option_string_is_accepted_or_refused_cleanly() {
        const PIECES: &[&str] = &[
            "path",
            "ro",
            "bs",
            "id",
            "rung",
            "coalesce",
            "poll_us",
            "backend",
            "mac",
            "edu",
            "=",
            ",",
            ":",
            "-",
            "tap",
            "echo",
            "sink",
            "rate",
            "vtd",
            "mode",
            "pin",
            "uid",
            "gid",
            "chroot",
            "sidecore",
            "deferred",
            "file",
            "unix",
            "stdio",
            "anon",
            "size",
            "L4p",
            "on",
            "4096",
            "0",
            "18446744073709551616",
            "ff",
            "+1",
            "é",
            "\0",
            "12345678901234567890123",
            "",
        ];
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut accepted = 0;
        for _ in 0..20_000 {
            let mut s = String::new();
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            for i in 0..(x % 12) {
                s.push_str(PIECES[((x >> (i * 5)) % PIECES.len() as u64) as usize]);
            }
            accepted += parse_blk(&s).is_ok() as u32;
            accepted += parse_net(&s, (x % 300) as usize).is_ok() as u32;
            accepted += parse_iommu(&s).is_ok() as u32;
            accepted += parse_device(&s).is_ok() as u32;
            accepted += parse_balloon(&s).is_ok() as u32;
            accepted += parse_serial(&s).is_ok() as u32;
            accepted += parse_backing(&s).is_ok() as u32;
            accepted += parse_pool(&s).is_ok() as u32;
            accepted += parse_jail(&s).is_ok() as u32;
        }
        assert!(accepted > 0, "the soup holds some valid strings");
    }
}

#[cfg(test)]
mod console_virtio_tests {
    use super::*;

    #[test]
    fn console_virtio_outputs_and_ports() {
        let out = |s: &str| {
            parse_console_virtio(s)
                .unwrap()
                .map(|c| (c.output, c.ports))
        };
        assert_eq!(out("off"), None);
        assert_eq!(out("tty"), Some((ConsoleOutput::Tty, vec![])));
        assert_eq!(
            out("file:/tmp/c,port1=/tmp/p1,port2=/tmp/p2"),
            Some((
                ConsoleOutput::File("/tmp/c".into()),
                vec!["/tmp/p1".into(), "/tmp/p2".into()]
            ))
        );
        assert_eq!(
            out("socket:/tmp/s"),
            Some((ConsoleOutput::Socket("/tmp/s".into()), vec![]))
        );
        assert!(parse_console_virtio("tty,port2=/tmp/p2").is_err());
        assert!(parse_console_virtio("pty").is_err());
        assert!(parse_console_virtio("tty,bogus=1").is_err());
    }

    #[test]
    fn user_device_option_names_and_rules() {
        let d = parse_user_device("socket=/run/edu.sock,id=edu0").unwrap();
        assert_eq!(d.socket, PathBuf::from("/run/edu.sock"));
        assert_eq!(d.id.as_deref(), Some("edu0"));
        for bad in [
            "",
            "id=x",
            "socket=",
            "socket=/s,id=a.b",
            "socket=/s,id=",
            "socket=/s,colour=red",
            "socket=/s,socket=/t",
        ] {
            assert!(parse_user_device(bad).is_err(), "{bad}");
        }
        let u = |id: Option<&str>| UserDeviceConfig {
            socket: "/s".into(),
            id: id.map(str::to_string),
        };
        assert_eq!(
            user_device_names(&[u(None), u(Some("user0")), u(None)]),
            ["user1", "user0", "user2"]
        );

        let mut c = VmConfig::new(KernelSource::File("/k".into()));
        c.devices.user_devices.push(u(None));
        assert_eq!(c.validate(), Err(ConfigError::UserDeviceNotShared));
        c.machine.backing = Backing::SharedMemfd;
        assert_eq!(c.validate(), Ok(()));
        // A named one is skipped by the default names, but two of one name clash.
        c.devices.user_devices.push(u(Some("user0")));
        assert_eq!(c.validate(), Ok(()));
        c.devices.user_devices.push(u(Some("user0")));
        assert_eq!(
            c.validate(),
            Err(ConfigError::DeviceNameTwice("user0".into()))
        );
        // `edu` names an out-of-process edu, unless the VM has Lucid's own.
        c.devices.user_devices.truncate(1);
        c.devices.user_devices[0].id = Some("edu".into());
        assert_eq!(c.validate(), Ok(()));
        c.devices.platform_pci.push(PlatformPciDevice::Edu);
        assert_eq!(
            c.validate(),
            Err(ConfigError::DeviceNameTwice("edu".into()))
        );
        c.devices.platform_pci.clear();
        c.devices.user_devices[0].id = None;
        // The config file carries them; a config without any still reads.
        let json = serde_json::to_string(&c).unwrap();
        assert!(
            json.contains("\"user_devices\":[{\"socket\":\"/s\"}]"),
            "{json}"
        );
        let back: VmConfig = serde_json::from_str(&json).unwrap();
        assert_eq!(back.devices.user_devices, c.devices.user_devices);
        let none = serde_json::to_string(&VmConfig::new(KernelSource::File("/k".into()))).unwrap();
        assert!(!none.contains("user_devices"));
    }
}
