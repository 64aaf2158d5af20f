//! lucid-vmm
