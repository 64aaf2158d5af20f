//! Booting real Linux kernels built or fetched by `scripts/linux-guest.sh` into `work-linux/`:
//! Debian's cloud kernel (ELF `vmlinux` through PVH) with a busybox initramfs, and the small
//! kernel (`work-linux/small/vmlinux`) whose own drivers drive Lucid's devices, checked through
//! `lucid-linux-client` (crates/lucid-linux-client), which must be built beside this `lucid`
//! (`cargo build --workspace --release`, as scripts/test.sh does, for the release tests).
//!
//! On a host whose KVM emulates guest kernel code (PVM, docs/foundation.md) Linux runs about
//! a thousand times slower than native: these tests look for boot milestones on the serial
//! console within a time limit, then stop Lucid with SIGTERM.
//!
//! Without the artifacts the tests print `skipped: ...` and pass, unless `LUCID_REQUIRE_LINUX=1`,
//! which makes a missing artifact a failure (CI sets it after running the script). With it (or
//! `CI`) set, a root run that cannot make the tap for the network checks fails too.
//! `LUCID_LINUX_DIR` overrides the artifact directory.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Milestones in boot order: (name, text that first shows it on the console).
const MILESTONES: &[(&str, &str)] = &[
    ("Linux version", "Linux version"),
    ("e820 map", "BIOS-e820:"),
    ("Lucid's ACPI tables (OEM LUCID)", "LUCID"),
    (
        "Booting paravirtualized kernel",
        "Booting paravirtualized kernel",
    ),
    ("setup_percpu", "setup_percpu:"),
    ("Memory:", "Memory: "),
    ("RCU", "rcu: "),
    ("ACPI: Core revision", "ACPI: Core revision"),
    ("console [ttyS0] enabled", "printk: console [ttyS0] enabled"),
    ("x2apic", "x2apic enabled"),
    ("FPU (then the int3 self-test)", "x86/fpu: x87 FPU will use"),
    ("alternatives applied", "Freeing SMP alternatives memory"),
    ("smp: Brought up", "smp: Brought up"),
    ("devtmpfs", "devtmpfs: initialized"),
    ("clocksource kvm-clock", "Switched to clocksource"),
    ("initramfs unpacked", "Trying to unpack rootfs"),
    ("serial driver (ttyS0 at I/O)", "ttyS0 at I/O"),
    ("Freeing unused kernel image", "Freeing unused kernel image"),
    ("Run /init", "Run /init"),
    (
        "userspace (initramfs /init)",
        "lucid-initramfs: userspace reached",
    ),
];

/// `LUCID_REQUIRE_LINUX` is set (to anything but empty or 0): what would be skipped fails.
fn linux_required() -> bool {
    std::env::var("LUCID_REQUIRE_LINUX").is_ok_and(|v| !v.is_empty() && v != "0")
}

/// Skips (prints `skipped: MSG` on stderr, the caller returns) or, with `LUCID_REQUIRE_LINUX`,
/// fails.
fn skip_unless_required(msg: &str) {
    if linux_required() {
        panic!("{msg} (LUCID_REQUIRE_LINUX is set)");
    }
    eprintln!("skipped: {msg}");
}

fn artifacts_dir() -> PathBuf {
    match std::env::var_os("LUCID_LINUX_DIR") {
        Some(d) => PathBuf::from(d),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../work-linux"),
    }
}

/// The kernel and initramfs, or None (after printing why) when the test should be skipped.
fn artifacts() -> Option<(PathBuf, PathBuf)> {
    let dir = artifacts_dir();
    let kernel = dir.join("vmlinux");
    let initrd = dir.join("initramfs.cpio.gz");
    let missing: Vec<_> = [&kernel, &initrd]
        .into_iter()
        .filter(|p| !p.is_file())
        .collect();
    if missing.is_empty() {
        return Some((kernel, initrd));
    }
    let msg = format!(
        "Linux artifacts missing ({}): run scripts/linux-guest.sh",
        missing
            .iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    );
    skip_unless_required(&msg);
    None
}

#[allow(dead_code)]
#[path = "../../lucid-linux-client/src/timed_boot.rs"]
mod timed_boot;
use timed_boot::{first, Boot, Line};

mod common;
// Strict: a counter missing from the report panics with its name.
use common::counter;

