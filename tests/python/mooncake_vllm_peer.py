"""One vLLM instance (P or D) running vLLM's OWN MooncakeConnector with ``mooncake.engine``
resolved to kvwire's drop-in, in a process of its own.

``mooncake.engine`` comes from the shim package that ``python -m kvwire.mooncake shim DIR``
writes (the same file users put on PYTHONPATH); nothing of MooncakeConnector is replaced. The
scheduler side runs in vLLM's real v1 Scheduler (CPU); the worker side gets CPU KV tensors in
the layout vLLM's model runner would allocate for the connector. What cannot run on a machine
without a GPU is patched, and only that (see ``_cpu_patches``):

* ``torch.accelerator.current_device_index`` (raises without an NVIDIA driver) -> device 0;
* ``current_platform.set_device`` (UnspecifiedPlatform raises NotImplementedError) -> no-op;
* the attention backend lookup: no model is loaded here (the static forward context is empty)
  and UnspecifiedPlatform names no backend, so the lookup returns the backend a GPU
  deployment resolves for this model (FlashAttention), which only informs block sizes.

Commands are served over a pipe (kvpeer._serve)."""

import hashlib
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

BLOCK = 16
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
HEADS, HEAD_DIM = 2, 64
NUM_BLOCKS = 64


def kv_block_pattern(rid, layer, index, shape):
    """What P's stand-in forward writes into block ``index`` (of the request) of ``layer``."""
    import torch

    g = torch.Generator().manual_seed(int(hashlib.sha256(f"{rid}/{layer}/{index}".encode()).hexdigest()[:8], 16))
    return torch.rand(*shape, generator=g)


def block_bytes(t):
    import torch

    return t.contiguous().view(torch.uint8).numpy().tobytes()


def _cpu_patches(mc):
    """The CUDA-only calls of MooncakeConnectorWorker, made to work on CPU (see module doc)."""
    import torch
    from vllm.platforms import current_platform

    torch.accelerator.current_device_index = lambda: 0  # 0.33: captured before initialize()
    type(current_platform).set_device = classmethod(lambda cls, device: None)
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend

    if hasattr(mc, "get_current_attn_backends"):  # 0.33
        mc.get_current_attn_backends = lambda vllm_config, layer_names=None: [FlashAttentionBackend]
    if hasattr(mc, "get_current_attn_backend"):  # 0.18.1
        mc.get_current_attn_backend = lambda vllm_config, layer_names=None: FlashAttentionBackend


def listen_port():
    """A free port outside the kernel's ephemeral range, so no outgoing connection of another
    process (gloo, ZMQ, HTTP clients) can take it between now and the bind in the P process."""
    import random
    import socket

    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(max(1024, low - 12000), low)
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
                return port
            except OSError:
                continue
    raise RuntimeError("no free port below the ephemeral range")


def vllm_version():
    import importlib.metadata as md

    return tuple(int(x) for x in md.version("vllm").split(".")[:2])


