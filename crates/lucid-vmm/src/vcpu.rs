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
use lucid_hv::{Exit, ExitKind, HvError, ImmediateExit, Vcpu};
use lucid_stats::{Counter, StatsRegistry};

use crate::emulate::Emulator;
use crate::hooks::{ExitAction, ExitHooks, HYPERCALL_UNKNOWN};

/// Lucid's hypercall port (see `lucid_boot::layout::ports::HYPERCALL`).
use lucid_boot::layout::ports::HYPERCALL as HYPERCALL_PORT;

type Call = Box<dyn FnOnce(&mut VcpuCtx) + Send>;

enum Request {
    Pause(mpsc::Sender<()>),
    Resume,
    Call(Call),
}

/// Why a vCPU stopped the VM.
#[derive(Debug, thiserror::Error)]
pub enum VcpuFault {
    #[error("vCPU {vcpu}: KVM_RUN failed")]
    Run {
        vcpu: u32,
        #[source]
        source: HvError,
    },
    #[error("vCPU {vcpu}: the guest raised system event {event} (crash)")]
    GuestCrash { vcpu: u32, event: u32 },
    #[error("vCPU {vcpu}: KVM could not enter the guest (hardware reason {reason:#x})")]
    FailEntry { vcpu: u32, reason: u64 },
    #[error("vCPU {vcpu}: unexpected exit to userspace: {exit}")]
    UnexpectedExit { vcpu: u32, exit: &'static str },
    /// KVM stopped with an internal error that Lucid could not finish (it names the vCPU).
    #[error(transparent)]
    Emulation(#[from] crate::emulate::CompleteError),
    #[error("vCPU {vcpu}: cannot {what} the registers of hypercall {nr}")]
    Hypercall {
        vcpu: u32,
        nr: u64,
        what: &'static str,
        #[source]
        source: HvError,
    },
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
    /// Signalled (under the `requests` lock) when a request is queued or the vCPU is kicked, so
    /// that a paused vCPU waiting for its next request wakes at once.
    wake: Condvar,
    /// Waits of a paused vCPU that timed out with a request queued or the VM stopping: a lost
    /// wake-up (a paused vCPU with nothing to do times out harmlessly and is not counted).
    wait_timeouts: Arc<Counter>,
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
        // A paused vCPU waits on `wake`, not in KVM_RUN: the signal does not reach it.
        let _q = self.requests.lock().unwrap_or_else(|e| e.into_inner());
        self.wake.notify_all();
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
            self.pending.store(true, Ordering::SeqCst);
        }
        // Kicks the vCPU out of the guest, or wakes it if it waits paused.
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

    /// Queues `f` to run on the vCPU thread between two guest entries and returns at once
    /// (the caller waits for its result its own way: SymCall waits with a deadline and kicks).
    pub fn submit(&self, f: impl FnOnce(&mut VcpuCtx) + Send + 'static) -> Result<(), VcpuError> {
        self.push(Request::Call(Box::new(f)))
    }

    /// Whether the calling thread is this vCPU's own thread (code in its exit handlers), which
    /// must not wait for a request it would have to serve itself.
    pub fn is_current_thread(&self) -> bool {
        let thread = self.thread.lock().unwrap_or_else(|e| e.into_inner());
        // SAFETY: pthread_self has no preconditions; pthread_equal compares two thread ids.
        thread.is_some_and(|t| unsafe { libc::pthread_equal(t, libc::pthread_self()) } != 0)
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
    /// Indexed by [`ExitKind::index`].
    exits: [Arc<Counter>; ExitKind::ALL.len()],
    exits_total: Arc<Counter>,
    pio_unhandled: Arc<Counter>,
    mmio_unhandled: Arc<Counter>,
    hypercalls: Arc<Counter>,
    emulated: Arc<Counter>,
    in_kvm_run_ns: Arc<Counter>,
    in_vmm_ns: Arc<Counter>,
    memory_faults: Arc<Counter>,
}

impl VcpuCounters {
    fn new(stats: &StatsRegistry, id: u32) -> Self {
        let c = |n: &str| stats.counter(format!("vcpu{id}.{n}"));
        VcpuCounters {
            exits: ExitKind::ALL.map(|k| c(&format!("exit.{}", k.name()))),
            exits_total: c("exits"),
            pio_unhandled: c("pio_unhandled"),
            mmio_unhandled: c("mmio_unhandled"),
            hypercalls: c("hypercalls"),
            emulated: c("emulated_insns"),
            in_kvm_run_ns: c("time.in_kvm_run_ns"),
            in_vmm_ns: c("time.in_vmm_ns"),
            memory_faults: c("memory_faults"),
        }
    }

    fn count(&self, kind: ExitKind) {
        self.exits_total.inc();
        self.exits[kind.index()].inc();
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
    /// The last exit the loop dispatched; `None` before the first and after a `KVM_RUN` that
    /// failed. An I/O, MMIO or MSR exit leaves its instruction for the next KVM_RUN to finish.
    last_exit: Option<ExitKind>,
    /// Memory-fault waits in a row that found no memory (`absorb_memory_fault`).
    dry_waits: u32,
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
            wake: Condvar::new(),
            wait_timeouts: stats.counter(format!("vcpu{id}.paused_wait_timeouts")),
        });
        let ctx = VcpuCtx {
            vcpu,
            hooks,
            lifecycle,
            handle: handle.clone(),
            counters: VcpuCounters::new(stats, id),
            emulator,
            paused: false,
            last_exit: None,
            dry_waits: 0,
        };
        (ctx, handle)
    }

