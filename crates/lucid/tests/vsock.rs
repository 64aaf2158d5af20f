//! virtio-vsock end to end on real KVM, with the default seccomp filters: the `virtio-vsock`
//! probe guest against host programs on the device's Unix socket (hybrid vsock). A host program
//! that connects with `CONNECT 1234\n` gets 1 MiB echoed by the guest (SHA-256 equal on both
//! sides); the guest connects to a host listener at `<socket>_5000`; 64 connections are open at
//! once, either way; garbage from a host program or from the guest gets the connection closed
//! or RST, and the VM goes on.

mod common;
mod rest_client;

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use common::{field, lucid, tmp, Outcome};
use rest_client::{eventually, have_curl, Server};
use serde_json::json;

const LIMIT: Duration = Duration::from_secs(90);

/// SHA-256 (FIPS 180-4), hex.
fn sha256(data: &[u8]) -> String {
    const K: [u32; 64] = [
        0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4,
        0xab1c5ed5, 0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe,
        0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f,
        0x4a7484aa, 0x5cb0a9dc, 0x76f988da, 0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7,
        0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc,
        0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85, 0xa2bfe8a1, 0xa81a664b,
        0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070, 0x19a4c116,
        0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
        0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7,
        0xc67178f2,
    ];
    let mut h: [u32; 8] = [
        0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab,
        0x5be0cd19,
    ];
    let mut msg = data.to_vec();
    msg.push(0x80);
    while msg.len() % 64 != 56 {
        msg.push(0);
    }
    msg.extend_from_slice(&((data.len() as u64) * 8).to_be_bytes());
    for block in msg.chunks(64) {
        let mut w = [0u32; 64];
        for i in 0..16 {
            w[i] = u32::from_be_bytes(block[4 * i..4 * i + 4].try_into().unwrap());
        }
        for i in 16..64 {
            let s0 = w[i - 15].rotate_right(7) ^ w[i - 15].rotate_right(18) ^ (w[i - 15] >> 3);
            let s1 = w[i - 2].rotate_right(17) ^ w[i - 2].rotate_right(19) ^ (w[i - 2] >> 10);
            w[i] = w[i - 16]
                .wrapping_add(s0)
                .wrapping_add(w[i - 7])
                .wrapping_add(s1);
        }
        let mut v = h;
        for i in 0..64 {
            let s1 = v[4].rotate_right(6) ^ v[4].rotate_right(11) ^ v[4].rotate_right(25);
            let ch = (v[4] & v[5]) ^ (!v[4] & v[6]);
            let t1 = v[7]
                .wrapping_add(s1)
                .wrapping_add(ch)
                .wrapping_add(K[i])
                .wrapping_add(w[i]);
            let s0 = v[0].rotate_right(2) ^ v[0].rotate_right(13) ^ v[0].rotate_right(22);
            let maj = (v[0] & v[1]) ^ (v[0] & v[2]) ^ (v[1] & v[2]);
            let t2 = s0.wrapping_add(maj);
            v.copy_within(0..7, 1);
            v[4] = v[4].wrapping_add(t1);
            v[0] = t1.wrapping_add(t2);
        }
        for (a, b) in h.iter_mut().zip(v) {
            *a = a.wrapping_add(b);
        }
    }
    h.iter().map(|x| format!("{x:08x}")).collect()
}

