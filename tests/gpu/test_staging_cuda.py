"""The connector's staging (kvwire.vllm.staging) with real CUDA KV caches, on a GPU: the CUDA
branch that the CPU tests check only against a stand-in. Run by tests/gpu/run.sh with
``KVWIRE_REQUIRE_GPU=1`` (no GPU is then a failure, not a skip).

* P: a layer is computed on the current stream (a long chain of kernels, then the fill), and its
  blocks are sent at once, without a synchronize: the gather copy must wait for the layer's
  event, or it reads the cache before the compute wrote it.
* D: writes land in the pinned host mirror or in a bounded landing pool, and are copied into
  the device cache one layer at a time (kvwire.vllm.landing), each copy after the compute
  stream's work; the request is busy until the copy completed.
* Every byte compared with the source, at both ends, K and V.
"""

import importlib.util
import os
import sys

import pytest

torch = pytest.importorskip("torch")

import kvwire  # noqa: E402

# The staging module alone: the package kvwire.vllm imports vLLM, which this machine may lack.
_spec = importlib.util.spec_from_file_location(
    "kvwire_vllm_staging", os.path.join(os.path.dirname(kvwire.__file__), "vllm", "staging.py"))
staging = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = staging  # dataclasses look their module up there
_spec.loader.exec_module(staging)
Staging = staging.Staging
_lspec = importlib.util.spec_from_file_location(
    "kvwire_vllm_landing", os.path.join(os.path.dirname(kvwire.__file__), "vllm", "landing.py"))
landing = importlib.util.module_from_spec(_lspec)
_lspec.loader.exec_module(landing)

if not torch.cuda.is_available():
    if os.environ.get("KVWIRE_REQUIRE_GPU") == "1":
        raise RuntimeError("KVWIRE_REQUIRE_GPU=1 but torch sees no CUDA device")
    pytest.skip("SKIPPED: no CUDA device", allow_module_level=True)

DEV = torch.device("cuda", 0)
BLOCKS, TOK, HEADS, DIM = 64, 16, 8, 128  # vLLM's [2, blocks, block_size, heads, head_dim]
BB = TOK * HEADS * DIM * 2  # bytes per (block, half) in fp16


def cuda_cache(fill=None):
    t = torch.zeros(2, BLOCKS, TOK, HEADS, DIM, dtype=torch.float16, device=DEV)
    if fill is not None:
        g = torch.Generator(device=DEV).manual_seed(fill)
        t.copy_(torch.rand(t.shape, generator=g, device=DEV, dtype=torch.float16))
    torch.cuda.synchronize()
    return t


def busy(ms_of_work=200):
    """Kernels that keep the current stream busy for a while (so a copy not ordered after them
    would run first)."""
    a = torch.rand(4096, 4096, device=DEV)
    for _ in range(ms_of_work):
        a = a @ a
        a = a / a.norm()
    return a


@pytest.fixture
def pair():
    """P's and D's engines, in this process, and a maker of stagings on them. After the test the
    engines shut down, then the stagings close (unpinning their host memory: left pinned, a later
    test's buffer at a freed address could not be pinned again)."""
    t = os.environ.get("KVWIRE_TEST_TRANSPORT", "auto")
    p, d = kvwire.Engine(transport=t), kvwire.Engine(transport=t)
    made = []

    def staging(engine, pool_bytes, producer):
        st = Staging(engine, DEV, pool_bytes, producer=producer, consumer=not producer)
        made.append(st)
        return st

    yield p, d, staging
    p.shutdown()
    d.shutdown()
    for st in made:
        st.close()


def test_staged_send_from_a_cuda_cache_waits_for_the_layer(pair):
    pe, de, staging = pair
    src = cuda_cache()
    st = staging(pe, 8 * 2 * BB, True)
    st.add_layer("l0", src, 2, BLOCKS, BB)
    dst = torch.zeros(2, BLOCKS, TOK, HEADS, DIM, dtype=torch.float16)  # D: a host cache
    kvwire.register_tensor(de, dst, "rw")
    peer = pe.connect(de.listen_addr)
    remote = peer.regions()[0]
    want = torch.rand(src.shape, generator=torch.Generator(device=DEV).manual_seed(7), device=DEV,
                      dtype=torch.float16)
    torch.cuda.synchronize()
    busy()  # the layer's compute: queued, not finished
    src.copy_(want)  # its last kernel writes the cache
    s_ids = [5, 6, 7, 40, 41, 2, 63, 0, 30, 31, 32, 33]
    d_ids = [1, 2, 3, 10, 11, 12, 20, 21, 50, 51, 52, 53]
    st.send(peer, "l0", s_ids, d_ids, remote, BLOCKS, "t")  # no synchronize before it
    out = st.reap(block=True)
    assert out == [("t", True, len(s_ids) * 2 * BB)]
    exp = torch.zeros_like(dst)
    w = want.cpu()
    for s, d in zip(s_ids, d_ids):
        exp[:, d] = w[:, s]
    assert torch.equal(dst, exp)
    assert st.stats["split"] >= 1 and st.idle  # 12 blocks through an 8-block pool


