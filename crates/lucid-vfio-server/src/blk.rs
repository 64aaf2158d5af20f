//! virtio-blk (virtio 1.x, modern PCI transport) as a vfio-user device, over a disk file.
//!
//! The layout is Lucid's own virtio-pci's ([`lucid_pci::virtio`]), so a driver that finds
//! Lucid's virtio-blk finds this one the same way: BAR 1 (32-bit, 4 KiB) holds the MSI-X table
//! (offset 0) and PBA (0x800), which the client emulates; BAR 4 (64-bit, 16 KiB) holds the
//! common configuration (0x0000), ISR (0x1000), device configuration (0x2000) and notifications
//! (0x3000, queue `q` at `q * 4`). Vector 0 and 1 are free for the driver (config and queue).
//!
//! The split virtqueue is walked by hand through the [`DmaTable`], so every descriptor, ring
//! and buffer access is checked against the mappings (and refused, logged and signalled on ERR
//! as the contract says). A notify write processes the queue before the reply.

use std::fs::File;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use lucid_pci::config::{
    touches, Bar, BarKind, ConfigSpace, PciIds, CAP_ID_VENDOR, COMMAND, COMMAND_BUS_MASTER,
    LEGACY_CONFIG_SIZE,
};
use lucid_pci::virtio::{
    cap_type, common, status, COMMON_LEN, COMMON_OFFSET, DEVICE_LEN, DEVICE_OFFSET, ISR_OFFSET,
    MSIX_BAR, MSIX_BAR_SIZE, MSIX_PBA_OFFSET, NOTIFY_MULTIPLIER, NOTIFY_OFFSET, NO_VECTOR,
    VIRTIO_BAR, VIRTIO_BAR_SIZE, VIRTIO_PCI_DEVICE_BASE, VIRTIO_PCI_VENDOR,
};
use lucid_pci::{msix, EduDma};
use vfio_bindings::bindings::vfio::{
    vfio_region_info, VFIO_IRQ_INFO_EVENTFD, VFIO_IRQ_INFO_NORESIZE, VFIO_IRQ_SET_ACTION_TRIGGER,
    VFIO_IRQ_SET_ACTION_TYPE_MASK, VFIO_IRQ_SET_DATA_EVENTFD, VFIO_IRQ_SET_DATA_NONE,
    VFIO_IRQ_SET_DATA_TYPE_MASK, VFIO_REGION_INFO_FLAG_READ, VFIO_REGION_INFO_FLAG_WRITE,
};
use vfio_user::{DmaMapFlags, DmaUnmapFlags, IrqInfo, ServerBackend, ServerRegion};

use crate::dma::{DmaTable, FAULT_LOG_SIZE};
use crate::edu::EduServerError;
use crate::{CONFIG_REGION, ERR_IRQ, FAULT_LOG_REGION, MSIX_IRQ, NUM_IRQS, NUM_REGIONS};

/// The MSI-X BAR's region (BAR 1).
pub const BLK_MSIX_REGION: u32 = MSIX_BAR as u32;
/// The virtio structures' region (BAR 4).
pub const BLK_VIRTIO_REGION: u32 = VIRTIO_BAR as u32;
/// The largest queue the device accepts.
pub const QUEUE_MAX: u16 = 256;
/// One request queue.
pub const NUM_QUEUES: usize = 1;
/// MSI-X vectors: the configuration change vector and one per queue.
pub const VECTORS: u16 = NUM_QUEUES as u16 + 1;
pub const SECTOR: u64 = 512;

/// virtio-blk feature bits (virtio 1.2, 5.2.3) and the transport's.
pub mod feature {
    pub const SEG_MAX: u64 = 1 << 2;
    pub const RO: u64 = 1 << 5;
    pub const BLK_SIZE: u64 = 1 << 6;
    pub const FLUSH: u64 = 1 << 9;
    pub const VERSION_1: u64 = 1 << 32;
    pub const ACCESS_PLATFORM: u64 = 1 << 33;
}

/// Request types and status values (virtio 1.2, 5.2.6).
pub mod req {
    pub const IN: u32 = 0;
    pub const OUT: u32 = 1;
    pub const FLUSH: u32 = 4;
    pub const GET_ID: u32 = 8;
    pub const S_OK: u8 = 0;
    pub const S_IOERR: u8 = 1;
    pub const S_UNSUPP: u8 = 2;
}

const DESC_F_NEXT: u16 = 1;
const DESC_F_WRITE: u16 = 2;
const AVAIL_F_NO_INTERRUPT: u16 = 1;
const ISR_QUEUE: u8 = 1;
const ISR_CONFIG: u8 = 2;
/// The serial GET_ID answers (at most 20 bytes).
const SERIAL: &[u8] = b"lucid-vfio-blk";

