//! virtio-blk's data hook (the Swap Mapper's seam) and `cache=none` (O_DIRECT), driven by a test
//! acting as the guest: a recording hook sees reads per guest-contiguous run with the right image
//! offsets and guest-physical addresses, hears of every change before the file changes and of
//! flushes after them, and is never called while a vIOMMU translates the device's addresses.

mod common;

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use common::blkdrv::*;
use common::*;
use lucid_mem::vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};
use lucid_virtio::blk::{req::*, BlockConfig, BlockDataHook};
use lucid_virtio::{Coalescing, Notify};

#[derive(Clone, Debug, PartialEq, Eq)]
enum Ev {
    Read {
        off: u64,
        gpa: u64,
        len: u64,
    },
    /// The image bytes at `off..off+len` when the hook was called.
    Before {
        off: u64,
        len: u64,
        then: Vec<u8>,
    },
    After {
        off: u64,
        gpa: u64,
        len: u64,
        then: Vec<u8>,
    },
    Flush,
}

/// Records every call. With `place`, it takes every other read run itself and puts the image
/// bytes there inverted (so the test sees the device did not copy over them).
struct Rec {
    /// Opened separately: the device's descriptor may be O_DIRECT.
    image: PathBuf,
    ev: Mutex<Vec<Ev>>,
    place: Option<GuestMemoryMmap>,
    reads: AtomicUsize,
    fail_reads: bool,
}

impl Rec {
    fn new(img: &Image, place: Option<GuestMemoryMmap>) -> Arc<Rec> {
        Arc::new(Rec {
            image: img.0.clone(),
            ev: Mutex::new(Vec::new()),
            place,
            reads: AtomicUsize::new(0),
            fail_reads: false,
        })
    }
    fn file_bytes(&self, off: u64, len: u64) -> Vec<u8> {
        let mut v = vec![0; len as usize];
        File::open(&self.image)
            .unwrap()
            .read_exact_at(&mut v, off)
            .unwrap();
        v
    }
    fn events(&self) -> Vec<Ev> {
        std::mem::take(&mut *self.ev.lock().unwrap())
    }
}

impl BlockDataHook for Rec {
    fn read(&self, _file: &File, off: u64, gpa: u64, len: u64) -> std::io::Result<bool> {
        self.ev.lock().unwrap().push(Ev::Read { off, gpa, len });
        if self.fail_reads {
            return Err(std::io::Error::other("test hook refuses"));
        }
        let n = self.reads.fetch_add(1, Ordering::SeqCst);
        match &self.place {
            Some(mem) if n.is_multiple_of(2) => {
                let inv: Vec<u8> = self.file_bytes(off, len).iter().map(|b| !b).collect();
                mem.write_slice(&inv, GuestAddress(gpa)).unwrap();
                Ok(true)
            }
            _ => Ok(false),
        }
    }
    fn before_change(&self, _file: &File, off: u64, len: u64) -> std::io::Result<()> {
        let then = self.file_bytes(off, len);
        self.ev.lock().unwrap().push(Ev::Before { off, len, then });
        Ok(())
    }
    fn after_write(&self, _file: &File, off: u64, gpa: u64, len: u64) {
        let then = self.file_bytes(off, len);
        self.ev.lock().unwrap().push(Ev::After {
            off,
            gpa,
            len,
            then,
        });
    }
    fn after_flush(&self, _file: &File) {
        self.ev.lock().unwrap().push(Ev::Flush);
    }
}

fn hooked(img: &Image, cfg: BlockConfig, place: bool) -> (Blk, Arc<Rec>) {
    let g = Guest::new();
    let rec = Rec::new(img, place.then(|| g.mem.clone()));
    let b = Blk::build_hooked(
        g,
        0,
        cfg,
        Notify::Kicks,
        Coalescing::default(),
        true,
        Some(rec.clone()),
    );
    (b, rec)
}

/// An image whose every byte is known: pattern(7).
fn patterned() -> (Image, Vec<u8>) {
    let img = Image::new(IMAGE);
    let data = pattern(7, IMAGE as usize);
    img.write(0, &data);
    (img, data)
}

/// `len` bytes of guest RAM at a 4 KiB boundary.
fn alloc_page_aligned(b: &mut Blk, len: u64) -> u64 {
    let a = b.g.alloc(len + 4096);
    (a + 4095) & !4095
}

