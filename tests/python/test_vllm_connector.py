"""KvwireConnector inside vLLM's real v1 Scheduler (CPU), on the installed vLLM version:
loaded by vLLM's factory through kv_connector_module_path in both roles; lazy reservation holds
no D block until P started; WAITING_FOR_REMOTE_KVS -> finished_recving -> running with every
KV byte checked; aborts and failures release everything."""

import json
import os

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM not installed in this venv (run tests/python/setup.sh)")

import torch  # noqa: E402

import kvwire  # noqa: E402
from kvwire.vllm import KvwireConnector, KvwireConnectorMetadata  # noqa: E402
from cuda_standin import defer_copies  # noqa: E402
from vllm_harness import (  # noqa: E402,F401 (mdir and pair: fixtures)
    LAYERS, PEER_TIMEOUT, RequestStatus, Side, assert_no_leak, d_delayed, d_request, free_port, kv_pattern,
    make_request, mdir, p_delayed, p_fill, p_request, pair, run_until, timeline, wait_for)


def d_maps_empty(side):
    """No request left in D's scheduler-side connector maps, nothing queued for its workers."""
    s = side.conn._sched
    maps = dict(d_reqs=s.d_reqs, d_by_key=s.d_by_key, out_recv=s.out_recv, out_failed=s.out_failed,
                out_sending=s.out_sending, out_land=s.out_land)
    assert not {k: v for k, v in maps.items() if v}, "requests left in D's connector"
    assert all(c.live_requests == 0 for c in s.d_cores.values())


def p_maps_empty(side):
    s = side.conn._sched
    maps = dict(p_reqs=s.p_reqs, p_by_key=s.p_by_key, p_reports=s.p_reports, out_sending=s.out_sending)
    assert not {k: v for k, v in maps.items() if v}, "requests left in P's connector"
    assert all(c.live_requests == 0 for c in s.p_cores.values())
    assert wait_for(lambda: not side.worker._worker.sends), "sends left in P's worker"


def count_frees(side):
    """Counts, per request, how often vLLM's scheduler frees its blocks (``_free_blocks``)."""
    freed = {}
    real = side.sched._free_blocks

    def free_blocks(request):
        freed[request.request_id] = freed.get(request.request_id, 0) + 1
        return real(request)

    side.sched._free_blocks = free_blocks
    return freed


def check_kv(d, rid, block_ids):
    for li, name in enumerate(LAYERS):
        for i, b in enumerate(block_ids):
            assert torch.equal(d.kv[name][:, b], kv_pattern(rid, li, i)), (name, i, b)


def test_factory_loads_both_roles(pair):
    d, p = pair()
    for side in (d, p):
        assert type(side.conn) is KvwireConnector  # built by vLLM's Scheduler via the factory
        assert type(side.worker) is KvwireConnector
        assert side.vc.kv_transfer_config.kv_connector_module_path == "kvwire.vllm"
    so = d.sched.schedule()
    assert isinstance(so.kv_connector_metadata, KvwireConnectorMetadata)


@pytest.mark.parametrize("policy,send_mode", [("lazy", "whole"), ("lazy", "layerwise"), ("jit", "whole")])
def test_lazy_end_to_end(pair, policy, send_mode):
    d, p = pair({"policy": policy}, {"send_mode": send_mode})
    full = d.free_blocks()
    dreq = d_request("r1", p)
    d.sched.add_request(dreq)
    for _ in range(5):  # P has not started: D is asked every step and holds nothing
        d.step()
        assert dreq.status == RequestStatus.WAITING
        assert d.free_blocks() == full
    preq = p_request("r1", d)
    p.sched.add_request(preq)
    reserved = []

    def d_step():
        d.step()
        if dreq.status == RequestStatus.WAITING_FOR_REMOTE_KVS and not reserved:
            reserved.extend(d.sched.kv_cache_manager.get_block_ids("d/r1")[0])
            assert d.free_blocks() == full - 3

    p_held = []

    def p_step():
        p.step(p_fill)
        if preq.is_finished() and not p_held:
            # P's prefill is done and the request finished, but its blocks stay until sent.
            p_held.append(p.free_blocks())
            assert "p/r1" in p_delayed(p)

    assert run_until(lambda: dreq.status == RequestStatus.RUNNING, p_step, d_step)
    assert p_held == [full - 3]
    assert len(reserved) == 3  # 40 tokens in 16-token blocks, reserved only after P started
    check_kv(d, "r1", reserved)  # every byte of both layers, K and V
    assert run_until(lambda: dreq.is_finished() and preq.is_finished() and p.free_blocks() == full,
                     lambda: p.step(p_fill), d.step)
    assert_no_leak(d)
    assert_no_leak(p)
    rec = timeline(d)[-1]
    assert '"outcome":"finished"' in rec and f'"policy":"{policy}"' in rec


