//! The completer on a [`MockCpu`]: each completion against the CPU's own result (the same
//! instruction run natively on the host, for those user mode can run) or the SDM's rules,
//! flags included; faults with RIP left in place; malformed input as errors, never panics.

use std::arch::asm;

use iced_x86::Mnemonic;

use super::insns::flags;
use super::vector::*;
use super::*;

const RIP: u64 = 0x1000;
const RSP: u64 = 0x8000;
const DATA: u64 = 0x6000;

fn cpu() -> MockCpu {
    let mut c = MockCpu::long_mode(0x10000);
    c.regs.rip = RIP;
    c.regs.rsp = RSP;
    c
}

/// Runs `bytes` and expects it to complete, RIP moving past it.
fn done(c: &mut MockCpu, bytes: &[u8]) -> Outcome {
    let rip = c.regs.rip;
    let o = complete_with(c, bytes).unwrap();
    assert_eq!(o.fault, None, "{bytes:02x?}");
    assert_eq!(c.regs.rip, rip + bytes.len() as u64);
    o
}

/// Runs `bytes` and expects `vector`/`error_code`, with the registers untouched.
fn faults(c: &mut MockCpu, bytes: &[u8], vector: u8, error_code: Option<u32>) {
    let before = c.regs;
    let o = complete_with(c, bytes).unwrap();
    let e = o.fault.unwrap_or_else(|| panic!("{bytes:02x?} completed"));
    assert_eq!(
        (e.vector, e.error_code),
        (vector, error_code),
        "{bytes:02x?}"
    );
    assert_eq!(c.regs, before, "a fault leaves the registers alone");
    assert_eq!(c.injected.last(), Some(&(vector, error_code)));
}

fn read_u64(c: &MockCpu, gpa: u64) -> u64 {
    let mut b = [0u8; 8];
    c.read_phys(gpa, &mut b).unwrap();
    u64::from_le_bytes(b)
}

/// Values with every bit count and position that matters, plus a few mixed ones.
fn samples() -> Vec<u64> {
    let mut v = vec![
        0,
        1,
        u64::MAX,
        0x8000_0000_0000_0000,
        0x8000_0000,
        0x8000,
        0x80,
    ];
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    for _ in 0..24 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.push(x);
        v.push(x >> (x % 61));
    }
    v
}

// ---- decoding and reports ----

#[test]
fn reports_name_the_instruction_and_its_bytes() {
    let text = |b: &[u8]| {
        InsnText {
            bytes: b.to_vec(),
            bitness: 64,
            rip: 0x1000,
        }
        .to_string()
    };
    assert!(text(&[0xcc]).contains("int3"), "{}", text(&[0xcc]));
    assert!(text(&[0x48, 0x0f, 0xc7, 0x0f]).contains("cmpxchg16b"));
    assert!(text(&[]).contains("no instruction bytes"));
    assert!(text(&[0xd6]).contains("undecodable"));
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
        (&[0x0f, 0x01, 0xd0][..], Mnemonic::Xgetbv),
        (&[0x66, 0x0f, 0xae, 0x37][..], Mnemonic::Clwb),
        (&[0x0f, 0x01, 0xfd][..], Mnemonic::Rdpru),
        (&[0x66, 0x0f, 0x38, 0x82, 0x07][..], Mnemonic::Invpcid),
        (&[0xcd, 0x80][..], Mnemonic::Int),
    ] {
        assert_eq!(decode(bytes, 64, 0).unwrap().mnemonic(), m);
    }
}

// ---- malformed input ----

#[test]
fn malformed_input_is_an_error_not_a_panic() {
    let mut c = cpu();
    assert!(matches!(
        complete_with(&mut c, &[]),
        Err(EmulateError::NoBytes)
    ));
    // popcnt cut short
    assert!(matches!(
        complete_with(&mut c, &[0xf3, 0x48, 0x0f]),
        Err(EmulateError::Truncated { .. })
    ));
    assert!(matches!(
        complete_with(&mut c, &[0xd6, 0x90, 0x90]), // salc: gone in 64-bit mode
        Err(EmulateError::Undecodable { .. })
    ));
    // nop: decodes, but it is nothing KVM would hand over
    assert!(matches!(
        complete_with(&mut c, &[0x90]),
        Err(EmulateError::Unsupported {
            mnemonic: Mnemonic::Nop,
            ..
        })
    ));
    // vpxor: a VEX form of an instruction Lucid completes in its legacy form
    assert!(matches!(
        complete_with(&mut c, &[0xc5, 0xf1, 0xef, 0xca]),
        Err(EmulateError::Unsupported { .. })
    ));
    // an MMX register form
    assert!(matches!(
        complete_with(&mut c, &[0x0f, 0xef, 0xca]),
        Err(EmulateError::Unsupported { .. })
    ));
    // a memory operand mapped beyond guest RAM: ldmxcsr [rdi]
    c.map(0x40_0000, 0x100_0000, 0x1000);
    c.regs.rdi = 0x40_0000;
    assert!(matches!(
        complete_with(&mut c, &[0x0f, 0xae, 0x17]),
        Err(EmulateError::NotRam { .. })
    ));
    assert_eq!(c.regs.rip, RIP, "nothing completed");
    assert!(c.injected.is_empty());
}

#[test]
fn a_lock_prefix_where_none_is_allowed_is_ud() {
    let mut c = cpu();
    faults(&mut c, &[0xf0, 0x0f, 0x01, 0xca], UD, None);
}

#[test]
fn an_address_that_does_not_translate_is_a_page_fault() {
    let mut c = cpu();
    c.regs.rdi = 0x7_0000; // past the mapped 64 KiB
    faults(&mut c, &[0x0f, 0xae, 0x1f], PF, Some(0b010)); // stmxcsr: a write
    assert_eq!(c.sregs.cr2, 0x7_0000);
    faults(&mut c, &[0x0f, 0xae, 0x17], PF, Some(0b000)); // ldmxcsr: a read
                                                          // at CPL3 the user bit is set
    c.sregs.cs.dpl = 3;
    faults(&mut c, &[0x0f, 0xae, 0x17], PF, Some(0b100));
    // a 4-byte access straddling into an unmapped page faults on the second page
    c.sregs.cs.dpl = 0;
    c.regs.rdi = 0xfffe;
    faults(&mut c, &[0x0f, 0xae, 0x1f], PF, Some(0b010));
    assert_eq!(c.sregs.cr2, 0x1_0000);
    assert_eq!(read_u64(&c, 0xfff8), 0, "nothing written before the fault");
}

