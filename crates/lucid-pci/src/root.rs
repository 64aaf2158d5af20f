//! The PCI root complex: bus 0 with a host bridge at 00:00.0 and devices in the other slots;
//! configuration access through ports 0xCF8/0xCFC and through ECAM; BAR assignment at build time
//! (firmware-style, from the 32-bit window) and BAR moves when the guest reprograms them.
//!
//! A BAR is decoded (registered on the MMIO or PIO bus) when its command-register decode bit is
//! set and its address is an acceptable placement: inside the PCI window and overlapping nothing
//! else on the bus. A guest that programs an odd, overlapping or out-of-window address gets a BAR
//! that decodes nothing until it writes a good one; Lucid never maps over RAM, ECAM, another BAR
//! or a platform device.

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use lucid_devices::{Bus, BusDevice};
use lucid_stats::{Counter, StatsRegistry};

use crate::config::{
    touches, BarKind, ConfigSpace, PciIds, BAR0, COMMAND, COMMAND_IO, COMMAND_MEMORY, NUM_BARS,
};
use crate::PciError;
use vm_allocator::{AddressAllocator, AllocPolicy, RangeInclusive};

/// A PCI function on Lucid's bus. The root does the generic config-space work; the device sees
/// BAR accesses and hears about config writes and BAR (un)mappings.
pub trait PciDevice: Send {
    fn config(&self) -> &ConfigSpace;
    fn config_mut(&mut self) -> &mut ConfigSpace;
    /// The guest is writing `data` at `offset`, before the write masks apply: a function whose
    /// config space lives elsewhere (an assigned device) forwards the bytes as written.
    fn config_writing(&mut self, _offset: usize, _data: &[u8]) {}
    /// The guest wrote `len` bytes at `offset` (already applied through the write masks).
    fn config_written(&mut self, _offset: usize, _len: usize) {}
    /// A config read is about to return `offset..offset+len`: refresh anything live there.
    fn config_reading(&mut self, _offset: usize, _len: usize) {}
    fn bar_read(&mut self, bar: usize, offset: u64, data: &mut [u8]);
    fn bar_write(&mut self, bar: usize, offset: u64, data: &[u8]);
    /// BAR `bar` now decodes at `base` (or nothing, for `None`): move ioeventfds and the like.
    fn bar_mapped(&mut self, _bar: usize, _base: Option<u64>) {}
    /// The function's requester ID (bus << 8 | device << 3 | function), set when it is attached.
    fn set_requester_id(&mut self, _rid: u16) {}
    /// The function left the bus (hot-unplug): stop its work and drop its interrupt line.
    fn reset(&mut self) {}
}

/// Bus 0, device `slot`, function 0.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct PciAddress {
    pub slot: u8,
}

impl PciAddress {
    pub fn requester_id(self) -> u16 {
        (self.slot as u16) << 3
    }
}

impl std::fmt::Display for PciAddress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "00:{:02x}.0", self.slot)
    }
}

/// Where the root may place BARs.
#[derive(Clone, Debug)]
pub struct PciWindows {
    pub mmio: Range<u64>,
    pub io: Range<u64>,
    /// ECAM base and size (config access MMIO).
    pub ecam: (u64, u64),
}

pub const MAX_SLOTS: u8 = 32;
pub const CONFIG_ADDRESS_PORT: u64 = 0xcf8;

struct Slot {
    name: String,
    dev: Arc<Mutex<dyn PciDevice>>,
    /// Where each BAR decodes now.
    mapped: [Option<u64>; NUM_BARS],
    /// The BAR ranges assigned when it was attached (`true`: I/O space), freed when it leaves.
    assigned: Vec<(bool, RangeInclusive)>,
}

struct Counters {
    cf8_reads: Arc<Counter>,
    cf8_writes: Arc<Counter>,
    ecam_reads: Arc<Counter>,
    ecam_writes: Arc<Counter>,
    bar_moves: Arc<Counter>,
    bar_refused: Arc<Counter>,
}

