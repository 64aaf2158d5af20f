//! virtio-blk over a raw image file.
//!
//! One request queue (index 0). Requests: `IN`, `OUT`, `FLUSH` (fdatasync: a completed flush
//! means the data is on stable storage, so it survives a `kill -9` of Lucid and a host crash),
//! `GET_ID`, `DISCARD` (punches a hole: the range then reads as zeros) and `WRITE_ZEROES`
//! (zero-range, or a hole with the unmap flag; plain writes of zeros where the file system has
//! neither). Data moves between the file and guest memory only through the DMA path, in bounce
//! buffers of at most 1 MiB.
//!
//! Layout: the chain's device-readable descriptors come first and hold the 16-byte header, then
//! (for OUT, DISCARD, WRITE_ZEROES) the data; the device-writable ones follow and hold (for IN
//! and GET_ID) the data, then the status byte, which is the last byte of the last descriptor
//! (any framing, as `VIRTIO_F_VERSION_1` implies).
//!
//! A [`BlockDataHook`] (the Swap Mapper) may take over the data of reads and must hear of every
//! change to the image before it happens; it is consulted only while no vIOMMU translates the
//! device's addresses. With [`BlockConfig::direct`] (`cache=none`) the image is opened
//! `O_DIRECT`: every transfer goes through a 4 KiB-aligned bounce buffer at block-aligned file
//! offsets, and the host page cache holds no copy of what the guest reads or writes.
//!
//! A [`BlockCache`] (SwapBypass's swap cache, docs/symbiotic.md §6) takes over the image I/O
//! of reads, writes, discards and flushes instead: the device still moves the data between guest
//! memory and its bounce buffer through the DMA path (so it works under a vIOMMU too), and the
//! cache decides what reaches the file. With a cache the data hook is not consulted.
//!
//! Statuses: `OK`; `IOERR` for a request the device refuses (range past capacity or not aligned
//! to the logical block size, zero or non-512-multiple length, data in a descriptor of the wrong
//! direction, a write on a read-only device, a DMA address outside guest memory, a host I/O
//! error); `UNSUPP` for an unknown type or reserved flags. A chain with no writable last byte for
//! the status, or whose status byte cannot be written, cannot be completed: the device then
//! needs a reset ([`crate::VirtioDevice::needs_reset`]).

use std::fs::{File, OpenOptions};
use std::io::{Seek, SeekFrom};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use crate::rate::{RateControl, RateCounters, Throttle};

use crate::worker::{
    gather, scatter, split_off, Backend, DataError, Desc, Fault, Io, Region, Served, WorkerSlot,
};
use crate::{device_type, features, ActivateContext, ActivateError, VirtioDevice};
use lucid_mem::vm_memory::{GuestAddress, GuestMemory, Permissions};

/// Feature bits (virtio spec 5.2.3).
pub mod feature {
    pub const VIRTIO_BLK_F_SIZE_MAX: u64 = 1 << 1;
    pub const VIRTIO_BLK_F_SEG_MAX: u64 = 1 << 2;
    pub const VIRTIO_BLK_F_RO: u64 = 1 << 5;
    pub const VIRTIO_BLK_F_BLK_SIZE: u64 = 1 << 6;
    pub const VIRTIO_BLK_F_FLUSH: u64 = 1 << 9;
    pub const VIRTIO_BLK_F_DISCARD: u64 = 1 << 13;
    pub const VIRTIO_BLK_F_WRITE_ZEROES: u64 = 1 << 14;
}

/// Request types and statuses (virtio spec 5.2.6).
pub mod req {
    pub const VIRTIO_BLK_T_IN: u32 = 0;
    pub const VIRTIO_BLK_T_OUT: u32 = 1;
    pub const VIRTIO_BLK_T_FLUSH: u32 = 4;
    pub const VIRTIO_BLK_T_GET_ID: u32 = 8;
    pub const VIRTIO_BLK_T_DISCARD: u32 = 11;
    pub const VIRTIO_BLK_T_WRITE_ZEROES: u32 = 13;
    pub const VIRTIO_BLK_S_OK: u8 = 0;
    pub const VIRTIO_BLK_S_IOERR: u8 = 1;
    pub const VIRTIO_BLK_S_UNSUPP: u8 = 2;
    /// `flags` bit of a discard / write-zeroes segment.
    pub const VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP: u32 = 1;
    /// Length of `GET_ID`'s answer.
    pub const VIRTIO_BLK_ID_BYTES: usize = 20;
}

use req::*;

/// Size of the request queue.
pub const QUEUE_SIZE: u16 = 256;
/// `seg_max`: data descriptors per request (the queue less header and status).
pub const SEG_MAX: u32 = QUEUE_SIZE as u32 - 2;
/// `size_max`: bytes per data descriptor.
pub const SIZE_MAX: u32 = 1 << 20;
/// Discard / write-zeroes limits offered in config space.
pub const MAX_DISCARD_SECTORS: u32 = 1 << 22;
pub const MAX_DISCARD_SEG: u32 = 16;
pub const MAX_WRITE_ZEROES_SECTORS: u32 = 1 << 22;
pub const MAX_WRITE_ZEROES_SEG: u32 = 16;
/// Size of the configuration space (up to and including `write_zeroes_may_unmap` and padding).
pub const CONFIG_SIZE: usize = 60;

