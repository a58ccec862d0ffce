"""A P/D pair of real vLLM v1 Schedulers on CPU, each with KvwireConnector loaded through vLLM's
own factory (kv_connector_module_path) in both roles, and a stand-in model runner that drives
the worker halves with CPU tensors as the KV cache (built like vLLM's
tests/v1/kv_connector/unit/utils.py, with a local 2-layer model config: no download).

With ``tp=N`` a side has N worker-side connectors (TP ranks 0..N-1, each with its own KV shard
of HEADS // N heads), their addresses handed to the scheduler as EngineCore does at startup, and
their outputs merged by vLLM's own KVOutputAggregator as the executor does."""

import json
import os
import tempfile
import time
from unittest import mock

import pytest
import torch
from kvwire.testing.ports import free_port
from kvwire.testing.wait import wait_for as _wait_for
from vllm import SamplingParams
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, ParallelConfig, SchedulerConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

BLOCK = 16
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
HEADS, HEAD_DIM = 2, 8
EOS = 999
_init = False


def model_dir():
    d = tempfile.mkdtemp(prefix="kvwire-model-")
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": HEADS,
        "num_hidden_layers": len(LAYERS), "vocab_size": 1000, "max_position_embeddings": 4096,
        "torch_dtype": "float32",
    }
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    return d


def vllm_config(kv_role, extra, mdir, load_failure_policy="fail", tp=1, block=BLOCK, dtype="float32",
                max_num_seqs=16, max_num_batched_tokens=1024):
    mc = ModelConfig(model=mdir, skip_tokenizer_init=True, dtype=dtype, seed=42, max_model_len=2048)
    sc = SchedulerConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, max_model_len=2048,
        enable_chunked_prefill=True, is_encoder_decoder=False,
    )
    cc = CacheConfig(block_size=block, gpu_memory_utilization=0.9, enable_prefix_caching=True)
    kt = KVTransferConfig(
        kv_connector="KvwireConnector", kv_connector_module_path="kvwire.vllm", kv_role=kv_role,
        kv_connector_extra_config=extra, kv_load_failure_policy=load_failure_policy,
    )
    par = {} if tp == 1 else {"parallel_config": ParallelConfig(tensor_parallel_size=tp)}
    vc = VllmConfig(scheduler_config=sc, model_config=mc, cache_config=cc, kv_transfer_config=kt,
                    device_config=DeviceConfig("cpu"), **par)
    vc.scheduler_config.async_scheduling = False
    return vc


def kv_cache_config(num_blocks, heads=HEADS, block=BLOCK, dtype=torch.float32):
    return KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), FullAttentionSpec(
            block_size=block, num_kv_heads=heads, head_size=HEAD_DIM, dtype=dtype))],
    )


def _worker(vc, kcc, rank, tp):
    """A worker-side connector of TP rank ``rank``: vLLM's TP-rank query answers ``rank`` while
    it is built (there is no process group here)."""
    if tp == 1:
        return KVConnectorFactory.create_connector(vc, KVConnectorRole.WORKER, kcc)
    with mock.patch("vllm.distributed.parallel_state.get_tensor_model_parallel_rank", return_value=rank):
        return KVConnectorFactory.create_connector(vc, KVConnectorRole.WORKER, kcc)


def hand_shake(conn, workers):
    """What EngineCore does once the workers registered their KV caches: every worker's
    handshake metadata, keyed by TP rank (0.33.0: by (pp rank, TP rank)), to the scheduler."""
    metas = {r: w.get_handshake_metadata() for r, w in enumerate(workers)}
    metas = {r: m for r, m in metas.items() if m is not None}
    if not metas:
        return
    if hasattr(conn, "set_xfer_handshake_metadata_pp_aware"):
        conn.set_xfer_handshake_metadata_pp_aware({(0, r): m for r, m in metas.items()})
    else:
        conn.set_xfer_handshake_metadata(metas)


def _start_load_after_forward() -> bool:
    """Whether this vLLM's model runner starts the connector's loads after the forward (0.33)
    rather than before it (0.18)."""
    import inspect

    from vllm.v1.worker import kv_connector_model_runner_mixin as mixin

    return "start_after_forward" in inspect.getsource(mixin)


START_LOAD_AFTER_FORWARD = _start_load_after_forward()


