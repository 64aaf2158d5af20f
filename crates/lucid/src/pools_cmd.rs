//! `lucid pools`: define, show and tear down the host's CPU pools (docs/scheduling.md).
//!
//! There is no daemon: `create` writes the host-wide state directory (default
//! `/run/lucid/pools`, env `LUCID_POOLS_DIR`) and makes the cgroups; every `lucid run` joins
//! the pools it finds there and publishes `vms/<pid>.json`, which `show` reads together with
//! what the kernel says about each listed thread (affinity, cgroup, policy).

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use lucid_pools::def::{self, Created, Destroyed, PoolDef, PoolSet, StateDir, VmRecord};
use lucid_pools::place::{self, Backend, ReadBack};
use lucid_pools::policy;
use serde_json::{json, Value};

#[derive(clap::Subcommand)]
pub enum PoolsCmd {
    /// Define the host's pools and make their cgroups (idempotent: the same definition again
    /// changes nothing).
    Create {
        #[arg(long = "def", value_name = "DEF", help = def::DEF.help(), value_parser = parse_def)]
        defs: Vec<PoolDef>,
        /// Read the pools from a JSON file instead: {"pools":[{"name":..,"cpus":[..],"policy":..}]}.
        #[arg(long, value_name = "FILE", conflicts_with = "defs")]
        from_json: Option<PathBuf>,
        /// Placement backend: v1 (cgroup v1 cpusets), v2 (cgroup v2 cpusets, threaded subtree)
        /// or affinity (sched_setaffinity only). Default: detected (env LUCID_POOLS_BACKEND).
        #[arg(long, value_name = "v1|v2|affinity")]
        backend: Option<String>,
    },
    /// Show the pools, their CPUs and policies, the VMs and threads in each (as the kernel
    /// reports them) and the VMs' latest monitor figures.
    Show {
        /// One JSON object instead of text.
        #[arg(long)]
        json: bool,
        /// Refresh every --interval seconds until interrupted (JSON: one object per line).
        #[arg(long)]
        watch: bool,
        #[arg(long, default_value_t = 1.0, value_name = "SECONDS")]
        interval: f64,
    },
    /// Remove the pools (cgroups and state files). Refuses while VMs use them unless --force,
    /// which moves their threads back to the default policy on every CPU.
    Destroy {
        #[arg(long)]
        force: bool,
    },
}

pub fn run(cmd: PoolsCmd) -> Result<ExitCode, String> {
    let state = StateDir::from_env();
    match cmd {
        PoolsCmd::Create {
            defs,
            from_json,
            backend,
        } => create(&state, &defs, from_json, backend),
        PoolsCmd::Show {
            json,
            watch,
            interval,
        } => show(&state, json, watch, interval),
        PoolsCmd::Destroy { force } => {
            match def::destroy(&state, force).map_err(err)? {
                Destroyed::Nothing => {
                    println!(
                        "no pools defined in {}: nothing to destroy",
                        state.dir.display()
                    );
                    Ok(ExitCode::SUCCESS)
                }
                Destroyed::Removed { evicted_vms } => {
                    println!("pools in {} destroyed", state.dir.display());
                    if evicted_vms > 0 {
                        println!("{evicted_vms} live VM(s) moved back to the default policy on every CPU");
                    }
                    Ok(ExitCode::SUCCESS)
                }
            }
        }
    }
}

fn err(e: impl std::error::Error + 'static) -> String {
    lucid_vmm::error_chain(&e)
}

/// `--def`, checked by clap so that a bad definition is a usage error.
fn parse_def(s: &str) -> Result<PoolDef, String> {
    PoolDef::parse(s).map_err(err)
}

