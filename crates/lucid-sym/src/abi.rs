//! The symbiotic ABI: hypercall numbers, SymSpy page layout, SymCall call numbers and status
//! codes. `guests/lib/x86/sym.h` is the C side of the same numbers; change both together.
//!
//! Hypercalls go through Lucid's hypercall port (`out %eax, %dx`, dx = 0x599, rax = number,
//! rdi/rsi/r8 = arguments, result in rax), which works on every host, PVM included (CPUID is
//! not intercepted there). Without `--symbiotic` none of these numbers is registered and each
//! returns all ones, like any unknown hypercall.

/// rdi = `DISCOVER_SIGNATURE` | `DISCOVER_VERSION` | `DISCOVER_FEATURES`.
pub const HC_DISCOVER: u64 = 6;
/// rdi = `REGISTER_GLOBAL` | `REGISTER_VCPU`, rsi = page-aligned guest-physical address in RAM
/// (0 unregisters). A per-vCPU page registers from the vCPU it belongs to. Returns 0 or a
/// negative errno (`-EINVAL` bad address or header, `-ENODEV` no such registration kind).
pub const HC_REGISTER: u64 = 7;
/// Ends the SymCall running on this vCPU: rdi = status (`SYM_OK` or an errno), rsi = value 0,
/// r8 = value 1. Outside a call it returns `-EINVAL` and changes nothing.
pub const HC_RETURN: u64 = 8;
/// rdi = `NOTIFY_*`: the guest tells Lucid something is ready in SymSpy (one exit, so Lucid
/// need not poll). Returns 0.
pub const HC_NOTIFY: u64 = 9;

pub const DISCOVER_SIGNATURE: u64 = 0;
pub const DISCOVER_VERSION: u64 = 1;
pub const DISCOVER_FEATURES: u64 = 2;
/// What `HC_DISCOVER(DISCOVER_SIGNATURE)` returns: "LUCIDSYM" in little-endian bytes.
pub const SIGNATURE: u64 = u64::from_le_bytes(*b"LUCIDSYM");
/// The ABI version: a guest refuses versions it does not know.
pub const VERSION: u64 = 1;

/// Feature bits (`HC_DISCOVER(DISCOVER_FEATURES)`, CPUID 0x40000101 ebx, `G_FEATURES`).
pub const FEAT_SYMSPY: u64 = 1 << 0;
pub const FEAT_SYMCALL: u64 = 1 << 1;
pub const FEAT_SWAPBYPASS: u64 = 1 << 2;
pub const FEAT_MODULES: u64 = 1 << 3;

pub const REGISTER_GLOBAL: u64 = 0;
pub const REGISTER_VCPU: u64 = 1;

/// `HC_NOTIFY` events.
pub const NOTIFY_MODULE_REPLY: u64 = 0;

/// Status codes (SymCall results, hypercall errors as their negation): Linux errno values.
pub const SYM_OK: u64 = 0;
pub const SYM_EWOULDBLOCK: u64 = 11;
pub const SYM_EFAULT: u64 = 14;
pub const SYM_EBUSY: u64 = 16;
pub const SYM_ENODEV: u64 = 19;
pub const SYM_EINVAL: u64 = 22;
pub const SYM_ENOSYS: u64 = 38;
pub const SYM_ETIMEDOUT: u64 = 110;

/// `-errno` as a hypercall result.
pub const fn neg(errno: u64) -> u64 {
    errno.wrapping_neg()
}

/// SymCall call numbers (rax at the entry; arguments in rdi, rsi, rdx, r10, r8).
pub mod call {
    /// Returns value0 = the sum of the five arguments, value1 = the first.
    pub const ECHO: u64 = 0;
    /// arg0 = guest page number in the guest's swap map: value0 = `PAGE_*`, value1 = its slot.
    pub const PAGE_STATE: u64 = 1;
    /// arg0 = counter index: value0 = that guest counter.
    pub const READ_COUNTER: u64 = 2;
    /// arg0 = swap slot: value0 = 1 if the slot still holds a page the guest will read, else 0.
    pub const SLOT_LIVE: u64 = 3;
    /// Misbehaving handlers, registered only by the test guest: loops forever, takes a page
    /// fault, smashes its stack and returns through it.
    pub const TEST_LOOP: u64 = 0x100;
    pub const TEST_FAULT: u64 = 0x101;
    pub const TEST_SMASH: u64 = 0x102;

