//! `lucid bench sym`, part `swapbypass` (docs/symbiotic.md §6): the `sym-swap` guest's
//! workload swapping to a plain virtio-blk disk (`cache=none`, so the host page cache does not
//! hide the disk) against the same with SwapBypass's swap cache in front, in one run.
//!
//! - `swapbypass_speedup`: sequential passes, a cache that holds all the swap traffic (the
//!   paper's "cache + RAM ≥ working set" point): baseline time over cached time.
//! - `swapbypass_speedup_vs_ramdisk`: the same baseline on a RAM-backed file (`/dev/shm`,
//!   through the host page cache: the paper's "RAM disk" line) over the cached time: what the
//!   cache saves on the VMM's own path, with no disk latency in the baseline.
//! - `swapbypass_small_cache_speedup`: random touches with a cache of a quarter of the swapped
//!   set (write-backs happen; some avoided because the guest freed the slot).
//! - `swapbypass_small_cache_spy_speedup`: the same with `liveness=spy` (the SymSpy swap map
//!   answers liveness without an exit; SymCall only when there is no map).
//!
//! Each `lucid run` is a child process of this binary; times are the guest's own (TSC) for the
//! workload only. The disk's latency on a shared host varies a lot from run to run, so each
//! configuration runs 3 times (once with `--quick`), baseline and cached alternating, and the
//! median run of each counts.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use serde_json::{json, Value};

use super::{Figures, Opts};
use crate::field;

/// One workload run: the guest's time and Lucid's `sym.swap.*` counters.
struct Run {
    ms: u64,
    swapins: u64,
    swapouts: u64,
    swap: serde_json::Map<String, Value>,
    /// `sym.call.*`: the SymCalls the liveness questions cost.
    call: serde_json::Map<String, Value>,
}

/// A temporary disk image, removed on drop.
struct Image(PathBuf);

impl Drop for Image {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn image(dir: &Path, tag: &str, mib: u64) -> Result<Image, String> {
    let p = dir.join(format!(
        "lucid-bench-swapbypass-{}-{tag}.img",
        std::process::id()
    ));
    let f = std::fs::File::create(&p).map_err(|e| format!("{}: {e}", p.display()))?;
    f.set_len(mib << 20)
        .map_err(|e| format!("{}: {e}", p.display()))?;
    Ok(Image(p))
}

/// Where the disk image lives: a disk (opened `cache=none`) or RAM (`/dev/shm`, page cache).
#[derive(Clone, Copy)]
enum Disk {
    Direct,
    Ram,
}

fn run_one(
    exe: &Path,
    tag: &str,
    disk_mib: u64,
    swapcache_mib: Option<u64>,
    cmdline: &str,
) -> Result<Run, String> {
    run_on(exe, tag, Disk::Direct, disk_mib, swapcache_mib, "", cmdline)
}

fn run_on(
    exe: &Path,
    tag: &str,
    disk: Disk,
    disk_mib: u64,
    swapcache_mib: Option<u64>,
    extra: &str,
    cmdline: &str,
) -> Result<Run, String> {
    let (dir, opts) = match disk {
        Disk::Direct => (std::env::temp_dir(), ",cache=none"),
        Disk::Ram => (PathBuf::from("/dev/shm"), ""),
    };
    let img = image(&dir, tag, disk_mib)?;
    let stats = std::env::temp_dir().join(format!(
        "lucid-bench-swapbypass-{}-{tag}.json",
        std::process::id()
    ));
    let mut blk = format!("path={}{opts}", img.0.display());
    let mut cmd = Command::new(exe);
    cmd.args(["run", "--guest", "sym-swap", "--memory", "256"]);
    if let Some(mib) = swapcache_mib {
        blk.push_str(&format!(",swapcache={mib}{extra}"));
        cmd.arg("--symbiotic");
    }
    let out = cmd
        .args(["--blk", &blk, "--cmdline", cmdline, "--stats-json"])
        .arg(&stats)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("cannot run {}: {e}", exe.display()))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let counters: Value = std::fs::read_to_string(&stats)
        .ok()
        .and_then(|s| serde_json::from_str(&s).ok())
        .unwrap_or(Value::Null);
    let _ = std::fs::remove_file(&stats);
    let get = |k: &str| field::<u64>(&stdout, "sym-swap mib=", k);
    let (Some(ms), Some(swapins), Some(swapouts), Some(0)) = (
        get("ms"),
        get("swapins"),
        get("swapouts"),
        get("mismatches"),
    ) else {
        return Err(format!(
            "{tag}: the guest did not finish cleanly: {}{}",
            stdout,
            String::from_utf8_lossy(&out.stderr)
                .lines()
                .filter(|l| l.contains("error") || l.contains("cannot"))
                .collect::<Vec<_>>()
                .join("; ")
        ));
    };
    let sym = &counters["counters"]["sym"];
    let swap = sym["swap"].as_object().cloned().unwrap_or_default();
    let call = sym["call"].as_object().cloned().unwrap_or_default();
    Ok(Run {
        ms,
        swapins,
        swapouts,
        swap,
        call,
    })
}

/// The run of median time (of at least one).
fn median_run(runs: Vec<Run>) -> Run {
    lucid_stats::into_median_by(runs, |a, b| a.ms.cmp(&b.ms)).expect("one run or more")
}

