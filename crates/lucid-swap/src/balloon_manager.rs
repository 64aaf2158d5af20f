//! A MOM-like balloon manager: a thread (`lucid-balloonm`) that every period (200 ms) reads the
//! VM's host memory pressure through a [`PressureSource`] and sets the balloon's target so that
//! what the guest uses fits the limit with some headroom.
//!
//! The sizing is [`next_target`], a pure function: under pressure (usage above the limit less
//! the headroom) it inflates by the excess, at most `max_inflate_step` per period, never while
//! the guest is still catching up with the last target (usage drops only once the guest has
//! inflated: asking for more before would over-balloon), never beyond what the guest reports
//! available (with statistics) less `guest_reserve`, and never below `min_guest` of RAM left to
//! the guest. With room to spare (usage below the limit less twice the headroom) it deflates by
//! the spare room, at most `max_deflate_step` per period. In between it holds the target.
//! The thread leaves a target alone for up to [`GUEST_GRACE`] while the guest works towards it
//! (`actual` differs), the first one (`--balloon size=`) included: changing it under a guest
//! still inflating only makes the balloon thrash.
//!
//! Counters, under `balloon.manager.`: `ticks`, `inflations`, `deflations` (target changes),
//! `usage_bytes` and `limit_bytes` (gauges: the latest pressure).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use lucid_seccomp::Role;
use lucid_stats::{Counter, StatsRegistry, ThreadRole};
use lucid_thread::{Background, Spawner, ThreadSpec};
use lucid_virtio::balloon::{BalloonControl, PAGE_SIZE};

/// How long the manager waits for the guest to reach a target before changing it again.
pub const GUEST_GRACE: Duration = Duration::from_secs(2);

/// Whether the manager should leave the target alone: the guest has not reached it yet and
/// the target was set less than `grace` ago.
pub fn waiting_for_guest(
    target_pages: u64,
    actual_pages: u64,
    since: Duration,
    grace: Duration,
) -> bool {
    actual_pages != target_pages && since < grace
}

/// The VM's memory use on the host and what it may use.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Pressure {
    /// Bytes the VM uses now (its memory cgroup's usage, or its resident set).
    pub usage: u64,
    /// Bytes it may use; 0 when unknown (the manager then leaves the target alone).
    pub limit: u64,
}

/// Where the manager reads the pressure (a memory cgroup, the process's RSS against host free
/// memory, a test's script).
pub trait PressureSource: Send + Sync {
    fn pressure(&self) -> Pressure;
}

/// How the manager sizes the balloon. Sizes in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SizingPolicy {
    /// Headroom below the limit, in thousandths of the limit...
    pub headroom_permille: u64,
    /// ...and at least this much.
    pub min_headroom: u64,
    /// Most the target grows per period.
    pub max_inflate_step: u64,
    /// Most the target shrinks per period.
    pub max_deflate_step: u64,
    /// RAM always left to the guest.
    pub min_guest: u64,
    /// With statistics: memory the guest keeps available whatever the pressure.
    pub guest_reserve: u64,
}

impl Default for SizingPolicy {
    fn default() -> Self {
        SizingPolicy {
            headroom_permille: 50,
            min_headroom: 8 << 20,
            max_inflate_step: 64 << 20,
            max_deflate_step: 32 << 20,
            min_guest: 32 << 20,
            guest_reserve: 8 << 20,
        }
    }
}

/// What [`next_target`] decides from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SizingInput {
    pub pressure: Pressure,
    /// The balloon's target and the pages the guest says it holds (4 KiB pages).
    pub target_pages: u64,
    pub actual_pages: u64,
    /// Guest RAM in 4 KiB pages.
    pub ram_pages: u64,
    /// Bytes the guest reports available (`VIRTIO_BALLOON_S_AVAIL`, else `S_MEMFREE`), if it
    /// sends statistics.
    pub guest_available: Option<u64>,
}

/// The next target, in 4 KiB pages (see the module documentation).
pub fn next_target(input: &SizingInput, policy: &SizingPolicy) -> u64 {
    let p = input.pressure;
    let target = input.target_pages;
    if p.limit == 0 {
        return target;
    }
    let headroom = (p.limit / 1000)
        .saturating_mul(policy.headroom_permille)
        .max(policy.min_headroom);
    let goal = p.limit.saturating_sub(headroom);
    let max_balloon = input
        .ram_pages
        .saturating_sub(policy.min_guest.div_ceil(PAGE_SIZE));
    if p.usage > goal {
        if input.actual_pages < target {
            // The guest has not caught up: usage has not dropped for the last step yet.
            return target.min(max_balloon);
        }
        let mut step = (p.usage - goal)
            .min(policy.max_inflate_step)
            .div_ceil(PAGE_SIZE);
        if let Some(avail) = input.guest_available {
            step = step.min(avail.saturating_sub(policy.guest_reserve) / PAGE_SIZE);
        }
        return target
            .saturating_add(step)
            .min(max_balloon)
            .max(target.min(max_balloon));
    }
    let spare = goal.saturating_sub(headroom);
    if p.usage < spare {
        let step = (spare - p.usage).min(policy.max_deflate_step) / PAGE_SIZE;
        return target.saturating_sub(step).min(max_balloon);
    }
    target.min(max_balloon)
}

