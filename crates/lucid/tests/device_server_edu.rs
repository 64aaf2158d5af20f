//! `lucid device-server edu` as a process, confined: a vfio-user client (the `vfio_user`
//! crate's own) negotiates, reads the edu's IDs from config space and a register, and the
//! server ends when it goes away; SIGTERM stops a waiting one; a path that is not a socket is
//! refused. The device itself is tested in `crates/lucid-vfio-server/tests/edu_server.rs`.

mod common;

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::fs::FileExt;
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

fn eventfd() -> File {
    // SAFETY: a new non-blocking eventfd; the File owns it.
    unsafe { File::from_raw_fd(libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC)) }
}

/// Whether `e` was signalled within a second (and consumes it).
fn signalled(mut e: &File) -> bool {
    let mut b = [0u8; 8];
    for _ in 0..100 {
        if e.read(&mut b).is_ok() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    false
}

fn w64(c: &mut vfio_user::Client, off: u64, v: u64) {
    c.region_write(0, off, &v.to_le_bytes()).unwrap();
}

/// What a confined server does with the descriptors a client sends: mmap a memfd, DMA into it,
/// refuse outside it, write the INTx and ERR eventfds and poll the unmask one in its thread.
fn confined_dma_and_interrupts(c: &mut vfio_user::Client) {
    // SAFETY: a new memfd from a NUL-terminated name; the File owns it.
    let ram = unsafe { File::from_raw_fd(libc::memfd_create(c"ram".as_ptr(), libc::MFD_CLOEXEC)) };
    ram.set_len(0x2000).unwrap();
    ram.write_all_at(b"lucid-vu", 0x10).unwrap();
    c.dma_map(0, 0x10_0000, 0x2000, ram.as_raw_fd()).unwrap();
    let (intx, unmask, err) = (eventfd(), eventfd(), eventfd());
    let trigger = 32 | 4; // ACTION_TRIGGER | DATA_EVENTFD
    c.set_irqs(0, trigger, 0, 1, &[intx.as_raw_fd()]).unwrap();
    c.set_irqs(0, 16 | 4, 0, 1, &[unmask.as_raw_fd()]).unwrap();
    c.set_irqs(3, trigger, 0, 1, &[err.as_raw_fd()]).unwrap();
    c.region_write(7, 4, &6u16.to_le_bytes()).unwrap(); // memory + bus master
                                                        // RAM -> buffer -> RAM at 0x1000, raising INTx (0x100) when done.
    for (src, dst, cmd) in [(0x10_0010, 0x40000, 1), (0x40000, 0x10_1000, 1 | 2 | 4)] {
        w64(c, 0x80, src);
        w64(c, 0x88, dst);
        w64(c, 0x90, 8);
        w64(c, 0x98, cmd);
    }
    let mut got = [0u8; 8];
    ram.read_exact_at(&mut got, 0x1000).unwrap();
    assert_eq!(&got, b"lucid-vu");
    assert!(signalled(&intx), "INTx");
    (&unmask).write_all(&1u64.to_ne_bytes()).unwrap();
    assert!(signalled(&intx), "INTx again at the unmask, still high");
    // Outside the mapping: refused, ERR written before the reply.
    w64(c, 0x88, 0x20_0000);
    w64(c, 0x98, 1 | 2);
    assert!((&err).read(&mut [0u8; 8]).is_ok(), "ERR");
    c.dma_unmap(0x10_0000, 0x2000).unwrap();
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
    confined_dma_and_interrupts(&mut c);
    c.shutdown().unwrap();
    drop(c);
    let (code, stdout, stderr) = finish(server);
    assert_eq!(code, Some(0), "{stdout}\n{stderr}");
    assert_eq!(
        stdout.trim(),
        "lucid device-server edu: stopped=disconnect clients=1 maps=1 unmaps=1 bytes_read=8 \
         bytes_written=8 refused=1",
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
