//! vhost-user devices against back-ends nobody here wrote, on real KVM: Debian's
//! `qemu-storage-daemon` serving a vhost-user-blk, `/usr/lib/qemu/virtiofsd` serving a
//! virtio-fs share, a back-end killed with `kill -9` while the guest uses it (and one
//! restarted, which Lucid reconnects to); and
//! vhost-user-net against `lucid device-server net`, a separate process built on rust-vmm's
//! `vhost-user-backend`.

mod common;
mod rest_client;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{disk, field, lucid, tmp, Outcome};
use serde_json::json;

const LIMIT: Duration = Duration::from_secs(120);
const QSD: &str = "/usr/bin/qemu-storage-daemon";
const VIRTIOFSD: &str = "/usr/lib/qemu/virtiofsd";
/// The synchronous requests of the reconnection test: enough to outlast the restart.
const RECONNECT_OPS: u64 = 50000;

/// A back-end process, killed (SIGKILL) when dropped.
struct BackEnd {
    child: Child,
    socket: PathBuf,
}

impl BackEnd {
    /// Starts `cmd` and waits for it to listen on `socket`.
    fn start(cmd: Command, socket: PathBuf) -> BackEnd {
        BackEnd::start_to(cmd, socket, Stdio::null())
    }

    /// As [`BackEnd::start`], its standard output going to `stdout`.
    fn start_to(mut cmd: Command, socket: PathBuf, stdout: Stdio) -> BackEnd {
        let _ = std::fs::remove_file(&socket);
        let child = cmd
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {cmd:?}: {e}"));
        let t0 = Instant::now();
        while !socket.exists() {
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "{cmd:?} made no socket {}",
                socket.display()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        BackEnd { child, socket }
    }

    fn qsd(img: &Path, tag: &str) -> Option<BackEnd> {
        if !Path::new(QSD).exists() {
            eprintln!("skipped: no {QSD} (apt-get install qemu-system-common)");
            return None;
        }
        let socket = tmp(&format!("{tag}.qsd.sock"));
        let mut cmd = Command::new(QSD);
        cmd.arg("--blockdev")
            .arg(format!(
                "driver=file,node-name=f,filename={}",
                img.display()
            ))
            .arg("--export")
            .arg(format!(
                "type=vhost-user-blk,id=e,node-name=f,addr.type=unix,addr.path={},writable=on",
                socket.display()
            ));
        Some(BackEnd::start(cmd, socket))
    }

    fn virtiofsd(dir: &Path, tag: &str) -> Option<BackEnd> {
        if !Path::new(VIRTIOFSD).exists() {
            eprintln!("skipped: no {VIRTIOFSD} (apt-get install qemu-system-common)");
            return None;
        }
        let socket = tmp(&format!("{tag}.vfsd.sock"));
        let mut cmd = Command::new(VIRTIOFSD);
        cmd.arg(format!("--socket-path={}", socket.display()))
            .arg("-o")
            .arg(format!("source={}", dir.display()))
            .arg("-o")
            .arg("cache=none")
            .arg("-o")
            .arg("sandbox=chroot");
        Some(BackEnd::start(cmd, socket))
    }

    /// `lucid device-server net`, its standard output (the summary) in `out`.
    fn net_server(tag: &str, out: &Path) -> BackEnd {
        let socket = tmp(&format!("{tag}.vhnet.sock"));
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_lucid"));
        cmd.args(["device-server", "net", "--socket"]).arg(&socket);
        let stdout = std::fs::File::create(out).unwrap();
        BackEnd::start_to(cmd, socket, stdout.into())
    }

    /// Waits for a back-end that stops on its own (the front-end left) and returns its exit
    /// status; one still running after `limit` is killed (None).
    fn wait(&mut self, limit: Duration) -> Option<i32> {
        let t0 = Instant::now();
        while t0.elapsed() < limit {
            if let Some(s) = self.child.try_wait().unwrap() {
                return s.code();
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        self.kill();
        None
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for BackEnd {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_file(&self.socket);
    }
}

fn mix64(mut x: u64) -> u64 {
    x ^= x >> 31;
    x = x.wrapping_mul(0x7fb5d329728ea185);
    x ^= x >> 27;
    x = x.wrapping_mul(0x81dadef4bc2dd44d);
    x ^= x >> 33;
    x
}

/// The virtio-blk probe guest's pattern for one 512-byte sector (guests/x86/virtio-blk.c).
fn sector_pattern(sector: u64, seed: u64) -> [u8; 512] {
    let mut w = [0u64; 64];
    w[0] = sector;
    w[1] = seed;
    let base = mix64(sector ^ (seed << 1));
    for (k, v) in w.iter_mut().enumerate().skip(2) {
        *v = base.wrapping_add((k as u64).wrapping_mul(0x9e3779b97f4a7c15));
    }
    let mut out = [0u8; 512];
    for (i, v) in w.iter().enumerate() {
        out[i * 8..i * 8 + 8].copy_from_slice(&v.to_le_bytes());
    }
    out
}

/// Sectors of `img` that do not hold the pattern of `seed`.
fn bad_sectors(img: &Path, seed: u64) -> u64 {
    let data = std::fs::read(img).unwrap();
    data.chunks(512)
        .enumerate()
        .filter(|(s, c)| *c != sector_pattern(*s as u64, seed))
        .count() as u64
}

fn blk_run(socket: &Path, cmdline: &str) -> Outcome {
    lucid(
        &[
            "run",
            "--guest",
            "virtio-blk",
            "--backing",
            "memfd",
            "--blk",
            &format!("vhost_user=on,socket={}", socket.display()),
            "--cmdline",
            cmdline,
        ],
        LIMIT,
    )
}

/// The guest writes every block of a disk qemu-storage-daemon serves and reads it back; the
/// host file then holds the guest's pattern in every sector. Then the host writes another
/// pattern and the guest reads and checks it.
#[test]
fn blk_from_qemu_storage_daemon() {
    let img = disk("vu-blk", 4);
    let Some(be) = BackEnd::qsd(&img, "vu-blk") else {
        return;
    };
    let blocks = (4 << 20) / 4096;
    let o = blk_run(
        &be.socket,
        &format!("op=write pattern=seq bs=4096 qd=8 count={blocks} verify=1 seed=0x1234"),
    );
    assert_eq!(
        o.status,
        Some(1),
        "(0 << 1) | 1: {}\n{}",
        o.stdout,
        o.stderr
    );
    assert_eq!(field(&o.stdout, "virtio-blk op=", "mismatches"), Some("0"));
    assert_eq!(
        field(&o.stdout, "virtio-blk op=", "ops"),
        Some(blocks.to_string().as_str())
    );
    assert_eq!(o.counter("vhost_user.blk0.connected"), 1);
    assert_eq!(o.counter("vhost_user.blk0.activations"), 1);
    assert_eq!(o.counter("vhost_user.blk0.mem_table_updates"), 1);
    assert_eq!(o.counter("vhost_user.blk0.vrings_set_up"), 1);
    assert_eq!(o.counter("vhost_user.blk0.disconnects"), 0);
    assert_eq!(o.counter("vhost_user.blk0.errors"), 0);
    // The data path is the back-end's: no kick reached Lucid's userspace, and the interrupts
    // went out through the irqfd Lucid gave the back-end.
    assert_eq!(o.counter("blk0.notify.exit"), 0);
    assert_eq!(o.counter("vhost_user.blk0.calls_relayed"), 0);
    assert!(o.counter("blk0.irq.irqfd_shared") >= 1);
    drop(be);
    assert_eq!(
        bad_sectors(&img, 0x1234),
        0,
        "the host file holds the guest's data"
    );

    // The host writes, the guest reads and checks.
    let data: Vec<u8> = (0..(4u64 << 20) / 512)
        .flat_map(|s| sector_pattern(s, 0x777))
        .collect();
    std::fs::write(&img, data).unwrap();
    let be = BackEnd::qsd(&img, "vu-blk").unwrap();
    let o = blk_run(
        &be.socket,
        "op=read pattern=rand bs=4096 qd=32 count=2000 verify=1 seed=0x777",
    );
    assert_eq!(
        o.status,
        Some(1),
        "(0 << 1) | 1: {}\n{}",
        o.stdout,
        o.stderr
    );
    assert_eq!(field(&o.stdout, "virtio-blk op=", "mismatches"), Some("0"));
    drop(be);
    std::fs::remove_file(img).unwrap();
}

/// A vhost-user device without shared guest RAM, or behind the vIOMMU, is refused before
/// anything is built, saying why.
#[test]
fn vhost_user_needs_shared_memory_and_no_iommu() {
    let o = common::lucid_plain(
        &[
            "run",
            "--guest",
            "hello",
            "--blk",
            "vhost_user=on,socket=/nonexistent.sock",
        ],
        LIMIT,
    );
    assert_ne!(o.status, Some(0));
    assert!(o.stderr.contains("--backing memfd"), "{}", o.stderr);
    let o = common::lucid_plain(
        &[
            "run",
            "--guest",
            "hello",
            "--backing",
            "memfd",
            "--iommu",
            "vtd",
            "--fs",
            "tag=t,socket=/nonexistent.sock",
        ],
        LIMIT,
    );
    assert_ne!(o.status, Some(0));
    assert!(o.stderr.contains("IOTLB"), "{}", o.stderr);
    // A back-end that is not there is the device's error, at build time.
    let o = common::lucid_plain(
        &[
            "run",
            "--guest",
            "hello",
            "--backing",
            "memfd",
            "--fs",
            "tag=t,socket=/nonexistent.sock",
        ],
        LIMIT,
    );
    assert_ne!(o.status, Some(0));
    assert!(o.stderr.contains("fs0: cannot connect"), "{}", o.stderr);
}

/// virtiofsd serves a directory: the probe guest negotiates, sets up its queues and speaks
/// FUSE (INIT, LOOKUP, OPEN, READ) to it; the bytes it read are the file's. Then it resets the
/// device and does it again.
#[test]
fn fs_from_virtiofsd() {
    let dir = tmp("vu-fs-share");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let content: Vec<u8> = (0..3000u32)
        .map(|i| (mix64(i.into()) & 0xff) as u8)
        .collect();
    std::fs::write(dir.join("probe.bin"), &content).unwrap();
    let Some(be) = BackEnd::virtiofsd(&dir, "vu-fs") else {
        return;
    };
    let o = lucid(
        &[
            "run",
            "--guest",
            "virtio-fs",
            "--backing",
            "memfd",
            "--fs",
            &format!("tag=share,socket={}", be.socket.display()),
            "--cmdline",
            "file=probe.bin bytes=4096 rounds=2",
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
    assert_eq!(field(&o.stdout, "virtio-fs tag=", "tag"), Some("share"));
    assert_eq!(field(&o.stdout, "virtio-fs init", "major"), Some("7"));
    let fnv = content.iter().fold(0xcbf29ce484222325u64, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x100000001b3)
    });
    let lines: Vec<&str> = o
        .stdout
        .lines()
        .filter(|l| l.starts_with("virtio-fs file="))
        .collect();
    let want = format!("virtio-fs file=probe.bin size=3000 read=3000 fnv={fnv:x}");
    // The second round comes after the guest reset the device: the back-end's rings were
    // stopped and set up again, memory table included.
    assert_eq!(lines, [&want, &want], "{}", o.stdout);
    // Both queues (high priority and requests) were handed over, twice.
    assert_eq!(o.counter("vhost_user.fs0.activations"), 2);
    assert_eq!(o.counter("vhost_user.fs0.vrings_set_up"), 4);
    assert!(o.counter("vhost_user.fs0.vrings_stopped") >= 2);
    assert_eq!(o.counter("vhost_user.fs0.mem_table_updates"), 2);
    assert_eq!(o.counter("fs0.notify.exit"), 0);
    drop(be);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The back-end is killed (SIGKILL) while the guest's requests are in flight: Lucid says so
/// for that device, counts it, and does not hang; the guest sees its requests time out.
#[test]
fn dead_back_end_is_reported_and_lucid_goes_on() {
    let img = disk("vu-dead", 16);
    let Some(mut be) = BackEnd::qsd(&img, "vu-dead") else {
        return;
    };
    let stats = tmp("vu-dead-stats.json");
    let mut child = Command::new(env!("CARGO_BIN_EXE_lucid"))
        .args([
            "run",
            "--guest",
            "virtio-blk",
            "--backing",
            "memfd",
            "--blk",
            &format!("vhost_user=on,socket={}", be.socket.display()),
            "--cmdline",
            "op=rw pattern=rand bs=4096 qd=4 count=100000000 timeout_ms=2000",
            "--stats-json",
        ])
        .arg(&stats)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let reader = std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let t0 = Instant::now();
    let mut out = String::new();
    while let Ok(line) = rx.recv_timeout(Duration::from_secs(60)) {
        out += &line;
        out += "\n";
        if line.starts_with("virtio-blk id=") {
            break;
        }
    }
    assert!(
        out.contains("virtio-blk id="),
        "the guest never started: {out}"
    );
    // Requests are flowing; then the back-end dies.
    std::thread::sleep(Duration::from_millis(500));
    be.kill();
    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("Lucid hung after its back-end died: {out}");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    reader.join().unwrap();
    out.extend(rx.try_iter().map(|l| l + "\n"));
    let mut stderr = String::new();
    let _ = std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr);
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&stats).unwrap()).unwrap();
    let _ = std::fs::remove_file(&stats);
    // The guest's requests time out: it says so and exits 1.
    assert_eq!(status.code(), Some(3), "(1 << 1) | 1: {out}\n{stderr}");
    assert!(out.contains("timeout"), "{out}");
    assert!(
        stderr.contains("blk0: the vhost-user back-end closed its socket"),
        "{stderr}"
    );
    assert_eq!(common::counter(&json, "vhost_user.blk0.disconnects"), 1);
    assert_eq!(common::counter(&json, "vhost_user.blk0.connected"), 0);
    assert!(t0.elapsed() < LIMIT);
    drop(be);
    std::fs::remove_file(img).unwrap();
}

/// qemu-storage-daemon is killed (SIGKILL) while the guest does synchronous reads and writes,
/// and a new one starts on the same socket a moment later: Lucid dials it again, replays the
/// set-up with the ring where the guest's completions stand, and the guest's I/O goes on with
/// every checksum right.
#[test]
fn back_end_restarted_mid_run_is_reconnected() {
    let img = disk("vu-recon", 16);
    let Some(be) = BackEnd::qsd(&img, "vu-recon") else {
        return;
    };
    let stats = tmp("vu-recon-stats.json");
    let mut child = Command::new(env!("CARGO_BIN_EXE_lucid"))
        .args([
            "run",
            "--guest",
            "virtio-blk",
            "--backing",
            "memfd",
            "--blk",
            &format!("vhost_user=on,socket={}", be.socket.display()),
            "--cmdline",
            &format!("op=rw pattern=rand bs=4096 qd=1 count={RECONNECT_OPS} verify=1 seed=0x4242 timeout_ms=20000"),
            "--stats-json",
        ])
        .arg(&stats)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let reader = std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let mut out = String::new();
    while let Ok(line) = rx.recv_timeout(Duration::from_secs(60)) {
        out += &line;
        out += "\n";
        if line.starts_with("virtio-blk id=") {
            break;
        }
    }
    assert!(
        out.contains("virtio-blk id="),
        "the guest never started: {out}"
    );
    // Requests are flowing; the back-end dies, and another takes its socket.
    std::thread::sleep(Duration::from_millis(300));
    drop(be);
    std::thread::sleep(Duration::from_millis(300));
    let be = BackEnd::qsd(&img, "vu-recon").unwrap();
    let deadline = Instant::now() + LIMIT;
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("the guest did not finish after the reconnection: {out}");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    reader.join().unwrap();
    out.extend(rx.try_iter().map(|l| l + "\n"));
    let mut stderr = String::new();
    let _ = std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr);
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&stats).unwrap()).unwrap();
    let _ = std::fs::remove_file(&stats);
    assert_eq!(status.code(), Some(1), "(0 << 1) | 1: {out}\n{stderr}");
    assert_eq!(
        field(&out, "virtio-blk op=", "mismatches"),
        Some("0"),
        "{out}"
    );
    assert_eq!(
        field(&out, "virtio-blk op=", "ops"),
        Some(RECONNECT_OPS.to_string().as_str())
    );
    assert!(
        stderr.contains("blk0: reconnected to the vhost-user back-end"),
        "{stderr}"
    );
    let counter = |n: &str| common::counter(&json, &format!("vhost_user.blk0.{n}"));
    assert_eq!(counter("disconnects"), 1, "{stderr}");
    assert_eq!(counter("reconnects"), 1, "{stderr}");
    assert_eq!(counter("reconnect_failures"), 0);
    assert_eq!(counter("connected"), 1);
    assert_eq!(counter("activations"), 1);
    assert_eq!(counter("vrings_set_up"), 2);
    assert_eq!(counter("mem_table_updates"), 2);
    drop(be);
    std::fs::remove_file(img).unwrap();
}

