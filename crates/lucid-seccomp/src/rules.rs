//! What each thread role may call, as seccompiler rules. The lists come from `strace -f` of the
//! runs the tests make (probe guests, virtio-blk and virtio-net on every rung, a hostile guest
//! that resets its devices, Linux, the console on a file and on a socket), plus harmless
//! read-only calls that a library may start making (time, `fstat`, `getrandom`, sleeping).
//! docs/security.md explains each list; keep the two in step.

use std::collections::BTreeMap;

use kvm_bindings::{
    kvm_clock_data, kvm_cpuid2, kvm_debugregs, kvm_enable_cap, kvm_fpu, kvm_interrupt,
    kvm_ioeventfd, kvm_irq_level, kvm_irq_routing, kvm_irqchip, kvm_irqfd, kvm_lapic_state,
    kvm_mp_state, kvm_msi, kvm_msrs, kvm_pit_state2, kvm_regs, kvm_sregs, kvm_translation,
    kvm_vcpu_events, kvm_xcrs, kvm_xsave, KVMIO,
};
use libc::c_long;
use seccompiler::{
    BackendError, SeccompCmpArgLen as Len, SeccompCmpOp as Op, SeccompCondition, SeccompRule,
};
use vmm_sys_util::{ioctl_io_nr, ioctl_ior_nr, ioctl_iow_nr, ioctl_iowr_nr};

use crate::Role;

// KVM ioctl request numbers (linux/kvm.h), computed from the structures they carry.
ioctl_io_nr!(KVM_CHECK_EXTENSION, KVMIO, 0x03);
ioctl_iow_nr!(KVM_IRQ_LINE, KVMIO, 0x61, kvm_irq_level);
ioctl_iowr_nr!(KVM_GET_IRQCHIP, KVMIO, 0x62, kvm_irqchip);
ioctl_ior_nr!(KVM_SET_IRQCHIP, KVMIO, 0x63, kvm_irqchip);
ioctl_iowr_nr!(KVM_IRQ_LINE_STATUS, KVMIO, 0x67, kvm_irq_level);
ioctl_iow_nr!(KVM_SET_GSI_ROUTING, KVMIO, 0x6a, kvm_irq_routing);
ioctl_iow_nr!(KVM_IRQFD, KVMIO, 0x76, kvm_irqfd);
ioctl_iow_nr!(KVM_IOEVENTFD, KVMIO, 0x79, kvm_ioeventfd);
ioctl_iow_nr!(KVM_SET_CLOCK, KVMIO, 0x7b, kvm_clock_data);
ioctl_ior_nr!(KVM_GET_CLOCK, KVMIO, 0x7c, kvm_clock_data);
ioctl_ior_nr!(KVM_GET_PIT2, KVMIO, 0x9f, kvm_pit_state2);
ioctl_iow_nr!(KVM_SET_PIT2, KVMIO, 0xa0, kvm_pit_state2);
ioctl_iow_nr!(KVM_SIGNAL_MSI, KVMIO, 0xa5, kvm_msi);
ioctl_io_nr!(KVM_RUN, KVMIO, 0x80);
ioctl_ior_nr!(KVM_GET_REGS, KVMIO, 0x81, kvm_regs);
ioctl_iow_nr!(KVM_SET_REGS, KVMIO, 0x82, kvm_regs);
ioctl_ior_nr!(KVM_GET_SREGS, KVMIO, 0x83, kvm_sregs);
ioctl_iow_nr!(KVM_SET_SREGS, KVMIO, 0x84, kvm_sregs);
ioctl_iowr_nr!(KVM_TRANSLATE, KVMIO, 0x85, kvm_translation);
ioctl_iow_nr!(KVM_INTERRUPT, KVMIO, 0x86, kvm_interrupt);
ioctl_iowr_nr!(KVM_GET_MSRS, KVMIO, 0x88, kvm_msrs);
ioctl_iow_nr!(KVM_SET_MSRS, KVMIO, 0x89, kvm_msrs);
ioctl_ior_nr!(KVM_GET_FPU, KVMIO, 0x8c, kvm_fpu);
ioctl_iow_nr!(KVM_SET_FPU, KVMIO, 0x8d, kvm_fpu);
ioctl_ior_nr!(KVM_GET_LAPIC, KVMIO, 0x8e, kvm_lapic_state);
ioctl_iow_nr!(KVM_SET_LAPIC, KVMIO, 0x8f, kvm_lapic_state);
ioctl_iowr_nr!(KVM_GET_CPUID2, KVMIO, 0x91, kvm_cpuid2);
ioctl_ior_nr!(KVM_GET_MP_STATE, KVMIO, 0x98, kvm_mp_state);
ioctl_iow_nr!(KVM_SET_MP_STATE, KVMIO, 0x99, kvm_mp_state);
ioctl_io_nr!(KVM_NMI, KVMIO, 0x9a);
ioctl_ior_nr!(KVM_GET_VCPU_EVENTS, KVMIO, 0x9f, kvm_vcpu_events);
ioctl_iow_nr!(KVM_SET_VCPU_EVENTS, KVMIO, 0xa0, kvm_vcpu_events);
ioctl_ior_nr!(KVM_GET_DEBUGREGS, KVMIO, 0xa1, kvm_debugregs);
ioctl_iow_nr!(KVM_SET_DEBUGREGS, KVMIO, 0xa2, kvm_debugregs);
ioctl_io_nr!(KVM_GET_TSC_KHZ, KVMIO, 0xa3);
ioctl_iow_nr!(KVM_ENABLE_CAP, KVMIO, 0xa3, kvm_enable_cap);
ioctl_ior_nr!(KVM_GET_XSAVE, KVMIO, 0xa4, kvm_xsave);
ioctl_iow_nr!(KVM_SET_XSAVE, KVMIO, 0xa5, kvm_xsave);
ioctl_ior_nr!(KVM_GET_XCRS, KVMIO, 0xa6, kvm_xcrs);
ioctl_iow_nr!(KVM_SET_XCRS, KVMIO, 0xa7, kvm_xcrs);
ioctl_io_nr!(KVM_KVMCLOCK_CTRL, KVMIO, 0xad);
ioctl_ior_nr!(KVM_GET_XSAVE2, KVMIO, 0xcf, kvm_xsave);

