"""``staging: device`` (kvwire.vllm.staging): KV caches registered as device regions where they
are, no host staging, on CPU. In vLLM's real v1 Scheduler (the harness): CPU caches in this mode,
every byte checked in D's cache; then its CUDA branch against a recording stand-in for
``torch.cuda`` whose events complete only when the test says so (P's writes wait for the layer's
compute and are posted by the forward's hooks, a write of a failed request is never posted, CUDA
caches and D's landing pool registered as device regions on the caches' device)."""

import json
import time

import pytest

torch = pytest.importorskip("torch", reason="torch not installed in this venv (run tests/python/setup.sh)")
vllm = pytest.importorskip("vllm", reason="vLLM not installed in this venv (run tests/python/setup.sh)")

import kvwire  # noqa: E402
from cuda_standin import StandInCuda  # noqa: E402
from kvwire.vllm import staging  # noqa: E402
from kvwire.vllm.landing import LandingCopies  # noqa: E402
from vllm_harness import (  # noqa: E402,F401 (mdir and pair: fixtures)
    LAYERS, RequestStatus, assert_no_leak, d_request, empty, holds, mdir, p_fill, p_request, pair, run_until,
    timeline, wait_for)


def worker(side):
    return side.worker._worker


def stager(side):
    return worker(side).stager


class Counting:
    """An engine whose writes are counted (every other call goes to the engine)."""

    def __init__(self, engine):
        self.engine, self.writes = engine, 0

    def write(self, peer, ops, **kw):
        self.writes += 1
        return self.engine.write(peer, ops, **kw)

    def __getattr__(self, name):
        return getattr(self.engine, name)


@pytest.mark.parametrize("send_mode", ["whole", "layerwise"])
@pytest.mark.parametrize("policy", ["lazy", "land"])
def test_device_mode_registers_the_caches_themselves(pair, policy, send_mode):
    """``staging: device`` on CPU caches: no stager on either side, the caches themselves (and
    D's landing pool, for ``land``) registered and written, every byte checked in D's cache."""
    d, p = pair({"policy": policy, "staging": "device"}, {"send_mode": send_mode, "staging": "device"})
    for s in (d, p):
        assert stager(s) is None and worker(s).marks is None  # CPU caches: no CUDA events
    assert bool(worker(d).landing) == (policy == "land")
    dreq = d_request("v1", p)
    d.sched.add_request(dreq)
    d.step()
    p.sched.add_request(p_request("v1", d))
    assert run_until(lambda: dreq.status == RequestStatus.RUNNING, lambda: p.step(p_fill), d.step)
    blocks = d.sched.kv_cache_manager.get_block_ids("d/v1")[0]
    assert len(blocks) == 3 and holds(d.kv, "v1", blocks)
    assert run_until(lambda: not p.sched.requests and not d.sched.requests, lambda: p.step(p_fill), d.step)
    assert_no_leak(d)
    assert_no_leak(p)


def test_device_writes_wait_for_the_layer_compute(pair, monkeypatch):
    """The CUDA branch of ``staging: device`` against a stand-in torch.cuda whose events complete
    only when the test says so: P records an event on the compute stream after each layer and
    posts no write before it completed (the forward itself never waits for it); once the test
    completes the events, the worker's thread posts the writes and D receives every byte. D's
    landing copy out of a GPU pool is waited for before the slots go back."""
    fake = StandInCuda()
    done = {"now": False}
    real_query = fake.Event.query
    monkeypatch.setattr(fake.Event, "query", lambda ev: real_query(ev) and done["now"])
    monkeypatch.setattr(staging, "cuda", fake)
    d, p = pair({"policy": "eager", "staging": "device"}, {"send_mode": "layerwise", "staging": "device"})
    w = worker(p)
    w.marks = staging.DeviceCopies(torch.device("cuda", 0))
    w.engine = Counting(w.engine)
    dreq = d_request("v2", p)
    d.sched.add_request(dreq)
    d.step()
    preq = p_request("v2", d)
    p.sched.add_request(preq)
    # P's prefill runs to its end (both layers computed, D's block ids known) with the events
    # pending: nothing is written, D's request waits.
    assert run_until(lambda: any(s.prefill_done and s.dst is not None and all(s.inflight) for s in w.sends.values()),
                     lambda: p.step(p_fill), d.step)
    computed = [e for e in fake.log if e[0] == "record" and e[1] == "compute"]
    assert len(computed) >= len(LAYERS)
    assert w.marks._stream is None  # P only marks events: no side stream was made
    p.step(p_fill)
    d.step()
    assert w.engine.writes == 0 and dreq.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert not any(s.first_write for s in w.sends.values())  # its first byte is not on the wire yet
    blocks = d.sched.kv_cache_manager.get_block_ids("d/v2")[0]
    assert empty(d.kv, blocks)
    # The worker's thread stops: the forward's own hooks must post the writes now.
    w._stop = True
    w._bg.join()
    released = time.monotonic_ns()
    done["now"] = True  # the layers' kernels completed
    p.step(p_fill)
    assert w.engine.writes == len(LAYERS)
    assert run_until(lambda: dreq.status == RequestStatus.RUNNING, lambda: p.step(p_fill), d.step)
    assert w.engine.writes == len(LAYERS) and holds(d.kv, "v2", blocks)
    assert run_until(lambda: not p.sched.requests and not d.sched.requests, lambda: p.step(p_fill), d.step)
    assert_no_leak(d)
    assert_no_leak(p)
    # P's first write went out after the events completed (one process: one monotonic clock).
    (rec,) = [json.loads(r) for r in timeline(p)]
    assert rec["p_first_write"] >= released, rec
    # D with a landing pool on the GPU: the copy out of the pool runs on a side stream, after
    # the compute stream's work so far; the request stays busy (not reported, its slots not
    # given back) until the copy's event completed.
    pools = {n: torch.zeros(2, 4, *d.kv[n].shape[2:]) for n in LAYERS}
    land = LandingCopies(staging.DeviceCopies(torch.device("cuda", 0)), LAYERS, d.kv, pools, {n: 2 for n in LAYERS})
    fake.log.clear()
    done["now"] = False
    land.copy("r", [1], [5])
    # (D's worker thread binds itself to the device meanwhile: its set_device is not the copy's)
    log = [e for e in fake.log if e[0] != "set_device"]
    assert [e[:2] for e in log] == [("record", "compute"), ("enter", "side"), ("wait", "side"), ("record", "side"),
                                    ("exit", "side")], fake.log
    assert land.busy("r") and not land.idle
    done["now"] = True
    assert not land.busy("r") and land.idle
    # One step's copies of two requests (and one refused: slot 9 is past the pool) go out
    # behind one mark, and complete with one event.
    fake.log.clear()
    done["now"] = False
    land.copy_all([("a", [0], [6], [0]), ("b", [1, 2], [7, 8], None), ("bad", [9], [9], None)])
    log = [e for e in fake.log if e[0] != "set_device"]
    assert [e[:2] for e in log] == [("record", "compute"), ("enter", "side"), ("wait", "side"), ("record", "side"),
                                    ("exit", "side")], fake.log
    assert land.busy("a") and land.busy("b") and not land.busy("bad") and land.take_failed("bad") == {9}
    done["now"] = True
    assert not land.busy("a") and not land.busy("b") and land.idle


