"""Scheduler side of the kv_both tax: vLLM's real v1 scheduler on CPU, per-step time with no
connector, an inert connector (``tax_noop``), KvwireConnector and vLLM's MooncakeConnector, all
kv_both and with no transfer pending.

Method (the one of ``research/vllm033_scheduler_tax.md``, rebuilt):

* ``VllmConfig``: a local dummy 2-layer llama config (no download), ``DeviceConfig("cpu")``,
  prefix caching on, block 16, ``max_num_seqs`` 256, ``max_num_batched_tokens`` 8192,
  ``max_model_len`` 4096, ``log_stats=True``, async scheduling (vLLM's default): the class comes
  from ``SchedulerConfig.get_scheduler_cls()``, as EngineCore picks it.
* Engine loop: ``EngineCore.step_with_batch_queue`` with a queue of depth 2 (schedule N+1, then
  update N); the model output is faked (one token per request that finished its prompt, an empty
  ``KVConnectorOutput`` attached when a connector is configured, as the executor does). Only
  ``schedule()`` and ``update_from_output()`` are timed (``time.perf_counter_ns``).
* Cache fill: every block of the pool except the null block gets a distinct block hash and goes
  into the prefix-cache map while staying free (the state the earlier notes reached by running
  4000-token prompts through prefill, reached directly here so that 1M blocks fill in seconds).
  ``gc.collect(); gc.freeze()`` afterwards, as EngineCore does.
* Workloads (no request carries ``kv_transfer_params``): ``decode`` -- ``live`` requests with
  64-token prompts decoding; ``churn`` -- 16-token prompts, lifetimes U[1,64) for the first
  cohort then U[16,48], every finished request replaced at once (``add_request`` not timed).
* Connectors are measured round-robin, in rotating order, ``rounds`` x ``round_steps`` steps each
  after a warm-up; the tax is the paired difference of per-round medians against ``none``.

Writes one JSON object (schema ``kvwire.tax.sched/1``) to ``--out``; progress on stderr.
"""

import argparse
import atexit
import gc
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections import deque

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# The model config is a local directory: no hub lookups (offline they wait for a timeout).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
import vllm  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.config import (  # noqa: E402
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import (  # noqa: E402
    get_request_block_hasher,
    init_none_hash,
    make_block_hash_with_group_id,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

BLOCK = 16
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
CONNECTORS = ["none", "noop", "kvwire", "mooncake"]
TOKEN = 7


def log(msg):
    print(f"[tax sched vllm {vllm.__version__}] {msg}", file=sys.stderr, flush=True)


def model_dir():
    d = tempfile.mkdtemp(prefix="kvwire-tax-model-")
    atexit.register(shutil.rmtree, d, True)
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_hidden_layers": len(LAYERS), "vocab_size": 1000, "max_position_embeddings": 4096,
        "torch_dtype": "float32",
    }
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    return d


def kv_transfer_config(conn):
    if conn == "none":
        return None
    if conn == "noop":
        return KVTransferConfig(kv_connector="NoOpConnector", kv_connector_module_path="tax_noop", kv_role="kv_both")
    if conn == "kvwire":
        return KVTransferConfig(kv_connector="KvwireConnector", kv_connector_module_path="kvwire.vllm",
                                kv_role="kv_both", kv_connector_extra_config={"transport": "tcp"})
    if conn == "mooncake":
        return KVTransferConfig(kv_connector="MooncakeConnector", kv_role="kv_both")
    raise ValueError(conn)


def build_scheduler(conn, mdir, num_blocks):
    mc = ModelConfig(model=mdir, skip_tokenizer_init=True, dtype="float32", seed=0, max_model_len=4096)
    sc = SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=4096,
                         enable_chunked_prefill=True, is_encoder_decoder=False)
    cc = CacheConfig(block_size=BLOCK, gpu_memory_utilization=0.9, enable_prefix_caching=True)
    vc = VllmConfig(scheduler_config=sc, model_config=mc, cache_config=cc,
                    kv_transfer_config=kv_transfer_config(conn), device_config=DeviceConfig("cpu"))
    vc.scheduler_config.async_scheduling = True
    vc.cache_config.num_gpu_blocks = num_blocks
    kcc = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(list(LAYERS), FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=8,
                                                         dtype=torch.float32))])
    cls = vc.scheduler_config.get_scheduler_cls()
    sched = cls(vllm_config=vc, kv_cache_config=kcc, structured_output_manager=StructuredOutputManager(vc),
                block_size=BLOCK, log_stats=True)
    return sched


