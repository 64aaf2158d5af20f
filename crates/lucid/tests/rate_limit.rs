//! Rate limiters on real KVM, driven through the REST API: a probe guest that asks for more
//! than its device's limit gets the limit, within 5 %, over 5 s of steady state (measured from
//! the device's own counters, sampled through `vm.counters`, over the host's clock between the
//! samples), loses nothing (the guests check every byte), and a change made through
//! `lucid.rate-limit` while it runs takes effect: the next 3 s run at the new limit, and
//! removing the limit lets the guest finish at full speed. One test each for blk (bytes, then
//! operations), net (an echo NIC, bytes) and rng (bytes).

mod common;
mod rest_client;

use std::path::Path;
use std::time::{Duration, Instant};

use common::{field, tmp};
use rest_client::{eventually, have_curl, raw, Server};
use serde_json::{json, Value};

/// The steady span measured at the first limit, and at the second.
const FIRST: Duration = Duration::from_secs(5);
const SECOND: Duration = Duration::from_secs(3);
/// Left for the bucket to settle after a change (one refill time of the limits used here).
const SETTLE: Duration = Duration::from_millis(1200);

/// One counter of `vm.counters` (`dev`, `name`) at a moment: the midpoint of the request.
fn sample(s: &Server, dev: &str, names: &[&str]) -> (Instant, u64) {
    let t0 = Instant::now();
    let (code, body) = raw(
        &s.socket,
        b"GET /api/v1/vm.counters HTTP/1.1\r\nHost: x\r\n\r\n",
    )
    .expect("vm.counters answers");
    let t1 = Instant::now();
    assert_eq!(code, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    let sum = names.iter().map(|n| v[dev][*n].as_u64().unwrap_or(0)).sum();
    (t0 + (t1 - t0) / 2, sum)
}

/// Units per second of `names` of `dev` over `span`.
fn rate(s: &Server, dev: &str, names: &[&str], span: Duration) -> f64 {
    let (t0, v0) = sample(s, dev, names);
    std::thread::sleep(span);
    let (t1, v1) = sample(s, dev, names);
    (v1 - v0) as f64 / (t1 - t0).as_secs_f64()
}

/// Within 5 % of `limit`; never above it by more than 5 %.
fn within(what: &str, got: f64, limit: f64) {
    let err = (got - limit) / limit;
    eprintln!(
        "{what}: {got:.0}/s for a limit of {limit:.0}/s ({:+.2} %)",
        err * 100.0
    );
    assert!(
        err.abs() <= 0.05,
        "{what}: {got:.0}/s is not within 5 % of {limit:.0}/s"
    );
}

fn set_limit(s: &Server, id: &str, cfg: Value) {
    let (code, body) = s.curl(
        "PUT",
        "lucid.rate-limit",
        Some(&json!({"id": id, "rate_limiter_config": cfg})),
    );
    assert_eq!((code, body.as_str()), (204, ""), "{}", s.stderr());
}

fn per_second(n: u64) -> Value {
    json!({"size": n, "refill_time": 1000})
}

/// Boots `config` on a fresh server; waits until `dev`'s `names` passed `warm` (the first
/// bucket spent, the guest at the limit).
fn boot(tag: &str, config: Value, dev: &str, names: &[&str], warm: u64) -> Server {
    let s = Server::start(tag);
    let (code, body) = s.curl("PUT", "vm.create", Some(&config));
    assert_eq!((code, body.as_str()), (204, ""));
    assert_eq!(s.curl("PUT", "vm.boot", None).0, 204, "{}", s.stderr());
    assert!(
        eventually(|| sample(&s, dev, names).1 >= warm),
        "{dev} never passed {warm}: {}",
        s.stderr()
    );
    s
}

fn vm(kernel: &str, cmdline: &str, serial: &Path) -> Value {
    json!({
        "payload": {"kernel": kernel, "cmdline": cmdline},
        "cpus": {"boot_vcpus": 1, "max_vcpus": 1},
        "memory": {"size": 128u64 << 20},
        "serial": {"mode": "File", "file": serial},
        "console": {"mode": "Off"},
    })
}

/// Waits for the guest's whole result line (`prefix`) on the console; returns the console.
fn result(s: &Server, serial: &Path, prefix: &str) -> String {
    let console = || std::fs::read_to_string(serial).unwrap_or_default();
    let whole = |c: String| c.find(prefix).is_some_and(|at| c[at..].contains('\n'));
    assert!(
        eventually(|| whole(console())),
        "no {prefix:?} on the console: {}\n{}",
        console(),
        s.stderr()
    );
    console()
}

fn disk(tag: &str) -> std::path::PathBuf {
    let p = tmp(&format!("{tag}.img"));
    std::fs::File::create(&p)
        .unwrap()
        .set_len(64 << 20)
        .unwrap();
    p
}

fn skip() -> bool {
    if !have_curl() {
        lucid_guests::skip_or_fail("curl is not installed (apt-get install curl)");
        return true;
    }
    false
}

const BLK_BYTES: &[&str] = &["bytes_read", "bytes_written"];

/// Bytes: Cloud Hypervisor's `rate_limiter_config` on a disk of `vm.create`, 1 MiB/s, then
/// 2 MiB/s; 16 KiB reads and writes, every block written read back and checked.
#[test]
fn a_disk_keeps_to_its_bandwidth_and_follows_a_change() {
    if skip() {
        return;
    }
    let img = disk("rl-blk-bw");
    let serial = tmp("rl-blk-bw.serial");
    let mib = 1u64 << 20;
    let mut config = vm(
        "builtin:virtio-blk",
        "op=rw bs=16384 qd=4 count=2000 verify=1 timeout_ms=60000",
        &serial,
    );
    config["disks"] = json!([{"path": img, "rate_limiter_config": {"bandwidth": per_second(mib)}}]);
    let s = boot("rl-blk-bw", config, "blk0", BLK_BYTES, 2 * mib);
    within("blk bytes", rate(&s, "blk0", BLK_BYTES, FIRST), mib as f64);
    set_limit(&s, "blk0", json!({"bandwidth": per_second(2 * mib)}));
    std::thread::sleep(SETTLE);
    within(
        "blk bytes after the change",
        rate(&s, "blk0", BLK_BYTES, SECOND),
        2.0 * mib as f64,
    );
    let c = s.json("GET", "vm.counters");
    assert_eq!(c["blk0"]["rate_limited.bw_bytes_per_s"], 2 * mib, "{c}");
    assert!(
        c["blk0"]["rate_limited.throttled_events"].as_u64() > Some(0),
        "{c}"
    );
    // No limit: the guest finishes its requests and the read-back of every block.
    set_limit(&s, "blk0", Value::Null);
    let out = result(&s, &serial, "virtio-blk op=");
    assert_eq!(field(&out, "virtio-blk op=", "ops"), Some("2000"), "{out}");
    assert_eq!(
        field(&out, "virtio-blk op=", "mismatches"),
        Some("0"),
        "{out}"
    );
    let c = s.json("GET", "vm.counters");
    assert_eq!(c["blk0"]["errors"], 0, "{c}");
    assert_eq!(c["blk0"]["rate_limited.bw_bytes_per_s"], 0, "{c}");
    let _ = std::fs::remove_file(img);
}

/// Operations: `ops=` of Lucid's flag in the `lucid` extension, 200/s, then 400/s.
#[test]
fn a_disk_keeps_to_its_operations_and_follows_a_change() {
    if skip() {
        return;
    }
    let img = disk("rl-blk-ops");
    let serial = tmp("rl-blk-ops.serial");
    let mut config = vm(
        "builtin:virtio-blk",
        "op=rw bs=4096 qd=4 count=5000 verify=1 timeout_ms=60000",
        &serial,
    );
    config["lucid"] = json!({"blk": [format!("path={},ops=200", img.display())]});
    let s = boot("rl-blk-ops", config, "blk0", &["requests"], 400);
    within("blk ops", rate(&s, "blk0", &["requests"], FIRST), 200.0);
    set_limit(&s, "blk0", json!({"ops": per_second(400)}));
    std::thread::sleep(SETTLE);
    within(
        "blk ops after the change",
        rate(&s, "blk0", &["requests"], SECOND),
        400.0,
    );
    set_limit(&s, "blk0", Value::Null);
    let out = result(&s, &serial, "virtio-blk op=");
    assert_eq!(field(&out, "virtio-blk op=", "ops"), Some("5000"), "{out}");
    assert_eq!(
        field(&out, "virtio-blk op=", "mismatches"),
        Some("0"),
        "{out}"
    );
    let c = s.json("GET", "vm.counters");
    assert_eq!(c["blk0"]["errors"], 0, "{c}");
    assert!(
        c["blk0"]["rate_limited.ops_deferred"].as_u64() > Some(0),
        "{c}"
    );
    let _ = std::fs::remove_file(img);
}

/// An echo NIC limited to 150 kB/s each way (`bw=` of `--net`), then 300 kB/s: the guest's
/// request-response of 1000-byte frames, each compared byte for byte with what it sent.
#[test]
fn a_nic_keeps_to_its_bandwidth_and_follows_a_change() {
    if skip() {
        return;
    }
    let serial = tmp("rl-net.serial");
    let mut config = vm(
        "builtin:virtio-net",
        "op=rr size=1000 count=4000 timeout_ms=60000",
        &serial,
    );
    config["lucid"] = json!({"net": ["backend=echo,bw=150000"]});
    let s = boot("rl-net", config, "net0", &["tx_bytes"], 300_000);
    within(
        "net tx bytes",
        rate(&s, "net0", &["tx_bytes"], FIRST),
        150_000.0,
    );
    set_limit(&s, "net0", json!({"bandwidth": per_second(300_000)}));
    std::thread::sleep(SETTLE);
    within(
        "net tx bytes after the change",
        rate(&s, "net0", &["tx_bytes"], SECOND),
        300_000.0,
    );
    set_limit(&s, "net0", Value::Null);
    let out = result(&s, &serial, "virtio-net op=");
    assert_eq!(
        field(&out, "virtio-net op=", "packets"),
        Some("4000"),
        "{out}"
    );
    assert_eq!(
        field(&out, "virtio-net op=", "mismatches"),
        Some("0"),
        "{out}"
    );
    let c = s.json("GET", "vm.counters");
    assert_eq!(c["net0"]["rx_packets"], 4000, "{c}");
    assert_eq!(c["net0"]["rx_dropped_no_buffers"], 0, "{c}");
}

/// The rng's `rate=` (8 KiB/s), raised to 32 KiB/s through the API, then removed.
#[test]
fn the_rng_follows_a_change_of_its_rate() {
    if skip() {
        return;
    }
    let serial = tmp("rl-rng.serial");
    let mut config = vm(
        "builtin:virtio-rng",
        "bytes=262144 chunk=1024 timeout_ms=60000",
        &serial,
    );
    config["lucid"] = json!({"rng": "rate=8192"});
    let s = boot("rl-rng", config, "rng", &["bytes_written"], 16384);
    within(
        "rng bytes",
        rate(&s, "rng", &["bytes_written"], FIRST),
        8192.0,
    );
    set_limit(&s, "rng", json!({"bandwidth": per_second(32768)}));
    std::thread::sleep(SETTLE);
    within(
        "rng bytes after the change",
        rate(&s, "rng", &["bytes_written"], SECOND),
        32768.0,
    );
    set_limit(&s, "rng", Value::Null);
    let out = result(&s, &serial, "virtio-rng: bytes=");
    assert_eq!(
        field(&out, "virtio-rng: bytes=", "bytes"),
        Some("262144"),
        "{out}"
    );
}

/// The endpoint's answers: 404 for a device the VM lacks, 400 for limits that do not parse or
/// a device with no limiter; before boot there is no device to change.
#[test]
fn the_endpoint_refuses_what_it_cannot_do() {
    if skip() {
        return;
    }
    let serial = tmp("rl-api.serial");
    let s = Server::start("rl-api");
    let put = |body: Value| s.curl("PUT", "lucid.rate-limit", Some(&body)).0;
    let mut config = vm("builtin:spin", "", &serial);
    config["lucid"] = json!({"net": ["backend=echo"], "device": ["edu"]});
    assert_eq!(s.curl("PUT", "vm.create", Some(&config)).0, 204);
    let ok = json!({"id": "net0", "rate_limiter_config": {"ops": per_second(10)}});
    assert_eq!(put(ok.clone()), 500, "not booted");
    assert_eq!(s.curl("PUT", "vm.boot", None).0, 204);
    assert_eq!(put(ok), 204);
    assert_eq!(put(json!({"id": "nope", "rate_limiter_config": null})), 404);
    assert_eq!(put(json!({"id": "edu", "rate_limiter_config": null})), 400);
    let zero = json!({"id": "net0", "rate_limiter_config": {"ops": {"size": 0, "refill_time": 1}}});
    assert_eq!(put(zero), 400);
    assert_eq!(
        put(json!({"id": "net0", "rate_limiter_config": {"bw": 1}})),
        400
    );
    assert_eq!(put(json!({"id": "net0"})), 400);
    assert_eq!(put(json!({"id": "net0", "rate_limiter_config": null})), 204);
}
