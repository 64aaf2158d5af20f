//! MSI-X: the capability, the vector table and the pending-bit array (PBA), and delivery to KVM.
//!
//! [`MsixTable`] is the guest-visible model (per-vector mask, function mask, enable, pending
//! bits). [`Interrupts`] wraps it with the delivery path of the device's rung: `KVM_SIGNAL_MSI`
//! from userspace (L0), or one GSI + irqfd per vector whose route follows the vector's
//! address/data (L1+). With MSI-X disabled, interrupts go out as INTx on an IOAPIC pin by irqfd.

use std::sync::atomic::{AtomicU16, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};

use lucid_hv::{GsiRouter, MsiMessage, Vm};
use lucid_stats::{Counter, StatsRegistry};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::config::{ConfigSpace, CAP_ID_MSIX};
use crate::PciError;

pub const MSIX_ENTRY_SIZE: u64 = 16;
/// Message control: enable, function mask.
pub const MSIX_ENABLE: u16 = 1 << 15;
pub const MSIX_FUNCTION_MASK: u16 = 1 << 14;
const VECTOR_CTRL_MASK: u32 = 1;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MsixEntry {
    pub msg: MsiMessage,
    pub masked: bool,
}

impl Default for MsixEntry {
    fn default() -> Self {
        // Every vector comes out of reset masked.
        MsixEntry {
            msg: MsiMessage::default(),
            masked: true,
        }
    }
}

/// What a table write changed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EntryChange {
    pub vector: u16,
    pub msg_changed: bool,
    pub unmasked: bool,
}

/// The guest-visible MSI-X state.
#[derive(Clone, Debug)]
pub struct MsixTable {
    entries: Vec<MsixEntry>,
    pba: Vec<u64>,
    enabled: bool,
    function_masked: bool,
}

impl MsixTable {
    pub fn new(vectors: u16) -> Self {
        MsixTable {
            entries: vec![MsixEntry::default(); vectors as usize],
            pba: vec![0; (vectors as usize).div_ceil(64)],
            enabled: false,
            function_masked: false,
        }
    }

    pub fn len(&self) -> u16 {
        self.entries.len() as u16
    }
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
    pub fn enabled(&self) -> bool {
        self.enabled
    }
    pub fn function_masked(&self) -> bool {
        self.function_masked
    }
    pub fn entry(&self, v: u16) -> Option<MsixEntry> {
        self.entries.get(v as usize).copied()
    }
    /// Masked by its own bit or the function mask.
    pub fn is_masked(&self, v: u16) -> bool {
        self.function_masked || self.entries.get(v as usize).is_none_or(|e| e.masked)
    }
    pub fn pending(&self, v: u16) -> bool {
        let v = v as usize;
        self.pba
            .get(v / 64)
            .is_some_and(|w| w & (1 << (v % 64)) != 0)
    }
    pub fn set_pending(&mut self, v: u16, on: bool) {
        let v = v as usize;
        if let Some(w) = self.pba.get_mut(v / 64) {
            if on {
                *w |= 1 << (v % 64);
            } else {
                *w &= !(1 << (v % 64));
            }
        }
    }

    /// Applies the capability's message control; returns whether vectors may have become
    /// deliverable (enabled and function unmasked now, not before).
    pub fn set_control(&mut self, ctrl: u16) -> bool {
        let before = self.enabled && !self.function_masked;
        self.enabled = ctrl & MSIX_ENABLE != 0;
        self.function_masked = ctrl & MSIX_FUNCTION_MASK != 0;
        !before && self.enabled && !self.function_masked
    }

    /// Back to reset state (all masked, nothing pending, disabled).
    pub fn reset(&mut self) {
        let n = self.len();
        *self = MsixTable::new(n);
    }

    fn dword(&self, v: usize, field: usize) -> u32 {
        let e = &self.entries[v];
        match field {
            0 => e.msg.address as u32,
            1 => (e.msg.address >> 32) as u32,
            2 => e.msg.data,
            _ => e.masked as u32,
        }
    }

