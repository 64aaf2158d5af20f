//! What a VM is made of, as the CLI (or a test, or later the API) describes it.

use std::path::PathBuf;

use lucid_devices::SerialOutput;
use lucid_iommu::{EmulationMode, PinPolicy, VtdConfig};
use lucid_mem::Backing;
use lucid_pci::Rung;
use lucid_virtio::balloon::BalloonConfig;
use lucid_virtio::blk::BlockConfig;
use lucid_virtio::net::NetConfig;
use lucid_virtio::Coalescing;

/// A virtio device on the PCI bus.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PciDeviceKind {
    Block(BlockConfig),
    Net(NetConfig),
}

/// One PCI device: what it is and its rung of the exit ladder.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PciDeviceConfig {
    pub kind: PciDeviceKind,
    pub rung: Rung,
    pub coalescing: Coalescing,
    /// L4: the polling thread sleeps this long when its rings are idle (0 spins).
    pub poll_idle_us: u32,
    /// `swapcache=MiB` on a `--blk`: SwapBypass's swap cache of this many MiB in front of the
    /// disk (docs/symbiotic.md §6); 0 = none. Needs `--symbiotic`, 4096-byte blocks and a
    /// rung with a worker thread (L1 or above).
    pub swapcache_mib: u32,
    /// `liveness=spy`: the swap cache asks the SymSpy swap map before SymCall `SLOT_LIVE`
    /// (no exit per question); default SymCall first.
    pub swapcache_spy_first: bool,
}

impl PciDeviceConfig {
    pub fn new(kind: PciDeviceKind) -> Self {
        PciDeviceConfig {
            kind,
            rung: Rung::default(),
            coalescing: Coalescing::default(),
            poll_idle_us: 0,
            swapcache_mib: 0,
            swapcache_spy_first: false,
        }
    }
}

/// A device on the PCI bus that is not virtio (`--device`). They take the slots after the virtio
/// devices.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
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
    /// virtio devices on PCI (bus 0, slots from 1 in this order; named blk0.., net0..). With
    /// none of these and no `platform_pci`, the VM has no PCI bus at all.
    pub pci: Vec<PciDeviceConfig>,
    /// Other PCI devices, in the slots after the virtio devices, in this order.
    pub platform_pci: Vec<PlatformPciDevice>,
    /// Confine Lucid's threads with a seccomp filter per role (docs/security.md).
    pub seccomp: bool,
    /// An emulated Intel VT-d (`--iommu vtd`): every device's DMA and MSIs go through it.
    pub iommu: Option<VtdConfig>,
    /// The host CPU pool the VM runs in (`--pool`; docs/scheduling.md).
    pub pool: crate::pools::PoolChoice,
    /// `--low-noise`: vCPUs pinned one per CPU, everything else elsewhere, no periodic work.
    pub low_noise: bool,
    /// The pools' monitor window and classifier settings.
    pub monitor: crate::pools::MonitorTuning,
    /// A virtio-balloon (`--balloon`), on PCI after the devices of `pci`, named `balloon`.
    pub balloon: Option<BalloonConfig>,
    /// `--memory-limit`: the host memory the VM's process may use (a memory cgroup with host
    /// swap behind it); the guest still has `mem_mib`. It moves the whole calling process into
    /// the cgroup (`lucid/vm-<pid>`) until the `Vm` is dropped.
    pub memory_limit_mib: Option<u64>,
    /// `--swap-mode`: how the VM's memory is swapped when it is over its limit.
    pub swap_mode: lucid_swap::SwapMode,
    /// `--swap-pager`: with a memory limit, a `lucid-pager` thread keeps usage under it with
    /// `MADV_PAGEOUT` (docs/vswapper.md: the kernel's limit reclaim fails on PVM hosts); off
    /// leaves reclaim to the kernel.
    pub swap_pager: bool,
    /// `--symbiotic`: offer the symbiotic interfaces (discovery, SymSpy, SymCall, SwapBypass,
    /// modules; docs/symbiotic.md). Off, their hypercalls are unknown to the guest.
    pub symbiotic: bool,
    /// `--api-socket`: serve the control API on this Unix socket (`crate::api`;
    /// docs/symbiotic.md).
    pub api_socket: Option<PathBuf>,
    /// Where the control API finds the modules `{"op":"module_load","builtin":NAME}` names
    /// (the CLI gives the guest kit's).
    pub builtin_modules: Option<crate::api::BuiltinModules>,
    /// The command that runs `lucid_swap::guard::serve` (the CLI: `lucid __oom-guard`): with a
    /// cgroup v1 limit and the pager, a process outside the limit that frees guest RAM when
    /// every Lucid thread waits for memory. None: no guard.
    pub oom_guard: Option<fn() -> std::process::Command>,
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
            pci: Vec::new(),
            platform_pci: Vec::new(),
            seccomp: true,
            iommu: None,
            pool: crate::pools::PoolChoice::Auto,
            low_noise: false,
            monitor: crate::pools::MonitorTuning::default(),
            balloon: None,
            memory_limit_mib: None,
            swap_mode: lucid_swap::SwapMode::Baseline,
            swap_pager: true,
            symbiotic: false,
            api_socket: None,
            builtin_modules: None,
            oom_guard: None,
        }
    }
}

