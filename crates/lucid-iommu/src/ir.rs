//! Interrupt remapping (VT-d spec chapter 5, xAPIC destinations): remappable-format MSIs are
//! looked up in the interrupt-remapping table latched by GCMD.SIRTP, validated, and rewritten
//! into the compatibility-format message KVM delivers. Faults 0x20-0x26 are recorded in the
//! fault-recording registers with the interrupt index in FI bits 63:48.

use std::sync::atomic::Ordering;

use lucid_hv::{MsiMessage, MsiRemapper};

use crate::regs::{G_CFI, G_IRE};
use crate::tables::{read_u64, ADDR_MASK};
use crate::{Vtd, IRT_VALID};

/// Reserved field in an interrupt request (remappable format).
pub const FR_IR_REQ_RSVD: u8 = 0x20;
/// The index is beyond the table's size.
pub const FR_IR_INDEX: u8 = 0x21;
/// The IRTE is not present.
pub const FR_IR_NOT_PRESENT: u8 = 0x22;
/// The table could not be read (no table latched, or outside guest RAM).
pub const FR_IR_TABLE: u8 = 0x23;
/// Reserved field set in a present IRTE (posted format, reserved delivery mode or SVT too).
pub const FR_IR_IRTE_RSVD: u8 = 0x24;
/// A compatibility-format interrupt while IR is on and CFIS is clear.
pub const FR_IR_COMPAT: u8 = 0x25;
/// The requester failed the IRTE's source-id verification.
pub const FR_IR_SID: u8 = 0x26;

/// Low qword reserved bits of an IRTE in xAPIC mode: 14:12, IM (15, posted), 31:24,
/// DST bits 7:0 (39:32) and DST bits 31:16 (63:48).
const IRTE_LO_RSVD: u64 = 0x7000 | 0x8000 | 0xff00_0000 | 0xff << 32 | 0xffff << 48;

/// A lookup failure: reason, interrupt index, and whether the IRTE asked for no recording.
struct IrFault(u8, u32, bool);

impl Vtd {
    fn ir_lookup(&self, source: u16, msg: MsiMessage) -> Result<MsiMessage, IrFault> {
        let a = msg.address;
        let handle = ((a >> 5) & 0x7fff) as u32 | (((a >> 2) & 1) as u32) << 15;
        let shv = a & 8 != 0;
        let mut index = handle;
        if shv {
            if msg.data >> 16 != 0 {
                return Err(IrFault(FR_IR_REQ_RSVD, handle, false));
            }
            index += msg.data & 0xffff;
        }
        let irt = self.irt.load(Ordering::Acquire);
        if irt & IRT_VALID == 0 {
            return Err(IrFault(FR_IR_TABLE, index, false));
        }
        let entries = 1u64 << ((irt & 0xf) + 1);
        if u64::from(index) >= entries {
            return Err(IrFault(FR_IR_INDEX, index, false));
        }
        let e = (irt & ADDR_MASK) + u64::from(index) * 16;
        let (lo, hi) = match (read_u64(&self.mem, e), read_u64(&self.mem, e + 8)) {
            (Some(l), Some(h)) => (l, h),
            _ => return Err(IrFault(FR_IR_TABLE, index, false)),
        };
        let fpd = lo & 2 != 0;
        if lo & 1 == 0 {
            return Err(IrFault(FR_IR_NOT_PRESENT, index, fpd));
        }
        let dlm = (lo >> 5) & 7;
        let svt = (hi >> 18) & 3;
        if lo & IRTE_LO_RSVD != 0 || hi >> 20 != 0 || dlm == 3 || dlm == 6 || svt == 3 {
            return Err(IrFault(FR_IR_IRTE_RSVD, index, fpd));
        }
        let sid = hi as u16;
        let ok = match svt {
            1 => {
                let mask: u16 = match (hi >> 16) & 3 {
                    0 => 0xffff,
                    1 => !4,
                    2 => !6,
                    _ => !7,
                };
                source & mask == sid & mask
            }
            2 => (sid >> 8..=sid & 0xff).contains(&(source >> 8)),
            _ => true,
        };
        if !ok {
            return Err(IrFault(FR_IR_SID, index, fpd));
        }
        let apic = (lo >> 40) & 0xff;
        Ok(MsiMessage {
            address: 0xfee0_0000 | apic << 12 | (lo & 8) | (lo & 4),
            data: ((lo >> 16) & 0xff) as u32 | (dlm as u32) << 8 | (((lo >> 4) & 1) as u32) << 15,
        })
    }

    fn ir_fault(&self, source: u16, f: IrFault) {
        self.c.faults_ir.inc();
        log::debug!(
            "vtd: interrupt-remapping fault {:#x}: source {source:#x} index {}",
            f.0,
            f.1
        );
        if f.2 {
            return;
        }
        self.with_state_cb(false, |st, fx| {
            self.record_fault(st, fx, source, u64::from(f.1) << 48, f.0, false)
        });
    }
}

impl MsiRemapper for Vtd {
    fn remap(&self, source: u16, msg: MsiMessage) -> Option<MsiMessage> {
        let g = self.gsts.load(Ordering::Acquire);
        let a = msg.address;
        // Not IR-enabled, or not an interrupt request at all: unchanged.
        if g & G_IRE == 0 || a >> 32 != 0 || (a >> 20) & 0xfff != 0xfee {
            return Some(msg);
        }
        if a & 0x10 == 0 {
            if g & G_CFI != 0 {
                return Some(msg);
            }
            self.ir_fault(source, IrFault(FR_IR_COMPAT, 0, false));
            return None;
        }
        match self.ir_lookup(source, msg) {
            Ok(m) => Some(m),
            Err(f) => {
                self.ir_fault(source, f);
                None
            }
        }
    }
}
