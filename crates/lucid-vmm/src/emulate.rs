//! Completing instructions that KVM's emulator could not. On hosts where guest kernel code is
//! emulated (PVM), KVM stops at instructions its emulator lacks and reports them with
//! `KVM_INTERNAL_ERROR_EMULATION` and the instruction bytes. Lucid decodes them with iced-x86;
//! those it knows how to finish it finishes and resumes the guest, and it counts them; any other
//! stops the VM with a report of the instruction and the guest state.

use iced_x86::{Decoder, DecoderOptions, Formatter, IntelFormatter, Mnemonic};
use lucid_hv::{InternalError, Vcpu};

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

/// Per-vCPU state of the completer (counts by mnemonic live in the stats registry).
#[derive(Default)]
pub struct Emulator {
    /// Mnemonics completed so far, for the report.
    pub completed: Vec<String>,
}

impl Emulator {
    pub fn new() -> Self {
        Self::default()
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
        if let Some(insn) = insn {
            if insn.mnemonic() == Mnemonic::Int3 {
                // INT3 is a trap: the handler's return address is the next instruction.
                let mut r = regs;
                r.rip = regs.rip.wrapping_add(insn.len() as u64);
                vcpu.set_regs(&r).map_err(|e| e.to_string())?;
                vcpu.inject_exception(3, None).map_err(|e| e.to_string())?;
                self.completed.push("int3".into());
                return Ok(());
            }
        }
        Err(format!(
            "vCPU {id}: KVM could not emulate {text} at rip={:#x}, and Lucid cannot complete it \
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
}
