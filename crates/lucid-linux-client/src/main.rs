//! `lucid-linux-client`: boots the small Linux kernel (scripts/linux-guest.sh) under Lucid and
//! checks what Linux's own drivers do with Lucid's devices: virtio-pci, virtio_blk (an ext2 root
//! filesystem and a GPT disk), virtio_net (static `ip=`, `netconsole`, ICMP echo), and, where a
//! guest can make system calls, a busybox userspace. Used by `scripts/linux-client.sh` and by the
//! CI test `crates/lucid/tests/linux.rs`; prints, last, one line:
//!
//! `linux-client: init=yes|no rootfs=ok|fail disk2=ok|fail net=ok|fail|skipped
//! [iommu=ok|fail] userspace=ok|fail|skipped seconds=N` (on one line; `iommu=` with `--iommu`)
//!
//! and with `--json FILE` a report with every milestone's time and the counts behind each check,
//! and for a skipped part its reason, typed (`net_skip`, `userspace_skip`) and in words.
//!
//! Each device's check also asks Lucid's counters how its interrupts went: Linux's virtio_pci
//! enabled MSI-X and every interrupt of the device went out as an MSI-X message
//! (`<dev>.irq.irqfd` + `<dev>.irq.msi_signal` > 0, `<dev>.irq.intx` = 0), so a driver that
//! fell back to INTx through the DSDT's `_PRT` fails it; and Linux enumerated one PCI function
//! per device (`pci 0000:00:..: [1af4:1042]` for each disk, `[1af4:1041]` for the NIC).
//!
//! With `--iommu SPEC` (passed to `lucid run --iommu SPEC`) every device sits behind Lucid's
//! VT-d: the boot adds the DMAR and intel-iommu milestones, and the `iommu` check wants them all,
//! no DMA or interrupt fault and translations counted; the report has every `iommu.*` counter.
//!
//! On a host whose KVM is PVM (docs/foundation.md) no guest system call works, so the checks
//! of the first boot need none: the kernel mounts the root filesystem and loads `/sbin/init` (a
//! 124-byte ELF that spins without a system call), reads both GPT headers of the second disk and
//! checks their CRCs, sends its log by `netconsole` to a UDP listener here, and answers ICMP
//! echo from here while init spins. The userspace boot runs only on VT-x/AMD-V hosts.
//!
//! The network part needs root (a network namespace with a tap, made and removed here); without
//! it (`net_skip: "no-root"`), or when the tap cannot be made (`"no-tap"`), or with `--net no`
//! (`"disabled"`), it is skipped with the reason.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

mod devices;
mod hotplug;
mod timed_boot;
use timed_boot::{counter, first, Boot, Line};

const GUEST_IP: &str = "10.0.2.15";
const HOST_IP: &str = "10.0.2.2";
const NETCONSOLE_PORT: u16 = 6666;
const TAP: &str = "lx0";
const ICMP_COUNT: u16 = 5;
/// PCI vendor:device of Linux's enumeration line for a modern virtio-blk and virtio-net function.
const VIRTIO_BLK_ID: &str = "[1af4:1042]";
const VIRTIO_NET_ID: &str = "[1af4:1041]";
const VIRTIO_RNG_ID: &str = "[1af4:1044]";
const VIRTIO_VSOCK_ID: &str = "[1af4:1053]";
const VIRTIO_CONSOLE_ID: &str = "[1af4:1043]";

/// A milestone: a console line that shows a step of the boot.
struct Milestone {
    name: &'static str,
    needle: &'static str,
    /// Which boots print it.
    when: When,
}

#[derive(Clone, Copy, PartialEq)]
enum When {
    Always,
    /// The boot has a NIC.
    Net,
    /// The boot has a vIOMMU (`--iommu`).
    Iommu,
}

/// The first boot's milestones, in boot order. A technique that gives Linux something new to
/// drive adds its line here (with a `When` for its device), and its check in `first_boot`:
/// the vIOMMU's DMAR table and intel-iommu taking the unit (below), a balloon device
/// (`virtio_balloon`, bound by Linux's virtio_balloon).
const MILESTONES: &[Milestone] = &[
    m("Linux version", "Linux version", When::Always),
    m("Lucid's ACPI tables", "ACPI: XSDT", When::Always),
    m(
        "PCI root bridge",
        "PCI host bridge to bus 0000:00",
        When::Always,
    ),
    // With `--iommu vtd`: Linux parses Lucid's DMAR (one DRHD at the contract's base, host
    // address width 48), intel-iommu sets the unit up with queued invalidation, and its init
    // ends with the banner, after which every PCI device's DMA goes through the unit.
    m(
        "DMAR: host address width 48",
        "DMAR: Host address width 48",
        When::Iommu,
    ),
    m(
        "DMAR: DRHD at 0xfed90000",
        "DMAR: DRHD base: 0x000000fed90000",
        When::Iommu,
    ),
    m(
        "DMAR: queued invalidation",
        "DMAR: dmar0: Using Queued invalidation",
        When::Iommu,
    ),
    m(
        "intel-iommu enabled",
        "DMAR: Intel(R) Virtualization Technology for Directed I/O",
        When::Iommu,
    ),
    m("virtio_blk vda", "virtio_blk virtio0: [vda]", When::Always),
    m("GPT of vdb read", " vdb: vdb1 vdb2 vdb3", When::Always),
    m(
        "netconsole",
        "netconsole: network logging started",
        When::Net,
    ),
    m("virtio_net eth0 up", "IP-Config: Complete", When::Net),
    m("ext2 root mounted", "VFS: Mounted root (ext2", When::Always),
    m(
        "Run /sbin/init",
        "Run /sbin/init as init process",
        When::Always,
    ),
];

const fn m(name: &'static str, needle: &'static str, when: When) -> Milestone {
    Milestone { name, needle, when }
}

struct Args {
    kernel: PathBuf,
    lucid: PathBuf,
    rung: String,
    timeout: Duration,
    json: Option<PathBuf>,
    log: Option<PathBuf>,
    userspace: Tristate,
    net: Tristate,
    /// `--iommu SPEC`: passed to `lucid run --iommu SPEC`.
    iommu: Option<String>,
    /// `--hotplug`: the ACPI PCI hotplug check through the REST API instead ([`hotplug`]).
    hotplug: bool,
    /// `--vhost-user`: the root boots from virtiofsd and qemu-storage-daemon ([`devices`]).
    vhost_user: Tristate,
    extra: Vec<String>,
}

#[derive(Clone, Copy, PartialEq)]
enum Tristate {
    Auto,
    Yes,
    No,
}

fn usage() -> ! {
    eprintln!(
        "usage: lucid-linux-client [--kernel VMLINUX] [--lucid PATH] [--rung L0|L1|L2|L3|L4|L4p] \
         [--timeout SECS] [--json FILE] [--log FILE] [--userspace auto|yes|no] \
         [--net auto|yes|no] [--iommu vtd[,mode=..][,pin=..]] [--hotplug] \
         [--vhost-user auto|yes|no] \
         [-- extra lucid run args]"
    );
    std::process::exit(2)
}

