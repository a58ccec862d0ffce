"""Sending a trace's turns to an OpenAI ``/v1/completions`` endpoint, streamed, and timing them.

Every session runs in order: its turn ``k`` is sent once its arrival time (scaled by
``time_scale``) has come and turn ``k-1`` is done. A request is streamed with greedy sampling
and ``ignore_eos`` so that it produces exactly ``output_tokens``; the client times the first
and the last chunk that carried output. ``return_token_ids`` asks vLLM for the output token ids
(kept in the result, for checking outputs); a server that ignores it is fine.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import aiohttp


@dataclass
class Result:
    session: str
    turn: int
    line: int
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    sent_s: float = 0.0  # from the replay's start
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None
    tokens: int = 0  # output tokens received
    token_ids: list = field(default_factory=list)
    prompt_ids: list = field(default_factory=list)
    error: str | None = None


class Replayer:
    def __init__(self, url: str, model: str, *, time_scale: float = 1.0, timeout: float = 600.0,
                 token_ids: bool = True, extra: dict | None = None, on_done=None):
        self.url = url.rstrip("/")
        self.model = model
        self.time_scale = time_scale
        self.timeout = timeout
        self.token_ids = token_ids
        self.extra = extra or {}
        self.on_done = on_done or (lambda r: None)

    async def run(self, turns, prompts) -> list[Result]:
        """Replays ``turns`` (a trace, in arrival order) with ``prompts[i]`` the ids of turn i."""
        by_session: dict[str, list] = {}
        for t, ids in zip(turns, prompts):
            by_session.setdefault(t.session, []).append((t, ids))
        t0 = time.monotonic()
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=self.timeout)
        async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as http:
            runs = [self._session(http, t0, items) for items in by_session.values()]
            done = await asyncio.gather(*runs)
        return sorted((r for rs in done for r in rs), key=lambda r: (r.sent_s, r.line))

    async def _session(self, http, t0: float, items) -> list[Result]:
        out = []
        for t, ids in items:
            delay = t0 + t.arrival_s * self.time_scale - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            r = Result(t.session, t.turn, t.line, t.prompt_tokens, t.cached_tokens, t.output_tokens, prompt_ids=ids)
            r.sent_s = time.monotonic() - t0
            await self._one(http, r, ids, t.session)
            out.append(r)
            self.on_done(r)
        return out

    async def _one(self, http, r: Result, ids, session: str) -> None:
        body = {"model": self.model, "prompt": ids, "max_tokens": r.output_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True, "user": session, **self.extra}
        if self.token_ids:
            body["return_token_ids"] = True
        start = time.monotonic()
        first = last = None
        buf = b""
        try:
            async with http.post(self.url + "/v1/completions", json=body) as resp:
                if resp.status != 200:
                    r.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                    return
                async for chunk in resp.content.iter_any():
                    buf += chunk
                    while b"\n\n" in buf:
                        event, buf = buf.split(b"\n\n", 1)
                        n, err = self._event(event, r)
                        if err:
                            r.error = err
                        if n:
                            now = time.monotonic()
                            first = first or now
                            last = now
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            r.error = f"{type(e).__name__}: {e}"
        finally:
            if first is not None:
                r.ttft_s = first - start
                if r.tokens > 1:
                    r.tpot_s = (last - first) / (r.tokens - 1)
            if r.error is None:
                r.e2e_s = time.monotonic() - start
                if r.tokens < r.output_tokens:
                    r.error = f"{r.tokens} output tokens of {r.output_tokens}"

    @staticmethod
    def _event(event: bytes, r: Result) -> tuple[int, str | None]:
        """Output tokens in one server-sent event (and an error it carries)."""
        data = b"".join(line[5:].strip() for line in event.split(b"\n") if line.startswith(b"data:"))
        if not data or data == b"[DONE]":
            return 0, None
        try:
            msg = json.loads(data)
        except ValueError:
            return 0, None
        if not isinstance(msg, dict):
            return 0, None
        if "error" in msg:
            e = msg["error"]
            return 0, str(e.get("message", e) if isinstance(e, dict) else e)
        n = 0
        for ch in msg.get("choices") or ():
            ids = ch.get("token_ids") if isinstance(ch, dict) else None
            if isinstance(ids, list) and ids:
                r.token_ids.extend(ids)
                n += len(ids)
            elif isinstance(ch, dict) and ch.get("text"):
                n += 1
        r.tokens += n
        return n, None