#[test]
fn read_is_offered_to_the_hook_with_offset_and_gpa() {
    let (img, data) = patterned();
    let (mut b, rec) = hooked(&img, cfg(&img), false);
    let a = alloc_page_aligned(&mut b, 8192);
    let (s, used) = b.req(VIRTIO_BLK_T_IN, 8, &[(a, 8192, true)]);
    assert_eq!((s, used), (VIRTIO_BLK_S_OK, 8193));
    assert_eq!(
        rec.events(),
        vec![Ev::Read {
            off: 4096,
            gpa: a,
            len: 8192
        }]
    );
    // The hook declined: the device copied.
    assert!(b.g.read(a, 8192) == data[4096..4096 + 8192]);
}

#[test]
fn unaligned_read_is_offered_per_guest_contiguous_run() {
    let (img, data) = patterned();
    let (mut b, rec) = hooked(&img, cfg(&img), false);
    // Two adjacent descriptors (one run) at an odd address, then a separate one.
    let a = b.g.alloc(4096) + 100;
    let c = b.g.alloc(8192) + 36;
    let bufs = [(a, 300, true), (a + 300, 1236, true), (c, 2560, true)];
    let (s, used) = b.req(VIRTIO_BLK_T_IN, 3, &bufs);
    assert_eq!((s, used), (VIRTIO_BLK_S_OK, 4097));
    assert_eq!(
        rec.events(),
        vec![
            Ev::Read {
                off: 1536,
                gpa: a,
                len: 1536
            },
            Ev::Read {
                off: 3072,
                gpa: c,
                len: 2560
            },
        ]
    );
    assert!(b.g.read(a, 1536) == data[1536..3072]);
    assert!(b.g.read(c, 2560) == data[3072..5632]);
}

/// What the hook placed stays (the device does not copy over it); the rest is copied from the
/// right image offsets, for the buffered and the O_DIRECT device and both block sizes.
#[test]
fn placed_runs_are_not_copied_and_the_rest_is() {
    for (direct, lbs) in [(false, 512), (true, 512), (true, 4096), (false, 4096)] {
        let (img, data) = patterned();
        let mut c = cfg(&img);
        c.direct = direct;
        c.logical_block_size = lbs;
        let (mut b, rec) = hooked(&img, c, true);
        // Five separate runs of uneven sizes adding up to 3 blocks of 4096.
        let lens = [1000u32, 3096, 512, 4000, 3680];
        let mut bufs = Vec::new();
        for &l in &lens {
            let a = b.g.alloc(u64::from(l) + 64) + 8;
            bufs.push((a, l, true));
        }
        let total: u32 = lens.iter().sum();
        assert_eq!(total, 3 * 4096);
        let (s, used) = b.req(VIRTIO_BLK_T_IN, 24, &bufs);
        assert_eq!((s, used), (VIRTIO_BLK_S_OK, total + 1), "direct {direct}");
        let ev = rec.events();
        assert_eq!(ev.len(), lens.len());
        let mut off = 24 * 512;
        for (i, &(a, l, _)) in bufs.iter().enumerate() {
            let l = u64::from(l);
            assert_eq!(
                ev[i],
                Ev::Read {
                    off,
                    gpa: a,
                    len: l
                }
            );
            let want = &data[off as usize..(off + l) as usize];
            let got = b.g.read(a, l as usize);
            if i.is_multiple_of(2) {
                let inv: Vec<u8> = want.iter().map(|b| !b).collect();
                assert!(got == inv, "placed run {i} (direct {direct}, bs {lbs})");
            } else {
                assert!(got == want, "copied run {i} (direct {direct}, bs {lbs})");
            }
            off += l;
        }
    }
}

/// Overlapping buffers (a hostile or careless driver): guest memory ends as a plain copy in
/// descriptor order leaves it, the last run's data on top, placed or copied.
#[test]
fn overlapping_buffers_end_as_a_copy_in_order_would_leave_them() {
    let (img, data) = patterned();
    let (mut b, rec) = hooked(&img, cfg(&img), true);
    let other = alloc_page_aligned(&mut b, 4096);
    let a = alloc_page_aligned(&mut b, 4096);
    // Runs: `other` (placed), `a` (copied), `a` again (placed, last).
    let bufs = [(other, 4096, true), (a, 4096, true), (a, 4096, true)];
    let (s, _) = b.req(VIRTIO_BLK_T_IN, 0, &bufs);
    assert_eq!(s, VIRTIO_BLK_S_OK);
    assert_eq!(rec.events().len(), 3);
    let inv: Vec<u8> = data[8192..12288].iter().map(|b| !b).collect();
    assert!(b.g.read(a, 4096) == inv, "the last run wins");
}

