//! The vCPU state a completion reads and changes, behind [`CpuState`]: the completer runs on a
//! real KVM vCPU ([`KvmCpu`]) or on plain memory ([`MockCpu`], for unit tests and fuzzing).

use std::collections::{BTreeMap, HashMap};

use lucid_boot::regs::segment_from_gdt;
use lucid_hv::kvm_bindings::{
    kvm_cpuid_entry2, kvm_fpu, kvm_regs, kvm_sregs, kvm_xsave, KVM_CPUID_FLAG_SIGNIFCANT_INDEX,
};
use lucid_hv::Vcpu;
use lucid_mem::GuestMemoryMmap;

use super::EmulateError;

/// What the completer needs from a vCPU. Registers are read once per instruction and written
/// back once; guest-virtual addresses go through [`CpuState::translate`].
pub trait CpuState {
    fn regs(&self) -> Result<kvm_regs, EmulateError>;
    fn set_regs(&mut self, regs: &kvm_regs) -> Result<(), EmulateError>;
    fn sregs(&self) -> Result<kvm_sregs, EmulateError>;
    fn set_sregs(&mut self, sregs: &kvm_sregs) -> Result<(), EmulateError>;
    /// x87 and SSE state (XMM registers, MXCSR, FSW, abridged tag word).
    fn fpu(&self) -> Result<kvm_fpu, EmulateError>;
    fn set_fpu(&mut self, fpu: &kvm_fpu) -> Result<(), EmulateError>;
    fn xcr0(&self) -> Result<u64, EmulateError>;
    /// CPUID leaf `leaf`/`index` as guest kernel code reads it: `[eax, ebx, ecx, edx]`, or
    /// `None` when the leaf is not there.
    fn cpuid(&self, leaf: u32, index: u32) -> Option<[u32; 4]>;
    /// Guest-virtual to guest-physical through the guest's page tables; `None` if not mapped.
    fn translate(&self, gva: u64) -> Result<Option<u64>, EmulateError>;
    fn read_phys(&self, gpa: u64, buf: &mut [u8]) -> Result<(), EmulateError>;
    fn write_phys(&mut self, gpa: u64, data: &[u8]) -> Result<(), EmulateError>;
    /// Makes the guest take exception `vector` at its current RIP when it next runs.
    fn inject_exception(&mut self, vector: u8, error_code: Option<u32>)
        -> Result<(), EmulateError>;
    /// Drops every cached guest translation, global ones included.
    fn flush_tlb(&mut self) -> Result<(), EmulateError>;
}

const CR4_PGE: u64 = 1 << 7;

/// A KVM vCPU and the VM's RAM. `cpuid` are the vCPU's entries as KVM holds them
/// (`KVM_GET_CPUID2`): on a host where KVM emulates guest kernel code, that is what the guest's
/// kernel reads (CPUID at CPL0 is answered by KVM's emulator), not the host's leaves that its
/// user mode sees.
pub struct KvmCpu<'a> {
    vcpu: &'a Vcpu,
    mem: Option<&'a GuestMemoryMmap>,
    cpuid: &'a [kvm_cpuid_entry2],
    /// The XSAVE image [`CpuState::fpu`] read, so that [`CpuState::set_fpu`] writes it back
    /// without reading the 4 KiB area again (one `KvmCpu` serves one instruction).
    xsave: std::cell::RefCell<Option<Box<kvm_xsave>>>,
}

impl<'a> KvmCpu<'a> {
    pub fn new(
        vcpu: &'a Vcpu,
        mem: Option<&'a GuestMemoryMmap>,
        cpuid: &'a [kvm_cpuid_entry2],
    ) -> Self {
        KvmCpu {
            vcpu,
            mem,
            cpuid,
            xsave: std::cell::RefCell::new(None),
        }
    }

    fn mem(&self) -> Result<&GuestMemoryMmap, EmulateError> {
        self.mem.ok_or(EmulateError::NoMemory)
    }
}

