//! Lucid's hypercalls, all in one table: each number Lucid answers, its name in the probe-guest
//! kit and what it does. The kit's `guests/lib/x86/lucid.h` (and `sym.h` for the symbiotic
//! calls, whose numbers live in [`lucid_sym::abi`]) is the C side; a test compares them.
//!
//! A guest calls with `out %eax, %dx`, dx = [`lucid_boot::layout::ports::HYPERCALL`], rax = the
//! number, rdi/rsi/r8 = the arguments; Lucid writes the result into rax (all ones for a number
//! nobody registered, [`crate::hooks::HYPERCALL_UNKNOWN`]).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use lucid_boot::layout::{self, ports};
use lucid_hv::kvm_bindings::kvm_regs;
use lucid_hv::Backend;
use lucid_sym::abi;

use crate::hooks::{ExitHooks, HookError};

/// Returns [`MAGIC`].
pub const DISCOVER: u64 = 0;
/// Returns the TSC frequency in kHz.
pub const TSC_KHZ: u64 = 1;
/// Returns the KVM backend ([`Backend::code`]).
pub const BACKEND: u64 = 2;
/// rdi = one of the `REPORT_*` keys, rsi = its value: the guest's own figures (its vIOMMU
/// mappings), kept as counters `iommu.guest.<key name>`; returns 0.
pub const REPORT: u64 = 3;
/// rdi = phase number (below `swap::MAX_PHASES`): the guest starts phase rdi; the host swap
/// counters' deltas over each phase are kept as `swap.phase.<n>.*`; returns 0 (all ones for
/// a phase number out of range).
pub const PHASE: u64 = 4;
/// rdi = `WORK_ITERATIONS` or `WORK_BYTES`, rsi = amount done since the last call: the
/// guest's progress, added to `guest.work.iterations` / `guest.work.bytes`; returns 0.
pub const WORK: u64 = 5;
pub const WORK_ITERATIONS: u64 = 0;
pub const WORK_BYTES: u64 = 1;
/// What DISCOVER returns: "LUCI".
pub const MAGIC: u64 = 0x4C55_4349;

/// REPORT keys (`LUCID_REPORT_*` in lucid.h).
pub const REPORT_MAPS: u64 = 0;
pub const REPORT_UNMAPS: u64 = 1;
/// rdtsc cycles spent in map, summed.
pub const REPORT_MAP_CYCLES: u64 = 2;
pub const REPORT_UNMAP_CYCLES: u64 = 3;
/// Maps served by an existing mapping.
pub const REPORT_REUSE_HITS: u64 = 4;
/// The most mappings logically unmapped but still reachable.
pub const REPORT_STALE_MAX: u64 = 5;
/// The longest time from a logical unmap to its invalidation's completion.
pub const REPORT_WINDOW_MAX_US: u64 = 6;
/// VT-d fault records the guest read.
pub const REPORT_FAULTS_SEEN: u64 = 7;

/// The counter name (after `iommu.guest.`) of REPORT key `key`.
pub fn report_key(key: u64) -> Option<&'static str> {
    const NAMES: [&str; 8] = [
        "maps",
        "unmaps",
        "map_cycles",
        "unmap_cycles",
        "reuse_hits",
        "stale_max",
        "window_max_us",
        "faults_seen",
    ];
    NAMES.get(usize::try_from(key).ok()?).copied()
}

/// One hypercall Lucid answers.
#[derive(Clone, Copy, Debug)]
pub struct Hypercall {
    pub nr: u64,
    /// Its name in the guest kit (`lucid.h`, or `sym.h` for `SYM_HC_*`).
    pub name: &'static str,
    /// Who registers it.
    pub registered_by: &'static str,
    /// Arguments and result.
    pub meaning: &'static str,
}

