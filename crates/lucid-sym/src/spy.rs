//! SymSpy pages: guest RAM the guest registered by guest-physical address. Lucid touches them
//! only through atomic loads and stores on guest memory (never a Rust reference into it: the
//! guest writes concurrently), so reading or publishing costs no exit.

use std::sync::atomic::Ordering;

use lucid_mem::GuestMemoryMmap;
use vm_memory::{Bytes, GuestAddress, GuestMemory, Permissions};

use crate::abi::{self, page};

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SpyError {
    #[error("SymSpy page {0:#x} is not page-aligned")]
    Unaligned(u64),
    #[error("SymSpy page {0:#x} is not inside guest RAM")]
    OutsideRam(u64),
    #[error("SymSpy page {gpa:#x}: bad header (magic {magic:#x}, version {version}, kind {kind})")]
    BadHeader {
        gpa: u64,
        magic: u32,
        version: u16,
        kind: u16,
    },
    #[error("SymSpy page {gpa:#x} says it belongs to vCPU {claimed}, registered from vCPU {vcpu}")]
    WrongVcpu { gpa: u64, claimed: u32, vcpu: u32 },
    #[error("unknown SymSpy registration kind {0}")]
    Kind(u64),
    #[error("no vCPU {0}")]
    NoVcpu(u32),
}

impl SpyError {
    /// The errno a guest's registration hypercall gets for this error.
    pub fn errno(&self) -> u64 {
        match self {
            SpyError::Kind(_) => abi::SYM_ENODEV,
            _ => abi::SYM_EINVAL,
        }
    }
}

/// One registered SymSpy page.
#[derive(Clone, Debug)]
pub struct SpyPage {
    mem: GuestMemoryMmap,
    gpa: u64,
}

impl SpyPage {
    /// A page at `gpa`, which must be page-aligned and wholly inside guest RAM.
    pub fn new(mem: &GuestMemoryMmap, gpa: u64) -> Result<Self, SpyError> {
        if !gpa.is_multiple_of(page::SIZE) {
            return Err(SpyError::Unaligned(gpa));
        }
        if !mem.check_range(
            GuestAddress(gpa),
            page::SIZE as usize,
            Permissions::ReadWrite,
        ) {
            return Err(SpyError::OutsideRam(gpa));
        }
        Ok(SpyPage {
            mem: mem.clone(),
            gpa,
        })
    }

    pub fn gpa(&self) -> u64 {
        self.gpa
    }

    fn addr(&self, off: u64) -> GuestAddress {
        debug_assert!(off < page::SIZE);
        GuestAddress(self.gpa + off)
    }

    // The page was checked to lie in RAM and memory regions are never removed while the VM
    // runs, so these accesses cannot fail for in-page offsets; a failure reads as zero.
    pub fn load_u32(&self, off: u64) -> u32 {
        self.mem
            .load(self.addr(off), Ordering::Acquire)
            .unwrap_or(0)
    }

    pub fn load_u64(&self, off: u64) -> u64 {
        self.mem
            .load(self.addr(off), Ordering::Acquire)
            .unwrap_or(0)
    }

    pub fn store_u32(&self, off: u64, v: u32) {
        let _ = self.mem.store(v, self.addr(off), Ordering::Release);
    }

    pub fn store_u64(&self, off: u64, v: u64) {
        let _ = self.mem.store(v, self.addr(off), Ordering::Release);
    }

    /// Checks the guest-written header: magic, version, kind and (per-vCPU pages) owner.
    pub fn check_header(&self, kind: u64, vcpu: u32) -> Result<(), SpyError> {
        let magic = self.load_u32(page::H_MAGIC);
        let word = self.load_u32(page::H_VERSION);
        let (version, k) = (word as u16, (word >> 16) as u16);
        if magic != page::MAGIC || u64::from(version) != abi::VERSION || u64::from(k) != kind {
            return Err(SpyError::BadHeader {
                gpa: self.gpa,
                magic,
                version,
                kind: k,
            });
        }
        let claimed = self.load_u32(page::H_VCPU);
        if kind == abi::REGISTER_VCPU && claimed != vcpu {
            return Err(SpyError::WrongVcpu {
                gpa: self.gpa,
                claimed,
                vcpu,
            });
        }
        Ok(())
    }

    /// Reads a guest-written record under its sequence count at `seq`: `read` runs until it saw
    /// an even count that did not change across it. `None` after `tries` torn reads (a guest
    /// that keeps the count odd cannot hold Lucid up).
    pub fn read_record<T>(&self, seq: u64, tries: u32, read: impl FnMut(&Self) -> T) -> Option<T> {
        self.read_record_counted(seq, tries, read).0
    }

    /// As [`SpyPage::read_record`], and how many tries were torn (odd or changed count).
    pub fn read_record_counted<T>(
        &self,
        seq: u64,
        tries: u32,
        mut read: impl FnMut(&Self) -> T,
    ) -> (Option<T>, u32) {
        for torn in 0..tries {
            let before = self.load_u32(seq);
            if before & 1 != 0 {
                std::hint::spin_loop();
                continue;
            }
            let v = read(self);
            std::sync::atomic::fence(Ordering::Acquire);
            if self.load_u32(seq) == before {
                return (Some(v), torn);
            }
        }
        (None, tries)
    }

