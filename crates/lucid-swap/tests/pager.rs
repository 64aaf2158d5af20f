//! The pager on a real memory cgroup (v1 here) with a small test swap file, no VM: 96 MiB of
//! "guest RAM" written under a 32 MiB limit with the pager running stays under the limit, keeps
//! every byte, and the pager's counters say it worked. One test in this binary: the limit moves
//! the whole process.

use std::time::{Duration, Instant};

use lucid_guests::skip_or_fail;
use lucid_stats::StatsRegistry;
use lucid_swap::limit::{MemoryController, MemoryLimit, SwapFile};
use lucid_swap::pager::{Pager, PagerConfig};

const MIB: u64 = 1 << 20;
const RAM: u64 = 96 * MIB;
const LIMIT: u64 = 32 * MIB;

fn byte(i: u64) -> u8 {
    (i.wrapping_mul(2654435761) >> 13) as u8
}

#[test]
fn pager_keeps_usage_under_the_limit_and_data_intact() {
    if let Err(e) = MemoryController::detect() {
        return skip_or_fail(&format!("this host has no memory cgroup controller: {e}"));
    }
    let dir = std::env::temp_dir();
    let _swap = match SwapFile::create(&dir, 256 * MIB) {
        Ok(s) => s,
        Err(e) => return skip_or_fail(&format!("no test swap file: {e}")),
    };
    let limit = MemoryLimit::apply("pagertest", LIMIT).expect("a memory limit");
    let stats = StatsRegistry::new();
    // SAFETY: a fresh private anonymous mapping owned by this test, unmapped at the end.
    let base = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            RAM as usize,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    assert_ne!(base, libc::MAP_FAILED);
    let cfg = PagerConfig::for_limit(LIMIT);
    let pager = Pager::spawn(
        &limit,
        vec![(base as u64, RAM)],
        Vec::new(),
        cfg,
        &stats,
        &lucid_thread::Spawner::new(None, stats.threads().clone()),
    )
    .unwrap();
    // SAFETY: the mapping above, RAM bytes long, used only by this thread.
    let mem = unsafe { std::slice::from_raw_parts_mut(base as *mut u8, RAM as usize) };
    let start = Instant::now();
    let mut peak = 0;
    for (i, page) in mem.chunks_mut(4096).enumerate() {
        for (j, b) in page.iter_mut().enumerate().step_by(512) {
            *b = byte(i as u64 * 4096 + j as u64);
        }
        if i % 256 == 0 {
            peak = peak.max(limit.usage().unwrap());
        }
    }
    for (i, page) in mem.chunks(4096).enumerate() {
        for (j, b) in page.iter().enumerate().step_by(512) {
            assert_eq!(*b, byte(i as u64 * 4096 + j as u64), "page {i} byte {j}");
        }
    }
    let took = start.elapsed();
    pager.stop();
    let snap = stats.snapshot();
    eprintln!("{took:?}, peak usage {} MiB, pager {snap:?}", peak >> 20);
    // SAFETY: unmapping our own mapping; `mem` is not used after this.
    unsafe { libc::munmap(base, RAM as usize) };
    drop(limit);
    assert!(peak <= LIMIT, "usage {peak} above the limit");
    assert!(snap["swap.pager.wakeups"] > 0 && snap["swap.pager.chunks"] > 0);
    assert!(snap["swap.pager.bytes"] > 0);
    assert_eq!(snap["swap.pager.stalls"], 0);
    assert!(took < Duration::from_secs(60));
}