/// Boots Debian's kernel with its initramfs (256 MiB, the console on stdout).
fn boot_debian(kernel: &Path, initrd: &Path, name: &str) -> Boot {
    let stats = std::env::temp_dir().join(format!(
        "lucid-linux-{}-{name}.stats.json",
        std::process::id()
    ));
    let args: Vec<String> = vec![
        "--kernel".into(),
        kernel.display().to_string(),
        "--initrd".into(),
        initrd.display().to_string(),
        "--memory".into(),
        "256".into(),
        "--serial".into(),
        "stdio".into(),
    ];
    let lucid = Path::new(env!("CARGO_BIN_EXE_lucid"));
    Boot::start(lucid, &args, None, stats, None).expect("spawn lucid")
}

fn milestone_table(lines: &[Line]) -> String {
    let mut s = String::from("milestone                          seconds\n");
    for (name, needle) in MILESTONES {
        match first(lines, needle) {
            Some(t) => s += &format!("  {name:<33}{t:>8.1}\n"),
            None => s += &format!("  {name:<33}       -\n"),
        }
    }
    s
}

/// The bounded CI test: Linux prints its banner and parses Lucid's ACPI tables, then Lucid stops
/// cleanly on SIGTERM. About 20 s on the 2-core PVM development machine (most of it before the
/// kernel's banner appears); the limit allows for a slow, busy machine.
#[test]
fn linux_boots_to_lucid_acpi_tables() {
    let Some((kernel, initrd)) = artifacts() else {
        return;
    };
    // Its turn among the Linux boots (each keeps a core busy): the 300 s limit is for this one.
    let _turn = one_boot_at_a_time();
    let started = Instant::now();
    let mut boot = boot_debian(&kernel, &initrd, "acpi");
    let reached = boot.wait_for(started + Duration::from_secs(300), |lines| {
        first(lines, "Linux version").is_some()
            && lines
                .iter()
                .any(|l| l.text.contains("ACPI:") && l.text.contains("LUCID"))
    });
    let t = started.elapsed().as_secs_f64();
    let (code, stderr, lines, _) = boot.finish();
    let tail: Vec<_> = lines.iter().rev().take(20).rev().map(|l| &l.text).collect();
    assert!(
        reached,
        "Linux did not reach Lucid's ACPI tables in {t:.0} s; last console lines:\n{tail:#?}\nstderr:\n{stderr}"
    );
    eprintln!("{}", milestone_table(&lines));
    // Lucid's convention for a VM stopped by signal N is exit status 128 + N.
    assert_eq!(
        code,
        Some(128 + libc::SIGTERM),
        "lucid did not exit cleanly on SIGTERM; stderr:\n{stderr}"
    );
    assert!(
        stderr.contains("signal 15"),
        "no stop report in stderr:\n{stderr}"
    );
}

/// Opt-in (`cargo test -p lucid --release --test linux -- --ignored --nocapture`): boots as far
/// as Linux gets in `LUCID_LINUX_SECS` seconds (default 900) and prints the milestones reached,
/// how the run ended, and the instructions Lucid completed for KVM's emulator.
#[test]
#[ignore]
fn linux_boot_milestones() {
    let Some((kernel, initrd)) = artifacts() else {
        return;
    };
    let secs: u64 = std::env::var("LUCID_LINUX_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(900);
    let _turn = one_boot_at_a_time();
    let started = Instant::now();
    let mut boot = boot_debian(&kernel, &initrd, "milestones");
    let ended = boot.wait_for(started + Duration::from_secs(secs), |_| false);
    let t = started.elapsed().as_secs_f64();
    let (code, stderr, lines, stats) = boot.finish();
    let log = artifacts_dir().join("linux_boot_milestones.log");
    let text: String = lines
        .iter()
        .map(|l| format!("{:8.3} {}\n", l.t, l.text))
        .collect();
    let _ = std::fs::write(&log, text);
    println!("{}", milestone_table(&lines));
    println!("console log with times: {}", log.display());
    println!(
        "run {} after {t:.0} s (exit status {code:?}); last console lines:",
        if ended {
            "ended by itself"
        } else {
            "stopped by the test"
        }
    );
    for l in lines.iter().rev().take(15).rev() {
        println!("  {:8.1} {}", l.t, l.text);
    }
    println!("lucid stderr:\n{stderr}");
    if let Some(stats) = stats {
        println!(
            "emulated_insns: {}",
            counter(&stats, "vcpu0.emulated_insns")
        );
        println!(
            "emulated by mnemonic: {}",
            stats["counters"]["vcpu0"]["emulated"]
        );
    }
    assert!(
        first(&lines, "Linux version").is_some(),
        "Linux printed nothing recognisable"
    );
}

// ---------------------------------------------------------------------------------------------
// The small kernel (work-linux/small/vmlinux) with Linux's own drivers on Lucid's devices
// ---------------------------------------------------------------------------------------------

/// The small kernel built by scripts/linux-guest.sh, or None (after printing why) to skip.
fn small_kernel() -> Option<PathBuf> {
    let k = artifacts_dir().join("small/vmlinux");
    if k.is_file() {
        return Some(k);
    }
    let msg = format!(
        "small Linux kernel missing ({}): run scripts/linux-guest.sh",
        k.display()
    );
    skip_unless_required(&msg);
    None
}

/// The Linux boots (the Debian kernel's and the small kernel's) take turns: each keeps a core
/// busy with the guest (all of its kernel code is emulated on a PVM host), and L4 adds a
/// polling thread on the other.
fn one_boot_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    static TURN: std::sync::Mutex<()> = std::sync::Mutex::new(());
    TURN.lock().unwrap_or_else(|e| e.into_inner())
}