impl CpuState for KvmCpu<'_> {
    fn regs(&self) -> Result<kvm_regs, EmulateError> {
        Ok(self.vcpu.get_regs()?)
    }
    fn set_regs(&mut self, regs: &kvm_regs) -> Result<(), EmulateError> {
        Ok(self.vcpu.set_regs(regs)?)
    }
    fn sregs(&self) -> Result<kvm_sregs, EmulateError> {
        Ok(self.vcpu.get_sregs()?)
    }
    fn set_sregs(&mut self, sregs: &kvm_sregs) -> Result<(), EmulateError> {
        Ok(self.vcpu.set_sregs(sregs)?)
    }
    // Through the XSAVE area rather than KVM_GET/SET_FPU: those read and write the legacy area
    // whatever XSTATE_BV says, so a value written while the guest's SSE state was in its
    // initial configuration (XSTATE_BV bit 1 clear) was dropped when KVM restored the state.
    fn fpu(&self) -> Result<kvm_fpu, EmulateError> {
        let x = Box::new(self.vcpu.get_xsave()?);
        let fpu = fpu_from_xsave(&x);
        *self.xsave.borrow_mut() = Some(x);
        Ok(fpu)
    }
    fn set_fpu(&mut self, fpu: &kvm_fpu) -> Result<(), EmulateError> {
        let mut x = match self.xsave.get_mut().take() {
            Some(x) => x,
            None => Box::new(self.vcpu.get_xsave()?),
        };
        fpu_into_xsave(fpu, &mut x);
        self.vcpu.set_xsave(&x)?;
        *self.xsave.get_mut() = Some(x);
        Ok(())
    }
    fn xcr0(&self) -> Result<u64, EmulateError> {
        let x = self.vcpu.get_xcrs()?;
        let n = (x.nr_xcrs as usize).min(x.xcrs.len());
        Ok(x.xcrs[..n]
            .iter()
            .find(|r| r.xcr == 0)
            .map_or(1, |r| r.value))
    }
    fn cpuid(&self, leaf: u32, index: u32) -> Option<[u32; 4]> {
        self.cpuid
            .iter()
            .find(|e| {
                e.function == leaf
                    && (e.index == index || e.flags & KVM_CPUID_FLAG_SIGNIFCANT_INDEX == 0)
            })
            .map(|e| [e.eax, e.ebx, e.ecx, e.edx])
    }
    fn translate(&self, gva: u64) -> Result<Option<u64>, EmulateError> {
        Ok(self.vcpu.translate(gva)?)
    }
    fn read_phys(&self, gpa: u64, buf: &mut [u8]) -> Result<(), EmulateError> {
        use lucid_mem::vm_memory::{Bytes, GuestAddress};
        self.mem()?
            .read_slice(buf, GuestAddress(gpa))
            .map_err(|source| EmulateError::NotRam {
                gpa,
                len: buf.len(),
                source: Some(source),
            })
    }
    fn write_phys(&mut self, gpa: u64, data: &[u8]) -> Result<(), EmulateError> {
        use lucid_mem::vm_memory::{Bytes, GuestAddress};
        self.mem()?
            .write_slice(data, GuestAddress(gpa))
            .map_err(|source| EmulateError::NotRam {
                gpa,
                len: data.len(),
                source: Some(source),
            })
    }
    fn inject_exception(
        &mut self,
        vector: u8,
        error_code: Option<u32>,
    ) -> Result<(), EmulateError> {
        Ok(self.vcpu.inject_exception(vector, error_code)?)
    }
    fn flush_tlb(&mut self) -> Result<(), EmulateError> {
        // KVM has no "flush the guest's TLB" ioctl, but KVM_SET_SREGS with a CR4 that differs
        // resets the vCPU's MMU context and requests a guest TLB flush. Flipping CR4.PGE and
        // setting it back, with no guest entry between, flushes everything (global entries
        // too) and leaves the registers as they were.
        let s = self.vcpu.get_sregs()?;
        let mut flipped = s;
        flipped.cr4 ^= CR4_PGE;
        self.vcpu.set_sregs(&flipped)?;
        Ok(self.vcpu.set_sregs(&s)?)
    }
}

/// The legacy (FXSAVE) area of an XSAVE image as bytes.
fn legacy(x: &kvm_xsave) -> [u8; 512] {
    let mut b = [0u8; 512];
    for (i, w) in x.region[..128].iter().enumerate() {
        b[i * 4..i * 4 + 4].copy_from_slice(&w.to_le_bytes());
    }
    b
}

fn field<const N: usize>(b: &[u8], at: usize) -> [u8; N] {
    b[at..at + N].try_into().unwrap_or([0; N])
}

