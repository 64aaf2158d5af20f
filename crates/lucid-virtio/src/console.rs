//! virtio-console (virtio 1.2, 5.3): a console beside the serial port. Queue 0 (receiveq)
//! carries port 0's input to the guest, queue 1 (transmitq) its output. No `F_SIZE`.
//!
//! With more ports ([`ConsoleConfig::ports`], each a file) the device offers `F_MULTIPORT`:
//! `max_nr_ports` in the configuration space, the control queues 2 (to the guest) and 3 (from
//! it), and port N's queues at 2N + 2 and 2N + 3. When the driver says `DEVICE_READY` the device
//! adds every port; when it says `PORT_READY` for one, port 0 is made the console
//! (`CONSOLE_PORT`), port N > 0 gets its name `lucid.portN` (`PORT_NAME`), and each is opened
//! (`PORT_OPEN`). Port N's output goes to its own file; it has no input.
//!
//! Output goes to Lucid's stdout ([`ConsoleOutput::Tty`]), a file (created or truncated), or
//! the client of a Unix socket Lucid listens on ([`ConsoleOutput::Socket`]; output with no
//! client, or that a client does not take at once, is dropped and counted). Input comes from
//! the socket's client: it waits in a bounded buffer for the guest's receive buffers, and the
//! socket is not read while that buffer is full.
//!
//! The back-end is the device's worker thread (`lucid-<name>-io`, seccomp role `backend`).
//! With a socket, the worker's extra descriptor is an epoll set of the listener and the client,
//! so a client that connects, leaves and comes back is seen without another thread.
//!
//! Counters, under `<name>.`: the worker's (`requests`, `bytes_read`: output taken from the
//! guest, `bytes_written`: input given to it, `kicks`, `irqs`, `errors`, ...), `tx_dropped`
//! (output bytes no one took), `clients` (socket clients accepted).

use std::collections::VecDeque;
use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::Arc;

use lucid_stats::{Counter, StatsRegistry};
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};

use crate::worker::{gather, scatter, Backend, Desc, Io, Pop, Region, Served, WorkerSlot};
use crate::{device_type, features, ActivateContext, ActivateError, VirtioDevice};

pub const QUEUE_SIZE: u16 = 128;
pub const RX_QUEUE: u16 = 0;
pub const TX_QUEUE: u16 = 1;
/// With `F_MULTIPORT`: control messages to the driver, and from it.
pub const CONTROL_RX: u16 = 2;
pub const CONTROL_TX: u16 = 3;
/// Input held for the guest at most; the socket is not read beyond it.
pub const INPUT_BUFFER: usize = 64 << 10;
/// Output taken from one chain at most (the rest of a longer chain is dropped and counted).
const MAX_CHAIN: usize = 1 << 20;

/// Where port 0's output goes (`--console-virtio`).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ConsoleOutput {
    /// Lucid's standard output.
    Tty,
    /// A file, created or truncated.
    File(PathBuf),
    /// A Unix socket Lucid listens on; its client also gives input.
    Socket(PathBuf),
}

/// What `--console-virtio` asks for.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConsoleConfig {
    pub output: ConsoleOutput,
    /// Ports 1.., each writing to its file (created or truncated); any makes the device
    /// multiport.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ports: Vec<PathBuf>,
}

/// Most ports besides port 0.
pub const MAX_EXTRA_PORTS: usize = 15;
/// `VIRTIO_CONSOLE_F_MULTIPORT`.
pub const F_MULTIPORT: u64 = 1 << 1;

/// Control message events (virtio 1.2, 5.3.6.2).
pub mod event {
    pub const DEVICE_READY: u16 = 0;
    pub const DEVICE_ADD: u16 = 1;
    pub const PORT_READY: u16 = 3;
    pub const CONSOLE_PORT: u16 = 4;
    pub const PORT_OPEN: u16 = 6;
    pub const PORT_NAME: u16 = 7;
}

/// The name port `n` (> 0) is announced with.
pub fn port_name(n: usize) -> String {
    format!("lucid.port{n}")
}

