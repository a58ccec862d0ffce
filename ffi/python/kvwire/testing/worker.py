"""``StandInWorker``: a vLLM worker with no model, for ``vllm serve --worker-cls`` on CPU.

It does what vLLM's GPU worker and model runner do around the model, with vLLM's own pieces
wherever they exist, so a KV connector loaded into the server sees the calls it sees on GPUs:

* start-up: the distributed groups (gloo), ``ensure_kv_transfer_initialized``, KV caches
  allocated in vLLM's layout (0.33: ``allocate_kv_cache``, one backing buffer, a
  ``[blocks, kv_heads, block_size, 2 * head_size]`` view per layer; 0.18.1: a
  ``(2, blocks, kv_heads, block_size, head_size)`` tensor per layer, the CPU backend's shape),
  ``register_kv_caches``, the handshake metadata keyed as each version expects;
* every step: ``handle_preemptions`` (as each version calls it), an empty step through
  ``KVConnectorModelRunnerMixin.kv_connector_no_forward``, a step with tokens inside
  ``set_forward_context`` and ``maybe_get_kv_connector_output`` (bind, start_load_kv,
  wait_for_save, get_finished, load errors, stats, clear), with ``wait_for_layer_load`` and
  ``save_kv_layer`` around each layer exactly where the attention wrapper calls them;
* ``execute_model`` returns ``None`` when tokens were scheduled and the output comes from
  ``sample_tokens``; a chunk that does not end its prefill samples nothing.

The "model" is :mod:`kvwire.testing.model`: each computed position's K/V is written into the
request's blocks, layer by layer, and the next token is read from the cache. Outside control
(per-layer compute time, holding a layer) is :mod:`kvwire.testing.control`.

Test hook: a request whose ``kv_transfer_params`` carry ``"kvwire_test_corrupt": true`` gets one
byte of its K/V flipped (layer 0, position 0) on this instance when it is first scheduled here
with KV it did not compute (a D that received it), before anything is read: the output must then
differ from a single instance's. ``"kvwire_test_corrupt_sent": true`` flips that byte on the
instance that computes the request's prefill (a P), after layer 0 of its first step was computed
and before that layer is handed to the connector: what P sends of block 0 is then wrong, so a D
that takes block 0 from P differs, and a D that had it cached (a prefix hit) must not.

Environment: ``KVWIRE_STANDIN_KV_MB`` (memory reported for the KV cache, default 64; or use
``--num-gpu-blocks-override``), plus the control variables of :mod:`kvwire.testing.control`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
from vllm.distributed.kv_transfer import (
    ensure_kv_transfer_initialized,
    ensure_kv_transfer_shutdown,
    get_kv_transfer_group,
    has_kv_transfer_group,
)
from vllm.distributed.parallel_state import (
    ensure_model_parallel_initialized,
    get_pp_group,
    get_tp_group,
    init_distributed_environment,
)
from vllm.forward_context import set_forward_context
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput
from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin as _KVMix
from vllm.v1.worker.worker_base import WorkerBase

from kvwire.testing import model as _model
from kvwire.testing.control import WorkerControl

try:  # 0.33: compile_or_warm_up_model returns CompilationTimes; 0.18.1: a float
    from vllm.v1.worker.worker_base import CompilationTimes
except ImportError:  # pragma: no cover - version dependent
    CompilationTimes = None

_V033 = CompilationTimes is not None


def layer_name(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


@dataclass
class _Req:
    tokens: list  # every token id known so far (prompt, then sampled)
    blocks: list  # block ids in order (group 0)
    computed: int  # positions whose K/V is in the cache (as the scheduler says)
    params: dict
    hashes: list = field(default_factory=list)  # prefix hash of each known position
    seen_external: bool = False
    steps: int = 0  # steps that computed tokens of it here


class _LayerKV:
    """One layer's KV tensor in either version's layout, addressed as (block, slot)."""

    def __init__(self, t: torch.Tensor, head_dim: int):
        self.t = t
        self.d = head_dim
        self.split = t.dim() == 5 and t.shape[0] == 2  # (2, B, H, N, D)

    def write(self, blocks: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        if self.split:
            self.t[0, blocks, :, slots, :] = k
            self.t[1, blocks, :, slots, :] = v
        else:  # [B, H, N, 2D]
            self.t[blocks, :, slots, : self.d] = k
            self.t[blocks, :, slots, self.d:] = v

    def read(self, blocks: list, n: int) -> torch.Tensor:
        """K and V of positions ``0..n-1`` as ``[2, n, H, D]``."""
        idx = torch.tensor(blocks, dtype=torch.long)
        if self.split:
            x = self.t[:, idx]  # [2, nb, H, N, D]
            x = x.permute(0, 1, 3, 2, 4).reshape(2, -1, x.shape[2], x.shape[4])
            return x[:, :n]
        x = self.t[idx]  # [nb, H, N, 2D]
        x = x.permute(0, 2, 1, 3).reshape(-1, x.shape[1], x.shape[3])[:n]
        return torch.stack([x[..., : self.d], x[..., self.d:]])

    def flip_byte(self, block: int) -> None:
        row = self.t[0, block] if self.split else self.t[block]
        b = row.view(torch.uint8).reshape(-1)
        b[0] ^= 0x01


class StandInWorker(WorkerBase):
    """See the module docstring. Test-only."""

    def __init__(self, vllm_config, local_rank, rank, distributed_init_method, is_driver_worker=False):
        super().__init__(vllm_config=vllm_config, local_rank=local_rank, rank=rank,
                         distributed_init_method=distributed_init_method,
                         is_driver_worker=is_driver_worker)
        mc, pc = self.model_config, self.parallel_config
        self.num_layers = mc.get_num_layers(pc)
        self.kv_heads = mc.get_num_kv_heads(pc)
        self.head_dim = mc.get_head_size()
        self.vocab = mc.get_vocab_size()
        self.dtype = mc.dtype
        self.dtype_name = str(self.dtype).removeprefix("torch.")
        self.reqs: dict[str, _Req] = {}
        self.kv: dict[str, _LayerKV] = {}
        self._pending = None
        self._probed: set = set()
        self.control = WorkerControl(rank)

    # ---- start-up ----
    def init_device(self):
        torch.set_num_threads(1)
        self.device = torch.device("cpu")
        pc = self.parallel_config
        init_distributed_environment(pc.world_size, self.rank, self.distributed_init_method,
                                     self.local_rank, "gloo")
        ensure_model_parallel_initialized(pc.tensor_parallel_size, pc.pipeline_parallel_size)

    def load_model(self, **kwargs):
        return None

    def get_kv_cache_spec(self):
        spec = FullAttentionSpec(block_size=self.cache_config.block_size, num_kv_heads=self.kv_heads,
                                 head_size=self.head_dim, dtype=self.dtype)
        return {layer_name(i): spec for i in range(self.num_layers)}

    def determine_available_memory(self):
        return int(float(os.environ.get("KVWIRE_STANDIN_KV_MB", "64")) * (1 << 20))

    def initialize_from_config(self, kv_cache_config):
        self.cache_config.num_gpu_blocks = kv_cache_config.num_blocks
        kt = self.vllm_config.kv_transfer_config
        if kt is not None and kt.kv_connector == "MooncakeConnector":
            # vLLM's MooncakeConnector worker asks torch for the current CUDA device, which
            # raises without an NVIDIA driver; on this CPU stand-in it is device 0. Nothing else
            # of it is changed.
            import torch

            torch.accelerator.current_device_index = lambda: 0
        ensure_kv_transfer_initialized(self.vllm_config, kv_cache_config)
        caches = self._allocate(kv_cache_config)
        self.kv = {name: _LayerKV(t, self.head_dim) for name, t in caches.items()}
        self.kv_tensors = caches
        if has_kv_transfer_group():
            g = get_kv_transfer_group()
            g.register_kv_caches(caches)
            if hasattr(g, "set_host_xfer_buffer_ops"):
                from vllm.distributed.kv_transfer.kv_connector.utils import copy_kv_blocks

                g.set_host_xfer_buffer_ops(copy_kv_blocks)

    def _allocate(self, kcc) -> dict:
        spec = next(iter(self.get_kv_cache_spec().values()))
        if _V033:
            from vllm.v1.worker.utils import allocate_kv_cache

            try:
                layout = self.cache_config.get_resolved_kv_cache_layout()
            except Exception:  # noqa: BLE001 - not resolved: the CPU default
                from vllm.v1.kv_cache_layout import KVCacheLayout

                layout = KVCacheLayout.LBHNC
            return allocate_kv_cache(kcc, torch.device("cpu"), layout)
        out = {}
        for t in kcc.kv_cache_tensors:
            raw = torch.zeros(t.size, dtype=torch.int8)
            n = t.size // spec.page_size_bytes
            for name in t.shared_by:
                out[name] = raw.view(spec.dtype).view(2, n, spec.num_kv_heads, spec.block_size, spec.head_size)
        return out

    def compile_or_warm_up_model(self):
        return CompilationTimes(0.0, 0.0) if _V033 else 0.0

    def get_supported_tasks(self):
        return ("generate",)

    def check_health(self):
        return None

    def get_kv_connector_handshake_metadata(self):
        if not has_kv_transfer_group():
            return None
        meta = get_kv_transfer_group().get_handshake_metadata()
        if meta is None:
            return None
        tp = get_tp_group().rank_in_group
        return {(get_pp_group().rank_in_group, tp): meta} if _V033 else {tp: meta}

    def shutdown(self):
        ensure_kv_transfer_shutdown()

    # ---- per step ----
    def _track(self, so):
        for rid in so.finished_req_ids:
            self.reqs.pop(rid, None)
        for nr in so.scheduled_new_reqs:
            params = {}
            sp = nr.sampling_params
            if sp is not None and getattr(sp, "extra_args", None):
                params = sp.extra_args.get("kv_transfer_params") or {}
            self.reqs[nr.req_id] = _Req(tokens=list(nr.prompt_token_ids or []),
                                        blocks=list(nr.block_ids[0]) if nr.block_ids else [],
                                        computed=nr.num_computed_tokens, params=params)
        cr = so.scheduled_cached_reqs
        for i, rid in enumerate(cr.req_ids):
            r = self.reqs.get(rid)
            if r is None:
                continue
            nb = cr.new_block_ids[i]
            if rid in cr.resumed_req_ids:
                r.blocks = list(nb[0]) if nb else []
            elif nb:
                r.blocks.extend(nb[0])
            r.computed = cr.num_computed_tokens[i]
            if rid in cr.all_token_ids:
                r.tokens = list(cr.all_token_ids[rid])

    def _hashes(self, r: _Req, upto: int) -> list:
        if len(r.hashes) < upto:
            start = r.hashes[-1] if r.hashes else 0
            r.hashes += _model.prefix_hashes(r.tokens[len(r.hashes):upto], start)
        return r.hashes

    def execute_model(self, scheduler_output):
        so = scheduler_output
        self._track(so)
        if has_kv_transfer_group():
            c = get_kv_transfer_group()
            if _V033:
                c.handle_preemptions(so.kv_connector_metadata)
            elif so.preempted_req_ids:
                c.handle_preemptions(so.preempted_req_ids)
        self._probe()
        self.control.begin_step(so.total_num_scheduled_tokens, so.num_scheduled_tokens)
        if so.total_num_scheduled_tokens == 0:
            if not has_kv_transfer_group():
                return EMPTY_MODEL_RUNNER_OUTPUT
            return _KVMix.kv_connector_no_forward(so, self.vllm_config)
        # What each layer writes this step: (blocks, slots, prefix hashes) of every computed
        # position, all requests together.
        bl, sl, hs = [], [], []
        prefill = last_chunk = False
        flip_sent = []
        bs = self.cache_config.block_size
        for rid, n in so.num_scheduled_tokens.items():
            r = self.reqs[rid]
            if r.computed > 0 and not r.seen_external and r.params.get("kvwire_test_corrupt"):
                self._corrupt(rid, r)
            r.seen_external = True
            lo, hi = r.computed, r.computed + n
            prefill |= hi < len(r.tokens) or lo + 1 < hi
            last_chunk |= r.steps > 0 and hi == len(r.tokens) and n > 1
            if r.steps == 0 and r.params.get("kvwire_test_corrupt_sent"):
                flip_sent.append(rid)
            r.steps += 1
            h = self._hashes(r, hi)
            for p in range(lo, hi):
                bl.append(r.blocks[p // bs])
                sl.append(p % bs)
                hs.append(h[p])
        blocks = torch.tensor(bl, dtype=torch.long)
        slots = torch.tensor(sl, dtype=torch.long)
        md = {name: SimpleNamespace(num_tokens=len(bl)) for name in self.kv}
        with set_forward_context(attn_metadata=md, vllm_config=self.vllm_config, num_tokens=len(bl)), \
                _KVMix.maybe_get_kv_connector_output(so) as kvo:
            live = has_kv_transfer_group() and get_kv_transfer_group().has_connector_metadata()
            for layer in range(self.num_layers):
                name = layer_name(layer)
                self.control.before_layer(layer, last_chunk)
                if live:
                    get_kv_transfer_group().wait_for_layer_load(name)
                k, v = _model.kv_values(hs, layer, self.kv_heads, self.head_dim)
                self.kv[name].write(blocks, slots, torch.from_numpy(k).to(self.dtype),
                                    torch.from_numpy(v).to(self.dtype))
                self.control.compute()
                if layer == 0:
                    for rid in flip_sent:
                        self._corrupt(rid, self.reqs[rid], "sent")
                if live:
                    get_kv_transfer_group().save_kv_layer(name, self.kv_tensors[name], md[name])
                if prefill:
                    self.control.event(ev="layer", layer=layer)
        self._pending = (so, kvo)
        return None

    def sample_tokens(self, grammar_output):
        so, kvo = self._pending
        self._pending = None
        ids = list(so.num_scheduled_tokens)
        sampled = []
        for rid in ids:
            r = self.reqs[rid]
            n = so.num_scheduled_tokens[rid]
            end = r.computed + n
            r.computed = end
            if end < len(r.tokens):  # a chunk that does not end the prefill
                sampled.append([])
                continue
            t = self._read_next(r, end)
            r.tokens.append(t)
            sampled.append([t])
        out = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                sampled_token_ids=sampled)
        out.kv_connector_output = kvo
        return out

    def _read_next(self, r: _Req, n: int) -> int:
        per_layer = []
        for layer in range(self.num_layers):
            x = self.kv[layer_name(layer)].read(r.blocks, n)
            per_layer.append(x.contiguous().view(torch.uint8).numpy().tobytes())
        return _model.next_token(per_layer, self.vocab)

    def _probe(self) -> None:
        """Looks for the K/V a test's probe names (see :mod:`kvwire.testing.control`) in every
        block of the KV cache and of the connector's landing pool."""
        spec = self.control.probe()
        if spec is None or spec["id"] in self._probed or not self.kv:
            return
        name = layer_name(spec["layer"])
        if name not in self.kv:
            return
        k, v = _model.kv_values(_model.prefix_hashes(spec["tokens"]), spec["layer"], self.kv_heads, self.head_dim)
        want = torch.stack([torch.from_numpy(k), torch.from_numpy(v)]).to(self.dtype)  # [2, n, H, D]
        n, bs = want.shape[1], self.cache_config.block_size
        if n == 0 or n > bs:
            return
        places = [("cache", self.kv[name])]
        pool = getattr(get_kv_transfer_group(), "landing_pool", None) if has_kv_transfer_group() else None
        if pool is not None and pool(name) is not None:
            places.append(("landing", _LayerKV(pool(name), self.head_dim)))
        if spec.get("in"):
            places = [p for p in places if p[0] == spec["in"]]
        found = []
        for where, lkv in places:
            nb = lkv.t.shape[1] if lkv.split else lkv.t.shape[0]
            x = lkv.read(list(range(nb)), nb * bs).reshape(2, nb, bs, *want.shape[2:])[:, :, :n]
            hit = (x == want[:, None]).reshape(2, nb, -1).all(-1).all(0)
            found += [{"in": where, "block": int(b)} for b in hit.nonzero().flatten().tolist()]
        if found:
            self._probed.add(spec["id"])
            self.control.event(ev="probe", id=spec["id"], found=found)

    def _corrupt(self, rid: str, r: _Req, what: str = "received") -> None:
        if not r.blocks:
            return
        self.kv[layer_name(0)].flip_byte(r.blocks[0])
        self.control.event(ev="corrupt", req=rid, block=r.blocks[0], what=what)

    # vLLM asks for these on some paths; the stand-in has no model.
    def get_model(self):
        return None

    def get_cache_block_size_bytes(self):
        spec = next(iter(self.get_kv_cache_spec().values()))
        return spec.page_size_bytes


__all__ = ["StandInWorker", "layer_name"]
