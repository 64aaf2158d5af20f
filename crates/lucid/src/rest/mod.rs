//! The Cloud Hypervisor REST API (docs/api.md): `lucid run --api-socket PATH` serves HTTP/1.1
//! on the Unix socket, with no payload waiting for `vm.create` as Cloud Hypervisor does, with
//! one beside the VM the flags booted ([`RestServer::adopt`]).
//!
//! Requests are parsed by `httparse`; this module frames them (Content-Length only), caps
//! them ([`MAX_HEAD`], [`MAX_BODY`]) and times them out ([`REQUEST_PATIENCE`]). The calling
//! thread serves one connection at a time and closes it after one response
//! (`Connection: close`), so a client that stalls holds the others for at most
//! [`REQUEST_PATIENCE`]. That thread also builds, starts and stops the VM, so it is not
//! confined by seccomp (the VM's own threads are).

pub mod config;
mod ext;

use std::collections::BTreeMap;
use std::io::{ErrorKind, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use lucid_stats::{Counter, StatsRegistry};
use lucid_vmm::api::{ApiError, ApiSocket};
use lucid_vmm::{PciDeviceConfig, RunReport, StopReason, Vm, VmConfig};
use serde_json::{json, Value};

/// The longest request line and headers.
pub const MAX_HEAD: usize = 16 << 10;
/// The largest body (a `vm.create` config is a few KiB).
pub const MAX_BODY: usize = 1 << 20;
/// How long a client has to send its whole request.
pub const REQUEST_PATIENCE: Duration = Duration::from_secs(5);
/// How long a response may wait for a client that does not read.
const WRITE_PATIENCE: Duration = Duration::from_secs(2);
const PREFIX: &str = "/api/v1/";

/// One HTTP response.
#[derive(Debug)]
pub struct Response {
    status: u16,
    content_type: &'static str,
    body: String,
}

impl Response {
    pub fn status(&self) -> u16 {
        self.status
    }
    pub fn body(&self) -> &str {
        &self.body
    }

    fn json(status: u16, v: &Value) -> Response {
        Response {
            status,
            content_type: "application/json",
            body: v.to_string(),
        }
    }
    fn empty() -> Response {
        Response {
            status: 204,
            content_type: "application/json",
            body: String::new(),
        }
    }
    /// An error, in Cloud Hypervisor's shape: a JSON array of the messages of the error chain.
    fn error(status: u16, msg: impl Into<String>) -> Response {
        Response::json(status, &json!([msg.into()]))
    }
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        204 => "No Content",
        400 => "Bad Request",
        404 => "Not Found",
        409 => "Conflict",
        408 => "Request Timeout",
        413 => "Payload Too Large",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        501 => "Not Implemented",
        _ => "",
    }
}

/// The VM the API manages, Cloud Hypervisor's states.
enum VmState {
    Created,
    Running(Box<Vm>),
    Paused(Box<Vm>),
    /// Stopped; its report (why, and the counters at the stop) is kept for `vm.counters`,
    /// `/metrics` and the exit status of a flag-booted VM.
    Shutdown(Box<RunReport>),
}

struct Managed {
    /// The `vm.create` body as given: `vm.info` returns it.
    body: Value,
    config: VmConfig,
    state: VmState,
}

/// The VM a `vm.create` body describes, as the REST API runs it: no signal handling or
/// console input of its own (the API owns the process), hotplug on (as Cloud Hypervisor).
fn rest_config(body: Value) -> Result<VmConfig, config::Refusal> {
    let mut config = config::map(body)?;
    config.machine.handle_signals = false;
    config.devices.serial_stdin = false;
    config.devices.hotplug = true;
    config.runtime.builtin_modules = Some(lucid_guests::module);
    Ok(config)
}

/// Removes the device `id` from a `vm.create` body's `disks` or `net`; whether it was there.
fn remove_by_id(body: &mut Value, id: &str) -> bool {
    for list in ["disks", "net", "fs", "user_devices"] {
        if let Some(a) = body[list].as_array_mut() {
            if let Some(i) = a.iter().position(|d| d["id"].as_str() == Some(id)) {
                a.remove(i);
                return true;
            }
        }
    }
    // The one vsock, named by its id or, without one, by Lucid's default name.
    let v = &body["vsock"];
    if v.is_object() && v["id"].as_str().unwrap_or("vsock0") == id {
        body["vsock"] = Value::Null;
        return true;
    }
    false
}

impl Managed {
    /// Whether the VM came from `vm.create` (a Cloud Hypervisor body, which names the kernel
    /// by a string), not from flags (Lucid's own `VmConfig` JSON).
    fn made_by_create(&self) -> bool {
        self.body["payload"]["kernel"].is_string()
    }

    /// A device added while the VM runs joins the configuration `vm.info` returns and a reboot
    /// boots: the body's `list` (`entry`, with its name as `id`) for a VM from `vm.create`,
    /// else Lucid's configuration (`device`, named).
    fn add_to_config(
        &mut self,
        list: &str,
        mut entry: Value,
        mut device: PciDeviceConfig,
        name: &str,
    ) {
        if self.made_by_create() {
            entry["id"] = json!(name);
            match self.body[list].as_array_mut() {
                Some(a) => a.push(entry),
                None if list == "vsock" => self.body[list] = entry,
                None => self.body[list] = json!([entry]),
            }
        } else {
            device.name = Some(name.into());
            self.config.devices.pci.push(device);
            self.body = serde_json::to_value(&self.config).unwrap_or(Value::Null);
        }
    }

