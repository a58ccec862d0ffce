"""``KvwireConnector``: a vLLM v1 KV connector on kvwire.

vLLM builds the connector twice: in the scheduler (``role=SCHEDULER``) and in each worker
(``role=WORKER``). This class only routes vLLM's hooks to the two halves:

* :mod:`kvwire.vllm.scheduler` — the P/D protocol cores, driven by the connector's own thread
  over the control plane (:mod:`kvwire.vllm.control`): the scheduler hooks never wait on the
  network, and everything keeps moving while the engine is idle; what the hooks do with a D
  request is in :mod:`kvwire.vllm.d_requests`, with a P request in :mod:`kvwire.vllm.p_requests`,
  and who the peers are in :mod:`kvwire.vllm.peers`;
* :mod:`kvwire.vllm.worker` — the KV caches in a data engine; P writes every (chunk, layer)
  piece as soon as its forward computed it, straight into D's blocks (or D's landing pool);
* :mod:`kvwire.vllm.options` — ``kv_connector_extra_config`` and ``kv_transfer_params`` (kvwire's
  and vLLM MooncakeConnector's), with every timeout and its default;
* :mod:`kvwire.vllm.envelope`, :mod:`kvwire.vllm.descriptor`, :mod:`kvwire.vllm.timeline`,
  :mod:`kvwire.vllm.bootstrap`, :mod:`kvwire.vllm.staging`, :mod:`kvwire.vllm.stats`.

Policies (``policy``): ``eager`` | ``lazy`` (default) | ``jit`` | ``land``; send modes
(``send_mode``): ``whole`` (default) | ``layerwise``. A request may override both
(``kvwire_policy`` / ``kvwire_send_mode`` in its ``kv_transfer_params``).

Prefix hits on D: D receives only the blocks its prefix cache lacks; P sends only that suffix;
a block D had cached is never written.

Failures on D (P down, timeout, transfer error, P aborted, an incompatible P) are reported
through vLLM's load-error path: the request is listed in ``finished_recving`` and its blocks in
``get_block_ids_with_load_errors``. A D request aborted after its block ids went to P keeps its
blocks until P confirms that no write is in flight.

Tensor parallelism: P and D must run the same TP size; P's rank r writes into D's rank r. Rank
r listens on ``data_listen``'s port + r; the addresses reach the scheduler through vLLM's
handshake hooks and are announced to peers in the connector's hello.

CUDA graphs: the per-layer hooks (``save_kv_layer``) do not run inside a replayed full CUDA
graph. :meth:`KvwireConnector.requires_piecewise_for_cudagraph` asks vLLM for piecewise graphs
only where layerwise sending needs the hooks (a producer with ``send_mode: layerwise``); a kv_both
or consumer instance keeps its full decode graphs. Without per-layer hooks (a full graph), the
worker still sends every layer after the forward (``wait_for_save``), which is always correct.
One log line at start-up says which applies.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvwire.vllm import compat
from kvwire.vllm import staging as _staging
from kvwire.vllm import stats as _stats
from kvwire.vllm.options import Options
from kvwire.vllm.scheduler import SchedulerSide, request_key  # noqa: F401 - request_key re-exported
from kvwire.vllm.stats import KvwireConnectorStats, KvwirePromMetrics
from kvwire.vllm.worker import KvwireHandshake, WorkerSide, rank_listen  # noqa: F401 - re-exported

logger = logging.getLogger("kvwire.vllm")


@dataclass
class KvwireConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> worker, once per step."""

    # D: requests whose KV fully landed (-> finished_recving).
    finished_recving: set = field(default_factory=set)
    # D: failed requests -> their block ids that did not load.
    failed_recving: dict = field(default_factory=dict)
    # Either side: delayed block frees that may now happen (-> finished_sending).
    finished_sending: set = field(default_factory=set)
    # P: prefill chunks computed in this step: (req, key, lo, hi, prompt, block ids, mode, last).
    p_chunks: list = field(default_factory=list)
    # D's landing pool or mirror: req -> (slots, or None for the mirror's same blocks; KV blocks;
    # layers, or None for all) to copy before the request is reported (kvwire.vllm.landing).
    land_copies: dict = field(default_factory=dict)
    # D: data addresses of P engines whose writes must be refused from now on.
    fences: list = field(default_factory=list)
    unfences: list = field(default_factory=list)  # lifted after ``fences``
    # Where the workers report (the scheduler side's control address).
    scheduler_control: str = ""
    preempted_req_ids: set = field(default_factory=set)


def _num_layers(vllm_config, kv_cache_config, extra) -> int:
    if "layers" in extra:
        return int(extra["layers"])
    if kv_cache_config is not None and kv_cache_config.kv_cache_groups:
        return len(kv_cache_config.kv_cache_groups[0].layer_names)
    return vllm_config.model_config.get_num_layers(vllm_config.parallel_config)


