"""kvwire.Engine across two processes: every byte checked at both ends, errors typed, GIL
released while blocked."""

import ctypes
import hashlib
import os
import socket
import sys
import threading
import time

import pytest

import kvwire
from conftest import pattern

MiB = 1 << 20


def sha(b):
    return hashlib.sha256(b).hexdigest()


def test_exception_hierarchy():
    for name in [
        "IoError", "ProtocolError", "VersionMismatchError", "AuthError", "OutOfBoundsError",
        "UnknownRegionError", "StaleRegionError", "AccessDeniedError", "PeerDeadError",
        "TimeoutError", "ShutdownError", "InvalidArgumentError", "UnsupportedError", "ConnectorError",
        "ResourceLimitError", "FencedError",
    ]:
        cls = getattr(kvwire, name)
        assert issubclass(cls, kvwire.KvwireError), name
    assert issubclass(kvwire.KvwireError, Exception)
    assert kvwire.KvwireError.__module__ == "kvwire"


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_scattered_write_verified_both_ends(engine_peer, transport):
    peer = engine_peer(transport=transport)
    rid = peer.call("alloc", "dst", 4 * MiB, "wo")
    e = kvwire.Engine(transport=transport)
    src = e.alloc(4 * MiB, "local")
    data = pattern(4 * MiB, "w")
    e.local_write(src, 0, data)
    p = e.connect(peer.call("addr"))
    assert p.transport == transport
    # Scattered 16 KiB blocks with a permutation, plus one large contiguous range.
    blk = 16 * 1024
    perm = [(i * 37) % 128 for i in range(128)]
    ops = [(src, i * blk, rid, perm[i] * blk, blk) for i in range(128)]
    ops.append((src, 2 * MiB, rid, 2 * MiB, 2 * MiB))
    stats = e.write(p, ops, notify=b"req-1").wait()
    assert stats.bytes == 128 * blk + 2 * MiB
    assert stats.ops == 129
    assert peer.call("notification", 10.0) == b"req-1"
    expected = bytearray(4 * MiB)
    for i in range(128):
        expected[perm[i] * blk:(perm[i] + 1) * blk] = data[i * blk:(i + 1) * blk]
    expected[2 * MiB:] = data[2 * MiB:]
    assert peer.call("sha", "dst") == sha(expected)  # checked on the target
    assert sha(e.local_read(src, 0, 4 * MiB)) == sha(data)  # source untouched
    e.shutdown()


def test_coalescing_adjacent_blocks(engine_peer):
    peer = engine_peer()
    rid = peer.call("alloc", "dst", MiB, "wo")
    e = kvwire.Engine()
    src = e.alloc(MiB, "local")
    e.local_write(src, 0, pattern(MiB, "c"))
    p = e.connect(peer.call("addr"))
    ops = [(src, i * 4096, rid, i * 4096, 4096) for i in range(256)]
    stats = e.write(p, ops).wait()
    assert stats.ops == 256 and stats.writes < stats.ops
    assert peer.call("sha", "dst") == sha(pattern(MiB, "c"))


def test_read_verified_both_ends(engine_peer):
    peer = engine_peer()
    rid = peer.call("alloc", "src", 2 * MiB, "ro")
    data = pattern(2 * MiB, "r")
    peer.call("fill", "src", data)
    e = kvwire.Engine()
    dst = e.alloc(2 * MiB, "local")
    p = e.connect(peer.call("addr"))
    b = e.read(p, [(dst, 0, rid, MiB, MiB), (dst, MiB, rid, 0, MiB)])
    stats = b.wait()
    assert stats.bytes == 2 * MiB
    assert b.done and b.poll() is not None
    got = e.local_read(dst, 0, 2 * MiB)
    assert got == data[MiB:] + data[:MiB]
    assert peer.call("sha", "src") == sha(data)  # the peer's bytes are unchanged


def test_registered_caller_memory(engine_peer):
    peer = engine_peer()
    rid = peer.call("alloc", "dst", MiB, "rw")
    e = kvwire.Engine()
    buf = (ctypes.c_char * MiB).from_buffer_copy(pattern(MiB, "m"))
    reg = e.register(ctypes.addressof(buf), MiB, "local")
    assert reg.addr == ctypes.addressof(buf) and reg.len == MiB
    p = e.connect(peer.call("addr"))
    e.write(p, [(reg, 0, rid, 0, MiB)]).wait()
    assert peer.call("sha", "dst") == sha(pattern(MiB, "m"))
    # Read it back into a second caller buffer.
    back = (ctypes.c_char * MiB)()
    reg2 = e.register(ctypes.addressof(back), MiB, "local")
    e.read(p, [(reg2, 0, rid, 0, MiB)]).wait()
    assert bytes(back) == pattern(MiB, "m")
    e.unregister(reg)
    e.unregister(reg2)


