//! `--memory-limit` and `--swap-mode` end to end on real KVM (seccomp on, as by default): the
//! probe guests run under a memory cgroup with a test swap file behind it in every swap mode, the
//! mapper modes refuse 512-byte disks, the guest's `LUCID_HC_PHASE` calls give `swap.phase.*`
//! counters, and the process sits in its own cgroup with the limit asked for.
//!
//! The tests share the host's swap and the `lucid/` memory cgroup with other tests: their swap
//! file is named after this process, and they remove the cgroups of Lucid processes that are gone.

mod common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use lucid_swap::limit::SwapFile;

use common::{disk, lucid, Outcome};
use lucid_guests::skip_or_fail;

const LIMIT: Duration = Duration::from_secs(180);

/// A swap file for the tests (swapoff and removed on drop); `None` (after [`skip_or_fail`])
/// where one cannot be made.
fn swap_file(mib: u64) -> Option<SwapFile> {
    SwapFile::create(&std::env::temp_dir(), mib << 20)
        .inspect_err(|e| skip_or_fail(&format!("cannot make a swap file: {e}")))
        .ok()
}

/// The tests swap on and off and share the cgroup: one at a time.
fn turn() -> std::sync::MutexGuard<'static, ()> {
    static TURN: std::sync::Mutex<()> = std::sync::Mutex::new(());
    TURN.lock().unwrap_or_else(|e| e.into_inner())
}

/// Removes the `lucid/<name>-<pid>` cgroups whose process is gone (a confined Lucid cannot
/// rmdir its own at exit).
fn remove_stale_cgroups() {
    // Lucid nests `lucid/` under the memory cgroup it starts in, which is the test's.
    let Ok(ctl) = lucid_swap::limit::MemoryController::detect() else {
        return;
    };
    let base = ctl
        .mount
        .join(ctl.current.trim_start_matches('/'))
        .join("lucid");
    let Ok(entries) = std::fs::read_dir(base) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if let Some(pid) = name
            .rsplit_once('-')
            .and_then(|(_, p)| p.parse::<u32>().ok())
        {
            if !Path::new(&format!("/proc/{pid}")).exists() {
                let _ = std::fs::remove_dir(e.path());
            }
        }
    }
}

fn has_v1_memory() -> bool {
    Path::new("/sys/fs/cgroup/memory/memory.limit_in_bytes").exists()
}

fn blk_run(img: &Path, mode: &str, limit_mib: &str) -> Outcome {
    lucid(
        &[
            "run",
            "--guest",
            "virtio-blk",
            "--memory",
            "256",
            "--memory-limit",
            limit_mib,
            "--swap-mode",
            mode,
            "--blk",
            &format!("path={},bs=4096", img.display()),
            "--cmdline",
            "op=rw pattern=rand bs=4096 qd=4 count=400 verify=1 phases=1",
        ],
        LIMIT,
    )
}

#[test]
fn every_swap_mode_runs_under_a_memory_limit_with_phases() {
    let _turn = turn();
    let Some(_swap) = swap_file(256) else {
        return;
    };
    for (mode, code) in [("baseline", 0), ("mapper", 1), ("vswapper", 2)] {
        let img = disk(&format!("swap-{mode}"), 16);
        let o = blk_run(&img, mode, "64");
        let _ = std::fs::remove_file(&img);
        remove_stale_cgroups();
        assert_eq!(o.status, Some(1), "{mode}: {}\n{}", o.stdout, o.stderr);
        assert_eq!(
            common::field(&o.stdout, "virtio-blk op=", "mismatches"),
            Some("0"),
            "{mode}: {}",
            o.stdout
        );
        assert!(
            o.stderr
                .contains(&format!("swap: mode {mode}, limit 64 MiB (")),
            "{mode}: {}",
            o.stderr
        );
        assert_eq!(o.counter("swap.mode"), code);
        assert_eq!(o.counter("swap.limit_bytes"), 64 << 20);
        assert!(o.counter("swap.cgroup.usage_bytes") > 0, "{mode}");
        // Phase 0: the timed run; phase 1: the read-back, ended when the VM stopped.
        for n in 0..2 {
            let stats = o.stats.as_ref().unwrap();
            let phase = &stats["counters"]["swap"]["phase"][n.to_string()];
            for k in [
                "ms",
                "swap_read_sectors",
                "swap_write_sectors",
                "majflt",
                "vmm_text_faults",
            ] {
                assert!(phase[k].is_u64(), "{mode}: swap.phase.{n}.{k} in {phase}");
            }
        }
        assert_eq!(o.counter("swap.phase.ignored"), 0);
        if mode == "baseline" {
            assert!(o.absent("swap.mapper"), "baseline installs no mapper");
        } else {
            // Aligned 4 KiB reads into page-aligned buffers map.
            assert!(o.counter("swap.mapper.runs") > 0, "{mode}: {}", o.stderr);
            assert_eq!(o.counter("swap.mapper.fallbacks"), 0);
        }
    }
}

