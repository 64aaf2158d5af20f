//! Instructions KVM's emulator lacks or might get wrong, run at CPL0 in the `cpl0-insns` probe
//! guest under Lucid, against the same instruction run natively on the host (inline asm here)
//! or, where user mode cannot run it, the SDM's rules. The stats show which of them reached
//! Lucid as emulation failures.

mod common;

use std::arch::asm;
use std::collections::HashMap;
use std::time::Duration;

use common::{lucid, Outcome};

const LIMIT: Duration = Duration::from_secs(60);

fn run(cmdline: &str) -> Outcome {
    let o = lucid(
        &["run", "--guest", "cpl0-insns", "--cmdline", cmdline],
        LIMIT,
    );
    assert_eq!(
        o.status,
        Some(1),
        "stdout: {}\nstderr: {}",
        o.stdout,
        o.stderr
    );
    assert!(o.stdout.contains("cpl0-insns: done"), "{}", o.stdout);
    o
}

/// Whether guest kernel code is emulated by KVM on this host (then these instructions reach
/// Lucid); the guest asks Lucid's backend hypercall.
fn pvm(o: &Outcome) -> bool {
    o.stdout.contains("cpl0-insns backend=pvm")
}

/// The `key=value` words of each output line starting with `prefix `.
fn lines(out: &str, prefix: &str) -> Vec<HashMap<String, String>> {
    out.lines()
        .filter_map(|l| l.strip_prefix(prefix)?.strip_prefix(' '))
        .map(|l| {
            l.split_whitespace()
                .filter_map(|w| w.split_once('='))
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .collect()
        })
        .collect()
}

fn num(s: &str) -> u64 {
    match s.strip_prefix("0x") {
        Some(h) => u64::from_str_radix(h, 16),
        None => s.parse(),
    }
    .unwrap_or_else(|_| panic!("not a number: {s}"))
}

fn pair(s: &str) -> (u64, u64) {
    let (a, b) = s.split_once('/').expect("a/b");
    (num(a), num(b))
}

/// `fault=` as (vector, error code), `None` for `fault=none`.
fn fault(l: &HashMap<String, String>) -> Option<(u64, u64)> {
    let f = &l["fault"];
    (f != "none").then(|| pair(f))
}

/// CPUID as guest code at CPL0 reads it (answered by KVM from the CPUID Lucid set): the leaf's
/// registers from the guest's `cpuid` lines.
fn cpl0_cpuid(out: &str, leaf: u64) -> [u64; 4] {
    let l = lines(out, "cpuid")
        .into_iter()
        .find(|l| num(&l["leaf"]) == leaf)
        .expect("cpuid line");
    let v: Vec<u64> = l["cpl0"].split(',').map(num).collect();
    [v[0], v[1], v[2], v[3]]
}

const FLAGS_IN: u64 = 0x8d7;
const CF: u64 = 1;
const PF: u64 = 4;
const ZF: u64 = 0x40;
const SF: u64 = 0x80;
const OF: u64 = 0x800;

/// SHLD/SHRD on the host: `d` and `s` full registers, `c` in RCX, flags preset to FLAGS_IN.
fn native_shift(op: &str, width: u64, d: u64, s: u64, c: u64) -> (u64, u64) {
    let (mut d, mut fl) = (d, FLAGS_IN);
    macro_rules! go {
        ($insn:literal) => {
            // SAFETY: one shift on the named registers between a flags write and read; the
            // stack pointer comes back to where it was.
            unsafe {
                asm!("push {f}", "popfq", $insn, "pushfq", "pop {f}",
                     d = inout(reg) d, s = in(reg) s, f = inout(reg) fl, in("rcx") c)
            }
        };
    }
    match (op, width) {
        ("shld", 16) => go!("shld {d:x}, {s:x}, cl"),
        ("shld", 32) => go!("shld {d:e}, {s:e}, cl"),
        ("shld", 64) => go!("shld {d:r}, {s:r}, cl"),
        ("shrd", 16) => go!("shrd {d:x}, {s:x}, cl"),
        ("shrd", 32) => go!("shrd {d:e}, {s:e}, cl"),
        ("shrd", 64) => go!("shrd {d:r}, {s:r}, cl"),
        _ => panic!("{op} {width}"),
    }
    (d, fl)
}

