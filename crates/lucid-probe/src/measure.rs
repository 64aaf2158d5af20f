//! The probe's guest programs and measurements, all on [`MiniVm`].

use std::sync::Arc;
use std::time::Duration;

use lucid_hv::{Exit, IoAddr, Kvm};
use vmm_sys_util::eventfd::EventFd;

use crate::codebuf::CodeBuf;
use crate::minivm::{CpuMode, Flow, MiniVm};
use crate::{CpuidLeaf, CpuidSeen, ProbeError};

/// Port written once per operation by the exit-cost guests.
pub const PORT_OP: u16 = 0x80;
/// Port written by every guest when it has finished one repetition.
pub const PORT_DONE: u16 = 0x81;
/// Unbacked guest-physical (and virtual) address the MMIO guests store to.
pub const MMIO_ADDR: u64 = 0xd000_0000;

const GUEST_MEM: usize = 4 << 20;

/// What a guest does once per iteration of its counted loop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoopBody {
    /// Nothing: the bare `dec ecx; jnz` loop.
    Empty,
    /// `out PORT_OP, al`
    PortOut,
    /// `mov [MMIO_ADDR], eax`
    MmioStore,
}

/// Guest program: `start: mov ecx, [PARAM]; (mov ebx, MMIO); L: body; dec ecx; jnz L;
/// out PORT_DONE, al; jmp start`. The iteration count is read from [`MiniVm::PARAM_ADDR`] at
/// every repetition, so one VM serves any number of runs without resetting registers.
pub fn counted_loop(body: LoopBody) -> CodeBuf {
    let mut c = CodeBuf::new();
    let start = c.here();
    c.mov_ecx_from_abs(MiniVm::PARAM_ADDR as u32);
    if body == LoopBody::MmioStore {
        c.mov_ebx_imm(MMIO_ADDR as u32);
    }
    let top = c.here();
    match body {
        LoopBody::Empty => {}
        LoopBody::PortOut => {
            c.out_al(PORT_OP as u8);
        }
        LoopBody::MmioStore => {
            c.store_eax_at_rbx();
        }
    }
    c.dec_ecx().jnz(top).out_al(PORT_DONE as u8).jmp(start);
    c
}

/// A [`MiniVm`] running [`counted_loop`]: each [`LoopVm::run`] is one repetition, ended by the
/// guest's `out PORT_DONE`. With [`LoopBody::PortOut`] this is the benchmarks' "floor": every
/// exit is only a re-entry.
pub struct LoopVm {
    vm: MiniVm,
}

impl LoopVm {
    pub fn new(kvm: &Arc<Kvm>, mode: CpuMode, body: LoopBody) -> Result<Self, ProbeError> {
        let mut vm = MiniVm::new(kvm, GUEST_MEM, mode)?;
        vm.load_code(MiniVm::CODE_ADDR, counted_loop(body).bytes())?;
        Ok(Self { vm })
    }

    pub fn vm(&self) -> &MiniVm {
        &self.vm
    }

    pub fn vm_mut(&mut self) -> &mut MiniVm {
        &mut self.vm
    }

    /// Runs one repetition of `iters` iterations; returns host time and userspace exits.
    pub fn run(&mut self, iters: u32) -> Result<(Duration, u64), ProbeError> {
        let iters = iters.max(1);
        self.vm.write_u32(MiniVm::PARAM_ADDR, iters)?;
        let max_exits = u64::from(iters) * 2 + 1000;
        let out = self.vm.run(max_exits, |exit| match exit {
            Exit::IoOut(PORT_DONE, _) => Ok(Flow::Stop),
            Exit::IoOut(PORT_OP, _) => Ok(Flow::Continue),
            Exit::MmioWrite(MMIO_ADDR, _) => Ok(Flow::Continue),
            other => Err(ProbeError::unexpected_exit("counted loop", &other)),
        })?;
        Ok((out.elapsed, out.exits))
    }
}

/// Cost of one exit-causing operation, in microseconds: median over `reps` runs of `ops`
/// operations of (host time / ops), after one warm-up run. Also returns the userspace exits of
/// the last run.
pub fn exit_cost_us(lvm: &mut LoopVm, ops: u32, reps: usize) -> Result<(f64, u64), ProbeError> {
    lvm.run(ops.min(50))?; // warm-up: shadow page tables, first-touch faults
    let mut samples = Vec::with_capacity(reps);
    let mut exits = 0;
    for _ in 0..reps {
        let (t, e) = lvm.run(ops)?;
        exits = e;
        samples.push(t.as_secs_f64() * 1e6 / f64::from(ops));
    }
    Ok((lucid_stats::median(&mut samples).unwrap_or(f64::NAN), exits))
}

/// A [`LoopVm`] whose `PORT_OP` writes and `MMIO_ADDR` stores are absorbed by ioeventfds.
pub fn ioeventfd_vm(kvm: &Arc<Kvm>, body: LoopBody) -> Result<(LoopVm, EventFd), ProbeError> {
    let lvm = LoopVm::new(kvm, CpuMode::User, body)?;
    let efd = EventFd::new(libc::EFD_NONBLOCK).map_err(ProbeError::EventFd)?;
    let addr = match body {
        LoopBody::MmioStore => IoAddr::Mmio(MMIO_ADDR),
        _ => IoAddr::Pio(PORT_OP),
    };
    lvm.vm().vm().register_ioeventfd(&efd, addr)?;
    Ok((lvm, efd))
}

