//! Batches: one completion per batch, waitable (deadline), pollable (O(1)) and awaitable.

use std::collections::{BinaryHeap, HashMap};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Weak};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::error::Error;
use crate::metrics::PeerObs;
use crate::region::RegionEntry;
use crate::types::{BatchStats, Dir};
use crate::wire::WireRegion;

/// One validated transfer (after coalescing).
pub(crate) struct Xfer {
    pub local: Arc<RegionEntry>,
    pub local_offset: u64,
    pub remote: WireRegion,
    pub remote_offset: u64,
    pub len: u64,
}

/// A batch ready to post.
pub(crate) struct Posted {
    pub id: u64,
    pub dir: Dir,
    pub xfers: Vec<Xfer>,
    pub notify: Option<Vec<u8>>,
    pub ops: usize,
    pub bytes: u64,
    pub deadline: Instant,
    pub timer: Arc<Timer>,
    /// When the batch was submitted (metrics: latency).
    pub start: Instant,
    /// How long `Batch::wait` spins before parking (see [`EngineConfig::wait_spin`]).
    ///
    /// [`EngineConfig::wait_spin`]: crate::config::EngineConfig::wait_spin
    pub spin: Duration,
}

/// Where a read slice lands locally.
pub(crate) struct ReadSlice {
    pub local: Arc<RegionEntry>,
    pub offset: u64,
    pub len: u32,
}

/// The shared state of one batch.
pub(crate) struct BatchState {
    pub id: u64,
    remaining: AtomicU32,
    /// Set by the first `finish` call: its outcome wins, even while its fail hook runs.
    finishing: AtomicBool,
    done: AtomicBool,
    result: Mutex<Option<Result<BatchStats, Error>>>,
    cv: Condvar,
    waker: Mutex<Option<Waker>>,
    timer_armed: AtomicBool,
    pub stats: BatchStats,
    pub deadline: Instant,
    /// Read slices by index (TCP reads).
    pub reads: Vec<ReadSlice>,
    /// The peer's in-flight map, to remove ourselves when finished.
    pending: Mutex<Option<Weak<Pending>>>,
    timer: Weak<Timer>,
    /// Run once when the batch fails, before anyone sees the error (a transport stops its data
    /// path from touching the batch's memory afterwards, e.g. RDMA READs at a deadline).
    on_fail: Mutex<Option<FailHook>>,
    /// A read batch (metrics: direction of the bytes).
    read: bool,
    /// When the batch was submitted (metrics: latency).
    start: Option<Instant>,
    /// How long `Batch::wait` spins before parking.
    spin: Duration,
}

/// See [`BatchState::set_on_fail`].
pub(crate) type FailHook = Box<dyn FnOnce(&Error) + Send>;

impl BatchState {
    pub fn new(
        id: u64,
        parts: u32,
        stats: BatchStats,
        deadline: Instant,
        reads: Vec<ReadSlice>,
        timer: &Arc<Timer>,
    ) -> Arc<Self> {
        Arc::new(BatchState {
            id,
            remaining: AtomicU32::new(parts),
            finishing: AtomicBool::new(false),
            done: AtomicBool::new(false),
            result: Mutex::new(None),
            cv: Condvar::new(),
            waker: Mutex::new(None),
            timer_armed: AtomicBool::new(false),
            stats,
            deadline,
            reads,
            pending: Mutex::new(None),
            timer: Arc::downgrade(timer),
            on_fail: Mutex::new(None),
            read: false,
            start: None,
            spin: DEFAULT_WAIT_SPIN,
        })
    }

    /// Takes the direction, submit time and spin budget of the batch it was created for (right after
    /// `new`, while the state is not shared yet).
    pub fn posted_as(mut self: Arc<Self>, b: &Posted) -> Arc<Self> {
        if let Some(s) = Arc::get_mut(&mut self) {
            s.read = b.dir == Dir::Read;
            s.start = Some(b.start);
            s.spin = b.spin;
        }
        self
    }

    pub fn is_done(&self) -> bool {
        self.done.load(Ordering::Acquire)
    }