const SECTOR: u64 = 512;
const BOUNCE_MAX: usize = 1 << 20;
/// Alignment of the bounce window (`O_DIRECT` wants the buffer aligned to the device's block).
const BOUNCE_ALIGN: usize = 4096;

#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct BlockConfig {
    /// The raw image file (or block device).
    pub path: PathBuf,
    pub read_only: bool,
    /// 512 or 4096.
    pub logical_block_size: u32,
    /// Answer to `GET_ID`, at most 20 bytes.
    pub id: String,
    /// Open the image `O_DIRECT` (`cache=none`): no host page cache for the guest's I/O.
    pub direct: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum BlockError {
    #[error("block image {path}: cannot open {mode}: {err}")]
    Open {
        path: PathBuf,
        mode: &'static str,
        err: std::io::Error,
    },
    #[error("block image {0}: is a directory")]
    IsDirectory(PathBuf),
    #[error("block image {path}: cannot find its size: {err}")]
    Size { path: PathBuf, err: std::io::Error },
    #[error("block image {path}: {size} bytes is smaller than one {block}-byte block")]
    TooSmall {
        path: PathBuf,
        size: u64,
        block: u32,
    },
    #[error("bad logical block size {0}: expected 512 or 4096")]
    BadBlockSize(u32),
    #[error("block id {0:?} is {1} bytes long: at most 20 allowed")]
    IdTooLong(String, usize),
    #[error(
        "block image {path}: the file system refuses O_DIRECT (cache=none): {err}; \
         drop cache=none or put the image on a file system that supports direct I/O (ext4, xfs)"
    )]
    DirectRefused { path: PathBuf, err: std::io::Error },
}

/// Takes over the data of virtio-blk requests: the Swap Mapper's hook. It maps image blocks over
/// the guest pages a read targets instead of copying them, and breaks those mappings before the
/// image bytes change. Called on the device's worker thread, one request at a time, in order.
/// Only used while no vIOMMU translates the device's addresses (then `gpa` is the guest-physical
/// address of the request's buffer).
pub trait BlockDataHook: Send + Sync {
    /// A guest read of `len` bytes at image offset `off` into guest-physical `gpa..gpa+len`
    /// (contiguous in guest memory). `Ok(true)`: the hook placed the data itself. `Ok(false)`:
    /// the device copies it as usual (the hook may first have prepared the pages, e.g. dropped
    /// evicted old content so the copy does not fault it in from swap).
    fn read(&self, file: &File, off: u64, gpa: u64, len: u64) -> std::io::Result<bool>;

    /// Before any change to image bytes `off..off+len` (write, write-zeroes, discard) reaches the
    /// file: afterwards no guest page may show the new bytes unless the guest reads them again.
    fn before_change(&self, file: &File, off: u64, len: u64) -> std::io::Result<()>;

    /// After a guest write of `len` bytes from `gpa` to image offset `off` reached the file.
    fn after_write(&self, _file: &File, _off: u64, _gpa: u64, _len: u64) {}

    /// After a guest flush (fdatasync) completed.
    fn after_flush(&self, _file: &File) {}
}

/// Takes over a disk's image I/O (SwapBypass's swap cache). Called on the device's worker
/// thread, one request at a time, in order, with the request's data already gathered from (or
/// to be scattered into) guest memory by the device through the DMA path. Offsets and lengths
/// are whole logical blocks inside the disk; `buf` is 4 KiB-aligned (fit for `O_DIRECT`) and
/// at most 1 MiB, so a large request arrives in pieces.
pub trait BlockCache: Send + Sync {
    /// A guest read: fill all of `buf` with image bytes `off..off+buf.len()` (from the cache,
    /// or from `file` for what it does not hold).
    fn read(&self, file: &File, off: u64, buf: &mut [u8]) -> std::io::Result<()>;

    /// A guest write of `data` to image offset `off`: the cache keeps it or writes `file`.
    fn write(&self, file: &File, off: u64, data: &[u8]) -> std::io::Result<()>;

    /// Before a guest discard or write-zeroes of `off..off+len` reaches the file (afterwards
    /// the range reads as zeros): cached copies of it must go.
    fn discard(&self, file: &File, off: u64, len: u64);

    /// A guest flush, before the device syncs the file: everything the guest still needs must
    /// be written to `file` by the time this returns.
    fn flush(&self, file: &File) -> std::io::Result<()>;
}

