//! A KVM vCPU: registers, CPUID, and `run`, which returns Lucid's own [`Exit`] so the exit loop
//! above never sees a KVM type it would have to match on.

use kvm_bindings::{
    kvm_fpu, kvm_lapic_state, kvm_mp_state, kvm_regs, kvm_run, kvm_sregs, CpuId,
    KVM_INTERNAL_ERROR_EMULATION,
};
use kvm_ioctls::{SyncReg, VcpuExit, VcpuFd};

use std::sync::Arc;

use crate::vm::VmInner;
use crate::HvError;

/// Why KVM returned to userspace. Borrowed data must be filled (reads) before the next `run`.
#[derive(Debug)]
pub enum Exit<'a> {
    IoIn(u16, &'a mut [u8]),
    IoOut(u16, &'a [u8]),
    /// A string `ins` of several elements (`rep insb`): port, element size, every element in
    /// order; each element is one access of that size to the port.
    IoInRep(u16, usize, &'a mut [u8]),
    /// A string `outs` of several elements, as [`Exit::IoInRep`].
    IoOutRep(u16, usize, &'a [u8]),
    MmioRead(u64, &'a mut [u8]),
    MmioWrite(u64, &'a [u8]),
    Hlt,
    /// Triple fault or an explicit shutdown.
    Shutdown,
    /// KVM could not handle something, typically an instruction its emulator lacks.
    InternalError(InternalError),
    /// A system event (reset, shutdown, crash) raised by the in-kernel devices.
    SystemEvent(u32),
    /// A guest RDMSR of an MSR Lucid traps; set `error` to inject #GP.
    RdMsr {
        index: u32,
        data: &'a mut u64,
        error: &'a mut u8,
    },
    /// A guest WRMSR of an MSR Lucid traps; set `error` to inject #GP.
    WrMsr {
        index: u32,
        data: u64,
        error: &'a mut u8,
    },
    /// The run was interrupted by a signal or `immediate_exit`.
    Interrupted,
    FailEntry(u64),
    /// An exit reason Lucid does not handle, by KVM number or name.
    Other(&'static str),
}

impl Exit<'_> {
    pub fn kind(&self) -> ExitKind {
        match self {
            Exit::IoIn(..) | Exit::IoInRep(..) => ExitKind::IoIn,
            Exit::IoOut(..) | Exit::IoOutRep(..) => ExitKind::IoOut,
            Exit::MmioRead(..) => ExitKind::MmioRead,
            Exit::MmioWrite(..) => ExitKind::MmioWrite,
            Exit::Hlt => ExitKind::Hlt,
            Exit::Shutdown => ExitKind::Shutdown,
            Exit::InternalError(_) => ExitKind::InternalError,
            Exit::SystemEvent(_) => ExitKind::SystemEvent,
            Exit::RdMsr { .. } => ExitKind::MsrRead,
            Exit::WrMsr { .. } => ExitKind::MsrWrite,
            Exit::Interrupted => ExitKind::Interrupted,
            Exit::FailEntry(_) => ExitKind::FailEntry,
            Exit::Other(_) => ExitKind::Other,
        }
    }
}

/// The kind of an [`Exit`], without its data: what the exit loop steers by and counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ExitKind {
    IoIn,
    IoOut,
    MmioRead,
    MmioWrite,
    Hlt,
    Shutdown,
    InternalError,
    SystemEvent,
    MsrRead,
    MsrWrite,
    Interrupted,
    FailEntry,
    Other,
}

impl ExitKind {
    /// Every kind, in the order of [`ExitKind::index`].
    pub const ALL: [ExitKind; 13] = [
        ExitKind::IoIn,
        ExitKind::IoOut,
        ExitKind::MmioRead,
        ExitKind::MmioWrite,
        ExitKind::Hlt,
        ExitKind::Shutdown,
        ExitKind::InternalError,
        ExitKind::SystemEvent,
        ExitKind::MsrRead,
        ExitKind::MsrWrite,
        ExitKind::Interrupted,
        ExitKind::FailEntry,
        ExitKind::Other,
    ];

    /// Its position in [`ExitKind::ALL`], for tables indexed by kind.
    pub const fn index(self) -> usize {
        self as usize
    }

    /// Short stable name, used as the counter name `vcpuN.exit.<name>`.
    pub const fn name(self) -> &'static str {
        match self {
            ExitKind::IoIn => "io_in",
            ExitKind::IoOut => "io_out",
            ExitKind::MmioRead => "mmio_read",
            ExitKind::MmioWrite => "mmio_write",
            ExitKind::Hlt => "hlt",
            ExitKind::Shutdown => "shutdown",
            ExitKind::InternalError => "internal_error",
            ExitKind::SystemEvent => "system_event",
            ExitKind::MsrRead => "msr_read",
            ExitKind::MsrWrite => "msr_write",
            ExitKind::Interrupted => "interrupted",
            ExitKind::FailEntry => "fail_entry",
            ExitKind::Other => "other",
        }
    }

    /// Whether KVM finishes the exit's instruction at the next `KVM_RUN` (an IN's data to its
    /// register, the skip past an OUT, an MSR access's result): until then the registers are
    /// not the guest's final ones.
    pub const fn completes_at_next_run(self) -> bool {
        matches!(
            self,
            ExitKind::IoIn
                | ExitKind::IoOut
                | ExitKind::MmioRead
                | ExitKind::MmioWrite
                | ExitKind::MsrRead
                | ExitKind::MsrWrite
        )
    }
}

impl std::fmt::Display for ExitKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// `KVM_EXIT_INTERNAL_ERROR` details; for emulation failures, the instruction bytes when KVM
/// reports them.
#[derive(Clone, Debug, Default)]
pub struct InternalError {
    pub suberror: u32,
    pub data: Vec<u64>,
    pub insn_bytes: Vec<u8>,
}

impl InternalError {
    pub fn is_emulation_failure(&self) -> bool {
        self.suberror == KVM_INTERNAL_ERROR_EMULATION
    }
}

/// Sets `immediate_exit` from another thread so a vCPU leaves (or does not enter) `KVM_RUN`.
/// Paired with a signal to the vCPU thread, no kick is ever lost.
#[derive(Clone, Copy)]
pub struct ImmediateExit(*mut u8);

// SAFETY: the pointer targets a byte in the vCPU's kvm_run mapping, which lives as long as the
// vCPU fd; the VMM joins vCPU threads (which own the fd) before dropping kickers' users.
unsafe impl Send for ImmediateExit {}
// SAFETY: see above; the only access is a volatile byte store.
unsafe impl Sync for ImmediateExit {}

impl ImmediateExit {
    pub fn set(&self) {
        // SAFETY: a single-byte volatile store into the shared kvm_run page; KVM reads it at entry.
        unsafe { std::ptr::write_volatile(self.0, 1) }
    }
}

pub struct Vcpu {
    id: u32,
    fd: VcpuFd,
    /// Address of the kvm_run mapping, kept as an integer so that reading exit details does not
    /// borrow `fd` while `run`'s borrow is alive.
    run_addr: usize,
    /// Whether KVM mirrors registers, segment registers and events in the kvm_run page
    /// (`KVM_CAP_SYNC_REGS`): see [`Vcpu::set_state_sync`].
    can_sync: bool,
    /// The VM and its guest memory: a vCPU fd keeps the kernel's VM (and its memory slots)
    /// alive, so it keeps the memory those slots point into alive too. Dropped after `fd`.
    _vm: Arc<VmInner>,
}

impl Vcpu {
    pub(crate) fn new(id: u32, mut fd: VcpuFd, vm: Arc<VmInner>, can_sync: bool) -> Self {
        let run_addr = fd.get_kvm_run() as *mut kvm_run as usize;
        Vcpu {
            id,
            fd,
            run_addr,
            can_sync,
            _vm: vm,
        }
    }

    pub fn id(&self) -> u32 {
        self.id
    }

    pub fn immediate_exit(&mut self) -> ImmediateExit {
        let run = self.run_addr as *mut kvm_run;
        // SAFETY: computing a field address inside the live kvm_run mapping.
        ImmediateExit(unsafe { std::ptr::addr_of_mut!((*run).immediate_exit) })
    }

    pub fn clear_immediate_exit(&mut self) {
        self.fd.set_kvm_immediate_exit(0);
    }

    /// Enters the guest until the next exit to userspace.
    pub fn run(&mut self) -> Result<Exit<'_>, HvError> {
        match self.fd.run() {
            Ok(exit) => Ok(match exit {
                VcpuExit::IoIn(p, d) => match io_size(self.run_addr) {
                    n if n > 0 && d.len() > n => Exit::IoInRep(p, n, d),
                    _ => Exit::IoIn(p, d),
                },
                VcpuExit::IoOut(p, d) => match io_size(self.run_addr) {
                    n if n > 0 && d.len() > n => Exit::IoOutRep(p, n, d),
                    _ => Exit::IoOut(p, d),
                },
                VcpuExit::MmioRead(a, d) => Exit::MmioRead(a, d),
                VcpuExit::MmioWrite(a, d) => Exit::MmioWrite(a, d),
                VcpuExit::Hlt => Exit::Hlt,
                VcpuExit::Shutdown => Exit::Shutdown,
                VcpuExit::InternalError => Exit::InternalError(internal_error(self.run_addr)),
                VcpuExit::SystemEvent(t, _) => Exit::SystemEvent(t),
                VcpuExit::Intr => Exit::Interrupted,
                VcpuExit::X86Rdmsr(m) => Exit::RdMsr {
                    index: m.index,
                    data: m.data,
                    error: m.error,
                },
                VcpuExit::X86Wrmsr(m) => Exit::WrMsr {
                    index: m.index,
                    data: m.data,
                    error: m.error,
                },
                VcpuExit::FailEntry(r, _) => Exit::FailEntry(r),
                VcpuExit::IrqWindowOpen => Exit::Other("irq_window_open"),
                VcpuExit::Exception => Exit::Other("exception"),
                VcpuExit::Debug(_) => Exit::Other("debug"),
                VcpuExit::Unknown => Exit::Other("unknown"),
                _ => Exit::Other("unsupported"),
            }),
            Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => {
                Ok(Exit::Interrupted)
            }
            Err(e) => Err(HvError::Ioctl("KVM_RUN", e)),
        }
    }
}

/// The element size of the I/O exit KVM_RUN just returned (its data holds `count` of them).
fn io_size(run_addr: usize) -> usize {
    // SAFETY: run_addr is the live kvm_run mapping of this vCPU, read after KVM_RUN returned
    // with KVM_EXIT_IO, so the `io` member of the union is the one KVM filled.
    unsafe { usize::from((*(run_addr as *const kvm_run)).__bindgen_anon_1.io.size) }
}

fn internal_error(run_addr: usize) -> InternalError {
    // SAFETY: run_addr is the live kvm_run mapping of this vCPU, read only after KVM_RUN returned.
    let run = unsafe { &*(run_addr as *const kvm_run) };
    // SAFETY: the exit reason is KVM_EXIT_INTERNAL_ERROR, so the `internal` and, for emulation
    // failures, `emulation_failure` members of the union are the ones KVM filled.
    unsafe {
        let internal = run.__bindgen_anon_1.internal;
        let n = (internal.ndata as usize).min(internal.data.len());
        let mut err = InternalError {
            suberror: internal.suberror,
            data: internal.data[..n].to_vec(),
            insn_bytes: Vec::new(),
        };
        if err.is_emulation_failure() {
            let ef = run.__bindgen_anon_1.emulation_failure;
            // flags bit 0: KVM_INTERNAL_ERROR_EMULATION_FLAG_INSTRUCTION_BYTES
            let insn = ef.__bindgen_anon_1.__bindgen_anon_1;
            if ef.flags & 1 != 0 {
                let len = (insn.insn_size as usize).min(insn.insn_bytes.len());
                err.insn_bytes = insn.insn_bytes[..len].to_vec();
            }
        }
        err
    }
}

impl Vcpu {
    pub fn get_regs(&self) -> Result<kvm_regs, HvError> {
        self.fd
            .get_regs()
            .map_err(|e| HvError::Ioctl("KVM_GET_REGS", e))
    }
    pub fn set_regs(&self, r: &kvm_regs) -> Result<(), HvError> {
        self.fd
            .set_regs(r)
            .map_err(|e| HvError::Ioctl("KVM_SET_REGS", e))
    }
    pub fn get_sregs(&self) -> Result<kvm_sregs, HvError> {
        self.fd
            .get_sregs()
            .map_err(|e| HvError::Ioctl("KVM_GET_SREGS", e))
    }
    pub fn set_sregs(&self, s: &kvm_sregs) -> Result<(), HvError> {
        self.fd
            .set_sregs(s)
            .map_err(|e| HvError::Ioctl("KVM_SET_SREGS", e))
    }
    pub fn get_fpu(&self) -> Result<kvm_fpu, HvError> {
        self.fd
            .get_fpu()
            .map_err(|e| HvError::Ioctl("KVM_GET_FPU", e))
    }
    pub fn set_fpu(&self, f: &kvm_fpu) -> Result<(), HvError> {
        self.fd
            .set_fpu(f)
            .map_err(|e| HvError::Ioctl("KVM_SET_FPU", e))
    }
    pub fn set_cpuid(&self, cpuid: &CpuId) -> Result<(), HvError> {
        self.fd
            .set_cpuid2(cpuid)
            .map_err(|e| HvError::Ioctl("KVM_SET_CPUID2", e))
    }
    pub fn get_lapic(&self) -> Result<kvm_lapic_state, HvError> {
        self.fd
            .get_lapic()
            .map_err(|e| HvError::Ioctl("KVM_GET_LAPIC", e))
    }
    pub fn set_lapic(&self, l: &kvm_lapic_state) -> Result<(), HvError> {
        self.fd
            .set_lapic(l)
            .map_err(|e| HvError::Ioctl("KVM_SET_LAPIC", e))
    }
    pub fn get_mp_state(&self) -> Result<kvm_mp_state, HvError> {
        self.fd
            .get_mp_state()
            .map_err(|e| HvError::Ioctl("KVM_GET_MP_STATE", e))
    }
    pub fn set_mp_state(&self, s: kvm_mp_state) -> Result<(), HvError> {
        self.fd
            .set_mp_state(s)
            .map_err(|e| HvError::Ioctl("KVM_SET_MP_STATE", e))
    }
    pub fn tsc_khz(&self) -> Result<u32, HvError> {
        self.fd
            .get_tsc_khz()
            .map_err(|e| HvError::Ioctl("KVM_GET_TSC_KHZ", e))
    }
    pub fn get_vcpu_events(&self) -> Result<kvm_bindings::kvm_vcpu_events, HvError> {
        self.fd
            .get_vcpu_events()
            .map_err(|e| HvError::Ioctl("KVM_GET_VCPU_EVENTS", e))
    }
    pub fn set_vcpu_events(&self, ev: &kvm_bindings::kvm_vcpu_events) -> Result<(), HvError> {
        self.fd
            .set_vcpu_events(ev)
            .map_err(|e| HvError::Ioctl("KVM_SET_VCPU_EVENTS", e))
    }
    /// Whether [`Vcpu::set_state_sync`] is available (`KVM_CAP_SYNC_REGS` with registers,
    /// segment registers and events).
    pub fn can_sync_state(&self) -> bool {
        self.can_sync
    }

    /// With `on`, every KVM_RUN leaves the registers, segment registers and events in the
    /// kvm_run page ([`Vcpu::synced_state`]) and [`Vcpu::put_synced_state`] hands changed ones
    /// to the next KVM_RUN: no GET/SET ioctl each (which cost microseconds apiece on some
    /// hosts). KVM_RUN with `immediate_exit` set then also reads the state, and finishes a
    /// pending exit, in one ioctl.
    pub fn set_state_sync(&mut self, on: bool) {
        for r in [
            SyncReg::Register,
            SyncReg::SystemRegister,
            SyncReg::VcpuEvents,
        ] {
            if on {
                self.fd.set_sync_valid_reg(r);
            } else {
                self.fd.clear_sync_valid_reg(r);
            }
        }
    }

    /// Whether [`Vcpu::set_state_sync`] is on.
    pub fn state_sync(&self) -> bool {
        // SAFETY: run_addr is this vCPU's live kvm_run mapping; the field is plain data only
        // this thread and KVM (inside KVM_RUN, on this thread) access.
        unsafe { (*(self.run_addr as *const kvm_run)).kvm_valid_regs != 0 }
    }

    /// The state KVM left in kvm_run at the last exit (with [`Vcpu::set_state_sync`] on), as
    /// changed by [`Vcpu::put_synced_state`] since.
    pub fn synced_state(&self) -> kvm_bindings::kvm_sync_regs {
        self.fd.sync_regs()
    }

    /// Hands state to the next KVM_RUN through kvm_run (each part given is marked dirty).
    /// Until then GET ioctls would not see it: [`Vcpu::flush_synced_state`] writes it at once.
    pub fn put_synced_state(
        &mut self,
        regs: Option<&kvm_regs>,
        sregs: Option<&kvm_sregs>,
        events: Option<&kvm_bindings::kvm_vcpu_events>,
    ) {
        let s = self.fd.sync_regs_mut();
        if let Some(r) = regs {
            s.regs = *r;
        }
        if let Some(r) = sregs {
            s.sregs = *r;
        }
        if let Some(e) = events {
            s.events = *e;
        }
        if regs.is_some() {
            self.fd.set_sync_dirty_reg(SyncReg::Register);
        }
        if sregs.is_some() {
            self.fd.set_sync_dirty_reg(SyncReg::SystemRegister);
        }
        if events.is_some() {
            self.fd.set_sync_dirty_reg(SyncReg::VcpuEvents);
        }
    }

    /// Writes state left dirty by [`Vcpu::put_synced_state`] with the SET ioctls now, so that
    /// code about to read or write the vCPU through ioctls sees it.
    pub fn flush_synced_state(&mut self) -> Result<(), HvError> {
        // SAFETY: as in `state_sync`.
        let dirty = unsafe { (*(self.run_addr as *const kvm_run)).kvm_dirty_regs };
        if dirty == 0 {
            return Ok(());
        }
        let s = self.fd.sync_regs();
        if dirty & u64::from(kvm_bindings::KVM_SYNC_X86_SREGS) != 0 {
            self.set_sregs(&s.sregs)?;
        }
        if dirty & u64::from(kvm_bindings::KVM_SYNC_X86_EVENTS) != 0 {
            self.set_vcpu_events(&s.events)?;
        }
        if dirty & u64::from(kvm_bindings::KVM_SYNC_X86_REGS) != 0 {
            self.set_regs(&s.regs)?;
        }
        for r in [
            SyncReg::Register,
            SyncReg::SystemRegister,
            SyncReg::VcpuEvents,
        ] {
            self.fd.clear_sync_dirty_reg(r);
        }
        Ok(())
    }

    /// Injects an exception (used to complete instructions KVM's emulator could not).
    pub fn inject_exception(&self, vector: u8, error_code: Option<u32>) -> Result<(), HvError> {
        let mut ev = self
            .fd
            .get_vcpu_events()
            .map_err(|e| HvError::Ioctl("KVM_GET_VCPU_EVENTS", e))?;
        ev.exception.injected = 1;
        ev.exception.nr = vector;
        ev.exception.has_error_code = error_code.is_some() as u8;
        ev.exception.error_code = error_code.unwrap_or(0);
        ev.flags = 0;
        self.fd
            .set_vcpu_events(&ev)
            .map_err(|e| HvError::Ioctl("KVM_SET_VCPU_EVENTS", e))
    }
    /// The CPUID entries KVM holds for this vCPU (what guest code that KVM emulates reads).
    pub fn get_cpuid(&self) -> Result<CpuId, HvError> {
        self.fd
            .get_cpuid2(kvm_bindings::KVM_MAX_CPUID_ENTRIES)
            .map_err(|e| HvError::Ioctl("KVM_GET_CPUID2", e))
    }
    /// The extended control registers (XCR0).
    pub fn get_xcrs(&self) -> Result<kvm_bindings::kvm_xcrs, HvError> {
        self.fd
            .get_xcrs()
            .map_err(|e| HvError::Ioctl("KVM_GET_XCRS", e))
    }
    /// The x87/SSE/AVX state in the standard XSAVE layout (legacy area, then the header with
    /// XSTATE_BV, the components whose values count).
    pub fn get_xsave(&self) -> Result<kvm_bindings::kvm_xsave, HvError> {
        self.fd
            .get_xsave()
            .map_err(|e| HvError::Ioctl("KVM_GET_XSAVE", e))
    }
    pub fn set_xsave(&self, x: &kvm_bindings::kvm_xsave) -> Result<(), HvError> {
        // SAFETY: KVM reads at most the 4096 bytes of `kvm_xsave`: the guest's state fits in them
        // because Lucid never enables dynamic XSTATE components (AMX) for its guests.
        unsafe { self.fd.set_xsave(x) }.map_err(|e| HvError::Ioctl("KVM_SET_XSAVE", e))
    }
    /// Guest-virtual to guest-physical, through the vCPU's current page tables.
    pub fn translate(&self, gva: u64) -> Result<Option<u64>, HvError> {
        let t = self
            .fd
            .translate_gva(gva)
            .map_err(|e| HvError::Ioctl("KVM_TRANSLATE", e))?;
        Ok((t.valid != 0).then_some(t.physical_address))
    }

    pub fn stats(&self) -> Option<crate::KvmStats> {
        crate::KvmStats::open(&self.fd)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_kinds_are_listed_in_index_order_with_distinct_names() {
        for (i, k) in ExitKind::ALL.iter().enumerate() {
            assert_eq!(k.index(), i);
        }
        let names: std::collections::HashSet<_> = ExitKind::ALL.iter().map(|k| k.name()).collect();
        assert_eq!(names.len(), ExitKind::ALL.len());
        assert_eq!(
            Exit::RdMsr {
                index: 0,
                data: &mut 0,
                error: &mut 0
            }
            .kind()
            .name(),
            "msr_read"
        );
    }
}
