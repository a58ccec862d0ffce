//! [`CtrlWriter`]: the queue and the writer thread of a peer's control connection.
//!
//! Region updates, withdrawals with their fences, shm and RDMA notifications with their fences
//! and the transports' own messages all go out through one writer per peer: senders append
//! encoded messages to its queue (never touching the socket, so no sender, and no lock a sender
//! holds, waits for a slow peer), and its thread writes them in order, each message (or group
//! of messages) whole, so they never interleave. The queue is bounded
//! (`Limits::ctrl_queue_bytes`): a peer that does not read is disconnected once its queue is
//! full, and one whose socket accepts nothing for `Limits::idle_timeout` too. While nothing is
//! queued the thread sends a heartbeat every third of that time.

use std::collections::{HashSet, VecDeque};
use std::io::Write;
use std::net::TcpStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::error::Error;
use crate::limits::Resource;
use crate::net::DeadlineIo;
use crate::wire::fence::{EngineMsg, FenceKind};
use crate::wire::CtrlMsg;

#[derive(Default)]
struct Queue {
    bufs: VecDeque<Vec<u8>>,
    /// Bytes queued or being written.
    bytes: usize,
    /// Set once the writer must stop: the peer is closed, or `failed` says why it must be.
    closed: bool,
    failed: Option<Error>,
}

/// Queued writer of a peer's control connection (see the module docs).
pub(crate) struct CtrlWriter {
    q: Mutex<Queue>,
    cv: Condvar,
    cap: usize,
    /// The connection it writes (shut down when the queue overflows, to wake the thread).
    stream: Mutex<Option<Arc<TcpStream>>>,
    /// Batches whose notification went out and whose delivery the target has not confirmed.
    awaiting: Mutex<HashSet<u64>>,
}

/// Called by the writer thread when the peer must be closed (with why).
pub(crate) type OnCtrlDead = Box<dyn FnOnce(Error) + Send>;

impl CtrlWriter {
    /// A writer whose queue holds at most `cap` bytes.
    pub fn new(cap: usize) -> CtrlWriter {
        CtrlWriter {
            q: Mutex::new(Queue::default()),
            cv: Condvar::new(),
            cap,
            stream: Mutex::new(None),
            awaiting: Mutex::new(HashSet::new()),
        }
    }

    /// The connection to write (a clone of the one the reader reads).
    pub fn attach(&self, s: TcpStream) {
        *self.stream.lock() = Some(Arc::new(s));
    }

    /// Why the writer failed the peer, if it did (a full queue, a write that did not end).
    pub fn failure(&self) -> Option<Error> {
        self.q.lock().failed.as_ref().map(Error::duplicate)
    }

    pub fn send(&self, m: &CtrlMsg) -> Result<(), Error> {
        self.push(m.encode())
    }

    /// Queues already encoded messages to go out in one piece (a region withdrawal and its
    /// fence).
    pub fn write_encoded(&self, buf: &[u8]) -> Result<(), Error> {
        self.push(buf.to_vec())
    }

    fn push(&self, buf: Vec<u8>) -> Result<(), Error> {
        let mut q = self.q.lock();
        if q.closed {
            return Err(Error::PeerDead("control connection closed".into()));
        }
        if q.bytes + buf.len() > self.cap {
            let e = Error::ResourceLimit {
                resource: Resource::CtrlQueue,
                limit: self.cap as u64,
            };
            q.closed = true;
            q.failed = Some(e.duplicate());
            drop(q);
            self.cv.notify_all();
            // The thread may be inside a write that the peer does not read: end it (and the
            // reader's read) now.
            if let Some(s) = self.stream.lock().as_ref() {
                let _ = s.shutdown(std::net::Shutdown::Both);
            }
            return Err(e);
        }
        q.bytes += buf.len();
        q.bufs.push_back(buf);
        drop(q);
        self.cv.notify_all();
        Ok(())
    }

