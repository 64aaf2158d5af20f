//! Per-vCPU adjustment of the `KVM_GET_SUPPORTED_CPUID` entries before `KVM_SET_CPUID2`.

use kvm_bindings::CpuId;

/// Leaf 1 ECX bit 31: running under a hypervisor.
pub const CPUID_HYPERVISOR: u32 = 1 << 31;
/// Leaf 1 EDX bit 28: the package has more than one logical processor.
pub const CPUID_HTT: u32 = 1 << 28;

/// Bits needed to number `n` things (ceil(log2(n))).
fn bits_for(n: u32) -> u32 {
    if n <= 1 {
        0
    } else {
        32 - (n - 1).leading_zeros()
    }
}

/// Adjusts `entries` (from `KVM_GET_SUPPORTED_CPUID`) for vCPU `vcpu_id` of `vcpus`, all of them
/// cores of one package with one thread each and APIC ID = vCPU index:
///
/// - leaf 1: initial APIC ID (EBX[31:24]) = `vcpu_id`, logical processor count EBX[23:16] =
///   `vcpus` (and HTT when more than one), CLFLUSH size kept, hypervisor bit (ECX[31]) set;
/// - leaf 4: EAX[31:26] = cores per package - 1, EAX[25:14] = logical processors sharing the
///   cache - 1 (0 for L1/L2, all vCPUs for L3);
/// - leaves 0xb and 0x1f: x2APIC topology, SMT level (1 thread) and core level (`vcpus`),
///   EDX = x2APIC ID;
/// - leaf 0x80000008 ECX[7:0] (AMD core count - 1).
///
/// The KVM leaves (0x40000000 "KVMKVMKVM", 0x40000001 features) are left as KVM reports them.
pub fn filter_cpuid(entries: &mut CpuId, vcpu_id: u8, vcpus: u8) {
    let vcpus = u32::from(vcpus.max(1));
    let id = u32::from(vcpu_id);
    let core_bits = bits_for(vcpus);
    for e in entries.as_mut_slice() {
        match e.function {
            1 => {
                e.ebx = (e.ebx & 0x0000_ffff) | (id << 24) | ((vcpus & 0xff) << 16);
                if vcpus > 1 {
                    e.edx |= CPUID_HTT;
                } else {
                    e.edx &= !CPUID_HTT;
                }
                e.ecx |= CPUID_HYPERVISOR;
            }
            4 => {
                let level = (e.eax >> 5) & 0x7;
                let sharing = if level >= 3 { vcpus - 1 } else { 0 };
                e.eax = (e.eax & 0x3fff) | ((sharing & 0xfff) << 14) | (((vcpus - 1) & 0x3f) << 26);
            }
            0xb | 0x1f => {
                e.edx = id;
                match e.index {
                    0 => {
                        // SMT level: one thread per core.
                        e.eax = 0;
                        e.ebx = 1;
                        e.ecx = 1 << 8;
                    }
                    1 => {
                        // Core level: all vCPUs in one package.
                        e.eax = core_bits;
                        e.ebx = vcpus;
                        e.ecx = (2 << 8) | 1;
                    }
                    n => {
                        // Invalid level terminates the enumeration.
                        e.eax = 0;
                        e.ebx = 0;
                        e.ecx = n & 0xff;
                    }
                }
            }
            0x8000_0008 => {
                e.ecx = (e.ecx & !0xff) | ((vcpus - 1) & 0xff);
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvm_bindings::kvm_cpuid_entry2;

    fn entry(function: u32, index: u32) -> kvm_cpuid_entry2 {
        kvm_cpuid_entry2 {
            function,
            index,
            eax: 0xffff_ffff,
            ebx: 0x0008_0800, // clflush 8, some count
            ecx: 0,
            edx: 0,
            ..Default::default()
        }
    }

    #[test]
    fn topology_leaves() {
        let list = [
            entry(1, 0),
            kvm_cpuid_entry2 {
                eax: 0x21,
                ..entry(4, 0)
            },
            kvm_cpuid_entry2 {
                eax: 0x63,
                ..entry(4, 3)
            },
            entry(0xb, 0),
            entry(0xb, 1),
            entry(0xb, 2),
            entry(0x4000_0000, 0),
        ];
        let mut c = CpuId::from_entries(&list).unwrap();
        filter_cpuid(&mut c, 3, 4);
        let s = c.as_slice();
        assert_eq!(s[0].ebx >> 24, 3);
        assert_eq!((s[0].ebx >> 16) & 0xff, 4);
        assert_eq!(s[0].ebx & 0xffff, 0x0800);
        assert_ne!(s[0].ecx & CPUID_HYPERVISOR, 0);
        assert_ne!(s[0].edx & CPUID_HTT, 0);
        assert_eq!(s[1].eax >> 26, 3);
        assert_eq!((s[1].eax >> 14) & 0xfff, 0);
        assert_eq!((s[2].eax >> 14) & 0xfff, 3);
        assert_eq!(s[2].eax & 0x3fff, 0x63);
        assert_eq!((s[3].ebx, s[3].ecx, s[3].edx), (1, 0x100, 3));
        assert_eq!((s[4].eax, s[4].ebx, s[4].ecx, s[4].edx), (2, 4, 0x201, 3));
        assert_eq!((s[5].ebx, s[5].ecx & 0xff00), (0, 0));
        assert_eq!(s[6].eax, 0xffff_ffff, "KVM leaves untouched");
    }

    #[test]
    fn bits() {
        assert_eq!(bits_for(1), 0);
        assert_eq!(bits_for(2), 1);
        assert_eq!(bits_for(3), 2);
        assert_eq!(bits_for(4), 2);
        assert_eq!(bits_for(5), 3);
    }
}
