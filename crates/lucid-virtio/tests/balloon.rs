//! virtio-balloon driven by a test acting as the guest: inflate, deflate, statistics, free page
//! reporting and the configuration space, and hostile input (PFNs outside RAM or in the hole,
//! wrong descriptor sizes and directions, chains as long as the queue, bad reports).

mod common;

use std::sync::{Arc, Mutex};

use common::*;
use lucid_mem::vm_memory::{Bytes, GuestAddress};
use lucid_mem::{Backing, DmaPath, GuestMemoryMmap, GuestRam, MemError, PageDiscard};
use lucid_stats::StatsRegistry;
use lucid_virtio::balloon::{feature::*, Balloon, BalloonConfig, BalloonControl, BalloonError};
use lucid_virtio::features::VIRTIO_F_VERSION_1;
use lucid_virtio::{ActivateContext, Coalescing, Notify, VirtioDevice};

/// Guest RAM: 16 MiB at 0, 16 MiB right after it (a second region), a hole, 16 MiB at 48 MiB.
const REGIONS: [(u64, u64); 3] = [(0, 16 << 20), (16 << 20, 16 << 20), (48 << 20, 16 << 20)];
const PAGES: u64 = (48 << 20) >> 12;

/// Records what is discarded and passes it on to guest RAM.
struct Recorder {
    ram: Arc<GuestRam>,
    calls: Mutex<Vec<(u64, u64)>>,
}

impl PageDiscard for Recorder {
    fn discard(&self, gpa: u64, len: u64) -> Result<(), MemError> {
        self.calls.lock().unwrap().push((gpa, len));
        self.ram.discard(gpa, len)
    }
}

struct Drv {
    mem: GuestMemoryMmap,
    stats: Arc<StatsRegistry>,
    irq: Arc<CountingIrq>,
    rec: Arc<Recorder>,
    dev: Balloon,
    ctl: BalloonControl,
    /// inflate, deflate, then stats / reporting as negotiated.
    q: Vec<Vq>,
    heap: u64,
}

impl Drv {
    fn new(cfg: BalloonConfig) -> Drv {
        let ram = Arc::new(GuestRam::new(&REGIONS, Backing::Anonymous).unwrap());
        let mem = ram.memory().clone();
        let stats = StatsRegistry::new();
        let rec = Arc::new(Recorder {
            ram: ram.clone(),
            calls: Mutex::new(Vec::new()),
        });
        let dev = Balloon::new("balloon".into(), cfg, &REGIONS, rec.clone(), &stats).unwrap();
        let ctl = dev.control();
        let mut d = Drv {
            mem,
            stats,
            irq: Arc::new(CountingIrq::default()),
            rec,
            dev,
            ctl,
            q: Vec::new(),
            heap: 1 << 20,
        };
        d.activate();
        d
    }

    fn activate(&mut self) {
        let features = self.dev.features();
        let n = self.dev.queue_max_sizes().len() as u16;
        let mut qs = Vec::new();
        self.q.clear();
        for i in 0..n {
            let (vq, (q, k)) = Vq::new(&self.mem, 0x10000 + 0x4000 * u64::from(i), 256);
            self.q.push(vq);
            qs.push((i, q, k));
        }
        let dma = DmaPath::new(self.mem.clone(), &self.stats);
        let ctx = ActivateContext {
            mem: dma.device_memory(DEV_ID),
            queues: qs,
            interrupt: self.irq.clone(),
            features,
            notify: Notify::Kicks,
            coalescing: Coalescing::default(),
            stats: self.stats.clone(),
            spawner: lucid_thread::Spawner::new(None, self.stats.threads().clone()),
        };
        self.dev.activate(ctx).unwrap();
    }

    fn alloc(&mut self, len: u64) -> u64 {
        let a = self.heap;
        self.heap = (self.heap + len.max(1) + 15) & !15;
        assert!(self.heap < 8 << 20);
        a
    }

