//! Lucid's own checks of a symbiotic module before it goes near the guest (docs/symbiotic.md §7):
//! an ELF64 x86-64 relocatable object (`gcc -c -mcmodel=small -fno-pic`) whose headers,
//! sections, symbols and relocations are in bounds, whose relocation types are the five the
//! guest loader applies, and which defines `module_init` and `module_exit`. The guest's loader
//! checks again (it must not trust Lucid either) and is the one that resolves symbols.

/// Relocation types the guest loader applies (`-mcmodel=small -fno-pic`).
pub const R_X86_64_64: u32 = 1;
pub const R_X86_64_PC32: u32 = 2;
pub const R_X86_64_PLT32: u32 = 4;
pub const R_X86_64_32: u32 = 10;
pub const R_X86_64_32S: u32 = 11;
pub const SUPPORTED_RELOCATIONS: [u32; 5] = [
    R_X86_64_64,
    R_X86_64_PC32,
    R_X86_64_PLT32,
    R_X86_64_32,
    R_X86_64_32S,
];

const EHDR: usize = 64;
const SHDR: usize = 64;
const SYM: usize = 24;
const RELA: usize = 24;
const SHT_NULL: u32 = 0;
const SHT_SYMTAB: u32 = 2;
const SHT_STRTAB: u32 = 3;
const SHT_RELA: u32 = 4;
const SHT_NOBITS: u32 = 8;
const SHT_REL: u32 = 9;
const SHF_ALLOC: u64 = 2;
const SHN_UNDEF: u16 = 0;
const SHN_LORESERVE: u16 = 0xff00;
const SHN_ABS: u16 = 0xfff1;
const SHN_COMMON: u16 = 0xfff2;

/// What a module may be at most.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Bytes of the object file (the guest's object buffer).
    pub max_object: u64,
    /// Bytes its allocated sections take once laid out (the guest's arena).
    pub max_image: u64,
}

/// Why Lucid refuses a module.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ModuleCheckError {
    #[error("not an ELF file (no \\x7fELF magic)")]
    NotElf,
    #[error("not a 64-bit little-endian ELF for x86-64 (class {class}, data {data}, machine {machine}): build it with the kit's gcc for x86-64")]
    WrongArch { class: u8, data: u8, machine: u16 },
    #[error("ELF type {0} is not ET_REL (1): a module is an object file from `gcc -c`, not a linked executable or shared object")]
    NotRelocatable(u16),
    #[error("truncated object: {what} ends at byte {end}, the file has {len}")]
    OutOfBounds { what: String, end: u64, len: u64 },
    #[error("malformed object: {0}")]
    Malformed(String),
    #[error("too big: the object has {size} bytes, at most {max} fit the guest's object buffer")]
    ObjectTooBig { size: u64, max: u64 },
    #[error("too big: its sections take {size} bytes, the guest's arena holds {max}")]
    ImageTooBig { size: u64, max: u64 },
    #[error("unsupported relocation type {rtype} in {section} (the loader applies R_X86_64_64, PC32, PLT32, 32 and 32S: build with -mcmodel=small -fno-pic)")]
    UnsupportedRelocation { rtype: u32, section: String },
    #[error("missing {0}: a module defines module_init and module_exit")]
    MissingEntry(&'static str),
}

/// What the checks learned about an accepted object.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ObjectInfo {
    pub sections: usize,
    pub relocations: usize,
    /// Bytes the allocated sections take laid out with their alignments.
    pub image_size: u64,
    /// Symbols the module needs from the guest's exports.
    pub undefined: Vec<String>,
    /// The source file it was compiled from (its STT_FILE symbol), without the extension.
    pub source: Option<String>,
}

fn u16_at(b: &[u8], off: usize) -> u16 {
    u16::from_le_bytes([b[off], b[off + 1]])
}
fn u32_at(b: &[u8], off: usize) -> u32 {
    u32::from_le_bytes(b[off..off + 4].try_into().unwrap_or([0; 4]))
}
fn u64_at(b: &[u8], off: usize) -> u64 {
    u64::from_le_bytes(b[off..off + 8].try_into().unwrap_or([0; 8]))
}

struct Shdr {
    name: u32,
    kind: u32,
    flags: u64,
    offset: u64,
    size: u64,
    link: u32,
    info: u32,
    align: u64,
    entsize: u64,
}

fn span(what: impl Fn() -> String, off: u64, size: u64, len: u64) -> Result<(), ModuleCheckError> {
    match off.checked_add(size) {
        Some(end) if end <= len => Ok(()),
        end => Err(ModuleCheckError::OutOfBounds {
            what: what(),
            end: end.unwrap_or(u64::MAX),
            len,
        }),
    }
}

