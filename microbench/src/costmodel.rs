//! The router's cost model: a small JSON file (schema `kvwire.cost/1`) that predicts the
//! `decode_sent → first_token` clock of one P/D request from what a router knows when it places
//! the request.
//!
//! # The formula
//!
//! For a request moving `bytes` of KV over `layers` layers to a decode engine that has
//! `dst_waiting` requests waiting and `dst_running` requests running at `decode_sent`, whose
//! prefill engine (the source) still has to compute `prefill_tokens` of its prompt, with
//! `src_waiting` requests holding `src_queued_tokens` uncached tokens queued ahead of it, a
//! step with `src_running_tokens` uncached tokens left to compute in progress, and
//! `src_pending_bytes` of KV to send before this request's ([`Inputs`]):
//!
//! ```text
//! t = fixed_s
//!   + bytes / bytes_per_s
//!   + layers · per_layer_tail_s
//!   + d_step_s · (1 + dst_running)
//!   + d_queue_s_per_waiting · dst_waiting
//!   + prefill_s_per_token · prefill_tokens
//!   + src_s_per_queued_token · src_queued_tokens
//!   + src_s_per_running_token · src_running_tokens
//!   + src_s_per_waiting · src_waiting
//!   + src_s_per_pending_byte · src_pending_bytes    (seconds)
//! ```
//!
//! evaluated left to right in `f64` (the Python helper `kvwire.costs` does the same, in the
//! same order, so both agree to rounding). The last five terms (the source side) are optional in
//! the file and default to 0, so files written before them load and predict as before; a router
//! that does not know the source side passes 0 for those inputs. Why this form — each term
//! stands for segments of the clock's decomposition
//! (`kvwire_connector::timeline::Decomposition`):
//!
//! * **wait for P**: with the request sent to P and D together, the clock starts while P still
//!   has to run the steps ahead of it (`src_*`: the queue ahead, FIFO, and the remainder of the
//!   step in progress, about half of it on average) and its own prefill (`prefill_tokens`, the
//!   prompt minus what P has cached: prefix reuse makes this much smaller than the bytes
//!   moved). `src_s_per_waiting` is the per-step cost paid once per queued request. In a
//!   migration (KV already on the source) the compute terms are 0.
//! * **exposed transfer**, queueing part: the source's link sends the KV of the requests ahead
//!   first (`src_pending_bytes`: what is not yet sent of the requests already prefilled, plus
//!   the KV of those in the running step and queued ahead).
//! * **reservation wait**: the part that does not grow with size or load (control messages, P
//!   admission, block ids reaching P) lands in `fixed_s`.
//! * **exposed transfer**: the bytes not hidden behind prefill. `bytes_per_s` is therefore the
//!   *effective* rate of the whole request, not the link rate: with whole-request sends it is
//!   close to the link's goodput; with layerwise sends only about one layer is exposed and the
//!   fitted rate is correspondingly higher. A fit that finds no size dependence stores
//!   [`MAX_BYTES_PER_S`].
//! * **per-layer tail**: fixed costs paid once per layer (one post, completion and notification
//!   per layer; the last layer's tail in layerwise mode). Only identifiable when the records span
//!   several layer counts; otherwise it is folded into `fixed_s`.
//! * **report delay, promotion delay, first step**: a few D scheduler steps, whose duration grows
//!   with the batch the request joins (`1 + dst_running` sequences). `d_step_s` is the marginal
//!   seconds per sequence of that batch, summed over the steps on the clock; the batch-independent
//!   part of the steps is in `fixed_s`.
//! * **D-side queueing**: every request already waiting on D is admitted before this one
//!   (`d_queue_s_per_waiting` each). This is the term the seed model `0.3 s + bytes / 2.7 GB/s`
//!   lacked, with the eager reservation and the step-bound promotion: it was 10–20× off on a
//!   loaded destination.
//!
//! All terms are non-negative, so predictions never decrease with bytes, layers or load.
//! The top-level `terms` are a least-squares fit (the conditional mean); `quantiles.p50` minimises
//! the mean *relative* error (a median weighted by 1/actual, so it sits slightly below the plain
//! median); `quantiles.p90` is a quantile fit: it predicts a time the request beats 9 times in 10.

use std::path::Path;

use serde::{Deserialize, Serialize};

/// The schema tag of the cost-model file.
pub const SCHEMA: &str = "kvwire.cost/1";