    /// A counter of the device's registry; a missing one panics with its name (read as 0, a
    /// renamed counter would pass every `== 0` check).
    fn stat(&self, name: &str) -> u64 {
        let snap = self.stats.snapshot();
        *snap
            .get(name)
            .unwrap_or_else(|| panic!("no counter {name} in {snap:?}"))
    }

    /// A buffer holding `pfns` as le32.
    fn pfn_buf(&mut self, pfns: &[u32]) -> (u64, u32) {
        let bytes: Vec<u8> = pfns.iter().flat_map(|p| p.to_le_bytes()).collect();
        let a = self.alloc(bytes.len() as u64);
        self.mem.write_slice(&bytes, GuestAddress(a)).unwrap();
        (a, bytes.len() as u32)
    }

    /// Puts a chain on queue `q`, kicks, and waits for it to be used.
    fn submit(&mut self, q: usize, bufs: &[(u64, u32, bool)]) -> (u32, u32) {
        let head = self.q[q].add(bufs);
        self.q[q].kick();
        let used = self.q[q].next_used().expect("the chain is used");
        assert_eq!(used.0, u32::from(head));
        used
    }

    fn inflate(&mut self, pfns: &[u32]) {
        let (a, l) = self.pfn_buf(pfns);
        assert_eq!(self.submit(0, &[(a, l, false)]).1, 0);
    }

    fn fill_page(&self, pfn: u64, byte: u8) {
        self.mem
            .write_slice(&[byte; 4096], GuestAddress(pfn << 12))
            .unwrap();
    }

    fn page_is(&self, pfn: u64, byte: u8) -> bool {
        let mut b = vec![0u8; 4096];
        self.mem
            .read_slice(&mut b, GuestAddress(pfn << 12))
            .unwrap();
        b.iter().all(|&x| x == byte)
    }

    fn calls(&self) -> Vec<(u64, u64)> {
        std::mem::take(&mut *self.rec.calls.lock().unwrap())
    }
}

fn all_on() -> BalloonConfig {
    BalloonConfig {
        size_mib: 8,
        deflate_on_oom: true,
        free_page_reporting: true,
        stats: true,
        manager: false,
    }
}

#[test]
fn inflate_discards_the_pages_in_runs_and_leaves_the_rest() {
    let mut d = Drv::new(BalloonConfig::default());
    for pfn in 2990..3020 {
        d.fill_page(pfn, 0xa5);
    }
    // Two runs, a lone page, a repeat, a run that crosses from region 0 into region 1, and
    // one in descending order (from region 1 down into region 0).
    let mut pfns: Vec<u32> = (3000..3010).collect();
    pfns.extend([3015, 3001]);
    pfns.extend(4094..4098);
    pfns.extend((4090..4100).rev());
    d.inflate(&pfns);
    assert_eq!(
        d.calls(),
        vec![
            (3000 << 12, 10 << 12),
            (3015 << 12, 4096),
            (3001 << 12, 4096),
            (4094 << 12, 2 << 12),
            (4096 << 12, 2 << 12),
            (4096 << 12, 4 << 12),
            (4090 << 12, 6 << 12),
        ]
    );
    for pfn in 3000..3010 {
        assert!(d.page_is(pfn, 0), "pfn {pfn} discarded reads zero");
    }
    assert!(d.page_is(3015, 0));
    for pfn in [2999, 3010, 3014, 3016] {
        assert!(d.page_is(pfn, 0xa5), "pfn {pfn} kept its data");
    }
    assert_eq!(d.stat("balloon.inflated_pages"), 26);
    assert_eq!(d.stat("balloon.bad_pfns"), 0);
    assert!(wait_for(|| d.irq.q(0) >= 1), "inflate queue interrupt");
}

#[test]
fn deflate_only_counts_and_discards_nothing() {
    let mut d = Drv::new(BalloonConfig::default());
    d.fill_page(500, 0x11);
    let (a, l) = d.pfn_buf(&[500, 501, 502]);
    d.submit(1, &[(a, l, false)]);
    assert!(d.calls().is_empty());
    assert!(d.page_is(500, 0x11));
    assert_eq!(d.stat("balloon.deflated_pages"), 3);
    assert_eq!(d.stat("balloon.inflated_pages"), 0);
}

