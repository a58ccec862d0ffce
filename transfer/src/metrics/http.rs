//! The opt-in HTTP endpoint: `GET /metrics` in the Prometheus text format.
//!
//! Each admitted connection is served on its own thread, within one deadline for its whole
//! request and response (`Limits::metrics_conn_timeout`); at most `Limits::metrics_max_conns`
//! at once. When full, the oldest connection that has not delivered a complete request head is
//! answered `503` and closed to admit the new one (the new one gets the `503` when every
//! admitted connection is being answered). The exposition is rendered only for a complete
//! `GET /metrics`.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::gate::{Admitted, ConnGate, Slot, STAGE_PROTECTED};
use crate::net::{refuse, spawn_counted, DeadlineIo, Threads};

/// Largest request head accepted (bytes); longer requests get 431 and are closed.
const MAX_REQUEST: usize = 8 << 10;

/// Produces the exposition text; `None` once the engine is gone (the server then stops).
pub(crate) type Render = Arc<dyn Fn() -> Option<String> + Send + Sync>;

/// The endpoint: its admission, what it serves, the deadline per connection.
pub(crate) struct Server {
    pub gate: Arc<ConnGate>,
    pub render: Render,
    /// Whether the engine still runs (the server stops once it does not).
    pub alive: Box<dyn Fn() -> bool + Send>,
    pub timeout: Duration,
    pub threads: Threads,
}

/// What a request head asks for.
#[derive(Debug, PartialEq, Eq)]
#[doc(hidden)]
pub enum Request {
    /// `GET /metrics` (any query string).
    Metrics,
    /// Anything else complete: 404.
    Other,
    /// The head is longer than [`MAX_REQUEST`]: 431.
    TooLarge,
    /// Not complete yet.
    Incomplete,
}

/// Parses the bytes of a request received so far (pure, for fuzzing).
#[doc(hidden)]
pub fn parse_request(buf: &[u8]) -> Request {
    let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
        return if buf.len() >= MAX_REQUEST {
            Request::TooLarge
        } else {
            Request::Incomplete
        };
    };
    if end + 4 > MAX_REQUEST {
        return Request::TooLarge;
    }
    let line = buf[..end].split(|b| *b == b'\n').next().unwrap_or(&[]);
    let mut parts = line.split(|b| *b == b' ');
    let method = parts.next().unwrap_or(&[]);
    let target = parts.next().unwrap_or(&[]);
    let path = target.split(|b| *b == b'?').next().unwrap_or(&[]);
    if method == b"GET" && path == b"/metrics" {
        Request::Metrics
    } else {
        Request::Other
    }
}

const UNAVAILABLE: &[u8] =
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";

impl Server {
    /// Serves until the engine is gone.
    pub fn serve(self, listener: TcpListener) {
        for conn in listener.incoming() {
            let Ok(s) = conn else {
                std::thread::sleep(Duration::from_millis(10));
                continue;
            };
            if !(self.alive)() {
                return;
            }
            let accepted = Instant::now();
            let ip = match s.peer_addr() {
                Ok(a) => a.ip(),
                Err(_) => continue,
            };
            let Admitted { slot, evicted } = match self.gate.admit(&s, ip) {
                Ok(a) => a,
                Err(_) => {
                    refuse(&s, UNAVAILABLE);
                    continue;
                }
            };
            if let Some((victim, _)) = evicted {
                refuse(&victim, UNAVAILABLE);
            }
            let (render, until) = (self.render.clone(), accepted + self.timeout);
            let spawned = spawn_counted("kvwire-metrics-conn".into(), &self.threads, move || {
                if let Err(e) = answer(&s, slot, &render, until) {
                    tracing::debug!(error = %e, "metrics request failed");
                }
            });
            if let Err(e) = spawned {
                tracing::debug!(error = %e, "cannot spawn a metrics thread");
            }
        }
    }
}

fn answer(s: &TcpStream, slot: Slot, render: &Render, until: Instant) -> std::io::Result<()> {
    let mut io = DeadlineIo::new(s, until);
    let mut buf = vec![0u8; MAX_REQUEST];
    let mut n = 0;
    let req = loop {
        match parse_request(&buf[..n]) {
            Request::Incomplete => {}
            r => break r,
        }
        let k = io.read(&mut buf[n..])?;
        if k == 0 {
            return Ok(()); // closed before a full request
        }
        n += k;
    };
    // A complete request: no longer evicted (it is being answered).
    slot.set(STAGE_PROTECTED);
    let text;
    let (status, body, ctype) = match req {
        Request::Metrics => match render() {
            Some(t) => {
                text = t;
                (
                    "200 OK",
                    text.as_str(),
                    "text/plain; version=0.0.4; charset=utf-8",
                )
            }
            None => ("503 Service Unavailable", "", "text/plain"),
        },
        Request::TooLarge => ("431 Request Header Fields Too Large", "", "text/plain"),
        _ => ("404 Not Found", "not found\n", "text/plain"),
    };
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    io.write_all(head.as_bytes())?;
    io.write_all(body.as_bytes())?;
    let _ = s.shutdown(std::net::Shutdown::Both);
    drop(slot);
    Ok(())
}

/// Live connections and evictions of the endpoint (for the snapshot).
pub(crate) fn gate_counts(g: &ConnGate) -> (u64, u64) {
    (
        g.in_progress() as u64,
        g.stats.evicted.load(Ordering::Relaxed),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_parse() {
        assert_eq!(
            parse_request(b"GET /metrics HTTP/1.1\r\n"),
            Request::Incomplete
        );
        assert_eq!(
            parse_request(b"GET /metrics?x=1 HTTP/1.1\r\nHost: a\r\n\r\n"),
            Request::Metrics
        );
        assert_eq!(
            parse_request(b"POST /metrics HTTP/1.1\r\n\r\n"),
            Request::Other
        );
        assert_eq!(parse_request(&vec![b'a'; MAX_REQUEST]), Request::TooLarge);
    }
}
