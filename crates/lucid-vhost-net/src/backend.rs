//! The device: a `VhostUserBackendMut` with virtio-net's two queues, reflecting every
//! transmitted frame onto the receive queue. Everything the front-end or its guest put in the
//! rings is checked before use: a descriptor outside the memory table, a chain too long or a
//! ring that cannot be read costs that one buffer (counted in `errors`), never the worker.

use std::io::{self, Read, Write};
use std::sync::Arc;

use lucid_stats::{Counter, StatsRegistry};
use vhost::vhost_user::message::VhostUserProtocolFeatures;
use vhost_user_backend::{VhostUserBackendMut, VringRwLock, VringT};
use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use virtio_bindings::virtio_net::VIRTIO_NET_F_MAC;
use virtio_bindings::virtio_ring::VIRTIO_RING_F_EVENT_IDX;
use virtio_queue::{DescriptorChain, QueueT, Reader, Writer};
use vm_memory::{
    Address, GuestAddressSpace, GuestMemoryAtomic, GuestMemoryBackend, GuestMemoryLoadGuard,
    GuestMemoryMmap, GuestMemoryRegion,
};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::event::{
    new_event_consumer_and_notifier, EventConsumer, EventFlag, EventNotifier,
};

use crate::reflect::{self, Backlog, NET_HDR_LEN};

/// virtio-net's queues: 0 receive, 1 transmit (one pair: no `VIRTIO_NET_F_MQ`).
pub const RX_QUEUE: u16 = 0;
pub const TX_QUEUE: u16 = 1;
pub const QUEUE_SIZE: usize = 1024;
/// `VHOST_USER_F_PROTOCOL_FEATURES`: the front-end may negotiate protocol features.
pub const VHOST_USER_F_PROTOCOL_FEATURES: u32 = 30;

type Mem = GuestMemoryAtomic<GuestMemoryMmap>;
type Guard = GuestMemoryLoadGuard<GuestMemoryMmap>;

/// The server's counters (registry names `vhnet.*`), from the guest's point of view as Lucid's
/// own virtio-net counts: `tx` is what it transmitted, `rx` what it received.
#[derive(Clone)]
pub struct Counters {
    pub tx_frames: Arc<Counter>,
    pub tx_bytes: Arc<Counter>,
    pub rx_frames: Arc<Counter>,
    pub rx_bytes: Arc<Counter>,
    /// Frames not reflected: runts, giants, a full backlog, a receive buffer too small.
    pub drops: Arc<Counter>,
    /// Buffers or rings the front-end's memory table does not cover, or that could not be read.
    pub errors: Arc<Counter>,
    /// Front-end connections served.
    pub connections: Arc<Counter>,
}

impl Counters {
    pub fn new(stats: &StatsRegistry) -> Self {
        let c = |n: &str| stats.counter(format!("vhnet.{n}"));
        Counters {
            tx_frames: c("tx_frames"),
            tx_bytes: c("tx_bytes"),
            rx_frames: c("rx_frames"),
            rx_bytes: c("rx_bytes"),
            drops: c("drops"),
            errors: c("errors"),
            connections: c("connections"),
        }
    }
}

impl std::fmt::Display for Counters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "frames_tx={} bytes_tx={} frames_rx={} bytes_rx={} drops={} errors={} connections={}",
            self.tx_frames.get(),
            self.tx_bytes.get(),
            self.rx_frames.get(),
            self.rx_bytes.get(),
            self.drops.get(),
            self.errors.get(),
            self.connections.get()
        )
    }
}

