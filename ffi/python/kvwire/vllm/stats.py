"""kvwire's numbers inside vLLM's connector stats: ``KvwireConnectorStats`` (periodic log line,
aggregation across TP workers and steps) and ``KvwirePromMetrics`` (vLLM's ``/metrics``).

Payload (``KvwireConnectorStats.data``, plain dicts so that it pickles and msgspec-encodes)::

    {"counters": {key: delta},                 # summed by aggregate()
     "hists":    {key: {"buckets": [n, ...],   # per-bucket deltas (not cumulative)
                        "sum": seconds, "count": n}},
     "gauges":   {source: {key: value}}}       # latest value per source; sources summed

A key is ``name`` or ``name|label|label``: the label values of the Prometheus series, in the
order of ``SERIES[name][2]``. Counters and histograms are deltas since the previous
``get_kv_connector_stats()`` of the same connector half; gauges are sent when they changed,
keyed by their source (``scheduler`` or ``worker<rank>``), so that one TP worker's gauges never
overwrite another's and an older value of a source is replaced by a newer one.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from kvwire._kvwire import CONNECTOR_BUCKET_BOUNDS

# Upper bounds (s) of the engine's batch-latency buckets: 2^i µs, i = 0..24, then +Inf.
ENGINE_BUCKET_BOUNDS = [2.0**i * 1e-6 for i in range(25)] + [math.inf]
BOUNDS = {"connector": list(CONNECTOR_BUCKET_BOUNDS), "engine": ENGINE_BUCKET_BOUNDS}

# name -> (kind, Prometheus name without "vllm:" prefix, label names, help, buckets)
SERIES: dict[str, tuple] = {
    # D side (scheduler, the DCore)
    "d_arrived": ("counter", "kvwire_d_requests_arrived", (), "Requests that arrived on D (remote prefill)."),
    "d_reservations": ("counter", "kvwire_d_reservations", (), "D block reservations made."),
    "d_reserved_blocks": ("counter", "kvwire_d_reserved_blocks", (), "D blocks reserved."),
    "d_releases": ("counter", "kvwire_d_releases", (), "D reservations released without becoming a running request."),
    "d_released_blocks": ("counter", "kvwire_d_released_blocks", (), "D blocks released without becoming a running request."),
    "d_completed": ("counter", "kvwire_d_requests_completed", (), "D requests whose KV fully landed."),
    "d_promoted": ("counter", "kvwire_d_requests_promoted", (), "D requests promoted to running."),
    "d_first_tokens": ("counter", "kvwire_d_first_tokens", (), "D requests that produced their first token."),
    "d_failed": ("counter", "kvwire_d_requests_failed", ("reason",), "D requests failed (local_abort: aborted by vLLM)."),
    "d_bytes_received": ("counter", "kvwire_d_received_bytes", (), "KV bytes landed on D."),
    "d_landings": ("counter", "kvwire_d_landings", (), "land requests that took landing-pool slots."),
    "d_land_fallbacks": ("counter", "kvwire_d_land_fallbacks", (),
                         "land requests that fell back to lazy (landing pool full)."),
    "d_block_seconds_waiting": ("counter", "kvwire_d_block_seconds_waiting", ("policy",),
                                "Block-seconds D held reserved blocks before promotion or release."),
    "d_decomposition": ("histogram", "kvwire_d_decode_sent_to_first_token_seconds", ("part",),
                        "decode_sent -> first_token and its parts, per request.", "connector"),
    "d_requests": ("gauge", "kvwire_d_requests", ("state",), "D requests by connector state now."),
    "d_held_blocks": ("gauge", "kvwire_d_held_blocks", (), "D blocks reserved and waiting for KV now."),
    "d_held_block_seconds": ("gauge", "kvwire_d_held_block_seconds", (),
                             "Block-seconds held so far by the reservations still waiting."),
    "d_landing_slots": ("gauge", "kvwire_d_landing_slots", (), "D landing-pool slots held now (land, and a staged D's requests)."),
    "d_landing_copied_layers": ("counter", "kvwire_d_landing_copied_layers", ("when",),
                                "Request layers D's workers copied out of the landing pool or mirror: while later "
                                "layers were still landing (landing), or once all had landed (complete)."),
    # P side (scheduler, the PCore)
    "p_scheduled": ("counter", "kvwire_p_requests_scheduled", (), "Requests scheduled on P for remote decode."),
    "p_transfers": ("counter", "kvwire_p_transfers", (), "Layer transfers started by P."),
    "p_transfers_done": ("counter", "kvwire_p_transfers_done", (), "Layer transfers completed."),
    "p_transfers_failed": ("counter", "kvwire_p_transfers_failed", (), "Layer transfers failed."),
    "p_bytes_sent": ("counter", "kvwire_p_sent_bytes", (), "KV bytes written by completed layer transfers."),
    "p_completed": ("counter", "kvwire_p_requests_completed", (), "P requests whose layers were all sent."),
    "p_failed": ("counter", "kvwire_p_requests_failed", ("reason",), "P requests failed."),
    "p_releases": ("counter", "kvwire_p_releases", (), "P block releases."),
    "p_released_blocks": ("counter", "kvwire_p_released_blocks", (), "P blocks released."),
    "p_send_latency": ("histogram", "kvwire_p_send_seconds", (), "P: scheduled -> every layer written.", "connector"),
    # The workers' data engine
    "engine_bytes": ("counter", "kvwire_engine_transfer_bytes", ("transport", "dir"), "Engine payload bytes of completed batches."),
    "engine_batches": ("counter", "kvwire_engine_batches", ("transport", "dir"), "Engine completed batches."),
    "engine_failed_batches": ("counter", "kvwire_engine_failed_batches", ("transport",), "Engine batches that failed."),
    "engine_errors": ("counter", "kvwire_engine_errors", ("stage", "kind"), "Engine errors by stage and kind."),
    "engine_batch_latency": ("histogram", "kvwire_engine_batch_latency_seconds", (),
                             "Engine batch latency, submit -> completion.", "engine"),
    "engine_inflight_bytes": ("gauge", "kvwire_engine_inflight_bytes", (), "Engine bytes in flight now."),
    "engine_inflight_batches": ("gauge", "kvwire_engine_inflight_batches", (), "Engine batches in flight now."),
    "engine_peers": ("gauge", "kvwire_engine_peers", (), "Engine peers connected now."),
    "engine_region_bytes": ("gauge", "kvwire_engine_region_bytes", ("kind",),
                            "Engine-registered bytes now: engine (allocated), host (pageable), pinned "
                            "(KV caches, staging pools and landing mirrors)."),
}

DECOMPOSITION_PARTS = ["wait_for_p", "reservation_wait", "exposed_transfer", "report_delay",
                       "promotion_delay", "first_step", "total"]


def _empty() -> dict:
    return {"counters": {}, "hists": {}, "gauges": {}}


def copy_payload(data: dict | None) -> dict:
    """A copy deep enough that aggregating into it never changes ``data``: vLLM hands the same
    payload dict to its logging and its Prometheus logger."""
    out = _empty()
    if not data:
        return out
    out["counters"] = dict(data.get("counters", {}))
    out["hists"] = {k: {"buckets": list(h["buckets"]), "sum": h["sum"], "count": h["count"]}
                    for k, h in data.get("hists", {}).items()}
    out["gauges"] = {src: dict(g) for src, g in data.get("gauges", {}).items()}
    return out


def split_key(key: str) -> tuple[str, list[str]]:
    name, *labels = key.split("|")
    return name, labels


# ---- flattening the native dicts into cumulative counters/hists and gauges --------------------

def flatten_d(m: dict) -> tuple[dict, dict, dict]:
    """``DCore.metrics(now)`` -> (counters, hists, gauges), cumulative."""
    c = {k: m[k] for k in ("arrived", "reservations", "reserved_blocks", "releases", "released_blocks",
                           "completed", "promoted", "first_tokens", "bytes_received", "landings",
                           "land_fallbacks")}
    c = {f"d_{k}": v for k, v in c.items()}
    for reason, n in m["failed"].items():
        c[f"d_failed|{reason}"] = n
    c[f"d_block_seconds_waiting|{m['policy']}"] = m["block_seconds_waiting"]
    h = {}
    for part in DECOMPOSITION_PARTS:
        x = m["decomposition"][part]
        h[f"d_decomposition|{part}"] = {"buckets": list(x["buckets"]), "sum": x["sum_seconds"], "count": x["count"]}
    g = {f"d_requests|{s}": n for s, n in m["states"].items()}
    g["d_held_blocks"] = m["held_blocks"]
    g["d_held_block_seconds"] = m["held_block_seconds"]
    g["d_landing_slots"] = m["landing_slots"]
    return c, h, g


def merge(flat: list) -> tuple[dict, dict, dict]:
    """Sums the flattened snapshots of several cores (one per policy or send mode)."""
    counters, hists, gauges = {}, {}, {}
    for c, h, g in flat:
        for k, v in c.items():
            counters[k] = counters.get(k, 0) + v
        for k, v in g.items():
            gauges[k] = gauges.get(k, 0) + v
        for k, x in h.items():
            have = hists.get(k)
            if have is None:
                hists[k] = {"buckets": list(x["buckets"]), "sum": x["sum"], "count": x["count"]}
            else:
                have["buckets"] = [a + b for a, b in zip(have["buckets"], x["buckets"])]
                have["sum"] += x["sum"]
                have["count"] += x["count"]
    return counters, hists, gauges


def flatten_p(m: dict) -> tuple[dict, dict, dict]:
    """``PCore.metrics()`` -> (counters, hists, gauges), cumulative."""
    c = {f"p_{k}": m[k] for k in ("scheduled", "transfers", "transfers_done", "transfers_failed", "bytes_sent",
                                  "completed", "releases", "released_blocks")}
    for reason, n in m["failed"].items():
        c[f"p_failed|{reason}"] = n
    x = m["send_latency"]
    h = {"p_send_latency": {"buckets": list(x["buckets"]), "sum": x["sum_seconds"], "count": x["count"]}}
    return c, h, {}


def flatten_engine(m: dict) -> tuple[dict, dict, dict]:
    """``kvwire.Engine.metrics()`` -> (counters, hists, gauges), cumulative."""
    c = {}
    for t, v in m["transports"].items():
        c[f"engine_bytes|{t}|write"] = v["write_bytes"]
        c[f"engine_bytes|{t}|read"] = v["read_bytes"]
        c[f"engine_batches|{t}|write"] = v["write_batches"]
        c[f"engine_batches|{t}|read"] = v["read_batches"]
        c[f"engine_failed_batches|{t}"] = v["failed_batches"]
    for stage, kinds in m["errors"].items():
        for kind, n in kinds.items():
            c[f"engine_errors|{stage}|{kind}"] = n
    n_b = len(ENGINE_BUCKET_BOUNDS)
    buckets, total, count = [0] * n_b, 0.0, 0
    for hist in m["latency"]:  # summed over transports and size classes
        prev = 0
        for i, (_, cum) in enumerate(hist["buckets"][:n_b]):
            buckets[i] += cum - prev
            prev = cum
        total += hist["sum_seconds"]
        count += hist["count"]
    h = {"engine_batch_latency": {"buckets": buckets, "sum": total, "count": count}}
    g = {"engine_inflight_bytes": m["inflight_bytes"], "engine_inflight_batches": m["inflight_batches"],
         "engine_peers": m["peers_connected"]}
    for kind, n in m["region_bytes_by_kind"].items():
        g[f"engine_region_bytes|{kind}"] = n
    return c, h, g


class DeltaTracker:
    """Turns cumulative snapshots into the deltas of one ``KvwireConnectorStats`` payload."""

    def __init__(self, source: str):
        self.source = source
        self.counters: dict[str, float] = {}
        self.hists: dict[str, dict] = {}
        self.gauges: dict[str, float] | None = None

    def delta(self, counters: dict, hists: dict, gauges: dict) -> dict:
        out = _empty()
        for k, v in counters.items():
            out["counters"][k] = v - self.counters.get(k, 0)
        for k, x in hists.items():
            prev = self.hists.get(k)
            if prev is None:
                out["hists"][k] = {"buckets": list(x["buckets"]), "sum": x["sum"], "count": x["count"]}
            else:
                out["hists"][k] = {"buckets": [a - b for a, b in zip(x["buckets"], prev["buckets"])],
                                   "sum": x["sum"] - prev["sum"], "count": x["count"] - prev["count"]}
        if gauges and gauges != self.gauges:
            out["gauges"][self.source] = dict(gauges)
        self.counters, self.hists, self.gauges = dict(counters), hists, dict(gauges)
        return out


def worker_source() -> str:
    """``worker<TP rank>`` (the process id when vLLM's parallel state is not initialised)."""
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return f"worker{get_tensor_model_parallel_rank()}"
    except Exception:  # noqa: BLE001 - not initialised (tests, single process)
        return f"worker-pid{os.getpid()}"


# ---- vLLM's stats object ----------------------------------------------------------------------

@dataclass
class KvwireConnectorStats(KVConnectorStats):
    """kvwire's connector stats (see the module docstring for the payload)."""

    def __post_init__(self):
        if not self.data:
            self.data = _empty()
        for k in ("counters", "hists", "gauges"):
            self.data.setdefault(k, {})

    def to_dict(self) -> dict[str, Any]:  # 0.18.1's base class has no to_dict
        return self.data

    def reset(self):
        self.data = _empty()

    def is_empty(self) -> bool:
        d = self.data
        return (not any(d["counters"].values())
                and not any(h["count"] for h in d["hists"].values())
                and not d["gauges"])

    def aggregate(self, other: KVConnectorStats) -> "KvwireConnectorStats":
        """Sums counters and histograms; gauges: per source, ``other``'s (the newer) win."""
        o = other.data if other is not None else None
        if not o:
            return self
        d = self.data
        for k, v in o.get("counters", {}).items():
            d["counters"][k] = d["counters"].get(k, 0) + v
        for k, x in o.get("hists", {}).items():
            mine = d["hists"].get(k)
            if mine is None:
                d["hists"][k] = {"buckets": list(x["buckets"]), "sum": x["sum"], "count": x["count"]}
            else:
                mine["buckets"] = [a + b for a, b in zip(mine["buckets"], x["buckets"])]
                mine["sum"] += x["sum"]
                mine["count"] += x["count"]
        for src, g in o.get("gauges", {}).items():
            d["gauges"][src] = dict(g)
        return self

    def _sum(self, name: str) -> float:
        return sum(v for k, v in self.data["counters"].items() if split_key(k)[0] == name)

    def _gauge(self, name: str) -> float:
        return sum(v for g in self.data["gauges"].values() for k, v in g.items() if split_key(k)[0] == name)

    def _mean_ms(self, key: str) -> float:
        h = self.data["hists"].get(key)
        return round(h["sum"] / h["count"] * 1e3, 3) if h and h["count"] else 0.0

    def reduce(self) -> dict[str, int | float]:
        """The interval's summary for vLLM's periodic ``KV Transfer metrics:`` log line: sums of
        the counters, mean latencies (ms), and the newest gauges summed over sources; only the
        halves present in the payload (D, P, engine)."""
        d = self.data
        names = {split_key(k)[0] for k in d["counters"]} | set(d["hists"])
        gnames = {split_key(k)[0] for g in d["gauges"].values() for k in g}
        out: dict[str, int | float] = {}
        if any(n.startswith("d_") for n in names | gnames):
            for n in ("d_arrived", "d_reserved_blocks", "d_released_blocks", "d_completed", "d_failed"):
                out[n] = self._sum(n)
            out["d_aborted"] = d["counters"].get("d_failed|local_abort", 0)
            out["d_block_seconds_waiting"] = round(self._sum("d_block_seconds_waiting"), 6)
            out["d_mean_decode_sent_to_first_token_ms"] = self._mean_ms("d_decomposition|total")
            if "d_requests" in gnames:
                out["d_requests_waiting"] = self._gauge_key("d_requests|waiting")
                out["d_held_blocks"] = self._gauge("d_held_blocks")
        if any(n.startswith("p_") for n in names):
            for n in ("p_scheduled", "p_transfers", "p_transfers_failed", "p_bytes_sent", "p_completed", "p_failed"):
                out[n] = self._sum(n)
            out["p_mean_send_ms"] = self._mean_ms("p_send_latency")
        if any(n.startswith("engine_") for n in names):
            out["engine_bytes"] = self._sum("engine_bytes")
            out["engine_batches"] = self._sum("engine_batches")
            out["engine_failed_batches"] = self._sum("engine_failed_batches")
            out["engine_errors"] = self._sum("engine_errors")
            out["engine_mean_batch_latency_ms"] = self._mean_ms("engine_batch_latency")
        return out

    def _gauge_key(self, key: str) -> float:
        return sum(g.get(key, 0) for g in self.data["gauges"].values())


# ---- vLLM's Prometheus metrics ----------------------------------------------------------------

def replay_values(buckets: list[int], total: float, bounds: list[float]) -> list[float]:
    """Values whose histogram is exactly ``buckets`` (per-bucket counts over ``bounds``) and whose
    sum is ``total`` (up to float rounding, when the deltas are consistent): a Prometheus
    ``Histogram`` only takes observations, and the cores keep bucket counts."""
    lows = [0.0] + bounds[:-1]
    n_inf = buckets[-1] if buckets else 0
    finite = [(lo, hi, c) for lo, hi, c in zip(lows, bounds, buckets) if c and math.isfinite(hi)]
    if n_inf:
        vals = [lo + (hi - lo) / 2 for lo, hi, c in finite for _ in range(c)]
        last = bounds[-2]
        rest = max(total - sum(vals), 0.0) / n_inf
        vals += [max(rest, math.nextafter(last, math.inf))] * n_inf
        return vals
    lo_sum = sum(lo * c for lo, _, c in finite)
    hi_sum = sum(hi * c for _, hi, c in finite)
    t = (total - lo_sum) / (hi_sum - lo_sum) if hi_sum > lo_sum else 1.0
    t = min(max(t, 1e-9), 1.0)  # a value equal to a lower bound would fall one bucket lower
    return [min(lo + t * (hi - lo), hi) for lo, hi, c in finite for _ in range(c)]


class KvwirePromMetrics(KVConnectorPromMetrics):
    """Creates kvwire's series with the metric classes vLLM passes in (``vllm:kvwire_*``, labels
    ``labelnames`` + the series' own) and records each stats payload into them."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.metrics: dict[str, Any] = {}
        self._gauge_sources: dict[tuple[int, str], dict[str, float]] = {}
        for name, spec in SERIES.items():
            kind, prom, labels, doc = spec[:4]
            names = list(labelnames) + list(labels)
            if kind == "counter":
                self.metrics[name] = self._counter_cls(name=f"vllm:{prom}", documentation=doc, labelnames=names)
            elif kind == "gauge":
                self.metrics[name] = self._gauge_cls(name=f"vllm:{prom}", documentation=doc, labelnames=names)
            else:
                bounds = [b for b in BOUNDS[spec[4]] if math.isfinite(b)]
                self.metrics[name] = self._histogram_cls(name=f"vllm:{prom}", documentation=doc,
                                                         labelnames=names, buckets=bounds)

    def _child(self, name: str, engine_idx: int, labels: list[str]):
        return self.metrics[name].labels(*self.per_engine_labelvalues[engine_idx], *labels)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
        d = transfer_stats_data or {}
        for key, v in d.get("counters", {}).items():
            name, labels = split_key(key)
            if name in self.metrics and v > 0:
                self._child(name, engine_idx, labels).inc(v)
        for key, h in d.get("hists", {}).items():
            name, labels = split_key(key)
            if name not in self.metrics or not h["count"]:
                continue
            child = self._child(name, engine_idx, labels)
            for v in replay_values(h["buckets"], h["sum"], BOUNDS[SERIES[name][4]]):
                child.observe(v)
        changed = set()
        for src, g in d.get("gauges", {}).items():
            self._gauge_sources[(engine_idx, src)] = dict(g)
            changed.update(g)
        for key in changed:  # a gauge is the sum over the sources (TP workers) of their newest value
            name, labels = split_key(key)
            if name in self.metrics:
                total = sum(g.get(key, 0) for (e, _), g in self._gauge_sources.items() if e == engine_idx)
                self._child(name, engine_idx, labels).set(total)


__all__ = ["copy_payload", "KvwireConnectorStats", "KvwirePromMetrics", "SERIES", "DeltaTracker", "replay_values",
           "flatten_d", "flatten_p", "flatten_engine", "worker_source"]
