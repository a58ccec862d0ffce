"""The worker half of ``KvwireConnector``: the KV caches in a kvwire data engine, and P's
writes of every (chunk, layer) piece as soon as the forward computed it.

P (producer), per request, on each TP rank:

* each step's metadata lists the prefill chunks computed in it (``p_chunks``: token range,
  the request's block ids so far, send mode, whether it is the last chunk);
* after layer ``l`` of the step (``save_kv_layer``), the chunk's *completed* blocks of layer
  ``l`` are ready: every block below the chunk's end, except a block the chunk boundary splits,
  which goes with the next chunk (and, at the last chunk, all the rest). The last chunk's layer
  also reports ``LAYER_READY`` to the scheduler, and the end of its forward ``PREFILL_DONE``;
* D's block ids reach this worker straight from the scheduler's driver thread (a ``WORK``
  message on this engine), not through a scheduler step; whatever is ready and has a
  destination is written at once, in layerwise mode, or after the last chunk's forward in whole
  mode. Writes are posted without waiting; a background thread reaps them and reports
  ``LAYER_SENT`` once a layer's last piece is written. ``wait_for_save`` never waits for the
  wire: a finished request's blocks stay held (``request_finished`` returned True) until the
  scheduler releases them.

D (consumer): the caches are registered and offered to P (``rw``); for policy ``land`` a
landing pool (``land_pool_blocks`` slots per layer, host memory) is offered after them. A staged
D with ``d_landing: pool`` offers the pool only (pinned when the cache is on CUDA; see
:mod:`kvwire.vllm.staging`): every request lands there; with ``d_landing: mirror`` it offers a
host mirror of each cache in its place. The scheduler says which slots (or the mirror's same
blocks) to copy into which blocks, and which layers (``land_copies``);
:mod:`kvwire.vllm.landing` copies them and a request is reported only once its copies completed.
A ``fence`` names P data engines whose connections to this one are closed before blocks they
may have written are reused.

GPU KV caches go through host staging (:mod:`kvwire.vllm.staging`), or, with ``staging:
device``, are registered as device regions where they are: P's writes then go device to device
(``cuda_ipc`` on one host, RDMA with GPUDirect across hosts), each posted only once an event
recorded after the layer's compute has completed (checked, never waited for, as later layers are
computed and from the worker's thread); D's landing pool, when it has one, is GPU memory too.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import kvwire
from kvwire.vllm import compat
from kvwire.vllm import envelope as env
from kvwire.vllm import staging as _staging
from kvwire.vllm.landing import LandingCopies
from kvwire.vllm import stats as _stats
from kvwire.vllm.control import ControlPlane, advertised
from kvwire.vllm.stats import KvwireConnectorStats

logger = logging.getLogger("kvwire.vllm")


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


def gpu_pci_address() -> str | None:
    """The PCI address (``0000:1b:00.0``) of this process's current CUDA device, or ``None``
    (no CUDA, or torch does not say)."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        p = torch.cuda.get_device_properties(torch.cuda.current_device())
        return f"{p.pci_domain_id:04x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0"
    except Exception:  # no torch, no driver, an older torch without the fields
        return None


def rdma_near(option: str) -> str | None:
    """What the data engine is told to be near (``rdma_near`` of the extra config)."""
    if option == "auto":
        return gpu_pci_address()
    return option or None


@dataclass
class KvwireHandshake(compat.KVConnectorHandshakeMetadata):
    """Worker -> scheduler at start-up (vLLM's handshake hooks): where this TP rank's data
    engine is reachable, and the layout of its KV caches."""

    rank: int
    tp: int
    data_addr: str
    layout: str | None = None
    block_bytes: int | None = None
    control_addr: str | None = None  # where the scheduler sends this rank its work


@dataclass
class _Send:
    """One P request on this rank."""

    key: int
    prompt: int
    mode: str
    sched: str  # the scheduler's control address (reports go there)
    blocks: list = field(default_factory=list)  # P's block ids so far
    ready: list = field(default_factory=list)  # per layer: blocks whose K/V is final
    complete: set = field(default_factory=set)  # layers the last chunk passed
    prefill_done: bool = False
    dst: dict | None = None  # {"first", "dst", "landing", "d_data"}
    sent: list = field(default_factory=list)  # per layer: blocks posted
    inflight: list = field(default_factory=list)  # per layer: writes in flight
    nbytes: list = field(default_factory=list)  # per layer: bytes written
    reported: set = field(default_factory=set)  # layers reported LAYER_SENT
    failed: bool = False
    events: dict = field(default_factory=dict)  # staging or device: layer -> compute event
    first_write: bool = False


