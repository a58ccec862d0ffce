"""Starting real ``vllm serve`` processes with the stand-in worker, and talking to them over HTTP.

Test-only. A :class:`Server` is one ``vllm serve`` (API server, engine-core process, worker
processes) in its own process group, on the CPU platform of :mod:`kvwire.testing.platform`,
with ``--worker-cls kvwire.testing.worker.StandInWorker``, ``--load-format dummy`` and a tiny
local model config (:func:`kvwire.testing.model.write_model_dir`). Everything is standard
library: no HTTP client beyond ``urllib``.

    srv = Server("p", python, port, model_dir, kv_transfer_config={...}, log_dir=d)
    srv.start(); srv.wait_ready()
    out = srv.complete(prompt_ids, max_tokens=8, kv_transfer_params={...})
    srv.stop()
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request

from kvwire.testing import model as _model
from kvwire.testing.ports import free_port, free_port_run  # noqa: F401  (free_port: re-exported for the e2e tests)

#: Ports reserved per server for vLLM's own listeners (``VLLM_PORT``).
VLLM_PORTS = 8

WORKER_CLS = "kvwire.testing.worker.StandInWorker"


class ServerError(RuntimeError):
    """A server did not start, died, or answered with an error."""


class Server:
    """One ``vllm serve`` process group (see the module docstring)."""

    def __init__(self, name: str, python: str, port: int, model_dir: str, *,
                 kv_transfer_config: dict | None = None, args: list | None = None,
                 env: dict | None = None, log_dir: str = "/tmp", block_size: int = 16,
                 max_model_len: int = 8192, max_num_batched_tokens: int = 512,
                 max_num_seqs: int = 16, num_blocks: int | None = None, dtype: str = "bfloat16",
                 async_scheduling: bool = False, prefix_caching: bool = True, log_stats: bool = False):
        self.name = name
        self.python = python
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = os.path.join(log_dir, f"server-{name}.log")
        self.proc: subprocess.Popen | None = None
        vllm = os.path.join(os.path.dirname(python), "vllm")
        cmd = [vllm, "serve", model_dir, "--served-model-name", "tiny", "--host", "127.0.0.1",
               "--port", str(port), "--worker-cls", WORKER_CLS, "--load-format", "dummy",
               "--skip-tokenizer-init", "--enforce-eager", "--dtype", dtype,
               "--block-size", str(block_size), "--max-model-len", str(max_model_len),
               "--max-num-seqs", str(max_num_seqs),
               "--max-num-batched-tokens", str(max_num_batched_tokens),
               "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching"]
        if not log_stats:  # no stats loggers: /metrics then has none of vLLM's (or kvwire's) series
            cmd += ["--disable-log-stats"]
        if num_blocks is not None:
            cmd += ["--num-gpu-blocks-override", str(num_blocks)]
        if kv_transfer_config is not None:
            cmd += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
        cmd += list(args or [])
        self.cmd = cmd
        e = dict(os.environ)
        e.update({"KVWIRE_TEST_CPU_PLATFORM": "1",
                  "KVWIRE_TEST_ASYNC_SCHEDULING": "1" if async_scheduling else "0",
                  "VLLM_ENABLE_V1_MULTIPROCESSING": "1", "OMP_NUM_THREADS": "1",
                  # vLLM's CPU platform binds each worker's OpenMP threads to one core; every
                  # thread the worker starts later (the connector's, the engine's) inherits that
                  # one core, shared with the worker's spinning main thread. The stand-in has no
                  # OpenMP work to place.
                  "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                  "PYTHONUNBUFFERED": "1", "VLLM_LOGGING_LEVEL": e.get("VLLM_LOGGING_LEVEL", "INFO")})
        e.pop("VLLM_TARGET_DEVICE", None)
        # vLLM's executors listen on a port for torch.distributed's store (tp 1 too). Without
        # VLLM_PORT it binds port 0, closes it and listens on that port later, and meanwhile the
        # kernel may hand the same port to an outgoing connection (a CI run's DS server died with
        # EADDRINUSE that way). With it, vLLM takes the first bindable port from VLLM_PORT up:
        # each server gets its own run below the ephemeral range, which outgoing connections
        # never use.
        e["VLLM_PORT"] = str(free_port_run(VLLM_PORTS))
        e.update(env or {})
        self.env = e

    # ---- life cycle ----
    def start(self) -> "Server":
        log = open(self.log_path, "ab")
        log.write(f"\n==== start {' '.join(self.cmd)}\n".encode())
        log.flush()
        self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=True)
        log.close()
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_ready(self, timeout: float = 300.0) -> "Server":
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if not self.alive():
                raise ServerError(f"server {self.name} exited ({self.proc.returncode}) before it was ready:\n"
                                  + self.log_tail())
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        raise ServerError(f"server {self.name} not ready after {timeout:.0f} s:\n" + self.log_tail())

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        self._kill_group()

    def pause(self) -> None:
        """SIGSTOP to the whole process group: a server that stalls (gets no CPU) but lives."""
        os.killpg(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.killpg(self.proc.pid, signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL to the whole process group (API server, engine core, workers): a crash."""
        self._kill_group()

    def _kill_group(self) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass

    def log_tail(self, n: int = 60) -> str:
        try:
            with open(self.log_path, "rb") as f:
                lines = f.read().decode(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(lines[-n:])

    # ---- HTTP ----
    def post(self, path: str, body: dict, timeout: float = 120.0, headers: dict | None = None) -> dict:
        data = json.dumps(body).encode()
        h = {"Content-Type": "application/json"}
        h.update(headers or {})
        req = urllib.request.Request(self.url + path, data=data, headers=h, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise ServerError(f"{self.name} {path}: HTTP {e.code}: {e.read()[:500]!r}") from e

    def complete(self, prompt, max_tokens: int, kv_transfer_params: dict | None = None,
                 timeout: float = 120.0, request_id: str | None = None) -> dict:
        """A greedy ``/v1/completions`` of token ids; returns the response (``token_ids`` of the
        first choice under ``"tokens"``)."""
        body = {"model": "tiny", "prompt": list(prompt), "max_tokens": max_tokens,
                "temperature": 0, "return_token_ids": True, "ignore_eos": True}
        if kv_transfer_params is not None:
            body["kv_transfer_params"] = kv_transfer_params
        headers = {"X-Request-Id": request_id} if request_id else None
        r = self.post("/v1/completions", body, timeout=timeout, headers=headers)
        r["tokens"] = r["choices"][0].get("token_ids")
        return r

    def metrics(self, timeout: float = 10.0) -> str:
        with urllib.request.urlopen(self.url + "/metrics", timeout=timeout) as r:
            return r.read().decode()

    def metric(self, name: str, labels: dict | None = None, text: str | None = None) -> float:
        """The sum of the samples of one metric whose labels include ``labels`` (in ``text``, one
        scrape of :meth:`metrics`, when given: several values from one snapshot)."""
        total, found = 0.0, False
        for line in (self.metrics() if text is None else text).splitlines():
            if not line.startswith(name):
                continue
            head, _, value = line.rpartition(" ")
            mname, _, lab = head.partition("{")
            if mname != name:
                continue
            if labels and not all(f'{k}="{v}"' in lab for k, v in labels.items()):
                continue
            total += float(value)
            found = True
        if not found:
            raise KeyError(name)
        return total


def reference(prompt, max_tokens: int, *, layers: int = 2, kv_heads: int = 2, head_dim: int = 16,
              vocab_size: int = 1000, dtype: str = "bfloat16") -> list:
    """What a correct single instance generates for ``prompt`` with the default tiny model."""
    return _model.reference_generate(prompt, max_tokens, layers=layers, heads=kv_heads,
                                     head_dim=head_dim, vocab_size=vocab_size, dtype=dtype)
