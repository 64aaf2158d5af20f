//! Software interrupts (INT n, INT3) delivered through the guest's IDT as the CPU does in
//! IA-32e mode: gate checks, the target code segment, the stack (IST, or the TSS's RSPn on a
//! privilege change), the five-word frame with RIP after the instruction, and RFLAGS. A check that
//! fails raises the CPU's fault instead, with RIP left at the instruction.

use iced_x86::Instruction;
use lucid_boot::regs::segment_from_gdt;
use lucid_hv::kvm_bindings::kvm_segment;

use super::insns::{canonical, fault, flags, Access, Ctx, Res, Stop};
use super::vector::{GP, NP, SS, TS};
use super::{CpuState, EmulateError};

/// An IDT gate in IA-32e mode (16 bytes).
struct Gate {
    offset: u64,
    selector: u16,
    ist: u8,
    kind: u8,
    dpl: u8,
    present: bool,
}

impl Gate {
    fn parse(b: [u8; 16]) -> Gate {
        let lo = u64::from_le_bytes(b[..8].try_into().unwrap_or_default());
        let hi = u64::from_le_bytes(b[8..].try_into().unwrap_or_default());
        Gate {
            offset: (lo & 0xffff) | ((lo >> 48) & 0xffff) << 16 | (hi & 0xffff_ffff) << 32,
            selector: (lo >> 16) as u16,
            ist: ((lo >> 32) & 7) as u8,
            kind: ((lo >> 40) & 0xf) as u8,
            dpl: ((lo >> 45) & 3) as u8,
            present: (lo >> 47) & 1 != 0,
        }
    }
}

const INTERRUPT_GATE: u8 = 0xe;
const TRAP_GATE: u8 = 0xf;