    pub fn id(&self) -> u32 {
        self.vcpu.id()
    }

    /// Whether the vCPU is paused; code run on it (a SymCall) may lift the pause for a while,
    /// as a nested loop would otherwise wait for a resume.
    pub(crate) fn set_paused(&mut self, paused: bool) -> bool {
        std::mem::replace(&mut self.paused, paused)
    }

    pub fn last_exit(&self) -> Option<ExitKind> {
        self.last_exit
    }

    /// Finishes the instruction of the last exit if it was I/O, MMIO or an MSR access: KVM
    /// completes it (an IN's data to its register, the skip past an OUT) at the next KVM_RUN,
    /// so one run with `immediate_exit` set completes it and returns at once. Until then the
    /// registers KVM reports are not the guest's final ones. Other exits the loop meets on the
    /// way (an MMIO access split in two) are dispatched as usual.
    pub fn complete_pending_exit(&mut self) -> LoopEnd {
        if !self.last_exit.is_some_and(ExitKind::completes_at_next_run) {
            return LoopEnd::Condition;
        }
        self.run_empty()
    }

    /// One KVM_RUN that does not enter the guest (`immediate_exit`): finishes a pending exit
    /// and, with [`lucid_hv::Vcpu::set_state_sync`] on, mirrors the vCPU state in kvm_run.
    pub fn run_empty(&mut self) -> LoopEnd {
        self.handle.immediate_exit.set();
        self.run_until(|kind| kind == Some(ExitKind::Interrupted))
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
            // State handed to the next KVM_RUN through kvm_run (a SymCall's restore) is
            // written now, so that a request reading or writing the vCPU sees the live state.
            if req.is_some() {
                if let Err(source) = self.vcpu.flush_synced_state() {
                    let vcpu = self.vcpu.id();
                    self.lifecycle
                        .stop(StopReason::error(VcpuFault::Run { vcpu, source }));
                }
            }
            match req {
                Some(Request::Pause(ack)) => {
                    self.paused = true;
                    let _ = ack.send(());
                }
                Some(Request::Resume) => self.paused = false,
                Some(Request::Call(f)) => f(self),
                None if self.paused && !self.lifecycle.is_stopping() => self.wait_for_request(),
                None => return,
            }
        }
    }

    /// Paused with nothing queued: sleeps until a request is queued or the VM stops (both
    /// notify `wake` under the queue's lock, and the queue is checked under that lock, so no
    /// wake-up is lost). The timeout is only a safety net; one that finds work was a lost
    /// wake-up, and is counted.
    fn wait_for_request(&self) {
        const SAFETY_NET: std::time::Duration = std::time::Duration::from_secs(1);
        let h = &self.handle;
        let q = h.requests.lock().unwrap_or_else(|e| e.into_inner());
        if !q.is_empty() || self.lifecycle.is_stopping() {
            return;
        }
        let (q, timeout) = h
            .wake
            .wait_timeout(q, SAFETY_NET)
            .unwrap_or_else(|e| e.into_inner());
        if timeout.timed_out() && (!q.is_empty() || self.lifecycle.is_stopping()) {
            h.wait_timeouts.inc();
        }
    }

    /// Runs the guest, dispatching every exit, until the VM stops or `until` returns true after
    /// a `KVM_RUN` (given the exit's kind; `None` when `KVM_RUN` failed). Re-entrant: may be
    /// called from code running on this vCPU.
    pub fn run_until(&mut self, mut until: impl FnMut(Option<ExitKind>) -> bool) -> LoopEnd {
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
            let (kind, followup) = match result {
                Ok(exit) => {
                    let kind = exit.kind();
                    self.counters.count(kind);
                    let f = handle_exit(exit, &self.hooks, &self.lifecycle, &self.counters, id);
                    (Some(kind), f)
                }
                Err(source)
                    if absorb_memory_fault(
                        &self.hooks,
                        &self.counters,
                        &mut self.dry_waits,
                        &source,
                    ) =>
                {
                    (None, Followup::None)
                }
                Err(source) => {
                    self.lifecycle
                        .stop(StopReason::error(VcpuFault::Run { vcpu: id, source }));
                    (None, Followup::None)
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
                Followup::Hlt => {
                    if let Some(hook) = self.hooks.hlt() {
                        let action = hook.hlt(&mut self.vcpu);
                        self.apply(action);
                    }
                }
                Followup::InternalError(err) => self.internal_error(&err),
            }
            self.counters
                .in_vmm_ns
                .add(left.elapsed().as_nanos() as u64);
            self.last_exit = kind;
            if until(kind) {
                return LoopEnd::Condition;
            }
        }
    }

    /// Carries out what an HLT or internal-error hook decided; false for
    /// [`ExitAction::Default`], which leaves the exit to Lucid's own handling.
    fn apply(&self, action: ExitAction) -> bool {
        match action {
            ExitAction::Default => false,
            ExitAction::Resume => true,
            ExitAction::Stop(reason) => {
                self.lifecycle.stop(reason);
                true
            }
        }
    }

    /// `KVM_EXIT_INTERNAL_ERROR`: the registry's hook first, then the instruction completer.
    fn internal_error(&mut self, err: &lucid_hv::InternalError) {
        if let Some(hook) = self.hooks.internal_error() {
            let action = hook.internal_error(&mut self.vcpu, err);
            if self.apply(action) {
                return;
            }
        }
        match self.emulator.complete(&mut self.vcpu, err) {
            Ok(()) => self.counters.emulated.inc(),
            Err(e) => self
                .lifecycle
                .stop(StopReason::error(VcpuFault::Emulation(e))),
        }
    }

    /// Lucid hypercall: rax = number, rdi/rsi/r8 = arguments, result in rax.
    fn hypercall(&mut self) {
        self.counters.hypercalls.inc();
        let vcpu = self.vcpu.id();
        let fault = |nr, what, source| {
            StopReason::error(VcpuFault::Hypercall {
                vcpu,
                nr,
                what,
                source,
            })
        };
        // With the state mirrored in kvm_run (during a SymCall) no ioctl is needed.
        let sync = self.vcpu.state_sync();
        let mut regs = if sync {
            self.vcpu.synced_state().regs
        } else {
            match self.vcpu.get_regs() {
                Ok(r) => r,
                Err(e) => return self.lifecycle.stop(fault(u64::MAX, "read", e)),
            }
        };
        let nr = regs.rax;
        regs.rax = self
            .hooks
            .hypercall(vcpu, &regs)
            .unwrap_or(HYPERCALL_UNKNOWN);
        if sync {
            self.vcpu.put_synced_state(Some(&regs), None, None);
        } else if let Err(e) = self.vcpu.set_regs(&regs) {
            self.lifecycle.stop(fault(nr, "write", e));
        }
    }
}

