//! `lucid run` with its console (stdout) on a pipe nobody reads: the guest finishes and Lucid
//! says how much output it dropped.

mod common;

use std::os::fd::{FromRawFd, OwnedFd};
use std::process::{Command, Stdio};
use std::time::Duration;

#[test]
fn stdout_on_a_pipe_nobody_reads_does_not_stall_the_guest() {
    let mut fds = [0; 2];
    // SAFETY: pipe2 fills two fds; fcntl on the read end just created.
    unsafe {
        assert_eq!(libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC), 0);
        assert!(libc::fcntl(fds[0], libc::F_SETPIPE_SZ, 4096) >= 4096);
    }
    // SAFETY: both fds were just created and are owned here only.
    let (reader, writer) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    let stats = common::tmp("console-stats.json");
    let mut child = Command::new(env!("CARGO_BIN_EXE_lucid"))
        .args([
            "run",
            "--guest",
            "hello",
            "--cmdline",
            "lines=2500",
            "--stats-json",
        ])
        .arg(&stats)
        .stdin(Stdio::null())
        .stdout(Stdio::from(writer))
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stderr = child.stderr.take().unwrap();
    let err = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = std::io::Read::read_to_string(&mut stderr, &mut s);
        s
    });
    let mut status = None;
    for _ in 0..1200 {
        if let Some(s) = child.try_wait().unwrap() {
            status = Some(s);
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let Some(status) = status else {
        let _ = child.kill();
        panic!("lucid stalled on a console nobody reads");
    };
    drop(reader);
    let err = err.join().unwrap();
    assert_eq!(status.code(), Some(1), "debug-exit 0: {err}");
    assert!(err.contains("bytes of guest output dropped"), "{err}");
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&stats).unwrap()).unwrap();
    assert!(json["counters"]["serial"]["tx_dropped"].as_u64().unwrap() > 0);
    let _ = std::fs::remove_file(stats);
}
