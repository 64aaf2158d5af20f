//! Symbiotic modules (docs/symbiotic.md §7) on real KVM: the `sym-mod` guest
//! runs the kit's module loader; Lucid loads, calls and unloads the kit's modules through the
//! SymSpy mailbox, refuses bad ones (its own checks and the guest loader's), places a module
//! in a read-only memory slot the guest cannot write, and survives a guest that never answers.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use lucid_vmm::sym::{CallLimits, ModuleError, ModuleOptions, Symbiotic};
use lucid_vmm::{KernelSource, SerialOutput, StopReason, Vm, VmConfig};

struct Guest {
    vm: Vm,
    serial: std::path::PathBuf,
}

impl Guest {
    fn start(tag: &str, cmdline: &str) -> Self {
        let serial =
            std::env::temp_dir().join(format!("lucid-symmod-{}-{tag}.txt", std::process::id()));
        let mut c = VmConfig::new(KernelSource::Builtin {
            name: "sym-mod".into(),
            bytes: lucid_guests::get("sym-mod").expect("built-in guest"),
        });
        c.payload.cmdline = cmdline.into();
        c.symbiotic.enabled = true;
        c.devices.serial = SerialOutput::File(serial.clone());
        let mut vm = Vm::build(c).expect("build the VM");
        // The SymCalls here must complete: a busy host may leave the vCPU thread unscheduled
        // for longer than the default bound, which is no fault of the call.
        vm.sym().expect("symbiotic VM").set_call_limits(CallLimits {
            timeout: Duration::from_secs(10),
            ..CallLimits::default()
        });
        vm.start().expect("start the VM");
        Guest { vm, serial }
    }

    fn sym(&self) -> Arc<Symbiotic> {
        self.vm.sym().expect("symbiotic VM").clone()
    }

    fn counter(&self, name: &str) -> u64 {
        self.vm.stats().counter(name).get()
    }

    /// Stops the VM and returns its console output.
    fn finish(self) -> String {
        self.vm.stop(StopReason::Signal(15));
        let report = self.vm.wait();
        assert_eq!(
            report.stop,
            StopReason::Signal(15),
            "the VM ran until stopped"
        );
        let out = std::fs::read_to_string(&self.serial).unwrap_or_default();
        let _ = std::fs::remove_file(&self.serial);
        out
    }
}

fn module(name: &str) -> &'static [u8] {
    lucid_guests::module(name).expect("built-in module")
}

fn fnv1a(b: &[u8]) -> u64 {
    b.iter().fold(0xcbf29ce484222325u64, |h, &c| {
        (h ^ u64::from(c)).wrapping_mul(0x100000001b3)
    })
}

/// `obj` with the first relocation of its first RELA section moved to offset 0xfff0.
fn relocation_past_its_section(obj: &[u8]) -> Vec<u8> {
    let mut b = obj.to_vec();
    let u = |b: &[u8], o: usize, n: usize| {
        b[o..o + n]
            .iter()
            .rev()
            .fold(0u64, |v, &c| (v << 8) | u64::from(c)) as usize
    };
    let (shoff, shnum) = (u(&b, 40, 8), u(&b, 60, 2));
    let rela = (0..shnum)
        .map(|i| shoff + i * 64)
        .find(|&s| u(&b, s + 4, 4) == 4)
        .expect("a RELA section");
    let first = u(&b, rela + 24, 8);
    b[first..first + 8].copy_from_slice(&0xfff0u64.to_le_bytes());
    b
}

fn guest_refusal(e: ModuleError) -> String {
    match e {
        ModuleError::Guest { message, .. } => message,
        e => panic!("expected the guest loader to refuse, got: {e}"),
    }
}

#[test]
fn hello_loads_calls_and_unloads_100_times_without_leaking() {
    let _turn = common::one_at_a_time();
    let g = Guest::start("hello", "");
    let sym = g.sym();
    let expected = fnv1a(b"hello") & 0xffff_ffff;
    let opts = ModuleOptions::default();
    let first = sym.load_module(module("hello"), &opts).expect("load hello");
    sym.unload_module(first.id).expect("unload hello");
    let start = sym.module_loader().expect("loader ready");
    assert_eq!(start.arena_used, 0, "arena empty after the first cycle");
    for i in 0..99 {
        let m = sym.load_module(module("hello"), &opts).expect("load hello");
        assert_eq!(m.name, "hello");
        assert_eq!(m.init_result, expected, "init result, cycle {i}");
        assert!(!m.read_only);
        assert!(m.base >= start.arena && m.base < start.arena + start.arena_size);
        assert_eq!(sym.modules().len(), 1);
        // module_call(x) = 2x + calls so far.
        assert_eq!(sym.call_module(m.id, 5).unwrap(), 10);
        assert_eq!(sym.call_module(m.id, 7).unwrap(), 15);
        sym.unload_module(m.id).expect("unload hello");
        assert!(matches!(
            sym.call_module(m.id, 1),
            Err(ModuleError::NoSuchModule(_))
        ));
    }
    let end = sym.module_loader().unwrap();
    assert_eq!(
        end.arena_used, start.arena_used,
        "arena usage back to its start"
    );
    assert_eq!(end.loaded, 0);
    assert!(sym.modules().is_empty());
    assert_eq!(g.counter("sym.mod.loads"), 100);
    assert_eq!(g.counter("sym.mod.unloads"), 100);
    assert_eq!(g.counter("sym.mod.calls"), 198);
    assert_eq!(g.counter("sym.mod.timeouts"), 0);
    assert_eq!(
        g.counter("sym.mod.bytes"),
        100 * module("hello").len() as u64
    );
    let out = g.finish();
    assert_eq!(out.matches("module hello: init").count(), 100, "{out}");
    assert_eq!(out.matches("module hello: exit calls=2").count(), 99);
}

