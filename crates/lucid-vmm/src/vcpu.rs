//! vCPU threads and the exit loop. Each vCPU runs on its own named thread; a [`VcpuHandle`] lets
//! any other thread pause it, read or write its registers, run code on it, and resume it. The
//! loop is re-entrant: code run on the vCPU (a SymCall, an emulation step) can itself run the
//! guest until a condition holds, with every exit still dispatched through the hooks.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;

use lucid_devices::{Lifecycle, StopReason};
use lucid_hv::kvm_bindings::{kvm_regs, kvm_sregs};
use lucid_hv::{Exit, HvError, ImmediateExit, Vcpu, EXIT_REASONS};
use lucid_stats::{Counter, StatsRegistry};

use crate::emulate::Emulator;
use crate::hooks::{ExitHooks, HYPERCALL_UNKNOWN};

/// Lucid's hypercall port (see `lucid_boot::layout::ports::HYPERCALL`).
use lucid_boot::layout::ports::HYPERCALL as HYPERCALL_PORT;

type Call = Box<dyn FnOnce(&mut VcpuCtx) + Send>;

enum Request {
    Pause(mpsc::Sender<()>),
    Resume,
    Call(Call),
}

#[derive(Debug, thiserror::Error)]
pub enum VcpuError {
    #[error("vCPU {0} has stopped")]
    Gone(u32),
    #[error(transparent)]
    Hv(#[from] HvError),
}

/// Control of one vCPU from other threads.
pub struct VcpuHandle {
    id: u32,
    requests: Mutex<VecDeque<Request>>,
    pending: AtomicBool,
    alive: AtomicBool,
    immediate_exit: ImmediateExit,
    thread: Mutex<Option<libc::pthread_t>>,
    /// Signalled whenever the vCPU finishes a request, so waiters need no polling.
    done: Condvar,
}

impl VcpuHandle {
    pub fn id(&self) -> u32 {
        self.id
    }

    /// Makes the vCPU leave the guest (or not enter it) and look at its requests.
    pub fn kick(&self) {
        // The lock orders this against the vCPU's teardown: once `alive` is false the kvm_run
        // page behind `immediate_exit` may be unmapped.
        let thread = self.thread.lock().unwrap_or_else(|e| e.into_inner());
        if !self.alive.load(Ordering::SeqCst) {
            return;
        }
        self.immediate_exit.set();
        if let Some(t) = *thread {
            // SAFETY: `t` is the vCPU thread's id, recorded by that thread and cleared before it
            // exits; the signal's handler does nothing, it only interrupts KVM_RUN.
            unsafe { libc::pthread_kill(t, vmm_sys_util::signal::SIGRTMIN()) };
        }
    }

    fn push(&self, r: Request) -> Result<(), VcpuError> {
        {
            // Under the thread lock, so a request is never queued after teardown cleared the
            // queue (its caller would wait forever).
            let _thread = self.thread.lock().unwrap_or_else(|e| e.into_inner());
            if !self.alive.load(Ordering::SeqCst) {
                return Err(VcpuError::Gone(self.id));
            }
            self.requests
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push_back(r);
        }
        self.pending.store(true, Ordering::SeqCst);
        self.kick();
        Ok(())
    }

    /// Stops the vCPU outside the guest; returns once it is paused.
    pub fn pause(&self) -> Result<(), VcpuError> {
        let (tx, rx) = mpsc::channel();
        self.push(Request::Pause(tx))?;
        rx.recv().map_err(|_| VcpuError::Gone(self.id))
    }

    pub fn resume(&self) -> Result<(), VcpuError> {
        self.push(Request::Resume)
    }

    /// Runs `f` on the vCPU thread, between two guest entries, and returns its result. Works
    /// whether or not the vCPU is paused.
    pub fn call<R: Send + 'static>(
        &self,
        f: impl FnOnce(&mut VcpuCtx) -> R + Send + 'static,
    ) -> Result<R, VcpuError> {
        let (tx, rx) = mpsc::channel();
        self.push(Request::Call(Box::new(move |ctx| {
            let _ = tx.send(f(ctx));
        })))?;
        rx.recv().map_err(|_| VcpuError::Gone(self.id))
    }

    pub fn get_regs(&self) -> Result<kvm_regs, VcpuError> {
        Ok(self.call(|c| c.vcpu.get_regs())??)
    }

    pub fn set_regs(&self, regs: kvm_regs) -> Result<(), VcpuError> {
        Ok(self.call(move |c| c.vcpu.set_regs(&regs))??)
    }

    pub fn get_sregs(&self) -> Result<kvm_sregs, VcpuError> {
        Ok(self.call(|c| c.vcpu.get_sregs())??)
    }

    pub fn set_sregs(&self, sregs: kvm_sregs) -> Result<(), VcpuError> {
        Ok(self.call(move |c| c.vcpu.set_sregs(&sregs))??)
    }
}

