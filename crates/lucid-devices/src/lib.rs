//! Lucid's device model: buses of address ranges that the exit loop dispatches to, the VM
//! lifecycle that devices can end, and the platform devices every VM has.

mod bus;
mod cmos;
mod debug_exit;
mod i8042;
mod lifecycle;
mod serial;

pub use bus::{Bus, BusDevice, BusError};
pub use cmos::Cmos;
pub use debug_exit::DebugExit;
pub use i8042::I8042;
pub use lifecycle::{Lifecycle, StopReason};
pub use serial::{IrqTrigger, Serial, SerialOutput};

/// A device that ignores writes and reads as zero (port 0x80 and the like).
pub struct Sink;

impl BusDevice for Sink {
    fn read(&mut self, _offset: u64, data: &mut [u8]) {
        data.fill(0);
    }
    fn write(&mut self, _offset: u64, _data: &[u8]) {}
}
