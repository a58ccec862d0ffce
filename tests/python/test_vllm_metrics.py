"""KvwireConnector's stats inside vLLM (real v1 Schedulers on CPU, the installed vLLM version):
after a known sequence (a finished request, an abort while waiting, a failed transfer), the
stats that vLLM's Scheduler hands to its loggers hold exactly the expected numbers; they
aggregate across TP workers through vLLM's KVOutputAggregator, reduce through vLLM's
KVConnectorLogging into the periodic log line, and vLLM's KVConnectorProm(etheus) builds our
Prometheus series and records them (checked by parsing prometheus_client's exposition)."""

import json
import math

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM not installed in this venv (run tests/python/setup.sh)")

import kvwire  # noqa: E402
from prometheus_client import REGISTRY, generate_latest  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1 import metrics as vmetrics  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402

from kvwire.vllm import KvwireConnector  # noqa: E402
from kvwire.vllm import compat  # noqa: E402
from kvwire.vllm.stats import (  # noqa: E402
    SERIES, DeltaTracker, KvwireConnectorStats, KvwirePromMetrics, flatten_engine, replay_values,
)
from test_vllm_connector import d_request, mdir, p_request, pair, run_until  # noqa: E402,F401
from vllm_harness import RequestStatus, d_core, p_core, p_fill, timeline  # noqa: E402

CONNECTOR_HOOKS = ("get_kv_connector_stats", "build_kv_connector_stats", "build_prom_metrics")


def stats_step(side, sink, fill=None):
    """``Side.step`` with the worker's stats in the connector output, as vLLM's model runner
    does; collects the ``kv_connector_stats`` payloads the Scheduler hands to its loggers."""
    so = side.sched.schedule()
    w = side.worker
    w.bind_connector_metadata(so.kv_connector_metadata)
    w.start_load_kv(None)
    for li, name in enumerate(side.kv):
        if fill is not None:
            fill(side, so, li, name)
        w.save_kv_layer(name, side.kv[name], attn_metadata=object())
    w.wait_for_save()
    sending, recving = w.get_finished(so.finished_req_ids)
    invalid = w.get_block_ids_with_load_errors()
    side.invalid |= invalid
    w.clear_connector_metadata()
    ids = list(so.num_scheduled_tokens.keys())
    out = ModelRunnerOutput(
        req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
        sampled_token_ids=[[7] for _ in ids], logprobs=None, prompt_logprobs_dict={}, pooler_output=None,
        kv_connector_output=KVConnectorOutput(finished_sending=sending, finished_recving=recving,
                                              invalid_block_ids=invalid,
                                              kv_connector_stats=w.get_kv_connector_stats()),
    )
    for eco in side.sched.update_from_output(so, out).values():
        st = getattr(eco, "scheduler_stats", None)
        if st is not None and st.kv_connector_stats:
            sink.append(st.kv_connector_stats)
    return so


def total(stats, name):
    return sum(v for k, v in stats.data["counters"].items() if k.split("|")[0] == name)


def hist(stats, key):
    return stats.data["hists"].get(key, {"buckets": [], "sum": 0.0, "count": 0})


def engine_errors(m):
    return sum(n for kinds in m["errors"].values() for n in kinds.values())


def test_hooks_exist_in_this_vllm():
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    missing = [h for h in CONNECTOR_HOOKS if not hasattr(KVConnectorBase_V1, h)]
    assert not missing, f"this vLLM lacks {missing}"
    for h in CONNECTOR_HOOKS:
        assert getattr(KvwireConnector, h) is not getattr(KVConnectorBase_V1, h), h


def test_stats_interval_limits_snapshots(pair):
    """Within ``stats_interval`` of the last snapshot nothing is taken; the next snapshot carries
    everything that happened meanwhile (counters are deltas of cumulative values)."""
    d, p = pair({"stats_interval": 3600})
    assert d.conn.get_kv_connector_stats() is not None  # the first call: gauges
    d.sched.add_request(d_request("iv", p))
    d.step()  # the request arrived on D's core
    assert d.conn.get_kv_connector_stats() is None  # inside the interval
    d.conn._sched.stats_at -= 3601 * 10**9
    st = d.conn.get_kv_connector_stats()
    assert st is not None and st.data["counters"]["d_arrived"] == 1


