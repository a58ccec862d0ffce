"""The router's records: one JSON line per request, in ``router-<pid>.jsonl``.

Fields: ``kind`` (``"router"``), ``transfer_id``, ``path``, ``stream``, ``prompt_tokens`` (when
the prompt is token ids; otherwise an estimate marked by ``prompt_tokens_estimated``), ``p``
and ``d`` (backend URLs; ``p`` null when the request stayed on D), ``p_load`` and ``d_load``
(``{"waiting", "running", "inflight"}`` when it was sent), ``arrival_ns``, ``decode_sent_ns``,
``first_token_ns`` (the first streamed chunk with output; null for non-streaming requests, whose
first token the proxy cannot see), ``last_token_ns``, ``status`` (the HTTP status the client
got), ``error``, ``p_status``/``p_error``. Times are ``time.monotonic_ns()``; ``wall_ns`` is
the Unix time at arrival. ``kvwire-bench calibrate --timeline DIR`` joins them with the
connectors' timelines by transfer id.
"""

from __future__ import annotations

import json
import os
import threading


class RecordWriter:
    """Appends records to one file, a line each, flushed; rotates to ``.1`` past ``max_bytes``.
    ``path`` ending in ``.jsonl`` is that file; any other is a directory (made if absent) that
    gets ``router-<pid>.jsonl``."""

    def __init__(self, path: str, max_bytes: int = 256 << 20):
        if not path.endswith(".jsonl"):
            os.makedirs(path, exist_ok=True)
            path = os.path.join(path, f"router-{os.getpid()}.jsonl")
        self.path = path
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._f = open(path, "a", encoding="utf-8")
        self.written = 0

    def put(self, rec: dict) -> None:
        line = json.dumps(rec, separators=(",", ":")) + "\n"
        with self._lock:
            if self._f.tell() + len(line) > self.max_bytes:
                self._f.close()
                os.replace(self.path, self.path + ".1")
                self._f = open(self.path, "a", encoding="utf-8")
            self._f.write(line)
            self._f.flush()
            self.written += 1

    def close(self) -> None:
        with self._lock:
            self._f.close()
