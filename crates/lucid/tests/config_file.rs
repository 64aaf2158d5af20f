//! `lucid run --config FILE`: the same VM as the flags (compared through `--print-config`), a VM
//! from a file boots, a bad file is a usage error that names its problem; `--stats-prom`
//! writes the counters in the Prometheus text format.

mod common;

use std::time::Duration;

use common::{disk, lucid, tmp, Outcome};
use lucid_vmm::EXIT_USAGE;

const LIMIT: Duration = Duration::from_secs(30);

fn run(args: &[&str]) -> Outcome {
    common::lucid_plain(args, LIMIT)
}

/// `--print-config`'s JSON, which must exit 0.
fn printed(args: &[&str]) -> serde_json::Value {
    let o = run(&[args, &["--print-config"]].concat());
    assert_eq!(o.status, Some(0), "{args:?}: {}", o.stderr);
    serde_json::from_str(&o.stdout).unwrap_or_else(|e| panic!("{e}: {}", o.stdout))
}

fn write(name: &str, text: &str) -> String {
    let path = tmp(name);
    std::fs::write(&path, text).unwrap();
    path.to_str().unwrap().to_owned()
}

#[test]
fn the_same_vm_from_flags_and_from_the_file_has_the_same_config() {
    let img = disk("config-file", 1);
    let blk = format!("path={},bs=4096,rung=L2,coalesce=4:10", img.display());
    let serial = format!("file:{}", tmp("config-serial.txt").display());
    let flags = [
        "run",
        "--guest",
        "hello",
        "--cmdline",
        "code=3",
        "--vcpus",
        "2",
        "--memory",
        "64",
        "--blk",
        &blk,
        "--net",
        "backend=sink,rate=100",
        "--device",
        "edu",
        "--iommu",
        "vtd,mode=sidecore",
        "--balloon",
        "size=16,stats=on",
        "--rng",
        "rate=1000",
        "--symbiotic",
        "--pool",
        "none",
        "--serial",
        &serial,
        "--swap-pager",
        "off",
    ];
    let from_flags = printed(&flags);
    assert_eq!(from_flags["machine"]["vcpus"], 2);
    assert_eq!(from_flags["payload"]["kernel"]["builtin"]["name"], "hello");
    assert_eq!(from_flags["devices"]["pci"].as_array().unwrap().len(), 2);
    assert_eq!(from_flags["devices"]["rng"]["rate"], 1000);

    let file = write("config.json", &from_flags.to_string());
    let from_file = printed(&["run", "--config", &file]);
    assert_eq!(from_file, from_flags);
    // A file may leave out whatever has its default: the flags' defaults are the file's.
    let short = write(
        "config-short.json",
        r#"{"payload":{"kernel":{"builtin":{"name":"hello"}}}}"#,
    );
    assert_eq!(
        printed(&["run", "--config", &short]),
        printed(&["run", "--guest", "hello"])
    );
    let _ = std::fs::remove_file(img);
}

#[test]
fn a_vm_from_a_file_boots_and_writes_prometheus_counters() {
    let file = write(
        "config-boot.json",
        r#"{"payload":{"kernel":{"builtin":{"name":"hello"}},"cmdline":"code=5"},
            "machine":{"mem_mib":32}}"#,
    );
    let prom = tmp("config-boot.prom");
    let o = lucid(
        &[
            "run",
            "--config",
            &file,
            "--stats-prom",
            prom.to_str().unwrap(),
        ],
        LIMIT,
    );
    assert!(
        o.stdout.contains("hello from the lucid probe kit"),
        "{}\n{}",
        o.stdout,
        o.stderr
    );
    assert_eq!(o.status, Some(11), "(5 << 1) | 1; stderr: {}", o.stderr);
    let text = std::fs::read_to_string(&prom).expect("--stats-prom written");
    let _ = std::fs::remove_file(&prom);
    assert!(
        text.contains("# TYPE lucid_vcpu0_exits_total counter\n"),
        "{text}"
    );
    let exits: u64 = text
        .lines()
        .find_map(|l| l.strip_prefix("lucid_vcpu0_exits_total "))
        .expect("a vcpu0.exits sample")
        .parse()
        .unwrap();
    assert_eq!(exits, o.counter("vcpu0.exits"), "the same run's counters");
    assert!(exits > 0);
}