def test_compat_matches_this_vllms_scheduler(pair):
    """0.18.1's Scheduler takes the scheduler-side stats only along with the workers' stats:
    there (and only there) the worker returns an object every step, empty or not."""
    import inspect

    from vllm.v1.core.sched.scheduler import Scheduler

    src = inspect.getsource(Scheduler.update_from_output)
    gated = "if kv_connector_stats and self.connector" in src
    assert compat.SCHEDULER_STATS_RIDE_ON_WORKER_STATS == gated
    d, p = pair({"stats_interval": 0})
    first = d.worker.get_kv_connector_stats()  # the first call carries the engine's gauges
    assert first is not None and not first.is_empty()
    idle = d.worker.get_kv_connector_stats()
    if gated:
        assert isinstance(idle, KvwireConnectorStats) and idle.is_empty()
    else:
        assert idle is None
    assert d.conn.get_kv_connector_stats() is not None  # the D core's gauges, first call
    assert d.conn.get_kv_connector_stats() is None  # nothing happened since


@pytest.fixture
def prom_clean():
    """vLLM registers its series in prometheus_client's global registry: start and end clean."""
    def clean():
        for c in list(REGISTRY._collector_to_names):
            if getattr(c, "_name", "").startswith("vllm:"):
                REGISTRY.unregister(c)
    clean()
    yield
    clean()


