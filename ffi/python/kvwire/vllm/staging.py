"""GPU KV caches for ``KvwireConnector``'s worker side: staging through host memory.

kvwire's tcp and shm transports read and write host memory only. A worker whose KV cache is on
CUDA therefore moves every byte through host memory registered with its data engine:

* **P (source): a bounded staging pool.** ``staging_mb`` MiB (default 256) of pinned host memory,
  registered ``local`` (not offered to peers). When a layer transfer (a request's blocks of one
  layer, K and V halves) is submitted, an event is recorded on the *current* stream, so the copy
  is ordered after the layer's compute and the host never waits for the forward. Later a side
  stream waits on that event and gathers the blocks into a chunk of the pool with
  ``non_blocking`` copies, then records a done event. Once that event has completed (polled from
  the worker hooks; ``wait_for_save`` may block), the chunk is written to D at the same offsets
  as the direct path. It is released when the write completes. A transfer that does not fit in
  the free pool waits in FIFO order, so nothing is reordered across the layers of a request. A
  transfer bigger than the whole pool is split by blocks.
* **D (target), ``d_landing: pool`` (the default): a bounded landing pool.** D registers no
  host copy of its cache: P writes every request into slots of a landing pool of ``staging_mb``
  in pinned host memory (``land_pool_blocks`` slots, by default as many blocks over every layer
  as ``staging_mb`` holds), and the workers copy the slots into the request's KV blocks, layer by
  layer as the layers land (``eager``, ``lazy``, ``jit``: D holds the blocks as the policy says)
  or all at once when the blocks are reserved (``land``): see :mod:`kvwire.vllm.landing`. A
  request waits for free slots (P holds its KV meanwhile); one larger than the whole pool fails
  (the load-error path).
* **D (target), ``d_landing: mirror``: a landing mirror.** Pinned host memory with exactly the KV
  cache's layout is registered *instead of* the device tensor. P addresses D as it does without staging and knows
  nothing of it. Each layer of a request is copied from the mirror's blocks into the same
  blocks of the cache as soon as it has landed (the scheduler lists the layers landed since the
  last step, as for the pool: see :mod:`kvwire.vllm.landing`); the request is reported only
  once every copy into its blocks has completed, and a request aborted meanwhile keeps its
  blocks until then. Policy ``land`` lands in its pool (``land_pool_blocks``), not the mirror.
  **The mirror costs host memory equal to the KV cache** (pinned when the cache is on CUDA).

``staging: device`` takes none of this: the caches are registered as device regions where they
are (``cuda_ipc`` reaches them on one host, RDMA with GPUDirect across hosts; tcp and shm refuse
them), P's writes wait for an event recorded after the layer's compute (see
:mod:`kvwire.vllm.worker`), and D's landing pool, when it has one, is GPU memory.

Without CUDA (``staging: always`` over CPU caches, how the CPU tests exercise this path) the same
code runs with synchronous copies and no events. The CUDA-specific lines are all in
:class:`DeviceCopies`.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

import kvwire

logger = logging.getLogger("kvwire.vllm")

#: The CUDA API :class:`DeviceCopies` uses (a module attribute, so that the CPU tests can check
#: the CUDA branch's calls against a stand-in).
cuda = torch.cuda

#: Chunks of the staging pool start at multiples of this many bytes (any element size divides it).
ALIGN = 256

#: ``staging`` values: ``auto`` stages CUDA caches, ``always`` every cache, ``never`` none (a CUDA
#: cache is refused); ``device`` stages none and registers CUDA caches as device regions, which
#: the ``cuda_ipc`` transport (same host) and RDMA with GPUDirect (across hosts) reach.
MODES = ("auto", "always", "never", "device")


def parse_options(extra: dict) -> tuple[str, int]:
    """``(mode, pool bytes)`` from ``kv_connector_extra_config`` (``staging``, ``staging_mb``);
    raises ``kvwire.InvalidArgumentError`` on a bad value. ``auto`` with transport ``cuda_ipc``
    is ``device``: that transport reaches the caches where they are."""
    mode = extra.get("staging", "auto")
    if mode not in MODES:
        raise kvwire.InvalidArgumentError(f"staging must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "auto" and extra.get("transport") == "cuda_ipc":
        mode = "device"
    raw = extra.get("staging_mb", 256)
    try:
        mb = float(raw)
    except (TypeError, ValueError):
        mb = -1.0
    if not (mb > 0 and mb < 1e9):
        raise kvwire.InvalidArgumentError(f"staging_mb must be a number of MiB > 0, got {raw!r}")
    return mode, int(mb * (1 << 20))


def wanted(mode: str, devices) -> bool:
    """Whether a worker whose KV caches are on ``devices`` (torch device types) stages
    (``device`` never does: the caches are registered where they are)."""
    return mode == "always" or (mode == "auto" and "cuda" in set(devices))


#: Where a staged D lands P's writes: ``pool`` (default), a landing pool of ``staging_mb`` in
#: host memory; ``mirror``, host memory with the layout of the whole KV cache. Either way each
#: layer is copied into the cache as it lands (see :mod:`kvwire.vllm.landing`).
D_LANDINGS = ("pool", "mirror")


def d_landing(extra: dict) -> str:
    """``d_landing`` from ``kv_connector_extra_config``; ``kvwire.InvalidArgumentError`` if bad."""
    v = extra.get("d_landing", "pool")
    if v not in D_LANDINGS:
        raise kvwire.InvalidArgumentError(f"d_landing must be one of {', '.join(D_LANDINGS)}, got {v!r}")
    return v


def block_bytes(kv_cache_config) -> int | None:
    """Bytes of one block over every layer (K and V) of one worker, from vLLM's
    ``KVCacheConfig``; ``None`` when it does not say."""
    try:
        n = sum(len(g.layer_names) * g.kv_cache_spec.page_size_bytes for g in kv_cache_config.kv_cache_groups)
    except (AttributeError, TypeError):
        return None
    return n or None


def pool_slots(extra: dict, pool_bytes: int, per_block: int | None) -> int:
    """Slots of a staged D's landing pool (one block over every layer each): ``land_pool_blocks``
    when it is set, else as many as ``staging_mb`` (``pool_bytes``) holds. The scheduler and the
    workers compute it alike, from the same ``KVCacheConfig``."""
    if "land_pool_blocks" in extra:
        return int(extra["land_pool_blocks"])
    if per_block is None:
        raise kvwire.InvalidArgumentError(
            "d_landing pool: the KV cache's bytes per block are unknown here; set land_pool_blocks")
    slots = pool_bytes // per_block
    if slots < 1:
        raise kvwire.InvalidArgumentError(
            f"d_landing pool: staging_mb ({pool_bytes} bytes) holds no block of this KV cache "
            f"({per_block} bytes over every layer); raise staging_mb")
    return slots


class PoolAllocator:
    """First-fit allocator of byte ranges of a pool of ``capacity`` bytes. Every range starts at
    a multiple of :data:`ALIGN`; freed ranges merge with their free neighbours."""

    def __init__(self, capacity: int):
        self.capacity = capacity - capacity % ALIGN
        self.free: list[list[int]] = [[0, self.capacity]] if self.capacity > 0 else []  # sorted [off, len]
        self.used = 0

    @staticmethod
    def rounded(n: int) -> int:
        return -(-n // ALIGN) * ALIGN

    def alloc(self, n: int) -> int | None:
        """The offset of ``n`` free bytes, or ``None`` when no free range is big enough."""
        n = self.rounded(max(n, 1))
        for i, (off, ln) in enumerate(self.free):
            if ln >= n:
                if ln == n:
                    del self.free[i]
                else:
                    self.free[i] = [off + n, ln - n]
                self.used += n
                return off
        return None

    def release(self, off: int, n: int) -> None:
        """Gives back the range ``alloc(n)`` returned as ``off``."""
        n = self.rounded(max(n, 1))
        i = 0
        while i < len(self.free) and self.free[i][0] < off:
            i += 1
        self.free.insert(i, [off, n])
        self.used -= n
        if i + 1 < len(self.free) and off + n == self.free[i + 1][0]:  # merge with the next
            self.free[i][1] += self.free.pop(i + 1)[1]
        if i > 0 and self.free[i - 1][0] + self.free[i - 1][1] == off:  # and with the previous
            self.free[i - 1][1] += self.free.pop(i)[1]


class DeviceCopies:
    """Copies between a KV cache's device and host memory. On CUDA they run asynchronously on a
    side stream and completion is an event; on the CPU they run at once and completion is
    ``None`` (done). The only place that calls the CUDA API (:data:`cuda`)."""

    def __init__(self, device: torch.device):
        if device.type not in ("cpu", "cuda"):
            raise kvwire.UnsupportedError(f"KV cache on {device}: staging supports cuda and cpu caches")
        self.device = device
        self.cuda = device.type == "cuda"
        self._stream = None
        self.pinned: list[int] = []

    @property
    def stream(self):
        """The side stream, made at the first copy (a worker that only marks events, such as P
        with ``staging: device``, never makes one); ``None`` on the CPU."""
        if self.cuda and self._stream is None:
            self._stream = cuda.Stream(device=self.device)
        return self._stream

    def host(self, shape, dtype) -> torch.Tensor:
        """Zeroed host memory, pinned when the cache is on CUDA (async copies need it). Pinned
        with ``cudaHostRegister``, not ``pin_memory=True``: torch's pinned allocator rounds sizes
        up to a power of two, which would cost up to twice the mirror's host memory."""
        t = torch.zeros(shape, dtype=dtype)
        if self.cuda:
            nbytes = t.numel() * t.element_size()
            err = int(cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, 0))
            if err != 0:
                raise kvwire.UnsupportedError(f"cannot pin {nbytes} bytes of host memory for staging (CUDA error {err})")
            self.pinned.append(t.data_ptr())
        return t

    def close(self):
        """Unpins what :meth:`host` pinned (the tensors must not be used for copies after)."""
        if self.cuda:
            self.settle()
            for ptr in self.pinned:
                cuda.cudart().cudaHostUnregister(ptr)
        self.pinned = []

    def bind_thread(self):
        """Makes the caches' device the current one of the calling thread (a thread that only
        queries events would otherwise create a context on device 0)."""
        if self.cuda:
            cuda.set_device(self.device)

    def mark(self):
        """An event after everything enqueued so far on the current (compute) stream."""
        if not self.cuda:
            return None
        ev = cuda.Event()
        ev.record(cuda.current_stream(self.device))
        return ev

    def copy(self, after, pairs):
        """Copies every ``(dst, src)`` pair once ``after`` (a :meth:`mark`) has completed;
        returns the completion to pass to :meth:`done`."""
        if not self.cuda:
            for dst, src in pairs:
                dst.copy_(src)
            return None
        with cuda.stream(self.stream):
            if after is not None:
                self.stream.wait_event(after)
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
            ev = cuda.Event()
            ev.record(self.stream)
        return ev

    def settle(self):
        """After a failed :meth:`copy`: waits for whatever part of it was enqueued, so that the
        memory it touches can be reused."""
        if self._stream is not None:
            try:
                self._stream.synchronize()
            except RuntimeError as e:
                logger.warning("kvwire: staging stream: %s", e)

    @staticmethod
    def done(ev, block: bool = False) -> bool:
        """Whether the copies behind ``ev`` completed; ``block`` waits for them."""
        if ev is None:
            return True
        if block:
            ev.synchronize()
            return True
        return ev.query()


