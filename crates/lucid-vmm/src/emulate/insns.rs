//! One completion: the working copy of the registers, operands, guest memory through the page
//! tables, the CPUID and mode checks that decide between completing and faulting, and what each
//! instruction does.

use iced_x86::{EncodingKind, Instruction, Mnemonic, OpKind, Register};
use lucid_hv::kvm_bindings::{kvm_fpu, kvm_regs, kvm_sregs};

use super::vector::{GP, MF, NM, PF, SS, UD};
use super::{interrupt, sse, CpuState, EmulateError, Exception};

pub const EFER_LMA: u64 = 1 << 10;
const CR0_PE: u64 = 1 << 0;
const CR0_MP: u64 = 1 << 1;
const CR0_EM: u64 = 1 << 2;
const CR0_TS: u64 = 1 << 3;
const CR4_TSD: u64 = 1 << 2;
const CR4_OSFXSR: u64 = 1 << 9;
const CR4_FSGSBASE: u64 = 1 << 16;
const CR4_PCIDE: u64 = 1 << 17;
const CR4_OSXSAVE: u64 = 1 << 18;

/// RFLAGS bits the completed instructions read or set.
pub mod flags {
    pub const CF: u64 = 1 << 0;
    pub const PF: u64 = 1 << 2;
    pub const AF: u64 = 1 << 4;
    pub const ZF: u64 = 1 << 6;
    pub const SF: u64 = 1 << 7;
    pub const TF: u64 = 1 << 8;
    pub const IF: u64 = 1 << 9;
    pub const OF: u64 = 1 << 11;
    pub const NT: u64 = 1 << 14;
    pub const RF: u64 = 1 << 16;
    pub const VM: u64 = 1 << 17;
    pub const AC: u64 = 1 << 18;
    pub const ARITH: u64 = CF | PF | AF | ZF | SF | OF;
}

/// Why a completion ended early: the instruction faults as on the CPU, or Lucid cannot do it.
pub enum Stop {
    Fault(Exception),
    Error(EmulateError),
}

impl<E: Into<EmulateError>> From<E> for Stop {
    fn from(e: E) -> Self {
        Stop::Error(e.into())
    }
}

pub type Res<T> = Result<T, Stop>;

pub fn fault<T>(vector: u8, error_code: Option<u32>) -> Res<T> {
    Err(Stop::Fault(Exception {
        vector,
        error_code,
        address: None,
    }))
}

fn unsupported<T>(insn: &Instruction, form: &'static str) -> Res<T> {
    Err(Stop::Error(EmulateError::Unsupported {
        mnemonic: insn.mnemonic(),
        form,
    }))
}

/// How a memory access is checked: a write or not, and whether it is an implicit supervisor
/// access (descriptor tables, the TSS, an interrupt's stack) whatever the CPL.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Access {
    Read,
    Write,
    SysRead,
    SysWrite,
}

pub fn canonical(va: u64) -> bool {
    ((va as i64) << 16 >> 16) as u64 == va
}

/// The state one completion works on: registers are read once, changed here and written back
/// once by [`Ctx::commit`]; the rest goes through the [`CpuState`].
pub struct Ctx<'a, S: CpuState + ?Sized> {
    pub cpu: &'a mut S,
    pub regs: kvm_regs,
    pub sregs: kvm_sregs,
    pub sregs_dirty: bool,
}

impl<'a, S: CpuState + ?Sized> Ctx<'a, S> {
    pub fn new(cpu: &'a mut S, regs: kvm_regs, sregs: kvm_sregs) -> Self {
        Ctx {
            cpu,
            regs,
            sregs,
            sregs_dirty: false,
        }
    }

    /// Writes back what the completion changed (`before` are the registers it started from).
    pub fn commit(&mut self, before: &kvm_regs) -> Result<(), EmulateError> {
        if self.sregs_dirty {
            self.cpu.set_sregs(&self.sregs)?;
        }
        if self.regs != *before {
            self.cpu.set_regs(&self.regs)?;
        }
        Ok(())
    }

