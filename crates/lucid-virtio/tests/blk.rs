//! virtio-blk driven by a test acting as the guest: real guest RAM, DMA path, eventfds, image.

mod common;

use common::blkdrv::*;
use common::*;
use lucid_virtio::blk::{feature::*, req::*, Block, BlockConfig, BlockError};
use lucid_virtio::features::*;
use lucid_virtio::{Coalescing, Notify, VirtioDevice};

fn segment(sector: u64, num: u32, flags: u32) -> [u8; 16] {
    let mut s = [0u8; 16];
    s[0..8].copy_from_slice(&sector.to_le_bytes());
    s[8..12].copy_from_slice(&num.to_le_bytes());
    s[12..16].copy_from_slice(&flags.to_le_bytes());
    s
}

#[test]
fn write_pattern_read_back_checksums() {
    let img = Image::new(IMAGE);
    let mut b = Blk::new(cfg(&img));
    // Scattered writes of several sizes, some split over several descriptors.
    let mut expect = Vec::new();
    for (i, (sector, len)) in [(0u64, 4096usize), (8, 65536), (1000, 512), (16_000, 131072)]
        .into_iter()
        .enumerate()
    {
        let data = pattern(i as u64, len);
        let a = b.g.alloc(len as u64);
        b.g.write(a, &data);
        let half = (len / 2) as u32;
        let bufs = if len >= 8192 {
            vec![(a, half, false), (a + u64::from(half), half, false)]
        } else {
            vec![(a, len as u32, false)]
        };
        let (s, used) = b.req(VIRTIO_BLK_T_OUT, sector, &bufs);
        assert_eq!((s, used), (VIRTIO_BLK_S_OK, 1));
        expect.push((sector, data));
    }
    for (sector, data) in &expect {
        // Read back in three descriptors of uneven sizes.
        let len = data.len();
        let a = b.g.alloc(len as u64);
        let (p1, p2) = (512u32.min(len as u32), (len as u32).saturating_sub(512) / 2);
        let p3 = len as u32 - p1 - p2;
        let mut bufs = vec![(a, p1, true)];
        if p2 > 0 {
            bufs.push((a + u64::from(p1), p2, true));
        }
        if p3 > 0 {
            bufs.push((a + u64::from(p1 + p2), p3, true));
        }
        let (s, used) = b.req(VIRTIO_BLK_T_IN, *sector, &bufs);
        assert_eq!(s, VIRTIO_BLK_S_OK);
        assert_eq!(used as usize, len + 1);
        let got = b.g.read(a, len);
        assert_eq!(checksum(&got), checksum(data), "sector {sector}");
        assert_eq!(&got, data);
        assert_eq!(checksum(&img.read(sector * 512, len)), checksum(data));
    }
    let st = |n: &str| b.g.stat(&format!("blk0.{n}"));
    // Counted just after the used entry the driver saw.
    assert!(wait_for(|| st("requests") == 8), "{}", st("requests"));
    assert_eq!(st("bytes_read"), 4096 + 65536 + 512 + 131072);
    assert_eq!(st("bytes_written"), 4096 + 65536 + 512 + 131072);
    assert_eq!(st("errors"), 0);
    assert!(st("kicks") >= 1);
    // Every request asked for an interrupt (EVENT_IDX with used_event 0 only on the first).
    // Each completion gets its interrupt decision (just after it is published).
    assert!(wait_for(|| st("irqs")
        + st("irqs_coalesced")
        + st("irqs_suppressed")
        == 8));
    b.dev.reset();
}

#[test]
fn flush_puts_data_in_the_file() {
    let img = Image::new(IMAGE);
    let mut b = Blk::new(cfg(&img));
    let data = pattern(7, 8192);
    assert_eq!(b.write(24, &data), VIRTIO_BLK_S_OK);
    let (s, used) = b.req(VIRTIO_BLK_T_FLUSH, 0, &[]);
    assert_eq!((s, used), (VIRTIO_BLK_S_OK, 1));
    assert_eq!(img.read(24 * 512, 8192), data);
    b.dev.reset();
}

