//! QEMU's `edu` educational PCI device (1234:11e8, QEMU's docs/specs/edu.rst), register for
//! register, so that drivers and test suites written for it run on Lucid. Lucid's probe guests
//! use its DMA engine to aim DMA at chosen IOVAs through the vIOMMU.
//!
//! BAR 0 is 1 MiB of 32-bit MMIO. Registers below 0x80 take 4-byte accesses only, the DMA
//! registers 4 or 8 bytes; any other access, and any other offset, reads all ones and writes
//! nothing.
//!
//! | offset | register |
//! |--------|----------|
//! | 0x00 | identification, 0x010000ed (RO) |
//! | 0x04 | liveness check: reads the inverse of the value last written |
//! | 0x08 | factorial: a write computes the factorial of the value (mod 2^32) into it |
//! | 0x20 | status: bit 0 computing (RO), bit 7 raise interrupt 0x1 when a factorial is done |
//! | 0x24 | interrupt status (RO) |
//! | 0x60 | raise interrupt: ORs the value into the interrupt status and signals |
//! | 0x64 | acknowledge interrupt: clears those bits; INTx drops when none is left |
//! | 0x80 | DMA source address |
//! | 0x88 | DMA destination address |
//! | 0x90 | DMA byte count |
//! | 0x98 | DMA command: bit 0 start (reads 1 while busy), bit 1 direction (0 RAM to device buffer, 1 device buffer to RAM), bit 2 raise interrupt 0x100 when done |
//!
//! The device buffer is 4 KiB at device address 0x40000. The RAM side goes through an
//! [`EduDma`] as this function's requester ID: in Lucid the [`DmaPath`], so a vIOMMU translates
//! it and records its faults; in a device server, the mappings its VMM gave it;
//! like QEMU, the RAM-side address is first masked to 28 bits (QEMU's default `dma_mask`). A DMA
//! error is otherwise ignored, as QEMU ignores it: nothing is copied into the device buffer, and
//! `edu.dma_errors` counts it.
//!
//! Interrupts: an MSI (one vector, 64-bit capable) sent through [`GsiRouter::signal_msi`] (so
//! interrupt remapping applies) when the driver enabled MSI and bus mastering, else a level on
//! INTx pin A held while the interrupt status is non-zero.
//!
//! Differences from QEMU, invisible to a driver that waits as the spec says: the factorial and
//! the DMA run synchronously on the vCPU thread that starts them (QEMU uses a thread and a
//! 100 ms timer), so the busy bits already read 0 at the next access; a DMA whose device-side
//! range leaves the buffer moves nothing and is logged at debug level (QEMU 7.2 stops the VM,
//! later versions log it and overrun the buffer), but completes like any other: busy clears and
//! the interrupt it asked for is raised.

use std::ops::Range;
use std::sync::Arc;

use lucid_hv::{GsiRouter, HvError, MsiMessage, Vm};
use lucid_mem::{DeviceId, DmaError, DmaPath};
use lucid_stats::{Counter, StatsRegistry};

use crate::config::{
    touches, Bar, BarKind, ConfigSpace, PciIds, COMMAND, COMMAND_BUS_MASTER, COMMAND_INTX_DISABLE,
    STATUS, STATUS_INTERRUPT,
};
use crate::msi::MsiCap;
use crate::root::PciDevice;
use crate::PciError;

pub const EDU_VENDOR: u16 = 0x1234;
pub const EDU_DEVICE: u16 = 0x11e8;
pub const EDU_REVISION: u8 = 0x10;
/// Class 00 (unclassified), subclass ff: QEMU's `PCI_CLASS_OTHERS`.
pub const EDU_CLASS: (u8, u8, u8) = (0x00, 0xff, 0x00);
pub const EDU_BAR: usize = 0;
pub const EDU_BAR_SIZE: u64 = 1 << 20;
/// The identification register: version 1.0, then 0xed.
pub const EDU_IDENT: u32 = 0x0100_00ed;

/// Register offsets in BAR 0.
pub mod reg {
    pub const IDENT: u64 = 0x00;
    pub const LIVENESS: u64 = 0x04;
    pub const FACTORIAL: u64 = 0x08;
    pub const STATUS: u64 = 0x20;
    pub const IRQ_STATUS: u64 = 0x24;
    pub const IRQ_RAISE: u64 = 0x60;
    pub const IRQ_ACK: u64 = 0x64;
    pub const DMA_SRC: u64 = 0x80;
    pub const DMA_DST: u64 = 0x88;
    pub const DMA_COUNT: u64 = 0x90;
    pub const DMA_CMD: u64 = 0x98;
}

/// Status register bits.
pub const STATUS_COMPUTING: u32 = 0x01;
pub const STATUS_IRQ_FACT: u32 = 0x80;
/// Interrupt status bits the device raises itself.
pub const IRQ_FACT: u32 = 0x001;
pub const IRQ_DMA: u32 = 0x100;
/// DMA command bits.
pub const DMA_CMD_START: u64 = 0x1;
pub const DMA_CMD_TO_RAM: u64 = 0x2;
pub const DMA_CMD_IRQ: u64 = 0x4;
/// The device buffer's device address and size.
pub const DMA_BUF_ADDR: u64 = 0x40000;
pub const DMA_BUF_SIZE: usize = 4096;
/// QEMU's default `dma_mask`: the RAM-side address keeps its low 28 bits.
pub const DMA_MASK: u64 = (1 << 28) - 1;

