//! MSI-X of a vfio-user device. Lucid owns the capability's body (message control, table and
//! PBA locations) and emulates the table and the PBA with [`MsixTable`]; the server only gets
//! one eventfd per vector (`SET_IRQS` index 2), which KVM delivers as an irqfd.
//!
//! KVM cannot mask an irqfd, so a vector that is masked (its own bit, the function mask, or
//! MSI-X disabled) has its irqfd detached from KVM: the server's signals then accumulate in the
//! eventfd, which is the vector's pending bit (a PBA read looks at it). Unmasking routes the GSI
//! to the vector's message and attaches the irqfd again; KVM injects at once when the eventfd
//! is already signalled, so a pending interrupt is delivered on unmask, as PCI wants.

use std::ops::Range;

use lucid_hv::{GsiRouter, Vm};
use lucid_pci::msix::{MsixTable, MSIX_ENTRY_SIZE};
use vmm_sys_util::eventfd::EventFd;

use super::{eventfd, le, Counters, UserDeviceError};
use lucid_pci::config::{LEGACY_CONFIG_SIZE, NUM_BARS};

/// The most vectors an MSI-X table can have (11-bit table size).
pub const MAX_VECTORS: u32 = 2048;
/// Capability: id, next, message control, table offset/BIR, PBA offset/BIR.
const CAP_LEN: usize = 12;

/// Where the device's MSI-X capability, table and PBA are.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    pub cap: usize,
    pub vectors: u16,
    pub table_bar: usize,
    pub table: Range<u64>,
    pub pba_bar: usize,
    pub pba: Range<u64>,
}

/// A BAR access Lucid serves itself: the offset into the table or the PBA.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Part {
    Table(u64),
    Pba(u64),
}

impl Layout {
    /// Reads the capability at `cap` of config space `b` and checks it against the device's
    /// memory BARs (`mem_bars[i]`: BAR i's size when it is a memory BAR) and the number of
    /// MSI-X interrupts the server offers.
    pub fn parse(
        b: &[u8],
        cap: usize,
        mem_bars: &[Option<u64>; NUM_BARS],
        server_vectors: u32,
    ) -> Result<Layout, UserDeviceError> {
        let bad = |problem: String| UserDeviceError::Msix { cap, problem };
        if cap < 0x40 || cap & 3 != 0 || cap + CAP_LEN > LEGACY_CONFIG_SIZE {
            return Err(bad("the capability is not where a capability can be".into()));
        }
        let vectors = (le::<2>(b, cap + 2) as u16 & 0x7ff) + 1;
        if server_vectors == 0 {
            return Err(bad(
                "the server offers no MSI-X interrupts (IRQ index 2 has count 0)".into(),
            ));
        }
        if server_vectors > MAX_VECTORS {
            return Err(bad(format!(
                "the server offers {server_vectors} MSI-X vectors, over the limit of {MAX_VECTORS}"
            )));
        }
        if server_vectors < u32::from(vectors) {
            return Err(bad(format!(
                "the table has {vectors} vectors but the server offers only {server_vectors}"
            )));
        }
        let place = |what: &str, reg: usize, len: u64| {
            let v = le::<4>(b, reg) as u32;
            let bar = (v & 7) as usize;
            let start = u64::from(v & !7);
            let Some(size) = mem_bars.get(bar).copied().flatten() else {
                return Err(bad(format!(
                    "the {what} is in BAR {bar}, which is not a memory BAR of the device"
                )));
            };
            if start + len > size {
                return Err(bad(format!(
                    "the {what} ({start:#x}+{len:#x}) is outside BAR {bar} ({size:#x} bytes)"
                )));
            }
            Ok((bar, start..start + len))
        };
        let n = u64::from(vectors);
        let (table_bar, table) = place("table", cap + 4, n * MSIX_ENTRY_SIZE)?;
        let (pba_bar, pba) = place("PBA", cap + 8, n.div_ceil(64) * 8)?;
        if table_bar == pba_bar && table.start < pba.end && pba.start < table.end {
            return Err(bad("the table and the PBA overlap".into()));
        }
        Ok(Layout {
            cap,
            vectors,
            table_bar,
            table,
            pba_bar,
            pba,
        })
    }

