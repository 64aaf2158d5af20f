//! SymSpy end to end on real KVM with the `sym-spy` probe guest: discovery on
//! and off, zero exits for 10^6 guest updates, consistent records read by Lucid while the guest
//! writes, per-vCPU pages registered from their own vCPU, bad registrations refused.

mod common;

use std::time::Duration;

use common::{field, lucid, Outcome};
use lucid_vmm::{KernelSource, SerialOutput, StopReason, Vm, VmConfig};

const LIMIT: Duration = Duration::from_secs(30);

fn spy(symbiotic: bool, vcpus: u32, cmdline: &str) -> Outcome {
    let vcpus = vcpus.to_string();
    let mut args = vec!["run", "--guest", "sym-spy", "--vcpus", &vcpus];
    if symbiotic {
        args.push("--symbiotic");
    }
    args.extend(["--cmdline", cmdline]);
    lucid(&args, LIMIT)
}

/// The guest's exit code 0 through the debug-exit port: Lucid exits (0 << 1) | 1.
const PASS: Option<i32> = Some(1);

fn sym_counters(o: &Outcome) -> u64 {
    let s = &o.stats.as_ref().expect("stats JSON")["counters"]["sym"];
    fn sum(v: &serde_json::Value) -> u64 {
        match v {
            serde_json::Value::Object(m) => m.values().map(sum).sum(),
            v => v.as_u64().unwrap_or(0),
        }
    }
    sum(s)
}

#[test]
fn discovery_by_hypercall_and_not_offered_without_symbiotic() {
    let on = spy(true, 1, "updates=1000");
    assert_eq!(on.status, PASS, "{}\n{}", on.stdout, on.stderr);
    let features = field(&on.stdout, "sym-spy discover", "discover_hc").unwrap();
    assert_eq!(features, "0xf", "SymSpy, SymCall, SwapBypass, modules");
    // CPUID is not intercepted on PVM: the leaves Lucid installs are not what the guest sees
    // there. Where CPUID is intercepted the guest finds the same features through it.
    let cpuid = field(&on.stdout, "sym-spy discover", "discover_cpuid").unwrap();
    let pvm = field(&on.stdout, "sym-spy discover", "backend") == Some("pvm");
    assert!(
        cpuid == "0xf" || (pvm && cpuid == "0x0"),
        "cpuid path: {cpuid}"
    );
    assert_eq!(
        field(&on.stdout, "sym-spy register", "global"),
        Some("0"),
        "{}",
        on.stdout
    );
    assert_eq!(on.counter("sym.spy.registrations"), 2);
    assert!(on.counter("sym.discoveries") >= 3);

    let off = spy(false, 1, "updates=1000");
    assert_eq!(off.status, PASS, "{}\n{}", off.stdout, off.stderr);
    assert!(off.stdout.contains("sym: not offered"), "{}", off.stdout);
    assert_eq!(
        field(&off.stdout, "sym-spy discover", "discover_hc"),
        Some("0x0")
    );
    assert_eq!(
        field(&off.stdout, "sym-spy discover", "discover_cpuid"),
        Some("0x0")
    );
    assert_eq!(
        field(&off.stdout, "sym-spy updates", "registered"),
        Some("0")
    );
    assert_eq!(sym_counters(&off), 0, "no sym.* counter moved");
    assert!(!off.stdout.contains("sym-spy lucid"));
}

/// Exits of a run that the guest's own work could have caused: all of them minus the console's
/// bytes (one exit each; the 2N run prints longer numbers) and minus the interruptions (a
/// signal to the vCPU thread ends KVM_RUN whatever the guest does: Lucid's kicks, the host).
fn exits(o: &Outcome) -> u64 {
    o.stats.as_ref().unwrap()["exits"].as_u64().unwrap()
        - o.counter("serial.tx_bytes")
        - o.counter("vcpu0.exit.interrupted")
}