    pub const PAGE_RESIDENT: u64 = 0;
    pub const PAGE_SWAPPED: u64 = 1;
    pub const PAGE_UNKNOWN: u64 = 2;
}

/// SymSpy pages: 4 KiB of guest RAM each, one global and one per vCPU, laid out alike up to the
/// records. Each direction has its own 64-byte line; a record is written under its sequence
/// count (odd while being written), read by retrying until the count is even and unchanged.
pub mod page {
    pub const SIZE: u64 = 4096;

    /// "SSPY": written by the guest before it registers the page.
    pub const MAGIC: u32 = u32::from_le_bytes(*b"SSPY");
    // Header (guest-written, checked at registration).
    pub const H_MAGIC: u64 = 0x000; // u32
    pub const H_VERSION: u64 = 0x004; // u16 (= abi::VERSION)
    pub const H_KIND: u64 = 0x006; // u16: REGISTER_GLOBAL | REGISTER_VCPU
    pub const H_VCPU: u64 = 0x008; // u32: the vCPU a per-vCPU page belongs to
    /// u64: the guest's registration generation; bumped whenever what the page points to
    /// (SymCall entry, exports) changes, so Lucid never calls a stale entry.
    pub const H_GENERATION: u64 = 0x010;

    // Global page, guest -> Lucid line (0x40..0x80).
    pub const G_SEQ: u64 = 0x040; // u32
    pub const G_PHASE: u64 = 0x044; // u32: the phase or task the guest runs
    pub const G_SYMCALL_ENTRY: u64 = 0x048; // u64: guest RIP; 0 = no SymCall
    pub const G_SYMCALL_CS: u64 = 0x050; // u32: code selector of the entry
    pub const G_SYMCALL_SS: u64 = 0x054; // u32: stack selector
    pub const G_SYMCALL_FLAGS: u64 = 0x058; // u64: RFLAGS at the entry (IF is forced off)
    pub const G_EXPORTS: u64 = 0x060; // u64: GPA of the module symbol table, 0 = none
    pub const G_SWAP_MAP: u64 = 0x068; // u64: GPA of the swap map (SwapBypass), 0 = none
    pub const G_SWAP_MAP_LEN: u64 = 0x070; // u32: entries in the swap map
    pub const G_SWAP_DEVICE: u64 = 0x074; // u32: PCI slot of the swap disk, 0 = none

    // Global page, Lucid -> guest line (0x80..0xc0).
    pub const L_SEQ: u64 = 0x080; // u32
    pub const L_FEATURES: u64 = 0x084; // u32: feature bits Lucid offers
    pub const L_MEM_PRESSURE: u64 = 0x088; // u64: host memory pressure, per mille
    pub const L_MEM_AVAILABLE_KIB: u64 = 0x090; // u64: host memory available to the VM, KiB
    pub const L_IOMMU_MODE: u64 = 0x098; // u32: IOMMU_*
    pub const L_RUNG: u64 = 0x09c; // u32: lowest exit-ladder rung among the VM's devices (0-4)
    /// `L_RUNG`/`W_RUNG` of a VM without devices on the ladder.
    pub const RUNG_NONE: u32 = 0xff;
    pub const L_SYMCALLS: u64 = 0x0a0; // u64: SymCalls completed
    pub const L_PUBLISHES: u64 = 0x0a8; // u64: times Lucid published this line

    /// The module mailbox (docs/symbiotic.md §7): requests 0x100..0x200 (Lucid -> guest), replies
    /// 0x200..0x300 (guest -> Lucid). Layout in `crate::abi::module`.
    pub const MAILBOX: u64 = 0x100;
    pub const MAILBOX_REPLY: u64 = 0x200;

