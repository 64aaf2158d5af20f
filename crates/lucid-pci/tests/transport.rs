//! The PCI root and the virtio-pci transport driven as a guest would drive them: configuration
//! cycles through ports 0xCF8/0xCFC and ECAM on the VMM's buses, BAR accesses on the MMIO bus.
//! A dummy virtio device stands in for blk/net. Needs /dev/kvm (for irqfds, routes and MSIs).

mod platform;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use lucid_devices::Bus;
use lucid_pci::config::{BAR0, COMMAND, COMMAND_MEMORY};
use lucid_pci::virtio::{
    common, status, MSIX_BAR, NOTIFY_MULTIPLIER, NOTIFY_OFFSET, NO_VECTOR, VIRTIO_BAR,
};
use lucid_pci::virtio::{ActivationError, QueueField};
use lucid_pci::Rung;
use lucid_pci::{
    attach_virtio, HostCaps, MsiPath, PciRoot, PciWindows, TransportOptions, VirtioPciDevice,
};
use lucid_stats::StatsRegistry;
use lucid_virtio::features::{VIRTIO_F_VERSION_1, VIRTIO_RING_F_EVENT_IDX};
use lucid_virtio::{ActivateContext, ActivateError, Notify, VirtioDevice, VirtioInterrupt};
use platform::{host, Host, ECAM, MMIO_WINDOW, RAM};

/// (queue index, size) of each queue, features, notify mode.
type Activation = (Vec<(u16, u16)>, u64, Notify);

#[derive(Default)]
struct Seen {
    activations: AtomicUsize,
    resets: AtomicUsize,
    last: Mutex<Option<Activation>>,
    irq: Mutex<Option<Arc<dyn VirtioInterrupt>>>,
    /// Refuse DRIVER_OK as a device missing a queue would.
    refuse: std::sync::atomic::AtomicBool,
}

struct Dummy {
    name: String,
    maxes: Vec<u16>,
    config: [u8; 8],
    seen: Arc<Seen>,
}

impl VirtioDevice for Dummy {
    fn name(&self) -> &str {
        &self.name
    }
    fn device_type(&self) -> u32 {
        2
    }
    fn queue_max_sizes(&self) -> &[u16] {
        &self.maxes
    }
    fn features(&self) -> u64 {
        VIRTIO_F_VERSION_1 | VIRTIO_RING_F_EVENT_IDX
    }
    fn read_config(&self, offset: u64, data: &mut [u8]) {
        for (i, b) in data.iter_mut().enumerate() {
            *b = self.config.get(offset as usize + i).copied().unwrap_or(0);
        }
    }
    fn write_config(&mut self, offset: u64, data: &[u8]) {
        for (i, b) in data.iter().enumerate() {
            if let Some(c) = self.config.get_mut(offset as usize + i) {
                *c = *b;
            }
        }
    }
    fn activate(&mut self, ctx: ActivateContext) -> Result<(), ActivateError> {
        use lucid_virtio::virtio_queue::QueueT;
        if self.seen.refuse.load(Ordering::SeqCst) {
            return Err(ActivateError::QueueMissing {
                device: self.name.clone(),
                queue: 3,
            });
        }
        self.seen.activations.fetch_add(1, Ordering::SeqCst);
        let qs = ctx.queues.iter().map(|(i, q, _)| (*i, q.size())).collect();
        *self.seen.last.lock().unwrap() = Some((qs, ctx.features, ctx.notify));
        *self.seen.irq.lock().unwrap() = Some(ctx.interrupt);
        Ok(())
    }
    fn reset(&mut self) {
        self.seen.resets.fetch_add(1, Ordering::SeqCst);
    }
}

fn dummy(name: &str, queues: usize) -> (Box<Dummy>, Arc<Seen>) {
    let seen = Arc::new(Seen::default());
    (
        Box::new(Dummy {
            name: name.into(),
            maxes: vec![256; queues],
            config: *b"LUCIDCFG",
            seen: seen.clone(),
        }),
        seen,
    )
}

fn opts(rung: Rung) -> TransportOptions {
    TransportOptions {
        rung,
        intx_gsi: Some(16),
        ..Default::default()
    }
}

impl Host {
    fn attach(
        &self,
        name: &str,
        queues: usize,
        rung: Rung,
    ) -> (u8, Arc<Seen>, Arc<Mutex<VirtioPciDevice>>) {
        let (d, seen) = dummy(name, queues);
        let (addr, dev) = attach_virtio(&self.root, d, self.env.clone(), opts(rung)).unwrap();
        (addr.slot, seen, dev)
    }
    fn ecam(&self, slot: u8, reg: u64) -> u32 {
        let mut d = [0; 4];
        assert!(self.mmio.read(ECAM + ((slot as u64) << 15) + reg, &mut d));
        u32::from_le_bytes(d)
    }
    fn ecam_write(&self, slot: u8, reg: u64, v: u32) {
        assert!(self
            .mmio
            .write(ECAM + ((slot as u64) << 15) + reg, &v.to_le_bytes()));
    }
    fn bar(&self, slot: u8, i: usize) -> u64 {
        let lo = self.cf8(slot, (BAR0 + 4 * i) as u32) as u64;
        let is64 = lo & 0x6 == 0x4;
        let hi = if is64 {
            self.cf8(slot, (BAR0 + 4 * i + 4) as u32) as u64
        } else {
            0
        };
        hi << 32 | (lo & !0xf)
    }
    fn r(&self, addr: u64, len: usize) -> u64 {
        let mut d = [0u8; 8];
        assert!(
            self.mmio.read(addr, &mut d[..len]),
            "read {addr:#x} unclaimed"
        );
        u64::from_le_bytes(d)
    }
    fn w(&self, addr: u64, len: usize, v: u64) -> bool {
        self.mmio.write(addr, &v.to_le_bytes()[..len])
    }
}

