"""A P/D pair of real vLLM v1 Schedulers on CPU, each with KvwireConnector loaded through vLLM's
own factory (kv_connector_module_path) in both roles, and a stand-in model runner that drives
the worker halves with CPU tensors as the KV cache (built like vLLM's
tests/v1/kv_connector/unit/utils.py, with a local 2-layer model config: no download)."""

import json
import os
import socket
import tempfile

import torch
from vllm import SamplingParams
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
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


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


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


def vllm_config(kv_role, extra, mdir, load_failure_policy="fail"):
    mc = ModelConfig(model=mdir, skip_tokenizer_init=True, dtype="float32", seed=42, max_model_len=2048)
    sc = SchedulerConfig(
        max_num_seqs=16, max_num_batched_tokens=1024, max_model_len=2048,
        enable_chunked_prefill=True, is_encoder_decoder=False,
    )
    cc = CacheConfig(block_size=BLOCK, gpu_memory_utilization=0.9, enable_prefix_caching=True)
    kt = KVTransferConfig(
        kv_connector="KvwireConnector", kv_connector_module_path="kvwire.vllm", kv_role=kv_role,
        kv_connector_extra_config=extra, kv_load_failure_policy=load_failure_policy,
    )
    vc = VllmConfig(scheduler_config=sc, model_config=mc, cache_config=cc, kv_transfer_config=kt,
                    device_config=DeviceConfig("cpu"))
    vc.scheduler_config.async_scheduling = False
    return vc


def kv_cache_config(num_blocks):
    return KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), FullAttentionSpec(
            block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_DIM, dtype=torch.float32))],
    )


class Side:
    """One vLLM instance: a real Scheduler (with the scheduler-side connector built by vLLM)
    plus a worker-side connector over CPU KV tensors of shape [2, blocks, BLOCK, HEADS, DIM]."""

    def __init__(self, kv_role, extra, mdir, num_blocks=64, **kw):
        self.num_blocks = num_blocks
        self.vc = vllm_config(kv_role, extra, mdir, **kw)
        kcc = kv_cache_config(num_blocks)
        self.vc.cache_config.num_gpu_blocks = num_blocks
        self.sched = Scheduler(vllm_config=self.vc, kv_cache_config=kcc,
                               structured_output_manager=StructuredOutputManager(self.vc),
                               block_size=BLOCK, log_stats=True)
        self.conn = self.sched.connector
        self.worker = KVConnectorFactory.create_connector(self.vc, KVConnectorRole.WORKER, kcc)
        self.kv = {n: torch.zeros(2, num_blocks, BLOCK, HEADS, HEAD_DIM) for n in LAYERS}
        self.worker.register_kv_caches(self.kv)
        self.invalid = set()

    def free_blocks(self):
        return self.sched.kv_cache_manager.block_pool.get_num_free_blocks()

    def step(self, fill=None):
        """One engine step: schedule, run the worker hooks around a stand-in forward (``fill``
        writes each scheduled prefill's KV), feed the connector output back."""
        so = self.sched.schedule()
        w = self.worker
        w.bind_connector_metadata(so.kv_connector_metadata)
        w.start_load_kv(None)
        for li, name in enumerate(LAYERS):
            if fill is not None:
                fill(self, so, li, name)
            w.save_kv_layer(name, self.kv[name], attn_metadata=object())
        w.wait_for_save()
        sending, recving = w.get_finished(so.finished_req_ids)
        invalid = w.get_block_ids_with_load_errors()
        self.invalid |= invalid
        w.clear_connector_metadata()
        ids = list(so.num_scheduled_tokens.keys())
        out = ModelRunnerOutput(
            req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=[[7] for _ in ids], logprobs=None, prompt_logprobs_dict={},
            pooler_output=None,
            kv_connector_output=KVConnectorOutput(finished_sending=sending, finished_recving=recving,
                                                  invalid_block_ids=invalid),
        )
        self.sched.update_from_output(so, out)
        return so

    def close(self):
        self.worker.shutdown()
        self.conn.shutdown()


def make_request(rid, tokens, params, max_tokens=4):
    global _init
    if not _init:
        init_none_hash(sha256)
        _init = True
    sp = SamplingParams(max_tokens=max_tokens)
    sp.update_from_generation_config({}, EOS)
    req = Request(request_id=rid, prompt_token_ids=[(rid.__hash__() + i) % 900 + 1 for i in range(tokens)],
                  sampling_params=sp, pooling_params=None, block_hasher=get_request_block_hasher(BLOCK, sha256))
    req.kv_transfer_params = params
    return req


def kv_pattern(rid, layer, block_index):
    """What P's stand-in forward writes for block ``block_index`` of request ``rid``."""
    g = torch.Generator().manual_seed(hash((rid, layer, block_index)) & 0x7FFFFFFF)
    return torch.rand(2, BLOCK, HEADS, HEAD_DIM, generator=g)


def p_fill(side, so, li, name):
    """P's stand-in attention: writes the KV of every prefill scheduled in this step."""
    for new in so.scheduled_new_reqs:
        for i, b in enumerate(new.block_ids[0]):
            side.kv[name][:, b] = kv_pattern(new.req_id.split("/")[-1], li, i)


__all__ = ["Side", "make_request", "kv_pattern", "p_fill", "free_port", "model_dir", "RequestStatus", "LAYERS"]
