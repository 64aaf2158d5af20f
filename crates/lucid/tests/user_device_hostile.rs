//! `lucid run --user-device` against hostile vfio-user servers: a test double in this file speaks
//! just enough of the protocol (raw bytes on a Unix socket) to lie at one step. Each case must
//! end with a clear error naming the problem, within a bound, never a hang or a crash.

mod common;

use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{lucid, tmp};

/// The client waits 5 s per message; boot and teardown on a loaded host take the rest.
const BOUND: Duration = Duration::from_secs(30);

const VERSION: u16 = 1;
const DEVICE_GET_INFO: u16 = 4;
const DEVICE_GET_REGION_INFO: u16 = 5;
const GET_IRQ_INFO: u16 = 7;
const SET_IRQS: u16 = 8;
const REGION_READ: u16 = 9;
const REGION_WRITE: u16 = 10;
const DMA_MAP: u16 = 2;
const REPLY: u32 = 1;
const VFIO_DEVICE_FLAGS_PCI: u32 = 1 << 1;

/// A request as the server read it.
struct Request {
    id: u16,
    command: u16,
    body: Vec<u8>,
}

fn header(id: u16, command: u16, size: usize, flags: u32) -> Vec<u8> {
    let mut h = Vec::with_capacity(16);
    h.extend_from_slice(&id.to_le_bytes());
    h.extend_from_slice(&command.to_le_bytes());
    h.extend_from_slice(&(size as u32).to_le_bytes());
    h.extend_from_slice(&flags.to_le_bytes());
    h.extend_from_slice(&0u32.to_le_bytes());
    h
}

/// A well-formed reply to `r` carrying `body` after the header.
fn reply(r: &Request, body: &[u8]) -> Vec<u8> {
    let mut m = header(r.id, r.command, 16 + body.len(), REPLY);
    m.extend_from_slice(body);
    m
}

fn u32s(v: &[u32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn version_reply(r: &Request) -> Vec<u8> {
    let mut body = vec![0, 0, 1, 0];
    body.extend_from_slice(b"{\"capabilities\":{}}\0");
    reply(r, &body)
}

/// A region info reply: `size` bytes, readable and writable.
fn region_reply(r: &Request, size: u64) -> Vec<u8> {
    let index = u32::from_le_bytes(r.body[8..12].try_into().unwrap());
    let mut body = u32s(&[32, 0x3, index, 0]);
    body.extend_from_slice(&size.to_le_bytes());
    body.extend_from_slice(&0u64.to_le_bytes());
    reply(r, &body)
}

/// An edu-like config space: 1234:11e8, BAR 0 a 32-bit memory BAR, no capabilities.
fn config_space() -> Vec<u8> {
    let mut c = vec![0u8; 256];
    c[0..4].copy_from_slice(&0x11e8_1234u32.to_le_bytes());
    c[0x0a] = 0xff;
    c
}

/// Serves one connection on `socket`, answering each request with what `answer` returns (None:
/// never answer, keep the connection open; an empty reply: close the connection, as a server
/// that died). Returns the socket path to give Lucid.
fn serve(name: &str, answer: impl Fn(&Request) -> Option<Vec<u8>> + Send + 'static) -> PathBuf {
    let path = tmp(&format!("hostile-{name}.sock"));
    let _ = std::fs::remove_file(&path);
    let listener = UnixListener::bind(&path).expect("bind the test server");
    std::thread::spawn(move || {
        let Ok((mut s, _)) = listener.accept() else {
            return;
        };
        loop {
            let mut h = [0u8; 16];
            if s.read_exact(&mut h).is_err() {
                return;
            }
            let size = u32::from_le_bytes(h[4..8].try_into().unwrap()) as usize;
            let mut body = vec![0u8; size.saturating_sub(16)];
            if s.read_exact(&mut body).is_err() {
                return;
            }
            let r = Request {
                id: u16::from_le_bytes([h[0], h[1]]),
                command: u16::from_le_bytes([h[2], h[3]]),
                body,
            };
            match answer(&r) {
                Some(m) if m.is_empty() => return,
                Some(m) => {
                    if s.write_all(&m).is_err() {
                        return;
                    }
                }
                None => hold(s),
            }
        }
    });
    path
}

/// Keeps the connection open and silent until the client goes away.
fn hold(mut s: UnixStream) -> ! {
    let mut sink = [0u8; 64];
    loop {
        match s.read(&mut sink) {
            Ok(0) | Err(_) => std::thread::sleep(Duration::from_secs(3600)),
            Ok(_) => {}
        }
    }
}

/// A device that answers correctly, except where `lie` returns Some.
fn honest_but(
    lie: impl Fn(&Request) -> Option<Option<Vec<u8>>> + Send + 'static,
    bar0: u64,
) -> impl Fn(&Request) -> Option<Vec<u8>> + Send + 'static {
    device(lie, bar0, config_space(), [0; 4])
}

/// A device with config space `config` and `irqs[i]` interrupts at VFIO IRQ index i.
fn device(
    lie: impl Fn(&Request) -> Option<Option<Vec<u8>>> + Send + 'static,
    bar0: u64,
    config: Vec<u8>,
    irqs: [u32; 4],
) -> impl Fn(&Request) -> Option<Vec<u8>> + Send + 'static {
    move |r| {
        if let Some(l) = lie(r) {
            return l;
        }
        Some(match r.command {
            VERSION => version_reply(r),
            DEVICE_GET_INFO => reply(r, &u32s(&[16, VFIO_DEVICE_FLAGS_PCI, 10, 4])),
            DEVICE_GET_REGION_INFO => {
                let index = u32::from_le_bytes(r.body[8..12].try_into().unwrap());
                let size = match index {
                    0 => bar0,
                    7 => 256,
                    _ => 0,
                };
                region_reply(r, size)
            }
            REGION_READ => {
                let offset = u64::from_le_bytes(r.body[0..8].try_into().unwrap()) as usize;
                let count = u32::from_le_bytes(r.body[12..16].try_into().unwrap()) as usize;
                let mut body = r.body[..16].to_vec();
                let c = &config;
                body.extend((offset..offset + count).map(|i| c.get(i).copied().unwrap_or(0)));
                reply(r, &body)
            }
            GET_IRQ_INFO => {
                let index = u32::from_le_bytes(r.body[8..12].try_into().unwrap());
                let count = irqs.get(index as usize).copied().unwrap_or(0);
                reply(r, &u32s(&[16, 0, index, count]))
            }
            REGION_WRITE => reply(r, &r.body[..16]),
            SET_IRQS | DMA_MAP => reply(r, &[]),
            _ => header(r.id, r.command, 16, REPLY | 1 << 5),
        })
    }
}

