//! Host probe: which KVM backend `/dev/kvm` is, what it offers, whether CPUID is intercepted, and
//! what exits and guest code cost here, measured in tiny VMs ([`MiniVm`]). `lucid probe` prints
//! its report; the VMM asks it one question ([`cpuid_intercepted`], for the ladder's L2).
//!
//! Opening the device and naming the backend are facts of the KVM seam
//! (`lucid_hv::host`); this crate runs guests to measure the rest.

#![warn(clippy::print_stdout, clippy::print_stderr)]

pub mod codebuf;
pub mod measure;
pub mod minivm;

use std::collections::BTreeMap;
use std::fmt;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use lucid_hv::host::{self, Backend, KvmOpenError};
use lucid_hv::kvm_bindings::*;
use lucid_hv::{Exit, HvError, Kvm};

pub use codebuf::CodeBuf;
pub use minivm::{CpuMode, Flow, MiniVm, RunOutcome};

use measure::{LoopBody, LoopVm};

/// What went wrong in the probe or in a [`MiniVm`].
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    /// `/dev/kvm` could not be opened.
    #[error(transparent)]
    Open(#[from] KvmOpenError),
    /// A KVM ioctl failed.
    #[error(transparent)]
    Hv(#[from] HvError),
    /// Guest RAM could not be mapped.
    #[error(transparent)]
    Mem(#[from] lucid_mem::MemError),
    #[error("cannot create an eventfd")]
    EventFd(#[source] std::io::Error),
    /// The guest exited in a way the probe did not expect.
    #[error("{probe}: unexpected vCPU exit {exit}")]
    UnexpectedExit {
        probe: &'static str,
        /// The exit's reason and, for I/O and MMIO, its port or address.
        exit: String,
    },
    /// The guest kept exiting without ever finishing.
    #[error("guest did not finish within {max_exits} exits")]
    TooManyExits { max_exits: u64 },
    #[error(
        "mini VM: guest RAM of {bytes} bytes must be a non-zero multiple of 2 MiB up to 3 GiB"
    )]
    BadRamSize { bytes: usize },
    #[error("mini VM: guest access at {addr:#x}+{len:#x} is outside RAM of {ram:#x} bytes")]
    OutsideRam { addr: u64, len: usize, ram: usize },
    #[error("KVM_GET_SUPPORTED_CPUID has no leaf 1")]
    NoCpuidLeaf1,
}

impl ProbeError {
    /// An exit a guest program did not expect.
    pub fn unexpected_exit(probe: &'static str, exit: &Exit<'_>) -> Self {
        let exit = match exit {
            Exit::IoIn(p, _) | Exit::IoOut(p, _) => format!("{} port {p:#x}", exit.kind()),
            Exit::MmioRead(a, _) | Exit::MmioWrite(a, _) => format!("{} {a:#x}", exit.kind()),
            Exit::Other(what) => format!("other ({what})"),
            e => e.kind().to_string(),
        };
        Self::UnexpectedExit { probe, exit }
    }
}

/// Host facts that explain the backend: modules, CPU flags, kernel.
#[derive(Debug, Clone, serde::Serialize)]
pub struct HostInfo {
    /// Kernel release (`/proc/sys/kernel/osrelease`).
    pub kernel: String,
    /// Which of `kvm`, `kvm_intel`, `kvm_amd`, `kvm_pvm` are in `/sys/module`.
    pub kvm_modules: Vec<String>,
    /// `/proc/cpuinfo` lists `vmx`.
    pub cpu_vmx: bool,
    /// `/proc/cpuinfo` lists `svm`.
    pub cpu_svm: bool,
    /// `/proc/cpuinfo` lists `hypervisor` (this host is itself a guest).
    pub cpu_hypervisor: bool,
    /// Online CPUs.
    pub cpus: usize,
}

fn host_info() -> HostInfo {
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_string())
        .unwrap_or_default();
    let kvm_modules = ["kvm", "kvm_intel", "kvm_amd", "kvm_pvm"]
        .iter()
        .filter(|m| Path::new("/sys/module").join(m).exists())
        .map(|m| m.to_string())
        .collect();
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let flags: Vec<&str> = cpuinfo
        .lines()
        .find(|l| l.starts_with("flags"))
        .and_then(|l| l.split_once(':'))
        .map(|(_, f)| f.split_whitespace().collect())
        .unwrap_or_default();
    HostInfo {
        kernel,
        kvm_modules,
        cpu_vmx: flags.contains(&"vmx"),
        cpu_svm: flags.contains(&"svm"),
        cpu_hypervisor: flags.contains(&"hypervisor"),
        cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
    }
}

