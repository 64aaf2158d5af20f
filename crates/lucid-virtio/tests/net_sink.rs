//! The paced virtio-net sink (`backend=sink,rate=MBIT`), driven by a test acting as the guest:
//! every frame is counted, and the rate holds in every window the device measures on its own
//! clock (`net0.sink.window_max_bytes`), whatever the host's speed: no wall-clock assertions on
//! throughput.

mod common;

use std::time::{Duration, Instant};

use common::*;
use lucid_virtio::net::{Net, NetBackend, NetConfig, NET_HDR_LEN, SINK_BURST, SINK_WINDOW};
use lucid_virtio::{Coalescing, Notify, VirtioDevice};

const MAC: [u8; 6] = [0x52, 0x54, 0x00, 0x12, 0x34, 0x56];

struct Link {
    g: Guest,
    tx: Vq,
    dev: Net,
    poll: bool,
    /// One buffer per descriptor (a header and a frame of up to 64 KiB).
    bufs: Vec<u64>,
    inflight: u32,
    kicked: u16,
}

impl Link {
    fn new(rate_mbit: u64, notify: Notify) -> Link {
        let mut dev = Net::new(
            "net0".into(),
            NetConfig {
                backend: NetBackend::Sink {
                    rate_mbit: Some(rate_mbit),
                },
                mac: MAC,
            },
        )
        .unwrap();
        let (mut g, _rx, tx) = activate_two_queues(&mut dev, notify);
        let bufs = (0..64).map(|_| g.alloc(65_536 + 64)).collect();
        Link {
            g,
            tx,
            dev,
            poll: matches!(notify, Notify::Poll { .. }),
            bufs,
            inflight: 0,
            kicked: 0,
        }
    }

    /// Queues one frame of `len` bytes (behind a zero header) if a buffer is free; kicks as a
    /// driver following EVENT_IDX would.
    fn offer(&mut self, len: u32) -> bool {
        if self.inflight as usize == self.bufs.len() {
            return false;
        }
        let b = self.bufs[self.tx.avail_idx as usize % self.bufs.len()];
        self.g.write(b, &[0u8; NET_HDR_LEN]);
        self.tx.add(&[(b, NET_HDR_LEN as u32 + len, false)]);
        self.inflight += 1;
        if !self.poll && self.tx.would_kick(self.kicked) {
            self.tx.kick();
        }
        self.kicked = self.tx.avail_idx;
        true
    }

    fn reap(&mut self) -> u32 {
        let mut n = 0;
        while let Some((_, len)) = self.tx.pop_used() {
            assert_eq!(len, 0);
            self.inflight -= 1;
            n += 1;
        }
        n
    }

    /// Sends `frames` frames of `len` bytes keeping the queue full; returns when all completed.
    fn stream(&mut self, frames: u64, len: u32) {
        let (mut offered, mut done) = (0u64, 0u64);
        let end = Instant::now() + TIMEOUT * 3;
        while done < frames {
            while offered < frames && self.offer(len) {
                offered += 1;
            }
            done += u64::from(self.reap());
            assert!(
                Instant::now() < end,
                "stalled: {done} of {frames} frames done, sink frames {}",
                self.stat("sink.frames")
            );
            std::thread::sleep(Duration::from_micros(100));
        }
    }

    fn stat(&self, n: &str) -> u64 {
        self.g.stat(&format!("net0.{n}"))
    }

    /// The most bytes a sink at `rate_mbit` may move in one of its windows: the window's refill,
    /// a full bucket, and the frame that takes the bucket below zero.
    fn window_bound(rate_mbit: u64, frame: u64) -> u64 {
        let rate = rate_mbit * 125_000;
        let ns = (SINK_WINDOW + SINK_BURST).as_nanos() as u64;
        rate * ns / 1_000_000_000 + frame
    }
}

