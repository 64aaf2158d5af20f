//! SymSpy, Lucid's half: what Lucid publishes in the lines it owns (global `L_*`: features,
//! host memory pressure, IOMMU mode, lowest ladder rung, SymCalls; per-vCPU `W_*`: rung,
//! run-queue wait, SymCalls), and the reader that decodes the guest's lines for the control
//! API and the tests. Both go through `SpyPage`'s atomic accessors under the records' sequence
//! counts: neither costs the guest an exit.
//!
//! Lucid publishes when a page registers (on the vCPU thread, inside the hypercall) and then
//! every [`PERIOD`] from `lucid-symspy`, a thread that is not started with `--low-noise`. Every
//! file it reads (`/proc/meminfo`, the memory cgroup's usage, each vCPU thread's `schedstat`)
//! is opened before the reading thread confines itself, so both run under seccomp with `pread`
//! only.

use std::fs::File;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use lucid_devices::Lifecycle;
use lucid_seccomp::Role;
use lucid_stats::{Counter, StatsRegistry, ThreadRole};
use lucid_swap::balloon_manager::PressureSource;
use lucid_sym::abi::page;
use lucid_sym::SpyPage;

use super::{Symbiotic, FEATURES};

/// How often `lucid-symspy` republishes Lucid's lines.
pub const PERIOD: Duration = Duration::from_millis(100);
/// Tries a read of a guest record gets before it is given up (each torn read is counted).
pub const READ_TRIES: u32 = 10_000;

/// What Lucid publishes that does not change while the VM runs, and where it reads host memory
/// pressure (part of [`super::SymParts`]).
pub struct PublishSources {
    /// The VM's memory cgroup (`--memory-limit`); without one, `/proc/meminfo`.
    pub pressure: Option<Arc<dyn PressureSource>>,
    /// `page::IOMMU_*`.
    pub iommu_mode: u32,
    /// Lowest exit-ladder rung among the VM's devices (0-4), `page::RUNG_NONE` without any.
    pub rung: u32,
}

impl Default for PublishSources {
    fn default() -> Self {
        PublishSources {
            pressure: None,
            iommu_mode: page::IOMMU_NONE,
            rung: page::RUNG_NONE,
        }
    }
}

/// Host memory as Lucid publishes it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct HostMemory {
    /// Used memory against what the VM may use, per mille.
    pub pressure_permille: u64,
    /// Memory still available to the VM, KiB.
    pub available_kib: u64,
}

/// The publisher's state inside [`Symbiotic`].
pub(super) struct Publisher {
    /// `/proc/meminfo`, opened when the VM is built.
    meminfo: Option<File>,
    sources: PublishSources,
    /// Each vCPU thread's `schedstat`, opened by that thread before it confined itself.
    schedstat: Mutex<Vec<Option<File>>>,
    symcalls: Arc<Counter>,
    publishes: Arc<Counter>,
    reads: Arc<Counter>,
    torn_reads: Arc<Counter>,
    /// `lucid-symspy`, while it runs.
    thread: Mutex<Option<lucid_thread::Background>>,
}

impl Publisher {
    pub(super) fn new(vcpus: u32, sources: PublishSources, stats: &StatsRegistry) -> Self {
        let meminfo = File::open("/proc/meminfo")
            .map_err(|e| log::warn!("sym: cannot open /proc/meminfo ({e}): no host pressure"))
            .ok();
        Publisher {
            meminfo,
            sources,
            schedstat: Mutex::new((0..vcpus).map(|_| None).collect()),
            symcalls: stats.counter("sym.call.completed"),
            publishes: stats.counter("sym.spy.publishes"),
            reads: stats.counter("sym.spy.reads"),
            torn_reads: stats.counter("sym.spy.torn_reads"),
            thread: Mutex::new(None),
        }
    }

    fn host_memory(&self) -> HostMemory {
        if let Some(p) = &self.sources.pressure {
            let p = p.pressure();
            if let Some(permille) = (p.usage.min(p.limit) * 1000).checked_div(p.limit) {
                return HostMemory {
                    pressure_permille: permille,
                    available_kib: p.limit.saturating_sub(p.usage) >> 10,
                };
            }
        }
        let Some(text) = self
            .meminfo
            .as_ref()
            .and_then(|f| lucid_swap::limit::pread_to_string(f).ok())
        else {
            return HostMemory::default();
        };
        meminfo_pressure(&text).unwrap_or_default()
    }

