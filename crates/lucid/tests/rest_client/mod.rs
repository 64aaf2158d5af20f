//! A client of the REST API for the integration tests: `lucid run --api-socket` as a child
//! process, driven by curl and by raw requests on the Unix socket.

#![allow(dead_code)]

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::common::tmp;

/// How long any one wait may last.
pub const LIMIT: Duration = Duration::from_secs(30);

/// A `lucid run --api-socket` serving the REST API, killed if a test fails.
pub struct Server {
    pub child: Option<Child>,
    pub socket: PathBuf,
    pub err: PathBuf,
}

impl Server {
    pub fn start(tag: &str) -> Server {
        Self::start_in(tag, &[])
    }

    /// Starts it under `wrapper` (`ip netns exec NS`), when not empty.
    pub fn start_in(tag: &str, wrapper: &[&str]) -> Server {
        let socket = tmp(&format!("{tag}.sock"));
        let err = tmp(&format!("{tag}.err"));
        let lucid = env!("CARGO_BIN_EXE_lucid");
        let mut cmd = match wrapper.split_first() {
            Some((first, rest)) => {
                let mut c = Command::new(first);
                c.args(rest).arg(lucid);
                c
            }
            None => Command::new(lucid),
        };
        let child = cmd
            .args(["run", "--api-socket"])
            .arg(&socket)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&err).unwrap())
            .spawn()
            .unwrap();
        let mut s = Server {
            child: Some(child),
            socket,
            err,
        };
        let t = Instant::now();
        while raw(
            &s.socket,
            b"GET /api/v1/vmm.ping HTTP/1.1\r\nHost: x\r\n\r\n",
        )
        .is_none()
        {
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

    pub fn stderr(&self) -> String {
        std::fs::read_to_string(&self.err).unwrap_or_default()
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().unwrap().id()
    }

    /// Waits for the process to end by itself; its exit status.
    pub fn wait(&mut self) -> Option<i32> {
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

    /// `METHOD /api/v1/NAME` by curl, with `body` as JSON: (status, body).
    pub fn curl(&self, method: &str, name: &str, body: Option<&Value>) -> (u16, String) {
        let mut cmd = Command::new("curl");
        cmd.args(["-s", "-m", "20", "-X", method, "--unix-socket"])
            .arg(&self.socket)
            .args(["-w", "\n%{http_code}"]);
        if let Some(b) = body {
            cmd.args(["-H", "Content-Type: application/json", "-d", &b.to_string()]);
        }
        let path = match name {
            "/metrics" => name.to_string(),
            n => format!("/api/v1/{n}"),
        };
        let out = cmd.arg(format!("http://localhost{path}")).output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let (body, code) = text.rsplit_once('\n').expect("curl's status line");
        let code = code.trim().parse().unwrap_or_else(|_| {
            panic!(
                "curl {method} {name}: no status ({text:?}); lucid: {}",
                self.stderr()
            )
        });
        (code, body.to_string())
    }

    pub fn json(&self, method: &str, name: &str) -> Value {
        let (code, body) = self.curl(method, name, None);
        assert_eq!(code, 200, "{method} {name}: {body}");
        serde_json::from_str(&body).unwrap()
    }

    pub fn state(&self) -> String {
        self.json("GET", "vm.info")["state"]
            .as_str()
            .unwrap()
            .to_string()
    }

    /// KVM's count of vCPU 0's exits (host preemption included), from vm.counters.
    pub fn exits(&self) -> u64 {
        let c = self.json("GET", "vm.counters");
        c["kvm"]["vcpu0.exits"]
            .as_u64()
            .unwrap_or_else(|| panic!("no kvm/vcpu0.exits in vm.counters: {c}"))
    }

    /// Waits until the exit counter moves past `from`.
    pub fn exits_move(&self, from: u64) -> bool {
        let t = Instant::now();
        while t.elapsed() < LIMIT {
            if self.exits() > from {
                return true;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        false
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Sends `request` as is and reads the response to EOF (the server closes after one):
/// (status, body), or None when the connection failed or was closed with no response.
pub fn raw(socket: &Path, request: &[u8]) -> Option<(u16, String)> {
    let mut s = UnixStream::connect(socket).ok()?;
    s.set_read_timeout(Some(LIMIT)).unwrap();
    s.write_all(request).ok()?;
    read_response(&mut s)
}

pub fn read_response(s: &mut UnixStream) -> Option<(u16, String)> {
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    let text = String::from_utf8_lossy(&out).into_owned();
    let code = text.strip_prefix("HTTP/1.1 ")?.get(..3)?.parse().ok()?;
    let body = text.split_once("\r\n\r\n")?.1.to_string();
    Some((code, body))
}

pub fn have_curl() -> bool {
    Command::new("curl")
        .arg("--version")
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Polls `what` until it holds or [`LIMIT`] passes.
pub fn eventually(what: impl Fn() -> bool) -> bool {
    let t = Instant::now();
    while t.elapsed() < LIMIT {
        if what() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    false
}

/// Whether process `pid` has `path` open.
pub fn has_open(pid: u32, path: &Path) -> bool {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .any(|p| p == path)
}

/// The built-in guests written by `lucid guests --write` into a fresh directory `tmp(tag)`
/// (`DIR/NAME.elf`, booted by path as an API client would).
pub fn written_guests(tag: &str) -> PathBuf {
    let dir = tmp(tag);
    let _ = std::fs::remove_dir_all(&dir);
    let out = Command::new(env!("CARGO_BIN_EXE_lucid"))
        .args(["guests", "--write"])
        .arg(&dir)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    dir
}
