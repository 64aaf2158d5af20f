//! ACPI fixed hardware for a full (not hardware-reduced) FADT: the PM1a event block (status and
//! enable), the PM1a control block and the 3.579545 MHz PM timer, registered as one 12-byte
//! range: PM1_STS at +0, PM1_EN at +2, PM1_CNT at +4, PM_TMR at +8 (QEMU's ICH9 layout).
//!
//! - The timer is a 32-bit count (FADT `TMR_VAL_EXT`) of a host monotonic clock at 3.579545 MHz
//!   from device creation. `TMR_STS` is set when bit 31 of the count has changed since the guest
//!   last cleared it; it is computed when the block is accessed (there is no timer thread), so
//!   an SCI for it is raised at the next access, not at the instant of the flip.
//! - `SCI_EN` reads as 1: there is no SMI command port, the platform is always in ACPI mode.
//! - SCI: the line is level, asserted while a status bit and its enable bit are both set, and
//!   re-evaluated on every access (the VMM routes it to GSI 9 through the IOAPIC).
//! - PM1_CNT with `SLP_EN`: the sleep type the DSDT's `_S5_` names powers the VM off (the VM
//!   stops as a guest power-off, exit status 0). Every other sleep type (S1-S4: Lucid has no
//!   suspend) is refused: logged as a warning, counted in `acpi_pm.sleep_refused`, and the
//!   guest keeps running with `WAK_STS` clear.

use std::sync::Arc;
use std::time::Instant;

use lucid_stats::{Counter, StatsRegistry};

use crate::{BusDevice, Lifecycle, StopReason};

/// PM timer frequency (ACPI spec: 3.579545 MHz).
pub const PM_TIMER_HZ: u64 = 3_579_545;
/// Length of the register range: event block (4), control block (2), a gap (2), timer (4).
pub const ACPI_PM_LEN: u64 = 12;

const STS: u64 = 0;
const EN: u64 = 2;
const CNT: u64 = 4;
const TMR: u64 = 8;

/// PM1 status and enable bits.
const TMR_STS: u16 = 1 << 0;
const PWRBTN_STS: u16 = 1 << 8;
/// The enable bits this device keeps (timer, power button); others read as 0.
const EN_MASK: u16 = TMR_STS | PWRBTN_STS;
/// PM1 control bits.
const SCI_EN: u16 = 1 << 0;
const SLP_TYP_SHIFT: u16 = 10;
const SLP_TYP_MASK: u16 = 7 << SLP_TYP_SHIFT;
const SLP_EN: u16 = 1 << 13;

/// Receives the SCI line level (true = asserted).
pub type SciLine = Box<dyn Fn(bool) + Send>;

/// The ACPI PM1a event and control blocks and the PM timer.
pub struct AcpiPm {
    sts: u16,
    en: u16,
    slp_typ: u16,
    epoch: Instant,
    /// Bit 31 of the timer count when the guest last cleared TMR_STS.
    tmr_msb_cleared: bool,
    /// The SLP_TYP value of S5, as the DSDT's `_S5_` package gives it.
    s5_slp_typ: u8,
    lifecycle: Arc<Lifecycle>,
    sci: SciLine,
    sci_level: bool,
    timer_reads: Arc<Counter>,
    sleep_refused: Arc<Counter>,
    sci_raised: Arc<Counter>,
}

impl AcpiPm {
    /// `s5_slp_typ` is the SLP_TYP value the DSDT's `_S5_` gives; `sci` drives the SCI line.
    pub fn new(
        lifecycle: Arc<Lifecycle>,
        s5_slp_typ: u8,
        sci: SciLine,
        stats: &StatsRegistry,
    ) -> Self {
        AcpiPm {
            sts: 0,
            en: 0,
            slp_typ: 0,
            epoch: Instant::now(),
            tmr_msb_cleared: false,
            s5_slp_typ,
            lifecycle,
            sci,
            sci_level: false,
            timer_reads: stats.counter("acpi_pm.timer_reads"),
            sleep_refused: stats.counter("acpi_pm.sleep_refused"),
            sci_raised: stats.counter("acpi_pm.sci_raised"),
        }
    }

