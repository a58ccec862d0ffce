"""``python -m kvwire.proxy`` as users run it (its own process), in front of stand-in OpenAI
backends (:mod:`fake_openai`): what P and D are sent, what the client gets back, the router
records, failures in bounded time, a client that goes away, and the policies. The proxy in front
of real vLLM servers is in tests/e2e/test_proxy_replay.py."""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("aiohttp", reason="aiohttp (shipped with vLLM) not installed in this venv")

from fake_openai import FakeBackend  # noqa: E402

from kvwire.testing.ports import free_port  # noqa: E402
from kvwire.testing.wait import wait_for as _wait_for  # noqa: E402

WAIT_S = 30.0


def wait_for(cond, timeout=WAIT_S):
    return _wait_for(cond, timeout, step=0.05)


class ProxyProc:
    def __init__(self, args, tmp_path, env=None):
        self.port = free_port()
        self.records = str(tmp_path / "records")
        cmd = [sys.executable, "-m", "kvwire.proxy", "--port", str(self.port), "--records", self.records,
               "--health-interval", "0.2", *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env={**os.environ, **(env or {})})

    def wait_listening(self):
        line = self.proc.stdout.readline()
        assert "listening on" in line, (line, self.proc.stderr.read() if self.proc.poll() is not None else "")

    def request(self, path, body, headers=None, timeout=WAIT_S):
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        c.request("POST", path, body=json.dumps(body) if not isinstance(body, bytes) else body,
                  headers={"Content-Type": "application/json", **(headers or {})})
        r = c.getresponse()
        data = r.read()
        c.close()
        return r.status, data

    def get(self, path):
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=WAIT_S)
        c.request("GET", path)
        r = c.getresponse()
        data = r.read()
        c.close()
        return r.status, json.loads(data)

    def record_lines(self):
        out = []
        for name in sorted(os.listdir(self.records)) if os.path.isdir(self.records) else []:
            with open(os.path.join(self.records, name)) as f:
                out += [json.loads(line) for line in f if line.strip()]
        return out

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


@pytest.fixture
def make(tmp_path):
    made = []

    def backends(*modes, **kw):
        bs = [FakeBackend(f"b{i}", m, **kw) for i, m in enumerate(modes)]
        made.extend(bs)
        return bs

    def proxy(args, env=None, wait=True):
        p = ProxyProc(args, tmp_path, env)
        made.append(p)
        if wait:
            p.wait_listening()
        return p

    yield backends, proxy
    for m in reversed(made):
        (m.stop if isinstance(m, ProxyProc) else m.close)()


def spec(b, **kv):
    return ",".join([b.url] + [f"{k}={v}" for k, v in kv.items()])


def sse_tokens(data: bytes) -> tuple[list, list]:
    """(token ids, error events) of a completions event stream."""
    ids, errors = [], []
    for ev in data.split(b"\n\n"):
        if not ev.startswith(b"data: ") or ev == b"data: [DONE]":
            continue
        msg = json.loads(ev[6:])
        if "error" in msg:
            errors.append(msg["error"])
        for ch in msg.get("choices", ()):
            ids += ch.get("token_ids", [])
    return ids, errors


def test_kvwire_style_dispatch_and_record(make):
    backends, proxy = make
    p, d = backends("ok", "ok")
    px = proxy(["--prefill", spec(p, control="10.0.0.1:7100"), "--decode", spec(d, control="10.0.0.2:7100")])
    status, data = px.request("/v1/completions", {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 4})
    assert status == 200, data
    out = json.loads(data)
    assert out["id"] == "b1" and out["choices"][0]["token_ids"] == [6, 7, 8, 6]  # D's answer
    assert wait_for(lambda: p.bodies)  # P is asked at the same time as D: it may answer later
    (pb,), (db,) = p.bodies, d.bodies
    tid = pb["kv_transfer_params"]["transfer_id"]
    assert pb["max_tokens"] == 1 and pb["stream"] is False
    assert pb["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": tid,
                                        "remote_control": "10.0.0.2:7100"}
    assert db["max_tokens"] == 4
    assert db["kv_transfer_params"] == {"do_remote_prefill": True, "do_remote_decode": False, "transfer_id": tid,
                                        "remote_control": "10.0.0.1:7100"}
    assert wait_for(lambda: len(px.record_lines()) == 1)
    (rec,) = px.record_lines()
    assert rec["kind"] == "router" and rec["transfer_id"] == tid and rec["status"] == 200
    assert rec["p"] == p.url and rec["d"] == d.url and rec["prompt_tokens"] == 3
    assert rec["arrival_ns"] <= rec["decode_sent_ns"] <= rec["last_token_ns"]
    assert rec["first_token_ns"] is None  # not streamed: the proxy cannot see the first token
    assert set(rec["d_load"]) >= {"inflight"}


