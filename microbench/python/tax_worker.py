"""Worker side of the kv_both tax: a CPU stand-in for vLLM's model runner with each connector's
worker half loaded, idle, and with transfers in flight for *other* requests.

The stand-in: per step, a fixed amount of GIL-holding Python work split over ``layers`` layers,
with the worker hooks called in the order vLLM's model runner calls them:
``bind_connector_metadata`` (empty metadata: no transfer for this step's requests),
``start_load_kv``, per layer ``wait_for_layer_load`` -> work -> ``save_kv_layer``,
``wait_for_save``, ``get_finished``, ``get_block_ids_with_load_errors``,
``clear_connector_metadata``.

Connectors (one alive at a time; ``none`` is the base chunk interleaved with each):

* ``none``: no connector, the hooks are not called;
* ``noop``: ``tax_noop.NoOpConnector`` built by vLLM's factory (worker role);
* ``kvwire``: ``kvwire.vllm.KvwireConnector`` built by vLLM's factory (worker role, kv_both,
  CPU KV caches registered). In flight: a driver thread keeps ``depth`` batches of real writes
  going from this connector's own kvwire engine to a kvwire engine in a child process over TCP
  loopback (the bytes are checked at the end);
* ``mooncake``: vLLM's MooncakeConnector worker when it can be built; on CPU it cannot (its
  constructor asks torch for the current CUDA device), so the stand-in is the real Mooncake
  ``TransferEngine`` (PyPI ``mooncake-transfer-engine-non-cuda``), initialized (P2PHANDSHAKE,
  tcp) with the KV memory registered, in this process; its hooks are then not called. In
  flight: a driver thread doing ``transfer_sync_write`` to a TransferEngine in a child process.

Figures per (connector, state): steps/s and per-step median of the stand-in loop; CPU time of
the threads the connector started (``/proc/self/task/<tid>/schedstat``: ns on CPU), and of the
driver thread separately; a GIL probe: with the main thread asleep (GIL free), a probe thread
sleeps 1 ms in a loop and records how late it wakes up; extra lateness over ``none`` is time
spent waiting for the GIL held by other threads.

Writes one JSON object (schema ``kvwire.tax.worker/1``) to ``--out``; progress on stderr.
"""

import argparse
import ctypes
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# The model config is a local directory: no hub lookups (offline they wait for a timeout).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
import vllm  # noqa: E402
from vllm.config import DeviceConfig, KVTransferConfig, ModelConfig, VllmConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorRole  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402

import tax_sched  # noqa: E402

BLOCK, HEADS, DIM, NUM_BLOCKS = 16, 2, 8, 256
CHUNK = 256 * 1024  # bytes per in-flight write op
OPS = 8  # ops per in-flight batch (2 MiB)


def log(msg):
    print(f"[tax worker vllm {vllm.__version__}] {msg}", file=sys.stderr, flush=True)


# ---- threads and their CPU ----------------------------------------------------------------------
def tids():
    return set(int(t) for t in os.listdir("/proc/self/task"))


