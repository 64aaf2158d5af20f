//! The probe guests under Lucid on real KVM: each checks behaviour and counts, never time.

mod common;

use std::time::Duration;

use common::{guest_file, lucid, run_cmd, tmp};

const LIMIT: Duration = Duration::from_secs(60);

fn guest(name: &str, extra: &[&str]) -> common::Outcome {
    let mut args = vec!["run", "--guest", name];
    args.extend_from_slice(extra);
    lucid(&args, LIMIT)
}

#[test]
fn default_run_reports_the_host_and_exits_zero() {
    let o = lucid(&["run"], LIMIT);
    assert_eq!(
        o.status,
        Some(0),
        "stdout: {}\nstderr: {}",
        o.stdout,
        o.stderr
    );
    for key in [
        "backend=",
        "cpl3_ns_per_iter=",
        "cpl0_ns_per_iter=",
        "pio_exit_us=",
        "ioeventfd_exit_us=",
    ] {
        assert!(o.stdout.contains(key), "missing {key} in {}", o.stdout);
    }
    assert!(o.stderr.contains("exits by reason"), "{}", o.stderr);
    // The ioeventfd writes never left the kernel, but were counted through the eventfd.
    assert!(o.counter("ioeventfd_probe.signals") > 0);
}

#[test]
fn hello_prints_and_exits_with_its_code() {
    let o = guest("hello", &["--cmdline", "code=5"]);
    assert!(
        o.stdout.contains("hello from the lucid probe kit"),
        "{}",
        o.stdout
    );
    assert_eq!(o.status, Some(11), "(5 << 1) | 1; stderr: {}", o.stderr);
    let stats = o.stats.as_ref().expect("stats JSON");
    assert_eq!(stats["stop"]["exit_code"], 11);
}

#[test]
fn compute_checksum_matches_the_host_build() {
    let o = guest("compute", &["--cmdline", "iters=1000000"]);
    assert_eq!(o.status, Some(1), "{}", o.stderr);
    let checksum = |s: &str| {
        s.split_whitespace()
            .find(|w| w.starts_with("checksum="))
            .map(str::to_owned)
    };
    let mut host = std::process::Command::new(lucid_guests::compute_host_path());
    host.arg("iters=1000000");
    let host = run_cmd(host, LIMIT);
    let guest_sum = checksum(&o.stdout).expect("guest checksum");
    assert_eq!(
        checksum(&host.stdout),
        Some(guest_sum),
        "host: {}",
        host.stdout
    );
}

#[test]
fn pio_ping_makes_exactly_n_exits_and_kvm_agrees() {
    let n = 5000u64;
    let o = guest("pio-ping", &["--cmdline", &format!("count={n}")]);
    assert_eq!(o.status, Some(1), "{}", o.stderr);
    assert_eq!(o.counter("post.writes"), n);
    let lucid_io = o.counter("vcpu0.exit.io_out") + o.counter("vcpu0.exit.io_in");
    assert!(lucid_io >= n);
    // KVM's own statistics: every userspace exit is one of KVM's exits, and where the backend
    // counts I/O exits (VT-x, AMD-V) it counts exactly the ones Lucid handled.
    let kvm_exits = o.counter("kvm.vcpu0.exits");
    assert!(kvm_exits >= o.counter("vcpu0.exits"), "KVM {kvm_exits}");
    let kvm_io = o.counter("kvm.vcpu0.io_exits");
    if kvm_io > 0 {
        assert_eq!(kvm_io, lucid_io);
    }
}

#[test]
fn mmio_ping_makes_exactly_n_exits() {
    let n = 3000u64;
    let o = guest("mmio-ping", &["--cmdline", &format!("count={n}")]);
    assert_eq!(o.status, Some(1), "{}", o.stderr);
    assert_eq!(o.counter("mmio_probe.writes"), n);
    assert_eq!(o.counter("vcpu0.exit.mmio_write"), n);
    // KVM's binary statistics count the same MMIO exits (PVM and VT-x both keep this one).
    assert_eq!(o.counter("kvm.vcpu0.mmio_exits"), n);
}

#[test]
fn memtouch_reads_back_what_it_wrote() {
    let o = guest("memtouch", &["--memory", "128", "--cmdline", "mib=64"]);
    assert!(o.stdout.contains("errors=0"), "{}", o.stdout);
    assert_eq!(o.status, Some(1), "{}", o.stderr);
}

#[test]
fn memtouch_on_anonymous_memfd_and_file_backing() {
    let img = tmp("backing.img");
    std::fs::write(&img, vec![0u8; 128 << 20]).unwrap();
    for backing in ["memfd", &format!("file:{}", img.display())] {
        let o = guest(
            "memtouch",
            &[
                "--memory",
                "128",
                "--backing",
                backing,
                "--cmdline",
                "mib=32",
            ],
        );
        assert!(o.stdout.contains("errors=0"), "{backing}: {}", o.stdout);
    }
    // A private mapping never writes the guest's data back to the file.
    assert!(std::fs::read(&img).unwrap().iter().all(|&b| b == 0));
    std::fs::remove_file(img).unwrap();
}