/// Largest stored `bytes_per_s` (1e15 B/s): a fit that finds no size dependence at all stores
/// this instead of infinity (JSON has no infinity), making the bytes term vanish in practice.
pub const MAX_BYTES_PER_S: f64 = 1e15;

/// What goes wrong loading, validating or saving a cost model.
#[derive(Debug, thiserror::Error)]
pub enum CostModelError {
    /// Reading or writing the file failed.
    #[error("cost model file {path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The text is not JSON, or a field has the wrong type.
    #[error("cost model is not valid JSON of the expected shape: {0}")]
    Json(#[from] serde_json::Error),
    /// The `schema` field is not [`SCHEMA`].
    #[error("cost model schema is {found:?}, expected {SCHEMA:?}")]
    BadSchema {
        /// The schema found.
        found: String,
    },
    /// A required term (or block) is absent.
    #[error("cost model lacks {0}")]
    Missing(String),
    /// A term is NaN, infinite or negative (or `bytes_per_s` is zero).
    #[error("cost model term {name} = {value} is not a finite non-negative number{extra}")]
    BadValue {
        /// Where the value sits, e.g. `quantiles.p90.d_step_s`.
        name: String,
        /// The value.
        value: f64,
        /// Extra explanation.
        extra: &'static str,
    },
}

/// What a router knows about one request when it sends it to D (the model's inputs).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Inputs {
    /// KV bytes to move.
    pub bytes: u64,
    /// Layers.
    pub layers: u32,
    /// Requests waiting on D.
    pub dst_waiting: u32,
    /// Requests running on D.
    pub dst_running: u32,
    /// Tokens of this request P still has to prefill after `decode_sent` (prompt minus cached
    /// tokens; 0 when the KV is already on the source).
    pub prefill_tokens: u64,
    /// Requests queued on P ahead of this one.
    pub src_waiting: u32,
    /// Uncached tokens of those requests.
    pub src_queued_tokens: u64,
    /// Uncached tokens of the step P is running not computed yet.
    pub src_running_tokens: u64,
    /// KV bytes P sends before this request's (not yet sent of prefilled requests, plus those
    /// running and queued ahead).
    pub src_pending_bytes: u64,
}

/// The fitted terms (see the module docs for the formula). The source-side terms
/// (`prefill_s_per_token` and the `src_*` ones) default to 0 when a file lacks them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Terms {
    /// Seconds every request pays.
    pub fixed_s: f64,
    /// Effective bytes per second of the whole request (> 0).
    pub bytes_per_s: f64,
    /// Seconds per layer.
    pub per_layer_tail_s: f64,
    /// Seconds per sequence in the D batch the request joins (`1 + dst_running`).
    pub d_step_s: f64,
    /// Seconds per request already waiting on D.
    pub d_queue_s_per_waiting: f64,
    /// Seconds per token of this request's own prefill.
    #[serde(default)]
    pub prefill_s_per_token: f64,
    /// Seconds per uncached token queued on P ahead of this request.
    #[serde(default)]
    pub src_s_per_queued_token: f64,
    /// Seconds per uncached token of the step P is running.
    #[serde(default)]
    pub src_s_per_running_token: f64,
    /// Seconds per request queued on P ahead of this one.
    #[serde(default)]
    pub src_s_per_waiting: f64,
    /// Seconds per KV byte P sends before this request's.
    #[serde(default)]
    pub src_s_per_pending_byte: f64,
}

impl Terms {
    /// Predicted seconds of `decode_sent → first_token` for a router that knows only the
    /// destination side (the source-side inputs are 0).
    pub fn predict(&self, bytes: u64, layers: u32, dst_waiting: u32, dst_running: u32) -> f64 {
        self.predict_inputs(&Inputs {
            bytes,
            layers,
            dst_waiting,
            dst_running,
            ..Inputs::default()
        })
    }

    /// Predicted seconds of `decode_sent → first_token` (the module's formula, in its order).
    pub fn predict_inputs(&self, x: &Inputs) -> f64 {
        self.fixed_s
            + x.bytes as f64 / self.bytes_per_s
            + f64::from(x.layers) * self.per_layer_tail_s
            + self.d_step_s * (1.0 + f64::from(x.dst_running))
            + self.d_queue_s_per_waiting * f64::from(x.dst_waiting)
            + self.prefill_s_per_token * x.prefill_tokens as f64
            + self.src_s_per_queued_token * x.src_queued_tokens as f64
            + self.src_s_per_running_token * x.src_running_tokens as f64
            + self.src_s_per_waiting * f64::from(x.src_waiting)
            + self.src_s_per_pending_byte * x.src_pending_bytes as f64
    }