/// The RAM side of the DMA engine: Lucid's [`DmaPath`], or a device server's table of the
/// mappings its VMM gave it (`lucid-vfio-server`). An `Err` moves no byte.
pub trait EduDma: Send + Sync {
    /// Device `dev` reads `buf.len()` bytes at device address `addr`.
    fn read(&self, dev: DeviceId, addr: u64, buf: &mut [u8]) -> Result<(), DmaError>;
    /// Device `dev` writes `buf` at device address `addr`.
    fn write(&self, dev: DeviceId, addr: u64, buf: &[u8]) -> Result<(), DmaError>;
    /// Allows or refuses DMA by `dev` (its bus-master enable).
    fn set_bus_master(&self, dev: DeviceId, enabled: bool);
}

impl EduDma for DmaPath {
    fn read(&self, dev: DeviceId, addr: u64, buf: &mut [u8]) -> Result<(), DmaError> {
        DmaPath::read(self, dev, addr, buf)
    }
    fn write(&self, dev: DeviceId, addr: u64, buf: &[u8]) -> Result<(), DmaError> {
        DmaPath::write(self, dev, addr, buf)
    }
    fn set_bus_master(&self, dev: DeviceId, enabled: bool) {
        DmaPath::set_bus_master(self, dev, enabled)
    }
}

/// Where the device's interrupts go. [`KvmIrq`] is the VM's; unit tests record them.
pub trait IrqSink: Send + Sync {
    /// Sends `msg` as requester `source` (bus << 8 | devfn).
    fn msi(&self, source: u16, msg: MsiMessage) -> Result<(), HvError>;
    /// Drives INTx pin A's line to `level` (a no-op without a line).
    fn set_intx(&self, level: bool) -> Result<(), HvError>;
}

/// Interrupts into KVM: MSIs by [`GsiRouter::signal_msi`], INTx as a level on an IOAPIC pin
/// (`KVM_IRQ_LINE`), held until the driver acknowledges.
///
/// KVM keeps one userspace level per pin, which irqfd pulses share: on a pin shared with a
/// virtio device in INTx mode (a ninth PCI device and up share pins), that device's pulse would
/// lower the edu's level until its next raise.
pub struct KvmIrq {
    vm: Vm,
    router: Arc<GsiRouter>,
    intx_gsi: Option<u32>,
}

impl KvmIrq {
    pub fn new(vm: Vm, router: Arc<GsiRouter>, intx_gsi: Option<u32>) -> Self {
        KvmIrq {
            vm,
            router,
            intx_gsi,
        }
    }
}

impl IrqSink for KvmIrq {
    fn msi(&self, source: u16, msg: MsiMessage) -> Result<(), HvError> {
        self.router.signal_msi(source, msg)
    }
    fn set_intx(&self, level: bool) -> Result<(), HvError> {
        match self.intx_gsi {
            Some(gsi) => self.vm.set_irq_line(gsi, level),
            None => Ok(()),
        }
    }
}

struct Counters {
    dma_reads: Arc<Counter>,
    dma_writes: Arc<Counter>,
    dma_bytes: Arc<Counter>,
    dma_errors: Arc<Counter>,
    dma_refused: Arc<Counter>,
    irqs: Arc<Counter>,
    irqs_dropped: Arc<Counter>,
    factorials: Arc<Counter>,
}

/// The edu function. Attach it with [`crate::attach_edu`] (or [`crate::PciRoot::add_device`]).
pub struct EduDevice {
    cfg: ConfigSpace,
    msi: MsiCap,
    rid: u16,
    dma: Arc<dyn EduDma>,
    irq: Arc<dyn IrqSink>,
    liveness: u32,
    fact: u32,
    status: u32,
    irq_status: u32,
    dma_src: u64,
    dma_dst: u64,
    dma_count: u64,
    dma_cmd: u64,
    buf: Box<[u8; DMA_BUF_SIZE]>,
    /// The level the device drives on INTx (QEMU's `pci_set_irq`).
    intx_level: bool,
    /// The line as the irqchip has it: `intx_level` unless the command register disables INTx.
    intx_line: bool,
    counters: Counters,
}

impl EduDevice {
    /// A device doing DMA through `dma` and interrupts through `irq`; `intx_gsi` is what the
    /// interrupt-line register says (the IOAPIC pin `irq` drives), `None` for none. Counters
    /// go under `edu.`.
    pub fn new(
        dma: Arc<DmaPath>,
        irq: Arc<dyn IrqSink>,
        intx_gsi: Option<u32>,
        stats: &StatsRegistry,
    ) -> Result<Self, PciError> {
        Self::with_dma(dma, irq, intx_gsi, stats)
    }