fn create(
    state: &StateDir,
    defs: &[PoolDef],
    from_json: Option<PathBuf>,
    backend: Option<String>,
) -> Result<ExitCode, String> {
    let set = match from_json {
        Some(path) => {
            let text = std::fs::read_to_string(&path)
                .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
            PoolSet::from_json(&text).map_err(err)?
        }
        None => PoolSet::new(defs.to_vec(), &def::online_cpus().map_err(err)?).map_err(err)?,
    };
    let forced = match backend.as_deref() {
        None => place::backend_from_env().map_err(err)?,
        Some("v1") => Some(Backend::CpusetV1),
        Some("v2") => Some(Backend::CpusetV2),
        Some("affinity") => Some(Backend::Affinity),
        Some(b) => return Err(format!("bad --backend {b:?}: expected v1, v2 or affinity")),
    };
    match def::create(state, &set, forced).map_err(err)? {
        Created::New(h) => println!(
            "created {} pool(s) in {} ({}{})",
            h.pools.len(),
            state.dir.display(),
            h.backend,
            h.cgroup
                .as_ref()
                .map(|c| format!(", cgroup {}", c.display()))
                .unwrap_or_default()
        ),
        Created::Repaired(h) => println!(
            "the pools in {} had lost their cgroups: made them again under {}",
            state.dir.display(),
            h.cgroup
                .as_ref()
                .map(|c| c.display().to_string())
                .unwrap_or_default()
        ),
        Created::Existing(_) => println!(
            "the same pools already exist in {}: nothing changed",
            state.dir.display()
        ),
    }
    Ok(ExitCode::SUCCESS)
}

fn show(state: &StateDir, json: bool, watch: bool, interval: f64) -> Result<ExitCode, String> {
    let interval = watch_interval(interval)?;
    loop {
        let report = report(state)?;
        if json {
            let text = match watch {
                true => report.to_string(),
                false => serde_json::to_string_pretty(&report).expect("JSON of plain values"),
            };
            println!("{text}");
        } else {
            if watch {
                // Home and clear, like watch(1).
                print!("\x1b[H\x1b[2J");
            }
            print!("{}", text(&report));
        }
        if !watch {
            return Ok(ExitCode::SUCCESS);
        }
        std::thread::sleep(interval);
    }
}

/// `--interval` as a duration, 0.1 s to 1 h (NaN would panic `Duration::from_secs_f64`).
fn watch_interval(secs: f64) -> Result<Duration, String> {
    match secs.is_nan() {
        true => Err("--interval NaN: give seconds, e.g. --interval 1 or 0.5".into()),
        false => Ok(Duration::from_secs_f64(secs.clamp(0.1, 3600.0))),
    }
}

fn read_back_json(r: &Result<ReadBack, place::PlaceError>) -> Value {
    match r {
        Ok(r) => json!({
            "cpus": def::format_cpu_list(&r.affinity),
            "cgroup": r.cgroup,
            "policy": r.policy.to_string(),
            "priority": r.priority,
            "nice": r.nice,
            "slice_ns": r.slice_ns,
        }),
        Err(e) => json!({ "error": e.to_string() }),
    }
}

