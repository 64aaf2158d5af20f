//! The emulated Intel VT-d (`lucid_iommu::Vtd`, samecore) driven by a guest: register accesses
//! anywhere in its two-page window, DMA translations and MSI remaps from any requester, and guest
//! memory writes, against a real 4 MiB guest RAM whose first bytes come from the input, so the
//! root, context and page tables, the invalidation queue and the IRTEs are all guest-chosen.
//!
//! Checked: a successful translation with translation on lies in guest RAM, with 1 to the asked
//! bytes; with translation off it is the identity; a remapped MSI is in compatibility format
//! (an unchanged one was not for the unit to remap); the pinner is never asked to unpin a page it
//! did not pin, to pin one it holds, or to unpin one a still-open access bracket translated to.
#![no_main]

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex};

use libfuzzer_sys::fuzz_target;
use lucid_fuzz::{Access, RECORD};
use lucid_hv::{MsiMessage, MsiRemapper};
use lucid_iommu::{EmulationMode, MsiSink, PinPolicy, Pinner, Vtd, VtdConfig, VTD_SIZE};
use lucid_mem::{Access as Dir, Backing, DmaTranslator, GuestRam};
use lucid_stats::StatsRegistry;
use vm_memory::{Bytes, GuestAddress};

const RAM: u64 = 4 << 20;
const GSTS: u64 = 0x1c;
const GSTS_TES: u32 = 1 << 31;
const GSTS_IRES: u32 = 1 << 25;
const GSTS_CFIS: u32 = 1 << 23;

struct Sink;
impl MsiSink for Sink {
    fn send(&self, _address: u64, _data: u32) {}
}

/// Holds what it pinned; asserts the unit's pin book never unpins what it does not hold, nor a
/// page that an open access bracket translated to.
#[derive(Default)]
struct CheckPinner {
    pages: Mutex<HashSet<u64>>,
    /// Guest pages reached by translations inside brackets that are still open.
    inflight: Mutex<HashMap<u64, u32>>,
}

impl Pinner for CheckPinner {
    fn pin(&self, gpa: u64, len: u64) -> bool {
        // As the mlock pinner: nothing outside guest RAM can be pinned.
        if gpa.checked_add(len).is_none_or(|end| end > RAM) {
            return false;
        }
        if len == 4096 {
            assert!(
                self.pages.lock().unwrap().insert(gpa),
                "pinned {gpa:#x} twice"
            );
        }
        true
    }
    fn unpin(&self, gpa: u64, len: u64) {
        assert_eq!(len, 4096, "only per-page pins are undone");
        assert!(
            self.pages.lock().unwrap().remove(&gpa),
            "unpin of {gpa:#x}, which is not pinned"
        );
        assert_eq!(
            self.inflight.lock().unwrap().get(&gpa),
            None,
            "unpin of {gpa:#x} while an access that translated to it is open"
        );
    }
}

/// An open access bracket: its token and the guest pages its translations reached.
struct Bracket {
    token: u64,
    pages: Vec<u64>,
}

fn close(vtd: &Vtd, pins: &CheckPinner, b: Bracket) {
    {
        let mut f = pins.inflight.lock().unwrap();
        for p in b.pages {
            let n = f.get_mut(&p).expect("counted");
            *n -= 1;
            if *n == 0 {
                f.remove(&p);
            }
        }
    }
    vtd.access_end(b.token);
}

fn gsts(vtd: &Vtd) -> u32 {
    let mut b = [0u8; 4];
    vtd.read(GSTS, &mut b);
    u32::from_le_bytes(b)
}

