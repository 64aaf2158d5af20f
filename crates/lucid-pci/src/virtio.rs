//! The virtio-pci modern transport (virtio 1.x, spec 4.1) for any [`VirtioDevice`], with the
//! device's rung of the exit ladder.
//!
//! Layout (the same as QEMU's, so that a driver written against either finds the same thing):
//! BAR 1 is a 32-bit MMIO BAR with the MSI-X table (offset 0) and PBA (0x800); BAR 4 is a 64-bit
//! MMIO BAR with the common configuration (0x0000), ISR (0x1000), device configuration (0x2000)
//! and notifications (0x3000, queue `q` at `q * 4`). Vector 0..queues-1 are free for the
//! driver to use; the device has `queues + 1` vectors.
//!
//! Rungs (decided by [`crate::ladder::plan`]):
//! - L0: kicks are MMIO exits to userspace, which this transport turns into writes to the
//!   queue's kick eventfd; interrupts go out with `KVM_SIGNAL_MSI`.
//! - L1: an ioeventfd on each queue's notify address (the kick never leaves the kernel);
//!   interrupts by irqfd on a GSI routed to the vector's MSI message.
//! - L2: L1, and the VM offers PV EOI in CPUID; effective only where the guest reads the VMM's
//!   CPUID (`<dev>.pv_eoi.effective`).
//! - L3: L1 on a host with posted interrupts (APICv/AVIC), where KVM posts irqfd interrupts into
//!   the running vCPU. Refused with [`PciError::Rung`] where the host lacks them.
//! - L4: L1 plus `Notify::Poll` to the device (its thread polls the avail rings with guest
//!   notifications suppressed); L4p (`guest_polls`) is the same here: the guest's driver chooses
//!   to poll and to set `VRING_AVAIL_F_NO_INTERRUPT`; interrupts it asks for are still sent.

use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};

use lucid_hv::{GsiRouter, IoAddr, Vm};
use lucid_mem::{DmaPath, GuestMemoryMmap};
use lucid_stats::{Counter, StatsRegistry};
use lucid_virtio::features::{
    VIRTIO_F_ACCESS_PLATFORM, VIRTIO_F_VERSION_1, VIRTIO_RING_F_EVENT_IDX,
};
use lucid_virtio::{
    device_type, ActivateContext, ActivateError, Coalescing, VirtioDevice, VirtioInterrupt,
};
use virtio_queue::{Queue, QueueT};
use vm_memory::GuestAddress;
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::config::{
    touches, Bar, BarKind, ConfigSpace, PciIds, CAP_ID_VENDOR, COMMAND, COMMAND_INTX_DISABLE,
};
use crate::ladder::{self, HostCaps, Rung, RungPlan};
use crate::msix::{self, Interrupts};
use crate::root::PciDevice;
use crate::PciError;

pub const VIRTIO_PCI_VENDOR: u16 = 0x1af4;
pub const VIRTIO_PCI_DEVICE_BASE: u16 = 0x1040;
pub const NO_VECTOR: u16 = 0xffff;

/// Device status bits.
pub mod status {
    pub const ACKNOWLEDGE: u8 = 1;
    pub const DRIVER: u8 = 2;
    pub const DRIVER_OK: u8 = 4;
    pub const FEATURES_OK: u8 = 8;
    pub const NEEDS_RESET: u8 = 0x40;
    pub const FAILED: u8 = 0x80;
}

/// virtio_pci_cap cfg_type values.
pub mod cap_type {
    pub const COMMON: u8 = 1;
    pub const NOTIFY: u8 = 2;
    pub const ISR: u8 = 3;
    pub const DEVICE: u8 = 4;
    pub const PCI_CFG: u8 = 5;
}

pub const MSIX_BAR: usize = 1;
pub const VIRTIO_BAR: usize = 4;
pub const MSIX_BAR_SIZE: u64 = 0x1000;
pub const MSIX_PBA_OFFSET: u64 = 0x800;
pub const VIRTIO_BAR_SIZE: u64 = 0x4000;
pub const COMMON_OFFSET: u64 = 0x0000;
pub const COMMON_LEN: u64 = 0x38;
pub const ISR_OFFSET: u64 = 0x1000;
pub const DEVICE_OFFSET: u64 = 0x2000;
pub const DEVICE_LEN: u64 = 0x1000;
pub const NOTIFY_OFFSET: u64 = 0x3000;
pub const NOTIFY_MULTIPLIER: u32 = 4;
/// Most vectors the MSI-X BAR layout holds (table below the PBA).
pub const MAX_VECTORS: u16 = (MSIX_PBA_OFFSET / msix::MSIX_ENTRY_SIZE) as u16;

