//! `lucid sym --socket PATH <cmd>`: a client of the REST API (`lucid run --api-socket PATH`,
//! docs/api.md) for Lucid's own endpoints, `/api/v1/lucid.*`: SymCalls, modules, the SymSpy
//! pages and the statistics, and `vmm.shutdown` to stop. One HTTP/1.1 request per connection
//! (the API's own types, `lucid_vmm::api::proto`); `--json` prints the answer's body as the
//! API sent it.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use lucid_vmm::api::proto::{
    CallName, Counters, ModuleInfo, ModuleList, ModuleLoad, ModuleUnload, SymReturn, Symcall,
    Unloaded,
};
use serde::de::DeserializeOwned;
use serde_json::Value;

/// How long the client waits for a reply (a SymCall is bounded by its timeout, 1 s by default
/// and at most 10 s, a module load by the guest loader's timeout).
const REPLY_PATIENCE: Duration = Duration::from_secs(30);

#[derive(clap::Args)]
pub struct SymArgs {
    /// The VMM's API socket (`lucid run --api-socket PATH`).
    #[arg(long, value_name = "PATH")]
    socket: PathBuf,
    /// Print the body of the API's answer as is.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    cmd: SymCmd,
}

#[derive(clap::Subcommand)]
enum SymCmd {
    /// Run a SymCall in the guest and print what it returned.
    Call {
        /// The vCPU that runs it.
        #[arg(long, default_value_t = 0)]
        vcpu: u32,
        /// echo, page_state, read_counter, slot_live, or a call number (decimal or 0x hex).
        call: String,
        /// Up to 5 arguments (rdi, rsi, rdx, r10, r8), decimal or 0x hex.
        args: Vec<String>,
        /// Cut the call off after this many ms (1-10000; default: the VM's bound, 1 s).
        #[arg(long, value_name = "MS")]
        timeout_ms: Option<u64>,
    },
    /// Load a module (an ELF64 relocatable object) into the running guest.
    Load {
        /// The object file (Lucid reads it: the path is made absolute here).
        #[arg(required_unless_present = "builtin")]
        file: Option<PathBuf>,
        /// A module built into Lucid instead of a file.
        #[arg(long, conflicts_with = "file", value_name = "NAME")]
        builtin: Option<String>,
        /// Place its code in read-only guest memory.
        #[arg(long)]
        read_only: bool,
    },
    /// Unload module ID.
    Unload { id: u32 },
    /// The modules loaded now.
    Modules,
    /// The SymSpy pages the guest registered, and their fields.
    Spy,
    /// The VMM's and the VM's statistics (the counters of --stats-json, and rest.*).
    Stats,
    /// Stop the VM and the VMM (`vmm.shutdown`).
    Stop,
}

fn number(s: &str) -> Result<u64, String> {
    match s.strip_prefix("0x") {
        Some(h) => u64::from_str_radix(h, 16),
        None => s.parse(),
    }
    .map_err(|_| format!("{s:?} is not a number (decimal or 0x hex)"))
}

/// One API request: method, endpoint under `/api/v1/`, body.
struct ApiRequest {
    method: &'static str,
    endpoint: &'static str,
    body: Option<Value>,
}

fn put(endpoint: &'static str, body: impl serde::Serialize) -> Result<ApiRequest, String> {
    Ok(ApiRequest {
        method: "PUT",
        endpoint,
        body: Some(serde_json::to_value(body).map_err(|e| e.to_string())?),
    })
}

fn get(endpoint: &'static str) -> ApiRequest {
    ApiRequest {
        method: "GET",
        endpoint,
        body: None,
    }
}

/// The request of `cmd`.
fn request(cmd: &SymCmd) -> Result<ApiRequest, String> {
    match cmd {
        SymCmd::Call {
            vcpu,
            call,
            args,
            timeout_ms,
        } => {
            if args.len() > 5 {
                return Err(format!(
                    "a SymCall takes at most 5 arguments, got {}",
                    args.len()
                ));
            }
            let args = args
                .iter()
                .map(|a| number(a))
                .collect::<Result<Vec<_>, _>>()?;
            // Numbers go as numbers; names as the API knows them.
            let call = match number(call) {
                Ok(n) => CallName::Number(n),
                Err(_) => CallName::Name(call.clone()),
            };
            put(
                "lucid.symcall",
                Symcall {
                    vcpu: *vcpu,
                    call,
                    args,
                    timeout_ms: *timeout_ms,
                },
            )
        }
        SymCmd::Load {
            file,
            builtin,
            read_only,
        } => {
            let load = match (file, builtin) {
                (_, Some(name)) => ModuleLoad {
                    path: None,
                    builtin: Some(name.clone()),
                    read_only: *read_only,
                },
                (Some(f), None) => ModuleLoad {
                    // Lucid resolves paths from its own working directory.
                    path: Some(
                        std::fs::canonicalize(f)
                            .map_err(|e| format!("module file {}: {e}", f.display()))?,
                    ),
                    builtin: None,
                    read_only: *read_only,
                },
                (None, None) => return Err("load: give a FILE or --builtin NAME".into()),
            };
            put("lucid.module-load", load)
        }
        SymCmd::Unload { id } => put("lucid.module-unload", ModuleUnload { id: *id }),
        SymCmd::Modules => Ok(get("lucid.modules")),
        SymCmd::Spy => Ok(get("lucid.spy")),
        SymCmd::Stats => Ok(get("lucid.stats")),
        SymCmd::Stop => Ok(ApiRequest {
            method: "PUT",
            endpoint: "vmm.shutdown",
            body: None,
        }),
    }
}

