//! Lucid's endpoints of the REST API (`/api/v1/lucid.*`, `lucid run --api-socket`) and their
//! client (`lucid sym`) on real KVM, with the default seccomp filters on: statistics and SymSpy
//! over the socket, bad requests (a body that is not JSON, an unknown endpoint, an unknown
//! field, a vCPU the VM lacks, a wrong method) refused with 400 or 404 and a message while the
//! VM runs on, the symbiotic requests refused without `--symbiotic`, the socket file's lifetime
//! (removed at exit, a stale one replaced, a live one refused), and SymCalls and modules end to
//! end. The HTTP framing's own bad input (a stalled client, a body over the cap, ...) is
//! api_rest.rs's.

mod common;

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{counter, field, run_cmd, tmp, Outcome};
use serde_json::Value;

const LIMIT: Duration = Duration::from_secs(20);

/// A `lucid run` in the background with its REST API on a socket of its own.
struct Vm {
    child: Option<Child>,
    socket: PathBuf,
    stats: PathBuf,
    out: PathBuf,
    err: PathBuf,
}

impl Vm {
    /// Starts `lucid run ARGS --api-socket SOCKET` and waits for the socket to answer.
    fn start(tag: &str, args: &[&str]) -> Vm {
        let mut vm = Vm::start_may_end(tag, args);
        assert!(vm.wait_for_socket(), "the VM ended: {}", vm.stderr());
        vm
    }

    /// Starts it; the caller waits for the socket (the guest may end at once).
    fn start_may_end(tag: &str, args: &[&str]) -> Vm {
        let socket = tmp(&format!("{tag}.sock"));
        let _ = std::fs::remove_file(&socket);
        Vm::spawn(tag, &socket, args)
    }

