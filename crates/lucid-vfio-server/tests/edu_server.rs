//! The edu device server on a temporary socket, in a thread, driven by the `vfio_user` crate's
//! own client: negotiation, regions, config space, registers, interrupts, DMA through a memfd
//! and its refusals. Read-only mappings (the crate's client always maps read-write) are tested
//! on the table and backend directly.

use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use lucid_mem::{Access, DmaError, FaultReason};
use lucid_pci::config::{COMMAND, COMMAND_BUS_MASTER, COMMAND_MEMORY};
use lucid_pci::edu::{reg, DMA_BUF_ADDR, DMA_CMD_START, DMA_CMD_TO_RAM, EDU_IDENT, IRQ_DMA};
use lucid_pci::EduDma;
use lucid_stats::StatsRegistry;
use lucid_vfio_server::dma::{FAULT_READ_ONLY, FAULT_WRITE};
use lucid_vfio_server::{
    server, DmaTable, EduServer, FaultRecord, MapError, BAR0_REGION, CONFIG_REGION, ERR_IRQ,
    FAULT_LOG_REGION, INTX_IRQ, MSIX_IRQ, MSI_IRQ,
};
use vfio_bindings::bindings::vfio::{
    VFIO_IRQ_SET_ACTION_MASK, VFIO_IRQ_SET_ACTION_TRIGGER, VFIO_IRQ_SET_ACTION_UNMASK,
    VFIO_IRQ_SET_DATA_EVENTFD, VFIO_IRQ_SET_DATA_NONE, VFIO_REGION_INFO_FLAG_READ,
    VFIO_REGION_INFO_FLAG_WRITE,
};
use vfio_user::{Client, DmaMapFlags, DmaUnmapFlags, ServerBackend};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

const TRIGGER: u32 = VFIO_IRQ_SET_ACTION_TRIGGER | VFIO_IRQ_SET_DATA_EVENTFD;
const UNMASK: u32 = VFIO_IRQ_SET_ACTION_UNMASK | VFIO_IRQ_SET_DATA_EVENTFD;

