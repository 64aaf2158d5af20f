//! The probe guests under Lucid on real KVM: each checks behaviour and counts, never time.

mod common;

use std::time::Duration;

use common::{guest_file, lucid, run_cmd, tmp};
use lucid_guests::{QEMU_MICROVM, QEMU_Q35};

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
        // The guest waits timeout_ms of wall time for its APs (5 s by default); 4 vCPUs on 2
        // busy cores can take longer to be scheduled, which is not what this checks.
        let o = guest(
            "smp",
            &["--vcpus", &n.to_string(), "--cmdline", "timeout_ms=30000"],
        );
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
    assert_eq!(o.status, Some(lucid_vmm::EXIT_FAILURE));
    assert!(o.stderr.contains("/nonexistent/kernel"), "{}", o.stderr);
    assert!(!o.stderr.contains("panicked"), "{}", o.stderr);
}

/// `--kernel /dev/zero` would read forever, a FIFO would block the open, a directory or a huge
/// sparse file would fail late: each is refused with one clear error before anything is read.
#[test]
fn kernel_and_initrd_that_are_not_regular_files_are_refused() {
    let fifo = tmp("kernel.fifo");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: mkfifo with a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let sparse = tmp("sparse.img");
    std::fs::File::create(&sparse)
        .unwrap()
        .set_len(64 << 30)
        .unwrap();
    let hello = guest_file("hello");
    let (fifo_s, sparse_s, hello_s) = (
        fifo.to_str().unwrap(),
        sparse.to_str().unwrap(),
        hello.to_str().unwrap(),
    );
    let dir = std::env::temp_dir();
    let bad = [
        ("/dev/zero", "/dev/zero is a character device"),
        (fifo_s, "is a FIFO"),
        (sparse_s, "bytes, more than"),
    ];
    let directory = [(dir.to_str().unwrap(), "is a directory")];
    let kernels = bad
        .iter()
        .chain(&directory)
        .map(|&(k, want)| (vec!["--kernel", k], want));
    let initrds = bad
        .iter()
        .map(|&(i, want)| (vec!["--kernel", hello_s, "--initrd", i], want));
    for (args, want) in kernels.chain(initrds) {
        let mut a = vec!["run"];
        a.extend(args.iter().copied());
        let o = lucid(&a, Duration::from_secs(20));
        assert!(!o.timed_out, "{args:?}: Lucid hung");
        assert_eq!(
            o.status,
            Some(lucid_vmm::EXIT_FAILURE),
            "{args:?}: {}",
            o.stderr
        );
        assert!(o.stderr.contains(want), "{args:?}: {}", o.stderr);
        assert!(!o.stderr.contains("panicked"), "{args:?}: {}", o.stderr);
    }
    for f in [fifo, sparse, hello] {
        let _ = std::fs::remove_file(f);
    }
}

#[test]
fn non_elf_and_truncated_elf_are_clear_errors() {
    let junk = tmp("junk.bin");
    std::fs::write(&junk, b"this is not a kernel at all, just text".repeat(100)).unwrap();
    let o = lucid(&["run", "--kernel", junk.to_str().unwrap()], LIMIT);
    assert_eq!(o.status, Some(lucid_vmm::EXIT_FAILURE));
    assert!(o.stderr.contains("not a kernel"), "{}", o.stderr);

    let elf = lucid_guests::get("hello").unwrap();
    let cut = tmp("truncated.elf");
    std::fs::write(&cut, &elf[..elf.len().min(200)]).unwrap();
    let o = lucid(&["run", "--kernel", cut.to_str().unwrap()], LIMIT);
    assert_eq!(o.status, Some(lucid_vmm::EXIT_FAILURE), "{}", o.stderr);
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
    assert_eq!(o.status, Some(lucid_vmm::EXIT_FAILURE), "{}", o.stderr);
    assert!(o.stderr.contains("memory too small"), "{}", o.stderr);
    let _ = std::fs::remove_file(big);
}

/// A `--stats-json` path that cannot be written is refused before the guest runs, not after.
#[test]
fn an_unwritable_stats_json_path_is_refused_before_the_run() {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_lucid"));
    cmd.args([
        "run",
        "--guest",
        "hello",
        "--stats-json",
        "/nonexistent-lucid-dir/stats.json",
    ]);
    let o = run_cmd(cmd, LIMIT);
    assert_eq!(o.status, Some(lucid_vmm::EXIT_FAILURE), "{}", o.stderr);
    assert!(
        o.stderr
            .contains("cannot write --stats-json /nonexistent-lucid-dir/stats.json"),
        "{}",
        o.stderr
    );
    assert!(
        !o.stdout.contains("hello from"),
        "the guest ran: {}",
        o.stdout
    );
}