    /// The config-space bytes Lucid keeps: the capability's body.
    pub fn body(&self) -> Range<usize> {
        self.cap + 2..self.cap + CAP_LEN
    }

    /// Whether an access at `offset` of BAR `bar` is the table's or the PBA's.
    pub fn part(&self, bar: usize, offset: u64) -> Option<Part> {
        if bar == self.table_bar && self.table.contains(&offset) {
            Some(Part::Table(offset - self.table.start))
        } else if bar == self.pba_bar && self.pba.contains(&offset) {
            Some(Part::Pba(offset - self.pba.start))
        } else {
            None
        }
    }
}

struct Vector {
    gsi: u32,
    efd: EventFd,
    /// Whether KVM listens on the eventfd (the vector is deliverable).
    attached: bool,
}

/// A device's MSI-X state and its vectors' GSIs and eventfds.
pub struct Msix {
    pub layout: Layout,
    table: MsixTable,
    vectors: Vec<Vector>,
}

impl Msix {
    /// A GSI and an eventfd per vector; no irqfd until the guest unmasks a vector.
    pub fn new(layout: Layout, router: &GsiRouter) -> Result<Self, UserDeviceError> {
        let mut m = Msix {
            table: MsixTable::new(layout.vectors),
            layout,
            vectors: Vec::new(),
        };
        for _ in 0..m.layout.vectors {
            let gsi = match router.allocate() {
                Ok(g) => g,
                Err(e) => {
                    m.release(None, router);
                    return Err(e.into());
                }
            };
            let efd = match eventfd() {
                Ok(e) => e,
                Err(e) => {
                    let _ = router.release(gsi);
                    m.release(None, router);
                    return Err(e);
                }
            };
            m.vectors.push(Vector {
                gsi,
                efd,
                attached: false,
            });
        }
        Ok(m)
    }

    /// The eventfds the server signals, vector by vector.
    pub fn fds(&self) -> Vec<std::os::fd::RawFd> {
        use std::os::fd::AsRawFd;
        self.vectors.iter().map(|v| v.efd.as_raw_fd()).collect()
    }

    pub fn enabled(&self) -> bool {
        self.table.enabled()
    }

    pub fn read(&mut self, part: Part, data: &mut [u8]) {
        match part {
            Part::Table(off) => self.table.read_table(off, data),
            Part::Pba(off) => {
                // A detached vector's eventfd holds its pending signal.
                for (i, v) in self.vectors.iter().enumerate() {
                    let pending = !v.attached && peek(&v.efd);
                    self.table.set_pending(i as u16, pending);
                }
                self.table.read_pba(off, data)
            }
        }
    }

    /// A guest write to the table (the PBA is read-only); re-syncs the vector it changed.
    pub fn write(&mut self, part: Part, data: &[u8], ctx: &Ctx<'_>) {
        if let Part::Table(off) = part {
            if let Some(ch) = self.table.write_table(off, data) {
                self.sync(ch.vector, ctx);
            }
        }
    }

    /// The guest wrote message control; returns whether MSI-X enable changed.
    pub fn control(&mut self, ctrl: u16, ctx: &Ctx<'_>) -> bool {
        let was = self.table.enabled();
        self.table.set_control(ctrl);
        for v in 0..self.table.len() {
            self.sync(v, ctx);
        }
        was != self.table.enabled()
    }

    /// Makes KVM follow vector `v`: routed and attached while deliverable, detached otherwise.
    fn sync(&mut self, v: u16, ctx: &Ctx<'_>) {
        let deliverable = self.table.enabled() && !self.table.is_masked(v);
        let Some(vec) = self.vectors.get_mut(v as usize) else {
            return;
        };
        if deliverable {
            let msg = self.table.entry(v).expect("in range").msg;
            if let Err(e) = ctx.router.set_msi(vec.gsi, ctx.rid, msg) {
                ctx.c.errors.inc();
                log::warn!("{}: MSI-X vector {v} route: {e}", ctx.name);
            }
            ctx.c.msix_routes.inc();
            if !vec.attached {
                match ctx.vm.register_irqfd(&vec.efd, vec.gsi) {
                    Ok(()) => vec.attached = true,
                    Err(e) => {
                        ctx.c.errors.inc();
                        log::warn!("{}: MSI-X vector {v} irqfd: {e}", ctx.name);
                    }
                }
            }
        } else if vec.attached {
            ctx.c.msix_masks.inc();
            if ctx.vm.unregister_irqfd(&vec.efd, vec.gsi).is_err() {
                ctx.c.errors.inc();
            }
            vec.attached = false;
        }
    }