def test_stream_is_relayed_and_timed(make):
    backends, proxy = make
    p, d = backends("ok", "ok")
    px = proxy(["--prefill", spec(p, control="h:1"), "--decode", spec(d, control="h:2")])
    status, data = px.request("/v1/completions", {"prompt": [1, 2, 3, 4, 5], "max_tokens": 5, "stream": True,
                                                  "stream_options": {"include_usage": True}})
    assert status == 200
    ids, errors = sse_tokens(data)
    assert ids == [2, 3, 4, 5, 6] and not errors and data.endswith(b"data: [DONE]\n\n")
    assert wait_for(lambda: p.bodies)  # P is asked at the same time as D: it may answer later
    assert "stream_options" not in p.bodies[0] and d.bodies[0]["stream_options"] == {"include_usage": True}
    assert wait_for(lambda: len(px.record_lines()) == 1)
    (rec,) = px.record_lines()
    assert rec["decode_sent_ns"] <= rec["first_token_ns"] <= rec["last_token_ns"]


def test_chat_stream_first_token_is_content_not_the_role_event(make):
    backends, proxy = make
    p, d = backends("ok", "hold")
    px = proxy(["--prefill", spec(p, control="h:1"), "--decode", spec(d, control="h:2")])
    c = http.client.HTTPConnection("127.0.0.1", px.port, timeout=WAIT_S)
    c.request("POST", "/v1/chat/completions", body=json.dumps({"messages": [{"role": "user", "content": "hi"}],
                                                               "max_tokens": 2, "stream": True}))
    r = c.getresponse()
    assert r.status == 200
    d.release()
    data = r.read()
    c.close()
    assert b'"content": "2"' in data or b'"content":"2"' in data
    assert wait_for(lambda: len(px.record_lines()) == 1)
    (rec,) = px.record_lines()
    assert rec["first_token_ns"] is not None and rec["prompt_tokens_estimated"] is True


def test_mooncake_style_and_client_params(make):
    backends, proxy = make
    p, d = backends("ok", "ok")
    px = proxy(["--style", "mooncake", "--prefill", spec(p, bootstrap="http://10.0.0.1:8998", engine_id="p0"),
                "--decode", d.url])
    status, _ = px.request("/v1/completions", {"prompt": [1, 2], "max_tokens": 2,
                                               "kv_transfer_params": {"kvwire_policy": "eager",
                                                                      "transfer_id": "client-cannot-set-it"}})
    assert status == 200
    assert wait_for(lambda: p.bodies)  # P is asked at the same time as D: it may answer later
    pk, dk = p.bodies[0]["kv_transfer_params"], d.bodies[0]["kv_transfer_params"]
    assert pk["transfer_id"] == dk["transfer_id"] != "client-cannot-set-it"
    assert "remote_control" not in pk and pk["do_remote_decode"] is True
    assert dk["remote_bootstrap_addr"] == "http://10.0.0.1:8998" and dk["remote_engine_id"] == "p0"
    assert pk["kvwire_policy"] == dk["kvwire_policy"] == "eager"


def test_style_needs_its_addresses(make):
    backends, proxy = make
    p, d = backends("ok", "ok")
    px = proxy(["--prefill", p.url, "--decode", d.url], wait=False)
    assert px.proc.wait(WAIT_S) == 2
    assert "no control= address" in px.proc.stderr.read()


