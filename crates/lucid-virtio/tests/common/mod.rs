//! The test acts as the guest driver: it lays out split rings in real guest RAM, writes
//! descriptors and avail entries, kicks real eventfds and reads the used rings.
#![allow(dead_code)]

pub mod blkdrv;

use std::collections::HashSet;
use std::sync::atomic::{fence, AtomicU64, Ordering};
use std::sync::Arc;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use lucid_mem::vm_memory::{Bytes, GuestAddress};
use lucid_mem::{
    Access, Backing, DeviceId, DmaError, DmaPath, DmaTranslator, FaultReason, GuestMemoryMmap,
    GuestRam,
};
use lucid_stats::StatsRegistry;
use lucid_virtio::virtio_queue::{Queue, QueueT};
use lucid_virtio::{ActivateContext, Coalescing, Notify, VirtioInterrupt};
use vmm_sys_util::eventfd::EventFd;

pub const RAM: u64 = 64 << 20;
pub const DEV_ID: u32 = 0x18;
pub const F_NEXT: u16 = 1;
pub const F_WRITE: u16 = 2;
pub const TIMEOUT: Duration = Duration::from_secs(10);

/// Counts interrupts per queue and configuration interrupts.
#[derive(Default)]
pub struct CountingIrq {
    pub queue: [AtomicU64; 4],
    pub config: AtomicU64,
}

impl VirtioInterrupt for CountingIrq {
    fn signal_queue(&self, queue: u16) {
        self.queue[usize::from(queue) % 4].fetch_add(1, Ordering::SeqCst);
    }
    fn signal_config(&self) {
        self.config.fetch_add(1, Ordering::SeqCst);
    }
}

impl CountingIrq {
    pub fn q(&self, i: usize) -> u64 {
        self.queue[i].load(Ordering::SeqCst)
    }
    pub fn config(&self) -> u64 {
        self.config.load(Ordering::SeqCst)
    }
}

/// Guest RAM, the DMA path, stats and a bump allocator for buffers.
pub struct Guest {
    pub ram: GuestRam,
    pub mem: GuestMemoryMmap,
    pub dma: Arc<DmaPath>,
    pub stats: Arc<StatsRegistry>,
    pub irq: Arc<CountingIrq>,
    heap: u64,
}

impl Guest {
    pub fn new() -> Guest {
        let ram = GuestRam::new(&[(0, RAM)], Backing::Anonymous).unwrap();
        let mem = ram.memory().clone();
        let stats = StatsRegistry::new();
        let dma = DmaPath::new(mem.clone(), &stats);
        Guest {
            ram,
            mem,
            dma,
            stats,
            irq: Arc::new(CountingIrq::default()),
            heap: 1 << 20,
        }
    }

    /// `len` bytes of guest RAM, 16-byte aligned, never reused.
    pub fn alloc(&mut self, len: u64) -> u64 {
        let a = self.heap;
        self.heap = (self.heap + len.max(1) + 15) & !15;
        assert!(self.heap < RAM, "test guest heap exhausted");
        a
    }

    pub fn write(&self, addr: u64, data: &[u8]) {
        self.mem.write_slice(data, GuestAddress(addr)).unwrap();
    }

    pub fn read(&self, addr: u64, len: usize) -> Vec<u8> {
        let mut v = vec![0; len];
        self.mem.read_slice(&mut v, GuestAddress(addr)).unwrap();
        v
    }

    /// A counter of the device's registry; a missing one panics with its name (read as 0, a
    /// renamed counter would pass every `== 0` check).
    pub fn stat(&self, name: &str) -> u64 {
        let snap = self.stats.snapshot();
        *snap
            .get(name)
            .unwrap_or_else(|| panic!("no counter {name} in {snap:?}"))
    }

