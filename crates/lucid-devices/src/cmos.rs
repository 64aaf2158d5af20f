//! A minimal MC146818 CMOS RTC at ports 0x70/0x71: the host's wall-clock time in BCD, update
//! never in progress, so Linux reads the time at boot without waiting.

use crate::BusDevice;

pub struct Cmos {
    index: u8,
    nvram: [u8; 128],
}

impl Default for Cmos {
    fn default() -> Self {
        Cmos {
            index: 0,
            nvram: [0; 128],
        }
    }
}

impl Cmos {
    pub fn new() -> Self {
        Self::default()
    }

    fn time_reg(&self, reg: u8) -> Option<u8> {
        // SAFETY: time(NULL) and gmtime_r into a zeroed struct tm owned by this frame.
        let tm = unsafe {
            let t = libc::time(std::ptr::null_mut());
            let mut tm: libc::tm = std::mem::zeroed();
            libc::gmtime_r(&t, &mut tm);
            tm
        };
        let bcd = |v: i32| -> u8 { (((v / 10) << 4) | (v % 10)) as u8 };
        Some(match reg {
            0x00 => bcd(tm.tm_sec),
            0x02 => bcd(tm.tm_min),
            0x04 => bcd(tm.tm_hour),
            0x06 => bcd(tm.tm_wday + 1),
            0x07 => bcd(tm.tm_mday),
            0x08 => bcd(tm.tm_mon + 1),
            0x09 => bcd(tm.tm_year % 100),
            0x32 => bcd(1900 + tm.tm_year / 100),
            0x0a => 0x26, // 32.768 kHz divider, update not in progress
            0x0b => 0x02, // 24-hour, BCD
            0x0c => 0x00,
            0x0d => 0x80, // battery good
            _ => return None,
        })
    }
}

impl BusDevice for Cmos {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        let v = match offset {
            0 => self.index,
            _ => {
                let reg = self.index & 0x7f;
                self.time_reg(reg).unwrap_or(self.nvram[reg as usize])
            }
        };
        data.fill(0);
        if let Some(b) = data.first_mut() {
            *b = v;
        }
    }
    fn write(&mut self, offset: u64, data: &[u8]) {
        let Some(&v) = data.first() else { return };
        match offset {
            0 => self.index = v & 0x7f,
            _ => {
                let reg = self.index & 0x7f;
                if self.time_reg(reg).is_none() {
                    self.nvram[reg as usize] = v;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_bcd_time_and_nvram() {
        let mut c = Cmos::new();
        let mut b = [0u8; 1];
        c.write(0, &[0x0a]);
        c.read(1, &mut b);
        assert_eq!(b[0] & 0x80, 0, "update in progress must be clear");
        c.write(0, &[0x08]);
        c.read(1, &mut b);
        assert!((0x01..=0x12).contains(&b[0]));
        c.write(0, &[0x40]);
        c.write(1, &[0x5a]);
        c.read(1, &mut b);
        assert_eq!(b[0], 0x5a);
    }
}
