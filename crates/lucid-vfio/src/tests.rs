use std::sync::Arc;

use lucid_iommu::{MapListener, Perm};

use crate::mock::{Call, Mock, Script};
use crate::{BarInfo, IrqCounts, RamRegions, RegionInfo, VfioDevice, VfioError};

const GROUP: u32 = 12;
const NAME: &str = "0000:01:00.0";

fn open(script: Script) -> (Arc<Mock>, Result<VfioDevice<Mock>, VfioError>) {
    let mock = Arc::new(Mock::new(script));
    let dev = VfioDevice::open(mock.clone(), GROUP, NAME);
    (mock, dev)
}

fn err(script: Script) -> (Vec<Call>, String) {
    let (mock, dev) = open(script);
    let e = dev.err().expect("setup should fail").to_string();
    (mock.calls(), e)
}

fn errno(name: &'static str, e: i32) -> Script {
    let mut s = Script::default();
    s.errno.insert(name, e);
    s
}

/// Two RAM regions adjacent in guest-physical space, far apart in the host.
const A: u64 = 0x7f00_0000_0000;
const B: u64 = 0x7e00_0000_0000;

fn ram() -> RamRegions {
    // SAFETY: the mock never touches the addresses.
    unsafe { RamRegions::new(&[(0, 0x10000, A), (0x10000, 0x10000, B)]) }
}

#[test]
fn setup_runs_in_order() {
    let (mock, dev) = open(Script::default());
    let dev = dev.unwrap();
    let mut want = vec![
        Call::OpenContainer,
        Call::ApiVersion,
        Call::CheckExtension(3),
        Call::OpenGroup(GROUP),
        Call::GroupStatus,
        Call::SetContainer,
        Call::SetIommu(3),
        Call::Device(NAME.into()),
        Call::DeviceInfo,
    ];
    want.extend((0..=7).map(Call::RegionInfo));
    want.extend([Call::IrqInfo(0), Call::IrqInfo(1), Call::IrqInfo(2)]);
    assert_eq!(mock.calls(), want);
    assert_eq!((dev.name(), dev.group()), (NAME, GROUP));
}

#[test]
fn missing_container() {
    let (calls, e) = err(errno("OpenContainer", libc::ENOENT));
    assert!(e.starts_with("/dev/vfio/vfio is missing"), "{e}");
    assert!(e.contains("vfio-pci"), "{e}");
    assert_eq!(calls, [Call::OpenContainer]);
    let (_, e) = err(errno("OpenContainer", libc::EACCES));
    assert!(e.starts_with("cannot open /dev/vfio/vfio: "), "{e}");
}

#[test]
fn wrong_api_version() {
    let (calls, e) = err(Script {
        api_version: 1,
        ..Script::default()
    });
    assert_eq!(
        e,
        "the host's VFIO API version is 1, Lucid speaks version 0"
    );
    assert_eq!(calls.len(), 2);
}

#[test]
fn no_type1v2() {
    let (calls, e) = err(Script {
        type1v2: false,
        ..Script::default()
    });
    assert!(e.contains("no TYPE1v2 IOMMU"), "{e}");
    assert_eq!(calls.last(), Some(&Call::CheckExtension(3)));
}

#[test]
fn missing_group() {
    let (calls, e) = err(errno("OpenGroup", libc::ENOENT));
    assert!(e.starts_with("no /dev/vfio/12: IOMMU group 12"), "{e}");
    assert_eq!(calls.last(), Some(&Call::OpenGroup(GROUP)));
    let (_, e) = err(errno("OpenGroup", libc::EBUSY));
    assert!(e.starts_with("cannot open /dev/vfio/12: "), "{e}");
}

#[test]
fn group_not_viable() {
    let (calls, e) = err(Script {
        group_flags: 0,
        ..Script::default()
    });
    assert_eq!(
        e,
        "IOMMU group 12 is not viable: bind every device of IOMMU group 12 to vfio-pci"
    );
    // Nothing joins the container.
    assert_eq!(calls.last(), Some(&Call::GroupStatus));
}

