//! VSWAPPER wiring of one VM (docs/vswapper.md): its memory limit (a memory cgroup with host swap
//! behind it, `--memory-limit`), the Swap Mapper on its virtio-blk disks (`--swap-mode`), the
//! host's swap counters as deltas over the run (`swap.host.*`) and per guest phase
//! (`LUCID_HC_PHASE`: `swap.phase.<n>.*`).
//!
//! Everything here that needs a file (the cgroup's files, `/proc/vmstat`, `/proc/self/stat`) is
//! opened while the VM is built, before any thread is confined: afterwards the VM's threads only
//! `pread` what is already open (the vCPU thread that serves a PHASE hypercall may not `open`).
//!
//! The limit, the host counters and the mapper are lane S1's `lucid_swap::{limit, host, mapper}`;
//! until they are merged, small local versions stand in for them below (each marked `LEAD:`).
//! LEAD: when swapping in S1's types, keep the two rules the stand-ins follow, or the default
//! `--seccomp` kills the VM (exit 148): (1) sampling (`HostCounters::snapshot`/`delta`,
//! `MemoryLimit::usage`) must `pread` descriptors opened at start, never open by path: it runs
//! on a vCPU thread (PHASE) and on the confined main thread (the report's probe); (2)
//! `MemoryLimit`'s drop runs on the confined main thread: it may only `write` to a descriptor
//! opened at `apply` (the parent's `cgroup.procs`) and must not `rmdir` when
//! `Seccomp::of_this_thread()` is set; `apply` prunes the empty cgroups of dead pids instead.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::Write;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, Weak};
use std::time::Instant;

use lucid_hv::kvm_bindings::kvm_regs;
use lucid_mem::{Access, DeviceId, DmaObserver, GuestRam, MemError, PageDiscard};
use lucid_stats::{Counter, StatsRegistry};
use lucid_swap::SwapMode;
use lucid_virtio::blk::BlockDataHook;

use crate::config::{PciDeviceKind, VmConfig};
use crate::hooks::ExitHooks;

/// What the swap hypercall returns for a phase number it will not record.
const HYPERCALL_REFUSED: u64 = u64::MAX;
/// Phases the guest may name (0..MAX_PHASES): each adds five counters to the registry.
pub const MAX_PHASES: u64 = 256;
const PAGE: u64 = 4096;

