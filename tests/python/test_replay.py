"""``kvwire.replay``'s trace reader (every error names its line), generator (agentic statistics),
prompts (a later turn really begins with the earlier prompt) and report (percentiles, classes)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("aiohttp", reason="aiohttp (shipped with vLLM) not installed in this venv")

from kvwire.replay import report as rp  # noqa: E402
from kvwire.replay.client import Result  # noqa: E402
from kvwire.replay.prompts import PromptBook  # noqa: E402
from kvwire.replay.trace import TraceError, generate, read_trace  # noqa: E402


def write(tmp_path, lines):
    p = tmp_path / "t.jsonl"
    p.write_text("".join((json.dumps(x) if not isinstance(x, str) else x) + "\n" for x in lines))
    return str(p)


def turn(s="a", k=0, t=0.0, prompt=100, cached=0, out=4):
    return {"session": s, "turn": k, "arrival_s": t, "prompt_tokens": prompt, "cached_tokens": cached,
            "output_tokens": out}


@pytest.mark.parametrize("bad, why", [
    ("{not json", "not JSON"),
    ('[1, 2]', "not a JSON object"),
    (json.dumps({"session": "a", "turn": 1}), "missing arrival_s"),
    (json.dumps(turn(k=1, t=1.0, prompt=0)), "prompt_tokens must be an integer >= 1"),
    (json.dumps(turn(k=1, t=1.0, prompt=10, cached=11)), "exceed prompt_tokens"),
    (json.dumps(turn(k=2, t=1.0)), "expected turn 1"),
    (json.dumps(turn(k=1, t=-1.0)), "arrival_s must be a finite number >= 0"),
    (json.dumps(turn(k=1, t=1.5, prompt=300, cached=200)), "exceed the previous turn's prompt"),
])
def test_a_bad_line_is_an_error_naming_it(tmp_path, bad, why):
    path = write(tmp_path, [turn(t=1.0), bad])
    with pytest.raises(TraceError) as e:
        read_trace(path)
    assert f"{path}:2:" in str(e.value) and why in str(e.value), str(e.value)


def test_turns_that_go_back_in_time_or_start_cached_are_refused(tmp_path):
    with pytest.raises(TraceError, match=r":2: session a turn 1 arrives before"):
        read_trace(write(tmp_path, [turn(t=2.0), turn(k=1, t=1.0)]))
    with pytest.raises(TraceError, match=r":1: session a turn 0 has cached_tokens"):
        read_trace(write(tmp_path, [turn(cached=5)]))
    with pytest.raises(TraceError, match="no turns"):
        read_trace(write(tmp_path, ["", "  "]))


def test_cli_reports_the_bad_line_and_exits_2(tmp_path):
    path = write(tmp_path, [turn(), "{oops"])
    r = subprocess.run([sys.executable, "-m", "kvwire.replay", "run", "--url", "http://127.0.0.1:9",
                        "--trace", path, "--out", str(tmp_path / "o")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and f"{path}:2: not JSON" in r.stderr, r.stderr


def test_generated_trace_has_agentic_reuse_and_reads_back(tmp_path):
    recs = generate(sessions=6, turns=(8, 12), contexts=(1000, 50000), reuse=0.93, outputs=(16, 64),
                    session_gap_s=5, think_s=5, seed=11)
    turns = read_trace(write(tmp_path, recs))
    later = [t for t in turns if t.turn]
    share = sum(t.cached_tokens for t in later) / sum(t.prompt_tokens for t in later)
    assert 0.90 <= share <= 0.95, share
    assert all(1000 <= t.prompt_tokens <= 50000 for t in turns)
    assert len({t.session for t in turns}) == 6
    assert [t.arrival_s for t in turns] == sorted(t.arrival_s for t in turns)


def test_shipped_trace_reads(tmp_path):
    import os

    import kvwire.replay

    path = os.path.join(os.path.dirname(kvwire.replay.__file__), "traces", "agentic-small.jsonl")
    turns = read_trace(path)
    assert len(turns) == 48 and len({t.session for t in turns}) == 5


def test_prompts_repeat_the_cached_prefix_and_nothing_else():
    recs = [turn(t=0.0, prompt=50), turn(k=1, t=1.0, prompt=80, cached=50), turn(k=2, t=2.0, prompt=60, cached=30),
            turn(s="b", t=0.5, prompt=50)]
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        p = f"{d}/t.jsonl"
        with open(p, "w") as f:
            f.write("".join(json.dumps(r) + "\n" for r in recs))
        turns = read_trace(p)
    book = PromptBook(1000)
    ids = {(t.session, t.turn): book.prompt(t) for t in turns}
    a0, a1, a2, b0 = ids["a", 0], ids["a", 1], ids["a", 2], ids["b", 0]
    assert len(a0) == 50 and len(a1) == 80 and len(a2) == 60
    assert a1[:50] == a0 and a2[:30] == a1[:30] and a2[30:] != a1[30:60]
    assert b0 != a0  # another session shares nothing
    assert all(10 <= x < 1000 for x in a0 + a1 + a2 + b0)
    assert PromptBook(1000).prompt(turns[0]) == a0  # seeded: the same prompts every run


def test_report_percentiles_and_classes():
    rs = []
    for i, n in enumerate([1000, 2000, 6000, 30000, 60000]):
        r = Result("s", i, i + 1, n, 0, 4, ttft_s=0.1 * (i + 1), tpot_s=0.01, e2e_s=1.0 + i, tokens=4)
        rs.append(r)
    rs.append(Result("s", 9, 10, 100, 0, 4, error="HTTP 502: boom"))
    rep = rp.summarize(rs)
    assert rep["overall"]["requests"] == 6 and rep["overall"]["errors"] == 1
    assert rep["overall"]["ttft_s"]["p50"] == pytest.approx(0.3)
    assert rep["overall"]["e2e_s"]["p90"] == pytest.approx(4.6)
    assert set(rep["classes"]) == {"<5k", "5-20k", "20-50k", ">50k"}
    assert rep["classes"]["<5k"]["requests"] == 3 and rep["classes"]["<5k"]["errors"] == 1
    assert "HTTP 502: boom" in rep["error_samples"][0]
    md = rp.markdown(rep)
    assert "| all | 6 | 1 |" in md and "error: s turn 9 (line 10): HTTP 502: boom" in md
    assert rp.quantile([], 50) is None