def test_register_torch_tensor(engine_peer):
    try:
        import torch
    except ImportError:
        msg = "SKIPPED: torch not installed in this venv (tensor registration not exercised)"
        print(msg, file=sys.stderr)
        if os.environ.get("KVWIRE_REQUIRE_TORCH") == "1":
            pytest.fail(msg)
        pytest.skip(msg)
    peer = engine_peer()
    rid = peer.call("alloc", "dst", 1 << 16, "wo")
    e = kvwire.Engine()
    t = torch.arange(1 << 14, dtype=torch.int32)
    reg = kvwire.register_tensor(e, t, "local")
    assert reg.len == t.numel() * t.element_size()
    p = e.connect(peer.call("addr"))
    e.write(p, [(reg, 0, rid, 0, reg.len)]).wait()
    assert peer.call("sha", "dst") == sha(t.numpy().tobytes())
    with pytest.raises(kvwire.InvalidArgumentError):
        kvwire.register_tensor(e, torch.zeros(8, 8)[:, ::2], "local")


def test_errors_typed(engine_peer):
    peer = engine_peer()
    rid = peer.call("alloc", "dst", 4096, "wo")
    ro = peer.call("alloc", "ro", 4096, "ro")
    e = kvwire.Engine()
    src = e.alloc(8192, "local")
    p = e.connect(peer.call("addr"))
    with pytest.raises(kvwire.OutOfBoundsError):
        e.write(p, [(src, 0, rid, 4000, 200)])
    with pytest.raises(kvwire.OutOfBoundsError):
        e.write(p, [(src, 8000, rid, 0, 200)])  # local side
    with pytest.raises(kvwire.OutOfBoundsError):
        e.local_write(src, 8190, b"abcd")
    with pytest.raises(kvwire.OutOfBoundsError):
        e.local_read(src, 0, 1 << 60)  # refused before allocating
    with pytest.raises(kvwire.UnknownRegionError):
        e.write(p, [(src, 0, (999, 1), 0, 10)])
    with pytest.raises(kvwire.AccessDeniedError):
        e.write(p, [(src, 0, ro, 0, 10)])
    with pytest.raises(kvwire.AccessDeniedError):
        e.read(p, [(src, 0, rid, 0, 10)])
    with pytest.raises(kvwire.InvalidArgumentError):
        e.write(p, [("not a region", 0, rid, 0, 10)])
    with pytest.raises(kvwire.InvalidArgumentError):
        e.alloc(10, "sideways")
    with pytest.raises(kvwire.InvalidArgumentError):
        e.register(0, 4096)
    with pytest.raises(kvwire.InvalidArgumentError):
        e.register(4096, 4096)  # not mapped
    with pytest.raises(kvwire.InvalidArgumentError):
        kvwire.Engine(listen="not an address")
    with pytest.raises(kvwire.InvalidArgumentError):
        e.get_notification(-1.0)
    with pytest.raises(kvwire.TimeoutError):
        e.get_notification(0.05)
    assert e.try_get_notification() is None
    # Nothing was written by any refused batch.
    assert peer.call("sha", "dst") == sha(bytes(4096))


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_stale_region_after_unregister(engine_peer, transport):
    peer = engine_peer(transport=transport)
    rid = peer.call("alloc", "dst", 4096, "wo")
    e = kvwire.Engine(transport=transport)
    src = e.alloc(4096, "local")
    p = e.connect(peer.call("addr"))
    e.write(p, [(src, 0, rid, 0, 16)]).wait()
    peer.call("unregister", "dst")
    if transport == "shm":
        # shm copies straight into the target's mapping: the initiator refuses a region only
        # once the removal announcement reached it (bounded wait for it).
        for _ in range(10_000):
            if all(r.id != rid for r in p.regions()):
                break
            threading.Event().wait(0.001)
        assert all(r.id != rid for r in p.regions())
    # TCP: refused at submit (our view is current) or by the target before a byte lands.
    with pytest.raises((kvwire.StaleRegionError, kvwire.UnknownRegionError)):
        e.write(p, [(src, 0, rid, 0, 16)]).wait()
    own = e.alloc(64, "local")
    e.unregister(own)
    with pytest.raises(kvwire.StaleRegionError):
        e.local_write(own, 0, b"x")


