//! The REST API beside a VM booted from flags (`lucid run --guest NAME --api-socket PATH`,
//! docs/api.md) on real KVM: the VM runs at once and the same endpoints serve it (vmm.ping,
//! vm.info Running, vm.counters, /metrics, pause and resume, vm.shutdown then vmm.shutdown); a
//! guest that ends by itself ends the process with the status it has without the API; SIGTERM
//! as without the API; the statistics files written as without the API.

mod common;

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{counter, run_cmd, tmp};
use serde_json::Value;

const LIMIT: Duration = Duration::from_secs(30);

/// A `lucid run ARGS --api-socket SOCKET`, killed if a test fails.
struct Lucid {
    child: Option<Child>,
    socket: PathBuf,
    err: PathBuf,
}

impl Lucid {
    fn start(tag: &str, args: &[&str]) -> Lucid {
        let socket = tmp(&format!("{tag}.sock"));
        let err = tmp(&format!("{tag}.err"));
        let child = Command::new(env!("CARGO_BIN_EXE_lucid"))
            .arg("run")
            .args(args)
            .arg("--api-socket")
            .arg(&socket)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&err).unwrap())
            .spawn()
            .unwrap();
        Lucid {
            child: Some(child),
            socket,
            err,
        }
    }

    /// Waits until the socket answers vmm.ping.
    fn ready(self) -> Lucid {
        let mut s = self;
        let t = Instant::now();
        while s.api("GET", "vmm.ping", "").is_none() {
            assert!(
                s.child.as_mut().unwrap().try_wait().unwrap().is_none(),
                "lucid ended: {}",
                s.stderr()
            );
            assert!(t.elapsed() < LIMIT, "the socket never answered");
            std::thread::sleep(Duration::from_millis(20));
        }
        s
    }

    fn stderr(&self) -> String {
        std::fs::read_to_string(&self.err).unwrap_or_default()
    }

    /// `METHOD /api/v1/NAME` (or `/metrics`) with `body`: (status, body).
    fn api(&self, method: &str, name: &str, body: &str) -> Option<(u16, String)> {
        let path = match name {
            "/metrics" => name.to_string(),
            n => format!("/api/v1/{n}"),
        };
        http(
            &self.socket,
            format!(
                "{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n{body}",
                body.len()
            )
            .as_bytes(),
        )
    }

    fn json(&self, method: &str, name: &str) -> Value {
        let (code, body) = self.api(method, name, "").expect("a response");
        assert_eq!(code, 200, "{method} {name}: {body}");
        serde_json::from_str(&body).unwrap()
    }

    fn ok(&self, name: &str) {
        let r = self.api("PUT", name, "").expect("a response");
        assert_eq!(r.0 / 100, 2, "PUT {name}: {}", r.1);
    }

    fn state(&self) -> String {
        self.json("GET", "vm.info")["state"]
            .as_str()
            .unwrap()
            .to_string()
    }

    fn exits(&self) -> u64 {
        self.json("GET", "vm.counters")["kvm"]["vcpu0.exits"]
            .as_u64()
            .expect("kvm/vcpu0.exits in vm.counters")
    }

    /// Waits for the process to end by itself; its exit status.
    fn wait(&mut self) -> Option<i32> {
        let mut child = self.child.take().unwrap();
        let t = Instant::now();
        loop {
            if let Some(s) = child.try_wait().unwrap() {
                return s.code();
            }
            if t.elapsed() > LIMIT {
                let _ = child.kill();
                let _ = child.wait();
                panic!("lucid did not exit: {}", self.stderr());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Lucid {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = std::fs::remove_file(&self.err);
    }
}

/// Sends `request` and reads the response to EOF: (status, body).
fn http(socket: &Path, request: &[u8]) -> Option<(u16, String)> {
    let mut s = UnixStream::connect(socket).ok()?;
    s.set_read_timeout(Some(LIMIT)).unwrap();
    s.write_all(request).ok()?;
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    let text = String::from_utf8_lossy(&out).into_owned();
    let code = text.strip_prefix("HTTP/1.1 ")?.get(..3)?.parse().ok()?;
    Some((code, text.split_once("\r\n\r\n")?.1.to_string()))
}

#[test]
fn a_flag_booted_vm_is_served_and_stops_with_vmm_shutdown() {
    let stats = tmp("beside-stats.json");
    let stats_arg = stats.to_str().unwrap();
    let mut s = Lucid::start("beside", &["--guest", "spin", "--stats-json", stats_arg]).ready();
    let info = s.json("GET", "vm.info");
    assert_eq!(info["state"], "Running", "booted at once: {info}");
    // Lucid's own VmConfig JSON: the VM came from flags, not from a vm.create body.
    assert_eq!(info["config"]["machine"]["vcpus"], 1, "{info}");
    assert!(info["device_tree"]["serial"].is_object(), "{info}");
    assert_eq!(
        s.api(
            "PUT",
            "vm.create",
            r#"{"payload":{"kernel":"builtin:spin"}}"#
        )
        .unwrap()
        .0,
        500,
        "a VM exists"
    );

    let before = s.exits();
    s.ok("vm.pause");
    assert_eq!(s.state(), "Paused");
    let paused = s.exits();
    std::thread::sleep(Duration::from_secs(1));
    assert_eq!(s.exits(), paused, "a paused vCPU exited");
    assert!(paused >= before);
    s.ok("vm.resume");
    assert_eq!(s.state(), "Running");
    let (code, metrics) = s.api("GET", "/metrics", "").unwrap();
    assert_eq!(code, 200);
    assert!(
        metrics.contains("# TYPE lucid_kvm_vcpu0_exits_total counter"),
        "{metrics}"
    );

    // vm.shutdown stops the VM, not the VMM (Cloud Hypervisor's meaning); it boots again.
    s.ok("vm.shutdown");
    assert_eq!(s.state(), "Shutdown");
    assert!(s.child.as_mut().unwrap().try_wait().unwrap().is_none());
    s.ok("vm.boot");
    assert_eq!(s.state(), "Running");
    // The new VM's statistics are the ones written: let its vCPU run first.
    let t = Instant::now();
    while s.exits() == 0 {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "the rebooted vCPU never ran"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(s.api("PUT", "vmm.shutdown", "").unwrap().0, 200);
    assert_eq!(s.wait(), Some(0), "{}", s.stderr());
    assert!(!s.socket.exists(), "the socket file is removed at exit");
    // The statistics of the run, as without the API.
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&stats).unwrap()).unwrap();
    assert!(counter(&v, "kvm.vcpu0.exits") > 0, "{v}");
    let _ = std::fs::remove_file(&stats);
}

/// A guest that ends by itself ends the process, with the exit status it has without the API.
#[test]
fn a_guest_that_ends_by_itself_ends_the_process_with_its_status() {
    for guest in ["hello", "triplefault"] {
        let mut plain = Command::new(env!("CARGO_BIN_EXE_lucid"));
        plain.args(["run", "--guest", guest]);
        let want = run_cmd(plain, LIMIT).status;
        assert!(want.is_some(), "{guest} without the API");
        let mut s = Lucid::start(&format!("ends-{guest}"), &["--guest", guest]);
        assert_eq!(s.wait(), want, "{guest}: {}", s.stderr());
        assert!(!s.socket.exists(), "{guest}: the socket file is removed");
    }
}

#[test]
fn sigterm_stops_a_flag_booted_vm_as_without_the_api() {
    let mut s = Lucid::start("beside-term", &["--guest", "spin"]).ready();
    let pid = s.child.as_ref().unwrap().id() as i32;
    // SAFETY: kill on our own child's pid.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
    assert_eq!(s.wait(), Some(128 + libc::SIGTERM), "{}", s.stderr());
    assert!(!s.socket.exists());
}

/// A flag-booted VM with `--hotplug`: `vm.add-disk` reaches the `hotplug` guest and joins
/// Lucid's configuration in `vm.info` (named by its id); after `vm.remove-device` and the
/// guest's eject it leaves it, and a reboot boots what is left.
#[test]
fn a_flag_booted_vm_hotplugs_into_its_configuration() {
    let serial = tmp("beside-hp.serial");
    let mut s = Lucid::start(
        "beside-hp",
        &[
            "--guest",
            "hotplug",
            "--hotplug",
            "--serial",
            &format!("file:{}", serial.display()),
        ],
    )
    .ready();
    let console = || std::fs::read_to_string(&serial).unwrap_or_default();
    let until = |what: &dyn Fn() -> bool| {
        let t = Instant::now();
        while !what() {
            assert!(t.elapsed() < LIMIT, "{}", console());
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    until(&|| console().contains("hotplug: ready"));
    let image = tmp("beside-hp.img");
    std::fs::write(&image, vec![0u8; 1 << 20]).unwrap();
    let body = format!(r#"{{"path":"{}","id":"extra"}}"#, image.display());
    let (code, reply) = s.api("PUT", "vm.add-disk", &body).unwrap();
    assert_eq!(code, 200, "{reply}");
    until(&|| console().contains("up 1af4:1042"));
    let pci = |s: &Lucid| s.json("GET", "vm.info")["config"]["devices"]["pci"].clone();
    assert_eq!(pci(&s)[0]["name"], "extra", "{}", pci(&s));
    let (code, _) = s
        .api("PUT", "vm.remove-device", r#"{"id":"extra"}"#)
        .unwrap();
    assert_eq!(code, 204);
    until(&|| console().contains("ejected vendor=ffff"));
    assert_eq!(pci(&s), serde_json::json!([]));
    s.ok("vm.reboot");
    assert_eq!(s.state(), "Running");
    assert_eq!(s.api("PUT", "vmm.shutdown", "").unwrap().0, 200);
    assert_eq!(s.wait(), Some(0), "{}", s.stderr());
}