/// What is left to do for an exit once its borrow of the vCPU has ended.
#[derive(Debug)]
enum Followup {
    None,
    ClearImmediateExit,
    Hypercall,
    TripleFault,
    /// The HLT hook, if any.
    Hlt,
    /// The internal-error hook, then the instruction completer.
    InternalError(lucid_hv::InternalError),
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
        Exit::IoOutRep(port, size, data) => {
            for d in data.chunks(size) {
                if !hooks.pio.write(port as u64, d) {
                    counters.pio_unhandled.inc();
                }
            }
        }
        Exit::IoInRep(port, size, data) => {
            for d in data.chunks_mut(size) {
                if !hooks.pio.read(port as u64, d) {
                    counters.pio_unhandled.inc();
                    d.fill(0xff);
                }
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
        Exit::Hlt => return Followup::Hlt,
        Exit::Interrupted => return Followup::ClearImmediateExit,
        Exit::Shutdown => return Followup::TripleFault,
        Exit::InternalError(err) => return Followup::InternalError(err),
        Exit::SystemEvent(kind) => lifecycle.stop(match kind {
            lucid_hv::kvm_bindings::KVM_SYSTEM_EVENT_RESET => StopReason::Reset,
            lucid_hv::kvm_bindings::KVM_SYSTEM_EVENT_SHUTDOWN => StopReason::Shutdown,
            event => StopReason::error(VcpuFault::GuestCrash { vcpu, event }),
        }),
        Exit::FailEntry(reason) => {
            lifecycle.stop(StopReason::error(VcpuFault::FailEntry { vcpu, reason }))
        }
        Exit::Other(exit) => {
            lifecycle.stop(StopReason::error(VcpuFault::UnexpectedExit { vcpu, exit }))
        }
    }
    Followup::None
}

/// `KVM_RUN` failed with `EFAULT` and a memory-fault hook is installed (a VM under
/// `--memory-limit`): waits for host memory and tells the loop to re-enter the guest, which
/// retries the access. Gives up (the VM stops with the error) after `MAX_DRY_WAITS` waits in
/// a row in which no memory came.
fn absorb_memory_fault(
    hooks: &ExitHooks,
    counters: &VcpuCounters,
    dry_waits: &mut u32,
    source: &lucid_hv::HvError,
) -> bool {
    const MAX_DRY_WAITS: u32 = 100;
    let lucid_hv::HvError::Ioctl(_, e) = source else {
        return false;
    };
    if e.errno() != libc::EFAULT {
        return false;
    }
    let Some(hook) = hooks.memory_fault() else {
        return false;
    };
    counters.memory_faults.inc();
    if hook.wait_for_memory() {
        *dry_waits = 0;
        return true;
    }
    *dry_waits += 1;
    *dry_waits < MAX_DRY_WAITS
}

#[cfg(test)]
mod tests {
    //! The exit dispatcher without KVM: exits made by hand, real hooks, lifecycle and counters.