/// Probe settings.
#[derive(Debug, Clone, Copy, Default)]
pub struct ProbeOptions {
    /// Fewer operations and repetitions: the whole probe in well under 2 s (for tests).
    pub quick: bool,
}

/// One CPUID leaf's four registers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct CpuidLeaf {
    pub eax: u32,
    pub ebx: u32,
    pub ecx: u32,
    pub edx: u32,
}

/// The CPUID interception check in one mode.
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct CpuidSeen {
    /// Privilege level the guest ran `cpuid` at.
    pub mode: CpuMode,
    /// Leaf 1 given to `KVM_SET_CPUID2`.
    pub set: CpuidLeaf,
    /// Leaf 1 the guest read.
    pub seen: CpuidLeaf,
    /// The guest read the APIC ID (EBX[31:24]) that was set.
    pub apic_id_matches: bool,
    /// The feature bits cleared in ECX (CX16, XSAVE, AVX) read as cleared.
    pub features_match: bool,
    /// The guest saw what was set (APIC ID and cleared features), not the host's leaf.
    pub intercepted: bool,
}

/// Everything the probe found. `Display` is a human-readable multi-line summary; serialize it
/// for the machine-readable form.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ProbeReport {
    /// "vmx" | "svm" | "pvm" | "unknown".
    pub backend: Backend,
    /// [`Backend::code`].
    pub backend_code: u32,
    pub host: HostInfo,
    pub api_version: i32,
    /// `KVM_CAP_MAX_VCPUS`.
    pub max_vcpus: usize,
    /// `KVM_CAP_NR_VCPUS` (recommended).
    pub nr_vcpus: usize,
    pub nr_memslots: usize,
    pub vcpu_mmap_size: usize,
    /// Capability name → supported. KVM capabilities (on a VM fd), the `x86_disable_exits_*`
    /// bits, KVM paravirtual features KVM offers in CPUID 0x40000001 (`pv_eoi`, `poll_control`,
    /// ...), x2APIC/TSC-deadline in KVM's supported leaf 1, and the APIC virtualization module
    /// parameters (`posted_interrupts` for kvm_intel `enable_apicv`, `avic` for kvm_amd).
    pub capabilities: BTreeMap<String, bool>,
    /// Raw `KVM_CHECK_EXTENSION(KVM_CAP_X86_DISABLE_EXITS)` mask.
    pub x86_disable_exits_mask: u32,
    /// Raw EAX of KVM's supported CPUID 0x40000001.
    pub kvm_pv_features: u32,
    /// `KVM_GET_TSC_KHZ` of a fresh vCPU.
    pub tsc_khz: Option<u32>,
    /// CPUID is intercepted at both CPL3 and CPL0: a guest sees what `KVM_SET_CPUID2` set.
    pub cpuid_intercepted: bool,
    pub cpuid_intercepted_cpl3: bool,
    pub cpuid_intercepted_cpl0: bool,
    /// The host's own leaf 1 and the details of both checks.
    pub cpuid_host_leaf1: CpuidLeaf,
    pub cpuid_cpl3: CpuidSeen,
    pub cpuid_cpl0: CpuidSeen,
    /// CPL3 `out` handled in userspace: one full `KVM_RUN` round trip, µs.
    pub pio_exit_us: f64,
    /// CPL3 store to an unbacked address handled in userspace, µs.
    pub mmio_exit_us: f64,
    /// The same `out` absorbed in the kernel by an ioeventfd, µs (None if unsupported).
    pub ioeventfd_exit_us: Option<f64>,
    /// The same store absorbed in the kernel by an ioeventfd, µs (None if unsupported).
    pub ioeventfd_mmio_exit_us: Option<f64>,
    /// Userspace exits in one ioeventfd run of `exit_ops` operations (1 = all absorbed).
    pub ioeventfd_userspace_exits: Option<u64>,
    /// Operations per exit-cost run.
    pub exit_ops: u32,
    /// `dec ecx; jnz` at CPL3, ns per iteration.
    pub cpl3_ns_per_iter: f64,
    /// The same loop at CPL0, ns per iteration.
    pub cpl0_ns_per_iter: f64,
    pub cpl0_over_cpl3: f64,
    pub cpl3_iters: u32,
    pub cpl0_iters: u32,
    /// Repetitions behind each median.
    pub repetitions: usize,
    pub quick: bool,
    /// Wall time of the whole probe, ms.
    pub probe_ms: f64,
}

