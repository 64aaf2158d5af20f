//! The CLI's logger: every `log` record from Lucid's crates becomes one line on stderr, in the
//! form the CLI has always printed (`lucid: warning: ...`). The level comes from the command
//! line (`-q`, `-v`, `--log-level`).

use std::io::Write;

use log::{Level, LevelFilter, Log, Metadata, Record};

struct StderrLogger {
    level: LevelFilter,
    /// The level for records of the VMM's library crates (every target but the CLI's own):
    /// `lucid bench` builds dozens of VMs and keeps their per-VM lines to errors by default.
    vmm_level: LevelFilter,
}

impl Log for StderrLogger {
    fn enabled(&self, m: &Metadata) -> bool {
        let cli = m.target() == "lucid" || m.target().starts_with("lucid::");
        m.level() <= if cli { self.level } else { self.vmm_level }
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

/// Installs the logger for the whole process (once); `vmm_level` applies to the library crates.
pub fn install(level: LevelFilter, vmm_level: LevelFilter) {
    let logger = StderrLogger { level, vmm_level };
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
        };
        let meta = |target, level| Metadata::builder().target(target).level(level).build();
        assert!(l.enabled(&meta("lucid::bench_io", Level::Info)));
        assert!(l.enabled(&meta("lucid", Level::Info)));
        assert!(!l.enabled(&meta("lucid_vmm::vm", Level::Warn)));
        assert!(l.enabled(&meta("lucid_pci::transport", Level::Error)));
    }
}