    /// A guest read of the table at `offset` (any size up to 8; beyond the table reads 0).
    pub fn read_table(&self, offset: u64, data: &mut [u8]) {
        for (i, b) in data.iter_mut().enumerate() {
            let o = offset + i as u64;
            let v = (o / MSIX_ENTRY_SIZE) as usize;
            *b = if v < self.entries.len() {
                let field = ((o % MSIX_ENTRY_SIZE) / 4) as usize;
                (self.dword(v, field) >> ((o % 4) * 8)) as u8
            } else {
                0
            };
        }
    }

    /// A guest write to the table: dword or qword, naturally aligned, within one entry; other
    /// shapes are ignored (the spec lets a device do so). Returns what changed.
    pub fn write_table(&mut self, offset: u64, data: &[u8]) -> Option<EntryChange> {
        let len = data.len() as u64;
        if !(len == 4 || len == 8) || offset & (len - 1) != 0 {
            return None;
        }
        let v = (offset / MSIX_ENTRY_SIZE) as usize;
        if v >= self.entries.len() {
            return None;
        }
        let before = self.entries[v];
        for (k, chunk) in data.chunks(4).enumerate() {
            let field = ((offset % MSIX_ENTRY_SIZE) / 4) as usize + k;
            let val = u32::from_le_bytes([chunk[0], chunk[1], chunk[2], chunk[3]]);
            let e = &mut self.entries[v];
            match field {
                0 => e.msg.address = (e.msg.address & !0xffff_ffff) | val as u64,
                1 => e.msg.address = (e.msg.address & 0xffff_ffff) | (val as u64) << 32,
                2 => e.msg.data = val,
                3 => e.masked = val & VECTOR_CTRL_MASK != 0,
                _ => {}
            }
        }
        let after = self.entries[v];
        Some(EntryChange {
            vector: v as u16,
            msg_changed: before.msg != after.msg,
            unmasked: before.masked && !after.masked,
        })
    }

    /// A guest read of the PBA (read-only; writes are ignored).
    pub fn read_pba(&self, offset: u64, data: &mut [u8]) {
        for (i, b) in data.iter_mut().enumerate() {
            let o = offset as usize + i;
            *b = self
                .pba
                .get(o / 8)
                .map_or(0, |w| (w >> ((o % 8) * 8)) as u8);
        }
    }
}

/// Adds the MSI-X capability to `cfg`: `vectors` entries, table at `table_offset` and PBA at
/// `pba_offset` in BAR `bar`. Returns the capability offset (message control is at +2).
pub fn add_capability(
    cfg: &mut ConfigSpace,
    vectors: u16,
    bar: u8,
    table_offset: u32,
    pba_offset: u32,
) -> Result<usize, PciError> {
    if vectors == 0 || vectors > 2048 || table_offset & 7 != 0 || pba_offset & 7 != 0 {
        return Err(PciError::MsixLayout {
            vectors,
            table: table_offset,
            pba: pba_offset,
        });
    }
    let mut body = Vec::with_capacity(10);
    body.extend_from_slice(&(vectors - 1).to_le_bytes());
    body.extend_from_slice(&(table_offset | bar as u32).to_le_bytes());
    body.extend_from_slice(&(pba_offset | bar as u32).to_le_bytes());
    let mut wmask = vec![0u8; 10];
    wmask[1] = 0xc0;
    cfg.add_capability(CAP_ID_MSIX, &body, &wmask)
}

/// How MSI-X messages reach the guest.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MsiPath {
    /// `KVM_SIGNAL_MSI` from the signalling thread (L0).
    SignalMsi,
    /// One GSI + irqfd per vector, routed to the vector's message (L1 and up).
    Irqfd,
}

struct Counters {
    msi_signal: Arc<Counter>,
    irqfd: Arc<Counter>,
    irqfd_shared: Arc<Counter>,
    masked_pending: Arc<Counter>,
    intx: Arc<Counter>,
    errors: Arc<Counter>,
}

