//! `lucid-linux-client --hotplug`: the small Linux kernel under `lucid run --api-socket`,
//! driven through Cloud Hypervisor's REST API by curl, checks ACPI PCI hotplug with Linux's
//! own drivers (docs/api.md):
//!
//! 1. `vm.create` (the kernel, an initramfs whose `/init` spins without a system call) and
//!    `vm.boot`; Linux registers the hotplug slots (`acpiphp`) and the power button.
//! 2. `vm.add-disk` (a GPT disk): `acpiphp` scans the slot, virtio_blk logs the disk with its
//!    capacity and reads its partition table (the disk's `bytes_written` counter, bytes the
//!    device wrote into guest buffers, moves).
//! 3. `vm.remove-device`: Linux releases the device and ejects the slot; Lucid detaches it
//!    and closes the image (`/proc/PID/fd`).
//! 4. `vm.power-button`: Linux's button driver reports the press as an input event (evbug logs
//!    it with `loglevel=8`). Powering off on it is userspace's job (systemd-logind, acpid),
//!    which no guest runs here.
//! 5. `vm.shutdown`, `vmm.shutdown`: Lucid exits 0.
//!
//! Prints, last, `linux-client: hotplug=ok|fail steps=N/M seconds=S`; `--json FILE` gets each
//! step with its time and evidence.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::timed_boot::{first, Boot, Line};
use crate::{gpt_disk, spinning_init, Args, Cpio, WorkDir};

/// The id the hot-added disk gets.
const DISK_ID: &str = "hotdisk";
/// How long each step after the boot may take (ACPI AML and the driver's probe are emulated
/// kernel code on a PVM host).
const STEP: Duration = Duration::from_secs(120);

/// One step's outcome.
struct Step {
    name: &'static str,
    ok: bool,
    seconds: f64,
    evidence: String,
}

/// `METHOD /api/v1/NAME` with `body` through curl: (status, body).
fn curl(socket: &Path, method: &str, name: &str, body: Option<&Value>) -> (u16, String) {
    let mut cmd = Command::new("curl");
    cmd.args(["-s", "-m", "60", "-X", method, "--unix-socket"])
        .arg(socket)
        .args(["-w", "\n%{http_code}"]);
    if let Some(b) = body {
        cmd.args(["-H", "Content-Type: application/json", "-d", &b.to_string()]);
    }
    let Ok(out) = cmd.arg(format!("http://localhost/api/v1/{name}")).output() else {
        return (0, "curl did not run (apt-get install curl)".into());
    };
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    match text.rsplit_once('\n') {
        Some((body, code)) => (code.trim().parse().unwrap_or(0), body.to_string()),
        None => (0, text),
    }
}

fn has_open(pid: u32, path: &Path) -> bool {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| {
            d.filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
                .any(|p| p == path)
        })
        .unwrap_or(false)
}

fn counter(socket: &Path, device: &str, name: &str) -> u64 {
    let (_, body) = curl(socket, "GET", "vm.counters", None);
    serde_json::from_str::<Value>(&body)
        .ok()
        .and_then(|v| v[device][name].as_u64())
        .unwrap_or(0)
}

/// Polls `what` until it holds or `limit` passes.
fn eventually(limit: Duration, what: impl Fn() -> bool) -> bool {
    let t = Instant::now();
    while t.elapsed() < limit {
        if what() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    what()
}

fn line_with<'a>(lines: &'a [Line], needles: &[&str]) -> Option<&'a Line> {
    lines
        .iter()
        .find(|l| needles.iter().all(|n| l.text.contains(n)))
}