def fill_cache(sched):
    """Gives every non-null block of the pool a distinct hash in the prefix-cache map; the blocks
    stay free (evictable). Returns how many blocks are cached."""
    pool = sched.kv_cache_manager.block_pool
    n = 0
    for blk in pool.blocks:
        if blk.is_null or blk.block_hash is not None:
            continue
        key = make_block_hash_with_group_id((0x6B76 << 40 | blk.block_id).to_bytes(32, "little"), 0)
        if hasattr(blk, "set_block_hash"):
            blk.set_block_hash(key, num_tokens=BLOCK)
        else:
            blk.block_hash = key
        pool.cached_block_hash_to_block.insert(key, blk)
        n += 1
    return n


def cached_blocks(sched):
    return len(sched.kv_cache_manager.block_pool.cached_block_hash_to_block)


_hasher = None


def new_request(rid, prompt, max_tokens, rng):
    global _hasher
    if _hasher is None:
        init_none_hash(sha256)
        _hasher = get_request_block_hasher(BLOCK, sha256)
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    sp.update_from_generation_config({}, 999)
    return Request(request_id=rid, prompt_token_ids=[rng.randrange(1, 900) for _ in range(prompt)],
                   sampling_params=sp, pooling_params=None, block_hasher=_hasher)


class Loop:
    """One scheduler stepped like EngineCore.step_with_batch_queue (depth 2)."""

    def __init__(self, conn, sched, seed):
        self.conn = conn
        self.sched = sched
        self.queue = deque()
        self.rng = random.Random(seed)
        self.live = set()
        self.next_id = 0
        self.finished = 0
        self.admitted = 0
        self.with_kv_output = conn != "none"

    def add(self, prompt, max_tokens):
        rid = f"{self.conn}-{self.next_id}"
        self.next_id += 1
        self.sched.add_request(new_request(rid, prompt, max_tokens, self.rng))
        self.live.add(rid)
        self.admitted += 1

    def _output(self, so):
        ids = list(so.num_scheduled_tokens.keys())
        toks = []
        for r in ids:
            req = self.sched.requests.get(r)
            done_prompt = req is not None and req.num_computed_tokens >= req.num_prompt_tokens
            toks.append([TOKEN] if done_prompt else [])
        kw = {}
        if self.with_kv_output:
            kw["kv_connector_output"] = KVConnectorOutput()
        return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                 sampled_token_ids=toks, logprobs=None, prompt_logprobs_dict={},
                                 pooler_output=None, **kw)

    def step(self):
        """One engine step; returns the ns spent in schedule() + update_from_output()."""
        t0 = time.perf_counter_ns()
        so = self.sched.schedule()
        t1 = time.perf_counter_ns()
        self.last_so = so
        self.queue.append(so)
        if len(self.queue) < 2 and so.total_num_scheduled_tokens > 0:
            return t1 - t0
        old = self.queue.popleft()
        out = self._output(old)
        t2 = time.perf_counter_ns()
        self.sched.update_from_output(old, out)
        t3 = time.perf_counter_ns()
        return (t1 - t0) + (t3 - t2)

    def reap(self):
        """Requests that finished since the last call (not timed)."""
        gone = [r for r in self.live if r not in self.sched.requests]
        for r in gone:
            self.live.discard(r)
        self.finished += len(gone)
        return len(gone)

    def drain(self):
        """Ends every live request and empties the queue, for the next workload."""
        if self.live:
            self.sched.finish_requests(list(self.live), RequestStatus.FINISHED_ABORTED)
        for _ in range(8):
            self.step()
        self.queue.clear()
        self.reap()
        self.live.clear()


def hook_costs(lp, number):
    """Isolated per-call µs (min of 3 timeit repeats) of the two scheduler hooks every step
    calls, on the last step's scheduler output (no transfer pending)."""
    import timeit

    conn = getattr(lp.sched, "connector", None)
    if conn is None or getattr(lp, "last_so", None) is None:
        return None
    so, out = lp.last_so, KVConnectorOutput()
    t = {}
    for name, fn in (("build_connector_meta", lambda: conn.build_connector_meta(so)),
                     ("update_connector_output", lambda: conn.update_connector_output(out))):
        t[name + "_us"] = min(timeit.repeat(fn, number=number, repeat=3)) / number * 1e6
    return t


def pct(xs, q):
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))]