/// Per-vCPU counters, registered as `vcpuN.exit.<reason>` and `vcpuN.time.*`.
struct VcpuCounters {
    exits: Vec<Arc<Counter>>,
    exits_total: Arc<Counter>,
    pio_unhandled: Arc<Counter>,
    mmio_unhandled: Arc<Counter>,
    hypercalls: Arc<Counter>,
    emulated: Arc<Counter>,
    in_kvm_run_ns: Arc<Counter>,
    in_vmm_ns: Arc<Counter>,
}

impl VcpuCounters {
    fn new(stats: &StatsRegistry, id: u32) -> Self {
        let c = |n: &str| stats.counter(format!("vcpu{id}.{n}"));
        VcpuCounters {
            exits: EXIT_REASONS
                .iter()
                .map(|r| c(&format!("exit.{r}")))
                .collect(),
            exits_total: c("exits"),
            pio_unhandled: c("pio_unhandled"),
            mmio_unhandled: c("mmio_unhandled"),
            hypercalls: c("hypercalls"),
            emulated: c("emulated_insns"),
            in_kvm_run_ns: c("time.in_kvm_run_ns"),
            in_vmm_ns: c("time.in_vmm_ns"),
        }
    }

    fn count(&self, reason: &str) {
        self.exits_total.inc();
        if let Some(i) = EXIT_REASONS.iter().position(|r| *r == reason) {
            self.exits[i].inc();
        }
    }
}

/// Why a run of the exit loop ended.
#[derive(Debug, PartialEq, Eq)]
pub enum LoopEnd {
    /// The VM is stopping.
    Stopped,
    /// The caller's condition held.
    Condition,
}

/// What a vCPU thread owns: the vCPU and everything an exit needs.
pub struct VcpuCtx {
    pub vcpu: Vcpu,
    pub hooks: Arc<ExitHooks>,
    pub lifecycle: Arc<Lifecycle>,
    handle: Arc<VcpuHandle>,
    counters: VcpuCounters,
    emulator: Emulator,
    paused: bool,
}

impl VcpuCtx {
    pub fn new(
        mut vcpu: Vcpu,
        hooks: Arc<ExitHooks>,
        lifecycle: Arc<Lifecycle>,
        stats: &StatsRegistry,
        emulator: Emulator,
    ) -> (Self, Arc<VcpuHandle>) {
        let id = vcpu.id();
        let handle = Arc::new(VcpuHandle {
            id,
            requests: Mutex::new(VecDeque::new()),
            pending: AtomicBool::new(false),
            alive: AtomicBool::new(true),
            immediate_exit: vcpu.immediate_exit(),
            thread: Mutex::new(None),
            done: Condvar::new(),
        });
        let ctx = VcpuCtx {
            vcpu,
            hooks,
            lifecycle,
            handle: handle.clone(),
            counters: VcpuCounters::new(stats, id),
            emulator,
            paused: false,
        };
        (ctx, handle)
    }

    pub fn id(&self) -> u32 {
        self.vcpu.id()
    }

    /// The vCPU thread's body: runs the guest until the VM stops.
    pub fn run(mut self) {
        // SAFETY: pthread_self has no preconditions.
        *self.handle.thread.lock().unwrap_or_else(|e| e.into_inner()) =
            Some(unsafe { libc::pthread_self() });
        self.run_until(|_| false);
    }

    fn take_requests(&mut self) {
        loop {
            let req = {
                let mut q = self
                    .handle
                    .requests
                    .lock()
                    .unwrap_or_else(|e| e.into_inner());
                let r = q.pop_front();
                if r.is_none() {
                    self.handle.pending.store(false, Ordering::SeqCst);
                }
                r
            };
            match req {
                Some(Request::Pause(ack)) => {
                    self.paused = true;
                    let _ = ack.send(());
                }
                Some(Request::Resume) => self.paused = false,
                Some(Request::Call(f)) => f(self),
                None if self.paused && !self.lifecycle.is_stopping() => {
                    // Wait for the next request without spinning.
                    let q = self
                        .handle
                        .requests
                        .lock()
                        .unwrap_or_else(|e| e.into_inner());
                    let _ = self
                        .handle
                        .done
                        .wait_timeout(q, std::time::Duration::from_millis(50));
                }
                None => return,
            }
            self.handle.done.notify_all();
        }
    }

