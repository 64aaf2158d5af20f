//! SwapBypass end to end (docs/symbiotic.md §6): the `sym-swap` guest swaps
//! its own pages to a virtio-blk disk with Lucid's swap cache in front (`swapcache=MiB`) and
//! verifies every byte it reads back. Hot (the cache holds all swap traffic), cold (a tiny
//! cache) and full (write-backs, some avoided because the guest freed the slot); a `kill -9`
//! after the guest's flush loses nothing it flushed; the same guest without `--symbiotic` is
//! the baseline. Real KVM.

mod common;

use std::process::Command;
use std::time::Duration;

use common::*;

const LIMIT: Duration = Duration::from_secs(60);

/// A disk image, removed when the test ends (passed or not).
struct Img(std::path::PathBuf);

impl Drop for Img {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// A run of sym-swap with `blk` options (`path=` added) and guest `cmdline`.
fn run(tag: &str, sym: bool, blk: &str, cmdline: &str) -> (Outcome, Img) {
    let img = Img(disk(tag, 16));
    let img_path = &img.0;
    let blk = format!("path={},{blk}", img_path.display());
    let mut args = vec![
        "run",
        "--guest",
        "sym-swap",
        "--memory",
        "64",
        "--blk",
        &blk,
        "--cmdline",
        cmdline,
    ];
    if sym {
        args.push("--symbiotic");
    }
    let o = lucid(&args, LIMIT);
    assert!(!o.timed_out, "{tag}: timed out: {}", o.stdout);
    (o, img)
}

fn num(o: &Outcome, key: &str) -> u64 {
    field(&o.stdout, "sym-swap mib=", key)
        .unwrap_or_else(|| panic!("no {key}= in: {}\n{}", o.stdout, o.stderr))
        .parse()
        .unwrap()
}

/// The guest checked every page it read back and Lucid's counts agree with its swap-ins.
fn intact(o: &Outcome, tag: &str) {
    // Guest exit 0 is Lucid's 1 (the debug-exit port's convention).
    assert_eq!(o.status, Some(1), "{tag}: {}\n{}", o.stdout, o.stderr);
    assert_eq!(num(o, "mismatches"), 0, "{tag}");
    assert!(
        num(o, "swapins") > 0 && num(o, "swapouts") > 0,
        "{tag}: swapping happened"
    );
    assert_eq!(
        o.counter("sym.swap.hits") + o.counter("sym.swap.misses"),
        num(o, "swapins"),
        "{tag}: every guest swap-in is one cache lookup"
    );
    assert_eq!(
        o.counter("sym.swap.writes_cached"),
        num(o, "swapouts"),
        "{tag}: every swap-out landed in the cache"
    );
    let wb = o.counter("sym.swap.writebacks") - o.counter("sym.swap.flush_writebacks");
    let avoided =
        o.counter("sym.swap.writebacks_avoided") - o.counter("sym.swap.flush_writebacks_avoided");
    assert!(
        wb + avoided <= o.counter("sym.swap.evictions"),
        "{tag}: a write-back (done or avoided) per dirty eviction at most"
    );
}

#[test]
fn hot_cache_serves_every_swap_in() {
    let (o, img) = run(
        "hot",
        true,
        "swapcache=16",
        "mib=8 resident_mib=2 passes=2 pattern=seq",
    );
    intact(&o, "hot");
    assert_eq!(o.counter("sym.swap.hits"), num(&o, "swapins"));
    assert_eq!(o.counter("sym.swap.misses"), 0);
    assert_eq!(o.counter("sym.swap.evictions"), 0);
    assert_eq!(
        o.counter("sym.swap.bytes_written_disk"),
        0,
        "nothing reached the disk"
    );
    assert_eq!(o.counter("sym.swap.discards"), num(&o, "discards"));
    drop(img);
}

#[test]
fn cold_cache_misses_and_still_reads_back_every_byte() {
    let (o, img) = run(
        "cold",
        true,
        "swapcache=1,cache=none",
        "mib=8 resident_mib=2 passes=2 pattern=seq",
    );
    intact(&o, "cold");
    // A 1 MiB cache streams 6 MiB of swap: every read comes from the disk.
    assert_eq!(o.counter("sym.swap.misses"), num(&o, "swapins"));
    assert!(o.counter("sym.swap.evictions") > 0);
    assert!(o.counter("sym.swap.writebacks") > 0);
    assert_eq!(
        o.counter("sym.swap.bytes_read_disk"),
        num(&o, "swapins") * 4096
    );
    drop(img);
}

#[test]
fn full_cache_writes_back_and_avoids_dead_slots() {
    // Random touches free slots soon after they were written; lazy discards leave them dead in
    // the cache, where eviction finds them.
    let (o, img) = run(
        "full",
        true,
        "swapcache=1",
        "mib=8 resident_mib=2 passes=3 pattern=rand discard_batch=256",
    );
    intact(&o, "full");
    assert!(o.counter("sym.swap.hits") > 0, "some swap-ins hit");
    assert!(o.counter("sym.swap.misses") > 0, "some miss");
    assert!(o.counter("sym.swap.writebacks") > 0, "write-backs happen");
    assert!(
        o.counter("sym.swap.writebacks_avoided") > 0,
        "some are avoided: {:?}",
        o.stats.as_ref().map(|s| &s["counters"]["sym"]["swap"])
    );
    // With the SymCall runtime, SLOT_LIVE answers every question (the map is the fallback).
    if o.counter("sym.call.calls") > 0 {
        assert_eq!(
            o.counter("sym.swap.liveness_symcall"),
            o.counter("sym.call.completed")
        );
        assert_eq!(o.counter("sym.swap.symcall_errors"), 0);
    }
    // Each avoided write-back was a liveness answer (SymCall, or the SymSpy swap map).
    assert!(
        o.counter("sym.swap.liveness_symcall") + o.counter("sym.swap.liveness_spy")
            >= o.counter("sym.swap.writebacks_avoided")
    );
    drop(img);
}

#[test]
fn liveness_from_the_spy_map_needs_no_symcall() {
    let (o, img) = run(
        "spy",
        true,
        "swapcache=1,liveness=spy",
        "mib=8 resident_mib=2 passes=3 pattern=rand discard_batch=256",
    );
    intact(&o, "spy");
    assert!(o.counter("sym.swap.writebacks_avoided") > 0);
    assert!(o.counter("sym.swap.liveness_spy") > 0);
    assert_eq!(o.counter("sym.swap.liveness_symcall"), 0);
    assert_eq!(o.counter("sym.call.calls"), 0, "no SymCall asked");
    drop(img);
}

#[test]
fn the_same_guest_without_symbiotic_is_the_baseline() {
    let (o, img) = run(
        "base",
        false,
        "cache=none",
        "mib=8 resident_mib=2 passes=2 pattern=seq",
    );
    assert_eq!(o.status, Some(1), "{}\n{}", o.stdout, o.stderr);
    assert!(o.stdout.contains("sym: not offered"), "{}", o.stdout);
    assert_eq!(num(&o, "mismatches"), 0);
    assert!(num(&o, "swapins") > 0);
    assert!(
        o.absent("sym"),
        "no swap cache: without --symbiotic no sym counter at all"
    );
    drop(img);
}

#[test]
fn swapcache_is_refused_without_symbiotic_and_on_l0() {
    for (sym, blk, want) in [
        (false, "swapcache=4", "--symbiotic"),
        (true, "swapcache=4,rung=L0", "rung=L1"),
        (true, "swapcache=4,bs=512", "bs"),
    ] {
        let (o, img) = run("refused", sym, blk, "mib=1 resident_mib=1");
        assert!(
            !o.stdout.contains("sym-swap: start"),
            "{blk}: the VM must not start"
        );
        assert!(o.stderr.contains(want), "{blk}: {}", o.stderr);
        assert!(!o.stderr.contains("panicked"), "{}", o.stderr);
        drop(img);
    }
}

/// The guest's page content (guests/x86/sym-swap.c `fill`).
fn page_ok(w: &[u64], page: u64, ver: u64) -> bool {
    let base = lucid_guests::pagecache::mix64(page.wrapping_mul(0x1_0000_0001) ^ ver);
    w[0] == page
        && w[1] == ver
        && (2..512)
            .all(|k| w[k] == base.wrapping_add((k as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15)))
}

#[test]
fn kill_9_after_the_guest_flushed_loses_nothing_flushed() {
    // A cache larger than the swap traffic: before the flush nothing is on the disk.
    let guard = Img(disk("kill9", 16));
    let img = guard.0.clone();
    let stats = tmp("kill9-stats.json");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_lucid"));
    cmd.args([
        "run",
        "--guest",
        "sym-swap",
        "--memory",
        "64",
        "--symbiotic",
        "--blk",
    ])
    .arg(format!("path={},swapcache=16", img.display()))
    .args([
        "--cmdline",
        "mib=8 resident_mib=2 passes=2 pattern=rand flush=1 hold=1",
        "--stats-json",
    ])
    .arg(&stats);
    let mut flushed = None;
    let mut mismatches = None;
    run_until_then_kill(cmd, "sym-swap: holding", LIMIT, |line| {
        if line.starts_with("sym-swap flushed") {
            flushed = Some(line.to_string());
        }
        if line.starts_with("sym-swap mib=") {
            mismatches = field(line, "sym-swap mib=", "mismatches").map(str::to_string);
        }
    });
    let _ = std::fs::remove_file(&stats);
    let flushed = flushed.expect("the guest flushed");
    assert_eq!(mismatches.as_deref(), Some("0"));
    let get = |k: &str| -> u64 {
        field(&flushed, "sym-swap flushed", k)
            .unwrap()
            .parse()
            .unwrap()
    };
    assert_eq!(get("status"), 0);
    let (swapped, swapsum) = (get("swapped"), get("swapsum"));
    assert!(swapped > 0);
    // Every non-zero slot of the image holds a swapped page, whole and at its last version,
    // each page once; together they are the guest's swapped set.
    let data = std::fs::read(&img).unwrap();
    drop(guard);
    let (mut found, mut sum) = (0u64, 0u64);
    let mut pages = std::collections::HashSet::new();
    for (slot, s) in data.chunks_exact(4096).enumerate() {
        if s.iter().all(|&b| b == 0) {
            continue;
        }
        let w: Vec<u64> = s
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert!(page_ok(&w, w[0], w[1]), "slot {slot}: not a whole page");
        assert!(pages.insert(w[0]), "page {} in two slots", w[0]);
        found += 1;
        sum = sum.wrapping_add((w[0] << 32).wrapping_add(w[1]));
    }
    assert_eq!(found, swapped, "every flushed page is on the disk");
    assert_eq!(sum, swapsum, "each at the version the guest last wrote");
}