    fn runq_wait_ns(&self, vcpu: u32) -> u64 {
        let files = self.schedstat.lock().unwrap_or_else(|e| e.into_inner());
        files
            .get(vcpu as usize)
            .and_then(Option::as_ref)
            .and_then(|f| lucid_swap::limit::pread_to_string(f).ok())
            .and_then(|s| schedstat_wait_ns(&s))
            .unwrap_or(0)
    }
}

/// `/proc/meminfo` text: used (MemTotal - MemAvailable) per mille of MemTotal, and MemAvailable.
fn meminfo_pressure(text: &str) -> Option<HostMemory> {
    let kib = |key: &str| -> Option<u64> {
        let line = text.lines().find(|l| l.starts_with(key))?;
        line[key.len()..].split_whitespace().next()?.parse().ok()
    };
    let total = kib("MemTotal:").filter(|&t| t > 0)?;
    let available = kib("MemAvailable:")?.min(total);
    Some(HostMemory {
        pressure_permille: (total - available) * 1000 / total,
        available_kib: available,
    })
}

/// `schedstat`: "time on CPU ns, time waiting on a run queue ns, timeslices".
fn schedstat_wait_ns(text: &str) -> Option<u64> {
    text.split_whitespace().nth(1)?.parse().ok()
}

impl Symbiotic {
    /// Called on vCPU `vcpu`'s thread before it confines itself: opens its `schedstat`, which
    /// the publisher reads with `pread` from then on.
    pub(crate) fn attach_vcpu_thread(&self, vcpu: u32) {
        match File::open("/proc/thread-self/schedstat") {
            Ok(f) => {
                let mut files = self
                    .publisher
                    .schedstat
                    .lock()
                    .unwrap_or_else(|e| e.into_inner());
                if let Some(slot) = files.get_mut(vcpu as usize) {
                    *slot = Some(f);
                }
            }
            Err(e) => log::debug!("sym: vCPU {vcpu}: no schedstat ({e}): run-queue wait reads 0"),
        }
    }

    /// Host memory as Lucid publishes it now.
    pub fn host_memory(&self) -> HostMemory {
        self.publisher.host_memory()
    }

    /// Writes Lucid's global line of `p` under its sequence count. The caller holds the
    /// registrations' lock, which makes it the only writer.
    pub(super) fn publish_global(&self, p: &SpyPage) {
        let mem = self.publisher.host_memory();
        let (iommu, rung) = (
            self.publisher.sources.iommu_mode,
            self.publisher.sources.rung,
        );
        let symcalls = self.publisher.symcalls.get();
        p.write_record(page::L_SEQ, |p| {
            p.store_u32(page::L_FEATURES, FEATURES as u32);
            p.store_u64(page::L_MEM_PRESSURE, mem.pressure_permille);
            p.store_u64(page::L_MEM_AVAILABLE_KIB, mem.available_kib);
            p.store_u32(page::L_IOMMU_MODE, iommu);
            p.store_u32(page::L_RUNG, rung);
            p.store_u64(page::L_SYMCALLS, symcalls);
            p.store_u64(
                page::L_PUBLISHES,
                p.load_u64(page::L_PUBLISHES).wrapping_add(1),
            );
        });
        self.publisher.publishes.inc();
    }

    /// Writes Lucid's line of vCPU `vcpu`'s page `p` (the caller holds the registrations' lock).
    pub(super) fn publish_vcpu(&self, vcpu: u32, p: &SpyPage) {
        let rung = self.publisher.sources.rung;
        let wait = self.publisher.runq_wait_ns(vcpu);
        let symcalls = self.symcalls_on(vcpu);
        p.write_record(page::W_SEQ, |p| {
            p.store_u32(page::W_RUNG, rung);
            p.store_u64(page::W_RUNQ_WAIT_NS, wait);
            p.store_u64(page::W_SYMCALLS, symcalls);
            p.store_u64(
                page::W_PUBLISHES,
                p.load_u64(page::W_PUBLISHES).wrapping_add(1),
            );
        });
        self.publisher.publishes.inc();
    }

    /// Republishes Lucid's lines in every registered page.
    pub fn publish(&self) {
        let spy = self.spy();
        if let Some(g) = spy.global() {
            self.publish_global(g);
        }
        for n in 0..self.vcpu_count {
            if let Some(p) = spy.vcpu(n) {
                self.publish_vcpu(n, p);
            }
        }
    }