fn parse_args() -> Args {
    let repo = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let dir = std::env::var_os("LUCID_LINUX_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo.join("work-linux"));
    let exe_dir = std::env::current_exe()
        .ok()
        .and_then(|p| p.parent().map(Path::to_path_buf))
        .unwrap_or_default();
    let mut a = Args {
        kernel: dir.join("small/vmlinux"),
        lucid: exe_dir.join("lucid"),
        rung: "L1".into(),
        timeout: Duration::from_secs(900),
        json: None,
        log: None,
        userspace: Tristate::Auto,
        net: Tristate::Auto,
        iommu: None,
        hotplug: false,
        vhost_user: Tristate::Auto,
        extra: Vec::new(),
    };
    let mut it = std::env::args().skip(1);
    let tri = |v: Option<String>| match v.as_deref() {
        Some("auto") => Tristate::Auto,
        Some("yes") => Tristate::Yes,
        Some("no") => Tristate::No,
        _ => usage(),
    };
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--kernel" => a.kernel = it.next().unwrap_or_else(|| usage()).into(),
            "--lucid" => a.lucid = it.next().unwrap_or_else(|| usage()).into(),
            "--rung" => a.rung = it.next().unwrap_or_else(|| usage()),
            "--timeout" => {
                let s = it.next().and_then(|s| s.parse().ok());
                a.timeout = Duration::from_secs(s.unwrap_or_else(|| usage()));
            }
            "--json" => a.json = it.next().map(PathBuf::from),
            "--log" => a.log = it.next().map(PathBuf::from),
            "--userspace" => a.userspace = tri(it.next()),
            "--net" => a.net = tri(it.next()),
            "--iommu" => a.iommu = Some(it.next().unwrap_or_else(|| usage())),
            "--hotplug" => a.hotplug = true,
            "--vhost-user" => a.vhost_user = tri(it.next()),
            "--" => a.extra = it.by_ref().collect(),
            _ => usage(),
        }
    }
    a
}

fn main() {
    let args = parse_args();
    if args.hotplug {
        let code = match WorkDir::new().and_then(|w| hotplug::run(&args, &w)) {
            Ok(passed) => i32::from(!passed),
            Err(e) => {
                eprintln!("linux-client: {e}");
                println!("linux-client: hotplug=fail error");
                2
            }
        };
        std::process::exit(code);
    }
    let start = Instant::now();
    let mut report = Report {
        iommu: if args.iommu.is_some() {
            Status::Fail
        } else {
            Status::Skipped
        },
        ..Report::default()
    };
    let code = match run(&args, &mut report) {
        Ok(()) => i32::from(!report.passed()),
        Err(e) => {
            eprintln!("linux-client: {e}");
            report.error = Some(e);
            2
        }
    };
    report.seconds = start.elapsed().as_secs_f64();
    if let Some(path) = &args.json {
        let text = serde_json::to_string_pretty(&report.to_json()).unwrap_or_default();
        if let Err(e) = std::fs::write(path, text) {
            eprintln!("linux-client: writing {}: {e}", path.display());
        }
    }
    println!("{}", report.line());
    std::process::exit(code);
}

#[derive(Default)]
struct Report {
    rung: String,
    backend: String,
    milestones: Vec<(String, Option<f64>)>,
    init: bool,
    rootfs: Status,
    disk2: Status,
    net: Status,
    /// With `--iommu`: `Ok` when Linux parsed the DMAR and intel-iommu took the unit with no DMA
    /// fault; `Skipped` without a vIOMMU.
    iommu: Status,
    net_skip: Option<Skip>,
    icmp_sent: u64,
    icmp_replies: u64,
    icmp_rtt_ms: Vec<f64>,
    netconsole_lines: Vec<String>,
    pci_functions: Vec<String>,
    userspace: Status,
    userspace_skip: Option<Skip>,
    userspace_lines: Vec<String>,
    /// The kernel booted from a virtio-fs root served by virtiofsd.
    virtiofs_root: Status,
    /// The kernel booted from an ext2 root served by qemu-storage-daemon's vhost-user-blk.
    vhost_user_blk: Status,
    /// The kernel booted from an ext2 root on `lucid device-server blk`, assigned over vfio-user.
    assigned_blk: Status,
    /// Linux's virtio_vsock took the device and refused a host connection to an unused port.
    vsock: Status,
    /// Linux's hw_random registered virtio-rng and read from it.
    rng: Status,
    /// Linux's virtio_console took the device as hvc0 and its log reached the console's file.
    console: Status,
    /// Linux's qemu_fw_cfg read the signature, the ID and the file directory.
    fw_cfg: Status,
    /// Why a device check was skipped, by its key in the line.
    devices_skip: Vec<(&'static str, Skip)>,
    vsock_refused: bool,
    counters: Vec<(String, u64)>,
    lucid_exit: Option<i32>,
    lucid_stderr: String,
    console_tail: Vec<String>,
    error: Option<String>,
    seconds: f64,
}

/// Why a part was skipped: a kind that callers decide on (the JSON's `net_skip`,
/// `userspace_skip`), and the words for people (`net_skipped_because`, ...).
#[derive(Clone, Debug)]
struct Skip {
    kind: SkipKind,
    why: String,
}

#[derive(Clone, Copy, PartialEq, Debug)]
enum SkipKind {
    /// `--net no` / `--userspace no`.
    Disabled,
    /// Not root: no network namespace or tap.
    NoRoot,
    /// Root, but the namespace with its tap could not be made.
    NoTap,
    /// A PVM host: no guest system call works, so no userspace.
    Pvm,
    /// No static `/bin/busybox` for the userspace boot.
    NoBusybox,
    /// A back-end program (virtiofsd, qemu-storage-daemon) is not installed.
    NoTool,
    /// The check does not apply to this run (vhost-user devices with `--iommu`).
    NotApplicable,
}

impl SkipKind {
    fn word(self) -> &'static str {
        match self {
            SkipKind::Disabled => "disabled",
            SkipKind::NoRoot => "no-root",
            SkipKind::NoTap => "no-tap",
            SkipKind::Pvm => "pvm",
            SkipKind::NoBusybox => "no-busybox",
            SkipKind::NoTool => "no-tool",
            SkipKind::NotApplicable => "not-applicable",
        }
    }
}

fn skip(kind: SkipKind, why: impl Into<String>) -> Option<Skip> {
    Some(Skip {
        kind,
        why: why.into(),
    })
}

#[derive(Default, Clone, Copy, PartialEq, Debug)]
enum Status {
    #[default]
    Fail,
    Ok,
    Skipped,
}

impl Status {
    fn word(self) -> &'static str {
        match self {
            Status::Fail => "fail",
            Status::Ok => "ok",
            Status::Skipped => "skipped",
        }
    }
    fn from(ok: bool) -> Status {
        if ok {
            Status::Ok
        } else {
            Status::Fail
        }
    }
}

impl Report {
    fn passed(&self) -> bool {
        self.error.is_none()
            && self.init
            && [
                self.rootfs,
                self.disk2,
                self.net,
                self.iommu,
                self.userspace,
                self.virtiofs_root,
                self.vhost_user_blk,
                self.assigned_blk,
                self.vsock,
                self.rng,
                self.console,
                self.fw_cfg,
            ]
            .iter()
            .all(|s| *s != Status::Fail)
    }

