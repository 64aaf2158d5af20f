//! Shared helpers for the integration tests: run the real `lucid` binary on real KVM, with a
//! deadline, and collect its output, exit status and statistics.

#![allow(dead_code)]

use std::io::Read;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

pub struct Outcome {
    pub status: Option<i32>,
    pub stdout: String,
    pub stderr: String,
    pub stats: Option<serde_json::Value>,
    pub timed_out: bool,
}

impl Outcome {
    /// A counter from the stats JSON by dotted path, e.g. `post.writes`; see [`counter`].
    pub fn counter(&self, path: &str) -> u64 {
        counter(self.stats.as_ref().expect("stats JSON written"), path)
    }

    /// Whether the stats have no counter and no group of counters at dotted `path` (e.g.
    /// `swap.mapper`: no mapper ran).
    pub fn absent(&self, path: &str) -> bool {
        let mut v = &self.stats.as_ref().expect("stats JSON written")["counters"];
        for part in path.split('.') {
            match v.get(part) {
                Some(x) => v = x,
                None => return true,
            }
        }
        false
    }

    /// As [`Outcome::counter`], 0 when absent: see [`counter_or_zero`].
    pub fn counter_or_zero(&self, path: &str) -> u64 {
        counter_or_zero(self.stats.as_ref().expect("stats JSON written"), path)
    }
}

/// The counter at dotted `path` (e.g. `post.writes`) of a stats JSON (`--stats-json`, the API's
/// `stats`). A missing counter panics with its name: read as 0, a renamed counter would pass
/// every `== 0` check.
pub fn counter(stats: &serde_json::Value, path: &str) -> u64 {
    counter_opt(stats, path).unwrap_or_else(|| panic!("no counter {path} in the stats: {stats}"))
}

/// As [`counter`], but 0 when absent: only for counters registered when first counted, each
/// caller saying why absence means none.
pub fn counter_or_zero(stats: &serde_json::Value, path: &str) -> u64 {
    counter_opt(stats, path).unwrap_or(0)
}

fn counter_opt(stats: &serde_json::Value, path: &str) -> Option<u64> {
    let mut v = stats.get("counters")?;
    for part in path.split('.') {
        v = v.get(part)?;
    }
    // A counter that has counters below it keeps its own value under `total`.
    v.as_u64().or_else(|| v.get("total")?.as_u64())
}

pub fn tmp(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("lucid-test-{}-{name}", std::process::id()))
}

/// Runs `lucid` with `args` (plus `--stats-json`), killing it with SIGKILL after `limit`.
/// `lucid ARGS` as given (no `--stats-json` added, so any subcommand), bounded by `limit`.
pub fn lucid_plain(args: &[&str], limit: Duration) -> Outcome {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_lucid"));
    cmd.args(args);
    let o = run_cmd(cmd, limit);
    assert!(!o.timed_out, "lucid {args:?} hung");
    o
}

pub fn lucid(args: &[&str], limit: Duration) -> Outcome {
    lucid_pinned(args, limit, &[])
}

/// [`lucid`] running probe guest `guest` with guest RAM in a memfd and the vfio-user device
/// `dev` (`socket=...`), then `extra`.
pub fn lucid_user_device(guest: &str, dev: &str, extra: &[&str], limit: Duration) -> Outcome {
    let mut args = vec![
        "run",
        "--guest",
        guest,
        "--backing",
        "memfd",
        "--user-device",
        dev,
    ];
    args.extend_from_slice(extra);
    lucid(&args, limit)
}

/// As [`lucid`], and pins each of Lucid's threads named in `pins` (e.g. `lucid-vcpu0`) to its
/// CPU as soon as it appears, for a while after start (a thread not seen within a second keeps
/// the affinity it inherited: a device back-end started by a pinned vCPU shares its CPU).
/// Best effort, for steadier timing: no test's assertions depend on it.
pub fn lucid_pinned(args: &[&str], limit: Duration, pins: &[(&str, usize)]) -> Outcome {
    let stats = tmp(&format!("stats-{}.json", rand_suffix()));
    let mut child = Command::new(env!("CARGO_BIN_EXE_lucid"))
        .args(args)
        .arg("--stats-json")
        .arg(&stats)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn lucid");
    pin_threads(child.id(), pins);
    let out = wait_with_deadline(&mut child, limit);
    let stats_json = std::fs::read_to_string(&stats)
        .ok()
        .and_then(|s| serde_json::from_str(&s).ok());
    let _ = std::fs::remove_file(&stats);
    Outcome {
        stats: stats_json,
        ..out
    }
}