/// A control message: id (le32), event (le16), value (le16), then a name for `PORT_NAME`.
fn control(id: u32, ev: u16, value: u16, name: &str) -> Vec<u8> {
    let mut m = id.to_le_bytes().to_vec();
    m.extend_from_slice(&ev.to_le_bytes());
    m.extend_from_slice(&value.to_le_bytes());
    m.extend_from_slice(name.as_bytes());
    m
}

/// The device's answer to control message `msg` from the driver, with `ports` ports.
pub fn control_reply(msg: &[u8], ports: u32) -> Vec<Vec<u8>> {
    if msg.len() < 8 {
        return Vec::new();
    }
    let id = u32::from_le_bytes([msg[0], msg[1], msg[2], msg[3]]);
    let ev = u16::from_le_bytes([msg[4], msg[5]]);
    let value = u16::from_le_bytes([msg[6], msg[7]]);
    match (ev, value) {
        (event::DEVICE_READY, 1) => (0..ports)
            .map(|p| control(p, event::DEVICE_ADD, 0, ""))
            .collect(),
        (event::PORT_READY, 1) if id < ports => {
            let first = match id {
                0 => control(0, event::CONSOLE_PORT, 1, ""),
                n => control(n, event::PORT_NAME, 0, &port_name(n as usize)),
            };
            vec![first, control(id, event::PORT_OPEN, 1, "")]
        }
        _ => Vec::new(),
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ConsoleError {
    #[error("console output file {path}: {source}")]
    File {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("console socket {path}: {source}")]
    Socket {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("console: {0} ports besides port 0; at most {MAX_EXTRA_PORTS}")]
    TooManyPorts(usize),
}

#[derive(Clone)]
struct Counters {
    tx_dropped: Arc<Counter>,
    clients: Arc<Counter>,
    control: Arc<Counter>,
}

/// What output goes to, opened when the device is made (so a bad path fails the VM's build).
enum Sink {
    Tty,
    File(Arc<File>),
    Socket(Arc<UnixListener>),
}

/// A virtio-console device with port 0.
pub struct Console {
    name: String,
    cfg: ConsoleConfig,
    sink: Sink,
    /// Ports 1.. (their files).
    extra: Vec<Arc<File>>,
    queue_sizes: Vec<u16>,
    c: Counters,
    worker: WorkerSlot,
}

impl Console {
    pub fn new(
        name: String,
        cfg: ConsoleConfig,
        stats: &StatsRegistry,
    ) -> Result<Console, ConsoleError> {
        if cfg.ports.len() > MAX_EXTRA_PORTS {
            return Err(ConsoleError::TooManyPorts(cfg.ports.len()));
        }
        let create = |p: &PathBuf| {
            File::create(p)
                .map(Arc::new)
                .map_err(|source| ConsoleError::File {
                    path: p.clone(),
                    source,
                })
        };
        let extra = cfg
            .ports
            .iter()
            .map(create)
            .collect::<Result<Vec<_>, _>>()?;
        let sink = match &cfg.output {
            ConsoleOutput::Tty => Sink::Tty,
            ConsoleOutput::File(p) => Sink::File(Arc::new(File::create(p).map_err(|source| {
                ConsoleError::File {
                    path: p.clone(),
                    source,
                }
            })?)),
            ConsoleOutput::Socket(p) => {
                let err = |source| ConsoleError::Socket {
                    path: p.clone(),
                    source,
                };
                // A socket left by an earlier run would make bind fail.
                if std::fs::symlink_metadata(p)
                    .is_ok_and(|m| std::os::unix::fs::FileTypeExt::is_socket(&m.file_type()))
                {
                    let _ = std::fs::remove_file(p);
                }
                let l = UnixListener::bind(p).map_err(err)?;
                l.set_nonblocking(true).map_err(err)?;
                Sink::Socket(Arc::new(l))
            }
        };
        let c = |n: &str| stats.counter(format!("{name}.{n}"));
        let c = Counters {
            tx_dropped: c("tx_dropped"),
            clients: c("clients"),
            control: c("control_messages"),
        };
        // Port 0's queues, then the control queues and each port's with more ports.
        let queues = match extra.len() {
            0 => 2,
            n => 4 + 2 * n,
        };
        Ok(Console {
            name,
            cfg,
            sink,
            extra,
            queue_sizes: vec![QUEUE_SIZE; queues],
            c,
            worker: WorkerSlot::default(),
        })
    }

    pub fn config(&self) -> &ConsoleConfig {
        &self.cfg
    }
}

impl VirtioDevice for Console {
    fn name(&self) -> &str {
        &self.name
    }

    fn device_type(&self) -> u32 {
        device_type::CONSOLE
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &self.queue_sizes
    }

    fn features(&self) -> u64 {
        let multiport = if self.extra.is_empty() {
            0
        } else {
            F_MULTIPORT
        };
        features::VIRTIO_F_VERSION_1
            | features::VIRTIO_F_ACCESS_PLATFORM
            | features::VIRTIO_RING_F_EVENT_IDX
            | multiport
    }

    /// cols (le16), rows (le16), max_nr_ports (le32), emerg_wr (le32): only max_nr_ports is set.
    fn read_config(&self, offset: u64, data: &mut [u8]) {
        let mut space = [0u8; 12];
        space[4..8].copy_from_slice(&(1 + self.extra.len() as u32).to_le_bytes());
        crate::blk::read_config_bytes(&space, offset, data);
    }

    fn write_config(&mut self, _offset: u64, _data: &[u8]) {}

    fn activate(&mut self, mut ctx: ActivateContext) -> Result<(), ActivateError> {
        let multiport = ctx.features & F_MULTIPORT != 0 && !self.extra.is_empty();
        if !multiport {
            ctx.queues
                .retain(|(i, _, _)| *i == RX_QUEUE || *i == TX_QUEUE);
        }
        let pos = |idx: u16| ctx.queues.iter().position(|(i, _, _)| *i == idx);
        let (rx, tx) = (pos(RX_QUEUE), pos(TX_QUEUE));
        let (ctrl_rx, ctrl_tx) = match multiport {
            true => (pos(CONTROL_RX), pos(CONTROL_TX)),
            false => (None, None),
        };
        // Port n > 0 transmits on queue 2n + 3.
        let ports: Vec<(Option<usize>, Arc<File>)> = match multiport {
            true => (1..=self.extra.len())
                .map(|n| (pos(2 * n as u16 + 3), self.extra[n - 1].clone()))
                .collect(),
            false => Vec::new(),
        };
        if tx.is_none() {
            return Err(ActivateError::QueueMissing {
                device: self.name.clone(),
                queue: TX_QUEUE,
            });
        }
        let thread_err = |source| ActivateError::Thread {
            device: self.name.clone(),
            source,
        };
        let out = match &self.sink {
            Sink::Tty => Out::Tty,
            Sink::File(f) => Out::File(f.clone()),
            Sink::Socket(l) => {
                let epoll = Epoll::new().map_err(thread_err)?;
                epoll
                    .ctl(
                        ControlOperation::Add,
                        l.as_raw_fd(),
                        EpollEvent::new(EventSet::IN, EV_LISTENER),
                    )
                    .map_err(thread_err)?;
                Out::Socket {
                    listener: l.clone(),
                    client: None,
                    epoll,
                }
            }
        };
        let backend = ConsoleWorker {
            out,
            rx,
            tx,
            ctrl_rx,
            ctrl_tx,
            ports,
            nports: 1 + self.extra.len() as u32,
            ctrl_out: VecDeque::new(),
            input: VecDeque::new(),
            buf: Vec::new(),
            regions: Vec::new(),
            descs: Vec::new(),
            c: self.c.clone(),
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

const EV_LISTENER: u64 = 0;
const EV_CLIENT: u64 = 1;

enum Out {
    Tty,
    File(Arc<File>),
    Socket {
        listener: Arc<UnixListener>,
        client: Option<UnixStream>,
        epoll: Epoll,
    },
}

struct ConsoleWorker {
    out: Out,
    rx: Option<usize>,
    tx: Option<usize>,
    ctrl_rx: Option<usize>,
    ctrl_tx: Option<usize>,
    /// Ports 1..: the position of the transmit queue, and the file.
    ports: Vec<(Option<usize>, Arc<File>)>,
    nports: u32,
    /// Control messages the driver has not taken yet.
    ctrl_out: VecDeque<Vec<u8>>,
    /// Input the guest has not taken yet.
    input: VecDeque<u8>,
    buf: Vec<u8>,
    regions: Vec<Region>,
    descs: Vec<Desc>,
    c: Counters,
}

impl ConsoleWorker {
    /// One output chain: its device-readable bytes go to the sink.
    fn transmit(&mut self, io: &Io, descs: &[Desc]) -> Served {
        if !self.take_chain(io, descs) {
            return Served::Used(0);
        }
        let buf = std::mem::take(&mut self.buf);
        let written = self.write_out(&buf);
        self.buf = buf;
        if let Err(e) = written {
            io.c.errors.inc();
            log::debug!("{}: output: {e}", io.name());
        }
        Served::Used(0)
    }

    /// One chain's device-readable bytes (at most `MAX_CHAIN`) into `self.buf`.
    fn take_chain(&mut self, io: &Io, descs: &[Desc]) -> bool {
        self.regions.clear();
        self.regions.extend(
            descs
                .iter()
                .filter(|d| !d.is_write_only())
                .map(|d| (d.addr().0, u64::from(d.len()))),
        );
        let len: u64 = self.regions.iter().map(|r| r.1).sum();
        let take = (len as usize).min(MAX_CHAIN);
        self.c.tx_dropped.add(len - take as u64);
        self.buf.resize(take, 0);
        if let Err(e) = gather(io, &self.regions, &mut self.buf) {
            io.c.errors.inc();
            log::debug!("{}: output buffer: {e}", io.name());
            return false;
        }
        io.c.bytes_read.add(take as u64);
        true
    }

    /// Port `n` (> 0): its output to its file.
    fn transmit_port(&mut self, io: &Io, descs: &[Desc], n: usize) -> Served {
        if self.take_chain(io, descs) {
            if let Err(e) = (&*self.ports[n].1).write_all(&self.buf) {
                io.c.errors.inc();
                log::debug!("{}: port {}: {e}", io.name(), n + 1);
            }
        }
        Served::Used(0)
    }

    /// A control message from the driver: queues the device's answers.
    fn control_in(&mut self, io: &Io, descs: &[Desc]) -> Served {
        if self.take_chain(io, descs) {
            self.c.control.inc();
            let replies = control_reply(&self.buf, self.nports);
            self.ctrl_out.extend(replies);
        }
        Served::Used(0)
    }

    /// Gives queued control messages to the driver, one per buffer.
    fn control_out(&mut self, io: &mut Io) -> bool {
        let Some(q) = self.ctrl_rx else {
            return false;
        };
        let mut found = false;
        let mut descs = std::mem::take(&mut self.descs);
        io.disable_notify(q);
        while !self.ctrl_out.is_empty() && !io.halted() {
            let head = match io.pop(q, &mut descs) {
                Pop::Chain(h) => h,
                Pop::Fatal => break,
                Pop::Empty => {
                    if io.enable_notify(q) {
                        io.disable_notify(q);
                        continue;
                    }
                    break;
                }
            };
            found = true;
            self.regions.clear();
            self.regions.extend(
                descs
                    .iter()
                    .filter(|d| d.is_write_only())
                    .map(|d| (d.addr().0, u64::from(d.len()))),
            );
            let msg = self.ctrl_out.pop_front().unwrap_or_default();
            let room: u64 = self.regions.iter().map(|r| r.1).sum();
            let n = msg.len().min(room as usize);
            let len = match scatter(io, &self.regions, &msg[..n]) {
                Ok(()) => n as u32,
                Err(e) => {
                    io.c.errors.inc();
                    log::debug!("{}: control buffer: {e}", io.name());
                    0
                }
            };
            io.complete(q, head, len);
        }
        io.end_batch(q);
        self.descs = descs;
        found
    }

    fn write_out(&mut self, buf: &[u8]) -> std::io::Result<()> {
        match &mut self.out {
            Out::Tty => {
                let mut o = std::io::stdout().lock();
                o.write_all(buf)?;
                o.flush()
            }
            Out::File(f) => (&**f).write_all(buf),
            Out::Socket { client, epoll, .. } => {
                let Some(s) = client else {
                    self.c.tx_dropped.add(buf.len() as u64);
                    return Ok(());
                };
                // Non-blocking: a client that does not read loses output, the guest goes on.
                let mut at = 0;
                while at < buf.len() {
                    match s.write(&buf[at..]) {
                        Ok(0) => break,
                        Ok(n) => at += n,
                        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                        Err(_) => {
                            drop_client(epoll, client);
                            break;
                        }
                    }
                }
                self.c.tx_dropped.add((buf.len() - at) as u64);
                Ok(())
            }
        }
    }

    /// Gives waiting input to the guest's receive buffers; returns whether any chain was used.
    fn deliver(&mut self, io: &mut Io) -> bool {
        let Some(rx) = self.rx else {
            return false;
        };
        let mut found = false;
        let mut descs = std::mem::take(&mut self.descs);
        io.disable_notify(rx);
        while !self.input.is_empty() && !io.halted() {
            let head = match io.pop(rx, &mut descs) {
                Pop::Chain(h) => h,
                Pop::Fatal => break,
                Pop::Empty => {
                    // Out of buffers: a kick brings the driver's next ones.
                    if io.enable_notify(rx) {
                        io.disable_notify(rx);
                        continue;
                    }
                    break;
                }
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
            let n = (room as usize).min(self.input.len());
            let bytes: Vec<u8> = self.input.iter().take(n).copied().collect();
            let len = match scatter(io, &self.regions, &bytes) {
                Ok(()) => {
                    self.input.drain(..n);
                    io.c.bytes_written.add(n as u64);
                    n as u32
                }
                Err(e) => {
                    io.c.errors.inc();
                    log::debug!("{}: input buffer: {e}", io.name());
                    0
                }
            };
            io.complete(rx, head, len);
        }
        io.end_batch(rx);
        self.descs = descs;
        found
    }

    /// The socket side: a new client replaces the old one; the client's bytes become input.
    fn poll_socket(&mut self) {
        let Out::Socket {
            listener,
            client,
            epoll,
        } = &mut self.out
        else {
            return;
        };
        let mut events = [EpollEvent::default(); 2];
        let n = epoll.wait(0, &mut events).unwrap_or(0);
        for ev in &events[..n] {
            match ev.data() {
                EV_LISTENER => {
                    while let Ok((s, _)) = listener.accept() {
                        if s.set_nonblocking(true).is_err() {
                            continue;
                        }
                        drop_client(epoll, client);
                        let added = epoll.ctl(
                            ControlOperation::Add,
                            s.as_raw_fd(),
                            EpollEvent::new(EventSet::IN, EV_CLIENT),
                        );
                        if added.is_ok() {
                            self.c.clients.inc();
                            *client = Some(s);
                        }
                    }
                }
                _ => {
                    let mut chunk = [0u8; 4096];
                    while self.input.len() < INPUT_BUFFER {
                        let Some(s) = client.as_mut() else { break };
                        let room = (INPUT_BUFFER - self.input.len()).min(chunk.len());
                        match s.read(&mut chunk[..room]) {
                            Ok(0) => drop_client(epoll, client),
                            Ok(k) => self.input.extend(&chunk[..k]),
                            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                            Err(_) => drop_client(epoll, client),
                        }
                    }
                }
            }
        }
    }
}

fn drop_client(epoll: &Epoll, client: &mut Option<UnixStream>) {
    if let Some(s) = client.take() {
        let _ = epoll.ctl(
            ControlOperation::Delete,
            s.as_raw_fd(),
            EpollEvent::default(),
        );
    }
}

impl Backend for ConsoleWorker {
    fn process_queue(&mut self, io: &mut Io, qi: usize) -> bool {
        if Some(qi) == self.tx {
            io.serve(qi, &mut |io, descs| self.transmit(io, descs))
        } else if Some(qi) == self.rx {
            self.deliver(io)
        } else if Some(qi) == self.ctrl_tx {
            let found = io.serve(qi, &mut |io, descs| self.control_in(io, descs));
            self.control_out(io) || found
        } else if Some(qi) == self.ctrl_rx {
            self.control_out(io)
        } else if let Some(n) = self.ports.iter().position(|p| p.0 == Some(qi)) {
            io.serve(qi, &mut |io, descs| self.transmit_port(io, descs, n))
        } else {
            false
        }
    }

    fn extra_fd(&self) -> Option<RawFd> {
        match &self.out {
            Out::Socket { epoll, .. } => Some(epoll.as_raw_fd()),
            _ => None,
        }
    }

    fn extra_wanted(&self) -> bool {
        self.input.len() < INPUT_BUFFER
    }

    fn on_extra(&mut self, io: &mut Io) -> bool {
        self.poll_socket();
        self.deliver(io)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_console_creates_its_file_and_a_socket_replaces_a_stale_one() {
        let stats = StatsRegistry::new();
        let dir = std::env::temp_dir().join(format!("lucid-console-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("out");
        std::fs::write(&file, b"old").unwrap();
        let cfg = ConsoleConfig {
            output: ConsoleOutput::File(file.clone()),
            ports: Vec::new(),
        };
        let c = Console::new("console".into(), cfg, &stats).unwrap();
        assert_eq!(c.device_type(), 3);
        assert_eq!(c.queue_max_sizes(), &[QUEUE_SIZE, QUEUE_SIZE]);
        assert_eq!(std::fs::read(&file).unwrap(), b"", "truncated");
        let sock = dir.join("sock");
        let cfg = ConsoleConfig {
            output: ConsoleOutput::Socket(sock.clone()),
            ports: Vec::new(),
        };
        drop(Console::new("console".into(), cfg.clone(), &stats).unwrap());
        // The socket file stays behind; the next device binds over it.
        Console::new("console".into(), cfg, &stats).unwrap();
        let bad = ConsoleConfig {
            output: ConsoleOutput::File(dir.join("no/such/dir")),
            ports: Vec::new(),
        };
        assert!(Console::new("console".into(), bad, &stats).is_err());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn the_control_protocol_adds_names_and_opens_every_port() {
        let msg = |id: u32, ev: u16, value: u16| control(id, ev, value, "");
        let adds = control_reply(&msg(0, event::DEVICE_READY, 1), 2);
        assert_eq!(
            adds,
            [msg(0, event::DEVICE_ADD, 0), msg(1, event::DEVICE_ADD, 0)]
        );
        assert_eq!(
            control_reply(&msg(0, event::PORT_READY, 1), 2),
            [msg(0, event::CONSOLE_PORT, 1), msg(0, event::PORT_OPEN, 1)]
        );
        let named = control_reply(&msg(1, event::PORT_READY, 1), 2);
        assert_eq!(&named[0][8..], b"lucid.port1");
        assert_eq!(
            u16::from_le_bytes([named[0][4], named[0][5]]),
            event::PORT_NAME
        );
        assert_eq!(named[1], msg(1, event::PORT_OPEN, 1));
        // A port that does not exist, a failed add, a short message: no answer.
        assert!(control_reply(&msg(2, event::PORT_READY, 1), 2).is_empty());
        assert!(control_reply(&msg(1, event::PORT_READY, 0), 2).is_empty());
        assert!(control_reply(&[0; 7], 2).is_empty());
        // Multiport's configuration: max_nr_ports at offset 4.
        let stats = StatsRegistry::new();
        let dir = std::env::temp_dir().join(format!("lucid-console-mp-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let cfg = ConsoleConfig {
            output: ConsoleOutput::File(dir.join("0")),
            ports: vec![dir.join("1"), dir.join("2")],
        };
        let c = Console::new("console".into(), cfg, &stats).unwrap();
        assert_ne!(c.features() & F_MULTIPORT, 0);
        assert_eq!(c.queue_max_sizes().len(), 8);
        let mut n = [0u8; 4];
        c.read_config(4, &mut n);
        assert_eq!(u32::from_le_bytes(n), 3);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