def runs(ids):
    """``(position, first id, count)`` for each run of consecutive ids in ``ids``."""
    out = []
    for j, b in enumerate(ids):
        if out and out[-1][1] + out[-1][2] == b:
            out[-1][2] += 1
        else:
            out.append([j, b, 1])
    return [tuple(r) for r in out]


@dataclass
class _Layer:
    cache: torch.Tensor
    halves: int
    num_blocks: int
    block_bytes: int
    mirror: torch.Tensor | None = None

    def blocks(self, t, h):
        """``[num_blocks, ...]`` view of half ``h`` (K or V) of ``t`` (the cache or its mirror)."""
        return t[h] if self.halves == 2 else t

    @property
    def block_shape(self):
        return tuple(self.cache.shape[2:] if self.halves == 2 else self.cache.shape[1:])


@dataclass
class _Job:
    """One layer transfer as submitted; reported once every piece is resolved."""

    tag: Any
    pending: int
    ok: bool = True
    nbytes: int = 0


@dataclass
class _Piece:
    """Some blocks of a job: queued, then copying into its chunk, then written."""

    job: _Job
    layer: _Layer
    peer: Any
    remote: Any
    remote_blocks: int
    pairs: list
    after: Any
    size: int
    off: int | None = None
    copied: Any = None
    batch: Any = None
    waited: bool = False