// Tap (linux/if_tun.h): what a net back-end may set on its own tap once the driver negotiated
// offloads. Opening and creating the tap (TUNSETIFF) happens before any filter.
const TUNSETOFFLOAD: u64 = 0x4004_54d0;
const TUNSETVNETHDRSZ: u64 = 0x4004_54d8;

/// `PAGEMAP_SCAN` (linux/fs.h: `_IOWR('f', 16, struct pm_scan_arg)`, 96 bytes): the Swap Mapper
/// finds the guest pages the guest has copied-on-write, on the `/proc/self/pagemap` descriptor
/// it opened before confinement.
const PAGEMAP_SCAN: u64 = 0xc060_6610;

/// `PROCMAP_QUERY` (linux/fs.h: `_IOWR('f', 17, struct procmap_query)`, 104 bytes): the Swap
/// Mapper counts guest RAM's VMAs on the `/proc/self/maps` descriptor it opened before
/// confinement.
const PROCMAP_QUERY: u64 = 0xc068_6611;

/// The vCPU's own ioctls, KVM_RUN first (conditions are tried in order). What the exit loop,
/// the instruction completer and the hypercalls do to the vCPU, plus what a device's
/// transport does to the VM when the guest programs it (irqfd, ioeventfd, MSI routes, INTx).
fn vcpu_ioctls() -> Vec<u64> {
    vec![
        KVM_RUN(),
        KVM_GET_REGS(),
        KVM_SET_REGS(),
        KVM_GET_SREGS(),
        KVM_SET_SREGS(),
        KVM_TRANSLATE(),
        KVM_GET_FPU(),
        KVM_SET_FPU(),
        KVM_GET_XSAVE(),
        KVM_GET_XSAVE2(),
        KVM_SET_XSAVE(),
        KVM_GET_XCRS(),
        KVM_SET_XCRS(),
        KVM_GET_MSRS(),
        KVM_SET_MSRS(),
        KVM_GET_LAPIC(),
        KVM_SET_LAPIC(),
        KVM_GET_MP_STATE(),
        KVM_SET_MP_STATE(),
        KVM_GET_VCPU_EVENTS(),
        KVM_SET_VCPU_EVENTS(),
        KVM_GET_DEBUGREGS(),
        KVM_SET_DEBUGREGS(),
        KVM_GET_CPUID2(),
        KVM_GET_TSC_KHZ(),
        KVM_KVMCLOCK_CTRL(),
        KVM_INTERRUPT(),
        KVM_NMI(),
        KVM_CHECK_EXTENSION(),
        KVM_IRQFD(),
        KVM_IOEVENTFD(),
        KVM_SET_GSI_ROUTING(),
        KVM_SIGNAL_MSI(),
        KVM_IRQ_LINE(),
        KVM_IRQ_LINE_STATUS(),
        KVM_GET_IRQCHIP(),
        KVM_SET_IRQCHIP(),
        KVM_GET_PIT2(),
        KVM_SET_PIT2(),
        KVM_GET_CLOCK(),
        KVM_SET_CLOCK(),
    ]
}