impl ProbeReport {
    /// Pretty JSON.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("ProbeReport serializes")
    }
}

/// KVM capabilities checked on a VM fd, by report name.
const CAPS: &[(&str, u32)] = &[
    ("irqchip", KVM_CAP_IRQCHIP),
    ("split_irqchip", KVM_CAP_SPLIT_IRQCHIP),
    ("irqfd", KVM_CAP_IRQFD),
    ("irqfd_resample", KVM_CAP_IRQFD_RESAMPLE),
    ("ioeventfd", KVM_CAP_IOEVENTFD),
    ("ioeventfd_any_length", KVM_CAP_IOEVENTFD_ANY_LENGTH),
    ("irq_routing", KVM_CAP_IRQ_ROUTING),
    ("signal_msi", KVM_CAP_SIGNAL_MSI),
    ("pit2", KVM_CAP_PIT2),
    ("pit_state2", KVM_CAP_PIT_STATE2),
    ("user_memory", KVM_CAP_USER_MEMORY),
    ("set_tss_addr", KVM_CAP_SET_TSS_ADDR),
    ("immediate_exit", KVM_CAP_IMMEDIATE_EXIT),
    ("x86_user_space_msr", KVM_CAP_X86_USER_SPACE_MSR),
    ("x86_msr_filter", KVM_CAP_X86_MSR_FILTER),
    ("x2apic_api", KVM_CAP_X2APIC_API),
    ("x86_disable_exits", KVM_CAP_X86_DISABLE_EXITS),
    ("halt_poll", KVM_CAP_HALT_POLL),
    ("binary_stats_fd", KVM_CAP_BINARY_STATS_FD),
    ("tsc_control", KVM_CAP_TSC_CONTROL),
    ("get_tsc_khz", KVM_CAP_GET_TSC_KHZ),
    ("coalesced_mmio", KVM_CAP_COALESCED_MMIO),
    ("coalesced_pio", KVM_CAP_COALESCED_PIO),
    ("readonly_mem", KVM_CAP_READONLY_MEM),
    ("sync_regs", KVM_CAP_SYNC_REGS),
    ("vcpu_events", KVM_CAP_VCPU_EVENTS),
    ("xsave", KVM_CAP_XSAVE),
    ("xcrs", KVM_CAP_XCRS),
    ("adjust_clock", KVM_CAP_ADJUST_CLOCK),
    ("kvmclock_ctrl", KVM_CAP_KVMCLOCK_CTRL),
    ("mp_state", KVM_CAP_MP_STATE),
];

