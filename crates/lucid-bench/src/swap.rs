//! `lucid bench swap`: VSWAPPER's evaluation (the paper's Figs. 4.3, 4.9-4.11) in one
//! run, on one image and under the same limits: the `pagecache` guest believes it has
//! `--memory` while Lucid limits the host side (`--memory-limit`), with each configuration —
//! `baseline`, `mapper`, `vswapper`, `balloon` (baseline swapping plus a virtio-balloon the guest
//! drives, sized by Lucid's manager) and `balloon+vswapper` — on workloads (a) re-read a file
//! several times (`a`), (a) then allocate the memory that held its cache (`ab`), and (c)
//! compress the file's data (`c`), at two or three limits.
//!
//! Every run is a separate `lucid run` process (each in its own memory cgroup, its counters from
//! `--stats-json`); the image is dropped from the host page cache before each run. Figures per
//! run: the guest's own time for the workload (`seconds`), swap sectors written and read, major
//! faults and faults on Lucid's text (the host's `swap.host.*` deltas), the mapper's counters, and
//! per iteration (the guest calls `LUCID_HC_PHASE`; Lucid keeps `swap.phase.<n>.*`) the time and
//! swap traffic for Fig. 4.9-like plots (`--plot`).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::time::Duration;

use crate::field;
use serde_json::{json, Value};

#[derive(clap::Args)]
pub struct SwapArgs {
    #[arg(long)]
    json: bool,
    /// A smoke run: a 256 MiB guest, a 96 MiB file, one 64 MiB limit, two iterations.
    #[arg(long)]
    quick: bool,
    /// Guest memory (what the guest believes it has), MiB.
    #[arg(long, default_value_t = 512)]
    memory: u64,
    /// Host-side limits to measure at, MiB.
    #[arg(long, value_delimiter = ',', default_values_t = [128u64, 192])]
    limits: Vec<u64>,
    /// Size of the file the workloads read, MiB.
    #[arg(long, default_value_t = 200)]
    file_mib: u64,
    /// Iterations of the re-read workload (a); the compress workload (c) makes half as many.
    #[arg(long, default_value_t = 5)]
    iters: u64,
    /// Configurations (baseline, mapper, vswapper, balloon, balloon+vswapper; `ample` adds a run
    /// with no limit, the reference for overheads).
    #[arg(long, value_delimiter = ',', default_values_t = CONFIGS.iter().map(|s| s.to_string()))]
    configs: Vec<String>,
    /// Workloads: a (re-read), ab (re-read then allocate), c (compress).
    #[arg(long, value_delimiter = ',', default_values_t = ["a".to_string(), "ab".into(), "c".into()])]
    workloads: Vec<String>,
    /// Runs of each configuration; the median by time is reported.
    #[arg(long, default_value_t = 1)]
    runs: usize,
    /// Make (and remove at the end) a swap file of this many MiB in the temporary directory when
    /// the host has no swap.
    #[arg(long)]
    make_swap: Option<u64>,
    /// Write an SVG plot per iteration of workload (a) at the tightest limit (time and swap
    /// sectors written, like the paper's Fig. 4.9a/d) to this file.
    #[arg(long)]
    plot: Option<PathBuf>,
    /// `--blk` options after the image path (4 KiB blocks and no host caching, as the paper runs
    /// every configuration).
    #[arg(long, default_value = "block_size=4096,cache=none")]
    blk_opts: String,
    /// Seconds before a run is killed.
    #[arg(long, default_value_t = 900)]
    timeout: u64,
}

/// The paper's five configurations.
pub const CONFIGS: &[&str] = &[
    "baseline",
    "mapper",
    "vswapper",
    "balloon",
    "balloon+vswapper",
];