    pub fn cpl(&self) -> u8 {
        if self.sregs.cr0 & CR0_PE == 0 {
            0
        } else {
            self.sregs.cs.dpl & 3
        }
    }

    pub fn long_mode(&self) -> bool {
        self.sregs.efer & EFER_LMA != 0
    }

    pub fn bits64(&self) -> bool {
        self.long_mode() && self.sregs.cs.l != 0
    }

    /// #UD unless CPUID leaf `leaf`.`index` has bit `bit` of register `reg` (0 eax .. 3 edx).
    fn require(&self, leaf: u32, index: u32, reg: usize, bit: u32) -> Res<()> {
        match self.cpu.cpuid(leaf, index) {
            Some(r) if r[reg] & (1 << bit) != 0 => Ok(()),
            _ => fault(UD, None),
        }
    }

    fn gpr_slot(&mut self, full: Register) -> Option<&mut u64> {
        let r = &mut self.regs;
        Some(match full {
            Register::RAX => &mut r.rax,
            Register::RBX => &mut r.rbx,
            Register::RCX => &mut r.rcx,
            Register::RDX => &mut r.rdx,
            Register::RSI => &mut r.rsi,
            Register::RDI => &mut r.rdi,
            Register::RSP => &mut r.rsp,
            Register::RBP => &mut r.rbp,
            Register::R8 => &mut r.r8,
            Register::R9 => &mut r.r9,
            Register::R10 => &mut r.r10,
            Register::R11 => &mut r.r11,
            Register::R12 => &mut r.r12,
            Register::R13 => &mut r.r13,
            Register::R14 => &mut r.r14,
            Register::R15 => &mut r.r15,
            _ => return None,
        })
    }

    /// A register's value at its size (AH..BH are the high bytes); a segment register's base,
    /// which 64-bit mode takes as 0 for ES, CS, SS and DS.
    pub fn get(&mut self, reg: Register) -> Option<u64> {
        if reg.is_segment_register() {
            let s = &self.sregs;
            let flat = self.long_mode() && s.cs.l != 0;
            return Some(match reg {
                Register::ES | Register::CS | Register::SS | Register::DS if flat => 0,
                Register::ES => s.es.base,
                Register::CS => s.cs.base,
                Register::SS => s.ss.base,
                Register::DS => s.ds.base,
                Register::FS => s.fs.base,
                Register::GS => s.gs.base,
                _ => return None,
            });
        }
        if matches!(reg, Register::RIP | Register::EIP) {
            return Some(self.regs.rip);
        }
        let high = matches!(
            reg,
            Register::AH | Register::CH | Register::DH | Register::BH
        );
        let v = *self.gpr_slot(reg.full_register())?;
        Some(match (reg.size(), high) {
            (1, true) => (v >> 8) & 0xff,
            (1, false) => v & 0xff,
            (2, _) => v & 0xffff,
            (4, _) => v & 0xffff_ffff,
            _ => v,
        })
    }

    /// Writes a general-purpose register with the architecture's rules: 32-bit writes clear the
    /// upper half, 8- and 16-bit writes keep the other bits.
    pub fn set(&mut self, insn: &Instruction, reg: Register, val: u64) -> Res<()> {
        let high = matches!(
            reg,
            Register::AH | Register::CH | Register::DH | Register::BH
        );
        let size = reg.size();
        let Some(slot) = self.gpr_slot(reg.full_register()) else {
            return unsupported(insn, "destination register");
        };
        *slot = match (size, high) {
            (1, true) => (*slot & !0xff00) | ((val & 0xff) << 8),
            (1, false) => (*slot & !0xff) | (val & 0xff),
            (2, _) => (*slot & !0xffff) | (val & 0xffff),
            (4, _) => val & 0xffff_ffff,
            _ => val,
        };
        Ok(())
    }