/// Under a limit well below what the guest touches, the host swaps (baseline), the data stays
/// right, and the swap line and `swap.host.*` say so. On this host (PVM) the kernel's own limit
/// reclaim would OOM-kill the VM (docs/vswapper.md §7): Lucid's pager (on by default) keeps it
/// under the limit.
///
/// A vCPU can outrun the pager: KVM's fault path then gets `EFAULT` from the cgroup's refused
/// charge (not a wait, even with `oom_kill_disable`), which would kill the VM about one run in
/// two if the vCPU loop did not wait for the pager and retry (`MemoryFaultHook`).
///
/// Without the OOM guard it hangs about one run in ten: every Lucid thread, the pager included,
/// asleep in the kernel waiting for memory at the limit (docs/vswapper.md §7).
#[test]
fn a_guest_over_its_limit_is_swapped_and_intact() {
    let _turn = turn();
    if !has_v1_memory() {
        return skip_or_fail("no cgroup v1 memory controller");
    }
    let Some(_swap) = swap_file(256) else {
        return;
    };
    let o = lucid(
        &[
            "run",
            "--guest",
            "memtouch",
            "--memory",
            "256",
            "--memory-limit",
            "48",
            "--cmdline",
            "mib=128",
        ],
        LIMIT,
    );
    remove_stale_cgroups();
    assert_eq!(o.status, Some(1), "{}\n{}", o.stdout, o.stderr);
    assert!(
        o.stdout.contains("errors=0"),
        "stdout {:?}, serial tx_written {} tx_dropped {} tx_unwritten {}\n{}",
        o.stdout,
        o.counter("serial.tx_written"),
        o.counter("serial.tx_dropped"),
        o.counter("serial.tx_unwritten"),
        o.stderr
    );
    // At least 80 of the 128 MiB written had to leave (the VM's own cgroup holds it in swap at
    // exit; /proc/vmstat is shared with other processes).
    assert!(
        o.counter("swap.host.memcg.swap") >= 80 << 20,
        "{}",
        o.stderr
    );
    assert!(o.counter("swap.cgroup.usage_bytes") <= 48 << 20);
    // A stall (3 s without freeing anything) may happen while a vCPU outruns the pager; the
    // VM must still finish intact, which the asserts above check.
    assert!(o.counter("swap.pager.chunks") > 0, "{}", o.stderr);
    assert!(o.stderr.contains("; pager "), "{}", o.stderr);
    assert!(o.stderr.contains("swap: mode baseline, limit 48 MiB"));
    // The guard ran (its counters are there) and never had to give up.
    assert!(o.stats.as_ref().unwrap()["counters"]["swap"]["guard"]["rescues"].is_u64());
    assert_eq!(o.counter("swap.guard.oom_kill_enabled"), 0, "{}", o.stderr);
}

#[test]
fn mapper_modes_refuse_a_512_byte_disk() {
    let img = disk("swap-512", 4);
    for mode in ["mapper", "vswapper"] {
        let o = lucid(
            &[
                "run",
                "--guest",
                "virtio-blk",
                "--swap-mode",
                mode,
                "--blk",
                &format!("path={}", img.display()),
            ],
            LIMIT,
        );
        assert_eq!(o.status, Some(lucid_vmm::EXIT_USAGE), "a usage error");
        assert!(
            o.stderr.contains(&format!(
                "--swap-mode {mode} maps 4096-byte disk blocks over guest pages, and blk0 has \
                 512-byte logical blocks: add bs=4096 to its --blk option"
            )),
            "{}",
            o.stderr
        );
        assert!(!o.stdout.contains("virtio-blk id="), "{}", o.stdout);
    }
    // Baseline does not care.
    let o = lucid(
        &[
            "run",
            "--guest",
            "virtio-blk",
            "--swap-mode",
            "baseline",
            "--blk",
            &format!("path={}", img.display()),
            "--cmdline",
            "op=read count=10",
        ],
        LIMIT,
    );
    let _ = std::fs::remove_file(&img);
    assert_eq!(o.status, Some(1), "{}", o.stderr);
    assert!(!o.stderr.contains("swap:"), "no swap line: {}", o.stderr);
}

/// The memory cgroup path of process `pid` (cgroup v1), empty when it is gone.
fn memory_cgroup(pid: u32) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/cgroup"))
        .unwrap_or_default()
        .lines()
        .find(|l| l.contains(":memory:"))
        .and_then(|l| l.splitn(3, ':').nth(2))
        .unwrap_or_default()
        .to_string()
}

