//! VSWAPPER end to end on real KVM: the `pagecache` guest (a guest OS with a page cache
//! over virtio-blk, every byte it reads checked) under a per-VM memory limit with each swap mode.
//!
//! - The guest's workloads pass with no limit (they and the host twin of their data agree), and
//!   a corrupted image is caught (the checker works).
//! - The consistency gate: random read/write/flush/discard/CPU-store sequences under memory
//!   pressure, with every swap mode, under a limit and a test swap file: every frame still shows
//!   what the guest read, never a block's newer content; `kill -9` in the middle of a durable run
//!   loses nothing the guest had flushed.
//! - The Swap Mapper: the re-read workload writes (almost) no swap; baseline writes plenty.
//! - Hostile guest I/O (unaligned, split, overlapping, out-of-range buffers and sectors): refused
//!   or served right, nothing around the buffers touched, the device keeps working.
//!
//! The tests under `--memory-limit` make their own swap file and remove it; guest RAM is kept
//! under the limit by Lucid's pager (docs/vswapper.md §7), which pages it out all along, so
//! every mode runs with its pages really evicted.

mod common;

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{field, lucid, one_at_a_time, tmp, Outcome};
use lucid_guests::pagecache::{self, BLOCK, DEFAULT_SEED, VER_ZERO};
use lucid_swap::limit::SwapFile;

const LIMIT: Duration = Duration::from_secs(300);
const MODES: &[&str] = &["baseline", "mapper", "vswapper"];

/// A disk image for the guest: `file_mib` MiB of version-0 blocks plus `extra_mib` MiB of zeros,
/// removed on drop.
struct Image(PathBuf);

impl Image {
    fn new(tag: &str, file_mib: u64, extra_mib: u64) -> Image {
        let p = tmp(&format!("{tag}.img"));
        pagecache::make_image(&p, file_mib * 256, extra_mib * 256, DEFAULT_SEED).unwrap();
        Image(p)
    }

    fn blk(&self) -> String {
        format!("path={},block_size=4096", self.0.display())
    }

    /// The options the mapper modes need: 4 KiB blocks and no host caching (as the paper runs
    /// every configuration).
    fn blk_direct(&self) -> String {
        format!("{},cache=none", self.blk())
    }
}