/// The `lucid run` flags of a configuration at `limit` MiB (None: no limit, `ample`).
fn config_flags(config: &str, memory: u64, limit: Option<u64>) -> Result<Vec<String>, String> {
    let mut v = Vec::new();
    let (mode, balloon) = match config {
        "ample" => return Ok(v),
        "baseline" => ("baseline", false),
        "mapper" => ("mapper", false),
        "vswapper" => ("vswapper", false),
        "balloon" => ("baseline", true),
        "balloon+vswapper" => ("vswapper", true),
        other => {
            return Err(format!(
                "unknown configuration {other:?}: expected one of {} or ample",
                CONFIGS.join(", ")
            ))
        }
    };
    if let Some(l) = limit {
        v.extend(["--memory-limit".to_string(), l.to_string()]);
    }
    v.extend(["--swap-mode".to_string(), mode.to_string()]);
    if balloon {
        // The initial target takes what the limit does not give; the manager then follows
        // the host's pressure.
        let size = limit.map_or(0, |l| memory.saturating_sub(l));
        v.extend([
            "--balloon".to_string(),
            format!("size={size},deflate_on_oom=on,manager=on"),
        ]);
    }
    Ok(v)
}

/// The guest command line of a workload.
fn workload_cmdline(w: &str, file_mib: u64, iters: u64, balloon: bool) -> Result<String, String> {
    let b = if balloon { " balloon=1" } else { "" };
    Ok(match w {
        "a" => format!("mode=reread mib={file_mib} iters={iters}{b}"),
        "ab" => format!("mode=alloc mib={file_mib}{b}"),
        "c" => format!(
            "mode=compress mib={} iters={}{b}",
            (file_mib / 2).max(1),
            (iters / 2).max(2)
        ),
        other => return Err(format!("unknown workload {other:?}: expected a, ab or c")),
    })
}

/// One iteration (phase) of a run.
#[derive(Clone, Debug, Default, serde::Serialize)]
struct Iteration {
    ms: u64,
    swap_write_sectors: u64,
    swap_read_sectors: u64,
    majflt: u64,
    vmm_text_faults: u64,
}

/// What one run gave.
#[derive(Clone, Debug, Default, serde::Serialize)]
struct RunResult {
    /// The guest's own time for the workload (sum of its iterations).
    seconds: f64,
    /// The process's wall time (boot and image included).
    wall_s: f64,
    swap_write_sectors: u64,
    swap_read_sectors: u64,
    majflt: u64,
    vmm_text_faults: u64,
    iterations: Vec<Iteration>,
    /// `swap.mapper.*`, `balloon.*` and `swap.host.*` counters as Lucid reported them.
    counters: BTreeMap<String, u64>,
}

fn counter(c: &BTreeMap<String, u64>, k: &str) -> u64 {
    c.get(k).copied().unwrap_or(0)
}

/// Drops `path`'s pages from the host page cache, so every run starts from the disk.
fn drop_cache(path: &Path) {
    if let Ok(f) = std::fs::File::open(path) {
        // SAFETY: fadvise on a valid open descriptor; it only drops clean cached pages.
        unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    }
}

struct Bench {
    exe: PathBuf,
    image: PathBuf,
    dir: PathBuf,
    memory: u64,
    blk_opts: String,
    timeout: Duration,
}

