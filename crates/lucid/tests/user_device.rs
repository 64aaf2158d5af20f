//! An assigned device on real KVM: QEMU's edu served by `lucid device-server edu` in a process of
//! its own and assigned to the guest over vfio-user (`--user-device`). The `edu` probe guest
//! passes against it with no IOMMU and behind the VT-d (samecore and sidecore, strict and
//! teardown strategies, interrupt remapping); the `iommu` isolation guest's DMAs outside the
//! mappings are refused by the device process and recorded by the unit; a device process killed
//! mid-run leaves a failed device, never a hung VMM. The virtio-blk probe guest reads and writes
//! its disk through `lucid device-server blk` (virtio-blk over PCI with MSI-X, in its own
//! process), with no IOMMU and behind the VT-d, every block checked. (Hostile servers:
//! `user_device_hostile.rs`; Linux mounting its root from the blk server: `linux.rs`.)

mod common;

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{disk, field, lucid_user_device, one_at_a_time, tmp, Outcome};

const LIMIT: Duration = Duration::from_secs(120);

/// The device server, killed when dropped.
struct Server {
    child: Child,
    socket: PathBuf,
    /// The blk server's disk, removed with the server.
    disk: Option<PathBuf>,
}

impl Server {
    fn start(tag: &str) -> Server {
        Server::spawn(tag, &["edu"])
    }

    /// `lucid device-server blk` on a new disk of `mib` MiB.
    fn blk(tag: &str, mib: u64) -> Server {
        let img = disk(tag, mib);
        let mut s = Server::spawn(tag, &["blk", "--disk", img.to_str().unwrap()]);
        s.disk = Some(img);
        s
    }

    /// `lucid device-server ARGS --socket S`.
    fn spawn(tag: &str, args: &[&str]) -> Server {
        let socket = tmp(&format!("{tag}.sock"));
        let _ = std::fs::remove_file(&socket);
        let child = Command::new(env!("CARGO_BIN_EXE_lucid"))
            .arg("device-server")
            .args(args)
            .arg("--socket")
            .arg(&socket)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let t0 = Instant::now();
        let s = socket.to_str().unwrap().to_string();
        while !std::fs::read_to_string("/proc/net/unix").is_ok_and(|t| t.contains(&s)) {
            assert!(t0.elapsed() < LIMIT, "the device server never listened");
            std::thread::sleep(Duration::from_millis(10));
        }
        Server {
            child,
            socket,
            disk: None,
        }
    }

    fn socket_opt(&self) -> String {
        format!("socket={},id=edu", self.socket.display())
    }

    fn socket_opt_named(&self, id: &str) -> String {
        format!("socket={},id={id}", self.socket.display())
    }

    /// The server's exit status and its last stdout line (it ends when its client goes).
    fn finish(mut self) -> (Option<i32>, String) {
        let t0 = Instant::now();
        let status = loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                break st.code();
            }
            assert!(
                t0.elapsed() < LIMIT,
                "the device server outlived its client"
            );
            std::thread::sleep(Duration::from_millis(20));
        };
        let mut out = String::new();
        use std::io::Read;
        if let Some(mut o) = self.child.stdout.take() {
            let _ = o.read_to_string(&mut out);
        }
        (status, out.lines().last().unwrap_or_default().to_string())
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.socket);
        if let Some(d) = &self.disk {
            let _ = std::fs::remove_file(d);
        }
    }
}

fn run_edu(server: &Server, extra: &[&str]) -> Outcome {
    lucid_user_device("edu", &server.socket_opt(), extra, LIMIT)
}

fn why(o: &Outcome) -> String {
    format!(
        "status {:?} timed_out {}\nstdout:\n{}\nstderr:\n{}",
        o.status, o.timed_out, o.stdout, o.stderr
    )
}

fn edu_checks_pass(o: &Outcome, what: &str) {
    let w = why(o);
    // The probe guests' exit code 0 reaches the host as 1 (isa-debug-exit: code << 1 | 1).
    assert_eq!(o.status, Some(1), "{what}: {w}");
    for check in ["liveness", "factorial", "dma", "irq", "dma_irq"] {
        assert_eq!(
            field(&o.stdout, "edu ident=", check),
            Some("ok"),
            "{what}: {w}"
        );
    }
}

