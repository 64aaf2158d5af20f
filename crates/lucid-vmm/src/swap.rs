//! VSWAPPER wiring of one VM (docs/vswapper.md): its memory limit (a memory cgroup with host swap
//! behind it, `--memory-limit`), the Swap Mapper on its virtio-blk disks (`--swap-mode`), the
//! host's swap counters as deltas over the run (`swap.host.*`) and per guest phase
//! (`LUCID_HC_PHASE`: `swap.phase.<n>.*`).
//!
//! Everything here that needs a file (the cgroup's files, `/proc/vmstat`, `/proc/self/stat`) is
//! opened while the VM is built, before any thread is confined: afterwards the VM's threads only
//! `pread` what is already open (the vCPU thread that serves a PHASE hypercall may not `open`).
//!
//! The limit, the host counters and the mapper are `lucid_swap::{limit, host, mapper}`. Two
//! rules keep them working under the default `--seccomp`: sampling (`HostCounters::snapshot`,
//! `MemoryLimit::usage`) reads descriptors opened at start, never a path (it runs on a vCPU
//! for PHASE and on the confined main thread for the report), and the limit's drop, on the
//! confined main thread, writes the parent's `cgroup.procs` through a descriptor and leaves the
//! empty directory to the next VM's `apply`.

use std::sync::{Arc, Mutex, Weak};
use std::time::Instant;

use lucid_hv::kvm_bindings::kvm_regs;
use lucid_mem::{DmaObserver, GuestRam, PageDiscard};
use lucid_stats::{Counter, StatsRegistry};
use lucid_swap::host::{HostCounters, HostSnapshot};
use lucid_swap::limit::{LimitError, MemoryLimit};
use lucid_swap::mapper::{MapperBudget, SwapMapper};
use lucid_swap::SwapMode;
use lucid_virtio::blk::BlockDataHook;

use crate::config::{PciDeviceKind, VmConfig};
use crate::hooks::ExitHooks;

/// What the swap hypercall returns for a phase number it will not record.
const HYPERCALL_REFUSED: u64 = u64::MAX;
/// Phases the guest may name (0..MAX_PHASES): each adds five counters to the registry.
pub const MAX_PHASES: u64 = 256;

