//! What this host's KVM is: opening `/dev/kvm` with errors a user can act on, which backend
//! serves it (VT-x, AMD-V or PVM) and the APIC virtualization its modules offer. Facts read
//! from the device and sysfs, without running a guest (the host probe, in `lucid-probe`, does
//! that).

use std::ffi::CString;
use std::fmt;
use std::path::Path;

use kvm_ioctls::Kvm;

/// Path of the KVM device.
pub const KVM_PATH: &str = "/dev/kvm";

/// The only KVM API version there has ever been.
pub const KVM_API_VERSION: i32 = 12;

/// Why `/dev/kvm` could not be opened. Each Display is one line saying what to do.
#[derive(Debug, thiserror::Error)]
pub enum KvmOpenError {
    /// The device node is missing.
    #[error("{path} does not exist: this host has no KVM (load kvm_intel/kvm_amd, or enable nested virtualization)")]
    NotFound { path: String },
    /// Not allowed to open it.
    #[error("{path}: permission denied: run as root or add your user to the kvm group")]
    PermissionDenied { path: String },
    /// The node exists but no KVM module backs it.
    #[error("{path} exists but no KVM module is loaded (errno {errno}): load kvm_intel or kvm_amd (modprobe)")]
    NoModule { path: String, errno: i32 },
    /// Opened, but the API version is not 12.
    #[error("{path}: KVM API version {found}, expected 12: this kernel's KVM is not supported")]
    ApiVersion { path: String, found: i32 },
    /// The path cannot be passed to open(2).
    #[error("{path:?}: the path contains a NUL byte")]
    BadPath { path: String },
    /// Any other failure of open(2).
    #[error("{path}: cannot open")]
    Other {
        path: String,
        #[source]
        source: std::io::Error,
    },
}

impl KvmOpenError {
    /// Maps an `open(2)` errno on `path` to the error a user can act on.
    pub fn from_errno(path: &str, errno: i32) -> Self {
        let path = path.to_string();
        match errno {
            libc::ENOENT => Self::NotFound { path },
            libc::EACCES | libc::EPERM => Self::PermissionDenied { path },
            libc::ENXIO | libc::ENODEV => Self::NoModule { path, errno },
            _ => Self::Other {
                path,
                source: std::io::Error::from_raw_os_error(errno),
            },
        }
    }
}

/// Opens the KVM device at `path` and checks the API version, with errors a user can act on.
/// Checks no capability: see [`crate::open_kvm`] for the VMM's.
pub fn open_device(path: &str) -> Result<Kvm, KvmOpenError> {
    let cpath = CString::new(path).map_err(|_| KvmOpenError::BadPath {
        path: path.to_string(),
    })?;
    let kvm = Kvm::new_with_path(&cpath).map_err(|e| KvmOpenError::from_errno(path, e.errno()))?;
    let found = kvm.get_api_version();
    if found != KVM_API_VERSION {
        return Err(KvmOpenError::ApiVersion {
            path: path.to_string(),
            found,
        });
    }
    Ok(kvm)
}

/// Which KVM backend serves `/dev/kvm`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    /// Nothing recognised.
    Unknown,
    /// Intel VT-x (`kvm_intel`).
    Vmx,
    /// AMD-V (`kvm_amd`).
    Svm,
    /// PVM, pagetable-based, no hardware virtualization (`kvm_pvm`).
    Pvm,
}

impl Backend {
    /// "vmx", "svm", "pvm" or "unknown".
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Unknown => "unknown",
            Self::Vmx => "vmx",
            Self::Svm => "svm",
            Self::Pvm => "pvm",
        }
    }

    /// 1 vmx, 2 svm, 3 pvm, 0 unknown (stable: guests and result files carry it).
    pub const fn code(self) -> u32 {
        match self {
            Self::Unknown => 0,
            Self::Vmx => 1,
            Self::Svm => 2,
            Self::Pvm => 3,
        }
    }

    /// True when guest kernel-mode code runs natively (hardware virtualization).
    pub fn is_hardware(self) -> bool {
        matches!(self, Self::Vmx | Self::Svm)
    }
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Detects the backend from the loaded KVM vendor modules in `/sys/module`.
pub fn detect_backend() -> Backend {
    detect_backend_in(Path::new("/sys/module"))
}