/// Runs `hello` with the device at `socket`; asserts Lucid refused it in time, saying `why`.
fn refused(socket: &PathBuf, why: &str) {
    let dev = format!("socket={}", socket.display());
    let start = Instant::now();
    let o = lucid(
        &[
            "run",
            "--guest",
            "hello",
            "--backing",
            "memfd",
            "--user-device",
            &dev,
        ],
        BOUND,
    );
    let took = start.elapsed();
    let _ = std::fs::remove_file(socket);
    assert!(!o.timed_out, "lucid hung; stderr: {}", o.stderr);
    assert_eq!(o.status, Some(70), "a Lucid failure; stderr: {}", o.stderr);
    assert!(
        o.stderr.contains("user0") && o.stderr.contains(why),
        "the error names the device and {why:?}: {}",
        o.stderr
    );
    assert!(
        !o.stdout.contains("hello from the lucid probe kit"),
        "the guest did not run"
    );
    assert!(took < BOUND, "refused in {took:?}");
}

#[test]
fn a_server_that_never_answers_is_refused_within_the_timeout() {
    let s = serve("silent", |_| None);
    let start = Instant::now();
    refused(&s, "did not answer within 5s");
    assert!(
        start.elapsed() >= Duration::from_secs(5),
        "waited the timeout"
    );
}

#[test]
fn a_reply_to_another_request_is_refused() {
    let s = serve("mismatch", |r| {
        let mut m = version_reply(r);
        m[0..2].copy_from_slice(&r.id.wrapping_add(7).to_le_bytes());
        Some(m)
    });
    refused(&s, "Reply does not match the request");
}

#[test]
fn a_malformed_version_reply_is_refused() {
    // A size below its fixed part: the crate used to underflow here.
    let s = serve("short", |r| Some(header(r.id, r.command, 4, REPLY)));
    refused(&s, "shorter than its fixed part");
}

#[test]
fn an_error_reply_is_an_error() {
    let s = serve("error", |r| {
        Some(header(r.id, r.command, 16, REPLY | 1 << 5))
    });
    refused(&s, "with error");
}

#[test]
fn a_billion_regions_are_refused() {
    let s = serve(
        "regions",
        honest_but(
            |r| {
                (r.command == DEVICE_GET_INFO).then(|| {
                    Some(reply(
                        r,
                        &u32s(&[16, VFIO_DEVICE_FLAGS_PCI, 1_000_000_000, 4]),
                    ))
                })
            },
            1 << 20,
        ),
    );
    refused(&s, "region count of 1000000000 is over the limit of 64");
}

