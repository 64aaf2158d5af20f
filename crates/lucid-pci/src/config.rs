//! A PCI function's configuration space: the type-0 header, the capability list and the 4 KiB
//! PCIe extended space, with per-bit write masks (read-only, read-write, write-1-to-clear) and
//! BARs whose size a guest probes by writing all ones.

use crate::{BarProblem, CapProblem, PciError};

pub const CONFIG_SIZE: usize = 4096;
/// The legacy (0xCF8) part of the space; capabilities live here.
pub const LEGACY_CONFIG_SIZE: usize = 256;

pub const VENDOR_ID: usize = 0x00;
pub const DEVICE_ID: usize = 0x02;
pub const COMMAND: usize = 0x04;
pub const STATUS: usize = 0x06;
pub const REVISION: usize = 0x08;
pub const CLASS_PROG_IF: usize = 0x09;
pub const CACHE_LINE_SIZE: usize = 0x0c;
pub const LATENCY_TIMER: usize = 0x0d;
pub const HEADER_TYPE: usize = 0x0e;
pub const BAR0: usize = 0x10;
pub const SUBSYSTEM_VENDOR_ID: usize = 0x2c;
pub const SUBSYSTEM_ID: usize = 0x2e;
pub const CAPABILITIES_POINTER: usize = 0x34;
pub const INTERRUPT_LINE: usize = 0x3c;
pub const INTERRUPT_PIN: usize = 0x3d;

pub const COMMAND_IO: u16 = 1 << 0;
pub const COMMAND_MEMORY: u16 = 1 << 1;
pub const COMMAND_BUS_MASTER: u16 = 1 << 2;
pub const COMMAND_INTX_DISABLE: u16 = 1 << 10;
/// Command bits a guest may change: I/O, memory, bus master, parity, SERR, INTx disable.
const COMMAND_WRITABLE: u16 = 0x0547;
/// INTx asserted by the function (read-only; set whatever INTx disable says).
pub const STATUS_INTERRUPT: u16 = 1 << 3;
pub const STATUS_CAP_LIST: u16 = 1 << 4;
/// Status error bits, write-1-to-clear.
const STATUS_W1C: u16 = 0xf900;

pub const CAP_ID_MSI: u8 = 0x05;
pub const CAP_ID_VENDOR: u8 = 0x09;
pub const CAP_ID_MSIX: u8 = 0x11;
/// Where the first capability goes.
const FIRST_CAP: usize = 0x40;

pub const NUM_BARS: usize = 6;

/// What a BAR decodes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BarKind {
    Io,
    Mmio32 {
        prefetchable: bool,
    },
    /// Occupies this BAR register and the next.
    Mmio64 {
        prefetchable: bool,
    },
}

impl BarKind {
    pub fn is_io(self) -> bool {
        self == BarKind::Io
    }
    fn flags(self) -> u32 {
        match self {
            BarKind::Io => 0x1,
            BarKind::Mmio32 { prefetchable } => (prefetchable as u32) << 3,
            BarKind::Mmio64 { prefetchable } => 0x4 | (prefetchable as u32) << 3,
        }
    }
    fn addr_mask(self) -> u32 {
        match self {
            BarKind::Io => !0x3,
            _ => !0xf,
        }
    }
}

/// One implemented BAR.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Bar {
    pub kind: BarKind,
    /// A power of two: at least 16 for memory, 4 for I/O.
    pub size: u64,
}

/// The identity a function presents in its header.
#[derive(Clone, Copy, Debug, Default)]
pub struct PciIds {
    pub vendor: u16,
    pub device: u16,
    pub revision: u8,
    /// (class, subclass, programming interface)
    pub class: (u8, u8, u8),
    pub subsystem_vendor: u16,
    pub subsystem: u16,
}

pub struct ConfigSpace {
    bytes: Box<[u8; CONFIG_SIZE]>,
    /// Bits a guest write may change.
    wmask: Box<[u8; CONFIG_SIZE]>,
    /// Bits a guest clears by writing 1.
    w1c: Box<[u8; CONFIG_SIZE]>,
    bars: [Option<Bar>; NUM_BARS],
    /// Offset of the last capability's "next" byte (the capabilities pointer at first).
    last_next: usize,
    /// Where the next capability may start.
    next_cap: usize,
}