/// Largest VM this version builds: 254 vCPUs (APIC IDs 0..253, the I/O APIC takes the next) and
/// 1 TiB of RAM.
pub const MAX_VCPUS: u8 = 254;
pub const MAX_MEM_MIB: u64 = 1 << 20;
/// Smallest RAM that holds the boot structures below 1 MiB plus a kernel.
pub const MIN_MEM_MIB: u64 = 2;

/// A `--blk`, `--net` or `--device` option string Lucid cannot use, saying which part and why.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum DeviceOptionError {
    #[error("{opt} {input:?}: {pair:?} is not KEY=VALUE")]
    NotKeyValue {
        opt: &'static str,
        input: String,
        pair: String,
    },
    #[error("{opt}: unknown option {key:?} (options: {known})")]
    UnknownKey {
        opt: &'static str,
        key: String,
        known: &'static str,
    },
    #[error("{opt} {key}={value}: expected {expected}")]
    BadValue {
        opt: &'static str,
        key: &'static str,
        value: String,
        expected: &'static str,
    },
    #[error("{opt} {input:?}: {what} is required")]
    Missing {
        opt: &'static str,
        input: String,
        what: &'static str,
    },
    #[error("--device {name:?}: no such device (devices: edu)")]
    UnknownDevice { name: String },
    #[error("--device {device}: takes no options, got {pair:?}")]
    NoOptions { device: &'static str, pair: String },
}

/// Parses `--device NAME[,KEY=VALUE..]`. The only device is `edu`, which takes no options.
/// Never panics, whatever the input (a fuzz target calls it).
pub fn parse_device(s: &str) -> Result<PlatformPciDevice, DeviceOptionError> {
    let mut parts = s.split(',').filter(|p| !p.is_empty());
    let name = parts.next().unwrap_or_default();
    let device = match name {
        "edu" => PlatformPciDevice::Edu,
        _ => return Err(DeviceOptionError::UnknownDevice { name: name.into() }),
    };
    if let Some(pair) = parts.next() {
        return Err(DeviceOptionError::NoOptions {
            device: device.name(),
            pair: pair.into(),
        });
    }
    Ok(device)
}