/// Brings a device to DRIVER_OK with every queue at `size`, rings in RAM.
fn drive_to_ok(h: &Host, slot: u8, queues: u16, size: u16) -> u8 {
    let b = h.bar(slot, VIRTIO_BAR);
    h.w(
        b + common::DEVICE_STATUS,
        1,
        (status::ACKNOWLEDGE | status::DRIVER) as u64,
    );
    h.w(b + common::DEVICE_FEATURE_SELECT, 4, 1);
    let hi = h.r(b + common::DEVICE_FEATURE, 4);
    assert_eq!(hi & 1, 1, "VERSION_1 offered");
    h.w(b + common::DRIVER_FEATURE_SELECT, 4, 1);
    h.w(b + common::DRIVER_FEATURE, 4, 1);
    h.w(b + common::DEVICE_STATUS, 1, 0xb);
    assert_eq!(
        h.r(b + common::DEVICE_STATUS, 1) as u8 & status::FEATURES_OK,
        status::FEATURES_OK
    );
    for q in 0..queues {
        h.w(b + common::QUEUE_SELECT, 2, q as u64);
        h.w(b + common::QUEUE_SIZE, 2, size as u64);
        let base = 0x10_0000 + q as u64 * 0x1_0000;
        h.w(b + common::QUEUE_DESC, 4, base);
        h.w(b + common::QUEUE_DESC_HI, 4, 0);
        h.w(b + common::QUEUE_DRIVER, 8, base + 0x4000);
        h.w(b + common::QUEUE_DEVICE, 8, base + 0x8000);
        h.w(b + common::QUEUE_MSIX_VECTOR, 2, q as u64);
        h.w(b + common::QUEUE_ENABLE, 2, 1);
    }
    h.w(b + common::DEVICE_STATUS, 1, 0xf);
    h.r(b + common::DEVICE_STATUS, 1) as u8
}

#[test]
fn cf8_and_ecam_give_the_same_view() {
    let h = host();
    let (slot, _, _) = h.attach("blk0", 1, Rung::L1);
    assert_eq!(slot, 1);
    for s in [0u8, 1, 2, 31] {
        for reg in (0..256).step_by(4) {
            assert_eq!(
                h.cf8(s, reg),
                h.ecam(s, reg as u64),
                "slot {s} reg {reg:#x}"
            );
        }
    }
    assert_eq!(h.cf8(0, 0), 0x0008_1b36, "host bridge");
    assert_eq!(h.cf8(0, 8) >> 8, 0x06_00_00, "bridge class");
    assert_eq!(h.cf8(1, 0), 0x1042_1af4, "virtio-blk modern");
    assert_eq!(h.cf8(1, 8) & 0xff, 1, "revision 1");
    assert_eq!(h.cf8(1, 0x2c), 0x1100_1af4);
    assert_eq!(h.cf8(2, 0), u32::MAX, "empty slot");
    // Extended space only through ECAM; other buses and functions are empty.
    assert_eq!(h.ecam(1, 0x100), 0);
    assert_eq!(h.ecam(1, 1 << 12), u32::MAX);
    let mut d = [0u8; 4];
    assert!(h.mmio.read(ECAM + (1 << 20), &mut d));
    assert_eq!(u32::from_le_bytes(d), u32::MAX);
    // A write through one path shows through the other.
    h.ecam_write(1, 0x3c, 0x0000_0107);
    assert_eq!(h.cf8(1, 0x3c) & 0xff, 0x07);
    h.cf8_write(1, 0x3c, 0x0000_0109);
    assert_eq!(h.ecam(1, 0x3c) & 0xff, 0x09);
    // Disabled 0xCF8 reads all ones; byte reads of 0xCFE work.
    assert!(h.pio.write(0xcf8, &0x0000_0000u32.to_le_bytes()));
    assert!(h.pio.read(0xcfc, &mut d));
    assert_eq!(d, [0xff; 4]);
    assert!(h.pio.write(0xcf8, &(0x8000_0800u32).to_le_bytes()));
    let mut w = [0u8; 2];
    assert!(h.pio.read(0xcfe, &mut w));
    assert_eq!(u16::from_le_bytes(w), 0x1042);
    assert!(h.counter("pci.cf8_reads") > 0 && h.counter("pci.ecam_reads") > 0);
}

#[test]
fn capability_chain_has_the_virtio_caps_and_msix() {
    let h = host();
    let (slot, _, _) = h.attach("net0", 2, Rung::L1);
    assert_ne!(h.cf8(slot, 4) >> 16 & 0x10, 0, "capability list bit");
    let mut p = h.cf8(slot, 0x34) & 0xff;
    let mut found = Vec::new();
    while p != 0 {
        let hdr = h.cf8(slot, p);
        let id = hdr & 0xff;
        if id == 0x09 {
            let cfg_type = (hdr >> 24) as u8;
            let bar = h.cf8(slot, p + 4) & 0xff;
            let off = h.cf8(slot, p + 8);
            let len = h.cf8(slot, p + 12);
            found.push((cfg_type, bar, off, len));
            if cfg_type == 2 {
                assert_eq!(h.cf8(slot, p + 16), NOTIFY_MULTIPLIER);
            }
        } else {
            assert_eq!(id, 0x11);
            let ctrl = hdr >> 16;
            assert_eq!(ctrl & 0x7ff, 2, "3 vectors: 2 queues + config");
            assert_eq!(h.cf8(slot, p + 4), MSIX_BAR as u32);
            assert_eq!(h.cf8(slot, p + 8), 0x800 | MSIX_BAR as u32);
        }
        p = (hdr >> 8) & 0xfc;
    }
    assert_eq!(
        found,
        vec![
            (1, 4, 0, 0x38),
            (2, 4, 0x3000, 8),
            (3, 4, 0x1000, 1),
            (4, 4, 0x2000, 0x1000),
            (5, 0, 0, 0)
        ]
    );
}

