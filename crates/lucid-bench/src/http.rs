//! A minimal HTTP/1.1 client over a Unix socket, for Lucid's REST API (`lucid run
//! --api-socket`): one request per connection, as the server closes each after one response.
//! `httparse` parses the response head; the body is framed by Content-Length or by the close.

use std::io::{ErrorKind, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// The largest response read (a `vm.counters` body is tens of KiB).
const MAX_RESPONSE: usize = 16 << 20;

/// Why a request got no response.
#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    /// Nothing listens on the socket (refused: a stale socket file; not found: gone).
    #[error("cannot connect to {path}")]
    Connect {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{what} {path}")]
    Io {
        path: PathBuf,
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: no response within {} ms", .after.as_millis())]
    TimedOut { path: PathBuf, after: Duration },
    #[error("{path}: not an HTTP response: {msg}")]
    BadResponse { path: PathBuf, msg: String },
}

/// A response: its status and body.
#[derive(Debug)]
pub struct Reply {
    pub status: u16,
    pub body: Vec<u8>,
}

impl Reply {
    /// The body as JSON (`Null` when it is empty or not JSON).
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or(serde_json::Value::Null)
    }

    /// The body as text, for error messages.
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    pub fn ok(&self) -> bool {
        (200..300).contains(&self.status)
    }
}

/// `method /api/v1/endpoint` (or any `path`) with an optional JSON `body`; the whole exchange
/// must finish within `timeout`.
pub fn request(
    socket: &Path,
    method: &str,
    path: &str,
    body: Option<&str>,
    timeout: Duration,
) -> Result<Reply, HttpError> {
    let deadline = Instant::now() + timeout;
    let io = |what: &'static str| {
        move |source| HttpError::Io {
            path: socket.into(),
            what,
            source,
        }
    };
    let mut s = UnixStream::connect(socket).map_err(|source| HttpError::Connect {
        path: socket.into(),
        source,
    })?;
    s.set_write_timeout(Some(timeout))
        .map_err(io("set a timeout on"))?;
    let body = body.unwrap_or("");
    let mut req = format!("{method} {path} HTTP/1.1\r\nHost: localhost\r\nAccept: */*\r\n");
    if !body.is_empty() || method != "GET" {
        req += &format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\n",
            body.len()
        );
    }
    req += "\r\n";
    req += body;
    s.write_all(req.as_bytes())
        .map_err(io("send a request to"))?;

    let mut buf = Vec::with_capacity(4096);
    let mut chunk = [0u8; 16384];
    loop {
        if let Some(reply) = parse(socket, &buf, false)? {
            return Ok(reply);
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(HttpError::TimedOut {
                path: socket.into(),
                after: timeout,
            });
        }
        s.set_read_timeout(Some(left))
            .map_err(io("set a timeout on"))?;
        match s.read(&mut chunk) {
            Ok(0) => {
                return parse(socket, &buf, true)?.ok_or_else(|| HttpError::BadResponse {
                    path: socket.into(),
                    msg: format!("closed after {} bytes", buf.len()),
                })
            }
            Ok(n) if buf.len() + n > MAX_RESPONSE => {
                return Err(HttpError::BadResponse {
                    path: socket.into(),
                    msg: format!("over {MAX_RESPONSE} bytes"),
                })
            }
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                return Err(HttpError::TimedOut {
                    path: socket.into(),
                    after: timeout,
                })
            }
            Err(e) => return Err(io("read the response from")(e)),
        }
    }
}

/// The response in `buf` once complete: its head parsed and its body all there (by
/// Content-Length, or everything up to the close when `closed`).
fn parse(socket: &Path, buf: &[u8], closed: bool) -> Result<Option<Reply>, HttpError> {
    let mut headers = [httparse::EMPTY_HEADER; 32];
    let mut resp = httparse::Response::new(&mut headers);
    let bad = |msg: String| HttpError::BadResponse {
        path: socket.into(),
        msg,
    };
    let head = match resp.parse(buf) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(e) => return Err(bad(e.to_string())),
    };
    let len = resp
        .headers
        .iter()
        .find(|h| h.name.eq_ignore_ascii_case("content-length"))
        .map(|h| {
            std::str::from_utf8(h.value)
                .ok()
                .and_then(|v| v.trim().parse::<usize>().ok())
                .ok_or_else(|| bad("Content-Length is not a number".into()))
        })
        .transpose()?;
    let status = resp.code.unwrap_or_default();
    let body = match len {
        Some(len) if buf.len() >= head + len => buf[head..head + len].to_vec(),
        None if closed => buf[head..].to_vec(),
        _ if closed => return Err(bad("closed before the whole body".into())),
        _ => return Ok(None),
    };
    Ok(Some(Reply { status, body }))
}

/// Waits until `socket` answers `vmm.ping` (the server is up), or `limit` passes.
pub fn wait_for_ping(socket: &Path, limit: Duration) -> Result<(), HttpError> {
    let start = Instant::now();
    loop {
        match request(
            socket,
            "GET",
            "/api/v1/vmm.ping",
            None,
            Duration::from_secs(2),
        ) {
            Ok(r) if r.ok() => return Ok(()),
            Ok(r) => {
                return Err(HttpError::BadResponse {
                    path: socket.into(),
                    msg: format!("vmm.ping answered {}: {}", r.status, r.text()),
                })
            }
            Err(e) if start.elapsed() >= limit => return Err(e),
            Err(_) => std::thread::sleep(Duration::from_millis(2)),
        }
    }
}