def test_known_sequence_exact_stats(pair, prom_clean):
    every_step = {"stats_interval": 0}  # a snapshot per step, so the last changes are collected
    d, p = pair({"policy": "lazy", **every_step}, {"send_mode": "whole", **every_step}, load_failure_policy="fail")
    d_out, p_out = [], []

    def ds():
        stats_step(d, d_out)

    def ps():
        stats_step(p, p_out, p_fill)

    # r1: finished (40 tokens: 3 blocks of 16).
    dreq = d_request("m1", p)
    d.sched.add_request(dreq)
    ds()
    preq = p_request("m1", d)
    p.sched.add_request(preq)
    assert run_until(lambda: dreq.is_finished() and preq.is_finished() and not p.sched.requests, ps, ds)
    assert dreq.status == RequestStatus.FINISHED_LENGTH_CAPPED
    # r2: aborted by vLLM while waiting for P (P never gets it): nothing reserved.
    dreq2 = d_request("m2", p)
    d.sched.add_request(dreq2)
    for _ in range(3):
        ds()
        ps()
    d.sched.finish_requests("d/m2", RequestStatus.FINISHED_ABORTED)
    for _ in range(3):
        ds()
        ps()
    # r3: D's data engine is gone when P writes: both layer transfers fail, P aborts, D releases.
    d.worker._worker.engine.shutdown()
    dreq3 = d_request("m3", p)
    d.sched.add_request(dreq3)
    ds()
    preq3 = p_request("m3", d)
    p.sched.add_request(preq3)
    assert run_until(lambda: dreq3.is_finished() and not p.sched.requests and not d.sched.requests, ps, ds)
    for _ in range(3):  # the last changes reach the next steps' stats
        ds()
        ps()

    # The payloads went through vLLM's Scheduler.make_stats (to_dict / .data); rebuild and
    # aggregate them as vLLM's KVConnectorLogging does, with our class found by vLLM's factory.
    assert d_out and p_out
    before = json.dumps(d_out + p_out)
    logs = {}
    for name, side, payloads in (("d", d, d_out), ("p", p, p_out)):
        lg = vmetrics.KVConnectorLogging(side.vc.kv_transfer_config)
        for data in payloads:
            lg.observe(data)
        acc = lg.transfer_stats_accumulator
        assert isinstance(acc, KvwireConnectorStats)
        agg = KvwireConnectorStats(data=json.loads(json.dumps(acc.data)))  # a copy, before log() resets
        lines = []
        lg.log(log_fn=lambda fmt, *a: lines.append(fmt % a))
        logs[name] = (agg, lines)
    # vLLM gives the same payload dicts to its Prometheus logger: logging must not change them.
    assert json.dumps(d_out + p_out) == before

    dstats, dlines = logs["d"]
    now = kvwire_now()
    dm = d_core(d).metrics(now)
    # D: exact counts.
    assert total(dstats, "d_arrived") == 3
    assert total(dstats, "d_reservations") == 2
    assert total(dstats, "d_reserved_blocks") == 6
    assert total(dstats, "d_releases") == 1  # m3's reservation, after P's abort
    assert total(dstats, "d_released_blocks") == 3
    assert total(dstats, "d_completed") == 1
    assert total(dstats, "d_promoted") == 1
    assert total(dstats, "d_first_tokens") == 1
    assert dstats.data["counters"]["d_failed|local_abort"] == 1
    assert dstats.data["counters"]["d_failed|remote_abort"] == 1
    assert total(dstats, "d_failed") == 2
    assert total(dstats, "d_bytes_received") == dm["bytes_received"] > 0
    # Block-seconds: the sum of the deltas is the core's cumulative figure, which is what the
    # D timeline records say (blocks × (promoted or released − reserved)).
    bs = dstats.data["counters"]["d_block_seconds_waiting|lazy"]
    assert bs == pytest.approx(dm["block_seconds_waiting"], rel=1e-9)
    recs = [json.loads(r) for r in timeline(d)]
    expect_bs = sum(r["blocks"] * ((r["d_promoted"] or r["d_released"]) - r["d_reserved"])
                    for r in recs if r["d_reserved"] is not None) / 1e9
    assert bs == pytest.approx(expect_bs, rel=1e-9) and bs > 0
    # decode_sent -> first_token of m1: one observation per part, parts sum to the total.
    parts = ["wait_for_p", "reservation_wait", "exposed_transfer", "report_delay", "promotion_delay", "first_step"]
    tot = hist(dstats, "d_decomposition|total")
    assert tot["count"] == 1 and sum(tot["buckets"]) == 1
    assert all(hist(dstats, f"d_decomposition|{x}")["count"] == 1 for x in parts)
    assert sum(hist(dstats, f"d_decomposition|{x}")["sum"] for x in parts) == pytest.approx(tot["sum"], rel=1e-9)
    m1 = next(r for r in recs if r["first_token"] is not None)
    assert tot["sum"] == pytest.approx((m1["first_token"] - m1["decode_sent"]) / 1e9, rel=1e-9)
    # Gauges: the newest scheduler value: nothing left.
    g = dstats.data["gauges"]["scheduler"]
    assert sum(v for k, v in g.items() if k.startswith("d_requests|")) == 0
    assert g["d_held_blocks"] == 0

    pstats, plines = logs["p"]
    pm = p_core(p).metrics()
    assert total(pstats, "p_scheduled") == 2
    assert total(pstats, "p_transfers") == 4  # whole mode: one per layer and request
    assert total(pstats, "p_transfers_done") == 2
    assert total(pstats, "p_transfers_failed") == 2
    assert total(pstats, "p_completed") == 1
    assert pstats.data["counters"]["p_failed|transfer_error"] == 1
    assert total(pstats, "p_failed") == 1
    assert total(pstats, "p_releases") == 2 and total(pstats, "p_released_blocks") == 6
    assert hist(pstats, "p_send_latency")["count"] == 1
    # The P worker's engine wrote m1's 2 layers × 3 blocks × K and V of 16×2×8 float32.
    block_bytes = 16 * 2 * 8 * 4
    assert total(pstats, "p_bytes_sent") == pm["bytes_sent"] == 2 * 3 * 2 * block_bytes
    # Whichever transport the engine picked (tcp asked; same-host peers may be upgraded to shm).
    writes = {k.split("|")[1]: v for k, v in pstats.data["counters"].items()
              if k.startswith("engine_bytes|") and k.endswith("|write") and v}
    assert len(writes) == 1, writes
    (xport, wbytes), = writes.items()
    assert wbytes == 2 * 3 * 2 * block_bytes
    assert pstats.data["counters"][f"engine_batches|{xport}|write"] == 2
    em = p.worker._worker.engine.metrics()
    assert total(pstats, "engine_errors") == engine_errors(em) >= 1  # m3's writes were refused
    # P's KV caches are its engine's only regions: pageable host memory on CPU.
    p_cache = sum(t.numel() * t.element_size() for t in p.worker._worker.caches.values())
    (pg,) = [g for src, g in pstats.data["gauges"].items() if src.startswith("worker")]
    assert (pg["engine_region_bytes|host"], pg["engine_region_bytes|pinned"]) == (p_cache, 0)
    assert hist(pstats, "engine_batch_latency")["count"] == 2

    # vLLM's periodic log line (KVConnectorLogging.log -> our reduce()).
    assert len(dlines) == 1 and dlines[0].startswith("KV Transfer metrics: ")
    assert "d_arrived=3" in dlines[0] and "d_failed=2" in dlines[0] and "d_aborted=1" in dlines[0]
    assert "d_reserved_blocks=6" in dlines[0] and "d_released_blocks=3" in dlines[0]
    assert len(plines) == 1 and "p_transfers=4" in plines[0] and "p_transfers_failed=2" in plines[0]
    assert f"engine_bytes={2 * 3 * 2 * block_bytes}" in plines[0]

    # vLLM's Prometheus glue builds our series and records the payloads.
    prom_cls = getattr(vmetrics, "KVConnectorProm", None) or getattr(vmetrics, "KVConnectorPrometheus")
    assert prom_cls is compat.KVConnectorProm
    prom = prom_cls(d.vc, ["model_name", "engine"], {0: ["m", "0"]})
    assert isinstance(prom.prom_metrics, KvwirePromMetrics)
    for data in d_out + p_out:
        prom.observe(data, 0)
    fams = {f.name: f for f in text_string_to_metric_families(generate_latest(REGISTRY).decode())}

    def sample(metric, suffix="", **labels):
        fam = fams[f"vllm:{SERIES[metric][1]}"]
        name = fam.name + suffix
        want = {"model_name": "m", "engine": "0", **labels}
        vals = [s.value for s in fam.samples if s.name == name and s.labels == want]
        assert len(vals) == 1, (name, want, [s for s in fam.samples if s.name == name])
        return vals[0]

    assert sample("d_arrived", "_total") == 3
    assert sample("d_reserved_blocks", "_total") == 6
    assert sample("d_failed", "_total", reason="local_abort") == 1
    assert sample("d_failed", "_total", reason="remote_abort") == 1
    assert sample("d_block_seconds_waiting", "_total", policy="lazy") == pytest.approx(bs, rel=1e-9)
    assert sample("p_transfers_failed", "_total") == 2
    assert sample("p_failed", "_total", reason="transfer_error") == 1
    assert sample("d_requests", state="waiting") == 0
    assert sample("d_held_blocks") == 0
    assert sample("d_decomposition", "_count", part="total") == 1
    assert sample("d_decomposition", "_sum", part="total") == pytest.approx(tot["sum"], rel=1e-6)
    # Cumulative `le` buckets equal our per-bucket counts, accumulated.
    from kvwire._kvwire import CONNECTOR_BUCKET_BOUNDS
    cum = 0
    for b, le in zip(tot["buckets"], CONNECTOR_BUCKET_BOUNDS):
        cum += b
        les = "+Inf" if math.isinf(le) else repr(float(le))
        assert sample("d_decomposition", "_bucket", part="total", le=les) == cum
    assert sample("engine_bytes", "_total", transport=xport, dir="write") == 2 * 3 * 2 * block_bytes
    assert sample("engine_batch_latency", "_count") == 2