#[test]
fn non_canonical_operands_fault() {
    let mut c = cpu();
    c.regs.rdi = 0x8000_0000_0000_0000;
    faults(&mut c, &[0x0f, 0xae, 0x17], GP, Some(0));
    c.regs.rsp = 0x8000_0000_0000_0000;
    faults(&mut c, &[0x66, 0x0f, 0xae, 0x34, 0x24], SS, Some(0)); // clwb [rsp]
}

/// A deterministic stream of random instruction bytes and register states through the whole
/// completer: every result is an outcome or an error.
#[test]
fn random_bytes_never_panic() {
    let mut x = 0x2545_f491_4f6c_dd1du64;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let interesting: &[&[u8]] = &[
        &[0x0f, 0x01],
        &[0x0f, 0xae],
        &[0x66, 0x0f, 0x38, 0x82],
        &[0xcd],
        &[0x66, 0x0f],
        &[0xf3, 0x48, 0x0f],
        &[0xf2, 0x0f, 0x38],
    ];
    for i in 0..20_000 {
        let mut c = cpu();
        for r in [
            &mut c.regs.rax,
            &mut c.regs.rcx,
            &mut c.regs.rdi,
            &mut c.regs.rsi,
        ] {
            *r = match next() % 4 {
                0 => next(),
                1 => next() % 0x1_0000,
                _ => next() % 0x20,
            };
        }
        if i % 3 == 0 {
            c.sregs.idt.base = next() % 0x1_0000;
            c.sregs.idt.limit = next() as u16;
            c.sregs.gdt.base = next() % 0x1_0000;
            c.sregs.gdt.limit = next() as u16;
            c.sregs.cs.dpl = (next() % 4) as u8;
        }
        for p in 0..(next() % 0x1000) {
            c.ram[(p * 16) as usize % 0x1_0000] = next() as u8;
        }
        let mut bytes = interesting[(next() % interesting.len() as u64) as usize].to_vec();
        let n = next() % 12;
        bytes.extend((0..n).map(|_| next() as u8));
        let _ = complete_with(&mut c, &bytes);
    }
}

// ---- bit counts, crc32 ----

macro_rules! native_count {
    ($insn:literal, $v:expr) => {{
        let (mut out, fl): (u64, u64);
        out = 0;
        // SAFETY: one register-to-register instruction and a flags read, on registers the
        // asm block names.
        unsafe {
            asm!(concat!($insn, "\n pushfq\n pop {f}"), inout("rax") out, in("rdi") $v,
                 f = out(reg) fl);
        }
        (out, fl)
    }};
}

#[test]
fn bit_counts_match_the_cpu() {
    if !std::is_x86_feature_detected!("popcnt")
        || !std::is_x86_feature_detected!("lzcnt")
        || !std::is_x86_feature_detected!("bmi1")
    {
        return;
    }
    for v in samples() {
        let cases: [(&[u8], (u64, u64), u64); 9] = [
            (
                &[0xf3, 0x48, 0x0f, 0xb8, 0xc7],
                native_count!("popcnt rax, rdi", v),
                flags::ARITH,
            ),
            (
                &[0xf3, 0x0f, 0xb8, 0xc7],
                native_count!("popcnt eax, edi", v),
                flags::ARITH,
            ),
            (
                &[0x66, 0xf3, 0x0f, 0xb8, 0xc7],
                native_count!("popcnt ax, di", v),
                flags::ARITH,
            ),
            (
                &[0xf3, 0x48, 0x0f, 0xbd, 0xc7],
                native_count!("lzcnt rax, rdi", v),
                flags::CF | flags::ZF,
            ),
            (
                &[0xf3, 0x0f, 0xbd, 0xc7],
                native_count!("lzcnt eax, edi", v),
                flags::CF | flags::ZF,
            ),
            (
                &[0x66, 0xf3, 0x0f, 0xbd, 0xc7],
                native_count!("lzcnt ax, di", v),
                flags::CF | flags::ZF,
            ),
            (
                &[0xf3, 0x48, 0x0f, 0xbc, 0xc7],
                native_count!("tzcnt rax, rdi", v),
                flags::CF | flags::ZF,
            ),
            (
                &[0xf3, 0x0f, 0xbc, 0xc7],
                native_count!("tzcnt eax, edi", v),
                flags::CF | flags::ZF,
            ),
            (
                &[0x66, 0xf3, 0x0f, 0xbc, 0xc7],
                native_count!("tzcnt ax, di", v),
                flags::CF | flags::ZF,
            ),
        ];
        for (bytes, (want, want_flags), defined) in cases {
            let mut c = cpu();
            c.regs.rdi = v;
            c.regs.rflags = 0x2 | flags::ARITH;
            done(&mut c, bytes);
            assert_eq!(c.regs.rax, want, "{bytes:02x?} of {v:#x}");
            assert_eq!(
                c.regs.rflags & defined,
                want_flags & defined,
                "{bytes:02x?} of {v:#x}"
            );
        }
    }
}

#[test]
fn popcnt_without_the_feature_is_ud() {
    let mut c = cpu();
    c.clear_feature(1, 0, 2, 23);
    faults(&mut c, &[0xf3, 0x48, 0x0f, 0xb8, 0xc7], UD, None);
}

