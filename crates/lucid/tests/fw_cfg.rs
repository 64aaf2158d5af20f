//! QEMU's fw_cfg on real KVM: the `fw-cfg` probe guest reads the signature, ID, CPU count, RAM
//! size, command line and file directory through the ports, does DMA reads (one to an address
//! outside RAM, which must end with the error bit and nothing else), and finds the ACPI device
//! Linux binds; `--fw-cfg off` takes it all away.

mod common;

use std::time::Duration;

use common::{field, lucid};

const LIMIT: Duration = Duration::from_secs(60);

fn result<'a>(out: &'a str, key: &str) -> &'a str {
    field(out, "fw-cfg: sig=", key)
        .unwrap_or_else(|| panic!("no {key}= in the guest's result line: {out}"))
}

#[test]
fn the_guest_reads_what_qemu_would_give_it() {
    let o = lucid(
        &[
            "run",
            "--guest",
            "fw-cfg",
            "--vcpus",
            "2",
            "--memory",
            "96",
            "--cmdline",
            "cpus=2 ram_mib=96",
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
    let out = &o.stdout;
    assert_eq!(result(out, "id"), "0x3", "{out}");
    assert_eq!(result(out, "cpus"), "2", "{out}");
    assert_eq!(result(out, "max_cpus"), "2", "{out}");
    assert_eq!(result(out, "ram_mib"), "96", "{out}");
    for (k, v) in [
        ("dma_sig", "ok"),
        ("cmdline", "ok"),
        ("e820", "ok"),
        ("dma", "ok"),
        ("dma_bad", "error"),
        ("dma_write", "error"),
        ("acpi", "ok"),
    ] {
        assert_eq!(result(out, k), v, "{k}: {out}");
    }
    assert!(
        out.contains("fw-cfg: file key=0x20 size=20 name=etc/e820"),
        "{out}"
    );
    // e820 by DMA, the bad destination and the refused write.
    assert_eq!(o.counter("fw_cfg.dma_ops"), 3);
    assert_eq!(o.counter("fw_cfg.dma_errors"), 2);
    assert!(o.counter("fw_cfg.selects") >= 8);
    // The directory came in two `rep insb`: its bytes are counted one by one.
    assert!(o.counter("fw_cfg.reads") >= 4 + 64 + 20, "{:?}", o.stats);
}

/// The default vCPU count, checked against the MADT's.
#[test]
fn one_vcpu_by_default() {
    let o = lucid(&["run", "--guest", "fw-cfg"], LIMIT);
    assert_eq!(
        o.status,
        Some(1),
        "(0 << 1) | 1: {}\n{}",
        o.stdout,
        o.stderr
    );
    assert_eq!(result(&o.stdout, "cpus"), "1", "{}", o.stdout);
}

#[test]
fn fw_cfg_off_leaves_the_ports_unclaimed() {
    let o = lucid(&["run", "--guest", "fw-cfg", "--fw-cfg", "off"], LIMIT);
    // Exit status (2 << 1) | 1: no signature.
    assert_eq!(o.status, Some(5), "{}\n{}", o.stdout, o.stderr);
    assert!(
        o.stdout
            .contains("fw-cfg: no fw_cfg (signature ff ff ff ff)"),
        "{}",
        o.stdout
    );
    assert!(o.absent("fw_cfg"));
}
