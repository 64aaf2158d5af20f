//! Every `lucid bench` subcommand once, in its quickest form: it succeeds and each goal figure of
//! its `--json` is present and a finite number. The values are not judged (a loaded CI machine is
//! no place to measure); what this catches is a benchmark that no longer runs end to end or no
//! longer reports a figure the docs quote.
//!
//! The benchmarks run in turn: each wants the host's CPUs to itself.

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::Value;

use common::{one_at_a_time, run_cmd};

/// `lucid bench ARGS --json`: its JSON, after checking that it exited 0 within `limit`.
fn bench(args: &[&str], limit: Duration) -> Value {
    let _turn = one_at_a_time();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_lucid"));
    cmd.arg("bench").args(args).arg("--json");
    let start = Instant::now();
    let o = run_cmd(cmd, limit);
    eprintln!(
        "lucid bench {}: {:.1} s",
        args.join(" "),
        start.elapsed().as_secs_f64()
    );
    assert!(
        !o.timed_out && o.status == Some(0),
        "lucid bench {args:?}: status {:?} (timed out: {})\nstdout: {}\nstderr: {}",
        o.status,
        o.timed_out,
        o.stdout,
        o.stderr
    );
    serde_json::from_str(&o.stdout)
        .unwrap_or_else(|e| panic!("lucid bench {args:?}: no JSON ({e}): {}", o.stdout))
}

/// Asserts that each of `keys` (a path of object keys) in `j` is a finite number.
fn assert_finite(j: &Value, keys: &[&[&str]]) {
    for path in keys {
        let mut v = j;
        for k in *path {
            v = v
                .get(k)
                .unwrap_or_else(|| panic!("no {path:?} in the JSON (missing {k:?}): {j}"));
        }
        let x = v
            .as_f64()
            .unwrap_or_else(|| panic!("{path:?} is not a number but {v}: {j}"));
        assert!(x.is_finite(), "{path:?} = {x}: {j}");
    }
}

#[test]
fn bench_exits() {
    let j = bench(
        &["exits", "--count", "1000", "--runs", "1"],
        Duration::from_secs(120),
    );
    assert_finite(
        &j,
        &[
            &["lucid_us"],
            &["floor_us"],
            &["lucid_over_floor"],
            &["qemu_over_lucid"],
            &["start_to_first_output_ms", "lucid"],
        ],
    );
}

#[test]
fn bench_io() {
    let j = bench(
        &["io", "--count", "100", "--runs", "1"],
        Duration::from_secs(300),
    );
    let workloads = j["workloads"].as_object().expect("workloads");
    assert!(!workloads.is_empty(), "{j}");
    assert!(j["vsock_mb_per_s"].as_f64().is_some_and(|x| x > 0.0), "{j}");
    for w in workloads.keys() {
        assert_finite(
            &j["workloads"][w],
            &[
                &["lucid_best_over_native"],
                &["lucid_best_over_qemu_best"],
                // The ladder's goal: exits per I/O at L4.
                &["rungs", "L4", "exits_per_io"],
                &["rungs", "L4p", "exits_per_io"],
            ],
        );
    }
    // qemu-storage-daemon's vhost-user-blk beside Lucid's own, where Debian's daemon is here.
    if std::path::Path::new("/usr/bin/qemu-storage-daemon").exists() {
        assert_finite(
            &j["vhost_user_blk_over_builtin"],
            &[&["qd1", "ratio"], &["qd32", "ratio"]],
        );
    }
}

#[test]
fn bench_iommu() {
    // One workload per device kind, both rungs, and the assigned device.
    let j = bench(
        &[
            "iommu",
            "--count",
            "100",
            "--runs",
            "1",
            "--workloads",
            "blk-randread-4k-qd1,net-rr-64,assigned",
        ],
        Duration::from_secs(300),
    );
    let goals: [&[&str]; 3] = [
        &["sidecore_teardown_over_off"],
        &["sidecore_over_samecore_strict"],
        &["teardown_hit_rate"],
    ];
    assert_finite(&j, &goals);
    // The edu in its own process over vfio-user.
    assert_finite(
        &j,
        &[
            &["assigned_teardown_over_off"],
            &["assigned_strict_over_off"],
        ],
    );
    for rung in ["L1", "L4p"] {
        assert_finite(&j["by_rung"][rung], &goals);
    }
}

#[test]
fn bench_pools() {
    let j = bench(&["pools", "--quick"], Duration::from_secs(300));
    assert_finite(
        &j,
        &[
            &["guest_to_backend_ms_per_mb_pools_over_default"],
            &["link_utilisation_pools"],
            &["link_utilisation_default"],
            &["low_noise_compute_over_native"],
        ],
    );
}

#[test]
fn bench_swap() {
    // The goal figures come from the re-read workload (a) at the tightest limit; CI machines
    // have no swap, which the limits need behind them.
    let j = bench(
        &["swap", "--quick", "--workloads", "a", "--make-swap", "512"],
        Duration::from_secs(600),
    );
    assert_finite(
        &j,
        &[
            &["mapper_swap_writes_over_baseline"],
            &["vswapper_speedup_over_baseline"],
            &["vswapper_over_balloon"],
        ],
    );
}

#[test]
fn bench_sym() {
    let j = bench(&["sym", "--quick"], Duration::from_secs(300));
    assert_finite(
        &j,
        &[
            &["symspy_exits_per_update"],
            &["symcall_cold_us"],
            &["symcall_warm_us"],
            &["symcall_warm_over_exit"],
            &["swapbypass_speedup"],
            &["module_load_us"],
        ],
    );
}

#[test]
fn bench_api() {
    let j = bench(&["api", "--runs", "1"], Duration::from_secs(120));
    assert_finite(
        &j,
        &[
            &["create_to_first_output_ms"],
            &["create_ms"],
            &["boot_ms"],
            &["first_output_ms"],
            &["flags_to_first_output_ms"],
        ],
    );
}