/// Child half of `flush_survives_kill_9`: writes, flushes, says so, then waits to be killed.
#[test]
#[ignore = "run by flush_survives_kill_9 in a child process"]
fn flush_child() {
    let Ok(path) = std::env::var("LUCID_FLUSH_CHILD_IMAGE") else {
        return;
    };
    let mut b = Blk::new(BlockConfig {
        path: path.into(),
        read_only: false,
        logical_block_size: 512,
        id: String::new(),
        direct: false,
    });
    assert_eq!(b.write(40, &pattern(40, 16384)), VIRTIO_BLK_S_OK);
    assert_eq!(b.req(VIRTIO_BLK_T_FLUSH, 0, &[]).0, VIRTIO_BLK_S_OK);
    println!("FLUSHED");
    use std::io::Write;
    std::io::stdout().flush().unwrap();
    std::thread::sleep(std::time::Duration::from_secs(60));
}

#[test]
fn flush_survives_kill_9() {
    use std::io::BufRead;
    let img = Image::new(IMAGE);
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "flush_child", "--ignored", "--nocapture"])
        .env("LUCID_FLUSH_CHILD_IMAGE", &img.0)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let out = child.stdout.take().unwrap();
    let mut flushed = false;
    for line in std::io::BufReader::new(out).lines() {
        if line.unwrap().contains("FLUSHED") {
            flushed = true;
            break;
        }
    }
    // SAFETY: kill(2) on our own child's pid.
    unsafe { libc::kill(child.id() as i32, libc::SIGKILL) };
    let status = child.wait().unwrap();
    assert!(flushed, "child did not flush: {status:?}");
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(status.signal(), Some(libc::SIGKILL));
    assert_eq!(img.read(40 * 512, 16384), pattern(40, 16384));
}

#[test]
fn discard_and_write_zeroes_read_back_zeros() {
    let img = Image::new(IMAGE);
    let mut b = Blk::new(cfg(&img));
    let data = pattern(3, 64 * 1024);
    assert_eq!(b.write(0, &data), VIRTIO_BLK_S_OK);
    // Discard sectors 8..16, write-zeroes 32..40 (keep allocation) and 64..72 (unmap).
    let segs: Vec<u8> = segment(8, 8, 0).to_vec();
    let a = b.g.alloc(16);
    b.g.write(a, &segs);
    assert_eq!(b.req(VIRTIO_BLK_T_DISCARD, 0, &[(a, 16, false)]).0, 0);
    let a = b.g.alloc(32);
    let mut two = segment(32, 8, 0).to_vec();
    two.extend_from_slice(&segment(64, 8, VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP));
    b.g.write(a, &two);
    assert_eq!(b.req(VIRTIO_BLK_T_WRITE_ZEROES, 0, &[(a, 32, false)]).0, 0);
    let (s, got) = b.read(0, 64 * 1024);
    assert_eq!(s, VIRTIO_BLK_S_OK);
    let mut expect = data.clone();
    for r in [8usize..16, 32..40, 64..72] {
        expect[r.start * 512..r.end * 512].fill(0);
    }
    assert_eq!(got, expect);
    assert_eq!(img.read(0, 64 * 1024), expect);
    // The unmap flag on a discard is reserved: UNSUPP. A segment past the end: IOERR.
    let a = b.g.alloc(16);
    b.g.write(a, &segment(0, 8, VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP));
    assert_eq!(
        b.req(VIRTIO_BLK_T_DISCARD, 0, &[(a, 16, false)]).0,
        VIRTIO_BLK_S_UNSUPP
    );
    let a = b.g.alloc(16);
    b.g.write(a, &segment(IMAGE / 512 - 4, 8, 0));
    assert_eq!(
        b.req(VIRTIO_BLK_T_WRITE_ZEROES, 0, &[(a, 16, false)]).0,
        VIRTIO_BLK_S_IOERR
    );
    // Segment list not a multiple of 16 bytes: IOERR.
    assert_eq!(
        b.req(VIRTIO_BLK_T_DISCARD, 0, &[(a, 12, false)]).0,
        VIRTIO_BLK_S_IOERR
    );
    b.dev.reset();
}

