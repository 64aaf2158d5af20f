//! The exit status table (README "Exit status"): a usage error and a Lucid failure each have one
//! even code, neither 0 nor 2 (a triple fault) nor any debug-exit code (odd), and --help and
//! --version still exit 0.

mod common;

use std::process::Command;
use std::time::Duration;

use common::{lucid, tmp};
use lucid_vmm::{EXIT_FAILURE, EXIT_USAGE};

const LIMIT: Duration = Duration::from_secs(30);

fn run(args: &[&str]) -> (Option<i32>, String, String) {
    let o = Command::new(env!("CARGO_BIN_EXE_lucid"))
        .args(args)
        .output()
        .expect("run lucid");
    (
        o.status.code(),
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

#[test]
fn the_codes_collide_with_nothing() {
    for code in [EXIT_USAGE, EXIT_FAILURE] {
        assert_eq!(code % 2, 0, "{code}: debug-exit codes are odd");
        assert!(![0, 2, 148].contains(&code), "{code}");
        assert!(!(128..=128 + 64).contains(&code), "{code}: a signal's");
    }
    assert_ne!(EXIT_USAGE, EXIT_FAILURE);
}

#[test]
fn usage_errors_exit_with_the_usage_code_in_one_format() {
    for args in [
        // clap's own: a range, an unknown flag, a missing subcommand.
        &["run", "--vcpus", "0"][..],
        &["run", "--vcpus", "255"],
        &["run", "--memory", "1"],
        &["run", "--memory-limit", "8"],
        &["run", "--no-such-flag"],
        // Lucid's sub-option parsers.
        &["run", "--blk", "colour=red"],
        &["run", "--blk", "path=/x,path=/y"],
        &["run", "--net", "backend=udp"],
        &["run", "--iommu", "amd"],
        &["run", "--serial", "tcp:1234"],
        &["run", "--backing", "floppy"],
        &["run", "--guest", "no-such-guest"],
        &["pools", "create", "--def", "name=a,cpus=0"],
        // VmConfig::validate.
        &[
            "run", "--guest", "hello", "--device", "edu", "--device", "edu",
        ],
        &["run", "--low-noise", "--pool", "io"],
        &["run", "--guest", "hello", "--blk", "path=/x,swapcache=8"],
    ] {
        let (code, _, err) = run(args);
        assert_eq!(code, Some(EXIT_USAGE), "{args:?}: {err}");
        assert!(err.starts_with("error: "), "{args:?}: one format: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
    // No command at all: clap prints the help, on stderr, as a usage error.
    let (code, _, err) = run(&[]);
    assert_eq!(code, Some(EXIT_USAGE), "{err}");
}

#[test]
fn a_kernel_lucid_cannot_load_is_a_failure() {
    let junk = tmp("exit-status-junk.bin");
    std::fs::write(&junk, b"not a kernel ".repeat(100)).unwrap();
    let o = lucid(&["run", "--kernel", junk.to_str().unwrap()], LIMIT);
    let _ = std::fs::remove_file(&junk);
    assert_eq!(o.status, Some(EXIT_FAILURE), "{}", o.stderr);
    assert!(o.stderr.starts_with("lucid: "), "{}", o.stderr);
}

#[test]
fn help_and_version_exit_zero() {
    for args in [
        &["--help"][..],
        &["--version"],
        &["run", "--help"],
        &["pools", "create", "--help"],
    ] {
        let (code, out, err) = run(args);
        assert_eq!(code, Some(0), "{args:?}: {err}");
        assert!(!out.is_empty(), "{args:?}");
    }
    // The sub-options' help comes from their tables.
    let (_, out, _) = run(&["run", "--help"]);
    for key in [
        "swapcache=MiB",
        "backend=tap:IFNAME|echo|sink",
        "pin=all|map|deferred",
    ] {
        assert!(out.contains(key), "{key}: {out}");
    }
    let (_, out, _) = run(&["pools", "create", "--help"]);
    assert!(out.contains("slice_us=N"), "{out}");
}