    /// A device removed while the VM runs leaves it.
    fn remove_from_config(&mut self, id: &str) {
        if self.made_by_create() {
            remove_by_id(&mut self.body, id);
        } else {
            let names = lucid_vmm::devices::virtio_names(&self.config.devices.pci);
            if let Some(i) = names.iter().position(|n| n == id) {
                let mut pci = std::mem::take(&mut self.config.devices.pci);
                pci.remove(i);
                // The others keep the names they run under.
                for (d, n) in pci.iter_mut().zip(names.iter().filter(|n| *n != id)) {
                    d.name.get_or_insert_with(|| n.clone());
                }
                self.config.devices.pci = pci;
                self.body = serde_json::to_value(&self.config).unwrap_or(Value::Null);
            }
        }
    }

    /// Replaces the configuration of a VM not running with `body` (204), or refuses it (400).
    fn reconfigure(&mut self, body: Value, endpoint: &str) -> Response {
        match rest_config(body.clone()) {
            Ok(config) => {
                self.body = body;
                self.config = config;
                Response::empty()
            }
            Err(e) => Response::error(400, format!("{endpoint}: {e}")),
        }
    }

    fn state_name(&self) -> &'static str {
        state_name(&self.state)
    }

    /// A VM whose guest ended by itself (or failed) is collected: it is Shutdown. True when
    /// this call collected it.
    fn reap(&mut self) -> bool {
        let ended = match &self.state {
            VmState::Running(vm) | VmState::Paused(vm) => vm.lifecycle().is_stopping(),
            _ => false,
        };
        if ended {
            self.stop(StopReason::Shutdown);
        }
        ended
    }

    /// Stops a running or paused VM for `why` (unless it was stopping already) and keeps its
    /// report.
    fn stop(&mut self, why: StopReason) {
        let state = std::mem::replace(&mut self.state, VmState::Created);
        self.state = match state {
            VmState::Running(vm) | VmState::Paused(vm) => {
                vm.stop(why);
                let report = vm.wait();
                log::info!("REST API: the VM stopped: {}", report.stop_text());
                VmState::Shutdown(Box::new(report))
            }
            other => other,
        };
    }

    fn counters(&self) -> BTreeMap<String, u64> {
        match &self.state {
            VmState::Running(vm) | VmState::Paused(vm) => vm.stats().snapshot(),
            VmState::Shutdown(r) => r.counters.clone(),
            VmState::Created => BTreeMap::new(),
        }
    }

    /// Cloud Hypervisor's device tree, by Lucid's device names (`blk0`, `net0`, `balloon`,
    /// `edu`: the names of `vm.counters`): the PCI functions of a running VM with their
    /// addresses, else the devices the config describes.
    fn device_tree(&self) -> Value {
        let entry = |id: &str, bdf: Option<String>| json!({"id": id, "resources": [], "children": [], "pci_bdf": bdf});
        let mut tree = serde_json::Map::new();
        match &self.state {
            VmState::Running(vm) | VmState::Paused(vm) => {
                for a in vm.devices().pci_devices() {
                    let bdf = format!("0000:00:{:02x}.0", a.slot.slot);
                    tree.insert(a.name.clone(), entry(&a.name, Some(bdf)));
                }
            }
            _ => {
                let mut names = lucid_vmm::devices::virtio_names(&self.config.devices.pci);
                if self.config.devices.balloon.is_some() {
                    names.push(lucid_vmm::devices::BALLOON.into());
                }
                if self.config.devices.rng.is_some() {
                    names.push(lucid_vmm::devices::RNG.into());
                }
                if self.config.devices.console.is_some() {
                    names.push(lucid_vmm::devices::CONSOLE.into());
                }
                names.extend(
                    self.config
                        .devices
                        .platform_pci
                        .iter()
                        .map(|d| d.name().into()),
                );
                for n in names {
                    tree.insert(n.clone(), entry(&n, None));
                }
            }
        }
        if self.config.iommu.is_some() {
            tree.insert("iommu".into(), entry("iommu", None));
        }
        tree.insert("serial".into(), entry("serial", None));
        Value::Object(tree)
    }
}

/// `rest.*` counters of the server itself, in its own registry (a VM comes and goes).
struct RestCounters {
    requests: Arc<Counter>,
    errors: Arc<Counter>,
    dropped: Arc<Counter>,
}

/// The REST server on the calling thread.
pub struct RestServer {
    sock: ApiSocket,
    signals: StopSignals,
    /// Readable once a VM of this server stops by itself (its lifecycle's kicker writes to
    /// `stopped_tx`), so that the server collects it without waiting for a request.
    stopped_rx: UnixStream,
    stopped_tx: UnixStream,
    vm: Option<Managed>,
    /// The VM was booted from flags: the process ends with it, as `lucid run` without the API.
    exit_with_guest: bool,
    stats: Arc<StatsRegistry>,
    counters: RestCounters,
}

/// How [`RestServer::serve`] ended.
pub struct Served {
    /// The process exit status: 0 after `vmm.shutdown`, 128 + n after signal n, the guest's
    /// (`RunReport::exit_code`) when a flag-booted VM ended by itself.
    pub code: i32,
    /// The last run of the VM, when one ran and was not deleted.
    pub report: Option<RunReport>,
}

/// What woke the server.
enum Wake {
    Client,
    Signal(i32),
    VmStopped,
}

