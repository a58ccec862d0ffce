"""KvwireConnector with staged KV caches (kvwire.vllm.staging), on CPU: ``staging: always`` makes
a CPU KV cache take the path a CUDA cache takes (P: gathered into a bounded host pool, written
from there; D, ``d_landing: mirror``: a host landing mirror registered in place of the cache,
each layer copied into the cache as it lands, the request reported once the copies completed),
with synchronous copies instead of stream copies. Unit tests of the pool and of the staged sends and landings over real kvwire engines,
then the whole path in vLLM's real v1 Scheduler (the harness), every byte of D's cache checked
against P's. D's bounded landing pool (``d_landing: pool``) is in test_vllm_landing.py."""

import os
import sys

import pytest

torch = pytest.importorskip("torch", reason="torch not installed in this venv (run tests/python/setup.sh)")

import kvwire  # noqa: E402
from kvwire.vllm import staging  # noqa: E402
from kvwire.vllm.landing import LandingCopies  # noqa: E402
from kvwire.vllm.staging import ALIGN, PoolAllocator, Staging, runs  # noqa: E402
from cuda_standin import StandInCuda, defer_copies  # noqa: E402



# ---- unit tests: no vLLM ----------------------------------------------------------------------

def test_pool_allocator_first_fit_align_and_merge():
    pool = PoolAllocator(10 * ALIGN + 17)
    assert pool.capacity == 10 * ALIGN  # the tail that cannot hold an aligned chunk is unused
    a = pool.alloc(1)  # rounded up to ALIGN
    b = pool.alloc(3 * ALIGN)
    c = pool.alloc(2 * ALIGN + 1)  # 3 units
    assert (a, b, c) == (0, ALIGN, 4 * ALIGN)
    assert pool.used == 7 * ALIGN
    assert pool.alloc(4 * ALIGN) is None  # 3 units left
    pool.release(b, 3 * ALIGN)
    assert pool.alloc(4 * ALIGN) is None  # 3 + 3 free units, not adjacent
    d = pool.alloc(2 * ALIGN)  # first fit: b's hole
    assert d == ALIGN
    pool.release(a, 1)
    pool.release(d, 2 * ALIGN)  # a + d + the rest of b's hole merge: [0, 4)
    assert pool.free[0] == [0, 4 * ALIGN]
    pool.release(c, 2 * ALIGN + 1)  # and with c and the tail: one range
    assert pool.free == [[0, 10 * ALIGN]] and pool.used == 0
    assert pool.alloc(10 * ALIGN) == 0 and pool.alloc(1) is None
    assert PoolAllocator(ALIGN - 1).alloc(1) is None


def test_runs():
    assert runs([]) == []
    assert runs([3, 4, 5, 9, 1, 2]) == [(0, 3, 3), (3, 9, 1), (4, 1, 2)]


def test_options():
    assert staging.parse_options({}) == ("auto", 256 << 20)
    assert staging.parse_options({"staging": "always", "staging_mb": "0.5"}) == ("always", 1 << 19)
    assert staging.parse_options({"transport": "cuda_ipc"})[0] == "device"
    assert staging.parse_options({"transport": "cuda_ipc", "staging": "always"})[0] == "always"
    assert staging.parse_options({"transport": "shm"})[0] == "auto"
    for bad in [{"staging": "yes"}, {"staging_mb": 0}, {"staging_mb": "x"}, {"staging_mb": float("nan")},
                {"staging_mb": -1}]:
        with pytest.raises(kvwire.InvalidArgumentError):
            staging.parse_options(bad)
    assert staging.wanted("auto", ["cuda"]) and not staging.wanted("auto", ["cpu"])
    assert staging.wanted("always", ["cpu"]) and not staging.wanted("never", ["cuda"])
    with pytest.raises(kvwire.UnsupportedError):
        staging.DeviceCopies(torch.device("meta"))


BB = 256  # bytes per (block, half) in the unit tests: [2, blocks, 8, 8] float32