#[test]
fn get_id_and_config_space() {
    let img = Image::new(IMAGE + 300); // a partial last sector is not offered
    let mut b = Blk::new(cfg(&img));
    let a = b.g.alloc(20);
    let (s, used) = b.req(VIRTIO_BLK_T_GET_ID, 0, &[(a, 20, true)]);
    assert_eq!((s, used), (VIRTIO_BLK_S_OK, 21));
    let mut want = b"lucid-test-disk".to_vec();
    want.resize(20, 0);
    assert_eq!(b.g.read(a, 20), want);
    // Unknown request type: UNSUPP.
    assert_eq!(b.req(99, 0, &[]).0, VIRTIO_BLK_S_UNSUPP);

    let mut c = [0u8; 60];
    b.dev.read_config(0, &mut c);
    assert_eq!(u64::from_le_bytes(c[0..8].try_into().unwrap()), IMAGE / 512);
    assert_eq!(u32::from_le_bytes(c[20..24].try_into().unwrap()), 512);
    assert!(u32::from_le_bytes(c[12..16].try_into().unwrap()) >= 1); // seg_max
    assert!(u32::from_le_bytes(c[36..40].try_into().unwrap()) >= 8); // max_discard_sectors
    assert_eq!(c[56], 1); // write_zeroes_may_unmap
    let mut past = [0xffu8; 8];
    b.dev.read_config(1000, &mut past);
    assert_eq!(past, [0; 8]);
    let f = b.dev.features();
    for bit in [
        VIRTIO_F_VERSION_1,
        VIRTIO_F_ACCESS_PLATFORM,
        VIRTIO_RING_F_EVENT_IDX,
        VIRTIO_BLK_F_FLUSH,
        VIRTIO_BLK_F_DISCARD,
        VIRTIO_BLK_F_WRITE_ZEROES,
        VIRTIO_BLK_F_BLK_SIZE,
        VIRTIO_BLK_F_SEG_MAX,
        VIRTIO_BLK_F_SIZE_MAX,
    ] {
        assert_ne!(f & bit, 0, "feature {bit:#x}");
    }
    assert_eq!(f & VIRTIO_BLK_F_RO, 0);
    assert_eq!(b.dev.queue_max_sizes(), &[256]);
    b.dev.reset();
}

#[test]
fn read_only_refuses_writes() {
    let img = Image::new(IMAGE);
    img.write(0, &pattern(9, 4096));
    let mut c = cfg(&img);
    c.read_only = true;
    let mut b = Blk::new(c);
    assert_ne!(b.dev.features() & VIRTIO_BLK_F_RO, 0);
    assert_eq!(b.dev.features() & VIRTIO_BLK_F_DISCARD, 0);
    assert_eq!(b.write(0, &[0u8; 4096]), VIRTIO_BLK_S_IOERR);
    let a = b.g.alloc(16);
    b.g.write(a, &segment(0, 8, 0));
    assert_eq!(
        b.req(VIRTIO_BLK_T_WRITE_ZEROES, 0, &[(a, 16, false)]).0,
        VIRTIO_BLK_S_IOERR
    );
    assert_eq!(b.req(VIRTIO_BLK_T_FLUSH, 0, &[]).0, VIRTIO_BLK_S_OK);
    let (s, got) = b.read(0, 4096);
    assert_eq!(s, VIRTIO_BLK_S_OK);
    assert_eq!(got, pattern(9, 4096));
    assert_eq!(img.read(0, 4096), pattern(9, 4096));
    assert_eq!(b.g.stat("blk0.errors"), 2);
    b.dev.reset();
}

