//! A PCI function in another process, reached over vfio-user (`--user-device socket=PATH`):
//! the `vfio_user` crate's client (vendored in `third_party/vfio_user`) behind Lucid's
//! [`PciDevice`]. docs/vfio.md has the design and the contract with the device server.
//!
//! - Config space: Lucid keeps the BAR registers, the command register (forwarded too), the
//!   interrupt line/pin and the MSI and MSI-X capabilities' bodies; every other byte is the
//!   device's (region 7), read live and written as the guest wrote it.
//! - BARs: sized from the BAR regions (0-5), kinds from the device's BAR registers; every access
//!   is forwarded (`REGION_READ`/`REGION_WRITE`) except those to the MSI-X table and PBA, which
//!   Lucid emulates ([`msix`]).
//! - Interrupts never pass through a Lucid thread: MSI and each MSI-X vector are an irqfd on a
//!   GSI the router points at the message the guest programmed (remapped by the vIOMMU when it
//!   is on); INTx an irqfd with a resamplefd, given to the server as INTx unmask.
//! - DMA: without a vIOMMU all of RAM (a shared memfd) is mapped at iova = gpa; with one, a
//!   [`MapListener`] sends `DMA_MAP`/`DMA_UNMAP` as the guest's tables change. A DMA the server
//!   refused lands in its fault log (region 9); after each forwarded access Lucid polls the ERR
//!   eventfd and replays new faults through the vIOMMU, which records them.
//! - A server that dies or misbehaves marks the device failed: BAR reads return all ones, writes
//!   are dropped, the vendor ID reads 0xffff (a surprise-removed device); logged once, counted.

use std::ops::Range;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

mod msix;

use lucid_hv::{GsiRouter, Vm};
use lucid_iommu::{MapListener, Perm, Vtd};
use lucid_mem::{Access, DmaTranslator, RamRegion};
use lucid_pci::config::{
    touches, Bar, BarKind, ConfigSpace, PciIds, BAR0, CAPABILITIES_POINTER, CAP_ID_MSI,
    CAP_ID_MSIX, CAP_ID_VENDOR, COMMAND, INTERRUPT_LINE, LEGACY_CONFIG_SIZE, NUM_BARS, STATUS,
    STATUS_CAP_LIST,
};
use lucid_pci::msi::{MsiCap, MSI_64BIT};
use lucid_pci::PciDevice;
use lucid_stats::{Counter, StatsRegistry};
use vfio_user::{Client, DmaMapFlags};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

/// How long Lucid waits for the device server: to connect and set up, and for each message.
pub const TIMEOUT: Duration = Duration::from_secs(5);

/// vfio-user's PCI region indexes (VFIO's) and the fault log of Lucid's contract.
const CONFIG_REGION: u32 = 7;
const FAULT_REGION: u32 = 9;
/// VFIO PCI interrupt indexes.
const IRQ_INTX: u32 = 0;
const IRQ_MSI: u32 = 1;
const IRQ_MSIX: u32 = 2;
const IRQ_ERR: u32 = 3;
/// `SET_IRQS` flags (VFIO's).
const SET_DATA_NONE: u32 = 1 << 0;
const SET_DATA_EVENTFD: u32 = 1 << 2;
const SET_ACTION_UNMASK: u32 = 1 << 4;
const SET_ACTION_TRIGGER: u32 = 1 << 5;
/// The most eventfds one `SET_IRQS` carries (the `vfio_user` server receives up to 16).
const SET_IRQS_FDS: usize = 16;
/// `DEVICE_GET_REGION_INFO` flags.
const REGION_READ: u32 = 1 << 0;

/// The fault log: `total` at 0, then a ring of [`FAULT_SLOTS`] records of 16 bytes from 8.
const FAULT_SLOTS: u32 = 64;
const FAULT_RECORD: usize = 16;
const FAULT_LOG_LEN: usize = 8 + FAULT_SLOTS as usize * FAULT_RECORD;
/// Record flags: the device wanted to write RAM; the IOVA was mapped read-only.
const FAULT_WRITE: u32 = 1 << 0;

/// The largest BAR Lucid accepts from a device (its PCI window is below 4 GiB).
pub const MAX_BAR_SIZE: u64 = 1 << 30;

