//! QEMU's fw_cfg, its x86 I/O-port interface as QEMU's `docs/specs/fw_cfg.rst` specifies it:
//! guests written for QEMU read their processor count, RAM size and command line there (and,
//! without it, read 0xffff processors from an unclaimed port and wait for them forever).
//!
//! Ports (offsets from [`FW_CFG_PORT`]): selector at +0 (16-bit write, little-endian; selects an
//! item and rewinds it), data at +1 (each byte read returns the item's next byte, 0 past its
//! end; writes are ignored, as on QEMU since 2.4), the DMA address at +4 (high 32 bits) and +8
//! (low 32 bits, which starts the transfer), each written big-endian. Reading +4..+12 gives the
//! DMA signature `QEMU CFG`.
//!
//! A DMA transfer reads the guest's `FWCfgDmaAccess` {control, length, address} (big-endian) at
//! the written address, optionally selects (`control >> 16`), then reads, skips or writes
//! `length` bytes; a read past the item's end fills zeros. It completes before the port write
//! returns and stores the control word back: 0, or [`dma_ctl::ERROR`] when a guest address is
//! not RAM or the operation is a write (no item here is writable). All guest memory goes
//! through the DMA path, untranslated: no vIOMMU sits in front of fw_cfg on QEMU either.
//!
//! Items: the signature, the ID (DMA supported), the CPU count (`NB_CPUS`, `MAX_CPUS`), the RAM
//! size, the kernel command line, and the file directory with the files [`FwCfg::add_file`]
//! adds (sorted by name as QEMU sorts them; the VMM adds `etc/e820`).
//!
//! Counters: `fw_cfg.selects` (selector writes and DMA selects), `fw_cfg.reads` (data-port
//! reads), `fw_cfg.dma_ops`, `fw_cfg.dma_errors` (transfers that ended with the error bit).

use std::collections::BTreeMap;
use std::sync::Arc;

use lucid_mem::{DeviceId, DmaPath};
use lucid_stats::{Counter, StatsRegistry};

use crate::BusDevice;

/// The selector port; the device spans [`FW_CFG_LEN`] ports from here.
pub const FW_CFG_PORT: u16 = 0x510;
/// Selector (2), data (1), a gap, and the 8-byte DMA address.
pub const FW_CFG_LEN: u64 = 0x0c;
/// The ACPI `_HID` Linux's `qemu_fw_cfg` driver binds.
pub const FW_CFG_ACPI_HID: &str = "QEMU0002";
/// What a guest reads at the DMA address port.
pub const FW_CFG_DMA_SIGNATURE: [u8; 8] = *b"QEMU CFG";
/// The DMA path's device number for fw_cfg: bus 0xff, the pseudo-bus of platform devices.
pub const FW_CFG_DEVICE_ID: DeviceId = 0xff10;
/// Length of a file name in a directory entry, NUL included.
pub const FILE_NAME_LEN: usize = 56;
/// Most files: their keys run from [`keys::FILE_FIRST`] up to the write bit.
pub const MAX_FILES: usize = 0x4000 - keys::FILE_FIRST as usize;

const OFF_SELECTOR: u64 = 0;
const OFF_DATA: u64 = 1;
const OFF_DMA: u64 = 4;
const OFF_DMA_LO: u64 = 8;

/// Item keys (QEMU's `FW_CFG_*`).
pub mod keys {
    pub const SIGNATURE: u16 = 0x00;
    pub const ID: u16 = 0x01;
    pub const RAM_SIZE: u16 = 0x03;
    pub const NB_CPUS: u16 = 0x05;
    pub const MAX_CPUS: u16 = 0x0f;
    pub const CMDLINE_SIZE: u16 = 0x14;
    pub const CMDLINE_DATA: u16 = 0x15;
    pub const FILE_DIR: u16 = 0x19;
    pub const FILE_FIRST: u16 = 0x20;
    /// Set in a selector: the guest means to write (the item is still selected).
    pub const WRITE_CHANNEL: u16 = 0x4000;
}

