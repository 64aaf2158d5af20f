//! What a run did: why it stopped, how long it took, and every counter, printed for a person at
//! VM exit and written as JSON.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::Duration;

use lucid_devices::StopReason;
use serde_json::json;

/// An error and its sources on one line: `what failed: why: deeper why`. A source whose text
/// its parent already shows (errors that print their source themselves) is not repeated.
pub fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut next = e.source();
    while let Some(src) = next {
        let s = src.to_string();
        if !text.contains(&s) {
            text.push_str(": ");
            text.push_str(&s);
        }
        next = src.source();
    }
    text
}

/// One virtio device's work in a run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceCounts {
    pub name: String,
    pub requests: u64,
    pub irqs: u64,
}

pub struct RunReport {
    pub stop: StopReason,
    pub wall: Duration,
    pub vcpus: u8,
    pub counters: BTreeMap<String, u64>,
}

impl RunReport {
    pub fn exit_code(&self) -> i32 {
        self.stop.exit_code()
    }

    /// Exits by reason summed over vCPUs.
    pub fn exits_by_reason(&self) -> BTreeMap<String, u64> {
        self.per_vcpu_by_name("exit")
    }

    /// The non-zero counters `vcpuN.<group>.<name>`, summed over vCPUs, by name.
    fn per_vcpu_by_name(&self, group: &str) -> BTreeMap<String, u64> {
        let infix = format!(".{group}.");
        let mut out = BTreeMap::new();
        for (k, v) in &self.counters {
            if let Some((_, name)) = k.split_once(&infix) {
                if k.starts_with("vcpu") && *v > 0 {
                    *out.entry(name.to_string()).or_insert(0) += v;
                }
            }
        }
        out
    }

    fn sum_suffix(&self, suffix: &str) -> u64 {
        self.counters
            .iter()
            .filter(|(k, _)| k.starts_with("vcpu") && k.ends_with(suffix))
            .map(|(_, v)| v)
            .sum()
    }

    /// Instructions Lucid completed for KVM's emulator (`vcpuN.emulated.<mnemonic>`), summed
    /// over vCPUs.
    pub fn emulated_by_mnemonic(&self) -> BTreeMap<String, u64> {
        self.per_vcpu_by_name("emulated")
    }

    pub fn total_exits(&self) -> u64 {
        self.sum_suffix(".exits")
    }

    /// Exits KVM itself counted on every vCPU (its binary statistics), userspace or not.
    pub fn kvm_exits(&self) -> u64 {
        self.counters
            .iter()
            .filter(|(k, _)| k.starts_with("kvm.vcpu") && k.ends_with(".exits"))
            .map(|(_, v)| v)
            .sum()
    }

    /// Each virtio device's completed requests (`<dev>.requests`) and the interrupts it sent
    /// by any path (`<dev>.irq.msi_signal`, `.irqfd`, `.intx`).
    pub fn devices(&self) -> Vec<DeviceCounts> {
        self.counters
            .iter()
            .filter_map(|(k, v)| {
                let dev = k.strip_suffix(".requests")?;
                // `api.requests` counts the control API's requests: not a device's.
                (!dev.contains('.') && dev != "api").then(|| DeviceCounts {
                    name: dev.to_string(),
                    requests: *v,
                    irqs: ["irq.msi_signal", "irq.irqfd", "irq.intx"]
                        .iter()
                        .filter_map(|i| self.counters.get(&format!("{dev}.{i}")))
                        .sum(),
                })
            })
            .collect()
    }

    /// Each vhost-user device's connection and set-up (`vhost_user.<dev>.*`).
    fn vhost_user_lines(&self) -> Vec<String> {
        self.counters
            .keys()
            .filter_map(|k| k.strip_prefix("vhost_user.")?.strip_suffix(".connected"))
            .map(|dev| {
                let c = |n: &str| {
                    self.counters
                        .get(&format!("vhost_user.{dev}.{n}"))
                        .copied()
                        .unwrap_or(0)
                };
                format!(
                    "vhost-user {dev}: {}, {} disconnects, {} activations, {} memory table \
                     updates, {} vrings set up, {} calls relayed, {} failed messages",
                    if c("connected") == 1 {
                        "connected"
                    } else {
                        "back-end gone"
                    },
                    c("disconnects"),
                    c("activations"),
                    c("mem_table_updates"),
                    c("vrings_set_up"),
                    c("calls_relayed"),
                    c("errors")
                )
            })
            .collect()
    }