/// A back-end's ioctls: interrupts it raises itself (L0 sends MSIs, INTx lines) and its tap.
fn backend_ioctls() -> Vec<u64> {
    vec![
        KVM_SIGNAL_MSI(),
        KVM_IRQ_LINE(),
        KVM_IRQ_LINE_STATUS(),
        TUNSETOFFLOAD,
        TUNSETVNETHDRSZ,
        libc::FIONBIO,
        PAGEMAP_SCAN,
        PROCMAP_QUERY,
    ]
}

/// The main thread's ioctls: tearing the VM down deassigns irqfds and ioeventfds and releases
/// MSI routes.
fn main_ioctls() -> Vec<u64> {
    vec![
        KVM_IRQFD(),
        KVM_IOEVENTFD(),
        KVM_SET_GSI_ROUTING(),
        KVM_CHECK_EXTENSION(),
    ]
}

/// Syscalls a role may make: always, or only when the arguments match one of the rules; and
/// the `ioctl` requests among them (for the tests).
#[derive(Default)]
pub(crate) struct Allowed(BTreeMap<c_long, Option<Vec<SeccompRule>>>, Vec<u64>);

impl Allowed {
    fn always(&mut self, nrs: &[c_long]) {
        for &nr in nrs {
            self.0.insert(nr, None);
        }
    }

    /// Allows `nr` when one of `rules` matches (added to any rules it already has).
    fn when(&mut self, nr: c_long, rules: Vec<SeccompRule>) {
        // `None`: already allowed whatever the arguments.
        if let Some(existing) = self.0.entry(nr).or_insert_with(|| Some(Vec::new())) {
            existing.extend(rules);
        }
    }

    /// `ioctl` with one of these requests (compared as the kernel does, on 32 bits).
    fn ioctls(&mut self, requests: &[u64]) -> Result<(), BackendError> {
        self.1.extend_from_slice(requests);
        let rules = requests
            .iter()
            .map(|&r| rule(vec![arg(1, Op::Eq, r)?]))
            .collect::<Result<_, _>>()?;
        self.when(libc::SYS_ioctl, rules);
        Ok(())
    }

    pub fn numbers(&self) -> impl Iterator<Item = c_long> + '_ {
        self.0.keys().copied()
    }

    pub fn into_rules(self) -> BTreeMap<i64, Vec<SeccompRule>> {
        self.0
            .into_iter()
            .map(|(nr, rules)| (nr, rules.unwrap_or_default()))
            .collect()
    }
}

fn arg(index: u8, op: Op, value: u64) -> Result<SeccompCondition, BackendError> {
    SeccompCondition::new(index, Len::Dword, op, value)
}

fn rule(conditions: Vec<SeccompCondition>) -> Result<SeccompRule, BackendError> {
    SeccompRule::new(conditions)
}

/// Every role: memory, locks, time, sleeping or waiting on its fds, signals' return, thread
/// exit, writing logs to stderr (and to whatever fd it already holds), closing fds, and what the
/// violation report needs (`write`, `exit_group`). No new executable memory.
fn base(a: &mut Allowed, pid: u32, kick_signal: i32) -> Result<(), BackendError> {
    use libc::*;
    a.always(&[
        SYS_read,
        SYS_write,
        SYS_writev,
        SYS_close,
        SYS_lseek,
        SYS_fstat,
        SYS_newfstatat,
        SYS_statx,
        SYS_futex,
        SYS_munmap,
        SYS_madvise,
        SYS_mlock,
        SYS_munlock,
        SYS_mremap,
        SYS_brk,
        SYS_sigaltstack,
        SYS_rt_sigreturn,
        SYS_rt_sigprocmask,
        SYS_rt_sigaction,
        SYS_restart_syscall,
        SYS_exit,
        SYS_exit_group,
        SYS_clock_gettime,
        SYS_clock_getres,
        SYS_gettimeofday,
        SYS_time,
        SYS_clock_nanosleep,
        SYS_nanosleep,
        SYS_sched_yield,
        SYS_poll,
        SYS_ppoll,
        SYS_sched_getaffinity,
        SYS_getrandom,
        SYS_getpid,
        SYS_gettid,
        // Which pages of a mapping are resident: the swap counters sample Lucid's own text
        // (on the main thread for the report, on a vCPU for a guest phase), the mapper guest RAM.
        SYS_mincore,
    ]);
    let no_exec = || -> Result<_, BackendError> {
        Ok(vec![rule(vec![arg(
            2,
            Op::MaskedEq(PROT_EXEC as u64),
            0,
        )?])?])
    };
    a.when(SYS_mmap, no_exec()?);
    a.when(SYS_mprotect, no_exec()?);
    // Signals only to this process: the vCPU kick, and SIGABRT for `abort()`.
    let to_self = |sig: i32| -> Result<_, BackendError> {
        rule(vec![
            arg(0, Op::Eq, u64::from(pid))?,
            arg(2, Op::Eq, sig as u64)?,
        ])
    };
    a.when(SYS_tgkill, vec![to_self(kick_signal)?, to_self(SIGABRT)?]);
    a.when(
        SYS_fcntl,
        [F_GETFD, F_SETFD, F_GETFL, F_SETFL, F_DUPFD_CLOEXEC]
            .iter()
            .map(|&cmd| rule(vec![arg(1, Op::Eq, cmd as u64)?]))
            .collect::<Result<_, _>>()?,
    );
    a.ioctls(&[libc::TCGETS])
}

