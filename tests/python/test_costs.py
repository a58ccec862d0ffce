"""kvwire.costs (pure Python) against the Rust cost model (kvwire-bench calibrate).

The expectations come from Rust: the test writes a model file, asks
``kvwire-bench calibrate --model M --predict-grid G`` for the Rust predictions over a fixed grid
of inputs, and checks the Python predictions agree to 1e-9 relative. A second case fits a model
in Rust from a synthetic timeline (``--timeline T --out M --predict-grid G``) and checks Python
loads the file Rust wrote and predicts the same.

The Rust binary: ``$KVWIRE_BENCH_BIN`` if set, otherwise ``cargo run -q -p kvwire-bench`` in the
repository (built on first use; ``$CARGO_TARGET_DIR`` is honoured). Without cargo the cross-language
tests print SKIPPED and skip, or fail when ``KVWIRE_REQUIRE_CARGO=1``.

Only the standard library and pytest are needed: ``costs.py`` is loaded from its file, so the
compiled extension does not have to be built.
"""

import importlib.util
import json
import math
import os
import random
import shutil
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.normpath(os.path.join(HERE, "..", ".."))
COSTS_PY = os.path.join(REPO, "ffi", "python", "kvwire", "costs.py")


def _load_costs():
    spec = importlib.util.spec_from_file_location("kvwire_costs_under_test", COSTS_PY)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


costs = _load_costs()


def _terms(k, source=True):
    t = {
        "fixed_s": 0.1234567 * k,
        "bytes_per_s": 2.7e9 / k,
        "per_layer_tail_s": 0.00123 * k,
        "d_step_s": 0.0045678 * k,
        "d_queue_s_per_waiting": 0.333 * k,
    }
    if source:
        t.update(
            {
                "prefill_s_per_token": 8.1e-5 * k,
                "src_s_per_queued_token": 7.7e-5 * k,
                "src_s_per_running_token": 3.9e-5 * k,
                "src_s_per_waiting": 0.0051 * k,
                "src_s_per_pending_byte": 1.3e-10 * k,
            }
        )
    return t


def _model_dict(source=True):
    return {
        "schema": "kvwire.cost/1",
        "transport": "rdma",
        "fitted_on": {"records": 7, "source": "test_costs.py"},
        "terms": _terms(1.0, source),
        "quantiles": {"p50": _terms(0.97, source), "p90": _terms(1.9, source)},
        "error": {"p50_rel": 0.05, "p90_rel": 0.2},
    }


def _rust_cmd():
    exe = os.environ.get("KVWIRE_BENCH_BIN")
    if exe:
        return [exe]
    cargo = shutil.which("cargo")
    if cargo is None:
        msg = "SKIPPED: cargo not found and KVWIRE_BENCH_BIN not set: no Rust predictions to compare"
        print(msg, file=sys.stderr)
        if os.environ.get("KVWIRE_REQUIRE_CARGO") == "1":
            pytest.fail(msg + " (KVWIRE_REQUIRE_CARGO=1)")
        pytest.skip(msg)
    return [cargo, "run", "-q", "-p", "kvwire-bench", "--bin", "kvwire-bench", "--"]


def _run_rust(args):
    cmd = _rust_cmd() + ["calibrate"] + args
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1800)
    assert p.returncode == 0, f"{cmd} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}"
    return p.stdout


def _rel(a, b):
    if a == b:
        return 0.0
    return abs(a - b) / max(abs(a), abs(b))


def _check_grid(model, grid):
    cases = grid["cases"]
    # 7 sizes x 4 layer counts x 3 waiting x 3 running x 3 quantiles.
    assert len(cases) == 7 * 4 * 3 * 3 * 3
    worst = 0.0
    for c in cases:
        got = model.predict(
            bytes=c["bytes"],
            layers=c["layers"],
            dst_waiting=c["dst_waiting"],
            dst_running=c["dst_running"],
            prefill_tokens=c["prefill_tokens"],
            src_waiting=c["src_waiting"],
            src_queued_tokens=c["src_queued_tokens"],
            src_running_tokens=c["src_running_tokens"],
            src_pending_bytes=c["src_pending_bytes"],
            quantile=c["quantile"],
        )
        want = c["seconds"]
        assert math.isfinite(want) and want >= 0.0
        r = _rel(got, want)
        worst = max(worst, r)
        assert r <= 1e-9, f"{c}: python {got!r} vs rust {want!r}"
    # The grid exercises the source-side inputs, not only zeros.
    assert any(c["prefill_tokens"] > 0 for c in cases)
    assert any(c["src_waiting"] > 0 and c["src_queued_tokens"] > 0 for c in cases)
    assert any(c["src_running_tokens"] > 0 for c in cases)
    assert any(c["src_pending_bytes"] > 0 for c in cases)
    return worst


