//! SymCall: Lucid runs a function in the guest on a chosen vCPU and gets its result
//! (docs/symbiotic.md §5).
//!
//! A call runs on the vCPU's own thread through [`VcpuHandle::submit`]: it finishes the pending
//! exit, saves the vCPU state, loads the entry the guest published in SymSpy, runs the
//! re-entrant exit loop until the guest's `HC_RETURN` on that vCPU (every other exit is
//! dispatched as usual), and restores the state. Calls do not nest (`Busy`), and are bounded in
//! exits and time: a handler looping at CPL3 takes no exits, so the calling thread kicks the
//! vCPU out of KVM_RUN once the deadline has passed. Whatever the handler did, the guest
//! resumes where it was with its registers intact.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use lucid_hv::kvm_bindings::{
    kvm_mp_state, kvm_regs, kvm_segment, kvm_sregs, kvm_vcpu_events, KVM_MP_STATE_RUNNABLE,
    KVM_VCPUEVENT_VALID_SHADOW,
};
use lucid_hv::HvError;
use lucid_stats::{Counter, StatsRegistry};
use lucid_sym::abi::{self, page};

use super::Symbiotic;
use crate::vcpu::{LoopEnd, VcpuCtx};

/// What a completed SymCall returned.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SymReturn {
    /// `abi::SYM_OK`, or the errno the guest's handler reported (`SYM_EFAULT` when the guest's
    /// exception path cut its handler off, `SYM_ENOSYS` for a call it has no handler for).
    pub status: u64,
    pub values: [u64; 2],
    /// Userspace exits taken while the call ran (the completion's included).
    pub exits: u64,
    /// Wall time of the call on the vCPU thread, state save and restore included.
    pub ns: u64,
}

/// Why Lucid could not complete a SymCall; the guest continues where it was in every case.
#[derive(Debug, thiserror::Error)]
pub enum SymCallError {
    #[error("the guest registered no SymCall entry (or no SymSpy page for vCPU {0})")]
    NotRegistered(u32),
    #[error("vCPU {0} is already running a SymCall (they do not nest), or the call came from that vCPU's own exit handler")]
    Busy(u32),
    #[error("no vCPU {0}")]
    NoVcpu(u32),
    #[error("the SymCall on vCPU {vcpu} did not complete within {ms} ms: cut off")]
    Timeout { vcpu: u32, ms: u64 },
    #[error("the SymCall on vCPU {vcpu} took more than {exits} exits: cut off")]
    TooManyExits { vcpu: u32, exits: u64 },
    #[error("vCPU {0} has stopped")]
    Gone(u32),
    #[error("the VM stopped during the SymCall")]
    Stopped,
    #[error("SymCall on vCPU {vcpu}: cannot {what} the vCPU state")]
    State {
        vcpu: u32,
        what: &'static str,
        #[source]
        source: lucid_hv::HvError,
    },
    #[error("SymCall is not available in this build")]
    Unavailable,
}

/// Bounds of one call: it is cut off (and the guest state restored) past either.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CallLimits {
    /// Wall time from the request to the completion (queueing on the vCPU included). The
    /// default, 1 s, is far above a call's cost (tens of µs) and covers a vCPU thread that the
    /// host does not schedule for a while: on a busy or CPU-quota-throttled host (cgroup
    /// `cpu.max` periods are 100 ms) a thread can wait longer than 100 ms to run, and a bound
    /// that short cut off calls whose handler did nothing wrong.
    pub timeout: Duration,
    /// Userspace exits while the handler runs (kicks included).
    pub max_exits: u64,
    /// How long the caller polls for the result before it sleeps. A warm call takes a few
    /// tens of µs, and the futex wake-up of a sleeping caller costs about as much again on
    /// this host (measured: 76 against 47 µs per call). Polling takes a CPU from the vCPUs,
    /// though: a back-end that calls in bulk while VMs compete for CPUs passes zero.
    pub poll: Duration,
}

impl Default for CallLimits {
    fn default() -> Self {
        CallLimits {
            timeout: Duration::from_secs(1),
            max_exits: 10_000,
            poll: Duration::from_micros(300),
        }
    }
}

