//! Builds and runs one VM. [`Vm::build`] reads top to bottom as the VM comes together, through
//! the stages of [`VmBuilder`]: KVM and memory, the interrupt controllers, the devices and their
//! exit hooks, the kernel and its boot tables, then the vCPUs; [`Vm::start`] starts the vCPU
//! threads and [`Vm::wait`] reports.

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

use lucid_boot::layout::{self, ports};
use lucid_boot::{AcpiConfig, KernelImage, KernelKind};
use lucid_devices::{
    BusDevice, Cmos, ConsoleOut, DebugExit, Lifecycle, NopPort, Serial, StopReason, I8042,
};
use lucid_hv::kvm_bindings::kvm_regs;
use lucid_hv::{Backend, IoAddr};
use lucid_mem::{DmaPath, GuestRam};
use lucid_seccomp::{Role, Seccomp};
use lucid_stats::StatsRegistry;
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::builder::{KernelLoad, VmBuilder};
use crate::config::{ConfigError, KernelSource, PlatformPciDevice, VmConfig};
use crate::emulate::Emulator;
use crate::hooks::ExitHooks;
use crate::report::RunReport;
use crate::vcpu::{VcpuCtx, VcpuHandle};

/// Lucid's hypercall numbers (shared with the probe-guest kit's `lucid.h`).
pub mod hypercall {
    pub const DISCOVER: u64 = 0;
    pub const TSC_KHZ: u64 = 1;
    pub const BACKEND: u64 = 2;
    /// rdi = one of the `REPORT_*` keys, rsi = its value: the guest's own figures (its vIOMMU
    /// mappings), kept as counters `iommu.guest.<key name>`; returns 0.
    pub const REPORT: u64 = 3;
    /// rdi = `WORK_ITERATIONS` or `WORK_BYTES`, rsi = amount done since the last call: the
    /// guest's progress, added to `guest.work.iterations` / `guest.work.bytes`; returns 0.
    pub const WORK: u64 = 5;
    pub const WORK_ITERATIONS: u64 = 0;
    pub const WORK_BYTES: u64 = 1;
    /// rdi = phase number (below `swap::MAX_PHASES`): the guest starts phase rdi; the host swap
    /// counters' deltas over each phase are kept as `swap.phase.<n>.*`; returns 0 (all ones for
    /// a phase number out of range).
    pub const PHASE: u64 = 4;
    /// What DISCOVER returns: "LUCI".
    pub const MAGIC: u64 = 0x4C55_4349;

    /// REPORT keys (`LUCID_REPORT_*` in lucid.h).
    pub const REPORT_MAPS: u64 = 0;
    pub const REPORT_UNMAPS: u64 = 1;
    /// rdtsc cycles spent in map, summed.
    pub const REPORT_MAP_CYCLES: u64 = 2;
    pub const REPORT_UNMAP_CYCLES: u64 = 3;
    /// Maps served by an existing mapping.
    pub const REPORT_REUSE_HITS: u64 = 4;
    /// The most mappings logically unmapped but still reachable.
    pub const REPORT_STALE_MAX: u64 = 5;
    /// The longest time from a logical unmap to its invalidation's completion.
    pub const REPORT_WINDOW_MAX_US: u64 = 6;
    /// VT-d fault records the guest read.
    pub const REPORT_FAULTS_SEEN: u64 = 7;

    /// The counter name (after `iommu.guest.`) of REPORT key `key`.
    pub fn report_key(key: u64) -> Option<&'static str> {
        const NAMES: [&str; 8] = [
            "maps",
            "unmaps",
            "map_cycles",
            "unmap_cycles",
            "reuse_hits",
            "stale_max",
            "window_max_us",
            "faults_seen",
        ];
        NAMES.get(usize::try_from(key).ok()?).copied()
    }
}

/// Kernel command-line switches that keep Linux off the instructions KVM's emulator lacks on a
/// host that emulates guest kernel code (PLATFORM.md): CX16, XSAVE and AVX (141, 154, 156), and
/// SSSE3 (137), whose absence sends the kernel's SIMD code (the BLAKE2s self-test at boot) to
/// plain C that KVM emulates without an exit per instruction (docs/linux.md, run C).
pub const PVM_LINUX_CMDLINE: &str = "noxsave clearcpuid=137,141,154,156";
/// The console line Linux gets when the user gives none.
pub const DEFAULT_LINUX_CMDLINE: &str = "console=ttyS0 earlyprintk=serial reboot=k panic=-1";