#[test]
fn garbage_pfns_and_descriptors_are_counted_and_ignored() {
    let mut d = Drv::new(BalloonConfig::default());
    d.fill_page(100, 0x33);
    let hole = (40u32 << 20) >> 12; // 40 MiB: between the regions
    let beyond = (64u32 << 20) >> 12; // the end of RAM
    let (good, gl) = d.pfn_buf(&[100]);
    let (bad, bl) = d.pfn_buf(&[hole, beyond, u32::MAX, 0x7fff_ffff]);
    // The last MiB of RAM holds PFNs outside RAM; a descriptor running off its end reads them.
    d.mem
        .write_slice(&vec![0xffu8; 1 << 20], GuestAddress(63 << 20))
        .unwrap();
    let odd = d.alloc(6);
    let written = d.alloc(8);
    let head = d.q[0].add(&[
        (bad, bl, false),
        (odd, 6, false),            // not a whole number of PFNs
        (odd, 0, false),            // empty
        (written, 8, true),         // device-writable
        (1 << 40, 4096, false),     // outside guest memory
        (63 << 20, 1 << 30, false), // runs off the end of RAM
        (good, gl, false),
    ]);
    d.q[0].kick();
    assert_eq!(d.q[0].next_used(), Some((u32::from(head), 0)));
    const TAIL: u64 = (1 << 20) / 4;
    assert_eq!(d.stat("balloon.bad_pfns"), 4 + TAIL);
    assert_eq!(d.stat("balloon.bad_descriptors"), 5);
    assert_eq!(d.stat("balloon.inflated_pages"), 1);
    assert!(d.page_is(100, 0));
    assert!(!d.dev.needs_reset());
    // Garbage on the deflate queue too, and the device still works.
    d.submit(1, &[(bad, bl, false), (odd, 6, false)]);
    assert_eq!(d.stat("balloon.bad_pfns"), 8 + TAIL);
    assert_eq!(d.stat("balloon.bad_descriptors"), 6);
    d.fill_page(101, 0x44);
    d.inflate(&[101]);
    assert!(d.page_is(101, 0));
    assert!(!d.dev.needs_reset());
    // A chain of more than 4 GiB breaks the ring rules (virtio 1.2, 2.7.5.2): the device needs
    // a reset, and works again after one.
    d.q[0].add(&[(good, u32::MAX, false), (good, u32::MAX, false)]);
    d.q[0].kick();
    assert!(wait_for(|| d.dev.needs_reset()));
    assert!(d.irq.config() >= 1, "told by a config interrupt");
    d.dev.reset();
    d.activate();
    d.fill_page(102, 0x55);
    d.inflate(&[102]);
    assert!(d.page_is(102, 0));
}

#[test]
fn a_chain_as_long_as_the_queue_with_big_pfn_arrays_is_served() {
    let mut d = Drv::new(BalloonConfig::default());
    // 256 descriptors of 1024 PFNs each (more than the 4 KiB the device reads at a time), all in
    // the first 16 MiB region's upper half: every page once.
    let mut bufs = Vec::new();
    for k in 0..4u32 {
        let pfns: Vec<u32> = (2048 + k * 1024..2048 + (k + 1) * 1024).collect();
        let (a, l) = d.pfn_buf(&pfns);
        bufs.push((a, l, false));
    }
    let (z, zl) = d.pfn_buf(&[2048]);
    while bufs.len() < 256 {
        bufs.push((z, zl, false));
    }
    d.submit(0, &bufs);
    assert_eq!(d.stat("balloon.inflated_pages"), 4096 + 252);
    assert!(!d.dev.needs_reset());
    let calls = d.calls();
    // One run per RAM region.
    assert_eq!(calls[0], (8 << 20, 8 << 20));
    assert_eq!(calls[1], (16 << 20, 8 << 20));
}

