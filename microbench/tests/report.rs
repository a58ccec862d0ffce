//! `kvwire-bench report --quick --no-vllm`: every file is written and carries what it must
//! (contents checked, not only existence); the vLLM step (ab) says it was skipped. The vLLM
//! parts run in the e2e stage (tests/e2e/test_ab.py runs `kvwire-bench ab --quick`).

use std::path::Path;
use std::process::Command;

fn json(path: &Path) -> serde_json::Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

#[test]
fn report_writes_every_file_with_its_contents() {
    let out = std::env::temp_dir().join(format!("kvwire-report-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let st = Command::new(env!("CARGO_BIN_EXE_kvwire-bench"))
        .args(["report", "--quick", "--no-vllm", "--out"])
        .arg(&out)
        .status()
        .expect("run kvwire-bench report");
    assert!(st.success(), "report exited with {st}");

    let md = std::fs::read_to_string(out.join("report.md")).expect("report.md");
    for section in [
        "## transfer",
        "## layerwise",
        "## clock",
        "## calibrate",
        "## kv_both tax",
    ] {
        assert!(md.contains(section), "report.md lacks {section}");
    }
    assert!(!md.contains("FAILED"), "a step failed:\n{md}");
    assert!(
        md.contains("## ab\n\nSKIPPED: it runs vLLM servers"),
        "the ab step is not said to be skipped:\n{md}"
    );
    assert!(!md.contains(": missing"), "a file is missing:\n{md}");

    let t = json(&out.join("transfer.json"));
    assert_eq!(t["engine"], "kvwire");
    let results = t["results"].as_array().expect("transfer results");
    assert!(!results.is_empty());
    for r in results {
        assert_eq!(r["verified"], true, "unverified result {r}");
    }
    for pattern in ["serial", "batch", "kv_layer"] {
        assert!(
            results.iter().any(|r| r["pattern"] == pattern),
            "transfer.json lacks {pattern}"
        );
    }

    let lw = json(&out.join("layerwise.json"));
    assert!(lw.is_object() && !lw.as_object().is_some_and(|o| o.is_empty()));

    let clock = json(&out.join("clock.json"));
    let text = clock.to_string();
    for cell in ["eager", "lazy", "jit", "whole", "layerwise"] {
        assert!(text.contains(cell), "clock.json lacks {cell}");
    }

    let png = std::fs::read(out.join("clock.png")).expect("clock.png");
    assert!(png.len() > 1000 && png.starts_with(b"\x89PNG\r\n\x1a\n"));

    let timeline = std::fs::read_to_string(out.join("timeline.jsonl")).expect("timeline");
    let mut n = 0;
    for line in timeline.lines().filter(|l| !l.trim().is_empty()) {
        let v: serde_json::Value = serde_json::from_str(line).expect("timeline line is JSON");
        assert!(
            v.get("decode_sent").is_some(),
            "record without decode_sent: {line}"
        );
        n += 1;
    }
    assert!(n > 0, "empty timeline");

    let cost = json(&out.join("cost.json"));
    assert_eq!(cost["schema"], "kvwire.cost/1");
    assert!(cost["terms"]["fixed_s"].is_number());
    assert!(cost["error"]["p50_rel"].is_number());
    // The kv_both tax: the Rust parts always, the vLLM parts measured or SKIPPED (said so), the
    // block pool read from clock.json (or "not measured" when the clock has no pool figures).
    let tax = json(&out.join("tax.json"));
    assert_eq!(tax["schema"], "kvwire.tax/1");
    assert_eq!(tax["core"]["results"].as_array().map(Vec::len), Some(8));
    assert!(tax["engine_idle"]["threads"].as_u64().unwrap_or(0) > 0);
    for v in tax["vllm"].as_array().expect("tax vllm") {
        assert!(v["status"] == "ok" || v["status"] == "SKIPPED", "{v}");
    }
    if tax["vllm"].as_array().is_some_and(Vec::is_empty) {
        assert!(
            md.contains("SKIPPED"),
            "vLLM parts neither run nor SKIPPED:\n{md}"
        );
    }
    let pool = &tax["pool"];
    assert!(pool["status"] == "measured" || pool["status"] == "not measured");
    assert!(md.contains("Block pool"), "{md}");
    assert!(md.contains("Connector core, per step"), "{md}");
    let _ = std::fs::remove_dir_all(&out);
}
