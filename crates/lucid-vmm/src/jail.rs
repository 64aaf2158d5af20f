//! `--jail` on a built VM (docs/jail.md): the paths Landlock still allows it, and the drop.

use lucid_jail::{Access, Allow, JailConfig};

use crate::config::{PciDeviceKind, VmConfig};
use crate::VmmError;

/// Drops the process into jail `j`. Called once everything the VM opens at build time is open
/// (the pools' cgroup files included) and the memory limit's pager and OOM guard run, before
/// any vCPU thread starts: the vCPU threads, the device back-ends they start and the techniques
/// that start after them inherit the whole jail.
pub(crate) fn enter(j: &JailConfig, config: &VmConfig) -> Result<(), VmmError> {
    let allow = allowed_paths(config);
    let entered = lucid_jail::enter(j, &allow)?;
    let landlock = match entered.landlock_abi {
        Some(v) => format!("Landlock ABI {v}, {} paths allowed", allow.len()),
        None => "no Landlock in this kernel".into(),
    };
    log::info!(
        "jail: running as uid {} gid {}{}, no capabilities ({landlock})",
        j.uid,
        j.gid,
        j.chroot
            .as_ref()
            .map(|d| format!(" in chroot {}", d.display()))
            .unwrap_or_default(),
    );
    Ok(())
}

/// What the VM may still open once jailed: its disk images (already open; listed so that a
/// reopen of its own image is not refused), this process's own `/proc` directory (threads read
/// their `/proc/thread-self` files as they start, the pools' monitor each thread's), the host's
/// `/proc/meminfo`, and the API socket's directory, where the socket file is removed at exit.
fn allowed_paths(config: &VmConfig) -> Vec<Allow> {
    let mut allow: Vec<Allow> = config
        .devices
        .pci
        .iter()
        .filter_map(|d| match &d.kind {
            PciDeviceKind::Block(b) => Some(Allow {
                path: b.path.clone(),
                access: match b.read_only {
                    true => Access::ReadFile,
                    false => Access::ReadWriteFile,
                },
            }),
            PciDeviceKind::Net(_) | PciDeviceKind::VhostUser(_) => None,
            // Its socket is bound before the jail is entered; `<socket>_P` must be reachable
            // from inside it for guest connections to the host.
            PciDeviceKind::Vsock(_) => None,
        })
        .collect();
    allow.push(Allow {
        path: "/proc/self".into(),
        access: Access::ReadTree,
    });
    // The balloon manager, which starts after the vCPUs, weighs the host's available memory.
    allow.push(Allow {
        path: "/proc/meminfo".into(),
        access: Access::ReadFile,
    });
    if let Some(dir) = config.api.socket.as_deref().and_then(|s| s.parent()) {
        let dir = match dir.as_os_str().is_empty() {
            true => std::path::Path::new("."),
            false => dir,
        };
        allow.push(Allow {
            path: dir.into(),
            access: Access::RemoveIn,
        });
    }
    allow
}
