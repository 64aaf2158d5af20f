//! The queue-worker core, seen through virtio-blk: poll mode, notification suppression in both
//! directions, interrupt coalescing, reset.

mod common;

use std::time::Duration;

use common::blkdrv::*;
use common::*;
use lucid_virtio::blk::{req::*, Block};
use lucid_virtio::features::*;
use lucid_virtio::{Coalescing, Notify, VirtioDevice};

fn st(b: &Blk, n: &str) -> u64 {
    b.g.stat(&format!("blk0.{n}"))
}

/// Writes then reads back `n` 4 KiB blocks, one request at a time.
fn sequential_io(b: &mut Blk, n: u64) {
    for i in 0..n {
        let data = pattern(i, 4096);
        assert_eq!(b.write(i * 8, &data), VIRTIO_BLK_S_OK);
        assert_eq!(b.read(i * 8, 4096), (VIRTIO_BLK_S_OK, data));
    }
}

#[test]
fn poll_mode_serves_requests_without_kicks() {
    for event_idx in [false, true] {
        for idle_sleep_us in [0, 20] {
            let img = Image::new(IMAGE);
            let mut b = Blk::with(
                cfg(&img),
                Notify::Poll { idle_sleep_us },
                Coalescing::default(),
                event_idx,
            );
            // Batches of 8 requests published at once, never kicked.
            for batch in 0..10u64 {
                let mut heads = Vec::new();
                for k in 0..8u64 {
                    let i = batch * 8 + k;
                    let a = b.g.alloc(4096);
                    b.g.write(a, &pattern(i, 4096));
                    heads.push(b.submit(VIRTIO_BLK_T_OUT, i * 8, &[(a, 4096, false)]));
                }
                for (_, status) in heads {
                    b.vq.next_used().expect("poll mode completed the request");
                    assert_eq!(b.g.read(status, 1)[0], VIRTIO_BLK_S_OK);
                }
            }
            for i in 0..80u64 {
                assert_eq!(img.read(i * 4096, 4096), pattern(i, 4096));
            }
            // The device keeps the driver from notifying.
            if event_idx {
                let old = b.vq.avail_idx;
                let a = b.g.alloc(512);
                b.submit(VIRTIO_BLK_T_IN, 0, &[(a, 512, true)]);
                assert!(
                    !b.vq.would_kick(old),
                    "avail_event {} lets the driver kick",
                    b.vq.avail_event()
                );
                b.vq.next_used().unwrap();
            } else {
                assert_eq!(b.vq.used_flags() & 1, 1, "VRING_USED_F_NO_NOTIFY not set");
            }
            assert_eq!(st(&b, "kicks"), 0);
            assert!(st(&b, "polls_found_work") >= 1);
            assert_eq!(st(&b, "errors"), 0);
            b.dev.reset();
        }
    }
}

#[test]
fn kick_mode_reenables_notifications_when_idle() {
    let img = Image::new(IMAGE);
    let mut b = Blk::with(cfg(&img), Notify::Kicks, Coalescing::default(), true);
    sequential_io(&mut b, 4);
    // After going idle the device asks to be notified of the next chain (avail_event catches
    // up with the avail index just after the last completion is published).
    // With avail_event == avail_idx, vring_need_event says: kick for the next chain.
    assert!(wait_for(|| b.vq.avail_event() == b.vq.avail_idx));
    let a = b.g.alloc(512);
    b.submit(VIRTIO_BLK_T_IN, 0, &[(a, 512, true)]);
    b.vq.next_used().unwrap();
    assert!(st(&b, "kicks") >= 9);
    b.dev.reset();
}

/// The guest below waits for each completion before it submits the next request, so the device
/// sees batches of one, or of two when the next request lands before the device's loop ends.
/// Interrupt decisions are made per batch.
#[test]
fn every_completion_gets_an_interrupt_without_coalescing() {
    let img = Image::new(IMAGE);
    let mut b = Blk::with(cfg(&img), Notify::Kicks, Coalescing::default(), false);
    sequential_io(&mut b, 4);
    assert!(wait_for(|| st(&b, "irqs") + st(&b, "irqs_coalesced") == 8));
    assert!(st(&b, "irqs") >= 4);
    assert_eq!(b.g.irq.q(0), st(&b, "irqs"));
    b.dev.reset();
}

#[test]
fn coalescing_by_count_lowers_interrupts_per_completion() {
    let img = Image::new(IMAGE);
    let coal = Coalescing {
        max_completions: 4,
        max_delay_us: 30_000_000,
    };
    for notify in [Notify::Kicks, Notify::Poll { idle_sleep_us: 10 }] {
        let mut b = Blk::with(cfg(&img), notify, coal, false);
        sequential_io(&mut b, 6); // 12 completions
                                  // An interrupt once 4 (or 5, with a batch of two) are pending: 2 or 3 interrupts.
                                  // The worker counts an interrupt (and the completions it covers) just after it
                                  // raised it: wait until the counts caught up with what the guest saw.
        let mut irqs = 0;
        assert!(wait_for(|| {
            irqs = st(&b, "irqs");
            irqs >= 2 && b.g.irq.q(0) == irqs && st(&b, "irqs_coalesced") >= 3 * irqs
        }));
        assert!(irqs <= 3, "{irqs} interrupts for 12 completions");
        b.dev.reset();

        // Fewer completions than the count, far from the time cap: no interrupt.
        let mut b = Blk::with(cfg(&img), notify, coal, false);
        sequential_io(&mut b, 1);
        assert_eq!(b.write(100, &[3u8; 512]), VIRTIO_BLK_S_OK);
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(b.g.irq.q(0), 0);
        assert_eq!(st(&b, "irqs") + st(&b, "irqs_coalesced"), 0);
        b.dev.reset();
    }
}

