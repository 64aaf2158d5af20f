//! `lucid device-server net` as a process: it listens, refuses a socket another server listens
//! on without connecting to it (a connection would be a front-end), stops on SIGTERM with its
//! counters, and replaces a stale socket file. Its data path is tested with rust-vmm's
//! front-end in `crates/lucid-vhost-net/tests/echo.rs`.

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const LIMIT: Duration = Duration::from_secs(30);

#[test]
fn a_device_server_listens_refuses_a_live_socket_and_stops_on_sigterm() {
    let socket = common::tmp("vhnet.sock");
    // A stale socket file, as a stopped server leaves it (a confined process may not unlink).
    drop(std::os::unix::net::UnixListener::bind(&socket).unwrap());
    let socket_arg = socket.to_str().unwrap();
    let server = Command::new(env!("CARGO_BIN_EXE_lucid"))
        .args(["device-server", "net", "--socket", socket_arg])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    let listening =
        || std::fs::read_to_string("/proc/net/unix").is_ok_and(|t| t.contains(socket_arg));
    while !listening() {
        assert!(t0.elapsed() < LIMIT, "the server never listened");
        std::thread::sleep(Duration::from_millis(10));
    }
    let second = common::lucid_plain(&["device-server", "net", "--socket", socket_arg], LIMIT);
    assert_eq!(second.status, Some(70), "{}", second.stderr);
    assert!(
        second
            .stderr
            .contains("another process listens on this socket"),
        "{}",
        second.stderr
    );
    // SAFETY: kill with the pid of our own child.
    unsafe { libc::kill(server.id() as i32, libc::SIGTERM) };
    let out = server.wait_with_output().unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert_eq!(out.status.code(), Some(0), "{stdout}\n{stderr}");
    // The refused server did not connect: the first saw no front-end.
    assert_eq!(
        stdout.trim(),
        "lucid device-server net: stopped=SIGTERM frames_tx=0 bytes_tx=0 frames_rx=0 \
         bytes_rx=0 drops=0 errors=0 connections=0",
        "{stderr}"
    );
    let _ = std::fs::remove_file(&socket);
}

#[test]
fn a_bad_mac_is_a_usage_error() {
    let o = common::lucid_plain(
        &[
            "device-server",
            "net",
            "--socket",
            "/nonexistent/s",
            "--mac",
            "52:54",
        ],
        LIMIT,
    );
    assert_eq!(o.status, Some(64), "{}", o.stderr);
    assert!(o.stderr.contains("is not a MAC address"), "{}", o.stderr);
}