/// Sends `req` over a connection of its own (`lucid_bench::http`, the client `lucid top` and
/// the benchmarks use too); the status and the body of the answer.
fn exchange(socket: &std::path::Path, req: &ApiRequest) -> Result<(u16, String), String> {
    let body = req.body.as_ref().map(Value::to_string);
    let path = format!("/api/v1/{}", req.endpoint);
    let reply =
        lucid_bench::http::request(socket, req.method, &path, body.as_deref(), REPLY_PATIENCE)
            .map_err(|e| {
                format!(
                    "{} (is Lucid running with --api-socket?)",
                    lucid_vmm::error_chain(&e)
                )
            })?;
    let text = String::from_utf8(reply.body).map_err(|_| "a reply body that is not UTF-8")?;
    Ok((reply.status, text))
}

pub fn run(a: SymArgs) -> Result<ExitCode, String> {
    let req = request(&a.cmd)?;
    let (status, body) = exchange(&a.socket, &req)?;
    if status >= 400 {
        return Err(refusal(status, &body));
    }
    // Decoded also for --json: an answer the client cannot read is an error either way.
    let text = human(&a.cmd, &body)?;
    if a.json {
        println!("{body}");
    } else {
        print!("{text}");
    }
    Ok(ExitCode::SUCCESS)
}

/// The API's refusal in words: Cloud Hypervisor's body is a JSON array of messages.
fn refusal(status: u16, body: &str) -> String {
    match serde_json::from_str::<Vec<String>>(body) {
        Ok(msgs) if !msgs.is_empty() => msgs.join(": "),
        _ => format!("the API answered {status}: {body}"),
    }
}

/// The answer in a body.
fn answer<T: DeserializeOwned>(body: &str) -> Result<T, String> {
    serde_json::from_str::<T>(body).map_err(|e| format!("bad answer {body:?}: {e}"))
}

/// The answer as text: `key=value` lines (the tests parse them), a table for the modules.
fn human(cmd: &SymCmd, body: &str) -> Result<String, String> {
    let mut out = String::new();
    match cmd {
        SymCmd::Call { .. } => {
            let r: SymReturn = answer(body)?;
            let [v0, v1] = r.values;
            out += &format!("status={}\n", r.status);
            out += &format!("value0={v0} ({v0:#x})\n");
            out += &format!("value1={v1} ({v1:#x})\n");
            out += &format!("exits={}\n", r.exits);
            out += &format!("ns={}\n", r.ns);
        }
        SymCmd::Load { .. } => module_lines(&mut out, &answer(body)?),
        SymCmd::Unload { .. } => {
            let u: Unloaded = answer(body)?;
            out += &format!("unloaded={}\n", u.id);
        }
        SymCmd::Modules => out += &modules_table(&answer::<ModuleList>(body)?.modules),
        SymCmd::Spy => flat(&mut out, "", &answer::<Value>(body)?, &[]),
        SymCmd::Stats => flat(&mut out, "", &answer::<Counters>(body)?.counters, &[]),
        SymCmd::Stop => out += "stopping\n",
    }
    Ok(out)
}

fn modules_table(list: &[ModuleInfo]) -> String {
    if list.is_empty() {
        return "no modules loaded\n".into();
    }
    let mut out = format!(
        "{:>4}  {:<20} {:>18} {:>8}  {:<3}  {:>10}\n",
        "id", "name", "base", "size", "ro", "init"
    );
    for m in list {
        out += &format!(
            "{:>4}  {:<20} {:>#18x} {:>8}  {:<3}  {:>10}\n",
            m.id,
            m.name,
            m.base,
            m.size,
            if m.read_only { "yes" } else { "no" },
            m.init_result,
        );
    }
    out
}

