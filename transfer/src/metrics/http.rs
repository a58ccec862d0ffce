//! The opt-in HTTP endpoint: `GET /metrics` in the Prometheus text format.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Duration;

/// Largest request head accepted (bytes); longer requests get 431 and are closed.
const MAX_REQUEST: usize = 8 << 10;
/// Per-connection read/write timeout.
const IO_TIMEOUT: Duration = Duration::from_secs(2);
/// A request head must arrive within this time (slow clients are closed).
const REQUEST_DEADLINE: Duration = Duration::from_secs(5);

/// Produces the exposition text; `None` once the engine is gone (the server then stops).
pub(crate) type Render = Box<dyn Fn() -> Option<String> + Send>;

/// Serves `GET /metrics` on `listener` (one connection at a time, each closed after one
/// response) until `render` returns `None`.
pub(crate) fn serve(listener: TcpListener, render: Render) {
    for conn in listener.incoming() {
        let Ok(s) = conn else {
            std::thread::sleep(Duration::from_millis(10));
            continue;
        };
        let Some(text) = render() else { return };
        if let Err(e) = answer(s, &text) {
            tracing::debug!(error = %e, "metrics request failed");
        }
    }
}

fn answer(mut s: TcpStream, text: &str) -> std::io::Result<()> {
    s.set_read_timeout(Some(IO_TIMEOUT))?;
    s.set_write_timeout(Some(IO_TIMEOUT))?;
    let mut buf = vec![0u8; MAX_REQUEST];
    let mut n = 0;
    let start = std::time::Instant::now();
    let head_end = loop {
        if n == buf.len() {
            break None;
        }
        if start.elapsed() >= REQUEST_DEADLINE {
            return Ok(()); // too slow: closed without an answer
        }
        let k = s.read(&mut buf[n..])?;
        if k == 0 {
            return Ok(()); // closed before a full request
        }
        n += k;
        if let Some(p) = buf[..n].windows(4).position(|w| w == b"\r\n\r\n") {
            break Some(p);
        }
    };
    let (status, body, ctype) = match head_end {
        None => ("431 Request Header Fields Too Large", "", "text/plain"),
        Some(end) => {
            let line = buf[..end].split(|b| *b == b'\n').next().unwrap_or(&[]);
            let mut parts = line.split(|b| *b == b' ');
            let method = parts.next().unwrap_or(&[]);
            let target = parts.next().unwrap_or(&[]);
            let path = target.split(|b| *b == b'?').next().unwrap_or(&[]);
            if method == b"GET" && path == b"/metrics" {
                ("200 OK", text, "text/plain; version=0.0.4; charset=utf-8")
            } else {
                ("404 Not Found", "not found\n", "text/plain")
            }
        }
    };
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes())?;
    s.write_all(body.as_bytes())?;
    s.flush()?;
    let _ = s.shutdown(std::net::Shutdown::Both);
    Ok(())
}
