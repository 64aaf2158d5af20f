//! Symbiotic modules (docs/symbiotic.md §7): Lucid injects a relocatable module
//! into a running guest. Lucid checks the object (`lucid_sym::module::check`), copies it into the
//! object buffer the guest's loader published, posts a request in the SymSpy mailbox and waits
//! for the reply (`HC_NOTIFY(NOTIFY_MODULE_REPLY)` wakes it); the guest's loader links it
//! against its exports and runs its init. A read-only module takes two round trips: the guest
//! links the code for a window outside RAM and stages it, Lucid copies it into a
//! `KVM_MEM_READONLY` memory slot at that window (guest writes there become MMIO exits Lucid
//! drops and counts) and the guest runs init from the slot. Requests are serialized; they run
//! on the caller's thread, which must not be a vCPU thread (the guest answers from a vCPU).

use std::collections::BTreeMap;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use lucid_devices::{Bus, BusDevice};
use lucid_mem::vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryRegion};
use lucid_mem::{Backing, GuestRam};
use lucid_stats::{Counter, StatsRegistry};
use lucid_sym::abi::module as m;
use lucid_sym::module::{check, Limits, ModuleCheckError};
use lucid_sym::SpyPage;

use super::Symbiotic;

/// How long a request waits for the guest's loader when the caller gives no timeout.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(5);
/// Read-only windows at a time (memory slots `RO_SLOT_BASE..+MAX_RO`).
const MAX_RO: u32 = 64;
const RO_SLOT_BASE: u32 = lucid_hv::EXTRA_SLOT_BASE + 16;

/// How to load a module.
#[derive(Clone, Debug, Default)]
pub struct ModuleOptions {
    /// Place the module's code in a read-only memory slot the guest cannot write.
    pub read_only: bool,
    /// How long to wait for the guest's loader (default [`DEFAULT_TIMEOUT`]).
    pub timeout: Option<std::time::Duration>,
}

/// A loaded module.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct ModuleInfo {
    pub id: u32,
    pub name: String,
    /// Guest-physical address of its code.
    pub base: u64,
    pub size: u64,
    pub read_only: bool,
    /// What its init function returned.
    pub init_result: u64,
    /// Post to init completed, in microseconds.
    pub load_us: u64,
}

