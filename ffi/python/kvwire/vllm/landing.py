"""D's landing pool on the worker: P's writes arrive in slots of the pool, and the workers copy
them into the request's KV blocks.

The pool has the KV cache's layout with ``slots`` blocks per layer. It lives where P's writes
can reach it: pinned host memory when D stages a CUDA cache (``d_landing: pool``), GPU memory
with ``staging: device``, host memory beside a CPU cache. Two kinds of request land in it:

* **policy ``land``**: D reserves KV blocks only once every layer is in the pool; then every
  layer is copied at once.
* **a staged D's ``eager``, ``lazy`` and ``jit``**: the pool is the only memory of D's that P
  can write, so P writes into slots while D holds KV blocks as the policy says; each layer is
  copied into the blocks as soon as it has landed (the scheduler lists the layers landed since
  the last step in each step's metadata), and what is left after the last layer is that
  layer's copy, not the whole request's.

A staged D with ``d_landing: mirror`` lands P's writes in a host mirror of its whole cache
instead (:mod:`kvwire.vllm.staging`): the same copies run from the mirror's blocks into the same
blocks of the cache, layer by layer as they land (every policy but ``land``, whose writes go to
the pool). The scheduler names no slots for those (``slots`` is ``None``).

Copies are ordered after the work already on the compute stream (a block just freed by another
request may still be read there) and, on CUDA, run on a side stream; a step's copies, every
request's, go out together behind one mark and complete with one event, polled, never waited
for. The worker reports a request (received, failed or released) only once
every copy into its blocks, and out of its slots, has completed: neither is reused before.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("kvwire.vllm")


def paired_runs(slots, blocks):
    """``(first slot, first block, count)`` for each run where both ids go up by one."""
    out = []
    for s, b in zip(slots, blocks):
        if out and out[-1][0] + out[-1][2] == s and out[-1][1] + out[-1][2] == b:
            out[-1][2] += 1
        else:
            out.append([s, b, 1])
    return [tuple(r) for r in out]


class LandingCopies:
    """The copies from a landing pool, or a landing mirror, into the KV caches of one worker.
    ``dev`` is a :class:`kvwire.vllm.staging.DeviceCopies` of the caches' device; ``caches``,
    ``pools`` and ``mirrors`` map layer names (in ``layers`` order) to tensors (``pools`` empty
    without a pool, ``mirrors`` empty without a mirror); ``halves`` is 2 for K/V-first layouts."""

    def __init__(self, dev, layers: list, caches: dict, pools: dict, halves: dict, mirrors: dict | None = None):
        self.dev = dev
        self.layers = list(layers)
        self.caches, self.pools, self.halves = caches, pools, halves
        self.mirrors = mirrors or {}
        self.running: dict[str, list] = {}  # req -> completions not yet seen done
        self.failed: dict[str, set] = {}  # req -> its KV blocks a copy failed to fill
        self.stats = dict(copies=0, layers=0, failed=0)

    def copy(self, req: str, slots: list | None, blocks: list, layers=None) -> None:
        """Starts copying ``slots`` of the pool (``None``: the same blocks of the mirror) into
        ``blocks`` for ``layers`` (indices; ``None``: every layer): :meth:`copy_all` of one."""
        self.copy_all([(req, slots, blocks, layers)])

    def copy_all(self, items) -> None:
        """Starts the copies ``(req, slots, blocks, layers)`` of one step (see :meth:`copy`) as
        one: a single mark on the compute stream, one completion shared by every request. A copy
        that cannot be made fails its request's blocks, one that cannot start fails every
        request's (see :meth:`take_failed`)."""
        pairs, reqs, layers = [], [], 0
        for req, slots, blocks, idx in items:
            src = self.pools if slots is not None else self.mirrors
            slots = blocks if slots is None else slots
            idx = range(len(self.layers)) if idx is None else idx
            why = self._refused(src, slots, blocks, idx)
            if why:
                logger.warning("kvwire: request %s: no copy into the KV cache: %s", req, why)
                self.failed.setdefault(req, set()).update(blocks)
                continue
            runs = paired_runs(slots, blocks)
            for i in idx:
                name = self.layers[i]
                for h in range(self.halves[name]):
                    c, p = self._half(self.caches[name], name, h), self._half(src[name], name, h)
                    pairs.extend((c[b:b + k], p[s:s + k]) for s, b, k in runs)
            reqs.append((req, blocks))
            layers += len(idx)
        if not reqs:
            return
        try:
            done = self.dev.copy(self.dev.mark(), pairs)
        except RuntimeError as e:
            logger.warning("kvwire: requests %s: copy into the KV cache failed: %s", [r for r, _ in reqs], e)
            self.dev.settle()
            self.stats["failed"] += 1
            for req, blocks in reqs:
                self.failed.setdefault(req, set()).update(blocks)
            return
        self.stats["copies"] += 1
        self.stats["layers"] += layers
        for req, _ in reqs:
            self.running.setdefault(req, []).append(done)

    def _half(self, t, name: str, h: int):
        """``[blocks, ...]`` view of half ``h`` of ``t`` (K or V; the whole of it when the layout
        has no halves)."""
        return t[h] if self.halves[name] == 2 else t

    def _refused(self, src: dict, slots: list, blocks: list, idx) -> str:
        """Why a copy of ``slots`` of ``src`` into ``blocks`` for layers ``idx`` cannot be
        made ("" when it can): every layer copied and the ids' range are checked, a slice past
        the end would copy nothing without an error."""
        if not src:
            return f"this worker has no landing {'mirror' if src is self.mirrors else 'pool'}"
        if len(slots) != len(blocks):
            return f"{len(slots)} landing slots for {len(blocks)} KV blocks"
        if any(not 0 <= i < len(self.layers) for i in idx):
            return f"layers {sorted(idx)} of {len(self.layers)}"
        for ids, what, tensors in ((blocks, "KV blocks", self.caches), (slots, "landing slots", src)):
            lo, hi = min(ids, default=0), max(ids, default=-1)
            for i in idx:
                name = self.layers[i]
                n = self._half(tensors[name], name, 0).shape[0]
                if lo < 0 or hi >= n:
                    return f"{what} {sorted(ids)} outside the {n} of {name}"
        return ""

    def busy(self, req: str) -> bool:
        """Whether a copy of ``req`` is still running."""
        evs = self.running.get(req)
        if not evs:
            return False
        evs[:] = [e for e in evs if not self.dev.done(e)]
        if evs:
            return True
        del self.running[req]
        return False

    def take_failed(self, req: str) -> set:
        """The KV blocks of ``req`` that a copy failed to fill (reported as load errors)."""
        return self.failed.pop(req, set())

    @property
    def idle(self) -> bool:
        return not any(self.busy(r) for r in list(self.running))