#[test]
fn crc32_matches_the_cpu() {
    if !std::is_x86_feature_detected!("sse4.2") {
        return;
    }
    // CRC-32C of "123456789" is 0xE3069283 (initial value and final xor 0xFFFFFFFF).
    assert_eq!(insns::crc32c(!0, b"123456789") ^ !0, 0xe306_9283);
    for v in samples() {
        let acc = v.rotate_left(17);
        let native = |which: u8| -> u64 {
            let mut a = acc;
            // SAFETY: one crc32 on the named registers.
            unsafe {
                match which {
                    0 => asm!("crc32 eax, dil", inout("rax") a, in("rdi") v),
                    1 => asm!("crc32 eax, di", inout("rax") a, in("rdi") v),
                    2 => asm!("crc32 eax, edi", inout("rax") a, in("rdi") v),
                    _ => asm!("crc32 rax, rdi", inout("rax") a, in("rdi") v),
                }
            }
            a
        };
        for (which, bytes) in [
            (0, &[0xf2, 0x40, 0x0f, 0x38, 0xf0, 0xc7][..]),
            (1, &[0x66, 0xf2, 0x0f, 0x38, 0xf1, 0xc7][..]),
            (2, &[0xf2, 0x0f, 0x38, 0xf1, 0xc7][..]),
            (3, &[0xf2, 0x48, 0x0f, 0x38, 0xf1, 0xc7][..]),
        ] {
            let mut c = cpu();
            c.regs.rax = acc;
            c.regs.rdi = v;
            done(&mut c, bytes);
            assert_eq!(c.regs.rax, native(which), "{bytes:02x?} {acc:#x} {v:#x}");
        }
    }
    // the memory form: crc32 eax, byte [rsi]
    let mut c = cpu();
    c.write_phys(DATA, &[0x31]).unwrap();
    c.regs.rsi = DATA;
    c.regs.rax = !0;
    done(&mut c, &[0xf2, 0x0f, 0x38, 0xf0, 0x06]);
    assert_eq!(c.regs.rax, insns::crc32c(!0, b"1") as u64);
}

// ---- rdrand/rdseed, clac/stac, fsgsbase ----

#[test]
fn rdrand_and_rdseed_give_fresh_values_with_cf() {
    let mut c = cpu();
    c.regs.rflags = 0x2 | flags::ZF | flags::OF;
    done(&mut c, &[0x48, 0x0f, 0xc7, 0xf0]);
    let first = c.regs.rax;
    assert_eq!(c.regs.rflags & flags::ARITH, flags::CF);
    done(&mut c, &[0x48, 0x0f, 0xc7, 0xf0]);
    assert_ne!(
        c.regs.rax, first,
        "two 64-bit random values are (almost surely) different"
    );
    c.regs.rax = u64::MAX;
    done(&mut c, &[0x0f, 0xc7, 0xf8]); // rdseed eax: 32 bits, zero-extended
    assert_eq!(c.regs.rax >> 32, 0);
    c.clear_feature(7, 0, 1, 18);
    faults(&mut c, &[0x0f, 0xc7, 0xf8], UD, None);
    c.clear_feature(1, 0, 2, 30);
    faults(&mut c, &[0x48, 0x0f, 0xc7, 0xf0], UD, None);
}

#[test]
fn clac_and_stac_toggle_ac_at_cpl0_only() {
    let mut c = cpu();
    done(&mut c, &[0x0f, 0x01, 0xcb]);
    assert_ne!(c.regs.rflags & flags::AC, 0);
    done(&mut c, &[0x0f, 0x01, 0xca]);
    assert_eq!(c.regs.rflags & flags::AC, 0);
    assert_eq!(c.regs.rflags & flags::ARITH, 0, "no other flag moved");
    c.sregs.cs.dpl = 3;
    faults(&mut c, &[0x0f, 0x01, 0xcb], UD, None);
    c.sregs.cs.dpl = 0;
    c.clear_feature(7, 0, 1, 20);
    faults(&mut c, &[0x0f, 0x01, 0xca], UD, None);
}

#[test]
fn fsgsbase_reads_and_writes_the_bases() {
    let mut c = cpu();
    c.sregs.cr4 |= 1 << 16;
    c.sregs.gs.base = 0xffff_8880_1234_5000;
    done(&mut c, &[0xf3, 0x48, 0x0f, 0xae, 0xc8]); // rdgsbase rax
    assert_eq!(c.regs.rax, 0xffff_8880_1234_5000);
    c.regs.rdi = 0x7fff_0000_1000;
    done(&mut c, &[0xf3, 0x48, 0x0f, 0xae, 0xd7]); // wrfsbase rdi
    assert_eq!(c.sregs.fs.base, 0x7fff_0000_1000);
    c.regs.rdi = 0x8000_0000_0000_0000;
    faults(&mut c, &[0xf3, 0x48, 0x0f, 0xae, 0xd7], GP, Some(0));
    c.sregs.cr4 &= !(1 << 16);
    faults(&mut c, &[0xf3, 0x48, 0x0f, 0xae, 0xc8], UD, None);
}

// ---- x87/SSE control ----

#[test]
fn wait_raises_nm_and_mf_when_due() {
    let mut c = cpu();
    done(&mut c, &[0x9b]);
    c.sregs.cr0 |= 0b1010; // TS | MP
    faults(&mut c, &[0x9b, 0xdb, 0xe2], NM, None);
    c.sregs.cr0 &= !0b1000;
    c.fpu.fsw = 0x80; // an unmasked exception pending
    faults(&mut c, &[0x9b, 0xdb, 0xe2], MF, None);
    // fnclex clears it
    done(&mut c, &[0xdb, 0xe2]);
    assert_eq!(c.fpu.fsw & 0x80ff, 0);
    done(&mut c, &[0x9b]);
}

#[test]
fn emms_empties_the_tag_word() {
    let mut c = cpu();
    c.fpu.ftwx = 0xff;
    done(&mut c, &[0x0f, 0x77]);
    assert_eq!(c.fpu.ftwx, 0);
    c.sregs.cr0 |= 1 << 2; // EM
    faults(&mut c, &[0x0f, 0x77], UD, None);
}

