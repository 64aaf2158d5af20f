//! Register offsets, bit fields and the capability values of the emulated unit (Intel VT-d
//! spec, chapter 10). Page 0 keeps the spec's layout; page 1 holds the fault-recording registers
//! (CAP.FRO) and the IOTLB registers (ECAP.IRO), which mix write-1-to-clear or start bits with
//! read-only fields and therefore must trap even in sidecore mode.

pub const VER: u64 = 0x00;
pub const CAP: u64 = 0x08;
pub const ECAP: u64 = 0x10;
pub const GCMD: u64 = 0x18;
pub const GSTS: u64 = 0x1c;
pub const RTADDR: u64 = 0x20;
pub const CCMD: u64 = 0x28;
pub const FSTS: u64 = 0x34;
pub const FECTL: u64 = 0x38;
pub const FEDATA: u64 = 0x3c;
pub const FEADDR: u64 = 0x40;
pub const FEUADDR: u64 = 0x44;
pub const IQH: u64 = 0x80;
pub const IQT: u64 = 0x88;
pub const IQA: u64 = 0x90;
pub const ICS: u64 = 0x9c;
pub const IECTL: u64 = 0xa0;
pub const IEDATA: u64 = 0xa4;
pub const IEADDR: u64 = 0xa8;
pub const IEUADDR: u64 = 0xac;
pub const IRTA: u64 = 0xb8;

/// Fault-recording registers: page 1, `NFR` records of 16 bytes.
pub const FRCD: u64 = 0x1000;
pub const NFR: usize = 8;
/// IOTLB registers: IVA then IOTLB, after the fault records on page 1.
pub const IVA: u64 = 0x1100;
pub const IOTLB: u64 = 0x1108;

/// Version 1.0.
pub const VER_VALUE: u32 = 0x10;

/// Maximum address-mask value for page-selective invalidations (2 MiB at most: every page in
/// the range is walked to count maps and unmaps).
pub const MAMV: u64 = 9;

/// CAP: 16-bit domain ids (ND=6), Caching Mode, SAGAW 39 and 48 bits, MGAW 48, FRO at page 1,
/// 2 MiB second-level pages, page-selective invalidation with MAMV, NFR records.
pub const CAP_VALUE: u64 = 6
    | 1 << 7
    | 0b110 << 8
    | 47 << 16
    | (FRCD / 16) << 24
    | 1 << 34
    | 1 << 39
    | ((NFR as u64) - 1) << 40
    | MAMV << 48;

/// ECAP: coherent table walks (C, so guests need not flush caches), queued invalidation,
/// interrupt remapping (EIM=0: xAPIC destinations), IRO at page 1, handle mask up to 15.
pub const ECAP_VALUE: u64 = 1 | 1 << 1 | 1 << 3 | (IVA / 16) << 8 | 0xf << 20;

// GCMD / GSTS bits (the status bit sits at the command bit's position).
pub const G_TE: u32 = 1 << 31;
pub const G_SRTP: u32 = 1 << 30;
pub const G_QIE: u32 = 1 << 26;
pub const G_IRE: u32 = 1 << 25;
pub const G_SIRTP: u32 = 1 << 24;
pub const G_CFI: u32 = 1 << 23;

// FSTS bits.
pub const FS_PFO: u32 = 1;
pub const FS_PPF: u32 = 1 << 1;
pub const FS_IQE: u32 = 1 << 4;
pub const FS_ICE: u32 = 1 << 5;
pub const FS_ITE: u32 = 1 << 6;
/// Write-1-to-clear bits of FSTS (PFO, AFO, APF, IQE, ICE, ITE).
pub const FS_RW1C: u32 = 0x7d;
/// Bits whose setting raises the fault event (when none of them was set before).
pub const FS_EVENT: u32 = FS_PFO | FS_PPF | FS_IQE | FS_ICE | FS_ITE;

// FECTL / IECTL.
pub const CTL_IM: u32 = 1 << 31;
pub const CTL_IP: u32 = 1 << 30;

pub const ICS_IWC: u32 = 1;

// CCMD.
pub const CCMD_ICC: u64 = 1 << 63;
// IOTLB register.
pub const IOTLB_IVT: u64 = 1 << 63;

/// Fault record high qword: F (fault), T (1 = read request), FR (reason), SID.
pub const FRCD_F: u64 = 1 << 63;
pub const FRCD_T: u64 = 1 << 62;

/// In sidecore mode FSTS and ICS carry this otherwise reserved bit whenever they are non-zero,
/// so that a guest's write-1-to-clear of exactly the set bits differs from what was published.
pub const SC_MARK: u32 = 1 << 31;
/// In sidecore mode a processed GCMD write is replaced by this value (reserved bits only): any
/// guest command then differs from it, even one equal to the previous command.
pub const SC_GCMD_CONSUMED: u32 = 0x0000_0001;
