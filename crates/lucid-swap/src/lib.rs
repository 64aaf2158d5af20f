//! VSWAPPER for Lucid (docs/vswapper.md): uncooperative swapping of a VM whose host memory is
//! limited below what the guest believes it has, without the pathologies of plain host swapping.
//!
//! - [`limit`]: the per-VM memory limit (a memory cgroup, v1 or v2) with host swap behind it.
//! - [`host`]: host-side swap and fault counters, as deltas over a run.
//! - [`mapper`]: the Swap Mapper (image blocks mapped over guest pages) and false-read prevention.
//! - [`balloon_manager`]: sizes a virtio-balloon from host memory pressure.

#![warn(clippy::print_stdout, clippy::print_stderr)]

pub mod balloon_manager;
pub mod host;
pub mod limit;
pub mod mapper;
