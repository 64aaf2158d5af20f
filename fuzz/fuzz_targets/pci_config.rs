//! PCI configuration space and MSI-X table writes, as a guest makes them: ports 0xCF8/0xCFC, ECAM
//! and BAR accesses on the VMM's buses, through the real root complex to two functions with every
//! BAR kind and an MSI-X capability whose table and PBA sit in BAR 1.
//!
//! Checked after the accesses: IDs and other read-only registers keep their values, the
//! capability list is intact, every decoded BAR is aligned and inside its window, and the MSI-X
//! table reads back what the guest's well-formed writes put there (a shadow model).
#![no_main]

use std::sync::{Arc, Mutex};

use libfuzzer_sys::fuzz_target;
use lucid_fuzz::{Access, Pci};
use lucid_pci::config::{CAP_ID_MSIX, CAP_ID_VENDOR, NUM_BARS};
use lucid_pci::msix::{self, MsixTable, MSIX_ENTRY_SIZE};
use lucid_pci::{Bar, BarKind, ConfigSpace, PciDevice, PciIds, PciWindows};
use lucid_stats::StatsRegistry;

const MMIO: std::ops::Range<u64> = 0xc000_0000..0xc100_0000;
const IO: std::ops::Range<u64> = 0xc000..0x1_0000;
const ECAM: (u64, u64) = (0xe000_0000, 0x20_0000);
const VECTORS: u16 = 8;
const MSIX_BAR: usize = 1;
const PBA: u64 = 0x800;

/// A function with an I/O BAR, the MSI-X BAR, a 64-bit BAR and a small prefetchable one.
struct Dev {
    cfg: ConfigSpace,
    ids: PciIds,
    caps: Vec<(usize, u8)>,
    msix_cap: usize,
    msix: MsixTable,
    /// What the guest's well-formed table writes put in each entry's four dwords.
    shadow: Vec<[u32; 4]>,
    regs: [u8; 64],
}

