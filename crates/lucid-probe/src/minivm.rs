//! A minimal 64-bit VM: one vCPU, identity-mapped guest RAM, long mode entered directly at CPL0
//! or CPL3, a code blob, and a `KVM_RUN` loop that hands every exit to a closure.
//!
//! This is the harness of the host probe: a guest loop whose only cost per exit is KVM itself
//! plus a closure that re-enters at once. It is built from the same pieces as every Lucid VM
//! (the first stage of `lucid_vmm::VmBuilder`): a [`lucid_hv::Vm`] with a [`GuestRam`] mapped
//! into it, and a [`lucid_hv::Vcpu`] whose segments are encoded by `lucid_boot::regs`. It has no
//! interrupt controller, no devices and no kernel.
//!
//! Guest-physical layout (everything identity-mapped, virtual == physical):
//!
//! | range                 | use                                                             |
//! |-----------------------|-----------------------------------------------------------------|
//! | `0x1000`              | PML4                                                            |
//! | `0x2000`              | PDPT                                                            |
//! | `0x3000..0x7000`      | four page directories: 2 MiB pages covering the low 4 GiB       |
//! | `0x8000..0x9000`      | parameter page ([`MiniVm::PARAM_ADDR`]), free for the caller    |
//! | `0x10000..`           | code ([`MiniVm::CODE_ADDR`]) and anything else the caller puts  |
//! | `..mem_bytes`         | stack grows down from the top of RAM                            |
//! | `mem_bytes..4 GiB`    | mapped in the page tables but not backed: MMIO exits            |
//!
//! All page-table entries carry the U/S bit, so CPL3 code can touch all of it (Lucid's boot page
//! tables do not: they are for kernels); entries beyond RAM are also cache-disabled (PCD).
//!
//! There is no GDT, IDT or TSS in guest memory: the hidden segment state is loaded directly with
//! `KVM_SET_SREGS`, and interrupts stay disabled. Any guest exception therefore triple-faults and
//! shows up as a `Shutdown` exit. Guests that need interrupts build their own tables.

use std::sync::Arc;
use std::time::{Duration, Instant};

use lucid_boot::regs::{gdt_entry, segment_from_gdt};
use lucid_hv::kvm_bindings::{kvm_regs, kvm_segment, CpuId};
use lucid_hv::{Exit, Kvm, Vcpu, Vm};
use lucid_mem::{Backing, GuestRam};
use vm_memory::{Bytes, GuestAddress};

use super::ProbeError;

/// Privilege level the guest code starts in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum CpuMode {
    /// Ring 0, 64-bit. Under PVM every instruction is emulated (thousands of times slower).
    Kernel,
    /// Ring 3, 64-bit, IOPL=3 so `in`/`out` work without a TSS bitmap. Native speed everywhere.
    User,
}

/// What the exit handler wants the run loop to do next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flow {
    /// Re-enter the guest.
    Continue,
    /// Return from [`MiniVm::run`].
    Stop,
}

/// Result of one [`MiniVm::run`].
#[derive(Debug, Clone, Copy)]
pub struct RunOutcome {
    /// Number of times `KVM_RUN` returned to userspace (including the last one, and `EINTR`s).
    pub exits: u64,
    /// Host `CLOCK_MONOTONIC` time from just before the first `KVM_RUN` to the return of the
    /// handler that said [`Flow::Stop`].
    pub elapsed: Duration,
}

/// A one-vCPU VM in 64-bit mode with identity paging. See the module documentation for the layout.
pub struct MiniVm {
    vcpu: Vcpu,
    vm: Vm,
    /// Guest RAM; the VM keeps its own clone of the mapping for as long as its slots exist.
    ram: GuestRam,
    mem_bytes: usize,
    mode: CpuMode,
}

const PML4_ADDR: u64 = 0x1000;
const PDPT_ADDR: u64 = 0x2000;
const PD_ADDR: u64 = 0x3000;
const PTE_P: u64 = 1;
const PTE_RW: u64 = 1 << 1;
const PTE_US: u64 = 1 << 2;
const PTE_PCD: u64 = 1 << 4;
const PTE_PS: u64 = 1 << 7;
const TWO_MIB: u64 = 2 << 20;