    use std::sync::Mutex;

    use lucid_devices::BusDevice;
    use lucid_hv::kvm_bindings::{
        KVM_SYSTEM_EVENT_CRASH, KVM_SYSTEM_EVENT_RESET, KVM_SYSTEM_EVENT_SHUTDOWN,
    };
    use lucid_hv::InternalError;

    use super::*;
    use crate::hooks::MsrHook;

    /// Remembers the last write; reads return 0x42.
    #[derive(Default)]
    struct Reg(Option<(u64, Vec<u8>)>);
    impl BusDevice for Reg {
        fn read(&mut self, _offset: u64, data: &mut [u8]) {
            data.fill(0x42);
        }
        fn write(&mut self, offset: u64, data: &[u8]) {
            self.0 = Some((offset, data.to_vec()));
        }
    }

    /// MSR 0x10 reads as 7 and accepts writes of 7 only.
    struct Msr7;
    impl MsrHook for Msr7 {
        fn read(&self, _vcpu: u32, _index: u32) -> Option<u64> {
            Some(7)
        }
        fn write(&self, _vcpu: u32, _index: u32, value: u64) -> bool {
            value == 7
        }
    }

    struct Setup {
        hooks: Arc<ExitHooks>,
        lifecycle: Lifecycle,
        stats: Arc<StatsRegistry>,
        counters: VcpuCounters,
        port: Arc<Mutex<Reg>>,
        page: Arc<Mutex<Reg>>,
    }

