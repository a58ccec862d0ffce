"""An arm's figures from the connectors' timelines (D's records, joined with P's for P's
milestones; every process on one host, so one monotonic clock)."""

from __future__ import annotations

import glob
import json
import os

from kvwire.replay.report import quantile

SEGMENTS = ("wait_for_p", "reservation_wait", "exposed_transfer", "report_delay", "promotion_delay", "first_step")


def read_records(directory: str) -> tuple[dict, dict]:
    """(D records, P records) by transfer id, from every ``*.jsonl`` under ``directory``
    (router records left out)."""
    d, p = {}, {}
    for path in glob.glob(os.path.join(directory, "**", "*.jsonl*"), recursive=True):
        if os.path.basename(path).startswith("router"):
            continue
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                tid = rec.get("transfer_id")
                if not isinstance(rec, dict) or tid is None:
                    continue
                (d if rec.get("role") in ("d", "pd") else p)[tid] = rec
    return d, p


def segments(rec: dict) -> list[float] | None:
    """``decode_sent → first_token`` cut at the milestones (seconds), as the connector and
    ``kvwire-bench calibrate`` cut it: each clamped into [previous, end], a missing one equal to
    the previous, so the six sum to the clock."""
    start, end = rec.get("decode_sent"), rec.get("first_token")
    if start is None or end is None or end < start:
        return None
    p_done, blocks = rec.get("p_last_layer_ready"), rec.get("blocks_to_p")
    flow = max(p_done, blocks) if p_done is not None and blocks is not None else (p_done if p_done is not None else blocks)
    raw = [p_done, flow, rec.get("last_byte"), rec.get("d_reported_finished"), rec.get("d_promoted")]
    out, prev = [], start
    for m in raw:
        v = min(max(m if m is not None else prev, prev), end)
        out.append((v - prev) / 1e9)
        prev = v
    out.append((end - prev) / 1e9)
    return out


def _joined(d: dict, p: dict | None) -> dict:
    rec = dict(d)
    if p is not None:
        off = d.get("clock_offset_ns") or 0  # P's clock minus D's
        for k in ("p_scheduled", "p_first_layer_ready", "p_last_layer_ready"):
            if p.get(k) is not None:  # P's own milestones, not D's view of them
                rec[k] = p[k] - off
    return rec


def arm_figures(directory: str, transfer_ids: list[str]) -> dict:
    """The timeline figures of the requests ``transfer_ids`` (an arm's), see the module doc."""
    d_all, p_all = read_records(directory)
    recs = [_joined(d_all[t], p_all.get(t)) for t in transfer_ids if t in d_all]
    ok = [r for r in recs if r.get("outcome") == "finished"]
    clocks, tails, segs = [], [], []
    block_s, wire = 0.0, 0
    for r in ok:
        s = segments(r)
        if s is not None:
            segs.append(s)
            clocks.append(sum(s))
        if r.get("last_byte") is not None and r.get("p_last_layer_ready") is not None:
            tails.append(max(0, r["last_byte"] - r["p_last_layer_ready"]) / 1e9)
        held = (r.get("blocks") or 0) - (r.get("prefix_blocks") or 0)
        landed = r.get("d_reported_finished") or r.get("last_byte")
        if held > 0 and r.get("d_reserved") is not None and landed is not None and landed >= r["d_reserved"]:
            block_s += held * (landed - r["d_reserved"]) / 1e9
        wire += int(r.get("bytes") or 0)
    n = len(segs)
    return {
        "timeline_records": len(recs),
        "missing_records": len(transfer_ids) - len(recs),
        "failed": len(recs) - len(ok),
        "fail_reasons": sorted({str(r.get("fail_reason")) for r in recs if r not in ok}),
        "clock_s": {"p50": quantile(clocks, 50), "p90": quantile(clocks, 90)},
        "decomposition_mean_s": {name: (sum(s[i] for s in segs) / n if n else None) for i, name in enumerate(SEGMENTS)},
        "exposed_tail_s": {"p50": quantile(tails, 50), "p90": quantile(tails, 90)},
        "d_block_seconds": block_s,
        "wire_bytes": wire,
    }