impl ConfigSpace {
    /// A type-0 header with `ids`, no BARs and no capabilities.
    pub fn new(ids: PciIds) -> Self {
        let mut c = ConfigSpace {
            bytes: Box::new([0; CONFIG_SIZE]),
            wmask: Box::new([0; CONFIG_SIZE]),
            w1c: Box::new([0; CONFIG_SIZE]),
            bars: [None; NUM_BARS],
            last_next: CAPABILITIES_POINTER,
            next_cap: FIRST_CAP,
        };
        c.set_u16(VENDOR_ID, ids.vendor);
        c.set_u16(DEVICE_ID, ids.device);
        c.bytes[REVISION] = ids.revision;
        c.bytes[CLASS_PROG_IF] = ids.class.2;
        c.bytes[CLASS_PROG_IF + 1] = ids.class.1;
        c.bytes[CLASS_PROG_IF + 2] = ids.class.0;
        c.bytes[HEADER_TYPE] = 0;
        c.set_u16(SUBSYSTEM_VENDOR_ID, ids.subsystem_vendor);
        c.set_u16(SUBSYSTEM_ID, ids.subsystem);
        c.set_wmask_u16(COMMAND, COMMAND_WRITABLE);
        c.w1c[STATUS..STATUS + 2].copy_from_slice(&STATUS_W1C.to_le_bytes());
        c.wmask[CACHE_LINE_SIZE] = 0xff;
        c.wmask[LATENCY_TIMER] = 0xff;
        c.wmask[INTERRUPT_LINE] = 0xff;
        c
    }

    /// Declares BAR `index` (a 64-bit BAR also takes `index + 1`).
    pub fn add_bar(&mut self, index: usize, bar: Bar) -> Result<(), PciError> {
        let is64 = matches!(bar.kind, BarKind::Mmio64 { .. });
        let min = if bar.kind.is_io() { 4 } else { 16 };
        let bad = |problem| PciError::Bar {
            bar: index,
            problem,
        };
        if index >= NUM_BARS || (is64 && index + 1 >= NUM_BARS) {
            return Err(bad(BarProblem::IndexOutOfRange));
        }
        if !bar.size.is_power_of_two() || bar.size < min {
            return Err(bad(BarProblem::BadSize {
                size: bar.size,
                min,
            }));
        }
        if (!is64 && bar.size > 1 << 31) || (bar.kind.is_io() && bar.size > 256) {
            return Err(bad(BarProblem::TooLarge { size: bar.size }));
        }
        if self.bars[index].is_some()
            || (is64 && self.bars[index + 1].is_some())
            || (index > 0
                && matches!(
                    self.bars[index - 1],
                    Some(Bar {
                        kind: BarKind::Mmio64 { .. },
                        ..
                    })
                ))
        {
            return Err(bad(BarProblem::InUse));
        }
        self.bars[index] = Some(bar);
        let off = BAR0 + 4 * index;
        self.set_u32(off, bar.kind.flags());
        let size_mask = !(bar.size - 1);
        self.set_wmask_u32(off, size_mask as u32 & bar.kind.addr_mask());
        if is64 {
            self.set_wmask_u32(off + 4, (size_mask >> 32) as u32);
        }
        Ok(())
    }

    pub fn bar(&self, index: usize) -> Option<Bar> {
        self.bars.get(index).copied().flatten()
    }

    /// The address BAR `index` holds now (flag bits stripped), whatever the command register says.
    pub fn bar_address(&self, index: usize) -> Option<u64> {
        let bar = self.bar(index)?;
        let off = BAR0 + 4 * index;
        let lo = (self.u32_at(off) & bar.kind.addr_mask()) as u64;
        let hi = match bar.kind {
            BarKind::Mmio64 { .. } => self.u32_at(off + 4) as u64,
            _ => 0,
        };
        Some(hi << 32 | lo)
    }

