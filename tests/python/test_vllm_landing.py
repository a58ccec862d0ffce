"""D's bounded landing pool (kvwire.vllm.landing), on CPU: ``staging: always`` with ``d_landing:
pool`` (the default) makes D's CPU KV cache take the path a CUDA cache takes. D registers the
pool only; P writes every request into slots of it; D's workers copy the slots into the
request's KV blocks, layer by layer as the layers land (``eager``, ``lazy``, ``jit``) or all at
once (``land``), and report the request only once the copies completed. In vLLM's real v1
Scheduler (the harness), every byte of D's cache checked against P's."""

import pytest

torch = pytest.importorskip("torch", reason="torch not installed in this venv (run tests/python/setup.sh)")

import kvwire  # noqa: E402
from kvwire.vllm import staging  # noqa: E402
from kvwire.vllm.landing import paired_runs  # noqa: E402
from cuda_standin import defer_copies  # noqa: E402


def test_paired_runs():
    assert paired_runs([], []) == []
    assert paired_runs([3, 4, 5, 9], [10, 11, 20, 21]) == [(3, 10, 2), (5, 20, 1), (9, 21, 1)]
    assert paired_runs([7, 6], [1, 2]) == [(7, 1, 1), (6, 2, 1)]


def test_staged_pool_options():
    assert staging.d_landing({}) == "pool" and staging.d_landing({"d_landing": "mirror"}) == "mirror"
    with pytest.raises(kvwire.InvalidArgumentError):
        staging.d_landing({"d_landing": "host"})
    assert staging.pool_slots({}, 10 * 4096, 4096) == 10
    assert staging.pool_slots({"land_pool_blocks": 3}, 10 * 4096, None) == 3
    with pytest.raises(kvwire.InvalidArgumentError, match="land_pool_blocks"):
        staging.pool_slots({}, 1 << 20, None)
    with pytest.raises(kvwire.InvalidArgumentError, match="raise staging_mb"):
        staging.pool_slots({}, 4095, 4096)
    assert staging.block_bytes(None) is None


# ---- in vLLM's scheduler ----------------------------------------------------------------------

vllm = pytest.importorskip("vllm", reason="vLLM not installed in this venv (run tests/python/setup.sh)")

from vllm_harness import (  # noqa: E402,F401 (mdir and pair: fixtures)
    LAYERS, RequestStatus, assert_no_leak, d_request, empty, hold_layer, holds, layer_empty, layer_holds, mdir,
    p_fill, p_request, pair, record_copies, run_until, timeline)

#: Bytes of one block over both layers (K and V): 2 x 16 tokens x 2 heads x 8 x float32, x 2 layers.
BLOCK_ALL_LAYERS = 2 * 16 * 2 * 8 * 4 * len(LAYERS)


def pool_mb(slots):
    return slots * BLOCK_ALL_LAYERS / (1 << 20)


def d_registered(d):
    """What D's data engine has registered, by kind of memory."""
    return d.worker._worker.engine.metrics()["region_bytes_by_kind"]


def landing(d):
    return d.worker._worker.land


def staged(policy, slots, **kw):
    return {"policy": policy, "staging": "always", "staging_mb": pool_mb(slots), **kw}


@pytest.mark.parametrize("send_mode", ["whole", "layerwise"])
@pytest.mark.parametrize("asked", [None, "eager", "jit", "land"])
def test_staged_d_lands_in_a_pool_an_eighth_of_its_cache(pair, send_mode, asked):
    """D's KV cache is 8x its staging_mb: D registers the landing pool only (no mirror, not the
    cache), keeps the policy the request asks for (lazy by default), and D's cache ends up with
    every byte, K and V; every layer was copied once, and every slot is back."""
    d, p = pair(staged("lazy", 8), {"send_mode": send_mode})
    cache_bytes = sum(t.numel() * t.element_size() for t in d.kv.values())
    assert cache_bytes == 8 * 8 * BLOCK_ALL_LAYERS
    w = d.worker._worker
    assert w.stager is not None and not w.stager.consumer and not w.stager.layers[LAYERS[0]].mirror
    assert all(t.shape[1] == 8 for t in w.landing.values())
    reg = d_registered(d)
    assert sum(reg.values()) == 8 * BLOCK_ALL_LAYERS <= pool_mb(8) * (1 << 20) == cache_bytes // 8
    copies = record_copies(d)
    dreq = d_request("b1", p)
    if asked:
        dreq.kv_transfer_params["kvwire_policy"] = asked
    d.sched.add_request(dreq)
    d.step()
    assert d.conn._sched.d_reqs["d/b1"].policy == (asked or "lazy")
    preq = p_request("b1", d)
    p.sched.add_request(preq)
    assert run_until(lambda: dreq.status == RequestStatus.RUNNING, lambda: p.step(p_fill), d.step)
    ids = d.sched.kv_cache_manager.get_block_ids("d/b1")[0]
    assert len(ids) == 3
    assert holds(d.kv, "b1", ids)
    if asked == "land":
        assert copies == [("d/b1", None)]  # every layer at once, once the blocks were reserved
    else:
        assert sorted(x for _, layers in copies for x in layers) == list(range(len(LAYERS)))
    assert run_until(lambda: dreq.is_finished() and not p.sched.requests, lambda: p.step(p_fill), d.step)
    assert_no_leak(d)
    assert_no_leak(p)
    assert sorted(d.conn._sched.land_free) == list(range(8))  # every slot back
    assert not d.conn._sched.slots_at_report and landing(d).idle
    assert d_registered(d) == reg


