//! The initiator side of the transfer bench: connects to a target, runs the phases of the
//! [`Plan`], and collects the target's verdicts and its own read-back checks.
//!
//! Timing covers only the engine calls (submit to completion). Generating each operation's
//! data, checksumming it, and waiting for the target's verdicts happen between timed
//! operations. GB/s is therefore bytes over the summed time with operations in flight.
//!
//! The serial and batch phases submit their timed writes with no notification: the peer
//! benches send none either. What each write put where (ranges and CRC-32) is kept in a
//! record and sent to the target, as tags of batches with no writes, before every verdict
//! request (so before any destination byte is reused) and at the end of each phase, all
//! outside the timed section. This checks every byte as a per-write tag would, because each
//! timed write (or batch) is waited to completion before the next is submitted, and
//! completion means the bytes are in the target's memory:
//!
//! * TCP (`transfer/src/transport/tcp.rs`): the target reads each write slice's payload into
//!   the region and only then queues the slice's ack; the batch completes when every slice
//!   was acked, tracked (with a notification) or not.
//! * shm (`transfer/src/transport/shm.rs`): the initiator itself copies into the target's
//!   mapped memfd (or with `process_vm_writev`); the batch completes after the copy, and the
//!   record's notification is sent over the control connection after that.
//! * RDMA (`transfer/src/transport/rdma.rs`): a batch completes when every RDMA WRITE's
//!   work completion arrived, which on a reliable connection follows the responder's ack;
//!   a batch with no writes completes after its notification went on the control connection.
//!
//! The KV-layer pattern keeps one notification per layer (timed), as the connector's layer
//! writes carry one; each row reports how many notifications its timed section sent.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use kvwire_transfer::{
    Access, Engine, EngineConfig, Op, Peer, RegionHandle, RegionId, TransportKind,
};
use tracing::{debug, info};

use crate::cpu;
use crate::error::{BenchError, Context};
use crate::pattern::{crc_region, op_seed, stage};
use crate::plan::{fmt_size, Plan};
use crate::report::{hostname, CpuPerGb, KvShape, Pattern, Report, Row, TargetSummary};
use crate::stats::{gbps, Samples};
use crate::target::{CONTROL_LEN, FLUSH_OFFSET};
use crate::wire::{Phase, Range, Tag, Verdict, WireError, MAX_TAG_RANGES, VERDICT_LEN};

/// Per-batch deadline handed to the engine.
const BATCH_DEADLINE: Duration = Duration::from_secs(60);
/// The serial and batch phases write into a window of at least this many bytes of the
/// target's region (8 slots at least, the whole region at most), then ask for a verdict and
/// start over: destinations stay as warm as a peer bench's fixed buffer, while no byte is
/// overwritten before the target checked it.
const DST_WINDOW: u64 = 1 << 20;
/// Bound on waiting for the target's verdict after a flush.
const VERDICT_TIMEOUT: Duration = Duration::from_secs(120);

/// How to run the initiator.
#[derive(Debug, Clone)]
pub struct RunConfig {
    /// The target's address (`kvwire-bench transfer --serve`).
    pub target: SocketAddr,
    /// Shared secret, if any.
    pub secret: Option<Vec<u8>>,
    /// Transport to ask for.
    pub transport: TransportKind,
    /// Where this side's engine listens.
    pub listen: SocketAddr,
    /// What to measure.
    pub plan: Plan,
    /// Draw a progress bar on stderr (only shown on a terminal).
    pub progress: bool,
    /// TCP connections per peer (`None`: the engine's default).
    pub lanes: Option<usize>,
    /// Largest slice in bytes (`None`: the engine's default).
    pub slice_size: Option<usize>,
    /// Serve the engine's Prometheus metrics (`GET /metrics`) on this address while the run
    /// lasts (port 0: a free port; the bound address is printed to stderr).
    pub metrics_addr: Option<SocketAddr>,
}

/// What the bench prints to stderr before the URL of its metrics endpoint (`--metrics-addr`).
pub const METRICS_PREFIX: &str = "kvwire-bench: metrics on ";

/// A transport's name as the reports print it.
pub fn transport_name(t: TransportKind) -> String {
    format!("{t:?}").to_ascii_lowercase()
}

