//! The virtio-pci transport as a guest drives it: configuration space (0xCF8/0xCFC, ECAM, the
//! VIRTIO_PCI_CAP_PCI_CFG window), the common configuration, ISR, device configuration and
//! notification registers, the MSI-X table, and interrupts the device raises, through the real
//! root complex to a real `VirtioPciDevice` over a stand-in device that checks what activation
//! hands it.
//!
//! Interrupts reach KVM, so this target opens /dev/kvm: one VM with an in-kernel irqchip per
//! process and no vCPU. The transport runs on rung L0 (`KVM_SIGNAL_MSI`, notifications by exit)
//! without INTx: the other rungs register ioeventfds and irqfds with KVM per device, at ~10 ms
//! per ioctl on a loaded PVM host, far too slow for 10^6 inputs (the transport tests cover them).
#![no_main]

use std::sync::{Arc, Mutex, OnceLock};

use libfuzzer_sys::fuzz_target;
use lucid_fuzz::{Access, Pci};
use lucid_hv::{GsiRouter, Vm};
use lucid_mem::{Backing, DmaPath, GuestRam};
use lucid_pci::{attach_virtio, HostCaps, PciWindows, Rung, TransportEnv, TransportOptions};
use lucid_stats::StatsRegistry;
use lucid_virtio::features::{VIRTIO_F_VERSION_1, VIRTIO_RING_F_EVENT_IDX};
use lucid_virtio::virtio_queue::QueueT;
use lucid_virtio::{ActivateContext, ActivateError, VirtioDevice, VirtioInterrupt};

const MMIO: std::ops::Range<u64> = 0xc000_0000..0xc100_0000;
const ECAM: (u64, u64) = (0xe000_0000, 0x10_0000);
const RAM: u64 = 2 << 20;
const MAXES: [u16; 2] = [256, 64];
const OFFERED: u64 = VIRTIO_F_VERSION_1 | VIRTIO_RING_F_EVENT_IDX | 1 << 5;

/// One VM and its RAM per process: KVM calls cost milliseconds here, and the transport only
/// checks ring addresses against RAM, never reads it.
fn host() -> &'static (Vm, GuestRam) {
    static HOST: OnceLock<(Vm, GuestRam)> = OnceLock::new();
    HOST.get_or_init(|| {
        let vm = Vm::new(lucid_hv::open_kvm().expect("virtio_pci needs /dev/kvm")).expect("VM");
        vm.create_irqchip_and_pit().expect("irqchip");
        (
            vm,
            GuestRam::new(&[(0, RAM)], Backing::Anonymous).expect("RAM"),
        )
    })
}

/// A device with two queues whose activation checks what the transport hands over. The guest
/// steers it through its configuration byte 0: bit 0 fails the next activation, bit 1 makes an
/// active device ask for a reset.
struct Stub {
    config: [u8; 8],
    mem_size: u64,
    active: Option<Arc<dyn VirtioInterrupt>>,
    irq: Arc<Mutex<Option<Arc<dyn VirtioInterrupt>>>>,
}

impl VirtioDevice for Stub {
    fn name(&self) -> &str {
        "stub0"
    }
    fn device_type(&self) -> u32 {
        lucid_virtio::device_type::NET
    }
    fn queue_max_sizes(&self) -> &[u16] {
        &MAXES
    }
    fn features(&self) -> u64 {
        OFFERED
    }
    fn read_config(&self, offset: u64, data: &mut [u8]) {
        data.fill(0);
        let from = self.config.get(offset as usize..).unwrap_or_default();
        data.iter_mut().zip(from).for_each(|(d, c)| *d = *c);
    }
    fn write_config(&mut self, offset: u64, data: &[u8]) {
        let to = self.config.get_mut(offset as usize..).unwrap_or_default();
        to.iter_mut().zip(data).for_each(|(c, d)| *c = *d);
    }
    fn activate(&mut self, ctx: ActivateContext) -> Result<(), ActivateError> {
        assert!(self.active.is_none(), "activated twice without a reset");
        assert_eq!(ctx.features & !OFFERED, 0, "features not offered");
        assert_ne!(ctx.features & VIRTIO_F_VERSION_1, 0);
        let mut seen = [false; 2];
        for (i, q, _) in &ctx.queues {
            let i = *i as usize;
            assert!(i < MAXES.len() && !seen[i], "queue {i} handed over twice");
            seen[i] = true;
            assert!(q.ready() && q.is_valid(&ctx.mem), "queue {i}");
            assert!(
                q.size().is_power_of_two() && q.size() <= MAXES[i],
                "queue {i} size"
            );
            for a in [q.desc_table(), q.avail_ring(), q.used_ring()] {
                assert!(a < self.mem_size, "queue {i} ring at {a:#x}");
            }
        }
        if self.config[0] & 1 != 0 {
            // The guest asked for a failure.
            return Err(ActivateError::QueueMissing {
                device: "stub0".into(),
                queue: 2,
            });
        }
        *self.irq.lock().unwrap() = Some(ctx.interrupt.clone());
        self.active = Some(ctx.interrupt);
        Ok(())
    }
    fn reset(&mut self) {
        self.active = None;
        *self.irq.lock().unwrap() = None;
    }
    fn needs_reset(&self) -> bool {
        self.active.is_some() && self.config[0] & 2 != 0
    }
}

// Input: accesses (see [`lucid_fuzz::Access`]) by `kind % 5`: 0, a dword write of 0xCF8 (`val`);
// 1, an access to port 0xCF8 + `sel % 8`; 2, an ECAM access at `addr` into bus 0; 3, an access at
// `addr % 0x4010` into BAR `sel % 6` where it decodes now; 4, the device raises the interrupt of
// queue `sel % 3`, or its configuration interrupt for `sel` 0xffff.
fuzz_target!(|data: &[u8]| {
    let (vm, ram) = host();
    let stats = StatsRegistry::new();
    let env = TransportEnv {
        vm: vm.clone(),
        router: GsiRouter::new(vm.clone()),
        mem: ram.memory().clone(),
        dma: DmaPath::new(ram.memory().clone(), &stats),
        stats: stats.clone(),
        spawner: lucid_thread::Spawner::new(None, stats.threads().clone()),
        host: HostCaps::default(),
    };
    let opts = TransportOptions {
        rung: Rung::L0,
        ..Default::default()
    };
    let windows = PciWindows {
        mmio: MMIO,
        io: 0xc000..0x1_0000,
        ecam: ECAM,
    };
    let pci = Pci::new(windows, &stats);
    let irq = Arc::new(Mutex::new(None));
    let stub = Stub {
        config: [0; 8],
        mem_size: RAM,
        active: None,
        irq: irq.clone(),
    };
    let (addr, _dev) = attach_virtio(&pci.root, Box::new(stub), env, opts).expect("attach");
    for a in Access::parse(data, 128) {
        match a.kind % 5 {
            k @ 0..=2 => pci.config_cycle(k, &a),
            3 => {
                let devices = pci.root.devices();
                let bars = devices
                    .iter()
                    .find(|(p, _, _)| *p == addr)
                    .expect("attached")
                    .2;
                let base = bars[a.sel as usize % 6].unwrap_or(MMIO.start);
                a.on(&pci.mmio, base + a.addr as u64 % 0x4010)
            }
            _ => {
                let irq = irq.lock().unwrap().clone();
                match (irq, a.sel) {
                    (Some(i), 0xffff) => i.signal_config(),
                    (Some(i), q) => i.signal_queue(q % 3),
                    (None, _) => {}
                }
            }
        }
    }
});
