//! Completing instructions that KVM's emulator could not. On hosts where guest kernel code is
//! emulated (PVM), KVM stops at instructions its emulator lacks and reports them with
//! `KVM_INTERNAL_ERROR_EMULATION` and the instruction bytes. Lucid decodes them with iced-x86
//! and does what the CPU would: completes the instruction, or makes the guest take the fault the
//! CPU would raise (#UD where the guest's CPUID lacks the feature, #GP for a bad operand, #PF for
//! an address that does not translate); then the guest resumes. Anything else stops the VM with
//! a report of the instruction and the guest state. The exit loop offers each internal error to
//! the registry's hook first ([`crate::hooks::InternalErrorHook`]); the completer gets those the
//! hook leaves alone.
//!
//! The completer works on a [`CpuState`]: [`KvmCpu`] for a real vCPU, [`MockCpu`] in unit tests
//! and fuzzing; [`complete_with`] is the whole completer on one instruction.

mod insns;
mod interrupt;
mod sse;
mod state;
#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

use iced_x86::{Decoder, DecoderError, DecoderOptions, Formatter, IntelFormatter, Mnemonic};
use lucid_hv::kvm_bindings::{kvm_cpuid_entry2, kvm_regs, kvm_sregs};
use lucid_hv::{HvError, InternalError, Vcpu};
use lucid_mem::vm_memory::GuestMemoryError;
use lucid_mem::GuestMemoryMmap;
use lucid_stats::{Counter, StatsRegistry};
use thiserror::Error;

pub use state::{CpuState, KvmCpu, MockCpu};

/// Why an instruction could not be completed.
#[derive(Debug, Error)]
pub enum EmulateError {
    #[error("KVM reported no instruction bytes")]
    NoBytes,
    #[error("the instruction bytes {bytes:02x?} end before the instruction does")]
    Truncated { bytes: Vec<u8> },
    #[error("the bytes {bytes:02x?} do not decode to an instruction")]
    Undecodable { bytes: Vec<u8> },
    #[error("Lucid has no completion for `{mnemonic:?}` ({form})")]
    Unsupported {
        mnemonic: Mnemonic,
        form: &'static str,
    },
    #[error("guest-physical {gpa:#x} ({len} bytes) is not guest RAM")]
    NotRam {
        gpa: u64,
        len: usize,
        #[source]
        source: Option<GuestMemoryError>,
    },
    #[error("the completer has no access to guest memory")]
    NoMemory,
    #[error("reading or writing the vCPU's state")]
    Kvm(#[from] HvError),
}

/// An exception the guest takes instead of the instruction completing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Exception {
    pub vector: u8,
    pub error_code: Option<u32>,
    /// For #PF: the linear address that did not translate (CR2).
    pub address: Option<u64>,
}

/// Exception vectors the completer raises.
pub mod vector {
    pub const BP: u8 = 3;
    pub const UD: u8 = 6;
    pub const NM: u8 = 7;
    pub const TS: u8 = 10;
    pub const NP: u8 = 11;
    pub const SS: u8 = 12;
    pub const GP: u8 = 13;
    pub const PF: u8 = 14;
    pub const MF: u8 = 16;
}

/// What became of one instruction.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Outcome {
    pub mnemonic: Mnemonic,
    /// `None`: the instruction completed and RIP moved on (or, for INT n, to the handler);
    /// otherwise the guest takes this exception at the instruction.
    pub fault: Option<Exception>,
}

/// The guest's code size from its CS and EFER.
fn bitness(sregs: &kvm_sregs) -> u32 {
    if sregs.efer & insns::EFER_LMA != 0 && sregs.cs.l != 0 {
        64
    } else if sregs.cs.db != 0 {
        32
    } else {
        16
    }
}

fn decode(bytes: &[u8], bitness: u32, rip: u64) -> Result<iced_x86::Instruction, EmulateError> {
    if bytes.is_empty() {
        return Err(EmulateError::NoBytes);
    }
    let mut dec = Decoder::with_ip(bitness, bytes, rip, DecoderOptions::NONE);
    let insn = dec.decode();
    match dec.last_error() {
        DecoderError::None if !insn.is_invalid() => Ok(insn),
        DecoderError::NoMoreBytes => Err(EmulateError::Truncated {
            bytes: bytes.to_vec(),
        }),
        _ => Err(EmulateError::Undecodable {
            bytes: bytes.to_vec(),
        }),
    }
}

