//! `ab.png` from an `ab.json` (a `kvwire-bench ab --quick` document kept as a fixture).

use kvwire_bench::ab::render_png;

fn fixture() -> serde_json::Value {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/data/ab_quick.json"
    ))
    .expect("fixture");
    serde_json::from_str(&text).expect("fixture is JSON")
}

#[test]
fn figure_is_drawn_from_ab_json() {
    let out = std::env::temp_dir().join(format!("kvwire-ab-plot-{}.png", std::process::id()));
    render_png(&fixture(), &out).expect("render");
    let png = std::fs::read(&out).expect("png written");
    assert!(
        png.starts_with(b"\x89PNG\r\n\x1a\n") && png.len() > 10_000,
        "{} bytes",
        png.len()
    );
    let _ = std::fs::remove_file(&out);
}

#[test]
fn no_arm_that_ran_is_an_error_not_an_empty_figure() {
    let mut doc = fixture();
    for arm in doc["arms"].as_array_mut().expect("arms") {
        arm["status"] = "failed to start".into();
    }
    let out = std::env::temp_dir().join(format!("kvwire-ab-plot-none-{}.png", std::process::id()));
    let err = render_png(&doc, &out).expect_err("nothing to draw");
    assert!(err.to_string().contains("no arm ran"), "{err}");
}
