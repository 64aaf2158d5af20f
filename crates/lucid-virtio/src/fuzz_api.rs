//! The entry point of the `virtqueue` fuzz target (`fuzz/`) and of its regression tests: a
//! device's back-end serves descriptor chains from guest memory that the input fills, on the
//! caller's thread ([`Notify::Inline`]). Not an API.
//!
//! Input: byte 0 picks the device (`% 6`: blk read-write, blk read-only, blk with 4096-byte
//! blocks, net echo, net sink, rng); byte 1 has flags (bit 0: EVENT_IDX negotiated, bit 1:
//! interrupt coalescing 4:0, bit 2: bus mastering off, so every DMA is refused, bit 3: the rng
//! limited to 4096 bytes a second); byte 2 the queue size, `1 << (b % 9)`; the rest is guest memory from address
//! 0. Each queue's rings are packed from address 0: the descriptor table, the avail ring, then
//! the used ring (4-byte aligned), the next queue 16-byte aligned after it.
//!
//! Checked: no panic; unless the device wrote into the rings (a guest may point buffers there),
//! each used ring's index moved by exactly the chains the device counted as
//! completed, each with an ID inside the queue; a block device that does not ask for a reset
//! served every chain made available; a device that asks for a reset said so by a configuration
//! interrupt; echo delivers no more frames than were sent.

use std::collections::BTreeMap;
use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use lucid_mem::vm_memory::{Bytes, GuestAddress};
use lucid_mem::{Access as DmaAccess, Backing, DeviceId, DmaObserver, DmaPath, GuestRam};
use lucid_stats::StatsRegistry;
use virtio_queue::{Queue, QueueT};
use vmm_sys_util::eventfd::EventFd;

use crate::blk::{Block, BlockConfig};
use crate::net::{Net, NetBackend, NetConfig};
use crate::rng::{Rng, RngConfig};
use crate::{features, ActivateContext, Coalescing, Notify, VirtioDevice, VirtioInterrupt};

const RAM: u64 = 2 << 20;
/// Guest memory the input may fill.
const MAX_IMAGE: usize = 64 << 10;
const DISK: i64 = 64 << 10;
const DEV_ID: DeviceId = 8;

/// Whether the device wrote into `0..end` (the rings): then the ring checks do not apply.
struct RingWrites {
    end: u64,
    hit: AtomicBool,
}

impl DmaObserver for RingWrites {
    fn observe(&self, _dev: DeviceId, gpa: u64, _len: u64, access: DmaAccess) {
        if access == DmaAccess::Write && gpa < self.end {
            self.hit.store(true, Ordering::Relaxed);
        }
    }
}

#[derive(Default)]
struct Irqs {
    queue: AtomicUsize,
    config: AtomicUsize,
}

impl VirtioInterrupt for Irqs {
    fn signal_queue(&self, _queue: u16) {
        self.queue.fetch_add(1, Ordering::Relaxed);
    }
    fn signal_config(&self) {
        self.config.fetch_add(1, Ordering::Relaxed);
    }
}

/// Where queue `i`'s rings go for queues of `size`: (descriptor table, avail ring, used ring).
fn rings(i: u64, size: u64) -> (u64, u64, u64) {
    let per_queue = (16 * size + 6 + 2 * size).next_multiple_of(4) + 6 + 8 * size;
    let desc = i * per_queue.next_multiple_of(16);
    let avail = desc + 16 * size;
    (desc, avail, (avail + 6 + 2 * size).next_multiple_of(4))
}

