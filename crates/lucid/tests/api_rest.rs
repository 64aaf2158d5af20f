//! Cloud Hypervisor's REST API (`lucid run --api-socket PATH` with no payload, docs/api.md) on
//! real KVM: the lifecycle driven by curl (ping, create with the built-in `spin` guest, boot,
//! info, pause with the vCPU's exit counter still for 1 s, resume, counters, /metrics,
//! shutdown, delete, vmm.shutdown with exit status 0), and bad input sent raw (malformed JSON,
//! a wrong method, unknown paths and fields, a disk that is a directory, a body over the cap,
//! a stalled and a vanished client, 100 clients at once, a live socket) while a VM runs on
//! and the server keeps answering.

mod common;
mod rest_client;

use std::io::Write;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::tmp;
use rest_client::{eventually, has_open, have_curl, raw, read_response, Server, LIMIT};
use serde_json::{json, Value};

fn put(name: &str, body: &str) -> Vec<u8> {
    format!(
        "PUT /api/v1/{name} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

fn spin_config(serial: &Path) -> Value {
    json!({
        "payload": {"kernel": "builtin:spin"},
        "cpus": {"boot_vcpus": 1, "max_vcpus": 1},
        "memory": {"size": 64u64 << 20},
        "serial": {"mode": "File", "file": serial},
        "console": {"mode": "Off"},
    })
}

#[test]
fn lifecycle_through_curl() {
    if !have_curl() {
        return lucid_guests::skip_or_fail("curl is not installed (apt-get install curl)");
    }
    // A socket file a dead run left is replaced.
    let stale = tmp("life.sock");
    let _ = std::fs::remove_file(&stale);
    drop(UnixListener::bind(&stale).unwrap());
    let mut s = Server::start("life");
    let mode = std::fs::metadata(&s.socket).unwrap();
    assert_eq!(
        std::os::unix::fs::PermissionsExt::mode(&mode.permissions()) & 0o777,
        0o600
    );

    let ping = s.json("GET", "vmm.ping");
    assert_eq!(ping["pid"].as_u64(), Some(u64::from(s.pid())), "{ping}");
    assert!(
        ping["version"].is_string() && ping["features"].is_array(),
        "{ping}"
    );
    assert_eq!(s.curl("GET", "vm.info", None).0, 404, "no VM yet");
    assert_eq!(s.curl("PUT", "vm.boot", None).0, 404, "no VM to boot");

    let serial = tmp("life.serial");
    let config = spin_config(&serial);
    assert_eq!(
        s.curl("PUT", "vm.create", Some(&config)),
        (204, String::new())
    );
    assert_eq!(s.state(), "Created");
    assert_eq!(
        s.curl("PUT", "vm.create", Some(&config)).0,
        500,
        "created twice"
    );
    assert_eq!(s.curl("PUT", "vm.pause", None).0, 500, "pause before boot");
    assert_eq!(s.curl("PUT", "vm.boot", None), (204, String::new()));
    let info = s.json("GET", "vm.info");
    assert_eq!(info["state"], "Running", "{info}");
    assert_eq!(info["config"], config, "vm.info returns the config");
    assert_eq!(info["memory_actual_size"], 64u64 << 20);
    assert!(info["device_tree"]["serial"].is_object(), "{info}");
    assert_eq!(s.curl("PUT", "vm.boot", None).0, 500, "booted twice");

    let before = s.exits();
    assert!(s.exits_move(before), "the running vCPU's exits never moved");
    assert_eq!(s.curl("PUT", "vm.pause", None), (204, String::new()));
    assert_eq!(s.state(), "Paused");
    assert_eq!(s.curl("PUT", "vm.pause", None).0, 500, "paused twice");
    let paused = s.exits();
    std::thread::sleep(Duration::from_secs(1));
    assert_eq!(s.exits(), paused, "a paused vCPU exited");
    assert_eq!(s.curl("PUT", "vm.resume", None), (204, String::new()));
    assert_eq!(s.state(), "Running");
    assert_eq!(
        s.curl("PUT", "vm.resume", None).0,
        500,
        "resumed while running"
    );
    assert!(s.exits_move(paused), "the resumed vCPU's exits never moved");

    let counters = s.json("GET", "vm.counters");
    assert!(counters["vcpu0"].is_object(), "{counters}");
    let (code, metrics) = s.curl("GET", "/metrics", None);
    assert_eq!(code, 200);
    assert!(
        metrics.contains("# TYPE lucid_kvm_vcpu0_exits_total counter"),
        "{metrics}"
    );
    assert!(
        metrics.contains("# HELP lucid_rest_requests_total "),
        "{metrics}"
    );
    for line in metrics.lines().filter(|l| !l.starts_with('#')) {
        let (name, value) = line.split_once(' ').unwrap();
        assert!(
            name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
                && !name.starts_with(|c: char| c.is_ascii_digit()),
            "metric name {name:?}"
        );
        value.parse::<u64>().unwrap();
    }

    assert_eq!(s.curl("PUT", "vm.shutdown", None), (204, String::new()));
    assert_eq!(s.state(), "Shutdown");
    assert_eq!(s.curl("PUT", "vm.shutdown", None).0, 500, "shut down twice");
    assert_eq!(
        s.curl("PUT", "vm.pause", None).0,
        500,
        "pause after shutdown"
    );
    assert!(std::fs::read_to_string(&serial)
        .unwrap()
        .contains("spin: looping forever"));
    assert_eq!(s.curl("PUT", "vm.delete", None), (204, String::new()));
    assert_eq!(s.curl("GET", "vm.info", None).0, 404, "deleted");

    assert_eq!(s.curl("PUT", "vmm.shutdown", None).0, 200);
    assert_eq!(s.wait(), Some(0), "{}", s.stderr());
    assert!(!s.socket.exists(), "the socket file is removed at exit");
}

#[test]
fn bad_input_is_refused_and_the_vmm_keeps_serving() {
    let mut s = Server::start("bad");
    let sock = s.socket.clone();
    let serial = tmp("bad.serial");
    let config = spin_config(&serial).to_string();
    assert_eq!(raw(&sock, &put("vm.create", &config)).unwrap().0, 204);
    assert_eq!(raw(&sock, &put("vm.boot", "")).unwrap().0, 204);

    let refused = |req: &[u8], code: u16, says: &str| {
        let (c, body) = raw(&sock, req).expect("a response");
        assert_eq!(c, code, "{}: {body}", String::from_utf8_lossy(req));
        assert!(body.contains(says), "{body} should say {says:?}");
        let msgs: Vec<String> = serde_json::from_str(&body).expect("an array of messages");
        assert!(!msgs.is_empty());
    };
    // Malformed JSON, unknown and unsupported fields, impossible values: 400, checked
    // before the state (a VM exists).
    refused(&put("vm.create", "{\"payload\":"), 400, "not JSON");
    let with = |k: &str, v: Value| {
        let mut c: Value = serde_json::from_str(&config).unwrap();
        c[k] = v;
        put("vm.create", &c.to_string())
    };
    refused(&with("bogus", json!(1)), 400, "bogus: unknown field");
    refused(
        &with("rng", json!({"src": "/dev/hwrng"})),
        400,
        "rng.src: Lucid's virtio-rng reads the host's getrandom",
    );
    refused(
        &with("cpus", json!({"boot_vcpus": 0})),
        400,
        "cpus.boot_vcpus",
    );
    refused(
        &with("memory", json!({"size": 1u64 << 50})),
        400,
        "memory.size",
    );
    refused(
        &with("memory", json!({"size": 64u64 << 20, "hugepages": true})),
        400,
        "memory.hugepages",
    );
    refused(
        &with("disks", json!([{"path": std::env::temp_dir()}])),
        400,
        "is a directory",
    );
    // Wrong methods (Cloud Hypervisor answers 400), unknown paths, endpoints not built.
    refused(b"POST /api/v1/vm.info HTTP/1.1\r\n\r\n", 400, "takes GET");
    refused(b"GET /api/v1/vm.boot HTTP/1.1\r\n\r\n", 400, "takes PUT");
    refused(
        b"GET /api/v1/vm.nothing HTTP/1.1\r\n\r\n",
        404,
        "no such endpoint",
    );
    refused(b"GET /index.html HTTP/1.1\r\n\r\n", 404, "no such endpoint");
    refused(&put("vm.add-disk", "{}"), 400, "path: required");
    refused(&put("vm.add-pmem", "{}"), 501, "does not serve yet");
    // Not HTTP; a body over the cap (refused from its Content-Length).
    refused(b"\x01\x02 garbage\r\n\r\n", 400, "not an HTTP/1.1 request");
    refused(
        b"PUT /api/v1/vm.create HTTP/1.1\r\nContent-Length: 2000000\r\n\r\n",
        413,
        "at most",
    );
    refused(
        b"PUT /api/v1/vm.create HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n",
        400,
        "Content-Length",
    );

    // A client that stalls mid-request is answered 408 and closed after the server's
    // patience (5 s); one that vanishes mid-request costs nothing.
    let mut stalled = UnixStream::connect(&sock).unwrap();
    stalled.set_read_timeout(Some(LIMIT)).unwrap();
    stalled
        .write_all(b"PUT /api/v1/vm.create HTTP/1.1\r\nContent-Length: 100\r\n\r\n{")
        .unwrap();
    let (code, _) = read_response(&mut stalled).expect("a 408 before the close");
    assert_eq!(code, 408);
    let mut gone = UnixStream::connect(&sock).unwrap();
    gone.write_all(b"PUT /api/v1/vm.pause HTTP/1.1\r\nContent-Le")
        .unwrap();
    drop(gone);

    // 100 clients at once: each is answered (they wait in the listen backlog).
    let clients: Vec<_> = (0..100)
        .map(|_| {
            let sock = sock.clone();
            std::thread::spawn(move || {
                raw(&sock, b"GET /api/v1/vmm.ping HTTP/1.1\r\n\r\n").map(|r| r.0)
            })
        })
        .collect();
    for c in clients {
        assert_eq!(c.join().unwrap(), Some(200));
    }

    // A second VMM on the same live socket is refused; a VM flag without a payload too.
    let second = common::run_cmd(
        {
            let mut c = Command::new(env!("CARGO_BIN_EXE_lucid"));
            c.args(["run", "--api-socket"]).arg(&sock);
            c
        },
        LIMIT,
    );
    assert_eq!(second.status, Some(70), "{}", second.stderr);
    assert!(second.stderr.contains("another process is listening"));
    let flag = common::run_cmd(
        {
            let mut c = Command::new(env!("CARGO_BIN_EXE_lucid"));
            c.args(["run", "--memory", "512", "--api-socket"])
                .arg(tmp("flag.sock"));
            c
        },
        LIMIT,
    );
    assert_eq!(flag.status, Some(64), "{}", flag.stderr);
    assert!(flag.stderr.contains("--memory"), "{}", flag.stderr);

    // The VM ran on through all of it, and the server still answers.
    let (code, body) = raw(&sock, b"GET /api/v1/vm.info HTTP/1.1\r\n\r\n").unwrap();
    assert_eq!(code, 200);
    assert_eq!(
        serde_json::from_str::<Value>(&body).unwrap()["state"],
        "Running"
    );
    assert_eq!(raw(&sock, &put("vmm.shutdown", "")).unwrap().0, 200);
    assert_eq!(s.wait(), Some(0), "{}", s.stderr());
}

#[test]
fn sigterm_stops_the_vm_and_removes_the_socket() {
    let mut s = Server::start("term");
    let config = spin_config(&tmp("term.serial")).to_string();
    assert_eq!(raw(&s.socket, &put("vm.create", &config)).unwrap().0, 204);
    assert_eq!(raw(&s.socket, &put("vm.boot", "")).unwrap().0, 204);
    // SAFETY: kill on our own child's pid.
    assert_eq!(unsafe { libc::kill(s.pid() as i32, libc::SIGTERM) }, 0);
    assert_eq!(s.wait(), Some(128 + libc::SIGTERM), "{}", s.stderr());
    assert!(!s.socket.exists(), "the socket file is removed");
}

/// The bar with hotplug: a probe guest written by `lucid guests --write` (the
/// `hotplug` guest, which plays the OSPM's part of ACPI PCI hotplug), created, booted, paused,
/// resumed; `vm.add-disk` puts a virtio-blk in a slot the guest finds in configuration space;
/// `vm.remove-device` asks the guest to release it, the guest ejects it and Lucid closes the
/// image; the power button reaches the guest; counters and `/metrics` count it all. Before
/// boot, add-disk and remove-device edit the configuration (204).
#[test]
fn hotplug_through_the_api() {
    if !have_curl() {
        return lucid_guests::skip_or_fail("curl is not installed (apt-get install curl)");
    }
    let dir = rest_client::written_guests("hp-guests");
    let image = tmp("hp-disk.img");
    std::fs::write(&image, vec![0u8; 1 << 20]).unwrap();
    let mut s = Server::start("hp");
    let disk = json!({"path": image, "id": "data"});
    assert_eq!(s.curl("PUT", "vm.add-disk", Some(&disk)).0, 404, "no VM");

    let serial = tmp("hp.serial");
    let mut config = spin_config(&serial);
    config["payload"]["kernel"] = json!(dir.join("hotplug.elf"));
    assert_eq!(s.curl("PUT", "vm.create", Some(&config)).0, 204);
    // Before boot: the configuration changes.
    assert_eq!(s.curl("PUT", "vm.add-disk", Some(&disk)).0, 204);
    assert_eq!(s.json("GET", "vm.info")["config"]["disks"][0], disk);
    let gone = json!({"id": "data"});
    assert_eq!(s.curl("PUT", "vm.remove-device", Some(&gone)).0, 204);
    assert_eq!(s.json("GET", "vm.info")["config"]["disks"], json!([]));
    assert_eq!(s.curl("PUT", "vm.remove-device", Some(&gone)).0, 404);

    assert_eq!(s.curl("PUT", "vm.boot", None).0, 204);
    let console = || std::fs::read_to_string(&serial).unwrap_or_default();
    assert!(eventually(|| console().contains("hotplug: ready")));
    assert_eq!(s.curl("PUT", "vm.pause", None).0, 204);
    assert_eq!(s.state(), "Paused");
    assert_eq!(s.curl("PUT", "vm.resume", None).0, 204);
    assert_eq!(s.state(), "Running");

    let (code, body) = s.curl("PUT", "vm.add-disk", Some(&disk));
    assert_eq!(code, 200, "{body}");
    let added: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(added["id"], "data", "{added}");
    let bdf = added["bdf"].as_str().unwrap().to_string();
    let slot = u8::from_str_radix(&bdf[8..10], 16).unwrap();
    assert!(
        eventually(|| console().contains(&format!("hotplug: slot {slot} up 1af4:1042"))),
        "the guest never found the disk in slot {slot}: {}",
        console()
    );
    assert!(has_open(s.pid(), &image));
    let info = s.json("GET", "vm.info");
    assert_eq!(
        info["device_tree"]["data"]["pci_bdf"],
        bdf.as_str(),
        "{info}"
    );
    assert_eq!(info["config"]["disks"][0]["id"], "data", "{info}");
    assert_eq!(s.curl("PUT", "vm.add-disk", Some(&disk)).0, 409, "same id");
    let bad = json!({"path": image, "id": "x", "queue_size": 64});
    let (code, body) = s.curl("PUT", "vm.add-disk", Some(&bad));
    assert!(code == 400 && body.contains("queue_size"), "{code} {body}");

    assert_eq!(s.curl("PUT", "vm.remove-device", Some(&gone)).0, 204);
    assert!(
        eventually(|| console().contains(&format!("hotplug: slot {slot} ejected vendor=ffff"))),
        "the guest never ejected slot {slot}: {}",
        console()
    );
    assert!(
        eventually(|| !has_open(s.pid(), &image)),
        "the image stayed open after the eject"
    );
    let info = s.json("GET", "vm.info");
    assert!(info["device_tree"]["data"].is_null(), "{info}");
    assert_eq!(info["config"]["disks"], json!([]), "{info}");
    let unknown = json!({"id": "nope"});
    assert_eq!(s.curl("PUT", "vm.remove-device", Some(&unknown)).0, 404);

    assert_eq!(s.curl("PUT", "vm.power-button", None).0, 204);
    assert!(eventually(|| console().contains("hotplug: power button")));
    let c = s.json("GET", "vm.counters");
    for (k, v) in [
        ("added", 1),
        ("removal_requests", 1),
        ("ejected", 1),
        ("power_button", 1),
    ] {
        assert_eq!(c["hotplug"][k], v, "hotplug.{k}: {c}");
    }
    let (_, metrics) = s.curl("GET", "/metrics", None);
    assert!(metrics.contains("# TYPE "), "{metrics}");
    assert!(
        metrics.contains("lucid_hotplug_ejected_total 1"),
        "{metrics}"
    );

    assert_eq!(s.curl("PUT", "vm.shutdown", None).0, 204);
    assert_eq!(s.curl("PUT", "vm.power-button", None).0, 500, "not booted");
    assert_eq!(s.curl("PUT", "vmm.shutdown", None).0, 200);
    assert_eq!(s.wait(), Some(0), "{}", s.stderr());
}

/// `vm.reboot` boots the VM again from its configuration, with a disk hot-added before it;
/// `vm.resize` moves the balloon's target (`desired_ram`, `desired_balloon`) and refuses what
/// Lucid cannot do (more vCPUs, more RAM than at boot).
#[test]
fn reboot_and_resize() {
    if !have_curl() {
        return lucid_guests::skip_or_fail("curl is not installed (apt-get install curl)");
    }
    let mut s = Server::start("reboot");
    let serial = tmp("reboot.serial");
    let mut config = spin_config(&serial);
    config["balloon"] = json!({"size": 0});
    assert_eq!(s.curl("PUT", "vm.create", Some(&config)).0, 204);
    assert_eq!(s.curl("PUT", "vm.reboot", None).0, 500, "not booted");
    assert_eq!(s.curl("PUT", "vm.boot", None).0, 204);
    let image = tmp("reboot-disk.img");
    std::fs::write(&image, vec![0u8; 1 << 20]).unwrap();
    let disk = json!({"path": image, "id": "kept"});
    assert_eq!(s.curl("PUT", "vm.add-disk", Some(&disk)).0, 200);

    let target = |s: &Server| s.json("GET", "vm.counters")["balloon"]["target_pages"].as_u64();
    let resize = |body: Value| s.curl("PUT", "vm.resize", Some(&body));
    assert_eq!(resize(json!({"desired_ram": 48u64 << 20})).0, 204);
    assert_eq!(target(&s), Some(4096), "16 MiB in the balloon");
    assert_eq!(resize(json!({"desired_balloon": 8u64 << 20})).0, 204);
    assert_eq!(target(&s), Some(2048));
    let (code, body) = resize(json!({"desired_vcpus": 2}));
    assert!(
        code == 400 && body.contains("desired_vcpus"),
        "{code} {body}"
    );
    let (code, body) = resize(json!({"desired_ram": 128u64 << 20}));
    assert!(code == 400 && body.contains("desired_ram"), "{code} {body}");
    assert_eq!(resize(json!({"desired_cpus": 1})).0, 400, "unknown field");

    let before = s.exits();
    assert_eq!(s.curl("PUT", "vm.reboot", None), (204, String::new()));
    let info = s.json("GET", "vm.info");
    assert_eq!(info["state"], "Running", "{info}");
    assert!(info["device_tree"]["kept"].is_object(), "{info}");
    assert!(s.exits_move(0), "the rebooted vCPU never ran");
    assert!(s.exits() < before + 1_000_000, "counters are the new VM's");
    assert_eq!(s.curl("PUT", "vmm.shutdown", None).0, 200);
    assert_eq!(s.wait(), Some(0), "{}", s.stderr());
}

/// The processes' descriptors that are open on `/dev/net/tun`.
fn tun_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter(|p| p == Path::new("/dev/net/tun"))
        .count()
}

/// `vm.add-net` on a tap (in a network namespace this test makes): the `hotplug` guest finds a
/// virtio-net function (`1af4:1041`) in the slot; after `vm.remove-device` and the guest's
/// eject, Lucid has closed the tap. (Dropping the server kills Lucid before the namespace
/// goes.)
#[test]
fn hotplug_a_nic_on_a_tap() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return lucid_guests::skip_or_fail("the tap test needs root");
    }
    if !have_curl() {
        return lucid_guests::skip_or_fail("curl is not installed (apt-get install curl)");
    }
    let ns = common::TapNamespace::new("hp", "hp0", None);
    let s = Server::start_in("hpnet", &ns.exec());
    let serial = tmp("hpnet.serial");
    let mut config = spin_config(&serial);
    config["payload"]["kernel"] = json!("builtin:hotplug");
    assert_eq!(s.curl("PUT", "vm.create", Some(&config)).0, 204);
    assert_eq!(s.curl("PUT", "vm.boot", None).0, 204);
    let console = || std::fs::read_to_string(&serial).unwrap_or_default();
    assert!(eventually(|| console().contains("hotplug: ready")));
    // The server runs under `ip netns exec`, which execs lucid: the same pid.
    let pid = s.pid();
    assert_eq!(tun_fds(pid), 0);
    let nic = json!({"tap": "hp0", "id": "nic", "mac": "52:54:00:12:34:99"});
    let (code, body) = s.curl("PUT", "vm.add-net", Some(&nic));
    assert_eq!(code, 200, "{body}");
    let added: Value = serde_json::from_str(&body).unwrap();
    let slot = u8::from_str_radix(&added["bdf"].as_str().unwrap()[8..10], 16).unwrap();
    assert!(
        eventually(|| console().contains(&format!("hotplug: slot {slot} up 1af4:1041"))),
        "{}",
        console()
    );
    assert_eq!(tun_fds(pid), 1);
    assert_eq!(
        s.curl("PUT", "vm.remove-device", Some(&json!({"id": "nic"})))
            .0,
        204
    );
    assert!(
        eventually(|| tun_fds(pid) == 0),
        "the tap stayed open after the eject"
    );
    assert_eq!(s.curl("PUT", "vmm.shutdown", None).0, 200);
    drop(s);
    drop(ns);
}

/// A guest that resets itself is booted again, as Cloud Hypervisor does (the `hotplug` guest
/// with `reset=1` resets right after it starts, so it boots again and again); `vmm.shutdown`
/// ends it.
#[test]
fn a_guest_reset_boots_the_vm_again() {
    if !have_curl() {
        return lucid_guests::skip_or_fail("curl is not installed (apt-get install curl)");
    }
    let mut s = Server::start("reset");
    let mut config = spin_config(&tmp("reset.serial"));
    config["payload"] = json!({"kernel": "builtin:hotplug", "cmdline": "reset=1"});
    assert_eq!(s.curl("PUT", "vm.create", Some(&config)).0, 204);
    assert_eq!(s.curl("PUT", "vm.boot", None).0, 204);
    assert!(
        eventually(|| s.stderr().matches("the guest reset; booted again").count() >= 2),
        "{}",
        s.stderr()
    );
    assert_eq!(s.curl("PUT", "vmm.shutdown", None).0, 200);
    assert_eq!(s.wait(), Some(0), "{}", s.stderr());
}