/// Why a vfio-user device cannot be attached.
#[derive(Debug, thiserror::Error)]
pub enum UserDeviceError {
    #[error("cannot set up the device at {}: {source}", .socket.display())]
    Connect {
        socket: PathBuf,
        #[source]
        source: vfio_user::Error,
    },
    #[error("the device server at {} did not answer within {TIMEOUT:?}", .0.display())]
    SetupTimeout(PathBuf),
    #[error("the device has no PCI config space region (region 7)")]
    NoConfigRegion,
    #[error("{what}: {source}")]
    Message {
        what: &'static str,
        #[source]
        source: vfio_user::Error,
    },
    #[error("BAR {bar}: size {size:#x} {problem}")]
    BarSize {
        bar: usize,
        size: u64,
        problem: &'static str,
    },
    #[error("BAR {bar}: {source}")]
    Bar {
        bar: usize,
        #[source]
        source: lucid_pci::PciError,
    },
    #[error("the device's MSI-X capability at {cap:#x}: {problem}")]
    Msix { cap: usize, problem: String },
    #[error("the device's MSI capability at {0:#x} is not where a capability can be")]
    MsiOffset(usize),
    #[error("MSI capability: {0}")]
    Msi(#[source] lucid_pci::PciError),
    #[error("the device's DMA needs guest RAM in a shared memfd (--backing memfd)")]
    NotShared,
    #[error("cannot create an eventfd: {0}")]
    EventFd(#[source] std::io::Error),
    #[error(transparent)]
    Hv(#[from] lucid_hv::HvError),
}

/// What the device needs from the VM.
pub struct UserDeviceParts<'a> {
    pub vm: &'a Vm,
    pub router: &'a Arc<GsiRouter>,
    pub stats: &'a StatsRegistry,
    /// Guest RAM: the memfd regions the server maps.
    pub ram: &'a [RamRegion],
    /// The vIOMMU, when the VM has one: DMA follows its mappings and faults are replayed to it.
    pub vtd: Option<&'a Arc<Vtd>>,
    /// The GSI of the slot's INTx line.
    pub intx_gsi: u32,
}

struct Counters {
    region_reads: Arc<Counter>,
    region_writes: Arc<Counter>,
    config_reads: Arc<Counter>,
    config_writes: Arc<Counter>,
    dma_maps: Arc<Counter>,
    dma_unmaps: Arc<Counter>,
    faults: Arc<Counter>,
    errors: Arc<Counter>,
    failed: Arc<Counter>,
    msi_routes: Arc<Counter>,
    msix_routes: Arc<Counter>,
    msix_masks: Arc<Counter>,
    msix_set_irqs: Arc<Counter>,
}

/// The connection, shared by the device (vCPU threads) and its [`MapListener`] (the vIOMMU's
/// invalidations): one message at a time.
struct Link {
    name: String,
    client: Mutex<Client>,
    failed: AtomicBool,
    c: Counters,
}

impl Link {
    fn lock(&self) -> MutexGuard<'_, Client> {
        self.client.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn failed(&self) -> bool {
        self.failed.load(Ordering::Acquire)
    }

    /// Runs one exchange with the server; None once the device failed. An error reply is the
    /// server refusing that one request (counted); anything else (a timeout, a closed or
    /// desynchronised stream) fails the device for good.
    fn call<T>(
        &self,
        what: &str,
        f: impl FnOnce(&mut Client) -> Result<T, vfio_user::Error>,
    ) -> Option<T> {
        if self.failed() {
            return None;
        }
        let mut client = self.lock();
        match f(&mut client) {
            Ok(v) => Some(v),
            Err(e @ vfio_user::Error::ReplyError { .. }) => {
                self.c.errors.inc();
                log::debug!("{}: {what}: {e}", self.name);
                None
            }
            Err(e) => {
                self.c.errors.inc();
                if !self.failed.swap(true, Ordering::AcqRel) {
                    self.c.failed.inc();
                    log::error!(
                        "{}: the device server failed ({what}: {e}); the device reads as removed",
                        self.name
                    );
                    let _ = client.shutdown();
                }
                None
            }
        }
    }

    /// `DMA_MAP` of `iova..iova+len` to guest RAM at `gpa`, split where the range crosses RAM
    /// regions (each its own offset in the memfd). Ranges outside RAM are not mapped.
    fn map(&self, ram: &[RamRegion], iova: u64, gpa: u64, len: u64, perm: Perm) {
        let mut flags = DmaMapFlags::empty();
        if perm.read {
            flags |= DmaMapFlags::READ;
        }
        if perm.write {
            flags |= DmaMapFlags::WRITE;
        }
        for (iova, r, off, n) in split(ram, iova, gpa, len) {
            let Some(fd) = r.fd.as_ref() else { continue };
            let mapped = self.call("DMA_MAP", |c| {
                c.dma_map_flags(flags, r.fd_offset + off, iova, n, fd.as_raw_fd())
            });
            if mapped.is_some() {
                self.c.dma_maps.inc();
            }
        }
    }

    fn unmap(&self, iova: u64, len: u64) {
        if self.call("DMA_UNMAP", |c| c.dma_unmap(iova, len)).is_some() {
            self.c.dma_unmaps.inc();
        }
    }
}

/// The pieces of `gpa..gpa+len` in RAM: (iova, region, offset in the region, length).
fn split(ram: &[RamRegion], iova: u64, gpa: u64, len: u64) -> Vec<(u64, &RamRegion, u64, u64)> {
    let end = gpa.saturating_add(len);
    ram.iter()
        .filter_map(|r| {
            let start = gpa.max(r.gpa);
            let stop = end.min(r.gpa + r.size);
            (start < stop).then(|| (iova + (start - gpa), r, start - r.gpa, stop - start))
        })
        .collect()
}

/// The vIOMMU tells the device's server what its requester may reach.
struct Listener {
    link: Arc<Link>,
    ram: Vec<RamRegion>,
}

impl MapListener for Listener {
    fn map(&self, iova: u64, gpa: u64, len: u64, perm: Perm) {
        self.link.map(&self.ram, iova, gpa, len, perm)
    }
    fn unmap(&self, iova: u64, len: u64) {
        self.link.unmap(iova, len)
    }
}

/// Which config-space bytes are Lucid's (the BARs, the expansion ROM BAR, the interrupt line and
/// pin, the MSI capability's body, everything past the legacy 256 bytes): never read from the
/// device, written to it only when [`FORWARDED_OWN`] says so.
#[derive(Clone, Debug)]
struct Owned {
    msi_body: Option<Range<usize>>,
    msix_body: Option<Range<usize>>,
}

/// The expansion ROM BAR: Lucid offers none (it reads 0).
const EXPANSION_ROM: usize = 0x30;

/// Lucid's bytes the device sees written too: the command register (memory/I/O decode, bus
/// mastering, INTx disable are the device's business as much as the bus's).
const FORWARDED_OWN: Range<usize> = COMMAND..COMMAND + 2;

impl Owned {
    fn lucid(&self, off: usize) -> bool {
        off >= LEGACY_CONFIG_SIZE
            || FORWARDED_OWN.contains(&off)
            || (BAR0..BAR0 + 4 * NUM_BARS).contains(&off)
            || (EXPANSION_ROM..EXPANSION_ROM + 4).contains(&off)
            || (INTERRUPT_LINE..INTERRUPT_LINE + 2).contains(&off)
            || self.msi_body.as_ref().is_some_and(|r| r.contains(&off))
            || self.msix_body.as_ref().is_some_and(|r| r.contains(&off))
    }

    /// Whether a guest write of byte `off` goes to the device.
    fn forwarded(&self, off: usize) -> bool {
        FORWARDED_OWN.contains(&off) || !self.lucid(off)
    }
}

/// A vfio-user PCI function.
pub struct UserDevice {
    link: Arc<Link>,
    cfg: ConfigSpace,
    owned: Owned,
    msi: Option<MsiCap>,
    /// MSI vector 0: its GSI and irqfd, and whether the server has it (MSI enabled).
    msi_irq: Option<(u32, EventFd)>,
    msi_on: bool,
    msix: Option<msix::Msix>,
    /// INTx: (GSI, trigger irqfd, resamplefd).
    intx: Option<(u32, EventFd, EventFd)>,
    /// The server's ERR eventfd: set when it appended to the fault log.
    err: Option<EventFd>,
    /// Fault log records read so far (the log's `total` when last read).
    faults_seen: u32,
    bar_regions: [Option<u64>; NUM_BARS],
    vm: Vm,
    router: Arc<GsiRouter>,
    vtd: Option<Arc<Vtd>>,
    ram: Vec<RamRegion>,
    rid: u16,
    listening: bool,
}

/// Reads a little-endian value of `N` bytes at `off` of `b`.
fn le<const N: usize>(b: &[u8], off: usize) -> u64 {
    let mut v = [0u8; 8];
    v[..N].copy_from_slice(&b[off..off + N]);
    u64::from_le_bytes(v)
}

/// Connects to `socket`; each message of the set-up must come within [`TIMEOUT`].
fn connect(socket: &Path) -> Result<Client, UserDeviceError> {
    Client::new_with_timeout(socket, TIMEOUT).map_err(|source| match source {
        vfio_user::Error::Timeout(_) => UserDeviceError::SetupTimeout(socket.to_path_buf()),
        source => UserDeviceError::Connect {
            socket: socket.to_path_buf(),
            source,
        },
    })
}

fn msg(what: &'static str) -> impl FnOnce(vfio_user::Error) -> UserDeviceError {
    move |source| UserDeviceError::Message { what, source }
}

fn eventfd() -> Result<EventFd, UserDeviceError> {
    EventFd::new(EFD_NONBLOCK).map_err(UserDeviceError::EventFd)
}

impl UserDevice {
    /// Connects to the server at `socket`, reads what the device is, and builds the function
    /// named `name` with its interrupts and DMA set up. Refuses a server that misbehaves with an
    /// error, within [`TIMEOUT`] per step.
    pub fn new(name: &str, socket: &Path, p: UserDeviceParts<'_>) -> Result<Self, UserDeviceError> {
        if p.ram.iter().any(|r| r.fd.is_none()) {
            return Err(UserDeviceError::NotShared);
        }
        let mut client = connect(socket)?;
        let config_size = client
            .region(CONFIG_REGION)
            .filter(|r| r.flags & REGION_READ != 0)
            .map(|r| r.size)
            .ok_or(UserDeviceError::NoConfigRegion)?;
        let mut dev_cfg = vec![0u8; LEGACY_CONFIG_SIZE];
        let n = (config_size as usize).min(LEGACY_CONFIG_SIZE);
        if n < 0x40 {
            return Err(UserDeviceError::NoConfigRegion);
        }
        client
            .region_read(CONFIG_REGION, 0, &mut dev_cfg[..n])
            .map_err(msg("reading config space"))?;
        let b = &dev_cfg;
        let mut cfg = ConfigSpace::new(PciIds {
            vendor: le::<2>(b, 0) as u16,
            device: le::<2>(b, 2) as u16,
            revision: b[8],
            class: (b[11], b[10], b[9]),
            subsystem_vendor: le::<2>(b, 0x2c) as u16,
            subsystem: le::<2>(b, 0x2e) as u16,
        });
        let bar_regions = Self::bars(&mut client, &mut cfg, b)?;

        // The device's capabilities stay the device's, except MSI and MSI-X, whose bodies
        // Lucid emulates at the device's offsets.
        let mut msi_at = None;
        let mut msix_at = None;
        if le::<2>(b, STATUS) as u16 & STATUS_CAP_LIST != 0 {
            let mut p = b[CAPABILITIES_POINTER] as usize & !3;
            let mut seen = 0;
            while (0x40..LEGACY_CONFIG_SIZE - 1).contains(&p) && seen < 48 {
                match b[p] {
                    CAP_ID_MSI => msi_at = Some(p),
                    CAP_ID_MSIX => msix_at = Some(p),
                    _ => {}
                }
                p = b[p + 1] as usize & !3;
                seen += 1;
            }
        }
        let irq_count = |client: &mut Client, index: u32| -> Result<u32, UserDeviceError> {
            if index >= client.num_irqs() {
                return Ok(0);
            }
            Ok(client
                .get_irq_info(index)
                .map_err(msg("reading interrupt info"))?
                .count)
        };
        let msix_layout = match msix_at {
            Some(at) => {
                let mut mem_bars = [None; NUM_BARS];
                for (i, m) in mem_bars.iter_mut().enumerate() {
                    *m = cfg.bar(i).filter(|b| !b.kind.is_io()).map(|b| b.size);
                }
                let n = irq_count(&mut client, IRQ_MSIX)?;
                Some(msix::Layout::parse(b, at, &mem_bars, n)?)
            }
            None => None,
        };
        let has_msi = msi_at.is_some() && irq_count(&mut client, IRQ_MSI)? > 0;
        let msi = Self::place_caps(
            &mut cfg,
            b,
            msi_at.filter(|_| has_msi),
            msix_layout.as_ref(),
        )?;
        let owned = Owned {
            msix_body: msix_layout.as_ref().map(|l| l.body()),
            msi_body: msi.map(|m| {
                let len = if m.control(&cfg) & MSI_64BIT != 0 {
                    14
                } else {
                    10
                };
                m.offset() + 2..m.offset() + len
            }),
        };

        // Interrupts: MSI vector 0 on its own GSI (no route until the guest enables it).
        let msi_irq = match msi {
            Some(_) => {
                let gsi = p.router.allocate()?;
                let efd = eventfd()?;
                if let Err(e) = p.vm.register_irqfd(&efd, gsi) {
                    let _ = p.router.release(gsi);
                    return Err(e.into());
                }
                Some((gsi, efd))
            }
            None => None,
        };
        let msix = match msix_layout {
            Some(l) => match msix::Msix::new(l, p.router) {
                Ok(m) => Some(m),
                Err(e) => {
                    if let Some((gsi, efd)) = msi_irq {
                        let _ = p.vm.unregister_irqfd(&efd, gsi);
                        let _ = p.router.release(gsi);
                    }
                    return Err(e);
                }
            },
            None => None,
        };
        let mut dev = UserDevice {
            link: Arc::new(Link {
                name: name.to_string(),
                client: Mutex::new(client),
                failed: AtomicBool::new(false),
                c: counters(name, p.stats),
            }),
            cfg,
            owned,
            msi,
            msi_irq,
            msi_on: false,
            msix,
            intx: None,
            err: None,
            faults_seen: 0,
            bar_regions,
            vm: p.vm.clone(),
            router: p.router.clone(),
            vtd: p.vtd.cloned(),
            ram: p.ram.to_vec(),
            rid: 0,
            listening: false,
        };
        // From here on `dev`'s Drop releases what was set up.
        let mut client = dev.link.lock();
        if irq_count(&mut client, IRQ_INTX)? > 0 {
            let (trigger, resample) = (eventfd()?, eventfd()?);
            p.vm.fd()
                .register_irqfd_with_resample(&trigger, &resample, p.intx_gsi)
                .map_err(|e| lucid_hv::HvError::Ioctl("KVM_IRQFD(resample)", e))?;
            dev.intx = Some((p.intx_gsi, trigger, resample));
            let (_, trigger, resample) = dev.intx.as_ref().expect("set above");
            client
                .set_irqs(
                    IRQ_INTX,
                    SET_ACTION_TRIGGER | SET_DATA_EVENTFD,
                    0,
                    1,
                    &[trigger.as_raw_fd()],
                )
                .map_err(msg("giving the server the INTx eventfd"))?;
            client
                .set_irqs(
                    IRQ_INTX,
                    SET_ACTION_UNMASK | SET_DATA_EVENTFD,
                    0,
                    1,
                    &[resample.as_raw_fd()],
                )
                .map_err(msg("giving the server the INTx unmask eventfd"))?;
            let line = u8::try_from(p.intx_gsi).unwrap_or(0xff);
            dev.cfg.set_interrupt(line, 1);
        }
        if irq_count(&mut client, IRQ_ERR)? > 0 && client.region(FAULT_REGION).is_some() {
            let err = eventfd()?;
            client
                .set_irqs(
                    IRQ_ERR,
                    SET_ACTION_TRIGGER | SET_DATA_EVENTFD,
                    0,
                    1,
                    &[err.as_raw_fd()],
                )
                .map_err(msg("giving the server the ERR eventfd"))?;
            dev.err = Some(err);
        }
        drop(client);
        if dev.vtd.is_none() {
            // No vIOMMU: the device may reach all of RAM at its guest-physical address.
            let mut client = dev.link.lock();
            for r in &dev.ram {
                let fd = r.fd.as_ref().expect("checked above").as_raw_fd();
                client
                    .dma_map_flags(DmaMapFlags::READ_WRITE, r.fd_offset, r.gpa, r.size, fd)
                    .map_err(msg("DMA_MAP of guest RAM"))?;
                dev.link.c.dma_maps.inc();
            }
        }
        log::info!(
            "{name}: vfio-user device {:04x}:{:04x} at {}, BARs {:?}, {}, {}",
            dev.cfg.u16_at(0),
            dev.cfg.u16_at(2),
            socket.display(),
            dev.bar_regions,
            if dev.msi.is_some() { "MSI" } else { "no MSI" },
            match &dev.msix {
                Some(m) => format!("MSI-X ({} vectors)", m.layout.vectors),
                None => "no MSI-X".to_string(),
            },
        );
        Ok(dev)
    }

    /// Declares the BARs the BAR regions size, of the kinds the device's BAR registers say.
    fn bars(
        client: &mut Client,
        cfg: &mut ConfigSpace,
        b: &[u8],
    ) -> Result<[Option<u64>; NUM_BARS], UserDeviceError> {
        let mut out = [None; NUM_BARS];
        let mut i = 0;
        while i < NUM_BARS {
            let size = client.region(i as u32).map_or(0, |r| r.size);
            let reg = le::<4>(b, BAR0 + 4 * i) as u32;
            let kind = if reg & 1 != 0 {
                BarKind::Io
            } else if reg & 0x6 == 0x4 {
                BarKind::Mmio64 {
                    prefetchable: reg & 0x8 != 0,
                }
            } else {
                BarKind::Mmio32 {
                    prefetchable: reg & 0x8 != 0,
                }
            };
            let next = if matches!(kind, BarKind::Mmio64 { .. }) {
                i + 2
            } else {
                i + 1
            };
            if size == 0 {
                i = next;
                continue;
            }
            let bad = |problem| UserDeviceError::BarSize {
                bar: i,
                size,
                problem,
            };
            if !size.is_power_of_two() {
                return Err(bad("is not a power of two"));
            }
            if size > MAX_BAR_SIZE {
                return Err(bad("is over Lucid's 1 GiB limit"));
            }
            cfg.add_bar(i, Bar { kind, size })
                .map_err(|source| UserDeviceError::Bar { bar: i, source })?;
            out[i] = Some(size);
            i = next;
        }
        Ok(out)
    }

    /// Lucid's MSI capability (one vector, the device's 64-bit capability) at `msi_at` and
    /// MSI-X capability at the layout's offset, the device's offsets. The header's capability
    /// list stays the device's (read live), so each is placed there by padding the shadow's list
    /// up to it.
    fn place_caps(
        cfg: &mut ConfigSpace,
        b: &[u8],
        msi_at: Option<usize>,
        msix: Option<&msix::Layout>,
    ) -> Result<Option<MsiCap>, UserDeviceError> {
        let msi_len = |at: usize| {
            if le::<2>(b, at + 2) as u16 & MSI_64BIT != 0 {
                14
            } else {
                10
            }
        };
        if let Some(at) = msi_at {
            if at < 0x40 || at & 3 != 0 || at + msi_len(at) > LEGACY_CONFIG_SIZE {
                return Err(UserDeviceError::MsiOffset(at));
            }
        }
        let mut caps: Vec<(usize, bool)> = msi_at.map(|a| (a, true)).into_iter().collect();
        caps.extend(msix.map(|l| (l.cap, false)));
        caps.sort_unstable();
        let mut next = 0x40;
        let mut msi = None;
        for (at, is_msi) in caps {
            let overlap = || match is_msi {
                true => UserDeviceError::MsiOffset(at),
                false => UserDeviceError::Msix {
                    cap: at,
                    problem: "the capability overlaps the MSI capability".into(),
                },
            };
            if at < next {
                return Err(overlap());
            }
            if at > next {
                let pad = vec![0u8; at - next - 2];
                cfg.add_capability(CAP_ID_VENDOR, &pad, &[])
                    .map_err(UserDeviceError::Msi)?;
            }
            let placed = if is_msi {
                let is64 = msi_len(at) == 14;
                let m = MsiCap::add(cfg, 1, is64).map_err(UserDeviceError::Msi)?;
                msi = Some(m);
                next = (at + msi_len(at) + 3) & !3;
                m.offset()
            } else {
                let l = msix.expect("listed above");
                let reg = |off: usize| le::<4>(b, l.cap + off) as u32;
                let bad = |e: lucid_pci::PciError| UserDeviceError::Msix {
                    cap: at,
                    problem: e.to_string(),
                };
                let off = lucid_pci::msix::add_capability(
                    cfg,
                    l.vectors,
                    (reg(4) & 7) as u8,
                    reg(4) & !7,
                    reg(8) & !7,
                )
                .map_err(bad)?;
                // The PBA may be in another BAR than the table.
                cfg.set_u32(off + 8, reg(8));
                next = at + 12;
                off
            };
            if placed != at {
                return Err(overlap());
            }
        }
        Ok(msi)
    }

    /// Whether the device failed (its server died or misbehaved).
    pub fn failed(&self) -> bool {
        self.link.failed()
    }

    /// The server appended to its fault log: replays each new record through the vIOMMU,
    /// which records the fault with its reason and this function's source ID.
    fn poll_faults(&mut self) {
        let Some(err) = &self.err else { return };
        if err.read().is_err() {
            return;
        }
        let mut log = vec![0u8; FAULT_LOG_LEN];
        if self
            .link
            .call("reading the fault log", |c| {
                c.region_read(FAULT_REGION, 0, &mut log)
            })
            .is_none()
        {
            return;
        }
        let total = le::<4>(&log, 0) as u32;
        let new = total.wrapping_sub(self.faults_seen);
        let first = total.wrapping_sub(new.min(FAULT_SLOTS));
        self.faults_seen = total;
        for i in 0..new.min(FAULT_SLOTS) {
            let at = 8 + (first.wrapping_add(i) % FAULT_SLOTS) as usize * FAULT_RECORD;
            let iova = le::<8>(&log, at);
            let len = le::<4>(&log, at + 8);
            let flags = le::<4>(&log, at + 12) as u32;
            let access = if flags & FAULT_WRITE != 0 {
                Access::Write
            } else {
                Access::Read
            };
            self.link.c.faults.inc();
            match &self.vtd {
                Some(vtd) => {
                    let t = (**vtd).translate(u32::from(self.rid), iova, len.max(1), access);
                    log::debug!(
                        "{}: device DMA {access:?} at {iova:#x}+{len} refused; vIOMMU: {t:?}",
                        self.link.name
                    );
                }
                None => log::warn!(
                    "{}: the device server refused a DMA {access:?} at {iova:#x}+{len} \
                     (flags {flags:#x})",
                    self.link.name
                ),
            }
        }
    }

    /// Follows the guest's MSI capability: routes the GSI to its message and gives the server
    /// the eventfd while MSI is enabled (VFIO's way of telling a device MSI is on).
    fn msi_changed(&mut self) {
        let (Some(m), Some((gsi, efd))) = (self.msi, &self.msi_irq) else {
            return;
        };
        let gsi = *gsi;
        let msg = m.message(&self.cfg, 0);
        let routed = match msg {
            Some(msg) => self.router.set_msi(gsi, self.rid, msg),
            None => self.router.clear(gsi),
        };
        if let Err(e) = routed {
            self.link.c.errors.inc();
            log::warn!("{}: MSI route: {e}", self.link.name);
        }
        self.link.c.msi_routes.inc();
        let on = msg.is_some();
        if on == self.msi_on {
            return;
        }
        self.msi_on = on;
        let fd = efd.as_raw_fd();
        self.link.call("SET_IRQS (MSI)", |c| {
            if on {
                c.set_irqs(IRQ_MSI, SET_ACTION_TRIGGER | SET_DATA_EVENTFD, 0, 1, &[fd])
            } else {
                c.set_irqs(IRQ_MSI, SET_ACTION_TRIGGER | SET_DATA_NONE, 0, 0, &[])
            }
        });
    }

    /// Follows MSI-X message control: each vector's route and irqfd, and the server's
    /// eventfds (`SET_IRQS` index 2) when enable changes, at most [`SET_IRQS_FDS`] a message.
    fn msix_control(&mut self) {
        let Some(m) = &mut self.msix else { return };
        let ctrl = self.cfg.u16_at(m.layout.cap + 2);
        let ctx = msix::Ctx {
            name: &self.link.name,
            vm: &self.vm,
            router: &self.router,
            rid: self.rid,
            c: &self.link.c,
        };
        if !m.control(ctrl, &ctx) {
            return;
        }
        let on = m.enabled();
        self.link.c.msix_set_irqs.inc();
        if !on {
            self.link.call("SET_IRQS (MSI-X off)", |c| {
                c.set_irqs(IRQ_MSIX, SET_ACTION_TRIGGER | SET_DATA_NONE, 0, 0, &[])
            });
            return;
        }
        let fds = m.fds();
        for (k, chunk) in fds.chunks(SET_IRQS_FDS).enumerate() {
            let start = (k * SET_IRQS_FDS) as u32;
            let sent = self.link.call("SET_IRQS (MSI-X)", |c| {
                c.set_irqs(
                    IRQ_MSIX,
                    SET_ACTION_TRIGGER | SET_DATA_EVENTFD,
                    start,
                    chunk.len() as u32,
                    chunk,
                )
            });
            if sent.is_none() {
                return;
            }
        }
    }

    /// Releases what the device holds in the VM and the vIOMMU (idempotent).
    fn release(&mut self) {
        if self.listening {
            if let Some(vtd) = &self.vtd {
                vtd.remove_listener(self.rid);
            }
            self.listening = false;
        }
        if let Some((gsi, efd)) = self.msi_irq.take() {
            let _ = self.vm.unregister_irqfd(&efd, gsi);
            let _ = self.router.release(gsi);
        }
        if let Some(m) = &mut self.msix {
            m.release(Some(&self.vm), &self.router);
        }
        if let Some((gsi, trigger, _)) = self.intx.take() {
            let _ = self.vm.unregister_irqfd(&trigger, gsi);
        }
    }
}

fn counters(name: &str, stats: &StatsRegistry) -> Counters {
    let c = |n: &str| stats.counter(format!("user_device.{name}.{n}"));
    Counters {
        region_reads: c("region_reads"),
        region_writes: c("region_writes"),
        config_reads: c("config_reads"),
        config_writes: c("config_writes"),
        dma_maps: c("dma_maps"),
        dma_unmaps: c("dma_unmaps"),
        faults: c("faults"),
        errors: c("errors"),
        failed: c("failed"),
        msi_routes: c("msi_routes"),
        msix_routes: c("msix_routes"),
        msix_masks: c("msix_masks"),
        msix_set_irqs: c("msix_set_irqs"),
    }
}

impl PciDevice for UserDevice {
    fn config(&self) -> &ConfigSpace {
        &self.cfg
    }

    fn config_mut(&mut self) -> &mut ConfigSpace {
        &mut self.cfg
    }

    fn config_reading(&mut self, offset: usize, len: usize) {
        let end = (offset + len).min(LEGACY_CONFIG_SIZE);
        if !(offset..end).any(|o| !self.owned.lucid(o)) {
            return;
        }
        let mut data = vec![0xffu8; end - offset];
        if !self.failed() {
            self.link.c.config_reads.inc();
            let read = self.link.call("config read", |c| {
                c.region_read(CONFIG_REGION, offset as u64, &mut data)
            });
            if read.is_none() {
                data.fill(0xff);
            }
            self.poll_faults();
        }
        for (i, &v) in data.iter().enumerate() {
            if !self.owned.lucid(offset + i) {
                self.cfg.set_u8(offset + i, v);
            }
        }
        if self.failed() {
            // A surprise-removed device: no vendor.
            self.cfg.set_u16(0, 0xffff);
        }
    }

    fn config_writing(&mut self, offset: usize, data: &[u8]) {
        // The bytes the device owns, in runs, as the guest wrote them.
        let mut i = 0;
        while i < data.len() {
            if !self.owned.forwarded(offset + i) {
                i += 1;
                continue;
            }
            let start = i;
            while i < data.len() && self.owned.forwarded(offset + i) {
                i += 1;
            }
            let run = &data[start..i];
            self.link.c.config_writes.inc();
            self.link.call("config write", |c| {
                c.region_write(CONFIG_REGION, (offset + start) as u64, run)
            });
        }
        self.poll_faults();
    }

    fn config_written(&mut self, offset: usize, len: usize) {
        if let Some(r) = &self.owned.msi_body {
            if touches(offset, len, r.start, r.len()) {
                self.msi_changed();
            }
        }
        if let Some(m) = &self.msix {
            if touches(offset, len, m.layout.cap + 2, 2) {
                self.msix_control();
            }
        }
    }

    fn bar_read(&mut self, bar: usize, offset: u64, data: &mut [u8]) {
        data.fill(0xff);
        if self.bar_regions.get(bar).copied().flatten().is_none() {
            return;
        }
        if let Some(m) = &mut self.msix {
            if let Some(part) = m.layout.part(bar, offset) {
                m.read(part, data);
                return;
            }
        }
        self.link.c.region_reads.inc();
        let mut buf = vec![0u8; data.len()];
        let read = self
            .link
            .call("BAR read", |c| c.region_read(bar as u32, offset, &mut buf));
        if read.is_some() {
            data.copy_from_slice(&buf);
        }
        self.poll_faults();
    }

    fn bar_write(&mut self, bar: usize, offset: u64, data: &[u8]) {
        if self.bar_regions.get(bar).copied().flatten().is_none() {
            return;
        }
        if let Some(m) = &mut self.msix {
            if let Some(part) = m.layout.part(bar, offset) {
                let ctx = msix::Ctx {
                    name: &self.link.name,
                    vm: &self.vm,
                    router: &self.router,
                    rid: self.rid,
                    c: &self.link.c,
                };
                m.write(part, data, &ctx);
                return;
            }
        }
        self.link.c.region_writes.inc();
        self.link
            .call("BAR write", |c| c.region_write(bar as u32, offset, data));
        self.poll_faults();
    }

    fn set_requester_id(&mut self, rid: u16) {
        self.rid = rid;
        if let Some(vtd) = &self.vtd {
            vtd.add_listener(
                rid,
                Arc::new(Listener {
                    link: self.link.clone(),
                    ram: self.ram.clone(),
                }),
            );
            self.listening = true;
        }
    }

    fn reset(&mut self) {
        self.release();
        self.link.call("DEVICE_RESET", |c| {
            if c.resettable() {
                c.reset()
            } else {
                Ok(())
            }
        });
        let _ = self.link.lock().shutdown();
    }
}

impl Drop for UserDevice {
    fn drop(&mut self) {
        self.release();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn region(gpa: u64, size: u64, fd_offset: u64) -> RamRegion {
        RamRegion {
            gpa,
            size,
            host_addr: 0,
            fd: None,
            fd_offset,
        }
    }

    #[test]
    fn a_range_across_ram_regions_is_split_at_each_memfd_offset() {
        let ram = [region(0, 0x1000, 0), region(0x4000, 0x2000, 0x1000)];
        let pieces: Vec<(u64, u64, u64)> = split(&ram, 0x10_0000, 0x800, 0x4000)
            .into_iter()
            .map(|(iova, r, off, n)| (iova, r.fd_offset + off, n))
            .collect();
        // 0x800..0x1000 in the first region; the hole 0x1000..0x4000 is skipped; 0x4000..0x4800.
        assert_eq!(
            pieces,
            vec![(0x10_0000, 0x800, 0x800), (0x10_3800, 0x1000, 0x800)]
        );
        assert!(
            split(&ram, 0, 0x2000, 0x1000).is_empty(),
            "a hole maps nothing"
        );
    }

    #[test]
    fn lucid_keeps_bars_command_and_the_msi_body() {
        let o = Owned {
            msi_body: Some(0x52..0x5e),
            msix_body: None,
        };
        for off in [0x04, 0x05, 0x10, 0x27, 0x30, 0x3c, 0x3d, 0x52, 0x5d, 0x100] {
            assert!(o.lucid(off), "{off:#x}");
        }
        for off in [0x00, 0x06, 0x2c, 0x34, 0x3e, 0x50, 0x51, 0x5e, 0xff] {
            assert!(!o.lucid(off), "{off:#x}");
            assert!(o.forwarded(off), "{off:#x}");
        }
        assert!(o.forwarded(0x04), "command writes reach the device too");
        assert!(!o.forwarded(0x10) && !o.forwarded(0x52));
    }

    #[test]
    fn lucid_keeps_the_msix_body_and_the_device_its_header() {
        let o = Owned {
            msi_body: None,
            msix_body: Some(0x72..0x7c),
        };
        // Message control, table and PBA registers are Lucid's: read from its copy, and a
        // write to message control never reaches the device.
        for off in [0x72, 0x73, 0x74, 0x78, 0x7b] {
            assert!(o.lucid(off) && !o.forwarded(off), "{off:#x}");
        }
        // The capability's ID and next pointer, and what follows, are the device's.
        for off in [0x70, 0x71, 0x7c] {
            assert!(!o.lucid(off) && o.forwarded(off), "{off:#x}");
        }
    }

    #[test]
    fn msi_and_msix_are_placed_at_the_devices_offsets() {
        let mut b = vec![0u8; LEGACY_CONFIG_SIZE];
        b[0x50] = CAP_ID_MSI;
        b[0x52] = MSI_64BIT as u8;
        b[0x70] = CAP_ID_MSIX;
        b[0x72..0x74].copy_from_slice(&7u16.to_le_bytes());
        b[0x74..0x78].copy_from_slice(&0x2000u32.to_le_bytes());
        b[0x78..0x7c].copy_from_slice(&0x2u32.to_le_bytes());
        let bars = [Some(0x4000), None, Some(0x1000), None, None, None];
        let l = msix::Layout::parse(&b, 0x70, &bars, 8).unwrap();
        let mut cfg = ConfigSpace::new(PciIds::default());
        let m = UserDevice::place_caps(&mut cfg, &b, Some(0x50), Some(&l))
            .unwrap()
            .unwrap();
        assert_eq!(m.offset(), 0x50);
        assert_eq!(cfg.u8_at(0x70), CAP_ID_MSIX);
        assert_eq!(cfg.u16_at(0x72), 7, "8 vectors, disabled");
        assert_eq!(cfg.u32_at(0x74), 0x2000);
        assert_eq!(cfg.u32_at(0x78), 0x2, "the PBA in BAR 2");
        // The guest may set enable and function mask only.
        cfg.write(0x72, &0xffffu16.to_le_bytes());
        assert_eq!(cfg.u16_at(0x72), 0xc007);
        // MSI-X alone, right after the header.
        let l = msix::Layout::parse(&b, 0x70, &bars, 8).unwrap();
        let mut cfg = ConfigSpace::new(PciIds::default());
        assert!(UserDevice::place_caps(&mut cfg, &b, None, Some(&l))
            .unwrap()
            .is_none());
        assert_eq!(cfg.u8_at(0x70), CAP_ID_MSIX);
    }
}