def cache(blocks, fill=None):
    t = torch.zeros(2, blocks, 8, 8)
    if fill is not None:
        g = torch.Generator().manual_seed(fill)
        t.copy_(torch.rand(t.shape, generator=g))
    return t


@pytest.fixture
def engines():
    made = []

    def make():
        e = kvwire.Engine(transport=os.environ.get("KVWIRE_TEST_TRANSPORT", "auto"))
        made.append(e)
        return e

    yield make
    for e in made:
        e.shutdown()


def sender(engines, pool_blocks, blocks=16):
    """A P-side stager over a filled cache, a D engine with a zeroed cache registered, the peer."""
    pe, de = engines(), engines()
    src = cache(blocks, fill=1)
    st = Staging(pe, torch.device("cpu"), pool_blocks * 2 * BB, producer=True, consumer=False)
    assert st.add_layer("l0", src, 2, blocks, BB) is None  # only sends: nothing offered
    dst = cache(blocks)
    kvwire.register_tensor(de, dst, "rw")
    peer = pe.connect(de.listen_addr)
    return st, src, dst, peer, peer.regions()[0]


def test_staged_send_splits_queues_and_lands_every_byte(engines):
    st, src, dst, peer, remote = sender(engines, pool_blocks=2)
    s_ids, d_ids = [3, 4, 5, 9, 0], [7, 8, 1, 2, 15]
    st.send(peer, "l0", s_ids, d_ids, remote, 16, "t1")
    st.send(peer, "l0", [10], [11], remote, 16, "t2")  # queued behind t1's pieces (FIFO)
    assert st.stats["split"] == 1
    out = st.reap(block=True)
    assert out == [("t1", True, 5 * 2 * BB), ("t2", True, 2 * BB)]
    assert st.stats["pieces"] == 4 and st.stats["waited"] >= 1  # the pool holds 2 blocks
    assert st.idle and st.pool.used == 0
    want = torch.zeros_like(dst)
    for s, d in zip(s_ids + [10], d_ids + [11]):
        want[:, d] = src[:, s]
    assert torch.equal(dst, want)  # every byte, K and V, nothing else written


def test_staged_send_writes_only_after_the_copy_completed(engines):
    """Copies that complete late (as CUDA stream copies do): the chunk is written only once its
    copy's event says done. Writing earlier would send the chunk's stale zeros."""
    st, src, dst, peer, remote = sender(engines, pool_blocks=4)
    events = defer_copies(st, polls=8)
    st.send(peer, "l0", [1, 2], [5, 6], remote, 16, "t")
    assert len(events) == 1 and not events[0].done
    assert st.reap(block=False) == [] and not events[0].done
    assert st.stats["staged_bytes"] == 0  # nothing written while the copy is pending
    assert not dst.any()
    out = []
    for _ in range(MAX_STEPS):  # polled until the copy completes
        out += st.reap(block=False)
        if events[0].done:
            break
    assert events[0].done and st.stats["staged_bytes"] == 2 * 2 * BB  # written once it completed
    out += st.reap(block=True)
    assert out == [("t", True, 2 * 2 * BB)]
    assert torch.equal(dst[:, 5:7], src[:, 1:3])
    assert st.idle


class FailingEngine:
    """The stager's engine with writes that fail at submission (``at="submit"``) or at
    completion (``at="complete"``)."""

    class Batch:
        def poll(self):
            raise kvwire.PeerDeadError("injected: peer died during the write")

        wait = poll

    def __init__(self, engine, at):
        self.engine, self.at, self.writes = engine, at, 0

    def write(self, peer, ops, **kw):
        self.writes += 1
        if self.at == "submit":
            raise kvwire.PeerDeadError("injected: peer unreachable")
        return FailingEngine.Batch()

    def __getattr__(self, name):
        return getattr(self.engine, name)


