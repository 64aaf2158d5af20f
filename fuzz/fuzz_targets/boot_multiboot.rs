//! The multiboot v1 loader: every 4-aligned multiboot magic in the first 8 KiB of the image gets
//! a valid checksum, so that the flags and the a.out addresses are what varies. The last input
//! byte is the options (see `lucid_fuzz::boot::load`).
#![no_main]

const MAGIC: u32 = 0x1bad_b002;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    if let Some((opts, mut image)) = lucid_fuzz::boot::split(data) {
        let end = image.len().min(8192);
        for off in (0..end.saturating_sub(11)).step_by(4) {
            let word = |i: usize| u32::from_le_bytes(image[i..i + 4].try_into().expect("4 bytes"));
            if word(off) == MAGIC {
                let sum = 0u32.wrapping_sub(MAGIC).wrapping_sub(word(off + 4));
                image[off + 8..off + 12].copy_from_slice(&sum.to_le_bytes());
            }
        }
        lucid_fuzz::boot::load(image, opts);
    }
});
