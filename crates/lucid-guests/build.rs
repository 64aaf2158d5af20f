//! Builds the probe guests (`guests/` at the repository root) with
//! `make -C guests O=$OUT_DIR/guests`; lib.rs embeds the results.

use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

fn have(tool: &str) -> bool {
    Command::new(tool)
        .arg("--version")
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false)
}

fn main() {
    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap());
    let guests = manifest.join("../../guests");
    let guests = guests.canonicalize().unwrap_or(guests);
    let out = PathBuf::from(env::var("OUT_DIR").unwrap()).join("guests");

    for entry in ["Makefile", "lib", "x86", "host", "modules"] {
        println!("cargo:rerun-if-changed={}", guests.join(entry).display());
    }
    println!("cargo:rerun-if-env-changed=GUEST_CC");

    for tool in ["gcc", "make"] {
        if !have(tool) {
            panic!(
                "lucid-guests: `{tool}` not found; the probe guests are built from C with gcc and make. \
                 Install them with: apt-get install gcc make"
            );
        }
    }

    let jobs = env::var("NUM_JOBS").unwrap_or_else(|_| "2".into());
    let status = Command::new("make")
        .arg("-C")
        .arg(&guests)
        .arg(format!("O={}", out.display()))
        .arg(format!("-j{jobs}"))
        .env_remove("MAKEFLAGS")
        .env_remove("MFLAGS")
        .status()
        .unwrap_or_else(|e| panic!("lucid-guests: running make failed: {e}"));
    if !status.success() {
        panic!(
            "lucid-guests: `make -C {} O={}` failed ({status})",
            guests.display(),
            out.display()
        );
    }
    check_built(&out);
}

fn check_built(out: &Path) {
    for name in ["hello.elf", "compute-host", "noise-host", "modules/hello.o"] {
        let p = out.join(name);
        if !p.exists() {
            panic!("lucid-guests: make did not produce {}", p.display());
        }
    }
}