class Instance:
    def __init__(self, role, engine_id, bootstrap_port, shim_dir, mdir, protocol="tcp"):
        os.environ["VLLM_HOST_IP"] = "127.0.0.1"  # every address vLLM publishes is loopback
        os.environ["VLLM_MOONCAKE_BOOTSTRAP_PORT"] = str(bootstrap_port)
        sys.path.insert(0, shim_dir)
        import torch  # noqa: F401
        import vllm_harness as h
        from vllm.config import KVTransferConfig, set_current_vllm_config
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.distributed.parallel_state import (
            ensure_model_parallel_initialized,
            init_distributed_environment,
        )
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager

        import mooncake.engine
        from vllm.distributed.kv_transfer.kv_connector.v1.mooncake import mooncake_connector as mc

        # The connector resolved mooncake.engine to kvwire's drop-in, nothing else.
        import kvwire.mooncake

        assert mooncake.engine.TransferEngine is kvwire.mooncake.TransferEngine
        self._record_engine_calls(kvwire.mooncake.TransferEngine)
        self.log = []
        self._capture_log(mc.logger)
        assert mc.TransferEngine is kvwire.mooncake.TransferEngine, mc.TransferEngine
        _cpu_patches(mc)
        self.mc = mc
        self.role = role
        vc = h.vllm_config(role, {}, mdir)
        vc.kv_transfer_config = KVTransferConfig(
            kv_connector="MooncakeConnector", kv_role=role, engine_id=engine_id,
            kv_connector_extra_config={"mooncake_protocol": protocol, "num_workers": 2},
        )
        self.vc = vc
        self.ctx = set_current_vllm_config(vc)
        self.ctx.__enter__()
        init_distributed_environment(
            world_size=1, rank=0, local_rank=0, backend="gloo",
            distributed_init_method=f"tcp://127.0.0.1:{h.free_port()}",
        )
        ensure_model_parallel_initialized(1, 1)
        self.kcc, self.kv = self._kv_cache()
        vc.cache_config.num_gpu_blocks = NUM_BLOCKS
        self.sched = Scheduler(vllm_config=vc, kv_cache_config=self.kcc,
                               structured_output_manager=StructuredOutputManager(vc),
                               block_size=BLOCK, log_stats=True)
        self.conn = self.sched.connector
        assert type(self.conn) is mc.MooncakeConnector
        self.worker = KVConnectorFactory.create_connector(vc, KVConnectorRole.WORKER, self.kcc)
        assert type(self.worker) is mc.MooncakeConnector
        self.worker.register_kv_caches(self.kv)
        self.engine = self.worker.connector_worker.engine
        assert isinstance(self.engine, kvwire.mooncake.TransferEngine)
        self.reqs = {}
        self.filled = {}
        self.invalid = set()
        self.failed = set()
        self.stats = []

    def _record_engine_calls(self, cls):
        """Records, in order, every TransferEngine method the connector calls (all threads),
        by the interpreter's profiling hook: nothing of the engine or the connector wrapped."""
        import threading

        self.engine_calls = []

        def prof(frame, event, arg):
            if event == "c_call" and type(getattr(arg, "__self__", None)) is cls:
                self.engine_calls.append(arg.__name__)

        sys.setprofile(prof)
        threading.setprofile(prof)

    def _capture_log(self, logger):
        """Keeps MooncakeConnector's warnings and errors (what it reports about transfers)."""
        import logging

        log = self.log

        class Keep(logging.Handler):
            def emit(self, record):
                log.append(record.getMessage())

        logger.addHandler(Keep(level=logging.WARNING))

    def _kv_cache(self):
        """KV cache config and tensors as vLLM's runner would build them for this connector."""
        import torch
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec

        spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_DIM,
                                 dtype=torch.float32)
        groups = [KVCacheGroupSpec(list(LAYERS), spec)]
        if vllm_version() >= (0, 30):
            from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
            from vllm.v1.worker.utils import allocate_kv_cache

            layout = self.mc.MooncakeConnector.get_required_kvcache_layout(self.vc)
            self.vc.cache_config.kv_cache_layout = layout  # resolved by the engine core
            kcc = get_kv_cache_config_from_groups(self.vc, groups, spec.page_size_bytes * NUM_BLOCKS * len(LAYERS))
            assert kcc.num_blocks == NUM_BLOCKS, kcc.num_blocks
            kv = allocate_kv_cache(kcc, torch.device("cpu"), self.vc.cache_config.get_resolved_kv_cache_layout())
            return kcc, kv
        from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheTensor

        kcc = KVCacheConfig(
            num_blocks=NUM_BLOCKS,
            kv_cache_tensors=[KVCacheTensor(size=spec.page_size_bytes * NUM_BLOCKS, shared_by=[n]) for n in LAYERS],
            kv_cache_groups=groups,
        )
        # FlashAttention's shape on 0.18.1: [2, num_blocks, block_size, heads, head_dim].
        kv = {n: torch.zeros(2, NUM_BLOCKS, BLOCK, HEADS, HEAD_DIM) for n in LAYERS}
        return kcc, kv

    # -- blocks ---------------------------------------------------------------------------
    def _block(self, name, b):
        t = self.kv[name]
        return t[b] if t.shape[0] == NUM_BLOCKS else t[:, b]

    def fill(self, rid, block_ids):
        for li, name in enumerate(LAYERS):
            for i, b in enumerate(block_ids):
                blk = self._block(name, b)
                blk.copy_(kv_block_pattern(rid, li, i, blk.shape).to(blk.dtype))

    def block_sha(self, block_ids):
        """sha256 over every layer's bytes of ``block_ids`` (in order)."""
        hsh = hashlib.sha256()
        for name in LAYERS:
            for b in block_ids:
                hsh.update(block_bytes(self._block(name, b)))
        return hsh.hexdigest()

    def matches_pattern(self, rid, block_ids):
        import torch

        for li, name in enumerate(LAYERS):
            for i, b in enumerate(block_ids):
                blk = self._block(name, b)
                if not torch.equal(blk, kv_block_pattern(rid, li, i, blk.shape).to(blk.dtype)):
                    return f"layer {name} block #{i} (id {b}) differs"
        return "ok"

    # -- requests -------------------------------------------------------------------------
    def add(self, rid, tokens, params, max_tokens):
        import vllm_harness as h

        req = h.make_request(rid, tokens, params, max_tokens=max_tokens)
        self.reqs[rid] = req
        self.sched.add_request(req)
        return len(req.prompt_token_ids)

    def status(self, rid):
        r = self.reqs[rid]
        return r.status.name, r.is_finished()

    def block_ids(self, rid):
        return list(self.sched.kv_cache_manager.get_block_ids(rid)[0])

    def free_blocks(self):
        return self.sched.kv_cache_manager.block_pool.get_num_free_blocks()

    def step(self, fill_prefills=False):
        """One engine step in the order vLLM's model runner drives the connector."""
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        so = self.sched.schedule()
        w = self.worker
        w.bind_connector_metadata(so.kv_connector_metadata)
        w.start_load_kv(None)
        if fill_prefills:  # stand-in forward: the prefill computes the request's KV
            for new in so.scheduled_new_reqs:
                self.fill(new.req_id, new.block_ids[0])
                self.filled[new.req_id] = list(new.block_ids[0])
        for name in LAYERS:
            w.save_kv_layer(name, self.kv[name], attn_metadata=object())
        w.wait_for_save()
        failed = set()
        if hasattr(w, "get_transfer_results"):
            tr = w.get_transfer_results(so.finished_req_ids)
            sending, recving, failed = tr.finished_sending, tr.finished_recving, tr.failed_recving
        else:
            sending, recving = w.get_finished(so.finished_req_ids)
        invalid = w.get_block_ids_with_load_errors()
        st = w.get_kv_connector_stats()
        if st is not None:
            self.stats.append(dict(st.data))
        self.invalid |= invalid
        self.failed |= set(failed or ())
        w.clear_connector_metadata()
        ids = list(so.num_scheduled_tokens.keys())
        kw = {"failed_recving": set(failed)} if failed else {}
        out = ModelRunnerOutput(
            req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=[[7] for _ in ids], logprobs=None, prompt_logprobs_dict={},
            pooler_output=None,
            kv_connector_output=KVConnectorOutput(finished_sending=sending, finished_recving=recving,
                                                  invalid_block_ids=invalid, **kw),
        )
        self.sched.update_from_output(so, out)
        return sorted(so.num_scheduled_tokens.items())

    def sleep_wake(self):
        """vLLM 0.33's sleep-mode hooks: the KV caches unregistered, then registered again
        (same addresses, new registrations)."""
        self.worker.unregister_kv_caches()
        self.worker.restore_kv_caches()
        return self.engine_calls[-2:]

    def last_error(self):
        return self.engine.last_error()

    def close(self):
        self.worker.shutdown()
        return True


def serve(conn, kw):
    """Peer process entry point: builds the instance, then serves commands."""
    import kvpeer

    inst = None

    def start(**args):
        nonlocal inst
        inst = Instance(**args)
        return inst.engine.get_local_hostname()

    def call(name, *args):
        return getattr(inst, name)(*args)

    def attr(path):
        obj = inst
        for p in path.split("."):
            obj = getattr(obj, p)
        return obj

    def kill_engine():
        inst.engine.shutdown()
        return True

    kvpeer._serve(conn, {"start": lambda: start(**kw), "call": call, "attr": attr, "kill_engine": kill_engine})