/// The reconnect thread is confined to its own role: the self-test's `socket(AF_UNIX,
/// SOCK_DGRAM)` is not the Unix stream it may make, so it is caught and reported.
#[test]
fn the_reconnect_thread_is_confined() {
    let img = disk("vu-rc-seccomp", 1);
    let Some(be) = BackEnd::qsd(&img, "vu-rc-seccomp") else {
        return;
    };
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_lucid"));
    cmd.args([
        "run",
        "--guest",
        "virtio-blk",
        "--backing",
        "memfd",
        "--blk",
    ])
    .arg(format!("vhost_user=on,socket={}", be.socket.display()))
    .env("LUCID_SECCOMP_SELFTEST", "vhost-user");
    let o = common::run_cmd(cmd, LIMIT);
    assert_eq!(o.status, Some(148), "{}", o.stderr);
    assert!(
        o.stderr.contains(
            "lucid: seccomp: thread lucid-blk0-rc (role vhost-user) made a forbidden system \
             call: socket (41)"
        ),
        "{}",
        o.stderr
    );
    drop(be);
    std::fs::remove_file(img).unwrap();
}

/// Cloud Hypervisor's API: `vm.create` with shared memory, `vm.add-fs` before boot (the
/// virtiofsd share joins the configuration), `vm.boot`; the guest reads the file through it.
#[test]
fn fs_through_the_rest_api() {
    let dir = tmp("vu-rest-share");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("hello.txt"), b"hello from the host\n").unwrap();
    let Some(be) = BackEnd::virtiofsd(&dir, "vu-rest") else {
        return;
    };
    let mut s = rest_client::Server::start("vu-rest");
    let serial = tmp("vu-rest.serial");
    let _ = std::fs::remove_file(&serial);
    let config = json!({
        "payload": {"kernel": "builtin:virtio-fs", "cmdline": "file=hello.txt"},
        "memory": {"size": 64u64 << 20, "shared": true},
        "serial": {"mode": "File", "file": serial},
        "console": {"mode": "Off"},
    });
    assert_eq!(s.curl("PUT", "vm.create", Some(&config)).0, 204);
    let fs = json!({"tag": "share", "socket": be.socket, "id": "share0"});
    assert_eq!(s.curl("PUT", "vm.add-fs", Some(&fs)), (204, String::new()));
    let info = s.json("GET", "vm.info");
    assert_eq!(info["config"]["fs"][0]["tag"], "share", "{info}");
    assert_eq!(s.curl("PUT", "vm.boot", None), (204, String::new()));
    let read = || std::fs::read_to_string(&serial).unwrap_or_default();
    // The serial port writes a byte at a time: wait for the guest's whole line.
    let line_done = || {
        read()
            .split_once("virtio-fs file=")
            .is_some_and(|(_, rest)| rest.contains('\n'))
    };
    assert!(
        rest_client::eventually(line_done),
        "{}\n{}",
        read(),
        s.stderr()
    );
    assert!(
        read().contains("virtio-fs file=hello.txt size=20 read=20"),
        "{}",
        read()
    );
    assert_eq!(s.curl("PUT", "vmm.shutdown", None).0, 200);
    s.wait();
    drop(be);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A "back-end" that answers the first message with garbage, and one that never answers:
