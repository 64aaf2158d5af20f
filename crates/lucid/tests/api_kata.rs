//! Kata Containers' Cloud Hypervisor driver, replayed: the requests, with their bodies, that
//! Kata's runtime sends to start a pod, hot-add a container's block rootfs, remove it and stop
//! the pod, sent by curl over the Unix socket to `lucid run --api-socket` on real KVM, each
//! answer checked against what Cloud Hypervisor answers.
//!
//! Written from kata-containers/kata-containers at 7c6ba40c54ea29b459b4997cff948caaba4e658b,
//! `src/runtime/virtcontainers/clh.go` and its generated client
//! (`pkg/cloud-hypervisor/client`, whose `New*Config` constructors fill in defaults and whose
//! `MarshalJSON` drops unset fields), for the default `configuration-clh.toml` (`Makefile`:
//! 1 vCPU, `default_maxvcpus = 0` = the host's CPUs, 2048 MiB, `default_maxmemory = 0` = the
//! host's RAM, `shared_fs = "virtio-fs"`, `entropy_source = "/dev/urandom"`, an ext4 guest
//! image, debug off, no IOMMU, not a confidential guest). In order:
//!
//! 1. `GET vmm.ping` (`launchClh` → `waitVMM` → `isClhRunning`, polled until it answers).
//! 2. `PUT vm.create` with [`kata_vm_config`] (`bootVM`; the body is built by `CreateVM`,
//!    `AddDevice` → `addVSock` and `addVolume`, and `getNonUserDefinedKernelParams` plus the
//!    systemd parameters of `katautils/create.go` for the cmdline).
//! 3. `GET vm.info`, state `Created` (`bootVM`).
//! 4. `PUT vm.add-net` with [`kata_net_config`] and the tap's fds as SCM_RIGHTS (`bootVM` →
//!    `vmAddNetPutRequest`; the body from `addNet`).
//! 5. `PUT vm.boot`, then `GET vm.info`, state `Running` (`bootVM`).
//! 6. `PUT vm.add-disk` with [`kata_rootfs_disk`] (`HotplugAddDevice` →
//!    `hotplugAddBlockDevice`, for a container whose rootfs is a block device, as a
//!    devicemapper or blockfile snapshotter gives); Kata turns the answer's `bdf` into the
//!    guest's PCI path (`clhPciInfoToPath`, checked here) and keeps its `id`.
//! 7. `GET vm.info` for `memory_actual_size` (`GetTotalMemoryMB`) and `GET vmm.ping` (`Check`,
//!    the runtime's monitor).
//! 8. `PUT vm.remove-device` with that `id` (`HotplugRemoveDevice`, when the container goes).
//! 9. `GET vmm.ping` then `PUT vmm.shutdown` (`StopVM` → `terminate`; Kata sends no
//!    `vm.shutdown`), and Kata waits for the process to exit.
//!
//! Where Kata's body asks for what Lucid lacks, Lucid refuses it with 400 naming the field,
//! and the replay goes on with the body changed as [`KATA_REFUSALS`] documents (what a Kata
//! deployment would have to change, and where nothing in its configuration can). Not
//! replayed: `vm.resize` (sent only when containers carry CPU or memory limits, to add vCPUs
//! or RAM, which Lucid cannot), VFIO `vm.add-device`, snapshot/restore of VM templates,
//! confidential guests.
//!
//! Kata's kernel and guest image are not on this machine: the kernel is the built-in probe
//! guest `hotplug` (written by `lucid guests --write`), which acknowledges hot-added devices
//! and ejects removed ones, and the guest image and the container's rootfs are temporary
//! files. Cloud Hypervisor's answers are from cloud-hypervisor/cloud-hypervisor at
//! ae44c2971c83dd2b1bd704fa81102ec0dec4e7d4, `vmm/src/api/http/http_endpoint.rs` and
//! `vmm/src/api/openapi/cloud-hypervisor.yaml`: 200 with a body for `vmm.ping`, `vm.info` and
//! a hot-plug to a booted VM (`PciDeviceInfo`: `id`, `bdf`); 204 with none for `vm.create`,
//! `vm.boot`, `vm.remove-device`, and for `vm.add-net` before boot; 200 with none for
//! `vmm.shutdown`.

mod common;
mod rest_client;

use std::path::Path;

use common::tmp;
use rest_client::{eventually, has_open, have_curl, Server};
use serde_json::{json, Value};

/// Kata's sandbox id: it names the sockets under `/run/vc/vm/` (`utils.BuildSocketPath`).
const SANDBOX: &str = "kata-replay";

