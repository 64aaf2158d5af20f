//! The orchestrator's devices, checked by what Linux's kernel does with them by itself:
//!
//! - **rng**: Linux's `hw_random` registers virtio-rng and its fill thread reads it (the device's
//!   bytes counter grows);
//! - **vsock**: Linux's `virtio_vsock` takes the device; a host program's `CONNECT 1234` through
//!   Lucid's hybrid socket reaches the guest kernel, which has no listener there and answers with
//!   a reset, so the host connection closes without `OK`;
//! - **virtiofs_root**: the kernel mounts its root (`rootfstype=virtiofs`) from a host directory
//!   served by the distribution's `virtiofsd` over vhost-user, and runs `/sbin/init` from it;
//! - **vhost_user_blk**: the kernel mounts its ext2 root from a disk served by
//!   `qemu-storage-daemon` over vhost-user-blk, and runs `/sbin/init` from it.
//! - **assigned_blk**: the same from `lucid device-server blk`, a virtio-blk PCI function in its
//!   own process assigned over vfio-user (also behind the vIOMMU).
//!
//! In both root boots `/sbin/init` is [`checking_init`]: it hashes 64 KiB of its own file as the
//! kernel mapped it and stops on `int3` when the hash matches and on `ud2` when it does not, so
//! the kernel's "Attempted to kill init! exitcode=0x00000005" (SIGTRAP) says every byte came
//! through the device intact, and 0x00000004 (SIGILL) says one did not. No system call is
//! needed, so this works on a PVM host too.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::timed_boot::{counter, first, Boot, Line};
use crate::{Args, Report, Skip, SkipKind, Status, WorkDir};

/// Where the distribution's virtiofsd lives (Debian's qemu-system-common).
const VIRTIOFSD: &str = "/usr/lib/qemu/virtiofsd";
const QSD: &str = "qemu-storage-daemon";
/// The virtio-fs tag the root is mounted by.
const FS_TAG: &str = "lucidroot";
/// The guest port the vsock check connects to: nothing listens there.
const VSOCK_PORT: u32 = 1234;
/// PCI vendor:device of Linux's enumeration line for a modern virtio-fs function.
const VIRTIO_FS_ID: &str = "[1af4:105a]";
/// The bytes of its own file that [`checking_init`] hashes.
const INIT_PAYLOAD: usize = 64 << 10;
/// What the kernel prints when the checking init's hash matched (SIGTRAP) or did not (SIGILL).
const INIT_MATCHED: &str = "Attempted to kill init! exitcode=0x00000005";
const INIT_MISMATCHED: &str = "Attempted to kill init! exitcode=0x00000004";

/// FNV-1a, 64-bit: what [`checking_init`]'s code computes.
fn fnv1a(data: &[u8]) -> u64 {
    data.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    })
}