    /// The linear address of memory operand `op`; #GP(0) (#SS(0) for the stack segment) when
    /// it is not canonical in 64-bit mode.
    pub fn address(&mut self, insn: &Instruction, op: u32) -> Res<u64> {
        let Some(va) = insn.try_virtual_address(op, 0, |r, _, _| self.get(r)) else {
            return unsupported(insn, "memory operand addressing");
        };
        if !self.bits64() {
            return Ok(va & 0xffff_ffff);
        }
        if !canonical(va) {
            let v = if insn.memory_segment() == Register::SS {
                SS
            } else {
                GP
            };
            return fault(v, Some(0));
        }
        Ok(va)
    }

    /// The guest-physical pieces of `len` bytes at `gva`, each within a page; #PF for the first
    /// page that does not translate. Nothing is accessed until every page translates.
    fn pieces(&self, gva: u64, len: usize, access: Access) -> Res<Vec<(u64, usize)>> {
        let mut out = Vec::new();
        let mut done = 0usize;
        while done < len {
            let va = gva.wrapping_add(done as u64);
            let n = ((0x1000 - (va & 0xfff)) as usize).min(len - done);
            match self.cpu.translate(va)? {
                Some(gpa) => out.push((gpa, n)),
                None => {
                    let write = matches!(access, Access::Write | Access::SysWrite);
                    let user = self.cpl() == 3 && matches!(access, Access::Read | Access::Write);
                    return Err(Stop::Fault(Exception {
                        vector: PF,
                        error_code: Some((write as u32) << 1 | (user as u32) << 2),
                        address: Some(va),
                    }));
                }
            }
            done += n;
        }
        Ok(out)
    }

    /// Checks that `len` bytes at `gva` translate, as an access of this kind would.
    pub fn probe(&self, gva: u64, len: usize, access: Access) -> Res<()> {
        self.pieces(gva, len, access).map(drop)
    }

    pub fn read(&self, gva: u64, buf: &mut [u8], access: Access) -> Res<()> {
        let mut at = 0;
        for (gpa, n) in self.pieces(gva, buf.len(), access)? {
            self.cpu.read_phys(gpa, &mut buf[at..at + n])?;
            at += n;
        }
        Ok(())
    }

    pub fn write(&mut self, gva: u64, data: &[u8], access: Access) -> Res<()> {
        let mut at = 0;
        for (gpa, n) in self.pieces(gva, data.len(), access)? {
            self.cpu.write_phys(gpa, &data[at..at + n])?;
            at += n;
        }
        Ok(())
    }

    pub fn read_u64(&self, gva: u64, access: Access) -> Res<u64> {
        let mut b = [0u8; 8];
        self.read(gva, &mut b, access)?;
        Ok(u64::from_le_bytes(b))
    }

    /// The value of operand `op` (register or memory), zero-extended, and its size in bytes.
    fn read_op(&mut self, insn: &Instruction, op: u32) -> Res<(u64, usize)> {
        match insn.op_kind(op) {
            OpKind::Register => {
                let r = insn.op_register(op);
                match self.get(r) {
                    Some(v) => Ok((v, r.size())),
                    None => unsupported(insn, "source register"),
                }
            }
            OpKind::Memory => {
                let size = insn.memory_size().size();
                if !matches!(size, 1 | 2 | 4 | 8) {
                    return unsupported(insn, "memory operand size");
                }
                let gva = self.address(insn, op)?;
                let mut b = [0u8; 8];
                self.read(gva, &mut b[..size], Access::Read)?;
                Ok((u64::from_le_bytes(b), size))
            }
            _ => unsupported(insn, "operand kind"),
        }
    }