/// The exits of a run by reason, for a failure message.
fn exits_by_reason(o: &Outcome) -> String {
    o.stats.as_ref().unwrap()["exits_by_reason"].to_string()
}

#[test]
fn a_million_updates_cost_no_exits() {
    const N: u64 = 1_000_000;
    let a = spy(true, 1, &format!("updates={N}"));
    let b = spy(true, 1, &format!("updates={}", 2 * N));
    for o in [&a, &b] {
        assert_eq!(o.status, PASS, "{}\n{}", o.stdout, o.stderr);
    }
    assert_eq!(
        field(&b.stdout, "sym-spy updates", "counter"),
        Some("2000000")
    );
    let extra = exits(&b) as i64 - exits(&a) as i64;
    assert_eq!(
        extra,
        0,
        "{N} more updates took {extra} more exits (N: {}, console {} bytes; 2N: {}, console {} \
         bytes)",
        exits_by_reason(&a),
        a.counter("serial.tx_bytes"),
        exits_by_reason(&b),
        b.counter("serial.tx_bytes"),
    );
    // Lucid published its lines at registration: the guest read them.
    let line = "sym-spy lucid";
    assert!(
        field(&b.stdout, line, "publishes")
            .unwrap()
            .parse::<u64>()
            .unwrap()
            >= 1
    );
    let pressure: u64 = field(&b.stdout, line, "pressure").unwrap().parse().unwrap();
    assert!(pressure <= 1000);
    assert!(
        field(&b.stdout, line, "available_kib")
            .unwrap()
            .parse::<u64>()
            .unwrap()
            > 0
    );
    assert_eq!(
        field(&b.stdout, line, "rung"),
        Some("255"),
        "no device: RUNG_NONE"
    );
    assert!(field(&b.stdout, line, "runq_wait_ns").is_some());
}

#[test]
fn per_vcpu_pages_register_from_their_own_vcpu() {
    let o = spy(true, 2, "updates=1000 cpus=2");
    assert_eq!(o.status, PASS, "{}\n{}", o.stdout, o.stderr);
    assert_eq!(field(&o.stdout, "sym-spy ap", "register"), Some("0"));
    assert_eq!(field(&o.stdout, "sym-spy ap", "vcpu"), Some("1"));
    assert_eq!(o.counter("sym.spy.registrations"), 3);
    // A page that claims vCPU 0 registered from vCPU 1 is refused; the VM goes on.
    let w = spy(true, 2, "updates=1000 cpus=2 wrong_vcpu=1");
    assert_eq!(w.status, PASS, "{}\n{}", w.stdout, w.stderr);
    assert_eq!(field(&w.stdout, "sym-spy ap", "register"), Some("-22"));
    assert_eq!(w.counter("sym.spy.registrations_refused"), 1);
    assert_eq!(w.counter("sym.spy.registrations"), 2);
}

#[test]
fn bad_registrations_get_einval_and_the_vm_goes_on() {
    let o = spy(true, 1, "updates=1000 bad=1");
    assert_eq!(o.status, PASS, "{}\n{}", o.stdout, o.stderr);
    let bad = "sym-spy bad";
    assert_eq!(field(&o.stdout, bad, "unaligned"), Some("-22"));
    assert_eq!(field(&o.stdout, bad, "outside"), Some("-22"));
    assert_eq!(field(&o.stdout, bad, "magic"), Some("-22"));
    assert_eq!(field(&o.stdout, bad, "kind"), Some("-19"));
    assert_eq!(o.counter("sym.spy.registrations_refused"), 4);
    // The good registrations after them still work.
    assert_eq!(field(&o.stdout, "sym-spy register", "global"), Some("0"));
    assert_eq!(field(&o.stdout, "sym-spy updates", "registered"), Some("1"));
}