impl RestServer {
    /// Binds `path` as the JSON-lines API does: mode 0600, a stale socket replaced, a live
    /// one refused.
    pub fn bind(path: &Path) -> Result<Self, ApiError> {
        let sock = ApiSocket::bind(path)?;
        let io = |what| {
            let path = path.to_path_buf();
            move |source| ApiError::Io { path, what, source }
        };
        let signals =
            StopSignals::new().map_err(io("take SIGINT and SIGTERM through a signalfd"))?;
        let (stopped_rx, stopped_tx) =
            UnixStream::pair().map_err(io("make the VM-stopped wake-up pair"))?;
        for s in [&stopped_rx, &stopped_tx] {
            s.set_nonblocking(true)
                .map_err(io("make the VM-stopped wake-up pair non-blocking"))?;
        }
        let stats = StatsRegistry::new();
        let c = |n: &str| stats.counter(format!("rest.{n}"));
        let counters = RestCounters {
            requests: c("requests"),
            errors: c("errors"),
            dropped: c("clients_dropped"),
        };
        Ok(RestServer {
            sock,
            signals,
            stopped_rx,
            stopped_tx,
            vm: None,
            exit_with_guest: false,
            stats,
            counters,
        })
    }

    /// Serves beside `vm`, built from `config` and started by the caller (`lucid run` with a
    /// payload): the VM is Running, `vm.info`'s `config` is Lucid's `VmConfig` JSON, and when
    /// the guest ends by itself [`RestServer::serve`] returns with its exit status.
    pub fn adopt(&mut self, vm: Vm, config: VmConfig) {
        self.watch(&vm);
        let body = serde_json::to_value(&config).unwrap_or(Value::Null);
        self.vm = Some(Managed {
            body,
            config,
            state: VmState::Running(Box::new(vm)),
        });
        self.exit_with_guest = true;
    }

    /// Wakes the server when `vm` stops (one byte per stop request; a full pipe is as good).
    fn watch(&self, vm: &Vm) {
        match self.stopped_tx.try_clone() {
            Ok(tx) => vm.lifecycle().add_kicker(Box::new(move || {
                let _ = (&tx).write(&[0]);
            })),
            Err(e) => log::warn!("REST API: the VM's stop is seen at the next request: {e}"),
        }
    }

    /// Collects a VM that stopped by itself; its exit status when the process ends with it.
    fn reap(&mut self) -> Option<i32> {
        let mut drained = [0u8; 64];
        while matches!((&self.stopped_rx).read(&mut drained), Ok(n) if n > 0) {}
        let m = self.vm.as_mut()?;
        if !m.reap() {
            return None;
        }
        if !self.exit_with_guest {
            // As Cloud Hypervisor: a guest that resets itself is booted again.
            if matches!(&m.state, VmState::Shutdown(r) if r.stop == StopReason::Reset) {
                let resp = self.boot(&[]);
                log::info!(
                    "REST API: the guest reset; booted again ({})",
                    resp.status()
                );
            }
            return None;
        }
        match &m.state {
            VmState::Shutdown(r) => Some(r.exit_code()),
            _ => None,
        }
    }

    /// Serves until `vmm.shutdown` (exit status 0), SIGINT/SIGTERM (128 + the signal) or,
    /// for an adopted VM, the guest's end (its exit status); the VM, if any, is stopped on
    /// the way out and the socket file removed.
    pub fn serve(mut self) -> Served {
        log::info!(
            "REST API (Cloud Hypervisor's) on {}: {}",
            self.sock.path().display(),
            match self.vm {
                Some(_) => "the VM runs",
                None => "waiting for vm.create",
            }
        );
        let (code, why) = loop {
            match self.signals.wait(self.sock.listener(), &self.stopped_rx) {
                Wake::Signal(sig) => {
                    log::info!("signal {sig}: stopping the VMM");
                    break (128 + sig, StopReason::Signal(sig));
                }
                Wake::VmStopped => {
                    if let Some(code) = self.reap() {
                        break (code, StopReason::Shutdown);
                    }
                    continue;
                }
                Wake::Client => {}
            }
            if let Some(code) = self.reap() {
                break (code, StopReason::Shutdown);
            }
            let stream = match self.sock.listener().accept() {
                Ok((s, _)) => s,
                Err(e) if matches!(e.kind(), ErrorKind::Interrupted | ErrorKind::WouldBlock) => {
                    continue
                }
                Err(e) => {
                    log::warn!("REST API: accept failed: {e}");
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                }
            };
            if self.connection(stream) {
                log::info!("REST API: vmm.shutdown");
                break (0, StopReason::Shutdown);
            }
        };
        let report = self.vm.take().and_then(|mut m| {
            m.stop(why);
            match m.state {
                VmState::Shutdown(r) => Some(*r),
                _ => None,
            }
        });
        Served { code, report }
    }

    /// Serves one request on `stream`; true after `vmm.shutdown`.
    fn connection(&mut self, mut stream: UnixStream) -> bool {
        let _ = stream.set_nonblocking(false);
        let _ = stream.set_write_timeout(Some(WRITE_PATIENCE));
        let request = match read_request(&mut stream) {
            Ok(r) => r,
            Err(Framing::Gone) => {
                self.counters.dropped.inc();
                return false;
            }
            Err(Framing::Refused(resp)) => {
                self.counters.dropped.inc();
                self.counters.errors.inc();
                let _ = write_response(&mut stream, &resp);
                return false;
            }
        };
        self.counters.requests.inc();
        let (resp, quit) = self.handle(&request);
        if resp.status >= 400 {
            self.counters.errors.inc();
            log::info!(
                "REST API: {} {} -> {} {}",
                request.method,
                request.path,
                resp.status,
                resp.body
            );
        }
        let _ = write_response(&mut stream, &resp);
        quit
    }

