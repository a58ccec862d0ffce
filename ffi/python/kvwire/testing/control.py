"""Controlling a running stand-in worker from a test, through a directory.

The worker reads ``$KVWIRE_STANDIN_CONTROL`` (a directory; unset: no control, no overhead):

* ``layer_ms`` — a number: milliseconds of "compute" per layer in every step that computes
  tokens (``$KVWIRE_STANDIN_LAYER_MS`` sets the value at start-up; the file overrides it and is
  re-read every step);
* ``token_us`` — a number: microseconds of "compute" per layer and per token the step computes,
  on top of ``layer_ms`` (``$KVWIRE_STANDIN_TOKEN_US`` at start-up; the file overrides it, re-read
  every step). With it a prefill's time grows with the tokens it computes, as a real model's
  does: what ``kvwire-bench calibrate`` fits its per-token prefill term to;
* ``hold.<layer>`` — while this file exists, a step that computes tokens stops before it
  computes layer ``<layer>`` (after the earlier layers were computed and handed to the
  connector). On stopping, the worker appends a line to ``held.<layer>``; it goes on once the
  test removes ``hold.<layer>``. So a test orders events without timing: "hold layer 1, wait
  until P is held, check what D has, release". A ``hold.<layer>`` that reads ``last-chunk``
  holds only a step that ends a prefill begun in an earlier step (a chunked prompt's last
  chunk);
* ``probe.json`` — ``{"id": ..., "tokens": [...], "layer": l, "in": ...}``: while it exists,
  every step looks for the K/V that the first ``len(tokens)`` positions of a prompt starting
  with ``tokens`` have in layer ``l`` (one block's worth, ``len(tokens)`` = the block size) in
  every block of the KV cache and of the connector's landing pool (only of the one ``in``
  names, ``cache`` or ``landing``, when set), and once found appends a
  ``{"ev": "probe", "id": ..., "found": [{"in": "cache"|"landing", "block": b}, ...]}``
  event (once per id). So a test sees what landed on an instance while its peer is held;
* ``events.jsonl`` — the worker appends one JSON line per event: ``{"ev": "step", "rank": r,
  "tokens": n, "reqs": [...]}`` for every step, ``{"ev": "layer", "layer": l, ...}`` once a
  layer was computed in a step with prefill tokens, ``{"ev": "corrupt", ...}`` when a byte was
  flipped on purpose (see :mod:`kvwire.testing.worker`).

:class:`Control` is the test's side of it.
"""

from __future__ import annotations

import json
import os
import time

ENV = "KVWIRE_STANDIN_CONTROL"
LAYER_MS_ENV = "KVWIRE_STANDIN_LAYER_MS"
TOKEN_US_ENV = "KVWIRE_STANDIN_TOKEN_US"
LAST_CHUNK = "last-chunk"
PROBE = "probe.json"


class WorkerControl:
    """The worker's side (one per worker process)."""

    def __init__(self, rank: int = 0):
        self.dir = os.environ.get(ENV) or None
        self.rank = rank
        self.default_ms = _env_number(LAYER_MS_ENV)
        self.default_us = _env_number(TOKEN_US_ENV)
        self.layer_ms = self.default_ms
        self.token_us = self.default_us
        self.tokens = 0

    def begin_step(self, tokens: int, reqs) -> None:
        self.tokens = tokens
        if self.dir is None:
            return
        self.layer_ms = self._number("layer_ms", self.default_ms)
        self.token_us = self._number("token_us", self.default_us)
        self.event(ev="step", tokens=tokens, reqs=list(reqs))

    def _number(self, name: str, default: float) -> float:
        try:
            with open(os.path.join(self.dir, name)) as f:
                return float(f.read().strip() or 0)
        except (OSError, ValueError):
            return default

    def before_layer(self, layer: int, last_chunk: bool = False) -> None:
        """Holds here while ``hold.<layer>`` exists (only in a last chunk's step when it says
        ``last-chunk``)."""
        if self.dir is None:
            return
        hold = os.path.join(self.dir, f"hold.{layer}")
        try:
            with open(hold) as f:
                only = f.read().strip()
        except OSError:
            return
        if only == LAST_CHUNK and not last_chunk:
            return
        with open(os.path.join(self.dir, f"held.{layer}"), "a") as f:
            f.write(f"{self.rank}\n")
        while os.path.exists(hold):
            time.sleep(0.002)

    def probe(self) -> dict | None:
        """The probe a test asked for (``probe.json``), or None."""
        if self.dir is None:
            return None
        try:
            with open(os.path.join(self.dir, PROBE)) as f:
                spec = json.load(f)
            where = spec.get("in")
            return {"id": str(spec["id"]), "tokens": [int(t) for t in spec["tokens"]], "layer": int(spec["layer"]),
                    "in": str(where) if where else None}
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def compute(self) -> None:
        """One layer's "compute" for the step begun last: ``layer_ms`` plus ``token_us`` per token."""
        s = self.layer_ms / 1e3 + self.tokens * self.token_us / 1e6
        if s > 0:
            time.sleep(s)

    def event(self, **fields) -> None:
        if self.dir is None:
            return
        fields.setdefault("rank", self.rank)
        fields["t_ns"] = time.monotonic_ns()
        with open(os.path.join(self.dir, "events.jsonl"), "a") as f:
            f.write(json.dumps(fields) + "\n")