/// A virtio-blk device.
pub struct Block {
    name: String,
    cfg: BlockConfig,
    file: Arc<File>,
    capacity_sectors: u64,
    config: [u8; CONFIG_SIZE],
    worker: WorkerSlot,
    hook: Option<Arc<dyn BlockDataHook>>,
    cache: Option<Arc<dyn BlockCache>>,
    limits: Option<Arc<RateControl>>,
}

impl Block {
    pub fn new(name: String, cfg: BlockConfig) -> Result<Block, BlockError> {
        if cfg.logical_block_size != 512 && cfg.logical_block_size != 4096 {
            return Err(BlockError::BadBlockSize(cfg.logical_block_size));
        }
        if cfg.id.len() > VIRTIO_BLK_ID_BYTES {
            return Err(BlockError::IdTooLong(cfg.id.clone(), cfg.id.len()));
        }
        let mode = if cfg.read_only {
            "read-only"
        } else {
            "read-write"
        };
        let mut opts = OpenOptions::new();
        opts.read(true).write(!cfg.read_only);
        if cfg.direct {
            use std::os::unix::fs::OpenOptionsExt;
            opts.custom_flags(libc::O_DIRECT);
        }
        let mut file = opts.open(&cfg.path).map_err(|err| {
            if cfg.direct && err.raw_os_error() == Some(libc::EINVAL) {
                BlockError::DirectRefused {
                    path: cfg.path.clone(),
                    err,
                }
            } else {
                BlockError::Open {
                    path: cfg.path.clone(),
                    mode,
                    err,
                }
            }
        })?;
        let meta = file.metadata().map_err(|err| BlockError::Size {
            path: cfg.path.clone(),
            err,
        })?;
        if meta.is_dir() {
            return Err(BlockError::IsDirectory(cfg.path.clone()));
        }
        // Seeking to the end also sizes block devices, whose metadata length is 0.
        let size = file
            .seek(SeekFrom::End(0))
            .map_err(|err| BlockError::Size {
                path: cfg.path.clone(),
                err,
            })?;
        let lbs = u64::from(cfg.logical_block_size);
        if size < lbs {
            return Err(BlockError::TooSmall {
                path: cfg.path.clone(),
                size,
                block: cfg.logical_block_size,
            });
        }
        // A partial last block is not offered.
        let capacity_sectors = size / lbs * lbs / SECTOR;
        let mut blk = Block {
            name,
            cfg,
            file: Arc::new(file),
            capacity_sectors,
            config: [0; CONFIG_SIZE],
            worker: WorkerSlot::default(),
            hook: None,
            cache: None,
            limits: None,
        };
        blk.config = blk.build_config();
        Ok(blk)
    }

    /// Installs the data hook (the Swap Mapper); it applies from the next activation, so the
    /// VMM sets it before the driver starts the device.
    pub fn set_data_hook(&mut self, hook: Arc<dyn BlockDataHook>) {
        self.hook = Some(hook);
    }

    /// Installs a block cache (SwapBypass); it applies from the next activation, so the VMM
    /// sets it before the driver starts the device. With a cache the data hook is not used.
    pub fn set_cache(&mut self, cache: Arc<dyn BlockCache>) {
        self.cache = Some(cache);
    }

    /// Puts the device behind a rate limiter ([`crate::rate`]): each request takes one
    /// operation and its data bytes (reads and writes). It applies from the next activation,
    /// and then follows every change made through `limits`.
    pub fn set_rate_control(&mut self, limits: Arc<RateControl>) {
        self.limits = Some(limits);
    }

    /// The logical block size the device offers (512 or 4096).
    pub fn logical_block_size(&self) -> u32 {
        self.cfg.logical_block_size
    }

    /// Capacity in 512-byte sectors.
    pub fn capacity_sectors(&self) -> u64 {
        self.capacity_sectors
    }

    fn build_config(&self) -> [u8; CONFIG_SIZE] {
        let mut c = [0u8; CONFIG_SIZE];
        let lbs = self.cfg.logical_block_size;
        let put32 = |c: &mut [u8; CONFIG_SIZE], off: usize, v: u32| {
            c[off..off + 4].copy_from_slice(&v.to_le_bytes())
        };
        c[0..8].copy_from_slice(&self.capacity_sectors.to_le_bytes());
        put32(&mut c, 8, SIZE_MAX);
        put32(&mut c, 12, SEG_MAX);
        // 16..20: geometry, not offered.
        put32(&mut c, 20, lbs);
        // 24: physical_block_exp, alignment_offset, min_io_size (in logical blocks).
        c[26..28].copy_from_slice(&1u16.to_le_bytes());
        // 28: opt_io_size; 32: writeback; 34: num_queues (no MQ).
        put32(&mut c, 36, MAX_DISCARD_SECTORS);
        put32(&mut c, 40, MAX_DISCARD_SEG);
        put32(&mut c, 44, lbs / SECTOR as u32);
        put32(&mut c, 48, MAX_WRITE_ZEROES_SECTORS);
        put32(&mut c, 52, MAX_WRITE_ZEROES_SEG);
        c[56] = 1; // write_zeroes_may_unmap
        c
    }
}

