//! The connector cores' metrics as Python dicts (`DCore.metrics(now)`, `PCore.metrics()`).

use kvwire_connector::metrics::{
    bucket_le_seconds, fail_reason_name, DECOMPOSITION_PARTS, D_STATES, FAIL_REASONS, HIST_BUCKETS,
};
use kvwire_connector::{DGauges, DMetrics, Histogram, PMetrics};
use pyo3::prelude::*;
use pyo3::types::PyDict;

/// Upper bounds (s) of the connector histogram buckets, the last `inf`.
pub fn bucket_bounds() -> Vec<f64> {
    (0..HIST_BUCKETS).map(bucket_le_seconds).collect()
}

fn hist<'py>(py: Python<'py>, h: &Histogram) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("buckets", h.buckets.to_vec())?;
    d.set_item("sum_seconds", h.sum_ns as f64 / 1e9)?;
    d.set_item("count", h.count)?;
    Ok(d)
}

fn failed<'py>(py: Python<'py>, f: &[u64; 7]) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    for (r, n) in FAIL_REASONS.iter().zip(f) {
        d.set_item(fail_reason_name(*r), *n)?;
    }
    Ok(d)
}

/// A D core's counters and gauges.
pub fn d_dict<'py>(py: Python<'py>, m: &DMetrics, g: &DGauges) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("policy", m.policy.name())?;
    for (k, v) in [
        ("arrived", m.arrived),
        ("reservations", m.reservations),
        ("reserved_blocks", m.reserved_blocks),
        ("releases", m.releases),
        ("released_blocks", m.released_blocks),
        ("completed", m.completed),
        ("landings", m.landings),
        ("land_fallbacks", m.land_fallbacks),
        ("promoted", m.promoted),
        ("first_tokens", m.first_tokens),
        ("aborted", m.aborted()),
        ("bytes_received", m.bytes_received),
        ("held_blocks", g.held_blocks),
        ("landing_slots", g.landing_slots),
    ] {
        d.set_item(k, v)?;
    }
    d.set_item("failed", failed(py, &m.failed)?)?;
    d.set_item("block_seconds_waiting", m.block_seconds_waiting())?;
    d.set_item("held_block_seconds", g.held_block_ns as f64 / 1e9)?;
    let states = PyDict::new(py);
    for (s, n) in D_STATES.iter().zip(g.by_state()) {
        states.set_item(*s, n)?;
    }
    d.set_item("states", states)?;
    let parts = PyDict::new(py);
    for (name, h) in DECOMPOSITION_PARTS.iter().zip(&m.decomposition) {
        parts.set_item(*name, hist(py, h)?)?;
    }
    d.set_item("decomposition", parts)?;
    Ok(d)
}

/// A P core's counters.
pub fn p_dict<'py>(py: Python<'py>, m: &PMetrics) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    for (k, v) in [
        ("scheduled", m.scheduled),
        ("transfers", m.transfers),
        ("transfers_done", m.transfers_done),
        ("transfers_failed", m.transfers_failed),
        ("bytes_sent", m.bytes_sent),
        ("completed", m.completed),
        ("aborted", m.aborted()),
        ("releases", m.releases),
        ("released_blocks", m.released_blocks),
    ] {
        d.set_item(k, v)?;
    }
    d.set_item("failed", failed(py, &m.failed)?)?;
    d.set_item("send_latency", hist(py, &m.send_latency)?)?;
    Ok(d)
}