def test_p_records_its_queue_and_its_prefix_hits(pair):
    """P's timeline records what the cost model's source terms take, as P knew it when each
    request arrived: the prompt tokens queued ahead of it (a waiting request's prefix-cache hit
    looked up, not counted) and what P's prefix cache held of its own prompt."""
    d, p = pair({"policy": "lazy"}, {"send_mode": "whole"})
    first = [(7 * i) % 900 + 1 for i in range(64)]
    again = first[:48] + [(11 * i) % 900 + 1 for i in range(32)]  # 3 blocks of r1, then new
    fresh = [(13 * i) % 900 + 1 for i in range(40)]
    prompts = {"r1": first, "r2": again, "r3": fresh}
    reqs = {}

    def run(rids):
        for rid in rids:  # D first, then P: both arrive before P's next step
            reqs["d/" + rid] = d_request(rid, p, prompt=prompts[rid])
            d.sched.add_request(reqs["d/" + rid])
        for rid in rids:
            reqs["p/" + rid] = p_request(rid, d, prompt=prompts[rid])
            p.sched.add_request(reqs["p/" + rid])
        assert run_until(lambda: all(reqs[s + r].is_finished() for r in rids for s in ("d/", "p/"))
                         and not p_delayed(p), lambda: p.step(p_fill), d.step)

    run(["r1"])  # r1's blocks stay in P's prefix cache
    run(["r2", "r3"])  # r3 arrives while r2 waits
    recs = {}
    for line in timeline(p, n=3):
        r = json.loads(line)
        recs[r["transfer_id"]] = r
    assert {k: (recs[k]["p_cached_tokens"], recs[k]["p_queued_tokens"], recs[k]["p_waiting"])
            for k in prompts} == {"r1": (0, 0, 1), "r2": (48, 0, 1), "r3": (0, 32, 2)}
    assert all(recs[k]["tokens"] == len(prompts[k]) and recs[k]["p_running"] == 0 for k in prompts)


def test_eager_layerwise_sends_during_the_forward(pair):
    d, p = pair({"policy": "eager"}, {"send_mode": "layerwise"})
    full = d.free_blocks()
    dreq = d_request("r2", p, tokens=50)
    d.sched.add_request(dreq)
    d.step()
    assert dreq.status == RequestStatus.WAITING_FOR_REMOTE_KVS  # eager: reserved at arrival
    assert d.free_blocks() == full - 4
    reserved = list(d.sched.kv_cache_manager.get_block_ids("d/r2")[0])
    d.step()
    from kvwire.vllm.scheduler import request_key

    preq = p_request("r2", d, tokens=50)
    p.sched.add_request(preq)
    key = request_key("r2")
    posted = []

    def fill(side, so, li, name):
        s = side.worker._worker.sends.get(key)
        if li == 0 and so.scheduled_new_reqs:
            # D's block ids (eager: sent at arrival) reach P's worker straight from P's driver
            # thread once P's scheduler has the request: the forward waits for them here, so
            # that what follows does not depend on which came first.
            assert wait_for(lambda: side.worker._worker.sends.get(key) is not None
                            and side.worker._worker.sends[key].dst is not None)
        p_fill(side, so, li, name)
        if li > 0 and so.scheduled_new_reqs:
            s = side.worker._worker.sends[key]
            posted.append(s.sent[li - 1] == 4)  # layer li-1 went out before layer li ran

    p_step = lambda: p.step(fill)  # noqa: E731
    assert run_until(lambda: dreq.status == RequestStatus.RUNNING, p_step, d.step)
    assert posted == [True] * (len(LAYERS) - 1)
    check_kv(d, "r2", reserved)
    assert run_until(lambda: dreq.is_finished() and p.free_blocks() == full, p_step, d.step)
    assert_no_leak(d)
    assert_no_leak(p)


