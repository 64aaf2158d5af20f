//! `lucid bench iommu`: the vIOMMU paper's Table 1, measured side by side in one run. For each
//! workload of `lucid bench io` (virtio-blk 4 KiB random reads at QD1 and QD32, virtio-net
//! request-response at 64 B and 1500 B) on rungs L1 and L4p, the same probe guest runs with no
//! IOMMU ("off") and then behind Lucid's VT-d in samecore and sidecore emulation, with each of the
//! guest mapping strategies (strict, shared, async, deferred, teardown256, teardown4096). The
//! `assigned` workload does the same for a device Lucid does not emulate (see `assigned`).
//!
//! Figures: ops/s from inside the guest and as a fraction of "off"; what the guest reports by
//! hypercall (`iommu.guest.*`: map and unmap cost in TSC cycles, reuse hits, stale-mapping maximum
//! and longest window); Lucid's own counts (peak pinned pages against pin-all, the sidecore
//! thread's CPU time). Each configuration runs `runs` times and the best run counts (the machine
//! is shared: the best is the least disturbed).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use lucid_iommu::{EmulationMode, PinPolicy, VtdConfig};
use lucid_vmm::{KernelSource, VmConfig};
use serde_json::{json, Value};

use crate::assigned;
use crate::io::{self, RungSetup, Workload, WORKLOADS};

/// The `--workloads` name of the assigned device (out-of-process edu over vfio-user).
const ASSIGNED: &str = "assigned";

#[derive(clap::Args)]
pub struct IommuArgs {
    #[arg(long)]
    json: bool,
    /// Operations per run.
    #[arg(long, default_value_t = 2000)]
    count: u64,
    /// Runs of each configuration; the best is reported.
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Rungs to measure on (L1, L4p).
    #[arg(long, value_delimiter = ',', default_values_t = ["L1".to_string(), "L4p".to_string()])]
    rungs: Vec<String>,
    /// Workloads (names as in `lucid bench io`, and `assigned`: virtio-blk and QEMU's edu in
    /// processes of their own over vfio-user); all by default.
    #[arg(long, value_delimiter = ',')]
    workloads: Vec<String>,
    /// Write an SVG plot of the fractions of "off" to this file.
    #[arg(long)]
    plot: Option<PathBuf>,
}

/// The guest's mapping strategies (`strategy=` of the probe guests' DMA layer).
pub const STRATEGIES: &[&str] = &[
    "strict",
    "shared",
    "async",
    "deferred",
    "teardown256",
    "teardown4096",
];

/// One column: no IOMMU, or a mode with a strategy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Setup {
    mode: Option<EmulationMode>,
    strategy: &'static str,
}

impl Setup {
    fn label(&self) -> String {
        match self.mode {
            None => "off".into(),
            Some(m) => format!("{}/{}", mode_name(m), self.strategy),
        }
    }
}

fn mode_name(m: EmulationMode) -> &'static str {
    match m {
        EmulationMode::Samecore => "samecore",
        EmulationMode::Sidecore => "sidecore",
    }
}

fn setups() -> Vec<Setup> {
    let mut v = vec![Setup {
        mode: None,
        strategy: "off",
    }];
    for mode in [EmulationMode::Samecore, EmulationMode::Sidecore] {
        for &strategy in STRATEGIES {
            v.push(Setup {
                mode: Some(mode),
                strategy,
            });
        }
    }
    v
}

/// What one run gave.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
struct Figures {
    ops_per_s: f64,
    /// Guest TSC cycles per map and per unmap (its own rdtsc around the DMA layer's calls).
    map_cycles: f64,
    unmap_cycles: f64,
    maps: u64,
    reuse_hits: u64,
    stale_max: u64,
    window_max_us: u64,
    faults: u64,
    pinned_peak: u64,
    /// The sidecore thread's CPU time over the run's wall time.
    sidecore_cpu: f64,
    iotlb_hit_rate: f64,
}

fn counter(c: &BTreeMap<String, u64>, k: &str) -> u64 {
    c.get(k).copied().unwrap_or(0)
}

fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 {
        0.0
    } else {
        a as f64 / b as f64
    }
}

