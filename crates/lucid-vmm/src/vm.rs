//! Builds and runs one VM. [`Vm::build`] reads top to bottom as the VM comes together, through
//! the stages of [`VmBuilder`]: KVM and memory, the interrupt controllers and the vCPUs, the
//! vIOMMU, the devices ([`DeviceManager`]), the kernel and its boot tables, then the techniques
//! ([`crate::technique`]); [`Vm::start`] starts the threads and [`Vm::wait`] reports.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use lucid_devices::{Lifecycle, StopReason};
use lucid_hv::Backend;
use lucid_mem::{DmaPath, GuestRam};
use lucid_seccomp::{Role, Seccomp};
use lucid_stats::StatsRegistry;
use lucid_stats::ThreadRole;
use lucid_thread::{Spawner, ThreadSpec};

use crate::builder::VmBuilder;
use crate::config::{KernelSource, VmConfig};
use crate::devices::{DeviceManager, DeviceParts};
use crate::emulate::Emulator;
use crate::hooks::ExitHooks;
use crate::report::RunReport;
use crate::technique::{StartContext, Techniques};
use crate::vcpu::{VcpuCtx, VcpuHandle};
use crate::VmmError;

/// A built VM.
pub struct Vm {
    config: VmConfig,
    /// The KVM VM: its MSR filter is installed at start, from the hooks registered by then.
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
    /// Starts the VM's threads; they confine themselves with `VmConfig::seccomp`.
    spawner: Spawner,
    /// The GSI router, when the VM has PCI devices or a vIOMMU.
    router: Option<Arc<lucid_hv::GsiRouter>>,
    /// The vIOMMU's unit (`VmConfig::iommu`); its lifecycle is a technique's.
    vtd: Option<Arc<lucid_iommu::Vtd>>,
    /// The symbiotic interfaces (`VmConfig::symbiotic`); their lifecycle is a technique's.
    sym: Option<Arc<crate::sym::Symbiotic>>,
    /// Where the balloon manager reads host pressure, when the caller chose.
    pressure: Option<Arc<dyn lucid_swap::balloon_manager::PressureSource>>,
    /// Taken when the VM stops, before the techniques are dropped.
    devices: Option<DeviceManager>,
    /// Last: dropped after every other part of the VM, in reverse start order.
    techniques: Techniques,
}