#[test]
fn out_of_range_and_misaligned_requests_fail_with_ioerr() {
    let img = Image::new(IMAGE);
    let mut b = Blk::new(cfg(&img));
    let cap = IMAGE / 512;
    assert_eq!(b.read(cap - 1, 512).0, VIRTIO_BLK_S_OK);
    assert_eq!(b.read(cap, 512).0, VIRTIO_BLK_S_IOERR);
    assert_eq!(b.read(cap - 1, 1024).0, VIRTIO_BLK_S_IOERR);
    assert_eq!(b.read(u64::MAX / 256, 512).0, VIRTIO_BLK_S_IOERR);
    assert_eq!(b.write(cap, &[1u8; 512]), VIRTIO_BLK_S_IOERR);
    // Not a multiple of 512 bytes.
    assert_eq!(b.read(0, 100).0, VIRTIO_BLK_S_IOERR);
    b.dev.reset();

    // 4 KiB logical blocks: sector and length must be 4 KiB aligned.
    let mut c = cfg(&img);
    c.logical_block_size = 4096;
    let mut b = Blk::new(c);
    let mut cs = [0u8; 4];
    b.dev.read_config(20, &mut cs);
    assert_eq!(u32::from_le_bytes(cs), 4096);
    assert_eq!(b.write(8, &pattern(1, 8192)), VIRTIO_BLK_S_OK);
    assert_eq!(b.read(8, 8192), (VIRTIO_BLK_S_OK, pattern(1, 8192)));
    assert_eq!(b.read(1, 4096).0, VIRTIO_BLK_S_IOERR);
    assert_eq!(b.read(8, 512).0, VIRTIO_BLK_S_IOERR);
    assert_eq!(b.write(4, &[0u8; 4096]), VIRTIO_BLK_S_IOERR);
    assert_eq!(b.read(8, 8192).1, pattern(1, 8192));
    b.dev.reset();
}

#[test]
fn dma_outside_guest_memory_is_ioerr_not_a_panic() {
    let img = Image::new(IMAGE);
    let mut b = Blk::new(cfg(&img));
    let outside = RAM + 0x1000;
    let (s, _) = b.req(VIRTIO_BLK_T_IN, 0, &[(outside, 4096, true)]);
    assert_eq!(s, VIRTIO_BLK_S_IOERR);
    let (s, _) = b.req(VIRTIO_BLK_T_OUT, 0, &[(1 << 45, 4096, false)]);
    assert_eq!(s, VIRTIO_BLK_S_IOERR);
    // Straddling the end of RAM.
    let (s, _) = b.req(VIRTIO_BLK_T_IN, 0, &[(RAM - 512, 1024, true)]);
    assert_eq!(s, VIRTIO_BLK_S_IOERR);
    // Wrapping around the address space.
    let (s, _) = b.req(VIRTIO_BLK_T_OUT, 0, &[(u64::MAX - 100, 512, false)]);
    assert_eq!(s, VIRTIO_BLK_S_IOERR);
    assert!(b.g.stat("dma.errors") >= 4);
    assert!(!b.dev.needs_reset());
    // The device still works.
    assert_eq!(b.write(0, &pattern(5, 512)), VIRTIO_BLK_S_OK);
    assert_eq!(b.read(0, 512), (VIRTIO_BLK_S_OK, pattern(5, 512)));
    b.dev.reset();
}

