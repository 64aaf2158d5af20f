//! virtio-balloon end to end on real KVM, with the default seccomp filters: the `balloon` probe
//! guest inflates to the size given on the command line and the host's resident memory drops by
//! what it gave back; it sends garbage PFNs and descriptors first (counted, the VM goes on),
//! free-page-reports pages it frees, deflates on OOM; the balloon manager deflates when the host
//! has room and inflates under pressure, and the guest follows.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{counter, field, lucid, tmp};
use lucid_swap::balloon_manager::{Pressure, PressureSource};
use lucid_vmm::{KernelSource, SerialOutput, StopReason, Vm, VmConfig};

const LIMIT: Duration = Duration::from_secs(120);
const MIB: u64 = 1 << 20;

/// The resident set of process `pid` (`Rss:` of smaps_rollup), in bytes.
fn rss(pid: u32) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).unwrap();
    let line = s.lines().find(|l| l.starts_with("Rss:")).unwrap();
    let kib: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    kib * 1024
}

/// The number of mappings (VMAs) of process `pid`.
fn vmas(pid: u32) -> usize {
    std::fs::read_to_string(format!("/proc/{pid}/maps"))
        .unwrap()
        .lines()
        .count()
}

#[test]
fn the_guest_inflates_to_the_cli_size_and_the_host_gets_the_memory_back() {
    let stats_path = tmp("balloon-inflate-stats.json");
    let mut child = Command::new(env!("CARGO_BIN_EXE_lucid"))
        .args(["run", "--guest", "balloon", "--memory", "256", "--balloon"])
        .arg("size=128,stats=on,free_page_reporting=on,deflate_on_oom=on")
        .args([
            "--cmdline",
            "hold_ms=1000 keep_mib=16 report_mib=4 oom_mib=8",
        ])
        .arg("--stats-json")
        .arg(&stats_path)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    let out = child.stdout.take().unwrap();
    let deadline = Instant::now() + LIMIT;
    let (mut touched, mut inflated) = (None, None);
    let (mut vmas_touched, mut vmas_inflated) = (0, 0);
    let mut lines = Vec::new();
    for line in BufReader::new(out).lines() {
        let line = line.unwrap();
        // The guest holds a second after each of these lines: the host looks meanwhile.
        if line.starts_with("balloon: touched") {
            touched = Some(rss(pid));
            vmas_touched = vmas(pid);
        }
        if line.starts_with("balloon: inflated") {
            inflated = Some(rss(pid));
            vmas_inflated = vmas(pid);
        }
        lines.push(line);
        if Instant::now() > deadline {
            let _ = child.kill();
            break;
        }
    }
    let status = child.wait().unwrap();
    let stdout = lines.join("\n");
    let stats: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&stats_path).unwrap()).unwrap();
    let _ = std::fs::remove_file(&stats_path);
    assert_eq!(status.code(), Some(1), "guest exit 0:\n{stdout}");
    assert!(stdout.contains("balloon: PASS"), "{stdout}");
    assert!(stdout.contains("balloon: garbage sent ok"), "{stdout}");
    let (touched, inflated) = (touched.unwrap(), inflated.unwrap());
    // 128 MiB given back: the host's resident memory drops by (nearly) that much.
    assert!(
        touched >= inflated + 120 * MIB,
        "RSS {} MiB after touching, {} MiB after inflating 128 MiB",
        touched >> 20,
        inflated >> 20
    );
    // Discarded pages are mapped over with fresh anonymous memory that merges with its
    // neighbours: the number of mappings hardly moves.
    assert!(
        vmas_inflated <= vmas_touched + 8,
        "{vmas_touched} mappings before inflating, {vmas_inflated} after"
    );
    let c = |p: &str| counter(&stats, p);
    assert_eq!(c("balloon.inflated_pages"), 128 * 256);
    assert_eq!(c("balloon.target_pages"), 128 * 256);
    // Deflate on OOM: 8 MiB more than was free, taken back from the balloon.
    assert_eq!(c("balloon.deflated_pages"), 8 * 256);
    assert_eq!(c("balloon.actual_pages"), 120 * 256);
    assert_eq!(c("balloon.reported_pages"), 4 * 256);
    // The garbage: 4 bad PFNs each on inflate and deflate, 5 bad descriptors, 3 bad reports.
    assert_eq!(c("balloon.bad_pfns"), 8);
    assert_eq!(c("balloon.bad_descriptors"), 5);
    assert_eq!(c("balloon.bad_reports"), 3);
    assert_eq!(c("balloon.discard_errors"), 0);
    assert_eq!(c("balloon.virtio.needs_reset"), 0);
    assert!(c("balloon.stats_updates") >= 1);
    assert_eq!(c("balloon.stats.total_memory"), 256 * MIB);
}

