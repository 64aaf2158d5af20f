//! The registry in the Prometheus text exposition format (version 0.0.4), for `GET /metrics`
//! and `lucid run --stats-prom`.
//!
//! Each dotted name becomes one metric: `lucid_` followed by the name with every character
//! outside `[a-zA-Z0-9_:]` replaced by `_` (so `vcpu0.exit.io_out` is `lucid_vcpu0_exit_io_out`).
//! Its `# HELP` line gives the dotted name. A counter gets Prometheus's `_total` suffix; two
//! names that still collide after all this get `_2`, `_3`.. in name order, so every family is
//! unique.
//!
//! The registry does not record which values are counters and which are gauges, so the kind
//! comes from the name ([`is_gauge`]): a value that can go down is a gauge when any word of its
//! name (split at `.` and `_`) is one of [`GAUGE_WORDS`], it ends in one of
//! [`GAUGE_NAMES`], or it lies under a `stats.` group (the balloon's guest-reported figures);
//! everything else only ever grows and is a counter.

use std::collections::{BTreeMap, HashSet};
use std::fmt::Write;

/// Words that make a name a gauge: extremes (`max`, `peak`), present values (`current`, `now`,
/// `last`, `usage`, `actual`, `target`), settings and states (`limit`, `mode`, `rung`, `label`,
/// `burst`, `offered`, `effective`, `noise`, `boosted`, `at`), sizes
/// (`capacity`, `cached`, `mapped`, `vmas`, `metadata`, `unwritten`, `resident`) and ratios (`per`, `rate`).
pub const GAUGE_WORDS: &[&str] = &[
    "actual",
    "at",
    "boosted",
    "burst",
    "cached",
    "capacity",
    "current",
    "effective",
    "label",
    "last",
    "limit",
    "mapped",
    "max",
    "metadata",
    "min",
    "mode",
    "noise",
    "nonresident",
    "now",
    "offered",
    "peak",
    "per",
    "rate",
    "resident",
    "rung",
    "target",
    "unwritten",
    "usage",
    "vmas",
];

/// Present values and settings, matched against the end of a name (whole dotted parts), whose
/// words alone would read as counters (unlike KVM's cumulative `halt_poll_*_ns` and
/// `*_window_exits`, or memory.stat's `memcg.pgfault`).
pub const GAUGE_NAMES: &[&str] = &[
    "halt_poll_ns",
    "window_ns",
    "ioeventfds_registered",
    "memcg.cache",
    "memcg.rss",
    "memcg.swap",
];

/// The prefix of every metric Lucid exports.
pub const PREFIX: &str = "lucid_";

/// Whether the registry value called `name` (dotted) is a gauge rather than a counter (the
/// rule is in the module's documentation).
pub fn is_gauge(name: &str) -> bool {
    // A rate limiter's group (`blk0.rate_limited.`) names a device's state, not a rate: only
    // the name under it tells.
    let name = name.rsplit_once(".rate_limited.").map_or(name, |(_, n)| n);
    let under_stats = name.starts_with("stats.") || name.contains(".stats.");
    under_stats
        || GAUGE_NAMES.iter().any(|g| {
            name.strip_suffix(g)
                .is_some_and(|head| head.is_empty() || head.ends_with('.'))
        })
        || name.split(['.', '_']).any(|w| GAUGE_WORDS.contains(&w))
}

/// `lucid_` and `name` with every character outside `[a-zA-Z0-9_:]` replaced by `_`: a valid
/// Prometheus metric name (`[a-zA-Z_:][a-zA-Z0-9_:]*`) whatever `name` holds.
pub fn metric_name(name: &str) -> String {
    let mut out = String::with_capacity(PREFIX.len() + name.len());
    out.push_str(PREFIX);
    out.extend(name.chars().map(
        |c| match c.is_ascii_alphanumeric() || c == '_' || c == ':' {
            true => c,
            false => '_',
        },
    ));
    out
}

