//! virtio-net driven by a test acting as the guest: echo, sink and a tap in a network namespace
//! the test creates.

mod common;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use common::*;
use lucid_guests::skip_or_fail;
use lucid_virtio::features::*;
use lucid_virtio::net::{Net, NetBackend, NetConfig, NetError, NET_HDR_LEN};
use lucid_virtio::{Coalescing, Notify, VirtioDevice};

const MAC: [u8; 6] = [0x52, 0x54, 0x00, 0x12, 0x34, 0x56];
const RX_BUF: u32 = 2048;

struct NetDrv {
    g: Guest,
    rx: Vq,
    tx: Vq,
    dev: Net,
    poll: bool,
    rx_bufs: HashMap<u16, u64>,
    /// Whether `recv` posts a fresh buffer for each one consumed.
    repost: bool,
}

impl NetDrv {
    fn new(backend: NetBackend, notify: Notify) -> NetDrv {
        let dev = Net::new("net0".into(), NetConfig { backend, mac: MAC }).unwrap();
        Self::with_dev(dev, notify)
    }

    fn with_dev(mut dev: Net, notify: Notify) -> NetDrv {
        let (g, rx, tx) = activate_two_queues(&mut dev, notify);
        NetDrv {
            g,
            rx,
            tx,
            dev,
            poll: matches!(notify, Notify::Poll { .. }),
            rx_bufs: HashMap::new(),
            repost: true,
        }
    }

    fn post_rx(&mut self, n: usize) {
        for _ in 0..n {
            let a = self.g.alloc(u64::from(RX_BUF));
            let h = self.rx.add(&[(a, RX_BUF, true)]);
            self.rx_bufs.insert(h, a);
        }
        if !self.poll {
            self.rx.kick();
        }
    }

    /// Transmits `frame` behind a zero header, header and frame in separate descriptors.
    fn send(&mut self, frame: &[u8]) {
        let h = self.g.alloc(NET_HDR_LEN as u64);
        self.g.write(h, &[0u8; NET_HDR_LEN]);
        let f = self.g.alloc(frame.len() as u64);
        self.g.write(f, frame);
        self.tx.add(&[
            (h, NET_HDR_LEN as u32, false),
            (f, frame.len() as u32, false),
        ]);
        if !self.poll {
            self.tx.kick();
        }
    }

    fn tx_done(&mut self) {
        let (_, len) = self.tx.next_used().expect("tx completed");
        assert_eq!(len, 0);
    }

    /// The next received frame (without the virtio header), and reposts its buffer.
    fn recv_within(&mut self, t: Duration) -> Option<Vec<u8>> {
        let (id, len) = self.rx.next_used_within(t)?;
        let a = self.rx_bufs.remove(&(id as u16)).expect("known rx buffer");
        let data = self.g.read(a, len as usize);
        assert_eq!(&data[..10], &[0u8; 10], "virtio_net_hdr flags/gso");
        assert_eq!(u16::from_le_bytes([data[10], data[11]]), 1, "num_buffers");
        if self.repost {
            self.post_rx(1);
        }
        Some(data[NET_HDR_LEN..].to_vec())
    }

    fn recv(&mut self) -> Vec<u8> {
        self.recv_within(TIMEOUT).expect("a frame arrived")
    }

    fn stat(&self, n: &str) -> u64 {
        self.g.stat(&format!("net0.{n}"))
    }
}

fn frame(i: u64, len: usize) -> Vec<u8> {
    let mut f = pattern(i, len);
    f[0..6].copy_from_slice(&[0x02, 0, 0, 0, 0, 1]);
    f[6..12].copy_from_slice(&MAC);
    f[12..14].copy_from_slice(&0x88b5u16.to_be_bytes()); // local experimental ethertype
    f
}