def cpu_ns(tid):
    """ns this thread spent on a CPU (schedstat; falls back to utime+stime ticks)."""
    try:
        with open(f"/proc/self/task/{tid}/schedstat") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open(f"/proc/self/task/{tid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) * 1_000_000_000 // os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0


def cpu_of(ts):
    return {t: cpu_ns(t) for t in ts}


# ---- peers in a child process ---------------------------------------------------------------
class Peer:
    """``tax_peer.py`` in a child process: the destination engine."""

    def __init__(self, kind, size):
        here = os.path.dirname(os.path.abspath(__file__))
        self.proc = subprocess.Popen([sys.executable, os.path.join(here, "tax_peer.py"), kind, str(size)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        # vLLM-free child: its only stdout lines are ours, but skip anything that is not JSON.
        while line and not line.startswith("{"):
            line = self.proc.stdout.readline()
        if not line:
            self.proc.kill()
            raise RuntimeError(f"{kind} peer process did not start")
        self.info = json.loads(line)

    def finish(self):
        try:
            out, _ = self.proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return None
        lines = [x for x in out.splitlines() if len(x) == 64]
        return lines[-1] if lines else None


# ---- in-flight drivers ----------------------------------------------------------------------
class Driver:
    """A thread keeping writes of a fixed pattern in flight while ``go`` is set; every write
    targets the same destination range, so the destination must end up equal to the pattern."""

    def __init__(self, run_once, period_s):
        self.run_once = run_once
        self.period_s = period_s
        self.go = threading.Event()
        self.stop = threading.Event()
        self.idle = threading.Event()
        self.batches = 0
        self.errors = []
        self.tid = None
        self.t = threading.Thread(target=self._loop, name="tax-driver", daemon=True)

    def _loop(self):
        self.tid = threading.get_native_id()
        deadline = time.monotonic() + 600
        while not self.stop.is_set() and time.monotonic() < deadline and len(self.errors) < 4:
            if not self.go.is_set():
                self.idle.set()
                self.go.wait(0.05)
                continue
            self.idle.clear()
            t0 = time.monotonic()
            try:
                self.run_once()
                self.batches += 1
            except Exception as e:  # reported in the JSON
                self.errors.append(f"{type(e).__name__}: {e}")
            rest = self.period_s - (time.monotonic() - t0)
            if rest > 0:  # paced: the same offered load for every engine
                time.sleep(rest)
        self.idle.set()

    def start(self):
        self.t.start()
        while self.tid is None:
            time.sleep(0.001)

    def pause(self):
        self.go.clear()
        self.idle.wait(30)

    def resume(self):
        self.go.set()

    def join(self):
        self.stop.set()
        self.go.set()
        self.t.join(30)


def pattern(n):
    return bytes((i * 131 + 7) & 0xFF for i in range(256)) * (n // 256)


# ---- the model-runner stand-in ---------------------------------------------------------------
def work(n):
    acc = 0
    for i in range(n):
        acc ^= i  # small ints only: the cost per iteration does not grow with n
    return acc


def calibrate(target_us):
    """Iterations of ``work`` that take ``target_us`` (best of 5 at ~10 ms, against hiccups)."""
    n = 200_000
    best = min(_timed(n) for _ in range(5))
    return max(1000, int(n * target_us * 1000 / best))


def _timed(n):
    t0 = time.perf_counter_ns()
    work(n)
    return time.perf_counter_ns() - t0


def run_steps(conn, meta_cls, kv, n_work, steps):
    """``steps`` stand-in steps; returns (wall ns, per-step ns list)."""
    names = list(kv)
    per_layer = max(1, n_work // len(names))
    attn = object()
    times = []
    t_start = time.perf_counter_ns()
    for _ in range(steps):
        t0 = time.perf_counter_ns()
        if conn is not None:
            conn.bind_connector_metadata(meta_cls())
            conn.start_load_kv(None)
            for name in names:
                conn.wait_for_layer_load(name)
                work(per_layer)
                conn.save_kv_layer(name, kv[name], attn)
            conn.wait_for_save()
            conn.get_finished(set())
            conn.get_block_ids_with_load_errors()
            conn.clear_connector_metadata()
        else:
            for name in names:
                work(per_layer)
        times.append(time.perf_counter_ns() - t0)
    return time.perf_counter_ns() - t_start, times


def gil_probe(seconds, period_s=0.001):
    """Main thread asleep; a probe thread sleeps ``period_s`` in a loop: lateness of its wake-ups
    (time past the requested sleep, which includes re-acquiring the GIL)."""
    late = []
    stop = threading.Event()

    def probe():
        while not stop.is_set():
            t0 = time.perf_counter_ns()
            time.sleep(period_s)
            late.append(time.perf_counter_ns() - t0 - int(period_s * 1e9))

    t = threading.Thread(target=probe, name="tax-gil-probe", daemon=True)
    t.start()
    time.sleep(seconds)
    stop.set()
    t.join(5)
    s = sorted(late) or [0]
    return {"samples": len(late), "p50_us": s[len(s) // 2] / 1e3, "p99_us": s[min(len(s) - 1, int(0.99 * len(s)))] / 1e3,
            "mean_us": sum(s) / len(s) / 1e3}


def measure(label, conn, meta_cls, kv, n_work, a, t0_tids, driver=None):
    """Paired chunks in one time window, rotating order each round: ``base`` (no hooks, driver
    paused), ``idle`` (hooks, driver paused), ``inflight`` (hooks, driver running). Returns one
    result per non-base state; CPU of the connector's threads (all threads started since
    ``t0_tids`` except the driver) is summed over that state's chunks."""
    states = ["base", "idle"] + (["inflight"] if driver else [])
    acc = {st: {"wall": 0, "times": [], "cpu": 0, "dcpu": 0, "rates": [], "batches": 0} for st in states}
    skip = {threading.get_native_id()} | ({driver.tid} if driver else set())
    for r in range(a.rounds):
        for st in states[r % len(states):] + states[:r % len(states)]:
            if driver:
                driver.resume() if st == "inflight" else driver.pause()
            own = tids() - t0_tids - skip
            c0 = cpu_of(own)
            d0 = cpu_ns(driver.tid) if driver else 0
            b0 = driver.batches if driver else 0
            wall, times = run_steps(conn if st != "base" else None, meta_cls, kv, n_work, a.chunk_steps)
            c1 = cpu_of(own)
            e = acc[st]
            e["wall"] += wall
            e["times"] += times
            e["cpu"] += sum(c1[t] - c0[t] for t in own)
            e["dcpu"] += (cpu_ns(driver.tid) - d0) if driver else 0
            e["rates"].append(len(times) / (wall / 1e9))
            e["batches"] += (driver.batches - b0) if driver else 0
    if driver:
        driver.pause()
    base = acc["base"]
    out = []
    for st in states[1:]:
        e = acc[st]
        lost = sorted(100.0 * (1 - x / b) for x, b in zip(e["rates"], base["rates"]))
        res = {
            "state": st, "steps": len(e["times"]), "steps_per_s": len(e["times"]) / (e["wall"] / 1e9),
            "base_steps_per_s": len(base["times"]) / (base["wall"] / 1e9),
            "median_step_us": statistics.median(e["times"]) / 1e3,
            "base_median_step_us": statistics.median(base["times"]) / 1e3,
            "steps_lost_pct": statistics.median(lost), "steps_lost_min_pct": lost[0], "steps_lost_max_pct": lost[-1],
            "threads": len(tids() - t0_tids - skip),
            "threads_cpu_pct": 100.0 * e["cpu"] / e["wall"],
        }
        if driver:
            res["driver_cpu_pct"] = 100.0 * e["dcpu"] / e["wall"]
            res["moved_mb_s"] = e["batches"] * a.depth * CHUNK * OPS / (e["wall"] / 1e9) / 1e6
        if driver and st == "inflight":
            driver.resume()
        res["gil_probe"] = gil_probe(a.probe_s)
        if driver:
            driver.pause()
        out.append(res)
        log(f"{label} {st}: {res['steps_per_s']:.1f} vs {res['base_steps_per_s']:.1f} steps/s "
            f"(lost {res['steps_lost_pct']:+.2f}%), {res['threads']} threads at {res['threads_cpu_pct']:.2f}% CPU, "
            f"GIL probe p50 {res['gil_probe']['p50_us']:.0f} us")
    return out


def vllm_cfg(conn, mdir):
    mc = ModelConfig(model=mdir, skip_tokenizer_init=True, dtype="float32", seed=0, max_model_len=4096)
    if conn == "noop":
        kt = KVTransferConfig(kv_connector="NoOpConnector", kv_connector_module_path="tax_noop", kv_role="kv_both")
    elif conn == "kvwire":
        kt = KVTransferConfig(kv_connector="KvwireConnector", kv_connector_module_path="kvwire.vllm", kv_role="kv_both",
                              kv_connector_extra_config={"transport": "tcp", "data_listen": "127.0.0.1:0"})
    else:
        kt = KVTransferConfig(kv_connector="MooncakeConnector", kv_role="kv_both")
    return VllmConfig(model_config=mc, kv_transfer_config=kt, device_config=DeviceConfig("cpu"))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--step-us", type=float, default=4000.0, help="GIL-holding work per step, µs")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--chunk-steps", type=int, default=40)
    ap.add_argument("--probe-s", type=float, default=1.0)
    ap.add_argument("--depth", type=int, default=2, help="in-flight batches of the driver")
    ap.add_argument("--rate-mb", type=float, default=200.0, help="offered in-flight load, MB/s (1e6 B)")
    a = ap.parse_args()
    import logging

    logging.disable(logging.WARNING)
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(a.layers)]
    mdir = tax_sched.model_dir()
    with open(os.path.join(mdir, "config.json")) as f:
        cfg = json.load(f)
    cfg["num_hidden_layers"] = a.layers
    with open(os.path.join(mdir, "config.json"), "w") as f:
        json.dump(cfg, f)
    kcc = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(
        list(layers), FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=DIM, dtype=torch.float32))])
    kv = {n: torch.zeros(2, NUM_BLOCKS, BLOCK, HEADS, DIM) for n in layers}
    n_work = calibrate(a.step_us)
    size = CHUNK * OPS
    out = {"schema": "kvwire.tax.worker/1", "vllm": vllm.__version__, "layers": a.layers, "step_work_us": a.step_us,
           "work_iterations": n_work, "rounds": a.rounds, "chunk_steps": a.chunk_steps, "probe_period_us": 1000,
           "inflight_batch_bytes": size, "inflight_depth": a.depth, "inflight_offered_mb_s": a.rate_mb,
           "method": "CPU stand-in model runner (fixed GIL-holding work per step, worker hooks as vLLM calls them); "
                     "base (no connector hooks) / idle / in-flight chunks interleaved in one window, steps lost = "
                     "median over rounds of 1 - rate/base rate; thread CPU from /proc/self/task/*/schedstat over "
                     "the state's chunks; GIL probe = wake-up lateness of a thread sleeping 1 ms while the main "
                     "thread sleeps (vs the same probe with no connector)",
           "runs": [], "notes": []}
    pat = pattern(size)
    want = hashlib.sha256(pat).hexdigest()
    out["gil_probe_none"] = gil_probe(a.probe_s)
    log(f"no connector: GIL probe p50 {out['gil_probe_none']['p50_us']:.0f} us")

    def add(conn, results, **extra):
        for r in results:
            r["gil_extra_p50_us"] = r["gil_probe"]["p50_us"] - out["gil_probe_none"]["p50_us"]
            out["runs"].append({"connector": conn, **r, **extra})

    # noop
    t0 = tids()
    c = KVConnectorFactory.create_connector(vllm_cfg("noop", mdir), KVConnectorRole.WORKER, kcc)
    c.register_kv_caches(kv)
    add("noop", measure("noop", c, KVConnectorMetadata, kv, n_work, a, t0), **{"class": type(c).__name__})
    c.shutdown()

    # kvwire
    from kvwire.vllm.connector import KvwireConnectorMetadata

    t0 = tids()
    c = KVConnectorFactory.create_connector(vllm_cfg("kvwire", mdir), KVConnectorRole.WORKER, kcc)
    c.register_kv_caches(kv)
    try:
        peer = Peer("kvwire", size)
        eng = c._worker.engine  # the connector's own data engine
        src = eng.alloc(size, "local")
        eng.local_write(src, 0, pat)
        p = eng.connect(peer.info["addr"])
        dst = p.regions()[0]
        ops = [(src, i * CHUNK, dst, i * CHUNK, CHUNK) for i in range(OPS)]

        def once():
            bs = [eng.write(p, ops) for _ in range(a.depth)]
            for b in bs:
                b.wait()

        drv = Driver(once, a.depth * size / (a.rate_mb * 1e6))
        drv.start()
        res = measure("kvwire", c, KvwireConnectorMetadata, kv, n_work, a, t0, drv)
        drv.join()
        got = peer.finish()
        for r in res:
            if r["state"] == "inflight":
                r.update({"batches": drv.batches * a.depth, "bytes": drv.batches * a.depth * size,
                          "verified": got == want and drv.batches > 0, "errors": drv.errors})
        add("kvwire", res, **{"class": type(c).__name__})
    except Exception as e:
        out["notes"].append(f"kvwire in flight: not measured: {type(e).__name__}: {e}")
        log(out["notes"][-1])
        add("kvwire", measure("kvwire", c, KvwireConnectorMetadata, kv, n_work, a, t0), **{"class": type(c).__name__})
    c.shutdown()

    # mooncake
    t0 = tids()
    try:
        c = KVConnectorFactory.create_connector(vllm_cfg("mooncake", mdir), KVConnectorRole.WORKER, kcc)
        c.register_kv_caches(kv)
        from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector import MooncakeConnectorMetadata

        add("mooncake", measure("mooncake", c, MooncakeConnectorMetadata, kv, n_work, a, t0),
            **{"class": type(c).__name__})
        c.shutdown()
    except Exception as e:
        why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        out["mooncake_worker"] = "stand-in"
        out["notes"].append(f"MooncakeConnector worker cannot be built here ({why}); stand-in: the real Mooncake "
                            "TransferEngine (tcp, P2PHANDSHAKE) with the KV caches registered, in this process; "
                            "no connector hooks are called, so its steps lost are only its threads' interference")
        log(out["notes"][-1])
        try:
            from mooncake.engine import TransferEngine

            t0 = tids()
            te = TransferEngine()
            rc = te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
            if rc != 0:
                raise RuntimeError(f"TransferEngine.initialize returned {rc}")
            for t in kv.values():
                if te.register_memory(t.data_ptr(), t.numel() * t.element_size()) != 0:
                    raise RuntimeError("TransferEngine.register_memory failed")
            peer = Peer("mooncake", size)
            if peer.info.get("rc") != 0 or peer.info.get("rc_register") != 0:
                raise RuntimeError(f"mooncake peer: {peer.info}")
            buf = (ctypes.c_char * size).from_buffer_copy(pat)
            addr = ctypes.addressof(buf)
            if te.register_memory(addr, size) != 0:
                raise RuntimeError("register_memory of the source failed")

            def once_mc():
                for _ in range(a.depth):
                    rc = te.transfer_sync_write(peer.info["session"], addr, peer.info["buf"], size)
                    if rc != 0:
                        raise RuntimeError(f"transfer_sync_write returned {rc}")

            drv = Driver(once_mc, a.depth * size / (a.rate_mb * 1e6))
            drv.start()
            res = measure("mooncake TE", None, None, kv, n_work, a, t0, drv)
            drv.join()
            got = peer.finish()
            for r in res:
                if r["state"] == "inflight":
                    r.update({"batches": drv.batches * a.depth, "bytes": drv.batches * a.depth * size,
                              "verified": got == want and drv.batches > 0, "errors": drv.errors})
            add("mooncake", res, **{"class": "mooncake.engine.TransferEngine (stand-in)"})
        except Exception as e2:
            out["notes"].append(f"mooncake stand-in: not measured: {type(e2).__name__}: {e2}")
            log(out["notes"][-1])
    with open(a.out, "w") as f:
        json.dump(out, f)
    sys.stderr.flush()
    shutil.rmtree(mdir, True)
    os._exit(0)  # background engine threads must not hold the exit


if __name__ == "__main__":
    main()
