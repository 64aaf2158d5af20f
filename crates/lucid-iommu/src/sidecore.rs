//! Sidecore emulation: register page 0 is plain shared memory the guest reads and writes without
//! exits, and a polling thread ([`Vtd::run_sidecore`]) notices the writes that start work.
//!
//! # Protocol
//!
//! For every register that a guest write acts on (GCMD, CCMD, IQT, FSTS, FECTL, ICS, IECTL) the
//! unit keeps a *base*: the value last seen or published in the page. A page value different
//! from its base is a guest write, handled exactly as the trapped write would be. Then the unit
//! publishes the resulting register values: read-only ones (VER, CAP, ECAP, GSTS, IQH) by plain
//! release stores, re-asserted whenever the guest scribbled over them; the guest-written ones by
//! compare-and-swap from the base, so that a guest write that lands in between is never
//! overwritten: it fails the swap, stays in the page, and is handled at the next poll. Value
//! registers (RTADDR, IQA, IRTA, FEDATA/FEADDR/FEUADDR, IEDATA/IEADDR/IEUADDR) are never
//! published: the page is their truth and the unit reads them when a command commits them.
//!
//! # Ordering
//!
//! The poll loads GCMD (acquire) before the value registers a command commits: SRTP reads
//! RTADDR, QIE reads IQA and SIRTP reads IRTA only after the GCMD load that saw the command.
//! The guest stores in program order (x86 TSO), so a RTADDR written before GCMD.SRTP is seen.
//! Status is published after the work it reports: a wait descriptor's status write and IQH move
//! before GSTS/ICS are stored, GCMD is consumed before GSTS says the command is done.
//!
//! # Deviations from the spec (sidecore mode only)
//!
//! * A processed GCMD write is replaced by [`SC_GCMD_CONSUMED`] (a reserved bit), so that
//!   reading GCMD returns 1 instead of 0, and a command equal to the previous one is still seen.
//! * FSTS and ICS mix write-1-to-clear and read-only fields and the spec keeps them on page 0.
//!   While non-zero they read with bit 31 ([`SC_MARK`], reserved) set, so that a guest that
//!   writes 1s to the bits it clears (as Linux does) always writes a different value. A guest
//!   that writes back exactly the value it read (mark included) is not seen.
//! * Two guest writes to one register between two polls count as the last one (the paper's
//!   "synchronous writes" rule: a driver waits for the status before writing again).
//! * The guest sees its command's effect after up to one poll period (the backoff below).
//!
//! # Idle backoff and accounting
//!
//! The thread spins with `pause` for 4096 idle polls, then sleeps 1 µs doubling up to 64 µs;
//! any work resets it. `iommu.sidecore.polls` counts polls, `.busy_polls` those that found a
//! guest write, `.cpu_ns` the thread's CPU time (CLOCK_THREAD_CPUTIME_ID).

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::pin::lock;
use crate::regs::*;
use crate::{EmulationMode, Fx, State, Vtd};

/// The sidecore's register page: 4096 bytes, 8-byte aligned, that stay mapped while the value
/// (or a copy) is used. `attach_shared_page` makes the unit's from its caller's promise.
#[derive(Clone, Copy)]
pub(crate) struct SharedPage(*mut u8);

impl SharedPage {
    /// # Safety
    /// `p` points to 4096 bytes, 8-byte aligned, mapped for as long as the value is used.
    pub(crate) unsafe fn new(p: *mut u8) -> Self {
        SharedPage(p)
    }
}

/// The shared page's dword at `off`.
pub(crate) fn p32<'a>(p: SharedPage, off: u64) -> &'a AtomicU32 {
    let off = (off & 0xffc) as usize;
    // SAFETY: `SharedPage::new`'s caller promised 4096 mapped, 8-byte aligned bytes; `off` is
    // 4-byte aligned and below 4096; the guest's accesses to the same memory are plain stores
    // and loads, which the atomic tolerates.
    unsafe { AtomicU32::from_ptr(p.0.add(off).cast::<u32>()) }
}

/// The shared page's qword at `off` (8-byte aligned register).
pub(crate) fn p64<'a>(p: SharedPage, off: u64) -> &'a AtomicU64 {
    let off = (off & 0xff8) as usize;
    // SAFETY: as in `p32`; 8-byte aligned base and offset, below 4096.
    unsafe { AtomicU64::from_ptr(p.0.add(off).cast::<u64>()) }
}

