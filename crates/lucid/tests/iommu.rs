//! The vIOMMU end to end on real KVM: the probe guests' VT-d driver (`guests/lib/x86/vtd.c`)
//! and DMA layer (`iommu_dma.c`) against Lucid's emulated VT-d, in samecore and sidecore
//! emulation. Behaviour and counts only: isolation (blocked DMA is recorded, signalled and
//! writes nothing), data through translation on every rung, the risk bounds of the paper's
//! Table 2 per mapping strategy, and a hostile driver.

mod common;

use std::path::Path;
use std::time::Duration;

use common::{disk, field, lucid, one_at_a_time, Outcome};

const LIMIT: Duration = Duration::from_secs(120);
const MODES: &[&str] = &["samecore", "sidecore"];

fn iommu_opt(mode: &str) -> String {
    format!("vtd,mode={mode},pin=map")
}

/// The virtio-blk probe guest on `img` (with the device options `dev`, e.g. `rung=L4`) behind
/// the VT-d in `mode`, running `cmdline`.
fn vtd_blk(img: &Path, dev: &str, mode: &str, cmdline: &str) -> Outcome {
    let mut blk = format!("path={}", img.display());
    if !dev.is_empty() {
        blk = format!("{blk},{dev}");
    }
    lucid(
        &[
            "run",
            "--guest",
            "virtio-blk",
            "--blk",
            &blk,
            "--iommu",
            &iommu_opt(mode),
            "--cmdline",
            cmdline,
        ],
        LIMIT,
    )
}

fn num(out: &str, prefix: &str, key: &str) -> u64 {
    field(out, prefix, key)
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {key}= on a line `{prefix}...` in:\n{out}"))
}

fn why(o: &Outcome) -> String {
    format!(
        "status {:?} timed_out {}\nstdout:\n{}\nstderr:\n{}",
        o.status, o.timed_out, o.stdout, o.stderr
    )
}

/// The edu device aims DMA at an IOVA never mapped, at one just unmapped under strict, at a
/// read-only mapping and reads a write-only one; an MSI names an IRTE that is not present.
/// Every case is blocked: a fault record with the right reason and source id, the fault
/// event, and the target page untouched (the guest checks its pattern); Lucid counts them.
#[test]
fn edu_dma_outside_the_mappings_is_blocked_recorded_and_signalled() {
    let _turn = one_at_a_time();
    for mode in MODES {
        let o = lucid(
            &[
                "run",
                "--guest",
                "iommu",
                "--device",
                "edu",
                "--iommu",
                &iommu_opt(mode),
            ],
            LIMIT,
        );
        let w = why(&o);
        assert_eq!(o.status, Some(1), "{mode}: {w}");
        let cases = num(&o.stdout, "iommu cases=", "cases");
        assert!(cases >= 6, "{mode}: {w}");
        assert_eq!(num(&o.stdout, "iommu cases=", "passed"), cases, "{w}");
        // Blocked: four DMAs (never mapped, after unmap, read-only, write-only) and the MSI
        // through a missing IRTE; the three blocked writes left their target page untouched.
        let blocked = num(&o.stdout, "iommu cases=", "blocked");
        assert!(blocked >= 5, "{mode}: {w}");
        assert!(num(&o.stdout, "iommu cases=", "untouched") >= 3, "{w}");
        assert_eq!(
            field(&o.stdout, "iommu cases=", "ir_fault"),
            Some("recorded"),
            "{mode}: {w}"
        );
        // Lucid's side: the blocked DMAs and the IR fault were recorded by the unit, and
        // the edu's transfers failed without a byte moved.
        assert!(o.counter("iommu.faults.dma") >= 4, "{mode}: {w}");
        assert!(o.counter("iommu.faults.ir") >= 1, "{mode}: {w}");
        assert!(o.counter("edu.dma_errors") >= 4, "{mode}: {w}");
    }
}

/// virtio-blk reads into an IOVA never mapped (equal to the target's physical address, so a
/// unit that did not translate would write the target) and into one just unmapped: IOERR,
/// a write fault recorded, the target untouched.
#[test]
fn blk_dma_outside_the_mappings_is_an_io_error() {
    let _turn = one_at_a_time();
    for mode in MODES {
        let img = disk(&format!("iso-{mode}"), 8);
        let o = vtd_blk(
            &img,
            "",
            mode,
            "op=rw count=200 qd=4 verify=1 iommu=vtd strategy=strict isolation=1",
        );
        let w = why(&o);
        assert_eq!(o.status, Some(1), "{mode}: {w}");
        assert_eq!(num(&o.stdout, "virtio-blk op=", "mismatches"), 0, "{w}");
        assert!(o.counter("iommu.faults.dma") >= 2, "{mode}: {w}");
        std::fs::remove_file(img).unwrap();
    }
}