/// The mnemonic of `bytes` when they are only invalid for a LOCK prefix the instruction does
/// not allow.
fn lock_misuse(bytes: &[u8], bitness: u32, rip: u64) -> Option<Mnemonic> {
    let mut dec = Decoder::with_ip(bitness, bytes, rip, DecoderOptions::NO_INVALID_CHECK);
    let insn = dec.decode();
    (!insn.is_invalid() && insn.has_lock_prefix()).then(|| insn.mnemonic())
}

/// Completes the instruction `bytes` (as KVM reported them) on `cpu`: the whole completer, for
/// the exit loop and for fuzzing with a [`MockCpu`]. Registers change only when the instruction
/// completes; when it faults, the exception is injected with RIP left at the instruction.
pub fn complete_with<S: CpuState + ?Sized>(
    cpu: &mut S,
    bytes: &[u8],
) -> Result<Outcome, EmulateError> {
    let regs = cpu.regs()?;
    let sregs = cpu.sregs()?;
    let bits = bitness(&sregs);
    let decoded = decode(bytes, bits, regs.rip);
    if let (Err(EmulateError::Undecodable { .. }), Some(m)) =
        (&decoded, lock_misuse(bytes, bits, regs.rip))
    {
        // A LOCK prefix on an instruction that does not take one: #UD on the CPU.
        cpu.inject_exception(vector::UD, None)?;
        return Ok(Outcome {
            mnemonic: m,
            fault: Some(Exception {
                vector: vector::UD,
                error_code: None,
                address: None,
            }),
        });
    }
    let insn = decoded?;
    let mnemonic = insn.mnemonic();
    let mut ctx = insns::Ctx::new(cpu, regs, sregs);
    match insns::complete(&mut ctx, &insn) {
        Ok(()) => {
            ctx.commit(&regs)?;
            Ok(Outcome {
                mnemonic,
                fault: None,
            })
        }
        Err(insns::Stop::Fault(e)) => {
            if let Some(cr2) = e.address {
                let mut s = sregs;
                s.cr2 = cr2;
                ctx.cpu.set_sregs(&s)?;
            }
            ctx.cpu.inject_exception(e.vector, e.error_code)?;
            Ok(Outcome {
                mnemonic,
                fault: Some(e),
            })
        }
        Err(insns::Stop::Error(e)) => Err(e),
    }
}

/// The instruction as reported: Intel syntax and bytes, for messages.
#[derive(Debug)]
pub struct InsnText {
    bytes: Vec<u8>,
    bitness: u32,
    rip: u64,
}

impl fmt::Display for InsnText {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let hex = |b: &[u8]| {
            b.iter()
                .map(|b| format!("{b:02x}"))
                .collect::<Vec<_>>()
                .join(" ")
        };
        match decode(&self.bytes, self.bitness, self.rip) {
            Ok(insn) => {
                let mut text = String::new();
                IntelFormatter::new().format(&insn, &mut text);
                let used = insn.len().min(self.bytes.len());
                write!(f, "`{text}` ({})", hex(&self.bytes[..used]))?;
            }
            Err(EmulateError::NoBytes) => write!(f, "<no instruction bytes reported>")?,
            Err(_) => write!(f, "<undecodable> ({})", hex(&self.bytes))?,
        }
        write!(f, " at rip={:#x}", self.rip)
    }
}

/// The guest's registers at the failure, for the report.
#[derive(Debug)]
pub struct Snapshot {
    regs: kvm_regs,
    sregs: kvm_sregs,
}

impl fmt::Display for Snapshot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (r, s) = (&self.regs, &self.sregs);
        write!(
            f,
            "{}-bit, cpl={}, cr0={:#x} cr3={:#x} cr4={:#x} efer={:#x}, rsp={:#x} rax={:#x} \
             rbx={:#x} rcx={:#x} rdx={:#x} rsi={:#x} rdi={:#x}",
            bitness(s),
            s.cs.dpl,
            s.cr0,
            s.cr3,
            s.cr4,
            s.efer,
            r.rsp,
            r.rax,
            r.rbx,
            r.rcx,
            r.rdx,
            r.rsi,
            r.rdi
        )
    }
}

