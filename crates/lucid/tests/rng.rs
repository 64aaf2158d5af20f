//! virtio-rng end to end on real KVM, with the default seccomp filters: the `virtio-rng` probe
//! guest reads entropy that Lucid draws from the host's getrandom (its counters show every
//! byte), a rate-limited device makes the guest wait as long as its token bucket says, the
//! device writes through the vIOMMU, and Cloud Hypervisor's `rng` of a `vm.create` (what Kata
//! sends) gives the guest the device.

mod common;
mod rest_client;

use std::time::Duration;

use common::{field, lucid, tmp};
use rest_client::{eventually, have_curl, Server};
use serde_json::json;

const LIMIT: Duration = Duration::from_secs(60);

fn num(out: &str, key: &str) -> u64 {
    field(out, "virtio-rng: bytes=", key)
        .unwrap_or_else(|| panic!("no {key}= in the guest's result line: {out}"))
        .parse()
        .unwrap()
}

#[test]
fn the_guest_reads_64_kib_of_entropy() {
    let o = lucid(&["run", "--guest", "virtio-rng", "--rng"], LIMIT);
    assert_eq!(
        o.status,
        Some(1),
        "(0 << 1) | 1: {}\n{}",
        o.stdout,
        o.stderr
    );
    assert_eq!(num(&o.stdout, "bytes"), 65536, "{}", o.stdout);
    assert!(num(&o.stdout, "distinct") > 200, "{}", o.stdout);
    let requests = num(&o.stdout, "requests");
    assert_eq!(requests, 16, "4 KiB requests, each filled: {}", o.stdout);
    assert_eq!(o.counter("rng.bytes_written"), 65536);
    assert_eq!(o.counter("rng.requests"), requests);
    assert_eq!(o.counter("rng.errors"), 0);
    assert_eq!(o.counter("rng.rate_limited.throttled_events"), 0);
    assert_eq!(o.counter("rng.rate_limited.bw_bytes_per_s"), 0);
}

/// 32 KiB at 16 KiB/s with a one-second burst: the first 16 KiB at once, the rest at the rate,
/// so the guest waits at least 1 s (a lower bound the limiter sets, not a speed goal).
#[test]
fn a_rate_limited_device_makes_the_guest_wait() {
    let rate = 16384u64;
    let bytes = 32768u64;
    let o = lucid(
        &[
            "run",
            "--guest",
            "virtio-rng",
            "--rng",
            &format!("rate={rate}"),
            "--cmdline",
            &format!("bytes={bytes} chunk=1024"),
        ],
        LIMIT,
    );
    assert_eq!(
        o.status,
        Some(1),
        "(0 << 1) | 1: {}\n{}",
        o.stdout,
        o.stderr
    );
    assert_eq!(num(&o.stdout, "bytes"), bytes, "{}", o.stdout);
    assert_eq!(num(&o.stdout, "requests"), bytes / 1024, "{}", o.stdout);
    assert_eq!(o.counter("rng.bytes_written"), bytes);
    assert_eq!(o.counter("rng.rate_limited.bw_bytes_per_s"), rate);
    assert!(
        o.counter("rng.rate_limited.throttled_events") > 0,
        "the bucket never ran dry"
    );
    let floor_ms = (bytes - rate) * 1000 / rate;
    let ms = num(&o.stdout, "tsc_ms");
    // tsc_ms is 0 when the guest cannot tell the TSC's frequency; the host's throttled time
    // holds the same bound.
    if ms > 0 {
        assert!(
            ms >= floor_ms * 95 / 100,
            "{ms} ms < {floor_ms} ms: {}",
            o.stdout
        );
    }
    let waited_ms = o.counter("rng.rate_limited.throttled_ns") / 1_000_000;
    assert!(
        waited_ms >= floor_ms * 95 / 100,
        "waited {waited_ms} ms < {floor_ms} ms"
    );
}

/// Behind the vIOMMU: every buffer is an IOVA the guest mapped for its request; the device
/// writes through the translation and the unit records no fault.
#[test]
fn the_device_writes_through_the_viommu() {
    let o = lucid(
        &[
            "run",
            "--guest",
            "virtio-rng",
            "--rng",
            "--iommu",
            "vtd",
            "--cmdline",
            "iommu=vtd strategy=strict bytes=16384",
        ],
        LIMIT,
    );
    assert_eq!(
        o.status,
        Some(1),
        "(0 << 1) | 1: {}\n{}",
        o.stdout,
        o.stderr
    );
    assert_eq!(num(&o.stdout, "bytes"), 16384, "{}", o.stdout);
    assert!(o.stdout.contains("iommu-dma "), "{}", o.stdout);
    assert_eq!(o.counter("rng.bytes_written"), 16384);
    assert_eq!(o.counter("iommu.faults.dma"), 0);
    assert!(
        o.counter("iommu.iotlb.misses") > 0,
        "nothing was translated"
    );
}

#[test]
fn rng_of_vm_create_gives_the_guest_the_device() {
    if !have_curl() {
        return lucid_guests::skip_or_fail("curl is not installed (apt-get install curl)");
    }
    let serial = tmp("rng-rest.serial");
    let s = Server::start("rng-rest");
    let config = json!({
        "payload": {"kernel": "builtin:virtio-rng", "cmdline": "bytes=8192"},
        "cpus": {"boot_vcpus": 1, "max_vcpus": 1},
        "memory": {"size": 64u64 << 20},
        "serial": {"mode": "File", "file": serial},
        "console": {"mode": "Off"},
        "rng": {"src": "/dev/urandom", "iommu": false},
    });
    let (code, body) = s.curl("PUT", "vm.create", Some(&config));
    assert_eq!((code, body.as_str()), (204, ""));
    let info = s.json("GET", "vm.info");
    assert!(info["device_tree"]["rng"].is_object(), "{info}");
    assert_eq!(s.curl("PUT", "vm.boot", None).0, 204);
    let console = || std::fs::read_to_string(&serial).unwrap_or_default();
    assert!(
        eventually(|| console().contains("virtio-rng: bytes=")),
        "the guest never read its bytes: {}\n{}",
        console(),
        s.stderr()
    );
    assert_eq!(num(&console(), "bytes"), 8192, "{}", console());
    assert!(eventually(|| s.json("GET", "vm.counters")["rng"]
        ["bytes_written"]
        == 8192));
}