#[test]
fn ldmxcsr_and_stmxcsr_move_mxcsr_through_memory() {
    let mut c = cpu();
    c.regs.rdi = DATA;
    c.write_phys(DATA, &0x9fc0u32.to_le_bytes()).unwrap();
    done(&mut c, &[0x0f, 0xae, 0x17]);
    assert_eq!(c.fpu.mxcsr, 0x9fc0);
    c.regs.rdi = DATA + 0x10;
    done(&mut c, &[0x0f, 0xae, 0x1f]);
    assert_eq!(read_u64(&c, DATA + 0x10) as u32, 0x9fc0);
    // ldmxcsr [rsp+8]
    c.write_phys(RSP + 8, &0x1f80u32.to_le_bytes()).unwrap();
    done(&mut c, &[0x0f, 0xae, 0x54, 0x24, 0x08]);
    assert_eq!(c.fpu.mxcsr, 0x1f80);
    // reserved bits: #GP(0), MXCSR unchanged
    c.regs.rdi = DATA;
    c.write_phys(DATA, &0x1_1f80u32.to_le_bytes()).unwrap();
    faults(&mut c, &[0x0f, 0xae, 0x17], GP, Some(0));
    assert_eq!(c.fpu.mxcsr, 0x1f80);
    c.sregs.cr0 |= 1 << 3; // TS
    faults(&mut c, &[0x0f, 0xae, 0x1f], NM, None);
    c.sregs.cr0 &= !(1 << 3);
    c.sregs.cr4 &= !(1 << 9); // no OSFXSR
    faults(&mut c, &[0x0f, 0xae, 0x1f], UD, None);
}

// ---- SSE ----

/// `insn` (on xmm1 and xmm2) run natively on `a` (xmm1) and `b` (xmm2): xmm1 after.
macro_rules! native_sse {
    ($insn:literal, $a:expr, $b:expr) => {{
        let mut a: [u8; 16] = $a.to_le_bytes();
        let b: [u8; 16] = $b.to_le_bytes();
        // SAFETY: loads two XMM registers from the buffers, runs one SSE instruction on them,
        // stores xmm1 back; both registers are declared clobbered.
        unsafe {
            asm!("movdqu xmm1, [{a}]", "movdqu xmm2, [{b}]", $insn, "movdqu [{a}], xmm1",
                 a = in(reg) a.as_mut_ptr(), b = in(reg) b.as_ptr(),
                 out("xmm1") _, out("xmm2") _);
        }
        u128::from_le_bytes(a)
    }};
}

#[test]
fn sse_register_forms_match_the_cpu() {
    let ssse3 = std::is_x86_feature_detected!("ssse3");
    let xs = samples();
    for (i, pair) in xs.windows(4).enumerate() {
        let a = pair[0] as u128 | (pair[1] as u128) << 64;
        let mut b = pair[2] as u128 | (pair[3] as u128) << 64;
        if i % 5 == 0 {
            b = a; // equal lanes for pcmpeqd
        }
        let small = b % 70; // shift counts, in range and past it
        let cases: Vec<(&[u8], u128, u128)> = vec![
            (
                &[0x66, 0x0f, 0xef, 0xca],
                native_sse!("pxor xmm1, xmm2", a, b),
                b,
            ),
            (
                &[0x66, 0x0f, 0xeb, 0xca],
                native_sse!("por xmm1, xmm2", a, b),
                b,
            ),
            (
                &[0x66, 0x0f, 0xdb, 0xca],
                native_sse!("pand xmm1, xmm2", a, b),
                b,
            ),
            (
                &[0x66, 0x0f, 0xdf, 0xca],
                native_sse!("pandn xmm1, xmm2", a, b),
                b,
            ),
            (
                &[0x0f, 0x57, 0xca],
                native_sse!("xorps xmm1, xmm2", a, b),
                b,
            ),
            (
                &[0x66, 0x0f, 0xfe, 0xca],
                native_sse!("paddd xmm1, xmm2", a, b),
                b,
            ),
            (
                &[0x66, 0x0f, 0xd4, 0xca],
                native_sse!("paddq xmm1, xmm2", a, b),
                b,
            ),
            (
                &[0x66, 0x0f, 0xfa, 0xca],
                native_sse!("psubd xmm1, xmm2", a, b),
                b,
            ),
            (
                &[0x66, 0x0f, 0xfb, 0xca],
                native_sse!("psubq xmm1, xmm2", a, b),
                b,
            ),
            (
                &[0x66, 0x0f, 0x62, 0xca],
                native_sse!("punpckldq xmm1, xmm2", a, b),
                b,
            ),
            (
                &[0x66, 0x0f, 0x6c, 0xca],
                native_sse!("punpcklqdq xmm1, xmm2", a, b),
                b,
            ),
            (
                &[0x66, 0x0f, 0x6a, 0xca],
                native_sse!("punpckhdq xmm1, xmm2", a, b),
                b,
            ),
            (
                &[0x66, 0x0f, 0x6d, 0xca],
                native_sse!("punpckhqdq xmm1, xmm2", a, b),
                b,
            ),
            (
                &[0x66, 0x0f, 0x70, 0xca, 0x1b],
                native_sse!("pshufd xmm1, xmm2, 0x1b", a, b),
                b,
            ),
            (
                &[0x66, 0x0f, 0x72, 0xd1, 0x03],
                native_sse!("psrld xmm1, 3", a, b),
                b,
            ),
            (
                &[0x66, 0x0f, 0x72, 0xf1, 0x03],
                native_sse!("pslld xmm1, 3", a, b),
                b,
            ),
            (
                &[0x66, 0x0f, 0x73, 0xd1, 0x07],
                native_sse!("psrlq xmm1, 7", a, b),
                b,
            ),
            (
                &[0x66, 0x0f, 0x73, 0xf1, 0x07],
                native_sse!("psllq xmm1, 7", a, b),
                b,
            ),
            (
                &[0x66, 0x0f, 0xd2, 0xca],
                native_sse!("psrld xmm1, xmm2", a, small),
                small,
            ),
            (
                &[0x66, 0x0f, 0x73, 0xd9, 0x05],
                native_sse!("psrldq xmm1, 5", a, b),
                b,
            ),
            (
                &[0x66, 0x0f, 0x73, 0xf9, 0x05],
                native_sse!("pslldq xmm1, 5", a, b),
                b,
            ),
            (
                &[0x66, 0x0f, 0x76, 0xca],
                native_sse!("pcmpeqd xmm1, xmm2", a, b),
                b,
            ),
            (
                &[0x0f, 0x28, 0xca],
                native_sse!("movaps xmm1, xmm2", a, b),
                b,
            ),
            (
                &[0xf3, 0x0f, 0x7e, 0xca],
                native_sse!("movq xmm1, xmm2", a, b),
                b,
            ),
        ];
        let mut cases = cases;
        if ssse3 {
            cases.push((
                &[0x66, 0x0f, 0x38, 0x00, 0xca],
                native_sse!("pshufb xmm1, xmm2", a, b),
                b,
            ));
            cases.push((
                &[0x66, 0x0f, 0x3a, 0x0f, 0xca, 0x04],
                native_sse!("palignr xmm1, xmm2, 4", a, b),
                b,
            ));
        }
        for (bytes, want, b) in cases {
            let mut c = cpu();
            c.fpu.xmm[1] = a.to_le_bytes();
            c.fpu.xmm[2] = b.to_le_bytes();
            done(&mut c, bytes);
            assert_eq!(
                u128::from_le_bytes(c.fpu.xmm[1]),
                want,
                "{bytes:02x?} a={a:#x} b={b:#x}"
            );
            assert_eq!(u128::from_le_bytes(c.fpu.xmm[2]), b, "source unchanged");
        }
    }
}