/// Why the exit loop must stop after a KVM internal error.
#[derive(Debug, Error)]
pub enum CompleteError {
    #[error("vCPU {vcpu}: KVM internal error, suberror {suberror} data {data:x?} at rip={rip:#x}")]
    Internal {
        vcpu: u32,
        suberror: u32,
        data: Vec<u64>,
        rip: u64,
    },
    #[error("vCPU {vcpu}: KVM could not emulate {insn} ({state}), and Lucid did not complete it")]
    NotCompleted {
        vcpu: u32,
        insn: InsnText,
        state: Box<Snapshot>,
        #[source]
        source: EmulateError,
    },
    #[error("vCPU {vcpu}: reading the registers after an emulation failure")]
    Registers {
        vcpu: u32,
        #[source]
        source: HvError,
    },
}

/// Per-vCPU state of the completer; counts by mnemonic go to the stats registry as
/// `vcpuN.emulated.<mnemonic>`.
pub struct Emulator {
    id: u32,
    mem: Option<GuestMemoryMmap>,
    stats: Option<Arc<StatsRegistry>>,
    /// One entry per mnemonic completed so far (its counter when there is a registry).
    counters: HashMap<Mnemonic, Option<Arc<Counter>>>,
    /// KVM's CPUID for this vCPU, read at the first completion.
    cpuid: Option<Vec<kvm_cpuid_entry2>>,
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
            cpuid: None,
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

    /// Counts a completion; the first of each mnemonic on this vCPU is logged.
    fn count(&mut self, m: Mnemonic) {
        let (id, stats) = (self.id, &self.stats);
        let counter = self.counters.entry(m).or_insert_with(|| {
            log::info!("vCPU {id}: completing `{m:?}` for KVM's instruction emulator");
            let name = format!("vcpu{id}.emulated.{}", format!("{m:?}").to_lowercase());
            stats.as_ref().map(|s| s.counter(name))
        });
        if let Some(c) = counter {
            c.inc();
        }
    }

    /// Completes the instruction KVM could not emulate (or injects the fault it raises).
    pub fn complete(&mut self, vcpu: &mut Vcpu, err: &InternalError) -> Result<(), CompleteError> {
        let vcpu_id = vcpu.id();
        let registers = |source| CompleteError::Registers {
            vcpu: vcpu_id,
            source,
        };
        if !err.is_emulation_failure() {
            return Err(CompleteError::Internal {
                vcpu: vcpu_id,
                suberror: err.suberror,
                data: err.data.clone(),
                rip: vcpu.get_regs().map_err(registers)?.rip,
            });
        }
        if self.cpuid.is_none() {
            let entries = vcpu.get_cpuid().map_err(registers)?;
            self.cpuid = Some(entries.as_slice().to_vec());
        }
        let cpuid = self.cpuid.as_deref().unwrap_or_default();
        let mut cpu = KvmCpu::new(vcpu, self.mem.as_ref(), cpuid);
        match complete_with(&mut cpu, &err.insn_bytes) {
            Ok(outcome) => {
                if let Some(e) = outcome.fault {
                    log::debug!(
                        "vCPU {vcpu_id}: {:?} raises exception {} (error code {:?}) as the CPU \
                         would",
                        outcome.mnemonic,
                        e.vector,
                        e.error_code
                    );
                }
                self.count(outcome.mnemonic);
                Ok(())
            }
            Err(source) => {
                let regs = vcpu.get_regs().map_err(registers)?;
                let sregs = vcpu.get_sregs().map_err(registers)?;
                Err(CompleteError::NotCompleted {
                    vcpu: vcpu_id,
                    insn: InsnText {
                        bytes: err.insn_bytes.clone(),
                        bitness: bitness(&sregs),
                        rip: regs.rip,
                    },
                    state: Box::new(Snapshot { regs, sregs }),
                    source,
                })
            }
        }
    }
}