impl Bench {
    fn run_once(&self, flags: &[String], cmdline: &str) -> Result<RunResult, String> {
        drop_cache(&self.image);
        let stats = self.dir.join("stats.json");
        let _ = std::fs::remove_file(&stats);
        let mut cmd = Command::new(&self.exe);
        cmd.args(["--quiet", "run", "--guest", "pagecache", "--memory"])
            .arg(self.memory.to_string())
            .arg("--blk")
            .arg(format!("path={},{}", self.image.display(), self.blk_opts))
            .args(flags)
            .args(["--cmdline", cmdline])
            .arg("--stats-json")
            .arg(&stats)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let what = format!("lucid run {} --cmdline {cmdline:?}", flags.join(" "));
        let child = cmd.spawn().map_err(|e| format!("{what}: {e}"))?;
        let out = wait_timeout(child, self.timeout).map_err(|e| format!("{what}: {e}"))?;
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        if !text.lines().any(|l| l == "PASS") {
            let err = String::from_utf8_lossy(&out.stderr);
            let fail = text
                .lines()
                .filter(|l| l.starts_with("FAIL") || l.starts_with("MISMATCH"))
                .collect::<Vec<_>>()
                .join("; ");
            return Err(format!(
                "{what}: the guest did not pass ({}): {fail} {}",
                out.status,
                err.lines().last().unwrap_or("")
            ));
        }
        let json: Value = std::fs::read_to_string(&stats)
            .ok()
            .and_then(|s| serde_json::from_str(&s).ok())
            .ok_or(format!("{what}: no --stats-json written"))?;
        let all = lucid_stats::flatten(&json["counters"]);
        let iters: Vec<(u64, u64)> = text
            .lines()
            .filter(|l| l.starts_with("pagecache iter="))
            .filter_map(|l| Some((field(l, "pagecache", "iter")?, field(l, "pagecache", "ms")?)))
            .collect();
        let iterations = iters
            .iter()
            .map(|&(n, ms)| {
                let p = |k: &str| counter(&all, &format!("swap.phase.{n}.{k}"));
                Iteration {
                    ms,
                    swap_write_sectors: p("swap_write_sectors"),
                    swap_read_sectors: p("swap_read_sectors"),
                    majflt: p("majflt"),
                    vmm_text_faults: p("vmm_text_faults"),
                }
            })
            .collect::<Vec<_>>();
        let counters = all
            .iter()
            .filter(|(k, _)| {
                (k.starts_with("swap.") && !k.starts_with("swap.phase."))
                    || k.starts_with("balloon.")
            })
            .map(|(k, v)| (k.clone(), *v))
            .collect();
        Ok(RunResult {
            seconds: iterations.iter().map(|i| i.ms).sum::<u64>() as f64 / 1e3,
            wall_s: json["wall_s"].as_f64().unwrap_or(0.0),
            swap_write_sectors: counter(&all, "swap.host.swap_write_sectors"),
            swap_read_sectors: counter(&all, "swap.host.swap_read_sectors"),
            majflt: all
                .get("swap.host.pgmajfault")
                .or(all.get("swap.host.majflt"))
                .copied()
                .unwrap_or(0),
            vmm_text_faults: counter(&all, "swap.host.vmm_text_faults"),
            iterations,
            counters,
        })
    }

    /// `runs` runs; the median by time.
    fn run(&self, flags: &[String], cmdline: &str, runs: usize) -> Result<RunResult, String> {
        let v = (0..runs.max(1))
            .map(|_| self.run_once(flags, cmdline))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(
            lucid_stats::into_median_by(v, |a, b| a.seconds.total_cmp(&b.seconds))
                .expect("runs >= 1"),
        )
    }
}

fn wait_timeout(
    mut child: std::process::Child,
    limit: Duration,
) -> Result<std::process::Output, String> {
    let start = std::time::Instant::now();
    let stdout = child.stdout.take();
    let stderr = child.stderr.take();
    let read = |p: Option<std::process::ChildStdout>| {
        std::thread::spawn(move || {
            let mut s = Vec::new();
            if let Some(mut p) = p {
                let _ = std::io::Read::read_to_end(&mut p, &mut s);
            }
            s
        })
    };
    let t_out = read(stdout);
    let t_err = std::thread::spawn(move || {
        let mut s = Vec::new();
        if let Some(mut p) = stderr {
            let _ = std::io::Read::read_to_end(&mut p, &mut s);
        }
        s
    });
    let status = loop {
        if let Some(s) = child.try_wait().map_err(|e| e.to_string())? {
            break s;
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            return Err(format!("killed after {} s", limit.as_secs()));
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    Ok(std::process::Output {
        status,
        stdout: t_out.join().unwrap_or_default(),
        stderr: t_err.join().unwrap_or_default(),
    })
}

/// A swap file made for the bench (`--make-swap`): swapoff and removed on drop.
struct TempSwap(PathBuf);

impl TempSwap {
    fn create(dir: &Path, mib: u64) -> Result<TempSwap, String> {
        let p = dir.join("swapfile");
        let run = |c: &mut Command| -> Result<(), String> {
            let o = c.output().map_err(|e| format!("{c:?}: {e}"))?;
            if o.status.success() {
                Ok(())
            } else {
                Err(format!("{c:?}: {}", String::from_utf8_lossy(&o.stderr)))
            }
        };
        run(Command::new("fallocate")
            .arg("-l")
            .arg(format!("{mib}M"))
            .arg(&p))?;
        let swap = TempSwap(p.clone());
        std::fs::set_permissions(&p, std::os::unix::fs::PermissionsExt::from_mode(0o600))
            .map_err(|e| e.to_string())?;
        run(Command::new("mkswap").arg(&p))?;
        run(Command::new("swapon").arg(&p))?;
        Ok(swap)
    }
}

impl Drop for TempSwap {
    fn drop(&mut self) {
        let _ = Command::new("swapoff").arg(&self.0).status();
        let _ = std::fs::remove_file(&self.0);
    }
}

fn host_has_swap() -> bool {
    std::fs::read_to_string("/proc/swaps").is_ok_and(|s| s.lines().count() > 1)
}

/// Results: workload -> limit label -> configuration -> run.
type Results = BTreeMap<String, BTreeMap<String, BTreeMap<String, Result<RunResult, String>>>>;

fn limit_label(l: Option<u64>) -> String {
    l.map_or("none".into(), |l| format!("limit_{l}"))
}

fn get<'a>(r: &'a Results, w: &str, l: &str, c: &str) -> Option<&'a RunResult> {
    r.get(w)?.get(l)?.get(c)?.as_ref().ok()
}

