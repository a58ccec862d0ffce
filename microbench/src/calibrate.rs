//! Fits the router cost model ([`crate::costmodel`]) from timeline records and measures its
//! error on records it was not fitted on.
//!
//! Input: JSON lines, one record per request, as written by the connector core
//! (`kvwire_connector::timeline::TimelineRecord::to_json_line`: the clock bench, the simulator,
//! the vLLM connector's logs) or by anything else with the same field names. Per line the fit
//! needs `decode_sent` and `first_token` (nanoseconds), `bytes` and `layers`; the request id is
//! `req` (a number or a string; `request_id` and `id` are accepted too). The D-side load at
//! `decode_sent`, `dst_waiting` and `dst_running`, is optional: the connector's timeline does
//! not carry it (the host knows its scheduler's queues, the core does not), so a record without
//! it counts as an idle destination and the load terms are only fitted where the records carry
//! varying load (see [`Calibration::notes`]). The same holds for the source side: what a router
//! knows of the prefill engine at `decode_sent` (`prefill_tokens`, the request's own tokens P
//! still computes — or `tokens − cached_tokens` when only those are given —, `src_waiting`,
//! `src_queued_tokens`, `src_running_tokens`, `src_pending_bytes`, see [`crate::costmodel::Inputs`]); absent fields
//! count as 0. `send_mode`, `policy` and `scenario` are read when present, to report the
//! held-out error per group ([`Calibration::groups`]).
//!
//! Lines that are not JSON, or whose fields have the wrong type, or that lack `bytes`/`layers`,
//! or whose clock runs backwards, are malformed: [`BadLines::Fail`] stops at the first with its
//! line number, [`BadLines::Skip`] keeps them in [`Timeline::bad_lines`]. Well-formed records
//! that cannot be used (failed requests, P-side records without `decode_sent`/`first_token`, a
//! zero clock, exact duplicates) are counted, not errors.
//!
//! Fitting:
//!
//! 1. **Split**: a record goes to the training part when a hash of its request id (FNV-1a 64,
//!    then a splitmix64 finaliser) modulo 100 is below 80, to the held-out part otherwise. The
//!    split depends only on the id: deterministic, and both records of one request fall on the
//!    same side.
//! 2. **Mean terms**: non-negative least squares of the clock in seconds (Lawson–Hanson on the
//!    normal equations, columns scaled to unit RMS): the conditional mean. The noise of the
//!    clock grows with the clock, so the fit is reweighted by `1 / pred²` with `pred` from the
//!    previous round (feasible weighted least squares, a fixed number of rounds).
//! 3. **p50 terms** (the headline, [`Calibration::p50`] and the file's `error` block): the
//!    held-out error is measured as `|pred − actual| / actual`, so the p50 terms minimise that
//!    on the training records: the mean relative error `Σ |pred − actual| / actual`, i.e. the
//!    check loss at 0.5 with each record weighted by `1 / actual`, non-negative, solved by
//!    iteratively reweighted NNLS started from the mean terms (a bounded number of iterations,
//!    deterministic). An unweighted fit of absolute seconds lets the longest clocks decide the
//!    terms; this one counts a 30% miss on a 50 ms clock as much as on a 5 s clock. It is a
//!    `1/actual`-weighted median, which sits at or a little below the plain median of the
//!    clock: the table prints the fraction of held-out clocks at or below it
//!    ([`Calibration::p50_coverage`]; 47.8% on a `kvwire-bench clock --seed 2` timeline).
//! 4. **p90 terms**: non-negative linear quantile regression of the clock (check loss at 0.9,
//!    each record weighted by `1 / pred_mean`), solved the same way from the mean terms: the
//!    conditional 90th percentile, so a router can read `p90` as "9 requests in 10 beat this".
//!
//!    Here the weights depend on the inputs only, never on the observed clock, on purpose:
//!    weighting by `1/actual` makes the fitted quantile a weighted one, which sits far below
//!    the real one whenever the records vary for reasons the inputs do not capture (measured on
//!    the connector simulator's timelines: such a p90 fit covered 62% of held-out clocks).
//! 5. **Error**: on the held-out part, the median and 90th percentile of
//!    `|pred_p50 − actual| / actual`, with the seed model `0.3 s + bytes / 2.7e9` measured on the
//!    same records, and the fractions of held-out clocks at or below the p50 and p90
//!    predictions; per scenario, send mode and policy when the records carry several
//!    ([`Calibration::groups`]).
//! 6. **Per send mode**: when the records mix send modes and none was chosen
//!    ([`CalibrateOptions::send_mode`], `--send-mode`), a model is also fitted on each mode's
//!    records alone and measured on that mode's held-out part ([`Calibration::per_send_mode`]):
//!    a deployment runs one mode, and whole and layerwise sends expose the transfer so
//!    differently that one linear model for both carries the difference as error.
//!
//! A term whose feature is constant over the training part (every record with the same layer
//! count, no load fields) cannot be told apart from `fixed_s`: it is set to zero and a note says
//! so.

use std::collections::HashSet;
use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use serde::Deserialize;

use crate::costmodel::{
    seed_predict, CostModel, CostModelError, ErrorBlock, FittedOn, Inputs, Quantile, Quantiles,
    Terms, MAX_BYTES_PER_S, SCHEMA,
};

/// Percent of request-id hashes that go to the training part.
pub const TRAIN_PERCENT: u64 = 80;
/// Fewest training records a fit accepts.
pub const MIN_TRAIN: usize = 10;
/// Fewest held-out records a fit accepts.
pub const MIN_HELD_OUT: usize = 2;
/// Iterations of the reweighted quantile fit.
const QUANTILE_ITERS: usize = 200;
/// Rounds of reweighting in the mean fit.
const MEAN_ROUNDS: usize = 4;
/// Smallest prediction used as a weight, as a fraction of the mean clock.
const PRED_FLOOR: f64 = 1e-3;
/// Smallest |residual| the quantile reweighting divides by, as a fraction of the mean clock.
const QUANTILE_EPS: f64 = 1e-5;

/// What to do with a malformed line.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BadLines {
    /// Stop with [`CalibrateError::Line`].
    Fail,
    /// Keep going; the line is listed in [`Timeline::bad_lines`].
    Skip,
}