/// Runs the whole plan against the target and returns the report (`report.verified` says
/// whether every byte checked out).
pub fn run(cfg: &RunConfig) -> Result<Report, BenchError> {
    cfg.plan.validate().map_err(BenchError::Plan)?;
    // KVWIRE_* knobs (tests/vm/bench_rdma.sh sets the RDMA ones).
    let defaults = EngineConfig::from_env();
    let engine = Engine::new(EngineConfig {
        listen: cfg.listen,
        secret: cfg.secret.clone(),
        transport: cfg.transport,
        lanes: cfg.lanes.unwrap_or(defaults.lanes),
        slice_size: cfg.slice_size.unwrap_or(defaults.slice_size),
        metrics_addr: cfg.metrics_addr,
        ..defaults
    })
    .ctx(|| format!("starting the initiator engine on {}", cfg.listen))?;
    if let Some(a) = engine.metrics_addr() {
        eprintln!("{METRICS_PREFIX}http://{a}/metrics");
    }
    let peer = engine
        .connect(cfg.target)
        .ctx(|| format!("connecting to the target at {}", cfg.target))?;
    let transport = transport_name(peer.transport());
    info!(target = %cfg.target, %transport, "connected");

    // The target offers exactly two regions: the control region (CONTROL_LEN bytes) and the
    // data region (the other one).
    let regions = peer.regions();
    let ctrl = regions
        .iter()
        .find(|r| r.len == CONTROL_LEN)
        .ok_or_else(|| {
            BenchError::Target(format!(
                "no {CONTROL_LEN}-byte control region offered (got {} regions); is this a `kvwire-bench transfer --serve` target?",
                regions.len()
            ))
        })?;
    let data = regions
        .iter()
        .filter(|r| r.id != ctrl.id)
        .max_by_key(|r| r.len)
        .ok_or_else(|| BenchError::Target("no data region offered".into()))?;
    let plan = &cfg.plan;
    let need = plan.data_region_len();
    if data.len < need {
        return Err(BenchError::Plan(format!(
            "the target's data region has {} bytes; this plan needs {need} (start the target with --region-size {need})",
            data.len
        )));
    }

    let src = engine
        .alloc_region(need as usize, Access::Local)
        .ctx(|| format!("allocating the {need} byte source region"))?;
    let scratch = engine
        .alloc_region(plan.scratch_len() as usize, Access::Local)
        .ctx(|| "allocating the read-back region".to_string())?;
    let ctrl_local = engine
        .alloc_region(CONTROL_LEN as usize, Access::Local)
        .ctx(|| "allocating the local control region".to_string())?;

    let steps = plan.sizes.len() as u64 * 3 + plan.kv_rounds as u64 + 3;
    let bar = if cfg.progress {
        ProgressBar::with_draw_target(Some(steps), ProgressDrawTarget::stderr())
    } else {
        ProgressBar::hidden()
    };
    if let Ok(style) = ProgressStyle::with_template("{bar:30} {pos}/{len} {elapsed} {msg}") {
        bar.set_style(style);
    }

    let mut b = Bench {
        engine: engine.clone(),
        peer,
        plan,
        run: run_id(),
        src,
        scratch,
        ctrl_local,
        r_data: data.id,
        r_data_len: data.len,
        r_ctrl: ctrl.id,
        seq: 0,
        tags_sent: 0,
        record: Record::default(),
        buf: Vec::new(),
        read_checked: 0,
        read_mismatches: 0,
        last: Verdict::default(),
        timed_cpu: Some(Duration::ZERO),
        bar,
    };
    let mut rows = Vec::new();
    b.warmup()?;
    for &size in &plan.sizes {
        b.bar.set_message(format!("serial {}", fmt_size(size)));
        let (row, expected) = b.serial(size)?;
        rows.push(row);
        b.bar.inc(1);
        b.bar.set_message(format!("read {}", fmt_size(size)));
        rows.push(b.read_back(size, &expected)?);
        b.bar.inc(1);
        b.bar.set_message(format!("batch {}", fmt_size(size)));
        rows.push(b.batch(size)?);
        b.bar.inc(1);
    }
    rows.push(b.kv()?);
    let v = b.flush()?;
    b.bar.finish_and_clear();

    let check = TargetSummary {
        tags_sent: b.tags_sent,
        tags_seen: v.tags_seen,
        verified_tags: v.verified_tags,
        verified_bytes: v.verified_bytes,
        mismatches: v.mismatches,
        bad_tags: v.bad_tags,
        read_bytes_checked: b.read_checked,
        read_mismatches: b.read_mismatches,
    };
    let verified = rows.iter().all(|r| r.verified)
        && v.tags_seen == b.tags_sent
        && v.verified_tags == b.tags_sent
        && v.mismatches == 0
        && v.bad_tags == 0
        && b.read_mismatches == 0
        && b.read_checked > 0;
    if v.mismatches > 0 {
        tracing::error!(
            phase = v.first_bad_phase,
            seq = v.first_bad_seq,
            expected = v.first_bad_expected,
            actual = v.first_bad_actual,
            "the target found {} mismatching batches",
            v.mismatches
        );
    }
    engine.shutdown();
    Ok(Report {
        engine: "kvwire",
        transport,
        host: hostname(),
        target: cfg.target.to_string(),
        verified,
        results: rows,
        check,
        plan: plan.clone(),
    })
}

