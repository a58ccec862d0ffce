//! Production timelines: the JSON lines the vLLM connector writes on every P and D engine
//! (`<engine>-<role>-<pid>.jsonl`, rotated into `.jsonl.1`, `.jsonl.2`... or `.jsonl.old`), and
//! the router's records (`router*.jsonl`), read from a directory (and its subdirectories) and
//! joined into one record per request on D's clock.
//!
//! A connector line is a `TimelineRecord` (`kvwire_connector::TimelineRecord`; unknown fields
//! are accepted) plus `role` (`"p"`, `"d"` or `"pd"`), `engine_id`, `transfer_id`,
//! `peer_engine_id`, the loads at `decode_sent` (`d_waiting`, `d_running` on D records;
//! `p_waiting`, `p_running`, `p_queued_tokens`, `p_cached_tokens` on P records), `clock_offset_ns` and
//! `clock_error_ns` (the peer's monotonic clock minus ours and the uncertainty of that estimate;
//! either may be absent or null) and, on P, `p_first_write`.
//!
//! Joining: a D record and the P record of the same request share `transfer_id` (or, when the
//! records carry none, `req`); with several P candidates the one written by the D record's
//! `peer_engine_id` wins. P's timestamps (`p_scheduled`, `p_first_layer_ready`,
//! `p_last_layer_ready`, `first_byte`, `p_first_write`) are moved onto D's clock — D's
//! `clock_offset_ns` is P's clock minus D's, so P's time `t` becomes `t − offset`; when only the
//! P record carries an offset (D's clock minus P's), `t + offset` — and the two records are
//! merged as `TimelineRecord::merge` does. Without any offset P's timestamps are left out of
//! the merge (D's own view of P's milestones stays) and the record is counted
//! ([`Production::clock_unknown`]); a joined record whose `clock_error_ns` exceeds the bound
//! ([`ProductionOptions::max_clock_error_ns`]) is kept and counted
//! ([`Production::clock_over_bound`]). A `"pd"` record has both sides on one clock (offset 0).
//! A D record without a P record (P's file missing or rotated away) is fitted on its own.
//!
//! Model inputs: `dst_waiting`/`dst_running` from D's `d_waiting`/`d_running`; `src_waiting`
//! and `src_queued_tokens` from P's `p_waiting`/`p_queued_tokens` (`p_running` counts requests,
//! which no term of the model takes); the request's own prefill, `prefill_tokens`, is `tokens`
//! less P's `p_cached_tokens` (what P's prefix cache held: P computed the rest). Router lines (`"kind": "router"`, `transfer_id`,
//! `decode_sent_ns`, `first_token_ns`, `last_token_ns` on the router's clock, `p`, `d`,
//! `p_load`, `d_load`) are joined by transfer id and give the loads where the connector's
//! records do not: a load is an object `{"waiting": n, "running": n, "queued_tokens": n}` (any
//! of them), or a bare number, the router's count of the engine's requests in flight — on D
//! that counts as running, on P as waiting.
//!
//! Lines without `role` or `kind` are read as plain timeline records, as from a single file
//! ([`super::read_timeline`]).

use std::cmp::Reverse;
use std::collections::{HashMap, HashSet};
use std::io::BufRead;
use std::path::{Path, PathBuf};

use kvwire_connector::TimelineRecord;
use serde::Deserialize;
use serde_json::Value;

use super::error::{BadLines, CalibrateError, LineError};
use super::records::{parse_line, parse_value, Collect, Parsed, RawId, Timeline};

/// Options of [`read_production`].
#[derive(Clone, Copy, Debug)]
pub struct ProductionOptions {
    /// What to do with a malformed line.
    pub bad: BadLines,
    /// Joined records whose clock offset is less certain than this (nanoseconds) are kept and
    /// counted in [`Production::clock_over_bound`].
    pub max_clock_error_ns: u64,
}

impl Default for ProductionOptions {
    fn default() -> Self {
        ProductionOptions {
            bad: BadLines::Fail,
            max_clock_error_ns: 5_000_000,
        }
    }
}