def kvwire_now():
    import time

    return time.monotonic_ns()


def test_aggregates_across_tp_workers_with_vllms_aggregator():
    """Two TP workers' stats through vLLM's KVOutputAggregator: counters and histograms add up;
    each worker's gauges are kept under its own source and summed by reduce()."""
    from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator

    e = kvwire.Engine(listen="127.0.0.1:0")
    try:
        m = e.metrics()
    finally:
        e.shutdown()
    outs = []
    for rank, (nbytes, inflight) in enumerate([(100, 3), (50, 4)]):
        m["transports"]["tcp"]["write_bytes"] = nbytes
        m["transports"]["tcp"]["write_batches"] = rank + 1
        m["inflight_batches"] = inflight
        m["latency"] = [{"buckets": [(0.0, 0)] * 3 + [(0.0, rank + 1)] * 23, "sum_seconds": 0.001 * (rank + 1),
                         "count": rank + 1}]
        data = DeltaTracker(f"worker{rank}").delta(*flatten_engine(m))
        st = KvwireConnector.build_kv_connector_stats(data)
        outs.append(ModelRunnerOutput(req_ids=[], req_id_to_index={}, sampled_token_ids=[], logprobs=None,
                                      prompt_logprobs_dict={}, pooler_output=None,
                                      kv_connector_output=KVConnectorOutput(kv_connector_stats=st)))
    agg = KVOutputAggregator(expected_finished_count=2).aggregate(outs).kv_connector_output.kv_connector_stats
    assert isinstance(agg, KvwireConnectorStats)
    assert agg.data["counters"]["engine_bytes|tcp|write"] == 150
    assert agg.data["counters"]["engine_batches|tcp|write"] == 3
    h = agg.data["hists"]["engine_batch_latency"]
    assert h["count"] == 3 and h["buckets"][3] == 3 and h["sum"] == pytest.approx(0.003)
    assert set(agg.data["gauges"]) == {"worker0", "worker1"}
    r = agg.reduce()
    assert r["engine_bytes"] == 150 and r["engine_batches"] == 3
    assert r["engine_mean_batch_latency_ms"] == pytest.approx(1.0)
    # A newer payload of worker0 replaces its gauges, it does not add to them.
    newer = KvwireConnectorStats(data={"counters": {}, "hists": {}, "gauges": {"worker0": {"engine_inflight_batches": 1}}})
    agg.aggregate(newer)
    assert sum(g["engine_inflight_batches"] for g in agg.data["gauges"].values()) == 5
    assert not agg.is_empty()
    agg.reset()
    assert agg.is_empty() and agg.reduce() == {}


