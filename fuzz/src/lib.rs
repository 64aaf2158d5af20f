//! What the fuzz targets share: the guest-access encoding of the register-level targets.
//!
//! An input is a sequence of 16-byte records, each one guest access: `kind`, `flags` (the size,
//! 1/2/4/8 bytes, in bits 0-1; a write when bit 2 is set), a 16-bit selector, a 32-bit address
//! and a 64-bit value, little-endian. Each target says what `kind`, the selector and the address
//! mean to it. Seeds are written in this encoding by `fuzz/seeds/make.py`.

use std::sync::Arc;

use lucid_devices::Bus;
use lucid_pci::{PciRoot, PciWindows};
use lucid_stats::StatsRegistry;

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

/// A PCI root complex on fresh MMIO and PIO buses, its configuration handlers registered.
pub struct Pci {
    pub root: Arc<PciRoot>,
    pub mmio: Arc<Bus>,
    pub pio: Arc<Bus>,
    /// ECAM base and size.
    pub ecam: (u64, u64),
}

impl Pci {
    pub fn new(windows: PciWindows, stats: &StatsRegistry) -> Pci {
        let (mmio, pio) = (Arc::new(Bus::new()), Arc::new(Bus::new()));
        let ecam = windows.ecam;
        let root = PciRoot::new(mmio.clone(), pio.clone(), windows, stats);
        root.register()
            .expect("register the configuration handlers");
        Pci {
            root,
            mmio,
            pio,
            ecam,
        }
    }

    /// The configuration cycles of the register-level targets, by `kind`: 0, a dword write of
    /// the 0xCF8 address register (`val`); 1, an access to port 0xCF8 + `sel % 8`; 2, an ECAM
    /// access at `addr` into the window.
    pub fn config_cycle(&self, kind: u8, a: &Access) {
        match kind {
            0 => Access {
                size: 4,
                write: true,
                ..*a
            }
            .on(&self.pio, 0xcf8),
            1 => a.on(&self.pio, 0xcf8 + (a.sel % 8) as u64),
            _ => a.on(&self.mmio, self.ecam.0 + a.addr as u64 % self.ecam.1),
        }
    }
}

/// The kernel loader targets (`boot_elf`, `boot_multiboot`, `boot_bzimage`): detection and
/// loading of an image into a 16 MiB guest, no KVM.
pub mod boot {
    use std::fs::File;
    use std::io::Write;
    use std::os::fd::{AsRawFd, FromRawFd};
    use std::path::{Path, PathBuf};
    use std::sync::OnceLock;

    use lucid_boot::layout::ram_regions;
    use lucid_boot::{AcpiConfig, BootParams, EntryMode, KernelImage};
    use lucid_mem::vm_memory::{GuestAddress, GuestMemoryMmap};

    const MEM: u64 = 16 << 20;
    const INITRD: usize = 8 << 10;

    /// An 8 KiB initrd in a memfd, opened by path as a file would be.
    fn initrd() -> &'static Path {
        static INITRD_FILE: OnceLock<(File, PathBuf)> = OnceLock::new();
        let (_, path) = INITRD_FILE.get_or_init(|| {
            // SAFETY: memfd_create with a NUL-terminated name; the fd it returns is ours alone.
            let fd = unsafe { libc::memfd_create(c"lucid-fuzz-initrd".as_ptr(), 0) };
            assert!(fd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
            // SAFETY: `fd` is a fresh descriptor that nothing else owns.
            let mut f = unsafe { File::from_raw_fd(fd) };
            f.write_all(&[0x5a; INITRD]).expect("fill the initrd");
            let path = format!("/proc/self/fd/{}", f.as_raw_fd()).into();
            (f, path)
        });
        path
    }

    /// Detects and loads `image`; `opts` bit 0 adds the initrd, bit 1 leaves out ACPI. Checks
    /// that what the loader reports lies in guest RAM.
    pub fn load(image: Vec<u8>, opts: u8) {
        static ACPI: OnceLock<AcpiConfig> = OnceLock::new();
        let Ok(image) = KernelImage::from_bytes(Path::new("fuzz"), image) else {
            return;
        };
        let ranges: Vec<_> = ram_regions(MEM)
            .into_iter()
            .map(|(a, s)| (GuestAddress(a), s as usize))
            .collect();
        let mem = GuestMemoryMmap::from_ranges(&ranges).expect("guest RAM");
        let p = BootParams {
            kernel: image.path(),
            initrd: (opts & 1 != 0).then(initrd),
            cmdline: "console=ttyS0 reboot=k",
            mem_size: MEM,
            acpi: (opts & 2 == 0).then(|| ACPI.get_or_init(|| AcpiConfig::new(2))),
        };
        let Ok(s) = lucid_boot::load_image(&mem, &image, &p) else {
            return;
        };
        assert!(s.kernel_end <= MEM, "{s:?}");
        if let Some((at, len)) = s.initrd {
            assert!(len == INITRD as u64 && at + len <= MEM, "{s:?}");
        }
        assert!(s.boot_info < MEM, "{s:?}");
        assert!(s.entry.gdt < MEM && s.entry.stack_top <= MEM, "{s:?}");
        if let EntryMode::Long64 { rsi, .. } = s.entry.mode {
            assert!(rsi < MEM && s.entry.page_tables < MEM, "{s:?}");
        }
    }

    /// The options byte and the image of an input: the last byte is the options.
    pub fn split(data: &[u8]) -> Option<(u8, Vec<u8>)> {
        let (&opts, image) = data.split_last()?;
        Some((opts, image.to_vec()))
    }
}
