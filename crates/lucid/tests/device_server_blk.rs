//! `lucid device-server blk` as a process, confined: a vfio-user client (the `vfio_user`
//! crate's own) reads the virtio-blk's IDs from config space, writes and reads a sector through
//! one queue in a memfd (the disk's pread/pwrite under the filter), and the server ends when it
//! goes away, its counters in its last line; a missing disk is refused. The device itself is
//! tested in `crates/lucid-vfio-server/tests/blk_server.rs`.

mod common;

use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const LIMIT: Duration = Duration::from_secs(30);
/// The virtio BAR's region and its common configuration offsets (virtio 1.2, 4.1.4.3).
const VIRTIO: u32 = 4;
const RAM: u64 = 0x10_0000;

fn spawn(socket: &Path, disk: &Path) -> Child {
    let server = Command::new(env!("CARGO_BIN_EXE_lucid"))
        .args([
            "device-server",
            "blk",
            "--socket",
            socket.to_str().unwrap(),
            "--disk",
            disk.to_str().unwrap(),
        ])
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

fn w(c: &mut vfio_user::Client, off: u64, data: &[u8]) {
    c.region_write(VIRTIO, off, data).unwrap();
}

/// Queue 0 of 4 entries in `ram`: descriptors at 0, avail at 0x1000, used at 0x2000; a request
/// of `rtype` on sector 1 with its header at 0x3000, 512 bytes at 0x4000, status at 0x5000.
fn request(c: &mut vfio_user::Client, ram: &File, rtype: u32, n: u16) -> u8 {
    let mut h = [0u8; 16];
    h[0..4].copy_from_slice(&rtype.to_le_bytes());
    h[8..16].copy_from_slice(&1u64.to_le_bytes());
    ram.write_all_at(&h, 0x3000).unwrap();
    let data_flags = if rtype == 0 { 1 | 2 } else { 1 };
    for (i, (addr, len, flags)) in [(0x3000, 16, 1), (0x4000, 512, data_flags), (0x5000, 1, 2)]
        .into_iter()
        .enumerate()
    {
        let mut d = [0u8; 16];
        d[0..8].copy_from_slice(&(RAM + addr).to_le_bytes());
        d[8..12].copy_from_slice(&(len as u32).to_le_bytes());
        d[12..14].copy_from_slice(&(flags as u16).to_le_bytes());
        d[14..16].copy_from_slice(&(i as u16 + 1).to_le_bytes());
        ram.write_all_at(&d, i as u64 * 16).unwrap();
    }
    ram.write_all_at(&0u16.to_le_bytes(), 0x1004 + (n as u64 % 4) * 2)
        .unwrap();
    ram.write_all_at(&(n + 1).to_le_bytes(), 0x1002).unwrap();
    w(c, 0x3000, &0u16.to_le_bytes());
    let mut idx = [0u8; 2];
    ram.read_exact_at(&mut idx, 0x2002).unwrap();
    assert_eq!(u16::from_le_bytes(idx), n + 1, "used idx");
    let mut s = [0u8; 1];
    ram.read_exact_at(&mut s, 0x5000).unwrap();
    s[0]
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
fn the_blk_server_serves_a_client_and_ends_with_it() {
    let socket = common::tmp("blk.sock");
    let disk = common::tmp("blk-disk.img");
    std::fs::write(&disk, vec![7u8; 4096]).unwrap();
    let server = spawn(&socket, &disk);
    let mut c = vfio_user::Client::new(&socket).expect("negotiation");
    let mut id = [0u8; 4];
    c.region_read(7, 0, &mut id).unwrap();
    assert_eq!(u32::from_le_bytes(id), 0x1042_1af4, "1af4:1042");

    // SAFETY: a new memfd from a NUL-terminated name; the File owns it.
    let ram = unsafe { File::from_raw_fd(libc::memfd_create(c"ram".as_ptr(), libc::MFD_CLOEXEC)) };
    ram.set_len(0x6000).unwrap();
    c.dma_map(0, RAM, 0x6000, ram.as_raw_fd()).unwrap();
    c.region_write(7, 4, &6u16.to_le_bytes()).unwrap(); // memory + bus master
    w(&mut c, 0x14, &[1 | 2]);
    w(&mut c, 0x08, &1u32.to_le_bytes());
    w(&mut c, 0x0c, &1u32.to_le_bytes()); // VERSION_1
    w(&mut c, 0x14, &[1 | 2 | 8]);
    w(&mut c, 0x18, &4u16.to_le_bytes());
    for (off, at) in [(0x20, 0), (0x28, 0x1000), (0x30, 0x2000)] {
        w(&mut c, off, &(RAM + at).to_le_bytes());
    }
    w(&mut c, 0x1c, &1u16.to_le_bytes());
    w(&mut c, 0x14, &[1 | 2 | 4 | 8]);

    ram.write_all_at(&[0x5a; 512], 0x4000).unwrap();
    assert_eq!(request(&mut c, &ram, 1, 0), 0, "OUT");
    ram.write_all_at(&[0; 512], 0x4000).unwrap();
    assert_eq!(request(&mut c, &ram, 0, 1), 0, "IN");
    let mut got = [0u8; 512];
    ram.read_exact_at(&mut got, 0x4000).unwrap();
    assert!(got.iter().all(|&b| b == 0x5a));
    c.shutdown().unwrap();
    drop(c);
    let (code, stdout, stderr) = finish(server);
    assert_eq!(code, Some(0), "{stdout}\n{stderr}");
    assert!(
        stdout.starts_with("lucid device-server blk: stopped=disconnect clients=1 maps=1")
            && stdout.contains("requests=2 disk_read=512 disk_written=512"),
        "{stdout}\n{stderr}"
    );
    let on_disk = std::fs::read(&disk).unwrap();
    assert!(on_disk[512..1024].iter().all(|&b| b == 0x5a));
    assert!(on_disk[..512].iter().all(|&b| b == 7));
    let _ = std::fs::remove_file(&socket);
    let _ = std::fs::remove_file(&disk);
}

#[test]
fn a_missing_disk_is_refused() {
    let socket = common::tmp("blk-nodisk.sock");
    let o = common::lucid_plain(
        &[
            "device-server",
            "blk",
            "--socket",
            socket.to_str().unwrap(),
            "--disk",
            "/nonexistent-dir/disk.img",
        ],
        LIMIT,
    );
    assert_eq!(o.status, Some(64), "{}", o.stderr);
    assert!(o.stderr.contains("cannot open the disk"), "{}", o.stderr);
}
