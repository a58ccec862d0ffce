"""The cuda_ipc transport from Python, on a GPU: two processes, each with a CUDA tensor registered
as a device region (``kvwire.register_tensor(..., ipc=True)``); the parent writes its tensor into
the child's and reads the child's back, with a notification; every byte compared on both ends.
Run by tests/gpu/run.sh with ``KVWIRE_REQUIRE_GPU=1`` (no GPU is then a failure, not a skip).
"""

import multiprocessing as mp
import os

import pytest

torch = pytest.importorskip("torch")

import kvwire  # noqa: E402

if not torch.cuda.is_available():
    if os.environ.get("KVWIRE_REQUIRE_GPU") == "1":
        raise RuntimeError("KVWIRE_REQUIRE_GPU=1 but torch sees no CUDA device")
    pytest.skip("SKIPPED: no CUDA device", allow_module_level=True)

N = 32 << 20  # bytes per tensor


def _pattern(seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randint(0, 256, (N,), dtype=torch.uint8, device="cuda", generator=g)


def _target(conn):
    e = kvwire.Engine()
    t = _pattern(2)
    r = kvwire.register_tensor(e, t, "rw", ipc=True)
    conn.send((e.listen_addr, r.id))
    while True:
        cmd = conn.recv()
        if cmd == "stop":
            break
        if cmd == "notify":
            conn.send([e.get_notification(timeout=10).tag])
        elif cmd == "bytes":
            torch.cuda.synchronize()
            conn.send(t.cpu().numpy().tobytes())
    e.unregister(r)
    e.shutdown()


def test_cuda_ipc_between_two_processes_every_byte():
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_target, args=(child,))
    p.start()
    try:
        addr, rid = parent.recv()
        e = kvwire.Engine()
        src = _pattern(1)
        back = torch.zeros(N, dtype=torch.uint8, device="cuda")
        rs = kvwire.register_tensor(e, src, "local", ipc=True)
        rb = kvwire.register_tensor(e, back, "local", ipc=True)
        try:
            peer = e.connect(addr)
            assert peer.transport == "cuda_ipc"
            parent.send("bytes")
            before = parent.recv()
            half = N // 2
            # the second half of ours into the first half of theirs, and the other way round
            b = e.write(peer, [(rs, half, rid, 0, half), (rs, 0, rid, half, half)], notify=b"py")
            b.wait(timeout=30)
            parent.send("notify")
            assert b"py" in parent.recv()
            want = torch.cat([src[half:], src[:half]]).cpu().numpy().tobytes()
            assert before != want
            parent.send("bytes")
            assert parent.recv() == want, "the target's tensor after the write"
            e.read(peer, [(rb, 0, rid, 0, N)]).wait(timeout=30)
            torch.cuda.synchronize()
            assert back.cpu().numpy().tobytes() == want, "bytes read back from the target"
            with pytest.raises(kvwire.OutOfBoundsError):
                e.write(peer, [(rs, 0, rid, N - 16, 32)])
            # The target withdraws its region while we are connected: we confirm, it returns.
            parent.send("stop")
            p.join(30)
            assert p.exitcode == 0
        finally:
            e.unregister(rs)
            e.unregister(rb)
            e.shutdown()
    finally:
        if p.is_alive():
            parent.send("stop")
            p.join(30)
