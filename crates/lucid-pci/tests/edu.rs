//! QEMU's `edu` device on Lucid's PCI root, driven as a guest driver would: configuration cycles
//! through ports 0xCF8/0xCFC, registers through BAR 0 on the MMIO bus, DMA into a real guest RAM,
//! MSIs into a real KVM vCPU's local APIC. Needs /dev/kvm.

mod platform;

use std::sync::{Arc, Mutex};

use lucid_hv::Vcpu;
use lucid_pci::config::{BAR0, COMMAND, COMMAND_BUS_MASTER, COMMAND_MEMORY};
use lucid_pci::edu::{reg, DMA_BUF_ADDR, DMA_CMD_IRQ, DMA_CMD_START, DMA_CMD_TO_RAM, EDU_IDENT};
use lucid_pci::{attach_edu, EduDevice};
use platform::MMIO_WINDOW;
use vm_memory::{Bytes, GuestAddress};

const INTX_GSI: u32 = 16;

/// The shared host with one vCPU and the edu device.
struct Host {
    p: platform::Host,
    vcpu: Vcpu,
    slot: u8,
    edu: Arc<Mutex<EduDevice>>,
}

/// A VM with one vCPU whose local APIC accepts interrupts, and the edu device in slot 1.
fn host() -> Host {
    let p = platform::host();
    let vcpu = p.vm.create_vcpu(0).unwrap();
    // Software-enable the APIC (spurious vector register bit 8) so that it accepts MSIs.
    let mut lapic = vcpu.get_lapic().unwrap();
    lapic.regs[0xf1] |= 1;
    vcpu.set_lapic(&lapic).unwrap();
    let (addr, edu) = attach_edu(&p.root, &p.env, Some(INTX_GSI)).unwrap();
    Host {
        p,
        vcpu,
        slot: addr.slot,
        edu,
    }
}

impl Host {
    fn cf8(&self, reg: u32) -> u32 {
        self.p.cf8(self.slot, reg)
    }
    fn cf8_write(&self, reg: u32, v: u32) {
        self.p.cf8_write(self.slot, reg, v)
    }
    fn bar0(&self) -> u64 {
        (self.cf8(BAR0 as u32) & !0xf) as u64
    }
    fn r(&self, off: u64, len: usize) -> u64 {
        let mut d = [0u8; 8];
        assert!(self.p.mmio.read(self.bar0() + off, &mut d[..len]));
        u64::from_le_bytes(d)
    }
    fn w(&self, off: u64, len: usize, v: u64) {
        assert!(self
            .p
            .mmio
            .write(self.bar0() + off, &v.to_le_bytes()[..len]));
    }
    fn counter(&self, name: &str) -> u64 {
        self.p.counter(name)
    }
    fn msi_cap(&self) -> u32 {
        let mut p = self.cf8(0x34) & 0xfc;
        while p != 0 {
            let hdr = self.cf8(p);
            if hdr & 0xff == 0x05 {
                return p;
            }
            p = (hdr >> 8) & 0xfc;
        }
        panic!("no MSI capability");
    }
    /// Whether `vector` is pending in the vCPU's local APIC (IRR).
    fn apic_irr(&self, vector: u8) -> bool {
        let lapic = self.vcpu.get_lapic().unwrap();
        let off = 0x200 + (vector as usize / 32) * 0x10 + (vector as usize % 32) / 8;
        lapic.regs[off] as u8 & (1 << (vector % 8)) != 0
    }
    fn dma(&self, src: u64, dst: u64, count: u64, cmd: u64) {
        self.w(reg::DMA_SRC, 8, src);
        self.w(reg::DMA_DST, 8, dst);
        self.w(reg::DMA_COUNT, 8, count);
        self.w(reg::DMA_CMD, 8, cmd | DMA_CMD_START);
        assert_eq!(self.r(reg::DMA_CMD, 8) & DMA_CMD_START, 0, "done");
    }
}

