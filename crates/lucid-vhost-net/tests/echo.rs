//! The echo server driven by rust-vmm's own vhost-user front-end (`vhost::vhost_user::Frontend`),
//! not Lucid's: guest memory is a memfd this test maps, the split rings are laid out in it by
//! hand, and the server runs confined in a child process (this test binary, re-run as the
//! server), stopped with SIGTERM. Its own harness (`harness = false`): the server must run on
//! the process's first thread, as in `lucid device-server`, so that SIGTERM, which it blocks
//! there before any other thread starts, reaches it and not a test runner's thread.

use std::fs::File;
use std::os::fd::FromRawFd;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{fence, Ordering};
use std::time::{Duration, Instant};

use lucid_vhost_net::server::{DeviceServerCmd, Mode, NetArgs};
use vhost::vhost_user::message::{
    VhostUserConfigFlags, VhostUserHeaderFlag, VhostUserProtocolFeatures,
};
use vhost::vhost_user::{Frontend, VhostUserFrontend};
use vhost::{VhostBackend, VhostUserMemoryRegionInfo, VringConfigData};
use vm_memory::{
    Bytes, FileOffset, GuestAddress, GuestMemoryBackend, GuestMemoryMmap, GuestRegionMmap,
    MmapRegion,
};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

const CHILD_ENV: &str = "LUCID_VHNET_TEST_SERVER";
const MEM_SIZE: usize = 1 << 20;
const QSIZE: u16 = 16;
const HDR: usize = 12;
const MAC: [u8; 6] = [0x52, 0x54, 0x00, 0x76, 0x68, 0x01];
const PEER: [u8; 6] = [0x02, 0x00, 0x00, 0x00, 0x00, 0x42];

const F_VERSION_1: u64 = 1 << 32;
const F_MAC: u64 = 1 << 5;
const F_EVENT_IDX: u64 = 1 << 29;
const F_PROTOCOL_FEATURES: u64 = 1 << 30;
const DESC_F_NEXT: u16 = 1;
const DESC_F_WRITE: u16 = 2;

type Test = (&'static str, fn());

const TESTS: &[Test] = &[
    (
        "frames_come_back_with_swapped_macs_and_an_interrupt",
        frames_come_back_with_swapped_macs_and_an_interrupt,
    ),
    (
        "frames_wait_for_receive_buffers",
        frames_wait_for_receive_buffers,
    ),
    (
        "a_stocked_receive_ring_does_not_hold_the_server",
        a_stocked_receive_ring_does_not_hold_the_server,
    ),
    (
        "a_hostile_front_end_costs_its_buffers_not_the_server",
        a_hostile_front_end_costs_its_buffers_not_the_server,
    ),
    (
        "a_refused_request_without_reconnect_ends_the_server_with_failure",
        a_refused_request_without_reconnect_ends_the_server_with_failure,
    ),
    ("the_server_is_confined", the_server_is_confined),
];

/// The server when re-run as one ([`spawn_server`]); otherwise the tests whose names contain
/// the first argument that is not a flag (all without one), one after the other.
fn main() -> std::process::ExitCode {
    if let Ok(socket) = std::env::var(CHILD_ENV) {
        return child_server(socket);
    }
    // libtest's flags are accepted and ignored (the tests run one at a time), with the value
    // of those that take one.
    let mut args = std::env::args().skip(1);
    let mut filter = None;
    while let Some(a) = args.next() {
        match a.as_str() {
            "--test-threads" | "--skip" | "--format" | "--color" | "-Z" | "--logfile" => {
                args.next();
            }
            a if a.starts_with('-') => {}
            _ => filter = filter.or(Some(a)),
        }
    }
    let (mut passed, mut failed) = (0, 0);
    for (name, f) in TESTS {
        if filter.as_ref().is_some_and(|p| !name.contains(p.as_str())) {
            continue;
        }
        let ok = std::panic::catch_unwind(f).is_ok();
        println!("test {name} ... {}", if ok { "ok" } else { "FAILED" });
        if ok {
            passed += 1;
        } else {
            failed += 1;
        }
    }
    println!("{passed} passed, {failed} failed");
    match failed {
        0 => std::process::ExitCode::SUCCESS,
        _ => std::process::ExitCode::FAILURE,
    }
}

fn child_server(socket: String) -> std::process::ExitCode {
    let cmd = DeviceServerCmd::Net(NetArgs {
        socket: socket.into(),
        mode: Mode::Echo,
        mac: "52:54:00:76:68:01".into(),
        reconnect: std::env::var("LUCID_VHNET_TEST_RECONNECT").is_ok(),
        no_seccomp: false,
    });
    match lucid_vhost_net::run(cmd) {
        Ok(summary) => {
            println!("{summary}");
            summary.exit_code()
        }
        Err(e) => {
            println!("server failed: {e}");
            std::process::ExitCode::from(3)
        }
    }
}

fn socket_path(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("lucid-vhnet-{}-{name}.sock", std::process::id()))
}