/// `FWCfgDmaAccess.control` bits.
pub mod dma_ctl {
    pub const ERROR: u32 = 1 << 0;
    pub const READ: u32 = 1 << 1;
    pub const SKIP: u32 = 1 << 2;
    pub const SELECT: u32 = 1 << 3;
    pub const WRITE: u32 = 1 << 4;
}

/// `FW_CFG_ID` bits.
const ID_TRADITIONAL: u32 = 1 << 0;
const ID_DMA: u32 = 1 << 1;

/// The `etc/e820` entry types.
pub const E820_RAM: u32 = 1;
pub const E820_RESERVED: u32 = 2;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum FwCfgError {
    #[error("fw_cfg file name {0:?}: empty, or longer than {max} bytes", max = FILE_NAME_LEN - 1)]
    BadName(String),
    #[error("fw_cfg file {0:?} exists already")]
    NameTaken(String),
    #[error("fw_cfg file {0:?}: more than {MAX_FILES} files, or one over 4 GiB")]
    TooMany(String),
}

struct Counters {
    selects: Arc<Counter>,
    reads: Arc<Counter>,
    dma_ops: Arc<Counter>,
    dma_errors: Arc<Counter>,
}

pub struct FwCfg {
    /// The fixed items, by key.
    items: BTreeMap<u16, Vec<u8>>,
    /// The files, sorted by name; file `i` has key `FILE_FIRST + i`.
    files: Vec<(String, Vec<u8>)>,
    selector: u16,
    offset: usize,
    dma_high: u32,
    /// `None`: no DMA interface (the ID says so, and address writes are ignored).
    dma: Option<Arc<DmaPath>>,
    counters: Counters,
}

impl FwCfg {
    /// The device with its signature, ID and an empty directory; the CPU count, RAM size and
    /// command line are empty until set.
    pub fn new(dma: Option<Arc<DmaPath>>, stats: &StatsRegistry) -> Self {
        let mut items = BTreeMap::new();
        items.insert(keys::SIGNATURE, b"QEMU".to_vec());
        let id = ID_TRADITIONAL | if dma.is_some() { ID_DMA } else { 0 };
        items.insert(keys::ID, id.to_le_bytes().to_vec());
        let mut dev = FwCfg {
            items,
            files: Vec::new(),
            selector: 0,
            offset: 0,
            dma_high: 0,
            dma,
            counters: Counters {
                selects: stats.counter("fw_cfg.selects"),
                reads: stats.counter("fw_cfg.reads"),
                dma_ops: stats.counter("fw_cfg.dma_ops"),
                dma_errors: stats.counter("fw_cfg.dma_errors"),
            },
        };
        dev.update_dir();
        dev
    }

    /// `NB_CPUS` and `MAX_CPUS` (Lucid has no CPU hotplug: both are the vCPU count).
    pub fn set_cpus(&mut self, n: u16) {
        self.items.insert(keys::NB_CPUS, n.to_le_bytes().to_vec());
        self.items.insert(keys::MAX_CPUS, n.to_le_bytes().to_vec());
    }

    pub fn set_ram_size(&mut self, bytes: u64) {
        self.items
            .insert(keys::RAM_SIZE, bytes.to_le_bytes().to_vec());
    }

    /// `CMDLINE_SIZE` (with the NUL) and `CMDLINE_DATA` (NUL-terminated), as QEMU gives them.
    pub fn set_cmdline(&mut self, cmdline: &str) {
        let mut data = cmdline.as_bytes().to_vec();
        data.push(0);
        self.items.insert(
            keys::CMDLINE_SIZE,
            (data.len() as u32).to_le_bytes().to_vec(),
        );
        self.items.insert(keys::CMDLINE_DATA, data);
    }

    /// Sets a fixed item (a key below [`keys::FILE_FIRST`]) to `data`.
    pub fn set_item(&mut self, key: u16, data: Vec<u8>) {
        if key < keys::FILE_FIRST && key != keys::FILE_DIR {
            self.items.insert(key, data);
        }
    }