/// Common configuration register offsets.
pub mod common {
    pub const DEVICE_FEATURE_SELECT: u64 = 0x00;
    pub const DEVICE_FEATURE: u64 = 0x04;
    pub const DRIVER_FEATURE_SELECT: u64 = 0x08;
    pub const DRIVER_FEATURE: u64 = 0x0c;
    pub const CONFIG_MSIX_VECTOR: u64 = 0x10;
    pub const NUM_QUEUES: u64 = 0x12;
    pub const DEVICE_STATUS: u64 = 0x14;
    pub const CONFIG_GENERATION: u64 = 0x15;
    pub const QUEUE_SELECT: u64 = 0x16;
    pub const QUEUE_SIZE: u64 = 0x18;
    pub const QUEUE_MSIX_VECTOR: u64 = 0x1a;
    pub const QUEUE_ENABLE: u64 = 0x1c;
    pub const QUEUE_NOTIFY_OFF: u64 = 0x1e;
    pub const QUEUE_DESC: u64 = 0x20;
    pub const QUEUE_DRIVER: u64 = 0x28;
    pub const QUEUE_DEVICE: u64 = 0x30;
    pub const QUEUE_DESC_HI: u64 = 0x24;
    pub const QUEUE_DRIVER_HI: u64 = 0x2c;
    pub const QUEUE_DEVICE_HI: u64 = 0x34;
}

/// Per-device transport options.
#[derive(Clone, Copy, Debug, Default)]
pub struct TransportOptions {
    pub rung: Rung,
    pub coalescing: Coalescing,
    /// L4: how long the polling thread sleeps when idle (0 spins).
    pub poll_idle_us: u32,
    /// IOAPIC pin for INTx (when the driver leaves MSI-X disabled).
    pub intx_gsi: Option<u32>,
}

/// What the VM gives every transport.
#[derive(Clone)]
pub struct TransportEnv {
    pub vm: Vm,
    pub router: Arc<GsiRouter>,
    /// Guest-physical memory, for the transport's own needs; the device's rings and data go
    /// through `dma` (its translator, when a vIOMMU is installed, must be installed before the
    /// transport is built: the transport offers `VIRTIO_F_ACCESS_PLATFORM` then).
    pub mem: GuestMemoryMmap,
    pub dma: Arc<DmaPath>,
    pub stats: Arc<StatsRegistry>,
    /// Starts the devices' back-end threads.
    pub spawner: lucid_thread::Spawner,
    pub host: HostCaps,
}

/// The transport's side of [`VirtioInterrupt`]: the queue → vector map the driver wrote and the
/// interrupt delivery.
pub struct VirtioPciInterrupt {
    interrupts: Arc<Interrupts>,
    queue_vectors: Vec<AtomicU16>,
    config_vector: AtomicU16,
    intx_allowed: AtomicBool,
    config_generation: AtomicU8,
    no_vector: Arc<Counter>,
}

impl VirtioPciInterrupt {
    fn raise(&self, vector: u16, isr_bit: u8) {
        if self.interrupts.msix_enabled() {
            if vector == NO_VECTOR {
                self.no_vector.inc();
            } else {
                self.interrupts.trigger(vector);
            }
        } else {
            self.interrupts
                .trigger_intx(isr_bit, self.intx_allowed.load(Ordering::Acquire));
        }
    }
}

impl VirtioInterrupt for VirtioPciInterrupt {
    fn signal_queue(&self, queue: u16) {
        let v = self
            .queue_vectors
            .get(queue as usize)
            .map_or(NO_VECTOR, |v| v.load(Ordering::Acquire));
        self.raise(v, 1);
    }

    fn queue_irqfd(&self, queue: u16) -> Option<EventFd> {
        let v = self
            .queue_vectors
            .get(queue as usize)?
            .load(Ordering::Acquire);
        if v == NO_VECTOR || !self.interrupts.msix_enabled() {
            return None;
        }
        self.interrupts.irqfd(v)
    }

    fn signal_config(&self) {
        self.config_generation.fetch_add(1, Ordering::AcqRel);
        // The config-change ISR bit is set whatever the interrupt mode (spec 4.1.4.5.1).
        self.interrupts.set_isr(2);
        self.raise(self.config_vector.load(Ordering::Acquire), 2);
    }
}

/// Why DRIVER_OK did not start the device. The transport then sets DEVICE_NEEDS_RESET, sends a
/// configuration change interrupt (virtio 1.2, 2.1.2), logs the reason and counts it in
/// `<dev>.virtio.activation_failed`; [`VirtioPciDevice::activation_error`] keeps the last one.
#[derive(Debug, thiserror::Error)]
pub enum ActivationError {
    #[error("queue {queue}: {what} rejected by the queue: {source}")]
    Queue {
        queue: u16,
        what: QueueField,
        #[source]
        source: virtio_queue::Error,
    },
    #[error(
        "queue {queue}: rings outside guest memory or not mapped for the device (descriptors \
         {desc:#x}, driver area {driver:#x}, device area {device:#x}, size {size})"
    )]
    RingsOutsideMemory {
        queue: u16,
        desc: u64,
        driver: u64,
        device: u64,
        size: u16,
    },
    #[error("queue {queue}: cannot share its kick eventfd with the device: {source}")]
    Kick {
        queue: u16,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Device(#[from] ActivateError),
}

/// The queue setting a driver wrote that virtio-queue refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QueueField {
    MaxSize(u16),
    Size(u16),
    DescTable(u64),
    DriverArea(u64),
    DeviceArea(u64),
}