@pytest.mark.parametrize("at", ["submit", "complete"])
def test_failed_staged_write_frees_its_chunk(engines, at):
    st, src, dst, peer, remote = sender(engines, pool_blocks=2)
    st.engine = FailingEngine(st.engine, at)
    st.send(peer, "l0", [1, 2, 3, 4, 5], [1, 2, 3, 4, 5], remote, 16, "bad")  # 3 pieces
    assert st.reap(block=True) == [("bad", False, 0)]  # reported once, as failed
    assert st.engine.writes == 1  # the pieces after the failed one were dropped, not sent
    assert st.idle and st.pool.used == 0 and st.pool.free == [[0, st.pool.capacity]]
    st.engine = st.engine.engine  # the pool works again afterwards
    st.send(peer, "l0", [6], [6], remote, 16, "ok")
    assert st.reap(block=True) == [("ok", True, 2 * BB)]
    assert torch.equal(dst[:, 6], src[:, 6]) and not dst[:, 1:6].any()


def test_pieces_start_in_submission_order(engines):
    """FIFO: a transfer that would fit in the free pool does not overtake one that waits."""
    st, src, dst, peer, remote = sender(engines, pool_blocks=3)
    started = []
    real = st._start
    st._start = lambda p: (started.append(p.job.tag), real(p))[1]
    defer_copies(st, polls=10**6)  # t1's chunk stays busy until reap blocks
    st.send(peer, "l0", [0, 1], [0, 1], remote, 16, "t1")
    st.send(peer, "l0", [2, 3], [2, 3], remote, 16, "t2")  # 1 block free: waits
    st.send(peer, "l0", [4], [4], remote, 16, "t3")  # would fit, but t2 is ahead of it
    assert started == ["t1"]
    assert [t for t, _, _ in st.reap(block=True)] == ["t1", "t2", "t3"]
    assert started == ["t1", "t2", "t3"]
    assert torch.equal(dst[:, :5], src[:, :5]) and st.idle


def test_failed_gather_copy_frees_its_chunk(engines):
    st, src, dst, peer, remote = sender(engines, pool_blocks=2)

    def broken(after, pairs):
        raise RuntimeError("injected: device copy failed")

    st.dev.copy = broken
    st.send(peer, "l0", [1, 2, 3], [1, 2, 3], remote, 16, "bad")
    assert st.reap(block=True) == [("bad", False, 0)]
    assert st.stats["staged_bytes"] == 0 and not dst.any()  # nothing was written
    assert st.idle and st.pool.free == [[0, st.pool.capacity]]


def mirrored(engines, n=8):
    """D's staging of one CPU cache layer of ``n`` blocks with a landing mirror: ``(staging,
    cache, the region offered to P, the copies from the mirror into the cache)``."""
    dev = cache(n)
    st = Staging(engines(), torch.device("cpu"), 1 << 20, producer=False, consumer=True)
    region = st.add_layer("l0", dev, 2, n, BB)
    return st, dev, region, LandingCopies(st.dev, ["l0"], {"l0": dev}, {}, {"l0": 2}, st.mirrors)


def test_failed_landing_copy_fails_the_request(engines):
    st, dev, _, land = mirrored(engines)

    def broken(after, pairs):
        raise RuntimeError("injected: device copy failed")

    st.dev.copy = broken
    land.copy("r", None, [1, 2])
    assert not land.busy("r") and land.take_failed("r") == {1, 2}  # through the load-error path
    assert land.stats["failed"] == 1 and not dev.any()


def test_bad_source_block_is_refused(engines):
    st, src, dst, peer, remote = sender(engines, pool_blocks=2)
    with pytest.raises(kvwire.InvalidArgumentError):
        st.send(peer, "l0", [16], [0], remote, 16, "t")
    assert st.idle and st.reap(block=False) == []


def test_pool_smaller_than_a_block_is_refused(engines):
    with pytest.raises(kvwire.InvalidArgumentError):
        Staging(engines(), torch.device("cpu"), ALIGN - 1, producer=True, consumer=False)
    st = Staging(engines(), torch.device("cpu"), 3 * ALIGN, producer=True, consumer=False)
    with pytest.raises(kvwire.InvalidArgumentError):  # K and V of one block: 2 x 512 bytes
        st.add_layer("l0", torch.zeros(2, 4, 8, 16), 2, 4, 512)