    /// Runs the guest, dispatching every exit, until the VM stops or `until` returns true after
    /// an exit. Re-entrant: may be called from code running on this vCPU.
    pub fn run_until(&mut self, mut until: impl FnMut(&str) -> bool) -> LoopEnd {
        loop {
            if self.handle.pending.load(Ordering::SeqCst) || self.paused {
                self.take_requests();
            }
            if self.lifecycle.is_stopping() {
                return LoopEnd::Stopped;
            }
            let id = self.vcpu.id();
            let entered = Instant::now();
            let result = self.vcpu.run();
            let left = Instant::now();
            self.counters
                .in_kvm_run_ns
                .add(left.duration_since(entered).as_nanos() as u64);
            let (reason, followup) = match result {
                Ok(exit) => {
                    let reason = exit.reason();
                    self.counters.count(reason);
                    let f = handle_exit(exit, &self.hooks, &self.lifecycle, &self.counters, id);
                    (reason, f)
                }
                Err(e) => {
                    self.lifecycle
                        .stop(StopReason::Error(format!("vCPU {id}: {e}")));
                    ("error", Followup::None)
                }
            };
            match followup {
                Followup::None => {}
                Followup::ClearImmediateExit => self.vcpu.clear_immediate_exit(),
                Followup::Hypercall => self.hypercall(),
                Followup::TripleFault => {
                    let rip = self.vcpu.get_regs().map(|r| r.rip).unwrap_or(0);
                    self.lifecycle
                        .stop(StopReason::TripleFault { vcpu: id, rip });
                }
                Followup::Emulate(err) => match self.emulator.complete(&mut self.vcpu, &err) {
                    Ok(()) => self.counters.emulated.inc(),
                    Err(e) => self.lifecycle.stop(StopReason::Error(e.report())),
                },
            }
            self.counters
                .in_vmm_ns
                .add(left.elapsed().as_nanos() as u64);
            if until(reason) {
                return LoopEnd::Condition;
            }
        }
    }

    /// Lucid hypercall: rax = number, rdi/rsi/r8 = arguments, result in rax.
    fn hypercall(&mut self) {
        self.counters.hypercalls.inc();
        let Ok(mut regs) = self.vcpu.get_regs() else {
            return;
        };
        regs.rax = self
            .hooks
            .hypercall(self.vcpu.id(), &regs)
            .unwrap_or(HYPERCALL_UNKNOWN);
        if let Err(e) = self.vcpu.set_regs(&regs) {
            self.lifecycle
                .stop(StopReason::Error(format!("hypercall: {e}")));
        }
    }
}

/// What is left to do for an exit once its borrow of the vCPU has ended.
enum Followup {
    None,
    ClearImmediateExit,
    Hypercall,
    TripleFault,
    Emulate(lucid_hv::InternalError),
}

impl Drop for VcpuCtx {
    /// Marks the handle dead before the vCPU (and its kvm_run page) goes away, and fails queued
    /// requests so that no caller waits forever.
    fn drop(&mut self) {
        let mut thread = self.handle.thread.lock().unwrap_or_else(|e| e.into_inner());
        self.handle.alive.store(false, Ordering::SeqCst);
        *thread = None;
        self.handle
            .requests
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
        drop(thread);
        self.handle.done.notify_all();
    }
}

/// Dispatches one exit to the hooks.
fn handle_exit(
    exit: Exit<'_>,
    hooks: &ExitHooks,
    lifecycle: &Lifecycle,
    counters: &VcpuCounters,
    vcpu: u32,
) -> Followup {
    match exit {
        Exit::IoOut(port, _) if port == HYPERCALL_PORT => return Followup::Hypercall,
        Exit::IoOut(port, data) => {
            if !hooks.pio.write(port as u64, data) {
                counters.pio_unhandled.inc();
            }
        }
        Exit::IoIn(port, data) => {
            if !hooks.pio.read(port as u64, data) {
                counters.pio_unhandled.inc();
                data.fill(0xff);
            }
        }
        Exit::MmioWrite(addr, data) => {
            if !hooks.mmio.write(addr, data) {
                counters.mmio_unhandled.inc();
            }
        }
        Exit::MmioRead(addr, data) => {
            if !hooks.mmio.read(addr, data) {
                counters.mmio_unhandled.inc();
                data.fill(0xff);
            }
        }
        Exit::RdMsr { index, data, error } => {
            match hooks.msr(index).and_then(|h| h.read(vcpu, index)) {
                Some(v) => *data = v,
                None => *error = 1,
            }
        }
        Exit::WrMsr { index, data, error } => {
            if !hooks.msr(index).is_some_and(|h| h.write(vcpu, index, data)) {
                *error = 1;
            }
        }
        Exit::Hlt => {}
        Exit::Interrupted => return Followup::ClearImmediateExit,
        Exit::Shutdown => return Followup::TripleFault,
        Exit::InternalError(err) => return Followup::Emulate(err),
        Exit::SystemEvent(kind) => lifecycle.stop(match kind {
            lucid_hv::kvm_bindings::KVM_SYSTEM_EVENT_RESET => StopReason::Reset,
            lucid_hv::kvm_bindings::KVM_SYSTEM_EVENT_SHUTDOWN => StopReason::Shutdown,
            other => StopReason::Error(format!("vCPU {vcpu}: guest system event {other} (crash)")),
        }),
        Exit::FailEntry(code) => lifecycle.stop(StopReason::Error(format!(
            "vCPU {vcpu}: KVM could not enter the guest (hardware reason {code:#x})"
        ))),
        Exit::Other(what) => lifecycle.stop(StopReason::Error(format!(
            "vCPU {vcpu}: unexpected exit to userspace: {what}"
        ))),
    }
    Followup::None
}
