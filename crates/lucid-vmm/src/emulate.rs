//! Completing instructions that KVM's emulator could not. On hosts where guest kernel code is
//! emulated (PVM), KVM stops at instructions its emulator lacks and reports them with
//! `KVM_INTERNAL_ERROR_EMULATION` and the instruction bytes. Lucid decodes them with iced-x86;
//! those it knows how to finish it finishes and resumes the guest, and it counts them; any other
//! stops the VM with a report of the instruction and the guest state.

use std::collections::HashMap;
use std::sync::Arc;

use iced_x86::{
    Decoder, DecoderOptions, Formatter, Instruction, IntelFormatter, Mnemonic, OpKind, Register,
};
use lucid_hv::kvm_bindings::{kvm_fpu, kvm_regs, kvm_sregs};
use lucid_hv::{InternalError, Vcpu};
use lucid_mem::GuestMemoryMmap;
use lucid_stats::{Counter, StatsRegistry};

/// Decoded bytes of a failed instruction, for reports.
fn describe(bytes: &[u8], bitness: u32, rip: u64) -> (String, Option<iced_x86::Instruction>) {
    if bytes.is_empty() {
        return ("<no instruction bytes reported>".into(), None);
    }
    let mut dec = Decoder::with_ip(bitness, bytes, rip, DecoderOptions::NONE);
    let insn = dec.decode();
    let hex: Vec<String> = bytes.iter().map(|b| format!("{b:02x}")).collect();
    if insn.is_invalid() {
        return (format!("<undecodable> ({})", hex.join(" ")), None);
    }
    let mut text = String::new();
    IntelFormatter::new().format(&insn, &mut text);
    let used = insn.len().min(bytes.len());
    (format!("`{text}` ({})", hex[..used].join(" ")), Some(insn))
}

/// RFLAGS bits the completed instructions set.
mod flags {
    pub const CF: u64 = 1 << 0;
    pub const PF: u64 = 1 << 2;
    pub const AF: u64 = 1 << 4;
    pub const ZF: u64 = 1 << 6;
    pub const SF: u64 = 1 << 7;
    pub const OF: u64 = 1 << 11;
    pub const AC: u64 = 1 << 18;
    pub const ARITH: u64 = CF | PF | AF | ZF | SF | OF;
}

/// Why an instruction was not completed.
enum NotDone {
    /// Lucid has no completion for this instruction (or this form of it).
    Unsupported(&'static str),
    /// The completion failed (register access, a guest address that does not translate).
    Failed(String),
}

impl<E: std::fmt::Display> From<E> for NotDone
where
    E: std::error::Error,
{
    fn from(e: E) -> Self {
        NotDone::Failed(e.to_string())
    }
}

/// The guest state one completion works on: registers are read once, changed here and written
/// back once; guest memory is reached through the vCPU's page tables.
struct Guest<'a> {
    vcpu: &'a Vcpu,
    mem: Option<&'a GuestMemoryMmap>,
    regs: kvm_regs,
    sregs: kvm_sregs,
    sregs_dirty: bool,
}