#[test]
fn sse_moves_between_registers_and_memory() {
    let mut c = cpu();
    let v: u128 = 0x0011_2233_4455_6677_8899_aabb_ccdd_eeff;
    c.regs.rcx = 0xdead_beef_1234_5678;
    done(&mut c, &[0x66, 0x44, 0x0f, 0x6e, 0xf9]); // movd xmm15, ecx
    assert_eq!(u128::from_le_bytes(c.fpu.xmm[15]), 0x1234_5678);
    done(&mut c, &[0x66, 0x48, 0x0f, 0x6e, 0xc9]); // movq xmm1, rcx
    assert_eq!(u128::from_le_bytes(c.fpu.xmm[1]), 0xdead_beef_1234_5678);
    c.fpu.xmm[1] = v.to_le_bytes();
    done(&mut c, &[0x66, 0x0f, 0x7e, 0xc9]); // movd ecx, xmm1
    assert_eq!(c.regs.rcx, 0xccdd_eeff);
    done(&mut c, &[0x66, 0x48, 0x0f, 0x7e, 0xc9]); // movq rcx, xmm1
    assert_eq!(c.regs.rcx, 0x8899_aabb_ccdd_eeff);
    c.regs.rdi = DATA;
    done(&mut c, &[0x66, 0x0f, 0x7f, 0x0f]); // movdqa [rdi], xmm1
    assert_eq!(read_u64(&c, DATA), v as u64);
    assert_eq!(read_u64(&c, DATA + 8), (v >> 64) as u64);
    c.fpu.xmm[1] = [0; 16];
    done(&mut c, &[0x66, 0x0f, 0x6f, 0x0f]); // movdqa xmm1, [rdi]
    assert_eq!(u128::from_le_bytes(c.fpu.xmm[1]), v);
    done(&mut c, &[0x66, 0x0f, 0xef, 0x0f]); // pxor xmm1, [rdi]
    assert_eq!(u128::from_le_bytes(c.fpu.xmm[1]), 0);
    // unaligned: movdqu works, movdqa, movaps and a 16-byte pxor operand fault
    c.regs.rdi = DATA + 4;
    done(&mut c, &[0xf3, 0x0f, 0x6f, 0x0f]);
    done(&mut c, &[0x0f, 0x10, 0x0f]); // movups
    faults(&mut c, &[0x66, 0x0f, 0x6f, 0x0f], GP, Some(0));
    faults(&mut c, &[0x66, 0x0f, 0xef, 0x0f], GP, Some(0));
    // movq [rdi], xmm1 stores 8 bytes only
    c.fpu.xmm[1] = v.to_le_bytes();
    c.write_phys(DATA + 4, &[0xaa; 16]).unwrap();
    done(&mut c, &[0x66, 0x0f, 0xd6, 0x0f]);
    assert_eq!(read_u64(&c, DATA + 4), v as u64);
    assert_eq!(read_u64(&c, DATA + 12), 0xaaaa_aaaa_aaaa_aaaa);
}

#[test]
fn sse_faults_as_the_cpu_does() {
    let mut c = cpu();
    c.sregs.cr0 |= 1 << 3; // TS
    faults(&mut c, &[0x66, 0x0f, 0xef, 0xca], NM, None);
    c.sregs.cr0 &= !(1 << 3);
    c.sregs.cr4 &= !(1 << 9); // OSFXSR clear
    faults(&mut c, &[0x66, 0x0f, 0xef, 0xca], UD, None);
    let mut c = cpu();
    c.clear_feature(1, 0, 2, 9); // no SSSE3
    faults(&mut c, &[0x66, 0x0f, 0x38, 0x00, 0xca], UD, None);
    done(&mut c, &[0x66, 0x0f, 0xef, 0xca]);
}

// ---- xgetbv, clwb, rdpru, invpcid ----

fn native_xgetbv(ecx: u32) -> u64 {
    assert!(std::is_x86_feature_detected!("xsave"));
    // SAFETY: the host CPU has XSAVE (checked above) and its kernel sets CR4.OSXSAVE.
    unsafe { std::arch::x86_64::_xgetbv(ecx) }
}