/// A malformed line skipped under [`BadLines::Skip`].
#[derive(Debug)]
pub struct BadLine {
    /// The file, when the input was a directory (the lines of a single file go by number).
    pub file: Option<String>,
    /// 1-based line number.
    pub line: usize,
    /// What is wrong with it.
    pub error: LineError,
}

impl std::fmt::Display for BadLine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.file {
            Some(file) => write!(f, "{file}:{}: {}", self.line, self.error),
            None => write!(f, "line {}: {}", self.line, self.error),
        }
    }
}

/// What [`read_production`] found.
#[derive(Debug, Default)]
pub struct Production {
    /// Usable records (joined, D alone, plain) in file order, and the unusable ones counted.
    /// Its `bad_lines` stays empty: malformed lines are in [`Production::bad_lines`].
    pub timeline: Timeline,
    /// Malformed lines skipped under [`BadLines::Skip`].
    pub bad_lines: Vec<BadLine>,
    /// The files read, in order.
    pub files: Vec<PathBuf>,
    /// Connector records with role `d` or `pd`.
    pub d_records: usize,
    /// Connector records with role `p`.
    pub p_records: usize,
    /// D records joined with their P record.
    pub joined: usize,
    /// D records without a P record.
    pub d_only: usize,
    /// P records no D record claimed.
    pub p_unmatched: usize,
    /// Joined records without a clock offset on either side (P's timestamps left out).
    pub clock_unknown: usize,
    /// Joined records with a clock offset but no error estimate.
    pub clock_error_unknown: usize,
    /// Joined records whose clock error exceeds the bound (kept).
    pub clock_over_bound: usize,
    /// Router records read.
    pub router_records: usize,
    /// Router records whose transfer id matched a D record.
    pub router_joined: usize,
    /// Records with a load taken from the router (the connector's record had none).
    pub router_loads: usize,
}

impl Production {
    /// Whether any connector or router record was read (else the input was a plain timeline).
    pub fn has_production_records(&self) -> bool {
        self.d_records + self.p_records + self.router_records > 0
    }

    /// What the join did, in one line.
    pub fn summary(&self, max_clock_error_ns: u64) -> String {
        format!(
            "production records: {} D and {} P in {} files; {} joined with their P record ({} \
             without a clock offset, {} without a clock error estimate, {} with a clock error \
             over {} ms, kept), {} D records without a P record, {} P records without a D \
             record; router: {} records, {} matched, loads from the router on {} records",
            self.d_records,
            self.p_records,
            self.files.len(),
            self.joined,
            self.clock_unknown,
            self.clock_error_unknown,
            self.clock_over_bound,
            max_clock_error_ns as f64 / 1e6,
            self.d_only,
            self.p_unmatched,
            self.router_records,
            self.router_joined,
            self.router_loads
        )
    }
}

/// What the connector adds to its core's record.
#[derive(Deserialize)]
struct Extras {
    transfer_id: Option<RawId>,
    engine_id: Option<RawId>,
    peer_engine_id: Option<RawId>,
    d_waiting: Option<u32>,
    d_running: Option<u32>,
    p_waiting: Option<u32>,
    p_queued_tokens: Option<u64>,
    p_cached_tokens: Option<u64>,
    clock_offset_ns: Option<i64>,
    clock_error_ns: Option<i64>,
    p_first_write: Option<u64>,
}

/// One connector record.
struct Conn {
    rec: TimelineRecord,
    x: Extras,
    /// Both sides on one clock (role `pd`).
    one_clock: bool,
    /// The join key: `transfer_id`, or `req`.
    key: String,
    file: usize,
    line: usize,
}

/// What a router knows of an engine's load.
#[derive(Clone, Copy, Deserialize)]
#[serde(untagged)]
enum Load {
    /// Requests in flight at the engine.
    Count(u64),
    /// Queues by name.
    Queues {
        waiting: Option<u64>,
        running: Option<u64>,
        queued_tokens: Option<u64>,
    },
}

#[derive(Deserialize)]
struct Router {
    transfer_id: RawId,
    p_load: Option<Load>,
    d_load: Option<Load>,
}