#[test]
fn bad_files_are_usage_errors_that_name_the_problem() {
    let hello = r#""payload":{"kernel":{"builtin":{"name":"hello"}}}"#;
    let cases = [
        ("not JSON", "nope".to_string(), "expected"),
        (
            "unknown field",
            format!(r#"{{{hello},"machine":{{"cpus":2}}}}"#),
            "unknown field `cpus`",
        ),
        (
            "no vCPUs",
            format!(r#"{{{hello},"machine":{{"vcpus":0}}}}"#),
            "--vcpus 0 is out of range",
        ),
        (
            "too many vCPUs for the type",
            format!(r#"{{{hello},"machine":{{"vcpus":300}}}}"#),
            "invalid value: integer `300`",
        ),
        (
            "too little memory",
            format!(r#"{{{hello},"machine":{{"mem_mib":1}}}}"#),
            "--memory 1 MiB is out of range",
        ),
        (
            "no payload",
            r#"{"machine":{"vcpus":1}}"#.to_string(),
            "missing field `payload`",
        ),
        (
            "an unknown built-in guest",
            r#"{"payload":{"kernel":{"builtin":{"name":"no-such"}}}}"#.to_string(),
            "no built-in guest \"no-such\"",
        ),
    ];
    for (what, text, says) in cases {
        let file = write("config-bad.json", &text);
        let o = run(&["run", "--config", &file]);
        assert_eq!(o.status, Some(EXIT_USAGE), "{what}: {}", o.stderr);
        assert!(o.stderr.contains(says), "{what}: {}", o.stderr);
    }
    let o = run(&["run", "--config", "/nonexistent/lucid.json"]);
    assert_eq!(o.status, Some(EXIT_USAGE), "{}", o.stderr);
    assert!(o.stderr.contains("cannot read --config"), "{}", o.stderr);

    // The flags that describe the VM are refused beside the file that describes it.
    let file = write("config-ok.json", &format!("{{{hello}}}"));
    for flag in [
        &["--vcpus", "2"][..],
        &["--guest", "hello"],
        &["--symbiotic"],
    ] {
        let o = run(&[&["run", "--config", &file][..], flag].concat());
        assert_eq!(o.status, Some(EXIT_USAGE), "{flag:?}: {}", o.stderr);
        assert!(o.stderr.contains("cannot be used with"), "{}", o.stderr);
    }
}

/// `--config` also takes Cloud Hypervisor's `VmConfig` (the body of `vm.create`, told apart by
/// its string `payload.kernel`): the same VM as the flags, and its refusals name the field.
#[test]
fn a_cloud_hypervisor_config_is_the_same_vm_as_the_flags() {
    let img = disk("config-ch", 1);
    let serial = tmp("config-ch-serial.txt");
    let flags = printed(&[
        "run",
        "--guest",
        "hello",
        "--vcpus",
        "2",
        "--memory",
        "64",
        "--blk",
        &format!("path={},ro=on", img.display()),
        "--serial",
        &format!("file:{}", serial.display()),
    ]);
    let ch = serde_json::json!({
        "payload": {"kernel": "builtin:hello"},
        "cpus": {"boot_vcpus": 2, "max_vcpus": 2},
        "memory": {"size": 64u64 << 20},
        "disks": [{"path": img, "readonly": true}],
        "serial": {"mode": "File", "file": serial},
    });
    let file = write("config-ch.json", &ch.to_string());
    assert_eq!(printed(&["run", "--config", &file]), flags);
    let o = run(&["run", "--config", &file]);
    assert_eq!(
        o.status,
        Some(1),
        "hello exits 0 through the debug port: {}",
        o.stderr
    );

    let bad = write(
        "config-ch-bad.json",
        r#"{"payload": {"kernel": "builtin:hello"}, "pmem": [{"file": "/x"}]}"#,
    );
    let o = run(&["run", "--config", &bad]);
    assert_eq!(o.status, Some(EXIT_USAGE), "{}", o.stderr);
    assert!(o.stderr.contains("pmem"), "{}", o.stderr);
}