    fn handle(&mut self, r: &Request) -> (Response, bool) {
        let path = r.path.split('?').next().unwrap_or_default();
        if path == "/metrics" {
            return (self.method(r, "GET", Self::metrics), false);
        }
        let Some(name) = path.strip_prefix(PREFIX) else {
            return (not_found(path), false);
        };
        let resp = match name {
            "vmm.ping" => self.method(r, "GET", Self::ping),
            "vmm.shutdown" => {
                // 200 with no body, as Cloud Hypervisor; the VM stops after the reply.
                let resp = self.method(r, "PUT", |_, _| Response {
                    status: 200,
                    ..Response::empty()
                });
                let quit = resp.status == 200;
                return (resp, quit);
            }
            "vm.create" => self.method(r, "PUT", Self::create),
            "vm.boot" => self.method(r, "PUT", Self::boot),
            "vm.info" => self.method(r, "GET", Self::info),
            "vm.counters" => self.method(r, "GET", Self::vm_counters),
            "vm.pause" => self.method(r, "PUT", Self::pause),
            "vm.resume" => self.method(r, "PUT", Self::resume),
            "vm.shutdown" => self.method(r, "PUT", Self::shutdown),
            "vm.delete" => self.method(r, "PUT", Self::delete),
            "vm.add-disk" => self.method(r, "PUT", |s, b| s.add_device("disk", b)),
            "vm.add-net" => self.method(r, "PUT", |s, b| s.add_device("net", b)),
            "vm.add-fs" => self.method(r, "PUT", |s, b| s.add_device("fs", b)),
            "vm.add-vsock" => self.method(r, "PUT", |s, b| s.add_device("vsock", b)),
            "vm.add-user-device" => self.method(r, "PUT", Self::add_user_device),
            "vm.remove-device" => self.method(r, "PUT", Self::remove_device),
            "vm.power-button" => self.method(r, "PUT", Self::power_button),
            "vm.reboot" => self.method(r, "PUT", Self::reboot),
            "vm.resize" => self.method(r, "PUT", Self::resize),
            lucid if lucid.starts_with("lucid.") => self.lucid(r, lucid),
            "vm.add-device"
            | "vm.add-pmem"
            | "vm.add-vdpa"
            | "vm.resize-zone"
            | "vm.resize-disk"
            | "vm.snapshot"
            | "vm.restore"
            | "vm.coredump"
            | "vm.send-migration"
            | "vm.receive-migration"
            | "vm.nmi" => Response::error(
                501,
                format!("{name}: a Cloud Hypervisor endpoint Lucid does not serve yet"),
            ),
            _ => not_found(path),
        };
        (resp, false)
    }

    /// Runs `f` when the request's method is `want`; Cloud Hypervisor answers any other
    /// method with 400.
    fn method(
        &mut self,
        r: &Request,
        want: &str,
        f: impl FnOnce(&mut Self, &[u8]) -> Response,
    ) -> Response {
        match r.method == want {
            true => f(self, &r.body),
            false => Response::error(400, format!("{}: takes {want}, not {}", r.path, r.method)),
        }
    }

    fn ping(&mut self, _: &[u8]) -> Response {
        Response::json(
            200,
            &json!({
                "build_version": format!("lucid {}", env!("CARGO_PKG_VERSION")),
                "version": env!("CARGO_PKG_VERSION"),
                "pid": std::process::id(),
                "features": ["kvm", "lucid"],
            }),
        )
    }

    fn create(&mut self, body: &[u8]) -> Response {
        // As Cloud Hypervisor: the body is checked (400) before the state (500).
        let v: Value = match serde_json::from_slice(body) {
            Ok(v) => v,
            Err(e) => return Response::error(400, format!("vm.create: the body is not JSON: {e}")),
        };
        match rest_config(v.clone()) {
            Ok(_) if self.vm.is_some() => Response::error(
                500,
                "vm.create: a VM is already created (vm.delete it first)",
            ),
            Ok(config) => {
                self.vm = Some(Managed {
                    body: v,
                    config,
                    state: VmState::Created,
                });
                Response::empty()
            }
            Err(e) => Response::error(400, format!("vm.create: {e}")),
        }
    }

    fn boot(&mut self, _: &[u8]) -> Response {
        let Some(m) = &self.vm else {
            return no_vm("vm.boot");
        };
        match m.state {
            VmState::Created | VmState::Shutdown(_) => {}
            _ => return Response::error(500, "vm.boot: the VM is already booted"),
        }
        let built = Vm::build(m.config.clone()).and_then(|mut vm| vm.start().map(|()| vm));
        match built {
            Ok(vm) => {
                self.watch(&vm);
                if let Some(m) = &mut self.vm {
                    m.state = VmState::Running(Box::new(vm));
                }
                Response::empty()
            }
            Err(e) => Response::error(500, format!("vm.boot: {}", lucid_vmm::error_chain(&e))),
        }
    }

    fn info(&mut self, _: &[u8]) -> Response {
        let Some(m) = &self.vm else {
            return no_vm("vm.info");
        };
        Response::json(
            200,
            &json!({
                "config": m.body,
                "state": m.state_name(),
                "memory_actual_size": m.config.machine.mem_mib << 20,
                "device_tree": m.device_tree(),
            }),
        )
    }