/// `counters` (dotted name to value, as [`crate::StatsRegistry::snapshot`] and a run report
/// hold them) in the Prometheus text exposition format: for each, in name order, a `# HELP`
/// line, a `# TYPE` line (`counter` or `gauge`) and the sample.
pub fn prometheus_text(counters: &BTreeMap<String, u64>) -> String {
    let mut out = String::new();
    let mut used = HashSet::new();
    for (name, value) in counters {
        let gauge = is_gauge(name);
        let mut base = metric_name(name);
        if !gauge && !base.ends_with("_total") {
            base.push_str("_total");
        }
        let mut metric = base.clone();
        let mut n = 2;
        while !used.insert(metric.clone()) {
            metric = format!("{base}_{n}");
            n += 1;
        }
        let kind = if gauge { "gauge" } else { "counter" };
        // HELP text escapes only backslash and newline.
        let help = name.replace('\\', "\\\\").replace('\n', "\\n");
        let _ = writeln!(out, "# HELP {metric} Lucid {kind} {help}");
        let _ = writeln!(out, "# TYPE {metric} {kind}");
        let _ = writeln!(out, "{metric} {value}");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn valid(name: &str) -> bool {
        let mut c = name.chars();
        c.next()
            .is_some_and(|f| f.is_ascii_alphabetic() || f == '_' || f == ':')
            && c.all(|x| x.is_ascii_alphanumeric() || x == '_' || x == ':')
    }

    #[test]
    fn names_are_sanitised_and_prefixed() {
        assert_eq!(metric_name("vcpu0.exit.io_out"), "lucid_vcpu0_exit_io_out");
        assert_eq!(metric_name("0bad-name é/x"), "lucid_0bad_name___x");
        for n in [
            "",
            "0",
            ".",
            "a.b-c",
            "monitor.thread.lucid-vcpu0.cpu_ns",
            "ü\n\\",
        ] {
            assert!(valid(&metric_name(n)), "{n:?} -> {}", metric_name(n));
        }
    }

    #[test]
    fn gauges_are_told_from_counters_by_name() {
        for g in [
            "iommu.pinned.current",
            "iommu.stale.max",
            "iommu.window_max_us",
            "pools.current",
            "pools.halt_poll_ns",
            "net0.rung",
            "balloon.target_pages",
            "balloon.stats.free_memory",
            "swap.limit_bytes",
            "monitor.last.bytes",
            "monitor.guest_to_backend_us_per_mb",
            "net0.sink.rate_bytes_per_s",
            "net0.sink.window_ns",
            "blk0.notify.ioeventfds_registered",
            "swap.host.memcg.rss",
            "memcg.swap",
            "swap.host.vmm_text_nonresident",
            "blk0.rate_limited.bw_bytes_per_s",
            "net0.rate_limited.ops_capacity",
        ] {
            assert!(is_gauge(g), "{g} is a gauge");
        }
        for c in [
            "vcpu0.exit.io_out",
            "vcpu0.exits",
            "serial.tx_bytes",
            "blk0.requests",
            "iommu.iotlb.misses",
            "balloon.stats_updates",
            "dma.bytes_read",
            "kvm.vcpu0.halt_poll_success_ns",
            "monitor.windows",
            "kvm.vcpu0.irq_window_exits",
            "swap.host.memcg.pgfault",
            "swap.host.memcg.pgswap",
            "net0.sink.xwindow_ns",
            "blk0.notify.ioeventfd_failed",
            "blk0.rate_limited.throttled_events",
            "rng.rate_limited.bytes_deferred",
        ] {
            assert!(!is_gauge(c), "{c} is a counter");
        }
    }

    #[test]
    fn text_has_help_type_and_a_sample_per_value() {
        let m: BTreeMap<String, u64> = [
            ("vcpu0.exit.io_out".to_string(), 42),
            ("iommu.stale.max".to_string(), 3),
        ]
        .into();
        let text = prometheus_text(&m);
        assert_eq!(
            text,
            "# HELP lucid_iommu_stale_max Lucid gauge iommu.stale.max\n\
             # TYPE lucid_iommu_stale_max gauge\n\
             lucid_iommu_stale_max 3\n\
             # HELP lucid_vcpu0_exit_io_out_total Lucid counter vcpu0.exit.io_out\n\
             # TYPE lucid_vcpu0_exit_io_out_total counter\n\
             lucid_vcpu0_exit_io_out_total 42\n"
        );
        assert_eq!(prometheus_text(&BTreeMap::new()), "");
    }

    /// Names that sanitise alike stay separate families, and every line parses: a comment or
    /// `name value` with a valid name.
    #[test]
    fn collisions_get_suffixes_and_every_line_is_well_formed() {
        let m: BTreeMap<String, u64> = [
            ("a.b".to_string(), 1),
            ("a_b".to_string(), 2),
            ("a-b".to_string(), 3),
            ("odd\nname\\".to_string(), 4),
        ]
        .into();
        let text = prometheus_text(&m);
        let mut families = Vec::new();
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                families.push(rest.split(' ').next().unwrap().to_string());
                continue;
            }
            if line.starts_with("# HELP ") {
                continue;
            }
            let (name, value) = line.split_once(' ').expect("name value");
            assert!(valid(name), "{line}");
            value.parse::<u64>().expect("an integer value");
        }
        let unique: HashSet<&String> = families.iter().collect();
        assert_eq!(unique.len(), 4, "{text}");
        assert!(text.contains("lucid_a_b_total_2 "), "{text}");
        assert!(text.contains("Lucid counter odd\\nname\\\\\n"), "{text}");
    }
}