struct Inner {
    slots: BTreeMap<u8, Slot>,
    /// The 0xCF8 address register.
    cf8: u32,
    /// Build-time BAR assignment in the MMIO and I/O windows, or why a window cannot hold
    /// any (empty). Where a guest moves a BAR later is checked against the bus, which knows
    /// every range, not against these.
    mmio_space: Result<AddressAllocator, vm_allocator::Error>,
    io_space: Result<AddressAllocator, vm_allocator::Error>,
}

impl Inner {
    /// Returns build-time BAR ranges (`true`: I/O space) to their windows.
    fn free(&mut self, taken: &[(bool, RangeInclusive)]) {
        for (io, r) in taken {
            let space = if *io {
                &mut self.io_space
            } else {
                &mut self.mmio_space
            };
            if let Ok(space) = space {
                // Each was allocated just before from this space.
                let _ = space.free(r);
            }
        }
    }
}

/// The root complex. Create with [`PciRoot::new`], attach devices with [`PciRoot::add_device`],
/// and hand its access handlers to the buses with [`PciRoot::register`].
pub struct PciRoot {
    inner: Mutex<Inner>,
    mmio: Arc<Bus>,
    pio: Arc<Bus>,
    windows: PciWindows,
    counters: Counters,
}

/// The host bridge at 00:00.0.
struct HostBridge(ConfigSpace);

impl PciDevice for HostBridge {
    fn config(&self) -> &ConfigSpace {
        &self.0
    }
    fn config_mut(&mut self) -> &mut ConfigSpace {
        &mut self.0
    }
    fn bar_read(&mut self, _: usize, _: u64, data: &mut [u8]) {
        data.fill(0xff);
    }
    fn bar_write(&mut self, _: usize, _: u64, _: &[u8]) {}
}

/// A BAR's range on a bus: forwards to the device with the BAR index.
struct BarRange {
    dev: Arc<Mutex<dyn PciDevice>>,
    bar: usize,
}

impl BusDevice for BarRange {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        lock(&self.dev).bar_read(self.bar, offset, data)
    }
    fn write(&mut self, offset: u64, data: &[u8]) {
        lock(&self.dev).bar_write(self.bar, offset, data)
    }
}