fn cas32(a: &AtomicU32, base: &mut u32, want: u32) {
    if want != *base
        && a.compare_exchange(*base, want, Ordering::SeqCst, Ordering::Acquire)
            .is_ok()
    {
        *base = want;
    }
}

fn marked(v: u32) -> u32 {
    if v != 0 {
        v | SC_MARK
    } else {
        0
    }
}

fn thread_cpu_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec through a valid pointer.
    if unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) } != 0 {
        return 0;
    }
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

const SPIN_POLLS: u32 = 4096;
const MAX_SLEEP_US: u64 = 64;

impl Vtd {
    pub(crate) fn sc_page(&self) -> Option<SharedPage> {
        if self.cfg.mode != EmulationMode::Sidecore {
            return None;
        }
        let p = self.shared.load(Ordering::Acquire);
        // `shared` holds only the page `attach_shared_page` was given (or null).
        (!p.is_null()).then_some(SharedPage(p))
    }

    /// Sidecore: page 0 is shared memory the guest writes without exits. The page is
    /// initialized with the registers' current values. Ignored in samecore mode.
    ///
    /// # Safety
    /// `page` points to 4096 bytes (page-aligned) that stay mapped for the Vtd's lifetime: the
    /// unit reads and writes them until it is dropped.
    pub unsafe fn attach_shared_page(&self, page: *mut u8) {
        if self.cfg.mode != EmulationMode::Sidecore || page.is_null() {
            return;
        }
        // SAFETY: this function's own contract.
        let shared = unsafe { SharedPage::new(page) };
        let mut st = lock(&self.st);
        for off in (0..0x1000).step_by(4) {
            p32(shared, off).store(self.read32(&st, off), Ordering::Relaxed);
        }
        st.sc.gcmd = 0;
        st.sc.ccmd = st.ccmd;
        st.sc.iqt = st.iqt as u32;
        st.sc.fsts = self.fsts_value(&st);
        st.sc.fectl = st.fectl;
        st.sc.ics = st.ics;
        st.sc.iectl = st.iectl;
        self.shared.store(page, Ordering::SeqCst);
        self.sc_publish(&mut st, shared);
    }

    /// Takes in the guest's writes to the polled registers (state lock held).
    pub(crate) fn sc_sync(&self, st: &mut State, fx: &mut Fx, p: SharedPage) {
        // GCMD first: the value registers a command commits are read after this load.
        let gcmd = p32(p, GCMD).load(Ordering::Acquire);
        let ccmd = p64(p, CCMD).load(Ordering::Acquire);
        let iqt = p32(p, IQT).load(Ordering::Acquire);
        let fsts = p32(p, FSTS).load(Ordering::Acquire);
        let fectl = p32(p, FECTL).load(Ordering::Acquire);
        let ics = p32(p, ICS).load(Ordering::Acquire);
        let iectl = p32(p, IECTL).load(Ordering::Acquire);
        let b = &st.sc;
        if (gcmd, ccmd, iqt, fsts, fectl, ics, iectl)
            == (b.gcmd, b.ccmd, b.iqt, b.fsts, b.fectl, b.ics, b.iectl)
        {
            return;
        }
        st.arrival = Instant::now();
        st.scan_budget = true;
        if gcmd != st.sc.gcmd {
            st.sc.gcmd = gcmd;
            self.write32(st, fx, GCMD, gcmd);
        }
        if ccmd != st.sc.ccmd {
            st.sc.ccmd = ccmd;
            self.write32(st, fx, CCMD, ccmd as u32);
            self.write32(st, fx, CCMD + 4, (ccmd >> 32) as u32);
        }
        if iqt != st.sc.iqt {
            st.sc.iqt = iqt;
            self.write32(st, fx, IQT, iqt);
        }
        if fsts != st.sc.fsts {
            st.sc.fsts = fsts;
            self.write32(st, fx, FSTS, fsts);
        }
        if fectl != st.sc.fectl {
            st.sc.fectl = fectl;
            self.write32(st, fx, FECTL, fectl);
        }
        if ics != st.sc.ics {
            st.sc.ics = ics;
            self.write32(st, fx, ICS, ics);
        }
        if iectl != st.sc.iectl {
            st.sc.iectl = iectl;
            self.write32(st, fx, IECTL, iectl);
        }
    }

