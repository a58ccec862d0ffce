"""The connector's control plane: messages to and from peers, off the scheduler thread.

A :class:`ControlPlane` owns (or borrows) a kvwire engine and two threads:

* **rx** blocks on the engine's notifications, decodes each envelope
  (:mod:`kvwire.vllm.envelope`), answers clock pings and hellos itself, and queues the rest for
  the owner, who takes them with :meth:`ControlPlane.recv` (blocking with a timeout, so the
  owner's own thread can sleep until something arrives or a deadline is due).
* **tx** sends what :meth:`ControlPlane.send` queued, in order per destination. ``send`` never
  blocks and never touches the network: connections are made by short-lived connect threads
  (one per destination at a time, bounded by ``connect_timeout``), with exponential backoff
  after a failure, so a dead or black-holed peer costs the caller nothing. A destination that
  cannot be reached is reported to the owner once per failure streak (``unreachable``); messages
  queued for it are kept up to :data:`MAX_QUEUED` (heartbeats are dropped while it is down).
  An envelope from a destination whose dial waits out a backoff ends the wait: it is up again
  (a restart), and what we owe it (a hello reply, heartbeats) goes now.

Identity: every envelope carries the sender's engine id and incarnation. A destination dialled
by address is bound to the engine that answers the hello sent on the new connection (its reply
echoes the address it was reached as), so addresses that differ textually (``0.0.0.0`` vs a
host name) never split or drop a peer.

Clock: to each peer it has heard from, the plane sends a clock ping every
:data:`CLOCK_INTERVAL`; from the replies it keeps the offset of the peer's monotonic clock
(``peer − ours``, ns) estimated from the exchange with the smallest round trip of the last
:data:`CLOCK_SAMPLES`, with its error bound (half that round trip).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace

import kvwire
from kvwire.vllm import envelope as env

logger = logging.getLogger("kvwire.vllm")

MAX_QUEUED = 4096
CLOCK_INTERVAL = 2.0
CLOCK_SAMPLES = 16
BACKOFF_MIN, BACKOFF_MAX = 0.2, 30.0
HELLO_RESEND = 1.0


def advertised(listen: str, bound: str, advertise_host: str | None, towards: str | None = None) -> str:
    """The address to tell peers for an engine configured to listen on ``listen`` that bound
    ``bound``: the bound port, and the configured host unless it is a wildcard — then
    ``advertise_host``, or this host's address on the route towards ``towards`` (an address of
    a peer), or its host name's address."""
    host = listen.rpartition(":")[0].strip("[]")
    port = bound.rpartition(":")[2]
    if host not in ("", "0.0.0.0", "::"):
        return f"{host}:{port}"
    return f"{advertise_host or local_address(towards)}:{port}"


def local_address(towards: str | None = None) -> str:
    """This host's address on the route towards ``towards`` (``host:port``), else the address
    its host name resolves to (never a wildcard)."""
    if towards:
        host = towards.rpartition(":")[0].strip("[]")
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((host, 9))  # no packet is sent for a UDP connect
                ip = s.getsockname()[0]
                if ip not in ("0.0.0.0", ""):
                    return ip
        except OSError:
            pass
    try:
        ip = socket.gethostbyname(socket.gethostname())
        if not ip.startswith("0."):
            return ip
    except OSError:
        pass
    return "127.0.0.1"


