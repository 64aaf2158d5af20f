//! The library side of the `lucid` command: what the fuzz targets (`fuzz/`) drive without a
//! process, the REST API's request framing and its `vm.create` mapping.

pub mod rest;
