//! `--jail` on real KVM: the jailed VMM runs as the jail's user with no capabilities and
//! no-new-privileges, in every thread, and its guest's disk and network work as without a jail;
//! bad jail options are refused before anything runs.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::{disk, field, lucid, lucid_plain, tmp};

const LIMIT: Duration = Duration::from_secs(120);
const JAIL: &str = "uid=65534,gid=65534";

/// `key:` of a `/proc/.../status` text, its tabs kept.
fn status_line<'a>(status: &'a str, key: &str) -> &'a str {
    status
        .lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))
        .unwrap_or_else(|| panic!("no {key} in {status}"))
}

/// Runs `lucid args`, hands back its stdout up to the line starting with `until`, the
/// `/proc/PID/status` of the process and of each of its threads (name, status) read then, and
/// kills it.
fn status_when(args: &[&str], until: &str) -> (String, String, Vec<(String, String)>) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_lucid"))
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let out = child.stdout.take().unwrap();
    let (tx, rx) = mpsc::channel();
    let reader = std::thread::spawn(move || {
        for line in BufReader::new(out).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let deadline = Instant::now() + LIMIT;
    let mut stdout = String::new();
    while let Ok(line) = rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
        stdout.push_str(&line);
        stdout.push('\n');
        if line.starts_with(until) {
            break;
        }
    }
    let pid = child.id();
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let mut threads = Vec::new();
    for t in std::fs::read_dir(format!("/proc/{pid}/task"))
        .into_iter()
        .flatten()
    {
        let t = t.unwrap().path();
        let comm = std::fs::read_to_string(t.join("comm")).unwrap_or_default();
        let st = std::fs::read_to_string(t.join("status")).unwrap_or_default();
        threads.push((comm.trim().to_string(), st));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    drop(rx);
    reader.join().unwrap();
    assert!(
        stdout.contains(until),
        "the guest never printed {until:?}:\n{stdout}"
    );
    (stdout, status, threads)
}

/// With and without seccomp: without it, no-new-privileges on the threads started before the
/// drop comes from the jail alone.
#[test]
fn the_jailed_vmm_runs_as_the_user_with_no_capabilities_and_its_disk_works() {
    for seccomp in [true, false] {
        jailed_disk(seccomp);
    }
}

fn jailed_disk(seccomp: bool) {
    let img = disk("jail-blk", 8);
    let blk = format!("path={},rung=L1", img.display());
    let mut args = vec![
        "run",
        "--guest",
        "virtio-blk",
        "--blk",
        &blk,
        "--cmdline",
        "op=write pattern=seq bs=4096 qd=4 count=128 verify=1 flush=1 hold=1 seed=0x5a",
        "--jail",
        JAIL,
    ];
    if !seccomp {
        args.push("--no-seccomp");
    }
    let (stdout, status, threads) = status_when(&args, "virtio-blk: holding");
    assert_eq!(status_line(&status, "Uid"), "\t65534\t65534\t65534\t65534");
    assert_eq!(status_line(&status, "Gid"), "\t65534\t65534\t65534\t65534");
    assert_eq!(status_line(&status, "Groups").trim(), "65534");
    for key in ["CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"] {
        assert_eq!(status_line(&status, key), "\t0000000000000000", "{key}");
    }
    assert_eq!(status_line(&status, "NoNewPrivs"), "\t1");
    // Every thread, those started before the drop included (the signal thread, the console's
    // writer): credentials are per thread, the drop reaches them all.
    for name in ["lucid-signals", "lucid-vcpu0", "lucid-blk0-io"] {
        assert!(
            threads.iter().any(|(n, _)| n == name),
            "no {name}: {threads:?}"
        );
    }
    for (name, st) in &threads {
        assert_eq!(
            status_line(st, "Uid"),
            "\t65534\t65534\t65534\t65534",
            "{name}"
        );
        for key in ["CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"] {
            assert_eq!(status_line(st, key), "\t0000000000000000", "{name} {key}");
        }
        assert_eq!(status_line(st, "NoNewPrivs"), "\t1", "{name}");
    }
    // The guest wrote, flushed and read back its disk through the jailed back-end.
    assert_eq!(
        field(&stdout, "virtio-blk op=", "ops"),
        Some("128"),
        "{stdout}"
    );
    assert_eq!(field(&stdout, "virtio-blk op=", "mismatches"), Some("0"));
    assert!(stdout.contains("virtio-blk flush status=0"), "{stdout}");
    let data = std::fs::read(&img).unwrap();
    assert_eq!(u64::from_le_bytes(data[8..16].try_into().unwrap()), 0x5a);
    std::fs::remove_file(img).unwrap();
}

#[test]
fn the_jailed_guest_network_works_as_without_a_jail() {
    let net = |jail: Option<&str>| {
        let mut args = vec![
            "run",
            "--guest",
            "virtio-net",
            "--net",
            "backend=echo,rung=L1",
            "--cmdline",
            "op=rr size=256 count=200 mode=irq",
        ];
        args.extend(jail.map(|j| ["--jail", j]).into_iter().flatten());
        let o = lucid(&args, LIMIT);
        assert!(!o.timed_out, "{jail:?}: Lucid hung");
        o
    };
    let plain = net(None);
    let jailed = net(Some(JAIL));
    assert!(
        jailed
            .stderr
            .contains("jail: running as uid 65534 gid 65534"),
        "{}",
        jailed.stderr
    );
    assert_eq!(jailed.status, plain.status, "{}", jailed.stderr);
    assert_eq!(jailed.status, Some(1), "the guest's success status");
    for o in [&plain, &jailed] {
        assert_eq!(field(&o.stdout, "virtio-net op=", "packets"), Some("200"));
        assert_eq!(field(&o.stdout, "virtio-net op=", "mismatches"), Some("0"));
    }
    // The statistics file, opened before the drop, is written after it.
    assert_eq!(jailed.counter("net0.rx_packets"), 200);
}

#[test]
fn a_chroot_jail_runs_the_guest() {
    let root = tmp("jail-root");
    std::fs::create_dir_all(&root).unwrap();
    let o = lucid(
        &[
            "run",
            "--guest",
            "virtio-net",
            "--net",
            "backend=echo",
            "--cmdline",
            "op=rr size=64 count=20 mode=irq",
            "--jail",
            &format!("{JAIL},chroot={}", root.display()),
        ],
        LIMIT,
    );
    assert_eq!(o.status, Some(1), "{}", o.stderr);
    assert!(o.stderr.contains("in chroot"), "{}", o.stderr);
    assert_eq!(field(&o.stdout, "virtio-net op=", "mismatches"), Some("0"));
    std::fs::remove_dir(root).unwrap();
}

#[test]
fn bad_jail_options_are_refused_before_anything_runs() {
    for (jail, says) in [
        (
            "uid=nobody,gid=65534",
            "--jail uid=nobody: expected a numeric id",
        ),
        ("uid=65534", "gid=N is required"),
        ("uid=65534,gid=65534,user=x", "unknown option \"user\""),
        ("uid=0,gid=0", "uid=0 or gid=0 is root's"),
        (
            "uid=65534,gid=65534,chroot=/nonexistent/lucid-jail",
            "chroot=/nonexistent/lucid-jail is not a directory",
        ),
    ] {
        let o = lucid_plain(&["run", "--guest", "hello", "--jail", jail], LIMIT);
        assert_eq!(o.status, Some(64), "{jail}: {}", o.stderr);
        assert!(o.stderr.contains(says), "{jail}: {}", o.stderr);
        assert!(!o.stderr.contains("panicked"), "{jail}: {}", o.stderr);
    }
}

/// A tap opened as root before the drop keeps working: the guest pings a host peer in a
/// namespace this test makes (its offload ioctls come after the drop, on the open tap).
#[test]
fn a_jailed_tap_backend_pings_a_host_peer() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return lucid_guests::skip_or_fail("the tap test needs root");
    }
    let ns = common::TapNamespace::new("jail", "lj0", Some("10.78.0.1/24"));
    let mut cmd = ns.command(env!("CARGO_BIN_EXE_lucid"));
    cmd.args([
        "run",
        "--guest",
        "virtio-net",
        "--net",
        "backend=tap:lj0,rung=L1",
        "--cmdline",
        "op=ping src=10.78.0.2 dst=10.78.0.1 count=20 size=98",
        "--jail",
        JAIL,
    ]);
    let o = common::run_cmd(cmd, LIMIT);
    drop(ns);
    assert_eq!(o.status, Some(1), "{}\n{}", o.stdout, o.stderr);
    assert!(
        o.stderr.contains("jail: running as uid 65534"),
        "{}",
        o.stderr
    );
    assert_eq!(
        field(&o.stdout, "virtio-net op=ping", "packets"),
        Some("20"),
        "{}",
        o.stdout
    );
    assert_eq!(
        field(&o.stdout, "virtio-net op=ping", "mismatches"),
        Some("0")
    );
}

