//! The pools workloads under Lucid on real KVM: each guest runs and reports, and its
//! figures agree with the VMM's counters and with the host twin; no timing assertions.

mod common;

use std::time::Duration;

use common::{field, lucid, run_cmd, Outcome};

const LIMIT: Duration = Duration::from_secs(120);

fn num(out: &str, prefix: &str, key: &str) -> u64 {
    field(out, prefix, key)
        .unwrap_or_else(|| panic!("no {key}= on a {prefix:?} line in:\n{out}"))
        .parse()
        .unwrap_or_else(|e| panic!("{key}: {e}"))
}

/// Runs probe guest `guest` with `extra` arguments; it must end through its exit write
/// (status 1).
fn run_guest(guest: &str, extra: &[&str]) -> Outcome {
    let args: Vec<&str> = ["run", "--guest", guest]
        .iter()
        .chain(extra)
        .copied()
        .collect();
    let o = lucid(&args, LIMIT);
    assert_eq!(
        o.status,
        Some(1),
        "stdout: {}\nstderr: {}",
        o.stdout,
        o.stderr
    );
    o
}

/// Runs the guests' host twin (`noise-host`) with `args`; it must succeed.
fn run_host(args: &[&str]) -> Outcome {
    let mut host = std::process::Command::new(lucid_guests::noise_host_path());
    host.args(args);
    let h = run_cmd(host, LIMIT);
    assert_eq!(h.status, Some(0), "{}", h.stderr);
    h
}

#[test]
fn stream_fills_the_paced_sink_and_reports_its_bytes() {
    let o = run_guest(
        "stream",
        &["--net", "backend=sink,rate=1000", "--cmdline", "mib=16"],
    );
    let bytes = num(&o.stdout, "stream bytes", "bytes");
    let frames = num(&o.stdout, "stream bytes", "frames");
    assert!(bytes >= 16 << 20, "{bytes}");
    assert_eq!(bytes, frames * 1514);
    assert_eq!(num(&o.stdout, "stream bytes", "reported_bytes"), bytes);
    // The guest stops at its exit write: up to a queue of frames may still be in the ring.
    let sink = o.counter("net0.sink.bytes");
    let sink_frames = o.counter("net0.sink.frames");
    assert!(
        sink <= bytes && sink + 256 * 1514 >= bytes,
        "sink {sink}, guest {bytes}"
    );
    assert_eq!(sink, sink_frames * 1514);
    assert_eq!(o.counter("net0.sink.rate_bytes_per_s"), 125_000_000);
    // 1 Gbit/s in 10 ms windows, 1 ms of burst, one frame over.
    assert!(o.counter("net0.sink.window_max_bytes") <= 1_375_000 + 1514);
    // The guest blocked (hlt) on a full queue rather than kicking per chunk.
    assert!(num(&o.stdout, "stream bytes", "waits") > 0);
    // The guest's WORK hypercalls add up to what it reports.
    assert_eq!(o.counter("guest.work.bytes"), bytes);
}

#[test]
fn cpu_passes_match_the_host_twin() {
    let o = run_guest("cpu", &["--cmdline", "passes=20 report=8"]);
    assert_eq!(num(&o.stdout, "cpu mib", "passes"), 20);
    assert_eq!(num(&o.stdout, "cpu mib", "reports"), 3);
    let h = run_host(&["mode=cpu", "passes=20"]);
    assert_eq!(
        field(&o.stdout, "cpu mib", "checksum"),
        field(&h.stdout, "cpu mib", "checksum"),
        "guest: {}\nhost: {}",
        o.stdout,
        h.stdout
    );
    assert_eq!(o.counter("guest.work.iterations"), 20);
}

#[test]
fn noise_reports_an_ordered_spread_and_matches_the_host_twin() {
    let args = "quanta=200 iters=20000 warmup=5";
    let o = run_guest("noise", &["--cmdline", args]);
    let q = |k| num(&o.stdout, "noise quanta", k);
    assert_eq!(q("quanta"), 200);
    assert!(q("min_tsc") > 0);
    assert!(q("min_tsc") <= q("median_tsc"));
    assert!(q("median_tsc") <= q("p99_tsc"));
    assert!(q("p99_tsc") <= q("max_tsc"));
    assert!(q("max_tsc") <= q("total_tsc"));
    assert!(field(&o.stdout, "noise spread", "spread_p99").is_some());
    let h = run_host(&args.split(' ').collect::<Vec<_>>());
    assert_eq!(
        field(&o.stdout, "noise quanta", "checksum"),
        field(&h.stdout, "noise quanta", "checksum")
    );
    assert!(num(&h.stdout, "noise min_ns", "min_ns") <= num(&h.stdout, "noise min_ns", "max_ns"));
    assert_eq!(o.counter("guest.work.iterations"), 200);
}

#[test]
fn stream_without_a_device_fails_setup_cleanly() {
    let o = lucid(&["run", "--guest", "stream"], LIMIT);
    // Exit code 2 (setup): (2 << 1) | 1.
    assert_eq!(
        o.status,
        Some(5),
        "stdout: {}\nstderr: {}",
        o.stdout,
        o.stderr
    );
}