impl VirtioDevice for Block {
    fn name(&self) -> &str {
        &self.name
    }

    fn device_type(&self) -> u32 {
        device_type::BLOCK
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &[QUEUE_SIZE]
    }

    fn features(&self) -> u64 {
        use feature::*;
        let mut f = features::VIRTIO_F_VERSION_1
            | features::VIRTIO_F_ACCESS_PLATFORM
            | features::VIRTIO_RING_F_EVENT_IDX
            | VIRTIO_BLK_F_SIZE_MAX
            | VIRTIO_BLK_F_SEG_MAX
            | VIRTIO_BLK_F_BLK_SIZE
            | VIRTIO_BLK_F_FLUSH;
        if self.cfg.read_only {
            f |= VIRTIO_BLK_F_RO;
        } else {
            f |= VIRTIO_BLK_F_DISCARD | VIRTIO_BLK_F_WRITE_ZEROES;
        }
        f
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        read_config_bytes(&self.config, offset, data);
    }

    fn write_config(&mut self, _offset: u64, _data: &[u8]) {
        // Nothing is writable: `writeback` needs VIRTIO_BLK_F_CONFIG_WCE, not offered.
    }

    fn activate(&mut self, mut ctx: ActivateContext) -> Result<(), ActivateError> {
        ctx.queues.retain(|(i, _, _)| *i == 0);
        if ctx.queues.is_empty() {
            return Err(ActivateError::QueueMissing {
                device: self.name.clone(),
                queue: 0,
            });
        }
        let backend = BlkBackend {
            file: self.file.clone(),
            capacity_bytes: self.capacity_sectors * SECTOR,
            lbs: u64::from(self.cfg.logical_block_size),
            read_only: self.cfg.read_only,
            direct: self.cfg.direct,
            hook: if self.cache.is_some() {
                None
            } else {
                self.hook.clone()
            },
            cache: self.cache.clone(),
            throttle: self
                .limits
                .as_ref()
                .map(|l| Throttle::new(l.clone(), RateCounters::new(&ctx.stats, &self.name))),
            id: self.cfg.id.as_bytes().to_vec(),
            bounce: Vec::new(),
            readable: Vec::new(),
            writable: Vec::new(),
            data_in: Vec::new(),
        };
        self.worker.start(&self.name, ctx, backend)
    }

    fn reset(&mut self) {
        self.worker.stop();
    }

    fn needs_reset(&self) -> bool {
        self.worker.needs_reset()
    }
}

/// Copies `data.len()` bytes of `config` from `offset`; bytes past its end read as zero.
pub(crate) fn read_config_bytes(config: &[u8], offset: u64, data: &mut [u8]) {
    for (i, b) in data.iter_mut().enumerate() {
        *b = usize::try_from(offset)
            .ok()
            .and_then(|o| o.checked_add(i))
            .and_then(|o| config.get(o).copied())
            .unwrap_or(0);
    }
}

struct BlkBackend {
    file: Arc<File>,
    capacity_bytes: u64,
    lbs: u64,
    read_only: bool,
    /// The image is open `O_DIRECT`: file transfers are block-aligned, from an aligned buffer.
    direct: bool,
    hook: Option<Arc<dyn BlockDataHook>>,
    cache: Option<Arc<dyn BlockCache>>,
    throttle: Option<Throttle>,
    id: Vec<u8>,
    /// Bounce buffer storage; [`BlkBackend::bounce`] hands out a `BOUNCE_ALIGN`-aligned window.
    bounce: Vec<u8>,
    readable: Vec<Region>,
    writable: Vec<Region>,
    data_in: Vec<Region>,
}

/// Why a request failed. The driver sees only the status ([`ReqError::status`]); a guest can
/// cause these at will, so they are counted in `errors` and logged at debug level.
#[derive(Debug, thiserror::Error)]
enum ReqError {
    #[error("a device-readable descriptor follows a device-writable one")]
    Layout,
    #[error("the device-readable buffers hold {have} bytes, less than the 16-byte header")]
    ShortHeader { have: u64 },
    #[error(
        "request type {rtype} with {in_len} bytes for the device and {out_len} for the driver"
    )]
    Direction {
        rtype: u32,
        in_len: u64,
        out_len: u64,
    },
    #[error("request type {rtype} on a read-only disk")]
    ReadOnly { rtype: u32 },
    #[error(
        "{len} bytes at sector {sector}: empty, outside the disk or not in whole {lbs}-byte blocks"
    )]
    Range { sector: u64, len: u64, lbs: u64 },
    #[error("request data: {0}")]
    Data(#[from] DataError),
    #[error("image {op} at byte {off:#x}: {source}")]
    File {
        op: &'static str,
        off: u64,
        #[source]
        source: std::io::Error,
    },
    #[error("{len} bytes of segments: a multiple of 16, at most {max} segments")]
    Segments { len: u64, max: u32 },
    #[error("a segment of {num} sectors: 1 to {max} allowed")]
    SegmentSize { num: u32, max: u32 },
    #[error("segment flags {0:#x} not supported")]
    Flags(u32),
    #[error("request type {0} not supported")]
    Unsupported(u32),
    /// Not an error: the rate limiter holds the request back.
    #[error("the rate limiter holds the request")]
    Deferred,
}