    /// Checks every term is finite and non-negative, and `bytes_per_s` positive.
    pub fn validate(&self, prefix: &str) -> Result<(), CostModelError> {
        let named = [
            ("fixed_s", self.fixed_s),
            ("bytes_per_s", self.bytes_per_s),
            ("per_layer_tail_s", self.per_layer_tail_s),
            ("d_step_s", self.d_step_s),
            ("d_queue_s_per_waiting", self.d_queue_s_per_waiting),
            ("prefill_s_per_token", self.prefill_s_per_token),
            ("src_s_per_queued_token", self.src_s_per_queued_token),
            ("src_s_per_running_token", self.src_s_per_running_token),
            ("src_s_per_waiting", self.src_s_per_waiting),
            ("src_s_per_pending_byte", self.src_s_per_pending_byte),
        ];
        for (n, v) in named {
            if !v.is_finite() || v < 0.0 {
                return Err(CostModelError::BadValue {
                    name: format!("{prefix}{n}"),
                    value: v,
                    extra: "",
                });
            }
        }
        if self.bytes_per_s <= 0.0 {
            return Err(CostModelError::BadValue {
                name: format!("{prefix}bytes_per_s"),
                value: self.bytes_per_s,
                extra: " (bytes_per_s must be > 0)",
            });
        }
        Ok(())
    }
}

/// Which fitted term set a prediction uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Quantile {
    /// The top-level `terms` (least squares: the conditional mean).
    Mean,
    /// `quantiles.p50`: the typical clock, fitted for the least mean relative error.
    P50,
    /// `quantiles.p90`: a clock 90% of requests beat.
    P90,
}

impl Quantile {
    /// Its name in the file and in the Python helper (`"mean"`, `"p50"`, `"p90"`).
    pub fn name(self) -> &'static str {
        match self {
            Quantile::Mean => "mean",
            Quantile::P50 => "p50",
            Quantile::P90 => "p90",
        }
    }

    /// All of them.
    pub const ALL: [Quantile; 3] = [Quantile::Mean, Quantile::P50, Quantile::P90];
}

/// What the model was fitted on.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FittedOn {
    /// Number of records used for fitting (the training part).
    pub records: u64,
    /// Where they came from (a file name, a bench run).
    pub source: String,
}

/// Quantile term sets.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Quantiles {
    /// The median fit.
    pub p50: Terms,
    /// The 90th-percentile fit.
    pub p90: Terms,
}

/// The model's own error, measured on held-out records.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct ErrorBlock {
    /// Median over held-out records of `|pred_p50 − actual| / actual`.
    pub p50_rel: f64,
    /// 90th percentile over held-out records of `|pred_p50 − actual| / actual`.
    pub p90_rel: f64,
    /// Held-out records the error was measured on (absent in hand-written files).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub held_out: Option<u64>,
    /// Fraction of held-out records whose actual clock was ≤ the p90 prediction.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub p90_coverage: Option<f64>,
}

/// A cost model file (`kvwire.cost/1`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CostModel {
    /// Always [`SCHEMA`].
    pub schema: String,
    /// The transport the records used (`rdma`, `tcp`, `shm`, ...).
    pub transport: String,
    /// The send mode the records used (`whole`, `layerwise`) when the fit was restricted to
    /// one; absent otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub send_mode: Option<String>,
    /// What it was fitted on.
    pub fitted_on: FittedOn,
    /// The least-squares terms (conditional mean).
    pub terms: Terms,
    /// Quantile terms.
    pub quantiles: Quantiles,
    /// Held-out error.
    pub error: ErrorBlock,
}