def chunk_fill(side, so, li, name):
    """P's stand-in attention for chunked prefills: every block a scheduled request holds gets
    its pattern (a later chunk's blocks too, which ``p_fill`` leaves alone)."""
    for rid in so.num_scheduled_tokens:
        for i, b in enumerate(side.sched.kv_cache_manager.get_block_ids(rid)[0]):
            side.kv[name][:, b] = kv_pattern(rid.split("/")[-1], li, i, side.rank, side.heads)


@pytest.mark.parametrize("policy", ["eager", "lazy", "land"])
def test_layer0_of_chunk0_lands_before_the_later_chunks_run(pair, policy):
    """A prompt of four chunks on P (max_num_batched_tokens 32, blocks of 16: two blocks a
    chunk), layerwise: inside P's first chunk's forward, between its layers 0 and 1, layer 0 of
    that chunk's two blocks is already on D (in its reserved KV blocks, or in its landing slots
    for land), so it landed before any later chunk ran, lazy and land as well as eager (D's
    reservation or slots reached P's workers in time). Then every byte lands."""
    d, p = pair({"policy": policy, "land_pool_blocks": 16}, {"send_mode": "layerwise"},
                p_kw={"max_num_batched_tokens": 32})
    dreq = d_request("c4", p, tokens=128)
    d.sched.add_request(dreq)
    p.sched.add_request(p_request("c4", d, tokens=128))
    early = []

    def on_d():
        st = d.conn._sched.d_reqs.get("d/c4")
        if st is None:
            return False
        if policy == "land":
            if not st.slots:
                return False
            where = [(d.worker._worker.landing[LAYERS[0]], st.slots[i]) for i in range(2)]
        else:
            ids = d.sched.kv_cache_manager.get_block_ids("d/c4")[0] if dreq.status == RequestStatus.WAITING_FOR_REMOTE_KVS else []
            if len(ids) < 2:
                return False
            where = [(d.kv[LAYERS[0]], ids[i]) for i in range(2)]
        return all(torch.equal(t[:, b], kv_pattern("c4", 0, i)) for i, (t, b) in enumerate(where))

    def fill(side, so, li, name):
        chunk_fill(side, so, li, name)
        first = any(n.req_id == "p/c4" for n in so.scheduled_new_reqs)
        if first and li == 1:
            # P is inside its first chunk's forward: D steps (its reservation, its slots) until
            # layer 0 of this chunk is there.
            early.append(run_until(on_d, d.step))

    assert run_until(lambda: dreq.status == RequestStatus.RUNNING or dreq.is_finished(), lambda: p.step(fill), d.step)
    assert early == [True], early
    assert dreq.status == RequestStatus.RUNNING, dreq.status
    check_kv(d, "c4", list(d.sched.kv_cache_manager.get_block_ids(dreq.request_id)[0]))


def test_abort_while_waiting_frees_everything(pair):
    d, p = pair({"policy": "lazy"})
    dreq = d_request("r3", p)
    d.sched.add_request(dreq)
    for _ in range(3):
        d.step()
    d.sched.finish_requests("d/r3", RequestStatus.FINISHED_ABORTED)
    for _ in range(3):
        d.step()
        p.step()
    assert_no_leak(d)
    d_maps_empty(d)


def test_abort_after_reservation_waits_for_p(pair):
    """Eager D sent its block ids to P, then aborts: the blocks stay until P confirms that no
    write is in flight, then they are freed (finished_sending)."""
    d, p = pair({"policy": "eager"})
    dreq = d_request("r4", p)
    d.sched.add_request(dreq)
    d.step()
    assert dreq.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    full = d.num_blocks - 1
    assert d.free_blocks() == full - 3
    d.sched.finish_requests("d/r4", RequestStatus.FINISHED_ABORTED)
    assert d.free_blocks() == full - 3  # held: P has the block ids
    assert "d/r4" in d_delayed(d)
    assert run_until(lambda: not d.sched.requests, d.step, p.step)
    assert_no_leak(d)
    d_maps_empty(d)


