//! Where Lucid's own boot structures go in guest memory. The kernel and initrd claim the memory
//! they ask for first; each structure then goes to its usual address ([`crate::layout`]) if that
//! is free, else to the lowest free range that fits, as QEMU moves the multiboot information
//! after a kernel that sits where it would have gone. Only a structure with a fixed home can
//! collide for real (the ACPI RSDP, which a legacy scan looks for in 0xe0000..0x100000); that is
//! an error that names what holds the memory.

use std::fmt;
use std::ops::Range;

use crate::layout::{EBDA_START, HIGH_MEMORY};
use crate::memmap::low_ram_end;
use crate::BootError;

/// A range of guest memory that something holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Claim {
    pub what: &'static str,
    pub start: u64,
    pub end: u64,
}

impl fmt::Display for Claim {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {:#x}..{:#x}", self.what, self.start, self.end)
    }
}

/// The claims that left no room for a structure, for [`BootError::NoRoom`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Claims(pub Vec<Claim>);

impl fmt::Display for Claims {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.is_empty() {
            return f.write_str("nothing else is there, the window is too small");
        }
        for (i, c) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{c}")?;
        }
        Ok(())
    }
}

/// Lowest address a moved structure may take: the real-mode interrupt vector table and BIOS
/// data area (0..0x500) and the rest of the first page stay untouched.
const FIRST_FREE: u64 = 0x1000;

/// The claims on guest memory while a kernel is loaded and its boot structures placed.
#[derive(Clone, Debug)]
pub(crate) struct BootArea {
    claims: Vec<Claim>,
    low_end: u64,
}

fn overlaps(a: &Range<u64>, c: &Claim) -> bool {
    a.start < c.end && c.start < a.end
}

impl BootArea {
    pub fn new(mem_size: u64) -> Self {
        BootArea {
            claims: Vec::new(),
            low_end: low_ram_end(mem_size),
        }
    }

    /// Records memory the kernel or initrd asked for (already checked to be RAM).
    pub fn claim(&mut self, what: &'static str, start: u64, end: u64) {
        if end > start {
            self.claims.push(Claim { what, start, end });
        }
    }

    /// What holds memory, in address order.
    pub fn claims(&self) -> Vec<Claim> {
        let mut v = self.claims.clone();
        v.sort_by_key(|c| c.start);
        v
    }

    fn is_free(&self, r: &Range<u64>) -> bool {
        !self.claims.iter().any(|c| overlaps(r, c))
    }

    /// The lowest `align`-aligned start of `size` free bytes in `window`.
    fn first_fit(&self, size: u64, align: u64, window: &Range<u64>) -> Option<u64> {
        let mut at = window.start.next_multiple_of(align);
        loop {
            let end = at.checked_add(size)?;
            if end > window.end {
                return None;
            }
            match self
                .claims
                .iter()
                .filter(|c| overlaps(&(at..end), c))
                .map(|c| c.end)
                .max()
            {
                None => return Some(at),
                Some(next) => at = next.next_multiple_of(align),
            }
        }
    }

    /// Places `size` bytes of `what` in `window`: at `pref` if that is free, else at the lowest
    /// free `align`-aligned range. Claims the range and returns its start.
    pub fn place_in(
        &mut self,
        what: &'static str,
        pref: u64,
        size: u64,
        align: u64,
        window: Range<u64>,
    ) -> Result<u64, BootError> {
        let w = std::slice::from_ref(&window);
        self.place_among(what, pref, size, align, w, w)
    }

    /// Places a structure that may live anywhere in low RAM outside the BIOS area: at `pref` if
    /// free, else the lowest free range below the EBDA, else from 1 MiB up.
    pub fn place(
        &mut self,
        what: &'static str,
        pref: u64,
        size: u64,
        align: u64,
    ) -> Result<u64, BootError> {
        let usual = [0..EBDA_START, HIGH_MEMORY..self.low_end];
        let moved = [FIRST_FREE..EBDA_START, HIGH_MEMORY..self.low_end];
        self.place_among(what, pref, size, align, &usual, &moved)
    }

    /// Places at `pref` if it lies in one of `usual` and is free, else first fit in `windows`.
    fn place_among(
        &mut self,
        what: &'static str,
        pref: u64,
        size: u64,
        align: u64,
        usual: &[Range<u64>],
        windows: &[Range<u64>],
    ) -> Result<u64, BootError> {
        let pref_range = pref..pref.saturating_add(size);
        let pref_ok = usual
            .iter()
            .any(|w| pref_range.start >= w.start && pref_range.end <= w.end)
            && self.is_free(&pref_range);
        let at = if pref_ok {
            Some(pref)
        } else {
            windows.iter().find_map(|w| self.first_fit(size, align, w))
        };
        let Some(at) = at else {
            let (start, end) = (windows[0].start, windows[windows.len() - 1].end);
            let taken = self
                .claims()
                .into_iter()
                .filter(|c| windows.iter().any(|w| overlaps(w, c)))
                .collect();
            return Err(BootError::NoRoom {
                what,
                size,
                start,
                end,
                taken: Claims(taken),
            });
        };
        if at != pref {
            let holder = self.claims.iter().find(|c| overlaps(&pref_range, c));
            log::info!(
                "{what} moved from {pref:#x} to {at:#x}{}",
                holder.map_or(String::new(), |c| format!(": {c} is there"))
            );
        }
        self.claim(what, at, at + size);
        Ok(at)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn preferred_free_and_moved() {
        let mut a = BootArea::new(64 << 20);
        assert_eq!(a.place("x", 0x7000, 0x100, 8).unwrap(), 0x7000);
        a.claim("kernel", 0x1000, 0x8000);
        // 0x7000 is now taken twice over; the first fit is after the kernel.
        assert_eq!(a.place("y", 0x7000, 0x100, 0x1000).unwrap(), 0x8000);
        assert_eq!(a.place("z", 0x7000, 0x10, 16).unwrap(), 0x8100);
        // Too big for below the EBDA: from 1 MiB.
        assert_eq!(
            a.place("big", 0x7000, 0x10_0000, 0x1000).unwrap(),
            0x10_0000
        );
    }

    #[test]
    fn fixed_window_full_names_the_holder() {
        let mut a = BootArea::new(64 << 20);
        a.claim("kernel", 0xe0000, 0x10_0000);
        let e = a
            .place_in("ACPI RSDP", 0xe0000, 36, 16, 0xe0000..0x10_0000)
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            "no room for ACPI RSDP (36 bytes) in 0xe0000..0x100000: kernel 0xe0000..0x100000"
        );
        // A gap at the end of the window is found.
        let mut a = BootArea::new(64 << 20);
        a.claim("kernel", 0xe0000, 0xfffc0);
        assert_eq!(
            a.place_in("ACPI RSDP", 0xe0000, 36, 16, 0xe0000..0x10_0000)
                .unwrap(),
            0xfffc0
        );
    }

    #[test]
    fn no_room_anywhere() {
        let mut a = BootArea::new(2 << 20);
        a.claim("kernel", 0, 2 << 20);
        let e = a
            .place("Linux zero page", 0x7000, 0x1000, 0x1000)
            .unwrap_err();
        assert!(
            matches!(
                e,
                BootError::NoRoom {
                    what: "Linux zero page",
                    size: 0x1000,
                    ..
                }
            ),
            "{e}"
        );
        assert!(e.to_string().contains("kernel 0x0..0x200000"), "{e}");
    }
}