#[test]
fn bad_modules_are_refused_by_lucid_and_by_the_guest_loader() {
    let _turn = common::one_at_a_time();
    let g = Guest::start("bad", "");
    let sym = g.sym();
    let opts = ModuleOptions::default();
    let loader = {
        // Wait for the loader through a harmless load.
        let m = sym.load_module(module("hello"), &opts).unwrap();
        sym.unload_module(m.id).unwrap();
        sym.module_loader().unwrap()
    };

    // A GOT relocation from -fpic: Lucid's checks name it; so does the guest loader.
    let e = sym.load_module(module("badrel"), &opts).unwrap_err();
    assert!(matches!(e, ModuleError::Check(_)), "{e}");
    let lucid_msg = e.to_string();
    assert!(
        lucid_msg.contains("unsupported relocation type 42"),
        "{lucid_msg}"
    );
    let guest_msg = guest_refusal(
        sym.load_module_unchecked(module("badrel"), &opts)
            .unwrap_err(),
    );
    assert_eq!(guest_msg, "unsupported relocation type 42");

    // A symbol the guest does not export: only the guest loader knows its exports.
    let msg = guest_refusal(sym.load_module(module("nosym"), &opts).unwrap_err());
    assert_eq!(msg, "missing symbol sym_export_missing");

    // A 64 MiB .bss: too big for the arena, on both sides.
    let e = sym.load_module(module("bigbss"), &opts).unwrap_err();
    assert!(e.to_string().contains("too big"), "{e}");
    let msg = guest_refusal(
        sym.load_module_unchecked(module("bigbss"), &opts)
            .unwrap_err(),
    );
    assert!(msg.starts_with("too big"), "{msg}");

    // An object larger than the guest's object buffer (valid ELF, padded).
    let mut huge = module("hello").to_vec();
    huge.resize(loader.object_size as usize + 4096, 0);
    let e = sym.load_module(&huge, &opts).unwrap_err();
    assert!(e.to_string().contains("too big"), "{e}");
    // Not ELF at all.
    let e = sym.load_module(b"#!/bin/sh\necho hi\n", &opts).unwrap_err();
    assert!(e.to_string().contains("not an ELF"), "{e}");
    let msg = guest_refusal(sym.load_module_unchecked(b"garbage!", &opts).unwrap_err());
    assert_eq!(msg, "not an ELF object");

    // A relocation that patches a byte past its section: both sides check targets.
    let bad = relocation_past_its_section(module("hello"));
    let e = sym.load_module(&bad, &opts).unwrap_err();
    assert!(e.to_string().contains("outside its section"), "{e}");
    let msg = guest_refusal(sym.load_module_unchecked(&bad, &opts).unwrap_err());
    assert!(
        msg.starts_with("relocation target 0xfff0 outside its section"),
        "{msg}"
    );

    assert_eq!(g.counter("sym.mod.refused_lucid"), 5);
    assert_eq!(g.counter("sym.mod.refused_guest"), 5);
    // Nothing leaked, and the loader still works.
    assert_eq!(sym.module_loader().unwrap().arena_used, 0);
    let m = sym.load_module(module("hello"), &opts).unwrap();
    sym.unload_module(m.id).unwrap();
    assert_eq!(g.counter("sym.mod.loads"), 2);
    g.finish();
}

#[test]
fn read_only_module_cannot_be_written_by_the_guest() {
    let _turn = common::one_at_a_time();
    let g = Guest::start("ro", "try_write_ro=1");
    let sym = g.sym();
    let ro = ModuleOptions {
        read_only: true,
        ..Default::default()
    };
    assert!(sym.module_slots().is_empty());
    for round in 0..3 {
        let m = sym
            .load_module(module("counter"), &ro)
            .expect("read-only load");
        assert!(m.read_only);
        assert_eq!(m.name, "counter");
        assert_eq!(m.init_result, 0x200, "init registered its SymCall");
        assert!(
            m.base >= lucid_sym::abi::module::RO_WINDOW,
            "code in the read-only window: {:#x}",
            m.base
        );
        assert_eq!(sym.module_slots().len(), 1, "one read-only memory slot");
        assert_eq!(sym.call_module(m.id, 3).unwrap(), 3);
        assert_eq!(sym.call_module(m.id, 4).unwrap(), 7);
        assert_eq!(g.counter("sym.mod.ro_writes_blocked"), round + 1);
        sym.unload_module(m.id).unwrap();
        assert!(sym.module_slots().is_empty(), "slot removed on unload");
    }
    // A read-only module next to an ordinary one.
    let a = sym.load_module(module("hello"), &ro).unwrap();
    let b = sym
        .load_module(module("hello"), &ModuleOptions::default())
        .unwrap();
    assert_eq!(a.init_result, b.init_result);
    assert_eq!(sym.call_module(a.id, 1).unwrap(), 2);
    sym.unload_module(a.id).unwrap();
    sym.unload_module(b.id).unwrap();
    assert!(sym.module_slots().is_empty());
    assert_eq!(sym.module_loader().unwrap().arena_used, 0);
    let out = g.finish();
    assert_eq!(out.matches("ro_write blocked=1").count(), 4, "{out}");
    assert!(!out.contains("ro_write blocked=0"), "{out}");
}

