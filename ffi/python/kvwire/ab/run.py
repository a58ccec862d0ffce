"""Running the A/B: servers per group of arms, one replay per arm, the figures collected."""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import subprocess
import sys
import time
import urllib.request

from kvwire.ab import arms as _arms
from kvwire.ab import engine as _engine
from kvwire.ab.timelines import arm_figures
from kvwire.replay import report as _report
from kvwire.replay.client import Replayer
from kvwire.replay.prompts import PromptBook
from kvwire.replay.trace import generate, read_trace
from kvwire.testing.control import ENV as CONTROL_ENV
from kvwire.testing.control import TOKEN_US_ENV
from kvwire.testing.ports import free_port
from kvwire.testing.servers import Server, ServerError

GROUPS = ("single", "kv_both-mooncake", "kv_both-kvwire", "pd")
READY_S = 900.0


def log(msg: str) -> None:
    print(f"[ab {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def quick_trace() -> list[dict]:
    return generate(sessions=3, turns=(4, 4), contexts=(64, 600), reuse=0.93, outputs=(4, 8),
                    session_gap_s=0.3, think_s=0.2, seed=3)


def cpu_trace() -> list[dict]:
    return generate(sessions=5, turns=(8, 8), contexts=(200, 3000), reuse=0.93, outputs=(8, 32),
                    session_gap_s=1.0, think_s=1.0, seed=5)


class AbRun:
    def __init__(self, opts):
        self.opts = opts
        self.out = os.path.abspath(opts.out)
        os.makedirs(self.out, exist_ok=True)
        self.python = opts.python or sys.executable
        if opts.trace:
            self.trace_path = opts.trace
        else:
            self.trace_path = os.path.join(self.out, "trace.jsonl")
            with open(self.trace_path, "w", encoding="utf-8") as f:
                for rec in (quick_trace() if opts.quick else cpu_trace()):
                    f.write(json.dumps(rec) + "\n")
        self.turns = read_trace(self.trace_path)
        book = PromptBook(opts.vocab, seed=opts.seed)
        self.prompts = [book.prompt(t) for t in self.turns]
        if opts.model:
            self.model = opts.model
        else:
            from kvwire.testing.model import write_model_dir

            self.model = write_model_dir(os.path.join(self.out, "model"))
        self.max_len = max(t.prompt_tokens + t.output_tokens for t in self.turns) + 64

    # ---- servers ----
    def server(self, name: str, kt: dict | None, log_dir: str) -> Server:
        o = self.opts
        env = {"VLLM_SERVER_DEV_MODE": "1"}
        ctl = os.path.join(log_dir, f"control-{name}")
        if not o.model:  # the stand-in's step events give the engine-core step times
            os.makedirs(ctl, exist_ok=True)
            env[CONTROL_ENV] = ctl
            if o.standin_token_us > 0:
                env[TOKEN_US_ENV] = str(o.standin_token_us)
        s = Server(name, self.python, free_port(), self.model, kv_transfer_config=kt, log_dir=log_dir,
                   env=env, block_size=o.block_size,
                   max_model_len=max(self.max_len, 1024), max_num_batched_tokens=o.max_num_batched_tokens,
                   num_blocks=o.num_blocks if not o.model else None, async_scheduling=True, log_stats=True)
        if o.model:  # a real model: vLLM's own worker on the default platform
            for flag, has_value in (("--worker-cls", True), ("--load-format", True), ("--skip-tokenizer-init", False),
                                    ("--enforce-eager", False)):
                if flag in s.cmd:
                    i = s.cmd.index(flag)
                    del s.cmd[i:i + (2 if has_value else 1)]
            s.cmd += ["--tensor-parallel-size", str(o.tensor_parallel_size)]
            s.env.pop("KVWIRE_TEST_CPU_PLATFORM", None)
        s.cmd += shlex.split(o.server_args or "")
        s.events = os.path.join(ctl, "events.jsonl")
        return s

    def group_servers(self, group: str, d: str) -> dict:
        tl = os.path.join(d, "timelines")
        if group == "single":
            return {"main": self.server("single", None, d)}
        if group == "kv_both-mooncake":
            return {"main": self.server("kv_both-mooncake", _arms.mooncake_config(), d)}
        if group == "kv_both-kvwire":
            return {"main": self.server("kv_both-kvwire", _arms.kvwire_config("kv_both", free_port(), free_port(), tl), d)}
        self.p_control, self.d_control = free_port(), free_port()
        return {"p": self.server("p", _arms.kvwire_config("kv_producer", self.p_control, free_port(), tl), d),
                "d": self.server("d", _arms.kvwire_config("kv_consumer", self.d_control, free_port(), tl), d)}

    # ---- one arm ----
    def replay(self, url: str, params: dict, turns=None, prompts=None) -> list:
        extra = {"kv_transfer_params": params} if params else {}
        rp = Replayer(url, "tiny" if not self.opts.model else self.opts.model, time_scale=self.opts.time_scale,
                      timeout=self.opts.timeout, extra=extra)
        return asyncio.run(rp.run(turns or self.turns, prompts or self.prompts))

    def warm_up(self, group: str, servers: dict, d: str) -> dict:
        """Two requests (other prompts than the trace's) before the group's arms, untimed in
        them: a fresh server's first requests pay one-off costs (first connections between P
        and D, first steps). Before and after them, a wait until the servers use no CPU
        (:func:`engine.settle`): start-up work a server still runs once it answers ``/health``
        is neither the warm-up's cold cost nor an arm's. Their time is reported, not hidden."""
        pgids = [s.proc.pid for s in servers.values()]
        before = _engine.settle(pgids)
        turns = self.turns[:2]
        prompts = [PromptBook(self.opts.vocab, seed=self.opts.seed + 1_000_003).prompt(t) for t in turns]
        t0 = time.monotonic()
        if group == "pd":
            wdir = os.path.join(d, "warmup")
            os.makedirs(wdir, exist_ok=True)
            proc, fh, url = self.proxy(wdir, servers)
            try:
                res = self.replay(url, {}, turns, prompts)
            finally:
                self.stop_proxy(proc, fh)
            self.reset_prefix_cache([servers["p"], servers["d"]])
        else:
            res = self.replay(servers["main"].url, {}, turns, prompts)
            self.reset_prefix_cache([servers["main"]])
        out = {"requests": len(res), "errors": sum(1 for r in res if r.error), "seconds": round(time.monotonic() - t0, 2),
               "ttft_s": [r.ttft_s for r in res], "error_samples": [str(r.error)[:300] for r in res if r.error][:2]}
        out["settle_before"], out["settle"] = before, _engine.settle(pgids)
        log(f"group {group}: warm-up {out['seconds']} s, {out['errors']} errors; "
            f"settled before: {before}, after: {out['settle']}"
            + "".join(f"\n  {e}" for e in out["error_samples"]))
        return out

    def proxy(self, d: str, servers: dict):
        port = free_port()
        log_path = os.path.join(d, "proxy.log")
        fh = open(log_path, "w")
        proc = subprocess.Popen([self.python, "-m", "kvwire.proxy", "--port", str(port), "--records", d,
                                 "--wait-ready", "60", "--timeout", str(self.opts.timeout), "--shutdown-grace", "10",
                                 "--prefill", f"{servers['p'].url},control=127.0.0.1:{self.p_control}",
                                 "--decode", f"{servers['d'].url},control=127.0.0.1:{self.d_control}"],
                                stdout=fh, stderr=subprocess.STDOUT)
        end = time.monotonic() + 90
        while time.monotonic() < end and proc.poll() is None:
            with open(log_path) as f:
                if "listening on" in f.read():
                    return proc, fh, f"http://127.0.0.1:{port}"
            time.sleep(0.2)
        proc.kill()
        fh.close()
        with open(log_path) as f:
            raise ServerError(f"the proxy did not start:\n{f.read()[-2000:]}")

    @staticmethod
    def stop_proxy(proc, fh) -> None:
        """SIGTERM: the proxy finishes (and records) what is in flight, then exits; killed if not."""
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        fh.close()

    @staticmethod
    def reset_prefix_cache(servers) -> bool:
        ok = True
        for s in servers:
            for _ in range(50):
                req = urllib.request.Request(s.url + "/reset_prefix_cache", method="POST")
                try:
                    with urllib.request.urlopen(req, timeout=30) as r:
                        if json.loads(r.read() or b"{}").get("success", True):
                            break
                except (OSError, ValueError):
                    pass
                time.sleep(0.2)
            else:
                ok = False
        return ok

    def run_arm(self, arm, servers: dict, d: str) -> dict:
        log(f"arm {arm.name}: replaying {len(self.turns)} requests")
        t0 = time.monotonic()
        figures = {}
        cpu0, ns0 = {n: _engine.snapshot(s.proc.pid) for n, s in servers.items()}, time.monotonic_ns()
        if arm.group == "pd":
            adir = os.path.join(d, arm.name)
            os.makedirs(adir, exist_ok=True)
            proc, fh, url = self.proxy(adir, servers)
            try:
                results = self.replay(url, arm.params)
            finally:
                self.stop_proxy(proc, fh)
            engine = self.engine_figures(servers, cpu0, ns0)
            tids = []
            for name in os.listdir(adir):
                if name.startswith("router"):
                    with open(os.path.join(adir, name)) as f:
                        tids += [json.loads(line)["transfer_id"] for line in f if line.strip()]
            # The connectors write their records from a thread of their own: wait (bounded) for D's
            # record of every request; what is still missing is counted in the figures.
            end = time.monotonic() + 15
            while True:
                figures = arm_figures(os.path.join(d, "timelines"), tids)
                if figures["missing_records"] == 0 or time.monotonic() > end:
                    break
                time.sleep(0.2)
            figures["router_records"] = len(tids)
            figures["reset_prefix_cache"] = self.reset_prefix_cache([servers["p"], servers["d"]])
        else:
            results = self.replay(servers["main"].url, {})
            engine = self.engine_figures(servers, cpu0, ns0)
        rep = _report.summarize(results)
        return {"arm": arm.name, "group": arm.group, "params": arm.params, "status": "ran",
                "seconds": round(time.monotonic() - t0, 1), "replay": rep, "timeline": figures, "engine": engine,
                "outputs": [r.token_ids for r in results], "keys": [(r.session, r.turn) for r in results]}

    @staticmethod
    def engine_figures(servers: dict, cpu0: dict, ns0: int) -> dict:
        """Per server, since ``cpu0``/``ns0`` (the arm's start): CPU by thread and busy step times
        (see :mod:`kvwire.ab.engine`)."""
        ns1 = time.monotonic_ns()
        return {n: {"cpu": _engine.cpu_by_thread(cpu0[n], _engine.snapshot(s.proc.pid)),
                    "steps": _engine.step_figures(_engine.read_steps(s.events), ns0, ns1)}
                for n, s in servers.items()}

    def skip_reason(self, group: str) -> str | None:
        """Why a group cannot run here (said in the report as SKIPPED), or None."""
        if group != "kv_both-mooncake":
            return None
        import importlib.metadata as md
        import importlib.util

        if importlib.util.find_spec("mooncake") is None:
            return "Mooncake's transfer engine is not installed in this venv (tests/python/install_mooncake.sh)"
        version = tuple(int(x) for x in md.version("vllm").split(".")[:2])
        if not self.opts.model and version < (0, 30):
            return (f"vLLM {md.version('vllm')}'s MooncakeConnector asserts the GPU KV layout (block size at "
                    "shape[-3]); the CPU stand-in's layout has the heads there (vLLM 0.33 runs this arm)")
        return None

    # ---- all ----
    def run(self) -> dict:
        chosen = _arms.pick(self.opts.arms)
        rows = []
        for group in GROUPS:
            arms = [a for a in chosen if a.group == group]
            if not arms:
                continue
            why = self.skip_reason(group)
            if why is not None:
                log(f"group {group}: SKIPPED: {why}")
                rows += [{"arm": a.name, "group": group, "params": a.params, "status": "SKIPPED", "error": why}
                         for a in arms]
                continue
            d = os.path.join(self.out, group)
            os.makedirs(d, exist_ok=True)
            servers = self.group_servers(group, d)
            log(f"group {group}: starting {', '.join(s.name for s in servers.values())}")
            try:
                for s in servers.values():
                    s.start()
                for s in servers.values():
                    s.wait_ready(READY_S)
            except ServerError as e:
                for s in servers.values():
                    s.stop()
                log(f"group {group}: servers failed to start")
                rows += [{"arm": a.name, "group": group, "params": a.params, "status": "failed to start",
                          "error": str(e)[-1500:]} for a in arms]
                continue
            try:
                warm = self.warm_up(group, servers, d)
                for a in arms:
                    rows.append({**self.run_arm(a, servers, d), "warmup": warm})
            finally:
                for s in servers.values():
                    s.stop()
        return self.compare(rows)

    def compare(self, rows: list) -> dict:
        ref = next((r for r in rows if r["arm"] == "single" and r["status"] == "ran"), None)
        want = dict(zip(map(tuple, ref["keys"]), ref["outputs"])) if ref else {}
        for r in rows:
            if r["status"] != "ran":
                continue
            got = dict(zip(map(tuple, r.pop("keys")), r.pop("outputs")))
            same = sum(1 for k, v in got.items() if k in want and v and v == want[k])
            r["outputs_equal_single"] = {"equal": same, "of": len(got), "reference": bool(ref)}
        return {"schema": "kvwire.ab/1", "quick": bool(self.opts.quick), "trace": self.trace_path,
                "requests": len(self.turns), "model": self.opts.model or "stand-in (kvwire.testing)",
                "block_size": self.opts.block_size, "standin_token_us": self.opts.standin_token_us,
                "host_cores": os.cpu_count(), "arms": rows}