#[test]
fn coalescing_time_cap_flushes_a_pending_interrupt() {
    let img = Image::new(IMAGE);
    let coal = Coalescing {
        max_completions: 1000,
        max_delay_us: 2000,
    };
    for notify in [Notify::Kicks, Notify::Poll { idle_sleep_us: 50 }] {
        let mut b = Blk::with(cfg(&img), notify, coal, false);
        sequential_io(&mut b, 2); // 4 completions, fewer than the count
        assert!(
            wait_for(|| st(&b, "irqs") + st(&b, "irqs_coalesced") == 4),
            "the timer did not flush the interrupt"
        );
        assert!(b.g.irq.q(0) >= 1);
        b.dev.reset();
    }
}

#[test]
fn coalescing_with_event_idx_still_interrupts_when_the_driver_waits() {
    let img = Image::new(IMAGE);
    let coal = Coalescing {
        max_completions: 3,
        max_delay_us: 1000,
    };
    let mut b = Blk::with(cfg(&img), Notify::Kicks, coal, true);
    for i in 0..9u64 {
        // Like Linux: after consuming, ask for an interrupt at the next used entry.
        b.vq.set_used_event(b.vq.used_seen);
        let before = b.g.irq.q(0);
        assert_eq!(b.write(i * 8, &pattern(i, 512)), VIRTIO_BLK_S_OK);
        // The driver would now sleep for its interrupt: it must come (count or timer).
        assert!(wait_for(|| b.g.irq.q(0) > before));
    }
    // Counted just after it was raised.
    assert!(wait_for(|| st(&b, "irqs") + st(&b, "irqs_coalesced") == 9));
    b.dev.reset();
}

#[test]
fn driver_suppression_is_honoured() {
    let img = Image::new(IMAGE);
    // VRING_AVAIL_F_NO_INTERRUPT without EVENT_IDX.
    let mut b = Blk::with(cfg(&img), Notify::Kicks, Coalescing::default(), false);
    b.vq.set_avail_flags(1);
    sequential_io(&mut b, 3);
    assert_eq!(b.g.irq.q(0), 0);
    // Each completion's interrupt decision comes just after its used entry.
    assert!(wait_for(|| st(&b, "irqs_suppressed") == 6));
    b.vq.set_avail_flags(0);
    sequential_io(&mut b, 1);
    assert!(wait_for(|| st(&b, "irqs") + st(&b, "irqs_coalesced") == 2));
    assert!(b.g.irq.q(0) >= 1);
    b.dev.reset();

    // used_event with EVENT_IDX, in poll mode with the guest polling too (L4 with guest_polls).
    let mut b = Blk::with(
        cfg(&img),
        Notify::Poll { idle_sleep_us: 10 },
        Coalescing::default(),
        true,
    );
    b.vq.set_used_event(b.vq.used_seen.wrapping_add(0x4000));
    sequential_io(&mut b, 5);
    assert_eq!(b.g.irq.q(0), 0);
    assert_eq!(st(&b, "irqs"), 0);
    assert!(wait_for(|| st(&b, "irqs_suppressed") == 10));
    // Asking for an interrupt at the next entry gets exactly one.
    b.vq.set_used_event(b.vq.used_seen);
    assert_eq!(b.write(0, &[1u8; 512]), VIRTIO_BLK_S_OK);
    assert!(wait_for(|| b.g.irq.q(0) == 1));
    assert_eq!(st(&b, "kicks"), 0);
    b.dev.reset();
}

#[test]
fn reset_stops_the_thread_and_the_device() {
    let img = Image::new(IMAGE);
    for notify in [Notify::Kicks, Notify::Poll { idle_sleep_us: 0 }] {
        let g = Guest::new();
        let mut dev = Block::new("blkrst".into(), cfg(&img)).unwrap();
        let (vq, (q, kick)) = Vq::new(&g.mem, 0x10000, 256);
        dev.activate(g.ctx(
            vec![(0, q, kick)],
            VIRTIO_F_VERSION_1,
            notify,
            Coalescing::default(),
        ))
        .unwrap();
        assert!(
            wait_for(|| thread_names().iter().any(|n| n == "lucid-blkrst-io")),
            "{:?}",
            thread_names()
        );
        let mut b = Blk {
            g,
            vq,
            dev,
            poll: matches!(notify, Notify::Poll { .. }),
        };
        sequential_io(&mut b, 1);
        b.dev.reset();
        assert!(!thread_names().iter().any(|n| n == "lucid-blkrst-io"));
        // Nothing is served after the reset.
        let a = b.g.alloc(512);
        b.submit(VIRTIO_BLK_T_IN, 0, &[(a, 512, true)]);
        b.vq.kick();
        assert!(b.vq.next_used_within(Duration::from_millis(100)).is_none());
        // A second reset is harmless.
        b.dev.reset();
    }
}

#[test]
fn activating_twice_is_refused() {
    let img = Image::new(IMAGE);
    let mut b = Blk::new(cfg(&img));
    let (_vq, (q, kick)) = Vq::new(&b.g.mem, 0x30000, 16);
    let e = b
        .dev
        .activate(b.g.ctx(vec![(0, q, kick)], 0, Notify::Kicks, Coalescing::default()))
        .unwrap_err();
    assert!(e.to_string().contains("twice"), "{e}");
    b.dev.reset();
}