    /// Cloud Hypervisor's shape: {device: {counter: value}}; a Lucid counter `a.b.c` is
    /// counter `b.c` of device `a`.
    fn vm_counters(&mut self, _: &[u8]) -> Response {
        let Some(m) = &self.vm else {
            return no_vm("vm.counters");
        };
        let mut out: BTreeMap<String, BTreeMap<String, u64>> = BTreeMap::new();
        for (k, v) in m.counters() {
            let (dev, c) = k.split_once('.').unwrap_or(("vm", k.as_str()));
            out.entry(dev.into()).or_default().insert(c.into(), v);
        }
        Response::json(200, &json!(out))
    }

    fn pause(&mut self, _: &[u8]) -> Response {
        let Some(m) = &mut self.vm else {
            return no_vm("vm.pause");
        };
        let state = std::mem::replace(&mut m.state, VmState::Created);
        let (state, resp) = match state {
            VmState::Running(vm) => {
                let failed = vm.vcpus().iter().find_map(|h| h.pause().err());
                match failed {
                    None => (VmState::Paused(vm), Response::empty()),
                    Some(e) => {
                        // Whatever paused runs on: the VM is still Running.
                        for h in vm.vcpus() {
                            let _ = h.resume();
                        }
                        let resp = Response::error(500, format!("vm.pause: {e}"));
                        (VmState::Running(vm), resp)
                    }
                }
            }
            s => {
                let msg = format!("vm.pause: the VM is {}, not Running", state_name(&s));
                (s, Response::error(500, msg))
            }
        };
        m.state = state;
        resp
    }

    fn resume(&mut self, _: &[u8]) -> Response {
        let Some(m) = &mut self.vm else {
            return no_vm("vm.resume");
        };
        let state = std::mem::replace(&mut m.state, VmState::Created);
        let (state, resp) = match state {
            VmState::Paused(vm) => match vm.vcpus().iter().find_map(|h| h.resume().err()) {
                None => (VmState::Running(vm), Response::empty()),
                Some(e) => {
                    let resp = Response::error(500, format!("vm.resume: {e}"));
                    (VmState::Paused(vm), resp)
                }
            },
            s => {
                let msg = format!("vm.resume: the VM is {}, not Paused", state_name(&s));
                (s, Response::error(500, msg))
            }
        };
        m.state = state;
        resp
    }

    fn shutdown(&mut self, _: &[u8]) -> Response {
        let Some(m) = &mut self.vm else {
            return no_vm("vm.shutdown");
        };
        match m.state {
            VmState::Running(_) | VmState::Paused(_) => {
                m.stop(StopReason::Shutdown);
                Response::empty()
            }
            _ => Response::error(
                500,
                format!("vm.shutdown: the VM is {}, not booted", m.state_name()),
            ),
        }
    }

    fn delete(&mut self, _: &[u8]) -> Response {
        if let Some(mut m) = self.vm.take() {
            m.stop(StopReason::Shutdown);
        }
        Response::empty()
    }

    /// `vm.add-disk` (`what` = "disk"), `vm.add-net` ("net") and `vm.add-vsock` ("vsock"), as
    /// Cloud Hypervisor: to a
    /// booted VM the device is hot-added (200 with its id and PCI address); to a VM not booted
    /// yet it is added to the configuration (204).
    fn add_device(&mut self, what: &str, body: &[u8]) -> Response {
        let endpoint = format!("vm.add-{what}");
        let v: Value = match serde_json::from_slice(body) {
            Ok(v) => v,
            Err(e) => {
                return Response::error(400, format!("{endpoint}: the body is not JSON: {e}"))
            }
        };
        let Some(m) = &mut self.vm else {
            return no_vm(&endpoint);
        };
        // `vsock` is one object, not a list, as in Cloud Hypervisor.
        let list = match what {
            "disk" => "disks",
            "fs" => "fs",
            "vsock" => "vsock",
            _ => "net",
        };
        if what == "vsock" && !m.body["vsock"].is_null() {
            return Response::error(400, format!("{endpoint}: the VM already has a vsock"));
        }
        let nics = m.body[list].as_array().map_or(0, Vec::len);
        let device = match config::hot_device(what, v.clone(), m.config.iommu.is_some(), nics) {
            Ok(d) => d,
            Err(e) => return Response::error(400, format!("{endpoint}: {e}")),
        };
        match &m.state {
            VmState::Running(vm) | VmState::Paused(vm) => match vm.devices().hot_add(&device) {
                Ok(a) => {
                    m.add_to_config(list, v, device, &a.name);
                    let bdf = format!("0000:00:{:02x}.0", a.slot.slot);
                    Response::json(200, &json!({"id": a.name, "bdf": bdf}))
                }
                Err(e) => {
                    let status = match e {
                        lucid_vmm::VmmError::DeviceExists(_) => 409,
                        _ => 500,
                    };
                    Response::error(
                        status,
                        format!("{endpoint}: {}", lucid_vmm::error_chain(&e)),
                    )
                }
            },
            VmState::Created | VmState::Shutdown(_) => {
                let mut body = m.body.clone();
                match body[list].as_array_mut() {
                    Some(a) => a.push(v),
                    None if list == "vsock" => body[list] = v,
                    None => body[list] = json!([v]),
                }
                m.reconfigure(body, &endpoint)
            }
        }
    }