    /// The 128-bit value of an XMM register or a memory operand (of its size, zero-extended).
    fn read_xmm_op(&mut self, insn: &Instruction, op: u32, fpu: &kvm_fpu) -> Res<u128> {
        match insn.op_kind(op) {
            OpKind::Register if insn.op_register(op).is_xmm() => {
                Ok(u128::from_le_bytes(fpu.xmm[insn.op_register(op).number()]))
            }
            OpKind::Register => Ok(self.read_op(insn, op)?.0 as u128),
            OpKind::Memory => {
                let size = insn.memory_size().size();
                if !matches!(size, 4 | 8 | 16) {
                    return unsupported(insn, "SSE memory operand size");
                }
                let gva = self.address(insn, op)?;
                let mut b = [0u8; 16];
                self.read(gva, &mut b[..size], Access::Read)?;
                Ok(u128::from_le_bytes(b))
            }
            OpKind::Immediate8 => Ok(insn.immediate8() as u128),
            _ => unsupported(insn, "SSE operand kind"),
        }
    }

    fn set_flags(&mut self, mask: u64, set: u64) {
        self.regs.rflags = (self.regs.rflags & !mask) | (set & mask);
    }

    /// SSE state usable: #UD with CR0.EM or without CR4.OSFXSR, #NM with CR0.TS.
    fn sse_usable(&self) -> Res<()> {
        if self.sregs.cr0 & CR0_EM != 0 || self.sregs.cr4 & CR4_OSFXSR == 0 {
            return fault(UD, None);
        }
        if self.sregs.cr0 & CR0_TS != 0 {
            return fault(NM, None);
        }
        Ok(())
    }
}

/// The CPUID feature an instruction needs, as (leaf, index, register, bit): without it the CPU
/// raises #UD. Decided by the CPUID the guest's kernel reads (see [`CpuState::cpuid`]).
fn feature(m: Mnemonic) -> Option<(u32, u32, usize, u32)> {
    use Mnemonic::*;
    const ECX: usize = 2;
    const EBX: usize = 1;
    const EDX: usize = 3;
    Some(match m {
        Popcnt => (1, 0, ECX, 23),
        Crc32 => (1, 0, ECX, 20),
        Rdrand => (1, 0, ECX, 30),
        Xgetbv => (1, 0, ECX, 26),
        Pshufb | Palignr => (1, 0, ECX, 9),
        Ldmxcsr | Stmxcsr | Movaps | Movups | Xorps => (1, 0, EDX, 25),
        m if sse::handles(m) => (1, 0, EDX, 26),
        Rdfsbase | Rdgsbase | Wrfsbase | Wrgsbase => (7, 0, EBX, 0),
        Invpcid => (7, 0, EBX, 10),
        Rdseed => (7, 0, EBX, 18),
        Clac | Stac => (7, 0, EBX, 20),
        Clwb => (7, 0, EBX, 24),
        Rdpru => (0x8000_0008, 0, EBX, 4),
        _ => return None,
    })
}

/// A random 64-bit value for `rdrand`/`rdseed`, from the host's kernel.
fn host_random() -> Option<u64> {
    let mut b = [0u8; 8];
    // SAFETY: getrandom writes at most `b.len()` bytes into the buffer it is given.
    let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), b.len(), 0) };
    (n == 8).then(|| u64::from_le_bytes(b))
}

/// CRC-32C (Castagnoli, reflected), one byte at a time, as the SSE4.2 `crc32` instruction.
pub fn crc32c(mut crc: u32, data: &[u8]) -> u32 {
    for &b in data {
        crc ^= b as u32;
        for _ in 0..8 {
            crc = if crc & 1 != 0 {
                (crc >> 1) ^ 0x82f6_3b78
            } else {
                crc >> 1
            };
        }
    }
    crc
}

