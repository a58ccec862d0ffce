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

Copies are ordered after the work already on the compute stream (a block just freed by another
request may still be read there) and, on CUDA, run on a side stream; completion is an event,
polled, never waited for. The worker reports a request (received, failed or released) only once
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
    """The copies from a landing pool into the KV caches of one worker. ``dev`` is a
    :class:`kvwire.vllm.staging.DeviceCopies` of the caches' device; ``caches`` and ``pools``
    map layer names (in ``layers`` order) to tensors; ``halves`` is 2 for K/V-first layouts."""

    def __init__(self, dev, layers: list, caches: dict, pools: dict, halves: dict):
        self.dev = dev
        self.layers = list(layers)
        self.caches, self.pools, self.halves = caches, pools, halves
        self.running: dict[str, list] = {}  # req -> completions not yet seen done
        self.failed: dict[str, set] = {}  # req -> its KV blocks a copy failed to fill
        self.stats = dict(copies=0, layers=0, failed=0)

    def copy(self, req: str, slots: list, blocks: list, layers=None) -> None:
        """Starts copying ``slots`` into ``blocks`` for ``layers`` (indices; ``None``: every
        layer). A copy that cannot start fails the request's blocks (see :meth:`take_failed`)."""
        if len(slots) != len(blocks):
            logger.warning("kvwire: request %s: %d landing slots for %d KV blocks", req, len(slots), len(blocks))
            self.failed.setdefault(req, set()).update(blocks)
            return
        idx = range(len(self.layers)) if layers is None else layers
        runs = paired_runs(slots, blocks)
        pairs = []
        try:
            for i in idx:
                name = self.layers[i]
                cache, pool = self.caches[name], self.pools[name]
                for h in range(self.halves[name]):
                    c, p = (cache[h], pool[h]) if self.halves[name] == 2 else (cache, pool)
                    for s, b, k in runs:
                        pairs.append((c[b:b + k], p[s:s + k]))
            done = self.dev.copy(self.dev.mark(), pairs)
        except (IndexError, RuntimeError) as e:
            logger.warning("kvwire: request %s: copy from the landing pool failed: %s", req, e)
            self.dev.settle()
            self.stats["failed"] += 1
            self.failed.setdefault(req, set()).update(blocks)
            return
        self.stats["copies"] += 1
        self.stats["layers"] += len(idx)
        self.running.setdefault(req, []).append(done)

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