/// Nanoseconds per iteration of the bare `dec ecx; jnz` loop in `mode`: the count is calibrated
/// so one run takes about `target`, then the median of `reps` runs is taken. Returns
/// (ns per iteration, iterations per run).
pub fn loop_ns_per_iter(
    kvm: &Arc<Kvm>,
    mode: CpuMode,
    target: Duration,
    reps: usize,
) -> Result<(f64, u32), ProbeError> {
    const MAX_ITERS: u64 = 0xc000_0000;
    let mut lvm = LoopVm::new(kvm, mode, LoopBody::Empty)?;
    let calib_floor = target / 10;
    let mut iters: u64 = 1000;
    let mut took = lvm.run(iters as u32)?.0;
    while took < calib_floor && iters < MAX_ITERS {
        let ratio = calib_floor.as_secs_f64() / took.as_secs_f64().max(1e-9);
        let factor = ratio.clamp(2.0, 100.0);
        iters = ((iters as f64 * factor) as u64).min(MAX_ITERS);
        took = lvm.run(iters as u32)?.0;
    }
    let per_iter = took.as_secs_f64() / iters as f64;
    let final_iters = (target.as_secs_f64() / per_iter).clamp(1000.0, MAX_ITERS as f64) as u32;
    let mut samples = Vec::with_capacity(reps);
    for _ in 0..reps {
        let (t, _) = lvm.run(final_iters)?;
        samples.push(t.as_secs_f64() * 1e9 / f64::from(final_iters));
    }
    Ok((
        lucid_stats::median(&mut samples).unwrap_or(f64::NAN),
        final_iters,
    ))
}

/// The host's own CPUID leaf 1 (as seen by this process).
pub fn host_leaf1() -> CpuidLeaf {
    let r = std::arch::x86_64::__cpuid_count(1, 0);
    CpuidLeaf {
        eax: r.eax,
        ebx: r.ebx,
        ecx: r.ecx,
        edx: r.edx,
    }
}

/// Leaf-1 ECX features the CPUID check clears: CX16 (13), XSAVE (26), AVX (28). OSXSAVE (27)
/// is also cleared but not compared, because KVM derives it from the guest's CR4.
pub const CLEARED_ECX: u32 = (1 << 13) | (1 << 26) | (1 << 28);
const CLEARED_ECX_ALL: u32 = CLEARED_ECX | (1 << 27);

/// Sets a leaf 1 that differs from the host's (features cleared, APIC ID changed) with
/// `KVM_SET_CPUID2`, runs `cpuid` in `mode`, and returns (what was set, what the guest saw).
pub fn cpuid_seen(kvm: &Arc<Kvm>, mode: CpuMode) -> Result<(CpuidLeaf, CpuidLeaf), ProbeError> {
    let host = host_leaf1();
    let apic_id: u32 = if host.ebx >> 24 == 0x5a { 0xa5 } else { 0x5a };
    let mut cpuid = lucid_hv::supported_cpuid(kvm)?;
    let mut set = None;
    for e in cpuid.as_mut_slice() {
        if e.function == 1 && e.index == 0 {
            e.ecx &= !CLEARED_ECX_ALL;
            e.ebx = (e.ebx & 0x00ff_ffff) | (apic_id << 24);
            set = Some(CpuidLeaf {
                eax: e.eax,
                ebx: e.ebx,
                ecx: e.ecx,
                edx: e.edx,
            });
        }
    }
    let set = set.ok_or(ProbeError::NoCpuidLeaf1)?;
    let mut vm = MiniVm::with_cpuid(kvm, GUEST_MEM, mode, &cpuid)?;
    let mut c = CodeBuf::new();
    c.mov_eax_imm(1)
        .xor_ecx_ecx()
        .cpuid()
        .out_al(PORT_DONE as u8);
    let end = c.here();
    c.jmp(end);
    vm.load_code(MiniVm::CODE_ADDR, c.bytes())?;
    vm.run(100, |exit| match exit {
        Exit::IoOut(PORT_DONE, _) => Ok(Flow::Stop),
        other => Err(ProbeError::unexpected_exit("cpuid check", &other)),
    })?;
    let r = vm.regs()?;
    let seen = CpuidLeaf {
        eax: r.rax as u32,
        ebx: r.rbx as u32,
        ecx: r.rcx as u32,
        edx: r.rdx as u32,
    };
    Ok((set, seen))
}

/// Whether the guest saw the leaf the VMM set (so CPUID is intercepted) rather than the host's:
/// the APIC ID in EBX[31:24] must be the one set, and the cleared features must read as clear.
pub fn cpuid_result(mode: CpuMode, set: CpuidLeaf, seen: CpuidLeaf) -> CpuidSeen {
    let apic_matches = seen.ebx >> 24 == set.ebx >> 24;
    let features_match = seen.ecx & CLEARED_ECX == set.ecx & CLEARED_ECX;
    CpuidSeen {
        mode,
        set,
        seen,
        apic_id_matches: apic_matches,
        features_match,
        intercepted: apic_matches && features_match,
    }
}