/// Kata's `VmConfig` for the default pod (`clh.go`, `CreateVM`), with the kernel and the guest
/// image at `kernel` and `image` (`/opt/kata/share/kata-containers/vmlinux.container` and
/// `kata-containers.img` on a Kata host), on a host with `cpus` CPUs and `ram_mib` of RAM.
fn kata_vm_config(kernel: &Path, image: &Path, cpus: u64, ram_mib: u64) -> Value {
    json!({
        "payload": {
            "kernel": kernel,
            // GetKernelRootParams (ext4 on virtio-blk), clhKernelParams, "quiet" (no debug),
            // then the systemd parameters katautils adds for an image.
            "cmdline": "root=/dev/vda1 rootflags=data=ordered,errors=remount-ro ro \
                        rootfstype=ext4 panic=1 no_timer_check noreplace-smp quiet \
                        systemd.unit=kata-containers.target \
                        systemd.mask=systemd-networkd.service \
                        systemd.mask=systemd-networkd.socket",
        },
        // NewPlatformConfig, SetNumPciSegments(2): virtio-fs goes on segment 1.
        "platform": {"num_pci_segments": 2, "tdx": false, "sev_snp": false},
        // NewMemoryConfig(default_memory); shared for virtio-fs' vhost-user daemon;
        // hotplug_size = default_maxmemory, which 0 makes the host's RAM.
        "memory": {
            "size": 2048u64 << 20,
            "hotplug_size": ram_mib << 20,
            "mergeable": false,
            "hotplug_method": "Acpi",
            "shared": true,
            "hugepages": false,
            "prefault": false,
            "thp": true,
        },
        // NewCpusConfig(default_vcpus, default_maxvcpus), topology cores_per_die = max.
        "cpus": {
            "boot_vcpus": 1,
            "max_vcpus": cpus,
            "topology": {"threads_per_core": 1, "cores_per_die": cpus,
                         "dies_per_package": 1, "packages": 1},
            "kvm_hyperv": false,
            "nested": true,
        },
        "rng": {"src": "/dev/urandom", "iommu": false},
        // The guest image, read-only (an ImageAsset).
        "disks": [{
            "path": image,
            "readonly": true,
            "direct": false,
            "iommu": false,
            "num_queues": 1,
            "queue_size": 128,
            "vhost_user": false,
            "backing_files": false,
            "sparse": true,
            "image_type": "Raw",
        }],
        // Serial and console Off without debug (Tty serial with enable_debug).
        "serial": {"mode": "Off", "iommu": false},
        "console": {"mode": "Off", "iommu": false},
        // addVSock: the agent's hybrid vsock, cid 3.
        // (Kata's is /run/vc/vm/<sandbox>/clh.sock; a directory of the test's here.)
        "vsock": {"cid": 3, "socket": tmp("kata-clh.sock"), "iommu": false},
        // addVolume: the shared directory over virtio-fs, on PCI segment 1.
        "fs": [{
            "tag": "kataShared",
            "socket": format!("/run/vc/vm/{SANDBOX}/virtiofsd.sock"),
            "num_queues": 1,
            "queue_size": 1024,
            "pci_segment": 1,
        }],
        "iommu": false,
        "watchdog": false,
        "pvpanic": false,
        "landlock_enable": false,
    })
}

/// Kata's `NetConfig` for the pod's interface (`addNet`): a MAC, no tap name (the tap's fds
/// travel with the request).
fn kata_net_config() -> Value {
    json!({
        "mac": "02:42:ac:11:00:02",
        "ip": "192.168.249.1",
        "mask": "255.255.255.0",
        "iommu": false,
        "num_queues": 2,
        "queue_size": 256,
        "vhost_user": false,
        "vhost_mode": "Client",
        "offload_tso": true,
        "offload_ufo": true,
        "offload_csum": true,
    })
}

/// Kata's `DiskConfig` for a container's block rootfs (`hotplugAddBlockDevice`): writable,
/// one queue per vCPU, 1024 entries.
fn kata_rootfs_disk(path: &Path) -> Value {
    json!({
        "path": path,
        "readonly": false,
        "direct": false,
        "iommu": false,
        "num_queues": 1,
        "queue_size": 1024,
        "vhost_user": false,
        "backing_files": false,
        "sparse": true,
        "image_type": "Raw",
    })
}

/// A field of Kata's `VmConfig` that Lucid refuses: the field the 400 names, how the replay
/// changes the body to go on, and what that means for a Kata deployment.
struct Refused {
    field: &'static str,
    change: fn(&mut Value),
    why: &'static str,
}