/// A device's interrupt state and delivery: MSI-X vectors, or INTx with the ISR byte.
pub struct Interrupts {
    table: Mutex<MsixTable>,
    vm: Vm,
    path: MsiPath,
    router: Option<Arc<GsiRouter>>,
    /// Per vector, for [`MsiPath::Irqfd`]: (GSI, its irqfd).
    irqfds: Vec<(u32, EventFd)>,
    /// INTx: an irqfd on an IOAPIC pin.
    intx: Option<(u32, EventFd)>,
    /// virtio ISR status bits (bit 0 queue, bit 1 config), cleared by the read.
    isr: AtomicU8,
    /// The function's requester ID, the source an interrupt remapper sees.
    source: AtomicU16,
    counters: Counters,
}

impl Interrupts {
    /// `vectors` MSI-X vectors delivered by `path` (with `router` for irqfd routes) and, when
    /// `intx_gsi` is given, INTx on that IOAPIC pin. Counters go under `<name>.irq.`.
    pub fn new(
        vm: Vm,
        vectors: u16,
        path: MsiPath,
        router: Option<Arc<GsiRouter>>,
        intx_gsi: Option<u32>,
        name: &str,
        stats: &StatsRegistry,
    ) -> Result<Arc<Self>, PciError> {
        let mut irqfds = Vec::new();
        if path == MsiPath::Irqfd {
            let router = router.as_ref().ok_or(PciError::NoGsiRouter)?;
            for _ in 0..vectors {
                let gsi = router.allocate()?;
                let efd = EventFd::new(EFD_NONBLOCK).map_err(PciError::EventFd)?;
                vm.register_irqfd(&efd, gsi)?;
                irqfds.push((gsi, efd));
            }
        }
        let intx = match intx_gsi {
            Some(gsi) => {
                let efd = EventFd::new(EFD_NONBLOCK).map_err(PciError::EventFd)?;
                vm.register_irqfd(&efd, gsi)?;
                Some((gsi, efd))
            }
            None => None,
        };
        let c = |n: &str| stats.counter(format!("{name}.irq.{n}"));
        Ok(Arc::new(Interrupts {
            table: Mutex::new(MsixTable::new(vectors)),
            vm,
            path,
            router,
            irqfds,
            intx,
            isr: AtomicU8::new(0),
            source: AtomicU16::new(0),
            counters: Counters {
                msi_signal: c("msi_signal"),
                irqfd: c("irqfd"),
                irqfd_shared: c("irqfd_shared"),
                masked_pending: c("masked_pending"),
                intx: c("intx"),
                errors: c("errors"),
            },
        }))
    }

    pub fn path(&self) -> MsiPath {
        self.path
    }

    /// The function's requester ID (bus << 8 | devfn), set when it is attached to the bus; the
    /// interrupt remapper keys its messages by it.
    pub fn set_requester_id(&self, rid: u16) {
        self.source.store(rid, Ordering::Relaxed);
    }