def test_replay_values_reproduce_buckets_and_sum():
    from kvwire.vllm.stats import BOUNDS

    bounds = BOUNDS["connector"]
    for buckets, s in [([1] + [0] * (len(bounds) - 1), 0.0), ([0, 2, 0, 1] + [0] * (len(bounds) - 4), 0.0012),
                       ([0] * (len(bounds) - 1) + [2], 200.0)]:
        vals = replay_values(buckets, s, bounds)
        got = [0] * len(bounds)
        for v in vals:
            got[next(i for i, b in enumerate(bounds) if v <= b)] += 1
        assert got == buckets
        assert sum(vals) == pytest.approx(s, abs=1e-12) or sum(buckets[:-1]) == 0 and s == 0.0


def test_zero_payloads_are_empty():
    st = KvwireConnector.build_kv_connector_stats()
    assert st.is_empty() and st.reduce() == {}
    st2 = KvwireConnector.build_kv_connector_stats({"counters": {"d_arrived": 0}, "hists": {}, "gauges": {}})
    assert st2.is_empty()


@pytest.mark.parametrize("bad", ["abc", -1, None])
def test_bad_stats_interval_is_refused(pair, bad):
    with pytest.raises(kvwire.InvalidArgumentError, match="stats_interval"):
        pair({"stats_interval": bad})