    // Per-vCPU page, guest -> Lucid line (0x40..0x80).
    pub const V_SEQ: u64 = 0x040; // u32
    pub const V_TASK: u64 = 0x044; // u32: the task or phase on this vCPU
    pub const V_COUNTER: u64 = 0x048; // u64: a guest counter (the SymSpy loop's updates)
    pub const V_IF: u64 = 0x050; // u64: 1 when the guest has interrupts enabled
    pub const V_SYMCALL_STACK: u64 = 0x058; // u64: top of this vCPU's SymCall stack
    pub const V_IN_SYMCALL: u64 = 0x060; // u64: guest-set while its handler runs

    // Per-vCPU page, Lucid -> guest line (0x80..0xc0).
    pub const W_SEQ: u64 = 0x080; // u32
    pub const W_RUNG: u64 = 0x084; // u32
    pub const W_RUNQ_WAIT_NS: u64 = 0x088; // u64: the vCPU thread's run-queue wait (schedstat)
    pub const W_SYMCALLS: u64 = 0x090; // u64: SymCalls run on this vCPU
    pub const W_PUBLISHES: u64 = 0x098; // u64

    pub const IOMMU_NONE: u32 = 0;
    pub const IOMMU_VTD_SAMECORE: u32 = 1;
    pub const IOMMU_VTD_SIDECORE: u32 = 2;
}

/// CPUID leaves for hosts that intercept CPUID (VT-x, AMD-V), above KVM's own 0x40000000 range.
pub const CPUID_LEAF: u32 = 0x4000_0100;
/// eax = version, ebx = features, ecx = hypercall port, edx = 0.
pub const CPUID_LEAF_INFO: u32 = 0x4000_0101;
/// The 12-byte signature in ebx, ecx, edx of `CPUID_LEAF`.
pub const CPUID_SIGNATURE: &[u8; 12] = b"LucidSymbiot";

/// The module mailbox (docs/symbiotic.md §7): one request at a time. Lucid
/// fills a request (0x100..0x200) and bumps `R_SEQ` last; the guest's loader (`symmod_poll`)
/// sees a new sequence, does the work, fills the reply (0x200..0x2c0) with `P_SEQ` = the
/// request's sequence written last, and raises `HC_NOTIFY(NOTIFY_MODULE_REPLY)`. The loader's
/// own description (arena, object buffer, usage) sits at 0x2c0..0x300, written by the guest.
/// Offsets are from the start of the global SymSpy page.
pub mod module {
    // Request, Lucid -> guest.
    pub const R_SEQ: u64 = 0x100; // u32: bumped last; a new value is a new request
    pub const R_OP: u64 = 0x104; // u32: OP_*
    pub const R_FLAGS: u64 = 0x108; // u32: FLAG_*
    pub const R_ID: u64 = 0x10c; // u32: module id (UNLOAD, SEAL)
    pub const R_SIZE: u64 = 0x110; // u64: object bytes Lucid copied to the object buffer
    pub const R_RO_GPA: u64 = 0x118; // u64: read-only window for this module (FLAG_READ_ONLY)
    pub const R_RO_SIZE: u64 = 0x120; // u64: its size
    pub const R_NAME: u64 = 0x128; // [u8; NAME_LEN], NUL-padded
    pub const NAME_LEN: usize = 32;
    pub const R_ARG: u64 = 0x148; // u64: OP_CALL's argument