#[test]
fn hook_read_error_fails_the_request() {
    let (img, _) = patterned();
    let g = Guest::new();
    let rec = Arc::new(Rec {
        image: img.0.clone(),
        ev: Mutex::new(Vec::new()),
        place: None,
        reads: AtomicUsize::new(0),
        fail_reads: true,
    });
    let mut b = Blk::build_hooked(
        g,
        0,
        cfg(&img),
        Notify::Kicks,
        Coalescing::default(),
        true,
        Some(rec.clone()),
    );
    assert_eq!(b.read(0, 4096).0, VIRTIO_BLK_S_IOERR);
    assert_eq!(b.g.stat("blk0.errors"), 1);
}

#[test]
fn buffers_outside_ram_are_not_offered() {
    let (img, _) = patterned();
    let (mut b, rec) = hooked(&img, cfg(&img), false);
    let (s, _) = b.req(VIRTIO_BLK_T_IN, 0, &[(RAM - 2048, 4096, true)]);
    assert_eq!(s, VIRTIO_BLK_S_IOERR);
    assert!(rec.events().is_empty());
}

#[test]
fn write_is_announced_before_the_file_changes() {
    let (img, data) = patterned();
    let (mut b, rec) = hooked(&img, cfg(&img), false);
    let new = pattern(99, 8192);
    let d1 = b.g.alloc(5000) + 4;
    let d2 = b.g.alloc(4000);
    b.g.write(d1, &new[..4192]);
    b.g.write(d2, &new[4192..]);
    let (s, _) = b.req(
        VIRTIO_BLK_T_OUT,
        16,
        &[(d1, 4192, false), (d2, 4000, false)],
    );
    assert_eq!(s, VIRTIO_BLK_S_OK);
    assert_eq!(
        rec.events(),
        vec![
            Ev::Before {
                off: 8192,
                len: 8192,
                then: data[8192..16384].to_vec()
            },
            Ev::After {
                off: 8192,
                gpa: d1,
                len: 4192,
                then: new[..4192].to_vec()
            },
            Ev::After {
                off: 8192 + 4192,
                gpa: d2,
                len: 4000,
                then: new[4192..].to_vec()
            },
        ]
    );
    assert!(img.read(8192, 8192) == new);
}

#[test]
fn write_zeroes_and_discard_are_announced_per_segment_before_the_change() {
    let (img, data) = patterned();
    let (mut b, rec) = hooked(&img, cfg(&img), false);
    for rtype in [VIRTIO_BLK_T_WRITE_ZEROES, VIRTIO_BLK_T_DISCARD] {
        let base = if rtype == VIRTIO_BLK_T_DISCARD {
            1024
        } else {
            0
        };
        let mut segs = Vec::new();
        for (sector, num) in [(base + 64u64, 8u32), (base + 200, 16)] {
            segs.extend_from_slice(&sector.to_le_bytes());
            segs.extend_from_slice(&num.to_le_bytes());
            segs.extend_from_slice(&0u32.to_le_bytes());
        }
        let a = b.g.alloc(segs.len() as u64);
        b.g.write(a, &segs);
        let (s, _) = b.req(rtype, 0, &[(a, segs.len() as u32, false)]);
        assert_eq!(s, VIRTIO_BLK_S_OK, "type {rtype}");
        let expect: Vec<Ev> = [(base + 64, 8u64), (base + 200, 16)]
            .iter()
            .map(|&(sector, num)| {
                let (off, len) = (sector * 512, num * 512);
                Ev::Before {
                    off,
                    len,
                    then: data[off as usize..(off + len) as usize].to_vec(),
                }
            })
            .collect();
        assert_eq!(rec.events(), expect, "type {rtype}");
        assert!(img.read((base + 200) * 512, 8192) == vec![0; 8192]);
    }
}

#[test]
fn flush_is_reported_after_it_completes() {
    let (img, _) = patterned();
    let (mut b, rec) = hooked(&img, cfg(&img), false);
    assert_eq!(b.req(VIRTIO_BLK_T_FLUSH, 0, &[]).0, VIRTIO_BLK_S_OK);
    assert_eq!(rec.events(), vec![Ev::Flush]);
}

