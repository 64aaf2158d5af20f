//! lucid-hv