    /// One part (slice ack, read slice, notification ack) finished.
    pub fn part_done(&self) {
        let prev = self.remaining.fetch_sub(1, Ordering::AcqRel);
        if prev == 1 {
            self.finish(Ok(self.stats));
        }
    }

    /// `n` parts finished at once (merged acks).
    pub fn parts_done(&self, n: u32) {
        let prev = self.remaining.fetch_sub(n, Ordering::AcqRel);
        if prev <= n {
            // `prev < n` only if a peer acked more than was sent: done either way.
            self.finish(Ok(self.stats));
        }
    }

    /// Completes a batch that has no parts at all.
    pub fn complete_now(&self) {
        self.finish(Ok(self.stats));
    }

    /// Fails the batch (no-op if already finished).
    pub fn fail(&self, e: Error) {
        self.finish(Err(e));
    }

    /// Installs a hook run (once, on the failing thread) before a failure is published.
    pub fn set_on_fail(&self, f: FailHook) {
        *self.on_fail.lock() = Some(f);
    }

    fn finish(&self, r: Result<BatchStats, Error>) {
        if self.finishing.swap(true, Ordering::AcqRel) {
            return;
        }
        let hook = self.on_fail.lock().take();
        if let (Err(e), Some(h)) = (&r, hook) {
            h(e);
        }
        // Metrics are recorded and the batch leaves the in-flight map before the outcome is
        // published (a waiter sees it counted and no longer in flight).
        if let Some(p) = self.pending.lock().take().and_then(|w| w.upgrade()) {
            if let Some(obs) = &p.obs {
                let took = self.start.map(|s| s.elapsed()).unwrap_or_default();
                obs.finished(&self.stats, self.read, took, &r);
            }
            p.remove(self.id);
        }
        {
            let mut g = self.result.lock();
            if g.is_some() {
                return;
            }
            *g = Some(r);
            self.done.store(true, Ordering::Release);
        }
        self.cv.notify_all();
        if let Some(w) = self.waker.lock().take() {
            w.wake();
        }
    }

    fn take_result(&self) -> Option<Result<BatchStats, Error>> {
        if !self.is_done() {
            return None;
        }
        let g = self.result.lock();
        g.as_ref().map(|r| match r {
            Ok(s) => Ok(*s),
            Err(e) => Err(e.duplicate()),
        })
    }

    fn check_deadline(&self) {
        if !self.is_done() && Instant::now() >= self.deadline {
            self.fail(Error::Timeout);
        }
    }
}

/// A peer's in-flight batches (by id), failed together when the peer dies.
#[derive(Default)]
pub(crate) struct Pending {
    map: Mutex<HashMap<u64, Arc<BatchState>>>,
    closed: Mutex<Option<String>>,
    /// Where this peer's batches are counted (`None`: metrics disabled).
    pub(crate) obs: Option<PeerObs>,
}

impl Pending {
    /// An empty in-flight map recording into `obs`.
    pub fn with_obs(obs: Option<PeerObs>) -> Self {
        Pending {
            obs,
            ..Pending::default()
        }
    }

    /// Registers a batch; fails it at once when the peer is already gone.
    pub fn insert(self: &Arc<Self>, b: &Arc<BatchState>) -> Result<(), Error> {
        let closed = self.closed.lock();
        if let Some(reason) = closed.as_ref() {
            return Err(Error::PeerDead(reason.clone()));
        }
        *b.pending.lock() = Some(Arc::downgrade(self));
        self.map.lock().insert(b.id, b.clone());
        Ok(())
    }
    pub fn get(&self, id: u64) -> Option<Arc<BatchState>> {
        self.map.lock().get(&id).cloned()
    }
    fn remove(&self, id: u64) {
        self.map.lock().remove(&id);
    }
    /// Fails every in-flight batch and refuses new ones.
    pub fn close(&self, reason: &str, shutdown: bool) {
        {
            let mut c = self.closed.lock();
            if c.is_none() {
                *c = Some(reason.to_string());
            }
        }
        let all: Vec<_> = self.map.lock().drain().map(|(_, b)| b).collect();
        for b in all {
            b.fail(if shutdown {
                Error::Shutdown
            } else {
                Error::PeerDead(reason.to_string())
            });
        }
    }
    /// (bytes, slices, batches) in flight (metrics).
    pub fn inflight(&self) -> (u64, u64, u64) {
        let m = self.map.lock();
        m.values().fold((0, 0, m.len() as u64), |(b, s, n), x| {
            (b + x.stats.bytes, s + x.stats.slices as u64, n)
        })
    }
    pub fn closed_reason(&self) -> Option<String> {
        self.closed.lock().clone()
    }
}

