//! virtio-vsock packets as a guest puts them on the tx queue: headers (CIDs, ports, ops, types,
//! lengths, credit fields) and payloads fed to the hybrid-vsock protocol, every guest connection
//! backed by a socket pair (see `lucid_virtio::vsock::fuzz_packets`). Never panics.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    lucid_virtio::vsock::fuzz_packets(data);
});