class Staging:
    """A worker's staging: the pool (``producer``) and the landing mirrors (``consumer``) of
    its KV caches, all on one ``device``. See the module docstring."""

    def __init__(self, engine, device: torch.device, pool_bytes: int, producer: bool, consumer: bool):
        self.engine = engine
        self.dev = DeviceCopies(device)
        self.layers: dict[str, _Layer] = {}
        self.consumer = consumer
        self.pool = self.pool_region = self.pool_mem = None
        if producer:
            self.pool = PoolAllocator(pool_bytes)
            if self.pool.capacity == 0:
                raise kvwire.InvalidArgumentError(f"staging pool of {pool_bytes} bytes holds nothing (minimum {ALIGN})")
            self.pool_mem = self.dev.host((self.pool.capacity,), torch.uint8)
            self.pool_region = kvwire.register_tensor(engine, self.pool_mem, "local", pinned=self.dev.cuda)
        self.queue: deque[_Piece] = deque()  # waiting for pool space, FIFO
        self.inflight: list[_Piece] = []  # copying or writing, in admission order
        self.finished: list = []  # (tag, ok, nbytes) not yet taken by reap
        self.stats = dict(pieces=0, waited=0, split=0, failed=0, staged_bytes=0)

    # ---- registration ----
    def add_layer(self, name, cache, halves, num_blocks, block_bytes):
        """Takes a KV cache layer; returns the region to offer to peers in its place (the
        landing mirror, or ``None`` when this worker only sends)."""
        if cache.device != self.dev.device:
            raise kvwire.InvalidArgumentError(f"KV cache {name} is on {cache.device}, the others on {self.dev.device}")
        lay = _Layer(cache, halves, num_blocks, block_bytes)
        if self.pool is not None and halves * block_bytes > self.pool.capacity:
            raise kvwire.InvalidArgumentError(
                f"staging pool ({self.pool.capacity} bytes, staging_mb) is smaller than one block of {name} "
                f"({halves * block_bytes} bytes, K and V)")
        region = None
        if self.consumer:
            lay.mirror = self.dev.host(tuple(cache.shape), cache.dtype)
            region = kvwire.register_tensor(self.engine, lay.mirror, "rw", pinned=self.dev.cuda)
        self.layers[name] = lay
        return region

    @property
    def mirrors(self) -> dict:
        """Layer name -> its landing mirror (empty when this worker only sends); the workers'
        :class:`kvwire.vllm.landing.LandingCopies` copy from them into the caches."""
        return {name: lay.mirror for name, lay in self.layers.items() if lay.mirror is not None}

    # ---- P: staged sends ----
    def send(self, peer, name, src, dst, remote, remote_blocks, tag, after=None):
        """Queues the write of blocks ``src`` of layer ``name`` to blocks ``dst`` of ``remote``
        (``remote_blocks`` blocks per half) on ``peer``; its outcome comes out of :meth:`reap` as
        ``(tag, ok, nbytes)``. The copy is ordered after ``after`` (a ``dev.mark()`` taken when the
        layer was computed), or after what the current stream holds now. Raises
        ``kvwire.InvalidArgumentError`` on a bad block id."""
        if self.pool is None:
            raise kvwire.UnsupportedError("this worker has no staging pool (it is not a producer)")
        lay = self.layers[name]
        pairs = list(zip(src, dst))
        bad = [s for s, _ in pairs if not 0 <= s < lay.num_blocks]
        if bad:
            raise kvwire.InvalidArgumentError(f"source blocks {bad[:4]} outside layer {name}'s {lay.num_blocks} blocks")
        if after is None:
            after = self.dev.mark()  # the layer's compute, as enqueued so far
        per = lay.halves * lay.block_bytes
        step = max(1, self.pool.capacity // per)
        chunks = [pairs[i:i + step] for i in range(0, len(pairs), step)]
        job = _Job(tag, len(chunks))
        if not chunks:
            self.finished.append((tag, True, 0))
            return
        if len(chunks) > 1:
            self.stats["split"] += 1
        for c in chunks:
            self.queue.append(_Piece(job, lay, peer, remote, remote_blocks, c, after, len(c) * per))
        self._pump()

    def _resolve(self, p: _Piece, ok: bool, err=None):
        if p.off is not None:
            self.pool.release(p.off, p.size)
            p.off = None
        if not ok:
            self.stats["failed"] += 1
            if p.job.ok:
                logger.warning("kvwire: staged transfer failed: %s", err)
            p.job.ok = False
        else:
            p.job.nbytes += p.size
        p.job.pending -= 1
        if p.job.pending == 0:
            self.finished.append((p.job.tag, p.job.ok, p.job.nbytes if p.job.ok else 0))

    def _start(self, p: _Piece):
        """Gathers the piece's blocks into its chunk (async on CUDA)."""
        lay = p.layer
        nb = len(p.pairs)
        chunk = self.pool_mem[p.off:p.off + p.size].view(lay.cache.dtype).view(lay.halves, nb, *lay.block_shape)
        copies = []
        for h in range(lay.halves):
            blocks = lay.blocks(lay.cache, h)
            for j, s, k in runs([s for s, _ in p.pairs]):
                copies.append((chunk[h, j:j + k], blocks[s:s + k]))
        p.copied = self.dev.copy(p.after, copies)

    def _write(self, p: _Piece):
        lay, nb, bb = p.layer, len(p.pairs), p.layer.block_bytes
        ops = []
        for j, (_, d) in enumerate(p.pairs):
            for h in range(lay.halves):
                ops.append((self.pool_region, p.off + (h * nb + j) * bb, p.remote, (h * p.remote_blocks + d) * bb, bb))
        p.batch = self.engine.write(p.peer, ops)
        self.stats["staged_bytes"] += p.size

    def _pump(self, block: bool = False) -> bool:
        """Admits queued pieces while the pool has room, writes the gathered ones, resolves the
        written ones. ``block``: waits for the oldest piece in flight when nothing else moved.
        Returns whether anything is still queued or in flight."""
        while True:
            moved = False
            while self.queue:
                p = self.queue[0]
                if not p.job.ok:  # an earlier piece of its transfer failed: do not send the rest
                    self.queue.popleft()
                    self._resolve(p, False)
                    moved = True
                    continue
                off = self.pool.alloc(p.size)
                if off is None:
                    p.waited = True
                    break
                self.queue.popleft()
                p.off = off
                self.stats["pieces"] += 1
                self.stats["waited"] += p.waited
                try:
                    self._start(p)
                except (RuntimeError, kvwire.KvwireError) as e:
                    self.dev.settle()
                    self._resolve(p, False, e)
                    moved = True
                    continue
                self.inflight.append(p)
                moved = True
            keep = []
            for p in self.inflight:
                try:
                    if p.batch is None and self.dev.done(p.copied):
                        self._write(p)
                        moved = True
                    st = p.batch.poll() if p.batch is not None else None
                except (RuntimeError, kvwire.KvwireError) as e:
                    self._resolve(p, False, e)
                    moved = True
                    continue
                if st is None:
                    keep.append(p)
                else:
                    self._resolve(p, True)
                    moved = True
            self.inflight = keep
            busy = bool(self.queue or self.inflight)
            if not busy or (not block and not moved):
                return busy
            if block and not moved:
                if not self.inflight:  # cannot happen: a piece fits in the empty pool
                    self._resolve(self.queue.popleft(), False, "a piece bigger than the staging pool")
                    continue
                # The oldest copy still running (its write goes out as soon as it is done, while
                # the earlier writes proceed), else the oldest write.
                copying = [p for p in self.inflight if p.batch is None]
                try:
                    if copying:
                        self.dev.done(copying[0].copied, block=True)
                    else:
                        self.inflight[0].batch.wait()
                except (RuntimeError, kvwire.KvwireError):
                    pass  # the poll in the next round resolves it

    def reap(self, block: bool):
        """Moves the staged sends along; returns the ``(tag, ok, nbytes)`` of the transfers that
        ended. ``block``: returns only when nothing is queued or in flight."""
        if self.queue or self.inflight:
            self._pump(block)
        out, self.finished = self.finished, []
        return out

    def close(self):
        """After the engine shut down: no transfer reads or writes the staging memory any more."""
        self.dev.close()

    @property
    def idle(self) -> bool:
        """Nothing queued, nothing in flight, every chunk back in the pool."""
        return not self.queue and not self.inflight and (self.pool is None or self.pool.used == 0)