/// Everything `show` prints, as one JSON value (the `--json` output).
fn report(state: &StateDir) -> Result<Value, String> {
    let host = state.load().map_err(err)?;
    // Listing cleans stale VM files only when we may write there; reading never needs it.
    let vms: Vec<VmRecord> = state.vms(host.is_some());
    let Some(host) = host else {
        return Ok(json!({
            "dir": state.dir,
            "defined": false,
            "pools": [],
            "vms": vms,
        }));
    };
    let thread_json = |t: &def::VmThread| {
        json!({
            "tid": t.tid,
            "name": t.name,
            "role": t.role,
            "pool": t.pool,
            "admission": t.admission,
            "kernel": read_back_json(&place::read_back(t.tid)),
        })
    };
    let pools: Vec<Value> = host
        .pools
        .iter()
        .map(|p| {
            let dir = host.cgroup.as_ref().map(|c| c.join(&p.name));
            let tasks = dir
                .as_ref()
                .map(|d| place::cgroup_tids(d, host.backend).len());
            let in_pool: Vec<Value> = vms
                .iter()
                .filter_map(|v| {
                    let threads: Vec<Value> = v
                        .threads
                        .iter()
                        .filter(|t| t.pool.as_deref() == Some(p.name.as_str()))
                        .map(thread_json)
                        .collect();
                    (!threads.is_empty())
                        .then(|| json!({ "pid": v.pid, "name": v.name, "threads": threads }))
                })
                .collect();
            let mut o = json!({
                "name": p.name,
                "cpus": p.cpus,
                "cpu_list": def::format_cpu_list(&p.cpus),
                "policy": p.policy.to_string(),
                "backends": p.backends,
                "halt_poll_ns": p.policy.halt_poll_ns(),
                "slice_ns": p.slice_ns(),
                "cgroup": dir,
                "cgroup_tasks": tasks,
                "vms": in_pool,
            });
            if p.policy == def::Policy::Noop {
                let (slots, waiting) = policy::admission_state(state, p);
                o["slots"] = json!(slots
                    .iter()
                    .map(|s| json!({
                        "cpu": s.cpu,
                        "held": s.held,
                        "holder": s.holder.map(|(pid, tid)| json!({"pid": pid, "tid": tid})),
                    }))
                    .collect::<Vec<_>>());
                o["waiting"] = json!(waiting
                    .iter()
                    .map(|(pid, tid)| json!({"pid": pid, "tid": tid}))
                    .collect::<Vec<_>>());
            }
            o
        })
        .collect();
    let vm_json: Vec<Value> = vms
        .iter()
        .map(|v| {
            json!({
                "pid": v.pid,
                "name": v.name,
                "pool": v.pool,
                "threads": v.threads.iter().map(thread_json).collect::<Vec<_>>(),
                "monitor": v.monitor,
                "extra": v.extra,
            })
        })
        .collect();
    Ok(json!({
        "dir": state.dir,
        "defined": true,
        "backend": host.backend.to_string(),
        "cgroup": host.cgroup,
        "created": host.created,
        "pools": pools,
        "vms": vm_json,
    }))
}

/// Flattens the monitor figures to `key=value` words (nested keys joined with '.').
fn flatten(prefix: &str, v: &Value, out: &mut Vec<String>) {
    match v {
        Value::Object(m) => {
            for (k, v) in m {
                let key = match prefix.is_empty() {
                    true => k.clone(),
                    false => format!("{prefix}.{k}"),
                };
                flatten(&key, v, out);
            }
        }
        Value::Null => {}
        Value::Number(n) => match n.as_f64() {
            Some(f) if n.is_f64() => out.push(format!("{prefix}={f:.3}")),
            _ => out.push(format!("{prefix}={n}")),
        },
        Value::String(s) => out.push(format!("{prefix}={s}")),
        other => out.push(format!("{prefix}={other}")),
    }
}

fn kernel_text(k: &Value) -> String {
    if let Some(e) = k.get("error").and_then(Value::as_str) {
        return format!("({e})");
    }
    let s = |key: &str| {
        k.get(key)
            .map(|v| v.to_string().replace('"', ""))
            .unwrap_or_default()
    };
    let mut out = format!("{} ", s("policy"));
    match s("policy").as_str() {
        "SCHED_FIFO" | "SCHED_RR" => out += &format!("prio {}", s("priority")),
        _ => {
            out += &format!("nice {}", s("nice"));
            let slice = k.get("slice_ns").and_then(Value::as_u64).unwrap_or(0);
            if slice > 0 {
                out += &format!(" slice {:.1}ms", slice as f64 / 1e6);
            }
        }
    }
    format!("{out}, cpus {}, cgroup {}", s("cpus"), s("cgroup"))
}