#[test]
fn echo_returns_every_packet_intact() {
    for notify in [Notify::Kicks, Notify::Poll { idle_sleep_us: 10 }] {
        let mut d = NetDrv::new(NetBackend::Echo, notify);
        d.post_rx(64);
        let mut total = 0u64;
        let mut i = 0u64;
        for burst in 0..20u64 {
            let mut sent = Vec::new();
            for k in 0..16u64 {
                let len = 60 + ((burst * 16 + k) * 97 % 1455) as usize;
                let f = frame(i, len);
                d.send(&f);
                total += len as u64;
                sent.push(f);
                i += 1;
            }
            for _ in 0..16 {
                d.tx_done();
            }
            for f in sent {
                let got = d.recv();
                assert_eq!(checksum(&got), checksum(&f));
                assert_eq!(got, f);
            }
        }
        assert_eq!(d.stat("tx_packets"), 320);
        assert_eq!(d.stat("rx_packets"), 320);
        assert_eq!(d.stat("tx_bytes"), total);
        assert_eq!(d.stat("rx_bytes"), total);
        assert_eq!(d.stat("rx_dropped_no_buffers"), 0);
        assert_eq!(d.stat("errors"), 0);
        if let Notify::Poll { .. } = notify {
            assert_eq!(d.stat("kicks"), 0);
        }
        d.dev.reset();
    }
}

/// A driver that does what the probe guest's rr loop does, with EVENT_IDX: one request in
/// flight, kicks as `avail_event` asks, and between replies either polls the used ring (`guest
/// polls`) or asks for the next interrupt with `used_event`, looks again, and waits for it. It
/// tells a lost interrupt (the reply is in the used ring, no interrupt came) from a lost reply.
fn request_response(
    notify: Notify,
    coalescing: Coalescing,
    guest_polls: bool,
    size: usize,
    n: u64,
) {
    let g = Guest::new();
    let mut dev = Net::new(
        "net0".into(),
        NetConfig {
            backend: NetBackend::Echo,
            mac: MAC,
        },
    )
    .unwrap();
    let (mut rx, (rq, rk)) = Vq::new(&g.mem, 0x10000, 256);
    let (mut tx, (tq, tk)) = Vq::new(&g.mem, 0x14000, 256);
    if guest_polls {
        rx.set_avail_flags(1);
        rx.set_used_event(0xffff);
    }
    let feats = dev.features();
    dev.activate(g.ctx(vec![(0, rq, rk), (1, tq, tk)], feats, notify, coalescing))
        .unwrap();
    let rx_buf = |id: u32| 0x100000 + u64::from(id) * u64::from(RX_BUF);
    for i in 0..64 {
        rx.add(&[(rx_buf(i), RX_BUF, true)]);
    }
    rx.kick();
    let (mut rx_kicked, mut tx_kicked, mut irqs_seen) = (rx.avail_idx, 0u16, 0u64);
    let tx_buf = 0x400000;
    g.write(tx_buf, &[0u8; NET_HDR_LEN]);
    for i in 0..n {
        let f = frame(i, size);
        g.write(tx_buf + NET_HDR_LEN as u64, &f);
        tx.add(&[(tx_buf, (NET_HDR_LEN + size) as u32, false)]);
        if tx.would_kick(tx_kicked) {
            tx.kick();
        }
        tx_kicked = tx.avail_idx;
        let start = Instant::now();
        let (id, len) = loop {
            while tx.pop_used().is_some() {}
            if let Some(u) = rx.pop_used() {
                break u;
            }
            if !guest_polls {
                rx.set_used_event(rx.used_seen);
                if rx.used_idx() != rx.used_seen {
                    continue;
                }
                while g.irq.q(0) == irqs_seen && start.elapsed() < TIMEOUT {
                    std::hint::spin_loop();
                }
                irqs_seen = g.irq.q(0);
            }
            assert!(
                start.elapsed() < TIMEOUT,
                "round trip {i}: {} (tx {} rx {} interrupts {} coalesced {} suppressed {})",
                if rx.used_idx() != rx.used_seen {
                    "the reply came without its interrupt"
                } else {
                    "no reply"
                },
                d_stat(&g, "tx_packets"),
                d_stat(&g, "rx_packets"),
                d_stat(&g, "irqs"),
                d_stat(&g, "irqs_coalesced"),
                d_stat(&g, "irqs_suppressed"),
            );
        };
        assert_eq!(len as usize, NET_HDR_LEN + size, "round trip {i}");
        assert_eq!(
            g.read(rx_buf(id) + NET_HDR_LEN as u64, size),
            f,
            "round trip {i}"
        );
        if guest_polls {
            rx.set_used_event(rx.used_seen.wrapping_sub(1));
        }
        rx.publish(id as u16);
        if rx.would_kick(rx_kicked) {
            rx.kick();
        }
        rx_kicked = rx.avail_idx;
    }
    assert_eq!(d_stat(&g, "rx_packets"), n);
    assert_eq!(d_stat(&g, "errors"), 0);
    dev.reset();
}

