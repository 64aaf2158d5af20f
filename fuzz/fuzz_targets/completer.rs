//! The instruction completer: the bytes KVM's emulator gave up on, completed on a `MockCpu` whose
//! mode, registers, CPUID and RAM the input sets.
//!
//! Input: byte 0, the mode (`% 4`: 64-bit CPL0, 64-bit CPL3, 32-bit compatibility mode, 16-bit
//! protected mode; bit 2 turns SMAP on, bit 3 makes the TSS's RSP0 point into RAM); byte 1, a
//! CPUID feature bit to clear (the n-th of those the completer checks; 0 and past the end clear
//! none); bytes 2-16, the instruction bytes (15, as KVM reports them); then the sixteen general
//! registers, RFLAGS, XMM0-15 as far as the input goes; the rest is guest RAM from address 0 (the
//! IDT at 0x1000, the GDT at 0x2000, the TSS at 0x3000, 64 KiB identity-mapped).
//!
//! Checked: no panic; an instruction that faults or fails leaves the registers as they were and
//! injects at most one exception; one that completes injects none and, unless it is INT n or
//! INT3, leaves RIP just past itself.
#![no_main]

use iced_x86::{Decoder, DecoderOptions, Mnemonic};
use libfuzzer_sys::fuzz_target;
use lucid_vmm::emulate::{complete_with, MockCpu};

const RAM: usize = 64 << 10;
/// (leaf, index, register, bit) of the CPUID features the completer checks.
const FEATURES: [(u32, u32, usize, u32); 12] = [
    (1, 0, 2, 9),
    (1, 0, 2, 20),
    (1, 0, 2, 23),
    (1, 0, 2, 26),
    (1, 0, 2, 30),
    (1, 0, 3, 25),
    (7, 0, 1, 0),
    (7, 0, 1, 10),
    (7, 0, 1, 18),
    (7, 0, 1, 24),
    (0xd, 1, 0, 2),
    (0x8000_0008, 0, 1, 4),
];

fn u64_at(b: &[u8], i: usize) -> u64 {
    let mut w = [0u8; 8];
    if let Some(s) = b.get(i * 8..) {
        let n = s.len().min(8);
        w[..n].copy_from_slice(&s[..n]);
    }
    u64::from_le_bytes(w)
}

fuzz_target!(|data: &[u8]| {
    let [mode, feature, rest @ ..] = data else {
        return;
    };
    let (insn, rest) = rest.split_at(rest.len().min(15));
    let (regs, ram) = rest.split_at(rest.len().min(17 * 8 + 16 * 16));
    let mut cpu = MockCpu::long_mode(RAM);
    let s = &mut cpu.sregs;
    match mode % 4 {
        1 => {
            s.cs.dpl = 3;
            s.cs.selector |= 3;
            s.ss.dpl = 3;
            s.ss.selector |= 3;
        }
        2 => (s.cs.l, s.cs.db) = (0, 1),
        3 => (s.cs.l, s.cs.db, s.efer) = (0, 0, 0),
        _ => {}
    }
    if mode & 4 != 0 {
        s.cr4 |= 1 << 21;
    }
    s.idt.base = 0x1000;
    s.idt.limit = 0xfff;
    s.gdt.base = 0x2000;
    s.gdt.limit = 0xfff;
    s.tr.base = 0x3000;
    s.tr.limit = 0x67;
    if let Some(&(leaf, index, reg, bit)) = FEATURES.get((*feature as usize).wrapping_sub(1)) {
        cpu.clear_feature(leaf, index, reg, bit);
    }
    let r = &mut cpu.regs;
    for (i, v) in [
        &mut r.rax,
        &mut r.rbx,
        &mut r.rcx,
        &mut r.rdx,
        &mut r.rsi,
        &mut r.rdi,
        &mut r.rsp,
        &mut r.rbp,
        &mut r.r8,
        &mut r.r9,
        &mut r.r10,
        &mut r.r11,
        &mut r.r12,
        &mut r.r13,
        &mut r.r14,
        &mut r.r15,
        &mut r.rflags,
    ]
    .into_iter()
    .enumerate()
    {
        *v = u64_at(regs, i);
    }
    r.rflags = (r.rflags | 2) & 0x3f_7fd7;
    r.rip = 0x8000;
    for x in 0..16 {
        let (lo, hi) = (u64_at(regs, 17 + 2 * x), u64_at(regs, 18 + 2 * x));
        cpu.fpu.xmm[x][..8].copy_from_slice(&lo.to_le_bytes());
        cpu.fpu.xmm[x][8..].copy_from_slice(&hi.to_le_bytes());
    }
    let n = ram.len().min(RAM);
    cpu.ram[..n].copy_from_slice(&ram[..n]);
    if mode & 8 != 0 {
        cpu.ram[0x3004..0x300c].copy_from_slice(&0xf000u64.to_le_bytes());
    }

    let before = cpu.regs;
    match complete_with(&mut cpu, insn) {
        Ok(o) if o.fault.is_none() => {
            assert!(cpu.injected.is_empty(), "{o:?}");
            if !matches!(o.mnemonic, Mnemonic::Int | Mnemonic::Int3) {
                let bits = match mode % 4 {
                    2 => 32,
                    3 => 16,
                    _ => 64,
                };
                let len = Decoder::with_ip(bits, insn, 0x8000, DecoderOptions::NONE)
                    .decode()
                    .len();
                assert_eq!(
                    cpu.regs.rip,
                    0x8000 + len as u64,
                    "{o:?}: RIP past the instruction"
                );
            }
        }
        Ok(o) => {
            assert_eq!(cpu.regs, before, "{o:?} changed registers");
            assert_eq!(cpu.injected.len(), 1, "{o:?}");
        }
        Err(e) => {
            assert_eq!(cpu.regs, before, "{e} changed registers");
            assert!(cpu.injected.is_empty(), "{e}");
        }
    }
});