def test_p_failure_fails_the_request_and_aborts_d(make):
    backends, proxy = make
    p, d = backends("fail", "hang")
    px = proxy(["--prefill", spec(p, control="h:1"), "--decode", spec(d, control="h:2")])
    status, data = px.request("/v1/completions", {"prompt": [1], "max_tokens": 3})
    assert status == 502
    msg = json.loads(data)["error"]["message"]
    assert p.url in msg and "500" in msg
    assert wait_for(lambda: d.cancelled == 1)  # D's request was closed: vLLM aborts it
    assert wait_for(lambda: len(px.record_lines()) == 1)
    assert px.record_lines()[0]["p_status"] == 500


def test_a_silent_d_times_out_in_bounded_time(make):
    backends, proxy = make
    p, d = backends("ok", "hang")
    px = proxy(["--timeout", "1", "--prefill", spec(p, control="h:1"), "--decode", spec(d, control="h:2")])
    status, data = px.request("/v1/completions", {"prompt": [1], "max_tokens": 3})
    assert status == 504 and "no answer within 1.0 s" in json.loads(data)["error"]["message"]
    assert wait_for(lambda: d.cancelled == 1)


def hang_up_after_the_first_token(port, max_tokens):
    """A streamed completion through the proxy at ``port`` whose client hangs up once D's first
    token came through."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=WAIT_S)
    c.request("POST", "/v1/completions",
              body=json.dumps({"prompt": [1, 2], "max_tokens": max_tokens, "stream": True}))
    r = c.getresponse()
    assert r.status == 200
    assert b"token_ids" in r.fp.readline() + r.fp.readline()
    c.sock.close()
    c.close()


def test_client_gone_mid_stream_closes_p_and_d(make):
    backends, proxy = make
    p, d = backends("hang", "hold")
    px = proxy(["--prefill", spec(p, control="h:1"), "--decode", spec(d, control="h:2")])
    hang_up_after_the_first_token(px.port, 3)
    assert wait_for(lambda: d.cancelled == 1 and p.cancelled == 1), (d.cancelled, p.cancelled)
    assert wait_for(lambda: len(px.record_lines()) == 1)
    assert px.record_lines()[0]["status"] == 499
    assert px.get("/status")[1]["counts"]["client_gone"] == 1


class InProcessProxy:
    """The proxy's app in this process, on a runner without ``handler_cancellation``: a client that
    hangs up is then seen only when the proxy next writes to it (as happens, by a race, in the
    proxy's own runner too)."""

    def __init__(self, args, tmp_path):
        import asyncio
        import threading

        from aiohttp import web

        from kvwire.proxy.__main__ import parser
        from kvwire.proxy.backends import parse_backend
        from kvwire.proxy.policy import load_policy
        from kvwire.proxy.records import RecordWriter
        from kvwire.proxy.server import Proxy

        self.port, self.records = free_port(), str(tmp_path / "records")
        opts = parser().parse_args(["--port", str(self.port), "--records", self.records, *args])
        self.proxy = Proxy(opts, [parse_backend(s, "p") for s in opts.prefill],
                           [parse_backend(s, "d") for s in opts.decode], load_policy(opts.policy, opts),
                           RecordWriter(opts.records))
        self.loop = asyncio.new_event_loop()
        started = threading.Event()

        async def start():
            await self.proxy.open()
            self.runner = web.AppRunner(self.proxy.app(), handler_cancellation=False, access_log=None)
            await self.runner.setup()
            await web.TCPSite(self.runner, "127.0.0.1", self.port).start()
            started.set()

        self.thread = threading.Thread(target=lambda: (self.loop.run_until_complete(start()),
                                                       self.loop.run_forever()), daemon=True)
        self.thread.start()
        assert started.wait(WAIT_S)

    record_lines = ProxyProc.record_lines

    def stop(self):
        import asyncio

        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(WAIT_S)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(WAIT_S)


def test_client_gone_seen_at_a_write_is_the_clients_not_ds(make, tmp_path):
    """aiohttp's error for a write to a client that went away (``ClientConnectionResetError``) is
    an ``aiohttp.ClientError`` too: it is still the client's hang-up (499), not D's failure (502),
    and D stays healthy."""
    backends, _ = make
    p, d = backends("ok", "hold")
    px = InProcessProxy(["--health-interval", "3600", "--prefill", spec(p, control="h:1"),
                         "--decode", spec(d, control="h:2")], tmp_path)
    try:
        hang_up_after_the_first_token(px.port, 200)
        d.release()  # D streams the rest: the proxy's writes to the gone client fail
        assert wait_for(lambda: len(px.record_lines()) == 1)
        (rec,) = px.record_lines()
        assert (rec["status"], rec["error"]) == (499, "the client went away"), rec
        assert px.proxy.decode[0].healthy and px.proxy.counts["client_gone"] == 1, px.proxy.counts
    finally:
        px.stop()


def test_unreachable_backend_at_startup(make):
    backends, proxy = make
    (p,) = backends("ok")
    dead = f"http://127.0.0.1:{free_port()}"
    px = proxy(["--prefill", spec(p, control="h:1"), "--decode", f"{dead},control=h:2"], wait=False)
    assert px.proc.wait(WAIT_S) == 2
    err = px.proc.stderr.read()
    assert f"D backend {dead} is unreachable" in err


def test_bad_body_and_bad_spec(make):
    backends, proxy = make
    p, d = backends("ok", "ok")
    px = proxy(["--prefill", spec(p, control="h:1"), "--decode", spec(d, control="h:2")])
    status, data = px.request("/v1/completions", b"{not json")
    assert status == 400 and "not a JSON object" in json.loads(data)["error"]["message"]
    status, _ = px.request("/v1/completions", [1, 2])
    assert status == 400
    assert not p.bodies and not d.bodies
    bad = proxy(["--prefill", "localhost:8000", "--decode", d.url], wait=False)
    assert bad.proc.wait(WAIT_S) == 2 and "http:// URL" in bad.proc.stderr.read()


def test_unhealthy_decode_gives_503(make):
    backends, proxy = make
    p, d = backends("ok", "ok")
    px = proxy(["--prefill", spec(p, control="h:1"), "--decode", spec(d, control="h:2")])
    d.healthy = False
    assert wait_for(lambda: px.get("/status")[1]["backends"][1]["healthy"] is False)
    status, data = px.request("/v1/completions", {"prompt": [1], "max_tokens": 1})
    assert status == 503 and "no healthy decode backend" in json.loads(data)["error"]["message"]
    assert not d.bodies
    d.healthy = True
    assert wait_for(lambda: px.request("/v1/completions", {"prompt": [1], "max_tokens": 1})[0] == 200)


def test_round_robin_and_least_load(make):
    backends, proxy = make
    p, d1, d2 = backends("ok", "ok", "ok")
    args = ["--prefill", spec(p, control="h:1"), "--decode", spec(d1, control="h:2"), "--decode", spec(d2, control="h:3")]
    rr = proxy(args)
    for _ in range(4):
        assert rr.request("/v1/completions", {"prompt": [1], "max_tokens": 1})[0] == 200
    assert len(d1.bodies) == len(d2.bodies) == 2
    d1.running = 5  # d1 reports 5 running requests in its /metrics
    ll = proxy(["--policy", "least_load", *args])
    assert wait_for(lambda: ll.get("/status")[1]["backends"][1]["load"].get("running") == 5)
    for _ in range(3):
        assert ll.request("/v1/completions", {"prompt": [1], "max_tokens": 1})[0] == 200
    assert len(d1.bodies) == 2 and len(d2.bodies) == 5


def cost_file(tmp_path, prefill_s_per_token):
    terms = {"fixed_s": 0.001, "bytes_per_s": 1e10, "per_layer_tail_s": 0.0, "d_step_s": 0.01,
             "d_queue_s_per_waiting": 0.0, "prefill_s_per_token": prefill_s_per_token}
    doc = {"schema": "kvwire.cost/1", "transport": "tcp", "fitted_on": {"records": 1}, "terms": terms,
           "quantiles": {"p50": terms, "p90": terms}, "error": {"p50_rel": 0.1, "p90_rel": 0.2}}
    path = tmp_path / "cost.json"
    path.write_text(json.dumps(doc))
    return str(path)


def test_pdsep_gate_keeps_short_tails_on_d(make, tmp_path):
    backends, proxy = make
    p, d = backends("ok", "ok")
    d.running = 4  # a local prefill would stall D's running requests
    px = proxy(["--policy", "pdsep", "--cost", cost_file(tmp_path, 1e-3), "--kv-bytes-per-token", "1024",
                "--layers", "2", "--pdsep-min-tokens", "64",
                "--prefill", spec(p, control="h:1"), "--decode", spec(d, control="h:2")])
    assert wait_for(lambda: px.get("/status")[1]["backends"][1]["load"].get("running") == 4)
    assert px.request("/v1/completions", {"prompt": [1] * 10, "max_tokens": 1})[0] == 200  # short: local
    assert not p.bodies and "kv_transfer_params" not in d.bodies[-1]
    first = list(range(500))
    assert px.request("/v1/completions", {"prompt": first, "max_tokens": 1, "user": "s1"})[0] == 200
    # (on failure, the proxy's view: its decisions, the backends' loads and health)
    assert d.bodies[-1]["kv_transfer_params"]["do_remote_prefill"] is True, px.get("/status")[1]
    assert wait_for(lambda: len(p.bodies) == 1)  # P is asked at the same time as D: it may answer later
    # The session's next turn: D holds its first 500 tokens, the uncached tail is 20.
    assert px.request("/v1/completions", {"prompt": first + [7] * 20, "max_tokens": 1, "user": "s1"})[0] == 200
    assert len(p.bodies) == 1 and "kv_transfer_params" not in d.bodies[-1]
    assert px.get("/status")[1]["decisions"] == {"pd": 1, "local": 2}
    bad = proxy(["--policy", "pdsep", "--prefill", spec(p, control="h:1"), "--decode", spec(d, control="h:2")],
                wait=False)
    assert bad.proc.wait(WAIT_S) == 2 and "needs --cost" in bad.proc.stderr.read()


def test_pluggable_policy(make, tmp_path):
    backends, proxy = make
    p, d1, d2 = backends("ok", "ok", "ok")
    (tmp_path / "mypolicy.py").write_text(
        "class Last:\n"
        "    def pick(self, prefill, decode, info):\n"
        "        return prefill[0], decode[-1]\n"
        "def make(options):\n"
        "    return Last()\n")
    env = {"PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    px = proxy(["--policy", "mypolicy:make", "--prefill", spec(p, control="h:1"),
                "--decode", spec(d1, control="h:2"), "--decode", spec(d2, control="h:3")], env=env)
    for _ in range(2):
        assert px.request("/v1/completions", {"prompt": [1], "max_tokens": 1})[0] == 200
    assert not d1.bodies and len(d2.bodies) == 2
    bad = proxy(["--policy", "nosuchmodule:make", "--prefill", spec(p, control="h:1"), "--decode", spec(d1, control="h:2")],
                wait=False)
    assert bad.proc.wait(WAIT_S) == 2 and "nosuchmodule" in bad.proc.stderr.read()