#[test]
fn xgetbv_matches_the_cpu() {
    if !std::is_x86_feature_detected!("xsave") {
        return;
    }
    let mut c = cpu();
    c.xcr0 = native_xgetbv(0);
    c.regs.rcx = 0xffff_ffff_0000_0000; // only ECX counts
    c.regs.rax = u64::MAX;
    c.regs.rdx = u64::MAX;
    done(&mut c, &[0x0f, 0x01, 0xd0]);
    assert_eq!(c.regs.rdx << 32 | c.regs.rax, native_xgetbv(0));
    assert_eq!(c.regs.rax >> 32, 0, "32-bit results, zero-extended");
    // ECX=1: XINUSE, a subset of XCR0; the host's SSE state is in use (it runs this test), and
    // Lucid reports every enabled component in use.
    c.regs.rcx = 1;
    done(&mut c, &[0x0f, 0x01, 0xd0]);
    let native = native_xgetbv(1);
    assert_eq!(native & !native_xgetbv(0), 0);
    assert_eq!(c.regs.rdx << 32 | c.regs.rax, c.xcr0);
    assert_eq!(c.regs.rax & native & 2, native & 2);
    c.regs.rcx = 2;
    faults(&mut c, &[0x0f, 0x01, 0xd0], GP, Some(0));
    c.regs.rcx = 1;
    c.clear_feature(0xd, 1, 0, 2); // no XGETBV with ECX=1
    faults(&mut c, &[0x0f, 0x01, 0xd0], GP, Some(0));
    c.sregs.cr4 &= !(1 << 18); // CR4.OSXSAVE clear
    c.regs.rcx = 0;
    faults(&mut c, &[0x0f, 0x01, 0xd0], UD, None);
    c.sregs.cr4 |= 1 << 18;
    c.clear_feature(1, 0, 2, 26);
    faults(&mut c, &[0x0f, 0x01, 0xd0], UD, None);
}

#[test]
fn clwb_checks_its_address_and_completes() {
    let mut c = cpu();
    c.regs.rdi = DATA;
    c.write_phys(DATA, &[0x5a; 8]).unwrap();
    done(&mut c, &[0x66, 0x0f, 0xae, 0x37]);
    assert_eq!(read_u64(&c, DATA), 0x5a5a_5a5a_5a5a_5a5a, "data untouched");
    if std::is_x86_feature_detected!("avx512f") || clwb_on_host() {
        let line = [0x5au8; 64];
        // SAFETY: clwb on a live, readable buffer; it writes nothing back that differs.
        unsafe { asm!("clwb [{p}]", p = in(reg) line.as_ptr()) };
        assert_eq!(line, [0x5a; 64]);
    }
    c.regs.rdi = 0x7_0000;
    faults(&mut c, &[0x66, 0x0f, 0xae, 0x37], PF, Some(0));
    c.regs.rdi = 0xffff_0000_0000_0000 >> 1;
    faults(&mut c, &[0x66, 0x0f, 0xae, 0x37], GP, Some(0));
    c.regs.rdi = DATA;
    c.clear_feature(7, 0, 1, 24);
    faults(&mut c, &[0x66, 0x0f, 0xae, 0x37], UD, None);
}

fn clwb_on_host() -> bool {
    // CPUID.(EAX=7,ECX=0):EBX bit 24
    std::arch::x86_64::__cpuid_count(7, 0).ebx & 1 << 24 != 0
}

#[test]
fn rdpru_is_ud_without_the_feature_and_refused_with_it() {
    let mut c = cpu();
    c.clear_feature(0x8000_0008, 0, 1, 4);
    faults(&mut c, &[0x0f, 0x01, 0xfd], UD, None);
    let mut c = cpu();
    assert!(matches!(
        complete_with(&mut c, &[0x0f, 0x01, 0xfd]),
        Err(EmulateError::Unsupported {
            mnemonic: Mnemonic::Rdpru,
            ..
        })
    ));
    c.sregs.cr4 |= 1 << 2; // TSD
    c.sregs.cs.dpl = 3;
    faults(&mut c, &[0x0f, 0x01, 0xfd], UD, None);
}

#[test]
fn invpcid_checks_its_operands_then_flushes() {
    let invpcid = [0x66, 0x0f, 0x38, 0x82, 0x07]; // invpcid rax, [rdi]
    let mut c = cpu();
    c.regs.rdi = DATA;
    let desc = |c: &mut MockCpu, pcid: u64, addr: u64| {
        c.write_phys(DATA, &pcid.to_le_bytes()).unwrap();
        c.write_phys(DATA + 8, &addr.to_le_bytes()).unwrap();
    };
    desc(&mut c, 0, 0xffff_8880_0000_1000);
    for kind in 0..4 {
        c.regs.rax = kind;
        done(&mut c, &invpcid);
    }
    assert_eq!(c.tlb_flushes, 4);
    c.regs.rax = 4;
    faults(&mut c, &invpcid, GP, Some(0));
    c.regs.rax = 1 << 32; // the whole register is the type in 64-bit mode
    faults(&mut c, &invpcid, GP, Some(0));
    // PCID bits set with CR4.PCIDE clear: only types 0 and 1 care
    desc(&mut c, 1, 0);
    c.regs.rax = 0;
    faults(&mut c, &invpcid, GP, Some(0));
    c.regs.rax = 1;
    faults(&mut c, &invpcid, GP, Some(0));
    c.regs.rax = 2;
    done(&mut c, &invpcid);
    c.sregs.cr4 |= 1 << 17;
    c.regs.rax = 1;
    done(&mut c, &invpcid);
    // reserved descriptor bits, and a non-canonical address for type 0
    desc(&mut c, 1 << 12, 0);
    c.regs.rax = 3;
    faults(&mut c, &invpcid, GP, Some(0));
    desc(&mut c, 0, 0x8000_0000_0000_0000);
    c.regs.rax = 0;
    faults(&mut c, &invpcid, GP, Some(0));
    c.regs.rax = 1;
    done(&mut c, &invpcid);
    assert_eq!(c.tlb_flushes, 7);
    // CPL3: #GP(0); without the feature: #UD; descriptor on no page: #PF
    c.sregs.cs.dpl = 3;
    faults(&mut c, &invpcid, GP, Some(0));
    c.sregs.cs.dpl = 0;
    c.regs.rdi = 0x7_0000;
    faults(&mut c, &invpcid, PF, Some(0));
    c.clear_feature(7, 0, 1, 10);
    faults(&mut c, &invpcid, UD, None);
    assert_eq!(c.tlb_flushes, 7);
}