/// A device back-end: its loop (epoll, timerfd, eventfds), disk images (positioned reads and
/// writes, flush, discard), taps, and the console's socket (accepting the one client, reading
/// and writing the connected stream).
fn backend(a: &mut Allowed) -> Result<(), BackendError> {
    use libc::*;
    a.always(&[
        SYS_epoll_create1,
        SYS_epoll_ctl,
        SYS_epoll_wait,
        SYS_epoll_pwait,
        SYS_epoll_pwait2,
        SYS_eventfd2,
        SYS_timerfd_create,
        SYS_timerfd_settime,
        SYS_timerfd_gettime,
        SYS_readv,
        SYS_pread64,
        SYS_pwrite64,
        SYS_preadv,
        SYS_pwritev,
        SYS_preadv2,
        SYS_pwritev2,
        SYS_fsync,
        SYS_fdatasync,
        SYS_fallocate,
        SYS_accept4,
        SYS_recvfrom,
        // A vsock stream's write side, once the guest shut its sending side.
        SYS_shutdown,
        // The Swap Mapper on a disk's worker: read-ahead of the blocks it maps.
        SYS_fadvise64,
        // A vhost-user device's watcher ends a connection whose back-end stopped answering.
        SYS_shutdown,
    ]);
    connected_send(a)?;
    // Its own affinity only (pid 0): a thread that starts in a VM with pools or `--low-noise`
    // moves itself to its CPUs as it starts (threads started by a vCPU inherit this list).
    a.when(SYS_sched_setaffinity, vec![rule(vec![arg(0, Op::Eq, 0)?])?]);
    a.ioctls(&backend_ioctls())
}

/// `sendto` on a connected socket only (no destination address): how std writes to a stream.
fn connected_send(a: &mut Allowed) -> Result<(), BackendError> {
    a.when(
        libc::SYS_sendto,
        vec![rule(vec![SeccompCondition::new(
            4,
            Len::Qword,
            Op::Eq,
            0,
        )?])?],
    );
    Ok(())
}

/// A vCPU: the exit loop's ioctls, the console's output, eventfds a transport creates when the
/// guest activates a device, and starting that device's back-end thread, which inherits this
/// filter before it adds its own: so the vCPU's list includes the back-end's, and what a new
/// thread does before its first line of Rust (rseq, robust futexes, its name, its filter).
fn vcpu(a: &mut Allowed) -> Result<(), BackendError> {
    use libc::*;
    backend(a)?;
    // clone3 is listed so that the filter stacked before this one decides it: ENOSYS (which
    // beats allow, while trap would beat ENOSYS), and glibc falls back to clone.
    a.always(&[SYS_eventfd2, SYS_rseq, SYS_set_robust_list, SYS_clone3]);
    // A vhost-user device's messages (DRIVER_OK, reset) carry descriptors.
    a.always(&[SYS_sendmsg, SYS_recvmsg]);
    a.when(
        SYS_clone,
        vec![rule(vec![arg(
            0,
            Op::MaskedEq(CLONE_THREAD as u64),
            CLONE_THREAD as u64,
        )?])?],
    );
    a.when(
        SYS_prctl,
        [PR_SET_NAME, PR_SET_NO_NEW_PRIVS, PR_GET_SECCOMP]
            .iter()
            .map(|&op| rule(vec![arg(0, Op::Eq, op as u64)?]))
            .collect::<Result<_, _>>()?,
    );
    a.when(
        SYS_seccomp,
        vec![rule(vec![arg(
            0,
            Op::Eq,
            u64::from(SECCOMP_SET_MODE_FILTER),
        )?])?],
    );
    pool_placement(a)?;
    a.ioctls(&vcpu_ioctls())
}

/// `fcntl`'s open-file-description locks (the no-op pools' waiting list).
fn ofd_locks(a: &mut Allowed) -> Result<(), BackendError> {
    a.when(
        libc::SYS_fcntl,
        [libc::F_OFD_GETLK, libc::F_OFD_SETLK, libc::F_OFD_SETLKW]
            .iter()
            .map(|&cmd| rule(vec![arg(1, Op::Eq, cmd as u64)?]))
            .collect::<Result<_, _>>()?,
    );
    Ok(())
}