#[test]
fn bars_assigned_in_window_and_moved_or_refused() {
    let h = host();
    let (a, _, _) = h.attach("blk0", 1, Rung::L1);
    let (b, _, _) = h.attach("blk1", 2, Rung::L1);
    for s in [a, b] {
        assert_ne!(
            h.cf8(s, COMMAND as u32) as u16 & COMMAND_MEMORY,
            0,
            "decoding on"
        );
        for (i, size) in [(MSIX_BAR, 0x1000u64), (VIRTIO_BAR, 0x4000)] {
            let base = h.bar(s, i);
            assert!(
                MMIO_WINDOW.contains(&base) && base.is_multiple_of(size),
                "{base:#x}"
            );
        }
    }
    // Size probing: all ones, read back, restore.
    let reg = (BAR0 + 4 * MSIX_BAR) as u32;
    let orig = h.cf8(a, reg);
    h.cf8_write(a, reg, u32::MAX);
    assert_eq!(h.cf8(a, reg), !0xfff);
    h.cf8_write(a, reg, orig);
    assert_eq!(h.bar(a, MSIX_BAR), orig as u64);
    let msix_a = h.bar(a, MSIX_BAR);
    assert!(h.w(msix_a, 4, 0xfee0_0000), "remapped after sizing");

    // Move a's virtio BAR to a free spot: the old range goes, the new one decodes, and the
    // ioeventfds follow.
    let old = h.bar(a, VIRTIO_BAR);
    let new = 0xc800_0000u64;
    let reg4 = (BAR0 + 4 * VIRTIO_BAR) as u32;
    h.cf8_write(a, reg4, new as u32 | 0x4);
    h.cf8_write(a, reg4 + 4, 0);
    assert_eq!(h.bar(a, VIRTIO_BAR), new);
    assert!(!h.mmio.read(old, &mut [0u8; 2]));
    assert_eq!(h.r(new + common::NUM_QUEUES, 2), 1);
    assert_eq!(h.counter("blk0.notify.ioeventfds_registered"), 1);

    // Overlapping the other device's BAR, the ECAM, RAM, or outside the window: refused, the
    // BAR decodes nothing, the other device is untouched.
    let refused = h.counter("pci.bar_refused");
    let other = h.bar(b, VIRTIO_BAR);
    for bad in [other, ECAM, 0x1000, 0xfee0_0000, 0xd000_0000, 0xffff_c000] {
        h.cf8_write(a, reg4, bad as u32 | 4);
        assert_eq!(
            h.r(other + common::NUM_QUEUES, 2),
            2,
            "b still there after {bad:#x}"
        );
    }
    assert!(h.counter("pci.bar_refused") >= refused + 5);
    assert_eq!(
        h.counter("blk0.notify.ioeventfds_registered"),
        0,
        "no ioeventfd at a refused address"
    );
    assert_eq!(h.ecam(b, 0) & 0xffff, 0x1af4, "ECAM still decodes");
    // A 64-bit BAR above 4 GiB (over RAM's high range) is refused too.
    h.cf8_write(a, reg4, 0xc800_0004);
    h.cf8_write(a, reg4 + 4, 1);
    assert!(!h.mmio.read(0x1_c800_0000, &mut [0u8; 1]));
    // Back to a good address: decodes again.
    h.cf8_write(a, reg4 + 4, 0);
    assert_eq!(h.r(0xc800_0000 + common::NUM_QUEUES, 2), 1);
    // Memory decoding off: nothing decodes; on: back.
    let cmd = h.cf8(a, 4) & 0xffff;
    h.cf8_write(a, 4, cmd & !(COMMAND_MEMORY as u32));
    assert!(!h.mmio.read(0xc800_0000, &mut [0u8; 2]));
    h.cf8_write(a, 4, cmd);
    assert_eq!(h.r(0xc800_0000 + common::NUM_QUEUES, 2), 1);
    assert_eq!(h.counter("blk0.notify.ioeventfds_registered"), 1);
    let names: Vec<String> = h.root.devices().into_iter().map(|d| d.1).collect();
    assert_eq!(names, ["host-bridge", "blk0", "blk1"]);
}

