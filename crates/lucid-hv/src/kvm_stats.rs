//! KVM's binary statistics (`KVM_GET_STATS_FD`): per-VM and per-vCPU counters kept by the kernel,
//! read beside Lucid's own counts so the two can be checked against each other.

use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::fs::FileExt;

use vmm_sys_util::ioctl::ioctl;
use vmm_sys_util::ioctl_io_nr;

const KVMIO: u32 = 0xAE;
ioctl_io_nr!(KVM_GET_STATS_FD, KVMIO, 0xce);

/// Size of `struct kvm_stats_header` and of the fixed part of `struct kvm_stats_desc`.
const HEADER_SIZE: usize = 24;
const DESC_FIXED: usize = 16;

struct Desc {
    name: String,
    offset: u64,
    size: u16,
}

/// An open statistics file and the descriptors read once from it.
pub struct KvmStats {
    file: File,
    descs: Vec<Desc>,
    data_offset: u64,
}

impl KvmStats {
    /// Opens the statistics of a VM or vCPU fd. `None` when the kernel lacks the capability or the
    /// header is malformed: statistics are an aid, never a reason to fail a run.
    pub fn open(fd: &impl AsRawFd) -> Option<Self> {
        // SAFETY: KVM_GET_STATS_FD takes no argument and returns a new fd or -1.
        let raw = unsafe { ioctl(fd, KVM_GET_STATS_FD()) };
        if raw < 0 {
            return None;
        }
        // SAFETY: `raw` is a fresh fd owned by nobody else.
        let file = unsafe { File::from_raw_fd(raw) };
        let mut hdr = [0u8; HEADER_SIZE];
        file.read_exact_at(&mut hdr, 0).ok()?;
        let u32_at = |b: &[u8], o: usize| u32::from_ne_bytes(b[o..o + 4].try_into().unwrap());
        let name_size = u32_at(&hdr, 4) as usize;
        let num_desc = u32_at(&hdr, 8) as usize;
        let desc_offset = u32_at(&hdr, 16) as u64;
        let data_offset = u32_at(&hdr, 20) as u64;
        if num_desc > 4096 || name_size > 4096 {
            return None;
        }
        let desc_len = DESC_FIXED + name_size;
        let mut raw_descs = vec![0u8; desc_len * num_desc];
        file.read_exact_at(&mut raw_descs, desc_offset).ok()?;
        let descs = raw_descs
            .chunks_exact(desc_len)
            .map(|d| {
                let size = u16::from_ne_bytes([d[6], d[7]]);
                let offset = u32_at(d, 8) as u64;
                let name_bytes = &d[DESC_FIXED..];
                let end = name_bytes.iter().position(|&c| c == 0).unwrap_or(name_size);
                Desc {
                    name: String::from_utf8_lossy(&name_bytes[..end]).into_owned(),
                    offset,
                    size,
                }
            })
            .collect();
        Some(KvmStats {
            file,
            descs,
            data_offset,
        })
    }

    /// Current values, one per counter; histograms are summed into one value.
    pub fn read(&self) -> Vec<(String, u64)> {
        self.descs
            .iter()
            .filter_map(|d| {
                let mut buf = vec![0u8; d.size as usize * 8];
                self.file
                    .read_exact_at(&mut buf, self.data_offset + d.offset)
                    .ok()?;
                let sum = buf
                    .chunks_exact(8)
                    .map(|c| u64::from_ne_bytes(c.try_into().unwrap()))
                    .fold(0u64, u64::wrapping_add);
                Some((d.name.clone(), sum))
            })
            .collect()
    }

    /// One named value, e.g. `io_exits`.
    pub fn get(&self, name: &str) -> Option<u64> {
        self.read()
            .into_iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v)
    }
}