class Side:
    """One vLLM instance: a real Scheduler (with the scheduler-side connector built by vLLM)
    plus ``tp`` worker-side connectors (``workers``; ``worker`` is rank 0's), rank r over CPU KV
    tensors ``kvs[r]`` of shape [2, blocks, block, HEADS // tp, DIM] (``kv`` is rank 0's), of the
    model's ``dtype`` (``block`` and ``dtype`` other than the defaults: for compatibility tests)."""

    def __init__(self, kv_role, extra, mdir, num_blocks=64, tp=1, block=BLOCK, dtype="float32", **kw):
        self.num_blocks = num_blocks
        self.block = block
        self.tp = tp
        self.heads = HEADS // tp
        # Every side writes its timeline (read back by ``timeline``); no Mooncake bootstrap port.
        self.timeline_dir = tempfile.mkdtemp(prefix="kvwire-timeline-")
        extra = {"timeline_path": self.timeline_dir, "bootstrap_port": 0, **extra}
        self.vc = vllm_config(kv_role, extra, mdir, tp=tp, block=block, dtype=dtype, **kw)
        tdtype = getattr(torch, dtype)
        kcc = kv_cache_config(num_blocks, self.heads, block, tdtype)
        self.vc.cache_config.num_gpu_blocks = num_blocks
        self.sched = Scheduler(vllm_config=self.vc, kv_cache_config=kcc,
                               structured_output_manager=StructuredOutputManager(self.vc),
                               block_size=block, log_stats=True)
        self.conn = self.sched.connector
        self.workers = [_worker(self.vc, kcc, r, tp) for r in range(tp)]
        self.worker = self.workers[0]
        self.kvs = [{n: torch.zeros(2, num_blocks, block, self.heads, HEAD_DIM, dtype=tdtype) for n in LAYERS}
                    for _ in range(tp)]
        self.kv = self.kvs[0]
        self.rank = 0  # the rank whose forward ``fill`` runs for (its KV is ``kv`` meanwhile)
        for w, kv in zip(self.workers, self.kvs):
            w.register_kv_caches(kv)
        hand_shake(self.conn, self.workers)
        self.aggregator = KVOutputAggregator(tp)
        self.invalid = set()

    def _sampled(self, rid):
        """What the model samples for ``rid`` this step: nothing while its prefill is partial
        (a chunk before the last, as vLLM's model runner does), else one token."""
        r = self.sched.requests.get(rid)
        if r is not None and r.num_computed_tokens < r.num_prompt_tokens:
            return []
        return [7]

    def free_blocks(self):
        return self.sched.kv_cache_manager.block_pool.get_num_free_blocks()

    def step(self, fill=None):
        """One engine step: schedule, run the worker hooks around a stand-in forward (``fill``
        writes each scheduled prefill's KV), feed the connector output back. ``start_load_kv``
        comes where this vLLM calls it: before the forward, or after it (vLLM 0.33, when no
        load of the step is synchronous)."""
        so = self.sched.schedule()
        after = START_LOAD_AFTER_FORWARD and not getattr(so, "has_sync_kv_loads", False)
        # The ranks run each phase in turn (in vLLM they run it at the same time).
        for w in self.workers:
            w.bind_connector_metadata(so.kv_connector_metadata)
            if not after:
                w.start_load_kv(None)
        for li, name in enumerate(LAYERS):
            for r, w in enumerate(self.workers):
                if fill is not None:
                    self.rank, self.kv = r, self.kvs[r]
                    fill(self, so, li, name)
                w.save_kv_layer(name, self.kvs[r][name], attn_metadata=object())
        self.rank, self.kv = 0, self.kvs[0]
        for w in self.workers:
            if after:
                w.start_load_kv(None)
            w.wait_for_save()
        ids = list(so.num_scheduled_tokens.keys())
        outs = []
        for w in self.workers:
            sending, recving = w.get_finished(so.finished_req_ids)
            invalid = w.get_block_ids_with_load_errors()
            w.clear_connector_metadata()
            outs.append(ModelRunnerOutput(
                req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                sampled_token_ids=[self._sampled(r) for r in ids], logprobs=None, prompt_logprobs_dict={},
                pooler_output=None,
                kv_connector_output=KVConnectorOutput(finished_sending=sending, finished_recving=recving,
                                                      invalid_block_ids=invalid),
            ))
        # One rank: its output as it is; more: merged as vLLM's executor merges them.
        out = outs[0] if self.tp == 1 else self.aggregator.aggregate(outs)
        self.invalid |= out.kv_connector_output.invalid_block_ids
        self.sched.update_from_output(so, out)
        return so

    def close(self):
        for w in self.workers:
            w.shutdown()
        self.conn.shutdown()


