//! virtio-blk's block-cache seam (SwapBypass's swap cache), driven by a test acting as the
//! guest: writes land in the cache and not in the file, reads come from the cache (or the file
//! through it), discards and write-zeroes reach the cache before the file changes, a flush
//! reaches it before the sync, and large requests arrive in aligned pieces of at most 1 MiB.

mod common;

use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::{Arc, Mutex};

use common::blkdrv::*;
use common::Guest;
use lucid_virtio::blk::{req::*, BlockCache};

/// Keeps every written 4 KiB block in memory; records the calls.
#[derive(Default)]
struct MemCache {
    blocks: Mutex<HashMap<u64, Vec<u8>>>,
    calls: Mutex<Vec<String>>,
}

impl BlockCache for MemCache {
    fn read(&self, file: &File, off: u64, buf: &mut [u8]) -> std::io::Result<()> {
        assert_eq!(buf.as_ptr() as usize % 4096, 0, "bounce buffer aligned");
        assert!(buf.len() <= 1 << 20);
        self.calls
            .lock()
            .unwrap()
            .push(format!("read {off} {}", buf.len()));
        let blocks = self.blocks.lock().unwrap();
        for (i, c) in buf.chunks_mut(4096).enumerate() {
            let o = off + i as u64 * 4096;
            match blocks.get(&o) {
                Some(b) => c.copy_from_slice(b),
                None => file.read_exact_at(c, o)?,
            }
        }
        Ok(())
    }
    fn write(&self, _file: &File, off: u64, data: &[u8]) -> std::io::Result<()> {
        self.calls
            .lock()
            .unwrap()
            .push(format!("write {off} {}", data.len()));
        let mut blocks = self.blocks.lock().unwrap();
        for (i, c) in data.chunks(4096).enumerate() {
            blocks.insert(off + i as u64 * 4096, c.to_vec());
        }
        Ok(())
    }
    fn discard(&self, _file: &File, off: u64, len: u64) {
        self.calls
            .lock()
            .unwrap()
            .push(format!("discard {off} {len}"));
        self.blocks
            .lock()
            .unwrap()
            .retain(|o, _| !(off..off + len).contains(o));
    }
    fn flush(&self, file: &File) -> std::io::Result<()> {
        self.calls.lock().unwrap().push("flush".into());
        for (o, b) in self.blocks.lock().unwrap().iter() {
            file.write_all_at(b, *o)?;
        }
        Ok(())
    }
}

fn cached() -> (Image, Blk, Arc<MemCache>) {
    let img = Image::new(IMAGE);
    let mut c = cfg(&img);
    c.logical_block_size = 4096;
    let cache = Arc::new(MemCache::default());
    let b = Blk::with_cache(c, cache.clone());
    (img, b, cache)
}

#[test]
fn writes_land_in_the_cache_until_a_flush() {
    let (img, mut b, cache) = cached();
    let data: Vec<u8> = (0..8192u32).map(|i| (i % 251) as u8).collect();
    assert_eq!(b.write(8, &data), VIRTIO_BLK_S_OK);
    assert!(
        img.read(4096, 8192).iter().all(|&x| x == 0),
        "file untouched"
    );
    let (s, back) = b.read(8, 8192);
    assert_eq!(s, VIRTIO_BLK_S_OK);
    assert!(back == data, "read back what was written");
    assert_eq!(b.req(VIRTIO_BLK_T_FLUSH, 0, &[]).0, VIRTIO_BLK_S_OK);
    assert!(img.read(4096, 8192) == data, "flushed to the file");
    let calls = cache.calls.lock().unwrap().clone();
    assert_eq!(calls, ["write 4096 8192", "read 4096 8192", "flush"]);
}

#[test]
fn reads_of_uncached_blocks_come_from_the_file() {
    let (img, mut b, _cache) = cached();
    img.write(3 * 4096, &[7; 4096]);
    let (st, back) = b.read(24, 4096);
    assert_eq!(st, VIRTIO_BLK_S_OK);
    assert!(back.iter().all(|&x| x == 7));
}

#[test]
fn discard_and_write_zeroes_reach_the_cache() {
    let (img, mut b, cache) = cached();
    assert_eq!(b.write(0, &[9; 4096 * 4]), VIRTIO_BLK_S_OK);
    for (rtype, sector) in [(VIRTIO_BLK_T_DISCARD, 0u64), (VIRTIO_BLK_T_WRITE_ZEROES, 8)] {
        let seg = b.g.alloc(16);
        let mut s = [0u8; 16];
        s[0..8].copy_from_slice(&sector.to_le_bytes());
        s[8..12].copy_from_slice(&8u32.to_le_bytes());
        b.g.write(seg, &s);
        assert_eq!(b.req(rtype, 0, &[(seg, 16, false)]).0, VIRTIO_BLK_S_OK);
    }
    let (st, back) = b.read(0, 4096 * 4);
    assert_eq!(st, VIRTIO_BLK_S_OK);
    assert!(
        back[..8192].iter().all(|&x| x == 0),
        "discarded blocks read as zeros"
    );
    assert!(
        back[8192..].iter().all(|&x| x == 9),
        "the others keep their data"
    );
    let calls = cache.calls.lock().unwrap().clone();
    assert!(calls.contains(&"discard 0 4096".to_string()), "{calls:?}");
    assert!(
        calls.contains(&"discard 4096 4096".to_string()),
        "{calls:?}"
    );
    drop(img);
}

#[test]
fn large_requests_arrive_in_pieces() {
    let (_img, mut b, cache) = cached();
    let len = 3 << 20;
    assert_eq!(b.write(0, &vec![1; len]), VIRTIO_BLK_S_OK);
    let calls = cache.calls.lock().unwrap().clone();
    assert_eq!(
        calls,
        [
            "write 0 1048576",
            "write 1048576 1048576",
            "write 2097152 1048576"
        ]
    );
}

#[test]
fn behind_a_viommu_the_data_goes_through_the_translator() {
    const OFF: u64 = 32 << 20;
    let img = Image::new(IMAGE);
    let mut c = cfg(&img);
    c.logical_block_size = 4096;
    let cache = Arc::new(MemCache::default());
    let g = Guest::new();
    let iommu = g.behind_iommu(OFF);
    let mut b = Blk::build_cached(g, OFF, c, cache.clone());
    let data: Vec<u8> = (0..4096u32).map(|i| (i % 253) as u8).collect();
    assert_eq!(b.write(16, &data), VIRTIO_BLK_S_OK);
    assert!(
        cache.blocks.lock().unwrap()[&(16 * 512)] == data,
        "the cache got the guest's data"
    );
    let (st, back) = b.read(16, 4096);
    assert_eq!(st, VIRTIO_BLK_S_OK);
    assert!(back == data);
    assert!(iommu.translations.load(std::sync::atomic::Ordering::SeqCst) > 0);
}