    /// `vm.add-user-device`: to a VM not booted yet the vfio-user device joins the configuration
    /// (204); a booted VM's threads are confined and open no new connection, so Lucid refuses
    /// to hot-add one (409 would say the id is taken; 400 says why).
    fn add_user_device(&mut self, body: &[u8]) -> Response {
        const ENDPOINT: &str = "vm.add-user-device";
        let v: Value = match serde_json::from_slice(body) {
            Ok(v) => v,
            Err(e) => {
                return Response::error(400, format!("{ENDPOINT}: the body is not JSON: {e}"))
            }
        };
        let Some(m) = &mut self.vm else {
            return no_vm(ENDPOINT);
        };
        if let Err(e) = config::hot_user_device(v.clone(), m.config.iommu.is_some()) {
            return Response::error(400, format!("{ENDPOINT}: {e}"));
        }
        match &m.state {
            VmState::Running(_) | VmState::Paused(_) => Response::error(
                400,
                format!(
                    "{ENDPOINT}: a vfio-user device connects to its server at boot only: \
                     add it before vm.boot (or in vm.create's user_devices)"
                ),
            ),
            VmState::Created | VmState::Shutdown(_) => {
                let mut body = m.body.clone();
                match body["user_devices"].as_array_mut() {
                    Some(a) => a.push(v),
                    None => body["user_devices"] = json!([v]),
                }
                m.reconfigure(body, ENDPOINT)
            }
        }
    }

    /// `vm.remove-device` (`{"id": ...}`): a booted VM's guest is asked to release the device
    /// (ACPI eject; Lucid detaches it when the guest has); before boot it leaves the
    /// configuration.
    fn remove_device(&mut self, body: &[u8]) -> Response {
        let id = match serde_json::from_slice::<Value>(body) {
            Ok(v) => match v.get("id").and_then(Value::as_str) {
                Some(id) if v.as_object().is_some_and(|o| o.len() == 1) => id.to_string(),
                _ => {
                    return Response::error(
                        400,
                        "vm.remove-device: the body must be {\"id\": \"<device id>\"}",
                    )
                }
            },
            Err(e) => {
                return Response::error(400, format!("vm.remove-device: the body is not JSON: {e}"))
            }
        };
        let Some(m) = &mut self.vm else {
            return no_vm("vm.remove-device");
        };
        match &m.state {
            VmState::Running(vm) | VmState::Paused(vm) => match vm.devices().hot_remove(&id) {
                Ok(()) => {
                    m.remove_from_config(&id);
                    Response::empty()
                }
                Err(e @ lucid_vmm::VmmError::NoSuchDevice(_)) => Response::error(
                    404,
                    format!("vm.remove-device: {}", lucid_vmm::error_chain(&e)),
                ),
                Err(e) => Response::error(
                    500,
                    format!("vm.remove-device: {}", lucid_vmm::error_chain(&e)),
                ),
            },
            VmState::Created | VmState::Shutdown(_) => {
                let mut body = m.body.clone();
                if !remove_by_id(&mut body, &id) {
                    return Response::error(
                        404,
                        format!("vm.remove-device: no device with id {id:?} in the configuration"),
                    );
                }
                m.reconfigure(body, "vm.remove-device")
            }
        }
    }

    /// `vm.reboot`: the VM stops (threads joined, devices closed) and boots again from its
    /// configuration, hot-added devices included.
    fn reboot(&mut self, _: &[u8]) -> Response {
        let Some(m) = &mut self.vm else {
            return no_vm("vm.reboot");
        };
        if !matches!(m.state, VmState::Running(_) | VmState::Paused(_)) {
            return Response::error(
                500,
                format!("vm.reboot: the VM is {}, not booted", m.state_name()),
            );
        }
        m.stop(StopReason::Shutdown);
        // A VM made by `vm.create` boots from its body, with the devices added since; one
        // booted from flags from its configuration.
        if m.body["payload"]["kernel"].is_string() {
            match rest_config(m.body.clone()) {
                Ok(c) => m.config = c,
                Err(e) => return Response::error(500, format!("vm.reboot: {e}")),
            }
        }
        self.boot(&[])
    }

    /// `vm.resize` (`desired_vcpus`, `desired_ram`, `desired_balloon`, in bytes): Lucid has
    /// no vCPU or memory hotplug, so RAM shrinks and grows back through the balloon:
    /// `desired_ram` sets the balloon to the boot RAM minus it, `desired_balloon` sets it
    /// directly. A running VM with a balloon only.
    fn resize(&mut self, body: &[u8]) -> Response {
        #[derive(serde::Deserialize)]
        #[serde(deny_unknown_fields)]
        struct Resize {
            desired_vcpus: Option<u64>,
            desired_ram: Option<u64>,
            desired_balloon: Option<u64>,
        }
        let r: Resize = match serde_json::from_slice(body) {
            Ok(r) => r,
            Err(e) => return Response::error(400, format!("vm.resize: {e}")),
        };
        let Some(m) = &self.vm else {
            return no_vm("vm.resize");
        };
        let vcpus = u64::from(m.config.machine.vcpus);
        if r.desired_vcpus.is_some_and(|n| n != vcpus) {
            return Response::error(
                400,
                format!("vm.resize: desired_vcpus: Lucid has no vCPU hotplug; the VM has {vcpus}"),
            );
        }
        let ram = m.config.machine.mem_mib << 20;
        let balloon_bytes = match (r.desired_ram, r.desired_balloon) {
            (Some(_), Some(_)) => {
                return Response::error(400, "vm.resize: give desired_ram or desired_balloon, not both")
            }
            (Some(want), None) if want > ram => {
                return Response::error(
                    400,
                    format!(
                        "vm.resize: desired_ram: {want} bytes is more than the {ram} the VM                          booted with; Lucid has no memory hotplug, it can only give back what                          the balloon holds"
                    ),
                )
            }
            (Some(want), None) => Some(ram - want),
            (None, b) => b,
        };
        let Some(bytes) = balloon_bytes else {
            return Response::empty();
        };
        let vm = match &m.state {
            VmState::Running(vm) | VmState::Paused(vm) => vm,
            _ => {
                return Response::error(
                    500,
                    format!("vm.resize: the VM is {}, not booted", m.state_name()),
                )
            }
        };
        match vm.balloon() {
            Some(b) if bytes <= ram => {
                b.set_target_pages(bytes >> 12);
                Response::empty()
            }
            Some(_) => Response::error(
                400,
                format!("vm.resize: desired_balloon: {bytes} bytes is more than guest RAM ({ram})"),
            ),
            None => Response::error(
                500,
                "vm.resize: the VM has no balloon (vm.create with `balloon`) to resize RAM with",
            ),
        }
    }