def test_landing_copies_mirror_to_device_before_reporting(engines):
    de, pe = engines(), engines()
    st, dev, region, land = mirrored(lambda: de)
    assert region is not None and region.len == dev.numel() * 4  # the mirror: the cache's layout
    # pageable on CPU (pinned with a CUDA cache: tests/gpu/test_staging_cuda.py)
    assert de.metrics()["region_bytes_by_kind"] == {"engine": 0, "host": dev.numel() * 4, "pinned": 0, "device": 0}
    data = cache(8, fill=3)
    pr = kvwire.register_tensor(pe, data, "rw")
    peer = pe.connect(de.listen_addr)
    remote = peer.regions()[0]
    ops = [(pr, (h * 8 + b) * BB, remote, (h * 8 + b) * BB, BB) for b in (2, 3, 6) for h in range(2)]
    pe.write(peer, ops).wait()  # what P writes lands in the mirror, not in the cache
    assert not dev.any() and torch.equal(st.layers["l0"].mirror[:, 2:4], data[:, 2:4])
    events = defer_copies(st, polls=2)
    land.copy("r", None, [6, 2, 3], [0])
    assert land.busy("r") and not dev.any()  # the copy has not completed: not reported
    for _ in range(MAX_STEPS):
        if not land.busy("r"):
            break
    assert not land.busy("r") and events[0].done and land.take_failed("r") == set()
    want = torch.zeros_like(dev)
    want[:, [2, 3, 6]] = data[:, [2, 3, 6]]
    assert torch.equal(dev, want)
    del st.dev.copy  # copies complete at once again
    # 8 is outside the cache, layer 1 does not exist, and there is no pool: refused, nothing copied
    land.copy("x", None, [2, 8])
    land.copy("y", None, [2], [1])
    land.copy("z", [0], [2])
    assert [land.take_failed(r) for r in "xyz"] == [{2, 8}, {2}, {2}]
    assert torch.equal(dev, want) and land.idle and land.stats == {"copies": 1, "layers": 1, "failed": 0}


def test_cuda_branch_orders_copies_after_the_compute_stream(engines, monkeypatch):
    """The CUDA branch against a stand-in torch.cuda: a send records an event on the current
    (compute) stream; the gather runs on the side stream after waiting for it, then records the
    done event, which is queried before the chunk is written. (D's landing copies, the same way:
    test_vllm_device.py.)"""
    fake = StandInCuda()
    monkeypatch.setattr(staging, "cuda", fake)
    st, src, dst, peer, remote = sender(engines, pool_blocks=4)
    st.dev = staging.DeviceCopies(torch.device("cuda", 0))
    assert st.dev.cuda and st.dev.stream.name == "side"
    st.send(peer, "l0", [1, 2, 7], [3, 4, 5], remote, 16, "t")
    assert st.reap(block=True) == [("t", True, 3 * 2 * BB)]
    assert torch.equal(dst[:, 3:6], src[:, [1, 2, 7]])
    assert fake.log[:6] == [("record", "compute", "e1"), ("enter", "side"), ("wait", "side", "e1"),
                            ("record", "side", "e2"), ("exit", "side"), ("query", "e2")]
    ld = Staging(engines(), torch.device("cpu"), 1 << 20, producer=False, consumer=True)
    ld.dev = staging.DeviceCopies(torch.device("cuda", 0))
    # Host memory: zeroed, pinned with cudaHostRegister (exact size), unpinned at close.
    fake.log.clear()
    h = ld.dev.host((3, 5), torch.float16)
    assert h.shape == (3, 5) and h.dtype == torch.float16 and not h.any()
    assert fake.log == [("pin", h.data_ptr(), 30, 0)]
    ld.close()  # no copy ran: no side stream was made, none to wait for
    assert fake.log == [("pin", h.data_ptr(), 30, 0), ("unpin", h.data_ptr())]
    st.close()  # the sender's copies ran on the side stream: it is waited for
    assert fake.log[-1] == ("sync", "side")