fn d_stat(g: &Guest, n: &str) -> u64 {
    g.stat(&format!("net0.{n}"))
}

/// For `valgrind --tool=callgrind` (docs/exit-ladder.md): kick mode only, no spinning
/// device thread, `LUCID_RR_SIZE` bytes (default 1500) and `LUCID_RR_STRESS` round trips
/// (default 2000); read the inclusive count of `NetWorker::process_queue`.
#[test]
#[ignore]
fn echo_request_response_for_callgrind() {
    let env = |k: &str, d: u64| {
        std::env::var(k)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(d)
    };
    let size = env("LUCID_RR_SIZE", 1500) as usize;
    request_response(
        Notify::Kicks,
        Coalescing::default(),
        false,
        size,
        env("LUCID_RR_STRESS", 2000),
    );
}

/// Request-response with EVENT_IDX in every notification mode: the device loses no reply and no
/// interrupt (the end-to-end version on real KVM is in crates/lucid/tests/io.rs).
/// `LUCID_RR_STRESS` round trips per case (default 5000).
#[test]
fn echo_request_response_loses_nothing() {
    let n = std::env::var("LUCID_RR_STRESS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(5000);
    let coalesce = Coalescing {
        max_completions: 8,
        max_delay_us: 50,
    };
    let poll = Notify::Poll { idle_sleep_us: 0 };
    for size in [64, 1500] {
        request_response(Notify::Kicks, Coalescing::default(), false, size, n);
        request_response(Notify::Kicks, coalesce, false, size, n);
        request_response(poll, Coalescing::default(), false, size, n);
        request_response(poll, Coalescing::default(), true, size, n);
    }
}

#[test]
fn echo_waits_for_rx_buffers() {
    let mut d = NetDrv::new(NetBackend::Echo, Notify::Kicks);
    let frames: Vec<_> = (0..5).map(|i| frame(i, 100 + i as usize)).collect();
    for f in &frames {
        d.send(f);
    }
    for _ in 0..5 {
        d.tx_done();
    }
    assert!(d.rx.next_used_within(Duration::from_millis(50)).is_none());
    // Adding buffers (and kicking rx) lets the backlog through, in order.
    d.post_rx(8);
    for f in &frames {
        assert_eq!(&d.recv(), f);
    }
    d.dev.reset();
}

#[test]
fn sink_counts_and_drops() {
    let mut d = NetDrv::new(NetBackend::Sink { rate_mbit: None }, Notify::Kicks);
    d.post_rx(8);
    let mut total = 0;
    for i in 0..50u64 {
        let f = frame(i, 64 + i as usize * 20);
        total += f.len() as u64;
        d.send(&f);
        d.tx_done();
    }
    assert_eq!(d.stat("tx_packets"), 50);
    assert_eq!(d.stat("tx_bytes"), total);
    assert_eq!(d.stat("bytes_read"), total);
    assert_eq!(d.stat("rx_packets"), 0);
    assert!(d.rx.next_used_within(Duration::from_millis(20)).is_none());
    d.dev.reset();
}

#[test]
fn malformed_chains_are_counted_not_fatal() {
    let mut d = NetDrv::new(NetBackend::Echo, Notify::Kicks);
    d.repost = false;
    // A tx chain with a device-writable descriptor.
    let a = d.g.alloc(256);
    d.tx.add(&[(a, 12, false), (a + 16, 100, true)]);
    d.tx.kick();
    d.tx_done();
    // A tx chain shorter than the header.
    d.tx.add(&[(a, 8, false)]);
    d.tx.kick();
    d.tx_done();
    // A tx chain pointing outside guest memory.
    d.tx.add(&[(a, 12, false), (RAM + 0x1000, 100, false)]);
    d.tx.kick();
    d.tx_done();
    assert_eq!(d.stat("errors"), 3);
    assert_eq!(d.stat("tx_dropped"), 3);
    assert_eq!(d.stat("tx_packets"), 0);
    // An rx buffer too small for the frame: the frame is dropped, the buffer kept.
    let small = d.g.alloc(64);
    let h = d.rx.add(&[(small, 64, true)]);
    d.rx_bufs.insert(h, small);
    d.rx.kick();
    d.send(&frame(1, 500));
    d.tx_done();
    assert!(wait_for(|| d.stat("rx_dropped_too_big") == 1));
    d.send(&frame(2, 40));
    d.tx_done();
    assert_eq!(d.recv(), frame(2, 40));
    // A read-only rx buffer is given back unused, and the frame waits for a good one.
    let ro = d.g.alloc(2048);
    d.rx.add(&[(ro, 2048, false)]);
    d.rx.kick();
    d.send(&frame(3, 300));
    d.tx_done();
    let (_, len) = d.rx.next_used().unwrap();
    assert_eq!(len, 0);
    d.post_rx(1);
    assert_eq!(d.recv(), frame(3, 300));
    assert!(!d.dev.needs_reset());
    d.dev.reset();
}

#[test]
fn config_features_and_bad_configs() {
    let d = NetDrv::new(NetBackend::Sink { rate_mbit: None }, Notify::Kicks);
    let mut mac = [0u8; 6];
    d.dev.read_config(0, &mut mac);
    assert_eq!(mac, MAC);
    let f = d.dev.features();
    for bit in [
        VIRTIO_F_VERSION_1,
        VIRTIO_F_ACCESS_PLATFORM,
        VIRTIO_RING_F_EVENT_IDX,
        lucid_virtio::net::feature::VIRTIO_NET_F_MAC,
    ] {
        assert_ne!(f & bit, 0);
    }
    assert_eq!(d.dev.queue_max_sizes().len(), 2);
    let e = |backend, mac| {
        Net::new("n".into(), NetConfig { backend, mac })
            .err()
            .unwrap()
    };
    assert!(matches!(
        e(NetBackend::Sink { rate_mbit: None }, [1, 0, 0, 0, 0, 0]),
        NetError::BadMac(_)
    ));
    let m = e(NetBackend::Tap("a-name-longer-than-15".into()), MAC).to_string();
    assert!(m.contains("longer than 15"), "{m}");
    // An existing interface that is not a tap.
    let m = e(NetBackend::Tap("lo".into()), MAC).to_string();
    eprintln!("{m}");
    assert!(m.starts_with("cannot create tap lo:"), "{m}");
}

// ---- tap in a network namespace ----

struct Netns(String);

impl Netns {
    fn new() -> Netns {
        let name = format!("lucid-test-{}", std::process::id());
        let _ = run("ip", &["netns", "del", &name]);
        run("ip", &["netns", "add", &name]).expect("ip netns add");
        Netns(name)
    }
    fn exec(&self, args: &[&str]) {
        let mut a = vec!["netns", "exec", &self.0];
        a.extend_from_slice(args);
        run("ip", &a).unwrap_or_else(|e| panic!("ip {a:?}: {e}"));
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = run("ip", &["netns", "del", &self.0]);
    }
}

fn run(cmd: &str, args: &[&str]) -> Result<String, String> {
    let out = std::process::Command::new(cmd)
        .args(args)
        .output()
        .map_err(|e| e.to_string())?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

/// Creates the tap from a thread that has entered the namespace (setns affects only the
/// calling thread; the tap belongs to the namespace of the thread that opened /dev/net/tun).
fn tap_in(ns: &Netns, ifname: &str) -> Net {
    let path = format!("/var/run/netns/{}", ns.0);
    let ifname = ifname.to_string();
    std::thread::spawn(move || {
        let f = std::fs::File::open(&path).unwrap();
        use std::os::fd::AsRawFd;
        // SAFETY: setns on a namespace fd we opened; affects only this short-lived thread.
        let r = unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) };
        assert_eq!(r, 0, "setns: {}", std::io::Error::last_os_error());
        Net::new(
            "net0".into(),
            NetConfig {
                backend: NetBackend::Tap(ifname),
                mac: MAC,
            },
        )
        .unwrap()
    })
    .join()
    .unwrap()
}