impl Drop for Image {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// A swap file for the tests that run under a memory limit (swapoff and removed on drop).
fn swap_file(mib: u64) -> SwapFile {
    SwapFile::create(&std::env::temp_dir(), mib << 20).expect("a test swap file (root, ext4/xfs)")
}

/// The VM's own cgroup's figure `key` of memory.stat at exit (`swap.host.memcg.<key>`): per VM,
/// unlike `/proc/vmstat`, which other processes' swapping pollutes.
fn memcg(o: &Outcome, key: &str) -> u64 {
    o.counter(&format!("swap.host.memcg.{key}"))
}

/// Guest RAM really left under the limit: in baseline Lucid's pager paged anonymous guest RAM
/// out (the kernel cannot here); in the mapper modes the kernel's own reclaim may be enough
/// (mapped guest pages are clean file pages), so the pager or the kernel did. The pager never
/// had to give up.
fn assert_paged(o: &Outcome, mode: &str, what: &str) {
    let pager = o.counter("swap.pager.chunks") > 0 && o.counter("swap.pager.bytes") > 0;
    assert!(
        pager || (mode != "baseline" && memcg(o, "pgpgout") > 0),
        "{what}: nothing left guest RAM: {:?}",
        o.stats
    );
    assert_eq!(o.counter("swap.pager.stalls"), 0, "{what}");
}

fn run_guest(blk: &str, memory_mib: u64, extra: &[&str], cmdline: &str) -> Outcome {
    let mem = memory_mib.to_string();
    let mut args = vec![
        "run",
        "--guest",
        "pagecache",
        "--memory",
        &mem,
        "--blk",
        blk,
    ];
    args.extend_from_slice(extra);
    args.extend_from_slice(&["--cmdline", cmdline]);
    lucid(&args, LIMIT)
}

/// The guest passed: exit status 1 (code 0), a `PASS` line, no mismatch.
fn assert_pass(o: &Outcome, what: &str) {
    assert!(!o.timed_out, "{what}: Lucid hung\n{}", o.stdout);
    assert!(
        o.status == Some(1) && o.stdout.lines().any(|l| l == "PASS"),
        "{what}: status {:?}\n{}\n{}",
        o.status,
        o.stdout,
        o.stderr
    );
    assert_eq!(
        field(&o.stdout, "pagecache done", "mismatches"),
        Some("0"),
        "{what}"
    );
    assert!(!o.stdout.contains("MISMATCH"), "{what}: {}", o.stdout);
}

/// `key=` of every `pagecache iter=` line, in order.
fn iter_values(out: &str, key: &str) -> Vec<u64> {
    out.lines()
        .filter(|l| l.starts_with("pagecache iter="))
        .filter_map(|l| {
            l.split_whitespace()
                .find_map(|w| w.strip_prefix(key)?.strip_prefix('='))
                .and_then(|v| v.parse().ok())
        })
        .collect()
}

#[test]
fn workloads_pass_without_a_limit() {
    let img = Image::new("wl", 16, 0);
    // (a) re-read: the first pass reads the disk, the second only the cache.
    let o = run_guest(&img.blk(), 128, &[], "mode=reread mib=16 iters=2");
    assert_pass(&o, "reread");
    assert_eq!(iter_values(&o.stdout, "disk_blocks"), vec![16 * 256, 0]);
    assert_eq!(iter_values(&o.stdout, "hits"), vec![0, 16 * 256]);
    assert!(o.counter("blk0.requests") >= 16 * 256 / 32);
    // (a)+(b): re-read, then the cache's frames are allocated, zeroed, filled and read back.
    let o = run_guest(&img.blk(), 128, &[], "mode=alloc mib=16");
    assert_pass(&o, "alloc");
    assert_eq!(iter_values(&o.stdout, "disk_blocks"), vec![16 * 256, 0]);
    // (c) compression over file data: every chunk decompresses to what was read.
    let o = run_guest(&img.blk(), 128, &[], "mode=compress mib=8 iters=2");
    assert_pass(&o, "compress");
    let out = field(&o.stdout, "pagecache compress iter=", "out_bytes")
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap();
    assert!(out > 0 && out < 8 << 20, "compressed to {out} bytes");
    // A cache smaller than the file: every pass reads the disk again (the clock evicts).
    let o = run_guest(
        &img.blk(),
        128,
        &[],
        "mode=reread mib=16 iters=2 cache_mib=8",
    );
    assert_pass(&o, "reread with a small cache");
    assert_eq!(
        iter_values(&o.stdout, "disk_blocks"),
        vec![16 * 256, 16 * 256]
    );
}

#[test]
fn a_wrong_block_on_the_disk_is_caught() {
    let img = Image::new("wrong", 4, 0);
    // Block 100 holds block 101's content, block 200 a newer version of itself.
    {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(&img.0)
            .unwrap();
        f.write_all_at(&pagecache::block(101, DEFAULT_SEED, 0), 100 * BLOCK as u64)
            .unwrap();
        f.write_all_at(&pagecache::block(200, DEFAULT_SEED, 3), 200 * BLOCK as u64)
            .unwrap();
    }
    let o = run_guest(&img.blk(), 128, &[], "mode=reread mib=4 iters=1");
    assert_eq!(o.status, Some(3), "{}", o.stdout);
    assert_eq!(
        field(&o.stdout, "pagecache done", "mismatches"),
        Some("2"),
        "{}",
        o.stdout
    );
    assert!(o
        .stdout
        .contains("MISMATCH what=reread block=100 ver=0 word=0"));
    assert!(o
        .stdout
        .contains("MISMATCH what=reread block=200 ver=0 word=2"));
    assert!(o.stdout.contains("FAIL"));
}

#[test]
fn consistency_sequences_pass_without_a_limit() {
    let img = Image::new("cons", 8, 0);
    let o = run_guest(
        &img.blk(),
        128,
        &[],
        "mode=consistency mib=8 rounds=3 ops=128 pressure_mib=16",
    );
    assert_pass(&o, "consistency");
    for key in ["writes", "discards", "stores", "fresh_reads"] {
        let n: u64 = field(&o.stdout, "pagecache consistency", key)
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        assert!(n > 0, "no {key}: {}", o.stdout);
    }
}

#[test]
fn hostile_guest_io_is_refused_or_served_right() {
    let img = Image::new("hostile", 4, 0);
    let o = run_guest(&img.blk(), 128, &[], "mode=hostile mib=4");
    assert_pass(&o, "hostile");
    let cases = o
        .stdout
        .lines()
        .filter(|l| l.starts_with("pagecache hostile case="))
        .count();
    assert!(cases >= 12, "{}", o.stdout);
    assert!(
        o.stdout.contains("pagecache hostile failed=0"),
        "{}",
        o.stdout
    );
    assert!(o.counter("blk0.errors") >= 6);
}

/// Hostile I/O with the mapper installed: the same cases, each mode, under a limit.
#[test]
fn hostile_guest_io_every_swap_mode() {
    let _turn = one_at_a_time();
    let _swap = swap_file(512);
    for mode in MODES {
        let img = Image::new(&format!("hostile-{mode}"), 4, 0);
        let o = run_guest(
            &img.blk_direct(),
            128,
            &["--memory-limit", "64", "--swap-mode", mode],
            "mode=hostile mib=4",
        );
        assert_pass(&o, &format!("hostile {mode}"));
        assert!(o.stdout.contains("pagecache hostile failed=0"), "{mode}");
    }
}

/// Reads the image back: block `b`, sector `s` (512 bytes) equals which of `candidates`?
fn durable_ok(img: &Path, blocks: u64, round: u64) -> Result<(), String> {
    let mut f = std::fs::File::open(img).unwrap();
    let mut buf = vec![0u8; blocks as usize * BLOCK];
    f.read_exact(&mut buf).unwrap();
    for b in 0..blocks {
        let got = &buf[b as usize * BLOCK..(b as usize + 1) * BLOCK];
        let now = pagecache::block(b, DEFAULT_SEED, pagecache::durable_state(b, round));
        let next = pagecache::block(b, DEFAULT_SEED, pagecache::durable_state(b, round + 1));
        for s in 0..BLOCK / 512 {
            let r = s * 512..(s + 1) * 512;
            if got[r.clone()] != now[r.clone()] && got[r.clone()] != next[r.clone()] {
                let v = u64::from_le_bytes(got[16..24].try_into().unwrap());
                return Err(format!(
                    "block {b} sector {s}: neither round {round} nor {} (holds version {v:#x}, \
                     zero = {VER_ZERO:#x})",
                    round + 1
                ));
            }
        }
    }
    Ok(())
}

/// Starts the durable workload, kills Lucid with SIGKILL once the guest reported `rounds`
/// flushed rounds, and checks the image holds at least everything flushed.
fn durable_kill9(extra: &[&str], tag: &str, memory: u64, mib: u64, rounds: u64) {
    let img = Image::new(tag, mib, 0);
    let mem = memory.to_string();
    let blk = img.blk_direct_if(extra);
    let mut child = Command::new(env!("CARGO_BIN_EXE_lucid"))
        .args([
            "run",
            "--guest",
            "pagecache",
            "--memory",
            &mem,
            "--blk",
            &blk,
        ])
        .args(extra)
        .args([
            "--cmdline",
            &format!("mode=durable mib={mib} rounds=1000000"),
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let pid = child.id();
    let mut last = 0;
    let start = Instant::now();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut seen = String::new();
    let mut line = String::new();
    while out.read_line(&mut line).unwrap_or(0) > 0 {
        seen.push_str(&line);
        if let Some(r) = line.trim().strip_prefix("pagecache durable flushed round=") {
            last = r.parse().unwrap();
            if last >= rounds {
                // SAFETY: kill(2) on our own child's pid; it has not been reaped yet.
                unsafe { libc::kill(pid as i32, libc::SIGKILL) };
                break;
            }
        }
        if start.elapsed() > LIMIT {
            let _ = child.kill();
            panic!("{tag}: no round {rounds} in time:\n{seen}");
        }
        line.clear();
    }
    let st = child.wait().unwrap();
    assert!(
        last >= rounds,
        "{tag}: the guest stopped early ({st}):\n{seen}"
    );
    // Every line read after the kill was printed before it: the round printed last is flushed.
    let rest = {
        let mut s = String::new();
        let _ = out.read_to_string(&mut s);
        s
    };
    for l in rest.lines() {
        if let Some(r) = l.strip_prefix("pagecache durable flushed round=") {
            last = last.max(r.parse().unwrap());
        }
    }
    if let Err(e) = durable_ok(&img.0, mib * 256, last) {
        panic!("{tag}: after kill -9 at round {last}: {e}");
    }
    remove_leftover_cgroups(pid);
}

impl Image {
    fn blk_direct_if(&self, extra: &[&str]) -> String {
        if extra.contains(&"--swap-mode") {
            self.blk_direct()
        } else {
            self.blk()
        }
    }
}

/// A `kill -9`ed Lucid cannot remove its memory cgroup: remove what it left (empty now).
fn remove_leftover_cgroups(pid: u32) {
    for root in ["/sys/fs/cgroup/memory/lucid", "/sys/fs/cgroup/lucid"] {
        let Ok(dir) = std::fs::read_dir(root) else {
            continue;
        };
        for e in dir.flatten() {
            if e.file_name()
                .to_string_lossy()
                .ends_with(&format!("-{pid}"))
            {
                let _ = std::fs::remove_dir(e.path());
            }
        }
    }
}

#[test]
fn kill9_loses_nothing_flushed() {
    durable_kill9(&[], "durable", 128, 4, 4);
}

#[test]
fn kill9_loses_nothing_flushed_under_a_limit_every_mode() {
    let _turn = one_at_a_time();
    let _swap = swap_file(512);
    for mode in MODES {
        durable_kill9(
            &["--memory-limit", "48", "--swap-mode", mode],
            &format!("durable-{mode}"),
            128,
            16,
            4,
        );
    }
}

/// The gate: random sequences under a limit well below what the guest touches, every mode, with
/// Lucid's pager evicting guest RAM all along (the guest pausing after its stores and its disk
/// changes so that the pager catches the frames): every frame shows what the guest read or
/// stored, never a block's newer content; blocks read afresh their current version; the
/// guest's scratch memory its pattern.
#[test]
fn consistency_gate_every_mode_under_a_limit() {
    let _turn = one_at_a_time();
    let _swap = swap_file(1024);
    for mode in MODES {
        // A fresh image each time: the guest's writes and discards change it, and each run
        // expects version 0 everywhere.
        let img = Image::new(&format!("gate-{mode}"), 32, 0);
        let o = run_guest(
            &img.blk_direct(),
            256,
            &["--memory-limit", "48", "--swap-mode", mode],
            "mode=consistency mib=32 rounds=8 ops=512 pressure_mib=32 settle_ms=20",
        );
        assert_pass(&o, &format!("consistency {mode}"));
        // Pages really left: the pager evicted guest RAM.
        assert_paged(&o, mode, mode);
        if *mode != "baseline" {
            assert!(o.counter("swap.mapper.mapped_pages") > 0, "{mode}");
            assert!(o.counter("swap.mapper.broken") > 0, "{mode}");
        } else {
            assert!(o.absent("swap.mapper"), "baseline installs no mapper");
        }
    }
}

/// The Swap Mapper's point (the paper's Fig. 4.9d): re-reading a file the guest caches, under a
/// limit below the file's size, baseline sends the cache to swap and reads it back each pass;
/// with the mapper the host drops those pages (they are the image's) and re-reads them from the
/// image. Measured on the VM's own cgroup (its anonymous refaults, the swap it holds at exit),
/// not on host-wide `/proc/vmstat`, which other processes' swapping pollutes (cgroup v1 counts
/// no swap writes per cgroup).
#[test]
fn mapper_rereads_write_almost_no_swap() {
    let _turn = one_at_a_time();
    let _swap = swap_file(1024);
    let img = Image::new("reread", 160, 0);
    let mut figures = Vec::new();
    for mode in ["baseline", "mapper"] {
        let o = run_guest(
            &img.blk_direct(),
            256,
            &["--memory-limit", "64", "--swap-mode", mode],
            "mode=reread mib=160 iters=3",
        );
        assert_pass(&o, &format!("reread {mode}"));
        assert_paged(&o, mode, mode);
        let (held, refaults) = (memcg(&o, "swap"), memcg(&o, "workingset_refault_anon"));
        eprintln!(
            "{mode}: memcg swap at exit {} KiB, anon refaults {refaults}, host-wide \
             swap_write_sectors {} (other processes' swapping counts too), iteration ms {:?}",
            held >> 10,
            o.counter("swap.host.swap_write_sectors"),
            iter_values(&o.stdout, "ms"),
        );
        figures.push((held, refaults));
    }
    let ((baseline, base_refaults), (mapper, map_refaults)) = (figures[0], figures[1]);
    // 160 MiB cached under a 64 MiB limit: baseline holds at least half of it in swap, and
    // reads it back (anonymous refaults) every pass.
    assert!(
        baseline >= 80 << 20,
        "baseline holds only {baseline} bytes in swap"
    );
    // The mapper's cache is dropped and re-read from the image, not swapped: its anonymous
    // refaults (the cgroup's swap-ins) stay under 5% of baseline's. What it holds in swap is
    // the guest's own anonymous memory and Lucid's (the mapper's reverse map: ~80 bytes a
    // mapped page), a few MiB: under a tenth of baseline's.
    assert!(
        map_refaults * 20 <= base_refaults,
        "mapper refaulted {map_refaults} anonymous pages, baseline {base_refaults}: more than 5%"
    );
    assert!(
        mapper * 10 <= baseline,
        "mapper holds {mapper} bytes in swap, baseline {baseline}: more than 10%"
    );
}

/// Workloads (b) and (c) under a limit below what they touch, every mode: each passes its own
/// data checks and Lucid records its phases.
#[test]
fn alloc_and_compress_pass_under_a_limit_every_mode() {
    let _turn = one_at_a_time();
    let _swap = swap_file(1024);
    let img = Image::new("alloc", 48, 0);
    for mode in MODES {
        for cmd in ["mode=alloc mib=48", "mode=compress mib=32 iters=2"] {
            let o = run_guest(
                &img.blk_direct(),
                256,
                &["--memory-limit", "32", "--swap-mode", mode],
                cmd,
            );
            assert_pass(&o, &format!("{cmd} {mode}"));
            assert_paged(&o, mode, &format!("{cmd} {mode}"));
            assert!(o.counter("swap.phase.1.ms") > 0 && o.counter("swap.phase.2.ms") > 0);
        }
    }
}

/// The guest's balloon driver (`balloon=1`) against the virtio-balloon: it inflates to the
/// target set on the command line (its cache shrinks: a file larger than what is left is read
/// from the disk every pass), and in `alloc` it deflates on OOM when offered, else fails as an
/// out-of-memory guest (the paper's balloon crash, Fig. 4.10).
#[test]
fn balloon_guest_inflates_and_deflates_on_oom() {
    let img = Image::new("balloon", 128, 0);
    let o = run_guest(
        &img.blk(),
        256,
        &["--balloon", "size=128"],
        "mode=reread mib=128 iters=2 balloon=1",
    );
    assert_pass(&o, "balloon reread");
    assert!(o.stdout.contains("pagecache balloon target_pages=32768"));
    // 224 MiB of frames less 128 MiB of balloon: the 128 MiB file no longer fits.
    assert_eq!(iter_values(&o.stdout, "disk_blocks"), vec![32768, 32768]);
    assert_eq!(o.counter("balloon.inflated_pages"), 32768);
    assert_eq!(o.counter("balloon.actual_pages"), 32768);
    let o = run_guest(
        &img.blk(),
        256,
        &["--balloon", "size=128"],
        "mode=alloc mib=128 balloon=1",
    );
    assert_eq!(o.status, Some(3), "{}", o.stdout);
    assert!(o.stdout.contains("FAIL: out of memory"), "{}", o.stdout);
    let o = run_guest(
        &img.blk(),
        256,
        &["--balloon", "size=128,deflate_on_oom=on"],
        "mode=alloc mib=128 balloon=1",
    );
    assert_pass(&o, "balloon alloc, deflate on OOM");
    assert!(o.stdout.contains("deflating the balloon by 8192 pages"));
    assert_eq!(o.counter("balloon.deflated_pages"), 8192);
}