/// Completes `insn` on `g`, or returns the fault the CPU would raise.
pub fn complete<S: CpuState + ?Sized>(g: &mut Ctx<'_, S>, insn: &Instruction) -> Res<()> {
    let m = insn.mnemonic();
    if let Some((leaf, index, reg, bit)) = feature(m) {
        g.require(leaf, index, reg, bit)?;
    }
    let mut next = g.regs.rip.wrapping_add(insn.len() as u64);
    if !g.bits64() {
        next &= if g.sregs.cs.db != 0 {
            0xffff_ffff
        } else {
            0xffff
        };
    }
    match m {
        // INT3 and INT n go through the guest's IDT, the handler returning after them.
        Mnemonic::Int3 => return interrupt::deliver(g, insn, 3, next),
        Mnemonic::Int => return interrupt::deliver(g, insn, insn.immediate8(), next),
        Mnemonic::Popcnt | Mnemonic::Lzcnt | Mnemonic::Tzcnt => {
            let (src, size) = g.read_op(insn, 1)?;
            let bits = (size * 8) as u32;
            let (res, cf) = match m {
                Mnemonic::Popcnt => (src.count_ones(), false),
                Mnemonic::Lzcnt => {
                    let lz = if src == 0 {
                        bits
                    } else {
                        src.leading_zeros() - (64 - bits)
                    };
                    (lz, src == 0)
                }
                _ => (if src == 0 { bits } else { src.trailing_zeros() }, src == 0),
            };
            g.set(insn, insn.op_register(0), res as u64)?;
            let zf = if m == Mnemonic::Popcnt {
                src == 0
            } else {
                res == 0
            };
            let f = if zf { flags::ZF } else { 0 } | if cf { flags::CF } else { 0 };
            // POPCNT clears the other arithmetic flags; LZCNT/TZCNT leave them undefined.
            g.set_flags(flags::ARITH, f);
        }
        Mnemonic::Crc32 => {
            let (src, size) = g.read_op(insn, 1)?;
            let dst = insn.op_register(0);
            let Some(crc) = g.get(dst) else {
                return unsupported(insn, "crc32 destination");
            };
            let out = crc32c(crc as u32, &src.to_le_bytes()[..size]);
            // The result is 32 bits, zero-extended into a 64-bit destination.
            g.set(insn, dst.full_register32(), out as u64)?;
        }
        Mnemonic::Rdrand | Mnemonic::Rdseed => {
            let dst = insn.op_register(0);
            // No entropy now is what the CPU reports with CF=0 and a zero destination.
            let v = host_random();
            g.set(insn, dst, v.unwrap_or(0))?;
            g.set_flags(flags::ARITH, if v.is_some() { flags::CF } else { 0 });
        }
        // SMAP: user-access windows open and close with the AC flag (CPL0 only).
        Mnemonic::Clac | Mnemonic::Stac => {
            if g.cpl() != 0 {
                return fault(UD, None);
            }
            g.set_flags(flags::AC, if m == Mnemonic::Stac { flags::AC } else { 0 });
        }
        // FSGSBASE: the kernel reads and writes the segment bases directly (64-bit mode only).
        Mnemonic::Rdfsbase | Mnemonic::Rdgsbase | Mnemonic::Wrfsbase | Mnemonic::Wrgsbase => {
            if !g.bits64() || g.sregs.cr4 & CR4_FSGSBASE == 0 {
                return fault(UD, None);
            }
            let fs = matches!(m, Mnemonic::Rdfsbase | Mnemonic::Wrfsbase);
            if matches!(m, Mnemonic::Rdfsbase | Mnemonic::Rdgsbase) {
                let base = if fs { g.sregs.fs.base } else { g.sregs.gs.base };
                g.set(insn, insn.op_register(0), base)?;
            } else {
                let (v, _) = g.read_op(insn, 0)?;
                if !canonical(v) {
                    return fault(GP, Some(0));
                }
                if fs {
                    g.sregs.fs.base = v;
                } else {
                    g.sregs.gs.base = v;
                }
                g.sregs_dirty = true;
            }
        }
        // x87 and SSE control: state through the FPU registers.
        Mnemonic::Wait => {
            // With CR0.TS and CR0.MP set, WAIT raises #NM; with an unmasked x87 exception
            // pending (FSW.ES), #MF. Both are faults: the handler returns to the WAIT.
            if g.sregs.cr0 & (CR0_TS | CR0_MP) == CR0_TS | CR0_MP {
                return fault(NM, None);
            }
            if g.cpu.fpu()?.fsw & 0x80 != 0 {
                return fault(MF, None);
            }
        }
        Mnemonic::Fnclex | Mnemonic::Emms => {
            if m == Mnemonic::Emms && g.sregs.cr0 & CR0_EM != 0 {
                return fault(UD, None);
            }
            if g.sregs.cr0 & (CR0_EM | CR0_TS) != 0 {
                return fault(NM, None);
            }
            let mut fpu = g.cpu.fpu()?;
            if m == Mnemonic::Fnclex {
                // Clear the exception flags, the summary and busy bits.
                fpu.fsw &= !0x80ff;
            } else {
                // EMMS marks every x87 register empty (the abridged tag word is 0 for empty).
                fpu.ftwx = 0;
            }
            g.cpu.set_fpu(&fpu)?;
        }
        Mnemonic::Ldmxcsr | Mnemonic::Stmxcsr => {
            g.sse_usable()?;
            let gva = g.address(insn, 0)?;
            let mut fpu = g.cpu.fpu()?;
            let mut b = fpu.mxcsr.to_le_bytes();
            if m == Mnemonic::Ldmxcsr {
                g.read(gva, &mut b, Access::Read)?;
                let v = u32::from_le_bytes(b);
                // Bits 16-31 are reserved (#GP(0)), except AMD's MM bit (17) where CPUID
                // 0x80000001 ECX.MisAlignSse offers it.
                let misalign = g
                    .cpu
                    .cpuid(0x8000_0001, 0)
                    .is_some_and(|r| r[2] & 1 << 7 != 0);
                let allowed = 0xffff | if misalign { 1 << 17 } else { 0 };
                if v & !allowed != 0 {
                    return fault(GP, Some(0));
                }
                fpu.mxcsr = v;
                g.cpu.set_fpu(&fpu)?;
            } else {
                g.write(gva, &b, Access::Write)?;
            }
        }
        m if sse::handles(m) => complete_sse(g, insn)?,
        Mnemonic::Xgetbv => {
            if g.sregs.cr4 & CR4_OSXSAVE == 0 {
                return fault(UD, None);
            }
            let v = match g.regs.rcx as u32 {
                0 => g.cpu.xcr0()?,
                // XINUSE, where CPUID 0xd.1 EAX bit 2 offers it. Every enabled component is
                // reported in use: the SDM allows a 1 for a component in its initial
                // configuration, while a 0 must be true, and KVM's saved XSTATE_BV was seen to
                // miss SSE state in use.
                1 if g.cpu.cpuid(0xd, 1).is_some_and(|r| r[0] & 1 << 2 != 0) => g.cpu.xcr0()?,
                _ => return fault(GP, Some(0)),
            };
            g.regs.rax = v & 0xffff_ffff;
            g.regs.rdx = v >> 32;
        }
        Mnemonic::Clwb => {
            // Guest RAM is host memory, coherent with every cache: writing a line back changes
            // nothing Lucid can see. The address is still checked as the CPU checks it (a read).
            let gva = g.address(insn, 0)?;
            g.probe(gva, 1, Access::Read)?;
        }
        Mnemonic::Rdpru => {
            if g.sregs.cr4 & CR4_TSD != 0 && g.cpl() != 0 {
                return fault(UD, None);
            }
            // The guest's CPUID offers RDPRU, but KVM gives Lucid no view of the guest's
            // MPERF/APERF: say so rather than make up a count.
            return unsupported(
                insn,
                "reading MPERF/APERF for a guest whose CPUID offers RDPRU",
            );
        }
        Mnemonic::Invpcid => complete_invpcid(g, insn)?,
        _ => return unsupported(insn, "no completion for this instruction"),
    }
    // The instruction completed: RF clears, RIP moves on.
    g.regs.rflags &= !flags::RF;
    g.regs.rip = next;
    Ok(())
}