#[test]
fn bad_options_are_clear_errors() {
    for args in [
        &["run", "--vcpus", "0"][..],
        &["run", "--memory", "1"],
        &["run", "--serial", "tcp:1234"],
        &["run", "--backing", "floppy"],
        &["run", "--guest", "no-such-guest"],
        &["run", "--iommu", "amd"],
        &["run", "--iommu", "vtd,mode=fast"],
        &["run", "--iommu", "vtd,pin=never"],
        &["run", "--iommu", "vtd,colour=red"],
    ] {
        let o = lucid(args, LIMIT);
        assert_eq!(
            o.status,
            Some(lucid_vmm::EXIT_USAGE),
            "{args:?}: {}",
            o.stderr
        );
        assert!(!o.stderr.contains("panicked"), "{args:?}: {}", o.stderr);
    }
}

/// `--iommu`: the register window traps in samecore mode; in sidecore mode its first page is
/// memory, and the sidecore thread runs confined to its seccomp role.
#[test]
fn iommu_modes_from_the_command_line() {
    for (mode, exits, confined) in [("samecore", 100, 0), ("sidecore", 0, 1)] {
        let iommu = format!("vtd,mode={mode},pin=map");
        let o = guest(
            "mmio-ping",
            &[
                "--iommu",
                &iommu,
                "--cmdline",
                "count=100 addr=0xfed90000 op=read",
            ],
        );
        assert_eq!(o.status, Some(1), "{mode}: {}", o.stderr);
        assert_eq!(o.counter("vcpu0.exit.mmio_read"), exits, "{mode}");
        assert_eq!(o.counter("seccomp.confined.iommu"), confined, "{mode}");
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
    // Lucid blocks SIGTERM in every thread (for its signal thread) before any vCPU starts: once
    // lucid-vcpu0 exists, the signal stops the VM however slowly the rest came up.
    let pid = child.id();
    let vcpu_up = || {
        std::fs::read_dir(format!("/proc/{pid}/task"))
            .into_iter()
            .flatten()
            .flatten()
            .any(|t| {
                std::fs::read_to_string(t.path().join("comm"))
                    .is_ok_and(|c| c.trim() == "lucid-vcpu0")
            })
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while !vcpu_up() {
        assert!(child.try_wait().unwrap().is_none(), "Lucid ended early");
        assert!(
            std::time::Instant::now() < deadline,
            "no lucid-vcpu0 thread"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
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

/// Asserts that the guest's console holds every one of `needles`.
fn assert_prints(o: &common::Outcome, needles: &[&str]) {
    for n in needles {
        assert!(
            o.stdout.contains(n),
            "missing {n:?}:\n{}\n{}",
            o.stdout,
            o.stderr
        );
    }
}

/// Runs `kernel` under QEMU with `machine` and the debug-exit device; `None` when QEMU is not
/// installed (which CI does not allow).
fn qemu(machine: &[&str], kernel: &std::path::Path, append: &str) -> Option<common::Outcome> {
    if !lucid_guests::qemu_installed() {
        return None;
    }
    let cmd = lucid_guests::qemu_command(machine, kernel, append);
    Some(run_cmd(cmd, LIMIT))
}

/// Boots the built-in guest `name` under QEMU's `machine` with `append`: its console must hold
/// `want` and its exit status be `status`. Nothing when QEMU is not installed (outside CI).
fn qemu_agrees(name: &str, machine: &[&str], append: &str, want: &str, status: i32) {
    let elf = guest_file(name);
    if let Some(q) = qemu(machine, &elf, append) {
        assert!(
            q.stdout.contains(want),
            "QEMU {machine:?}, {name} {append}: {}\n{}",
            q.stdout,
            q.stderr
        );
        assert_eq!(q.status, Some(status), "QEMU {machine:?}, {name} {append}");
    }
    let _ = std::fs::remove_file(elf);
}

#[test]
fn the_same_guest_binary_boots_under_qemu() {
    qemu_agrees(
        "hello",
        QEMU_MICROVM,
        "code=5",
        "hello from the lucid probe kit",
        11,
    );
}

/// A PVH ELF linked with `ld -Ttext=0x100000` has its ELF headers in a PT_LOAD at 0xff000.
/// Lucid refused it ("below 1 MiB is the boot area"); QEMU loads it, and so does Lucid now.
#[test]
fn pvh_elf_with_headers_below_1_mib_boots_as_under_qemu() {
    let o = guest("pvh-ttext", &["--cmdline", "code=3"]);
    assert_prints(&o, &["pvh-ttext: ehdr=0xff000 magic=ok rsdp=0xe0000"]);
    assert_eq!(o.status, Some(7), "{}", o.stderr);
    // 0xff000 is qboot's BIOS ROM under microvm: QEMU boots the image, but the headers are not
    // in memory there (magic=MISSING).
    qemu_agrees(
        "pvh-ttext",
        QEMU_MICROVM,
        "code=3",
        "pvh-ttext: ehdr=0xff000",
        7,
    );
}

/// A multiboot kernel linked at 4 KiB, with bss over Lucid's usual places for the multiboot
/// info: Lucid puts its structures elsewhere, the guest finds its bss clean, every structure
/// outside its image, and runs real-mode code. QEMU's `pc` machine (SeaBIOS runs QEMU's
/// multiboot option ROM, ~7 s here) agrees; qboot/microvm do not start multiboot kernels.
#[test]
fn multiboot_kernel_in_low_memory_boots_as_under_qemu() {
    let o = guest("mb-lowmem", &["--cmdline", "low=1"]);
    assert_prints(
        &o,
        &[
            "mb-lowmem: ok",
            "bss_dirty_bytes=0x00000000",
            "real mode read 0x1badb002",
        ],
    );
    assert!(!o.stdout.contains("OVERLAPS"), "{}", o.stdout);
    assert_eq!(o.status, Some(1), "{}", o.stderr);
    qemu_agrees("mb-lowmem", &["-M", "pc"], "low=1", "mb-lowmem: ok", 1);
}

/// The FADT describes PM1a event/control blocks, a 32-bit PM timer, the SCI and a FACS; the
/// timer never runs backwards and ticks at 3.579545 MHz against the TSC (a wide band); S5
/// through PM1a_CNT powers the VM off (exit 0); S3, which Lucid cannot do, is refused and
/// counted, the guest keeps running. Before: a hardware-reduced FADT, no PM blocks (exit 2).
#[test]
fn acpi_pm_timer_ticks_and_s5_powers_off() {
    let o = guest("acpi-pm", &[]);
    assert_prints(
        &o,
        &[
            "acpi-pm: pm1a_evt=0x600 pm1a_cnt=0x604 pm_tmr=0x608 tmr_len=4 ext=1 sci=9 \
             hw_reduced=0",
            "facs_sig=ok",
            "sci_en=1 timer reads=1000 backwards=0",
            "acpi-pm: ok",
        ],
    );
    assert_eq!(o.status, Some(1), "{}", o.stderr);
    assert!(o.counter("acpi_pm.timer_reads") > 1000);

    let o = guest("acpi-pm", &["--cmdline", "sleep=s5 reads=10"]);
    assert_prints(&o, &["writing SLP_TYP=0|SLP_EN to 0x604 (S5)"]);
    assert!(!o.stdout.contains("still running"), "{}", o.stdout);
    assert_eq!(o.status, Some(0), "{}", o.stderr);
    let stats = o.stats.as_ref().expect("stats JSON");
    assert_eq!(stats["stop"]["reason"], "guest powered off");

    let o = guest("acpi-pm", &["--cmdline", "sleep=1 reads=10"]);
    assert_prints(&o, &["still running after SLP_TYP=1"]);
    assert_eq!(o.counter("acpi_pm.sleep_refused"), 1);
    assert_eq!(o.status, Some(1), "{}", o.stderr);

    // QEMU q35 (ICH9 PM at 0x600, a 24-bit timer) agrees with the probe and powers off on S5.
    // The rate is not checked there: the guest's TSC frequency is its own PIT estimate.
    let timer = "reads=100 check_rate=0";
    qemu_agrees("acpi-pm", QEMU_Q35, timer, "backwards=0", 1);
    qemu_agrees("acpi-pm", QEMU_Q35, "sleep=s5 reads=10", "(S5)", 0);
}

/// A KVM hypercall made at CPL0 the way Linux makes it (`ptp_kvm_init`'s `KVM_HC_CLOCK_PAIRING`,
/// and an unknown number) comes back to the guest: answered by KVM (-1000 = -KVM_ENOSYS for an
/// unknown number) on hosts that run guest kernel code in hardware, or refused with #UD on a
/// host that emulates it (PVM), where KVM's default "fix the hypercall instruction" quirk would
/// rewrite and re-run it for good. A second vCPU ends the run (code 3) if the call never returns.
#[test]
fn kvm_hypercall_at_cpl0_returns_to_the_guest() {
    let pvm = lucid_hv::detect_backend() == lucid_hv::Backend::Pvm;
    for (insn, nr) in [
        ("vmmcall", 9),
        ("vmcall", 9),
        ("vmmcall", 12345),
        ("vmcall", 12345),
    ] {
        // The watcher gives up after watch_ms of wall time: generous, since on a busy host the
        // caller's vCPU thread may not run for seconds (a call that never returns still ends
        // the run, in 30 s, within the 60 s limit).
        let cmdline = format!("insn={insn} nr={nr} watch_ms=30000");
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