/// Every hypercall number, once.
pub const TABLE: &[Hypercall] = &[
    Hypercall {
        nr: DISCOVER,
        name: "LUCID_HC_DISCOVER",
        registered_by: "every VM",
        meaning: "returns LUCID_MAGIC (\"LUCI\")",
    },
    Hypercall {
        nr: TSC_KHZ,
        name: "LUCID_HC_TSC_KHZ",
        registered_by: "every VM",
        meaning: "returns the TSC frequency in kHz",
    },
    Hypercall {
        nr: BACKEND,
        name: "LUCID_HC_BACKEND",
        registered_by: "every VM",
        meaning: "returns the KVM backend, a LUCID_BACKEND_* value",
    },
    Hypercall {
        nr: REPORT,
        name: "LUCID_HC_REPORT",
        registered_by: "every VM (iommu.rs)",
        meaning: "rdi = LUCID_REPORT_* key, rsi = value: counter iommu.guest.<key>; returns 0",
    },
    Hypercall {
        nr: PHASE,
        name: "LUCID_HC_PHASE",
        registered_by: "every VM (swap.rs)",
        meaning: "rdi = phase: the host swap counters per phase, swap.phase.<n>.*; returns 0",
    },
    Hypercall {
        nr: WORK,
        name: "LUCID_HC_WORK",
        registered_by: "every VM (pools.rs)",
        meaning: "rdi = LUCID_WORK_* kind, rsi = amount: counters guest.work.<kind>; returns 0",
    },
    Hypercall {
        nr: abi::HC_DISCOVER,
        name: "SYM_HC_DISCOVER",
        registered_by: "--symbiotic (sym/)",
        meaning: "rdi = SYM_DISCOVER_*: the signature, ABI version or feature bits",
    },
    Hypercall {
        nr: abi::HC_REGISTER,
        name: "SYM_HC_REGISTER",
        registered_by: "--symbiotic (sym/)",
        meaning: "rdi = SYM_REGISTER_*, rsi = SymSpy page address (0: off); returns 0 or -errno",
    },
    Hypercall {
        nr: abi::HC_RETURN,
        name: "SYM_HC_RETURN",
        registered_by: "--symbiotic (sym/)",
        meaning: "ends this vCPU's SymCall: rdi = status, rsi and r8 = its two values",
    },
    Hypercall {
        nr: abi::HC_NOTIFY,
        name: "SYM_HC_NOTIFY",
        registered_by: "--symbiotic (sym/)",
        meaning: "rdi = SYM_NOTIFY_*: something is ready in SymSpy; returns 0",
    },
];

/// The rest of `lucid.h`, by C name: ports, addresses, argument keys and result values.
pub const GUEST_ABI: &[(&str, u64)] = &[
    ("LUCID_HC_PORT", ports::HYPERCALL as u64),
    ("LUCID_IOEVENTFD_PORT", ports::IOEVENTFD_PROBE as u64),
    ("LUCID_NOP_PORT", ports::POST as u64),
    ("LUCID_EXIT_PORT", ports::DEBUG_EXIT as u64),
    ("LUCID_SERIAL_PORT", ports::SERIAL_COM1 as u64),
    ("LUCID_MMIO_PROBE", layout::PROBE_MMIO),
    ("LUCID_LAPIC_BASE", layout::LAPIC_START),
    ("LUCID_IOAPIC_BASE", layout::IOAPIC_START),
    ("LUCID_MMIO_HOLE", layout::MMIO_HOLE_START),
    ("LUCID_WORK_ITERATIONS", WORK_ITERATIONS),
    ("LUCID_WORK_BYTES", WORK_BYTES),
    ("LUCID_REPORT_MAPS", REPORT_MAPS),
    ("LUCID_REPORT_UNMAPS", REPORT_UNMAPS),
    ("LUCID_REPORT_MAP_CYCLES", REPORT_MAP_CYCLES),
    ("LUCID_REPORT_UNMAP_CYCLES", REPORT_UNMAP_CYCLES),
    ("LUCID_REPORT_REUSE_HITS", REPORT_REUSE_HITS),
    ("LUCID_REPORT_STALE_MAX", REPORT_STALE_MAX),
    ("LUCID_REPORT_WINDOW_MAX_US", REPORT_WINDOW_MAX_US),
    ("LUCID_REPORT_FAULTS_SEEN", REPORT_FAULTS_SEEN),
    ("LUCID_MAGIC", MAGIC),
    ("LUCID_BACKEND_UNKNOWN", Backend::Unknown.code() as u64),
    ("LUCID_BACKEND_VMX", Backend::Vmx.code() as u64),
    ("LUCID_BACKEND_SVM", Backend::Svm.code() as u64),
    ("LUCID_BACKEND_PVM", Backend::Pvm.code() as u64),
];

/// The kit's name of hypercall `nr`, or "unknown".
pub fn name(nr: u64) -> &'static str {
    TABLE
        .iter()
        .find(|h| h.nr == nr)
        .map_or("unknown", |h| h.name)
}