/// Checksummed data through strict translation on every rung, both devices, both modes.
#[test]
fn data_is_intact_through_translation_on_every_rung() {
    let _turn = one_at_a_time();
    const RUNGS: &[(&str, &str)] = &[
        ("rung=L0", "irq"),
        ("rung=L1", "irq"),
        ("rung=L2", "irq"),
        ("rung=L4", "irq"),
        ("rung=L4p", "poll"),
    ];
    for mode in MODES {
        for (rung, gmode) in RUNGS {
            let img = disk(&format!("rung-{mode}"), 8);
            let o = vtd_blk(
                &img,
                rung,
                mode,
                &format!(
                    "op=rw pattern=rand count=300 qd=8 verify=1 mode={gmode} iommu=vtd \
                     strategy=strict"
                ),
            );
            let w = why(&o);
            assert_eq!(o.status, Some(1), "blk {mode} {rung}: {w}");
            assert_eq!(num(&o.stdout, "virtio-blk op=", "mismatches"), 0, "{w}");
            assert_eq!(num(&o.stdout, "virtio-blk op=", "ops"), 300, "{w}");
            assert_eq!(o.counter("iommu.faults.dma"), 0, "{mode} {rung}: {w}");
            assert_eq!(o.counter("blk0.errors"), 0, "{mode} {rung}: {w}");
            // The device's data and rings went through the unit: it translated, and the
            // guest's unmaps reached it (Caching Mode: maps too).
            assert!(o.counter("iommu.iotlb.misses") > 0, "{mode} {rung}: {w}");
            assert!(o.counter("iommu.inv.iotlb_page") > 0, "{mode} {rung}: {w}");
            std::fs::remove_file(img).unwrap();

            let o = lucid(
                &[
                    "run",
                    "--guest",
                    "virtio-net",
                    "--net",
                    &format!("backend=echo,{rung}"),
                    "--iommu",
                    &iommu_opt(mode),
                    "--cmdline",
                    &format!("op=rr size=1500 count=300 mode={gmode} iommu=vtd strategy=strict"),
                ],
                LIMIT,
            );
            let w = why(&o);
            assert_eq!(o.status, Some(1), "net {mode} {rung}: {w}");
            assert_eq!(num(&o.stdout, "virtio-net op=", "mismatches"), 0, "{w}");
            assert_eq!(num(&o.stdout, "virtio-net op=", "packets"), 300, "{w}");
            assert_eq!(o.counter("iommu.faults.dma"), 0, "{mode} {rung}: {w}");
        }
    }
}

/// The paper's Table 2 as assertions: strict and shared leave no stale mapping; deferred at
/// most 250 and teardown at most its quota (exact: counts). Time: each check of the guest's
/// limits leaves only mappings younger than 10 ms, so a flush is decided at most 10 ms plus the
/// longest gap between two checks after the oldest unmap (`decide_max_us`, both guest-measured:
/// a descheduled vCPU widens the gap, not the policy's share). The end-to-end window (to the
/// completed invalidation, which on a sidecore waits for its polling thread) includes the host's
/// scheduling, so it is only bounded loosely: a mapping left stale until the run ends would
/// still fail it. The guest's result line and what it reported to Lucid (`iommu.guest.*`) agree.
#[test]
fn risk_bounds_per_strategy() {
    let _turn = one_at_a_time();
    // The policy's limit (10 ms; the guest acts from 9 ms on) and the loose end-to-end bound.
    const LIMIT_US: u64 = 10_000;
    const WINDOW_SANITY_US: u64 = 1_000_000;
    let bounds: &[(&str, u64, bool)] = &[
        ("strict", 0, false),
        ("shared", 0, false),
        ("deferred", 250, true),
        ("teardown256", 256, true),
        ("teardown4096", 4096, true),
    ];
    for mode in MODES {
        for &(strategy, stale_bound, timed) in bounds {
            let img = disk(&format!("risk-{mode}"), 8);
            let o = vtd_blk(
                &img,
                "",
                mode,
                &format!(
                    "op=rw pattern=rand count=2000 qd=8 verify=1 iommu=vtd strategy={strategy}"
                ),
            );
            let w = why(&o);
            let what = format!("{mode} {strategy}");
            assert_eq!(o.status, Some(1), "{what}: {w}");
            assert_eq!(num(&o.stdout, "virtio-blk op=", "mismatches"), 0, "{w}");
            let stale_max = num(&o.stdout, "iommu-dma ", "stale_max");
            let window = num(&o.stdout, "iommu-dma ", "window_max_us");
            let decide = num(&o.stdout, "iommu-dma ", "decide_max_us");
            let gap = num(&o.stdout, "iommu-dma ", "check_gap_max_us");
            let maps = num(&o.stdout, "iommu-dma ", "maps");
            assert!(maps >= 2000, "{what}: {w}");
            assert!(
                stale_max <= stale_bound,
                "{what}: stale_max {stale_max}: {w}"
            );
            if timed {
                assert!(stale_max > 0, "{what}: nothing deferred: {w}");
                assert!(num(&o.stdout, "iommu-dma ", "flushes") > 0, "{what}: {w}");
                assert!(
                    decide <= LIMIT_US + gap,
                    "{what}: a flush decided {decide} us after the oldest unmap,                      longest gap between checks {gap} us: {w}"
                );
                // The window ends after the flush that was decided: never shorter.
                assert!(
                    window >= decide,
                    "{what}: window {window} decide {decide}: {w}"
                );
                assert!(
                    window <= WINDOW_SANITY_US,
                    "{what}: window {window} us: {w}"
                );
            } else {
                assert_eq!(window, 0, "{what}: {w}");
                assert_eq!(decide, 0, "{what}: {w}");
            }
            assert_eq!(o.counter("iommu.guest.stale_max"), stale_max, "{what}");
            assert_eq!(o.counter("iommu.guest.window_max_us"), window, "{what}");
            assert_eq!(o.counter("iommu.guest.maps"), maps, "{what}");
            assert_eq!(o.counter("iommu.faults.dma"), 0, "{what}: {w}");
            if strategy.starts_with("teardown") || strategy == "shared" {
                // Reuse is the point of these strategies: a random workload over 8 MiB still
                // maps the same header and status pages again and again.
                assert!(o.counter("iommu.guest.reuse_hits") > 0, "{what}: {w}");
            }
            std::fs::remove_file(img).unwrap();
        }
    }
}