/// Completion handle of a batch.
pub struct Batch {
    pub(crate) state: Arc<BatchState>,
}

impl std::fmt::Debug for Batch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Batch")
            .field("id", &self.state.id)
            .field("done", &self.state.is_done())
            .finish()
    }
}

impl Batch {
    /// Blocks until the batch completes or its deadline passes (`Error::Timeout`).
    ///
    /// Before parking, the caller checks the completion flag for a short bounded time
    /// ([`EngineConfig::wait_spin`](crate::EngineConfig::wait_spin), default 30 µs): a small
    /// write completes within about one round trip, and waking a parked thread costs about as
    /// much again. Set it to zero to never spin.
    pub fn wait(&self) -> Result<BatchStats, Error> {
        let s = &self.state;
        spin_until_done(s);
        let mut g = s.result.lock();
        while g.is_none() {
            if s.cv.wait_until(&mut g, s.deadline).timed_out() && g.is_none() {
                drop(g);
                s.fail(Error::Timeout);
                g = s.result.lock();
                // Another finisher may still be running its fail hook: wait for its outcome.
                while g.is_none() {
                    s.cv.wait(&mut g);
                }
            }
        }
        drop(g);
        s.take_result().unwrap_or(Err(Error::Timeout))
    }

    /// Waits at most `d`; `None` means still running.
    pub fn wait_timeout(&self, d: Duration) -> Option<Result<BatchStats, Error>> {
        let s = &self.state;
        let until = (Instant::now() + d).min(s.deadline);
        let mut g = s.result.lock();
        while g.is_none() {
            if s.cv.wait_until(&mut g, until).timed_out() {
                break;
            }
        }
        drop(g);
        s.check_deadline();
        s.take_result()
    }

    /// O(1), non-blocking: the result if finished (a passed deadline finishes it with `Timeout`).
    pub fn poll(&self) -> Option<Result<BatchStats, Error>> {
        self.state.check_deadline();
        self.state.take_result()
    }

    /// The batch's deadline.
    pub fn deadline(&self) -> Instant {
        self.state.deadline
    }
}

impl Future for Batch {
    type Output = Result<BatchStats, Error>;
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let s = &self.state;
        if let Some(r) = Batch::poll(&self) {
            return Poll::Ready(r);
        }
        {
            let mut w = s.waker.lock();
            match w.as_ref() {
                Some(old) if old.will_wake(cx.waker()) => {}
                _ => *w = Some(cx.waker().clone()),
            }
        }
        if !s.timer_armed.swap(true, Ordering::AcqRel) {
            if let Some(t) = s.timer.upgrade() {
                t.arm(s);
            }
        }
        // Re-check after publishing the waker (completion may have raced with us).
        match Batch::poll(&self) {
            Some(r) => Poll::Ready(r),
            None => Poll::Pending,
        }
    }
}

/// `Batch::wait`'s spin budget when the configuration does not set one.
pub(crate) const DEFAULT_WAIT_SPIN: Duration = Duration::from_micros(30);
/// The largest spin budget.
pub(crate) const MAX_WAIT_SPIN: Duration = Duration::from_micros(1000);

fn spin_until_done(s: &BatchState) {
    let budget = s.spin;
    if budget.is_zero() || s.is_done() {
        return;
    }
    let start = Instant::now();
    let mut n = 0u32;
    while !s.is_done() {
        std::hint::spin_loop();
        n = n.wrapping_add(1);
        if n % 64 == 0 && start.elapsed() >= budget {
            return;
        }
    }
}