fn lucid_run(
    w: &Workload,
    r: &RungSetup,
    s: Setup,
    kernel: &Path,
    disk: &Path,
    count: u64,
    dir: &Path,
) -> Result<Figures, String> {
    let mut c = VmConfig::new(KernelSource::File(kernel.into()));
    if s.mode.is_some() {
        c.payload.cmdline = format!(" iommu=vtd strategy={}", s.strategy);
    }
    c.iommu = s.mode.map(|mode| VtdConfig {
        mode,
        pin: PinPolicy::Map,
    });
    let label = format!(" {}", s.label());
    let (guest, report) = io::run_guest(w, r, disk, count, dir, c, &label)?;
    let k = &report.counters;
    let maps = counter(k, "iommu.guest.maps");
    let unmaps = counter(k, "iommu.guest.unmaps");
    let wall = report.wall.as_nanos().max(1) as f64;
    Ok(Figures {
        ops_per_s: guest.ops_per_s,
        map_cycles: ratio(counter(k, "iommu.guest.map_cycles"), maps),
        unmap_cycles: ratio(counter(k, "iommu.guest.unmap_cycles"), unmaps),
        maps,
        reuse_hits: counter(k, "iommu.guest.reuse_hits"),
        stale_max: counter(k, "iommu.guest.stale_max"),
        window_max_us: counter(k, "iommu.guest.window_max_us"),
        faults: counter(k, "iommu.faults.dma"),
        pinned_peak: counter(k, "iommu.pinned.peak"),
        sidecore_cpu: counter(k, "iommu.sidecore.cpu_ns") as f64 / wall,
        iotlb_hit_rate: ratio(
            counter(k, "iommu.iotlb.hits"),
            counter(k, "iommu.iotlb.hits") + counter(k, "iommu.iotlb.misses"),
        ),
    })
}

/// One cell of the table: the best of the runs, or why every run failed.
type Cell = Result<Figures, String>;

/// One row: (workload, rung label) and a cell per setup.
type Row = ((&'static str, &'static str), Vec<(Setup, Cell)>);

struct Table {
    /// (workload, rung label) -> setup label -> cell
    rows: Vec<Row>,
    guest_ram_pages: u64,
}

impl Table {
    fn over_off(row: &[(Setup, Cell)], s: &Setup) -> Option<f64> {
        let off = row
            .iter()
            .find(|(x, _)| x.mode.is_none())?
            .1
            .as_ref()
            .ok()?;
        let this = row.iter().find(|(x, _)| x == s)?.1.as_ref().ok()?;
        (off.ops_per_s > 0.0).then(|| this.ops_per_s / off.ops_per_s)
    }

    fn ops(row: &[(Setup, Cell)], mode: EmulationMode, strategy: &str) -> Option<f64> {
        row.iter()
            .find(|(x, _)| x.mode == Some(mode) && x.strategy == strategy)
            .and_then(|(_, c)| c.as_ref().ok())
            .map(|f| f.ops_per_s)
    }

    /// The rows of one rung only.
    fn only(&self, rung: &str) -> Table {
        Table {
            rows: self
                .rows
                .iter()
                .filter(|((_, r), _)| *r == rung)
                .cloned()
                .collect(),
            guest_ram_pages: self.guest_ram_pages,
        }
    }