/// Bits of `KVM_CAP_X86_DISABLE_EXITS`.
const DISABLE_EXITS: &[(&str, u32)] = &[
    ("x86_disable_exits_mwait", KVM_X86_DISABLE_EXITS_MWAIT),
    ("x86_disable_exits_hlt", KVM_X86_DISABLE_EXITS_HLT),
    ("x86_disable_exits_pause", KVM_X86_DISABLE_EXITS_PAUSE),
    ("x86_disable_exits_cstate", KVM_X86_DISABLE_EXITS_CSTATE),
];

/// KVM paravirtual feature bits (CPUID 0x40000001 EAX).
const PV_FEATURES: &[(&str, u32)] = &[
    ("kvmclock", 0),
    ("nop_io_delay", 1),
    ("kvmclock2", 3),
    ("async_pf", 4),
    ("steal_time", 5),
    ("pv_eoi", 6),
    ("pv_unhalt", 7),
    ("pv_tlb_flush", 9),
    ("async_pf_vmexit", 10),
    ("pv_send_ipi", 11),
    ("poll_control", 12),
    ("pv_sched_yield", 13),
    ("async_pf_int", 14),
    ("msi_ext_dest_id", 15),
    ("kvmclock_stable", 24),
];

struct CapsFound {
    caps: BTreeMap<String, bool>,
    disable_exits: u32,
    pv_features: u32,
    tsc_khz: Option<u32>,
}

fn probe_capabilities(kvm: &Arc<Kvm>) -> Result<CapsFound, ProbeError> {
    let vm = lucid_hv::Vm::new(kvm.clone())?;
    let vm = vm.fd();
    let mut caps = BTreeMap::new();
    for &(name, cap) in CAPS {
        caps.insert(name.to_string(), vm.check_extension_raw(cap.into()) > 0);
    }
    let disable_exits = vm
        .check_extension_raw(KVM_CAP_X86_DISABLE_EXITS.into())
        .max(0) as u32;
    for &(name, bit) in DISABLE_EXITS {
        caps.insert(name.to_string(), disable_exits & bit != 0);
    }

    let cpuid = lucid_hv::supported_cpuid(kvm)?;
    let leaf = |f: u32| {
        cpuid
            .as_slice()
            .iter()
            .find(|e| e.function == f && e.index == 0)
            .copied()
    };
    let pv_features = leaf(0x4000_0001).map_or(0, |e| e.eax);
    for &(name, bit) in PV_FEATURES {
        caps.insert(name.to_string(), pv_features & (1 << bit) != 0);
    }
    let leaf1_ecx = leaf(1).map_or(0, |e| e.ecx);
    caps.insert("cpuid_x2apic".to_string(), leaf1_ecx & (1 << 21) != 0);
    caps.insert("cpuid_tsc_deadline".to_string(), leaf1_ecx & (1 << 24) != 0);
    caps.insert(
        "posted_interrupts".to_string(),
        host::module_param(host::APICV_PARAM),
    );
    caps.insert("avic".to_string(), host::module_param(host::AVIC_PARAM));

    let tsc_khz = vm
        .create_vcpu(0)
        .ok()
        .and_then(|vcpu| vcpu.get_tsc_khz().ok());
    Ok(CapsFound {
        caps,
        disable_exits,
        pv_features,
        tsc_khz,
    })
}