// ---------------------------------------------------------------- deadline timer

struct TimerEntry {
    at: Instant,
    batch: Weak<BatchState>,
}
impl PartialEq for TimerEntry {
    fn eq(&self, o: &Self) -> bool {
        self.at == o.at
    }
}
impl Eq for TimerEntry {}
impl PartialOrd for TimerEntry {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for TimerEntry {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        o.at.cmp(&self.at) // min-heap
    }
}

/// Fails awaited batches at their deadline, so a future never hangs on a dead or slow peer.
/// Only batches that were polled as futures and not finished are armed; `wait`/`poll` check the
/// deadline themselves.
#[derive(Default)]
pub(crate) struct Timer {
    heap: Mutex<(BinaryHeap<TimerEntry>, bool)>,
    cv: Condvar,
}

impl Timer {
    pub fn start(self: &Arc<Self>, threads: &crate::net::Threads) -> std::io::Result<()> {
        let t = self.clone();
        crate::net::spawn_counted("kvwire-timer".into(), threads, move || t.run())?;
        Ok(())
    }

    fn arm(&self, b: &Arc<BatchState>) {
        let mut g = self.heap.lock();
        let earliest = g.0.peek().map(|e| e.at);
        g.0.push(TimerEntry {
            at: b.deadline,
            batch: Arc::downgrade(b),
        });
        if earliest.is_none_or(|e| b.deadline < e) {
            self.cv.notify_one();
        }
    }

    pub fn stop(&self) {
        self.heap.lock().1 = true;
        self.cv.notify_all();
    }

    fn run(&self) {
        let mut g = self.heap.lock();
        loop {
            if g.1 {
                return;
            }
            let now = Instant::now();
            while g.0.peek().is_some_and(|e| e.at <= now) {
                if let Some(e) = g.0.pop() {
                    if let Some(b) = e.batch.upgrade() {
                        b.check_deadline();
                    }
                }
            }
            match g.0.peek().map(|e| e.at) {
                Some(at) => {
                    self.cv.wait_until(&mut g, at);
                }
                None => self.cv.wait(&mut g),
            }
        }
    }
}

#[cfg(test)]
mod hook_tests {
    use super::*;
    use crate::types::TransportKind;

    fn stats() -> BatchStats {
        BatchStats {
            bytes: 0,
            ops: 0,
            writes: 0,
            slices: 0,
            transport: TransportKind::Tcp,
        }
    }

    #[test]
    fn fail_hook_runs_before_the_error_is_seen_and_first_finisher_wins() {
        let timer = Arc::new(Timer::default());
        let st = BatchState::new(1, 1, stats(), Instant::now(), Vec::new(), &timer);
        let seen = Arc::new(Mutex::new(None));
        let (s2, st2) = (seen.clone(), Arc::downgrade(&st));
        st.set_on_fail(Box::new(move |e: &Error| {
            // the outcome is not published yet while the hook runs
            let done = st2.upgrade().map(|s| s.is_done());
            *s2.lock() = Some((matches!(e, Error::Timeout), done));
        }));
        let b = Batch { state: st.clone() };
        assert!(matches!(b.wait(), Err(Error::Timeout)));
        assert_eq!(*seen.lock(), Some((true, Some(false))));
        st.part_done(); // a late completion does not change the outcome
        assert!(matches!(b.poll(), Some(Err(Error::Timeout))));
        // success: the hook is dropped, not run
        let st = BatchState::new(
            2,
            1,
            stats(),
            Instant::now() + Duration::from_secs(60),
            Vec::new(),
            &timer,
        );
        let ran = Arc::new(AtomicBool::new(false));
        let r2 = ran.clone();
        st.set_on_fail(Box::new(move |_| r2.store(true, Ordering::SeqCst)));
        st.part_done();
        st.fail(Error::Shutdown);
        assert!(!ran.load(Ordering::SeqCst));
        assert!(matches!(Batch { state: st }.poll(), Some(Ok(_))));
    }
}
