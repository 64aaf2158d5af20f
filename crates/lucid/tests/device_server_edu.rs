//! `lucid device-server edu` as a process, confined: a vfio-user client (the `vfio_user`
//! crate's own) negotiates, reads the edu's IDs from config space and a register, and the
//! server ends when it goes away; SIGTERM stops a waiting one; a path that is not a socket is
//! refused. The device itself is tested in `crates/lucid-vfio-server/tests/edu_server.rs`.

mod common;

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const LIMIT: Duration = Duration::from_secs(30);

fn spawn(socket: &Path) -> Child {
    let server = Command::new(env!("CARGO_BIN_EXE_lucid"))
        .args(["device-server", "edu", "--socket", socket.to_str().unwrap()])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    let s = socket.to_str().unwrap();
    while !std::fs::read_to_string("/proc/net/unix").is_ok_and(|t| t.contains(s)) {
        assert!(t0.elapsed() < LIMIT, "the server never listened");
        std::thread::sleep(Duration::from_millis(10));
    }
    server
}

fn finish(server: Child) -> (Option<i32>, String, String) {
    let out = server.wait_with_output().unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn the_edu_server_serves_a_client_and_ends_with_it() {
    let socket = common::tmp("edu.sock");
    let server = spawn(&socket);
    let mut c = vfio_user::Client::new(&socket).expect("negotiation");
    assert_eq!(c.region(0).unwrap().size, 1 << 20);
    let mut id = [0u8; 4];
    c.region_read(7, 0, &mut id).unwrap();
    assert_eq!(u32::from_le_bytes(id), 0x11e8_1234, "1234:11e8");
    c.region_read(0, 0, &mut id).unwrap();
    assert_eq!(u32::from_le_bytes(id), 0x0100_00ed, "edu ident");
    c.shutdown().unwrap();
    drop(c);
    let (code, stdout, stderr) = finish(server);
    assert_eq!(code, Some(0), "{stdout}\n{stderr}");
    assert_eq!(
        stdout.trim(),
        "lucid device-server edu: stopped=disconnect clients=1 maps=0 unmaps=0 bytes_read=0 \
         bytes_written=0 refused=0",
        "{stderr}"
    );

    // The socket it leaves is stale: the next server replaces it, and SIGTERM stops it.
    let server = spawn(&socket);
    let second = common::lucid_plain(
        &["device-server", "edu", "--socket", socket.to_str().unwrap()],
        LIMIT,
    );
    assert!(
        second
            .stderr
            .contains("another process listens on this socket"),
        "{}",
        second.stderr
    );
    // SAFETY: kill with the pid of our own child.
    unsafe { libc::kill(server.id() as i32, libc::SIGTERM) };
    let (code, stdout, stderr) = finish(server);
    assert_eq!(code, Some(0), "{stdout}\n{stderr}");
    assert!(
        stdout.contains("stopped=SIGTERM clients=0"),
        "{stdout}\n{stderr}"
    );
    let _ = std::fs::remove_file(&socket);
}

#[test]
fn a_path_that_is_not_a_socket_is_refused() {
    let file = common::tmp("edu-not-a-socket");
    std::fs::write(&file, b"data").unwrap();
    let o = common::lucid_plain(
        &["device-server", "edu", "--socket", file.to_str().unwrap()],
        LIMIT,
    );
    assert_eq!(o.status, Some(64), "{}", o.stderr);
    assert!(
        o.stderr.contains("exists and is not a socket"),
        "{}",
        o.stderr
    );
    assert_eq!(std::fs::read(&file).unwrap(), b"data", "left alone");
    let _ = std::fs::remove_file(&file);
    let o = common::lucid_plain(
        &[
            "device-server",
            "edu",
            "--socket",
            "/nonexistent-dir/edu.sock",
        ],
        LIMIT,
    );
    assert_ne!(o.status, Some(0), "{}", o.stderr);
    assert!(o.stderr.contains("cannot listen on"), "{}", o.stderr);
}
