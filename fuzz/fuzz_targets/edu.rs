//! QEMU's `edu` device behind the real root complex, driven by guest accesses: configuration
//! cycles, BAR 0 registers and DMA into a 1 MiB guest RAM, with a vIOMMU-style translator that
//! comes and goes. No KVM: interrupts go to a recorder.
//!
//! Checked after the accesses: IDs, the interrupt pin and the capability list keep their values,
//! the MSI capability's read-only bits too, the INTx line only ever changes level (never "set
//! high" twice), every MSI carries the device's requester ID, and the device still answers its
//! identification register.
#![no_main]

use std::sync::{Arc, Mutex};

use libfuzzer_sys::fuzz_target;
use lucid_fuzz::{Access, Pci};
use lucid_hv::{HvError, MsiMessage};
use lucid_mem::{Access as Dir, Backing, DeviceId, DmaError, DmaPath, DmaTranslator, GuestRam};
use lucid_pci::config::CAP_ID_MSI;
use lucid_pci::edu::{reg, IrqSink, EDU_IDENT};
use lucid_pci::{EduDevice, PciDevice, PciWindows};
use lucid_stats::StatsRegistry;

const RAM: u64 = 1 << 20;

#[derive(Default)]
struct Recorder {
    msi_sources: Mutex<Vec<u16>>,
    intx: Mutex<Vec<bool>>,
}

impl IrqSink for Recorder {
    fn msi(&self, source: u16, _msg: MsiMessage) -> Result<(), HvError> {
        self.msi_sources.lock().unwrap().push(source);
        Ok(())
    }
    fn set_intx(&self, level: bool) -> Result<(), HvError> {
        self.intx.lock().unwrap().push(level);
        Ok(())
    }
}

/// IOVA = GPA + 1 MiB in 1..2 MiB, page by page; the rest is not mapped.
struct Shift;

impl DmaTranslator for Shift {
    fn translate(
        &self,
        dev: DeviceId,
        iova: u64,
        len: u64,
        access: Dir,
    ) -> Result<(u64, u64), DmaError> {
        if !(RAM..2 * RAM).contains(&iova) {
            return Err(DmaError::Fault {
                dev,
                iova,
                access,
                reason: lucid_mem::FaultReason::NotMapped,
            });
        }
        Ok((iova - RAM, len.min(0x1000 - (iova & 0xfff))))
    }
}

// Accesses (see [`lucid_fuzz::Access`]) by `kind % 5`: 0, a dword write of the 0xCF8 address
// register; 1, port 0xCF8 + `sel % 8`; 2, ECAM at `addr`; 3, BAR 0 at `addr % 1 MiB` from where
// it decodes now (from the window's start when nowhere); 4, translator on (`val` odd) or off.
fuzz_target!(|data: &[u8]| {
    let stats = Arc::new(StatsRegistry::new());
    let windows = PciWindows {
        mmio: 0xc000_0000..0xc100_0000,
        io: 0xc000..0x1_0000,
        ecam: (0xe000_0000, 0x20_0000),
    };
    let pci = Pci::new(windows, &stats);
    let ram = GuestRam::new(&[(0, RAM)], Backing::Anonymous).expect("guest RAM");
    let dma = DmaPath::new(ram.memory().clone(), &stats);
    let irq = Arc::new(Recorder::default());
    let edu = Arc::new(Mutex::new(
        EduDevice::new(dma.clone(), irq.clone(), Some(16), &stats).expect("edu"),
    ));
    let slot = pci
        .root
        .add_device("edu", edu.clone())
        .expect("a free slot")
        .slot;
    let caps = edu.lock().unwrap().config().capabilities();
    for a in Access::parse(data, 256) {
        match a.kind % 5 {
            k @ 0..=2 => pci.config_cycle(k, &a),
            3 => {
                let base = pci
                    .root
                    .devices()
                    .into_iter()
                    .find(|(addr, _, _)| addr.slot == slot)
                    .and_then(|(_, _, bars)| bars[0])
                    .unwrap_or(0xc000_0000);
                a.on(&pci.mmio, base + (a.addr as u64 % (1 << 20)));
            }
            _ => dma.set_translator(match a.val & 1 {
                1 => Some(Arc::new(Shift) as Arc<dyn DmaTranslator>),
                _ => None,
            }),
        }
    }
    let mut d = edu.lock().unwrap();
    let c = d.config();
    assert_eq!(
        (c.u16_at(0), c.u16_at(2), c.u8_at(8)),
        (0x1234, 0x11e8, 0x10)
    );
    assert_eq!(c.u8_at(0x3d), 1, "interrupt pin A");
    assert_eq!(c.capabilities(), caps);
    assert_eq!(caps, vec![(0x40, CAP_ID_MSI)]);
    assert_eq!(
        c.u16_at(0x42) & !0x71,
        0x0080,
        "MSI: 1 vector, 64-bit, no masking"
    );
    let rid = u16::from(slot) << 3;
    assert!(irq.msi_sources.lock().unwrap().iter().all(|&s| s == rid));
    let levels = irq.intx.lock().unwrap().clone();
    assert!(levels.windows(2).all(|w| w[0] != w[1]), "{levels:?}");
    assert_eq!(
        levels.first().copied().unwrap_or(true),
        true,
        "first change raises"
    );
    let mut id = [0u8; 4];
    d.bar_read(0, reg::IDENT, &mut id);
    assert_eq!(u32::from_le_bytes(id), EDU_IDENT);
    drop(d);
    drop(ram);
});
