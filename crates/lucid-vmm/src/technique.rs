//! One lifecycle for the techniques a VM runs besides its devices (the vIOMMU, VSWAPPER, the
//! CPU pools, the symbiotic interfaces, the balloon manager): each is built by
//! [`crate::Vm::build`], started by [`crate::Vm::start`] in list order and stopped in reverse
//! order by the one path that both [`crate::Vm::wait`] and dropping the VM take.
//!
//! Stopping has two steps around the join of the vCPU threads: [`Technique::quiesce`] while they
//! may still run (no new work; a last look at them while they are listed), then
//! [`Technique::stop`] once they are gone. Whatever a technique still owns goes when it is
//! dropped, after the VM's devices, in reverse order too: the first technique (VSWAPPER, whose
//! memory limit every guest page is charged to) goes last.

use std::sync::Arc;

use lucid_devices::Lifecycle;
use lucid_mem::GuestRam;
use lucid_stats::StatsRegistry;
use lucid_swap::balloon_manager::PressureSource;

use crate::hooks::ExitHooks;
use crate::VmmError;

/// What a technique's start may use.
pub struct StartContext<'a> {
    pub ram: &'a Arc<GuestRam>,
    pub hooks: &'a Arc<ExitHooks>,
    pub stats: &'a Arc<StatsRegistry>,
    pub lifecycle: &'a Arc<Lifecycle>,
    /// Starts the techniques' threads (named, registered, placed, confined).
    pub spawner: &'a lucid_thread::Spawner,
    /// Where the balloon manager reads host pressure, when the caller chose
    /// ([`crate::Vm::set_pressure_source`]).
    pub pressure: Option<Arc<dyn PressureSource>>,
}

/// One technique of a VM.
pub trait Technique: Send {
    /// Its name in the log.
    fn name(&self) -> &'static str;

    /// Whether it starts before the vCPU threads (the pager: guest RAM stays under the limit
    /// from their first fault) rather than after them.
    fn starts_before_vcpus(&self) -> bool {
        false
    }

    /// Starts its threads.
    fn start(&mut self, _cx: &StartContext<'_>) -> Result<(), VmmError> {
        Ok(())
    }

    /// The VM is stopping and its vCPU threads are not joined yet. Called again is harmless.
    fn quiesce(&mut self) {}

    /// The vCPU threads are joined: stops its threads. Called again is harmless.
    fn stop(&mut self) {}

    /// The prefixes of the counters it owns in the stats registry.
    fn counters(&self) -> &'static [&'static str];

    /// What it does in this VM, in a line or two (logged at debug level when it is added).
    fn summary(&self) -> Vec<String> {
        Vec::new()
    }
}

/// A VM's techniques in start order; dropped in reverse order.
#[derive(Default)]
pub(crate) struct Techniques(Vec<Box<dyn Technique>>);

impl Techniques {
    pub(crate) fn push(&mut self, t: Option<impl Technique + 'static>) {
        if let Some(t) = t {
            for line in t.summary() {
                log::debug!("{}: {line}", t.name());
            }
            self.0.push(Box::new(t));
        }
    }

    /// Starts, in order, those that start before the vCPU threads (`before`) or after them.
    pub(crate) fn start(&mut self, before: bool, cx: &StartContext<'_>) -> Result<(), VmmError> {
        for t in self.0.iter_mut() {
            if t.starts_before_vcpus() == before {
                t.start(cx)?;
            }
        }
        Ok(())
    }

    pub(crate) fn quiesce(&mut self) {
        for t in self.0.iter_mut().rev() {
            t.quiesce();
        }
    }

    pub(crate) fn stop(&mut self) {
        for t in self.0.iter_mut().rev() {
            t.stop();
        }
    }

    /// (name, counter prefixes) of each, in start order.
    pub(crate) fn list(&self) -> Vec<(&'static str, &'static [&'static str])> {
        self.0.iter().map(|t| (t.name(), t.counters())).collect()
    }
}

impl Drop for Techniques {
    fn drop(&mut self) {
        while let Some(t) = self.0.pop() {
            drop(t);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    struct Probe {
        name: &'static str,
        before: bool,
        log: Arc<Mutex<Vec<String>>>,
    }

    impl Probe {
        fn note(&self, what: &str) {
            self.log
                .lock()
                .unwrap()
                .push(format!("{what} {}", self.name));
        }
    }

    impl Technique for Probe {
        fn name(&self) -> &'static str {
            self.name
        }
        fn starts_before_vcpus(&self) -> bool {
            self.before
        }
        fn start(&mut self, _: &StartContext<'_>) -> Result<(), VmmError> {
            self.note("start");
            Ok(())
        }
        fn quiesce(&mut self) {
            self.note("quiesce");
        }
        fn stop(&mut self) {
            self.note("stop");
        }
        fn counters(&self) -> &'static [&'static str] {
            &[]
        }
    }

    impl Drop for Probe {
        fn drop(&mut self) {
            self.note("drop");
        }
    }

    #[test]
    fn techniques_stop_and_drop_in_reverse_order() {
        let log = Arc::new(Mutex::new(Vec::new()));
        let mut ts = Techniques::default();
        for (name, before) in [("a", true), ("b", false), ("c", false)] {
            let log = log.clone();
            ts.push(Some(Probe { name, before, log }));
        }
        let ram = Arc::new(GuestRam::new(&[(0, 1 << 20)], lucid_mem::Backing::Anonymous).unwrap());
        let cx = StartContext {
            ram: &ram,
            hooks: &ExitHooks::new(),
            stats: &StatsRegistry::new(),
            lifecycle: &Arc::new(Lifecycle::new()),
            spawner: &lucid_thread::Spawner::new(None, lucid_stats::ThreadRegistry::new()),
            pressure: None,
        };
        ts.start(true, &cx).unwrap();
        ts.start(false, &cx).unwrap();
        ts.quiesce();
        ts.stop();
        assert_eq!(ts.list().len(), 3);
        drop(ts);
        let want = [
            "start a",
            "start b",
            "start c",
            "quiesce c",
            "quiesce b",
            "quiesce a",
            "stop c",
            "stop b",
            "stop a",
            "drop c",
            "drop b",
            "drop a",
        ];
        assert_eq!(*log.lock().unwrap(), want);
    }
}