/// Why one line is malformed.
#[derive(Debug, thiserror::Error)]
pub enum LineError {
    /// Not JSON, or a field of the wrong type.
    #[error("not a timeline record: {0}")]
    Json(#[from] serde_json::Error),
    /// A field the fit needs is absent.
    #[error("missing field `{0}`")]
    Missing(&'static str),
    /// Values that cannot be a real request.
    #[error("{0}")]
    Invalid(String),
}

/// What stops a calibration.
#[derive(Debug, thiserror::Error)]
pub enum CalibrateError {
    /// Reading the timeline failed.
    #[error("timeline {path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// A malformed line (under [`BadLines::Fail`]).
    #[error("timeline line {line}: {error}")]
    Line {
        /// 1-based line number.
        line: usize,
        /// What is wrong with it.
        #[source]
        error: LineError,
    },
    /// Records of several transports and no choice made.
    #[error("records of several transports ({0}); pick one with --transport")]
    MixedTransports(String),
    /// Too few usable records on one side of the split.
    #[error("too few usable records: {train} for training (need {MIN_TRAIN}), {held_out} held out (need {MIN_HELD_OUT})")]
    TooFew {
        /// Training records.
        train: usize,
        /// Held-out records.
        held_out: usize,
    },
    /// The fitted model failed validation (should not happen; reported rather than written).
    #[error(transparent)]
    Model(#[from] CostModelError),
}

/// One usable request: its clock and the model's inputs.
#[derive(Clone, Debug, PartialEq)]
pub struct Sample {
    /// Request id as text (numbers in decimal).
    pub id: String,
    /// `first_token − decode_sent`, seconds (> 0).
    pub seconds: f64,
    /// KV bytes moved.
    pub bytes: u64,
    /// Layers.
    pub layers: u32,
    /// Requests waiting on D at `decode_sent` (0 when the record did not say).
    pub dst_waiting: u32,
    /// Requests running on D at `decode_sent` (0 when the record did not say).
    pub dst_running: u32,
    /// Whether the record carried `dst_waiting`/`dst_running`.
    pub has_load: bool,
    /// Tokens P still prefills after `decode_sent` (0 when the record did not say).
    pub prefill_tokens: u64,
    /// Requests queued on P ahead of this one (0 when the record did not say).
    pub src_waiting: u32,
    /// Their uncached tokens (0 when the record did not say).
    pub src_queued_tokens: u64,
    /// Uncached tokens of P's step in progress not computed yet (0 when the record did not
    /// say).
    pub src_running_tokens: u64,
    /// KV bytes P sends before this request's (0 when the record did not say).
    pub src_pending_bytes: u64,
    /// Whether the record carried any source-side field.
    pub has_src: bool,
    /// P's send mode, when the record says (`whole`, `layerwise`).
    pub send_mode: Option<String>,
    /// D's policy, when the record says.
    pub policy: Option<String>,
    /// The scenario (`pd`, `migration`), when the record says.
    pub scenario: Option<String>,
    /// Transport label.
    pub transport: String,
    /// The clock cut into [`SEGMENTS`] (seconds), when the record carries the milestones.
    pub segments: Option<[f64; 6]>,
    /// 1-based line in the input.
    pub line: usize,
}

/// Names of the segments of `decode_sent → first_token`, in order (the connector's
/// `Decomposition`): wait for P's prefill, late block ids, transfer not hidden behind prefill,
/// last byte → reported finished, reported → promoted, promoted → first token.
pub use kvwire_connector::SEGMENT_NAMES as SEGMENTS;

/// Cuts `[start, end]` at the milestones the way the connector's timeline does: each milestone
/// clamped into `[previous, end]`, a missing one equal to the previous, so the segments sum to
/// `end − start` exactly. `None` when the record carries none of the milestones.
fn segments_of(r: &RawRecord, start: u64, end: u64) -> Option<[f64; 6]> {
    let p_done = r.p_last_layer_ready;
    let flow = match (p_done, r.blocks_to_p) {
        (Some(a), Some(b)) => Some(a.max(b)),
        (a, b) => a.or(b),
    };
    let raw = [
        p_done,
        flow,
        r.last_byte,
        r.d_reported_finished,
        r.d_promoted,
    ];
    if raw.iter().all(Option::is_none) {
        return None;
    }
    let mut prev = start;
    let mut out = [0.0; 6];
    for (i, m) in raw.iter().enumerate() {
        let v = m.unwrap_or(prev).clamp(prev, end);
        out[i] = (v - prev) as f64 * 1e-9;
        prev = v;
    }
    out[5] = (end - prev) as f64 * 1e-9;
    Some(out)
}

/// A parsed timeline.
#[derive(Debug, Default)]
pub struct Timeline {
    /// Usable records, in file order.
    pub samples: Vec<Sample>,
    /// Malformed lines skipped under [`BadLines::Skip`]: (line, error).
    pub bad_lines: Vec<(usize, LineError)>,
    /// Records of failed requests.
    pub skipped_failed: usize,
    /// Records without `decode_sent` or `first_token` (P-side records, unfinished requests).
    pub skipped_incomplete: usize,
    /// Records whose clock is zero.
    pub skipped_zero: usize,
    /// Records identical in id and clock to an earlier one.
    pub skipped_duplicate: usize,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum RawId {
    Num(u64),
    Str(String),
}

#[derive(Deserialize)]
struct RawRecord {
    #[serde(alias = "request_id", alias = "id")]
    req: Option<RawId>,
    decode_sent: Option<u64>,
    first_token: Option<u64>,
    bytes: Option<u64>,
    layers: Option<u32>,
    dst_waiting: Option<u32>,
    dst_running: Option<u32>,
    tokens: Option<u64>,
    cached_tokens: Option<u64>,
    prefill_tokens: Option<u64>,
    src_waiting: Option<u32>,
    src_queued_tokens: Option<u64>,
    src_running_tokens: Option<u64>,
    src_pending_bytes: Option<u64>,
    send_mode: Option<String>,
    policy: Option<String>,
    scenario: Option<String>,
    transport: Option<String>,
    outcome: Option<String>,
    p_last_layer_ready: Option<u64>,
    blocks_to_p: Option<u64>,
    last_byte: Option<u64>,
    d_reported_finished: Option<u64>,
    d_promoted: Option<u64>,
}

enum Parsed {
    Use(Box<Sample>),
    Failed,
    Incomplete,
    Zero,
}

fn parse_line(text: &str, line: usize) -> Result<Parsed, LineError> {
    let mut r: RawRecord = serde_json::from_str(text)?;
    if r.outcome.as_deref() == Some("failed") {
        return Ok(Parsed::Failed);
    }
    let bytes = r.bytes.ok_or(LineError::Missing("bytes"))?;
    let layers = r.layers.ok_or(LineError::Missing("layers"))?;
    let id = match r.req.take() {
        Some(RawId::Num(n)) => n.to_string(),
        Some(RawId::Str(s)) => s,
        None => return Err(LineError::Missing("req")),
    };
    let (Some(start), Some(end)) = (r.decode_sent, r.first_token) else {
        return Ok(Parsed::Incomplete);
    };
    if end < start {
        return Err(LineError::Invalid(format!(
            "first_token {end} is before decode_sent {start}"
        )));
    }
    if end == start {
        return Ok(Parsed::Zero);
    }
    let prefill_tokens = r.prefill_tokens.or_else(|| {
        r.cached_tokens
            .map(|c| r.tokens.unwrap_or(0).saturating_sub(c))
    });
    let has_src = prefill_tokens.is_some()
        || r.src_waiting.is_some()
        || r.src_queued_tokens.is_some()
        || r.src_running_tokens.is_some()
        || r.src_pending_bytes.is_some();
    Ok(Parsed::Use(Box::new(Sample {
        id,
        prefill_tokens: prefill_tokens.unwrap_or(0),
        src_waiting: r.src_waiting.unwrap_or(0),
        src_queued_tokens: r.src_queued_tokens.unwrap_or(0),
        src_running_tokens: r.src_running_tokens.unwrap_or(0),
        src_pending_bytes: r.src_pending_bytes.unwrap_or(0),
        has_src,
        send_mode: r.send_mode.take(),
        policy: r.policy.take(),
        scenario: r.scenario.take(),
        seconds: (end - start) as f64 * 1e-9,
        bytes,
        layers,
        dst_waiting: r.dst_waiting.unwrap_or(0),
        dst_running: r.dst_running.unwrap_or(0),
        has_load: r.dst_waiting.is_some() || r.dst_running.is_some(),
        segments: segments_of(&r, start, end),
        transport: r.transport.unwrap_or_default(),
        line,
    })))
}

/// Parses timeline JSON lines from `reader` (blank lines are ignored).
pub fn parse_timeline<R: BufRead>(reader: R, bad: BadLines) -> Result<Timeline, CalibrateError> {
    parse_timeline_named(reader, bad, "<input>")
}

fn parse_timeline_named<R: BufRead>(
    reader: R,
    bad: BadLines,
    name: &str,
) -> Result<Timeline, CalibrateError> {
    let mut t = Timeline::default();
    let mut seen: HashSet<(String, u64)> = HashSet::new();
    for (i, line) in reader.lines().enumerate() {
        let n = i + 1;
        let text = line.map_err(|source| CalibrateError::Io {
            path: name.to_string(),
            source,
        })?;
        if text.trim().is_empty() {
            continue;
        }
        match parse_line(&text, n) {
            Ok(Parsed::Use(s)) => {
                if seen.insert((s.id.clone(), s.seconds.to_bits())) {
                    t.samples.push(*s);
                } else {
                    t.skipped_duplicate += 1;
                }
            }
            Ok(Parsed::Failed) => t.skipped_failed += 1,
            Ok(Parsed::Incomplete) => t.skipped_incomplete += 1,
            Ok(Parsed::Zero) => t.skipped_zero += 1,
            Err(error) => match bad {
                BadLines::Fail => return Err(CalibrateError::Line { line: n, error }),
                BadLines::Skip => t.bad_lines.push((n, error)),
            },
        }
    }
    Ok(t)
}

/// Reads a timeline file.
pub fn read_timeline(path: &Path, bad: BadLines) -> Result<Timeline, CalibrateError> {
    let f = std::fs::File::open(path).map_err(|source| CalibrateError::Io {
        path: path.display().to_string(),
        source,
    })?;
    parse_timeline_named(std::io::BufReader::new(f), bad, &path.display().to_string())
}

/// Whether a request id belongs to the training part (see the module docs).
pub fn is_train(id: &str) -> bool {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in id.as_bytes() {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    // splitmix64 finaliser: spreads consecutive ids evenly.
    h ^= h >> 30;
    h = h.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h ^= h >> 27;
    h = h.wrapping_mul(0x94d0_49bb_1331_11eb);
    h ^= h >> 31;
    h % 100 < TRAIN_PERCENT
}

/// Splits samples into (training, held-out) by request id.
pub fn split(samples: &[Sample]) -> (Vec<Sample>, Vec<Sample>) {
    samples.iter().cloned().partition(|s| is_train(&s.id))
}

impl Sample {
    /// The model's inputs of this record.
    pub fn inputs(&self) -> Inputs {
        Inputs {
            bytes: self.bytes,
            layers: self.layers,
            dst_waiting: self.dst_waiting,
            dst_running: self.dst_running,
            prefill_tokens: self.prefill_tokens,
            src_waiting: self.src_waiting,
            src_queued_tokens: self.src_queued_tokens,
            src_running_tokens: self.src_running_tokens,
            src_pending_bytes: self.src_pending_bytes,
        }
    }
}

const NF: usize = 10;

/// Index of the first source-side feature.
const FIRST_SRC: usize = 5;

/// Start of the note given when no record carries a source-side field.
pub const NO_SOURCE_NOTE: &str = "no record carries prefill_tokens or src_* fields";

/// Names of the fitted terms in feature order.
const NAMES: [&str; NF] = [
    "fixed_s",
    "bytes_per_s",
    "per_layer_tail_s",
    "d_step_s",
    "d_queue_s_per_waiting",
    "prefill_s_per_token",
    "src_s_per_queued_token",
    "src_s_per_running_token",
    "src_s_per_waiting",
    "src_s_per_pending_byte",
];

/// The input each term multiplies, in feature order.
const WHAT: [&str; NF] = [
    "",
    "bytes",
    "layers",
    "dst_running",
    "dst_waiting",
    "prefill_tokens",
    "src_queued_tokens",
    "src_running_tokens",
    "src_waiting",
    "src_pending_bytes",
];

fn features(s: &Sample) -> [f64; NF] {
    [
        1.0,
        s.bytes as f64,
        f64::from(s.layers),
        1.0 + f64::from(s.dst_running),
        f64::from(s.dst_waiting),
        s.prefill_tokens as f64,
        s.src_queued_tokens as f64,
        s.src_running_tokens as f64,
        f64::from(s.src_waiting),
        s.src_pending_bytes as f64,
    ]
}

/// Solves `G x = h` restricted to the indices in `idx` (Gaussian elimination with partial
/// pivoting); `None` when the restricted system is (numerically) singular.
fn solve_sub(g: &[[f64; NF]; NF], h: &[f64; NF], idx: &[usize]) -> Option<[f64; NF]> {
    let k = idx.len();
    let mut a = vec![vec![0.0; k + 1]; k];
    let mut scale: f64 = 0.0;
    for (r, &i) in idx.iter().enumerate() {
        for (c, &j) in idx.iter().enumerate() {
            a[r][c] = g[i][j];
        }
        a[r][k] = h[i];
        scale = scale.max(g[i][i].abs());
    }
    for col in 0..k {
        let piv = (col..k).max_by(|&x, &y| a[x][col].abs().total_cmp(&a[y][col].abs()))?;
        if a[piv][col].abs() <= 1e-12 * scale.max(f64::MIN_POSITIVE) {
            return None;
        }
        a.swap(col, piv);
        let (upper, lower) = a.split_at_mut(col + 1);
        let pivot_row = &upper[col];
        for row in lower.iter_mut() {
            let f = row[col] / pivot_row[col];
            for (v, p) in row.iter_mut().zip(pivot_row).skip(col) {
                *v -= f * p;
            }
        }
    }
    let mut x = [0.0; NF];
    for r in (0..k).rev() {
        let mut v = a[r][k];
        for c in r + 1..k {
            v -= a[r][c] * x[idx[c]];
        }
        x[idx[r]] = v / a[r][r];
    }
    Some(x)
}

/// Non-negative least squares `min ‖A x − b‖, x ≥ 0` from the normal equations `G = AᵀA`,
/// `h = Aᵀb` (Lawson–Hanson active set). Variables with `allowed[j] == false` stay zero.
fn nnls(g: &[[f64; NF]; NF], h: &[f64; NF], allowed: &[bool; NF]) -> [f64; NF] {
    let mut x = [0.0; NF];
    let mut passive = [false; NF];
    let mut banned = [false; NF];
    let tol = 1e-12 * h.iter().fold(0.0f64, |m, v| m.max(v.abs())).max(1e-300);
    for _outer in 0..(3 * NF + 10) {
        let mut w = [0.0; NF];
        for j in 0..NF {
            w[j] = h[j] - (0..NF).map(|k| g[j][k] * x[k]).sum::<f64>();
        }
        let cand = (0..NF)
            .filter(|&j| allowed[j] && !passive[j] && !banned[j] && w[j] > tol)
            .max_by(|&a, &b| w[a].total_cmp(&w[b]));
        let Some(t) = cand else { break };
        passive[t] = true;
        for _inner in 0..(3 * NF + 10) {
            let idx: Vec<usize> = (0..NF).filter(|&j| passive[j]).collect();
            let Some(z) = solve_sub(g, h, &idx) else {
                // The new column is collinear with the passive ones: it adds nothing.
                passive[t] = false;
                banned[t] = true;
                break;
            };
            if idx.iter().all(|&j| z[j] > 0.0) {
                x = z;
                break;
            }
            let mut alpha = f64::INFINITY;
            for &j in &idx {
                if z[j] <= 0.0 {
                    let d = x[j] - z[j];
                    if d > 0.0 {
                        alpha = alpha.min(x[j] / d);
                    } else {
                        alpha = 0.0;
                    }
                }
            }
            if !alpha.is_finite() {
                alpha = 0.0;
            }
            for &j in &idx {
                x[j] += alpha * (z[j] - x[j]);
                if x[j] <= 1e-15 * (1.0 + z[j].abs()) && z[j] <= 0.0 {
                    x[j] = 0.0;
                    passive[j] = false;
                }
            }
            if !passive[t] {
                break;
            }
        }
    }
    for v in x.iter_mut() {
        if !v.is_finite() || *v < 0.0 {
            *v = 0.0;
        }
    }
    x
}

/// The design: row `i` is `features_i` scaled per column to unit RMS, target the clock in
/// seconds.
struct Design {
    rows: Vec<[f64; NF]>,
    targets: Vec<f64>,
    col_scale: [f64; NF],
    allowed: [bool; NF],
    /// Smallest |residual| (seconds) the quantile reweighting divides by.
    eps: f64,
}

impl Design {
    fn new(train: &[Sample]) -> Design {
        let mut rows: Vec<[f64; NF]> = train.iter().map(features).collect();
        let targets: Vec<f64> = train.iter().map(|s| s.seconds).collect();
        let mean_target = targets.iter().sum::<f64>() / targets.len().max(1) as f64;
        let mut allowed = [true; NF];
        // A feature constant over the training part is collinear with the intercept.
        for (j, a) in allowed.iter_mut().enumerate().skip(1) {
            let first = train.first().map(|s| features(s)[j]);
            *a = train.iter().any(|s| Some(features(s)[j]) != first);
        }
        let mut col_scale = [1.0; NF];
        for j in 0..NF {
            let ms = rows.iter().map(|r| r[j] * r[j]).sum::<f64>() / rows.len().max(1) as f64;
            let s = ms.sqrt();
            if s > 0.0 && s.is_finite() {
                col_scale[j] = s;
            } else {
                allowed[j] = false;
            }
        }
        for r in rows.iter_mut() {
            for j in 0..NF {
                r[j] /= col_scale[j];
            }
        }
        Design {
            rows,
            targets,
            col_scale,
            allowed,
            eps: QUANTILE_EPS * mean_target.max(f64::MIN_POSITIVE),
        }
    }

    fn solve_weighted(&self, w: &[f64]) -> [f64; NF] {
        let mut g = [[0.0; NF]; NF];
        let mut h = [0.0; NF];
        for ((r, &wi), &y) in self.rows.iter().zip(w).zip(&self.targets) {
            for a in 0..NF {
                h[a] += wi * r[a] * y;
                for b in 0..NF {
                    g[a][b] += wi * r[a] * r[b];
                }
            }
        }
        nnls(&g, &h, &self.allowed)
    }

    fn residuals(&self, x: &[f64; NF]) -> Vec<f64> {
        self.rows
            .iter()
            .zip(&self.targets)
            .map(|(r, y)| y - (0..NF).map(|j| r[j] * x[j]).sum::<f64>())
            .collect()
    }

    /// Predictions of the scaled coefficients `x` on the training rows, floored at a small
    /// positive time so they can be divided by.
    fn predictions(&self, x: &[f64; NF]) -> Vec<f64> {
        let floor = self.eps / QUANTILE_EPS * PRED_FLOOR;
        self.rows
            .iter()
            .map(|r| (0..NF).map(|j| r[j] * x[j]).sum::<f64>().max(floor))
            .collect()
    }

    /// Least squares weighted by `1 / pred²` (the noise grows with the clock), `pred` from the
    /// previous round, starting from the unweighted fit. The weights depend on the inputs only,
    /// never on the observed clock, so they do not bias the fit.
    fn mean_fit(&self) -> [f64; NF] {
        let mut x = self.solve_weighted(&vec![1.0; self.rows.len()]);
        for _ in 0..MEAN_ROUNDS {
            let w: Vec<f64> = self.predictions(&x).iter().map(|p| 1.0 / (p * p)).collect();
            x = self.solve_weighted(&w);
        }
        x
    }

    /// Check-loss fit of the `tau` quantile, each record weighted by `1 / pred_mean` (inputs
    /// only, as above), by iteratively reweighted NNLS started from the mean terms.
    fn quantile_fit(&self, tau: f64, mean: [f64; NF]) -> [f64; NF] {
        let base: Vec<f64> = self.predictions(&mean).iter().map(|p| 1.0 / p).collect();
        self.check_loss_fit(tau, &base, mean)
    }

    /// The p50 terms: minimum of the mean relative error `Σ |pred − actual| / actual` over the
    /// training records, i.e. the check loss at 0.5 with each record weighted by `1 / actual`
    /// (a median of the clock where short clocks count as much as long ones), by iteratively
    /// reweighted NNLS started from `start`.
    fn relative_l1_fit(&self, start: [f64; NF]) -> [f64; NF] {
        let base: Vec<f64> = self.targets.iter().map(|y| 1.0 / y).collect();
        self.check_loss_fit(0.5, &base, start)
    }

    /// Minimises `Σ base_i · ρ_tau(actual_i − pred_i)` (ρ the check loss) over non-negative
    /// terms by iteratively reweighted NNLS from `start` (a bounded number of iterations).
    fn check_loss_fit(&self, tau: f64, base: &[f64], start: [f64; NF]) -> [f64; NF] {
        let mut x = start;
        for _ in 0..QUANTILE_ITERS {
            let w: Vec<f64> = self
                .residuals(&x)
                .iter()
                .zip(base)
                .map(|(&r, &b)| {
                    b * (if r >= 0.0 { tau } else { 1.0 - tau }) / r.abs().max(self.eps)
                })
                .collect();
            let nx = self.solve_weighted(&w);
            let change = (0..NF)
                .map(|j| (nx[j] - x[j]).abs() / (x[j].abs() + 1e-12))
                .fold(0.0f64, f64::max);
            x = nx;
            if change < 1e-12 {
                break;
            }
        }
        x
    }

    fn terms(&self, x: &[f64; NF]) -> Terms {
        let b: [f64; NF] = std::array::from_fn(|j| x[j] / self.col_scale[j]);
        Terms {
            fixed_s: b[0],
            bytes_per_s: if b[1] > 1.0 / MAX_BYTES_PER_S {
                1.0 / b[1]
            } else {
                MAX_BYTES_PER_S
            },
            per_layer_tail_s: b[2],
            d_step_s: b[3],
            d_queue_s_per_waiting: b[4],
            prefill_s_per_token: b[5],
            src_s_per_queued_token: b[6],
            src_s_per_running_token: b[7],
            src_s_per_waiting: b[8],
            src_s_per_pending_byte: b[9],
        }
    }
}

/// `q`-quantile (0..=1) of `v` by linear interpolation between order statistics; NaN if empty.
pub fn quantile(v: &[f64], q: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let pos = q.clamp(0.0, 1.0) * (s.len() - 1) as f64;
    let lo = pos.floor() as usize;
    let hi = pos.ceil() as usize;
    s[lo] + (s[hi] - s[lo]) * (pos - lo as f64)
}

/// Relative errors of a predictor on samples: (median, p90) of `|pred − actual| / actual`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RelError {
    /// Median relative error.
    pub p50: f64,
    /// 90th-percentile relative error.
    pub p90: f64,
    /// Median of `pred / actual` (below 1: the predictor is optimistic).
    pub median_ratio: f64,
}

/// Relative error of `pred` on `samples`.
pub fn rel_error(samples: &[Sample], pred: impl Fn(&Sample) -> f64) -> RelError {
    let rel: Vec<f64> = samples
        .iter()
        .map(|s| (pred(s) - s.seconds).abs() / s.seconds)
        .collect();
    let ratio: Vec<f64> = samples.iter().map(|s| pred(s) / s.seconds).collect();
    RelError {
        p50: quantile(&rel, 0.5),
        p90: quantile(&rel, 0.9),
        median_ratio: quantile(&ratio, 0.5),
    }
}

/// The outcome of a calibration.
#[derive(Clone, Debug)]
pub struct Calibration {
    /// The fitted model (error block from the held-out part).
    pub model: CostModel,
    /// Request ids used for fitting.
    pub train_ids: Vec<String>,
    /// Request ids the error was measured on.
    pub held_out_ids: Vec<String>,
    /// Held-out error of the p50 model (the headline: the error block of the file).
    pub p50: RelError,
    /// Held-out error of the mean (least-squares) model.
    pub mean: RelError,
    /// Held-out error of the seed model `0.3 s + bytes / 2.7e9`.
    pub seed: RelError,
    /// Training error of the p50 model (for comparison with the held-out one).
    pub p50_train: RelError,
    /// Fraction of held-out clocks ≤ the p50 prediction (near 0.5 when the relative-error fit
    /// is also a median of the clock; see the module docs).
    pub p50_coverage: f64,
    /// Fraction of held-out clocks ≤ the p90 prediction.
    pub p90_coverage: f64,
    /// Things the reader should know (terms that could not be identified, missing load fields).
    pub notes: Vec<String>,
    /// Where the time went, over every usable record that carries the milestones (empty when
    /// none does).
    pub segments: Vec<SegmentStat>,
    /// Records the segment statistics cover.
    pub segment_records: usize,
    /// Held-out error per scenario, send mode and policy (where the records carry more than
    /// one value).
    pub groups: Vec<GroupError>,
    /// When the records mix send modes (and no mode was chosen): the calibration of each mode
    /// on its own records. A deployment runs one send mode, so this is the error its own
    /// model has.
    pub per_send_mode: Vec<(String, Calibration)>,
}

/// One segment of the clock over many records.
#[derive(Clone, Debug, PartialEq)]
pub struct SegmentStat {
    /// One of [`SEGMENTS`].
    pub name: &'static str,
    /// Median seconds.
    pub p50: f64,
    /// 90th-percentile seconds.
    pub p90: f64,
    /// Its share of the summed clocks (the segment means add up to the mean clock).
    pub share: f64,
}

/// Segment statistics of the samples that carry milestones.
pub fn segment_stats(samples: &[Sample]) -> (Vec<SegmentStat>, usize) {
    let segs: Vec<[f64; 6]> = samples.iter().filter_map(|s| s.segments).collect();
    if segs.is_empty() {
        return (Vec::new(), 0);
    }
    let total: f64 = segs.iter().flat_map(|s| s.iter()).sum();
    let stats = SEGMENTS
        .iter()
        .enumerate()
        .map(|(i, name)| {
            let v: Vec<f64> = segs.iter().map(|s| s[i]).collect();
            SegmentStat {
                name,
                p50: quantile(&v, 0.5),
                p90: quantile(&v, 0.9),
                share: if total > 0.0 {
                    v.iter().sum::<f64>() / total
                } else {
                    0.0
                },
            }
        })
        .collect();
    (stats, segs.len())
}

/// Options of [`calibrate`].
#[derive(Clone, Debug, Default)]
pub struct CalibrateOptions {
    /// Only records of this transport; `None`: all records must share one.
    pub transport: Option<String>,
    /// Only records of this send mode (`whole`, `layerwise`); `None`: all.
    pub send_mode: Option<String>,
    /// The `fitted_on.source` text.
    pub source: String,
}

/// Fits the model to `samples` (split by request id) and measures it on the held-out part.
pub fn calibrate(
    samples: &[Sample],
    opts: &CalibrateOptions,
) -> Result<Calibration, CalibrateError> {
    let chosen: Vec<Sample> = match &opts.transport {
        Some(t) => samples
            .iter()
            .filter(|s| &s.transport == t)
            .cloned()
            .collect(),
        None => samples.to_vec(),
    };
    let chosen: Vec<Sample> = match &opts.send_mode {
        Some(m) => chosen
            .into_iter()
            .filter(|s| s.send_mode.as_ref() == Some(m))
            .collect(),
        None => chosen,
    };
    let mut transports: Vec<String> = chosen.iter().map(|s| s.transport.clone()).collect();
    transports.sort();
    transports.dedup();
    if transports.len() > 1 {
        return Err(CalibrateError::MixedTransports(transports.join(", ")));
    }
    let transport = transports
        .pop()
        .or_else(|| opts.transport.clone())
        .unwrap_or_default();
    let (train, held) = split(&chosen);
    if train.len() < MIN_TRAIN || held.len() < MIN_HELD_OUT {
        return Err(CalibrateError::TooFew {
            train: train.len(),
            held_out: held.len(),
        });
    }
    let design = Design::new(&train);
    let mut notes = Vec::new();
    let any_src = chosen.iter().any(|s| s.has_src);
    for j in 1..NF {
        // Without any source-side field one note below says so for all of them.
        if !design.allowed[j] && (any_src || j < FIRST_SRC) {
            notes.push(format!(
                "{} is the same in every training record: {} not identifiable, left at its \
                 neutral value (folded into fixed_s)",
                WHAT[j], NAMES[j]
            ));
        }
    }
    let (segments, segment_records) = segment_stats(&chosen);
    let without_load = chosen.iter().filter(|s| !s.has_load).count();
    if without_load > 0 {
        notes.push(format!(
            "{without_load} of {} records carry no dst_waiting/dst_running: counted as an idle \
             destination (0 waiting, 0 running)",
            chosen.len()
        ));
    }
    let without_src = chosen.iter().filter(|s| !s.has_src).count();
    if !any_src {
        notes.push(format!(
            "{NO_SOURCE_NOTE}: prefill_s_per_token and the src_* terms are left at 0"
        ));
    } else if without_src > 0 {
        notes.push(format!(
            "{without_src} of {} records carry no prefill_tokens/src_* fields: counted as a \
             source with nothing left to compute",
            chosen.len()
        ));
    }
    let xm = design.mean_fit();
    let x50 = design.relative_l1_fit(xm);
    let x90 = design.quantile_fit(0.9, xm);
    let terms = design.terms(&xm);
    let p50t = design.terms(&x50);
    let p90t = design.terms(&x90);
    let pred = |t: Terms| move |s: &Sample| t.predict_inputs(&s.inputs());
    let p50 = rel_error(&held, pred(p50t));
    let mean = rel_error(&held, pred(terms));
    let seed = rel_error(&held, |s| seed_predict(s.bytes));
    let p50_train = rel_error(&train, pred(p50t));
    let coverage = |t: Terms| {
        let covered = held.iter().filter(|s| s.seconds <= pred(t)(s)).count();
        covered as f64 / held.len() as f64
    };
    let p50_coverage = coverage(p50t);
    let p90_coverage = coverage(p90t);
    let mut groups = Vec::new();
    type Key = fn(&Sample) -> Option<&String>;
    let keys: [(&str, Key); 3] = [
        ("scenario", |s| s.scenario.as_ref()),
        ("send_mode", |s| s.send_mode.as_ref()),
        ("policy", |s| s.policy.as_ref()),
    ];
    for (key, get) in keys {
        let mut values: Vec<&String> = held.iter().filter_map(get).collect();
        values.sort();
        values.dedup();
        if values.len() < 2 {
            continue;
        }
        for v in values {
            let part: Vec<Sample> = held.iter().filter(|s| get(s) == Some(v)).cloned().collect();
            groups.push(GroupError {
                group: format!("{key}={v}"),
                held_out: part.len(),
                p50: rel_error(&part, pred(p50t)),
                seed: rel_error(&part, |s| seed_predict(s.bytes)),
            });
        }
    }
    let model = CostModel {
        schema: SCHEMA.to_string(),
        transport,
        send_mode: opts.send_mode.clone(),
        fitted_on: FittedOn {
            records: train.len() as u64,
            source: opts.source.clone(),
        },
        terms,
        quantiles: Quantiles {
            p50: p50t,
            p90: p90t,
        },
        error: ErrorBlock {
            p50_rel: p50.p50,
            p90_rel: p50.p90,
            held_out: Some(held.len() as u64),
            p90_coverage: Some(p90_coverage),
        },
    };
    model.validate()?;
    Ok(Calibration {
        model,
        train_ids: train.iter().map(|s| s.id.clone()).collect(),
        held_out_ids: held.iter().map(|s| s.id.clone()).collect(),
        p50,
        mean,
        seed,
        p50_train,
        p50_coverage,
        p90_coverage,
        notes,
        segments,
        segment_records,
        groups,
        per_send_mode: if opts.send_mode.is_none() {
            per_send_mode(&chosen, opts)
        } else {
            Vec::new()
        },
    })
}

/// When the records mix send modes: a model fitted on each mode's records alone (same split),
/// with its held-out error. Modes with too few records are left out.
fn per_send_mode(chosen: &[Sample], opts: &CalibrateOptions) -> Vec<(String, Calibration)> {
    let mut modes: Vec<&String> = chosen.iter().filter_map(|s| s.send_mode.as_ref()).collect();
    modes.sort();
    modes.dedup();
    if modes.len() < 2 {
        return Vec::new();
    }
    modes
        .into_iter()
        .filter_map(|m| {
            let o = CalibrateOptions {
                send_mode: Some(m.clone()),
                ..opts.clone()
            };
            calibrate(chosen, &o).ok().map(|c| (m.clone(), c))
        })
        .collect()
}

/// Held-out error of the p50 model on one group of records (one send mode, policy or
/// scenario).
#[derive(Clone, Debug, PartialEq)]
pub struct GroupError {
    /// `key=value`, e.g. `send_mode=layerwise`.
    pub group: String,
    /// Held-out records in the group.
    pub held_out: usize,
    /// Error of the calibrated p50 model.
    pub p50: RelError,
    /// Error of the seed model on the same records.
    pub seed: RelError,
}

impl Calibration {
    /// The comparison table printed by `kvwire-bench calibrate`.
    pub fn table(&self) -> String {
        let m = &self.model;
        let mut s = String::new();
        s.push_str(&format!(
            "cost model fitted on {} records ({}), transport {:?}, error on {} held-out records\n\n",
            self.train_ids.len(),
            m.fitted_on.source,
            m.transport,
            self.held_out_ids.len()
        ));
        s.push_str(&format!(
            "{:<34} {:>12} {:>12} {:>14}\n",
            "model (held-out)", "p50 |rel|", "p90 |rel|", "median pred/act"
        ));
        let row = |name: &str, e: &RelError| {
            format!(
                "{:<34} {:>12.4} {:>12.4} {:>14.4}\n",
                name, e.p50, e.p90, e.median_ratio
            )
        };
        s.push_str(&row("seed 0.3 s + bytes / 2.7 GB/s", &self.seed));
        s.push_str(&row("calibrated p50 (min. mean |rel|)", &self.p50));
        s.push_str(&row("calibrated mean (least squares)", &self.mean));
        s.push_str(&row("calibrated p50, training records", &self.p50_train));
        s.push_str(&format!(
            "calibrated p50: {:.1}% of held-out clocks at or below the prediction\n",
            100.0 * self.p50_coverage
        ));
        s.push_str(&format!(
            "calibrated p90: {:.1}% of held-out clocks at or below the prediction\n",
            100.0 * self.p90_coverage
        ));
        s.push_str(
            "p50 terms minimise the mean of |pred - actual| / actual on the training records \
             (check loss at 0.5, each record weighted by 1/actual); p90 terms are a quantile \
             fit (check loss at 0.9, weights 1/pred_mean); mean terms: least squares \
             reweighted by 1/pred_mean^2\n\n",
        );
        if !self.groups.is_empty() {
            s.push_str(&format!(
                "{:<34} {:>8} {:>12} {:>12} {:>14} {:>14}\n",
                "held-out error per group",
                "records",
                "p50 |rel|",
                "p90 |rel|",
                "seed p50",
                "seed p90"
            ));
            for g in &self.groups {
                s.push_str(&format!(
                    "{:<34} {:>8} {:>12.4} {:>12.4} {:>14.4} {:>14.4}\n",
                    g.group, g.held_out, g.p50.p50, g.p50.p90, g.seed.p50, g.seed.p90
                ));
            }
            s.push('\n');
        }
        if !self.per_send_mode.is_empty() {
            s.push_str(&format!(
                "{:<34} {:>8} {:>12} {:>12} {:>14} {:>14} {:>9}\n",
                "fitted per send mode (held-out)",
                "records",
                "p50 |rel|",
                "p90 |rel|",
                "seed p50",
                "seed p90",
                "p90 cov"
            ));
            for (m, c) in &self.per_send_mode {
                s.push_str(&format!(
                    "{:<34} {:>8} {:>12.4} {:>12.4} {:>14.4} {:>14.4} {:>8.1}%\n",
                    format!("send_mode={m} (own model)"),
                    c.held_out_ids.len(),
                    c.p50.p50,
                    c.p50.p90,
                    c.seed.p50,
                    c.seed.p90,
                    100.0 * c.p90_coverage
                ));
            }
            s.push('\n');
        }
        s.push_str(&format!(
            "{:<6} {:>12} {:>14} {:>16} {:>12} {:>22}\n",
            "terms",
            "fixed_s",
            "bytes_per_s",
            "per_layer_tail_s",
            "d_step_s",
            "d_queue_s_per_waiting"
        ));
        for (n, t) in [
            ("mean", &m.terms),
            ("p50", &m.quantiles.p50),
            ("p90", &m.quantiles.p90),
        ] {
            s.push_str(&format!(
                "{:<6} {:>12.6} {:>14.4e} {:>16.6} {:>12.6} {:>22.6}\n",
                n,
                t.fixed_s,
                t.bytes_per_s,
                t.per_layer_tail_s,
                t.d_step_s,
                t.d_queue_s_per_waiting
            ));
        }
        s.push_str(&format!(
            "{:<6} {:>19} {:>22} {:>23} {:>17} {:>22}\n",
            "source",
            "prefill_s_per_token",
            "src_s_per_queued_token",
            "src_s_per_running_token",
            "src_s_per_waiting",
            "src_s_per_pending_byte"
        ));
        for (n, t) in [
            ("mean", &m.terms),
            ("p50", &m.quantiles.p50),
            ("p90", &m.quantiles.p90),
        ] {
            s.push_str(&format!(
                "{:<6} {:>19.4e} {:>22.4e} {:>23.4e} {:>17.6} {:>22.4e}\n",
                n,
                t.prefill_s_per_token,
                t.src_s_per_queued_token,
                t.src_s_per_running_token,
                t.src_s_per_waiting,
                t.src_s_per_pending_byte
            ));
        }
        if !self.segments.is_empty() {
            s.push_str(&format!(
                "\nwhere the clock went ({} records with milestones; seconds)\n{:<18} {:>10} {:>10} {:>14}\n",
                self.segment_records, "segment", "p50", "p90", "share of mean"
            ));
            for g in &self.segments {
                s.push_str(&format!(
                    "{:<18} {:>10.4} {:>10.4} {:>13.1}%\n",
                    g.name,
                    g.p50,
                    g.p90,
                    100.0 * g.share
                ));
            }
        }
        for n in &self.notes {
            s.push_str(&format!("note: {n}\n"));
        }
        s
    }
}

/// The grid of inputs `--predict-grid` evaluates: every (bytes, layers, dst_waiting,
/// dst_running) of a fixed grid, each with source-side inputs taken in turn from their own
/// lists (the first case has them all 0).
pub fn grid_inputs() -> Vec<Inputs> {
    let bytes = [
        0u64,
        1,
        16 * 1024,
        1 << 20,
        805_306_368,
        4_915_200_000,
        (1u64 << 53) + 1,
    ];
    let layers = [0u32, 1, 48, 80];
    let waiting = [0u32, 3, 1000];
    let running = [0u32, 7, 256];
    let prefill = [0u64, 1, 3_000, 50_000, (1u64 << 40) + 3];
    let src_waiting = [0u32, 2, 17, u32::MAX];
    let src_queued = [0u64, 12_345, 1_000_000];
    let src_running = [0u64, 16_384];
    let src_pending = [0u64, 805_306_368, 7_000_000_000_000];
    let mut v = Vec::new();
    for &b in &bytes {
        for &l in &layers {
            for &w in &waiting {
                for &r in &running {
                    let i = v.len();
                    v.push(Inputs {
                        bytes: b,
                        layers: l,
                        dst_waiting: w,
                        dst_running: r,
                        prefill_tokens: prefill[i % prefill.len()],
                        src_waiting: src_waiting[(i / 2) % src_waiting.len()],
                        src_queued_tokens: src_queued[(i / 3) % src_queued.len()],
                        src_running_tokens: src_running[(i / 5) % src_running.len()],
                        src_pending_bytes: src_pending[(i / 7) % src_pending.len()],
                    });
                }
            }
        }
    }
    v
}

/// The model's predictions on [`grid_inputs`] for every quantile, as JSON:
/// `{"model": {...}, "cases": [{"bytes", "layers", "dst_waiting", "dst_running",
/// "prefill_tokens", "src_waiting", "src_queued_tokens", "src_running_tokens",
/// "src_pending_bytes", "quantile",
/// "seconds"}]}`. Cross-language tests compare other implementations of the formula with it.
pub fn predict_grid(model: &CostModel) -> serde_json::Value {
    let mut cases = Vec::new();
    for x in grid_inputs() {
        for q in Quantile::ALL {
            cases.push(serde_json::json!({
                "bytes": x.bytes, "layers": x.layers, "dst_waiting": x.dst_waiting,
                "dst_running": x.dst_running, "prefill_tokens": x.prefill_tokens,
                "src_waiting": x.src_waiting, "src_queued_tokens": x.src_queued_tokens,
                "src_running_tokens": x.src_running_tokens,
                "src_pending_bytes": x.src_pending_bytes,
                "quantile": q.name(), "seconds": model.predict_inputs(&x, q),
            }));
        }
    }
    serde_json::json!({ "model": model, "cases": cases })
}

/// Arguments of `kvwire-bench calibrate`.
#[derive(Debug, clap::Args)]
pub struct CalibrateArgs {
    /// Timeline records (JSON lines) to fit on.
    #[arg(long, value_name = "FILE", required_unless_present = "predict_grid")]
    pub timeline: Option<PathBuf>,
    /// Write the fitted cost model (JSON, schema kvwire.cost/1) here.
    #[arg(long, value_name = "FILE")]
    pub out: Option<PathBuf>,
    /// Only use records of this transport (needed when the file mixes transports).
    #[arg(long)]
    pub transport: Option<String>,
    /// Only use records of this send mode (whole, layerwise); the model is for that mode.
    #[arg(long)]
    pub send_mode: Option<String>,
    /// Skip malformed lines (listed on stderr) instead of failing on the first one.
    #[arg(long)]
    pub skip_bad_lines: bool,
    /// Text for fitted_on.source [default: the timeline's path].
    #[arg(long)]
    pub source: Option<String>,
    /// Write the model's predictions over a fixed input grid (JSON) here, for cross-language
    /// checks. With --model, no fitting is done.
    #[arg(long, value_name = "FILE")]
    pub predict_grid: Option<PathBuf>,
    /// With --predict-grid: the model to evaluate instead of fitting one.
    #[arg(
        long,
        value_name = "FILE",
        requires = "predict_grid",
        conflicts_with = "timeline"
    )]
    pub model: Option<PathBuf>,
}

/// Writes to stdout, ignoring a closed pipe (`kvwire-bench calibrate ... | head`).
fn say(text: &str) {
    use std::io::Write;
    let _ = std::io::stdout().lock().write_all(text.as_bytes());
}

fn write_grid(model: &CostModel, path: &Path) -> Result<(), String> {
    let text = serde_json::to_string(&predict_grid(model)).map_err(|e| e.to_string())?;
    std::fs::write(path, text).map_err(|e| format!("{}: {e}", path.display()))
}

/// Runs `kvwire-bench calibrate`: prints the table, writes the model; exit 1 on any error.
pub fn run_cli(a: &CalibrateArgs) -> ExitCode {
    match run_cli_inner(a) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvwire-bench calibrate: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run_cli_inner(a: &CalibrateArgs) -> Result<(), String> {
    if let Some(mpath) = &a.model {
        let model = CostModel::load(mpath).map_err(|e| e.to_string())?;
        if let Some(g) = &a.predict_grid {
            write_grid(&model, g)?;
        }
        return Ok(());
    }
    let Some(tpath) = &a.timeline else {
        return Err("--timeline FILE is required (or --model with --predict-grid)".into());
    };
    let bad = if a.skip_bad_lines {
        BadLines::Skip
    } else {
        BadLines::Fail
    };
    let t = read_timeline(tpath, bad).map_err(|e| e.to_string())?;
    for (line, e) in &t.bad_lines {
        eprintln!("skipped line {line}: {e}");
    }
    say(&format!(
        "timeline {}: {} usable records; skipped {} malformed, {} failed, {} incomplete \
         (no decode_sent/first_token), {} zero clock, {} duplicate\n",
        tpath.display(),
        t.samples.len(),
        t.bad_lines.len(),
        t.skipped_failed,
        t.skipped_incomplete,
        t.skipped_zero,
        t.skipped_duplicate
    ));
    let opts = CalibrateOptions {
        transport: a.transport.clone(),
        send_mode: a.send_mode.clone(),
        source: a
            .source
            .clone()
            .unwrap_or_else(|| tpath.display().to_string()),
    };
    let c = calibrate(&t.samples, &opts).map_err(|e| e.to_string())?;
    say(&c.table());
    if let Some(out) = &a.out {
        c.model.save(out).map_err(|e| e.to_string())?;
        say(&format!("wrote {}\n", out.display()));
    }
    if let Some(g) = &a.predict_grid {
        write_grid(&c.model, g)?;
    }
    Ok(())
}
