//! Devices behind a vIOMMU: the DMA path has a translator (a test one that maps IOVA
//! `gpa + OFF` to `gpa` and faults chosen pages), the rings and buffers are given to the device
//! as IOVAs, and the test, as the guest driver, works on guest-physical memory. Checks that rings
//! and data both go through the translator, that a ring fault makes the device need a reset, and
//! that a data fault fails only its request (blk IOERR, net drop) without touching any page the
//! translator did not map.

mod common;

use std::sync::atomic::Ordering;

use common::blkdrv::{cfg, Blk, Image, IMAGE};
use common::*;
use lucid_virtio::blk::{req::*, Block};
use lucid_virtio::features::*;
use lucid_virtio::net::{Net, NetBackend, NetConfig, NET_HDR_LEN};
use lucid_virtio::{Coalescing, Notify, VirtioDevice};

/// IOVA = guest-physical + 32 MiB. The test's buffers and rings sit below 32 MiB, so a device
/// that skipped translation would use an IOVA as a guest-physical address inside RAM, and
/// `changed_pages` would see it.
const OFF: u64 = 32 << 20;

fn blk_behind_iommu(img: &Image, notify: Notify) -> (Blk, std::sync::Arc<OffsetIommu>) {
    let g = Guest::new();
    let iommu = g.behind_iommu(OFF);
    let b = Blk::build(g, OFF, cfg(img), notify, Coalescing::default(), true);
    (b, iommu)
}

/// Pages at or above `OFF`: where a device that used IOVAs as guest-physical would write.
fn bypassed(pages: &[u64]) -> Vec<u64> {
    pages.iter().copied().filter(|&p| p >= OFF >> 12).collect()
}

#[test]
fn blk_rings_and_data_at_iovas() {
    for notify in [Notify::Kicks, Notify::Poll { idle_sleep_us: 10 }] {
        let img = Image::new(IMAGE);
        let (mut b, iommu) = blk_behind_iommu(&img, notify);
        let before = b.g.read(0, RAM as usize);
        // Buffers that cross pages: each piece is translated separately.
        let data = pattern(7, 3 * 4096);
        assert_eq!(b.write(8, &data), VIRTIO_BLK_S_OK, "{notify:?}");
        assert_eq!(img.read(8 * 512, data.len()), data);
        let (st, back) = b.read(8, data.len());
        assert_eq!(st, VIRTIO_BLK_S_OK);
        assert_eq!(back, data);
        let id = b.g.alloc(20);
        assert_eq!(
            b.req(VIRTIO_BLK_T_GET_ID, 0, &[(id, 20, true)]),
            (VIRTIO_BLK_S_OK, 21)
        );
        assert_eq!(&b.g.read(id, 15)[..], b"lucid-test-disk");
        assert!(bypassed(&b.g.changed_pages(&before)).is_empty());
        assert_eq!(b.g.stat("dma.errors"), 0);
        assert!(!b.dev.needs_reset());
        b.dev.reset();
        assert!(iommu.translations.load(Ordering::SeqCst) > 0);
        assert_eq!(iommu.unbracketed.load(Ordering::SeqCst), 0);
        assert_eq!(iommu.open(), 0, "every bracket ended");
    }
}

#[test]
fn blk_ring_fault_needs_reset() {
    for ring in ["desc", "avail", "used"] {
        let img = Image::new(IMAGE);
        let (mut b, iommu) = blk_behind_iommu(&img, Notify::Kicks);
        let gpa = match ring {
            "desc" => b.vq.desc,
            "avail" => b.vq.avail,
            _ => b.vq.used,
        };
        iommu.unmap_gpa(gpa);
        let id = b.g.alloc(20);
        b.submit(VIRTIO_BLK_T_GET_ID, 0, &[(id, 20, true)]);
        assert!(wait_for(|| b.dev.needs_reset()), "{ring}: needs reset");
        assert!(b.g.irq.config() >= 1, "{ring}: config interrupt");
        assert!(b.g.stat("dma.errors") >= 1);
        assert_eq!(b.vq.used_idx(), 0, "{ring}: nothing completed");
        b.dev.reset();
        assert!(!b.dev.needs_reset());
        assert_eq!(iommu.open(), 0);
    }
}

