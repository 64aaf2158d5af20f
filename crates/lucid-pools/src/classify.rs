//! Labels a VM CPU-bound or I/O-bound from the monitor's windows and says when to move it
//! (docs/scheduling.md). Pure: it sees only [`Observation`]s and the time, so it is
//! tested with synthetic windows.
//!
//! Each window gives the VM's CPU demand ((CPU + run-queue wait) / wall, per vCPU), its I/O rate
//! and its event rate (kicks + interrupts). The three are smoothed (EWMA, α = 0.3) and the
//! smoothed values (and the window's own, which must agree) get a label: CPU-bound when demand ≥ 0.9 with little I/O, I/O-bound when
//! demand ≤ 0.6 with I/O above the thresholds, or whatever the demand when the I/O is heavy
//! (≥ 10 MB/s or ≥ 5000 events/s: a guest that polls for its completions instead of halting,
//! as the probe guests do, keeps its demand near 1 however I/O-bound it is), else unknown. The VM moves only after
//! [`ClassifierConfig::agree`] windows in a row agree on a label other than its current one, and
//! at least [`ClassifierConfig::dwell`] after its last placement: averages move VMs, spikes do
//! not (the thesis's §1.4).

use std::time::Duration;

/// What the classifier thinks a VM is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Label {
    CpuBound,
    IoBound,
    Unknown,
}

impl Label {
    pub fn name(self) -> &'static str {
        match self {
            Label::CpuBound => "cpu",
            Label::IoBound => "io",
            Label::Unknown => "unknown",
        }
    }

    /// The number published as the `monitor.label` gauge: 0 unknown, 1 CPU-bound, 2 I/O-bound.
    pub fn code(self) -> u64 {
        match self {
            Label::Unknown => 0,
            Label::CpuBound => 1,
            Label::IoBound => 2,
        }
    }
}

impl std::fmt::Display for Label {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Thresholds and timing. [`Default`] holds the values docs/scheduling.md gives.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ClassifierConfig {
    /// EWMA weight of the newest window.
    pub alpha: f64,
    /// Windows in a row that must agree before a move.
    pub agree: u32,
    /// Least time between two placements of one VM.
    pub dwell: Duration,
    /// Demand at or above which a VM with little I/O is CPU-bound.
    pub cpu_demand: f64,
    /// Demand at or below which a VM with enough I/O is I/O-bound.
    pub io_demand: f64,
    /// I/O rate (bytes/s, both directions) that counts as "I/O".
    pub io_bytes_per_s: f64,
    /// Event rate (kicks + interrupts per second) that counts as "I/O".
    pub io_events_per_s: f64,
    /// I/O rate that makes a VM I/O-bound whatever its demand.
    pub heavy_io_bytes_per_s: f64,
    /// Event rate that makes a VM I/O-bound whatever its demand.
    pub heavy_io_events_per_s: f64,
}

impl Default for ClassifierConfig {
    fn default() -> Self {
        ClassifierConfig {
            alpha: 0.3,
            agree: 5,
            dwell: Duration::from_secs(10),
            cpu_demand: 0.9,
            io_demand: 0.6,
            io_bytes_per_s: 1e6,
            io_events_per_s: 500.0,
            heavy_io_bytes_per_s: 10e6,
            heavy_io_events_per_s: 5000.0,
        }
    }
}

/// One monitor window of one VM, as rates.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Observation {
    /// (CPU + run-queue wait) / wall, averaged over the VM's vCPU threads (0..=1 per vCPU).
    pub demand: f64,
    /// Bytes moved by the VM's back-ends per second, both directions.
    pub io_bytes_per_s: f64,
    /// Kicks + interrupts per second.
    pub events_per_s: f64,
}

/// What [`Classifier::observe`] decided for one window.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Leave the VM where it is.
    Stay,
    /// Move the VM to the pool for this label (never `Unknown`).
    Move(Label),
}

/// One VM's classifier state.
#[derive(Clone, Debug)]
pub struct Classifier {
    cfg: ClassifierConfig,
    smoothed: Option<Observation>,
    /// The label of the latest window (from the smoothed values) and how many windows in a row
    /// gave it.
    last: Label,
    streak: u32,
    /// Where the VM is now (`Unknown` until the first move).
    current: Label,
    /// When the VM was last placed (its start counts).
    placed_at: Duration,
}

impl Classifier {
    /// A classifier for a VM placed at time `now` (any monotonic clock, as a duration since an
    /// origin the caller keeps) with label `current` (`Unknown` if it was placed by default).
    pub fn new(cfg: ClassifierConfig, current: Label, now: Duration) -> Self {
        Classifier {
            cfg,
            smoothed: None,
            last: Label::Unknown,
            streak: 0,
            current,
            placed_at: now,
        }
    }

