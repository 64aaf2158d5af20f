//! `lucid bench sym`: the symbiotic mechanisms against the exits they save
//! (docs/symbiotic.md). Each part measures in its own file and returns `key = value` figures;
//! this file runs the parts and prints them (one JSON object with `--json`).

use std::process::ExitCode;

use serde_json::{Map, Value};

mod modules;
mod spy;
mod swapbypass;
mod symcall;

#[derive(clap::Args)]
pub struct SymArgs {
    /// One JSON object instead of text.
    #[arg(long)]
    json: bool,
    /// A smoke run: fewer iterations and smaller working sets.
    #[arg(long)]
    quick: bool,
    /// Parts to run (comma-separated: spy, symcall, swapbypass, modules).
    #[arg(long, default_value = "spy,symcall,swapbypass,modules")]
    parts: String,
}

/// What each part is given.
pub struct Opts {
    pub quick: bool,
}

/// A part's figures: (key, value), keys as in docs/symbiotic.md.
pub type Figures = Vec<(String, Value)>;

/// The parts, in the order they run: (name, header, headline keys every run reports, `null`
/// when the part could not measure them).
const PARTS: &[(&str, &str, &[&str])] = &[
    (
        "spy",
        "SymSpy, exits per guest update of its page (goal 0)",
        &["symspy_exits_per_update"],
    ),
    (
        "symcall",
        "SymCall, cold and warm latency against one userspace exit round trip (goal: warm <= 2x)",
        &[
            "symcall_cold_us",
            "symcall_warm_us",
            "symcall_warm_over_exit",
        ],
    ),
    (
        "swapbypass",
        "SwapBypass, a swapping workload on plain virtio-blk swap over the same with the swap cache",
        &["swapbypass_speedup"],
    ),
    (
        "modules",
        "symbiotic modules, load time into a running guest",
        &["module_load_us"],
    ),
];

fn run_part(part: &str, opts: &Opts) -> Result<Figures, String> {
    match part {
        "spy" => spy::run(opts),
        "symcall" => symcall::run(opts),
        "swapbypass" => swapbypass::run(opts),
        "modules" => modules::run(opts),
        _ => unreachable!("parts are checked before they run"),
    }
}

pub fn run(a: SymArgs) -> Result<ExitCode, String> {
    let opts = Opts { quick: a.quick };
    let names: Vec<&str> = PARTS.iter().map(|p| p.0).collect();
    let chosen: Vec<&str> = a
        .parts
        .split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .collect();
    // Checked before any part runs: a typo should not cost a long run.
    if let Some(p) = chosen.iter().find(|p| !names.contains(p)) {
        return Err(format!(
            "lucid bench sym: no part {p:?} ({})",
            names.join(", ")
        ));
    }
    let mut out = Map::new();
    for &(part, header, keys) in PARTS.iter().filter(|p| chosen.contains(&p.0)) {
        if !a.json {
            println!("## {part}: {header}");
        }
        let figures = match run_part(part, &opts) {
            Ok(f) => f,
            Err(e) => {
                // A part that cannot run on this host says why and the others still run.
                if !a.json {
                    println!("  not measured: {e}");
                }
                out.insert(format!("{part}_error"), Value::String(e));
                Vec::new()
            }
        };
        for (k, v) in &figures {
            if !a.json {
                println!("  {k} = {v}");
            }
        }
        out.extend(figures);
        for k in keys {
            out.entry(k.to_string()).or_insert(Value::Null);
        }
    }
    if a.json {
        println!("{}", Value::Object(out));
    }
    Ok(ExitCode::SUCCESS)
}