#[test]
fn smp_sees_every_vcpu() {
    for n in [2u8, 4] {
        let o = guest("smp", &["--vcpus", &n.to_string()]);
        assert!(
            o.stdout.contains(&format!("smp: {n} of {n} cpus up")),
            "{n} vCPUs: {}\n{}",
            o.stdout,
            o.stderr
        );
        assert_eq!(o.status, Some(1));
    }
}

#[test]
fn missing_kernel_is_one_clear_error() {
    let o = lucid(&["run", "--kernel", "/nonexistent/kernel"], LIMIT);
    assert_eq!(o.status, Some(1));
    assert!(o.stderr.contains("/nonexistent/kernel"), "{}", o.stderr);
    assert!(!o.stderr.contains("panicked"), "{}", o.stderr);
}

#[test]
fn non_elf_and_truncated_elf_are_clear_errors() {
    let junk = tmp("junk.bin");
    std::fs::write(&junk, b"this is not a kernel at all, just text".repeat(100)).unwrap();
    let o = lucid(&["run", "--kernel", junk.to_str().unwrap()], LIMIT);
    assert_eq!(o.status, Some(1));
    assert!(o.stderr.contains("not a kernel"), "{}", o.stderr);

    let elf = lucid_guests::get("hello").unwrap();
    let cut = tmp("truncated.elf");
    std::fs::write(&cut, &elf[..elf.len().min(200)]).unwrap();
    let o = lucid(&["run", "--kernel", cut.to_str().unwrap()], LIMIT);
    assert_eq!(o.status, Some(1), "{}", o.stderr);
    assert!(!o.stderr.contains("panicked"), "{}", o.stderr);
    assert!(
        o.stderr.to_lowercase().contains("truncated"),
        "{}",
        o.stderr
    );
    let _ = std::fs::remove_file(junk);
    let _ = std::fs::remove_file(cut);
}

#[test]
fn kernel_larger_than_memory_is_a_clear_error() {
    // hello.elf with its load segment's memory size raised to 64 MiB, booted in 16 MiB.
    let mut elf = lucid_guests::get("hello").unwrap().to_vec();
    let phoff = u64::from_le_bytes(elf[0x20..0x28].try_into().unwrap()) as usize;
    let phnum = u16::from_le_bytes(elf[0x38..0x3a].try_into().unwrap()) as usize;
    for i in 0..phnum {
        let ph = phoff + i * 56;
        if u32::from_le_bytes(elf[ph..ph + 4].try_into().unwrap()) == 1 {
            elf[ph + 40..ph + 48].copy_from_slice(&(64u64 << 20).to_le_bytes());
        }
    }
    let big = tmp("big.elf");
    std::fs::write(&big, elf).unwrap();
    let o = lucid(
        &["run", "--memory", "16", "--kernel", big.to_str().unwrap()],
        LIMIT,
    );
    assert_eq!(o.status, Some(1), "{}", o.stderr);
    assert!(o.stderr.contains("memory too small"), "{}", o.stderr);
    let _ = std::fs::remove_file(big);
}

#[test]
fn bad_options_are_clear_errors() {
    for args in [
        &["run", "--vcpus", "0"][..],
        &["run", "--memory", "1"],
        &["run", "--serial", "tcp:1234"],
        &["run", "--backing", "floppy"],
        &["run", "--guest", "no-such-guest"],
    ] {
        let o = lucid(args, LIMIT);
        assert_eq!(o.status, Some(1), "{args:?}: {}", o.stderr);
        assert!(!o.stderr.contains("panicked"), "{args:?}: {}", o.stderr);
    }
}

#[test]
fn triple_fault_is_reported_not_a_crash() {
    let o = guest("triplefault", &[]);
    assert_eq!(o.status, Some(2), "{}", o.stderr);
    assert!(o.stderr.contains("triple-faulted"), "{}", o.stderr);
}

#[test]
fn garbage_on_every_port_and_mmio_page_does_not_hurt_lucid() {
    let o = guest("garbage", &[]);
    assert!(!o.timed_out, "Lucid hung");
    assert!(!o.stderr.contains("panicked"), "{}", o.stderr);
    assert!(
        o.stdout.contains("garbage: survived"),
        "{}\n{}",
        o.stdout,
        o.stderr
    );
    assert!(o.counter("vcpu0.pio_unhandled") > 0);
}