# ---- in vLLM's scheduler ----------------------------------------------------------------------

vllm = pytest.importorskip("vllm", reason="vLLM not installed in this venv (run tests/python/setup.sh)")

from vllm_harness import (  # noqa: E402,F401 (mdir and pair: fixtures)
    LAYERS, MAX_STEPS, PEER_TIMEOUT, RequestStatus, Side, assert_no_leak, d_request, empty, holds,
    kv_pattern, layer_empty, layer_holds, mdir, p_fill, p_request, pair, run_until, timeline, wait_for)


def stager(side):
    return side.worker._worker.stager


def landing(side):
    return side.worker._worker.land


def watch_landing(d, rid):
    """Logs ``(from the mirror, layers, ok)`` of each copy of ``rid`` D's worker starts; ``ok``:
    the cache holds none of those layers' bytes yet while the mirror holds all of them."""
    land, seen = landing(d), []
    real, mirrors = land.copy_all, stager(d).mirrors

    def copy_all(items):
        for req, slots, blocks, layers in items:
            if req == f"d/{rid}":
                idx = list(range(len(LAYERS)) if layers is None else layers)
                ok = all(layer_empty(d.kv, li, blocks) and layer_holds(mirrors, rid, li, blocks) for li in idx)
                seen.append((slots is None, idx, ok))
        return real(items)

    land.copy_all = copy_all
    return seen


def all_copied(events):
    """Completes every deferred copy (see ``defer_copies``)."""
    for ev in events:
        ev.synchronize()


SIDES = {"p": ({}, {"staging": "always", "staging_mb": 1, "d_landing": "mirror"}),
         "d": ({"staging": "always", "staging_mb": 1, "d_landing": "mirror"}, {}),
         "both": ({"staging": "always", "staging_mb": 1, "d_landing": "mirror"}, {"staging": "always", "staging_mb": 1, "d_landing": "mirror"})}


@pytest.mark.parametrize("where", list(SIDES))
@pytest.mark.parametrize("send_mode", ["whole", "layerwise"])
@pytest.mark.parametrize("policy", ["eager", "lazy", "jit", "land"])
def test_staged_end_to_end(pair, where, policy, send_mode):
    d_extra, p_extra = SIDES[where]
    d, p = pair({"policy": policy, **d_extra}, {"send_mode": send_mode, **p_extra})
    assert (stager(d) is not None) == (where != "p") and (stager(p) is not None) == (where != "d")
    landings = watch_landing(d, "s1") if stager(d) is not None else None
    dreq = d_request("s1", p)
    d.sched.add_request(dreq)
    d.step()
    preq = p_request("s1", d)
    p.sched.add_request(preq)
    reserved = []

    def d_step():
        d.step()
        if dreq.status == RequestStatus.WAITING_FOR_REMOTE_KVS and not reserved:
            reserved.extend(d.sched.kv_cache_manager.get_block_ids("d/s1")[0])

    assert run_until(lambda: dreq.status == RequestStatus.RUNNING, lambda: p.step(p_fill), d_step)
    assert len(reserved) == 3
    assert holds(d.kv, "s1", reserved)  # D's cache itself (not the mirror): every byte, K and V
    if landings is not None and policy == "land":
        # land lands in its pool, not the mirror: one copy of every layer from its slots
        assert [(mirror, idx) for mirror, idx, _ in landings] == [(False, [0, 1])]
    elif landings is not None:
        # Each layer was copied once, from the mirror, which held its bytes while the cache held
        # none: the copies are what put them in the cache, before the request was reported.
        assert all(mirror and ok for mirror, _, ok in landings)
        assert sorted(li for _, idx, _ in landings for li in idx) == list(range(len(LAYERS)))
        assert landing(d).stats["layers"] == len(LAYERS)
    if stager(p) is not None:
        assert stager(p).stats["pieces"] == len(LAYERS)  # one piece per layer transfer
        assert stager(p).stats["staged_bytes"] == len(LAYERS) * 3 * 2 * 16 * 2 * 8 * 4
    assert run_until(lambda: dreq.is_finished() and preq.is_finished() and p.free_blocks() == p.num_blocks - 1,
                     lambda: p.step(p_fill), d.step)
    assert_no_leak(d)
    assert_no_leak(p)
    for s in (d, p):
        if stager(s) is not None:
            assert stager(s).idle
    if landings is not None:
        assert landing(d).idle