/// The `lucid-linux-client` binary of the same profile as the `lucid` under test: another
/// package's binary, so cargo builds it only when asked (`cargo build --workspace`).
fn linux_client() -> std::path::PathBuf {
    let path = Path::new(env!("CARGO_BIN_EXE_lucid")).with_file_name("lucid-linux-client");
    assert!(
        path.is_file(),
        "no {} (cargo build --workspace, with this test's profile)",
        path.display()
    );
    path
}

/// What a run of `lucid-linux-client` left.
struct ClientRun {
    report: serde_json::Value,
    stdout: String,
    stderr: String,
    success: bool,
    /// The console log.
    log: PathBuf,
}

/// Runs `lucid-linux-client --kernel KERNEL ARGS` with a JSON report and a console log named
/// by `tag`.
fn run_linux_client(kernel: &Path, tag: &str, args: &[String]) -> ClientRun {
    let json = std::env::temp_dir().join(format!(
        "lucid-linux-client-{}-{tag}.json",
        std::process::id()
    ));
    let log = artifacts_dir().join(format!("linux-client-{tag}.log"));
    let out = Command::new(linux_client())
        .arg("--kernel")
        .arg(kernel)
        .args(["--lucid", env!("CARGO_BIN_EXE_lucid")])
        .args(args)
        .args(["--timeout", "900", "--json"])
        .arg(&json)
        .arg("--log")
        .arg(&log)
        .stdin(Stdio::null())
        .output()
        .expect("run lucid-linux-client");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    let report: serde_json::Value = std::fs::read_to_string(&json)
        .ok()
        .and_then(|s| serde_json::from_str(&s).ok())
        .unwrap_or_else(|| panic!("no report from lucid-linux-client:\n{stdout}\n{stderr}"));
    let _ = std::fs::remove_file(&json);
    ClientRun {
        report,
        stdout,
        stderr,
        success: out.status.success(),
        log,
    }
}