#[test]
fn statistics_are_read_held_and_given_back_on_request() {
    let mut d = Drv::new(all_on());
    let stats_buf = |d: &mut Drv, free: u64| {
        let mut b = Vec::new();
        for (tag, v) in [(4u16, free), (5, 64 << 20), (6, free + 4096), (99, 7)] {
            b.extend(tag.to_le_bytes());
            b.extend(v.to_le_bytes());
        }
        let a = d.alloc(b.len() as u64);
        d.mem.write_slice(&b, GuestAddress(a)).unwrap();
        (a, b.len() as u32)
    };
    let (a, l) = stats_buf(&mut d, 1 << 20);
    d.q[2].add(&[(a, l, false)]);
    d.q[2].kick();
    assert!(wait_for(|| d.stat("balloon.stats_updates") == 1));
    let s = d.ctl.stats().expect("stats read");
    assert_eq!(s.free_memory(), Some(1 << 20));
    assert_eq!(s.total_memory(), Some(64 << 20));
    assert_eq!(s.get(99), Some(7));
    assert_eq!(d.stat("balloon.stats.available_memory"), (1 << 20) + 4096);
    // Held: not in the used ring until fresh figures are wanted.
    std::thread::sleep(std::time::Duration::from_millis(50));
    assert!(d.q[2].pop_used().is_none());
    d.ctl.request_stats();
    assert!(d.q[2].next_used().is_some(), "buffer given back");
    assert!(wait_for(|| d.irq.q(2) >= 1));
    let (a, l) = stats_buf(&mut d, 2 << 20);
    d.q[2].add(&[(a, l, false)]);
    d.q[2].kick();
    assert!(wait_for(|| d.stat("balloon.stats_updates") == 2));
    assert_eq!(d.ctl.stats().unwrap().free_memory(), Some(2 << 20));
    // A buffer that is not whole entries: counted, the whole entries kept.
    d.ctl.request_stats();
    assert!(d.q[2].next_used().is_some());
    let (a, _) = stats_buf(&mut d, 3 << 20);
    d.q[2].add(&[(a, 15, false)]);
    d.q[2].kick();
    assert!(wait_for(|| d.stat("balloon.stats_updates") == 3));
    assert_eq!(d.stat("balloon.bad_stats"), 1);
    assert_eq!(d.ctl.stats().unwrap().free_memory(), Some(3 << 20));
}

#[test]
fn free_page_reports_discard_whole_ram_pages_only() {
    let mut d = Drv::new(all_on());
    for pfn in 1000..1020 {
        d.fill_page(pfn, 0x77);
    }
    // Queue 3 is reporting (stats negotiated). Device-writable ranges, as Linux sends them.
    let used = d.submit(
        3,
        &[
            (1000 << 12, 8 << 12, true),
            (1010 << 12, 4 << 12, false),
            ((1015 << 12) + 8, 4096, true), // not page aligned
            (1016 << 12, 100, true),        // not whole pages
            (40 << 20, 4096, true),         // the hole
            ((31 << 20), 2 << 20, true),    // runs into the hole
            ((15 << 20), 2 << 20, true),    // spans regions 0 and 1: fine
            (!0xfffu64, 4096, true),        // wraps
        ],
    );
    assert_eq!(used.1, 0);
    assert_eq!(d.stat("balloon.bad_reports"), 5);
    assert_eq!(d.stat("balloon.reported_pages"), 8 + 4 + 512);
    for pfn in (1000..1008).chain(1010..1014) {
        assert!(d.page_is(pfn, 0), "{pfn}");
    }
    for pfn in [1008, 1009, 1014, 1015, 1016] {
        assert!(d.page_is(pfn, 0x77), "{pfn}");
    }
    let calls = d.calls();
    assert!(calls.contains(&(15 << 20, 1 << 20)) && calls.contains(&(16 << 20, 1 << 20)));
}

#[test]
fn reporting_is_queue_2_without_stats() {
    let mut d = Drv::new(BalloonConfig {
        free_page_reporting: true,
        ..BalloonConfig::default()
    });
    assert_eq!(d.dev.queue_max_sizes().len(), 3);
    d.fill_page(700, 1);
    d.submit(2, &[(700 << 12, 4096, true)]);
    assert_eq!(d.stat("balloon.reported_pages"), 1);
    assert!(d.page_is(700, 0));
}

