//! Entry register state for the boot vCPU: GDT, identity page tables for 64-bit entries, control
//! registers and segments.

use kvm_bindings::{kvm_regs, kvm_segment, kvm_sregs};
use vm_memory::GuestMemoryMmap;

use crate::layout::BOOT_IDT_OFFSET;
use crate::loader::write_bytes;
use crate::{BootError, EntryMode, EntryState};

/// GDT selectors written by [`crate::setup_boot_regs`].
pub mod selectors {
    /// Flat 32-bit code (protected-mode entries).
    pub const CODE32: u16 = 0x08;
    /// 64-bit code: Linux's `__BOOT_CS`.
    pub const CODE64: u16 = 0x10;
    /// Flat data: Linux's `__BOOT_DS`.
    pub const DATA: u16 = 0x18;
}

pub const X86_CR0_PE: u64 = 1 << 0;
pub const X86_CR0_ET: u64 = 1 << 4;
pub const X86_CR0_NE: u64 = 1 << 5;
pub const X86_CR0_PG: u64 = 1 << 31;
pub const X86_CR4_PAE: u64 = 1 << 5;
pub const EFER_LME: u64 = 1 << 8;
pub const EFER_LMA: u64 = 1 << 10;

/// Flags (access byte in bits 0-7, flags nibble in bits 12-15) of the boot GDT entries.
const CODE32_FLAGS: u16 = 0xc09b; // G, D/B, P, DPL0, S, execute/read, accessed
const CODE64_FLAGS: u16 = 0xa09b; // G, L, P, DPL0, S, execute/read, accessed
const DATA_FLAGS: u16 = 0xc093; // G, D/B, P, DPL0, S, read/write, accessed

/// Encodes a segment descriptor.
pub fn gdt_entry(flags: u16, base: u32, limit: u32) -> u64 {
    let (flags, base, limit) = (u64::from(flags), u64::from(base), u64::from(limit));
    ((base & 0xff00_0000) << 32)
        | ((flags & 0xf0ff) << 40)
        | ((limit & 0x000f_0000) << 32)
        | ((base & 0x00ff_ffff) << 16)
        | (limit & 0x0000_ffff)
}

/// The `kvm_segment` (hidden part) matching a descriptor loaded with `selector`.
pub fn segment_from_gdt(entry: u64, selector: u16) -> kvm_segment {
    let g = ((entry >> 55) & 1) as u8;
    let raw_limit = (((entry >> 32) & 0x000f_0000) | (entry & 0xffff)) as u32;
    kvm_segment {
        base: ((entry >> 16) & 0x00ff_ffff) | ((entry >> 32) & 0xff00_0000),
        limit: if g == 1 {
            (raw_limit << 12) | 0xfff
        } else {
            raw_limit
        },
        selector,
        type_: ((entry >> 40) & 0xf) as u8,
        present: ((entry >> 47) & 1) as u8,
        dpl: ((entry >> 45) & 3) as u8,
        db: ((entry >> 54) & 1) as u8,
        s: ((entry >> 44) & 1) as u8,
        l: ((entry >> 53) & 1) as u8,
        g,
        avl: ((entry >> 52) & 1) as u8,
        unusable: 0,
        padding: 0,
    }
}

/// The boot GDT: null, 32-bit code (0x08), 64-bit code (0x10), data (0x18).
pub fn boot_gdt() -> [u64; 4] {
    [
        0,
        gdt_entry(CODE32_FLAGS, 0, 0xfffff),
        gdt_entry(CODE64_FLAGS, 0, 0xfffff),
        gdt_entry(DATA_FLAGS, 0, 0xfffff),
    ]
}

fn write_u64s(
    mem: &GuestMemoryMmap,
    addr: u64,
    v: &[u64],
    what: &'static str,
) -> Result<(), BootError> {
    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    write_bytes(mem, addr, &bytes, what)
}

/// Identity map of the first 4 GiB with 2 MiB pages at `pml4`: PML4 -> one PDPT (the next page)
/// -> 4 page directories (the four pages after it).
fn write_page_tables(mem: &GuestMemoryMmap, pml4: u64) -> Result<(), BootError> {
    const P_RW: u64 = 0x3;
    const PS: u64 = 0x80;
    let (pdpt, pd) = (pml4 + 0x1000, pml4 + 0x2000);
    let mut table = vec![0u64; 512];
    table[0] = pdpt | P_RW;
    write_u64s(mem, pml4, &table, "PML4")?;
    let mut table = vec![0u64; 512];
    for (i, e) in table.iter_mut().take(4).enumerate() {
        *e = (pd + 0x1000 * i as u64) | P_RW;
    }
    write_u64s(mem, pdpt, &table, "PDPT")?;
    let pds: Vec<u64> = (0..2048u64).map(|i| (i << 21) | P_RW | PS).collect();
    write_u64s(mem, pd, &pds, "page directories")
}

/// Sets the boot vCPU's registers for `entry`. `sregs` should hold the vCPU's current special
/// registers (`KVM_GET_SREGS`); the segment, descriptor-table and control registers are replaced
/// and everything else (TR, LDT, APIC base, ...) is kept. Writes the GDT (and for 64-bit entries the
/// identity page tables) into guest memory.
pub fn setup_boot_regs(
    entry: &EntryState,
    regs: &mut kvm_regs,
    sregs: &mut kvm_sregs,
    mem: &GuestMemoryMmap,
) -> Result<(), BootError> {
    let gdt = boot_gdt();
    write_u64s(mem, entry.gdt, &gdt, "boot GDT")?;
    write_u64s(mem, entry.gdt + BOOT_IDT_OFFSET, &[0], "boot IDT")?;
    sregs.gdt.base = entry.gdt;
    sregs.gdt.limit = (std::mem::size_of_val(&gdt) - 1) as u16;
    sregs.idt.base = entry.gdt + BOOT_IDT_OFFSET;
    sregs.idt.limit = 7;

    let data = segment_from_gdt(gdt[(selectors::DATA >> 3) as usize], selectors::DATA);
    let code_sel = match entry.mode {
        EntryMode::Protected32 { .. } => selectors::CODE32,
        EntryMode::Long64 { .. } => selectors::CODE64,
    };
    sregs.cs = segment_from_gdt(gdt[(code_sel >> 3) as usize], code_sel);
    sregs.ds = data;
    sregs.es = data;
    sregs.fs = data;
    sregs.gs = data;
    sregs.ss = data;

    *regs = kvm_regs {
        rflags: 0x2,
        rsp: entry.stack_top,
        rbp: entry.stack_top,
        ..Default::default()
    };
    match entry.mode {
        EntryMode::Protected32 { eip, eax, ebx } => {
            sregs.cr0 = X86_CR0_PE | X86_CR0_ET;
            sregs.cr3 = 0;
            sregs.cr4 = 0;
            sregs.efer = 0;
            regs.rip = eip;
            regs.rax = eax;
            regs.rbx = ebx;
        }
        EntryMode::Long64 { rip, rsi } => {
            write_page_tables(mem, entry.page_tables)?;
            sregs.cr3 = entry.page_tables;
            sregs.cr4 = X86_CR4_PAE;
            sregs.cr0 = X86_CR0_PE | X86_CR0_ET | X86_CR0_NE | X86_CR0_PG;
            sregs.efer = EFER_LME | EFER_LMA;
            regs.rip = rip;
            regs.rsi = rsi;
        }
    }
    Ok(())
}