const READ_WRITE: u32 = VFIO_REGION_INFO_FLAG_READ | VFIO_REGION_INFO_FLAG_WRITE;

/// The regions: BAR 1 (MSI-X), BAR 4 (virtio), config space, fault log. None is mappable.
pub fn blk_regions() -> Vec<ServerRegion> {
    (0..NUM_REGIONS)
        .map(|index| {
            let (size, flags) = match index {
                BLK_MSIX_REGION => (MSIX_BAR_SIZE, READ_WRITE),
                BLK_VIRTIO_REGION => (VIRTIO_BAR_SIZE, READ_WRITE),
                CONFIG_REGION => (LEGACY_CONFIG_SIZE as u64, READ_WRITE),
                FAULT_LOG_REGION => (FAULT_LOG_SIZE as u64, VFIO_REGION_INFO_FLAG_READ),
                _ => (0, 0),
            };
            ServerRegion {
                region_info: vfio_region_info {
                    argsz: std::mem::size_of::<vfio_region_info>() as u32,
                    flags,
                    index,
                    size,
                    ..Default::default()
                },
                sparse_areas: Vec::new(),
                mmap_fd: None,
            }
        })
        .collect()
}

/// The interrupts: MSI-X ([`VECTORS`]) and ERR; no INTx or MSI.
pub fn blk_irqs() -> Vec<IrqInfo> {
    (0..NUM_IRQS)
        .map(|index| {
            let (count, flags) = match index {
                MSIX_IRQ => (
                    VECTORS as u32,
                    VFIO_IRQ_INFO_EVENTFD | VFIO_IRQ_INFO_NORESIZE,
                ),
                ERR_IRQ => (1, VFIO_IRQ_INFO_EVENTFD),
                _ => (0, 0),
            };
            IrqInfo {
                index,
                flags,
                count,
            }
        })
        .collect()
}

/// What the device did, for the summary and tests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BlkStats {
    /// Requests completed (put in the used ring), whatever their status.
    pub requests: u64,
    /// Bytes read from the disk file for IN requests.
    pub disk_read: u64,
    /// Bytes written to the disk file by OUT requests.
    pub disk_written: u64,
    pub flushes: u64,
    /// Requests completed with IOERR (a refused buffer, out of range, read-only disk, I/O error).
    pub ioerr: u64,
    /// Requests completed with UNSUPP.
    pub unsupported: u64,
    /// Requests dropped (their status byte unreachable): the device then needs a reset.
    pub dropped: u64,
    /// MSI-X vector eventfd writes.
    pub interrupts: u64,
}

impl std::fmt::Display for BlkStats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "requests={} disk_read={} disk_written={} flushes={} ioerr={} unsupported={} dropped={} interrupts={}",
            self.requests,
            self.disk_read,
            self.disk_written,
            self.flushes,
            self.ioerr,
            self.unsupported,
            self.dropped,
            self.interrupts
        )
    }
}

/// [`BlkStats`] shared between the device and the summary.
#[derive(Default)]
pub struct BlkCounters {
    requests: AtomicU64,
    disk_read: AtomicU64,
    disk_written: AtomicU64,
    flushes: AtomicU64,
    ioerr: AtomicU64,
    unsupported: AtomicU64,
    dropped: AtomicU64,
    interrupts: AtomicU64,
}

impl BlkCounters {
    pub fn stats(&self) -> BlkStats {
        let l = |c: &AtomicU64| c.load(Ordering::Relaxed);
        BlkStats {
            requests: l(&self.requests),
            disk_read: l(&self.disk_read),
            disk_written: l(&self.disk_written),
            flushes: l(&self.flushes),
            ioerr: l(&self.ioerr),
            unsupported: l(&self.unsupported),
            dropped: l(&self.dropped),
            interrupts: l(&self.interrupts),
        }
    }
}

