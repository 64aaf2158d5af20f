//! Host-side swap and fault counters, as deltas since a start point: what each swap pathology
//! costs the host (swap sectors written and read, major faults, faults on the VMM's own code).
//!
//! Sources:
//! - `/proc/vmstat` (host-wide: other processes' swapping counts too): `pswpin`, `pswpout`
//!   (pages; × 8 = 512-byte sectors), `swpin_zero`/`swpout_zero` (zero pages the kernel swapped
//!   without I/O, 6.12+), `pgmajfault`, `workingset_refault_anon`/`_file`.
//! - the memory cgroup this process is in (its [`crate::limit::MemoryLimit`] once applied):
//!   memory.stat, per VM. Event keys (`pg*`, `workingset_*`, `pswp*`, `swp*`, `zswp*`) are
//!   deltas, state keys (`rss`/`anon`, `cache`/`file`, `swap`, `mapped_file`, ...) are current.
//! - `/proc/self/stat` `majflt`: this process's major faults (guest memory faulted in by vCPUs
//!   through KVM and by device threads, and the VMM's own code and data).
//! - VMM-text faults: stock Linux counts no faults per mapping, so [`HostCounters`] samples the
//!   residency of Lucid's executable text (its `r-xp` mappings of /proc/self/exe) with `mincore`
//!   and counts pages that were evicted at one sample and resident again at the next: each is a
//!   major fault on VMM code (the page came back because something executed it; prefetch by
//!   read-around is counted too). Evict-and-refault cycles between two samples are missed, so
//!   this is a lower bound; sample often (the stats probe samples on every read) for precision.
//!   `vmm_text_nonresident` is the number of text pages evicted right now.

use std::collections::BTreeMap;
use std::fs::{self, File};
use std::io;
use std::sync::{Arc, Mutex};

use lucid_stats::StatsRegistry;

use crate::limit::{parse_stat, pread_to_string, MemoryController, MemoryLimit};

/// The `/proc/vmstat` keys we follow.
pub const VMSTAT_KEYS: [&str; 7] = [
    "pswpin",
    "pswpout",
    "swpin_zero",
    "swpout_zero",
    "pgmajfault",
    "workingset_refault_anon",
    "workingset_refault_file",
];

/// memory.stat keys reported (v1 and v2 names; those the host lacks are left out).
const MEMCG_KEYS: [&str; 17] = [
    "rss",
    "cache",
    "anon",
    "file",
    "swap",
    "mapped_file",
    "file_mapped",
    "pgmajfault",
    "pgfault",
    "workingset_refault_anon",
    "workingset_refault_file",
    "pswpin",
    "pswpout",
    "swpin_zero",
    "swpout_zero",
    "pgpgin",
    "pgpgout",
];

fn is_event_key(k: &str) -> bool {
    ["pg", "workingset_", "pswp", "swp", "zswp"]
        .iter()
        .any(|p| k.starts_with(p))
}

/// One reading of every source.
#[derive(Clone, Debug, Default)]
pub struct HostSnapshot {
    pub vmstat: BTreeMap<String, u64>,
    pub memcg: BTreeMap<String, u64>,
    pub majflt: u64,
    pub vmm_text_faults: u64,
    pub vmm_text_nonresident: u64,
}

/// Differences between two snapshots (memcg state keys: the later value).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HostDelta {
    pub pswpin: u64,
    pub pswpout: u64,
    pub swpin_zero: u64,
    pub swpout_zero: u64,
    pub pgmajfault: u64,
    pub workingset_refault_anon: u64,
    pub workingset_refault_file: u64,
    /// This process's major faults.
    pub majflt: u64,
    /// Major faults on the VMM's own text (see the module doc: a sampled lower bound).
    pub vmm_text_faults: u64,
    /// VMM text pages evicted at the later snapshot.
    pub vmm_text_nonresident: u64,
    pub memcg: BTreeMap<String, u64>,
}

impl HostDelta {
    /// Swap read I/O in 512-byte sectors (pswpin × 8).
    pub fn swap_read_sectors(&self) -> u64 {
        self.pswpin * 8
    }

    /// Swap write I/O in 512-byte sectors (pswpout × 8).
    pub fn swap_write_sectors(&self) -> u64 {
        self.pswpout * 8
    }