/// Runs the whole probe: opens `/dev/kvm`, reads capabilities, checks CPUID interception and
/// measures exit and guest-code costs in [`MiniVm`]s. Quick mode takes well under 2 s.
pub fn run_probe(opts: &ProbeOptions) -> Result<ProbeReport, ProbeError> {
    let started = Instant::now();
    let kvm = Arc::new(host::open_device(host::KVM_PATH)?);
    let backend = host::detect_backend();
    let host = host_info();
    let found = probe_capabilities(&kvm)?;

    let (reps, exit_ops, cpl3_target, cpl0_target) = if opts.quick {
        (3, 100, Duration::from_millis(15), Duration::from_millis(30))
    } else {
        (
            5,
            2000,
            Duration::from_millis(100),
            Duration::from_millis(100),
        )
    };

    // CPUID interception.
    let host_leaf1 = measure::host_leaf1();
    let (set, seen) = measure::cpuid_seen(&kvm, CpuMode::User)?;
    let cpuid_cpl3 = measure::cpuid_result(CpuMode::User, set, seen);
    let (set, seen) = measure::cpuid_seen(&kvm, CpuMode::Kernel)?;
    let cpuid_cpl0 = measure::cpuid_result(CpuMode::Kernel, set, seen);

    // Exit costs, all from CPL3.
    let mut lvm = LoopVm::new(&kvm, CpuMode::User, LoopBody::PortOut)?;
    let (pio_exit_us, _) = measure::exit_cost_us(&mut lvm, exit_ops, reps)?;
    let mut lvm = LoopVm::new(&kvm, CpuMode::User, LoopBody::MmioStore)?;
    let (mmio_exit_us, _) = measure::exit_cost_us(&mut lvm, exit_ops, reps)?;
    let have_ioeventfd = found.caps.get("ioeventfd").copied().unwrap_or(false);
    let (ioeventfd_exit_us, ioeventfd_userspace_exits) = if have_ioeventfd {
        let (mut lvm, _efd) = measure::ioeventfd_vm(&kvm, LoopBody::PortOut)?;
        let (us, exits) = measure::exit_cost_us(&mut lvm, exit_ops, reps)?;
        (Some(us), Some(exits))
    } else {
        (None, None)
    };
    let ioeventfd_mmio_exit_us = if have_ioeventfd {
        let (mut lvm, _efd) = measure::ioeventfd_vm(&kvm, LoopBody::MmioStore)?;
        Some(measure::exit_cost_us(&mut lvm, exit_ops, reps)?.0)
    } else {
        None
    };

    // Guest code speed by privilege level.
    let (cpl3_ns_per_iter, cpl3_iters) =
        measure::loop_ns_per_iter(&kvm, CpuMode::User, cpl3_target, reps)?;
    let (cpl0_ns_per_iter, cpl0_iters) =
        measure::loop_ns_per_iter(&kvm, CpuMode::Kernel, cpl0_target, reps)?;

    Ok(ProbeReport {
        backend,
        backend_code: backend.code(),
        host,
        api_version: kvm.get_api_version(),
        max_vcpus: kvm.get_max_vcpus(),
        nr_vcpus: kvm.get_nr_vcpus(),
        nr_memslots: kvm.get_nr_memslots(),
        vcpu_mmap_size: kvm.get_vcpu_mmap_size().unwrap_or(0),
        capabilities: found.caps,
        x86_disable_exits_mask: found.disable_exits,
        kvm_pv_features: found.pv_features,
        tsc_khz: found.tsc_khz,
        cpuid_intercepted: cpuid_cpl3.intercepted && cpuid_cpl0.intercepted,
        cpuid_intercepted_cpl3: cpuid_cpl3.intercepted,
        cpuid_intercepted_cpl0: cpuid_cpl0.intercepted,
        cpuid_host_leaf1: host_leaf1,
        cpuid_cpl3,
        cpuid_cpl0,
        pio_exit_us,
        mmio_exit_us,
        ioeventfd_exit_us,
        ioeventfd_mmio_exit_us,
        ioeventfd_userspace_exits,
        exit_ops,
        cpl3_ns_per_iter,
        cpl0_ns_per_iter,
        cpl0_over_cpl3: cpl0_ns_per_iter / cpl3_ns_per_iter,
        cpl3_iters,
        cpl0_iters,
        repetitions: reps,
        quick: opts.quick,
        probe_ms: started.elapsed().as_secs_f64() * 1e3,
    })
}

fn yes_no(b: bool) -> &'static str {
    if b {
        "yes"
    } else {
        "no"
    }
}