/// x87 and SSE state from an XSAVE image (standard layout: KVM_GET_XSAVE gives the initial
/// values for a component whose XSTATE_BV bit is clear).
pub(super) fn fpu_from_xsave(x: &kvm_xsave) -> kvm_fpu {
    let b = legacy(x);
    kvm_fpu {
        fpr: std::array::from_fn(|i| field(&b, 32 + 16 * i)),
        fcw: u16::from_le_bytes(field(&b, 0)),
        fsw: u16::from_le_bytes(field(&b, 2)),
        ftwx: b[4],
        pad1: 0,
        last_opcode: u16::from_le_bytes(field(&b, 6)),
        last_ip: u64::from_le_bytes(field(&b, 8)),
        last_dp: u64::from_le_bytes(field(&b, 16)),
        xmm: std::array::from_fn(|i| field(&b, 160 + 16 * i)),
        mxcsr: u32::from_le_bytes(field(&b, 24)),
        pad2: 0,
    }
}

/// Writes `f` into the legacy area of `x` and marks the x87 and SSE components as holding
/// values (XSTATE_BV bits 0 and 1), so that KVM loads them.
pub(super) fn fpu_into_xsave(f: &kvm_fpu, x: &mut kvm_xsave) {
    let mut b = legacy(x);
    let mut put = |at: usize, v: &[u8]| b[at..at + v.len()].copy_from_slice(v);
    put(0, &f.fcw.to_le_bytes());
    put(2, &f.fsw.to_le_bytes());
    put(4, &[f.ftwx]);
    put(6, &f.last_opcode.to_le_bytes());
    put(8, &f.last_ip.to_le_bytes());
    put(16, &f.last_dp.to_le_bytes());
    put(24, &f.mxcsr.to_le_bytes());
    for (i, r) in f.fpr.iter().enumerate() {
        put(32 + 16 * i, r);
    }
    for (i, r) in f.xmm.iter().enumerate() {
        put(160 + 16 * i, r);
    }
    for (i, w) in x.region[..128].iter_mut().enumerate() {
        *w = u32::from_le_bytes(field(&b, i * 4));
    }
    // XSTATE_BV is the first quadword of the header, at byte 512.
    x.region[128] |= 0b11;
}

/// A vCPU in plain memory: registers, CPUID, a page map and guest RAM. It records the
/// exceptions injected and the TLB flushes asked for. [`MockCpu::long_mode`] gives a 64-bit CPL0
/// CPU with every feature the completer knows of and its RAM identity-mapped.
#[derive(Clone, Debug, Default)]
pub struct MockCpu {
    pub regs: kvm_regs,
    pub sregs: kvm_sregs,
    pub fpu: kvm_fpu,
    pub xcr0: u64,
    /// CPUID leaves by (leaf, index).
    pub cpuid: HashMap<(u32, u32), [u32; 4]>,
    /// Guest RAM from guest-physical 0.
    pub ram: Vec<u8>,
    /// Guest-virtual page number to guest-physical page number.
    pub pages: BTreeMap<u64, u64>,
    /// Exceptions injected, in order: (vector, error code).
    pub injected: Vec<(u8, Option<u32>)>,
    pub tlb_flushes: u32,
}

impl MockCpu {
    /// 64-bit mode at CPL0 (CR0.PE|PG, CR4.PAE|OSFXSR|OSXSAVE, EFER.LME|LMA, flat selectors
    /// 0x08 code and 0x10 data), `ram` bytes of RAM mapped at the same guest-virtual
    /// addresses, x87/SSE enabled in XCR0, and CPUID with every feature the completer checks.
    pub fn long_mode(ram: usize) -> Self {
        // flat 64-bit kernel code and data, as a boot GDT holds them
        let code = segment_from_gdt(0x00af_9b00_0000_ffff, 0x08);
        let data = segment_from_gdt(0x00cf_9300_0000_ffff, 0x10);
        let mut sregs = kvm_sregs {
            cs: code,
            ds: data,
            es: data,
            ss: data,
            fs: data,
            gs: data,
            cr0: 0x8000_0033,
            cr4: 0x20 | 1 << 9 | 1 << 10 | 1 << 18,
            efer: 0x500,
            ..Default::default()
        };
        sregs.tr.type_ = 0xb;
        sregs.tr.present = 1;
        let mut cpu = MockCpu {
            regs: kvm_regs {
                rflags: 0x2,
                ..Default::default()
            },
            sregs,
            fpu: kvm_fpu {
                fcw: 0x37f,
                mxcsr: 0x1f80,
                ..Default::default()
            },
            xcr0: 0x7,
            ram: vec![0; ram],
            ..Default::default()
        };
        cpu.map(0, 0, ram as u64);
        // leaf 1: SSE, SSE2 (EDX), SSSE3, SSE4.2, POPCNT, XSAVE, RDRAND (ECX)
        cpu.cpuid.insert(
            (1, 0),
            [
                0,
                0,
                1 << 9 | 1 << 20 | 1 << 23 | 1 << 26 | 1 << 30,
                3 << 25,
            ],
        );
        // leaf 7: FSGSBASE, INVPCID, RDSEED, SMAP, CLWB
        cpu.cpuid
            .insert((7, 0), [0, 1 | 1 << 10 | 1 << 18 | 1 << 20 | 1 << 24, 0, 0]);
        // leaf 0xd.1: XGETBV with ECX=1
        cpu.cpuid.insert((0xd, 1), [1 << 2, 0, 0, 0]);
        // leaf 0x80000008: RDPRU
        cpu.cpuid.insert((0x8000_0008, 0), [0, 1 << 4, 0, 0]);
        cpu
    }

