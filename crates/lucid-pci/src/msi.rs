//! Plain MSI (PCI Local Bus 3.0, 6.8.1): the capability in configuration space and the message a
//! function sends. The guest's writes go through the capability's write masks, so the state lives
//! in config space; [`MsiCap`] knows the layout and reads it back.
//!
//! Supported: 1-32 vectors (a power of two), 32- or 64-bit message address, no per-vector
//! masking. Message control: enable (RW), multiple message capable (RO), multiple message enable
//! (RW), 64-bit capable (RO); the address's low two bits are reserved (read 0); message data is
//! 16 bits.

use lucid_hv::MsiMessage;

use crate::config::{ConfigSpace, CAP_ID_MSI};
use crate::{CapProblem, PciError};

/// Message control bits.
pub const MSI_ENABLE: u16 = 1 << 0;
pub const MSI_MMC_SHIFT: u16 = 1;
pub const MSI_MME_SHIFT: u16 = 4;
pub const MSI_MME_MASK: u16 = 0x7 << MSI_MME_SHIFT;
pub const MSI_64BIT: u16 = 1 << 7;

/// Where a function's MSI capability is and what it can do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MsiCap {
    offset: usize,
    is64: bool,
    /// log2 of the vectors the function asks for (multiple message capable).
    mmc: u8,
}

impl MsiCap {
    /// Appends an MSI capability offering `vectors` (1, 2, 4, 8, 16 or 32), 64-bit capable
    /// when `is64`. Disabled, address and data zero, as after reset.
    pub fn add(cfg: &mut ConfigSpace, vectors: u8, is64: bool) -> Result<Self, PciError> {
        let body_len = if is64 { 12 } else { 8 };
        if !vectors.is_power_of_two() || vectors > 32 {
            return Err(PciError::Capability {
                id: CAP_ID_MSI,
                len: 2 + body_len,
                problem: CapProblem::Vectors { vectors },
            });
        }
        let mmc = vectors.trailing_zeros() as u8;
        let ctrl = (u16::from(mmc) << MSI_MMC_SHIFT) | if is64 { MSI_64BIT } else { 0 };
        let mut body = vec![0u8; body_len];
        body[..2].copy_from_slice(&ctrl.to_le_bytes());
        let mut wmask = vec![0u8; body_len];
        wmask[..2].copy_from_slice(&(MSI_ENABLE | MSI_MME_MASK).to_le_bytes());
        wmask[2..6].copy_from_slice(&0xffff_fffcu32.to_le_bytes());
        if is64 {
            wmask[6..10].fill(0xff);
        }
        wmask[body_len - 2..].fill(0xff);
        let offset = cfg.add_capability(CAP_ID_MSI, &body, &wmask)?;
        Ok(MsiCap { offset, is64, mmc })
    }

    /// The capability's offset in config space (message control is at +2).
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// Offset and length of the message control register, for "did this write touch it".
    pub fn control_range(&self) -> (usize, usize) {
        (self.offset + 2, 2)
    }

    pub fn control(&self, cfg: &ConfigSpace) -> u16 {
        cfg.u16_at(self.offset + 2)
    }

    pub fn enabled(&self, cfg: &ConfigSpace) -> bool {
        self.control(cfg) & MSI_ENABLE != 0
    }

    /// How many vectors the driver enabled (multiple message enable, capped at what the
    /// function offers: a larger value is undefined in the spec).
    pub fn enabled_vectors(&self, cfg: &ConfigSpace) -> u32 {
        let mme = (self.control(cfg) & MSI_MME_MASK) >> MSI_MME_SHIFT;
        1 << mme.min(u16::from(self.mmc))
    }