    fn setup() -> Setup {
        let hooks = ExitHooks::new();
        let port = Arc::new(Mutex::new(Reg::default()));
        let page = Arc::new(Mutex::new(Reg::default()));
        hooks.pio.insert(0x100, 4, "port", port.clone()).unwrap();
        hooks
            .mmio
            .insert(0x1000, 0x1000, "page", page.clone())
            .unwrap();
        hooks.add_msr(0x10, Arc::new(Msr7)).unwrap();
        let stats = StatsRegistry::new();
        let counters = VcpuCounters::new(&stats, 3);
        Setup {
            hooks,
            lifecycle: Lifecycle::new(),
            stats,
            counters,
            port,
            page,
        }
    }

    impl Setup {
        fn exit(&self, exit: Exit<'_>) -> Followup {
            handle_exit(exit, &self.hooks, &self.lifecycle, &self.counters, 3)
        }
        fn count(&self, name: &str) -> u64 {
            self.stats.snapshot()[&format!("vcpu3.{name}")]
        }
        fn fault(&self) -> Option<String> {
            match self.lifecycle.reason()? {
                StopReason::Error(e) => {
                    let f = e.downcast_ref::<VcpuFault>().expect("a VcpuFault");
                    Some(format!("{f:?}"))
                }
                other => Some(format!("{other:?}")),
            }
        }
    }

    #[test]
    fn port_io_goes_to_the_bus_or_counts_as_unhandled() {
        let s = setup();
        assert!(matches!(s.exit(Exit::IoOut(0x102, &[9])), Followup::None));
        assert_eq!(s.port.lock().unwrap().0, Some((2, vec![9])));
        let mut d = [0u8; 2];
        assert!(matches!(s.exit(Exit::IoIn(0x100, &mut d)), Followup::None));
        assert_eq!(d, [0x42, 0x42]);
        assert_eq!(s.count("pio_unhandled"), 0);
        // Nobody there: writes vanish, reads float high, both are counted.
        s.exit(Exit::IoOut(0x200, &[1]));
        let mut d = [0u8; 4];
        s.exit(Exit::IoIn(0x200, &mut d));
        assert_eq!(d, [0xff; 4]);
        // An access that straddles the end of a range is not the device's.
        s.exit(Exit::IoIn(0x103, &mut [0u8; 2]));
        assert_eq!(s.count("pio_unhandled"), 3);
        assert!(s.lifecycle.reason().is_none());
    }

    /// A string `ins`/`outs` is one access per element: 8 bytes at a 4-byte port range fit
    /// as four 2-byte reads.
    #[test]
    fn string_port_io_is_one_access_per_element() {
        let s = setup();
        s.exit(Exit::IoOutRep(0x102, 1, &[1, 2, 3]));
        assert_eq!(s.port.lock().unwrap().0, Some((2, vec![3])));
        let mut d = [0u8; 8];
        s.exit(Exit::IoInRep(0x100, 2, &mut d));
        assert_eq!(d, [0x42; 8]);
        assert_eq!(s.count("pio_unhandled"), 0);
        s.exit(Exit::IoInRep(0x200, 1, &mut d));
        assert_eq!(d, [0xff; 8]);
        assert_eq!(s.count("pio_unhandled"), 8);
    }