def test_python_matches_rust_on_a_model_without_source_terms(tmp_path):
    """A file written before the source-side terms existed loads in both and predicts the same;
    its source terms are 0."""
    mpath = tmp_path / "old.json"
    gpath = tmp_path / "grid.json"
    mpath.write_text(json.dumps(_model_dict(source=False)))
    _run_rust(["--model", str(mpath), "--predict-grid", str(gpath)])
    grid = json.loads(gpath.read_text())
    assert grid["model"]["terms"]["src_s_per_waiting"] == 0.0
    m = costs.CostModel.load(str(mpath))
    assert m.terms["p90"].prefill_s_per_token == 0.0
    _check_grid(m, grid)
    # Source inputs change nothing for such a model.
    a = m.predict(bytes=10**9, layers=8, dst_waiting=1, dst_running=3)
    b = m.predict(bytes=10**9, layers=8, dst_waiting=1, dst_running=3, prefill_tokens=5000, src_waiting=4,
                  src_queued_tokens=20000, src_running_tokens=16000, src_pending_bytes=10**9)
    assert a == b


def test_python_matches_rust_on_a_hand_written_model(tmp_path):
    mpath = tmp_path / "model.json"
    gpath = tmp_path / "grid.json"
    mpath.write_text(json.dumps(_model_dict()))
    _run_rust(["--model", str(mpath), "--predict-grid", str(gpath)])
    grid = json.loads(gpath.read_text())
    # Rust read the same terms we wrote.
    assert grid["model"]["quantiles"]["p90"]["d_queue_s_per_waiting"] == _terms(1.9)["d_queue_s_per_waiting"]
    assert grid["model"]["quantiles"]["p90"]["src_s_per_queued_token"] == _terms(1.9)["src_s_per_queued_token"]
    worst = _check_grid(costs.CostModel.load(str(mpath)), grid)
    print(f"hand model: worst relative difference {worst:.3g} over {len(grid['cases'])} cases")


def _synthetic_timeline(path, n=600, seed=5):
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(n):
            layers = rng.choice([2, 12, 24, 48, 96])
            nbytes = rng.randint(256, 50000) * 98304
            waiting = rng.choice([0, 0, rng.randint(1, 20)])
            running = rng.randint(0, 128)
            prefill = rng.choice([0, rng.randint(500, 4000), rng.randint(1000, 50000)])
            src_waiting = rng.choice([0, rng.randint(1, 6)])
            queued = src_waiting * rng.randint(500, 8000)
            pending = rng.choice([0, rng.randint(1, 40) * 10**8])
            t = 0.05 + nbytes / 5e9 + layers * 0.002 + 0.004 * (1 + running) + 0.25 * waiting
            t += 8e-5 * prefill + 8e-5 * queued + 0.005 * src_waiting + pending / 4e9
            t *= 1.0 + 0.05 * rng.gauss(0.0, 1.0)
            start = 10**9 + i * 1000
            rec = {
                "req": f"cmpl-{i}",
                "side": "d",
                "decode_sent": start,
                "first_token": start + max(1, int(round(t * 1e9))),
                "bytes": nbytes,
                "layers": layers,
                "transport": "tcp",
                "outcome": "finished",
                "dst_waiting": waiting,
                "dst_running": running,
                "prefill_tokens": prefill,
                "src_waiting": src_waiting,
                "src_queued_tokens": queued,
                "src_pending_bytes": pending,
            }
            f.write(json.dumps(rec) + "\n")


def test_python_loads_and_matches_a_model_fitted_by_rust(tmp_path):
    tpath = tmp_path / "timeline.jsonl"
    mpath = tmp_path / "cost.json"
    gpath = tmp_path / "grid.json"
    _synthetic_timeline(str(tpath))
    out = _run_rust(["--timeline", str(tpath), "--out", str(mpath), "--predict-grid", str(gpath)])
    assert "seed 0.3 s + bytes / 2.7 GB/s" in out, out
    m = costs.CostModel.load(str(mpath))
    assert m.transport == "tcp"
    data = json.loads(mpath.read_text())
    assert data["schema"] == "kvwire.cost/1"
    assert 0 < data["fitted_on"]["records"] < 600
    assert data["error"]["held_out"] + data["fitted_on"]["records"] == 600
    worst = _check_grid(m, json.loads(gpath.read_text()))
    print(f"fitted model: worst relative difference {worst:.3g}")
    # The fit is close to the terms the timeline was generated from (5% noise, 600 records).
    t = m.terms["p50"]
    assert abs(t.d_queue_s_per_waiting - 0.25) / 0.25 < 0.05, t
    assert abs(t.bytes_per_s - 5e9) / 5e9 < 0.1, t
    assert abs(t.prefill_s_per_token - 8e-5) / 8e-5 < 0.05, t
    assert abs(t.src_s_per_queued_token - 8e-5) / 8e-5 < 0.1, t
    assert abs(t.src_s_per_pending_byte - 2.5e-10) / 2.5e-10 < 0.1, t