fn ip_csum(data: &[u8]) -> u16 {
    let mut s = 0u32;
    for c in data.chunks(2) {
        s += u32::from(u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)]));
    }
    while s > 0xffff {
        s = (s & 0xffff) + (s >> 16);
    }
    !(s as u16)
}

const GUEST_IP: [u8; 4] = [10, 200, 0, 2];
const HOST_IP: [u8; 4] = [10, 200, 0, 1];

fn arp_request() -> Vec<u8> {
    let mut f = vec![0xff; 6];
    f.extend_from_slice(&MAC);
    f.extend_from_slice(&[0x08, 0x06, 0, 1, 0x08, 0, 6, 4, 0, 1]);
    f.extend_from_slice(&MAC);
    f.extend_from_slice(&GUEST_IP);
    f.extend_from_slice(&[0; 6]);
    f.extend_from_slice(&HOST_IP);
    f.resize(60, 0);
    f
}

fn icmp_echo(dst_mac: &[u8], payload: &[u8]) -> Vec<u8> {
    let mut icmp = vec![8, 0, 0, 0, 0x12, 0x34, 0, 1];
    icmp.extend_from_slice(payload);
    let c = ip_csum(&icmp);
    icmp[2..4].copy_from_slice(&c.to_be_bytes());
    let mut ip = vec![0x45, 0];
    ip.extend_from_slice(&((20 + icmp.len()) as u16).to_be_bytes());
    ip.extend_from_slice(&[0, 1, 0x40, 0, 64, 1, 0, 0]);
    ip.extend_from_slice(&GUEST_IP);
    ip.extend_from_slice(&HOST_IP);
    let c = ip_csum(&ip);
    ip[10..12].copy_from_slice(&c.to_be_bytes());
    let mut f = dst_mac.to_vec();
    f.extend_from_slice(&MAC);
    f.extend_from_slice(&[0x08, 0x00]);
    f.extend_from_slice(&ip);
    f.extend_from_slice(&icmp);
    f
}