/// Lucid refuses the device with an error naming the step (the second within the reply
/// timeout), and does not hang.
#[test]
fn garbage_or_silent_back_end_is_refused() {
    use std::io::{Read, Write};
    use std::os::unix::net::UnixListener;
    for (tag, garbage) in [("vu-garbage", true), ("vu-silent", false)] {
        let socket = tmp(&format!("{tag}.sock"));
        let _ = std::fs::remove_file(&socket);
        let listener = UnixListener::bind(&socket).unwrap();
        let server = std::thread::spawn(move || {
            let (mut c, _) = listener.accept().unwrap();
            let mut hdr = [0u8; 12];
            c.read_exact(&mut hdr).unwrap();
            if garbage {
                let junk: Vec<u8> = (0..64u64).map(|i| (mix64(i) & 0xff) as u8).collect();
                let _ = c.write_all(&junk);
            }
            // Hold the connection until Lucid gives up on it.
            let mut rest = Vec::new();
            let _ = c.read_to_end(&mut rest);
        });
        let t0 = Instant::now();
        let o = common::lucid_plain(
            &[
                "run",
                "--guest",
                "hello",
                "--backing",
                "memfd",
                "--fs",
                &format!("tag=t,socket={}", socket.display()),
            ],
            LIMIT,
        );
        assert_ne!(o.status, Some(0), "{tag}");
        assert!(
            o.stderr.contains("fs0: vhost-user GET_FEATURES failed"),
            "{tag}: {}",
            o.stderr
        );
        assert!(t0.elapsed() < Duration::from_secs(30), "{tag}");
        server.join().unwrap();
        let _ = std::fs::remove_file(&socket);
    }
}