def test_formula_by_hand():
    m = costs.CostModel(_model_dict())
    t = _terms(1.0)
    want = (
        t["fixed_s"]
        + 4_000_000_000 / t["bytes_per_s"]
        + 48 * t["per_layer_tail_s"]
        + t["d_step_s"] * (1 + 9)
        + t["d_queue_s_per_waiting"] * 2
    )
    assert m.predict(bytes=4_000_000_000, layers=48, dst_waiting=2, dst_running=9, quantile="mean") == want
    src = dict(
        prefill_tokens=3000,
        src_waiting=2,
        src_queued_tokens=9000,
        src_running_tokens=16384,
        src_pending_bytes=805306368,
    )
    want_src = (
        want
        + t["prefill_s_per_token"] * 3000
        + t["src_s_per_queued_token"] * 9000
        + t["src_s_per_running_token"] * 16384
        + t["src_s_per_waiting"] * 2
        + t["src_s_per_pending_byte"] * 805306368
    )
    got = m.predict(bytes=4_000_000_000, layers=48, dst_waiting=2, dst_running=9, quantile="mean", **src)
    assert got == want_src
    # More queued work on the source never predicts less time.
    assert m.predict(bytes=1, layers=1, src_queued_tokens=2) > m.predict(bytes=1, layers=1, src_queued_tokens=1)
    p50 = m.predict(bytes=4_000_000_000, layers=48, dst_waiting=2, dst_running=9)
    p90 = m.predict(bytes=4_000_000_000, layers=48, dst_waiting=2, dst_running=9, quantile="p90")
    assert p50 < want < p90
    assert abs(p90 / want - 1.9) < 1e-12
    # More load never predicts less time.
    assert m.predict(bytes=1, layers=1, dst_waiting=5) > m.predict(bytes=1, layers=1, dst_waiting=4)


def _edited(f):
    d = _model_dict()
    f(d)
    return json.dumps(d)


@pytest.mark.parametrize(
    "edit,needle",
    [
        (lambda d: d.update(schema="kvwire.cost/2"), "schema"),
        (lambda d: d.pop("schema"), "lacks schema"),
        (lambda d: d.pop("terms"), "lacks terms"),
        (lambda d: d["quantiles"]["p90"].pop("d_step_s"), "quantiles.p90.d_step_s"),
        (lambda d: d["quantiles"].pop("p50"), "quantiles.p50"),
        (lambda d: d["terms"].update(fixed_s=-0.1), "terms.fixed_s"),
        (lambda d: d["terms"].update(fixed_s=True), "terms.fixed_s"),
        (lambda d: d["terms"].update(d_step_s="fast"), "terms.d_step_s"),
        (lambda d: d["quantiles"]["p50"].update(bytes_per_s=0.0), "bytes_per_s"),
        (lambda d: d["quantiles"]["p50"].update(bytes_per_s=float("inf")), "bytes_per_s"),
        (lambda d: d["terms"].update(per_layer_tail_s=float("nan")), "per_layer_tail_s"),
        (lambda d: d["error"].pop("p90_rel"), "error.p90_rel"),
        (lambda d: d["terms"].update(src_s_per_waiting=-1.0), "terms.src_s_per_waiting"),
        (lambda d: d["quantiles"]["p90"].update(prefill_s_per_token="x"), "quantiles.p90.prefill_s_per_token"),
    ],
)
def test_bad_files_raise_cost_model_error(edit, needle):
    with pytest.raises(costs.CostModelError, match=needle.replace(".", r"\.")):
        costs.CostModel.loads(_edited(edit))


def test_bad_inputs_raise_cost_model_error():
    with pytest.raises(costs.CostModelError):
        costs.CostModel.loads("{not json")
    with pytest.raises(costs.CostModelError):
        costs.CostModel.loads("[]")
    m = costs.CostModel(_model_dict())
    with pytest.raises(costs.CostModelError, match="quantile"):
        m.predict(bytes=1, layers=1, quantile="p99")
    with pytest.raises(costs.CostModelError, match="bytes"):
        m.predict(bytes=-1, layers=1)
    with pytest.raises(costs.CostModelError, match="dst_waiting"):
        m.predict(bytes=1, layers=1, dst_waiting=1.5)
    with pytest.raises(costs.CostModelError, match="src_queued_tokens"):
        m.predict(bytes=1, layers=1, src_queued_tokens=-3)
    with pytest.raises(costs.CostModelError, match="prefill_tokens"):
        m.predict(bytes=1, layers=1, prefill_tokens=True)
    assert issubclass(costs.CostModelError, ValueError)