/// One line, classified.
enum Entry {
    Plain(Parsed),
    D(Conn),
    P(Conn),
    Router(Router),
}

fn classify(text: &str, file: usize, line: usize) -> Result<Entry, LineError> {
    let v: Value = serde_json::from_str(text)?;
    if v.get("kind").and_then(Value::as_str) == Some("router") {
        return Ok(Entry::Router(Router::deserialize(&v)?));
    }
    let role = match v.get("role") {
        None | Some(Value::Null) => return parse_line(text, line).map(Entry::Plain),
        Some(Value::String(r)) if ["p", "d", "pd"].contains(&r.as_str()) => r.clone(),
        Some(other) => {
            return Err(LineError::Invalid(format!(
                "role {other} is not \"p\", \"d\" or \"pd\""
            )))
        }
    };
    let rec = TimelineRecord::deserialize(&v)?;
    let x = Extras::deserialize(&v)?;
    let key = match x.transfer_id.as_ref().map(RawId::text) {
        Some(t) if !t.is_empty() => t,
        _ => rec.req.0.to_string(),
    };
    let c = Conn {
        rec,
        x,
        one_clock: role == "pd",
        key,
        file,
        line,
    };
    Ok(if role == "p" {
        Entry::P(c)
    } else {
        Entry::D(c)
    })
}

/// The timeline files under `dir` (recursively): `*.jsonl` and their rotations `*.jsonl.N`
/// and `*.jsonl.old`, each file's rotations oldest first before the file itself.
pub fn production_files(dir: &Path) -> std::io::Result<Vec<PathBuf>> {
    let mut found = Vec::new();
    let mut dirs = vec![dir.to_path_buf()];
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d)? {
            let e = e?;
            let path = e.path();
            if e.file_type()?.is_dir() {
                dirs.push(path);
                continue;
            }
            let Some(name) = path.file_name().and_then(|n| n.to_str()) else {
                continue;
            };
            // Rank: older rotations first (.old, then .N by decreasing N), the live file last.
            let (base, rank) = match name.rsplit_once(".jsonl.") {
                Some((b, "old")) => (b.to_string(), (0, Reverse(u64::MAX))),
                Some((b, n)) if !n.is_empty() && n.bytes().all(|c| c.is_ascii_digit()) => (
                    b.to_string(),
                    (0, Reverse(n.parse().unwrap_or(u64::MAX - 1))),
                ),
                _ => match name.strip_suffix(".jsonl") {
                    Some(b) => (b.to_string(), (1, Reverse(0))),
                    None => continue,
                },
            };
            if path.is_file() {
                found.push((d.clone(), base, rank, path));
            }
        }
    }
    found.sort();
    Ok(found.into_iter().map(|(.., p)| p).collect())
}

/// Reads production timelines from `path` — a directory (see [`production_files`]) or one
/// file — and joins them (see the module documentation).
pub fn read_production(
    path: &Path,
    opts: &ProductionOptions,
) -> Result<Production, CalibrateError> {
    if !path.is_dir() {
        return read_files(vec![path.to_path_buf()], true, opts);
    }
    let files = production_files(path).map_err(|source| CalibrateError::Io {
        path: path.display().to_string(),
        source,
    })?;
    read_files(files, false, opts)
}

/// Reads and joins the production timelines in `files` (as from [`production_files`]; router
/// records may come from other directories than the connectors' files, as `kvwire-bench ab`
/// keeps them).
pub fn read_production_files(
    files: Vec<PathBuf>,
    opts: &ProductionOptions,
) -> Result<Production, CalibrateError> {
    read_files(files, false, opts)
}

