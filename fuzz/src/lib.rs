//! What the fuzz targets share: the guest-access encoding of the register-level targets.
//!
//! An input is a sequence of 16-byte records, each one guest access: `kind`, `flags` (the size,
//! 1/2/4/8 bytes, in bits 0-1; a write when bit 2 is set), a 16-bit selector, a 32-bit address
//! and a 64-bit value, little-endian. Each target says what `kind`, the selector and the address
//! mean to it. Seeds are written in this encoding by `fuzz/seeds/make.py`.

/// One guest access.
#[derive(Clone, Copy, Debug)]
pub struct Access {
    pub kind: u8,
    pub size: usize,
    pub write: bool,
    pub sel: u16,
    pub addr: u32,
    pub val: u64,
}

pub const RECORD: usize = 16;

impl Access {
    /// The accesses in `data` (a trailing partial record is ignored), at most `max`.
    pub fn parse(data: &[u8], max: usize) -> impl Iterator<Item = Access> + '_ {
        data.chunks_exact(RECORD).take(max).map(|r| Access {
            kind: r[0],
            size: 1 << (r[1] & 3),
            write: r[1] & 4 != 0,
            sel: u16::from_le_bytes([r[2], r[3]]),
            addr: u32::from_le_bytes([r[4], r[5], r[6], r[7]]),
            val: u64::from_le_bytes(r[8..16].try_into().expect("8 bytes")),
        })
    }

    /// Performs the access on `bus` at `addr`.
    pub fn on(&self, bus: &lucid_devices::Bus, addr: u64) {
        if self.write {
            bus.write(addr, &self.val.to_le_bytes()[..self.size]);
        } else {
            let mut d = [0u8; 8];
            bus.read(addr, &mut d[..self.size]);
        }
    }
}
