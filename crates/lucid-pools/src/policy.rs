//! (to be written: see lib.rs)
