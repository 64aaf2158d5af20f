//! The bzImage loader (Linux boot protocol setup header): the image always has "HdrS" at 0x202.
//! The last input byte is the options (see `lucid_fuzz::boot::load`).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    if let Some((opts, mut image)) = lucid_fuzz::boot::split(data) {
        if image.len() >= 0x206 && !image.starts_with(b"\x7fELF") {
            image[0x202..0x206].copy_from_slice(b"HdrS");
            lucid_fuzz::boot::load(image, opts);
        }
    }
});