    /// Publishes the status registers into the page (state lock held).
    pub(crate) fn sc_publish(&self, st: &mut State, p: SharedPage) {
        cas32(p32(p, GCMD), &mut st.sc.gcmd, SC_GCMD_CONSUMED);
        let want = st.ccmd;
        if want != st.sc.ccmd
            && p64(p, CCMD)
                .compare_exchange(st.sc.ccmd, want, Ordering::SeqCst, Ordering::Acquire)
                .is_ok()
        {
            st.sc.ccmd = want;
        }
        for (off, v) in [
            (VER, VER_VALUE),
            (CAP, CAP_VALUE as u32),
            (CAP + 4, (CAP_VALUE >> 32) as u32),
            (ECAP, ECAP_VALUE as u32),
            (ECAP + 4, (ECAP_VALUE >> 32) as u32),
            (IQH, st.iqh as u32),
            (IQH + 4, (st.iqh >> 32) as u32),
            (GSTS, st.gsts),
        ] {
            let a = p32(p, off);
            if a.load(Ordering::Relaxed) != v {
                a.store(v, Ordering::Release);
            }
        }
        let fsts = marked(self.fsts_value(st));
        cas32(p32(p, FSTS), &mut st.sc.fsts, fsts);
        cas32(p32(p, FECTL), &mut st.sc.fectl, st.fectl);
        cas32(p32(p, ICS), &mut st.sc.ics, marked(st.ics));
        cas32(p32(p, IECTL), &mut st.sc.iectl, st.iectl);
        let w = &self.sc_watch;
        let s = &st.sc;
        for (i, v) in [
            s.gcmd,
            s.iqt,
            s.fsts,
            s.fectl,
            s.ics,
            s.iectl,
            s.ccmd as u32,
            (s.ccmd >> 32) as u32,
        ]
        .into_iter()
        .enumerate()
        {
            w[i].store(v, Ordering::Release);
        }
    }

    /// Lock-free: does the page hold a guest write not yet taken in?
    fn sc_dirty(&self, p: SharedPage) -> bool {
        let w = &self.sc_watch;
        [GCMD, IQT, FSTS, FECTL, ICS, IECTL, CCMD, CCMD + 4]
            .iter()
            .enumerate()
            .any(|(i, &off)| p32(p, off).load(Ordering::Acquire) != w[i].load(Ordering::Relaxed))
    }

    /// The sidecore thread body: polls until `stop`, backs off when idle, counts polls,
    /// busy polls and its own CPU time (CLOCK_THREAD_CPUTIME_ID).
    pub fn run_sidecore(&self, stop: &AtomicBool) {
        let cpu0 = thread_cpu_ns();
        let cpu_base = self.c.sc_cpu_ns.get();
        let (mut idle, mut sleep_us) = (0u32, 1u64);
        let (mut polls, mut busy) = (0u64, 0u64);
        let mut last_maint = Instant::now();
        let flush = |polls: &mut u64, busy: &mut u64| {
            self.c.sc_polls.add(std::mem::take(polls));
            self.c.sc_busy_polls.add(std::mem::take(busy));
            self.c
                .sc_cpu_ns
                .set(cpu_base + thread_cpu_ns().saturating_sub(cpu0));
        };
        while !stop.load(Ordering::Acquire) {
            polls += 1;
            let dirty = self.sc_page().is_some_and(|p| self.sc_dirty(p));
            if dirty {
                busy += 1;
                self.with_state(|_, _| {});
                idle = 0;
                sleep_us = 1;
                continue;
            }
            idle = idle.saturating_add(1);
            // Grace periods and deferred unpins also progress while the guest is quiet.
            if last_maint.elapsed() >= Duration::from_millis(1) {
                last_maint = Instant::now();
                self.with_state(|_, _| {});
            }
            if idle < SPIN_POLLS {
                std::hint::spin_loop();
            } else {
                flush(&mut polls, &mut busy);
                std::thread::sleep(Duration::from_micros(sleep_us));
                sleep_us = (sleep_us * 2).min(MAX_SLEEP_US);
            }
            if polls >= 1024 {
                flush(&mut polls, &mut busy);
            }
        }
        flush(&mut polls, &mut busy);
    }
}