/// Why the VM's swap set-up failed; each says how to fix it.
#[derive(Debug, thiserror::Error)]
pub enum SwapError {
    #[error(
        "--memory-limit needs the memory cgroup controller, which this host does not offer \
         (neither /sys/fs/cgroup/memory nor a cgroup v2 hierarchy with \"memory\" in \
         cgroup.controllers); enable it (cgroup_enable=memory) or drop --memory-limit"
    )]
    NoMemoryController,
    #[error(
        "--memory-limit needs host swap as its backstop, and /proc/swaps lists none; add a \
         swap file, e.g.: fallocate -l 4G /swapfile && chmod 600 /swapfile && mkswap /swapfile \
         && swapon /swapfile"
    )]
    NoSwap,
    #[error("--memory-limit: cannot {what} {path}: {source} (Lucid must run as root, or own the cgroup hierarchy)")]
    Cgroup {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("--memory-limit {mib} MiB: the limit must be at least 16 MiB")]
    LimitTooSmall { mib: u64 },
    #[error("cannot open {path} for the swap counters: {source}")]
    Counters {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// The swap side of a VM, kept by [`crate::Vm`] for its lifetime.
pub(crate) struct VmSwap {
    /// Dropped last: the process leaves the cgroup when the VM goes.
    limit: Option<Arc<LocalLimit>>,
    mapper: Option<Arc<LocalMapper>>,
    phases: Option<Arc<Phases>>,
}

impl VmSwap {
    /// Applies `--memory-limit` before guest RAM is allocated, so every guest page is charged to
    /// the VM's cgroup.
    pub(crate) fn limit(config: &VmConfig) -> Result<Option<Arc<LocalLimit>>, SwapError> {
        match config.memory_limit_mib {
            None => Ok(None),
            Some(mib) if mib < 16 => Err(SwapError::LimitTooSmall { mib }),
            Some(mib) => apply_limit("vm", mib << 20).map(|l| Some(Arc::new(l))),
        }
    }

    /// The rest, once guest RAM exists: the mapper (for `config.swap_mode` other than
    /// baseline), the host counters probe and the PHASE hypercall.
    pub(crate) fn build(
        config: &VmConfig,
        limit: Option<Arc<LocalLimit>>,
        ram: &Arc<GuestRam>,
        stats: &Arc<StatsRegistry>,
        hooks: &ExitHooks,
    ) -> Result<VmSwap, SwapError> {
        let mapper = match config.swap_mode {
            SwapMode::Baseline => None,
            mode => Some(new_mapper(ram.clone(), mode, stats)),
        };
        let swapping = limit.is_some() || mapper.is_some();
        if swapping {
            stats.counter("swap.mode").set(mode_code(config.swap_mode));
            if let Some(l) = &limit {
                stats.counter("swap.limit_bytes").set(l.bytes);
                let l = l.clone();
                stats.probe(
                    "swap.cgroup",
                    Box::new(move || vec![("usage_bytes".into(), l.usage().unwrap_or(0))]),
                );
            }
            if mapper.is_some() && config.iommu.is_some() {
                log::warn!(
                    "--swap-mode {}: with a vIOMMU the disks' addresses are IOVAs, so the mapper \
                     stays idle (every read is copied)",
                    config.swap_mode
                );
            }
        }
        // The counters are cheap to keep: a VM may report phases with or without a limit.
        let phases = match HostSampler::open(limit.as_deref()) {
            Ok(host) => {
                let host = Arc::new(host);
                let start = host.sample();
                let h = host.clone();
                stats.probe(
                    "swap.host",
                    Box::new(move || h.sample().delta(&start).named()),
                );
                let p = Arc::new(Phases {
                    host,
                    stats: Arc::downgrade(stats),
                    current: Mutex::new(None),
                    ignored: stats.counter("swap.phase.ignored"),
                });
                add_phase_hypercall(hooks, &p);
                Some(p)
            }
            Err(e) if swapping => return Err(e),
            Err(e) => {
                log::debug!("no host swap counters: {e}");
                None
            }
        };
        Ok(VmSwap {
            limit,
            mapper,
            phases,
        })
    }

    /// The hook to install on every virtio-blk disk (none in baseline mode).
    pub(crate) fn blk_hook(&self) -> Option<Arc<dyn BlockDataHook>> {
        self.mapper.clone().map(|m| m as Arc<dyn BlockDataHook>)
    }

    /// The DMA observer (the mapper forgets pages a device wrote into).
    pub(crate) fn dma_observer(&self) -> Option<Arc<dyn DmaObserver>> {
        self.mapper.clone().map(|m| m as Arc<dyn DmaObserver>)
    }

    /// What gives guest pages back (the balloon, free page reporting): the mapper when there is
    /// one (it must forget file-backed pages), else guest RAM itself.
    // TODO(lead): S3's balloon takes this as its `Arc<dyn PageDiscard>`.
    #[allow(dead_code)]
    pub(crate) fn page_discard(&self, ram: &Arc<GuestRam>) -> Arc<dyn PageDiscard> {
        match &self.mapper {
            Some(m) => m.clone(),
            None => ram.clone(),
        }
    }

    /// The VM stopped: the phase the guest was in ends now.
    pub(crate) fn finish(&self) {
        if let Some(p) = &self.phases {
            p.close_current();
        }
    }

    pub(crate) fn has_limit(&self) -> bool {
        self.limit.is_some()
    }
}

/// `swap.mode`: 0 baseline, 1 mapper, 2 vswapper (the summary turns it back into a name).
fn mode_code(m: SwapMode) -> u64 {
    match m {
        SwapMode::Baseline => 0,
        SwapMode::Mapper => 1,
        SwapMode::Vswapper => 2,
    }
}

/// The name of `swap.mode` value `code`.
pub(crate) fn mode_name(code: u64) -> &'static str {
    match code {
        1 => "mapper",
        2 => "vswapper",
        _ => "baseline",
    }
}

