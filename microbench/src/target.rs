//! The target side of the transfer bench (`kvwire-bench transfer --serve`).
//!
//! The target offers two regions: a large data region the initiator writes into and reads
//! back from, and a small control region whose first bytes hold the target's [`Verdict`].
//! A verifier thread takes the notifications the engine delivers after each batch has
//! landed, decodes their [`Tag`], and checks the CRC-32 of the named bytes. To keep checks
//! off the timed path it holds tags until the initiator asks for a verdict (a tag with a
//! non-zero `flush_total`), then checks everything and publishes the counters. The
//! initiator asks before it reuses any destination bytes, so nothing is overwritten before
//! it was checked.
//!
//! Tags come from the network: each peer's run is kept apart (another peer's tags never reset
//! it), a refused tag is counted but never published over another run's verdict, and the work
//! a tag can cause is bounded: one pass over the data region at most (a tag naming more bytes
//! than the region, or a flush count beyond the tags its run sent, is refused unread), and the
//! verifier checks only when something is pending.

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use kvwire_transfer::{Access, Engine, EngineConfig, PeerId, RegionHandle, TransportKind};
use tracing::{debug, info, warn};

use crate::cpu;
use crate::error::{BenchError, Context};
use crate::pattern::crc_region;
use crate::wire::{Phase, Tag, Verdict};

/// Bytes of the control region.
pub const CONTROL_LEN: u64 = 4096;
/// Offset in the control region where the initiator's flush writes land (ignored bytes).
pub const FLUSH_OFFSET: u64 = 2048;
/// Tags held unchecked before the verifier checks them anyway.
const MAX_PENDING: usize = 100_000;
/// How often an idle verifier looks for notifications.
const IDLE_POLL: Duration = Duration::from_millis(2);

/// Test-only fault injection: makes the target corrupt bytes, to show the checks catch it.
#[doc(hidden)]
#[derive(Debug, Clone, Copy)]
pub enum TargetFault {
    /// Before checking the `n`-th measured batch of a run (1-based; tags that carry data,
    /// warm-up writes not counted), flip the first byte of its first range in the data
    /// region.
    CorruptBeforeVerify {
        /// Which data tag.
        nth: u64,
    },
    /// Like `CorruptBeforeVerify`, but flips the first byte of range `range` of that tag
    /// (nothing when the tag has fewer ranges).
    CorruptRangeBeforeVerify {
        /// Which data tag.
        nth: u64,
        /// Which of its ranges (0-based).
        range: usize,
    },
}

/// How to start a target.
#[derive(Debug, Clone)]
pub struct ServeConfig {
    /// Address the engine listens on.
    pub listen: SocketAddr,
    /// Shared secret, if any.
    pub secret: Option<Vec<u8>>,
    /// Transport preference of the target's engine.
    pub transport: TransportKind,
    /// Bytes of the data region.
    pub region_len: u64,
    /// Test-only fault injection.
    #[doc(hidden)]
    pub fault: Option<TargetFault>,
}

/// A running target: an engine, its two regions and the verifier thread.
pub struct Target {
    engine: Engine,
    stop: Arc<AtomicBool>,
    latest: Arc<Mutex<Verdict>>,
    worker: Option<JoinHandle<()>>,
    region_len: u64,
    stats: Arc<TargetStats>,
}

impl Target {
    /// Starts the engine, allocates the regions and starts the verifier.
    pub fn start(cfg: ServeConfig) -> Result<Target, BenchError> {
        let ecfg = EngineConfig {
            listen: cfg.listen,
            secret: cfg.secret.clone(),
            transport: cfg.transport,
            // KVWIRE_* knobs (tests/vm/bench_rdma.sh sets the RDMA ones).
            ..EngineConfig::from_env()
        };
        let engine =
            Engine::new(ecfg).ctx(|| format!("starting the target engine on {}", cfg.listen))?;
        let data = engine
            .alloc_region(cfg.region_len as usize, Access::ReadWrite)
            .ctx(|| format!("allocating the {} byte data region", cfg.region_len))?;
        let ctrl = engine
            .alloc_region(CONTROL_LEN as usize, Access::ReadWrite)
            .ctx(|| "allocating the control region".to_string())?;
        let stop = Arc::new(AtomicBool::new(false));
        let latest = Arc::new(Mutex::new(Verdict::default()));
        let stats = Arc::new(TargetStats::default());
        let mut v = Verifier {
            engine: engine.clone(),
            data,
            ctrl,
            region_len: cfg.region_len,
            fault: cfg.fault,
            runs: HashMap::new(),
            order: VecDeque::new(),
            scratch: Vec::new(),
            latest: latest.clone(),
            stats: stats.clone(),
        };
        v.publish(&Verdict::default());
        let stop2 = stop.clone();
        let worker = std::thread::Builder::new()
            .name("kvwire-bench-verifier".into())
            .spawn(move || v.run(&stop2))?;
        info!(addr = %engine.listen_addr(), region_len = cfg.region_len, "target ready");
        Ok(Target {
            engine,
            stop,
            latest,
            worker: Some(worker),
            region_len: cfg.region_len,
            stats,
        })
    }