class KvwireConnector(KVConnectorBase_V1, compat.SupportsHMA):
    """kvwire's P/D connector (see the module docstring)."""

    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        kt = vllm_config.kv_transfer_config
        extra = dict(kt.kv_connector_extra_config or {})
        self._extra = extra
        self.opts = Options.parse(extra)
        self._engine_id = str(getattr(kt, "engine_id", None) or "kvwire")
        self._block_size = vllm_config.cache_config.block_size
        self._layers = _num_layers(vllm_config, kv_cache_config, extra)
        self._is_producer = kt.kv_role in ("kv_producer", "kv_both")
        self._is_consumer = kt.kv_role in ("kv_consumer", "kv_both")
        self._tp = compat.tp_size(vllm_config)
        # A staged D lands every request in a bounded pool (staging, landing): its slots, the
        # same for the scheduler and every worker; None otherwise. Or (d_landing: mirror) in a
        # host mirror of its whole cache, the same block ids.
        self._d_pool = None
        mode, pool_bytes = _staging.parse_options(extra)
        device = getattr(getattr(vllm_config, "device_config", None), "device_type", "cuda")
        landing = _staging.d_landing(extra) if self._is_consumer else None  # checked on every D
        staged_d = landing is not None and _staging.wanted(mode, [device])
        self._d_mirror = staged_d and landing == "mirror"
        if staged_d and landing == "pool":
            kcc = getattr(self, "_kv_cache_config", None) or kv_cache_config
            self._d_pool = _staging.pool_slots(extra, pool_bytes, _staging.block_bytes(kcc))
        self._sched = self._worker = None
        if role == KVConnectorRole.SCHEDULER:
            compat.backport_on_new_request()
            self._sched = SchedulerSide(self)
            self._log_graph_mode(vllm_config)
        else:
            self._worker = WorkerSide(self)

    def _log_graph_mode(self, vllm_config) -> None:
        try:
            mode = str(vllm_config.compilation_config.cudagraph_mode)
        except AttributeError:
            mode = "unknown"
        if self._is_producer and self.opts.send_mode == "layerwise":
            how = "per-layer sends (piecewise CUDA graphs requested where graphs are used)"
        else:
            how = "sends after each forward (no per-layer hooks needed)"
        logger.info("kvwire: cudagraph_mode %s: %s", mode, how)

    # ---- scheduler side ----
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return self._sched.get_num_new_matched_tokens(request, num_computed_tokens)

    def on_new_request(self, request):
        """A request was queued by the scheduler (0.33: vLLM's call; 0.18.1: the wrap of
        :func:`compat.backport_on_new_request`)."""
        self._sched.on_new_request(request)

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        self._sched.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output):
        meta = self._sched.build_connector_meta(scheduler_output)
        meta.scheduler_control = self._sched.control.addr
        return meta

    def update_connector_output(self, connector_output):
        self._sched.update_connector_output(connector_output)

    def request_finished(self, request, block_ids):
        return self._sched.request_finished(request, list(block_ids))

    def request_finished_all_groups(self, request, block_ids):
        return self._sched.request_finished(request, list(block_ids[0]) if block_ids else [])

    def has_pending_push_work(self):  # 0.33.0: keeps P stepping while releases are pending
        return self._sched is not None and self._sched.has_pending_work()

    def set_xfer_handshake_metadata(self, metadata):
        """Scheduler: every TP rank's handshake (``{tp_rank: KvwireHandshake}``), once."""
        if self._sched is not None:
            self._sched.set_rank_addrs(metadata)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config) -> bool:
        """Layerwise sending needs the per-layer hooks, which a replayed full CUDA graph skips."""
        return (extra_config or {}).get("send_mode") == "layerwise"

    @property
    def control_addr(self) -> str:
        """The scheduler side's control address (what the other side puts in ``remote_control``)."""
        return self._sched.control.addr

    @property
    def engine_id(self) -> str:
        return self._sched.engine_id if self._sched is not None else self._engine_id

    @property
    def data_addr(self) -> str:
        """The worker side's data address."""
        return self._worker.engine.listen_addr

    # ---- stats ----
    def get_kv_connector_stats(self):
        half = self._sched if self._sched is not None else self._worker
        return half.stats() if half is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data=None):
        return KvwireConnectorStats(data=_stats.copy_payload(data))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return KvwirePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ---- worker side ----
    def get_handshake_metadata(self):
        return self._worker.handshake() if self._worker is not None else None

    def register_kv_caches(self, kv_caches):
        self._worker.register_kv_caches(kv_caches)

    def landing_pool(self, layer_name):
        """D's landing-pool tensor of a layer (policy ``land``; same layout as the layer's KV
        cache), or None: for inspection, e.g. by :mod:`kvwire.testing`."""
        return self._worker.landing.get(layer_name) if self._worker is not None else None

    def start_load_kv(self, forward_context, **kwargs):
        self._worker.start_load_kv(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name):
        return None

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        if attn_metadata is None or not self.has_connector_metadata():
            return
        self._worker.save_kv_layer(self._get_connector_metadata(), layer_name)

    def wait_for_save(self):
        if self.has_connector_metadata():
            self._worker.wait_for_save(self._get_connector_metadata())

    def get_finished(self, finished_req_ids):
        return self._worker.get_finished()

    def get_block_ids_with_load_errors(self):
        return self._worker.take_load_errors()

    def handle_preemptions(self, arg):
        return None

    def shutdown(self):
        if self._sched is not None:
            self._sched.close()
        if self._worker is not None:
            self._worker.close()

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config):
        return None