fn fmt_opt_us(v: Option<f64>) -> String {
    v.map_or_else(|| "n/a".to_string(), |v| format!("{v:.2} us"))
}

impl fmt::Display for ProbeReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let h = &self.host;
        writeln!(
            f,
            "Lucid host probe ({} mode, medians of {})",
            if self.quick { "quick" } else { "full" },
            self.repetitions
        )?;
        writeln!(
            f,
            "  backend         {} (modules: {}; cpu flags: vmx {}, svm {}, hypervisor {})",
            self.backend,
            h.kvm_modules.join(", "),
            yes_no(h.cpu_vmx),
            yes_no(h.cpu_svm),
            yes_no(h.cpu_hypervisor)
        )?;
        writeln!(f, "  host            kernel {}, {} CPUs", h.kernel, h.cpus)?;
        writeln!(
            f,
            "  KVM             API {}, max vCPUs {} (recommended {}), memslots {}, run area {} B, TSC {}",
            self.api_version,
            self.max_vcpus,
            self.nr_vcpus,
            self.nr_memslots,
            self.vcpu_mmap_size,
            self.tsc_khz
                .map_or_else(|| "unknown".to_string(), |k| format!("{k} kHz"))
        )?;
        let yes: Vec<&str> = self
            .capabilities
            .iter()
            .filter(|(_, &v)| v)
            .map(|(k, _)| k.as_str())
            .collect();
        let no: Vec<&str> = self
            .capabilities
            .iter()
            .filter(|(_, &v)| !v)
            .map(|(k, _)| k.as_str())
            .collect();
        writeln!(f, "  supported       {}", yes.join(" "))?;
        writeln!(f, "  not supported   {}", no.join(" "))?;
        for c in [&self.cpuid_cpl3, &self.cpuid_cpl0] {
            writeln!(
                f,
                "  CPUID at {}  intercepted {} (APIC ID as set {}, features as set {}): set leaf 1 ebx={:08x} ecx={:08x}, guest saw ebx={:08x} ecx={:08x} (host ebx={:08x} ecx={:08x})",
                if c.mode == CpuMode::User { "CPL3" } else { "CPL0" },
                yes_no(c.intercepted),
                yes_no(c.apic_id_matches),
                yes_no(c.features_match),
                c.set.ebx,
                c.set.ecx,
                c.seen.ebx,
                c.seen.ecx,
                self.cpuid_host_leaf1.ebx,
                self.cpuid_host_leaf1.ecx
            )?;
        }
        writeln!(
            f,
            "  CPUID           {}",
            if self.cpuid_intercepted {
                "intercepted: guests see what KVM_SET_CPUID2 sets"
            } else {
                "NOT intercepted: guests may see the host's CPUID whatever the VMM sets"
            }
        )?;
        writeln!(
            f,
            "  exit costs      ({} ops per run, guest at CPL3)",
            self.exit_ops
        )?;
        writeln!(f, "    PIO  to userspace   {:.2} us", self.pio_exit_us)?;
        writeln!(f, "    MMIO to userspace   {:.2} us", self.mmio_exit_us)?;
        writeln!(
            f,
            "    PIO  via ioeventfd  {} (userspace exits per run: {})",
            fmt_opt_us(self.ioeventfd_exit_us),
            self.ioeventfd_userspace_exits
                .map_or_else(|| "n/a".to_string(), |e| e.to_string())
        )?;
        writeln!(
            f,
            "    MMIO via ioeventfd  {}",
            fmt_opt_us(self.ioeventfd_mmio_exit_us)
        )?;
        writeln!(f, "  guest code      dec ecx; jnz loop")?;
        writeln!(
            f,
            "    CPL3  {:.3} ns/iter ({} iters per run)",
            self.cpl3_ns_per_iter, self.cpl3_iters
        )?;
        writeln!(
            f,
            "    CPL0  {:.3} ns/iter ({} iters per run)",
            self.cpl0_ns_per_iter, self.cpl0_iters
        )?;
        writeln!(f, "    CPL0/CPL3  {:.0}x", self.cpl0_over_cpl3)?;
        write!(f, "  probe took {:.0} ms", self.probe_ms)
    }
}