    fn line(&self) -> String {
        // `iommu=` only for a boot with a vIOMMU, so the line without one keeps its form.
        let iommu = match self.iommu {
            Status::Skipped => String::new(),
            s => format!(" iommu={}", s.word()),
        };
        format!(
            "linux-client: init={} rootfs={} disk2={} net={}{iommu} userspace={} \
             virtiofs_root={} vhost_user_blk={} assigned_blk={} vsock={} rng={} console={} fw_cfg={} \
             seconds={}",
            if self.init { "yes" } else { "no" },
            self.rootfs.word(),
            self.disk2.word(),
            self.net.word(),
            self.userspace.word(),
            self.virtiofs_root.word(),
            self.vhost_user_blk.word(),
            self.assigned_blk.word(),
            self.vsock.word(),
            self.rng.word(),
            self.console.word(),
            self.fw_cfg.word(),
            self.seconds.round() as u64
        )
    }

    fn to_json(&self) -> Value {
        let milestones: Vec<Value> = self
            .milestones
            .iter()
            .map(|(n, t)| json!({ "name": n, "seconds": t }))
            .collect();
        // Nested by the dotted name, as in Lucid's stats JSON, so `timed_boot::counter` reads
        // both.
        let mut counters = json!({});
        for (name, v) in &self.counters {
            let mut at = &mut counters;
            for part in name.split('.') {
                at = &mut at[part];
            }
            *at = json!(v);
        }
        json!({
            "rung": self.rung,
            "backend": self.backend,
            "milestones": milestones,
            "init": self.init,
            "rootfs": self.rootfs.word(),
            "disk2": self.disk2.word(),
            "net": self.net.word(),
            "iommu": self.iommu.word(),
            "net_skip": self.net_skip.as_ref().map(|s| s.kind.word()),
            "net_skipped_because": self.net_skip.as_ref().map(|s| &s.why),
            "icmp": { "sent": self.icmp_sent, "replies": self.icmp_replies, "rtt_ms": self.icmp_rtt_ms },
            "netconsole_lines": self.netconsole_lines,
            "pci_functions": self.pci_functions,
            "userspace": self.userspace.word(),
            "userspace_skip": self.userspace_skip.as_ref().map(|s| s.kind.word()),
            "userspace_skipped_because": self.userspace_skip.as_ref().map(|s| &s.why),
            "userspace_lines": self.userspace_lines,
            "virtiofs_root": self.virtiofs_root.word(),
            "vhost_user_blk": self.vhost_user_blk.word(),
            "assigned_blk": self.assigned_blk.word(),
            "vsock": self.vsock.word(),
            "vsock_refused": self.vsock_refused,
            "rng": self.rng.word(),
            "console": self.console.word(),
            "fw_cfg": self.fw_cfg.word(),
            "devices_skip": self.devices_skip.iter()
                .map(|(k, s)| (k.to_string(), json!({ "kind": s.kind.word(), "why": s.why })))
                .collect::<serde_json::Map<String, Value>>(),
            "counters": counters,
            "lucid_exit": self.lucid_exit,
            "lucid_stderr": self.lucid_stderr,
            "console_tail": self.console_tail,
            "error": self.error,
            "seconds": self.seconds,
        })
    }
}

fn run(args: &Args, report: &mut Report) -> Result<(), String> {
    if !args.kernel.is_file() {
        return Err(format!(
            "no kernel at {}: run scripts/linux-guest.sh",
            args.kernel.display()
        ));
    }
    if !args.lucid.is_file() {
        return Err(format!(
            "no lucid binary at {} (cargo build --release -p lucid)",
            args.lucid.display()
        ));
    }
    let backend = lucid_hv::detect_backend();
    report.rung = args.rung.clone();
    report.backend = backend.to_string();
    let work = WorkDir::new()?;

    let netns = match args.net {
        Tristate::No => {
            report.net_skip = skip(SkipKind::Disabled, "--net no");
            None
        }
        _ => match NetNs::new() {
            Ok(ns) => Some(ns),
            Err(e) if args.net == Tristate::Auto => {
                report.net_skip = Some(e);
                None
            }
            Err(e) => return Err(e.why),
        },
    };
    if let Some(s) = &report.net_skip {
        eprintln!("linux-client: network checks skipped: {}", s.why);
        report.net = Status::Skipped;
    }

    first_boot(args, &work, netns.as_ref(), report)?;
    let roots = match (args.vhost_user, &args.iommu) {
        (Tristate::No, _) => Some(skip(SkipKind::Disabled, "--vhost-user no")),
        (Tristate::Auto, Some(_)) => Some(skip(
            SkipKind::NotApplicable,
            "vhost-user back-ends map guest memory themselves: not behind the vIOMMU",
        )),
        _ => None,
    };
    match roots {
        Some(why) => {
            let why = why.expect("a reason");
            report.virtiofs_root = Status::Skipped;
            report.vhost_user_blk = Status::Skipped;
            report.devices_skip.push(("virtiofs_root", why.clone()));
            report.devices_skip.push(("vhost_user_blk", why));
        }
        None => {
            devices::virtiofs_root(args, &work, report)?;
            devices::vhost_user_blk_root(args, &work, report)?;
        }
    }
    devices::assigned_blk_root(args, &work, report)?;

    let pvm = backend == lucid_hv::Backend::Pvm;
    match (args.userspace, pvm) {
        (Tristate::No, _) => {
            report.userspace = Status::Skipped;
            report.userspace_skip = skip(SkipKind::Disabled, "--userspace no");
        }
        (Tristate::Auto, true) => {
            let why = "this host's KVM is PVM: a guest's system calls do not reach its kernel \
                       (docs/linux.md), so no Linux userspace runs here";
            eprintln!("linux-client: userspace checks skipped: {why}");
            report.userspace = Status::Skipped;
            report.userspace_skip = skip(SkipKind::Pvm, why);
        }
        _ => userspace_boot(args, &work, netns.as_ref(), report)?,
    }
    Ok(())
}

/// A scratch directory, removed at drop.
struct WorkDir(PathBuf);

impl WorkDir {
    fn new() -> Result<Self, String> {
        let p = std::env::temp_dir().join(format!("lucid-linux-client-{}", std::process::id()));
        std::fs::create_dir_all(&p).map_err(|e| format!("mkdir {}: {e}", p.display()))?;
        Ok(WorkDir(p))
    }
    fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for WorkDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

// ---------------------------------------------------------------------------------------------
// Disk images
// ---------------------------------------------------------------------------------------------

/// A static x86-64 ELF executable whose only code is `pause; jmp .-2`: an init that never makes
/// a system call. 64-byte ELF header, one 56-byte PT_LOAD of the whole file at 0x400000, code.
fn spinning_init() -> Vec<u8> {
    const BASE: u64 = 0x40_0000;
    let code = [0xf3, 0x90, 0xeb, 0xfc];
    let entry_off = 64 + 56;
    let size = (entry_off + code.len()) as u64;
    let mut e = Vec::new();
    e.extend_from_slice(b"\x7fELF\x02\x01\x01\0\0\0\0\0\0\0\0\0");
    e.extend_from_slice(&2u16.to_le_bytes()); // ET_EXEC
    e.extend_from_slice(&0x3eu16.to_le_bytes()); // EM_X86_64
    e.extend_from_slice(&1u32.to_le_bytes());
    e.extend_from_slice(&(BASE + entry_off as u64).to_le_bytes()); // e_entry
    e.extend_from_slice(&64u64.to_le_bytes()); // e_phoff
    e.extend_from_slice(&0u64.to_le_bytes()); // e_shoff
    e.extend_from_slice(&0u32.to_le_bytes()); // e_flags
    for v in [64u16, 56, 1, 64, 0, 0] {
        // ehsize, phentsize, phnum, shentsize, shnum, shstrndx
        e.extend_from_slice(&v.to_le_bytes());
    }
    e.extend_from_slice(&1u32.to_le_bytes()); // PT_LOAD
    e.extend_from_slice(&5u32.to_le_bytes()); // R+X
    for v in [0, BASE, BASE, size, size, 0x1000] {
        // offset, vaddr, paddr, filesz, memsz, align
        e.extend_from_slice(&v.to_le_bytes());
    }
    e.extend_from_slice(&code);
    e
}

/// An ext2 image with `/sbin/init` and the directories Linux mounts on, by `mke2fs -d`.
fn ext2_root(work: &WorkDir) -> Result<PathBuf, String> {
    let root = work.path("root");
    for d in ["sbin", "dev", "proc", "sys"] {
        std::fs::create_dir_all(root.join(d)).map_err(|e| format!("mkdir: {e}"))?;
    }
    let init = root.join("sbin/init");
    std::fs::write(&init, spinning_init()).map_err(|e| format!("write init: {e}"))?;
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&init, std::fs::Permissions::from_mode(0o755))
        .map_err(|e| format!("chmod init: {e}"))?;
    mke2fs(&root, &work.path("root.ext2"))
}