/// Runs `lucid-linux-client` on `rung` and checks every milestone this host allows: Linux
/// enumerates Lucid's virtio functions, one per device, and virtio_pci drives each of them with
/// MSI-X, every interrupt an MSI-X message and none on INTx (which the DSDT's `_PRT` routes,
/// for a driver without MSI-X); virtio_blk
/// mounts the ext2 root and loads `/sbin/init` from it, and reads both GPT headers of a second
/// disk with matching CRCs; virtio_net takes a static `ip=`, sends the kernel log by netconsole
/// to a UDP listener on the host, and answers 5 of 5 ICMP echo requests from the host while
/// init spins (when the test runs as root: it makes a network namespace with a tap). Userspace
/// (busybox: disk checksums, write and read back, ping, poweroff) runs on VT-x/AMD-V hosts and
/// is skipped, with the reason, on PVM, where no guest system call works.
///
/// With `iommu` (a `--iommu` spec) every device sits behind Lucid's VT-d, and on top of all that
/// Linux parses the DMAR, intel-iommu takes the unit and programs it (see `check_iommu`).
fn small_linux_on(rung: &str, iommu: Option<&str>) {
    let Some(kernel) = small_kernel() else {
        return;
    };
    let _turn = one_boot_at_a_time();
    // `vtd,mode=sidecore` -> `-vtd-sidecore` in the file names.
    let tag = iommu.map_or(String::new(), |s| {
        let words: Vec<_> = s
            .split(',')
            .map(|w| w.rsplit('=').next().unwrap_or(w))
            .collect();
        format!("-{}", words.join("-"))
    });
    let mut args = vec!["--rung".to_string(), rung.to_string()];
    if let Some(spec) = iommu {
        args.extend(["--iommu".to_string(), spec.to_string()]);
    }
    // The vhost-user root boots have no Lucid thread in their data path, so the rung changes
    // nothing there: they run once, on L1 (with `--iommu` the client skips them by itself).
    let roots = rung == "L1" && iommu.is_none();
    if !roots {
        args.extend(["--vhost-user".to_string(), "no".to_string()]);
    }
    let ClientRun {
        report,
        stdout,
        stderr,
        success,
        log,
    } = run_linux_client(&kernel, &format!("{rung}{tag}"), &args);
    let line = stdout.lines().last().unwrap_or_default();
    println!("{rung}{tag}: {line}");
    for m in report["milestones"].as_array().into_iter().flatten() {
        println!(
            "  {:<30}{:>8}",
            m["name"].as_str().unwrap_or("?"),
            match m["seconds"].as_f64() {
                Some(t) => format!("{t:.1}"),
                None => "-".into(),
            }
        );
    }
    println!("  counters: {}", report["counters"]);
    println!("  icmp: {}", report["icmp"]);
    println!(
        "  netconsole lines: {}",
        report["netconsole_lines"].as_array().map_or(0, Vec::len)
    );
    let why = format!("report: {report:#}\nstderr: {stderr}");
    assert!(
        line.starts_with("linux-client: init=yes rootfs=ok "),
        "{why}"
    );
    assert!(line.contains(" disk2=ok "), "{why}");
    for m in report["milestones"].as_array().expect("milestones") {
        assert!(
            m["seconds"].is_number(),
            "milestone {} not reached; {why}",
            m["name"]
        );
    }
    // The report's counters are nested as in Lucid's stats JSON.
    let count = |n: &str| counter(&report, n);
    assert!(count("blk0.requests") > 0, "{why}");
    assert!(count("blk1.requests") > 0, "{why}");
    assert_eq!(count("blk0.errors") + count("blk1.errors"), 0, "{why}");
    assert_eq!(report["disk2"], "ok", "{why}");

    // Whether the network ran, and if not, why (a kind, not words).
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    let net_skip = report["net_skip"].as_str();
    let has_net = net_skip.is_none();

    // Linux enumerated one virtio function per device: two disks and, with the network, a NIC.
    let functions = report["pci_functions"].as_array().expect("pci_functions");
    let with_id = |id: &str| {
        functions
            .iter()
            .filter(|f| f.as_str().is_some_and(|f| f.contains(id)))
            .count()
    };
    assert_eq!(with_id("[1af4:1042]"), 2, "{why}");
    assert_eq!(with_id("[1af4:1041]"), usize::from(has_net), "{why}");
    assert_eq!(with_id("[1af4:1044]"), 1, "virtio-rng; {why}");
    assert_eq!(with_id("[1af4:1053]"), 1, "virtio-vsock; {why}");
    assert_eq!(with_id("[1af4:1043]"), 1, "virtio-console; {why}");
    assert_eq!(functions.len(), 5 + usize::from(has_net), "{why}");
    // virtio_console took the device as hvc0 and the kernel's log reached its file; qemu_fw_cfg
    // read the signature, the ID and the file directory.
    assert_eq!(report["console"], "ok", "{why}");
    assert_eq!(report["fw_cfg"], "ok", "{why}");
    // hw_random registered virtio-rng and its fill thread read from it; virtio_vsock took the
    // device and its transport reset a host connection to a port nothing listens on.
    assert_eq!(report["rng"], "ok", "{why}");
    assert!(count("rng.bytes_written") > 0, "{why}");
    assert_eq!(report["vsock"], "ok", "{why}");
    assert_eq!(report["vsock_refused"], true, "{why}");
    if roots {
        // The kernel mounted its root from virtiofsd and from qemu-storage-daemon, and the
        // init it ran from each hashed its own 64 KiB as the kernel mapped it: intact.
        assert_eq!(report["virtiofs_root"], "ok", "{why}");
        assert_eq!(report["vhost_user_blk"], "ok", "{why}");
        assert!(
            line.contains(" virtiofs_root=ok vhost_user_blk=ok assigned_blk=ok vsock=ok rng=ok "),
            "{why}"
        );
    } else {
        assert_eq!(report["virtiofs_root"], "skipped", "{why}");
    }
    // The kernel mounted its root from `lucid device-server blk`, assigned over vfio-user
    // (behind the VT-d too, with no fault), and its init found itself intact.
    assert_eq!(report["assigned_blk"], "ok", "{why}");
    // MSI-X, not INTx: Lucid delivers a device's MSI-X vectors by KVM_SIGNAL_MSI on L0 and by
    // irqfd on L1-L4 (`irq.msi_signal`, `irq.irqfd`), and counts INTx apart (`irq.intx`). L4's
    // polling back-ends still raise the interrupts a driver asks for, and Linux's virtio_blk
    // and virtio_net ask for them (block completions, received packets), so on either rung each
    // device has at least one, all on the rung's MSI-X path.
    let (msix, other) = if rung == "L0" {
        ("msi_signal", "irqfd")
    } else {
        ("irqfd", "msi_signal")
    };
    let devices: &[&str] = if has_net {
        &["blk0", "blk1", "net0", "rng", "vsock0", "console"]
    } else {
        &["blk0", "blk1", "rng", "vsock0", "console"]
    };
    for dev in devices {
        assert!(
            count(&format!("{dev}.irq.{msix}")) > 0,
            "{dev}: no MSI-X interrupt ({msix}) on {rung}; {why}"
        );
        assert_eq!(
            count(&format!("{dev}.irq.intx")),
            0,
            "{dev}: interrupts on INTx; {why}"
        );
        assert_eq!(
            count(&format!("{dev}.irq.{other}")),
            0,
            "{dev}: interrupts by {other} on {rung}; {why}"
        );
    }

    // What Linux said about Lucid's platform devices.
    let console = std::fs::read_to_string(&log).unwrap_or_default();
    for bad in ["no GSI", "can't derive routing", "i8042: Can't read CTR"] {
        assert!(
            !console.contains(bad),
            "console has {bad:?}: see {}",
            log.display()
        );
    }

    let net_skipped = report["net_skipped_because"].as_str().unwrap_or_default();
    match net_skip {
        None => assert!(root, "the network ran without root; {why}"),
        Some("no-tap") => {
            assert!(root, "{why}");
            // A host without tap support: only the network part is skipped, and only where
            // nothing requires it.
            assert!(
                !linux_required(),
                "root, but no tap for the network checks (LUCID_REQUIRE_LINUX is set): \
                 {net_skipped}; {why}"
            );
            lucid_guests::skip_or_fail(&format!("the network checks: {net_skipped}"));
        }
        Some("no-root") => {
            assert!(!root, "{why}");
            lucid_guests::skip_or_fail(&format!("the network checks need root; {why}"));
        }
        Some(other) => panic!("unexpected net_skip {other:?}; {why}"),
    }
    if has_net {
        assert_eq!(report["net"], "ok", "{why}");
        assert_eq!(report["icmp"]["replies"], 5, "{why}");
        assert!(
            count("net0.tx_packets") > 0 && count("net0.rx_packets") > 0,
            "{why}"
        );
        let netcon = report["netconsole_lines"].as_array().expect("lines");
        assert!(
            netcon
                .iter()
                .any(|l| l.as_str().is_some_and(|l| l.contains("Run /sbin/init"))),
            "{why}"
        );
    } else {
        assert_eq!(report["net"], "skipped", "{why}");
    }

    if lucid_hv::detect_backend() == lucid_hv::Backend::Pvm {
        assert_eq!(report["userspace"], "skipped", "{why}");
        assert_eq!(report["userspace_skip"], "pvm", "{why}");
        println!(
            "  userspace skipped: {}",
            report["userspace_skipped_because"].as_str().unwrap_or("?")
        );
    } else {
        assert_eq!(report["userspace"], "ok", "{why}");
    }
    match iommu {
        Some(spec) => check_iommu(spec, &report, &console, &why),
        None => assert_eq!(report["iommu"], "skipped", "{why}"),
    }
    assert!(success, "{why}");
}

