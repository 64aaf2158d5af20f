//! What the PCI integration tests share: a KVM VM with an irqchip, 16 MiB of guest RAM behind the
//! DMA path, and Lucid's PCI root on fresh MMIO and port buses, driven as a guest would drive it.

#![allow(dead_code)]

use std::sync::Arc;

use lucid_devices::Bus;
use lucid_hv::{GsiRouter, Vm};
use lucid_mem::{Backing, DmaPath, GuestRam};
use lucid_pci::{HostCaps, PciRoot, PciWindows, TransportEnv};
use lucid_stats::StatsRegistry;

pub const MMIO_WINDOW: std::ops::Range<u64> = 0xc000_0000..0xd000_0000;
pub const ECAM: u64 = 0xe000_0000;
pub const RAM: u64 = 16 << 20;

pub struct Host {
    pub vm: Vm,
    pub mmio: Arc<Bus>,
    pub pio: Arc<Bus>,
    pub root: Arc<PciRoot>,
    pub env: TransportEnv,
    pub _ram: GuestRam,
}

/// A VM with an irqchip, guest RAM and a registered PCI root with no device on it.
pub fn host() -> Host {
    let kvm = lucid_hv::open_kvm().expect("KVM");
    let vm = Vm::new(kvm).unwrap();
    vm.create_irqchip_and_pit().unwrap();
    let stats = StatsRegistry::new();
    let ram = GuestRam::new(&[(0, RAM)], Backing::Anonymous).unwrap();
    let dma = DmaPath::new(ram.memory().clone(), &stats);
    let (mmio, pio) = (Arc::new(Bus::new()), Arc::new(Bus::new()));
    let root = PciRoot::new(
        mmio.clone(),
        pio.clone(),
        PciWindows {
            mmio: MMIO_WINDOW,
            io: 0xc000..0x1_0000,
            ecam: (ECAM, 0x1000_0000),
        },
        &stats,
    );
    root.register().unwrap();
    let env = TransportEnv {
        vm: vm.clone(),
        router: GsiRouter::new(vm.clone()),
        mem: ram.memory().clone(),
        dma,
        spawner: lucid_thread::Spawner::new(None, stats.threads().clone()),
        stats,
        host: HostCaps::default(),
    };
    Host {
        vm,
        mmio,
        pio,
        root,
        env,
        _ram: ram,
    }
}

impl Host {
    /// A configuration read of bus 0 `slot` through ports 0xCF8/0xCFC.
    pub fn cf8(&self, slot: u8, reg: u32) -> u32 {
        let a = 0x8000_0000 | (slot as u32) << 11 | (reg & 0xfc);
        assert!(self.pio.write(0xcf8, &a.to_le_bytes()));
        let mut d = [0; 4];
        assert!(self.pio.read(0xcfc, &mut d));
        u32::from_le_bytes(d)
    }
    pub fn cf8_write(&self, slot: u8, reg: u32, v: u32) {
        let a = 0x8000_0000 | (slot as u32) << 11 | (reg & 0xfc);
        assert!(self.pio.write(0xcf8, &a.to_le_bytes()));
        assert!(self.pio.write(0xcfc, &v.to_le_bytes()));
    }
    /// A counter of the platform's registry; a missing one panics with its name (read as 0, a
    /// renamed counter would pass every `== 0` check).
    pub fn counter(&self, name: &str) -> u64 {
        let snap = self.env.stats.snapshot();
        *snap
            .get(name)
            .unwrap_or_else(|| panic!("no counter {name} in {snap:?}"))
    }
}
