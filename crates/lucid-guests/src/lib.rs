//! lucid-guests
