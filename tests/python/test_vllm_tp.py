"""KvwireConnector at tensor parallel size 2, inside vLLM's real v1 Scheduler (CPU), on the
installed vLLM version: two worker-side connectors per role (TP ranks 0 and 1, each with its own
KV shard filled with a rank-specific pattern), their addresses handed to the scheduler through
vLLM's handshake hooks, their outputs merged by vLLM's KVOutputAggregator. P's rank r writes into
D's rank r; every byte of each of D's shards is checked against P's; P's scheduler counts a layer
as sent only once both P ranks reported it; one rank's failure or a TP mismatch fails the request
through the load-error path with nothing leaked."""

import os
import pickle

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM not installed in this venv (run tests/python/setup.sh)")

import torch  # noqa: E402

import kvwire  # noqa: E402
from kvwire.testing.ports import free_port_run  # noqa: E402
from kvwire.vllm import envelope as env  # noqa: E402
from kvwire.vllm.connector import KvwireHandshake, rank_listen, request_key  # noqa: E402
from vllm_harness import (  # noqa: E402
    LAYERS, open_pair, PEER_TIMEOUT, RequestStatus, Side, assert_no_leak, d_request, kv_pattern,
    mdir, p_core, p_fill, p_request, run_until, timeline)

TP = 2


@pytest.fixture
def pair(mdir):
    sides = []

    def make(d_extra=None, p_extra=None, d_tp=TP, p_tp=TP, d_listen=None, **kw):
        return open_pair(sides, mdir, d_extra, p_extra, d_kw={"tp": d_tp, **kw}, p_kw={"tp": p_tp},
                         d_listen=d_listen or f"127.0.0.1:{free_port_run(d_tp)}", p_listen="127.0.0.1:0")

    yield make
    for s in sides:
        s.close()


def check_shards(d, rid, block_ids):
    """Every byte of every D rank's shard (both layers, K and V) is what P's same rank wrote."""
    for r in range(d.tp):
        for li, name in enumerate(LAYERS):
            for i, b in enumerate(block_ids):
                want = kv_pattern(rid, li, i, r, d.heads)
                assert torch.equal(d.kvs[r][name][:, b], want), (r, name, i, b)


def admit(d, dreq):
    """D steps until the request holds its blocks; returns their ids."""
    assert run_until(lambda: dreq.status == RequestStatus.WAITING_FOR_REMOTE_KVS or dreq.is_finished(), d.step)
    return list(d.sched.kv_cache_manager.get_block_ids(dreq.request_id)[0])


def test_rank_addressing():
    assert rank_listen("127.0.0.1:7000", 0) == "127.0.0.1:7000"
    assert rank_listen("127.0.0.1:7000", 3) == "127.0.0.1:7003"
    assert rank_listen("127.0.0.1:0", 1) == "127.0.0.1:0"
    assert rank_listen("[::1]:7000", 1) == "[::1]:7001"
    for bad in ["7000", "127.0.0.1:x", "127.0.0.1:70000", ":7000"]:
        with pytest.raises(kvwire.InvalidArgumentError):
            rank_listen(bad, 1)
    with pytest.raises(kvwire.InvalidArgumentError):
        rank_listen("127.0.0.1:65535", 1)


def test_ranks_announce_their_own_addresses(pair):
    d, p = pair(d_listen="127.0.0.1:0")  # ephemeral: only the handshake can tell P the ports
    metas = [w.get_handshake_metadata() for w in d.workers]
    assert [m.rank for m in metas] == [0, 1] and all(isinstance(m, KvwireHandshake) and m.tp == TP for m in metas)
    assert [m.data_addr for m in metas] == [w.data_addr for w in d.workers]
    assert [pickle.loads(pickle.dumps(m)) for m in metas] == metas  # it crosses processes in vLLM
    assert metas[0].data_addr != metas[1].data_addr
    assert d.conn._sched.rank_addrs == [m.data_addr for m in metas]
    # ... and they are what D's hello tells P, in rank order
    assert p.conn._sched.control.peer_hello[d.conn.engine_id]["data"] == [m.data_addr for m in metas]
    # A fixed data_listen: rank r listens on its port + r.
    d2, _ = pair()
    host, port = d2.workers[0].data_addr.rsplit(":", 1)
    assert d2.workers[1].data_addr == f"{host}:{int(port) + 1}"


@pytest.mark.parametrize("policy,send_mode,d_listen", [
    ("lazy", "whole", None), ("lazy", "layerwise", None), ("eager", "layerwise", "127.0.0.1:0"),
    ("jit", "whole", "127.0.0.1:0")])