struct ManagerCounters {
    ticks: Arc<Counter>,
    inflations: Arc<Counter>,
    deflations: Arc<Counter>,
    usage: Arc<Counter>,
    limit: Arc<Counter>,
}

/// The running manager thread; stopped (and joined) by [`BalloonManager::stop`] or on drop.
pub struct BalloonManager {
    thread: Background,
}

impl BalloonManager {
    /// Starts `lucid-balloonm`: it confines itself as a device back-end (it raises the
    /// balloon's configuration interrupt; an error ends the thread with a log line), then every
    /// `period` sizes the balloon of `ctl` from `source` with `policy`, asking the guest for
    /// fresh statistics each time.
    pub fn spawn(
        ctl: BalloonControl,
        source: Arc<dyn PressureSource>,
        policy: SizingPolicy,
        period: Duration,
        stats: &StatsRegistry,
        spawner: &Spawner,
    ) -> std::io::Result<BalloonManager> {
        let c = |n: &str| stats.counter(format!("balloon.manager.{n}"));
        let counters = ManagerCounters {
            ticks: c("ticks"),
            inflations: c("inflations"),
            deflations: c("deflations"),
            usage: c("usage_bytes"),
            limit: c("limit_bytes"),
        };
        let spec = ThreadSpec::new("lucid-balloonm", ThreadRole::Other, Role::Backend);
        let thread = spawner
            .spawn_background(spec, move |confined, thread_stop| {
                if let Err(e) = confined {
                    log::error!("balloon manager: {e}");
                    return;
                }
                let mut last_change = Instant::now();
                while !thread_stop.load(Ordering::Acquire) {
                    if tick(&ctl, &*source, &policy, &counters, last_change.elapsed()) {
                        last_change = Instant::now();
                    }
                    std::thread::park_timeout(period);
                }
            })
            .map_err(std::io::Error::other)?;
        Ok(BalloonManager { thread })
    }

    /// Stops the thread and waits for it.
    pub fn stop(mut self) {
        self.thread.stop();
    }
}