/// The guest's module loader as it describes itself in the mailbox.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct LoaderInfo {
    pub arena: u64,
    pub arena_size: u64,
    pub object: u64,
    pub object_size: u64,
    pub arena_used: u64,
    pub loaded: u32,
    pub requests: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum ModuleError {
    #[error("module loading is not available in this build")]
    Unavailable,
    #[error("{0}")]
    Refused(String),
    #[error("Lucid refused the module: {0}")]
    Check(#[from] ModuleCheckError),
    #[error("the guest refused the module: {message} (status {status})")]
    Guest { status: u32, message: String },
    #[error("no module loader in the guest: {0}")]
    NoLoader(String),
    #[error("the guest's module loader did not answer within {0:?} (is its main loop polling the mailbox?); the request was withdrawn")]
    Timeout(Duration),
    #[error("no module {0} is loaded")]
    NoSuchModule(u32),
    #[error("read-only placement failed: {0}")]
    ReadOnly(String),
    #[error("module requests cannot be made from a vCPU thread (the guest answers on a vCPU): use another thread")]
    OnVcpuThread,
}

/// `sym.mod.*` counters.
pub struct ModCounters {
    pub loads: Arc<Counter>,
    pub unloads: Arc<Counter>,
    pub calls: Arc<Counter>,
    pub refused_guest: Arc<Counter>,
    pub refused_lucid: Arc<Counter>,
    pub timeouts: Arc<Counter>,
    pub ro_writes_blocked: Arc<Counter>,
    pub bytes: Arc<Counter>,
}

struct RoWindow {
    index: u32,
    gpa: u64,
    /// The slot's memory (Lucid's writable mapping of it); dropped after the slot is gone.
    _ram: GuestRam,
}

struct Loaded {
    info: ModuleInfo,
    ro: Option<RoWindow>,
}

#[derive(Default)]
struct State {
    seq: u32,
    loaded: BTreeMap<u32, Loaded>,
    ro_used: u64,
}

/// The module side of [`Symbiotic`].
pub struct Modules {
    counters: ModCounters,
    /// Held for a whole request: one at a time.
    state: Mutex<State>,
    /// Bumped by `HC_NOTIFY(NOTIFY_MODULE_REPLY)`.
    notified: Mutex<u64>,
    wake: Condvar,
    hv: Option<lucid_hv::Vm>,
    mmio: Arc<Bus>,
}

/// Guest writes into a read-only window: dropped and counted; reads there never exit.
struct RoGuard {
    blocked: Arc<Counter>,
}

impl BusDevice for RoGuard {
    fn read(&mut self, _offset: u64, data: &mut [u8]) {
        data.fill(0);
    }
    fn write(&mut self, offset: u64, _data: &[u8]) {
        self.blocked.inc();
        log::debug!("sym: guest write into a read-only module at +{offset:#x} dropped");
    }
}

impl Modules {
    pub(crate) fn new(stats: &StatsRegistry, mmio: Arc<Bus>, hv: Option<lucid_hv::Vm>) -> Self {
        let c = |n: &str| stats.counter(format!("sym.mod.{n}"));
        Modules {
            counters: ModCounters {
                loads: c("loads"),
                unloads: c("unloads"),
                calls: c("calls"),
                refused_guest: c("refused_guest"),
                refused_lucid: c("refused_lucid"),
                timeouts: c("timeouts"),
                ro_writes_blocked: c("ro_writes_blocked"),
                bytes: c("bytes"),
            },
            state: Mutex::new(State::default()),
            notified: Mutex::new(0),
            wake: Condvar::new(),
            hv,
            mmio,
        }
    }

    /// `HC_NOTIFY(NOTIFY_MODULE_REPLY)`: a reply is ready.
    pub(crate) fn notify(&self) {
        *self.notified.lock().unwrap_or_else(|e| e.into_inner()) += 1;
        self.wake.notify_all();
    }

    pub fn counters(&self) -> &ModCounters {
        &self.counters
    }
}

/// A reply read back from the mailbox.
struct Reply {
    status: u32,
    id: u32,
    stage: u32,
    base: u64,
    size: u64,
    init: u64,
    staged: u64,
    staged_size: u64,
    message: String,
}

fn read_reply(page: &SpyPage, mem: &lucid_mem::GuestMemoryMmap) -> Reply {
    let mut msg = [0u8; m::MESSAGE_LEN];
    let _ = mem.read_slice(&mut msg, GuestAddress(page.gpa() + m::P_MESSAGE));
    let n = msg.iter().position(|&c| c == 0).unwrap_or(msg.len());
    Reply {
        status: page.load_u32(m::P_STATUS),
        id: page.load_u32(m::P_ID),
        stage: page.load_u32(m::P_STAGE),
        base: page.load_u64(m::P_BASE),
        size: page.load_u64(m::P_SIZE),
        init: page.load_u64(m::P_INIT),
        staged: page.load_u64(m::P_STAGED),
        staged_size: page.load_u64(m::P_STAGED_SIZE),
        message: String::from_utf8_lossy(&msg[..n]).into_owned(),
    }
}

fn loader_info(page: &SpyPage) -> Option<LoaderInfo> {
    (page.load_u32(m::A_MAGIC) == m::LOADER_MAGIC).then(|| LoaderInfo {
        arena: page.load_u64(m::A_ARENA),
        arena_size: page.load_u64(m::A_ARENA_SIZE),
        object: page.load_u64(m::A_OBJECT),
        object_size: page.load_u64(m::A_OBJECT_SIZE),
        arena_used: page.load_u64(m::A_ARENA_USED),
        loaded: page.load_u32(m::A_LOADED),
        requests: page.load_u64(m::A_POLLS),
    })
}

fn in_ram(mem: &lucid_mem::GuestMemoryMmap, gpa: u64, len: u64) -> bool {
    len == 0 || (usize::try_from(len).is_ok() && mem.check_range(GuestAddress(gpa), len as usize))
}

struct Request<'a> {
    op: u32,
    flags: u32,
    id: u32,
    size: u64,
    ro: (u64, u64),
    name: &'a str,
    arg: u64,
}