/// QEMU's quirk of the configuration address: its two low bits, which the spec reserves, are
/// ORed with the data port's offset. A guest that selects register 2 and reads a word at 0xCFC
/// gets the device ID (QEMU's edu test programs do), a byte at 0xCFD with register 1 the
/// vendor ID's high byte, as on QEMU.
#[test]
fn the_configuration_address_keeps_its_low_bits_as_qemu_does() {
    let h = host();
    let select = |reg: u32| {
        let a = 0x8000_0000 | u32::from(h.slot) << 11 | reg;
        assert!(h.p.pio.write(0xcf8, &a.to_le_bytes()));
    };
    let read = |port: u64, len: usize| {
        let mut d = [0u8; 4];
        assert!(h.p.pio.read(port, &mut d[..len]));
        u32::from_le_bytes(d)
    };
    select(2);
    assert_eq!(read(0xcfc, 2), 0x11e8, "device ID");
    select(1);
    assert_eq!(
        read(0xcfd, 1),
        0x12,
        "register 1 | 1: the vendor ID's high byte"
    );
    select(0);
    assert_eq!(read(0xcfe, 2), 0x11e8, "aligned, as before");
    assert_eq!(read(0xcfc, 4), 0x11e8_1234);
}

#[test]
fn enumerates_as_qemu_edu() {
    let h = host();
    assert_eq!(h.slot, 1);
    assert_eq!(h.cf8(0), 0x11e8_1234);
    assert_eq!(h.cf8(8), 0x00ff_0010);
    assert_eq!(h.cf8(0x2c), 0x1100_1af4);
    assert_eq!(h.cf8(0x3c) & 0xffff, 0x0100 | INTX_GSI, "pin A, line 16");
    // BAR 0: 1 MiB of 32-bit non-prefetchable MMIO, naturally aligned in the window.
    let base = h.bar0();
    assert!(MMIO_WINDOW.contains(&base) && base.is_multiple_of(1 << 20));
    assert_eq!(h.cf8(BAR0 as u32) & 0xf, 0);
    h.cf8_write(BAR0 as u32, u32::MAX);
    assert_eq!(h.cf8(BAR0 as u32), 0xfff0_0000);
    h.cf8_write(BAR0 as u32, base as u32);
    for i in 1..6 {
        assert_eq!(h.cf8((BAR0 + 4 * i) as u32), 0, "BAR {i} unimplemented");
    }
    assert_eq!(h.r(reg::IDENT, 4), EDU_IDENT as u64);
    // One capability, plain MSI: 1 vector, 64-bit, disabled.
    let cap = h.msi_cap();
    assert_eq!(cap, 0x40);
    assert_eq!(h.cf8(cap) >> 8 & 0xff, 0, "last capability");
    assert_eq!(h.cf8(cap) >> 16, 0x0080);
    assert_ne!(h.cf8(4) >> 16 & 0x10, 0, "capability list bit");
}

