//! lucid-devices
