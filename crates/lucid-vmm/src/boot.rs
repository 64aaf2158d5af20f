//! The boot stage of [`crate::Vm::build`]: the kernel image, its command line (what Linux needs
//! on this host and with a vIOMMU), the ACPI tables that describe the VM's devices, and Lucid's
//! CPUID edits for each vCPU.

use std::path::Path;

use lucid_boot::layout;
use lucid_boot::{AcpiConfig, BootSetup, KernelImage};
use lucid_hv::Backend;

use crate::builder::{KernelLoad, VmBuilder};
use crate::config::{KernelSource, VmConfig};
use crate::VmmError;

/// Kernel command-line switches that keep Linux off the instructions KVM's emulator lacks on a
/// host that emulates guest kernel code (PLATFORM.md): CX16, XSAVE and AVX (141, 154, 156), and
/// SSSE3 (137), whose absence sends the kernel's SIMD code (the BLAKE2s self-test at boot) to
/// plain C that KVM emulates without an exit per instruction (docs/linux.md, run C).
pub const PVM_LINUX_CMDLINE: &str = "noxsave clearcpuid=137,141,154,156";
/// The console line Linux gets when the user gives none.
pub const DEFAULT_LINUX_CMDLINE: &str = "console=ttyS0 earlyprintk=serial reboot=k panic=-1";

/// Loads the kernel `config` names with its initrd, its command line and ACPI tables that
/// describe the PCI bus (`pci`), the vIOMMU (`iommu`) and fw_cfg, which gets the command line;
/// returns the boot vCPU's entry state.
pub(crate) fn load_kernel(
    b: &VmBuilder,
    config: &VmConfig,
    pci: bool,
    iommu: bool,
    fw_cfg: Option<&std::sync::Mutex<lucid_devices::FwCfg>>,
) -> Result<BootSetup, VmmError> {
    let image = match &config.payload.kernel {
        KernelSource::File(p) => KernelImage::open(p)?,
        KernelSource::Builtin { name, bytes } => {
            KernelImage::from_bytes(Path::new(&format!("<built-in {name}>")), bytes.to_vec())?
        }
    };
    let mut cmdline = kernel_cmdline(&config.payload.cmdline, image.is_linux(), b.backend());
    if iommu && image.is_linux() {
        cmdline = crate::iommu::linux_cmdline(cmdline);
    }
    log::debug!("kernel command line: {cmdline:?}");
    let mut acpi = AcpiConfig::new(config.machine.vcpus);
    if let Some(f) = fw_cfg {
        f.lock()
            .unwrap_or_else(|e| e.into_inner())
            .set_cmdline(&cmdline);
        acpi.fw_cfg = true;
    }
    if pci {
        let last_bus = ((layout::PCI_ECAM_SIZE >> 20) - 1).min(255) as u8;
        acpi.pci_ecam = Some((layout::PCI_ECAM_START, 0, last_bus));
        acpi.hotplug = config.devices.hotplug;
    }
    if iommu {
        acpi.dmar = Some(lucid_boot::DmarUnit {
            base: lucid_iommu::VTD_BASE,
            pages: (lucid_iommu::VTD_SIZE >> 12) as u32,
        });
    }
    b.load_kernel(&KernelLoad {
        image: &image,
        initrd: config.payload.initrd.as_deref(),
        cmdline: &cmdline,
        acpi: Some(&acpi),
    })
}

/// The command line the kernel gets: Linux gets a console by default, and on a host that emulates
/// guest kernel code the switches that avoid instructions KVM cannot emulate.
pub(crate) fn kernel_cmdline(user: &str, linux: bool, backend: Backend) -> String {
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

/// Lucid's edits to the CPUID KVM supports, per vCPU: PV EOI only when the ladder offers it,
/// and the symbiotic leaves (0x40000100/0x40000101) only with `--symbiotic`.
pub(crate) fn edit_vcpu_cpuid(
    cpuid: &mut lucid_hv::kvm_bindings::CpuId,
    offer_pv_eoi: bool,
    symbiotic: bool,
) {
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