/// The pools' placer on a back-end thread a vCPU started, which runs under the vCPU's
/// filter before the thread confines itself: its own policy (`sched_setattr`/`sched_getattr`
/// on pid 0 only; `sched_setaffinity` on itself is the back-end's) and, for a no-op pool, its
/// admission on files opened before confinement (`flock` on a slot, OFD locks on the waiting
/// list, `ftruncate`; `pread64`/`pwrite64` are the back-end's).
fn pool_placement(a: &mut Allowed) -> Result<(), BackendError> {
    use libc::*;
    a.always(&[SYS_flock, SYS_ftruncate]);
    for nr in [SYS_sched_setattr, SYS_sched_getattr] {
        a.when(nr, vec![rule(vec![arg(0, Op::Eq, 0)?])?]);
    }
    ofd_locks(a)
}

/// The main thread once the VM runs, and the signal thread: waiting, taking SIGINT/SIGTERM,
/// reading KVM's binary statistics, writing the report, tearing the VM down.
fn main_thread(a: &mut Allowed) -> Result<(), BackendError> {
    use libc::*;
    a.always(&[SYS_pread64, SYS_rt_sigtimedwait, SYS_fsync, SYS_fdatasync]);
    // Tearing a live vhost-user device down stops its back-end's rings.
    a.always(&[SYS_sendmsg, SYS_recvmsg]);
    a.ioctls(&main_ioctls())
}

/// The vIOMMU's sidecore thread: it polls shared memory and sleeps (the base list), sends the
/// unit's own MSIs and, after an interrupt-entry-cache invalidation it processed, re-installs the
/// remapped GSI routes; an assigned device's map listener sends its server `DMA_MAP`/`DMA_UNMAP`
/// (with a descriptor) and reads the reply.
fn iommu(a: &mut Allowed) -> Result<(), BackendError> {
    a.always(&[libc::SYS_sendmsg, libc::SYS_recvmsg, libc::SYS_recvfrom]);
    connected_send(a)?;
    a.ioctls(&[KVM_SIGNAL_MSI(), KVM_SET_GSI_ROUTING()])
}

/// The pools' monitor: reading the registry (KVM's statistics files), opening procfs files
/// read-only (each thread's `schedstat` and `status`: the threads come and go, so the files
/// cannot all be opened before confinement; `O_RDONLY` without `O_CREAT`, so it can read but not
/// create or change a file), placing threads of the VM (affinity, `sched_setattr`, the boost's
/// `setpriority`; cgroup `tasks` files are opened before confinement and written), no-op
/// admission on files opened before (`flock`, OFD locks, `pread64`, `pwrite64`, `ftruncate`),
/// its JSON file in the pools' state directory (opened before, rewritten with `pwrite` +
/// `ftruncate`) and halt polling (`KVM_ENABLE_CAP` on the VM fd).
fn monitor(a: &mut Allowed) -> Result<(), BackendError> {
    use libc::*;
    a.always(&[
        SYS_pread64,
        SYS_pwrite64,
        SYS_ftruncate,
        SYS_flock,
        SYS_sched_setaffinity,
        SYS_sched_setattr,
        SYS_sched_getattr,
        SYS_setpriority,
    ]);
    ofd_locks(a)?;
    open_read_only(a)?;
    a.ioctls(&[KVM_ENABLE_CAP(), KVM_CHECK_EXTENSION()])
}

/// The pager: `pread` of the cgroup's usage, `read`/`ppoll` of its threshold eventfd,
/// `madvise(MADV_PAGEOUT)` over guest RAM, `write` of oom_control (the base list has those) and
/// `fadvise64` (dropping the disk images' unmapped page cache).
fn pager(a: &mut Allowed) {
    a.always(&[libc::SYS_pread64, libc::SYS_fadvise64]);
}