#[test]
fn sha256_of_abc() {
    assert_eq!(
        sha256(b"abc"),
        "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    );
}

/// A fresh socket path for the device.
fn socket(tag: &str) -> PathBuf {
    let p = tmp(&format!("vsock-dev-{tag}.sock"));
    let _ = std::fs::remove_file(&p);
    p
}

/// `<socket>_<port>`.
fn port_path(sock: &Path, port: u32) -> PathBuf {
    let mut s = sock.as_os_str().to_owned();
    s.push(format!("_{port}"));
    PathBuf::from(s)
}

/// Runs `lucid run --guest virtio-vsock --vsock cid=3,socket=SOCK` with `cmdline` on a thread.
fn start(sock: &Path, cmdline: &str, extra: &[&str]) -> JoinHandle<Outcome> {
    let mut args: Vec<String> = [
        "run",
        "--guest",
        "virtio-vsock",
        "--vsock",
        &format!("cid=3,socket={}", sock.display()),
        "--cmdline",
        cmdline,
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    args.extend(extra.iter().map(|s| s.to_string()));
    std::thread::spawn(move || {
        let a: Vec<&str> = args.iter().map(String::as_str).collect();
        lucid(&a, LIMIT)
    })
}

/// Connects to the device's socket once Lucid listens.
fn dial(sock: &Path) -> UnixStream {
    let t0 = Instant::now();
    loop {
        match UnixStream::connect(sock) {
            Ok(s) => {
                s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
                return s;
            }
            Err(e) if t0.elapsed() > Duration::from_secs(30) => panic!("{}: {e}", sock.display()),
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

/// Connects and asks for guest port `port`; returns the stream and Lucid's `OK` line.
fn connect_guest(sock: &Path, port: u32) -> (UnixStream, String) {
    let mut s = dial(sock);
    s.write_all(format!("CONNECT {port}\n").as_bytes()).unwrap();
    let mut line = Vec::new();
    let mut b = [0u8; 1];
    while b[0] != b'\n' {
        match s.read(&mut b) {
            Ok(1) => line.push(b[0]),
            r => panic!("no OK line (got {line:?}): {r:?}"),
        }
    }
    (s, String::from_utf8(line).unwrap())
}

fn ok_exit(o: &Outcome) {
    assert_eq!(
        o.status,
        Some(1),
        "(0 << 1) | 1: {}\n{}",
        o.stdout,
        o.stderr
    );
}

fn pattern(n: usize) -> Vec<u8> {
    let mut x = 0x2545_f491_4f6c_dd1du64;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

#[test]
fn a_host_program_gets_1_mib_echoed_by_the_guest() {
    let sock = socket("echo");
    let vm = start(&sock, "mode=echo port=1234 conns=1", &[]);
    let (s, ok) = connect_guest(&sock, 1234);
    let host_port: u32 = ok
        .strip_prefix("OK ")
        .and_then(|p| p.trim().parse().ok())
        .unwrap_or_else(|| panic!("{ok:?}"));
    assert!(host_port >= 1 << 30, "{ok}");
    let data = pattern(1 << 20);
    let sent_hash = sha256(&data);
    let mut w = s.try_clone().unwrap();
    let writer = std::thread::spawn(move || w.write_all(&data).unwrap());
    let mut back = vec![0u8; 1 << 20];
    (&s).read_exact(&mut back).unwrap();
    writer.join().unwrap();
    drop(s);
    let o = vm.join().unwrap();
    ok_exit(&o);
    assert_eq!(sha256(&back), sent_hash, "the echo differs");
    let line = "virtio-vsock: mode=echo";
    assert_eq!(field(&o.stdout, line, "sha256"), Some(sent_hash.as_str()));
    assert_eq!(field(&o.stdout, line, "bytes"), Some("1048576"));
    assert_eq!(o.counter("vsock.vsock0.connections_host"), 1);
    assert_eq!(o.counter("vsock.vsock0.tx_bytes"), 1 << 20);
    assert_eq!(o.counter("vsock.vsock0.rx_bytes"), 1 << 20);
    assert_eq!(o.counter("vsock.vsock0.bad_packets"), 0);
    // The guest's 32 KiB credit bounds what the device reads ahead of the echo.
    assert_eq!(o.counter("vsock.vsock0.rst_sent"), 0);
}

/// Echoes every connection made to `path` on a thread of its own; returns how many it took.
fn echo_listener(path: &Path, conns: usize) -> JoinHandle<Vec<Vec<u8>>> {
    let l = UnixListener::bind(path).unwrap();
    std::thread::spawn(move || {
        let mut threads = Vec::new();
        for _ in 0..conns {
            let (mut s, _) = l.accept().unwrap();
            threads.push(std::thread::spawn(move || {
                let mut got = Vec::new();
                let mut buf = vec![0u8; 65536];
                loop {
                    match s.read(&mut buf) {
                        Ok(0) | Err(_) => break,
                        Ok(n) => {
                            got.extend_from_slice(&buf[..n]);
                            if s.write_all(&buf[..n]).is_err() {
                                break;
                            }
                        }
                    }
                }
                got
            }));
        }
        threads.into_iter().map(|t| t.join().unwrap()).collect()
    })
}

#[test]
fn the_guest_connects_to_a_host_listener() {
    let sock = socket("connect");
    let listener = echo_listener(&port_path(&sock, 5000), 1);
    let o = start(&sock, "mode=connect port=5000 bytes=1m", &[])
        .join()
        .unwrap();
    ok_exit(&o);
    let got = listener.join().unwrap();
    let line = "virtio-vsock: mode=connect";
    assert_eq!(
        field(&o.stdout, line, "mismatches"),
        Some("0"),
        "{}",
        o.stdout
    );
    assert_eq!(got[0].len(), 1 << 20);
    assert_eq!(
        field(&o.stdout, line, "sha256"),
        Some(sha256(&got[0]).as_str())
    );
    assert_eq!(o.counter("vsock.vsock0.connections_guest"), 1);
    let _ = std::fs::remove_file(port_path(&sock, 5000));
}

#[test]
fn sixty_four_guest_connections_at_once() {
    let sock = socket("many");
    let listener = echo_listener(&port_path(&sock, 5000), 64);
    let o = start(&sock, "mode=many port=5000 conns=64", &[])
        .join()
        .unwrap();
    ok_exit(&o);
    let line = "virtio-vsock: mode=many";
    assert_eq!(field(&o.stdout, line, "ok"), Some("64"), "{}", o.stdout);
    assert_eq!(field(&o.stdout, line, "held"), Some("64"));
    assert_eq!(listener.join().unwrap().len(), 64);
    assert_eq!(o.counter("vsock.vsock0.connections_guest"), 64);
    let _ = std::fs::remove_file(port_path(&sock, 5000));
}

#[test]
fn sixty_four_host_connections_at_once() {
    let sock = socket("many-host");
    let vm = start(&sock, "mode=echo port=1234 conns=64", &[]);
    let mut streams: Vec<UnixStream> = (0..64).map(|_| connect_guest(&sock, 1234).0).collect();
    for (i, s) in streams.iter_mut().enumerate() {
        s.write_all(format!("conn {i}\n").as_bytes()).unwrap();
    }
    for (i, s) in streams.iter_mut().enumerate() {
        let mut line = String::new();
        BufReader::new(&*s).read_line(&mut line).unwrap();
        assert_eq!(line, format!("conn {i}\n"));
    }
    drop(streams);
    let o = vm.join().unwrap();
    ok_exit(&o);
    assert_eq!(
        field(&o.stdout, "virtio-vsock: mode=echo", "conns"),
        Some("64")
    );
    assert_eq!(o.counter("vsock.vsock0.connections_host"), 64);
}

/// A host program that writes garbage instead of `CONNECT` is closed; one that asks for a port
/// the guest does not listen on is closed without `OK`; then a good one is served.
#[test]
fn garbage_from_a_host_program_closes_only_its_connection() {
    let sock = socket("garbage");
    let vm = start(&sock, "mode=echo port=1234 conns=1", &[]);
    for junk in [
        &b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"[..],
        &[0xffu8; 100][..],
    ] {
        let mut s = dial(&sock);
        let _ = s.write_all(junk);
        let mut rest = Vec::new();
        let _ = s.read_to_end(&mut rest);
        assert!(rest.is_empty(), "answered garbage with {rest:?}");
    }
    let mut s = dial(&sock);
    s.write_all(b"CONNECT 999\n").unwrap();
    let mut rest = Vec::new();
    let _ = s.read_to_end(&mut rest);
    assert!(rest.is_empty(), "no guest listener, yet {rest:?}");
    let (mut s, ok) = connect_guest(&sock, 1234);
    assert!(ok.starts_with("OK "), "{ok}");
    s.write_all(b"ping").unwrap();
    let mut b = [0u8; 4];
    s.read_exact(&mut b).unwrap();
    assert_eq!(&b, b"ping");
    drop(s);
    let o = vm.join().unwrap();
    ok_exit(&o);
    assert_eq!(o.counter("vsock.vsock0.host_bad_requests"), 2);
    assert_eq!(o.counter("vsock.vsock0.connections_host"), 1);
}

/// Malformed packets from the guest (data on no connection, an unknown op, a length beyond its
/// buffer, an unknown type) and a connection to a host port nobody listens on: each gets RST,
/// and the device goes on.
#[test]
fn bad_packets_from_the_guest_get_rst() {
    let sock = socket("bad");
    let o = start(&sock, "mode=bad port=5000", &[]).join().unwrap();
    ok_exit(&o);
    let line = "virtio-vsock: mode=bad";
    assert_eq!(field(&o.stdout, line, "rst"), Some("5"), "{}", o.stdout);
    assert_eq!(field(&o.stdout, line, "refused"), Some("1"));
    assert_eq!(o.counter("vsock.vsock0.bad_packets"), 4);
    assert_eq!(o.counter("vsock.vsock0.connect_failures"), 1);
    assert_eq!(o.counter("vsock.vsock0.rst_sent"), 5);
    assert_eq!(o.counter("vsock0.errors"), 0);
}

/// Behind the vIOMMU: every buffer is an IOVA the guest mapped; the device moves the stream
/// through the translation and the unit records no fault.
#[test]
fn the_stream_goes_through_the_viommu() {
    let sock = socket("vtd");
    let listener = echo_listener(&port_path(&sock, 5000), 1);
    let o = start(
        &sock,
        "mode=connect port=5000 bytes=256k iommu=vtd strategy=strict",
        &["--iommu", "vtd"],
    )
    .join()
    .unwrap();
    ok_exit(&o);
    assert!(o.stdout.contains("iommu-dma "), "{}", o.stdout);
    assert_eq!(
        field(&o.stdout, "virtio-vsock: mode=connect", "mismatches"),
        Some("0")
    );
    assert_eq!(listener.join().unwrap()[0].len(), 256 << 10);
    let _ = std::fs::remove_file(port_path(&sock, 5000));
}

/// Cloud Hypervisor's `vsock` of a `vm.create` (what Kata sends) gives the guest the device;
/// `vm.add-vsock` hot-adds one to a booted VM, and a second is refused.
#[test]
fn vsock_of_vm_create_and_vm_add_vsock() {
    if !have_curl() {
        return lucid_guests::skip_or_fail("curl is not installed (apt-get install curl)");
    }
    let sock = socket("rest");
    let listener = echo_listener(&port_path(&sock, 5000), 1);
    let serial = tmp("vsock-rest.serial");
    let s = Server::start("vsock-rest");
    let config = json!({
        "payload": {"kernel": "builtin:virtio-vsock", "cmdline": "mode=connect port=5000 bytes=64k"},
        "cpus": {"boot_vcpus": 1, "max_vcpus": 1},
        "memory": {"size": 64u64 << 20},
        "serial": {"mode": "File", "file": serial},
        "console": {"mode": "Off"},
        "vsock": {"cid": 3, "socket": sock, "iommu": false, "id": "agent"},
    });
    let (code, body) = s.curl("PUT", "vm.create", Some(&config));
    assert_eq!((code, body.as_str()), (204, ""));
    assert!(s.json("GET", "vm.info")["device_tree"]["agent"].is_object());
    assert_eq!(s.curl("PUT", "vm.boot", None).0, 204);
    let console = || std::fs::read_to_string(&serial).unwrap_or_default();
    assert!(
        // The serial port writes a byte at a time: wait for the guest's whole line.
        eventually(|| console()
            .split_once("virtio-vsock: mode=connect")
            .is_some_and(|(_, rest)| rest.contains('\n'))),
        "{}\n{}",
        console(),
        s.stderr()
    );
    assert_eq!(
        field(&console(), "virtio-vsock: mode=connect", "mismatches"),
        Some("0")
    );
    assert_eq!(listener.join().unwrap()[0].len(), 64 << 10);
    assert!(eventually(|| s.json("GET", "vm.counters")["vsock"]
        ["agent.connections_guest"]
        == 1));
    let (code, body) = s.curl(
        "PUT",
        "vm.add-vsock",
        Some(&json!({"cid": 4, "socket": socket("rest2")})),
    );
    assert_eq!(code, 400, "{body}");
    assert!(body.contains("already has a vsock"), "{body}");
    let _ = std::fs::remove_file(port_path(&sock, 5000));
}

#[test]
fn vm_add_vsock_hot_adds_a_listening_device() {
    if !have_curl() {
        return lucid_guests::skip_or_fail("curl is not installed (apt-get install curl)");
    }
    let sock = socket("hot");
    let s = Server::start("vsock-hot");
    let config = json!({
        "payload": {"kernel": "builtin:spin"},
        "cpus": {"boot_vcpus": 1, "max_vcpus": 1},
        "memory": {"size": 64u64 << 20},
        "console": {"mode": "Off"},
    });
    assert_eq!(s.curl("PUT", "vm.create", Some(&config)).0, 204);
    assert_eq!(s.curl("PUT", "vm.boot", None).0, 204);
    let (code, body) = s.curl(
        "PUT",
        "vm.add-vsock",
        Some(&json!({"cid": 2, "socket": "/x"})),
    );
    assert_eq!(code, 400, "{body}");
    assert!(body.contains("cid"), "{body}");
    let v = json!({"cid": 3, "socket": sock});
    let (code, body) = s.curl("PUT", "vm.add-vsock", Some(&v));
    assert_eq!(code, 200, "{body}");
    let r: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(r["id"], "vsock0", "{r}");
    assert!(r["bdf"].as_str().unwrap().starts_with("0000:00:"), "{r}");
    // Lucid listens; the connection waits until a driver starts the device. A socket in use is
    // not taken over.
    UnixStream::connect(&sock).unwrap();
    let (code, body) = s.curl(
        "PUT",
        "vm.add-vsock",
        Some(&json!({"cid": 3, "socket": sock, "id": "again"})),
    );
    assert_eq!(code, 400, "{body}");
    assert_eq!(s.json("GET", "vm.info")["config"]["vsock"]["cid"], 3);
    let (code, body) = s.curl("PUT", "vm.add-vsock", Some(&v));
    assert_eq!(code, 400, "{body}");
}

/// A socket somebody listens on is not taken over (a stale one, nobody listening, is replaced).
#[test]
fn a_socket_in_use_is_refused() {
    let sock = socket("in-use");
    let l = UnixListener::bind(&sock).unwrap();
    let o = lucid(
        &[
            "run",
            "--guest",
            "hello",
            "--vsock",
            &format!("cid=3,socket={}", sock.display()),
        ],
        LIMIT,
    );
    assert_ne!(o.status, Some(1), "{}", o.stderr);
    assert!(o.stderr.contains("in use"), "{}", o.stderr);
    drop(l);
    let o = lucid(
        &[
            "run",
            "--guest",
            "hello",
            "--vsock",
            &format!("cid=3,socket={}", sock.display()),
        ],
        LIMIT,
    );
    assert_eq!(o.status, Some(1), "{}", o.stderr);
}

/// The connect thread is confined to its own role: the self-test's `socket(AF_UNIX,
/// SOCK_DGRAM)` is not the Unix stream it may make, so it is caught and reported.
#[test]
fn the_connect_thread_is_confined() {
    let sock = socket("seccomp");
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_lucid"));
    cmd.args(["run", "--guest", "spin", "--vsock"])
        .arg(format!("cid=3,socket={}", sock.display()))
        .env("LUCID_SECCOMP_SELFTEST", "vsock");
    let o = common::run_cmd(cmd, LIMIT);
    assert_eq!(o.status, Some(148), "{}", o.stderr);
    assert!(
        o.stderr.contains(
            "lucid: seccomp: thread lucid-vsock0-cn (role vsock) made a forbidden system call: \
             socket (41)"
        ),
        "{}",
        o.stderr
    );
}