fn module_lines(out: &mut String, m: &ModuleInfo) {
    *out += &format!("id={}\nname={}\nbase={:#x}\n", m.id, m.name, m.base);
    *out += &format!("size={}\nread_only={}\n", m.size, m.read_only);
    *out += &format!("init_result={}\nload_us={}\n", m.init_result, m.load_us);
}

/// `a.b.c=value` lines of a JSON tree (array items by index), skipping top-level `skip` keys.
fn flat(out: &mut String, prefix: &str, v: &Value, skip: &[&str]) {
    let join = |k: &str| match prefix {
        "" => k.to_string(),
        p => format!("{p}.{k}"),
    };
    match v {
        Value::Object(m) => {
            for (k, v) in m.iter().filter(|(k, _)| !skip.contains(&k.as_str())) {
                flat(out, &join(k), v, &[]);
            }
        }
        Value::Array(a) => {
            for (i, v) in a.iter().enumerate() {
                flat(out, &join(&i.to_string()), v, &[]);
            }
        }
        Value::String(s) => *out += &format!("{prefix}={s}\n"),
        v => *out += &format!("{prefix}={v}\n"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn wire(cmd: &SymCmd) -> Result<Value, String> {
        request(cmd).map(|r| r.body.unwrap_or(Value::Null))
    }

    #[test]
    fn requests_from_the_command_line() {
        let call = SymCmd::Call {
            vcpu: 1,
            call: "echo".into(),
            args: vec!["1".into(), "0x10".into()],
            timeout_ms: None,
        };
        assert_eq!(request(&call).unwrap().endpoint, "lucid.symcall");
        assert_eq!(
            wire(&call).unwrap(),
            json!({"vcpu":1,"call":"echo","args":[1,16]})
        );
        let call = SymCmd::Call {
            vcpu: 0,
            call: "0x101".into(),
            args: vec![],
            timeout_ms: Some(5000),
        };
        assert_eq!(wire(&call).unwrap()["call"], json!(0x101));
        assert_eq!(wire(&call).unwrap()["timeout_ms"], json!(5000));
        let bad = SymCmd::Call {
            vcpu: 0,
            call: "echo".into(),
            args: vec!["x".into()],
            timeout_ms: None,
        };
        assert!(wire(&bad).unwrap_err().contains("not a number"));
        let six = SymCmd::Call {
            vcpu: 0,
            call: "echo".into(),
            args: vec!["1".into(); 6],
            timeout_ms: None,
        };
        assert!(wire(&six).unwrap_err().contains("at most 5"));
        let load = SymCmd::Load {
            file: None,
            builtin: Some("hello".into()),
            read_only: true,
        };
        assert_eq!(
            wire(&load).unwrap(),
            json!({"builtin":"hello","read_only":true})
        );
        let stop = request(&SymCmd::Stop).unwrap();
        assert_eq!((stop.method, stop.endpoint), ("PUT", "vmm.shutdown"));
        assert!(stop.body.is_none());
        assert_eq!(request(&SymCmd::Spy).unwrap().method, "GET");
    }

    #[test]
    fn refusals() {
        assert_eq!(refusal(400, r#"["a","b"]"#), "a: b");
        assert_eq!(refusal(500, "oops"), "the API answered 500: oops");
    }

    #[test]
    fn the_modules_table_lines_up() {
        let r = json!({"modules":[
            {"id":1,"name":"hello","base":0x800000,"size":202,"read_only":false,"init_result":7,"load_us":3},
            {"id":12,"name":"counter","base":0x7000_0000u64,"size":8,"read_only":true,"init_result":512,"load_us":4},
        ]});
        let text = human(&SymCmd::Modules, &r.to_string()).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 3, "{text}");
        assert!(lines.iter().all(|l| l.len() == lines[0].len()), "{text}");
        assert!(lines[2].contains("counter") && lines[2].contains("0x70000000"));
        assert!(lines[2].contains(" yes "), "{text}");
        let none = human(&SymCmd::Modules, r#"{"modules":[]}"#).unwrap();
        assert_eq!(none, "no modules loaded\n");
        assert!(human(&SymCmd::Modules, "[]").is_err());
    }

    #[test]
    fn flat_lines() {
        let mut out = String::new();
        flat(
            &mut out,
            "",
            &json!({"ok":true,"a":{"b":1,"c":[2,{"d":"x"}]},"n":null}),
            &["ok"],
        );
        assert_eq!(out, "a.b=1\na.c.0=2\na.c.1.d=x\nn=null\n");
    }
}