fn ratio(a: u64, b: u64) -> Value {
    if b == 0 {
        return Value::Null;
    }
    json!((a as f64 / b as f64 * 100.0).round() / 100.0)
}

pub fn run(opts: &Opts) -> Result<Figures, String> {
    let exe = std::env::current_exe().map_err(|e| format!("cannot find lucid: {e}"))?;
    let (mib, resident, passes, reps) = if opts.quick {
        (8, 2, 2, 1)
    } else {
        (32, 8, 2, 3)
    };
    // Room for every swapped page and the guest's pending discards.
    let disk = mib + 8;
    let seq = format!("mib={mib} resident_mib={resident} passes={passes} pattern=seq");
    let rand = format!(
        "mib={mib} resident_mib={resident} passes={} pattern=rand discard_batch=256",
        passes + 1
    );
    let pair = |tag: &str, cache: u64, cmdline: &str| -> Result<(Run, Run), String> {
        let (mut base, mut cached) = (Vec::new(), Vec::new());
        for i in 0..reps {
            base.push(run_one(
                &exe,
                &format!("{tag}-base-{i}"),
                disk,
                None,
                cmdline,
            )?);
            cached.push(run_one(
                &exe,
                &format!("{tag}-cached-{i}"),
                disk,
                Some(cache),
                cmdline,
            )?);
        }
        Ok((median_run(base), median_run(cached)))
    };
    let (base, hot) = pair("seq", mib, &seq)?;
    let ram = (0..reps)
        .map(|i| run_on(&exe, &format!("ram-{i}"), Disk::Ram, disk, None, "", &seq))
        .collect::<Result<Vec<_>, _>>()
        .map(median_run);
    let small_mib = ((mib - resident) / 4).max(1);
    let (base_rand, small) = pair("rand", small_mib, &rand)?;
    // The same small cache asking the SymSpy map first (no exit per liveness question).
    let spy = (0..reps)
        .map(|i| {
            let tag = format!("rand-spy-{i}");
            run_on(
                &exe,
                &tag,
                Disk::Direct,
                disk,
                Some(small_mib),
                ",liveness=spy",
                &rand,
            )
        })
        .collect::<Result<Vec<_>, _>>()
        .map(median_run)?;
    let c = |r: &Run, k: &str| r.swap.get(k).and_then(Value::as_u64).unwrap_or(0);
    let mut f: Figures = vec![
        ("swapbypass_speedup".into(), ratio(base.ms, hot.ms)),
        ("swapbypass_baseline_ms".into(), json!(base.ms)),
        (
            "swapbypass_speedup_vs_ramdisk".into(),
            ram.as_ref().map_or(Value::Null, |r| ratio(r.ms, hot.ms)),
        ),
        (
            "swapbypass_ramdisk_ms".into(),
            ram.as_ref().map_or(Value::Null, |r| json!(r.ms)),
        ),
        ("swapbypass_cached_ms".into(), json!(hot.ms)),
        ("swapbypass_swapins".into(), json!(hot.swapins)),
        ("swapbypass_swapouts".into(), json!(hot.swapouts)),
        ("swapbypass_hits".into(), json!(c(&hot, "hits"))),
        ("swapbypass_misses".into(), json!(c(&hot, "misses"))),
        (
            "swapbypass_small_cache_speedup".into(),
            ratio(base_rand.ms, small.ms),
        ),
        (
            "swapbypass_small_cache_baseline_ms".into(),
            json!(base_rand.ms),
        ),
        ("swapbypass_small_cache_ms".into(), json!(small.ms)),
        ("swapbypass_small_cache_spy_ms".into(), json!(spy.ms)),
        (
            "swapbypass_small_cache_spy_speedup".into(),
            ratio(base_rand.ms, spy.ms),
        ),
        (
            "swapbypass_small_cache_hits".into(),
            json!(c(&small, "hits")),
        ),
        (
            "swapbypass_small_cache_misses".into(),
            json!(c(&small, "misses")),
        ),
        (
            "swapbypass_small_cache_writebacks".into(),
            json!(c(&small, "writebacks")),
        ),
        (
            "swapbypass_writebacks_avoided".into(),
            json!(c(&small, "writebacks_avoided")),
        ),
        (
            "swapbypass_liveness_symcall".into(),
            json!(c(&small, "liveness_symcall")),
        ),
        (
            "swapbypass_liveness_spy".into(),
            json!(c(&small, "liveness_spy")),
        ),
    ];
    // Mean SymCall time of the small-cache run's liveness questions (none: the SymSpy map
    // answered).
    let calls = small
        .call
        .get("completed")
        .and_then(Value::as_u64)
        .unwrap_or(0);
    let ns = small
        .call
        .get("ns_total")
        .and_then(Value::as_u64)
        .unwrap_or(0);
    f.push((
        "swapbypass_liveness_call_us".into(),
        if calls == 0 {
            Value::Null
        } else {
            json!((ns as f64 / calls as f64 / 10.0).round() / 100.0)
        },
    ));
    f.push((
        "swapbypass_workload".into(),
        json!(format!(
            "{mib} MiB working set in {resident} MiB of frames, {passes} seq passes / {} rand \
             passes, 4 KiB pages; disk cache=none; hot cache {mib} MiB, small cache {} MiB",
            passes + 1,
            (mib - resident) / 4
        )),
    ));
    Ok(f)
}
