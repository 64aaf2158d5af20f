//! Virtqueue descriptor chains: a blk or net back-end serves the chains of guest memory the
//! input fills (see `lucid_virtio::fuzz_api` for the encoding and what is checked).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    lucid_virtio::fuzz_api::virtqueue(data);
});