// ---- software interrupts through the IDT ----

const IDT: u64 = 0x2000;
const GDT: u64 = 0x3000;
const TSS: u64 = 0x4000;
const RSP0: u64 = 0x9000;
const IST1: u64 = 0xa008; // not 16-byte aligned: the CPU aligns it down
const HANDLER: u64 = 0xffff_ffff_8100_0000;

/// A long-mode CPU with a GDT (0x08 kernel code, 0x10 kernel data, 0x18 user data, 0x20 user
/// code, 0x28 conforming kernel code, 0x30 a code segment not present, 0x38 data), a TSS with
/// RSP0 and IST1, and an empty IDT of 256 gates.
fn idt_cpu() -> MockCpu {
    let mut c = cpu();
    let gdt: [u64; 8] = [
        0,
        0x00af_9a00_0000_ffff,
        0x00cf_9200_0000_ffff,
        0x00cf_f200_0000_ffff,
        0x00af_fa00_0000_ffff,
        0x00af_9e00_0000_ffff,
        0x00af_1a00_0000_ffff,
        0x00cf_9200_0000_ffff,
    ];
    for (i, d) in gdt.iter().enumerate() {
        c.write_phys(GDT + 8 * i as u64, &d.to_le_bytes()).unwrap();
    }
    c.write_phys(TSS + 4, &RSP0.to_le_bytes()).unwrap();
    c.write_phys(TSS + 0x24, &IST1.to_le_bytes()).unwrap();
    c.sregs.gdt.base = GDT;
    c.sregs.gdt.limit = 8 * 8 - 1;
    c.sregs.idt.base = IDT;
    c.sregs.idt.limit = 256 * 16 - 1;
    c.sregs.tr.base = TSS;
    c.sregs.tr.limit = 0x67;
    c.sregs.tr.selector = 0x40;
    c
}

/// Installs gate `vector`: handler at HANDLER, `selector`, `ist`, type/attribute byte `attr`
/// (0x8e: present interrupt gate DPL0, 0x8f trap gate, | 0x60 for DPL3).
fn set_gate(c: &mut MockCpu, vector: u8, selector: u16, ist: u8, attr: u8) {
    let lo = (HANDLER & 0xffff)
        | (selector as u64) << 16
        | (ist as u64) << 32
        | (attr as u64) << 40
        | ((HANDLER >> 16) & 0xffff) << 48;
    let hi = HANDLER >> 32;
    let at = IDT + vector as u64 * 16;
    c.write_phys(at, &lo.to_le_bytes()).unwrap();
    c.write_phys(at + 8, &hi.to_le_bytes()).unwrap();
}

/// The five words an interrupt pushed at `rsp`: RIP, CS, RFLAGS, RSP, SS.
fn frame(c: &MockCpu, rsp: u64) -> [u64; 5] {
    std::array::from_fn(|i| read_u64(c, rsp + 8 * i as u64))
}

#[test]
fn int_n_pushes_the_frame_on_the_current_stack() {
    let mut c = idt_cpu();
    set_gate(&mut c, 0x80, 0x08, 0, 0x8e);
    c.regs.rsp = RSP - 8; // misaligned: the CPU aligns to 16 first
    c.regs.rflags = 0x2 | flags::IF | flags::TF | flags::ZF | flags::AC;
    let before = c.regs;
    let o = complete_with(&mut c, &[0xcd, 0x80]).unwrap();
    assert_eq!(o.fault, None);
    assert_eq!(c.regs.rip, HANDLER);
    assert_eq!(c.regs.rsp, RSP - 16 - 40);
    assert_eq!(
        frame(&c, c.regs.rsp),
        [RIP + 2, 0x08, before.rflags, RSP - 8, 0x10]
    );
    // an interrupt gate clears IF and TF; AC and the arithmetic flags stay
    assert_eq!(c.regs.rflags, 0x2 | flags::ZF | flags::AC);
    assert_eq!(c.sregs.cs.selector, 0x08, "same code segment");
    assert!(c.injected.is_empty());
}

#[test]
fn int3_goes_the_same_way_and_a_trap_gate_keeps_if() {
    let mut c = idt_cpu();
    set_gate(&mut c, 3, 0x08, 0, 0xef); // DPL3 trap gate, as kernels set #BP
    c.regs.rflags = 0x2 | flags::IF;
    let o = complete_with(&mut c, &[0xcc]).unwrap();
    assert_eq!((o.mnemonic, o.fault), (Mnemonic::Int3, None));
    assert_eq!(c.regs.rip, HANDLER);
    assert_eq!(frame(&c, c.regs.rsp)[0], RIP + 1, "returns after the int3");
    assert_ne!(c.regs.rflags & flags::IF, 0);
}

#[test]
fn ist_and_privilege_change_take_the_stack_from_the_tss() {
    let mut c = idt_cpu();
    set_gate(&mut c, 0x81, 0x08, 1, 0x8e);
    done_int(&mut c, 0x81);
    assert_eq!(c.regs.rsp, (IST1 & !15) - 40);
    assert_eq!(frame(&c, c.regs.rsp)[3], RSP, "old RSP in the frame");

    // from CPL3 to a DPL3 gate into kernel code: RSP0, SS null at RPL0, CS at CPL0
    let mut c = idt_cpu();
    set_gate(&mut c, 0x80, 0x08, 0, 0xee);
    c.sregs.cs = kvm_segment_user(0x23, 0xb, 1);
    c.sregs.ss = kvm_segment_user(0x1b, 0x3, 0);
    done_int(&mut c, 0x80);
    assert_eq!(c.regs.rsp, RSP0 - 40);
    assert_eq!(frame(&c, c.regs.rsp), [RIP + 2, 0x23, 0x2, RSP, 0x1b]);
    assert_eq!((c.sregs.cs.selector, c.sregs.cs.dpl), (0x08, 0));
    assert_eq!((c.sregs.ss.selector, c.sregs.ss.dpl), (0, 0));

    // a conforming code segment keeps the CPL: no stack switch
    let mut c = idt_cpu();
    set_gate(&mut c, 0x80, 0x28, 0, 0xee);
    c.sregs.cs = kvm_segment_user(0x23, 0xb, 1);
    done_int(&mut c, 0x80);
    assert_eq!(c.regs.rsp, RSP - 40);
    assert_eq!((c.sregs.cs.selector, c.sregs.cs.dpl), (0x2b, 0));
}