/// Lucid's own hypercalls: discovery, the TSC frequency (stored in the returned cell once the
/// boot vCPU exists) and the KVM backend.
pub(crate) fn add_hypercalls(
    hooks: &ExitHooks,
    backend: Backend,
) -> Result<Arc<AtomicU64>, HookError> {
    let tsc_khz = Arc::new(AtomicU64::new(0));
    hooks.add_hypercall(DISCOVER, Arc::new(|_: u32, _: &kvm_regs| MAGIC))?;
    let t = tsc_khz.clone();
    hooks.add_hypercall(
        TSC_KHZ,
        Arc::new(move |_: u32, _: &kvm_regs| t.load(Ordering::Relaxed)),
    )?;
    let code = backend.code() as u64;
    hooks.add_hypercall(BACKEND, Arc::new(move |_: u32, _: &kvm_regs| code))?;
    Ok(tsc_khz)
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    /// The object-like `#define NAME VALUE`s of a C header whose names start with `prefix`.
    fn defines(header: &str, prefix: &str) -> BTreeMap<String, u64> {
        let mut out = BTreeMap::new();
        for line in header.lines() {
            let mut words = line.split_whitespace();
            if words.next() != Some("#define") {
                continue;
            }
            let (Some(name), Some(value)) = (words.next(), words.next()) else {
                continue;
            };
            if !name.starts_with(prefix) || name.contains('(') {
                continue;
            }
            let digits = value.trim_end_matches(['U', 'L', 'u', 'l']);
            let v = match digits
                .strip_prefix("0x")
                .or_else(|| digits.strip_prefix("0X"))
            {
                Some(hex) => u64::from_str_radix(hex, 16),
                None => digits.parse(),
            }
            .unwrap_or_else(|e| panic!("#define {name} {value}: {e}"));
            assert!(out.insert(name.to_string(), v).is_none(), "{name} twice");
        }
        out
    }

    #[test]
    fn every_number_in_the_table_is_used_once() {
        let mut seen = BTreeMap::new();
        for h in TABLE {
            if let Some(other) = seen.insert(h.nr, h.name) {
                panic!("{} and {other} share hypercall {}", h.name, h.nr);
            }
        }
        assert_eq!(name(abi::HC_RETURN), "SYM_HC_RETURN");
        assert_eq!(name(1000), "unknown");
    }

    /// lucid.h and the table hold the same names with the same values, each way.
    #[test]
    fn lucid_h_matches_the_table() {
        let header = include_str!("../../../guests/lib/x86/lucid.h");
        let c = defines(header, "LUCID_");
        let mut rust: BTreeMap<String, u64> = TABLE
            .iter()
            .filter(|h| h.name.starts_with("LUCID_"))
            .map(|h| (h.name.to_string(), h.nr))
            .collect();
        for (name, v) in GUEST_ABI {
            assert!(rust.insert(name.to_string(), *v).is_none(), "{name} twice");
        }
        for (name, v) in &c {
            assert_eq!(
                rust.get(name),
                Some(v),
                "lucid.h's {name} in the Rust table"
            );
        }
        for (name, v) in &rust {
            assert_eq!(c.get(name), Some(v), "the Rust table's {name} in lucid.h");
        }
    }

    /// The symbiotic calls' numbers in sym.h are the table's, each way.
    #[test]
    fn sym_h_hypercalls_match_the_table() {
        let header = include_str!("../../../guests/lib/x86/sym.h");
        let c = defines(header, "SYM_HC_");
        let rust: BTreeMap<String, u64> = TABLE
            .iter()
            .filter(|h| h.name.starts_with("SYM_HC_"))
            .map(|h| (h.name.to_string(), h.nr))
            .collect();
        assert_eq!(c, rust);
    }

    #[test]
    fn the_builtin_calls_answer_and_cannot_be_registered_twice() {
        let hooks = ExitHooks::new();
        let tsc = add_hypercalls(&hooks, Backend::Pvm).unwrap();
        tsc.store(2_000_000, Ordering::Relaxed);
        let call = |nr| {
            hooks.hypercall(
                0,
                &kvm_regs {
                    rax: nr,
                    ..Default::default()
                },
            )
        };
        assert_eq!(call(DISCOVER), Some(MAGIC));
        assert_eq!(call(TSC_KHZ), Some(2_000_000));
        assert_eq!(call(BACKEND), Some(Backend::Pvm.code().into()));
        assert!(matches!(
            add_hypercalls(&hooks, Backend::Pvm),
            Err(HookError::HypercallTaken { nr: DISCOVER })
        ));
    }
}