/// [`detect_backend`] on another sysfs module directory. A vendor module for hardware
/// virtualization wins over `kvm_pvm` if both are loaded.
pub fn detect_backend_in(sys_module: &Path) -> Backend {
    if sys_module.join("kvm_intel").exists() {
        Backend::Vmx
    } else if sys_module.join("kvm_amd").exists() {
        Backend::Svm
    } else if sys_module.join("kvm_pvm").exists() {
        Backend::Pvm
    } else {
        Backend::Unknown
    }
}

/// A boolean module parameter (`Y`/`1`) from sysfs; false when absent.
pub fn module_param(path: &str) -> bool {
    std::fs::read_to_string(path)
        .map(|s| matches!(s.trim(), "Y" | "y" | "1"))
        .unwrap_or(false)
}

/// kvm_intel's `enable_apicv` (posted interrupts).
pub const APICV_PARAM: &str = "/sys/module/kvm_intel/parameters/enable_apicv";
/// kvm_amd's `avic`.
pub const AVIC_PARAM: &str = "/sys/module/kvm_amd/parameters/avic";

/// Whether the host virtualizes APIC interrupts (VT-x APICv posted interrupts or AMD AVIC), read
/// from the KVM module parameters: what the exit ladder's L3 needs.
pub fn posted_interrupts_available() -> bool {
    module_param(APICV_PARAM) || module_param(AVIC_PARAM)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn open_error_mapping_is_one_actionable_line() {
        let e = open_device("/nonexistent/lucid-test/kvm").unwrap_err();
        assert!(matches!(e, KvmOpenError::NotFound { .. }), "{e:?}");
        let msg = e.to_string();
        assert_eq!(
            msg,
            "/nonexistent/lucid-test/kvm does not exist: this host has no KVM (load kvm_intel/kvm_amd, or enable nested virtualization)"
        );
        assert!(!msg.contains('\n'));

        let e = KvmOpenError::from_errno("/dev/kvm", libc::EACCES);
        assert_eq!(
            e.to_string(),
            "/dev/kvm: permission denied: run as root or add your user to the kvm group"
        );
        let e = KvmOpenError::from_errno("/dev/kvm", libc::ENOENT);
        assert!(e.to_string().starts_with("/dev/kvm does not exist"));
        let e = KvmOpenError::from_errno("/dev/kvm", libc::ENXIO);
        assert!(matches!(e, KvmOpenError::NoModule { .. }));
        let e = KvmOpenError::from_errno("/dev/kvm", libc::EIO);
        assert!(matches!(e, KvmOpenError::Other { .. }));
        assert!(matches!(
            open_device("/dev/k\0vm"),
            Err(KvmOpenError::BadPath { .. })
        ));
    }

    #[test]
    fn open_error_permission_denied_on_real_path() {
        // A file without read/write permission: root bypasses DAC, so only check when not root.
        let dir = std::env::temp_dir().join(format!("lucid-hv-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("kvm");
        std::fs::write(&path, b"").unwrap();
        std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o000))
            .unwrap();
        let result = open_device(path.to_str().unwrap());
        // Effective uid from /proc: root bypasses file permissions.
        let is_root = std::fs::read_to_string("/proc/self/status")
            .unwrap()
            .lines()
            .find(|l| l.starts_with("Uid:"))
            .is_some_and(|l| l.split_whitespace().nth(2) == Some("0"));
        if !is_root {
            assert!(matches!(result, Err(KvmOpenError::PermissionDenied { .. })));
        } else {
            // Opened a regular file: the API version ioctl fails, which must not pass as KVM.
            assert!(result.is_err());
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn backend_codes_and_names() {
        assert_eq!(Backend::Vmx.code(), 1);
        assert_eq!(Backend::Svm.code(), 2);
        assert_eq!(Backend::Pvm.code(), 3);
        assert_eq!(Backend::Unknown.code(), 0);
        assert_eq!(Backend::Pvm.as_str(), "pvm");
        assert_eq!(serde_json::to_string(&Backend::Svm).unwrap(), "\"svm\"");
        assert_eq!(
            detect_backend_in(Path::new("/nonexistent/sys/module")),
            Backend::Unknown
        );
    }

    #[test]
    fn backend_is_pvm_here() {
        // PLATFORM.md: this project's machines are PVM hosts.
        assert_eq!(detect_backend(), Backend::Pvm);
    }
}
