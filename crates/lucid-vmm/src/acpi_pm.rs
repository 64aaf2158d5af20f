//! Wires the ACPI fixed hardware (`lucid_devices::AcpiPm`: PM1a event and control blocks, PM
//! timer) into a VM, where the FADT of `lucid_boot::AcpiConfig::pm` says it is: its ports at
//! `ACPI_PM_BASE`, its SCI on IRQ 9 of the in-kernel PIC and IOAPIC, and `\_S5_`'s sleep type.

use std::sync::{Arc, Mutex};

use lucid_boot::acpi::SLP_TYP_S5;
use lucid_boot::layout::{ports, ACPI_SCI_IRQ};
use lucid_devices::{AcpiPm, Bus, Lifecycle, SciLine, ACPI_PM_LEN};
use lucid_stats::StatsRegistry;

use crate::VmmError;

/// Registers the ACPI PM device on `pio`.
pub(crate) fn add_acpi_pm(
    vm: &lucid_hv::Vm,
    pio: &Bus,
    lifecycle: &Arc<Lifecycle>,
    stats: &StatsRegistry,
) -> Result<(), VmmError> {
    let line = vm.clone();
    let sci: SciLine = Box::new(move |level| {
        if let Err(e) = line.set_irq_line(u32::from(ACPI_SCI_IRQ), level) {
            log::error!("ACPI SCI (IRQ {ACPI_SCI_IRQ}) level {level}: {e}");
        }
    });
    let pm = AcpiPm::new(lifecycle.clone(), SLP_TYP_S5, sci, stats);
    pio.insert(
        u64::from(ports::ACPI_PM_BASE),
        ACPI_PM_LEN,
        "acpi-pm",
        Arc::new(Mutex::new(pm)),
    )?;
    Ok(())
}
