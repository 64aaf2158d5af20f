//! The 16550 serial console (vm-superio's UART) with its output on stdout, a file or a Unix
//! socket, input from stdin or the socket's client, and its interrupt raised through an irqfd.

use std::fs::File;
use std::io::Read;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use lucid_seccomp::Role;
use lucid_stats::{Counter, StatsRegistry, ThreadRole};
use lucid_thread::{Spawner, ThreadSpec};
use vm_superio::{serial::SerialEvents, Trigger};
use vmm_sys_util::eventfd::EventFd;

use crate::console::{ConsoleOut, ConsoleWriter, Sink};
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
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SerialOutput {
    Stdio,
    File(PathBuf),
    /// Lucid listens at this path; the first client to connect gets the console (and what was
    /// printed before it connected), and its input goes to the guest.
    Unix(PathBuf),
}

/// The form `--serial` takes.
impl std::fmt::Display for SerialOutput {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SerialOutput::Stdio => f.write_str("stdio"),
            SerialOutput::File(p) => write!(f, "file:{}", p.display()),
            SerialOutput::Unix(p) => write!(f, "unix:{}", p.display()),
        }
    }
}

/// A `--serial` value that is none of the forms.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
#[error("bad --serial {0:?}: expected stdio, file:PATH or unix:PATH")]
pub struct BadSerialOption(pub String);

impl std::str::FromStr for SerialOutput {
    type Err = BadSerialOption;
    fn from_str(s: &str) -> Result<Self, BadSerialOption> {
        match s.split_once(':') {
            _ if s == "stdio" => Ok(SerialOutput::Stdio),
            Some(("file", p)) if !p.is_empty() => Ok(SerialOutput::File(p.into())),
            Some(("unix", p)) if !p.is_empty() => Ok(SerialOutput::Unix(p.into())),
            _ => Err(BadSerialOption(s.to_string())),
        }
    }
}

type Uart = vm_superio::Serial<IrqTrigger, Events, ConsoleWriter>;

/// Console output a stalled reader may leave waiting, at most; beyond it bytes are dropped. A
/// socket console keeps more, for what is printed before its first client connects.
pub const CONSOLE_BUFFER: usize = 64 << 10;
pub const SOCKET_BACKLOG: usize = 1 << 20;

/// COM1, registered at 0x3f8 with length 8.
pub struct Serial {
    uart: Uart,
    out: Arc<ConsoleOut>,
    /// The socket console's client slot, shared with the accept thread.
    client: Option<Arc<Mutex<Option<Arc<UnixStream>>>>>,
    rx_bytes: Arc<Counter>,
}

impl Serial {
    /// Creates the console and its output thread (confined as a device back-end). Input
    /// threads (stdin or socket) are started by [`Serial::start_input`] once the device is
    /// shared.
    pub fn new(
        output: &SerialOutput,
        irq: EventFd,
        stats: &StatsRegistry,
        spawner: &Spawner,
    ) -> std::io::Result<(Self, Option<UnixListener>)> {
        let mut client = None;
        let (sink, capacity, listener) = match output {
            SerialOutput::Stdio => (Sink::Stdout, CONSOLE_BUFFER, None),
            SerialOutput::File(p) => (Sink::File(File::create(p)?), CONSOLE_BUFFER, None),
            SerialOutput::Unix(p) => {
                let _ = std::fs::remove_file(p);
                let l = UnixListener::bind(p)?;
                let slot: Arc<Mutex<Option<Arc<UnixStream>>>> = Arc::default();
                client = Some(slot.clone());
                (Sink::Socket(slot), SOCKET_BACKLOG, Some(l))
            }
        };
        let (out, writer) =
            ConsoleOut::start(sink, capacity, stats, spawner).map_err(std::io::Error::other)?;
        let trigger = IrqTrigger {
            evt: irq,
            count: stats.counter("serial.irqs"),
        };
        let events = Events {
            tx_bytes: stats.counter("serial.tx_bytes"),
            tx_lost: stats.counter("serial.tx_dropped"),
        };
        Ok((
            Serial {
                uart: vm_superio::Serial::with_events(trigger, events, writer),
                out,
                client,
                rx_bytes: stats.counter("serial.rx_bytes"),
            },
            listener,
        ))
    }

    /// The output side, to flush at VM exit.
    pub fn output(&self) -> &Arc<ConsoleOut> {
        &self.out
    }

    /// Starts the input side: the socket's accept loop, or a stdin reader when `stdin` is set.
    /// The input thread confines itself as a device back-end.
    pub fn start_input(
        dev: &Arc<Mutex<Serial>>,
        listener: Option<UnixListener>,
        stdin: bool,
        spawner: &Spawner,
    ) {
        let spec = |name: &str| ThreadSpec::new(name, ThreadRole::Other, Role::Backend);
        if let Some(l) = listener {
            let dev = dev.clone();
            let _ = spawner.spawn(spec("lucid-serial-accept"), move |confined| {
                if confined.is_err() {
                    return;
                }
                for conn in l.incoming().flatten() {
                    let Ok(reader) = conn.try_clone() else {
                        continue;
                    };
                    let (slot, out) = {
                        let d = dev.lock().unwrap_or_else(|e| e.into_inner());
                        (d.client.clone(), d.out.clone())
                    };
                    if let Some(slot) = slot {
                        // The writer thread sends the backlog, then follows the output.
                        *slot.lock().unwrap_or_else(|e| e.into_inner()) = Some(Arc::new(conn));
                        out.wake();
                    }
                    pump_input(&dev, reader);
                }
            });
        } else if stdin {
            let dev = dev.clone();
            let _ = spawner.spawn(spec("lucid-serial-stdin"), move |confined| {
                if confined.is_ok() {
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

    fn spawner(stats: &StatsRegistry) -> Spawner {
        Spawner::new(None, stats.threads().clone())
    }

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
        let (mut s, _) = Serial::new(
            &SerialOutput::File(path.clone()),
            evt,
            &stats,
            &spawner(&stats),
        )
        .unwrap();
        for b in b"hi\n" {
            s.write(0, &[*b]);
        }
        drop(s);
        assert_eq!(std::fs::read(&path).unwrap(), b"hi\n");
        assert_eq!(stats.snapshot()["serial.tx_bytes"], 3);
        assert_eq!(stats.snapshot()["serial.tx_written"], 3);
        std::fs::remove_file(path).unwrap();
    }

    /// Runs `f` on a thread and fails (instead of hanging) if it takes more than a minute.
    fn within_a_minute<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || tx.send(f()));
        rx.recv_timeout(std::time::Duration::from_secs(60))
            .expect("the UART blocked on a stalled reader")
    }

    /// A socket client that connects and never reads: the UART goes on, and once the backlog
    /// and the socket are full, bytes are dropped and counted.
    #[test]
    fn a_stalled_socket_client_does_not_block_the_uart() {
        let path = std::env::temp_dir().join(format!("lucid-serial-sock-{}", std::process::id()));
        let stats = StatsRegistry::new();
        let evt = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        let (s, listener) = Serial::new(
            &SerialOutput::Unix(path.clone()),
            evt,
            &stats,
            &spawner(&stats),
        )
        .unwrap();
        let dev = Arc::new(Mutex::new(s));
        Serial::start_input(&dev, listener, false, &spawner(&stats));
        let _client = UnixStream::connect(&path).unwrap();
        let slot = dev.lock().unwrap().client.clone().unwrap();
        while slot.lock().unwrap().is_none() {
            std::thread::yield_now();
        }
        let total = 4 * SOCKET_BACKLOG as u64;
        let d = dev.clone();
        within_a_minute(move || {
            for i in 0..total {
                d.lock().unwrap().write(0, &[b'a' + (i % 26) as u8]);
            }
        });
        let c = stats.snapshot();
        assert_eq!(c["serial.tx_bytes"], total);
        assert!(c["serial.tx_dropped"] > 0, "{c:?}");
        assert!(
            c["serial.tx_written"] + c["serial.tx_dropped"] <= total,
            "{c:?}"
        );
        let _ = std::fs::remove_file(path);
    }
}