/// Descriptor flags (access byte and flags nibble, as `lucid_boot::regs::gdt_entry` takes them)
/// of the 64-bit code and the data segments at DPL 0 and DPL 3.
const CODE64_DPL0: u16 = 0xa09b; // G, L, P, DPL0, S, execute/read, accessed
const CODE64_DPL3: u16 = 0xa0fb; // G, L, P, DPL3, S, execute/read, accessed
const DATA_DPL0: u16 = 0xc093; // G, D/B, P, DPL0, S, read/write, accessed
const DATA_DPL3: u16 = 0xc0f3; // G, D/B, P, DPL3, S, read/write, accessed

impl MiniVm {
    /// Guest address of a page free for the caller's parameters and results.
    pub const PARAM_ADDR: u64 = 0x8000;
    /// Default guest address for code.
    pub const CODE_ADDR: u64 = 0x1_0000;
    /// Largest supported RAM size (the rest of the low 4 GiB is left for MMIO).
    pub const MAX_MEM: usize = 3 << 30;

    /// Creates the VM with KVM's supported CPUID on the vCPU.
    pub fn new(kvm: &Arc<Kvm>, mem_bytes: usize, mode: CpuMode) -> Result<Self, ProbeError> {
        let cpuid = lucid_hv::supported_cpuid(kvm)?;
        Self::with_cpuid(kvm, mem_bytes, mode, &cpuid)
    }

    /// Creates the VM with `cpuid` given to the vCPU (`KVM_SET_CPUID2`) before anything else.
    ///
    /// `mem_bytes` must be a non-zero multiple of 2 MiB, at most [`MiniVm::MAX_MEM`]. The vCPU
    /// starts at [`MiniVm::CODE_ADDR`] with the stack at the top of RAM; load code there with
    /// [`MiniVm::load_code`] or move the entry with [`MiniVm::set_entry`].
    pub fn with_cpuid(
        kvm: &Arc<Kvm>,
        mem_bytes: usize,
        mode: CpuMode,
        cpuid: &CpuId,
    ) -> Result<Self, ProbeError> {
        if mem_bytes == 0 || mem_bytes & (TWO_MIB as usize - 1) != 0 || mem_bytes > Self::MAX_MEM {
            return Err(ProbeError::BadRamSize { bytes: mem_bytes });
        }
        let vm = Vm::new(kvm.clone())?;
        let ram = GuestRam::new(&[(0, mem_bytes as u64)], Backing::Anonymous)?;
        vm.map_memory(ram.memory())?;
        let vcpu = vm.create_vcpu(0)?;
        vcpu.set_cpuid(cpuid)?;
        let mut mini = Self {
            vcpu,
            vm,
            ram,
            mem_bytes,
            mode,
        };
        mini.write_page_tables()?;
        mini.set_long_mode_sregs()?;
        mini.set_entry(Self::CODE_ADDR)?;
        Ok(mini)
    }

    fn write_page_tables(&mut self) -> Result<(), ProbeError> {
        let mem = self.mem_bytes as u64;
        let table = PTE_P | PTE_RW | PTE_US;
        self.write_u64(PML4_ADDR, PDPT_ADDR | table)?;
        for gb in 0..4u64 {
            let pd = PD_ADDR + gb * 0x1000;
            self.write_u64(PDPT_ADDR + gb * 8, pd | table)?;
            let pdes: Vec<u8> = (0..512u64)
                .flat_map(|i| {
                    let addr = (gb << 30) + i * TWO_MIB;
                    let pcd = if addr >= mem { PTE_PCD } else { 0 };
                    (addr | PTE_P | PTE_RW | PTE_US | PTE_PS | pcd).to_le_bytes()
                })
                .collect();
            self.write(pd, &pdes)?;
        }
        Ok(())
    }

    fn set_long_mode_sregs(&self) -> Result<(), ProbeError> {
        let mut s = self.vcpu.get_sregs()?;
        let (code_flags, data_flags, cs_sel, ds_sel) = match self.mode {
            CpuMode::Kernel => (CODE64_DPL0, DATA_DPL0, 0x08u16, 0x10u16),
            CpuMode::User => (CODE64_DPL3, DATA_DPL3, 0x2b, 0x23),
        };
        let data = segment_from_gdt(gdt_entry(data_flags, 0, 0xfffff), ds_sel);
        s.cs = segment_from_gdt(gdt_entry(code_flags, 0, 0xfffff), cs_sel);
        s.ds = data;
        s.es = data;
        s.fs = data;
        s.gs = data;
        s.ss = data;
        s.tr = kvm_segment {
            base: 0,
            limit: 0x67,
            selector: 0x18,
            type_: 11, // busy 64-bit TSS
            present: 1,
            ..Default::default()
        };
        s.cr3 = PML4_ADDR;
        s.cr4 = 1 << 5; // PAE
        s.cr0 = 0x8000_0011; // PG | ET | PE
        s.efer = 0x500; // LMA | LME
        Ok(self.vcpu.set_sregs(&s)?)
    }

