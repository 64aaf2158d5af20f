//! Host probe (being written).