    pub fn requester_id(&self) -> u16 {
        self.source.load(Ordering::Relaxed)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, MsixTable> {
        self.table.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A copy of the guest-visible state (for tests and diagnostics).
    pub fn snapshot(&self) -> MsixTable {
        self.lock().clone()
    }

    /// How many vectors the table has.
    pub fn vectors(&self) -> u16 {
        self.lock().len()
    }

    pub fn msix_enabled(&self) -> bool {
        self.lock().enabled()
    }

    /// The GSI behind `vector` on the irqfd path.
    pub fn gsi(&self, vector: u16) -> Option<u32> {
        self.irqfds.get(vector as usize).map(|(g, _)| *g)
    }

    /// A copy of `vector`'s irqfd (irqfd path only), for a writer outside the VMM: KVM routes it
    /// to the vector's message, but does not hold it back while the vector is masked.
    pub fn irqfd(&self, vector: u16) -> Option<EventFd> {
        let (_, efd) = self.irqfds.get(vector as usize)?;
        let efd = efd.try_clone().ok()?;
        self.counters.irqfd_shared.inc();
        Some(efd)
    }

    /// Raises `vector`: delivered now, or left pending while masked.
    pub fn trigger(&self, vector: u16) {
        let mut t = self.lock();
        if vector >= t.len() {
            return;
        }
        if t.is_masked(vector) {
            t.set_pending(vector, true);
            self.counters.masked_pending.inc();
            return;
        }
        let msg = t.entry(vector).map(|e| e.msg).unwrap_or_default();
        drop(t);
        self.deliver(vector, msg);
    }

    fn deliver(&self, vector: u16, msg: MsiMessage) {
        match self.path {
            MsiPath::SignalMsi => {
                self.counters.msi_signal.inc();
                let sent = match &self.router {
                    Some(router) => router.signal_msi(self.requester_id(), msg),
                    None => self.vm.signal_msi(msg.address, msg.data),
                };
                if sent.is_err() {
                    self.counters.errors.inc();
                }
            }
            MsiPath::Irqfd => {
                self.counters.irqfd.inc();
                if let Some((_, efd)) = self.irqfds.get(vector as usize) {
                    if efd.write(1).is_err() {
                        self.counters.errors.inc();
                    }
                }
            }
        }
    }

    /// INTx: sets `isr_bits` and pulses the pin (when the command register allows INTx).
    pub fn trigger_intx(&self, isr_bits: u8, allowed: bool) {
        self.isr.fetch_or(isr_bits, Ordering::AcqRel);
        if !allowed {
            return;
        }
        if let Some((_, efd)) = &self.intx {
            self.counters.intx.inc();
            if efd.write(1).is_err() {
                self.counters.errors.inc();
            }
        }
    }

    pub fn set_isr(&self, bits: u8) {
        self.isr.fetch_or(bits, Ordering::AcqRel);
    }

    /// The guest reads the ISR byte: returns it and clears it.
    pub fn read_isr(&self) -> u8 {
        self.isr.swap(0, Ordering::AcqRel)
    }

    /// A guest write to the MSI-X table.
    pub fn write_table(&self, offset: u64, data: &[u8]) {
        let mut t = self.lock();
        let Some(ch) = t.write_table(offset, data) else {
            return;
        };
        let entry = t.entry(ch.vector).expect("vector from the table");
        if ch.msg_changed && self.path == MsiPath::Irqfd {
            self.update_route(ch.vector, entry.msg);
        }
        if ch.unmasked && !t.is_masked(ch.vector) && t.pending(ch.vector) {
            t.set_pending(ch.vector, false);
            drop(t);
            self.deliver(ch.vector, entry.msg);
        }
    }

    fn update_route(&self, vector: u16, msg: MsiMessage) {
        if let (Some(router), Some((gsi, _))) = (&self.router, self.irqfds.get(vector as usize)) {
            // A message that is not an MSI write (garbage from the guest) still installs; KVM
            // routes it as the guest asked. It must not fail the VMM, so errors are counted.
            if router.set_msi(*gsi, self.requester_id(), msg).is_err() {
                self.counters.errors.inc();
            }
        }
    }

    pub fn read_table(&self, offset: u64, data: &mut [u8]) {
        self.lock().read_table(offset, data)
    }

    pub fn read_pba(&self, offset: u64, data: &mut [u8]) {
        self.lock().read_pba(offset, data)
    }

    /// The guest wrote the capability's message control.
    pub fn write_control(&self, ctrl: u16) {
        let mut t = self.lock();
        if !t.set_control(ctrl) {
            return;
        }
        let mut due = Vec::new();
        for v in 0..t.len() {
            if t.pending(v) && !t.is_masked(v) {
                t.set_pending(v, false);
                due.push((v, t.entry(v).expect("in range").msg));
            }
        }
        drop(t);
        for (v, msg) in due {
            self.deliver(v, msg);
        }
    }

    /// Device reset: the table returns to its reset state (routes are left; they are rewritten
    /// before a vector is unmasked again).
    pub fn reset(&self) {
        self.lock().reset();
        self.isr.store(0, Ordering::Release);
    }
}

impl Drop for Interrupts {
    fn drop(&mut self) {
        for (gsi, efd) in &self.irqfds {
            let _ = self.vm.unregister_irqfd(efd, *gsi);
            if let Some(r) = &self.router {
                let _ = r.release(*gsi);
            }
        }
        if let Some((gsi, efd)) = &self.intx {
            let _ = self.vm.unregister_irqfd(efd, *gsi);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w32(t: &mut MsixTable, off: u64, v: u32) -> Option<EntryChange> {
        t.write_table(off, &v.to_le_bytes())
    }
    fn r32(t: &MsixTable, off: u64) -> u32 {
        let mut d = [0; 4];
        t.read_table(off, &mut d);
        u32::from_le_bytes(d)
    }

    #[test]
    fn table_reset_state_masks_everything() {
        let t = MsixTable::new(3);
        for v in 0..3 {
            assert!(t.is_masked(v));
            assert_eq!(r32(&t, v as u64 * 16 + 12), 1);
        }
        assert!(!t.enabled());
        assert!(t.is_masked(7), "out-of-range vectors read as masked");
    }

    #[test]
    fn entry_writes_report_changes() {
        let mut t = MsixTable::new(2);
        let c = w32(&mut t, 16, 0xfee0_1000).unwrap();
        assert_eq!(
            c,
            EntryChange {
                vector: 1,
                msg_changed: true,
                unmasked: false
            }
        );
        w32(&mut t, 20, 0).unwrap();
        let c = w32(&mut t, 24, 0x4041).unwrap();
        assert!(c.msg_changed);
        assert_eq!(
            t.entry(1).unwrap().msg,
            MsiMessage {
                address: 0xfee0_1000,
                data: 0x4041
            }
        );
        let c = w32(&mut t, 28, 0).unwrap();
        assert!(c.unmasked && !c.msg_changed);
        assert!(!t.is_masked(1));
        // A qword write of address.
        t.write_table(0, &0x1_fee0_0000u64.to_le_bytes()).unwrap();
        assert_eq!(t.entry(0).unwrap().msg.address, 0x1_fee0_0000);
        // Reserved vector-control bits are not stored.
        w32(&mut t, 12, 0xffff_fffe);
        assert_eq!(r32(&t, 12), 0);
    }

    #[test]
    fn garbage_writes_are_ignored() {
        let mut t = MsixTable::new(1);
        let before = t.clone().entries;
        assert!(t.write_table(0, &[1, 2]).is_none(), "2-byte write");
        assert!(t.write_table(2, &[1, 2, 3, 4]).is_none(), "misaligned");
        assert!(t.write_table(4, &[0; 8]).is_none(), "misaligned qword");
        assert!(w32(&mut t, 16, 5).is_none(), "beyond the table");
        assert!(w32(&mut t, 0x7ff0, 5).is_none());
        assert_eq!(t.entries, before);
        let mut d = [0xaa; 4];
        t.read_table(0x100, &mut d);
        assert_eq!(d, [0; 4]);
    }

    #[test]
    fn function_mask_and_pending_bits() {
        let mut t = MsixTable::new(70);
        w32(&mut t, 65 * 16 + 12, 0);
        assert!(!t.set_control(MSIX_FUNCTION_MASK), "enable bit not set");
        assert!(t.is_masked(65), "function mask wins");
        t.set_pending(65, true);
        let mut d = [0u8; 8];
        t.read_pba(8, &mut d);
        assert_eq!(u64::from_le_bytes(d), 1 << 1);
        assert!(t.set_control(MSIX_ENABLE), "became deliverable");
        assert!(!t.is_masked(65));
        assert!(!t.set_control(MSIX_ENABLE), "no change");
        t.set_pending(65, false);
        assert!(!t.pending(65));
        t.reset();
        assert!(t.is_masked(65) && !t.enabled());
    }

    #[test]
    fn capability_layout() {
        let mut c = ConfigSpace::new(Default::default());
        let off = add_capability(&mut c, 3, 1, 0, 0x800).unwrap();
        assert_eq!(c.u8_at(off), CAP_ID_MSIX);
        assert_eq!(c.u16_at(off + 2), 2);
        assert_eq!(c.u32_at(off + 4), 1);
        assert_eq!(c.u32_at(off + 8), 0x801);
        c.write(off + 2, &0xffffu16.to_le_bytes());
        assert_eq!(
            c.u16_at(off + 2),
            0xc002,
            "only enable and function mask are writable"
        );
        assert!(add_capability(&mut c, 0, 1, 0, 0).is_err());
    }
}