#[test]
fn ioctl_failures_name_the_ioctl() {
    for (call, ioctl) in [
        ("GroupStatus", "VFIO_GROUP_GET_STATUS"),
        ("SetContainer", "VFIO_GROUP_SET_CONTAINER"),
        ("SetIommu", "VFIO_SET_IOMMU"),
        ("DeviceInfo", "VFIO_DEVICE_GET_INFO"),
        ("RegionInfo", "VFIO_DEVICE_GET_REGION_INFO"),
        ("IrqInfo", "VFIO_DEVICE_GET_IRQ_INFO"),
    ] {
        let (_, e) = err(errno(call, libc::EINVAL));
        assert!(e.starts_with(&format!("{ioctl} failed: ")), "{call}: {e}");
    }
}

#[test]
fn missing_device() {
    let (calls, e) = err(errno("Device", libc::ENODEV));
    assert!(
        e.starts_with("no device 0000:01:00.0 in IOMMU group 12: "),
        "{e}"
    );
    assert_eq!(calls.last(), Some(&Call::Device(NAME.into())));
}

#[test]
fn not_pci_and_too_few_regions() {
    let mut s = Script::default();
    s.device.flags = 1;
    let (_, e) = err(s);
    assert_eq!(
        e,
        "0000:01:00.0 is not a PCI device (VFIO device flags 0x1)"
    );
    let mut s = Script::default();
    s.device.num_regions = 7;
    let (_, e) = err(s);
    assert!(e.starts_with("0000:01:00.0 has 7 regions"), "{e}");
}

#[test]
fn bars_and_irqs() {
    let (_, dev) = open(Script::default());
    let dev = dev.unwrap();
    assert_eq!(
        dev.bar(0),
        Some(BarInfo {
            size: 1 << 20,
            mappable: true
        })
    );
    assert_eq!(dev.bar(1), None);
    assert_eq!(
        dev.bar(2),
        Some(BarInfo {
            size: 0x4000,
            mappable: false
        })
    );
    assert_eq!(dev.bar(6), None);
    assert_eq!(
        dev.irq_counts(),
        IrqCounts {
            intx: 1,
            msi: 1,
            msix: 0
        }
    );
}

#[test]
fn bar_size_must_be_a_power_of_two() {
    let mut s = Script::default();
    s.regions.insert(
        4,
        RegionInfo {
            flags: 3,
            size: 0x3000,
            offset: 4 << 40,
        },
    );
    let (_, e) = err(s);
    assert_eq!(
        e,
        "BAR 4 of 0000:01:00.0 is 0x3000 bytes, not a power of two"
    );
}

#[test]
fn irqs_past_num_irqs_are_not_asked() {
    let mut s = Script::default();
    s.device.num_irqs = 2;
    let (mock, dev) = open(s);
    assert_eq!(dev.unwrap().irq_counts().msix, 0);
    assert!(!mock.calls().contains(&Call::IrqInfo(2)));
}

#[test]
fn region_access_at_region_offset() {
    let (mock, dev) = open(Script::default());
    let dev = dev.unwrap();
    mock.clear();
    dev.write(2, 0x10, &[1, 2, 3, 4]).unwrap();
    let mut buf = [0u8; 2];
    dev.read(7, 0x3e, &mut buf).unwrap();
    assert_eq!(buf, [0xab, 0xab]);
    assert_eq!(
        mock.calls(),
        [
            Call::RegionWrite((2 << 40) + 0x10, vec![1, 2, 3, 4]),
            Call::RegionRead((7 << 40) + 0x3e, 2),
        ]
    );
    let e = dev.read(7, 0xff, &mut buf).unwrap_err().to_string();
    assert_eq!(e, "access 0xff+2 outside region 7 (0x100 bytes)");
    assert!(dev.write(1, 0, &[0]).is_err());
    assert!(dev.read(7, u64::MAX, &mut buf).is_err());
    assert_eq!(mock.calls().len(), 2);
}

#[test]
fn interrupts_and_reset() {
    let (mock, dev) = open(Script::default());
    let dev = dev.unwrap();
    mock.clear();
    dev.enable_msi(&[10]).unwrap();
    dev.enable_intx(11, 12).unwrap();
    dev.disable_irq(1).unwrap();
    dev.reset().unwrap();
    let set = |index, flags, fds: &[i32]| Call::SetIrqs {
        index,
        flags,
        start: 0,
        fds: fds.to_vec(),
    };
    assert_eq!(
        mock.calls(),
        [
            set(1, 4 | 32, &[10]),
            set(0, 4 | 32, &[11]),
            set(0, 4 | 16, &[12]),
            set(1, 1 | 32, &[]),
            Call::Reset,
        ]
    );
    let e = dev.enable_msix(&[13]).unwrap_err().to_string();
    assert_eq!(e, "irq index 2 has 0 vectors, 1 given");
    assert!(dev.enable_msi(&[1, 2]).is_err());
    assert_eq!(mock.calls().len(), 5);
}

