//! The virtio-blk device server on a temporary socket, in a thread, driven by the `vfio_user`
//! crate's client as a driver would drive it: the config space and capabilities, the virtio
//! initialisation through the common configuration, one queue in a memfd, IN/OUT/FLUSH/GET_ID
//! requests, the MSI-X vector eventfd, and a buffer outside the mappings refused (IOERR, fault
//! log, ERR eventfd).

use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use lucid_pci::config::{COMMAND, COMMAND_BUS_MASTER, COMMAND_MEMORY};
use lucid_pci::virtio::{common, status};
use lucid_vfio_server::blk::{
    feature, req, BlkCounters, BLK_MSIX_REGION, BLK_VIRTIO_REGION, VECTORS,
};
use lucid_vfio_server::dma::{FAULT_READ_ONLY, FAULT_WRITE};
use lucid_vfio_server::{
    server, Disk, DmaTable, CONFIG_REGION, ERR_IRQ, FAULT_LOG_REGION, MSIX_IRQ,
};
use vfio_bindings::bindings::vfio::{VFIO_IRQ_SET_ACTION_TRIGGER, VFIO_IRQ_SET_DATA_EVENTFD};
use vfio_user::{Client, DmaMapFlags};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

const TRIGGER: u32 = VFIO_IRQ_SET_ACTION_TRIGGER | VFIO_IRQ_SET_DATA_EVENTFD;
const RAM_IOVA: u64 = 0x10_0000;
const RAM_SIZE: u64 = 0x10000;
const DESC: u64 = 0x0000;
const AVAIL: u64 = 0x1000;
const USED: u64 = 0x2000;
const QSIZE: u16 = 8;
const NOTIFY: u64 = 0x3000;
const ISR: u64 = 0x1000;
const DEVCFG: u64 = 0x2000;
const SECTORS: u64 = 16;

struct Harness {
    dir: PathBuf,
    disk: File,
    counters: Arc<BlkCounters>,
    thread: Option<JoinHandle<Result<(), server::ServerError>>>,
}