/// Why the VM's swap set-up failed; each says how to fix it.
#[derive(Debug, thiserror::Error)]
pub enum SwapError {
    #[error("--memory-limit: {0}")]
    Limit(#[from] LimitError),
    #[error("--memory-limit: cannot start the pager thread: {0}")]
    Pager(#[source] std::io::Error),
    #[error(transparent)]
    Hooks(#[from] crate::hooks::HookError),
}

/// The swap side of a VM, kept by [`crate::Vm`] for its lifetime.
pub(crate) struct VmSwap {
    mapper: Option<Arc<SwapMapper>>,
    phases: Option<Arc<Phases>>,
    /// Stops (joins its thread, turns the OOM killer back on) when the VM is dropped.
    pager: Option<lucid_swap::pager::Pager>,
    pager_on: bool,
    /// Runs `lucid __oom-guard` (cgroup v1 with a pager; `RuntimeConfig::oom_guard`).
    guard_command: Option<fn() -> std::process::Command>,
    /// Killed and reaped when the VM is dropped.
    guard: Option<lucid_swap::guard::OomGuard>,
    /// The disk images (the pager drops their unmapped page cache).
    images: Vec<std::path::PathBuf>,
    /// Dropped last (fields drop in order): the process leaves the cgroup, and the cgroup is
    /// removed, after the pager has stopped writing its oom_control.
    limit: Option<Arc<MemoryLimit>>,
}

impl VmSwap {
    /// Applies `--memory-limit` before guest RAM is allocated, so every guest page is charged to
    /// the VM's cgroup.
    pub(crate) fn limit(config: &VmConfig) -> Result<Option<Arc<MemoryLimit>>, SwapError> {
        match config.memory.limit_mib {
            None => Ok(None),
            Some(mib) => Ok(Some(Arc::new(MemoryLimit::apply("vm", mib << 20)?))),
        }
    }

    /// The rest, once guest RAM exists: the mapper (for `config.memory.swap_mode` other than
    /// baseline), the host counters probe and the PHASE hypercall.
    pub(crate) fn build(
        config: &VmConfig,
        limit: Option<Arc<MemoryLimit>>,
        ram: &Arc<GuestRam>,
        stats: &Arc<StatsRegistry>,
        hooks: &ExitHooks,
    ) -> Result<VmSwap, SwapError> {
        let mapper = match config.memory.swap_mode {
            SwapMode::Baseline => None,
            mode => {
                let m = SwapMapper::new(ram.clone(), mode, stats, MapperBudget::default());
                log::info!("swap mode {mode}: {}", m.summary());
                Some(m)
            }
        };
        let swapping = limit.is_some() || mapper.is_some();
        if swapping {
            stats
                .counter("swap.mode")
                .set(mode_code(config.memory.swap_mode));
            if let Some(l) = &limit {
                stats.counter("swap.limit_bytes").set(l.limit_bytes());
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
                    config.memory.swap_mode
                );
            }
        }
        // The counters are cheap to keep: a VM may report phases with or without a limit. They
        // start after the limit is applied, so that memory.stat is the VM's own cgroup's.
        let host = Arc::new(match &limit {
            Some(l) => HostCounters::start_in(l),
            None => HostCounters::start(),
        });
        lucid_swap::host::register_probe(stats, host.clone());
        let phases = Arc::new(Phases {
            host,
            stats: Arc::downgrade(stats),
            current: Mutex::new(None),
            ignored: stats.counter("swap.phase.ignored"),
        });
        add_phase_hypercall(hooks, &phases)?;
        let phases = Some(phases);
        Ok(VmSwap {
            limit,
            mapper,
            phases,
            pager: None,
            pager_on: config.memory.pager,
            guard_command: config.runtime.oom_guard,
            guard: None,
            images: config
                .devices
                .pci
                .iter()
                .filter_map(|d| match &d.kind {
                    PciDeviceKind::Block(b) => Some(b.path.clone()),
                    _ => None,
                })
                .collect(),
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
    pub(crate) fn page_discard(&self, ram: &Arc<GuestRam>) -> Arc<dyn PageDiscard> {
        match &self.mapper {
            Some(m) => m.clone(),
            None => ram.clone(),
        }
    }

    /// Starts `lucid-pager` (with a limit and `--swap-pager on`), before the vCPUs run.
    pub(crate) fn start_pager(
        &mut self,
        ram: &GuestRam,
        hooks: &crate::hooks::ExitHooks,
        stats: &StatsRegistry,
        spawner: &lucid_thread::Spawner,
    ) -> Result<(), SwapError> {
        use lucid_swap::pager::{Pager, PagerConfig};
        let Some(limit) = self.limit.clone().filter(|_| self.pager_on) else {
            return Ok(());
        };
        if self.pager.is_some() {
            return Ok(());
        }
        let ranges = ram
            .regions()
            .iter()
            .map(|r| (r.host_addr, r.size))
            .collect();
        let images = self
            .images
            .iter()
            .filter_map(|p| std::fs::File::open(p).ok())
            .collect();
        let own_ranges: Vec<(u64, u64)> = ram
            .regions()
            .iter()
            .map(|r| (r.host_addr, r.size))
            .collect();
        let pager = Pager::spawn(
            &limit,
            ranges,
            images,
            PagerConfig::for_limit(limit.limit_bytes()),
            stats,
            spawner,
        )
        .map_err(SwapError::Pager)?;
        self.pager = Some(pager);
        self.start_guard(&limit, &own_ranges, stats);
        // KVM's fault path gets EFAULT, not a wait, when the cgroup refuses a charge: the vCPU
        // waits for the pager and retries instead of the VM dying.
        if let Ok(usage) = limit.usage_file() {
            hooks.set_memory_fault(Arc::new(WaitForPager {
                usage,
                high: PagerConfig::for_limit(limit.limit_bytes()).high(),
                chunks: lucid_swap::pager::chunks(&own_ranges, 2 << 20),
                hand: std::sync::atomic::AtomicUsize::new(0),
            }));
        }
        Ok(())
    }

    /// Starts the OOM guard (cgroup v1 only: v2 has no `oom_kill_disable`, so nothing sleeps
    /// at the limit). A guard that cannot start costs a warning, not the VM.
    fn start_guard(&mut self, limit: &MemoryLimit, ram: &[(u64, u64)], stats: &StatsRegistry) {
        use lucid_swap::guard::{GuardConfig, OomGuard};
        let Some(command) = self.guard_command else {
            return;
        };
        if limit.version() != lucid_swap::limit::CgroupVersion::V1 {
            return;
        }
        let config = GuardConfig {
            pid: std::process::id(),
            memcg: limit.path().to_path_buf(),
            home_procs: limit.home_procs(),
            limit: limit.limit_bytes(),
            headroom: lucid_swap::pager::PagerConfig::for_limit(limit.limit_bytes()).headroom,
            chunks: lucid_swap::pager::chunks(ram, 2 << 20),
            grace: std::time::Duration::from_millis(200),
            stall: lucid_swap::pager::PagerConfig::for_limit(limit.limit_bytes()).stall,
        };
        match OomGuard::spawn(command(), &config, stats) {
            Ok(g) => {
                log::debug!("oom guard: process {}", g.pid());
                self.guard = Some(g);
            }
            Err(e) => log::warn!(
                "--memory-limit: cannot start the OOM guard ({e}): if every thread of this VM \
                 waits for memory at once, it hangs"
            ),
        }
    }

    /// The VM stopped: the phase the guest was in ends now. The pager keeps the cgroup under
    /// its limit until the VM is dropped (the report is written in the cgroup too).
    pub(crate) fn finish(&self) {
        if let Some(p) = &self.phases {
            p.close_current();
        }
    }

    /// The balloon manager's pressure: the VM's cgroup when it has a limit.
    pub(crate) fn pressure(&self) -> Option<Arc<dyn lucid_swap::balloon_manager::PressureSource>> {
        self.limit
            .clone()
            .map(|l| Arc::new(crate::balloon::LimitPressure(l)) as _)
    }
}

/// VSWAPPER as one of the VM's techniques: the pager (and its OOM guard) start before the vCPU
/// threads; the phase the guest was in ends when the VM stops; the limit goes when this is
/// dropped, after every other part of the VM.
impl crate::technique::Technique for VmSwap {
    fn name(&self) -> &'static str {
        "vswapper"
    }

    fn starts_before_vcpus(&self) -> bool {
        true
    }

    fn start(&mut self, cx: &crate::technique::StartContext<'_>) -> Result<(), crate::VmmError> {
        Ok(self.start_pager(cx.ram, cx.hooks, cx.stats, cx.spawner)?)
    }

    fn stop(&mut self) {
        self.finish();
    }

    fn counters(&self) -> &'static [&'static str] {
        &["swap."]
    }

    fn summary(&self) -> Vec<String> {
        let mut out = Vec::new();
        if let Some(l) = &self.limit {
            out.push(format!(
                "memory limit {} MiB{}",
                l.limit_bytes() >> 20,
                if self.pager_on { ", pager on" } else { "" }
            ));
        }
        if let Some(m) = &self.mapper {
            out.push(format!("swap mapper: {}", m.summary()));
        }
        out
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

// ---------------------------------------------------------------------------------------------
// Phases: LUCID_HC_PHASE

/// Host counters sampled when the guest starts a phase; the deltas go to `swap.phase.<n>.*`.
struct Phases {
    host: Arc<HostCounters>,
    stats: Weak<StatsRegistry>,
    current: Mutex<Option<(u64, Instant, HostSnapshot)>>,
    ignored: Arc<Counter>,
}

impl Phases {
    /// Phase `n` starts: the one before it ends.
    fn start(&self, n: u64) -> u64 {
        if n >= MAX_PHASES {
            self.ignored.inc();
            return HYPERCALL_REFUSED;
        }
        let now = (Instant::now(), self.host.snapshot());
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
            self.record(prev, (Instant::now(), self.host.snapshot()));
        }
    }

    /// Adds phase `n`'s figures (a phase named twice sums both stretches).
    fn record(&self, (n, t0, s0): (u64, Instant, HostSnapshot), (t1, s1): (Instant, HostSnapshot)) {
        let Some(stats) = self.stats.upgrade() else {
            return;
        };
        let d = HostCounters::delta_between(&s0, &s1);
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

fn add_phase_hypercall(
    hooks: &ExitHooks,
    phases: &Arc<Phases>,
) -> Result<(), crate::hooks::HookError> {
    let p = Arc::downgrade(phases);
    hooks.add_hypercall(
        crate::hypercall::PHASE,
        Arc::new(move |_: u32, regs: &kvm_regs| match p.upgrade() {
            Some(p) => p.start(regs.rdi),
            None => HYPERCALL_REFUSED,
        }),
    )
}

/// The vCPUs' memory-fault hook under a limit: polls the cgroup's usage (a descriptor opened
/// before confinement) until it is under the pager's high mark, for at most 100 ms. Every 10 ms
/// without progress it pages a 2 MiB chunk of guest RAM out itself: with `oom_kill_disable` on,
/// a thread whose own (user-mode) fault is refused a charge sleeps until memory is freed, and if
/// that thread is the pager, only another thread's page-out wakes it.
struct WaitForPager {
    usage: std::fs::File,
    high: u64,
    /// Guest RAM in 2 MiB chunks (host address, length), and the next one to page out.
    chunks: Vec<(u64, u64)>,
    hand: std::sync::atomic::AtomicUsize,
}

impl WaitForPager {
    fn usage(&self) -> Option<u64> {
        lucid_swap::limit::pread_u64(&self.usage)
    }

    fn page_out_one(&self) {
        if self.chunks.is_empty() {
            return;
        }
        let i = self.hand.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % self.chunks.len();
        let (addr, len) = self.chunks[i];
        // SAFETY: the range is guest RAM mapped for the VM's lifetime; MADV_PAGEOUT only moves
        // its pages to swap (or drops clean file pages), the content stays the same.
        unsafe { libc::madvise(addr as *mut libc::c_void, len as usize, libc::MADV_PAGEOUT) };
    }
}

impl crate::hooks::MemoryFaultHook for WaitForPager {
    fn wait_for_memory(&self) -> bool {
        for i in 1..=100 {
            if self.usage().is_some_and(|u| u < self.high) {
                return true;
            }
            if i % 10 == 0 {
                self.page_out_one();
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn phases_record_deltas_and_refuse_numbers_out_of_range() {
        let stats = StatsRegistry::new();
        let p = Phases {
            host: Arc::new(HostCounters::start()),
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
}
