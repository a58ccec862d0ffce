"""The connector's control plane (:mod:`kvwire.vllm.control`) on its own: order of delivery,
order of envelopes and reachability events, redials of a peer that is heard from, hellos sent
again on a connection whose peer's identity was lost."""

import time

import pytest

pytest.importorskip("kvwire", reason="kvwire not installed in this venv (run tests/python/setup.sh)")

from kvwire.vllm import envelope as env  # noqa: E402
from kvwire.testing.ports import free_port  # noqa: E402
from kvwire.testing.wait import wait_for as _wait_for  # noqa: E402
from kvwire.vllm.control import ControlPlane  # noqa: E402

WAIT_S = 60.0


def wait_for(cond, timeout=WAIT_S):
    return _wait_for(cond, timeout)


def hello(role):
    return lambda: {"role": role, "data": []}


@pytest.fixture
def planes():
    made = []

    def make(name, **kw):
        c = ControlPlane(engine_id=name, incarnation=len(made) + 1, transport="tcp", **kw)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


def test_control_plane_delivers_in_send_order(planes):
    """Messages to one destination arrive in the order they were sent, however many are queued
    at once (the engine orders only notifications of batches that did not overlap)."""
    a, b = planes("a"), planes("b")
    n = 3000
    for i in range(n):
        a.send(b.addr, env.REPORT, i.to_bytes(4, "little") + bytes(i % 300))
    got = []
    assert wait_for(lambda: got.extend(b.recv(0.05)[0]) or len(got) >= n)
    seq = [int.from_bytes(e.payload[:4], "little") for e in got]
    assert seq == list(range(n))
    assert all(len(e.payload) == 4 + i % 300 for i, e in enumerate(got))
    assert b.bad_messages == 0


def test_events_and_envelopes_come_out_in_the_order_they_happened(planes):
    """A dial that failed, then an envelope: the owner sees the failure first, so the state the
    envelope brings (a hello reply naming who is at an address) is not undone by an older event."""
    a, b = planes("a"), planes("b")
    dead = f"127.0.0.1:{free_port()}"
    a.send(dead, env.REPORT, b"lost")
    assert wait_for(lambda: a.failed_dials(dead) >= 1)
    b.send(a.addr, env.REPORT, b"after")
    items = []
    assert wait_for(lambda: items.extend(a.recv_ordered(0.05)) or any(not ev for ev, _ in items))
    kinds = [x if ev else ("envelope", x.payload) for ev, x in items]
    first = kinds.index(("envelope", b"after"))
    # the dial's events, then (redials of the dead address may add more refusals) the envelope
    assert kinds[:2] == [("unreachable", dead), ("refused", dead)], kinds
    assert set(kinds[2:first]) <= {("refused", dead)}, kinds


def test_a_peer_heard_from_is_dialled_before_its_backoff_ends(planes):
    """Our dials of an address failed (its engine was down, restarting) and the next waits out a
    long backoff; then the engine there sends us something: it is up, so we dial it at once and
    what we queued for it arrives, instead of waiting for the backoff."""
    a = planes("a", hello=hello("d"))
    addr = f"127.0.0.1:{free_port()}"
    a.send(addr, env.REPORT, b"owed")
    assert wait_for(lambda: a.failed_dials(addr) >= 1)
    with a._lock:
        a._outs[addr].retry_at = time.monotonic() + 3600.0  # as after many failures, but longer
    b = planes("b", listen=addr, hello=hello("p"))  # the engine comes back at that address
    assert b.addr == addr
    b.send(a.addr, env.REPORT, b"back")
    got = []
    assert wait_for(lambda: got.extend(e.payload for e in b.recv(0.05)[0] if e.kind == env.REPORT)
                    or b"owed" in got)
    assert a.redials == 1


def test_probe_sends_our_hello_again_on_a_connection_whose_peer_is_unknown(planes):
    """The connection to an address is up but who answers there was forgotten (a refused dial
    of the old engine was handled after the new one's reply): probes send our hello again on
    that connection, and the reply names the engine again."""
    a, b = planes("a", hello=hello("d")), planes("b", hello=hello("p"))
    a.probe(b.addr)
    assert wait_for(lambda: a.engine_at.get(b.addr) == "b")
    a.engine_at.pop(b.addr)
    hellos = b.peer_hello.get("a")
    # the owner probes at each step while it waits (a hello goes out at most once a second)
    assert wait_for(lambda: a.probe(b.addr) >= 0 and a.engine_at.get(b.addr) == "b")
    assert b.peer_hello.get("a") is not hellos  # a second hello reached b