/// Delivers software interrupt `vector` (from `insn`, whose next instruction is at `next`).
pub fn deliver<S: CpuState + ?Sized>(
    g: &mut Ctx<'_, S>,
    insn: &Instruction,
    vector: u8,
    next: u64,
) -> Res<()> {
    if !g.long_mode() {
        // Real mode never gets here (KVM's emulator delivers through the IVT itself).
        return Err(Stop::Error(EmulateError::Unsupported {
            mnemonic: insn.mnemonic(),
            form: "software interrupt in legacy protected mode",
        }));
    }
    // Faults about the gate carry the vector with the IDT bit set (EXT clear: software).
    let idt_error = Some(vector as u32 * 8 + 2);
    let at = vector as u64 * 16;
    if at + 15 > g.sregs.idt.limit as u64 {
        return fault(GP, idt_error);
    }
    let mut raw = [0u8; 16];
    g.read(g.sregs.idt.base.wrapping_add(at), &mut raw, Access::SysRead)?;
    let gate = Gate::parse(raw);
    if gate.kind != INTERRUPT_GATE && gate.kind != TRAP_GATE {
        return fault(GP, idt_error);
    }
    let cpl = g.cpl();
    // INT n and INT3 may only use gates at or below their privilege.
    if gate.dpl < cpl {
        return fault(GP, idt_error);
    }
    if !gate.present {
        return fault(NP, idt_error);
    }

    let cs = code_segment(g, gate.selector)?;
    let sel_error = Some((gate.selector & 0xfffc) as u32);
    if cs.l == 0 || cs.db != 0 {
        return fault(GP, sel_error);
    }
    // A conforming segment keeps the CPL; otherwise the handler runs at the segment's DPL.
    let new_cpl = if cs.type_ & 0x4 != 0 { cpl } else { cs.dpl };

    let old_rsp = g.regs.rsp;
    let mut rsp = if gate.ist != 0 {
        tss_u64(g, 0x24 + 8 * (gate.ist as u32 - 1))?
    } else if new_cpl < cpl {
        tss_u64(g, 4 + 8 * new_cpl as u32)?
    } else {
        old_rsp
    };
    if !canonical(rsp) {
        return fault(SS, Some(0));
    }
    rsp &= !0xf;
    let old_ss = g.sregs.ss.selector as u64;
    let old_cs = g.sregs.cs.selector as u64;
    // Lowest address first: RIP, CS, RFLAGS, RSP, SS.
    let frame = [next, old_cs, g.regs.rflags, old_rsp, old_ss];
    let mut bytes = [0u8; 40];
    for (i, w) in frame.iter().enumerate() {
        bytes[i * 8..i * 8 + 8].copy_from_slice(&w.to_le_bytes());
    }
    rsp = rsp.wrapping_sub(40);
    if !canonical(gate.offset) {
        return fault(GP, Some(0));
    }
    g.write(rsp, &bytes, Access::SysWrite)?;

    g.regs.rsp = rsp;
    g.regs.rip = gate.offset;
    g.regs.rflags &= !(flags::TF | flags::NT | flags::RF | flags::VM);
    if gate.kind == INTERRUPT_GATE {
        g.regs.rflags &= !flags::IF;
    }
    let new_cs = kvm_segment {
        selector: (gate.selector & 0xfffc) | new_cpl as u16,
        type_: cs.type_ | 1,
        dpl: if cs.type_ & 0x4 != 0 { cs.dpl } else { new_cpl },
        ..cs
    };
    // The usual case, a kernel handler in the kernel's own code segment, leaves CS alone.
    let c = &g.sregs.cs;
    let same = (c.selector, c.base, c.dpl, c.l, c.db, c.present)
        == (
            new_cs.selector,
            new_cs.base,
            new_cs.dpl,
            new_cs.l,
            new_cs.db,
            1,
        );
    if !same {
        g.sregs.cs = new_cs;
        g.sregs_dirty = true;
    }
    if new_cpl < cpl {
        // A privilege change in 64-bit mode loads SS with a null selector at the new RPL.
        g.sregs.ss = kvm_segment {
            selector: new_cpl as u16,
            base: 0,
            limit: 0xffff_ffff,
            type_: 0x3,
            present: 1,
            dpl: new_cpl,
            db: 1,
            s: 1,
            l: 0,
            g: 1,
            avl: 0,
            unusable: 0,
            padding: 0,
        };
        g.sregs_dirty = true;
    }
    Ok(())
}

/// The code segment `selector` names, from the GDT or LDT, with the checks an interrupt makes.
fn code_segment<S: CpuState + ?Sized>(g: &mut Ctx<'_, S>, selector: u16) -> Res<kvm_segment> {
    let error = Some((selector & 0xfffc) as u32);
    if selector & 0xfffc == 0 {
        return fault(GP, Some(0));
    }
    let table = if selector & 4 != 0 {
        (g.sregs.ldt.base, g.sregs.ldt.limit as u64)
    } else {
        (g.sregs.gdt.base, g.sregs.gdt.limit as u64)
    };
    let at = (selector & 0xfff8) as u64;
    if at + 7 > table.1 {
        return fault(GP, error);
    }
    let d = g.read_u64(table.0.wrapping_add(at), Access::SysRead)?;
    let seg = segment_from_gdt(d, selector);
    let code = seg.s != 0 && seg.type_ & 0x8 != 0;
    if !code || seg.dpl > g.cpl() {
        return fault(GP, error);
    }
    if seg.present == 0 {
        return fault(NP, error);
    }
    Ok(seg)
}

/// A 64-bit field of the current 64-bit TSS; #TS past its limit.
fn tss_u64<S: CpuState + ?Sized>(g: &mut Ctx<'_, S>, offset: u32) -> Res<u64> {
    let tr = g.sregs.tr;
    if offset as u64 + 7 > tr.limit as u64 {
        return fault(TS, Some((tr.selector & 0xfffc) as u32));
    }
    g.read_u64(tr.base.wrapping_add(offset as u64), Access::SysRead)
}
