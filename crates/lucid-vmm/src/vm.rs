//! Builds and runs one VM. [`Vm::build`] reads top to bottom as the VM comes together: KVM and
//! memory, the interrupt controllers, the devices and their exit hooks, the kernel and its boot
//! tables, then the vCPUs; [`Vm::start`] starts the vCPU threads and [`Vm::wait`] reports.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

use lucid_boot::layout::{self, ports};
use lucid_boot::{AcpiConfig, BootParams, KernelImage, KernelKind};
use lucid_devices::{Cmos, DebugExit, Lifecycle, NopPort, Serial, StopReason, I8042};
use lucid_hv::kvm_bindings::{kvm_regs, KVM_MAX_CPUID_ENTRIES};
use lucid_hv::probe::{detect_backend, Backend};
use lucid_hv::IoAddr;
use lucid_mem::{DmaPath, GuestRam};
use lucid_seccomp::Role;
use lucid_stats::StatsRegistry;
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::config::{KernelSource, VmConfig, MAX_MEM_MIB, MAX_VCPUS, MIN_MEM_MIB};
use crate::emulate::Emulator;
use crate::hooks::ExitHooks;
use crate::report::RunReport;
use crate::vcpu::{VcpuCtx, VcpuHandle};

/// Lucid's hypercall numbers (shared with the probe-guest kit's `lucid.h`).
pub mod hypercall {
    pub const DISCOVER: u64 = 0;
    pub const TSC_KHZ: u64 = 1;
    pub const BACKEND: u64 = 2;
    /// What DISCOVER returns: "LUCI".
    pub const MAGIC: u64 = 0x4C55_4349;
}

/// Kernel command-line switches that keep Linux off the instructions KVM's emulator lacks on a
/// host that emulates guest kernel code (PLATFORM.md): CX16, XSAVE and AVX (141, 154, 156), and
/// SSSE3 (137), whose absence sends the kernel's SIMD code (the BLAKE2s self-test at boot) to
/// plain C that KVM emulates without an exit per instruction (docs/linux.md, run C).
pub const PVM_LINUX_CMDLINE: &str = "noxsave clearcpuid=137,141,154,156";
/// The console line Linux gets when the user gives none.
pub const DEFAULT_LINUX_CMDLINE: &str = "console=ttyS0 earlyprintk=serial reboot=k panic=-1";

