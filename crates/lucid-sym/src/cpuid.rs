//! The hypervisor CPUID leaves (`abi::CPUID_LEAF`, `abi::CPUID_LEAF_INFO`) for hosts whose CPUID
//! is intercepted: the discovery path Palacios used. On PVM hosts CPUID runs natively, so the
//! guests there use `HC_DISCOVER`; both paths report the same version and features.

use crate::abi;

/// One CPUID leaf's registers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Leaf {
    pub function: u32,
    pub eax: u32,
    pub ebx: u32,
    pub ecx: u32,
    pub edx: u32,
}

/// The two leaves Lucid adds with `--symbiotic`.
pub fn leaves(features: u64, hypercall_port: u16) -> [Leaf; 2] {
    let sig = |i: usize| u32::from_le_bytes(abi::CPUID_SIGNATURE[i..i + 4].try_into().expect("4"));
    [
        Leaf {
            function: abi::CPUID_LEAF,
            eax: abi::CPUID_LEAF_INFO,
            ebx: sig(0),
            ecx: sig(4),
            edx: sig(8),
        },
        Leaf {
            function: abi::CPUID_LEAF_INFO,
            eax: abi::VERSION as u32,
            ebx: features as u32,
            ecx: u32::from(hypercall_port),
            edx: 0,
        },
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_signature_reads_back_in_ebx_ecx_edx_order() {
        let [l, info] = leaves(abi::FEAT_SYMSPY | abi::FEAT_SYMCALL, 0x599);
        let mut sig = Vec::new();
        for r in [l.ebx, l.ecx, l.edx] {
            sig.extend_from_slice(&r.to_le_bytes());
        }
        assert_eq!(&sig, abi::CPUID_SIGNATURE);
        assert_eq!(l.eax, abi::CPUID_LEAF_INFO);
        assert_eq!((info.eax, info.ebx, info.ecx), (1, 3, 0x599));
        // Clear of KVM's own range (0x40000000-0x400000ff).
        assert!(l.function >= 0x4000_0100);
    }
}