#[test]
fn feature_negotiation_and_status_machine() {
    let h = host();
    let (slot, seen, dev) = h.attach("blk0", 1, Rung::L1);
    let b = h.bar(slot, VIRTIO_BAR);
    h.w(b + common::DEVICE_STATUS, 1, 3);
    // A driver that does not accept VERSION_1 is refused.
    h.w(b + common::DRIVER_FEATURE_SELECT, 4, 0);
    h.w(b + common::DRIVER_FEATURE, 4, VIRTIO_RING_F_EVENT_IDX);
    h.w(b + common::DEVICE_STATUS, 1, 0xb);
    assert_eq!(h.r(b + common::DEVICE_STATUS, 1), 3, "FEATURES_OK refused");
    // Nor one that asks for a feature not offered.
    h.w(b + common::DRIVER_FEATURE_SELECT, 4, 1);
    h.w(b + common::DRIVER_FEATURE, 4, 1 | 2);
    h.w(b + common::DEVICE_STATUS, 1, 0xb);
    assert_eq!(h.r(b + common::DEVICE_STATUS, 1), 3);
    assert_eq!(h.counter("blk0.virtio.features_refused"), 2);
    // DRIVER_OK without FEATURES_OK is not taken.
    h.w(b + common::DEVICE_STATUS, 1, 7);
    assert_eq!(h.r(b + common::DEVICE_STATUS, 1), 3);
    h.w(b + common::DRIVER_FEATURE, 4, 1);
    h.w(b + common::DEVICE_STATUS, 1, 0xb);
    assert_eq!(h.r(b + common::DEVICE_STATUS, 1), 0xb);
    // Features freeze after FEATURES_OK.
    h.w(b + common::DRIVER_FEATURE, 4, 0);
    assert_eq!(h.r(b + common::DRIVER_FEATURE, 4), 1);
    // Clearing a bit other than by reset is ignored.
    h.w(b + common::DEVICE_STATUS, 1, 1);
    assert_eq!(h.r(b + common::DEVICE_STATUS, 1), 0xb);
    // Reset, then the whole dance.
    h.w(b + common::DEVICE_STATUS, 1, 0);
    assert_eq!(h.r(b + common::DEVICE_STATUS, 1), 0);
    assert_eq!(seen.resets.load(Ordering::SeqCst), 0, "never activated");
    assert_eq!(drive_to_ok(&h, slot, 1, 128), 0xf);
    assert_eq!(seen.activations.load(Ordering::SeqCst), 1);
    let (qs, feats, notify) = seen.last.lock().unwrap().clone().unwrap();
    assert_eq!(qs, vec![(0, 128)]);
    assert_eq!(feats, VIRTIO_F_VERSION_1);
    assert_eq!(notify, Notify::Kicks);
    // Queue fields are frozen while live.
    h.w(b + common::QUEUE_SIZE, 2, 64);
    assert_eq!(h.r(b + common::QUEUE_SIZE, 2), 128);
    // Device config window.
    assert_eq!(h.r(b + 0x2000, 4), u32::from_le_bytes(*b"LUCI") as u64);
    h.w(b + 0x2004, 1, b'X' as u64);
    assert_eq!(h.r(b + 0x2004, 1), b'X' as u64);
    // Reset stops the device and clears everything.
    h.w(b + common::DEVICE_STATUS, 1, 0);
    assert_eq!(seen.resets.load(Ordering::SeqCst), 1);
    assert_eq!(h.r(b + common::QUEUE_ENABLE, 2), 0);
    assert_eq!(h.r(b + common::QUEUE_MSIX_VECTOR, 2), NO_VECTOR as u64);
    assert_eq!(h.r(b + common::QUEUE_SIZE, 2), 256);
    drop(dev);
}

#[test]
fn bad_queues_set_needs_reset() {
    let h = host();
    let (slot, seen, dev) = h.attach("blk0", 1, Rung::L1);
    let b = h.bar(slot, VIRTIO_BAR);
    let why = || format!("{:?}", dev.lock().unwrap().activation_error());
    for size in [0u16, 3, 100, 512, 0xffff] {
        h.w(b + common::DEVICE_STATUS, 1, 0);
        assert_eq!(why(), "None", "a reset forgets the last failure");
        let st = drive_to_ok(&h, slot, 1, size);
        assert_eq!(st & status::NEEDS_RESET, status::NEEDS_RESET, "size {size}");
        assert!(
            matches!(
                dev.lock().unwrap().activation_error(),
                Some(ActivationError::Queue { queue: 0, what: QueueField::Size(s), .. }) if *s == size
            ),
            "size {size}: {}",
            why()
        );
    }
    // Rings outside guest memory, or straddling its end, or misaligned.
    for (desc, drv, devr) in [
        (RAM, 0x1000, 0x2000),
        (RAM - 0x10, 0x1000, 0x2000),
        (0x1000, 0x2000, u64::MAX - 3),
        (0x1008, 0x2000, 0x3000),
        (0x1000, 0x2001, 0x3000),
    ] {
        h.w(b + common::DEVICE_STATUS, 1, 0);
        h.w(b + common::DEVICE_STATUS, 1, 3);
        h.w(b + common::DRIVER_FEATURE_SELECT, 4, 1);
        h.w(b + common::DRIVER_FEATURE, 4, 1);
        h.w(b + common::DEVICE_STATUS, 1, 0xb);
        h.w(b + common::QUEUE_SELECT, 2, 0);
        h.w(b + common::QUEUE_DESC, 8, desc);
        h.w(b + common::QUEUE_DRIVER, 8, drv);
        h.w(b + common::QUEUE_DEVICE, 8, devr);
        h.w(b + common::QUEUE_ENABLE, 2, 1);
        h.w(b + common::DEVICE_STATUS, 1, 0xf);
        let st = h.r(b + common::DEVICE_STATUS, 1) as u8;
        assert_ne!(st & status::NEEDS_RESET, 0, "{desc:#x} {drv:#x} {devr:#x}");
        // The reason names the queue and the address at fault.
        let e = dev
            .lock()
            .unwrap()
            .activation_error()
            .map(|e| e.to_string());
        let e = e.expect("a reason");
        assert!(e.starts_with("queue 0: "), "{e}");
        let at_fault = [desc, drv, devr]
            .iter()
            .any(|a| e.contains(&format!("{a:#x}")));
        assert!(at_fault, "{e}");
        // Further status writes cannot get it going.
        h.w(b + common::DEVICE_STATUS, 1, (st | 4) as u64);
    }
    assert_eq!(seen.activations.load(Ordering::SeqCst), 0);
    assert_eq!(h.counter("blk0.virtio.needs_reset"), 10);
    assert_eq!(h.counter("blk0.virtio.activation_failed"), 10);
    // Selecting a queue that does not exist: reads 0, writes ignored.
    h.w(b + common::DEVICE_STATUS, 1, 0);
    h.w(b + common::QUEUE_SELECT, 2, 7);
    assert_eq!(h.r(b + common::QUEUE_SIZE, 2), 0);
    h.w(b + common::QUEUE_ENABLE, 2, 1);
    h.w(b + common::QUEUE_MSIX_VECTOR, 2, 0);
    // Vectors the device does not have read back as NO_VECTOR.
    h.w(b + common::QUEUE_SELECT, 2, 0);
    h.w(b + common::QUEUE_MSIX_VECTOR, 2, 9);
    assert_eq!(h.r(b + common::QUEUE_MSIX_VECTOR, 2), NO_VECTOR as u64);
    // A good setup still works afterwards.
    h.w(b + common::DEVICE_STATUS, 1, 0);
    assert_eq!(drive_to_ok(&h, slot, 1, 256), 0xf);
    assert_eq!(seen.activations.load(Ordering::SeqCst), 1);
}