def test_staged_kv_both(pair):
    """kv_both on both sides, both staged: every worker has a pool and mirrors, and only the
    mirrors are offered (the pool is registered local), so P finds one region per layer."""
    staged = {"staging": "always", "staging_mb": 1, "d_landing": "mirror"}
    d, p = pair({"policy": "lazy", **staged}, {"send_mode": "layerwise", **staged}, roles=("kv_both", "kv_both"))
    for s in (d, p):
        assert stager(s).pool is not None and stager(s).consumer
    dreq = d_request("s5", p)
    d.sched.add_request(dreq)
    d.step()
    preq = p_request("s5", d)
    p.sched.add_request(preq)
    assert run_until(lambda: dreq.status == RequestStatus.RUNNING, lambda: p.step(p_fill), d.step)
    ids = d.sched.kv_cache_manager.get_block_ids("d/s5")[0]
    assert holds(d.kv, "s5", ids)
    assert stager(p).stats["pieces"] == len(LAYERS) and landing(d).stats["layers"] == len(LAYERS)
    assert run_until(lambda: dreq.is_finished() and not p.sched.requests, lambda: p.step(p_fill), d.step)
    assert_no_leak(d)
    assert_no_leak(p)


@pytest.mark.parametrize("d_landing", ["mirror", "pool"])
def test_staged_tp2(mdir, d_landing):
    """Tensor parallel size 2, both sides staged: each rank has its own pool and mirrors (or
    landing pool) and moves its own shard; every byte of each of D's shards is checked."""
    import inspect

    if "tp" not in inspect.signature(Side).parameters:
        msg = "SKIPPED: the vLLM harness has no tensor parallel ranks"
        print(msg, file=sys.stderr)
        pytest.skip(msg)
    base = {"transport": os.environ.get("KVWIRE_TEST_TRANSPORT", "auto"), "peer_timeout": PEER_TIMEOUT,
            "data_listen": "127.0.0.1:0", "staging": "always", "staging_mb": 1, "d_landing": d_landing}
    d = Side("kv_consumer", {**base, "policy": "lazy"}, mdir, tp=2)
    p = Side("kv_producer", {**base, "send_mode": "layerwise"}, mdir, tp=2)
    try:
        assert all(w._worker.stager is not None for w in d.workers + p.workers)
        dreq = d_request("s7", p, tokens=50)
        d.sched.add_request(dreq)
        d.step()
        p.sched.add_request(p_request("s7", d, tokens=50))
        assert run_until(lambda: dreq.status == RequestStatus.RUNNING, lambda: p.step(p_fill), d.step)
        ids = d.sched.kv_cache_manager.get_block_ids("d/s7")[0]
        assert len(ids) == 4
        for r in range(2):
            for li, name in enumerate(LAYERS):
                for i, b in enumerate(ids):
                    assert torch.equal(d.kvs[r][name][:, b], kv_pattern("s7", li, i, r, d.heads)), (r, name, i)
        if d_landing == "mirror":
            assert [w._worker.land.stats["layers"] for w in d.workers] == [len(LAYERS)] * 2
        else:  # both ranks' pools, the same slots: the scheduler gave them all back
            assert all(not w._worker.stager.consumer and w._worker.landing for w in d.workers)
            assert sorted(d.conn._sched.land_free) == list(range(d.conn._sched.land_slots))
        assert run_until(lambda: dreq.is_finished() and not p.sched.requests, lambda: p.step(p_fill), d.step)
        assert_no_leak(d)
        assert_no_leak(p)
        assert all(w._worker.stager.idle for w in d.workers + p.workers)
    finally:
        d.close()
        p.close()


