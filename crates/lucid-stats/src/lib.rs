//! One stats registry per VM: every mechanism (exits, devices, DMA, swap, upcalls) registers named
//! counters here, next to the code that counts, and the registry prints them at VM exit, as JSON
//! and in the Prometheus text format ([`prometheus`]).
//!
//! Counters are lock-free atomics handed out as `Arc<Counter>`; the registry's lock is taken only to
//! register or to read, never on the hot path.
//!
//! Beside the registry, two small things the crates that count share: [`median`] (the figure the
//! probe and the benchmarks report) and [`cgroup`] (where the cgroup hierarchies are mounted,
//! for the pools' cpuset and VSWAPPER's memory controller).

#![warn(clippy::print_stdout, clippy::print_stderr)]

pub mod cgroup;
mod median;
pub mod prometheus;
mod threads;

pub use median::{into_median_by, median, median_by};
pub use prometheus::prometheus_text;
pub use threads::{ThreadGuard, ThreadInfo, ThreadRegistry, ThreadRole};

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// A monotonically increasing (or settable gauge) 64-bit count.
#[derive(Debug, Default)]
pub struct Counter(AtomicU64);

impl Counter {
    pub fn inc(&self) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }
    pub fn add(&self, n: u64) {
        self.0.fetch_add(n, Ordering::Relaxed);
    }
    pub fn set(&self, n: u64) {
        self.0.store(n, Ordering::Relaxed);
    }
    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// A value read when the registry is read (for example KVM's binary statistics).
pub type Probe = Box<dyn Fn() -> Vec<(String, u64)> + Send + Sync>;

/// Named counters, grouped by dotted names such as `vcpu0.exit.io_out` or `serial.tx_bytes`.
#[derive(Default)]
pub struct StatsRegistry {
    counters: Mutex<BTreeMap<String, Arc<Counter>>>,
    probes: Mutex<Vec<(String, Probe)>>,
    /// The VM's threads: kept here because everything that counts for a VM already holds its
    /// registry, so threads register where they start without more plumbing.
    threads: Arc<ThreadRegistry>,
}

impl StatsRegistry {
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    /// Returns the counter registered under `name`, creating it at zero if it is new, so that two
    /// parts of the VMM naming the same counter share it.
    pub fn counter(&self, name: impl Into<String>) -> Arc<Counter> {
        let mut map = self.counters.lock().unwrap_or_else(|e| e.into_inner());
        map.entry(name.into()).or_default().clone()
    }

    /// The VM's thread list (vCPUs and device back-ends register themselves when they start).
    pub fn threads(&self) -> &Arc<ThreadRegistry> {
        &self.threads
    }

    /// Registers a probe whose values are read, under `prefix.`, on every snapshot.
    pub fn probe(&self, prefix: impl Into<String>, probe: Probe) {
        let mut probes = self.probes.lock().unwrap_or_else(|e| e.into_inner());
        probes.push((prefix.into(), probe));
    }

    /// All counters and probe values, sorted by name.
    pub fn snapshot(&self) -> BTreeMap<String, u64> {
        // Probes first: a probe may fold what it read into a counter.
        let probed: Vec<(String, u64)> = self
            .probes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .flat_map(|(prefix, probe)| {
                probe()
                    .into_iter()
                    .map(move |(name, value)| (format!("{prefix}.{name}"), value))
            })
            .collect();
        let mut out: BTreeMap<String, u64> = self
            .counters
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .map(|(k, v)| (k.clone(), v.get()))
            .collect();
        out.extend(probed);
        out
    }

    /// The sum of every counter whose name matches `prefix*suffix`, e.g. all vCPUs' `exit.io_out`.
    pub fn sum(&self, prefix: &str, suffix: &str) -> u64 {
        self.snapshot()
            .iter()
            .filter(|(k, _)| k.starts_with(prefix) && k.ends_with(suffix))
            .map(|(_, v)| *v)
            .sum()
    }