/// After the deadline the caller kicks the vCPU this often until the call ends: the vCPU
/// checks the time after every exit, and a kick guarantees one.
const KICK_EVERY: Duration = Duration::from_millis(2);
/// How long past its deadline a caller still waits for a call its vCPU took up. A vCPU kicked
/// out of KVM_RUN comes back within a few ms; one that does not is held in an exit handler,
/// possibly one waiting for the caller itself (the guest's handler resets the disk whose
/// back-end thread asked: the reset joins that thread), so the caller gives up rather than
/// wait forever. The call then ends on the vCPU whenever that handler returns.
const RUNNING_GRACE: Duration = Duration::from_secs(1);
/// A request's phases (see `call_with`).
const QUEUED: u8 = 0;
const RUNNING: u8 = 1;
const ABANDONED: u8 = 2;
/// The vCPU finished the call.
const DONE: u8 = 3;
/// The caller stopped waiting for a running call (`RUNNING_GRACE`): the vCPU frees the slot
/// when the call ends, so that no other call nests inside it meanwhile.
const GAVE_UP: u8 = 4;
/// Torn reads of a SymSpy record tolerated before the record counts as absent.
const READ_TRIES: u32 = 1000;

/// `sym.call.*` counters.
pub struct CallCounters {
    pub calls: Arc<Counter>,
    pub completed: Arc<Counter>,
    pub busy: Arc<Counter>,
    pub timeouts: Arc<Counter>,
    pub too_many_exits: Arc<Counter>,
    pub faults: Arc<Counter>,
    pub not_registered: Arc<Counter>,
    pub stray_returns: Arc<Counter>,
    pub exits: Arc<Counter>,
    pub ns_total: Arc<Counter>,
}

/// One vCPU's call slot.
#[derive(Default)]
struct Slot {
    /// A call is queued or running (set by the caller: a second one is refused at once).
    active: AtomicBool,
    /// The guest runs the handler: `HC_RETURN` is expected.
    running: AtomicBool,
    /// What `HC_RETURN` reported: status, value 0, value 1.
    ret: Mutex<Option<[u64; 3]>>,
    /// Calls completed on this vCPU (`W_SYMCALLS`).
    completed: AtomicU64,
}

/// The SymCall state of a VM (inside [`Symbiotic`]).
pub struct Calls {
    slots: Vec<Slot>,
    limits: Mutex<CallLimits>,
    /// Use KVM's kvm_run state mirror when the host has it (off: GET/SET ioctls throughout).
    mirror: AtomicBool,
    pub counters: CallCounters,
}

impl Calls {
    pub(super) fn new(vcpus: u32, stats: &StatsRegistry) -> Self {
        let c = |n: &str| stats.counter(format!("sym.call.{n}"));
        Calls {
            slots: (0..vcpus).map(|_| Slot::default()).collect(),
            limits: Mutex::new(CallLimits::default()),
            mirror: AtomicBool::new(true),
            counters: CallCounters {
                calls: c("calls"),
                completed: c("completed"),
                busy: c("busy"),
                timeouts: c("timeouts"),
                too_many_exits: c("too_many_exits"),
                faults: c("faults"),
                not_registered: c("not_registered"),
                stray_returns: c("stray_returns"),
                exits: c("exits"),
                ns_total: c("ns_total"),
            },
        }
    }
}

/// Clears a slot's `active` flag however the call ends, unless the vCPU is left to.
struct ActiveGuard<'a>(Option<&'a AtomicBool>);
impl ActiveGuard<'_> {
    /// The call goes on after the caller leaves: the vCPU clears the flag.
    fn leave_to_vcpu(&mut self) {
        self.0 = None;
    }
}
impl Drop for ActiveGuard<'_> {
    fn drop(&mut self) {
        if let Some(a) = self.0 {
            a.store(false, Ordering::SeqCst);
        }
    }
}

/// The upcall context read from SymSpy.
#[derive(Clone, Copy, Debug)]
struct Entry {
    rip: u64,
    cs: u16,
    ss: u16,
    flags: u64,
    stack: u64,
}

/// The vCPU state a call saves and restores.
struct Saved {
    regs: kvm_regs,
    sregs: kvm_sregs,
    events: kvm_vcpu_events,
    mp_state: kvm_mp_state,
}

/// How a call's run ended, before the restore.
enum Outcome {
    Returned([u64; 3]),
    Timeout,
    TooManyExits,
    Stopped,
}