    /// Programs BAR `index` as firmware would. `addr` must be aligned to the BAR's size.
    pub fn set_bar_address(&mut self, index: usize, addr: u64) -> Result<(), PciError> {
        let bad = |problem| PciError::Bar {
            bar: index,
            problem,
        };
        let bar = self.bar(index).ok_or(bad(BarProblem::NotImplemented))?;
        if addr & (bar.size - 1) != 0 {
            return Err(bad(BarProblem::Misaligned {
                addr,
                size: bar.size,
            }));
        }
        if !matches!(bar.kind, BarKind::Mmio64 { .. }) && addr > u32::MAX as u64 {
            return Err(bad(BarProblem::Above4G { addr }));
        }
        let off = BAR0 + 4 * index;
        self.set_u32(off, addr as u32 | bar.kind.flags());
        if matches!(bar.kind, BarKind::Mmio64 { .. }) {
            self.set_u32(off + 4, (addr >> 32) as u32);
        }
        Ok(())
    }

    /// Appends a capability: `body` is everything after the ID and next-pointer bytes;
    /// `wmask` (same length, or empty for read-only) says which of its bits a guest may write.
    /// Returns the capability's offset.
    pub fn add_capability(&mut self, id: u8, body: &[u8], wmask: &[u8]) -> Result<usize, PciError> {
        let len = 2 + body.len();
        let bad = |problem| PciError::Capability { id, len, problem };
        if !wmask.is_empty() && wmask.len() != body.len() {
            return Err(bad(CapProblem::MaskLength {
                mask: wmask.len(),
                body: body.len(),
            }));
        }
        let off = self.next_cap;
        if off + len > LEGACY_CONFIG_SIZE {
            return Err(bad(CapProblem::NoRoom { offset: off }));
        }
        self.bytes[off] = id;
        self.bytes[off + 1] = 0;
        self.bytes[off + 2..off + len].copy_from_slice(body);
        if !wmask.is_empty() {
            self.wmask[off + 2..off + len].copy_from_slice(wmask);
        }
        self.bytes[self.last_next] = off as u8;
        self.last_next = off + 1;
        self.next_cap = (off + len + 3) & !3;
        let status = self.u16_at(STATUS) | STATUS_CAP_LIST;
        self.set_u16(STATUS, status);
        Ok(off)
    }

    /// Walks the capability list: (offset, id) of each, stopping at loops or bad pointers.
    pub fn capabilities(&self) -> Vec<(usize, u8)> {
        let mut out = Vec::new();
        let mut p = self.bytes[CAPABILITIES_POINTER] as usize & !3;
        while (FIRST_CAP..LEGACY_CONFIG_SIZE).contains(&p) && out.len() < 48 {
            out.push((p, self.bytes[p]));
            p = self.bytes[p + 1] as usize & !3;
        }
        out
    }

    pub fn set_interrupt(&mut self, line: u8, pin: u8) {
        self.bytes[INTERRUPT_LINE] = line;
        self.bytes[INTERRUPT_PIN] = pin;
    }

    pub fn command(&self) -> u16 {
        self.u16_at(COMMAND)
    }

    pub fn set_command(&mut self, cmd: u16) {
        self.set_u16(COMMAND, cmd);
    }

    /// A guest read. Accesses beyond the space read as ones.
    pub fn read(&self, offset: usize, data: &mut [u8]) {
        for (i, b) in data.iter_mut().enumerate() {
            *b = self.bytes.get(offset + i).copied().unwrap_or(0xff);
        }
    }

    /// A guest write, through the write masks.
    pub fn write(&mut self, offset: usize, data: &[u8]) {
        for (i, &v) in data.iter().enumerate() {
            let o = offset + i;
            if o >= CONFIG_SIZE {
                break;
            }
            let (m, c) = (self.wmask[o], self.w1c[o]);
            let old = self.bytes[o];
            self.bytes[o] = ((old & !m) | (v & m)) & !(v & c);
        }
    }