/// A device that refuses DRIVER_OK: its reason reaches the transport intact, the status says
/// DEVICE_NEEDS_RESET and the driver gets a configuration change interrupt (virtio 1.2, 2.1.2).
#[test]
fn a_refused_activation_keeps_its_reason() {
    let h = host();
    let (slot, seen, dev) = h.attach("blk0", 1, Rung::L0);
    enable_msix(&h, slot);
    program_vector(&h, slot, 0, 0x4040, false);
    let b = h.bar(slot, VIRTIO_BAR);
    h.w(b + common::CONFIG_MSIX_VECTOR, 2, 0);
    seen.refuse.store(true, Ordering::SeqCst);
    let msi_before = h.counter("blk0.irq.msi_signal");
    let st = drive_to_ok(&h, slot, 1, 256);
    assert_eq!(st & status::NEEDS_RESET, status::NEEDS_RESET);
    assert_eq!(
        h.counter("blk0.irq.msi_signal"),
        msi_before + 1,
        "config interrupt"
    );
    assert_eq!(h.counter("blk0.virtio.activation_failed"), 1);
    match dev.lock().unwrap().activation_error() {
        Some(ActivationError::Device(ActivateError::QueueMissing { device, queue: 3 })) => {
            assert_eq!(device, "blk0")
        }
        e => panic!("{e:?}"),
    }
    h.w(b + common::DEVICE_STATUS, 1, 0);
    seen.refuse.store(false, Ordering::SeqCst);
    assert_eq!(drive_to_ok(&h, slot, 1, 256), 0xf);
    assert!(dev.lock().unwrap().activation_error().is_none());
}

/// A notify address whose ioeventfd KVM refuses (here: taken by another eventfd) falls back to
/// the notify exit, which kicks the same queue; the reason is counted and logged.
#[test]
fn a_refused_ioeventfd_falls_back_to_the_notify_exit() {
    use vmm_sys_util::eventfd::EventFd;
    let h = host();
    // The first device's virtio BAR (the largest) goes at the window's start.
    let squatter = EventFd::new(0).unwrap();
    let queue0 = MMIO_WINDOW.start + NOTIFY_OFFSET;
    h.vm.register_ioeventfd(&squatter, lucid_hv::IoAddr::Mmio(queue0))
        .unwrap();
    let (slot, _, dev) = h.attach("net0", 2, Rung::L1);
    let b = h.bar(slot, VIRTIO_BAR);
    assert_eq!(b + NOTIFY_OFFSET, queue0);
    assert_eq!(h.counter("net0.notify.ioeventfd_failed"), 1);
    assert_eq!(h.counter("net0.notify.ioeventfds_registered"), 1);
    // The notify write reaches the transport (the exit path) and kicks queue 0.
    assert!(h.w(queue0, 2, 0));
    assert_eq!(h.counter("net0.notify.exit"), 1);
    assert_eq!(dev.lock().unwrap().kick(0).unwrap().read().unwrap(), 1);
}

/// BAR space comes from vm-allocator: a device whose BAR cannot be mapped (a platform device
/// squats there) gets an error naming the address, and its space goes back to the window for
/// the next device; a window too small says how much was asked.
#[test]
fn bar_space_is_returned_when_an_attach_fails() {
    struct Squatter;
    impl lucid_devices::BusDevice for Squatter {
        fn read(&mut self, _: u64, _: &mut [u8]) {}
        fn write(&mut self, _: u64, _: &[u8]) {}
    }
    let h = host();
    let start = MMIO_WINDOW.start;
    h.mmio
        .insert(start, 0x4000, "squatter", Arc::new(Mutex::new(Squatter)))
        .unwrap();
    let (d, _) = dummy("blk0", 1);
    let e = attach_virtio(&h.root, d, h.env.clone(), opts(Rung::L1)).err();
    assert!(
        matches!(
            e,
            Some(lucid_pci::PciError::BarOverlaps { bar: VIRTIO_BAR, base, .. }) if base == start
        ),
        "{e:?}"
    );
    assert!(h.mmio.remove(start));
    let (slot, _, _) = h.attach("blk1", 1, Rung::L1);
    assert_eq!(
        h.bar(slot, VIRTIO_BAR),
        start,
        "the failed attach's space was returned"
    );

    // A window with room for one device's BARs, not two.
    let stats = StatsRegistry::new();
    let small = PciRoot::new(
        Arc::new(Bus::new()),
        Arc::new(Bus::new()),
        PciWindows {
            mmio: start..start + 0x8000,
            io: 0xc000..0x1_0000,
            ecam: (ECAM, 0x1000_0000),
        },
        &stats,
    );
    let (d, _) = dummy("blk2", 1);
    attach_virtio(&small, d, h.env.clone(), opts(Rung::L0)).unwrap();
    let (d, _) = dummy("blk3", 1);
    match attach_virtio(&small, d, h.env.clone(), opts(Rung::L0)).err() {
        Some(lucid_pci::PciError::NoSpace {
            device, bar, size, ..
        }) => {
            assert_eq!((device.as_str(), bar, size), ("blk3", VIRTIO_BAR, 0x4000))
        }
        e => panic!("{e:?}"),
    }
}

fn enable_msix(h: &Host, slot: u8) -> u32 {
    // The MSI-X capability is the last in the chain.
    let mut p = h.cf8(slot, 0x34) & 0xff;
    loop {
        let hdr = h.cf8(slot, p);
        if hdr & 0xff == 0x11 {
            h.cf8_write(slot, p, 0x8000 << 16);
            return p;
        }
        p = (hdr >> 8) & 0xfc;
    }
}