fn server_summary(line: &str, key: &str) -> u64 {
    field(line, "lucid device-server ", key)
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {key}= in the server's last line: {line}"))
}

/// No IOMMU: all guest RAM is offered to the device (one DMA_MAP per RAM region), its MSI
/// reaches the guest through an irqfd, and the server ends cleanly when the VM does.
#[test]
fn the_edu_guest_passes_against_the_out_of_process_edu() {
    let server = Server::start("plain");
    let o = run_edu(&server, &["--cmdline", "rounds=20"]);
    edu_checks_pass(&o, "no iommu");
    let maps = o.counter("user_device.edu.dma_maps");
    assert!((1..=4).contains(&maps), "one per RAM region: {}", why(&o));
    assert_eq!(o.counter("user_device.edu.failed"), 0);
    assert!(o.counter("user_device.edu.msi_routes") >= 1, "{}", why(&o));
    let (status, last) = server.finish();
    assert_eq!(status, Some(0), "{last}");
    // 20 round trips of 4032 bytes each way, and the 64-byte DMA that ends in an interrupt.
    assert!(server_summary(&last, "bytes_read") >= 20 * 4032, "{last}");
    assert!(
        server_summary(&last, "bytes_written") >= 20 * 4032,
        "{last}"
    );
    assert_eq!(server_summary(&last, "refused"), 0, "{last}");
}

/// Behind the VT-d the device holds exactly what the guest's tables map: every guest map
/// becomes a DMA_MAP and every unmap a DMA_UNMAP before the invalidation completes; the guest's
/// device-to-RAM buffers are write-only mappings. No fault in any mode or strategy, and the
/// MSI goes through interrupt remapping.
#[test]
fn the_edu_guest_passes_through_the_vtd() {
    let _turn = one_at_a_time();
    for mode in ["samecore", "sidecore"] {
        for strategy in ["strict", "teardown256"] {
            let server = Server::start(&format!("{mode}-{strategy}"));
            let iommu = format!("vtd,mode={mode},pin=map");
            let cmdline = format!("iommu=vtd irq_remap=1 strategy={strategy} rounds=20");
            let o = run_edu(&server, &["--iommu", &iommu, "--cmdline", &cmdline]);
            let what = format!("{mode} {strategy}");
            edu_checks_pass(&o, &what);
            let w = why(&o);
            assert_eq!(o.counter("iommu.faults.dma"), 0, "{what}: {w}");
            assert_eq!(o.counter("user_device.edu.faults"), 0, "{what}: {w}");
            let guest_maps = o.counter("iommu.guest.maps");
            let maps = o.counter("user_device.edu.dma_maps");
            assert!(guest_maps >= 41, "{what}: {w}");
            if strategy == "strict" {
                // The identity maps while translation was off, then one per guest map.
                assert!(maps >= guest_maps, "{what}: {w}");
                assert!(
                    o.counter("user_device.edu.dma_unmaps") >= guest_maps,
                    "{what}: {w}"
                );
            } else {
                // Teardown reuses mappings: far fewer messages than guest maps.
                assert!(maps < guest_maps, "{what}: {w}");
            }
            let (status, last) = server.finish();
            assert_eq!(status, Some(0), "{what}: {last}");
            assert_eq!(server_summary(&last, "refused"), 0, "{what}: {last}");
        }
    }
}

/// The `iommu` guest aims the edu's DMA at an IOVA never mapped, one just unmapped, a
/// read-only mapping (written) and a write-only one (read): the device process refuses each
/// (no byte moved), Lucid replays it through the unit, which records it with its reason and
/// source id and raises the fault event; the guest finds its targets untouched.
#[test]
fn dma_outside_the_mappings_is_refused_by_the_device_and_recorded() {
    let _turn = one_at_a_time();
    for mode in ["samecore", "sidecore"] {
        let server = Server::start(&format!("iso-{mode}"));
        let iommu = format!("vtd,mode={mode},pin=map");
        let o = lucid_user_device("iommu", &server.socket_opt(), &["--iommu", &iommu], LIMIT);
        let w = why(&o);
        assert_eq!(o.status, Some(1), "{mode}: {w}");
        let num = |k: &str| -> u64 {
            field(&o.stdout, "iommu cases=", k)
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| panic!("no {k}= in: {w}"))
        };
        assert!(num("cases") >= 6, "{mode}: {w}");
        assert_eq!(num("passed"), num("cases"), "{mode}: {w}");
        assert!(num("blocked") >= 5, "{mode}: {w}");
        assert!(num("untouched") >= 3, "{mode}: {w}");
        assert!(o.counter("iommu.faults.dma") >= 4, "{mode}: {w}");
        assert!(o.counter("user_device.edu.faults") >= 4, "{mode}: {w}");
        let (_, last) = server.finish();
        assert!(server_summary(&last, "refused") >= 4, "{mode}: {last}");
    }
}