    /// As [`EduDevice::new`], with its RAM side behind any [`EduDma`].
    pub fn with_dma(
        dma: Arc<dyn EduDma>,
        irq: Arc<dyn IrqSink>,
        intx_gsi: Option<u32>,
        stats: &StatsRegistry,
    ) -> Result<Self, PciError> {
        let mut cfg = ConfigSpace::new(PciIds {
            vendor: EDU_VENDOR,
            device: EDU_DEVICE,
            revision: EDU_REVISION,
            class: EDU_CLASS,
            // QEMU's default subsystem IDs.
            subsystem_vendor: 0x1af4,
            subsystem: 0x1100,
        });
        cfg.add_bar(
            EDU_BAR,
            Bar {
                kind: BarKind::Mmio32 {
                    prefetchable: false,
                },
                size: EDU_BAR_SIZE,
            },
        )?;
        let msi = MsiCap::add(&mut cfg, 1, true)?;
        // A line register of 0xff says "not connected" (x86 convention).
        let line = intx_gsi.map_or(0xff, |g| u8::try_from(g).unwrap_or(0xff));
        cfg.set_interrupt(line, 1);
        let c = |n: &str| stats.counter(format!("edu.{n}"));
        Ok(EduDevice {
            cfg,
            msi,
            rid: 0,
            dma,
            irq,
            liveness: 0,
            fact: 0,
            status: 0,
            irq_status: 0,
            dma_src: 0,
            dma_dst: 0,
            dma_count: 0,
            dma_cmd: 0,
            buf: Box::new([0; DMA_BUF_SIZE]),
            intx_level: false,
            intx_line: false,
            counters: Counters {
                dma_reads: c("dma_reads"),
                dma_writes: c("dma_writes"),
                dma_bytes: c("dma_bytes"),
                dma_errors: c("dma_errors"),
                dma_refused: c("dma_refused"),
                irqs: c("irqs"),
                irqs_dropped: c("irqs_dropped"),
                factorials: c("factorials"),
            },
        })
    }

    /// The interrupt status register.
    pub fn irq_status(&self) -> u32 {
        self.irq_status
    }

    /// The device buffer (4 KiB at device address [`DMA_BUF_ADDR`]).
    pub fn buffer(&self) -> &[u8; DMA_BUF_SIZE] {
        &self.buf
    }

    /// Whether the device holds its INTx line asserted now.
    pub fn intx_asserted(&self) -> bool {
        self.intx_line
    }

    fn read_reg(&self, offset: u64, len: usize) -> u64 {
        if !access_ok(offset, len) {
            return u64::MAX;
        }
        match offset {
            reg::IDENT => EDU_IDENT.into(),
            reg::LIVENESS => self.liveness.into(),
            reg::FACTORIAL => self.fact.into(),
            reg::STATUS => self.status.into(),
            reg::IRQ_STATUS => self.irq_status.into(),
            reg::DMA_SRC => self.dma_src,
            reg::DMA_DST => self.dma_dst,
            reg::DMA_COUNT => self.dma_count,
            reg::DMA_CMD => self.dma_cmd,
            _ => u64::MAX,
        }
    }

    fn write_reg(&mut self, offset: u64, len: usize, val: u64) {
        if !access_ok(offset, len) {
            return;
        }
        // Registers below 0x80 are 4-byte only, so `val` fits 32 bits there.
        let v32 = val as u32;
        match offset {
            reg::LIVENESS => self.liveness = !v32,
            reg::FACTORIAL => {
                // Computed at once, so "computing" is never seen set.
                self.fact = factorial(v32);
                self.counters.factorials.inc();
                if self.status & STATUS_IRQ_FACT != 0 {
                    self.raise(IRQ_FACT);
                }
            }
            reg::STATUS => {
                self.status = (self.status & !STATUS_IRQ_FACT) | (v32 & STATUS_IRQ_FACT);
            }
            reg::IRQ_RAISE => self.raise(v32),
            reg::IRQ_ACK => self.lower(v32),
            // A 4-byte write sets the whole register (the upper half to 0), as in QEMU.
            reg::DMA_SRC => self.dma_src = val,
            reg::DMA_DST => self.dma_dst = val,
            reg::DMA_COUNT => self.dma_count = val,
            reg::DMA_CMD if val & DMA_CMD_START != 0 => {
                self.dma_cmd = val;
                self.run_dma();
            }
            _ => {}
        }
    }

    /// Runs the transfer the DMA registers describe, then completes the command.
    fn run_dma(&mut self) {
        let to_ram = self.dma_cmd & DMA_CMD_TO_RAM != 0;
        let (dev_addr, ram_addr) = match to_ram {
            true => (self.dma_src, self.dma_dst),
            false => (self.dma_dst, self.dma_src),
        };
        let count = self.dma_count;
        match buffer_range(dev_addr, count) {
            None => {
                self.counters.dma_refused.inc();
                log::debug!(
                    "edu: DMA of {count:#x} bytes at device address {dev_addr:#x} leaves the \
                     buffer {DMA_BUF_ADDR:#x}+{DMA_BUF_SIZE:#x}: refused"
                );
            }
            Some(range) if range.is_empty() => {}
            Some(range) => {
                let ram = ram_addr & DMA_MASK;
                if ram != ram_addr {
                    log::debug!("edu: DMA address {ram_addr:#x} clamped to {ram:#x}");
                }
                let n = range.len() as u64;
                let rid = u32::from(self.rid);
                let done = if to_ram {
                    self.dma
                        .write(rid, ram, &self.buf[range])
                        .map(|()| &self.counters.dma_writes)
                } else {
                    // Into a bounce buffer first: a failed read leaves the device buffer as it was.
                    let mut bounce = [0u8; DMA_BUF_SIZE];
                    let bounce = &mut bounce[..range.len()];
                    self.dma.read(rid, ram, bounce).map(|()| {
                        self.buf[range].copy_from_slice(bounce);
                        &self.counters.dma_reads
                    })
                };
                match done {
                    Ok(c) => {
                        c.inc();
                        self.counters.dma_bytes.add(n);
                    }
                    Err(e) => {
                        self.counters.dma_errors.inc();
                        log::debug!("edu: {e}");
                    }
                }
            }
        }
        self.dma_cmd &= !DMA_CMD_START;
        if self.dma_cmd & DMA_CMD_IRQ != 0 {
            self.raise(IRQ_DMA);
        }
    }

