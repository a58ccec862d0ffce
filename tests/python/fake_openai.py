"""A stand-in OpenAI/vLLM HTTP backend for the proxy's tests: ``/health``, ``/metrics``,
``/v1/models``, ``/v1/completions`` and ``/v1/chat/completions``, in a thread of its own.

What it answers is set per backend (``mode``): ``ok`` (the output is the prompt's first
``max_tokens`` ids + 1, streamed one token an event when asked), ``fail`` (HTTP 500), ``hang``
(never answers), ``hold`` (streams its first token, then waits until the test releases it or the
client goes away; ``hold_at=N`` holds only the N-th request so). Every request body is kept, and every handler that ended because its client
went away is counted in ``cancelled``."""

from __future__ import annotations

import asyncio
import json
import threading

from aiohttp import web


class FakeBackend:
    def __init__(self, name: str, mode: str = "ok", running: int = 0, waiting: int = 0, hold_at: int | None = None):
        self.name, self.mode = name, mode
        self.hold_at = hold_at  # the request (1-based) that is held after its first token, in mode ok
        self.running, self.waiting = running, waiting
        self.bodies: list[dict] = []
        self.cancelled = 0
        self.healthy = True
        self._closed = False
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._release: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        self._ready.wait(10)

    # ---- test side ----
    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def release(self) -> None:
        self._loop.call_soon_threadsafe(self._release.set)

    def close(self) -> None:
        """Stops serving (its connections and its port closed, as a killed server's); once."""
        if self._closed:
            return
        self._closed = True

        async def stop():
            await self._runner.cleanup()

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    # ---- server side ----
    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._release = asyncio.Event()
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_post("/v1/chat/completions", self._complete)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()

    async def _health(self, request):
        return web.Response(status=200 if self.healthy else 503)

    async def _metrics(self, request):
        text = (f'vllm:num_requests_running{{model_name="tiny",engine="0"}} {self.running}.0\n'
                f'vllm:num_requests_waiting{{model_name="tiny",engine="0"}} {self.waiting}.0\n')
        return web.Response(text=text)

    async def _models(self, request):
        return web.json_response({"object": "list", "data": [{"id": "tiny", "object": "model"}]})

    async def _complete(self, request):
        body = await request.json()
        self.bodies.append(body)
        try:
            return await self._answer(request, body)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise

    async def _answer(self, request, body):
        if self.mode == "fail":
            return web.json_response({"error": {"message": f"{self.name} failed"}}, status=500)
        if self.mode == "hang":
            await asyncio.Event().wait()
        prompt = body.get("prompt") if isinstance(body.get("prompt"), list) else [1, 2, 3]
        n = int(body.get("max_tokens") or body.get("max_completion_tokens") or 1)
        out = [(prompt[i % len(prompt)] + 1) for i in range(n)]
        chat = request.path.endswith("/chat/completions")
        if not body.get("stream"):
            choice = ({"message": {"role": "assistant", "content": " ".join(map(str, out))}} if chat
                      else {"text": " ".join(map(str, out)), "token_ids": out})
            return web.json_response({"id": self.name, "choices": [choice],
                                      "kv_transfer_params": body.get("kv_transfer_params")})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if chat:
            await resp.write(b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n\n')
        for i, t in enumerate(out):
            ch = {"delta": {"content": str(t)}} if chat else {"text": str(t), "token_ids": [t]}
            await resp.write(b"data: " + json.dumps({"id": self.name, "choices": [ch]}).encode() + b"\n\n")
            if i == 0 and (self.mode == "hold" or len(self.bodies) == self.hold_at):
                await self._release.wait()
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp
