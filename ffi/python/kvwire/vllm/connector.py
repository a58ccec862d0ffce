"""``KvwireConnector``: a vLLM v1 KV connector on kvwire.

Roles and processes
-------------------
vLLM builds the connector twice: in the scheduler (``role=SCHEDULER``) and in each worker
(``role=WORKER``). The scheduler halves of P and D run the P/D protocol core (Rust
``PCore``/``DCore``) and talk to each other with kvwire notifications (control messages over
kvwire itself). The worker halves register the KV caches with a kvwire engine and move the
bytes: P's worker writes its blocks straight into D's KV cache.

Request parameters (``kv_transfer_params``)
-------------------------------------------
* D: ``{"do_remote_prefill": true, "transfer_id": X, "remote_control": "host:port"}``
  (P's control address).
* P: ``{"do_remote_decode": true, "transfer_id": X, "remote_control": "host:port"}``
  (D's control address).

Extra config (``kv_connector_extra_config``)
--------------------------------------------
``policy``: ``eager`` | ``lazy`` (default) | ``jit`` — when D reserves its blocks (lazy: once P
announced it started the request; until then ``get_num_new_matched_tokens`` returns ``None``
and the request holds no block). ``send_mode``: ``whole`` (default) | ``layerwise``.
``stats_interval`` (s, default 0.1): how often vLLM's stats hooks take a new snapshot of the
cores and engines (see docs/metrics.md). ``control_listen`` (scheduler), ``data_listen``
(worker; D's must be reachable by P's worker and is announced to P by D's scheduler; TP rank r
listens on its port + r),
``secret``, ``transport``, ``layers`` and the core's timeouts (``peer_timeout``,
``wait_for_p_timeout``, ``request_timeout``, ``drain_timeout``,
``block_ids_timeout``, in seconds).

Failures on D (P down, timeout, transfer error, P aborted) are reported through vLLM's load-error
path: the request is listed in ``finished_recving`` and its blocks in
``get_block_ids_with_load_errors`` (``kv_load_failure_policy`` decides fail or recompute). A D
request aborted after its block ids went to P keeps its blocks (``request_finished`` returns
``True``) until P confirms that no write is in flight. One aborted once every layer landed
holds nothing more: vLLM frees its blocks on its one report (``finished_recving``, or
``finished_sending`` when the abort came before the workers were told).

Tensor parallelism
------------------
P and D must run the same tensor parallel size N. Each worker (TP rank r, as vLLM's
``get_tensor_model_parallel_rank``) has its own data engine holding its shard of every layer (its
heads, the same block ids on every rank), and P's rank r writes its shard into D's rank r. Rank r
listens on ``data_listen``'s port + r (each rank of a host needs its own port; port 0: an
ephemeral port per rank). The addresses reach the scheduler through vLLM's own handshake hooks
(``get_handshake_metadata`` on each worker, ``set_xfer_handshake_metadata`` in EngineCore, as NIXL
does), so that what D announces to P is what its ranks actually bound, on whatever host each
rank runs: D's scheduler announces its N rank addresses in rank order, comma-separated, in the
control envelope; their count is D's TP size. (At N = 1 a configured ``data_listen`` is announced
as before.) P's scheduler counts a layer as sent only when every one of its N ranks reported it
(any failure fails the layer, hence the request, once no rank still writes). A P whose TP size
differs from the size D announced fails the request's transfers at once (a transfer error, seen
on D through the load-error path). Pipeline parallelism is not supported.

GPU KV caches
-------------
kvwire's transports move host memory. ``staging``: ``auto`` (default: iff the KV cache is on
CUDA) | ``always`` (CPU caches too) | ``never`` (a CUDA cache is refused) makes a worker go
through pinned host memory (:mod:`kvwire.vllm.staging`): P gathers each layer transfer into a
bounded pool (``staging_mb``, default 256) with async copies ordered after the layer's compute,
then writes from there; D offers a host mirror of its KV cache (as much host memory as the
cache) and copies a request's blocks to the device before reporting it received. Either side
may stage or not, independently. With staging off, a CPU KV cache is registered and written in
place.

Limits: D must not use a local prefix hit for a remote-prefill request (all prompt blocks are
received).
"""

from __future__ import annotations

import hashlib
import logging
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import kvwire
from kvwire._kvwire import DCore, PCore
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from vllm.v1.request import RequestStatus

from kvwire.vllm import compat
from kvwire.vllm import staging as _staging
from kvwire.vllm import stats as _stats
from kvwire.vllm.stats import KvwireConnectorStats, KvwirePromMetrics

logger = logging.getLogger("kvwire.vllm")

# ---- control envelope ------------------------------------------------------------------------
# b"KVW1" | kind u8 | u16 len + sender control address | u16 len + sender data address | payload
_MAGIC = b"KVW1"
KIND_TO_P = 1  # payload: an encoded kvwire-connector Message from a D core to a P core
# payload: req u64 | layer u16 | ok u8 | bytes u64 | TP rank u16 (P worker -> P scheduler)
KIND_XFER = 2
KIND_TO_D = 3  # payload: an encoded kvwire-connector Message from a P core to a D core
_XFER = struct.Struct("<QHBQH")


def encode_envelope(kind: int, control: str, data: str, payload: bytes) -> bytes:
    c, d = control.encode(), data.encode()
    return _MAGIC + struct.pack("<BH", kind, len(c)) + c + struct.pack("<H", len(d)) + d + payload