/// SHLD/SHRD by CL and by immediate, every width, register and memory destinations, and the
/// count register as an operand: at CPL0 (KVM's emulator on this host) they give the host CPU's
/// result and defined flags, and none of them reaches Lucid.
#[test]
fn shld_shrd_at_cpl0_match_the_host() {
    let o = run("run=shift");
    let cases = lines(&o.stdout, "shift");
    assert_eq!(cases.len(), 21 * 7 * 2, "{}", o.stdout);
    for l in &cases {
        let (op, form, width) = (&l["op"][..], &l["form"][..], num(&l["width"]));
        let (d, s, c) = (num(&l["d"]), num(&l["s"]), num(&l["count"]));
        let (want, want_fl) = match form {
            "cl-rcx-dst" => {
                let rcx = (d & !0xff) | (c & 0xff);
                native_shift(op, width, rcx, s, rcx)
            }
            "cl-ecx-src" => native_shift(op, width, d, (s & !0xff) | (c & 0xff), c),
            _ => native_shift(op, width, d, s, c),
        };
        let want = if form == "mem" && width < 64 {
            want & ((1 << width) - 1)
        } else {
            want
        };
        let masked = c & if width == 64 { 63 } else { 31 };
        let defined = match masked {
            0 => CF | PF | ZF | SF | OF | 0x10,
            1 => CF | PF | ZF | SF | OF,
            _ => CF | PF | ZF | SF,
        };
        for cpl in ["cpl0", "cpl3"] {
            let (got, got_fl) = pair(&l[cpl]);
            assert_eq!(got, want, "{cpl} {l:?}");
            assert_eq!(got_fl & defined, want_fl & defined, "{cpl} flags {l:?}");
        }
    }
    // A mnemonic's counter appears when it is first emulated: absent is never.
    let emulated = |m: &str| o.counter_or_zero(&format!("vcpu0.emulated.{m}"));
    assert_eq!(emulated("shld") + emulated("shrd"), 0);
}

fn native_xgetbv(ecx: u32) -> u64 {
    assert!(std::is_x86_feature_detected!("xsave"));
    // SAFETY: the host CPU has XSAVE (checked above) and its kernel sets CR4.OSXSAVE.
    unsafe { std::arch::x86_64::_xgetbv(ecx) }
}

/// XGETBV, CLWB, RDPRU and INVPCID at CPL0: what reaches Lucid, and what the guest sees.
#[test]
fn system_instructions_at_cpl0_complete_or_fault_as_the_cpu_does() {
    assert!(std::is_x86_feature_detected!("xsave"), "the host has XSAVE");
    let host_xcr0 = native_xgetbv(0);
    let o = run(&format!(
        "run=cpuid,xgetbv,clwb,rdpru,invpcid,xmm xcr0={host_xcr0:#x}"
    ));
    let out = &o.stdout;
    let leaf1 = cpl0_cpuid(out, 1);
    let leaf7 = cpl0_cpuid(out, 7);
    let ext8 = cpl0_cpuid(out, 0x8000_0008);

    // XGETBV: #UD with CR4.OSXSAVE clear; XCR0 as the guest loaded it (the host's own value);
    // ECX=1 a superset of what is in use; ECX=2 #GP(0).
    assert_ne!(leaf1[2] & 1 << 26, 0, "XSAVE offered at CPL0");
    let set = &lines(out, "xsetbv")[0];
    assert_eq!(fault(set), None, "{out}");
    let x: HashMap<String, HashMap<String, String>> = lines(out, "xgetbv")
        .into_iter()
        .map(|l| (l["case"].clone(), l))
        .collect();
    assert_eq!(fault(&x["osxsave0"]), Some((6, 0)));
    assert_eq!(fault(&x["xcr0"]), None);
    assert_eq!(num(&x["xcr0"]["value"]), host_xcr0);
    let (native_inuse, inuse) = (native_xgetbv(1), num(&x["xinuse"]["value"]));
    assert_eq!(fault(&x["xinuse"]), None);
    for v in [native_inuse, inuse] {
        assert_eq!(v & !host_xcr0, 0, "XINUSE within XCR0: {v:#x}");
        assert_ne!(v & 2, 0, "SSE state in use: {v:#x}");
    }
    assert_eq!(fault(&x["ecx2"]), Some((13, 0)));

    // CLWB: completes and leaves the line's data alone; a non-canonical address is #GP(0), one
    // that does not translate #PF.
    let clwb = lines(out, "clwb");
    if leaf7[1] & 1 << 24 != 0 {
        assert_eq!(fault(&clwb[0]), None);
        assert_eq!(num(&clwb[0]["value"]), 0x1122_3344_5566_7788);
        assert_eq!(fault(&clwb[1]), Some((13, 0)));
        // an address with no page: #PF, a read (error code 0), CR2 the address
        assert_eq!(fault(&clwb[2]), Some((14, 0)));
        assert_eq!(num(&clwb[2]["cr2"]), 0x1_0000_0040);
        if std::arch::x86_64::__cpuid_count(7, 0).ebx & 1 << 24 != 0 {
            let line = [0x5au8; 64];
            // SAFETY: clwb of a live buffer: data unchanged.
            unsafe { asm!("clwb [{p}]", p = in(reg) line.as_ptr()) };
            assert_eq!(line, [0x5a; 64]);
        }
    } else {
        assert!(clwb.iter().all(|l| fault(l) == Some((6, 0))));
    }

    // RDPRU: #UD where the guest's CPUID lacks it, as on a CPU without it (the host's own
    // CPUID lacks it too here: natively it would be SIGILL).
    let rdpru = &lines(out, "rdpru")[0];
    assert_eq!(ext8[1] & 1 << 4, 0, "no CPUID here offers RDPRU: {out}");
    assert_eq!(fault(rdpru), Some((6, 0)));

    // INVPCID: #UD without the feature; with it, the new mapping after each valid type and
    // #GP(0) for the bad ones.
    let inv = lines(out, "invpcid");
    assert_eq!(inv.len(), 8);
    if leaf7[1] & 1 << 10 == 0 {
        assert!(inv.iter().all(|l| fault(l) == Some((6, 0))), "{out}");
    } else {
        for l in &inv[..4] {
            assert_eq!(fault(l), None, "{l:?}");
            assert_eq!(l["after"], l["expect"], "{l:?}");
        }
        assert!(inv[4..].iter().all(|l| fault(l) == Some((13, 0))), "{out}");
    }

    // An XMM register written by a completion is what CPL3 code then reads natively.
    for l in lines(out, "xmm") {
        assert_eq!(l["got"], l["want"], "{l:?}");
    }

    // All of them reached Lucid as emulation failures at CPL0 (where KVM emulates CPL0 code;
    // under VT-x or AMD-V they run on the CPU).
    if !pvm(&o) {
        return;
    }
    let emulated = |m: &str| o.counter(&format!("vcpu0.emulated.{m}"));
    assert_eq!(emulated("xgetbv"), 4);
    assert_eq!(emulated("clwb"), 3);
    assert_eq!(emulated("rdpru"), 1);
    assert_eq!(emulated("invpcid"), 8);
    assert!(emulated("movq") >= 4);
}

