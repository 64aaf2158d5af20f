//! Symbiotic virtualization (the Palacios VMM's, docs/symbiotic.md): a guest and Lucid that know
//! about each other. Optional on both sides: a guest that never asks sees no difference, and
//! Lucid offers it only with `--symbiotic`.
//!
//! - [`abi`]: the numbers and byte layouts shared with the guests (`guests/lib/x86/sym.h`).
//! - [`spy`]: SymSpy pages, read and written without exits, only through atomic accessors.
//! - [`cpuid`]: the hypervisor CPUID leaves for hosts that intercept CPUID.
//! - [`module`]: Lucid's checks of a symbiotic module object before it goes to the guest.
//! - [`swapcache`]: SwapBypass's swap cache (LRU, write-back, liveness), pure logic.

pub mod abi;
pub mod cpuid;
pub mod module;
pub mod spy;
pub mod swapcache;

pub use spy::{Registrations, SpyError, SpyPage};