/// Legacy-encoded integer SSE on XMM registers (VEX/EVEX would need the upper lanes and AVX
/// state; MMX forms the x87 register file).
fn complete_sse<S: CpuState + ?Sized>(g: &mut Ctx<'_, S>, insn: &Instruction) -> Res<()> {
    if insn.encoding() != EncodingKind::Legacy {
        return unsupported(insn, "VEX/EVEX encoding");
    }
    if (0..insn.op_count())
        .any(|i| insn.op_kind(i) == OpKind::Register && insn.op_register(i).is_mm())
    {
        return unsupported(insn, "MMX form");
    }
    g.sse_usable()?;
    // A 16-byte memory operand must be aligned, except for the unaligned moves.
    if insn.memory_size().size() == 16
        && !matches!(insn.mnemonic(), Mnemonic::Movdqu | Mnemonic::Movups)
    {
        for op in 0..insn.op_count() {
            if insn.op_kind(op) == OpKind::Memory && g.address(insn, op)? & 15 != 0 {
                return fault(GP, Some(0));
            }
        }
    }
    let mut fpu = g.cpu.fpu()?;
    let dst = insn.op_register(0);
    if insn.op_kind(0) == OpKind::Memory {
        // Stores: movd/movq/movdqa/movdqu/movaps/movups m, xmm.
        let v = g.read_xmm_op(insn, 1, &fpu)?;
        let size = insn.memory_size().size();
        let gva = g.address(insn, 0)?;
        g.write(gva, &v.to_le_bytes()[..size], Access::Write)?;
    } else if !dst.is_xmm() {
        // movd/movq r, xmm.
        let v = g.read_xmm_op(insn, 1, &fpu)?;
        g.set(insn, dst, v as u64)?;
    } else {
        let a = u128::from_le_bytes(fpu.xmm[dst.number()]);
        let b = g.read_xmm_op(insn, 1, &fpu)?;
        let imm = (0..insn.op_count())
            .any(|i| insn.op_kind(i) == OpKind::Immediate8)
            .then(|| insn.immediate8());
        let Some(r) = sse::compute(insn.mnemonic(), a, b, imm) else {
            return unsupported(insn, "this SSE instruction form");
        };
        fpu.xmm[dst.number()] = r.to_le_bytes();
        g.cpu.set_fpu(&fpu)?;
    }
    Ok(())
}

