//! What a VM is made of, as the CLI (or a test, or later the API) describes it.

use std::path::PathBuf;

use lucid_devices::SerialOutput;
use lucid_mem::Backing;
use lucid_pci::Rung;
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
}

impl PciDeviceConfig {
    pub fn new(kind: PciDeviceKind) -> Self {
        PciDeviceConfig {
            kind,
            rung: Rung::default(),
            coalescing: Coalescing::default(),
            poll_idle_us: 0,
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
    /// none, the VM has no PCI bus at all.
    pub pci: Vec<PciDeviceConfig>,
    /// Confine Lucid's threads with a seccomp filter per role (docs/security.md).
    pub seccomp: bool,
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
            seccomp: true,
        }
    }
}

/// Largest VM this version builds: 254 vCPUs (APIC IDs 0..253, the I/O APIC takes the next) and
/// 1 TiB of RAM.
pub const MAX_VCPUS: u8 = 254;
pub const MAX_MEM_MIB: u64 = 1 << 20;
/// Smallest RAM that holds the boot structures below 1 MiB plus a kernel.
pub const MIN_MEM_MIB: u64 = 2;

/// Parses `--blk path=FILE[,ro=on|off][,bs=512|4096][,id=STR][,rung=L0..L4|L4p]
/// [,coalesce=N:USEC][,poll_us=N]`.
pub fn parse_blk(s: &str) -> Result<PciDeviceConfig, String> {
    let mut cfg = BlockConfig {
        path: PathBuf::new(),
        read_only: false,
        logical_block_size: 512,
        id: String::new(),
    };
    let mut common = Common::default();
    for (k, v) in pairs("--blk", s)? {
        match k {
            "path" | "file" => cfg.path = PathBuf::from(v),
            "ro" | "readonly" => cfg.read_only = parse_bool("--blk", k, v)?,
            "bs" | "block_size" => {
                cfg.logical_block_size = match v {
                    "512" => 512,
                    "4096" | "4k" | "4K" => 4096,
                    _ => return Err(format!("--blk bs={v}: expected 512 or 4096")),
                }
            }
            "id" => {
                if v.len() > 20 {
                    return Err(format!("--blk id={v:?}: at most 20 bytes"));
                }
                cfg.id = v.to_string();
            }
            _ => common.set("--blk", k, v, "path, ro, bs, id")?,
        }
    }
    if cfg.path.as_os_str().is_empty() {
        return Err(format!("--blk {s:?}: path=FILE is required"));
    }
    Ok(common.finish(PciDeviceKind::Block(cfg)))
}

/// Parses `--net backend=tap:IFNAME|echo|sink[,mac=52:54:00:..][,rung=..][,coalesce=N:USEC]
/// [,poll_us=N]`. `index` picks the default MAC (52:54:00:12:34:56 + index).
pub fn parse_net(s: &str, index: usize) -> Result<PciDeviceConfig, String> {
    use lucid_virtio::net::NetBackend;
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
    for (k, v) in pairs("--net", s)? {
        match k {
            "backend" => {
                backend = Some(match v.split_once(':') {
                    Some(("tap", ifname)) if !ifname.is_empty() && ifname.len() < 16 => {
                        NetBackend::Tap(ifname.to_string())
                    }
                    None if v == "echo" => NetBackend::Echo,
                    None if v == "sink" => NetBackend::Sink,
                    _ => {
                        return Err(format!(
                            "--net backend={v}: expected tap:IFNAME (1-15 bytes), echo or sink"
                        ))
                    }
                })
            }
            "mac" => mac = parse_mac(v)?,
            _ => common.set("--net", k, v, "backend, mac")?,
        }
    }
    let backend =
        backend.ok_or_else(|| format!("--net {s:?}: backend=tap:IFNAME|echo|sink is required"))?;
    Ok(common.finish(PciDeviceKind::Net(NetConfig { backend, mac })))
}

#[derive(Default)]
struct Common {
    rung: Option<Rung>,
    coalescing: Coalescing,
    poll_idle_us: u32,
}

impl Common {
    fn set(&mut self, opt: &str, k: &str, v: &str, own: &str) -> Result<(), String> {
        match k {
            "rung" => self.rung = Some(v.parse().map_err(|e| format!("{opt} rung={v}: {e}"))?),
            "coalesce" => {
                let (n, us) = v.split_once(':').ok_or_else(|| {
                    format!("{opt} coalesce={v}: expected N:USEC (at most N completions or USEC µs per interrupt)")
                })?;
                let num = |x: &str| {
                    x.parse::<u32>()
                        .map_err(|_| format!("{opt} coalesce={v}: {x:?} is not a number"))
                };
                self.coalescing = Coalescing {
                    max_completions: num(n)?,
                    max_delay_us: num(us)?,
                };
            }
            "poll_us" => {
                self.poll_idle_us = v
                    .parse()
                    .map_err(|_| format!("{opt} poll_us={v}: not a number"))?
            }
            _ => {
                return Err(format!(
                    "{opt}: unknown option {k:?} (options: {own}, rung, coalesce, poll_us)"
                ))
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
        }
    }
}

fn pairs<'a>(opt: &str, s: &'a str) -> Result<Vec<(&'a str, &'a str)>, String> {
    s.split(',')
        .filter(|p| !p.is_empty())
        .map(|p| {
            p.split_once('=')
                .ok_or_else(|| format!("{opt} {s:?}: {p:?} is not KEY=VALUE"))
        })
        .collect()
}

fn parse_bool(opt: &str, k: &str, v: &str) -> Result<bool, String> {
    match v {
        "on" | "true" | "1" | "yes" => Ok(true),
        "off" | "false" | "0" | "no" => Ok(false),
        _ => Err(format!("{opt} {k}={v}: expected on or off")),
    }
}

fn parse_mac(v: &str) -> Result<[u8; 6], String> {
    let bad = || format!("--net mac={v}: expected six hex bytes like 52:54:00:12:34:56");
    let parts: Vec<&str> = v.split([':', '-']).collect();
    if parts.len() != 6 {
        return Err(bad());
    }
    let mut mac = [0u8; 6];
    for (m, p) in mac.iter_mut().zip(parts) {
        // from_str_radix alone would take a sign: "+2" is not a hex byte.
        if p.len() != 2 || !p.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(bad());
        }
        *m = u8::from_str_radix(p, 16).map_err(|_| bad())?;
    }
    if mac[0] & 1 != 0 || mac == [0; 6] {
        return Err(format!("--net mac={v}: a multicast or zero address"));
    }
    Ok(mac)
}

#[cfg(test)]
mod tests {
    use super::*;
    use lucid_pci::Rung;
    use lucid_virtio::net::NetBackend;

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
        let d = parse_blk("path=a").unwrap();
        assert_eq!(d.rung, Rung::L1);
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
        for bad in [
            "",
            "backend=tap:",
            "backend=tap:waytoolonginterfacename",
            "backend=udp",
            "backend=sink,mac=01:00:00:00:00:00",
            "backend=sink,mac=zz:00:00:00:00:00",
            "backend=sink,mac=1:2:3",
            "backend=sink,rung=L5",
            // Found by fuzzing (cli_devices): a sign is not a hex digit.
            "mac=+2:00:00:00:00:01,backend=tap:0",
        ] {
            assert!(parse_net(bad, 0).is_err(), "{bad}");
        }
    }
}