    pub fn config(&self) -> &ClassifierConfig {
        &self.cfg
    }

    /// The smoothed figures so far.
    pub fn smoothed(&self) -> Option<Observation> {
        self.smoothed
    }

    /// The label of the latest window.
    pub fn label(&self) -> Label {
        self.last
    }

    /// The label of the pool the VM is in.
    pub fn current(&self) -> Label {
        self.current
    }

    /// How many windows in a row gave [`Classifier::label`].
    pub fn streak(&self) -> u32 {
        self.streak
    }

    /// Labels a set of (smoothed) figures.
    pub fn label_of(&self, o: &Observation) -> Label {
        let c = &self.cfg;
        let io = o.io_bytes_per_s >= c.io_bytes_per_s || o.events_per_s >= c.io_events_per_s;
        let quiet = o.io_bytes_per_s < c.io_bytes_per_s && o.events_per_s < c.io_events_per_s;
        let heavy =
            o.io_bytes_per_s >= c.heavy_io_bytes_per_s || o.events_per_s >= c.heavy_io_events_per_s;
        if o.demand >= c.cpu_demand && quiet {
            Label::CpuBound
        } else if (o.demand <= c.io_demand && io) || heavy {
            Label::IoBound
        } else {
            Label::Unknown
        }
    }

    /// Takes one window ending at `now` and says whether to move the VM. After a `Move` the
    /// caller places the VM; the classifier already counts it as placed there at `now`.
    pub fn observe(&mut self, o: Observation, now: Duration) -> Decision {
        let clean = |v: f64| if v.is_finite() && v > 0.0 { v } else { 0.0 };
        let o = Observation {
            demand: clean(o.demand),
            io_bytes_per_s: clean(o.io_bytes_per_s),
            events_per_s: clean(o.events_per_s),
        };
        let a = self.cfg.alpha.clamp(0.0, 1.0);
        let s = match self.smoothed {
            None => o,
            Some(p) => Observation {
                demand: a * o.demand + (1.0 - a) * p.demand,
                io_bytes_per_s: a * o.io_bytes_per_s + (1.0 - a) * p.io_bytes_per_s,
                events_per_s: a * o.events_per_s + (1.0 - a) * p.events_per_s,
            },
        };
        self.smoothed = Some(s);
        // A window agrees on a label when its own figures and the smoothed ones both give it:
        // the average keeps a burst's trace for a while after the burst, the raw window does not.
        let label = match (self.label_of(&s), self.label_of(&o)) {
            (smooth, raw) if smooth == raw => smooth,
            _ => Label::Unknown,
        };
        if label == self.last {
            self.streak = self.streak.saturating_add(1);
        } else {
            self.last = label;
            self.streak = 1;
        }
        let dwelt = now.saturating_sub(self.placed_at) >= self.cfg.dwell;
        if label != Label::Unknown
            && label != self.current
            && self.streak >= self.cfg.agree.max(1)
            && dwelt
        {
            self.current = label;
            self.placed_at = now;
            return Decision::Move(label);
        }
        Decision::Stay
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CPU: Observation = Observation {
        demand: 1.0,
        io_bytes_per_s: 0.0,
        events_per_s: 2.0,
    };
    const IO: Observation = Observation {
        demand: 0.3,
        io_bytes_per_s: 100e6,
        events_per_s: 5000.0,
    };

    fn s(n: u64) -> Duration {
        Duration::from_secs(n)
    }

    /// Feeds `obs` once a second from `from`, returning the second of each move.
    fn feed(c: &mut Classifier, from: u64, obs: &[Observation]) -> Vec<(u64, Label)> {
        let mut moves = Vec::new();
        for (i, o) in obs.iter().enumerate() {
            let t = from + i as u64;
            if let Decision::Move(l) = c.observe(*o, s(t)) {
                moves.push((t, l));
            }
        }
        moves
    }

    #[test]
    fn a_cpu_loop_is_cpu_bound_and_moves_after_agree_windows_and_the_dwell() {
        let mut c = Classifier::new(ClassifierConfig::default(), Label::Unknown, s(0));
        // Windows 1..=5 agree by second 5, but the 10 s dwell holds the move to second 10.
        let moves = feed(&mut c, 1, &[CPU; 15]);
        assert_eq!(moves, vec![(10, Label::CpuBound)]);
        assert_eq!(c.current(), Label::CpuBound);
        assert_eq!(c.label(), Label::CpuBound);
    }

    #[test]
    fn an_io_stream_is_io_bound_within_its_windows() {
        let cfg = ClassifierConfig {
            dwell: Duration::ZERO,
            ..Default::default()
        };
        let mut c = Classifier::new(cfg, Label::Unknown, s(0));
        let moves = feed(&mut c, 1, &[IO; 8]);
        assert_eq!(moves, vec![(5, Label::IoBound)], "after exactly 5 windows");
    }

    #[test]
    fn a_cpu_vm_in_the_io_pool_moves_to_the_cpu_pool_then_stays() {
        let mut c = Classifier::new(ClassifierConfig::default(), Label::IoBound, s(0));
        let moves = feed(&mut c, 1, &[CPU; 40]);
        assert_eq!(moves, vec![(10, Label::CpuBound)]);
    }

    #[test]
    fn a_short_burst_does_not_move_the_vm() {
        let mut c = Classifier::new(ClassifierConfig::default(), Label::CpuBound, s(0));
        // 20 s of CPU, a 4 s I/O burst, then CPU again: never a move.
        let mut obs = vec![CPU; 20];
        obs.extend([IO; 4]);
        obs.extend([CPU; 20]);
        assert_eq!(feed(&mut c, 1, &obs), vec![]);
        assert_eq!(c.current(), Label::CpuBound);
        // Alternating bursts never agree for 5 windows either.
        let mut c = Classifier::new(ClassifierConfig::default(), Label::CpuBound, s(0));
        let alternating: Vec<_> = (0..60)
            .map(|i| if (i / 2) % 2 == 0 { IO } else { CPU })
            .collect();
        assert_eq!(feed(&mut c, 1, &alternating), vec![]);
    }

    #[test]
    fn the_dwell_stops_a_second_move_soon_after_the_first() {
        let cfg = ClassifierConfig {
            agree: 2,
            ..Default::default()
        };
        let mut c = Classifier::new(cfg, Label::Unknown, s(0));
        let mut obs = vec![CPU; 12];
        obs.extend([IO; 12]);
        let moves = feed(&mut c, 1, &obs);
        // CPU at 10 (dwell from 0); the workload turns at 13 and the smoothed label follows a
        // couple of windows later, but the next move waits for 10 s after the first.
        assert_eq!(moves, vec![(10, Label::CpuBound), (20, Label::IoBound)]);
    }

    #[test]
    fn mixed_or_idle_vms_are_unknown_and_never_move() {
        let c = Classifier::new(ClassifierConfig::default(), Label::Unknown, s(0));
        let idle = Observation::default();
        assert_eq!(c.label_of(&idle), Label::Unknown);
        // Busy with some I/O: neither.
        let busy_io = Observation {
            demand: 1.0,
            io_bytes_per_s: 5e6,
            events_per_s: 600.0,
        };
        assert_eq!(c.label_of(&busy_io), Label::Unknown);
        let mut c = c;
        assert_eq!(feed(&mut c, 1, &[idle; 30]), vec![]);
    }

    #[test]
    fn a_guest_that_polls_for_heavy_io_is_io_bound() {
        let c = Classifier::new(ClassifierConfig::default(), Label::Unknown, s(0));
        for o in [
            Observation {
                demand: 1.0,
                io_bytes_per_s: 100e6,
                events_per_s: 50.0,
            },
            Observation {
                demand: 0.95,
                io_bytes_per_s: 0.0,
                events_per_s: 8000.0,
            },
        ] {
            assert_eq!(c.label_of(&o), Label::IoBound, "{o:?}");
        }
    }

    #[test]
    fn events_alone_make_io() {
        let c = Classifier::new(ClassifierConfig::default(), Label::Unknown, s(0));
        let chatty = Observation {
            demand: 0.2,
            io_bytes_per_s: 0.0,
            events_per_s: 800.0,
        };
        assert_eq!(c.label_of(&chatty), Label::IoBound);
    }

    #[test]
    fn garbage_figures_are_treated_as_zero() {
        let mut c = Classifier::new(ClassifierConfig::default(), Label::Unknown, s(0));
        let bad = Observation {
            demand: f64::NAN,
            io_bytes_per_s: f64::INFINITY,
            events_per_s: -3.0,
        };
        assert_eq!(c.observe(bad, s(1)), Decision::Stay);
        assert_eq!(c.smoothed(), Some(Observation::default()));
    }

    #[test]
    fn short_test_windows_work_the_same() {
        let cfg = ClassifierConfig {
            agree: 3,
            dwell: Duration::from_millis(500),
            ..Default::default()
        };
        let mut c = Classifier::new(cfg, Label::IoBound, Duration::ZERO);
        let mut moved = None;
        for i in 1..20u64 {
            if let Decision::Move(l) = c.observe(CPU, Duration::from_millis(200 * i)) {
                moved = Some((i, l));
                break;
            }
        }
        assert_eq!(moved, Some((3, Label::CpuBound)));
    }
}