    /// Maps `len` bytes of guest-virtual memory at `gva` to guest-physical `gpa` (page-aligned).
    pub fn map(&mut self, gva: u64, gpa: u64, len: u64) {
        for p in 0..len.div_ceil(0x1000) {
            self.pages.insert((gva >> 12) + p, (gpa >> 12) + p);
        }
    }

    /// Clears CPUID bit `bit` of register `reg` (0 eax .. 3 edx) of a leaf.
    pub fn clear_feature(&mut self, leaf: u32, index: u32, reg: usize, bit: u32) {
        if let Some(r) = self.cpuid.get_mut(&(leaf, index)) {
            r[reg] &= !(1 << bit);
        }
    }

    fn ram_range(&self, gpa: u64, len: usize) -> Result<std::ops::Range<usize>, EmulateError> {
        let start = usize::try_from(gpa).ok();
        match start.and_then(|s| Some(s..s.checked_add(len)?)) {
            Some(r) if r.end <= self.ram.len() => Ok(r),
            _ => Err(EmulateError::NotRam {
                gpa,
                len,
                source: None,
            }),
        }
    }
}

impl CpuState for MockCpu {
    fn regs(&self) -> Result<kvm_regs, EmulateError> {
        Ok(self.regs)
    }
    fn set_regs(&mut self, regs: &kvm_regs) -> Result<(), EmulateError> {
        self.regs = *regs;
        Ok(())
    }
    fn sregs(&self) -> Result<kvm_sregs, EmulateError> {
        Ok(self.sregs)
    }
    fn set_sregs(&mut self, sregs: &kvm_sregs) -> Result<(), EmulateError> {
        self.sregs = *sregs;
        Ok(())
    }
    fn fpu(&self) -> Result<kvm_fpu, EmulateError> {
        Ok(self.fpu)
    }
    fn set_fpu(&mut self, fpu: &kvm_fpu) -> Result<(), EmulateError> {
        self.fpu = *fpu;
        Ok(())
    }
    fn xcr0(&self) -> Result<u64, EmulateError> {
        Ok(self.xcr0)
    }
    fn cpuid(&self, leaf: u32, index: u32) -> Option<[u32; 4]> {
        self.cpuid.get(&(leaf, index)).copied()
    }
    fn translate(&self, gva: u64) -> Result<Option<u64>, EmulateError> {
        Ok(self
            .pages
            .get(&(gva >> 12))
            .map(|p| p << 12 | (gva & 0xfff)))
    }
    fn read_phys(&self, gpa: u64, buf: &mut [u8]) -> Result<(), EmulateError> {
        let r = self.ram_range(gpa, buf.len())?;
        buf.copy_from_slice(&self.ram[r]);
        Ok(())
    }
    fn write_phys(&mut self, gpa: u64, data: &[u8]) -> Result<(), EmulateError> {
        let r = self.ram_range(gpa, data.len())?;
        self.ram[r].copy_from_slice(data);
        Ok(())
    }
    fn inject_exception(
        &mut self,
        vector: u8,
        error_code: Option<u32>,
    ) -> Result<(), EmulateError> {
        self.injected.push((vector, error_code));
        Ok(())
    }
    fn flush_tlb(&mut self) -> Result<(), EmulateError> {
        self.tlb_flushes += 1;
        Ok(())
    }
}
