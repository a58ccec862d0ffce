"""The Mooncake drop-in with CUDA memory, on a GPU: two processes register CUDA tensors with
``kvwire.mooncake.TransferEngine.register_memory`` (as vLLM's MooncakeConnector registers its
KV caches) and move bytes between them with ``transfer_sync_write``/``read`` and a batch of
scattered blocks; every byte compared on both ends. Run by tests/gpu/run.sh with
``KVWIRE_REQUIRE_GPU=1`` (no GPU is then a failure, not a skip).
"""

import multiprocessing as mp
import os

import pytest

torch = pytest.importorskip("torch")

from kvwire.mooncake import TransferEngine  # noqa: E402

if not torch.cuda.is_available():
    if os.environ.get("KVWIRE_REQUIRE_GPU") == "1":
        raise RuntimeError("KVWIRE_REQUIRE_GPU=1 but torch sees no CUDA device")
    pytest.skip("SKIPPED: no CUDA device", allow_module_level=True)

N = 16 << 20
BLK = 64 << 10


def _pattern(seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randint(0, 256, (N,), dtype=torch.uint8, device="cuda", generator=g)


def _engine():
    te = TransferEngine()
    assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", "") == 0, te.last_error()
    return te


def _target(conn):
    te = _engine()
    t = _pattern(2)
    assert te.register_memory(t.data_ptr(), N) == 0, te.last_error()
    conn.send((f"127.0.0.1:{te.get_rpc_port()}", t.data_ptr()))
    while True:
        cmd = conn.recv()
        if cmd == "stop":
            break
        torch.cuda.synchronize()
        conn.send(t.cpu().numpy().tobytes())
    assert te.unregister_memory(t.data_ptr()) == 0, te.last_error()


def test_mooncake_dropin_moves_cuda_memory_between_processes():
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_target, args=(child,))
    p.start()
    try:
        session, raddr = parent.recv()
        te = _engine()
        src = _pattern(1)
        back = torch.zeros(N, dtype=torch.uint8, device="cuda")
        for t in (src, back):
            assert te.register_memory(t.data_ptr(), N) == 0, te.last_error()
        # The whole tensor, then 64 scattered blocks over its first MiB-s, vLLM-style.
        assert te.transfer_sync_write(session, src.data_ptr(), raddr, N) == 0, te.last_error()
        parent.send("bytes")
        want = bytearray(src.cpu().numpy().tobytes())
        assert parent.recv() == want, "the target's tensor after the write"
        srcs = [src.data_ptr() + i * BLK for i in range(64)]
        dsts = [raddr + ((i * 7) % 64) * BLK for i in range(64)]
        assert te.batch_transfer_sync_write(session, srcs, dsts, [BLK] * 64) == 0, te.last_error()
        host = src.cpu().numpy().tobytes()
        for i in range(64):
            j = (i * 7) % 64
            want[j * BLK:(j + 1) * BLK] = host[i * BLK:(i + 1) * BLK]
        parent.send("bytes")
        assert parent.recv() == want, "the target's tensor after the scattered blocks"
        assert te.transfer_sync_read(session, back.data_ptr(), raddr, N) == 0, te.last_error()
        torch.cuda.synchronize()
        assert back.cpu().numpy().tobytes() == want, "bytes read back"
        # outside the peer's registered memory: refused, -1
        assert te.transfer_sync_write(session, src.data_ptr(), raddr + N - 16, 32) < 0
        assert te.last_error()
        parent.send("stop")
        p.join(30)
        assert p.exitcode == 0
        for t in (src, back):
            assert te.unregister_memory(t.data_ptr()) == 0, te.last_error()
    finally:
        if p.is_alive():
            parent.send("stop")
            p.join(30)