/// An ext2 image of the directory `root` at `img`, 4 MiB, by `mke2fs -d`.
fn mke2fs(root: &Path, img: &Path) -> Result<PathBuf, String> {
    let out = Command::new("mke2fs")
        .args([
            "-F",
            "-q",
            "-t",
            "ext2",
            "-b",
            "1024",
            "-E",
            "root_owner=0:0",
            "-d",
        ])
        .arg(root)
        .arg(img)
        .arg("4M")
        .output()
        .map_err(|e| format!("mke2fs (e2fsprogs): {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "mke2fs failed: {}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(img.to_path_buf())
}

/// CRC-32 (IEEE, reflected), as GPT uses.
fn crc32(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in data {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = (crc >> 1) ^ (0xedb8_8320 & (crc & 1).wrapping_neg());
        }
    }
    !crc
}

/// A 2 MiB disk with a protective MBR and a GPT (primary at LBA 1, backup at the last LBA) of
/// three partitions. Linux lists them (`vdb: vdb1 vdb2 vdb3`) only after reading both headers
/// and their entry arrays and matching every CRC, so the line shows that data came through
/// virtio_blk intact from both ends of the disk.
fn gpt_disk(work: &WorkDir) -> Result<PathBuf, String> {
    const SECTORS: u64 = 4096;
    const ENTRIES: usize = 128;
    const ENTRY_SIZE: usize = 128;
    let mut disk = vec![0u8; (SECTORS * 512) as usize];
    // Protective MBR: one partition of type 0xEE from LBA 1 over the whole disk.
    let pe = &mut disk[446..462];
    pe[1..4].copy_from_slice(&[0, 2, 0]);
    pe[4] = 0xee;
    pe[5..8].copy_from_slice(&[0xff, 0xff, 0xff]);
    pe[8..12].copy_from_slice(&1u32.to_le_bytes());
    pe[12..16].copy_from_slice(&((SECTORS - 1) as u32).to_le_bytes());
    disk[510] = 0x55;
    disk[511] = 0xaa;
    // Linux filesystem data, mixed-endian GUID 0FC63DAF-8483-4772-8E79-3D69D8477DE4.
    let linux_fs = [
        0xaf, 0x3d, 0xc6, 0x0f, 0x83, 0x84, 0x72, 0x47, 0x8e, 0x79, 0x3d, 0x69, 0xd8, 0x47, 0x7d,
        0xe4,
    ];
    let mut entries = vec![0u8; ENTRIES * ENTRY_SIZE];
    for (i, (first, last)) in [(2048u64, 2559u64), (2560, 3071), (3072, SECTORS - 34)]
        .into_iter()
        .enumerate()
    {
        let e = &mut entries[i * ENTRY_SIZE..(i + 1) * ENTRY_SIZE];
        e[..16].copy_from_slice(&linux_fs);
        e[16..32].copy_from_slice(&[
            0x1c,
            0x1d,
            0,
            0,
            0,
            0,
            0,
            0,
            0,
            0,
            0,
            0,
            0,
            0,
            0,
            i as u8 + 1,
        ]);
        e[32..40].copy_from_slice(&first.to_le_bytes());
        e[40..48].copy_from_slice(&last.to_le_bytes());
        for (k, c) in format!("lucid-{}", i + 1).encode_utf16().enumerate() {
            e[56 + 2 * k..58 + 2 * k].copy_from_slice(&c.to_le_bytes());
        }
    }
    let entries_crc = crc32(&entries);
    let header = |my_lba: u64, alt_lba: u64, entries_lba: u64| {
        let mut h = vec![0u8; 92];
        h[..8].copy_from_slice(b"EFI PART");
        h[8..12].copy_from_slice(&0x0001_0000u32.to_le_bytes());
        h[12..16].copy_from_slice(&92u32.to_le_bytes());
        h[24..32].copy_from_slice(&my_lba.to_le_bytes());
        h[32..40].copy_from_slice(&alt_lba.to_le_bytes());
        h[40..48].copy_from_slice(&34u64.to_le_bytes()); // first usable
        h[48..56].copy_from_slice(&(SECTORS - 34).to_le_bytes()); // last usable
        h[56..72].copy_from_slice(b"lucid-gpt-disk!!");
        h[72..80].copy_from_slice(&entries_lba.to_le_bytes());
        h[80..84].copy_from_slice(&(ENTRIES as u32).to_le_bytes());
        h[84..88].copy_from_slice(&(ENTRY_SIZE as u32).to_le_bytes());
        h[88..92].copy_from_slice(&entries_crc.to_le_bytes());
        let crc = crc32(&h);
        h[16..20].copy_from_slice(&crc.to_le_bytes());
        h
    };
    let last = SECTORS - 1;
    let backup_entries = last - 32;
    let put = |disk: &mut Vec<u8>, lba: u64, bytes: &[u8]| {
        let at = (lba * 512) as usize;
        disk[at..at + bytes.len()].copy_from_slice(bytes);
    };
    put(&mut disk, 1, &header(1, last, 2));
    put(&mut disk, 2, &entries);
    put(&mut disk, backup_entries, &entries);
    put(&mut disk, last, &header(last, 1, backup_entries));
    let img = work.path("gpt.img");
    std::fs::write(&img, disk).map_err(|e| format!("write {}: {e}", img.display()))?;
    Ok(img)
}

// ---------------------------------------------------------------------------------------------
// Network namespace with a tap, UDP listener, ICMP echo
// ---------------------------------------------------------------------------------------------

/// A network namespace with a tap `lx0` at 10.0.2.2/24, removed at drop.
struct NetNs {
    name: String,
    fd: File,
}

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("ip (iproute2): {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

impl NetNs {
    /// The namespace, or why not: [`SkipKind::NoRoot`] or [`SkipKind::NoTap`].
    fn new() -> Result<NetNs, Skip> {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            return Err(Skip {
                kind: SkipKind::NoRoot,
                why: "making a network namespace and a tap needs root".into(),
            });
        }
        let name = format!("lucid-lx-{}", std::process::id());
        let _ = ip(&["netns", "del", &name]);
        let no_tap = |e: String| Skip {
            kind: SkipKind::NoTap,
            why: format!("cannot make a tap in a network namespace: {e}"),
        };
        ip(&["netns", "add", &name]).map_err(no_tap)?;
        let ns = |a: &[&str]| {
            let mut v = vec!["netns", "exec", &name, "ip"];
            v.extend_from_slice(a);
            ip(&v)
        };
        let made = ns(&["tuntap", "add", "dev", TAP, "mode", "tap"])
            .and_then(|_| ns(&["addr", "add", &format!("{HOST_IP}/24"), "dev", TAP]))
            .and_then(|_| ns(&["link", "set", TAP, "up"]))
            .and_then(|_| ns(&["link", "set", "lo", "up"]))
            .and_then(|_| {
                File::open(format!("/var/run/netns/{name}")).map_err(|e| format!("netns: {e}"))
            });
        match made {
            Ok(fd) => Ok(NetNs { name, fd }),
            Err(e) => {
                let _ = ip(&["netns", "del", &name]);
                Err(no_tap(e))
            }
        }
    }
}

/// Moves the calling thread into the network namespace of `ns` (an open `/var/run/netns` file).
fn enter_netns(ns: &File) -> Result<(), String> {
    // SAFETY: setns on a namespace fd we hold open; it changes only this thread's namespace.
    if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        return Err(format!("setns: {}", std::io::Error::last_os_error()));
    }
    Ok(())
}

