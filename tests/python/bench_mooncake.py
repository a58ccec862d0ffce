"""Times kvwire.mooncake.TransferEngine.batch_transfer_sync_write against kvwire.Engine.write for
the same vLLM-shaped batch (scattered 16 KiB blocks) between two processes on loopback, bytes
verified at the target after each configuration. A benchmark, not a test: it prints figures.

    python tests/python/bench_mooncake.py [--blocks 1024] [--iters 20] [--protocol tcp|shm]
"""

import argparse
import ctypes
import hashlib
import statistics
import sys
import time

sys.path.insert(0, __import__("os").path.dirname(__file__))
from conftest import Child, pattern  # noqa: E402

import kvpeer  # noqa: E402
import kvwire  # noqa: E402
from kvwire.mooncake import TransferEngine  # noqa: E402

BLK = 16 * 1024


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--protocol", default="tcp")
    a = ap.parse_args()
    n = a.blocks
    size = n * BLK
    data = pattern(size, "bench")
    perm = [(i * 7919) % n for i in range(n)]
    expected = bytearray(size)
    for i, j in enumerate(perm):
        expected[j * BLK:(j + 1) * BLK] = data[i * BLK:(i + 1) * BLK]
    want = hashlib.sha256(expected).hexdigest()

    # Mooncake drop-in.
    peer = Child(kvpeer.mooncake_peer, {"protocol": a.protocol})
    raddr = peer.call("buffer", "dst", size)
    session = peer.call("session")
    te = TransferEngine()
    assert te.initialize("127.0.0.1", "P2PHANDSHAKE", a.protocol, "") == 0
    buf = (ctypes.c_char * size).from_buffer_copy(data)
    laddr = ctypes.addressof(buf)
    assert te.register_memory(laddr, size) == 0
    srcs = [laddr + i * BLK for i in range(n)]
    dsts = [raddr + j * BLK for j in perm]
    lens = [BLK] * n
    t_mc = []
    for _ in range(a.iters + 2):
        t0 = time.perf_counter()
        assert te.batch_transfer_sync_write(session, srcs, dsts, lens) == 0, te.last_error()
        t_mc.append(time.perf_counter() - t0)
    assert peer.call("sha", "dst") == want
    peer.close()

    # kvwire.Engine with the same ops.
    peer = Child(kvpeer.engine_peer, {"transport": a.protocol})
    rid = peer.call("alloc", "dst", size, "wo")
    e = kvwire.Engine(transport=a.protocol)
    src = e.alloc(size, "local")
    e.local_write(src, 0, data)
    p = e.connect(peer.call("addr"))
    ops = [(src, i * BLK, rid, j * BLK, BLK) for i, j in enumerate(perm)]
    t_kv = []
    for _ in range(a.iters + 2):
        t0 = time.perf_counter()
        e.write(p, ops).wait()
        t_kv.append(time.perf_counter() - t0)
    assert peer.call("sha", "dst") == want
    peer.close()

    for name, t in (("mooncake drop-in batch_transfer_sync_write", t_mc[2:]), ("kvwire.Engine.write+wait", t_kv[2:])):
        med = statistics.median(t)
        print(f"{name}: {n} x 16 KiB scattered ({size / 1e6:.1f} MB), {a.protocol}, "
              f"median {med * 1e3:.2f} ms over {len(t)} runs, {size / med / 1e9:.2f} GB/s, verified")


if __name__ == "__main__":
    main()