/// INT n and INT3 at CPL0 go through the guest's IDT as on the CPU: the frame (RIP after the
/// instruction, CS, RFLAGS, RSP, SS) on the 16-byte-aligned current or IST stack, IF cleared by
/// interrupt gates only, and #NP/#GP with the vector in the error code for a bad gate.
#[test]
fn int_n_and_int3_at_cpl0_go_through_the_idt() {
    let o = run("run=int");
    let cases: HashMap<String, HashMap<String, String>> = lines(&o.stdout, "int")
        .into_iter()
        .map(|l| (l["case"].clone(), l))
        .collect();
    assert_eq!(cases.len(), 8, "{}", o.stdout);
    let n = |c: &str, k: &str| num(&cases[c][k]);
    for c in ["int-gate", "ist", "trap-gate-if1", "int-gate-if1", "int3"] {
        assert_eq!(fault(&cases[c]), None, "{c}");
        assert_eq!(n(c, "delivered"), 1, "{c}");
        assert_eq!(
            n(c, "frame_rip"),
            n(c, "next_rip"),
            "{c}: returns after the instruction"
        );
        assert_eq!(n(c, "frame_cs"), n(c, "cs"), "{c}");
        assert_eq!(n(c, "frame_rflags"), n(c, "rflags"), "{c}");
        assert_eq!(n(c, "frame_rsp"), n(c, "rsp"), "{c}");
        assert_eq!(n(c, "frame_ss"), n(c, "ss"), "{c}");
        let top = if c == "ist" {
            n(c, "ist_top")
        } else {
            n(c, "rsp")
        };
        assert_eq!(n(c, "handler_rsp"), (top & !15) - 40, "{c}: frame position");
    }
    const IF: u64 = 0x200;
    assert_ne!(n("trap-gate-if1", "rflags") & IF, 0);
    assert_ne!(
        n("trap-gate-if1", "handler_rflags") & IF,
        0,
        "a trap gate keeps IF"
    );
    assert_ne!(n("int-gate-if1", "rflags") & IF, 0);
    assert_eq!(
        n("int-gate-if1", "handler_rflags") & IF,
        0,
        "an interrupt gate clears IF"
    );
    for (c, vector, err) in [
        ("not-present", 11, 0x93 * 8 + 2),
        ("bad-type", 13, 0x94 * 8 + 2),
        ("past-limit", 13, 0x95 * 8 + 2),
    ] {
        assert_eq!(fault(&cases[c]), Some((vector, err)), "{c}");
        assert_eq!(n(c, "delivered"), 0, "{c}");
    }
    if pvm(&o) {
        assert_eq!(o.counter("vcpu0.emulated.int"), 7);
        assert_eq!(o.counter("vcpu0.emulated.int3"), 1);
    }
}