/// Runs the check; `Ok(true)` when every step passed.
pub fn run(args: &Args, work: &WorkDir) -> Result<bool, String> {
    let start = Instant::now();
    let mut cpio = Cpio::new();
    cpio.entry("dev", 0o040755, (0, 0), &[]);
    cpio.entry("dev/console", 0o020600, (5, 1), &[]);
    cpio.entry("init", 0o100755, (0, 0), &spinning_init());
    let initrd = work.path("hotplug.cpio");
    std::fs::write(&initrd, cpio.finish()).map_err(|e| format!("initramfs: {e}"))?;
    let disk = gpt_disk(work)?;
    let socket = work.path("api.sock");
    let mut boot = Boot::serve(&args.lucid, &socket, args.log.as_deref())?;
    let mut steps: Vec<Step> = Vec::new();
    let mut step = |name, ok: bool, evidence: String| {
        eprintln!(
            "linux-client: hotplug {name}: {} ({evidence})",
            if ok { "ok" } else { "FAIL" }
        );
        steps.push(Step {
            name,
            ok,
            seconds: start.elapsed().as_secs_f64(),
            evidence,
        });
        ok
    };

    let up = eventually(Duration::from_secs(20), || socket.exists());
    let config = json!({
        "payload": {
            "kernel": args.kernel,
            "initramfs": initrd,
            "cmdline": "console=ttyS0 earlyprintk=serial reboot=k panic=-1 loglevel=8",
        },
        "memory": {"size": 128u64 << 20},
        "serial": {"mode": "Tty"},
        "console": {"mode": "Off"},
    });
    let created = up && curl(&socket, "PUT", "vm.create", Some(&config)).0 == 204;
    let booted = created && curl(&socket, "PUT", "vm.boot", None).0 == 204;
    let deadline = Instant::now() + args.timeout;
    let init_line = "Run /init as init process";
    let reached = booted && boot.wait_for(deadline, |l| first(l, init_line).is_some());
    let lines = boot.lines();
    let slots = lines
        .iter()
        .filter(|l| l.text.contains("acpiphp: Slot [") && l.text.contains("registered"))
        .count();
    let button = line_with(lines, &["Power Button [PWRB]"]).is_some();
    let mut ok = step(
        "boot",
        reached && slots > 0 && button,
        format!("init={reached} acpiphp_slots={slots} power_button={button}"),
    );

    let mut added = String::new();
    if ok {
        let body = json!({"path": disk, "readonly": true, "id": DISK_ID});
        let (code, resp) = curl(&socket, "PUT", "vm.add-disk", Some(&body));
        added = resp.clone();
        let logged = code == 200
            && boot.wait_for(Instant::now() + STEP, |l| {
                line_with(l, &["virtio_blk", "512-byte logical blocks"]).is_some()
            });
        let capacity = line_with(boot.lines(), &["virtio_blk", "512-byte logical blocks"])
            .map(|l| l.text.clone())
            .unwrap_or_default();
        // A disk read is the device writing into guest memory.
        let read = eventually(STEP, || counter(&socket, DISK_ID, "bytes_written") >= 512);
        ok = step(
            "add-disk",
            logged && read,
            format!("{code} {resp}; {capacity:?}; first sector read={read}"),
        );
    }
    if ok {
        let (code, _) = curl(
            &socket,
            "PUT",
            "vm.remove-device",
            Some(&json!({"id": DISK_ID})),
        );
        let pid = boot.pid();
        let closed = code == 204 && eventually(STEP, || !has_open(pid, &disk));
        let ejected = counter(&socket, "hotplug", "ejected");
        ok = step(
            "remove-device",
            closed && ejected == 1,
            format!("{code}; image closed={closed}; hotplug.ejected={ejected}"),
        );
    }
    if ok {
        let (code, _) = curl(&socket, "PUT", "vm.power-button", None);
        // KEY_POWER is input event code 116.
        let seen = code == 204
            && boot.wait_for(Instant::now() + STEP, |l| {
                line_with(l, &["evbug", "Code: 116"]).is_some()
            });
        ok = step(
            "power-button",
            seen,
            format!("{code}; evbug saw KEY_POWER={seen}"),
        );
    }
    let shutdown = curl(&socket, "PUT", "vm.shutdown", None).0;
    let vmm = curl(&socket, "PUT", "vmm.shutdown", None).0;
    let (code, stderr, lines, _) = boot.finish();
    if ok {
        step(
            "shutdown",
            shutdown == 204 && vmm == 200 && code == Some(0),
            format!("vm.shutdown {shutdown}, vmm.shutdown {vmm}, exit {code:?}"),
        );
    }
    let passed = steps.iter().all(|s| s.ok) && steps.len() == 5;
    println!(
        "linux-client: hotplug={} steps={}/5 seconds={:.0}",
        if passed { "ok" } else { "fail" },
        steps.iter().filter(|s| s.ok).count(),
        start.elapsed().as_secs_f64()
    );
    if let Some(path) = &args.json {
        let report = json!({
            "passed": passed,
            "steps": steps.iter().map(|s| json!({
                "name": s.name, "ok": s.ok, "seconds": s.seconds, "evidence": s.evidence,
            })).collect::<Vec<_>>(),
            "added": added,
            "lucid_exit": code,
            "lucid_stderr": stderr,
            "console_tail": crate::tail(&lines, 40),
        });
        let text = serde_json::to_string_pretty(&report).unwrap_or_default();
        std::fs::write(path, text).map_err(|e| format!("{}: {e}", path.display()))?;
    }
    Ok(passed)
}
