//! The rate limiter on the devices' worker threads, driven by a test acting as the guest: a
//! request the buckets cannot cover waits in the ring (the device takes nothing more from the
//! queue) until the limits change through the device's `RateControl`, in kick and poll mode;
//! nothing is lost. The buckets here refill in an hour, so "waits" needs no clock.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::blkdrv::*;
use common::*;
use lucid_virtio::blk::req::*;
use lucid_virtio::net::{Net, NetBackend, NetConfig, NET_HDR_LEN};
use lucid_virtio::rate::{RateControl, RateLimiterConfig, TokenBucketConfig};
use lucid_virtio::{Notify, VirtioDevice};

const HOUR_MS: u64 = 3_600_000;
/// How long the test watches a held request not complete.
const HELD: Duration = Duration::from_millis(300);

fn hourly(bandwidth: Option<u64>, ops: Option<u64>) -> RateLimiterConfig {
    let b = |size| TokenBucketConfig {
        size,
        one_time_burst: None,
        refill_time: HOUR_MS,
    };
    RateLimiterConfig {
        bandwidth: bandwidth.map(b),
        ops: ops.map(b),
    }
}

const MODES: [Notify; 2] = [Notify::Kicks, Notify::Poll { idle_sleep_us: 50 }];

#[test]
fn a_disk_holds_requests_past_its_operations_until_the_limit_changes() {
    for notify in MODES {
        let img = Image::new(IMAGE);
        let limits = RateControl::new(hourly(None, Some(2))).unwrap();
        let mut d = Blk::limited(cfg(&img), notify, limits.clone());
        let data: Vec<Vec<u8>> = (0..4).map(|i| pattern(i, 4096)).collect();
        let mut status = Vec::new();
        for (i, buf) in data.iter().enumerate() {
            let a = d.g.alloc(4096);
            d.g.write(a, buf);
            status.push(
                d.submit(VIRTIO_BLK_T_OUT, i as u64 * 8, &[(a, 4096, false)])
                    .1,
            );
        }
        // Two operations in the bucket: two writes done, two waiting in the ring.
        for _ in 0..2 {
            assert!(d.vq.next_used().is_some(), "{notify:?}");
        }
        assert_eq!(
            d.vq.next_used_within(HELD),
            None,
            "{notify:?}: over the limit"
        );
        assert_eq!(d.g.stat("blk0.requests"), 2);
        assert_eq!(d.g.stat("blk0.rate_limited.throttled_events"), 1);
        assert_eq!(d.g.stat("blk0.rate_limited.ops_deferred"), 1);
        assert_eq!(d.g.stat("blk0.rate_limited.ops_capacity"), 2);
        // One more operation an hour is still too few; lifting the limit lets both go.
        limits.set(hourly(None, Some(1))).unwrap();
        assert_eq!(d.vq.next_used_within(HELD), None, "{notify:?}: still held");
        limits.set(RateLimiterConfig::default()).unwrap();
        for _ in 0..2 {
            assert!(d.vq.next_used().is_some(), "{notify:?}: released");
        }
        for (i, (buf, s)) in data.iter().zip(&status).enumerate() {
            assert_eq!(d.g.read(*s, 1)[0], VIRTIO_BLK_S_OK);
            assert_eq!(
                &img.read(i as u64 * 4096, 4096),
                buf,
                "{notify:?}: block {i}"
            );
        }
        assert_eq!(d.g.stat("blk0.rate_limited.ops_capacity"), 0);
        assert_eq!(d.g.stat("blk0.errors"), 0);
        d.dev.reset();
    }
}