    /// Starts it on `socket`, as it is (it may exist).
    fn spawn(tag: &str, socket: &Path, args: &[&str]) -> Vm {
        let (stats, out, err) = (
            tmp(&format!("{tag}-stats.json")),
            tmp(&format!("{tag}.out")),
            tmp(&format!("{tag}.err")),
        );
        let child = Command::new(env!("CARGO_BIN_EXE_lucid"))
            .arg("run")
            .args(args)
            .arg("--api-socket")
            .arg(socket)
            .arg("--stats-json")
            .arg(&stats)
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&out).unwrap())
            .stderr(std::fs::File::create(&err).unwrap())
            .spawn()
            .expect("spawn lucid");
        Vm {
            child: Some(child),
            socket: socket.into(),
            stats,
            out,
            err,
        }
    }

    /// Waits until the socket answers (one connection); false when the VM ended first.
    fn wait_for_socket(&mut self) -> bool {
        let start = Instant::now();
        while UnixStream::connect(&self.socket).is_err() {
            if !self.running() {
                return false;
            }
            assert!(
                start.elapsed() < LIMIT,
                "the API socket never answered: {}",
                self.stderr()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        true
    }

    fn stderr(&self) -> String {
        std::fs::read_to_string(&self.err).unwrap_or_default()
    }

    fn stdout(&self) -> String {
        std::fs::read_to_string(&self.out).unwrap_or_default()
    }

    /// `lucid sym --socket SOCKET ARGS`.
    fn sym(&self, args: &[&str]) -> Outcome {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_lucid"));
        cmd.arg("sym").arg("--socket").arg(&self.socket).args(args);
        let o = run_cmd(cmd, LIMIT);
        assert!(!o.timed_out, "lucid sym {args:?} hung");
        o
    }

    /// `METHOD /api/v1/NAME` with `body` over a connection of its own: (status, the body as
    /// JSON, or as a string when it is not JSON).
    fn request(&self, method: &str, name: &str, body: &str) -> (u16, Value) {
        self.try_request(method, name, body).expect("a response")
    }

    /// As [`Vm::request`]; `None` when the API is gone (the VM ended).
    fn try_request(&self, method: &str, name: &str, body: &str) -> Option<(u16, Value)> {
        let mut c = UnixStream::connect(&self.socket).ok()?;
        c.set_read_timeout(Some(LIMIT)).ok()?;
        let req = format!(
            "{method} /api/v1/{name} HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        );
        c.write_all(req.as_bytes()).ok()?;
        let mut out = String::new();
        c.read_to_string(&mut out).ok()?;
        let code = out.strip_prefix("HTTP/1.1 ")?.get(..3)?.parse().ok()?;
        let body = out.split_once("\r\n\r\n")?.1;
        let v = serde_json::from_str(body).unwrap_or_else(|_| Value::String(body.into()));
        Some((code, v))
    }

    /// A 200 answer's body.
    fn answer(&self, method: &str, name: &str, body: &str) -> Value {
        let (code, v) = self.request(method, name, body);
        assert_eq!(code, 200, "{method} {name} {body}: {v}");
        v
    }

    fn running(&mut self) -> bool {
        self.child.as_mut().unwrap().try_wait().unwrap().is_none()
    }

    /// Waits for the VM to end (after `stop` or on its own); its status and statistics.
    fn wait(&mut self) -> (Option<i32>, Value) {
        let mut child = self.child.take().unwrap();
        let start = Instant::now();
        let status = loop {
            if let Some(s) = child.try_wait().unwrap() {
                break s;
            }
            if start.elapsed() > LIMIT {
                let _ = child.kill();
                panic!("the VM did not stop: {}", self.stderr());
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let stats = std::fs::read_to_string(&self.stats)
            .ok()
            .and_then(|s| serde_json::from_str(&s).ok())
            .unwrap_or(Value::Null);
        (status.code(), stats)
    }

    /// Ends the VM with SIGKILL, as a crash would.
    fn kill(&mut self) {
        let mut child = self.child.take().unwrap();
        child.kill().unwrap();
        child.wait().unwrap();
    }
}

impl Drop for Vm {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        for p in [&self.stats, &self.out, &self.err] {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// The message of a refusal (Cloud Hypervisor's body: an array of messages) with `code`.
fn refusal(r: (u16, Value), code: u16) -> String {
    assert_eq!(r.0, code, "{}", r.1);
    let msgs: Vec<String> = serde_json::from_value(r.1).expect("an array of messages");
    assert!(!msgs.is_empty());
    msgs.join(": ")
}

#[test]
fn stats_and_spy_work_bad_requests_are_refused_and_the_vm_runs_on() {
    let mut vm = Vm::start("bad", &["--guest", "spin", "--symbiotic"]);

    // The client: statistics as key=value lines and as JSON, the server's beside the VM's.
    let o = vm.sym(&["stats"]);
    assert_eq!(o.status, Some(0), "{}", o.stderr);
    assert!(
        field(&o.stdout, "rest.requests=", "rest.requests").is_some(),
        "{}",
        o.stdout
    );
    assert!(o.stdout.contains("kvm.vcpu0.exits="), "{}", o.stdout);
    let o = vm.sym(&["--json", "stats"]);
    let v: Value = serde_json::from_str(o.stdout.trim()).unwrap();
    assert!(counter(&v, "rest.requests") >= 2, "{v}");
    // SymSpy: spin registers nothing.
    let o = vm.sym(&["spy"]);
    assert_eq!(o.status, Some(0), "{}", o.stderr);
    assert!(o.stdout.contains("global=null"), "{}", o.stdout);
    assert!(!o.stdout.contains("vcpus."), "{}", o.stdout);
    let v = vm.answer("GET", "lucid.spy", "");
    assert_eq!(v["vcpus"], serde_json::json!([]), "{v}");

    // A body that is not JSON, an unknown endpoint, an unknown field, a vCPU it does not have,
    // a call it does not know, wrong methods: 400 or 404 with a message that says what to fix.
    let e = refusal(vm.request("PUT", "lucid.symcall", "{not json"), 400);
    assert!(e.contains("lucid.symcall: the body is not"), "{e}");
    let e = refusal(vm.request("PUT", "lucid.frobnicate", "{}"), 404);
    assert!(e.contains("no such endpoint"), "{e}");
    let e = refusal(
        vm.request("PUT", "lucid.symcall", r#"{"call":"echo","arg":[1]}"#),
        400,
    );
    assert!(e.contains("unknown field `arg`"), "{e}");
    let e = refusal(
        vm.request("PUT", "lucid.symcall", r#"{"vcpu":7,"call":"echo"}"#),
        400,
    );
    assert!(e.contains("no vCPU 7"), "{e}");
    let e = refusal(
        vm.request("PUT", "lucid.symcall", r#"{"call":"nope"}"#),
        400,
    );
    assert!(e.contains("no SymCall \"nope\""), "{e}");
    let e = refusal(vm.request("PUT", "lucid.module-unload", ""), 400);
    assert!(e.contains("lucid.module-unload: the body is not"), "{e}");
    let e = refusal(vm.request("GET", "lucid.symcall", ""), 400);
    assert!(e.contains("takes PUT"), "{e}");
    let e = refusal(vm.request("PUT", "lucid.spy", ""), 400);
    assert!(e.contains("takes GET"), "{e}");

    // Still there, and it counted all that.
    assert!(vm.running(), "{}", vm.stderr());
    let v = vm.answer("GET", "lucid.stats", "");
    assert!(counter(&v, "rest.errors") >= 8, "{v}");
    assert!(vm.stdout().contains("spin: looping forever"));

    // `stop` ends the VM cleanly and the socket file goes with it.
    let o = vm.sym(&["stop"]);
    assert_eq!(o.status, Some(0), "{}", o.stderr);
    assert_eq!(o.stdout, "stopping\n");
    let (status, stats) = vm.wait();
    assert_eq!(status, Some(0), "{}", vm.stderr());
    assert!(!vm.socket.exists(), "socket file left behind");
    assert!(counter(&stats, "kvm.vcpu0.exits") > 0, "{stats}");
}

#[test]
fn symbiotic_requests_without_symbiotic_are_refused_clearly() {
    let mut vm = Vm::start("nosym", &["--guest", "spin"]);
    for args in [
        &["call", "echo", "1", "2"][..],
        &["load", "/etc/hostname"],
        &["unload", "1"],
        &["modules"],
        &["spy"],
    ] {
        let o = vm.sym(args);
        assert_eq!(
            o.status,
            Some(lucid_vmm::EXIT_FAILURE),
            "{args:?}: {}",
            o.stdout
        );
        assert!(
            o.stderr.contains("runs without --symbiotic"),
            "{args:?}: {}",
            o.stderr
        );
    }
    let e = refusal(vm.request("GET", "lucid.modules", ""), 400);
    assert!(e.contains("runs without --symbiotic"), "{e}");
    let o = vm.sym(&["stats"]);
    assert_eq!(o.status, Some(0), "{}", o.stderr);
    assert_eq!(vm.sym(&["stop"]).status, Some(0));
    assert_eq!(vm.wait().0, Some(0), "{}", vm.stderr());
    assert!(!vm.socket.exists());
}

#[test]
fn a_live_socket_is_refused_a_stale_one_replaced_and_a_file_left_alone() {
    let mut a = Vm::start("live", &["--guest", "spin"]);
    // A second run on A's socket: refused before it runs anything.
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_lucid"));
    cmd.args(["run", "--guest", "hello", "--api-socket"])
        .arg(&a.socket);
    let o = run_cmd(cmd, LIMIT);
    assert_eq!(o.status, Some(lucid_vmm::EXIT_FAILURE), "{}", o.stderr);
    assert!(
        o.stderr.contains("another process is listening there"),
        "{}",
        o.stderr
    );
    assert!(
        !o.stdout.contains("hello"),
        "the second guest ran: {}",
        o.stdout
    );
    assert_eq!(a.sym(&["stats"]).status, Some(0), "A still serves");

    // A dies by SIGKILL: its socket file stays, stale; the next run replaces it.
    a.kill();
    assert!(a.socket.exists());
    let mut b = Vm::spawn("stale", &a.socket, &["--guest", "spin"]);
    assert!(b.wait_for_socket(), "{}", b.stderr());
    assert!(
        b.stderr().contains("replacing a stale socket"),
        "{}",
        b.stderr()
    );
    assert_eq!(b.sym(&["stats"]).status, Some(0));
    assert_eq!(b.sym(&["stop"]).status, Some(0));
    assert_eq!(b.wait().0, Some(0));
    assert!(!b.socket.exists());

    // Not a socket: refused, and the file is not touched.
    let file = tmp("not-a-socket");
    std::fs::write(&file, b"keep me").unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_lucid"));
    cmd.args(["run", "--guest", "hello", "--api-socket"])
        .arg(&file);
    let o = run_cmd(cmd, LIMIT);
    assert_eq!(o.status, Some(lucid_vmm::EXIT_FAILURE));
    assert!(o.stderr.contains("is not a socket"), "{}", o.stderr);
    assert_eq!(std::fs::read(&file).unwrap(), b"keep me");
    std::fs::remove_file(&file).unwrap();

    // And the client on a socket nobody serves.
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_lucid"));
    cmd.args(["sym", "--socket"])
        .arg(tmp("nobody.sock"))
        .arg("stats");
    let o = run_cmd(cmd, LIMIT);
    assert_eq!(o.status, Some(lucid_vmm::EXIT_FAILURE));
    assert!(o.stderr.contains("cannot connect"), "{}", o.stderr);
}

/// Waits until the guest registered its global SymSpy page with a SymCall entry (or a module
/// symbol table, `key`), or the VM ended; true when registered.
fn wait_for_registration(vm: &mut Vm, key: &str) -> bool {
    if !vm.wait_for_socket() {
        return false;
    }
    let start = Instant::now();
    while start.elapsed() < LIMIT && vm.running() {
        let Some((200, v)) = vm.try_request("GET", "lucid.spy", "") else {
            return false;
        };
        if v["global"]["guest"][key].as_u64().unwrap_or(0) != 0 {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    false
}

/// SymCalls through the API: the kit's echo, a call the guest has no handler for.
#[test]
fn symcall_echo_through_the_api() {
    // The guest registers, then runs its workload for `ms` while Lucid calls it.
    let mut vm = Vm::start_may_end(
        "call",
        &[
            "--guest",
            "sym-call",
            "--symbiotic",
            "--cmdline",
            "ms=15000",
        ],
    );
    assert!(
        wait_for_registration(&mut vm, "symcall_entry"),
        "sym-call registered no SymCall entry: {}",
        vm.stdout()
    );
    // Generous bounds: a busy host may leave the vCPU thread unscheduled for a while, which is
    // no fault of the call.
    let o = vm.sym(&["call", "--timeout-ms", "10000", "echo", "1", "2", "3"]);
    assert_eq!(o.status, Some(0), "{}", o.stderr);
    // The kit's echo: value0 = the sum of the arguments, value1 = the first.
    assert_eq!(field(&o.stdout, "status=", "status"), Some("0"));
    assert!(o.stdout.contains("value0=6 "), "{}", o.stdout);
    assert!(o.stdout.contains("value1=1 "), "{}", o.stdout);
    let v = vm.answer(
        "PUT",
        "lucid.symcall",
        r#"{"vcpu":0,"call":0,"args":[40,2],"timeout_ms":10000}"#,
    );
    assert_eq!(v["values"][0], 42, "{v}");
    // A call number the guest has no handler for: the guest's ENOSYS, not an API error.
    let v = vm.answer(
        "PUT",
        "lucid.symcall",
        r#"{"call":"0x7777","timeout_ms":10000}"#,
    );
    assert_eq!(v["status"], lucid_sym::abi::SYM_ENOSYS, "{v}");
    // A bound the API does not take (it serves one request at a time).
    let e = refusal(
        vm.request(
            "PUT",
            "lucid.symcall",
            r#"{"call":"echo","timeout_ms":60000}"#,
        ),
        400,
    );
    assert!(e.contains("timeout_ms"), "{e}");
    assert!(vm.running(), "{}", vm.stderr());
    let v = vm.answer("GET", "lucid.stats", "");
    assert_eq!(counter(&v, "rest.errors"), 1, "the refused bound: {v}");
    assert_eq!(vm.sym(&["stop"]).status, Some(0));
    vm.wait();
}

/// Modules through the API: load, list and unload built-in modules (one read-only), and bad
/// ones refused.
#[test]
fn module_load_list_unload_through_the_api() {
    // The guest polls its mailbox until stopped (`ms` 0, its default).
    let mut vm = Vm::start_may_end("mod", &["--guest", "sym-mod", "--symbiotic"]);
    assert!(
        wait_for_registration(&mut vm, "exports"),
        "sym-mod published no exports: {}",
        vm.stdout()
    );
    let o = vm.sym(&["--json", "load", "--builtin", "hello"]);
    assert_eq!(o.status, Some(0), "{}", o.stderr);
    let info: Value = serde_json::from_str(o.stdout.trim()).unwrap();
    let id = info["id"].as_u64().unwrap().to_string();
    let o = vm.sym(&["modules"]);
    assert!(o.stdout.contains("hello"), "{}", o.stdout);
    // Read-only: its code in a read-only memory slot the API's thread adds.
    let o = vm.sym(&["--json", "load", "--builtin", "counter", "--read-only"]);
    assert_eq!(o.status, Some(0), "{}", o.stderr);
    let ro: Value = serde_json::from_str(o.stdout.trim()).unwrap();
    assert_eq!(ro["read_only"], Value::Bool(true), "{ro}");
    let ro_id = ro["id"].as_u64().unwrap().to_string();
    for id in [&id, &ro_id] {
        assert_eq!(vm.sym(&["unload", id]).status, Some(0));
    }
    let o = vm.sym(&["modules"]);
    assert!(o.stdout.contains("no modules loaded"), "{}", o.stdout);
    // Not modules, or bad ones: refused with a reason, and the VM goes on.
    let o = vm.sym(&["load", "/etc/hostname"]);
    assert_eq!(o.status, Some(lucid_vmm::EXIT_FAILURE));
    assert!(o.stderr.contains("module_load:"), "{}", o.stderr);
    let o = vm.sym(&["load", "--builtin", "badrel"]);
    assert_eq!(o.status, Some(lucid_vmm::EXIT_FAILURE));
    assert!(o.stderr.contains("relocation"), "{}", o.stderr);
    let o = vm.sym(&["unload", "999"]);
    assert_eq!(o.status, Some(lucid_vmm::EXIT_FAILURE));
    assert!(vm.running());
    assert_eq!(vm.sym(&["stop"]).status, Some(0));
    vm.wait();
}