    /// Starts `lucid-symspy`, which republishes every [`PERIOD`] until the VM stops (not with
    /// `--low-noise`: Lucid then publishes only when a page registers). It confines itself to
    /// the pager's role, the smallest that fits: the base list plus `pread64`.
    pub fn start_publisher(
        self: &Arc<Self>,
        lifecycle: Arc<Lifecycle>,
        spawner: &lucid_thread::Spawner,
    ) -> Result<(), lucid_thread::SpawnError> {
        let sym = self.clone();
        let spec = lucid_thread::ThreadSpec::new("lucid-symspy", ThreadRole::Other, Role::Pager);
        let t = spawner.spawn_background(spec, move |confined, stop| {
            if let Err(e) = confined {
                log::error!("lucid-symspy: {e}: Lucid's SymSpy lines are not republished");
                return;
            }
            loop {
                std::thread::park_timeout(PERIOD);
                if stop.load(Ordering::Acquire) || lifecycle.is_stopping() {
                    break;
                }
                sym.publish();
            }
        })?;
        *self
            .publisher
            .thread
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = Some(t);
        Ok(())
    }

    /// Stops and joins `lucid-symspy` (no-op when it is not running).
    pub fn stop_publisher(&self) {
        let t = self
            .publisher
            .thread
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(mut t) = t {
            t.stop();
        }
    }

    /// Reads one guest record, counting its torn reads.
    fn read_line<T>(
        &self,
        snap: &mut SpySnapshot,
        p: &SpyPage,
        seq: u64,
        f: impl FnMut(&SpyPage) -> T,
    ) -> Option<T> {
        self.publisher.reads.inc();
        let (v, torn) = p.read_record_counted(seq, READ_TRIES, f);
        snap.torn_reads += u64::from(torn);
        self.publisher.torn_reads.add(u64::from(torn));
        if v.is_none() {
            snap.unread += 1;
        }
        v
    }

    /// Decodes the guest's SymSpy records (and Lucid's own lines) as they are now, without an
    /// exit: each guest record is read under its sequence count, retried while torn (counted
    /// in `sym.spy.torn_reads`) up to [`READ_TRIES`] times, then reported unread, never waited
    /// for.
    pub fn spy_snapshot(&self) -> SpySnapshot {
        let spy = self.spy();
        let mut snap = SpySnapshot {
            changes: spy.changes(),
            ..Default::default()
        };
        let global = spy.global().map(|p| {
            let guest = self.read_line(&mut snap, p, page::G_SEQ, |p| GuestGlobal {
                phase: p.load_u32(page::G_PHASE),
                symcall_entry: p.load_u64(page::G_SYMCALL_ENTRY),
                symcall_cs: p.load_u32(page::G_SYMCALL_CS),
                symcall_ss: p.load_u32(page::G_SYMCALL_SS),
                symcall_flags: p.load_u64(page::G_SYMCALL_FLAGS),
                exports: p.load_u64(page::G_EXPORTS),
                swap_map: p.load_u64(page::G_SWAP_MAP),
                swap_map_len: p.load_u32(page::G_SWAP_MAP_LEN),
                swap_device: p.load_u32(page::G_SWAP_DEVICE),
            });
            GlobalRecord {
                gpa: p.gpa(),
                generation: p.load_u64(page::H_GENERATION),
                guest,
                // Lucid's own line: it is the only writer and holds the lock, so never torn.
                lucid: LucidGlobal {
                    features: p.load_u32(page::L_FEATURES),
                    mem_pressure_permille: p.load_u64(page::L_MEM_PRESSURE),
                    mem_available_kib: p.load_u64(page::L_MEM_AVAILABLE_KIB),
                    iommu_mode: p.load_u32(page::L_IOMMU_MODE),
                    rung: p.load_u32(page::L_RUNG),
                    symcalls: p.load_u64(page::L_SYMCALLS),
                    publishes: p.load_u64(page::L_PUBLISHES),
                },
            }
        });
        let mut vcpus = Vec::new();
        for n in 0..self.vcpu_count {
            let Some(p) = spy.vcpu(n) else { continue };
            let guest = self.read_line(&mut snap, p, page::V_SEQ, |p| GuestVcpu {
                task: p.load_u32(page::V_TASK),
                counter: p.load_u64(page::V_COUNTER),
                if_enabled: p.load_u64(page::V_IF) != 0,
                symcall_stack: p.load_u64(page::V_SYMCALL_STACK),
                in_symcall: p.load_u64(page::V_IN_SYMCALL) != 0,
            });
            vcpus.push(VcpuRecord {
                vcpu: n,
                gpa: p.gpa(),
                generation: p.load_u64(page::H_GENERATION),
                guest,
                lucid: LucidVcpu {
                    rung: p.load_u32(page::W_RUNG),
                    runq_wait_ns: p.load_u64(page::W_RUNQ_WAIT_NS),
                    symcalls: p.load_u64(page::W_SYMCALLS),
                    publishes: p.load_u64(page::W_PUBLISHES),
                },
            });
        }
        snap.global = global;
        snap.vcpus = vcpus;
        snap
    }
}