/// `--jail` is VmConfig's `jail` section: `--print-config` shows it, and a `--config` file with
/// it runs jailed.
#[test]
fn the_jail_is_a_section_of_the_config_file() {
    let args = [
        "run",
        "--guest",
        "virtio-net",
        "--net",
        "backend=echo",
        "--cmdline",
        "op=rr size=64 count=20 mode=irq",
        "--jail",
        JAIL,
    ];
    let o = lucid_plain(&[&args[..], &["--print-config"]].concat(), LIMIT);
    assert_eq!(o.status, Some(0), "{}", o.stderr);
    let config: serde_json::Value = serde_json::from_str(&o.stdout).unwrap();
    assert_eq!(
        config["jail"],
        serde_json::json!({"uid": 65534, "gid": 65534, "chroot": null})
    );
    let file = tmp("jail-config.json");
    std::fs::write(&file, &o.stdout).unwrap();
    let o = lucid(&["run", "--config", file.to_str().unwrap()], LIMIT);
    assert_eq!(o.status, Some(1), "{}", o.stderr);
    assert!(
        o.stderr.contains("jail: running as uid 65534"),
        "{}",
        o.stderr
    );
    std::fs::remove_file(file).unwrap();
}

/// `lucid run` as an unprivileged member of a group that may open `/dev/kvm` (with no root-only
/// option): this host's `/dev/kvm` is root's alone, so the test gives a private mount namespace a
/// `/dev/kvm` of group 65533 and runs Lucid as uid 65534 in it, without and with a jail to its
/// own ids (a non-root caller may not chroot, change its ids or keep other groups).
#[test]
fn an_unprivileged_member_of_the_kvm_group_runs_and_jails_a_vm() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return lucid_guests::skip_or_fail("making a /dev/kvm in a mount namespace needs root");
    }
    let node = tmp("kvm-node");
    let _ = std::fs::remove_file(&node);
    let lucid_bin = env!("CARGO_BIN_EXE_lucid");
    let run = format!(
        "setpriv --reuid=65534 --regid=65533 --clear-groups --inh-caps=-all {lucid_bin} run \
         --guest virtio-net --net backend=echo --cmdline 'op=rr size=64 count=20 mode=irq'"
    );
    let script = format!(
        "set -e; mknod {n} c 10 232; chgrp 65533 {n}; chmod 660 {n}; mount --bind {n} /dev/kvm; \
         set +e; {run}; echo plain-status=$?; {run} --jail uid=65534,gid=65533; \
         echo jailed-status=$?; {run} --jail uid=65534,gid=65533,chroot=/; \
         echo chroot-status=$?",
        n = node.display()
    );
    let mut cmd = Command::new("unshare");
    cmd.args(["-m", "--propagation", "private", "sh", "-c", &script]);
    let o = common::run_cmd(cmd, LIMIT);
    let _ = std::fs::remove_file(&node);
    let all = format!("{}\n{}", o.stdout, o.stderr);
    assert_eq!(o.status, Some(0), "{all}");
    assert!(o.stdout.contains("plain-status=1"), "{all}");
    assert!(o.stdout.contains("jailed-status=1"), "{all}");
    assert!(
        o.stderr.contains("jail: running as uid 65534 gid 65533"),
        "{all}"
    );
    assert_eq!(
        o.stdout.matches("mismatches=0").count(),
        2,
        "both guests echoed every frame: {all}"
    );
    // A chroot needs CAP_SYS_CHROOT: refused before the guest runs, with Lucid's failure status.
    assert!(o.stdout.contains("chroot-status=70"), "{all}");
    assert!(o.stderr.contains("jail: chroot failed"), "{all}");
}