impl std::fmt::Display for QueueField {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            QueueField::MaxSize(v) => write!(f, "maximum size {v}"),
            QueueField::Size(v) => write!(f, "size {v}"),
            QueueField::DescTable(a) => write!(f, "descriptor table address {a:#x}"),
            QueueField::DriverArea(a) => write!(f, "driver area address {a:#x}"),
            QueueField::DeviceArea(a) => write!(f, "device area address {a:#x}"),
        }
    }
}

#[derive(Clone, Copy, Debug)]
struct QueueCfg {
    max: u16,
    size: u16,
    enabled: bool,
    desc: u64,
    driver: u64,
    device: u64,
}

impl QueueCfg {
    fn new(max: u16) -> Self {
        QueueCfg {
            max,
            size: max,
            enabled: false,
            desc: 0,
            driver: 0,
            device: 0,
        }
    }
}

struct Counters {
    notify_exit: Arc<Counter>,
    config_reads: Arc<Counter>,
    config_writes: Arc<Counter>,
    common_accesses: Arc<Counter>,
    device_cfg_accesses: Arc<Counter>,
    bad_accesses: Arc<Counter>,
    activations: Arc<Counter>,
    activation_failed: Arc<Counter>,
    resets: Arc<Counter>,
    needs_reset: Arc<Counter>,
    features_refused: Arc<Counter>,
    ioeventfds: Arc<Counter>,
    ioeventfd_failed: Arc<Counter>,
}

/// A virtio device on PCI.
pub struct VirtioPciDevice {
    name: String,
    device: Box<dyn VirtioDevice>,
    cfg: ConfigSpace,
    msix_cap: usize,
    pci_cfg_cap: usize,
    irq: Arc<VirtioPciInterrupt>,
    env: TransportEnv,
    plan: RungPlan,
    opts: TransportOptions,
    rid: u16,
    offered: u64,
    device_feature_select: u32,
    driver_feature_select: u32,
    driver_features: u64,
    status: u8,
    queue_select: u16,
    queues: Vec<QueueCfg>,
    kicks: Vec<EventFd>,
    /// Where the notify ioeventfds are registered (the virtio BAR's base).
    ioeventfds_at: Option<u64>,
    /// Per queue: its notify ioeventfd is registered at `ioeventfds_at`.
    ioeventfd_on: Vec<bool>,
    activated: bool,
    activation_error: Option<ActivationError>,
    counters: Counters,
}