/// What a boot behind the VT-d must show: the DMAR milestones (already checked with the others,
/// here by name so that a renamed milestone cannot drop them), no fault, and counters from which
/// Linux's use of the unit is plain (figures of one run in docs/linux.md, "Through the vIOMMU").
fn check_iommu(spec: &str, report: &serde_json::Value, console: &str, why: &str) {
    let count = |n: &str| counter(report, n);
    let names: Vec<_> = report["milestones"]
        .as_array()
        .expect("milestones")
        .iter()
        .filter_map(|m| m["name"].as_str())
        .collect();
    for want in [
        "DMAR: host address width 48",
        "DMAR: DRHD at 0xfed90000",
        "DMAR: queued invalidation",
        "intel-iommu enabled",
    ] {
        assert!(names.contains(&want), "no milestone {want:?}; {why}");
    }
    assert_eq!(report["iommu"], "ok", "{why}");
    println!("  iommu: {}", report["counters"]["iommu"]);
    // No DMA or interrupt request refused, and Linux's fault handler printed nothing.
    assert_eq!(count("iommu.faults.dma"), 0, "{why}");
    assert_eq!(count("iommu.faults.ir"), 0, "{why}");
    assert!(!console.contains("DMAR: DRHD: handling fault"), "{why}");
    // Linux programmed the unit: it invalidated the context cache and the IOTLB through the
    // invalidation queue (each batch closed by a wait descriptor), and mapped the virtio rings and
    // buffers, whose first accesses missed the VMM's IOTLB. With Caching Mode Linux also flushes
    // on every map and unmap (strict: one page-selective invalidation per unmap).
    assert!(count("iommu.inv.context") > 0, "{why}");
    assert!(count("iommu.inv.wait") > 0, "{why}");
    assert!(count("iommu.maps") > 0, "{why}");
    assert!(count("iommu.iotlb.misses") > 0, "{why}");
    assert!(count("iommu.iotlb.hits") > 0, "{why}");
    // Sidecore: Linux's writes to register page 0 (shared memory) were found by the polling
    // thread; samecore has no such thread.
    if spec.contains("mode=sidecore") {
        assert!(count("iommu.sidecore.busy_polls") > 0, "{why}");
    } else {
        assert_eq!(count("iommu.sidecore.polls"), 0, "{why}");
    }
}

