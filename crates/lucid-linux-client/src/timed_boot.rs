//! Runs `lucid run` and reads the guest's console line by line, with the time each line arrived.
//! Shared by `lucid-linux-client` and the Linux tests (`crates/lucid/tests/linux.rs`, which
//! include this file as a module).

use std::fs::File;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde_json::Value;

/// Console lines that end a boot early.
pub const FATAL: &[&str] = &["Kernel panic", "not syncing"];

/// A console line and when it arrived, in seconds since Lucid was started.
pub struct Line {
    pub t: f64,
    pub text: String,
}

/// A running `lucid run`, its console read line by line with times. Dropped unfinished (an
/// early return, a panic), it kills and reaps Lucid.
pub struct Boot {
    child: Child,
    lines: Vec<Line>,
    rx: mpsc::Receiver<Line>,
    stderr: Option<std::thread::JoinHandle<String>>,
    /// The `--stats-json` file, read at the end.
    stats: Option<PathBuf>,
    log: Option<File>,
}

impl Boot {
    /// Starts `lucid run ARGS --stats-json STATS`, inside the network namespace `netns` (an
    /// open `/var/run/netns` file) when given; `log` gets every console line with its time.
    pub fn start(
        lucid: &Path,
        args: &[String],
        netns: Option<&File>,
        stats: PathBuf,
        log: Option<&Path>,
    ) -> Result<Boot, String> {
        // Everything that can fail comes before the spawn, so no error leaves Lucid running.
        let log = match log {
            Some(p) => {
                let mut f = File::create(p).map_err(|e| format!("{}: {e}", p.display()))?;
                let _ = writeln!(f, "# lucid run {}", args.join(" "));
                Some(f)
            }
            None => None,
        };
        let mut cmd = Command::new(lucid);
        cmd.arg("run").args(args).arg("--stats-json").arg(&stats);
        if let Some(ns) = netns {
            let fd = ns.as_raw_fd();
            // SAFETY: the closure runs in the child between fork and exec and makes only the
            // async-signal-safe setns system call on a descriptor the child inherited.
            unsafe {
                cmd.pre_exec(move || {
                    if libc::setns(fd, libc::CLONE_NEWNET) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
        }
        Self::spawn(cmd, Some(stats), log)
    }

    /// Starts `lucid run --api-socket SOCKET` with no VM: the REST API creates one, and its
    /// console (`serial.mode` Tty) is read here; `log` as for [`Boot::start`].
    pub fn serve(lucid: &Path, socket: &Path, log: Option<&Path>) -> Result<Boot, String> {
        let log = match log {
            Some(p) => Some(File::create(p).map_err(|e| format!("{}: {e}", p.display()))?),
            None => None,
        };
        let mut cmd = Command::new(lucid);
        cmd.arg("run").arg("--api-socket").arg(socket);
        Self::spawn(cmd, None, log)
    }

    fn spawn(mut cmd: Command, stats: Option<PathBuf>, log: Option<File>) -> Result<Boot, String> {
        cmd.stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let start = Instant::now();
        let mut child = cmd
            .spawn()
            .map_err(|e| format!("spawn {:?}: {e}", cmd.get_program()))?;
        let (tx, rx) = mpsc::channel();
        let stdout = child.stdout.take().expect("piped");
        std::thread::spawn(move || {
            let mut r = BufReader::new(stdout);
            let mut buf = Vec::new();
            while let Ok(n) = r.read_until(b'\n', &mut buf) {
                if n == 0 {
                    break;
                }
                let text = String::from_utf8_lossy(&buf).trim_end().to_string();
                let t = start.elapsed().as_secs_f64();
                if tx.send(Line { t, text }).is_err() {
                    break;
                }
                buf.clear();
            }
        });
        let mut err = child.stderr.take().expect("piped");
        let stderr = std::thread::spawn(move || {
            let mut s = String::new();
            let _ = err.read_to_string(&mut s);
            s
        });
        Ok(Boot {
            child,
            lines: Vec::new(),
            rx,
            stderr: Some(stderr),
            stats,
            log,
        })
    }

    fn push(&mut self, l: Line) {
        if let Some(f) = &mut self.log {
            let _ = writeln!(f, "{:8.3} {}", l.t, l.text);
        }
        self.lines.push(l);
    }

    /// Lucid's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The console lines so far.
    pub fn lines(&self) -> &[Line] {
        &self.lines
    }

    /// Reads console lines until `done` holds, Lucid exits, a fatal line appears or `deadline`.
    pub fn wait_for(&mut self, deadline: Instant, done: impl Fn(&[Line]) -> bool) -> bool {
        loop {
            if done(&self.lines) {
                return true;
            }
            if self
                .lines
                .iter()
                .any(|l| FATAL.iter().any(|f| l.text.contains(f)))
            {
                return false;
            }
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            match self
                .rx
                .recv_timeout((deadline - now).min(Duration::from_millis(500)))
            {
                Ok(l) => self.push(l),
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => return done(&self.lines),
            }
        }
    }

    /// Stops Lucid with SIGTERM (if it still runs) and collects what is left.
    pub fn finish(mut self) -> (Option<i32>, String, Vec<Line>, Option<Value>) {
        if self.child.try_wait().ok().flatten().is_none() {
            // SAFETY: kill(2) on our own child, which has not been reaped.
            unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        }
        let deadline = Instant::now() + Duration::from_secs(20);
        let status = loop {
            if let Ok(Some(s)) = self.child.try_wait() {
                break Some(s);
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                break self.child.wait().ok();
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        while let Ok(l) = self.rx.recv_timeout(Duration::from_millis(200)) {
            self.push(l);
        }
        let stderr = self
            .stderr
            .take()
            .and_then(|h| h.join().ok())
            .unwrap_or_default();
        let stats = self.stats.as_ref().and_then(|p| {
            let v = std::fs::read_to_string(p)
                .ok()
                .and_then(|s| serde_json::from_str(&s).ok());
            let _ = std::fs::remove_file(p);
            v
        });
        let lines = std::mem::take(&mut self.lines);
        (status.and_then(|s| s.code()), stderr, lines, stats)
    }
}

impl Drop for Boot {
    /// A boot not finished (an early return or a panic between `start` and `finish`): kill
    /// Lucid and reap it, so no `lucid run` outlives its caller. After `finish` the child has
    /// been reaped and `try_wait` says so.
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
            if let Some(p) = &self.stats {
                let _ = std::fs::remove_file(p);
            }
        }
    }
}

/// A counter from Lucid's stats JSON (`--stats-json`) by dotted path (`blk0.irq.irqfd`): the
/// number, or a histogram's `total`; 0 when absent.
pub fn counter(stats: &Value, path: &str) -> u64 {
    let mut v = &stats["counters"];
    for part in path.split('.') {
        v = &v[part];
    }
    v.as_u64().or_else(|| v["total"].as_u64()).unwrap_or(0)
}

/// When the first line containing `needle` arrived.
pub fn first(lines: &[Line], needle: &str) -> Option<f64> {
    lines.iter().find(|l| l.text.contains(needle)).map(|l| l.t)
}
