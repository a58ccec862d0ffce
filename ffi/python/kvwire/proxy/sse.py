"""Watching an OpenAI server-sent-event stream for its output, without changing a byte of it."""

from __future__ import annotations

import json


class OutputWatcher:
    """Fed the raw chunks of a ``text/event-stream`` body; says which chunk carried output
    (completion ``text`` or ``token_ids``, chat ``delta.content``) — the first such chunk is
    the first token the client sees. Events are split on blank lines across chunk boundaries;
    an event that is not JSON (``[DONE]``, keep-alives) carries no output. Holds at most one
    partial event (bounded by ``max_event``)."""

    def __init__(self, max_event: int = 1 << 20):
        self._buf = b""
        self.max_event = max_event
        self.events = 0
        self.error: str | None = None

    def feed(self, chunk: bytes) -> bool:
        self._buf += chunk
        found = False
        while True:
            end = self._buf.find(b"\n\n")
            if end < 0:
                break
            event, self._buf = self._buf[:end], self._buf[end + 2:]
            found |= self._event(event)
        if len(self._buf) > self.max_event:
            self._buf = b""  # not an event stream we understand: relayed, not watched
        return found

    def _event(self, event: bytes) -> bool:
        data = b"".join(line[5:].strip() for line in event.split(b"\n") if line.startswith(b"data:"))
        if not data or data == b"[DONE]":
            return False
        try:
            msg = json.loads(data)
        except ValueError:
            return False
        self.events += 1
        if not isinstance(msg, dict):
            return False
        if "error" in msg and self.error is None:
            err = msg["error"]
            self.error = str(err.get("message", err) if isinstance(err, dict) else err)
        for ch in msg.get("choices") or ():
            if not isinstance(ch, dict):
                continue
            delta = ch.get("delta") if isinstance(ch.get("delta"), dict) else {}
            if ch.get("text") or ch.get("token_ids") or delta.get("content") or delta.get("reasoning_content"):
                return True
        return False
