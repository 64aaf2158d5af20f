//! The legacy devices every VM has, on the exit hooks: COM1, the debug-exit port, the i8042
//! reset line, the CMOS RTC, the ACPI PM block, the POST port and the two probes guests
//! measure exits with (an ioeventfd port and an MMIO page).

use std::sync::{Arc, Mutex};

use lucid_boot::layout::{self, ports};
use lucid_devices::{BusDevice, Cmos, ConsoleOut, DebugExit, Lifecycle, NopPort, Serial, I8042};
use lucid_hv::IoAddr;
use lucid_stats::StatsRegistry;
use lucid_thread::Spawner;
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::config::VmConfig;
use crate::hooks::ExitHooks;
use crate::VmmError;

/// The legacy devices' parts the VM keeps.
pub(crate) struct LegacyDevices {
    /// The serial console's output, flushed before the run is reported.
    pub console: Arc<ConsoleOut>,
    /// Kept open: the irqfd and ioeventfd registrations refer to them.
    _eventfds: Vec<EventFd>,
}

impl LegacyDevices {
    /// Attaches the devices every VM has, on the exit hooks: COM1 (its interrupt by irqfd on
    /// GSI 4), the debug-exit port, the i8042 reset line, the CMOS RTC, the ACPI PM block, the
    /// POST port, the ioeventfd probe port and the MMIO probe page.
    pub(crate) fn attach(
        config: &VmConfig,
        vm: &lucid_hv::Vm,
        hooks: &ExitHooks,
        lifecycle: &Arc<Lifecycle>,
        stats: &Arc<StatsRegistry>,
        spawner: &Spawner,
    ) -> Result<Self, VmmError> {
        let serial_irq = eventfd("the serial interrupt")?;
        vm.register_irqfd(&serial_irq, 4)?;
        let (serial, listener) = Serial::new(
            &config.devices.serial,
            clone_eventfd(&serial_irq, "the serial interrupt")?,
            stats,
            spawner,
        )
        .map_err(|source| VmmError::Serial {
            output: config.devices.serial.clone(),
            source,
        })?;
        let console = serial.output().clone();
        let serial = Arc::new(Mutex::new(serial));
        let stdin = config.devices.serial_stdin
            && config.devices.serial == lucid_devices::SerialOutput::Stdio;
        Serial::start_input(&serial, listener, stdin, spawner);
        let pio = |base: u16, len: u64, name: &str, dev: Arc<Mutex<dyn BusDevice>>| {
            hooks.pio.insert(base.into(), len, name, dev)
        };
        pio(ports::SERIAL_COM1, 8, "serial", serial)?;
        let debug_exit = DebugExit::new(lifecycle.clone());
        pio(
            ports::DEBUG_EXIT,
            4,
            "debug-exit",
            Arc::new(Mutex::new(debug_exit)),
        )?;
        let i8042 = I8042::new(lifecycle.clone());
        pio(ports::I8042, 5, "i8042", Arc::new(Mutex::new(i8042)))?;
        pio(ports::RTC, 2, "cmos", Arc::new(Mutex::new(Cmos::new())))?;
        crate::acpi_pm::add_acpi_pm(vm, &hooks.pio, lifecycle, stats)?;
        let post = NopPort::new(stats, "post");
        pio(ports::POST, 1, "post", Arc::new(Mutex::new(post)))?;
        // The page probe guests store to when they measure MMIO exits.
        let mmio_probe = NopPort::new(stats, "mmio_probe");
        hooks.mmio.insert(
            layout::PROBE_MMIO,
            0x1000,
            "mmio-probe",
            Arc::new(Mutex::new(mmio_probe)),
        )?;
        Ok(LegacyDevices {
            console,
            _eventfds: vec![serial_irq, ioeventfd_probe(vm, stats)?],
        })
    }
}

/// The ioeventfd behind `ports::IOEVENTFD_PROBE`: writes there never leave the kernel. A stats
/// probe drains the eventfd, so the count of absorbed writes is still reported.
fn ioeventfd_probe(vm: &lucid_hv::Vm, stats: &Arc<StatsRegistry>) -> Result<EventFd, VmmError> {
    let evt = eventfd("the ioeventfd probe")?;
    vm.register_ioeventfd(&evt, IoAddr::Pio(ports::IOEVENTFD_PROBE))?;
    let reader = clone_eventfd(&evt, "the ioeventfd probe")?;
    let count = stats.counter("ioeventfd_probe.signals");
    stats.probe(
        "ioeventfd_probe",
        Box::new(move || {
            // An eventfd read returns the number of writes since the last read.
            if let Ok(n) = reader.read() {
                count.add(n);
            }
            vec![]
        }),
    );
    Ok(evt)
}

pub(crate) fn eventfd(what: &'static str) -> Result<EventFd, VmmError> {
    EventFd::new(EFD_NONBLOCK).map_err(|source| VmmError::EventFd { what, source })
}

pub(crate) fn clone_eventfd(evt: &EventFd, what: &'static str) -> Result<EventFd, VmmError> {
    evt.try_clone()
        .map_err(|source| VmmError::EventFd { what, source })
}