/// The mapper modes need 4 KiB logical blocks: a page-sized, page-aligned read is what maps.
/// Returns the first disk (index, block size) that has smaller ones.
pub(crate) fn disk_refused_by(config: &VmConfig) -> Option<(usize, u32)> {
    if config.swap_mode == SwapMode::Baseline {
        return None;
    }
    config
        .pci
        .iter()
        .filter_map(|d| match &d.kind {
            PciDeviceKind::Block(b) => Some(b.logical_block_size),
            _ => None,
        })
        .enumerate()
        .find(|&(_, bs)| u64::from(bs) != PAGE)
}

// ---------------------------------------------------------------------------------------------
// Phases: LUCID_HC_PHASE

/// Host counters sampled when the guest starts a phase; the deltas go to `swap.phase.<n>.*`.
struct Phases {
    host: Arc<HostSampler>,
    stats: Weak<StatsRegistry>,
    current: Mutex<Option<(u64, Instant, Sample)>>,
    ignored: Arc<Counter>,
}

impl Phases {
    /// Phase `n` starts: the one before it ends.
    fn start(&self, n: u64) -> u64 {
        if n >= MAX_PHASES {
            self.ignored.inc();
            return HYPERCALL_REFUSED;
        }
        let now = (Instant::now(), self.host.sample());
        let prev = self
            .current
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .replace((n, now.0, now.1.clone()));
        if let Some(prev) = prev {
            self.record(prev, now);
        }
        0
    }

    fn close_current(&self) {
        let prev = self
            .current
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(prev) = prev {
            self.record(prev, (Instant::now(), self.host.sample()));
        }
    }

    /// Adds phase `n`'s figures (a phase named twice sums both stretches).
    fn record(&self, (n, t0, s0): (u64, Instant, Sample), (t1, s1): (Instant, Sample)) {
        let Some(stats) = self.stats.upgrade() else {
            return;
        };
        let d = s1.delta(&s0);
        let ms = t1.duration_since(t0).as_millis() as u64;
        for (k, v) in [
            ("ms", ms),
            ("swap_read_sectors", d.pswpin * 8),
            ("swap_write_sectors", d.pswpout * 8),
            ("majflt", d.majflt),
            ("vmm_text_faults", d.vmm_text_faults),
        ] {
            stats.counter(format!("swap.phase.{n}.{k}")).add(v);
        }
    }
}

fn add_phase_hypercall(hooks: &ExitHooks, phases: &Arc<Phases>) {
    let p = Arc::downgrade(phases);
    hooks.add_hypercall(
        crate::hypercall::PHASE,
        Arc::new(move |_: u32, regs: &kvm_regs| match p.upgrade() {
            Some(p) => p.start(regs.rdi),
            None => HYPERCALL_REFUSED,
        }),
    );
}

// ---------------------------------------------------------------------------------------------
// Host counters. LEAD: replace with lucid_swap::host::HostCounters (it must read through
// descriptors opened before confinement: it is sampled on vCPU and main threads).

/// One reading of the host's swap counters.
#[derive(Clone, Debug, Default)]
struct Sample {
    pswpin: u64,
    pswpout: u64,
    swpin_zero: u64,
    swpout_zero: u64,
    pgmajfault: u64,
    refault_anon: u64,
    refault_file: u64,
    /// This process's major faults.
    majflt: u64,
    /// Major faults on Lucid's own text. LEAD: S1's `vmm_text_faults()`; 0 here.
    vmm_text_faults: u64,
}

impl Sample {
    fn delta(&self, from: &Sample) -> Sample {
        let d = |a: u64, b: u64| a.saturating_sub(b);
        Sample {
            pswpin: d(self.pswpin, from.pswpin),
            pswpout: d(self.pswpout, from.pswpout),
            swpin_zero: d(self.swpin_zero, from.swpin_zero),
            swpout_zero: d(self.swpout_zero, from.swpout_zero),
            pgmajfault: d(self.pgmajfault, from.pgmajfault),
            refault_anon: d(self.refault_anon, from.refault_anon),
            refault_file: d(self.refault_file, from.refault_file),
            majflt: d(self.majflt, from.majflt),
            vmm_text_faults: d(self.vmm_text_faults, from.vmm_text_faults),
        }
    }