#[test]
fn blk_avail_entry_fault_is_not_an_empty_ring() {
    // The avail ring's index is readable but its entries are on an unmapped page: virtio-queue
    // just yields nothing; the worker must see a ring fault rather than wait forever.
    let img = Image::new(IMAGE);
    let mut g = Guest::new();
    let iommu = g.behind_iommu(OFF);
    let mut dev = Block::new("blk0".into(), cfg(&img)).unwrap();
    let (mut vq, (mut q, kick)) = Vq::at(&g.mem, 0x10000, 256, OFF);
    vq.avail = 0x20000 - 4; // flags and idx end page 0x1f; the entries start page 0x20
    q.try_set_avail_ring_address(lucid_mem::vm_memory::GuestAddress(vq.avail + OFF))
        .unwrap();
    let feats = dev.features() | VIRTIO_RING_F_EVENT_IDX;
    dev.activate(g.ctx(
        vec![(0, q, kick)],
        feats,
        Notify::Kicks,
        Coalescing::default(),
    ))
    .unwrap();
    iommu.unmap_gpa(0x20000);
    let hdr = g.alloc(16);
    g.write(hdr, &[0; 16]);
    let status = g.alloc(1);
    vq.add(&[(hdr, 16, false), (status, 1, true)]);
    vq.kick();
    assert!(wait_for(|| dev.needs_reset()));
    assert_eq!(g.irq.config(), 1);
    dev.reset();
}

#[test]
fn blk_data_fault_is_ioerr_and_touches_no_unmapped_page() {
    let img = Image::new(IMAGE);
    let (mut b, iommu) = blk_behind_iommu(&img, Notify::Kicks);
    let disk = pattern(3, 8192);
    img.write(0, &disk);
    // A read into two pages, the second unmapped.
    let buf = (b.g.alloc(3 * 4096) + 4095) & !4095;
    b.g.write(buf, &[0xa5; 8192]);
    iommu.unmap_gpa(buf + 4096);
    let before = b.g.read(0, RAM as usize);
    let errors = b.g.stat("dma.errors");
    let (status, len) = b.req(VIRTIO_BLK_T_IN, 0, &[(buf, 8192, true)]);
    assert_eq!((status, len), (VIRTIO_BLK_S_IOERR, 1));
    assert!(b.g.stat("dma.errors") > errors);
    // Never the unmapped page, nor anything a bypassing device would have hit.
    let changed = b.g.changed_pages(&before);
    assert!(!changed.contains(&((buf + 4096) >> 12)), "{changed:x?}");
    assert!(bypassed(&changed).is_empty(), "{changed:x?}");
    assert_eq!(b.g.read(buf + 4096, 4096), vec![0xa5; 4096]);
    // Everything changed is the driver's ring pages, the mapped data page, the header/status.
    let rings = [b.vq.desc >> 12, b.vq.avail >> 12, b.vq.used >> 12];
    let others: Vec<u64> = changed
        .iter()
        .copied()
        .filter(|p| !rings.contains(p) && *p != buf >> 12)
        .collect();
    assert_eq!(others.len(), 1, "only the header/status page: {changed:x?}");
    // A write from an unmapped buffer: IOERR, the disk keeps its data.
    let (status, _) = b.req(VIRTIO_BLK_T_OUT, 0, &[(buf + 4096, 4096, false)]);
    assert_eq!(status, VIRTIO_BLK_S_IOERR);
    assert_eq!(img.read(0, 8192), disk);
    // The device goes on.
    assert!(!b.dev.needs_reset());
    let (status, data) = b.read(0, 512);
    assert_eq!(status, VIRTIO_BLK_S_OK);
    assert_eq!(data, disk[..512]);
    b.dev.reset();
    assert_eq!(iommu.open(), 0);
    assert_eq!(iommu.unbracketed.load(Ordering::SeqCst), 0);
}

/// virtio-net with the echo back-end behind the test IOMMU.
struct EchoNet {
    g: Guest,
    iommu: std::sync::Arc<OffsetIommu>,
    rx: Vq,
    tx: Vq,
    dev: Net,
}