impl Symbiotic {
    pub fn module_counters(&self) -> &ModCounters {
        self.modules.counters()
    }

    /// The guest's module loader, once it is ready.
    pub fn module_loader(&self) -> Option<LoaderInfo> {
        loader_info(&self.spy().global()?.clone())
    }

    /// Memory slots of read-only modules in place now.
    pub fn module_slots(&self) -> Vec<u32> {
        self.modules
            .hv
            .as_ref()
            .map(|v| v.extra_slots())
            .unwrap_or_default()
    }

    /// Loads module `bytes` (an ELF64 relocatable object) into the guest.
    pub fn load_module(
        &self,
        bytes: &[u8],
        opts: &ModuleOptions,
    ) -> Result<ModuleInfo, ModuleError> {
        self.load(bytes, opts, true)
    }

    /// [`Symbiotic::load_module`] without Lucid's checks, so that tests see the guest loader
    /// refuse bad objects on its own.
    pub fn load_module_unchecked(
        &self,
        bytes: &[u8],
        opts: &ModuleOptions,
    ) -> Result<ModuleInfo, ModuleError> {
        self.load(bytes, opts, false)
    }

    /// Runs module `id`'s exit function and frees it in the guest (and its read-only slot).
    pub fn unload_module(&self, id: u32) -> Result<(), ModuleError> {
        let mut st = self.module_state()?;
        if !st.loaded.contains_key(&id) {
            return Err(ModuleError::NoSuchModule(id));
        }
        let (page, _) = self.ready_loader(DEFAULT_TIMEOUT)?;
        let req = Request {
            op: m::OP_UNLOAD,
            flags: 0,
            id,
            size: 0,
            ro: (0, 0),
            name: "",
            arg: 0,
        };
        let r = self.round_trip(&mut st, &page, &req, DEFAULT_TIMEOUT)?;
        if r.status != 0 && r.status != m::SYM_ENOENT {
            return Err(ModuleError::Guest {
                status: r.status,
                message: r.message,
            });
        }
        if let Some(l) = st.loaded.remove(&id) {
            if let Some(ro) = l.ro {
                self.remove_window(&mut st, ro);
            }
        }
        self.modules.counters.unloads.inc();
        Ok(())
    }

    /// Runs module `id`'s `module_call(arg)` in the guest and returns its result.
    pub fn call_module(&self, id: u32, arg: u64) -> Result<u64, ModuleError> {
        let mut st = self.module_state()?;
        if !st.loaded.contains_key(&id) {
            return Err(ModuleError::NoSuchModule(id));
        }
        let (page, _) = self.ready_loader(DEFAULT_TIMEOUT)?;
        let req = Request {
            op: m::OP_CALL,
            flags: 0,
            id,
            size: 0,
            ro: (0, 0),
            name: "",
            arg,
        };
        let r = self.round_trip(&mut st, &page, &req, DEFAULT_TIMEOUT)?;
        if r.status != 0 {
            return Err(ModuleError::Guest {
                status: r.status,
                message: r.message,
            });
        }
        self.modules.counters.calls.inc();
        Ok(r.init)
    }

    /// The modules loaded now.
    pub fn modules(&self) -> Vec<ModuleInfo> {
        let st = self.modules.state.lock().unwrap_or_else(|e| e.into_inner());
        st.loaded.values().map(|l| l.info.clone()).collect()
    }