    /// Adds file `name` to the directory; returns its key (keys follow the name order, so a
    /// later file may move earlier ones: add every file before the guest runs).
    pub fn add_file(&mut self, name: &str, data: Vec<u8>) -> Result<u16, FwCfgError> {
        if name.is_empty() || name.len() >= FILE_NAME_LEN || name.contains('\0') {
            return Err(FwCfgError::BadName(name.into()));
        }
        if self.files.len() >= MAX_FILES || u32::try_from(data.len()).is_err() {
            return Err(FwCfgError::TooMany(name.into()));
        }
        let i = match self.files.binary_search_by(|(n, _)| n.as_str().cmp(name)) {
            Ok(_) => return Err(FwCfgError::NameTaken(name.into())),
            Err(i) => i,
        };
        self.files.insert(i, (name.into(), data));
        self.update_dir();
        Ok(keys::FILE_FIRST + i as u16)
    }

    /// The file directory: a big-endian count, then {size, select, reserved, name} each.
    fn update_dir(&mut self) {
        let mut dir = (self.files.len() as u32).to_be_bytes().to_vec();
        for (i, (name, data)) in self.files.iter().enumerate() {
            dir.extend_from_slice(&(data.len() as u32).to_be_bytes());
            dir.extend_from_slice(&(keys::FILE_FIRST + i as u16).to_be_bytes());
            dir.extend_from_slice(&0u16.to_be_bytes());
            let mut n = [0u8; FILE_NAME_LEN];
            n[..name.len()].copy_from_slice(name.as_bytes());
            dir.extend_from_slice(&n);
        }
        self.items.insert(keys::FILE_DIR, dir);
    }

    /// The selected item's bytes (none for an unknown key: it reads as zeros).
    fn item(&self) -> &[u8] {
        let key = self.selector & !keys::WRITE_CHANNEL;
        let data = match key.checked_sub(keys::FILE_FIRST) {
            Some(i) => self.files.get(i as usize).map(|f| &f.1),
            None => self.items.get(&key),
        };
        data.map_or(&[], |d| d.as_slice())
    }

    fn select(&mut self, key: u16) {
        self.counters.selects.inc();
        self.selector = key;
        self.offset = 0;
    }

    /// Carries out the `FWCfgDmaAccess` at guest-physical `addr` and stores its control word
    /// back (0, or the error bit).
    fn dma_transfer(&mut self, addr: u64) {
        self.counters.dma_ops.inc();
        let Some(dma) = self.dma.clone() else { return };
        let mut hdr = [0u8; 16];
        let ok = match dma.read_physical(FW_CFG_DEVICE_ID, addr, &mut hdr) {
            Ok(()) => self.run_dma(&dma, &hdr),
            Err(e) => {
                log::debug!("fw_cfg: DMA access descriptor: {e}");
                false
            }
        };
        if !ok {
            self.counters.dma_errors.inc();
        }
        let control = if ok { 0 } else { dma_ctl::ERROR };
        if let Err(e) = dma.write_physical(FW_CFG_DEVICE_ID, addr, &control.to_be_bytes()) {
            log::debug!("fw_cfg: DMA control word: {e}");
        }
    }