    fn named(&self) -> Vec<(String, u64)> {
        [
            ("pswpin", self.pswpin),
            ("pswpout", self.pswpout),
            ("swpin_zero", self.swpin_zero),
            ("swpout_zero", self.swpout_zero),
            ("pgmajfault", self.pgmajfault),
            ("workingset_refault_anon", self.refault_anon),
            ("workingset_refault_file", self.refault_file),
            ("swap_read_sectors", self.pswpin * 8),
            ("swap_write_sectors", self.pswpout * 8),
            ("majflt", self.majflt),
            ("vmm_text_faults", self.vmm_text_faults),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect()
    }
}

/// `/proc/vmstat` and `/proc/self/stat`, open for the VM's lifetime.
struct HostSampler {
    vmstat: File,
    stat: File,
}

impl HostSampler {
    fn open(_limit: Option<&LocalLimit>) -> Result<HostSampler, SwapError> {
        let open = |p: &str| {
            File::open(p).map_err(|source| SwapError::Counters {
                path: p.into(),
                source,
            })
        };
        Ok(HostSampler {
            vmstat: open("/proc/vmstat")?,
            stat: open("/proc/self/stat")?,
        })
    }

    fn sample(&self) -> Sample {
        let mut s = Sample::default();
        let vmstat = pread_all(&self.vmstat);
        for line in vmstat.lines() {
            let Some((k, v)) = line.split_once(' ') else {
                continue;
            };
            let v = v.trim().parse().unwrap_or(0);
            match k {
                "pswpin" => s.pswpin = v,
                "pswpout" => s.pswpout = v,
                "swpin_zero" => s.swpin_zero = v,
                "swpout_zero" => s.swpout_zero = v,
                "pgmajfault" => s.pgmajfault = v,
                "workingset_refault_anon" => s.refault_anon = v,
                "workingset_refault_file" => s.refault_file = v,
                _ => {}
            }
        }
        // Field 12 (majflt), counted after the command name's closing parenthesis.
        let stat = pread_all(&self.stat);
        s.majflt = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().nth(9))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        s
    }
}