fn program_vector(h: &Host, slot: u8, v: u64, data: u32, masked: bool) {
    let t = h.bar(slot, MSIX_BAR) + v * 16;
    h.w(t, 4, 0xfee0_0000);
    h.w(t + 4, 4, 0);
    h.w(t + 8, 4, data as u64);
    h.w(t + 12, 4, masked as u64);
}

fn msix_rung(rung: Rung, path: MsiPath, counter: &str) {
    let h = host();
    let (slot, seen, dev) = h.attach("net0", 2, rung);
    assert_eq!(dev.lock().unwrap().interrupts().path(), path);
    assert_eq!(drive_to_ok(&h, slot, 2, 256), 0xf);
    let irq = seen.irq.lock().unwrap().clone().unwrap();
    // MSI-X still disabled: INTx with the ISR bit.
    irq.signal_queue(0);
    assert_eq!(h.counter("net0.irq.intx"), 1);
    let isr = h.bar(slot, VIRTIO_BAR) + 0x1000;
    assert_eq!(h.r(isr, 1), 1);
    assert_eq!(h.r(isr, 1), 0, "read clears");
    let cap = enable_msix(&h, slot);
    program_vector(&h, slot, 0, 0x31, false);
    program_vector(&h, slot, 1, 0x32, true);
    irq.signal_queue(0);
    assert_eq!(h.counter(counter), 1);
    // Vector 1 is masked: pending, then delivered on unmask.
    irq.signal_queue(1);
    assert_eq!(h.counter(counter), 1);
    assert_eq!(h.counter("net0.irq.masked_pending"), 1);
    let pba = h.bar(slot, MSIX_BAR) + 0x800;
    assert_eq!(h.r(pba, 8), 0b10);
    h.w(h.bar(slot, MSIX_BAR) + 16 + 12, 4, 0);
    assert_eq!(h.counter(counter), 2);
    assert_eq!(h.r(pba, 8), 0);
    // Function mask holds everything back.
    h.cf8_write(slot, cap, 0xc000 << 16);
    irq.signal_queue(0);
    assert_eq!(h.counter(counter), 2);
    assert_eq!(h.r(pba, 8), 0b01);
    h.cf8_write(slot, cap, 0x8000 << 16);
    assert_eq!(h.counter(counter), 3);
    // The config vector is unset: nothing goes out, counted.
    irq.signal_config();
    assert_eq!(h.counter("net0.irq.no_vector"), 1);
    assert_eq!(
        h.r(h.bar(slot, VIRTIO_BAR) + common::CONFIG_GENERATION, 1),
        1
    );
    if path == MsiPath::Irqfd {
        let d = dev.lock().unwrap();
        let gsi = d.interrupts().gsi(0).unwrap();
        assert_eq!(h.env.router.route(gsi).unwrap().data, 0x31);
    }
    // Garbage in the table does not hurt: odd addresses and data route or signal without error
    // to the VMM, and odd-sized writes are ignored.
    let t = h.bar(slot, MSIX_BAR);
    h.w(t, 4, 0xdead_beef);
    h.w(t + 4, 4, 0xffff_ffff);
    h.w(t + 8, 2, 0x1234);
    h.w(t + 3, 4, 1);
    irq.signal_queue(0);
    let _ = &h.vm;
}

/// Records what it is asked to remap and blocks vector data 0x66.
#[derive(Default)]
struct Recorder(Mutex<Vec<(u16, lucid_hv::MsiMessage)>>);

impl lucid_hv::MsiRemapper for Recorder {
    fn remap(&self, source: u16, msg: lucid_hv::MsiMessage) -> Option<lucid_hv::MsiMessage> {
        self.0.lock().unwrap().push((source, msg));
        (msg.data != 0x66).then_some(msg)
    }
}

/// With an interrupt remapper installed, MSI-X messages reach it with the function's requester
/// ID: on L0 each signalled MSI, on L1 each route the guest programs; a blocked route installs
/// nothing.
#[test]
fn msix_messages_carry_the_requester_id_to_the_remapper() {
    for rung in [Rung::L0, Rung::L1] {
        let h = host();
        let rec = Arc::new(Recorder::default());
        h.env.router.set_remapper(Some(rec.clone()));
        let (slot, seen, dev) = h.attach("net0", 2, rung);
        let rid = u16::from(slot) << 3;
        assert_eq!(dev.lock().unwrap().interrupts().requester_id(), rid);
        assert_eq!(drive_to_ok(&h, slot, 2, 256), 0xf);
        let irq = seen.irq.lock().unwrap().clone().unwrap();
        enable_msix(&h, slot);
        program_vector(&h, slot, 0, 0x31, false);
        program_vector(&h, slot, 1, 0x66, false);
        irq.signal_queue(0);
        let got = rec.0.lock().unwrap().clone();
        assert!(
            got.iter().any(|(s, m)| *s == rid && m.data == 0x31),
            "{rung:?}: {got:?}"
        );
        assert!(got.iter().all(|(s, _)| *s == rid), "{rung:?}: {got:?}");
        if rung == Rung::L1 {
            let d = dev.lock().unwrap();
            let (g0, g1) = (
                d.interrupts().gsi(0).unwrap(),
                d.interrupts().gsi(1).unwrap(),
            );
            assert_eq!(h.env.router.installed(g0).unwrap().data, 0x31);
            assert_eq!(h.env.router.route(g1).unwrap().data, 0x66);
            assert_eq!(h.env.router.installed(g1), None, "blocked: no route");
            assert_eq!(h.env.router.blocked(), 1);
        }
    }
}

#[test]
fn msix_l0_signals_msi() {
    msix_rung(Rung::L0, MsiPath::SignalMsi, "net0.irq.msi_signal");
}

#[test]
fn msix_l1_uses_irqfd_routes() {
    msix_rung(Rung::L1, MsiPath::Irqfd, "net0.irq.irqfd");
}

