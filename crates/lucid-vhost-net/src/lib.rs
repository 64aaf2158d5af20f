//! A vhost-user-net back-end for tests, built on rust-vmm's `vhost-user-backend`: `lucid
//! device-server net --socket PATH` serves a VMM's vhost-user-net front-end from another
//! process. Its one mode, `echo`, is a reflector: every frame the guest transmits comes back
//! on its receive queue with source and destination MAC addresses swapped, so a guest's
//! request-response gets its replies. It offers `VIRTIO_F_VERSION_1`, `VIRTIO_NET_F_MAC` (the
//! configuration space through `GET_CONFIG`), `VIRTIO_RING_F_EVENT_IDX` and the protocol
//! features `CONFIG` and `REPLY_ACK` (one queue pair: no `MQ`); the process confines itself
//! with the seccomp role `device-server` once its socket is bound.

#![warn(clippy::print_stdout, clippy::print_stderr)]

pub mod backend;
pub mod reflect;
pub mod server;

pub use backend::{Counters, NetBackend};
pub use server::{run, DeviceServerCmd, NetArgs, ServerError, Summary};
