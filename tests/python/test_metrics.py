"""kvwire.Engine.metrics(): after a known sequence of transfers to a peer in another process,
the counters are exactly what the outcomes imply, and the Prometheus text parses."""

import hashlib
import sys

import pytest

import kvwire
from conftest import pattern

MiB = 1 << 20
CLASSES = ["le_4KiB", "le_64KiB", "le_1MiB", "le_16MiB", "gt_16MiB"]


def size_class(n):
    for limit, name in zip([4 << 10, 64 << 10, 1 << 20, 16 << 20], CLASSES):
        if n <= limit:
            return name
    return CLASSES[-1]


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_metrics_exact_after_known_transfers(engine_peer, transport):
    peer = engine_peer(transport=transport)
    rid = peer.call("alloc", "dst", 4 * MiB, "rw")
    e = kvwire.Engine(transport=transport)
    src = e.alloc(4 * MiB, "local")
    data = pattern(4 * MiB, "m")
    e.local_write(src, 0, data)
    p = e.connect(peer.call("addr"))
    assert p.transport == transport

    m0 = e.metrics()
    assert m0["registrations"] == 1 and m0["registered_bytes"] == 4 * MiB
    assert m0["connections_outbound"] == 1 and m0["peers_connected"] == 1

    sizes = [4096, 100_000, 2 * MiB]
    stats = []
    for n in sizes:
        stats.append(e.write(p, [(src, 0, rid, 0, n)], notify=b"n").wait())
        assert peer.call("notification", 10.0) == b"n"
        # checked on the target
        assert peer.call("sha", "dst", 0, n) == hashlib.sha256(data[:n]).hexdigest()
    rb = e.alloc(8192, "local")
    rstats = e.read(p, [(rb, 0, rid, 0, 8192)]).wait()
    assert e.local_read(rb, 0, 8192) == data[:8192]
    with pytest.raises(kvwire.OutOfBoundsError):
        e.write(p, [(src, 0, rid, 4 * MiB - 10, 4096)])

    m = e.metrics()
    t = m["transports"][transport]
    assert t["write_bytes"] == sum(sizes)
    assert t["write_batches"] == len(sizes)
    assert t["read_bytes"] == 8192 and t["read_batches"] == 1
    assert t["ops"] == len(sizes) + 1
    assert t["slices"] == sum(s.slices for s in stats) + rstats.slices
    assert t["failed_batches"] == 0
    for other, ot in m["transports"].items():
        if other != transport:
            assert ot["write_bytes"] == ot["read_bytes"] == ot["write_batches"] == 0
    want = {c: 0 for c in CLASSES}
    for n in sizes + [8192]:
        want[size_class(n)] += 1
    for h in m["latency"]:
        exp = want[h["size"]] if h["transport"] == transport else 0
        assert h["count"] == exp, h
        assert h["buckets"][-1][1] == exp
        assert h["buckets"][-1][0] == float("inf")
    assert m["errors"]["submit"]["out_of_bounds"] == 1
    assert sum(sum(k.values()) for k in m["errors"].values()) == 1
    assert m["inflight_bytes"] == m["inflight_batches"] == 0
    assert m["registrations"] == 2
    assert len(m["peers"]) == 1
    pp = m["peers"][0]
    assert pp["id"] == p.id and pp["transport"] == transport
    assert pp["write_bytes"] == sum(sizes) and pp["read_bytes"] == 8192
    assert pp["batches"] == len(sizes) + 1
    assert pp["slice_sizes"] is None  # adaptive slice sizes are RDMA's

    text = m["prometheus_text"]
    assert f'kvwire_transfer_bytes_total{{transport="{transport}",dir="write"}} {sum(sizes)}' in text
    try:
        from prometheus_client.parser import text_string_to_metric_families
    except ImportError:
        print("SKIPPED: prometheus_client not installed; exposition text not parsed", file=sys.stderr)
        return
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    # prometheus_client strips the _total suffix from counter family names.
    bytes_fam = fams["kvwire_transfer_bytes"]
    got = {
        (s.labels["transport"], s.labels["dir"]): s.value
        for s in bytes_fam.samples
        if s.name == "kvwire_transfer_bytes_total"
    }
    assert got[(transport, "write")] == sum(sizes)
    assert got[(transport, "read")] == 8192
    hist = fams["kvwire_batch_latency_seconds"]
    counts = {
        s.labels["size"]: s.value
        for s in hist.samples
        if s.name.endswith("_count") and s.labels["transport"] == transport
    }
    assert counts == {c: float(v) for c, v in want.items()}
    e.shutdown()


def test_region_bytes_by_kind():
    """Registered bytes by what the memory is: allocated by the engine, or the caller's
    (pageable here: pinned memory needs a GPU, see tests/gpu/test_staging_cuda.py), in the dict
    and in the Prometheus text; an unregistered region leaves its kind's count."""
    import ctypes

    e = kvwire.Engine(transport="tcp")
    a = e.alloc(3 * 4096, "rw")
    buf = ctypes.create_string_buffer(5000)
    r = e.register(ctypes.addressof(buf), 5000, "rw")
    m = e.metrics()
    assert m["region_bytes_by_kind"] == {"engine": 3 * 4096, "host": 5000, "pinned": 0, "device": 0}
    assert 'kvwire_region_bytes_by_kind{kind="host"} 5000' in m["prometheus_text"]
    e.unregister(r)
    assert e.metrics()["region_bytes_by_kind"] == {"engine": 3 * 4096, "host": 0, "pinned": 0, "device": 0}
    e.unregister(a)
    e.shutdown()
