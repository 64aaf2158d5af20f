//! The VMM's signals: the vCPU kick (a do-nothing handler that only interrupts KVM_RUN) and
//! SIGINT/SIGTERM, which stop the VM cleanly.

use std::sync::Arc;

use lucid_devices::{Lifecycle, StopReason};
use lucid_seccomp::Role;
use lucid_stats::ThreadRole;
use lucid_thread::{Spawner, ThreadSpec};

extern "C" fn kick_handler(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {}

/// The vCPU kick signal only needs to interrupt KVM_RUN; its handler does nothing.
pub(crate) fn install_kick_handler() {
    if let Err(e) = vmm_sys_util::signal::register_signal_handler(
        vmm_sys_util::signal::SIGRTMIN(),
        kick_handler,
    ) {
        log::warn!("cannot install the vCPU kick signal handler ({e}): pausing a vCPU may hang");
    }
}

/// SIGINT and SIGTERM stop the VM cleanly: they are blocked in every thread and taken by one
/// thread with sigwait. Called before any of the VM's threads start (console writer, input,
/// vCPUs, device back-ends), so they all inherit the mask: a thread that did not would take
/// the signal's default action and kill the process.
pub(crate) fn watch_stop_signals(lifecycle: Arc<Lifecycle>, spawner: &Spawner) {
    // SAFETY: sigset manipulation on a local set, and pthread_sigmask on the calling thread.
    let set = unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        set
    };
    let spec = ThreadSpec::new("lucid-signals", ThreadRole::Other, Role::Main);
    let spawned = spawner.spawn(spec, move |confined| {
        if let Err(e) = confined {
            return lifecycle.stop(StopReason::error(e));
        }
        let mut sig: libc::c_int = 0;
        // SAFETY: sigwait on a valid set with a valid out pointer.
        if unsafe { libc::sigwait(&set, &mut sig) } == 0 {
            log::info!("signal {sig}: stopping the VM");
            lifecycle.stop(StopReason::Signal(sig));
        }
    });
    if let Err(e) = spawned {
        log::warn!("cannot start the signal thread ({e}): SIGINT/SIGTERM will not stop the VM");
    }
}
