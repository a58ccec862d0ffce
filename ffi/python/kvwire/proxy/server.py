"""The proxy's HTTP server (aiohttp): dispatch to P and D, relay D's answer, keep the records.

Every request: pick P and D (:mod:`kvwire.proxy.policy`), mint a transfer id, send P its copy
(``max_tokens`` 1, not streamed) and D the client's, each with its ``kv_transfer_params``, at
once; relay D's answer as it comes. Failures answer the client with an OpenAI-style error
(``{"error": {"message", "type", "code"}}``): 400 for a body that is not a JSON object, 503 when
no healthy backend of a role is left, 502 when a backend answers with an error or drops the
connection (P's failure ends D's request too: its KV would never come), 504 when one does not
answer within ``--timeout`` (for a stream: between two chunks). A failure after a stream began
is sent as a last ``data: {"error": ...}`` event. A client that goes away cancels the handler
(aiohttp's ``handler_cancellation``): the proxy's connections to P and D close, and vLLM aborts
the request on both.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid

import aiohttp
from aiohttp import web

from kvwire.proxy import params as _params
from kvwire.proxy.backends import parse_metrics
from kvwire.proxy.policy import RequestInfo
from kvwire.proxy.sse import OutputWatcher

logger = logging.getLogger("kvwire.proxy")

PATHS = ("/v1/completions", "/v1/chat/completions")
FORWARDED_HEADERS = ("Authorization",)


class BackendFailure(Exception):
    """A backend answered with an error, dropped the connection or timed out."""

    def __init__(self, backend, status: int, message: str):
        super().__init__(f"{backend.role.upper()} backend {backend.url}: {message}")
        self.backend = backend
        self.status = status


class ClientGone(Exception):
    """Writing to the client failed: it went away. aiohttp raises ``ClientConnectionResetError``
    there, which is an ``aiohttp.ClientError`` too; kept apart so that a client's hang-up is never
    taken for D's failure (a 502, and D marked unhealthy)."""


async def _to_client(write) -> None:
    try:
        await write
    except ConnectionError as e:
        raise ClientGone(str(e) or type(e).__name__) from e


def error_body(status: int, message: str) -> dict:
    return {"error": {"message": message, "type": "kvwire_proxy_error", "code": status}}


def error_response(status: int, message: str) -> web.Response:
    return web.json_response(error_body(status, message), status=status)


def request_info(path: str, body: dict, headers) -> RequestInfo:
    """The prompt's length (exact for token-id prompts, else estimated at 4 characters a token)
    and its session (the body's ``user``, or an ``X-Session-Id`` header)."""
    session = headers.get("X-Session-Id") or (body.get("user") if isinstance(body.get("user"), str) else None)
    n, estimated = _prompt_tokens(body)
    return RequestInfo(path, n, estimated, session)