def decode_envelope(tag: bytes):
    """``(kind, control, data, payload)``; raises ``ValueError`` on malformed input."""
    if len(tag) < 7 or tag[:4] != _MAGIC:
        raise ValueError("not a kvwire connector envelope")
    kind, n = struct.unpack_from("<BH", tag, 4)
    i = 7
    if len(tag) < i + n + 2:
        raise ValueError("truncated envelope")
    control = tag[i:i + n].decode()
    i += n
    (m,) = struct.unpack_from("<H", tag, i)
    i += 2
    if len(tag) < i + m:
        raise ValueError("truncated envelope")
    data = tag[i:i + m].decode()
    return kind, control, data, bytes(tag[i + m:])


def request_key(transfer_id: str) -> int:
    """The 64-bit request id both sides derive from the shared transfer id."""
    return int.from_bytes(hashlib.blake2b(transfer_id.encode(), digest_size=8).digest(), "little")


def _now() -> int:
    return time.monotonic_ns()


def _host_port(addr: str) -> tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    try:
        p = int(port)
    except ValueError:
        p = -1
    if not sep or not host or not 0 <= p <= 65535:
        raise kvwire.InvalidArgumentError(f"data address {addr!r} is not host:port")
    return host, p


def rank_listen(data_listen: str, rank: int) -> str:
    """Where TP rank ``rank`` listens for data: ``data_listen`` itself for rank 0, its port +
    ``rank`` for the others (port 0: an ephemeral port per rank)."""
    if rank == 0:
        return data_listen
    host, port = _host_port(data_listen)
    if port == 0:
        return f"{host}:0"
    if port + rank > 65535:
        raise kvwire.InvalidArgumentError(f"data_listen {data_listen!r}: no port for tensor parallel rank {rank}")
    return f"{host}:{port + rank}"


def rank_address(announced: str, rank: int, tp: int) -> str:
    """The data address of D's TP rank ``rank`` in what D's scheduler announced (its ranks'
    addresses in rank order, comma-separated); a typed error when D's TP size differs."""
    addrs = announced.split(",")
    if len(addrs) != tp:
        raise kvwire.InvalidArgumentError(
            f"D announced {len(addrs) if announced else 0} data address(es), one per tensor parallel rank, "
            f"but this instance has tensor parallel size {tp}: P and D must use the same size")
    return addrs[rank]


@dataclass
class KvwireHandshake(compat.KVConnectorHandshakeMetadata):
    """Worker -> scheduler at startup (vLLM's handshake hooks): where this TP rank's data engine
    is reachable."""

    rank: int
    tp: int
    data_addr: str


class _Control:
    """A kvwire engine used for control messages: sends go over our own outbound connection to
    each peer's listen address; receives are notifications."""

    def __init__(self, listen: str, secret, transport: str, data_addr: str = ""):
        self.engine = kvwire.Engine(listen=listen, secret=secret, transport=transport)
        self.addr = self.engine.listen_addr
        self.data_addr = data_addr
        self._peers: dict[str, Any] = {}
        self._ids: dict[str, int] = {}
        self._addrs: dict[int, str] = {}
        self.bad_messages = 0

    def peer_id(self, addr: str) -> int:
        pid = self._ids.get(addr)
        if pid is None:
            pid = len(self._ids) + 1
            self._ids[addr] = pid
            self._addrs[pid] = addr
        return pid

    def addr_of(self, pid: int) -> str | None:
        return self._addrs.get(pid)

    def send(self, pid_or_addr, kind: int, payload: bytes) -> None:
        """Sends one message; raises a ``kvwire.KvwireError`` when the peer cannot be reached."""
        addr = pid_or_addr if isinstance(pid_or_addr, str) else self._addrs[pid_or_addr]
        peer = self._peers.get(addr)
        if peer is None or not peer.alive:
            peer = self.engine.connect(addr)
            self._peers[addr] = peer
        tag = encode_envelope(kind, self.addr, self.data_addr, payload)
        try:
            self.engine.write(peer, [], notify=tag).wait()
        except kvwire.KvwireError:
            self._peers.pop(addr, None)
            raise

    def drain(self, limit: int = 100_000):
        """Queued messages as ``(kind, control, data, payload)``; malformed ones are dropped."""
        out = []
        for _ in range(limit):
            n = self.engine.try_get_notification()
            if n is None:
                break
            try:
                out.append(decode_envelope(bytes(n.tag)))
            except (ValueError, UnicodeDecodeError, struct.error):
                self.bad_messages += 1
        return out

    def close(self):
        self.engine.shutdown()