fn add(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

/// The disk the device serves.
pub struct Disk {
    file: File,
    readonly: bool,
    /// Its size in sectors when opened (a partial last sector is not offered).
    sectors: u64,
}

impl Disk {
    pub fn new(file: File, readonly: bool) -> std::io::Result<Self> {
        let sectors = file.metadata()?.len() / SECTOR;
        Ok(Disk {
            file,
            readonly,
            sectors,
        })
    }

    fn sectors(&self) -> u64 {
        self.sectors
    }
}

#[derive(Clone, Copy)]
struct Queue {
    size: u16,
    ready: bool,
    vector: u16,
    desc: u64,
    driver: u64,
    device: u64,
    last_avail: u16,
    next_used: u16,
}

impl Default for Queue {
    fn default() -> Self {
        Queue {
            size: QUEUE_MAX,
            ready: false,
            vector: NO_VECTOR,
            desc: 0,
            driver: 0,
            device: 0,
            last_avail: 0,
            next_used: 0,
        }
    }
}

/// One buffer of a descriptor chain.
#[derive(Clone, Copy)]
struct Seg {
    addr: u64,
    len: u32,
    write: bool,
}

/// A DMA the device could not make (refused, logged and signalled by the table).
struct Refused;

/// virtio-blk served over vfio-user.
pub struct BlkServer {
    cfg: ConfigSpace,
    dma: Arc<DmaTable>,
    disk: Arc<Disk>,
    counters: Arc<BlkCounters>,
    offered: u64,
    device_feature_select: u32,
    driver_feature_select: u32,
    driver_features: u64,
    msix_config: u16,
    status: u8,
    isr: u8,
    queue_select: u16,
    queues: [Queue; NUM_QUEUES],
    vectors: Vec<Option<File>>,
}

impl BlkServer {
    pub fn new(
        dma: Arc<DmaTable>,
        disk: Arc<Disk>,
        counters: Arc<BlkCounters>,
    ) -> Result<Self, EduServerError> {
        // The device's addresses are always the client's IOVAs (its vIOMMU's, or guest-physical
        // without one): a driver behind an IOMMU must translate them (virtio 1.2, 6.1).
        let mut offered = feature::VERSION_1
            | feature::ACCESS_PLATFORM
            | feature::SEG_MAX
            | feature::BLK_SIZE
            | feature::FLUSH;
        if disk.readonly {
            offered |= feature::RO;
        }
        Ok(BlkServer {
            cfg: config_space()?,
            dma,
            disk,
            counters,
            offered,
            device_feature_select: 0,
            driver_feature_select: 0,
            driver_features: 0,
            msix_config: NO_VECTOR,
            status: 0,
            isr: 0,
            queue_select: 0,
            queues: [Queue::default(); NUM_QUEUES],
            vectors: (0..VECTORS).map(|_| None).collect(),
        })
    }

    pub fn dma(&self) -> &Arc<DmaTable> {
        &self.dma
    }

    pub fn stats(&self) -> BlkStats {
        self.counters.stats()
    }

    /// The device status register.
    pub fn device_status(&self) -> u8 {
        self.status
    }

    /// The virtio reset (status 0): features, queues, ISR; the vectors' eventfds stay.
    fn virtio_reset(&mut self) {
        self.device_feature_select = 0;
        self.driver_feature_select = 0;
        self.driver_features = 0;
        self.msix_config = NO_VECTOR;
        self.status = 0;
        self.isr = 0;
        self.queue_select = 0;
        self.queues = [Queue::default(); NUM_QUEUES];
    }

    fn selected(&mut self) -> Option<&mut Queue> {
        self.queues.get_mut(self.queue_select as usize)
    }

    /// The common configuration structure as the driver reads it now.
    fn common_image(&self) -> [u8; COMMON_LEN as usize] {
        let mut b = [0u8; COMMON_LEN as usize];
        let mut put =
            |off: u64, v: &[u8]| b[off as usize..off as usize + v.len()].copy_from_slice(v);
        let half = |f: u64, sel: u32| -> u32 {
            match sel {
                0 => f as u32,
                1 => (f >> 32) as u32,
                _ => 0,
            }
        };
        put(
            common::DEVICE_FEATURE_SELECT,
            &self.device_feature_select.to_le_bytes(),
        );
        put(
            common::DEVICE_FEATURE,
            &half(self.offered, self.device_feature_select).to_le_bytes(),
        );
        put(
            common::DRIVER_FEATURE_SELECT,
            &self.driver_feature_select.to_le_bytes(),
        );
        put(
            common::DRIVER_FEATURE,
            &half(self.driver_features, self.driver_feature_select).to_le_bytes(),
        );
        put(common::CONFIG_MSIX_VECTOR, &self.msix_config.to_le_bytes());
        put(common::NUM_QUEUES, &(NUM_QUEUES as u16).to_le_bytes());
        put(common::DEVICE_STATUS, &[self.status]);
        put(common::CONFIG_GENERATION, &[0]);
        put(common::QUEUE_SELECT, &self.queue_select.to_le_bytes());
        if let Some(q) = self.queues.get(self.queue_select as usize) {
            put(common::QUEUE_SIZE, &q.size.to_le_bytes());
            put(common::QUEUE_MSIX_VECTOR, &q.vector.to_le_bytes());
            put(common::QUEUE_ENABLE, &(q.ready as u16).to_le_bytes());
            put(common::QUEUE_NOTIFY_OFF, &self.queue_select.to_le_bytes());
            put(common::QUEUE_DESC, &q.desc.to_le_bytes());
            put(common::QUEUE_DRIVER, &q.driver.to_le_bytes());
            put(common::QUEUE_DEVICE, &q.device.to_le_bytes());
        }
        b
    }

    fn common_write(&mut self, off: u64, data: &[u8]) {
        let mut b = [0u8; 8];
        let n = data.len().min(8);
        b[..n].copy_from_slice(&data[..n]);
        let v = u64::from_le_bytes(b);
        match off {
            common::DEVICE_FEATURE_SELECT => self.device_feature_select = v as u32,
            common::DRIVER_FEATURE_SELECT => self.driver_feature_select = v as u32,
            common::DRIVER_FEATURE if self.status & status::FEATURES_OK == 0 => {
                let v = v & 0xffff_ffff;
                match self.driver_feature_select {
                    0 => self.driver_features = (self.driver_features & !0xffff_ffff) | v,
                    1 => self.driver_features = (self.driver_features & 0xffff_ffff) | (v << 32),
                    _ => {}
                }
            }
            common::CONFIG_MSIX_VECTOR => self.msix_config = vector(v as u16),
            common::DEVICE_STATUS => self.write_status(v as u8),
            common::QUEUE_SELECT => self.queue_select = v as u16,
            common::QUEUE_SIZE => {
                let s = v as u16;
                if let Some(q) = self.selected().filter(|q| !q.ready) {
                    if s != 0 && s <= QUEUE_MAX && s.is_power_of_two() {
                        q.size = s;
                    }
                }
            }
            common::QUEUE_MSIX_VECTOR => {
                if let Some(q) = self.selected() {
                    q.vector = vector(v as u16);
                }
            }
            common::QUEUE_ENABLE => {
                if let Some(q) = self.selected() {
                    if v & 1 == 1 {
                        q.ready = true;
                    }
                }
            }
            o if (common::QUEUE_DESC..COMMON_LEN).contains(&o) => {
                if let Some(q) = self.selected().filter(|q| !q.ready) {
                    let (field, base) = match o {
                        o if o < common::QUEUE_DRIVER => (&mut q.desc, common::QUEUE_DESC),
                        o if o < common::QUEUE_DEVICE => (&mut q.driver, common::QUEUE_DRIVER),
                        _ => (&mut q.device, common::QUEUE_DEVICE),
                    };
                    let at = (o - base) as usize;
                    let mut bytes = field.to_le_bytes();
                    let n = data.len().min(8 - at);
                    bytes[at..at + n].copy_from_slice(&data[..n]);
                    *field = u64::from_le_bytes(bytes);
                }
            }
            _ => log::debug!("ignored common cfg write at {off:#x}"),
        }
    }

    fn write_status(&mut self, v: u8) {
        if v == 0 {
            self.virtio_reset();
            log::debug!("virtio reset");
            return;
        }
        let mut v = v;
        if v & status::FEATURES_OK != 0 && self.status & status::FEATURES_OK == 0 {
            let ok = self.driver_features & !self.offered == 0
                && self.driver_features & feature::VERSION_1 != 0;
            if !ok {
                log::warn!(
                    "driver features {:#x} refused (offered {:#x})",
                    self.driver_features,
                    self.offered
                );
                v &= !status::FEATURES_OK;
            }
        }
        // NEEDS_RESET is the device's to set.
        self.status = v | (self.status & status::NEEDS_RESET);
    }

    fn device_cfg(&self) -> [u8; 36] {
        let mut b = [0u8; 36];
        b[0..8].copy_from_slice(&self.disk.sectors().to_le_bytes());
        b[12..16].copy_from_slice(&(QUEUE_MAX as u32 - 2).to_le_bytes());
        b[20..24].copy_from_slice(&(SECTOR as u32).to_le_bytes());
        b[34..36].copy_from_slice(&(NUM_QUEUES as u16).to_le_bytes());
        b
    }

    fn virtio_read(&mut self, offset: u64, data: &mut [u8]) {
        data.fill(0);
        let window = |base: u64, size: u64| within(offset, data.len(), base, size);
        if window(COMMON_OFFSET, COMMON_LEN) {
            let img = self.common_image();
            let o = (offset - COMMON_OFFSET) as usize;
            data.copy_from_slice(&img[o..o + data.len()]);
        } else if offset == ISR_OFFSET {
            data[0] = std::mem::take(&mut self.isr);
        } else if window(DEVICE_OFFSET, DEVICE_LEN) {
            let img = self.device_cfg();
            let o = (offset - DEVICE_OFFSET) as usize;
            for (i, d) in data.iter_mut().enumerate() {
                *d = img.get(o + i).copied().unwrap_or(0);
            }
        }
    }

    fn virtio_write(&mut self, offset: u64, data: &[u8]) {
        if within(offset, data.len(), COMMON_OFFSET, COMMON_LEN) {
            self.common_write(offset - COMMON_OFFSET, data);
        } else if offset >= NOTIFY_OFFSET {
            let rel = offset - NOTIFY_OFFSET;
            let q = (rel / NOTIFY_MULTIPLIER as u64) as usize;
            if rel.is_multiple_of(NOTIFY_MULTIPLIER as u64) && q < NUM_QUEUES {
                self.process_queue(q);
            }
        }
    }

    fn read_u16(&self, addr: u64) -> Result<u16, Refused> {
        let mut b = [0u8; 2];
        self.dma.read(0, addr, &mut b).map_err(|_| Refused)?;
        Ok(u16::from_le_bytes(b))
    }

    /// The chain from `head`, or None when it is malformed (a loop, an index out of the table)
    /// or a descriptor is unreachable.
    fn chain(&self, q: &Queue, head: u16) -> Result<Option<Vec<Seg>>, Refused> {
        let mut segs = Vec::new();
        let mut i = head;
        loop {
            if i >= q.size || segs.len() >= q.size as usize {
                return Ok(None);
            }
            let mut d = [0u8; 16];
            self.dma
                .read(0, q.desc + i as u64 * 16, &mut d)
                .map_err(|_| Refused)?;
            let addr = u64::from_le_bytes(d[0..8].try_into().unwrap_or_default());
            let len = u32::from_le_bytes(d[8..12].try_into().unwrap_or_default());
            let flags = u16::from_le_bytes([d[12], d[13]]);
            let next = u16::from_le_bytes([d[14], d[15]]);
            segs.push(Seg {
                addr,
                len,
                write: flags & DESC_F_WRITE != 0,
            });
            if flags & DESC_F_NEXT == 0 {
                return Ok(Some(segs));
            }
            i = next;
        }
    }

    /// Processes the avail ring of queue `qi`; interrupts the driver if it completed any.
    fn process_queue(&mut self, qi: usize) {
        let q = self.queues[qi];
        if !q.ready
            || self.status & status::DRIVER_OK == 0
            || self.status & status::NEEDS_RESET != 0
        {
            return;
        }
        match self.drain(qi) {
            Ok(0) => {}
            Ok(_) => {
                let flags = self.read_u16(q.driver).unwrap_or(0);
                if flags & AVAIL_F_NO_INTERRUPT == 0 {
                    self.interrupt(ISR_QUEUE, q.vector);
                }
            }
            Err(Refused) => self.needs_reset(),
        }
    }

    /// Completes what the avail ring holds; Err when a ring or a status byte was unreachable.
    fn drain(&mut self, qi: usize) -> Result<u32, Refused> {
        let mut done = 0;
        loop {
            let q = self.queues[qi];
            let avail_idx = self.read_u16(q.driver + 2)?;
            if avail_idx == q.last_avail {
                return Ok(done);
            }
            let slot = (q.last_avail % q.size) as u64;
            let head = self.read_u16(q.driver + 4 + slot * 2)?;
            let Some(segs) = self.chain(&q, head)? else {
                log::warn!("queue {qi}: malformed chain at {head}");
                return Err(Refused);
            };
            let written = match self.request(&segs) {
                Some(n) => n,
                None => {
                    add(&self.counters.dropped, 1);
                    return Err(Refused);
                }
            };
            let used = q.device + 4 + (q.next_used % q.size) as u64 * 8;
            let mut elem = [0u8; 8];
            elem[0..4].copy_from_slice(&(head as u32).to_le_bytes());
            elem[4..8].copy_from_slice(&written.to_le_bytes());
            self.dma.write(0, used, &elem).map_err(|_| Refused)?;
            let next_used = q.next_used.wrapping_add(1);
            self.dma
                .write(0, q.device + 2, &next_used.to_le_bytes())
                .map_err(|_| Refused)?;
            let q = &mut self.queues[qi];
            q.next_used = next_used;
            q.last_avail = q.last_avail.wrapping_add(1);
            add(&self.counters.requests, 1);
            done += 1;
        }
    }

    /// Runs one request; the bytes written to its writable buffers, or None when its status
    /// byte is unreachable (the request is dropped).
    fn request(&self, segs: &[Seg]) -> Option<u32> {
        let readable: Vec<Seg> = segs.iter().copied().filter(|s| !s.write).collect();
        let writable: Vec<Seg> = segs
            .iter()
            .copied()
            .filter(|s| s.write && s.len > 0)
            .collect();
        let wlen: u64 = writable.iter().map(|s| s.len as u64).sum();
        if wlen == 0 {
            return None;
        }
        // The status byte is the last writable byte; the data in front of it.
        let status_addr = {
            let last = writable.last()?;
            last.addr.wrapping_add(last.len as u64 - 1)
        };
        let data_in = wlen - 1;
        let mut header = [0u8; 16];
        let status = match gather(&self.dma, &readable, 0, &mut header) {
            Err(Refused) => req::S_IOERR,
            Ok(()) => {
                let rtype = u32::from_le_bytes(header[0..4].try_into().unwrap_or_default());
                let sector = u64::from_le_bytes(header[8..16].try_into().unwrap_or_default());
                self.execute(rtype, sector, &readable, &writable, data_in)
            }
        };
        let written = match status {
            req::S_OK => data_in + 1,
            _ => 1,
        };
        match status {
            req::S_IOERR => add(&self.counters.ioerr, 1),
            req::S_UNSUPP => add(&self.counters.unsupported, 1),
            _ => {}
        }
        self.dma.write(0, status_addr, &[status]).ok()?;
        Some(written as u32)
    }

    fn execute(
        &self,
        rtype: u32,
        sector: u64,
        readable: &[Seg],
        writable: &[Seg],
        data_in: u64,
    ) -> u8 {
        let rlen: u64 = readable.iter().map(|s| s.len as u64).sum();
        let data_out = rlen.saturating_sub(16);
        let in_range = |len: u64| {
            sector
                .checked_mul(SECTOR)
                .and_then(|o| o.checked_add(len))
                .is_some_and(|end| end <= self.disk.sectors() * SECTOR)
        };
        match rtype {
            req::IN => {
                if !in_range(data_in) {
                    return req::S_IOERR;
                }
                let mut buf = vec![0u8; data_in as usize];
                if self
                    .disk
                    .file
                    .read_exact_at(&mut buf, sector * SECTOR)
                    .is_err()
                {
                    return req::S_IOERR;
                }
                if scatter(&self.dma, writable, &buf).is_err() {
                    return req::S_IOERR;
                }
                add(&self.counters.disk_read, data_in);
                req::S_OK
            }
            req::OUT => {
                if self.disk.readonly || !in_range(data_out) {
                    return req::S_IOERR;
                }
                let mut buf = vec![0u8; data_out as usize];
                if gather(&self.dma, readable, 16, &mut buf).is_err() {
                    return req::S_IOERR;
                }
                if self.disk.file.write_all_at(&buf, sector * SECTOR).is_err() {
                    return req::S_IOERR;
                }
                add(&self.counters.disk_written, data_out);
                req::S_OK
            }
            req::FLUSH => {
                add(&self.counters.flushes, 1);
                match self.disk.readonly || self.disk.file.sync_data().is_ok() {
                    true => req::S_OK,
                    false => req::S_IOERR,
                }
            }
            req::GET_ID => {
                let mut id = [0u8; 20];
                id[..SERIAL.len()].copy_from_slice(SERIAL);
                let n = (data_in as usize).min(id.len());
                match scatter(&self.dma, writable, &id[..n]) {
                    Ok(()) => req::S_OK,
                    Err(Refused) => req::S_IOERR,
                }
            }
            _ => req::S_UNSUPP,
        }
    }

    /// Sets ISR `bits` and signals `vector`'s eventfd, if the driver gave one.
    fn interrupt(&mut self, bits: u8, vector: u16) {
        self.isr |= bits;
        if let Some(Some(f)) = self.vectors.get_mut(vector as usize) {
            match f.write_all(&1u64.to_ne_bytes()) {
                Ok(()) => add(&self.counters.interrupts, 1),
                Err(e) => log::warn!("MSI-X vector {vector}: {e}"),
            }
        }
    }

    /// The device cannot go on (a ring or status byte it may not reach): DEVICE_NEEDS_RESET and
    /// a configuration change interrupt.
    fn needs_reset(&mut self) {
        log::warn!("virtqueue unreachable: the device needs a reset");
        self.status |= status::NEEDS_RESET;
        self.interrupt(ISR_CONFIG, self.msix_config);
    }

    fn config_written(&mut self, off: usize, len: usize) {
        if touches(off, len, COMMAND, 2) {
            let on = self.cfg.command() & COMMAND_BUS_MASTER != 0;
            self.dma.set_bus_master(0, on);
        }
    }

    fn set_irqs_inner(
        &mut self,
        index: u32,
        flags: u32,
        start: u32,
        count: u32,
        fds: Vec<File>,
    ) -> Result<(), EduServerError> {
        let refused = EduServerError::SetIrqs {
            index,
            flags,
            start,
            count,
            fds: fds.len(),
        };
        let data = flags & VFIO_IRQ_SET_DATA_TYPE_MASK;
        let action = flags & VFIO_IRQ_SET_ACTION_TYPE_MASK;
        if action != VFIO_IRQ_SET_ACTION_TRIGGER {
            return Err(refused);
        }
        match (index, data) {
            (MSIX_IRQ, VFIO_IRQ_SET_DATA_EVENTFD)
                if fds.len() == count as usize && start + count <= VECTORS as u32 =>
            {
                if count == 0 {
                    self.vectors.iter_mut().for_each(|v| *v = None);
                }
                for (i, f) in fds.into_iter().enumerate() {
                    self.vectors[start as usize + i] = Some(f);
                }
            }
            (MSIX_IRQ, VFIO_IRQ_SET_DATA_NONE) if fds.is_empty() && count == 0 => {
                self.vectors.iter_mut().for_each(|v| *v = None);
            }
            (ERR_IRQ, VFIO_IRQ_SET_DATA_EVENTFD) if start == 0 && count <= 1 => {
                self.dma.set_err_eventfd(fds.into_iter().next());
            }
            _ => return Err(refused),
        }
        log::debug!("SET_IRQS index {index} flags {flags:#x} start {start} count {count}");
        Ok(())
    }
}

/// Whether `len` bytes at `offset` lie in `[base, base + size)`.
fn within(offset: u64, len: usize, base: u64, size: u64) -> bool {
    offset
        .checked_sub(base)
        .is_some_and(|o| o + len as u64 <= size)
}

/// A vector number the device has, or NO_VECTOR.
fn vector(v: u16) -> u16 {
    if v < VECTORS {
        v
    } else {
        NO_VECTOR
    }
}

/// Reads `out.len()` bytes from the buffers `segs`, starting `skip` bytes in.
fn gather(dma: &DmaTable, segs: &[Seg], mut skip: u64, out: &mut [u8]) -> Result<(), Refused> {
    let mut done = 0usize;
    for s in segs {
        if done == out.len() {
            break;
        }
        let len = s.len as u64;
        if skip >= len {
            skip -= len;
            continue;
        }
        let n = ((len - skip) as usize).min(out.len() - done);
        dma.read(0, s.addr + skip, &mut out[done..done + n])
            .map_err(|_| Refused)?;
        done += n;
        skip = 0;
    }
    match done == out.len() {
        true => Ok(()),
        false => Err(Refused),
    }
}

/// Writes `data` into the buffers `segs`, from their start; nothing when one of them may not be
/// written (that one's refusal is recorded).
fn scatter(dma: &DmaTable, segs: &[Seg], data: &[u8]) -> Result<(), Refused> {
    let mut left = data.len();
    for s in segs {
        let n = (s.len as usize).min(left);
        if n == 0 {
            break;
        }
        if !dma.permits(s.addr, n as u64, true) {
            // Refused again, with the fault logged and ERR written; no byte moves.
            let _ = dma.write(0, s.addr, &data[..n]);
            return Err(Refused);
        }
        left -= n;
    }
    let mut done = 0usize;
    for s in segs {
        if done == data.len() {
            break;
        }
        let n = (s.len as usize).min(data.len() - done);
        dma.write(0, s.addr, &data[done..done + n])
            .map_err(|_| Refused)?;
        done += n;
    }
    Ok(())
}

/// The config space: Lucid's virtio-pci header, BARs and capabilities (without the PCI
/// configuration access capability), MSI-X with [`VECTORS`] vectors in BAR 1.
fn config_space() -> Result<ConfigSpace, lucid_pci::PciError> {
    let mut cfg = ConfigSpace::new(PciIds {
        vendor: VIRTIO_PCI_VENDOR,
        device: VIRTIO_PCI_DEVICE_BASE + 2,
        revision: 1,
        class: (0x01, 0x00, 0x00),
        subsystem_vendor: VIRTIO_PCI_VENDOR,
        subsystem: 0x1100,
    });
    cfg.add_bar(
        MSIX_BAR,
        Bar {
            kind: BarKind::Mmio32 {
                prefetchable: false,
            },
            size: MSIX_BAR_SIZE,
        },
    )?;
    cfg.add_bar(
        VIRTIO_BAR,
        Bar {
            kind: BarKind::Mmio64 {
                prefetchable: false,
            },
            size: VIRTIO_BAR_SIZE,
        },
    )?;
    let vcap = |t: u8, off: u64, len: u64| -> Vec<u8> {
        let mut b = vec![16, t, VIRTIO_BAR as u8, 0, 0, 0];
        b.extend_from_slice(&(off as u32).to_le_bytes());
        b.extend_from_slice(&(len as u32).to_le_bytes());
        b
    };
    cfg.add_capability(
        CAP_ID_VENDOR,
        &vcap(cap_type::COMMON, COMMON_OFFSET, COMMON_LEN),
        &[],
    )?;
    let mut notify = vcap(
        cap_type::NOTIFY,
        NOTIFY_OFFSET,
        NUM_QUEUES as u64 * NOTIFY_MULTIPLIER as u64,
    );
    notify[0] = 20;
    notify.extend_from_slice(&NOTIFY_MULTIPLIER.to_le_bytes());
    cfg.add_capability(CAP_ID_VENDOR, &notify, &[])?;
    cfg.add_capability(CAP_ID_VENDOR, &vcap(cap_type::ISR, ISR_OFFSET, 1), &[])?;
    cfg.add_capability(
        CAP_ID_VENDOR,
        &vcap(cap_type::DEVICE, DEVICE_OFFSET, DEVICE_LEN),
        &[],
    )?;
    msix::add_capability(&mut cfg, VECTORS, MSIX_BAR as u8, 0, MSIX_PBA_OFFSET as u32)?;
    Ok(cfg)
}

fn check(region: u32, offset: u64, len: usize, size: u64) -> Result<(), EduServerError> {
    match offset.checked_add(len as u64) {
        Some(end) if end <= size => Ok(()),
        _ => Err(EduServerError::Outside {
            region,
            offset,
            len,
            size,
        }),
    }
}

impl ServerBackend for BlkServer {
    fn region_read(&mut self, region: u32, offset: u64, data: &mut [u8]) -> std::io::Result<()> {
        match region {
            BLK_VIRTIO_REGION => {
                check(region, offset, data.len(), VIRTIO_BAR_SIZE)?;
                self.virtio_read(offset, data);
            }
            // The client emulates the MSI-X table and PBA.
            BLK_MSIX_REGION => {
                check(region, offset, data.len(), MSIX_BAR_SIZE)?;
                data.fill(0);
            }
            CONFIG_REGION => {
                check(region, offset, data.len(), LEGACY_CONFIG_SIZE as u64)?;
                self.cfg.read(offset as usize, data);
            }
            FAULT_LOG_REGION => {
                check(region, offset, data.len(), FAULT_LOG_SIZE as u64)?;
                self.dma.read_fault_log(offset, data);
            }
            _ => return Err(EduServerError::NoRegion(region).into()),
        }
        Ok(())
    }

    fn region_write(&mut self, region: u32, offset: u64, data: &[u8]) -> std::io::Result<()> {
        match region {
            // A notify runs the queue here: its faults are logged and ERR signalled before the
            // reply.
            BLK_VIRTIO_REGION => {
                check(region, offset, data.len(), VIRTIO_BAR_SIZE)?;
                self.virtio_write(offset, data);
            }
            BLK_MSIX_REGION => check(region, offset, data.len(), MSIX_BAR_SIZE)?,
            CONFIG_REGION => {
                check(region, offset, data.len(), LEGACY_CONFIG_SIZE as u64)?;
                let off = offset as usize;
                self.cfg.write(off, data);
                self.config_written(off, data.len());
            }
            FAULT_LOG_REGION => return Err(EduServerError::ReadOnly(region).into()),
            _ => return Err(EduServerError::NoRegion(region).into()),
        }
        Ok(())
    }

    fn dma_map(
        &mut self,
        flags: DmaMapFlags,
        offset: u64,
        address: u64,
        size: u64,
        fd: Option<File>,
    ) -> std::io::Result<()> {
        self.dma
            .map(flags, offset, address, size, fd.as_ref())
            .inspect_err(|e| log::warn!("{e}"))?;
        Ok(())
    }

    fn dma_unmap(&mut self, flags: DmaUnmapFlags, address: u64, size: u64) -> std::io::Result<()> {
        self.dma
            .unmap(flags, address, size)
            .inspect_err(|e| log::warn!("{e}"))?;
        Ok(())
    }

    /// The function's reset: virtio state and config space fresh; mappings and eventfds stay.
    fn reset(&mut self) -> std::io::Result<()> {
        self.virtio_reset();
        self.cfg = config_space().map_err(EduServerError::from)?;
        self.dma.set_bus_master(0, false);
        log::info!("device reset");
        Ok(())
    }

    fn set_irqs(
        &mut self,
        index: u32,
        flags: u32,
        start: u32,
        count: u32,
        fds: Vec<File>,
    ) -> std::io::Result<()> {
        self.set_irqs_inner(index, flags, start, count, fds)
            .inspect_err(|e| log::warn!("{e}"))?;
        Ok(())
    }
}