    pub fn u8_at(&self, off: usize) -> u8 {
        self.bytes[off]
    }
    pub fn u16_at(&self, off: usize) -> u16 {
        u16::from_le_bytes([self.bytes[off], self.bytes[off + 1]])
    }
    pub fn u32_at(&self, off: usize) -> u32 {
        let mut b = [0; 4];
        b.copy_from_slice(&self.bytes[off..off + 4]);
        u32::from_le_bytes(b)
    }
    /// Device-side stores (not masked).
    pub fn set_u8(&mut self, off: usize, v: u8) {
        self.bytes[off] = v;
    }
    pub fn set_u16(&mut self, off: usize, v: u16) {
        self.bytes[off..off + 2].copy_from_slice(&v.to_le_bytes());
    }
    pub fn set_u32(&mut self, off: usize, v: u32) {
        self.bytes[off..off + 4].copy_from_slice(&v.to_le_bytes());
    }
    fn set_wmask_u16(&mut self, off: usize, v: u16) {
        self.wmask[off..off + 2].copy_from_slice(&v.to_le_bytes());
    }
    fn set_wmask_u32(&mut self, off: usize, v: u32) {
        self.wmask[off..off + 4].copy_from_slice(&v.to_le_bytes());
    }
}

/// Whether a config write of `len` bytes at `offset` touched the range `start..start+size`.
pub fn touches(offset: usize, len: usize, start: usize, size: usize) -> bool {
    offset < start + size && start < offset + len
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids() -> PciIds {
        PciIds {
            vendor: 0x1af4,
            device: 0x1042,
            revision: 1,
            class: (0x01, 0x00, 0x00),
            subsystem_vendor: 0x1af4,
            subsystem: 2,
        }
    }

    fn r32(c: &ConfigSpace, off: usize) -> u32 {
        let mut d = [0; 4];
        c.read(off, &mut d);
        u32::from_le_bytes(d)
    }

    #[test]
    fn header_ids_and_read_only_bits() {
        let mut c = ConfigSpace::new(ids());
        assert_eq!(r32(&c, 0), 0x1042_1af4);
        c.write(0, &[0xff; 4]);
        assert_eq!(r32(&c, 0), 0x1042_1af4, "IDs are read-only");
        c.write(COMMAND, &0xffffu16.to_le_bytes());
        assert_eq!(c.command(), COMMAND_WRITABLE);
        c.write(INTERRUPT_PIN, &[7]);
        assert_eq!(c.u8_at(INTERRUPT_PIN), 0);
        c.write(INTERRUPT_LINE, &[11]);
        assert_eq!(c.u8_at(INTERRUPT_LINE), 11);
        // Extended space exists and reads zero; beyond it reads ones.
        assert_eq!(r32(&c, 0x100), 0);
        let mut d = [0u8; 2];
        c.read(CONFIG_SIZE - 1, &mut d);
        assert_eq!(d, [0, 0xff]);
    }

    #[test]
    fn status_error_bits_are_write_one_to_clear() {
        let mut c = ConfigSpace::new(ids());
        c.set_u16(STATUS, 0x8000 | STATUS_CAP_LIST);
        c.write(STATUS, &0x0010u16.to_le_bytes());
        assert_eq!(
            c.u16_at(STATUS),
            0x8010,
            "writing 0 to an error bit keeps it"
        );
        c.write(STATUS, &0x8000u16.to_le_bytes());
        assert_eq!(c.u16_at(STATUS), 0x0010);
    }

    #[test]
    fn bar_sizing_by_all_ones() {
        let mut c = ConfigSpace::new(ids());
        c.add_bar(
            0,
            Bar {
                kind: BarKind::Mmio32 {
                    prefetchable: false,
                },
                size: 0x1000,
            },
        )
        .unwrap();
        c.add_bar(
            2,
            Bar {
                kind: BarKind::Mmio64 { prefetchable: true },
                size: 0x4000,
            },
        )
        .unwrap();
        c.add_bar(
            5,
            Bar {
                kind: BarKind::Io,
                size: 0x20,
            },
        )
        .unwrap();
        for (i, size) in [(0usize, 0x1000u64), (2, 0x4000), (5, 0x20)] {
            let off = BAR0 + 4 * i;
            c.write(off, &u32::MAX.to_le_bytes());
            let kind = c.bar(i).unwrap().kind;
            assert_eq!(
                r32(&c, off),
                (!(size as u32 - 1) & kind.addr_mask()) | kind.flags()
            );
        }
        assert_eq!(r32(&c, BAR0 + 8) & 0xf, 0xc, "64-bit prefetchable flags");
        c.write(BAR0 + 12, &u32::MAX.to_le_bytes());
        assert_eq!(
            r32(&c, BAR0 + 12),
            u32::MAX,
            "upper half of a small 64-bit BAR"
        );
        assert_eq!(r32(&c, BAR0 + 4), 0, "unimplemented BAR reads 0");
        c.write(BAR0 + 4, &u32::MAX.to_le_bytes());
        assert_eq!(r32(&c, BAR0 + 4), 0, "unimplemented BAR ignores writes");
        c.set_bar_address(2, 0x1_2345_4000).unwrap();
        assert_eq!(c.bar_address(2), Some(0x1_2345_4000));
        assert!(c.set_bar_address(0, 0x1800).is_err(), "misaligned");
        assert!(
            c.set_bar_address(0, 1 << 32).is_err(),
            "32-bit BAR above 4 GiB"
        );
        // Odd values are masked to the BAR's alignment.
        c.write(BAR0, &0xdead_beefu32.to_le_bytes());
        assert_eq!(c.bar_address(0), Some(0xdead_b000));
    }

    #[test]
    fn bad_bars_are_refused() {
        let mut c = ConfigSpace::new(ids());
        let m32 = BarKind::Mmio32 {
            prefetchable: false,
        };
        let m64 = BarKind::Mmio64 {
            prefetchable: false,
        };
        assert!(c
            .add_bar(
                6,
                Bar {
                    kind: m32,
                    size: 16
                }
            )
            .is_err());
        assert!(c
            .add_bar(
                5,
                Bar {
                    kind: m64,
                    size: 16
                }
            )
            .is_err());
        assert!(c
            .add_bar(
                0,
                Bar {
                    kind: m32,
                    size: 24
                }
            )
            .is_err());
        assert!(c.add_bar(0, Bar { kind: m32, size: 8 }).is_err());
        c.add_bar(
            0,
            Bar {
                kind: m64,
                size: 16,
            },
        )
        .unwrap();
        assert!(c
            .add_bar(
                1,
                Bar {
                    kind: m32,
                    size: 16
                }
            )
            .is_err());
        assert!(c
            .add_bar(
                0,
                Bar {
                    kind: m32,
                    size: 16
                }
            )
            .is_err());
    }

    #[test]
    fn capability_chain_walk() {
        let mut c = ConfigSpace::new(ids());
        assert_eq!(c.u16_at(STATUS) & STATUS_CAP_LIST, 0);
        let a = c
            .add_capability(
                CAP_ID_VENDOR,
                &[14, 1, 4, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
                &[],
            )
            .unwrap();
        let b = c
            .add_capability(CAP_ID_MSIX, &[0; 10], &[0, 0xc0, 0, 0, 0, 0, 0, 0, 0, 0])
            .unwrap();
        assert_eq!(a, 0x40);
        assert_eq!(b, 0x50);
        assert_ne!(c.u16_at(STATUS) & STATUS_CAP_LIST, 0);
        assert_eq!(
            c.capabilities(),
            vec![(0x40, CAP_ID_VENDOR), (0x50, CAP_ID_MSIX)]
        );
        // The cap's ID and next pointer are read-only; only masked bits change.
        c.write(b, &[0xff; 4]);
        assert_eq!(c.u32_at(b), 0xc000_0000 | CAP_ID_MSIX as u32);
        assert!(c.add_capability(9, &[0; 200], &[]).is_err());
    }
}
