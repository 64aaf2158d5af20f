//! How a VM ends. Any thread (a device, a vCPU, the signal thread) may ask the VM to stop; the
//! first reason wins, every vCPU is kicked out of the guest, and the main thread wakes.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};

/// A failure that stopped the VM: a typed error (for example `lucid_vmm::VcpuFault`) with its
/// source chain, shared so that every reader of the stop reason sees the same one.
pub type StopError = Arc<dyn std::error::Error + Send + Sync + 'static>;

/// Exit status of a Lucid failure (the VM could not be built or run on). Even, so that no
/// debug-exit code (odd) means it, and not 2 (a triple fault).
pub const EXIT_FAILURE: i32 = 70;
/// Exit status of a command line Lucid refuses (clap's errors, a bad sub-option, a rule of
/// `VmConfig::validate`). Even, and neither 2 nor [`EXIT_FAILURE`].
pub const EXIT_USAGE: i32 = 64;

#[derive(Clone, Debug)]
pub enum StopReason {
    /// The guest wrote `code` to the debug-exit port.
    DebugExit(u32),
    /// The guest asked for a reset (i8042, triple fault handled as reset is *not* this).
    Reset,
    /// The guest powered off (KVM system event or every vCPU halted for good).
    Shutdown,
    /// The guest triple-faulted.
    TripleFault { vcpu: u32, rip: u64 },
    /// SIGINT or SIGTERM.
    Signal(i32),
    /// The VMM could not go on.
    Error(StopError),
    /// The VMM dropped the VM while it ran.
    Dropped,
}

impl StopReason {
    /// The VM stops because of `e`.
    pub fn error(e: impl std::error::Error + Send + Sync + 'static) -> Self {
        StopReason::Error(Arc::new(e))
    }

    /// The process exit status that reports this stop: debug-exit follows QEMU (always odd),
    /// power-off and reset 0, a triple fault 2, a failure [`EXIT_FAILURE`], a signal 128 + n.
    pub fn exit_code(&self) -> i32 {
        match self {
            StopReason::DebugExit(v) => ((v << 1) | 1) as i32 & 0xff,
            StopReason::Reset | StopReason::Shutdown => 0,
            StopReason::Error(_) | StopReason::Dropped => EXIT_FAILURE,
            StopReason::TripleFault { .. } => 2,
            StopReason::Signal(s) => 128 + s,
        }
    }
}

/// Two errors are the same stop only if they are the same error.
impl PartialEq for StopReason {
    fn eq(&self, other: &Self) -> bool {
        use StopReason::*;
        match (self, other) {
            (DebugExit(a), DebugExit(b)) => a == b,
            (Reset, Reset) | (Shutdown, Shutdown) | (Dropped, Dropped) => true,
            (TripleFault { vcpu: a, rip: x }, TripleFault { vcpu: b, rip: y }) => a == b && x == y,
            (Signal(a), Signal(b)) => a == b,
            (Error(a), Error(b)) => Arc::ptr_eq(a, b),
            _ => false,
        }
    }
}

impl Eq for StopReason {}

type Kick = Box<dyn Fn() + Send + Sync>;

#[derive(Default)]
pub struct Lifecycle {
    stopping: AtomicBool,
    reason: Mutex<Option<StopReason>>,
    cv: Condvar,
    kickers: Mutex<Vec<Kick>>,
}

impl Lifecycle {
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers a way to kick one vCPU out of the guest.
    pub fn add_kicker(&self, k: Kick) {
        self.kickers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(k);
    }

    /// Asks the VM to stop; only the first reason is kept.
    pub fn stop(&self, reason: StopReason) {
        {
            let mut r = self.reason.lock().unwrap_or_else(|e| e.into_inner());
            if r.is_none() {
                *r = Some(reason);
            }
            self.stopping.store(true, Ordering::SeqCst);
        }
        self.cv.notify_all();
        for k in self
            .kickers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
        {
            k();
        }
    }

    pub fn is_stopping(&self) -> bool {
        self.stopping.load(Ordering::Relaxed)
    }

    /// Blocks until some thread calls `stop`.
    pub fn wait(&self) -> StopReason {
        let mut r = self.reason.lock().unwrap_or_else(|e| e.into_inner());
        while r.is_none() {
            r = self.cv.wait(r).unwrap_or_else(|e| e.into_inner());
        }
        r.clone().expect("checked above")
    }

    pub fn reason(&self) -> Option<StopReason> {
        self.reason
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn first_reason_wins_and_kicks() {
        let l = Arc::new(Lifecycle::new());
        let kicked = Arc::new(AtomicBool::new(false));
        let k = kicked.clone();
        l.add_kicker(Box::new(move || k.store(true, Ordering::SeqCst)));
        let l2 = l.clone();
        let t = std::thread::spawn(move || l2.wait());
        l.stop(StopReason::DebugExit(5));
        l.stop(StopReason::Reset);
        assert_eq!(t.join().unwrap(), StopReason::DebugExit(5));
        assert!(kicked.load(Ordering::SeqCst));
        assert_eq!(StopReason::DebugExit(5).exit_code(), 11);
    }
}