fn config(cmdline: &str, vcpus: u8) -> VmConfig {
    let mut c = VmConfig::new(KernelSource::Builtin {
        name: "sym-spy".into(),
        bytes: lucid_guests::get("sym-spy").expect("built-in guest"),
    });
    c.payload.cmdline = cmdline.into();
    c.machine.vcpus = vcpus;
    c.symbiotic.enabled = true;
    c.devices.serial = SerialOutput::File(
        std::env::temp_dir().join(format!("lucid-symspy-{}.txt", std::process::id())),
    );
    c
}

/// Lucid reads the guest's records while the guest rewrites them: every record read is whole
/// (the guest writes counter = i and task = !i together), torn reads are retried, none hangs.
#[test]
fn lucid_reads_consistent_records_while_the_guest_writes() {
    // The guest writes until stopped (for all practical purposes); the test reads until it has
    // seen what it checks, however slowly the host runs either side.
    let mut vm = Vm::build(config("updates=1000 hold_ms=600000 pace=20", 1)).unwrap();
    vm.start().unwrap();
    let sym = vm.sym().expect("symbiotic VM").clone();
    let start = std::time::Instant::now();
    while sym.spy_snapshot().vcpus.is_empty() {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "guest never registered"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    let (mut reads, mut inconsistent, mut torn, mut unread, mut moved) = (0u64, 0, 0, 0, 0);
    let mut last = 0;
    let mut last_publishes = 0;
    // At least 2 s of reading (as many reads as the host allows, against a guest that keeps
    // writing), and until lucid-symspy republished 5 times (every 100 ms), the counter moved
    // under the reads and there were a thousand of them.
    let reading = std::time::Instant::now();
    while reading.elapsed() < Duration::from_secs(2)
        || last_publishes < 5
        || moved <= 10
        || reads <= 1000
    {
        assert!(
            reading.elapsed() < Duration::from_secs(60),
            "{reads} reads, {moved} moved, {last_publishes} publishes in 60 s"
        );
        let s = sym.spy_snapshot();
        torn += s.torn_reads;
        unread += s.unread;
        let v = s.vcpus.first().expect("the guest's page stays registered");
        let Some(g) = &v.guest else { continue };
        if g.counter == 0 {
            continue; // registered, not written yet
        }
        reads += 1;
        if g.task != !(g.counter as u32) {
            inconsistent += 1;
        }
        if g.counter > last {
            moved += 1;
        }
        assert!(g.counter >= last, "the counter never goes back");
        last = g.counter;
        last_publishes = v.lucid.publishes;
        assert!(s.global.as_ref().unwrap().guest.is_some() || s.unread > 0);
    }
    let stats = vm.stats().snapshot();
    vm.stop(StopReason::Signal(15));
    let report = vm.wait();
    assert!(reads > 1000, "{reads} snapshots");
    assert_eq!(inconsistent, 0, "{inconsistent} of {reads} records torn");
    assert!(
        moved > 10,
        "the guest kept writing while Lucid read ({moved})"
    );
    assert_eq!(stats["sym.spy.torn_reads"], torn, "every torn read counted");
    assert!(unread * 100 <= reads, "{unread} unread of {reads}");
    assert!(
        last_publishes >= 5,
        "lucid-symspy republished: {last_publishes}"
    );
    eprintln!("{reads} reads, {torn} torn (retried), {unread} unread, {moved} moved");
    // The VM stopped: its registrations are gone.
    assert!(sym.spy_snapshot().vcpus.is_empty() && sym.spy_snapshot().global.is_none());
    assert!(report.counters["sym.spy.reads"] >= reads);
}

/// Lucid's lines describe the VM: the lowest rung among its disks, its IOMMU mode; the
/// publisher republishes while the guest runs, and not at all with `--low-noise` (then only at
/// registration).
#[test]
fn lucids_lines_follow_the_vm_and_low_noise_publishes_only_at_registration() {
    let img = common::disk("symspy", 1);
    let (blk1, blk0) = (
        format!("path={},rung=L1", img.display()),
        format!("path={},rung=L0", img.display()),
    );
    let args = [
        "run",
        "--guest",
        "sym-spy",
        "--symbiotic",
        "--blk",
        &blk1,
        "--blk",
        &blk0,
        "--iommu",
        "vtd,mode=samecore",
        "--cmdline",
        "updates=1000 hold_ms=500",
    ];
    let o = lucid(&args, LIMIT);
    std::fs::remove_file(&img).unwrap();
    assert_eq!(o.status, PASS, "{}\n{}", o.stdout, o.stderr);
    let line = "sym-spy lucid";
    assert_eq!(field(&o.stdout, line, "rung"), Some("0"), "{}", o.stdout);
    assert_eq!(field(&o.stdout, line, "iommu"), Some("1"), "samecore");
    let publishes: u64 = field(&o.stdout, line, "publishes")
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        publishes >= 3,
        "republished every 100 ms over 500 ms: {publishes}"
    );
    assert!(o.counter("sym.spy.publishes") >= 2 * publishes - 1);

    let quiet = ["--low-noise", "--cmdline", "updates=1000 hold_ms=500"];
    let mut args = vec!["run", "--guest", "sym-spy", "--symbiotic"];
    args.extend(quiet);
    let q = lucid(&args, LIMIT);
    assert_eq!(q.status, PASS, "{}\n{}", q.stdout, q.stderr);
    assert_eq!(field(&q.stdout, line, "publishes"), Some("1"));
    assert_eq!(field(&q.stdout, line, "vcpu_publishes"), Some("1"));
    assert_eq!(
        q.counter("sym.spy.publishes"),
        2,
        "one per page, at registration"
    );
}