    /// The address initiators connect to.
    pub fn addr(&self) -> SocketAddr {
        self.engine.listen_addr()
    }

    /// Bytes of the data region.
    pub fn region_len(&self) -> u64 {
        self.region_len
    }

    /// The verifier's work so far (tests of its bounds).
    #[doc(hidden)]
    pub fn stats(&self) -> &TargetStats {
        &self.stats
    }

    /// The verdict most recently published.
    pub fn verdict(&self) -> Verdict {
        self.latest.lock().map(|v| v.clone()).unwrap_or_default()
    }

    /// Stops the verifier and the engine.
    pub fn stop(mut self) {
        self.halt();
    }

    fn halt(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
        self.engine.shutdown();
    }
}

impl Drop for Target {
    fn drop(&mut self) {
        self.halt();
    }
}

/// Counters of the verifier's work (tests of its bounds).
#[doc(hidden)]
#[derive(Debug, Default)]
pub struct TargetStats {
    /// Bytes of the data region read to check tags.
    pub crc_bytes: AtomicU64,
    /// Tags checked (read, or refused without reading).
    pub tags_checked: AtomicU64,
    /// Tags refused without reading a byte (undecodable, ranges beyond the region, more
    /// bytes than the region, a flush count beyond the tags seen).
    pub bad_tags: AtomicU64,
    /// Passes of the verifier loop that checked with nothing pending (stays 0: it never
    /// spins).
    pub idle_checks: AtomicU64,
}

/// What the verifier holds for one peer's run: one initiator's tags never reset another's.
#[derive(Default)]
struct RunState {
    verdict: Verdict,
    pending: VecDeque<Tag>,
    /// Ranges of the pending tags (checked anyway beyond [`MAX_PENDING_RANGES`]).
    pending_ranges: usize,
    /// Tags the initiator has asked to be checked (largest `flush_total` seen this run).
    want: u64,
    data_tags: u64,
}

impl RunState {
    fn due(&self) -> bool {
        !self.pending.is_empty()
            && (self.want > self.verdict.verified_tags
                || self.pending.len() > MAX_PENDING
                || self.pending_ranges > MAX_PENDING_RANGES)
    }
}

/// Peers whose runs are kept at once (the least recently heard from is forgotten first).
const MAX_RUNS: usize = 16;
/// Ranges held unchecked per run before the verifier checks them anyway.
const MAX_PENDING_RANGES: usize = 1 << 20;

struct Verifier {
    engine: Engine,
    data: RegionHandle,
    ctrl: RegionHandle,
    region_len: u64,
    fault: Option<TargetFault>,
    runs: HashMap<PeerId, RunState>,
    /// Peers by when their last tag arrived, oldest first.
    order: VecDeque<PeerId>,
    scratch: Vec<u8>,
    latest: Arc<Mutex<Verdict>>,
    stats: Arc<TargetStats>,
}

impl Verifier {
    /// Drains the notification queue every [`IDLE_POLL`] instead of waking for each
    /// notification: a wake-up per write would compete with the engine's own threads for
    /// the CPU during the timed phases. Checks only what is pending, so no tag can make it
    /// spin.
    fn run(&mut self, stop: &AtomicBool) {
        let notes = self.engine.notifications();
        while !stop.load(Ordering::SeqCst) {
            while let Some(n) = notes.try_recv() {
                self.take(n.peer, &n.tag);
            }
            let due: Vec<PeerId> = self
                .runs
                .iter()
                .filter(|(_, r)| r.due())
                .map(|(p, _)| *p)
                .collect();
            if due.is_empty() {
                std::thread::sleep(IDLE_POLL);
            }
            for p in due {
                self.check_pending(p);
            }
        }
    }

    /// The run state of `peer`; a new one forgets the least recently heard from beyond
    /// [`MAX_RUNS`].
    fn state(&mut self, peer: PeerId) -> &mut RunState {
        if let Some(i) = self.order.iter().position(|p| *p == peer) {
            self.order.remove(i);
        }
        self.order.push_back(peer);
        while self.order.len() > MAX_RUNS {
            if let Some(old) = self.order.pop_front() {
                self.runs.remove(&old);
            }
        }
        self.runs.entry(peer).or_default()
    }

    /// Counts a tag refused unread. It is reported (in [`Target::verdict`]) but never
    /// published to the control region: a peer's garbage does not overwrite another's
    /// verdict.
    fn refuse(&mut self, peer: PeerId) {
        self.stats.bad_tags.fetch_add(1, Ordering::Relaxed);
        self.stats.tags_checked.fetch_add(1, Ordering::Relaxed);
        let st = self.state(peer);
        st.verdict.bad_tags += 1;
        let v = st.verdict.clone();
        if let Ok(mut l) = self.latest.lock() {
            *l = v;
        }
    }