impl Drop for NetNs {
    fn drop(&mut self) {
        let _ = ip(&["netns", "del", &self.name]);
    }
}

/// Collects netconsole's UDP datagrams (one or more log lines each) until `stop`.
fn netconsole_listener(
    ns: &NetNs,
    stop: Arc<AtomicBool>,
    lines: Arc<Mutex<Vec<String>>>,
) -> Result<std::thread::JoinHandle<()>, String> {
    let fd = ns.fd.try_clone().map_err(|e| e.to_string())?;
    let (tx, rx) = mpsc::channel();
    let h = std::thread::spawn(move || {
        let sock = enter_netns(&fd).and_then(|_| {
            std::net::UdpSocket::bind((HOST_IP, NETCONSOLE_PORT)).map_err(|e| e.to_string())
        });
        let sock = match sock {
            Ok(s) => {
                let _ = tx.send(Ok(()));
                s
            }
            Err(e) => {
                let _ = tx.send(Err(e));
                return;
            }
        };
        let _ = sock.set_read_timeout(Some(Duration::from_millis(200)));
        let mut buf = [0u8; 2048];
        while !stop.load(Ordering::Relaxed) {
            if let Ok(n) = sock.recv(&mut buf) {
                let text = String::from_utf8_lossy(&buf[..n]);
                let mut l = lines.lock().unwrap_or_else(|e| e.into_inner());
                l.extend(text.lines().map(|s| s.trim_end().to_string()));
            }
        }
    });
    rx.recv()
        .map_err(|_| "netconsole listener died".to_string())??;
    Ok(h)
}

fn inet_checksum(data: &[u8]) -> u16 {
    let mut sum = 0u32;
    for c in data.chunks(2) {
        let w = u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)]);
        sum += u32::from(w);
    }
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// Sends `count` ICMP echo requests to the guest from inside the namespace (a raw socket, one
/// at a time, up to 5 s each) and returns the round-trip times of the replies.
fn ping_guest(ns: &NetNs, count: u16) -> Result<Vec<f64>, String> {
    let fd = ns.fd.try_clone().map_err(|e| e.to_string())?;
    std::thread::spawn(move || enter_netns(&fd).and_then(|_| ping_here(count)))
        .join()
        .map_err(|_| "ping thread panicked".to_string())?
}

fn ping_here(count: u16) -> Result<Vec<f64>, String> {
    // SAFETY: plain socket(2); the fd is owned by `sock` below.
    let raw = unsafe { libc::socket(libc::AF_INET, libc::SOCK_RAW, libc::IPPROTO_ICMP) };
    if raw < 0 {
        return Err(format!(
            "raw ICMP socket: {}",
            std::io::Error::last_os_error()
        ));
    }
    // SAFETY: `raw` is a fresh descriptor that nothing else owns.
    let sock = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(raw) };
    let tv = libc::timeval {
        tv_sec: 0,
        tv_usec: 200_000,
    };
    // SAFETY: setsockopt with a valid timeval of the size given.
    unsafe {
        libc::setsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            &tv as *const _ as *const libc::c_void,
            std::mem::size_of::<libc::timeval>() as u32,
        )
    };
    let guest: std::net::Ipv4Addr = GUEST_IP.parse().expect("address");
    let dst = libc::sockaddr_in {
        sin_family: libc::AF_INET as u16,
        sin_port: 0,
        sin_addr: libc::in_addr {
            s_addr: u32::from(guest).to_be(),
        },
        sin_zero: [0; 8],
    };
    let id = (std::process::id() & 0xffff) as u16;
    let mut rtts = Vec::new();
    for seq in 1..=count {
        let mut pkt = vec![8u8, 0, 0, 0];
        pkt.extend_from_slice(&id.to_be_bytes());
        pkt.extend_from_slice(&seq.to_be_bytes());
        pkt.extend_from_slice(b"lucid linux-client echo payload.");
        let c = inet_checksum(&pkt);
        pkt[2..4].copy_from_slice(&c.to_be_bytes());
        let sent = Instant::now();
        // SAFETY: sendto with a buffer and a sockaddr_in of the sizes given.
        let n = unsafe {
            libc::sendto(
                sock.as_raw_fd(),
                pkt.as_ptr() as *const libc::c_void,
                pkt.len(),
                0,
                &dst as *const _ as *const libc::sockaddr,
                std::mem::size_of::<libc::sockaddr_in>() as u32,
            )
        };
        if n < 0 {
            return Err(format!("sendto: {}", std::io::Error::last_os_error()));
        }
        while sent.elapsed() < Duration::from_secs(5) {
            let mut buf = [0u8; 1500];
            // SAFETY: recv into a buffer of the size given.
            let n = unsafe {
                libc::recv(
                    sock.as_raw_fd(),
                    buf.as_mut_ptr() as *mut libc::c_void,
                    buf.len(),
                    0,
                )
            };
            if n <= 0 {
                continue;
            }
            let b = &buf[..n as usize];
            let ihl = usize::from(b[0] & 0xf) * 4;
            if b.len() < ihl + 8 || b[12..16] != guest.octets() {
                continue;
            }
            let icmp = &b[ihl..];
            if icmp[0] == 0 && icmp[4..6] == id.to_be_bytes() && icmp[6..8] == seq.to_be_bytes() {
                rtts.push(sent.elapsed().as_secs_f64() * 1000.0);
                break;
            }
        }
    }
    Ok(rtts)
}

fn tail(lines: &[Line], n: usize) -> Vec<String> {
    let from = lines.len().saturating_sub(n);
    lines[from..]
        .iter()
        .map(|l| format!("{:8.1} {}", l.t, l.text))
        .collect()
}