impl Symbiotic {
    /// Runs call `nr` with `args` (rdi, rsi, rdx, r10, r8) in the guest on `vcpu`, from any
    /// thread except that vCPU's own exit handlers (a back-end thread, the control API), with
    /// this VM's limits ([`Symbiotic::set_call_limits`]; 1 s, 10 000 exits by default).
    pub fn call(&self, vcpu: u32, nr: u64, args: [u64; 5]) -> Result<SymReturn, SymCallError> {
        let limits = *self.calls.limits.lock().unwrap_or_else(|e| e.into_inner());
        self.call_with(vcpu, nr, args, limits)
    }

    /// The limits [`Symbiotic::call`] uses.
    pub fn call_limits(&self) -> CallLimits {
        *self.calls.limits.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The limits later [`Symbiotic::call`]s get.
    pub fn set_call_limits(&self, limits: CallLimits) {
        *self.calls.limits.lock().unwrap_or_else(|e| e.into_inner()) = limits;
    }

    /// Whether calls may use KVM's kvm_run state mirror (`KVM_CAP_SYNC_REGS`; on by default
    /// where the host has it). Off, every part of the state goes through GET/SET ioctls: the
    /// path hosts without the capability take, kept switchable to test and measure it.
    pub fn set_state_mirror(&self, on: bool) {
        self.calls.mirror.store(on, Ordering::Relaxed);
    }

    /// SymCalls completed on `vcpu` (what `W_SYMCALLS` holds).
    pub fn symcalls_on(&self, vcpu: u32) -> u64 {
        self.calls
            .slots
            .get(vcpu as usize)
            .map_or(0, |s| s.completed.load(Ordering::Relaxed))
    }

    pub fn call_counters(&self) -> &CallCounters {
        &self.calls.counters
    }

    /// [`Symbiotic::call`] with explicit limits.
    pub fn call_with(
        &self,
        vcpu: u32,
        nr: u64,
        args: [u64; 5],
        limits: CallLimits,
    ) -> Result<SymReturn, SymCallError> {
        let c = &self.calls.counters;
        c.calls.inc();
        let (Some(handle), Some(slot)) =
            (self.vcpu_handle(vcpu), self.calls.slots.get(vcpu as usize))
        else {
            return Err(SymCallError::NoVcpu(vcpu));
        };
        if slot
            .active
            .compare_exchange(false, true, Ordering::SeqCst, Ordering::SeqCst)
            .is_err()
        {
            c.busy.inc();
            return Err(SymCallError::Busy(vcpu));
        }
        let mut active = ActiveGuard(Some(&slot.active));
        // From the vCPU's own thread the request would wait for itself.
        if handle.is_current_thread() {
            c.busy.inc();
            return Err(SymCallError::Busy(vcpu));
        }
        let Some(me) = self.me.upgrade() else {
            return Err(SymCallError::Stopped);
        };
        let (tx, rx) = mpsc::channel();
        // Queued -> running, or queued -> abandoned by a caller whose deadline passed before
        // the vCPU took the request up (it was held in a long exit handler): the request then
        // does nothing when it runs.
        let phase = Arc::new(AtomicU8::new(QUEUED));
        let p = phase.clone();
        handle
            .submit(move |ctx| {
                if p.compare_exchange(QUEUED, RUNNING, Ordering::SeqCst, Ordering::SeqCst)
                    .is_ok()
                {
                    let r = me.run_call(ctx, nr, args, limits);
                    if p.compare_exchange(RUNNING, DONE, Ordering::SeqCst, Ordering::SeqCst)
                        .is_err()
                    {
                        // GAVE_UP: the caller has left; the slot is free only now.
                        if let Some(s) = me.calls.slots.get(vcpu as usize) {
                            s.active.store(false, Ordering::SeqCst);
                        }
                    }
                    let _ = tx.send(r);
                }
            })
            .map_err(|_| SymCallError::Gone(vcpu))?;
        let asked = Instant::now();
        let deadline = asked + limits.timeout;
        // Polls first (`CallLimits::poll`); the yield leaves the CPU to the vCPU thread when
        // both share one.
        let mut early = None;
        while asked.elapsed() < limits.poll {
            match rx.try_recv() {
                Ok(r) => {
                    early = Some(r);
                    break;
                }
                Err(mpsc::TryRecvError::Empty) => std::thread::yield_now(),
                Err(mpsc::TryRecvError::Disconnected) => break,
            }
        }
        let result = loop {
            if let Some(r) = early.take() {
                break r;
            }
            let now = Instant::now();
            let wait = deadline.saturating_duration_since(now).max(KICK_EVERY);
            match rx.recv_timeout(wait) {
                Ok(r) => break r,
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    if Instant::now() >= deadline {
                        if phase
                            .compare_exchange(QUEUED, ABANDONED, Ordering::SeqCst, Ordering::SeqCst)
                            .is_ok()
                        {
                            break Err(SymCallError::Timeout {
                                vcpu,
                                ms: limits.timeout.as_millis() as u64,
                            });
                        }
                        if Instant::now() >= deadline + RUNNING_GRACE
                            && phase
                                .compare_exchange(
                                    RUNNING,
                                    GAVE_UP,
                                    Ordering::SeqCst,
                                    Ordering::SeqCst,
                                )
                                .is_ok()
                        {
                            active.leave_to_vcpu();
                            log::warn!(
                                "sym: the SymCall on vCPU {vcpu} is still running {} ms past \
                                 its deadline (the vCPU is held in an exit handler): given up",
                                RUNNING_GRACE.as_millis()
                            );
                            break Err(SymCallError::Timeout {
                                vcpu,
                                ms: limits.timeout.as_millis() as u64,
                            });
                        }
                        handle.kick();
                    }
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => break Err(SymCallError::Gone(vcpu)),
            }
        };
        match &result {
            Ok(r) => {
                c.exits.add(r.exits);
                c.ns_total.add(r.ns);
            }
            Err(SymCallError::Timeout { .. }) => c.timeouts.inc(),
            Err(SymCallError::TooManyExits { .. }) => c.too_many_exits.inc(),
            Err(SymCallError::NotRegistered(_)) => c.not_registered.inc(),
            Err(_) => {}
        }
        result
    }

    /// `HC_RETURN` from `vcpu`: ends its running call, or is a stray (`-EINVAL`).
    pub(super) fn symcall_return(&self, vcpu: u32, status: u64, v0: u64, v1: u64) -> u64 {
        match self.calls.slots.get(vcpu as usize) {
            Some(slot) if slot.running.load(Ordering::SeqCst) => {
                *slot.ret.lock().unwrap_or_else(|e| e.into_inner()) = Some([status, v0, v1]);
                0
            }
            _ => {
                self.calls.counters.stray_returns.inc();
                abi::neg(abi::SYM_EINVAL)
            }
        }
    }

    /// The entry the guest published: global record + this vCPU's stack.
    fn entry(&self, vcpu: u32) -> Option<Entry> {
        let (global, own) = {
            let spy = self.spy();
            (spy.global()?.clone(), spy.vcpu(vcpu)?.clone())
        };
        // The generation is bumped outside the record: a change across the read means the
        // entry moved under it, so read again.
        let mut entry = None;
        for _ in 0..READ_TRIES {
            let gen = global.load_u64(page::H_GENERATION);
            let e = global.read_record(page::G_SEQ, READ_TRIES, |p| {
                (
                    p.load_u64(page::G_SYMCALL_ENTRY),
                    p.load_u32(page::G_SYMCALL_CS),
                    p.load_u32(page::G_SYMCALL_SS),
                    p.load_u64(page::G_SYMCALL_FLAGS),
                )
            })?;
            if global.load_u64(page::H_GENERATION) == gen {
                entry = Some(e);
                break;
            }
        }
        let (rip, cs, ss, flags) = entry?;
        let stack = own.read_record(page::V_SEQ, READ_TRIES, |p| {
            p.load_u64(page::V_SYMCALL_STACK)
        })?;
        let sel = |s: u32| u16::try_from(s).ok().filter(|s| *s != 0);
        if rip == 0 || stack == 0 {
            return None;
        }
        Some(Entry {
            rip,
            cs: sel(cs)?,
            ss: sel(ss)?,
            flags,
            stack,
        })
    }

    /// The call, on the vCPU thread.
    fn run_call(
        &self,
        ctx: &mut VcpuCtx,
        nr: u64,
        args: [u64; 5],
        limits: CallLimits,
    ) -> Result<SymReturn, SymCallError> {
        let started = Instant::now();
        let vcpu = ctx.id();
        let slot = &self.calls.slots[vcpu as usize];
        let state = |what, source: HvError| SymCallError::State { vcpu, what, source };
        let entry = self.entry(vcpu).ok_or(SymCallError::NotRegistered(vcpu))?;
        // A nested loop on a paused vCPU would wait for a resume: lift the pause meanwhile.
        let was_paused = ctx.set_paused(false);
        let sync = ctx.vcpu.can_sync_state() && self.calls.mirror.load(Ordering::Relaxed);
        let saved = match save(ctx, sync) {
            Ok(s) => s,
            Err(e) => {
                ctx.vcpu.set_state_sync(false);
                ctx.set_paused(was_paused);
                return Err(match e {
                    None => SymCallError::Stopped,
                    Some(e) => state("read", e),
                });
            }
        };
        *slot.ret.lock().unwrap_or_else(|e| e.into_inner()) = None;
        let mut exits = 0;
        let loaded = load(ctx, sync, &saved, &entry, nr, &args);
        let outcome = match loaded {
            Ok(changed) => {
                slot.running.store(true, Ordering::SeqCst);
                let (outcome, n) = self.run_handler(ctx, slot, started, limits);
                exits = n;
                slot.running.store(false, Ordering::SeqCst);
                Ok((outcome, changed))
            }
            Err(e) => Err(e),
        };
        // 5. Restore (also after a failed load: part of it may have been written). The
        // completion's OUT is left unfinished: KVM finishes a fast OUT at the next entry only
        // if RIP still points at it, and the restored RIP is the interrupted context's.
        let (sregs_changed, events_changed) = match &outcome {
            Ok((Outcome::Returned([status, ..]), changed)) => {
                (changed.sregs || *status == abi::SYM_EFAULT, changed.events)
            }
            _ => (true, true),
        };
        let restored = restore(ctx, sync, &saved, sregs_changed, events_changed);
        if sync {
            ctx.vcpu.set_state_sync(false);
        }
        ctx.set_paused(was_paused);
        let (outcome, _) = outcome.map_err(|e| state("load", e))?;
        restored.map_err(|e| state("restore", e))?;
        let ns = started.elapsed().as_nanos() as u64;
        match outcome {
            Outcome::Returned([status, v0, v1]) => {
                let c = &self.calls.counters;
                c.completed.inc();
                if status == abi::SYM_EFAULT {
                    c.faults.inc();
                }
                let n = slot.completed.fetch_add(1, Ordering::Relaxed) + 1;
                if let Some(p) = self.spy().vcpu(vcpu) {
                    p.write_record(page::W_SEQ, |p| p.store_u64(page::W_SYMCALLS, n));
                }
                Ok(SymReturn {
                    status,
                    values: [v0, v1],
                    exits,
                    ns,
                })
            }
            Outcome::Timeout => Err(SymCallError::Timeout {
                vcpu,
                ms: limits.timeout.as_millis() as u64,
            }),
            Outcome::TooManyExits => Err(SymCallError::TooManyExits {
                vcpu,
                exits: limits.max_exits,
            }),
            Outcome::Stopped => Err(SymCallError::Stopped),
        }
    }

    /// Step 4: runs the guest until `HC_RETURN` on this vCPU or a bound; returns how it ended and
    /// the exits taken.
    fn run_handler(
        &self,
        ctx: &mut VcpuCtx,
        slot: &Slot,
        started: Instant,
        limits: CallLimits,
    ) -> (Outcome, u64) {
        let deadline = started + limits.timeout;
        let mut exits = 0u64;
        let mut cut = None;
        let end = ctx.run_until(|_| {
            exits += 1;
            if slot.ret.lock().unwrap_or_else(|e| e.into_inner()).is_some() {
                return true;
            }
            if exits >= limits.max_exits {
                cut = Some(Outcome::TooManyExits);
            } else if Instant::now() >= deadline {
                cut = Some(Outcome::Timeout);
            }
            cut.is_some()
        });
        let outcome = if end == LoopEnd::Stopped {
            Outcome::Stopped
        } else if let Some(cut) = cut {
            cut
        } else {
            match slot.ret.lock().unwrap_or_else(|e| e.into_inner()).take() {
                Some(r) => Outcome::Returned(r),
                None => Outcome::Stopped,
            }
        };
        (outcome, exits)
    }
}

/// What the load changed beyond the registers.
struct Changed {
    sregs: bool,
    events: bool,
}

/// A flat 64-bit code or data segment of privilege `sel & 3` (what a 64-bit GDT holds).
fn flat_segment(sel: u16, code: bool) -> kvm_segment {
    kvm_segment {
        base: 0,
        limit: 0xffff_ffff,
        selector: sel,
        type_: if code { 0xb } else { 0x3 },
        present: 1,
        dpl: (sel & 3) as u8,
        db: u8::from(!code),
        s: 1,
        l: u8::from(code),
        g: 1,
        avl: 0,
        unusable: 0,
        padding: 0,
    }
}

/// Steps 1 and 2: finishes the last exit's instruction (it belongs to the interrupted
/// context), then saves. With KVM's state mirror one empty KVM_RUN does both; otherwise the
/// pending exit is finished only if there is one, and the state read with GET ioctls. `None`:
/// the VM is stopping.
fn save(ctx: &mut VcpuCtx, sync: bool) -> Result<Saved, Option<HvError>> {
    if sync {
        ctx.vcpu.set_state_sync(true);
        if ctx.run_empty() == LoopEnd::Stopped {
            return Err(None);
        }
        let s = ctx.vcpu.synced_state();
        return Ok(Saved {
            mp_state: mp_state(ctx, &s.sregs)?,
            regs: s.regs,
            sregs: s.sregs,
            events: s.events,
        });
    }
    if ctx.complete_pending_exit() == LoopEnd::Stopped {
        return Err(None);
    }
    // The kick that queued this call has been served: a call issued right after the last one
    // finds the vCPU still in userspace with `immediate_exit` set, and would pay an empty
    // KVM_RUN. (A deadline kick cleared here is repeated.)
    ctx.vcpu.clear_immediate_exit();
    let sregs = ctx.vcpu.get_sregs()?;
    Ok(Saved {
        regs: ctx.vcpu.get_regs()?,
        events: ctx.vcpu.get_vcpu_events()?,
        mp_state: mp_state(ctx, &sregs)?,
        sregs,
    })
}

/// The multiprocessing state: a vCPU at CPL3 runs (HLT faults there), so only one elsewhere
/// needs the ioctl.
fn mp_state(ctx: &VcpuCtx, sregs: &kvm_sregs) -> Result<kvm_mp_state, HvError> {
    if sregs.cs.selector & 3 == 3 {
        return Ok(kvm_mp_state {
            mp_state: KVM_MP_STATE_RUNNABLE,
        });
    }
    ctx.vcpu.get_mp_state()
}

/// Step 3: loads the upcall context: entry, stack, flags (IF off, IOPL as registered), call number
/// and arguments; CS/SS only if they differ from the interrupted ones (the fast path: a guest
/// interrupted at CPL3 with the user selectors needs no segment load); no pending event or
/// interrupt shadow; runnable. With `sync`, the state goes to the handler's KVM_RUN through
/// kvm_run instead of SET ioctls.
fn load(
    ctx: &mut VcpuCtx,
    sync: bool,
    saved: &Saved,
    entry: &Entry,
    nr: u64,
    args: &[u64; 5],
) -> Result<Changed, HvError> {
    let mut changed = Changed {
        sregs: false,
        events: false,
    };
    let mut sregs = None;
    if saved.sregs.cs.selector != entry.cs || saved.sregs.ss.selector != entry.ss {
        let mut s = saved.sregs;
        s.cs = flat_segment(entry.cs, true);
        s.ss = flat_segment(entry.ss, false);
        changed.sregs = true;
        sregs = Some(s);
    }
    let e = &saved.events;
    let mut events = None;
    if e.exception.injected != 0
        || e.exception.pending != 0
        || e.interrupt.injected != 0
        || e.interrupt.shadow != 0
        || e.nmi.injected != 0
    {
        let mut ev = *e;
        ev.exception.injected = 0;
        ev.exception.pending = 0;
        ev.exception_has_payload = 0;
        ev.interrupt.injected = 0;
        ev.interrupt.shadow = 0;
        ev.nmi.injected = 0;
        ev.flags = KVM_VCPUEVENT_VALID_SHADOW;
        changed.events = true;
        events = Some(ev);
    }
    if saved.mp_state.mp_state != KVM_MP_STATE_RUNNABLE {
        ctx.vcpu.set_mp_state(kvm_mp_state {
            mp_state: KVM_MP_STATE_RUNNABLE,
        })?;
    }
    let mut r = saved.regs;
    r.rip = entry.rip;
    r.rsp = entry.stack;
    r.rflags = 0x2 | (entry.flags & 0x3000);
    r.rax = nr;
    r.rdi = args[0];
    r.rsi = args[1];
    r.rdx = args[2];
    r.r10 = args[3];
    r.r8 = args[4];
    if sync {
        ctx.vcpu
            .put_synced_state(Some(&r), sregs.as_ref(), events.as_ref());
        return Ok(changed);
    }
    if let Some(s) = &sregs {
        ctx.vcpu.set_sregs(s)?;
    }
    if let Some(ev) = &events {
        ctx.vcpu.set_vcpu_events(ev)?;
    }
    ctx.vcpu.set_regs(&r)?;
    Ok(changed)
}

/// Step 5: puts back what the call changed: registers always, the rest when the load or the
/// handler may have changed it. With `sync`, through kvm_run for the next KVM_RUN (a request
/// run before that flushes it with the SET ioctls).
fn restore(
    ctx: &mut VcpuCtx,
    sync: bool,
    saved: &Saved,
    sregs: bool,
    events: bool,
) -> Result<(), HvError> {
    if saved.mp_state.mp_state != KVM_MP_STATE_RUNNABLE {
        ctx.vcpu.set_mp_state(saved.mp_state)?;
    }
    if sync {
        ctx.vcpu.put_synced_state(
            Some(&saved.regs),
            sregs.then_some(&saved.sregs),
            events.then_some(&saved.events),
        );
        return Ok(());
    }
    if sregs {
        ctx.vcpu.set_sregs(&saved.sregs)?;
    }
    if events {
        ctx.vcpu.set_vcpu_events(&saved.events)?;
    }
    ctx.vcpu.set_regs(&saved.regs)
}

#[cfg(test)]
mod tests {
    //! What can be checked without a vCPU: refusals, stray returns, descriptors.