/// What went wrong with one buffer or ring; logged and counted, never fatal.
#[derive(Debug, thiserror::Error)]
enum BufError {
    #[error("descriptor chain: {0}")]
    Chain(#[from] virtio_queue::Error),
    #[error("guest memory: {0}")]
    Io(#[from] io::Error),
}

/// What one pass of [`NetBackend::transmit`] or [`NetBackend::receive`] did.
struct Pass {
    /// Buffers went to the used ring: the driver may want an interrupt.
    used: bool,
    /// The pass stopped because the ring had no more buffers (not because the receive
    /// backlog ran out): buffers the driver adds meanwhile are worth another pass.
    drained: bool,
}

/// One connection's device state (a new front-end gets a new one).
pub struct NetBackend {
    mac: [u8; 6],
    mem: Option<Mem>,
    event_idx: bool,
    backlog: Backlog,
    counters: Counters,
}

impl NetBackend {
    pub fn new(mac: [u8; 6], counters: Counters) -> Self {
        NetBackend {
            mac,
            mem: None,
            event_idx: false,
            backlog: Backlog::default(),
            counters,
        }
    }

    /// Counts an error the front-end caused and says what it was (at most at warn level, as a
    /// hostile front-end may repeat it at will).
    fn error(&self, queue: &str, e: &dyn std::fmt::Display) {
        self.counters.errors.inc();
        log::debug!("{queue}: {e}");
        if self.counters.errors.get() <= 10 {
            log::warn!("{queue}: {e} (the buffer is given back empty)");
        }
    }

    /// Pops the next available chain: the guard on the vring is held only for the pop.
    fn pop(vring: &VringRwLock, mem: &Guard) -> Option<DescriptorChain<Guard>> {
        vring
            .get_mut()
            .get_queue_mut()
            .pop_descriptor_chain(mem.clone())
    }

    /// Takes every transmitted buffer, completes it and queues its reflection.
    fn transmit(&mut self, vring: &VringRwLock, mem: &Guard) -> Result<Pass, BufError> {
        let mut used = false;
        while let Some(chain) = Self::pop(vring, mem) {
            let head = chain.head_index();
            match read_chain(mem, chain) {
                Ok(mut buf) => {
                    self.counters.tx_frames.inc();
                    self.counters
                        .tx_bytes
                        .add(buf.len().saturating_sub(NET_HDR_LEN) as u64);
                    match reflect::reflect(&mut buf) {
                        Ok(()) => {
                            if self.backlog.push(buf).is_err() {
                                self.counters.drops.inc();
                            }
                        }
                        Err(e) => {
                            self.counters.drops.inc();
                            log::debug!("tx: frame dropped: {e}");
                        }
                    }
                }
                Err(e) => self.error("tx", &e),
            }
            used |= self.complete(vring, head, 0, "tx");
        }
        Ok(Pass {
            used,
            drained: true,
        })
    }

    /// Puts chain `head` in the used ring; false (counted) when the ring refuses it (a head
    /// index past the ring, a used ring outside memory).
    fn complete(&self, vring: &VringRwLock, head: u16, len: u32, queue: &str) -> bool {
        vring
            .add_used(head, len)
            .inspect_err(|e| self.error(queue, e))
            .is_ok()
    }

    /// Moves waiting frames into receive buffers, oldest first, while there are both.
    fn receive(&mut self, vring: &VringRwLock, mem: &Guard) -> Result<Pass, BufError> {
        let mut used = false;
        while let Some(len) = self.backlog.front().map(Vec::len) {
            let Some(chain) = Self::pop(vring, mem) else {
                return Ok(Pass {
                    used,
                    drained: true,
                });
            };
            let head = chain.head_index();
            let mut w = match Writer::new(&**mem, chain) {
                Ok(w) => w,
                Err(e) => {
                    self.error("rx", &e);
                    used |= self.complete(vring, head, 0, "rx");
                    continue;
                }
            };
            let buf = self.backlog.pop().unwrap_or_default();
            if w.available_bytes() < len {
                // Too small: the frame is dropped and the buffer given back empty, so that
                // a tiny buffer cannot hold up the frames behind it.
                self.counters.drops.inc();
                used |= self.complete(vring, head, 0, "rx");
                continue;
            }
            match w.write_all(&buf) {
                Ok(()) => {
                    self.counters.rx_frames.inc();
                    self.counters.rx_bytes.add((len - NET_HDR_LEN) as u64);
                    used |= self.complete(vring, head, len as u32, "rx");
                }
                Err(e) => {
                    self.error("rx", &e);
                    used |= self.complete(vring, head, 0, "rx");
                }
            }
        }
        Ok(Pass {
            used,
            drained: false,
        })
    }

    /// Runs `work` on `vring` until it finds nothing more to do, with notifications off while
    /// it works (EVENT_IDX: re-enabling them tells whether the driver added buffers meanwhile),
    /// then interrupts the driver if it asked to be.
    ///
    /// Buffers added meanwhile call for another pass only when the last one ran out of
    /// buffers: a receive ring the driver keeps stocked always has some, so looping on them
    /// with an empty backlog would spin forever, holding the back-end's lock against every
    /// request of the front-end.
    fn process(
        &mut self,
        vring: &VringRwLock,
        mem: &Guard,
        mut work: impl FnMut(&mut Self, &VringRwLock, &Guard) -> Result<Pass, BufError>,
    ) -> Result<(), BufError> {
        let mut used = false;
        loop {
            if self.event_idx {
                vring.disable_notification()?;
            }
            let pass = work(self, vring, mem)?;
            used |= pass.used;
            if !self.event_idx || !vring.enable_notification()? || !pass.drained {
                break;
            }
        }
        if used && vring.needs_notification()? {
            vring.signal_used_queue()?;
        }
        Ok(())
    }
}

/// The whole readable part of a transmitted chain (at most a header and [`reflect::MAX_FRAME`]
/// bytes; a longer chain is dropped unread).
fn read_chain(mem: &Guard, chain: DescriptorChain<Guard>) -> Result<Vec<u8>, BufError> {
    let mut r = Reader::new(&**mem, chain)?;
    let n = r
        .available_bytes()
        .min(NET_HDR_LEN + reflect::MAX_FRAME + 1);
    let mut buf = vec![0; n];
    r.read_exact(&mut buf)?;
    Ok(buf)
}

/// Refuses a memory table whose regions run past the end of their files: an access there would
/// fault (SIGBUS) and end the server, not the request.
fn check_backing(mem: &GuestMemoryMmap) -> io::Result<()> {
    for r in mem.iter() {
        let Some(fo) = r.file_offset() else {
            continue;
        };
        let file_len = fo.file().metadata()?.len();
        let fits = fo
            .start()
            .checked_add(r.len())
            .is_some_and(|end| end <= file_len);
        if !fits {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "memory region at {:#x} of {:#x} bytes from file offset {:#x} runs past its \
                     file's {file_len:#x} bytes",
                    r.start_addr().raw_value(),
                    r.len(),
                    fo.start()
                ),
            ));
        }
    }
    Ok(())
}