@pytest.mark.parametrize("d_landing", ["pool", "mirror"])
@pytest.mark.parametrize("policy", ["lazy", "eager"])
def test_each_layer_is_copied_as_soon_as_it_lands(pair, policy, d_landing):
    """P's last layer is held back: D has already copied layer 0 from the pool (or the mirror)
    into the request's KV blocks (and nothing of layer 1), and the request waits. Once the layer
    is released, only it is copied, and the request is reported with every byte."""
    d, p = pair(staged(policy, 8, d_landing=d_landing), {"send_mode": "layerwise"})
    copies = record_copies(d)
    release = hold_layer(p, len(LAYERS) - 1)
    dreq = d_request("lw", p)
    d.sched.add_request(dreq)
    d.step()
    p.sched.add_request(p_request("lw", d))
    assert run_until(lambda: copies, lambda: p.step(p_fill), d.step)
    assert copies == [("d/lw", [0])]
    ids = d.sched.kv_cache_manager.get_block_ids("d/lw")[0]
    assert layer_holds(d.kv, "lw", 0, ids) and layer_empty(d.kv, 1, ids)
    for _ in range(5):  # nothing else lands, nothing else is copied, nothing is reported
        p.step(p_fill)
        d.step()
    assert copies == [("d/lw", [0])] and dreq.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    release()
    assert run_until(lambda: dreq.status == RequestStatus.RUNNING, lambda: p.step(p_fill), d.step)
    assert copies == [("d/lw", [0]), ("d/lw", [1])]
    assert holds(d.kv, "lw", ids)
    assert run_until(lambda: dreq.is_finished() and not p.sched.requests, lambda: p.step(p_fill), d.step)
    assert_no_leak(d)
    assert_no_leak(p)
    sched = d.conn._sched
    assert sorted(sched.land_free) == list(range(sched.land_slots))
    assert sched.copied_layers == {"landing": 1, "complete": 1}


def test_one_steps_copies_go_out_together(pair):
    """Two requests' last layer lands between the same two steps of D: the next step copies both
    in one submission (one mark on the compute stream, one completion for both), and each
    request's blocks get its own bytes."""
    d, p = pair(staged("lazy", 8), {"send_mode": "layerwise"})
    land, calls = landing(d), []
    real = land.copy_all

    def copy_all(items):
        calls.append(sorted((req, tuple(layers)) for req, _, _, layers in items))
        return real(items)

    land.copy_all = copy_all
    release = hold_layer(p, len(LAYERS) - 1)
    dreqs = [d_request(f"m{i}", p) for i in range(2)]
    for r in dreqs:
        d.sched.add_request(r)
    d.step()
    for i in range(2):
        p.sched.add_request(p_request(f"m{i}", d))
    sched = d.conn._sched
    st = [sched.d_reqs[f"d/m{i}"] for i in range(2)]
    assert run_until(lambda: all(0 in s.copied for s in st), lambda: p.step(p_fill), d.step)
    before = land.stats["copies"]
    release()
    # D does not step: its driver thread takes in P's reports of the last layer for both
    assert run_until(lambda: all(1 in s.core.landed_layers(s.key) for s in st), lambda: p.step(p_fill))
    d.step()
    assert calls[-1] == [("d/m0", (1,)), ("d/m1", (1,))] and land.stats["copies"] == before + 1
    assert run_until(lambda: all(r.status == RequestStatus.RUNNING for r in dreqs), lambda: p.step(p_fill), d.step)
    for i, r in enumerate(dreqs):
        assert holds(d.kv, f"m{i}", d.sched.kv_cache_manager.get_block_ids(r.request_id)[0])
    assert run_until(lambda: all(r.is_finished() for r in dreqs) and not p.sched.requests,
                     lambda: p.step(p_fill), d.step)
    assert_no_leak(d)
    assert_no_leak(p)
    assert sorted(sched.land_free) == list(range(8))