    /// The transfer a `FWCfgDmaAccess` asks for; false on an error.
    fn run_dma(&mut self, dma: &DmaPath, hdr: &[u8; 16]) -> bool {
        let be32 = |b: &[u8]| u32::from_be_bytes([b[0], b[1], b[2], b[3]]);
        let control = be32(&hdr[0..4]);
        let mut length = u64::from(be32(&hdr[4..8]));
        let mut address = u64::from_be_bytes(hdr[8..16].try_into().unwrap_or_default());
        if control & dma_ctl::SELECT != 0 {
            self.select((control >> 16) as u16);
        }
        let (read, write) = if control & dma_ctl::READ != 0 {
            (true, false)
        } else if control & dma_ctl::WRITE != 0 {
            (false, true)
        } else if control & dma_ctl::SKIP != 0 {
            (false, false)
        } else {
            return true;
        };
        const ZEROS: [u8; 4096] = [0; 4096];
        while length > 0 {
            let item = self.item();
            let avail = item.len().saturating_sub(self.offset);
            let n = if avail == 0 {
                // Past the end: a read gets zeros, at most a page per copy.
                length.min(ZEROS.len() as u64)
            } else {
                length.min(avail as u64)
            };
            if write {
                log::debug!("fw_cfg: DMA write to item {:#x} refused", self.selector);
                return false;
            }
            if read {
                let src = match avail {
                    0 => &ZEROS[..n as usize],
                    _ => &item[self.offset..self.offset + n as usize],
                };
                if let Err(e) = dma.write_physical(FW_CFG_DEVICE_ID, address, src) {
                    log::debug!("fw_cfg: DMA read of item {:#x}: {e}", self.selector);
                    return false;
                }
            }
            if avail > 0 {
                self.offset += n as usize;
            }
            length -= n;
            address = address.wrapping_add(n);
        }
        true
    }
}

impl BusDevice for FwCfg {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        match offset {
            OFF_DATA => {
                for b in data.iter_mut() {
                    self.counters.reads.inc();
                    *b = self.item().get(self.offset).copied().unwrap_or(0);
                    if self.offset < self.item().len() {
                        self.offset += 1;
                    }
                }
            }
            OFF_DMA..FW_CFG_LEN => {
                for (i, b) in data.iter_mut().enumerate() {
                    let at = (offset - OFF_DMA) as usize + i;
                    *b = FW_CFG_DMA_SIGNATURE.get(at).copied().unwrap_or(0);
                }
            }
            _ => data.fill(0),
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        let mut v = [0u8; 8];
        let n = data.len().min(8);
        v[..n].copy_from_slice(&data[..n]);
        match (offset, n) {
            (OFF_SELECTOR, 1..) => self.select(u16::from_le_bytes([v[0], v[1]])),
            (OFF_DMA, 8) if self.dma.is_some() => {
                self.dma_transfer(u64::from_be_bytes(v));
            }
            (OFF_DMA, 4) => self.dma_high = u32::from_be_bytes([v[0], v[1], v[2], v[3]]),
            (OFF_DMA_LO, 4) if self.dma.is_some() => {
                let low = u32::from_be_bytes([v[0], v[1], v[2], v[3]]);
                let addr = (u64::from(self.dma_high) << 32) | u64::from(low);
                self.dma_high = 0;
                self.dma_transfer(addr);
            }
            _ => {}
        }
    }
}

