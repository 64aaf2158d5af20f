//! Lucid's narrow seam to KVM: opening the device, VMs, vCPUs, capabilities, the host probe and
//! KVM's binary statistics. Nothing above this crate calls a KVM ioctl directly.

pub mod probe;
