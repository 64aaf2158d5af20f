//! `lucid sym --socket PATH <cmd>`: the client of a running VM's control API (`lucid run
//! --api-socket PATH`, docs/symbiotic.md): SymCalls, modules, the SymSpy pages and the
//! statistics. One request, one reply; `--json` prints the reply as the API sent it.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use serde_json::{json, Value};

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

/// The request line of `cmd`.
fn request(cmd: &SymCmd) -> Result<Value, String> {
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
                Ok(n) => json!(n),
                Err(_) => json!(call),
            };
            let mut req = json!({"op": "symcall", "vcpu": vcpu, "call": call, "args": args});
            if let Some(ms) = timeout_ms {
                req["timeout_ms"] = json!(ms);
            }
            req
        }
        SymCmd::Load {
            file,
            builtin,
            read_only,
        } => match (file, builtin) {
            (_, Some(name)) => {
                json!({"op": "module_load", "builtin": name, "read_only": read_only})
            }
            (Some(f), None) => {
                // Lucid resolves paths from its own working directory.
                let abs = std::fs::canonicalize(f)
                    .map_err(|e| format!("module file {}: {e}", f.display()))?;
                json!({"op": "module_load", "path": abs, "read_only": read_only})
            }
            (None, None) => return Err("load: give a FILE or --builtin NAME".into()),
        },
        SymCmd::Unload { id } => json!({"op": "module_unload", "id": id}),
        SymCmd::Modules => json!({"op": "modules"}),
        SymCmd::Spy => json!({"op": "spy"}),
        SymCmd::Stats => json!({"op": "stats"}),
        SymCmd::Stop => json!({"op": "stop"}),
    })
}

/// Sends one request and returns the reply line.
fn exchange(socket: &std::path::Path, req: &Value) -> Result<String, String> {
    let at = || format!("the control API at {}", socket.display());
    let mut s = UnixStream::connect(socket).map_err(|e| {
        format!(
            "cannot connect to {}: {e} (is the VM running with --api-socket?)",
            at()
        )
    })?;
    s.set_read_timeout(Some(REPLY_PATIENCE))
        .map_err(|e| e.to_string())?;
    let mut line = req.to_string();
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
    let reply: Value =
        serde_json::from_str(&line).map_err(|e| format!("bad reply {line:?}: {e}"))?;
    if reply["ok"] != Value::Bool(true) {
        return Err(reply["error"]
            .as_str()
            .unwrap_or("the API refused the request without saying why")
            .to_string());
    }
    if a.json {
        println!("{line}");
        return Ok(ExitCode::SUCCESS);
    }
    print!("{}", human(&a.cmd, &reply));
    Ok(ExitCode::SUCCESS)
}

/// The reply as text: `key=value` lines (the tests parse them), a table for the modules.
fn human(cmd: &SymCmd, r: &Value) -> String {
    let mut out = String::new();
    match cmd {
        SymCmd::Call { .. } => {
            let v = |i: usize| r["values"][i].as_u64().unwrap_or(0);
            out += &format!("status={}\n", r["status"]);
            out += &format!("value0={} ({:#x})\n", v(0), v(0));
            out += &format!("value1={} ({:#x})\n", v(1), v(1));
            out += &format!("exits={}\n", r["exits"]);
            out += &format!("ns={}\n", r["ns"]);
        }
        SymCmd::Load { .. } => module_lines(&mut out, r),
        SymCmd::Unload { id } => out += &format!("unloaded={id}\n"),
        SymCmd::Modules => {
            let list = r["modules"].as_array().cloned().unwrap_or_default();
            if list.is_empty() {
                out += "no modules loaded\n";
            } else {
                out += &format!(
                    "{:>4}  {:<20} {:>18} {:>8}  {:<3}  {:>10}\n",
                    "id", "name", "base", "size", "ro", "init"
                );
                for m in list {
                    let n = |k: &str| m[k].as_u64().unwrap_or(0);
                    let ro = if m["read_only"] == Value::Bool(true) {
                        "yes"
                    } else {
                        "no"
                    };
                    out += &format!(
                        "{:>4}  {:<20} {:>#18x} {:>8}  {:<3}  {:>10}\n",
                        n("id"),
                        m["name"].as_str().unwrap_or("?"),
                        n("base"),
                        n("size"),
                        ro,
                        n("init_result"),
                    );
                }
            }
        }
        SymCmd::Spy => flat(&mut out, "", r, &["ok"]),
        SymCmd::Stats => flat(&mut out, "", &r["counters"], &[]),
        SymCmd::Stop => out += "stopping\n",
    }
    out
}

fn module_lines(out: &mut String, r: &Value) {
    for key in [
        "id",
        "name",
        "base",
        "size",
        "read_only",
        "init_result",
        "load_us",
    ] {
        match (&r[key], key) {
            (Value::Number(n), "base") => {
                *out += &format!("{key}={:#x}\n", n.as_u64().unwrap_or(0))
            }
            (Value::String(s), _) => *out += &format!("{key}={s}\n"),
            (Value::Null, _) => {}
            (v, _) => *out += &format!("{key}={v}\n"),
        }
    }
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

    #[test]
    fn requests_from_the_command_line() {
        let call = SymCmd::Call {
            vcpu: 1,
            call: "echo".into(),
            args: vec!["1".into(), "0x10".into()],
            timeout_ms: None,
        };
        assert_eq!(
            request(&call).unwrap(),
            json!({"op":"symcall","vcpu":1,"call":"echo","args":[1,16]})
        );
        let call = SymCmd::Call {
            vcpu: 0,
            call: "0x101".into(),
            args: vec![],
            timeout_ms: Some(5000),
        };
        assert_eq!(request(&call).unwrap()["call"], json!(0x101));
        assert_eq!(request(&call).unwrap()["timeout_ms"], json!(5000));
        let bad = SymCmd::Call {
            vcpu: 0,
            call: "echo".into(),
            args: vec!["x".into()],
            timeout_ms: None,
        };
        assert!(request(&bad).unwrap_err().contains("not a number"));
        let six = SymCmd::Call {
            vcpu: 0,
            call: "echo".into(),
            args: vec!["1".into(); 6],
            timeout_ms: None,
        };
        assert!(request(&six).unwrap_err().contains("at most 5"));
        let load = SymCmd::Load {
            file: None,
            builtin: Some("hello".into()),
            read_only: true,
        };
        assert_eq!(
            request(&load).unwrap(),
            json!({"op":"module_load","builtin":"hello","read_only":true})
        );
    }

    #[test]
    fn the_modules_table_lines_up() {
        let r = json!({"ok":true,"modules":[
            {"id":1,"name":"hello","base":0x800000,"size":202,"read_only":false,"init_result":7},
            {"id":12,"name":"counter","base":0x7000_0000u64,"size":8,"read_only":true,"init_result":512},
        ]});
        let text = human(&SymCmd::Modules, &r);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 3, "{text}");
        assert!(lines.iter().all(|l| l.len() == lines[0].len()), "{text}");
        assert!(lines[2].contains("counter") && lines[2].contains("0x70000000"));
        assert!(lines[2].contains(" yes "), "{text}");
        let none = human(&SymCmd::Modules, &json!({"ok":true,"modules":[]}));
        assert_eq!(none, "no modules loaded\n");
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
