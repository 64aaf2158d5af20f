//! The balloon manager's default view of host memory pressure: this process's resident set
//! against a limit, or against what the host still has available.

use std::fs::File;
use std::os::unix::fs::FileExt;

use lucid_swap::balloon_manager::{Pressure, PressureSource};

/// This process's resident set (`/proc/self/statm`) against `limit` bytes, or, without one,
/// against itself plus the host's `MemAvailable` (`/proc/meminfo`). Both files are opened when
/// it is made: the manager's thread reads them with `pread` under its seccomp filter, which
/// opens nothing.
pub struct ProcessPressure {
    statm: File,
    meminfo: File,
    limit: Option<u64>,
}

impl ProcessPressure {
    pub fn open(limit: Option<u64>) -> std::io::Result<ProcessPressure> {
        Ok(ProcessPressure {
            statm: File::open("/proc/self/statm")?,
            meminfo: File::open("/proc/meminfo")?,
            limit,
        })
    }

    fn read(f: &File) -> Option<String> {
        let mut buf = vec![0u8; 8192];
        let n = f.read_at(&mut buf, 0).ok()?;
        buf.truncate(n);
        String::from_utf8(buf).ok()
    }

    fn rss(&self) -> Option<u64> {
        let s = Self::read(&self.statm)?;
        let pages: u64 = s.split_whitespace().nth(1)?.parse().ok()?;
        // SAFETY: sysconf has no memory preconditions.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        Some(pages * u64::try_from(page).ok().filter(|&p| p > 0).unwrap_or(4096))
    }

    fn host_available(&self) -> Option<u64> {
        let s = Self::read(&self.meminfo)?;
        parse_meminfo(&s, "MemAvailable:")
    }
}

/// The value of `key` (e.g. `MemAvailable:`) in `/proc/meminfo` text, in bytes.
fn parse_meminfo(s: &str, key: &str) -> Option<u64> {
    let line = s.lines().find(|l| l.starts_with(key))?;
    let kib: u64 = line[key.len()..].split_whitespace().next()?.parse().ok()?;
    Some(kib * 1024)
}

impl PressureSource for ProcessPressure {
    fn pressure(&self) -> Pressure {
        let Some(usage) = self.rss() else {
            return Pressure::default();
        };
        let limit = match self.limit {
            Some(l) => l,
            None => match self.host_available() {
                Some(a) => usage.saturating_add(a),
                None => 0,
            },
        };
        Pressure { usage, limit }
    }
}

/// The VM's memory cgroup (`--memory-limit`): its usage against its limit, read through the
/// descriptor the limit opened (the manager's thread opens nothing).
pub struct LimitPressure(pub std::sync::Arc<lucid_swap::limit::MemoryLimit>);

impl PressureSource for LimitPressure {
    fn pressure(&self) -> Pressure {
        match self.0.usage() {
            Ok(usage) => Pressure {
                usage,
                limit: self.0.limit_bytes(),
            },
            Err(_) => Pressure::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_this_process() {
        let p = ProcessPressure::open(None).unwrap();
        let r = p.pressure();
        assert!(r.usage > 1 << 20, "{r:?}");
        assert!(r.limit > r.usage, "{r:?}");
        let p = ProcessPressure::open(Some(123 << 20)).unwrap();
        assert_eq!(p.pressure().limit, 123 << 20);
        assert_eq!(
            parse_meminfo(
                "MemTotal: 10 kB\nMemAvailable:   2048 kB\n",
                "MemAvailable:"
            ),
            Some(2 << 20)
        );
        assert_eq!(parse_meminfo("MemTotal: 10 kB\n", "MemAvailable:"), None);
    }
}