def test_abort_of_a_request_p_already_ended_is_confirmed(pair):
    """D aborts a request whose block ids P has, after P sent it all and forgot it (D had not
    taken in P's messages yet): P's connector hands D's Abort to the core that ran the request,
    which confirms at once, so D frees the blocks without waiting out its drain (set far beyond
    the test's bound here) and without giving P up."""
    from kvwire.vllm import envelope as env

    d, p = pair({"policy": "eager", "drain_timeout": 3600})
    dreq = d_request("r9", p)
    d.sched.add_request(dreq)
    d.step()
    assert dreq.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    ds = d.conn._sched
    (key,) = [st.key for st in ds.d_reqs.values()]
    real, held_back = ds._on_envelope, []

    def on_envelope(e, now):  # what P says about the request waits until D aborted it
        if e.kind == env.TO_D and env.message_request(e.payload) == key and held_back[-1:] != ["aborted"]:
            held_back.append(e)
            return
        real(e, now)

    ds._on_envelope = on_envelope
    full = p.free_blocks()
    preq = p_request("r9", d)
    p.sched.add_request(preq)
    ps = p.conn._sched
    assert run_until(lambda: preq.is_finished() and not ps.p_by_key and p.free_blocks() == full,
                     lambda: p.step(p_fill))
    assert held_back  # P said it sent the layers; D has not heard it
    held_back.append("aborted")
    d.sched.finish_requests("d/r9", RequestStatus.FINISHED_ABORTED)
    assert "d/r9" in d_delayed(d)  # P had the block ids: held until P confirms
    assert run_until(lambda: not d.sched.requests and not d_delayed(d), d.step, p.step, max_steps=2000)
    assert_no_leak(d)
    d_maps_empty(d)


@pytest.mark.parametrize("policy", ["lazy", "eager"])
def test_failed_transfer_takes_the_load_error_path(pair, policy):
    """D's data engine is gone when P writes: the transfer fails, P aborts, D reports the
    request's blocks through get_block_ids_with_load_errors and finished_recving; with
    kv_load_failure_policy=fail the request ends with an error, and nothing leaks."""
    d, p = pair({"policy": policy}, {}, load_failure_policy="fail")
    dreq = d_request("r5", p)
    d.sched.add_request(dreq)
    d.step()
    d.worker._worker.engine.shutdown()  # D's KV cache can no longer be written
    preq = p_request("r5", d)
    p.sched.add_request(preq)
    reserved = []
    if dreq.status == RequestStatus.WAITING_FOR_REMOTE_KVS:  # eager: reserved at arrival (the
        # failure may end the request within the first step of the loop below)
        reserved.extend(d.sched.kv_cache_manager.get_block_ids("d/r5")[0])

    def d_step():
        d.step()
        if dreq.status == RequestStatus.WAITING_FOR_REMOTE_KVS and not reserved:
            reserved.extend(d.sched.kv_cache_manager.get_block_ids("d/r5")[0])

    assert run_until(lambda: dreq.is_finished(), lambda: p.step(p_fill), d_step)
    assert dreq.status != RequestStatus.RUNNING
    assert set(reserved) and set(reserved) <= d.invalid  # the load-error path named them
    assert run_until(lambda: not p.sched.requests, lambda: p.step(p_fill), d.step)
    assert_no_leak(d)
    assert_no_leak(p)
    assert any('"outcome":"failed"' in r for r in timeline(p))
    assert any('"outcome":"failed"' in r for r in timeline(d))