#[derive(Debug, thiserror::Error)]
pub enum VmmError {
    #[error(transparent)]
    Hv(#[from] lucid_hv::HvError),
    #[error(transparent)]
    Mem(#[from] lucid_mem::MemError),
    #[error(transparent)]
    Boot(#[from] lucid_boot::BootError),
    #[error("device setup: {0}")]
    Device(String),
    #[error("invalid configuration: {0}")]
    Config(String),
    #[error("cannot start vCPU thread: {0}")]
    Thread(std::io::Error),
    #[error(transparent)]
    Seccomp(#[from] lucid_seccomp::SeccompError),
}

/// A built VM.
pub struct Vm {
    config: VmConfig,
    kind: KernelKind,
    vm: lucid_hv::Vm,
    ram: GuestRam,
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
    warnings: Vec<String>,
    pci: Option<PciBus>,
    /// Set when the VM's threads confine themselves (`VmConfig::seccomp`).
    seccomp: Option<lucid_seccomp::Seccomp>,
}

/// The VM's PCI bus and its virtio devices.
pub struct PciBus {
    pub root: Arc<lucid_pci::PciRoot>,
    pub router: Arc<lucid_hv::GsiRouter>,
    /// (name, address, transport) in attach order.
    pub devices: Vec<(
        String,
        lucid_pci::PciAddress,
        Arc<Mutex<lucid_pci::VirtioPciDevice>>,
    )>,
}

impl Vm {
    pub fn build(config: VmConfig) -> Result<Self, VmmError> {
        check_config(&config)?;
        let kvm = lucid_hv::open_kvm()?;
        let backend = detect_backend();
        let stats = StatsRegistry::new();
        let seccomp = if config.seccomp {
            Some(lucid_seccomp::Seccomp::prepare(&stats)?)
        } else {
            None
        };
        let lifecycle = Arc::new(Lifecycle::new());
        let hooks = ExitHooks::new();
        let mut warnings = Vec::new();

        // Memory.
        let vm = lucid_hv::Vm::new(kvm.clone())?;
        let mem_size = config.mem_mib << 20;
        let ram = GuestRam::new(&layout::ram_regions(mem_size), config.backing.clone())?;
        for (slot, r) in ram.regions().iter().enumerate() {
            // SAFETY: the region's mapping is owned by `ram`, which this Vm keeps until after
            // the vCPU threads are joined.
            unsafe { vm.set_memory_slot(slot as u32, r.gpa, r.size, r.host_addr, false)? };
        }
        let dma = DmaPath::new(ram.memory().clone(), &stats);

        // Interrupt controllers and timers, in the kernel.
        vm.create_irqchip_and_pit()?;
        if let Some(s) = vm.stats() {
            stats.probe("kvm.vm", Box::new(move || s.read()));
        }

        // Platform devices.
        let mut eventfds = Vec::new();
        let serial_irq = EventFd::new(EFD_NONBLOCK).map_err(dev_err("serial irq eventfd"))?;
        vm.register_irqfd(&serial_irq, 4)?;
        let (serial, listener) = Serial::new(
            &config.serial,
            serial_irq.try_clone().map_err(dev_err("eventfd"))?,
            &stats,
        )
        .map_err(|e| VmmError::Device(format!("serial console {:?}: {e}", config.serial)))?;
        eventfds.push(serial_irq);
        let serial = Arc::new(Mutex::new(serial));
        let stdin = config.serial_stdin && config.serial == lucid_devices::SerialOutput::Stdio;
        Serial::start_input(&serial, listener, stdin, seccomp.clone());
        let pio = &hooks.pio;
        let add =
            |base: u16, len: u64, name: &str, dev: Arc<Mutex<dyn lucid_devices::BusDevice>>| {
                pio.insert(base as u64, len, name, dev)
                    .map_err(|e| VmmError::Device(e.to_string()))
            };
        add(ports::SERIAL_COM1, 8, "serial", serial)?;
        add(
            ports::DEBUG_EXIT,
            4,
            "debug-exit",
            Arc::new(Mutex::new(DebugExit::new(lifecycle.clone()))),
        )?;
        add(
            ports::I8042,
            5,
            "i8042",
            Arc::new(Mutex::new(I8042::new(lifecycle.clone()))),
        )?;
        add(ports::RTC, 2, "cmos", Arc::new(Mutex::new(Cmos::new())))?;
        crate::acpi_pm::add_acpi_pm(&vm, pio, &lifecycle, &stats)?;
        add(
            ports::POST,
            1,
            "post",
            Arc::new(Mutex::new(NopPort::new(&stats, "post"))),
        )?;
        eventfds.push(ioeventfd_probe(&vm, &stats)?);
        // The page probe guests store to when they measure MMIO exits.
        hooks
            .mmio
            .insert(
                layout::PROBE_MMIO,
                0x1000,
                "mmio-probe",
                Arc::new(Mutex::new(NopPort::new(&stats, "mmio_probe"))),
            )
            .map_err(|e| VmmError::Device(e.to_string()))?;

        // virtio devices on PCI (only when there are any).
        let pci = if config.pci.is_empty() {
            None
        } else {
            Some(attach_pci(
                &config,
                &kvm,
                &vm,
                &ram,
                &dma,
                &hooks,
                &stats,
                &mut warnings,
            )?)
        };

        // Lucid's own hypercalls.
        let tsc_khz = Arc::new(std::sync::atomic::AtomicU64::new(0));
        hooks.add_hypercall(
            hypercall::DISCOVER,
            Arc::new(|_: u32, _: &kvm_regs| hypercall::MAGIC),
        );
        let t = tsc_khz.clone();
        hooks.add_hypercall(
            hypercall::TSC_KHZ,
            Arc::new(move |_: u32, _: &kvm_regs| t.load(std::sync::atomic::Ordering::Relaxed)),
        );
        let code = backend.code() as u64;
        hooks.add_hypercall(
            hypercall::BACKEND,
            Arc::new(move |_: u32, _: &kvm_regs| code),
        );

        // The kernel, its command line and the boot tables.
        let (kernel_path, image) = match &config.kernel {
            KernelSource::File(p) => (p.clone(), KernelImage::open(p)?),
            KernelSource::Builtin { name, bytes } => {
                let p = PathBuf::from(format!("<built-in {name}>"));
                (p.clone(), KernelImage::from_bytes(&p, bytes.to_vec())?)
            }
        };
        let kind = image.kind();
        let cmdline = kernel_cmdline(&config.cmdline, image.is_linux(), backend, &mut warnings);
        let mut acpi = AcpiConfig::new(config.vcpus);
        if pci.is_some() {
            let last_bus = ((layout::PCI_ECAM_SIZE >> 20) - 1).min(255) as u8;
            acpi.pci_ecam = Some((layout::PCI_ECAM_START, 0, last_bus));
        }
        let setup = lucid_boot::load_image(
            ram.memory(),
            &image,
            &BootParams {
                kernel: &kernel_path,
                initrd: config.initrd.as_deref(),
                cmdline: &cmdline,
                mem_size,
                acpi: Some(&acpi),
            },
        )?;

        // vCPUs: CPUID each, boot registers on vCPU 0; the others wait for INIT/SIPI.
        let mut ctxs = Vec::new();
        let mut handles = Vec::new();
        for id in 0..config.vcpus {
            let vcpu = vm.create_vcpu(id as u32)?;
            let mut cpuid = kvm
                .get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
                .map_err(|e| lucid_hv::HvError::Ioctl("KVM_GET_SUPPORTED_CPUID", e))?;
            lucid_boot::filter_cpuid(&mut cpuid, id, config.vcpus);
            // PV EOI in CPUID is the ladder's call (L2 only).
            if !lucid_pci::ladder::vm_offers_pv_eoi(config.pci.iter().map(|d| d.rung)) {
                hide_pv_eoi(&mut cpuid);
            }
            vcpu.set_cpuid(&cpuid)?;
            set_lint_virtual_wire(&vcpu)?;
            if id == 0 {
                let (mut regs, mut sregs) = (vcpu.get_regs()?, vcpu.get_sregs()?);
                lucid_boot::setup_boot_regs(&setup.entry, &mut regs, &mut sregs, ram.memory())?;
                vcpu.set_sregs(&sregs)?;
                vcpu.set_regs(&regs)?;
                tsc_khz.store(
                    vcpu.tsc_khz().unwrap_or(0) as u64,
                    std::sync::atomic::Ordering::Relaxed,
                );
            }
            if let Some(s) = vcpu.stats() {
                stats.probe(format!("kvm.vcpu{id}"), Box::new(move || s.read()));
            }
            let (ctx, handle) = VcpuCtx::new(
                vcpu,
                hooks.clone(),
                lifecycle.clone(),
                &stats,
                Emulator::with_memory(id as u32, ram.memory().clone(), stats.clone()),
            );
            let h = handle.clone();
            lifecycle.add_kicker(Box::new(move || h.kick()));
            ctxs.push(ctx);
            handles.push(handle);
        }

        Ok(Vm {
            config,
            kind,
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
            _eventfds: eventfds,
            warnings,
            pci,
            seccomp,
        })
    }

    /// Starts one named thread per vCPU.
    pub fn start(&mut self) -> Result<(), VmmError> {
        install_kick_handler();
        if self.config.handle_signals {
            watch_stop_signals(self.lifecycle.clone(), self.seccomp.clone());
        }
        self.started = Some(Instant::now());
        for ctx in self.ctxs.drain(..) {
            let name = format!("lucid-vcpu{}", ctx.id());
            let (seccomp, lifecycle) = (self.seccomp.clone(), self.lifecycle.clone());
            let t = std::thread::Builder::new()
                .name(name)
                .spawn(
                    move || match lucid_seccomp::confine(seccomp.as_ref(), Role::Vcpu) {
                        Ok(()) => ctx.run(),
                        Err(e) => lifecycle.stop(StopReason::Error(e.to_string())),
                    },
                )
                .map_err(VmmError::Thread)?;
            self.threads.push(t);
        }
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
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        let wall = self.started.map(|s| s.elapsed()).unwrap_or_default();
        RunReport {
            stop,
            wall,
            vcpus: self.config.vcpus,
            counters: self.stats.snapshot(),
        }
    }

    /// Builds, starts and waits.
    pub fn run(config: VmConfig) -> Result<RunReport, VmmError> {
        let mut vm = Vm::build(config)?;
        vm.start()?;
        Ok(vm.wait())
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
    pub fn ram(&self) -> &GuestRam {
        &self.ram
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
    /// Things the user should know before the guest runs (e.g. emulated guest kernel code).
    pub fn warnings(&self) -> &[String] {
        &self.warnings
    }
    /// Asks the VM to stop, as SIGTERM would.
    pub fn stop(&self, reason: StopReason) {
        self.lifecycle.stop(reason)
    }
}

/// IOAPIC pins 16-23 carry PCI INTx (the ISA IRQs keep 0-15); devices share them round-robin.
const PCI_INTX_FIRST_GSI: u32 = 16;
const PCI_INTX_PINS: u32 = 8;

/// Builds the PCI root complex (0xCF8 ports and ECAM), then each configured virtio device on its
/// rung, attached in order from slot 1.
#[allow(clippy::too_many_arguments)]
fn attach_pci(
    config: &VmConfig,
    kvm: &lucid_hv::Kvm,
    vm: &lucid_hv::Vm,
    ram: &GuestRam,
    dma: &Arc<DmaPath>,
    hooks: &Arc<ExitHooks>,
    stats: &Arc<StatsRegistry>,
    warnings: &mut Vec<String>,
) -> Result<PciBus, VmmError> {
    use lucid_pci::{HostCaps, PciWindows, TransportEnv, TransportOptions};

    let pci_err = |e: lucid_pci::PciError| VmmError::Device(format!("PCI: {e}"));
    let host = HostCaps::probe(
        config.pci.iter().map(|d| d.rung),
        lucid_hv::probe::posted_interrupts_available,
        || lucid_hv::probe::cpuid_intercepted(kvm).unwrap_or(false),
    );
    let router = lucid_hv::GsiRouter::new(vm.clone());
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
    root.register().map_err(pci_err)?;
    let env = TransportEnv {
        vm: vm.clone(),
        router: router.clone(),
        mem: ram.memory().clone(),
        dma: dma.clone(),
        stats: stats.clone(),
        host,
    };
    let (mut nblk, mut nnet) = (0, 0);
    let mut devices = Vec::new();
    for (i, d) in config.pci.iter().enumerate() {
        let device: Box<dyn lucid_virtio::VirtioDevice> = match &d.kind {
            crate::config::PciDeviceKind::Block(b) => {
                let name = format!("blk{nblk}");
                nblk += 1;
                Box::new(
                    lucid_virtio::blk::Block::new(name.clone(), b.clone())
                        .map_err(|e| VmmError::Device(format!("{name}: {e}")))?,
                )
            }
            crate::config::PciDeviceKind::Net(n) => {
                let name = format!("net{nnet}");
                nnet += 1;
                Box::new(
                    lucid_virtio::net::Net::new(name.clone(), n.clone())
                        .map_err(|e| VmmError::Device(format!("{name}: {e}")))?,
                )
            }
        };
        let name = device.name().to_string();
        let opts = TransportOptions {
            rung: d.rung,
            coalescing: d.coalescing,
            poll_idle_us: d.poll_idle_us,
            intx_gsi: Some(PCI_INTX_FIRST_GSI + i as u32 % PCI_INTX_PINS),
        };
        let (addr, dev) = lucid_pci::attach_virtio(&root, device, env.clone(), opts)
            .map_err(|e| VmmError::Device(format!("{name}: {e}")))?;
        if let Some(w) = lock_transport(&dev).plan().warning() {
            warnings.push(format!("{name}: {w}"));
        }
        devices.push((name, addr, dev));
    }
    Ok(PciBus {
        root,
        router,
        devices,
    })
}

fn lock_transport(
    d: &Arc<Mutex<lucid_pci::VirtioPciDevice>>,
) -> std::sync::MutexGuard<'_, lucid_pci::VirtioPciDevice> {
    d.lock().unwrap_or_else(|e| e.into_inner())
}

fn dev_err(what: &'static str) -> impl Fn(std::io::Error) -> VmmError {
    move |e| VmmError::Device(format!("{what}: {e}"))
}

fn check_config(c: &VmConfig) -> Result<(), VmmError> {
    if c.vcpus == 0 || c.vcpus > MAX_VCPUS {
        return Err(VmmError::Config(format!(
            "--vcpus {} is out of range 1..={MAX_VCPUS}",
            c.vcpus
        )));
    }
    if c.mem_mib < MIN_MEM_MIB || c.mem_mib > MAX_MEM_MIB {
        return Err(VmmError::Config(format!(
            "--memory {} MiB is out of range {MIN_MEM_MIB}..={MAX_MEM_MIB}",
            c.mem_mib
        )));
    }
    if c.cmdline.contains('\0') {
        return Err(VmmError::Config(
            "the command line contains a NUL byte".into(),
        ));
    }
    Ok(())
}

/// The command line the kernel gets: Linux gets a console by default, and on a host that emulates
/// guest kernel code the switches that avoid instructions KVM cannot emulate.
fn kernel_cmdline(user: &str, linux: bool, backend: Backend, warnings: &mut Vec<String>) -> String {
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
        warnings.push(format!(
            "this host's KVM is PVM: guest kernel code is emulated (thousands of times slower than \
             native), so Linux boots slowly; added `{PVM_LINUX_CMDLINE}` to the command line"
        ));
    }
    cmdline
}

/// The ioeventfd behind `ports::IOEVENTFD_PROBE`: writes there never leave the kernel. A stats
/// probe drains the eventfd, so the count of absorbed writes is still reported.
fn ioeventfd_probe(vm: &lucid_hv::Vm, stats: &Arc<StatsRegistry>) -> Result<EventFd, VmmError> {
    let evt = EventFd::new(EFD_NONBLOCK).map_err(dev_err("ioeventfd"))?;
    vm.register_ioeventfd(&evt, IoAddr::Pio(ports::IOEVENTFD_PROBE))?;
    let reader = evt.try_clone().map_err(dev_err("ioeventfd"))?;
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

/// LINT0 as ExtINT and LINT1 as NMI, the virtual-wire setup firmware leaves for an OS.
fn set_lint_virtual_wire(vcpu: &lucid_hv::Vcpu) -> Result<(), VmmError> {
    const LVT_LINT0: usize = 0x350;
    const LVT_LINT1: usize = 0x360;
    const DM_EXTINT: u32 = 0x7 << 8;
    const DM_NMI: u32 = 0x4 << 8;
    let mut lapic = vcpu.get_lapic()?;
    let mut set = |off: usize, mode: u32| {
        let b = &mut lapic.regs[off..off + 4];
        let v = u32::from_le_bytes([b[0] as u8, b[1] as u8, b[2] as u8, b[3] as u8]);
        let v = (v & !0x700) | mode;
        for (i, byte) in v.to_le_bytes().iter().enumerate() {
            b[i] = *byte as _;
        }
    };
    set(LVT_LINT0, DM_EXTINT);
    set(LVT_LINT1, DM_NMI);
    vcpu.set_lapic(&lapic)?;
    Ok(())
}

extern "C" fn kick_handler(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {}

/// The vCPU kick signal only needs to interrupt KVM_RUN; its handler does nothing.
fn install_kick_handler() {
    let _ = vmm_sys_util::signal::register_signal_handler(
        vmm_sys_util::signal::SIGRTMIN(),
        kick_handler,
    );
}

/// SIGINT and SIGTERM stop the VM cleanly: they are blocked in every thread and taken by one
/// thread with sigwait. Called before the vCPU threads start, so they inherit the mask.
fn watch_stop_signals(lifecycle: Arc<Lifecycle>, seccomp: Option<lucid_seccomp::Seccomp>) {
    // SAFETY: sigset manipulation on a local set, and pthread_sigmask on the calling thread.
    let set = unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        set
    };
    let _ = std::thread::Builder::new()
        .name("lucid-signals".into())
        .spawn(move || {
            if let Err(e) = lucid_seccomp::confine(seccomp.as_ref(), Role::Main) {
                return lifecycle.stop(StopReason::Error(e.to_string()));
            }
            let mut sig: libc::c_int = 0;
            // SAFETY: sigwait on a valid set with a valid out pointer.
            if unsafe { libc::sigwait(&set, &mut sig) } == 0 {
                lifecycle.stop(StopReason::Signal(sig));
            }
        });
}
