//! Wires the emulated VT-d (`--iommu vtd`) into a VM: the DMA path's translator, the GSI router's
//! interrupt remapper, the register window (trapping, or in sidecore mode a shared page that
//! `lucid-vtd-sc` polls plus a trapping page), and the guest's REPORT hypercall.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::thread::JoinHandle;

use lucid_devices::BusDevice;
use lucid_hv::kvm_bindings::kvm_regs;
use lucid_hv::GsiRouter;
use lucid_iommu::{EmulationMode, MlockPinner, MsiSink, Vtd, VtdConfig, VTD_BASE, VTD_SIZE};
use lucid_mem::vm_memory::{GuestAddress, GuestMemoryBackend};
use lucid_mem::{Backing, DmaPath, GuestMemoryMmap, GuestRam};
use lucid_seccomp::Role;
use lucid_stats::{StatsRegistry, ThreadRole};
use lucid_thread::{Spawner, ThreadSpec};

use crate::hooks::{ExitHooks, HookError, HYPERCALL_UNKNOWN};
use crate::hypercall;
use crate::VmmError;

/// One register page.
const PAGE: u64 = 0x1000;

/// The unit's own MSIs (fault events, invalidation completion) go straight to KVM: they are not
/// subject to remapping.
struct KvmMsiSink(lucid_hv::Vm);

impl MsiSink for KvmMsiSink {
    fn send(&self, address: u64, data: u32) {
        if let Err(e) = self.0.signal_msi(address, data) {
            log::debug!("VT-d MSI {address:#x}/{data:#x} not delivered: {e}");
        }
    }
}

/// A trapping part of the register window: `first` is its offset in the window.
struct VtdMmio {
    vtd: Arc<Vtd>,
    first: u64,
}

impl BusDevice for VtdMmio {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        self.vtd.read(self.first + offset, data)
    }
    fn write(&mut self, offset: u64, data: &[u8]) {
        self.vtd.write(self.first + offset, data)
    }
}

/// The VM's vIOMMU and what keeps it running.
pub(crate) struct Iommu {
    pub vtd: Arc<Vtd>,
    stop: Arc<AtomicBool>,
    sidecore: Option<JoinHandle<()>>,
    /// Sidecore: the shared register page (a memfd page, also a KVM memory slot).
    _page: Option<GuestMemoryMmap>,
}

impl Iommu {
    /// Builds the unit for `cfg` and installs it: the DMA translator (before any device is
    /// attached, so that transports see `has_translator()`), the router's remapper, the register
    /// window and, in sidecore mode, the polling thread.
    #[allow(clippy::too_many_arguments)]
    pub fn build(
        cfg: VtdConfig,
        vm: &lucid_hv::Vm,
        mem: &GuestMemoryMmap,
        dma: &DmaPath,
        router: &Arc<GsiRouter>,
        hooks: &ExitHooks,
        stats: &Arc<StatsRegistry>,
        spawner: &Spawner,
    ) -> Result<Self, VmmError> {
        let vtd = Vtd::new(
            cfg,
            mem.clone(),
            Arc::new(KvmMsiSink(vm.clone())),
            Arc::new(MlockPinner::new(mem.clone())),
            stats,
        );
        dma.set_translator(Some(vtd.clone()));
        router.set_remapper(Some(vtd.clone()));
        let blocked = Arc::downgrade(router);
        stats.probe(
            "irq",
            Box::new(move || match blocked.upgrade() {
                Some(r) => vec![("remap_blocked".to_string(), r.blocked())],
                None => vec![],
            }),
        );

        let (trap_from, page) = match cfg.mode {
            EmulationMode::Samecore => (0, None),
            EmulationMode::Sidecore => (PAGE, Some(shared_page(vm, &vtd)?)),
        };
        // Weak: the Vtd owns this closure and the router holds the Vtd. The closure also holds
        // the shared page's mapping, so that it lives as long as the Vtd that points into it.
        let weak: Weak<GsiRouter> = Arc::downgrade(router);
        let keep = page.clone();
        vtd.on_ir_change(Box::new(move || {
            let _page = &keep;
            if let Some(r) = weak.upgrade() {
                if let Err(e) = r.refresh() {
                    log::warn!("VT-d: re-installing the remapped MSI routes: {e}");
                }
            }
        }));
        hooks.mmio.insert(
            VTD_BASE + trap_from,
            VTD_SIZE - trap_from,
            "vtd",
            Arc::new(Mutex::new(VtdMmio {
                vtd: vtd.clone(),
                first: trap_from,
            })),
        )?;

        let stop = Arc::new(AtomicBool::new(false));
        let sidecore = match cfg.mode {
            EmulationMode::Samecore => None,
            EmulationMode::Sidecore => Some(spawn_sidecore(&vtd, &stop, spawner)?),
        };
        log::info!(
            "vIOMMU: VT-d at {VTD_BASE:#x}, {:?}, pin {:?}",
            cfg.mode,
            cfg.pin
        );
        Ok(Iommu {
            vtd,
            stop,
            sidecore,
            _page: page,
        })
    }

