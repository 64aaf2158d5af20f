//! SymCall: Lucid runs a function in the guest on a chosen vCPU and gets its result (issue 9
//! step 3). LEAD: stand-in; the call lane replaces this file.

use super::Symbiotic;

/// What a completed SymCall returned.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
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
    #[error("vCPU {0} is already running a SymCall (they do not nest)")]
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

impl Symbiotic {
    /// Runs call `nr` with `args` (rdi, rsi, rdx, r10, r8) in the guest on `vcpu`, from any
    /// thread except that vCPU's own exit handlers (a back-end thread, the control API).
    pub fn call(&self, vcpu: u32, nr: u64, args: [u64; 5]) -> Result<SymReturn, SymCallError> {
        let _ = (vcpu, nr, args);
        Err(SymCallError::Unavailable)
    }
}