def test_reported_only_once_the_last_copy_completed(pair):
    """The copies complete late (as stream copies do): the request stays WAITING_FOR_REMOTE_KVS,
    and its slots stay taken, until the last copy's event says done."""
    d, p = pair(staged("lazy", 8), {"send_mode": "layerwise"})
    events = defer_copies(d.worker._worker.stager, polls=float("inf"))
    sched = d.conn._sched
    dreq = d_request("late", p)
    d.sched.add_request(dreq)
    d.step()
    p.sched.add_request(p_request("late", d))
    # every layer landed, the request's report is with the workers: every copy was started
    assert run_until(lambda: "d/late" in sched.d_reqs and sched.d_reqs["d/late"].recv_sent,
                     lambda: p.step(p_fill), d.step)
    assert events
    ids = d.sched.kv_cache_manager.get_block_ids("d/late")[0]
    for _ in range(5):
        p.step(p_fill)
        d.step()
    assert dreq.status == RequestStatus.WAITING_FOR_REMOTE_KVS and empty(d.kv, ids)
    assert len(sched.land_free) == 8 - 3
    for ev in events:
        ev.synchronize()
    assert run_until(lambda: dreq.status == RequestStatus.RUNNING, d.step)
    assert holds(d.kv, "late", ids)
    assert run_until(lambda: dreq.is_finished() and not p.sched.requests, lambda: p.step(p_fill), d.step)
    assert_no_leak(d)
    assert sorted(sched.land_free) == list(range(8))


def test_abort_while_copying_holds_blocks_and_slots_until_the_copy_completed(pair):
    """D's request is aborted while layer 0 is being copied into its blocks and P still holds
    layer 1: the KV blocks stay held (the copy may still write them) and the slots stay taken
    (the copy may still read them, P may still write them), then both come back once, nothing
    leaks."""
    d, p = pair(staged("lazy", 4), {"send_mode": "layerwise"})
    sched = d.conn._sched
    events = defer_copies(d.worker._worker.stager, polls=float("inf"))
    release = hold_layer(p, len(LAYERS) - 1)
    dreq = d_request("ac", p)
    d.sched.add_request(dreq)
    d.step()
    p.sched.add_request(p_request("ac", d))
    assert run_until(lambda: events, lambda: p.step(p_fill), d.step)  # layer 0's copy started
    full = d.num_blocks - 1
    assert d.free_blocks() == full - 3 and len(sched.land_free) == 1
    d.sched.finish_requests("d/ac", RequestStatus.FINISHED_ABORTED)
    release()
    for _ in range(8):
        d.step()
        p.step(p_fill)
    assert d.free_blocks() == full - 3 and len(sched.land_free) == 1
    for ev in events:
        ev.synchronize()
    assert run_until(lambda: not d.sched.requests and not p.sched.requests and len(sched.land_free) == 4,
                     lambda: p.step(p_fill), d.step)
    assert sorted(sched.land_free) == list(range(4)) and not sched.slots_at_report
    assert_no_leak(d)
    assert_no_leak(p)


def test_failed_landing_copy_takes_the_load_error_path(pair):
    """The copy out of the pool fails: the request fails through vLLM's load-error path (its
    blocks in the invalid block ids), its slots come back, nothing leaks."""
    d, p = pair(staged("lazy", 8), {"send_mode": "layerwise"}, load_failure_policy="fail")

    def broken(after, pairs):
        raise RuntimeError("copy engine fault (test)")

    d.worker._worker.stager.dev.copy = broken
    dreq = d_request("cf", p)
    d.sched.add_request(dreq)
    d.step()
    p.sched.add_request(p_request("cf", d))
    assert run_until(lambda: dreq.status == RequestStatus.WAITING_FOR_REMOTE_KVS, lambda: p.step(p_fill), d.step)
    ids = list(d.sched.kv_cache_manager.get_block_ids("d/cf")[0])
    assert run_until(lambda: dreq.is_finished(), lambda: p.step(p_fill), d.step)
    assert dreq.status != RequestStatus.RUNNING
    assert set(ids) <= d.invalid and landing(d).stats["failed"] >= 1
    assert run_until(lambda: not p.sched.requests and not d.sched.requests, lambda: p.step(p_fill), d.step)
    assert_no_leak(d)
    assert_no_leak(p)
    assert sorted(d.conn._sched.land_free) == list(range(8))