/// Receives frames until `pick` accepts one (the host also sends IPv6 noise).
fn recv_matching<T>(d: &mut NetDrv, mut pick: impl FnMut(&[u8]) -> Option<T>) -> T {
    let end = Instant::now() + TIMEOUT;
    loop {
        let left = end.saturating_duration_since(Instant::now());
        let f = d.recv_within(left).expect("expected frame did not arrive");
        if let Some(t) = pick(&f) {
            return t;
        }
    }
}

#[test]
fn tap_exchanges_frames_with_a_host_peer_in_a_namespace() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return skip_or_fail("the tap test needs root (it creates a network namespace and a tap)");
    }
    if run("ip", &["-V"]).is_err() {
        return skip_or_fail("no `ip` command (iproute2)");
    }
    for notify in [Notify::Kicks, Notify::Poll { idle_sleep_us: 20 }] {
        let ns = Netns::new();
        let dev = tap_in(&ns, "lucidtap0");
        ns.exec(&["ip", "addr", "add", "10.200.0.1/24", "dev", "lucidtap0"]);
        ns.exec(&["ip", "link", "set", "lucidtap0", "up"]);
        // The tap exists in the namespace, not in ours.
        assert!(run("ip", &["link", "show", "lucidtap0"]).is_err());
        let mut d = NetDrv::with_dev(dev, notify);
        d.post_rx(32);

        // ARP: who has 10.200.0.1? The host stack answers with the tap's MAC.
        d.send(&arp_request());
        d.tx_done();
        let host_mac = recv_matching(&mut d, |f| {
            (f.len() >= 42
                && f[12..14] == [0x08, 0x06]
                && f[20..22] == [0, 2]
                && f[28..32] == HOST_IP
                && f[32..38] == MAC
                && f[38..42] == GUEST_IP)
                .then(|| f[22..28].to_vec())
        });

        // ICMP echo: the host answers with the same payload.
        let payload = pattern(77, 1000);
        d.send(&icmp_echo(&host_mac, &payload));
        d.tx_done();
        let reply = recv_matching(&mut d, |f| {
            (f.len() > 42 && f[12..14] == [0x08, 0x00] && f[23] == 1 && f[34] == 0)
                .then(|| f.to_vec())
        });
        assert_eq!(&reply[0..6], &MAC);
        assert_eq!(&reply[26..30], &HOST_IP);
        assert_eq!(&reply[30..34], &GUEST_IP);
        assert_eq!(ip_csum(&reply[14..34]), 0, "IP checksum");
        assert_eq!(ip_csum(&reply[34..]), 0, "ICMP checksum");
        assert_eq!(&reply[38..42], &[0x12, 0x34, 0, 1]);
        assert_eq!(&reply[42..], &payload[..]);

        // The host counted our frames on its side of the tap.
        let rx_host: u64 = run(
            "ip",
            &[
                "netns",
                "exec",
                &ns.0,
                "cat",
                "/sys/class/net/lucidtap0/statistics/rx_packets",
            ],
        )
        .unwrap()
        .trim()
        .parse()
        .unwrap();
        assert!(rx_host >= 2, "host saw {rx_host} frames");
        assert_eq!(d.stat("tx_packets"), 2);
        assert!(d.stat("rx_packets") >= 2);
        assert_eq!(d.stat("errors"), 0);
        d.dev.reset();
        drop(d);
    }
}

