//! The memory limit on this host (cgroup v1 here) with a small test swap file: guest RAM above
//! the limit goes to swap when it is anonymous (baseline), and is dropped and refaulted from the
//! image without swap writes when the Swap Mapper mapped it. One test in this binary: the limit
//! moves the whole process, which must not squeeze other tests running in parallel threads.

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::Arc;

use lucid_guests::skip_or_fail;
use lucid_mem::{Backing, GuestRam};
use lucid_stats::StatsRegistry;
use lucid_swap::host::HostCounters;
use lucid_swap::limit::{swap_total_bytes, MemoryController, MemoryLimit, SwapFile};
use lucid_swap::mapper::{MapperBudget, SwapMapper};
use lucid_swap::SwapMode;
use lucid_virtio::blk::BlockDataHook;
use vm_memory::{Bytes, GuestAddress};

const MIB: u64 = 1 << 20;
const IMAGE: u64 = 96 * MIB;
const RAM: u64 = 128 * MIB;
const LIMIT: u64 = 40 * MIB;
const CHUNK: u64 = 256 * 1024;

fn chunk_bytes(i: u64) -> Vec<u8> {
    (0..CHUNK)
        .map(|j| (i.wrapping_mul(37) ^ j.wrapping_mul(11) ^ (j >> 12)) as u8)
        .collect()
}

/// Reads all guest RAM holding the image `rounds` times, checking every byte.
fn verify(ram: &GuestRam, rounds: usize) {
    let mut buf = vec![0u8; CHUNK as usize];
    for _ in 0..rounds {
        for i in 0..IMAGE / CHUNK {
            ram.memory()
                .read_slice(&mut buf, GuestAddress(i * CHUNK))
                .unwrap();
            assert!(buf == chunk_bytes(i), "guest chunk {i} differs");
        }
    }
}

struct Dir(PathBuf);

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn limit_with_swap_file_baseline_swaps_mapper_does_not() {
    if let Err(e) = MemoryController::detect() {
        return skip_or_fail(&format!("this host has no memory cgroup controller: {e}"));
    }
    // Swap files need a real filesystem (not tmpfs): the target dir's is one here.
    let base = std::env::var_os("CARGO_TARGET_TMPDIR")
        .map(PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    let dir = Dir(base.join(format!("lucid-s1-limit-{}", std::process::id())));
    std::fs::create_dir_all(&dir.0).unwrap();
    let swap = SwapFile::create(&dir.0, 256 * MIB).expect("test swap file");
    assert!(swap_total_bytes() >= 256 * MIB - 4096);

    // The image, written and then evicted from the page cache before the limit applies, so
    // that the mapper's reads are charged to the VM's cgroup.
    let path = dir.0.join("image.raw");
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&path)
        .unwrap();
    for i in 0..IMAGE / CHUNK {
        f.write_all_at(&chunk_bytes(i), i * CHUNK).unwrap();
    }
    f.sync_all().unwrap();
    let evict = |f: &File| {
        // SAFETY: fadvise on our fd.
        unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    };
    evict(&f);

    let limit = MemoryLimit::apply("s1-limit-test", LIMIT).expect("memory limit");
    let cg = limit.path().to_path_buf();
    assert!(cg.is_dir());
    let procs = std::fs::read_to_string(cg.join("cgroup.procs")).unwrap();
    assert!(procs
        .lines()
        .any(|l| l.trim() == std::process::id().to_string()));

    // Baseline: the image copied into anonymous guest RAM, then read twice.
    let h = HostCounters::start();
    {
        let ram = GuestRam::new(&[(0, RAM)], Backing::Anonymous).unwrap();
        let mut buf = vec![0u8; CHUNK as usize];
        for i in 0..IMAGE / CHUNK {
            f.read_exact_at(&mut buf, i * CHUNK).unwrap();
            ram.memory()
                .write_slice(&buf, GuestAddress(i * CHUNK))
                .unwrap();
        }
        verify(&ram, 2);
        assert!(limit.usage().unwrap() <= LIMIT + MIB);
    }
    let base_d = h.delta();
    evict(&f);

    // Mapper: the same reads through the Swap Mapper.
    let h = HostCounters::start();
    let stats = StatsRegistry::new();
    {
        let ram = Arc::new(GuestRam::new(&[(0, RAM)], Backing::Anonymous).unwrap());
        let m = SwapMapper::new(
            ram.clone(),
            SwapMode::Mapper,
            &stats,
            MapperBudget::default(),
        );
        for i in 0..IMAGE / CHUNK {
            assert!(m.read(&f, i * CHUNK, i * CHUNK, CHUNK).unwrap());
        }
        verify(&ram, 2);
        assert!(limit.usage().unwrap() <= LIMIT + MIB);
        assert_eq!(m.mapped_pages(), IMAGE / 4096);
        // Large runs into contiguous guest RAM merge into one VMA.
        assert!(m.vmas() <= 3, "{} VMAs", m.vmas());
    }
    let map_d = h.delta();
    let stat = limit.stat().unwrap();
    eprintln!(
        "baseline: swap_write_sectors {} swap_read_sectors {} majflt {} memcg {:?}",
        base_d.swap_write_sectors(),
        base_d.swap_read_sectors(),
        base_d.majflt,
        base_d.memcg
    );
    eprintln!(
        "mapper:   swap_write_sectors {} swap_read_sectors {} majflt {} memcg {:?}",
        map_d.swap_write_sectors(),
        map_d.swap_read_sectors(),
        map_d.majflt,
        map_d.memcg
    );
    eprintln!("memory.stat now: {stat:?}");
    // Baseline had to push most of the 96 MiB past a 40 MiB limit into swap (/proc/vmstat is
    // host-wide, so other processes' swapping adds to both figures: compare loosely).
    assert!(
        base_d.swap_write_sectors() >= (IMAGE - LIMIT) / 512 / 2,
        "baseline wrote only {} swap sectors",
        base_d.swap_write_sectors()
    );
    // Per VM (this cgroup only, so other processes' swapping cannot blur it): anonymous pages
    // refaulted from swap. Baseline re-reads its swapped copy; the mapper re-reads the image.
    let refaults = |d: &lucid_swap::host::HostDelta| {
        d.memcg.get("workingset_refault_anon").copied().unwrap_or(0)
    };
    if base_d.memcg.contains_key("workingset_refault_anon") {
        assert!(
            refaults(&base_d) >= (IMAGE - LIMIT) / 4096 / 2,
            "baseline refaulted only {} anonymous pages",
            refaults(&base_d)
        );
        assert!(
            refaults(&map_d) * 5 < refaults(&base_d),
            "mapper refaulted {} anonymous pages from swap, baseline {}",
            refaults(&map_d),
            refaults(&base_d)
        );
    }
    drop(limit);
    assert!(!cg.exists(), "cgroup {} left behind", cg.display());
    drop(swap);
    drop(f);
}
