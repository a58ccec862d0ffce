"""``kvwire-bench ab --quick`` as a user runs it: real ``vllm serve`` processes per arm (CPU,
stand-in model), one trace replayed against every arm; ab.json carries every figure of every
arm, every output equals the single instance's, and ab.png is drawn."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import warnings

import pytest

ARMS = ["single", "kv_both-mooncake", "kv_both-kvwire"] + [
    f"pd-{p}-{m}" for p in ("eager", "lazy", "jit", "land") for m in ("whole", "layerwise")]
SEGMENTS = {"wait_for_p", "reservation_wait", "exposed_transfer", "report_delay", "promotion_delay", "first_step"}


def test_ab_quick_runs_every_arm():
    bench = os.environ.get("KVWIRE_BENCH_BIN")
    if not bench or not os.path.exists(bench):
        pytest.fail(f"KVWIRE_BENCH_BIN={bench!r}: no kvwire-bench binary (tests/e2e/run.sh builds one)")
    out = tempfile.mkdtemp(prefix="kvwire-ab-")
    r = subprocess.run([bench, "ab", "--quick", "--python", sys.executable, "--out", out],
                       capture_output=True, text=True, timeout=1500)
    print(r.stdout)
    assert r.returncode == 0, r.stdout + r.stderr[-5000:]
    with open(os.path.join(out, "ab.json")) as f:
        ab = json.load(f)
    assert ab["schema"] == "kvwire.ab/1" and ab["requests"] == 12
    by = {a["arm"]: a for a in ab["arms"]}
    warned = set()
    assert sorted(by) == sorted(ARMS)
    for name, a in by.items():
        assert a["status"] == "ran", (name, a.get("error"))
        o = a["replay"]["overall"]
        assert o["requests"] == 12 and o["errors"] == 0, (name, a["replay"]["error_samples"])
        for m in ("ttft_s", "tpot_s", "e2e_s"):
            assert set(o[m]) == {"p50", "p90", "p99"}
        assert o["ttft_s"]["p50"] > 0 and o["e2e_s"]["p99"] >= o["e2e_s"]["p50"]
        assert a["outputs_equal_single"] == {"equal": 12, "of": 12, "reference": True}, name
        # The warm-up absorbs a fresh pair's one-off costs (first dials, first steps): its
        # errors are reported (here, loudly) and the arms' requests, which follow it, must all pass.
        assert a["warmup"]["requests"] == 2, a["warmup"]
        if a["warmup"]["errors"] and a["group"] not in warned:
            warned.add(a["group"])
            warnings.warn(f"{a['group']} warm-up: {a['warmup']['errors']} errors: {a['warmup']['error_samples']}")
        # What the arm cost its servers: every thread's CPU, and busy steps from the stand-in
        # (a decoding server has back-to-back busy steps; P, prefilling one request at a time,
        # may have none).
        assert set(a["engine"]) == ({"p", "d"} if a["group"] == "pd" else {"main"}), a["engine"].keys()
        for srv, e in a["engine"].items():
            assert e["cpu"]["total_s"] > 0 and e["cpu"]["threads"] > 1, (name, srv, e["cpu"])
            if srv != "p":
                st = e["steps"]
                assert st and st["count"] > 0 and st["p90_s"] >= st["p50_s"] > 0, (name, srv, st)
        if a["group"] != "pd":
            continue
        t = a["timeline"]
        assert t["timeline_records"] == 12 and t["missing_records"] == 0 and t["failed"] == 0, (name, t)
        assert set(t["decomposition_mean_s"]) == SEGMENTS
        assert t["clock_s"]["p50"] > 0 and t["clock_s"]["p90"] >= t["clock_s"]["p50"]
        assert set(t["exposed_tail_s"]) == {"p50", "p90"}
        assert t["d_block_seconds"] >= 0 and t["wire_bytes"] > 0
        assert t["reset_prefix_cache"] is True
        assert all(isinstance(v, float) and v >= 0 for v in t["decomposition_mean_s"].values()), t
    # The cost model fitted on the P/D arms' own timelines (8 arms × 12 requests, P and D joined;
    # the warm-up's requests are not among them).
    cal = ab["calibration"]
    assert "error" not in cal, cal
    assert cal["records"] == 96 and cal["joined"] >= 96 and cal["router_matched"] == 96, cal
    assert cal["train"] + cal["held_out"] == 96 and cal["held_out"] >= 2, cal
    assert cal["calibrated_p50_rel"]["p90"] >= cal["calibrated_p50_rel"]["p50"] >= 0, cal
    with open(os.path.join(out, "cost.json")) as f:
        assert json.load(f)["schema"] == "kvwire.cost/1"
    with open(os.path.join(out, "ab.md")) as f:
        md = f.read()
    assert "Cost model fitted on these P/D arms' timelines (96 records" in md
    assert all(name in md for name in ARMS)
    with open(os.path.join(out, "ab.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