def test_landing_is_reported_only_once_its_copy_completed(pair):
    """D's mirror→cache copies complete late (as CUDA stream copies do): the request stays
    WAITING_FOR_REMOTE_KVS until every copy's event says done, its cache blocks empty until the
    first does."""
    d, p = pair({"policy": "lazy", "staging": "always", "staging_mb": 1, "d_landing": "mirror"}, {"send_mode": "whole"})
    events = defer_copies(stager(d), polls=4)
    dreq = d_request("s2", p)
    d.sched.add_request(dreq)
    d.step()
    p.sched.add_request(p_request("s2", d))
    assert run_until(lambda: events, lambda: p.step(p_fill), d.step)  # the landing started
    ids = d.sched.kv_cache_manager.get_block_ids("d/s2")[0]
    waited = 0
    while not all(ev.done for ev in events) and waited < MAX_STEPS:
        assert dreq.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        assert any(ev.done for ev in events) or empty(d.kv, ids)
        d.step()
        waited += 1
    assert waited >= 2  # the report waited for the copies across steps
    assert run_until(lambda: dreq.status == RequestStatus.RUNNING, d.step)
    assert holds(d.kv, "s2", ids)


def test_abort_while_landing_frees_the_blocks_after_the_copy(pair):
    """D's request is aborted while its blocks are being copied mirror→cache: the blocks are not
    freed (and cannot be reused) before the copy completed, then freed once, through one report."""
    d, p = pair({"policy": "lazy", "staging": "always", "staging_mb": 1, "d_landing": "mirror"}, {})
    events = defer_copies(stager(d), polls=10**6)
    dreq = d_request("s6", p)
    d.sched.add_request(dreq)
    d.step()
    p.sched.add_request(p_request("s6", d))
    assert run_until(lambda: events, lambda: p.step(p_fill), d.step)  # the landing started
    full = d.num_blocks - 1
    assert d.free_blocks() == full - 3
    d.sched.finish_requests("d/s6", RequestStatus.FINISHED_ABORTED)
    for _ in range(5):
        d.step()
        p.step()
    assert d.free_blocks() == full - 3  # held: the copy may still write into them
    all_copied(events)
    assert run_until(lambda: not d.sched.requests and not p.sched.requests, d.step, p.step)
    assert_no_leak(d)
    assert_no_leak(p)
    assert stager(d).idle and landing(d).idle


def test_without_the_landing_copy_the_cache_stays_empty(pair):
    """The landing copies are what move the bytes: with them disabled, every byte is in the
    mirror and the cache blocks stay empty, through the request's report and after it."""
    d, p = pair({"policy": "lazy", "staging": "always", "staging_mb": 1, "d_landing": "mirror"}, {})
    landing(d).copy_all = lambda items: None
    dreq = d_request("s3", p)
    d.sched.add_request(dreq)
    d.step()
    p.sched.add_request(p_request("s3", d))
    assert run_until(lambda: dreq.status == RequestStatus.WAITING_FOR_REMOTE_KVS, lambda: p.step(p_fill), d.step)
    ids = d.sched.kv_cache_manager.get_block_ids("d/s3")[0]
    assert run_until(lambda: dreq.status == RequestStatus.RUNNING, lambda: p.step(p_fill), d.step)
    assert holds(stager(d).mirrors, "s3", ids) and empty(d.kv, ids)


