//! The host twin of the `pagecache` guest's block content (guests/x86/pagecache.c): the tests
//! and `lucid bench swap` make disk images with it and check images after a run.
//!
//! Block `b` of version `v` with seed `s` (4 KiB) holds little-endian u64 words `w[0] = b`,
//! `w[1] = s`, `w[2] = v`, then an xorshift stream seeded from `(b, s, v)` choosing one of 16
//! seed-derived tokens. Version [`VER_ZERO`] is all zeros (a discarded block).

use std::io::Write;
use std::path::Path;

/// Logical block size of the workloads.
pub const BLOCK: usize = 4096;
/// The version that stands for a zeroed (discarded) block.
pub const VER_ZERO: u64 = 0xffff;
/// The guest's default seed (`seed=`).
pub const DEFAULT_SEED: u64 = 0x5eed;

/// The kit's `mix64` (guests/lib/x86/libcflat.h): the block guests' data-pattern hash.
pub fn mix64(mut x: u64) -> u64 {
    x ^= x >> 31;
    x = x.wrapping_mul(0x7fb5_d329_728e_a185);
    x ^= x >> 27;
    x = x.wrapping_mul(0x81da_def4_bc2d_d44d);
    x ^= x >> 33;
    x
}

fn xs(mut x: u64) -> u64 {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    x
}

/// Fills `out` (one block) with block `b` version `v` of seed `s`.
pub fn fill(out: &mut [u8; BLOCK], b: u64, s: u64, v: u64) {
    if v == VER_ZERO {
        out.fill(0);
        return;
    }
    let toks: Vec<u64> = (1..=16u64)
        .map(|j| mix64(s.wrapping_add(j.wrapping_mul(0x9e37_79b9_7f4a_7c15))))
        .collect();
    let mut x = mix64(b ^ (s << 1) ^ (v << 48)) | 1;
    for (i, w) in out.chunks_exact_mut(8).enumerate() {
        let word = match i {
            0 => b,
            1 => s,
            2 => v,
            _ => {
                x = xs(x);
                toks[(x & 15) as usize]
            }
        };
        w.copy_from_slice(&word.to_le_bytes());
    }
}

/// Block `b` version `v` of seed `s`.
pub fn block(b: u64, s: u64, v: u64) -> [u8; BLOCK] {
    let mut out = [0u8; BLOCK];
    fill(&mut out, b, s, v);
    out
}

/// Writes an image of `blocks` blocks, each at version 0 of seed `s`, to `path`
/// (`extra_blocks` zero blocks after them, sparse).
pub fn make_image(path: &Path, blocks: u64, extra_blocks: u64, s: u64) -> std::io::Result<()> {
    let f = std::fs::File::create(path)?;
    let mut w = std::io::BufWriter::with_capacity(1 << 20, &f);
    let mut buf = [0u8; BLOCK];
    for b in 0..blocks {
        fill(&mut buf, b, s, 0);
        w.write_all(&buf)?;
    }
    w.flush()?;
    drop(w);
    f.set_len((blocks + extra_blocks) * BLOCK as u64)?;
    f.sync_all()
}

/// The `durable` mode's state of block `b` after round `r`: version `r`, or zeros for even
/// blocks when `r % 3 == 0`.
pub fn durable_state(b: u64, r: u64) -> u64 {
    if r.is_multiple_of(3) && b.is_multiple_of(2) {
        VER_ZERO
    } else {
        r % VER_ZERO
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_words_and_zero_blocks() {
        let b = block(7, 0x5eed, 3);
        assert_eq!(u64::from_le_bytes(b[0..8].try_into().unwrap()), 7);
        assert_eq!(u64::from_le_bytes(b[8..16].try_into().unwrap()), 0x5eed);
        assert_eq!(u64::from_le_bytes(b[16..24].try_into().unwrap()), 3);
        assert_ne!(block(7, 0x5eed, 3)[24..], block(8, 0x5eed, 3)[24..]);
        assert_ne!(block(7, 0x5eed, 3)[24..], block(7, 0x5eed, 4)[24..]);
        assert!(block(7, 0x5eed, VER_ZERO).iter().all(|&x| x == 0));
        assert_eq!(durable_state(4, 3), VER_ZERO);
        assert_eq!(durable_state(5, 3), 3);
    }
}
