//! `lucid bench api`: the latency from `vm.create` to the guest's first serial output through
//! the REST API (`lucid run --api-socket S`, docs/api.md), in its pieces, beside the same
//! figure for the flags (`lucid run --guest NAME`, from process start).
//!
//! One API server runs every REST run in turn (`vm.delete` between them), as an orchestrator
//! keeps its VMM process: the process start is not in the REST figure (it is reported apart, as
//! `process_to_ping_ms`). The serial port writes into a FIFO this process holds open for
//! reading and writing, so the first byte wakes a `poll` here at once (a file would have to
//! be polled for its size) and the VM's closing it is no end of file.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use lucid_stats::median;
use serde_json::json;

use crate::http::{request, wait_for_ping};

/// How long any one step may take before the run is given up.
const LIMIT: Duration = Duration::from_secs(30);

#[derive(clap::Args)]
pub struct ApiArgs {
    /// One JSON object instead of text.
    #[arg(long)]
    json: bool,
    /// Runs of each path; medians are reported.
    #[arg(long, default_value_t = 10)]
    runs: usize,
    /// The built-in probe guest booted (it must print on the serial port at once).
    #[arg(long, default_value = "hello")]
    guest: String,
}

/// The API server process, stopped however the benchmark ends.
struct Server {
    child: Child,
    socket: PathBuf,
}