/// What failed while building or starting a VM, and with what.
#[derive(Debug, thiserror::Error)]
pub enum VmmError {
    #[error(transparent)]
    Hv(#[from] lucid_hv::HvError),
    #[error(transparent)]
    Mem(#[from] lucid_mem::MemError),
    #[error(transparent)]
    Boot(#[from] lucid_boot::BootError),
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("cannot open the serial console --serial {output}")]
    Serial {
        output: lucid_devices::SerialOutput,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot create the eventfd of {what}")]
    EventFd {
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
    /// A platform device's range clashes with another.
    #[error("cannot place a platform device")]
    Bus(#[from] lucid_devices::BusError),
    #[error("cannot set up the PCI root complex")]
    PciRoot(#[source] lucid_pci::PciError),
    #[error("{device}: cannot open its back-end")]
    Block {
        device: String,
        #[source]
        source: lucid_virtio::blk::BlockError,
    },
    #[error("{device}: cannot open its back-end")]
    Net {
        device: String,
        #[source]
        source: lucid_virtio::net::NetError,
    },
    #[error("cannot create the virtio-balloon")]
    Balloon(#[source] lucid_virtio::balloon::BalloonError),
    #[error("cannot start the balloon manager's thread")]
    BalloonManager(#[source] std::io::Error),
    #[error("{device}: cannot attach it to PCI")]
    PciAttach {
        device: String,
        #[source]
        source: lucid_pci::PciError,
    },
    #[error("cannot start the thread of vCPU {vcpu}")]
    Thread {
        vcpu: u32,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Seccomp(#[from] lucid_seccomp::SeccompError),
    #[error(transparent)]
    Pools(#[from] crate::pools::PoolsError),
    #[error(transparent)]
    Swap(#[from] crate::swap::SwapError),
    #[error(transparent)]
    Api(#[from] crate::api::ApiError),
    #[error("cannot start the vIOMMU's sidecore thread")]
    IommuThread {
        #[source]
        source: std::io::Error,
    },
}

/// A built VM.
pub struct Vm {
    config: VmConfig,
    kind: KernelKind,
    vm: lucid_hv::Vm,
    ram: Arc<GuestRam>,
    dma: Arc<DmaPath>,
    hooks: Arc<ExitHooks>,
    lifecycle: Arc<Lifecycle>,
    stats: Arc<StatsRegistry>,
    handles: Vec<Arc<VcpuHandle>>,
    ctxs: Vec<VcpuCtx>,
    threads: Vec<JoinHandle<()>>,
    started: Option<Instant>,
    backend: Backend,
    /// Kept open: the irqfd and ioeventfd registrations refer to them.
    _eventfds: Vec<EventFd>,
    pci: Option<PciBus>,
    /// The serial console's output, flushed before the run is reported.
    console: Arc<ConsoleOut>,
    /// Set when the VM's threads confine themselves (`MachineConfig::seccomp`).
    seccomp: Option<Seccomp>,
    /// The vIOMMU (`VmConfig::iommu`).
    iommu: Option<crate::iommu::Iommu>,
    /// The GSI router, when the VM has PCI devices or a vIOMMU.
    router: Option<Arc<lucid_hv::GsiRouter>>,
    /// The VM's place in the host's CPU pools (`PoolsConfig::pool`), when it has one.
    pools: Option<crate::pools::Pools>,
    /// Where the balloon manager reads host pressure (`--balloon ...,manager=on`).
    pressure: Option<Arc<dyn lucid_swap::balloon_manager::PressureSource>>,
    balloon_manager: Option<lucid_swap::balloon_manager::BalloonManager>,
    /// The memory limit, the Swap Mapper and the host swap counters (swap.rs).
    swap: crate::swap::VmSwap,
    /// The symbiotic interfaces (`SymbioticConfig::enabled`).
    sym: Option<Arc<crate::sym::Symbiotic>>,
    /// The control API's socket, bound while the VM was built (`ApiConfig::socket`), until
    /// [`Vm::start`] gives it to its thread.
    api_socket: Option<crate::api::ApiSocket>,
    api: Option<crate::api::ApiServer>,
}

/// The VM's PCI bus and its devices.
pub struct PciBus {
    pub root: Arc<lucid_pci::PciRoot>,
    pub router: Arc<lucid_hv::GsiRouter>,
    /// (name, address, transport) of the virtio devices, in attach order.
    pub devices: Vec<(
        String,
        lucid_pci::PciAddress,
        Arc<Mutex<lucid_pci::VirtioPciDevice>>,
    )>,
    /// The other devices, in the slots after the virtio ones.
    pub platform: Vec<PlatformFunction>,
    /// The virtio-balloon's control (`DevicesConfig::balloon`).
    pub balloon: Option<lucid_virtio::balloon::BalloonControl>,
}

/// (name, address, function) of a PCI device that is not virtio.
pub type PlatformFunction = (
    String,
    lucid_pci::PciAddress,
    Arc<Mutex<dyn lucid_pci::PciDevice>>,
);

impl Vm {
    /// Builds the VM `config` describes, stage by stage ([`VmBuilder`]), ready to [`Vm::start`].
    pub fn build(config: VmConfig) -> Result<Self, VmmError> {
        config.validate()?;
        let stats = StatsRegistry::new();
        let seccomp = match config.machine.seccomp {
            true => Some(Seccomp::prepare(&stats)?),
            false => None,
        };
        let lifecycle = Arc::new(Lifecycle::new());
        if config.pools.low_noise {
            // Before any thread starts: they all inherit the non-vCPU CPUs.
            crate::pools::low_noise(config.machine.vcpus, &stats)?;
            for p in crate::pools::low_noise_pollers(&config) {
                log::warn!("--low-noise: {p}");
            }
        }
        if config.machine.handle_signals {
            // Before any thread starts, so that every thread inherits the blocked mask.
            watch_stop_signals(lifecycle.clone(), seccomp.clone());
        }
        let hooks = ExitHooks::new();

        // The memory limit before guest RAM exists, so that every guest page is charged to it;
        // then KVM and guest memory, and the swap side that shares it.
        let limit = crate::swap::VmSwap::limit(&config)?;
        let mut b = VmBuilder::new(config.machine.mem_mib << 20, config.machine.backing.clone())?;
        let dma = DmaPath::new(b.memory().clone(), &stats);
        let swap = crate::swap::VmSwap::build(&config, limit, b.ram(), &stats, &hooks)?;
        if let Some(o) = swap.dma_observer() {
            dma.add_observer(o);
        }

        // Interrupt controllers and timers, in the kernel.
        b.irqchip()?;
        if let Some(s) = b.vm().stats() {
            stats.probe("kvm.vm", Box::new(move || s.read()));
        }

        // MSI routes, and the vIOMMU before any device: transports ask the DMA path whether
        // addresses are translated when they are built.
        let has_pci = !config.devices.pci.is_empty()
            || !config.devices.platform_pci.is_empty()
            || config.devices.balloon.is_some();
        let router =
            (has_pci || config.iommu.is_some()).then(|| lucid_hv::GsiRouter::new(b.vm().clone()));
        let iommu = match (config.iommu, &router) {
            (Some(cfg), Some(router)) => Some(crate::iommu::Iommu::build(
                cfg,
                b.vm(),
                b.memory(),
                &dma,
                router,
                &hooks,
                &stats,
                &seccomp,
            )?),
            _ => None,
        };

        // Devices: the platform's, then PCI (only when there are PCI devices): virtio devices,
        // then the others (`--device`).
        let platform = platform_devices(&config, b.vm(), &hooks, &lifecycle, &stats, &seccomp)?;
        // SwapBypass's swap cache (`--blk ...,swapcache=MiB`), on the disk that asks for it.
        let swapcache = config
            .devices
            .pci
            .iter()
            .enumerate()
            .find(|(_, d)| d.swapcache_mib > 0)
            .map(|(i, d)| {
                crate::sym::SwapCacheDevice::new(
                    d.swapcache_mib,
                    i as u32 + 1,
                    d.swapcache_spy_first,
                    &stats,
                )
            });
        let pci = match (&router, has_pci) {
            (Some(router), true) => Some(attach_pci(
                &config,
                &b,
                router,
                &dma,
                &hooks,
                &stats,
                &swap,
                swapcache.as_ref(),
            )?),
            _ => None,
        };
        let tsc_khz = add_hypercalls(&hooks, b.backend());
        crate::iommu::add_report_hypercall(&hooks, &stats);
        crate::pools::add_work_hypercall(&hooks, &stats);
        let sym = config.symbiotic.enabled.then(|| {
            let sym = crate::sym::Symbiotic::install(
                &hooks,
                b.memory(),
                config.machine.vcpus.into(),
                &stats,
            );
            sym.set_sources(sym_sources(&config, &swap));
            sym
        });
        if let Some(sym) = &sym {
            sym.set_hv(b.vm().clone());
        }
        if let (Some(c), Some(s)) = (&swapcache, &sym) {
            c.set_sym(s);
        }
        // Bound now, so that a path in use fails the build, not a running VM.
        let api_socket = config
            .api
            .socket
            .as_deref()
            .map(crate::api::ApiSocket::bind)
            .transpose()?;

        // The kernel, its command line and the boot tables.
        let image = match &config.payload.kernel {
            KernelSource::File(p) => KernelImage::open(p)?,
            KernelSource::Builtin { name, bytes } => {
                KernelImage::from_bytes(Path::new(&format!("<built-in {name}>")), bytes.to_vec())?
            }
        };
        let mut cmdline = kernel_cmdline(&config.payload.cmdline, image.is_linux(), b.backend());
        if iommu.is_some() && image.is_linux() {
            cmdline = crate::iommu::linux_cmdline(cmdline);
        }
        log::debug!("kernel command line: {cmdline:?}");
        let mut acpi = AcpiConfig::new(config.machine.vcpus);
        if pci.is_some() {
            let last_bus = ((layout::PCI_ECAM_SIZE >> 20) - 1).min(255) as u8;
            acpi.pci_ecam = Some((layout::PCI_ECAM_START, 0, last_bus));
        }
        if iommu.is_some() {
            acpi.dmar = Some(lucid_boot::DmarUnit {
                base: lucid_iommu::VTD_BASE,
                pages: (lucid_iommu::VTD_SIZE >> 12) as u32,
            });
        }
        let setup = b.load_kernel(&KernelLoad {
            image: &image,
            initrd: config.payload.initrd.as_deref(),
            cmdline: &cmdline,
            acpi: Some(&acpi),
        })?;

        // vCPUs: boot registers on vCPU 0; the others wait for INIT/SIPI.
        // PV EOI in CPUID is the ladder's call (L2 only).
        let offer_pv_eoi =
            lucid_pci::ladder::vm_offers_pv_eoi(config.devices.pci.iter().map(|d| d.rung));
        let mut ctxs = Vec::new();
        let mut handles = Vec::new();
        for id in 0..config.machine.vcpus {
            let boot = (id == 0).then_some(&setup);
            let vcpu = b.vcpu(id, config.machine.vcpus, boot, |cpuid| {
                edit_vcpu_cpuid(cpuid, offer_pv_eoi, config.symbiotic.enabled)
            })?;
            if id == 0 {
                tsc_khz.store(vcpu.tsc_khz().unwrap_or(0).into(), Ordering::Relaxed);
            }
            if let Some(s) = vcpu.stats() {
                stats.probe(format!("kvm.vcpu{id}"), Box::new(move || s.read()));
            }
            let emulator = Emulator::with_memory(id.into(), b.memory().clone(), stats.clone());
            let (ctx, handle) =
                VcpuCtx::new(vcpu, hooks.clone(), lifecycle.clone(), &stats, emulator);
            let h = handle.clone();
            lifecycle.add_kicker(Box::new(move || h.kick()));
            ctxs.push(ctx);
            handles.push(handle);
        }

        // The pools, once the KVM VM exists (halt polling) and before any vCPU or back-end
        // thread starts (they place themselves as they register).
        let pools = match config.pools.low_noise {
            true => None,
            false => crate::pools::Pools::join(
                &config.pools.pool,
                crate::pools::JoinArgs {
                    tuning: config.pools.monitor,
                    vm: b.vm(),
                    stats: &stats,
                    vm_name: &vm_name(&config.payload.kernel),
                    seccomp: config.machine.seccomp,
                    backends: config.devices.pci.len()
                        + usize::from(config.devices.balloon.is_some()),
                },
            )?,
        };

        if let Some(sym) = &sym {
            sym.set_vcpus(handles.clone());
        }
        let backend = b.backend();
        let (vm, ram) = b.finish();
        Ok(Vm {
            config,
            kind: image.kind(),
            vm,
            ram,
            dma,
            hooks,
            lifecycle,
            stats,
            handles,
            ctxs,
            threads: Vec::new(),
            started: None,
            backend,
            _eventfds: platform.eventfds,
            pci,
            console: platform.console,
            seccomp,
            iommu,
            router,
            pools,
            pressure: None,
            balloon_manager: None,
            swap,
            sym,
            api_socket,
            api: None,
        })
    }

    /// Starts one named thread per vCPU.
    pub fn start(&mut self) -> Result<(), VmmError> {
        install_kick_handler();
        // The pager before the vCPUs: guest RAM must stay under the limit from their first
        // fault.
        self.swap
            .start_pager(&self.ram, &self.hooks, &self.stats, self.seccomp.clone())?;
        self.started = Some(Instant::now());
        for ctx in self.ctxs.drain(..) {
            let vcpu = ctx.id();
            let (seccomp, lifecycle) = (self.seccomp.clone(), self.lifecycle.clone());
            let threads = self.stats.threads().clone();
            let sym = self.sym.clone();
            let t = std::thread::Builder::new()
                .name(format!("lucid-vcpu{vcpu}"))
                .spawn(move || {
                    let _registered = threads.register_current(lucid_stats::ThreadRole::Vcpu(vcpu));
                    if let Some(sym) = sym {
                        sym.attach_vcpu_thread(vcpu);
                    }
                    match lucid_seccomp::confine(seccomp.as_ref(), Role::Vcpu) {
                        Ok(()) => ctx.run(),
                        Err(e) => lifecycle.stop(StopReason::error(e)),
                    }
                })
                .map_err(|source| VmmError::Thread { vcpu, source })?;
            self.threads.push(t);
        }
        if let Some(pools) = &mut self.pools {
            pools.start_monitor(&self.seccomp)?;
        }
        if let Some(sym) = self.sym.as_ref().filter(|_| !self.config.pools.low_noise) {
            sym.start_publisher(
                self.lifecycle.clone(),
                self.seccomp.clone(),
                self.stats.threads().clone(),
            )
            .map_err(|source| VmmError::Thread { vcpu: 0, source })?;
        }
        self.start_balloon_manager()?;
        if let Some(sock) = self.api_socket.take() {
            let ctx = crate::api::ApiContext {
                sym: self.sym.clone(),
                stats: self.stats.clone(),
                lifecycle: self.lifecycle.clone(),
                vcpus: self.config.machine.vcpus.into(),
                builtin_modules: self.config.runtime.builtin_modules,
            };
            self.api = Some(crate::api::ApiServer::spawn(
                sock,
                ctx,
                self.seccomp.clone(),
            )?);
        }
        Ok(())
    }

    /// Sets where the balloon manager reads host pressure (before [`Vm::start`]; the VM's
    /// memory cgroup once it has one); by default it is the VM's memory cgroup under
    /// `--memory-limit`, else this process's resident set against what the host has available
    /// ([`crate::balloon::ProcessPressure`]).
    pub fn set_pressure_source(
        &mut self,
        source: Arc<dyn lucid_swap::balloon_manager::PressureSource>,
    ) {
        self.pressure = Some(source);
    }

    /// `--balloon ...,manager=on`: starts `lucid-balloonm`, confined as a back-end (it raises
    /// the balloon's configuration interrupt; it reads its pressure from files opened here).
    fn start_balloon_manager(&mut self) -> Result<(), VmmError> {
        use lucid_swap::balloon_manager::{BalloonManager, SizingPolicy};
        let manage = self
            .config
            .devices
            .balloon
            .as_ref()
            .is_some_and(|b| b.manager);
        let Some(ctl) = self.balloon().cloned().filter(|_| manage) else {
            return Ok(());
        };
        let source = match self.pressure.take().or_else(|| self.swap.pressure()) {
            Some(s) => s,
            None => Arc::new(
                crate::balloon::ProcessPressure::open(None).map_err(VmmError::BalloonManager)?,
            ),
        };
        let seccomp = self.seccomp.clone();
        let m = BalloonManager::spawn(
            ctl,
            source,
            SizingPolicy::default(),
            std::time::Duration::from_millis(200),
            &self.stats,
            Box::new(move || {
                lucid_seccomp::confine(seccomp.as_ref(), Role::Backend).map_err(|e| e.to_string())
            }),
        )
        .map_err(VmmError::BalloonManager)?;
        self.balloon_manager = Some(m);
        Ok(())
    }

    /// Confines the calling thread to the main thread's seccomp role when the VM's threads are
    /// confined: from then on it may wait, report and tear the VM down, not open files or
    /// start processes. For the thread that started the VM and will only wait for it (the
    /// CLI's main thread), once everything it will write to is open.
    pub fn confine_caller(&self) -> Result<(), VmmError> {
        Ok(lucid_seccomp::confine(self.seccomp.as_ref(), Role::Main)?)
    }

    /// Waits until the VM stops, joins the vCPU threads and reports.
    pub fn wait(mut self) -> RunReport {
        let stop = self.lifecycle.wait();
        // No new requests; one in progress ends when its vCPU stops (joined below).
        if let Some(api) = &self.api {
            api.signal_stop();
        }
        // The monitor's last window, while the vCPU threads are still listed.
        if let Some(pools) = &mut self.pools {
            pools.stop();
        }
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        // A guest reset stops the VM: its SymSpy registrations go with it.
        if let Some(sym) = &self.sym {
            sym.stop_publisher();
            sym.reset();
        }
        // Its socket file goes with it.
        if let Some(mut api) = self.api.take() {
            api.stop();
        }
        if let Some(m) = self.balloon_manager.take() {
            m.stop();
        }
        if let Some(iommu) = &mut self.iommu {
            iommu.stop();
        }
        let wall = self.started.map(|s| s.elapsed()).unwrap_or_default();
        self.swap.finish();
        // What a stalled reader left in the buffer counts as dropped once the VM is gone.
        let unwritten = self.console.flush(lucid_devices::FLUSH_PATIENCE);
        self.stats
            .counter("serial.tx_unwritten")
            .set(unwritten as u64);
        RunReport {
            stop,
            wall,
            vcpus: self.config.machine.vcpus,
            counters: self.stats.snapshot(),
        }
    }

    /// Builds, starts and waits.
    pub fn run(config: VmConfig) -> Result<RunReport, VmmError> {
        let mut vm = Vm::build(config)?;
        vm.start()?;
        Ok(vm.wait())
    }

    /// The symbiotic interfaces, with `--symbiotic`.
    pub fn sym(&self) -> Option<&Arc<crate::sym::Symbiotic>> {
        self.sym.as_ref()
    }

    pub fn stats(&self) -> &Arc<StatsRegistry> {
        &self.stats
    }
    pub fn hooks(&self) -> &Arc<ExitHooks> {
        &self.hooks
    }
    pub fn lifecycle(&self) -> &Arc<Lifecycle> {
        &self.lifecycle
    }
    pub fn vcpus(&self) -> &[Arc<VcpuHandle>] {
        &self.handles
    }
    pub fn dma(&self) -> &Arc<DmaPath> {
        &self.dma
    }
    /// Guest RAM, shared with what gives pages back or remaps them (the balloon).
    pub fn ram(&self) -> &Arc<GuestRam> {
        &self.ram
    }
    /// The virtio-balloon's control, when the VM has one (`DevicesConfig::balloon`).
    pub fn balloon(&self) -> Option<&lucid_virtio::balloon::BalloonControl> {
        self.pci.as_ref().and_then(|p| p.balloon.as_ref())
    }
    /// Whether the VM runs under `--memory-limit`.
    pub fn memory_limited(&self) -> bool {
        self.swap.has_limit()
    }
    pub fn kvm_vm(&self) -> &lucid_hv::Vm {
        &self.vm
    }
    pub fn kernel_kind(&self) -> KernelKind {
        self.kind
    }
    pub fn backend(&self) -> Backend {
        self.backend
    }
    /// The PCI bus, when the VM has PCI devices.
    pub fn pci(&self) -> Option<&PciBus> {
        self.pci.as_ref()
    }
    /// The vIOMMU, when the VM has one (`VmConfig::iommu`).
    pub fn iommu(&self) -> Option<&Arc<lucid_iommu::Vtd>> {
        self.iommu.as_ref().map(|i| &i.vtd)
    }
    /// The GSI router (MSI routes, interrupt remapping), when the VM has PCI devices or a
    /// vIOMMU.
    pub fn gsi_router(&self) -> Option<&Arc<lucid_hv::GsiRouter>> {
        self.router.as_ref()
    }
    /// Asks the VM to stop, as SIGTERM would.
    pub fn stop(&self, reason: StopReason) {
        self.lifecycle.stop(reason)
    }
}

impl Drop for Vm {
    /// A VM dropped while it runs stops: its vCPU threads are joined, then the PCI bus goes,
    /// and with the last hold on each transport (the exit hooks, a field of this struct) its
    /// device is reset and its back-end thread joined.
    fn drop(&mut self) {
        if !self.threads.is_empty() {
            self.lifecycle.stop(StopReason::Dropped);
            if let Some(api) = &self.api {
                api.signal_stop();
            }
            for t in self.threads.drain(..) {
                let _ = t.join();
            }
        }
        if let Some(sym) = &self.sym {
            sym.stop_publisher();
        }
        self.api = None;
        self.pools = None;
        self.balloon_manager = None;
        // The sidecore stops before the devices whose DMA it translates go.
        self.iommu = None;
        self.pci = None;
    }
}

/// The VM's name in the pools' state directory: its guest or kernel file name.
fn vm_name(kernel: &KernelSource) -> String {
    match kernel {
        KernelSource::Builtin { name, .. } => name.clone(),
        KernelSource::File(p) => p
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "kernel".into()),
    }
}

/// What the platform devices leave the VM to keep.
struct Platform {
    /// The serial console's output, flushed at VM exit.
    console: Arc<ConsoleOut>,
    /// Kept open: the irqfd and ioeventfd registrations refer to them.
    eventfds: Vec<EventFd>,
}

/// The devices every VM has, on the exit hooks: COM1 (its interrupt by irqfd on GSI 4), the
/// debug-exit port, the i8042 reset line, the CMOS RTC, the POST port, the ioeventfd probe port
/// and the MMIO probe page.
fn platform_devices(
    config: &VmConfig,
    vm: &lucid_hv::Vm,
    hooks: &ExitHooks,
    lifecycle: &Arc<Lifecycle>,
    stats: &Arc<StatsRegistry>,
    seccomp: &Option<Seccomp>,
) -> Result<Platform, VmmError> {
    let serial_irq = eventfd("the serial interrupt")?;
    vm.register_irqfd(&serial_irq, 4)?;
    let (serial, listener) = Serial::new(
        &config.devices.serial,
        clone_eventfd(&serial_irq, "the serial interrupt")?,
        stats,
        seccomp.clone(),
    )
    .map_err(|source| VmmError::Serial {
        output: config.devices.serial.clone(),
        source,
    })?;
    let console = serial.output().clone();
    let serial = Arc::new(Mutex::new(serial));
    let stdin =
        config.devices.serial_stdin && config.devices.serial == lucid_devices::SerialOutput::Stdio;
    Serial::start_input(&serial, listener, stdin, seccomp.clone());
    let pio = |base: u16, len: u64, name: &str, dev: Arc<Mutex<dyn BusDevice>>| {
        hooks.pio.insert(base.into(), len, name, dev)
    };
    pio(ports::SERIAL_COM1, 8, "serial", serial)?;
    let debug_exit = DebugExit::new(lifecycle.clone());
    pio(
        ports::DEBUG_EXIT,
        4,
        "debug-exit",
        Arc::new(Mutex::new(debug_exit)),
    )?;
    let i8042 = I8042::new(lifecycle.clone());
    pio(ports::I8042, 5, "i8042", Arc::new(Mutex::new(i8042)))?;
    pio(ports::RTC, 2, "cmos", Arc::new(Mutex::new(Cmos::new())))?;
    crate::acpi_pm::add_acpi_pm(vm, &hooks.pio, lifecycle, stats)?;
    let post = NopPort::new(stats, "post");
    pio(ports::POST, 1, "post", Arc::new(Mutex::new(post)))?;
    // The page probe guests store to when they measure MMIO exits.
    let mmio_probe = NopPort::new(stats, "mmio_probe");
    hooks.mmio.insert(
        layout::PROBE_MMIO,
        0x1000,
        "mmio-probe",
        Arc::new(Mutex::new(mmio_probe)),
    )?;
    Ok(Platform {
        console,
        eventfds: vec![serial_irq, ioeventfd_probe(vm, stats)?],
    })
}

/// Lucid's own hypercalls: discovery, the TSC frequency (stored once the boot vCPU exists) and
/// the KVM backend.
fn add_hypercalls(hooks: &ExitHooks, backend: Backend) -> Arc<AtomicU64> {
    let tsc_khz = Arc::new(AtomicU64::new(0));
    hooks.add_hypercall(
        hypercall::DISCOVER,
        Arc::new(|_: u32, _: &kvm_regs| hypercall::MAGIC),
    );
    let t = tsc_khz.clone();
    hooks.add_hypercall(
        hypercall::TSC_KHZ,
        Arc::new(move |_: u32, _: &kvm_regs| t.load(Ordering::Relaxed)),
    );
    let code = backend.code() as u64;
    hooks.add_hypercall(
        hypercall::BACKEND,
        Arc::new(move |_: u32, _: &kvm_regs| code),
    );
    tsc_khz
}

/// Builds the PCI root complex (0xCF8 ports and ECAM), then each configured virtio device on its
/// rung, attached in order from slot 1.
// The VM's parts a device needs, passed one by one: a struct would only rename them.
#[allow(clippy::too_many_arguments)]
fn attach_pci(
    config: &VmConfig,
    b: &VmBuilder,
    router: &Arc<lucid_hv::GsiRouter>,
    dma: &Arc<DmaPath>,
    hooks: &Arc<ExitHooks>,
    stats: &Arc<StatsRegistry>,
    swap: &crate::swap::VmSwap,
    swapcache: Option<&Arc<crate::sym::SwapCacheDevice>>,
) -> Result<PciBus, VmmError> {
    // The Swap Mapper on every disk (none in baseline mode); pages the balloon gives back go
    // through it when there is one (it forgets the image blocks they showed), else through guest
    // RAM itself (fresh anonymous memory over them).
    let blk_hook = swap.blk_hook();
    let discard = swap.page_discard(b.ram());
    use lucid_pci::{HostCaps, PciWindows, TransportEnv, TransportOptions};

    let host = HostCaps::probe(
        config.devices.pci.iter().map(|d| d.rung),
        lucid_hv::posted_interrupts_available,
        || lucid_probe::cpuid_intercepted(b.kvm()).unwrap_or(false),
    );
    let router = router.clone();
    let root = lucid_pci::PciRoot::new(
        hooks.mmio.clone(),
        hooks.pio.clone(),
        PciWindows {
            mmio: layout::PCI_MMIO_START..layout::PCI_MMIO_END,
            io: 0xc000..0x1_0000,
            ecam: (layout::PCI_ECAM_START, layout::PCI_ECAM_SIZE),
        },
        stats,
    );
    root.register().map_err(VmmError::PciRoot)?;
    let env = TransportEnv {
        vm: b.vm().clone(),
        router: router.clone(),
        mem: b.memory().clone(),
        dma: dma.clone(),
        stats: stats.clone(),
        host,
    };
    let (mut nblk, mut nnet) = (0, 0);
    let mut devices = Vec::new();
    for (i, d) in config.devices.pci.iter().enumerate() {
        let device: Box<dyn lucid_virtio::VirtioDevice> = match &d.kind {
            crate::config::PciDeviceKind::Block(b) => {
                let name = format!("blk{nblk}");
                nblk += 1;
                let mut blk =
                    lucid_virtio::blk::Block::new(name.clone(), b.clone()).map_err(|source| {
                        VmmError::Block {
                            device: name,
                            source,
                        }
                    })?;
                if let Some(h) = &blk_hook {
                    blk.set_data_hook(h.clone());
                }
                if let Some(c) = swapcache.filter(|_| d.swapcache_mib > 0) {
                    blk.set_cache(c.clone());
                }
                Box::new(blk)
            }
            crate::config::PciDeviceKind::Net(n) => {
                let name = format!("net{nnet}");
                nnet += 1;
                Box::new(
                    lucid_virtio::net::Net::new(name.clone(), n.clone()).map_err(|source| {
                        VmmError::Net {
                            device: name,
                            source,
                        }
                    })?,
                )
            }
        };
        let name = device.name().to_string();
        let opts = TransportOptions {
            rung: d.rung,
            coalescing: d.coalescing,
            poll_idle_us: d.poll_idle_us,
            // attach_virtio takes the next free slot, i + 1; the DSDT's _PRT uses the same rule.
            intx_gsi: Some(layout::pci_intx_gsi(i as u8 + 1, 0)),
        };
        let (addr, dev) =
            lucid_pci::attach_virtio(&root, device, env.clone(), opts).map_err(|source| {
                VmmError::PciAttach {
                    device: name.clone(),
                    source,
                }
            })?;
        debug_assert_eq!(addr.slot, i as u8 + 1, "INTx GSI assumes slot i + 1");
        let plan = lock_transport(&dev).plan();
        if let Some(w) = plan.warning() {
            log::warn!("{name}: {w}");
        }
        log::info!(
            "{name}: PCI 00:{:02x}.0 on rung {:?}: kicks by {}, interrupts by {:?}, back-end {:?}",
            addr.slot,
            plan.rung,
            if plan.ioeventfd {
                "ioeventfd"
            } else {
                "userspace exit"
            },
            plan.msi,
            plan.notify,
        );
        devices.push((name, addr, dev));
    }
    // The balloon, after them, by the same rule.
    let mut balloon = None;
    if let Some(cfg) = &config.devices.balloon {
        let ram = b.ram();
        let ranges: Vec<(u64, u64)> = ram.regions().iter().map(|r| (r.gpa, r.size)).collect();
        let dev = lucid_virtio::balloon::Balloon::new(
            "balloon".into(),
            cfg.clone(),
            &ranges,
            discard,
            stats,
        )
        .map_err(VmmError::Balloon)?;
        balloon = Some(dev.control());
        let slot = devices.len() as u8 + 1;
        let opts = TransportOptions {
            intx_gsi: Some(layout::pci_intx_gsi(slot, 0)),
            ..TransportOptions::default()
        };
        let (addr, dev) = lucid_pci::attach_virtio(&root, Box::new(dev), env.clone(), opts)
            .map_err(|source| VmmError::PciAttach {
                device: "balloon".into(),
                source,
            })?;
        debug_assert_eq!(addr.slot, slot, "INTx GSI assumes the next slot");
        log::info!(
            "balloon: PCI {addr}, target {} MiB, features {:#x}",
            cfg.size_mib,
            cfg.features()
        );
        devices.push(("balloon".into(), addr, dev));
    }
    // The other devices, in the next slots; INTx by the same rule.
    let mut platform = Vec::new();
    for &d in &config.devices.platform_pci {
        let slot = u8::try_from(devices.len() + platform.len() + 1).unwrap_or(u8::MAX);
        let intx_gsi = layout::pci_intx_gsi(slot, 0);
        let attached = match d {
            PlatformPciDevice::Edu => lucid_pci::attach_edu(&root, &env, Some(intx_gsi))
                .map(|(a, dev)| (a, dev as Arc<Mutex<dyn lucid_pci::PciDevice>>)),
        };
        let (addr, dev) = attached.map_err(|source| VmmError::PciAttach {
            device: d.name().into(),
            source,
        })?;
        debug_assert_eq!(addr.slot, slot, "INTx GSI assumes the next slot");
        log::info!(
            "{}: PCI {addr}, interrupts by MSI or INTx on GSI {intx_gsi}",
            d.name()
        );
        platform.push((d.name().to_string(), addr, dev));
    }
    Ok(PciBus {
        root,
        router,
        devices,
        platform,
        balloon,
    })
}

fn lock_transport(
    d: &Arc<Mutex<lucid_pci::VirtioPciDevice>>,
) -> std::sync::MutexGuard<'_, lucid_pci::VirtioPciDevice> {
    d.lock().unwrap_or_else(|e| e.into_inner())
}

fn eventfd(what: &'static str) -> Result<EventFd, VmmError> {
    EventFd::new(EFD_NONBLOCK).map_err(|source| VmmError::EventFd { what, source })
}

fn clone_eventfd(evt: &EventFd, what: &'static str) -> Result<EventFd, VmmError> {
    evt.try_clone()
        .map_err(|source| VmmError::EventFd { what, source })
}

/// The command line the kernel gets: Linux gets a console by default, and on a host that emulates
/// guest kernel code the switches that avoid instructions KVM cannot emulate.
fn kernel_cmdline(user: &str, linux: bool, backend: Backend) -> String {
    let mut cmdline = if linux && user.trim().is_empty() {
        DEFAULT_LINUX_CMDLINE.to_string()
    } else {
        user.to_string()
    };
    if linux && backend == Backend::Pvm {
        // Linux honours only the last `clearcpuid=`: fold the user's bits into Lucid's.
        let mut extra = PVM_LINUX_CMDLINE.to_string();
        let words: Vec<&str> = cmdline.split_whitespace().collect();
        if let Some(user_bits) = words
            .iter()
            .rev()
            .find_map(|w| w.strip_prefix("clearcpuid="))
        {
            extra = extra.replacen("clearcpuid=", &format!("clearcpuid={user_bits},"), 1);
            cmdline = words
                .iter()
                .filter(|w| !w.starts_with("clearcpuid="))
                .copied()
                .collect::<Vec<_>>()
                .join(" ");
        }
        cmdline = format!("{cmdline} {extra}").trim().to_string();
        log::warn!(
            "this host's KVM is PVM: guest kernel code is emulated (thousands of times slower than \
             native), so Linux boots slowly; added `{PVM_LINUX_CMDLINE}` to the command line"
        );
    }
    cmdline
}

/// The ioeventfd behind `ports::IOEVENTFD_PROBE`: writes there never leave the kernel. A stats
/// probe drains the eventfd, so the count of absorbed writes is still reported.
fn ioeventfd_probe(vm: &lucid_hv::Vm, stats: &Arc<StatsRegistry>) -> Result<EventFd, VmmError> {
    let evt = eventfd("the ioeventfd probe")?;
    vm.register_ioeventfd(&evt, IoAddr::Pio(ports::IOEVENTFD_PROBE))?;
    let reader = clone_eventfd(&evt, "the ioeventfd probe")?;
    let count = stats.counter("ioeventfd_probe.signals");
    stats.probe(
        "ioeventfd_probe",
        Box::new(move || {
            // An eventfd read returns the number of writes since the last read.
            if let Ok(n) = reader.read() {
                count.add(n);
            }
            vec![]
        }),
    );
    Ok(evt)
}

/// What SymSpy publishes about this VM: the lowest ladder rung among its devices, its IOMMU
/// mode, and its memory cgroup as the pressure source when it has a limit.
fn sym_sources(config: &VmConfig, swap: &crate::swap::VmSwap) -> crate::sym::PublishSources {
    use lucid_pci::ladder::Rung;
    use lucid_sym::abi::page;
    let rung = config
        .devices
        .pci
        .iter()
        .map(|d| match d.rung {
            Rung::L0 => 0,
            Rung::L1 => 1,
            Rung::L2 => 2,
            Rung::L3 => 3,
            Rung::L4 { .. } => 4,
        })
        .min()
        .unwrap_or(page::RUNG_NONE);
    let iommu_mode = match config.iommu.map(|c| c.mode) {
        None => page::IOMMU_NONE,
        Some(lucid_iommu::EmulationMode::Samecore) => page::IOMMU_VTD_SAMECORE,
        Some(lucid_iommu::EmulationMode::Sidecore) => page::IOMMU_VTD_SIDECORE,
    };
    crate::sym::PublishSources {
        pressure: swap.pressure(),
        iommu_mode,
        rung,
    }
}

/// Lucid's edits to the CPUID KVM supports, per vCPU: PV EOI only when the ladder offers it,
/// and the symbiotic leaves (0x40000100/0x40000101) only with `--symbiotic`.
fn edit_vcpu_cpuid(cpuid: &mut lucid_hv::kvm_bindings::CpuId, offer_pv_eoi: bool, symbiotic: bool) {
    if !offer_pv_eoi {
        hide_pv_eoi(cpuid)
    }
    if symbiotic {
        crate::sym::add_cpuid_leaves(cpuid);
    }
}

/// Clears `KVM_FEATURE_PV_EOI` (bit 6 of leaf 0x40000001 EAX).
fn hide_pv_eoi(cpuid: &mut lucid_hv::kvm_bindings::CpuId) {
    const KVM_CPUID_FEATURES: u32 = 0x4000_0001;
    const KVM_FEATURE_PV_EOI: u32 = 1 << 6;
    for e in cpuid.as_mut_slice() {
        if e.function == KVM_CPUID_FEATURES {
            e.eax &= !KVM_FEATURE_PV_EOI;
        }
    }
}

extern "C" fn kick_handler(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {}

/// The vCPU kick signal only needs to interrupt KVM_RUN; its handler does nothing.
fn install_kick_handler() {
    if let Err(e) = vmm_sys_util::signal::register_signal_handler(
        vmm_sys_util::signal::SIGRTMIN(),
        kick_handler,
    ) {
        log::warn!("cannot install the vCPU kick signal handler ({e}): pausing a vCPU may hang");
    }
}

/// SIGINT and SIGTERM stop the VM cleanly: they are blocked in every thread and taken by one
/// thread with sigwait. Called before any of the VM's threads start (console writer, input,
/// vCPUs, device back-ends), so they all inherit the mask: a thread that did not would take
/// the signal's default action and kill the process.
fn watch_stop_signals(lifecycle: Arc<Lifecycle>, seccomp: Option<Seccomp>) {
    // SAFETY: sigset manipulation on a local set, and pthread_sigmask on the calling thread.
    let set = unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        set
    };
    let spawned = std::thread::Builder::new()
        .name("lucid-signals".into())
        .spawn(move || {
            if let Err(e) = lucid_seccomp::confine(seccomp.as_ref(), Role::Main) {
                return lifecycle.stop(StopReason::error(e));
            }
            let mut sig: libc::c_int = 0;
            // SAFETY: sigwait on a valid set with a valid out pointer.
            if unsafe { libc::sigwait(&set, &mut sig) } == 0 {
                log::info!("signal {sig}: stopping the VM");
                lifecycle.stop(StopReason::Signal(sig));
            }
        });
    if let Err(e) = spawned {
        log::warn!("cannot start the signal thread ({e}): SIGINT/SIGTERM will not stop the VM");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_symbiotic_cpuid_leaves_are_added_only_with_symbiotic() {
        use lucid_hv::kvm_bindings::{kvm_cpuid_entry2, CpuId};
        let base = CpuId::from_entries(&[kvm_cpuid_entry2 {
            function: 0x4000_0000,
            eax: 0x4000_0001,
            ..Default::default()
        }])
        .unwrap();
        let find = |c: &CpuId, f: u32| c.as_slice().iter().find(|e| e.function == f).copied();
        let mut plain = base.clone();
        edit_vcpu_cpuid(&mut plain, true, false);
        assert!(find(&plain, lucid_sym::abi::CPUID_LEAF).is_none());
        assert!(find(&plain, lucid_sym::abi::CPUID_LEAF_INFO).is_none());
        let mut sym = base.clone();
        edit_vcpu_cpuid(&mut sym, true, true);
        let leaf = find(&sym, lucid_sym::abi::CPUID_LEAF).expect("0x40000100 added");
        let info = find(&sym, lucid_sym::abi::CPUID_LEAF_INFO).expect("0x40000101 added");
        let mut sig = Vec::new();
        for r in [leaf.ebx, leaf.ecx, leaf.edx] {
            sig.extend_from_slice(&r.to_le_bytes());
        }
        assert_eq!(&sig, lucid_sym::abi::CPUID_SIGNATURE);
        assert_eq!(info.eax, lucid_sym::abi::VERSION as u32);
        assert_eq!(u64::from(info.ebx), crate::sym::FEATURES);
        assert_eq!(info.ecx, 0x599, "the hypercall port");
        // KVM's own leaf is left alone, and adding twice does not duplicate.
        assert_eq!(find(&sym, 0x4000_0000).unwrap().eax, 0x4000_0001);
        edit_vcpu_cpuid(&mut sym, true, true);
        assert_eq!(sym.as_slice().len(), 3);
    }

    #[test]
    fn non_linux_kernels_get_the_command_line_as_given() {
        for backend in [Backend::Pvm, Backend::Vmx] {
            assert_eq!(kernel_cmdline("count=5", false, backend), "count=5");
            assert_eq!(kernel_cmdline("", false, backend), "");
        }
    }

    #[test]
    fn linux_gets_a_console_by_default() {
        assert_eq!(
            kernel_cmdline("", true, Backend::Vmx),
            DEFAULT_LINUX_CMDLINE
        );
        assert_eq!(
            kernel_cmdline("  ", true, Backend::Svm),
            DEFAULT_LINUX_CMDLINE
        );
        assert_eq!(
            kernel_cmdline("console=hvc0", true, Backend::Vmx),
            "console=hvc0"
        );
    }

    #[test]
    fn linux_on_pvm_gets_the_emulation_switches() {
        assert_eq!(
            kernel_cmdline("", true, Backend::Pvm),
            format!("{DEFAULT_LINUX_CMDLINE} {PVM_LINUX_CMDLINE}")
        );
        assert_eq!(
            kernel_cmdline("root=/dev/vda", true, Backend::Pvm),
            format!("root=/dev/vda {PVM_LINUX_CMDLINE}")
        );
    }

    /// Linux honours only the last `clearcpuid=`: the user's bits join Lucid's in one.
    #[test]
    fn the_users_clearcpuid_is_folded_into_lucids() {
        assert_eq!(
            kernel_cmdline(
                "clearcpuid=1 console=ttyS0 clearcpuid=5,6",
                true,
                Backend::Pvm
            ),
            "console=ttyS0 noxsave clearcpuid=5,6,137,141,154,156"
        );
        // Elsewhere the user's line is left alone.
        assert_eq!(
            kernel_cmdline("clearcpuid=5", true, Backend::Vmx),
            "clearcpuid=5"
        );
    }
}