    pub fn ctx(
        &self,
        queues: Vec<(u16, Queue, EventFd)>,
        features: u64,
        notify: Notify,
        coalescing: Coalescing,
    ) -> ActivateContext {
        ActivateContext {
            mem: self.dma.device_memory(DEV_ID),
            queues,
            interrupt: self.irq.clone(),
            features,
            notify,
            coalescing,
            stats: self.stats.clone(),
            spawner: lucid_thread::Spawner::new(None, self.stats.threads().clone()),
        }
    }
}

/// A fresh guest and `dev` activated, with every feature it offers, on two 256-entry queues:
/// 0 at 0x10000 and 1 at 0x14000 (virtio-net's rx and tx).
pub fn activate_two_queues(
    dev: &mut dyn lucid_virtio::VirtioDevice,
    notify: Notify,
) -> (Guest, Vq, Vq) {
    let g = Guest::new();
    let (q0, (rq, rk)) = Vq::new(&g.mem, 0x10000, 256);
    let (q1, (tq, tk)) = Vq::new(&g.mem, 0x14000, 256);
    let feats = dev.features();
    dev.activate(g.ctx(
        vec![(0, rq, rk), (1, tq, tk)],
        feats,
        notify,
        Coalescing::default(),
    ))
    .unwrap();
    (g, q0, q1)
}

/// The driver's side of one split virtqueue.
pub struct Vq {
    pub mem: GuestMemoryMmap,
    /// What the device's addresses add to guest-physical ones (0 without a translator).
    pub dev_off: u64,
    pub size: u16,
    pub desc: u64,
    pub avail: u64,
    pub used: u64,
    next_desc: u16,
    pub avail_idx: u16,
    pub used_seen: u16,
    pub kick: EventFd,
}

impl Vq {
    /// Lays out a queue of `size` at `base` (16 KiB needed) and returns the driver side and the
    /// device side (a ready `Queue` and the kick eventfd).
    pub fn new(mem: &GuestMemoryMmap, base: u64, size: u16) -> (Vq, (Queue, EventFd)) {
        Self::at(mem, base, size, 0)
    }

    /// [`Vq::new`] for a device that sees guest-physical `a` at `a + dev_off` (behind an
    /// [`OffsetIommu`]): the queue's ring addresses and every descriptor's buffer address are
    /// given to the device as such.
    pub fn at(mem: &GuestMemoryMmap, base: u64, size: u16, dev_off: u64) -> (Vq, (Queue, EventFd)) {
        let desc = base;
        let avail = base + 0x1000;
        let used = base + 0x2000;
        mem.write_slice(&[0u8; 0x4000], GuestAddress(base)).unwrap();
        let mut q = Queue::new(size).unwrap();
        q.set_size(size);
        q.try_set_desc_table_address(GuestAddress(desc + dev_off))
            .unwrap();
        q.try_set_avail_ring_address(GuestAddress(avail + dev_off))
            .unwrap();
        q.try_set_used_ring_address(GuestAddress(used + dev_off))
            .unwrap();
        q.set_ready(true);
        let kick = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        let dev_kick = kick.try_clone().unwrap();
        (
            Vq {
                mem: mem.clone(),
                dev_off,
                size,
                desc,
                avail,
                used,
                next_desc: 0,
                avail_idx: 0,
                used_seen: 0,
                kick,
            },
            (q, dev_kick),
        )
    }

    pub fn write_desc(&self, i: u16, addr: u64, len: u32, flags: u16, next: u16) {
        let mut b = [0u8; 16];
        b[0..8].copy_from_slice(&addr.wrapping_add(self.dev_off).to_le_bytes());
        b[8..12].copy_from_slice(&len.to_le_bytes());
        b[12..14].copy_from_slice(&flags.to_le_bytes());
        b[14..16].copy_from_slice(&next.to_le_bytes());
        self.mem
            .write_slice(&b, GuestAddress(self.desc + 16 * u64::from(i)))
            .unwrap();
    }

