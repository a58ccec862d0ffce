"""kvwire.ab.engine: CPU by thread of a process group from /proc, busy step intervals from the
stand-in's step events."""

from __future__ import annotations

import json
import os
import threading

import pytest

from kvwire.ab import engine

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc")


def test_cpu_of_a_busy_thread_is_counted_in_its_process():
    pg = os.getpgid(0)
    before = engine.snapshot(pg)
    assert any(pid == os.getpid() for pid, _ in before), "this process is not in its own group's snapshot"
    spun, release = threading.Event(), threading.Event()

    def spin():
        x = 0
        for i in range(20_000_000):  # work, not time: enough for several clock ticks
            x ^= i
        spun.set()
        release.wait()

    t = threading.Thread(target=spin)
    t.start()
    spun.wait()
    after = engine.snapshot(pg)  # while the thread still exists
    release.set()
    t.join()
    assert len(after) == len(before) + 1  # the new thread, counted from zero
    cpu = engine.cpu_by_thread(before, after)
    me = next(st[0] for (pid, _), st in after.items() if pid == os.getpid())
    assert cpu["by_process"][me] > 0 and cpu["total_s"] >= cpu["by_process"][me]
    assert cpu["threads"] == len(after)
    assert sum(r["threads"] for r in cpu["by_thread"]) == len(after)


def test_snapshot_of_no_group_is_empty():
    assert engine.snapshot(2**22 + 12345) == {}


def test_busy_step_intervals_inside_the_window(tmp_path):
    ev = tmp_path / "events.jsonl"
    rows = [  # (t_ns, tokens, rank)
        (100, 5, 0), (300, 1, 0), (600, 1, 0),   # busy: gaps 200, 300
        (700, 0, 0), (5_000, 1, 0),              # an idle step between: no gap counted
        (5_400, 1, 1),                           # another rank: ignored
        (6_000, 1, 0), (9_000, 1, 0)]            # 6000 -> 9000: 3000, and 5000 -> 6000: 1000
    with open(ev, "w") as f:
        for t, n, r in rows:
            f.write(json.dumps({"ev": "step", "t_ns": t, "tokens": n, "rank": r, "reqs": {}}) + "\n")
        f.write('{"ev": "layer", "t_ns": 50}\nnot json\n')
    steps = engine.read_steps(str(ev))
    assert [e["t_ns"] for e in steps] == [100, 300, 600, 700, 5_000, 6_000, 9_000]
    fig = engine.step_figures(steps, 0, 10_000)
    assert fig["count"] == 4
    assert fig["mean_s"] == pytest.approx((200 + 300 + 1000 + 3000) / 4 / 1e9)
    assert fig["p50_s"] == pytest.approx(650 / 1e9)
    only = engine.step_figures(steps, 0, 650)  # the window cuts the rest off
    assert only["count"] == 2 and only["p90_s"] == pytest.approx(290 / 1e9)
    assert engine.step_figures(steps, 650, 4_000) is None
    assert engine.read_steps(str(tmp_path / "missing.jsonl")) == []


def test_settle_waits_while_the_group_is_busy_and_returns_once_it_is_quiet():
    import subprocess
    import sys
    import time

    # A process group of its own that spins until the test closes its stdin.
    child = subprocess.Popen([sys.executable, "-c", "import select, sys\n"
                              "while not select.select([sys.stdin], [], [], 0)[0]:\n    pass\n"],
                             stdin=subprocess.PIPE, start_new_session=True)
    calls = []

    def sleep(s):
        calls.append(s)
        if len(calls) == 3:  # the third window: the helper is done
            child.stdin.close()
            child.wait(30)
        time.sleep(s)

    try:
        # A spinning process uses far more than 2 % of a core in a window, however loaded the box.
        out = engine.settle([child.pid], window_s=0.5, quiet_cpu_s=0.01, timeout_s=60, sleep=sleep)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert out["settled"] and out["windows"] == 3
    assert out["busy_cpu_s"] >= 0.02  # the two busy windows were seen


def test_settle_gives_up_after_its_windows():
    out = engine.settle([os.getpgid(0)], window_s=0.01, quiet_cpu_s=-1.0, timeout_s=0.05, sleep=lambda s: None)
    assert not out["settled"] and out["windows"] == 5