/// A static x86-64 ELF whose code hashes [`INIT_PAYLOAD`] bytes of a pattern stored in the file
/// and executes `int3` when the hash is the one computed here, `ud2` otherwise. One PT_LOAD maps
/// the whole file at 0x400000; the code starts at 120 and the pattern at 256.
pub fn checking_init() -> Vec<u8> {
    const BASE: u64 = 0x40_0000;
    const CODE_OFF: u64 = 120;
    const PAYLOAD_OFF: usize = 256;
    let payload: Vec<u8> = (0..INIT_PAYLOAD as u64)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    let mut code = Vec::new();
    code.extend_from_slice(&[0x48, 0xbe]); // movabs rsi, payload
    code.extend_from_slice(&(BASE + PAYLOAD_OFF as u64).to_le_bytes());
    code.push(0xb9); // mov ecx, len
    code.extend_from_slice(&(INIT_PAYLOAD as u32).to_le_bytes());
    code.extend_from_slice(&[0x48, 0xb8]); // movabs rax, FNV offset basis
    code.extend_from_slice(&0xcbf2_9ce4_8422_2325u64.to_le_bytes());
    code.extend_from_slice(&[0x48, 0xbf]); // movabs rdi, FNV prime
    code.extend_from_slice(&0x100_0000_01b3u64.to_le_bytes());
    code.extend_from_slice(&[
        0x0f, 0xb6, 0x16, // 1: movzx edx, byte [rsi]
        0x48, 0x31, 0xd0, // xor rax, rdx
        0x48, 0x0f, 0xaf, 0xc7, // imul rax, rdi
        0x48, 0xff, 0xc6, // inc rsi
        0xff, 0xc9, // dec ecx
        0x75, 0xef, // jnz 1b
        0x48, 0xba, // movabs rdx, expected
    ]);
    code.extend_from_slice(&fnv1a(&payload).to_le_bytes());
    code.extend_from_slice(&[
        0x48, 0x39, 0xd0, // cmp rax, rdx
        0x75, 0x01, // jne 2f
        0xcc, // int3
        0x0f, 0x0b, // 2: ud2
    ]);
    let size = (PAYLOAD_OFF + INIT_PAYLOAD) as u64;
    let mut e = Vec::new();
    e.extend_from_slice(b"\x7fELF\x02\x01\x01\0\0\0\0\0\0\0\0\0");
    e.extend_from_slice(&2u16.to_le_bytes()); // ET_EXEC
    e.extend_from_slice(&0x3eu16.to_le_bytes()); // EM_X86_64
    e.extend_from_slice(&1u32.to_le_bytes());
    e.extend_from_slice(&(BASE + CODE_OFF).to_le_bytes()); // e_entry
    e.extend_from_slice(&64u64.to_le_bytes()); // e_phoff
    e.extend_from_slice(&0u64.to_le_bytes()); // e_shoff
    e.extend_from_slice(&0u32.to_le_bytes()); // e_flags
    for v in [64u16, 56, 1, 64, 0, 0] {
        e.extend_from_slice(&v.to_le_bytes());
    }
    e.extend_from_slice(&1u32.to_le_bytes()); // PT_LOAD
    e.extend_from_slice(&5u32.to_le_bytes()); // R+X
    for v in [0, BASE, BASE, size, size, 0x1000] {
        e.extend_from_slice(&v.to_le_bytes());
    }
    e.extend_from_slice(&code);
    e.resize(PAYLOAD_OFF, 0);
    e.extend_from_slice(&payload);
    e
}

/// A root directory with the checking init and the directories Linux mounts on.
fn root_dir(work: &WorkDir, name: &str) -> Result<PathBuf, String> {
    let root = work.path(name);
    for d in ["sbin", "dev", "proc", "sys"] {
        std::fs::create_dir_all(root.join(d)).map_err(|e| format!("mkdir: {e}"))?;
    }
    let init = root.join("sbin/init");
    std::fs::write(&init, checking_init()).map_err(|e| format!("write init: {e}"))?;
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&init, std::fs::Permissions::from_mode(0o755))
        .map_err(|e| format!("chmod init: {e}"))?;
    Ok(root)
}

/// A back-end process (virtiofsd, qemu-storage-daemon), killed and reaped at drop.
struct Backend {
    child: Child,
}

impl Backend {
    /// Starts `cmd` and waits up to 10 s for it to create `socket`.
    fn start(name: &'static str, mut cmd: Command, socket: &Path) -> Result<Backend, String> {
        let child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| format!("{name}: {e}"))?;
        let mut b = Backend { child };
        let deadline = Instant::now() + Duration::from_secs(10);
        while !socket.exists() {
            if let Ok(Some(s)) = b.child.try_wait() {
                let mut err = String::new();
                if let Some(mut e) = b.child.stderr.take() {
                    let _ = e.read_to_string(&mut err);
                }
                return Err(format!("{name} exited ({s}): {}", err.trim()));
            }
            if Instant::now() > deadline {
                return Err(format!("{name} made no socket at {}", socket.display()));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(b)
    }
}

impl Drop for Backend {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn tool_missing(tool: &str) -> bool {
    if tool.contains('/') {
        return !Path::new(tool).is_file();
    }
    Command::new(tool)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_err()
}

/// `lucid run` arguments of a root boot: the kernel, 128 MiB of shared memory (vhost-user maps
/// it into the back-end), the console, then `devices`, then the user's extras.
fn root_boot_args(args: &Args, cmdline: &str, devices: &[String]) -> Vec<String> {
    let mut run: Vec<String> = vec![
        "--kernel".into(),
        args.kernel.display().to_string(),
        "--memory".into(),
        "128".into(),
        "--backing".into(),
        "memfd".into(),
        "--cmdline".into(),
        format!("console=ttyS0 earlyprintk=serial reboot=k panic=-1 init=/sbin/init {cmdline}"),
    ];
    run.extend(devices.iter().cloned());
    run.extend(args.extra.iter().cloned());
    run
}

/// What a root boot showed.
struct RootBoot {
    lines: Vec<Line>,
    stats: Option<serde_json::Value>,
}

impl RootBoot {
    fn run(args: &Args, work: &WorkDir, tag: &str, run: &[String]) -> Result<RootBoot, String> {
        let log = args
            .log
            .as_ref()
            .map(|p| p.with_extension(format!("{tag}.log")));
        let mut boot = Boot::start(
            &args.lucid,
            run,
            None,
            work.path(&format!("stats-{tag}.json")),
            log.as_deref(),
        )?;
        boot.wait_for(Instant::now() + args.timeout, |l| {
            first(l, "Attempted to kill init!").is_some()
        });
        let (_code, _stderr, lines, stats) = boot.finish();
        Ok(RootBoot { lines, stats })
    }