    /// Writes a chain of buffers (address, length, device-writable) into free descriptors and
    /// returns its head, without publishing it.
    pub fn chain(&mut self, bufs: &[(u64, u32, bool)]) -> u16 {
        let head = self.next_desc;
        for (k, &(addr, len, w)) in bufs.iter().enumerate() {
            let i = (head + k as u16) % self.size;
            let last = k + 1 == bufs.len();
            let flags = if w { F_WRITE } else { 0 } | if last { 0 } else { F_NEXT };
            self.write_desc(i, addr, len, flags, (i + 1) % self.size);
        }
        self.next_desc = (head + bufs.len() as u16) % self.size;
        head
    }

    /// Puts `head` in the avail ring and publishes the new index.
    pub fn publish(&mut self, head: u16) {
        let slot = self.avail + 4 + 2 * u64::from(self.avail_idx % self.size);
        self.mem
            .write_obj(head.to_le(), GuestAddress(slot))
            .unwrap();
        self.avail_idx = self.avail_idx.wrapping_add(1);
        self.set_avail_idx(self.avail_idx);
    }

    pub fn set_avail_idx(&self, idx: u16) {
        fence(Ordering::SeqCst);
        self.mem
            .store(idx.to_le(), GuestAddress(self.avail + 2), Ordering::Release)
            .unwrap();
        fence(Ordering::SeqCst);
    }

    pub fn add(&mut self, bufs: &[(u64, u32, bool)]) -> u16 {
        let h = self.chain(bufs);
        self.publish(h);
        h
    }

    pub fn kick(&self) {
        self.kick.write(1).unwrap();
    }

    pub fn used_idx(&self) -> u16 {
        fence(Ordering::SeqCst);
        let v: u16 = self
            .mem
            .load(GuestAddress(self.used + 2), Ordering::Acquire)
            .unwrap();
        u16::from_le(v)
    }

    pub fn used_flags(&self) -> u16 {
        u16::from_le(self.mem.read_obj(GuestAddress(self.used)).unwrap())
    }

    /// The device's `avail_event` (EVENT_IDX).
    pub fn avail_event(&self) -> u16 {
        let a = self.used + 4 + 8 * u64::from(self.size);
        u16::from_le(self.mem.read_obj(GuestAddress(a)).unwrap())
    }

    pub fn set_avail_flags(&self, f: u16) {
        self.mem
            .write_obj(f.to_le(), GuestAddress(self.avail))
            .unwrap();
        fence(Ordering::SeqCst);
    }

    /// The driver's `used_event` (EVENT_IDX).
    pub fn set_used_event(&self, v: u16) {
        let a = self.avail + 4 + 2 * u64::from(self.size);
        self.mem.write_obj(v.to_le(), GuestAddress(a)).unwrap();
        fence(Ordering::SeqCst);
    }

    /// Whether a driver following EVENT_IDX would kick after publishing from `old` to
    /// `self.avail_idx` (virtio spec `vring_need_event`).
    pub fn would_kick(&self, old: u16) -> bool {
        let new = self.avail_idx;
        new.wrapping_sub(self.avail_event()).wrapping_sub(1) < new.wrapping_sub(old)
    }

    /// The next used element (id, len), waiting up to `TIMEOUT`.
    pub fn next_used(&mut self) -> Option<(u32, u32)> {
        self.next_used_within(TIMEOUT)
    }

    pub fn next_used_within(&mut self, t: Duration) -> Option<(u32, u32)> {
        let end = Instant::now() + t;
        loop {
            if let Some(u) = self.pop_used() {
                return Some(u);
            }
            if Instant::now() > end {
                return None;
            }
            std::thread::sleep(Duration::from_micros(50));
        }
    }

    /// The next used element (id, len), if the device has put one there.
    pub fn pop_used(&mut self) -> Option<(u32, u32)> {
        if self.used_idx() == self.used_seen {
            return None;
        }
        let slot = self.used + 4 + 8 * u64::from(self.used_seen % self.size);
        let id: u32 = self.mem.read_obj(GuestAddress(slot)).unwrap();
        let len: u32 = self.mem.read_obj(GuestAddress(slot + 4)).unwrap();
        self.used_seen = self.used_seen.wrapping_add(1);
        Some((u32::from_le(id), u32::from_le(len)))
    }
}