#[test]
fn a_loader_that_does_not_answer_times_out_and_the_vm_carries_on() {
    let _turn = common::one_at_a_time();
    let g = Guest::start("timeout", "poll_after_ms=3000");
    let sym = g.sym();
    // The load's timeout also covers waiting for the loader to show up: wait for it first
    // (however slowly the guest boots), so that the short load below times out on the loader
    // that does not poll yet (it starts polling 3 s after it registered).
    let start = Instant::now();
    while sym.module_loader().is_none() {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "the guest's loader never registered"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    let quick = ModuleOptions {
        timeout: Some(Duration::from_millis(300)),
        ..Default::default()
    };
    let e = sym.load_module(module("hello"), &quick).unwrap_err();
    assert!(matches!(e, ModuleError::Timeout(_)), "{e}");
    assert_eq!(g.counter("sym.mod.timeouts"), 1);
    assert!(sym.modules().is_empty());
    // Once the guest polls, the withdrawn request is skipped and a new one works.
    let patient = ModuleOptions {
        timeout: Some(Duration::from_secs(10)),
        ..Default::default()
    };
    let m = sym
        .load_module(module("hello"), &patient)
        .expect("load after the timeout");
    assert_eq!(m.init_result, fnv1a(b"hello") & 0xffff_ffff);
    let loader = sym.module_loader().unwrap();
    assert_eq!(loader.requests, 1, "the withdrawn request was not handled");
    assert_eq!(loader.loaded, 1);
    sym.unload_module(m.id).unwrap();
    let out = g.finish();
    assert_eq!(out.matches("module hello: init").count(), 1, "{out}");
}

#[test]
fn a_guest_without_a_loader_gets_a_clear_error() {
    let _turn = common::one_at_a_time();
    let serial = std::env::temp_dir().join(format!("lucid-symmod-{}-none.txt", std::process::id()));
    let mut c = VmConfig::new(KernelSource::Builtin {
        name: "spin".into(),
        bytes: lucid_guests::get("spin").expect("built-in guest"),
    });
    c.symbiotic.enabled = true;
    c.devices.serial = SerialOutput::File(serial.clone());
    let mut vm = Vm::build(c).unwrap();
    vm.start().unwrap();
    let sym = vm.sym().unwrap().clone();
    let e = sym
        .load_module(
            module("hello"),
            &ModuleOptions {
                timeout: Some(Duration::from_millis(200)),
                ..Default::default()
            },
        )
        .unwrap_err();
    assert!(matches!(e, ModuleError::NoLoader(_)), "{e}");
    assert!(e.to_string().contains("no SymSpy global page"), "{e}");
    assert!(matches!(
        sym.unload_module(7),
        Err(ModuleError::NoSuchModule(7))
    ));
    vm.stop(StopReason::Signal(15));
    assert_eq!(vm.wait().stop, StopReason::Signal(15));
    let _ = std::fs::remove_file(serial);
}

/// Modules and SymCall together: the `counter` module's init registers a SymCall handler, so
/// Lucid calls into a module it injected; unloading unregisters it (the call then gets ENOSYS).
#[test]
fn lucid_calls_into_an_injected_module_through_symcall() {
    let _turn = common::one_at_a_time();
    let g = Guest::start("symcall", "");
    let sym = g.sym();
    let nr = lucid_sym::abi::module::SYMCALL_MODULE_COUNTER;
    for read_only in [false, true] {
        let opts = ModuleOptions {
            read_only,
            ..Default::default()
        };
        let m = sym.load_module(module("counter"), &opts).unwrap();
        let r = sym
            .call(0, nr, [5, 0, 0, 0, 0])
            .expect("SymCall into the module");
        assert_eq!((r.status, r.values[0]), (0, 5));
        let r = sym.call(0, nr, [6, 0, 0, 0, 0]).unwrap();
        assert_eq!((r.status, r.values[0]), (0, 11));
        sym.unload_module(m.id).unwrap();
        let r = sym.call(0, nr, [1, 0, 0, 0, 0]).unwrap();
        assert_eq!(
            r.status,
            lucid_sym::abi::SYM_ENOSYS,
            "handler gone with the module"
        );
    }
    g.finish();
}