/// `single`: the input was one file (its malformed lines go by number alone).
fn read_files(
    files: Vec<PathBuf>,
    single: bool,
    opts: &ProductionOptions,
) -> Result<Production, CalibrateError> {
    let io = |p: &Path| {
        let path = p.display().to_string();
        move |source| CalibrateError::Io { path, source }
    };
    let mut out = Production {
        files,
        ..Production::default()
    };
    let mut entries = Vec::new();
    for (fi, f) in out.files.iter().enumerate() {
        let name = f.display().to_string();
        let reader = std::io::BufReader::new(std::fs::File::open(f).map_err(io(f))?);
        for (i, text) in reader.lines().enumerate() {
            let text = text.map_err(io(f))?;
            if text.trim().is_empty() {
                continue;
            }
            match classify(&text, fi, i + 1) {
                Ok(e) => entries.push(e),
                Err(error) => {
                    let file = (!single).then(|| name.clone());
                    bad_line(&mut out.bad_lines, opts.bad, file, i + 1, error)?;
                }
            }
        }
    }
    join(entries, opts, single, &mut out)?;
    Ok(out)
}

/// Keeps a malformed line or stops at it.
fn bad_line(
    bad_lines: &mut Vec<BadLine>,
    bad: BadLines,
    file: Option<String>,
    line: usize,
    error: LineError,
) -> Result<(), CalibrateError> {
    match (bad, file) {
        (BadLines::Fail, None) => Err(CalibrateError::Line { line, error }),
        (BadLines::Fail, Some(file)) => Err(CalibrateError::FileLine { file, line, error }),
        (BadLines::Skip, file) => {
            bad_lines.push(BadLine { file, line, error });
            Ok(())
        }
    }
}

/// The loads of a joined record, as model inputs.
#[derive(Default)]
struct Loads {
    dst_waiting: Option<u64>,
    dst_running: Option<u64>,
    src_waiting: Option<u64>,
    src_queued_tokens: Option<u64>,
}

fn join(
    entries: Vec<Entry>,
    opts: &ProductionOptions,
    single: bool,
    out: &mut Production,
) -> Result<(), CalibrateError> {
    let mut ps: Vec<Conn> = Vec::new();
    let mut routers: HashMap<String, Router> = HashMap::new();
    let mut rest = Vec::new();
    for e in entries {
        match e {
            Entry::P(c) => ps.push(c),
            Entry::Router(r) => {
                out.router_records += 1;
                routers.entry(r.transfer_id.text()).or_insert(r);
            }
            other => rest.push(other),
        }
    }
    out.p_records = ps.len();
    let mut p_by_key: HashMap<&str, Vec<usize>> = HashMap::new();
    for (i, p) in ps.iter().enumerate() {
        p_by_key.entry(p.key.as_str()).or_default().push(i);
    }
    let mut used = vec![false; ps.len()];
    let mut routed: HashSet<String> = HashSet::new();
    let mut c = Collect::default();
    for e in rest {
        let d = match e {
            Entry::Plain(p) => {
                c.add(p);
                continue;
            }
            Entry::D(d) => d,
            Entry::P(_) | Entry::Router(_) => continue,
        };
        out.d_records += 1;
        let p = p_by_key
            .get(d.key.as_str())
            .and_then(|cands| pick(cands, &ps, &used, &d))
            .inspect(|&i| used[i] = true)
            .map(|i| &ps[i]);
        let (merged, p_first_write) = match p {
            Some(p) => {
                out.joined += 1;
                merge(&d, p, opts, out)
            }
            None => {
                out.d_only += 1;
                (d.rec.clone(), None)
            }
        };
        let mut loads = Loads {
            dst_waiting: d.x.d_waiting.map(u64::from),
            dst_running: d.x.d_running.map(u64::from),
            src_waiting: p.and_then(|p| p.x.p_waiting).map(u64::from),
            src_queued_tokens: p.and_then(|p| p.x.p_queued_tokens),
        };
        if let Some(r) = routers.get(&d.key) {
            if routed.insert(d.key.clone()) {
                out.router_joined += 1;
            }
            if loads.fill_from_router(r) {
                out.router_loads += 1;
            }
        }
        // Serialising a record cannot fail; a Null would be refused below as malformed.
        let mut v = serde_json::to_value(&merged).unwrap_or_default();
        if let Some(m) = v.as_object_mut() {
            m.insert("req".into(), Value::String(d.key.clone()));
            for (k, x) in [
                ("dst_waiting", loads.dst_waiting),
                ("dst_running", loads.dst_running),
                ("src_waiting", loads.src_waiting),
                ("src_queued_tokens", loads.src_queued_tokens),
                ("p_first_write", p_first_write),
                ("cached_tokens", p.and_then(|p| p.x.p_cached_tokens)),
            ] {
                if let Some(x) = x {
                    m.insert(k.into(), x.into());
                }
            }
        }
        match parse_value(&v, d.line) {
            Ok(parsed) => c.add(parsed),
            Err(error) => {
                let file = (!single).then(|| out.files[d.file].display().to_string());
                bad_line(&mut out.bad_lines, opts.bad, file, d.line, error)?;
            }
        }
    }
    out.p_unmatched = used.iter().filter(|u| !**u).count();
    out.timeline = c.timeline;
    Ok(())
}