    // Reply, guest -> Lucid.
    pub const P_SEQ: u64 = 0x200; // u32: the request's R_SEQ, written last
    pub const P_STATUS: u64 = 0x204; // u32: SYM_OK or an errno (EINVAL bad object, ENOENT
                                     // missing symbol, ENOMEM too big, ENOEXEC bad relocation, ...)
    pub const P_ID: u64 = 0x208; // u32: module id
    pub const P_STAGE: u64 = 0x20c; // u32: STAGE_*: what the reply finishes
    pub const P_BASE: u64 = 0x210; // u64: GPA of the module's code
    pub const P_SIZE: u64 = 0x218; // u64: bytes the module takes in the arena
    pub const P_INIT: u64 = 0x220; // u64: what module_init returned
    pub const P_STAGED: u64 = 0x228; // u64: read-only load: GPA of the linked code to copy
    pub const P_STAGED_SIZE: u64 = 0x230; // u64: its size
    pub const P_MESSAGE: u64 = 0x240; // [u8; MESSAGE_LEN]: NUL-terminated, why it refused
    pub const MESSAGE_LEN: usize = 128;

    // The loader, guest -> Lucid (written once by symmod_init, usage after every request).
    pub const A_MAGIC: u64 = 0x2c0; // u32: LOADER_MAGIC once the loader polls
    pub const A_LOADED: u64 = 0x2c4; // u32: modules loaded now
    pub const A_ARENA: u64 = 0x2c8; // u64: GPA of the module arena
    pub const A_ARENA_SIZE: u64 = 0x2d0; // u64
    pub const A_OBJECT: u64 = 0x2d8; // u64: GPA of the buffer Lucid copies objects into
    pub const A_OBJECT_SIZE: u64 = 0x2e0; // u64
    pub const A_ARENA_USED: u64 = 0x2e8; // u64: arena bytes in use
    pub const A_POLLS: u64 = 0x2f0; // u64: requests handled

    /// "SMOD".
    pub const LOADER_MAGIC: u32 = u32::from_le_bytes(*b"SMOD");

    pub const OP_NONE: u32 = 0;
    /// Link the object in the buffer and run its init (or, read-only, stage its code).
    pub const OP_LOAD: u32 = 1;
    /// Run module `R_ID`'s exit and free it.
    pub const OP_UNLOAD: u32 = 2;
    /// Read-only load, second half: Lucid copied the staged code into the read-only window;
    /// free the staging copy and run init from the window.
    pub const OP_SEAL: u32 = 3;
    /// Run module `R_ID`'s `module_call(R_ARG)`; its result comes back in `P_INIT`.
    pub const OP_CALL: u32 = 4;

    pub const FLAG_READ_ONLY: u32 = 1;

    /// The SymCall number the `counter` module's init registers (value0 = its counter after
    /// adding arg0); its exit unregisters it.
    pub const SYMCALL_MODULE_COUNTER: u64 = 0x200;

    /// The reply's stage: the request is done (init ran, or the module is gone) ...
    pub const STAGE_DONE: u32 = 0;
    /// ... or (read-only LOAD) the code is linked for the window and staged at `P_STAGED`.
    pub const STAGE_STAGED: u32 = 1;

    /// Status codes beyond `abi::SYM_*`.
    pub const SYM_ENOENT: u32 = 2;
    pub const SYM_ENOEXEC: u32 = 8;
    pub const SYM_ENOMEM: u32 = 12;
    pub const SYM_E2BIG: u32 = 7;

    /// The guest-physical window read-only modules are placed in: below 2 GiB, so code there
    /// reaches the guest's exports with 32-bit PC-relative calls (`-mcmodel=small`), and
    /// above the RAM of any VM that uses it (Lucid refuses read-only modules in a VM whose
    /// RAM reaches it). One `RO_SLOT` per module; the kit's page tables map it (identity map of
    /// 0-4 GiB).
    pub const RO_WINDOW: u64 = 0x7000_0000;
    pub const RO_WINDOW_SIZE: u64 = 0x1000_0000;
    pub const RO_SLOT: u64 = 0x10_0000;

    /// The exports table at `G_EXPORTS`: a header (`EXPORTS_MAGIC`: u32, count: u32) and
    /// `count` entries of `EXPORT_ENTRY` bytes: the address (u64) and a NUL-padded name.
    pub const EXPORTS_MAGIC: u32 = u32::from_le_bytes(*b"SEXP");
    pub const EXPORT_ENTRY: u64 = 32;
    pub const EXPORT_NAME_LEN: usize = 24;
}
