//! Notifications delivered to this engine (as a target), without busy loops.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::error::Error;
use crate::limits::Resource;
use crate::net::LogLimiter;
use crate::types::PeerId;

/// Bytes a pending notification is counted with besides its tag.
pub(crate) const NOTIFY_OVERHEAD: usize = 64;

/// One peer's budget of pending notification bytes (`Limits::peer_notify_bytes`).
pub(crate) struct Budget {
    used: AtomicUsize,
    cap: usize,
}

/// Bytes taken from a [`Budget`], given back when dropped.
pub(crate) struct Charge {
    b: Arc<Budget>,
    n: usize,
}

impl Drop for Charge {
    fn drop(&mut self) {
        self.b.used.fetch_sub(self.n, Ordering::AcqRel);
    }
}

impl Budget {
    pub fn new(cap: usize) -> Arc<Budget> {
        Arc::new(Budget {
            used: AtomicUsize::new(0),
            cap,
        })
    }

    /// Takes `n` bytes; `Error::ResourceLimit` when that would exceed the budget.
    pub fn charge(self: &Arc<Self>, n: usize) -> Result<Charge, Error> {
        self.used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |u| {
                u.checked_add(n).filter(|t| *t <= self.cap)
            })
            .map_err(|_| Error::ResourceLimit {
                resource: Resource::NotifyBytes,
                limit: self.cap as u64,
            })?;
        Ok(Charge { b: self.clone(), n })
    }

    /// Bytes taken now.
    pub fn used(&self) -> usize {
        self.used.load(Ordering::Acquire)
    }

    /// The budget.
    pub fn cap(&self) -> usize {
        self.cap
    }
}

/// A notification: the tag a peer attached to a batch, delivered after all its bytes landed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Notification {
    /// The peer that sent it.
    pub peer: PeerId,
    /// The tag.
    pub tag: Vec<u8>,
}

/// Queue bound: beyond this many undelivered notifications, new ones are dropped (and counted).
pub(crate) const MAX_QUEUED: usize = 1 << 20;

/// A queued notification and the bytes it holds of its peer's budget.
struct Queued {
    n: Notification,
    _charge: Option<Charge>,
}

#[derive(Default)]
struct QState {
    q: VecDeque<Queued>,
    wakers: Vec<Waker>,
    closed: bool,
    dropped: u64,
}

#[derive(Default)]
pub(crate) struct NotifyQueue {
    st: Mutex<QState>,
    cv: Condvar,
    /// Metrics: notifications queued, dropped (queue full), suppressed (a slice was refused).
    pub(crate) delivered: std::sync::atomic::AtomicU64,
    pub(crate) dropped: std::sync::atomic::AtomicU64,
    pub(crate) suppressed: std::sync::atomic::AtomicU64,
    /// Notifications refused because their peer's budget was spent.
    pub(crate) refused: std::sync::atomic::AtomicU64,
    drop_log: LogLimiter,
}

impl NotifyQueue {
    /// Queues a notification holding `charge` of its peer's budget until it is taken.
    pub fn push(&self, n: Notification, charge: Option<Charge>) {
        let wakers = {
            let mut s = self.st.lock();
            if s.q.len() >= MAX_QUEUED {
                s.dropped += 1;
                self.dropped
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if let Some(count) = self.drop_log.hit() {
                    tracing::warn!(count, "notification queue full; dropping");
                }
                return;
            }
            s.q.push_back(Queued { n, _charge: charge });
            self.delivered
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            std::mem::take(&mut s.wakers)
        };
        self.cv.notify_one();
        for w in wakers {
            w.wake();
        }
    }
    pub fn close(&self) {
        let wakers = {
            let mut s = self.st.lock();
            s.closed = true;
            std::mem::take(&mut s.wakers)
        };
        self.cv.notify_all();
        for w in wakers {
            w.wake();
        }
    }
}

/// Receiver of notifications. Clones share one queue (each notification goes to one receiver).
#[derive(Clone)]
pub struct Notifications {
    pub(crate) q: Arc<NotifyQueue>,
}

impl std::fmt::Debug for Notifications {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Notifications").finish_non_exhaustive()
    }
}

impl Notifications {
    /// Blocks up to `d` for the next notification (`Error::Timeout`; `Error::Shutdown` once the
    /// engine is shut down and the queue is empty).
    pub fn recv_timeout(&self, d: Duration) -> Result<Notification, Error> {
        let until = Instant::now() + d;
        let mut s = self.q.st.lock();
        loop {
            if let Some(q) = s.q.pop_front() {
                return Ok(q.n);
            }
            if s.closed {
                return Err(Error::Shutdown);
            }
            if self.q.cv.wait_until(&mut s, until).timed_out() {
                return s.q.pop_front().map(|q| q.n).ok_or(Error::Timeout);
            }
        }
    }

    /// The next notification if one is queued.
    pub fn try_recv(&self) -> Option<Notification> {
        self.q.st.lock().q.pop_front().map(|q| q.n)
    }

    /// Awaits the next notification (no runtime needed; `Error::Shutdown` after shutdown).
    pub async fn recv(&self) -> Result<Notification, Error> {
        RecvFuture { q: &self.q }.await
    }

    /// How many notifications were dropped because the queue was full.
    pub fn dropped(&self) -> u64 {
        self.q.st.lock().dropped
    }
}

struct RecvFuture<'a> {
    q: &'a NotifyQueue,
}

impl Future for RecvFuture<'_> {
    type Output = Result<Notification, Error>;
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut s = self.q.st.lock();
        if let Some(q) = s.q.pop_front() {
            return Poll::Ready(Ok(q.n));
        }
        if s.closed {
            return Poll::Ready(Err(Error::Shutdown));
        }
        if !s.wakers.iter().any(|w| w.will_wake(cx.waker())) {
            s.wakers.push(cx.waker().clone());
        }
        Poll::Pending
    }
}