impl CostModel {
    /// Parses and validates a model from JSON text.
    pub fn from_json_str(text: &str) -> Result<CostModel, CostModelError> {
        // Look at the raw value first so a wrong schema or an absent term gets its own error
        // rather than serde's generic "missing field".
        let v: serde_json::Value = serde_json::from_str(text)?;
        let schema = v
            .get("schema")
            .ok_or_else(|| CostModelError::Missing("schema".into()))?;
        match schema.as_str() {
            Some(SCHEMA) => {}
            Some(s) => {
                return Err(CostModelError::BadSchema {
                    found: s.to_string(),
                })
            }
            None => {
                return Err(CostModelError::BadSchema {
                    found: schema.to_string(),
                })
            }
        }
        for top in ["transport", "fitted_on", "terms", "quantiles", "error"] {
            if v.get(top).is_none() {
                return Err(CostModelError::Missing(top.to_string()));
            }
        }
        let blocks = [
            ("terms".to_string(), v.get("terms")),
            (
                "quantiles.p50".to_string(),
                v.get("quantiles").and_then(|q| q.get("p50")),
            ),
            (
                "quantiles.p90".to_string(),
                v.get("quantiles").and_then(|q| q.get("p90")),
            ),
        ];
        for (name, block) in &blocks {
            let block = block.ok_or_else(|| CostModelError::Missing(name.clone()))?;
            for t in TERM_NAMES {
                match block.get(t) {
                    None | Some(serde_json::Value::Null) => {
                        return Err(CostModelError::Missing(format!("{name}.{t}")))
                    }
                    Some(_) => {}
                }
            }
        }
        let m: CostModel = serde_json::from_value(v)?;
        m.validate()?;
        Ok(m)
    }

    /// Reads and validates a model file.
    pub fn load(path: &Path) -> Result<CostModel, CostModelError> {
        let text = std::fs::read_to_string(path).map_err(|source| CostModelError::Io {
            path: path.display().to_string(),
            source,
        })?;
        Self::from_json_str(&text)
    }

    /// The model as pretty JSON.
    pub fn to_json_string(&self) -> String {
        // Plain structs of numbers and strings always serialise.
        serde_json::to_string_pretty(self).unwrap_or_default()
    }

    /// Validates, then writes the model to `path`.
    pub fn save(&self, path: &Path) -> Result<(), CostModelError> {
        self.validate()?;
        let mut text = self.to_json_string();
        text.push('\n');
        std::fs::write(path, text).map_err(|source| CostModelError::Io {
            path: path.display().to_string(),
            source,
        })
    }

    /// Checks schema and terms.
    pub fn validate(&self) -> Result<(), CostModelError> {
        if self.schema != SCHEMA {
            return Err(CostModelError::BadSchema {
                found: self.schema.clone(),
            });
        }
        self.terms.validate("terms.")?;
        self.quantiles.p50.validate("quantiles.p50.")?;
        self.quantiles.p90.validate("quantiles.p90.")?;
        for (n, v) in [
            ("error.p50_rel", self.error.p50_rel),
            ("error.p90_rel", self.error.p90_rel),
        ] {
            if !v.is_finite() || v < 0.0 {
                return Err(CostModelError::BadValue {
                    name: n.to_string(),
                    value: v,
                    extra: "",
                });
            }
        }
        Ok(())
    }

    /// The term set for `q`.
    pub fn terms_for(&self, q: Quantile) -> &Terms {
        match q {
            Quantile::Mean => &self.terms,
            Quantile::P50 => &self.quantiles.p50,
            Quantile::P90 => &self.quantiles.p90,
        }
    }

    /// Predicted seconds of `decode_sent → first_token` from all the inputs.
    pub fn predict_inputs(&self, x: &Inputs, q: Quantile) -> f64 {
        self.terms_for(q).predict_inputs(x)
    }

    /// Predicted seconds of `decode_sent → first_token` with the source-side inputs at 0 (see
    /// the module docs for the formula).
    pub fn predict(
        &self,
        bytes: u64,
        layers: u32,
        dst_waiting: u32,
        dst_running: u32,
        q: Quantile,
    ) -> f64 {
        self.terms_for(q)
            .predict(bytes, layers, dst_waiting, dst_running)
    }
}

/// The source-side term names, in formula order: optional in a file (absent means 0).
pub const OPTIONAL_TERM_NAMES: [&str; 5] = [
    "prefill_s_per_token",
    "src_s_per_queued_token",
    "src_s_per_running_token",
    "src_s_per_waiting",
    "src_s_per_pending_byte",
];

/// The required term names, in file order.
pub const TERM_NAMES: [&str; 5] = [
    "fixed_s",
    "bytes_per_s",
    "per_layer_tail_s",
    "d_step_s",
    "d_queue_s_per_waiting",
];

/// The seed model the router used before calibration: `0.3 s + bytes / 2.7 GB/s`, blind to
/// layers and to D's load. Kept to compare against.
pub fn seed_predict(bytes: u64) -> f64 {
    0.3 + bytes as f64 / 2.7e9
}