/// The virtio-net guest's round trips through `lucid device-server net`, which reflects every
/// frame: all come back intact, and the server counts each one both ways. The guest keeps its
/// receive ring stocked, so the back-end finds spare buffers after each reflection.
fn net_round_trips(tag: &str, cmdline: &str, event_idx: &str) {
    let out = tmp(&format!("{tag}.vhnet.out"));
    let mut be = BackEnd::net_server(tag, &out);
    let o = lucid(
        &[
            "run",
            "--guest",
            "virtio-net",
            "--net",
            &format!("vhost_user=on,socket={}", be.socket.display()),
            "--backing",
            "memfd",
            "--cmdline",
            cmdline,
        ],
        LIMIT,
    );
    // Without --reconnect the server ends when Lucid, its front-end, goes.
    let status = be.wait(Duration::from_secs(10));
    let summary = std::fs::read_to_string(&out).unwrap_or_default();
    let _ = std::fs::remove_file(&out);
    assert_eq!(
        o.status,
        Some(1),
        "(0 << 1) | 1: {}\n{}",
        o.stdout,
        o.stderr
    );
    assert_eq!(
        field(&o.stdout, "virtio-net detail:", "event_idx"),
        Some(event_idx),
        "{}",
        o.stdout
    );
    assert_eq!(field(&o.stdout, "virtio-net op=", "packets"), Some("1000"));
    assert_eq!(field(&o.stdout, "virtio-net op=", "mismatches"), Some("0"));
    assert_eq!(o.counter("vhost_user.net0.activations"), 1);
    assert_eq!(o.counter("vhost_user.net0.vrings_set_up"), 2);
    assert_eq!(o.counter("vhost_user.net0.errors"), 0);
    assert_eq!(o.counter("vhost_user.net0.disconnects"), 0);
    assert_eq!(status, Some(0), "{summary}");
    let server = "lucid device-server net:";
    for (k, v) in [
        ("stopped", "disconnect"),
        ("frames_tx", "1000"),
        ("frames_rx", "1000"),
        ("drops", "0"),
        ("errors", "0"),
        ("connections", "1"),
    ] {
        assert_eq!(field(&summary, server, k), Some(v), "{k}: {summary}");
    }
}

/// With VIRTIO_RING_F_EVENT_IDX (the guest's default).
#[test]
fn net_from_the_device_server_with_event_idx() {
    net_round_trips(
        "vu-net-evidx",
        "op=rr size=64 count=1000 dst=02:00:00:00:00:42 reflect=1",
        "1",
    );
}

/// Without it: the used ring's flags say when to kick and interrupt.
#[test]
fn net_from_the_device_server_without_event_idx() {
    net_round_trips(
        "vu-net-noevidx",
        "op=rr size=64 count=1000 dst=02:00:00:00:00:42 reflect=1 event_idx=0",
        "0",
    );
}