    /// The root was mounted with `fstype`, init ran, and its hash of its own file matched.
    fn init_verified(&self, fstype: &str) -> bool {
        first(
            &self.lines,
            &format!("VFS: Mounted root ({fstype} filesystem)"),
        )
        .is_some()
            && first(&self.lines, "Run /sbin/init as init process").is_some()
            && first(&self.lines, INIT_MATCHED).is_some()
            && first(&self.lines, INIT_MISMATCHED).is_none()
    }

    fn counter(&self, name: &str) -> u64 {
        self.stats.as_ref().map_or(0, |s| counter(s, name))
    }
}

/// Boot 3: the root from a host directory through virtiofsd.
pub fn virtiofs_root(args: &Args, work: &WorkDir, report: &mut Report) -> Result<(), String> {
    if tool_missing(VIRTIOFSD) {
        report.virtiofs_root = Status::Skipped;
        report.devices_skip.push((
            "virtiofs_root",
            skip_missing(VIRTIOFSD, "qemu-system-common"),
        ));
        return Ok(());
    }
    let root = root_dir(work, "fsroot")?;
    let socket = work.path("virtiofsd.sock");
    let mut cmd = Command::new(VIRTIOFSD);
    cmd.arg(format!("--socket-path={}", socket.display()))
        .args(["-o", &format!("source={}", root.display())])
        .args(["-o", "cache=none", "-o", "sandbox=chroot"]);
    let _fsd = Backend::start("virtiofsd", cmd, &socket)?;
    let run = root_boot_args(
        args,
        &format!("rootfstype=virtiofs root={FS_TAG} ro"),
        &[
            "--fs".into(),
            format!("tag={FS_TAG},socket={}", socket.display()),
        ],
    );
    let b = RootBoot::run(args, work, "virtiofs", &run)?;
    report.virtiofs_root = Status::from(
        b.init_verified("virtiofs")
            && b.lines.iter().any(|l| l.text.contains(VIRTIO_FS_ID))
            && b.counter("fs0.virtio.activations") > 0,
    );
    if report.virtiofs_root == Status::Fail {
        report.console_tail.extend(crate::tail(&b.lines, 25));
    }
    Ok(())
}

/// Boot 4: an ext2 root from qemu-storage-daemon's vhost-user-blk export.
pub fn vhost_user_blk_root(args: &Args, work: &WorkDir, report: &mut Report) -> Result<(), String> {
    if tool_missing(QSD) {
        report.vhost_user_blk = Status::Skipped;
        report
            .devices_skip
            .push(("vhost_user_blk", skip_missing(QSD, "qemu-system-common")));
        return Ok(());
    }
    let root = root_dir(work, "blkroot")?;
    let img = crate::mke2fs(&root, &work.path("blkroot.ext2"))?;
    let socket = work.path("qsd.sock");
    let mut cmd = Command::new(QSD);
    cmd.arg("--blockdev")
        .arg(format!(
            "driver=file,node-name=root,filename={}",
            img.display()
        ))
        .arg("--export")
        .arg(format!(
            "type=vhost-user-blk,id=root,node-name=root,addr.type=unix,addr.path={},writable=off",
            socket.display()
        ));
    let _qsd = Backend::start("qemu-storage-daemon", cmd, &socket)?;
    let run = root_boot_args(
        args,
        "root=/dev/vda ro rootfstype=ext2",
        &[
            "--blk".into(),
            format!("vhost_user=on,socket={}", socket.display()),
        ],
    );
    let b = RootBoot::run(args, work, "vhost-user-blk", &run)?;
    report.vhost_user_blk = Status::from(
        b.init_verified("ext2")
            && b.lines
                .iter()
                .any(|l| l.text.contains(crate::VIRTIO_BLK_ID))
            && b.counter("blk0.virtio.activations") > 0,
    );
    if report.vhost_user_blk == Status::Fail {
        report.console_tail.extend(crate::tail(&b.lines, 25));
    }
    Ok(())
}

/// Boot 5: an ext2 root from `lucid device-server blk`, a virtio-blk function in its own
/// process assigned over vfio-user (behind the vIOMMU with `--iommu`: Linux's intel-iommu maps
/// its DMA, and the device process gets exactly those mappings).
pub fn assigned_blk_root(args: &Args, work: &WorkDir, report: &mut Report) -> Result<(), String> {
    let root = root_dir(work, "assignedroot")?;
    let img = crate::mke2fs(&root, &work.path("assignedroot.ext2"))?;
    let socket = work.path("assigned-blk.sock");
    let mut cmd = Command::new(&args.lucid);
    cmd.args(["device-server", "blk", "--readonly", "--socket"])
        .arg(&socket)
        .arg("--disk")
        .arg(&img);
    let _server = Backend::start("lucid device-server blk", cmd, &socket)?;
    let mut devices = vec![
        "--user-device".into(),
        format!("socket={},id=vblk", socket.display()),
    ];
    if let Some(spec) = &args.iommu {
        devices.extend(["--iommu".into(), spec.clone()]);
    }
    let run = root_boot_args(args, "root=/dev/vda ro rootfstype=ext2", &devices);
    let b = RootBoot::run(args, work, "assigned-blk", &run)?;
    report.assigned_blk = Status::from(
        b.init_verified("ext2")
            && b.lines
                .iter()
                .any(|l| l.text.contains(crate::VIRTIO_BLK_ID))
            && b.counter("user_device.vblk.region_writes") > 0
            && b.counter("user_device.vblk.failed") == 0
            && b.counter("iommu.faults.dma") == 0,
    );
    if report.assigned_blk == Status::Fail {
        report.console_tail.extend(crate::tail(&b.lines, 25));
    }
    Ok(())
}

fn skip_missing(tool: &str, package: &str) -> Skip {
    Skip {
        kind: SkipKind::NoTool,
        why: format!("no {tool} (apt-get install {package})"),
    }
}

/// The host side of the vsock check: `CONNECT` to a guest port nothing listens on. `Ok(true)`
/// when the guest refused it (the connection closed without `OK`), `Ok(false)` when it was
/// accepted or nothing came back within 10 s.
pub fn vsock_refused(socket: &Path) -> Result<bool, String> {
    let mut s = UnixStream::connect(socket).map_err(|e| format!("{}: {e}", socket.display()))?;
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .map_err(|e| e.to_string())?;
    s.write_all(format!("CONNECT {VSOCK_PORT}\n").as_bytes())
        .map_err(|e| format!("vsock CONNECT: {e}"))?;
    let mut buf = [0u8; 64];
    match s.read(&mut buf) {
        Ok(0) => Ok(true),
        Ok(_) => Ok(false),
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => Ok(true),
        Err(_) => Ok(false),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checking_init_embeds_the_hash_of_its_payload() {
        let e = checking_init();
        assert_eq!(e.len(), 256 + INIT_PAYLOAD);
        assert_eq!(
            u64::from_le_bytes(e[24..32].try_into().unwrap()),
            0x40_0000 + 120
        );
        // movabs rdx, expected: the 8 bytes after `48 ba`.
        let at = e[120..256]
            .windows(2)
            .position(|w| w == [0x48, 0xba])
            .unwrap()
            + 122;
        let want = u64::from_le_bytes(e[at..at + 8].try_into().unwrap());
        assert_eq!(want, fnv1a(&e[256..]));
        assert_eq!(
            &e[at + 8..at + 16],
            &[0x48, 0x39, 0xd0, 0x75, 0x01, 0xcc, 0x0f, 0x0b]
        );
    }

    #[test]
    fn fnv1a_matches_the_reference_values() {
        assert_eq!(fnv1a(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a(b"a"), 0xaf63_dc4c_8601_ec8c);
    }
}