impl ReqError {
    fn status(&self) -> u8 {
        match self {
            ReqError::Flags(_) | ReqError::Unsupported(_) => VIRTIO_BLK_S_UNSUPP,
            _ => VIRTIO_BLK_S_IOERR,
        }
    }
}

fn file_err(op: &'static str, off: u64) -> impl FnOnce(std::io::Error) -> ReqError {
    move |source| ReqError::File { op, off, source }
}

impl Backend for BlkBackend {
    fn process_queue(&mut self, io: &mut Io, qi: usize) -> bool {
        io.serve(qi, &mut |io, descs| self.handle(io, descs))
    }

    fn wake_at(&self) -> Option<Instant> {
        self.throttle.as_ref()?.wake_at()
    }

    fn limits_fd(&self) -> Option<RawFd> {
        Some(self.throttle.as_ref()?.wake_fd())
    }

    fn on_limits(&mut self, _io: &mut Io) {
        if let Some(t) = &mut self.throttle {
            t.on_change();
        }
    }
}

impl BlkBackend {
    fn handle(&mut self, io: &Io, descs: &[Desc]) -> Served {
        // The status byte: the last byte of the last descriptor, which must be device-writable.
        let last = descs[descs.len() - 1];
        if !last.is_write_only() || last.len() == 0 {
            return Served::Fatal(Fault::NoStatusByte {
                addr: last.addr().0,
                len: last.len(),
            });
        }
        let status_addr = last.addr().0.wrapping_add(u64::from(last.len()) - 1);
        let (status, written) = match self.request(io, descs) {
            Ok(written) => (VIRTIO_BLK_S_OK, written),
            Err(ReqError::Deferred) => return Served::Defer,
            Err(e) => {
                io.c.errors.inc();
                log::debug!("{}: request failed: {e}", io.name());
                (e.status(), 0)
            }
        };
        if let Err(e) = io.dma.write(io.dev_id, status_addr, &[status]) {
            return Served::Fatal(Fault::StatusByte(e));
        }
        Served::Used(written.saturating_add(1))
    }

    /// Serves one request; returns the data bytes written into guest buffers.
    fn request(&mut self, io: &Io, descs: &[Desc]) -> Result<u32, ReqError> {
        // Readable descriptors, then writable ones; a readable one after a writable one is a
        // malformed layout.
        let first_w = descs
            .iter()
            .position(|d| d.is_write_only())
            .unwrap_or(descs.len());
        if descs[first_w..].iter().any(|d| !d.is_write_only()) {
            return Err(ReqError::Layout);
        }
        // Region lists are kept between requests (no allocation per request).
        let mut readable = std::mem::take(&mut self.readable);
        let mut writable = std::mem::take(&mut self.writable);
        let mut data_in = std::mem::take(&mut self.data_in);
        readable.clear();
        readable.extend(
            descs[..first_w]
                .iter()
                .map(|d| (d.addr().0, u64::from(d.len()))),
        );
        writable.clear();
        writable.extend(
            descs[first_w..]
                .iter()
                .map(|d| (d.addr().0, u64::from(d.len()))),
        );
        // Drop the status byte from the writable data.
        if let Some(l) = writable.last_mut() {
            l.1 -= 1;
        }
        writable.retain(|r| r.1 > 0);
        let r = if split_off(&readable, 16, &mut data_in) {
            self.serve_parsed(io, &readable, &data_in, &writable)
        } else {
            Err(ReqError::ShortHeader {
                have: readable.iter().map(|r| r.1).sum(),
            })
        };
        self.readable = readable;
        self.writable = writable;
        self.data_in = data_in;
        r
    }

