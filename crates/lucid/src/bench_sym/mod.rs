//! `lucid bench sym`: the symbiotic mechanisms against the exits they save (issue 9,
//! docs/symbiotic.md). Each part measures in its own file and returns `key = value` figures;
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

pub fn run(a: SymArgs) -> Result<ExitCode, String> {
    let opts = Opts { quick: a.quick };
    let mut out = Map::new();
    for part in a.parts.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let figures = match part {
            "spy" => spy::run(&opts),
            "symcall" => symcall::run(&opts),
            "swapbypass" => swapbypass::run(&opts),
            "modules" => modules::run(&opts),
            p => {
                return Err(format!(
                    "lucid bench sym: no part {p:?} (spy, symcall, swapbypass, modules)"
                ))
            }
        };
        match figures {
            Ok(f) => out.extend(f),
            Err(e) => {
                // A part that cannot run on this host says why and the others still run.
                out.insert(format!("{part}_error"), Value::String(e));
            }
        }
    }
    if a.json {
        println!("{}", Value::Object(out));
    } else {
        for (k, v) in &out {
            println!("{k} = {v}");
        }
    }
    Ok(ExitCode::SUCCESS)
}