    /// The message for `vector`: None while MSI is disabled or for a vector beyond those
    /// enabled. With several vectors enabled the function puts the vector number in the low
    /// bits of the data.
    pub fn message(&self, cfg: &ConfigSpace, vector: u32) -> Option<MsiMessage> {
        let n = self.enabled_vectors(cfg);
        if !self.enabled(cfg) || vector >= n {
            return None;
        }
        let lo = u64::from(cfg.u32_at(self.offset + 4));
        let (hi, data_off) = match self.is64 {
            true => (u64::from(cfg.u32_at(self.offset + 8)), self.offset + 12),
            false => (0, self.offset + 8),
        };
        let data = u32::from(cfg.u16_at(data_off));
        Some(MsiMessage {
            address: hi << 32 | lo,
            data: (data & !(n - 1)) | vector,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{touches, STATUS, STATUS_CAP_LIST};

    fn w(c: &mut ConfigSpace, off: usize, v: u32) {
        c.write(off, &v.to_le_bytes());
    }

    #[test]
    fn layout_and_write_masks_64bit() {
        let mut c = ConfigSpace::new(Default::default());
        let m = MsiCap::add(&mut c, 1, true).unwrap();
        let o = m.offset();
        assert_eq!(o, 0x40);
        assert_ne!(c.u16_at(STATUS) & STATUS_CAP_LIST, 0);
        assert_eq!(c.u8_at(o), CAP_ID_MSI);
        assert_eq!(c.u16_at(o + 2), MSI_64BIT, "1 vector, 64-bit, disabled");
        // Everything writable at once: only the masked bits stick.
        c.write(o + 2, &[0xff; 12]);
        assert_eq!(
            c.u16_at(o + 2),
            MSI_64BIT | MSI_ENABLE | MSI_MME_MASK,
            "MMC, 64-bit and per-vector masking are read-only"
        );
        assert_eq!(c.u32_at(o + 4), 0xffff_fffc, "address bits 1:0 reserved");
        assert_eq!(c.u32_at(o + 8), 0xffff_ffff);
        assert_eq!(c.u16_at(o + 12), 0xffff);
        assert_eq!(c.u8_at(o + 1), 0, "next pointer is read-only");
        assert!(touches(o + 2, 1, m.control_range().0, m.control_range().1));
    }

    #[test]
    fn message_follows_enable_and_vectors() {
        let mut c = ConfigSpace::new(Default::default());
        let m = MsiCap::add(&mut c, 4, true).unwrap();
        let o = m.offset();
        assert_eq!(c.u16_at(o + 2), MSI_64BIT | 2 << MSI_MMC_SHIFT);
        w(&mut c, o + 4, 0xfee0_100f);
        w(&mut c, o + 8, 0);
        c.write(o + 12, &0x4123u16.to_le_bytes());
        assert_eq!(m.message(&c, 0), None, "disabled");
        c.write(o + 2, &MSI_ENABLE.to_le_bytes());
        assert_eq!(
            m.message(&c, 0),
            Some(MsiMessage {
                address: 0xfee0_100c,
                data: 0x4123
            })
        );
        assert_eq!(m.message(&c, 1), None, "one vector enabled");
        c.write(o + 2, &(MSI_ENABLE | 7 << MSI_MME_SHIFT).to_le_bytes());
        assert_eq!(m.enabled_vectors(&c), 4, "MME above MMC is capped");
        assert_eq!(m.message(&c, 3).unwrap().data, 0x4123);
        assert_eq!(m.message(&c, 2).unwrap().data, 0x4122);
        assert_eq!(m.message(&c, 4), None);
        w(&mut c, o + 8, 1);
        assert_eq!(m.message(&c, 0).unwrap().address, 0x1_fee0_100c);
    }

    #[test]
    fn thirty_two_bit_layout_and_bad_vector_counts() {
        let mut c = ConfigSpace::new(Default::default());
        let m = MsiCap::add(&mut c, 1, false).unwrap();
        let o = m.offset();
        c.write(o + 2, &[0xff; 8]);
        assert_eq!(c.u16_at(o + 2), MSI_ENABLE | MSI_MME_MASK);
        assert_eq!(c.u16_at(o + 8), 0xffff, "data right after a 32-bit address");
        assert_eq!(m.message(&c, 0).unwrap().address, 0xffff_fffc);
        for bad in [0u8, 3, 64] {
            assert!(MsiCap::add(&mut c, bad, true).is_err(), "{bad} vectors");
        }
    }
}
