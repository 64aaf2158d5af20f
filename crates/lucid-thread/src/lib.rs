//! One way to start a VMM thread. [`Spawner::spawn`] names the thread, and on the new thread
//! registers it in the VM's [`ThreadRegistry`] under its [`ThreadRole`], places it (the
//! [`Placer`] the scheduling pools or `--low-noise` installed, if any), runs what it must do
//! before confinement, and confines it to its seccomp [`Role`]; then it runs the body, which is
//! told whether confinement worked. `spawn` returns once the thread is registered and placed, so
//! that a VM that stops right after a spawn never leaves a thread the pools did not see.
//!
//! The VM creates one [`Spawner`] and hands clones to everything that starts threads.

#![warn(clippy::print_stdout, clippy::print_stderr)]

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};
use std::thread::JoinHandle;

use lucid_seccomp::{Role, Seccomp, SeccompError};
use lucid_stats::{ThreadInfo, ThreadRegistry, ThreadRole};

/// Puts a thread that just registered where it belongs. It runs on that thread, so it may act
/// on itself (set its own affinity, join a cgroup).
pub type Placer = Arc<dyn Fn(&ThreadInfo) + Send + Sync>;

/// What a thread body is told: whether its thread is confined (always `Ok` with seccomp off,
/// unless the self-test says otherwise). On `Err` the thread must not do its work unconfined.
pub type Confined = Result<(), SpawnError>;

#[derive(Debug, thiserror::Error)]
pub enum SpawnError {
    #[error("cannot start thread {name}: {source}")]
    Start {
        name: String,
        #[source]
        source: std::io::Error,
    },
    #[error("thread {name} cannot confine itself: {source}")]
    Confine {
        name: String,
        #[source]
        source: SeccompError,
    },
}

/// A thread to start: its name, its role for the pools and its seccomp role.
pub struct ThreadSpec {
    pub name: String,
    pub role: ThreadRole,
    pub seccomp_role: Role,
    before_confine: Option<Box<dyn FnOnce() + Send>>,
}

impl ThreadSpec {
    pub fn new(name: impl Into<String>, role: ThreadRole, seccomp_role: Role) -> Self {
        ThreadSpec {
            name: name.into(),
            role,
            seccomp_role,
            before_confine: None,
        }
    }

    /// Runs `f` on the new thread after it is placed and before it confines itself: what needs
    /// system calls its role forbids (opening its own `/proc/thread-self` files).
    pub fn before_confine(mut self, f: impl FnOnce() + Send + 'static) -> Self {
        self.before_confine = Some(Box::new(f));
        self
    }
}

/// Starts the VM's threads. Clones share the placer: one installed later applies to every
/// thread any clone starts from then on.
#[derive(Clone)]
pub struct Spawner {
    seccomp: Option<Seccomp>,
    threads: Arc<ThreadRegistry>,
    placer: Arc<RwLock<Option<Placer>>>,
}

impl std::fmt::Debug for Spawner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Spawner")
            .field("confined", &self.seccomp.is_some())
            .field("threads", &self.threads)
            .finish_non_exhaustive()
    }
}

impl Spawner {
    /// Threads confine themselves when `seccomp` is set and register in `threads`.
    pub fn new(seccomp: Option<Seccomp>, threads: Arc<ThreadRegistry>) -> Self {
        Spawner {
            seccomp,
            threads,
            placer: Arc::default(),
        }
    }

    /// The confinement token, when the VM's threads confine themselves.
    pub fn seccomp(&self) -> Option<&Seccomp> {
        self.seccomp.as_ref()
    }

    pub fn threads(&self) -> &Arc<ThreadRegistry> {
        &self.threads
    }

    /// Sets how threads started from now on are placed (`None`: left where they start, as
    /// when the VM stops and the pools stop placing). Replaces an earlier placer.
    pub fn set_placer(&self, placer: Option<Placer>) {
        *self.placer.write().unwrap_or_else(|e| e.into_inner()) = placer;
    }

    /// Starts thread `spec` running `body`, which gets the outcome of confinement. Returns once
    /// the thread is registered and placed.
    pub fn spawn<T: Send + 'static>(
        &self,
        spec: ThreadSpec,
        body: impl FnOnce(Confined) -> T + Send + 'static,
    ) -> Result<JoinHandle<T>, SpawnError> {
        let ThreadSpec {
            name,
            role,
            seccomp_role,
            before_confine,
        } = spec;
        let (seccomp, threads, placer) = (
            self.seccomp.clone(),
            self.threads.clone(),
            self.placer.clone(),
        );
        let (placed_tx, placed_rx) = std::sync::mpsc::sync_channel::<()>(1);
        let thread_name = name.clone();
        let handle = std::thread::Builder::new()
            .name(name.clone())
            .spawn(move || {
                let registered = threads.register_current(role);
                let place = placer.read().unwrap_or_else(|e| e.into_inner()).clone();
                if let Some(place) = place {
                    place(registered.info());
                }
                let _ = placed_tx.send(());
                if let Some(f) = before_confine {
                    f();
                }
                let confined =
                    lucid_seccomp::confine(seccomp.as_ref(), seccomp_role).map_err(|source| {
                        SpawnError::Confine {
                            name: thread_name,
                            source,
                        }
                    });
                let out = body(confined);
                drop(registered);
                out
            })
            .map_err(|source| SpawnError::Start { name, source })?;
        // Err only if the thread ended before it was placed (it panicked in the placer).
        let _ = placed_rx.recv();
        Ok(handle)
    }

    /// [`Spawner::spawn`] for a thread that runs until asked to stop: `body` also gets the stop
    /// flag, which it polls (sleeping in `park_timeout` it wakes at once when stopped).
    pub fn spawn_background(
        &self,
        spec: ThreadSpec,
        body: impl FnOnce(Confined, &AtomicBool) + Send + 'static,
    ) -> Result<Background, SpawnError> {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = self.spawn(spec, move |confined| body(confined, &flag))?;
        Ok(Background {
            stop,
            thread: Some(thread),
        })
    }
}

/// A thread from [`Spawner::spawn_background`]. Stopping sets the flag, unparks the thread and
/// joins it; dropping stops it too.
pub struct Background {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Background {
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
mod tests;
