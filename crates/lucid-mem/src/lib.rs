//! lucid-mem