#[test]
fn a_disk_counts_data_bytes_and_lets_a_large_request_into_debt() {
    let img = Image::new(IMAGE);
    img.write(0, &pattern(9, 65536));
    let limits = RateControl::new(hourly(Some(4096), None)).unwrap();
    let mut d = Blk::limited(cfg(&img), Notify::Kicks, limits.clone());
    // A flush takes no byte; a read larger than the bucket goes while the bucket is full.
    assert_eq!(d.req(VIRTIO_BLK_T_FLUSH, 0, &[]).0, VIRTIO_BLK_S_OK);
    let (s, got) = d.read(0, 65536);
    assert_eq!((s, got), (VIRTIO_BLK_S_OK, pattern(9, 65536)));
    // In debt now: a flush (no bytes) still goes, a 512-byte read waits.
    assert_eq!(d.req(VIRTIO_BLK_T_FLUSH, 0, &[]).0, VIRTIO_BLK_S_OK);
    let a = d.g.alloc(512);
    let (head, status) = d.submit(VIRTIO_BLK_T_IN, 0, &[(a, 512, true)]);
    assert_eq!(d.vq.next_used_within(HELD), None);
    assert_eq!(d.g.stat("blk0.rate_limited.bytes_deferred"), 512);
    // The debt (60 KiB) carries over, paid at the new rate in about 60 ms.
    let per_second = RateLimiterConfig {
        bandwidth: Some(TokenBucketConfig::per_second(1 << 20, None)),
        ops: None,
    };
    limits.set(per_second).unwrap();
    let (id, len) = d.vq.next_used().expect("released by the higher limit");
    assert_eq!((id, len), (u32::from(head), 513));
    assert_eq!(d.g.read(status, 1)[0], VIRTIO_BLK_S_OK);
    assert_eq!(d.g.read(a, 512), pattern(9, 65536)[..512]);
    assert_eq!(d.g.stat("blk0.rate_limited.bw_capacity"), 1 << 20);
    d.dev.reset();
}

/// An echo NIC: a frame held by the tx buckets stays in the tx ring, and comes back once the
/// limit is lifted.
#[test]
fn a_nic_holds_frames_until_the_limit_changes() {
    for notify in MODES {
        let limits = RateControl::new(hourly(None, Some(2))).unwrap();
        let mut dev = Net::new(
            "net0".into(),
            NetConfig {
                backend: NetBackend::Echo,
                mac: [0x52, 0x54, 0, 0x12, 0x34, 0x56],
            },
        )
        .unwrap();
        dev.set_rate_control(limits.clone());
        let (mut g, mut rx, mut tx) = activate_two_queues(&mut dev, notify);
        let poll = matches!(notify, Notify::Poll { .. });
        let mut bufs = Vec::new();
        for _ in 0..8 {
            let a = g.alloc(2048);
            bufs.push(a);
            rx.add(&[(a, 2048, true)]);
        }
        if !poll {
            rx.kick();
        }
        let frames: Vec<Vec<u8>> = (0..3).map(|i| pattern(100 + i, 200)).collect();
        for f in &frames {
            let h = g.alloc(NET_HDR_LEN as u64 + 200);
            g.write(h, &[0; NET_HDR_LEN]);
            g.write(h + NET_HDR_LEN as u64, f);
            tx.add(&[(h, (NET_HDR_LEN + 200) as u32, false)]);
        }
        if !poll {
            tx.kick();
        }
        // Two frames out and back; the third waits in the tx ring.
        for _ in 0..2 {
            assert!(tx.next_used().is_some(), "{notify:?}");
            assert!(rx.next_used().is_some(), "{notify:?}");
        }
        assert_eq!(tx.next_used_within(HELD), None, "{notify:?}");
        // Fewer operations: the bucket keeps what it had (none), the frame still waits.
        limits.set(hourly(None, Some(1))).unwrap();
        assert_eq!(tx.next_used_within(HELD), None, "{notify:?}: still held");
        limits.set(RateLimiterConfig::default()).unwrap();
        assert!(tx.next_used().is_some(), "{notify:?}: released");
        let (id, len) = rx.next_used().expect("echoed");
        assert_eq!(len as usize, NET_HDR_LEN + 200);
        let a = bufs[id as usize];
        assert_eq!(g.read(a + NET_HDR_LEN as u64, 200), frames[2]);
        assert_eq!(g.stat("net0.tx_packets"), 3);
        assert_eq!(g.stat("net0.rx_packets"), 3);
        assert!(g.stat("net0.rate_limited.throttled_events") >= 1);
        dev.reset();
    }
}

#[test]
fn an_invalid_limit_is_refused_and_the_old_one_kept() {
    let limits: Arc<RateControl> = RateControl::new(hourly(Some(10), None)).unwrap();
    assert!(limits.set(hourly(Some(0), None)).is_err());
    assert_eq!(limits.get(), hourly(Some(10), None));
}
