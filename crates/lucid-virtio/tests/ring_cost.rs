//! The ring path's cost, for callgrind: `LUCID_RING_COST_N` GET_ID requests published before
//! activation and served inline (no thread, deterministic). The instructions of one request
//! are the difference between two runs with different N, divided by the difference in N:
//!
//! ```text
//! LUCID_RING_COST_N=80 valgrind --tool=callgrind <test binary> --ignored ring_cost
//! ```
//!
//! `LUCID_RING_COST_IOMMU=1` puts the device behind the test translator (`OffsetIommu`), rings
//! and buffers at IOVAs: the cost of translating with a trivial translator.

mod common;

use common::blkdrv::{cfg, Image, IMAGE};
use common::*;
use lucid_virtio::blk::{req::*, Block};
use lucid_virtio::features::*;
use lucid_virtio::{Coalescing, Notify, VirtioDevice};

#[test]
#[ignore = "a measurement, run under callgrind"]
fn ring_cost() {
    let n: u16 = std::env::var("LUCID_RING_COST_N")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(80)
        .min(80); // 3 descriptors each in a 256-entry table, all published at once
    let img = Image::new(IMAGE);
    let mut g = Guest::new();
    let off = if std::env::var_os("LUCID_RING_COST_IOMMU").is_some() {
        g.behind_iommu(32 << 20);
        32 << 20
    } else {
        0
    };
    let mut dev = Block::new("blk0".into(), cfg(&img)).unwrap();
    let (mut vq, (q, kick)) = Vq::at(&g.mem, 0x10000, 256, off);
    let mut statuses = Vec::new();
    for _ in 0..n {
        let hdr = g.alloc(16);
        let mut h = [0u8; 16];
        h[0..4].copy_from_slice(&VIRTIO_BLK_T_GET_ID.to_le_bytes());
        g.write(hdr, &h);
        let id = g.alloc(20);
        let status = g.alloc(1);
        g.write(status, &[0xff]);
        vq.add(&[(hdr, 16, false), (id, 20, true), (status, 1, true)]);
        statuses.push(status);
    }
    let feats = dev.features() | VIRTIO_RING_F_EVENT_IDX;
    dev.activate(g.ctx(
        vec![(0, q, kick)],
        feats,
        Notify::Inline,
        Coalescing::default(),
    ))
    .unwrap();
    assert_eq!(vq.used_idx(), n);
    assert!(statuses.iter().all(|&s| g.read(s, 1)[0] == VIRTIO_BLK_S_OK));
}
