//! Integer SSE instructions on 128-bit values (little-endian lanes), enough for the kernel's
//! SIMD code that runs during boot (e.g. BLAKE2s-SSSE3 in the random pool).

use iced_x86::Mnemonic;

pub fn handles(m: Mnemonic) -> bool {
    use Mnemonic::*;
    matches!(
        m,
        Movd | Movq
            | Movdqa
            | Movdqu
            | Movaps
            | Movups
            | Pxor
            | Por
            | Pand
            | Pandn
            | Xorps
            | Paddd
            | Paddq
            | Psubd
            | Psubq
            | Punpckldq
            | Punpcklqdq
            | Punpckhdq
            | Punpckhqdq
            | Pshufd
            | Pshufb
            | Psrld
            | Pslld
            | Psrlq
            | Psllq
            | Psrldq
            | Pslldq
            | Pcmpeqd
            | Palignr
    )
}

fn lanes32(v: u128) -> [u32; 4] {
    std::array::from_fn(|i| (v >> (32 * i)) as u32)
}
fn from32(l: [u32; 4]) -> u128 {
    l.iter()
        .enumerate()
        .fold(0, |acc, (i, &x)| acc | (x as u128) << (32 * i))
}
fn lanes64(v: u128) -> [u64; 2] {
    [v as u64, (v >> 64) as u64]
}
fn from64(l: [u64; 2]) -> u128 {
    l[0] as u128 | (l[1] as u128) << 64
}

/// `dst op src` for register destinations; `imm` for the forms with an immediate. The shift
/// forms take their count from `src` when there is no immediate.
pub fn compute(m: Mnemonic, dst: u128, src: u128, imm: Option<u8>) -> Option<u128> {
    use Mnemonic::*;
    let count = imm.map(u64::from).unwrap_or(src as u64);
    let (d32, s32) = (lanes32(dst), lanes32(src));
    let (d64, s64) = (lanes64(dst), lanes64(src));
    Some(match m {
        // movd/movq into an XMM register zero the rest of it.
        Movd => src as u32 as u128,
        Movq => src as u64 as u128,
        Movdqa | Movdqu | Movaps | Movups => src,
        Pxor | Xorps => dst ^ src,
        Por => dst | src,
        Pand => dst & src,
        Pandn => !dst & src,
        Paddd => from32(std::array::from_fn(|i| d32[i].wrapping_add(s32[i]))),
        Psubd => from32(std::array::from_fn(|i| d32[i].wrapping_sub(s32[i]))),
        Paddq => from64([d64[0].wrapping_add(s64[0]), d64[1].wrapping_add(s64[1])]),
        Psubq => from64([d64[0].wrapping_sub(s64[0]), d64[1].wrapping_sub(s64[1])]),
        Pcmpeqd => from32(std::array::from_fn(|i| {
            if d32[i] == s32[i] {
                u32::MAX
            } else {
                0
            }
        })),
        Punpckldq => from32([d32[0], s32[0], d32[1], s32[1]]),
        Punpckhdq => from32([d32[2], s32[2], d32[3], s32[3]]),
        Punpcklqdq => from64([d64[0], s64[0]]),
        Punpckhqdq => from64([d64[1], s64[1]]),
        Pshufd => {
            let i = imm?;
            from32(std::array::from_fn(|k| s32[((i >> (2 * k)) & 3) as usize]))
        }
        Pshufb => {
            let (d, s) = (dst.to_le_bytes(), src.to_le_bytes());
            let r: [u8; 16] = std::array::from_fn(|k| {
                if s[k] & 0x80 != 0 {
                    0
                } else {
                    d[(s[k] & 15) as usize]
                }
            });
            u128::from_le_bytes(r)
        }
        Psrld | Pslld => {
            if count > 31 {
                0
            } else if m == Psrld {
                from32(d32.map(|x| x >> count))
            } else {
                from32(d32.map(|x| x << count))
            }
        }
        Psrlq | Psllq => {
            if count > 63 {
                0
            } else if m == Psrlq {
                from64(d64.map(|x| x >> count))
            } else {
                from64(d64.map(|x| x << count))
            }
        }
        Psrldq | Pslldq => {
            let bytes = imm? as u32;
            if bytes > 15 {
                0
            } else if m == Psrldq {
                dst >> (8 * bytes)
            } else {
                dst << (8 * bytes)
            }
        }
        Palignr => {
            // (dst:src) >> (8 * imm), low 128 bits.
            let sh = imm? as u32 * 8;
            let wide = [src, dst];
            if sh >= 256 {
                0
            } else if sh >= 128 {
                wide[1] >> (sh - 128)
            } else if sh == 0 {
                src
            } else {
                (src >> sh) | (dst << (128 - sh))
            }
        }
        _ => return None,
    })
}