def test_backend_killed_mid_replay_fails_only_its_requests(make, tmp_path):
    """``python -m kvwire.replay`` through the proxy over two D backends; one is killed while it
    streams its third request: the requests that fail are that backend's (that one at least),
    the other's all complete, and the proxy stops sending to the dead one."""
    import threading

    from kvwire.replay.trace import generate

    backends, proxy = make
    p, d1 = backends("ok", "ok")
    (d2,) = backends("ok", hold_at=3)
    px = proxy(["--timeout", "5", "--prefill", spec(p, control="h:1"),
                "--decode", spec(d1, control="h:2"), "--decode", spec(d2, control="h:3")])
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in generate(
        sessions=3, turns=(6, 6), contexts=(10, 50), reuse=0.9, outputs=(2, 3), session_gap_s=0.05,
        think_s=0.1, seed=1)))
    killed = threading.Event()

    def kill():
        if wait_for(lambda: len(d2.bodies) >= 3):  # the third is held mid-stream
            d2.close()
            killed.set()

    th = threading.Thread(target=kill)
    th.start()
    r = subprocess.run([sys.executable, "-m", "kvwire.replay", "run", "--url", f"http://127.0.0.1:{px.port}",
                        "--trace", str(trace), "--out", str(tmp_path / "out"), "--progress", "off"],
                       capture_output=True, text=True, timeout=120)
    th.join(WAIT_S)
    assert killed.is_set()
    recs = px.record_lines()
    assert len(recs) == 18
    failed = [x for x in recs if x["status"] != 200]
    assert all(x["d"] == d2.url for x in failed), failed
    assert all(x["status"] == 200 for x in recs if x["d"] == d1.url)
    with open(tmp_path / "out" / "report.json") as f:
        rep = json.load(f)
    assert rep["overall"]["errors"] == len(failed)
    assert (r.returncode == 1) == bool(failed), r.stdout + r.stderr
    assert len(d1.bodies) == sum(1 for x in recs if x["d"] == d1.url)
    # The first failure marks d2 unhealthy: after it, only requests already routed (at most one
    # per session) still went to d2, every later one to d1.
    assert failed
    first = min(x["arrival_ns"] for x in failed)
    assert sum(1 for x in recs if x["arrival_ns"] > first and x["d"] == d2.url) <= 3, recs