@pytest.mark.parametrize("field,d_kw,p_kw,d_says", [
    ("block_size", {"block": 16}, {"block": 32}, "block_size: 16 vs 32"),
    ("dtype", {"dtype": "float16"}, {"dtype": "bfloat16"}, "dtype: float16 vs bfloat16"),
])
def test_incompatible_layout_is_refused_with_the_message(pair, caplog, field, d_kw, p_kw, d_says):
    """P and D differ in block size (16 vs 32) or KV dtype (fp16 vs bf16): the hellos' descriptors
    differ, D fails the request through the load-error path before reserving anything, P never
    writes (no P worker connects to D's data engine, D's cache stays zero), each side logs the
    difference once, and nothing leaks."""
    caplog.set_level("WARNING", logger="kvwire.vllm")
    d, p = pair({"policy": "eager"}, {"send_mode": "whole"}, p_kw=p_kw, **d_kw)
    dreq = make_request("d/c1", 40, {"do_remote_prefill": True, "transfer_id": "c1",
                                     "remote_control": p.conn.control_addr}, block=d.block)
    preq = make_request("p/c1", 40, {"do_remote_decode": True, "transfer_id": "c1",
                                     "remote_control": d.conn.control_addr}, max_tokens=1, block=p.block)
    d.sched.add_request(dreq)
    p.sched.add_request(preq)
    assert run_until(lambda: dreq.is_finished() and not p.sched.requests, p.step, d.step)
    assert dreq.status != RequestStatus.FINISHED_LENGTH_CAPPED  # it never ran
    assert d.invalid  # the load-error path named its blocks
    assert_no_leak(d)
    assert_no_leak(p)
    assert not p.conn._sched.p_reports
    assert d.worker._worker.engine.metrics()["connections_inbound"] == 0
    for name in LAYERS:
        assert not d.kv[name].any()
    p_says = d_says.replace(f"{field}: ", "").split(" vs ")
    p_says = f"{field}: {p_says[1]} vs {p_says[0]}"
    peer_lines = [r.getMessage() for r in caplog.records if "is incompatible with this instance" in r.getMessage()]
    assert sum(d_says in m for m in peer_lines) == 1, peer_lines  # D's line
    assert sum(p_says in m for m in peer_lines) == 1, peer_lines  # P's line
    assert any('"outcome":"failed"' in r for r in timeline(d))


def test_request_queued_on_p_outlives_wait_for_p(pair):
    """P runs one request at a time and is busy with a local one: the P/D request waits in P's
    queue for several times D's wait-for-P deadline (1 s here; 30 s was the old default) and
    still completes with every byte right, because P reported it queued the moment vLLM queued
    it (``on_new_request``: vLLM 0.33's call, backported to 0.18.1 by kvwire.vllm.compat)."""
    import time

    wait_s = 1.0
    d, p = pair({"policy": "lazy", "wait_for_p_timeout": wait_s}, {}, p_kw={"max_num_seqs": 1})
    occupant = make_request("p/busy", 40, None, max_tokens=1500)
    p.sched.add_request(occupant)
    p.step(p_fill)  # the occupant holds P's only slot
    dreq = d_request("q1", p)
    d.sched.add_request(dreq)
    preq = p_request("q1", d)
    p.sched.add_request(preq)
    start = time.monotonic()
    assert run_until(lambda: time.monotonic() - start > 3 * wait_s or dreq.is_finished(),
                     lambda: p.step(p_fill), d.step)
    assert not dreq.is_finished(), dreq.status  # D did not give up on a request P has queued
    assert preq.request_id not in p.conn._sched.p_reqs or not p.conn._sched.p_reqs[preq.request_id].scheduled
    assert preq.num_computed_tokens == 0  # still queued behind the occupant
    p.sched.finish_requests("p/busy", RequestStatus.FINISHED_ABORTED)
    assert run_until(lambda: dreq.status == RequestStatus.RUNNING or dreq.is_finished(),
                     lambda: p.step(p_fill), d.step)
    assert dreq.status == RequestStatus.RUNNING, dreq.status
    check_kv(d, "q1", list(d.sched.kv_cache_manager.get_block_ids(dreq.request_id)[0]))


def test_p_unreachable_fails_the_request(pair):
    """P's control address does not answer: D fails the request through the load-error path
    instead of waiting forever (lazy: it held no block before)."""
    d, p = pair({"policy": "lazy"})
    port = free_port()
    dreq = make_request("d/r6", 40, {"do_remote_prefill": True, "transfer_id": "r6",
                                     "remote_control": f"127.0.0.1:{port}"})
    d.sched.add_request(dreq)
    assert run_until(lambda: dreq.is_finished(), d.step)
    assert dreq.status != RequestStatus.FINISHED_LENGTH_CAPPED  # it never ran
    assert d.invalid  # reported through the load-error path
    assert_no_leak(d)