#[test]
fn config_space_target_actual_and_the_config_interrupt() {
    let mut d = Drv::new(all_on());
    let read32 = |d: &Drv, off: u64| {
        let mut b = [0u8; 4];
        d.dev.read_config(off, &mut b);
        u32::from_le_bytes(b)
    };
    assert_eq!(read32(&d, 0), 8 << 8, "size_mib=8 as 4 KiB pages");
    assert_eq!(d.stat("balloon.target_pages"), 2048);
    d.ctl.set_target_pages(1000);
    assert_eq!(read32(&d, 0), 1000);
    assert_eq!(d.irq.config(), 1);
    d.ctl.set_target_pages(1000);
    assert_eq!(d.irq.config(), 1, "no change, no interrupt");
    d.ctl.set_target_pages(u64::MAX);
    assert_eq!(d.ctl.target_pages(), PAGES, "clamped to guest RAM");
    assert_eq!(d.irq.config(), 2);
    // The driver writes `actual`; num_pages is not its to write.
    d.dev.write_config(4, &1234u32.to_le_bytes());
    d.dev.write_config(0, &7u32.to_le_bytes());
    d.dev.write_config(5, &[0x10]);
    assert_eq!(
        d.ctl.actual_pages(),
        0x10d2,
        "1234 = 0x4d2 with byte 1 = 0x10"
    );
    assert_eq!(read32(&d, 4), 0x10d2);
    assert_eq!(d.stat("balloon.actual_pages"), 0x10d2);
    assert_eq!(d.ctl.target_pages(), PAGES);
    // Reads past the end and wild offsets are zeros, writes there ignored.
    d.dev.write_config(u64::MAX - 1, &[1, 2, 3, 4]);
    let mut b = [0xffu8; 8];
    d.dev.read_config(14, &mut b);
    assert_eq!(b, [0; 8]);
    // After a reset the driver starts over with an empty balloon and no interrupt to raise.
    d.dev.reset();
    assert_eq!(d.ctl.actual_pages(), 0);
    d.ctl.set_target_pages(10);
    assert_eq!(d.irq.config(), 2);
    d.activate();
    d.ctl.set_target_pages(11);
    assert_eq!(d.irq.config(), 3);
    d.inflate(&[600]);
    assert_eq!(d.stat("balloon.inflated_pages"), 1);
}

#[test]
fn features_queues_and_refusals() {
    let d = Drv::new(all_on());
    let f = d.dev.features();
    assert_ne!(f & VIRTIO_F_VERSION_1, 0);
    for bit in [
        VIRTIO_BALLOON_F_STATS_VQ,
        VIRTIO_BALLOON_F_DEFLATE_ON_OOM,
        VIRTIO_BALLOON_F_PAGE_REPORTING,
    ] {
        assert_ne!(f & bit, 0);
    }
    assert_eq!(
        f & (VIRTIO_BALLOON_F_MUST_TELL_HOST | VIRTIO_BALLOON_F_FREE_PAGE_HINT),
        0
    );
    // Linux's driver refuses ACCESS_PLATFORM: offering it would make FEATURES_OK fail.
    assert_eq!(f & lucid_virtio::features::VIRTIO_F_ACCESS_PLATFORM, 0);
    assert_eq!(d.dev.queue_max_sizes().len(), 4);
    let plain = Balloon::new(
        "b".into(),
        BalloonConfig::default(),
        &REGIONS,
        d.rec.clone(),
        &d.stats,
    )
    .unwrap();
    assert_eq!(plain.features() & 0xff, 0);
    assert_eq!(plain.queue_max_sizes().len(), 2);
    let too_big = Balloon::new(
        "b".into(),
        BalloonConfig {
            size_mib: 49,
            ..BalloonConfig::default()
        },
        &REGIONS,
        d.rec.clone(),
        &d.stats,
    );
    assert!(matches!(too_big, Err(BalloonError::TooBig { .. })));
}