    /// Serves a request whose chain is split into the readable regions (header first), the
    /// readable data after the header, and the writable data before the status byte.
    fn serve_parsed(
        &mut self,
        io: &Io,
        readable: &[Region],
        data_in: &[Region],
        writable: &[Region],
    ) -> Result<u32, ReqError> {
        let mut hdr = [0u8; 16];
        gather(io, readable, &mut hdr)?;
        let rtype = u32::from_le_bytes(hdr[0..4].try_into().expect("4 bytes"));
        let sector = u64::from_le_bytes(hdr[8..16].try_into().expect("8 bytes"));
        let in_len: u64 = data_in.iter().map(|r| r.1).sum();
        let out_len: u64 = writable.iter().map(|r| r.1).sum();
        let direction = ReqError::Direction {
            rtype,
            in_len,
            out_len,
        };
        if let Some(t) = &mut self.throttle {
            let bytes = match rtype {
                VIRTIO_BLK_T_IN => out_len,
                VIRTIO_BLK_T_OUT => in_len,
                _ => 0,
            };
            if !t.admit(bytes) {
                return Err(ReqError::Deferred);
            }
        }

        match rtype {
            VIRTIO_BLK_T_IN => {
                // Data must go into device-writable buffers only.
                if in_len != 0 {
                    return Err(direction);
                }
                let off = self.check_range(sector, out_len)?;
                self.read_into(io, off, writable)?;
                io.c.bytes_written.add(out_len);
                Ok(out_len as u32)
            }
            VIRTIO_BLK_T_OUT => {
                if out_len != 0 {
                    return Err(direction);
                }
                if self.read_only {
                    return Err(ReqError::ReadOnly { rtype });
                }
                let off = self.check_range(sector, in_len)?;
                self.write_from(io, off, data_in)?;
                io.c.bytes_read.add(in_len);
                Ok(0)
            }
            VIRTIO_BLK_T_FLUSH => {
                if let Some(cache) = &self.cache {
                    cache
                        .flush(&self.file)
                        .map_err(file_err("cache flush", 0))?;
                }
                if !self.read_only {
                    // SAFETY: fdatasync on a descriptor we own; no memory is involved.
                    if unsafe { libc::fdatasync(self.file.as_raw_fd()) } != 0 {
                        return Err(file_err("fdatasync", 0)(std::io::Error::last_os_error()));
                    }
                }
                if let Some(hook) = self.active_hook(io) {
                    hook.after_flush(&self.file);
                }
                Ok(0)
            }
            VIRTIO_BLK_T_GET_ID => {
                if out_len == 0 || in_len != 0 {
                    return Err(direction);
                }
                let mut id = [0u8; VIRTIO_BLK_ID_BYTES];
                id[..self.id.len()].copy_from_slice(&self.id);
                let n = (out_len as usize).min(VIRTIO_BLK_ID_BYTES);
                scatter(io, writable, &id[..n])?;
                io.c.bytes_written.add(n as u64);
                Ok(n as u32)
            }
            VIRTIO_BLK_T_DISCARD | VIRTIO_BLK_T_WRITE_ZEROES => {
                if self.read_only {
                    return Err(ReqError::ReadOnly { rtype });
                }
                if out_len != 0 {
                    return Err(direction);
                }
                let discard = rtype == VIRTIO_BLK_T_DISCARD;
                let (max_seg, max_sectors) = if discard {
                    (MAX_DISCARD_SEG, MAX_DISCARD_SECTORS)
                } else {
                    (MAX_WRITE_ZEROES_SEG, MAX_WRITE_ZEROES_SECTORS)
                };
                if in_len == 0 || !in_len.is_multiple_of(16) || in_len / 16 > u64::from(max_seg) {
                    return Err(ReqError::Segments {
                        len: in_len,
                        max: max_seg,
                    });
                }
                let mut segs = vec![0u8; in_len as usize];
                gather(io, data_in, &mut segs)?;
                // Check every segment before changing anything.
                let mut ranges = Vec::new();
                for s in segs.chunks_exact(16) {
                    let sector = u64::from_le_bytes(s[0..8].try_into().expect("8 bytes"));
                    let num = u32::from_le_bytes(s[8..12].try_into().expect("4 bytes"));
                    let flags = u32::from_le_bytes(s[12..16].try_into().expect("4 bytes"));
                    let unmap = flags & VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP != 0;
                    if flags & !VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP != 0 || (discard && unmap) {
                        return Err(ReqError::Flags(flags));
                    }
                    if num == 0 || num > max_sectors {
                        return Err(ReqError::SegmentSize {
                            num,
                            max: max_sectors,
                        });
                    }
                    let len = u64::from(num) * SECTOR;
                    let off = self.check_range(sector, len)?;
                    ranges.push((off, len, unmap));
                }
                let hook = self.active_hook(io);
                for (off, len, unmap) in ranges {
                    if let Some(cache) = &self.cache {
                        cache.discard(&self.file, off, len);
                    }
                    if let Some(hook) = &hook {
                        hook.before_change(&self.file, off, len)
                            .map_err(file_err("before_change", off))?;
                    }
                    self.zero(off, len, discard || unmap)?;
                }
                Ok(0)
            }
            _ => Err(ReqError::Unsupported(rtype)),
        }
    }

    /// Byte offset of a transfer of `len` bytes at `sector`, if inside the disk and aligned to
    /// the logical block size.
    fn check_range(&self, sector: u64, len: u64) -> Result<u64, ReqError> {
        let off = sector
            .checked_mul(SECTOR)
            .filter(|o| o.is_multiple_of(self.lbs));
        match off.and_then(|o| o.checked_add(len)) {
            Some(end)
                if len != 0
                    && len.is_multiple_of(SECTOR)
                    && len.is_multiple_of(self.lbs)
                    && end <= self.capacity_bytes =>
            {
                Ok(end - len)
            }
            _ => Err(ReqError::Range {
                sector,
                len,
                lbs: self.lbs,
            }),
        }
    }