def _env_number(name: str) -> float:
    try:
        return max(0.0, float(os.environ.get(name, "0") or 0))
    except ValueError:
        return 0.0


class Control:
    """The test's side: ``Control(dir)`` and pass ``env()`` to the server."""

    def __init__(self, path: str):
        self.dir = path
        os.makedirs(path, exist_ok=True)

    def env(self) -> dict:
        return {ENV: self.dir}

    def set_layer_ms(self, ms: float) -> None:
        with open(os.path.join(self.dir, "layer_ms"), "w") as f:
            f.write(str(ms))

    def set_token_us(self, us: float) -> None:
        with open(os.path.join(self.dir, "token_us"), "w") as f:
            f.write(str(us))

    def hold(self, layer: int, last_chunk: bool = False) -> None:
        """Holds every step that computes tokens before ``layer`` (with ``last_chunk``: only a
        step that ends a prefill begun in an earlier step)."""
        self._put(f"hold.{layer}", LAST_CHUNK if last_chunk else "")

    def probe(self, pid: str, tokens, layer: int, where: str | None = None) -> None:
        """Asks the worker to look for the K/V of ``tokens`` (a prompt's first block) in
        ``layer`` (only in ``where``, ``cache`` or ``landing``, when given); :meth:`found`
        says where it saw it."""
        self._put(PROBE, json.dumps({"id": pid, "tokens": list(tokens), "layer": layer, "in": where}))

    def _put(self, name: str, text: str) -> None:
        """Writes a control file whole (a worker never reads half of it)."""
        tmp = os.path.join(self.dir, name + ".tmp")
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, os.path.join(self.dir, name))

    def end_probe(self) -> None:
        try:
            os.unlink(os.path.join(self.dir, PROBE))
        except FileNotFoundError:
            pass

    def found(self, pid: str) -> list:
        """Where the worker found probe ``pid``'s K/V (empty: not yet)."""
        out = []
        for e in self.events("probe"):
            if e.get("id") == pid:
                out += e.get("found", [])
        return out

    def release(self, layer: int) -> None:
        try:
            os.unlink(os.path.join(self.dir, f"hold.{layer}"))
        except FileNotFoundError:
            pass

    def held(self, layer: int) -> int:
        """How many times a worker stopped at ``layer``."""
        try:
            with open(os.path.join(self.dir, f"held.{layer}")) as f:
                return sum(1 for _ in f)
        except FileNotFoundError:
            return 0

    def wait_held(self, layer: int, count: int = 1, timeout: float = 120.0) -> None:
        """Waits until a worker stopped at ``layer`` ``count`` times (the timeout only bounds a
        hang: it is no assertion about speed)."""
        end = time.monotonic() + timeout
        while self.held(layer) < count:
            if time.monotonic() > end:
                raise TimeoutError(f"no worker reached layer {layer} ({self.held(layer)}/{count})")
            time.sleep(0.01)

    def events(self, ev: str | None = None) -> list[dict]:
        try:
            with open(os.path.join(self.dir, "events.jsonl")) as f:
                out = [json.loads(line) for line in f if line.strip()]
        except FileNotFoundError:
            return []
        return [e for e in out if ev is None or e.get("ev") == ev]