def test_p_that_never_answers_our_hello_fails_the_request(pair):
    """Something at P's control address takes our connection and our hello but never answers it
    (P's identity never arrives): D fails the request through the load-error path once
    wait_for_p_timeout has passed, instead of holding it forever."""
    from kvwire.vllm.control import ControlPlane

    mute = ControlPlane(engine_id="mute", incarnation=1, transport="tcp")  # no hello: answers none
    try:
        d, _ = pair({"policy": "lazy", "wait_for_p_timeout": 1.0})
        dreq = make_request("d/m1", 40, {"do_remote_prefill": True, "transfer_id": "m1",
                                         "remote_control": mute.addr})
        d.sched.add_request(dreq)
        assert run_until(lambda: dreq.is_finished(), d.step)
        assert dreq.status != RequestStatus.FINISHED_LENGTH_CAPPED  # it never ran
        assert d.invalid  # reported through the load-error path
        assert "mute" not in d.conn._sched.pid_of_engine
        assert not d.conn._sched.identity_wait
        assert_no_leak(d)
    finally:
        mute.close()


def test_p_back_at_an_unreachable_address_is_dialled_afresh(pair, mdir):
    """D found P's address unreachable (nothing listened there); then a P starts at that address
    (a restarted server): D's next request dials it again instead of failing on the old verdict,
    and completes with every byte right."""
    port = free_port()
    d, _ = pair({"policy": "lazy"})
    addr = f"127.0.0.1:{port}"
    first = make_request("d/u1", 40, {"do_remote_prefill": True, "transfer_id": "u1", "remote_control": addr})
    d.sched.add_request(first)
    assert run_until(lambda: first.is_finished(), d.step)
    assert addr in d.conn._sched.unreachable
    p = Side("kv_producer", {"transport": os.environ.get("KVWIRE_TEST_TRANSPORT", "auto"), "peer_timeout": PEER_TIMEOUT,
                             "data_listen": f"127.0.0.1:{free_port()}", "control_listen": addr}, mdir)
    try:
        assert p.conn.control_addr == addr
        dreq = d_request("u2", p)
        d.sched.add_request(dreq)
        p.sched.add_request(p_request("u2", d))
        assert run_until(lambda: dreq.status == RequestStatus.RUNNING or dreq.is_finished(),
                         lambda: p.step(p_fill), d.step)
        assert dreq.status == RequestStatus.RUNNING, dreq.status
        check_kv(d, "u2", list(d.sched.kv_cache_manager.get_block_ids(dreq.request_id)[0]))
        assert not d.conn._sched.redial_of
    finally:
        p.close()


def test_envelope_rejects_garbage():
    from kvwire.vllm import envelope as env

    tag = env.encode(env.TO_P, "engine-1", 7, "127.0.0.1:2", b"xyz")
    e = env.decode(tag)
    assert (e.kind, e.engine_id, e.incarnation, e.control, e.payload) == (env.TO_P, "engine-1", 7, "127.0.0.1:2", b"xyz")
    for bad in [b"", b"KVW2", b"XXXX\x01\x00\x00", tag[:9], b"KVW2\x01\xff\xff", b"KVW2\x63\x00\x00" + bytes(10)]:
        with pytest.raises(ValueError):
            env.decode(bad)
    with pytest.raises(ValueError):
        env.parse_report(b"\x09" + bytes(31))
    assert issubclass(kvwire.ConnectorError, kvwire.KvwireError)


def test_bundles_split_in_order_and_reject_garbage():
    from kvwire.vllm import envelope as env

    tags = [env.encode(env.REPORT, "e", 1, "a:1", bytes([i]) * i) for i in range(1, 6)]
    assert env.unbundle(env.bundle(tags)) == tags
    assert env.unbundle(tags[0]) == [tags[0]]  # a lone envelope is not a bundle
    whole = env.bundle(tags)
    for bad in [b"KVWB", whole[:-1], b"KVWB" + bytes(4), b"KVWB\xff\xff\xff\x7f" + tags[0], whole + b"\x01"]:
        with pytest.raises(ValueError):
            env.unbundle(bad)