/// With a translator, addresses are IOVAs: the hook is never consulted, data still moves.
#[test]
fn no_hook_calls_behind_a_viommu() {
    const OFF: u64 = 32 << 20;
    let (img, data) = patterned();
    let g = Guest::new();
    let _iommu = g.behind_iommu(OFF);
    let rec = Rec::new(&img, Some(g.mem.clone()));
    let mut b = Blk::build_hooked(
        g,
        OFF,
        cfg(&img),
        Notify::Kicks,
        Coalescing::default(),
        true,
        Some(rec.clone()),
    );
    let a = b.g.alloc(8192);
    let (s, _) = b.req(VIRTIO_BLK_T_IN, 8, &[(a, 8192, true)]);
    assert_eq!(s, VIRTIO_BLK_S_OK);
    assert!(b.g.read(a, 8192) == data[4096..4096 + 8192]);
    let new = pattern(3, 4096);
    b.g.write(a, &new);
    let (s, _) = b.req(VIRTIO_BLK_T_OUT, 40, &[(a, 4096, false)]);
    assert_eq!(s, VIRTIO_BLK_S_OK);
    assert!(img.read(40 * 512, 4096) == new);
    assert_eq!(b.req(VIRTIO_BLK_T_FLUSH, 0, &[]).0, VIRTIO_BLK_S_OK);
    let mut seg = Vec::new();
    seg.extend_from_slice(&80u64.to_le_bytes());
    seg.extend_from_slice(&8u32.to_le_bytes());
    seg.extend_from_slice(&0u32.to_le_bytes());
    b.g.write(a, &seg);
    assert_eq!(
        b.req(VIRTIO_BLK_T_DISCARD, 0, &[(a, 16, false)]).0,
        VIRTIO_BLK_S_OK
    );
    assert!(rec.events().is_empty());
}

/// Whether some descriptor of this process open on `path` has O_DIRECT.
fn open_direct(path: &std::path::Path) -> Option<bool> {
    for e in std::fs::read_dir("/proc/self/fd").ok()?.flatten() {
        if std::fs::read_link(e.path()).ok().as_deref() == Some(path) {
            let info =
                std::fs::read_to_string(format!("/proc/self/fdinfo/{}", e.file_name().to_str()?))
                    .ok()?;
            let flags = info.lines().find_map(|l| l.strip_prefix("flags:"))?.trim();
            let flags = u32::from_str_radix(flags, 8).ok()?;
            return Some(flags & libc::O_DIRECT as u32 != 0);
        }
    }
    None
}

/// cache=none: the image is open O_DIRECT, and writes and reads of every shape (split over
/// uneven descriptors, larger than the bounce buffer, zeroed, discarded) read back right.
#[test]
fn cache_none_reads_and_writes_are_correct() {
    for lbs in [512u32, 4096] {
        let img = Image::new(IMAGE);
        let mut c = cfg(&img);
        c.direct = true;
        c.logical_block_size = lbs;
        let mut b = Blk::new(c);
        let path = std::fs::canonicalize(&img.0).unwrap();
        assert_eq!(open_direct(&path), Some(true), "bs {lbs}");
        let mut expect = vec![0u8; IMAGE as usize];
        // (sector, length): small, odd-split, and 2 MiB + 4 KiB (crosses the 1 MiB bounce).
        for (i, (sector, len)) in [(8u64, 4096usize), (64, 12288), (4096, (2 << 20) + 4096)]
            .into_iter()
            .enumerate()
        {
            let data = pattern(i as u64 + 11, len);
            let a = b.g.alloc(len as u64 + 16) + 3;
            b.g.write(a, &data);
            // Uneven descriptors: 700, 1, rest.
            let bufs = [
                (a, 700, false),
                (a + 700, 1, false),
                (a + 701, len as u32 - 701, false),
            ];
            assert_eq!(b.req(VIRTIO_BLK_T_OUT, sector, &bufs).0, VIRTIO_BLK_S_OK);
            expect[sector as usize * 512..sector as usize * 512 + len].copy_from_slice(&data);
        }
        // Write zeroes over part of the big write.
        let mut seg = Vec::new();
        seg.extend_from_slice(&4104u64.to_le_bytes());
        seg.extend_from_slice(&16u32.to_le_bytes());
        seg.extend_from_slice(&0u32.to_le_bytes());
        let s = b.g.alloc(16);
        b.g.write(s, &seg);
        assert_eq!(
            b.req(VIRTIO_BLK_T_WRITE_ZEROES, 0, &[(s, 16, false)]).0,
            VIRTIO_BLK_S_OK
        );
        expect[4104 * 512..4120 * 512].fill(0);
        assert_eq!(b.req(VIRTIO_BLK_T_FLUSH, 0, &[]).0, VIRTIO_BLK_S_OK);
        // Read everything back through uneven descriptors.
        let len = 4 << 20;
        let a = b.g.alloc(len as u64 + 16) + 5;
        let bufs = [
            (a, 4095, true),
            (a + 4095, 3, true),
            (a + 4098, len as u32 - 4098, true),
        ];
        assert_eq!(b.req(VIRTIO_BLK_T_IN, 0, &bufs).0, VIRTIO_BLK_S_OK);
        assert!(b.g.read(a, len) == expect[..len], "bs {lbs}: read back");
        assert!(img.read(0, IMAGE as usize) == expect, "bs {lbs}: image");
        assert_eq!(b.g.stat("blk0.errors"), 0);
    }
}