    /// The rungs measured, in order.
    fn rungs(&self) -> Vec<&'static str> {
        let mut v: Vec<&'static str> = Vec::new();
        for ((_, r), _) in &self.rows {
            if !v.contains(r) {
                v.push(r);
            }
        }
        v
    }

    /// The three goal figures over these rows.
    fn goals(&self) -> Value {
        json!({
            "sidecore_teardown_over_off": self.sidecore_teardown_over_off(),
            "sidecore_over_samecore_strict": self.sidecore_over_samecore_strict(),
            "teardown_hit_rate": self.teardown_hit_rate(),
        })
    }

    /// The worst workload's sidecore-with-teardown fraction of off (the better teardown quota
    /// per workload). None when a needed cell failed.
    fn sidecore_teardown_over_off(&self) -> Option<f64> {
        let mut worst: Option<f64> = None;
        for (_, row) in &self.rows {
            let best = ["teardown256", "teardown4096"]
                .iter()
                .filter_map(|t| {
                    Self::over_off(
                        row,
                        &Setup {
                            mode: Some(EmulationMode::Sidecore),
                            strategy: t,
                        },
                    )
                })
                .fold(None, |a: Option<f64>, b| Some(a.map_or(b, |a| a.max(b))))?;
            worst = Some(worst.map_or(best, |w| w.min(best)));
        }
        worst
    }

    /// The worst workload's sidecore over samecore, both strict.
    fn sidecore_over_samecore_strict(&self) -> Option<f64> {
        let mut worst: Option<f64> = None;
        for (_, row) in &self.rows {
            let side = Self::ops(row, EmulationMode::Sidecore, "strict")?;
            let same = Self::ops(row, EmulationMode::Samecore, "strict")?;
            if same <= 0.0 {
                return None;
            }
            let r = side / same;
            worst = Some(worst.map_or(r, |w| w.min(r)));
        }
        worst
    }

    /// Reuse hits over maps, over every teardown run.
    fn teardown_hit_rate(&self) -> Option<f64> {
        let (mut hits, mut maps) = (0u64, 0u64);
        for (_, row) in &self.rows {
            for (s, c) in row {
                if let (true, Ok(f)) = (s.strategy.starts_with("teardown"), c) {
                    hits += f.reuse_hits;
                    maps += f.maps;
                }
            }
        }
        (maps > 0).then(|| hits as f64 / maps as f64)
    }

    fn to_json(&self, count: u64) -> Value {
        let mut workloads = serde_json::Map::new();
        for ((w, r), row) in &self.rows {
            let mut cells = serde_json::Map::new();
            for (s, c) in row {
                let v = match c {
                    Ok(f) => {
                        let mut v = json!(f);
                        v["over_off"] = json!(Self::over_off(row, s));
                        v
                    }
                    Err(e) => json!({ "error": e }),
                };
                cells.insert(s.label(), v);
            }
            workloads
                .entry(w.to_string())
                .or_insert_with(|| json!({}))
                .as_object_mut()
                .expect("object")
                .insert(r.to_string(), Value::Object(cells));
        }
        let by_rung: serde_json::Map<String, Value> = self
            .rungs()
            .into_iter()
            .map(|r| (r.to_string(), self.only(r).goals()))
            .collect();
        let mut j = self.goals();
        j["count"] = json!(count);
        j["pin"] = json!("map");
        j["guest_ram_pages"] = json!(self.guest_ram_pages);
        j["workloads"] = Value::Object(workloads);
        // The same three figures for each rung alone (the top-level ones are the worst of all).
        j["by_rung"] = Value::Object(by_rung);
        j
    }

    fn print(&self) {
        println!(
            "lucid bench iommu: ops/s as a fraction of no IOMMU (\"off\"), best of the runs; \
             map/unmap in guest TSC cycles; pin=map (pin-all would pin {} pages)",
            self.guest_ram_pages
        );
        for ((w, r), row) in &self.rows {
            println!("{w} on {r}:");
            for (s, c) in row {
                match c {
                    Ok(f) => println!(
                        "  {:<22} {:>9.0} ops/s  {:>5}  map {:>7.0}  unmap {:>7.0}  hits {:>6}/{:<6}  \
                         stale max {:>4}  window {:>5} us  pinned peak {:>5}  sidecore cpu {:.2}",
                        s.label(),
                        f.ops_per_s,
                        Self::over_off(row, s).map_or("-".into(), |x| format!("{x:.2}")),
                        f.map_cycles,
                        f.unmap_cycles,
                        f.reuse_hits,
                        f.maps,
                        f.stale_max,
                        f.window_max_us,
                        f.pinned_peak,
                        f.sidecore_cpu,
                    ),
                    Err(e) => println!("  {:<22} error: {e}", s.label()),
                }
            }
        }
        let show = |x: Option<f64>| x.map_or("n/a".into(), |v| format!("{v:.3}"));
        let line = |scope: &str, t: &Table| {
            println!(
                "{scope}: sidecore_teardown_over_off {} (goal >= 0.97)  \
                 sidecore_over_samecore_strict {} (goal >= 2)  teardown_hit_rate {} (goal >= 0.9)",
                show(t.sidecore_teardown_over_off()),
                show(t.sidecore_over_samecore_strict()),
                show(t.teardown_hit_rate()),
            )
        };
        line("all rungs", self);
        for r in self.rungs() {
            line(&format!("{r} only"), &self.only(r));
        }
    }

    /// One panel per workload and rung; one bar per setup, height = fraction of off.
    fn svg(&self) -> String {
        let setups = setups();
        let panel_h = 150.0;
        let (w, h) = (960.0, 50.0 + panel_h * self.rows.len() as f64 + 40.0);
        let mut s = crate::svg_start(
            w,
            h,
            10,
            "lucid bench iommu: ops/s as a fraction of no IOMMU (1.0 = off), samecore (blue) and \
             sidecore (orange)",
        );
        let bar_w = (w - 200.0) / setups.len() as f64;
        for (i, ((wl, rung), row)) in self.rows.iter().enumerate() {
            let top = 40.0 + i as f64 * panel_h;
            let bottom = top + panel_h - 30.0;
            let y = |v: f64| bottom - v.clamp(0.0, 1.2) / 1.2 * (bottom - top);
            let _ = writeln!(
                s,
                r#"<text x="6" y="{}" font-size="11">{wl} {rung}</text>"#,
                top + 20.0
            );
            let _ = writeln!(
                s,
                r##"<line x1="180" x2="{}" y1="{}" y2="{}" stroke="#999" stroke-dasharray="3"/>"##,
                w - 10.0,
                y(1.0),
                y(1.0)
            );
            for (j, setup) in setups.iter().enumerate() {
                let x = 185.0 + j as f64 * bar_w;
                if let Some(v) = Self::over_off(row, setup) {
                    let fill = match setup.mode {
                        None => "#888",
                        Some(EmulationMode::Samecore) => "#4a7fb5",
                        Some(EmulationMode::Sidecore) => "#d0842c",
                    };
                    let _ = writeln!(
                        s,
                        r#"<rect x="{x}" y="{}" width="{}" height="{}" fill="{fill}"/>"#,
                        y(v),
                        bar_w * 0.8,
                        bottom - y(v)
                    );
                }
                if i + 1 == self.rows.len() {
                    let _ = writeln!(
                        s,
                        r#"<text x="{x}" y="{}" transform="rotate(50 {x} {})">{}</text>"#,
                        bottom + 10.0,
                        bottom + 10.0,
                        setup.strategy
                    );
                }
            }
        }
        s.push_str("</svg>\n");
        s
    }
}

