//! The guest's physical memory map as every boot protocol reports it (e820 for Linux, the PVH
//! memmap table, the multiboot mmap), and checks that a range is usable RAM.

use std::ops::Range;
use std::path::Path;

use crate::layout::{
    ram_regions, ACPI_END, EBDA_START, HIGH_MEMORY, HIGH_RAM_START, MMIO_HOLE_START, PCI_ECAM_SIZE,
    PCI_ECAM_START,
};
use crate::BootError;

/// e820 / PVH / multiboot type of usable RAM.
pub const E820_RAM: u32 = 1;
/// e820 / PVH / multiboot type of reserved memory.
pub const E820_RESERVED: u32 = 2;

/// One entry of the memory map.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemEntry {
    pub addr: u64,
    pub size: u64,
    /// [`E820_RAM`] or [`E820_RESERVED`] (the e820 numbering, shared by PVH and multiboot).
    pub kind: u32,
}

/// The memory map for `mem_size` bytes of guest RAM laid out by [`ram_regions`] (see
/// [`memory_map_with`]):
///
/// - RAM `0..EBDA_START` (640 KiB minus the EBDA),
/// - reserved `EBDA_START..1 MiB` (EBDA, VGA hole, BIOS area and the ACPI tables at 0xe0000),
/// - RAM from 1 MiB to the end of low RAM (at most the start of the MMIO hole),
/// - reserved: the PCIe ECAM window, so that Linux accepts an MCFG table pointing there,
/// - RAM from 4 GiB for what did not fit below the hole.
pub fn memory_map(mem_size: u64) -> Vec<MemEntry> {
    memory_map_with(mem_size, None)
}

/// [`memory_map`] with a `reserved` range (ACPI tables that had to leave the BIOS area) cut out
/// of the RAM entries and listed as reserved.
pub fn memory_map_with(mem_size: u64, reserved: Option<Range<u64>>) -> Vec<MemEntry> {
    let mut map = vec![
        MemEntry {
            addr: 0,
            size: EBDA_START,
            kind: E820_RAM,
        },
        MemEntry {
            addr: EBDA_START,
            size: ACPI_END - EBDA_START,
            kind: E820_RESERVED,
        },
    ];
    let low_end = low_ram_end(mem_size);
    if low_end > HIGH_MEMORY {
        map.push(MemEntry {
            addr: HIGH_MEMORY,
            size: low_end - HIGH_MEMORY,
            kind: E820_RAM,
        });
    }
    map.push(MemEntry {
        addr: PCI_ECAM_START,
        size: PCI_ECAM_SIZE,
        kind: E820_RESERVED,
    });
    for (start, len) in ram_regions(mem_size) {
        if start >= HIGH_RAM_START {
            map.push(MemEntry {
                addr: start,
                size: len,
                kind: E820_RAM,
            });
        }
    }
    if let Some(r) = reserved {
        map = map.into_iter().flat_map(|e| cut(e, &r)).collect();
        map.push(MemEntry {
            addr: r.start,
            size: r.end - r.start,
            kind: E820_RESERVED,
        });
    }
    map.sort_by_key(|e| e.addr);
    map
}

/// What is left of RAM entry `e` outside `r` (reserved entries are kept whole).
fn cut(e: MemEntry, r: &Range<u64>) -> Vec<MemEntry> {
    let end = e.addr + e.size;
    if e.kind != E820_RAM || r.end <= e.addr || r.start >= end {
        return vec![e];
    }
    let mut v = Vec::new();
    if r.start > e.addr {
        v.push(MemEntry {
            size: r.start - e.addr,
            ..e
        });
    }
    if r.end < end {
        v.push(MemEntry {
            addr: r.end,
            size: end - r.end,
            ..e
        });
    }
    v
}

/// End (exclusive) of the RAM region that starts at 0.
pub fn low_ram_end(mem_size: u64) -> u64 {
    mem_size.min(MMIO_HOLE_START)
}

pub(crate) fn mib_up(bytes: u64) -> u64 {
    bytes.div_ceil(1 << 20)
}

/// Checks that `start..end` can hold kernel or initrd bytes: inside one RAM region (below 1 MiB
/// too: Lucid's boot structures move out of the way, `area.rs`). If the range is below the MMIO
/// hole but past the end of RAM, more memory would help: `MemoryTooSmall`.
pub(crate) fn check_load_range(
    mem_size: u64,
    path: &Path,
    what: &'static str,
    start: u64,
    end: u64,
) -> Result<(), BootError> {
    let outside = |why| BootError::OutsideRam {
        path: path.to_path_buf(),
        what,
        start,
        end,
        why,
    };
    if end < start {
        return Err(outside("the range wraps around"));
    }
    if ram_regions(mem_size)
        .iter()
        .any(|&(s, l)| start >= s && end <= s + l)
    {
        return Ok(());
    }
    if end <= MMIO_HOLE_START {
        return Err(BootError::MemoryTooSmall {
            what,
            need_mib: mib_up(end),
            have_mib: mem_size >> 20,
        });
    }
    if start < MMIO_HOLE_START || end <= HIGH_RAM_START {
        return Err(outside("overlaps the MMIO hole 0xc0000000..4 GiB"));
    }
    Err(outside("above the end of guest RAM"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn map_small_and_large() {
        let m = memory_map(64 << 20);
        assert_eq!(
            m[0],
            MemEntry {
                addr: 0,
                size: 0x9fc00,
                kind: 1
            }
        );
        assert_eq!(m[1].addr, 0x9fc00);
        assert_eq!(m[1].addr + m[1].size, 0x100000);
        assert_eq!(
            m[2],
            MemEntry {
                addr: 0x100000,
                size: (64 << 20) - 0x100000,
                kind: 1
            }
        );
        assert_eq!(m[3].kind, E820_RESERVED);
        assert_eq!(m.len(), 4);
        let m = memory_map(4 << 30);
        assert_eq!(
            m.last().unwrap(),
            &MemEntry {
                addr: 4 << 30,
                size: 1 << 30,
                kind: 1
            }
        );
        assert_eq!(m[2].addr + m[2].size, 0xc000_0000);
    }

    #[test]
    fn load_range_checks() {
        let p = Path::new("k");
        assert!(check_load_range(64 << 20, p, "kernel", 1 << 20, 2 << 20).is_ok());
        let e = check_load_range(64 << 20, p, "kernel", 1 << 20, 100 << 20).unwrap_err();
        assert_eq!(
            e.to_string(),
            "memory too small: kernel needs 100 MiB, guest has 64 MiB"
        );
        assert!(check_load_range(64 << 20, p, "kernel", 0x7000, 0x8000).is_ok());
        assert!(check_load_range(8 << 30, p, "kernel", 0xbfff_0000, 0xc000_1000).is_err());
    }

    #[test]
    fn reserved_ranges_are_cut_out_of_ram() {
        let m = memory_map_with(64 << 20, Some(0x3f0_0000..0x3f0_2000));
        assert_eq!(
            m[2..5],
            [
                MemEntry {
                    addr: 0x10_0000,
                    size: 0x3f0_0000 - 0x10_0000,
                    kind: E820_RAM
                },
                MemEntry {
                    addr: 0x3f0_0000,
                    size: 0x2000,
                    kind: E820_RESERVED
                },
                MemEntry {
                    addr: 0x3f0_2000,
                    size: (64 << 20) - 0x3f0_2000,
                    kind: E820_RAM
                },
            ]
        );
    }
}