    /// A bounce window of `min(len, BOUNCE_MAX)` bytes, `BOUNCE_ALIGN`-aligned (for `O_DIRECT`).
    fn bounce(&mut self, len: u64) -> &mut [u8] {
        let n = (len as usize).min(BOUNCE_MAX);
        if self.bounce.len() < n + BOUNCE_ALIGN {
            self.bounce.resize(n + BOUNCE_ALIGN, 0);
        }
        let start = (BOUNCE_ALIGN - self.bounce.as_ptr() as usize % BOUNCE_ALIGN) % BOUNCE_ALIGN;
        &mut self.bounce[start..start + n]
    }

    /// Runs `step(piece, done)` over `total` bytes in bounce-sized pieces of the bounce buffer,
    /// `done` the bytes before the piece.
    fn in_pieces(
        &mut self,
        total: u64,
        mut step: impl FnMut(&mut [u8], u64) -> Result<(), ReqError>,
    ) -> Result<(), ReqError> {
        let mut done = 0u64;
        while done < total {
            let buf = self.bounce(total - done);
            step(buf, done)?;
            done += buf.len() as u64;
        }
        Ok(())
    }

    /// The data hook, while device addresses are guest-physical (no vIOMMU translator).
    fn active_hook(&self, io: &Io) -> Option<Arc<dyn BlockDataHook>> {
        self.hook
            .as_ref()
            .filter(|_| !io.dma.has_translator())
            .cloned()
    }

    /// A read of image bytes `off..` into `regions`: the hook (if any) is offered each
    /// guest-contiguous run inside guest RAM; what it does not place is copied.
    fn read_into(&mut self, io: &Io, off: u64, regions: &[Region]) -> Result<(), ReqError> {
        if let Some(cache) = self.cache.clone() {
            return self.cached_read(io, &cache, off, regions);
        }
        let Some(hook) = self.active_hook(io) else {
            return self.copy_in(io, off, regions);
        };
        let file = self.file.clone();
        let mut pending: Vec<Region> = Vec::new();
        // Image offset of the first pending run.
        let mut pending_off = off;
        let mut pos = off;
        for (gpa, len) in guest_runs(regions) {
            // Outside RAM (or wrapping): the copy reports the bad address.
            let in_ram = usize::try_from(len).is_ok_and(|l| {
                io.dma
                    .memory()
                    .check_range(GuestAddress(gpa), l, Permissions::ReadWrite)
            });
            if in_ram && !pending.is_empty() {
                // Copies land before the hook's next placement: guest memory ends as a plain
                // copy in descriptor order would leave it, even where buffers overlap.
                self.copy_in(io, pending_off, &pending)?;
                pending.clear();
            }
            let placed = in_ram
                && hook
                    .read(&file, pos, gpa, len)
                    .map_err(file_err("map", pos))?;
            if !placed {
                if pending.is_empty() {
                    pending_off = pos;
                }
                pending.push((gpa, len));
            }
            pos += len;
        }
        if !pending.is_empty() {
            self.copy_in(io, pending_off, &pending)?;
        }
        Ok(())
    }

    /// Copies image bytes `off..off+total` into `regions` (which hold `total` bytes). With
    /// `O_DIRECT` the file is read in whole logical blocks around the range.
    fn copy_in(&mut self, io: &Io, off: u64, regions: &[Region]) -> Result<(), ReqError> {
        let total: u64 = regions.iter().map(|r| r.1).sum();
        let align = if self.direct { self.lbs } else { 1 };
        let file = self.file.clone();
        let mut cur = (0usize, 0u64);
        let mut done = 0u64;
        while done < total {
            let at = off + done;
            let skip = at % align;
            let want = (total - done + skip).min(BOUNCE_MAX as u64);
            // BOUNCE_MAX is a multiple of the block, and a request ends on a block boundary.
            let len = want.div_ceil(align) * align;
            let buf = self.bounce(len);
            file.read_exact_at(buf, at - skip)
                .map_err(file_err("read", at - skip))?;
            let n = (len - skip).min(total - done);
            scatter_at(
                io,
                regions,
                &mut cur,
                &buf[skip as usize..(skip + n) as usize],
            )?;
            done += n;
        }
        Ok(())
    }

