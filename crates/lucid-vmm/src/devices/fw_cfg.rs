//! QEMU's fw_cfg (`lucid_devices::fw_cfg`) with what this VM is: its vCPU count, RAM size and
//! RAM map (`etc/e820`) at build time, the kernel command line once the kernel is loaded.

use std::sync::{Arc, Mutex};

use lucid_boot::layout::ports;
use lucid_devices::fw_cfg::{e820_file, E820_RAM, FW_CFG_LEN};
use lucid_devices::FwCfg;
use lucid_mem::DmaPath;
use lucid_stats::StatsRegistry;

use crate::builder::VmBuilder;
use crate::config::VmConfig;
use crate::hooks::ExitHooks;
use crate::VmmError;

/// Puts fw_cfg on its ports; the command line is set by [`crate::boot::load_kernel`].
pub(crate) fn attach(
    config: &VmConfig,
    builder: &VmBuilder,
    dma: &Arc<DmaPath>,
    hooks: &ExitHooks,
    stats: &StatsRegistry,
) -> Result<Arc<Mutex<FwCfg>>, VmmError> {
    let mut dev = FwCfg::new(Some(dma.clone()), stats);
    dev.set_cpus(config.machine.vcpus.into());
    dev.set_ram_size(builder.ram().size());
    let ram: Vec<(u64, u64, u32)> = builder
        .ram()
        .regions()
        .iter()
        .map(|r| (r.gpa, r.size, E820_RAM))
        .collect();
    dev.add_file("etc/e820", e820_file(&ram))
        .map_err(|e| VmmError::BackEnd {
            device: "fw_cfg".into(),
            source: Box::new(e),
        })?;
    let dev = Arc::new(Mutex::new(dev));
    hooks
        .pio
        .insert(ports::FW_CFG.into(), FW_CFG_LEN, "fw_cfg", dev.clone())?;
    Ok(dev)
}
