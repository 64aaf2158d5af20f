//! QEMU's fw_cfg driven by guest port accesses, with DMA into a 1 MiB guest RAM: selector and
//! data reads, DMA descriptors the input places in RAM (or outside it), any access size at any
//! offset. No KVM.
//!
//! Checked after the accesses: the signature still reads "QEMU" and the ID still says DMA.
#![no_main]

use libfuzzer_sys::fuzz_target;
use lucid_devices::fw_cfg::{e820_file, keys, E820_RAM, FW_CFG_LEN};
use lucid_devices::{BusDevice, FwCfg};
use lucid_fuzz::Access;
use lucid_mem::{Backing, DmaPath, GuestRam};
use lucid_stats::StatsRegistry;

const RAM: u64 = 1 << 20;

fuzz_target!(|data: &[u8]| {
    let stats = StatsRegistry::new();
    let ram = GuestRam::new(&[(0, RAM)], Backing::Anonymous).expect("guest RAM");
    let dma = DmaPath::new(ram.memory().clone(), &stats);
    let mut dev = FwCfg::new(Some(dma.clone()), &stats);
    dev.set_cpus(2);
    dev.set_ram_size(RAM);
    dev.set_cmdline("console=ttyS0");
    dev.add_file("etc/e820", e820_file(&[(0, RAM, E820_RAM)]))
        .expect("etc/e820");
    // kind 0: a port access at offset `addr % 12`; kind 1: `val` (big-endian, as a
    // `FWCfgDmaAccess` holds it) stored at `addr` in RAM (or refused outside it).
    for a in Access::parse(data, 4096) {
        match a.kind % 2 {
            0 => {
                let off = u64::from(a.addr) % FW_CFG_LEN;
                if a.write {
                    dev.write(off, &a.val.to_le_bytes()[..a.size]);
                } else {
                    let mut d = [0u8; 8];
                    dev.read(off, &mut d[..a.size]);
                }
            }
            _ => {
                let _ = dma.write(0, u64::from(a.addr), &a.val.to_be_bytes()[..a.size]);
            }
        }
    }
    dev.write(0, &keys::SIGNATURE.to_le_bytes());
    let mut sig = [0u8; 4];
    dev.read(1, &mut sig);
    assert_eq!(&sig, b"QEMU");
    dev.write(0, &keys::ID.to_le_bytes());
    let mut id = [0u8; 4];
    dev.read(1, &mut id);
    assert_eq!(id, [3, 0, 0, 0]);
});