    /// A guest write of `regions` to image offset `off` (block-aligned): the hook hears of it
    /// before the file changes and after each guest-contiguous run reached it.
    fn write_from(&mut self, io: &Io, off: u64, regions: &[Region]) -> Result<(), ReqError> {
        if let Some(cache) = self.cache.clone() {
            return self.cached_write(io, &cache, off, regions);
        }
        let hook = self.active_hook(io);
        let total: u64 = regions.iter().map(|r| r.1).sum();
        let file = self.file.clone();
        if let Some(hook) = &hook {
            hook.before_change(&file, off, total)
                .map_err(file_err("before_change", off))?;
        }
        let mut cur = (0usize, 0u64);
        self.in_pieces(total, |buf, done| {
            gather_at(io, regions, &mut cur, buf)?;
            file.write_all_at(buf, off + done)
                .map_err(file_err("write", off + done))
        })?;
        if let Some(hook) = &hook {
            let mut pos = off;
            for (gpa, len) in guest_runs(regions) {
                hook.after_write(&file, pos, gpa, len);
                pos += len;
            }
        }
        Ok(())
    }

    /// A read through the block cache, in bounce-sized pieces.
    fn cached_read(
        &mut self,
        io: &Io,
        cache: &Arc<dyn BlockCache>,
        off: u64,
        regions: &[Region],
    ) -> Result<(), ReqError> {
        let total: u64 = regions.iter().map(|r| r.1).sum();
        let file = self.file.clone();
        let mut cur = (0usize, 0u64);
        self.in_pieces(total, |buf, done| {
            cache
                .read(&file, off + done, buf)
                .map_err(file_err("cache read", off + done))?;
            Ok(scatter_at(io, regions, &mut cur, buf)?)
        })
    }

    /// A write through the block cache, in bounce-sized pieces.
    fn cached_write(
        &mut self,
        io: &Io,
        cache: &Arc<dyn BlockCache>,
        off: u64,
        regions: &[Region],
    ) -> Result<(), ReqError> {
        let total: u64 = regions.iter().map(|r| r.1).sum();
        let file = self.file.clone();
        let mut cur = (0usize, 0u64);
        self.in_pieces(total, |buf, done| {
            gather_at(io, regions, &mut cur, buf)?;
            cache
                .write(&file, off + done, buf)
                .map_err(file_err("cache write", off + done))
        })
    }

    /// Makes `len` bytes at `off` read as zeros; `dealloc` frees the blocks (a hole) rather
    /// than keeping them allocated.
    fn zero(&mut self, off: u64, len: u64, dealloc: bool) -> Result<(), ReqError> {
        let mode = if dealloc {
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE
        } else {
            libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE
        };
        // SAFETY: fallocate on a descriptor we own with in-range offsets; no memory is involved.
        let r = unsafe { libc::fallocate(self.file.as_raw_fd(), mode, off as i64, len as i64) };
        if r == 0 {
            return Ok(());
        }
        // Not supported by this file system (or a block device): write zeros.
        let file = self.file.clone();
        self.in_pieces(len, |buf, done| {
            buf.fill(0);
            file.write_all_at(buf, off + done)
                .map_err(file_err("write", off + done))
        })
    }
}

/// `regions` with guest-contiguous neighbours merged: the runs a [`BlockDataHook`] is offered.
fn guest_runs(regions: &[Region]) -> Vec<Region> {
    let mut runs: Vec<Region> = Vec::with_capacity(regions.len());
    for &(addr, len) in regions {
        match runs.last_mut() {
            Some(last) if last.0.checked_add(last.1) == Some(addr) => last.1 += len,
            _ => runs.push((addr, len)),
        }
    }
    runs
}

/// Writes `buf` into `regions` from the cursor `(region index, offset in it)`, advancing it.
fn scatter_at(
    io: &Io,
    regions: &[Region],
    cur: &mut (usize, u64),
    buf: &[u8],
) -> Result<(), DataError> {
    let mut done = 0usize;
    while done < buf.len() {
        let Some(&(addr, len)) = regions.get(cur.0) else {
            return Err(DataError::Short {
                need: buf.len(),
                have: done,
            });
        };
        let n = ((len - cur.1) as usize).min(buf.len() - done);
        io.dma
            .write(io.dev_id, addr.wrapping_add(cur.1), &buf[done..done + n])?;
        done += n;
        cur.1 += n as u64;
        if cur.1 == len {
            *cur = (cur.0 + 1, 0);
        }
    }
    Ok(())
}

/// Reads `buf.len()` bytes from `regions` at the cursor `(region index, offset in it)`.
fn gather_at(
    io: &Io,
    regions: &[Region],
    cur: &mut (usize, u64),
    buf: &mut [u8],
) -> Result<(), DataError> {
    let mut done = 0usize;
    while done < buf.len() {
        let Some(&(addr, len)) = regions.get(cur.0) else {
            return Err(DataError::Short {
                need: buf.len(),
                have: done,
            });
        };
        let n = ((len - cur.1) as usize).min(buf.len() - done);
        io.dma.read(
            io.dev_id,
            addr.wrapping_add(cur.1),
            &mut buf[done..done + n],
        )?;
        done += n;
        cur.1 += n as u64;
        if cur.1 == len {
            *cur = (cur.0 + 1, 0);
        }
    }
    Ok(())
}