    /// Writes Lucid's record under its sequence count at `seq` (odd while `write` runs). Only
    /// Lucid writes these lines, one writer at a time (the caller's lock).
    pub fn write_record(&self, seq: u64, write: impl FnOnce(&Self)) {
        let s = self.load_u32(seq);
        let odd = s.wrapping_add(1) | 1;
        self.store_u32(seq, odd);
        std::sync::atomic::fence(Ordering::Release);
        write(self);
        std::sync::atomic::fence(Ordering::Release);
        self.store_u32(seq, odd.wrapping_add(1));
    }
}

/// The pages a guest registered: one global, one per vCPU. Cleared when the VM resets.
#[derive(Debug)]
pub struct Registrations {
    global: Option<SpyPage>,
    vcpus: Vec<Option<SpyPage>>,
    /// Registrations (and unregistrations) accepted so far: lets readers notice a change.
    changes: u64,
}

impl Registrations {
    pub fn new(vcpus: u32) -> Self {
        Registrations {
            global: None,
            vcpus: vec![None; vcpus as usize],
            changes: 0,
        }
    }

    /// `HC_REGISTER` from `vcpu`: `gpa` 0 unregisters.
    pub fn register(
        &mut self,
        mem: &GuestMemoryMmap,
        vcpu: u32,
        kind: u64,
        gpa: u64,
    ) -> Result<(), SpyError> {
        if kind != abi::REGISTER_GLOBAL && kind != abi::REGISTER_VCPU {
            return Err(SpyError::Kind(kind));
        }
        let page = match gpa {
            0 => None,
            _ => {
                let p = SpyPage::new(mem, gpa)?;
                p.check_header(kind, vcpu)?;
                Some(p)
            }
        };
        match kind {
            abi::REGISTER_GLOBAL => self.global = page,
            abi::REGISTER_VCPU => {
                *self
                    .vcpus
                    .get_mut(vcpu as usize)
                    .ok_or(SpyError::NoVcpu(vcpu))? = page
            }
            _ => unreachable!("kind checked above"),
        }
        self.changes += 1;
        Ok(())
    }

    pub fn global(&self) -> Option<&SpyPage> {
        self.global.as_ref()
    }

    pub fn vcpu(&self, vcpu: u32) -> Option<&SpyPage> {
        self.vcpus.get(vcpu as usize)?.as_ref()
    }

    pub fn changes(&self) -> u64 {
        self.changes
    }

    /// Forgets every registration (VM reset: the guest's memory no longer holds them).
    pub fn clear(&mut self) {
        self.global = None;
        self.vcpus.iter_mut().for_each(|v| *v = None);
        self.changes += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mem() -> GuestMemoryMmap {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap()
    }

    fn header(m: &GuestMemoryMmap, gpa: u64, kind: u16, vcpu: u32) {
        let p = SpyPage::new(m, gpa).unwrap();
        p.store_u32(page::H_MAGIC, page::MAGIC);
        p.store_u32(page::H_VERSION, abi::VERSION as u32 | u32::from(kind) << 16);
        p.store_u32(page::H_VCPU, vcpu);
    }

    #[test]
    fn registration_checks_alignment_ram_header_and_owner() {
        let m = mem();
        let mut r = Registrations::new(2);
        assert_eq!(
            r.register(&m, 0, abi::REGISTER_GLOBAL, 0x1001),
            Err(SpyError::Unaligned(0x1001))
        );
        assert_eq!(
            r.register(&m, 0, abi::REGISTER_GLOBAL, 1 << 20),
            Err(SpyError::OutsideRam(1 << 20))
        );
        assert!(matches!(
            r.register(&m, 0, abi::REGISTER_GLOBAL, 0x1000),
            Err(SpyError::BadHeader { .. })
        ));
        header(&m, 0x1000, 0, 0);
        r.register(&m, 0, abi::REGISTER_GLOBAL, 0x1000).unwrap();
        header(&m, 0x2000, 1, 1);
        assert!(matches!(
            r.register(&m, 0, abi::REGISTER_VCPU, 0x2000),
            Err(SpyError::WrongVcpu { .. })
        ));
        r.register(&m, 1, abi::REGISTER_VCPU, 0x2000).unwrap();
        assert_eq!(r.vcpu(1).unwrap().gpa(), 0x2000);
        assert_eq!(r.register(&m, 0, 9, 0x2000), Err(SpyError::Kind(9)));
        r.clear();
        assert!(r.global().is_none() && r.vcpu(1).is_none());
    }

    #[test]
    fn records_round_trip_under_their_sequence_count() {
        let m = mem();
        let p = SpyPage::new(&m, 0x3000).unwrap();
        p.write_record(page::L_SEQ, |p| p.store_u64(page::L_MEM_PRESSURE, 7));
        assert_eq!(p.load_u32(page::L_SEQ), 2);
        assert_eq!(
            p.read_record(page::L_SEQ, 10, |p| p.load_u64(page::L_MEM_PRESSURE)),
            Some(7)
        );
        // A writer stuck mid-record (odd count) gives up after the tries, not forever.
        p.store_u32(page::L_SEQ, 3);
        assert_eq!(p.read_record(page::L_SEQ, 10, |p| p.load_u64(0)), None);
        assert_eq!(
            p.read_record_counted(page::L_SEQ, 10, |p| p.load_u64(0)),
            (None, 10)
        );
        p.store_u32(page::L_SEQ, 4);
        assert_eq!(
            p.read_record_counted(page::L_SEQ, 10, |p| p.load_u64(page::L_MEM_PRESSURE)),
            (Some(7), 0)
        );
    }
}
