//! A calibration: the model fitted on the training part and measured on the held-out part.

use crate::costmodel::{seed_predict, CostModel, ErrorBlock, FittedOn, Quantiles, Terms, SCHEMA};

use super::error::CalibrateError;
use super::fit::{Design, FIRST_SRC, NAMES, NO_SOURCE_NOTE, WHAT};
use super::nnls::NF;
use super::records::Sample;
use super::split::{split, MIN_HELD_OUT, MIN_TRAIN};
use super::stats::{rel_error, segment_stats, GroupError, RelError, SegmentStat};

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
            need_train: MIN_TRAIN,
            need_held_out: MIN_HELD_OUT,
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
