//! Seccomp on the real binary: a forbidden system call from each thread role ends that VM (its
//! process, with status 148) and is reported, while a VM running beside it is untouched; every
//! thread confines itself, back-ends restarted after a device reset included; `--no-seccomp`
//! turns the filters off. `LUCID_SECCOMP_SELFTEST=<role>` makes a thread of that role call
//! `socket(2)`, which no role may call (crates/lucid-seccomp).

mod common;

use std::process::Command;
use std::time::Duration;

use common::{disk, lucid, run_cmd, Outcome};

const LIMIT: Duration = Duration::from_secs(120);
const VIOLATION: i32 = 148;
const BLK_OPS: &str = "op=rw pattern=rand bs=4096 qd=8 count=200 verify=1 mode=irq";

/// `lucid run` of the virtio-blk probe guest on `img`, with `env` and `extra` arguments.
fn blk_run(img: &std::path::Path, env: &[(&str, &str)], extra: &[&str]) -> Outcome {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_lucid"));
    cmd.args(["run", "--guest", "virtio-blk", "--blk"])
        .arg(format!("path={},rung=L1", img.display()))
        .args(["--cmdline", BLK_OPS])
        .args(extra)
        .envs(env.iter().copied());
    run_cmd(cmd, LIMIT)
}

/// The first line of `text` that starts with `prefix`.
fn line<'a>(text: &'a str, prefix: &str, what: &str) -> &'a str {
    text.lines()
        .find(|l| l.starts_with(prefix))
        .unwrap_or_else(|| panic!("{what}: no line {prefix:?} in\n{text}"))
}

fn assert_blk_guest_passed(o: &Outcome, what: &str) {
    assert_eq!(o.status, Some(1), "{what}: {}\n{}", o.stdout, o.stderr);
    let line = line(&o.stdout, "virtio-blk op=", what);
    assert!(
        line.contains("ops=200") && line.contains("mismatches=0"),
        "{what}: {line}"
    );
}

#[test]
fn a_forbidden_call_from_each_role_ends_only_its_vm_and_is_reported() {
    // (role, the threads of that role that make the call first)
    let roles: &[(&str, &[&str])] = &[
        ("vcpu", &["lucid-vcpu0"]),
        ("backend", &["lucid-blk0-io", "lucid-serial-out"]),
        ("main", &["main", "lucid-signals"]),
    ];
    for (role, threads) in roles {
        let (mine, theirs) = (
            disk(&format!("{role}-bad"), 8),
            disk(&format!("{role}-good"), 8),
        );
        let neighbour = {
            let theirs = theirs.clone();
            std::thread::spawn(move || blk_run(&theirs, &[], &[]))
        };
        let o = blk_run(&mine, &[("LUCID_SECCOMP_SELFTEST", role)], &[]);
        assert!(!o.timed_out, "{role}: Lucid hung after the violation");
        assert_eq!(o.status, Some(VIOLATION), "{role}: {}", o.stderr);
        let report = line(&o.stderr, "lucid: seccomp: thread ", role);
        assert!(
            threads.iter().any(|t| report.starts_with(&format!(
                "lucid: seccomp: thread {t} (role {role}) made a forbidden system call: \
                 socket (41); Lucid stops with exit status 148"
            ))),
            "{role}: {report}"
        );
        // The VM beside it ran to the end, every block intact.
        assert_blk_guest_passed(&neighbour.join().unwrap(), &format!("beside {role}"));
        for img in [mine, theirs] {
            std::fs::remove_file(img).unwrap();
        }
    }
}

/// The vIOMMU's sidecore thread confines itself to role `iommu`: a forbidden call there ends the
/// VM and names the thread.
#[test]
fn a_forbidden_call_from_the_iommu_sidecore_is_reported() {
    let img = disk("iommu-bad", 8);
    let o = blk_run(
        &img,
        &[("LUCID_SECCOMP_SELFTEST", "iommu")],
        &["--iommu", "vtd,mode=sidecore"],
    );
    assert!(!o.timed_out, "Lucid hung after the violation");
    assert_eq!(o.status, Some(VIOLATION), "{}", o.stderr);
    let report = line(&o.stderr, "lucid: seccomp: thread ", "iommu");
    assert!(
        report.starts_with(
            "lucid: seccomp: thread lucid-vtd-sc (role iommu) made a forbidden system call: \
             socket (41)"
        ),
        "{report}"
    );
    std::fs::remove_file(img).unwrap();
}

#[test]
fn no_seccomp_turns_the_filters_off() {
    let img = disk("off", 8);
    let o = blk_run(
        &img,
        &[("LUCID_SECCOMP_SELFTEST", "vcpu")],
        &["--no-seccomp"],
    );
    // The vCPU's socket(2) went through (and was closed), so the guest ran to the end.
    assert_blk_guest_passed(&o, "--no-seccomp");
    assert!(!o.stderr.contains("lucid: seccomp:"), "{}", o.stderr);
    std::fs::remove_file(img).unwrap();
}

#[test]
fn every_thread_confines_itself_back_ends_restarted_after_resets_included() {
    // The hostile guest breaks its rings again and again; each reset and re-activation starts
    // a new back-end thread.
    let img = disk("evil", 8);
    let o = lucid(
        &[
            "run",
            "--guest",
            "virtio-evil",
            "--blk",
            &format!("path={},rung=L1", img.display()),
            "--net",
            "backend=echo,rung=L1",
        ],
        LIMIT,
    );
    assert!(
        o.stdout.contains("virtio-evil: survived"),
        "{}\n{}",
        o.stdout,
        o.stderr
    );
    let activations = o.counter("blk0.virtio.activations") + o.counter("net0.virtio.activations");
    assert!(activations > 2, "the guest re-activated its devices");
    // Each back-end thread, and the console's writer thread.
    assert_eq!(o.counter("seccomp.confined.backend"), activations + 1);
    assert_eq!(o.counter("seccomp.confined.vcpu"), 1);
    // The main thread and the signal thread.
    assert_eq!(o.counter("seccomp.confined.main"), 2);
    std::fs::remove_file(img).unwrap();
}
