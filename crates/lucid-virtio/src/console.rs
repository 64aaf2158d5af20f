//! virtio-console (virtio 1.2, 5.3), port 0 only: a console beside the serial port. Queue 0
//! (receiveq) carries input to the guest, queue 1 (transmitq) its output. No feature of its
//! own (no `F_SIZE`, no `F_MULTIPORT`): the configuration space reads as zeros.
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
}

#[derive(Clone)]
struct Counters {
    tx_dropped: Arc<Counter>,
    clients: Arc<Counter>,
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
    queue_sizes: [u16; 2],
    c: Counters,
    worker: WorkerSlot,
}

impl Console {
    pub fn new(
        name: String,
        cfg: ConsoleConfig,
        stats: &StatsRegistry,
    ) -> Result<Console, ConsoleError> {
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
        };
        Ok(Console {
            name,
            cfg,
            sink,
            queue_sizes: [QUEUE_SIZE; 2],
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
        features::VIRTIO_F_VERSION_1
            | features::VIRTIO_F_ACCESS_PLATFORM
            | features::VIRTIO_RING_F_EVENT_IDX
    }

    fn read_config(&self, _offset: u64, data: &mut [u8]) {
        data.fill(0);
    }

    fn write_config(&mut self, _offset: u64, _data: &[u8]) {}

    fn activate(&mut self, mut ctx: ActivateContext) -> Result<(), ActivateError> {
        ctx.queues
            .retain(|(i, _, _)| *i == RX_QUEUE || *i == TX_QUEUE);
        let pos = |idx: u16| ctx.queues.iter().position(|(i, _, _)| *i == idx);
        let (rx, tx) = (pos(RX_QUEUE), pos(TX_QUEUE));
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
            return Served::Used(0);
        }
        io.c.bytes_read.add(take as u64);
        let buf = std::mem::take(&mut self.buf);
        let written = self.write_out(&buf);
        self.buf = buf;
        if let Err(e) = written {
            io.c.errors.inc();
            log::debug!("{}: output: {e}", io.name());
        }
        Served::Used(0)
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
        };
        let c = Console::new("console".into(), cfg, &stats).unwrap();
        assert_eq!(c.device_type(), 3);
        assert_eq!(c.queue_max_sizes(), &[QUEUE_SIZE, QUEUE_SIZE]);
        assert_eq!(std::fs::read(&file).unwrap(), b"", "truncated");
        let sock = dir.join("sock");
        let cfg = ConsoleConfig {
            output: ConsoleOutput::Socket(sock.clone()),
        };
        drop(Console::new("console".into(), cfg.clone(), &stats).unwrap());
        // The socket file stays behind; the next device binds over it.
        Console::new("console".into(), cfg, &stats).unwrap();
        let bad = ConsoleConfig {
            output: ConsoleOutput::File(dir.join("no/such/dir")),
        };
        assert!(Console::new("console".into(), bad, &stats).is_err());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