    fn take(&mut self, peer: PeerId, raw: &[u8]) {
        let tag = match Tag::decode(raw) {
            Ok(t) => t,
            Err(e) => {
                warn!("undecodable notification ({} bytes): {e}", raw.len());
                self.refuse(peer);
                return;
            }
        };
        // One pass over the region per tag at most: a tag naming bytes outside the region,
        // or more bytes in all than the region holds, is refused unread.
        let mut total: u64 = 0;
        let fits = tag.ranges.iter().all(|r| {
            let end = r.offset.checked_add(r.len);
            total = total.saturating_add(r.len);
            end.is_some_and(|end| end <= self.region_len) && total <= self.region_len
        });
        if !fits {
            warn!(
                seq = tag.seq,
                ranges = tag.ranges.len(),
                "tag names bytes outside the data region or more than it holds"
            );
            self.refuse(peer);
            return;
        }
        let st = self.state(peer);
        let new_run = tag.run != st.verdict.run;
        let seen = if new_run { 1 } else { st.verdict.tags_seen + 1 };
        // The initiator waits for each flush, so its flush count covers the tags it sent so
        // far, this one included; a larger count could never be reached.
        if tag.flush_total > seen {
            warn!(
                seq = tag.seq,
                flush_total = tag.flush_total,
                "flush count beyond the tags seen"
            );
            self.refuse(peer);
            return;
        }
        if new_run {
            debug!(run = tag.run, "new initiator run");
            *st = RunState {
                verdict: Verdict {
                    run: tag.run,
                    ..Verdict::default()
                },
                ..RunState::default()
            };
        }
        st.verdict.tags_seen += 1;
        st.want = st.want.max(tag.flush_total);
        st.pending_ranges += tag.ranges.len();
        st.pending.push_back(tag);
    }

    fn check_pending(&mut self, peer: PeerId) {
        let Some(st) = self.runs.get_mut(&peer) else {
            return;
        };
        if st.pending.is_empty() {
            self.stats.idle_checks.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let tags: Vec<Tag> = st.pending.drain(..).collect();
        st.pending_ranges = 0;
        let mut verdict = std::mem::take(&mut st.verdict);
        let mut data_tags = st.data_tags;
        for tag in &tags {
            self.check(&mut verdict, &mut data_tags, tag);
        }
        self.publish(&verdict);
        if let Some(st) = self.runs.get_mut(&peer) {
            st.verdict = verdict;
            st.data_tags = data_tags;
        }
    }

    /// Checks one tag whose ranges are known to lie in the region.
    fn check(&mut self, verdict: &mut Verdict, data_tags: &mut u64, tag: &Tag) {
        self.stats.tags_checked.fetch_add(1, Ordering::Relaxed);
        verdict.verified_tags += 1;
        if !tag.ranges.is_empty() && tag.phase != Phase::Warmup {
            *data_tags += 1;
            let hit = match self.fault {
                Some(TargetFault::CorruptBeforeVerify { nth }) if nth == *data_tags => {
                    tag.ranges.first()
                }
                Some(TargetFault::CorruptRangeBeforeVerify { nth, range }) if nth == *data_tags => {
                    tag.ranges.get(range)
                }
                _ => None,
            };
            if let Some(r) = hit {
                self.corrupt(r.offset);
            }
        }
        let mut h = crc32fast::Hasher::new();
        for r in &tag.ranges {
            if let Err(e) = crc_region(
                &self.engine,
                self.data,
                r.offset,
                r.len,
                &mut h,
                &mut self.scratch,
            ) {
                warn!(seq = tag.seq, "reading the data region failed: {e}");
                mismatch(verdict, tag, 0);
                return;
            }
            self.stats.crc_bytes.fetch_add(r.len, Ordering::Relaxed);
            verdict.verified_bytes += r.len;
        }
        let actual = h.finalize();
        if actual != tag.crc {
            warn!(
                seq = tag.seq,
                phase = ?tag.phase,
                expected = tag.crc,
                actual,
                "data mismatch"
            );
            mismatch(verdict, tag, actual);
        }
    }

    fn corrupt(&mut self, offset: u64) {
        let mut b = [0u8; 1];
        if self.engine.local_read(self.data, offset, &mut b).is_ok() {
            b[0] = !b[0];
            let _ = self.engine.local_write(self.data, offset, &b);
            warn!(
                offset,
                "fault injection: flipped one byte of the data region"
            );
        }
    }

    /// Publishes `verdict` with the process's CPU time and this (the verifier's) thread's in it.
    fn publish(&mut self, verdict: &Verdict) {
        let nanos =
            |d: Option<Duration>| d.map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX));
        let v = Verdict {
            cpu_ns: nanos(cpu::process()),
            checker_cpu_ns: nanos(cpu::thread()),
            ..verdict.clone()
        };
        if let Err(e) = self.engine.local_write(self.ctrl, 0, &v.encode()) {
            warn!("publishing the verdict failed: {e}");
        }
        if let Ok(mut l) = self.latest.lock() {
            *l = v;
        }
    }
}

fn mismatch(verdict: &mut Verdict, tag: &Tag, actual: u32) {
    if verdict.mismatches == 0 {
        verdict.first_bad_phase = tag.phase as u8;
        verdict.first_bad_seq = tag.seq;
        verdict.first_bad_expected = tag.crc;
        verdict.first_bad_actual = actual;
    }
    verdict.mismatches += 1;
}
