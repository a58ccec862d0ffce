//! Request mixes for the clock bench: a synthetic agentic mix and trace files.

use std::path::Path;

use kvwire_connector::{Nanos, SEC};
use kvwire_testkit::rng::Rng;

/// One request of a run, the same for every cell of the matrix.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RequestSpec {
    /// Arrival at the router (virtual nanoseconds from the start of the run).
    pub arrival: Nanos,
    /// Prompt tokens (the whole context: what D needs and what is transferred).
    pub prompt_tokens: u32,
    /// Tokens P already has cached (P prefills only `prompt_tokens - cached_tokens`).
    pub cached_tokens: u32,
    /// Output tokens D decodes.
    pub output_tokens: u32,
}

impl RequestSpec {
    /// Tokens P must prefill.
    pub fn uncached(&self) -> u32 {
        self.prompt_tokens.saturating_sub(self.cached_tokens)
    }
}

/// Parameters of the synthetic agentic mix: sessions whose context grows turn by turn, with
/// a high probability that P still holds the previous turn (prefix reuse), Poisson arrivals.
#[derive(Clone, Debug)]
pub struct AgenticMix {
    /// Sessions active at once (each arrival picks one at random).
    pub sessions: usize,
    /// Shortest context.
    pub min_tokens: u32,
    /// Longest context; a session that would exceed it starts over.
    pub max_tokens: u32,
    /// Tokens added per turn, uniform in the range.
    pub turn_tokens: (u32, u32),
    /// Probability that P has the previous context cached.
    pub reuse: f64,
    /// Output tokens, uniform in the range.
    pub output_tokens: (u32, u32),
    /// Poisson arrival rate, requests per second.
    pub arrival_rate: f64,
}

impl AgenticMix {
    /// The default mix: 48 sessions, contexts 1k–50k tokens, 500–4000 new tokens a turn, 93%
    /// reuse (the intra-session reuse of the seed study's agentic trace), 16–96 output tokens.
    pub fn standard(arrival_rate: f64) -> Self {
        AgenticMix {
            sessions: 48,
            min_tokens: 1_000,
            max_tokens: 50_000,
            turn_tokens: (500, 4_000),
            reuse: 0.93,
            output_tokens: (16, 96),
            arrival_rate,
        }
    }

    /// Generates `n` requests from `seed` (deterministic).
    pub fn generate(&self, n: usize, seed: u64) -> Vec<RequestSpec> {
        let mut rng = Rng::new(seed);
        let min = u64::from(self.min_tokens.max(1));
        let max = u64::from(self.max_tokens.max(self.min_tokens.max(1)));
        let mut ctx: Vec<u32> = (0..self.sessions.max(1))
            .map(|_| rng.range(min, (max / 4).max(min)) as u32)
            .collect();
        let mut t: Nanos = 0;
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let i = rng.range(0, ctx.len() as u64 - 1) as usize;
            let add = rng.range(
                u64::from(self.turn_tokens.0),
                u64::from(self.turn_tokens.1.max(self.turn_tokens.0)),
            ) as u32;
            let mut prompt = ctx[i].saturating_add(add);
            let mut cached = if rng.chance(self.reuse) { ctx[i] } else { 0 };
            if u64::from(prompt) > max {
                prompt = rng.range(min, (min * 8).min(max)) as u32;
                cached = 0;
            }
            ctx[i] = prompt;
            let output = rng.range(
                u64::from(self.output_tokens.0.max(1)),
                u64::from(self.output_tokens.1.max(self.output_tokens.0.max(1))),
            ) as u32;
            out.push(RequestSpec {
                arrival: t,
                prompt_tokens: prompt,
                cached_tokens: cached,
                output_tokens: output,
            });
            let gap = (rng.exp(1.0 / self.arrival_rate.max(1e-6)) * 1e9) as Nanos;
            t += gap.max(1);
        }
        out
    }
}

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
/// `cached`) and `output_tokens` (also `output_length`). CSV: `arrival_s,prompt_tokens,
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
            [num(0)?, num(1)?, num(2)?, num(3)?]
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

fn json_fields(line: &str, n: usize) -> Result<[f64; 4], TraceError> {
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
    ])
}

fn spec_of(f: [f64; 4], n: usize) -> Result<RequestSpec, TraceError> {
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
    Ok(RequestSpec {
        arrival: (f[0] * SEC as f64) as Nanos,
        prompt_tokens: prompt,
        cached_tokens: cached,
        output_tokens: output,
    })
}