    /// Flat `(name, value)` pairs as the stats probe reports them.
    pub fn pairs(&self) -> Vec<(String, u64)> {
        let mut v: Vec<(String, u64)> = vec![
            ("swap_read_sectors".into(), self.swap_read_sectors()),
            ("swap_write_sectors".into(), self.swap_write_sectors()),
            ("pswpin".into(), self.pswpin),
            ("pswpout".into(), self.pswpout),
            ("swpin_zero".into(), self.swpin_zero),
            ("swpout_zero".into(), self.swpout_zero),
            ("pgmajfault".into(), self.pgmajfault),
            (
                "workingset_refault_anon".into(),
                self.workingset_refault_anon,
            ),
            (
                "workingset_refault_file".into(),
                self.workingset_refault_file,
            ),
            ("majflt".into(), self.majflt),
            ("vmm_text_faults".into(), self.vmm_text_faults),
            ("vmm_text_nonresident".into(), self.vmm_text_nonresident),
        ];
        v.extend(
            self.memcg
                .iter()
                .map(|(k, val)| (format!("memcg.{k}"), *val)),
        );
        v
    }

    fn between(a: &HostSnapshot, b: &HostSnapshot) -> HostDelta {
        let d = |k: &str| {
            b.vmstat
                .get(k)
                .copied()
                .unwrap_or(0)
                .saturating_sub(a.vmstat.get(k).copied().unwrap_or(0))
        };
        let memcg = b
            .memcg
            .iter()
            .map(|(k, &v)| {
                let v = if is_event_key(k) {
                    v.saturating_sub(a.memcg.get(k).copied().unwrap_or(0))
                } else {
                    v
                };
                (k.clone(), v)
            })
            .collect();
        HostDelta {
            pswpin: d("pswpin"),
            pswpout: d("pswpout"),
            swpin_zero: d("swpin_zero"),
            swpout_zero: d("swpout_zero"),
            pgmajfault: d("pgmajfault"),
            workingset_refault_anon: d("workingset_refault_anon"),
            workingset_refault_file: d("workingset_refault_file"),
            majflt: b.majflt.saturating_sub(a.majflt),
            vmm_text_faults: b.vmm_text_faults.saturating_sub(a.vmm_text_faults),
            vmm_text_nonresident: b.vmm_text_nonresident,
            memcg,
        }
    }
}

/// Residency of the VMM's executable text, sampled with mincore.
#[derive(Default)]
struct TextSampler {
    /// (address, length) of each r-xp mapping of /proc/self/exe.
    ranges: Vec<(usize, usize)>,
    last: Vec<u8>,
    refaults: u64,
    nonresident: u64,
}

impl TextSampler {
    fn new() -> TextSampler {
        let mut s = TextSampler {
            ranges: exe_text_ranges().unwrap_or_default(),
            ..Default::default()
        };
        s.sample();
        s
    }

    fn sample(&mut self) {
        let mut now = Vec::with_capacity(self.last.len());
        for &(addr, len) in &self.ranges {
            let mut v = vec![0u8; len.div_ceil(4096)];
            // SAFETY: mincore only writes `v`, one byte per page of the range, which we sized;
            // the range is a mapping of our own executable that stays mapped for the process's
            // life (a stale range gives ENOMEM, handled below).
            let r = unsafe { libc::mincore(addr as *mut libc::c_void, len, v.as_mut_ptr()) };
            if r != 0 {
                v.iter_mut().for_each(|b| *b = 1);
            }
            now.extend(v.iter().map(|b| b & 1));
        }
        self.refaults += refaults(&self.last, &now);
        self.nonresident = now.iter().filter(|b| **b == 0).count() as u64;
        self.last = now;
    }
}

/// Pages evicted at the last sample (0) and resident now (1); none when the layout changed.
fn refaults(last: &[u8], now: &[u8]) -> u64 {
    if last.len() != now.len() {
        return 0;
    }
    last.iter()
        .zip(now)
        .filter(|(a, b)| **a == 0 && **b == 1)
        .count() as u64
}