/// A disk image in memory (a memfd) that `Block::new` opens by path.
fn disk() -> File {
    // SAFETY: memfd_create with a NUL-terminated name; the fd it returns is ours alone.
    let fd = unsafe { libc::memfd_create(c"lucid-fuzz-disk".as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
    // SAFETY: `fd` is a fresh descriptor that nothing else owns.
    let file = unsafe { File::from_raw_fd(fd) };
    file.set_len(DISK as u64).expect("size the disk");
    file
}

/// Runs one input (see the module's documentation); returns the device's counters (without
/// its name), none for an input shorter than its 3-byte header.
pub fn virtqueue(data: &[u8]) -> BTreeMap<String, u64> {
    let [kind, flags, size, image @ ..] = data else {
        return BTreeMap::new();
    };
    let image = &image[..image.len().min(MAX_IMAGE)];
    let disk_file = disk();
    let stats = StatsRegistry::new();
    let mut dev: Box<dyn VirtioDevice> = match kind % 6 {
        k @ 0..=2 => {
            let cfg = BlockConfig {
                path: format!("/proc/self/fd/{}", disk_file.as_raw_fd()).into(),
                read_only: k == 1,
                logical_block_size: if k == 2 { 4096 } else { 512 },
                id: "fuzz".into(),
                direct: false,
            };
            Box::new(Block::new("blk0".into(), cfg).expect("memfd disk"))
        }
        5 => {
            let cfg = RngConfig {
                rate: (flags & 8 != 0).then_some(4096),
                ..RngConfig::default()
            };
            Box::new(Rng::new("rng".into(), cfg, &stats).expect("a valid rate"))
        }
        k => {
            let backend = if k == 3 {
                NetBackend::Echo
            } else {
                NetBackend::Sink { rate_mbit: None }
            };
            let cfg = NetConfig {
                backend,
                mac: [0x52, 0x54, 0, 0x12, 0x34, 0x56],
            };
            Box::new(Net::new("net0".into(), cfg).expect("echo or sink"))
        }
    };
    let is_blk = kind % 6 <= 2;
    let size = (1u16 << (size % 9)).min(dev.queue_max_sizes()[0]);
    let ram = GuestRam::new(&[(0, RAM)], Backing::Anonymous).expect("guest RAM");
    let mem = ram.memory().clone();
    mem.write_slice(image, GuestAddress(0)).expect("image fits");
    let dma = DmaPath::new(mem.clone(), &stats);
    let queue_count = dev.queue_max_sizes().len() as u64;
    let ring_writes = Arc::new(RingWrites {
        end: rings(queue_count, size.into()).0,
        hit: AtomicBool::new(false),
    });
    dma.add_observer(ring_writes.clone());
    dma.set_bus_master(DEV_ID, flags & 4 == 0);
    let irqs = Arc::new(Irqs::default());
    let mut queues = Vec::new();
    let mut layout = Vec::new();
    for i in 0..dev.queue_max_sizes().len() as u16 {
        let (desc, avail, used) = rings(i.into(), size.into());
        let mut q = Queue::new(size).expect("power of two");
        q.set_desc_table_address(Some(desc as u32), Some((desc >> 32) as u32));
        q.set_avail_ring_address(Some(avail as u32), Some((avail >> 32) as u32));
        q.set_used_ring_address(Some(used as u32), Some((used >> 32) as u32));
        q.set_ready(true);
        // The used ring is the device's: it starts zeroed whatever the image holds.
        mem.write_slice(&vec![0; 6 + 8 * usize::from(size)], GuestAddress(used))
            .expect("in RAM");
        queues.push((i, q, EventFd::new(0).expect("eventfd")));
        layout.push((avail, used));
    }
    let ctx = ActivateContext {
        mem: dma.device_memory(DEV_ID),
        queues,
        interrupt: irqs.clone(),
        features: dev.features()
            & !(if flags & 1 == 0 {
                features::VIRTIO_RING_F_EVENT_IDX
            } else {
                0
            }),
        notify: Notify::Inline,
        coalescing: Coalescing {
            max_completions: if flags & 2 != 0 { 4 } else { 0 },
            max_delay_us: 0,
        },
        stats: stats.clone(),
        spawner: lucid_thread::Spawner::new(None, stats.threads().clone()),
    };
    dev.activate(ctx).expect("valid queues");

    let counters = stats.snapshot();
    let count = |n: &str| counters.get(&format!("{}.{n}", dev.name())).copied();
    let needs_reset = dev.needs_reset();
    let mut completed = 0u64;
    let rings_intact = !ring_writes.hit.load(Ordering::Relaxed);
    for (avail, used) in layout.into_iter().filter(|_| rings_intact) {
        let u16_at = |a: u64| mem.read_obj::<u16>(GuestAddress(a)).expect("in RAM");
        let used_idx = u16_at(used + 2);
        completed += u64::from(used_idx);
        for e in 0..used_idx.min(size) {
            let id = mem
                .read_obj::<u32>(GuestAddress(used + 4 + 8 * u64::from(e)))
                .expect("in RAM");
            assert!(id < u32::from(size), "used id {id} in a queue of {size}");
        }
        if is_blk && !needs_reset {
            assert_eq!(
                used_idx,
                u16_at(avail + 2),
                "available chains left unserved"
            );
        }
    }
    // Each used index started at 0 and moves once per completed chain (fewer than 2^16 here).
    if rings_intact {
        assert_eq!(Some(completed), count("requests"));
    }
    if needs_reset {
        assert!(
            irqs.config.load(Ordering::Relaxed) > 0,
            "reset needed in silence"
        );
    }
    if kind % 6 == 3 {
        let (rx, tx) = (count("rx_packets"), count("tx_packets"));
        assert!(rx.is_some() && tx.is_some(), "net counters registered");
        assert!(rx <= tx, "more frames echoed than sent");
    }
    dev.reset();
    drop(disk_file);
    let prefix = format!("{}.", dev.name());
    counters
        .into_iter()
        .filter_map(|(k, v)| Some((k.strip_prefix(&prefix)?.to_string(), v)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seed(name: &str) -> Vec<u8> {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../../fuzz/seeds/virtqueue");
        std::fs::read(format!("{dir}/{name}")).expect("seed")
    }

    /// The committed seeds are the requests they are named after.
    #[test]
    fn seeds_serve_their_requests() {
        let c = virtqueue(&seed("blk-out-in-id-flush-discard"));
        assert_eq!((c["requests"], c["errors"]), (5, 0));
        assert_eq!((c["bytes_read"], c["bytes_written"]), (512, 512 + 20));
        let c = virtqueue(&seed("blk-4k-event-idx"));
        assert_eq!(
            (c["requests"], c["errors"]),
            (2, 2),
            "512-byte transfers on a 4k disk"
        );
        let c = virtqueue(&seed("blk-ro-write-refused"));
        assert_eq!((c["requests"], c["errors"]), (1, 1));
        let c = virtqueue(&seed("net-echo-tx-rx"));
        assert_eq!((c["tx_packets"], c["rx_packets"], c["requests"]), (1, 1, 2));
        let c = virtqueue(&seed("net-sink-split-header"));
        assert_eq!((c["tx_packets"], c["tx_bytes"], c["errors"]), (1, 60, 0));
        let c = virtqueue(&seed("rng-fill-and-read-only"));
        assert_eq!(
            (c["requests"], c["bytes_written"], c["errors"]),
            (2, 64, 1),
            "a 64-byte buffer filled, a read-only chain refused"
        );
        let mut limited = seed("rng-fill-and-read-only");
        limited[1] |= 8;
        let c = virtqueue(&limited);
        assert_eq!(
            (c["requests"], c["bytes_written"]),
            (2, 64),
            "within the burst"
        );
    }
}
