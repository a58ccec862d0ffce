//! The cost model fitted on the A/B's own servers: the P/D arms' production timelines (the
//! connectors' records under `pd/timelines`, the proxy's router records under each arm's
//! directory), joined and fitted as `kvwire-bench calibrate --timeline` does, so that a run on
//! a cluster (`--model`) leaves a `cost.json` calibrated on that cluster's servers.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use serde_json::{json, Value};

use crate::calibrate::{
    calibrate, production_files, read_production_files, CalibrateOptions, ProductionOptions,
};

/// What the fit left: `cost.json` and `calibration.txt` written into `out`, and the summary
/// that goes into `ab.json`.
pub struct Fitted {
    /// The `calibration` object of `ab.json`.
    pub summary: Value,
    /// A few lines for `ab.md`.
    pub markdown: String,
}

/// The timeline and router files of the P/D arms under `out/pd` (the warm-up's router records,
/// under `pd/warmup`, are not among them); `None` when no P/D arm ran.
fn inputs(out: &Path) -> Result<Option<Vec<PathBuf>>, String> {
    let pd = out.join("pd");
    let timelines = pd.join("timelines");
    if !timelines.is_dir() {
        return Ok(None);
    }
    let io = |p: &Path, e: std::io::Error| format!("{}: {e}", p.display());
    let mut files = production_files(&timelines).map_err(|e| io(&timelines, e))?;
    let mut arms: Vec<PathBuf> = std::fs::read_dir(&pd)
        .map_err(|e| io(&pd, e))?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| {
            p.is_dir()
                && p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with("pd-"))
        })
        .collect();
    arms.sort();
    for arm in arms {
        let routers = production_files(&arm).map_err(|e| io(&arm, e))?;
        files.extend(routers.into_iter().filter(|f| is_router(f)));
    }
    Ok(Some(files))
}

fn is_router(f: &Path) -> bool {
    f.file_name()
        .and_then(|n| n.to_str())
        .is_some_and(|n| n.starts_with("router"))
}

/// The transfer ids of the router records in `files`.
fn transfer_ids(files: &[PathBuf]) -> Result<HashSet<String>, String> {
    let mut ids = HashSet::new();
    for f in files {
        let text = std::fs::read_to_string(f).map_err(|e| format!("{}: {e}", f.display()))?;
        for line in text.lines().filter(|l| !l.trim().is_empty()) {
            let v: Value =
                serde_json::from_str(line).map_err(|e| format!("{}: {e}", f.display()))?;
            if let Some(id) = v.get("transfer_id").and_then(Value::as_str) {
                ids.insert(id.to_string());
            }
        }
    }
    Ok(ids)
}

/// Fits the P/D arms' records under `out` (see the module docs). `Ok(None)`: no P/D arm ran;
/// `Err`: the records could not be read or fitted (said in `ab.json` and `ab.md`).
pub fn fit(out: &Path) -> Result<Option<Fitted>, String> {
    let Some(files) = inputs(out)? else {
        return Ok(None);
    };
    let popts = ProductionOptions::default();
    let routers: Vec<PathBuf> = files.iter().filter(|f| is_router(f)).cloned().collect();
    let arms = transfer_ids(&routers)?;
    let mut p = read_production_files(files, &popts).map_err(|e| e.to_string())?;
    // The arms' requests only: the warm-up's (first dials, first steps) are not measured.
    p.timeline.samples.retain(|s| arms.contains(&s.id));
    let opts = CalibrateOptions {
        source: format!("kvwire-bench ab: {}", out.join("pd").display()),
        ..CalibrateOptions::default()
    };
    let c = calibrate(&p.timeline.samples, &opts).map_err(|e| e.to_string())?;
    let model = out.join("cost.json");
    c.model.save(&model).map_err(|e| e.to_string())?;
    let text = format!("{}\n{}", p.summary(popts.max_clock_error_ns), c.table());
    std::fs::write(out.join("calibration.txt"), &text)
        .map_err(|e| format!("{}: {e}", out.join("calibration.txt").display()))?;
    let rel = |r: &crate::calibrate::RelError| json!({"p50": r.p50, "p90": r.p90});
    let summary = json!({
        "records": p.timeline.samples.len(),
        "joined": p.joined,
        "router_matched": p.router_joined,
        "train": c.train_ids.len(),
        "held_out": c.held_out_ids.len(),
        "calibrated_p50_rel": rel(&c.p50),
        "seed_rel": rel(&c.seed),
        "p90_coverage": c.p90_coverage,
        "model": "cost.json",
        "table": "calibration.txt",
    });
    let markdown = format!(
        "Cost model fitted on these P/D arms' timelines ({} records, the arms' requests; of all \
         the D records {} joined with P's, {} with the router's; {} held out): held-out |pred − actual| / actual p50 {:.2}, p90 {:.2} \
         (seed model `0.3 s + bytes / 2.7 GB/s`: {:.2}, {:.2}); p90 prediction covers {:.0}% of \
         held-out clocks. `cost.json`, the full table in `calibration.txt`.\n",
        p.timeline.samples.len(),
        p.joined,
        p.router_joined,
        c.held_out_ids.len(),
        c.p50.p50,
        c.p50.p90,
        c.seed.p50,
        c.seed.p90,
        c.p90_coverage * 100.0
    );
    Ok(Some(Fitted { summary, markdown }))
}
