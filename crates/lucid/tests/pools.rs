//! The scheduling pools end to end on real KVM (default seccomp on): a VM's vCPU and back-end
//! threads land in its pool (affinity and cpuset cgroup read back while it runs), the monitor's
//! figures reach `--stats-json`, the classifier moves a CPU-bound VM to the CPU pool while it
//! runs and the guest finishes its work, and `--low-noise` keeps the vCPU's CPU to itself.
//!
//! Pools live in a unique state directory and cgroup root (`LUCID_POOLS_DIR`,
//! `LUCID_POOLS_CGROUP`), removed at the end. The pools here: `io` = CPU 0 (policy io) and
//! `cpu` = CPU 1 (policy cpu), on this 2-CPU host.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{disk, one_at_a_time, tmp};
use lucid_pools::place::{read_back, ReadBack};
use lucid_pools::policy::{default_io_slice_ns, SchedPolicy};

const LIMIT: Duration = Duration::from_secs(180);

/// Two CPUs or more: the tests put pools on CPUs 0 and 1 (if not, [`skip_or_fail`]).
fn two_cpus() -> bool {
    let two = std::thread::available_parallelism().map_or(0, |n| n.get()) >= 2;
    if !two {
        lucid_guests::skip_or_fail("the pools tests need two CPUs");
    }
    two
}

/// The host's pools for one test, made with `lucid pools create --def ...` in a unique state
/// directory and cgroup root (`LUCID_POOLS_DIR`, `LUCID_POOLS_CGROUP`), and torn down with
/// `lucid pools destroy` at the end, which must leave nothing behind.
struct TestPools {
    dir: PathBuf,
    root: String,
    /// The pools' cgroup directory (None for the affinity backend).
    cgroup: Option<PathBuf>,
}

impl TestPools {
    /// `io` = CPU 0 (policy io), `cpu` = CPU 1 (policy cpu).
    fn new(tag: &str) -> TestPools {
        Self::with(
            tag,
            &["name=io,cpus=0,policy=io", "name=cpu,cpus=1,policy=cpu"],
        )
    }

    fn with(tag: &str, defs: &[&str]) -> TestPools {
        let dir = tmp(&format!("pools-{tag}"));
        let _ = std::fs::remove_dir_all(&dir);
        let mut pools = TestPools {
            dir,
            root: format!("lucid-test-{}-{tag}", std::process::id()),
            cgroup: None,
        };
        let mut c = pools.cli();
        c.args(["pools", "create"]);
        for d in defs {
            c.args(["--def", d]);
        }
        let out = c.output().expect("run lucid pools create");
        assert!(
            out.status.success(),
            "lucid pools create: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let host: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(pools.dir.join("pools.json")).unwrap())
                .unwrap();
        pools.cgroup = host["cgroup"].as_str().map(PathBuf::from);
        pools
    }

    fn cli(&self) -> Command {
        let mut c = Command::new(env!("CARGO_BIN_EXE_lucid"));
        c.env("LUCID_POOLS_DIR", &self.dir)
            .env("LUCID_POOLS_CGROUP", &self.root);
        c
    }

    fn command(&self) -> Command {
        let mut c = self.cli();
        c.stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        c
    }

    /// `lucid pools show --json`.
    fn show(&self) -> serde_json::Value {
        let out = self
            .cli()
            .args(["pools", "show", "--json"])
            .output()
            .expect("run lucid pools show");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).expect("pools show --json")
    }
}