impl Guest<'_> {
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

    /// A general-purpose register's value, at its size (AH..BH are the high bytes).
    fn get(&mut self, reg: Register) -> Option<u64> {
        if reg.is_segment_register() {
            let s = &self.sregs;
            return Some(match reg {
                Register::ES => s.es.base,
                Register::CS => s.cs.base,
                Register::SS => s.ss.base,
                Register::DS => s.ds.base,
                Register::FS => s.fs.base,
                Register::GS => s.gs.base,
                _ => return None,
            });
        }
        if reg == Register::RIP {
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
    fn set(&mut self, reg: Register, val: u64) -> Result<(), NotDone> {
        let high = matches!(
            reg,
            Register::AH | Register::CH | Register::DH | Register::BH
        );
        let size = reg.size();
        let slot = self
            .gpr_slot(reg.full_register())
            .ok_or(NotDone::Unsupported("destination register"))?;
        *slot = match (size, high) {
            (1, true) => (*slot & !0xff00) | ((val & 0xff) << 8),
            (1, false) => (*slot & !0xff) | (val & 0xff),
            (2, _) => (*slot & !0xffff) | (val & 0xffff),
            (4, _) => val & 0xffff_ffff,
            _ => val,
        };
        Ok(())
    }

    /// The guest-virtual address of memory operand `op`.
    fn address(&mut self, insn: &Instruction, op: u32) -> Result<u64, NotDone> {
        let regs = self.regs;
        let sregs = self.sregs;
        let mut g = Guest {
            vcpu: self.vcpu,
            mem: None,
            regs,
            sregs,
            sregs_dirty: false,
        };
        insn.try_virtual_address(op, 0, |r, _, _| g.get(r))
            .ok_or(NotDone::Unsupported("memory operand addressing"))
    }

    /// Copies between guest-virtual memory and `buf`, page by page.
    fn access(&self, gva: u64, buf: &mut [u8], write: bool) -> Result<(), NotDone> {
        use lucid_mem::vm_memory::{Bytes, GuestAddress};
        let mem = self
            .mem
            .ok_or(NotDone::Unsupported("guest memory access"))?;
        let mut done = 0usize;
        while done < buf.len() {
            let va = gva.wrapping_add(done as u64);
            let in_page = (0x1000 - (va & 0xfff)) as usize;
            let n = in_page.min(buf.len() - done);
            let gpa = self
                .vcpu
                .translate(va)?
                .ok_or_else(|| NotDone::Failed(format!("guest address {va:#x} is not mapped")))?;
            let chunk = &mut buf[done..done + n];
            let r = if write {
                mem.write_slice(chunk, GuestAddress(gpa))
            } else {
                mem.read_slice(chunk, GuestAddress(gpa))
            };
            r.map_err(|e| NotDone::Failed(format!("guest physical {gpa:#x}: {e}")))?;
            done += n;
        }
        Ok(())
    }

    /// The value of operand `op` (register or memory), zero-extended, and its size in bytes.
    fn read_op(&mut self, insn: &Instruction, op: u32) -> Result<(u64, usize), NotDone> {
        match insn.op_kind(op) {
            OpKind::Register => {
                let r = insn.op_register(op);
                let v = self.get(r).ok_or(NotDone::Unsupported("source register"))?;
                Ok((v, r.size()))
            }
            OpKind::Memory => {
                let size = insn.memory_size().size();
                if !matches!(size, 1 | 2 | 4 | 8) {
                    return Err(NotDone::Unsupported("memory operand size"));
                }
                let gva = self.address(insn, op)?;
                let mut b = [0u8; 8];
                self.access(gva, &mut b[..size], false)?;
                Ok((u64::from_le_bytes(b), size))
            }
            _ => Err(NotDone::Unsupported("operand kind")),
        }
    }

    /// The 128-bit value of an XMM register or a memory operand (of its size, zero-extended).
    fn read_xmm_op(&mut self, insn: &Instruction, op: u32, fpu: &kvm_fpu) -> Result<u128, NotDone> {
        match insn.op_kind(op) {
            OpKind::Register => {
                let r = insn.op_register(op);
                if r.is_xmm() {
                    let i = r.number();
                    Ok(u128::from_le_bytes(fpu.xmm[i]))
                } else {
                    Ok(self.read_op(insn, op)?.0 as u128)
                }
            }
            OpKind::Memory => {
                let size = insn.memory_size().size();
                if !matches!(size, 4 | 8 | 16) {
                    return Err(NotDone::Unsupported("SSE memory operand size"));
                }
                let gva = self.address(insn, op)?;
                let mut b = [0u8; 16];
                self.access(gva, &mut b[..size], false)?;
                Ok(u128::from_le_bytes(b))
            }
            OpKind::Immediate8 => Ok(insn.immediate8() as u128),
            _ => Err(NotDone::Unsupported("SSE operand kind")),
        }
    }

    fn set_flags(&mut self, mask: u64, set: u64) {
        self.regs.rflags = (self.regs.rflags & !mask) | (set & mask);
    }
}

/// Integer SSE instructions on 128-bit values (little-endian lanes), enough for the kernel's
/// SIMD code that runs during boot (e.g. BLAKE2s-SSSE3 in the random pool).
mod sse {
    use iced_x86::Mnemonic;

    pub fn handles(m: Mnemonic) -> bool {
        use Mnemonic::*;
        matches!(
            m,
            Movd | Movq
                | Movdqa
                | Movdqu
                | Movaps
                | Movups
                | Pxor
                | Por
                | Pand
                | Pandn
                | Xorps
                | Paddd
                | Paddq
                | Psubd
                | Psubq
                | Punpckldq
                | Punpcklqdq
                | Punpckhdq
                | Punpckhqdq
                | Pshufd
                | Pshufb
                | Psrld
                | Pslld
                | Psrlq
                | Psllq
                | Psrldq
                | Pslldq
                | Pcmpeqd
                | Palignr
        )
    }

    fn lanes32(v: u128) -> [u32; 4] {
        std::array::from_fn(|i| (v >> (32 * i)) as u32)
    }
    fn from32(l: [u32; 4]) -> u128 {
        l.iter()
            .enumerate()
            .fold(0, |acc, (i, &x)| acc | (x as u128) << (32 * i))
    }
    fn lanes64(v: u128) -> [u64; 2] {
        [v as u64, (v >> 64) as u64]
    }
    fn from64(l: [u64; 2]) -> u128 {
        l[0] as u128 | (l[1] as u128) << 64
    }

    /// `dst op src` for register destinations; `imm` for the forms with an immediate. The shift
    /// forms take their count from `src` when there is no immediate.
    pub fn compute(m: Mnemonic, dst: u128, src: u128, imm: Option<u8>) -> Option<u128> {
        use Mnemonic::*;
        let count = imm.map(u64::from).unwrap_or(src as u64);
        let (d32, s32) = (lanes32(dst), lanes32(src));
        let (d64, s64) = (lanes64(dst), lanes64(src));
        Some(match m {
            // movd/movq into an XMM register zero the rest of it.
            Movd => src as u32 as u128,
            Movq => src as u64 as u128,
            Movdqa | Movdqu | Movaps | Movups => src,
            Pxor | Xorps => dst ^ src,
            Por => dst | src,
            Pand => dst & src,
            Pandn => !dst & src,
            Paddd => from32(std::array::from_fn(|i| d32[i].wrapping_add(s32[i]))),
            Psubd => from32(std::array::from_fn(|i| d32[i].wrapping_sub(s32[i]))),
            Paddq => from64([d64[0].wrapping_add(s64[0]), d64[1].wrapping_add(s64[1])]),
            Psubq => from64([d64[0].wrapping_sub(s64[0]), d64[1].wrapping_sub(s64[1])]),
            Pcmpeqd => from32(std::array::from_fn(|i| {
                if d32[i] == s32[i] {
                    u32::MAX
                } else {
                    0
                }
            })),
            Punpckldq => from32([d32[0], s32[0], d32[1], s32[1]]),
            Punpckhdq => from32([d32[2], s32[2], d32[3], s32[3]]),
            Punpcklqdq => from64([d64[0], s64[0]]),
            Punpckhqdq => from64([d64[1], s64[1]]),
            Pshufd => {
                let i = imm?;
                from32(std::array::from_fn(|k| s32[((i >> (2 * k)) & 3) as usize]))
            }
            Pshufb => {
                let (d, s) = (dst.to_le_bytes(), src.to_le_bytes());
                let r: [u8; 16] = std::array::from_fn(|k| {
                    if s[k] & 0x80 != 0 {
                        0
                    } else {
                        d[(s[k] & 15) as usize]
                    }
                });
                u128::from_le_bytes(r)
            }
            Psrld | Pslld => {
                if count > 31 {
                    0
                } else if m == Psrld {
                    from32(d32.map(|x| x >> count))
                } else {
                    from32(d32.map(|x| x << count))
                }
            }
            Psrlq | Psllq => {
                if count > 63 {
                    0
                } else if m == Psrlq {
                    from64(d64.map(|x| x >> count))
                } else {
                    from64(d64.map(|x| x << count))
                }
            }
            Psrldq | Pslldq => {
                let bytes = imm? as u32;
                if bytes > 15 {
                    0
                } else if m == Psrldq {
                    dst >> (8 * bytes)
                } else {
                    dst << (8 * bytes)
                }
            }
            Palignr => {
                // (dst:src) >> (8 * imm), low 128 bits.
                let sh = imm? as u32 * 8;
                let wide = [src, dst];
                if sh >= 256 {
                    0
                } else if sh >= 128 {
                    wide[1] >> (sh - 128)
                } else if sh == 0 {
                    src
                } else {
                    (src >> sh) | (dst << (128 - sh))
                }
            }
            _ => return None,
        })
    }
}

/// CRC-32C (Castagnoli, reflected), one byte at a time, as the SSE4.2 `crc32` instruction.
fn crc32c(mut crc: u32, data: &[u8]) -> u32 {
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

/// A random 64-bit value for `rdrand`/`rdseed`, from the host's kernel.
fn host_random() -> Option<u64> {
    let mut b = [0u8; 8];
    // SAFETY: getrandom writes at most `b.len()` bytes into the buffer it is given.
    let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), b.len(), 0) };
    (n == 8).then(|| u64::from_le_bytes(b))
}