/// The CLI's default pressure (this process's resident set against it plus the host's
/// MemAvailable, `ProcessPressure`): the manager deflates while MemAvailable exceeds ~11% of the
/// VM's RSS (a few tens of MiB here) and would inflate only below ~5% of it, a host about to
/// run out of memory, so `inflations == 0` does not race anything a test run does.
#[test]
fn the_manager_deflates_when_the_host_has_room_and_the_guest_follows() {
    let o = lucid(
        &[
            "run",
            "--guest",
            "balloon",
            "--memory",
            "256",
            "--balloon",
            "size=64,manager=on,stats=on",
            "--cmdline",
            "follow_ms=30000 until_zero=1 oom=0 report=0",
        ],
        LIMIT,
    );
    assert_eq!(o.status, Some(1), "{}\n{}", o.stdout, o.stderr);
    // The guest inflates towards the first target (16384 pages); the manager's first tick may
    // already have lowered it (a host with room), so the guest settles on at most that much.
    let inflated: u64 = field(&o.stdout, "balloon: inflated", "actual")
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no inflated line:\n{}", o.stdout));
    assert!((1..=16384).contains(&inflated), "{}", o.stdout);
    assert!(
        o.stdout.contains("balloon: followed actual=0 target=0"),
        "{}",
        o.stdout
    );
    // Everything the guest gave, the manager had it take back.
    let inflated_s = inflated.to_string();
    assert_eq!(
        field(&o.stdout, "balloon: PASS", "deflated"),
        Some(inflated_s.as_str())
    );
    assert_eq!(o.counter("balloon.inflated_pages"), inflated);
    assert_eq!(o.counter("balloon.deflated_pages"), inflated);
    assert!(o.counter("balloon.manager.deflations") >= 1);
    assert_eq!(o.counter("balloon.manager.inflations"), 0);
    assert!(o.counter("balloon.config_changes") >= 1);
    // The manager asks for statistics every period; the guest refills the buffer.
    assert!(o.counter("balloon.stats_updates") >= 2);
}

/// A host whose pressure the test sets: the VM uses `base` less what the balloon gave back
/// (as a real host would see it), so the manager converges instead of inflating once more on
/// every tick. Counts the manager's reads (one per tick).
struct Scripted {
    base: AtomicU64,
    limit: AtomicU64,
    balloon: std::sync::OnceLock<lucid_virtio::balloon::BalloonControl>,
    reads: AtomicU64,
}

impl PressureSource for Scripted {
    fn pressure(&self) -> Pressure {
        self.reads.fetch_add(1, Ordering::SeqCst);
        let returned = self.balloon.get().map_or(0, |b| b.actual_pages() * 4096);
        Pressure {
            usage: self.base.load(Ordering::SeqCst).saturating_sub(returned),
            limit: self.limit.load(Ordering::SeqCst),
        }
    }
}

fn wait(what: &str, mut f: impl FnMut() -> bool) {
    let end = Instant::now() + Duration::from_secs(60);
    while !f() {
        assert!(Instant::now() < end, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn under_pressure_the_manager_inflates_and_with_room_it_deflates() {
    let serial = tmp("balloon-pressure.txt");
    let mut c = VmConfig::new(KernelSource::Builtin {
        name: "balloon".into(),
        bytes: lucid_guests::get("balloon").unwrap(),
    });
    c.machine.mem_mib = 256;
    c.payload.cmdline = "follow_ms=60000 until_zero=1 oom=0 report=0 garbage=0".into();
    c.devices.serial = SerialOutput::File(serial.clone());
    c.devices.balloon = Some(lucid_vmm::parse_balloon("size=0,manager=on,stats=on").unwrap());
    assert!(c.machine.seccomp);
    let host = Arc::new(Scripted {
        base: AtomicU64::new(300 * MIB),
        limit: AtomicU64::new(256 * MIB),
        balloon: std::sync::OnceLock::new(),
        reads: AtomicU64::new(0),
    });
    let mut vm = Vm::build(c).unwrap();
    vm.set_pressure_source(host.clone());
    let ctl = vm.balloon().unwrap().clone();
    assert!(host.balloon.set(ctl.clone()).is_ok());
    vm.start().unwrap();
    // 300 MiB used of 256: the manager inflates by the excess over the limit less headroom
    // (5% of it: 12.8 MiB), so the guest settles at 300 - 243.2 = 56.8 MiB.
    wait("the guest to inflate", || ctl.actual_pages() > 0);
    // Settled: the guest holds the target and the target outlived three of the manager's ticks.
    let mut settled = None;
    wait("the balloon to settle", || {
        let (target, reads) = (ctl.target_pages(), host.reads.load(Ordering::SeqCst));
        match settled {
            Some((t, r)) if t == target && ctl.actual_pages() == target => reads >= r + 3,
            _ => {
                settled = (ctl.actual_pages() == target).then_some((target, reads));
                false
            }
        }
    });
    let inflated = ctl.actual_pages();
    assert!(
        (50 * 256..=64 * 256).contains(&inflated),
        "{inflated} pages"
    );
    // The guest's statistics reach the manager's side.
    wait("statistics", || ctl.stats().is_some());
    // Room to spare: the manager deflates to nothing and the guest follows, then stops.
    host.base.store(100 * MIB, Ordering::SeqCst);
    wait("the guest to deflate", || {
        ctl.target_pages() == 0 && ctl.actual_pages() == 0
    });
    let report = vm.wait();
    let out = std::fs::read_to_string(&serial).unwrap_or_default();
    let _ = std::fs::remove_file(&serial);
    assert_eq!(report.stop, StopReason::DebugExit(0), "{out}");
    assert!(out.contains("balloon: PASS"), "{out}");
    assert_eq!(report.counters["balloon.inflated_pages"], inflated);
    assert_eq!(report.counters["balloon.deflated_pages"], inflated);
    assert!(report.counters["balloon.manager.inflations"] >= 1);
    assert!(report.counters["balloon.manager.deflations"] >= 1);
}