#[test]
fn wrong_direction_and_zero_length_descriptors_fail_with_ioerr() {
    let img = Image::new(IMAGE);
    img.write(0, &pattern(2, 4096));
    let mut b = Blk::new(cfg(&img));
    // A read whose data descriptor is read-only (device would write into it).
    let a = b.g.alloc(4096);
    b.g.write(a, &[0x5a; 4096]);
    let (s, _) = b.req(VIRTIO_BLK_T_IN, 0, &[(a, 4096, false)]);
    assert_eq!(s, VIRTIO_BLK_S_IOERR);
    assert_eq!(
        b.g.read(a, 4096),
        vec![0x5a; 4096],
        "device wrote a read-only buffer"
    );
    // A write whose data descriptor is device-writable.
    let (s, _) = b.req(VIRTIO_BLK_T_OUT, 0, &[(a, 4096, true)]);
    assert_eq!(s, VIRTIO_BLK_S_IOERR);
    assert_eq!(img.read(0, 4096), pattern(2, 4096));
    // Zero-length data.
    assert_eq!(
        b.req(VIRTIO_BLK_T_IN, 0, &[(a, 0, true)]).0,
        VIRTIO_BLK_S_IOERR
    );
    assert_eq!(
        b.req(VIRTIO_BLK_T_OUT, 0, &[(a, 0, false)]).0,
        VIRTIO_BLK_S_IOERR
    );
    assert_eq!(b.req(VIRTIO_BLK_T_IN, 0, &[]).0, VIRTIO_BLK_S_IOERR);
    // A header shorter than 16 bytes.
    let hdr = b.g.alloc(16);
    let st = b.g.alloc(1);
    b.vq.add(&[(hdr, 8, false), (st, 1, true)]);
    b.vq.kick();
    b.vq.next_used().unwrap();
    assert_eq!(b.g.read(st, 1)[0], VIRTIO_BLK_S_IOERR);
    // A readable descriptor after a writable one.
    let (s, _) = b.req(VIRTIO_BLK_T_IN, 0, &[(a, 512, true), (a, 512, false)]);
    assert_eq!(s, VIRTIO_BLK_S_IOERR);
    assert!(!b.dev.needs_reset());
    assert_eq!(b.read(0, 4096), (VIRTIO_BLK_S_OK, pattern(2, 4096)));
    b.dev.reset();
}

/// Publishes a chain made of raw descriptors and kicks.
fn publish_raw(b: &mut Blk, descs: &[(u16, u64, u32, u16, u16)], head: u16) {
    for &(i, addr, len, flags, next) in descs {
        b.vq.write_desc(i, addr, len, flags, next);
    }
    b.vq.publish(head);
    b.vq.kick();
}

fn assert_needs_reset(b: &Blk) {
    assert!(
        wait_for(|| b.dev.needs_reset()),
        "device did not ask for reset"
    );
    assert!(b.g.irq.config() >= 1, "no configuration interrupt");
}

/// After a needs-reset, a reset and a fresh activation bring the device back.
fn reset_and_check(b: &mut Blk, img: &Image) {
    b.dev.reset();
    assert!(!b.dev.needs_reset());
    let (vq, (q, kick)) = Vq::new(&b.g.mem, 0x20000, 64);
    b.vq = vq;
    b.dev
        .activate(b.g.ctx(
            vec![(0, q, kick)],
            VIRTIO_F_VERSION_1,
            Notify::Kicks,
            Coalescing::default(),
        ))
        .unwrap();
    assert_eq!(b.write(0, &pattern(11, 1024)), VIRTIO_BLK_S_OK);
    assert_eq!(b.read(0, 1024), (VIRTIO_BLK_S_OK, pattern(11, 1024)));
    assert_eq!(img.read(0, 1024), pattern(11, 1024));
    b.dev.reset();
}

#[test]
fn looping_chain_needs_reset() {
    let img = Image::new(IMAGE);
    let mut b = Blk::new(cfg(&img));
    let hdr = b.g.alloc(16);
    let data = b.g.alloc(512);
    // 0 -> 1 -> 2 -> 1 -> ...
    publish_raw(
        &mut b,
        &[
            (0, hdr, 16, F_NEXT, 1),
            (1, data, 512, F_NEXT | F_WRITE, 2),
            (2, data, 512, F_NEXT | F_WRITE, 1),
        ],
        0,
    );
    assert_needs_reset(&b);
    assert_eq!(b.vq.used_idx(), 0);
    reset_and_check(&mut b, &img);
}