    /// The 32-bit PM timer count now.
    fn timer(&self) -> u32 {
        let ns = self.epoch.elapsed().as_nanos();
        (ns * u128::from(PM_TIMER_HZ) / 1_000_000_000) as u32
    }

    /// PM1 status with TMR_STS as it stands at timer count `t`.
    fn status(&self, t: u32) -> u16 {
        let flipped = (t >> 31 != 0) != self.tmr_msb_cleared;
        self.sts | if flipped { TMR_STS } else { 0 }
    }

    fn control(&self) -> u16 {
        SCI_EN | self.slp_typ
    }

    /// The 12 bytes of the register range as the guest reads them at timer count `t`.
    fn image(&self, t: u32) -> [u8; ACPI_PM_LEN as usize] {
        let mut b = [0u8; ACPI_PM_LEN as usize];
        b[STS as usize..][..2].copy_from_slice(&self.status(t).to_le_bytes());
        b[EN as usize..][..2].copy_from_slice(&self.en.to_le_bytes());
        b[CNT as usize..][..2].copy_from_slice(&self.control().to_le_bytes());
        b[TMR as usize..][..4].copy_from_slice(&t.to_le_bytes());
        b
    }

    fn update_sci(&mut self, t: u32) {
        let level = self.status(t) & self.en != 0;
        if level != self.sci_level {
            self.sci_level = level;
            if level {
                self.sci_raised.inc();
            }
            (self.sci)(level);
        }
    }

    fn write_status(&mut self, clear: u16, t: u32) {
        if clear & TMR_STS != 0 {
            self.tmr_msb_cleared = t >> 31 != 0;
        }
        self.sts &= !clear;
    }

    fn write_control(&mut self, v: u16) {
        self.slp_typ = v & SLP_TYP_MASK;
        if v & SLP_EN == 0 {
            return;
        }
        let typ = ((v & SLP_TYP_MASK) >> SLP_TYP_SHIFT) as u8;
        if typ == self.s5_slp_typ {
            log::info!("guest entered ACPI S5 (soft off) through PM1a_CNT: powering off");
            self.lifecycle.stop(StopReason::Shutdown);
        } else {
            self.sleep_refused.inc();
            log::warn!(
                "guest asked for ACPI sleep type {typ} (SLP_TYP|SLP_EN written to PM1a_CNT); \
                 Lucid implements only S5 (soft off, SLP_TYP {}): refused, the guest keeps \
                 running and WAK_STS stays clear",
                self.s5_slp_typ
            );
        }
    }
}

/// The bytes of a write that fall into register `reg..reg+2`, as (value, byte mask).
fn part16(offset: u64, data: &[u8], reg: u64) -> Option<(u16, u16)> {
    let (mut v, mut mask) = (0u16, 0u16);
    for (i, &byte) in data.iter().enumerate() {
        let at = offset + i as u64;
        if (reg..reg + 2).contains(&at) {
            let shift = 8 * (at - reg);
            v |= u16::from(byte) << shift;
            mask |= 0xff << shift;
        }
    }
    (mask != 0).then_some((v, mask))
}

impl BusDevice for AcpiPm {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        // One clock read per access: the timer and TMR_STS agree within it.
        let t = self.timer();
        let image = self.image(t);
        for (i, b) in data.iter_mut().enumerate() {
            *b = image.get(offset as usize + i).copied().unwrap_or(0xff);
        }
        if (offset..offset + data.len() as u64).contains(&TMR) {
            self.timer_reads.inc();
        }
        self.update_sci(t);
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        let t = self.timer();
        if let Some((v, _)) = part16(offset, data, STS) {
            self.write_status(v, t);
        }
        if let Some((v, mask)) = part16(offset, data, EN) {
            self.en = (self.en & !mask | v & mask) & EN_MASK;
        }
        if let Some((v, mask)) = part16(offset, data, CNT) {
            self.write_control(self.control() & !mask | v & mask);
        }
        self.update_sci(t);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    fn pm() -> (AcpiPm, Arc<Lifecycle>, Arc<Mutex<Vec<bool>>>) {
        let l = Arc::new(Lifecycle::new());
        let levels = Arc::new(Mutex::new(Vec::new()));
        let lv = levels.clone();
        let sci: SciLine = Box::new(move |on| lv.lock().unwrap().push(on));
        let stats = StatsRegistry::new();
        (AcpiPm::new(l.clone(), 0, sci, &stats), l, levels)
    }