fn run_id() -> u64 {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    // never 0: a zeroed control region must not look like this run's verdict
    (t ^ ((std::process::id() as u64) << 32)) | 1
}

/// Ranges written by completed, untagged writes of one phase, in order, with the CRC-32 of
/// their bytes concatenated in that order.
struct Record {
    phase: Phase,
    ranges: Vec<Range>,
    crc: crc32fast::Hasher,
}

impl Default for Record {
    fn default() -> Self {
        Record {
            phase: Phase::Serial,
            ranges: Vec::new(),
            crc: crc32fast::Hasher::new(),
        }
    }
}

struct Bench<'a> {
    engine: Engine,
    peer: Peer,
    plan: &'a Plan,
    run: u64,
    src: RegionHandle,
    scratch: RegionHandle,
    ctrl_local: RegionHandle,
    r_data: RegionId,
    r_data_len: u64,
    r_ctrl: RegionId,
    seq: u64,
    tags_sent: u64,
    /// Writes completed since the last record was sent (see the module docs).
    record: Record,
    buf: Vec<u8>,
    read_checked: u64,
    read_mismatches: u64,
    /// The last verdict seen (for per-phase deltas).
    last: Verdict,
    /// This process's CPU time inside timed sections so far (`None` once a reading failed).
    timed_cpu: Option<Duration>,
    bar: ProgressBar,
}

/// Where a row's CPU count starts (see [`CpuPerGb`]).
#[derive(Clone, Copy)]
struct CpuMark {
    initiator: Option<Duration>,
    target: Option<u64>,
}

/// The target's transfer CPU at a verdict: its process's less its verifier thread's, ns.
fn target_cpu_ns(v: &Verdict) -> Option<u64> {
    (v.cpu_ns > 0).then(|| v.cpu_ns.saturating_sub(v.checker_cpu_ns))
}