#[test]
fn tap_stops_reading_without_rx_buffers() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return skip_or_fail("the tap test needs root (it creates a network namespace and a tap)");
    }
    let ns = Netns(format!("lucid-test-{}-b", std::process::id()));
    let _ = run("ip", &["netns", "del", &ns.0]);
    run("ip", &["netns", "add", &ns.0]).expect("ip netns add");
    let dev = tap_in(&ns, "lucidtap1");
    ns.exec(&["ip", "addr", "add", "10.200.0.1/24", "dev", "lucidtap1"]);
    ns.exec(&["ip", "link", "set", "lucidtap1", "up"]);
    let mut d = NetDrv::with_dev(dev, Notify::Kicks);
    // No rx buffers: the ARP reply waits in the tap.
    d.send(&arp_request());
    d.tx_done();
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(d.stat("rx_packets"), 0);
    d.post_rx(16);
    recv_matching(&mut d, |f| {
        (f.len() >= 42 && f[12..14] == [0x08, 0x06] && f[20..22] == [0, 2]).then_some(())
    });
    d.dev.reset();
}

/// Sends `frames` out of interface `ifname` of namespace `ns` by a packet socket: the tap's
/// reader (the device) receives them.
fn inject(ns: &Netns, ifname: &str, frames: Vec<Vec<u8>>) {
    let path = format!("/var/run/netns/{}", ns.0);
    let ifname = std::ffi::CString::new(ifname).unwrap();
    std::thread::spawn(move || {
        use std::os::fd::AsRawFd;
        let f = std::fs::File::open(&path).unwrap();
        // SAFETY: setns on a namespace fd we opened; affects only this short-lived thread.
        assert_eq!(unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) }, 0);
        // SAFETY: plain socket creation; protocol 0 makes it send-only.
        let fd = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW, 0) };
        assert!(
            fd >= 0,
            "packet socket: {}",
            std::io::Error::last_os_error()
        );
        // SAFETY: a NUL-terminated name.
        let ifindex = unsafe { libc::if_nametoindex(ifname.as_ptr()) };
        assert!(ifindex > 0);
        // SAFETY: sockaddr_ll is plain data; all zeros is a valid value.
        let mut addr: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        addr.sll_family = libc::AF_PACKET as u16;
        addr.sll_ifindex = ifindex as i32;
        addr.sll_halen = 6;
        for frame in &frames {
            // SAFETY: sends `frame` (valid for its length) to the address `addr` describes.
            let n = unsafe {
                libc::sendto(
                    fd,
                    frame.as_ptr().cast(),
                    frame.len(),
                    0,
                    (&addr as *const libc::sockaddr_ll).cast(),
                    std::mem::size_of::<libc::sockaddr_ll>() as u32,
                )
            };
            assert_eq!(
                n,
                frame.len() as isize,
                "{}",
                std::io::Error::last_os_error()
            );
        }
        // SAFETY: closes the socket this thread opened.
        unsafe { libc::close(fd) };
    })
    .join()
    .unwrap();
}