#[test]
fn sigterm_stops_a_guest_that_never_exits() {
    let stats = tmp("spin-stats.json");
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_lucid"))
        .args(["run", "--guest", "spin", "--stats-json"])
        .arg(&stats)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_secs(2));
    // SAFETY: sending SIGTERM to our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "Lucid ignored SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(status.code(), Some(128 + libc::SIGTERM));
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&stats).unwrap()).unwrap();
    assert!(json["stop"]["reason"].as_str().unwrap().contains("signal"));
    let _ = std::fs::remove_file(stats);
}

#[test]
fn serial_to_file_and_unix_socket() {
    let file = tmp("console.txt");
    let o = guest("hello", &["--serial", &format!("file:{}", file.display())]);
    assert_eq!(o.status, Some(1));
    let text = std::fs::read_to_string(&file).unwrap();
    assert!(text.contains("hello from the lucid probe kit"));
    let _ = std::fs::remove_file(file);

    // Unix socket: output before the client connects is kept for it.
    let sock = tmp("console.sock");
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_lucid"))
        .args(["run", "--guest", "spin", "--serial"])
        .arg(format!("unix:{}", sock.display()))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut conn = None;
    for _ in 0..200 {
        if let Ok(c) = std::os::unix::net::UnixStream::connect(&sock) {
            conn = Some(c);
            break;
        }
        std::thread::sleep(Duration::from_millis(25));
    }
    let mut conn = conn.expect("console socket");
    conn.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut buf = [0u8; 256];
    let n = std::io::Read::read(&mut conn, &mut buf).unwrap();
    assert!(n > 0);
    let _ = child.kill();
    let _ = child.wait();
    let _ = std::fs::remove_file(sock);
}

#[test]
fn the_same_guest_binary_boots_under_qemu() {
    if std::process::Command::new("qemu-system-x86_64")
        .arg("--version")
        .output()
        .is_err()
    {
        assert!(
            std::env::var_os("CI").is_none(),
            "qemu-system-x86_64 missing in CI (scripts/deps.sh --test installs it)"
        );
        println!("skipped: qemu-system-x86_64 is not installed");
        return;
    }
    let elf = guest_file("hello");
    let mut cmd = std::process::Command::new("qemu-system-x86_64");
    cmd.args([
        "-M",
        "microvm,x-option-roms=off,rtc=off,isa-serial=on",
        "-enable-kvm",
        "-m",
        "256",
        "-nodefaults",
        "-no-user-config",
        "-nographic",
        "-no-reboot",
        "-serial",
        "stdio",
        "-monitor",
        "none",
        "-display",
        "none",
        "-device",
        "isa-debug-exit,iobase=0xf4,iosize=4",
        "-append",
        "code=5",
        "-kernel",
    ])
    .arg(&elf);
    let o = run_cmd(cmd, LIMIT);
    assert!(
        o.stdout.contains("hello from the lucid probe kit"),
        "{}\n{}",
        o.stdout,
        o.stderr
    );
    assert_eq!(o.status, Some(11));
    let _ = std::fs::remove_file(elf);
}

/// A KVM hypercall made at CPL0 the way Linux makes it (`ptp_kvm_init`'s `KVM_HC_CLOCK_PAIRING`,
/// and an unknown number) comes back to the guest: answered by KVM (-1000 = -KVM_ENOSYS for an
/// unknown number) on hosts that run guest kernel code in hardware, or refused with #UD on a
/// host that emulates it (PVM), where KVM's default "fix the hypercall instruction" quirk would
/// rewrite and re-run it for good. A second vCPU ends the run (code 3) if the call never returns.
#[test]
fn kvm_hypercall_at_cpl0_returns_to_the_guest() {
    let pvm = lucid_hv::probe::detect_backend() == lucid_hv::probe::Backend::Pvm;
    for (insn, nr) in [
        ("vmmcall", 9),
        ("vmcall", 9),
        ("vmmcall", 12345),
        ("vmcall", 12345),
    ] {
        let cmdline = format!("insn={insn} nr={nr} watch_ms=5000");
        let o = guest("kvm-hypercall", &["--vcpus", "2", "--cmdline", &cmdline]);
        assert_eq!(o.status, Some(1), "{cmdline}: {}\n{}", o.stdout, o.stderr);
        let result = o
            .stdout
            .lines()
            .filter_map(|l| l.strip_prefix("kvm-hypercall: "))
            .find(|l| l.starts_with("ud="))
            .unwrap_or_else(|| panic!("{cmdline}: no result in {}", o.stdout));
        if pvm {
            assert!(result.starts_with("ud=1 "), "{cmdline}: {result}");
        } else if nr != 9 {
            // Unknown to KVM (whichever vendor's instruction: KVM fixes up a foreign one).
            assert_eq!(result, "ud=0 rax=-1000", "{cmdline}");
        }
    }
}
