//! The comparison table `kvwire-bench calibrate` prints.

use super::calibration::Calibration;
use super::stats::RelError;

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
