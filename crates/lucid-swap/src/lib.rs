//! VSWAPPER for Lucid (docs/vswapper.md): uncooperative swapping of a VM whose host memory is
//! limited below what the guest believes it has, without the pathologies of plain host swapping.
//!
//! - [`limit`]: the per-VM memory limit (a memory cgroup, v1 or v2) with host swap behind it.
//! - [`host`]: host-side swap and fault counters, as deltas over a run.
//! - [`mapper`]: the Swap Mapper (image blocks mapped over guest pages) and false-read prevention.
//! - [`pager`]: keeps the cgroup under its limit with `MADV_PAGEOUT` where the kernel's own
//!   limit reclaim fails (this PVM host).
//! - [`guard`]: a process outside the limit that frees guest RAM when every Lucid thread waits
//!   for memory (cgroup v1's `oom_kill_disable`).
//! - [`balloon_manager`]: sizes a virtio-balloon from host memory pressure.

#![warn(clippy::print_stdout, clippy::print_stderr)]

pub mod balloon_manager;
pub mod guard;
pub mod host;
pub mod limit;
pub mod mapper;
pub mod pager;

/// How a VM's guest memory is swapped when its limit is reached.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SwapMode {
    /// Plain uncooperative host swapping of anonymous guest memory (what every VMM does).
    #[default]
    Baseline,
    /// The Swap Mapper: pages the guest read from its virtio-blk disk stay tied to their image
    /// blocks, so the host drops them instead of swapping them.
    Mapper,
    /// The Mapper plus false-read prevention.
    Vswapper,
}

impl std::str::FromStr for SwapMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "baseline" => Ok(SwapMode::Baseline),
            "mapper" => Ok(SwapMode::Mapper),
            "vswapper" => Ok(SwapMode::Vswapper),
            _ => Err(format!(
                "unknown swap mode {s:?} (modes: baseline, mapper, vswapper)"
            )),
        }
    }
}

impl std::fmt::Display for SwapMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            SwapMode::Baseline => "baseline",
            SwapMode::Mapper => "mapper",
            SwapMode::Vswapper => "vswapper",
        })
    }
}
