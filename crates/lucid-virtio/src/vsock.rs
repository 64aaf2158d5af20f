//! virtio-vsock (virtio 1.2, 5.10) with Lucid as the host end, "hybrid" over a Unix socket as
//! Firecracker and Cloud Hypervisor do it: stream sockets only (no SEQPACKET), host CID 2.
//!
//! - A host program connects to the device's socket `PATH` and writes `CONNECT <port>\n`; Lucid
//!   picks a host port, asks the guest (REQUEST to `<port>`) and, once the guest accepts
//!   (RESPONSE), answers `OK <hostport>\n`: from then on the stream carries the connection's bytes.
//!   A guest that refuses (RST) closes the stream; a line that is not `CONNECT <u32>\n` within 32
//!   bytes closes it too.
//! - A guest connection to host port P is connected to the Unix socket `PATH_P`; it is RST when
//!   nothing listens there.
//!
//! Queues: rx (0, device to guest), tx (1, guest to device), event (2: never used, Lucid sends no
//! transport reset). Configuration: `guest_cid` (le64). Header and packet fields are parsed and
//! built with the `virtio-vsock` crate; every byte of a guest buffer moves through the DMA path.
//!
//! Flow control is virtio's credit scheme, both ways: Lucid advertises [`BUF_ALLOC`] bytes per
//! connection and counts in `fwd_cnt` what it has written to the host stream (sending
//! CREDIT_UPDATE when a quarter of the buffer was freed since the guest last heard, or when asked
//! by CREDIT_REQUEST); it reads from the host stream only as much as the guest's last
//! `buf_alloc - (tx_cnt - fwd_cnt)` allows, and asks with CREDIT_REQUEST when that reaches 0.
//! A guest that sends more than its credit (credit overflow), an unknown op or type, a packet for
//! no connection, or a malformed header (shorter than 44 bytes, a length beyond its buffers or
//! beyond 64 KiB, wrong CIDs) gets RST and the packet is counted in `bad_packets`.
//!
//! Threads: the device's worker (`lucid-<name>-io`, seccomp role `backend`) runs the queues,
//! accepts on the listening socket and moves the streams; socket(2)/connect(2), which no back-end
//! may call, happen on a small thread started with the device (`lucid-<name>-cn`, role `vsock`)
//! that the worker hands connect requests to.
//!
//! Counters, under `vsock.<name>.`: `connections_host`, `connections_guest` (connections
//! established from each side), `open` (a gauge), `rx_bytes` (payload given to the guest),
//! `tx_bytes` (payload from the guest), `rst_sent`, `rst_received` (the guest's resets, a refused
//! host connection among them), `credit_updates` (sent), `credit_requests`
//! (sent), `bad_packets`, `credit_overflows`, `host_bad_requests` (handshakes refused),
//! `connect_failures` (guest connections nothing listened for); and the worker's under `<name>.`.

use std::collections::{HashMap, VecDeque};
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use lucid_seccomp::Role;
use lucid_stats::{Counter, StatsRegistry, ThreadRole};
use lucid_thread::{Spawner, ThreadSpec};
use virtio_vsock::packet::{VsockPacket, PKT_HEADER_SIZE};
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::EventFd;

use crate::worker::{gather, scatter, split_off, Backend, Desc, Io, Pop, Region, WorkerSlot};
use crate::{device_type, features, ActivateContext, ActivateError, VirtioDevice};

pub const QUEUE_SIZE: u16 = 256;
/// The host's CID: where every guest packet must go.
pub const HOST_CID: u64 = 2;
/// Receive buffer Lucid advertises per connection (bytes from the guest not yet written to the
/// host stream).
pub const BUF_ALLOC: u32 = 256 << 10;
/// Largest payload of one packet, either way.
pub const MAX_PAYLOAD: u32 = 64 << 10;
/// Connections (established or being set up) at once; more are refused.
pub const MAX_CONNECTIONS: usize = 1024;
/// Host ports Lucid picks for host-initiated connections start here.
const LOCAL_PORT_BASE: u32 = 1 << 30;
/// The longest handshake line (`CONNECT 4294967295\n` is 19 bytes).
const HANDSHAKE_MAX: usize = 32;
const RX: u16 = 0;
const TX: u16 = 1;

/// virtio-vsock's packet types and operations (virtio 1.2, 5.10.6).
pub mod op {
    pub const TYPE_STREAM: u16 = 1;
    pub const REQUEST: u16 = 1;
    pub const RESPONSE: u16 = 2;
    pub const RST: u16 = 3;
    pub const SHUTDOWN: u16 = 4;
    pub const RW: u16 = 5;
    pub const CREDIT_UPDATE: u16 = 6;
    pub const CREDIT_REQUEST: u16 = 7;
    /// SHUTDOWN flags: the sender will receive no more, send no more.
    pub const SHUTDOWN_RCV: u32 = 1;
    pub const SHUTDOWN_SEND: u32 = 2;
}

/// What `--vsock` asks for.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VsockConfig {
    /// The guest's context ID (3 and up: 0-2 are reserved, `u32::MAX` is "any").
    pub cid: u64,
    /// The Unix socket Lucid listens on; guest connections to port P go to `<socket>_P`.
    pub socket: PathBuf,
}

#[derive(Debug, thiserror::Error)]
pub enum VsockError {
    #[error("vsock cid {0}: give 3 to 4294967294")]
    Cid(u64),
    #[error("vsock socket {path}: {source}")]
    Listen {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("vsock: {0}")]
    Io(#[from] std::io::Error),
    #[error(transparent)]
    Spawn(#[from] lucid_thread::SpawnError),
}

/// Whether `cid` can be a guest's.
pub fn cid_ok(cid: u64) -> bool {
    (3..u64::from(u32::MAX)).contains(&cid)
}

/// A packet header, read and written with the `virtio-vsock` crate.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Hdr {
    pub src_cid: u64,
    pub dst_cid: u64,
    pub src_port: u32,
    pub dst_port: u32,
    pub len: u32,
    pub type_: u16,
    pub op: u16,
    pub flags: u32,
    pub buf_alloc: u32,
    pub fwd_cnt: u32,
}

impl Hdr {
    pub fn parse(raw: &[u8; PKT_HEADER_SIZE]) -> Hdr {
        let mut b = *raw;
        // SAFETY: the packet's slices point into `b`, which outlives the packet (dropped at the
        // end of this function) and which nothing else touches meanwhile.
        let Ok(mut p) = (unsafe { VsockPacket::new(&mut b, None) }) else {
            return Hdr::default();
        };
        if p.set_header_from_raw(raw).is_err() {
            return Hdr::default();
        }
        Hdr {
            src_cid: p.src_cid(),
            dst_cid: p.dst_cid(),
            src_port: p.src_port(),
            dst_port: p.dst_port(),
            len: p.len(),
            type_: p.type_(),
            op: p.op(),
            flags: p.flags(),
            buf_alloc: p.buf_alloc(),
            fwd_cnt: p.fwd_cnt(),
        }
    }