def test_tp2_end_to_end(pair, policy, send_mode, d_listen):
    d, p = pair({"policy": policy}, {"send_mode": send_mode}, d_listen=d_listen)
    full = d.free_blocks()
    dreq = d_request("t1", p, tokens=50)
    d.sched.add_request(dreq)
    d.step()
    preq = p_request("t1", d, tokens=50)
    p.sched.add_request(preq)
    reserved = []

    def d_step():
        d.step()
        if dreq.status == RequestStatus.WAITING_FOR_REMOTE_KVS and not reserved:
            reserved.extend(d.sched.kv_cache_manager.get_block_ids("d/t1")[0])

    if dreq.status == RequestStatus.WAITING_FOR_REMOTE_KVS:  # eager: reserved at arrival
        reserved.extend(d.sched.kv_cache_manager.get_block_ids("d/t1")[0])
    assert run_until(lambda: dreq.status == RequestStatus.RUNNING, lambda: p.step(p_fill), d_step)
    assert len(reserved) == 4  # 50 tokens in 16-token blocks
    # The ranks' patterns differ: a shard landing on the wrong rank would be caught.
    assert not torch.equal(kv_pattern("t1", 0, 0, 0, d.heads), kv_pattern("t1", 0, 0, 1, d.heads))
    check_shards(d, "t1", reserved)
    assert run_until(lambda: dreq.is_finished() and preq.is_finished() and p.free_blocks() == full,
                     lambda: p.step(p_fill), d.step)
    assert_no_leak(d)
    assert_no_leak(p)
    ps = p.conn._sched
    assert not ps.p_reports
    assert '"outcome":"finished"' in timeline(d)[-1]
    assert p_core(p).metrics()["transfers_done"] == len(LAYERS)  # one per layer, not per rank


def test_layer_counts_only_when_every_rank_reported(pair):
    """P's rank 1 holds back its transfer reports: rank 0's alone never makes a layer sent, so D
    does not see the request finished; once rank 1's reports arrive, it is."""
    d, p = pair({"policy": "eager"}, {"send_mode": "whole"})
    dreq = d_request("t2", p)
    d.sched.add_request(dreq)
    reserved = admit(d, dreq)
    held = []
    w1 = p.workers[1]._worker
    real_report = w1._report

    def hold_sent(s, what, layer, ok, nbytes, t):  # rank 1 keeps its LAYER_SENT reports back
        if what == env.LAYER_SENT:
            held.append((s, what, layer, ok, nbytes, t))
        else:
            real_report(s, what, layer, ok, nbytes, t)

    w1._report = hold_sent
    preq = p_request("t2", d)
    p.sched.add_request(preq)
    ps = p.conn._sched
    key = request_key("t2")

    def rank0_taken_in():  # every layer's LAYER_SENT reported by rank 0 and taken in by P
        got = [ps.p_reports.get((key, env.LAYER_SENT, layer), {}) for layer in range(len(LAYERS))]
        return len(held) == len(LAYERS) and all(set(g) == {0} for g in got)

    assert run_until(rank0_taken_in, lambda: p.step(p_fill), d.step)
    for _ in range(5):  # rank 0 alone: nothing is sent as far as the core knows
        p.step(p_fill)
        d.step()
    assert dreq.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert p_core(p).metrics()["transfers_done"] == 0
    assert all(a[3] for a in held)  # rank 1's transfers themselves succeeded
    w1._report = real_report
    for a in held:
        real_report(*a)
    assert run_until(lambda: dreq.status == RequestStatus.RUNNING, lambda: p.step(p_fill), d.step)
    assert p_core(p).metrics()["transfers_done"] == len(LAYERS)
    check_shards(d, "t2", reserved)
    assert run_until(lambda: dreq.is_finished() and not p.sched.requests, lambda: p.step(p_fill), d.step)
    assert_no_leak(d)
    assert_no_leak(p)