/// The P record for `d` among `cands` (indices into `ps` with D's key): an unclaimed one
/// written by D's peer engine first, then any unclaimed one, then any.
fn pick(cands: &[usize], ps: &[Conn], used: &[bool], d: &Conn) -> Option<usize> {
    let peer = d.x.peer_engine_id.as_ref().map(RawId::text);
    let by_peer =
        |i: &&usize| peer.is_some() && ps[**i].x.engine_id.as_ref().map(RawId::text) == peer;
    let free = |i: &&usize| !used[**i];
    cands
        .iter()
        .find(|i| free(i) && by_peer(i))
        .or_else(|| cands.iter().find(free))
        .or_else(|| cands.first())
        .copied()
}

/// D's record merged with P's, P's timestamps moved onto D's clock; P's first write, moved.
fn merge(
    d: &Conn,
    p: &Conn,
    opts: &ProductionOptions,
    out: &mut Production,
) -> (TimelineRecord, Option<u64>) {
    // P's clock minus D's, and its uncertainty.
    let (offset, error) = if d.one_clock {
        (Some(0), Some(0))
    } else if let Some(o) = d.x.clock_offset_ns {
        (Some(i128::from(o)), d.x.clock_error_ns)
    } else if let Some(o) = p.x.clock_offset_ns {
        (Some(-i128::from(o)), p.x.clock_error_ns)
    } else {
        (None, None)
    };
    match (offset, error) {
        (None, _) => out.clock_unknown += 1,
        (Some(_), None) => out.clock_error_unknown += 1,
        (Some(_), Some(e)) if e.unsigned_abs() > opts.max_clock_error_ns => {
            out.clock_over_bound += 1
        }
        _ => {}
    }
    let shift = |t: Option<u64>| -> Option<u64> {
        let o = offset?;
        u64::try_from(i128::from(t?) - o).ok()
    };
    let mut on_d = p.rec.clone();
    on_d.p_scheduled = shift(p.rec.p_scheduled);
    on_d.p_first_layer_ready = shift(p.rec.p_first_layer_ready);
    on_d.p_last_layer_ready = shift(p.rec.p_last_layer_ready);
    on_d.first_byte = shift(p.rec.first_byte);
    (
        TimelineRecord::merge(&d.rec, &on_d),
        shift(p.x.p_first_write),
    )
}

impl Loads {
    /// Fills the loads the connector's records lack from the router's; whether any was.
    fn fill_from_router(&mut self, r: &Router) -> bool {
        let mut used = false;
        if self.dst_waiting.is_none() && self.dst_running.is_none() {
            if let Some(l) = r.d_load {
                (self.dst_waiting, self.dst_running) = match l {
                    Load::Count(n) => (None, Some(n)),
                    Load::Queues {
                        waiting, running, ..
                    } => (waiting, running),
                };
                used = true;
            }
        }
        if self.src_waiting.is_none() && self.src_queued_tokens.is_none() {
            if let Some(l) = r.p_load {
                (self.src_waiting, self.src_queued_tokens) = match l {
                    Load::Count(n) => (Some(n), None),
                    Load::Queues {
                        waiting,
                        queued_tokens,
                        ..
                    } => (waiting, queued_tokens),
                };
                used = true;
            }
        }
        used
    }
}
