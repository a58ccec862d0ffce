"""kvwire where users run it: real ``vllm serve`` processes on CPU (API server, engine-core
process, unmodified scheduler), KvwireConnector loaded by ``kv_connector_module_path``, requests
over HTTP with ``kv_transfer_params``.

Four servers for the module: ``single`` (no connector: the reference instance), ``P``
(kv_producer), ``D`` (kv_consumer) and ``DS`` (kv_consumer whose cache takes the staged path a
CUDA cache takes: ``staging: always``, P writes into its bounded landing pool and its workers copy
each layer into the KV blocks as it lands), all with the stand-in worker of :mod:`kvwire.testing`,
whose next token is read from the KV in the cache: D's output equals the single instance's only
if every byte D received is right. ``single``, P and D run vLLM's in-process executor, as vLLM
runs one GPU; DS runs its multiprocess one (the worker, and the connector's worker side, in a
process of its own, as at tensor parallelism > 1). Async scheduling follows
``KVWIRE_E2E_ASYNC`` (1: on, vLLM's default; 0: off); ``tests/e2e/run.sh`` runs both on both
vLLM versions.

Every wait below is bounded so that a hang fails the test; none is an assertion about speed.
"""

from __future__ import annotations

import glob
import http.client
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading

import pytest

from kvwire.ab.engine import group_pids
from kvwire.testing.control import Control
from kvwire.testing.model import write_model_dir
from kvwire.testing.servers import Server, ServerError, free_port, reference
from kvwire.testing.wait import wait_for as _wait_for

ASYNC = os.environ.get("KVWIRE_E2E_ASYNC", "1") == "1"
BATCHED = 512  # max_num_batched_tokens: longer prompts are prefilled in chunks
LONG = 1500  # three chunks
POLICIES = ("eager", "lazy", "jit", "land")
MODES = ("whole", "layerwise")
WAIT_S = 180.0
MAX_MODEL_LEN = 4096


def wait_for(cond, timeout=WAIT_S, step=0.2):
    return _wait_for(cond, timeout, step)


class Cluster:
    def __init__(self, root: str):
        py = sys.executable
        self.root = root
        self.model = write_model_dir(os.path.join(root, "model"))
        self.timelines = os.path.join(root, "timelines")
        self.p_ctl, self.d_ctl = Control(os.path.join(root, "p-ctl")), Control(os.path.join(root, "d-ctl"))
        self.ds_ctl = Control(os.path.join(root, "ds-ctl"))
        self.p_control, self.d_control, self.ds_control = free_port(), free_port(), free_port()
        self.bootstrap = free_port()
        common = {"async_scheduling": ASYNC, "log_dir": root, "max_num_batched_tokens": BATCHED,
                  "num_blocks": 512, "max_model_len": MAX_MODEL_LEN, "log_stats": True}

        def kt(role, ctl, **extra):
            return {"kv_connector": "KvwireConnector", "kv_connector_module_path": "kvwire.vllm", "kv_role": role,
                    "kv_connector_extra_config": {"control_listen": f"127.0.0.1:{ctl}",
                                                  "data_listen": f"127.0.0.1:{free_port()}",
                                                  "timeline_path": self.timelines,
                                                  "heartbeat_interval": 0.5, "connect_timeout": 60, **extra}}

        self.single = Server("single", py, free_port(), self.model, **common)
        self.p = Server("p", py, free_port(), self.model,
                        kv_transfer_config={**kt("kv_producer", self.p_control, bootstrap_port=self.bootstrap),
                                            "engine_id": "e2e-p"},
                        env=self.p_ctl.env(), **common)
        self.d = Server("d", py, free_port(), self.model,
                        kv_transfer_config=kt("kv_consumer", self.d_control, land_pool_blocks=128, bootstrap_port=0),
                        env=self.d_ctl.env(), **common)
        self.ds = Server("ds", py, free_port(), self.model,
                         kv_transfer_config=kt("kv_consumer", self.ds_control, staging="always", land_pool_blocks=128,
                                               bootstrap_port=0),
                         env=self.ds_ctl.env(), args=["--distributed-executor-backend", "mp"], **common)
        self.servers = [self.single, self.p, self.d, self.ds]
        self._ref: dict[tuple, list] = {}

    def start(self):
        for s in self.servers:
            s.start()
        for s in self.servers:
            s.wait_ready(600)

    def stop(self):
        for s in self.servers:
            s.stop()

    def single_output(self, prompt, n):
        k = (tuple(prompt), n)
        if k not in self._ref:
            self._ref[k] = self.single.complete(prompt, n)["tokens"]
        return self._ref[k]

    def pd(self, prompt, tid, policy="lazy", mode="layerwise", n=5, d_extra=None, timeout=120.0,
           p_extra=None, d_request_id=None, staged=False):
        """One P/D request as a router sends it: P (max_tokens 1) and D (``staged``: DS) at once."""
        res = {}
        d_server, d_control = (self.ds, self.ds_control) if staged else (self.d, self.d_control)

        def to_p():
            try:
                res["p"] = self.p.complete(prompt, 1, {"do_remote_decode": True, "transfer_id": tid,
                                                       "remote_control": f"127.0.0.1:{d_control}",
                                                       "kvwire_send_mode": mode, **(p_extra or {})},
                                         timeout=timeout)
            except (ServerError, OSError) as e:
                res["p_error"] = e

        th = threading.Thread(target=to_p)
        th.start()
        try:
            d = d_server.complete(prompt, n, {"do_remote_prefill": True, "transfer_id": tid,
                                            "remote_control": f"127.0.0.1:{self.p_control}",
                                            "kvwire_policy": policy, **(d_extra or {})}, timeout=timeout,
                                request_id=d_request_id)
        finally:
            th.join(timeout + 10)
        return d["tokens"], res

    def d_idle(self, staged=False):
        """D (``staged``: DS) holds no block for kvwire and has no kvwire request. A short local
        request first makes it step (an idle engine publishes no stats), so its gauges are
        current."""
        d = self.ds if staged else self.d
        try:
            d.complete([5, 6, 7], 2)
            return (d.metric("vllm:kvwire_d_held_blocks") == 0.0
                    and d.metric("vllm:kvwire_d_requests") == 0.0
                    and d.metric("vllm:kvwire_d_landing_slots") == 0.0)
        except (KeyError, OSError, ServerError):
            return False