def test_sigterm_lets_the_request_in_flight_finish_and_records_it(make):
    """SIGTERM stops taking requests, but the one streaming finishes (D is released only once the
    proxy said it is stopping), its record is written, and the proxy exits 0."""
    backends, proxy = make
    p, d = backends("ok", "hold")
    px = proxy(["--prefill", spec(p, control="h:1"), "--decode", spec(d, control="h:2")])
    c = http.client.HTTPConnection("127.0.0.1", px.port, timeout=WAIT_S)
    c.request("POST", "/v1/completions", body=json.dumps({"prompt": [1, 2, 3], "max_tokens": 3, "stream": True}))
    r = c.getresponse()
    assert r.status == 200
    assert b"token_ids" in r.readline() + r.readline()  # D's first token came through; D holds
    px.proc.terminate()
    assert "stopping" in px.proc.stdout.readline()
    d.release()
    ids, errors = sse_tokens(r.read())
    c.close()
    assert ids == [3, 4] and not errors  # the rest of the stream (the first token was read above)
    assert px.proc.wait(WAIT_S) == 0
    (rec,) = px.record_lines()
    assert rec["status"] == 200 and rec["error"] is None


def test_sigterm_past_the_grace_cancels_and_still_records(make):
    """A request still in flight when the shutdown grace ends is cancelled (D's and P's requests
    closed) and recorded as failed by the stop, not as a client that went away."""
    backends, proxy = make
    p, d = backends("ok", "hold")
    px = proxy(["--shutdown-grace", "0.5", "--prefill", spec(p, control="h:1"), "--decode", spec(d, control="h:2")])
    c = http.client.HTTPConnection("127.0.0.1", px.port, timeout=WAIT_S)
    c.request("POST", "/v1/completions", body=json.dumps({"prompt": [1, 2], "max_tokens": 3, "stream": True}))
    r = c.getresponse()
    assert r.status == 200
    assert b"token_ids" in r.fp.readline() + r.fp.readline()
    px.proc.terminate()
    assert px.proc.wait(WAIT_S) == 0
    c.close()
    assert wait_for(lambda: d.cancelled == 1)
    (rec,) = px.record_lines()
    assert rec["status"] == 503 and "stopped" in rec["error"], rec