/// INVPCID: the operand checks of the SDM, then a full flush of the guest's TLB, which covers
/// every type (one address, one PCID, all with or without globals).
fn complete_invpcid<S: CpuState + ?Sized>(g: &mut Ctx<'_, S>, insn: &Instruction) -> Res<()> {
    if g.cr0_pe_off_or_v86() {
        return fault(UD, None);
    }
    if g.cpl() != 0 {
        return fault(GP, Some(0));
    }
    let Some(kind) = g.get(insn.op_register(0)) else {
        return unsupported(insn, "type register");
    };
    let gva = g.address(insn, 1)?;
    let mut desc = [0u8; 16];
    g.read(gva, &mut desc, Access::Read)?;
    let pcid = u64::from_le_bytes(desc[..8].try_into().unwrap_or_default());
    let addr = u64::from_le_bytes(desc[8..].try_into().unwrap_or_default());
    let pcide = g.sregs.cr4 & CR4_PCIDE != 0;
    let bad = kind > 3
        || pcid >> 12 != 0
        || (kind <= 1 && pcid != 0 && !pcide)
        || (kind == 0 && !canonical(addr));
    if bad {
        return fault(GP, Some(0));
    }
    g.cpu.flush_tlb()?;
    Ok(())
}

impl<S: CpuState + ?Sized> Ctx<'_, S> {
    /// Real mode or virtual-8086 mode, where some system instructions are #UD.
    fn cr0_pe_off_or_v86(&self) -> bool {
        self.sregs.cr0 & CR0_PE == 0 || self.regs.rflags & flags::VM != 0
    }
}