/// The r-xp mappings of this process's executable in /proc/self/maps.
fn exe_text_ranges() -> io::Result<Vec<(usize, usize)>> {
    let exe = fs::read_link("/proc/self/exe")?;
    let maps = fs::read_to_string("/proc/self/maps")?;
    Ok(maps
        .lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let range = f.next()?;
            let perms = f.next()?;
            let path = f.nth(3)?;
            if !perms.starts_with("r-x") || exe.as_path() != std::path::Path::new(path) {
                return None;
            }
            let (a, b) = range.split_once('-')?;
            let a = usize::from_str_radix(a, 16).ok()?;
            let b = usize::from_str_radix(b, 16).ok()?;
            Some((a, b.checked_sub(a)?))
        })
        .collect())
}

fn parse_majflt(stat: &str) -> Option<u64> {
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(9)?.parse().ok()
}

/// Host counters since [`HostCounters::start`].
///
/// Every file is opened by `start` and read with `pread` afterwards: sampling runs on confined
/// threads (a vCPU serving a guest phase, the main thread writing the report), which may not
/// open files.
pub struct HostCounters {
    start: HostSnapshot,
    vmstat: Option<File>,
    self_stat: Option<File>,
    memcg_stat: Option<File>,
    text: Mutex<TextSampler>,
}

impl HostCounters {
    /// Snapshots every source now. The memory cgroup is the one this process is in at this
    /// moment (start after [`crate::limit::MemoryLimit::apply`] to follow the VM's own, or use
    /// [`HostCounters::start_in`]).
    pub fn start() -> HostCounters {
        let memcg_stat = MemoryController::detect()
            .ok()
            .map(|c| {
                c.mount
                    .join(c.current.trim_start_matches('/'))
                    .join("memory.stat")
            })
            .and_then(|p| File::open(p).ok());
        Self::with_memcg(memcg_stat)
    }

    /// [`HostCounters::start`] following `limit`'s cgroup.
    pub fn start_in(limit: &MemoryLimit) -> HostCounters {
        Self::with_memcg(limit.stat_file().ok())
    }

    fn with_memcg(memcg_stat: Option<File>) -> HostCounters {
        let mut h = HostCounters {
            start: HostSnapshot::default(),
            vmstat: File::open("/proc/vmstat").ok(),
            self_stat: File::open("/proc/self/stat").ok(),
            memcg_stat,
            text: Mutex::new(TextSampler::new()),
        };
        h.start = h.snapshot();
        h
    }

    /// Reads every source now (and samples the VMM text), through the descriptors `start`
    /// opened.
    pub fn snapshot(&self) -> HostSnapshot {
        let read = |f: &Option<File>| {
            f.as_ref()
                .and_then(|f| pread_to_string(f).ok())
                .unwrap_or_default()
        };
        let vmstat = parse_stat(&read(&self.vmstat))
            .into_iter()
            .filter(|(k, _)| VMSTAT_KEYS.contains(&k.as_str()))
            .collect();
        let memcg = parse_stat(&read(&self.memcg_stat))
            .into_iter()
            .filter(|(k, _)| MEMCG_KEYS.contains(&k.as_str()))
            .collect();
        let (vmm_text_faults, vmm_text_nonresident) = {
            let mut t = self.text.lock().unwrap_or_else(|e| e.into_inner());
            t.sample();
            (t.refaults, t.nonresident)
        };
        HostSnapshot {
            vmstat,
            memcg,
            majflt: parse_majflt(&read(&self.self_stat)).unwrap_or(0),
            vmm_text_faults,
            vmm_text_nonresident,
        }
    }

    /// Differences since `start`.
    pub fn delta(&self) -> HostDelta {
        HostDelta::between(&self.start, &self.snapshot())
    }

    /// Differences between two snapshots (e.g. per guest phase).
    pub fn delta_between(a: &HostSnapshot, b: &HostSnapshot) -> HostDelta {
        HostDelta::between(a, b)
    }

    /// Major faults on the VMM's own text since start (sampled now; see the module doc).
    pub fn vmm_text_faults(&self) -> u64 {
        let mut t = self.text.lock().unwrap_or_else(|e| e.into_inner());
        t.sample();
        t.refaults.saturating_sub(self.start.vmm_text_faults)
    }

