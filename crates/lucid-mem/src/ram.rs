//! RAM regions and their backing. The default is anonymous private memory; a shared memfd lets
//! another thread or process see the pages (sidecore polling, SymSpy); a private file mapping
//! over a disk image is what the Swap Mapper needs. Any page range can be remapped at run time:
//! KVM follows the new mapping through its MMU notifier.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::sync::Arc;

use vm_memory::mmap::MmapRegionBuilder;
use vm_memory::{FileOffset, GuestAddress, GuestRegionMmap, MmapRegion};

use crate::GuestMemoryMmap;

/// What failed while mapping or remapping guest RAM, and with what.
#[derive(Debug, thiserror::Error)]
pub enum MemError {
    #[error("cannot create the memfd of {size} bytes for guest RAM")]
    Memfd {
        size: u64,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot open memory backing file {path}")]
    File {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("memory backing file {path} has {have} bytes, the guest needs {need}")]
    FileTooSmall { path: PathBuf, have: u64, need: u64 },
    #[error("cannot duplicate the backing fd for the RAM region at {gpa:#x}")]
    DupFd {
        gpa: u64,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot map {size:#x} bytes of guest RAM at {gpa:#x}")]
    Mmap {
        gpa: u64,
        size: u64,
        #[source]
        source: vm_memory::mmap::MmapRegionError,
    },
    #[error("the RAM region at {gpa:#x} of {size:#x} bytes ends beyond the address space")]
    RegionOverflow { gpa: u64, size: u64 },
    #[error("the RAM regions {ranges:x?} cannot form guest memory")]
    Layout {
        ranges: Vec<(u64, u64)>,
        #[source]
        source: vm_memory::GuestRegionCollectionError,
    },
    #[error("remap of {gpa:#x}+{len:#x} is not inside one RAM region or not page aligned")]
    BadRemap { gpa: u64, len: u64 },
    #[error("remap of {gpa:#x}+{len:#x} failed")]
    RemapFailed {
        gpa: u64,
        len: u64,
        #[source]
        source: std::io::Error,
    },
}

/// Gives guest pages back to the host (balloon inflate, free-page reporting): their content is
/// dropped and they read as zeros on the next access. `GuestRam` does it by mapping fresh
/// anonymous memory over them; the Swap Mapper supplies its own so that it also forgets pages
/// it had tied to disk-image blocks (a plain `MADV_DONTNEED` on such a page would bring the
/// image block back instead of zeros).
pub trait PageDiscard: Send + Sync {
    /// Discards the page-aligned range `gpa..gpa+len` (inside one RAM region).
    fn discard(&self, gpa: u64, len: u64) -> Result<(), MemError>;
}

impl PageDiscard for GuestRam {
    fn discard(&self, gpa: u64, len: u64) -> Result<(), MemError> {
        self.remap(gpa, len, None)
    }
}

/// How guest RAM is backed.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Backing {
    /// Private anonymous memory (the default).
    #[default]
    Anonymous,
    /// A shared memfd: visible to other mappings of the same fd.
    SharedMemfd,
    /// A private (copy-on-write) mapping of a file: reads come from the file until written.
    FilePrivate(PathBuf),
}

/// One RAM region as Lucid sees it: where it is in the guest and in the host, and its fd if any.
#[derive(Clone, Debug)]
pub struct RamRegion {
    pub gpa: u64,
    pub size: u64,
    pub host_addr: u64,
    pub fd: Option<Arc<File>>,
    pub fd_offset: u64,
}

/// All of a VM's RAM.
pub struct GuestRam {
    mem: GuestMemoryMmap,
    regions: Vec<RamRegion>,
    backing: Backing,
}

const PAGE: u64 = 4096;

impl GuestRam {
    /// Maps `ranges` (guest-physical start, length) with `backing`. File-backed RAM uses
    /// consecutive offsets of the file for consecutive regions.
    pub fn new(ranges: &[(u64, u64)], backing: Backing) -> Result<Self, MemError> {
        let total: u64 = ranges.iter().map(|r| r.1).sum();
        let file: Option<Arc<File>> = match &backing {
            Backing::Anonymous => None,
            Backing::SharedMemfd => {
                // SAFETY: memfd_create with a valid NUL-terminated name; the fd is checked below.
                let fd =
                    unsafe { libc::memfd_create(c"lucid-guest-ram".as_ptr(), libc::MFD_CLOEXEC) };
                if fd < 0 {
                    return Err(MemError::Memfd {
                        size: total,
                        source: std::io::Error::last_os_error(),
                    });
                }
                // SAFETY: fd is a fresh descriptor we own.
                let f = unsafe { <File as std::os::fd::FromRawFd>::from_raw_fd(fd) };
                f.set_len(total).map_err(|source| MemError::Memfd {
                    size: total,
                    source,
                })?;
                Some(Arc::new(f))
            }
            Backing::FilePrivate(path) => {
                let f = File::open(path).map_err(|source| MemError::File {
                    path: path.clone(),
                    source,
                })?;
                let have = f.metadata().map(|m| m.len()).unwrap_or(0);
                if have < total {
                    return Err(MemError::FileTooSmall {
                        path: path.clone(),
                        have,
                        need: total,
                    });
                }
                Some(Arc::new(f))
            }
        };
        let (flags, prot) = match backing {
            Backing::Anonymous => (
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                libc::PROT_READ | libc::PROT_WRITE,
            ),
            Backing::SharedMemfd => (
                libc::MAP_SHARED | libc::MAP_NORESERVE,
                libc::PROT_READ | libc::PROT_WRITE,
            ),
            Backing::FilePrivate(_) => (
                libc::MAP_PRIVATE | libc::MAP_NORESERVE,
                libc::PROT_READ | libc::PROT_WRITE,
            ),
        };
        let mut regions = Vec::new();
        let mut guest_regions = Vec::new();
        let mut offset = 0u64;
        for &(gpa, size) in ranges {
            let mut builder = MmapRegionBuilder::new(size as usize)
                .with_mmap_prot(prot)
                .with_mmap_flags(flags);
            if let Some(f) = &file {
                let dup = f
                    .try_clone()
                    .map_err(|source| MemError::DupFd { gpa, source })?;
                builder = builder.with_file_offset(FileOffset::new(dup, offset));
            }
            let region: MmapRegion<()> =
                builder
                    .build()
                    .map_err(|source| MemError::Mmap { gpa, size, source })?;
            let host_addr = region.as_ptr() as u64;
            let gr = GuestRegionMmap::new(region, GuestAddress(gpa))
                .ok_or(MemError::RegionOverflow { gpa, size })?;
            guest_regions.push(gr);
            regions.push(RamRegion {
                gpa,
                size,
                host_addr,
                fd: file.clone(),
                fd_offset: offset,
            });
            offset += size;
        }
        let mem =
            GuestMemoryMmap::from_regions(guest_regions).map_err(|source| MemError::Layout {
                ranges: ranges.to_vec(),
                source,
            })?;
        Ok(GuestRam {
            mem,
            regions,
            backing,
        })
    }

    pub fn memory(&self) -> &GuestMemoryMmap {
        &self.mem
    }

    pub fn regions(&self) -> &[RamRegion] {
        &self.regions
    }

    pub fn backing(&self) -> &Backing {
        &self.backing
    }

    pub fn size(&self) -> u64 {
        self.regions.iter().map(|r| r.size).sum()
    }

    /// Replaces the pages at `gpa..gpa+len` with a private mapping of `file` at `file_offset`
    /// (or fresh anonymous zero pages when `file` is `None`). The VM may be running: KVM drops
    /// its old translations and faults the new pages in on the next access.
    pub fn remap(&self, gpa: u64, len: u64, file: Option<(&File, u64)>) -> Result<(), MemError> {
        let region = self
            .regions
            .iter()
            .find(|r| gpa >= r.gpa && gpa.saturating_add(len) <= r.gpa + r.size)
            .filter(|_| gpa.is_multiple_of(PAGE) && len.is_multiple_of(PAGE) && len > 0)
            .ok_or(MemError::BadRemap { gpa, len })?;
        let host = region.host_addr + (gpa - region.gpa);
        let (flags, fd, off) = match file {
            Some((f, off)) => (libc::MAP_PRIVATE | libc::MAP_FIXED, f.as_raw_fd(), off),
            None => (
                libc::MAP_PRIVATE | libc::MAP_FIXED | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            ),
        };
        // SAFETY: `host..host+len` lies inside a mapping this GuestRam owns (checked above);
        // MAP_FIXED replaces those pages in place, so every pointer into the region stays valid.
        let r = unsafe {
            libc::mmap(
                host as *mut libc::c_void,
                len as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                flags,
                fd,
                off as libc::off_t,
            )
        };
        if r == libc::MAP_FAILED {
            return Err(MemError::RemapFailed {
                gpa,
                len,
                source: std::io::Error::last_os_error(),
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use vm_memory::{Bytes, GuestAddress};

    #[test]
    fn anonymous_ram_reads_back() {
        let ram = GuestRam::new(&[(0, 1 << 20), (4 << 20, 1 << 20)], Backing::Anonymous).unwrap();
        ram.memory()
            .write_obj(0xdead_beefu32, GuestAddress(0x4000))
            .unwrap();
        assert_eq!(
            ram.memory().read_obj::<u32>(GuestAddress(0x4000)).unwrap(),
            0xdead_beef
        );
        assert!(ram.memory().read_obj::<u32>(GuestAddress(2 << 20)).is_err());
        assert_eq!(ram.size(), 2 << 20);
    }

    #[test]
    fn memfd_is_shared_with_other_mappings() {
        let ram = GuestRam::new(&[(0, 1 << 20)], Backing::SharedMemfd).unwrap();
        ram.memory()
            .write_obj(0x1234u16, GuestAddress(0x10))
            .unwrap();
        let f = ram.regions()[0].fd.clone().unwrap();
        let mut buf = [0u8; 2];
        std::os::unix::fs::FileExt::read_exact_at(f.as_ref(), &mut buf, 0x10).unwrap();
        assert_eq!(u16::from_ne_bytes(buf), 0x1234);
    }

    #[test]
    fn file_private_reads_file_and_does_not_write_it() {
        let path = std::env::temp_dir().join(format!("lucid-mem-test-{}", std::process::id()));
        let mut f = File::create(&path).unwrap();
        f.write_all(&vec![0xabu8; 2 << 20]).unwrap();
        drop(f);
        let ram = GuestRam::new(&[(0, 2 << 20)], Backing::FilePrivate(path.clone())).unwrap();
        assert_eq!(
            ram.memory().read_obj::<u8>(GuestAddress(0x1000)).unwrap(),
            0xab
        );
        ram.memory().write_obj(0u8, GuestAddress(0x1000)).unwrap();
        assert_eq!(std::fs::read(&path).unwrap()[0x1000], 0xab);
        std::fs::remove_file(path).unwrap();
    }

    #[test]
    fn remap_replaces_pages_in_place() {
        let path = std::env::temp_dir().join(format!("lucid-remap-test-{}", std::process::id()));
        std::fs::write(&path, vec![0x5au8; 8192]).unwrap();
        let ram = GuestRam::new(&[(0, 1 << 20)], Backing::Anonymous).unwrap();
        let f = File::open(&path).unwrap();
        ram.remap(0x2000, 0x1000, Some((&f, 0x1000))).unwrap();
        assert_eq!(
            ram.memory().read_obj::<u8>(GuestAddress(0x2abc)).unwrap(),
            0x5a
        );
        ram.remap(0x2000, 0x1000, None).unwrap();
        assert_eq!(
            ram.memory().read_obj::<u8>(GuestAddress(0x2abc)).unwrap(),
            0
        );
        assert!(ram.remap(0x2001, 0x1000, None).is_err());
        assert!(ram.remap(0xff000, 0x2000, None).is_err());
        std::fs::remove_file(path).unwrap();
    }
}