    pub fn encode(&self) -> [u8; PKT_HEADER_SIZE] {
        let mut b = [0u8; PKT_HEADER_SIZE];
        // SAFETY: as in `parse`: the packet writes only into `b`, which outlives it.
        if let Ok(mut p) = unsafe { VsockPacket::new(&mut b, None) } {
            p.set_src_cid(self.src_cid)
                .set_dst_cid(self.dst_cid)
                .set_src_port(self.src_port)
                .set_dst_port(self.dst_port)
                .set_len(self.len)
                .set_type(self.type_)
                .set_op(self.op)
                .set_flags(self.flags)
                .set_buf_alloc(self.buf_alloc)
                .set_fwd_cnt(self.fwd_cnt);
        }
        b
    }
}

#[derive(Clone)]
struct Counters {
    connections_host: Arc<Counter>,
    connections_guest: Arc<Counter>,
    open: Arc<Counter>,
    rx_bytes: Arc<Counter>,
    tx_bytes: Arc<Counter>,
    rst_sent: Arc<Counter>,
    credit_updates: Arc<Counter>,
    credit_requests: Arc<Counter>,
    bad_packets: Arc<Counter>,
    credit_overflows: Arc<Counter>,
    host_bad_requests: Arc<Counter>,
    connect_failures: Arc<Counter>,
    rst_received: Arc<Counter>,
}

impl Counters {
    fn new(stats: &StatsRegistry, name: &str) -> Counters {
        let c = |n: &str| stats.counter(format!("vsock.{name}.{n}"));
        Counters {
            connections_host: c("connections_host"),
            connections_guest: c("connections_guest"),
            open: c("open"),
            rx_bytes: c("rx_bytes"),
            tx_bytes: c("tx_bytes"),
            rst_sent: c("rst_sent"),
            credit_updates: c("credit_updates"),
            credit_requests: c("credit_requests"),
            bad_packets: c("bad_packets"),
            credit_overflows: c("credit_overflows"),
            host_bad_requests: c("host_bad_requests"),
            connect_failures: c("connect_failures"),
            rst_received: c("rst_received"),
        }
    }
}

/// (host port, guest port): one connection.
type Key = (u32, u32);

/// A connect request of the worker and its outcome, by activation (`gen`), so that a reset
/// device drops what an earlier activation asked for.
struct Request {
    gen: u64,
    key: Key,
}

struct Done {
    gen: u64,
    key: Key,
    stream: std::io::Result<UnixStream>,
}

/// The connect thread's mailbox: requests in, connected streams out.
struct Connector {
    base: PathBuf,
    requests: Mutex<VecDeque<Request>>,
    request_evt: EventFd,
    done: Mutex<VecDeque<Done>>,
    done_evt: EventFd,
    stop: AtomicBool,
}

impl Connector {
    fn run(&self) {
        loop {
            let _ = self.request_evt.read();
            if self.stop.load(Ordering::Acquire) {
                return;
            }
            loop {
                let req = self
                    .requests
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .pop_front();
                let Some(req) = req else { break };
                let stream = connect(&self.base, req.key.0);
                self.done
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push_back(Done {
                        gen: req.gen,
                        key: req.key,
                        stream,
                    });
                let _ = self.done_evt.write(1);
            }
        }
    }