fn pin_threads(pid: u32, pins: &[(&str, usize)]) {
    let mut left: Vec<_> = pins.to_vec();
    let start = Instant::now();
    while !left.is_empty() && start.elapsed() < Duration::from_secs(1) {
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
            return;
        };
        for t in tasks.flatten() {
            let comm = std::fs::read_to_string(t.path().join("comm")).unwrap_or_default();
            let Some(k) = left.iter().position(|(n, _)| *n == comm.trim()) else {
                continue;
            };
            let tid: libc::pid_t = t.file_name().to_string_lossy().parse().unwrap_or(0);
            // SAFETY: cpu_set_t is plain data; CPU_SET and sched_setaffinity get a valid pointer
            // to it and its size. A thread that exited meanwhile makes the call fail, harmlessly.
            unsafe {
                let mut set: libc::cpu_set_t = std::mem::zeroed();
                libc::CPU_SET(left[k].1, &mut set);
                libc::sched_setaffinity(tid, std::mem::size_of::<libc::cpu_set_t>(), &set);
            }
            left.swap_remove(k);
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Runs any command with a deadline.
pub fn run_cmd(mut cmd: Command, limit: Duration) -> Outcome {
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    wait_with_deadline(&mut child, limit)
}

fn wait_with_deadline(child: &mut std::process::Child, limit: Duration) -> Outcome {
    let mut so = child.stdout.take().expect("piped");
    let mut se = child.stderr.take().expect("piped");
    let t_out = std::thread::spawn(move || {
        let mut s = Vec::new();
        let _ = so.read_to_end(&mut s);
        s
    });
    let t_err = std::thread::spawn(move || {
        let mut s = Vec::new();
        let _ = se.read_to_end(&mut s);
        s
    });
    let start = Instant::now();
    let mut timed_out = false;
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait") {
            break s;
        }
        if start.elapsed() > limit {
            timed_out = true;
            let _ = child.kill();
            break child.wait().expect("wait");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    Outcome {
        status: status.code(),
        stdout: String::from_utf8_lossy(&t_out.join().unwrap()).into_owned(),
        stderr: String::from_utf8_lossy(&t_err.join().unwrap()).into_owned(),
        stats: None,
        timed_out,
    }
}

fn rand_suffix() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    format!("{nanos}-{:?}", std::thread::current().id()).replace(['(', ')'], "")
}

/// Writes a built-in guest's ELF to a file, for tests that need a path (e.g. for QEMU).
pub fn guest_file(name: &str) -> PathBuf {
    let path = tmp(&format!("{name}.elf"));
    std::fs::write(&path, lucid_guests::get(name).expect("built-in guest")).unwrap();
    path
}

/// A sparse disk image of `mib` MiB in the temporary directory, named after `tag`.
pub fn disk(tag: &str, mib: u64) -> PathBuf {
    let p = tmp(&format!("{tag}.img"));
    std::fs::File::create(&p)
        .unwrap()
        .set_len(mib << 20)
        .unwrap();
    p
}

/// A turn for tests that run polling threads (sidecore, the L4 rungs): two such VMs at once on
/// a 2-core machine starve each other, so the tests of one binary that take this run in turn.
pub fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    static TURN: std::sync::Mutex<()> = std::sync::Mutex::new(());
    TURN.lock().unwrap_or_else(|e| e.into_inner())
}

/// `key=` of the first line of `out` starting with `prefix`, e.g. `mismatches` of the
/// `virtio-blk op=` result line.
pub fn field<'a>(out: &'a str, prefix: &str, key: &str) -> Option<&'a str> {
    let line = out.lines().find(|l| l.starts_with(prefix))?;
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(key)?.strip_prefix('='))
}

/// Spawns `cmd` (a `lucid run` of a guest that ends by holding), hands each stdout line to
/// `on_line` until one starts with `stop` or `limit` passes (also when the guest goes quiet),
/// then kills it with SIGKILL: nothing more gets written back. For the kill -9 durability tests.
pub fn run_until_then_kill(
    mut cmd: Command,
    stop: &str,
    limit: Duration,
    mut on_line: impl FnMut(&str),
) {
    use std::io::{BufRead, BufReader};
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let out = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let reader = std::thread::spawn(move || {
        for line in BufReader::new(out).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let deadline = Instant::now() + limit;
    while let Ok(line) = rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
        on_line(&line);
        if line.starts_with(stop) {
            break;
        }
    }
    child.kill().unwrap();
    child.wait().unwrap();
    drop(rx);
    reader.join().unwrap();
}

/// A network namespace this test makes with a tap in it (`ip` from iproute2; root only),
/// removed at drop. No address outside the namespace is touched.
pub struct TapNamespace {
    pub name: String,
}

impl TapNamespace {
    /// Namespace `lucid-<tag>-<pid>` with tap `tap`; with `host_addr` (`10.77.0.1/24`) the tap
    /// has that address and is up, with the loopback.
    pub fn new(tag: &str, tap: &str, host_addr: Option<&str>) -> Self {
        let ns = TapNamespace {
            name: format!("lucid-{tag}-{}", std::process::id()),
        };
        ip(&["netns", "add", &ns.name]);
        let mut steps = vec![vec!["tuntap", "add", "dev", tap, "mode", "tap"]];
        if let Some(addr) = host_addr {
            steps.push(vec!["addr", "add", addr, "dev", tap]);
            steps.push(vec!["link", "set", tap, "up"]);
            steps.push(vec!["link", "set", "lo", "up"]);
        }
        for step in steps {
            let mut a = vec!["netns", "exec", &ns.name, "ip"];
            a.extend(step);
            ip(&a);
        }
        ns
    }

    /// The command prefix that runs a program inside (`ip netns exec NAME`).
    pub fn exec(&self) -> [&str; 4] {
        ["ip", "netns", "exec", &self.name]
    }

    /// `program` to run inside.
    pub fn command(&self, program: &str) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.name, program]);
        c
    }
}

impl Drop for TapNamespace {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .status();
    }
}

/// Runs `ip ARGS`, which must succeed.
fn ip(args: &[&str]) {
    let s = Command::new("ip")
        .args(args)
        .status()
        .expect("ip (iproute2)");
    assert!(s.success(), "ip {args:?}");
}