/// Completes `insn` on `g`; the caller writes the registers back and counts it.
fn complete_insn(g: &mut Guest<'_>, insn: &Instruction) -> Result<(), NotDone> {
    let next = g.regs.rip.wrapping_add(insn.len() as u64);
    match insn.mnemonic() {
        Mnemonic::Int3 => {
            // INT3 is a trap: the handler's return address is the next instruction.
            g.regs.rip = next;
            g.vcpu.inject_exception(3, None)?;
            return Ok(());
        }
        Mnemonic::Popcnt | Mnemonic::Lzcnt | Mnemonic::Tzcnt => {
            let (src, size) = g.read_op(insn, 1)?;
            let bits = (size * 8) as u32;
            let (res, cf) = match insn.mnemonic() {
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
            g.set(insn.op_register(0), res as u64)?;
            let zf = if insn.mnemonic() == Mnemonic::Popcnt {
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
            let crc = g
                .get(dst)
                .ok_or(NotDone::Unsupported("crc32 destination"))? as u32;
            let out = crc32c(crc, &src.to_le_bytes()[..size]);
            // The result is 32 bits, zero-extended into a 64-bit destination.
            g.set(dst.full_register32(), out as u64)?;
        }
        Mnemonic::Rdrand | Mnemonic::Rdseed => {
            let dst = insn.op_register(0);
            match host_random() {
                Some(v) => {
                    g.set(dst, v)?;
                    g.set_flags(flags::ARITH, flags::CF);
                }
                None => {
                    g.set(dst, 0)?;
                    g.set_flags(flags::ARITH, 0);
                }
            }
        }
        // SMAP: user-access windows open and close with the AC flag.
        Mnemonic::Clac => g.regs.rflags &= !flags::AC,
        Mnemonic::Stac => g.regs.rflags |= flags::AC,
        // FSGSBASE: the kernel reads and writes the segment bases directly.
        Mnemonic::Rdfsbase | Mnemonic::Rdgsbase => {
            let base = if insn.mnemonic() == Mnemonic::Rdfsbase {
                g.sregs.fs.base
            } else {
                g.sregs.gs.base
            };
            g.set(insn.op_register(0), base)?;
        }
        Mnemonic::Wrfsbase | Mnemonic::Wrgsbase => {
            let (v, _) = g.read_op(insn, 0)?;
            if insn.mnemonic() == Mnemonic::Wrfsbase {
                g.sregs.fs.base = v;
            } else {
                g.sregs.gs.base = v;
            }
            g.sregs_dirty = true;
        }
        // x87 and SSE control: state through KVM_GET/SET_FPU.
        Mnemonic::Wait => {
            // With CR0.TS and CR0.MP set, WAIT raises #NM; with an unmasked x87 exception
            // pending (FSW.ES), #MF. Both are faults: the handler returns to the WAIT.
            if g.sregs.cr0 & 0xa == 0xa {
                g.vcpu.inject_exception(7, None)?;
                return Ok(());
            }
            if g.vcpu.get_fpu()?.fsw & 0x80 != 0 {
                g.vcpu.inject_exception(16, None)?;
                return Ok(());
            }
        }
        Mnemonic::Fnclex | Mnemonic::Emms => {
            let mut fpu = g.vcpu.get_fpu()?;
            if insn.mnemonic() == Mnemonic::Fnclex {
                // Clear the exception flags, the summary and busy bits.
                fpu.fsw &= !0x80ff;
            } else {
                // EMMS marks every x87 register empty (the abridged tag word is 0 for empty).
                fpu.ftwx = 0;
            }
            g.vcpu.set_fpu(&fpu)?;
        }
        Mnemonic::Ldmxcsr | Mnemonic::Stmxcsr => {
            let gva = g.address(insn, 0)?;
            let mut fpu = g.vcpu.get_fpu()?;
            let mut b = fpu.mxcsr.to_le_bytes();
            if insn.mnemonic() == Mnemonic::Ldmxcsr {
                g.access(gva, &mut b, false)?;
                fpu.mxcsr = u32::from_le_bytes(b);
                g.vcpu.set_fpu(&fpu)?;
            } else {
                g.access(gva, &mut b, true)?;
            }
        }
        m if sse::handles(m) => {
            // Legacy-SSE forms only (VEX/EVEX would need the upper lanes and AVX state).
            if insn.encoding() != iced_x86::EncodingKind::Legacy {
                return Err(NotDone::Unsupported("VEX/EVEX-encoded SSE instruction"));
            }
            let mut fpu = g.vcpu.get_fpu()?;
            let dst = insn.op_register(0);
            if insn.op_kind(0) == OpKind::Memory {
                // Stores: movd/movq/movdqa/movdqu m, xmm.
                let v = g.read_xmm_op(insn, 1, &fpu)?;
                let size = insn.memory_size().size();
                let gva = g.address(insn, 0)?;
                let mut b = v.to_le_bytes();
                g.access(gva, &mut b[..size], true)?;
            } else if !dst.is_xmm() {
                // movd/movq r, xmm.
                let v = g.read_xmm_op(insn, 1, &fpu)?;
                g.set(dst, v as u64)?;
            } else {
                let a = u128::from_le_bytes(fpu.xmm[dst.number()]);
                let b = g.read_xmm_op(insn, 1, &fpu)?;
                let imm = (0..insn.op_count())
                    .any(|i| insn.op_kind(i) == OpKind::Immediate8)
                    .then(|| insn.immediate8());
                let r = sse::compute(insn.mnemonic(), a, b, imm)
                    .ok_or(NotDone::Unsupported("this SSE instruction form"))?;
                fpu.xmm[dst.number()] = r.to_le_bytes();
                g.vcpu.set_fpu(&fpu)?;
            }
        }
        _ => return Err(NotDone::Unsupported("no completion for this instruction")),
    }
    g.regs.rip = next;
    Ok(())
}

/// Per-vCPU state of the completer; counts by mnemonic go to the stats registry as
/// `vcpuN.emulated.<mnemonic>`.
pub struct Emulator {
    id: u32,
    mem: Option<GuestMemoryMmap>,
    stats: Option<Arc<StatsRegistry>>,
    counters: HashMap<Mnemonic, Arc<Counter>>,
    /// Mnemonics completed so far (each once), for the report.
    pub completed: Vec<String>,
}

impl Default for Emulator {
    fn default() -> Self {
        Self::new()
    }
}

impl Emulator {
    /// A completer without guest memory: only instructions with no memory operand complete.
    pub fn new() -> Self {
        Emulator {
            id: 0,
            mem: None,
            stats: None,
            counters: HashMap::new(),
            completed: Vec::new(),
        }
    }

    /// A completer for vCPU `id` that reaches guest memory and counts what it completes.
    pub fn with_memory(id: u32, mem: GuestMemoryMmap, stats: Arc<StatsRegistry>) -> Self {
        Emulator {
            id,
            mem: Some(mem),
            stats: Some(stats),
            ..Self::new()
        }
    }

    fn count(&mut self, m: Mnemonic) {
        let name = format!("{m:?}").to_lowercase();
        if let Some(stats) = &self.stats {
            let id = self.id;
            self.counters
                .entry(m)
                .or_insert_with(|| stats.counter(format!("vcpu{id}.emulated.{name}")))
                .inc();
        }
        if !self.completed.contains(&name) {
            self.completed.push(name);
        }
    }

    /// Completes the failed instruction, or returns a one-paragraph report of why not.
    pub fn complete(&mut self, vcpu: &mut Vcpu, err: &InternalError) -> Result<(), String> {
        let id = vcpu.id();
        let regs = vcpu.get_regs().map_err(|e| e.to_string())?;
        let sregs = vcpu.get_sregs().map_err(|e| e.to_string())?;
        let bitness = if sregs.cs.l != 0 {
            64
        } else if sregs.cs.db != 0 {
            32
        } else {
            16
        };
        if !err.is_emulation_failure() {
            return Err(format!(
                "vCPU {id}: KVM internal error, suberror {} data {:x?} at rip={:#x} (cs.l={} cpl={})",
                err.suberror, err.data, regs.rip, sregs.cs.l, sregs.cs.dpl
            ));
        }
        let (text, insn) = describe(&err.insn_bytes, bitness, regs.rip);
        let why = match insn {
            Some(insn) => {
                let mut g = Guest {
                    vcpu,
                    mem: self.mem.as_ref(),
                    regs,
                    sregs,
                    sregs_dirty: false,
                };
                match complete_insn(&mut g, &insn) {
                    Ok(()) => {
                        if g.sregs_dirty {
                            vcpu.set_sregs(&g.sregs).map_err(|e| e.to_string())?;
                        }
                        if g.regs != regs {
                            vcpu.set_regs(&g.regs).map_err(|e| e.to_string())?;
                        }
                        self.count(insn.mnemonic());
                        return Ok(());
                    }
                    Err(NotDone::Unsupported(what)) => format!("Lucid cannot complete it: {what}"),
                    Err(NotDone::Failed(e)) => format!("Lucid's completion failed: {e}"),
                }
            }
            None => "Lucid cannot complete it".into(),
        };
        Err(format!(
            "vCPU {id}: KVM could not emulate {text} at rip={:#x}, and {why} \
             ({bitness}-bit, cpl={}, cr0={:#x} cr3={:#x} cr4={:#x} efer={:#x}, rsp={:#x} \
             rax={:#x} rbx={:#x} rcx={:#x} rdx={:#x} rsi={:#x} rdi={:#x})",
            regs.rip,
            sregs.cs.dpl,
            sregs.cr0,
            sregs.cr3,
            sregs.cr4,
            sregs.efer,
            regs.rsp,
            regs.rax,
            regs.rbx,
            regs.rcx,
            regs.rdx,
            regs.rsi,
            regs.rdi,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn describes_known_and_garbage_bytes() {
        let (t, i) = describe(&[0xcc], 64, 0x1000);
        assert!(t.contains("int3"), "{t}");
        assert_eq!(i.unwrap().len(), 1);
        let (t, _) = describe(&[0x48, 0x0f, 0xc7, 0x0f], 64, 0);
        assert!(t.contains("cmpxchg16b"), "{t}");
        let (t, i) = describe(&[], 64, 0);
        assert!(i.is_none() && t.contains("no instruction"));
    }

    #[test]
    fn sse_lanes() {
        use sse::compute;
        let a: u128 = 0x0000_0004_0000_0003_0000_0002_0000_0001;
        let b: u128 = 0x0000_0040_0000_0030_0000_0020_ffff_ffff;
        assert_eq!(
            compute(Mnemonic::Paddd, a, b, None),
            Some(0x0000_0044_0000_0033_0000_0022_0000_0000)
        );
        assert_eq!(
            compute(Mnemonic::Punpckldq, a, b, None),
            Some(0x0000_0020_0000_0002_ffff_ffff_0000_0001)
        );
        assert_eq!(
            compute(Mnemonic::Punpcklqdq, a, b, None),
            Some(0x0000_0020_ffff_ffff_0000_0002_0000_0001)
        );
        // pshufd 0x93 rotates the dwords up by one: [3,0,1,2].
        assert_eq!(
            compute(Mnemonic::Pshufd, 0, a, Some(0x93)),
            Some(0x0000_0003_0000_0002_0000_0001_0000_0004)
        );
        assert_eq!(
            compute(Mnemonic::Psrld, a, 0, Some(1)),
            Some(0x0000_0002_0000_0001_0000_0001_0000_0000)
        );
        assert_eq!(compute(Mnemonic::Pslld, a, 0, Some(32)), Some(0));
        // pshufb with a byte-reversing mask; a set top bit zeroes the byte.
        let rev = u128::from_le_bytes(std::array::from_fn(|i| 15 - i as u8));
        assert_eq!(
            compute(Mnemonic::Pshufb, a, rev, None),
            Some(a.swap_bytes())
        );
        let zero = u128::from_le_bytes([0x80; 16]);
        assert_eq!(compute(Mnemonic::Pshufb, a, zero, None), Some(0));
        assert_eq!(
            compute(Mnemonic::Movd, a, 0x1_2345_6789, None),
            Some(0x2345_6789)
        );
        assert_eq!(
            compute(Mnemonic::Palignr, a, b, Some(4)),
            Some((b >> 32) | (a << 96))
        );
    }

    #[test]
    fn crc32c_matches_the_standard_check_value() {
        // CRC-32C of "123456789" is 0xE3069283 (initial value and final xor 0xFFFFFFFF).
        assert_eq!(crc32c(!0, b"123456789") ^ !0, 0xe306_9283);
    }

    #[test]
    fn decodes_the_instructions_it_completes() {
        for (bytes, m) in [
            (&[0xf3, 0x48, 0x0f, 0xb8, 0xc7][..], Mnemonic::Popcnt),
            (&[0xf3, 0x48, 0x0f, 0xbd, 0xc7][..], Mnemonic::Lzcnt),
            (&[0xf3, 0x48, 0x0f, 0xbc, 0xc7][..], Mnemonic::Tzcnt),
            (&[0xf2, 0x48, 0x0f, 0x38, 0xf1, 0xc7][..], Mnemonic::Crc32),
            (&[0x48, 0x0f, 0xc7, 0xf0][..], Mnemonic::Rdrand),
            (&[0x0f, 0x01, 0xca][..], Mnemonic::Clac),
            (&[0x66, 0x44, 0x0f, 0x6e, 0xf9][..], Mnemonic::Movd),
            (&[0x66, 0x0f, 0x38, 0x00, 0xc1][..], Mnemonic::Pshufb),
            (&[0x9b][..], Mnemonic::Wait),
            (&[0xdb, 0xe2][..], Mnemonic::Fnclex),
            (&[0x0f, 0xae, 0x17][..], Mnemonic::Ldmxcsr),
            (&[0x0f, 0x01, 0xcb][..], Mnemonic::Stac),
            (&[0xf3, 0x48, 0x0f, 0xae, 0xc8][..], Mnemonic::Rdgsbase),
            (&[0xf3, 0x48, 0x0f, 0xae, 0xd8][..], Mnemonic::Wrgsbase),
        ] {
            let (_, i) = describe(bytes, 64, 0);
            assert_eq!(i.unwrap().mnemonic(), m);
        }
    }
}