impl Dev {
    fn new(device: u16) -> Dev {
        let ids = PciIds {
            vendor: 0x1af4,
            device,
            revision: 1,
            class: (0xff, 0, 0),
            subsystem_vendor: 0x1af4,
            subsystem: 0x1100,
        };
        let mut cfg = ConfigSpace::new(ids);
        let bars = [
            (0, BarKind::Io, 32),
            (
                MSIX_BAR,
                BarKind::Mmio32 {
                    prefetchable: false,
                },
                0x1000,
            ),
            (
                2,
                BarKind::Mmio64 {
                    prefetchable: false,
                },
                0x4000,
            ),
            (4, BarKind::Mmio64 { prefetchable: true }, 1 << 20),
        ];
        for (i, kind, size) in bars {
            cfg.add_bar(i, Bar { kind, size }).expect("valid BAR");
        }
        let mut wmask = [0u8; 14];
        wmask[4..8].fill(0xff);
        cfg.add_capability(
            CAP_ID_VENDOR,
            &[16, 1, 4, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
            &wmask,
        )
        .expect("room");
        let msix_cap =
            msix::add_capability(&mut cfg, VECTORS, MSIX_BAR as u8, 0, PBA as u32).expect("room");
        let caps = cfg.capabilities();
        assert_eq!(caps[1], (msix_cap, CAP_ID_MSIX));
        let shadow = vec![[0, 0, 0, 1]; VECTORS as usize];
        Dev {
            cfg,
            ids,
            caps,
            msix_cap,
            msix: MsixTable::new(VECTORS),
            shadow,
            regs: [0; 64],
        }
    }

    fn check(&self) {
        let c = &self.cfg;
        assert_eq!(c.u16_at(0), self.ids.vendor);
        assert_eq!(c.u16_at(2), self.ids.device);
        assert_eq!(c.u8_at(0x3d), 0, "interrupt pin is read-only");
        assert_eq!(c.capabilities(), self.caps);
        assert_eq!(c.u16_at(self.msix_cap + 2) & 0x3fff, VECTORS - 1);
        for (v, want) in self.shadow.iter().enumerate() {
            for (f, want) in want.iter().enumerate() {
                let mut d = [0u8; 4];
                self.msix
                    .read_table(v as u64 * MSIX_ENTRY_SIZE + f as u64 * 4, &mut d);
                assert_eq!(u32::from_le_bytes(d), *want, "vector {v} dword {f}");
            }
        }
    }
}

impl PciDevice for Dev {
    fn config(&self) -> &ConfigSpace {
        &self.cfg
    }
    fn config_mut(&mut self) -> &mut ConfigSpace {
        &mut self.cfg
    }
    fn config_written(&mut self, offset: usize, len: usize) {
        if lucid_pci::config::touches(offset, len, self.msix_cap + 2, 2) {
            self.msix.set_control(self.cfg.u16_at(self.msix_cap + 2));
        }
    }
    fn bar_read(&mut self, bar: usize, offset: u64, data: &mut [u8]) {
        match bar {
            MSIX_BAR if offset < PBA => self.msix.read_table(offset, data),
            MSIX_BAR => self.msix.read_pba(offset - PBA, data),
            _ => {
                for (i, b) in data.iter_mut().enumerate() {
                    *b = self.regs[(offset as usize + i) % self.regs.len()];
                }
            }
        }
    }
    fn bar_write(&mut self, bar: usize, offset: u64, data: &[u8]) {
        match bar {
            MSIX_BAR if offset < PBA => {
                let len = data.len() as u64;
                let v = (offset / MSIX_ENTRY_SIZE) as usize;
                if (len == 4 || len == 8) && offset % len == 0 && v < self.shadow.len() {
                    for (k, w) in data.chunks(4).enumerate() {
                        let f = (offset % MSIX_ENTRY_SIZE / 4) as usize + k;
                        let w = u32::from_le_bytes(w.try_into().expect("4 bytes"));
                        self.shadow[v][f] = if f == 3 { w & 1 } else { w };
                    }
                }
                self.msix.write_table(offset, data);
            }
            MSIX_BAR => {}
            _ => {
                for (i, b) in data.iter().enumerate() {
                    self.regs[(offset as usize + i) % 64] = *b;
                }
            }
        }
    }
    fn bar_mapped(&mut self, bar: usize, base: Option<u64>) {
        let Some(base) = base else { return };
        let b = self.cfg.bar(bar).expect("a mapped BAR exists");
        assert_eq!(base % b.size, 0, "BAR {bar} at {base:#x} is not aligned");
        let window = if b.kind.is_io() { IO } else { MMIO };
        assert!(
            window.start <= base && base + b.size <= window.end,
            "BAR {bar} at {base:#x}"
        );
        assert_eq!(self.cfg.bar_address(bar), Some(base));
    }
}

// Accesses (see [`lucid_fuzz::Access`]) by `kind % 4`: 0, a dword write of the 0xCF8 address
// register (`val`); 1, an access to port 0xCF8 + `sel % 8`; 2, an ECAM access at `addr` into
// the window; 3, an access at `addr % 2 MiB` from where BAR `sel % 6` of device `sel >> 8 & 1`
// decodes now (from the window's start when it decodes nowhere).
fuzz_target!(|data: &[u8]| {
    let stats = StatsRegistry::new();
    let windows = PciWindows {
        mmio: MMIO,
        io: IO,
        ecam: ECAM,
    };
    let pci = Pci::new(windows, &stats);
    let devs = [
        Arc::new(Mutex::new(Dev::new(0x10f0))),
        Arc::new(Mutex::new(Dev::new(0x10f1))),
    ];
    for (i, d) in devs.iter().enumerate() {
        pci.root
            .add_device(&format!("dev{i}"), d.clone())
            .expect("room for two functions");
    }
    for a in Access::parse(data, 128) {
        match a.kind % 4 {
            k @ 0..=2 => pci.config_cycle(k, &a),
            _ => {
                let (i, bar) = ((a.sel >> 8) as usize & 1, a.sel as usize % NUM_BARS);
                let slot = i as u8 + 1;
                let mapped = pci
                    .root
                    .devices()
                    .into_iter()
                    .find(|(p, _, _)| p.slot == slot);
                let io = devs[i]
                    .lock()
                    .unwrap()
                    .cfg
                    .bar(bar)
                    .is_some_and(|b| b.kind.is_io());
                let base = mapped.and_then(|(_, _, m)| m[bar]).unwrap_or(if io {
                    IO.start
                } else {
                    MMIO.start
                });
                let bus = if io { &pci.pio } else { &pci.mmio };
                a.on(bus, base + (a.addr as u64 % (2 << 20)))
            }
        }
    }
    for d in &devs {
        d.lock().unwrap().check();
    }
});
