//! The console's output path. The UART hands each byte to a bounded buffer and returns at once; a
//! writer thread drains the buffer into the sink (stdout, a file or FIFO, a socket client). So a
//! reader that stalls (a full pipe, a client that stopped reading) never stalls the vCPU: once
//! the buffer is full, further bytes are dropped and counted (`serial.tx_dropped`).

use std::collections::VecDeque;
use std::fs::File;
use std::io::Write;
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use lucid_seccomp::Role;
use lucid_stats::{Counter, StatsRegistry, ThreadRole};
use lucid_thread::{SpawnError, Spawner, ThreadSpec};

/// Where the writer thread puts the bytes.
pub(crate) enum Sink {
    Stdout,
    File(File),
    /// The client of a `unix:` console, once one connected (set by the accept thread).
    Socket(Arc<Mutex<Option<Arc<UnixStream>>>>),
}

impl Sink {
    /// Whether a write can go anywhere now (a socket console waits for its client).
    fn ready(&self) -> bool {
        match self {
            Sink::Socket(c) => lock(c).is_some(),
            _ => true,
        }
    }

    fn write_all(&mut self, buf: &[u8]) -> std::io::Result<()> {
        match self {
            Sink::Stdout => {
                let mut out = std::io::stdout().lock();
                write_patiently(&mut out, buf)?;
                out.flush()
            }
            Sink::File(f) => write_patiently(f, buf),
            Sink::Socket(c) => {
                let Some(client) = lock(c).clone() else {
                    return Err(std::io::ErrorKind::NotConnected.into());
                };
                let r = (&*client).write_all(buf);
                if r.is_err() {
                    // Gone: later output waits for the next client.
                    let mut slot = lock(c);
                    if slot.as_ref().is_some_and(|s| Arc::ptr_eq(s, &client)) {
                        *slot = None;
                    }
                }
                r
            }
        }
    }
}