    /// What the edu device did, when there is one and a guest drove it.
    fn edu_line(&self) -> Option<String> {
        let c = |n: &str| self.counters.get(&format!("edu.{n}")).copied();
        let (reads, writes) = (c("dma_reads")?, c("dma_writes")?);
        let (errors, refused) = (c("dma_errors")?, c("dma_refused")?);
        let (irqs, factorials) = (c("irqs")?, c("factorials")?);
        if reads + writes + errors + refused + irqs + factorials == 0 {
            return None;
        }
        Some(format!(
            "edu: {reads} DMA reads and {writes} writes ({} bytes), {errors} failed, {refused} \
             refused (outside its buffer); {irqs} interrupts; {factorials} factorials",
            c("dma_bytes")?
        ))
    }

    /// What the balloon did, when the VM has one (its counters are registered only then).
    fn balloon_line(&self) -> Option<String> {
        let c = |n: &str| self.counters.get(&format!("balloon.{n}")).copied();
        let target = c("target_pages")?;
        let z = |n: &str| c(n).unwrap_or(0);
        let mib = |pages: u64| pages as f64 / 256.0;
        let mut line = format!(
            "balloon: target {:.1} MiB, holds {:.1} MiB; inflated {:.1} MiB, deflated {:.1} \
             MiB, free pages reported {:.1} MiB; guest garbage: {} bad PFNs, {} bad \
             descriptors, {} bad reports",
            mib(target),
            mib(z("actual_pages")),
            mib(z("inflated_pages")),
            mib(z("deflated_pages")),
            mib(z("reported_pages")),
            z("bad_pfns"),
            z("bad_descriptors"),
            z("bad_reports"),
        );
        if z("manager.ticks") > 0 {
            let _ = write!(
                line,
                "; manager: {} inflations, {} deflations",
                z("manager.inflations"),
                z("manager.deflations")
            );
        }
        Some(line)
    }

    /// What the vIOMMU did, when the VM has one (its counters are registered only then).
    fn iommu_line(&self) -> Option<String> {
        let c = |n: &str| self.counters.get(&format!("iommu.{n}")).copied();
        let hits = c("iotlb.hits")?;
        let z = |n: &str| c(n).unwrap_or(0);
        let mut line = format!(
            "vIOMMU: {} maps, {} unmaps; invalidations: {} context, {}/{}/{} IOTLB \
             global/domain/page, {} interrupt-entry, {} waits; IOTLB {hits} hits, {} misses; \
             faults: {} DMA, {} interrupt remapping; pinned peak {} pages; stale max {}, \
             longest window {} us",
            z("maps"),
            z("unmaps"),
            z("inv.context"),
            z("inv.iotlb_global"),
            z("inv.iotlb_domain"),
            z("inv.iotlb_page"),
            z("inv.iec"),
            z("inv.wait"),
            z("iotlb.misses"),
            z("faults.dma"),
            z("faults.ir"),
            z("pinned.peak"),
            z("stale.max"),
            z("window_max_us"),
        );
        if z("sidecore.polls") > 0 {
            let _ = write!(
                line,
                "; sidecore: {} polls, {} found work, {:.3} s of CPU",
                z("sidecore.polls"),
                z("sidecore.busy_polls"),
                z("sidecore.cpu_ns") as f64 / 1e9
            );
        }
        Some(line)
    }