/// Whether a guest at CPL3 reads the CPUID that `KVM_SET_CPUID2` set (one tiny VM, a few ms).
/// PV features offered in CPUID (PV EOI: the exit ladder's L2) only reach guests where it is.
pub fn cpuid_intercepted(kvm: &Arc<Kvm>) -> Result<bool, ProbeError> {
    let (set, seen) = measure::cpuid_seen(kvm, CpuMode::User)?;
    Ok(measure::cpuid_result(CpuMode::User, set, seen).intercepted)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quick_probe_on_real_kvm() {
        let t = Instant::now();
        let r = run_probe(&ProbeOptions { quick: true }).expect("probe runs");
        eprintln!("{r}");
        assert!(t.elapsed() < Duration::from_secs(10));
        assert_eq!(r.backend, Backend::Pvm);
        assert_eq!(r.api_version, 12);
        assert!(
            !r.cpuid_intercepted,
            "PLATFORM.md: CPUID not intercepted here"
        );
        assert!(!r.cpuid_intercepted_cpl3);
        assert!(r.pio_exit_us > 0.0);
        assert!(r.mmio_exit_us > 0.0);
        assert!(r.ioeventfd_exit_us.unwrap() > 0.0);
        assert_eq!(
            r.ioeventfd_userspace_exits,
            Some(1),
            "ioeventfd absorbs every out"
        );
        assert!(r.cpl3_ns_per_iter > 0.0);
        assert!(r.cpl0_ns_per_iter > r.cpl3_ns_per_iter);
        assert!(r.capabilities["ioeventfd"]);
        assert!(r.capabilities["irqfd"]);
        assert!(r.capabilities["binary_stats_fd"]);

        let json: serde_json::Value = serde_json::from_str(&r.to_json()).unwrap();
        for key in [
            "backend",
            "capabilities",
            "cpuid_intercepted",
            "pio_exit_us",
            "ioeventfd_exit_us",
            "cpl3_ns_per_iter",
            "cpl0_ns_per_iter",
        ] {
            assert!(json.get(key).is_some(), "JSON lacks {key}");
        }
        assert_eq!(json["backend"], "pvm");
        assert!(r.to_string().lines().count() > 5);
    }

    /// `cargo test -p lucid-probe full_probe -- --ignored --nocapture` prints the full report.
    #[test]
    #[ignore = "takes a few seconds; run by hand to see this host's figures"]
    fn full_probe_prints_report() {
        let r = run_probe(&ProbeOptions { quick: false }).expect("probe runs");
        println!("{r}");
        println!("{}", r.to_json());
    }

    #[test]
    fn mini_vm_floor_loop_counts_exits() {
        let kvm = Arc::new(host::open_device(host::KVM_PATH).unwrap());
        let mut lvm = LoopVm::new(&kvm, CpuMode::User, LoopBody::PortOut).unwrap();
        let (_, exits) = lvm.run(10).unwrap();
        assert_eq!(exits, 11, "10 ops + the done marker");
        // The VM loops back by itself: a second run needs no register reset.
        let (_, exits) = lvm.run(3).unwrap();
        assert_eq!(exits, 4);
    }

    #[test]
    fn mini_vm_rejects_bad_layout() {
        let kvm = Arc::new(host::open_device(host::KVM_PATH).unwrap());
        assert!(matches!(
            MiniVm::new(&kvm, 3 << 20, CpuMode::User),
            Err(ProbeError::BadRamSize { .. })
        ));
        let mut vm = MiniVm::new(&kvm, 2 << 20, CpuMode::User).unwrap();
        assert!(vm.write(2 << 20, &[0]).is_err());
        assert!(vm.write((2 << 20) - 1, &[0]).is_ok());
    }
}
