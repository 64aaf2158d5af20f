//! A virtio-blk device on one queue, driven by the test as the guest.
#![allow(dead_code)]

use std::os::unix::fs::FileExt;
use std::path::PathBuf;

use super::*;
use lucid_virtio::blk::{req::*, Block, BlockConfig};
use lucid_virtio::features::*;
use lucid_virtio::{Coalescing, Notify, VirtioDevice};

pub const IMAGE: u64 = 8 << 20;

/// A temporary image file, removed on drop.
pub struct Image(pub PathBuf);

impl Image {
    pub fn new(len: u64) -> Image {
        use std::sync::atomic::{AtomicU32, Ordering};
        static N: AtomicU32 = AtomicU32::new(0);
        let p = std::env::temp_dir().join(format!(
            "lucid-blk-test-{}-{}.img",
            std::process::id(),
            N.fetch_add(1, Ordering::SeqCst)
        ));
        let f = std::fs::File::create(&p).unwrap();
        f.set_len(len).unwrap();
        Image(p)
    }
    pub fn read(&self, off: u64, len: usize) -> Vec<u8> {
        let f = std::fs::File::open(&self.0).unwrap();
        let mut v = vec![0; len];
        f.read_exact_at(&mut v, off).unwrap();
        v
    }
    pub fn write(&self, off: u64, data: &[u8]) {
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(&self.0)
            .unwrap();
        f.write_all_at(data, off).unwrap();
    }
}

impl Drop for Image {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

pub fn cfg(img: &Image) -> BlockConfig {
    BlockConfig {
        path: img.0.clone(),
        read_only: false,
        logical_block_size: 512,
        id: "lucid-test-disk".into(),
        direct: false,
    }
}

/// A guest with one virtio-blk device on an activated queue.
pub struct Blk {
    pub g: Guest,
    pub vq: Vq,
    pub dev: Block,
    pub poll: bool,
}

impl Blk {
    pub fn new(cfg: BlockConfig) -> Blk {
        Self::with(cfg, Notify::Kicks, Coalescing::default(), true)
    }

    pub fn with(cfg: BlockConfig, notify: Notify, coal: Coalescing, event_idx: bool) -> Blk {
        Self::build(Guest::new(), 0, cfg, notify, coal, event_idx)
    }

    /// A device on guest `g` whose addresses are guest-physical + `dev_off` (an
    /// [`OffsetIommu`] installed in `g` beforehand).
    pub fn build(
        g: Guest,
        dev_off: u64,
        cfg: BlockConfig,
        notify: Notify,
        coal: Coalescing,
        event_idx: bool,
    ) -> Blk {
        Self::build_hooked(g, dev_off, cfg, notify, coal, event_idx, None)
    }

    /// [`Blk::build`] with a data hook installed before activation.
    pub fn build_hooked(
        g: Guest,
        dev_off: u64,
        cfg: BlockConfig,
        notify: Notify,
        coal: Coalescing,
        event_idx: bool,
        hook: Option<std::sync::Arc<dyn lucid_virtio::blk::BlockDataHook>>,
    ) -> Blk {
        let mut dev = Block::new("blk0".into(), cfg).unwrap();
        if let Some(h) = hook {
            dev.set_data_hook(h);
        }
        let (vq, (q, kick)) = Vq::at(&g.mem, 0x10000, 256, dev_off);
        let mut feats = dev.features() & !VIRTIO_RING_F_EVENT_IDX;
        if event_idx {
            feats |= VIRTIO_RING_F_EVENT_IDX;
        }
        dev.activate(g.ctx(vec![(0, q, kick)], feats, notify, coal))
            .unwrap();
        Blk {
            g,
            vq,
            dev,
            poll: matches!(notify, Notify::Poll { .. }),
        }
    }

    /// A device behind the rate limiter `limits`.
    pub fn limited(
        cfg: BlockConfig,
        notify: Notify,
        limits: std::sync::Arc<lucid_virtio::rate::RateControl>,
    ) -> Blk {
        let g = Guest::new();
        let mut dev = Block::new("blk0".into(), cfg).unwrap();
        dev.set_rate_control(limits);
        let (vq, (q, kick)) = Vq::at(&g.mem, 0x10000, 256, 0);
        let feats = dev.features();
        dev.activate(g.ctx(vec![(0, q, kick)], feats, notify, Coalescing::default()))
            .unwrap();
        Blk {
            g,
            vq,
            dev,
            poll: matches!(notify, Notify::Poll { .. }),
        }
    }

    /// A device with a block cache (SwapBypass's seam) installed before activation.
    pub fn with_cache(
        cfg: BlockConfig,
        cache: std::sync::Arc<dyn lucid_virtio::blk::BlockCache>,
    ) -> Blk {
        Self::build_cached(Guest::new(), 0, cfg, cache)
    }

    /// [`Blk::with_cache`] on guest `g` whose device addresses are guest-physical + `dev_off`.
    pub fn build_cached(
        g: Guest,
        dev_off: u64,
        cfg: BlockConfig,
        cache: std::sync::Arc<dyn lucid_virtio::blk::BlockCache>,
    ) -> Blk {
        let mut dev = Block::new("blk0".into(), cfg).unwrap();
        dev.set_cache(cache);
        let (vq, (q, kick)) = Vq::at(&g.mem, 0x10000, 256, dev_off);
        let feats = dev.features() & !VIRTIO_RING_F_EVENT_IDX;
        dev.activate(g.ctx(
            vec![(0, q, kick)],
            feats,
            Notify::Kicks,
            Coalescing::default(),
        ))
        .unwrap();
        Blk {
            g,
            vq,
            dev,
            poll: false,
        }
    }

    /// Publishes a request: header, then `data` buffers, then a status byte. Returns the head
    /// and the status address.
    pub fn submit(&mut self, rtype: u32, sector: u64, data: &[(u64, u32, bool)]) -> (u16, u64) {
        let hdr = self.g.alloc(16);
        let mut h = [0u8; 16];
        h[0..4].copy_from_slice(&rtype.to_le_bytes());
        h[8..16].copy_from_slice(&sector.to_le_bytes());
        self.g.write(hdr, &h);
        let status = self.g.alloc(1);
        self.g.write(status, &[0xff]);
        let mut bufs = vec![(hdr, 16u32, false)];
        bufs.extend_from_slice(data);
        bufs.push((status, 1, true));
        let head = self.vq.add(&bufs);
        if !self.poll {
            self.vq.kick();
        }
        (head, status)
    }

    /// One request, waited for: (status, used length).
    pub fn req(&mut self, rtype: u32, sector: u64, data: &[(u64, u32, bool)]) -> (u8, u32) {
        let (head, status) = self.submit(rtype, sector, data);
        let (id, len) = self.vq.next_used().expect("request completed");
        assert_eq!(id, u32::from(head));
        (self.g.read(status, 1)[0], len)
    }

    /// Writes `data` at `sector` in one descriptor.
    pub fn write(&mut self, sector: u64, data: &[u8]) -> u8 {
        let a = self.g.alloc(data.len() as u64);
        self.g.write(a, data);
        self.req(VIRTIO_BLK_T_OUT, sector, &[(a, data.len() as u32, false)])
            .0
    }

    /// Reads `len` bytes at `sector` in one descriptor.
    pub fn read(&mut self, sector: u64, len: usize) -> (u8, Vec<u8>) {
        let a = self.g.alloc(len as u64);
        self.g.write(a, &vec![0xa5; len]);
        let (s, _) = self.req(VIRTIO_BLK_T_IN, sector, &[(a, len as u32, true)]);
        (s, self.g.read(a, len))
    }
}