/// CI: the small kernel with every device on rung L1 (ioeventfd kicks, irqfd interrupts).
#[test]
fn small_linux_drives_lucid_devices_on_l1() {
    small_linux_on("L1", None);
}

/// CI: the same on rung L4 (a polling back-end thread per device).
#[test]
fn small_linux_drives_lucid_devices_on_l4() {
    small_linux_on("L4", None);
}

/// CI: L1 with every device behind the VT-d (`--iommu vtd,mode=samecore`: the register window
/// traps), driven by Linux's intel-iommu.
#[test]
fn small_linux_drives_lucid_devices_through_the_vtd_samecore_on_l1() {
    small_linux_on("L1", Some("vtd,mode=samecore"));
}

/// CI: the same with the sidecore VT-d (page 0 of the registers is shared memory that a polling
/// thread serves; page 1 traps).
#[test]
fn small_linux_drives_lucid_devices_through_the_vtd_sidecore_on_l1() {
    small_linux_on("L1", Some("vtd,mode=sidecore"));
}

/// CI: ACPI PCI hotplug with Linux's own drivers, through the REST API (`lucid-linux-client
/// --hotplug`, crates/lucid-linux-client/src/hotplug.rs): `acpiphp` finds a disk `vm.add-disk`
/// put in, virtio_blk logs its capacity and reads it; `vm.remove-device` makes Linux release
/// and eject it and Lucid close the image; the power button reaches Linux's button driver.
#[test]
fn small_linux_hotplugs_a_disk_through_the_rest_api() {
    let Some(kernel) = small_kernel() else {
        return;
    };
    let _turn = one_boot_at_a_time();
    let ClientRun { report, stderr, .. } =
        run_linux_client(&kernel, "hotplug", &["--hotplug".to_string()]);
    for s in report["steps"].as_array().into_iter().flatten() {
        println!(
            "  {:<14}{:>8.1}  {}",
            s["name"].as_str().unwrap_or("?"),
            s["seconds"].as_f64().unwrap_or(0.0),
            s["evidence"].as_str().unwrap_or("")
        );
    }
    assert_eq!(
        report["passed"], true,
        "report: {report:#}\nstderr: {stderr}"
    );
}