    /// The VM's swapping, when it ran under `--memory-limit` or a mapper mode: host swap traffic
    /// over the run, the mapper's state, and how many phases the guest reported.
    fn swap_line(&self) -> Option<String> {
        let c = |n: &str| self.counters.get(&format!("swap.{n}")).copied();
        let z = |n: &str| c(n).unwrap_or(0);
        let mode = crate::swap::mode_name(c("mode")?);
        let mut line = format!("swap: mode {mode}");
        match c("limit_bytes") {
            Some(l) => {
                let _ = write!(
                    line,
                    ", limit {} MiB ({} MiB in use at exit)",
                    l >> 20,
                    z("cgroup.usage_bytes") >> 20
                );
            }
            None => line.push_str(", no memory limit"),
        }
        let _ = write!(
            line,
            "; host swap {} sectors written, {} read ({} and {} zero pages), {} major faults in \
             Lucid ({} on its text)",
            z("host.swap_write_sectors"),
            z("host.swap_read_sectors"),
            z("host.swpout_zero"),
            z("host.swpin_zero"),
            z("host.majflt"),
            z("host.vmm_text_faults"),
        );
        if let Some(w) = c("pager.wakeups") {
            let _ = write!(
                line,
                "; pager {w} wakeups, {} chunks paged out, {} MiB freed, {} image cache drops, {} \
                 stalls",
                z("pager.chunks"),
                z("pager.bytes") >> 20,
                z("pager.cache_drops"),
                z("pager.stalls"),
            );
        }
        if mode != "baseline" {
            let _ = write!(
                line,
                "; mapper {} pages mapped in {} runs ({} VMAs), {} broken, {} fallbacks to copy",
                z("mapper.mapped_pages"),
                z("mapper.runs"),
                z("mapper.vmas"),
                z("mapper.broken"),
                z("mapper.fallbacks"),
            );
        }
        if mode == "vswapper" {
            let _ = write!(
                line,
                ", {} stale and {} false reads avoided, {} zero pages",
                z("mapper.stale_reads_avoided"),
                z("mapper.false_reads_avoided"),
                z("mapper.zero_pages"),
            );
        }
        let phases = self
            .counters
            .keys()
            .filter(|k| k.starts_with("swap.phase.") && k.ends_with(".ms"))
            .count();
        if phases > 0 {
            let _ = write!(line, "; {phases} guest phases (swap.phase.*)");
        }
        Some(line)
    }

    pub fn stop_text(&self) -> String {
        match &self.stop {
            StopReason::DebugExit(v) => format!("guest wrote {v:#x} to the debug-exit port"),
            StopReason::Reset => "guest requested a reset".into(),
            StopReason::Shutdown => "guest powered off".into(),
            StopReason::TripleFault { vcpu, rip } => {
                format!("guest triple-faulted on vCPU {vcpu} (rip {rip:#x})")
            }
            StopReason::Signal(s) => format!("stopped by signal {s}"),
            StopReason::Error(e) => format!("error: {}", error_chain(e.as_ref())),
            StopReason::Dropped => "the VMM dropped the VM while it ran".into(),
        }
    }

    /// The human summary printed at VM exit, one fact per line (the CLI logs each at info).
    pub fn summary(&self) -> String {
        let secs = self.wall.as_secs_f64().max(1e-9);
        let exits = self.total_exits();
        let in_run = self.sum_suffix(".time.in_kvm_run_ns") as f64 / 1e9;
        let in_vmm = self.sum_suffix(".time.in_vmm_ns") as f64 / 1e9;
        let mut s = String::new();
        let _ = writeln!(s, "VM stopped: {}", self.stop_text());
        let _ = writeln!(
            s,
            "{:.3} s wall, {} vCPU(s), {} exits to userspace ({:.0}/s)",
            secs,
            self.vcpus,
            exits,
            exits as f64 / secs
        );
        let by_reason: Vec<String> = self
            .exits_by_reason()
            .iter()
            .map(|(r, n)| format!("{r} {n}"))
            .collect();
        if !by_reason.is_empty() {
            let _ = writeln!(s, "exits by reason: {}", by_reason.join(", "));
        }
        let _ = writeln!(
            s,
            "vCPU time in KVM_RUN (guest and in-kernel exits) {in_run:.3} s, in the VMM {in_vmm:.3} s"
        );
        for d in self.devices() {
            let r = d.requests.max(1) as f64;
            let _ = writeln!(
                s,
                "{}: {} requests, {:.3} exits and {:.3} interrupts per request \
                 (whole run, boot included)",
                d.name,
                d.requests,
                exits as f64 / r,
                d.irqs as f64 / r
            );
        }
        for line in [
            self.edu_line(),
            self.iommu_line(),
            self.balloon_line(),
            self.swap_line(),
        ]
        .into_iter()
        .flatten()
        {
            let _ = writeln!(s, "{line}");
        }
        for line in self.vhost_user_lines() {
            let _ = writeln!(s, "{line}");
        }
        let emulated = self.emulated_by_mnemonic();
        if !emulated.is_empty() {
            let list: Vec<String> = emulated.iter().map(|(m, n)| format!("{m} {n}")).collect();
            let _ = writeln!(
                s,
                "instructions KVM's emulator could not run, completed by Lucid: {}",
                list.join(", ")
            );
        }
        let dropped = self.counters.get("serial.tx_dropped").copied().unwrap_or(0);
        let unwritten = self
            .counters
            .get("serial.tx_unwritten")
            .copied()
            .unwrap_or(0);
        if dropped + unwritten > 0 {
            let _ = writeln!(
                s,
                "serial console: {dropped} bytes of guest output dropped and {unwritten} \
                 left unwritten: the console's reader did not keep up (serial.tx_dropped, \
                 serial.tx_unwritten)"
            );
        }
        if let Some(k) = self.counters.get("kvm.vcpu0.exits") {
            let _ = writeln!(
                s,
                "KVM's own count on vCPU 0: {k} exits, {} I/O exits, {} MMIO exits",
                self.counters.get("kvm.vcpu0.io_exits").unwrap_or(&0),
                self.counters.get("kvm.vcpu0.mmio_exits").unwrap_or(&0)
            );
        }
        s
    }