    /// `vm.power-button`: the ACPI power button of a booted VM.
    fn power_button(&mut self, _: &[u8]) -> Response {
        let Some(m) = &mut self.vm else {
            return no_vm("vm.power-button");
        };
        match &m.state {
            VmState::Running(vm) | VmState::Paused(vm) => match vm.devices().press_power_button() {
                Ok(()) => Response::empty(),
                Err(e) => Response::error(
                    500,
                    format!("vm.power-button: {}", lucid_vmm::error_chain(&e)),
                ),
            },
            _ => Response::error(
                500,
                format!("vm.power-button: the VM is {}, not booted", m.state_name()),
            ),
        }
    }

    /// Every counter of the server's and the VM's registries in Prometheus' text format.
    fn metrics(&mut self, _: &[u8]) -> Response {
        let mut all = self.stats.snapshot();
        if let Some(m) = &self.vm {
            all.extend(m.counters());
        }
        Response {
            status: 200,
            content_type: "text/plain; version=0.0.4",
            body: lucid_stats::prometheus_text(&all),
        }
    }
}

fn state_name(s: &VmState) -> &'static str {
    match s {
        VmState::Created => "Created",
        VmState::Running(_) => "Running",
        VmState::Paused(_) => "Paused",
        VmState::Shutdown(_) => "Shutdown",
    }
}

fn no_vm(what: &str) -> Response {
    Response::error(404, format!("{what}: no VM is created (vm.create first)"))
}

fn not_found(path: &str) -> Response {
    Response::error(
        404,
        format!("{path}: no such endpoint (the API is at {PREFIX}; docs/api.md lists them)"),
    )
}

/// SIGINT and SIGTERM, blocked in this thread and every thread it starts from now on (the
/// VM's inherit the mask), read from a signalfd beside the listening socket, so that they
/// stop the VM and remove the socket as `vmm.shutdown` does.
struct StopSignals {
    fd: std::os::fd::OwnedFd,
}

impl StopSignals {
    fn new() -> std::io::Result<Self> {
        use std::os::fd::FromRawFd;
        // SAFETY: sigset manipulation on a local set, pthread_sigmask on the calling thread,
        // and signalfd creating a new descriptor that is owned at once.
        unsafe {
            let mut set: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut set);
            libc::sigaddset(&mut set, libc::SIGINT);
            libc::sigaddset(&mut set, libc::SIGTERM);
            libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
            let fd = libc::signalfd(-1, &set, libc::SFD_CLOEXEC | libc::SFD_NONBLOCK);
            if fd < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(StopSignals {
                fd: std::os::fd::OwnedFd::from_raw_fd(fd),
            })
        }
    }

    /// Waits until a stop signal came, the VM stopped (`stopped` is readable) or `listener`
    /// has a client, in that order of precedence.
    fn wait(&self, listener: &std::os::unix::net::UnixListener, stopped: &UnixStream) -> Wake {
        use std::os::fd::AsRawFd;
        let pollfd = |fd| libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        let mut fds = [
            pollfd(listener.as_raw_fd()),
            pollfd(self.fd.as_raw_fd()),
            pollfd(stopped.as_raw_fd()),
        ];
        // SAFETY: poll on three valid descriptors in a local array of its stated length.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, -1) };
        if n > 0 && fds[1].revents == 0 && fds[2].revents != 0 {
            return Wake::VmStopped;
        }
        if n <= 0 || fds[1].revents == 0 {
            return Wake::Client;
        }
        // SAFETY: signalfd_siginfo is plain data, valid all zeroes.
        let mut info: libc::signalfd_siginfo = unsafe { std::mem::zeroed() };
        let size = std::mem::size_of::<libc::signalfd_siginfo>();
        // SAFETY: `info` is `size` bytes of writable plain data.
        let got = unsafe {
            libc::read(
                self.fd.as_raw_fd(),
                (&mut info as *mut libc::signalfd_siginfo).cast(),
                size,
            )
        };
        match got == size as isize {
            true => Wake::Signal(info.ssi_signo as i32),
            false => Wake::Client,
        }
    }
}

/// A request, framed.
#[derive(Debug)]
pub struct Request {
    pub method: String,
    pub path: String,
    pub body: Vec<u8>,
}

/// What the bytes read so far hold.
#[derive(Debug)]
pub enum Parsed {
    /// Not a whole request yet: read more.
    Partial,
    /// A whole request (bytes past its body are ignored: one request per connection).
    Complete(Request),
}