/// Waits until `f` holds, up to `TIMEOUT`.
pub fn wait_for(mut f: impl FnMut() -> bool) -> bool {
    let end = Instant::now() + TIMEOUT;
    while !f() {
        if Instant::now() > end {
            return false;
        }
        std::thread::sleep(Duration::from_micros(100));
    }
    true
}

/// A deterministic byte pattern.
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// FNV-1a, for checksums.
pub fn checksum(data: &[u8]) -> u64 {
    data.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    })
}

/// Names of this process's threads.
pub fn thread_names() -> Vec<String> {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|e| std::fs::read_to_string(e.ok()?.path().join("comm")).ok())
        .map(|s| s.trim().to_string())
        .collect()
}

/// A test vIOMMU: IOVA `a + off` is guest-physical `a` for `a` in guest RAM, 4 KiB at a time;
/// other IOVAs, and the IOVA pages in `faults`, fault. Counts its access brackets.
pub struct OffsetIommu {
    pub off: u64,
    pub faults: Mutex<HashSet<u64>>,
    pub begun: AtomicU64,
    pub ended: AtomicU64,
    /// Translations made outside any bracket.
    pub unbracketed: AtomicU64,
    pub translations: AtomicU64,
}

impl OffsetIommu {
    /// Makes the IOVA page holding guest-physical `gpa` fault.
    pub fn unmap_gpa(&self, gpa: u64) {
        self.faults.lock().unwrap().insert((gpa + self.off) >> 12);
    }
    pub fn open(&self) -> u64 {
        self.begun.load(Ordering::SeqCst) - self.ended.load(Ordering::SeqCst)
    }
}

impl DmaTranslator for OffsetIommu {
    fn translate(
        &self,
        dev: DeviceId,
        iova: u64,
        len: u64,
        access: Access,
    ) -> Result<(u64, u64), DmaError> {
        self.translations.fetch_add(1, Ordering::SeqCst);
        if self.open() == 0 {
            self.unbracketed.fetch_add(1, Ordering::SeqCst);
        }
        let fault = |reason| DmaError::Fault {
            dev,
            iova,
            access,
            reason,
        };
        let gpa = iova
            .checked_sub(self.off)
            .filter(|&g| g < RAM)
            .ok_or(fault(FaultReason::NotMapped))?;
        if self.faults.lock().unwrap().contains(&(iova >> 12)) {
            return Err(fault(FaultReason::NotMapped));
        }
        Ok((gpa, len.min(0x1000 - (gpa & 0xfff))))
    }
    fn access_begin(&self) -> u64 {
        self.begun.fetch_add(1, Ordering::SeqCst) + 1
    }
    fn access_end(&self, _token: u64) {
        self.ended.fetch_add(1, Ordering::SeqCst);
    }
}

impl Guest {
    /// Installs an [`OffsetIommu`] with offset `off` in the DMA path.
    pub fn behind_iommu(&self, off: u64) -> Arc<OffsetIommu> {
        let t = Arc::new(OffsetIommu {
            off,
            faults: Mutex::new(HashSet::new()),
            begun: AtomicU64::new(0),
            ended: AtomicU64::new(0),
            unbracketed: AtomicU64::new(0),
            translations: AtomicU64::new(0),
        });
        self.dma.set_translator(Some(t.clone()));
        t
    }

    /// Indices of the guest pages whose contents differ from `before` (a copy of all of RAM).
    pub fn changed_pages(&self, before: &[u8]) -> Vec<u64> {
        let now = self.read(0, RAM as usize);
        (0..RAM / 0x1000)
            .filter(|&p| {
                let r = (p * 0x1000) as usize..((p + 1) * 0x1000) as usize;
                now[r.clone()] != before[r]
            })
            .collect()
    }
}