/// `lucid run` arguments: the kernel, 128 MiB, `disks` (path, read-only) in order as vda, vdb,
/// .., a NIC on the tap when `net`, every device on the rung asked for, the vIOMMU when asked
/// for, then the user's extras.
fn run_args(
    args: &Args,
    initrd: Option<&Path>,
    disks: &[(&Path, bool)],
    net: bool,
    cmdline: String,
) -> Vec<String> {
    let rung = &args.rung;
    let mut run: Vec<String> = vec!["--kernel".into(), args.kernel.display().to_string()];
    if let Some(i) = initrd {
        run.extend(["--initrd".into(), i.display().to_string()]);
    }
    run.extend(["--memory".into(), "128".into()]);
    for (path, ro) in disks {
        let ro = if *ro { ",ro=on" } else { "" };
        run.extend([
            "--blk".into(),
            format!("path={}{ro},rung={rung}", path.display()),
        ]);
    }
    if net {
        run.extend(["--net".into(), format!("backend=tap:{TAP},rung={rung}")]);
    }
    if let Some(spec) = &args.iommu {
        run.extend(["--iommu".into(), spec.clone()]);
    }
    run.extend(["--cmdline".into(), cmdline]);
    run.extend(args.extra.iter().cloned());
    run
}

/// Boot 1: ext2 root on vda, GPT disk on vdb, NIC on the tap; no system call anywhere.
fn first_boot(
    args: &Args,
    work: &WorkDir,
    ns: Option<&NetNs>,
    report: &mut Report,
) -> Result<(), String> {
    let root = ext2_root(work)?;
    let gpt = gpt_disk(work)?;
    // hvc0 first: the last `console=` is /dev/console, and that stays the serial port.
    let mut cmdline = String::from(
        "console=hvc0 console=ttyS0 earlyprintk=serial reboot=k panic=-1 root=/dev/vda ro \
         rootfstype=ext2 init=/sbin/init",
    );
    if ns.is_some() {
        cmdline += &format!(
            " ip={GUEST_IP}::{HOST_IP}:255.255.255.0::eth0:off \
             netconsole=@{GUEST_IP}/eth0,{NETCONSOLE_PORT}@{HOST_IP}/"
        );
    }
    let mut run = run_args(
        args,
        None,
        &[(&root, true), (&gpt, true)],
        ns.is_some(),
        cmdline,
    );
    // The devices Linux drives by itself: virtio-rng (hw_random's fill thread reads it) and
    // virtio-vsock (its transport answers a host connection).
    let vsock_socket = work.path("vsock.sock");
    let hvc_log = work.path("hvc0.log");
    run.extend([
        "--console-virtio".into(),
        format!("file:{}", hvc_log.display()),
        "--rng".into(),
        "--vsock".into(),
        format!("cid=3,socket={}", vsock_socket.display()),
    ]);

    let stop = Arc::new(AtomicBool::new(false));
    let netcon = Arc::new(Mutex::new(Vec::new()));
    let listener = match ns {
        Some(ns) => Some(netconsole_listener(ns, stop.clone(), netcon.clone())?),
        None => None,
    };
    let deadline = Instant::now() + args.timeout;
    let mut boot = Boot::start(
        &args.lucid,
        &run,
        ns.map(|n| &n.fd),
        work.path("stats1.json"),
        args.log.as_deref(),
    )?;
    let init_line = "Run /sbin/init as init process";
    let reached = boot.wait_for(deadline, |l| first(l, init_line).is_some());
    let mut rtts = Vec::new();
    if reached {
        match devices::vsock_refused(&vsock_socket) {
            Ok(r) => report.vsock_refused = r,
            Err(e) => eprintln!("linux-client: vsock: {e}"),
        }
        if let Some(ns) = ns {
            // Init spins from here on; the kernel answers from its interrupt handlers.
            std::thread::sleep(Duration::from_secs(1));
            match ping_guest(ns, ICMP_COUNT) {
                Ok(r) => rtts = r,
                Err(e) => eprintln!("linux-client: ping: {e}"),
            }
            // netconsole sends each line as printk makes it; give the last ones a moment.
            let until = Instant::now() + Duration::from_secs(10);
            while Instant::now() < until
                && !netcon
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .iter()
                    .any(|l| l.contains(init_line))
            {
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
    let (code, stderr, lines, stats) = boot.finish();
    stop.store(true, Ordering::Relaxed);
    if let Some(h) = listener {
        let _ = h.join();
    }

    let has_net = ns.is_some();
    let has_iommu = args.iommu.is_some();
    report.milestones = MILESTONES
        .iter()
        .filter(|m| match m.when {
            When::Always => true,
            When::Net => has_net,
            When::Iommu => has_iommu,
        })
        .map(|m| (m.name.to_string(), first(&lines, m.needle)))
        .collect();
    report.init = first(&lines, init_line).is_some();
    let devices: &[&str] = if has_net {
        &["blk0", "blk1", "net0", "rng", "vsock0", "console"]
    } else {
        &["blk0", "blk1", "rng", "vsock0", "console"]
    };
    let mut names: Vec<String> = [
        "blk0.requests",
        "blk0.errors",
        "blk1.requests",
        "blk1.errors",
        "net0.tx_packets",
        "net0.rx_packets",
        "vcpu0.exits",
        "vcpu0.emulated_insns",
        "rng.bytes_written",
        "rng.virtio.activations",
        "vsock0.virtio.activations",
        "vsock.vsock0.rst_received",
        "console.bytes_read",
        "fw_cfg.selects",
        "fw_cfg.reads",
    ]
    .map(String::from)
    .to_vec();
    for dev in devices {
        for n in [
            "irqs",
            "irqs_suppressed",
            "irq.irqfd",
            "irq.msi_signal",
            "irq.intx",
        ] {
            names.push(format!("{dev}.{n}"));
        }
    }
    let c = |n: &str| stats.as_ref().map_or(0, |s| counter(s, n));
    for name in names {
        let v = c(&name);
        report.counters.push((name, v));
    }
    if has_iommu {
        // Every counter the unit registered (`iommu.*`), whatever the model counts.
        if let Some(s) = &stats {
            leaf_counters(&s["counters"]["iommu"], "iommu", &mut report.counters);
        }
    }
    // Every interrupt of the device went out as an MSI-X message (irqfd on L1-L4, signal_msi
    // on L0), and at least one did: its driver enabled MSI-X and did not fall back to INTx.
    let msix_only = |dev: &str| {
        c(&format!("{dev}.irq.irqfd")) + c(&format!("{dev}.irq.msi_signal")) > 0
            && c(&format!("{dev}.irq.intx")) == 0
    };
    // Linux's enumeration: `pci 0000:00:01.0: [1af4:1042] type 00 class 0x010000`.
    report.pci_functions = lines
        .iter()
        .filter_map(|l| l.text.find("pci 0000:").map(|i| &l.text[i + 4..]))
        .filter(|s| s.contains(": [1af4:"))
        .map(|s| s.split(" type").next().unwrap_or(s).to_string())
        .collect();
    let functions = |id: &str| {
        report
            .pci_functions
            .iter()
            .filter(|f| f.contains(id))
            .count()
    };
    let blk_functions = functions(VIRTIO_BLK_ID) == 2;
    report.rootfs = Status::from(
        first(&lines, "VFS: Mounted root (ext2").is_some()
            && report.init
            && blk_functions
            && msix_only("blk0")
            && c("blk0.requests") > 0
            && c("blk0.errors") == 0,
    );
    report.disk2 = Status::from(
        first(&lines, " vdb: vdb1 vdb2 vdb3").is_some()
            && blk_functions
            && msix_only("blk1")
            && c("blk1.errors") == 0,
    );
    report.rng = Status::from(
        functions(VIRTIO_RNG_ID) == 1
            && c("rng.virtio.activations") > 0
            && c("rng.bytes_written") > 0
            && msix_only("rng"),
    );
    report.vsock = Status::from(
        functions(VIRTIO_VSOCK_ID) == 1
            && c("vsock0.virtio.activations") > 0
            && report.vsock_refused
            && c("vsock.vsock0.rst_received") > 0
            && msix_only("vsock0"),
    );
    // hvc0 gets every kernel line printed after it registered (with the serial port preferred
    // and a boot console, 6.1 does not replay the earlier ones to it), init's line among them.
    let hvc = std::fs::read_to_string(&hvc_log).unwrap_or_default();
    report.console = Status::from(
        functions(VIRTIO_CONSOLE_ID) == 1
            && first(&lines, "printk: console [hvc0] enabled").is_some()
            && hvc.contains(init_line)
            && c("console.bytes_read") >= hvc.len() as u64
            && msix_only("console"),
    );
    // qemu_fw_cfg logs nothing when it succeeds: it selected the signature, the ID and the
    // directory (three selects) and read the directory's entries (76 bytes and more).
    report.fw_cfg = Status::from(c("fw_cfg.selects") >= 3 && c("fw_cfg.reads") >= 76);
    report.netconsole_lines = netcon.lock().unwrap_or_else(|e| e.into_inner()).clone();
    if has_net {
        report.icmp_sent = u64::from(ICMP_COUNT);
        report.icmp_replies = rtts.len() as u64;
        report.icmp_rtt_ms = rtts;
        report.net = Status::from(
            first(&lines, "IP-Config: Complete").is_some()
                && report.icmp_replies == report.icmp_sent
                && report
                    .netconsole_lines
                    .iter()
                    .any(|l| l.contains(init_line))
                && c("net0.tx_packets") > 0
                && c("net0.rx_packets") > 0
                && functions(VIRTIO_NET_ID) == 1
                && msix_only("net0"),
        );
    }
    if has_iommu {
        // intel-iommu took the unit (each DMAR milestone), and no DMA or interrupt request was
        // refused: neither the model's fault counters nor Linux's fault handler saw one.
        let iommu_lines = MILESTONES
            .iter()
            .filter(|m| m.when == When::Iommu)
            .all(|m| first(&lines, m.needle).is_some());
        let linux_saw_fault = lines.iter().any(|l| {
            l.text.contains("DMAR: DRHD: handling fault") || l.text.contains("DMAR: [DMA")
        });
        report.iommu = Status::from(
            iommu_lines
                && !linux_saw_fault
                && c("iommu.faults.dma") == 0
                && c("iommu.faults.ir") == 0
                && c("iommu.iotlb.misses") > 0,
        );
    }
    report.lucid_exit = code;
    report.lucid_stderr = stderr;
    report.console_tail = tail(&lines, 25);
    Ok(())
}

/// Flattens the numeric leaves of a stats JSON subtree into dotted names under `prefix`.
fn leaf_counters(v: &Value, prefix: &str, out: &mut Vec<(String, u64)>) {
    match v {
        Value::Object(m) => {
            for (k, v) in m {
                leaf_counters(v, &format!("{prefix}.{k}"), out);
            }
        }
        v => {
            if let Some(n) = v.as_u64() {
                out.push((prefix.to_string(), n));
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Boot 2 (VT-x/AMD-V): busybox userspace
// ---------------------------------------------------------------------------------------------

/// newc cpio archive writer (what the kernel unpacks as an initramfs).
struct Cpio {
    out: Vec<u8>,
    ino: u32,
}

impl Cpio {
    fn new() -> Self {
        Cpio {
            out: Vec::new(),
            ino: 1,
        }
    }
    fn entry(&mut self, name: &str, mode: u32, rdev: (u32, u32), data: &[u8]) {
        let fields = [
            self.ino,
            mode,
            0,
            0,
            1,
            0,
            data.len() as u32,
            0,
            0,
            rdev.0,
            rdev.1,
            name.len() as u32 + 1,
            0,
        ];
        self.ino += 1;
        self.out.extend_from_slice(b"070701");
        for f in fields {
            self.out.extend_from_slice(format!("{f:08x}").as_bytes());
        }
        self.out.extend_from_slice(name.as_bytes());
        self.out.push(0);
        self.pad();
        self.out.extend_from_slice(data);
        self.pad();
    }
    fn pad(&mut self) {
        while self.out.len() & 3 != 0 {
            self.out.push(0);
        }
    }
    fn finish(mut self) -> Vec<u8> {
        self.entry("TRAILER!!!", 0, (0, 0), &[]);
        self.out
    }
}

/// `/init` of the userspace boot: checksums vda, copies it to vdb and checksums the copy read
/// back after dropping vdb's buffers, pings the host through eth0, and powers off.
const USERSPACE_INIT: &str = r#"#!/bin/busybox sh
B=/bin/busybox
$B mount -t proc proc /proc
$B mount -t sysfs sysfs /sys
$B mount -t devtmpfs devtmpfs /dev
echo "lucid-userspace: up"
echo "lucid-userspace: vda sha256 $($B sha256sum /dev/vda | $B cut -d' ' -f1)"
$B dd if=/dev/vda of=/dev/vdb bs=64k conv=fsync 2>/dev/null
$B blockdev --flushbufs /dev/vdb
echo "lucid-userspace: vdb sha256 $($B sha256sum /dev/vdb | $B cut -d' ' -f1)"
$B ip link set eth0 up
$B ip addr add GUEST/24 dev eth0
$B ping -c 3 -W 5 HOST | $B grep 'packets transmitted' | $B sed 's/^/lucid-userspace: ping /'
echo "lucid-userspace: done"
$B poweroff -f
$B reboot -f
"#;

fn is_static_elf(path: &Path) -> bool {
    // No PT_INTERP (type 3) among the program headers.
    let Ok(b) = std::fs::read(path) else {
        return false;
    };
    if b.len() < 64 || &b[..4] != b"\x7fELF" || b[4] != 2 {
        return false;
    }
    let u16at = |o: usize| u16::from_le_bytes([b[o], b[o + 1]]) as usize;
    let phoff = u64::from_le_bytes(b[32..40].try_into().unwrap_or_default()) as usize;
    let (phentsize, phnum) = (u16at(54), u16at(56));
    (0..phnum).all(|i| {
        let o = phoff + i * phentsize;
        o + 4 <= b.len() && u32::from_le_bytes(b[o..o + 4].try_into().unwrap_or_default()) != 3
    })
}

fn sha256_of(path: &Path) -> Result<String, String> {
    let out = Command::new("sha256sum")
        .arg(path)
        .output()
        .map_err(|e| format!("sha256sum: {e}"))?;
    let s = String::from_utf8_lossy(&out.stdout);
    s.split_whitespace()
        .next()
        .map(str::to_string)
        .ok_or_else(|| "sha256sum printed nothing".into())
}

fn userspace_boot(
    args: &Args,
    work: &WorkDir,
    ns: Option<&NetNs>,
    report: &mut Report,
) -> Result<(), String> {
    let busybox = Path::new("/bin/busybox");
    if !is_static_elf(busybox) {
        report.userspace = Status::Skipped;
        report.userspace_skip = skip(
            SkipKind::NoBusybox,
            "no static /bin/busybox (apt-get install busybox-static)",
        );
        return Ok(());
    }
    let bb = std::fs::read(busybox).map_err(|e| format!("{}: {e}", busybox.display()))?;
    let init = USERSPACE_INIT
        .replace("GUEST", GUEST_IP)
        .replace("HOST", HOST_IP);
    let mut cpio = Cpio::new();
    for d in ["bin", "dev", "proc", "sys"] {
        cpio.entry(d, 0o040755, (0, 0), &[]);
    }
    cpio.entry("dev/console", 0o020600, (5, 1), &[]);
    cpio.entry("bin/busybox", 0o100755, (0, 0), &bb);
    cpio.entry("init", 0o100755, (0, 0), init.as_bytes());
    let initrd = work.path("userspace.cpio");
    std::fs::write(&initrd, cpio.finish()).map_err(|e| format!("initramfs: {e}"))?;
    // 1 MiB of a known pattern, and as much scratch space.
    let data: Vec<u8> = (0..1u32 << 20)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    let vda = work.path("data.img");
    let vdb = work.path("scratch.img");
    std::fs::write(&vda, &data).map_err(|e| format!("data disk: {e}"))?;
    std::fs::write(&vdb, vec![0u8; data.len()]).map_err(|e| format!("scratch disk: {e}"))?;
    let want = sha256_of(&vda)?;
    let cmdline = "console=ttyS0 earlyprintk=serial reboot=k panic=-1 rdinit=/init".to_string();
    let disks = [(vda.as_path(), true), (vdb.as_path(), false)];
    let run = run_args(args, Some(&initrd), &disks, ns.is_some(), cmdline);
    let log = args.log.as_ref().map(|p| p.with_extension("userspace.log"));
    let mut boot = Boot::start(
        &args.lucid,
        &run,
        ns.map(|n| &n.fd),
        work.path("stats2.json"),
        log.as_deref(),
    )?;
    boot.wait_for(Instant::now() + args.timeout, |l| {
        first(l, "lucid-userspace: done").is_some()
    });
    // It powers off by itself; a little time for that before SIGTERM.
    boot.wait_for(Instant::now() + Duration::from_secs(10), |_| false);
    let (_code, _stderr, lines, _stats) = boot.finish();
    report.userspace_lines = lines
        .iter()
        .filter(|l| l.text.starts_with("lucid-userspace:"))
        .map(|l| l.text.clone())
        .collect();
    let said = |s: &str| report.userspace_lines.iter().any(|l| l.contains(s));
    let disks = said(&format!("vda sha256 {want}")) && said(&format!("vdb sha256 {want}"));
    let net = ns.is_none() || said("3 packets transmitted, 3 packets received");
    report.userspace = Status::from(said("lucid-userspace: done") && disks && net);
    if report.userspace == Status::Fail {
        report.console_tail.extend(tail(&lines, 25));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32_matches_the_standard_check_value() {
        assert_eq!(crc32(b"123456789"), 0xcbf4_3926);
    }

    #[test]
    fn spinning_init_is_a_static_elf_entering_its_loop() {
        let e = spinning_init();
        assert_eq!(e.len(), 124);
        assert_eq!(&e[..4], b"\x7fELF");
        assert_eq!(
            u64::from_le_bytes(e[24..32].try_into().unwrap()),
            0x40_0000 + 120
        );
        assert_eq!(&e[120..], &[0xf3, 0x90, 0xeb, 0xfc]);
        let dir = std::env::temp_dir().join(format!("lucid-lc-test-{}", std::process::id()));
        std::fs::write(&dir, &e).unwrap();
        assert!(is_static_elf(&dir));
        std::fs::remove_file(&dir).unwrap();
    }

    #[test]
    fn gpt_headers_carry_valid_crcs_at_both_ends() {
        let w = WorkDir::new().unwrap();
        let d = std::fs::read(gpt_disk(&w).unwrap()).unwrap();
        for lba in [1usize, 4095] {
            let h = &d[lba * 512..lba * 512 + 92];
            assert_eq!(&h[..8], b"EFI PART");
            let mut z = h.to_vec();
            z[16..20].fill(0);
            assert_eq!(crc32(&z).to_le_bytes(), h[16..20]);
            let entries_lba = u64::from_le_bytes(h[72..80].try_into().unwrap()) as usize;
            let entries = &d[entries_lba * 512..entries_lba * 512 + 128 * 128];
            assert_eq!(crc32(entries).to_le_bytes(), h[88..92]);
        }
    }

    #[test]
    fn cpio_entries_are_newc_and_aligned() {
        let mut c = Cpio::new();
        c.entry("init", 0o100755, (0, 0), b"#!/bin/sh\n");
        let out = c.finish();
        assert_eq!(&out[..6], b"070701");
        assert_eq!(out.len() % 4, 0);
        assert!(out.windows(10).any(|w| w == b"TRAILER!!!"));
    }

    #[test]
    fn report_line_has_the_documented_form() {
        let r = Report {
            init: true,
            rootfs: Status::Ok,
            disk2: Status::Fail,
            net: Status::Skipped,
            iommu: Status::Skipped,
            userspace: Status::Skipped,
            seconds: 131.4,
            ..Report::default()
        };
        assert_eq!(
            r.line(),
            "linux-client: init=yes rootfs=ok disk2=fail net=skipped userspace=skipped \
             virtiofs_root=fail vhost_user_blk=fail assigned_blk=fail vsock=fail rng=fail \
             console=fail fw_cfg=fail seconds=131"
        );
        assert!(!r.passed(), "a failed GPT check fails the run");
        let r = Report {
            iommu: Status::Ok,
            ..r
        };
        assert!(r
            .line()
            .contains(" net=skipped iommu=ok userspace=skipped "));
    }

    #[test]
    fn report_json_nests_counters_and_types_skips() {
        let r = Report {
            counters: vec![("blk0.irq.irqfd".into(), 9), ("blk0.requests".into(), 7)],
            net_skip: skip(
                SkipKind::NoTap,
                "cannot make a tap in a network namespace: x",
            ),
            ..Report::default()
        };
        let j = r.to_json();
        assert_eq!(counter(&j, "blk0.irq.irqfd"), 9);
        assert_eq!(counter(&j, "blk0.requests"), 7);
        assert_eq!(counter(&j, "blk1.requests"), 0);
        assert_eq!(j["net_skip"], "no-tap");
        assert_eq!(j["userspace_skip"], Value::Null);
    }

    #[test]
    fn iommu_counters_are_taken_whole_and_nest_back() {
        let stats = json!({ "counters": { "iommu": {
            "inv": { "wait": 834, "iotlb_page": 824 },
            "maps": 629,
            "sidecore": { "cpu_ns": { "total": 5 } },
        } } });
        let mut counters = Vec::new();
        leaf_counters(&stats["counters"]["iommu"], "iommu", &mut counters);
        assert_eq!(counters.len(), 4);
        let r = Report {
            counters,
            ..Report::default()
        };
        let j = r.to_json();
        assert_eq!(counter(&j, "iommu.inv.wait"), 834);
        assert_eq!(counter(&j, "iommu.inv.iotlb_page"), 824);
        assert_eq!(counter(&j, "iommu.maps"), 629);
        assert_eq!(counter(&j, "iommu.sidecore.cpu_ns"), 5);
    }
}