def test_wrong_secret_is_auth_error(engine_peer):
    peer = engine_peer(secret=b"right")
    e = kvwire.Engine(secret=b"wrong")
    with pytest.raises(kvwire.AuthError):
        e.connect(peer.call("addr"))
    ok = kvwire.Engine(secret=b"right")
    ok.connect(peer.call("addr"))


def test_fence_refuses_a_peer_until_unfenced():
    t = kvwire.Engine(transport="tcp")
    dst = t.alloc(MiB, "wo")
    p = kvwire.Engine(transport="tcp")
    src = p.alloc(MiB, "local")
    p.local_write(src, 0, b"x" * 4096)
    peer = p.connect(t.listen_addr)
    p.write(peer, [(src, 0, dst, 0, 4096)]).wait(30.0)
    t.fence(p.listen_addr)
    assert len(t.peers()) == 0
    with pytest.raises(kvwire.FencedError):
        p.connect(t.listen_addr)
    assert t.unfence(p.listen_addr)
    assert not t.unfence(p.listen_addr)
    peer = p.connect(t.listen_addr)
    p.write(peer, [(src, 0, dst, 0, 4096)]).wait(30.0)


def test_fence_refuses_the_process_not_its_restart(engine_peer):
    """A fence holds the process that was at the address: it is refused even after its
    connection died, while a new process listening there (the peer restarted) is accepted
    without an unfence, and its bytes land."""
    t = kvwire.Engine(transport="tcp")
    dst = t.alloc(MiB, "wo")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        addr = f"127.0.0.1:{s.getsockname()[1]}"
    old = engine_peer(transport="tcp", listen=addr)
    old.call("alloc", "src", 4096, "local")
    old.call("fill", "src", pattern(4096, "old"))
    assert old.call("connect_write", t.listen_addr, "src", dst.id, 0, 4096) == "ok"
    assert t.local_read(dst, 0, 4096) == pattern(4096, "old")
    t.fence(addr)
    assert old.call("connect_write", t.listen_addr, "src", dst.id, 0, 4096) == "FencedError"
    old.kill()
    new = engine_peer(transport="tcp", listen=addr)
    new.call("alloc", "src", 4096, "local")
    new.call("fill", "src", pattern(4096, "new"))
    assert new.call("connect_write", t.listen_addr, "src", dst.id, 4096, 4096) == "ok"
    assert t.local_read(dst, 0, 4096) == pattern(4096, "old")
    assert t.local_read(dst, 4096, 4096) == pattern(4096, "new")
    assert t.unfence(addr)  # the fence of the old process was still there


def test_dead_peer(engine_peer):
    peer = engine_peer()
    rid = peer.call("alloc", "dst", 4 * MiB, "wo")
    e = kvwire.Engine(transport="tcp", deadline=5.0)
    src = e.alloc(4 * MiB, "local")
    p = e.connect(peer.call("addr"))
    e.write(p, [(src, 0, rid, 0, 4096)]).wait()
    peer.kill()
    with pytest.raises((kvwire.PeerDeadError, kvwire.TimeoutError)) as ei:
        for _ in range(100):  # bounded: the first failure ends it
            e.write(p, [(src, 0, rid, 0, 4 * MiB)]).wait()
    # The peer's death is seen as a dead peer, not only as a deadline.
    assert isinstance(ei.value, kvwire.PeerDeadError), repr(ei.value)
    assert not p.alive


def test_connect_timeout_and_refused():
    # A listener that never answers the handshake.
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    e = kvwire.Engine(connect_timeout=0.3)
    with pytest.raises(kvwire.TimeoutError):
        e.connect("127.0.0.1:%d" % s.getsockname()[1])
    s.close()
    # Nothing listening at all.
    s2 = socket.socket()
    s2.bind(("127.0.0.1", 0))
    port = s2.getsockname()[1]
    s2.close()
    with pytest.raises(kvwire.KvwireError):
        e.connect("127.0.0.1:%d" % port)