const KATA_REFUSALS: &[Refused] = &[
    Refused {
        field: "cpus.max_vcpus",
        change: |c| {
            set(c, "/cpus/max_vcpus", json!(1));
            set(c, "/cpus/topology/cores_per_die", json!(1));
        },
        why: "Lucid has no vCPU hotplug. Kata: default_maxvcpus = default_vcpus, which sends \
              max_vcpus 1 and a topology of one core (accepted: it is Lucid's own); \
              containers' CPU limits then cannot add vCPUs",
    },
    Refused {
        field: "memory.hotplug_size",
        change: |c| remove(c, "/memory/hotplug_size"),
        why: "Lucid has no memory hotplug. Kata sends it for every guest that is not \
              confidential; no setting removes it, and containers' memory limits cannot grow \
              the guest",
    },
    Refused {
        field: "platform.num_pci_segments",
        change: |c| remove(c, "/platform/num_pci_segments"),
        why: "Lucid has one PCI segment. Kata always asks for 2 (virtio-fs on segment 1); no \
              setting changes it",
    },
    Refused {
        field: "fs[0].pci_segment",
        change: |c| {
            remove(c, "/fs");
            set(c, "/memory/shared", json!(false));
        },
        why: "Lucid has one PCI segment and Kata puts virtio-fs on segment 1 (on segment 0 \
              Lucid's virtio-fs serves it from virtiofsd). Kata: shared_fs = \"none\", which \
              also sends memory.shared false; containers' rootfs must then be block devices \
              (devicemapper or blockfile snapshotter), the vm.add-disk below",
    },
];

fn set(v: &mut Value, pointer: &str, to: Value) {
    match v.pointer_mut(pointer) {
        Some(x) => *x = to,
        None => panic!("{pointer} not in the body"),
    }
}

fn remove(v: &mut Value, pointer: &str) {
    let (parent, key) = pointer.rsplit_once('/').unwrap();
    let removed = v
        .pointer_mut(parent)
        .and_then(Value::as_object_mut)
        .and_then(|o| o.remove(key));
    assert!(removed.is_some(), "{pointer} not in {v}");
}

/// The one message of a Cloud Hypervisor-shaped error body (a JSON array of messages).
fn message(body: &str) -> String {
    let v: Value =
        serde_json::from_str(body).unwrap_or_else(|e| panic!("not JSON ({e}): {body:?}"));
    v[0].as_str()
        .unwrap_or_else(|| panic!("not an array of messages: {body}"))
        .to_string()
}

/// Kata's `clhPciInfoToPath`: "0000:00:SS.0" with a two-digit slot, else Kata fails the
/// hotplug.
fn kata_pci_path(bdf: &str) -> Option<u8> {
    let t: Vec<&str> = bdf.split(':').collect();
    if t.len() != 3 || t[0] != "0000" || t[1] != "00" {
        return None;
    }
    let (slot, func) = t[2].split_once('.')?;
    if func != "0" || slot.len() != 2 {
        return None;
    }
    u8::from_str_radix(slot, 16).ok()
}

fn host_ram_mib() -> u64 {
    let info = std::fs::read_to_string("/proc/meminfo").unwrap();
    let kib: u64 = info
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|l| l.split_whitespace().next()?.parse().ok())
        .unwrap();
    kib >> 10
}