    /// Every request fails (the thread could not confine itself).
    fn refuse_all(&self) {
        loop {
            let _ = self.request_evt.read();
            if self.stop.load(Ordering::Acquire) {
                return;
            }
            let reqs: Vec<Request> = self
                .requests
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .drain(..)
                .collect();
            let mut done = self.done.lock().unwrap_or_else(|e| e.into_inner());
            for r in reqs {
                done.push_back(Done {
                    gen: r.gen,
                    key: r.key,
                    stream: Err(std::io::Error::from(std::io::ErrorKind::PermissionDenied)),
                });
            }
            drop(done);
            let _ = self.done_evt.write(1);
        }
    }
}

/// `<base>_<port>`, connected and non-blocking.
fn connect(base: &Path, port: u32) -> std::io::Result<UnixStream> {
    let mut p = base.as_os_str().to_owned();
    p.push(format!("_{port}"));
    let s = UnixStream::connect(PathBuf::from(p))?;
    nonblocking(s.as_raw_fd())?;
    Ok(s)
}

/// O_NONBLOCK by fcntl (which every seccomp role allows; std's way is an ioctl).
fn nonblocking(fd: RawFd) -> std::io::Result<()> {
    // SAFETY: F_GETFL/F_SETFL on a descriptor this thread holds open; no memory is passed.
    let r = unsafe {
        let fl = libc::fcntl(fd, libc::F_GETFL);
        if fl < 0 {
            fl
        } else {
            libc::fcntl(fd, libc::F_SETFL, fl | libc::O_NONBLOCK)
        }
    };
    if r < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// A virtio-vsock device.
pub struct Vsock {
    name: String,
    cfg: VsockConfig,
    queue_sizes: [u16; 3],
    listener: Arc<UnixListener>,
    connector: Arc<Connector>,
    thread: Option<JoinHandle<()>>,
    c: Counters,
    gen: Arc<AtomicU64>,
    worker: WorkerSlot,
}

impl Vsock {
    /// Listens on `cfg.socket` (a socket file there that nobody listens on is replaced; one in
    /// use is an error) and starts the connect
    /// thread. Call on a thread whose seccomp filter allows socket(2) and bind(2): the VM's
    /// builder or the API server, not a vCPU.
    pub fn new(
        name: String,
        cfg: VsockConfig,
        stats: &StatsRegistry,
        spawner: &Spawner,
    ) -> Result<Vsock, VsockError> {
        if !cid_ok(cfg.cid) {
            return Err(VsockError::Cid(cfg.cid));
        }
        let listen_err = |source| VsockError::Listen {
            path: cfg.socket.clone(),
            source,
        };
        use std::os::unix::fs::FileTypeExt;
        // A socket file nobody listens on is a stale one (a VM before this one); one somebody
        // listens on is not ours to take.
        if std::fs::symlink_metadata(&cfg.socket).is_ok_and(|m| m.file_type().is_socket()) {
            if UnixStream::connect(&cfg.socket).is_ok() {
                return Err(listen_err(std::io::ErrorKind::AddrInUse.into()));
            }
            std::fs::remove_file(&cfg.socket).map_err(listen_err)?;
        }
        let listener = UnixListener::bind(&cfg.socket).map_err(listen_err)?;
        nonblocking(listener.as_raw_fd()).map_err(listen_err)?;
        let connector = Arc::new(Connector {
            base: cfg.socket.clone(),
            requests: Mutex::default(),
            request_evt: EventFd::new(0)?,
            done: Mutex::default(),
            done_evt: EventFd::new(libc::EFD_NONBLOCK)?,
            stop: AtomicBool::new(false),
        });
        let cn = connector.clone();
        let spec = ThreadSpec::new(format!("lucid-{name}-cn"), ThreadRole::Other, Role::Vsock);
        let thread = spawner.spawn(spec, move |confined| match confined {
            Ok(()) => cn.run(),
            Err(e) => {
                log::error!("{e}: guest connections to the host will be refused");
                cn.refuse_all()
            }
        })?;
        Ok(Vsock {
            c: Counters::new(stats, &name),
            name,
            cfg,
            queue_sizes: [QUEUE_SIZE; 3],
            listener: Arc::new(listener),
            connector,
            thread: Some(thread),
            gen: Arc::default(),
            worker: WorkerSlot::default(),
        })
    }

    pub fn config(&self) -> &VsockConfig {
        &self.cfg
    }
}

impl Drop for Vsock {
    fn drop(&mut self) {
        self.worker.stop();
        self.connector.stop.store(true, Ordering::Release);
        let _ = self.connector.request_evt.write(1);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl VirtioDevice for Vsock {
    fn name(&self) -> &str {
        &self.name
    }

    fn device_type(&self) -> u32 {
        device_type::VSOCK
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &self.queue_sizes
    }

    fn features(&self) -> u64 {
        features::VIRTIO_F_VERSION_1
            | features::VIRTIO_F_ACCESS_PLATFORM
            | features::VIRTIO_RING_F_EVENT_IDX
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        crate::blk::read_config_bytes(&self.cfg.cid.to_le_bytes(), offset, data);
    }

    fn write_config(&mut self, _offset: u64, _data: &[u8]) {}

    fn activate(&mut self, ctx: ActivateContext) -> Result<(), ActivateError> {
        let pos = |q: u16| ctx.queues.iter().position(|(i, _, _)| *i == q);
        let missing = |queue| ActivateError::QueueMissing {
            device: self.name.clone(),
            queue,
        };
        let rx = pos(RX).ok_or_else(|| missing(RX))?;
        let tx = pos(TX).ok_or_else(|| missing(TX))?;
        let gen = self.gen.fetch_add(1, Ordering::Relaxed) + 1;
        let thread_err = |source| ActivateError::Thread {
            device: self.name.clone(),
            source,
        };
        let mux = Muxer::new(
            self.cfg.cid,
            self.c.clone(),
            Link::Thread {
                connector: self.connector.clone(),
                gen,
            },
        )
        .map_err(thread_err)?;
        let listener = self.listener.clone();
        mux.epoll
            .ctl(
                ControlOperation::Add,
                listener.as_raw_fd(),
                EpollEvent::new(EventSet::IN, TOKEN_LISTENER),
            )
            .map_err(thread_err)?;
        mux.epoll
            .ctl(
                ControlOperation::Add,
                self.connector.done_evt.as_raw_fd(),
                EpollEvent::new(EventSet::IN, TOKEN_DONE),
            )
            .map_err(thread_err)?;
        let backend = VsockBackend {
            mux,
            listener: Some(listener),
            rx,
            tx,
            descs: Vec::new(),
            regions: Vec::new(),
            rest: Vec::new(),
            buf: vec![0; MAX_PAYLOAD as usize],
        };
        self.worker.start(&self.name, ctx, backend)
    }

    fn reset(&mut self) {
        self.worker.stop();
    }

    fn needs_reset(&self) -> bool {
        self.worker.needs_reset()
    }
}

const TOKEN_LISTENER: u64 = 0;
const TOKEN_DONE: u64 = 1;
const TOKEN_FIRST: u64 = 2;

/// How the muxer gets host streams for guest connections.
enum Link {
    /// Through the connect thread.
    Thread { connector: Arc<Connector>, gen: u64 },
    /// A socket pair made on the spot, whose far end is kept (the fuzz target's).
    Pairs(Vec<UnixStream>),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// The host program asked; the guest has not answered.
    LocalInit,
    Established,
}

struct Conn {
    key: Key,
    token: u64,
    stream: UnixStream,
    state: State,
    /// Bytes from the guest not yet written to the host stream.
    to_host: VecDeque<u8>,
    /// Bytes received from the guest, and written to the host stream (our fwd_cnt).
    rx_cnt: u32,
    fwd_cnt: u32,
    /// The fwd_cnt the guest last heard.
    fwd_sent: u32,
    /// Bytes given to the guest, and the guest's last buf_alloc / fwd_cnt.
    tx_cnt: u32,
    peer_buf_alloc: u32,
    peer_fwd_cnt: u32,
    /// The guest will send no more: shut the host stream's write side once `to_host` is out.
    guest_shut_send: bool,
    write_shut: bool,
    /// The guest will take no more.
    guest_shut_rcv: bool,
    /// The host stream reached EOF (the guest was sent SHUTDOWN).
    host_eof: bool,
    /// The host stream hung up: taken off the epoll set, read until EOF as credit allows.
    hup: bool,
    /// Queued in `ready` (known readable).
    in_ready: bool,
    /// The epoll interest registered.
    interest: EventSet,
    credit_update_queued: bool,
    /// A CREDIT_REQUEST went out for the credit running dry: one per time, not one per
    /// answer, or a slow reader and Lucid would trade them forever.
    credit_asked: bool,
}

impl Conn {
    fn new(key: Key, token: u64, stream: UnixStream, state: State) -> Conn {
        Conn {
            key,
            token,
            stream,
            state,
            to_host: VecDeque::new(),
            rx_cnt: 0,
            fwd_cnt: 0,
            fwd_sent: 0,
            tx_cnt: 0,
            peer_buf_alloc: 0,
            peer_fwd_cnt: 0,
            guest_shut_send: false,
            write_shut: false,
            guest_shut_rcv: false,
            host_eof: false,
            hup: false,
            in_ready: false,
            interest: EventSet::empty(),
            credit_update_queued: false,
            credit_asked: false,
        }
    }

    /// What the guest can still take.
    fn peer_credit(&self) -> u32 {
        let in_flight = self.tx_cnt.wrapping_sub(self.peer_fwd_cnt);
        self.peer_buf_alloc.saturating_sub(in_flight)
    }

    fn may_read(&self) -> bool {
        self.state == State::Established
            && !self.host_eof
            && !self.guest_shut_rcv
            && self.peer_credit() > 0
    }
}

/// A host program's connection before its `CONNECT` line.
struct Handshake {
    stream: UnixStream,
    line: Vec<u8>,
}

/// The protocol: connections, their host streams, and the packets owed to the guest.
pub(crate) struct Muxer {
    cid: u64,
    c: Counters,
    link: Link,
    epoll: Epoll,
    conns: HashMap<u64, Conn>,
    by_key: HashMap<Key, u64>,
    handshakes: HashMap<u64, Handshake>,
    /// Guest connections waiting for the connect thread, with the REQUEST's credit fields.
    connecting: HashMap<Key, (u32, u32)>,
    next_token: u64,
    next_port: u32,
    /// Control packets owed to the guest, in order.
    control: VecDeque<Hdr>,
    /// Connections whose host stream has bytes (or EOF) for the guest.
    ready: VecDeque<u64>,
}

impl Muxer {
    fn new(cid: u64, c: Counters, link: Link) -> std::io::Result<Muxer> {
        Ok(Muxer {
            cid,
            c,
            link,
            epoll: Epoll::new()?,
            conns: HashMap::new(),
            by_key: HashMap::new(),
            handshakes: HashMap::new(),
            connecting: HashMap::new(),
            next_token: TOKEN_FIRST,
            next_port: LOCAL_PORT_BASE,
            control: VecDeque::new(),
            ready: VecDeque::new(),
        })
    }

    fn token(&mut self) -> u64 {
        let t = self.next_token;
        self.next_token += 1;
        t
    }

    fn open_count(&self) -> usize {
        self.conns.len() + self.connecting.len() + self.handshakes.len()
    }

    /// A packet to the guest on connection `key`.
    fn reply(&self, key: Key, op: u16, flags: u32) -> Hdr {
        pkt(self.cid, key, op, flags)
    }

    fn send_rst(&mut self, key: Key) {
        let h = self.reply(key, op::RST, 0);
        self.control.push_back(h);
    }

    /// Answers a bad packet with RST (never a RST with one).
    fn bad(&mut self, h: &Hdr, why: &str) {
        self.c.bad_packets.inc();
        log::debug!("vsock: bad packet {h:?}: {why}");
        if h.op != op::RST {
            self.send_rst((h.dst_port, h.src_port));
        }
    }

    /// One packet the guest put on the tx queue, with its payload.
    pub(crate) fn on_guest(&mut self, h: &Hdr, data: &[u8]) {
        if h.src_cid != self.cid || h.dst_cid != HOST_CID {
            return self.bad(h, "wrong CIDs");
        }
        if h.type_ != op::TYPE_STREAM {
            return self.bad(h, "not a stream packet");
        }
        let key = (h.dst_port, h.src_port);
        if h.op == op::REQUEST {
            return self.guest_request(h, key);
        }
        if h.op == op::RST {
            self.c.rst_received.inc();
            self.connecting.remove(&key);
            if let Some(t) = self.by_key.get(&key).copied() {
                self.remove(t);
            }
            return;
        }
        let Some(t) = self.by_key.get(&key).copied() else {
            return self.bad(h, "no such connection");
        };
        let Some(conn) = self.conns.get_mut(&t) else {
            return;
        };
        conn.peer_buf_alloc = h.buf_alloc;
        conn.peer_fwd_cnt = h.fwd_cnt;
        match (h.op, conn.state) {
            (op::RESPONSE, State::LocalInit) => {
                // Straight to the stream, which holds nothing yet (a few bytes always fit):
                // these are not the guest's bytes, so not counted in fwd_cnt.
                let ok = format!("OK {}\n", key.0);
                if (&conn.stream).write(ok.as_bytes()).ok() != Some(ok.len()) {
                    self.send_rst(key);
                    return self.remove(t);
                }
                conn.state = State::Established;
                self.c.connections_host.inc();
            }
            (op::RW, State::Established) => {
                let buffered = conn.rx_cnt.wrapping_sub(conn.fwd_cnt);
                if u64::from(buffered) + data.len() as u64 > u64::from(BUF_ALLOC) {
                    self.c.credit_overflows.inc();
                    self.bad(h, "credit overflow");
                    return self.remove(t);
                }
                if conn.guest_shut_send {
                    return self.bad(h, "data after SHUTDOWN(send)");
                }
                conn.rx_cnt = conn.rx_cnt.wrapping_add(data.len() as u32);
                conn.to_host.extend(data.iter());
                self.c.tx_bytes.add(data.len() as u64);
                self.flush_host(t);
            }
            (op::SHUTDOWN, State::Established) => {
                let both = op::SHUTDOWN_RCV | op::SHUTDOWN_SEND;
                conn.guest_shut_rcv |= h.flags & op::SHUTDOWN_RCV != 0;
                conn.guest_shut_send |= h.flags & op::SHUTDOWN_SEND != 0;
                if h.flags & both == both {
                    // The guest is done: what it sent goes out if it can, then RST ends it.
                    self.flush_host(t);
                    self.send_rst(key);
                    return self.remove(t);
                }
                self.flush_host(t);
            }
            (op::CREDIT_UPDATE, State::Established) => {}
            (op::CREDIT_REQUEST, State::Established) => self.queue_credit_update(t),
            (op::RESPONSE | op::RW | op::SHUTDOWN | op::CREDIT_UPDATE | op::CREDIT_REQUEST, _) => {
                self.bad(h, "not expected in this state");
                return self.remove(t);
            }
            _ => {
                self.bad(h, "unknown op");
                return self.remove(t);
            }
        }
        self.sync(t);
    }

    fn guest_request(&mut self, h: &Hdr, key: Key) {
        if self.by_key.contains_key(&key) || self.connecting.contains_key(&key) {
            return self.bad(h, "REQUEST for a connection that exists");
        }
        if self.open_count() >= MAX_CONNECTIONS {
            self.c.connect_failures.inc();
            return self.send_rst(key);
        }
        self.connecting.insert(key, (h.buf_alloc, h.fwd_cnt));
        match &mut self.link {
            Link::Thread { connector, gen } => {
                connector
                    .requests
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push_back(Request { gen: *gen, key });
                let _ = connector.request_evt.write(1);
            }
            Link::Pairs(far) => {
                let stream = UnixStream::pair().and_then(|(a, b)| {
                    nonblocking(a.as_raw_fd())?;
                    nonblocking(b.as_raw_fd())?;
                    far.push(b);
                    Ok(a)
                });
                self.connected(key, stream);
            }
        }
    }

    /// The connect thread's answer for guest connection `key`.
    fn connected(&mut self, key: Key, stream: std::io::Result<UnixStream>) {
        let Some((buf_alloc, fwd_cnt)) = self.connecting.remove(&key) else {
            return; // The guest gave up meanwhile.
        };
        let stream = match stream {
            Ok(s) => s,
            Err(e) => {
                log::debug!("vsock: guest connection to host port {}: {e}", key.0);
                self.c.connect_failures.inc();
                return self.send_rst(key);
            }
        };
        let t = self.token();
        let mut conn = Conn::new(key, t, stream, State::Established);
        conn.peer_buf_alloc = buf_alloc;
        conn.peer_fwd_cnt = fwd_cnt;
        if self.add_conn(conn).is_err() {
            return self.send_rst(key);
        }
        self.c.connections_guest.inc();
        let h = self.reply(key, op::RESPONSE, 0);
        self.control.push_back(h);
        self.sync(t);
    }

    fn add_conn(&mut self, conn: Conn) -> std::io::Result<()> {
        self.epoll.ctl(
            ControlOperation::Add,
            conn.stream.as_raw_fd(),
            EpollEvent::new(EventSet::empty(), conn.token),
        )?;
        self.by_key.insert(conn.key, conn.token);
        self.conns.insert(conn.token, conn);
        self.c.open.set(self.conns.len() as u64);
        Ok(())
    }

    fn remove(&mut self, t: u64) {
        if let Some(conn) = self.conns.remove(&t) {
            self.by_key.remove(&conn.key);
            if !conn.hup {
                let _ = self.epoll.ctl(
                    ControlOperation::Delete,
                    conn.stream.as_raw_fd(),
                    EpollEvent::default(),
                );
            }
        }
        self.c.open.set(self.conns.len() as u64);
    }

    fn queue_credit_update(&mut self, t: u64) {
        let Some(conn) = self.conns.get_mut(&t) else {
            return;
        };
        if !conn.credit_update_queued {
            conn.credit_update_queued = true;
            let h = pkt(self.cid, conn.key, op::CREDIT_UPDATE, 0);
            self.control.push_back(h);
        }
    }

    /// Writes what the guest sent to the host stream, as far as it takes it.
    fn flush_host(&mut self, t: u64) {
        let Some(conn) = self.conns.get_mut(&t) else {
            return;
        };
        while !conn.to_host.is_empty() {
            let (a, _) = conn.to_host.as_slices();
            // SAFETY: send(2) reads at most `a.len()` bytes from `a`; MSG_NOSIGNAL: a closed
            // peer is an EPIPE here, not a SIGPIPE.
            let n = unsafe {
                libc::send(
                    conn.stream.as_raw_fd(),
                    a.as_ptr().cast(),
                    a.len(),
                    libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT,
                )
            };
            if n < 0 {
                let e = std::io::Error::last_os_error();
                match e.kind() {
                    std::io::ErrorKind::Interrupted => continue,
                    std::io::ErrorKind::WouldBlock => break,
                    _ => {
                        log::debug!("vsock: host stream of {:?}: {e}", conn.key);
                        let key = conn.key;
                        self.send_rst(key);
                        return self.remove(t);
                    }
                }
            }
            conn.to_host.drain(..n as usize);
            conn.fwd_cnt = conn.fwd_cnt.wrapping_add(n as u32);
        }
        if conn.to_host.is_empty() && conn.guest_shut_send && !conn.write_shut {
            conn.write_shut = true;
            let _ = conn.stream.shutdown(std::net::Shutdown::Write);
        }
        if conn.fwd_cnt.wrapping_sub(conn.fwd_sent) >= BUF_ALLOC / 4 {
            self.queue_credit_update(t);
        }
    }

    /// Brings connection `t`'s epoll interest and ready-list place up to date.
    fn sync(&mut self, t: u64) {
        let Some(conn) = self.conns.get_mut(&t) else {
            return;
        };
        if conn.hup {
            if conn.may_read() && !conn.in_ready {
                conn.in_ready = true;
                self.ready.push_back(t);
            }
            return;
        }
        let mut want = EventSet::empty();
        if conn.may_read() && !conn.in_ready {
            want |= EventSet::IN;
        }
        if !conn.to_host.is_empty() {
            want |= EventSet::OUT;
        }
        if want != conn.interest {
            conn.interest = want;
            let _ = self.epoll.ctl(
                ControlOperation::Modify,
                conn.stream.as_raw_fd(),
                EpollEvent::new(want, t),
            );
        }
        if conn.peer_credit() > 0 {
            conn.credit_asked = false;
        } else if conn.state == State::Established && !conn.host_eof && !conn.credit_asked {
            conn.credit_asked = true;
            let h = pkt(self.cid, conn.key, op::CREDIT_REQUEST, 0);
            self.control.push_back(h);
        }
    }

    /// Handles what the epoll set reports (without waiting).
    fn poll_host(&mut self, listener: Option<&UnixListener>) {
        let mut events = [EpollEvent::default(); 64];
        for _ in 0..16 {
            let n = match self.epoll.wait(0, &mut events) {
                Ok(n) => n,
                Err(_) => return,
            };
            for ev in &events[..n] {
                match ev.data() {
                    TOKEN_LISTENER => {
                        if let Some(l) = listener {
                            self.accept(l);
                        }
                    }
                    TOKEN_DONE => self.drain_done(),
                    t => self.on_stream(t, ev.event_set()),
                }
            }
            if n < events.len() {
                return;
            }
        }
    }

    fn accept(&mut self, l: &UnixListener) {
        loop {
            let s = match l.accept() {
                Ok((s, _)) => s,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(_) => return,
            };
            if self.open_count() >= MAX_CONNECTIONS || nonblocking(s.as_raw_fd()).is_err() {
                self.c.host_bad_requests.inc();
                continue;
            }
            let t = self.token();
            if self
                .epoll
                .ctl(
                    ControlOperation::Add,
                    s.as_raw_fd(),
                    EpollEvent::new(EventSet::IN, t),
                )
                .is_ok()
            {
                self.handshakes.insert(
                    t,
                    Handshake {
                        stream: s,
                        line: Vec::new(),
                    },
                );
            }
        }
    }

    fn drain_done(&mut self) {
        let Link::Thread { connector, gen } = &self.link else {
            return;
        };
        let _ = connector.done_evt.read();
        let gen = *gen;
        let done: Vec<Done> = connector
            .done
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .drain(..)
            .collect();
        for d in done.into_iter().filter(|d| d.gen == gen) {
            self.connected(d.key, d.stream);
        }
    }

    fn on_stream(&mut self, t: u64, ev: EventSet) {
        if self.handshakes.contains_key(&t) {
            return self.handshake(t);
        }
        let Some(conn) = self.conns.get_mut(&t) else {
            return;
        };
        if ev.intersects(EventSet::HANG_UP | EventSet::ERROR) {
            conn.hup = true;
            let _ = self.epoll.ctl(
                ControlOperation::Delete,
                conn.stream.as_raw_fd(),
                EpollEvent::default(),
            );
            if conn.state == State::LocalInit {
                // The host program left before the guest answered.
                let key = conn.key;
                self.send_rst(key);
                return self.remove(t);
            }
            conn.to_host.clear();
        } else {
            if ev.contains(EventSet::IN) && !conn.in_ready {
                conn.in_ready = true;
                self.ready.push_back(t);
            }
            if ev.contains(EventSet::OUT) {
                self.flush_host(t);
            }
        }
        self.sync(t);
    }

    /// Reads a host program's `CONNECT <port>\n` a byte at a time (what follows the line is
    /// the connection's and stays in the socket).
    fn handshake(&mut self, t: u64) {
        let Some(hs) = self.handshakes.get_mut(&t) else {
            return;
        };
        let mut b = [0u8; 1];
        let port = loop {
            match hs.stream.read(&mut b) {
                Ok(1) if b[0] == b'\n' => break parse_connect(&hs.line),
                Ok(1) if hs.line.len() < HANDSHAKE_MAX => hs.line.push(b[0]),
                Ok(_) => break None,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return,
                Err(_) => break None,
            }
        };
        let Some(hs) = self.handshakes.remove(&t) else {
            return;
        };
        let _ = self.epoll.ctl(
            ControlOperation::Delete,
            hs.stream.as_raw_fd(),
            EpollEvent::default(),
        );
        let Some(guest_port) = port else {
            self.c.host_bad_requests.inc();
            log::debug!(
                "vsock: a host program sent {:?}, not CONNECT <port>",
                String::from_utf8_lossy(&hs.line)
            );
            return;
        };
        let Some(host_port) = self.free_port(guest_port) else {
            self.c.host_bad_requests.inc();
            return;
        };
        let key = (host_port, guest_port);
        let t = self.token();
        if self
            .add_conn(Conn::new(key, t, hs.stream, State::LocalInit))
            .is_err()
        {
            return;
        }
        let h = self.reply(key, op::REQUEST, 0);
        self.control.push_back(h);
    }

    fn free_port(&mut self, guest_port: u32) -> Option<u32> {
        for _ in 0..MAX_CONNECTIONS * 2 {
            let p = self.next_port;
            self.next_port = self.next_port.checked_add(1).unwrap_or(LOCAL_PORT_BASE);
            if !self.by_key.contains_key(&(p, guest_port)) {
                return Some(p);
            }
        }
        None
    }

    /// Whether there is something for the guest's rx queue.
    fn has_output(&self) -> bool {
        !self.control.is_empty() || !self.ready.is_empty()
    }

    /// Fills one rx buffer of `room` payload bytes: its header and how much of `buf` it
    /// carries, or None when nothing was owed after all.
    fn next_output(&mut self, buf: &mut [u8]) -> Option<(Hdr, usize)> {
        if let Some(mut h) = self.control.pop_front() {
            if let Some(conn) = self
                .by_key
                .get(&(h.src_port, h.dst_port))
                .and_then(|t| self.conns.get_mut(t))
            {
                h.fwd_cnt = conn.fwd_cnt;
                conn.fwd_sent = conn.fwd_cnt;
                match h.op {
                    op::CREDIT_UPDATE => {
                        conn.credit_update_queued = false;
                        self.c.credit_updates.inc();
                    }
                    op::CREDIT_REQUEST => self.c.credit_requests.inc(),
                    _ => {}
                }
            }
            if h.op == op::RST {
                self.c.rst_sent.inc();
            }
            return Some((h, 0));
        }
        while let Some(t) = self.ready.pop_front() {
            let Some(conn) = self.conns.get_mut(&t) else {
                continue;
            };
            conn.in_ready = false;
            if !conn.may_read() {
                self.sync(t);
                continue;
            }
            let want = buf.len().min(conn.peer_credit() as usize);
            match conn.stream.read(&mut buf[..want]) {
                Ok(0) => {
                    conn.host_eof = true;
                    let mut h = pkt(
                        self.cid,
                        conn.key,
                        op::SHUTDOWN,
                        op::SHUTDOWN_RCV | op::SHUTDOWN_SEND,
                    );
                    h.fwd_cnt = conn.fwd_cnt;
                    conn.fwd_sent = conn.fwd_cnt;
                    self.sync(t);
                    return Some((h, 0));
                }
                Ok(n) => {
                    conn.tx_cnt = conn.tx_cnt.wrapping_add(n as u32);
                    let mut h = pkt(self.cid, conn.key, op::RW, 0);
                    h.len = n as u32;
                    h.fwd_cnt = conn.fwd_cnt;
                    conn.fwd_sent = conn.fwd_cnt;
                    self.c.rx_bytes.add(n as u64);
                    // More may be waiting: it stays ready, behind the others.
                    if conn.may_read() {
                        conn.in_ready = true;
                        self.ready.push_back(t);
                    }
                    self.sync(t);
                    return Some((h, n));
                }
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted
                    ) =>
                {
                    self.sync(t);
                }
                Err(e) => {
                    log::debug!("vsock: host stream of {:?}: {e}", conn.key);
                    let h = pkt(self.cid, conn.key, op::RST, 0);
                    self.remove(t);
                    self.c.rst_sent.inc();
                    return Some((h, 0));
                }
            }
        }
        None
    }
}

/// A packet from the host to guest `cid` on connection `key`.
fn pkt(cid: u64, key: Key, op: u16, flags: u32) -> Hdr {
    Hdr {
        src_cid: HOST_CID,
        dst_cid: cid,
        src_port: key.0,
        dst_port: key.1,
        len: 0,
        type_: op::TYPE_STREAM,
        op,
        flags,
        buf_alloc: BUF_ALLOC,
        fwd_cnt: 0,
    }
}

/// `CONNECT <port>` (the line without its newline) → the guest port.
fn parse_connect(line: &[u8]) -> Option<u32> {
    let s = std::str::from_utf8(line).ok()?;
    let p = s.strip_prefix("CONNECT ")?.trim_end_matches('\r');
    if p.is_empty() || !p.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    p.parse().ok()
}

struct VsockBackend {
    mux: Muxer,
    listener: Option<Arc<UnixListener>>,
    /// The worker's queue positions of rx and tx.
    rx: usize,
    tx: usize,
    descs: Vec<Desc>,
    regions: Vec<Region>,
    rest: Vec<Region>,
    buf: Vec<u8>,
}

impl VsockBackend {
    fn process_tx(&mut self, io: &mut Io) -> bool {
        let qi = self.tx;
        let mut found = false;
        let mut descs = std::mem::take(&mut self.descs);
        'outer: loop {
            io.disable_notify(qi);
            loop {
                if io.halted() {
                    break 'outer;
                }
                let head = match io.pop(qi, &mut descs) {
                    Pop::Chain(h) => h,
                    Pop::Empty => break,
                    Pop::Fatal => break 'outer,
                };
                found = true;
                self.tx_packet(io, &descs);
                io.complete(qi, head, 0);
            }
            io.end_batch(qi);
            if io.halted() || !io.enable_notify(qi) {
                break;
            }
        }
        self.descs = descs;
        found
    }

    /// One tx chain: header, then payload, in the device-readable buffers.
    fn tx_packet(&mut self, io: &Io, descs: &[Desc]) {
        self.regions.clear();
        self.regions.extend(
            descs
                .iter()
                .filter(|d| !d.is_write_only())
                .map(|d| (d.addr().0, u64::from(d.len()))),
        );
        let room: u64 = self.regions.iter().map(|r| r.1).sum();
        let mut raw = [0u8; PKT_HEADER_SIZE];
        if room < PKT_HEADER_SIZE as u64 || gather(io, &self.regions, &mut raw).is_err() {
            self.mux.c.bad_packets.inc();
            io.c.errors.inc();
            return;
        }
        let h = Hdr::parse(&raw);
        let len = h.len as usize;
        if h.len > MAX_PAYLOAD || u64::from(h.len) > room - PKT_HEADER_SIZE as u64 {
            return self.mux.bad(&h, "length beyond its buffers");
        }
        if h.op != op::RW && h.len != 0 {
            return self.mux.bad(&h, "payload on a control packet");
        }
        if len > 0 {
            split_off(&self.regions, PKT_HEADER_SIZE as u64, &mut self.rest);
            if gather(io, &self.rest, &mut self.buf[..len]).is_err() {
                io.c.errors.inc();
                return self.mux.bad(&h, "payload not readable");
            }
            io.c.bytes_read.add(len as u64);
        }
        self.mux.on_guest(&h, &self.buf[..len]);
    }

    /// Gives the guest what it is owed while it offers rx buffers.
    fn fill_rx(&mut self, io: &mut Io) -> bool {
        let qi = self.rx;
        let mut found = false;
        let mut descs = std::mem::take(&mut self.descs);
        'outer: loop {
            io.disable_notify(qi);
            while self.mux.has_output() {
                if io.halted() {
                    break 'outer;
                }
                let head = match io.pop(qi, &mut descs) {
                    Pop::Chain(h) => h,
                    Pop::Empty => break,
                    Pop::Fatal => break 'outer,
                };
                found = true;
                self.regions.clear();
                self.regions.extend(
                    descs
                        .iter()
                        .filter(|d| d.is_write_only())
                        .map(|d| (d.addr().0, u64::from(d.len()))),
                );
                let room: u64 = self.regions.iter().map(|r| r.1).sum();
                if room < PKT_HEADER_SIZE as u64 {
                    io.c.errors.inc();
                    io.complete(qi, head, 0);
                    continue;
                }
                let data_room = (room - PKT_HEADER_SIZE as u64).min(u64::from(MAX_PAYLOAD));
                let Some((h, n)) = self.mux.next_output(&mut self.buf[..data_room as usize]) else {
                    io.unpop(qi);
                    break 'outer;
                };
                let mut ok = scatter(io, &self.regions, &h.encode()).is_ok();
                if ok && n > 0 {
                    split_off(&self.regions, PKT_HEADER_SIZE as u64, &mut self.rest);
                    ok = scatter(io, &self.rest, &self.buf[..n]).is_ok();
                }
                if ok {
                    io.c.bytes_written.add((PKT_HEADER_SIZE + n) as u64);
                    io.complete(qi, head, (PKT_HEADER_SIZE + n) as u32);
                } else {
                    io.c.errors.inc();
                    io.complete(qi, head, 0);
                }
            }
            io.end_batch(qi);
            // Output left and no buffer: ask for a kick when the guest adds one.
            if io.halted() || !self.mux.has_output() || !io.enable_notify(qi) {
                break;
            }
        }
        io.end_batch(qi);
        self.descs = descs;
        found
    }
}

impl Backend for VsockBackend {
    fn process_queue(&mut self, io: &mut Io, qi: usize) -> bool {
        let mut found = false;
        if qi == self.tx {
            found |= self.process_tx(io);
        }
        if qi == self.tx || qi == self.rx {
            found |= self.fill_rx(io);
        }
        found
    }

