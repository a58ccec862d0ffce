//! Notifications delivered to this engine (as a target), without busy loops.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::error::Error;
use crate::types::PeerId;

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

#[derive(Default)]
struct QState {
    q: VecDeque<Notification>,
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
}

impl NotifyQueue {
    pub fn push(&self, n: Notification) {
        let wakers = {
            let mut s = self.st.lock();
            if s.q.len() >= MAX_QUEUED {
                s.dropped += 1;
                self.dropped
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                tracing::warn!(dropped = s.dropped, "notification queue full; dropping");
                return;
            }
            s.q.push_back(n);
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
            if let Some(n) = s.q.pop_front() {
                return Ok(n);
            }
            if s.closed {
                return Err(Error::Shutdown);
            }
            if self.q.cv.wait_until(&mut s, until).timed_out() {
                return s.q.pop_front().ok_or(Error::Timeout);
            }
        }
    }

    /// The next notification if one is queued.
    pub fn try_recv(&self) -> Option<Notification> {
        self.q.st.lock().q.pop_front()
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
        if let Some(n) = s.q.pop_front() {
            return Poll::Ready(Ok(n));
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