@pytest.mark.parametrize("policy", ["lazy", "land"])
def test_staged_pool_too_full_waits_for_slots(pair, policy):
    """Two requests of 3 blocks each and a pool of 4 slots: the second waits for slots (P keeps
    its KV; with lazy, vLLM reserves none of its blocks meanwhile), takes them once the first
    was reported, and both arrive byte for byte."""
    d, p = pair(staged(policy, 4), {"send_mode": "layerwise"})
    sched = d.conn._sched
    reqs = {rid: d_request(rid, p) for rid in ("w1", "w2")}
    for rid, r in reqs.items():
        d.sched.add_request(r)
        d.step()
        p.sched.add_request(p_request(rid, d))

    def one_waits():
        st = [sched.d_reqs.get(r.request_id) for r in reqs.values()]
        return all(st) and sorted(s.slots is None for s in st) == [False, True]

    assert run_until(one_waits, lambda: p.step(p_fill), d.step)
    waiting = next(r for r in reqs.values() if sched.d_reqs[r.request_id].slots is None)
    if policy == "land":
        assert sched.d_by_key[sched.land_waiting[0][0]].req == waiting.request_id
    else:
        # vLLM keeps it waiting: no KV block allocated to it
        assert waiting.status == RequestStatus.WAITING
        assert not d.sched.kv_cache_manager.get_block_ids(waiting.request_id)[0]
    assert run_until(lambda: all(r.status == RequestStatus.RUNNING or r.is_finished() for r in reqs.values()),
                     lambda: p.step(p_fill), d.step)
    assert not sched.land_waiting
    for rid, r in reqs.items():
        ids = d.sched.kv_cache_manager.get_block_ids(r.request_id)[0]
        assert holds(d.kv, rid, ids), rid
    assert run_until(lambda: all(r.is_finished() for r in reqs.values()) and not p.sched.requests,
                     lambda: p.step(p_fill), d.step)
    assert_no_leak(d)
    assert_no_leak(p)
    assert sorted(sched.land_free) == list(range(4))


@pytest.mark.parametrize("policy", ["lazy", "land"])
def test_request_larger_than_the_pool_fails_without_a_mirror(pair, policy):
    """A request of 3 blocks and a pool of 2 slots: with no mirror to fall back to, it takes the
    load-error path; nothing leaks and the pool is untouched."""
    d, p = pair(staged(policy, 2), {}, load_failure_policy="fail")
    dreq = d_request("big", p)
    d.sched.add_request(dreq)
    d.step()
    p.sched.add_request(p_request("big", d))
    assert run_until(lambda: dreq.is_finished(), lambda: p.step(p_fill), d.step)
    assert dreq.status != RequestStatus.RUNNING
    assert sorted(d.conn._sched.land_free) == [0, 1] and not d.conn._sched.land_waiting
    assert not any(t.any() for t in d.worker._worker.landing.values())
    assert run_until(lambda: not p.sched.requests, lambda: p.step(p_fill), d.step)
    assert_no_leak(d)
    assert_no_leak(p)
    assert any('"outcome":"failed"' in r for r in timeline(d))


@pytest.mark.parametrize("policy", ["lazy", "land"])
def test_abort_of_a_landing_request_gives_its_slots_back(pair, policy):
    """D's request is aborted while its KV lands in the pool: its slots come back once P
    confirmed (nothing of it can land any more), and nothing leaks."""
    d, p = pair(staged(policy, 4), {"send_mode": "layerwise"})
    sched = d.conn._sched
    dreq = d_request("ab", p)
    d.sched.add_request(dreq)
    d.step()
    p.sched.add_request(p_request("ab", d))
    assert run_until(lambda: sched.d_reqs["d/ab"].slots, lambda: p.step(p_fill), d.step)
    assert len(sched.land_free) == 1
    d.sched.finish_requests("d/ab", RequestStatus.FINISHED_ABORTED)
    assert run_until(lambda: not d.sched.requests and not p.sched.requests and len(sched.land_free) == 4,
                     lambda: p.step(p_fill), d.step)
    assert sorted(sched.land_free) == list(range(4)) and not sched.slots_at_report
    assert_no_leak(d)
    assert_no_leak(p)