def _prompt_tokens(body: dict) -> tuple[int, bool]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return len(prompt), False
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
        return len(prompt[0]), False
    if isinstance(prompt, str):
        return max(1, len(prompt) // 4), True
    chars = 0
    for m in body.get("messages") or ():
        c = m.get("content") if isinstance(m, dict) else None
        if isinstance(c, str):
            chars += len(c)
        elif isinstance(c, list):
            chars += sum(len(p.get("text", "")) for p in c if isinstance(p, dict))
    return max(1, chars // 4), True


class Proxy:
    def __init__(self, opts, prefill, decode, policy, records=None):
        self.opts = opts
        self.prefill = prefill
        self.decode = decode
        self.policy = policy
        self.records = records
        self.session: aiohttp.ClientSession | None = None
        self.counts = {"requests": 0, "ok": 0, "failed": 0, "client_gone": 0}
        self.stopping = False  # set on SIGTERM: a handler cancelled then failed for that, not its client
        self._health: asyncio.Task | None = None

    # ---- backends ----
    async def check(self, b) -> bool:
        """One health check of ``b``: ``/health``, then its load from ``/metrics``."""
        t = aiohttp.ClientTimeout(total=self.opts.connect_timeout + 2)
        try:
            async with self.session.get(b.url + "/health", timeout=t) as r:
                if r.status != 200:
                    raise aiohttp.ClientResponseError(r.request_info, (), status=r.status, message="unhealthy")
            async with self.session.get(b.url + "/metrics", timeout=t) as r:
                if r.status == 200:
                    b.load = parse_metrics(await r.text())
            b.healthy, b.last_error = True, None
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            if b.healthy:
                logger.warning("kvwire.proxy: %s backend %s is unhealthy: %s", b.role.upper(), b.url, e or type(e).__name__)
            b.healthy, b.last_error = False, str(e) or type(e).__name__
        b.checked_at = time.monotonic()
        return b.healthy

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.opts.health_interval)
            await asyncio.gather(*(self.check(b) for b in self.prefill + self.decode))

    async def wait_ready(self, seconds: float) -> list:
        """Checks every backend until all are healthy or ``seconds`` passed; the unhealthy ones."""
        end = time.monotonic() + seconds
        while True:
            await asyncio.gather(*(self.check(b) for b in self.prefill + self.decode))
            bad = [b for b in self.prefill + self.decode if not b.healthy]
            if not bad or time.monotonic() >= end:
                return bad
            await asyncio.sleep(min(1.0, max(0.0, end - time.monotonic())))

    async def open(self) -> None:
        self.session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.opts.connect_timeout),
            connector=aiohttp.TCPConnector(limit=0))

    async def on_startup(self, app) -> None:
        self._health = asyncio.create_task(self._health_loop())

    async def on_cleanup(self, app) -> None:
        if self._health is not None:
            self._health.cancel()
        if self.session is not None:
            await self.session.close()
        if self.records is not None:
            self.records.close()

    # ---- handlers ----
    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.opts.max_body)
        for path in PATHS:
            app.router.add_post(path, self.handle)
        app.router.add_get("/health", self.health)
        app.router.add_get("/status", self.status)
        app.router.add_get("/v1/models", self.models)
        app.on_startup.append(self.on_startup)
        app.on_cleanup.append(self.on_cleanup)
        return app

    def _status(self) -> dict:
        out = {"backends": [b.status() for b in self.prefill + self.decode], "counts": dict(self.counts),
               "style": self.opts.style, "policy": self.opts.policy}
        decisions = getattr(self.policy, "decisions", None)
        if isinstance(decisions, dict):
            out["decisions"] = dict(decisions)
        return out

    async def health(self, request) -> web.Response:
        ok = any(b.healthy for b in self.prefill) and any(b.healthy for b in self.decode)
        return web.json_response(self._status(), status=200 if ok else 503)

    async def status(self, request) -> web.Response:
        return web.json_response(self._status())

    async def models(self, request) -> web.Response:
        ds = [b for b in self.decode if b.healthy]
        if not ds:
            return error_response(503, "no healthy decode backend")
        try:
            async with self.session.get(ds[0].url + "/v1/models", timeout=aiohttp.ClientTimeout(
                    total=self.opts.timeout)) as r:
                return web.Response(body=await r.read(), status=r.status, content_type="application/json")
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            return error_response(502, f"decode backend {ds[0].url}: {e or type(e).__name__}")

    async def handle(self, request) -> web.StreamResponse:
        self.counts["requests"] += 1
        try:
            body = await request.json()
        except (ValueError, UnicodeDecodeError):
            body = None
        if not isinstance(body, dict):
            self.counts["failed"] += 1
            return error_response(400, "the request body is not a JSON object")
        path = request.path
        info = request_info(path, body, request.headers)
        ps = [b for b in self.prefill if b.healthy]
        ds = [b for b in self.decode if b.healthy]
        if not ps or not ds:
            self.counts["failed"] += 1
            role = "prefill" if not ps else "decode"
            return error_response(503, f"no healthy {role} backend ("
                                  + "; ".join(f"{b.url}: {b.last_error}" for b in (self.prefill if not ps else self.decode))
                                  + ")")
        p, d = self.policy.pick(ps, ds, info)
        tid = f"kvw-{uuid.uuid4().hex}"
        stream = bool(body.get("stream"))
        rec = {"kind": "router", "transfer_id": tid, "path": path, "stream": stream,
               "prompt_tokens": info.prompt_tokens, "prompt_tokens_estimated": info.estimated,
               "session": info.session,
               "p": p.url if p is not None else None, "d": d.url,
               "p_load": p.load_now() if p is not None else None, "d_load": d.load_now(),
               "arrival_ns": time.monotonic_ns(), "wall_ns": time.time_ns(),
               "decode_sent_ns": None, "first_token_ns": None, "last_token_ns": None,
               "status": None, "error": None, "p_status": None, "p_error": None}
        headers = {h: request.headers[h] for h in FORWARDED_HEADERS if h in request.headers}
        client_kv = body.get("kv_transfer_params") if isinstance(body.get("kv_transfer_params"), dict) else None
        p_task = None
        try:
            d_body = dict(body)
            if p is not None:
                p_body = dict(body, stream=False, max_tokens=1,
                              kv_transfer_params=_params.p_params(self.opts.style, tid, p, d, client_kv))
                p_body.pop("stream_options", None)
                if "max_completion_tokens" in p_body:
                    p_body["max_completion_tokens"] = 1
                d_body["kv_transfer_params"] = _params.d_params(self.opts.style, tid, p, d, client_kv)
                p.inflight += 1
                p_task = asyncio.create_task(self._call_p(p, path, p_body, headers, rec))
            else:
                d_body.pop("kv_transfer_params", None)
            d.inflight += 1
            try:
                rec["decode_sent_ns"] = time.monotonic_ns()
                resp = await self._relay_d(request, d, path, d_body, headers, stream, p_task, rec)
            finally:
                d.inflight -= 1
            kind = "ok" if rec["status"] == 200 and rec["error"] is None else (
                "client_gone" if rec["status"] == 499 else "failed")
            self.counts[kind] += 1
            return resp
        except _params.StyleError as e:
            rec["status"], rec["error"] = 500, str(e)
            self.counts["failed"] += 1
            return error_response(500, str(e))
        except asyncio.CancelledError:
            if self.stopping:
                rec["status"], rec["error"] = 503, "the proxy stopped before the answer ended"
                self.counts["failed"] += 1
            else:
                rec["status"], rec["error"] = 499, "the client went away"
                self.counts["client_gone"] += 1
            raise
        finally:
            try:
                if p_task is not None and not p_task.done():
                    p_task.cancel()
                if p_task is not None:
                    await asyncio.gather(p_task, return_exceptions=True)
            finally:  # a handler cancelled while it waits for P still leaves its record
                if self.records is not None:
                    self.records.put(rec)

    async def _call_p(self, p, path, body, headers, rec) -> None:
        try:
            async with self.session.post(p.url + path, json=body, headers=headers,
                                         timeout=aiohttp.ClientTimeout(total=self.opts.timeout)) as r:
                try:
                    text = await r.text()
                except asyncio.CancelledError:
                    r.close()  # the connection goes: vLLM aborts the request on P
                    raise
                rec["p_status"] = r.status
                if r.status != 200:
                    rec["p_error"] = text[:500]
                    raise BackendFailure(p, 502, f"answered {r.status}: {text[:500]}")
        except asyncio.TimeoutError as e:
            rec["p_error"] = f"no answer within {self.opts.timeout} s"
            raise BackendFailure(p, 504, rec["p_error"]) from e
        except aiohttp.ClientError as e:
            rec["p_error"] = str(e) or type(e).__name__
            p.healthy, p.last_error = isinstance(e, aiohttp.ClientResponseError), rec["p_error"]
            raise BackendFailure(p, 502, rec["p_error"]) from e
        finally:
            p.inflight -= 1

    @staticmethod
    async def _next(task, p_task):
        """``task``'s result, unless P failed first (then BackendFailure, and ``task`` is cancelled)."""
        if p_task is not None and not p_task.done():
            await asyncio.wait({task, p_task}, return_when=asyncio.FIRST_COMPLETED)
        if p_task is not None and p_task.done() and not p_task.cancelled() and p_task.exception() is not None:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            raise p_task.exception()
        return await task

    async def _relay_d(self, request, d, path, body, headers, stream, p_task, rec) -> web.StreamResponse:
        read = aiohttp.ClientTimeout(total=None, sock_connect=self.opts.connect_timeout, sock_read=self.opts.timeout)
        sink = {}  # the client's stream, once it began
        try:
            # D's answer (its headers too) is raced against P's: a P that fails ends it.
            r = await self._next(asyncio.ensure_future(
                self.session.post(d.url + path, json=body, headers=headers, timeout=read)), p_task)
            try:
                return await self._answer(request, r, d, stream, p_task, rec, sink)
            except BaseException:
                r.close()  # the connection goes: vLLM aborts the request on D
                raise
            finally:
                r.release()
        except ClientGone:
            rec["status"], rec["error"] = 499, "the client went away"
            return sink["out"]
        except asyncio.TimeoutError:
            failure = BackendFailure(d, 504, f"no answer within {self.opts.timeout} s")
        except aiohttp.ClientError as e:
            failure = BackendFailure(d, 502, str(e) or type(e).__name__)
            d.healthy, d.last_error = isinstance(e, aiohttp.ClientResponseError), str(e) or type(e).__name__
        except BackendFailure as e:
            failure = e
        rec["status"], rec["error"] = failure.status, str(failure)
        logger.warning("kvwire.proxy: request %s: %s", rec["transfer_id"], failure)
        out = sink.get("out")
        if out is None:
            return error_response(failure.status, str(failure))
        try:
            await out.write(b"data: " + json.dumps(error_body(failure.status, str(failure))).encode() + b"\n\n")
            await out.write_eof()
        except (ConnectionError, RuntimeError):
            pass
        return out

    async def _answer(self, request, r, d, stream, p_task, rec, sink) -> web.StreamResponse:
        """D's answer to the client: whole, or relayed chunk by chunk as it streams."""
        if r.status != 200:
            text = await self._next(asyncio.create_task(r.text()), p_task)
            raise BackendFailure(d, 502, f"answered {r.status}: {text[:500]}")
        if not stream:
            data = await self._next(asyncio.create_task(r.read()), p_task)
            rec["last_token_ns"] = time.monotonic_ns()
            rec["status"] = 200
            return web.Response(body=data, status=200, content_type="application/json")
        out = sink["out"] = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream",
                                                                    "Cache-Control": "no-cache"})
        await _to_client(out.prepare(request))
        watch = OutputWatcher()
        while True:
            chunk = await self._next(asyncio.create_task(r.content.readany()), p_task)
            if not chunk:
                break
            if watch.feed(chunk):
                now = time.monotonic_ns()
                rec["first_token_ns"] = rec["first_token_ns"] or now
                rec["last_token_ns"] = now
            await _to_client(out.write(chunk))
        rec["status"] = 200
        rec["error"] = watch.error
        await _to_client(out.write_eof())
        return out
