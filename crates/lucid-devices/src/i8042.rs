//! The i8042 controller, for what Linux uses it for on a VM: the reset line (command 0xfe).

use std::sync::Arc;

use vm_superio::{I8042Device, Trigger};

use crate::{BusDevice, Lifecycle, StopReason};

struct ResetLine(Arc<Lifecycle>);

impl Trigger for ResetLine {
    type E = std::convert::Infallible;
    fn trigger(&self) -> Result<(), Self::E> {
        self.0.stop(StopReason::Reset);
        Ok(())
    }
}

/// Registered at port 0x60 with length 5 (0x60..=0x64); offset 4 is the command port.
pub struct I8042(I8042Device<ResetLine>);

impl I8042 {
    pub fn new(lifecycle: Arc<Lifecycle>) -> Self {
        I8042(I8042Device::new(ResetLine(lifecycle)))
    }
}

impl BusDevice for I8042 {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        if data.len() == 1 && (offset == 0 || offset == 4) {
            data[0] = self.0.read(offset as u8);
        } else {
            data.fill(0xff);
        }
    }
    fn write(&mut self, offset: u64, data: &[u8]) {
        if data.len() == 1 && (offset == 0 || offset == 4) {
            let _ = self.0.write(offset as u8, data[0]);
        }
    }
}