impl Bench<'_> {
    fn next_seq(&mut self) -> u64 {
        self.seq += 1;
        self.seq
    }

    fn op(&self, local_offset: u64, remote_offset: u64, len: u64) -> Op {
        Op {
            local: self.src,
            local_offset,
            remote: self.r_data,
            remote_offset,
            len,
        }
    }

    /// Generates one operation's data at `local_offset` of the source region.
    fn stage(
        &mut self,
        phase: Phase,
        seq: u64,
        index: u32,
        local_offset: u64,
        len: u64,
    ) -> Result<crc32fast::Hasher, BenchError> {
        let seed = op_seed(self.run, phase as u8, seq, index);
        stage(
            &self.engine,
            self.src,
            local_offset,
            len,
            seed,
            &mut self.buf,
        )
        .ctx(|| "writing the source pattern".to_string())
    }

    /// Submits one write batch with its tag and waits for it; returns the time from submit
    /// to completion. With `flush`, the tag asks the target to check everything so far.
    fn send(&mut self, ops: &[Op], mut tag: Tag, flush: bool) -> Result<Duration, BenchError> {
        self.tags_sent += 1;
        if flush {
            tag.flush_total = self.tags_sent;
        }
        let bytes = tag.encode();
        let t0 = Instant::now();
        let batch = self
            .engine
            .write(&self.peer, ops, Some(&bytes), Some(BATCH_DEADLINE))
            .ctx(|| format!("submitting {:?} batch {}", tag.phase, tag.seq))?;
        batch
            .wait()
            .ctx(|| format!("waiting for {:?} batch {}", tag.phase, tag.seq))?;
        Ok(t0.elapsed())
    }

    /// Runs a timed section, adding the CPU this process spent in it (all threads) to
    /// [`Bench::timed_cpu`]; the clock is read outside the section's own timing.
    fn counted<T>(
        &mut self,
        section: impl FnOnce(&mut Self) -> Result<T, BenchError>,
    ) -> Result<T, BenchError> {
        let c0 = cpu::process();
        let out = section(self);
        self.timed_cpu = match (self.timed_cpu, c0, cpu::process()) {
            (Some(t), Some(a), Some(b)) => Some(t + b.saturating_sub(a)),
            _ => None,
        };
        out
    }

    /// Where a row's CPU count starts: now, and the last verdict.
    fn cpu_mark(&self) -> CpuMark {
        CpuMark {
            initiator: self.timed_cpu,
            target: target_cpu_ns(&self.last),
        }
    }

    /// CPU per GB since `mark` (up to the last verdict, for the target) for `bytes` moved.
    fn cpu_since(&self, mark: CpuMark, bytes: u64) -> CpuPerGb {
        let init = self
            .timed_cpu
            .zip(mark.initiator)
            .map(|(b, a)| b.saturating_sub(a));
        let tgt = target_cpu_ns(&self.last)
            .zip(mark.target)
            .map(|(b, a)| Duration::from_nanos(b.saturating_sub(a)));
        CpuPerGb {
            initiator: cpu::s_per_gb(init, bytes),
            target: cpu::s_per_gb(tgt, bytes),
        }
    }

    /// Submits one write batch without a notification and waits for it; returns the time
    /// from submit to completion (the timed section holds exactly these two calls).
    fn timed(&mut self, ops: &[Op], what: Phase) -> Result<Duration, BenchError> {
        self.counted(|b| {
            let t0 = Instant::now();
            let batch = b
                .engine
                .write(&b.peer, ops, None, Some(BATCH_DEADLINE))
                .ctx(|| format!("submitting a {what:?} batch"))?;
            batch
                .wait()
                .ctx(|| format!("waiting for a {what:?} batch"))?;
            Ok(t0.elapsed())
        })
    }

    /// Adds the ranges of a completed untagged write batch (and the CRC-32 of their bytes,
    /// in order) to the record; sends the record first if it is of another phase or full.
    fn note(
        &mut self,
        phase: Phase,
        ranges: &[Range],
        crc: &crc32fast::Hasher,
    ) -> Result<(), BenchError> {
        if !self.record.ranges.is_empty()
            && (self.record.phase != phase
                || self.record.ranges.len() + ranges.len() > MAX_TAG_RANGES)
        {
            self.send_record()?;
        }
        self.record.phase = phase;
        self.record.ranges.extend_from_slice(ranges);
        self.record.crc.combine(crc);
        Ok(())
    }

    /// Untimed: sends the record of the untagged writes as the tag of a batch with no writes.
    fn send_record(&mut self) -> Result<(), BenchError> {
        if self.record.ranges.is_empty() {
            return Ok(());
        }
        let rec = std::mem::take(&mut self.record);
        let tag = Tag {
            run: self.run,
            phase: rec.phase,
            seq: self.next_seq(),
            flush_total: 0,
            crc: rec.crc.finalize(),
            ranges: rec.ranges,
        };
        self.send(&[], tag, false)?;
        Ok(())
    }

    /// Asks the target to check every tag sent so far (the pending record first) and
    /// returns its verdict.
    fn flush(&mut self) -> Result<Verdict, BenchError> {
        self.send_record()?;
        let seq = self.next_seq();
        let tag = Tag {
            run: self.run,
            phase: Phase::Flush,
            seq,
            flush_total: 0,
            crc: 0,
            ranges: Vec::new(),
        };
        let op = Op {
            local: self.ctrl_local,
            local_offset: FLUSH_OFFSET,
            remote: self.r_ctrl,
            remote_offset: FLUSH_OFFSET,
            len: 8,
        };
        self.send(&[op], tag, true)?;
        self.wait_verdict()
    }

    /// Reads the target's verdict until it covers every tag sent.
    fn wait_verdict(&mut self) -> Result<Verdict, BenchError> {
        let t0 = Instant::now();
        let mut buf = [0u8; VERDICT_LEN];
        let op = Op {
            local: self.ctrl_local,
            local_offset: 0,
            remote: self.r_ctrl,
            remote_offset: 0,
            len: VERDICT_LEN as u64,
        };
        let mut pause = Duration::from_micros(200);
        loop {
            self.engine
                .read(&self.peer, std::slice::from_ref(&op), Some(BATCH_DEADLINE))
                .ctx(|| "reading the target's verdict".to_string())?
                .wait()
                .ctx(|| "reading the target's verdict".to_string())?;
            self.engine
                .local_read(self.ctrl_local, 0, &mut buf)
                .ctx(|| "copying the verdict".to_string())?;
            match Verdict::decode(&buf) {
                Ok(v) if v.run == self.run && v.verified_tags >= self.tags_sent => {
                    debug!(?v, "verdict");
                    return Ok(v);
                }
                Ok(v) if v.run == self.run && v.tags_seen > self.tags_sent => {
                    return Err(BenchError::Target(format!(
                        "the target saw {} notifications but {} were sent",
                        v.tags_seen, self.tags_sent
                    )));
                }
                // not yet covered, another run's, not written yet, or torn: read again
                Ok(_) | Err(WireError::Torn) | Err(WireError::BadMagic) => {}
                Err(e) => return Err(BenchError::Target(format!("bad verdict record: {e}"))),
            }
            if t0.elapsed() > VERDICT_TIMEOUT {
                return Err(BenchError::Timeout(format!(
                    "the target's verdict on {} notifications",
                    self.tags_sent
                )));
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(5));
        }
    }

    /// Verdict after a phase: true when the phase added no mismatch and no bad tag.
    fn phase_ok(&mut self, v: Verdict) -> bool {
        let ok = v.mismatches == self.last.mismatches
            && v.bad_tags == self.last.bad_tags
            && v.verified_tags == self.tags_sent;
        self.last = v;
        ok
    }

    /// Untimed: writes the whole remote data region once (each write verified like the
    /// measured ones), so that no timed operation pays for first-touch page faults on
    /// either side, as the peer benches fault their buffers in before timing.
    fn warmup(&mut self) -> Result<(), BenchError> {
        self.bar.set_message("warm-up");
        let chunk = (8u64 << 20)
            .min(self.r_data_len)
            .min(self.plan.data_region_len())
            & !7;
        let seq = self.next_seq();
        let full_crc = self.stage(Phase::Warmup, seq, 0, 0, chunk)?.finalize();
        let mut off = 0;
        while off < self.r_data_len {
            let len = chunk.min(self.r_data_len - off);
            let crc = if len == chunk {
                full_crc
            } else {
                let mut h = crc32fast::Hasher::new();
                crc_region(&self.engine, self.src, 0, len, &mut h, &mut self.buf)
                    .ctx(|| "checksumming the warm-up data".to_string())?;
                h.finalize()
            };
            let tag = Tag {
                run: self.run,
                phase: Phase::Warmup,
                seq: self.next_seq(),
                flush_total: 0,
                crc,
                ranges: vec![Range { offset: off, len }],
            };
            let op = self.op(0, off, len);
            self.send(&[op], tag, false)?;
            off += len;
        }
        let v = self.flush()?;
        if !self.phase_ok(v) {
            return Err(BenchError::Target(
                "the warm-up writes did not verify on the target".into(),
            ));
        }
        self.bar.inc(1);
        Ok(())
    }

    /// Serial writes of `size`, one in flight. Returns the row and, for the first slots of
    /// the destination, the CRC of what the last write there put in (for the read-back).
    fn serial(&mut self, size: u64) -> Result<(Row, Vec<Option<u32>>), BenchError> {
        let p = self.plan;
        let dst_slots = (self.r_data_len / size).clamp(1, (DST_WINDOW / size).max(8));
        let src_slots = (p.data_region_len() / size).clamp(1, 8);
        let max_ops = (p.max_ops as u64).min((p.max_bytes / size).max(5));
        let mut expected = vec![None; (p.read_max_ops as u64).min(dst_slots) as usize];
        let mut lat = Samples::new();
        let mark = self.cpu_mark();
        let t_phase = Instant::now();
        for i in 0..max_ops {
            if t_phase.elapsed().as_secs_f64() > p.max_secs && !lat.is_empty() {
                break;
            }
            if i > 0 && i % dst_slots == 0 {
                self.flush()?; // check before reusing destination bytes
            }
            let (slot, sslot) = (i % dst_slots, i % src_slots);
            let seq = self.next_seq();
            let h = self.stage(Phase::Serial, seq, 0, sslot * size, size)?;
            if let Some(e) = expected.get_mut(slot as usize) {
                *e = Some(h.clone().finalize());
            }
            let op = self.op(sslot * size, slot * size, size);
            lat.push(self.timed(&[op], Phase::Serial)?);
            let range = Range {
                offset: slot * size,
                len: size,
            };
            self.note(Phase::Serial, &[range], &h)?;
        }
        let v = self.flush()?;
        let verified = self.phase_ok(v);
        let (p50, p99) = lat.p50_p99_us();
        let ops = lat.len() as u64;
        Ok((
            Row {
                pattern: Pattern::Serial,
                size,
                ops,
                p50_us: p50,
                p99_us: p99,
                gbps: gbps(ops * size, lat.total()),
                verified,
                batch: None,
                batches: None,
                kv: None,
                timed_notifications: 0,
                cpu_s_per_gb: self.cpu_since(mark, ops * size),
                slice_sizes: self.peer.slice_sizes(),
            },
            expected,
        ))
    }

    /// Reads back what the serial phase left in its destination slots (cycling through them
    /// up to `read_max_ops` reads) and compares every byte (by CRC) with what was written.
    fn read_back(&mut self, size: u64, expected: &[Option<u32>]) -> Result<Row, BenchError> {
        let p = self.plan;
        let mut lat = Samples::new();
        let mut bad = 0u64;
        let mark = self.cpu_mark();
        let t_phase = Instant::now();
        let written: Vec<(usize, u32)> = expected
            .iter()
            .enumerate()
            .filter_map(|(slot, w)| w.map(|w| (slot, w)))
            .collect();
        for &(slot, want) in written.iter().cycle().take(p.read_max_ops) {
            if t_phase.elapsed().as_secs_f64() > p.read_max_secs && !lat.is_empty() {
                break;
            }
            let op = Op {
                local: self.scratch,
                local_offset: 0,
                remote: self.r_data,
                remote_offset: slot as u64 * size,
                len: size,
            };
            lat.push(self.counted(|b| {
                let t0 = Instant::now();
                b.engine
                    .read(&b.peer, std::slice::from_ref(&op), Some(BATCH_DEADLINE))
                    .ctx(|| format!("submitting a {size} byte read"))?
                    .wait()
                    .ctx(|| format!("waiting for a {size} byte read"))?;
                Ok(t0.elapsed())
            })?);
            let mut h = crc32fast::Hasher::new();
            crc_region(&self.engine, self.scratch, 0, size, &mut h, &mut self.buf)
                .ctx(|| "checking read-back bytes".to_string())?;
            self.read_checked += size;
            if h.finalize() != want {
                bad += 1;
                tracing::error!(slot, size, "read-back mismatch");
            }
        }
        self.read_mismatches += bad;
        // A verdict closes the row: the target's CPU for these reads ends there.
        let v = self.flush()?;
        let target_ok = self.phase_ok(v);
        let (p50, p99) = lat.p50_p99_us();
        let ops = lat.len() as u64;
        Ok(Row {
            pattern: Pattern::Read,
            size,
            ops,
            p50_us: p50,
            p99_us: p99,
            gbps: gbps(ops * size, lat.total()),
            verified: bad == 0 && ops > 0 && target_ok,
            batch: None,
            batches: None,
            kv: None,
            timed_notifications: 0,
            cpu_s_per_gb: self.cpu_since(mark, ops * size),
            slice_sizes: self.peer.slice_sizes(),
        })
    }

    /// Batches of `plan.batch` writes of `size`, one batch in flight.
    fn batch(&mut self, size: u64) -> Result<Row, BenchError> {
        let p = self.plan;
        let n = p.batch as u64;
        let batch_slots = (self.r_data_len / (size * n)).min((DST_WINDOW / (size * n)).max(2));
        if batch_slots == 0 {
            return Err(BenchError::Plan(format!(
                "a batch of {n} x {size} bytes does not fit the target's {} byte region",
                self.r_data_len
            )));
        }
        let max_batches = (p.max_ops as u64 / n)
            .max(2)
            .min((p.max_bytes / (size * n)).max(2));
        let mut lat = Samples::new();
        let mark = self.cpu_mark();
        let t_phase = Instant::now();
        for k in 0..max_batches {
            if t_phase.elapsed().as_secs_f64() > p.max_secs && !lat.is_empty() {
                break;
            }
            if k > 0 && k % batch_slots == 0 {
                self.flush()?; // check before reusing destination bytes
            }
            let base = (k % batch_slots) * n * size;
            let seq = self.next_seq();
            let mut crc = crc32fast::Hasher::new();
            let mut ops = Vec::with_capacity(n as usize);
            let mut ranges = Vec::with_capacity(n as usize);
            for j in 0..n {
                let h = self.stage(Phase::Batch, seq, j as u32, j * size, size)?;
                crc.combine(&h);
                ops.push(self.op(j * size, base + j * size, size));
                ranges.push(Range {
                    offset: base + j * size,
                    len: size,
                });
            }
            lat.push(self.timed(&ops, Phase::Batch)?);
            self.note(Phase::Batch, &ranges, &crc)?;
        }
        let v = self.flush()?;
        let verified = self.phase_ok(v);
        let (p50, p99) = lat.p50_p99_us();
        let batches = lat.len() as u64;
        Ok(Row {
            pattern: Pattern::Batch,
            size,
            ops: batches * n,
            p50_us: p50,
            p99_us: p99,
            gbps: gbps(batches * n * size, lat.total()),
            verified,
            batch: Some(p.batch),
            batches: Some(batches),
            kv: None,
            timed_notifications: 0,
            cpu_s_per_gb: self.cpu_since(mark, batches * n * size),
            slice_sizes: self.peer.slice_sizes(),
        })
    }

    /// The KV-layer pattern: per layer, `kv_blocks` writes of `kv_block_size` as one batch,
    /// waited before the next layer; one untimed warm-up round, then timed rounds. The
    /// last round is read back and compared.
    fn kv(&mut self) -> Result<Row, BenchError> {
        let p = self.plan;
        let (layers, blocks, bs) = (p.kv_layers, p.kv_blocks as u64, p.kv_block_size);
        let layer_bytes = p.kv_layer_bytes();
        let remote_slot = |j: u64| if p.kv_scatter { blocks - 1 - j } else { j };
        let mut lat = Samples::new();
        let mut round_walls: Vec<Duration> = Vec::new();
        let mut expected = vec![0u32; layers * blocks as usize];
        let mut verified = true;
        let mut mark = None;
        let t_phase = Instant::now();
        for round in 0..=p.kv_rounds {
            if round > 0 && t_phase.elapsed().as_secs_f64() > p.kv_max_secs {
                break;
            }
            self.bar.set_message(if round == 0 {
                "kv warm-up".to_string()
            } else {
                format!("kv round {round}/{}", p.kv_rounds)
            });
            // prepare every layer's data, ops and tag before the round starts
            let mut prepared = Vec::with_capacity(layers);
            for l in 0..layers {
                let seq = self.next_seq();
                let base = l as u64 * layer_bytes;
                let mut crc = crc32fast::Hasher::new();
                let mut ops = Vec::with_capacity(blocks as usize);
                let mut ranges = Vec::with_capacity(blocks as usize);
                for j in 0..blocks {
                    let h = self.stage(Phase::KvLayer, seq, j as u32, base + j * bs, bs)?;
                    expected[l * blocks as usize + j as usize] = h.clone().finalize();
                    crc.combine(&h);
                    let roff = base + remote_slot(j) * bs;
                    ops.push(self.op(base + j * bs, roff, bs));
                    ranges.push(Range {
                        offset: roff,
                        len: bs,
                    });
                }
                let tag = Tag {
                    run: self.run,
                    phase: Phase::KvLayer,
                    seq,
                    flush_total: 0,
                    crc: crc.finalize(),
                    ranges,
                };
                prepared.push((ops, tag));
            }
            let t_round = Instant::now();
            for (l, (ops, tag)) in prepared.into_iter().enumerate() {
                let last = l + 1 == layers;
                if round > 0 {
                    lat.push(self.counted(|b| b.send(&ops, tag, last))?);
                } else {
                    self.send(&ops, tag, last)?;
                }
            }
            let wall = t_round.elapsed();
            if round > 0 {
                round_walls.push(wall);
            }
            let v = self.wait_verdict()?;
            verified &= self.phase_ok(v);
            if round == 0 {
                mark = Some(self.cpu_mark()); // the timed rounds' CPU starts here
            }
            self.bar.inc(1);
        }
        let cpu = mark.map_or_else(CpuPerGb::default, |m| {
            self.cpu_since(m, round_walls.len() as u64 * p.kv_round_bytes())
        });
        // read back the last round, one batch per layer, and compare every block
        self.bar.set_message("kv read-back");
        let mut bad = 0u64;
        for l in 0..layers {
            let base = l as u64 * layer_bytes;
            let ops: Vec<Op> = (0..blocks)
                .map(|j| Op {
                    local: self.scratch,
                    local_offset: j * bs,
                    remote: self.r_data,
                    remote_offset: base + remote_slot(j) * bs,
                    len: bs,
                })
                .collect();
            self.engine
                .read(&self.peer, &ops, Some(BATCH_DEADLINE))
                .ctx(|| format!("submitting the read-back of KV layer {l}"))?
                .wait()
                .ctx(|| format!("waiting for the read-back of KV layer {l}"))?;
            for j in 0..blocks {
                let mut h = crc32fast::Hasher::new();
                crc_region(
                    &self.engine,
                    self.scratch,
                    j * bs,
                    bs,
                    &mut h,
                    &mut self.buf,
                )
                .ctx(|| "checking KV read-back bytes".to_string())?;
                self.read_checked += bs;
                if h.finalize() != expected[l * blocks as usize + j as usize] {
                    bad += 1;
                    tracing::error!(layer = l, block = j, "KV read-back mismatch");
                }
            }
        }
        self.read_mismatches += bad;
        self.bar.inc(1);
        let rounds = round_walls.len();
        let mut per_round: Vec<f64> = round_walls
            .iter()
            .map(|w| gbps(p.kv_round_bytes(), *w))
            .collect();
        per_round.sort_by(f64::total_cmp);
        let median = per_round.get(rounds / 2).copied().unwrap_or(0.0);
        let best = per_round.last().copied().unwrap_or(0.0);
        let total: Duration = round_walls.iter().sum();
        let (p50, p99) = lat.p50_p99_us();
        Ok(Row {
            pattern: Pattern::KvLayer,
            size: bs,
            ops: rounds as u64 * layers as u64 * blocks,
            p50_us: p50,
            p99_us: p99,
            gbps: gbps(rounds as u64 * p.kv_round_bytes(), total),
            verified: verified && bad == 0 && rounds > 0,
            batch: None,
            batches: None,
            // one per layer of every timed round, inside the timed section
            timed_notifications: lat.len() as u64,
            cpu_s_per_gb: cpu,
            slice_sizes: self.peer.slice_sizes(),
            kv: Some(KvShape {
                layers,
                blocks: blocks as usize,
                rounds,
                gbps_median_round: median,
                gbps_best_round: best,
                scatter: p.kv_scatter,
            }),
        })
    }
}
