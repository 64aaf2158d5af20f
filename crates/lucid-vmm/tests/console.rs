//! The serial console on real KVM with a reader that never reads: the guest still finishes, and
//! the bytes that found no room are counted.

use lucid_vmm::{KernelSource, SerialOutput, StopReason, Vm, VmConfig};

/// The `hello` guest prints 2,500 lines (77,500 bytes) into a FIFO shrunk to one page whose
/// reader never reads: more than the FIFO and Lucid's console buffer hold together.
#[test]
fn a_guest_printing_into_a_fifo_nobody_reads_finishes() {
    let path = std::env::temp_dir().join(format!("lucid-console-fifo-{}", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: mkfifo and open on a valid C string; fcntl on the fd just opened.
    let reader = unsafe {
        assert_eq!(libc::mkfifo(c.as_ptr(), 0o600), 0);
        let fd = libc::open(c.as_ptr(), libc::O_RDONLY | libc::O_NONBLOCK);
        assert!(fd >= 0);
        assert!(libc::fcntl(fd, libc::F_SETPIPE_SZ, 4096) >= 4096);
        fd
    };
    let mut config = VmConfig::new(KernelSource::Builtin {
        name: "hello".into(),
        bytes: lucid_guests::get("hello").expect("built-in guest"),
    });
    config.payload.cmdline = "lines=2500 code=3".into();
    config.devices.serial = SerialOutput::File(path.clone());
    let report = Vm::run(config).unwrap();
    assert_eq!(report.stop, StopReason::DebugExit(3));
    let c = &report.counters;
    let printed = c["serial.tx_bytes"];
    assert!(printed >= 2500 * 31, "{printed}");
    let (written, dropped, unwritten) = (
        c["serial.tx_written"],
        c["serial.tx_dropped"],
        c["serial.tx_unwritten"],
    );
    assert!(written <= 4096, "{c:?}");
    assert!(dropped > 0);
    assert_eq!(written + dropped + unwritten, printed);
    assert!(report.summary().contains("bytes of guest output dropped"));
    // SAFETY: closing the fd opened above.
    unsafe { libc::close(reader) };
    std::fs::remove_file(path).unwrap();
}