    /// Every counter and probe value in the Prometheus text exposition format (`GET /metrics`;
    /// names, kinds and the gauge rule: [`prometheus`]).
    pub fn to_prometheus(&self) -> String {
        prometheus_text(&self.snapshot())
    }

    /// Nested JSON: `a.b.c = 1` becomes `{"a":{"b":{"c":1}}}`.
    pub fn to_json(&self) -> serde_json::Value {
        nest(&self.snapshot())
    }
}

/// Turns dotted names into nested JSON objects. A name that is both a leaf and a prefix keeps the
/// leaf under the key `total`.
pub fn nest(flat: &BTreeMap<String, u64>) -> serde_json::Value {
    use serde_json::{Map, Value};
    let mut root = Map::new();
    for (name, value) in flat {
        let mut node = &mut root;
        let parts: Vec<&str> = name.split('.').collect();
        for part in &parts[..parts.len() - 1] {
            let entry = node
                .entry(part.to_string())
                .or_insert_with(|| Value::Object(Map::new()));
            if !entry.is_object() {
                let leaf = entry.take();
                let mut m = Map::new();
                m.insert("total".into(), leaf);
                *entry = Value::Object(m);
            }
            node = entry.as_object_mut().expect("made an object above");
        }
        let last = parts[parts.len() - 1].to_string();
        match node.get_mut(&last) {
            Some(Value::Object(m)) => {
                m.insert("total".into(), Value::from(*value));
            }
            _ => {
                node.insert(last, Value::from(*value));
            }
        }
    }
    Value::Object(root)
}

/// The inverse of [`nest`]: nested JSON counters (as in `--stats-json`) back to dotted names; a
/// `total` key stands for its parent's own value. Non-integer leaves are skipped.
pub fn flatten(v: &serde_json::Value) -> BTreeMap<String, u64> {
    fn walk(v: &serde_json::Value, prefix: &str, out: &mut BTreeMap<String, u64>) {
        match v {
            serde_json::Value::Object(m) => {
                for (k, x) in m {
                    let name = if k == "total" {
                        prefix.to_string()
                    } else if prefix.is_empty() {
                        k.clone()
                    } else {
                        format!("{prefix}.{k}")
                    };
                    walk(x, &name, out);
                }
            }
            serde_json::Value::Number(n) => {
                if let Some(x) = n.as_u64() {
                    out.insert(prefix.to_string(), x);
                }
            }
            _ => {}
        }
    }
    let mut out = BTreeMap::new();
    walk(v, "", &mut out);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_name_shares_counter() {
        let r = StatsRegistry::new();
        r.counter("vcpu0.exit.io").inc();
        r.counter("vcpu0.exit.io").add(2);
        r.counter("vcpu1.exit.io").inc();
        assert_eq!(r.snapshot()["vcpu0.exit.io"], 3);
        assert_eq!(r.sum("vcpu", ".exit.io"), 4);
    }

    #[test]
    fn json_nests_and_keeps_leaf_prefixes() {
        let r = StatsRegistry::new();
        r.counter("a.b").set(1);
        r.counter("a.b.c").set(2);
        r.probe("kvm", Box::new(|| vec![("x".into(), 7)]));
        let j = r.to_json();
        assert_eq!(j["a"]["b"]["total"], 1);
        assert_eq!(j["a"]["b"]["c"], 2);
        assert_eq!(j["kvm"]["x"], 7);
    }

    #[test]
    fn nested_counters_flatten_back() {
        let v = serde_json::json!({"swap": {"host": {"swap_write_sectors": 8}, "phase": {"1": {"ms": 5}}},
                       "blk0": {"requests": {"total": 3, "x": 1}}});
        let m = flatten(&v);
        assert_eq!(m["swap.host.swap_write_sectors"], 8);
        assert_eq!(m["swap.phase.1.ms"], 5);
        assert_eq!(m["blk0.requests"], 3);
        assert_eq!(m["blk0.requests.x"], 1);
        assert_eq!(flatten(&nest(&m)), m);
    }
}