    fn raise(&mut self, bits: u32) {
        self.irq_status |= bits;
        if self.irq_status == 0 {
            return;
        }
        if self.msi.enabled(&self.cfg) {
            self.send_msi();
        } else {
            self.set_intx_level(true);
        }
    }

    fn lower(&mut self, bits: u32) {
        self.irq_status &= !bits;
        if self.irq_status == 0 && !self.msi.enabled(&self.cfg) {
            self.set_intx_level(false);
        }
    }

    fn send_msi(&mut self) {
        let Some(msg) = self.msi.message(&self.cfg, 0) else {
            return;
        };
        // An MSI is a memory write by the function: no bus mastering, no write.
        if self.cfg.command() & COMMAND_BUS_MASTER == 0 {
            self.counters.irqs_dropped.inc();
            log::debug!("edu: MSI dropped: bus mastering is off");
            return;
        }
        match self.irq.msi(self.rid, msg) {
            Ok(()) => self.counters.irqs.inc(),
            Err(e) => {
                self.counters.irqs_dropped.inc();
                log::debug!("edu: MSI {msg:x?} not delivered: {e}");
            }
        }
    }

    fn set_intx_level(&mut self, level: bool) {
        self.intx_level = level;
        let status = self.cfg.u16_at(STATUS) & !STATUS_INTERRUPT;
        let bit = if level { STATUS_INTERRUPT } else { 0 };
        self.cfg.set_u16(STATUS, status | bit);
        self.update_intx_line();
    }

    fn update_intx_line(&mut self) {
        let line = self.intx_level && self.cfg.command() & COMMAND_INTX_DISABLE == 0;
        if line == self.intx_line {
            return;
        }
        self.intx_line = line;
        match self.irq.set_intx(line) {
            Ok(()) if line => self.counters.irqs.inc(),
            Ok(()) => {}
            Err(e) => {
                self.counters.irqs_dropped.inc();
                log::debug!("edu: INTx level {line} not set: {e}");
            }
        }
    }

    fn apply_bus_master(&self) {
        let on = self.cfg.command() & COMMAND_BUS_MASTER != 0;
        self.dma.set_bus_master(u32::from(self.rid), on);
    }
}

/// Registers below 0x80 take 4-byte accesses; the DMA registers 4 or 8.
fn access_ok(offset: u64, len: usize) -> bool {
    len == 4 || (len == 8 && offset >= reg::DMA_SRC)
}

/// Where `count` bytes at device address `addr` sit in the buffer, if they all do.
fn buffer_range(addr: u64, count: u64) -> Option<Range<usize>> {
    let start = addr.checked_sub(DMA_BUF_ADDR)?;
    let end = start.checked_add(count)?;
    (end <= DMA_BUF_SIZE as u64).then_some(start as usize..end as usize)
}

/// n! mod 2^32, as QEMU's 32-bit loop computes it. The product is 0 from 34! on (32 factors of
/// two), so the loop stops there whatever `n` is.
fn factorial(n: u32) -> u32 {
    let mut r = 1u32;
    let mut v = n;
    while v > 0 && r != 0 {
        r = r.wrapping_mul(v);
        v -= 1;
    }
    r
}

impl PciDevice for EduDevice {
    fn config(&self) -> &ConfigSpace {
        &self.cfg
    }
    fn config_mut(&mut self) -> &mut ConfigSpace {
        &mut self.cfg
    }

    fn config_written(&mut self, offset: usize, len: usize) {
        if touches(offset, len, COMMAND, 2) {
            self.apply_bus_master();
            self.update_intx_line();
        }
        let (ctrl, ctrl_len) = self.msi.control_range();
        // With MSI on, the function must not assert INTx (PCI 3.0, 6.8.3.3), as QEMU does.
        if touches(offset, len, ctrl, ctrl_len) && self.msi.enabled(&self.cfg) {
            self.set_intx_level(false);
        }
    }

    fn bar_read(&mut self, bar: usize, offset: u64, data: &mut [u8]) {
        if bar != EDU_BAR || data.len() > 8 {
            data.fill(0xff);
            return;
        }
        let v = self.read_reg(offset, data.len());
        let n = data.len();
        data.copy_from_slice(&v.to_le_bytes()[..n]);
    }

    fn bar_write(&mut self, bar: usize, offset: u64, data: &[u8]) {
        if bar != EDU_BAR || data.len() > 8 {
            return;
        }
        let mut b = [0u8; 8];
        b[..data.len()].copy_from_slice(data);
        self.write_reg(offset, data.len(), u64::from_le_bytes(b));
    }

    fn set_requester_id(&mut self, rid: u16) {
        self.rid = rid;
        self.apply_bus_master();
    }