#[test]
fn a_bar_of_three_bytes_is_refused() {
    let s = serve("bar3", honest_but(|_| None, 3));
    refused(&s, "BAR 0: size 0x3 is not a power of two");
}

#[test]
fn a_bar_too_big_is_refused() {
    let s = serve("bar-huge", honest_but(|_| None, 1 << 40));
    refused(&s, "over Lucid's 1 GiB limit");
}

#[test]
fn a_server_that_stops_answering_mid_setup_is_refused() {
    // Version and device info are answered; the region infos never are.
    let s = serve(
        "stall",
        honest_but(
            |r| (r.command == DEVICE_GET_REGION_INFO).then_some(None),
            1 << 20,
        ),
    );
    refused(&s, "did not answer within 5s");
}

#[test]
fn an_honest_device_joins_the_bus_and_the_guest_runs() {
    let s = serve("honest", honest_but(|_| None, 1 << 20));
    let dev = format!("socket={},id=fake", s.display());
    let o = lucid(
        &[
            "run",
            "--guest",
            "hello",
            "--backing",
            "memfd",
            "--user-device",
            &dev,
        ],
        BOUND,
    );
    let _ = std::fs::remove_file(&s);
    assert_eq!(o.status, Some(1), "hello's success; stderr: {}", o.stderr);
    assert!(
        o.stderr.contains("fake: vfio-user device 1234:11e8"),
        "{}",
        o.stderr
    );
    assert!(o.counter("user_device.fake.dma_maps") >= 1, "RAM mapped");
    assert_eq!(o.counter("user_device.fake.failed"), 0);
}

#[test]
fn without_a_shared_memfd_the_device_is_refused_before_anything_runs() {
    let o = lucid(
        &[
            "run",
            "--guest",
            "hello",
            "--user-device",
            "socket=/nonexistent",
        ],
        BOUND,
    );
    assert_eq!(o.status, Some(64), "a usage error; stderr: {}", o.stderr);
    assert!(o.stderr.contains("--backing memfd"), "{}", o.stderr);
}

#[test]
fn a_missing_socket_is_a_clear_error() {
    let o = lucid(
        &[
            "run",
            "--guest",
            "hello",
            "--backing",
            "memfd",
            "--user-device",
            "socket=/nonexistent/lucid.sock",
        ],
        BOUND,
    );
    assert_eq!(o.status, Some(70), "stderr: {}", o.stderr);
    assert!(
        o.stderr.contains("/nonexistent/lucid.sock") && o.stderr.contains("Error connecting"),
        "{}",
        o.stderr
    );
}

#[test]
fn a_server_that_dies_after_set_up_leaves_a_removed_device_not_a_hang() {
    // Set up honestly, then gone at the guest's first BAR access: the edu guest finds the
    // device (it has edu's IDs), and its registers read all ones from then on.
    let bar_access = |r: &Request| {
        let region = u32::from_le_bytes(r.body[8..12].try_into().unwrap());
        (matches!(r.command, REGION_READ | REGION_WRITE) && region < 6).then(|| Some(Vec::new()))
    };
    let s = serve("dies", honest_but(bar_access, 1 << 20));
    let dev = format!("socket={}", s.display());
    let o = lucid(
        &[
            "run",
            "--guest",
            "edu",
            "--backing",
            "memfd",
            "--user-device",
            &dev,
        ],
        BOUND,
    );
    let _ = std::fs::remove_file(&s);
    assert!(!o.timed_out, "lucid hung; stderr: {}", o.stderr);
    assert!(
        o.stderr.contains("user0: the device server failed"),
        "logged with its reason: {}",
        o.stderr
    );
    assert_eq!(
        o.stderr.matches("the device server failed").count(),
        1,
        "logged once: {}",
        o.stderr
    );
    assert_eq!(o.counter("user_device.user0.failed"), 1);
    assert_ne!(
        o.status,
        Some(1),
        "the edu guest did not pass: {}",
        o.stdout
    );
    assert!(
        o.stdout.contains("ident=0xffffffff") || !o.stdout.contains("ident=0x10000ed"),
        "{}",
        o.stdout
    );
}

/// The edu-like config space with an MSI-X capability at 0x40: `vectors`, and the table and
/// PBA registers (offset | BIR) as given.
fn msix_config(vectors: u16, table: u32, pba: u32) -> Vec<u8> {
    let mut c = config_space();
    c[0x06] = 0x10; // Status: capability list.
    c[0x34] = 0x40;
    c[0x40] = 0x11;
    c[0x42..0x44].copy_from_slice(&(vectors - 1).to_le_bytes());
    c[0x44..0x48].copy_from_slice(&table.to_le_bytes());
    c[0x48..0x4c].copy_from_slice(&pba.to_le_bytes());
    c
}