@pytest.mark.parametrize("send_mode", ["whole", "layerwise"])
def test_pool_smaller_than_a_layer_queues_and_splits(pair, send_mode):
    """P's pool holds 2 blocks (K and V) while each layer transfer has 7 blocks and two requests
    are in flight: transfers are split and queued, every byte still arrives, in order."""
    block = 2 * 16 * 2 * 8 * 4  # K and V of one block
    d, p = pair({"policy": "eager", "staging": "always", "staging_mb": 1, "d_landing": "mirror"},
                {"send_mode": send_mode, "staging": "always", "staging_mb": 2 * block / (1 << 20)})
    assert stager(p).pool.capacity == 2 * block
    dreqs = [d_request(f"q{i}", p, tokens=100) for i in range(2)]
    for r in dreqs:
        d.sched.add_request(r)
    d.step()
    ids = {r.request_id: list(d.sched.kv_cache_manager.get_block_ids(r.request_id)[0]) for r in dreqs}
    assert all(len(v) == 7 for v in ids.values())
    for i in range(2):
        p.sched.add_request(p_request(f"q{i}", d, tokens=100))
    assert run_until(lambda: all(r.status == RequestStatus.RUNNING for r in dreqs), lambda: p.step(p_fill), d.step)
    for i, r in enumerate(dreqs):
        assert holds(d.kv, f"q{i}", ids[r.request_id])
    stats = stager(p).stats
    assert stats["split"] == 2 * len(LAYERS)  # every layer transfer: pieces of 2, 2, 2, 1 blocks
    assert stats["pieces"] == 2 * len(LAYERS) * 4
    assert stats["waited"] > 0  # pieces waited for pool space
    assert run_until(lambda: all(r.is_finished() for r in dreqs) and not p.sched.requests,
                     lambda: p.step(p_fill), d.step)
    assert_no_leak(d)
    assert_no_leak(p)
    assert stager(p).idle


@pytest.mark.parametrize("at", ["submit", "complete"])
def test_failed_staged_write_takes_the_load_error_path(pair, at):
    """P's staged write fails: P reports the layer failed, the request fails on D through the
    load-error path (its blocks in get_block_ids_with_load_errors), nothing leaks, and P's
    staging chunks are all back in the pool."""
    d, p = pair({"policy": "eager", "staging": "always", "staging_mb": 1, "d_landing": "mirror"},
                {"staging": "always", "staging_mb": 1, "d_landing": "mirror"}, load_failure_policy="fail")
    st = stager(p)
    st.engine = FailingEngine(st.engine, at)
    dreq = d_request("s4", p)
    d.sched.add_request(dreq)
    d.step()
    assert dreq.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    reserved = list(d.sched.kv_cache_manager.get_block_ids("d/s4")[0])
    preq = p_request("s4", d)
    p.sched.add_request(preq)
    assert run_until(lambda: dreq.is_finished(), lambda: p.step(p_fill), d.step)
    assert dreq.status != RequestStatus.RUNNING
    assert st.engine.writes >= 1 and st.stats["failed"] >= 1  # the staged write was tried, and failed
    assert set(reserved) <= d.invalid
    assert empty(d.kv, reserved) and landing(d).stats["layers"] == 0
    assert run_until(lambda: not p.sched.requests, lambda: p.step(p_fill), d.step)
    assert_no_leak(d)
    assert_no_leak(p)
    assert wait_for(lambda: st.idle and st.pool.used == 0)  # the worker's thread reaps the failed write
    assert any('"outcome":"failed"' in r for r in timeline(d))


def test_device_cache_without_staging_is_refused(mdir):
    """A KV cache that is not in host memory (here on the meta device; on a GPU machine, CUDA)
    is refused with a clear error when staging does not take it."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm_harness import kv_cache_config, vllm_config

    kv = {n: torch.zeros(2, 64, 16, 2, 8, device="meta") for n in LAYERS}
    for mode, err in [("never", "needs staging"), ("auto", "needs staging"), ("always", "cuda and cpu"),
                      ("device", "staging device takes cuda and cpu")]:
        vc = vllm_config("kv_consumer", {"staging": mode}, mdir)
        w = KVConnectorFactory.create_connector(vc, KVConnectorRole.WORKER, kv_cache_config(64))
        try:
            with pytest.raises(kvwire.UnsupportedError, match=err):
                w.register_kv_caches(kv)
        finally:
            w.shutdown()