    fn reset(&mut self) {
        self.set_intx_level(false);
        self.dma.set_bus_master(u32::from(self.rid), false);
    }
}

impl Drop for EduDevice {
    fn drop(&mut self) {
        if self.intx_line {
            let _ = self.irq.set_intx(false);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{COMMAND_MEMORY, INTERRUPT_LINE, INTERRUPT_PIN};
    use crate::msi::{MSI_64BIT, MSI_ENABLE};
    use lucid_mem::{Access, DeviceId, DmaError, DmaTranslator, FaultReason};
    use lucid_mem::{Backing, GuestRam};
    use std::sync::Mutex;

    const RID: u16 = 3 << 3;

    /// Records what the device signals.
    #[derive(Default)]
    struct Recorder {
        msis: Mutex<Vec<(u16, MsiMessage)>>,
        intx: Mutex<Vec<bool>>,
    }
    impl IrqSink for Recorder {
        fn msi(&self, source: u16, msg: MsiMessage) -> Result<(), HvError> {
            self.msis.lock().unwrap().push((source, msg));
            Ok(())
        }
        fn set_intx(&self, level: bool) -> Result<(), HvError> {
            self.intx.lock().unwrap().push(level);
            Ok(())
        }
    }

    /// IOVA = GPA + 0x10_0000 for IOVAs in 1..2 MiB; everything else faults.
    struct Window;
    impl DmaTranslator for Window {
        fn translate(
            &self,
            dev: DeviceId,
            iova: u64,
            len: u64,
            access: Access,
        ) -> Result<(u64, u64), DmaError> {
            if !(0x10_0000..0x20_0000).contains(&iova) {
                return Err(DmaError::Fault {
                    dev,
                    iova,
                    access,
                    reason: FaultReason::NotMapped,
                });
            }
            Ok((iova - 0x10_0000, len.min(0x1000 - (iova & 0xfff))))
        }
    }

    struct T {
        edu: EduDevice,
        irq: Arc<Recorder>,
        dma: Arc<DmaPath>,
        stats: Arc<StatsRegistry>,
        _ram: GuestRam,
    }

    impl T {
        fn new() -> T {
            let ram = GuestRam::new(&[(0, 4 << 20)], Backing::Anonymous).unwrap();
            let stats = StatsRegistry::new();
            let dma = DmaPath::new(ram.memory().clone(), &stats);
            let irq = Arc::new(Recorder::default());
            let mut edu = EduDevice::new(dma.clone(), irq.clone(), Some(17), &stats).unwrap();
            edu.set_requester_id(RID);
            let mut t = T {
                edu,
                irq,
                dma,
                stats,
                _ram: ram,
            };
            t.command(COMMAND_MEMORY | COMMAND_BUS_MASTER);
            t
        }
        fn r(&mut self, off: u64, len: usize) -> u64 {
            let mut d = [0u8; 8];
            self.edu.bar_read(0, off, &mut d[..len]);
            u64::from_le_bytes(d)
        }
        fn r32(&mut self, off: u64) -> u32 {
            self.r(off, 4) as u32
        }
        fn w(&mut self, off: u64, len: usize, v: u64) {
            self.edu.bar_write(0, off, &v.to_le_bytes()[..len]);
        }
        fn w32(&mut self, off: u64, v: u32) {
            self.w(off, 4, v.into())
        }
        fn cfg_write(&mut self, off: usize, data: &[u8]) {
            self.edu.config_mut().write(off, data);
            self.edu.config_written(off, data.len());
        }
        fn command(&mut self, cmd: u16) {
            self.cfg_write(COMMAND, &cmd.to_le_bytes());
        }
        fn enable_msi(&mut self, data: u16) {
            let o = self.edu.msi.offset();
            self.cfg_write(o + 4, &0xfee0_0000u32.to_le_bytes());
            self.cfg_write(o + 8, &0u32.to_le_bytes());
            self.cfg_write(o + 12, &data.to_le_bytes());
            self.cfg_write(o + 2, &MSI_ENABLE.to_le_bytes());
        }
        fn counter(&self, n: &str) -> u64 {
            self.stats.snapshot()[n]
        }
        fn dma(&mut self, src: u64, dst: u64, count: u64, cmd: u64) {
            self.w(reg::DMA_SRC, 8, src);
            self.w(reg::DMA_DST, 8, dst);
            self.w(reg::DMA_COUNT, 8, count);
            self.w(reg::DMA_CMD, 8, cmd | DMA_CMD_START);
        }
        fn ram(&self, gpa: u64, len: usize) -> Vec<u8> {
            let mut b = vec![0; len];
            self.dma.read(0xffff, gpa, &mut b).unwrap();
            b
        }
        fn msis(&self) -> Vec<(u16, MsiMessage)> {
            self.irq.msis.lock().unwrap().clone()
        }
        fn intx(&self) -> Vec<bool> {
            self.irq.intx.lock().unwrap().clone()
        }
    }

    #[test]
    fn config_space_as_qemu_presents_it() {
        let t = T::new();
        let c = t.edu.config();
        assert_eq!(c.u32_at(0), 0x11e8_1234);
        assert_eq!(
            c.u32_at(8),
            0x00ff_0010,
            "class 00ff, prog-if 0, revision 0x10"
        );
        assert_eq!(c.u32_at(0x2c), 0x1100_1af4);
        assert_eq!(c.bar(0).unwrap().size, 1 << 20);
        assert!(matches!(
            c.bar(0).unwrap().kind,
            BarKind::Mmio32 {
                prefetchable: false
            }
        ));
        assert_eq!((c.u8_at(INTERRUPT_PIN), c.u8_at(INTERRUPT_LINE)), (1, 17));
        let o = t.edu.msi.offset();
        assert_eq!(c.capabilities(), vec![(o, crate::config::CAP_ID_MSI)]);
        assert_eq!(c.u16_at(o + 2), MSI_64BIT, "1 vector, 64-bit, off");
    }

    #[test]
    fn ident_liveness_and_factorial() {
        let mut t = T::new();
        assert_eq!(t.r32(reg::IDENT), EDU_IDENT);
        t.w32(reg::IDENT, 5);
        assert_eq!(t.r32(reg::IDENT), EDU_IDENT, "read-only");
        t.w32(reg::LIVENESS, 0x1234_5678);
        assert_eq!(t.r32(reg::LIVENESS), !0x1234_5678);
        for (n, f) in [
            (0u32, 1u32),
            (1, 1),
            (5, 120),
            (12, 479_001_600),
            (13, 1_932_053_504),
            (33, 2_147_483_648),
            (34, 0),
            (u32::MAX, 0),
        ] {
            t.w32(reg::FACTORIAL, n);
            assert_eq!(t.r32(reg::STATUS) & STATUS_COMPUTING, 0, "done at once");
            assert_eq!(t.r32(reg::FACTORIAL), f, "{n}!");
        }
        assert_eq!(t.counter("edu.factorials"), 8);
        assert!(
            t.msis().is_empty() && t.intx().is_empty(),
            "no irq asked for"
        );
        // Only bit 7 of the status is writable.
        t.w32(reg::STATUS, 0xffff_ffff);
        assert_eq!(t.r32(reg::STATUS), STATUS_IRQ_FACT);
        t.w32(reg::FACTORIAL, 4);
        assert_eq!(t.r32(reg::IRQ_STATUS), IRQ_FACT);
        assert_eq!(t.intx(), vec![true]);
        t.w32(reg::STATUS, 0);
        assert_eq!(t.r32(reg::STATUS), 0);
    }

    #[test]
    fn intx_level_follows_irq_status_and_command() {
        let mut t = T::new();
        t.w32(reg::IRQ_RAISE, 0x30);
        assert_eq!(t.r32(reg::IRQ_STATUS), 0x30);
        assert!(t.edu.intx_asserted());
        t.w32(reg::IRQ_RAISE, 0x1);
        assert_eq!(t.intx(), vec![true], "already high");
        assert_ne!(t.edu.config().u16_at(STATUS) & STATUS_INTERRUPT, 0);
        t.w32(reg::IRQ_ACK, 0x10);
        assert_eq!(t.r32(reg::IRQ_STATUS), 0x21);
        assert!(t.edu.intx_asserted(), "bits left");
        // INTx disable drops the line but not the device's level; enable brings it back.
        t.command(COMMAND_MEMORY | COMMAND_BUS_MASTER | COMMAND_INTX_DISABLE);
        assert!(!t.edu.intx_asserted());
        assert_ne!(t.edu.config().u16_at(STATUS) & STATUS_INTERRUPT, 0);
        t.command(COMMAND_MEMORY | COMMAND_BUS_MASTER);
        assert!(t.edu.intx_asserted());
        t.w32(reg::IRQ_ACK, 0xffff_ffff);
        assert_eq!(t.r32(reg::IRQ_STATUS), 0);
        assert_eq!(t.intx(), vec![true, false, true, false]);
        assert_eq!(t.edu.config().u16_at(STATUS) & STATUS_INTERRUPT, 0);
        // Raising nothing with nothing pending signals nothing.
        t.w32(reg::IRQ_RAISE, 0);
        assert_eq!(t.intx().len(), 4);
        assert_eq!(t.counter("edu.irqs"), 2);
    }

    #[test]
    fn msi_goes_to_the_router_with_the_requester_id() {
        let mut t = T::new();
        t.w32(reg::IRQ_RAISE, 4);
        assert!(t.edu.intx_asserted());
        t.enable_msi(0x4045);
        assert!(!t.edu.intx_asserted(), "enabling MSI deasserts INTx");
        t.w32(reg::IRQ_RAISE, 8);
        let m = MsiMessage {
            address: 0xfee0_0000,
            data: 0x4045,
        };
        assert_eq!(t.msis(), vec![(RID, m)]);
        // Acknowledging with MSI on touches no line; every raise sends a message.
        t.w32(reg::IRQ_ACK, 0xc);
        t.w32(reg::IRQ_RAISE, 1);
        assert_eq!(t.msis().len(), 2);
        assert_eq!(t.intx(), vec![true, false]);
        // No bus mastering, no MSI.
        t.command(COMMAND_MEMORY);
        t.w32(reg::IRQ_RAISE, 1);
        assert_eq!(t.msis().len(), 2);
        assert_eq!(t.counter("edu.irqs_dropped"), 1);
        // MSI off again: the next raise goes out on INTx.
        let o = t.edu.msi.offset();
        t.cfg_write(o + 2, &0u16.to_le_bytes());
        assert!(!t.edu.intx_asserted(), "nothing until the next raise");
        t.w32(reg::IRQ_RAISE, 2);
        assert!(t.edu.intx_asserted());
        assert_eq!(t.msis().len(), 2);
    }

    #[test]
    fn dma_both_directions_through_the_buffer() {
        let mut t = T::new();
        t.dma.write(0, 0x1000, b"lucid edu dma test").unwrap();
        // RAM -> device buffer at offset 0x10.
        t.dma(0x1000, DMA_BUF_ADDR + 0x10, 18, DMA_CMD_IRQ);
        assert_eq!(&t.edu.buffer()[0x10..0x22], b"lucid edu dma test");
        assert_eq!(t.r(reg::DMA_CMD, 8), DMA_CMD_IRQ, "start clears when done");
        assert_eq!(t.r32(reg::IRQ_STATUS), IRQ_DMA);
        t.w32(reg::IRQ_ACK, IRQ_DMA);
        // Device buffer -> RAM elsewhere, crossing a page, no irq.
        t.dma(DMA_BUF_ADDR + 0x10, 0x2ffa, 18, DMA_CMD_TO_RAM);
        assert_eq!(t.ram(0x2ffa, 18), b"lucid edu dma test");
        assert_eq!(t.r(reg::DMA_CMD, 8), DMA_CMD_TO_RAM);
        assert_eq!(t.r32(reg::IRQ_STATUS), 0);
        assert_eq!(t.counter("edu.dma_reads"), 1);
        assert_eq!(t.counter("edu.dma_writes"), 1);
        assert_eq!(t.counter("edu.dma_bytes"), 36);
        // The whole buffer, both ways, with 4-byte register writes.
        let pattern: Vec<u8> = (0..DMA_BUF_SIZE).map(|i| (i * 7) as u8).collect();
        t.dma.write(0, 0x8000, &pattern).unwrap();
        t.w32(reg::DMA_SRC, 0x8000);
        t.w32(reg::DMA_DST, DMA_BUF_ADDR as u32);
        t.w32(reg::DMA_COUNT, DMA_BUF_SIZE as u32);
        t.w32(reg::DMA_CMD, DMA_CMD_START as u32);
        assert_eq!(&t.edu.buffer()[..], &pattern[..]);
        t.dma(DMA_BUF_ADDR, 0x2_0000, DMA_BUF_SIZE as u64, DMA_CMD_TO_RAM);
        assert_eq!(t.ram(0x2_0000, DMA_BUF_SIZE), pattern);
        // Register reads back: 8 bytes, and 4 bytes of the low half.
        assert_eq!(t.r(reg::DMA_DST, 8), 0x2_0000);
        assert_eq!(t.r(reg::DMA_COUNT, 4), DMA_BUF_SIZE as u64);
    }

    #[test]
    fn dma_ram_address_is_clamped_to_28_bits_as_in_qemu() {
        let mut t = T::new();
        t.dma.write(0, 0x3000, b"xyz").unwrap();
        t.dma(0x1000_3000, DMA_BUF_ADDR, 3, 0);
        assert_eq!(&t.edu.buffer()[..3], b"xyz");
    }

    #[test]
    fn dma_outside_the_buffer_is_refused_but_completes() {
        let mut t = T::new();
        t.dma.write(0, 0x1000, &[0xaa; 64]).unwrap();
        for (dev, count) in [
            (DMA_BUF_ADDR - 1, 4u64),
            (DMA_BUF_ADDR + 4095, 2),
            (DMA_BUF_ADDR, 4097),
            (DMA_BUF_ADDR + 8, u64::MAX),
            (u64::MAX, 2),
            (0, 16),
        ] {
            t.dma(0x1000, dev, count, DMA_CMD_IRQ);
            assert_eq!(t.r(reg::DMA_CMD, 8) & DMA_CMD_START, 0);
            t.dma(dev, 0x1000, count, DMA_CMD_TO_RAM);
        }
        assert!(t.edu.buffer().iter().all(|&b| b == 0));
        assert_eq!(t.ram(0x1000, 64), vec![0xaa; 64]);
        assert_eq!(t.counter("edu.dma_refused"), 12);
        assert_eq!(t.r32(reg::IRQ_STATUS), IRQ_DMA, "completion still raised");
        // An empty transfer at the buffer's end is in range and moves nothing.
        t.dma(0x1000, DMA_BUF_ADDR + 4096, 0, 0);
        assert_eq!(t.counter("edu.dma_refused"), 12);
        assert_eq!(t.counter("edu.dma_bytes"), 0);
    }

    #[test]
    fn dma_faults_leave_memory_and_buffer_untouched() {
        let mut t = T::new();
        t.dma.write(0, 0x1000, b"mapped").unwrap();
        t.dma.set_translator(Some(Arc::new(Window)));
        // IOVA 0x10_1000 is GPA 0x1000.
        t.dma(0x10_1000, DMA_BUF_ADDR, 6, DMA_CMD_IRQ);
        assert_eq!(&t.edu.buffer()[..6], b"mapped");
        // An unmapped IOVA: the buffer keeps its bytes, the command completes.
        t.dma(0x5000, DMA_BUF_ADDR, 6, DMA_CMD_IRQ);
        assert_eq!(&t.edu.buffer()[..6], b"mapped");
        assert_eq!(t.r(reg::DMA_CMD, 8), DMA_CMD_IRQ);
        // A read whose second page faults copies nothing into the buffer either.
        t.dma(0x1f_fffc, DMA_BUF_ADDR, 6, 0);
        assert_eq!(&t.edu.buffer()[..6], b"mapped");
        // Device -> RAM at an unmapped IOVA writes nothing anywhere.
        t.dma.set_translator(None);
        let before = t.ram(0, 0x4000);
        t.dma.set_translator(Some(Arc::new(Window)));
        t.dma(DMA_BUF_ADDR, 0x3000, 6, DMA_CMD_TO_RAM);
        t.dma.set_translator(None);
        assert_eq!(t.ram(0, 0x4000), before);
        assert_eq!(t.counter("edu.dma_errors"), 3);
        assert_eq!(t.counter("edu.dma_reads"), 1);
        assert_eq!(t.counter("edu.dma_bytes"), 6);
        // Bus mastering off: refused by the DMA path, counted the same way.
        t.command(COMMAND_MEMORY);
        t.dma(0x1000, DMA_BUF_ADDR + 0x100, 6, 0);
        assert_eq!(t.counter("edu.dma_errors"), 4);
        assert_eq!(&t.edu.buffer()[0x100..0x106], &[0; 6]);
    }

    #[test]
    fn access_sizes_and_offsets_as_qemu_allows() {
        let mut t = T::new();
        // Below 0x80 only 4 bytes.
        assert_eq!(t.r(reg::IDENT, 8), u64::MAX);
        assert_eq!(t.r(reg::IDENT, 2), 0xffff);
        assert_eq!(t.r(reg::IDENT, 1), 0xff);
        t.w(reg::LIVENESS, 8, 0);
        t.w(reg::LIVENESS, 2, 0);
        assert_eq!(t.r32(reg::LIVENESS), 0, "no write took effect");
        t.w(reg::IRQ_RAISE, 2, 1);
        t.w(reg::IRQ_RAISE, 8, 1);
        assert_eq!(t.r32(reg::IRQ_STATUS), 0);
        // DMA registers take 4 and 8; upper halves are not registers of their own.
        t.w(reg::DMA_SRC, 8, 0x1_2345_6789);
        assert_eq!(t.r(reg::DMA_SRC, 8), 0x1_2345_6789);
        assert_eq!(t.r(reg::DMA_SRC, 4), 0x2345_6789);
        assert_eq!(t.r(reg::DMA_SRC + 4, 4), 0xffff_ffff);
        t.w(reg::DMA_SRC + 4, 4, 7);
        t.w(reg::DMA_SRC, 2, 7);
        assert_eq!(t.r(reg::DMA_SRC, 8), 0x1_2345_6789);
        t.w(reg::DMA_SRC, 4, 0x10);
        assert_eq!(t.r(reg::DMA_SRC, 8), 0x10, "4-byte write clears the top");
        // A command without the start bit is ignored.
        t.w(reg::DMA_CMD, 8, DMA_CMD_TO_RAM | DMA_CMD_IRQ);
        assert_eq!(t.r(reg::DMA_CMD, 8), 0);
        // Unknown, unaligned and far offsets; other BARs; oversized accesses.
        for off in [
            0x0c,
            0x10,
            0x28,
            0x68,
            0x81,
            0xa0,
            0x1000,
            0xf_fffc,
            1 << 40,
        ] {
            assert_eq!(t.r(off, 4), 0xffff_ffff, "{off:#x}");
            t.w(off, 4, 0xffff_ffff);
            t.w(off, 8, u64::MAX);
        }
        let mut big = [0u8; 16];
        t.edu.bar_read(0, 0, &mut big);
        assert_eq!(big, [0xff; 16]);
        t.edu.bar_write(0, reg::IRQ_RAISE, &[1; 16]);
        t.edu.bar_write(0, reg::IRQ_RAISE, &[]);
        t.edu.bar_read(0, 0, &mut []);
        t.edu.bar_read(3, 0, &mut big[..4]);
        t.edu.bar_write(3, reg::IRQ_RAISE, &[1, 0, 0, 0]);
        assert_eq!(t.r32(reg::IRQ_STATUS), 0);
        assert_eq!(t.r32(reg::IDENT), EDU_IDENT);
    }

    #[test]
    fn garbage_register_soup_never_panics() {
        let mut t = T::new();
        t.enable_msi(0x41);
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..20_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let off = [
                0x00, 0x04, 0x08, 0x20, 0x24, 0x60, 0x64, 0x80, 0x88, 0x90, 0x98, 0x9c,
            ][(x % 12) as usize];
            let len = [1usize, 2, 4, 8][((x >> 8) % 4) as usize];
            let v = x.rotate_left(17);
            if x & (1 << 40) != 0 {
                t.w(off, len, v);
            } else {
                t.r(off, len);
            }
            if x & 0xff == 0 {
                // Sometimes a good DMA: buffer window and low RAM.
                t.dma(
                    x & 0x3fff,
                    DMA_BUF_ADDR + (x >> 20) % 4096,
                    (x >> 32) % 64,
                    x & 6,
                );
            }
        }
        assert_eq!(t.r32(reg::IDENT), EDU_IDENT);
    }
}
