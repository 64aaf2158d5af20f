//! Which host threads a VM runs and what each is for, so that the scheduling pools can place
//! them and the monitor can read their `schedstat`. A thread registers itself (only it knows its
//! own TID) and is dropped from the list when its guard goes.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::thread::JoinHandle;

/// What a Lucid thread does, as the pools see it.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ThreadRole {
    /// The thread running `KVM_RUN` for vCPU `n`.
    Vcpu(u32),
    /// A device back-end (a virtio worker, the sidecore vIOMMU poller): it moves guest data.
    Backend,
    /// Anything else (signals, serial, monitor).
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

/// Called on a thread that just registered, on that thread (so it may act on itself: set its
/// own affinity, join a cgroup), with its entry.
pub type OnRegister = Arc<dyn Fn(&ThreadInfo) + Send + Sync>;

/// The VM's thread list. One per VM, shared like the stats registry.
#[derive(Default)]
pub struct ThreadRegistry {
    threads: Mutex<Vec<ThreadInfo>>,
    on_register: RwLock<Option<OnRegister>>,
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
    tid: i32,
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
        let hook = self
            .on_register
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        if let Some(hook) = hook {
            hook(&info);
        }
        ThreadGuard {
            registry: self.clone(),
            tid,
        }
    }

    /// Sets what every thread that registers from now on runs, on itself, right after it
    /// registered (the scheduling pools place it). Replaces an earlier hook.
    pub fn set_on_register(&self, hook: Option<OnRegister>) {
        *self.on_register.write().unwrap_or_else(|e| e.into_inner()) = hook;
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
        list.retain(|t| t.tid != self.tid);
    }
}

/// A named background thread that runs until it is asked to stop: its body polls the stop flag
/// it is given. Stopping sets the flag, unparks the thread (one sleeping in `park_timeout` wakes
/// at once) and joins it; dropping stops it too.
pub struct Background {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Background {
    pub fn spawn(
        name: &str,
        body: impl FnOnce(&AtomicBool) + Send + 'static,
    ) -> std::io::Result<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::Builder::new()
            .name(name.into())
            .spawn(move || body(&flag))?;
        Ok(Background {
            stop,
            thread: Some(thread),
        })
    }

    /// Stops the thread and waits for it (no-op once stopped). From the thread itself (its body
    /// dropped the last owner of this handle) it only sets the flag: a thread cannot join itself.
    pub fn stop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            if t.thread().id() == std::thread::current().id() {
                return;
            }
            t.thread().unpark();
            let _ = t.join();
        }
    }
}

impl Drop for Background {
    fn drop(&mut self) {
        self.stop();
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

    #[test]
    fn the_hook_runs_on_the_registering_thread() {
        let reg = ThreadRegistry::new();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let s2 = seen.clone();
        reg.set_on_register(Some(Arc::new(move |t: &ThreadInfo| {
            // SAFETY: gettid has no arguments and cannot fail.
            let me = unsafe { libc::gettid() };
            s2.lock().unwrap().push((t.tid == me, t.role.clone()));
        })));
        let r2 = reg.clone();
        std::thread::spawn(move || drop(r2.register_current(ThreadRole::Vcpu(3))))
            .join()
            .unwrap();
        assert_eq!(*seen.lock().unwrap(), vec![(true, ThreadRole::Vcpu(3))]);
    }

    #[test]
    fn a_background_thread_stops_when_asked_and_when_dropped() {
        use std::sync::atomic::AtomicU32;
        let ran = Arc::new(AtomicU32::new(0));
        let r = ran.clone();
        let mut t = Background::spawn("lucid-test-bg", move |stop| {
            while !stop.load(Ordering::Acquire) {
                std::thread::park_timeout(std::time::Duration::from_secs(60));
            }
            r.fetch_add(1, Ordering::SeqCst);
        })
        .unwrap();
        t.stop();
        assert_eq!(ran.load(Ordering::SeqCst), 1);
        t.stop();
        let r = ran.clone();
        drop(
            Background::spawn("lucid-test-bg", move |stop| {
                while !stop.load(Ordering::Acquire) {
                    std::thread::park_timeout(std::time::Duration::from_secs(60));
                }
                r.fetch_add(1, Ordering::SeqCst);
            })
            .unwrap(),
        );
        assert_eq!(ran.load(Ordering::SeqCst), 2);
    }
}