    /// Stops and joins the sidecore thread (when there is one).
    pub fn stop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.sidecore.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Iommu {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The vIOMMU as one of the VM's techniques: built (and its sidecore started) before any
/// device, stopped after the vCPU threads and before the devices whose DMA it translates go.
impl crate::technique::Technique for Iommu {
    fn name(&self) -> &'static str {
        "viommu"
    }

    fn stop(&mut self) {
        Iommu::stop(self);
    }

    fn counters(&self) -> &'static [&'static str] {
        &["iommu.", "irq."]
    }

    fn summary(&self) -> Vec<String> {
        vec![format!(
            "VT-d at {VTD_BASE:#x}{}",
            if self.sidecore.is_some() {
                ", sidecore"
            } else {
                ", samecore"
            }
        )]
    }
}

/// Sidecore: register page 0 as guest memory the guest reads and writes without exits: one
/// 4 KiB memfd page, a KVM memory slot at `VTD_BASE` (numbered after the RAM slots) and mapped
/// here, handed to the Vtd.
fn shared_page(vm: &lucid_hv::Vm, vtd: &Vtd) -> Result<GuestMemoryMmap, VmmError> {
    let ram = GuestRam::new(&[(VTD_BASE, PAGE)], Backing::SharedMemfd)?;
    let page = ram.memory().clone();
    vm.map_memory(&page)?;
    let host = page
        .get_host_address(GuestAddress(VTD_BASE))
        .map_err(|_| lucid_hv::HvError::BadMemory(VTD_BASE))?;
    // SAFETY: `host` is the start of the 4 KiB mapping of `page`, which lives as long as the Vtd:
    // a clone is moved into the Vtd's own on_ir_change closure (see `Iommu::build`), and the
    // KVM VM keeps another for as long as the slot exists.
    unsafe { vtd.attach_shared_page(host) };
    Ok(page)
}

fn spawn_sidecore(
    vtd: &Arc<Vtd>,
    stop: &Arc<AtomicBool>,
    spawner: &Spawner,
) -> Result<JoinHandle<()>, VmmError> {
    let (vtd, stop) = (vtd.clone(), stop.clone());
    let spec = ThreadSpec::new("lucid-vtd-sc", ThreadRole::Other, Role::Iommu);
    Ok(spawner.spawn(spec, move |confined| {
        if let Err(e) = confined {
            // Never run unconfined; the guest sees a unit that stopped responding.
            log::error!("lucid-vtd-sc: {e}");
            return;
        }
        vtd.run_sidecore(&stop)
    })?)
}

/// What Linux needs on its command line with the vIOMMU: `intremap=off` unless the user chose.
///
/// Lucid's I/O APIC is KVM's in-kernel one, which knows only the compatibility format of a
/// redirection entry. A Linux that turns interrupt remapping on writes its I/O APIC entries in
/// the remappable format (an IRTE index where the destination was), which KVM's I/O APIC would
/// deliver to the wrong vCPU or vector: QEMU refuses `intremap=on` with `kernel-irqchip=on` for
/// the same reason. DMA remapping is unaffected; MSIs are then not remapped for Linux.
pub(crate) fn linux_cmdline(cmdline: String) -> String {
    if cmdline
        .split_whitespace()
        .any(|w| w.starts_with("intremap="))
    {
        return cmdline;
    }
    log::info!(
        "vIOMMU: Linux gets intremap=off (KVM's in-kernel I/O APIC cannot take remappable \
         redirection entries); DMA remapping stays on"
    );
    format!("{cmdline} intremap=off").trim().to_string()
}

/// Hypercall REPORT (rdi = key, rsi = value): the guest's own figures for its mappings, kept as
/// `iommu.guest.<key>` counters (set, not added). Unknown keys return `HYPERCALL_UNKNOWN`.
pub(crate) fn add_report_hypercall(
    hooks: &ExitHooks,
    stats: &Arc<StatsRegistry>,
) -> Result<(), HookError> {
    let stats = Arc::downgrade(stats);
    hooks.add_hypercall(
        hypercall::REPORT,
        Arc::new(move |_: u32, regs: &kvm_regs| {
            let (Some(name), Some(stats)) = (hypercall::report_key(regs.rdi), stats.upgrade())
            else {
                return HYPERCALL_UNKNOWN;
            };
            stats.counter(format!("iommu.guest.{name}")).set(regs.rsi);
            0
        }),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn linux_gets_intremap_off_unless_the_user_chose() {
        assert_eq!(
            linux_cmdline("console=ttyS0".into()),
            "console=ttyS0 intremap=off"
        );
        assert_eq!(linux_cmdline(String::new()), "intremap=off");
        let mine = "console=ttyS0 intremap=on".to_string();
        assert_eq!(linux_cmdline(mine.clone()), mine);
    }
}