impl VirtioPciDevice {
    pub fn new(
        device: Box<dyn VirtioDevice>,
        env: TransportEnv,
        opts: TransportOptions,
    ) -> Result<Self, PciError> {
        let name = device.name().to_string();
        let plan = ladder::plan(opts.rung, env.host, opts.poll_idle_us)?;
        let maxes = device.queue_max_sizes().to_vec();
        if maxes.is_empty() || maxes.len() >= MAX_VECTORS as usize {
            return Err(PciError::QueueCount {
                device: name,
                queues: maxes.len(),
                max: MAX_VECTORS as usize - 1,
            });
        }
        if let Some(m) = maxes
            .iter()
            .find(|&&m| m == 0 || !m.is_power_of_two() || m > 32768)
        {
            return Err(PciError::QueueMaxSize {
                device: name,
                size: *m,
            });
        }
        let vectors = maxes.len() as u16 + 1;
        let dtype = device.device_type();
        let class = match dtype {
            device_type::BLOCK => (0x01, 0x00, 0x00),
            device_type::NET => (0x02, 0x00, 0x00),
            _ => (0xff, 0x00, 0x00),
        };
        let mut cfg = ConfigSpace::new(PciIds {
            vendor: VIRTIO_PCI_VENDOR,
            device: VIRTIO_PCI_DEVICE_BASE + dtype as u16,
            revision: 1,
            class,
            subsystem_vendor: VIRTIO_PCI_VENDOR,
            subsystem: 0x1100,
        });
        cfg.add_bar(
            MSIX_BAR,
            Bar {
                kind: BarKind::Mmio32 {
                    prefetchable: false,
                },
                size: MSIX_BAR_SIZE,
            },
        )?;
        cfg.add_bar(
            VIRTIO_BAR,
            Bar {
                kind: BarKind::Mmio64 {
                    prefetchable: false,
                },
                size: VIRTIO_BAR_SIZE,
            },
        )?;
        let vcap = |t: u8, off: u64, len: u64| -> Vec<u8> {
            let mut b = vec![16, t, VIRTIO_BAR as u8, 0, 0, 0];
            b.extend_from_slice(&(off as u32).to_le_bytes());
            b.extend_from_slice(&(len as u32).to_le_bytes());
            b
        };
        cfg.add_capability(
            CAP_ID_VENDOR,
            &vcap(cap_type::COMMON, COMMON_OFFSET, COMMON_LEN),
            &[],
        )?;
        let mut notify = vcap(
            cap_type::NOTIFY,
            NOTIFY_OFFSET,
            maxes.len() as u64 * NOTIFY_MULTIPLIER as u64,
        );
        notify[0] = 20;
        notify.extend_from_slice(&NOTIFY_MULTIPLIER.to_le_bytes());
        cfg.add_capability(CAP_ID_VENDOR, &notify, &[])?;
        cfg.add_capability(CAP_ID_VENDOR, &vcap(cap_type::ISR, ISR_OFFSET, 1), &[])?;
        cfg.add_capability(
            CAP_ID_VENDOR,
            &vcap(cap_type::DEVICE, DEVICE_OFFSET, DEVICE_LEN),
            &[],
        )?;
        // VIRTIO_PCI_CAP_PCI_CFG: a window onto the BARs through config space. bar, offset,
        // length and data are writable.
        let mut pcfg = vcap(cap_type::PCI_CFG, 0, 0);
        pcfg[0] = 20;
        pcfg[2] = 0;
        pcfg.extend_from_slice(&[0; 4]);
        let mut wm = vec![0u8; pcfg.len()];
        wm[2] = 0xff;
        wm[6..18].fill(0xff);
        let pci_cfg_cap = cfg.add_capability(CAP_ID_VENDOR, &pcfg, &wm)?;
        let msix_cap =
            msix::add_capability(&mut cfg, vectors, MSIX_BAR as u8, 0, MSIX_PBA_OFFSET as u32)?;
        cfg.set_interrupt(opts.intx_gsi.unwrap_or(0xff) as u8, 1);

        let interrupts = Interrupts::new(
            env.vm.clone(),
            vectors,
            plan.msi,
            Some(env.router.clone()),
            opts.intx_gsi,
            &name,
            &env.stats,
        )?;
        let irq = Arc::new(VirtioPciInterrupt {
            interrupts,
            queue_vectors: maxes.iter().map(|_| AtomicU16::new(NO_VECTOR)).collect(),
            config_vector: AtomicU16::new(NO_VECTOR),
            intx_allowed: AtomicBool::new(true),
            config_generation: AtomicU8::new(0),
            no_vector: env.stats.counter(format!("{name}.irq.no_vector")),
        });
        let kicks = maxes
            .iter()
            .map(|_| EventFd::new(EFD_NONBLOCK))
            .collect::<Result<Vec<_>, _>>()
            .map_err(PciError::EventFd)?;
        let s = &env.stats;
        let c = |n: &str| s.counter(format!("{name}.{n}"));
        let counters = Counters {
            notify_exit: c("notify.exit"),
            config_reads: c("pci.config_reads"),
            config_writes: c("pci.config_writes"),
            common_accesses: c("virtio.common_accesses"),
            device_cfg_accesses: c("virtio.device_cfg_accesses"),
            bad_accesses: c("virtio.bad_accesses"),
            activations: c("virtio.activations"),
            activation_failed: c("virtio.activation_failed"),
            resets: c("virtio.resets"),
            needs_reset: c("virtio.needs_reset"),
            features_refused: c("virtio.features_refused"),
            ioeventfds: c("notify.ioeventfds_registered"),
            ioeventfd_failed: c("notify.ioeventfd_failed"),
        };
        c("rung").set(plan.rung.code());
        c("pv_eoi.offered").set(plan.pv_eoi as u64);
        c("pv_eoi.effective").set(plan.pv_eoi_effective as u64);
        // Behind a vIOMMU the device's addresses are IOVAs: the driver must know (virtio 6.1).
        let mut offered = device.features() | VIRTIO_F_VERSION_1;
        if env.dma.has_translator() {
            offered |= VIRTIO_F_ACCESS_PLATFORM;
        }
        Ok(VirtioPciDevice {
            name,
            device,
            cfg,
            msix_cap,
            pci_cfg_cap,
            irq,
            plan,
            opts,
            rid: 0,
            offered,
            device_feature_select: 0,
            driver_feature_select: 0,
            driver_features: 0,
            status: 0,
            queue_select: 0,
            queues: maxes.iter().map(|&m| QueueCfg::new(m)).collect(),
            kicks,
            ioeventfds_at: None,
            ioeventfd_on: vec![false; maxes.len()],
            activated: false,
            activation_error: None,
            counters,
            env,
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }
    pub fn plan(&self) -> RungPlan {
        self.plan
    }
    pub fn status(&self) -> u8 {
        self.status
    }
    /// Why the last DRIVER_OK failed (cleared by a reset).
    pub fn activation_error(&self) -> Option<&ActivationError> {
        self.activation_error.as_ref()
    }
    pub fn interrupts(&self) -> &Arc<Interrupts> {
        &self.irq.interrupts
    }
    /// The kick eventfd of queue `q` (what the ioeventfd or the notify exit signals).
    pub fn kick(&self, q: usize) -> Option<&EventFd> {
        self.kicks.get(q)
    }

    fn notify_addr(base: u64, q: usize) -> u64 {
        base + NOTIFY_OFFSET + q as u64 * NOTIFY_MULTIPLIER as u64
    }

    /// Moves the notify ioeventfds to the virtio BAR at `base` (or removes them). A queue whose
    /// registration fails keeps working through the notify exit, which this transport turns
    /// into the same kick (the L0 path): the reason is logged and counted in
    /// `notify.ioeventfd_failed`, and the driver sees no difference.
    fn set_ioeventfds(&mut self, base: Option<u64>) {
        if !self.plan.ioeventfd || base == self.ioeventfds_at {
            return;
        }
        if let Some(old) = self.ioeventfds_at.take() {
            for (q, k) in self.kicks.iter().enumerate() {
                if !std::mem::take(&mut self.ioeventfd_on[q]) {
                    continue;
                }
                let addr = Self::notify_addr(old, q);
                match self.env.vm.unregister_ioeventfd(k, IoAddr::Mmio(addr)) {
                    Ok(()) => self
                        .counters
                        .ioeventfds
                        .set(self.counters.ioeventfds.get().saturating_sub(1)),
                    Err(e) => log::error!(
                        "{}: queue {q}: cannot remove the notify ioeventfd at {addr:#x}: {e}",
                        self.name
                    ),
                }
            }
        }
        if let Some(new) = base {
            for (q, k) in self.kicks.iter().enumerate() {
                let addr = Self::notify_addr(new, q);
                match self.env.vm.register_ioeventfd(k, IoAddr::Mmio(addr)) {
                    Ok(()) => {
                        self.ioeventfd_on[q] = true;
                        self.counters.ioeventfds.inc();
                    }
                    Err(e) => {
                        self.counters.ioeventfd_failed.inc();
                        log::warn!(
                            "{}: queue {q}: no notify ioeventfd at {addr:#x} ({e}); its \
                             notifications take the userspace exit",
                            self.name
                        );
                    }
                }
            }
            self.ioeventfds_at = Some(new);
        }
    }

    fn reset_device(&mut self) {
        if self.activated {
            self.device.reset();
            self.activated = false;
        }
        self.counters.resets.inc();
        self.activation_error = None;
        self.status = 0;
        self.device_feature_select = 0;
        self.driver_feature_select = 0;
        self.driver_features = 0;
        self.queue_select = 0;
        for q in &mut self.queues {
            *q = QueueCfg::new(q.max);
        }
        for v in &self.irq.queue_vectors {
            v.store(NO_VECTOR, Ordering::Release);
        }
        self.irq.config_vector.store(NO_VECTOR, Ordering::Release);
        self.irq.interrupts.read_isr();
        for k in &self.kicks {
            let _ = k.read();
        }
    }

    fn write_status(&mut self, v: u8) {
        if v == 0 {
            self.reset_device();
            return;
        }
        if self.activated && self.device.needs_reset() {
            self.status |= status::NEEDS_RESET;
        }
        let old = self.status;
        let v = (v & !status::NEEDS_RESET) | (old & status::NEEDS_RESET);
        if v & old != old {
            // A driver must not clear bits except by writing 0.
            self.counters.bad_accesses.inc();
            return;
        }
        let mut v = v;
        let new = v & !old;
        if new & status::FEATURES_OK != 0 {
            let f = self.driver_features;
            // With ACCESS_PLATFORM offered, a driver that did not accept it would hand the
            // device guest-physical addresses where it expects IOVAs (virtio 6.1: the device
            // may fail FEATURES_OK).
            let platform = self.offered & VIRTIO_F_ACCESS_PLATFORM;
            if f & !self.offered != 0 || f & VIRTIO_F_VERSION_1 == 0 || f & platform != platform {
                self.counters.features_refused.inc();
                v &= !status::FEATURES_OK;
            }
        }
        if new & status::DRIVER_OK != 0 {
            if v & status::FEATURES_OK == 0 || old & status::NEEDS_RESET != 0 {
                v &= !status::DRIVER_OK;
                self.counters.bad_accesses.inc();
            } else if let Err(e) = self.activate() {
                // A guest can repeat this at will: the first one is an error, the rest detail.
                if self.counters.activation_failed.get() == 0 {
                    log::error!("{}: DRIVER_OK refused, device needs reset: {e}", self.name);
                } else {
                    log::debug!("{}: DRIVER_OK refused, device needs reset: {e}", self.name);
                }
                self.counters.activation_failed.inc();
                self.activation_error = Some(e);
                self.counters.needs_reset.inc();
                v |= status::NEEDS_RESET;
                self.status = v;
                self.irq.signal_config();
                return;
            }
        }
        self.status = v;
    }

    /// DRIVER_OK: validate the queues against guest memory and start the device.
    fn activate(&mut self) -> Result<(), ActivationError> {
        let event_idx = self.driver_features & VIRTIO_RING_F_EVENT_IDX != 0;
        // The rings are in the device's address space (IOVAs behind a vIOMMU).
        let mem = self.env.dma.device_memory(u32::from(self.rid));
        let mut queues = Vec::new();
        for (i, qc) in self.queues.iter().enumerate() {
            if !qc.enabled {
                continue;
            }
            let queue = i as u16;
            let refused = |what| {
                move |source| ActivationError::Queue {
                    queue,
                    what,
                    source,
                }
            };
            let mut q = Queue::new(qc.max).map_err(refused(QueueField::MaxSize(qc.max)))?;
            q.try_set_size(qc.size)
                .map_err(refused(QueueField::Size(qc.size)))?;
            q.try_set_desc_table_address(GuestAddress(qc.desc))
                .map_err(refused(QueueField::DescTable(qc.desc)))?;
            q.try_set_avail_ring_address(GuestAddress(qc.driver))
                .map_err(refused(QueueField::DriverArea(qc.driver)))?;
            q.try_set_used_ring_address(GuestAddress(qc.device))
                .map_err(refused(QueueField::DeviceArea(qc.device)))?;
            q.set_event_idx(event_idx);
            q.set_ready(true);
            if !q.is_valid(&mem) {
                return Err(ActivationError::RingsOutsideMemory {
                    queue,
                    desc: qc.desc,
                    driver: qc.driver,
                    device: qc.device,
                    size: qc.size,
                });
            }
            let kick = self.kicks[i]
                .try_clone()
                .map_err(|source| ActivationError::Kick { queue, source })?;
            queues.push((queue, q, kick));
        }
        let ctx = ActivateContext {
            mem,
            queues,
            interrupt: self.irq.clone(),
            features: self.driver_features,
            notify: self.plan.notify,
            coalescing: self.opts.coalescing,
            stats: self.env.stats.clone(),
            spawner: self.env.spawner.clone(),
        };
        self.device.activate(ctx)?;
        self.activated = true;
        self.counters.activations.inc();
        Ok(())
    }

    fn queue(&mut self) -> Option<&mut QueueCfg> {
        self.queues.get_mut(self.queue_select as usize)
    }

    fn common_read(&mut self, off: u64, data: &mut [u8]) {
        use common::*;
        self.counters.common_accesses.inc();
        let len = data.len();
        let sel = self.queue_select as usize;
        let q = self.queues.get(sel).copied();
        let v: u64 = match (off, len) {
            (DEVICE_FEATURE_SELECT, 4) => self.device_feature_select as u64,
            (DEVICE_FEATURE, 4) => match self.device_feature_select {
                0 => self.offered & 0xffff_ffff,
                1 => self.offered >> 32,
                _ => 0,
            },
            (DRIVER_FEATURE_SELECT, 4) => self.driver_feature_select as u64,
            (DRIVER_FEATURE, 4) => match self.driver_feature_select {
                0 => self.driver_features & 0xffff_ffff,
                1 => self.driver_features >> 32,
                _ => 0,
            },
            (CONFIG_MSIX_VECTOR, 2) => self.irq.config_vector.load(Ordering::Acquire) as u64,
            (NUM_QUEUES, 2) => self.queues.len() as u64,
            (DEVICE_STATUS, 1) => {
                if self.activated && self.device.needs_reset() {
                    self.status |= status::NEEDS_RESET;
                }
                self.status as u64
            }
            (CONFIG_GENERATION, 1) => self.irq.config_generation.load(Ordering::Acquire) as u64,
            (QUEUE_SELECT, 2) => self.queue_select as u64,
            (QUEUE_SIZE, 2) => q.map_or(0, |q| q.size as u64),
            (QUEUE_MSIX_VECTOR, 2) => {
                self.irq
                    .queue_vectors
                    .get(sel)
                    .map_or(NO_VECTOR, |v| v.load(Ordering::Acquire)) as u64
            }
            (QUEUE_ENABLE, 2) => q.map_or(0, |q| q.enabled as u64),
            (QUEUE_NOTIFY_OFF, 2) => q.map_or(0, |_| sel as u64),
            (QUEUE_DESC, 4 | 8) => q.map_or(0, |q| q.desc),
            (QUEUE_DESC_HI, 4) => q.map_or(0, |q| q.desc >> 32),
            (QUEUE_DRIVER, 4 | 8) => q.map_or(0, |q| q.driver),
            (QUEUE_DRIVER_HI, 4) => q.map_or(0, |q| q.driver >> 32),
            (QUEUE_DEVICE, 4 | 8) => q.map_or(0, |q| q.device),
            (QUEUE_DEVICE_HI, 4) => q.map_or(0, |q| q.device >> 32),
            _ => {
                self.counters.bad_accesses.inc();
                0
            }
        };
        data.copy_from_slice(&v.to_le_bytes()[..len]);
    }

    fn common_write(&mut self, off: u64, data: &[u8]) {
        use common::*;
        self.counters.common_accesses.inc();
        let mut b = [0u8; 8];
        b[..data.len()].copy_from_slice(data);
        let v = u64::from_le_bytes(b);
        // Queue fields are frozen once the queue is enabled or the device is live.
        let live = self.status & status::DRIVER_OK != 0;
        let set_half = |old: u64, hi: bool, len: usize| -> u64 {
            match (hi, len) {
                (_, 8) => v,
                (false, _) => (old & !0xffff_ffff) | (v & 0xffff_ffff),
                (true, _) => (old & 0xffff_ffff) | (v << 32),
            }
        };
        let len = data.len();
        match (off, len) {
            (DEVICE_FEATURE_SELECT, 4) => self.device_feature_select = v as u32,
            (DRIVER_FEATURE_SELECT, 4) => self.driver_feature_select = v as u32,
            (DRIVER_FEATURE, 4) if self.status & status::FEATURES_OK == 0 => {
                match self.driver_feature_select {
                    0 => self.driver_features = (self.driver_features & !0xffff_ffff) | v,
                    1 => self.driver_features = (self.driver_features & 0xffff_ffff) | v << 32,
                    _ => {}
                }
            }
            (CONFIG_MSIX_VECTOR, 2) => self
                .irq
                .config_vector
                .store(self.vector_or_none(v as u16), Ordering::Release),
            (DEVICE_STATUS, 1) => self.write_status(v as u8),
            (QUEUE_SELECT, 2) => self.queue_select = v as u16,
            (QUEUE_MSIX_VECTOR, 2) => {
                let vec = self.vector_or_none(v as u16);
                if let Some(slot) = self.irq.queue_vectors.get(self.queue_select as usize) {
                    slot.store(vec, Ordering::Release);
                }
            }
            (QUEUE_SIZE, 2) => match self.queue() {
                Some(q) if !q.enabled && !live => q.size = v as u16,
                _ => self.counters.bad_accesses.inc(),
            },
            (QUEUE_ENABLE, 2) => match self.queue() {
                // Writing 0 is not allowed (queue reset is a separate feature Lucid lacks).
                Some(q) if v == 1 && !live => q.enabled = true,
                _ => self.counters.bad_accesses.inc(),
            },
            (QUEUE_DESC | QUEUE_DRIVER | QUEUE_DEVICE, 4 | 8)
            | (QUEUE_DESC_HI | QUEUE_DRIVER_HI | QUEUE_DEVICE_HI, 4) => {
                let base = off & !7;
                let hi = off & 4 != 0;
                match self.queues.get_mut(self.queue_select as usize) {
                    Some(q) if !q.enabled && !live => {
                        let field = match base {
                            QUEUE_DESC => &mut q.desc,
                            QUEUE_DRIVER => &mut q.driver,
                            _ => &mut q.device,
                        };
                        *field = set_half(*field, hi, len);
                    }
                    _ => self.counters.bad_accesses.inc(),
                }
            }
            _ => self.counters.bad_accesses.inc(),
        }
    }

    /// A vector the device has, or NO_VECTOR (which the driver reads back as the failure).
    fn vector_or_none(&self, v: u16) -> u16 {
        if v < self.irq.interrupts.vectors() {
            v
        } else {
            NO_VECTOR
        }
    }

    fn virtio_bar_read(&mut self, off: u64, data: &mut [u8]) {
        data.fill(0);
        match off {
            o if o < COMMON_OFFSET + COMMON_LEN => self.common_read(o, data),
            ISR_OFFSET => {
                if let Some(b) = data.first_mut() {
                    *b = self.irq.interrupts.read_isr();
                }
            }
            o if (DEVICE_OFFSET..DEVICE_OFFSET + DEVICE_LEN).contains(&o)
                && o + data.len() as u64 <= DEVICE_OFFSET + DEVICE_LEN =>
            {
                self.counters.device_cfg_accesses.inc();
                self.device.read_config(o - DEVICE_OFFSET, data);
            }
            _ => {}
        }
    }

    fn virtio_bar_write(&mut self, off: u64, data: &[u8]) {
        match off {
            o if o < COMMON_OFFSET + COMMON_LEN => self.common_write(o, data),
            o if (DEVICE_OFFSET..DEVICE_OFFSET + DEVICE_LEN).contains(&o)
                && o + data.len() as u64 <= DEVICE_OFFSET + DEVICE_LEN =>
            {
                self.counters.device_cfg_accesses.inc();
                self.device.write_config(o - DEVICE_OFFSET, data);
            }
            o if o >= NOTIFY_OFFSET => {
                let q = ((o - NOTIFY_OFFSET) / NOTIFY_MULTIPLIER as u64) as usize;
                self.counters.notify_exit.inc();
                if let Some(k) = self.kicks.get(q) {
                    let _ = k.write(1);
                }
            }
            _ => {}
        }
    }

    fn pci_cfg_window(&mut self, write: bool) {
        let cap = self.pci_cfg_cap;
        let bar = self.cfg.u8_at(cap + 4) as usize;
        let offset = self.cfg.u32_at(cap + 8) as u64;
        let len = self.cfg.u32_at(cap + 12) as usize;
        if !matches!(len, 1 | 2 | 4) {
            return;
        }
        let data_off = cap + 16;
        if write {
            let mut d = [0u8; 4];
            self.cfg.read(data_off, &mut d);
            self.bar_write(bar, offset, &d[..len]);
        } else {
            let mut d = [0u8; 4];
            self.bar_read(bar, offset, &mut d[..len]);
            for (i, b) in d.iter().enumerate() {
                self.cfg.set_u8(data_off + i, *b);
            }
        }
    }
}

impl PciDevice for VirtioPciDevice {
    fn config(&self) -> &ConfigSpace {
        &self.cfg
    }
    fn config_mut(&mut self) -> &mut ConfigSpace {
        &mut self.cfg
    }

    fn config_reading(&mut self, offset: usize, len: usize) {
        self.counters.config_reads.inc();
        if touches(offset, len, self.pci_cfg_cap + 16, 4) {
            self.pci_cfg_window(false);
        }
    }

    fn config_written(&mut self, offset: usize, len: usize) {
        self.counters.config_writes.inc();
        if touches(offset, len, self.msix_cap + 2, 2) {
            let ctrl = self.cfg.u16_at(self.msix_cap + 2);
            self.irq.interrupts.write_control(ctrl);
        }
        if touches(offset, len, COMMAND, 2) {
            let allowed = self.cfg.command() & COMMAND_INTX_DISABLE == 0;
            self.irq.intx_allowed.store(allowed, Ordering::Release);
            self.apply_bus_master();
        }
        if touches(offset, len, self.pci_cfg_cap + 16, 4) {
            self.pci_cfg_window(true);
        }
    }

    fn bar_read(&mut self, bar: usize, offset: u64, data: &mut [u8]) {
        match bar {
            MSIX_BAR if offset < MSIX_PBA_OFFSET => self.irq.interrupts.read_table(offset, data),
            MSIX_BAR => self.irq.interrupts.read_pba(offset - MSIX_PBA_OFFSET, data),
            VIRTIO_BAR => self.virtio_bar_read(offset, data),
            _ => data.fill(0xff),
        }
    }

    fn bar_write(&mut self, bar: usize, offset: u64, data: &[u8]) {
        match bar {
            MSIX_BAR if offset < MSIX_PBA_OFFSET => self.irq.interrupts.write_table(offset, data),
            VIRTIO_BAR => self.virtio_bar_write(offset, data),
            _ => {}
        }
    }

    fn bar_mapped(&mut self, bar: usize, base: Option<u64>) {
        if bar == VIRTIO_BAR {
            self.set_ioeventfds(base);
        }
    }

    fn set_requester_id(&mut self, rid: u16) {
        self.rid = rid;
        self.irq.interrupts.set_requester_id(rid);
        self.apply_bus_master();
    }

    fn reset(&mut self) {
        self.reset_device();
        self.env.dma.set_bus_master(u32::from(self.rid), false);
    }
}

impl VirtioPciDevice {
    /// A function without bus mastering may not DMA: the DMA path refuses its accesses.
    fn apply_bus_master(&self) {
        let on = self.cfg.command() & crate::config::COMMAND_BUS_MASTER != 0;
        self.env.dma.set_bus_master(self.rid as u32, on);
    }
}

impl Drop for VirtioPciDevice {
    fn drop(&mut self) {
        if self.activated {
            self.device.reset();
        }
        self.set_ioeventfds(None);
    }
}

/// A transport ready to attach: `Arc<Mutex<_>>` as the root wants it.
pub fn shared(dev: VirtioPciDevice) -> Arc<Mutex<VirtioPciDevice>> {
    Arc::new(Mutex::new(dev))
}
