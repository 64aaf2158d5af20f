//! QEMU's `isa-debug-exit`: a guest write of `v` ends the VM, and Lucid exits with `(v << 1) | 1`.

use std::sync::Arc;

use crate::{BusDevice, Lifecycle, StopReason};

pub struct DebugExit {
    lifecycle: Arc<Lifecycle>,
}

impl DebugExit {
    pub fn new(lifecycle: Arc<Lifecycle>) -> Self {
        DebugExit { lifecycle }
    }
}

impl BusDevice for DebugExit {
    fn read(&mut self, _offset: u64, data: &mut [u8]) {
        data.fill(0xff);
    }
    fn write(&mut self, _offset: u64, data: &[u8]) {
        let mut v = [0u8; 4];
        let n = data.len().min(4);
        v[..n].copy_from_slice(&data[..n]);
        self.lifecycle
            .stop(StopReason::DebugExit(u32::from_le_bytes(v)));
    }
}