def make_request(rid, tokens, params, max_tokens=4, block=BLOCK, prompt=None):
    """A request of ``tokens`` prompt tokens derived from ``rid`` (or the token ids ``prompt``)."""
    global _init
    if not _init:
        init_none_hash(sha256)
        _init = True
    sp = SamplingParams(max_tokens=max_tokens)
    sp.update_from_generation_config({}, EOS)
    ids = list(prompt) if prompt is not None else [(rid.__hash__() + i) % 900 + 1 for i in range(tokens)]
    req = Request(request_id=rid, prompt_token_ids=ids,
                  sampling_params=sp, pooling_params=None, block_hasher=get_request_block_hasher(block, sha256))
    req.kv_transfer_params = params
    return req


def kv_pattern(rid, layer, block_index, rank=0, heads=HEADS):
    """What P's stand-in forward writes for block ``block_index`` of request ``rid`` (TP rank
    ``rank``'s shard of ``heads`` heads; every rank's differs)."""
    seed = hash((rid, layer, block_index) if rank == 0 else (rid, layer, block_index, rank))
    g = torch.Generator().manual_seed(seed & 0x7FFFFFFF)
    return torch.rand(2, BLOCK, heads, HEAD_DIM, generator=g)


def p_fill(side, so, li, name):
    """P's stand-in attention: writes the KV of every prefill scheduled in this step (the shard
    of TP rank ``side.rank``)."""
    for new in so.scheduled_new_reqs:
        for i, b in enumerate(new.block_ids[0]):
            side.kv[name][:, b] = kv_pattern(new.req_id.split("/")[-1], li, i, side.rank, side.heads)


# ---- shared by the connector test files -------------------------------------------------------

MAX_STEPS = 60  # every stepping loop of the tests is bounded
# s: both sides step on one thread in these tests, so a step stalled on a loaded box must not
# look like a dead peer; tests about liveness pass their own value.
PEER_TIMEOUT = 600.0


def d_request(rid, p, tokens=40, prompt=None):
    return make_request(f"d/{rid}", tokens, {"do_remote_prefill": True, "transfer_id": rid,
                                             "remote_control": p.conn.control_addr}, prompt=prompt)


def p_request(rid, d, tokens=40, prompt=None):
    return make_request(f"p/{rid}", tokens, {"do_remote_decode": True, "transfer_id": rid,
                                             "remote_control": d.conn.control_addr}, max_tokens=1, prompt=prompt)


#: Every stepping loop of the tests is bounded by this deadline (seconds): it only bounds a
#: hang (the connector's own threads move messages and bytes between steps), no assertion
#: depends on it.
WAIT_S = 120.0


def run_until(cond, *steps, max_steps=None):
    """Steps ``steps`` until ``cond()`` holds (True), the step budget is spent or ``WAIT_S``
    passed (False). Between rounds it yields briefly to the connector's threads."""
    end = time.monotonic() + WAIT_S
    n = 0
    while time.monotonic() < end and (max_steps is None or n < max_steps):
        if cond():
            return True
        for s in steps:
            s()
        n += 1
        time.sleep(0.002)
    return cond()


def wait_for(cond, timeout=WAIT_S):
    """Waits (without stepping) until ``cond()`` holds; bounds a hang only."""
    return _wait_for(cond, timeout)


def open_pair(sides, mdir, d_extra=None, p_extra=None, roles=("kv_consumer", "kv_producer"), d_kw=None, p_kw=None,
              d_listen=None, p_listen=None):
    """A D and a P :class:`Side` that know each other, appended to ``sides`` (the test's fixture
    closes them). Transport ``auto`` (shm on this host; ``KVWIRE_TEST_TRANSPORT=tcp`` forces
    TCP). Both sides step on the test's one thread, so a side is silent for as long as the
    other's step runs: peer liveness (a wall-clock judgement) would declare a peer down whenever
    a step stalls on a loaded box, hence ``PEER_TIMEOUT`` (tests about liveness pass their own)."""
    base = {"transport": os.environ.get("KVWIRE_TEST_TRANSPORT", "auto"), "peer_timeout": PEER_TIMEOUT}
    d = Side(roles[0], {**base, "data_listen": d_listen or f"127.0.0.1:{free_port()}", **(d_extra or {})}, mdir,
             **(d_kw or {}))
    sides.append(d)
    p = Side(roles[1], {**base, "data_listen": p_listen or f"127.0.0.1:{free_port()}", **(p_extra or {})}, mdir,
             **(p_kw or {}))
    sides.append(p)
    introduce(d, p)
    return d, p