/// The edu guest under the VT-d with interrupt remapping, for every strategy: its DMA round
/// trip, factorial and interrupts work through translation.
#[test]
fn edu_works_through_translation_and_interrupt_remapping() {
    let _turn = one_at_a_time();
    for mode in MODES {
        for strategy in ["strict", "async", "teardown256"] {
            let o = lucid(
                &[
                    "run",
                    "--guest",
                    "edu",
                    "--device",
                    "edu",
                    "--iommu",
                    &iommu_opt(mode),
                    "--cmdline",
                    &format!("iommu=vtd irq_remap=1 strategy={strategy} rounds=20"),
                ],
                LIMIT,
            );
            let w = why(&o);
            assert_eq!(o.status, Some(1), "{mode} {strategy}: {w}");
            for check in ["liveness", "factorial", "dma", "irq", "dma_irq"] {
                assert_eq!(field(&o.stdout, "edu ident=", check), Some("ok"), "{w}");
            }
            assert_eq!(o.counter("iommu.faults.dma"), 0, "{mode} {strategy}: {w}");
            assert!(o.counter("edu.dma_bytes") > 0, "{w}");
        }
    }
}

/// A hostile driver: garbage in every register, tables outside RAM or looping, queue
/// wrap-around and bad descriptors, wait descriptors aimed outside RAM, IRTEs with reserved
/// bits. Lucid records faults and neither panics nor hangs, and a normal setup at the end works.
#[test]
fn a_hostile_vtd_driver_hurts_only_itself() {
    let _turn = one_at_a_time();
    for mode in MODES {
        let o = lucid(
            &[
                "run",
                "--guest",
                "vtd-evil",
                "--device",
                "edu",
                "--iommu",
                &iommu_opt(mode),
            ],
            Duration::from_secs(300),
        );
        let w = why(&o);
        assert!(!o.timed_out, "{mode}: {w}");
        assert_eq!(o.status, Some(1), "{mode}: {w}");
        assert!(o.stdout.contains("vtd-evil: final setup ok"), "{mode}: {w}");
        assert!(
            o.counter("iommu.faults.dma") + o.counter("iommu.faults.ir") > 0,
            "{w}"
        );
    }
}

/// Register accesses: samecore traps every one; sidecore serves page 0 from memory (no exit)
/// and traps page 1 (fault recording). The guest also checks read-only registers stay put.
#[test]
fn register_accesses_trap_in_samecore_and_not_on_the_sidecore_page() {
    let _turn = one_at_a_time();
    let reads = 2000u64;
    let mut exits = Vec::new();
    for mode in MODES {
        let o = lucid(
            &[
                "run",
                "--guest",
                "vtd-regs",
                "--iommu",
                &iommu_opt(mode),
                "--cmdline",
                &format!("reads={reads} loop=page0"),
            ],
            LIMIT,
        );
        let w = why(&o);
        assert_eq!(o.status, Some(1), "{mode}: {w}");
        assert!(o.stdout.contains("vtd-regs: ok"), "{mode}: {w}");
        exits.push((
            o.counter("vcpu0.exit.mmio_read") + o.counter("vcpu0.exit.mmio_write"),
            w,
        ));
    }
    let (same, w) = &exits[0];
    assert!(
        *same >= reads,
        "samecore: {same} MMIO exits for {reads} reads: {w}"
    );
    let (side, w) = &exits[1];
    assert!(
        *side < reads / 10,
        "sidecore: {side} MMIO exits for {reads} reads: {w}"
    );
}