/// The SymSpy records as [`Symbiotic::spy_snapshot`] read them.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct SpySnapshot {
    /// The global page, when registered.
    pub global: Option<GlobalRecord>,
    /// The registered per-vCPU pages, by vCPU.
    pub vcpus: Vec<VcpuRecord>,
    /// Registrations accepted (and cleared) so far: a change means the pages moved.
    pub changes: u64,
    /// Torn reads retried while taking this snapshot.
    pub torn_reads: u64,
    /// Guest records still torn after [`READ_TRIES`] tries (their `guest` is `None`).
    pub unread: u64,
}

#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct GlobalRecord {
    pub gpa: u64,
    pub generation: u64,
    /// The guest's line; `None` when it stayed torn through the retries.
    pub guest: Option<GuestGlobal>,
    pub lucid: LucidGlobal,
}

#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct GuestGlobal {
    pub phase: u32,
    pub symcall_entry: u64,
    pub symcall_cs: u32,
    pub symcall_ss: u32,
    pub symcall_flags: u64,
    pub exports: u64,
    pub swap_map: u64,
    pub swap_map_len: u32,
    pub swap_device: u32,
}

#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct LucidGlobal {
    pub features: u32,
    pub mem_pressure_permille: u64,
    pub mem_available_kib: u64,
    pub iommu_mode: u32,
    pub rung: u32,
    pub symcalls: u64,
    pub publishes: u64,
}

#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct VcpuRecord {
    pub vcpu: u32,
    pub gpa: u64,
    pub generation: u64,
    pub guest: Option<GuestVcpu>,
    pub lucid: LucidVcpu,
}

#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct GuestVcpu {
    pub task: u32,
    pub counter: u64,
    pub if_enabled: bool,
    pub symcall_stack: u64,
    pub in_symcall: bool,
}

#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct LucidVcpu {
    pub rung: u32,
    pub runq_wait_ns: u64,
    pub symcalls: u64,
    pub publishes: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn meminfo_and_schedstat_parse() {
        let m = "MemTotal:       1000 kB\nMemFree:         100 kB\nMemAvailable:    250 kB\n";
        assert_eq!(
            meminfo_pressure(m),
            Some(HostMemory {
                pressure_permille: 750,
                available_kib: 250
            })
        );
        assert_eq!(
            meminfo_pressure("MemTotal: 0 kB\nMemAvailable: 0 kB\n"),
            None
        );
        assert_eq!(meminfo_pressure("garbage"), None);
        assert_eq!(schedstat_wait_ns("123 456 7\n"), Some(456));
        assert_eq!(schedstat_wait_ns("123"), None);
    }

    #[test]
    fn guest_written_publish_counts_wrap_instead_of_panicking() {
        use lucid_mem::vm_memory::GuestAddress;
        use lucid_sym::abi;
        let mem = lucid_mem::GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap();
        let stats = lucid_stats::StatsRegistry::new();
        let sym = super::super::tests_support::sym(&mem, 1, &stats);
        for (gpa, kind, line) in [
            (0x1000, abi::REGISTER_GLOBAL, page::L_PUBLISHES),
            (0x2000, abi::REGISTER_VCPU, page::W_PUBLISHES),
        ] {
            let p = SpyPage::new(&mem, gpa).unwrap();
            p.store_u32(page::H_MAGIC, page::MAGIC);
            p.store_u32(page::H_VERSION, abi::VERSION as u32 | (kind as u32) << 16);
            p.store_u32(page::H_VCPU, 0);
            // The guest owns the memory of Lucid's lines too.
            p.store_u64(line, u64::MAX);
            assert_eq!(sym.register(0, kind, gpa), 0);
            assert_eq!(p.load_u64(line), 0);
        }
    }

    #[test]
    fn this_hosts_meminfo_reads() {
        let f = File::open("/proc/meminfo").unwrap();
        let m = meminfo_pressure(&lucid_swap::limit::pread_to_string(&f).unwrap()).unwrap();
        assert!(m.pressure_permille <= 1000 && m.available_kib > 0);
    }
}