#[test]
fn l0_notify_exit_kicks_the_queue() {
    let h = host();
    let (slot, _, dev) = h.attach("net0", 2, Rung::L0);
    let b = h.bar(slot, VIRTIO_BAR);
    assert!(h.w(b + NOTIFY_OFFSET + NOTIFY_MULTIPLIER as u64, 2, 1));
    assert!(h.w(b + NOTIFY_OFFSET + NOTIFY_MULTIPLIER as u64, 2, 1));
    assert_eq!(h.counter("net0.notify.exit"), 2);
    let d = dev.lock().unwrap();
    assert_eq!(d.kick(1).unwrap().read().unwrap(), 2);
    assert!(d.kick(0).unwrap().read().is_err(), "queue 0 not kicked");
    assert_eq!(
        h.counter("net0.notify.ioeventfds_registered"),
        0,
        "L0 has no ioeventfds"
    );
}

#[test]
fn rungs_plan_as_documented() {
    use lucid_pci::ladder::plan;
    let none = HostCaps::default();
    assert!(plan(Rung::L3, none, 0).is_err());
    let l3 = plan(
        Rung::L3,
        HostCaps {
            posted_interrupts: true,
            ..none
        },
        0,
    )
    .unwrap();
    assert!(l3.ioeventfd && l3.msi == MsiPath::Irqfd);
    let l2 = plan(Rung::L2, none, 0).unwrap();
    assert!(l2.pv_eoi && !l2.pv_eoi_effective);
    let l2 = plan(
        Rung::L2,
        HostCaps {
            cpuid_intercepted: true,
            ..none
        },
        0,
    )
    .unwrap();
    assert!(l2.pv_eoi_effective);
    let l4 = plan(Rung::L4 { guest_polls: true }, none, 5).unwrap();
    assert_eq!(l4.notify, Notify::Poll { idle_sleep_us: 5 });
    assert!(l4.ioeventfd);
    let l0 = plan(Rung::L0, none, 0).unwrap();
    assert!(!l0.ioeventfd && l0.msi == MsiPath::SignalMsi);
    // The transport refuses L3 here with the same error.
    let h = host();
    let (d, _) = dummy("blk0", 1);
    let e = VirtioPciDevice::new(d, h.env.clone(), opts(Rung::L3))
        .err()
        .unwrap();
    assert!(e.to_string().contains("posted interrupts"), "{e}");
}

#[test]
fn l4_passes_poll_to_the_device() {
    let h = host();
    let (slot, seen, _dev) = h.attach("blk0", 1, Rung::L4 { guest_polls: false });
    assert_eq!(drive_to_ok(&h, slot, 1, 64), 0xf);
    let (_, _, notify) = seen.last.lock().unwrap().clone().unwrap();
    assert!(matches!(notify, Notify::Poll { .. }));
    assert_eq!(h.counter("blk0.rung"), 4);
}

#[test]
fn pci_cfg_capability_window_reaches_the_bar() {
    let h = host();
    let (slot, _, _) = h.attach("net0", 2, Rung::L1);
    let mut p = h.cf8(slot, 0x34) & 0xff;
    let cap = loop {
        let hdr = h.cf8(slot, p);
        if hdr & 0xff == 9 && hdr >> 24 == 5 {
            break p;
        }
        p = (hdr >> 8) & 0xfc;
    };
    h.cf8_write(slot, cap + 4, VIRTIO_BAR as u32);
    h.cf8_write(slot, cap + 8, common::NUM_QUEUES as u32);
    h.cf8_write(slot, cap + 12, 2);
    assert_eq!(h.cf8(slot, cap + 16) & 0xffff, 2);
}

#[test]
fn hostile_config_and_bar_garbage_never_panics() {
    let h = host();
    let (a, _, _) = h.attach("blk0", 1, Rung::L1);
    let (_b, _, _) = h.attach("net0", 2, Rung::L0);
    let mut x: u64 = 0x1234_5678_9abc_def1;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    for _ in 0..20_000 {
        let r = next();
        let slot = (r % 4) as u8;
        let reg = ((r >> 8) % 256) as u32 & !3;
        let v = next() as u32;
        match r >> 60 {
            0..=5 => h.cf8_write(slot, reg, v),
            6..=9 => {
                let _ = h.cf8(slot, reg);
            }
            10 | 11 => h.ecam_write(slot, ((r >> 16) % 0x1000) & !3, v),
            _ => {
                // Anywhere in the PCI window, any size.
                let addr = MMIO_WINDOW.start + (next() % 0x10_0000);
                let len = [1usize, 2, 4, 8][(r % 4) as usize];
                let _ = h.w(addr, len, next());
                let _ = h.mmio.read(addr, &mut [0u8; 8][..len]);
            }
        }
    }
    // The root and its host bridge still answer; device a still enumerates.
    assert_eq!(h.cf8(0, 0), 0x0008_1b36);
    assert_eq!(h.cf8(a, 0), 0x1042_1af4);
    // No two mapped BARs overlap.
    let mut ranges: Vec<(u64, u64)> = h
        .mmio
        .ranges()
        .into_iter()
        .map(|(b, l, _)| (b, l))
        .collect();
    ranges.sort();
    for w in ranges.windows(2) {
        assert!(w[0].0 + w[0].1 <= w[1].0, "{ranges:x?}");
    }
    for (b, l) in ranges {
        assert!((b >= MMIO_WINDOW.start && b + l <= MMIO_WINDOW.end) || b == ECAM);
    }
}

#[test]
fn dropping_the_root_drops_and_resets_active_devices() {
    let h = host();
    let (slot, seen, dev) = h.attach("blk0", 1, Rung::L1);
    assert_eq!(drive_to_ok(&h, slot, 1, 64), 0xf);
    drop(dev);
    let Host {
        root, mmio, pio, ..
    } = h;
    drop(root);
    // The access handlers stay on the buses but answer all ones once the root is gone.
    let mut d = [0u8; 4];
    assert!(pio.write(0xcf8, &0x8000_0800u32.to_le_bytes()));
    assert!(pio.read(0xcfc, &mut d));
    assert_eq!(d, [0xff; 4]);
    // The BAR ranges still hold the device; unmapping them drops it, which resets it.
    for (base, _, name) in mmio.ranges() {
        if name.starts_with("blk0") {
            mmio.remove(base);
        }
    }
    assert_eq!(seen.resets.load(Ordering::SeqCst), 1, "reset on drop");
}