    #[test]
    fn the_hypercall_port_is_left_to_the_vcpu() {
        let s = setup();
        let f = s.exit(Exit::IoOut(HYPERCALL_PORT, &[0, 0, 0, 0]));
        assert!(matches!(f, Followup::Hypercall));
        assert_eq!(s.count("pio_unhandled"), 0);
    }

    #[test]
    fn mmio_goes_to_the_bus_or_counts_as_unhandled() {
        let s = setup();
        s.exit(Exit::MmioWrite(0x1008, &[1, 2, 3, 4]));
        assert_eq!(s.page.lock().unwrap().0, Some((8, vec![1, 2, 3, 4])));
        let mut d = [0u8; 8];
        s.exit(Exit::MmioRead(0x1ff8, &mut d));
        assert_eq!(d, [0x42; 8]);
        s.exit(Exit::MmioWrite(0x3000, &[1]));
        let mut d = [0u8; 4];
        s.exit(Exit::MmioRead(0x3000, &mut d));
        assert_eq!(d, [0xff; 4]);
        assert_eq!(s.count("mmio_unhandled"), 2);
    }

    #[test]
    fn trapped_msrs_reach_their_hook_and_others_fault() {
        let s = setup();
        let (mut data, mut error) = (0u64, 0u8);
        s.exit(Exit::RdMsr {
            index: 0x10,
            data: &mut data,
            error: &mut error,
        });
        assert_eq!((data, error), (7, 0));
        s.exit(Exit::RdMsr {
            index: 0x11,
            data: &mut data,
            error: &mut error,
        });
        assert_eq!(error, 1, "#GP for an MSR nobody handles");
        for (index, value, gp) in [(0x10, 7, 0), (0x10, 8, 1), (0x11, 7, 1)] {
            let mut error = 0u8;
            s.exit(Exit::WrMsr {
                index,
                data: value,
                error: &mut error,
            });
            assert_eq!(error, gp, "wrmsr {index:#x} {value}");
        }
    }

    #[test]
    fn exits_the_vcpu_finishes_itself() {
        let s = setup();
        assert!(matches!(s.exit(Exit::Hlt), Followup::Hlt));
        assert!(matches!(
            s.exit(Exit::Interrupted),
            Followup::ClearImmediateExit
        ));
        assert!(matches!(s.exit(Exit::Shutdown), Followup::TripleFault));
        let err = InternalError {
            suberror: 1,
            data: vec![],
            insn_bytes: vec![0xcc],
        };
        assert!(matches!(
            s.exit(Exit::InternalError(err)),
            Followup::InternalError(e) if e.insn_bytes == [0xcc]
        ));
        assert!(s.lifecycle.reason().is_none());
    }

    #[test]
    fn system_events_and_failures_stop_the_vm_with_a_typed_reason() {
        let s = setup();
        s.exit(Exit::SystemEvent(KVM_SYSTEM_EVENT_RESET));
        assert_eq!(s.lifecycle.reason(), Some(StopReason::Reset));
        let s = setup();
        s.exit(Exit::SystemEvent(KVM_SYSTEM_EVENT_SHUTDOWN));
        assert_eq!(s.lifecycle.reason(), Some(StopReason::Shutdown));
        let s = setup();
        s.exit(Exit::SystemEvent(KVM_SYSTEM_EVENT_CRASH));
        assert_eq!(s.fault().unwrap(), "GuestCrash { vcpu: 3, event: 3 }");
        let s = setup();
        s.exit(Exit::FailEntry(0x21));
        assert_eq!(s.fault().unwrap(), "FailEntry { vcpu: 3, reason: 33 }");
        let s = setup();
        s.exit(Exit::Other("debug"));
        assert_eq!(
            s.fault().unwrap(),
            "UnexpectedExit { vcpu: 3, exit: \"debug\" }"
        );
        // The first reason wins.
        s.exit(Exit::SystemEvent(KVM_SYSTEM_EVENT_RESET));
        assert!(s.fault().unwrap().starts_with("UnexpectedExit"));
    }
}
