//! The CLI's sub-option strings (`--blk`, `--net`, `--iommu`, `--rng`, `--vsock`, `--device`, `--serial`,
//! `--backing`, `--pool`, the pools' `--def`): any string gets a config or an error, an accepted config written back as an option string parses to the same config, and an
//! accepted MAC address is made of hex digits.
#![no_main]

use libfuzzer_sys::fuzz_target;
use lucid_pci::Rung;
use lucid_virtio::net::NetBackend;
use lucid_virtio::vhost_user::VhostUserKind;
use lucid_vmm::lucid_iommu::{EmulationMode, PinPolicy, VtdConfig};
use lucid_vmm::{
    parse_blk, parse_device, parse_iommu, parse_net, PciDeviceConfig, PciDeviceKind,
    RateLimiterConfig,
};

fn rung(r: Rung) -> &'static str {
    match r {
        Rung::L0 => "L0",
        Rung::L1 => "L1",
        Rung::L2 => "L2",
        Rung::L3 => "L3",
        Rung::L4 { guest_polls: false } => "L4",
        Rung::L4 { guest_polls: true } => "L4p",
    }
}

/// The option string the CLI documents for `d`.
/// `,bw=..,bw_burst=..,ops=..,ops_burst=..` for what is set: the flags give one-second
/// buckets, so a bucket's size is its rate.
fn unparse_limits(limits: Option<RateLimiterConfig>) -> String {
    let limits = limits.unwrap_or_default();
    let mut out = String::new();
    for (key, b) in [("bw", limits.bandwidth), ("ops", limits.ops)] {
        if let Some(b) = b {
            out += &format!(",{key}={}", b.size);
            if let Some(burst) = b.one_time_burst {
                out += &format!(",{key}_burst={burst}");
            }
        }
    }
    out
}

fn unparse(d: &PciDeviceConfig) -> String {
    let mut common = format!(
        "rung={},coalesce={}:{},poll_us={}",
        rung(d.rung),
        d.coalescing.max_completions,
        d.coalescing.max_delay_us,
        d.poll_idle_us
    );
    common += &unparse_limits(d.rate_limiter);
    match &d.kind {
        PciDeviceKind::Block(b) => format!(
            "path={},ro={},bs={},id={},{common}",
            b.path.display(),
            if b.read_only { "on" } else { "off" },
            b.logical_block_size,
            b.id
        ),
        PciDeviceKind::Net(n) => {
            let backend = match &n.backend {
                NetBackend::Tap(i) => format!("tap:{i}"),
                NetBackend::Echo => "echo".into(),
                NetBackend::Sink { rate_mbit: None } => "sink".into(),
                NetBackend::Sink { rate_mbit: Some(r) } => format!("sink,rate={r}"),
            };
            let m = n.mac;
            format!(
                "backend={backend},mac={:02x}:{:02x}:{:02x}:{:02x}:{:02x}:{:02x},{common}",
                m[0], m[1], m[2], m[3], m[4], m[5]
            )
        }
        PciDeviceKind::VhostUser(v) => {
            let mut o = format!(
                "vhost_user=on,socket={},num_queues={},queue_size={},rung={}",
                v.socket.display(),
                v.num_queues,
                v.queue_size,
                rung(d.rung)
            );
            if let VhostUserKind::Net { mac: m } = v.kind {
                o += &format!(
                    ",mac={:02x}:{:02x}:{:02x}:{:02x}:{:02x}:{:02x}",
                    m[0], m[1], m[2], m[3], m[4], m[5]
                );
            }
            o
        }
        PciDeviceKind::Vsock(v) => {
            let id = d
                .name
                .as_ref()
                .map(|n| format!(",id={n}"))
                .unwrap_or_default();
            format!("cid={},socket={}{id}", v.cid, v.socket.display())
        }
    }
}

/// The `--iommu` string the CLI documents for `c`.
fn unparse_iommu(c: &VtdConfig) -> String {
    let mode = match c.mode {
        EmulationMode::Samecore => "samecore",
        EmulationMode::Sidecore => "sidecore",
    };
    let pin = match c.pin {
        PinPolicy::All => "all",
        PinPolicy::Map => "map",
        PinPolicy::Deferred => "deferred",
    };
    format!("vtd,mode={mode},pin={pin}")
}

fuzz_target!(|s: &str| {
    let _ = (
        lucid_vmm::parse_serial(s),
        lucid_vmm::parse_backing(s),
        lucid_vmm::parse_pool(s),
        lucid_vmm::parse_balloon(s),
    );
    let _ = lucid_vmm::lucid_pools::def::PoolDef::parse(s);
    if let Ok(j) = lucid_vmm::parse_jail(s) {
        let chroot = j
            .chroot
            .as_ref()
            .map(|d| format!(",chroot={}", d.display()))
            .unwrap_or_default();
        let again = lucid_vmm::parse_jail(&format!("uid={},gid={}{chroot}", j.uid, j.gid))
            .expect("a written-back --jail parses");
        assert_eq!(again, j);
    }
    if let Ok(c) = lucid_vmm::parse_rng(s) {
        let rate = c.rate.map(|r| format!("rate={r}")).unwrap_or_default();
        let back = rate + &unparse_limits(c.rate_limiter);
        let again = lucid_vmm::parse_rng(&back).expect("a written-back --rng parses");
        assert_eq!(again, c);
    }
    if let Ok(d) = lucid_vmm::parse_vsock(s) {
        let again = lucid_vmm::parse_vsock(&unparse(&d)).expect("a written-back --vsock parses");
        assert_eq!(again, d);
    }
    if let Ok(c) = parse_iommu(s) {
        let again = parse_iommu(&unparse_iommu(&c)).expect("a written-back --iommu parses");
        assert_eq!((again.mode, again.pin), (c.mode, c.pin));
    }
    if let Ok(d) = parse_blk(s) {
        let again = parse_blk(&unparse(&d)).expect("a written-back --blk parses");
        assert_eq!(again, d);
    }
    if let Ok(d) = parse_net(s, 0) {
        let again = parse_net(&unparse(&d), 0).expect("a written-back --net parses");
        assert_eq!(again, d);
        for (_, mac) in s
            .split(',')
            .filter_map(|p| p.split_once('='))
            .filter(|(k, _)| *k == "mac")
        {
            assert!(
                mac.bytes()
                    .all(|b| b.is_ascii_hexdigit() || b == b':' || b == b'-'),
                "accepted MAC {mac:?}"
            );
        }
    }
    if let Ok(d) = parse_device(s) {
        assert_eq!(
            parse_device(d.name()),
            Ok(d),
            "a written-back --device parses"
        );
        // Empty pieces are skipped, as in --blk and --net: the name is the first other one.
        let name = s.split(',').find(|p| !p.is_empty());
        assert_eq!(name, Some(d.name()), "accepted --device {s:?}");
    }
});