impl Drop for Server {
    fn drop(&mut self) {
        let shut = request(
            &self.socket,
            "PUT",
            "/api/v1/vmm.shutdown",
            None,
            Duration::from_secs(5),
        );
        let start = Instant::now();
        while shut.is_ok() && start.elapsed() < Duration::from_secs(5) {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A FIFO at `path`, opened for reading and writing without blocking.
fn fifo(path: &Path) -> Result<File, String> {
    let _ = std::fs::remove_file(path);
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes())
        .map_err(|_| format!("{}: a NUL in the path", path.display()))?;
    // SAFETY: mkfifo reads the NUL-terminated path, which outlives the call.
    if unsafe { libc::mkfifo(c.as_ptr(), 0o600) } != 0 {
        return Err(format!(
            "mkfifo {}: {}",
            path.display(),
            std::io::Error::last_os_error()
        ));
    }
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| format!("{}: {e}", path.display()))
}

/// Reads whatever `f` holds now.
fn drain(f: &File) {
    let mut b = [0u8; 4096];
    // SAFETY: read into a local buffer of its stated length from a valid descriptor.
    while unsafe { libc::read(f.as_raw_fd(), b.as_mut_ptr().cast(), b.len()) } > 0 {}
}

/// Waits until `f` has a byte to read; false after `limit`.
fn wait_readable(f: &File, limit: Duration) -> bool {
    let deadline = Instant::now() + limit;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return false;
        }
        let mut p = libc::pollfd {
            fd: f.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: poll on one valid descriptor in a local struct.
        let n = unsafe { libc::poll(&mut p, 1, left.as_millis().min(i32::MAX as u128) as i32) };
        if n > 0 && p.revents & libc::POLLIN != 0 {
            return true;
        }
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// One REST run's pieces, in ms: (create, boot, first output after boot, total).
fn rest_run(socket: &Path, serial: &File, body: &str) -> Result<[f64; 4], String> {
    let put = |what: &str, body: Option<&str>| -> Result<(), String> {
        let r = request(socket, "PUT", &format!("/api/v1/{what}"), body, LIMIT)
            .map_err(|e| lucid_vmm::error_chain(&e))?;
        match r.ok() {
            true => Ok(()),
            false => Err(format!("{what}: {} {}", r.status, r.text())),
        }
    };
    drain(serial);
    let t0 = Instant::now();
    put("vm.create", Some(body))?;
    let t1 = Instant::now();
    put("vm.boot", None)?;
    let t2 = Instant::now();
    let printed = wait_readable(serial, LIMIT);
    let t3 = Instant::now();
    put("vm.delete", None)?;
    if !printed {
        return Err(format!(
            "the guest printed nothing on its serial port within {} s",
            LIMIT.as_secs()
        ));
    }
    Ok([ms(t1 - t0), ms(t2 - t1), ms(t3 - t2), ms(t3 - t0)])
}

pub fn run(args: ApiArgs) -> Result<ExitCode, String> {
    let runs = args.runs.max(1);
    if lucid_guests::get(&args.guest).is_none() {
        return Err(format!(
            "no built-in guest {:?}; built-in guests: {}",
            args.guest,
            lucid_guests::NAMES.join(", ")
        ));
    }
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let dir = std::env::temp_dir().join(format!("lucid-bench-api-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let result = measure(&args, runs, &exe, &dir);
    let _ = std::fs::remove_dir_all(&dir);
    let result = result?;
    if args.json {
        println!("{result}");
    } else {
        let f = |k: &str| result[k].as_f64().unwrap_or(f64::NAN);
        println!(
            "lucid bench api: guest {}, median of {runs} runs",
            args.guest
        );
        println!(
            "  REST: vm.create to the first serial output {:8.2} ms   (fastest {:.2})",
            f("create_to_first_output_ms"),
            f("create_to_first_output_ms_min")
        );
        println!(
            "        (vm.create {:.2} ms, vm.boot {:.2} ms, boot to first output {:.2} ms)",
            f("create_ms"),
            f("boot_ms"),
            f("first_output_ms")
        );
        println!(
            "  flags: process start to the first output  {:8.2} ms   (fastest {:.2}; lucid run --guest {})",
            f("flags_to_first_output_ms"),
            f("flags_to_first_output_ms_min"),
            args.guest
        );
        println!(
            "  REST server: process start to vmm.ping    {:8.2} ms",
            f("process_to_ping_ms")
        );
    }
    Ok(ExitCode::SUCCESS)
}

fn measure(
    args: &ApiArgs,
    runs: usize,
    exe: &Path,
    dir: &Path,
) -> Result<serde_json::Value, String> {
    let socket = dir.join("api.sock");
    let serial_path = dir.join("serial.fifo");
    let serial = fifo(&serial_path)?;
    let err_path = dir.join("server.err");
    let err = File::create(&err_path).map_err(|e| format!("{}: {e}", err_path.display()))?;
    let start = Instant::now();
    let child = Command::new(exe)
        .args(["run", "--quiet", "--api-socket"])
        .arg(&socket)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(err)
        .spawn()
        .map_err(|e| format!("{}: {e}", exe.display()))?;
    let server = Server {
        child,
        socket: socket.clone(),
    };
    let server_err = || std::fs::read_to_string(&err_path).unwrap_or_default();
    wait_for_ping(&socket, LIMIT).map_err(|e| {
        format!(
            "{}; its stderr: {}",
            lucid_vmm::error_chain(&e),
            server_err()
        )
    })?;
    let to_ping = ms(start.elapsed());
    // The flags' VM: 256 MiB (the flags' default, not Cloud Hypervisor's 512), one vCPU.
    let body = json!({
        "payload": {"kernel": format!("builtin:{}", args.guest)},
        "memory": {"size": 256u64 << 20},
        "serial": {"mode": "File", "file": serial_path},
    })
    .to_string();
    let mut pieces: [Vec<f64>; 4] = Default::default();
    let mut flags = Vec::new();
    // Interleaved, so that drift in the machine's load hits both paths alike.
    for _ in 0..runs {
        let r = rest_run(&socket, &serial, &body)
            .map_err(|e| format!("{e}; the server's stderr: {}", server_err()))?;
        for (p, v) in pieces.iter_mut().zip(r) {
            p.push(v);
        }
        let mut c = Command::new(exe);
        c.args(["run", "--quiet", "--guest", &args.guest])
            .stdin(Stdio::null())
            .stderr(Stdio::null());
        flags.push(crate::time_to_first_byte(c)?);
    }
    drop(server);
    let totals = pieces[3].clone();
    let min = |v: &[f64]| v.iter().copied().fold(f64::INFINITY, f64::min);
    let (total_min, flags_min) = (min(&totals), min(&flags));
    let [create, boot, first, total] = pieces.map(|mut v| median(&mut v).expect("runs >= 1"));
    let flags_ms = median(&mut flags).expect("runs >= 1");
    Ok(json!({
        "guest": args.guest,
        "runs": runs,
        "create_to_first_output_ms": total,
        "create_ms": create,
        "boot_ms": boot,
        "first_output_ms": first,
        "flags_to_first_output_ms": flags_ms,
        "rest_over_flags": total / flags_ms,
        // The least of the runs: what an idle machine approaches.
        "create_to_first_output_ms_min": total_min,
        "flags_to_first_output_ms_min": flags_min,
        "process_to_ping_ms": to_ping,
        "create_to_first_output_ms_runs": totals,
    }))
}