@pytest.fixture(scope="module")
def cluster():
    root = tempfile.mkdtemp(prefix="kvwire-e2e-")
    c = Cluster(root)
    try:
        c.start()
        yield c
    except ServerError as e:
        pytest.fail(str(e))
    finally:
        c.stop()


def worker_processes(server):
    """How many of the server's processes are vLLM model-worker processes (named by vLLM)."""
    names = []
    for pid in group_pids(server.proc.pid):
        try:
            with open(f"/proc/{pid}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            pass
    return names.count("VLLM::Worker")


def prompt_of(n, seed):
    return [20 + (j * 7 + seed * 13) % 900 for j in range(n)]


def test_each_server_runs_the_executor_asked_for(cluster):
    # vLLM's CPU platform would move every worker into a process of its own (0.33), which then
    # spins between steps; the stand-in platform keeps the in-process executor a one-GPU server
    # runs, unless the server asked for the multiprocess one (DS).
    assert [worker_processes(s) for s in (cluster.single, cluster.p, cluster.d, cluster.ds)] == [0, 0, 0, 1]


def test_single_instance_is_the_model(cluster):
    """The reference instance generates what the stand-in model says (so the comparisons below
    compare against something known)."""
    p = prompt_of(LONG, 99)
    assert cluster.single_output(p, 5) == reference(p, 5)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("policy", POLICIES)
def test_d_output_equals_single_instance(cluster, policy, mode):
    seed = POLICIES.index(policy) * 10 + MODES.index(mode)
    for n in (40, LONG):  # LONG > max_num_batched_tokens: P prefills it in chunks
        prompt = prompt_of(n, seed)
        got, res = cluster.pd(prompt, f"o-{policy}-{mode}-{n}-{ASYNC}", policy, mode)
        assert "p_error" not in res, res
        assert got == cluster.single_output(prompt, 5), (policy, mode, n)
    assert wait_for(cluster.d_idle), "D holds blocks after its requests ended"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("policy", POLICIES)
def test_staged_d_output_equals_single_instance(cluster, policy, mode):
    """The same through DS, whose KV cache takes a CUDA cache's staged path: P writes into its
    landing pool (a quarter of its cache), its workers copy the slots into the KV blocks."""
    seed = 500 + POLICIES.index(policy) * 10 + MODES.index(mode)
    for n in (40, LONG):
        prompt = prompt_of(n, seed)
        got, res = cluster.pd(prompt, f"os-{policy}-{mode}-{n}-{ASYNC}", policy, mode, staged=True)
        assert "p_error" not in res, res
        assert got == cluster.single_output(prompt, 5), (policy, mode, n)
    assert wait_for(lambda: cluster.d_idle(staged=True)), "DS holds blocks or slots after its requests ended"


def test_corrupted_transfer_changes_output(cluster):
    """One byte flipped in D's received KV (the stand-in's test hook) changes D's output: the
    comparisons above can fail."""
    prompt = prompt_of(200, 77)
    got, _ = cluster.pd(prompt, f"corrupt-{ASYNC}", "lazy", "layerwise", d_extra={"kvwire_test_corrupt": True})
    assert any(e.get("ev") == "corrupt" for e in cluster.d_ctl.events("corrupt"))
    assert got != cluster.single_output(prompt, 5)


def test_burst_then_idle_p_every_request_completes(cluster):
    """Eight P/D requests at once; the last one completes with P idle afterwards (no later step
    on P carries it)."""
    out = {}

    def one(i):
        prompt = prompt_of(300 + 40 * i, 200 + i)
        try:
            out[i] = (cluster.pd(prompt, f"burst-{i}-{ASYNC}", POLICIES[i % 4], MODES[i % 2])[0], prompt)
        except (ServerError, OSError) as e:
            out[i] = (e, prompt)

    ths = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in ths:
        t.start()
    for t in ths:
        t.join(300)
    assert sorted(out) == list(range(8))
    for i, (got, prompt) in out.items():
        assert got == cluster.single_output(prompt, 5), (i, got)
    assert wait_for(cluster.d_idle)


def test_prefix_hit_on_d_receives_only_the_suffix(cluster):
    """A second turn extends the first: D's prefix cache holds the first turn's full blocks, P
    sends exactly the rest (counted in bytes on D), and the output still equals the single
    instance's."""
    base = prompt_of(1200, 300)
    a, _ = cluster.pd(base, f"turn1-{ASYNC}", "lazy", "layerwise")
    assert a == cluster.single_output(base, 5)
    nxt = base + a + prompt_of(300, 301)
    before = cluster.d.metric("vllm:kvwire_d_received_bytes_total")
    b, _ = cluster.pd(nxt, f"turn2-{ASYNC}", "lazy", "layerwise")
    assert b == cluster.single_output(nxt, 5)
    assert wait_for(lambda: cluster.d.metric("vllm:kvwire_d_received_bytes_total") > before)
    got = cluster.d.metric("vllm:kvwire_d_received_bytes_total") - before
    block_bytes = 2 * 2 * 16 * 2 * 16 * 2  # layers x (K, V) x block x kv heads x head dim x bf16
    whole = -(-len(nxt) // 16) * block_bytes
    cached = (len(base) // 16) * block_bytes  # full blocks of turn 1's prompt stay in D's cache
    print(f"prefix hit: D received {got} B of {whole} B, {cached} B cached")
    assert got == whole - cached, (got, whole, cached)  # exactly the blocks it lacked


def in_thread(fn, *args, **kw):
    """Starts ``fn(*args, **kw)`` in a thread; returns the thread and a dict that gets its result
    under ``"value"``, or a server or socket error under ``"error"``."""
    out = {}

    def run():
        try:
            out["value"] = fn(*args, **kw)
        except (ServerError, OSError) as e:
            out["error"] = e

    th = threading.Thread(target=run)
    th.start()
    return th, out


def step_indexes(ctl, tag):
    """Positions, in the worker's event order, of the steps that computed tokens of the request
    tagged ``tag``."""
    return [i for i, e in enumerate(ctl.events("step"))
            if e.get("tokens", 0) > 0 and any(tag in str(r) for r in e.get("reqs", []))]


def steps_of(ctl, tag):
    """How many steps of the stand-in worker computed tokens of the request tagged ``tag``."""
    return len(step_indexes(ctl, tag))


def test_prefix_hit_never_writes_a_cached_block_a_running_request_reads(cluster):
    """P's block 0 of turn 2 is wrong on purpose (one byte flipped on P after its layer 0 was
    computed, before it was handed to the connector). D has turn 1's blocks cached and a local
    request decodes over them (it shares them) while turn 2 lands: both outputs equal the single
    instance's, so P never wrote D's cached block 0. The same flip without the prefix hit changes
    D's output: the check can fail."""
    tag = f"cachedreader{int(ASYNC)}"
    fresh = prompt_of(400, 321)
    got, _ = cluster.pd(fresh, f"flip-sent-{ASYNC}", "lazy", "layerwise", p_extra={"kvwire_test_corrupt_sent": True})
    assert any(e.get("what") == "sent" for e in cluster.p_ctl.events("corrupt"))
    assert got != cluster.single_output(fresh, 5), "the flipped byte P sent did not change D's output"
    base = prompt_of(1200, 322)
    a, _ = cluster.pd(base, f"hit1-{ASYNC}", "lazy", "layerwise")
    assert a == cluster.single_output(base, 5)
    shared = base + a
    # The reader decodes as long as the model length lets it (about 2900 steps), to outlast
    # turn 2, which needs a few of D's steps; the step order below checks it did (1500 steps
    # once ended just before turn 2's first one, in a CI run).
    n_reader = MAX_MODEL_LEN - len(shared) - 16
    th, out = in_thread(cluster.d.complete, shared, n_reader, request_id=tag, timeout=WAIT_S)
    try:
        assert wait_for(lambda: steps_of(cluster.d_ctl, tag) > 1), "the reader does not run"
        nxt = shared + prompt_of(300, 323)
        b, res = cluster.pd(nxt, f"hit2-{ASYNC}", "lazy", "layerwise",
                            p_extra={"kvwire_test_corrupt_sent": True}, d_request_id=f"hittwo{int(ASYNC)}")
    finally:
        th.join(WAIT_S)
    assert "p_error" not in res, res
    assert b == cluster.single_output(nxt, 5), "D's cached block was written"
    assert "error" not in out, out
    reader, turn2 = step_indexes(cluster.d_ctl, tag), step_indexes(cluster.d_ctl, f"hittwo{int(ASYNC)}")
    assert turn2 and reader[0] < turn2[0] < reader[-1], "the reader did not run across turn 2"
    assert out["value"]["tokens"] == cluster.single_output(shared, n_reader), "the reader read a changed block"
    assert wait_for(cluster.d_idle)


def poke(server):
    """A short local request: the engine steps (its worker runs the control directory's probe,
    its scheduler publishes current gauges). True if it answered."""
    try:
        server.complete([5, 6, 7], 1)
        return True
    except (OSError, ServerError):
        return False


LEAD_POLICIES = ("eager", "lazy", "land")


def landing_copies(server) -> float:
    """Layers the server's workers copied out of its landing pool while later layers of the
    request were still landing (0 before the first)."""
    try:
        return server.metric("vllm:kvwire_d_landing_copied_layers_total", {"when": "landing"})
    except KeyError:
        return 0.0


@pytest.mark.parametrize("staged", [False, True], ids=["d", "ds"])
@pytest.mark.parametrize("policy", LEAD_POLICIES)
def test_layer0_of_chunk0_lands_before_p_ends_its_last_chunk(cluster, policy, staged):
    """A prompt of three chunks on P, layerwise. P's worker is held inside its last chunk's
    forward, before that chunk's last layer; meanwhile D's worker finds layer 0 of the first
    chunk's first block (its K/V, every element compared) in a KV block, or in a landing slot for
    land: it landed before P's forward ended, for lazy and land as for eager (D's reservation or
    slots reached P's workers in time). Then, still held: land holds no KV block for the request
    (only landing slots: its blocks are taken at KV-complete), eager and lazy hold theirs. After
    the release every byte lands (D's output equals the single instance's) and D holds nothing.
    Through DS too (``staged``): there P writes into the landing pool whatever the policy (eager
    and lazy hold slots beside their KV blocks), and for eager and lazy DS's workers copied layer
    0 into the KV block before layer 1 landed."""
    prompt = prompt_of(LONG, 800 + LEAD_POLICIES.index(policy) + 10 * staged)
    tid = f"lead-{policy}-{int(staged)}-{ASYNC}"
    p_ctl, d_ctl = cluster.p_ctl, (cluster.ds_ctl if staged else cluster.d_ctl)
    d_server = cluster.ds if staged else cluster.d
    copied_before = landing_copies(d_server) if staged else 0.0
    held = p_ctl.held(1)
    p_ctl.hold(1, last_chunk=True)
    # DS: the bytes are in a landing slot first whatever the policy; look where they go next
    d_ctl.probe(tid, prompt[:16], 0, "cache" if staged and policy != "land" else None)
    th, out = in_thread(cluster.pd, prompt, tid, policy, "layerwise", staged=staged)
    try:
        p_ctl.wait_held(1, held + 1)
        # P is inside its last chunk's forward: layer 0 computed, layer 1 not.
        assert wait_for(lambda: poke(d_server) and d_ctl.found(tid)), \
            f"{policy}: layer 0 of chunk 0 is not on D while P runs its last chunk"
        where = {f["in"] for f in d_ctl.found(tid)}
        assert where == ({"landing"} if policy == "land" else {"cache"}), (policy, d_ctl.found(tid))
        # D's gauges, both from one snapshot, once it shows the request (they are published at
        # most every stats_interval): land's in slots only, the others' in KV blocks.
        seen = {}

        def shown():
            if not poke(d_server):
                return False
            text = d_server.metrics()
            seen.update(blocks=d_server.metric("vllm:kvwire_d_held_blocks", text=text),
                        slots=d_server.metric("vllm:kvwire_d_landing_slots", text=text))
            return seen["blocks"] + seen["slots"] > 0

        assert wait_for(shown), seen
        if policy == "land":
            assert seen["blocks"] == 0 and seen["slots"] > 0, seen
        else:  # DS: its KV blocks, and the slots P writes into
            assert seen["blocks"] > 0 and (seen["slots"] > 0) == staged, seen
        assert p_ctl.held(1) == held + 1 and th.is_alive()  # still inside that forward
    finally:
        p_ctl.release(1)
        d_ctl.end_probe()
        th.join(WAIT_S)
    assert "error" not in out, out
    got, res = out["value"]
    assert "p_error" not in res, res
    assert got == cluster.single_output(prompt, 5), policy
    assert wait_for(lambda: cluster.d_idle(staged))
    if staged and policy != "land":  # layer 0's copy was counted while layer 1 was still held
        assert wait_for(lambda: poke(d_server) and landing_copies(d_server) > copied_before)


def test_mooncake_connector_params_drive_it_unchanged(cluster):
    """A router written for vLLM's MooncakeConnector: P gets only ``do_remote_decode`` and the
    transfer id, D finds P through ``remote_bootstrap_addr`` and ``remote_engine_id``."""
    prompt = prompt_of(700, 600)
    tid = f"mc-{ASYNC}"
    res = {}

    def to_p():
        res["p"] = cluster.p.complete(prompt, 1, {"do_remote_decode": True, "transfer_id": tid})

    th = threading.Thread(target=to_p)
    th.start()
    d = cluster.d.complete(prompt, 5, {"do_remote_prefill": True, "transfer_id": tid, "remote_engine_id": "e2e-p",
                                       "remote_bootstrap_addr": f"http://127.0.0.1:{cluster.bootstrap}"})
    th.join(130)
    assert "p" in res
    assert d["tokens"] == cluster.single_output(prompt, 5)
    assert wait_for(cluster.d_idle)


class Proc:
    """A ``python -m kvwire.<tool>`` child process, its output in a log file."""

    def __init__(self, root, name, args):
        self.log = os.path.join(root, f"{name}.log")
        self.fh = open(self.log, "w")
        self.p = subprocess.Popen([sys.executable, "-m", *args], stdout=self.fh, stderr=subprocess.STDOUT)

    def text(self):
        self.fh.flush()
        with open(self.log) as f:
            return f.read()

    def stop(self):
        if self.p.poll() is None:
            self.p.terminate()
            try:
                self.p.wait(20)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait(20)
        self.fh.close()


@pytest.fixture(scope="module")
def proxy(cluster):
    """``python -m kvwire.proxy`` in front of the cluster's P and D, its router records written
    beside the connectors' timelines; yields its URL."""
    port = free_port()
    proc = Proc(cluster.root, "proxy", [
        "kvwire.proxy", "--port", str(port), "--records", cluster.timelines, "--wait-ready", "30",
        "--prefill", f"{cluster.p.url},control=127.0.0.1:{cluster.p_control}",
        "--decode", f"{cluster.d.url},control=127.0.0.1:{cluster.d_control}"])
    try:
        assert wait_for(lambda: "listening on" in proc.text() or proc.p.poll() is not None, 60), proc.text()
        assert proc.p.poll() is None, proc.text()
        proc.url, proc.port = f"http://127.0.0.1:{port}", port
        yield proc
    finally:
        proc.stop()


def router_records(cluster):
    out = []
    for fn in glob.glob(os.path.join(cluster.timelines, "router-*.jsonl")):
        with open(fn) as f:
            out += [json.loads(line) for line in f if line.strip()]
    return out


def test_proxy_replays_an_agentic_trace_every_output_checked(cluster, proxy):
    """``python -m kvwire.replay`` replays 50 turns of 5 sessions (later turns extend the earlier
    prompts) through the proxy, streamed: every output equals what the model generates for its
    prompt, the proxy wrote a router record per request (the calibration test below joins them
    with the connectors' timelines), and D holds nothing afterwards."""
    from kvwire.replay.trace import generate

    trace = os.path.join(cluster.root, "trace.jsonl")
    with open(trace, "w") as f:
        for rec in generate(sessions=5, turns=(10, 10), contexts=(100, 1000), reuse=0.93, outputs=(2, 6),
                            session_gap_s=0.5, think_s=0.3, seed=7):
            f.write(json.dumps(rec) + "\n")
    out = os.path.join(cluster.root, "replay")
    r = subprocess.run([sys.executable, "-m", "kvwire.replay", "run", "--url", proxy.url,
                        "--trace", trace, "--out", out, "--progress", "off"],
                       capture_output=True, text=True, timeout=600)
    print(r.stdout)
    assert r.returncode == 0, r.stdout + r.stderr + proxy.text()[-3000:]
    with open(os.path.join(out, "results.jsonl")) as f:
        results = [json.loads(line) for line in f]
    assert len(results) == 50 and len({r["session"] for r in results}) == 5
    for res in results:
        assert res["error"] is None, res["error"]
        assert res["token_ids"] == reference(res["prompt_ids"], res["output_tokens"]), (res["session"], res["turn"])
    with open(os.path.join(out, "report.json")) as f:
        rep = json.load(f)
    assert rep["overall"]["requests"] == 50 and rep["overall"]["errors"] == 0
    assert rep["overall"]["ttft_s"]["p50"] is not None
    routers = router_records(cluster)
    assert len(routers) == 50
    assert all(x["status"] == 200 and x["first_token_ns"] and x["p"] == cluster.p.url for x in routers)
    assert wait_for(cluster.d_idle)


def idle_engine(server):
    """No request running or waiting, no KV block in use (a local request first makes it step:
    an idle engine publishes no stats)."""
    try:
        server.complete([5, 6, 7], 2)
        busy = server.metric("vllm:num_requests_running") + server.metric("vllm:num_requests_waiting")
        try:
            usage = server.metric("vllm:kv_cache_usage_perc")
        except KeyError:
            usage = server.metric("vllm:gpu_cache_usage_perc")
        return busy == 0 and usage == 0
    except (KeyError, OSError, ServerError):
        return False


def test_client_gone_mid_stream_through_the_proxy_frees_p_and_d(cluster, proxy):
    """A client that reads D's first token through the proxy and hangs up: D aborts the request
    (the proxy's connection to it closed), and both engines end with no request and no block."""
    n_before = len(router_records(cluster))
    gen_before = cluster.d.metric("vllm:generation_tokens_total")
    prompt = [(i * 7) % 900 + 10 for i in range(600)]
    c = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=WAIT_S)
    c.request("POST", "/v1/completions", json.dumps({
        "model": "tiny", "prompt": prompt, "max_tokens": 3000, "temperature": 0, "ignore_eos": True,
        "stream": True, "return_token_ids": True}).encode(), {"Content-Type": "application/json"})
    r = c.getresponse()
    assert r.status == 200
    line = b""
    while b"token_ids" not in line:
        line = r.fp.readline()
        assert line, "the stream ended before its first token"
    c.sock.shutdown(socket.SHUT_RDWR)
    c.close()
    assert wait_for(lambda: len(router_records(cluster)) == n_before + 1)
    assert router_records(cluster)[-1]["status"] == 499
    assert wait_for(lambda: idle_engine(cluster.d) and idle_engine(cluster.p))
    assert wait_for(cluster.d_idle)
    # Aborted, not run to its end: D generated far fewer than the 3000 tokens asked for.
    assert cluster.d.metric("vllm:generation_tokens_total") - gen_before < 1500


def test_timelines_written_and_calibrated(cluster):
    """Both engines wrote their timelines; ``kvwire-bench calibrate --timeline DIR`` joins P's
    and D's records and fits them (it prints its held-out error)."""
    assert wait_for(lambda: glob.glob(os.path.join(cluster.timelines, "*p*.jsonl"))
                    and glob.glob(os.path.join(cluster.timelines, "*d*.jsonl")))
    recs = []
    for f in glob.glob(os.path.join(cluster.timelines, "*.jsonl")):
        with open(f) as fh:
            recs += [json.loads(line) for line in fh if line.strip()]
    assert {r.get("role") for r in recs} >= {"p", "d"}
    # The loads each side knew when the request arrived, and what P's prefix cache held: the
    # model's queue and prefill inputs.
    ps = [r for r in recs if r.get("role") == "p" and r.get("outcome") == "finished"]
    ds = [r for r in recs if r.get("role") == "d" and r.get("outcome") == "finished"]
    assert ps and ds
    for r in ps:
        assert r["p_waiting"] >= 1 and r["p_running"] >= 0 and r["p_queued_tokens"] >= 0, r
        assert 0 <= r["p_cached_tokens"] <= r["tokens"], r
    for r in ds:
        assert r["d_waiting"] >= 1 and r["d_running"] >= 0, r
    bench = os.environ.get("KVWIRE_BENCH_BIN")
    if not bench or not os.path.exists(bench):
        pytest.fail(f"KVWIRE_BENCH_BIN={bench!r}: no kvwire-bench binary (tests/e2e/run.sh builds one)")
    out = os.path.join(cluster.root, "cost.json")
    r = subprocess.run([bench, "calibrate", "--timeline", cluster.timelines, "--out", out],
                       capture_output=True, text=True, timeout=300)
    print(r.stdout)
    assert r.returncode == 0, r.stdout + r.stderr
    # The proxy tests' router records are joined with D's by transfer id.
    routers = len(router_records(cluster))
    if routers:
        m = re.search(r"router: (\d+) records, (\d+) matched", r.stdout + r.stderr)
        assert m and int(m.group(1)) == routers and int(m.group(2)) >= 50, r.stdout + r.stderr
    with open(out) as f:
        model = json.load(f)
    assert model, "empty cost model"


class Blackhole:
    """A TCP address that drops connection attempts instead of refusing them: a listener that
    never accepts, its accept queue full, so the kernel drops every further SYN (as a
    partitioned or powered-off host does)."""

    def __init__(self):
        self.ls = socket.socket()
        self.ls.bind(("127.0.0.1", 0))
        self.ls.listen(0)
        self.addr = "127.0.0.1:%d" % self.ls.getsockname()[1]
        self.fill = []
        for _ in range(4):  # fills the queue (one entry at backlog 0); the rest wait in SYN_SENT
            c = socket.socket()
            c.setblocking(False)
            c.connect_ex(self.ls.getsockname())
            self.fill.append(c)
        probe = socket.socket()
        probe.settimeout(2.0)
        try:
            probe.connect(self.ls.getsockname())
            raise AssertionError("the blackhole accepted a connection")
        except socket.timeout:
            pass  # dropped, not refused: what a blackholed peer looks like
        finally:
            probe.close()

    def close(self):
        for c in self.fill:
            c.close()
        self.ls.close()


class Pending:
    """A completion sent over its own connection and left waiting; ``cancel`` closes the
    connection (vLLM aborts a request whose client went away)."""

    def __init__(self, server, prompt, n, params, request_id):
        self.conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=WAIT_S)
        body = {"model": "tiny", "prompt": list(prompt), "max_tokens": n, "temperature": 0,
                "return_token_ids": True, "ignore_eos": True, "kv_transfer_params": params}
        self.conn.request("POST", "/v1/completions", json.dumps(body).encode(),
                          {"Content-Type": "application/json", "X-Request-Id": request_id})
        self.result = None
        self.th = threading.Thread(target=self._wait)
        self.th.start()

    def _wait(self):
        try:
            r = self.conn.getresponse()
            self.result = (r.status, r.read()[:300])
        except (OSError, http.client.HTTPException) as e:
            self.result = e

    def done(self):
        return not self.th.is_alive()

    def cancel(self):
        try:
            self.conn.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.conn.close()
        self.th.join(WAIT_S)


def test_blackholed_peer_costs_no_steps(cluster):
    """A peer whose address drops packets (not refuses them): D holds a request whose P is
    blackholed, P prefills one whose D is blackholed; meanwhile a local request on each takes as
    many steps as it took before (counted, not timed) and completes while the blackholed request
    is still pending on D (it cannot end before D's 60 s wait-for-P) and before either side's
    first dial of the blackhole gave up (60 s connect_timeout): a step that waited on the network
    would have let that dial end first. Nothing is left once the client gives up."""
    bh = Blackhole()
    local = prompt_of(64, 700)
    try:
        for srv, ctl, side in ((cluster.d, cluster.d_ctl, "d"), (cluster.p, cluster.p_ctl, "p")):
            assert srv.complete(local, 8, request_id=f"bhbase{side}{int(ASYNC)}")["tokens"] == cluster.single_output(local, 8)
        base = {"d": steps_of(cluster.d_ctl, f"bhbased{int(ASYNC)}"), "p": steps_of(cluster.p_ctl, f"bhbasep{int(ASYNC)}")}
        assert base["d"] > 0 and base["p"] > 0, base
        hung = Pending(cluster.d, prompt_of(300, 701), 5,
                       {"do_remote_prefill": True, "transfer_id": f"bh-d-{ASYNC}", "remote_control": bh.addr,
                        "kvwire_policy": "lazy"}, f"bhhung{int(ASYNC)}")
        try:
            # P's request ends after its prefill; its KV waits for block ids that cannot come.
            p_out = cluster.p.complete(prompt_of(300, 702), 1, {"do_remote_decode": True, "transfer_id": f"bh-p-{ASYNC}",
                                                                 "remote_control": bh.addr})
            assert p_out["tokens"], p_out
            for srv, ctl, side in ((cluster.d, cluster.d_ctl, "d"), (cluster.p, cluster.p_ctl, "p")):
                tag = f"bhlocal{side}{int(ASYNC)}"
                assert srv.complete(local, 8, request_id=tag)["tokens"] == cluster.single_output(local, 8)
                assert steps_of(ctl, tag) == base[side], (side, steps_of(ctl, tag), base[side])
                # Its first dial of the blackhole (60 s connect_timeout) has not given up yet: no
                # step waited for it.
                assert f"cannot reach {bh.addr}" not in srv.log_tail(200000), side
            assert not hung.done(), f"the blackholed request ended: {hung.result}"
            assert cluster.d.metric("vllm:num_requests_waiting") >= 1.0  # D's scheduler still holds it
        finally:
            hung.cancel()
        assert wait_for(cluster.d_idle), "D holds the blackholed request after its client left"
    finally:
        bh.close()


def test_p_stalled_past_peer_timeout_is_not_fenced(cluster):
    """P's whole server stalls (SIGSTOP) while it holds an eager request's layer 1, longer than
    D's peer_timeout: D fails the request but keeps its blocks (P has their ids and may still
    write) until P, resumed, confirms; P is not given up for its silence, so the next request
    from P lands (a fenced P would fail it) and equals the single instance's output."""
    ctl = cluster.p_ctl
    warm = prompt_of(100, 519)  # P and D know each other before P stalls
    assert cluster.pd(warm, f"stall-warm-{ASYNC}", "eager", "layerwise")[0] == cluster.single_output(warm, 5)
    given_up = cluster.d.log_tail(10**6).count("given up")
    held = ctl.held(1)
    ctl.hold(1)
    th, res = in_thread(cluster.pd, prompt_of(LONG, 520), f"stall-{ASYNC}", "eager", "layerwise", timeout=150)
    paused = False
    try:
        ctl.wait_held(1, held + 1)
        cluster.p.pause()
        paused = True

        def draining():
            try:
                cluster.d.complete([5, 6, 7], 2)  # D steps, so its gauges are current
                return cluster.d.metric("vllm:kvwire_d_requests", {"state": "draining"}) == 1.0
            except (KeyError, OSError, ServerError):
                return False

        # D's peer_timeout (15 s) passes: the request fails, its blocks wait for P.
        assert wait_for(draining, 90), "D did not give the stalled P's request up"
        assert th.is_alive(), f"D answered before P confirmed: {res}"
    finally:
        if paused:
            cluster.p.resume()
        ctl.release(1)
    th.join(200)
    assert not th.is_alive(), "D's client still waiting"
    assert "error" in res and "HTTP" in str(res["error"]), res
    assert wait_for(cluster.d_idle), "D holds blocks after P confirmed"
    assert cluster.d.log_tail(10**6).count("given up") == given_up, cluster.d.log_tail(40)
    prompt = prompt_of(LONG, 521)
    got, res = cluster.pd(prompt, f"after-stall-{ASYNC}", "eager", "layerwise")
    assert "p_error" not in res, res
    assert got == cluster.single_output(prompt, 5)
    assert wait_for(cluster.d_idle)


def test_p_killed_mid_request_then_restarted(cluster):
    """P's server is killed (SIGKILL to its process group) while it holds a request's layer 1:
    D's client gets an error, not a hang; D holds no block afterwards and still serves its own
    requests. Then P starts again on the same ports (a new incarnation, at an address D last
    found unreachable): D dials it afresh and takes its writes again, under every policy, and the
    outputs of requests whose blocks D reused equal the single instance's (the stand-in reads its
    next token from every KV byte, so a stale write of the dead P would show). Runs last."""
    ctl = cluster.p_ctl
    held = ctl.held(1)
    ctl.hold(1)
    prompt = prompt_of(LONG, 500)
    th, res = in_thread(cluster.pd, prompt, f"kill-{ASYNC}", "eager", "layerwise", timeout=150)
    try:
        ctl.wait_held(1, held + 1)
        cluster.p.kill()
    finally:
        ctl.release(1)
    th.join(200)
    assert not th.is_alive(), "D's client still waiting"
    assert "error" in res, f"D answered although P died: {res.get('value')}"
    assert "HTTP" in str(res["error"]), res["error"]  # the server answered with an error status
    assert wait_for(cluster.d_idle), "D holds blocks after P died"
    local = prompt_of(100, 501)
    assert cluster.d.complete(local, 5)["tokens"] == cluster.single_output(local, 5)
    cluster.p.start()
    cluster.p.wait_ready(600)
    for i, policy in enumerate(("eager", "lazy", "land", "jit")):
        prompt = prompt_of(LONG, 510 + i)
        got, res = cluster.pd(prompt, f"after-restart-{i}-{ASYNC}", policy, "layerwise")
        assert "p_error" not in res, res
        assert got == cluster.single_output(prompt, 5), policy
    assert wait_for(cluster.d_idle)