// Input: a header record (pin policy = `kind % 3`: Map, Deferred, All; `sel` bytes follow it and
// are copied to guest RAM at 0), then records (see [`lucid_fuzz::Access`]) by `kind % 5`:
// 0, a register access (`size` bytes, write when `write`) at `addr % (VTD_SIZE + 16)`;
// 1, a translation for requester `sel` of IOVA `val`, `addr & 0x3fff` bytes, a write when
// `write`, in a bracket left open when `size` >= 4; 2, a remap of the MSI from `sel` with data
// `addr` at address `val` (bits 19:0 of it under 0xfee0_0000 unless `val` bit 63); 3, `size`
// bytes of `val` written to guest RAM at `addr % RAM`; 4, the oldest open bracket ends (all of
// them when `sel` is odd).
fuzz_target!(|data: &[u8]| {
    if data.len() < RECORD {
        return;
    }
    let head = Access::parse(&data[..RECORD], 1).next().expect("a header");
    let pin = [PinPolicy::Map, PinPolicy::Deferred, PinPolicy::All][usize::from(head.kind % 3)];
    let rest = &data[RECORD..];
    let n = usize::from(head.sel).min(rest.len());
    let (prefix, records) = rest.split_at(n);

    let ram = GuestRam::new(&[(0, RAM)], Backing::Anonymous).expect("guest RAM");
    let mem = ram.memory().clone();
    mem.write_slice(prefix, GuestAddress(0))
        .expect("prefix in RAM");
    let pins = Arc::new(CheckPinner::default());
    let stats = StatsRegistry::new();
    let cfg = VtdConfig {
        mode: EmulationMode::Samecore,
        pin,
    };
    let vtd = Vtd::new(cfg, mem.clone(), Arc::new(Sink), pins.clone(), &stats);
    let mut open: VecDeque<Bracket> = VecDeque::new();

    for a in Access::parse(records, 512) {
        match a.kind % 5 {
            0 => {
                let off = u64::from(a.addr) % (VTD_SIZE + 16);
                let mut b = a.val.to_le_bytes();
                if a.write {
                    vtd.write(off, &b[..a.size]);
                } else {
                    vtd.read(off, &mut b[..a.size]);
                }
            }
            1 => {
                let (iova, len) = (a.val, u64::from(a.addr & 0x3fff));
                let dir = if a.write { Dir::Write } else { Dir::Read };
                let te = gsts(&vtd) & GSTS_TES != 0;
                let token = vtd.access_begin();
                let r = vtd.translate(u32::from(a.sel), iova, len, dir);
                let mut b = Bracket {
                    token,
                    pages: Vec::new(),
                };
                if let Ok((gpa, got)) = r {
                    if te {
                        assert!(
                            (1..=len.max(1)).contains(&got),
                            "{got:#x} bytes for {len:#x}"
                        );
                        assert!(
                            gpa.checked_add(got).is_some_and(|end| end <= RAM),
                            "iova {iova:#x} -> {gpa:#x}+{got:#x}, outside guest RAM"
                        );
                        assert_eq!(gpa >> 12, (gpa + got - 1) >> 12, "one page at most");
                        b.pages.push(gpa & !0xfff);
                        *pins
                            .inflight
                            .lock()
                            .unwrap()
                            .entry(gpa & !0xfff)
                            .or_default() += 1;
                    } else {
                        assert_eq!((gpa, got), (iova, len.max(1)), "untranslated");
                    }
                }
                if a.size >= 4 && open.len() < 64 {
                    open.push_back(b);
                } else {
                    close(&vtd, &pins, b);
                }
            }
            2 => {
                let address = if a.val >> 63 != 0 {
                    a.val & !(1 << 63)
                } else {
                    0xfee0_0000 | (a.val & 0xf_ffff)
                };
                let msg = MsiMessage {
                    address,
                    data: a.addr,
                };
                let g = gsts(&vtd);
                if let Some(m) = vtd.remap(a.sel, msg) {
                    let interrupt = address >> 32 == 0 && (address >> 20) & 0xfff == 0xfee;
                    let passes = g & GSTS_IRES == 0
                        || !interrupt
                        || (address & 0x10 == 0 && g & GSTS_CFIS != 0);
                    if passes {
                        assert_eq!(m, msg, "passed through unchanged");
                    } else {
                        assert_eq!(m.address >> 20, 0xfee, "{m:x?}");
                        assert_eq!(m.address & 0x10, 0, "compatibility format: {m:x?}");
                        assert_eq!(m.address & 0xff3, 0, "{m:x?}");
                        assert_eq!(m.data >> 16, 0, "{m:x?}");
                    }
                }
            }
            3 => {
                let gpa = u64::from(a.addr) % RAM;
                let b = a.val.to_le_bytes();
                let n = a.size.min((RAM - gpa) as usize);
                mem.write_slice(&b[..n], GuestAddress(gpa))
                    .expect("inside RAM");
            }
            _ => {
                let all = a.sel & 1 != 0;
                while let Some(b) = open.pop_front() {
                    close(&vtd, &pins, b);
                    if !all {
                        break;
                    }
                }
            }
        }
    }
    while let Some(b) = open.pop_front() {
        close(&vtd, &pins, b);
    }
    drop(vtd);
    drop(ram);
});