#[test]
fn kata_pod_start_replayed() {
    if !have_curl() {
        return lucid_guests::skip_or_fail("curl is not installed (apt-get install curl)");
    }
    let dir = rest_client::written_guests("kata-guests");
    let image = tmp("kata-containers.img");
    std::fs::File::create(&image)
        .unwrap()
        .set_len(8 << 20)
        .unwrap();
    let rootfs = tmp("kata-rootfs.img");
    std::fs::File::create(&rootfs)
        .unwrap()
        .set_len(8 << 20)
        .unwrap();
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get() as u64);

    let mut s = Server::start("kata");
    // 1. Kata polls vmm.ping until the VMM answers.
    let ping = s.json("GET", "vmm.ping");
    assert!(ping["version"].is_string(), "{ping}");
    assert_eq!(ping["pid"], s.pid(), "{ping}");

    // 2. vm.create with Kata's body: each field Lucid lacks is refused by name, in turn.
    let mut config = kata_vm_config(&dir.join("hotplug.elf"), &image, cpus, host_ram_mib());
    let mut pending: Vec<&Refused> = KATA_REFUSALS
        .iter()
        // On a 1-CPU host Kata's max_vcpus is already 1.
        .filter(|r| cpus > 1 || r.field != "cpus.max_vcpus")
        .collect();
    while !pending.is_empty() {
        let (code, body) = s.curl("PUT", "vm.create", Some(&config));
        let fields: Vec<&str> = pending.iter().map(|r| r.field).collect();
        assert_eq!(code, 400, "Kata's body with {fields:?} unchanged: {body}");
        let msg = message(&body);
        let i = pending
            .iter()
            .position(|r| msg.starts_with(&format!("vm.create: {}: ", r.field)))
            .unwrap_or_else(|| panic!("an unexpected refusal: {msg}"));
        let r = pending.remove(i);
        eprintln!("refused {}: {msg}\n  so: {}", r.field, r.why);
        (r.change)(&mut config);
    }
    let (code, body) = s.curl("PUT", "vm.create", Some(&config));
    assert_eq!((code, body.as_str()), (204, ""), "the changed body");

    // 3. vm.info: Created, the configuration as sent.
    let info = s.json("GET", "vm.info");
    assert_eq!(info["state"], "Created", "{info}");
    assert_eq!(info["config"], config, "{info}");

    // 4. vm.add-net: Cloud Hypervisor takes the tap's fds from SCM_RIGHTS (204 before boot);
    // Lucid reads no fds and needs a tap name, so the pod's network is refused by name.
    let (code, body) = s.curl("PUT", "vm.add-net", Some(&kata_net_config()));
    assert_eq!(code, 400, "{body}");
    assert!(message(&body).starts_with("vm.add-net: tap: "), "{body}");
    assert_eq!(s.json("GET", "vm.info")["config"]["net"], Value::Null);

    // 5. vm.boot, then vm.info: Running.
    let (code, body) = s.curl("PUT", "vm.boot", None);
    assert_eq!((code, body.as_str()), (204, ""));
    assert_eq!(s.state(), "Running");

    // 6. The container's rootfs: Kata's queue_size (1024) is refused by name (Lucid's
    // virtio-blk queues have 256 entries, and only Cloud Hypervisor's default 128 is accepted);
    // without it, 200 with the id and an address Kata can parse.
    let (code, body) = s.curl("PUT", "vm.add-disk", Some(&kata_rootfs_disk(&rootfs)));
    assert_eq!(code, 400, "{body}");
    assert!(
        message(&body).starts_with("vm.add-disk: queue_size: "),
        "{body}"
    );
    let mut disk = kata_rootfs_disk(&rootfs);
    remove(&mut disk, "/queue_size");
    let (code, body) = s.curl("PUT", "vm.add-disk", Some(&disk));
    assert_eq!(code, 200, "{body}");
    let added: Value = serde_json::from_str(&body).unwrap();
    let id = added["id"].as_str().expect("an id").to_string();
    assert!(!id.is_empty());
    let bdf = added["bdf"].as_str().expect("a bdf").to_string();
    assert!(kata_pci_path(&bdf).is_some(), "Kata cannot parse {bdf}");
    assert_eq!(
        added.as_object().unwrap().len(),
        2,
        "PciDeviceInfo: {added}"
    );
    assert!(has_open(s.pid(), &rootfs));

    // 7. vm.info as Kata reads it: Running, 2048 MiB, the disk in the config and the tree.
    let info = s.json("GET", "vm.info");
    assert_eq!(info["state"], "Running", "{info}");
    assert_eq!(info["memory_actual_size"], 2048u64 << 20, "{info}");
    let disks = info["config"]["disks"].as_array().unwrap();
    assert_eq!(disks.len(), 2, "{info}");
    assert_eq!(disks[1]["id"], id.as_str(), "{info}");
    assert_eq!(disks[1]["path"], json!(rootfs), "{info}");
    assert_eq!(info["device_tree"][&id]["pci_bdf"], bdf.as_str(), "{info}");
    assert!(s.json("GET", "vmm.ping")["version"].is_string());

    // 8. The container goes: the guest ejects the disk and Lucid closes the image.
    let (code, body) = s.curl("PUT", "vm.remove-device", Some(&json!({"id": id})));
    assert_eq!((code, body.as_str()), (204, ""));
    assert!(
        eventually(|| !has_open(s.pid(), &rootfs)),
        "the rootfs stayed open after the eject"
    );
    assert_eq!(s.json("GET", "vm.counters")["hotplug"]["ejected"], 1);

    // 9. StopVM: ping, vmm.shutdown (200, no body), and the process exits.
    assert!(s.json("GET", "vmm.ping")["version"].is_string());
    let (code, body) = s.curl("PUT", "vmm.shutdown", None);
    assert_eq!((code, body.as_str()), (200, ""));
    assert_eq!(s.wait(), Some(0), "{}", s.stderr());
}