@dataclass
class PeerClock:
    offset_ns: int = 0
    error_ns: int | None = None
    samples: deque = field(default_factory=lambda: deque(maxlen=CLOCK_SAMPLES))

    def add(self, t1: int, t2: int, t3: int, t4: int) -> None:
        rtt = (t4 - t1) - (t3 - t2)
        if rtt < 0:
            return
        self.samples.append((rtt, ((t2 - t1) + (t3 - t4)) // 2))
        rtt, off = min(self.samples)
        self.offset_ns, self.error_ns = off, rtt // 2


@dataclass
class _Out:
    addr: str
    queue: deque = field(default_factory=deque)
    peer: object = None
    connecting: bool = False
    backoff: float = 0.0
    retry_at: float = 0.0
    down_reported: bool = False
    inflight: list = field(default_factory=list)
    dropped: int = 0
    probe: bool = False  # connect even with nothing queued (to exchange hellos)
    failed: int = 0  # dials of this address that failed so far
    hello_at: float = 0.0  # when a hello was last queued on the connection now up


class ControlPlane:
    """See the module docstring. ``hello()`` returns the JSON-able dict this side announces
    (role, descriptor, data addresses); None disables hellos and clock pings (a worker's plane,
    which talks only to its own scheduler)."""

    def __init__(self, *, engine_id: str, incarnation: int, listen: str = "127.0.0.1:0",
                 secret=None, transport: str = "auto", advertise_host: str | None = None,
                 connect_timeout: float = 5.0, hello=None, engine=None, name: str = "ctl"):
        self.engine_id = engine_id
        self.incarnation = incarnation
        self.hello = hello
        self._own_engine = engine is None
        self.engine = engine if engine is not None else kvwire.Engine(
            listen=listen, secret=secret, transport=transport, connect_timeout=connect_timeout)
        self.listen = listen
        self.advertise_host = advertise_host
        self.addr = advertised(listen, self.engine.listen_addr, advertise_host)
        self.name = name
        self.bad_messages = 0
        self.sent = 0
        self.redials = 0  # dials made before their backoff ended, because the peer was heard
        self._lock = threading.Lock()
        self._tx_cv = threading.Condition(self._lock)
        self._rx_cv = threading.Condition(threading.Lock())
        # envelopes and reachability events, in the order they happened: a reply that follows a
        # failed dial must not be undone by that dial's event
        self._inbox: deque = deque()  # (False, envelope) | (True, ("unreachable" | "refused" | "reachable", addr))
        self._outs: dict[str, _Out] = {}
        #: engine id -> the advertised control address its envelopes carry
        self.addr_of: dict[str, str] = {}
        #: address we dialled -> the engine id that answered there
        self.engine_at: dict[str, str] = {}
        #: engine id -> the latest hello it sent (dict) and its incarnation
        self.peer_hello: dict[str, dict] = {}
        self.incarnation_of: dict[str, int] = {}
        self.clocks: dict[str, PeerClock] = {}
        self._clock_due = 0.0
        self._stop = False
        self._threads = [threading.Thread(target=self._rx_loop, name=f"kvwire-{name}-rx", daemon=True),
                         threading.Thread(target=self._tx_loop, name=f"kvwire-{name}-tx", daemon=True)]
        for t in self._threads:
            t.start()

    # ---- owner API ----
    def send(self, addr: str, kind: int, payload: bytes, droppable: bool = False) -> None:
        """Queues one message for ``addr`` (never blocks). ``droppable``: not kept while the
        destination is unreachable (heartbeats)."""
        tag = env.encode(kind, self.engine_id, self.incarnation, self.addr, payload)
        with self._lock:
            out = self._outs.get(addr)
            if out is None:
                out = self._outs[addr] = _Out(addr)
            if droppable and out.peer is None and out.down_reported:
                out.dropped += 1
                return
            if len(out.queue) >= MAX_QUEUED:
                out.queue.popleft()
                out.dropped += 1
            out.queue.append(tag)
            self._tx_cv.notify()

    def probe(self, addr: str, now: bool = False) -> int:
        """Makes sure the engine at ``addr`` answers our hello (``engine_at[addr]`` is then set):
        a connection is made if none is up (``now``: at once, backoff skipped); on a connection
        that is up, a hello is sent again (at most once per :data:`HELLO_RESEND` seconds) in case
        its reply was lost with an earlier connection. Returns how many dials of it failed so far
        (see :meth:`failed_dials`)."""
        with self._lock:
            out = self._outs.get(addr)
            if out is None:
                out = self._outs[addr] = _Out(addr)
            if out.peer is None and not out.connecting and (now or not out.queue):
                out.probe = True
                if now:
                    out.retry_at = 0.0
            elif out.peer is not None and self.hello is not None and addr not in self.engine_at:
                t = time.monotonic()
                if t - out.hello_at >= HELLO_RESEND:
                    out.hello_at = t
                    out.queue.appendleft(self._hello_tag(addr))
            self._tx_cv.notify()
            return out.failed

    def failed_dials(self, addr: str) -> int:
        """How many dials of ``addr`` failed so far."""
        with self._lock:
            out = self._outs.get(addr)
            return out.failed if out is not None else 0

    def recv(self, timeout: float) -> tuple[list, list]:
        """``(envelopes, events)`` that arrived, waiting up to ``timeout`` seconds for the first
        (for an owner that does not need their relative order; see :meth:`recv_ordered`)."""
        items = self.recv_ordered(timeout)
        return [x for ev, x in items if not ev], [x for ev, x in items if ev]

    def recv_ordered(self, timeout: float) -> list:
        """What arrived, in order, waiting up to ``timeout`` seconds for the first: ``(False,
        envelope)`` or ``(True, (kind, addr))`` for a reachability event."""
        with self._rx_cv:
            if not self._inbox and timeout > 0:
                self._rx_cv.wait(timeout)
            items, self._inbox = list(self._inbox), deque()
        return items

    def wake(self) -> None:
        """Makes a waiting :meth:`recv` return now."""
        with self._rx_cv:
            self._rx_cv.notify_all()

    def clock_of(self, engine_id: str) -> tuple[int, int | None]:
        c = self.clocks.get(engine_id)
        return (c.offset_ns, c.error_ns) if c is not None else (0, None)

    def pending(self) -> int:
        """Messages queued or in flight (for tests and ``has_pending_push_work``)."""
        with self._lock:
            return sum(len(o.queue) + len(o.inflight) for o in self._outs.values())

    def close(self) -> None:
        self._stop = True
        with self._lock:
            self._tx_cv.notify_all()
        self.wake()
        for t in self._threads:
            t.join(timeout=2.0)
        if self._own_engine:
            self.engine.shutdown()

    # ---- rx ----
    def _rx_loop(self) -> None:
        while not self._stop:
            try:
                n = self.engine.get_notification(timeout=0.2)
            except kvwire.TimeoutError:
                continue
            except kvwire.KvwireError:
                if self._stop:
                    return
                time.sleep(0.05)
                continue
            now = time.monotonic_ns()
            try:
                tags = env.unbundle(bytes(n.tag))
            except ValueError:
                self.bad_messages += 1
                continue
            for tag in tags:
                self._on_envelope(tag, now)

    def _on_envelope(self, tag: bytes, now: int) -> None:
        try:
            e = env.decode(tag)
        except (ValueError, UnicodeDecodeError):
            self.bad_messages += 1
            return
        if e.engine_id and e.control:
            self.addr_of[e.engine_id] = e.control
            self._heard_at(e.control)
        if e.kind == env.CLOCK:
            self._on_clock(e, now)
            return
        if e.kind in (env.HELLO, env.HELLO_REPLY):
            try:
                h = env.from_json(e.payload)
            except ValueError:
                self.bad_messages += 1
                return
            e = replace(e, hello=h)
            self.peer_hello[e.engine_id] = h
            reached = h.get("reached_as")
            if e.kind == env.HELLO_REPLY and isinstance(reached, str):
                self.engine_at[reached] = e.engine_id
            if e.kind == env.HELLO and self.hello is not None:
                reply = dict(self.hello())
                reply["reached_as"] = h.get("dialled", "")
                self.send(e.control, env.HELLO_REPLY, env.to_json(reply))
        self.incarnation_of[e.engine_id] = e.incarnation
        with self._rx_cv:
            self._inbox.append((False, e))
            self._rx_cv.notify_all()

    def _heard_at(self, addr: str) -> None:
        """An envelope came from the engine advertising ``addr``: it is up, so a dial of it that
        waits out a backoff (it was down a while, say restarting) is made now instead — what we
        owe it (our hello reply, heartbeats) must not wait up to :data:`BACKOFF_MAX`."""
        with self._lock:
            out = self._outs.get(addr)
            if out is not None and out.peer is None and not out.connecting and out.retry_at > time.monotonic():
                out.retry_at = 0.0
                out.backoff = 0.0
                self.redials += 1
                self._tx_cv.notify()

    def _on_clock(self, e, now: int) -> None:
        try:
            t1, t2, t3, reply = env.parse_clock(e.payload)
        except ValueError:
            self.bad_messages += 1
            return
        if reply:
            self.clocks.setdefault(e.engine_id, PeerClock()).add(t1, t2, t3, now)
        else:
            self.send(e.control, env.CLOCK, env.clock(t1, now, time.monotonic_ns(), True), droppable=True)

    # ---- tx ----
    def _tx_loop(self) -> None:
        while not self._stop:
            with self._lock:
                self._tx_cv.wait(0.0005 if any(o.inflight or o.queue for o in self._outs.values()) else 0.2)
                outs = list(self._outs.values())
            now = time.monotonic()
            for o in outs:
                self._service(o, now)
            if self.hello is not None and now >= self._clock_due:
                self._clock_due = now + CLOCK_INTERVAL
                for eid, addr in list(self.addr_of.items()):
                    if eid in self.peer_hello:
                        self.send(addr, env.CLOCK, env.clock(time.monotonic_ns(), 0, 0, False), droppable=True)

    def _service(self, o: _Out, now: float) -> None:
        # One bundle in flight per destination: the next is written only once the last one's
        # notification is queued at the target, which keeps them in order there.
        if o.inflight:
            try:
                if o.inflight[0].poll() is None:
                    return
            except kvwire.KvwireError as e:
                self._broken(o, f"write failed: {e}")
                return
            o.inflight.clear()
        with self._lock:
            peer = o.peer
            if peer is None:
                if (o.queue or o.probe) and not o.connecting and now >= o.retry_at:
                    o.probe = False
                    o.connecting = True
                    threading.Thread(target=self._connect, args=(o,), name=f"kvwire-{self.name}-connect",
                                     daemon=True).start()
                return
            batch, size = [], 4
            while o.queue and (not batch or size + 4 + len(o.queue[0]) <= env.MAX_BUNDLE):
                tag = o.queue.popleft()
                batch.append(tag)
                size += 4 + len(tag)
        if not batch:
            return
        try:
            o.inflight.append(self.engine.write(peer, [], notify=batch[0] if len(batch) == 1 else env.bundle(batch)))
            self.sent += len(batch)
        except kvwire.KvwireError as e:
            with self._lock:
                o.queue.extendleft(reversed(batch))
            self._broken(o, f"write refused: {e}")

    def _connect(self, o: _Out) -> None:
        logger.debug("kvwire: %s dialling %s (%d queued)", self.name, o.addr, len(o.queue))
        try:
            peer = self.engine.connect(o.addr)
        except kvwire.KvwireError as e:
            with self._lock:
                o.connecting = False
                o.failed += 1
                o.backoff = min(BACKOFF_MAX, max(BACKOFF_MIN, o.backoff * 2))
                o.retry_at = time.monotonic() + o.backoff
                first = not o.down_reported
                o.down_reported = True
            if first:
                logger.warning("kvwire: cannot reach %s: %s (retrying with backoff)", o.addr, e)
                self._event(("unreachable", o.addr))
            if "refused" in str(e).lower():
                # Nothing listens there any more: the engine that did is gone (a timeout or a
                # black hole says less, and is left to the peer's heartbeats).
                self._event(("refused", o.addr))
            return
        hello = self._hello_tag(o.addr) if self.hello is not None else None
        with self._lock:
            o.connecting = False
            o.peer = peer
            o.backoff = 0.0
            was_down, o.down_reported = o.down_reported, False
            if hello is not None:
                o.hello_at = time.monotonic()
                o.queue.appendleft(hello)
            self._tx_cv.notify()
        if was_down:
            self._event(("reachable", o.addr))

    def _hello_tag(self, addr: str) -> bytes:
        h = dict(self.hello())
        h["dialled"] = addr
        return env.encode(env.HELLO, self.engine_id, self.incarnation, self.addr, env.to_json(h))

    def _broken(self, o: _Out, why: str) -> None:
        with self._lock:
            o.peer = None
            o.inflight.clear()
            o.backoff = BACKOFF_MIN
            o.retry_at = time.monotonic() + o.backoff
            first = not o.down_reported
            o.down_reported = True
        if first:
            logger.warning("kvwire: connection to %s lost: %s", o.addr, why)
            self._event(("unreachable", o.addr))

    def _event(self, ev) -> None:
        with self._rx_cv:
            self._inbox.append((True, ev))
            self._rx_cv.notify_all()