/// A vhost-user back-end or vfio-user device process (`lucid device-server`), confined once
/// its socket is bound: accepting the front-end on that socket, its messages and the
/// descriptors they carry (`recvmsg`, `sendmsg`), mapping the memory table or the DMA_MAP
/// ranges (`mmap` without exec and `munmap` from the base list), the vring worker's epoll loop
/// and eventfds, the vfio-user INTx unmask thread's `poll` (base list), starting those threads
/// (as a vCPU starts back-ends), ending a connection (`shutdown`), and the main thread's
/// `sigtimedwait` for SIGTERM.
fn device_server(a: &mut Allowed) -> Result<(), BackendError> {
    use libc::*;
    a.always(&[
        SYS_epoll_create1,
        SYS_epoll_ctl,
        SYS_epoll_wait,
        SYS_epoll_pwait,
        SYS_epoll_pwait2,
        SYS_eventfd2,
        SYS_accept4,
        SYS_recvfrom,
        SYS_recvmsg,
        SYS_sendmsg,
        SYS_shutdown,
        SYS_rt_sigtimedwait,
        SYS_rseq,
        SYS_set_robust_list,
        SYS_clone3,
        // A block device's disk file (opened before confinement).
        SYS_pread64,
        SYS_pwrite64,
        SYS_fdatasync,
    ]);
    connected_send(a)?;
    a.when(
        SYS_clone,
        vec![rule(vec![arg(
            0,
            Op::MaskedEq(CLONE_THREAD as u64),
            CLONE_THREAD as u64,
        )?])?],
    );
    a.when(
        SYS_prctl,
        vec![rule(vec![arg(0, Op::Eq, PR_SET_NAME as u64)?])?],
    );
    Ok(())
}

/// A vsock device's connect thread: a Unix stream socket (no other family or type) and
/// `connect(2)` on it; the base list has the rest (its eventfds, `fcntl` for O_NONBLOCK).
fn vsock(a: &mut Allowed) -> Result<(), BackendError> {
    use libc::*;
    a.when(
        SYS_socket,
        vec![rule(vec![
            arg(0, Op::Eq, AF_UNIX as u64)?,
            arg(1, Op::Eq, (SOCK_STREAM | SOCK_CLOEXEC) as u64)?,
        ])?],
    );
    a.always(&[SYS_connect]);
    Ok(())
}

/// A vhost-user device's reconnect thread: the vsock connect thread's Unix stream socket and
/// `connect(2)`, and the messages of the replayed set-up, which carry descriptors.
fn vhost_user(a: &mut Allowed) -> Result<(), BackendError> {
    vsock(a)?;
    a.always(&[libc::SYS_sendmsg, libc::SYS_recvmsg]);
    Ok(())
}

/// `openat(dirfd, path, flags, mode)` with no access mode but read and no `O_CREAT`/`O_TRUNC`.
fn open_read_only(a: &mut Allowed) -> Result<(), BackendError> {
    use libc::*;
    let read_only = (O_ACCMODE | O_CREAT | O_TRUNC) as u64;
    a.when(
        SYS_openat,
        vec![rule(vec![arg(2, Op::MaskedEq(read_only), 0)?])?],
    );
    Ok(())
}

/// The jail's drop as glibc makes it on every thread (lucid-jail): one supplementary group,
/// then the jail's gid and uid as real, effective and saved ids. Nothing else: these only give
/// privilege up.
pub(crate) fn jail_drop(a: &mut Allowed, uid: u32, gid: u32) -> Result<(), BackendError> {
    let all3 = |id: u32| -> Result<Vec<SeccompRule>, BackendError> {
        Ok(vec![rule(
            (0..3)
                .map(|i| arg(i, Op::Eq, u64::from(id)))
                .collect::<Result<_, _>>()?,
        )?])
    };
    a.when(libc::SYS_setresuid, all3(uid)?);
    a.when(libc::SYS_setresgid, all3(gid)?);
    a.when(libc::SYS_setgroups, vec![rule(vec![arg(0, Op::Eq, 1)?])?]);
    Ok(())
}