    /// Queues the notification of batch `batch` followed by a fence the target answers once it
    /// queued the notification. The caller must leave one part of the batch open: the engine
    /// completes it when the answer arrives (so a completed batch's notification is already
    /// delivered, as over TCP). Transports that notify over the control connection use this.
    pub fn send_notify(&self, batch: u64, tag: Vec<u8>) -> Result<(), Error> {
        let mut buf = CtrlMsg::Notify(tag).encode();
        buf.extend_from_slice(
            &EngineMsg::Fence(FenceKind::Notify, batch)
                .to_ctrl()
                .encode(),
        );
        self.awaiting.lock().insert(batch);
        let r = self.push(buf);
        if r.is_err() {
            self.awaiting.lock().remove(&batch);
        }
        r
    }

    /// The target answered the notification of `batch`; `false` when none was awaited.
    pub fn confirm(&self, batch: u64) -> bool {
        self.awaiting.lock().remove(&batch)
    }

    /// Forgets every awaited confirmation (the peer is gone).
    pub fn forget_all(&self) {
        self.awaiting.lock().clear();
    }

    /// Bytes queued now.
    pub fn queued_bytes(&self) -> usize {
        self.q.lock().bytes
    }

    /// Stops the writer (the peer is closed); what is still queued is dropped.
    pub fn close(&self) {
        let mut q = self.q.lock();
        q.closed = true;
        q.bufs.clear();
        q.bytes = 0;
        drop(q);
        self.cv.notify_all();
        // Its socket closes once the thread is done with it.
        self.stream.lock().take();
    }

    /// The writer thread: writes what is queued to the attached connection until closed; a
    /// write that does not end within `idle`, a write error or a full queue ends it with
    /// `on_dead`.
    pub fn run(&self, idle: Duration, on_dead: OnCtrlDead) {
        let Some(s) = self.stream.lock().clone() else {
            return;
        };
        let beat = (idle / 3).max(Duration::from_millis(1));
        let ping = EngineMsg::Ping.to_ctrl().encode();
        let mut out: Vec<u8> = Vec::new();
        loop {
            // Queued bytes in `out` (a heartbeat is not counted in the queue).
            let mut counted = 0;
            {
                let mut q = self.q.lock();
                let mut last = Instant::now();
                loop {
                    if let Some(e) = q.failed.as_ref().map(Error::duplicate) {
                        drop(q);
                        on_dead(e);
                        return;
                    }
                    if q.closed {
                        return;
                    }
                    if !q.bufs.is_empty() {
                        break;
                    }
                    if self.cv.wait_until(&mut q, last + beat).timed_out() && q.bufs.is_empty() {
                        if !q.closed {
                            out.extend_from_slice(&ping);
                        }
                        break;
                    }
                    last = Instant::now();
                }
                // Everything queued goes out in one write (messages stay whole and in order).
                for b in q.bufs.drain(..) {
                    counted += b.len();
                    out.extend_from_slice(&b);
                }
            }
            if out.is_empty() {
                continue;
            }
            let r = DeadlineIo::new(&s, Instant::now() + idle).write_all(&out);
            {
                let mut q = self.q.lock();
                q.bytes = q.bytes.saturating_sub(counted);
            }
            out.clear();
            if let Err(e) = r {
                let e = match e.kind() {
                    std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock => Error::Timeout,
                    _ => Error::Io(e),
                };
                if !self.q.lock().closed {
                    on_dead(e);
                }
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_queue_fails_the_peer_and_refuses_more() {
        let w = CtrlWriter::new(100);
        assert!(w.write_encoded(&[0; 60]).is_ok());
        assert_eq!(w.queued_bytes(), 60);
        assert!(matches!(
            w.write_encoded(&[0; 60]),
            Err(Error::ResourceLimit {
                resource: Resource::CtrlQueue,
                limit: 100
            })
        ));
        assert!(matches!(w.write_encoded(&[0; 1]), Err(Error::PeerDead(_))));
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        w.attach(TcpStream::connect(l.local_addr().expect("addr")).expect("connect"));
        let (tx, rx) = std::sync::mpsc::channel();
        w.run(
            Duration::from_secs(60),
            Box::new(move |e| tx.send(e.to_string()).expect("send")),
        );
        assert!(rx.recv().expect("on_dead").contains("control bytes queued"));
    }
}
