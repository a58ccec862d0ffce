//! The design matrix of the fit and its solutions: mean terms (reweighted least squares), the
//! p50 terms (minimum mean relative error) and quantile terms (check loss), all non-negative.

use crate::costmodel::{Terms, MAX_BYTES_PER_S};

use super::nnls::{nnls, NF};
use super::records::Sample;

/// Iterations of the reweighted quantile fit.
pub(super) const QUANTILE_ITERS: usize = 200;
/// Rounds of reweighting in the mean fit.
pub(super) const MEAN_ROUNDS: usize = 4;
/// Smallest prediction used as a weight, as a fraction of the mean clock.
pub(super) const PRED_FLOOR: f64 = 1e-3;
/// Smallest |residual| the quantile reweighting divides by, as a fraction of the mean clock.
pub(super) const QUANTILE_EPS: f64 = 1e-5;

/// Index of the first source-side feature.
pub(super) const FIRST_SRC: usize = 5;

/// Start of the note given when no record carries a source-side field.
pub const NO_SOURCE_NOTE: &str = "no record carries prefill_tokens or src_* fields";

/// Names of the fitted terms in feature order.
pub(super) const NAMES: [&str; NF] = [
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
pub(super) const WHAT: [&str; NF] = [
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

pub(super) fn features(s: &Sample) -> [f64; NF] {
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

/// The design: row `i` is `features_i` scaled per column to unit RMS, target the clock in
/// seconds.
pub(super) struct Design {
    rows: Vec<[f64; NF]>,
    targets: Vec<f64>,
    col_scale: [f64; NF],
    pub(super) allowed: [bool; NF],
    /// Smallest |residual| (seconds) the quantile reweighting divides by.
    eps: f64,
}

impl Design {
    pub(super) fn new(train: &[Sample]) -> Design {
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
    pub(super) fn mean_fit(&self) -> [f64; NF] {
        let mut x = self.solve_weighted(&vec![1.0; self.rows.len()]);
        for _ in 0..MEAN_ROUNDS {
            let w: Vec<f64> = self.predictions(&x).iter().map(|p| 1.0 / (p * p)).collect();
            x = self.solve_weighted(&w);
        }
        x
    }

    /// Check-loss fit of the `tau` quantile, each record weighted by `1 / pred_mean` (inputs
    /// only, as above), by iteratively reweighted NNLS started from the mean terms.
    pub(super) fn quantile_fit(&self, tau: f64, mean: [f64; NF]) -> [f64; NF] {
        let base: Vec<f64> = self.predictions(&mean).iter().map(|p| 1.0 / p).collect();
        self.check_loss_fit(tau, &base, mean)
    }

    /// The p50 terms: minimum of the mean relative error `Σ |pred − actual| / actual` over the
    /// training records, i.e. the check loss at 0.5 with each record weighted by `1 / actual`
    /// (a median of the clock where short clocks count as much as long ones), by iteratively
    /// reweighted NNLS started from `start`.
    pub(super) fn relative_l1_fit(&self, start: [f64; NF]) -> [f64; NF] {
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

    pub(super) fn terms(&self, x: &[f64; NF]) -> Terms {
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
