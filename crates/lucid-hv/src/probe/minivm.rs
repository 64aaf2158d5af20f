//! A minimal 64-bit VM: one vCPU, identity-mapped guest RAM, long mode entered directly at CPL0
//! or CPL3, a code blob, and a `KVM_RUN` loop that hands every exit to a closure.
//!
//! This is the harness of the host probe and the "floor" of the benchmarks: a guest loop whose only
//! cost per exit is KVM itself plus a closure that re-enters at once.
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
//! All page-table entries carry the U/S bit, so CPL3 code can touch all of it; entries beyond RAM
//! are also cache-disabled (PCD).
//!
//! There is no GDT, IDT or TSS in guest memory: the hidden segment state is loaded directly with
//! `KVM_SET_SREGS`, and interrupts stay disabled. Any guest exception therefore triple-faults and
//! shows up as a `Shutdown` exit. Guests that need interrupts build their own tables.

use std::time::{Duration, Instant};

use kvm_bindings::{
    kvm_regs, kvm_segment, kvm_userspace_memory_region, CpuId, KVM_MAX_CPUID_ENTRIES,
};
use kvm_ioctls::{Kvm, VcpuExit, VcpuFd, VmFd};

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

/// Anonymous shared mapping used as guest RAM. Unmapped on drop.
struct GuestRam {
    ptr: *mut u8,
    len: usize,
}

