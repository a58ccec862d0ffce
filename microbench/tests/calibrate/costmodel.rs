//! The cost model file: its formula, its JSON form and the files it refuses.

use kvwire_bench::costmodel::{
    seed_predict, CostModel, CostModelError, ErrorBlock, FittedOn, Inputs, Quantile, Quantiles,
    Terms, SCHEMA,
};

use super::scaled;

fn model() -> CostModel {
    let t = Terms {
        fixed_s: 0.1,
        bytes_per_s: 2e9,
        per_layer_tail_s: 0.001,
        d_step_s: 0.005,
        d_queue_s_per_waiting: 0.3,
        prefill_s_per_token: 0.0,
        src_s_per_queued_token: 0.0,
        src_s_per_running_token: 0.0,
        src_s_per_waiting: 0.0,
        src_s_per_pending_byte: 0.0,
    };
    CostModel {
        schema: SCHEMA.into(),
        transport: "rdma".into(),
        send_mode: None,
        fitted_on: FittedOn {
            records: 10,
            source: "hand".into(),
        },
        terms: t,
        quantiles: Quantiles {
            p50: t,
            p90: scaled(&t, 2.0),
        },
        error: ErrorBlock {
            p50_rel: 0.1,
            p90_rel: 0.4,
            held_out: None,
            p90_coverage: None,
        },
    }
}

#[test]
fn predict_follows_the_documented_formula() {
    let m = model();
    // 0.1 + 4e9/2e9 + 48·0.001 + 0.005·(1+9) + 0.3·2 = 0.1 + 2 + 0.048 + 0.05 + 0.6
    let p = m.predict(4_000_000_000, 48, 2, 9, Quantile::P50);
    assert!((p - 2.798).abs() < 1e-12, "{p}");
    assert!((m.predict(4_000_000_000, 48, 2, 9, Quantile::P90) - 2.0 * 2.798).abs() < 1e-12);
    assert_eq!(m.predict(0, 0, 0, 0, Quantile::Mean), 0.1 + 0.005);
    assert!((seed_predict(2_700_000_000) - 1.3).abs() < 1e-12);
}

#[test]
fn cost_model_json_round_trips_and_rejects_bad_files() {
    let m = model();
    let dir = std::env::temp_dir().join(format!("kvwire-cost-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("tmp dir");
    let path = dir.join("cost.json");
    m.save(&path).expect("save");
    let back = CostModel::load(&path).expect("load");
    assert_eq!(back, m);
    // The DESIGN.md example shape (p50/p90 blocks filled) loads.
    let text = m.to_json_string();
    let v: serde_json::Value = serde_json::from_str(&text).expect("json");
    assert_eq!(v["schema"], SCHEMA);
    assert_eq!(v["terms"]["bytes_per_s"], 2e9);

    let edit = |f: &dyn Fn(&mut serde_json::Value)| {
        let mut v = v.clone();
        f(&mut v);
        CostModel::from_json_str(&v.to_string())
    };
    assert!(matches!(
        edit(&|v| v["schema"] = "kvwire.cost/2".into()),
        Err(CostModelError::BadSchema { .. })
    ));
    match edit(&|v| {
        v["quantiles"]["p90"]
            .as_object_mut()
            .map(|o| o.remove("d_step_s"));
    }) {
        Err(CostModelError::Missing(w)) => assert_eq!(w, "quantiles.p90.d_step_s"),
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        edit(&|v| {
            v.as_object_mut().map(|o| o.remove("terms"));
        }),
        Err(CostModelError::Missing(_))
    ));
    match edit(&|v| v["terms"]["fixed_s"] = (-1.0).into()) {
        Err(CostModelError::BadValue { name, .. }) => assert_eq!(name, "terms.fixed_s"),
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        edit(&|v| v["quantiles"]["p50"]["bytes_per_s"] = 0.0.into()),
        Err(CostModelError::BadValue { .. })
    ));
    assert!(matches!(
        edit(&|v| v["terms"]["d_step_s"] = "fast".into()),
        Err(CostModelError::Json(_))
    ));
    assert!(matches!(
        CostModel::from_json_str("{\"schema\": \"kvwire.cost/1\", \"terms\": NaN}"),
        Err(CostModelError::Json(_))
    ));
    let mut nan = m.clone();
    nan.quantiles.p90.per_layer_tail_s = f64::NAN;
    assert!(matches!(
        nan.save(&dir.join("nan.json")),
        Err(CostModelError::BadValue { .. })
    ));
    let mut inf = m.clone();
    inf.terms.bytes_per_s = f64::INFINITY;
    assert!(matches!(
        inf.validate(),
        Err(CostModelError::BadValue { .. })
    ));
    assert!(matches!(
        CostModel::load(&dir.join("absent.json")),
        Err(CostModelError::Io { .. })
    ));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_model_file_without_source_terms_loads_with_zeros() {
    let mut v: serde_json::Value = serde_json::from_str(&model().to_json_string()).unwrap();
    for block in ["terms"] {
        let o = v[block].as_object_mut().unwrap();
        for k in kvwire_bench::costmodel::OPTIONAL_TERM_NAMES {
            assert!(o.remove(k).is_some(), "{k}");
        }
    }
    for q in ["p50", "p90"] {
        let o = v["quantiles"][q].as_object_mut().unwrap();
        for k in kvwire_bench::costmodel::OPTIONAL_TERM_NAMES {
            o.remove(k);
        }
    }
    let m = CostModel::from_json_str(&v.to_string()).expect("old file loads");
    let x = Inputs {
        bytes: 1 << 30,
        layers: 48,
        dst_waiting: 2,
        dst_running: 9,
        prefill_tokens: 3_000,
        src_waiting: 4,
        src_queued_tokens: 20_000,
        src_running_tokens: 9_000,
        src_pending_bytes: 1 << 33,
    };
    for q in Quantile::ALL {
        assert_eq!(m.terms_for(q).src_s_per_pending_byte, 0.0);
        // Source inputs change nothing; the destination-only prediction is unchanged.
        assert_eq!(m.predict_inputs(&x, q), m.predict(1 << 30, 48, 2, 9, q));
    }
    // A negative source term is refused with its name.
    let mut bad = v.clone();
    bad["quantiles"]["p90"]["src_s_per_waiting"] = serde_json::json!(-1.0);
    let e = CostModel::from_json_str(&bad.to_string()).unwrap_err();
    assert!(
        e.to_string().contains("quantiles.p90.src_s_per_waiting"),
        "{e}"
    );
}