def introduce(*sides):
    """Makes every side know every other's identity (the hello round trip a first request to a
    new peer waits for), so that a test's first step behaves as any later one."""
    for a in sides:
        for b in sides:
            if a is not b:
                a.conn._sched.control.probe(b.conn.control_addr)
    for a in sides:
        for b in sides:
            if a is not b:
                # What a request's first use of the address checks (SchedulerSide._pid_for_addr):
                # the engine there known, and its hello reply handled by the driver thread, which
                # may come a little after the control plane recorded the engine.
                sa, addr = a.conn._sched, b.conn.control_addr
                assert wait_for(lambda: addr in sa.control.engine_at and addr in sa.answered), "no hello"


def sched_side(side):
    return side.conn._sched


def d_core(side):
    """The D core of ``side`` (one policy in these tests)."""
    (core,) = side.conn._sched.d_cores.values()
    return core


def p_core(side):
    (core,) = side.conn._sched.p_cores.values()
    return core


def p_delayed(side):
    """P requests whose blocks vLLM holds until the connector releases them."""
    return {r for r, st in side.conn._sched.p_reqs.items() if st.delayed}


def d_delayed(side):
    return {r for r, st in side.conn._sched.d_reqs.items() if st.delayed}


def timeline(side, n=1):
    """The timeline records ``side`` wrote (JSON lines), waiting until at least ``n`` are there."""
    def read():
        out = []
        for f in sorted(os.listdir(side.timeline_dir)):
            with open(os.path.join(side.timeline_dir, f)) as fh:
                out += [line.strip() for line in fh if line.strip()]
        return out
    wait_for(lambda: len(read()) >= n, timeout=30)
    return read()


@pytest.fixture(scope="module")
def mdir():
    """The stand-in model's directory (a pytest fixture; import it into a test module)."""
    return model_dir()


@pytest.fixture
def pair(mdir):
    """``pair(d_extra, p_extra, roles=..., p_kw=None, **d_kw)`` -> (D, P), closed after the test
    (a pytest fixture; import it into a test module)."""
    sides = []
    yield lambda d_extra=None, p_extra=None, roles=("kv_consumer", "kv_producer"), p_kw=None, **kw: open_pair(
        sides, mdir, d_extra, p_extra, roles, d_kw=kw, p_kw=p_kw)
    for s in sides:
        s.close()


def holds(t, rid, block_ids):
    """Whether ``t`` (a layer dict: a cache, or mirrors of one) holds P's bytes of ``rid`` in
    ``block_ids``, K and V of every layer."""
    return all(torch.equal(t[name][:, b], kv_pattern(rid, li, i))
               for li, name in enumerate(LAYERS) for i, b in enumerate(block_ids))


def empty(t, block_ids):
    """Whether no byte of ``block_ids`` is set in ``t`` (a layer dict)."""
    return not any(t[name][:, b].any() for name in LAYERS for b in block_ids)


def layer_holds(t, rid, li, block_ids):
    """Whether layer ``li`` of ``t`` holds P's bytes of ``rid`` in ``block_ids`` (K and V)."""
    return all(torch.equal(t[LAYERS[li]][:, b], kv_pattern(rid, li, i)) for i, b in enumerate(block_ids))


def layer_empty(t, li, block_ids):
    return not any(t[LAYERS[li]][:, b].any() for b in block_ids)


def record_copies(d):
    """Logs ``(req, layers)`` of every landing copy D's worker starts."""
    land, seen = d.worker._worker.land, []
    real = land.copy_all

    def copy_all(items):
        seen.extend((req, None if layers is None else list(layers)) for req, _, _, layers in items)
        return real(items)

    land.copy_all = copy_all
    return seen


def hold_layer(p, layer):
    """P posts no write of ``layer`` until the returned ``release()``: D cannot see it land."""
    w = p.worker._worker
    real, on = w._pump, [True]

    def pump(s, li):
        if not (on[0] and li == layer):
            real(s, li)

    def release():
        on[0] = False
        with w.lock:
            for s in list(w.sends.values()):
                real(s, layer)

    w._pump = pump
    return release


def assert_no_leak(side):
    assert side.free_blocks() == side.num_blocks - 1, "blocks leaked"
    assert not side.sched.requests, "requests left in the scheduler"


__all__ = ["Side", "open_pair", "make_request", "kv_pattern", "p_fill", "free_port", "model_dir", "RequestStatus", "LAYERS",
           "MAX_STEPS", "PEER_TIMEOUT", "d_request", "p_request", "run_until", "assert_no_leak", "wait_for",
           "layer_holds", "layer_empty", "record_copies", "hold_layer",
           "sched_side", "d_core", "p_core", "p_delayed", "d_delayed", "timeline", "WAIT_S", "introduce", "holds",
           "empty", "mdir", "pair"]