#[test]
fn chain_with_next_outside_the_table_needs_reset() {
    let img = Image::new(IMAGE);
    let mut b = Blk::new(cfg(&img));
    let hdr = b.g.alloc(16);
    publish_raw(&mut b, &[(0, hdr, 16, F_NEXT, 999)], 0);
    assert_needs_reset(&b);
    reset_and_check(&mut b, &img);
}

#[test]
fn head_index_outside_the_table_needs_reset() {
    let img = Image::new(IMAGE);
    let mut b = Blk::new(cfg(&img));
    publish_raw(&mut b, &[], 4000);
    assert_needs_reset(&b);
    reset_and_check(&mut b, &img);
}

#[test]
fn missing_or_empty_status_needs_reset() {
    let img = Image::new(IMAGE);
    let mut b = Blk::new(cfg(&img));
    // Only a header: nowhere to put the status.
    let hdr = b.g.alloc(16);
    b.vq.add(&[(hdr, 16, false)]);
    b.vq.kick();
    assert_needs_reset(&b);
    reset_and_check(&mut b, &img);

    let mut b = Blk::new(cfg(&img));
    let st = b.g.alloc(1);
    b.vq.add(&[(hdr, 16, false), (st, 0, true)]);
    b.vq.kick();
    assert_needs_reset(&b);
    reset_and_check(&mut b, &img);

    // A status byte outside guest memory.
    let mut b = Blk::new(cfg(&img));
    b.vq.add(&[(hdr, 16, false), (RAM + 5, 1, true)]);
    b.vq.kick();
    assert_needs_reset(&b);
    reset_and_check(&mut b, &img);
}

#[test]
fn avail_index_jumping_past_the_queue_needs_reset() {
    let img = Image::new(IMAGE);
    let mut b = Blk::new(cfg(&img));
    b.vq.set_avail_idx(1000);
    b.vq.kick();
    assert_needs_reset(&b);
    reset_and_check(&mut b, &img);
}

#[test]
fn descriptor_table_outside_memory_is_refused_at_activation() {
    let img = Image::new(IMAGE);
    let g = Guest::new();
    let mut dev = Block::new("blk0".into(), cfg(&img)).unwrap();
    let (_vq, (mut q, kick)) = Vq::new(&g.mem, 0x10000, 256);
    use lucid_virtio::virtio_queue::QueueT;
    q.set_desc_table_address(Some(0xffff_0000), Some(0x10));
    let e = dev
        .activate(g.ctx(vec![(0, q, kick)], 0, Notify::Kicks, Coalescing::default()))
        .unwrap_err();
    assert!(e.to_string().contains("outside guest memory"), "{e}");
    let e = dev
        .activate(g.ctx(vec![], 0, Notify::Kicks, Coalescing::default()))
        .unwrap_err();
    assert!(e.to_string().contains("queue 0"), "{e}");
}

#[test]
fn bad_configs_give_clear_errors() {
    let img = Image::new(IMAGE);
    let e = |c: BlockConfig| Block::new("blk0".into(), c).err().unwrap();
    let mut c = cfg(&img);
    c.path = "/nonexistent/lucid.img".into();
    let m = e(c).to_string();
    assert!(
        m.contains("/nonexistent/lucid.img") && m.contains("No such file"),
        "{m}"
    );
    let mut c = cfg(&img);
    c.logical_block_size = 1024;
    assert!(matches!(e(c), BlockError::BadBlockSize(1024)));
    let mut c = cfg(&img);
    c.id = "x".repeat(21);
    assert!(e(c).to_string().contains("at most 20"));
    let mut c = cfg(&img);
    c.path = std::env::temp_dir();
    assert!(matches!(
        e(c),
        BlockError::IsDirectory(_) | BlockError::Open { .. }
    ));
    let small = Image::new(100);
    assert!(e(cfg(&small))
        .to_string()
        .contains("smaller than one 512-byte block"));
}
