//! Co-existing scheduling policies (docs/scheduling.md): host CPU pools, each with a policy for
//! the Lucid threads placed in it, shared by every Lucid process on the host.
//!
//! - [`def`]: pool definitions and the host-wide state directory every Lucid process joins.
//! - [`place`]: putting threads into a pool (cgroup cpusets v1/v2, or affinity) and reading back.
//! - [`policy`]: the per-pool policies (`noop`, `io`, `cpu`, `default`) and the no-op admission.
//! - [`monitor`]: per-VM figures every second (bytes, kicks, exits, run-queue wait, ms lost/MB).
//! - [`classify`]: labels a VM CPU- or I/O-bound from the monitor and picks its pool.

#![warn(clippy::print_stdout, clippy::print_stderr)]

pub mod classify;
pub mod def;
pub mod monitor;
pub mod place;
pub mod policy;