def test_p_dies_while_d_waits(pair, caplog):
    """P's scheduler goes away after D announced the request (lazy: D holds nothing). D's next
    heartbeat to P fails, P is declared down, and the request ends through the load-error path
    with nothing leaked, instead of waiting for P forever. D's log says why it gave P up."""
    import logging
    import time

    caplog.set_level(logging.INFO, logger="kvwire.vllm")
    d, p = pair({"policy": "lazy"})
    dreq = d_request("r7", p)
    d.sched.add_request(dreq)
    for _ in range(3):
        d.step()
        p.step()
    assert dreq.status == RequestStatus.WAITING
    p.conn.shutdown()  # P's control engine is gone
    for _ in range(500):  # bounded: heartbeats go out every 0.5 s
        if dreq.is_finished():
            break
        d.step()
        time.sleep(0.01)
    assert dreq.is_finished()
    assert dreq.status != RequestStatus.FINISHED_LENGTH_CAPPED
    given_up = [(r.levelno, r.getMessage()) for r in caplog.records if "given up" in r.getMessage()]
    assert len(given_up) == 1 and "P " in given_up[0][1], given_up
    (level, msg), = given_up
    # D's heartbeat to P failed: the host reported P down (information, not the core's own
    # verdict, which would be a warning).
    assert level == logging.INFO and "reported down by the host" in msg, given_up
    assert_no_leak(d)


def test_long_forward_does_not_declare_a_heard_peer_down(pair):
    """P's forward runs longer than P's peer_timeout while D keeps running and sending to P:
    after the forward, P takes in D's queued messages before judging D's liveness, so D stays
    up and the request is not failed."""
    import time

    timeout = 2.0
    d, p = pair({"policy": "lazy"}, {"send_mode": "whole", "peer_timeout": timeout})
    dreq = d_request("r8", p)
    d.sched.add_request(dreq)
    for _ in range(2):
        d.step()
        p.step()
    preq = p_request("r8", d)
    p.sched.add_request(preq)

    def delivered():
        return p.conn._sched.control.engine.metrics()["notifications_delivered"]

    # P's step below starts right after D sent it something (a heartbeat), so that P has heard
    # from D just before its forward whatever the step times were so far.
    seen = delivered()
    assert run_until(lambda: delivered() != seen, lambda: time.sleep(0.05), d.step), "D sent nothing to P"

    stalled = []

    def long_forward(side, so, li, name):
        p_fill(side, so, li, name)
        if stalled or not so.scheduled_new_reqs:
            return
        # P's first forward of the request: D runs meanwhile until P's liveness tick is due
        # with D silent (as P last saw it) for longer than the timeout, and a message from D
        # arrived at P since P last looked.
        stalled.append(1)
        since, seen = time.monotonic(), delivered()
        cap = time.monotonic() + 60  # safety cap only: the loop ends on progress, not on this
        while time.monotonic() - since < 1.5 * timeout or delivered() == seen:
            assert time.monotonic() < cap, "D sent nothing to P within 60 s of stepping"
            d.step()
            time.sleep(0.02)

    p.step(long_forward)
    assert stalled and preq.is_finished()
    assert "p/r8" in p_delayed(p), "D was declared down although its messages were queued"
    assert not any('"outcome":"failed"' in r for r in timeline(p, n=0))
    # Cleanup only (P's short timeout makes outcomes past this point depend on step times).
    d.sched.finish_requests("d/r8", RequestStatus.FINISHED_ABORTED)
    assert run_until(lambda: not d.sched.requests and not p.sched.requests, d.step, p.step)
    assert_no_leak(d)
    assert_no_leak(p)


