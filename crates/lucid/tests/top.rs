//! `lucid top` on real KVM: two REST VMMs (`lucid run --api-socket DIR/a.sock`, `b.sock`), each
//! running a probe guest that exits to Lucid in a loop, are both listed Running with nonzero
//! exit rates; a stale socket file in the same directory is reported as skipped, and the
//! snapshot still comes. A VMM started with `--api-socket auto` is found in the run directory.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{lucid_plain, tmp};
use lucid_bench::http::{request, wait_for_ping};
use serde_json::{json, Value};

const LIMIT: Duration = Duration::from_secs(30);

/// A `lucid run --api-socket` process, stopped however the test ends.
struct Vmm {
    child: Child,
    socket: PathBuf,
}

impl Vmm {
    fn start(socket: PathBuf) -> Vmm {
        let child = Command::new(env!("CARGO_BIN_EXE_lucid"))
            .args(["run", "--quiet", "--api-socket"])
            .arg(&socket)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        let vmm = Vmm { child, socket };
        wait_for_ping(&vmm.socket, LIMIT).expect("the API answers vmm.ping");
        vmm
    }

    fn put(&self, what: &str, body: Option<&Value>) {
        let body = body.map(Value::to_string);
        let r = request(
            &self.socket,
            "PUT",
            &format!("/api/v1/{what}"),
            body.as_deref(),
            LIMIT,
        )
        .unwrap();
        assert!(r.ok(), "{what}: {} {}", r.status, r.text());
    }
}

impl Drop for Vmm {
    fn drop(&mut self) {
        let _ = request(
            &self.socket,
            "PUT",
            "/api/v1/vmm.shutdown",
            None,
            Duration::from_secs(5),
        );
        let t = Instant::now();
        while t.elapsed() < LIMIT {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn top(dir: &Path, extra: &[&str]) -> String {
    let mut args = vec!["top", "--run-dir", dir.to_str().unwrap(), "--once"];
    args.extend_from_slice(extra);
    let o = lucid_plain(&args, LIMIT);
    assert_eq!(o.status, Some(0), "lucid top: {}", o.stderr);
    o.stdout
}

#[test]
fn top_lists_each_running_vm_and_skips_a_stale_socket() {
    let dir = tmp("top-run");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let vmms: Vec<Vmm> = ["a", "b"]
        .iter()
        .map(|n| Vmm::start(dir.join(format!("{n}.sock"))))
        .collect();
    // pio-ping's `out`s never end with this count: a steady stream of exits to Lucid.
    let body = json!({
        "payload": {"kernel": "builtin:pio-ping", "cmdline": "count=1000000000000000"},
        "memory": {"size": 64u64 << 20},
    });
    for v in &vmms {
        v.put("vm.create", Some(&body));
        v.put("vm.boot", None);
    }
    // A VMM that died without removing its socket.
    let stale = dir.join("stale.sock");
    drop(std::os::unix::net::UnixListener::bind(&stale).unwrap());

    let out = top(&dir, &["--json", "--interval", "0.5"]);
    let snap: Value = serde_json::from_str(out.trim()).unwrap_or_else(|e| panic!("{e}: {out}"));
    let vms = snap["vms"].as_array().expect("vms");
    let names: Vec<&str> = vms.iter().map(|v| v["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["a", "b"], "{snap}");
    for (v, vmm) in vms.iter().zip(&vmms) {
        assert_eq!(v["state"], "Running", "{v}");
        assert_eq!(v["pid"], json!(vmm.child.id()), "{v}");
        assert!(v["exits_per_s"].as_f64().unwrap() > 0.0, "{v}");
        assert!(
            v["exits_by_reason_per_s"]["io_out"].as_f64().unwrap() > 0.0,
            "{v}"
        );
    }
    let skipped = snap["skipped"].as_array().expect("skipped");
    assert_eq!(skipped.len(), 1, "{snap}");
    assert_eq!(skipped[0]["socket"], json!(stale), "{snap}");
    assert!(
        skipped[0]["reason"].as_str().unwrap().contains("stale"),
        "{snap}"
    );

    // The display: one block per VM, the stale socket noted.
    let text = top(&dir, &["--interval", "0.2"]);
    for n in [
        "\na  pid", "\nb  pid", "Running", "exits/s", "io_out", "skipped",
    ] {
        assert!(text.contains(n), "no {n:?} in:\n{text}");
    }
    drop(vmms);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn top_with_no_run_directory_says_so() {
    let dir = tmp("top-none");
    let out = top(&dir, &["--json", "--interval", "0.05"]);
    let snap: Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(snap["vms"], json!([]));
    assert!(snap["notes"][0]
        .as_str()
        .unwrap()
        .contains("does not exist"));
}

/// `lucid run --api-socket auto` serves on `lucid-<pid>.sock` in the run directory
/// (`LUCID_RUN_DIR` here), creating it mode 0700, and `lucid top` lists it with no other setup.
#[test]
fn top_finds_a_vmm_started_with_api_socket_auto() {
    use std::os::unix::fs::PermissionsExt;
    let base = tmp("top-auto");
    let _ = std::fs::remove_dir_all(&base);
    std::fs::create_dir_all(&base).unwrap();
    let dir = base.join("run");
    let log = base.join("stderr");
    let child = Command::new(env!("CARGO_BIN_EXE_lucid"))
        .args(["run", "--api-socket", "auto"])
        .env("LUCID_RUN_DIR", &dir)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let pid = child.id();
    let socket = dir.join(format!("lucid-{pid}.sock"));
    let vmm = Vmm {
        child,
        socket: socket.clone(),
    };
    wait_for_ping(&socket, LIMIT).expect("the API answers vmm.ping on the auto socket");
    let mode = std::fs::metadata(&dir).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o700, "{mode:o}");

    let out = top(&dir, &["--json", "--interval", "0.05"]);
    let snap: Value = serde_json::from_str(out.trim()).unwrap_or_else(|e| panic!("{e}: {out}"));
    let vms = snap["vms"].as_array().expect("vms");
    assert_eq!(vms.len(), 1, "{snap}");
    assert_eq!(vms[0]["name"], json!(format!("lucid-{pid}")), "{snap}");
    assert_eq!(vms[0]["pid"], json!(pid), "{snap}");
    assert_eq!(vms[0]["state"], "NotCreated", "{snap}");
    drop(vmm);
    let stderr = std::fs::read_to_string(&log).unwrap();
    assert!(
        stderr.contains(&format!(
            "--api-socket auto: serving on {}",
            socket.display()
        )),
        "{stderr}"
    );
    let _ = std::fs::remove_dir_all(&base);
}