struct Harness {
    dir: PathBuf,
    dma: Arc<DmaTable>,
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

/// A server on a fresh socket and a client connected to it.
fn start(name: &str) -> (Client, Harness) {
    let dir = std::env::temp_dir().join(format!("lucid-vfio-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let sock = dir.join("edu.sock");
    let listener = server::bind(&sock).unwrap();
    let dma = Arc::new(DmaTable::new());
    let thread = {
        let dma = dma.clone();
        std::thread::spawn(move || {
            let stats = StatsRegistry::new();
            server::serve(listener, &dma, &stats, &AtomicU64::new(0), false)
        })
    };
    let client = Client::new(&sock).expect("version negotiation and region discovery");
    let h = Harness {
        dir,
        dma,
        thread: Some(thread),
    };
    (client, h)
}

fn r32(c: &mut Client, region: u32, off: u64) -> u32 {
    let mut b = [0u8; 4];
    c.region_read(region, off, &mut b).unwrap();
    u32::from_le_bytes(b)
}

fn w32(c: &mut Client, region: u32, off: u64, v: u32) {
    c.region_write(region, off, &v.to_le_bytes()).unwrap();
}

fn w64(c: &mut Client, off: u64, v: u64) {
    c.region_write(BAR0_REGION, off, &v.to_le_bytes()).unwrap();
}

fn enable_bus_master(c: &mut Client) {
    let cmd = COMMAND_MEMORY | COMMAND_BUS_MASTER;
    c.region_write(CONFIG_REGION, COMMAND as u64, &cmd.to_le_bytes())
        .unwrap();
}

fn dma(c: &mut Client, src: u64, dst: u64, count: u64, cmd: u64) {
    w64(c, reg::DMA_SRC, src);
    w64(c, reg::DMA_DST, dst);
    w64(c, reg::DMA_COUNT, count);
    w64(c, reg::DMA_CMD, cmd | DMA_CMD_START);
}

/// Whether `e` was signalled within a second (and consumes it).
fn signalled(e: &EventFd) -> bool {
    for _ in 0..100 {
        if e.read().is_ok() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    false
}

fn memfd(size: u64) -> File {
    // SAFETY: a new anonymous file from a NUL-terminated name; the descriptor is ours.
    let fd = unsafe { libc::memfd_create(c"lucid-test-ram".as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
    // SAFETY: `fd` is a fresh descriptor nothing else owns.
    let f = unsafe { File::from_raw_fd(fd) };
    f.set_len(size).unwrap();
    f
}

fn fault_log(c: &mut Client) -> (u32, Vec<FaultRecord>) {
    let total = r32(c, FAULT_LOG_REGION, 0);
    let recs = (0..total.min(64) as u64)
        .map(|i| {
            let mut b = [0u8; 16];
            c.region_read(FAULT_LOG_REGION, 8 + i * 16, &mut b).unwrap();
            FaultRecord {
                iova: u64::from_le_bytes(b[0..8].try_into().unwrap()),
                len: u32::from_le_bytes(b[8..12].try_into().unwrap()),
                flags: u32::from_le_bytes(b[12..16].try_into().unwrap()),
            }
        })
        .collect();
    (total, recs)
}

#[test]
fn negotiates_and_describes_the_edu() {
    let (mut c, mut h) = start("describe");
    let rw = VFIO_REGION_INFO_FLAG_READ | VFIO_REGION_INFO_FLAG_WRITE;
    let bar0 = c.region(BAR0_REGION).unwrap();
    assert_eq!((bar0.size, bar0.flags), (1 << 20, rw));
    let cfg = c.region(CONFIG_REGION).unwrap();
    assert_eq!((cfg.size, cfg.flags), (256, rw));
    let log = c.region(FAULT_LOG_REGION).unwrap();
    assert_eq!((log.size, log.flags), (4096, VFIO_REGION_INFO_FLAG_READ));
    assert_eq!(c.region(1).unwrap().size, 0);
    for (index, count) in [(INTX_IRQ, 1), (MSI_IRQ, 1), (MSIX_IRQ, 0), (ERR_IRQ, 1)] {
        assert_eq!(c.get_irq_info(index).unwrap().count, count, "irq {index}");
    }
    // 1234:11e8, class 00ff00, the MSI capability in the list.
    assert_eq!(r32(&mut c, CONFIG_REGION, 0), 0x11e8_1234);
    assert_eq!(r32(&mut c, CONFIG_REGION, 8) >> 8, 0x00ff00);
    let cap = r32(&mut c, CONFIG_REGION, 0x34) & 0xff;
    assert_ne!(cap, 0);
    assert_eq!(r32(&mut c, CONFIG_REGION, cap.into()) & 0xff, 0x05);
    c.shutdown().unwrap();
    h.join().unwrap();
}

#[test]
fn registers_through_region_accesses() {
    let (mut c, mut h) = start("regs");
    assert_eq!(r32(&mut c, BAR0_REGION, reg::IDENT), EDU_IDENT);
    w32(&mut c, BAR0_REGION, reg::LIVENESS, 0x1234_5678);
    assert_eq!(r32(&mut c, BAR0_REGION, reg::LIVENESS), !0x1234_5678);
    w32(&mut c, BAR0_REGION, reg::FACTORIAL, 10);
    assert_eq!(r32(&mut c, BAR0_REGION, reg::FACTORIAL), 3_628_800);
    c.reset().unwrap();
    assert_eq!(r32(&mut c, BAR0_REGION, reg::LIVENESS), 0, "reset");
    c.shutdown().unwrap();
    h.join().unwrap();
}

#[test]
fn intx_and_msi_on_the_clients_eventfds() {
    let (mut c, mut h) = start("irqs");
    let intx = EventFd::new(EFD_NONBLOCK).unwrap();
    let unmask = EventFd::new(EFD_NONBLOCK).unwrap();
    c.set_irqs(INTX_IRQ, TRIGGER, 0, 1, &[intx.as_raw_fd()])
        .unwrap();
    c.set_irqs(INTX_IRQ, UNMASK, 0, 1, &[unmask.as_raw_fd()])
        .unwrap();
    w32(&mut c, BAR0_REGION, reg::IRQ_RAISE, 0x10);
    assert!(signalled(&intx), "INTx on the raise");
    assert_eq!(r32(&mut c, BAR0_REGION, reg::IRQ_STATUS), 0x10);
    // Still high: each unmask signals it again.
    unmask.write(1).unwrap();
    assert!(signalled(&intx), "INTx again at the unmask");
    w32(&mut c, BAR0_REGION, reg::IRQ_ACK, 0x10);
    unmask.write(1).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    assert!(intx.read().is_err(), "low: the unmask signals nothing");

    // Masked, a rise is held back until the unmask; a cleared trigger signals nothing.
    let none = VFIO_IRQ_SET_DATA_NONE;
    c.set_irqs(INTX_IRQ, VFIO_IRQ_SET_ACTION_MASK | none, 0, 1, &[])
        .unwrap();
    w32(&mut c, BAR0_REGION, reg::IRQ_RAISE, 0x20);
    std::thread::sleep(Duration::from_millis(50));
    assert!(intx.read().is_err(), "masked");
    c.set_irqs(INTX_IRQ, VFIO_IRQ_SET_ACTION_UNMASK | none, 0, 1, &[])
        .unwrap();
    assert!(signalled(&intx), "at the unmask");
    w32(&mut c, BAR0_REGION, reg::IRQ_ACK, 0x20);
    c.set_irqs(INTX_IRQ, VFIO_IRQ_SET_ACTION_TRIGGER | none, 0, 0, &[])
        .unwrap();
    w32(&mut c, BAR0_REGION, reg::IRQ_RAISE, 0x20);
    std::thread::sleep(Duration::from_millis(50));
    assert!(intx.read().is_err(), "no trigger eventfd");
    w32(&mut c, BAR0_REGION, reg::IRQ_ACK, 0x20);

    // MSI: the eventfd turns the edu's MSI on; bus mastering lets it out.
    let msi = EventFd::new(EFD_NONBLOCK).unwrap();
    c.set_irqs(MSI_IRQ, TRIGGER, 0, 1, &[msi.as_raw_fd()])
        .unwrap();
    enable_bus_master(&mut c);
    w32(&mut c, BAR0_REGION, reg::IRQ_RAISE, 0x1);
    assert!(signalled(&msi), "MSI");
    assert!(intx.read().is_err(), "no INTx with MSI on");
    c.shutdown().unwrap();
    h.join().unwrap();
}

#[test]
fn dma_both_directions_through_a_memfd() {
    let (mut c, mut h) = start("dma");
    let ram = memfd(0x10000);
    ram.write_all_at(b"from the guest's RAM", 0x100).unwrap();
    c.dma_map(0, 0x20_0000, 0x10000, ram.as_raw_fd()).unwrap();
    enable_bus_master(&mut c);
    let irq = EventFd::new(EFD_NONBLOCK).unwrap();
    c.set_irqs(INTX_IRQ, TRIGGER, 0, 1, &[irq.as_raw_fd()])
        .unwrap();
    // RAM -> device buffer, then the buffer -> RAM elsewhere (crossing a page).
    dma(&mut c, 0x20_0100, DMA_BUF_ADDR, 20, 0x4);
    assert!(signalled(&irq));
    assert_eq!(r32(&mut c, BAR0_REGION, reg::IRQ_STATUS), IRQ_DMA);
    dma(&mut c, DMA_BUF_ADDR, 0x20_2ffa, 20, DMA_CMD_TO_RAM);
    let mut got = [0u8; 20];
    ram.read_exact_at(&mut got, 0x2ffa).unwrap();
    assert_eq!(&got, b"from the guest's RAM");
    let s = h.dma.stats();
    assert_eq!(
        (s.maps, s.bytes_read, s.bytes_written, s.refused),
        (1, 20, 20, 0)
    );
    c.dma_unmap(0x20_0000, 0x10000).unwrap();
    assert_eq!(h.dma.stats().unmaps, 1);
    assert!(h.dma.mappings().is_empty());
    c.shutdown().unwrap();
    h.join().unwrap();
}

#[test]
fn dma_outside_the_mappings_is_refused_logged_and_signalled() {
    let (mut c, mut h) = start("refused");
    let ram = memfd(0x4000);
    ram.write_all_at(&[0x5a; 0x4000], 0).unwrap();
    ram.write_all_at(&[0xa5; 64], 0).unwrap();
    c.dma_map(0, 0x10_0000, 0x4000, ram.as_raw_fd()).unwrap();
    enable_bus_master(&mut c);
    let err = EventFd::new(EFD_NONBLOCK).unwrap();
    c.set_irqs(ERR_IRQ, TRIGGER, 0, 1, &[err.as_raw_fd()])
        .unwrap();
    // Fill the device buffer from mapped RAM, then aim it at never-mapped IOVAs.
    dma(&mut c, 0x10_0000, DMA_BUF_ADDR, 64, 0);
    dma(&mut c, DMA_BUF_ADDR, 0x30_0000, 16, DMA_CMD_TO_RAM);
    // The ERR eventfd was written before the reply to the register write came back.
    assert_eq!(err.read().unwrap(), 1, "ERR before the reply");
    // A write straddling the mapping's end: refused whole, from the first unmapped byte.
    dma(&mut c, DMA_BUF_ADDR, 0x10_3ff8, 16, DMA_CMD_TO_RAM);
    assert_eq!(err.read().unwrap(), 1);
    // A read of an unmapped IOVA.
    dma(&mut c, 0x50_0000, DMA_BUF_ADDR, 8, 0);
    assert_eq!(err.read().unwrap(), 1);
    let (total, recs) = fault_log(&mut c);
    assert_eq!(total, 3);
    assert_eq!(
        recs,
        vec![
            FaultRecord {
                iova: 0x30_0000,
                len: 16,
                flags: FAULT_WRITE
            },
            FaultRecord {
                iova: 0x10_4000,
                len: 8,
                flags: FAULT_WRITE
            },
            FaultRecord {
                iova: 0x50_0000,
                len: 8,
                flags: 0
            },
        ]
    );
    let mut all = vec![0u8; 0x4000];
    ram.read_exact_at(&mut all, 0).unwrap();
    assert!(all[..64].iter().all(|&b| b == 0xa5), "no byte moved");
    assert!(all[64..].iter().all(|&b| b == 0x5a), "no byte moved");
    // Just unmapped: refused too.
    c.dma_unmap(0x10_0000, 0x4000).unwrap();
    dma(&mut c, DMA_BUF_ADDR, 0x10_0000, 4, DMA_CMD_TO_RAM);
    assert_eq!(err.read().unwrap(), 1);
    assert_eq!(fault_log(&mut c).0, 4);
    assert_eq!(h.dma.stats().refused, 4);
    c.shutdown().unwrap();
    h.join().unwrap();
    assert!(
        h.dma.mappings().is_empty(),
        "the mappings go with the client"
    );
}

#[test]
fn read_only_mappings_refuse_writes_on_the_table() {
    let t = DmaTable::new();
    let err = EventFd::new(EFD_NONBLOCK).unwrap();
    // SAFETY: a duplicate of the eventfd, owned by the File.
    let dup = unsafe { File::from_raw_fd(libc::dup(err.as_raw_fd())) };
    t.set_err_eventfd(Some(dup));
    let ram = memfd(0x3000);
    ram.write_all_at(b"read me", 0x1000).unwrap();
    t.map(DmaMapFlags::READ, 0x1000, 0x8000, 0x2000, Some(&ram))
        .unwrap();
    let mut b = [0u8; 7];
    assert_eq!(
        EduDma::read(&t, 0, 0x8000, &mut b),
        Err(DmaError::BusMasterOff { dev: 0 })
    );
    t.set_bus_master(0, true);
    EduDma::read(&t, 0, 0x8000, &mut b).unwrap();
    assert_eq!(&b, b"read me");
    assert_eq!(
        EduDma::write(&t, 0, 0x8000, b"WRITE"),
        Err(DmaError::Fault {
            dev: 0,
            iova: 0x8000,
            access: Access::Write,
            reason: FaultReason::Denied
        })
    );
    assert_eq!(err.read().unwrap(), 1);
    EduDma::read(&t, 0, 0x8000, &mut b).unwrap();
    assert_eq!(&b, b"read me", "unchanged");
    assert_eq!(
        t.faults(),
        vec![FaultRecord {
            iova: 0x8000,
            len: 5,
            flags: FAULT_WRITE | FAULT_READ_ONLY
        }]
    );
    // Overlaps and a missing descriptor are refused.
    assert!(matches!(
        t.map(DmaMapFlags::READ_WRITE, 0, 0x9000, 0x1000, Some(&ram)),
        Err(MapError::Overlap { .. })
    ));
    assert!(matches!(
        t.map(DmaMapFlags::READ_WRITE, 0, 0x20000, 0x1000, None),
        Err(MapError::NoFd { .. })
    ));
    assert!(matches!(
        t.map(DmaMapFlags::READ_WRITE, 0x2000, 0x20000, 0x2000, Some(&ram)),
        Err(MapError::PastEnd { .. })
    ));
    assert_eq!(t.stats().refused, 2);
}

#[test]
fn partial_unmaps_split_on_page_boundaries() {
    let t = DmaTable::new();
    t.set_bus_master(0, true);
    let ram = memfd(0x4000);
    t.map(DmaMapFlags::READ_WRITE, 0, 0x10000, 0x4000, Some(&ram))
        .unwrap();
    assert!(matches!(
        t.unmap(DmaUnmapFlags::empty(), 0x10800, 0x1000),
        Err(MapError::Split { .. })
    ));
    assert!(matches!(
        t.unmap(DmaUnmapFlags::empty(), 0x40000, 0x1000),
        Err(MapError::NotMapped { .. })
    ));
    t.unmap(DmaUnmapFlags::empty(), 0x11000, 0x1000).unwrap();
    assert_eq!(
        t.mappings(),
        vec![(0x10000, 0x1000, true), (0x12000, 0x2000, true)]
    );
    EduDma::write(&t, 0, 0x13ffc, b"tail").unwrap();
    EduDma::write(&t, 0, 0x10000, b"head").unwrap();
    assert!(EduDma::write(&t, 0, 0x11000, b"gone").is_err());
    let mut b = [0u8; 4];
    ram.read_exact_at(&mut b, 0x3ffc).unwrap();
    assert_eq!(&b, b"tail");
    ram.read_exact_at(&mut b, 0x1000).unwrap();
    assert_eq!(b, [0; 4]);
    t.unmap(DmaUnmapFlags::UNMAP_ALL, 0, 0).unwrap();
    assert!(t.mappings().is_empty());
}

#[test]
fn backend_refuses_device_writes_to_a_read_only_mapping() {
    let dma = Arc::new(DmaTable::new());
    let mut edu = EduServer::new(dma.clone(), StatsRegistry::new()).unwrap();
    let ram = memfd(0x1000);
    ram.write_all_at(b"keep", 0).unwrap();
    edu.dma_map(
        DmaMapFlags::READ,
        0,
        0x4000,
        0x1000,
        Some(ram.try_clone().unwrap()),
    )
    .unwrap();
    let cmd = COMMAND_MEMORY | COMMAND_BUS_MASTER;
    edu.region_write(CONFIG_REGION, COMMAND as u64, &cmd.to_le_bytes())
        .unwrap();
    let w = |edu: &mut EduServer, off: u64, v: u64| {
        edu.region_write(BAR0_REGION, off, &v.to_le_bytes())
            .unwrap();
    };
    // Read it into the buffer (allowed), then write it back (refused).
    w(&mut edu, reg::DMA_SRC, 0x4000);
    w(&mut edu, reg::DMA_DST, DMA_BUF_ADDR);
    w(&mut edu, reg::DMA_COUNT, 4);
    w(&mut edu, reg::DMA_CMD, DMA_CMD_START);
    assert_eq!(&edu.device().buffer()[..4], b"keep");
    w(&mut edu, reg::DMA_SRC, DMA_BUF_ADDR + 8);
    w(&mut edu, reg::DMA_DST, 0x4000);
    w(&mut edu, reg::DMA_CMD, DMA_CMD_START | DMA_CMD_TO_RAM);
    let mut b = [0u8; 4];
    ram.read_exact_at(&mut b, 0).unwrap();
    assert_eq!(&b, b"keep");
    assert_eq!(
        dma.faults(),
        vec![FaultRecord {
            iova: 0x4000,
            len: 4,
            flags: FAULT_WRITE | FAULT_READ_ONLY
        }]
    );
    let mut log = [0u8; 4];
    edu.region_read(FAULT_LOG_REGION, 0, &mut log).unwrap();
    assert_eq!(u32::from_le_bytes(log), 1);
    assert!(edu.region_write(FAULT_LOG_REGION, 0, &[0; 4]).is_err());
    assert!(edu.region_read(BAR0_REGION, (1 << 20) - 2, &mut b).is_err());
}

#[test]
fn with_reconnect_the_next_client_gets_a_fresh_device_and_no_mappings() {
    let dir = std::env::temp_dir().join(format!("lucid-vfio-{}-reconnect", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let sock = dir.join("edu.sock");
    let listener = server::bind(&sock).unwrap();
    let dma = Arc::new(DmaTable::new());
    let clients = Arc::new(AtomicU64::new(0));
    {
        let (dma, clients) = (dma.clone(), clients.clone());
        // Serves until the test process ends.
        std::thread::spawn(move || {
            server::serve(listener, &dma, &StatsRegistry::new(), &clients, true)
        });
    }
    let ram = memfd(0x1000);
    let mut c = Client::new(&sock).unwrap();
    w32(&mut c, BAR0_REGION, reg::LIVENESS, 0);
    c.dma_map(0, 0x1000, 0x1000, ram.as_raw_fd()).unwrap();
    assert_eq!(dma.mappings().len(), 1);
    c.shutdown().unwrap();
    drop(c);
    let mut c = Client::new(&sock).unwrap();
    assert_eq!(r32(&mut c, BAR0_REGION, reg::LIVENESS), 0, "a fresh edu");
    assert!(
        dma.mappings().is_empty(),
        "the last client's mappings are gone"
    );
    assert_eq!(clients.load(std::sync::atomic::Ordering::Relaxed), 1);
    c.shutdown().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}