/// The server in a child process, once its socket accepts connections.
fn spawn_server(socket: &Path, reconnect: bool) -> Child {
    let _ = std::fs::remove_file(socket);
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.env(CHILD_ENV, socket)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if reconnect {
        cmd.env("LUCID_VHNET_TEST_RECONNECT", "1");
    }
    let child = cmd.spawn().unwrap();
    let t0 = Instant::now();
    while !socket.exists() {
        assert!(t0.elapsed() < Duration::from_secs(10), "no socket");
        std::thread::sleep(Duration::from_millis(10));
    }
    child
}

/// Stops the server with SIGTERM and returns its exit status and output.
fn stop_server(child: Child) -> (Option<i32>, String) {
    // SAFETY: kill with the pid of our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    finish(child)
}

fn finish(child: Child) -> (Option<i32>, String) {
    let out = child.wait_with_output().unwrap();
    let text = format!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code(), text)
}

/// `name=value` from the server's summary line.
fn counter(out: &str, name: &str) -> u64 {
    let line = out
        .lines()
        .find_map(|l| l.strip_prefix("lucid device-server net:"))
        .unwrap_or_else(|| panic!("no summary in {out}"));
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(&format!("{name}=")))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {name} in {line}"))
}

/// Guest RAM: a memfd, mapped here, at guest-physical 0.
fn guest_memory() -> GuestMemoryMmap {
    // SAFETY: a C string literal and flags; the returned fd is checked and then owned by File.
    let fd = unsafe { libc::memfd_create(c"lucid-vhnet-test".as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0);
    // SAFETY: fd was just created and nothing else owns it.
    let file = unsafe { File::from_raw_fd(fd) };
    file.set_len(MEM_SIZE as u64).unwrap();
    let region = MmapRegion::from_file(FileOffset::new(file, 0), MEM_SIZE).unwrap();
    GuestMemoryMmap::from_regions(vec![GuestRegionMmap::new(region, GuestAddress(0)).unwrap()])
        .unwrap()
}

/// A split virtqueue laid out by hand in guest memory, as a driver would.
struct Ring {
    desc: u64,
    avail: u64,
    used: u64,
    avail_idx: u16,
    last_used: u16,
    call: EventFd,
    kick: EventFd,
}

impl Ring {
    fn new(base: u64) -> Ring {
        Ring {
            desc: base,
            avail: base + 0x1000,
            used: base + 0x2000,
            avail_idx: 0,
            last_used: 0,
            call: EventFd::new(EFD_NONBLOCK).unwrap(),
            kick: EventFd::new(EFD_NONBLOCK).unwrap(),
        }
    }

    fn set_desc(&self, m: &GuestMemoryMmap, i: u16, addr: u64, len: u32, flags: u16, next: u16) {
        let d = self.desc + 16 * u64::from(i);
        m.write_obj(addr, GuestAddress(d)).unwrap();
        m.write_obj(len, GuestAddress(d + 8)).unwrap();
        m.write_obj(flags, GuestAddress(d + 12)).unwrap();
        m.write_obj(next, GuestAddress(d + 14)).unwrap();
    }

    /// Makes chain `head` available and kicks.
    fn push(&mut self, m: &GuestMemoryMmap, head: u16) {
        let slot = self.avail + 4 + 2 * u64::from(self.avail_idx % QSIZE);
        m.write_obj(head, GuestAddress(slot)).unwrap();
        self.avail_idx = self.avail_idx.wrapping_add(1);
        self.publish(m, self.avail_idx);
    }

    fn publish(&self, m: &GuestMemoryMmap, idx: u16) {
        fence(Ordering::SeqCst);
        m.write_obj(idx, GuestAddress(self.avail + 2)).unwrap();
        fence(Ordering::SeqCst);
        self.kick.write(1).unwrap();
    }

    /// EVENT_IDX: interrupt me when the used index passes `idx`.
    fn set_used_event(&self, m: &GuestMemoryMmap, idx: u16) {
        let at = self.avail + 4 + 2 * u64::from(QSIZE);
        m.write_obj(idx, GuestAddress(at)).unwrap();
    }

    fn used_idx(&self, m: &GuestMemoryMmap) -> u16 {
        fence(Ordering::SeqCst);
        m.read_obj(GuestAddress(self.used + 2)).unwrap()
    }

    /// Waits for the call eventfd, then for a used entry; returns (id, len).
    fn wait_used(&mut self, m: &GuestMemoryMmap) -> (u16, u32) {
        let t0 = Instant::now();
        loop {
            if self.call.read().is_ok() && self.used_idx(m) != self.last_used {
                break;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(5),
                "no interrupt for a used entry (used.idx {} last {})",
                self.used_idx(m),
                self.last_used
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        let e = self.used + 4 + 8 * u64::from(self.last_used % QSIZE);
        let id: u32 = m.read_obj(GuestAddress(e)).unwrap();
        let len: u32 = m.read_obj(GuestAddress(e + 4)).unwrap();
        self.last_used = self.last_used.wrapping_add(1);
        (id as u16, len)
    }

    fn config(&self, va: u64) -> VringConfigData {
        VringConfigData {
            queue_max_size: QSIZE,
            queue_size: QSIZE,
            flags: 0,
            desc_table_addr: va + self.desc,
            used_ring_addr: va + self.used,
            avail_ring_addr: va + self.avail,
            log_addr: None,
        }
    }
}

/// A connected, negotiated front-end with both rings set up and enabled.
struct Driver {
    fe: Frontend,
    mem: GuestMemoryMmap,
    rx: Ring,
    tx: Ring,
    event_idx: bool,
}

const RX_BUF: u64 = 0x10_0000 - 0x8_0000;
const TX_BUF: u64 = 0x10_0000 - 0x4_0000;

/// A front-end that negotiated features and protocol features, every request acknowledged.
fn negotiate(socket: &Path, event_idx: bool) -> Frontend {
    let mut fe = Frontend::connect(socket, 2).unwrap();
    fe.set_owner().unwrap();
    let offered = fe.get_features().unwrap();
    let want = F_VERSION_1 | F_MAC | F_EVENT_IDX | F_PROTOCOL_FEATURES;
    assert_eq!(offered & want, want, "{offered:#x}");
    let acked = match event_idx {
        true => want,
        false => want & !F_EVENT_IDX,
    };
    fe.set_features(acked).unwrap();
    let pf = fe.get_protocol_features().unwrap();
    assert!(pf.contains(VhostUserProtocolFeatures::CONFIG), "{pf:?}");
    assert!(!pf.contains(VhostUserProtocolFeatures::MQ), "{pf:?}");
    fe.set_protocol_features(
        VhostUserProtocolFeatures::CONFIG | VhostUserProtocolFeatures::REPLY_ACK,
    )
    .unwrap();
    // Every request from here on is acknowledged: a refusal is an error here.
    fe.set_hdr_flags(VhostUserHeaderFlag::NEED_REPLY);
    let (_, cfg) = fe
        .get_config(0, 6, VhostUserConfigFlags::WRITABLE, &[0; 6])
        .unwrap();
    assert_eq!(&cfg[..], &MAC);
    fe
}

impl Driver {
    fn connect(socket: &Path, event_idx: bool) -> Driver {
        let mut fe = negotiate(socket, event_idx);
        let mem = guest_memory();
        let region = mem.iter().next().unwrap();
        let info = VhostUserMemoryRegionInfo::from_guest_region(region).unwrap();
        let va = info.userspace_addr;
        fe.set_mem_table(&[info]).unwrap();
        let rx = Ring::new(0x1000);
        let tx = Ring::new(0x4000);
        for (q, r) in [(0, &rx), (1, &tx)] {
            fe.set_vring_num(q, QSIZE).unwrap();
            fe.set_vring_addr(q, &r.config(va)).unwrap();
            fe.set_vring_base(q, 0).unwrap();
            fe.set_vring_call(q, &r.call).unwrap();
            fe.set_vring_kick(q, &r.kick).unwrap();
            fe.set_vring_enable(q, true).unwrap();
        }
        Driver {
            fe,
            mem,
            rx,
            tx,
            event_idx,
        }
    }

    fn post_rx(&mut self, i: u16, len: u32) {
        let addr = RX_BUF + 0x1000 * u64::from(i);
        self.rx.set_desc(&self.mem, i, addr, len, DESC_F_WRITE, 0);
        if self.event_idx {
            self.rx.set_used_event(&self.mem, self.rx.last_used);
        }
        self.rx.push(&self.mem, i);
    }

    fn send(&mut self, i: u16, frame: &[u8]) {
        let addr = TX_BUF + 0x1000 * u64::from(i);
        let mut buf = vec![0u8; HDR];
        buf.extend_from_slice(frame);
        self.mem.write_slice(&buf, GuestAddress(addr)).unwrap();
        self.tx.set_desc(&self.mem, i, addr, buf.len() as u32, 0, 0);
        if self.event_idx {
            self.tx.set_used_event(&self.mem, self.tx.last_used);
        }
        self.tx.push(&self.mem, i);
    }

    /// The received buffer `i` (header and frame) of `len` bytes.
    fn rx_buf(&self, i: u16, len: u32) -> Vec<u8> {
        let mut b = vec![0; len as usize];
        let addr = RX_BUF + 0x1000 * u64::from(i);
        self.mem.read_slice(&mut b, GuestAddress(addr)).unwrap();
        b
    }
}

/// A test frame: to PEER from MAC, sequence number, payload and its checksum.
fn frame(seq: u32, size: usize) -> Vec<u8> {
    let mut f = Vec::with_capacity(size);
    f.extend_from_slice(&PEER);
    f.extend_from_slice(&MAC);
    f.extend_from_slice(&[0x88, 0xb5]);
    f.extend_from_slice(&seq.to_le_bytes());
    let mut x = u64::from(seq) * 0x9e37_79b9_7f4a_7c15 + 1;
    while f.len() < size - 4 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        f.push(x as u8);
    }
    let sum = f[14..]
        .iter()
        .fold(0u32, |s, &b| s.wrapping_mul(31).wrapping_add(u32::from(b)));
    f.extend_from_slice(&sum.to_le_bytes());
    f
}

/// What the reflector must return for `f`.
fn swapped(f: &[u8]) -> Vec<u8> {
    let mut r = f.to_vec();
    r[..6].copy_from_slice(&f[6..12]);
    r[6..12].copy_from_slice(&f[..6]);
    r
}

/// One round trip: a frame on tx, its reflection on rx (rx buffer `rxi`), both interrupts.
fn round_trip(d: &mut Driver, seq: u32, size: usize, rxi: u16) {
    let txi = (seq % u32::from(QSIZE)) as u16;
    let f = frame(seq, size);
    d.send(txi, &f);
    assert_eq!(d.tx.wait_used(&d.mem), (txi, 0), "tx completion of {seq}");
    let (id, len) = d.rx.wait_used(&d.mem);
    assert_eq!((id, len as usize), (rxi, HDR + size), "rx of {seq}");
    let got = d.rx_buf(id, len);
    assert_eq!(
        &got[..HDR],
        &[0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0],
        "header of {seq}"
    );
    assert_eq!(got[HDR..], swapped(&f), "frame {seq}");
}

fn frames_come_back_with_swapped_macs_and_an_interrupt() {
    for event_idx in [true, false] {
        let socket = socket_path(&format!("rr-{event_idx}"));
        let server = spawn_server(&socket, false);
        let mut d = Driver::connect(&socket, event_idx);
        // 40 round trips through 16-entry rings: both wrap; one rx buffer reposted each time.
        let sizes = [64usize, 1514, 60, 9000];
        let mut bytes = 0;
        for seq in 0..40u32 {
            let rxi = (seq % u32::from(QSIZE)) as u16;
            d.post_rx(rxi, 2048.max(HDR as u32 + 9000));
            let size = sizes[seq as usize % sizes.len()];
            round_trip(&mut d, seq, size, rxi);
            bytes += size as u64;
        }
        let (status, out) = stop_server(server);
        assert_eq!(status, Some(0), "{out}");
        assert!(out.contains("stopped=SIGTERM"), "{out}");
        for (c, want) in [
            ("frames_tx", 40),
            ("frames_rx", 40),
            ("bytes_tx", bytes),
            ("bytes_rx", bytes),
            ("drops", 0),
            ("errors", 0),
            ("connections", 1),
        ] {
            assert_eq!(counter(&out, c), want, "{c} event_idx={event_idx}\n{out}");
        }
        drop(d);
    }
}

/// A driver that keeps spare receive buffers posted, as a real one does: after each
/// reflection the ring still has some, and the server serves the next frame (with EVENT_IDX,
/// re-enabling notifications on that ring reports buffers every time).
fn a_stocked_receive_ring_does_not_hold_the_server() {
    for event_idx in [true, false] {
        let socket = socket_path(&format!("stocked-{event_idx}"));
        let server = spawn_server(&socket, false);
        let mut d = Driver::connect(&socket, event_idx);
        const SPARE: u16 = 8;
        for i in 0..SPARE {
            d.post_rx(i, 2048);
        }
        for seq in 0..40u32 {
            let rxi = (seq % u32::from(QSIZE)) as u16;
            round_trip(&mut d, seq, 64, rxi);
            d.post_rx((rxi + SPARE) % QSIZE, 2048);
        }
        let (status, out) = stop_server(server);
        assert_eq!(status, Some(0), "{out}");
        for (c, want) in [
            ("frames_tx", 40),
            ("frames_rx", 40),
            ("drops", 0),
            ("errors", 0),
        ] {
            assert_eq!(counter(&out, c), want, "{c} event_idx={event_idx}\n{out}");
        }
        drop(d);
    }
}

/// Frames sent before the guest posted receive buffers wait for them, in order.
fn frames_wait_for_receive_buffers() {
    let socket = socket_path("backlog");
    let server = spawn_server(&socket, false);
    let mut d = Driver::connect(&socket, true);
    let frames: Vec<Vec<u8>> = (0..5).map(|s| frame(s, 100)).collect();
    for (i, f) in frames.iter().enumerate() {
        d.send(i as u16, f);
        assert_eq!(d.tx.wait_used(&d.mem), (i as u16, 0));
    }
    for (i, f) in frames.iter().enumerate() {
        d.post_rx(i as u16, 2048);
        let (id, len) = d.rx.wait_used(&d.mem);
        assert_eq!(id, i as u16);
        assert_eq!(d.rx_buf(id, len)[HDR..], swapped(f));
    }
    // The front-end goes: without --reconnect the server exits on its own.
    drop(d);
    let (status, out) = finish(server);
    assert_eq!(status, Some(0), "{out}");
    assert!(out.contains("stopped=disconnect"), "{out}");
    assert_eq!(counter(&out, "frames_rx"), 5, "{out}");
}

/// Descriptors outside the memory table, looping chains, a bogus avail index, a runt, a
/// receive buffer too small, and a request with a ring outside the memory table: each costs its
/// buffer or its connection, and the server serves the next frame and the next front-end.
fn a_hostile_front_end_costs_its_buffers_not_the_server() {
    let socket = socket_path("hostile");
    let server = spawn_server(&socket, true);
    let mut d = Driver::connect(&socket, false);
    let m = d.mem.clone();

    // tx: a buffer far outside guest memory is completed, empty.
    d.tx.set_desc(&m, 0, 0x4000_0000, 100, 0, 0);
    d.tx.push(&m, 0);
    assert_eq!(d.tx.wait_used(&m), (0, 0));
    // tx: a buffer that runs off the end of guest memory.
    d.tx.set_desc(&m, 1, MEM_SIZE as u64 - 8, 64, 0, 0);
    d.tx.push(&m, 1);
    assert_eq!(d.tx.wait_used(&m), (1, 0));
    // tx: a chain that loops on itself (read as 16 descriptors: a 1 KiB garbage frame).
    d.mem.write_slice(&[0u8; 64], GuestAddress(TX_BUF)).unwrap();
    d.tx.set_desc(&m, 2, TX_BUF, 64, DESC_F_NEXT, 2);
    d.tx.push(&m, 2);
    assert_eq!(d.tx.wait_used(&m), (2, 0));
    // tx: a head index past the ring (never completed: the used ring refuses it), then a runt
    // (header and 6 bytes), dropped.
    d.tx.push(&m, 100);
    d.send(3, &[1, 2, 3, 4, 5, 6]);
    assert_eq!(d.tx.wait_used(&m), (3, 0));
    // The garbage frame waits for a receive buffer. One outside memory is given back empty
    // (the frame waits on); one too small for it is given back empty and the frame dropped.
    d.rx.set_desc(&m, 0, 0x4000_0000, 2048, DESC_F_WRITE, 0);
    d.rx.push(&m, 0);
    assert_eq!(d.rx.wait_used(&m), (0, 0));
    d.post_rx(1, 16);
    assert_eq!(d.rx.wait_used(&m), (1, 0));
    // An avail index far ahead of the ring: ignored until it is sane again.
    d.tx.publish(&m, d.tx.avail_idx.wrapping_add(1000));
    std::thread::sleep(Duration::from_millis(50));
    d.tx.publish(&m, d.tx.avail_idx);
    // A good frame comes back in the next good buffer.
    let f = frame(7, 200);
    d.send(4, &f);
    assert_eq!(d.tx.wait_used(&m), (4, 0));
    d.post_rx(2, 2048);
    let (id, len) = d.rx.wait_used(&m);
    assert_eq!(id, 2);
    assert_eq!(d.rx_buf(id, len)[HDR..], swapped(&f));

    // A ring outside the memory table: the request is refused (REPLY_ACK) and this connection
    // ends; the server serves the next front-end.
    let bad = VringConfigData {
        desc_table_addr: 0x10,
        ..d.tx.config(0)
    };
    assert!(d.fe.set_vring_addr(1, &bad).is_err());
    drop(d);
    // A memory table larger than its file (access past its end would fault): refused.
    let fe = negotiate(&socket, false);
    let mem = guest_memory();
    let mut info =
        VhostUserMemoryRegionInfo::from_guest_region(mem.iter().next().unwrap()).unwrap();
    info.memory_size *= 2;
    assert!(fe.set_mem_table(&[info]).is_err());
    drop(fe);
    let mut d = Driver::connect(&socket, true);
    d.post_rx(0, 2048);
    round_trip(&mut d, 0, 64, 0);

    let (status, out) = stop_server(server);
    assert_eq!(status, Some(0), "{out}");
    assert_eq!(counter(&out, "connections"), 3, "{out}");
    // tx outside memory, off its end, head past the ring; rx outside memory; the bad ring; the
    // memory table past its file.
    assert_eq!(counter(&out, "errors"), 6, "{out}");
    // The runt, the empty chain of the head past the ring, the frame too big for its buffer.
    assert_eq!(counter(&out, "drops"), 3, "{out}");
    assert_eq!(counter(&out, "frames_rx"), 2, "{out}");
    assert!(!out.contains("forbidden system call"), "{out}");
}

/// Without `--reconnect`, a front-end that breaks the protocol ends the server with a failure
/// status, its counters printed.
fn a_refused_request_without_reconnect_ends_the_server_with_failure() {
    let socket = socket_path("refused");
    let server = spawn_server(&socket, false);
    let mut d = Driver::connect(&socket, false);
    d.post_rx(0, 2048);
    round_trip(&mut d, 0, 64, 0);
    let bad = VringConfigData {
        used_ring_addr: 0x10,
        ..d.rx.config(0)
    };
    assert!(d.fe.set_vring_addr(0, &bad).is_err());
    drop(d);
    let (status, out) = finish(server);
    assert_eq!(status, Some(1), "{out}");
    assert!(out.contains("stopped=frontend-error"), "{out}");
    assert_eq!(counter(&out, "errors"), 1, "{out}");
    assert_eq!(counter(&out, "frames_rx"), 1, "{out}");
}

/// The server's threads run under the `device-server` filter: its self-test call (`socket`)
/// is caught, reported and ends the process with Lucid's violation status.
fn the_server_is_confined() {
    let socket = socket_path("confined");
    let _ = std::fs::remove_file(&socket);
    let child = Command::new(std::env::current_exe().unwrap())
        .env(CHILD_ENV, &socket)
        .env(lucid_seccomp::SELFTEST_ENV, "device-server")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (status, out) = finish(child);
    assert_eq!(status, Some(lucid_seccomp::VIOLATION_EXIT_STATUS), "{out}");
    assert!(
        out.contains("(role device-server) made a forbidden system call: socket (41)"),
        "{out}"
    );
    let _ = std::fs::remove_file(&socket);
}