@pytest.mark.parametrize("when", ["recv_queued", "recv_emitted", "recv_seen", "landing"])
def test_abort_after_the_kv_landed_frees_once(pair, when):
    """D's request is aborted once every layer landed, before vLLM scheduled it:
    * ``recv_queued``: D's core reported it finished between two steps (it drains P's messages
      whenever a deadline is due), it is not yet in any step's metadata;
    * ``recv_emitted``: this step's metadata lists it in finished_recving, vLLM has not seen the
      workers' report yet (the abort comes in between, as with vLLM's batch queue);
    * ``recv_seen``: vLLM took the workers' finished_recving, it has not scheduled the request;
    * ``landing``: D stages (``staging: always``) and a mirror→cache copy is still running.
    vLLM frees the blocks on one report of a finished request (finished_recving or
    finished_sending) and asserts that a second one names a request it still has, so each
    ordering must end with the blocks freed exactly once, no assertion, D's pool whole, no request
    left in either connector and P's request done normally."""
    import time

    d_extra = {"policy": "lazy"}
    if when == "landing":
        d_extra.update(staging="always", staging_mb=1, d_landing="mirror")
    d, p = pair(d_extra, {"send_mode": "whole"})
    freed = count_frees(d)
    full = d.num_blocks - 1
    ds = d.conn._sched
    rid = f"a-{when}"
    dreq = d_request(rid, p)
    d.sched.add_request(dreq)
    d.step()
    preq = p_request(rid, d)
    p.sched.add_request(preq)
    p_step = lambda: p.step(p_fill)  # noqa: E731

    def abort(frees_now=False):
        """``frees_now``: vLLM has the finished_recving already, so nothing else is to come."""
        assert dreq.status == RequestStatus.WAITING_FOR_REMOTE_KVS and d.free_blocks() == full - 3
        d.sched.finish_requests(dreq.request_id, RequestStatus.FINISHED_ABORTED)
        assert dreq.is_finished()
        assert freed == ({dreq.request_id: 1} if frees_now else {})

    if when == "recv_queued":
        # D reserves (lazy: once P started) and sends its block ids; then only P steps while D's
        # scheduler takes in P's messages without stepping, so the finished report stays queued.
        assert run_until(lambda: dreq.status == RequestStatus.WAITING_FOR_REMOTE_KVS, p_step, d.step)

        # the connector's driver thread takes P's messages in without D stepping
        assert run_until(lambda: dreq.request_id in ds.out_recv, p_step)
        abort()
    elif when == "recv_emitted":
        emitted = []
        schedule = d.sched.schedule

        def schedule_then_abort():
            so = schedule()
            if dreq.request_id in so.kv_connector_metadata.finished_recving and not emitted:
                emitted.append(so)
                abort()
            return so

        d.sched.schedule = schedule_then_abort
        assert run_until(lambda: emitted, p_step, d.step)
    elif when == "recv_seen":
        assert run_until(lambda: dreq.request_id in d.sched.finished_recving_kv_req_ids, p_step, d.step)
        abort(frees_now=True)
    else:
        events = defer_copies(d.worker._worker.stager, polls=float("inf"))
        assert run_until(lambda: events, p_step, d.step)  # the landing started
        abort()
        for _ in range(5):
            d.step()
            p.step()
        assert d.free_blocks() == full - 3 and not freed  # the copy may still write into them
        for ev in events:  # the copies complete
            ev.synchronize()
    assert run_until(lambda: not d.sched.requests and not p.sched.requests, d.step, p_step)
    for _ in range(3):  # a report still due comes out (a second one asserts in vLLM)
        d.step()
        p.step()
    assert freed == {dreq.request_id: 1}
    assert_no_leak(d)
    assert_no_leak(p)
    d_maps_empty(d)
    p_maps_empty(p)
    assert preq.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert not any('"outcome":"failed"' in r for r in timeline(p))  # P's side ended normally
    if when == "landing":
        st = d.worker._worker.stager
        assert st.idle and d.worker._worker.land.idle


def test_rdma_near_option_picks_the_workers_gpu():
    from kvwire.vllm import worker
    from kvwire.vllm.options import Options

    assert Options.parse({}).rdma_near == "auto"
    assert Options.parse({"rdma_near": ""}).rdma_near == ""
    assert worker.rdma_near("") is None
    assert worker.rdma_near("0000:1b:00.0") == "0000:1b:00.0"
    assert worker.rdma_near("auto") == worker.gpu_pci_address()
    if torch.cuda.is_available():
        addr = worker.gpu_pci_address()
        assert addr is not None and len(addr) == 12 and addr[4] == ":" and addr[7] == ":", addr
    else:
        assert worker.gpu_pci_address() is None