impl EchoNet {
    fn new() -> EchoNet {
        let g = Guest::new();
        let iommu = g.behind_iommu(OFF);
        let mut dev = Net::new(
            "net0".into(),
            NetConfig {
                backend: NetBackend::Echo,
                mac: [0x52, 0x54, 0, 0x12, 0x34, 0x56],
            },
        )
        .unwrap();
        let (rx, (rq, rk)) = Vq::at(&g.mem, 0x10000, 256, OFF);
        let (tx, (tq, tk)) = Vq::at(&g.mem, 0x14000, 256, OFF);
        let feats = dev.features();
        dev.activate(g.ctx(
            vec![(0, rq, rk), (1, tq, tk)],
            feats,
            Notify::Kicks,
            Coalescing::default(),
        ))
        .unwrap();
        EchoNet {
            g,
            iommu,
            rx,
            tx,
            dev,
        }
    }

    fn post_rx(&mut self, at: u64) {
        self.rx.add(&[(at, 2048, true)]);
        self.rx.kick();
    }

    fn send(&mut self, frame: &[u8]) -> u64 {
        let h = self.g.alloc(NET_HDR_LEN as u64);
        self.g.write(h, &[0; NET_HDR_LEN]);
        let f = self.g.alloc(frame.len() as u64);
        self.g.write(f, frame);
        self.tx.add(&[
            (h, NET_HDR_LEN as u32, false),
            (f, frame.len() as u32, false),
        ]);
        f
    }

    fn stat(&self, n: &str) -> u64 {
        self.g.stat(&format!("net0.{n}"))
    }
}

fn frame(seed: u64) -> Vec<u8> {
    let mut f = pattern(seed, 300);
    f[12..14].copy_from_slice(&0x88b5u16.to_be_bytes());
    f
}

#[test]
fn net_rings_at_iovas_and_faulting_frames_dropped() {
    let mut n = EchoNet::new();
    let before = n.g.read(0, RAM as usize);
    // A frame goes out and comes back, rings and buffers all at IOVAs.
    let rx_buf = n.g.alloc(2048);
    n.post_rx(rx_buf);
    let f = frame(1);
    n.send(&f);
    n.tx.kick();
    assert_eq!(n.tx.next_used().unwrap().1, 0);
    let (_, len) = n.rx.next_used().expect("echoed");
    assert_eq!(len as usize, NET_HDR_LEN + f.len());
    assert_eq!(n.g.read(rx_buf + NET_HDR_LEN as u64, f.len()), f);
    assert!(bypassed(&n.g.changed_pages(&before)).is_empty());

    // A tx frame whose buffer faults: consumed, dropped, counted; nothing echoed.
    let f2 = frame(2);
    let at = n.g.alloc(0x2000);
    let page = (at + 0xfff) & !0xfff;
    let h = n.g.alloc(NET_HDR_LEN as u64);
    n.g.write(page, &f2);
    n.iommu.unmap_gpa(page);
    n.tx.add(&[(h, NET_HDR_LEN as u32, false), (page, 300, false)]);
    n.tx.kick();
    assert_eq!(n.tx.next_used().unwrap().1, 0);
    assert_eq!(n.stat("tx_dropped_fault"), 1);
    assert_eq!(n.stat("tx_dropped"), 1);

    // An rx buffer that faults: the frame is dropped, the chain completed with 0 bytes.
    n.post_rx(page);
    n.send(&frame(3));
    n.tx.kick();
    assert_eq!(n.tx.next_used().unwrap().1, 0);
    assert_eq!(n.rx.next_used().expect("rx chain returned").1, 0);
    assert_eq!(n.stat("rx_dropped_fault"), 1);
    assert_eq!(n.g.read(page, 300), f2, "the unmapped page is untouched");

    // And the device goes on.
    let rx_buf = n.g.alloc(2048);
    n.post_rx(rx_buf);
    let f4 = frame(4);
    n.send(&f4);
    n.tx.kick();
    assert_eq!(n.rx.next_used().unwrap().1 as usize, NET_HDR_LEN + f4.len());
    assert_eq!(n.g.read(rx_buf + NET_HDR_LEN as u64, f4.len()), f4);
    assert!(!n.dev.needs_reset());
    n.dev.reset();
    assert_eq!(n.iommu.open(), 0);
    assert_eq!(n.iommu.unbracketed.load(Ordering::SeqCst), 0);
}

#[test]
fn net_ring_fault_needs_reset() {
    let mut n = EchoNet::new();
    n.iommu.unmap_gpa(n.tx.used);
    n.send(&frame(1));
    n.tx.kick();
    assert!(wait_for(|| n.dev.needs_reset()));
    assert!(n.g.irq.config() >= 1);
    n.dev.reset();
    assert_eq!(n.iommu.open(), 0);
}
