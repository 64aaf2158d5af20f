//! The 16550 serial console (vm-superio's UART) with its output on stdout, a file or a Unix
//! socket, input from stdin or the socket's client, and its interrupt raised through an irqfd.

use std::fs::File;
use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use lucid_seccomp::{Role, Seccomp};
use lucid_stats::{Counter, StatsRegistry};
use vm_superio::{serial::SerialEvents, Trigger};
use vmm_sys_util::eventfd::EventFd;

use crate::BusDevice;

/// Raises a device's interrupt by signalling an eventfd (an irqfd in KVM), and counts it.
pub struct IrqTrigger {
    pub evt: EventFd,
    pub count: Arc<Counter>,
}

impl Trigger for IrqTrigger {
    type E = std::io::Error;
    fn trigger(&self) -> Result<(), Self::E> {
        self.count.inc();
        self.evt.write(1)
    }
}

struct Events {
    tx_bytes: Arc<Counter>,
    tx_lost: Arc<Counter>,
}

impl SerialEvents for Events {
    fn buffer_read(&self) {}
    fn out_byte(&self) {
        self.tx_bytes.inc();
    }
    fn tx_lost_byte(&self) {
        self.tx_lost.inc();
    }
    fn in_buffer_empty(&self) {}
}

/// Where the console goes, as given on the command line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SerialOutput {
    Stdio,
    File(PathBuf),
    /// Lucid listens at this path; the first client to connect gets the console (and what was
    /// printed before it connected), and its input goes to the guest.
    Unix(PathBuf),
}

impl std::str::FromStr for SerialOutput {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.split_once(':') {
            _ if s == "stdio" => Ok(SerialOutput::Stdio),
            Some(("file", p)) if !p.is_empty() => Ok(SerialOutput::File(p.into())),
            Some(("unix", p)) if !p.is_empty() => Ok(SerialOutput::Unix(p.into())),
            _ => Err(format!(
                "bad --serial {s:?}: expected stdio, file:PATH or unix:PATH"
            )),
        }
    }
}

/// The console sink: a writer that never blocks the vCPU on a missing reader.
enum Sink {
    Stdout,
    File(File),
    Socket(Arc<Mutex<SocketSink>>),
}

#[derive(Default)]
struct SocketSink {
    client: Option<UnixStream>,
    backlog: Vec<u8>,
}

const SOCKET_BACKLOG_MAX: usize = 1 << 20;

impl Write for Sink {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match self {
            Sink::Stdout => {
                let mut out = std::io::stdout().lock();
                out.write_all(buf)?;
                out.flush()?;
            }
            Sink::File(f) => f.write_all(buf)?,
            Sink::Socket(s) => {
                let mut s = s.lock().unwrap_or_else(|e| e.into_inner());
                let sent = match s.client.as_mut() {
                    Some(c) => c.write_all(buf).is_ok(),
                    None => false,
                };
                if !sent {
                    s.client = None;
                    if s.backlog.len() + buf.len() <= SOCKET_BACKLOG_MAX {
                        s.backlog.extend_from_slice(buf);
                    }
                }
            }
        }
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

type Uart = vm_superio::Serial<IrqTrigger, Events, Sink>;

/// COM1, registered at 0x3f8 with length 8.
pub struct Serial {
    uart: Uart,
    rx_bytes: Arc<Counter>,
}

impl Serial {
    /// Creates the console. Input threads (stdin or socket) are started by [`Serial::start_input`]
    /// once the device is shared.
    pub fn new(
        output: &SerialOutput,
        irq: EventFd,
        stats: &StatsRegistry,
    ) -> std::io::Result<(Self, Option<UnixListener>)> {
        let (sink, listener) = match output {
            SerialOutput::Stdio => (Sink::Stdout, None),
            SerialOutput::File(p) => (Sink::File(File::create(p)?), None),
            SerialOutput::Unix(p) => {
                let _ = std::fs::remove_file(p);
                let l = UnixListener::bind(p)?;
                (Sink::Socket(Arc::default()), Some(l))
            }
        };
        let trigger = IrqTrigger {
            evt: irq,
            count: stats.counter("serial.irqs"),
        };
        let events = Events {
            tx_bytes: stats.counter("serial.tx_bytes"),
            tx_lost: stats.counter("serial.tx_lost"),
        };
        Ok((
            Serial {
                uart: vm_superio::Serial::with_events(trigger, events, sink),
                rx_bytes: stats.counter("serial.rx_bytes"),
            },
            listener,
        ))
    }

