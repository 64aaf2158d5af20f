//! `lucid sym --socket PATH <cmd>`: the client of a running VM's control API (`lucid run
//! --api-socket PATH`, docs/symbiotic.md): SymCalls, modules, the SymSpy pages and the
//! statistics. One request, one reply (the API's own types, `lucid_vmm::api::proto`); `--json`
//! prints the reply as the API sent it.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use lucid_vmm::api::proto::{
    CallName, Counters, ModuleInfo, ModuleList, Reply, Request, Stopping, SymReturn, Unloaded,
};
use serde::de::DeserializeOwned;
use serde_json::Value;

/// How long the client waits for a reply (a SymCall is bounded by its timeout, 1 s by default
/// and at most 10 s, a module load by the guest loader's timeout).
const REPLY_PATIENCE: Duration = Duration::from_secs(30);

#[derive(clap::Args)]
pub struct SymArgs {
    /// The VM's control socket (`lucid run --api-socket PATH`).
    #[arg(long, value_name = "PATH")]
    socket: PathBuf,
    /// Print the API's JSON reply as is.
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
    /// The VM's statistics (the counters of --stats-json).
    Stats,
    /// Stop the VM.
    Stop,
}

fn number(s: &str) -> Result<u64, String> {
    match s.strip_prefix("0x") {
        Some(h) => u64::from_str_radix(h, 16),
        None => s.parse(),
    }
    .map_err(|_| format!("{s:?} is not a number (decimal or 0x hex)"))
}

/// The request of `cmd`.
fn request(cmd: &SymCmd) -> Result<Request, String> {
    Ok(match cmd {
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
            Request::Symcall {
                vcpu: *vcpu,
                call,
                args,
                timeout_ms: *timeout_ms,
            }
        }
        SymCmd::Load {
            file,
            builtin,
            read_only,
        } => match (file, builtin) {
            (_, Some(name)) => Request::ModuleLoad {
                path: None,
                builtin: Some(name.clone()),
                read_only: *read_only,
            },
            (Some(f), None) => Request::ModuleLoad {
                // Lucid resolves paths from its own working directory.
                path: Some(
                    std::fs::canonicalize(f)
                        .map_err(|e| format!("module file {}: {e}", f.display()))?,
                ),
                builtin: None,
                read_only: *read_only,
            },
            (None, None) => return Err("load: give a FILE or --builtin NAME".into()),
        },
        SymCmd::Unload { id } => Request::ModuleUnload { id: *id },
        SymCmd::Modules => Request::Modules,
        SymCmd::Spy => Request::Spy,
        SymCmd::Stats => Request::Stats,
        SymCmd::Stop => Request::Stop,
    })
}

/// Sends one request and returns the reply line.
fn exchange(socket: &std::path::Path, req: &Request) -> Result<String, String> {
    let at = || format!("the control API at {}", socket.display());
    let mut s = UnixStream::connect(socket).map_err(|e| {
        format!(
            "cannot connect to {}: {e} (is the VM running with --api-socket?)",
            at()
        )
    })?;
    s.set_read_timeout(Some(REPLY_PATIENCE))
        .map_err(|e| e.to_string())?;
    let mut line = serde_json::to_string(req).map_err(|e| e.to_string())?;
    line.push('\n');
    s.write_all(line.as_bytes())
        .map_err(|e| format!("cannot send to {}: {e}", at()))?;
    let mut reply = String::new();
    BufReader::new(s)
        .read_line(&mut reply)
        .map_err(|e| format!("no reply from {}: {e}", at()))?;
    if reply.is_empty() {
        return Err(format!("{} closed the connection without a reply", at()));
    }
    Ok(reply.trim_end().to_string())
}

pub fn run(a: SymArgs) -> Result<ExitCode, String> {
    let req = request(&a.cmd)?;
    let line = exchange(&a.socket, &req)?;
    // Decoded also for --json: a refusal is an error either way.
    let text = human(&a.cmd, &line)?;
    if a.json {
        println!("{line}");
    } else {
        print!("{text}");
    }
    Ok(ExitCode::SUCCESS)
}

/// The answer in a reply line, or the API's error.
fn answer<T: DeserializeOwned>(line: &str) -> Result<T, String> {
    serde_json::from_str::<Reply<T>>(line)
        .map_err(|e| format!("bad reply {line:?}: {e}"))?
        .into_result()
}

/// The reply as text: `key=value` lines (the tests parse them), a table for the modules.
fn human(cmd: &SymCmd, line: &str) -> Result<String, String> {
    let mut out = String::new();
    match cmd {
        SymCmd::Call { .. } => {
            let r: SymReturn = answer(line)?;
            let [v0, v1] = r.values;
            out += &format!("status={}\n", r.status);
            out += &format!("value0={v0} ({v0:#x})\n");
            out += &format!("value1={v1} ({v1:#x})\n");
            out += &format!("exits={}\n", r.exits);
            out += &format!("ns={}\n", r.ns);
        }
        SymCmd::Load { .. } => module_lines(&mut out, &answer(line)?),
        SymCmd::Unload { .. } => {
            let u: Unloaded = answer(line)?;
            out += &format!("unloaded={}\n", u.id);
        }
        SymCmd::Modules => out += &modules_table(&answer::<ModuleList>(line)?.modules),
        SymCmd::Spy => flat(&mut out, "", &answer::<Value>(line)?, &[]),
        SymCmd::Stats => flat(&mut out, "", &answer::<Counters>(line)?.counters, &[]),
        SymCmd::Stop => {
            answer::<Stopping>(line)?;
            out += "stopping\n";
        }
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
        request(cmd).map(|r| serde_json::to_value(r).unwrap())
    }

    #[test]
    fn requests_from_the_command_line() {
        let call = SymCmd::Call {
            vcpu: 1,
            call: "echo".into(),
            args: vec!["1".into(), "0x10".into()],
            timeout_ms: None,
        };
        assert_eq!(
            wire(&call).unwrap(),
            json!({"op":"symcall","vcpu":1,"call":"echo","args":[1,16]})
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
            json!({"op":"module_load","builtin":"hello","read_only":true})
        );
    }

    #[test]
    fn the_modules_table_lines_up() {
        let r = json!({"ok":true,"modules":[
            {"id":1,"name":"hello","base":0x800000,"size":202,"read_only":false,"init_result":7,"load_us":3},
            {"id":12,"name":"counter","base":0x7000_0000u64,"size":8,"read_only":true,"init_result":512,"load_us":4},
        ]});
        let text = human(&SymCmd::Modules, &r.to_string()).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 3, "{text}");
        assert!(lines.iter().all(|l| l.len() == lines[0].len()), "{text}");
        assert!(lines[2].contains("counter") && lines[2].contains("0x70000000"));
        assert!(lines[2].contains(" yes "), "{text}");
        let none = human(&SymCmd::Modules, r#"{"ok":true,"modules":[]}"#).unwrap();
        assert_eq!(none, "no modules loaded\n");
        let refused = human(&SymCmd::Modules, r#"{"ok":false,"error":"no --symbiotic"}"#);
        assert_eq!(refused.unwrap_err(), "no --symbiotic");
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