impl Drop for TestPools {
    fn drop(&mut self) {
        // The VMs have ended: destroy needs no --force (a failed test may have left one).
        let force = std::thread::panicking();
        let mut c = self.cli();
        c.args(["pools", "destroy"]);
        if force {
            c.arg("--force");
        }
        let out = c.output().expect("run lucid pools destroy");
        if !force {
            assert!(
                out.status.success(),
                "lucid pools destroy: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            assert!(!self.dir.exists(), "{} left behind", self.dir.display());
            if let Some(cg) = &self.cgroup {
                assert!(!cg.exists(), "cgroup {} left behind", cg.display());
            }
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A temporary file removed when the test ends, passed or not.
struct Removed(PathBuf);

impl Drop for Removed {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// One of the VM's threads as /proc shows it.
#[derive(Debug)]
struct Task {
    tid: i32,
    comm: String,
    cpus: String,
    cpuset: String,
}

fn tasks(pid: u32) -> Vec<Task> {
    let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return Vec::new();
    };
    dir.flatten()
        .map(|t| {
            let read = |f: &str| std::fs::read_to_string(t.path().join(f)).unwrap_or_default();
            let status = read("status");
            let cpus = status
                .lines()
                .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
                .unwrap_or("")
                .trim()
                .to_string();
            let cpuset = read("cgroup")
                .lines()
                .find_map(|l| {
                    let mut parts = l.splitn(3, ':');
                    let (_, ctrl, path) = (parts.next()?, parts.next()?, parts.next()?);
                    ctrl.split(',')
                        .any(|c| c == "cpuset")
                        .then(|| path.to_string())
                })
                .unwrap_or_default();
            Task {
                tid: t.file_name().to_string_lossy().parse().unwrap_or(0),
                comm: read("comm").trim().to_string(),
                cpus,
                cpuset,
            }
        })
        .collect()
}

/// Polls `pred` on the VM's threads until it holds (true) or `limit` passes or the VM exits.
fn until(child: &mut Child, limit: Duration, pred: impl Fn(&[Task]) -> bool) -> bool {
    let start = Instant::now();
    while start.elapsed() < limit {
        if child.try_wait().ok().flatten().is_some() {
            return false;
        }
        if pred(&tasks(child.id())) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    false
}

fn task<'a>(ts: &'a [Task], comm: &str) -> Option<&'a Task> {
    ts.iter().find(|t| t.comm == comm)
}

/// What the kernel says about the VM's thread `comm`: affinity, cgroup, policy, nice, slice.
fn kernel(ts: &[Task], comm: &str) -> Option<ReadBack> {
    task(ts, comm).and_then(|t| read_back(t.tid).ok())
}

/// SCHED_BATCH nice 10: the `cpu` policy.
fn is_cpu_policy(r: &ReadBack) -> bool {
    (r.policy, r.nice) == (SchedPolicy::Batch, 10)
}

/// The `io` policy: SCHED_OTHER with the short slice (nice 0, or up to 3 steps of the wake
/// boost below it), or nice -5 (and boosts) where the kernel keeps no per-thread slice.
fn is_io_policy(r: &ReadBack) -> bool {
    r.policy == SchedPolicy::Other
        && ((r.slice_ns == default_io_slice_ns() && (-3..=0).contains(&r.nice))
            || (-8..=-5).contains(&r.nice))
}

/// SCHED_OTHER nice 0: the `default` policy (and back-ends in a `cpu` pool).
fn is_default_policy(r: &ReadBack) -> bool {
    (r.policy, r.nice) == (SchedPolicy::Other, 0)
}

/// An admitted back-end of a `noop` pool: SCHED_FIFO priority 10 on one CPU.
fn is_noop_admitted(r: &ReadBack) -> bool {
    (r.policy, r.priority, r.affinity.len()) == (SchedPolicy::Fifo, 10, 1)
}

struct Finished {
    status: Option<i32>,
    stdout: String,
    stderr: String,
    stats: serde_json::Value,
}

impl Finished {
    fn counter(&self, path: &str) -> u64 {
        common::counter(&self.stats, path)
    }

    fn counter_or_zero(&self, path: &str) -> u64 {
        common::counter_or_zero(&self.stats, path)
    }
}

fn finish(mut child: Child, stats: &Path) -> Finished {
    let start = Instant::now();
    while child.try_wait().ok().flatten().is_none() {
        if start.elapsed() > LIMIT {
            let _ = child.kill();
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = child.wait_with_output().expect("wait");
    let json = std::fs::read_to_string(stats)
        .ok()
        .and_then(|s| serde_json::from_str(&s).ok())
        .unwrap_or(serde_json::Value::Null);
    let _ = std::fs::remove_file(stats);
    Finished {
        status: out.status.code(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        stats: json,
    }
}

fn blk_args<'a>(img: &'a str, stats: &'a str, count: &'a str) -> Vec<String> {
    [
        "run",
        "--guest",
        "virtio-blk",
        "--blk",
        &format!("path={img}"),
        "--cmdline",
        &format!("op=rw pattern=rand bs=4096 qd=8 count={count} verify=1"),
        "--stats-json",
        stats,
        "--monitor-window-ms",
        "200",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

#[test]
fn a_vm_in_a_named_pool_has_its_vcpu_and_backend_threads_there() {
    if !two_cpus() {
        return;
    }
    let _turn = one_at_a_time();
    let pools = TestPools::new("named");
    let img = Removed(disk("pools-named", 64));
    let stats = tmp("pools-named-stats.json");
    let mut args = blk_args(img.0.to_str().unwrap(), stats.to_str().unwrap(), "60000");
    args.extend(["--pool".into(), "cpu".into()]);
    let mut child = pools.command().args(&args).spawn().expect("spawn lucid");
    let pid = child.id();

    // Both the vCPU and the back-end (started when the guest activates the disk) land on CPU 1
    // and, with cgroups, in the pool's cpuset.
    let want_cpuset = format!("/{}/cpu", pools.root);
    let cgroups = pools.cgroup.is_some();
    // ... the vCPU with the cpu policy (SCHED_BATCH nice 10), the back-end with the default
    // one (an I/O thread under SCHED_BATCH would wait behind the busy vCPU).
    let placed = |ts: &[Task]| {
        ["lucid-vcpu0", "lucid-blk0-io"].iter().all(|n| {
            task(ts, n).is_some_and(|t| t.cpus == "1" && (!cgroups || t.cpuset == want_cpuset))
        }) && kernel(ts, "lucid-vcpu0").is_some_and(|r| is_cpu_policy(&r))
            && kernel(ts, "lucid-blk0-io").is_some_and(|r| is_default_policy(&r))
    };
    let in_pool = until(&mut child, Duration::from_secs(60), placed);
    let seen = tasks(pid);
    // The state directory lists the VM, its pool and its threads (from the monitor's first
    // window on).
    let json_path = pools.dir.join(format!("vms/{pid}.json"));
    let listed = |j: &serde_json::Value| {
        j["threads"]
            .as_array()
            .is_some_and(|ts| ts.iter().any(|t| t["name"] == "lucid-blk0-io"))
    };
    let mut vm_json = serde_json::Value::Null;
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(20) && !listed(&vm_json) {
        std::thread::sleep(Duration::from_millis(50));
        vm_json = std::fs::read_to_string(&json_path)
            .ok()
            .and_then(|s| serde_json::from_str(&s).ok())
            .unwrap_or(serde_json::Value::Null);
    }
    let out = finish(child, &stats);
    let policies: Vec<_> = ["lucid-vcpu0", "lucid-blk0-io"]
        .iter()
        .map(|n| kernel(&seen, n))
        .collect();
    assert!(
        in_pool,
        "threads not in pool cpu: {seen:?} {policies:?}\n{}",
        out.stderr
    );
    // Threads that are not the VM's vCPUs or back-ends stay where Linux put them.
    let main = seen
        .iter()
        .find(|t| t.comm == "lucid")
        .expect("main thread");
    // What it inherited: this thread's CPUs (all of the host's, whatever their number).
    let ours = std::fs::read_to_string("/proc/thread-self/status").unwrap();
    let ours = ours
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
        .map(str::trim)
        .unwrap();
    assert_eq!(main.cpus, ours, "{seen:?}");
    assert!(listed(&vm_json), "vms/{pid}.json: {vm_json}");
    assert_eq!(vm_json["pool"], "cpu");
    assert_eq!(vm_json["pinned"], true);
    for name in ["lucid-vcpu0", "lucid-blk0-io"] {
        assert!(
            vm_json["threads"]
                .as_array()
                .unwrap()
                .iter()
                .any(|t| t["name"] == name && t["pool"] == "cpu"),
            "{vm_json}"
        );
    }
    // Gone (empty: a confined VM cannot unlink) once the VM exits.
    assert!(std::fs::read_to_string(&json_path)
        .unwrap_or_default()
        .is_empty());

    assert_eq!(out.status, Some(1), "{}\n{}", out.stdout, out.stderr);
    assert!(
        out.stdout.contains("mismatches=0"),
        "{}\n{}",
        out.stdout,
        out.stderr
    );
    // The monitor's figures are in --stats-json: windows, bytes and kicks of the disk, and
    // per-thread CPU time and run-queue wait.
    assert!(out.counter("monitor.windows") >= 2, "{}", out.stats);
    assert!(
        out.counter("monitor.bytes") >= 60_000 * 4096 / 2,
        "{}",
        out.stats
    );
    assert!(out.counter("monitor.kicks") > 0);
    assert!(out.counter("monitor.vcpu_cpu_ns") > 0);
    assert!(out.counter("monitor.thread.lucid-blk0-io.cpu_ns") > 0);
    assert!(out.counter("monitor.kvm.exits") > 0);
    assert!(out.stats["counters"]["monitor"]
        .get("guest_to_backend_us_per_mb")
        .is_some());
    assert!(out.counter("pools.placements") >= 2);
    // Pinned by hand: never moved.
    assert_eq!(out.counter("monitor.moves"), 0);
    assert_eq!(out.counter("pools.current"), 1);
}

/// The P2 layout (docs/scheduling.md): a back-ends pool (`backends=on`) on CPU 0 takes the VM's
/// back-end thread while its vCPU runs in the VM's pool on CPU 1.
#[test]
fn back_ends_go_to_the_back_end_pool_and_vcpus_to_the_vms() {
    if !two_cpus() {
        return;
    }
    let _turn = one_at_a_time();
    let pools = TestPools::with(
        "backends",
        &[
            "name=be,cpus=0,policy=noop,backends=on",
            "name=vms,cpus=1,policy=default",
        ],
    );
    let img = Removed(disk("pools-backends", 64));
    let stats = tmp("pools-backends-stats.json");
    let mut args = blk_args(img.0.to_str().unwrap(), stats.to_str().unwrap(), "60000");
    args.extend(["--pool".into(), "auto".into()]);
    let mut child = pools.command().args(&args).spawn().expect("spawn lucid");
    let pid = child.id();
    let cgroups = pools.cgroup.is_some();
    let (be, vms) = (
        format!("/{}/be", pools.root),
        format!("/{}/vms", pools.root),
    );
    // The back-end is admitted to the no-op pool's one CPU (SCHED_FIFO 10); the vCPU runs
    // under the default policy.
    let placed = until(&mut child, Duration::from_secs(60), |ts| {
        task(ts, "lucid-vcpu0").is_some_and(|t| t.cpus == "1" && (!cgroups || t.cpuset == vms))
            && task(ts, "lucid-blk0-io")
                .is_some_and(|t| t.cpus == "0" && (!cgroups || t.cpuset == be))
            && kernel(ts, "lucid-blk0-io").is_some_and(|r| is_noop_admitted(&r))
            && kernel(ts, "lucid-vcpu0")
                .is_some_and(|r| (r.policy, r.nice) == (SchedPolicy::Other, 0))
    });
    let seen = tasks(pid);
    let out = finish(child, &stats);
    assert!(placed, "{seen:?}\n{}", out.stderr);
    assert_eq!(out.status, Some(1), "{}\n{}", out.stdout, out.stderr);
    assert!(out.stdout.contains("mismatches=0"), "{}", out.stdout);
    assert_eq!(out.counter("pools.noop_admitted"), 1, "{}", out.stats);
    // Auto starts in the default-policy pool; a busy-polling disk guest is neither CPU- nor
    // I/O-bound by the thresholds, so it stays.
    assert_eq!(out.counter("pools.current"), 1);
}

/// `vms/<pid>.json` of a VM once it lists thread `name` (from the monitor's first window on)
/// with an entry that satisfies `done` (the record is rewritten once per monitor window, after
/// the kernel state a test may have seen); what it last read when `limit` passed.
fn vm_record_until(
    pools: &TestPools,
    pid: u32,
    name: &str,
    limit: Duration,
    done: impl Fn(&serde_json::Value) -> bool,
) -> serde_json::Value {
    let path = pools.dir.join(format!("vms/{pid}.json"));
    let start = Instant::now();
    loop {
        let v: serde_json::Value = std::fs::read_to_string(&path)
            .ok()
            .and_then(|s| serde_json::from_str(&s).ok())
            .unwrap_or(serde_json::Value::Null);
        let ok = v["threads"]
            .as_array()
            .is_some_and(|ts| ts.iter().any(|t| t["name"] == name && done(t)));
        if ok || start.elapsed() > limit {
            return v;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A thread of a VM in `lucid pools show --json`'s list of VMs.
fn shown_thread<'a>(
    report: &'a serde_json::Value,
    pid: u32,
    name: &str,
) -> Option<&'a serde_json::Value> {
    report["vms"].as_array()?.iter().find(|v| v["pid"] == pid)?["threads"]
        .as_array()?
        .iter()
        .find(|t| t["name"] == name)
}

/// The no-op pool admits one back-end per CPU host-wide: with one CPU in it, the first VM's
/// back-end is admitted (SCHED_FIFO on that CPU), a second VM's waits where it is, and is
/// admitted when the first VM exits. `lucid pools show --json` lists both VMs, their threads
/// and where each stands.
#[test]
fn the_noop_pool_admits_one_back_end_per_cpu_host_wide_and_the_next_when_one_exits() {
    if !two_cpus() {
        return;
    }
    let _turn = one_at_a_time();
    let pools = TestPools::with(
        "noop",
        &[
            "name=be,cpus=1,policy=noop",
            "name=vms,cpus=0,policy=default",
        ],
    );
    let (img_a, img_b) = (
        Removed(disk("pools-noop-a", 64)),
        Removed(disk("pools-noop-b", 64)),
    );
    let (stats_a, stats_b) = (tmp("pools-noop-a.json"), tmp("pools-noop-b.json"));
    // Long runs: each is ended by SIGTERM once seen.
    let start_vm = |img: &Removed, stats: &Path| {
        let mut args = blk_args(
            img.0.to_str().unwrap(),
            stats.to_str().unwrap(),
            "100000000",
        );
        args.extend(["--pool".into(), "auto".into()]);
        pools.command().args(&args).spawn().expect("spawn lucid")
    };
    let admitted = |ts: &[Task]| {
        task(ts, "lucid-blk0-io").is_some_and(|t| t.cpus == "1")
            && kernel(ts, "lucid-blk0-io").is_some_and(|r| is_noop_admitted(&r))
    };
    let mut a = start_vm(&img_a, &stats_a);
    let pid_a = a.id();
    let a_admitted = until(&mut a, Duration::from_secs(60), admitted);
    let mut b = start_vm(&img_b, &stats_b);
    let pid_b = b.id();
    // B's back-end asked (its record says waiting once it was placed) and stays where it
    // started, not FIFO.
    let rec_b = vm_record_until(
        &pools,
        pid_b,
        "lucid-blk0-io",
        Duration::from_secs(30),
        |t| t["admission"].is_string(),
    );
    let b_thread = |rec: &serde_json::Value| {
        rec["threads"]
            .as_array()
            .and_then(|ts| ts.iter().find(|t| t["name"] == "lucid-blk0-io").cloned())
            .unwrap_or_default()
    };
    let b_waiting = b_thread(&rec_b)["admission"] == "waiting";
    let b_seen = tasks(pid_b);
    let b_kernel = kernel(&b_seen, "lucid-blk0-io");
    // `pools show` reads the records: wait for a window of each VM that shows the states.
    let start = Instant::now();
    let report = loop {
        let r = pools.show();
        let adm = |pid, name| shown_thread(&r, pid, name).map(|t| t["admission"].clone());
        let settled = adm(pid_a, "lucid-blk0-io") == Some("admitted".into())
            && adm(pid_b, "lucid-blk0-io") == Some("waiting".into());
        if settled || start.elapsed() > Duration::from_secs(30) {
            break r;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let a_after = tasks(pid_a);
    let a_still_admitted = admitted(&a_after);

    // A ends; its slot frees and B's monitor admits B's back-end.
    // SAFETY: kill with a pid we started and a signal number.
    unsafe { libc::kill(pid_a as i32, libc::SIGTERM) };
    let out_a = finish(a, &stats_a);
    let b_admitted = until(&mut b, Duration::from_secs(30), admitted);
    // The kernel state comes first; the record says so at the end of that monitor window.
    let rec_b_after = vm_record_until(
        &pools,
        pid_b,
        "lucid-blk0-io",
        Duration::from_secs(30),
        |t| t["admission"] == "admitted",
    );
    // SAFETY: as above.
    unsafe { libc::kill(pid_b as i32, libc::SIGTERM) };
    let out_b = finish(b, &stats_b);

    assert!(a_admitted, "A's back-end not admitted: {}", out_a.stderr);
    assert!(
        a_still_admitted,
        "A's back-end lost its slot: {a_after:?} {:?}\n{}",
        kernel(&a_after, "lucid-blk0-io"),
        out_a.stderr
    );
    assert!(b_waiting, "B's record: {rec_b}\n{}", out_b.stderr);
    let b_kernel = b_kernel.expect("B's back-end runs");
    assert_ne!(b_kernel.policy, SchedPolicy::Fifo, "{b_kernel:?}");
    assert_eq!(
        b_kernel.affinity,
        vec![0],
        "left where it started: {b_kernel:?}"
    );
    // `lucid pools show --json`: both VMs and their threads, A holding the slot, B waiting.
    let t = shown_thread(&report, pid_a, "lucid-blk0-io").expect("A's back-end shown");
    assert_eq!(
        (&t["pool"], &t["admission"], &t["kernel"]["policy"]),
        (&"be".into(), &"admitted".into(), &"SCHED_FIFO".into()),
        "{report}"
    );
    let t = shown_thread(&report, pid_a, "lucid-vcpu0").expect("A's vCPU shown");
    assert_eq!(
        (&t["pool"], &t["kernel"]["cpus"]),
        (&"vms".into(), &"0".into())
    );
    let t = shown_thread(&report, pid_b, "lucid-blk0-io").expect("B's back-end shown");
    assert_eq!(t["admission"], "waiting", "{report}");
    let be = report["pools"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == "be")
        .expect("pool be");
    assert_eq!(be["slots"][0]["holder"]["pid"], pid_a, "{be}");
    assert_eq!(be["waiting"][0]["pid"], pid_b, "{be}");
    assert!(be["vms"].as_array().is_some_and(|v| v.len() == 2), "{be}");

    assert!(
        b_admitted,
        "B's back-end not admitted after A exited: {}",
        out_b.stderr
    );
    assert_eq!(b_thread(&rec_b_after)["admission"], "admitted");
    // Both ended by SIGTERM (128 + 15) with their data intact.
    for out in [&out_a, &out_b] {
        assert_eq!(out.status, Some(143), "{}\n{}", out.stdout, out.stderr);
        assert!(!out.stderr.contains("seccomp"), "{}", out.stderr);
    }
    assert_eq!(out_a.counter("pools.noop_admitted"), 1, "{}", out_a.stats);
    assert_eq!(out_b.counter("pools.noop_waiting"), 1, "{}", out_b.stats);
    assert_eq!(out_b.counter("pools.noop_admitted"), 1, "{}", out_b.stats);
}

#[test]
fn the_classifier_moves_a_cpu_bound_vm_to_the_cpu_pool_and_it_keeps_running() {
    if !two_cpus() {
        return;
    }
    let _turn = one_at_a_time();
    let pools = TestPools::new("auto");
    let stats = tmp("pools-auto-stats.json");
    // About 4 s of compute here; short windows so the move comes after about a second.
    let mut child = pools
        .command()
        .args([
            "run",
            "--guest",
            "compute",
            "--cmdline",
            "iters=2000000000",
            "--pool",
            "auto",
            "--monitor-window-ms",
            "200",
            "--classify-windows",
            "3",
            "--classify-dwell-ms",
            "1000",
            "--stats-json",
        ])
        .arg(&stats)
        .spawn()
        .expect("spawn lucid");
    // Auto starts in the first pool, io (CPU 0, the short slice)...
    let in_io = until(&mut child, Duration::from_secs(30), |ts| {
        task(ts, "lucid-vcpu0").is_some_and(|t| t.cpus == "0")
            && kernel(ts, "lucid-vcpu0").is_some_and(|r| is_io_policy(&r))
    });
    // ...and the classifier moves the CPU loop to the cpu pool (CPU 1, SCHED_BATCH) while it
    // runs.
    let moved = until(&mut child, Duration::from_secs(60), |ts| {
        task(ts, "lucid-vcpu0").is_some_and(|t| t.cpus == "1")
            && kernel(ts, "lucid-vcpu0").is_some_and(|r| is_cpu_policy(&r))
    });
    let running_after_move = child.try_wait().ok().flatten().is_none();
    let out = finish(child, &stats);
    assert!(
        in_io && moved,
        "in io {in_io}, moved {moved}: {}",
        out.stderr
    );
    assert!(
        running_after_move,
        "the VM ended at the move: {}",
        out.stderr
    );
    // The guest finished its work after the move: all its iterations and its checksum.
    assert_eq!(out.status, Some(1), "{}\n{}", out.stdout, out.stderr);
    assert!(
        out.stdout.contains("compute iters=2000000000"),
        "{}",
        out.stdout
    );
    assert!(out.stdout.contains("checksum=0x"), "{}", out.stdout);
    assert_eq!(out.counter("monitor.moves"), 1, "{}", out.stats);
    assert_eq!(out.counter("pools.current"), 1);
    // It kept running for a while in its new pool.
    let wall_ms = (out.stats["wall_s"].as_f64().unwrap_or(0.0) * 1000.0) as u64;
    assert!(
        wall_ms > out.counter("monitor.moved_at_ms") + 200,
        "wall {wall_ms} ms, moved at {} ms",
        out.counter("monitor.moved_at_ms")
    );
    // The cpu policy turns halt polling off where KVM lets a VM choose.
    if out.stats["counters"]["pools"].get("halt_poll_ns").is_some() {
        assert_eq!(out.counter("pools.halt_poll_ns"), 0);
    }
}

/// An I/O stream (the disk guest, which polls for completions: its demand stays near 1, its
/// I/O rate makes it I/O-bound) starting in the cpu pool is moved to the io pool while it runs,
/// back-end and all, and its data stays intact.
#[test]
fn the_classifier_moves_an_io_stream_to_the_io_pool() {
    if !two_cpus() {
        return;
    }
    let _turn = one_at_a_time();
    let pools = TestPools::with(
        "stream",
        &["name=cpu,cpus=1,policy=cpu", "name=io,cpus=0,policy=io"],
    );
    let img = Removed(disk("pools-stream", 64));
    let stats = tmp("pools-stream-stats.json");
    let mut args = blk_args(img.0.to_str().unwrap(), stats.to_str().unwrap(), "200000");
    args.extend(
        [
            "--pool",
            "auto",
            "--classify-windows",
            "3",
            "--classify-dwell-ms",
            "1000",
        ]
        .map(String::from),
    );
    let mut child = pools.command().args(&args).spawn().expect("spawn lucid");
    // Each pool's policy comes with it: SCHED_BATCH in cpu (the back-end keeps the default
    // policy there), the short slice in io for both.
    let on = |cpu: &'static str, vcpu: fn(&ReadBack) -> bool, backend: fn(&ReadBack) -> bool| {
        move |ts: &[Task]| {
            ["lucid-vcpu0", "lucid-blk0-io"]
                .iter()
                .all(|n| task(ts, n).is_some_and(|t| t.cpus == cpu))
                && kernel(ts, "lucid-vcpu0").is_some_and(|r| vcpu(&r))
                && kernel(ts, "lucid-blk0-io").is_some_and(|r| backend(&r))
        }
    };
    let in_cpu = until(
        &mut child,
        Duration::from_secs(30),
        on("1", is_cpu_policy, is_default_policy),
    );
    let moved = until(
        &mut child,
        Duration::from_secs(60),
        on("0", is_io_policy, is_io_policy),
    );
    let out = finish(child, &stats);
    assert!(
        in_cpu && moved,
        "in cpu {in_cpu}, moved {moved}: {}",
        out.stderr
    );
    assert_eq!(out.status, Some(1), "{}\n{}", out.stdout, out.stderr);
    assert!(out.stdout.contains("mismatches=0"), "{}", out.stdout);
    // In the io pool the monitor's boost ladder stepped the woken threads' nice.
    assert!(out.counter("pools.boost_steps") > 0, "{}", out.stats);
    assert_eq!(out.counter("monitor.moves"), 1, "{}", out.stats);
    assert_eq!(out.counter("pools.current"), 1);
}

#[test]
fn low_noise_gives_the_vcpu_its_own_cpu_and_runs_no_monitor() {
    if !two_cpus() {
        return;
    }
    let _turn = one_at_a_time();
    // Pools defined on the host do not matter in low-noise mode.
    let pools = TestPools::new("quiet");
    let img = Removed(disk("pools-quiet", 64));
    let stats = tmp("pools-quiet-stats.json");
    let mut args = blk_args(img.0.to_str().unwrap(), stats.to_str().unwrap(), "60000");
    args.push("--low-noise".into());
    let mut child = pools.command().args(&args).spawn().expect("spawn lucid");
    let pid = child.id();
    let placed = until(&mut child, Duration::from_secs(60), |ts| {
        task(ts, "lucid-vcpu0").is_some_and(|t| t.cpus == "1")
            && task(ts, "lucid-blk0-io").is_some_and(|t| t.cpus == "0")
    });
    let seen = tasks(pid);
    let out = finish(child, &stats);
    assert!(placed, "{seen:?}\n{}", out.stderr);
    // Everything of Lucid's but the vCPU is on CPU 0; no monitor thread. KVM's own worker in
    // the process (`kvm-nx-lpage-recovery`, started by the vCPU's first KVM_RUN) inherits the
    // vCPU's CPU: Lucid has no point at which to move it without periodic work (it sleeps
    // unless nx_huge_pages is on).
    for t in seen.iter().filter(|t| !t.comm.starts_with("kvm-")) {
        let want = if t.comm == "lucid-vcpu0" { "1" } else { "0" };
        assert_eq!(t.cpus, want, "{t:?}");
        assert_ne!(t.comm, "lucid-monitor");
    }
    assert_eq!(out.status, Some(1), "{}\n{}", out.stdout, out.stderr);
    assert!(out.stdout.contains("mismatches=0"), "{}", out.stdout);
    assert_eq!(out.counter("pools.low_noise"), 1);
    // No monitor ran, so none of its counters exist.
    assert!(
        out.stats["counters"].get("monitor").is_none(),
        "{}",
        out.stats
    );
    assert!(!pools.dir.join(format!("vms/{pid}.json")).exists());
}

/// Garbage from the user or on disk is refused with how to fix it, never a panic (exit 101):
/// `lucid pools create` with bad definitions, `show --interval nan`, and a corrupt
/// `pools.json`, which `lucid run` and `show` refuse and `destroy --force` removes.
#[test]
fn garbage_definitions_and_a_corrupt_pools_json_are_refused_cleanly() {
    let dir = tmp("pools-garbage");
    let _ = std::fs::remove_dir_all(&dir);
    let lucid = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_lucid"))
            .env("LUCID_POOLS_DIR", &dir)
            .env(
                "LUCID_POOLS_CGROUP",
                format!("lucid-test-{}-garbage", std::process::id()),
            )
            .stdin(Stdio::null())
            .args(args)
            .output()
            .expect("run lucid");
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    for def in [
        "",
        "name=a",
        "name=a,cpus=0-99999999,policy=io",
        "name=a,cpus=x,policy=io",
        "name=../a,cpus=0,policy=io",
        "name=a,cpus=0,policy=rt",
        "name=a,cpus=0,policy=io,slice_us=99999999999",
        "=,=,,,",
    ] {
        let (code, err) = lucid(&["pools", "create", "--def", def]);
        assert!(
            code != Some(0) && code != Some(101),
            "{def:?}: {code:?} {err}"
        );
        assert!(!err.contains("panicked"), "{def:?}: {err}");
    }
    assert!(!dir.join("pools.json").exists(), "refused: nothing written");
    let (code, err) = lucid(&["pools", "show", "--watch", "--interval", "nan"]);
    assert!(
        code != Some(101) && err.contains("--interval"),
        "{code:?} {err}"
    );
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("pools.json"),
        r#"{"pools":[{"name":"..","cpus":[0],"policy":"io"}],"backend":"cpuset-v1","cgroup":"/","created":0}"#,
    )
    .unwrap();
    let (code, err) = lucid(&["run", "--guest", "hello", "--pool", "auto"]);
    assert_eq!(code, Some(lucid_vmm::EXIT_FAILURE), "{err}");
    assert!(
        err.contains("is corrupt") && err.contains("destroy --force"),
        "{err}"
    );
    let (code, err) = lucid(&["pools", "show"]);
    assert!(code != Some(0) && code != Some(101), "{err}");
    assert!(err.contains("destroy --force"), "{err}");
    let (code, err) = lucid(&["pools", "destroy", "--force"]);
    assert_eq!(code, Some(0), "{err}");
    assert!(!dir.exists(), "destroy --force removed the corrupt state");
}

#[test]
fn bad_pool_choices_are_refused_with_a_clear_error() {
    let pools = TestPools::with(
        "bad",
        &["name=io,cpus=0,policy=io", "name=be,cpus=1,policy=noop"],
    );
    let run = |extra: &[&str]| {
        let out = pools
            .command()
            .args(["run", "--guest", "hello"])
            .args(extra)
            .output()
            .expect("run lucid");
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (code, err) = run(&["--pool", "nosuch"]);
    assert_eq!(code, Some(lucid_vmm::EXIT_FAILURE));
    assert!(
        err.contains("no such pool") && err.contains("io, be"),
        "{err}"
    );
    // A no-op pool holds back-ends only.
    let (code, err) = run(&["--pool", "be"]);
    assert_eq!(code, Some(lucid_vmm::EXIT_FAILURE));
    assert!(
        err.contains("a noop pool takes device back-end threads only"),
        "{err}"
    );
    let (code, err) = run(&["--pool", "../etc"]);
    assert_eq!(code, Some(lucid_vmm::EXIT_USAGE));
    assert!(err.contains("expected none, auto or a pool name"), "{err}");
    let (code, err) = run(&["--low-noise", "--pool", "io"]);
    assert_eq!(code, Some(lucid_vmm::EXIT_USAGE));
    assert!(err.contains("exclude each other"), "{err}");
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    if cpus <= 254 {
        let (code, err) = run(&["--low-noise", "--vcpus", &cpus.to_string()]);
        assert_eq!(code, Some(lucid_vmm::EXIT_FAILURE));
        assert!(err.contains("use fewer --vcpus"), "{err}");
    }
    // No pools at all: auto runs in none, a name is refused.
    let empty = tmp("pools-none");
    let out = Command::new(env!("CARGO_BIN_EXE_lucid"))
        .env("LUCID_POOLS_DIR", &empty)
        .args(["run", "--guest", "hello", "--pool", "io"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(lucid_vmm::EXIT_FAILURE));
    assert!(err.contains("none defined"), "{err}");
}

#[test]
fn the_work_hypercall_counts_are_in_the_stats() {
    // Every VM has the counters (zero until a guest reports).
    let o = common::lucid(&["run", "--guest", "hello", "--pool", "none"], LIMIT);
    assert_eq!(o.status, Some(1), "{}", o.stderr);
    let c = &o.stats.as_ref().expect("stats")["counters"]["guest"]["work"];
    assert_eq!(c["iterations"], 0);
    assert_eq!(c["bytes"], 0);
}

/// The monitor confines itself to seccomp role `monitor`: a forbidden call there ends the VM
/// and names the thread and role (`LUCID_SECCOMP_SELFTEST=monitor` makes it call `socket`).
#[test]
fn the_monitor_thread_is_confined_to_its_seccomp_role() {
    let pools = TestPools::new("seccomp");
    let out = pools
        .command()
        .env("LUCID_SECCOMP_SELFTEST", "monitor")
        .args(["run", "--guest", "compute", "--cmdline", "iters=2000000000"])
        .args(["--pool", "io"])
        .output()
        .expect("run lucid");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(148), "{err}");
    assert!(
        err.contains("thread lucid-monitor (role monitor) made a forbidden system call: socket"),
        "{err}"
    );
}

/// A guest that resets its devices again and again starts a new back-end thread each time; in
/// a no-op pool each new one asks for admission under the vCPU's seccomp filter, on files
/// opened before confinement (one set per device, given back when a back-end ends), and the
/// VM survives: no forbidden call, no admission without files.
#[test]
fn back_ends_restarted_by_resets_rejoin_the_noop_pool_under_seccomp() {
    if !two_cpus() {
        return;
    }
    let _turn = one_at_a_time();
    let pools = TestPools::with(
        "resets",
        &[
            "name=be,cpus=1,policy=noop",
            "name=vms,cpus=0,policy=default",
        ],
    );
    let img = Removed(disk("pools-resets", 8));
    let stats = tmp("pools-resets-stats.json");
    let child = pools
        .command()
        .args(["run", "--guest", "virtio-evil", "--pool", "auto"])
        .args(["--blk", &format!("path={},rung=L1", img.0.display())])
        .args([
            "--net",
            "backend=echo,rung=L1",
            "--monitor-window-ms",
            "100",
        ])
        .arg("--stats-json")
        .arg(&stats)
        .spawn()
        .expect("spawn lucid");
    let out = finish(child, &stats);
    assert!(
        out.stdout.contains("virtio-evil: survived"),
        "{}\n{}",
        out.stdout,
        out.stderr
    );
    assert!(!out.stderr.contains("seccomp"), "{}", out.stderr);
    let activations =
        out.counter("blk0.virtio.activations") + out.counter("net0.virtio.activations");
    assert!(activations > 2, "the guest re-activated its devices");
    // Every back-end thread asked once, on files given back by the one it replaced.
    assert_eq!(
        out.counter("pools.noop_requests"),
        activations,
        "{}",
        out.stats
    );
    assert!(out.counter("pools.noop_admitted") >= 1, "{}", out.stats);
    // These two are registered when first counted (lucid-vmm's pools glue): absent is none.
    assert_eq!(
        out.counter_or_zero("pools.noop_no_files"),
        0,
        "{}",
        out.stats
    );
    assert_eq!(
        out.counter_or_zero("pools.place_errors"),
        0,
        "{}",
        out.stats
    );
}
