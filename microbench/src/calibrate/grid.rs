//! The model's predictions over a fixed input grid, for cross-language checks.

use crate::costmodel::{CostModel, Inputs, Quantile};

/// The grid of inputs `--predict-grid` evaluates: every (bytes, layers, dst_waiting,
/// dst_running) of a fixed grid, each with source-side inputs taken in turn from their own
/// lists (the first case has them all 0).
pub fn grid_inputs() -> Vec<Inputs> {
    let bytes = [
        0u64,
        1,
        16 * 1024,
        1 << 20,
        805_306_368,
        4_915_200_000,
        (1u64 << 53) + 1,
    ];
    let layers = [0u32, 1, 48, 80];
    let waiting = [0u32, 3, 1000];
    let running = [0u32, 7, 256];
    let prefill = [0u64, 1, 3_000, 50_000, (1u64 << 40) + 3];
    let src_waiting = [0u32, 2, 17, u32::MAX];
    let src_queued = [0u64, 12_345, 1_000_000];
    let src_running = [0u64, 16_384];
    let src_pending = [0u64, 805_306_368, 7_000_000_000_000];
    let mut v = Vec::new();
    for &b in &bytes {
        for &l in &layers {
            for &w in &waiting {
                for &r in &running {
                    let i = v.len();
                    v.push(Inputs {
                        bytes: b,
                        layers: l,
                        dst_waiting: w,
                        dst_running: r,
                        prefill_tokens: prefill[i % prefill.len()],
                        src_waiting: src_waiting[(i / 2) % src_waiting.len()],
                        src_queued_tokens: src_queued[(i / 3) % src_queued.len()],
                        src_running_tokens: src_running[(i / 5) % src_running.len()],
                        src_pending_bytes: src_pending[(i / 7) % src_pending.len()],
                    });
                }
            }
        }
    }
    v
}

/// The model's predictions on [`grid_inputs`] for every quantile, as JSON:
/// `{"model": {...}, "cases": [{"bytes", "layers", "dst_waiting", "dst_running",
/// "prefill_tokens", "src_waiting", "src_queued_tokens", "src_running_tokens",
/// "src_pending_bytes", "quantile",
/// "seconds"}]}`. Cross-language tests compare other implementations of the formula with it.
pub fn predict_grid(model: &CostModel) -> serde_json::Value {
    let mut cases = Vec::new();
    for x in grid_inputs() {
        for q in Quantile::ALL {
            cases.push(serde_json::json!({
                "bytes": x.bytes, "layers": x.layers, "dst_waiting": x.dst_waiting,
                "dst_running": x.dst_running, "prefill_tokens": x.prefill_tokens,
                "src_waiting": x.src_waiting, "src_queued_tokens": x.src_queued_tokens,
                "src_running_tokens": x.src_running_tokens,
                "src_pending_bytes": x.src_pending_bytes,
                "quantile": q.name(), "seconds": model.predict_inputs(&x, q),
            }));
        }
    }
    serde_json::json!({ "model": model, "cases": cases })
}