/// Writes all of `buf`, waiting out `ENOMEM` for a while: under a tight `--memory-limit` the pipe
/// or page-cache page a write needs is charged to the VM's memory cgroup, and the charge fails
/// while the cgroup sits at its limit until the pager has freed memory.
fn write_patiently(w: &mut impl Write, mut buf: &[u8]) -> std::io::Result<()> {
    let mut tries = 0;
    while !buf.is_empty() {
        match w.write(buf) {
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(n) => {
                buf = &buf[n..];
                tries = 0;
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) if e.raw_os_error() == Some(libc::ENOMEM) && tries < 300 => {
                tries += 1;
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

struct State {
    buf: VecDeque<u8>,
    /// Bytes the writer thread is writing now (no longer in `buf`).
    in_flight: usize,
    closing: bool,
    /// When the writer last finished a write (or started waiting), for the final flush.
    progress: Instant,
    /// The writer thread sleeps on `cv`: only then does new output need a wake-up (a futex
    /// call per byte on the vCPU otherwise: the UART writes one byte at a time).
    writer_waiting: bool,
    /// Bytes wait for a sink that cannot take them yet (a socket console with no client).
    no_reader: bool,
}

struct Shared {
    state: Mutex<State>,
    /// Signalled when bytes arrive, the sink becomes ready, a write ends, or the console closes.
    cv: Condvar,
    capacity: usize,
    dropped: Arc<Counter>,
    written: Arc<Counter>,
    /// The first drop is logged; the rest are only counted.
    warned: std::sync::atomic::AtomicBool,
}

/// The writer side the UART owns: never blocks.
pub(crate) struct ConsoleWriter(Arc<Shared>);

impl Write for ConsoleWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let s = &self.0;
        let mut st = lock(&s.state);
        let room = s.capacity.saturating_sub(st.buf.len());
        let take = room.min(buf.len());
        st.buf.extend(&buf[..take]);
        let wake = take > 0 && st.writer_waiting;
        drop(st);
        if take < buf.len() {
            s.dropped.add((buf.len() - take) as u64);
            if !s.warned.swap(true, std::sync::atomic::Ordering::Relaxed) {
                log::warn!(
                    "serial console: its reader is not keeping up and {} bytes are waiting: \
                     dropping further output (counted in serial.tx_dropped)",
                    s.capacity
                );
            }
        }
        if wake {
            s.cv.notify_all();
        }
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The console's output: its buffer and writer thread. Dropping it flushes what it can (see
/// [`ConsoleOut::flush`]) and ends the thread.
pub struct ConsoleOut {
    shared: Arc<Shared>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

/// How long the final flush waits for a reader that makes no progress at all.
pub const FLUSH_PATIENCE: Duration = Duration::from_secs(2);

impl ConsoleOut {
    /// Starts the writer thread for `sink`. At most `capacity` bytes wait for the reader. The
    /// thread confines itself as a device back-end before its first write.
    pub(crate) fn start(
        sink: Sink,
        capacity: usize,
        stats: &StatsRegistry,
        spawner: &Spawner,
    ) -> Result<(Arc<Self>, ConsoleWriter), SpawnError> {
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                buf: VecDeque::new(),
                in_flight: 0,
                closing: false,
                progress: Instant::now(),
                writer_waiting: false,
                no_reader: false,
            }),
            cv: Condvar::new(),
            capacity,
            dropped: stats.counter("serial.tx_dropped"),
            written: stats.counter("serial.tx_written"),
            warned: std::sync::atomic::AtomicBool::new(false),
        });
        let s = shared.clone();
        let spec = ThreadSpec::new("lucid-serial-out", ThreadRole::Other, Role::Backend);
        let thread = spawner.spawn(spec, move |confined| {
            if confined.is_ok() {
                drain(&s, sink)
            }
        })?;
        let out = Arc::new(ConsoleOut {
            shared: shared.clone(),
            thread: Mutex::new(Some(thread)),
        });
        Ok((out, ConsoleWriter(shared)))
    }

    /// Wakes the writer thread (a socket client connected).
    pub(crate) fn wake(&self) {
        let _st = lock(&self.shared.state);
        self.shared.cv.notify_all();
    }

    /// Waits until every buffered byte is written, or until the reader has made no progress
    /// for `patience` (a stalled reader: the bytes stay buffered). Returns the bytes still
    /// buffered or in flight.
    pub fn flush(&self, patience: Duration) -> usize {
        let s = &self.shared;
        let started = Instant::now();
        let mut st = lock(&s.state);
        loop {
            let pending = st.buf.len();
            if pending == 0 && st.in_flight == 0 {
                return 0;
            }
            if st.no_reader && st.in_flight == 0 {
                // Nobody to write to (a socket console no client connected to): no point
                // waiting for progress.
                return pending;
            }
            // Patience counts from the flush too: the last progress may be long ago because
            // nothing was printed since, and a writer thread starved of CPU for a moment has
            // not stalled.
            let idle = st.progress.elapsed().min(started.elapsed());
            if idle >= patience {
                return pending + st.in_flight;
            }
            st =
                s.cv.wait_timeout(st, patience - idle)
                    .unwrap_or_else(|e| e.into_inner())
                    .0;
        }
    }
}

impl Drop for ConsoleOut {
    fn drop(&mut self) {
        let left = self.flush(FLUSH_PATIENCE);
        lock(&self.shared.state).closing = true;
        self.shared.cv.notify_all();
        let thread = self
            .thread
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if left == 0 {
            if let Some(t) = thread {
                let _ = t.join();
            }
        } else {
            // The reader stalled: the thread stays blocked in its write until the reader reads
            // or goes away, then sees `closing` and ends. Joining it could wait forever.
            self.shared.dropped.add(left as u64);
        }
    }
}

/// The writer thread: takes what is buffered and writes it, blocking on the sink as long as it
/// must, with the buffer unlocked so the UART keeps going.
fn drain(s: &Shared, mut sink: Sink) {
    let mut st = lock(&s.state);
    loop {
        while !st.closing && (st.buf.is_empty() || !sink.ready()) {
            st.progress = Instant::now();
            let no_reader = !st.buf.is_empty();
            if no_reader != st.no_reader {
                st.no_reader = no_reader;
                s.cv.notify_all();
            }
            st.writer_waiting = true;
            st = s.cv.wait(st).unwrap_or_else(|e| e.into_inner());
            st.writer_waiting = false;
        }
        st.no_reader = false;
        if st.closing && (st.buf.is_empty() || !sink.ready()) {
            return;
        }
        let chunk: Vec<u8> = st.buf.drain(..).collect();
        st.in_flight = chunk.len();
        drop(st);
        let ok = sink.write_all(&chunk).is_ok();
        st = lock(&s.state);
        st.in_flight = 0;
        st.progress = Instant::now();
        if ok {
            s.written.add(chunk.len() as u64);
        } else {
            // The socket client went away mid-write: the chunk waits for the next one, as
            // far as the buffer has room. Any other sink that fails loses it.
            let keep = match sink {
                Sink::Socket(_) => s.capacity.saturating_sub(st.buf.len()).min(chunk.len()),
                _ => 0,
            };
            for &b in chunk[..keep].iter().rev() {
                st.buf.push_front(b);
            }
            s.dropped.add((chunk.len() - keep) as u64);
        }
        s.cv.notify_all();
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
