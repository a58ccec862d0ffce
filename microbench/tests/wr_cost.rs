//! `kvwire-bench wr-cost` on the loopback device: every row present with its figures, the
//! verified batch passed (the command fails otherwise), and the completion counts follow the
//! signalling interval (every work request completes when each is signalled; fewer when one in
//! 16 is); the scatter-gather rows post one work request per block without gathering and one
//! per 16 blocks with it.

use std::process::Command;

#[test]
fn wr_cost_reports_every_row_and_completions_follow_the_signalling() {
    let dir = std::env::temp_dir().join(format!("kvwire-wr-cost-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let json = dir.join("wr.json");
    let out = Command::new(env!("CARGO_BIN_EXE_kvwire-bench"))
        .args([
            "wr-cost", "--rounds", "3", "--wrs", "64", "--slices", "4K,64K", "--blocks", "16K",
        ])
        .args(["--signal-every", "1,16", "--json"])
        .arg(&json)
        .output()
        .expect("run kvwire-bench wr-cost");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "wr-cost failed: {stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("| slice | signal 1 in |"), "{stdout}");
    let doc: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&json).expect("json written")).expect("json");
    let rows = doc["rows"].as_array().expect("rows");
    assert_eq!(rows.len(), 4, "2 slices x 2 signalling intervals");
    for r in rows {
        assert_eq!(r["wrs"], 3 * 64, "{r}");
        for k in [
            "post_ns_per_wr",
            "completion_ns_per_wr",
            "verbs_floor_ns_per_wr",
        ] {
            assert!(r[k].as_f64().is_some_and(|x| x > 0.0), "{k} in {r}");
        }
        let c = r["completions_per_wr"]
            .as_f64()
            .expect("completions_per_wr");
        match r["signal_every"].as_u64() {
            Some(1) => assert_eq!(c, 1.0, "every work request signalled: {r}"),
            Some(16) => assert!(c > 0.0 && c < 0.5, "one in 16 signalled: {r}"),
            other => panic!("unexpected signal_every {other:?}"),
        }
    }
    let gathered = doc["gather_rows"].as_array().expect("gather_rows");
    assert_eq!(
        gathered.len(),
        2,
        "one block size, without and with gathering"
    );
    assert_eq!(gathered[0]["max_sge"], 1, "{}", gathered[0]);
    assert_eq!(
        gathered[0]["wrs_per_batch"], 64.0,
        "one WR per block: {}",
        gathered[0]
    );
    assert!(gathered[1]["max_sge"].is_null(), "{}", gathered[1]);
    assert_eq!(
        gathered[1]["wrs_per_batch"], 4.0,
        "16 blocks per WR: {}",
        gathered[1]
    );
    for r in gathered {
        assert_eq!(r["blocks"], 3 * 64, "{r}");
        assert!(
            r["engine_ns_per_block"].as_f64().is_some_and(|x| x > 0.0),
            "{r}"
        );
    }
    assert!(
        gathered[1]["engine_vs_single"].as_f64().is_some(),
        "{}",
        gathered[1]
    );
    assert!(stdout.contains("| block | pieces per WR |"), "{stdout}");
    let _ = std::fs::remove_dir_all(&dir);
}