/// `kill -9` of the device process while the guest runs DMA round trips: the device is marked
/// failed (logged once, counted), the guest reads all ones and gives up on its own, and Lucid
/// ends the VM: no hang, no crash.
#[test]
fn a_killed_device_process_fails_the_device_not_the_vmm() {
    let server = Server::start("killed");
    let pid = server.child.id() as i32;
    let killer = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(1500));
        // SAFETY: kill(2) on the server's pid, which the test still owns (not yet waited for).
        unsafe { libc::kill(pid, libc::SIGKILL) };
    });
    let o = run_edu(&server, &["--cmdline", "rounds=100000000 timeout_ms=500"]);
    killer.join().unwrap();
    let w = why(&o);
    assert!(!o.timed_out, "{w}");
    assert_eq!(o.counter("user_device.edu.failed"), 1, "{w}");
    assert!(o.stderr.contains("edu"), "{w}");
    // The guest noticed: its DMA or interrupt checks failed.
    assert!(
        o.stdout.contains("BAD") || o.stdout.contains("timed out"),
        "{w}"
    );
    drop(server);
}

/// The virtio-blk probe guest against `lucid device-server blk`: random reads and writes at
/// QD8 with every block checked, its completions by MSI-X vector straight to KVM, with no IOMMU
/// and behind the VT-d (both modes, strict and teardown); under strict every buffer the guest
/// maps becomes a DMA_MAP and no fault is recorded.
#[test]
fn the_virtio_blk_guest_uses_the_out_of_process_blk_device() {
    let _turn = one_at_a_time();
    let setups: &[(&str, Option<(&str, &str)>)] = &[
        ("plain", None),
        ("strict", Some(("samecore", "strict"))),
        ("sidecore-teardown", Some(("sidecore", "teardown256"))),
    ];
    for (tag, iommu) in setups {
        let server = Server::blk(&format!("blk-{tag}"), 8);
        let dev = server.socket_opt_named("vblk");
        let mut cmdline = "op=rw verify=1 qd=8 count=2000".to_string();
        let mut extra = vec![];
        let spec;
        if let Some((mode, strategy)) = iommu {
            cmdline += &format!(" iommu=vtd strategy={strategy}");
            spec = format!("vtd,mode={mode},pin=map");
            extra.extend(["--iommu", spec.as_str()]);
        }
        extra.extend(["--cmdline", cmdline.as_str()]);
        let o = lucid_user_device("virtio-blk", &dev, &extra, LIMIT);
        let w = why(&o);
        assert_eq!(o.status, Some(1), "{tag}: {w}");
        let num = |k: &str| -> u64 {
            field(&o.stdout, "virtio-blk op=", k)
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| panic!("no {k}= in: {w}"))
        };
        assert_eq!(num("ops"), 2000, "{tag}: {w}");
        assert_eq!(num("mismatches"), 0, "{tag}: {w}");
        assert!(num("irqs") > 0, "{tag}: completions by MSI-X: {w}");
        assert_eq!(o.counter("user_device.vblk.failed"), 0, "{tag}: {w}");
        assert!(
            o.counter("user_device.vblk.msix_set_irqs") >= 1,
            "{tag}: {w}"
        );
        assert_eq!(o.counter_or_zero("iommu.faults.dma"), 0, "{tag}: {w}");
        if *tag == "strict" {
            assert!(
                o.counter("user_device.vblk.dma_maps") >= o.counter("iommu.guest.maps"),
                "{tag}: {w}"
            );
        }
        let (status, last) = server.finish();
        assert_eq!(status, Some(0), "{tag}: {last}");
        assert!(server_summary(&last, "requests") >= 2000, "{tag}: {last}");
        assert_eq!(server_summary(&last, "ioerr"), 0, "{tag}: {last}");
        assert_eq!(server_summary(&last, "refused"), 0, "{tag}: {last}");
    }
}