/// Parses `--blk path=FILE[,ro=on|off][,bs=512|4096][,id=STR][,cache=none|writeback]
/// [,rung=L0..L4|L4p][,coalesce=N:USEC][,poll_us=N][,swapcache=MiB]`. `cache=none` opens the image `O_DIRECT`;
/// `swapcache=MiB` puts SwapBypass's swap cache in front of the disk (it implies `bs=4096`);
/// `liveness=symcall|spy` picks what the cache asks first whether a slot is live. Never panics, whatever the input (a fuzz target calls it).
pub fn parse_blk(s: &str) -> Result<PciDeviceConfig, DeviceOptionError> {
    const OPT: &str = "--blk";
    let mut cfg = BlockConfig {
        path: PathBuf::new(),
        read_only: false,
        logical_block_size: 512,
        id: String::new(),
        direct: false,
    };
    let mut common = Common::default();
    let mut swapcache_mib = 0u32;
    let mut spy_first = None;
    let mut bs_given = false;
    for (k, v) in pairs(OPT, s)? {
        let bad = |key, expected| bad_value(OPT, key, v, expected);
        match k {
            "path" | "file" => cfg.path = PathBuf::from(v),
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
            "ro" | "readonly" => cfg.read_only = parse_bool(v).ok_or(bad("ro", "on or off"))?,
            "bs" | "block_size" => {
                bs_given = true;
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
            _ => common.set(
                OPT,
                k,
                v,
                "path, ro, bs, id, cache, rung, coalesce, poll_us, swapcache, liveness",
            )?,
        }
    }
    if cfg.path.as_os_str().is_empty() {
        return Err(DeviceOptionError::Missing {
            opt: OPT,
            input: s.into(),
            what: "path=FILE",
        });
    }
    if swapcache_mib > 0 {
        // Swap slots are 4 KiB: the cache sees only whole, aligned slots.
        if bs_given && cfg.logical_block_size != 4096 {
            return Err(bad_value(
                OPT,
                "bs",
                "512",
                "4096 with swapcache= (the swap cache's slots are 4 KiB)",
            ));
        }
        if cfg.read_only {
            return Err(bad_value(
                OPT,
                "ro",
                "on",
                "off with swapcache= (a swap disk is written)",
            ));
        }
        cfg.logical_block_size = 4096;
    }
    if spy_first.is_some() && swapcache_mib == 0 {
        return Err(bad_value(
            OPT,
            "liveness",
            if spy_first == Some(true) {
                "spy"
            } else {
                "symcall"
            },
            "given only with swapcache=",
        ));
    }
    let mut d = common.finish(PciDeviceKind::Block(cfg));
    d.swapcache_mib = swapcache_mib;
    d.swapcache_spy_first = spy_first.unwrap_or(false);
    Ok(d)
}

/// Parses `--net backend=tap:IFNAME|echo|sink[,rate=MBIT][,mac=52:54:00:..][,rung=..]
/// [,coalesce=N:USEC][,poll_us=N]` (`rate`: a sink paced to that many Mbit/s, sink only). `index` picks the default MAC (52:54:00:12:34:56 + index). Never panics,
/// whatever the input (a fuzz target calls it).
pub fn parse_net(s: &str, index: usize) -> Result<PciDeviceConfig, DeviceOptionError> {
    use lucid_virtio::net::NetBackend;
    const OPT: &str = "--net";
    let mut backend = None;
    let mut mac = [
        0x52,
        0x54,
        0x00,
        0x12,
        0x34,
        0x56u8.wrapping_add(index as u8),
    ];
    let mut common = Common::default();
    let mut rate = None;
    for (k, v) in pairs(OPT, s)? {
        match k {
            "rate" => {
                const EXPECTED: &str = "Mbit/s, 1-100000 (e.g. rate=1000 for 1 Gbit/s)";
                let r: u64 = v.parse().map_err(|_| bad_value(OPT, "rate", v, EXPECTED))?;
                if r == 0 || r > lucid_virtio::net::SINK_MAX_RATE_MBIT {
                    return Err(bad_value(OPT, "rate", v, EXPECTED));
                }
                rate = Some(r);
            }
            "backend" => {
                backend = Some(match v.split_once(':') {
                    Some(("tap", ifname)) if !ifname.is_empty() && ifname.len() < 16 => {
                        NetBackend::Tap(ifname.to_string())
                    }
                    None if v == "echo" => NetBackend::Echo,
                    None if v == "sink" => NetBackend::Sink { rate_mbit: None },
                    _ => {
                        return Err(bad_value(
                            OPT,
                            "backend",
                            v,
                            "tap:IFNAME (1-15 bytes), echo or sink",
                        ))
                    }
                })
            }
            "mac" => mac = parse_mac(v)?,
            _ => common.set(OPT, k, v, "backend, rate, mac, rung, coalesce, poll_us")?,
        }
    }
    let mut backend = backend.ok_or_else(|| DeviceOptionError::Missing {
        opt: OPT,
        input: s.into(),
        what: "backend=tap:IFNAME|echo|sink",
    })?;
    if let Some(r) = rate {
        match &mut backend {
            NetBackend::Sink { rate_mbit } => *rate_mbit = Some(r),
            _ => {
                return Err(bad_value(
                    OPT,
                    "rate",
                    &format!("{r} with a backend other than sink"),
                    "rate=MBIT only with backend=sink",
                ))
            }
        }
    }
    Ok(common.finish(PciDeviceKind::Net(NetConfig { backend, mac })))
}

/// Parses `--balloon size=MiB[,deflate_on_oom=on][,free_page_reporting=on][,stats=on]
/// [,manager=on]`: the first target (how much the guest gives back) and the features offered.
/// Never panics, whatever the input.
pub fn parse_balloon(s: &str) -> Result<BalloonConfig, DeviceOptionError> {
    const OPT: &str = "--balloon";
    let mut cfg = BalloonConfig::default();
    let mut size = None;
    for (k, v) in pairs(OPT, s)? {
        let flag = |key| parse_bool(v).ok_or(bad_value(OPT, key, v, "on or off"));
        match k {
            "size" => {
                size = Some(
                    v.parse::<u64>()
                        .ok()
                        .filter(|&m| m <= MAX_MEM_MIB)
                        .ok_or(bad_value(OPT, "size", v, "MiB, a decimal number"))?,
                )
            }
            "deflate_on_oom" => cfg.deflate_on_oom = flag("deflate_on_oom")?,
            "free_page_reporting" => cfg.free_page_reporting = flag("free_page_reporting")?,
            "stats" => cfg.stats = flag("stats")?,
            "manager" => cfg.manager = flag("manager")?,
            _ => {
                return Err(DeviceOptionError::UnknownKey {
                    opt: OPT,
                    key: k.into(),
                    known: "size, deflate_on_oom, free_page_reporting, stats, manager",
                })
            }
        }
    }
    cfg.size_mib = size.ok_or_else(|| DeviceOptionError::Missing {
        opt: OPT,
        input: s.into(),
        what: "size=MiB",
    })?;
    Ok(cfg)
}

/// Parses `--iommu vtd[,mode=samecore|sidecore][,pin=all|map|deferred]` (defaults: samecore,
/// pin=all: every guest page pinned at start). Never panics, whatever the input (a fuzz target
/// calls it).
pub fn parse_iommu(s: &str) -> Result<VtdConfig, DeviceOptionError> {
    const OPT: &str = "--iommu";
    let (model, rest) = s.split_once(',').unwrap_or((s, ""));
    if model != "vtd" {
        return Err(DeviceOptionError::Missing {
            opt: OPT,
            input: s.into(),
            what: "the model first (vtd)",
        });
    }
    let mut cfg = VtdConfig {
        mode: EmulationMode::Samecore,
        pin: PinPolicy::All,
    };
    for (k, v) in pairs(OPT, rest)? {
        match k {
            "mode" => {
                cfg.mode = match v {
                    "samecore" => EmulationMode::Samecore,
                    "sidecore" => EmulationMode::Sidecore,
                    _ => return Err(bad_value(OPT, "mode", v, "samecore or sidecore")),
                }
            }
            "pin" => {
                cfg.pin = match v {
                    "all" => PinPolicy::All,
                    "map" => PinPolicy::Map,
                    "deferred" => PinPolicy::Deferred,
                    _ => return Err(bad_value(OPT, "pin", v, "all, map or deferred")),
                }
            }
            _ => {
                return Err(DeviceOptionError::UnknownKey {
                    opt: OPT,
                    key: k.into(),
                    known: "mode, pin",
                })
            }
        }
    }
    Ok(cfg)
}

#[derive(Default)]
struct Common {
    rung: Option<Rung>,
    coalescing: Coalescing,
    poll_idle_us: u32,
}

impl Common {
    fn set(
        &mut self,
        opt: &'static str,
        k: &str,
        v: &str,
        known: &'static str,
    ) -> Result<(), DeviceOptionError> {
        let bad = |key, expected| bad_value(opt, key, v, expected);
        match k {
            "rung" => {
                self.rung = Some(
                    v.parse()
                        .map_err(|_| bad("rung", "L0, L1, L2, L3, L4 or L4p"))?,
                )
            }
            "coalesce" => {
                const EXPECTED: &str =
                    "N:USEC (at most N completions or USEC µs per interrupt, decimal numbers)";
                let (n, us) = v.split_once(':').ok_or(bad("coalesce", EXPECTED))?;
                self.coalescing = Coalescing {
                    max_completions: n.parse().map_err(|_| bad("coalesce", EXPECTED))?,
                    max_delay_us: us.parse().map_err(|_| bad("coalesce", EXPECTED))?,
                };
            }
            "poll_us" => {
                self.poll_idle_us = v
                    .parse()
                    .map_err(|_| bad("poll_us", "a number of microseconds"))?
            }
            _ => {
                return Err(DeviceOptionError::UnknownKey {
                    opt,
                    key: k.into(),
                    known,
                })
            }
        }
        Ok(())
    }

    fn finish(self, kind: PciDeviceKind) -> PciDeviceConfig {
        PciDeviceConfig {
            kind,
            rung: self.rung.unwrap_or_default(),
            coalescing: self.coalescing,
            poll_idle_us: self.poll_idle_us,
            swapcache_mib: 0,
            swapcache_spy_first: false,
        }
    }
}

fn bad_value(
    opt: &'static str,
    key: &'static str,
    value: &str,
    expected: &'static str,
) -> DeviceOptionError {
    DeviceOptionError::BadValue {
        opt,
        key,
        value: value.into(),
        expected,
    }
}

fn pairs<'a>(opt: &'static str, s: &'a str) -> Result<Vec<(&'a str, &'a str)>, DeviceOptionError> {
    s.split(',')
        .filter(|p| !p.is_empty())
        .map(|p| {
            p.split_once('=')
                .ok_or_else(|| DeviceOptionError::NotKeyValue {
                    opt,
                    input: s.into(),
                    pair: p.into(),
                })
        })
        .collect()
}

fn parse_bool(v: &str) -> Option<bool> {
    match v {
        "on" | "true" | "1" | "yes" => Some(true),
        "off" | "false" | "0" | "no" => Some(false),
        _ => None,
    }
}

fn parse_mac(v: &str) -> Result<[u8; 6], DeviceOptionError> {
    let bad = |expected| bad_value("--net", "mac", v, expected);
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
        assert_eq!(
            parse_device("edu,dma_mask=1"),
            Err(DeviceOptionError::NoOptions {
                device: "edu",
                pair: "dma_mask=1".into()
            })
        );
        for bad in ["", ",", "EDU", "edu2", "virtio-blk", "=edu", "edu=1"] {
            assert!(
                matches!(
                    parse_device(bad),
                    Err(DeviceOptionError::UnknownDevice { .. })
                ),
                "{bad}"
            );
        }
        let msg = parse_device("ed").unwrap_err().to_string();
        assert_eq!(msg, "--device \"ed\": no such device (devices: edu)");
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
            "sidecore",
            "deferred",
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
        }
        assert!(accepted > 0, "the soup holds some valid strings");
    }
}