    use lucid_mem::vm_memory::GuestAddress;
    use lucid_mem::GuestMemoryMmap;

    use super::*;

    fn sym() -> (Arc<Symbiotic>, Arc<StatsRegistry>) {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap();
        let stats = StatsRegistry::new();
        (super::super::tests_support::sym(&mem, 2, &stats), stats)
    }

    #[test]
    fn calls_need_a_vcpu() {
        let (s, stats) = sym();
        // No vCPU handles yet (the VM is not built), and none numbered 7 ever.
        assert!(matches!(
            s.call(0, abi::call::ECHO, [0; 5]),
            Err(SymCallError::NoVcpu(0))
        ));
        assert!(matches!(
            s.call(7, abi::call::ECHO, [0; 5]),
            Err(SymCallError::NoVcpu(7))
        ));
        assert_eq!(stats.snapshot()["sym.call.calls"], 2);
        assert_eq!(s.symcalls_on(7), 0);
    }

    #[test]
    fn a_return_outside_a_call_is_refused_and_counted() {
        let (s, stats) = sym();
        assert_eq!(s.symcall_return(0, 0, 1, 2), abi::neg(abi::SYM_EINVAL));
        assert_eq!(s.symcall_return(9, 0, 1, 2), abi::neg(abi::SYM_EINVAL));
        assert_eq!(stats.snapshot()["sym.call.stray_returns"], 2);
        // During a call the values land in the vCPU's slot.
        let slot = &s.calls.slots[1];
        slot.running.store(true, Ordering::SeqCst);
        assert_eq!(s.symcall_return(1, 14, 13, 0x1234), 0);
        assert_eq!(*slot.ret.lock().unwrap(), Some([14, 13, 0x1234]));
    }

    #[test]
    fn loaded_segments_are_flat_64_bit() {
        let cs = flat_segment(0x2b, true);
        assert_eq!(
            (cs.dpl, cs.l, cs.db, cs.type_, cs.present),
            (3, 1, 0, 0xb, 1)
        );
        let ss = flat_segment(0x23, false);
        assert_eq!((ss.dpl, ss.l, ss.db, ss.type_), (3, 0, 1, 0x3));
        assert_eq!(flat_segment(0x18, true).dpl, 0);
    }
}