#[test]
fn map_all_ram_maps_iova_equal_gpa() {
    let (mock, dev) = open(Script::default());
    let dma = dev.unwrap().dma(ram());
    mock.clear();
    dma.map_all_ram().unwrap();
    let rw = Perm::READ_WRITE;
    assert_eq!(
        mock.calls(),
        [
            Call::MapDma {
                iova: 0,
                size: 0x10000,
                vaddr: A,
                perm: rw
            },
            Call::MapDma {
                iova: 0x10000,
                size: 0x10000,
                vaddr: B,
                perm: rw
            },
        ]
    );
    assert_eq!(dma.maps(), 2);
}

#[test]
fn map_all_ram_failure_is_an_error() {
    let (_, dev) = open(errno("MapDma", libc::ENOMEM));
    let e = dev.unwrap().dma(ram()).map_all_ram().unwrap_err();
    assert!(
        e.to_string().starts_with("VFIO_IOMMU_MAP_DMA failed: "),
        "{e}"
    );
}

#[test]
fn listener_splits_across_ram_regions_with_perm() {
    let (mock, dev) = open(Script::default());
    let dma = dev.unwrap().dma(ram());
    mock.clear();
    let ro = Perm {
        read: true,
        write: false,
    };
    let wo = Perm {
        read: false,
        write: true,
    };
    // gpa 0xe000..0x12000 crosses from the first region into the second.
    dma.map(0x5000_0000, 0xe000, 0x4000, ro);
    dma.map(0x6000_0000, 0x1000, 0x1000, wo);
    dma.unmap(0x5000_0000, 0x4000);
    assert_eq!(
        mock.calls(),
        [
            Call::MapDma {
                iova: 0x5000_0000,
                size: 0x2000,
                vaddr: A + 0xe000,
                perm: ro
            },
            Call::MapDma {
                iova: 0x5000_2000,
                size: 0x2000,
                vaddr: B,
                perm: ro
            },
            Call::MapDma {
                iova: 0x6000_0000,
                size: 0x1000,
                vaddr: A + 0x1000,
                perm: wo
            },
            Call::UnmapDma {
                iova: 0x5000_0000,
                size: 0x4000
            },
        ]
    );
    assert_eq!((dma.maps(), dma.unmaps(), dma.failures()), (3, 1, 0));
}

#[test]
fn listener_counts_refusals_without_panicking() {
    let (mock, dev) = open(Script {
        refuse_iova: Some(0x9000),
        ..Script::default()
    });
    let dma = dev.unwrap().dma(ram());
    mock.clear();
    // Refused by the host.
    dma.map(0x9000, 0x1000, 0x1000, Perm::READ_WRITE);
    assert_eq!((dma.maps(), dma.failures()), (0, 1));
    // Partly outside guest RAM: the RAM part is mapped, the rest counted.
    dma.map(0xa000, 0x1f000, 0x2000, Perm::READ_WRITE);
    assert_eq!((dma.maps(), dma.failures()), (1, 2));
    assert_eq!(
        mock.calls().last(),
        Some(&Call::MapDma {
            iova: 0xa000,
            size: 0x1000,
            vaddr: B + 0xf000,
            perm: Perm::READ_WRITE
        })
    );
    // Wholly outside: no call at all.
    dma.map(0xc000, 0x100_0000, 0x1000, Perm::READ_WRITE);
    assert_eq!(mock.calls().len(), 2);
    assert_eq!(dma.failures(), 3);
}

#[test]
fn listener_counts_failed_unmaps() {
    let (_, dev) = open(errno("UnmapDma", libc::EINVAL));
    let dma = dev.unwrap().dma(ram());
    dma.unmap(0x1000, 0x1000);
    assert_eq!((dma.unmaps(), dma.failures()), (0, 1));
}
