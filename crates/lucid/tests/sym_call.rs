//! SymCall end to end (docs/symbiotic.md §5): a real VM (`lucid_vmm::Vm` in
//! process, `--symbiotic`, default seccomp) runs the `sym-call` guest, whose CPL3 workload checks
//! its registers and memory continually; the test thread issues SymCalls into it. Asserts
//! results, refusals, cut-offs and that the guest ends with `corrupt=0`.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use lucid_sym::abi::{self, call, page};
use lucid_vmm::sym::{CallLimits, SymCallError, Symbiotic};
use lucid_vmm::{KernelSource, SerialOutput, StopReason, Vm, VmConfig};

/// The guest's own calls (sym-call.c): end the workload; PIO exits forever; make hypercall
/// arg0 and return its result.
const TEST_DONE: u64 = 0x1f0;
const TEST_EXITS: u64 = 0x1f1;
const TEST_HC: u64 = 0x1f2;

struct Guest {
    vm: Vm,
    serial: std::path::PathBuf,
}

fn boot(tag: &str, vcpus: u8, cmdline: &str, symbiotic: bool) -> Guest {
    boot_with(tag, vcpus, cmdline, symbiotic, |_| {})
}

/// The limits of the calls that must complete (set on every symbiotic VM here): a call costs
/// tens of µs, but a busy host may leave the vCPU thread unscheduled for longer than the default
/// bound, which is no fault of the call. The tests that expect a cut-off pass short limits.
fn patient() -> CallLimits {
    CallLimits {
        timeout: Duration::from_secs(10),
        ..CallLimits::default()
    }
}

/// As [`boot`], with `setup` run on the VM between its build and its start.
fn boot_with(
    tag: &str,
    vcpus: u8,
    cmdline: &str,
    symbiotic: bool,
    setup: impl FnOnce(&Vm),
) -> Guest {
    let mut c = VmConfig::new(KernelSource::Builtin {
        name: "sym-call".into(),
        bytes: lucid_guests::get("sym-call").expect("built-in guest"),
    });
    c.payload.cmdline = cmdline.into();
    c.machine.vcpus = vcpus;
    c.symbiotic.enabled = symbiotic;
    let serial =
        std::env::temp_dir().join(format!("lucid-symcall-{}-{tag}.txt", std::process::id()));
    c.devices.serial = SerialOutput::File(serial.clone());
    let mut vm = Vm::build(c).expect("build VM");
    if let Some(sym) = vm.sym() {
        sym.set_call_limits(patient());
    }
    setup(&vm);
    vm.start().expect("start VM");
    Guest { vm, serial }
}

impl Guest {
    fn sym(&self) -> Arc<Symbiotic> {
        self.vm.sym().expect("--symbiotic").clone()
    }

    /// Waits until `vcpu` answers an echo (the guest registered its entry and stack there).
    fn ready(&self, vcpu: u32) {
        let sym = self.sym();
        let start = Instant::now();
        loop {
            match sym.call(vcpu, call::ECHO, [1, 2, 3, 4, 5]) {
                Ok(r) => {
                    assert_eq!((r.status, r.values), (abi::SYM_OK, [15, 1]));
                    return;
                }
                Err(SymCallError::NotRegistered(_))
                    if start.elapsed() < Duration::from_secs(20) =>
                {
                    std::thread::sleep(Duration::from_millis(5))
                }
                Err(e) => panic!("vCPU {vcpu} never answered: {e}; serial: {}", self.output()),
            }
        }
    }

    fn output(&self) -> String {
        std::fs::read_to_string(&self.serial).unwrap_or_default()
    }

