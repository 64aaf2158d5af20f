//! Builds a VM in stages, in the order a VM comes together: KVM and guest RAM, the interrupt
//! controllers, the vCPUs, (the devices, which [`crate::Vm::build`] adds), the kernel and its
//! boot tables, and the boot vCPU's entry registers. `Vm::build` runs every stage; harnesses that drive a vCPU themselves stop after
//! the stage they need: the benchmark floor takes a vCPU and runs it with nothing behind its
//! exits, the boot tests skip the interrupt controllers so that HLT reaches them.

use std::path::Path;
use std::sync::Arc;

use lucid_boot::layout;
use lucid_boot::{AcpiConfig, BootParams, BootSetup, KernelImage};
use lucid_hv::kvm_bindings::CpuId;
use lucid_hv::{detect_backend, Backend, Kvm, Vcpu};
use lucid_mem::{Backing, GuestMemoryMmap, GuestRam};

use crate::VmmError;

/// A VM being built: KVM, the VM and its guest RAM, and what the stages have added so far.
pub struct VmBuilder {
    kvm: Arc<Kvm>,
    vm: lucid_hv::Vm,
    ram: Arc<GuestRam>,
    mem_size: u64,
    backend: Backend,
    irqchip: bool,
}

/// The kernel for [`VmBuilder::load_kernel`] and what goes with it.
#[derive(Clone, Copy)]
pub struct KernelLoad<'a> {
    pub image: &'a KernelImage,
    pub initrd: Option<&'a Path>,
    pub cmdline: &'a str,
    /// ACPI tables to write (and to point the kernel at); `None` writes none.
    pub acpi: Option<&'a AcpiConfig>,
}

impl VmBuilder {
    /// Stage 1: KVM (with the capabilities every Lucid VM needs), a VM, and `mem_size` bytes of
    /// guest RAM with `backing`, laid out as Lucid's PC (`layout::ram_regions`: low RAM, the MMIO
    /// hole, the rest from 4 GiB) and mapped into the VM.
    pub fn new(mem_size: u64, backing: Backing) -> Result<Self, VmmError> {
        let kvm = lucid_hv::open_kvm()?;
        let backend = detect_backend();
        let vm = lucid_hv::Vm::new(kvm.clone())?;
        if backend == Backend::Pvm {
            // Else a KVM hypercall at CPL0 spins in the host kernel forever (docs/linux.md).
            vm.disable_hypercall_patching()?;
        }
        let ram = Arc::new(GuestRam::new(&layout::ram_regions(mem_size), backing)?);
        vm.map_memory(ram.memory())?;
        log::debug!(
            "VM: {} MiB of guest RAM ({:?}), KVM backend {backend}",
            mem_size >> 20,
            ram.backing()
        );
        Ok(VmBuilder {
            kvm,
            vm,
            ram,
            mem_size,
            backend,
            irqchip: false,
        })
    }

    /// Stage 2: the in-kernel PIC, IOAPIC, LAPICs and PIT. Without it a guest's HLT comes back to
    /// userspace (what the boot tests want) and nothing delivers interrupts.
    pub fn irqchip(&mut self) -> Result<(), VmmError> {
        self.vm.create_irqchip_and_pit()?;
        self.irqchip = true;
        Ok(())
    }

    /// Stage 5: the kernel with its initrd and command line, the ACPI tables and the boot
    /// information its protocol wants, placed where the image leaves room. Returns the boot
    /// vCPU's entry state.
    pub fn load_kernel(&self, k: &KernelLoad) -> Result<BootSetup, VmmError> {
        let setup = lucid_boot::load_image(
            self.ram.memory(),
            k.image,
            &BootParams {
                kernel: k.image.path(),
                initrd: k.initrd,
                cmdline: k.cmdline,
                mem_size: self.mem_size,
                acpi: k.acpi,
            },
        )?;
        log::debug!(
            "kernel {}: {:?}, entry {:x?}, ends at {:#x}",
            k.image.path().display(),
            setup.kind,
            setup.entry,
            setup.kernel_end
        );
        Ok(setup)
    }

    /// Stage 3: vCPU `id` of `count`, with KVM's supported CPUID adjusted for it
    /// (`lucid_boot::filter_cpuid`, then `edit_cpuid`), LINT0/LINT1 wired as firmware leaves
    /// them (with the irqchip), and on the boot vCPU (`boot` given) the entry registers.
    pub fn vcpu(
        &self,
        id: u8,
        count: u8,
        boot: Option<&BootSetup>,
        edit_cpuid: impl FnOnce(&mut CpuId),
    ) -> Result<Vcpu, VmmError> {
        let vcpu = self.vm.create_vcpu(id.into())?;
        let mut cpuid = lucid_hv::supported_cpuid(&self.kvm)?;
        lucid_boot::filter_cpuid(&mut cpuid, id, count);
        edit_cpuid(&mut cpuid);
        vcpu.set_cpuid(&cpuid)?;
        if self.irqchip {
            set_lint_virtual_wire(&vcpu)?;
        }
        if let Some(setup) = boot {
            self.boot_vcpu(&vcpu, setup)?;
        }
        Ok(vcpu)
    }

    /// The boot vCPU's entry registers for the kernel [`VmBuilder::load_kernel`] placed, once
    /// the vCPU exists.
    pub fn boot_vcpu(&self, vcpu: &Vcpu, setup: &BootSetup) -> Result<(), VmmError> {
        let (mut regs, mut sregs) = (vcpu.get_regs()?, vcpu.get_sregs()?);
        lucid_boot::setup_boot_regs(&setup.entry, &mut regs, &mut sregs, self.ram.memory())?;
        vcpu.set_sregs(&sregs)?;
        vcpu.set_regs(&regs)?;
        Ok(())
    }

    pub fn kvm(&self) -> &Arc<Kvm> {
        &self.kvm
    }
    pub fn vm(&self) -> &lucid_hv::Vm {
        &self.vm
    }
    /// Guest RAM, shared with whoever gives pages back or remaps them (the balloon, the Swap
    /// Mapper).
    pub fn ram(&self) -> &Arc<GuestRam> {
        &self.ram
    }
    pub fn memory(&self) -> &GuestMemoryMmap {
        self.ram.memory()
    }
    pub fn mem_size(&self) -> u64 {
        self.mem_size
    }
    pub fn backend(&self) -> Backend {
        self.backend
    }

    /// The VM and its RAM, for whoever runs it.
    pub fn finish(self) -> (lucid_hv::Vm, Arc<GuestRam>) {
        (self.vm, self.ram)
    }
}

/// LINT0 as ExtINT and LINT1 as NMI, the virtual-wire setup firmware leaves for an OS.
fn set_lint_virtual_wire(vcpu: &Vcpu) -> Result<(), VmmError> {
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
