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

/// The balloon manager (`--balloon ...,manager=on`) as one of the VM's techniques:
/// `lucid-balloonm` starts after the vCPU threads, confined as a back-end (it raises the
/// balloon's configuration interrupt; it reads its pressure from files opened before).
pub(crate) struct BalloonManagerTechnique {
    pub ctl: lucid_virtio::balloon::BalloonControl,
    /// The VM's memory cgroup under `--memory-limit`; else, unless the caller chose a source,
    /// this process against the host ([`ProcessPressure`]).
    pub limit_pressure: Option<std::sync::Arc<dyn PressureSource>>,
    pub manager: Option<lucid_swap::balloon_manager::BalloonManager>,
}

impl crate::technique::Technique for BalloonManagerTechnique {
    fn name(&self) -> &'static str {
        "balloon-manager"
    }

    fn start(&mut self, cx: &crate::technique::StartContext<'_>) -> Result<(), crate::VmmError> {
        use crate::VmmError::BalloonManager as Error;
        use lucid_swap::balloon_manager::{BalloonManager, SizingPolicy};
        let source = match cx.pressure.clone().or_else(|| self.limit_pressure.clone()) {
            Some(s) => s,
            None => std::sync::Arc::new(ProcessPressure::open(None).map_err(Error)?),
        };
        let m = BalloonManager::spawn(
            self.ctl.clone(),
            source,
            SizingPolicy::default(),
            std::time::Duration::from_millis(200),
            cx.stats,
            cx.spawner,
        )
        .map_err(Error)?;
        self.manager = Some(m);
        Ok(())
    }

    fn stop(&mut self) {
        if let Some(m) = self.manager.take() {
            m.stop();
        }
    }

    fn counters(&self) -> &'static [&'static str] {
        &["balloon.manager."]
    }

    fn summary(&self) -> Vec<String> {
        vec!["sizes the balloon from host memory pressure every 200 ms".into()]
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