/// One period: read, decide, set. Returns whether it changed the target.
fn tick(
    ctl: &BalloonControl,
    source: &dyn PressureSource,
    policy: &SizingPolicy,
    c: &ManagerCounters,
    since_change: Duration,
) -> bool {
    c.ticks.inc();
    let pressure = source.pressure();
    c.usage.set(pressure.usage);
    c.limit.set(pressure.limit);
    ctl.request_stats();
    if waiting_for_guest(
        ctl.target_pages(),
        ctl.actual_pages(),
        since_change,
        GUEST_GRACE,
    ) {
        return false;
    }
    let stats = ctl.stats();
    let input = SizingInput {
        pressure,
        target_pages: ctl.target_pages(),
        actual_pages: ctl.actual_pages(),
        ram_pages: ctl.ram_pages(),
        guest_available: stats
            .as_ref()
            .and_then(|s| s.available_memory().or(s.free_memory())),
    };
    let next = next_target(&input, policy);
    if next > input.target_pages {
        c.inflations.inc();
    } else if next < input.target_pages {
        c.deflations.inc();
    }
    if next != input.target_pages {
        log::debug!(
            "balloon manager: usage {} MiB of {} MiB: target {} -> {} pages",
            pressure.usage >> 20,
            pressure.limit >> 20,
            input.target_pages,
            next
        );
        ctl.set_target_pages(next);
    }
    next != input.target_pages
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;
    const PAGES_PER_MIB: u64 = MIB / PAGE_SIZE;

    fn input(usage_mib: u64, limit_mib: u64, target_mib: u64, actual_mib: u64) -> SizingInput {
        SizingInput {
            pressure: Pressure {
                usage: usage_mib * MIB,
                limit: limit_mib * MIB,
            },
            target_pages: target_mib * PAGES_PER_MIB,
            actual_pages: actual_mib * PAGES_PER_MIB,
            ram_pages: 512 * PAGES_PER_MIB,
            guest_available: None,
        }
    }

    fn mib(pages: u64) -> u64 {
        pages / PAGES_PER_MIB
    }

    #[test]
    fn the_guest_gets_time_to_reach_a_target() {
        let g = GUEST_GRACE;
        assert!(waiting_for_guest(100, 40, Duration::from_millis(500), g));
        assert!(!waiting_for_guest(100, 100, Duration::from_millis(500), g));
        assert!(!waiting_for_guest(100, 40, g, g), "not forever");
    }

    #[test]
    fn unknown_limit_leaves_the_target_alone() {
        let p = SizingPolicy::default();
        assert_eq!(mib(next_target(&input(300, 0, 40, 40), &p)), 40);
    }

    #[test]
    fn pressure_inflates_by_the_excess_in_capped_steps() {
        let p = SizingPolicy::default();
        // Limit 256 MiB: headroom max(12.8 MiB, 8 MiB) = 12.8 MiB; goal 243.2 MiB.
        let t = next_target(&input(250, 256, 0, 0), &p);
        assert_eq!(
            t,
            (250 * MIB - (256 * MIB - 256 * MIB / 1000 * 50)).div_ceil(PAGE_SIZE)
        );
        // A big excess: one step of 64 MiB.
        assert_eq!(mib(next_target(&input(500, 256, 0, 0), &p)), 64);
        assert_eq!(mib(next_target(&input(500, 256, 64, 64), &p)), 128);
    }

    #[test]
    fn no_more_until_the_guest_catches_up() {
        let p = SizingPolicy::default();
        assert_eq!(mib(next_target(&input(500, 256, 64, 10), &p)), 64);
    }

    #[test]
    fn never_takes_the_guests_minimum_or_its_reserve() {
        let p = SizingPolicy::default();
        // 512 MiB guest, 32 MiB minimum: at most 480 MiB of balloon.
        assert_eq!(mib(next_target(&input(2000, 256, 470, 470), &p)), 480);
        assert_eq!(mib(next_target(&input(2000, 256, 480, 480), &p)), 480);
        // The guest reports 20 MiB available, keeps 8: 12 MiB more at most.
        let mut i = input(500, 256, 100, 100);
        i.guest_available = Some(20 * MIB);
        assert_eq!(mib(next_target(&i, &p)), 112);
        i.guest_available = Some(4 * MIB);
        assert_eq!(mib(next_target(&i, &p)), 100, "no room: hold");
        // A target above the maximum (RAM shrank? a user) is brought down.
        assert_eq!(mib(next_target(&input(240, 256, 500, 500), &p)), 480);
    }

    #[test]
    fn room_to_spare_deflates_in_steps_down_to_zero() {
        let p = SizingPolicy::default();
        // Limit 256: goal 243.2, spare below 230.4 MiB.
        assert_eq!(mib(next_target(&input(100, 256, 200, 200), &p)), 200 - 32);
        let spare = 256 * MIB - 2 * (256 * MIB / 1000 * 50);
        assert_eq!(
            next_target(&input(220, 256, 200, 200), &p),
            200 * PAGES_PER_MIB - (spare - 220 * MIB) / PAGE_SIZE
        );
        assert_eq!(next_target(&input(10, 256, 16, 16), &p), 0);
        let mut t = 200 * PAGES_PER_MIB;
        for _ in 0..10 {
            let mut i = input(50, 256, 0, 0);
            i.target_pages = t;
            i.actual_pages = t;
            t = next_target(&i, &p);
        }
        assert_eq!(t, 0);
    }

    #[test]
    fn between_the_thresholds_the_target_holds() {
        let p = SizingPolicy::default();
        assert_eq!(mib(next_target(&input(235, 256, 50, 50), &p)), 50);
        assert_eq!(mib(next_target(&input(243, 256, 50, 50), &p)), 50);
    }

    #[test]
    fn converges_under_a_steady_workload() {
        // A guest that touches 400 MiB of its 512 MiB; the balloon takes pages from it one for
        // one. Usage = touched - balloon (+ 20 MiB of VMM). Limit 256 MiB.
        let p = SizingPolicy::default();
        let mut target = 0;
        for _ in 0..20 {
            let usage = (400 + 20) * MIB - target * PAGE_SIZE;
            let i = SizingInput {
                pressure: Pressure {
                    usage,
                    limit: 256 * MIB,
                },
                target_pages: target,
                actual_pages: target,
                ram_pages: 512 * PAGES_PER_MIB,
                guest_available: None,
            };
            target = next_target(&i, &p);
        }
        let usage = (420 * MIB).saturating_sub(target * PAGE_SIZE);
        assert!(
            (256 * MIB - 27 * MIB..=256 * MIB - 12 * MIB).contains(&usage),
            "{}",
            usage >> 20
        );
    }
}