/// Rx behind a rate limiter out of tokens stops reading the tap (the frame it read waits
/// beside it, the others in the kernel's queue); lifting the limit delivers them all, in order.
#[test]
fn tap_rx_waits_for_its_rate_limiter() {
    use lucid_virtio::rate::{RateControl, RateLimiterConfig, TokenBucketConfig};
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return skip_or_fail("the tap test needs root (it creates a network namespace and a tap)");
    }
    let ns = Netns(format!("lucid-test-{}-c", std::process::id()));
    let _ = run("ip", &["netns", "del", &ns.0]);
    run("ip", &["netns", "add", &ns.0]).expect("ip netns add");
    let mut dev = tap_in(&ns, "lucidtap2");
    // One frame an hour each way.
    let limits = RateControl::new(RateLimiterConfig {
        bandwidth: None,
        ops: Some(TokenBucketConfig {
            size: 1,
            one_time_burst: None,
            refill_time: 3_600_000,
        }),
    })
    .unwrap();
    dev.set_rate_control(limits.clone());
    ns.exec(&["ip", "link", "set", "lucidtap2", "up"]);
    let mut d = NetDrv::with_dev(dev, Notify::Kicks);
    d.post_rx(32);
    let ours: Vec<Vec<u8>> = (0..4)
        .map(|i| {
            let mut f = frame(500 + i, 300);
            f[0..6].copy_from_slice(&MAC);
            f
        })
        .collect();
    inject(&ns, "lucidtap2", ours.clone());
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        d.stat("rx_packets") <= 1,
        "{} frames past the limit",
        d.stat("rx_packets")
    );
    assert!(d.stat("rate_limited.throttled_events") >= 1);
    limits.set(RateLimiterConfig::default()).unwrap();
    let mut got = Vec::new();
    while got.len() < ours.len() {
        let f = d.recv();
        if f.len() == 300 && f[12..14] == [0x88, 0xb5] {
            got.push(f);
        }
    }
    assert_eq!(got, ours);
    assert_eq!(d.stat("rx_dropped_no_buffers"), 0);
    d.dev.reset();
}

/// Child half of `tap_without_privilege_says_what_is_needed`.
#[test]
#[ignore = "run by tap_without_privilege_says_what_is_needed as an unprivileged user"]
fn tap_unprivileged_child() {
    if std::env::var_os("LUCID_TAP_CHILD").is_none() {
        return;
    }
    let e = Net::new(
        "net0".into(),
        NetConfig {
            backend: NetBackend::Tap("lucidtapnp".into()),
            mac: MAC,
        },
    )
    .err()
    .expect("an unprivileged user created a tap");
    println!("ERROR: {e}");
}

#[test]
fn tap_without_privilege_says_what_is_needed() {
    use std::os::unix::process::CommandExt;
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return skip_or_fail("needs root to run a child as an unprivileged user");
    }
    // A copy of this test binary where the unprivileged user can run it (the build tree may sit
    // in a directory only root can enter).
    let exe = std::env::temp_dir().join(format!("lucid-tap-child-{}", std::process::id()));
    std::fs::copy(std::env::current_exe().unwrap(), &exe).unwrap();
    std::fs::set_permissions(&exe, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    // Another test thread forking while the copy was open for writing makes exec fail with
    // ETXTBSY for a moment: retry.
    let run = || {
        std::process::Command::new(&exe)
            .args([
                "--exact",
                "tap_unprivileged_child",
                "--ignored",
                "--nocapture",
            ])
            .env("LUCID_TAP_CHILD", "1")
            .uid(65534)
            .gid(65534)
            .output()
    };
    let mut out = run();
    for _ in 0..50 {
        match &out {
            Err(e) if e.raw_os_error() == Some(libc::ETXTBSY) => {
                std::thread::sleep(std::time::Duration::from_millis(20));
                out = run();
            }
            _ => break,
        }
    }
    let out = out.unwrap();
    let _ = std::fs::remove_file(&exe);
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() && !text.contains("ERROR") {
        return skip_or_fail(&format!(
            "cannot run the test binary as nobody: {}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    assert!(
        text.contains("needs root or CAP_NET_ADMIN"),
        "unexpected: {text} {}",
        String::from_utf8_lossy(&out.stderr)
    );
}