fn ratio(a: f64, b: f64) -> Option<f64> {
    (b > 0.0).then(|| a / b)
}

pub fn run(args: SwapArgs) -> Result<ExitCode, String> {
    let (memory, limits, file_mib, iters) = if args.quick {
        (256, vec![64], 96, 2)
    } else {
        (args.memory, args.limits.clone(), args.file_mib, args.iters)
    };
    for c in &args.configs {
        config_flags(c, memory, None)?;
    }
    for w in &args.workloads {
        workload_cmdline(w, file_mib, iters, false)?;
    }
    // The guest's cache starts at 32 MiB; the file must fit what it believes it has.
    if memory < file_mib + 48 {
        return Err(format!(
            "--memory {memory} MiB is too small for a {file_mib} MiB file: give at least {}",
            file_mib + 48
        ));
    }
    let dir = std::env::temp_dir().join(format!("lucid-bench-swap-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let _swap = match args.make_swap {
        Some(mib) if !host_has_swap() => Some(TempSwap::create(&dir, mib)?),
        _ => None,
    };
    if !host_has_swap() && args.configs.iter().any(|c| c != "ample") {
        let _ = std::fs::remove_dir_all(&dir);
        return Err(
            "the host has no swap: the limits need it as the backstop. Add a swap file \
             (fallocate -l 2G /swapfile && chmod 600 /swapfile && mkswap /swapfile && swapon \
             /swapfile) or pass --make-swap 2048"
                .into(),
        );
    }
    let image = dir.join("disk.img");
    lucid_guests::pagecache::make_image(
        &image,
        file_mib * 256,
        0,
        lucid_guests::pagecache::DEFAULT_SEED,
    )
    .map_err(|e| format!("{}: {e}", image.display()))?;
    let bench = Bench {
        exe: std::env::current_exe().map_err(|e| e.to_string())?,
        image: image.clone(),
        dir: dir.clone(),
        memory,
        blk_opts: args.blk_opts.clone(),
        timeout: Duration::from_secs(args.timeout),
    };
    let mut results: Results = BTreeMap::new();
    for w in &args.workloads {
        for c in &args.configs {
            let lims: Vec<Option<u64>> = if c == "ample" {
                vec![None]
            } else {
                limits.iter().map(|&l| Some(l)).collect()
            };
            for l in lims {
                let flags = config_flags(c, memory, l)?;
                let cmdline = workload_cmdline(w, file_mib, iters, c.starts_with("balloon"))?;
                let r = bench.run(&flags, &cmdline, args.runs);
                if !args.json {
                    match &r {
                        Ok(x) => eprintln!(
                            "{w:<3} {:<10} {c:<17} {:8.2} s  swap writes {:>9}  reads {:>9}  \
                             majflt {:>7}  per iteration ms {:?}",
                            limit_label(l),
                            x.seconds,
                            x.swap_write_sectors,
                            x.swap_read_sectors,
                            x.majflt,
                            x.iterations.iter().map(|i| i.ms).collect::<Vec<_>>()
                        ),
                        Err(e) => eprintln!("{w:<3} {:<10} {c:<17} failed: {e}", limit_label(l)),
                    }
                }
                results
                    .entry(w.clone())
                    .or_default()
                    .entry(limit_label(l))
                    .or_default()
                    .insert(c.clone(), r);
            }
        }
    }
    let _ = std::fs::remove_file(&image);

    // Headline figures: workload (a) at the tightest limit.
    let tight = limits.iter().min().map(|&l| limit_label(Some(l)));
    let head = |c: &str| tight.as_deref().and_then(|l| get(&results, "a", l, c));
    let (base, mapper, vsw, balloon) = (
        head("baseline"),
        head("mapper"),
        head("vswapper"),
        head("balloon"),
    );
    let mapper_writes = base.zip(mapper).and_then(|(b, m)| {
        ratio(
            m.swap_write_sectors as f64,
            b.swap_write_sectors.max(1) as f64,
        )
    });
    let speedup = base.zip(vsw).and_then(|(b, v)| ratio(b.seconds, v.seconds));
    let over_balloon = vsw
        .zip(balloon)
        .and_then(|(v, b)| ratio(v.seconds, b.seconds));

    let mut by_workload = serde_json::Map::new();
    for (w, per_limit) in &results {
        let mut lm = serde_json::Map::new();
        for (l, per_config) in per_limit {
            let mut cm = serde_json::Map::new();
            for (c, r) in per_config {
                cm.insert(
                    c.clone(),
                    match r {
                        Ok(x) => serde_json::to_value(x).expect("plain data"),
                        Err(e) => json!({ "error": e }),
                    },
                );
            }
            lm.insert(l.clone(), Value::Object(cm));
        }
        by_workload.insert(w.clone(), Value::Object(lm));
    }
    let summary = json!({
        "memory_mib": memory,
        "file_mib": file_mib,
        "iters": iters,
        "limits_mib": limits,
        "runs": args.runs,
        "headline_limit": tight,
        "workloads": by_workload,
        "mapper_swap_writes_over_baseline": mapper_writes,
        "vswapper_speedup_over_baseline": speedup,
        "vswapper_over_balloon": over_balloon,
        "goals": {
            "mapper_swap_writes_over_baseline_max": 0.05,
            "vswapper_speedup_over_baseline_min": 5.0,
            "vswapper_over_balloon_max": 1.3,
        },
    });
    if let Some(p) = &args.plot {
        if let Some(l) = &tight {
            std::fs::write(p, svg_plot(&results, l, &args.configs))
                .map_err(|e| format!("{}: {e}", p.display()))?;
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    if args.json {
        println!("{summary}");
    } else {
        let f = |x: Option<f64>| x.map_or("n/a".into(), |x| format!("{x:.3}"));
        println!(
            "lucid bench swap: guest {memory} MiB, file {file_mib} MiB, limits {limits:?} MiB"
        );
        for (w, per_limit) in &results {
            for (l, per_config) in per_limit {
                for (c, r) in per_config {
                    match r {
                        Ok(x) => println!(
                            "  {w:<3} {l:<10} {c:<17} {:8.2} s  swap w {:>9}  r {:>9}  majflt {:>7}  text {:>5}",
                            x.seconds, x.swap_write_sectors, x.swap_read_sectors, x.majflt,
                            x.vmm_text_faults
                        ),
                        Err(e) => println!("  {w:<3} {l:<10} {c:<17} failed: {e}"),
                    }
                }
            }
        }
        println!(
            "  (a) at {}: mapper swap writes / baseline = {} (goal <= 0.05); vswapper speed-up \
             over baseline = {} (goal >= 5); vswapper / balloon time = {} (goal <= 1.3)",
            tight.as_deref().unwrap_or("-"),
            f(mapper_writes),
            f(speedup),
            f(over_balloon)
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// Two panels per iteration of workload (a) at `limit`: the guest's time (Fig. 4.9a) and swap
/// sectors written (Fig. 4.9d), a line per configuration.
fn svg_plot(results: &Results, limit: &str, configs: &[String]) -> String {
    let (w, h) = (900.0, 560.0);
    let mut s = crate::svg_start(
        w,
        h,
        11,
        &format!(
            "lucid bench swap: workload (a), re-reading a file, {limit}: per iteration time (top) \
             and swap sectors written (bottom)"
        ),
    );
    let colors = [
        "#d0542c", "#4a7fb5", "#2f9e44", "#999999", "#7b3fb5", "#444444",
    ];
    // (configuration, its colour by position in `configs`, its run)
    let runs: Vec<(&String, usize, &RunResult)> = configs
        .iter()
        .enumerate()
        .filter_map(|(k, c)| Some((c, k, get(results, "a", limit, c)?)))
        .collect();
    let n = runs
        .iter()
        .map(|(_, _, r)| r.iterations.len())
        .max()
        .unwrap_or(0)
        .max(1);
    type Panel = (&'static str, fn(&Iteration) -> f64);
    let panels: [Panel; 2] = [
        ("seconds", |i| i.ms as f64 / 1e3),
        ("swap sectors written", |i| i.swap_write_sectors as f64),
    ];
    for (p, (name, get_v)) in panels.iter().enumerate() {
        let (top, bottom) = (50.0 + p as f64 * 250.0, 250.0 + p as f64 * 250.0);
        let (left, right) = (70.0, w - 170.0);
        let max = runs
            .iter()
            .flat_map(|(_, _, r)| r.iterations.iter().map(get_v))
            .fold(0.0, f64::max)
            .max(1e-9);
        let x = |i: usize| left + (right - left) * (i as f64 + 0.5) / n as f64;
        let y = |v: f64| bottom - (v / max) * (bottom - top);
        let _ = writeln!(
            s,
            r##"<line x1="{left}" x2="{right}" y1="{bottom}" y2="{bottom}" stroke="#000"/><line x1="{left}" x2="{left}" y1="{top}" y2="{bottom}" stroke="#000"/><text x="{left}" y="{}">{name} (max {max:.3e})</text>"##,
            top - 6.0
        );
        for i in 0..n {
            let _ = writeln!(
                s,
                r#"<text x="{}" y="{}">{}</text>"#,
                x(i) - 3.0,
                bottom + 14.0,
                i + 1
            );
        }
        for (c, k, r) in &runs {
            let color = colors[k % colors.len()];
            let pts: Vec<String> = r
                .iterations
                .iter()
                .enumerate()
                .map(|(i, it)| format!("{:.1},{:.1}", x(i), y(get_v(it))))
                .collect();
            let _ = writeln!(
                s,
                r#"<polyline fill="none" stroke="{color}" stroke-width="2" points="{}"/>"#,
                pts.join(" ")
            );
            if p == 0 {
                let _ = writeln!(
                    s,
                    r#"<text x="{}" y="{}" fill="{color}">{c}</text>"#,
                    right + 15.0,
                    top + 16.0 * (*k as f64 + 1.0)
                );
            }
        }
    }
    let _ = writeln!(s, r#"<text x="70" y="{}">iteration</text>"#, h - 12.0);
    s.push_str("</svg>\n");
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn configurations_map_to_the_contract_flags() {
        assert_eq!(
            config_flags("mapper", 512, Some(128)).unwrap(),
            ["--memory-limit", "128", "--swap-mode", "mapper"]
        );
        assert_eq!(
            config_flags("balloon+vswapper", 512, Some(128)).unwrap(),
            [
                "--memory-limit",
                "128",
                "--swap-mode",
                "vswapper",
                "--balloon",
                "size=384,deflate_on_oom=on,manager=on"
            ]
        );
        assert!(config_flags("ample", 512, None).unwrap().is_empty());
        assert!(config_flags("nope", 512, None).is_err());
        assert!(workload_cmdline("ab", 200, 5, true)
            .unwrap()
            .ends_with("balloon=1"));
        assert!(workload_cmdline("x", 200, 5, false).is_err());
    }
}
