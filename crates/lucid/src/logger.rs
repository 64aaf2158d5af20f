//! The CLI's logger: every `log` record from Lucid's crates becomes one line on stderr, in the
//! form scripts and tests match on (`lucid: warning: ...`). The level comes from the command
//! line (`-q`, `-v`, `--log-level`).

use std::collections::HashSet;
use std::io::Write;
use std::sync::Mutex;

use log::{Level, LevelFilter, Log, Metadata, Record};

struct StderrLogger {
    level: LevelFilter,
    /// The level for records of the VMM's library crates (every target but the CLI's own and
    /// the benchmarks', which print their figures through `log`).
    vmm_level: LevelFilter,
    /// The VMM crates' lines already printed, when each is to be printed once (`lucid bench`
    /// builds dozens of VMs, which would say the same things again and again).
    seen: Option<Mutex<HashSet<String>>>,
}

fn is_cli(target: &str) -> bool {
    ["lucid", "lucid_bench"].iter().any(|c| {
        target
            .strip_prefix(c)
            .is_some_and(|rest| rest.is_empty() || rest.starts_with("::"))
    })
}

impl Log for StderrLogger {
    fn enabled(&self, m: &Metadata) -> bool {
        m.level()
            <= if is_cli(m.target()) {
                self.level
            } else {
                self.vmm_level
            }
    }

    fn log(&self, r: &Record) {
        if !self.enabled(r.metadata()) {
            return;
        }
        let line = match r.level() {
            Level::Error => format!("lucid: error: {}\n", r.args()),
            Level::Warn => format!("lucid: warning: {}\n", r.args()),
            Level::Info => format!("lucid: {}\n", r.args()),
            Level::Debug => format!("lucid: debug: {}: {}\n", r.target(), r.args()),
            Level::Trace => format!("lucid: trace: {}: {}\n", r.target(), r.args()),
        };
        if let Some(seen) = &self.seen {
            let mut seen = seen.lock().unwrap_or_else(|e| e.into_inner());
            if !is_cli(r.target()) && !seen.insert(line.clone()) {
                return;
            }
        }
        // One write per line, so lines from different threads do not interleave.
        let _ = std::io::stderr().lock().write_all(line.as_bytes());
    }

    fn flush(&self) {}
}

/// The level from the flags: `--log-level` wins; else info, `-q` warnings, each `-v` one more.
pub fn level(log_level: Option<LevelFilter>, quiet: bool, verbose: u8) -> LevelFilter {
    log_level.unwrap_or(match (quiet, verbose) {
        (true, _) => LevelFilter::Warn,
        (false, 0) => LevelFilter::Info,
        (false, 1) => LevelFilter::Debug,
        (false, _) => LevelFilter::Trace,
    })
}

/// Installs the logger for the whole process (once); `vmm_level` applies to the library crates,
/// whose lines are printed once each with `once`.
pub fn install(level: LevelFilter, vmm_level: LevelFilter, once: bool) {
    let logger = StderrLogger {
        level,
        vmm_level,
        seen: once.then(Mutex::default),
    };
    if log::set_boxed_logger(Box::new(logger)).is_ok() {
        log::set_max_level(level.max(vmm_level));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn levels_from_flags() {
        assert_eq!(level(None, false, 0), LevelFilter::Info);
        assert_eq!(level(None, true, 0), LevelFilter::Warn);
        assert_eq!(level(None, false, 1), LevelFilter::Debug);
        assert_eq!(level(None, false, 3), LevelFilter::Trace);
        assert_eq!(level(Some(LevelFilter::Error), true, 2), LevelFilter::Error);
    }

    #[test]
    fn the_vmm_crates_can_have_their_own_level() {
        let l = StderrLogger {
            level: LevelFilter::Info,
            vmm_level: LevelFilter::Error,
            seen: None,
        };
        let meta = |target, level| Metadata::builder().target(target).level(level).build();
        assert!(l.enabled(&meta("lucid_bench::io", Level::Info)));
        assert!(l.enabled(&meta("lucid::sym_cmd", Level::Info)));
        assert!(l.enabled(&meta("lucid", Level::Info)));
        assert!(!l.enabled(&meta("lucid_vmm::vm", Level::Warn)));
        assert!(l.enabled(&meta("lucid_pci::transport", Level::Error)));
    }
}
