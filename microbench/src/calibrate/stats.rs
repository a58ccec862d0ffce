//! Statistics of the fit's error and of the clock: quantiles, relative errors, segments.

use super::records::{Sample, SEGMENTS};

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