impl Vm {
    /// Builds the VM `config` describes, stage by stage ([`VmBuilder`]), ready to [`Vm::start`].
    pub fn build(config: VmConfig) -> Result<Self, VmmError> {
        config.validate()?;
        let stats = StatsRegistry::new();
        let mut seccomp = match config.machine.seccomp {
            true => Some(Seccomp::prepare(&stats)?),
            false => None,
        };
        if let Some(j) = &config.jail {
            // Before any thread starts, so that every thread has them (crate::jail); the bounding
            // set stays for the root processes a memory limit runs (mkswap, the OOM guard).
            lucid_jail::before_threads(config.memory.limit_mib.is_none())?;
            seccomp = seccomp.map(|s| s.allow_jail_drop(j.uid, j.gid));
        }
        let spawner = Spawner::new(seccomp, stats.threads().clone());
        let lifecycle = Arc::new(Lifecycle::new());
        if config.pools.low_noise {
            // Before any thread starts: they all inherit the non-vCPU CPUs.
            crate::pools::low_noise(config.machine.vcpus, &stats, &spawner)?;
            for p in crate::pools::low_noise_pollers(&config) {
                log::warn!("--low-noise: {p}");
            }
        }
        if config.machine.handle_signals {
            // Before any thread starts, so that every thread inherits the blocked mask.
            crate::signals::watch_stop_signals(lifecycle.clone(), &spawner);
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

        // Interrupt controllers and timers, in the kernel; then the vCPUs, whose boot registers
        // come with the kernel.
        b.irqchip()?;
        if let Some(s) = b.vm().stats() {
            stats.probe("kvm.vm", Box::new(move || s.read()));
        }
        let tsc_khz = crate::hypercall::add_hypercalls(&hooks, b.backend())?;
        let (ctxs, handles) = vcpus(&b, &config, &hooks, &lifecycle, &stats, &tsc_khz)?;

        // MSI routes, and the vIOMMU before any device: transports ask the DMA path whether
        // addresses are translated when they are built.
        let router = (DeviceManager::wants_pci(&config) || config.iommu.is_some())
            .then(|| lucid_hv::GsiRouter::new(b.vm().clone()));
        let iommu = match (config.iommu, &router) {
            (Some(cfg), Some(router)) => Some(crate::iommu::Iommu::build(
                cfg,
                b.vm(),
                b.memory(),
                &dma,
                router,
                &hooks,
                &stats,
                &spawner,
            )?),
            _ => None,
        };

        // The symbiotic interfaces, whole, before the devices (the swap cache asks them).
        let sym = config.symbiotic.enabled.then(|| {
            crate::sym::Symbiotic::new(crate::sym::SymParts {
                hooks: &hooks,
                mem: b.memory(),
                stats: &stats,
                vcpu_count: config.machine.vcpus.into(),
                vcpus: handles.clone(),
                sources: sym_sources(&config, &swap),
                hv: Some(b.vm().clone()),
            })
        });
        let sym = sym.transpose()?;

        // Devices: the legacy ones, then PCI (only when there are PCI devices).
        let devices = DeviceManager::build(DeviceParts {
            config: &config,
            builder: &b,
            router: router.as_ref(),
            dma: &dma,
            hooks: &hooks,
            lifecycle: &lifecycle,
            stats: &stats,
            spawner: &spawner,
            swap: &swap,
            sym: sym.as_ref(),
            vtd: iommu.as_ref().map(|i| &i.vtd),
        })?;
        crate::iommu::add_report_hypercall(&hooks, &stats)?;
        crate::pools::add_work_hypercall(&hooks, &stats)?;

        // The kernel, its command line and the boot tables; the boot vCPU's entry state.
        let setup = crate::boot::load_kernel(
            &b,
            &config,
            devices.has_pci(),
            iommu.is_some(),
            devices.fw_cfg().map(|f| &**f),
        )?;
        b.boot_vcpu(&ctxs[0].vcpu, &setup)?;

        // The techniques, in start order. The pools join once the KVM VM exists (halt polling)
        // and before any vCPU or back-end thread starts (they place themselves as they register).
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
                        + usize::from(config.devices.balloon.is_some())
                        + usize::from(config.devices.rng.is_some())
                        + usize::from(config.devices.console.is_some()),
                    spawner: &spawner,
                },
            )?,
        };
        let balloon_manager = devices
            .balloon()
            .filter(|_| config.devices.balloon.as_ref().is_some_and(|b| b.manager))
            .map(|ctl| crate::balloon::BalloonManagerTechnique {
                ctl: ctl.clone(),
                limit_pressure: swap.pressure(),
                manager: None,
            });
        let vtd = iommu.as_ref().map(|i| i.vtd.clone());
        let mut techniques = Techniques::default();
        techniques.push(Some(swap));
        techniques.push(iommu);
        techniques.push(pools);
        techniques.push(sym.clone().map(|sym| crate::sym::SymTechnique {
            sym,
            publish: !config.pools.low_noise,
        }));
        techniques.push(balloon_manager);

        let backend = b.backend();
        let (vm, ram) = b.finish();
        Ok(Vm {
            config,
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
            spawner,
            router,
            vtd,
            sym,
            pressure: None,
            devices: Some(devices),
            techniques,
        })
    }

    /// Starts the techniques that run before the vCPUs, one named thread per vCPU, then the
    /// other techniques.
    pub fn start(&mut self) -> Result<(), VmmError> {
        crate::signals::install_kick_handler();
        self.hooks.install_msr_filter(&self.vm)?;
        let cx = StartContext {
            ram: &self.ram,
            hooks: &self.hooks,
            stats: &self.stats,
            lifecycle: &self.lifecycle,
            spawner: &self.spawner,
            pressure: self.pressure.take(),
        };
        self.techniques.start(true, &cx)?;
        if let Some(j) = &self.config.jail {
            crate::jail::enter(j, &self.config)?;
        }
        self.started = Some(Instant::now());
        for ctx in self.ctxs.drain(..) {
            let vcpu = ctx.id();
            let lifecycle = self.lifecycle.clone();
            let sym = self.sym.clone();
            let spec = ThreadSpec::new(
                format!("lucid-vcpu{vcpu}"),
                ThreadRole::Vcpu(vcpu),
                Role::Vcpu,
            )
            .before_confine(move || {
                if let Some(sym) = sym {
                    sym.attach_vcpu_thread(vcpu);
                }
            });
            let t = self.spawner.spawn(spec, move |confined| match confined {
                Ok(()) => ctx.run(),
                Err(e) => lifecycle.stop(StopReason::error(e)),
            })?;
            self.threads.push(t);
        }
        self.techniques.start(false, &cx)
    }

    /// Sets where the balloon manager reads host pressure (before [`Vm::start`]); by default
    /// it is the VM's memory cgroup under `--memory-limit`, else this process's resident set
    /// against what the host has available ([`crate::balloon::ProcessPressure`]).
    pub fn set_pressure_source(
        &mut self,
        source: Arc<dyn lucid_swap::balloon_manager::PressureSource>,
    ) {
        self.pressure = Some(source);
    }

    /// Confines the calling thread to the main thread's seccomp role when the VM's threads are
    /// confined: from then on it may wait, report and tear the VM down, not open files or
    /// start processes. For the thread that started the VM and will only wait for it (the
    /// CLI's main thread), once everything it will write to is open.
    pub fn confine_caller(&self) -> Result<(), VmmError> {
        Ok(lucid_seccomp::confine(self.spawner.seccomp(), Role::Main)?)
    }

    /// The one way the VM's threads stop, for [`Vm::wait`] and for a drop: the techniques
    /// quiesce (newest first; the pools' monitor takes its last window while the vCPU threads
    /// are still listed), the vCPU threads are joined, then the techniques stop (newest first;
    /// the vIOMMU's sidecore before the devices whose DMA it translates go). Idempotent.
    fn shut_down(&mut self) {
        self.techniques.quiesce();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        self.techniques.stop();
    }

    /// Waits until the VM stops, stops its threads and reports.
    pub fn wait(mut self) -> RunReport {
        let stop = self.lifecycle.wait();
        self.shut_down();
        let wall = self.started.map(|s| s.elapsed()).unwrap_or_default();
        // What a stalled reader left in the buffer counts as dropped once the VM is gone.
        if let Some(d) = &self.devices {
            let unwritten = d.console().flush(lucid_devices::FLUSH_PATIENCE);
            self.stats
                .counter("serial.tx_unwritten")
                .set(unwritten as u64);
        }
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
    /// What the VM was built from.
    pub fn config(&self) -> &VmConfig {
        &self.config
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
    /// The VM's devices.
    pub fn devices(&self) -> &DeviceManager {
        self.devices
            .as_ref()
            .expect("taken only when the VM is dropped")
    }
    /// The virtio-balloon's control, when the VM has one (`VmConfig::balloon`).
    pub fn balloon(&self) -> Option<&lucid_virtio::balloon::BalloonControl> {
        self.devices().balloon()
    }
    /// The techniques the VM runs, in start order: (name, prefixes of the counters each owns).
    pub fn techniques(&self) -> Vec<(&'static str, &'static [&'static str])> {
        self.techniques.list()
    }
    pub fn backend(&self) -> Backend {
        self.backend
    }
    /// The vIOMMU, when the VM has one (`VmConfig::iommu`).
    pub fn iommu(&self) -> Option<&Arc<lucid_iommu::Vtd>> {
        self.vtd.as_ref()
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
    /// A VM dropped while it runs stops, by the path [`Vm::wait`] takes. Then the devices go:
    /// with the last hold on each transport (the exit hooks, the device manager) its device is
    /// reset and its back-end thread joined. The techniques go last (a field declared last),
    /// in reverse start order, so that the memory limit goes after everything it charges.
    fn drop(&mut self) {
        if !self.threads.is_empty() {
            self.lifecycle.stop(StopReason::Dropped);
        }
        self.shut_down();
        self.devices = None;
    }
}

/// vCPU `0..config.machine.vcpus`, each with its exit loop's context (no thread yet); the boot vCPU's
/// TSC frequency goes to `tsc_khz` (the TSC_KHZ hypercall). PV EOI in CPUID is the ladder's
/// call (L2 only).
fn vcpus(
    b: &VmBuilder,
    config: &VmConfig,
    hooks: &Arc<ExitHooks>,
    lifecycle: &Arc<Lifecycle>,
    stats: &Arc<StatsRegistry>,
    tsc_khz: &AtomicU64,
) -> Result<(Vec<VcpuCtx>, Vec<Arc<VcpuHandle>>), VmmError> {
    let offer_pv_eoi =
        lucid_pci::ladder::vm_offers_pv_eoi(config.devices.pci.iter().map(|d| d.rung));
    let mut ctxs = Vec::new();
    let mut handles = Vec::new();
    for id in 0..config.machine.vcpus {
        let vcpu = b.vcpu(id, config.machine.vcpus, None, |cpuid| {
            crate::boot::edit_vcpu_cpuid(cpuid, offer_pv_eoi, config.symbiotic.enabled)
        })?;
        if id == 0 {
            tsc_khz.store(vcpu.tsc_khz().unwrap_or(0).into(), Ordering::Relaxed);
        }
        if let Some(s) = vcpu.stats() {
            stats.probe(format!("kvm.vcpu{id}"), Box::new(move || s.read()));
        }
        let emulator = Emulator::with_memory(id.into(), b.memory().clone(), stats.clone());
        let (ctx, handle) = VcpuCtx::new(vcpu, hooks.clone(), lifecycle.clone(), stats, emulator);
        let h = handle.clone();
        lifecycle.add_kicker(Box::new(move || h.kick()));
        ctxs.push(ctx);
        handles.push(handle);
    }
    Ok((ctxs, handles))
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
