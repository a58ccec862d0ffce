//! Socket helpers every connection uses: one deadline for a whole exchange ([`DeadlineIo`]),
//! keepalive ([`tune`]), refusals that never leave a peer waiting ([`refuse`]), counted threads
//! ([`spawn_counted`]) and rate-limited log lines ([`LogLimiter`]).

use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use socket2::{SockRef, TcpKeepalive};

/// Shortest timeout handed to the socket (a zero timeout would mean "none").
const MIN_TIMEOUT: Duration = Duration::from_millis(1);

/// A stream whose reads and writes all end by one deadline (each call gets the time that is
/// left; none is allowed once it passed), unlike a socket timeout, which a peer trickling one
/// byte at a time renews with every byte.
pub(crate) struct DeadlineIo<'a> {
    s: &'a TcpStream,
    until: Instant,
}

impl<'a> DeadlineIo<'a> {
    pub fn new(s: &'a TcpStream, until: Instant) -> DeadlineIo<'a> {
        DeadlineIo { s, until }
    }

    fn left(&self) -> io::Result<Duration> {
        let now = Instant::now();
        if now >= self.until {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "deadline of the exchange passed",
            ));
        }
        Ok((self.until - now).max(MIN_TIMEOUT))
    }
}

impl Read for DeadlineIo<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.s.set_read_timeout(Some(self.left()?))?;
        (&*self.s).read(buf)
    }
}

impl Write for DeadlineIo<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.s.set_write_timeout(Some(self.left()?))?;
        (&*self.s).write(buf)
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Keepalive probes: first after this much silence, then every [`KEEPALIVE_INTERVAL`],
/// [`KEEPALIVE_RETRIES`] times, before the kernel declares a half-open connection dead.
const KEEPALIVE_TIME: Duration = Duration::from_secs(15);
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(5);
const KEEPALIVE_RETRIES: u32 = 3;

/// No Nagle delay, and TCP keepalive (a peer whose host vanished is found dead).
pub(crate) fn tune(s: &TcpStream) -> io::Result<()> {
    s.set_nodelay(true)?;
    let ka = TcpKeepalive::new()
        .with_time(KEEPALIVE_TIME)
        .with_interval(KEEPALIVE_INTERVAL)
        .with_retries(KEEPALIVE_RETRIES);
    SockRef::from(s).set_tcp_keepalive(&ka)
}

/// Answers a connection that is not served with `bytes` (a `Reject`, an HTTP 503) without
/// ever blocking: the socket is non-blocking, and a reply that does not fit the send buffer is
/// cut (the peer then sees a close). Then closes our side.
pub(crate) fn refuse(s: &TcpStream, bytes: &[u8]) {
    let _ = s.set_nonblocking(true);
    let _ = (&*s).write(bytes);
    let _ = s.shutdown(Shutdown::Both);
}

/// Spawns a named thread counted in `live` while it runs.
pub(crate) fn spawn_counted<F>(
    name: String,
    live: &Arc<AtomicU64>,
    f: F,
) -> io::Result<std::thread::JoinHandle<()>>
where
    F: FnOnce() + Send + 'static,
{
    struct Count(Arc<AtomicU64>);
    impl Drop for Count {
        fn drop(&mut self) {
            self.0.fetch_sub(1, Ordering::AcqRel);
        }
    }
    live.fetch_add(1, Ordering::AcqRel);
    let c = Count(live.clone());
    std::thread::Builder::new().name(name).spawn(move || {
        let _c = c;
        f()
    })
    // On a spawn error the closure (and `c`) is dropped, which undoes the count.
}

/// Thread counts of one engine, shared with its transports.
pub(crate) type Threads = Arc<AtomicU64>;

/// Rate limit of a repeated log line: it is written for the 1st, 2nd, 4th, 8th... occurrence,
/// and at least once a minute while it keeps occurring, with the count so far. So N events
/// write at most log2(N) + 1 lines plus one per minute.
#[derive(Default)]
pub(crate) struct LogLimiter {
    count: AtomicU64,
    /// Milliseconds since [`LogLimiter::epoch`] of the last line written.
    last_ms: AtomicU64,
}

/// How long a limited line stays quiet at most while its event keeps occurring.
const LOG_EVERY: Duration = Duration::from_secs(60);

impl LogLimiter {
    fn epoch() -> Instant {
        static E: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
        *E.get_or_init(Instant::now)
    }

    /// Counts one event; `Some(count)` when a line should be written for it.
    pub fn hit(&self) -> Option<u64> {
        let n = self.count.fetch_add(1, Ordering::Relaxed) + 1;
        let now = Self::epoch().elapsed().as_millis() as u64;
        let last = self.last_ms.load(Ordering::Relaxed);
        let due = now.saturating_sub(last) >= LOG_EVERY.as_millis() as u64;
        if n.is_power_of_two() || due {
            self.last_ms.store(now.max(1), Ordering::Relaxed);
            Some(n)
        } else {
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limiter_writes_log2_lines() {
        let l = LogLimiter::default();
        // Started just now: no minute has passed, so only powers of two are written.
        l.last_ms.store(
            LogLimiter::epoch().elapsed().as_millis() as u64 + 1,
            Ordering::Relaxed,
        );
        let lines = (0..1000).filter(|_| l.hit().is_some()).count();
        assert_eq!(lines, 10); // 1, 2, 4, ..., 512
        assert_eq!(l.count.load(Ordering::Relaxed), 1000);
    }

    #[test]
    fn deadline_io_ends_a_trickle() {
        let lst = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let c = TcpStream::connect(lst.local_addr().expect("addr")).expect("connect");
        let (s, _) = lst.accept().expect("accept");
        let mut d = DeadlineIo::new(&s, Instant::now() - Duration::from_secs(1));
        let mut b = [0u8; 1];
        assert_eq!(
            d.read(&mut b).map_err(|e| e.kind()),
            Err(io::ErrorKind::TimedOut)
        );
        drop(c);
    }
}