impl VhostUserBackendMut for NetBackend {
    type Bitmap = ();
    type Vring = VringRwLock;

    fn num_queues(&self) -> usize {
        2
    }

    fn max_queue_size(&self) -> usize {
        QUEUE_SIZE
    }

    fn features(&self) -> u64 {
        1 << VIRTIO_F_VERSION_1
            | 1 << VIRTIO_NET_F_MAC
            | 1 << VIRTIO_RING_F_EVENT_IDX
            | 1 << VHOST_USER_F_PROTOCOL_FEATURES
    }

    /// CONFIG for the MAC; REPLY_ACK so that a request the back-end refuses (a memory table it
    /// cannot map, a ring index out of range) is answered with an error the front-end sees.
    fn protocol_features(&self) -> VhostUserProtocolFeatures {
        VhostUserProtocolFeatures::CONFIG | VhostUserProtocolFeatures::REPLY_ACK
    }

    fn reset_device(&mut self) {
        self.backlog.clear();
    }

    fn set_event_idx(&mut self, enabled: bool) {
        self.event_idx = enabled;
    }

    fn get_config(&self, offset: u32, size: u32) -> Vec<u8> {
        reflect::config_bytes(self.mac, offset, size)
    }

    fn update_memory(&mut self, mem: Mem) -> io::Result<()> {
        self.mem = None;
        check_backing(&mem.memory())?;
        self.mem = Some(mem);
        Ok(())
    }

    /// A fresh pair per worker: the daemon's handler wakes its worker with it when the
    /// connection ends, so that dropping the daemon does not wait forever.
    fn exit_event(&self, _thread_index: usize) -> Option<(EventConsumer, EventNotifier)> {
        new_event_consumer_and_notifier(EventFlag::NONBLOCK | EventFlag::CLOEXEC)
            .inspect_err(|e| log::error!("cannot create the worker's exit eventfd: {e}"))
            .ok()
    }

    fn handle_event(
        &mut self,
        device_event: u16,
        _evset: EventSet,
        vrings: &[VringRwLock],
        _thread_id: usize,
    ) -> io::Result<()> {
        let (Some(rx), Some(tx)) = (
            vrings.get(usize::from(RX_QUEUE)),
            vrings.get(usize::from(TX_QUEUE)),
        ) else {
            return Ok(());
        };
        let Some(mem) = self.mem.as_ref().map(|m| m.memory()) else {
            // Kicked before any memory table: nothing can be read yet.
            return Ok(());
        };
        if device_event == TX_QUEUE {
            if let Err(e) = self.process(tx, &mem, Self::transmit) {
                self.error("tx ring", &e);
            }
        }
        if matches!(device_event, RX_QUEUE | TX_QUEUE) && !self.backlog.is_empty() {
            if let Err(e) = self.process(rx, &mem, Self::receive) {
                self.error("rx ring", &e);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn features_are_what_the_front_end_is_told() {
        let b = NetBackend::new([2, 0, 0, 0, 0, 1], Counters::new(&StatsRegistry::new()));
        assert_eq!(b.features(), 0x1_6000_0020);
        assert_eq!(b.num_queues(), 2);
        assert!(!b
            .protocol_features()
            .contains(VhostUserProtocolFeatures::MQ));
        assert_eq!(b.get_config(0, 6), [2, 0, 0, 0, 0, 1]);
    }
}
