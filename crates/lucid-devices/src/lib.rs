//! Lucid's device model: buses of address ranges that the exit loop dispatches to, the VM
//! lifecycle that devices can end, and the platform devices every VM has.

#![warn(clippy::print_stdout, clippy::print_stderr)]

mod acpi_pm;
mod bus;
mod cmos;
mod console;
mod debug_exit;
pub mod fw_cfg;
mod i8042;
mod lifecycle;
mod serial;

pub use acpi_pm::{AcpiPm, SciLine, ACPI_PM_LEN, PM_TIMER_HZ};
pub use bus::{Bus, BusDevice, BusError};
pub use cmos::Cmos;
pub use console::{ConsoleOut, FLUSH_PATIENCE};
pub use debug_exit::DebugExit;
pub use fw_cfg::{FwCfg, FwCfgError};
pub use i8042::I8042;
pub use lifecycle::{Lifecycle, StopReason, EXIT_FAILURE, EXIT_USAGE};
pub use serial::{
    BadSerialOption, IrqTrigger, Serial, SerialOutput, CONSOLE_BUFFER, SOCKET_BACKLOG,
};

/// A port that ignores writes and reads as zero (port 0x80 and the like), counting accesses so
/// that probe guests can check exits per operation.
pub struct NopPort {
    pub reads: std::sync::Arc<lucid_stats::Counter>,
    pub writes: std::sync::Arc<lucid_stats::Counter>,
}

impl NopPort {
    pub fn new(stats: &lucid_stats::StatsRegistry, name: &str) -> Self {
        NopPort {
            reads: stats.counter(format!("{name}.reads")),
            writes: stats.counter(format!("{name}.writes")),
        }
    }
}

impl BusDevice for NopPort {
    fn read(&mut self, _offset: u64, data: &mut [u8]) {
        self.reads.inc();
        data.fill(0);
    }
    fn write(&mut self, _offset: u64, _data: &[u8]) {
        self.writes.inc();
    }
}