    /// Detaches the irqfds and frees the GSIs (idempotent).
    pub fn release(&mut self, vm: Option<&Vm>, router: &GsiRouter) {
        for v in self.vectors.drain(..) {
            if let (true, Some(vm)) = (v.attached, vm) {
                let _ = vm.unregister_irqfd(&v.efd, v.gsi);
            }
            let _ = router.release(v.gsi);
        }
    }
}

/// What a route change needs from the device.
pub struct Ctx<'a> {
    pub name: &'a str,
    pub vm: &'a Vm,
    pub router: &'a GsiRouter,
    pub rid: u16,
    pub c: &'a Counters,
}

/// Whether the eventfd is signalled, leaving its count as it was.
fn peek(efd: &EventFd) -> bool {
    match efd.read() {
        Ok(n) => {
            let _ = efd.write(n);
            true
        }
        Err(_) => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A config space with an MSI-X capability at 0x40: `vectors`, table and PBA registers.
    fn cfg(vectors: u16, table: u32, pba: u32) -> Vec<u8> {
        let mut b = vec![0u8; 256];
        b[0x40] = 0x11;
        b[0x42..0x44].copy_from_slice(&(vectors - 1).to_le_bytes());
        b[0x44..0x48].copy_from_slice(&table.to_le_bytes());
        b[0x48..0x4c].copy_from_slice(&pba.to_le_bytes());
        b
    }

    const BARS: [Option<u64>; NUM_BARS] = [Some(0x4000), None, Some(0x1000), None, None, None];

    fn refused(b: &[u8], server: u32, why: &str) {
        let e = Layout::parse(b, 0x40, &BARS, server)
            .unwrap_err()
            .to_string();
        assert!(e.contains(why), "{e:?} should say {why:?}");
    }

    #[test]
    fn a_sane_layout_is_read_and_its_accesses_intercepted() {
        let l = Layout::parse(&cfg(3, 0x2000, 0x3000), 0x40, &BARS, 3).unwrap();
        assert_eq!((l.vectors, l.table_bar, l.pba_bar), (3, 0, 0));
        assert_eq!(
            (l.table.clone(), l.pba.clone()),
            (0x2000..0x2030, 0x3000..0x3008)
        );
        assert_eq!(l.body(), 0x42..0x4c);
        assert_eq!(l.part(0, 0x2000), Some(Part::Table(0)));
        assert_eq!(l.part(0, 0x202c), Some(Part::Table(0x2c)));
        assert_eq!(l.part(0, 0x3004), Some(Part::Pba(4)));
        for (bar, off) in [(0, 0x1fff), (0, 0x2030), (0, 0x3008), (0, 0), (2, 0x2000)] {
            assert_eq!(l.part(bar, off), None, "BAR {bar} {off:#x} is the device's");
        }
        // Table and PBA in different BARs.
        let l = Layout::parse(&cfg(64, 0x0, 0x2 | 0x800), 0x40, &BARS, 64).unwrap();
        assert_eq!(l.part(2, 0x800), Some(Part::Pba(0)));
        assert_eq!(l.part(0, 0x3f0), Some(Part::Table(0x3f0)));
        assert_eq!(l.part(0, 0x400), None);
    }

    #[test]
    fn bad_geometry_is_refused() {
        refused(
            &cfg(4, 0x3, 0x0),
            4,
            "table is in BAR 3, which is not a memory BAR",
        );
        refused(&cfg(4, 0x7, 0x0), 4, "BAR 7");
        refused(&cfg(4, 0x0, 0x1 | 0x800), 4, "PBA is in BAR 1");
        refused(
            &cfg(4, 0x3ff8, 0x0),
            4,
            "table (0x3ff8+0x40) is outside BAR 0",
        );
        refused(
            &cfg(4, 0x0, 0x2 | 0x1000),
            4,
            "PBA (0x1000+0x8) is outside BAR 2",
        );
        refused(&cfg(2048, 0x0, 0x7ff8), 2048, "outside BAR 0");
        refused(&cfg(4, 0x0, 0x20), 4, "overlap");
        refused(
            &cfg(4, 0x0, 0x800),
            4096,
            "4096 MSI-X vectors, over the limit of 2048",
        );
        refused(
            &cfg(4, 0x0, 0x800),
            2,
            "the table has 4 vectors but the server offers only 2",
        );
        refused(&cfg(4, 0x0, 0x800), 0, "no MSI-X interrupts");
        let e = Layout::parse(&cfg(4, 0, 0x800), 0xfc, &BARS, 4).unwrap_err();
        assert!(e.to_string().contains("not where a capability can be"));
    }

    #[test]
    fn vectors_follow_enable_and_masks_and_a_masked_signal_is_pending() {
        use lucid_hv::MsiMessage;
        use lucid_pci::msix::{MSIX_ENABLE, MSIX_FUNCTION_MASK};
        let vm = Vm::new(lucid_hv::open_kvm().expect("KVM")).unwrap();
        vm.create_irqchip_and_pit().unwrap();
        let router = GsiRouter::new(vm.clone());
        let stats = lucid_stats::StatsRegistry::new();
        let c = super::super::counters("t", &stats);
        let ctx = Ctx {
            name: "t",
            vm: &vm,
            router: &router,
            rid: 0x08,
            c: &c,
        };
        let l = Layout::parse(&cfg(2, 0x0, 0x800), 0x40, &BARS, 2).unwrap();
        let mut m = Msix::new(l, &router).unwrap();
        let msg = MsiMessage {
            address: 0xfee0_0000,
            data: 0x41,
        };
        let w = |m: &mut Msix, off: u64, v: u32| m.write(Part::Table(off), &v.to_le_bytes(), &ctx);
        w(&mut m, 0, msg.address as u32);
        w(&mut m, 8, msg.data);
        w(&mut m, 12, 0);
        assert!(!m.vectors[0].attached, "MSI-X still disabled");
        assert!(m.control(MSIX_ENABLE, &ctx), "enable changed");
        let gsi = m.vectors[0].gsi;
        assert_eq!(router.route(gsi), Some(msg));
        assert!(
            m.vectors[0].attached && !m.vectors[1].attached,
            "vector 1 is masked"
        );
        assert!(!m.control(MSIX_ENABLE | MSIX_FUNCTION_MASK, &ctx));
        assert!(!m.vectors[0].attached, "the function mask detaches");
        m.control(MSIX_ENABLE, &ctx);
        w(&mut m, 12, 1);
        assert!(!m.vectors[0].attached, "the entry mask detaches");
        // The server signals the masked vector: pending, and still so after the read.
        m.vectors[0].efd.write(1).unwrap();
        for _ in 0..2 {
            let mut pba = [0u8; 8];
            m.read(Part::Pba(0), &mut pba);
            assert_eq!(u64::from_le_bytes(pba), 1);
        }
        w(&mut m, 12, 0);
        assert!(
            m.vectors[0].attached,
            "unmasked: KVM takes the pending signal"
        );
        let mut pba = [0u8; 8];
        m.read(Part::Pba(0), &mut pba);
        assert_eq!(u64::from_le_bytes(pba), 0);
        assert!(m.control(0, &ctx), "disable changed");
        assert!(!m.vectors[0].attached);
        assert_eq!(c.msix_masks.get(), 3);
        m.release(Some(&vm), &router);
        assert!(m.vectors.is_empty());
    }

    #[test]
    fn a_pending_signal_stays_in_the_eventfd() {
        let efd = eventfd().unwrap();
        assert!(!peek(&efd));
        efd.write(2).unwrap();
        assert!(peek(&efd) && peek(&efd), "peeking keeps it");
        assert_eq!(efd.read().unwrap(), 2);
    }
}