    /// Waits until the guest has printed `line` (up to 20 s).
    fn wait_output(&self, line: &str) {
        let start = Instant::now();
        while !self.output().contains(line) {
            assert!(
                start.elapsed() < Duration::from_secs(20),
                "no {line:?} on the serial port: {}",
                self.output()
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Ends the workload with TEST_DONE (unless `done` is false), waits for the VM and returns
    /// the serial output after checking the guest's verdict.
    fn finish(self, done: bool) -> (String, lucid_vmm::RunReport) {
        if done {
            let r = self.sym().call(0, TEST_DONE, [0; 5]).expect("TEST_DONE");
            assert_eq!(r.status, abi::SYM_OK);
        }
        let report = self.vm.wait();
        let out = std::fs::read_to_string(&self.serial).unwrap_or_default();
        let _ = std::fs::remove_file(&self.serial);
        assert!(
            out.contains("sym-call done"),
            "guest did not finish ({:?}; serial counters {:?}): {out}",
            report.stop,
            report
                .counters
                .iter()
                .filter(|(k, _)| k.starts_with("serial."))
                .collect::<Vec<_>>()
        );
        assert!(out.contains(" corrupt=0 "), "guest saw corruption: {out}");
        assert!(!out.contains("EXCEPTION"), "{out}");
        assert_eq!(report.stop, StopReason::DebugExit(0), "{out}");
        (out, report)
    }
}

fn field(out: &str, key: &str) -> u64 {
    out.split_whitespace()
        .find_map(|w| w.strip_prefix(&format!("{key}=")))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {key}= in {out}"))
}

#[test]
fn echo_is_correct_ten_thousand_times() {
    let g = boot("echo", 1, "ms=120000", true);
    g.ready(0);
    let sym = g.sym();
    const N: u64 = 10_000;
    let (mut exits, mut max_exits) = (0, 0);
    for i in 0..N {
        let a = [i, i * 3, !i, i << 20, 7];
        let r = sym.call(0, call::ECHO, a).expect("echo");
        assert_eq!(r.status, abi::SYM_OK);
        let sum = a.iter().fold(0u64, |s, v| s.wrapping_add(*v));
        assert_eq!(r.values, [sum, i], "call {i}");
        exits += r.exits;
        max_exits = max_exits.max(r.exits);
    }
    // The completion's exit, plus the odd kick that lands after the call began.
    assert!(
        exits >= N && max_exits <= 3,
        "exits {exits}, max {max_exits}"
    );
    // READ_COUNTER reaches the guest's counters (index 3 is a constant it set).
    let r = sym.call(0, call::READ_COUNTER, [3, 0, 0, 0, 0]).unwrap();
    assert_eq!((r.status, r.values[0]), (abi::SYM_OK, 0x5eed));
    let r = sym.call(0, call::READ_COUNTER, [99, 0, 0, 0, 0]).unwrap();
    assert_eq!(r.status, abi::SYM_EINVAL);
    let r = sym.call(0, 0x77, [0; 5]).unwrap();
    assert_eq!(r.status, abi::SYM_ENOSYS, "no handler");
    // A paused vCPU serves calls and stays paused: its workload does not move meanwhile.
    let h = g.vm.vcpus()[0].clone();
    h.pause().unwrap();
    let c1 = sym
        .call(0, call::READ_COUNTER, [2, 0, 0, 0, 0])
        .unwrap()
        .values[0];
    std::thread::sleep(Duration::from_millis(50));
    let c2 = sym
        .call(0, call::READ_COUNTER, [2, 0, 0, 0, 0])
        .unwrap()
        .values[0];
    assert_eq!(c1, c2, "rounds while paused");
    h.resume().unwrap();
    // Lucid's count of the vCPU's calls is in its SymSpy page.
    let w = sym.spy().vcpu(0).unwrap().load_u64(page::W_SYMCALLS);
    assert_eq!(w, sym.symcalls_on(0));
    assert!(w >= N + 6);
    let stats = g.vm.stats().snapshot();
    let (out, _) = g.finish(true);
    assert!(field(&out, "symcalls_seen") >= N + 4, "{out}");
    assert!(field(&out, "checks") > 0);
    assert_eq!(stats["sym.call.busy"], 0);
    assert_eq!(stats["sym.call.timeouts"], 0);
    assert!(stats["sym.call.completed"] >= N + 4);
    assert!(stats["sym.call.exits"] >= N);
}

/// Calls land right after the guest's PIO exits too (the pending OUT is finished first).
#[test]
fn calls_between_pio_exits_leave_the_guest_intact() {
    let g = boot("pio", 1, "ms=120000 exits_every=300", true);
    g.ready(0);
    let sym = g.sym();
    // The workload's exits go to the POST port (0x80); the calls' own completions do not.
    let post = g.vm.stats().counter("post.writes");
    let before = post.get();
    for i in 0..3000u64 {
        // Each call waits for a new exit of the workload and is queued at once: it lands while
        // the vCPU handles that exit or soon after, whatever the speed of the guest's loop
        // against the caller's turnaround.
        let seen = post.get();
        let t = Instant::now();
        while post.get() == seen {
            assert!(
                t.elapsed() < Duration::from_secs(20),
                "the workload stopped exiting (call {i}): {}",
                g.output()
            );
            std::thread::yield_now();
        }
        let r = sym.call(0, call::ECHO, [i, 1, 1, 1, 1]).expect("echo");
        assert_eq!(r.values, [i + 4, i]);
    }
    let exits = post.get() - before;
    let (out, _) = g.finish(true);
    assert!(field(&out, "checks") > 0);
    assert!(exits >= 3000, "the guest exits while called: {exits}");
}

#[test]
fn two_vcpus_are_called_concurrently_from_two_threads() {
    let g = boot("smp", 2, "cpus=2 ms=120000", true);
    g.ready(0);
    g.ready(1);
    // Phase 1: 2000 calls each to its own vCPU (never refused: nobody else calls it then).
    // Phase 2, after both finished phase 1: every fourth call goes to the other vCPU.
    let phase2 = Arc::new(std::sync::Barrier::new(2));
    let threads: Vec<_> = (0..2u32)
        .map(|t| {
            let sym = g.sym();
            let phase2 = phase2.clone();
            std::thread::spawn(move || {
                let mut busy = 0;
                for i in 0..3000u64 {
                    if i == 2000 {
                        phase2.wait();
                    }
                    let vcpu = if i >= 2000 && i % 4 == 3 { 1 - t } else { t };
                    let a = [i, u64::from(t), 100, 0, 0];
                    match sym.call(vcpu, call::ECHO, a) {
                        Ok(r) => assert_eq!(r.values, [i + u64::from(t) + 100, i]),
                        // The other thread holds that vCPU right now: refused, not queued.
                        Err(SymCallError::Busy(v)) if i >= 2000 => {
                            assert_eq!(v, vcpu);
                            busy += 1;
                        }
                        Err(e) => panic!("call {i} to vCPU {vcpu}: {e}"),
                    }
                }
                busy
            })
        })
        .collect();
    let busy: u64 = threads.into_iter().map(|t| t.join().unwrap()).sum();
    assert!(busy < 2000, "{busy} of the 2000 mixed calls refused");
    let sym = g.sym();
    assert!(sym.symcalls_on(0) > 2000 && sym.symcalls_on(1) > 2000);
    assert_eq!(
        sym.symcalls_on(0) + sym.symcalls_on(1),
        6000 - busy + 2,
        "+ the two readiness echoes"
    );
    for v in 0..2 {
        let r = sym
            .call(v, call::READ_COUNTER, [u64::from(v), 0, 0, 0, 0])
            .unwrap();
        assert!(r.values[0] > 0, "vCPU {v}'s workload ran");
    }
    let (out, _) = g.finish(true);
    assert!(field(&out, "symcalls_seen") > 4000, "{out}");
}

#[test]
fn misbehaving_handlers_cost_the_call_not_the_vm() {
    let g = boot("bad", 1, "ms=120000", true);
    g.ready(0);
    let sym = g.sym();
    let short = CallLimits {
        timeout: Duration::from_millis(300),
        ..CallLimits::default()
    };
    // A looping handler takes no exits: cut off by the deadline. While it runs, a second call
    // to that vCPU is refused at once. (This first loop runs 3 s: the test must see the
    // guest's mark and call again before it ends, even when it is not scheduled for a while.)
    let looping = {
        let sym = sym.clone();
        let long = CallLimits {
            timeout: Duration::from_secs(3),
            ..CallLimits::default()
        };
        std::thread::spawn(move || sym.call_with(0, call::TEST_LOOP, [0; 5], long))
    };
    // The guest marks its vCPU page while a handler runs.
    let spy_page = sym.spy().vcpu(0).unwrap().clone();
    while spy_page.load_u64(page::V_IN_SYMCALL) == 0 && !looping.is_finished() {
        std::thread::sleep(Duration::from_millis(1));
    }
    let nested = sym.call(0, call::ECHO, [0; 5]);
    assert!(
        matches!(nested, Err(SymCallError::Busy(0))),
        "refused, not queued: {nested:?}"
    );
    let r = looping.join().unwrap();
    assert!(
        matches!(r, Err(SymCallError::Timeout { vcpu: 0, .. })),
        "{r:?}"
    );
    // The guest continues: the next call works.
    assert_eq!(
        sym.call(0, call::ECHO, [1, 0, 0, 0, 0]).unwrap().values,
        [1, 1]
    );
    // A faulting handler: the guest's exception path reports the #PF.
    let r = sym
        .call(0, call::TEST_FAULT, [0; 5])
        .expect("fault reported");
    assert_eq!(r.status, abi::SYM_EFAULT);
    assert_eq!(r.values[0], 14, "#PF");
    // A handler that smashes its return address: #GP on the ret, or cut off.
    let smash_timed_out = match sym.call_with(0, call::TEST_SMASH, [0; 5], short) {
        Ok(r) => {
            assert_eq!((r.status, r.values[0]), (abi::SYM_EFAULT, 13), "#GP");
            0
        }
        Err(SymCallError::Timeout { .. }) => 1,
        Err(e) => panic!("smash: {e}"),
    };
    // Again, to see the state was fully put back each time.
    for _ in 0..3 {
        assert!(sym.call_with(0, call::TEST_LOOP, [0; 5], short).is_err());
        assert_eq!(
            sym.call(0, call::TEST_FAULT, [0; 5]).unwrap().status,
            abi::SYM_EFAULT
        );
        assert_eq!(
            sym.call(0, call::ECHO, [2, 0, 0, 0, 0]).unwrap().values,
            [2, 2]
        );
    }
    // A vCPU held outside the guest past the deadline (here: another request waiting on its
    // thread until the test releases it) never takes the call up: the caller gives up on time,
    // the call never runs.
    let h = g.vm.vcpus()[0].clone();
    let (held_tx, held) = std::sync::mpsc::channel();
    let (release, release_rx) = std::sync::mpsc::channel::<()>();
    let holder = std::thread::spawn(move || {
        h.call(move |_| {
            held_tx.send(()).unwrap();
            let _ = release_rx.recv_timeout(Duration::from_secs(60));
        })
    });
    held.recv_timeout(Duration::from_secs(20))
        .expect("the holding request runs on the vCPU thread");
    let quick = CallLimits {
        timeout: Duration::from_millis(100),
        ..CallLimits::default()
    };
    let r = sym.call_with(0, call::ECHO, [0; 5], quick);
    assert!(matches!(r, Err(SymCallError::Timeout { .. })), "{r:?}");
    assert!(
        !holder.is_finished(),
        "gave up while the vCPU was still held"
    );
    release.send(()).unwrap();
    holder.join().unwrap().unwrap();
    let before = sym.symcalls_on(0);
    assert_eq!(
        sym.call(0, call::ECHO, [4, 0, 0, 0, 0]).unwrap().values,
        [4, 4]
    );
    assert_eq!(
        sym.symcalls_on(0),
        before + 1,
        "the abandoned call did not run"
    );
    let stats = g.vm.stats().snapshot();
    let (out, _) = g.finish(true);
    assert!(field(&out, "faults_seen") >= 4, "{out}");
    assert_eq!(stats["sym.call.busy"], 1);
    assert_eq!(stats["sym.call.timeouts"], 5 + smash_timed_out);
    assert!(stats["sym.call.faults"] >= 4);
    assert_eq!(stats["sym.call.stray_returns"], 0);
}

#[test]
fn a_guest_without_a_symcall_entry_is_not_called() {
    let g = boot("unreg", 1, "ms=1500 register=0", true);
    let sym = g.sym();
    // Past the point where the guest would have registered its entry.
    g.wait_output("sym-call ready cpus=1 registered=0");
    for _ in 0..10 {
        let r = sym.call(0, call::ECHO, [0; 5]);
        assert!(matches!(r, Err(SymCallError::NotRegistered(0))), "{r:?}");
    }
    assert!(matches!(
        sym.call(5, call::ECHO, [0; 5]),
        Err(SymCallError::NoVcpu(5))
    ));
    let stats = g.vm.stats().snapshot();
    assert_eq!(stats["sym.call.not_registered"], 10);
    let (out, _) = g.finish(false);
    assert_eq!(field(&out, "symcalls_seen"), 0);
}

#[test]
fn without_symbiotic_there_is_nothing_to_call() {
    let mut c = VmConfig::new(KernelSource::Builtin {
        name: "sym-call".into(),
        bytes: lucid_guests::get("sym-call").expect("built-in guest"),
    });
    c.devices.serial = SerialOutput::File(
        std::env::temp_dir().join(format!("lucid-symcall-{}-plain.txt", std::process::id())),
    );
    let vm = Vm::build(c).expect("build VM");
    assert!(vm.sym().is_none());
}

/// A call issued on the vCPU's own thread (from an exit handler: here a hypercall hook) is
/// refused at once, inside a SymCall or not, instead of waiting for itself; a handler that keeps
/// exiting is cut off by the exit bound; an `HC_RETURN` outside a call is refused.
#[test]
fn own_thread_calls_are_refused_and_the_exit_bound_holds() {
    let g = boot_with("self", 1, "ms=120000 selfcall=64 stray=1", true, |vm| {
        let sym = vm.sym().expect("--symbiotic").clone();
        for nr in [64u64, 65] {
            let s = sym.clone();
            let hook = move |vcpu: u32, _: &lucid_hv::kvm_bindings::kvm_regs| -> u64 {
                match s.call(vcpu, call::ECHO, [0; 5]) {
                    Err(SymCallError::Busy(_)) => 1,
                    Ok(_) => 2,
                    Err(_) => 3,
                }
            };
            vm.hooks().add_hypercall(nr, Arc::new(hook)).unwrap();
        }
    });
    g.ready(0);
    let sym = g.sym();
    // Outside a call (the guest's boot, printed before its "ready" line) and inside one (a
    // handler's hypercall).
    let t = Instant::now();
    while !g.output().contains("sym-call ready") && t.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(g.output().contains("sym-call selfcall=1"), "{}", g.output());
    // An HC_RETURN outside a call is refused and counted.
    assert!(g.output().contains("sym-call stray=-22"), "{}", g.output());
    let r = sym.call(0, TEST_HC, [65, 0, 0, 0, 0]).unwrap();
    assert_eq!((r.status, r.values[0]), (abi::SYM_OK, 1));
    let bounded = CallLimits {
        timeout: Duration::from_secs(5),
        max_exits: 500,
        ..CallLimits::default()
    };
    let r = sym.call_with(0, TEST_EXITS, [0; 5], bounded);
    assert!(
        matches!(
            r,
            Err(SymCallError::TooManyExits {
                vcpu: 0,
                exits: 500
            })
        ),
        "{r:?}"
    );
    assert_eq!(
        sym.call(0, call::ECHO, [3, 0, 0, 0, 0]).unwrap().values,
        [3, 3]
    );
    let stats = g.vm.stats().snapshot();
    g.finish(true);
    assert_eq!(stats["sym.call.busy"], 2);
    assert_eq!(stats["sym.call.too_many_exits"], 1);
    assert_eq!(stats["sym.call.stray_returns"], 1);
}

/// The `lucid` binary: with `--symbiotic` the guest registers and runs its checked workload
/// (nobody calls it); without, it is told nothing is offered and says so.
#[test]
fn the_cli_offers_symcall_only_with_symbiotic() {
    let limit = Duration::from_secs(30);
    let on = common::lucid(
        &[
            "run",
            "--guest",
            "sym-call",
            "--symbiotic",
            "--cmdline",
            "ms=200",
        ],
        limit,
    );
    assert!(
        on.stdout.contains("sym-call done"),
        "{}{}",
        on.stdout,
        on.stderr
    );
    assert!(on.stdout.contains(" corrupt=0 "), "{}", on.stdout);
    assert_eq!(on.status, Some(1), "exit code 0: (0 << 1) | 1");
    assert_eq!(on.counter("sym.call.calls"), 0);
    let off = common::lucid(
        &["run", "--guest", "sym-call", "--cmdline", "ms=200"],
        limit,
    );
    assert!(off.stdout.contains("sym: not offered"), "{}", off.stdout);
    assert_eq!(off.status, Some(5), "exit code 2: (2 << 1) | 1");
}

/// Without KVM's state mirror (hosts without `KVM_CAP_SYNC_REGS`) the same calls go through
/// GET/SET ioctls: echo, a fault, a loop and calls right after PIO exits, guest intact.
#[test]
fn the_ioctl_path_keeps_the_guest_intact_too() {
    let g = boot("ioctl", 1, "ms=120000 exits_every=300", true);
    let sym = g.sym();
    sym.set_state_mirror(false);
    g.ready(0);
    for i in 0..2000u64 {
        let r = sym.call(0, call::ECHO, [i, 2, 0, 0, 0]).expect("echo");
        assert_eq!(r.values, [i + 2, i]);
    }
    let r = sym.call(0, call::TEST_FAULT, [0; 5]).unwrap();
    assert_eq!((r.status, r.values[0]), (abi::SYM_EFAULT, 14));
    let short = CallLimits {
        timeout: Duration::from_millis(100),
        ..CallLimits::default()
    };
    let r = sym.call_with(0, call::TEST_LOOP, [0; 5], short);
    assert!(matches!(r, Err(SymCallError::Timeout { .. })), "{r:?}");
    assert_eq!(
        sym.call(0, call::ECHO, [5, 0, 0, 0, 0]).unwrap().values,
        [5, 5]
    );
    g.finish(true);
}
