"""The connector's control envelope: every message between scheduler sides, and between a
scheduler side and its own workers, travels as one kvwire notification in this layout.

::

    b"KVW2" | kind u8 | engine id (u16 length + UTF-8) | incarnation u64
            | sender control address (u16 length + UTF-8) | payload

The sender's identity is its vLLM engine id and the incarnation of this process (random at
start), not an address string: a peer that restarts is recognised by a new incarnation, and one
that announces itself under a different host name than the one it was dialled by is still the
same peer. Envelopes queued for one destination travel together as one *bundle* notification
(``b"KVWB" | (length u32 | envelope)*``), one bundle in flight per destination at a time, so
they arrive in the order they were sent (the engine orders notifications only of batches that
did not overlap in time). Payloads by kind:

* ``TO_P`` / ``TO_D``: an encoded kvwire-connector protocol message (:mod:`kvwire.core`).
* ``HELLO`` / ``HELLO_REPLY``: JSON: the sender's role, advertised data addresses (one per TP
  rank), model/layout descriptor (:mod:`kvwire.vllm.descriptor`), and the address the sender
  used to reach the receiver (``reached_as``, so an address the receiver dialled is bound to the
  identity that answers).
* ``CLOCK``: ``t1 u64 | t2 u64 | t3 u64 | reply u8``: an NTP-style exchange of monotonic
  clocks for the P↔D clock offset of the timelines.
* ``REPORT`` (worker → its scheduler): ``what u8 | key u64 | layer u16 | ok u8 | bytes u64 |
  rank u16 | t_ns u64``.
* ``WORK`` (scheduler → its workers): JSON: destination of a request (D's block ids, addresses)
  or a cancel.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass, field

MAGIC = b"KVW2"
BUNDLE_MAGIC = b"KVWB"
#: Largest bundle (the engine's notification limit is 64 KiB).
MAX_BUNDLE = 60 << 10
_LEN = struct.Struct("<I")
TO_P = 1
REPORT = 2
TO_D = 3
HELLO = 4
HELLO_REPLY = 5
CLOCK = 6
WORK = 7
KINDS = (TO_P, REPORT, TO_D, HELLO, HELLO_REPLY, CLOCK, WORK)

#: What a worker reports (``REPORT``).
LAYER_READY = 1  # the request's last chunk passed this layer
PREFILL_DONE = 2  # the request's last chunk's forward finished
LAYER_SENT = 3  # every block of this layer was written (ok=0: the write failed)
FIRST_BYTE = 4  # the request's first write was posted

_CLOCK = struct.Struct("<QQQB")
_REPORT = struct.Struct("<BQHBQHQ")
#: Longest JSON payload accepted (a destination of 1M blocks is ~14 MB of JSON; notifications
#: are bounded by the engine's tag limit well below that).
MAX_JSON = 1 << 20


@dataclass(frozen=True)
class Envelope:
    kind: int
    engine_id: str
    incarnation: int
    control: str
    payload: bytes
    #: A HELLO's or HELLO_REPLY's payload as parsed by the control plane that received it.
    hello: dict | None = field(default=None, compare=False)


def encode(kind: int, engine_id: str, incarnation: int, control: str, payload: bytes) -> bytes:
    e, c = engine_id.encode(), control.encode()
    return (MAGIC + struct.pack("<BH", kind, len(e)) + e + struct.pack("<QH", incarnation, len(c)) + c
            + payload)


def bundle(tags: list) -> bytes:
    """One notification carrying ``tags`` (envelopes) in order."""
    return BUNDLE_MAGIC + b"".join(_LEN.pack(len(t)) + t for t in tags)


def unbundle(tag: bytes) -> list:
    """The envelopes of a notification: its parts when it is a bundle, else ``[tag]``. Raises
    ``ValueError`` on a malformed bundle (nothing of it is used)."""
    if tag[:4] != BUNDLE_MAGIC:
        return [tag]
    out, i = [], 4
    while i < len(tag):
        if i + 4 > len(tag):
            raise ValueError("bundle: truncated length")
        (n,) = _LEN.unpack_from(tag, i)
        i += 4
        if n == 0 or i + n > len(tag):
            raise ValueError("bundle: part overruns the notification")
        out.append(tag[i:i + n])
        i += n
    if not out:
        raise ValueError("bundle: empty")
    return out


def decode(tag: bytes) -> Envelope:
    """Raises ``ValueError`` on anything malformed."""
    if len(tag) < 7 or tag[:4] != MAGIC:
        raise ValueError("not a kvwire connector envelope")
    kind, n = struct.unpack_from("<BH", tag, 4)
    if kind not in KINDS:
        raise ValueError(f"unknown envelope kind {kind}")
    i = 7
    if len(tag) < i + n + 10:
        raise ValueError("truncated envelope")
    engine_id = tag[i:i + n].decode()
    i += n
    incarnation, m = struct.unpack_from("<QH", tag, i)
    i += 10
    if len(tag) < i + m:
        raise ValueError("truncated envelope")
    control = tag[i:i + m].decode()
    return Envelope(kind, engine_id, incarnation, control, bytes(tag[i + m:]))


def clock(t1: int, t2: int, t3: int, reply: bool) -> bytes:
    return _CLOCK.pack(t1, t2, t3, 1 if reply else 0)


def parse_clock(p: bytes) -> tuple[int, int, int, bool]:
    if len(p) != _CLOCK.size:
        raise ValueError("bad clock payload")
    t1, t2, t3, r = _CLOCK.unpack(p)
    return t1, t2, t3, bool(r)


def report(what: int, key: int, layer: int, ok: bool, nbytes: int, rank: int, t_ns: int) -> bytes:
    return _REPORT.pack(what, key, layer, 1 if ok else 0, nbytes, rank, t_ns)


def parse_report(p: bytes) -> tuple[int, int, int, bool, int, int, int]:
    if len(p) != _REPORT.size:
        raise ValueError("bad report payload")
    what, key, layer, ok, nbytes, rank, t = _REPORT.unpack(p)
    if what not in (LAYER_READY, PREFILL_DONE, LAYER_SENT, FIRST_BYTE):
        raise ValueError(f"unknown report {what}")
    return what, key, layer, bool(ok), nbytes, rank, t


def to_json(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def from_json(p: bytes) -> dict:
    if len(p) > MAX_JSON:
        raise ValueError("JSON payload too long")
    obj = json.loads(p)
    if not isinstance(obj, dict):
        raise ValueError("JSON payload is not an object")
    return obj


def message_request(payload: bytes) -> int | None:
    """The request key a core message is about (None: a heartbeat, or too short to say)."""
    # kvwire-connector frame: "KW" | version | type | u32 length | body (request id first,
    # except heartbeats, type 8)
    if len(payload) < 16 or payload[3] == 8:
        return None
    return struct.unpack_from("<Q", payload, 8)[0]


def request_key(transfer_id: str) -> int:
    """The 64-bit request id both sides derive from the shared transfer id."""
    return int.from_bytes(hashlib.blake2b(transfer_id.encode(), digest_size=8).digest(), "little")