    /// Resets the general registers: `rip = entry`, `rsp` = top of RAM, RFLAGS with IOPL=3 in
    /// user mode, everything else zero. Only call it between runs that ended on an exit the
    /// guest does not need completed (or before the first run).
    pub fn set_entry(&self, entry: u64) -> Result<(), ProbeError> {
        let regs = kvm_regs {
            rip: entry,
            rsp: self.mem_bytes as u64,
            rflags: match self.mode {
                CpuMode::Kernel => 0x2,
                CpuMode::User => 0x3002,
            },
            ..Default::default()
        };
        Ok(self.vcpu.set_regs(&regs)?)
    }

    /// Copies `code` into guest memory at `addr`.
    pub fn load_code(&mut self, addr: u64, code: &[u8]) -> Result<(), ProbeError> {
        self.write(addr, code)
    }

    /// Writes `bytes` at guest-physical `addr`.
    pub fn write(&mut self, addr: u64, bytes: &[u8]) -> Result<(), ProbeError> {
        self.check_range(addr, bytes.len())?;
        self.ram
            .memory()
            .write_slice(bytes, GuestAddress(addr))
            .map_err(|_| self.outside(addr, bytes.len()))
    }

    /// Reads `buf.len()` bytes at guest-physical `addr`.
    pub fn read(&self, addr: u64, buf: &mut [u8]) -> Result<(), ProbeError> {
        self.check_range(addr, buf.len())?;
        let len = buf.len();
        self.ram
            .memory()
            .read_slice(buf, GuestAddress(addr))
            .map_err(|_| self.outside(addr, len))
    }

    /// Writes a little-endian `u32` at guest-physical `addr`.
    pub fn write_u32(&mut self, addr: u64, value: u32) -> Result<(), ProbeError> {
        self.write(addr, &value.to_le_bytes())
    }

    fn write_u64(&mut self, addr: u64, value: u64) -> Result<(), ProbeError> {
        self.write(addr, &value.to_le_bytes())
    }

    fn check_range(&self, addr: u64, len: usize) -> Result<(), ProbeError> {
        match addr.checked_add(len as u64) {
            Some(end) if end <= self.mem_bytes as u64 => Ok(()),
            _ => Err(self.outside(addr, len)),
        }
    }

    fn outside(&self, addr: u64, len: usize) -> ProbeError {
        ProbeError::OutsideRam {
            addr,
            len,
            ram: self.mem_bytes,
        }
    }

    /// Size of guest RAM in bytes.
    pub fn mem_bytes(&self) -> usize {
        self.mem_bytes
    }

    /// Privilege level the guest runs in.
    pub fn mode(&self) -> CpuMode {
        self.mode
    }

    /// The VM, e.g. to register ioeventfds or irqfds.
    pub fn vm(&self) -> &Vm {
        &self.vm
    }

    /// The vCPU.
    pub fn vcpu(&self) -> &Vcpu {
        &self.vcpu
    }

    /// The vCPU's general registers.
    pub fn regs(&self) -> Result<kvm_regs, ProbeError> {
        Ok(self.vcpu.get_regs()?)
    }

    /// Runs the vCPU, handing every exit to `on_exit`, until it returns [`Flow::Stop`] or an
    /// error. An interrupted `KVM_RUN` (`EINTR`) counts as an exit and re-enters. Fails with
    /// [`ProbeError::TooManyExits`] after `max_exits` exits without a stop.
    pub fn run<F>(&mut self, max_exits: u64, mut on_exit: F) -> Result<RunOutcome, ProbeError>
    where
        F: FnMut(Exit<'_>) -> Result<Flow, ProbeError>,
    {
        let start = Instant::now();
        let mut exits = 0u64;
        loop {
            if exits >= max_exits {
                return Err(ProbeError::TooManyExits { max_exits });
            }
            exits += 1;
            match self.vcpu.run()? {
                Exit::Interrupted => {}
                exit => {
                    if on_exit(exit)? == Flow::Stop {
                        return Ok(RunOutcome {
                            exits,
                            elapsed: start.elapsed(),
                        });
                    }
                }
            }
        }
    }
}