/// The text form of [`report`].
fn text(r: &Value) -> String {
    use std::fmt::Write;
    let mut o = String::new();
    let dir = r["dir"].as_str().unwrap_or("?");
    if r["defined"] != json!(true) {
        let _ = writeln!(
            o,
            "no pools defined in {dir} (create them with `lucid pools create --def name=NAME,cpus=LIST,policy=noop|io|cpu|default`)"
        );
        return o;
    }
    let _ = writeln!(
        o,
        "pools in {dir} ({}{})",
        r["backend"].as_str().unwrap_or("?"),
        r["cgroup"]
            .as_str()
            .map(|c| format!(", cgroup {c}"))
            .unwrap_or_default()
    );
    let _ = writeln!(
        o,
        "{:<12} {:<8} {:<8} {:<9} {:<10} {:<8} {:>7}  VMS",
        "POOL", "CPUS", "POLICY", "BACKENDS", "HALT-POLL", "SLICE", "THREADS"
    );
    let empty = Vec::new();
    for p in r["pools"].as_array().unwrap_or(&empty) {
        let vms = p["vms"].as_array().unwrap_or(&empty);
        let threads: usize = vms
            .iter()
            .map(|v| v["threads"].as_array().map_or(0, Vec::len))
            .sum();
        let halt = match p["halt_poll_ns"].as_u64() {
            None => "default".to_string(),
            Some(0) => "off".to_string(),
            Some(n) => format!("{}us", n / 1000),
        };
        let slice = match p["slice_ns"].as_u64() {
            None => "default".to_string(),
            Some(n) => format!("{:.2}ms", n as f64 / 1e6),
        };
        let backends = match p["backends"] == json!(true) {
            true => "yes",
            false => "no",
        };
        let _ = writeln!(
            o,
            "{:<12} {:<8} {:<8} {:<9} {:<10} {:<8} {:>7}  {}",
            p["name"].as_str().unwrap_or("?"),
            p["cpu_list"].as_str().unwrap_or("?"),
            p["policy"].as_str().unwrap_or("?"),
            backends,
            halt,
            slice,
            threads,
            vms.len()
        );
        if let Some(slots) = p["slots"].as_array() {
            let held: Vec<String> = slots
                .iter()
                .map(
                    |s| match (s["held"] == json!(true), s["holder"].is_null()) {
                        (false, _) => format!("cpu{}: free", s["cpu"]),
                        (true, true) => format!("cpu{}: held", s["cpu"]),
                        (true, false) => format!(
                            "cpu{}: pid {} tid {}",
                            s["cpu"], s["holder"]["pid"], s["holder"]["tid"]
                        ),
                    },
                )
                .collect();
            let waiting = p["waiting"].as_array().map_or(0, Vec::len);
            let _ = writeln!(
                o,
                "{:<12} slots: {}; waiting: {waiting}",
                "",
                held.join(", ")
            );
        }
    }
    let vms = r["vms"].as_array().unwrap_or(&empty);
    if vms.is_empty() {
        let _ = writeln!(o, "no VMs running in the pools");
        return o;
    }
    let _ = writeln!(o, "VMs:");
    for v in vms {
        let mut extra = Vec::new();
        flatten("", &v["extra"], &mut extra);
        let _ = writeln!(
            o,
            "  pid {} {:?}, pool {}{}",
            v["pid"],
            v["name"].as_str().unwrap_or(""),
            v["pool"].as_str().unwrap_or("none"),
            match extra.is_empty() {
                true => String::new(),
                false => format!(" ({})", extra.join(" ")),
            }
        );
        for t in v["threads"].as_array().unwrap_or(&empty) {
            let _ = writeln!(
                o,
                "    {:<16} tid {:<7} {:<8} -> {:<10} {}{}",
                t["name"].as_str().unwrap_or(""),
                t["tid"],
                t["role"].as_str().unwrap_or(""),
                t["pool"].as_str().unwrap_or("-"),
                t["admission"]
                    .as_str()
                    .map(|a| format!("[{a}] "))
                    .unwrap_or_default(),
                kernel_text(&t["kernel"])
            );
        }
        let mut words = Vec::new();
        flatten("", &v["monitor"], &mut words);
        if !words.is_empty() {
            let mut line = String::from("    monitor:");
            for w in words {
                if line.len() + w.len() > 100 {
                    let _ = writeln!(o, "{line}");
                    line = String::from("            ");
                }
                line.push(' ');
                line.push_str(&w);
            }
            let _ = writeln!(o, "{line}");
        }
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn watch_interval_refuses_nan_and_clamps() {
        assert!(watch_interval(f64::NAN).unwrap_err().contains("--interval"));
        assert_eq!(watch_interval(-1.0).unwrap(), Duration::from_millis(100));
        assert_eq!(
            watch_interval(f64::INFINITY).unwrap(),
            Duration::from_secs(3600)
        );
        assert_eq!(watch_interval(0.5).unwrap(), Duration::from_millis(500));
    }

    #[test]
    fn report_reads_back_the_threads_vms_publish() {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            return lucid_guests::skip_or_fail("needs root (it places a thread in a cgroup)");
        }
        let base = std::env::temp_dir().join(format!("lucid-p1-cmd-{}", std::process::id()));
        let state = StateDir::new(base.join("state"), "unused");
        /// Removes the test's directory even when an assertion fails.
        struct Cleanup(std::path::PathBuf);
        impl Drop for Cleanup {
            fn drop(&mut self) {
                let _ = std::fs::remove_dir_all(&self.0);
            }
        }
        let _cleanup = Cleanup(base.clone());
        let set = PoolSet::parse_defs(&["name=all,cpus=0,policy=cpu"]).unwrap();
        def::create(&state, &set, Some(Backend::Affinity)).unwrap();
        let placer = place::Placer::open(&state).unwrap().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let (stop, wait) = std::sync::mpsc::channel::<()>();
        let h = std::thread::spawn(move || {
            // SAFETY: gettid has no preconditions.
            tx.send(unsafe { libc::gettid() }).unwrap();
            let _ = wait.recv();
        });
        let tid = rx.recv().unwrap();
        placer.place_thread(tid, "all").unwrap();
        let mut rec = VmRecord::for_self("vm1");
        rec.pool = Some("all".into());
        rec.threads.push(def::VmThread {
            tid,
            name: "lucid-vcpu0".into(),
            role: "vcpu0".into(),
            pool: Some("all".into()),
            admission: None,
        });
        rec.monitor = json!({"demand": 0.5});
        state.write_vm(&rec).unwrap();
        let r = report(&state).unwrap();
        let t = &r["pools"][0]["vms"][0]["threads"][0];
        assert_eq!(t["kernel"]["policy"], "SCHED_BATCH", "{r}");
        assert_eq!(t["kernel"]["nice"], 10);
        assert_eq!(t["kernel"]["cpus"], "0");
        assert_eq!(r["vms"][0]["monitor"]["demand"], 0.5);
        let txt = text(&r);
        assert!(
            txt.contains("SCHED_BATCH nice 10")
                && txt.contains("cpus 0,")
                && txt.contains("demand=0.500"),
            "{txt}"
        );
        drop(stop);
        h.join().unwrap();
        state.remove_vm(rec.pid);
        def::destroy(&state, false).unwrap();
        assert!(!state.dir.exists());
    }

    #[test]
    fn text_of_no_pools_says_how_to_create() {
        let t = text(&json!({"dir": "/x", "defined": false, "pools": [], "vms": []}));
        assert!(t.contains("lucid pools create"), "{t}");
    }

    #[test]
    fn text_lists_pools_threads_and_monitor() {
        let r = json!({
            "dir": "/x", "defined": true, "backend": "cpuset-v1", "cgroup": "/cg",
            "pools": [{"name": "io", "cpu_list": "0", "policy": "io", "backends": false,
                       "halt_poll_ns": 200000, "slice_ns": 700000,
                       "vms": [{"pid": 5, "threads": [{}]}]},
                      {"name": "be", "cpu_list": "1", "policy": "noop", "backends": true,
                       "halt_poll_ns": null, "vms": [],
                       "slots": [{"cpu": 1, "held": true, "holder": {"pid": 5, "tid": 7}}],
                       "waiting": []}],
            "vms": [{"pid": 5, "name": "a", "pool": "io",
                     "threads": [{"tid": 6, "name": "lucid-vcpu0", "role": "vcpu0", "pool": "io",
                                  "kernel": {"policy": "SCHED_OTHER", "nice": 0,
                                             "slice_ns": 3000000, "cpus": "0", "cgroup": "/cg/io"}}],
                     "monitor": {"ms_lost_per_mb": {"guest_to_backend": 0.25}},
                     "extra": {"label": "io-bound"}}]
        });
        let t = text(&r);
        for want in [
            "cpuset-v1",
            "200us",
            "0.70ms",
            "cpu1: pid 5 tid 7",
            "lucid-vcpu0",
            "slice 3.0ms",
            "ms_lost_per_mb.guest_to_backend=0.250",
            "(label=io-bound)",
        ] {
            assert!(t.contains(want), "{want:?} missing in\n{t}");
        }
    }
}
