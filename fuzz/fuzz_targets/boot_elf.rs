//! The ELF kernel loaders: PVH (the Xen PHYS32_ENTRY note), multiboot ELF and vmlinux. The image
//! always starts with the ELF magic; the last input byte is the options (see
//! `lucid_fuzz::boot::load`).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    if let Some((opts, mut image)) = lucid_fuzz::boot::split(data) {
        let n = image.len().min(4);
        image[..n].copy_from_slice(&b"\x7fELF"[..n]);
        lucid_fuzz::boot::load(image, opts);
    }
});