/// The pid of the OOM guard serving VM process `vm` (`lucid __oom-guard <vm> ...`).
fn oom_guard_of(vm: u32) -> Option<u32> {
    let want = format!("__oom-guard\0{vm}\0");
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let pid = e.file_name().to_str()?.parse::<u32>().ok()?;
        let cmd = std::fs::read(e.path().join("cmdline")).ok()?;
        String::from_utf8_lossy(&cmd).contains(&want).then_some(pid)
    })
}

/// Alive and not a zombie.
fn running(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| s.rsplit_once(") ").map(|(_, r)| !r.starts_with('Z')))
        .unwrap_or(false)
}

/// While the VM runs, its process is in `lucid/vm-<pid>` with the limit asked for, and its OOM
/// guard (docs/vswapper.md §7) runs outside that cgroup; a `kill -9` of Lucid ends the guard too.
#[test]
fn the_process_sits_in_its_own_memory_cgroup() {
    let _turn = turn();
    if !has_v1_memory() {
        return skip_or_fail("no cgroup v1 memory controller");
    }
    let Some(_swap) = swap_file(64) else {
        return;
    };
    let img = disk("swap-hold", 4);
    let mut child = Command::new(env!("CARGO_BIN_EXE_lucid"))
        .args(["run", "--guest", "virtio-blk", "--memory-limit", "100"])
        .args(["--blk", &format!("path={},bs=4096", img.display())])
        .args(["--cmdline", "op=read count=10 hold=1"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let pid = child.id();
    // `lucid/vm-<pid>` under the cgroup the test runs in.
    let mut dir = None;
    let start = Instant::now();
    let mut seen = None;
    while start.elapsed() < Duration::from_secs(30) {
        let cg = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap_or_default();
        let mine = format!("/lucid/vm-{pid}");
        if let Some(path) = cg
            .lines()
            .filter_map(|l| l.splitn(3, ':').nth(2).filter(|_| l.contains(":memory:")))
            .find(|p| p.ends_with(&mine))
        {
            let d = Path::new("/sys/fs/cgroup/memory").join(path.trim_start_matches('/'));
            seen = std::fs::read_to_string(d.join("memory.limit_in_bytes")).ok();
            dir = Some(d);
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    // The guard: started with the pager, then it moves itself out of the limit.
    let mut guard = None;
    while guard.is_none() && start.elapsed() < Duration::from_secs(30) {
        guard = oom_guard_of(pid).filter(|&g| {
            let cg = memory_cgroup(g);
            !cg.is_empty() && !cg.contains("/lucid/vm-")
        });
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
    let _ = std::fs::remove_file(&img);
    let guard = guard.expect("an OOM guard outside the VM's cgroup");
    let gone = Instant::now();
    while running(guard) && gone.elapsed() < Duration::from_secs(20) {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(!running(guard), "the guard outlived its VM");
    // A killed Lucid cannot remove its cgroup: the next VM's `apply` would; the test does now.
    let dir = dir.expect("the VM's process moved into lucid/vm-<pid>");
    let _ = std::fs::remove_dir(&dir);
    assert_eq!(seen.as_deref().map(str::trim), Some("104857600"));
    assert!(
        !dir.exists(),
        "the test removed the cgroup of the killed VM"
    );
}

/// `cache=none` (O_DIRECT) under the default seccomp, alone and with the mapper mapping the
/// image it writes past the page cache: every read verified.
#[test]
fn cache_none_disks_keep_their_data_with_and_without_the_mapper() {
    for (mode, bs) in [("baseline", "512"), ("mapper", "4096")] {
        let img = disk(&format!("swap-direct-{mode}"), 16);
        let o = lucid(
            &[
                "run",
                "--guest",
                "virtio-blk",
                "--swap-mode",
                mode,
                "--blk",
                &format!("path={},bs={bs},cache=none", img.display()),
                "--cmdline",
                &format!("op=rw pattern=rand bs={bs} qd=4 count=400 verify=1 flush=1"),
            ],
            LIMIT,
        );
        let _ = std::fs::remove_file(&img);
        assert_eq!(o.status, Some(1), "{mode}: {}\n{}", o.stdout, o.stderr);
        assert_eq!(
            common::field(&o.stdout, "virtio-blk op=", "mismatches"),
            Some("0"),
            "{mode}: {}",
            o.stdout
        );
        assert!(
            o.stdout.contains("virtio-blk flush status=0"),
            "{}",
            o.stdout
        );
        assert_eq!(o.counter("blk0.errors"), 0, "{mode}");
        if mode == "mapper" {
            assert!(o.counter("swap.mapper.runs") > 0, "{}", o.stderr);
        }
    }
}