def test_device_write_of_a_failed_request_is_never_posted(pair, monkeypatch):
    """A write waiting for its layer's event when the request fails (here: cancelled) is dropped,
    never posted after the failure."""
    fake = StandInCuda()
    monkeypatch.setattr(fake.Event, "query", lambda ev: False)
    monkeypatch.setattr(staging, "cuda", fake)
    d, p = pair({"policy": "eager", "staging": "device"}, {"send_mode": "layerwise", "staging": "device"})
    w = worker(p)
    w.marks = staging.DeviceCopies(torch.device("cuda", 0))
    w.engine = Counting(w.engine)
    d.sched.add_request(d_request("v3", p))
    d.step()
    p.sched.add_request(p_request("v3", d))
    assert run_until(lambda: any(s.dst is not None and any(s.inflight) for s in w.sends.values()),
                     lambda: p.step(p_fill), d.step)
    (key, s), = w.sends.items()
    with w.lock:
        w._on_work({"op": "cancel", "key": key}, s.sched)
        w._reap()
    assert s.failed and not any(s.inflight) and w.engine.writes == 0
    monkeypatch.setattr(fake.Event, "query", lambda ev: True)  # the layers complete after the cancel
    with w.lock:
        w._reap()
    assert w.engine.writes == 0


def test_device_mode_registers_cuda_caches_as_device_regions(mdir, monkeypatch):
    """``staging: device`` with caches that say they are on CUDA (CPU tensors standing in, with
    torch.cuda and the registration recorded): every cache and D's landing pool registered as
    device regions (``ipc``), the pool allocated on the caches' device, the compute events taken
    on it and the worker's thread bound to it; caches on two devices are refused."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm_harness import kv_cache_config, vllm_config

    class OnCuda(torch.Tensor):
        @property
        def device(self):
            return torch.device("cuda", 1)

    fake = StandInCuda()
    monkeypatch.setattr(staging, "cuda", fake)
    registered, zeros = [], []
    real_zeros = torch.zeros

    def register(engine, t, access="rw", pinned=False, ipc=False):
        registered.append((str(t.device), ipc, pinned))
        return real_register(engine, t.as_subclass(torch.Tensor), access)

    def zeros_on(*shape, device=None, **kw):
        zeros.append(str(device))
        t = real_zeros(*shape, **kw)
        return t.as_subclass(OnCuda) if str(device).startswith("cuda") else t

    real_register = kvwire.register_tensor
    kv = {n: real_zeros(2, 64, 16, 2, 8).as_subclass(OnCuda) for n in LAYERS}
    vc = vllm_config("kv_consumer", {"staging": "device", "policy": "land", "land_pool_blocks": 4}, mdir)
    w = KVConnectorFactory.create_connector(vc, KVConnectorRole.WORKER, kv_cache_config(64))
    try:
        with monkeypatch.context() as m:
            m.setattr(kvwire, "register_tensor", register)
            m.setattr(torch, "zeros", zeros_on)
            w.register_kv_caches(kv)
        ws = w._worker
        assert ws.stager is None and ws.marks is not None and str(ws.marks.device) == "cuda:1"
        assert registered == [("cuda:1", True, False)] * (2 * len(LAYERS)), registered
        assert zeros == ["cuda:1"] * len(LAYERS)
        assert wait_for(lambda: ("set_device", "cuda:1") in fake.log)
    finally:
        w.shutdown()
    kv2 = dict(kv)
    kv2[LAYERS[0]] = real_zeros(2, 64, 16, 2, 8)
    w = KVConnectorFactory.create_connector(vc, KVConnectorRole.WORKER, kv_cache_config(64))
    try:
        with pytest.raises(kvwire.InvalidArgumentError, match="one device"):
            w.register_kv_caches(kv2)
    finally:
        w.shutdown()
