"""What an arm cost its servers beyond the client's clock: CPU seconds by thread and engine-core
step times, for the serving-level tax (``kvwire-bench tax --servers``).

* CPU: every thread of a server's process group (API server, engine core, workers, and the
  threads the connector and its transfer engine start), read from ``/proc`` before and after the
  arm's replay (Linux). Threads are grouped by process and thread name; a thread that ended
  between the two reads is missing from the figures (its CPU is lost, not guessed).
* Steps: the stand-in worker's step events (:mod:`kvwire.testing.control`): the interval from
  one step that computed tokens to the next one that did, i.e. one turn of the engine-core loop
  while it is busy (scheduler, connector hooks, the stand-in's forward, output processing).
  Only with the stand-in; a real model has no such events and reports none.
"""

from __future__ import annotations

import json
import math
import os
import time

from kvwire.replay.report import quantile

try:
    TICKS = os.sysconf("SC_CLK_TCK")
except (ValueError, OSError, AttributeError):  # pragma: no cover - not Linux
    TICKS = 100


def _stat_fields(path: str) -> tuple[str, list[str]] | None:
    """(comm, the fields after it) of a ``/proc/.../stat`` file, or None when it is gone."""
    try:
        with open(path, "rb") as f:
            text = f.read().decode(errors="replace")
    except OSError:
        return None
    lo, hi = text.find("("), text.rfind(")")
    if lo < 0 or hi < lo:
        return None
    return text[lo + 1:hi], text[hi + 2:].split()


def group_pids(pgid: int) -> list[int]:
    """The processes of process group ``pgid``."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        st = _stat_fields(f"/proc/{name}/stat")
        # After the comm: state, ppid, pgrp, ...
        if st is not None and len(st[1]) > 2 and st[1][2] == str(pgid):
            out.append(int(name))
    return sorted(out)


def snapshot(pgid: int) -> dict:
    """``{(pid, tid): (process name, thread name, CPU ticks)}`` for every thread of the group."""
    out = {}
    for pid in group_pids(pgid):
        proc = _stat_fields(f"/proc/{pid}/stat")
        if proc is None:
            continue
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            st = _stat_fields(f"/proc/{pid}/task/{tid}/stat")
            # utime and stime are the 14th and 15th fields of the line: 12th and 13th after comm.
            if st is None or len(st[1]) < 13:
                continue
            out[(pid, int(tid))] = (proc[0], st[0], int(st[1][11]) + int(st[1][12]))
    return out


def cpu_by_thread(before: dict, after: dict) -> dict:
    """CPU seconds between two snapshots, by ``process/thread`` name (threads of one name
    summed), with the total per process and overall; a thread new since ``before`` counts from
    zero."""
    threads: dict[str, dict] = {}
    procs: dict[str, float] = {}
    for key, (pname, tname, ticks) in after.items():
        prev = before.get(key)
        used = (ticks - prev[2]) / TICKS if prev is not None else ticks / TICKS
        if used < 0:
            continue
        name = f"{pname}/{tname}"
        t = threads.setdefault(name, {"cpu_s": 0.0, "threads": 0})
        t["cpu_s"] += used
        t["threads"] += 1
        procs[pname] = procs.get(pname, 0.0) + used
    rows = sorted(({"name": k, "cpu_s": round(v["cpu_s"], 3), "threads": v["threads"]} for k, v in threads.items()),
                  key=lambda r: -r["cpu_s"])
    return {"total_s": round(sum(procs.values()), 3),
            "by_process": {k: round(v, 3) for k, v in sorted(procs.items(), key=lambda kv: -kv[1])},
            "by_thread": rows, "threads": len(after)}


def settle(pgids, window_s: float = 0.5, quiet_cpu_s: float = 0.02, timeout_s: float = 30.0,
           sleep=time.sleep) -> dict:
    """Waits until the process groups ``pgids`` together used less than ``quiet_cpu_s`` CPU
    seconds in one ``window_s`` window, for at most ``timeout_s``: a server that answers
    ``/health`` may still run start-up helpers (vLLM 0.33 compiles kernels in child processes for
    a few seconds after it is ready), whose CPU would otherwise be counted in the first arm.
    Returns ``{"settled": bool, "windows": n, "busy_cpu_s": CPU seen before the quiet window,
    "seconds": wall time waited}``."""
    t0 = time.monotonic()
    busy = 0.0
    windows = max(1, math.ceil(timeout_s / window_s))
    for n in range(1, windows + 1):
        before = {g: snapshot(g) for g in pgids}
        sleep(window_s)
        used = sum(cpu_by_thread(before[g], snapshot(g))["total_s"] for g in pgids)
        if used < quiet_cpu_s:
            return {"settled": True, "windows": n, "busy_cpu_s": round(busy, 3),
                    "seconds": round(time.monotonic() - t0, 2)}
        busy += used
    return {"settled": False, "windows": windows, "busy_cpu_s": round(busy, 3),
            "seconds": round(time.monotonic() - t0, 2)}


def read_steps(events_path: str) -> list[dict]:
    """The stand-in's step events (rank 0), in order; empty when there are none."""
    out = []
    try:
        with open(events_path) as f:
            for line in f:
                try:
                    e = json.loads(line)
                except ValueError:
                    continue
                if e.get("ev") == "step" and e.get("rank", 0) == 0:
                    out.append(e)
    except OSError:
        pass
    return out


def step_figures(steps: list[dict], t0_ns: int, t1_ns: int) -> dict | None:
    """Intervals between consecutive busy steps (both computed tokens) inside ``[t0, t1]``:
    count, p50, p90 and mean, seconds. None without a busy interval."""
    inside = [e for e in steps if t0_ns <= e.get("t_ns", -1) <= t1_ns]
    gaps = [(b["t_ns"] - a["t_ns"]) / 1e9 for a, b in zip(inside, inside[1:])
            if a.get("tokens", 0) > 0 and b.get("tokens", 0) > 0]
    if not gaps:
        return None
    return {"count": len(gaps), "p50_s": quantile(gaps, 50), "p90_s": quantile(gaps, 90),
            "mean_s": sum(gaps) / len(gaps)}