/// The whole of a procfs or cgroup file, read from offset 0 through an open descriptor.
fn pread_all(f: &File) -> String {
    let mut out = Vec::new();
    let mut buf = [0u8; 8192];
    loop {
        match f.read_at(&mut buf, out.len() as u64) {
            Ok(0) | Err(_) => break,
            Ok(n) => out.extend_from_slice(&buf[..n]),
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

// ---------------------------------------------------------------------------------------------
// The memory limit. LEAD: replace with lucid_swap::limit::MemoryLimit::apply(name, bytes)
// (its Drop must not open or rmdir on a confined thread: see `Drop for LocalLimit`).

/// The VM process's memory cgroup: `<root>/lucid/<name>-<pid>`.
pub(crate) struct LocalLimit {
    dir: PathBuf,
    bytes: u64,
    /// `cgroup.procs` of the cgroup the process came from, open for writing: leaving needs no
    /// `open` (the thread that drops the VM is confined by then).
    home_procs: File,
    usage: File,
}

impl LocalLimit {
    fn usage(&self) -> Option<u64> {
        pread_all(&self.usage).trim().parse().ok()
    }
}

impl Drop for LocalLimit {
    fn drop(&mut self) {
        let _ = write!(&self.home_procs, "{}", std::process::id());
        // Removing the directory needs rmdir, which no confined role may call: a confined
        // thread leaves the empty cgroup for the next `apply` to prune.
        if lucid_seccomp::Seccomp::of_this_thread().is_none() {
            let _ = std::fs::remove_dir(&self.dir);
        }
    }
}

fn apply_limit(name: &str, bytes: u64) -> Result<LocalLimit, SwapError> {
    let swaps = std::fs::read_to_string("/proc/swaps").unwrap_or_default();
    if swaps.lines().skip(1).all(|l| l.trim().is_empty()) {
        return Err(SwapError::NoSwap);
    }
    let own = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
    let cg_err = |what, path: &Path| {
        let path = path.to_path_buf();
        move |source| SwapError::Cgroup { what, path, source }
    };
    // v1 where the host mounts the memory controller there (as this dev box does), else v2.
    let v1 = Path::new("/sys/fs/cgroup/memory");
    let (root, home, limit_file, usage_file) = if v1.join("memory.limit_in_bytes").exists() {
        let home = own
            .lines()
            .find_map(|l| {
                let mut f = l.splitn(3, ':');
                let (_, ctrls, path) = (f.next()?, f.next()?, f.next()?);
                ctrls.split(',').any(|c| c == "memory").then_some(path)
            })
            .unwrap_or("/");
        (
            v1.to_path_buf(),
            home.to_string(),
            "memory.limit_in_bytes",
            "memory.usage_in_bytes",
        )
    } else {
        let v2 = ["/sys/fs/cgroup/unified", "/sys/fs/cgroup"]
            .into_iter()
            .map(Path::new)
            .find(|p| {
                std::fs::read_to_string(p.join("cgroup.controllers"))
                    .is_ok_and(|c| c.split_whitespace().any(|c| c == "memory"))
            })
            .ok_or(SwapError::NoMemoryController)?;
        let home = own
            .lines()
            .find_map(|l| l.strip_prefix("0::"))
            .unwrap_or("/");
        (
            v2.to_path_buf(),
            home.to_string(),
            "memory.max",
            "memory.current",
        )
    };
    let base = root.join("lucid");
    std::fs::create_dir_all(&base).map_err(cg_err("create", &base))?;
    if root.join("cgroup.subtree_control").exists() {
        // v2: the memory controller must be enabled for lucid/'s children.
        let ctl = base.join("cgroup.subtree_control");
        let _ = std::fs::write(root.join("cgroup.subtree_control"), "+memory");
        std::fs::write(&ctl, "+memory").map_err(cg_err("enable memory in", &ctl))?;
    }
    prune_stale(&base);
    let dir = base.join(format!("{name}-{}", std::process::id()));
    match std::fs::create_dir(&dir) {
        Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => {
            return Err(cg_err("create", &dir)(e))
        }
        _ => {}
    }
    let lim = dir.join(limit_file);
    std::fs::write(&lim, bytes.to_string()).map_err(cg_err("write", &lim))?;
    let home_path = root.join(home.trim_start_matches('/')).join("cgroup.procs");
    let home_procs = std::fs::OpenOptions::new()
        .write(true)
        .open(&home_path)
        .map_err(cg_err("open", &home_path))?;
    let usage_path = dir.join(usage_file);
    let usage = File::open(&usage_path).map_err(cg_err("open", &usage_path))?;
    let procs = dir.join("cgroup.procs");
    std::fs::write(&procs, std::process::id().to_string()).map_err(cg_err("join", &procs))?;
    log::info!(
        "memory limit {} MiB: this process is in {}",
        bytes >> 20,
        dir.display()
    );
    Ok(LocalLimit {
        dir,
        bytes,
        home_procs,
        usage,
    })
}

/// Removes `base/<name>-<pid>` cgroups whose process is gone (left by a confined exit).
fn prune_stale(base: &Path) {
    let Ok(entries) = std::fs::read_dir(base) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(pid) = name
            .rsplit_once('-')
            .and_then(|(_, p)| p.parse::<u32>().ok())
        else {
            continue;
        };
        if !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = std::fs::remove_dir(e.path());
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The Swap Mapper. LEAD: replace with lucid_swap::mapper::SwapMapper::new(ram, mode, stats,
// budget). This stand-in maps aligned reads, breaks mappings before changes and forgets pages
// devices wrote or the balloon discarded; it lacks PAGEMAP_SCAN (COWed pages stay in its map
// until their block changes: harmless, MADV_POPULATE_WRITE on them is a no-op) and vswapper's
// false-read prevention (vswapper behaves as mapper).

fn new_mapper(ram: Arc<GuestRam>, mode: SwapMode, stats: &StatsRegistry) -> Arc<LocalMapper> {
    let max_map = std::fs::read_to_string("/proc/sys/vm/max_map_count")
        .ok()
        .and_then(|s| s.trim().parse::<u64>().ok())
        .unwrap_or(65530);
    let c = |n: &str| stats.counter(format!("swap.mapper.{n}"));
    log::info!("swap mode {mode}: VMA budget {}", max_map / 2);
    Arc::new(LocalMapper {
        ram,
        budget: max_map / 2,
        state: Mutex::new(MapState::default()),
        mapped_pages: c("mapped_pages"),
        runs: c("runs"),
        broken: c("broken"),
        fallbacks: c("fallbacks"),
        vmas: c("vmas"),
    })
}

/// Which image block each mapped guest page shows, and the reverse.
#[derive(Default)]
struct MapState {
    /// gpa page -> (image fd, block offset).
    pages: HashMap<u64, (i32, u64)>,
    /// (image fd, block offset) -> gpa pages mapping it.
    blocks: BTreeMap<(i32, u64), Vec<u64>>,
    /// Live remapped ranges (gpa -> len); a later remap or discard that covers one replaces
    /// its VMA. Their number bounds the VMAs the mapper added (partial overlaps count twice).
    runs: BTreeMap<u64, u64>,
}

impl MapState {
    /// Drops the runs that `gpa..gpa+len` covers entirely.
    fn cover(&mut self, gpa: u64, len: u64) {
        let end = gpa + len;
        let covered: Vec<u64> = self
            .runs
            .range(gpa..end)
            .filter(|&(&g, &l)| g + l <= end)
            .map(|(&g, _)| g)
            .collect();
        for g in covered {
            self.runs.remove(&g);
        }
    }
}

impl MapState {
    fn forget(&mut self, gpa: u64) -> bool {
        let Some(key) = self.pages.remove(&gpa) else {
            return false;
        };
        if let Some(v) = self.blocks.get_mut(&key) {
            v.retain(|&g| g != gpa);
            if v.is_empty() {
                self.blocks.remove(&key);
            }
        }
        true
    }
}

pub(crate) struct LocalMapper {
    ram: Arc<GuestRam>,
    budget: u64,
    state: Mutex<MapState>,
    mapped_pages: Arc<Counter>,
    runs: Arc<Counter>,
    broken: Arc<Counter>,
    fallbacks: Arc<Counter>,
    vmas: Arc<Counter>,
}

impl LocalMapper {
    fn lock(&self) -> std::sync::MutexGuard<'_, MapState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The host address of guest-physical `gpa..gpa+len`, inside one RAM region.
    fn host(&self, gpa: u64, len: u64) -> Option<u64> {
        self.ram
            .regions()
            .iter()
            .find(|r| gpa >= r.gpa && gpa.checked_add(len).is_some_and(|e| e <= r.gpa + r.size))
            .map(|r| r.host_addr + (gpa - r.gpa))
    }

    fn madvise(host: u64, len: u64, advice: i32) -> std::io::Result<()> {
        // SAFETY: `host..host+len` is guest RAM this process maps (checked by `host`); the
        // populate advices fault pages in without changing what they hold.
        if unsafe { libc::madvise(host as *mut libc::c_void, len as usize, advice) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    }
}

impl BlockDataHook for LocalMapper {
    fn read(&self, file: &File, off: u64, gpa: u64, len: u64) -> std::io::Result<bool> {
        if !(off.is_multiple_of(PAGE) && gpa.is_multiple_of(PAGE) && len.is_multiple_of(PAGE)) {
            return Ok(false);
        }
        let Some(host) = self.host(gpa, len) else {
            return Ok(false);
        };
        let mut st = self.lock();
        if st.runs.len() as u64 >= self.budget {
            self.fallbacks.inc();
            return Ok(false);
        }
        let fd = file.as_raw_fd();
        // SAFETY: fadvise on a descriptor the device owns; no memory is involved.
        unsafe { libc::posix_fadvise(fd, off as i64, len as i64, libc::POSIX_FADV_WILLNEED) };
        if let Err(e) = self.ram.remap(gpa, len, Some((file, off))) {
            log::debug!("mapper: remap {gpa:#x}+{len:#x}: {e}");
            self.fallbacks.inc();
            return Ok(false);
        }
        // Present, read-only, still the page cache's pages: no copy-on-write until the guest
        // stores (MAP_POPULATE would COW every page).
        Self::madvise(host, len, libc::MADV_POPULATE_READ)?;
        for p in 0..len / PAGE {
            let g = gpa + p * PAGE;
            st.forget(g);
            let key = (fd, off + p * PAGE);
            st.pages.insert(g, key);
            st.blocks.entry(key).or_default().push(g);
        }
        st.cover(gpa, len);
        st.runs.insert(gpa, len);
        self.vmas.set(st.runs.len() as u64);
        self.mapped_pages.set(st.pages.len() as u64);
        self.runs.inc();
        Ok(true)
    }

    fn before_change(&self, file: &File, off: u64, len: u64) -> std::io::Result<()> {
        let fd = file.as_raw_fd();
        let start = off / PAGE * PAGE;
        let end = off.saturating_add(len);
        let mut st = self.lock();
        let gpas: Vec<u64> = st
            .blocks
            .range((fd, start)..(fd, end))
            .flat_map(|(_, v)| v.iter().copied())
            .collect();
        for g in gpas {
            // Copy-on-write now, while the file still holds what the guest read.
            if let Some(host) = self.host(g, PAGE) {
                Self::madvise(host, PAGE, libc::MADV_POPULATE_WRITE)?;
            }
            st.forget(g);
            self.broken.inc();
        }
        self.mapped_pages.set(st.pages.len() as u64);
        Ok(())
    }
}

impl DmaObserver for LocalMapper {
    fn observe(&self, _dev: DeviceId, gpa: u64, len: u64, access: Access) {
        if !matches!(access, Access::Write) {
            return;
        }
        // The device's copy made private copies of the pages it wrote: they no longer show
        // their block.
        let mut st = self.lock();
        if st.pages.is_empty() {
            return;
        }
        let mut g = gpa / PAGE * PAGE;
        while g < gpa.saturating_add(len) {
            if st.forget(g) {
                self.broken.inc();
            }
            g += PAGE;
        }
        self.mapped_pages.set(st.pages.len() as u64);
    }
}

impl PageDiscard for LocalMapper {
    fn discard(&self, gpa: u64, len: u64) -> Result<(), MemError> {
        let mut st = self.lock();
        // Anonymous zero pages over the range: MADV_DONTNEED would bring the block back.
        self.ram.remap(gpa, len, None)?;
        let mut g = gpa;
        while g < gpa + len {
            st.forget(g);
            g += PAGE;
        }
        st.cover(gpa, len);
        self.vmas.set(st.runs.len() as u64);
        self.mapped_pages.set(st.pages.len() as u64);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{KernelSource, PciDeviceConfig};
    use lucid_mem::vm_memory::{Bytes, GuestAddress};
    use lucid_mem::Backing;
    use lucid_virtio::blk::BlockConfig;

    fn config_with_disk(mode: SwapMode, bs: u32) -> VmConfig {
        let mut c = VmConfig::new(KernelSource::Builtin {
            name: "t".into(),
            bytes: &[],
        });
        c.swap_mode = mode;
        c.pci
            .push(PciDeviceConfig::new(PciDeviceKind::Block(BlockConfig {
                path: "/nonexistent".into(),
                read_only: false,
                logical_block_size: bs,
                id: String::new(),
                direct: false,
            })));
        c
    }

    #[test]
    fn mapper_modes_need_4k_blocks_and_baseline_does_not() {
        assert_eq!(
            disk_refused_by(&config_with_disk(SwapMode::Mapper, 512)),
            Some((0, 512))
        );
        assert_eq!(
            disk_refused_by(&config_with_disk(SwapMode::Vswapper, 512)),
            Some((0, 512))
        );
        assert_eq!(
            disk_refused_by(&config_with_disk(SwapMode::Mapper, 4096)),
            None
        );
        assert_eq!(
            disk_refused_by(&config_with_disk(SwapMode::Baseline, 512)),
            None
        );
    }

    #[test]
    fn phases_record_deltas_and_refuse_numbers_out_of_range() {
        let stats = StatsRegistry::new();
        let p = Phases {
            host: Arc::new(HostSampler::open(None).unwrap()),
            stats: Arc::downgrade(&stats),
            current: Mutex::new(None),
            ignored: stats.counter("swap.phase.ignored"),
        };
        assert_eq!(p.start(0), 0);
        assert_eq!(p.start(MAX_PHASES), HYPERCALL_REFUSED);
        assert_eq!(p.start(u64::MAX), HYPERCALL_REFUSED);
        assert_eq!(p.start(3), 0);
        p.close_current();
        p.close_current();
        let snap = stats.snapshot();
        assert_eq!(snap["swap.phase.ignored"], 2);
        for n in [0, 3] {
            for k in [
                "ms",
                "swap_read_sectors",
                "swap_write_sectors",
                "majflt",
                "vmm_text_faults",
            ] {
                assert!(snap.contains_key(&format!("swap.phase.{n}.{k}")), "{n}.{k}");
            }
        }
        assert!(!snap.keys().any(|k| k.starts_with("swap.phase.256")));
    }

    fn image(tag: &str, data: &[u8]) -> (PathBuf, File) {
        let p = std::env::temp_dir().join(format!("lucid-s2-{tag}-{}.img", std::process::id()));
        std::fs::write(&p, data).unwrap();
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&p)
            .unwrap();
        (p, f)
    }

    fn read_guest(ram: &GuestRam, gpa: u64, len: usize) -> Vec<u8> {
        let mut v = vec![0; len];
        ram.memory().read_slice(&mut v, GuestAddress(gpa)).unwrap();
        v
    }

    /// The consistency gate on the stand-in: a page read from block B, dropped by the host,
    /// still shows what the guest read after B is overwritten (before_change first).
    #[test]
    fn stand_in_mapper_keeps_what_the_guest_read() {
        let old: Vec<u8> = (0..1 << 20).map(|i| (i * 7 % 251) as u8).collect();
        let (path, file) = image("gate", &old);
        let ram = Arc::new(GuestRam::new(&[(0, 4 << 20)], Backing::Anonymous).unwrap());
        let stats = StatsRegistry::new();
        let m = new_mapper(ram.clone(), SwapMode::Mapper, &stats);
        // Unaligned: declined.
        assert!(!m.read(&file, 512, 0x10000, 4096).unwrap());
        assert!(!m.read(&file, 4096, 0x10200, 4096).unwrap());
        // Two blocks at 8 KiB into two guest pages.
        assert!(m.read(&file, 8192, 0x10000, 8192).unwrap());
        assert!(read_guest(&ram, 0x10000, 8192) == old[8192..16384]);
        // The host drops the (clean, file-backed) pages.
        let host = m.host(0x10000, 8192).unwrap();
        LocalMapper::madvise(host, 8192, libc::MADV_PAGEOUT).unwrap();
        // The guest writes new content to the first block.
        m.before_change(&file, 8192, 4096).unwrap();
        file.write_all_at(&[0xee; 4096], 8192).unwrap();
        assert!(read_guest(&ram, 0x10000, 8192) == old[8192..16384]);
        let snap = stats.snapshot();
        assert_eq!(snap["swap.mapper.broken"], 1);
        assert_eq!(snap["swap.mapper.mapped_pages"], 1);
        assert_eq!(snap["swap.mapper.runs"], 1);
        assert_eq!(snap["swap.mapper.vmas"], 1);
        // A device writing into the second page makes it private: forgotten.
        ram.memory()
            .write_slice(&[1, 2, 3], GuestAddress(0x11000))
            .unwrap();
        m.observe(0, 0x11000, 3, Access::Write);
        assert_eq!(stats.snapshot()["swap.mapper.mapped_pages"], 0);
        assert_eq!(read_guest(&ram, 0x11000, 3), [1, 2, 3]);
        // Discard: zeros, and the run is gone.
        assert!(m.read(&file, 0, 0x20000, 4096).unwrap());
        m.discard(0x20000, 4096).unwrap();
        assert_eq!(read_guest(&ram, 0x20000, 4096), vec![0; 4096]);
        let snap = stats.snapshot();
        assert_eq!(snap["swap.mapper.mapped_pages"], 0);
        assert_eq!(snap["swap.mapper.vmas"], 1);
        let _ = std::fs::remove_file(path);
    }
}
