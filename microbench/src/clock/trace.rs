//! Trace files for the clock bench: JSON lines or CSV, one request per line.

use std::path::Path;

use kvwire_connector::{Nanos, SEC};

use super::workload::RequestSpec;

/// A trace file that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    /// Reading the file failed.
    #[error("reading trace {path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// A line is malformed.
    #[error("trace line {line}: {what}")]
    Line {
        /// 1-based line number.
        line: usize,
        /// What is wrong.
        what: String,
    },
    /// The trace holds no request.
    #[error("trace has no requests")]
    Empty,
}

/// Most tokens a trace request may have (a larger value is a malformed line, not a request).
pub const MAX_TRACE_TOKENS: u64 = 4_000_000;

/// Parses a trace: JSON lines or CSV, one request per line.
///
/// JSON lines: an object with `arrival_s` (seconds; also `arrival`, `timestamp`), `prompt_tokens`
/// (also `input_tokens`, `input_length`), `cached_tokens` (optional, default 0; also
/// `cached`), `output_tokens` (also `output_length`) and `session` (optional, also
/// `session_id`: a whole number; the requests of one session are one growing context for D's
/// prefix cache). CSV: `arrival_s,prompt_tokens,
/// cached_tokens,output_tokens`, an optional header line, `#` comments. Arrivals are sorted and
/// shifted so the first is at 0. Blank lines are skipped; anything else malformed is an error
/// with its line number.
pub fn parse_trace(text: &str) -> Result<Vec<RequestSpec>, TraceError> {
    let mut out = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        let line = raw.trim();
        let n = i + 1;
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let fields = if line.starts_with('{') {
            json_fields(line, n)?
        } else {
            let cols: Vec<&str> = line.split(',').map(str::trim).collect();
            if out.is_empty() && cols.first().is_some_and(|c| c.parse::<f64>().is_err()) {
                // Header line.
                continue;
            }
            if cols.len() != 4 {
                return Err(TraceError::Line {
                    line: n,
                    what: format!("expected 4 comma-separated columns, got {}", cols.len()),
                });
            }
            let num = |k: usize| {
                cols[k].parse::<f64>().map_err(|_| TraceError::Line {
                    line: n,
                    what: format!("column {} is not a number: {:?}", k + 1, cols[k]),
                })
            };
            [num(0)?, num(1)?, num(2)?, num(3)?, -1.0]
        };
        out.push(spec_of(fields, n)?);
    }
    if out.is_empty() {
        return Err(TraceError::Empty);
    }
    out.sort_by_key(|r| r.arrival);
    let t0 = out[0].arrival;
    for r in &mut out {
        r.arrival -= t0;
    }
    Ok(out)
}

/// Reads and parses a trace file (see [`parse_trace`]).
pub fn read_trace(path: &Path) -> Result<Vec<RequestSpec>, TraceError> {
    let text = std::fs::read_to_string(path).map_err(|source| TraceError::Io {
        path: path.display().to_string(),
        source,
    })?;
    parse_trace(&text)
}

fn json_fields(line: &str, n: usize) -> Result<[f64; 5], TraceError> {
    let v: serde_json::Value = serde_json::from_str(line).map_err(|e| TraceError::Line {
        line: n,
        what: format!("not JSON: {e}"),
    })?;
    let get = |names: &[&str], default: Option<f64>| -> Result<f64, TraceError> {
        for k in names {
            if let Some(x) = v.get(*k) {
                return x.as_f64().ok_or_else(|| TraceError::Line {
                    line: n,
                    what: format!("field {k} is not a number"),
                });
            }
        }
        default.ok_or_else(|| TraceError::Line {
            line: n,
            what: format!("missing field {}", names[0]),
        })
    };
    Ok([
        get(&["arrival_s", "arrival", "timestamp"], None)?,
        get(&["prompt_tokens", "input_tokens", "input_length"], None)?,
        get(&["cached_tokens", "cached"], Some(0.0))?,
        get(&["output_tokens", "output_length"], None)?,
        get(&["session", "session_id"], Some(-1.0))?,
    ])
}

fn spec_of(f: [f64; 5], n: usize) -> Result<RequestSpec, TraceError> {
    let bad = |what: String| TraceError::Line { line: n, what };
    if !f[0].is_finite() || f[0] < 0.0 || f[0] > 1e7 {
        return Err(bad(format!("arrival {} out of range [0, 1e7] s", f[0])));
    }
    let tok = |x: f64, name: &str, min: f64| -> Result<u32, TraceError> {
        if !x.is_finite() || x < min || x > MAX_TRACE_TOKENS as f64 || x.fract() != 0.0 {
            return Err(bad(format!(
                "{name} {x} is not a whole number in [{min}, {MAX_TRACE_TOKENS}]"
            )));
        }
        Ok(x as u32)
    };
    let prompt = tok(f[1], "prompt_tokens", 1.0)?;
    let cached = tok(f[2], "cached_tokens", 0.0)?;
    let output = tok(f[3], "output_tokens", 1.0)?;
    if cached > prompt {
        return Err(bad(format!(
            "cached_tokens {cached} exceeds prompt_tokens {prompt}"
        )));
    }
    // A session number makes the requests of that session one growing context (D's prefix
    // cache keys its entries by it); without one, nothing is reused on D.
    let context =
        (f[4].is_finite() && f[4] >= 0.0 && f[4] <= u32::MAX as f64 && f[4].fract() == 0.0)
            .then_some(f[4] as u64);
    let mut spec = RequestSpec::new((f[0] * SEC as f64) as Nanos, prompt, cached, output);
    spec.context = context;
    Ok(spec)
}