#[test]
fn an_msix_device_joins_the_bus_and_the_guest_runs() {
    let cfg = msix_config(4, 0x2000, 0x3000);
    let s = serve("msix", device(|_| None, 1 << 20, cfg, [0, 0, 4, 0]));
    let dev = format!("socket={},id=fake", s.display());
    let o = lucid(
        &[
            "run",
            "--guest",
            "hello",
            "--backing",
            "memfd",
            "--user-device",
            &dev,
        ],
        BOUND,
    );
    let _ = std::fs::remove_file(&s);
    assert_eq!(o.status, Some(1), "hello's success; stderr: {}", o.stderr);
    assert!(
        o.stderr.contains("fake: vfio-user device 1234:11e8")
            && o.stderr.contains("MSI-X (4 vectors)"),
        "{}",
        o.stderr
    );
    assert_eq!(o.counter("user_device.fake.failed"), 0);
}

#[test]
fn msix_in_a_missing_bar_is_refused() {
    let cfg = msix_config(4, 0x3 | 0x2000, 0x3000);
    let s = serve("msix-bir", device(|_| None, 1 << 20, cfg, [0, 0, 4, 0]));
    refused(
        &s,
        "the table is in BAR 3, which is not a memory BAR of the device",
    );
}

#[test]
fn an_msix_table_outside_its_bar_is_refused() {
    let cfg = msix_config(4, 0x1000, 0x800);
    let s = serve("msix-outside", device(|_| None, 0x1000, cfg, [0, 0, 4, 0]));
    refused(
        &s,
        "the table (0x1000+0x40) is outside BAR 0 (0x1000 bytes)",
    );
}

#[test]
fn four_thousand_msix_vectors_are_refused() {
    let cfg = msix_config(2048, 0x0, 0x8000);
    let s = serve("msix-4096", device(|_| None, 1 << 20, cfg, [0, 0, 4096, 0]));
    // The client refuses the count as it reads it, before the capability is looked at.
    refused(&s, "interrupt count of 4096 is over the limit of 2048");
}

#[test]
fn a_guest_enabling_msix_hands_the_server_its_vector_eventfds() {
    // A virtio-rng look-alike (common and notify capabilities in BAR 0) with 4 MSI-X vectors:
    // the probe kit's virtio driver enables MSI-X before it talks to the device (which then
    // fails it: the double offers no features).
    let mut cfg = msix_config(4, 0x2000, 0x2800);
    cfg[0..4].copy_from_slice(&0x1044_1af4u32.to_le_bytes());
    cfg[0x34] = 0x40;
    let common = [0x09, 0x50, 16, 1, 0, 0, 0, 0];
    cfg[0x40..0x48].copy_from_slice(&common);
    cfg[0x48..0x50].copy_from_slice(&u32s(&[0x1000, 0x100]));
    let notify = [0x09, 0x64, 20, 2, 0, 0, 0, 0];
    cfg[0x50..0x58].copy_from_slice(&notify);
    cfg[0x58..0x64].copy_from_slice(&u32s(&[0x3000, 0x100, 4]));
    cfg[0x64..0x70].copy_from_slice(&msix_config(4, 0x2000, 0x2800)[0x40..0x4c]);
    let sets = Arc::new(Mutex::new(Vec::new()));
    let seen = sets.clone();
    let record = move |r: &Request| {
        if r.command == SET_IRQS {
            let v: Vec<u32> = (0..5)
                .map(|i| u32::from_le_bytes(r.body[4 * i..4 * i + 4].try_into().unwrap()))
                .collect();
            seen.lock().unwrap().push(v);
        }
        None
    };
    let s = serve("msix-on", device(record, 1 << 20, cfg, [0, 0, 4, 0]));
    let dev = format!("socket={},id=fake", s.display());
    let o = lucid(
        &[
            "run",
            "--guest",
            "virtio-rng",
            "--backing",
            "memfd",
            "--user-device",
            &dev,
        ],
        BOUND,
    );
    let _ = std::fs::remove_file(&s);
    assert!(!o.timed_out, "lucid hung; stderr: {}", o.stderr);
    // argsz, flags, index, start, count.
    let on = vec![20, (1 << 5) | (1 << 2), 2, 0, 4];
    let sets = sets.lock().unwrap();
    assert!(
        sets.contains(&on),
        "SET_IRQS MSI-X with 4 eventfds: {sets:?}; stdout: {}; stderr: {}",
        o.stdout,
        o.stderr
    );
    assert!(o.counter("user_device.fake.msix_set_irqs") >= 1);
    assert_eq!(o.counter("user_device.fake.failed"), 0);
}