def test_landing_into_a_cuda_cache_reports_after_the_copy(pair):
    pe, de, staging = pair
    dev = cuda_cache()
    st = staging(de, 1 << 20, False)
    region = st.add_layer("l0", dev, 2, BLOCKS, BB)
    assert region is not None and region.len == dev.numel() * 2  # the host mirror
    data = torch.rand(dev.shape, generator=torch.Generator().manual_seed(3)).to(torch.float16)
    pr = kvwire.register_tensor(pe, data, "rw")
    peer = pe.connect(de.listen_addr)
    remote = peer.regions()[0]
    blocks = [2, 3, 17, 60]
    ops = [(pr, (h * BLOCKS + b) * BB, remote, (h * BLOCKS + b) * BB, BB) for b in blocks for h in range(2)]
    pe.write(peer, ops).wait(30.0)
    assert not dev.any().item()  # landed in the mirror only
    land = landing.LandingCopies(st.dev, ["l0"], {"l0": dev}, {}, {"l0": 2}, st.mirrors)
    land.copy("r", None, blocks, [0])
    for _ in range(10**7):
        if not land.busy("r"):
            break
    assert not land.busy("r") and land.take_failed("r") == set()
    torch.cuda.synchronize()
    exp = torch.zeros_like(data)
    exp[:, blocks] = data[:, blocks]
    assert torch.equal(dev.cpu(), exp)



def test_landing_pool_copies_layer_by_layer_into_a_cuda_cache():
    """D's bounded landing pool (pinned host memory) copied into a CUDA cache one layer at a time,
    as the layers land: the compute stream writes the target blocks after a long chain of
    kernels, and the copy, ordered after that work, overwrites them; the request stays busy until
    the copy's event completed; the other layer is untouched until its own copy."""
    dev = staging.DeviceCopies(DEV)
    names = ["l0", "l1"]
    caches = {n: cuda_cache() for n in names}
    pools = {n: dev.host((2, 8, TOK, HEADS, DIM), torch.float16) for n in names}
    for i, n in enumerate(names):
        pools[n].copy_(torch.rand(pools[n].shape, generator=torch.Generator().manual_seed(10 + i)).to(torch.float16))
    land = landing.LandingCopies(dev, names, caches, pools, {n: 2 for n in names})
    slots, blocks = [0, 1, 2, 5], [40, 41, 7, 63]
    for li, n in enumerate(names):
        busy()
        caches[n][:, blocks] = 1.0  # the compute stream's last write to these blocks, late
        land.copy("r", slots, blocks, [li])
        for _ in range(10**7):
            if not land.busy("r"):
                break
        assert not land.busy("r") and land.idle
        torch.cuda.synchronize()
        assert torch.equal(caches[n][:, blocks].cpu(), pools[n][:, slots]), n
        for later in names[li + 1:]:
            assert not caches[later].any().item(), later
    assert land.stats == {"copies": 2, "layers": 2, "failed": 0}
    dev.close()


def test_staging_memory_is_counted_as_pinned(pair):
    """What staging pins (P's pool, D's landing mirror: as large as the KV cache) is counted as
    pinned in the engines' metrics; a pageable buffer registered beside it as host."""
    pe, de, staging = pair
    cache = cuda_cache()
    staging(pe, 8 * 2 * BB, True).add_layer("l0", cache, 2, BLOCKS, BB)
    staging(de, 1 << 20, False).add_layer("l0", cache, 2, BLOCKS, BB)
    pageable = torch.zeros(3 << 10, dtype=torch.uint8)
    kvwire.register_tensor(pe, pageable, "rw")
    assert pe.metrics()["region_bytes_by_kind"] == {"engine": 0, "host": 3 << 10, "pinned": 8 * 2 * BB, "device": 0}
    mirror = cache.numel() * cache.element_size()
    assert de.metrics()["region_bytes_by_kind"] == {"engine": 0, "host": 0, "pinned": mirror, "device": 0}