    fn rd(p: &mut AcpiPm, off: u64, n: usize) -> u32 {
        let mut b = [0u8; 4];
        p.read(off, &mut b[..n]);
        u32::from_le_bytes(b)
    }

    #[test]
    fn timer_advances_and_sci_en_is_set() {
        let (mut p, ..) = pm();
        let t0 = rd(&mut p, TMR, 4);
        std::thread::sleep(std::time::Duration::from_millis(2));
        let t1 = rd(&mut p, TMR, 4);
        // At least 2 ms worth of 3.579545 MHz ticks.
        assert!(t1.wrapping_sub(t0) >= 7000, "{t0} -> {t1}");
        assert_eq!(rd(&mut p, CNT, 2) & 1, 1, "SCI_EN");
        // Byte reads of the timer see the count's bytes: each byte read agrees with a dword
        // read just before or just after it (the count moves on between reads). A thread
        // preempted between the reads lets 256 ticks (72 us) or more pass, and then a byte can
        // have wrapped around and be anything: such a sample proves nothing and is taken again.
        for byte in 0..4u64 {
            let (before, b, after) = (0..1000)
                .map(|_| {
                    let before = rd(&mut p, TMR, 4);
                    let b = rd(&mut p, TMR + byte, 1);
                    (before, b, rd(&mut p, TMR, 4))
                })
                .find(|&(before, _, after)| after.wrapping_sub(before) < 256)
                .expect("1000 tries without three reads within 256 ticks");
            let at = |v: u32| (v >> (8 * byte)) & 0xff;
            let (lo, hi) = (at(before), at(after));
            let ok = if lo <= hi {
                (lo..=hi).contains(&b)
            } else {
                b >= lo || b <= hi
            };
            assert!(
                ok,
                "byte {byte}: {b:#x} not between {before:#x} and {after:#x}"
            );
        }
    }

    #[test]
    fn s5_powers_off_other_sleep_types_are_refused() {
        let (mut p, l, _) = pm();
        // S3 in QEMU's numbering (1): refused, the VM keeps running.
        p.write(CNT, &(SLP_EN | (1 << SLP_TYP_SHIFT)).to_le_bytes());
        assert_eq!(l.reason(), None);
        assert_eq!(p.sleep_refused.get(), 1);
        assert_eq!(rd(&mut p, CNT, 2) & u32::from(SLP_EN), 0, "SLP_EN reads 0");
        // A 32-bit write over the event block does not touch control.
        p.write(STS, &[0xff; 4]);
        assert_eq!(l.reason(), None);
        // SLP_TYP 0 (our S5) with SLP_EN: power off.
        p.write(CNT, &SLP_EN.to_le_bytes());
        assert_eq!(l.reason(), Some(StopReason::Shutdown));
    }

    #[test]
    fn enable_bits_kept_status_is_write_one_to_clear() {
        let (mut p, _, levels) = pm();
        p.write(EN, &0xffffu16.to_le_bytes());
        assert_eq!(rd(&mut p, EN, 2), u32::from(EN_MASK));
        p.sts = PWRBTN_STS;
        p.write(EN, &PWRBTN_STS.to_le_bytes());
        assert_eq!(levels.lock().unwrap().last(), Some(&true), "SCI raised");
        p.write(STS, &PWRBTN_STS.to_le_bytes());
        assert_eq!(rd(&mut p, STS, 2) & u32::from(PWRBTN_STS), 0);
        assert_eq!(levels.lock().unwrap().last(), Some(&false), "SCI lowered");
    }
}