fn cstr(b: &[u8], tab: &Shdr, off: u32) -> Result<String, ModuleCheckError> {
    let start = tab
        .offset
        .checked_add(u64::from(off))
        .filter(|&s| s < tab.offset + tab.size);
    let Some(start) = start else {
        return Err(ModuleCheckError::Malformed(format!(
            "string offset {off} outside its string table"
        )));
    };
    let end_tab = (tab.offset + tab.size) as usize;
    let s = &b[start as usize..end_tab];
    let n = s.iter().position(|&c| c == 0).ok_or_else(|| {
        ModuleCheckError::Malformed("unterminated string in a string table".into())
    })?;
    Ok(String::from_utf8_lossy(&s[..n]).into_owned())
}

/// Checks `b` as a module object; the error says what is wrong and how to fix it.
pub fn check(b: &[u8], limits: &Limits) -> Result<ObjectInfo, ModuleCheckError> {
    let len = b.len() as u64;
    if b.len() < 4 || &b[..4] != b"\x7fELF" {
        return Err(ModuleCheckError::NotElf);
    }
    if len > limits.max_object {
        return Err(ModuleCheckError::ObjectTooBig {
            size: len,
            max: limits.max_object,
        });
    }
    span(|| "the ELF header".into(), 0, EHDR as u64, len)?;
    let (class, data, machine) = (b[4], b[5], u16_at(b, 18));
    if class != 2 || data != 1 || machine != 62 {
        return Err(ModuleCheckError::WrongArch {
            class,
            data,
            machine,
        });
    }
    let etype = u16_at(b, 16);
    if etype != 1 {
        return Err(ModuleCheckError::NotRelocatable(etype));
    }
    let shoff = u64_at(b, 40);
    let shentsize = u16_at(b, 58);
    let shnum = u16_at(b, 60);
    let shstrndx = u16_at(b, 62);
    if usize::from(shentsize) != SHDR {
        return Err(ModuleCheckError::Malformed(format!(
            "section header size {shentsize}, expected {SHDR}"
        )));
    }
    if shnum == 0 || shstrndx >= shnum {
        return Err(ModuleCheckError::Malformed(format!(
            "{shnum} sections, section-name table index {shstrndx}"
        )));
    }
    span(
        || "the section table".into(),
        shoff,
        u64::from(shnum) * SHDR as u64,
        len,
    )?;
    let mut sh = Vec::with_capacity(usize::from(shnum));
    for i in 0..usize::from(shnum) {
        let o = shoff as usize + i * SHDR;
        sh.push(Shdr {
            name: u32_at(b, o),
            kind: u32_at(b, o + 4),
            flags: u64_at(b, o + 8),
            offset: u64_at(b, o + 24),
            size: u64_at(b, o + 32),
            link: u32_at(b, o + 40),
            info: u32_at(b, o + 44),
            align: u64_at(b, o + 48),
            entsize: u64_at(b, o + 56),
        });
    }
    for (i, s) in sh.iter().enumerate() {
        // Section 0 too, unless it is the null section: one posing as a table is read.
        if s.kind != SHT_NOBITS && !(i == 0 && s.kind == SHT_NULL) {
            span(|| format!("section {i}"), s.offset, s.size, len)?;
        }
        if s.align > 1 && !s.align.is_power_of_two() {
            return Err(ModuleCheckError::Malformed(format!(
                "section {i} alignment {} is not a power of two",
                s.align
            )));
        }
        if s.align > 4096 {
            return Err(ModuleCheckError::Malformed(format!(
                "section {i} alignment {} is over 4096",
                s.align
            )));
        }
    }
    let shstr = &sh[usize::from(shstrndx)];
    if shstr.kind != SHT_STRTAB {
        return Err(ModuleCheckError::Malformed(
            "the section-name table is not a string table".into(),
        ));
    }
    let name_of = |i: usize| cstr(b, shstr, sh[i].name).unwrap_or_else(|_| format!("#{i}"));

    // Layout of the allocated sections, as the loader does it.
    let mut image: u64 = 0;
    for s in sh.iter().filter(|s| s.flags & SHF_ALLOC != 0) {
        let a = s.align.max(1);
        image = image
            .checked_next_multiple_of(a)
            .and_then(|x| x.checked_add(s.size))
            .ok_or_else(|| ModuleCheckError::Malformed("section sizes overflow".into()))?;
    }
    if image > limits.max_image {
        return Err(ModuleCheckError::ImageTooBig {
            size: image,
            max: limits.max_image,
        });
    }

    // The symbol table: entries in bounds, names in its string table, sections that exist.
    let syms: Vec<usize> = (0..sh.len())
        .filter(|&i| sh[i].kind == SHT_SYMTAB)
        .collect();
    let [symi] = syms[..] else {
        return Err(ModuleCheckError::Malformed(format!(
            "{} symbol tables, expected one",
            syms.len()
        )));
    };
    let symtab = &sh[symi];
    if symtab.entsize != SYM as u64 || !symtab.size.is_multiple_of(SYM as u64) {
        return Err(ModuleCheckError::Malformed(
            "symbol table entry size".into(),
        ));
    }
    let strtab = sh
        .get(symtab.link as usize)
        .filter(|s| s.kind == SHT_STRTAB);
    let Some(strtab) = strtab else {
        return Err(ModuleCheckError::Malformed(
            "the symbol table's string table is missing".into(),
        ));
    };
    let nsyms = (symtab.size / SYM as u64) as usize;
    let (mut init, mut exit) = (false, false);
    let mut undefined = Vec::new();
    let mut source = None;
    for k in 1..nsyms {
        let o = symtab.offset as usize + k * SYM;
        let name = cstr(b, strtab, u32_at(b, o))?;
        let shndx = u16_at(b, o + 6);
        let bind = b[o + 4] >> 4;
        if shndx == SHN_COMMON {
            return Err(ModuleCheckError::Malformed(format!(
                "common symbol {name}: build with -fno-common"
            )));
        }
        if shndx != SHN_UNDEF && shndx < SHN_LORESERVE && usize::from(shndx) >= sh.len() {
            return Err(ModuleCheckError::Malformed(format!(
                "symbol {name} in section {shndx}, which does not exist"
            )));
        }
        if b[o + 4] & 0xf == 4 && source.is_none() {
            let stem = name.rsplit('/').next().unwrap_or(&name);
            source = Some(stem.split('.').next().unwrap_or(stem).to_string());
        }
        if shndx == SHN_UNDEF && !name.is_empty() {
            undefined.push(name);
        } else if bind == 1 && shndx != SHN_ABS {
            init |= name == "module_init";
            exit |= name == "module_exit";
        }
    }
    if !init {
        return Err(ModuleCheckError::MissingEntry("module_init"));
    }
    if !exit {
        return Err(ModuleCheckError::MissingEntry("module_exit"));
    }

    // Relocations: RELA only, entries in bounds, known types, symbols that exist, targets
    // inside the section they patch.
    let mut relocations = 0;
    for (i, s) in sh.iter().enumerate() {
        if s.kind == SHT_REL {
            return Err(ModuleCheckError::Malformed(format!(
                "REL section {} (x86-64 objects use RELA)",
                name_of(i)
            )));
        }
        if s.kind != SHT_RELA {
            continue;
        }
        if s.entsize != RELA as u64 || !s.size.is_multiple_of(RELA as u64) {
            return Err(ModuleCheckError::Malformed(format!(
                "relocation entry size in {}",
                name_of(i)
            )));
        }
        if s.link as usize != symi {
            return Err(ModuleCheckError::Malformed(format!(
                "{} does not use the symbol table",
                name_of(i)
            )));
        }
        let Some(target) = sh.get(s.info as usize) else {
            return Err(ModuleCheckError::Malformed(format!(
                "{} patches section {}, which does not exist",
                name_of(i),
                s.info
            )));
        };
        let patches_alloc = target.flags & SHF_ALLOC != 0;
        for k in 0..(s.size / RELA as u64) as usize {
            let o = s.offset as usize + k * RELA;
            let r_offset = u64_at(b, o);
            let info = u64_at(b, o + 8);
            let (rtype, rsym) = (info as u32, (info >> 32) as usize);
            if !patches_alloc {
                continue; // debug sections: the loader skips them
            }
            if !SUPPORTED_RELOCATIONS.contains(&rtype) {
                return Err(ModuleCheckError::UnsupportedRelocation {
                    rtype,
                    section: name_of(i),
                });
            }
            if rsym >= nsyms {
                return Err(ModuleCheckError::Malformed(format!(
                    "relocation {k} in {} names symbol {rsym}, the table has {nsyms}",
                    name_of(i)
                )));
            }
            let width = if rtype == R_X86_64_64 { 8 } else { 4 };
            if r_offset.checked_add(width).is_none_or(|e| e > target.size) {
                return Err(ModuleCheckError::Malformed(format!(
                    "relocation {k} in {} patches byte {r_offset}, outside its section ({} bytes)",
                    name_of(i),
                    target.size
                )));
            }
            relocations += 1;
        }
    }
    Ok(ObjectInfo {
        sections: sh.len(),
        relocations,
        image_size: image,
        undefined,
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: Limits = Limits {
        max_object: 1 << 20,
        max_image: 1 << 20,
    };

    /// A minimal valid object: null, .text (4 bytes, one PC32 relocation against `printf`),
    /// .rela.text, .symtab (null, module_init, module_exit, printf), .strtab, .shstrtab.
    fn object(rtype: u32) -> Vec<u8> {
        let shstr = b"\0.text\0.rela.text\0.symtab\0.strtab\0.shstrtab\0";
        let str_ = b"\0module_init\0module_exit\0printf\0";
        let text = [0x90u8; 16];
        let mut syms = vec![0u8; SYM];
        for (name, shndx, value) in [(1u32, 1u16, 0u64), (13, 1, 8), (25, 0, 0)] {
            let mut s = [0u8; SYM];
            s[0..4].copy_from_slice(&name.to_le_bytes());
            s[4] = (1 << 4) | if shndx == 0 { 0 } else { 2 };
            s[6..8].copy_from_slice(&shndx.to_le_bytes());
            s[8..16].copy_from_slice(&value.to_le_bytes());
            syms.extend_from_slice(&s);
        }
        let mut rela = vec![0u8; RELA];
        rela[0..8].copy_from_slice(&1u64.to_le_bytes());
        rela[8..16].copy_from_slice(&((3u64 << 32) | u64::from(rtype)).to_le_bytes());
        rela[16..24].copy_from_slice(&(-4i64).to_le_bytes());

        let mut b = vec![0u8; EHDR];
        let place = |b: &mut Vec<u8>, d: &[u8]| {
            let o = b.len() as u64;
            b.extend_from_slice(d);
            o
        };
        let o_text = place(&mut b, &text);
        let o_rela = place(&mut b, &rela);
        let o_sym = place(&mut b, &syms);
        let o_str = place(&mut b, str_);
        let o_shstr = place(&mut b, shstr);
        while !b.len().is_multiple_of(8) {
            b.push(0);
        }
        let shoff = b.len() as u64;
        // name, type, flags, offset, size, link, info, align, entsize
        type Sec = (u32, u32, u64, u64, u64, u32, u32, u64, u64);
        let secs: [Sec; 6] = [
            (0, 0, 0, 0, 0, 0, 0, 0, 0),
            (1, 1, 6, o_text, 16, 0, 0, 16, 0),
            (7, SHT_RELA, 0x40, o_rela, RELA as u64, 3, 1, 8, RELA as u64),
            (
                18,
                SHT_SYMTAB,
                0,
                o_sym,
                syms.len() as u64,
                4,
                1,
                8,
                SYM as u64,
            ),
            (26, SHT_STRTAB, 0, o_str, str_.len() as u64, 0, 0, 1, 0),
            (34, SHT_STRTAB, 0, o_shstr, shstr.len() as u64, 0, 0, 1, 0),
        ];
        for (name, kind, flags, off, size, link, info, align, ent) in secs {
            let mut s = [0u8; SHDR];
            s[0..4].copy_from_slice(&name.to_le_bytes());
            s[4..8].copy_from_slice(&kind.to_le_bytes());
            s[8..16].copy_from_slice(&flags.to_le_bytes());
            s[24..32].copy_from_slice(&off.to_le_bytes());
            s[32..40].copy_from_slice(&size.to_le_bytes());
            s[40..44].copy_from_slice(&link.to_le_bytes());
            s[44..48].copy_from_slice(&info.to_le_bytes());
            s[48..56].copy_from_slice(&align.to_le_bytes());
            s[56..64].copy_from_slice(&ent.to_le_bytes());
            b.extend_from_slice(&s);
        }
        b[0..4].copy_from_slice(b"\x7fELF");
        b[4] = 2;
        b[5] = 1;
        b[6] = 1;
        b[16..18].copy_from_slice(&1u16.to_le_bytes());
        b[18..20].copy_from_slice(&62u16.to_le_bytes());
        b[40..48].copy_from_slice(&shoff.to_le_bytes());
        b[52..54].copy_from_slice(&64u16.to_le_bytes());
        b[58..60].copy_from_slice(&64u16.to_le_bytes());
        b[60..62].copy_from_slice(&6u16.to_le_bytes());
        b[62..64].copy_from_slice(&5u16.to_le_bytes());
        b
    }

    #[test]
    fn a_section_0_posing_as_a_table_is_bounds_checked_too() {
        let good = object(R_X86_64_PC32);
        let shoff = u64_at(&good, 40) as usize;
        // Section 0 as the section-name table, or as the only symbol table (.symtab, section
        // 3, made PROGBITS), pointing past the end of the object.
        for kind in [SHT_SYMTAB, SHT_STRTAB] {
            let mut b = good.clone();
            b[shoff + 4..shoff + 8].copy_from_slice(&kind.to_le_bytes());
            b[shoff + 24..shoff + 32].copy_from_slice(&(u64::MAX - 8).to_le_bytes());
            b[shoff + 32..shoff + 40].copy_from_slice(&(2 * SYM as u64).to_le_bytes());
            b[shoff + 40..shoff + 44].copy_from_slice(&4u32.to_le_bytes());
            b[shoff + 56..shoff + 64].copy_from_slice(&(SYM as u64).to_le_bytes());
            if kind == SHT_STRTAB {
                b[62..64].copy_from_slice(&0u16.to_le_bytes());
            } else {
                let sym = shoff + 3 * SHDR;
                b[sym + 4..sym + 8].copy_from_slice(&1u32.to_le_bytes());
            }
            let r = check(&b, &LIMITS);
            assert!(
                matches!(r, Err(ModuleCheckError::OutOfBounds { .. })),
                "kind {kind}: {r:?}"
            );
        }
    }

    #[test]
    fn a_valid_object_passes() {
        let info = check(&object(R_X86_64_PLT32), &LIMITS).unwrap();
        assert_eq!(info.relocations, 1);
        assert_eq!(info.image_size, 16);
        assert_eq!(info.undefined, vec!["printf".to_string()]);
    }

    #[test]
    fn malformed_inputs_are_refused_with_what_is_wrong() {
        assert_eq!(check(b"", &LIMITS), Err(ModuleCheckError::NotElf));
        assert_eq!(check(b"MZ\x90\0", &LIMITS), Err(ModuleCheckError::NotElf));
        let good = object(R_X86_64_PC32);
        // Truncated anywhere: an error, never a panic.
        for n in 4..good.len() {
            assert!(check(&good[..n], &LIMITS).is_err(), "truncated at {n}");
        }
        let mut b = good.clone();
        b[18] = 3; // EM_386
        assert!(matches!(
            check(&b, &LIMITS),
            Err(ModuleCheckError::WrongArch { .. })
        ));
        let mut b = good.clone();
        b[16] = 2; // ET_EXEC
        assert_eq!(check(&b, &LIMITS), Err(ModuleCheckError::NotRelocatable(2)));
        let mut b = good.clone();
        b[40..48].copy_from_slice(&u64::MAX.to_le_bytes()); // section table far away
        assert!(matches!(
            check(&b, &LIMITS),
            Err(ModuleCheckError::OutOfBounds { .. })
        ));
        let mut b = good.clone();
        b[62] = 9; // shstrndx past the table
        assert!(matches!(
            check(&b, &LIMITS),
            Err(ModuleCheckError::Malformed(_))
        ));
        // Every byte of the headers flipped: never a panic.
        for i in 0..good.len() {
            let mut b = good.clone();
            b[i] ^= 0xff;
            let _ = check(&b, &LIMITS);
        }
    }

    #[test]
    fn unsupported_relocations_and_limits_are_refused() {
        let e = check(&object(9), &LIMITS).unwrap_err(); // R_X86_64_GOTPCREL
        assert_eq!(
            e,
            ModuleCheckError::UnsupportedRelocation {
                rtype: 9,
                section: ".rela.text".into()
            }
        );
        assert!(e.to_string().contains("unsupported relocation type 9"));
        let tiny = Limits {
            max_object: 64,
            max_image: 1 << 20,
        };
        assert!(matches!(
            check(&object(2), &tiny),
            Err(ModuleCheckError::ObjectTooBig { .. })
        ));
        let small = Limits {
            max_object: 1 << 20,
            max_image: 8,
        };
        assert!(check(&object(2), &small)
            .unwrap_err()
            .to_string()
            .starts_with("too big"));
    }

    #[test]
    fn entry_points_are_required() {
        let mut b = object(2);
        // Rename module_exit to module_exiT.
        let p = b.windows(11).position(|w| w == b"module_exit").unwrap();
        b[p + 10] = b'T';
        assert_eq!(
            check(&b, &LIMITS),
            Err(ModuleCheckError::MissingEntry("module_exit"))
        );
    }
}