/// KVM holds the symbiotic CPUID leaves for every vCPU with `--symbiotic` and not without
/// (what a guest whose CPUID is intercepted would read; on PVM the guest's `cpuid` runs
/// natively and does not see them).
#[test]
fn kvm_holds_the_cpuid_leaves_only_with_symbiotic() {
    for symbiotic in [true, false] {
        let mut c = config("updates=1000 hold_ms=5000", 2);
        c.symbiotic.enabled = symbiotic;
        let mut vm = Vm::build(c).unwrap();
        // Queued before the vCPUs start, so each is read before its first entry: without
        // `--symbiotic` the guest finds no interface and ends at once, and a request made
        // after `start` could find its vCPU gone.
        let mut replies = Vec::new();
        for h in vm.vcpus() {
            let (tx, rx) = std::sync::mpsc::channel();
            h.submit(move |ctx| {
                let cpuid = ctx.vcpu.get_cpuid().expect("KVM_GET_CPUID2");
                let find = |f: u32| {
                    cpuid
                        .as_slice()
                        .iter()
                        .find(|e| e.function == f)
                        .map(|e| (e.eax, e.ebx, e.ecx, e.edx))
                };
                let _ = tx.send((
                    find(lucid_sym::abi::CPUID_LEAF),
                    find(lucid_sym::abi::CPUID_LEAF_INFO),
                ));
            })
            .unwrap();
            replies.push(rx);
        }
        vm.start().unwrap();
        for rx in replies {
            let leaves = rx.recv_timeout(Duration::from_secs(60)).unwrap();
            match symbiotic {
                true => {
                    let (sig, info) = (leaves.0.unwrap(), leaves.1.unwrap());
                    let mut s = Vec::new();
                    for r in [sig.1, sig.2, sig.3] {
                        s.extend_from_slice(&r.to_le_bytes());
                    }
                    assert_eq!(&s, lucid_sym::abi::CPUID_SIGNATURE);
                    assert_eq!((info.0, info.1, info.2), (1, 0xf, 0x599));
                }
                false => assert_eq!(leaves, (None, None)),
            }
        }
        vm.stop(StopReason::Signal(15));
        vm.wait();
    }
}