    fn module_state(&self) -> Result<std::sync::MutexGuard<'_, State>, ModuleError> {
        if std::thread::current()
            .name()
            .is_some_and(|n| n.starts_with("lucid-vcpu"))
        {
            return Err(ModuleError::OnVcpuThread);
        }
        Ok(self.modules.state.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Waits (up to `timeout`) for a registered global page whose loader is ready.
    fn ready_loader(&self, timeout: Duration) -> Result<(SpyPage, LoaderInfo), ModuleError> {
        let end = Instant::now() + timeout;
        loop {
            let page = self.spy().global().cloned();
            if let Some(info) = page.as_ref().and_then(loader_info) {
                return Ok((page.unwrap_or_else(|| unreachable!()), info));
            }
            if Instant::now() >= end {
                self.modules.counters.timeouts.inc();
                return Err(ModuleError::NoLoader(match page {
                    None => format!(
                        "no SymSpy global page registered within {timeout:?} (run a symbiotic \
                         guest with the kit's loader, e.g. sym-mod)"
                    ),
                    Some(_) => format!(
                        "the guest registered SymSpy but started no module loader within \
                         {timeout:?} (symmod_init)"
                    ),
                }));
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    fn load(
        &self,
        bytes: &[u8],
        opts: &ModuleOptions,
        checked: bool,
    ) -> Result<ModuleInfo, ModuleError> {
        let timeout = opts.timeout.unwrap_or(DEFAULT_TIMEOUT);
        let mut st = self.module_state()?;
        let (page, loader) = self.ready_loader(timeout)?;
        let mem = self.memory().clone();
        if !in_ram(&mem, loader.object, loader.object_size)
            || !in_ram(&mem, loader.arena, loader.arena_size)
        {
            return Err(ModuleError::NoLoader(format!(
                "its object buffer {:#x}+{:#x} or arena {:#x}+{:#x} is not guest RAM",
                loader.object, loader.object_size, loader.arena, loader.arena_size
            )));
        }
        let limits = Limits {
            max_object: loader.object_size,
            max_image: loader.arena_size,
        };
        let name = match check(bytes, &limits) {
            Ok(info) => info.source,
            Err(e) if checked => {
                self.modules.counters.refused_lucid.inc();
                return Err(e.into());
            }
            Err(_) => None,
        }
        .unwrap_or_else(|| "module".into());
        if bytes.len() as u64 > loader.object_size {
            self.modules.counters.refused_lucid.inc();
            return Err(ModuleCheckError::ObjectTooBig {
                size: bytes.len() as u64,
                max: loader.object_size,
            }
            .into());
        }
        let ro = if opts.read_only {
            Some(self.take_window(&mut st)?)
        } else {
            None
        };
        let start = Instant::now();
        let r = mem
            .write_slice(bytes, GuestAddress(loader.object))
            .map_err(|e| ModuleError::Refused(format!("copying into the guest: {e}")));
        let r = r.and_then(|()| {
            let req = Request {
                op: m::OP_LOAD,
                flags: if ro.is_some() { m::FLAG_READ_ONLY } else { 0 },
                id: 0,
                size: bytes.len() as u64,
                ro: ro.map(|(_, gpa)| (gpa, m::RO_SLOT)).unwrap_or((0, 0)),
                name: &name,
                arg: 0,
            };
            self.round_trip(&mut st, &page, &req, timeout)
        });
        let mut r = match r {
            Ok(r) if r.status == 0 => r,
            Ok(r) => {
                if let Some((i, _)) = ro {
                    st.ro_used &= !(1 << i);
                }
                self.modules.counters.refused_guest.inc();
                return Err(ModuleError::Guest {
                    status: r.status,
                    message: r.message,
                });
            }
            Err(e) => {
                if let Some((i, _)) = ro {
                    st.ro_used &= !(1 << i);
                }
                return Err(e);
            }
        };
        let mut window = None;
        if let Some((index, gpa)) = ro {
            match self.seal(&mut st, &page, &r, index, gpa, timeout) {
                Ok((w, sealed)) => {
                    window = Some(w);
                    r = sealed;
                }
                Err(e) => {
                    st.ro_used &= !(1 << index);
                    return Err(e);
                }
            }
        }
        let info = ModuleInfo {
            id: r.id,
            name,
            base: r.base,
            size: r.size,
            read_only: window.is_some(),
            init_result: r.init,
            load_us: start.elapsed().as_micros() as u64,
        };
        self.modules.counters.loads.inc();
        self.modules.counters.bytes.add(bytes.len() as u64);
        let old = st.loaded.insert(
            info.id,
            Loaded {
                info: info.clone(),
                ro: window,
            },
        );
        // The id is the guest's word: one it reuses replaces the old record, whose read-only
        // slot, MMIO guard and window would otherwise stay taken for the VM's life.
        if let Some(old) = old {
            log::warn!(
                "sym: the guest reused module id {} for {}",
                info.id,
                info.name
            );
            if let Some(ro) = old.ro {
                self.remove_window(&mut st, ro);
            }
        }
        Ok(info)
    }

    /// A free read-only window: (index, GPA). The window must lie above guest RAM.
    fn take_window(&self, st: &mut State) -> Result<(u32, u64), ModuleError> {
        if self.modules.hv.is_none() {
            return Err(ModuleError::ReadOnly("no KVM VM attached".into()));
        }
        let (lo, hi) = (m::RO_WINDOW, m::RO_WINDOW + m::RO_WINDOW_SIZE);
        if self
            .memory()
            .iter()
            .any(|r| r.start_addr().0 < hi && r.start_addr().0 + r.len() > lo)
        {
            return Err(ModuleError::ReadOnly(format!(
                "guest RAM reaches the read-only window {lo:#x}..{hi:#x}: give the VM less than \
                 {} MiB of memory",
                lo >> 20
            )));
        }
        let index = (0..MAX_RO)
            .find(|i| st.ro_used & (1 << i) == 0)
            .ok_or_else(|| ModuleError::ReadOnly(format!("all {MAX_RO} windows in use")))?;
        st.ro_used |= 1 << index;
        Ok((index, lo + u64::from(index) * m::RO_SLOT))
    }

    /// Read-only load, second half: copy the staged code into a read-only slot at the window,
    /// guard the window against writes and let the guest run init from it.
    fn seal(
        &self,
        st: &mut State,
        page: &SpyPage,
        staged: &Reply,
        index: u32,
        gpa: u64,
        timeout: Duration,
    ) -> Result<(RoWindow, Reply), ModuleError> {
        let mem = self.memory();
        let hv = self
            .modules
            .hv
            .as_ref()
            .ok_or_else(|| ModuleError::ReadOnly("no KVM VM attached".into()))?;
        if staged.stage != m::STAGE_STAGED
            || staged.base != gpa
            || staged.staged_size > m::RO_SLOT
            || !in_ram(mem, staged.staged, staged.staged_size)
        {
            return Err(ModuleError::ReadOnly(format!(
                "the guest staged {:#x}+{:#x} for {:#x} (stage {}), expected code for {gpa:#x} \
                 in RAM, at most {:#x} bytes",
                staged.staged,
                staged.staged_size,
                staged.base,
                staged.stage,
                m::RO_SLOT
            )));
        }
        let mut code = vec![0u8; staged.staged_size as usize];
        mem.read_slice(&mut code, GuestAddress(staged.staged))
            .map_err(|e| ModuleError::ReadOnly(format!("reading the staged code: {e}")))?;
        let ram = GuestRam::new(&[(gpa, m::RO_SLOT)], Backing::Anonymous)
            .map_err(|e| ModuleError::ReadOnly(format!("slot memory: {e}")))?;
        ram.memory()
            .write_slice(&code, GuestAddress(gpa))
            .map_err(|e| ModuleError::ReadOnly(format!("filling the slot: {e}")))?;
        let slot = RO_SLOT_BASE + index;
        hv.map_slot(slot, ram.memory(), true)
            .map_err(|e| ModuleError::ReadOnly(format!("memory slot {slot}: {e}")))?;
        let guard = Arc::new(Mutex::new(RoGuard {
            blocked: self.modules.counters.ro_writes_blocked.clone(),
        }));
        let _ = self
            .modules
            .mmio
            .insert(gpa, m::RO_SLOT, "sym-module-ro", guard);
        let window = RoWindow {
            index,
            gpa,
            _ram: ram,
        };
        let req = Request {
            op: m::OP_SEAL,
            flags: 0,
            id: staged.id,
            size: 0,
            ro: (gpa, m::RO_SLOT),
            name: "",
            arg: 0,
        };
        match self.round_trip(st, page, &req, timeout) {
            Ok(r) if r.status == 0 => Ok((window, r)),
            Ok(r) => {
                self.remove_window(st, window);
                self.modules.counters.refused_guest.inc();
                Err(ModuleError::Guest {
                    status: r.status,
                    message: r.message,
                })
            }
            Err(e) => {
                self.remove_window(st, window);
                Err(e)
            }
        }
    }

    fn remove_window(&self, st: &mut State, w: RoWindow) {
        if let Some(hv) = &self.modules.hv {
            if let Err(e) = hv.unmap_slot(RO_SLOT_BASE + w.index) {
                // The slot is still in place: keep its window taken (and guarded).
                log::warn!("sym: removing the read-only slot of {:#x}: {e}", w.gpa);
                return;
            }
        }
        self.modules.mmio.remove(w.gpa);
        st.ro_used &= !(1 << w.index);
    }

    /// Posts `req` and waits for its reply; on timeout the request is withdrawn (a new sequence
    /// with `OP_NONE`, which the loader skips).
    fn round_trip(
        &self,
        st: &mut State,
        page: &SpyPage,
        req: &Request,
        timeout: Duration,
    ) -> Result<Reply, ModuleError> {
        let g = page.gpa();
        let mem = self.memory();
        // The loader remembers the last sequence it saw; continue from the page's.
        st.seq = page.load_u32(m::R_SEQ).wrapping_add(1);
        if st.seq == page.load_u32(m::P_SEQ) {
            st.seq = st.seq.wrapping_add(1);
        }
        let seq = st.seq;
        page.store_u32(m::R_OP, req.op);
        page.store_u32(m::R_FLAGS, req.flags);
        page.store_u32(m::R_ID, req.id);
        page.store_u64(m::R_SIZE, req.size);
        page.store_u64(m::R_RO_GPA, req.ro.0);
        page.store_u64(m::R_RO_SIZE, req.ro.1);
        page.store_u64(m::R_ARG, req.arg);
        let mut name = [0u8; m::NAME_LEN];
        let n = req.name.len().min(m::NAME_LEN - 1);
        name[..n].copy_from_slice(&req.name.as_bytes()[..n]);
        let _ = mem.write_slice(&name, GuestAddress(g + m::R_NAME));
        // Release: the fields above are visible before the new sequence.
        page.store_u32(m::R_SEQ, seq);

        let end = Instant::now() + timeout;
        let mut seen = self
            .modules
            .notified
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        loop {
            if page.load_u32(m::P_SEQ) == seq {
                drop(seen);
                return Ok(read_reply(page, mem));
            }
            let now = Instant::now();
            if now >= end {
                break;
            }
            // Bounded waits: a notify that raced ahead of the check is caught next round.
            let wait = (end - now).min(Duration::from_millis(5));
            seen = self
                .modules
                .wake
                .wait_timeout(seen, wait)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        drop(seen);
        page.store_u32(m::R_OP, m::OP_NONE);
        st.seq = seq.wrapping_add(1);
        page.store_u32(m::R_SEQ, st.seq);
        // The loader checks the sequence before it replies and undoes a load it finished
        // after the withdrawal; a reply that beat the withdrawal still counts.
        if page.load_u32(m::P_SEQ) == seq {
            return Ok(read_reply(page, mem));
        }
        self.modules.counters.timeouts.inc();
        log::warn!(
            "sym: module request {} (op {}) timed out after {timeout:?}",
            seq,
            req.op
        );
        Err(ModuleError::Timeout(timeout))
    }
}