/// IOVA = guest-physical + `IOVA_OFFSET`; anything below faults.
struct Offset;
const IOVA_OFFSET: u64 = 1 << 40;
impl lucid_mem::DmaTranslator for Offset {
    fn translate(
        &self,
        dev: u32,
        iova: u64,
        len: u64,
        access: lucid_mem::Access,
    ) -> Result<(u64, u64), lucid_mem::DmaError> {
        match iova.checked_sub(IOVA_OFFSET) {
            Some(gpa) => Ok((gpa, len.min(0x1000 - (gpa & 0xfff)))),
            None => Err(lucid_mem::DmaError::Fault {
                dev,
                iova,
                access,
                reason: lucid_mem::FaultReason::NotMapped,
            }),
        }
    }
}

/// Negotiates `driver_hi` as the high feature word (low word 0) and sets up queue 0 at
/// `base` (a device address); returns the status after FEATURES_OK and after DRIVER_OK.
fn negotiate(h: &Host, slot: u8, driver_hi: u64, base: u64) -> (u8, u8) {
    let b = h.bar(slot, VIRTIO_BAR);
    h.w(b + common::DEVICE_STATUS, 1, 0);
    h.w(b + common::DEVICE_STATUS, 1, 3);
    h.w(b + common::DRIVER_FEATURE_SELECT, 4, 0);
    h.w(b + common::DRIVER_FEATURE, 4, 0);
    h.w(b + common::DRIVER_FEATURE_SELECT, 4, 1);
    h.w(b + common::DRIVER_FEATURE, 4, driver_hi);
    h.w(b + common::DEVICE_STATUS, 1, 0xb);
    let features_ok = h.r(b + common::DEVICE_STATUS, 1) as u8;
    h.w(b + common::QUEUE_SELECT, 2, 0);
    h.w(b + common::QUEUE_SIZE, 2, 64);
    h.w(b + common::QUEUE_DESC, 8, base);
    h.w(b + common::QUEUE_DRIVER, 8, base + 0x4000);
    h.w(b + common::QUEUE_DEVICE, 8, base + 0x8000);
    h.w(b + common::QUEUE_ENABLE, 2, 1);
    h.w(b + common::DEVICE_STATUS, 1, 0xf);
    (features_ok, h.r(b + common::DEVICE_STATUS, 1) as u8)
}

fn device_features(h: &Host, slot: u8) -> u64 {
    let b = h.bar(slot, VIRTIO_BAR);
    h.w(b + common::DEVICE_FEATURE_SELECT, 4, 0);
    let lo = h.r(b + common::DEVICE_FEATURE, 4);
    h.w(b + common::DEVICE_FEATURE_SELECT, 4, 1);
    lo | h.r(b + common::DEVICE_FEATURE, 4) << 32
}

#[test]
fn access_platform_only_behind_a_translator() {
    use lucid_virtio::features::VIRTIO_F_ACCESS_PLATFORM;
    // No translator: the features are the device's and VERSION_1, as before.
    let h = host();
    let (slot, seen, _dev) = h.attach("blk0", 1, Rung::L1);
    assert_eq!(
        device_features(&h, slot),
        VIRTIO_F_VERSION_1 | VIRTIO_RING_F_EVENT_IDX
    );
    assert_eq!(negotiate(&h, slot, 1, 0x10_0000), (0xb, 0xf));
    assert_eq!(seen.activations.load(Ordering::SeqCst), 1);
    assert_eq!(h.counter("blk0.virtio.features_refused"), 0);

    // A translator installed before the transport is built: ACCESS_PLATFORM is offered and
    // required, and the rings are checked in the device's IOVA space.
    let h = host();
    h.env.dma.set_translator(Some(Arc::new(Offset)));
    let (slot, seen, dev) = h.attach("blk0", 1, Rung::L1);
    assert_eq!(
        device_features(&h, slot),
        VIRTIO_F_VERSION_1 | VIRTIO_RING_F_EVENT_IDX | VIRTIO_F_ACCESS_PLATFORM
    );
    // Without ACCESS_PLATFORM: FEATURES_OK stays clear, DRIVER_OK is not taken.
    // (The DRIVER_OK write sets FEATURES_OK again: refused again.)
    assert_eq!(negotiate(&h, slot, 1, IOVA_OFFSET + 0x10_0000), (3, 3));
    assert_eq!(h.counter("blk0.virtio.features_refused"), 2);
    assert_eq!(seen.activations.load(Ordering::SeqCst), 0);
    // Rings at guest-physical addresses the device cannot reach: activation refused.
    assert_eq!(
        negotiate(&h, slot, 3, 0x10_0000),
        (0xb, 0xf | status::NEEDS_RESET)
    );
    assert!(matches!(
        dev.lock().unwrap().activation_error(),
        Some(ActivationError::RingsOutsideMemory { .. })
    ));
    // Rings at mapped IOVAs: accepted, with ACCESS_PLATFORM negotiated.
    assert_eq!(negotiate(&h, slot, 3, IOVA_OFFSET + 0x10_0000), (0xb, 0xf));
    assert_eq!(seen.activations.load(Ordering::SeqCst), 1);
    let (_, feats, _) = seen.last.lock().unwrap().clone().unwrap();
    assert_eq!(feats, VIRTIO_F_VERSION_1 | VIRTIO_F_ACCESS_PLATFORM);
    assert_eq!(h.counter("blk0.virtio.features_refused"), 2);
}