@dataclass
class KvwireConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> worker, once per step."""

    # D: requests whose KV fully landed (-> finished_recving).
    finished_recving: set = field(default_factory=set)
    # D: the block ids of the requests in finished_recving (a staged worker copies them from its
    # landing mirror to the device before reporting the request).
    recv_block_ids: dict = field(default_factory=dict)
    # D: failed requests -> their block ids that did not load.
    failed_recving: dict = field(default_factory=dict)
    # Either side: delayed block frees that may now happen (-> finished_sending).
    finished_sending: set = field(default_factory=set)
    # P: (req_key, layer, src blocks, dst blocks, D data address, phase): phase "now" (at the
    # start of the step), "layer" (after that layer's attention), "after" (after the forward).
    transfers: list = field(default_factory=list)
    # P: where the worker reports transfer completions (our scheduler's control address).
    scheduler_control: str = ""
    preempted_req_ids: set = field(default_factory=set)


def _extra(vllm_config) -> dict:
    kt = vllm_config.kv_transfer_config
    return dict(kt.kv_connector_extra_config or {})


def _num_layers(vllm_config, kv_cache_config, extra) -> int:
    if "layers" in extra:
        return int(extra["layers"])
    if kv_cache_config is not None and kv_cache_config.kv_cache_groups:
        return len(kv_cache_config.kv_cache_groups[0].layer_names)
    return vllm_config.model_config.get_num_layers(vllm_config.parallel_config)


class KvwireConnector(KVConnectorBase_V1, compat.SupportsHMA):
    """kvwire's P/D connector (see the module docstring)."""

    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        extra = _extra(vllm_config)
        self._extra = extra
        self._policy = extra.get("policy", "lazy")
        self._send_mode = extra.get("send_mode", "whole")
        secret = extra.get("secret")
        self._secret = secret.encode() if isinstance(secret, str) else secret
        self._transport = extra.get("transport", "auto")
        self._block_size = vllm_config.cache_config.block_size
        self._layers = _num_layers(vllm_config, kv_cache_config, extra)
        # Stats snapshots at most this often (s): Engine.metrics() costs hundreds of µs, too much
        # for every step. Counters stay exact (deltas of cumulative values), gauges lag by up to this.
        try:
            interval = float(extra.get("stats_interval", 0.1))
        except (TypeError, ValueError):
            interval = -1.0
        if not (interval >= 0 and interval < 1e9):
            raise kvwire.InvalidArgumentError(
                f"stats_interval must be a number of seconds >= 0, got {extra.get('stats_interval')!r}")
        self._stats_interval_ns = int(interval * 1e9)
        kt = vllm_config.kv_transfer_config
        self._is_producer = kt.kv_role in ("kv_producer", "kv_both")
        self._is_consumer = kt.kv_role in ("kv_consumer", "kv_both")
        self._tp = compat.tp_size(vllm_config)
        if role == KVConnectorRole.SCHEDULER:
            self._sched = _SchedulerSide(self)
            self._worker = None
        else:
            self._sched = None
            self._worker = _WorkerSide(self)

    # ---- scheduler side ----
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return self._sched.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        self._sched.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output):
        return self._sched.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output):
        self._sched.update_connector_output(connector_output)

    def request_finished(self, request, block_ids):
        return self._sched.request_finished(request, list(block_ids))

    def request_finished_all_groups(self, request, block_ids):
        return self._sched.request_finished(request, list(block_ids[0]) if block_ids else [])

    # ---- stats (vLLM's connector stats and Prometheus hooks) ----
    def get_kv_connector_stats(self):
        """Scheduler: the connector cores' deltas and gauges since the last call; worker: the data
        engine's. ``None`` when nothing changed (except on vLLM 0.18.1's worker, see compat)."""
        half = self._sched if self._sched is not None else self._worker
        return half.stats() if half is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data=None):
        # A copy: the logger's accumulator aggregates into it, and vLLM gives the same payload
        # to its Prometheus logger.
        return KvwireConnectorStats(data=_stats.copy_payload(data))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return KvwirePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def has_pending_push_work(self):  # 0.33.0 only; keeps P stepping while sends are pending
        return self._sched is not None and self._sched.has_pending_work()

    def get_handshake_metadata(self):
        """Worker: this TP rank's data address (EngineCore collects every rank's at startup)."""
        return self._worker.handshake() if self._worker is not None else None

    def set_xfer_handshake_metadata(self, metadata):
        """Scheduler: every TP rank's handshake (``{tp_rank: KvwireHandshake}``), once at
        startup: what D announces to P as its data addresses."""
        if self._sched is not None:
            self._sched.set_rank_addrs(metadata)

    @property
    def control_addr(self) -> str:
        """The scheduler side's control address (what the other side puts in
        ``remote_control``)."""
        return self._sched.control.addr

    @property
    def data_addr(self) -> str:
        """The worker side's data address."""
        return self._worker.engine.listen_addr

    # ---- worker side ----
    def register_kv_caches(self, kv_caches):
        self._worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context, **kwargs):
        self._worker.start_load_kv(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name):
        return None

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        if attn_metadata is None or not self.has_connector_metadata():
            return
        self._worker.save_kv_layer(self._get_connector_metadata(), layer_name)

    def wait_for_save(self):
        if self.has_connector_metadata():
            self._worker.wait_for_save(self._get_connector_metadata())

    def get_finished(self, finished_req_ids):
        return self._worker.get_finished()

    def get_block_ids_with_load_errors(self):
        return self._worker.take_load_errors()

    def handle_preemptions(self, arg):
        return None

    def shutdown(self):
        if self._sched is not None:
            self._sched.close()
        if self._worker is not None:
            self._worker.close()

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config):
        return None


