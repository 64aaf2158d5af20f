//! Which host threads a VM runs and what each is for, so that the scheduling pools can place
//! them and the monitor can read their `schedstat`. A thread registers itself (only it knows its
//! own TID) and is dropped from the list when its guard goes.

use std::sync::{Arc, Mutex};

/// What a Lucid thread does, as the pools see it.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ThreadRole {
    /// The thread running `KVM_RUN` for vCPU `n`.
    Vcpu(u32),
    /// A device back-end (a virtio worker): it moves guest data, in the pools' back-end pool.
    Backend,
    /// Anything else (signals, serial, monitor, pager, the sidecore vIOMMU poller): the pools
    /// leave it where it started.
    Other,
}

/// One registered thread.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ThreadInfo {
    /// Kernel thread ID (`gettid`).
    pub tid: i32,
    /// The name the thread was spawned with (`lucid-vcpu0`, `lucid-blk0-io`, ...).
    pub name: String,
    pub role: ThreadRole,
}

/// The VM's thread list. One per VM, shared like the stats registry.
#[derive(Default)]
pub struct ThreadRegistry {
    threads: Mutex<Vec<ThreadInfo>>,
}

impl std::fmt::Debug for ThreadRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ThreadRegistry")
            .field("threads", &self.list())
            .finish_non_exhaustive()
    }
}

/// Keeps a thread in the registry; dropping it (when the thread ends) removes the entry.
#[derive(Debug)]
#[must_use = "the thread leaves the registry when the guard is dropped"]
pub struct ThreadGuard {
    registry: Arc<ThreadRegistry>,
    info: ThreadInfo,
}

impl ThreadGuard {
    /// The entry this guard keeps.
    pub fn info(&self) -> &ThreadInfo {
        &self.info
    }
}

impl ThreadRegistry {
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    /// Registers the calling thread under `role` and its current name.
    pub fn register_current(self: &Arc<Self>, role: ThreadRole) -> ThreadGuard {
        // SAFETY: gettid has no arguments and cannot fail.
        let tid = unsafe { libc::gettid() };
        let name = std::thread::current()
            .name()
            .unwrap_or("lucid-unnamed")
            .to_string();
        let info = ThreadInfo { tid, name, role };
        {
            let mut list = self.threads.lock().unwrap_or_else(|e| e.into_inner());
            list.retain(|t| t.tid != tid);
            list.push(info.clone());
        }
        ThreadGuard {
            registry: self.clone(),
            info,
        }
    }

    /// Whether thread `tid` is registered now (it has not ended).
    pub fn is_registered(&self, tid: i32) -> bool {
        self.threads
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .any(|t| t.tid == tid)
    }

    /// Every registered thread, in registration order.
    pub fn list(&self) -> Vec<ThreadInfo> {
        self.threads
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

impl Drop for ThreadGuard {
    fn drop(&mut self) {
        let mut list = self
            .registry
            .threads
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        list.retain(|t| t.tid != self.info.tid);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_thread_registers_itself_and_leaves_on_drop() {
        let reg = ThreadRegistry::new();
        let r2 = reg.clone();
        let (tx, rx) = std::sync::mpsc::channel();
        let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
        let t = std::thread::Builder::new()
            .name("lucid-test-backend".into())
            .spawn(move || {
                let _g = r2.register_current(ThreadRole::Backend);
                tx.send(()).unwrap();
                done_rx.recv().unwrap();
            })
            .unwrap();
        rx.recv().unwrap();
        let list = reg.list();
        assert_eq!(list.len(), 1);
        assert_eq!(list[0].name, "lucid-test-backend");
        assert_eq!(list[0].role, ThreadRole::Backend);
        assert!(list[0].tid > 0);
        done_tx.send(()).unwrap();
        t.join().unwrap();
        assert!(reg.list().is_empty());
    }
}