    fn extra_fd(&self) -> Option<RawFd> {
        Some(self.mux.epoll.as_raw_fd())
    }

    fn extra_wanted(&self) -> bool {
        true
    }

    fn on_extra(&mut self, io: &mut Io) -> bool {
        self.mux.poll_host(self.listener.as_deref());
        self.fill_rx(io)
    }
}

/// The `vsock` fuzz target: `data` is a stream of tx packets (a 44-byte header, then as many
/// payload bytes as the header's `len` says, as far as the input goes) fed to the protocol with
/// every guest connection given a socket pair; what the device owes the guest is drained after
/// each. Never panics. Returns (`bad_packets`, `rst_sent`).
#[doc(hidden)]
pub fn fuzz_packets(data: &[u8]) -> (u64, u64) {
    let stats = StatsRegistry::new();
    let c = Counters::new(&stats, "fuzz");
    let Ok(mut mux) = Muxer::new(3, c, Link::Pairs(Vec::new())) else {
        return (0, 0);
    };
    let mut buf = vec![0u8; 4096];
    let mut at = 0;
    while at + PKT_HEADER_SIZE <= data.len() {
        let mut raw = [0u8; PKT_HEADER_SIZE];
        raw.copy_from_slice(&data[at..at + PKT_HEADER_SIZE]);
        at += PKT_HEADER_SIZE;
        let h = Hdr::parse(&raw);
        assert_eq!(Hdr::parse(&h.encode()), h);
        let len = (h.len as usize).min(data.len() - at);
        let payload = &data[at..at + len];
        at += len;
        if h.len > MAX_PAYLOAD || h.len as usize != len {
            mux.bad(&h, "length beyond its buffers");
        } else {
            mux.on_guest(&h, payload);
        }
        // The far ends talk back: bytes for the guest, some of them closed.
        if let Link::Pairs(far) = &mut mux.link {
            for (i, s) in far.iter_mut().enumerate() {
                let _ = s.write(&payload[..payload.len().min(64)]);
                let mut sink = [0u8; 512];
                let _ = s.read(&mut sink);
                if h.flags & 0x100 != 0 && i == 0 {
                    let _ = s.shutdown(std::net::Shutdown::Both);
                }
            }
        }
        mux.poll_host(None);
        let mut n = 0;
        while mux.has_output() && n < 256 {
            let _ = mux.next_output(&mut buf);
            n += 1;
        }
        assert!(mux.conns.len() <= MAX_CONNECTIONS);
    }
    (mux.c.bad_packets.get(), mux.c.rst_sent.get())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hdr(op: u16, src_port: u32, dst_port: u32, len: u32) -> Hdr {
        Hdr {
            src_cid: 3,
            dst_cid: HOST_CID,
            src_port,
            dst_port,
            len,
            type_: op::TYPE_STREAM,
            op,
            flags: 0,
            buf_alloc: 65536,
            fwd_cnt: 0,
        }
    }

    fn mux() -> Muxer {
        let stats = StatsRegistry::new();
        Muxer::new(3, Counters::new(&stats, "t"), Link::Pairs(Vec::new())).unwrap()
    }

    fn drain(m: &mut Muxer) -> Vec<(Hdr, Vec<u8>)> {
        let mut out = Vec::new();
        let mut buf = vec![0u8; 4096];
        while m.has_output() {
            match m.next_output(&mut buf) {
                Some((h, n)) => out.push((h, buf[..n].to_vec())),
                None => break,
            }
        }
        out
    }

    #[test]
    fn header_round_trips_through_the_crate() {
        let h = hdr(op::RW, 1234, 5678, 99);
        let raw = h.encode();
        assert_eq!(raw.len(), 44);
        assert_eq!(&raw[0..8], &3u64.to_le_bytes());
        assert_eq!(&raw[24..28], &99u32.to_le_bytes());
        assert_eq!(Hdr::parse(&raw), h);
    }

    #[test]
    fn handshake_lines() {
        assert_eq!(parse_connect(b"CONNECT 1234"), Some(1234));
        assert_eq!(parse_connect(b"CONNECT 4294967295"), Some(u32::MAX));
        assert_eq!(parse_connect(b"CONNECT 4294967296"), None);
        assert_eq!(parse_connect(b"CONNECT -1"), None);
        assert_eq!(parse_connect(b"GET / HTTP/1.1"), None);
        assert_eq!(parse_connect(b"CONNECT "), None);
    }

    #[test]
    fn guest_connection_carries_data_and_credit() {
        let mut m = mux();
        m.on_guest(&hdr(op::REQUEST, 50, 7000, 0), &[]);
        let out = drain(&mut m);
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].0.op, op::RESPONSE);
        assert_eq!((out[0].0.src_port, out[0].0.dst_port), (7000, 50));
        m.on_guest(&hdr(op::RW, 50, 7000, 5), b"hello");
        let Link::Pairs(far) = &mut m.link else {
            unreachable!()
        };
        let mut got = [0u8; 5];
        far[0].read_exact(&mut got).unwrap();
        assert_eq!(&got, b"hello");
        far[0].write_all(b"back").unwrap();
        m.poll_host(None);
        let out = drain(&mut m);
        assert_eq!(out[0].0.op, op::RW);
        assert_eq!(out[0].1, b"back");
        assert_eq!(out[0].0.fwd_cnt, 5);
        // Credit overflow: more than BUF_ALLOC in flight is RST.
        let big = vec![0u8; MAX_PAYLOAD as usize];
        let Link::Pairs(far) = &mut m.link else {
            unreachable!()
        };
        far[0].set_nonblocking(true).unwrap();
        let mut ops = Vec::new();
        for _ in 0..(BUF_ALLOC / MAX_PAYLOAD + 64) {
            m.on_guest(&hdr(op::RW, 50, 7000, MAX_PAYLOAD), &big);
            ops.extend(drain(&mut m).into_iter().map(|(h, _)| h.op));
            if ops.contains(&op::RST) {
                break;
            }
        }
        assert!(ops.contains(&op::RST), "{ops:?}");
        assert_eq!(m.c.credit_overflows.get(), 1);
        assert!(m.conns.is_empty());
    }

    #[test]
    fn bad_packets_get_rst() {
        let mut m = mux();
        m.on_guest(&hdr(op::RW, 1, 2, 0), &[]);
        let mut h = hdr(op::REQUEST, 1, 2, 0);
        h.type_ = 2;
        m.on_guest(&h, &[]);
        let mut h = hdr(op::REQUEST, 1, 2, 0);
        h.src_cid = 9;
        m.on_guest(&h, &[]);
        m.on_guest(&hdr(op::RST, 1, 2, 0), &[]);
        let out = drain(&mut m);
        assert_eq!(out.len(), 3);
        assert!(out.iter().all(|(h, _)| h.op == op::RST));
        assert_eq!(m.c.bad_packets.get(), 3);
        m.on_guest(&hdr(op::REQUEST, 1, 2, 0), &[]);
        m.on_guest(&hdr(99, 1, 2, 0), &[]);
        let ops: Vec<u16> = drain(&mut m).iter().map(|(h, _)| h.op).collect();
        assert_eq!(ops, [op::RESPONSE, op::RST]);
        assert!(m.conns.is_empty());
    }

    /// The committed seeds (`fuzz/seeds/vsock_packets`, written by `seeds/vsock_seeds.py`).
    #[test]
    fn seeds_do_what_they_are_named_after() {
        let dir = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../fuzz/seeds/vsock_packets"
        );
        let seed = |n: &str| std::fs::read(format!("{dir}/{n}")).expect("seed");
        assert_eq!(fuzz_packets(&seed("connect-rw-shutdown")), (0, 1));
        assert_eq!(fuzz_packets(&seed("bad-headers")), (7, 7));
        assert_eq!(fuzz_packets(&seed("many-connections")).0, 0);
        for n in ["credit-overflow", "host-hangup"] {
            fuzz_packets(&seed(n));
        }
    }

    #[test]
    fn fuzz_entry_survives_garbage() {
        fuzz_packets(&[0xff; 200]);
        let mut d = hdr(op::REQUEST, 1, 2, 0).encode().to_vec();
        d.extend(hdr(op::RW, 1, 2, 3).encode());
        d.extend(b"abc");
        d.extend(hdr(op::SHUTDOWN, 1, 2, 0).encode());
        fuzz_packets(&d);
    }
}
