//! Lucid's own endpoints, `/api/v1/lucid.*` (docs/api.md): SymCalls, symbiotic modules, the
//! SymSpy pages and the statistics tree, the operations of `lucid_vmm::api` on the VM this
//! server manages. `lucid sym` is their client.
//!
//! Status codes as for Cloud Hypervisor's endpoints: 400 for a body that does not parse or a
//! request the VM cannot serve as asked (a vCPU it lacks, no `--symbiotic`), 404 with no VM,
//! 500 for a VM in the wrong state or an operation that was tried and failed.

use lucid_vmm::api::{self, proto, OpError};
use lucid_vmm::{RateLimitError, Vm};
use serde::de::DeserializeOwned;
use serde::Serialize;

use super::{no_vm, not_found, Request, Response, RestServer, VmState};

/// An endpoint's handler: the response, or the refusal.
type Handler = fn(&mut RestServer, &str, &[u8]) -> Result<Response, Response>;

impl RestServer {
    /// Serves `lucid.<op>` (`name`).
    pub(super) fn lucid(&mut self, r: &Request, name: &str) -> Response {
        let (want, f): (&str, Handler) = match name {
            "lucid.symcall" => ("PUT", Self::symcall),
            "lucid.module-load" => ("PUT", Self::module_load),
            "lucid.module-unload" => ("PUT", Self::module_unload),
            "lucid.modules" => ("GET", Self::modules),
            "lucid.spy" => ("GET", Self::spy),
            "lucid.stats" => ("GET", Self::counters_tree),
            "lucid.rate-limit" => ("PUT", Self::rate_limit),
            _ => return not_found(&r.path),
        };
        self.method(r, want, |s, b| f(s, name, b).unwrap_or_else(|e| e))
    }

    fn symcall(&mut self, name: &str, b: &[u8]) -> Result<Response, Response> {
        let req: proto::Symcall = body(name, b)?;
        self.on_vm(name, Need::Running, |vm| api::symcall(vm, &req))
    }

    fn module_load(&mut self, name: &str, b: &[u8]) -> Result<Response, Response> {
        let req: proto::ModuleLoad = body(name, b)?;
        self.on_vm(name, Need::Running, |vm| api::module_load(vm, &req))
    }

    fn module_unload(&mut self, name: &str, b: &[u8]) -> Result<Response, Response> {
        let req: proto::ModuleUnload = body(name, b)?;
        self.on_vm(name, Need::Running, |vm| api::module_unload(vm, req.id))
    }

    fn modules(&mut self, name: &str, _: &[u8]) -> Result<Response, Response> {
        self.on_vm(name, Need::Booted, api::modules)
    }

    fn spy(&mut self, name: &str, _: &[u8]) -> Result<Response, Response> {
        self.on_vm(name, Need::Booted, api::spy)
    }

    /// The server's and the VM's counters as one tree, with or without a VM.
    fn counters_tree(&mut self, _: &str, _: &[u8]) -> Result<Response, Response> {
        let mut all = self.stats.snapshot();
        if let Some(m) = &self.vm {
            all.extend(m.counters());
        }
        answer(&proto::Counters {
            counters: lucid_stats::nest(&all),
        })
    }

    /// `{"id": DEVICE, "rate_limiter_config": {...} | null}`: the device's new limits (null:
    /// none), taken by its back-end thread at once. 204; 404 for a device the VM lacks; 400
    /// for a body or limits that do not parse, or a device with no limiter.
    fn rate_limit(&mut self, name: &str, b: &[u8]) -> Result<Response, Response> {
        #[derive(serde::Deserialize)]
        #[serde(deny_unknown_fields)]
        struct Req {
            id: String,
            rate_limiter_config: serde_json::Value,
        }
        let req: Req = body(name, b)?;
        let cfg = match req.rate_limiter_config {
            serde_json::Value::Null => None,
            v => Some(
                super::config::rate_limiter_config("rate_limiter_config", v)
                    .map_err(|e| Response::error(400, format!("{name}: {e}")))?,
            ),
        };
        let Some(m) = &self.vm else {
            return Err(no_vm(name));
        };
        let vm = match &m.state {
            VmState::Running(vm) | VmState::Paused(vm) => vm,
            _ => {
                return Err(Response::error(
                    500,
                    format!(
                        "{name}: the VM is {}, not Running or Paused",
                        m.state_name()
                    ),
                ))
            }
        };
        match vm.devices().set_rate_limit(&req.id, cfg) {
            Ok(()) => Ok(Response::empty()),
            Err(e @ RateLimitError::NoSuchDevice(_)) => {
                Err(Response::error(404, format!("{name}: {e}")))
            }
            Err(e) => Err(Response::error(400, format!("{name}: {e}"))),
        }
    }

    /// `f` on the VM when it is in a state `need` allows.
    fn on_vm<T: Serialize>(
        &self,
        name: &str,
        need: Need,
        f: impl FnOnce(&Vm) -> Result<T, OpError>,
    ) -> Result<Response, Response> {
        let Some(m) = &self.vm else {
            return Err(no_vm(name));
        };
        let vm = match (&m.state, need) {
            (VmState::Running(vm), _) | (VmState::Paused(vm), Need::Booted) => vm,
            _ => {
                let want = match need {
                    Need::Running => "Running",
                    Need::Booted => "Running or Paused",
                };
                return Err(Response::error(
                    500,
                    format!("{name}: the VM is {}, not {want}", m.state_name()),
                ));
            }
        };
        match f(vm) {
            Ok(a) => answer(&a),
            Err(e @ (OpError::Request(_) | OpError::NotSymbiotic(_))) => {
                Err(Response::error(400, e.to_string()))
            }
            Err(e @ OpError::Failed(_)) => Err(Response::error(500, e.to_string())),
        }
    }
}

/// The VM states an operation works in: a SymCall or a module needs running vCPUs.
#[derive(Clone, Copy)]
enum Need {
    Running,
    Booted,
}

fn body<T: DeserializeOwned>(name: &str, b: &[u8]) -> Result<T, Response> {
    serde_json::from_slice(b).map_err(|e| {
        Response::error(
            400,
            format!("{name}: the body is not what it takes: {e} (docs/api.md)"),
        )
    })
}

fn answer(a: &impl Serialize) -> Result<Response, Response> {
    serde_json::to_value(a)
        .map(|v| Response::json(200, &v))
        .map_err(|e| Response::error(500, format!("the answer is not JSON: {e}")))
}
