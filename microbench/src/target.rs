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

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use kvwire_transfer::{Access, Engine, EngineConfig, RegionHandle, TransportKind};
use tracing::{debug, info, warn};

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
        let mut v = Verifier {
            engine: engine.clone(),
            data,
            ctrl,
            region_len: cfg.region_len,
            fault: cfg.fault,
            verdict: Verdict::default(),
            pending: VecDeque::new(),
            want: 0,
            data_tags: 0,
            scratch: Vec::new(),
            latest: latest.clone(),
        };
        v.publish();
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

struct Verifier {
    engine: Engine,
    data: RegionHandle,
    ctrl: RegionHandle,
    region_len: u64,
    fault: Option<TargetFault>,
    verdict: Verdict,
    pending: VecDeque<Tag>,
    /// Tags the initiator has asked to be checked (largest `flush_total` seen this run).
    want: u64,
    data_tags: u64,
    scratch: Vec<u8>,
    latest: Arc<Mutex<Verdict>>,
}

impl Verifier {
    /// Drains the notification queue every [`IDLE_POLL`] instead of waking for each
    /// notification: a wake-up per write would compete with the engine's own threads for
    /// the CPU during the timed phases.
    fn run(&mut self, stop: &AtomicBool) {
        let notes = self.engine.notifications();
        while !stop.load(Ordering::SeqCst) {
            while let Some(n) = notes.try_recv() {
                self.take(&n.tag);
            }
            if self.want > self.verdict.verified_tags || self.pending.len() > MAX_PENDING {
                self.check_pending();
            } else {
                std::thread::sleep(IDLE_POLL);
            }
        }
    }

    fn take(&mut self, raw: &[u8]) {
        let tag = match Tag::decode(raw) {
            Ok(t) => t,
            Err(e) => {
                warn!("undecodable notification ({} bytes): {e}", raw.len());
                self.verdict.bad_tags += 1;
                self.publish();
                return;
            }
        };
        if tag.run != self.verdict.run {
            debug!(run = tag.run, "new initiator run");
            self.verdict = Verdict {
                run: tag.run,
                ..Verdict::default()
            };
            self.pending.clear();
            self.want = 0;
            self.data_tags = 0;
        }
        self.verdict.tags_seen += 1;
        self.want = self.want.max(tag.flush_total);
        self.pending.push_back(tag);
    }

    fn check_pending(&mut self) {
        while let Some(tag) = self.pending.pop_front() {
            self.check(&tag);
        }
        self.publish();
    }

    fn check(&mut self, tag: &Tag) {
        self.verdict.verified_tags += 1;
        let in_bounds = tag.ranges.iter().all(|r| {
            r.offset
                .checked_add(r.len)
                .is_some_and(|end| end <= self.region_len)
        });
        if !in_bounds {
            warn!(seq = tag.seq, "tag names bytes outside the data region");
            self.verdict.bad_tags += 1;
            self.mismatch(tag, 0);
            return;
        }
        if !tag.ranges.is_empty() && tag.phase != Phase::Warmup {
            self.data_tags += 1;
            let hit = match self.fault {
                Some(TargetFault::CorruptBeforeVerify { nth }) if nth == self.data_tags => {
                    tag.ranges.first()
                }
                Some(TargetFault::CorruptRangeBeforeVerify { nth, range })
                    if nth == self.data_tags =>
                {
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
                self.mismatch(tag, 0);
                return;
            }
            self.verdict.verified_bytes += r.len;
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
            self.mismatch(tag, actual);
        }
    }

    fn mismatch(&mut self, tag: &Tag, actual: u32) {
        if self.verdict.mismatches == 0 {
            self.verdict.first_bad_phase = tag.phase as u8;
            self.verdict.first_bad_seq = tag.seq;
            self.verdict.first_bad_expected = tag.crc;
            self.verdict.first_bad_actual = actual;
        }
        self.verdict.mismatches += 1;
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

    fn publish(&mut self) {
        if let Err(e) = self
            .engine
            .local_write(self.ctrl, 0, &self.verdict.encode())
        {
            warn!("publishing the verdict failed: {e}");
        }
        if let Ok(mut l) = self.latest.lock() {
            *l = self.verdict.clone();
        }
    }
}