def run_cell(loops, mode, live, rounds, round_steps, warmup):
    """Runs one workload on every loop, round-robin; returns per-connector results."""
    for lp in loops:
        lp.churn = mode == "churn"
        for _ in range(live):
            if mode == "decode":
                lp.add(64, 100_000)
            else:
                lp.add(16, lp.rng.randrange(1, 64))
    samples = {lp.conn: [] for lp in loops}
    round_meds = {lp.conn: [] for lp in loops}
    fin0 = {lp.conn: lp.finished for lp in loops}
    adm0 = {lp.conn: lp.admitted for lp in loops}

    def steps(lp, n, keep):
        for _ in range(n):
            dt = lp.step()
            if keep is not None:
                keep.append(dt)
            if lp.churn:
                for _ in range(lp.reap()):
                    lp.add(16, lp.rng.randrange(16, 49))

    for lp in loops:
        steps(lp, warmup, None)
    for lp in loops:
        fin0[lp.conn] = lp.finished
        adm0[lp.conn] = lp.admitted
    for r in range(rounds):
        order = loops[r % len(loops):] + loops[:r % len(loops)]
        for lp in order:
            keep = []
            steps(lp, round_steps, keep)
            samples[lp.conn].extend(keep)
            round_meds[lp.conn].append(statistics.median(keep))
    measured = rounds * round_steps
    res = {}
    base = round_meds.get("none")
    noop = round_meds.get("noop")
    for lp in loops:
        s = samples[lp.conn]
        rm = round_meds[lp.conn]
        e = {
            "steps": len(s),
            "median_us": statistics.median(s) / 1e3,
            "p90_us": pct(s, 0.9) / 1e3,
            "mean_us": sum(s) / len(s) / 1e3,
            "finished_per_step": (lp.finished - fin0[lp.conn]) / measured,
            "admitted_per_step": (lp.admitted - adm0[lp.conn]) / measured,
            "live_end": len(lp.live),
            "cached_blocks_end": cached_blocks(lp.sched),
        }
        for name, ref in (("vs_none", base), ("vs_noop", noop)):
            if ref is not None and lp.conn != name[3:]:
                d = sorted((a - b) / 1e3 for a, b in zip(rm, ref))
                e[f"delta_{name}_us"] = statistics.median(d)
                e[f"delta_{name}_min_us"] = d[0]
                e[f"delta_{name}_max_us"] = d[-1]
        res[lp.conn] = e
    for lp in loops:
        lp.drain()
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", default="1000,1000000")
    ap.add_argument("--connectors", default=",".join(CONNECTORS))
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--round-steps", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--decode-live", type=int, default=10)
    ap.add_argument("--churn-live", type=int, default=200)
    ap.add_argument("--out", required=True, help="JSON result file (vLLM logs to stdout)")
    a = ap.parse_args()
    import logging

    logging.disable(logging.WARNING)
    mdir = model_dir()
    out = {
        "schema": "kvwire.tax.sched/1", "vllm": vllm.__version__, "python": sys.version.split()[0],
        "method": "real vLLM v1 scheduler on CPU; async scheduling, batch queue depth 2; "
                  "schedule()+update_from_output() timed with perf_counter_ns; connectors round-robin "
                  "in one process; delta = median over rounds of paired per-round median differences",
        "rounds": a.rounds, "round_steps": a.round_steps, "warmup": a.warmup,
        "connectors": {}, "errors": {}, "cells": [],
    }
    conns = [c for c in a.connectors.split(",") if c]
    for blocks in [int(b) for b in a.blocks.split(",") if b]:
        loops = []
        gc.disable()  # a million block objects would otherwise trigger full collections while built
        for i, c in enumerate(conns):
            t0 = time.monotonic()
            try:
                s = build_scheduler(c, mdir, blocks)
            except Exception as e:  # a connector that cannot be built is reported, not hidden
                out["errors"][c] = f"{type(e).__name__}: {e}"
                log(f"{c}: cannot build the scheduler: {e}")
                continue
            cname = type(s.connector).__name__ if getattr(s, "connector", None) is not None else None
            out["connectors"][c] = {"class": cname, "scheduler": type(s).__name__,
                                    "defer_block_free": getattr(s, "defer_block_free", None)}
            filled = fill_cache(s)
            loops.append(Loop(c, s, seed=1234 + i))
            log(f"{blocks} blocks: {c} built and filled ({filled} cached) in {time.monotonic() - t0:.1f} s")
        gc.enable()
        gc.collect()
        gc.freeze()
        for mode, live in (("decode", a.decode_live), ("churn", a.churn_live)):
            t0 = time.monotonic()
            res = run_cell(loops, mode, live, a.rounds, a.round_steps, a.warmup)
            log(f"{mode} {live} live @ {blocks} blocks: " + ", ".join(
                f"{c} {r['median_us']:.1f}" for c, r in res.items()) + f" us/step ({time.monotonic() - t0:.1f} s)")
            out["cells"].append({"mode": mode, "live": live, "blocks": blocks, "results": res})
            if mode == "decode" and "hooks" not in out:
                # Where the per-step difference comes from: the hooks alone, in isolation.
                out["hooks"] = {lp.conn: hook_costs(lp, 2000) for lp in loops if lp.conn != "none"}
                log("hooks (us per call): " + ", ".join(f"{c} {h}" for c, h in out["hooks"].items()))
        for lp in loops:
            conn = getattr(lp.sched, "connector", None)
            if conn is not None and hasattr(conn, "shutdown"):
                try:
                    conn.shutdown()
                except Exception:
                    pass
        del loops
        gc.unfreeze()
        gc.collect()
    with open(a.out, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