    /// Samples the VMM text residency only (cheap: call it periodically for a tighter bound).
    pub fn sample_text(&self) {
        self.text.lock().unwrap_or_else(|e| e.into_inner()).sample();
    }
}

/// Registers `counters` as the stats probe `swap.host.*`: `swap_read_sectors`,
/// `swap_write_sectors`, the vmstat keys, `majflt`, `vmm_text_faults`, `vmm_text_nonresident`
/// and `memcg.<key>`, all deltas since the counters' start (memcg state keys: current values).
pub fn register_probe(stats: &StatsRegistry, counters: Arc<HostCounters>) {
    stats.probe("swap.host", Box::new(move || counters.delta().pairs()));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_vmstat_and_majflt() {
        let h = HostCounters::start();
        assert!(
            h.start.vmstat.contains_key("pswpout"),
            "{:?}",
            h.start.vmstat
        );
        assert!(h.start.vmstat.contains_key("pgmajfault"));
        let d = h.delta();
        assert_eq!(d.swap_write_sectors(), d.pswpout * 8);
        assert!(!exe_text_ranges().unwrap().is_empty());
    }

    #[test]
    fn probe_reports_under_swap_host() {
        let stats = StatsRegistry::new();
        register_probe(&stats, Arc::new(HostCounters::start()));
        let snap = stats.snapshot();
        for k in [
            "swap.host.swap_read_sectors",
            "swap.host.swap_write_sectors",
            "swap.host.majflt",
            "swap.host.vmm_text_faults",
        ] {
            assert!(snap.contains_key(k), "{k} missing from {snap:?}");
        }
    }

    /// Evicting our own text (MADV_PAGEOUT on the executable's r-xp mappings) shows up as
    /// non-resident pages, and running code again as VMM-text faults.
    #[test]
    fn evicted_text_is_seen_and_its_refaults_counted() {
        let h = HostCounters::start();
        let ranges = exe_text_ranges().unwrap();
        for &(a, len) in &ranges {
            // SAFETY: reclaim hint on our own text mapping; pages come back on the next fetch.
            unsafe { libc::madvise(a as *mut libc::c_void, len, libc::MADV_PAGEOUT) };
        }
        h.sample_text();
        let evicted = h.text.lock().unwrap().nonresident;
        // Run some code, then load one byte of every text page: the code alone may miss the
        // few pages that stayed evicted (CI once saw 1 evicted page that it never ran).
        let _ = format!("{:?}", h.snapshot());
        for &(a, len) in &ranges {
            for off in (0..len).step_by(4096) {
                // SAFETY: a read inside our own mapped, readable text.
                unsafe { std::ptr::read_volatile((a + off) as *const u8) };
            }
        }
        let d = h.delta();
        eprintln!(
            "text pages evicted {evicted}, refaulted {}, now evicted {}",
            d.vmm_text_faults, d.vmm_text_nonresident
        );
        if evicted == 0 {
            eprintln!(
                "MADV_PAGEOUT evicted no text here (shared or locked pages): nothing to check"
            );
            return;
        }
        assert!(d.vmm_text_faults > 0);
        assert!(d.vmm_text_nonresident < evicted);
    }

    #[test]
    fn text_refaults_count_evicted_then_resident_pages() {
        let mut t = TextSampler {
            ranges: vec![],
            last: vec![0, 1, 0, 1],
            refaults: 0,
            nonresident: 0,
        };
        // No ranges means an empty sample, which is a length change: not counted.
        t.sample();
        assert_eq!(t.refaults, 0);
        assert_eq!(refaults(&[0, 1, 0, 1, 0], &[1, 1, 0, 0, 1]), 2);
        assert_eq!(refaults(&[0, 0], &[1, 1, 1]), 0);
        let a = HostSnapshot {
            memcg: [("pgmajfault".to_string(), 5), ("rss".to_string(), 100)].into(),
            ..Default::default()
        };
        let b = HostSnapshot {
            memcg: [("pgmajfault".to_string(), 8), ("rss".to_string(), 40)].into(),
            ..Default::default()
        };
        let d = HostDelta::between(&a, &b);
        assert_eq!(d.memcg["pgmajfault"], 3);
        assert_eq!(d.memcg["rss"], 40);
    }
}
