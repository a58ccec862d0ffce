//! Races against `unregister`: threads that keep submitting batches (a few in flight each)
//! while a region goes away, and a child target whose caller memory is withdrawn under them.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use kvwire_transfer::{
    Access, Batch, Engine, EngineConfig, Error, Op, Peer, RegionHandle, RegionId, TransportKind,
};

use super::{pattern, Target};

/// Bound on batches per racing thread.
pub const MAX_BATCHES: usize = 3000;
/// Batches each racing thread keeps in flight.
pub const INFLIGHT: usize = 4;

/// What one racing thread saw.
#[derive(Default, Clone, Copy, Debug)]
pub struct Outcome {
    /// Batches completed.
    pub ok: u64,
    /// `StaleRegion` while the thread was still submitting: refused at submit, or failed when a
    /// full window of batches in flight was settled.
    pub stale: u64,
    /// `StaleRegion` among the batches still in flight when the thread stopped submitting.
    pub stale_after: u64,
}

impl Outcome {
    /// Every `StaleRegion` the thread saw.
    pub fn stale_all(&self) -> u64 {
        self.stale + self.stale_after
    }
}

/// Waits for the batches in flight; anything but success or `StaleRegion` is a failure.
/// Returns how many failed with `StaleRegion`.
fn settle(inflight: &mut Vec<Batch>, ok: &mut u64, done: &AtomicU64) -> u64 {
    let mut stale = 0;
    for b in inflight.drain(..) {
        match b.wait() {
            Ok(_) => {
                *ok += 1;
                done.fetch_add(1, Ordering::Relaxed);
            }
            Err(Error::StaleRegion(_)) => stale += 1,
            Err(other) => panic!("batch: unexpected {other}"),
        }
    }
    stale
}

/// Threads submitting batches until told to stop; each stops once it was told to and has seen
/// `StaleRegion`, or after [`MAX_BATCHES`].
pub struct Racers {
    stop: Arc<AtomicBool>,
    done: Arc<AtomicU64>,
    handles: Vec<JoinHandle<Outcome>>,
}

impl Racers {
    /// Starts `threads` threads; thread `th` submits its batch `i` with `submit(i, th)`
    /// ([`INFLIGHT`] in flight at most). A submit error other than `StaleRegion` is a failure.
    pub fn spawn<F>(threads: usize, submit: F) -> Racers
    where
        F: Fn(usize, usize) -> Result<Batch, Error> + Send + Sync + 'static,
    {
        let submit = Arc::new(submit);
        let stop = Arc::new(AtomicBool::new(false));
        let done = Arc::new(AtomicU64::new(0));
        let mut handles = Vec::new();
        for th in 0..threads {
            let (submit, stop, done) = (submit.clone(), stop.clone(), done.clone());
            handles.push(std::thread::spawn(move || {
                let mut out = Outcome::default();
                let mut inflight = Vec::new();
                for i in 0..MAX_BATCHES {
                    match submit(i, th) {
                        Ok(b) => inflight.push(b),
                        Err(Error::StaleRegion(_)) => out.stale += 1,
                        Err(other) => panic!("submit: unexpected {other}"),
                    }
                    if inflight.len() >= INFLIGHT {
                        out.stale += settle(&mut inflight, &mut out.ok, &done);
                    }
                    if stop.load(Ordering::Acquire) && out.stale > 0 {
                        break;
                    }
                }
                out.stale_after = settle(&mut inflight, &mut out.ok, &done);
                out
            }));
        }
        Racers {
            stop,
            done,
            handles,
        }
    }

    /// Lets batches flow until `n` completed; bounded (10 s), so that a slow host only makes
    /// the race start later.
    pub fn wait_completed(&self, n: u64) {
        let mut waited = 0;
        while self.done.load(Ordering::Relaxed) < n && waited < 2000 {
            std::thread::sleep(Duration::from_millis(5));
            waited += 1;
        }
    }

    /// Tells every thread to stop and collects what each saw (`who` names them in a panic).
    pub fn stop(self, who: &str) -> Vec<Outcome> {
        self.stop.store(true, Ordering::Release);
        self.handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| panic!("{who} thread")))
            .collect()
    }
}

/// A child target with a 1 MiB control region (index 0) and `len` bytes of caller memory
/// (index 1, `register_raw`), our engine connected to it, and a local source region holding the
/// pattern `seed`, already written once over the whole raw region and checked there.
pub struct RawTarget {
    /// Our connection to the child.
    pub p: Peer,
    /// Our engine.
    pub e: Engine,
    /// The child.
    pub t: Target,
    /// The child's raw region.
    pub raw: RegionId,
    /// Our source region (`len` bytes of the pattern `seed`).
    pub src: RegionHandle,
    /// The pattern in `src`.
    pub seed: u64,
}

impl RawTarget {
    /// Starts the child, connects an engine configured for `transport` and checks that the
    /// connection uses `expect`, then writes the whole raw region once and checks it.
    pub fn start(transport: TransportKind, expect: TransportKind, len: usize, seed: u64) -> Self {
        let mut t = Target::spawn("child_main", &format!("1048576:rw,{len}:rw:raw"), None);
        let e = Engine::new(EngineConfig {
            transport,
            ..Default::default()
        })
        .expect("engine");
        let p = e.connect(t.addr).expect("connect");
        assert_eq!(p.transport(), expect);
        let raw = p.regions()[1].id;
        let src = e.alloc_region(len, Access::Local).expect("src");
        e.local_write(src, 0, &pattern(seed, 0, len)).expect("fill");
        // Before the race: one verified write of the whole region.
        let whole = Op {
            local: src,
            local_offset: 0,
            remote: raw,
            remote_offset: 0,
            len: len as u64,
        };
        e.write(&p, &[whole], None, None)
            .expect("submit")
            .wait()
            .expect("first write");
        assert_eq!(t.cmd(&format!("check 1 0 {len} {seed}")), "OK");
        RawTarget {
            p,
            e,
            t,
            raw,
            src,
            seed,
        }
    }

    /// The child unregisters the raw region and at once overwrites its memory with the pattern
    /// `guard`.
    pub fn unregister_guard(&mut self, guard: u64) {
        assert_eq!(self.t.cmd(&format!("unregister_guard 1 {guard}")), "OK");
    }

    /// After the race: no byte landed in the raw memory after `unregister` returned (the guard
    /// is intact), and the peer and the control region still work, bytes checked at both ends.
    pub fn finish(mut self, guard: u64) {
        assert_eq!(self.t.cmd(&format!("check_guard 1 {guard}")), "OK");
        let ctl = self.p.regions()[0].id;
        self.e
            .write(
                &self.p,
                &[Op {
                    local: self.src,
                    local_offset: 0,
                    remote: ctl,
                    remote_offset: 0,
                    len: 1 << 20,
                }],
                None,
                None,
            )
            .expect("submit")
            .wait()
            .expect("write after the race");
        let seed = self.seed;
        assert_eq!(self.t.cmd(&format!("check 0 0 1048576 {seed}")), "OK");
        assert!(self.p.is_alive());
    }
}