impl GuestRam {
    fn new(len: usize) -> Result<Self, ProbeError> {
        // SAFETY: anonymous mapping with a null hint; no existing memory is affected. The result
        // is checked against MAP_FAILED before use.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(ProbeError::Mmap {
                size: len,
                source: std::io::Error::last_os_error(),
            });
        }
        Ok(Self {
            ptr: ptr.cast(),
            len,
        })
    }

    fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` is a live mapping of `len` readable bytes owned by `self`. The guest may
        // write to it concurrently only while KVM_RUN runs, which needs `&mut MiniVm`.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`, and `&mut self` makes this the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for GuestRam {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` describe exactly the mapping created in `new`, unmapped only here.
        unsafe {
            libc::munmap(self.ptr.cast(), self.len);
        }
    }
}

/// A one-vCPU VM in 64-bit mode with identity paging. See the module documentation for the layout.
pub struct MiniVm {
    // Field order is drop order: vCPU, then VM, then the RAM the VM's memslot points into.
    vcpu: VcpuFd,
    vm: VmFd,
    ram: GuestRam,
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

impl MiniVm {
    /// Guest address of a page free for the caller's parameters and results.
    pub const PARAM_ADDR: u64 = 0x8000;
    /// Default guest address for code.
    pub const CODE_ADDR: u64 = 0x1_0000;
    /// Largest supported RAM size (the rest of the low 4 GiB is left for MMIO).
    pub const MAX_MEM: usize = 3 << 30;

    /// Creates the VM with KVM's supported CPUID on the vCPU.
    pub fn new(kvm: &Kvm, mem_bytes: usize, mode: CpuMode) -> Result<Self, ProbeError> {
        let cpuid = kvm
            .get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
            .map_err(|e| ProbeError::kvm("KVM_GET_SUPPORTED_CPUID", e))?;
        Self::with_cpuid(kvm, mem_bytes, mode, &cpuid)
    }

    /// Creates the VM with `cpuid` given to the vCPU (`KVM_SET_CPUID2`) before anything else.
    ///
    /// `mem_bytes` must be a non-zero multiple of 2 MiB, at most [`MiniVm::MAX_MEM`]. The vCPU
    /// starts at [`MiniVm::CODE_ADDR`] with the stack at the top of RAM; load code there with
    /// [`MiniVm::load_code`] or move the entry with [`MiniVm::set_entry`].
    pub fn with_cpuid(
        kvm: &Kvm,
        mem_bytes: usize,
        mode: CpuMode,
        cpuid: &CpuId,
    ) -> Result<Self, ProbeError> {
        if mem_bytes == 0 || mem_bytes & (TWO_MIB as usize - 1) != 0 || mem_bytes > Self::MAX_MEM {
            return Err(ProbeError::Layout(format!(
                "guest RAM of {mem_bytes} bytes: must be a non-zero multiple of 2 MiB up to 3 GiB"
            )));
        }
        let vm = kvm
            .create_vm()
            .map_err(|e| ProbeError::kvm("KVM_CREATE_VM", e))?;
        let ram = GuestRam::new(mem_bytes)?;
        let region = kvm_userspace_memory_region {
            slot: 0,
            flags: 0,
            guest_phys_addr: 0,
            memory_size: mem_bytes as u64,
            userspace_addr: ram.ptr as u64,
        };
        // SAFETY: the region describes `ram`, a live mapping of exactly `mem_bytes` bytes that
        // `MiniVm` owns and drops only after the VM fd (field order).
        unsafe { vm.set_user_memory_region(region) }
            .map_err(|e| ProbeError::kvm("KVM_SET_USER_MEMORY_REGION", e))?;
        let vcpu = vm
            .create_vcpu(0)
            .map_err(|e| ProbeError::kvm("KVM_CREATE_VCPU", e))?;
        vcpu.set_cpuid2(cpuid)
            .map_err(|e| ProbeError::kvm("KVM_SET_CPUID2", e))?;

        let mut mini = Self {
            vcpu,
            vm,
            ram,
            mode,
        };
        mini.write_page_tables();
        mini.set_long_mode_sregs()?;
        mini.set_entry(Self::CODE_ADDR)?;
        Ok(mini)
    }

    fn write_page_tables(&mut self) {
        let mem = self.ram.len as u64;
        let table = PTE_P | PTE_RW | PTE_US;
        self.write_u64(PML4_ADDR, PDPT_ADDR | table);
        for gb in 0..4u64 {
            let pd = PD_ADDR + gb * 0x1000;
            self.write_u64(PDPT_ADDR + gb * 8, pd | table);
            for i in 0..512u64 {
                let addr = (gb << 30) + i * TWO_MIB;
                let mut pde = addr | PTE_P | PTE_RW | PTE_US | PTE_PS;
                if addr >= mem {
                    pde |= PTE_PCD;
                }
                self.write_u64(pd + i * 8, pde);
            }
        }
    }

    fn set_long_mode_sregs(&self) -> Result<(), ProbeError> {
        let mut s = self
            .vcpu
            .get_sregs()
            .map_err(|e| ProbeError::kvm("KVM_GET_SREGS", e))?;
        let (dpl, cs_sel, ds_sel) = match self.mode {
            CpuMode::Kernel => (0u8, 0x08u16, 0x10u16),
            CpuMode::User => (3, 0x2b, 0x23),
        };
        let code = kvm_segment {
            base: 0,
            limit: 0xffff_ffff,
            selector: cs_sel,
            type_: 11, // execute/read, accessed
            present: 1,
            dpl,
            db: 0,
            s: 1,
            l: 1,
            g: 1,
            avl: 0,
            unusable: 0,
            padding: 0,
        };
        let data = kvm_segment {
            selector: ds_sel,
            type_: 3, // read/write, accessed
            db: 1,
            l: 0,
            ..code
        };
        s.cs = code;
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
            dpl: 0,
            db: 0,
            s: 0,
            l: 0,
            g: 0,
            avl: 0,
            unusable: 0,
            padding: 0,
        };
        s.cr3 = PML4_ADDR;
        s.cr4 = 1 << 5; // PAE
        s.cr0 = 0x8000_0011; // PG | ET | PE
        s.efer = 0x500; // LMA | LME
        self.vcpu
            .set_sregs(&s)
            .map_err(|e| ProbeError::kvm("KVM_SET_SREGS", e))
    }

    /// Resets the general registers: `rip = entry`, `rsp` = top of RAM, RFLAGS with IOPL=3 in
    /// user mode, everything else zero. Only call it between runs that ended on an exit the
    /// guest does not need completed (or before the first run).
    pub fn set_entry(&self, entry: u64) -> Result<(), ProbeError> {
        let regs = kvm_regs {
            rip: entry,
            rsp: self.ram.len as u64,
            rflags: match self.mode {
                CpuMode::Kernel => 0x2,
                CpuMode::User => 0x3002,
            },
            ..Default::default()
        };
        self.vcpu
            .set_regs(&regs)
            .map_err(|e| ProbeError::kvm("KVM_SET_REGS", e))
    }

    /// Copies `code` into guest memory at `addr`.
    pub fn load_code(&mut self, addr: u64, code: &[u8]) -> Result<(), ProbeError> {
        self.write(addr, code)
    }

    /// Writes `bytes` at guest-physical `addr`.
    pub fn write(&mut self, addr: u64, bytes: &[u8]) -> Result<(), ProbeError> {
        let range = self.range(addr, bytes.len())?;
        self.ram.as_mut_slice()[range].copy_from_slice(bytes);
        Ok(())
    }

    /// Reads `buf.len()` bytes at guest-physical `addr`.
    pub fn read(&self, addr: u64, buf: &mut [u8]) -> Result<(), ProbeError> {
        let range = self.range(addr, buf.len())?;
        buf.copy_from_slice(&self.ram.as_slice()[range]);
        Ok(())
    }

    /// Writes a little-endian `u32` at guest-physical `addr`.
    pub fn write_u32(&mut self, addr: u64, value: u32) -> Result<(), ProbeError> {
        self.write(addr, &value.to_le_bytes())
    }

    fn write_u64(&mut self, addr: u64, value: u64) {
        // Only used for the page tables, which are always in range.
        let a = addr as usize;
        self.ram.as_mut_slice()[a..a + 8].copy_from_slice(&value.to_le_bytes());
    }

    fn range(&self, addr: u64, len: usize) -> Result<std::ops::Range<usize>, ProbeError> {
        let start = usize::try_from(addr).unwrap_or(usize::MAX);
        match start.checked_add(len) {
            Some(end) if end <= self.ram.len => Ok(start..end),
            _ => Err(ProbeError::Layout(format!(
                "guest access at {addr:#x}+{len:#x} is outside RAM of {:#x} bytes",
                self.ram.len
            ))),
        }
    }

    /// Size of guest RAM in bytes.
    pub fn mem_bytes(&self) -> usize {
        self.ram.len
    }

    /// Privilege level the guest runs in.
    pub fn mode(&self) -> CpuMode {
        self.mode
    }

    /// The VM, e.g. to register ioeventfds or irqfds.
    pub fn vm(&self) -> &VmFd {
        &self.vm
    }

    /// The vCPU.
    pub fn vcpu(&self) -> &VcpuFd {
        &self.vcpu
    }

    /// The vCPU, mutably (e.g. for `immediate_exit` or sync regs).
    pub fn vcpu_mut(&mut self) -> &mut VcpuFd {
        &mut self.vcpu
    }

    /// The vCPU's general registers.
    pub fn regs(&self) -> Result<kvm_regs, ProbeError> {
        self.vcpu
            .get_regs()
            .map_err(|e| ProbeError::kvm("KVM_GET_REGS", e))
    }

    /// Runs the vCPU, handing every exit to `on_exit`, until it returns [`Flow::Stop`] or an
    /// error. `KVM_RUN` failing with `EINTR`/`EAGAIN` counts as an exit and re-enters. Fails with
    /// [`ProbeError::TooManyExits`] after `max_exits` exits without a stop.
    pub fn run<F>(&mut self, max_exits: u64, mut on_exit: F) -> Result<RunOutcome, ProbeError>
    where
        F: FnMut(VcpuExit<'_>) -> Result<Flow, ProbeError>,
    {
        let start = Instant::now();
        let mut exits = 0u64;
        loop {
            if exits >= max_exits {
                return Err(ProbeError::TooManyExits { max_exits });
            }
            exits += 1;
            match self.vcpu.run() {
                Ok(exit) => {
                    if on_exit(exit)? == Flow::Stop {
                        return Ok(RunOutcome {
                            exits,
                            elapsed: start.elapsed(),
                        });
                    }
                }
                Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => {}
                Err(e) => return Err(ProbeError::kvm("KVM_RUN", e)),
            }
        }
    }
}

/// A tiny x86-64 assembler: just the instructions the probe and benchmark guests need.
#[derive(Debug, Default, Clone)]
pub struct CodeBuf {
    bytes: Vec<u8>,
}

impl CodeBuf {
    /// An empty buffer.
    pub fn new() -> Self {
        Self::default()
    }

    /// Offset of the next instruction (a label for the jumps).
    pub fn here(&self) -> usize {
        self.bytes.len()
    }

    /// The encoded bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// Appends raw bytes.
    pub fn raw(&mut self, bytes: &[u8]) -> &mut Self {
        self.bytes.extend_from_slice(bytes);
        self
    }

    /// `mov eax, imm32`
    pub fn mov_eax_imm(&mut self, imm: u32) -> &mut Self {
        self.raw(&[0xb8]).raw(&imm.to_le_bytes())
    }

    /// `mov ebx, imm32` (zero-extends into rbx)
    pub fn mov_ebx_imm(&mut self, imm: u32) -> &mut Self {
        self.raw(&[0xbb]).raw(&imm.to_le_bytes())
    }

    /// `mov ecx, imm32`
    pub fn mov_ecx_imm(&mut self, imm: u32) -> &mut Self {
        self.raw(&[0xb9]).raw(&imm.to_le_bytes())
    }

    /// `mov ecx, [abs32]` (the address must be below 2 GiB: it is sign-extended)
    pub fn mov_ecx_from_abs(&mut self, addr: u32) -> &mut Self {
        assert!(addr < 0x8000_0000, "absolute address must be below 2 GiB");
        self.raw(&[0x8b, 0x0c, 0x25]).raw(&addr.to_le_bytes())
    }

    /// `xor ecx, ecx`
    pub fn xor_ecx_ecx(&mut self) -> &mut Self {
        self.raw(&[0x31, 0xc9])
    }

    /// `dec ecx`
    pub fn dec_ecx(&mut self) -> &mut Self {
        self.raw(&[0xff, 0xc9])
    }

    /// `mov [rbx], eax`
    pub fn store_eax_at_rbx(&mut self) -> &mut Self {
        self.raw(&[0x89, 0x03])
    }

    /// `out imm8, al`
    pub fn out_al(&mut self, port: u8) -> &mut Self {
        self.raw(&[0xe6, port])
    }

    /// `cpuid`
    pub fn cpuid(&mut self) -> &mut Self {
        self.raw(&[0x0f, 0xa2])
    }

    /// `hlt`
    pub fn hlt(&mut self) -> &mut Self {
        self.raw(&[0xf4])
    }

    /// `jnz label` (short form; the label must be within -128..127 bytes)
    pub fn jnz(&mut self, label: usize) -> &mut Self {
        let rel = self.rel8(label);
        self.raw(&[0x75, rel])
    }

    /// `jmp label` (short form)
    pub fn jmp(&mut self, label: usize) -> &mut Self {
        let rel = self.rel8(label);
        self.raw(&[0xeb, rel])
    }

    fn rel8(&self, label: usize) -> u8 {
        let next = self.bytes.len() as i64 + 2;
        let rel = label as i64 - next;
        let rel = i8::try_from(rel).expect("short jump target out of range");
        rel as u8
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn code_buf_encodes_loop() {
        let mut c = CodeBuf::new();
        c.mov_ecx_imm(5);
        let top = c.here();
        c.dec_ecx().jnz(top).out_al(0x81).jmp(0);
        assert_eq!(
            c.bytes(),
            &[0xb9, 5, 0, 0, 0, 0xff, 0xc9, 0x75, 0xfc, 0xe6, 0x81, 0xeb, 0xf3]
        );
    }
}
