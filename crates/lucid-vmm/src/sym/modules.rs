//! Symbiotic modules: Lucid injects a relocatable module into a running guest through the
//! SymSpy mailbox; the guest's loader links it against its exports and runs its init (issue 9
//! step 5). LEAD: stand-in; the modules lane replaces this file.

use super::Symbiotic;

/// How to load a module.
#[derive(Clone, Debug, Default)]
pub struct ModuleOptions {
    /// Place the module's code in a read-only memory slot the guest cannot write.
    pub read_only: bool,
    /// How long to wait for the guest's loader.
    pub timeout: Option<std::time::Duration>,
}

/// A loaded module.
#[derive(Clone, Debug, serde::Serialize)]
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

#[derive(Debug, thiserror::Error)]
pub enum ModuleError {
    #[error("module loading is not available in this build")]
    Unavailable,
    #[error("{0}")]
    Refused(String),
}

impl Symbiotic {
    /// Loads module `bytes` (an ELF64 relocatable object) into the guest.
    pub fn load_module(
        &self,
        bytes: &[u8],
        opts: &ModuleOptions,
    ) -> Result<ModuleInfo, ModuleError> {
        let _ = (bytes, opts);
        Err(ModuleError::Unavailable)
    }

    /// Runs module `id`'s exit function and frees it in the guest.
    pub fn unload_module(&self, id: u32) -> Result<(), ModuleError> {
        let _ = id;
        Err(ModuleError::Unavailable)
    }

    /// The modules loaded now.
    pub fn modules(&self) -> Vec<ModuleInfo> {
        Vec::new()
    }
}