class _SchedulerSide:
    """The scheduler half: protocol cores, control messages, what the workers must do."""

    def __init__(self, c: KvwireConnector):
        ex = c._extra
        self.c = c
        # What D announces as its data address(es): at TP 1 the configured data_listen (the
        # handshake may replace an unset one); above, nothing until every rank's handshake came.
        self.control = _Control(ex.get("control_listen", "127.0.0.1:0"), c._secret, c._transport,
                                ex.get("data_listen", "") if c._tp == 1 else "")
        t = dict(transport="kvwire")

        def opt(*names):
            return {n: float(ex[n]) for n in names if n in ex}

        self.d = DCore(c._policy, c._layers, **t, **opt("peer_timeout", "wait_for_p_timeout", "request_timeout", "drain_timeout")) if c._is_consumer else None
        self.p = PCore(c._send_mode, c._layers, **t, **opt("peer_timeout", "request_timeout", "block_ids_timeout", "drain_timeout")) if c._is_producer else None
        # D requests: vLLM id -> key and back; P likewise.
        self.d_key: dict[str, int] = {}
        self.d_req: dict[int, str] = {}
        self.d_failed_early: dict[int, str] = {}  # failed before any reservation
        self.d_delayed: set[str] = set()  # aborted D requests whose blocks wait for P
        self.d_reported: set[str] = set()
        # Listed in a step's finished_recving, the workers' report not back yet (a staged worker
        # reports only once its landing copy completed).
        self.d_recv_sent: set[str] = set()
        self.d_promoted: set[int] = set()
        # Promoted in this step: their first token comes out of this step's forward.
        self.d_first_pending: set[int] = set()
        self.p_key: dict[str, int] = {}
        self.p_req: dict[int, str] = {}
        self.p_info: dict[int, tuple] = {}  # key -> (peer id, tokens, blocks)
        self.p_scheduled: set[int] = set()
        self.p_done: set[int] = set()
        self.p_delayed: set[str] = set()
        self.p_transfers_pending = 0
        # key -> layer -> [ranks that reported, all ok, bytes]: a (request, layer) transfer is
        # reported to the core once every TP rank reported it.
        self.p_xfer: dict[int, dict[int, list]] = {}
        self.tp_refused: set[int] = set()  # D peers whose TP size differs (warned once)
        self.peer_data: dict[int, str] = {}
        # Worker-bound, drained into the next metadata.
        self.out_recv: set[str] = set()
        self.out_failed: dict[str, list] = {}
        self.out_sending: set[str] = set()
        self.out_transfers: list = []
        self.timeline: list[str] = []
        self.lock = threading.Lock()
        self.deltas = _stats.DeltaTracker("scheduler")
        self.stats_at = None
        # Idle fast path: the cores are polled only when a call into them since the last poll may
        # have queued actions or timeline records (_dirty: every event call sets it) or when
        # their earliest deadline (_deadline, ns, as of the last poll) is due.
        self._dirty = True
        self._deadline = None
        # The metadata of a step with nothing for the workers (built once, handed out again
        # while still empty; neither vLLM nor the worker side mutates metadata).
        self._empty_meta = None

    # -- helpers --
    def _params(self, request):
        return getattr(request, "kv_transfer_params", None) or {}

    def _run_actions(self, now):
        if not self._dirty and (self._deadline is None or now < self._deadline):
            return  # no core call since the last poll and no deadline due: nothing can be queued
        cores = [(core, side) for core, side in ((self.d, "d"), (self.p, "p")) if core is not None]
        if any((t := core.poll_timeout()) is not None and t <= now for core, _ in cores):
            # Deadlines judge peer liveness: first take in what the peers already delivered
            # (a scheduler step longer than peer_timeout must not declare a peer down whose
            # heartbeats are waiting in our queue).
            self._drain(now)
        # Cleared before polling: an action handler that calls into a core sets it again.
        self._dirty = False
        deadline = None
        for core, side in cores:
            if (t := core.poll_timeout()) is not None and t <= now:
                core.handle_timeout(now)
            for a in core.poll_actions():
                getattr(self, f"_{side}_action")(a, now)
            self.timeline.extend(core.poll_timeline())
            if (t := core.poll_timeout()) is not None and (deadline is None or t < deadline):
                deadline = t
        self._deadline = deadline

    def _send(self, core, peer, payload, now):
        try:
            self.control.send(peer, KIND_TO_D if core is self.p else KIND_TO_P, payload)
        except kvwire.KvwireError as e:
            logger.warning("kvwire: peer %s unreachable: %s", self.control.addr_of(peer), e)
            self._dirty = True
            core.peer_down(peer, now)

    def _d_action(self, a, now):
        kind = a[0]
        if kind == "send":
            self._send(self.d, a[1], a[2], now)
        elif kind == "finished":
            req = self.d_req.get(a[1])
            if req is not None:
                self.out_recv.add(req)
        elif kind == "failed":
            req = self.d_req.get(a[1])
            if req is None:
                return
            if req in self.d_delayed:
                pass  # aborted by vLLM already: its blocks are freed through the release path
            elif a[2]:
                self.out_failed[req] = list(a[2])
            elif req not in self.d_delayed:
                self.d_failed_early[a[1]] = req
            logger.warning("kvwire: request %s failed on D: %s", req, a[3])
        elif kind == "release":
            req = self.d_req.get(a[1])
            if req is not None and req in self.d_delayed:
                self.d_delayed.discard(req)
                self.out_sending.add(req)
                self._forget_d(a[1])
        # "may_reserve": polled in get_num_new_matched_tokens; "disconnect": nothing to tear
        # down (data connections belong to the workers).

    def _p_action(self, a, now):
        kind = a[0]
        if kind == "send":
            self._send(self.p, a[1], a[2], now)
        elif kind == "transfer":
            _, key, peer, layer, src, dst = a
            data = self.peer_data.get(peer, "")
            n = data.count(",") + 1 if data else 0  # D's TP size (nothing announced: 0)
            if n != self.c._tp and (n or self.c._tp > 1):
                if peer not in self.tp_refused:
                    self.tp_refused.add(peer)
                    logger.warning("kvwire: D %s announced %d data address(es), one per tensor parallel rank, "
                                   "this P has tensor parallel size %d: its transfers fail",
                                   self.control.addr_of(peer), n, self.c._tp)
                self._dirty = True
                try:
                    self.p.transfer_failed(key, layer, now)
                except kvwire.ConnectorError:
                    pass
                return
            self.out_transfers.append((key, layer, src, dst, data, "now"))
            self.p_transfers_pending += 1
            self.p_xfer.setdefault(key, {})[layer] = [set(), True, 0]
        elif kind == "release":
            req = self.p_req.get(a[1])
            if req is not None and req in self.p_delayed:
                self.p_delayed.discard(req)
                self.out_sending.add(req)
            self._forget_p(a[1])
        elif kind == "failed":
            logger.warning("kvwire: request %s failed on P: %s", self.p_req.get(a[1]), a[2])

    def _forget_d(self, key):
        self.d_first_pending.discard(key)
        self.d_failed_early.pop(key, None)
        req = self.d_req.pop(key, None)
        if req is not None:
            self.d_key.pop(req, None)
            self.d_reported.discard(req)
            self.d_recv_sent.discard(req)

    def _forget_p(self, key):
        open_xfers = self.p_xfer.pop(key, None)
        if open_xfers:  # reports still due from some rank: they will be ignored
            self.p_transfers_pending = max(0, self.p_transfers_pending - len(open_xfers))
        req = self.p_req.pop(key, None)
        if req is not None and req not in self.p_delayed:
            self.p_key.pop(req, None)
        self.p_info.pop(key, None)
        self.p_scheduled.discard(key)
        self.p_done.discard(key)

    def _poll(self):
        now = _now()
        self._drain(now)
        self._run_actions(now)

    def _drain(self, now):
        """Hands every queued control message to its core (their actions run in
        ``_run_actions``)."""
        # The common case, an empty queue, costs one call into the engine.
        first = self.control.engine.try_get_notification()
        if first is None:
            return
        try:
            msgs = [decode_envelope(bytes(first.tag))]
        except (ValueError, UnicodeDecodeError, struct.error):
            self.control.bad_messages += 1
            msgs = []
        msgs += self.control.drain()
        self._dirty = True  # the messages below go into the cores
        for kind, control, data, payload in msgs:
            pid = self.control.peer_id(control)
            if data:
                self.peer_data[pid] = data
            if kind in (KIND_TO_P, KIND_TO_D):
                core = self.p if kind == KIND_TO_P else self.d
                if core is None:
                    self.control.bad_messages += 1
                    continue
                try:
                    core.message(pid, payload, now)
                except kvwire.ConnectorError as e:
                    logger.warning("kvwire: message from %s refused: %s", control, e)
            elif kind == KIND_XFER and self.p is not None:
                try:
                    key, layer, ok, nbytes, rank = _XFER.unpack(payload)
                except struct.error:
                    self.control.bad_messages += 1
                    continue
                if rank >= self.c._tp:
                    self.control.bad_messages += 1
                    continue
                self._xfer_report(key, layer, rank, ok, nbytes, now)

    def _xfer_report(self, key, layer, rank, ok, nbytes, now):
        """One P worker rank's report of a (request, layer) transfer. The core hears of the
        transfer once every rank reported it (done if all succeeded, failed otherwise), so that
        no rank still writes when the core fails or releases the request."""
        layers = self.p_xfer.get(key)
        st = layers.get(layer) if layers is not None else None
        if st is None:
            # Not a transfer in flight (its request is over): the core counts it as late or
            # refuses it.
            st = [None, bool(ok), nbytes]
        elif rank in st[0]:
            logger.debug("kvwire: repeated transfer report (layer %d, rank %d)", layer, rank)
            return
        else:
            st[0].add(rank)
            st[1] = st[1] and bool(ok)
            st[2] += nbytes
            if len(st[0]) < self.c._tp:
                return
            del layers[layer]
            if not layers:
                del self.p_xfer[key]
            self.p_transfers_pending = max(0, self.p_transfers_pending - 1)
        try:
            if st[1]:
                self.p.transfer_done(key, layer, st[2], now)
            else:
                self.p.transfer_failed(key, layer, now)
        except kvwire.ConnectorError as e:
            logger.debug("kvwire: transfer report refused: %s", e)

    # -- vLLM hooks --
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        params = self._params(request)
        if not params.get("do_remote_prefill") or self.d is None:
            return 0, False
        req = request.request_id
        key = self.d_key.get(req)
        tokens = request.num_prompt_tokens - num_computed_tokens
        if key is None:
            key = request_key(str(params.get("transfer_id", req)))
            now = _now()
            peer = self.control.peer_id(str(params["remote_control"]))
            blocks = -(-request.num_prompt_tokens // self.c._block_size)
            self._dirty = True
            try:
                self.d.arrived(key, peer, max(tokens, 1), blocks, now)
            except kvwire.ConnectorError as e:
                logger.warning("kvwire: request %s refused: %s", req, e)
                return 0, False
            self.d_key[req] = key
            self.d_req[key] = req
            self._run_actions(now)
        if key in self.d_failed_early:
            # Failed before any reservation: admit it so the failure takes vLLM's load-error path.
            return tokens, True
        if self.d.may_reserve(key):
            return tokens, True
        return None, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        req = request.request_id
        params = self._params(request)
        if params.get("do_remote_prefill") and self.d is not None and num_external_tokens > 0:
            key = self.d_key.get(req)
            if key is None:
                return
            ids = compat.block_ids_group0(blocks)
            now = _now()
            if self.d_failed_early.pop(key, None) is not None:
                self.out_failed[req] = ids
                self._forget_d(key)
                return
            self._dirty = True
            try:
                self.d.reserved(key, ids, now)
            except kvwire.ConnectorError as e:
                logger.warning("kvwire: reservation for %s refused: %s", req, e)
                try:
                    self.d.abort(key, now)
                except kvwire.ConnectorError:
                    pass
                self.out_failed[req] = ids
            self._run_actions(now)
        elif params.get("do_remote_decode") and self.p is not None:
            if req in self.p_key:
                return
            key = request_key(str(params.get("transfer_id", req)))
            peer = self.control.peer_id(str(params["remote_control"]))
            self.p_key[req] = key
            self.p_req[key] = req
            self.p_info[key] = (peer, request.num_prompt_tokens)

    def _p_schedule(self, key, block_ids, now):
        if key in self.p_scheduled:
            return True
        info = self.p_info.get(key)
        need = -(-info[1] // self.c._block_size) if info else 0
        if info is None or len(block_ids) < need:
            return False
        self._dirty = True
        try:
            self.p.scheduled(key, info[0], info[1], list(block_ids[:need]), now)
            self.p_scheduled.add(key)
        except kvwire.ConnectorError as e:
            logger.warning("kvwire: P scheduling of %s refused: %s", self.p_req.get(key), e)
            return False
        return True

    def build_connector_meta(self, scheduler_output):
        now = _now()
        self._poll()
        if not (self._dirty or self.p_key or self.d_reported or self.out_recv or self.out_failed
                or self.out_sending or self.out_transfers) and (self._deadline is None or now < self._deadline):
            return self._idle_meta()  # idle: the rest of this method would do nothing
        prefilling = set()
        if self.p is not None and self.p_key:
            # Prefills that complete in this step: every layer becomes ready during it.
            for new in scheduler_output.scheduled_new_reqs:
                key = self.p_key.get(new.req_id)
                if key is None:
                    continue
                ids = list(new.block_ids[0]) if new.block_ids else []
                n = scheduler_output.num_scheduled_tokens.get(new.req_id, 0)
                if self._p_schedule(key, ids, now) and new.num_computed_tokens + n >= self.p_info[key][1]:
                    self._dirty = True
                    for layer in range(self.c._layers):
                        self.p.layer_ready(key, layer, now)
                    self.p.prefill_done(key, now)
                    self.p_done.add(key)
                    prefilling.add(key)
        if self.d is not None and self.d_reported:
            for new in scheduler_output.scheduled_new_reqs:
                if new.req_id in self.d_reported:
                    self.d_reported.discard(new.req_id)
                    key = self.d_key.get(new.req_id)
                    if key is not None:
                        self._dirty = True
                        try:
                            self.d.promoted(key, now)
                            self.d_promoted.add(key)
                            self.d_first_pending.add(key)
                        except kvwire.ConnectorError:
                            pass
        self._run_actions(now)
        if not (self.out_recv or self.out_failed or self.out_sending or self.out_transfers):
            return self._idle_meta()
        # Transfers of prefills computed in this very step run during the forward (layerwise:
        # right after each layer's attention) or after it (whole); the others at its start.
        late = "layer" if self.c._send_mode == "layerwise" else "after"
        self.out_transfers = [t[:5] + ((late if t[0] in prefilling else "now"),) for t in self.out_transfers]
        meta = KvwireConnectorMetadata(
            finished_recving=self.out_recv,
            recv_block_ids={r: list(self.d.reserved_blocks(self.d_key[r])) for r in self.out_recv if r in self.d_key},
            failed_recving=self.out_failed,
            finished_sending=self.out_sending,
            transfers=self.out_transfers,
            scheduler_control=self.control.addr,
        )
        self.d_recv_sent |= self.out_recv
        self.out_recv, self.out_failed, self.out_sending, self.out_transfers = set(), {}, set(), []
        return meta

    def _idle_meta(self):
        """The metadata of a step with nothing for the workers (callers checked that nothing is
        pending for them)."""
        meta = self._empty_meta
        if meta is None or meta.finished_recving or meta.failed_recving or meta.finished_sending \
                or meta.transfers or meta.preempted_req_ids:
            meta = self._empty_meta = KvwireConnectorMetadata(scheduler_control=self.control.addr)
        return meta

    def _d_first_tokens(self, now, keys=None):
        """Reports the first token of requests promoted in the step that just ran (vLLM calls
        request_finished and update_connector_output after the step's tokens are appended)."""
        for key in list(self.d_first_pending if keys is None else keys):
            self.d_first_pending.discard(key)
            self._dirty = True
            try:
                self.d.first_token(key, now)
            except kvwire.ConnectorError:
                pass

    def update_connector_output(self, out):
        if not (self._dirty or self._deadline is not None or self.d_first_pending or out.finished_recving):
            return  # idle: nothing reported, nothing queued in the cores, no deadline pending
        now = _now()
        if self.d is not None and self.d_first_pending:
            self._d_first_tokens(now)
        for req in out.finished_recving or ():
            self.d_recv_sent.discard(req)
            key = self.d_key.get(req)
            if key is None:
                continue
            self._dirty = True
            try:
                self.d.reported(key, now)
                self.d_reported.add(req)
            except kvwire.ConnectorError:
                # A failed request reported through the load-error path: it is over.
                self._forget_d(key)
        self._run_actions(now)

    def request_finished(self, request, block_ids):
        req = request.request_id
        now = _now()
        key = self.d_key.get(req)
        if key is not None and self.d is not None:
            self._dirty = True
            if key in self.d_promoted:  # a normal end: the blocks are the request's
                self.d_promoted.discard(key)
                if key in self.d_first_pending:
                    self._d_first_tokens(now, [key])
                try:
                    self.d.abort(key, now)
                except kvwire.ConnectorError:
                    pass
                self._forget_d(key)
                return False, None
            if req in self.out_recv or req in self.d_recv_sent or req in self.d_reported:
                # Every layer landed: no write is in flight. vLLM frees the blocks itself, on one
                # report of the aborted request (the finished_recving the workers have or had;
                # one not handed to them yet becomes a finished_sending), or now when it took
                # that report already. A release on top would be a second report: vLLM asserts.
                if req in self.out_recv:
                    self.out_recv.discard(req)
                    self.out_sending.add(req)
                self._forget_d(key)  # the core's release and failure actions below: ignored
                try:
                    self.d.abort(key, now)
                except kvwire.ConnectorError:
                    pass
                self._run_actions(now)
                return False, None
            held = bool(self.d.reserved_blocks(key))
            if held:
                # Block ids went to P: the blocks stay until P confirms nothing is in flight
                # (or P is declared down, or the drain deadline); then finished_sending frees.
                self.d_delayed.add(req)
            try:
                self.d.abort(key, now)
            except kvwire.ConnectorError:
                pass
            self._run_actions(now)
            if held:
                return True, None
            self._forget_d(key)
            return False, None
        key = self.p_key.get(req)
        if key is not None and self.p is not None and request.status == RequestStatus.FINISHED_ABORTED:
            self._dirty = True
            scheduled = key in self.p_scheduled
            if scheduled:
                self.p_delayed.add(req)  # transfers may be reading the blocks: wait for release
            try:
                self.p.abort(key, now)
            except kvwire.ConnectorError:
                pass
            self._run_actions(now)
            if scheduled:
                return True, None
            self._forget_p(key)
            return False, None
        if key is not None and self.p is not None:
            self._dirty = True
            if key not in self.p_scheduled and not self._p_schedule(key, block_ids, now):
                self._forget_p(key)
                return False, None
            if key not in self.p_done:
                for layer in range(self.c._layers):
                    try:
                        self.p.layer_ready(key, layer, now)
                    except kvwire.ConnectorError:
                        pass
                try:
                    self.p.prefill_done(key, now)
                except kvwire.ConnectorError:
                    pass
                self.p_done.add(key)
            self.p_delayed.add(req)
            self._run_actions(now)
            return True, {"transfer_id": request.kv_transfer_params.get("transfer_id")}
        return False, None

    def stats(self):
        now = _now()
        if self.stats_at is not None and now - self.stats_at < self.c._stats_interval_ns:
            return None
        self.stats_at = now
        counters, hists, gauges = {}, {}, {}
        for core, flatten in ((self.d, lambda: _stats.flatten_d(self.d.metrics(now))),
                              (self.p, lambda: _stats.flatten_p(self.p.metrics()))):
            if core is not None:
                c, h, g = flatten()
                counters.update(c)
                hists.update(h)
                gauges.update(g)
        st = KvwireConnectorStats(data=self.deltas.delta(counters, hists, gauges))
        return None if st.is_empty() else st

    def set_rank_addrs(self, metadata):
        tp = self.c._tp
        addrs = {}
        for rank, m in (metadata or {}).items():
            if isinstance(m, KvwireHandshake) and m.tp == tp and m.rank == rank:
                addrs[rank] = m.data_addr
        if sorted(addrs) != list(range(tp)):
            logger.error("kvwire: data addresses of tensor parallel ranks %s reported, expected 0..%d: "
                         "P cannot write into this instance's KV caches", sorted(addrs), tp - 1)
            return
        if tp == 1 and self.control.data_addr:
            return  # the configured data_listen stays what is announced
        self.control.data_addr = ",".join(addrs[r] for r in range(tp))

    def has_pending_work(self) -> bool:
        return bool(self.p_delayed or self.out_sending or self.out_transfers or self.p_transfers_pending)

    def close(self):
        self.control.close()


class _WorkerSide:
    """The worker half: KV caches registered with a data engine; P writes into D."""

    def __init__(self, c: KvwireConnector):
        self.c = c
        ex = c._extra
        # Tensor parallelism: this rank's shard goes to (or comes from) the peer's same rank.
        self.rank, self.tp = compat.tp_rank(c._vllm_config), c._tp
        if not 0 <= self.rank < self.tp:
            raise kvwire.InvalidArgumentError(f"tensor parallel rank {self.rank} out of range for size {self.tp}")
        self.listen = rank_listen(ex.get("data_listen", "127.0.0.1:0"), self.rank)
        self.engine = kvwire.Engine(listen=self.listen, secret=c._secret, transport=c._transport)
        self.layers: list[str] = []
        self.regions: dict[str, Any] = {}
        self.shape: dict[str, tuple] = {}  # name -> (halves, num_blocks, block_bytes)
        self.peers: dict[str, Any] = {}
        self.inflight: list = []  # (batch, key, layer, nbytes, scheduler_control)
        self.done_layers: set[str] = set()
        self.recv: set[str] = set()
        self.sending: set[str] = set()
        self.load_errors: set[int] = set()
        self.control = None
        self.deltas = _stats.DeltaTracker(_stats.worker_source())
        self.stats_at = None
        # GPU KV caches go through host memory (kvwire.vllm.staging); None: direct (CPU caches).
        self.staging_mode, self.staging_bytes = _staging.parse_options(ex)
        self.stager = None

    def stats(self):
        now = _now()
        if self.stats_at is not None and now - self.stats_at < self.c._stats_interval_ns:
            return KvwireConnectorStats() if compat.SCHEDULER_STATS_RIDE_ON_WORKER_STATS else None
        self.stats_at = now
        st = KvwireConnectorStats(data=self.deltas.delta(*_stats.flatten_engine(self.engine.metrics())))
        if st.is_empty() and not compat.SCHEDULER_STATS_RIDE_ON_WORKER_STATS:
            return None
        return st

    def register_kv_caches(self, kv_caches):
        num_blocks = None
        kc = self.c._kv_cache_config
        if kc is not None:
            num_blocks = kc.num_blocks
        if kv_caches and _staging.wanted(self.staging_mode, [t.device.type for t in kv_caches.values()]):
            dev = next(iter(kv_caches.values())).device
            self.stager = _staging.Staging(self.engine, dev, self.staging_bytes, self.c._is_producer, self.c._is_consumer)
        for name, t in kv_caches.items():
            if self.stager is None and str(t.device) != "cpu":
                raise kvwire.UnsupportedError(
                    f"KV cache {name} is on {t.device}: kvwire's transports move host memory only; a CUDA cache "
                    f"needs staging through pinned host memory (kv_connector_extra_config staging: auto or "
                    f"always; it is {self.staging_mode!r})")
            n = num_blocks or (t.shape[1] if t.shape[0] == 2 else t.shape[0])
            if t.shape[0] == 2 and t.dim() > 1 and t.shape[1] == n:
                halves, block_bytes = 2, t[0][0].numel() * t.element_size()
            elif t.shape[0] == n:
                halves, block_bytes = 1, t[0].numel() * t.element_size()
            else:
                raise kvwire.InvalidArgumentError(f"KV cache {name}: unsupported shape {tuple(t.shape)}")
            if self.stager is not None:  # offered in its place: the landing mirror (D), or nothing
                self.regions[name] = self.stager.add_layer(name, t, halves, n, block_bytes)
            else:
                self.regions[name] = kvwire.register_tensor(self.engine, t, "rw")
            self.shape[name] = (halves, n, block_bytes)
            self.layers.append(name)

    def handshake(self):
        # The configured host with the port bound (an ephemeral one included).
        addr = self.engine.listen_addr
        try:
            addr = f"{_host_port(self.listen)[0]}:{_host_port(addr)[1]}"
        except kvwire.InvalidArgumentError:
            pass  # not host:port: announced as the engine gives it
        return KvwireHandshake(self.rank, self.tp, addr)

    def _peer(self, addr):
        addr = rank_address(addr, self.rank, self.tp)  # D's rank r, for our rank r
        p = self.peers.get(addr)
        if p is None or not p.alive:
            p = self.engine.connect(addr)
            self.peers[addr] = p
        return p

    def _report(self, scheduler_control, key, layer, ok, nbytes):
        if self.control is None:
            self.control = _Control("127.0.0.1:0", self.c._secret, self.c._transport)
        try:
            self.control.send(scheduler_control, KIND_XFER, _XFER.pack(key, layer, 1 if ok else 0, nbytes, self.rank))
        except kvwire.KvwireError as e:
            logger.warning("kvwire: cannot report transfer to the scheduler: %s", e)

    def _submit(self, meta, tr):
        key, layer, src, dst, data_addr, _ = tr
        try:
            name = self.layers[layer]
            halves, n, bb = self.shape[name]
            peer = self._peer(data_addr)
            remote = peer.regions()
            if len(remote) != len(self.layers):
                raise kvwire.InvalidArgumentError(f"D offers {len(remote)} KV regions, P has {len(self.layers)} layers")
            r = remote[layer]
            rn = r.len // (halves * bb)
            if self.stager is not None:  # from the device cache through a pinned host chunk
                self.stager.send(peer, name, src, dst, r, rn, (key, layer, meta.scheduler_control))
                return
            ops = []
            for s, d in zip(src, dst):
                for h in range(halves):
                    ops.append((self.regions[name], (h * n + s) * bb, r, (h * rn + d) * bb, bb))
            batch = self.engine.write(peer, ops)
            self.inflight.append((batch, key, layer, len(ops) * bb, meta.scheduler_control))
        except kvwire.KvwireError as e:
            logger.warning("kvwire: transfer of layer %d failed: %s", layer, e)
            self._report(meta.scheduler_control, key, layer, False, 0)

    def start_load_kv(self, meta):
        if self.stager is None or not self.stager.consumer:
            self.recv |= meta.finished_recving
        else:  # reported by get_finished once their blocks were copied mirror -> device
            self.stager.land(meta.finished_recving, meta.recv_block_ids)
        for req, blocks in meta.failed_recving.items():
            self.recv.add(req)
            self.load_errors.update(blocks)
        self.sending |= meta.finished_sending
        for tr in meta.transfers:
            if tr[5] == "now":
                self._submit(meta, tr)

    def save_kv_layer(self, meta, layer_name):
        try:
            layer = self.layers.index(layer_name)
        except ValueError:
            return
        for tr in meta.transfers:
            if tr[5] == "layer" and tr[1] == layer:
                self._submit(meta, tr)

    def _reap(self, block: bool):
        if self.stager is not None:
            for (key, layer, sc), ok, nbytes in self.stager.reap(block):
                self._report(sc, key, layer, ok, nbytes)
        keep = []
        for item in self.inflight:
            batch, key, layer, nbytes, sc = item
            try:
                st = batch.wait() if block else batch.poll()
            except kvwire.KvwireError as e:
                logger.warning("kvwire: transfer of layer %d failed: %s", layer, e)
                self._report(sc, key, layer, False, 0)
                continue
            if st is None:
                keep.append(item)
            else:
                self._report(sc, key, layer, True, nbytes)
        self.inflight = keep

    def wait_for_save(self, meta):
        # Whole-mode transfers of prefills computed in this step run after the forward.
        for tr in meta.transfers:
            if tr[5] == "after":
                self._submit(meta, tr)
        self._reap(block=True)

    def get_finished(self):
        self._reap(block=False)
        if self.stager is not None:  # D: + the requests whose blocks were copied to the device
            self.recv, self.sending, bad = self.stager.settle(self.recv, self.sending)
            self.load_errors |= bad
        recv, self.recv = self.recv, set()
        sending, self.sending = self.sending, set()
        return (sending or None), (recv or None)

    def take_load_errors(self):
        e, self.load_errors = self.load_errors, set()
        return e

    def close(self):
        self.engine.shutdown()
        if self.stager is not None:
            self.stager.close()
        if self.control is not None:
            self.control.close()