impl Drop for Harness {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Harness {
    /// Waits for the server to end (the client went away) and returns its result.
    fn join(&mut self) -> Result<(), server::ServerError> {
        self.thread.take().unwrap().join().unwrap()
    }
}

fn start(name: &str, readonly: bool) -> (Client, Harness) {
    let dir = std::env::temp_dir().join(format!("lucid-vfio-blk-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("disk.img");
    let disk = File::options()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&path)
        .unwrap();
    disk.set_len(SECTORS * 512).unwrap();
    for s in 0..SECTORS {
        disk.write_all_at(&[s as u8; 512], s * 512).unwrap();
    }
    let served = File::options()
        .read(true)
        .write(!readonly)
        .open(&path)
        .unwrap();
    let served = Arc::new(Disk::new(served, readonly).unwrap());
    let sock = dir.join("blk.sock");
    let listener = server::bind(&sock).unwrap();
    let counters = Arc::new(BlkCounters::default());
    let thread = {
        let counters = counters.clone();
        std::thread::spawn(move || {
            let dma = Arc::new(DmaTable::new());
            server::serve_blk_clients(
                listener,
                &dma,
                &served,
                &counters,
                &AtomicU64::new(0),
                false,
            )
        })
    };
    let client = Client::new(&sock).expect("version negotiation and region discovery");
    (
        client,
        Harness {
            dir,
            disk,
            counters,
            thread: Some(thread),
        },
    )
}

fn rd<const N: usize>(c: &mut Client, region: u32, off: u64) -> [u8; N] {
    let mut b = [0u8; N];
    c.region_read(region, off, &mut b).unwrap();
    b
}

fn r32(c: &mut Client, region: u32, off: u64) -> u32 {
    u32::from_le_bytes(rd(c, region, off))
}

fn r8(c: &mut Client, off: u64) -> u8 {
    rd::<1>(c, BLK_VIRTIO_REGION, off)[0]
}

fn wv(c: &mut Client, off: u64, data: &[u8]) {
    c.region_write(BLK_VIRTIO_REGION, off, data).unwrap();
}

fn memfd(size: u64) -> File {
    // SAFETY: a new anonymous file from a NUL-terminated name; the descriptor is ours.
    let fd = unsafe { libc::memfd_create(c"lucid-test-ram".as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0);
    // SAFETY: `fd` is a fresh descriptor nothing else owns.
    let f = unsafe { File::from_raw_fd(fd) };
    f.set_len(size).unwrap();
    f
}

fn signalled(e: &EventFd) -> bool {
    for _ in 0..100 {
        if e.read().is_ok() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    false
}

/// The virtio initialisation of a driver that accepts `features`, with queue 0 in `ram` on
/// vector 1. Returns the device status after FEATURES_OK.
fn init(c: &mut Client, features: u64) -> u8 {
    c.region_write(
        CONFIG_REGION,
        COMMAND as u64,
        &(COMMAND_MEMORY | COMMAND_BUS_MASTER).to_le_bytes(),
    )
    .unwrap();
    wv(c, common::DEVICE_STATUS, &[0]);
    wv(
        c,
        common::DEVICE_STATUS,
        &[status::ACKNOWLEDGE | status::DRIVER],
    );
    for sel in 0..2u32 {
        wv(c, common::DRIVER_FEATURE_SELECT, &sel.to_le_bytes());
        let half = (features >> (32 * sel)) as u32;
        wv(c, common::DRIVER_FEATURE, &half.to_le_bytes());
    }
    let s = status::ACKNOWLEDGE | status::DRIVER | status::FEATURES_OK;
    wv(c, common::DEVICE_STATUS, &[s]);
    let got = r8(c, common::DEVICE_STATUS);
    if got & status::FEATURES_OK == 0 {
        return got;
    }
    wv(c, common::QUEUE_SELECT, &0u16.to_le_bytes());
    wv(c, common::QUEUE_SIZE, &QSIZE.to_le_bytes());
    wv(c, common::QUEUE_MSIX_VECTOR, &1u16.to_le_bytes());
    wv(c, common::QUEUE_DESC, &(RAM_IOVA + DESC).to_le_bytes());
    // The driver and device areas as two 32-bit halves each, as some drivers write them.
    for (off, v) in [
        (common::QUEUE_DRIVER, RAM_IOVA + AVAIL),
        (common::QUEUE_DEVICE, RAM_IOVA + USED),
    ] {
        wv(c, off, &(v as u32).to_le_bytes());
        wv(c, off + 4, &((v >> 32) as u32).to_le_bytes());
    }
    wv(c, common::QUEUE_ENABLE, &1u16.to_le_bytes());
    wv(c, common::DEVICE_STATUS, &[s | status::DRIVER_OK]);
    got
}

/// A driver's side of queue 0 in the memfd.
struct Driver {
    ram: File,
    next_desc: u16,
    avail_idx: u16,
}

impl Driver {
    fn new(c: &mut Client) -> Self {
        let ram = memfd(RAM_SIZE);
        c.dma_map(0, RAM_IOVA, RAM_SIZE, ram.as_raw_fd()).unwrap();
        Driver {
            ram,
            next_desc: 0,
            avail_idx: 0,
        }
    }

    /// Puts a chain of (IOVA, len, device-writable) buffers in the avail ring; its head.
    fn submit(&mut self, bufs: &[(u64, u32, bool)]) -> u16 {
        let head = self.next_desc;
        for (i, &(addr, len, write)) in bufs.iter().enumerate() {
            let idx = (head + i as u16) % QSIZE;
            let last = i + 1 == bufs.len();
            let flags: u16 = if last { 0 } else { 1 } | if write { 2 } else { 0 };
            let next = (idx + 1) % QSIZE;
            let mut d = [0u8; 16];
            d[0..8].copy_from_slice(&addr.to_le_bytes());
            d[8..12].copy_from_slice(&len.to_le_bytes());
            d[12..14].copy_from_slice(&flags.to_le_bytes());
            d[14..16].copy_from_slice(&next.to_le_bytes());
            self.ram.write_all_at(&d, DESC + idx as u64 * 16).unwrap();
        }
        self.next_desc = (head + bufs.len() as u16) % QSIZE;
        let slot = (self.avail_idx % QSIZE) as u64;
        self.ram
            .write_all_at(&head.to_le_bytes(), AVAIL + 4 + slot * 2)
            .unwrap();
        self.avail_idx = self.avail_idx.wrapping_add(1);
        self.ram
            .write_all_at(&self.avail_idx.to_le_bytes(), AVAIL + 2)
            .unwrap();
        head
    }

    /// A request of `rtype` at `sector` with `data` bytes (device-writable for IN and GET_ID):
    /// header at 0x3000, data at 0x4000 (or `data_iova`), status at 0x5000.
    fn request(&mut self, rtype: u32, sector: u64, data: u32, data_iova: Option<u64>) -> u16 {
        let mut h = [0u8; 16];
        h[0..4].copy_from_slice(&rtype.to_le_bytes());
        h[8..16].copy_from_slice(&sector.to_le_bytes());
        self.ram.write_all_at(&h, 0x3000).unwrap();
        self.ram.write_all_at(&[0xff], 0x5000).unwrap();
        let to_ram = rtype != req::OUT;
        let mut bufs = vec![(RAM_IOVA + 0x3000, 16, false)];
        if data > 0 {
            bufs.push((data_iova.unwrap_or(RAM_IOVA + 0x4000), data, to_ram));
        }
        bufs.push((RAM_IOVA + 0x5000, 1, true));
        self.submit(&bufs)
    }

    fn status(&self) -> u8 {
        let mut b = [0u8; 1];
        self.ram.read_exact_at(&mut b, 0x5000).unwrap();
        b[0]
    }

    fn used_idx(&self) -> u16 {
        let mut b = [0u8; 2];
        self.ram.read_exact_at(&mut b, USED + 2).unwrap();
        u16::from_le_bytes(b)
    }

    /// The used element at ring slot `i`: (id, len).
    fn used(&self, i: u16) -> (u32, u32) {
        let mut b = [0u8; 8];
        self.ram
            .read_exact_at(&mut b, USED + 4 + (i % QSIZE) as u64 * 8)
            .unwrap();
        (
            u32::from_le_bytes(b[0..4].try_into().unwrap()),
            u32::from_le_bytes(b[4..8].try_into().unwrap()),
        )
    }

    fn data(&self, len: usize) -> Vec<u8> {
        let mut b = vec![0u8; len];
        self.ram.read_exact_at(&mut b, 0x4000).unwrap();
        b
    }
}

fn notify(c: &mut Client) {
    wv(c, NOTIFY, &0u16.to_le_bytes());
}

#[test]
fn describes_a_modern_virtio_blk() {
    let (mut c, mut h) = start("describe", false);
    assert_eq!(c.region(BLK_MSIX_REGION).unwrap().size, 0x1000);
    assert_eq!(c.region(BLK_VIRTIO_REGION).unwrap().size, 0x4000);
    assert_eq!(c.region(0).unwrap().size, 0);
    assert_eq!(c.region(FAULT_LOG_REGION).unwrap().size, 4096);
    assert_eq!(c.get_irq_info(MSIX_IRQ).unwrap().count, VECTORS as u32);
    assert_eq!(c.get_irq_info(ERR_IRQ).unwrap().count, 1);
    assert_eq!(c.get_irq_info(0).unwrap().count, 0);
    assert_eq!(r32(&mut c, CONFIG_REGION, 0), 0x1042_1af4);
    assert_eq!(
        r32(&mut c, CONFIG_REGION, 8),
        0x0100_0001,
        "class 010000, revision 1"
    );
    assert_eq!(r32(&mut c, CONFIG_REGION, 0x2c), 0x1100_1af4);
    assert_ne!(
        r32(&mut c, CONFIG_REGION, 4) & (1 << 20),
        0,
        "capability list"
    );
    // BAR 4: 64-bit memory.
    assert_eq!(r32(&mut c, CONFIG_REGION, 0x10 + 4 * 4) & 0x7, 0x4);
    // The capability list: common, notify, ISR, device (vendor 0x09), MSI-X (0x11).
    let mut p = r32(&mut c, CONFIG_REGION, 0x34) as u64 & 0xfc;
    let mut seen = Vec::new();
    while p != 0 {
        let w = r32(&mut c, CONFIG_REGION, p);
        let (id, next) = (w & 0xff, (w >> 8) & 0xfc);
        if id == 0x09 {
            let (cfg_type, bar) = ((w >> 24) as u8, rd::<1>(&mut c, CONFIG_REGION, p + 4)[0]);
            let off = r32(&mut c, CONFIG_REGION, p + 8);
            assert_eq!(bar, 4);
            seen.push((cfg_type, off));
            if cfg_type == 2 {
                assert_eq!(
                    r32(&mut c, CONFIG_REGION, p + 16),
                    4,
                    "notify_off_multiplier"
                );
            }
        } else {
            assert_eq!(id, 0x11);
            assert_eq!((w >> 16) & 0x7ff, VECTORS as u32 - 1, "table size");
            assert_eq!(r32(&mut c, CONFIG_REGION, p + 4), 1, "table in BAR 1 at 0");
            assert_eq!(
                r32(&mut c, CONFIG_REGION, p + 8),
                0x801,
                "PBA in BAR 1 at 0x800"
            );
            seen.push((0x11, 0));
        }
        p = next as u64;
    }
    assert_eq!(
        seen,
        [(1, 0), (2, 0x3000), (3, 0x1000), (4, 0x2000), (0x11, 0)]
    );
    // The device configuration: capacity, seg_max, blk_size.
    assert_eq!(
        u64::from_le_bytes(rd(&mut c, BLK_VIRTIO_REGION, DEVCFG)),
        SECTORS
    );
    assert_eq!(r32(&mut c, BLK_VIRTIO_REGION, DEVCFG + 12), 254);
    assert_eq!(r32(&mut c, BLK_VIRTIO_REGION, DEVCFG + 20), 512);
    // Features: VERSION_1 (bit 32), ACCESS_PLATFORM (33), SEG_MAX, BLK_SIZE, FLUSH; no RO.
    wv(&mut c, common::DEVICE_FEATURE_SELECT, &1u32.to_le_bytes());
    assert_eq!(r32(&mut c, BLK_VIRTIO_REGION, common::DEVICE_FEATURE), 3);
    wv(&mut c, common::DEVICE_FEATURE_SELECT, &0u32.to_le_bytes());
    let lo = r32(&mut c, BLK_VIRTIO_REGION, common::DEVICE_FEATURE) as u64;
    assert_eq!(lo, feature::SEG_MAX | feature::BLK_SIZE | feature::FLUSH);
    assert_eq!(
        u16::from_le_bytes(rd(&mut c, BLK_VIRTIO_REGION, common::NUM_QUEUES)),
        1
    );
    // Features the device did not offer: FEATURES_OK stays clear.
    let got = init(&mut c, feature::VERSION_1 | (1 << 28));
    assert_eq!(got & status::FEATURES_OK, 0);
    c.shutdown().unwrap();
    h.join().unwrap();
}

#[test]
fn reads_writes_flushes_and_interrupts() {
    let (mut c, mut h) = start("io", false);
    let mut d = Driver::new(&mut c);
    let (cfg_vec, q_vec) = (
        EventFd::new(EFD_NONBLOCK).unwrap(),
        EventFd::new(EFD_NONBLOCK).unwrap(),
    );
    c.set_irqs(
        MSIX_IRQ,
        TRIGGER,
        0,
        2,
        &[cfg_vec.as_raw_fd(), q_vec.as_raw_fd()],
    )
    .unwrap();
    let features =
        feature::VERSION_1 | feature::ACCESS_PLATFORM | feature::FLUSH | feature::BLK_SIZE;
    assert_ne!(init(&mut c, features) & status::FEATURES_OK, 0);

    // IN: two sectors from sector 2.
    let head = d.request(req::IN, 2, 1024, None);
    notify(&mut c);
    assert_eq!(d.used_idx(), 1);
    assert_eq!(d.used(0), (head as u32, 1025));
    assert_eq!(d.status(), req::S_OK);
    let data = d.data(1024);
    assert!(data[..512].iter().all(|&b| b == 2) && data[512..].iter().all(|&b| b == 3));
    assert!(signalled(&q_vec), "the queue's vector");
    assert!(cfg_vec.read().is_err(), "not the config vector");
    assert_eq!(r8(&mut c, ISR), 1);
    assert_eq!(r8(&mut c, ISR), 0, "read to clear");

    // OUT: one sector to sector 5.
    d.ram.write_all_at(&[0xab; 512], 0x4000).unwrap();
    let head = d.request(req::OUT, 5, 512, None);
    notify(&mut c);
    assert_eq!(d.used_idx(), 2);
    assert_eq!(d.used(1), (head as u32, 1));
    assert_eq!(d.status(), req::S_OK);
    let mut got = [0u8; 512];
    h.disk.read_exact_at(&mut got, 5 * 512).unwrap();
    assert!(got.iter().all(|&b| b == 0xab));
    assert!(signalled(&q_vec));

    // FLUSH and GET_ID.
    d.request(req::FLUSH, 0, 0, None);
    notify(&mut c);
    assert_eq!((d.used_idx(), d.status()), (3, req::S_OK));
    d.request(req::GET_ID, 0, 20, None);
    notify(&mut c);
    assert_eq!((d.used_idx(), d.status()), (4, req::S_OK));
    assert_eq!(&d.data(14), b"lucid-vfio-blk");

    // Past the end of the disk: IOERR; an unknown type: UNSUPP.
    d.request(req::IN, SECTORS - 1, 1024, None);
    notify(&mut c);
    assert_eq!((d.used_idx(), d.status()), (5, req::S_IOERR));
    d.request(99, 0, 0, None);
    notify(&mut c);
    assert_eq!((d.used_idx(), d.status()), (6, req::S_UNSUPP));

    // With VIRTQ_AVAIL_F_NO_INTERRUPT the vector stays quiet.
    while q_vec.read().is_ok() {}
    d.ram.write_all_at(&1u16.to_le_bytes(), AVAIL).unwrap();
    d.request(req::IN, 0, 512, None);
    notify(&mut c);
    assert_eq!((d.used_idx(), d.status()), (7, req::S_OK));
    std::thread::sleep(Duration::from_millis(50));
    assert!(q_vec.read().is_err(), "NO_INTERRUPT");

    c.shutdown().unwrap();
    h.join().unwrap();
    let s = h.counters.stats();
    assert_eq!(s.requests, 7);
    assert_eq!((s.disk_read, s.disk_written, s.flushes), (1536, 512, 1));
    assert_eq!((s.ioerr, s.unsupported), (1, 1));
}

#[test]
fn a_buffer_outside_the_mappings_or_read_only_is_refused() {
    let (mut c, mut h) = start("refused", false);
    let mut d = Driver::new(&mut c);
    let err = EventFd::new(EFD_NONBLOCK).unwrap();
    c.set_irqs(ERR_IRQ, TRIGGER, 0, 1, &[err.as_raw_fd()])
        .unwrap();
    assert_ne!(init(&mut c, feature::VERSION_1) & status::FEATURES_OK, 0);
    let head = d.request(req::IN, 0, 512, Some(0x90_0000));
    notify(&mut c);
    // The ERR eventfd was written before the notify's reply.
    assert!(err.read().is_ok(), "ERR before the reply");
    assert_eq!(d.used_idx(), 1);
    assert_eq!(d.used(0), (head as u32, 1));
    assert_eq!(d.status(), req::S_IOERR);
    assert_eq!(r32(&mut c, FAULT_LOG_REGION, 0), 1);
    let rec: [u8; 16] = rd(&mut c, FAULT_LOG_REGION, 8);
    assert_eq!(u64::from_le_bytes(rec[0..8].try_into().unwrap()), 0x90_0000);
    assert_eq!(u32::from_le_bytes(rec[8..12].try_into().unwrap()), 512);
    assert_eq!(
        u32::from_le_bytes(rec[12..16].try_into().unwrap()),
        FAULT_WRITE
    );
    // The device goes on.
    d.request(req::IN, 1, 512, None);
    notify(&mut c);
    assert_eq!((d.used_idx(), d.status()), (2, req::S_OK));
    // An IN into a read-only mapping: refused as a write to it, nothing written there.
    let ro = memfd(0x1000);
    c.dma_map_flags(DmaMapFlags::READ, 0, 0x80_0000, 0x1000, ro.as_raw_fd())
        .unwrap();
    d.request(req::IN, 1, 512, Some(0x80_0000));
    notify(&mut c);
    assert!(err.read().is_ok(), "ERR");
    assert_eq!((d.used_idx(), d.status()), (3, req::S_IOERR));
    assert_eq!(r32(&mut c, FAULT_LOG_REGION, 0), 2);
    let rec: [u8; 16] = rd(&mut c, FAULT_LOG_REGION, 8 + 16);
    assert_eq!(u64::from_le_bytes(rec[0..8].try_into().unwrap()), 0x80_0000);
    assert_eq!(
        u32::from_le_bytes(rec[12..16].try_into().unwrap()),
        FAULT_WRITE | FAULT_READ_ONLY
    );
    let mut got = [0u8; 512];
    ro.read_exact_at(&mut got, 0).unwrap();
    assert!(got.iter().all(|&b| b == 0));
    // An OUT from it reads fine.
    d.request(req::OUT, 4, 512, Some(0x80_0000));
    notify(&mut c);
    assert_eq!((d.used_idx(), d.status()), (4, req::S_OK));
    h.disk.read_exact_at(&mut got, 4 * 512).unwrap();
    assert!(
        got.iter().all(|&b| b == 0),
        "sector 4 from the read-only mapping"
    );
    c.shutdown().unwrap();
    h.join().unwrap();
}

#[test]
fn a_readonly_disk_refuses_writes() {
    let (mut c, mut h) = start("ro", true);
    let mut d = Driver::new(&mut c);
    wv(&mut c, common::DEVICE_FEATURE_SELECT, &0u32.to_le_bytes());
    let lo = r32(&mut c, BLK_VIRTIO_REGION, common::DEVICE_FEATURE) as u64;
    assert_ne!(lo & feature::RO, 0);
    assert_ne!(
        init(&mut c, feature::VERSION_1 | feature::RO) & status::FEATURES_OK,
        0
    );
    d.ram.write_all_at(&[0xcd; 512], 0x4000).unwrap();
    d.request(req::OUT, 3, 512, None);
    notify(&mut c);
    assert_eq!((d.used_idx(), d.status()), (1, req::S_IOERR));
    let mut got = [0u8; 512];
    h.disk.read_exact_at(&mut got, 3 * 512).unwrap();
    assert!(got.iter().all(|&b| b == 3), "unchanged");
    c.shutdown().unwrap();
    h.join().unwrap();
}