    pub fn to_json(&self) -> serde_json::Value {
        let secs = self.wall.as_secs_f64();
        let exits = self.total_exits();
        json!({
            "stop": {
                "reason": self.stop_text(),
                "exit_code": self.exit_code(),
            },
            "wall_s": secs,
            "vcpus": self.vcpus,
            "exits": exits,
            "exits_per_s": if secs > 0.0 { exits as f64 / secs } else { 0.0 },
            "exits_by_reason": self.exits_by_reason(),
            "time_in_kvm_run_s": self.sum_suffix(".time.in_kvm_run_ns") as f64 / 1e9,
            "time_in_vmm_s": self.sum_suffix(".time.in_vmm_ns") as f64 / 1e9,
            "devices": self.devices().into_iter().map(|d| {
                let r = d.requests.max(1) as f64;
                (d.name, json!({
                    "requests": d.requests,
                    "exits_per_request": exits as f64 / r,
                    "irqs_per_request": d.irqs as f64 / r,
                }))
            }).collect::<serde_json::Map<String, serde_json::Value>>(),
            "counters": lucid_stats::nest(&self.counters),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("outer")]
    struct Outer(#[source] Middle);

    /// Prints its source itself, as some errors do.
    #[derive(Debug, thiserror::Error)]
    #[error("middle: {0}")]
    struct Middle(#[source] std::io::Error);

    #[test]
    fn error_chain_joins_sources_once() {
        let e = Outer(Middle(std::io::Error::other("disk on fire")));
        assert_eq!(error_chain(&e), "outer: middle: disk on fire");
    }

    #[test]
    fn summary_names_emulated_instructions_and_dropped_console_bytes() {
        let counters: BTreeMap<String, u64> = [
            ("vcpu0.emulated.int3", 2),
            ("vcpu1.emulated.int3", 1),
            ("vcpu1.emulated.xgetbv", 1),
            ("serial.tx_dropped", 10),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        let r = RunReport {
            stop: StopReason::Shutdown,
            wall: Duration::from_secs(1),
            vcpus: 2,
            counters,
        };
        let s = r.summary();
        assert!(s.contains("completed by Lucid: int3 3, xgetbv 1"), "{s}");
        assert!(
            s.contains("serial console: 10 bytes of guest output dropped"),
            "{s}"
        );
    }

    #[test]
    fn summary_says_what_the_viommu_did_only_when_there_is_one() {
        let mut r = RunReport {
            stop: StopReason::Shutdown,
            wall: Duration::from_secs(1),
            vcpus: 1,
            counters: BTreeMap::new(),
        };
        assert!(!r.summary().contains("vIOMMU:"));
        for (n, v) in [
            ("iommu.maps", 3),
            ("iommu.iotlb.hits", 10),
            ("iommu.iotlb.misses", 2),
            ("iommu.faults.dma", 1),
        ] {
            r.counters.insert(n.into(), v);
        }
        let s = r.summary();
        assert!(s.contains("vIOMMU: 3 maps, 0 unmaps;"), "{s}");
        assert!(s.contains("IOTLB 10 hits, 2 misses; faults: 1 DMA,"), "{s}");
        assert!(!s.contains("sidecore"), "{s}");
        r.counters.insert("iommu.sidecore.polls".into(), 5);
        r.counters
            .insert("iommu.sidecore.cpu_ns".into(), 1_500_000_000);
        assert!(r
            .summary()
            .contains("sidecore: 5 polls, 0 found work, 1.500 s of CPU"));
    }

    #[test]
    fn summary_says_what_the_balloon_did_only_when_there_is_one() {
        let mut r = RunReport {
            stop: StopReason::Shutdown,
            wall: Duration::from_secs(1),
            vcpus: 1,
            counters: Default::default(),
        };
        assert!(!r.summary().contains("balloon:"));
        for (k, v) in [
            ("balloon.target_pages", 512),
            ("balloon.actual_pages", 256),
            ("balloon.inflated_pages", 512),
            ("balloon.deflated_pages", 256),
            ("balloon.bad_pfns", 3),
        ] {
            r.counters.insert(k.into(), v);
        }
        let s = r.summary();
        assert!(
            s.contains(
                "balloon: target 2.0 MiB, holds 1.0 MiB; inflated 2.0 MiB, deflated 1.0 MiB, \
                 free pages reported 0.0 MiB; guest garbage: 3 bad PFNs, 0 bad descriptors, 0 \
                 bad reports\n"
            ),
            "{s}"
        );
    }

    #[test]
    fn summary_says_what_edu_did_only_when_driven() {
        let mk = |vals: [u64; 7]| {
            let names = [
                "dma_reads",
                "dma_writes",
                "dma_bytes",
                "dma_errors",
                "dma_refused",
                "irqs",
                "factorials",
            ];
            RunReport {
                stop: StopReason::Shutdown,
                wall: Duration::from_secs(1),
                vcpus: 1,
                counters: names
                    .iter()
                    .zip(vals)
                    .map(|(n, v)| (format!("edu.{n}"), v))
                    .collect(),
            }
        };
        assert!(!mk([0; 7]).summary().contains("edu:"));
        let s = mk([2, 1, 12288, 1, 0, 3, 4]).summary();
        assert!(
            s.contains(
                "edu: 2 DMA reads and 1 writes (12288 bytes), 1 failed, 0 refused (outside its \
                 buffer); 3 interrupts; 4 factorials"
            ),
            "{s}"
        );
    }

    #[test]
    fn summary_has_a_swap_line_only_when_the_vm_swaps() {
        let mut r = RunReport {
            stop: StopReason::Shutdown,
            wall: Duration::from_secs(1),
            vcpus: 1,
            counters: BTreeMap::from([("swap.host.majflt".to_string(), 3)]),
        };
        assert!(!r.summary().contains("swap:"));
        for (k, v) in [
            ("swap.mode", 1),
            ("swap.limit_bytes", 64 << 20),
            ("swap.cgroup.usage_bytes", 60 << 20),
            ("swap.host.swap_write_sectors", 800),
            ("swap.host.swap_read_sectors", 16),
            ("swap.mapper.mapped_pages", 100),
            ("swap.mapper.runs", 20),
            ("swap.phase.0.ms", 5),
            ("swap.phase.1.ms", 7),
        ] {
            r.counters.insert(k.into(), v);
        }
        let s = r.summary();
        assert!(
            s.contains(
                "swap: mode mapper, limit 64 MiB (60 MiB in use at exit); host swap 800 sectors \
                 written, 16 read (0 and 0 zero pages), 3 major faults in Lucid (0 on its text); \
                 mapper 100 pages mapped in 20 runs (0 VMAs), 0 broken, 0 fallbacks to copy; 2 \
                 guest phases (swap.phase.*)"
            ),
            "{s}"
        );
    }
}