    /// Starts the input side: the socket's accept loop, or a stdin reader when `stdin` is set.
    /// With `seccomp`, the input thread confines itself as a device back-end.
    pub fn start_input(
        dev: &Arc<Mutex<Serial>>,
        listener: Option<UnixListener>,
        stdin: bool,
        seccomp: Option<Seccomp>,
    ) {
        let confine = move || lucid_seccomp::confine(seccomp.as_ref(), Role::Backend).is_ok();
        if let Some(l) = listener {
            let dev = dev.clone();
            let _ = std::thread::Builder::new()
                .name("lucid-serial-accept".into())
                .spawn(move || {
                    if !confine() {
                        return;
                    }
                    for conn in l.incoming().flatten() {
                        let Ok(reader) = conn.try_clone() else {
                            continue;
                        };
                        {
                            let mut d = dev.lock().unwrap_or_else(|e| e.into_inner());
                            if let Sink::Socket(s) = d.uart.writer_mut() {
                                let mut s = s.lock().unwrap_or_else(|e| e.into_inner());
                                let mut conn = conn;
                                let backlog = std::mem::take(&mut s.backlog);
                                let _ = conn.write_all(&backlog);
                                s.client = Some(conn);
                            }
                        }
                        pump_input(&dev, reader);
                    }
                });
        } else if stdin {
            let dev = dev.clone();
            let _ = std::thread::Builder::new()
                .name("lucid-serial-stdin".into())
                .spawn(move || {
                    if confine() {
                        pump_input(&dev, std::io::stdin())
                    }
                });
        }
    }
}

/// Copies bytes from `input` into the UART's receive FIFO until EOF.
fn pump_input(dev: &Arc<Mutex<Serial>>, mut input: impl Read) {
    let mut buf = [0u8; 64];
    while let Ok(n) = input.read(&mut buf) {
        if n == 0 {
            break;
        }
        let mut rest = &buf[..n];
        while !rest.is_empty() {
            let taken = {
                let mut d = dev.lock().unwrap_or_else(|e| e.into_inner());
                let t = d.uart.enqueue_raw_bytes(rest).unwrap_or(0);
                d.rx_bytes.add(t as u64);
                t
            };
            rest = &rest[taken..];
            if taken == 0 {
                // FIFO full: the guest has not drained it yet.
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
        }
    }
}

impl BusDevice for Serial {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        data.fill(0);
        if let (Some(b), true) = (data.first_mut(), offset < 8) {
            *b = self.uart.read(offset as u8);
        }
    }
    fn write(&mut self, offset: u64, data: &[u8]) {
        if let (Some(&b), true) = (data.first(), offset < 8) {
            let _ = self.uart.write(offset as u8, b);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_serial_option() {
        assert_eq!("stdio".parse::<SerialOutput>(), Ok(SerialOutput::Stdio));
        assert_eq!(
            "file:/tmp/x".parse::<SerialOutput>(),
            Ok(SerialOutput::File("/tmp/x".into()))
        );
        assert!("file:".parse::<SerialOutput>().is_err());
        assert!("tcp:1".parse::<SerialOutput>().is_err());
    }

    #[test]
    fn file_output_gets_bytes_and_counts() {
        let path = std::env::temp_dir().join(format!("lucid-serial-{}", std::process::id()));
        let stats = StatsRegistry::new();
        let evt = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        let (mut s, _) = Serial::new(&SerialOutput::File(path.clone()), evt, &stats).unwrap();
        for b in b"hi\n" {
            s.write(0, &[*b]);
        }
        drop(s);
        assert_eq!(std::fs::read(&path).unwrap(), b"hi\n");
        assert_eq!(stats.snapshot()["serial.tx_bytes"], 3);
        std::fs::remove_file(path).unwrap();
    }
}
