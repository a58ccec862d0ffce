//! Timeline records: one JSON line per request parsed into a [`Sample`] (the clock and the
//! model's inputs), malformed lines kept or refused, unusable records counted.

use std::collections::HashSet;
use std::io::BufRead;
use std::path::Path;

use serde::Deserialize;

use crate::costmodel::Inputs;

use super::error::{BadLines, CalibrateError, LineError};

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

/// A request id: a number or a string.
#[derive(Deserialize)]
#[serde(untagged)]
pub(super) enum RawId {
    Num(u64),
    Str(String),
}

impl RawId {
    /// The id as text (numbers in decimal).
    pub(super) fn text(&self) -> String {
        match self {
            RawId::Num(n) => n.to_string(),
            RawId::Str(s) => s.clone(),
        }
    }
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

/// What one line is.
pub(super) enum Parsed {
    Use(Box<Sample>),
    Failed,
    Incomplete,
    Zero,
}

pub(super) fn parse_line(text: &str, line: usize) -> Result<Parsed, LineError> {
    sample_of(serde_json::from_str(text)?, line)
}

/// [`parse_line`] of a line already parsed as JSON.
pub(super) fn parse_value(v: &serde_json::Value, line: usize) -> Result<Parsed, LineError> {
    sample_of(RawRecord::deserialize(v)?, line)
}

fn sample_of(mut r: RawRecord, line: usize) -> Result<Parsed, LineError> {
    if r.outcome.as_deref() == Some("failed") {
        return Ok(Parsed::Failed);
    }
    let bytes = r.bytes.ok_or(LineError::Missing("bytes"))?;
    let layers = r.layers.ok_or(LineError::Missing("layers"))?;
    let Some(id) = r.req.as_ref().map(RawId::text) else {
        return Err(LineError::Missing("req"));
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
    let mut t = Collect::default();
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
            Ok(p) => t.add(p),
            Err(error) => match bad {
                BadLines::Fail => return Err(CalibrateError::Line { line: n, error }),
                BadLines::Skip => t.timeline.bad_lines.push((n, error)),
            },
        }
    }
    Ok(t.timeline)
}

/// A timeline being read: records added one by one, exact duplicates dropped.
#[derive(Default)]
pub(super) struct Collect {
    pub(super) timeline: Timeline,
    seen: HashSet<(String, u64)>,
}

impl Collect {
    /// Adds a usable record (unless it repeats an earlier one) or counts an unusable one.
    pub(super) fn add(&mut self, p: Parsed) {
        let t = &mut self.timeline;
        match p {
            Parsed::Use(s) => {
                if self.seen.insert((s.id.clone(), s.seconds.to_bits())) {
                    t.samples.push(*s);
                } else {
                    t.skipped_duplicate += 1;
                }
            }
            Parsed::Failed => t.skipped_failed += 1,
            Parsed::Incomplete => t.skipped_incomplete += 1,
            Parsed::Zero => t.skipped_zero += 1,
        }
    }
}

/// Reads a timeline file.
pub fn read_timeline(path: &Path, bad: BadLines) -> Result<Timeline, CalibrateError> {
    let f = std::fs::File::open(path).map_err(|source| CalibrateError::Io {
        path: path.display().to_string(),
        source,
    })?;
    parse_timeline_named(std::io::BufReader::new(f), bad, &path.display().to_string())
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