#[test]
fn dma_factorial_and_interrupts_through_bar0() {
    let h = host();
    let cmd = COMMAND_MEMORY | COMMAND_BUS_MASTER;
    h.cf8_write(COMMAND as u32, cmd as u32);
    let mem = h.p.env.mem.clone();
    let pattern: Vec<u8> = (0..4096u32).map(|i| (i * 13 + 5) as u8).collect();
    mem.write_slice(&pattern, GuestAddress(0x10_0000)).unwrap();

    // RAM -> buffer, buffer -> RAM elsewhere (two slices, different buffer offsets).
    h.dma(0x10_0000, DMA_BUF_ADDR, 4096, 0);
    h.dma(DMA_BUF_ADDR + 0x800, 0x20_0800, 0x800, DMA_CMD_TO_RAM);
    h.dma(DMA_BUF_ADDR, 0x20_0000, 0x800, DMA_CMD_TO_RAM);
    let mut back = vec![0u8; 4096];
    mem.read_slice(&mut back, GuestAddress(0x20_0000)).unwrap();
    assert_eq!(back, pattern);
    assert_eq!(h.counter("edu.dma_reads"), 1);
    assert_eq!(h.counter("edu.dma_writes"), 2);
    assert_eq!(h.counter("edu.dma_bytes"), 8192);

    // Factorial, liveness.
    h.w(reg::FACTORIAL, 4, 10);
    assert_eq!(h.r(reg::STATUS, 4) & 1, 0);
    assert_eq!(h.r(reg::FACTORIAL, 4), 3_628_800);
    h.w(reg::LIVENESS, 4, 0xa5a5_0000);
    assert_eq!(h.r(reg::LIVENESS, 4), 0x5a5a_ffff);

    // INTx (MSI off): a level held until acknowledged.
    h.w(reg::IRQ_RAISE, 4, 0x1000);
    assert!(h.edu.lock().unwrap().intx_asserted());
    assert_ne!(h.cf8(4) >> 16 & 0x8, 0, "interrupt status bit");
    h.w(reg::IRQ_ACK, 4, 0x1000);
    assert!(!h.edu.lock().unwrap().intx_asserted());
    assert_eq!(h.counter("edu.irqs"), 1);

    // MSI on: each raise reaches the vCPU's APIC with the programmed vector.
    let cap = h.msi_cap();
    h.cf8_write(cap + 4, 0xfee0_0000);
    h.cf8_write(cap + 8, 0);
    h.cf8_write(cap + 12, 0x45);
    h.cf8_write(cap, 1 << 16);
    assert_eq!(h.cf8(cap) >> 16, 0x0081, "enabled");
    assert!(!h.apic_irr(0x45));
    h.w(reg::IRQ_RAISE, 4, 0x2);
    assert!(h.apic_irr(0x45), "MSI delivered");
    assert_eq!(h.r(reg::IRQ_STATUS, 4), 0x2);
    assert!(!h.edu.lock().unwrap().intx_asserted());
    h.w(reg::IRQ_ACK, 4, 0x2);
    // Factorial and DMA completions, on another vector.
    h.cf8_write(cap + 12, 0x46);
    h.w(reg::STATUS, 4, 0x80);
    h.w(reg::FACTORIAL, 4, 3);
    assert_eq!(h.r(reg::IRQ_STATUS, 4), 0x1);
    assert!(h.apic_irr(0x46));
    h.cf8_write(cap + 12, 0x47);
    h.dma(0x10_0000, DMA_BUF_ADDR, 16, DMA_CMD_IRQ);
    assert_eq!(h.r(reg::IRQ_STATUS, 4), 0x101);
    assert!(h.apic_irr(0x47));
    assert_eq!(h.counter("edu.irqs"), 4);
    assert_eq!(h.counter("edu.irqs_dropped"), 0);

    // Bus mastering off: DMA refused by the DMA path, MSI not sent.
    h.cf8_write(COMMAND as u32, COMMAND_MEMORY as u32);
    h.dma(0x30_0000, DMA_BUF_ADDR, 16, DMA_CMD_IRQ);
    assert_eq!(h.counter("edu.dma_errors"), 1);
    assert_eq!(h.counter("edu.irqs_dropped"), 1);
    assert_eq!(h.counter("edu.irqs"), 4);
}

#[test]
fn bad_offsets_sizes_and_config_writes_are_harmless() {
    let h = host();
    h.cf8_write(COMMAND as u32, (COMMAND_MEMORY | COMMAND_BUS_MASTER) as u32);
    let mut x = 0x0123_4567_89ab_cdefu64;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let base = h.bar0();
    for _ in 0..20_000 {
        let r = next();
        let len = [1usize, 2, 3, 4, 8][(r % 5) as usize];
        let off = match r >> 61 {
            0..=3 => (r >> 8) % 0xa0,
            _ => (r >> 8) % (1 << 20) - (len as u64).min((r >> 8) % (1 << 20)),
        };
        let v = next();
        if r & (1 << 20) != 0 {
            let _ = h.p.mmio.write(base + off, &v.to_le_bytes()[..len]);
        } else {
            let _ = h.p.mmio.read(base + off, &mut [0u8; 8][..len]);
        }
        if r.is_multiple_of(97) {
            // Config garbage everywhere but the BAR and command (so that the BAR stays put).
            let reg = ((v >> 8) % 64) as u32 * 4;
            if reg != BAR0 as u32 && reg != COMMAND as u32 {
                h.cf8_write(reg, v as u32);
            }
        }
    }
    // Still the edu, still in place; nothing outside RAM was touched (the DMA path refuses it).
    assert_eq!(h.bar0(), base);
    assert_eq!(h.r(reg::IDENT, 4), EDU_IDENT as u64);
    assert_eq!(h.cf8(0), 0x11e8_1234);
}