fn kvm_segment_user(selector: u16, type_: u8, l: u8) -> lucid_hv::kvm_bindings::kvm_segment {
    lucid_hv::kvm_bindings::kvm_segment {
        selector,
        type_,
        present: 1,
        dpl: 3,
        s: 1,
        l,
        db: 1 - l,
        g: 1,
        limit: 0xffff_ffff,
        ..Default::default()
    }
}

fn done_int(c: &mut MockCpu, vector: u8) {
    let o = complete_with(c, &[0xcd, vector]).unwrap();
    assert_eq!(o.fault, None, "int {vector:#x}");
    assert_eq!(c.regs.rip, HANDLER);
}

#[test]
fn gate_checks_fault_with_the_vector_in_the_error_code() {
    let v = 0x90u8;
    let idt_error = Some(v as u32 * 8 + 2);
    let int = [0xcd, v];
    // not present: #NP
    let mut c = idt_cpu();
    set_gate(&mut c, v, 0x08, 0, 0x0e);
    faults(&mut c, &int, NP, idt_error);
    // a call gate (type 0xc) in the IDT: #GP
    set_gate(&mut c, v, 0x08, 0, 0x8c);
    faults(&mut c, &int, GP, idt_error);
    // past the IDT limit: #GP
    set_gate(&mut c, v, 0x08, 0, 0x8e);
    c.sregs.idt.limit = v as u16 * 16 - 1;
    faults(&mut c, &int, GP, idt_error);
    // INT n at CPL3 through a DPL0 gate: #GP
    let mut c = idt_cpu();
    set_gate(&mut c, v, 0x08, 0, 0x8e);
    c.sregs.cs = kvm_segment_user(0x23, 0xb, 1);
    faults(&mut c, &int, GP, idt_error);
    assert!(c.injected.len() == 1 && c.regs.rsp == RSP);
}

#[test]
fn target_segment_and_stack_checks_fault() {
    let int = [0xcd, 0x80];
    let mut c = idt_cpu();
    // null selector: #GP(0); beyond the GDT: #GP(sel); a data segment: #GP(sel);
    // not present: #NP(sel); a 32-bit code segment is no 64-bit handler: #GP(sel)
    for (sel, vector, error) in [
        (0x00, GP, 0),
        (0x48, GP, 0x48),
        (0x38, GP, 0x38),
        (0x30, NP, 0x30),
    ] {
        set_gate(&mut c, 0x80, sel, 0, 0x8e);
        faults(&mut c, &int, vector, Some(error));
    }
    // IST entry past the TSS limit: #TS(TSS selector)
    set_gate(&mut c, 0x80, 0x08, 1, 0x8e);
    c.sregs.tr.limit = 0x20;
    faults(&mut c, &int, TS, Some(0x40));
    // a stack that does not translate: #PF, a supervisor write, CR2 in the frame's page
    let mut c = idt_cpu();
    set_gate(&mut c, 0x80, 0x08, 0, 0x8e);
    c.regs.rsp = 0x7_0010;
    faults(&mut c, &int, PF, Some(0b010));
    assert_eq!(c.sregs.cr2, 0x7_0010 - 40);
}

#[test]
fn int_outside_long_mode_is_refused() {
    let mut c = idt_cpu();
    c.sregs.efer = 0;
    c.sregs.cs.l = 0;
    c.sregs.cs.db = 1;
    assert!(matches!(
        complete_with(&mut c, &[0xcd, 0x80]),
        Err(EmulateError::Unsupported {
            mnemonic: Mnemonic::Int,
            ..
        })
    ));
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
    // pshufd 0x93 rotates the dwords up by one: [3,0,1,2].
    assert_eq!(
        compute(Mnemonic::Pshufd, 0, a, Some(0x93)),
        Some(0x0000_0003_0000_0002_0000_0001_0000_0004)
    );
    assert_eq!(compute(Mnemonic::Pslld, a, 0, Some(32)), Some(0));
    assert_eq!(
        compute(Mnemonic::Palignr, a, b, Some(4)),
        Some((b >> 32) | (a << 96))
    );
}

#[test]
fn fpu_state_goes_through_the_xsave_legacy_area_and_marks_it_in_use() {
    use lucid_hv::kvm_bindings::kvm_xsave;
    let mut x = kvm_xsave::default();
    x.region[7] = 0xffbf; // MXCSR_MASK, which kvm_fpu does not carry
    x.region[129] = 0x8000_0000; // an upper XSTATE_BV bit that must stay
    let f = lucid_hv::kvm_bindings::kvm_fpu {
        fpr: std::array::from_fn(|i| [i as u8 + 1; 16]),
        fcw: 0x37f,
        fsw: 0x80,
        ftwx: 0x81,
        last_opcode: 0x123,
        last_ip: 0x1122_3344_5566_7788,
        last_dp: 0x99aa_bbcc_ddee_ff00,
        xmm: std::array::from_fn(|i| [0x40 + i as u8; 16]),
        mxcsr: 0x1f80,
        ..Default::default()
    };
    state::fpu_into_xsave(&f, &mut x);
    assert_eq!(state::fpu_from_xsave(&x), f);
    assert_eq!(
        x.region[128] & 0b11,
        0b11,
        "x87 and SSE marked as holding values"
    );
    assert_eq!(x.region[129], 0x8000_0000);
    assert_eq!(x.region[7], 0xffbf);
    // bytes as FXSAVE lays them out: MXCSR at 24, XMM0 at 160
    assert_eq!(x.region[6], 0x1f80);
    assert_eq!(x.region[40], 0x4040_4040);
}