def test_shutdown_is_typed():
    e = kvwire.Engine()
    e.shutdown()
    with pytest.raises(kvwire.ShutdownError):
        e.connect("127.0.0.1:1")


def test_gil_released_while_waiting_for_notification(engine_peer):
    """A thread blocked in get_notification must not hold the GIL: the main thread runs Python
    code meanwhile and is the one that triggers the notification. With the GIL held, the main
    thread could not run and the waiter would time out instead."""
    peer = engine_peer()
    e = kvwire.Engine()
    region = e.alloc(4096, "wo")
    sender = kvwire.Engine()
    src = sender.alloc(4096, "local")
    p = sender.connect(e.listen_addr)
    got = {}

    def waiter():
        try:
            got["n"] = e.get_notification(30.0)
        except Exception as ex:  # recorded, asserted below
            got["err"] = ex

    t = threading.Thread(target=waiter)
    t.start()
    counted = 0
    while counted < 200_000:  # pure-Python work while the other thread is blocked in Rust
        counted += 1
    sender.write(p, [(src, 0, region.id, 0, 8)], notify=b"wake").wait()
    t.join(60)
    assert not t.is_alive()
    assert "err" not in got, got.get("err")
    assert bytes(got["n"].tag) == b"wake"
    assert counted == 200_000
    peer.call("addr")


def test_gil_released_while_waiting_for_batch(engine_peer):
    """Batch.wait must not hold the GIL. The peer process is stopped (SIGSTOP), so a batch to it
    cannot complete; a thread waits on it; the main thread runs Python code and is the one that
    resumes the peer (SIGCONT). If wait() held the GIL the main thread could not resume the
    peer and the batch would end in its deadline (TimeoutError) instead of succeeding."""
    import signal

    peer = engine_peer()
    rid = peer.call("alloc", "dst", 32 * MiB, "wo")
    e = kvwire.Engine(transport="tcp", deadline=60.0)
    src = e.alloc(32 * MiB, "local")
    data = pattern(32 * MiB, "gil")
    e.local_write(src, 0, data)
    p = e.connect(peer.call("addr"))
    started = threading.Event()
    got = {}

    def waiter():
        b = e.write(p, [(src, 0, rid, 0, 32 * MiB)], notify=b"gil")
        started.set()
        try:
            got["stats"] = b.wait()
        except Exception as ex:  # recorded, asserted below
            got["err"] = ex

    os.kill(peer.proc.pid, signal.SIGSTOP)
    # kill() returns once the signal is queued: wait until every thread of the peer stopped.
    tasks = f"/proc/{peer.proc.pid}/task"
    deadline = time.monotonic() + 10
    while not all(
        open(f"{tasks}/{t}/stat").read().rsplit(")", 1)[1].split()[0] in ("T", "t")
        for t in os.listdir(tasks)
    ):
        assert time.monotonic() < deadline, "peer did not stop after SIGSTOP"
        time.sleep(0.002)
    try:
        t = threading.Thread(target=waiter)
        t.start()
        assert started.wait(30)
        counted = 0
        while counted < 200_000:  # pure-Python work while the waiter is blocked in Rust
            counted += 1
        assert "stats" not in got  # the stopped peer cannot have acknowledged the batch
    finally:
        os.kill(peer.proc.pid, signal.SIGCONT)
    t.join(60)
    assert not t.is_alive()
    assert "err" not in got, got.get("err")
    assert got["stats"].bytes == 32 * MiB
    assert peer.call("notification", 10.0) == b"gil"
    assert peer.call("sha", "dst") == sha(data)


def test_rdma_near_is_accepted_without_rdma():
    # The data engine of a vLLM worker is told which PCI device (its GPU) it serves; with no
    # RDMA device here the engine still starts and moves bytes over tcp/shm.
    a = kvwire.Engine(rdma_near="0000:1b:00.0")
    b = kvwire.Engine(rdma_near="")
    dst = a.alloc(4096, "wo")
    src = b.alloc(4096, "local")
    data = pattern(4096, "near")
    b.local_write(src, 0, data)
    peer = b.connect(a.listen_addr)
    b.write(peer, [(src, 0, dst.id, 0, 4096)]).wait()
    assert a.local_read(dst, 0, 4096) == data
    assert b.local_read(src, 0, 4096) == data
    with pytest.raises(TypeError):
        kvwire.Engine(rdma_near=5)
