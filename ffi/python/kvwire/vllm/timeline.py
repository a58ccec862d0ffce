"""Production timelines: the connector's per-request records written as JSON lines, off the
hot path.

:class:`TimelineWriter` takes records (dicts) from the connector's threads into a bounded queue
and writes them from its own thread to ``<dir>/<engine>-<role>-<pid>.jsonl``, rotated by size
(``max_bytes`` per file, ``files`` files kept: ``.1`` is the previous one). When the queue is
full a record is dropped and counted (``dropped``), never buffered without bound; ``written``
counts what reached the file.

Each record is the connector core's timeline record (see ``kvwire_connector::TimelineRecord``:
nanosecond timestamps on this host's monotonic clock) plus what the connector knows at the
time: ``transfer_id``, ``engine_id``, ``role`` (``p`` or ``d``), ``peer_engine_id``, the loads
at ``decode_sent`` (``d_waiting``, ``d_running``; on P ``p_waiting``, ``p_running``,
``p_queued_tokens``), on P ``p_cached_tokens`` (the prompt tokens P's prefix cache held when
it first scheduled the request: P computed the rest), and ``clock_offset_ns`` / ``clock_error_ns`` (the peer's monotonic clock
minus ours, estimated over the control channel) so that ``kvwire-bench calibrate`` can put P's
and D's milestones on one clock.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading

logger = logging.getLogger("kvwire.vllm")


class TimelineWriter:
    def __init__(self, directory: str, engine_id: str, role: str, max_bytes: int = 64 << 20, files: int = 4,
                 capacity: int = 16384):
        os.makedirs(directory, exist_ok=True)
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in engine_id)
        self.path = os.path.join(directory, f"{safe}-{role}-{os.getpid()}.jsonl")
        self.max_bytes = max(4096, int(max_bytes))
        self.files = max(1, int(files))
        self.q: queue.Queue = queue.Queue(maxsize=capacity)
        self.dropped = 0
        self.written = 0
        self._f = open(self.path, "a", buffering=1 << 16)
        self._size = self._f.tell()
        self._t = threading.Thread(target=self._run, name="kvwire-timeline", daemon=True)
        self._t.start()

    def put(self, record: dict) -> None:
        try:
            self.q.put_nowait(record)
        except queue.Full:
            self.dropped += 1

    def _rotate(self) -> None:
        self._f.close()
        for i in range(self.files - 1, 0, -1):
            src = self.path if i == 1 else f"{self.path}.{i - 1}"
            if os.path.exists(src):
                os.replace(src, f"{self.path}.{i}")
        if self.files == 1:
            os.replace(self.path, f"{self.path}.old") if os.path.exists(self.path) else None
        self._f = open(self.path, "a", buffering=1 << 16)
        self._size = 0

    def _run(self) -> None:
        while True:
            rec = self.q.get()
            if rec is None:
                break
            try:
                line = json.dumps(rec, separators=(",", ":")) + "\n"
                if self._size + len(line) > self.max_bytes and self._size > 0:
                    self._rotate()
                self._f.write(line)
                self._size += len(line)
                self.written += 1
                if self.q.empty():
                    self._f.flush()
            except (OSError, TypeError, ValueError) as e:
                self.dropped += 1
                logger.warning("kvwire: timeline record not written: %s", e)
        self._f.flush()

    def close(self) -> None:
        self.q.put(None)
        self._t.join(timeout=5.0)
        try:
            self._f.close()
        except OSError:
            pass