/// Why no request was read.
enum Framing {
    /// The client disconnected or stalled past [`REQUEST_PATIENCE`] before a whole request.
    Gone,
    /// Answered with this and closed.
    Refused(Response),
}

/// The framing of one request in `buf`, the bytes a client sent so far: `httparse` parses
/// the head, the body is `Content-Length` bytes after it. A refusal is the response to send
/// before closing (400, 413, 431), whatever more the client would send.
pub fn parse_request(buf: &[u8]) -> Result<Parsed, Response> {
    let mut headers = [httparse::EMPTY_HEADER; 32];
    let mut req = httparse::Request::new(&mut headers);
    let head_len = match req.parse(buf) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) if buf.len() < MAX_HEAD => return Ok(Parsed::Partial),
        Ok(httparse::Status::Partial) | Err(httparse::Error::TooManyHeaders) => {
            return Err(Response::error(
                431,
                format!("the request line and headers are over {MAX_HEAD} bytes or 32 headers"),
            ))
        }
        Err(e) => {
            return Err(Response::error(
                400,
                format!("not an HTTP/1.1 request: {e}"),
            ))
        }
    };
    let mut body_len = 0usize;
    for h in req.headers.iter() {
        if h.name.eq_ignore_ascii_case("transfer-encoding") {
            return Err(Response::error(
                400,
                "Transfer-Encoding is not supported: send the body with Content-Length",
            ));
        }
        if h.name.eq_ignore_ascii_case("content-length") {
            body_len = std::str::from_utf8(h.value)
                .ok()
                .and_then(|v| v.trim().parse().ok())
                .ok_or_else(|| Response::error(400, "Content-Length is not a number"))?;
        }
    }
    if body_len > MAX_BODY {
        return Err(Response::error(
            413,
            format!("the body is {body_len} bytes; at most {MAX_BODY} are accepted"),
        ));
    }
    if buf.len() - head_len < body_len {
        return Ok(Parsed::Partial);
    }
    Ok(Parsed::Complete(Request {
        method: req.method.unwrap_or_default().to_string(),
        path: req.path.unwrap_or_default().to_string(),
        body: buf[head_len..head_len + body_len].to_vec(),
    }))
}

/// Reads from `s` until [`parse_request`] has a whole request or a refusal, within
/// [`REQUEST_PATIENCE`].
fn read_request(s: &mut UnixStream) -> Result<Request, Framing> {
    let deadline = Instant::now() + REQUEST_PATIENCE;
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 4096];
    loop {
        match parse_request(&buf) {
            Ok(Parsed::Complete(r)) => return Ok(r),
            Err(resp) => return Err(Framing::Refused(resp)),
            Ok(Parsed::Partial) => {}
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(timed_out());
        }
        let _ = s.set_read_timeout(Some(left));
        match s.read(&mut chunk) {
            Ok(0) => return Err(Framing::Gone),
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                return Err(timed_out())
            }
            Err(_) => return Err(Framing::Gone),
        }
    }
}

fn timed_out() -> Framing {
    Framing::Refused(Response::error(
        408,
        format!(
            "the request was not complete within {} s",
            REQUEST_PATIENCE.as_secs()
        ),
    ))
}

fn write_response(s: &mut UnixStream, r: &Response) -> std::io::Result<()> {
    let mut out = format!(
        "HTTP/1.1 {} {}\r\nServer: lucid\r\nConnection: close\r\nContent-Length: {}\r\n",
        r.status,
        reason(r.status),
        r.body.len()
    );
    if !r.body.is_empty() {
        out += &format!("Content-Type: {}\r\n", r.content_type);
    }
    out += "\r\n";
    out += &r.body;
    s.write_all(out.as_bytes())?;
    s.flush()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn complete(b: &[u8]) -> Request {
        match parse_request(b) {
            Ok(Parsed::Complete(r)) => r,
            other => panic!("{other:?}"),
        }
    }

    fn refusal(b: &[u8]) -> u16 {
        parse_request(b).expect_err("refused").status()
    }

    #[test]
    fn framing_takes_whole_requests_and_refuses_what_it_cannot_serve() {
        let r = complete(b"PUT /api/v1/vm.create HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}extra");
        assert_eq!(
            (r.method.as_str(), r.path.as_str()),
            ("PUT", "/api/v1/vm.create")
        );
        assert_eq!(r.body, b"{}");
        assert!(complete(b"GET /metrics HTTP/1.1\r\n\r\n").body.is_empty());
        for partial in [
            &b""[..],
            b"GET /api/v1/vmm.ping HTTP/1.1\r\n",
            b"PUT /x HTTP/1.1\r\nContent-Length: 5\r\n\r\nabc",
        ] {
            assert!(matches!(parse_request(partial), Ok(Parsed::Partial)));
        }
        assert_eq!(refusal(b"\x00\x01 nonsense\r\n\r\n"), 400);
        assert_eq!(
            refusal(b"PUT /x HTTP/1.1\r\nContent-Length: x\r\n\r\n"),
            400
        );
        assert_eq!(
            refusal(b"PUT /x HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"),
            400
        );
        let big = format!(
            "PUT /x HTTP/1.1\r\nContent-Length: {}\r\n\r\n",
            MAX_BODY + 1
        );
        assert_eq!(refusal(big.as_bytes()), 413);
        let mut long = b"GET /".to_vec();
        long.resize(MAX_HEAD + 1, b'a');
        assert_eq!(refusal(&long), 431);
    }
}
