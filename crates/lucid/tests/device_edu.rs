//! `lucid run --device edu` on real KVM: the device joins the PCI bus after the virtio devices
//! without disturbing a guest, and what Lucid cannot do is one clear error. (The probe guest that
//! drives edu from inside the VM has its own test.)

mod common;

use std::time::Duration;

use common::{disk, lucid};

const LIMIT: Duration = Duration::from_secs(60);

#[test]
fn hello_still_runs_with_edu_on_the_bus() {
    let o = lucid(&["run", "--guest", "hello", "--device", "edu"], LIMIT);
    assert!(
        o.stdout.contains("hello from the lucid probe kit"),
        "{}\n{}",
        o.stdout,
        o.stderr
    );
    assert_eq!(o.status, Some(1), "(0 << 1) | 1; stderr: {}", o.stderr);
    assert!(
        o.stderr.contains("edu: PCI 00:01.0") && o.stderr.contains("GSI 16"),
        "{}",
        o.stderr
    );
    // Its counters are registered (and nothing drove it).
    let stats = o.stats.as_ref().expect("stats JSON");
    for c in [
        "dma_reads",
        "dma_writes",
        "dma_bytes",
        "dma_errors",
        "irqs",
        "factorials",
    ] {
        assert_eq!(stats["counters"]["edu"][c], 0, "edu.{c}");
    }
}

#[test]
fn edu_takes_the_slot_after_the_virtio_devices() {
    let img = disk("edu-slot", 1);
    let blk = format!("path={}", img.display());
    let o = lucid(
        &[
            "run",
            "--guest",
            "hello",
            "--device",
            "edu",
            "--blk",
            &blk,
            "--net",
            "backend=sink",
        ],
        LIMIT,
    );
    let _ = std::fs::remove_file(&img);
    assert_eq!(o.status, Some(1), "{}", o.stderr);
    // blk0 in slot 1, net0 in 2, edu in 3 with INTx on the _PRT's GSI for slot 3.
    assert!(
        o.stderr.contains("edu: PCI 00:03.0") && o.stderr.contains("GSI 18"),
        "{}",
        o.stderr
    );
}

#[test]
fn what_edu_cannot_do_is_one_clear_error() {
    for (args, want) in [
        (
            &["--device", "edu,dma_mask=0xffffffff"][..],
            "unknown option \"dma_mask\"",
        ),
        (&["--device", "edu2"], "expected edu"),
        (&["--device", ""], "expected edu"),
        (
            &["--device", "edu", "--device", "edu"],
            "one edu device at most",
        ),
    ] {
        let mut a = vec!["run", "--guest", "hello"];
        a.extend_from_slice(args);
        let o = lucid(&a, LIMIT);
        assert_eq!(
            o.status,
            Some(lucid_vmm::EXIT_USAGE),
            "{args:?}: {}",
            o.stderr
        );
        assert!(o.stderr.contains(want), "{args:?}: {}", o.stderr);
        assert!(!o.stderr.contains("panicked"), "{args:?}: {}", o.stderr);
        assert!(
            !o.stdout.contains("hello from"),
            "{args:?}: refused before the run"
        );
    }
}