@dataclass
class _After:
    """A write from device memory that waits for the layer's compute (``staging: device``):
    posted by :meth:`WorkerSide._reap` once ``event`` completed."""

    event: Any
    peer: Any
    ops: list


class WorkerSide:
    def __init__(self, c):
        self.c = c
        o = c.opts
        self.rank, self.tp = compat.tp_rank(c._vllm_config), c._tp
        if not 0 <= self.rank < self.tp:
            raise kvwire.InvalidArgumentError(f"tensor parallel rank {self.rank} out of range for size {self.tp}")
        self.listen = rank_listen(o.data_listen, self.rank)
        self.engine = kvwire.Engine(listen=self.listen, secret=o.secret, transport=o.transport,
                                    rdma_near=rdma_near(o.rdma_near))
        # Its own small engine for the messages with its scheduler (destinations in, reports
        # out), so the data engine carries KV only. Control engines run TCP: they open no RDMA
        # device.
        ctl_host = self.listen.rpartition(":")[0] or "127.0.0.1"
        self.control = ControlPlane(engine_id=f"{c._engine_id}/worker{self.rank}", incarnation=0,
                                    listen=f"{ctl_host}:0", secret=o.secret,
                                    transport="tcp",
                                    advertise_host=o.advertise_host, name=f"worker{self.rank}")
        self.layers: list[str] = []
        self.regions: dict[str, Any] = {}
        self.shape: dict[str, tuple] = {}  # name -> (halves, num_blocks, block_bytes)
        self.caches: dict[str, Any] = {}
        self.landing: dict[str, Any] = {}  # name -> landing-pool tensor (D: land, or a staged D)
        self.land: LandingCopies | None = None  # its copies into the caches
        self.peers: dict[str, Any] = {}
        self.lock = threading.RLock()
        self.sends: dict[int, _Send] = {}
        self.deferred: dict[int, _Send] = {}  # staging: device: the sends with writes waiting (_After)
        self.step_meta = None  # the metadata whose prefill chunks step_chunks holds
        self.step_chunks: list = []
        self.step_layers: set = set()
        self.sched = ""
        self.recv: set[str] = set()
        self.sending: set[str] = set()
        self.load_errors: set[int] = set()
        self.deltas = _stats.DeltaTracker(_stats.worker_source())
        self.stats_at = None
        self.staging_mode, self.staging_bytes = _staging.parse_options(c._extra)
        self.stager = None
        # staging: device, caches on CUDA: records the compute events that P's writes, and the
        # reuse of D's landing slots, wait for
        self.marks = None
        self.layout = None
        self.block_bytes = None
        self._stop = False
        self._bg = threading.Thread(target=self._background, name=f"kvwire-worker{self.rank}", daemon=True)
        self._bg.start()

    # ---- registration ----
    def register_kv_caches(self, kv_caches):
        import torch

        num_blocks = None
        kc = self.c._kv_cache_config
        if kc is not None:
            num_blocks = kc.num_blocks
        if kv_caches and _staging.wanted(self.staging_mode, [t.device.type for t in kv_caches.values()]):
            dev = next(iter(kv_caches.values())).device
            # D with a bounded landing pool registers no mirror: the pool below takes the writes
            self.stager = _staging.Staging(self.engine, dev, self.staging_bytes, self.c._is_producer,
                                           self.c._is_consumer and self.c._d_pool is None)
        direct = self.staging_mode == "device"
        if kv_caches and direct:
            devs = {t.device for t in kv_caches.values()}
            bad = [d for d in devs if d.type not in ("cpu", "cuda")]
            if bad:
                raise kvwire.UnsupportedError(f"KV cache on {bad[0]}: staging device takes cuda and cpu caches")
            if len(devs) > 1:
                raise kvwire.InvalidArgumentError(f"KV caches on {sorted(map(str, devs))}: staging device takes the "
                                                  f"caches of one device")
            dev = devs.pop()
            if dev.type == "cuda":
                self.marks = _staging.DeviceCopies(dev)
        for name, t in kv_caches.items():
            if self.stager is None and str(t.device) != "cpu" and not direct:
                raise kvwire.UnsupportedError(
                    f"KV cache {name} is on {t.device}: kvwire's transports move host memory only; a CUDA cache "
                    f"needs staging through pinned host memory (kv_connector_extra_config staging: auto or "
                    f"always; it is {self.staging_mode!r})")
            n = num_blocks or (t.shape[1] if t.shape[0] == 2 else t.shape[0])
            if t.shape[0] == 2 and t.dim() > 1 and t.shape[1] == n:
                halves, block_bytes = 2, t[0][0].numel() * t.element_size()
                layout = "2B" + "x".join(str(d) for d in t.shape[2:])
            elif t.shape[0] == n:
                halves, block_bytes = 1, t[0].numel() * t.element_size()
                layout = "B" + "x".join(str(d) for d in t.shape[1:])
            else:
                raise kvwire.InvalidArgumentError(f"KV cache {name}: unsupported shape {tuple(t.shape)}")
            if self.stager is not None:  # offered in its place: the landing mirror (D), or nothing
                self.regions[name] = self.stager.add_layer(name, t, halves, n, block_bytes)
            else:
                self.regions[name] = kvwire.register_tensor(self.engine, t, "rw", ipc=direct)
            self.shape[name] = (halves, n, block_bytes)
            self.caches[name] = t
            self.layers.append(name)
            self.layout = f"{layout}:{t.dtype}".replace("torch.", "")
            self.block_bytes = halves * block_bytes
        pool = self.c.opts.land_pool_blocks if self.c._d_pool is None else self.c._d_pool
        if self.c._is_consumer and pool > 0:
            pinned = self.stager is not None and self.stager.dev.cuda
            for name in self.layers:
                t = self.caches[name]
                halves, n, bb = self.shape[name]
                shape = (2, pool) + tuple(t.shape[2:]) if halves == 2 else (pool,) + tuple(t.shape[1:])
                if pinned:
                    lt = self.stager.dev.host(shape, t.dtype)
                else:  # host memory, or where the cache is (staging: device)
                    lt = torch.zeros(shape, dtype=t.dtype, device=t.device if direct else "cpu")
                self.landing[name] = lt
                kvwire.register_tensor(self.engine, lt, "rw", pinned=pinned, ipc=direct)
            if self.marks is not None:
                gb = sum(t.numel() * t.element_size() for t in self.landing.values()) / 1e9
                logger.warning("kvwire: D's landing pool takes %.2f GB of %s beside the KV cache (%d slots per layer, "
                               "land_pool_blocks); vLLM's gpu_memory_utilization does not count it", gb,
                               self.marks.device, pool)
        mirrors = self.stager.mirrors if self.stager is not None else {}
        if self.landing or mirrors:  # D: what lands in the pool or the mirror is copied into the caches
            dev = self.stager.dev if self.stager is not None else self.marks
            if dev is None:
                dev = _staging.DeviceCopies(torch.device("cpu"))
            self.land = LandingCopies(dev, self.layers, self.caches, self.landing,
                                      {name: self.shape[name][0] for name in self.layers}, mirrors)

    def handshake(self):
        addr = self.engine.listen_addr
        try:
            addr = advertised(self.listen, addr, self.c.opts.advertise_host)
        except (kvwire.InvalidArgumentError, ValueError):
            pass
        return KvwireHandshake(self.rank, self.tp, addr, self.layout, self.block_bytes, self.control.addr)

    # ---- per step ----
    def start_load_kv(self, meta):
        if meta.fences:
            self._fence(meta.fences)
        for addr in getattr(meta, "unfences", None) or []:
            try:
                self.engine.unfence(addr)
            except (kvwire.KvwireError, AttributeError) as e:
                logger.warning("kvwire: lifting the fence of %s failed: %s", addr, e)
        if meta.land_copies and self.land is None:
            logger.warning("kvwire: landing copies asked, but this worker has no landing pool or mirror")
            for _, blocks, _ in meta.land_copies.values():
                self.load_errors.update(blocks)
        elif meta.land_copies:
            with self.lock:
                self.land.copy_all([(req, *c) for req, c in meta.land_copies.items()])
        self.recv |= meta.finished_recving  # reported once their copies (if any) completed
        for req, blocks in meta.failed_recving.items():
            self.recv.add(req)
            self.load_errors.update(blocks)
        self.sending |= meta.finished_sending
        self._begin_step(meta)

    def _begin_step(self, meta) -> None:
        """Takes the prefill chunks this step computes, once per step, at whichever hook comes
        first: vLLM 0.18 calls ``start_load_kv`` before the forward, vLLM 0.33 after it (its
        loads are asynchronous), so there the first layer's ``save_kv_layer`` comes first."""
        if meta is self.step_meta:
            return
        self.step_meta = meta
        self.sched = meta.scheduler_control or self.sched
        with self.lock:
            self.step_chunks = list(meta.p_chunks)
            self.step_layers = set()
            for (req, key, lo, hi, prompt, blocks, mode, last) in self.step_chunks:
                s = self.sends.get(key)
                if s is None:
                    s = self.sends[key] = self._new_send(key, self.sched)
                s.prompt, s.mode, s.sched = prompt, mode, s.sched or self.sched
                s.blocks = list(blocks)

    def save_kv_layer(self, meta, layer_name):
        try:
            layer = self.layers.index(layer_name)
        except ValueError:
            return
        self._begin_step(meta)
        if not self.step_chunks:
            return
        with self.lock:
            self._layer_done(layer, time.monotonic_ns())

    def _layer_done(self, layer: int, now: int) -> None:
        """Layer ``layer`` of this step's forward is computed (worker lock held)."""
        self.step_layers.add(layer)
        self._post_ready()
        bs = self.c._block_size
        for (req, key, lo, hi, prompt, blocks, mode, last) in self.step_chunks:
            s = self.sends.get(key)
            if s is None:
                continue
            s.ready[layer] = -(-prompt // bs) if last else hi // bs
            marks = self.stager.dev if self.stager is not None else self.marks
            if marks is not None:
                s.events[layer] = marks.mark()
            if last:
                s.complete.add(layer)
                self._report(s, env.LAYER_READY, layer, True, 0, now)
            self._pump(s, layer)

    def wait_for_save(self, meta):
        self._begin_step(meta)
        now = time.monotonic_ns()
        with self.lock:
            # Layers whose hook did not run (a replayed full CUDA graph skips them) are computed
            # now that the forward is over.
            for layer in range(len(self.layers)):
                if layer not in self.step_layers:
                    self._layer_done(layer, now)
            for (req, key, lo, hi, prompt, blocks, mode, last) in self.step_chunks:
                s = self.sends.get(key)
                if s is None or not last:
                    continue
                s.prefill_done = True
                self._report(s, env.PREFILL_DONE, 0, True, 0, now)
                for layer in range(len(self.layers)):
                    self._pump(s, layer)
            self.step_chunks = []
            self.step_layers = set()

    def get_finished(self):
        with self.lock:
            self._reap()
        if self.land is not None:  # D: a request whose landing copies still run waits for them
            with self.lock:
                busy = {r for r in self.recv | self.sending if self.land.busy(r)}
                for r in self.recv - busy:
                    self.load_errors |= self.land.take_failed(r)
                for r in self.sending - busy:
                    self.land.take_failed(r)  # released: nothing of it is read any more
        else:
            busy = set()
        recv, self.recv = self.recv - busy, self.recv & busy
        sending, self.sending = self.sending - busy, self.sending & busy
        return (sending or None), (recv or None)

    def take_load_errors(self):
        e, self.load_errors = self.load_errors, set()
        return e

    # ---- P: writes ----
    def _pump(self, s: _Send, layer: int) -> None:
        """Posts what of ``layer`` is ready and has a destination (worker lock held)."""
        if s.dst is None or s.failed:
            return
        if s.mode == "whole" and not s.prefill_done:
            return
        first = s.dst["first"]
        lo = max(s.sent[layer], first)
        hi = s.ready[layer]
        if hi <= lo:
            return
        src = s.blocks[lo:hi]
        dst = s.dst["dst"][lo - first:hi - first]
        if len(src) != hi - lo or len(dst) != hi - lo:
            logger.warning("kvwire: request %x layer %d: blocks %d..%d not known (%d src, %d dst)", s.key, layer,
                           lo, hi, len(src), len(dst))
            self._fail(s)
            return
        try:
            peer = self._peer(s.dst["d_data"])
            name = self.layers[layer]
            halves, n, bb = self.shape[name]
            remote = peer.regions()
            L = len(self.layers)
            if len(remote) < L:
                raise kvwire.InvalidArgumentError(f"D offers {len(remote)} KV regions, P needs {L}")
            # D offers its caches (or mirrors), then its landing pool; a staged D with a bounded
            # pool offers the pool only: the landing regions are the last L
            idx = layer + (len(remote) - L if s.dst["landing"] else 0)
            r = remote[idx]
            rn = r.len // (halves * bb)
            posted = True
            if self.stager is not None:
                done = []
                self.stager.send(peer, name, src, dst, r, rn, (s.key, layer, hi), after=s.events.get(layer))
                s.inflight[layer].append(("staged", hi, done))
            else:
                ops = []
                for sb, db in zip(src, dst):
                    for h in range(halves):
                        ops.append((self.regions[name], (h * n + sb) * bb, r, (h * rn + db) * bb, bb))
                ev = s.events.get(layer) if self.marks is not None else None
                if ev is not None and not self.marks.done(ev):  # the layer is still being computed
                    s.inflight[layer].append((_After(ev, peer, ops), hi, len(ops) * bb))
                    self.deferred[s.key] = s
                    posted = False
                else:
                    s.inflight[layer].append((self.engine.write(peer, ops), hi, len(ops) * bb))
            s.sent[layer] = hi
            if posted:
                self._first_write(s, layer)
        except kvwire.KvwireError as e:
            logger.warning("kvwire: transfer of layer %d of request %x failed: %s", layer, s.key, e)
            self._fail(s)

    def _first_write(self, s: _Send, layer: int) -> None:
        if not s.first_write:
            s.first_write = True
            self._report(s, env.FIRST_BYTE, layer, True, 0, time.monotonic_ns())

    def _new_send(self, key: int, sched: str) -> _Send:
        L = len(self.layers)
        return _Send(key=key, prompt=0, mode="layerwise", sched=sched, ready=[0] * L, sent=[0] * L,
                     inflight=[[] for _ in range(L)], nbytes=[0] * L)

    def _fail(self, s: _Send) -> None:
        s.failed = True
        now = time.monotonic_ns()
        for layer in range(len(self.layers)):
            if layer not in s.reported:
                s.reported.add(layer)
                self._report(s, env.LAYER_SENT, layer, False, 0, now)

    def _post_ready(self) -> None:
        """Posts the deferred writes (``staging: device``) whose layer's compute completed; drops
        those of failed requests, which never go out (lock held). Called from the forward's hooks
        (a layer's write goes out as a later layer is computed) and from the worker's thread."""
        for key, s in list(self.deferred.items()):
            for layer, fl in enumerate(s.inflight):
                for i, (b, hi, nb) in enumerate(fl):
                    if not isinstance(b, _After) or (not s.failed and not self.marks.done(b.event)):
                        continue
                    if s.failed:  # failed or cancelled before it went out
                        fl[i] = None
                        continue
                    try:
                        fl[i] = (self.engine.write(b.peer, b.ops), hi, nb)
                    except kvwire.KvwireError as e:
                        logger.warning("kvwire: write of layer %d of request %x failed: %s", layer, key, e)
                        fl[i] = None
                        self._fail(s)
                        continue
                    self._first_write(s, layer)
                fl[:] = [x for x in fl if x is not None]
            if not any(isinstance(x[0], _After) for fl in s.inflight for x in fl):
                del self.deferred[key]

    def _reap(self) -> None:
        """Settles finished writes; reports layers whose last piece is written (lock held)."""
        self._post_ready()
        staged = {}
        if self.stager is not None:
            for (key, layer, hi), ok, nbytes in self.stager.reap(False):
                staged[(key, layer, hi)] = (ok, nbytes)
        n_blocks = lambda s: -(-s.prompt // self.c._block_size)  # noqa: E731
        for key, s in list(self.sends.items()):
            for layer, fl in enumerate(s.inflight):
                keep = []
                for item in fl:
                    b, hi, nb = item
                    if b == "staged":
                        res = staged.pop((key, layer, hi), None)
                        if res is None:
                            keep.append(item)
                            continue
                        ok, nbytes = res
                    else:
                        if isinstance(b, _After):  # its layer is still being computed
                            keep.append(item)
                            continue
                        try:
                            st = b.poll()
                        except kvwire.KvwireError as e:
                            logger.warning("kvwire: write of layer %d of request %x failed: %s", layer, key, e)
                            ok, nbytes = False, 0
                        else:
                            if st is None:
                                keep.append(item)
                                continue
                            ok, nbytes = True, nb
                    if not ok:
                        self._fail(s)
                        keep = []
                        break
                    s.nbytes[layer] += nbytes
                s.inflight[layer] = keep
                if (not keep and not s.failed and layer not in s.reported and layer in s.complete
                        and s.dst is not None and s.sent[layer] >= n_blocks(s)):
                    s.reported.add(layer)
                    self._report(s, env.LAYER_SENT, layer, True, s.nbytes[layer], time.monotonic_ns())
            if len(s.reported) == len(self.layers) and not any(s.inflight):
                del self.sends[key]

    def _report(self, s: _Send, what: int, layer: int, ok: bool, nbytes: int, t: int) -> None:
        target = s.sched or self.sched
        if target:
            self.control.send(target, env.REPORT, env.report(what, s.key, layer, ok, nbytes, self.rank, t))

    def _peer(self, d_data: list):
        addr = d_data[self.rank]
        p = self.peers.get(addr)
        if p is None or not p.alive:
            p = self.engine.connect(addr)
            self.peers[addr] = p
        return p

    # ---- background: destinations from the scheduler, reaping ----
    def _background(self) -> None:
        bound = False
        while not self._stop:
            if not bound and self.marks is not None:
                # Event queries from this thread: on the caches' GPU, not a new context on GPU 0
                self.marks.bind_thread()
                bound = True
            msgs, _ = self.control.recv(0.005)
            with self.lock:
                for e in msgs:
                    if e.kind != env.WORK:
                        continue
                    try:
                        w = env.from_json(e.payload)
                    except ValueError:
                        self.control.bad_messages += 1
                        continue
                    self.sched = self.sched or e.control
                    self._on_work(w, e.control)
                if self.sends:
                    self._reap()

    def _on_work(self, w: dict, sched: str) -> None:
        op = w.get("op")
        key = w.get("key")
        if op == "dst":
            s = self.sends.get(key)
            if s is None:  # the destination came before this rank's first chunk
                s = self.sends[key] = self._new_send(key, sched)
            s.sched = s.sched or sched
            d_data = w.get("d_data") or []
            if len(d_data) != self.tp:
                logger.warning("kvwire: request %x: D has %d ranks, this P %d", key, len(d_data), self.tp)
                self._fail(s)
                return
            s.dst = {"first": int(w.get("first", 0)), "dst": list(w.get("dst") or []),
                     "landing": bool(w.get("landing")), "d_data": d_data}
            for layer in range(len(self.layers)):
                self._pump(s, layer)
        elif op == "cancel":
            s = self.sends.get(key)
            if s is not None and not s.failed:
                self._fail(s)
        elif op == "drop":
            for addr in w.get("addrs") or []:
                self.peers.pop(addr, None)

    # ---- D: fences ----
    def _fence(self, addrs: list) -> None:
        """Closes this engine's connections from the P data engines at ``addrs`` and refuses
        their writes from now on."""
        fence = getattr(self.engine, "fence", None)
        for addr in addrs:
            if fence is not None:
                try:
                    fence(addr)
                except kvwire.KvwireError as e:
                    logger.warning("kvwire: fencing %s failed: %s", addr, e)
            else:
                logger.warning("kvwire: this kvwire build cannot fence peer %s", addr)

    # ---- stats, close ----
    def stats(self):
        now = time.monotonic_ns()
        if self.stats_at is not None and now - self.stats_at < self.c.opts.stats_interval_ns:
            return KvwireConnectorStats() if compat.SCHEDULER_STATS_RIDE_ON_WORKER_STATS else None
        self.stats_at = now
        st = KvwireConnectorStats(data=self.deltas.delta(*_stats.flatten_engine(self.engine.metrics())))
        if st.is_empty() and not compat.SCHEDULER_STATS_RIDE_ON_WORKER_STATS:
            return None
        return st

    def close(self):
        self._stop = True
        self._bg.join(timeout=2.0)
        self.control.close()  # its own engine
        self.engine.shutdown()
        if self.stager is not None:
            self.stager.close()