@pytest.mark.parametrize("send_mode", ["whole", "layerwise"])
def test_one_rank_unreachable_fails_the_request(pair, send_mode):
    """D's rank 1 data engine is gone when P writes: P's rank 1 fails, rank 0 succeeds; P fails
    the request, D reports its blocks through the load-error path, P frees its blocks."""
    d, p = pair({"policy": "eager"}, {"send_mode": send_mode}, load_failure_policy="fail")
    dreq = d_request("t3", p)
    d.sched.add_request(dreq)
    reserved = admit(d, dreq)
    assert len(reserved) == 3
    d.workers[1]._worker.engine.shutdown()  # D rank 1's KV shard can no longer be written
    preq = p_request("t3", d)
    p.sched.add_request(preq)
    assert run_until(lambda: dreq.is_finished(), lambda: p.step(p_fill), d.step)
    assert dreq.status != RequestStatus.RUNNING and dreq.status != RequestStatus.FINISHED_LENGTH_CAPPED
    assert set(reserved) <= d.invalid  # the load-error path named them
    assert run_until(lambda: not p.sched.requests and p.free_blocks() == p.num_blocks - 1,
                     lambda: p.step(p_fill), d.step)
    assert_no_leak(d)
    assert_no_leak(p)
    ps = p.conn._sched
    assert not ps.p_reports
    assert p_core(p).metrics()["transfers_failed"] >= 1
    assert any('"outcome":"failed"' in r for r in timeline(p))
    assert any('"outcome":"failed"' in r for r in timeline(d))


@pytest.mark.parametrize("p_tp,d_tp", [(2, 1), (1, 2)])
def test_tp_mismatch_fails_cleanly(pair, p_tp, d_tp):
    """P and D run different TP sizes: P refuses to write (nothing is written into D), the
    request fails on D through the load-error path, and both sides free everything."""
    d, p = pair({"policy": "eager"}, {"send_mode": "whole"}, d_tp=d_tp, p_tp=p_tp)
    dreq = d_request("t4", p)
    d.sched.add_request(dreq)
    preq = p_request("t4", d)
    p.sched.add_request(preq)
    # The hellos carry each side's descriptor (TP size, heads per rank, layout): D refuses the
    # request before reserving anything, through the load-error path; P never gets block ids.
    assert run_until(lambda: dreq.is_finished() and not p.sched.requests, lambda: p.step(p_fill), d.step)
    assert dreq.status != RequestStatus.FINISHED_LENGTH_CAPPED  # it never ran
    assert d.invalid  # the load-error path named its blocks
    assert_no_leak(d)
    assert_no_leak(p)
    ps = p.conn._sched
    assert not ps.p_reports
    for w in d.workers:
        assert w._worker.engine.metrics()["connections_inbound"] == 0  # no P worker connected to write
    for r in range(d.tp):
        for name in LAYERS:
            assert not d.kvs[r][name].any()
    assert any('"outcome":"failed"' in r for r in timeline(d))


def test_incomplete_handshake_announces_nothing(mdir):
    """A TP-2 scheduler without every rank's handshake announces no data address (P then fails
    the request as a TP mismatch), never a partial list nor data_listen alone (which would send
    every P rank to D's rank 0)."""
    side = Side("kv_consumer", {"data_listen": f"127.0.0.1:{free_port_run(TP)}", "peer_timeout": PEER_TIMEOUT},
                mdir, tp=TP)
    try:
        sched = side.conn._sched
        full = list(sched.rank_addrs)
        assert len(full) == TP  # the harness handed both ranks' handshakes over
        m0, m1 = (w.get_handshake_metadata() for w in side.workers)
        sched.rank_addrs = []  # as before any handshake at TP > 1
        for bad in [{0: m0}, {0: m0, 1: m0}, {0: m0, 1: KvwireHandshake(1, 4, m1.data_addr)}, {}]:
            side.conn.set_xfer_handshake_metadata(bad)
            assert sched.rank_addrs == [], bad
            assert sched._hello()["data"] == []
        side.conn.set_xfer_handshake_metadata({0: m0, 1: m1})
        assert sched.rank_addrs == full
    finally:
        side.close()


def test_malformed_rank_reports_are_dropped(pair):
    """A transfer report naming a rank P does not have, or in the TP-less format, counts as a bad
    message and changes nothing."""
    from kvwire.vllm.control import ControlPlane

    d, p = pair()
    ps = p.conn._sched
    ctl = ControlPlane(engine_id="stranger", incarnation=1, transport=os.environ.get("KVWIRE_TEST_TRANSPORT", "auto"))
    try:
        key = request_key("t5")
        ctl.send(p.conn.control_addr, env.REPORT, env.report(env.LAYER_SENT, key, 0, True, 10, TP, 1))  # rank 2 of 2
        ctl.send(p.conn.control_addr, env.REPORT, env.report(env.LAYER_SENT, key, 0, True, 10, 0, 1)[:-2])  # short
        assert run_until(lambda: ps.control.bad_messages == 2, p.step)
        assert not ps.p_reports
    finally:
        ctl.close()
