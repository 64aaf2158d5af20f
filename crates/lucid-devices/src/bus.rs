//! A bus of address ranges (I/O ports or MMIO). Devices register ranges; the exit loop looks up
//! the range that holds an address and calls the device with the offset into its range. Ranges
//! can be added and removed while the VM runs (BAR moves, hot-plug, symbiotic modules).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, RwLock};

/// A device on a bus. `offset` is relative to the start of the range it was registered at.
pub trait BusDevice: Send {
    fn read(&mut self, offset: u64, data: &mut [u8]);
    fn write(&mut self, offset: u64, data: &[u8]);
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum BusError {
    #[error("{name}: range {base:#x}+{len:#x} overlaps {other} at {other_base:#x}")]
    Overlap {
        name: String,
        base: u64,
        len: u64,
        other: String,
        other_base: u64,
    },
    #[error("{name}: empty or wrapping range {base:#x}+{len:#x}")]
    BadRange { name: String, base: u64, len: u64 },
}

struct Entry {
    len: u64,
    name: String,
    dev: Arc<Mutex<dyn BusDevice>>,
}

#[derive(Default)]
pub struct Bus {
    ranges: RwLock<BTreeMap<u64, Entry>>,
}

impl Bus {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn insert(
        &self,
        base: u64,
        len: u64,
        name: &str,
        dev: Arc<Mutex<dyn BusDevice>>,
    ) -> Result<(), BusError> {
        if len == 0 || base.checked_add(len).is_none() {
            return Err(BusError::BadRange {
                name: name.into(),
                base,
                len,
            });
        }
        let mut ranges = self.ranges.write().unwrap_or_else(|e| e.into_inner());
        let clash = ranges
            .range(..base + len)
            .next_back()
            .filter(|(b, e)| **b + e.len > base);
        if let Some((b, e)) = clash {
            return Err(BusError::Overlap {
                name: name.into(),
                base,
                len,
                other: e.name.clone(),
                other_base: *b,
            });
        }
        ranges.insert(
            base,
            Entry {
                len,
                name: name.into(),
                dev,
            },
        );
        Ok(())
    }

    /// Removes the range starting at `base`; returns whether there was one.
    pub fn remove(&self, base: u64) -> bool {
        self.ranges
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&base)
            .is_some()
    }

    fn find(&self, addr: u64, len: usize) -> Option<(u64, Arc<Mutex<dyn BusDevice>>)> {
        let ranges = self.ranges.read().unwrap_or_else(|e| e.into_inner());
        let (base, e) = ranges.range(..=addr).next_back()?;
        let end = addr.checked_add(len as u64)?;
        (end <= base + e.len).then(|| (addr - base, e.dev.clone()))
    }

    /// Dispatches a read; returns false when no device claims the whole access.
    pub fn read(&self, addr: u64, data: &mut [u8]) -> bool {
        match self.find(addr, data.len()) {
            Some((off, dev)) => {
                dev.lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .read(off, data);
                true
            }
            None => false,
        }
    }

    /// Dispatches a write; returns false when no device claims the whole access.
    pub fn write(&self, addr: u64, data: &[u8]) -> bool {
        match self.find(addr, data.len()) {
            Some((off, dev)) => {
                dev.lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .write(off, data);
                true
            }
            None => false,
        }
    }

    /// (base, len, name) of every range, for `lucid` diagnostics.
    pub fn ranges(&self) -> Vec<(u64, u64, String)> {
        self.ranges
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .map(|(b, e)| (*b, e.len, e.name.clone()))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Reg(u8);
    impl BusDevice for Reg {
        fn read(&mut self, offset: u64, data: &mut [u8]) {
            data.fill(self.0 + offset as u8);
        }
        fn write(&mut self, _offset: u64, data: &[u8]) {
            self.0 = data[0];
        }
    }

    #[test]
    fn dispatch_overlap_and_removal() {
        let bus = Bus::new();
        bus.insert(0x10, 4, "a", Arc::new(Mutex::new(Reg(1))))
            .unwrap();
        assert!(matches!(
            bus.insert(0x12, 4, "b", Arc::new(Mutex::new(Reg(2)))),
            Err(BusError::Overlap { .. })
        ));
        assert!(matches!(
            bus.insert(0x0e, 4, "b", Arc::new(Mutex::new(Reg(2)))),
            Err(BusError::Overlap { .. })
        ));
        bus.insert(0x14, 4, "c", Arc::new(Mutex::new(Reg(5))))
            .unwrap();
        let mut d = [0u8; 1];
        assert!(bus.read(0x12, &mut d));
        assert_eq!(d[0], 3);
        assert!(bus.write(0x10, &[9]));
        assert!(bus.read(0x10, &mut d));
        assert_eq!(d[0], 9);
        // An access straddling the end of a range is not claimed.
        assert!(!bus.read(0x13, &mut [0u8; 2]));
        assert!(!bus.read(0x100, &mut d));
        assert!(bus.remove(0x10));
        assert!(!bus.read(0x10, &mut d));
        assert!(bus
            .insert(u64::MAX, 2, "wrap", Arc::new(Mutex::new(Reg(0))))
            .is_err());
    }
}
