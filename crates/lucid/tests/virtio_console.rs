//! virtio-console on real KVM, with the default seccomp filters: the `virtio-console` probe
//! guest writes known lines on port 0, which land in a file, on Lucid's stdout, or with the
//! client of a Unix socket, whose input the guest reads and echoes back.

mod common;
mod rest_client;

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{lucid, tmp};
use rest_client::{eventually, have_curl, Server};
use serde_json::json;

const LIMIT: Duration = Duration::from_secs(60);

#[test]
fn port_0_output_lands_in_the_file() {
    let out = tmp("vcon.out");
    let o = lucid(
        &[
            "run",
            "--guest",
            "virtio-console",
            "--console-virtio",
            &format!("file:{}", out.display()),
            "--cmdline",
            "text=abc_def lines=3",
        ],
        LIMIT,
    );
    assert_eq!(
        o.status,
        Some(1),
        "(0 << 1) | 1: {}\n{}",
        o.stdout,
        o.stderr
    );
    let text = std::fs::read_to_string(&out).unwrap();
    let want = "0: abc def\n1: abc def\n2: abc def\n";
    assert_eq!(text, want);
    assert!(
        o.stdout.contains("virtio-console: features="),
        "{}",
        o.stdout
    );
    assert_eq!(o.counter("console.bytes_read"), want.len() as u64);
    assert_eq!(o.counter("console.requests"), 3);
    assert_eq!(o.counter("console.errors"), 0);
    let _ = std::fs::remove_file(&out);
}

#[test]
fn tty_output_goes_to_stdout() {
    let o = lucid(
        &[
            "run",
            "--guest",
            "virtio-console",
            "--console-virtio",
            "tty",
            "--cmdline",
            "text=on_the_tty",
        ],
        LIMIT,
    );
    assert_eq!(o.status, Some(1), "{}\n{}", o.stdout, o.stderr);
    assert!(o.stdout.contains("0: on the tty\n"), "{}", o.stdout);
}

#[test]
fn the_socket_client_gives_input_and_gets_output() {
    let sock = tmp("vcon.sock");
    let child = Command::new(env!("CARGO_BIN_EXE_lucid"))
        .args([
            "run",
            "--guest",
            "virtio-console",
            "--console-virtio",
            &format!("socket:{}", sock.display()),
            "--cmdline",
            "read=5 timeout_ms=30000",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    let mut client = loop {
        match UnixStream::connect(&sock) {
            Ok(s) => break s,
            Err(_) if t0.elapsed() < LIMIT => std::thread::sleep(Duration::from_millis(20)),
            Err(e) => panic!("{}: {e}", sock.display()),
        }
    };
    client
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    client.write_all(b"hello").unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 256];
    while !String::from_utf8_lossy(&got).contains("echo: hello\n") {
        match client.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => got.extend_from_slice(&buf[..n]),
        }
    }
    let o = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(
        String::from_utf8_lossy(&got).contains("echo: hello\n"),
        "{:?}\n{stdout}\n{}",
        String::from_utf8_lossy(&got),
        String::from_utf8_lossy(&o.stderr)
    );
    assert_eq!(o.status.code(), Some(1), "{stdout}");
    assert!(stdout.contains("virtio-console: input=hello"), "{stdout}");
    let _ = std::fs::remove_file(&sock);
}

/// Three ports: the guest opens them through the control queues, port 0 is the console, the
/// others are announced by name, and each port's output lands in its own file.
#[test]
fn multiport_output_goes_to_each_ports_file() {
    let (p0, p1, p2) = (tmp("vcon-mp0"), tmp("vcon-mp1"), tmp("vcon-mp2"));
    let o = lucid(
        &[
            "run",
            "--guest",
            "virtio-console",
            "--console-virtio",
            &format!(
                "file:{},port1={},port2={}",
                p0.display(),
                p1.display(),
                p2.display()
            ),
            "--cmdline",
            "text=mp lines=2",
        ],
        LIMIT,
    );
    assert_eq!(o.status, Some(1), "{}\n{}", o.stdout, o.stderr);
    assert!(
        o.stdout
            .contains("virtio-console: ports=3 console=0 opened=3 names=lucid.port1,lucid.port2"),
        "{}",
        o.stdout
    );
    let read = |p: &std::path::Path| std::fs::read_to_string(p).unwrap();
    assert_eq!(read(&p0), "0: mp\n1: mp\n");
    assert_eq!(read(&p1), "0: port 1 mp\n1: port 1 mp\n");
    assert_eq!(read(&p2), "0: port 2 mp\n1: port 2 mp\n");
    // DEVICE_READY and a PORT_READY for each port.
    assert_eq!(o.counter("console.control_messages"), 4);
    for p in [p0, p1, p2] {
        let _ = std::fs::remove_file(p);
    }
}

/// Cloud Hypervisor's `console` of a `vm.create` gives the guest the device.
#[test]
fn console_of_vm_create_gives_the_guest_the_device() {
    if !have_curl() {
        return lucid_guests::skip_or_fail("curl is not installed (apt-get install curl)");
    }
    let out = tmp("vcon-rest.out");
    let s = Server::start("vcon-rest");
    let config = json!({
        "payload": {"kernel": "builtin:virtio-console", "cmdline": "text=over_rest"},
        "cpus": {"boot_vcpus": 1, "max_vcpus": 1},
        "memory": {"size": 64u64 << 20},
        "serial": {"mode": "Null"},
        "console": {"mode": "File", "file": out, "iommu": false},
    });
    let (code, body) = s.curl("PUT", "vm.create", Some(&config));
    assert_eq!((code, body.as_str()), (204, ""));
    let info = s.json("GET", "vm.info");
    assert!(info["device_tree"]["console"].is_object(), "{info}");
    assert_eq!(s.curl("PUT", "vm.boot", None).0, 204);
    let text = || std::fs::read_to_string(&out).unwrap_or_default();
    assert!(
        eventually(|| text() == "0: over rest\n"),
        "{:?}\n{}",
        text(),
        s.stderr()
    );
    let _ = std::fs::remove_file(&out);
}
