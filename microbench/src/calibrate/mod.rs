//! Fits the router cost model ([`crate::costmodel`]) from timeline records and measures its
//! error on records it was not fitted on.
//!
//! Input: JSON lines, one record per request, as written by the connector core
//! (`kvwire_connector::timeline::TimelineRecord::to_json_line`: the clock bench, the simulator)
//! or by anything else with the same field names; or a directory of production timelines (the
//! vLLM connector's P and D records and the router's, [`read_production`]): P's and D's records
//! of one request are joined onto D's clock first, then fitted like the rest. Per line the fit
//! needs `decode_sent` and `first_token` (nanoseconds), `bytes` and `layers`; the request id is
//! `req` (a number or a string; `request_id` and `id` are accepted too). The D-side load at
//! `decode_sent`, `dst_waiting` and `dst_running`, is optional: the core's records do not carry
//! it (the host knows its scheduler's queues, the core does not; the vLLM connector's
//! production records add them), so a record without it counts as an idle destination and the
//! load terms are only fitted where the records carry varying load (see
//! [`Calibration::notes`]). The same holds for the source side: what a router knows of the
//! prefill engine at `decode_sent` (`prefill_tokens`, the request's own tokens P still computes
//! — or `tokens − cached_tokens` when only those are given —, `src_waiting`,
//! `src_queued_tokens`, `src_running_tokens`, `src_pending_bytes`, see
//! [`crate::costmodel::Inputs`]); absent fields count as 0. `send_mode`, `policy` and
//! `scenario` are read when present, to report the held-out error per group
//! ([`Calibration::groups`]).
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
//!
//! Where things are: `records` (a line into a [`Sample`]), `production` (directories of P, D
//! and router records, joined), `error`, `split`, `nnls` (Lawson–Hanson), `fit` (the design and
//! its mean, p50 and quantile solutions), `calibration` ([`calibrate`]), `stats`, `table` (what
//! the CLI prints), `grid` (`--predict-grid`), `cli`.

mod calibration;
mod cli;
mod error;
mod fit;
mod grid;
mod nnls;
mod production;
mod records;
mod split;
mod stats;
mod table;

pub use calibration::{calibrate, CalibrateOptions, Calibration};
pub use cli::{run_cli, CalibrateArgs};
pub use error::{BadLines, CalibrateError, LineError};
pub use fit::NO_SOURCE_NOTE;
pub use grid::{grid_inputs, predict_grid};
pub use production::{
    production_files, read_production, read_production_files, BadLine, Production,
    ProductionOptions,
};
pub use records::{parse_timeline, read_timeline, Sample, Timeline, SEGMENTS};
pub use split::{is_train, split, MIN_HELD_OUT, MIN_TRAIN, TRAIN_PERCENT};
pub use stats::{quantile, rel_error, segment_stats, GroupError, RelError, SegmentStat};