/// The syscalls `role` may make in process `pid`, whose vCPUs are kicked with `kick_signal`.
pub(crate) fn allowed(role: Role, pid: u32, kick_signal: i32) -> Result<Allowed, BackendError> {
    let mut a = Allowed::default();
    base(&mut a, pid, kick_signal)?;
    match role {
        Role::Vcpu => vcpu(&mut a)?,
        Role::Backend => backend(&mut a)?,
        Role::Main => main_thread(&mut a)?,
        Role::Iommu => iommu(&mut a)?,
        Role::Monitor => monitor(&mut a)?,
        Role::Pager => pager(&mut a),
        Role::DeviceServer => device_server(&mut a)?,
        Role::Vsock => vsock(&mut a)?,
        Role::VhostUser => vhost_user(&mut a)?,
    }
    Ok(a)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kvm_request_numbers_match_linux_headers() {
        // From linux/kvm.h as the kernel's headers expand them.
        assert_eq!(KVM_RUN(), 0xae80);
        assert_eq!(KVM_GET_REGS(), 0x8090_ae81);
        assert_eq!(KVM_SET_SREGS(), 0x4138_ae84);
        assert_eq!(KVM_IRQFD(), 0x4020_ae76);
        assert_eq!(KVM_IOEVENTFD(), 0x4040_ae79);
        assert_eq!(KVM_SET_GSI_ROUTING(), 0x4008_ae6a);
        assert_eq!(KVM_SIGNAL_MSI(), 0x4020_aea5);
        assert_eq!(KVM_GET_VCPU_EVENTS(), 0x8040_ae9f);
        assert_eq!(KVM_GET_FPU(), 0x81a0_ae8c);
        assert_eq!(KVM_SET_IRQCHIP(), 0x8208_ae63);
    }

    fn has(role: Role, name: &str) -> bool {
        allowed(role, 1, 34)
            .unwrap()
            .numbers()
            .any(|nr| crate::names::name(nr) == Some(name))
    }

    #[test]
    fn roles_get_what_their_paths_need_and_nothing_dangerous() {
        for role in Role::ALL {
            for bad in [
                "execve",
                "execveat",
                "fork",
                "vfork",
                "socket",
                "connect",
                "bind",
                "listen",
                "open",
                "openat2",
                "ptrace",
                "mount",
                "umount2",
                "kill",
                "memfd_create",
                "process_vm_writev",
                "unlink",
                "unlinkat",
                "chmod",
                "setuid",
            ] {
                // The vsock connect thread's one exception (a Unix stream socket, checked below).
                if matches!(role, Role::Vsock | Role::VhostUser)
                    && matches!(bad, "socket" | "connect")
                {
                    continue;
                }
                assert!(!has(role, bad), "{role} may call {bad}");
            }
            // Only the monitor opens files, and only read-only (checked below).
            assert_eq!(has(role, "openat"), role == Role::Monitor, "{role} openat");
            for needed in [
                "write",
                "futex",
                "mmap",
                "exit",
                "exit_group",
                "rt_sigreturn",
            ] {
                assert!(has(role, needed), "{role} may not call {needed}");
            }
        }
        // A vCPU starts back-ends, which inherit its filter.
        let vcpu = allowed(Role::Vcpu, 1, 34).unwrap();
        for nr in allowed(Role::Backend, 1, 34).unwrap().numbers() {
            assert!(
                vcpu.numbers().any(|v| v == nr),
                "{:?}",
                crate::names::name(nr)
            );
        }
        assert!(has(Role::Backend, "pwrite64") && !has(Role::Main, "pwrite64"));
        // The Swap Mapper on a disk's worker: map (no exec), populate, read ahead.
        for needed in [
            "mmap",
            "madvise",
            "fadvise64",
            "mincore",
            "pread64",
            "ioctl",
        ] {
            assert!(has(Role::Backend, needed), "backend may not call {needed}");
        }
        assert_eq!(
            PAGEMAP_SCAN,
            (3 << 30) | (96 << 16) | ((b'f' as u64) << 8) | 16
        );
        assert_eq!(
            PROCMAP_QUERY,
            (3 << 30) | (104 << 16) | ((b'f' as u64) << 8) | 17
        );
        for needed in ["pread64", "madvise", "write", "ppoll", "read", "fadvise64"] {
            assert!(has(Role::Pager, needed), "pager may not call {needed}");
        }
        for bad in ["openat", "clone", "pwrite64", "unlinkat", "rmdir"] {
            assert!(!has(Role::Pager, bad), "pager may call {bad}");
        }
        // The swap counters: pread of files opened before confinement, mincore of the text.
        for role in [Role::Main, Role::Vcpu] {
            assert!(has(role, "pread64") && has(role, "mincore"), "{role}");
        }
        assert!(has(Role::Vcpu, "clone") && !has(Role::Backend, "clone"));
        assert!(!has(Role::Main, "clone3") && !has(Role::Main, "accept4"));
        // The sidecore polls and sleeps: no disk, no sockets, no threads.
        for bad in ["pwrite64", "clone", "accept4", "epoll_wait", "eventfd2"] {
            assert!(!has(Role::Iommu, bad), "iommu may call {bad}");
        }
        assert!(has(Role::Iommu, "mlock") && has(Role::Iommu, "sched_yield"));
        // The monitor places threads but starts none and touches no disk image.
        for bad in ["clone", "accept4", "eventfd2", "epoll_wait"] {
            assert!(!has(Role::Monitor, bad), "monitor may call {bad}");
        }
        assert!(has(Role::Monitor, "sched_setaffinity") && has(Role::Monitor, "ftruncate"));
        // Placing threads and no-op admission: the monitor for any thread of the VM, a vCPU
        // (the hook of a back-end it starts) for itself only; nobody else's.
        for needed in ["flock", "sched_setattr", "sched_getattr", "setpriority"] {
            assert!(has(Role::Monitor, needed), "monitor may not call {needed}");
        }
        for needed in ["flock", "ftruncate", "sched_setattr", "sched_getattr"] {
            assert!(has(Role::Vcpu, needed), "vcpu may not call {needed}");
        }
        for role in [Role::Main, Role::Iommu, Role::Backend] {
            for bad in ["flock", "sched_setattr", "setpriority", "ftruncate"] {
                assert!(!has(role, bad), "{role} may call {bad}");
            }
        }
        assert!(!has(Role::Vcpu, "setpriority"));
        // A device server process: its socket and threads, a disk opened before (blk), no KVM.
        for needed in [
            "accept4",
            "recvmsg",
            "sendmsg",
            "shutdown",
            "clone",
            "epoll_wait",
            "mmap",
            "munmap",
            "poll",
            "pread64",
            "pwrite64",
            "fdatasync",
        ] {
            assert!(
                has(Role::DeviceServer, needed),
                "device-server may not call {needed}"
            );
        }
        for bad in ["openat", "flock", "sched_setaffinity", "seccomp"] {
            assert!(
                !has(Role::DeviceServer, bad),
                "device-server may call {bad}"
            );
        }
    }

    /// A vCPU (and the back-ends it starts) may set only its own policy; the monitor any
    /// thread's. `fcntl` stays limited to listed commands, now with the OFD locks.
    #[test]
    fn own_policy_only_on_vcpus_and_ofd_locks_by_command() {
        let conditional = |role: Role, nr: c_long| {
            let a = allowed(role, 1, 34).unwrap();
            match a.0.get(&nr) {
                Some(Some(rules)) => Some(rules.len()),
                Some(None) => None,
                None => panic!("{role} may not call {nr}"),
            }
        };
        assert_eq!(conditional(Role::Vcpu, libc::SYS_sched_setattr), Some(1));
        assert_eq!(conditional(Role::Vcpu, libc::SYS_sched_getattr), Some(1));
        assert_eq!(
            conditional(Role::Vcpu, libc::SYS_sched_setaffinity),
            Some(1)
        );
        assert_eq!(conditional(Role::Monitor, libc::SYS_sched_setattr), None);
        // base's five commands plus the three OFD lock commands.
        assert_eq!(conditional(Role::Vcpu, libc::SYS_fcntl), Some(8));
        assert_eq!(conditional(Role::Monitor, libc::SYS_fcntl), Some(8));
        assert_eq!(conditional(Role::Backend, libc::SYS_fcntl), Some(5));
    }

    /// With a jail, every role may take the drop to the jail's ids, and only to them.
    #[test]
    fn the_jail_drop_is_allowed_with_its_ids_only() {
        for role in Role::ALL {
            let mut a = allowed(role, 1, 34).unwrap();
            assert!(!a.0.contains_key(&libc::SYS_setresuid), "{role}");
            jail_drop(&mut a, 65534, 65533).unwrap();
            for nr in [
                libc::SYS_setresuid,
                libc::SYS_setresgid,
                libc::SYS_setgroups,
            ] {
                assert!(
                    matches!(a.0.get(&nr), Some(Some(r)) if r.len() == 1),
                    "{role} {nr}"
                );
            }
            assert!(!a.0.contains_key(&libc::SYS_setuid), "{role}");
        }
    }

    /// The monitor's `openat` rule lets read-only opens through and nothing that writes or
    /// creates.
    #[test]
    fn the_vsock_thread_opens_unix_stream_sockets_only() {
        let a = allowed(Role::Vsock, 1, 34).unwrap();
        let socket = a.into_rules().remove(&libc::SYS_socket).unwrap();
        assert_eq!(socket.len(), 1);
        assert!(!has(Role::Vsock, "accept4") && !has(Role::Vsock, "bind"));
        let a = allowed(Role::VhostUser, 1, 34).unwrap();
        assert_eq!(a.into_rules().remove(&libc::SYS_socket).unwrap().len(), 1);
        assert!(!has(Role::VhostUser, "accept4") && !has(Role::VhostUser, "bind"));
        assert!(has(Role::Backend, "shutdown") && !has(Role::Main, "shutdown"));
    }

    #[test]
    fn the_monitor_opens_read_only() {
        let mask = (libc::O_ACCMODE | libc::O_CREAT | libc::O_TRUNC) as u64;
        let ok = |flags: i32| (flags as u64) & mask == 0;
        assert!(ok(libc::O_RDONLY | libc::O_CLOEXEC));
        for bad in [
            libc::O_WRONLY,
            libc::O_RDWR,
            libc::O_RDONLY | libc::O_CREAT,
            libc::O_RDONLY | libc::O_TRUNC,
            libc::O_TMPFILE | libc::O_RDWR,
        ] {
            assert!(!ok(bad), "{bad:#x}");
        }
    }
}