/// QEMU's `etc/e820`: packed little-endian {address: u64, length: u64, type: u32} entries.
pub fn e820_file(entries: &[(u64, u64, u32)]) -> Vec<u8> {
    let mut v = Vec::with_capacity(entries.len() * 20);
    for (addr, len, kind) in entries {
        v.extend_from_slice(&addr.to_le_bytes());
        v.extend_from_slice(&len.to_le_bytes());
        v.extend_from_slice(&kind.to_le_bytes());
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;
    use lucid_mem::{Backing, GuestRam};

    const RAM: u64 = 0x10_0000;

    fn dev(dma: bool) -> (FwCfg, Option<Arc<DmaPath>>, Arc<StatsRegistry>) {
        let stats = StatsRegistry::new();
        let path = dma.then(|| {
            let ram = GuestRam::new(&[(0, RAM)], Backing::Anonymous).unwrap();
            DmaPath::new(ram.memory().clone(), &stats)
        });
        let mut d = FwCfg::new(path.clone(), &stats);
        d.set_cpus(3);
        d.set_ram_size(RAM);
        d.set_cmdline("console=ttyS0");
        d.add_file("etc/e820", e820_file(&[(0, RAM, E820_RAM)]))
            .unwrap();
        (d, path, stats)
    }

    fn select(d: &mut FwCfg, key: u16) {
        d.write(OFF_SELECTOR, &key.to_le_bytes());
    }

    fn read_bytes(d: &mut FwCfg, n: usize) -> Vec<u8> {
        let mut v = vec![0u8; n];
        for b in v.iter_mut() {
            d.read(OFF_DATA, std::slice::from_mut(b));
        }
        v
    }

    fn dma_access(d: &mut FwCfg, at: u64) {
        d.write(OFF_DMA, &((at >> 32) as u32).to_be_bytes());
        d.write(OFF_DMA_LO, &(at as u32).to_be_bytes());
    }

    fn put_access(mem: &DmaPath, at: u64, control: u32, len: u32, addr: u64) {
        let mut a = control.to_be_bytes().to_vec();
        a.extend_from_slice(&len.to_be_bytes());
        a.extend_from_slice(&addr.to_be_bytes());
        mem.write(0, at, &a).unwrap();
    }

    fn control(mem: &DmaPath, at: u64) -> u32 {
        let mut c = [0u8; 4];
        mem.read(0, at, &mut c).unwrap();
        u32::from_be_bytes(c)
    }

    #[test]
    fn signature_id_and_the_fixed_items() {
        let (mut d, _, stats) = dev(true);
        select(&mut d, keys::SIGNATURE);
        assert_eq!(read_bytes(&mut d, 6), b"QEMU\0\0");
        select(&mut d, keys::ID);
        assert_eq!(read_bytes(&mut d, 4), [3, 0, 0, 0]);
        select(&mut d, keys::NB_CPUS);
        assert_eq!(read_bytes(&mut d, 2), [3, 0]);
        select(&mut d, keys::MAX_CPUS);
        assert_eq!(read_bytes(&mut d, 2), [3, 0]);
        select(&mut d, keys::RAM_SIZE);
        assert_eq!(read_bytes(&mut d, 8), RAM.to_le_bytes());
        select(&mut d, keys::CMDLINE_SIZE);
        assert_eq!(read_bytes(&mut d, 4), 14u32.to_le_bytes());
        select(&mut d, keys::CMDLINE_DATA);
        assert_eq!(read_bytes(&mut d, 14), b"console=ttyS0\0");
        // An unknown key reads as zeros; a wide read of the data port reads on.
        select(&mut d, 0x1234);
        assert_eq!(read_bytes(&mut d, 2), [0, 0]);
        select(&mut d, keys::SIGNATURE);
        let mut w = [0u8; 4];
        d.read(OFF_DATA, &mut w);
        assert_eq!(&w, b"QEMU");
        assert_eq!(stats.counter("fw_cfg.selects").get(), 9);
        assert_eq!(stats.counter("fw_cfg.reads").get(), 46);
        // The DMA signature, in two 32-bit reads.
        let (mut hi, mut lo) = ([0u8; 4], [0u8; 4]);
        d.read(OFF_DMA, &mut hi);
        d.read(OFF_DMA_LO, &mut lo);
        assert_eq!([hi, lo].concat(), b"QEMU CFG");
        // Without a DMA path, the ID says so.
        let (mut d, _, _) = dev(false);
        select(&mut d, keys::ID);
        assert_eq!(read_bytes(&mut d, 4), [1, 0, 0, 0]);
    }

    #[test]
    fn the_directory_is_sorted_and_names_its_keys() {
        let (mut d, _, _) = dev(false);
        assert_eq!(d.add_file("etc/a", vec![7; 3]), Ok(0x20));
        assert_eq!(
            d.add_file("etc/a", vec![]),
            Err(FwCfgError::NameTaken("etc/a".into()))
        );
        assert!(d.add_file(&"x".repeat(56), vec![]).is_err());
        assert!(d.add_file("", vec![]).is_err());
        select(&mut d, keys::FILE_DIR);
        let dir = read_bytes(&mut d, 4 + 2 * 64);
        assert_eq!(&dir[..4], 2u32.to_be_bytes());
        let entry = |i: usize| &dir[4 + i * 64..4 + (i + 1) * 64];
        assert_eq!(&entry(0)[..4], 3u32.to_be_bytes());
        assert_eq!(&entry(0)[4..6], 0x20u16.to_be_bytes());
        assert_eq!(&entry(0)[8..14], b"etc/a\0");
        assert_eq!(&entry(1)[..4], 20u32.to_be_bytes());
        assert_eq!(&entry(1)[4..6], 0x21u16.to_be_bytes());
        assert_eq!(&entry(1)[8..17], b"etc/e820\0");
        select(&mut d, 0x21);
        assert_eq!(read_bytes(&mut d, 20), e820_file(&[(0, RAM, E820_RAM)]));
    }

    #[test]
    fn dma_reads_skips_and_errors() {
        let (mut d, mem, stats) = dev(true);
        let mem = mem.unwrap();
        // Select the signature and read 8 bytes: 4 of it, then zeros.
        mem.write(0, 0x2000, &[0xaa; 8]).unwrap();
        let ctl = (u32::from(keys::SIGNATURE) << 16) | dma_ctl::SELECT | dma_ctl::READ;
        put_access(&mem, 0x1000, ctl, 8, 0x2000);
        dma_access(&mut d, 0x1000);
        assert_eq!(control(&mem, 0x1000), 0);
        let mut got = [0u8; 8];
        mem.read(0, 0x2000, &mut got).unwrap();
        assert_eq!(&got, b"QEMU\0\0\0\0");
        // Skip 8 bytes of the command line, then read on.
        let ctl = (u32::from(keys::CMDLINE_DATA) << 16) | dma_ctl::SELECT | dma_ctl::SKIP;
        put_access(&mem, 0x1000, ctl, 8, 0);
        dma_access(&mut d, 0x1000);
        put_access(&mem, 0x1000, dma_ctl::READ, 5, 0x2000);
        dma_access(&mut d, 0x1000);
        assert_eq!(control(&mem, 0x1000), 0);
        let mut got = [0u8; 5];
        mem.read(0, 0x2000, &mut got).unwrap();
        assert_eq!(&got, b"ttyS0");
        // A destination outside RAM, and a write: the error bit, and nothing else happens.
        put_access(&mem, 0x1000, dma_ctl::READ, 8, RAM - 4);
        dma_access(&mut d, 0x1000);
        assert_eq!(control(&mem, 0x1000), dma_ctl::ERROR);
        put_access(&mem, 0x1000, dma_ctl::WRITE, 1, 0x2000);
        dma_access(&mut d, 0x1000);
        assert_eq!(control(&mem, 0x1000), dma_ctl::ERROR);
        // A descriptor outside RAM: counted, nothing written.
        dma_access(&mut d, 1 << 40);
        assert_eq!(stats.counter("fw_cfg.dma_ops").get(), 6);
        assert_eq!(stats.counter("fw_cfg.dma_errors").get(), 3);
        // Neither a control of 0 nor an unknown op transfers anything.
        put_access(&mem, 0x1000, 0, 8, 0x3000);
        dma_access(&mut d, 0x1000);
        assert_eq!(control(&mem, 0x1000), 0);
    }

    /// Any port sequence, any DMA descriptor: no panic (the fuzz target's property).
    #[test]
    fn arbitrary_sequences_do_not_panic() {
        let (mut d, mem, _) = dev(true);
        let mem = mem.unwrap();
        let mut x = 0x1234_5678_9abc_def0u64;
        for _ in 0..20000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let off = x % FW_CFG_LEN;
            let len = [1, 2, 4, 8][(x >> 8) as usize % 4];
            if x & (1 << 20) != 0 {
                let _ = mem.write(0, (x >> 24) % RAM, &(x as u32).to_be_bytes());
                d.write(off, &x.to_le_bytes()[..len]);
            } else {
                d.read(off, &mut [0u8; 8][..len]);
            }
        }
    }
}