#[test]
fn paced_sink_keeps_to_its_rate_in_every_window() {
    for notify in [Notify::Kicks, Notify::Poll { idle_sleep_us: 10 }] {
        let rate = 100; // Mbit/s: 12.5 MB/s, 125 KB per 10 ms window
        let mut l = Link::new(rate, notify);
        let (frames, len) = (2000u64, 1514u32);
        l.stream(frames, len);
        assert_eq!(l.stat("sink.frames"), frames, "{notify:?}");
        assert_eq!(l.stat("sink.bytes"), frames * u64::from(len));
        assert_eq!(l.stat("tx_packets"), frames);
        assert_eq!(l.stat("errors"), 0);
        assert_eq!(l.stat("sink.rate_bytes_per_s"), rate * 125_000);
        assert_eq!(l.stat("sink.window_ns"), SINK_WINDOW.as_nanos() as u64);
        let max = l.stat("sink.window_max_bytes");
        let bound = Link::window_bound(rate, u64::from(len));
        eprintln!(
            "{notify:?}: window_max_bytes={max} bound={bound} throttled_ns={}",
            l.stat("sink.throttled_ns")
        );
        assert!(
            max <= bound,
            "{notify:?}: {max} bytes in one window > {bound}"
        );
        // 3 MB offered at once to a 12.5 MB/s link: frames waited for tokens.
        assert!(l.stat("sink.throttled_ns") > 0);
        assert!(max > 0);
        l.dev.reset();
    }
}

#[test]
fn paced_sink_passes_frames_larger_than_its_bucket() {
    // 1 Mbit/s: a 125-byte bucket; 64 KiB frames still go, one per 0.52 s of tokens. Two of
    // them: the first from the full bucket, the second after the debt is paid.
    let mut l = Link::new(1, Notify::Kicks);
    l.stream(2, 65_536);
    assert_eq!(l.stat("sink.frames"), 2);
    assert_eq!(l.stat("sink.bytes"), 2 * 65_536);
    assert_eq!(l.stat("sink.burst_bytes"), 125);
    // One frame per window: the second came after the first's debt.
    assert_eq!(l.stat("sink.window_max_bytes"), 65_536);
    assert!(l.stat("sink.throttled_ns") > 0);
    l.dev.reset();
}

#[test]
fn throttled_sink_leaves_frames_in_the_ring_and_resets_promptly() {
    // 1 Mbit/s with 16 frames of 64 KiB offered: 8 s of link time. The sink takes the first
    // and leaves the rest in the avail ring (the guest sees a full queue), and a reset does
    // not wait for tokens.
    let mut l = Link::new(1, Notify::Kicks);
    for _ in 0..16 {
        assert!(l.offer(65_536));
    }
    assert!(wait_for(|| l.stat("sink.frames") >= 1));
    std::thread::sleep(Duration::from_millis(50));
    assert!(l.stat("sink.frames") < 16);
    assert_eq!(l.stat("sink.frames"), l.stat("tx_packets"));
    let t = Instant::now();
    l.dev.reset();
    let waited = t.elapsed();
    let done = l.stat("sink.frames");
    assert!(done < 16, "{done} frames passed a 1 Mbit/s link");
    // Generous: the link would hold the worker for seconds.
    assert!(waited < Duration::from_secs(2), "reset took {waited:?}");
}

#[test]
fn unpaced_sink_counts_frames() {
    let mut d = Net::new(
        "net0".into(),
        NetConfig {
            backend: NetBackend::Sink { rate_mbit: None },
            mac: MAC,
        },
    )
    .unwrap();
    let mut g = Guest::new();
    let (_rx, (rq, rk)) = Vq::new(&g.mem, 0x10000, 256);
    let (mut tx, (tq, tk)) = Vq::new(&g.mem, 0x14000, 256);
    let feats = d.features();
    d.activate(g.ctx(
        vec![(0, rq, rk), (1, tq, tk)],
        feats,
        Notify::Kicks,
        Coalescing::default(),
    ))
    .unwrap();
    let b = g.alloc(2048);
    for i in 0..100u32 {
        tx.add(&[(b, NET_HDR_LEN as u32 + 60 + i, false)]);
        tx.kick();
        tx.next_used().expect("completed");
    }
    assert_eq!(g.stat("net0.sink.frames"), 100);
    assert_eq!(
        g.stat("net0.sink.bytes"),
        (0..100).map(|i| 60 + i).sum::<u64>()
    );
    assert_eq!(g.stat("net0.sink.throttled_ns"), 0);
    assert_eq!(g.stat("net0.sink.rate_bytes_per_s"), 0);
    d.reset();
}

#[test]
fn bad_rates_are_refused() {
    for r in [0, 100_001] {
        let e = Net::new(
            "n".into(),
            NetConfig {
                backend: NetBackend::Sink { rate_mbit: Some(r) },
                mac: MAC,
            },
        )
        .err()
        .expect("refused")
        .to_string();
        assert!(e.contains("rate=1000"), "{e}");
    }
}