fn lock<T: ?Sized>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl PciRoot {
    /// A root complex placing BARs in `windows` and registering them on `mmio`/`pio`.
    pub fn new(
        mmio: Arc<Bus>,
        pio: Arc<Bus>,
        windows: PciWindows,
        stats: &StatsRegistry,
    ) -> Arc<Self> {
        let c = |n: &str| stats.counter(format!("pci.{n}"));
        let space = |w: &Range<u64>| AddressAllocator::new(w.start, w.end.saturating_sub(w.start));
        let root = PciRoot {
            inner: Mutex::new(Inner {
                slots: BTreeMap::new(),
                cf8: 0,
                mmio_space: space(&windows.mmio),
                io_space: space(&windows.io),
            }),
            mmio,
            pio,
            windows,
            counters: Counters {
                cf8_reads: c("cf8_reads"),
                cf8_writes: c("cf8_writes"),
                ecam_reads: c("ecam_reads"),
                ecam_writes: c("ecam_writes"),
                bar_moves: c("bar_moves"),
                bar_refused: c("bar_refused"),
            },
        };
        // Red Hat's PCIe host bridge IDs, class 06.00.00, as QEMU presents them.
        let mut bridge = ConfigSpace::new(PciIds {
            vendor: 0x1b36,
            device: 0x0008,
            revision: 0,
            class: (0x06, 0x00, 0x00),
            subsystem_vendor: 0x1af4,
            subsystem: 0x1100,
        });
        bridge.set_command(COMMAND_MEMORY | COMMAND_IO);
        lock(&root.inner).slots.insert(
            0,
            Slot {
                name: "host-bridge".into(),
                dev: Arc::new(Mutex::new(HostBridge(bridge))),
                mapped: [None; NUM_BARS],
                assigned: Vec::new(),
            },
        );
        Arc::new(root)
    }

    /// Registers the configuration-access handlers: ports 0xCF8-0xCFF on the PIO bus and the
    /// ECAM window on the MMIO bus.
    pub fn register(self: &Arc<Self>) -> Result<(), PciError> {
        self.pio.insert(
            CONFIG_ADDRESS_PORT,
            8,
            "pci-config",
            Arc::new(Mutex::new(PortAccess(Arc::downgrade(self)))),
        )?;
        let (base, size) = self.windows.ecam;
        self.mmio.insert(
            base,
            size,
            "pci-ecam",
            Arc::new(Mutex::new(EcamAccess(Arc::downgrade(self)))),
        )?;
        Ok(())
    }

    /// Attaches `dev` at the next free slot: assigns its BARs from the windows (largest first,
    /// naturally aligned), enables decoding and maps them.
    pub fn add_device(
        &self,
        name: &str,
        dev: Arc<Mutex<dyn PciDevice>>,
    ) -> Result<PciAddress, PciError> {
        let slot = (1..MAX_SLOTS)
            .find(|s| !lock(&self.inner).slots.contains_key(s))
            .ok_or(PciError::BusFull)?;
        self.add_device_at(slot, name, dev)
    }

    /// Attaches `dev` at `slot` (1 to `MAX_SLOTS - 1`, free), as [`PciRoot::add_device`] does.
    pub fn add_device_at(
        &self,
        slot: u8,
        name: &str,
        dev: Arc<Mutex<dyn PciDevice>>,
    ) -> Result<PciAddress, PciError> {
        let mut inner = lock(&self.inner);
        if slot == 0 || slot >= MAX_SLOTS || inner.slots.contains_key(&slot) {
            return Err(PciError::SlotTaken(slot));
        }
        let addr = PciAddress { slot };
        let mut d = lock(&dev);
        d.set_requester_id(addr.requester_id());
        let mut bars: Vec<(usize, BarKind, u64)> = (0..NUM_BARS)
            .filter_map(|i| d.config().bar(i).map(|b| (i, b.kind, b.size)))
            .collect();
        bars.sort_by_key(|&(_, _, size)| std::cmp::Reverse(size));
        let mut cmd = d.config().command();
        let mut taken: Vec<(bool, RangeInclusive)> = Vec::new();
        let assigned = bars.iter().try_for_each(|&(i, kind, size)| {
            let io = kind.is_io();
            let (space, window) = if io {
                (&mut inner.io_space, &self.windows.io)
            } else {
                (&mut inner.mmio_space, &self.windows.mmio)
            };
            // Naturally aligned, as a BAR must be.
            let range = space
                .as_mut()
                .map_err(|e| *e)
                .and_then(|s| s.allocate(size, size, AllocPolicy::FirstMatch))
                .map_err(|source| PciError::NoSpace {
                    device: name.to_string(),
                    bar: i,
                    size,
                    window: window.clone(),
                    source,
                })?;
            taken.push((io, range));
            d.config_mut().set_bar_address(i, range.start())?;
            cmd |= if io { COMMAND_IO } else { COMMAND_MEMORY };
            Ok(())
        });
        if let Err(e) = assigned {
            inner.free(&taken);
            return Err(e);
        }
        d.config_mut().set_command(cmd);
        drop(d);
        inner.slots.insert(
            slot,
            Slot {
                name: name.to_string(),
                dev,
                mapped: [None; NUM_BARS],
                assigned: taken.clone(),
            },
        );
        let s = inner.slots.get_mut(&slot).expect("inserted above");
        self.remap(s);
        if let Some((i, _, _)) = bars.iter().find(|(i, _, _)| s.mapped[*i].is_none()) {
            let e = PciError::BarOverlaps {
                device: name.to_string(),
                bar: *i,
                base: lock(&s.dev).config().bar_address(*i).unwrap_or(0),
            };
            // Undo: unmap what was mapped and free the slot.
            for (j, m) in s.mapped.iter().enumerate() {
                if let Some(base) = m {
                    self.bus_for(&s.dev, j).remove(*base);
                }
            }
            inner.slots.remove(&slot);
            inner.free(&taken);
            return Err(e);
        }
        Ok(addr)
    }

    /// Detaches the function at `slot` (hot-unplug): unmaps its BARs, returns their ranges to
    /// the windows and resets it. Returns it, or `None` for an empty slot or the host bridge.
    pub fn remove_device(&self, slot: u8) -> Option<Arc<Mutex<dyn PciDevice>>> {
        if slot == 0 {
            return None;
        }
        let mut inner = lock(&self.inner);
        let mut s = inner.slots.remove(&slot)?;
        for (i, m) in s.mapped.iter_mut().enumerate() {
            if let Some(base) = m.take() {
                self.bus_for(&s.dev, i).remove(base);
                lock(&s.dev).bar_mapped(i, None);
            }
        }
        inner.free(&s.assigned);
        drop(inner);
        lock(&s.dev).reset();
        Some(s.dev)
    }

    /// (address, name, [BAR base as decoded now]) of every function, host bridge included.
    pub fn devices(&self) -> Vec<(PciAddress, String, [Option<u64>; NUM_BARS])> {
        lock(&self.inner)
            .slots
            .iter()
            .map(|(&slot, s)| (PciAddress { slot }, s.name.clone(), s.mapped))
            .collect()
    }

    fn bus_for(&self, dev: &Arc<Mutex<dyn PciDevice>>, bar: usize) -> &Bus {
        let io = lock(dev).config().bar(bar).is_some_and(|b| b.kind.is_io());
        if io {
            &self.pio
        } else {
            &self.mmio
        }
    }

    /// Brings each BAR's bus registration in line with its register and the command bits.
    fn remap(&self, slot: &mut Slot) {
        for i in 0..NUM_BARS {
            let (want, size, io) = {
                let d = lock(&slot.dev);
                let cfg = d.config();
                let Some(bar) = cfg.bar(i) else { continue };
                let io = bar.kind.is_io();
                let on = cfg.command() & if io { COMMAND_IO } else { COMMAND_MEMORY } != 0;
                (on.then(|| cfg.bar_address(i)).flatten(), bar.size, io)
            };
            if want == slot.mapped[i] {
                continue;
            }
            let bus = if io { &self.pio } else { &self.mmio };
            if let Some(old) = slot.mapped[i].take() {
                bus.remove(old);
                lock(&slot.dev).bar_mapped(i, None);
            }
            let Some(base) = want else { continue };
            let window = if io {
                &self.windows.io
            } else {
                &self.windows.mmio
            };
            let inside =
                base >= window.start && base.checked_add(size).is_some_and(|end| end <= window.end);
            let range = Arc::new(Mutex::new(BarRange {
                dev: slot.dev.clone(),
                bar: i,
            }));
            let name = format!("{}-bar{i}", slot.name);
            if inside && bus.insert(base, size, &name, range).is_ok() {
                slot.mapped[i] = Some(base);
                self.counters.bar_moves.inc();
                lock(&slot.dev).bar_mapped(i, Some(base));
            } else {
                self.counters.bar_refused.inc();
            }
        }
    }

    /// A configuration read of function `(bus, dev, func)` at `reg`.
    pub fn config_read(&self, bus: u8, dev: u8, func: u8, reg: usize, data: &mut [u8]) {
        data.fill(0xff);
        if bus != 0 || func != 0 {
            return;
        }
        let inner = lock(&self.inner);
        if let Some(s) = inner.slots.get(&dev) {
            let mut d = lock(&s.dev);
            d.config_reading(reg, data.len());
            d.config().read(reg, data);
        }
    }

    /// A configuration write to function `(bus, dev, func)` at `reg`.
    pub fn config_write(&self, bus: u8, dev: u8, func: u8, reg: usize, data: &[u8]) {
        if bus != 0 || func != 0 {
            return;
        }
        let mut inner = lock(&self.inner);
        let Some(s) = inner.slots.get_mut(&dev) else {
            return;
        };
        {
            let mut d = lock(&s.dev);
            d.config_writing(reg, data);
            d.config_mut().write(reg, data);
            d.config_written(reg, data.len());
        }
        if touches(reg, data.len(), COMMAND, 2) || touches(reg, data.len(), BAR0, 4 * NUM_BARS) {
            self.remap(s);
        }
    }

    /// An ECAM access at `offset` into the window.
    fn ecam(&self, offset: u64, data: &mut [u8], write: bool) {
        let bus = (offset >> 20) as u8;
        let dev = ((offset >> 15) & 0x1f) as u8;
        let func = ((offset >> 12) & 7) as u8;
        let reg = (offset & 0xfff) as usize;
        // Accesses must stay within one function's space and be 1, 2 or 4 bytes, aligned.
        let len = data.len();
        let ok = matches!(len, 1 | 2 | 4) && reg & (len - 1) == 0;
        if write {
            self.counters.ecam_writes.inc();
            if ok {
                self.config_write(bus, dev, func, reg, data);
            }
        } else {
            self.counters.ecam_reads.inc();
            if ok {
                self.config_read(bus, dev, func, reg, data);
            } else {
                data.fill(0xff);
            }
        }
    }

    /// The 0xCF8 register's target, if enabled: (bus, dev, func, register). The register keeps
    /// the two low bits the guest wrote, which the spec reserves: QEMU ORs them with the data
    /// port's offset (`config_reg | (addr & 3)`), so a guest that writes register 2 and reads
    /// a word at 0xCFC gets the device ID. Lucid does the same, so such guests find devices.
    fn cf8_target(&self) -> Option<(u8, u8, u8, usize)> {
        let a = lock(&self.inner).cf8;
        (a & 0x8000_0000 != 0).then_some((
            (a >> 16) as u8,
            ((a >> 11) & 0x1f) as u8,
            ((a >> 8) & 7) as u8,
            (a & 0xff) as usize,
        ))
    }

    fn port(&self, offset: u64, data: &mut [u8], write: bool) {
        if offset == 0 && data.len() == 4 {
            let mut inner = lock(&self.inner);
            if write {
                inner.cf8 = u32::from_le_bytes([data[0], data[1], data[2], data[3]]);
            } else {
                data.copy_from_slice(&inner.cf8.to_le_bytes());
            }
            return;
        }
        if offset < 4 {
            // Byte/word accesses to 0xCF8-0xCFB are not configuration cycles.
            if !write {
                data.fill(0xff);
            }
            return;
        }
        let byte = (offset - 4) as usize;
        if byte + data.len() > 4 {
            if !write {
                data.fill(0xff);
            }
            return;
        }
        if write {
            self.counters.cf8_writes.inc();
        } else {
            self.counters.cf8_reads.inc();
        }
        match self.cf8_target() {
            Some((bus, dev, func, reg)) if write => {
                self.config_write(bus, dev, func, reg | byte, data)
            }
            Some((bus, dev, func, reg)) => self.config_read(bus, dev, func, reg | byte, data),
            None if !write => data.fill(0xff),
            None => {}
        }
    }
}

/// The handlers hold the root weakly: the root holds the buses they sit on, and the VM's
/// teardown must drop the devices (stopping their threads).
struct PortAccess(Weak<PciRoot>);

impl BusDevice for PortAccess {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        match self.0.upgrade() {
            Some(root) => root.port(offset, data, false),
            None => data.fill(0xff),
        }
    }
    fn write(&mut self, offset: u64, data: &[u8]) {
        if let Some(root) = self.0.upgrade() {
            let mut d = data.to_vec();
            root.port(offset, &mut d, true)
        }
    }
}

struct EcamAccess(Weak<PciRoot>);

impl BusDevice for EcamAccess {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        match self.0.upgrade() {
            Some(root) => root.ecam(offset, data, false),
            None => data.fill(0xff),
        }
    }
    fn write(&mut self, offset: u64, data: &[u8]) {
        if let Some(root) = self.0.upgrade() {
            let mut d = data.to_vec();
            root.ecam(offset, &mut d, true)
        }
    }
}