fn rung_setup(label: &str) -> Result<&'static RungSetup, String> {
    io::RUNGS
        .iter()
        .find(|r| r.label.eq_ignore_ascii_case(label))
        .ok_or(format!("unknown rung {label} (L0, L1, L2, L4, L4p)"))
}

pub fn run(args: IommuArgs) -> Result<ExitCode, String> {
    let rungs: Vec<&RungSetup> = args
        .rungs
        .iter()
        .map(|r| rung_setup(r))
        .collect::<Result<_, _>>()?;
    let wanted = |name: &str| args.workloads.is_empty() || args.workloads.iter().any(|n| n == name);
    let workloads: Vec<&Workload> = WORKLOADS.iter().filter(|w| wanted(w.name)).collect();
    let with_assigned = wanted(ASSIGNED);
    if workloads.is_empty() && !with_assigned {
        return Err(format!("no such workload in {:?}", args.workloads));
    }
    let dir = std::env::temp_dir().join(format!("lucid-bench-iommu-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let disk = io::make_disk(&dir)?;
    let mut rows = Vec::new();
    for w in workloads {
        let kernel = io::guest_path(w.guest, &dir)?;
        for r in &rungs {
            let mut row = Vec::new();
            for s in setups() {
                let mut best: Option<Figures> = None;
                let mut err = String::new();
                for _ in 0..args.runs.max(1) {
                    match lucid_run(w, r, s, &kernel, &disk, args.count, &dir) {
                        Ok(f) if best.as_ref().is_none_or(|b| f.ops_per_s > b.ops_per_s) => {
                            best = Some(f)
                        }
                        Ok(_) => {}
                        Err(e) => err = e,
                    }
                }
                let cell = best.ok_or(err);
                match &cell {
                    Ok(f) => log::info!(
                        "{:<22} {:<4} {:<22} {:.0} ops/s",
                        w.name,
                        r.label,
                        s.label(),
                        f.ops_per_s
                    ),
                    Err(e) => log::warn!("{:<22} {:<4} {:<22} {e}", w.name, r.label, s.label()),
                }
                row.push((s, cell));
            }
            rows.push(((w.name, r.label), row));
        }
    }
    let mut assigned_rows = Vec::new();
    if with_assigned {
        let setups: Vec<assigned::Setup> = setups().iter().map(|s| (s.mode, s.strategy)).collect();
        for d in assigned::Device::ALL {
            let row = assigned::measure(d, &setups, args.count, args.runs, &dir, &disk)?;
            assigned_rows.push((d, row));
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    let table = Table {
        rows,
        guest_ram_pages: (VmConfig::new(KernelSource::File(PathBuf::new()))
            .machine
            .mem_mib
            << 20)
            >> 12,
    };
    if let Some(p) = &args.plot {
        std::fs::write(p, table.svg()).map_err(|e| format!("{}: {e}", p.display()))?;
    }
    if args.json {
        let mut j = table.to_json(args.count);
        if with_assigned {
            if let (Some(j), Value::Object(a)) = (
                j.as_object_mut(),
                assigned::to_json(&assigned_rows, args.count),
            ) {
                j.extend(a);
            }
        }
        println!("{j}");
    } else {
        table.print();
        if with_assigned {
            assigned::print(&assigned_rows);
        }
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fig(ops: f64, hits: u64, maps: u64) -> Cell {
        Ok(Figures {
            ops_per_s: ops,
            reuse_hits: hits,
            maps,
            ..Figures::default()
        })
    }

    #[test]
    fn goals_come_from_the_worst_workload() {
        let row = |off: f64, same: f64, side: f64, td: f64| {
            setups()
                .into_iter()
                .map(|s| {
                    let v = match (s.mode, s.strategy) {
                        (None, _) => fig(off, 0, 0),
                        (Some(EmulationMode::Samecore), "strict") => fig(same, 0, 0),
                        (Some(EmulationMode::Sidecore), "strict") => fig(side, 0, 0),
                        (Some(_), t) if t.starts_with("teardown") => fig(td, 9, 10),
                        _ => fig(1.0, 0, 0),
                    };
                    (s, v)
                })
                .collect::<Vec<_>>()
        };
        let t = Table {
            rows: vec![
                (("a", "L1"), row(100.0, 10.0, 30.0, 99.0)),
                (("b", "L1"), row(200.0, 50.0, 75.0, 150.0)),
            ],
            guest_ram_pages: 1,
        };
        assert_eq!(t.sidecore_teardown_over_off(), Some(0.75));
        assert_eq!(t.sidecore_over_samecore_strict(), Some(1.5));
        assert_eq!(t.teardown_hit_rate(), Some(0.9));
        let j = t.to_json(5);
        assert_eq!(j["sidecore_over_samecore_strict"], json!(1.5));
        assert_eq!(
            j["by_rung"]["L1"]["sidecore_over_samecore_strict"],
            json!(1.5)
        );
        assert_eq!(j["workloads"]["a"]["L1"]["off"]["over_off"], json!(1.0));
        assert_eq!(
            j["workloads"]["b"]["L1"]["samecore/strict"]["ops_per_s"],
            json!(50.0)
        );
        assert!(t.svg().starts_with("<svg"));
    }

    #[test]
    fn a_failed_cell_leaves_the_goal_unknown() {
        let mut row: Vec<(Setup, Cell)> =
            setups().into_iter().map(|s| (s, fig(1.0, 0, 0))).collect();
        row[1].1 = Err("boom".into());
        let t = Table {
            rows: vec![(("a", "L1"), row)],
            guest_ram_pages: 1,
        };
        assert_eq!(t.sidecore_over_samecore_strict(), None);
        assert_eq!(t.teardown_hit_rate(), None);
    }
}
