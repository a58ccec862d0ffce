"""The differences between vLLM 0.18.1 and 0.33.0 that the connector depends on."""

import logging
import sys

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorHandshakeMetadata, KVConnectorMetadata

try:  # 0.33.0 and later
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
except ImportError:  # 0.18.1: the worker calls get_finished directly; no failed_recving
    KVConnectorTransferResults = None

try:  # 0.33.0: base class renamed from KVConnectorPrometheus (0.18.1)
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm
except ImportError:
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPrometheus as KVConnectorProm

# vLLM 0.18.1's Scheduler.update_from_output asks the scheduler-side connector for its stats only
# when the workers' output carries stats (``if kv_connector_stats and self.connector``); 0.33.0
# asks every step. On 0.18.1 the worker therefore returns a (possibly empty) stats object every
# step, so that the scheduler's numbers (the P/D cores) reach the loggers.
SCHEDULER_STATS_RIDE_ON_WORKER_STATS = KVConnectorTransferResults is None

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA
except ImportError:
    SupportsHMA = object

# Handshake (both versions): after the workers registered their KV caches, EngineCore collects
# each worker's get_handshake_metadata() (a KVConnectorHandshakeMetadata) and hands the
# scheduler-side connector {tp_rank: metadata} through set_xfer_handshake_metadata (0.33.0 through
# set_xfer_handshake_metadata_pp_aware, whose default drops the pp rank and refuses pp_rank > 0).


def tp_size(vllm_config) -> int:
    """The tensor parallel size of this vLLM instance."""
    return max(1, int(getattr(vllm_config.parallel_config, "tensor_parallel_size", 1) or 1))


def tp_rank(vllm_config) -> int:
    """This worker's rank in its tensor parallel group, read as vLLM's own NIXL and Mooncake
    connectors read it (``get_tensor_model_parallel_rank()``, the TP group's ``rank_in_group``,
    which is also the key EngineCore gives our handshake metadata). At size 1 it is 0 without
    asking vLLM (no process group is needed)."""
    if tp_size(vllm_config) == 1:
        return 0
    from vllm.distributed import parallel_state

    return int(parallel_state.get_tensor_model_parallel_rank())


def block_ids_group0(blocks):
    """Block ids of the first KV-cache group of a ``KVCacheBlocks``."""
    ids = blocks.get_block_ids()
    return list(ids[0]) if ids else []


def preempted_ids(arg):
    """``handle_preemptions``: 0.18.1 passes a set of request ids, 0.33.0 the metadata."""
    if isinstance(arg, KVConnectorMetadata):
        return set(getattr(arg, "preempted_req_ids", ()) or ())
    return set(arg or ())


def backport_on_new_request() -> None:
    """vLLM 0.33.0's Scheduler calls ``connector.on_new_request(request)`` as it queues a request;
    0.18.1's tells the connector of a request only when it first tries to allocate it, so a P
    could not report a request queued behind others. Where the hook is missing, this wraps
    ``Scheduler.add_request`` (once per process) to make the same call after the request was
    queued."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    if hasattr(KVConnectorBase_V1, "on_new_request"):
        return
    from vllm.v1.core.sched.scheduler import Scheduler

    if getattr(Scheduler.add_request, "_kvwire_backport", False):
        return
    plain = Scheduler.add_request

    def add_request(self, request):
        new = request.request_id not in self.requests
        plain(self, request)
        hook = getattr(getattr(self, "connector", None), "on_new_request", None)
        if new and hook is not None and request.request_id in self.requests:
            try:
                hook(request)
            except Exception:  # noqa: BLE001 - the connector must never break vLLM's add_request
                logging.getLogger("kvwire.vllm").exception("kvwire: on_new_request failed")

    add_request._kvwire_backport = True
    Scheduler.add_request = add_request


def count_uncached(request) -> None:
    """A request about to fail through the KV load-error path before it was ever scheduled still
    has ``num_cached_tokens == -1`` (vLLM's "not counted yet"). vLLM 0.18.1 puts that -1 into the
    failed request's output, and its frontend's prompt-token stats then add a negative count to a
    Prometheus counter: ``ValueError`` in the output handler, and the API server dies. Counting
    the request as having no cached token (what is true of it) avoids that on every version."""
    n = getattr(request, "num_cached_tokens", 0)
    if isinstance(n, int) and n < 0:
        request.num_cached_tokens = 0


#: Waiting requests whose prefix-cache hit ``scheduler_loads`` looks up (the rest count whole).
LOOKUPS = 16


def _cache_hit(s, r) -> int:
    """Prompt tokens of waiting request ``r`` that ``s``'s prefix cache holds now: the scheduler's
    own lookup, read-only (the hit is claimed only when the request is scheduled); 0 when it
    cannot be asked."""
    kvm = getattr(s, "kv_cache_manager", None)
    if kvm is None or not getattr(kvm, "enable_caching", False) or getattr(r, "skip_reading_prefix_cache", False):
        return 0
    try:
        return int(kvm.coordinator.find_longest_cache_hit(r.block_hashes, r.num_tokens - 1)[1])
    except (AttributeError, TypeError, IndexError, ValueError, AssertionError):
        return 0


def _waiting_queues(s, frame) -> list:
    """Every queue of scheduler ``s`` that holds waiting requests: ``waiting``; on versions that
    keep them apart (0.18.1), ``skipped_waiting`` (requests blocked on remote KV, grammar, ...);
    and the requests the step now running has set aside so far (``step_skipped_waiting``, a local
    of ``schedule``, put back at its end)."""
    queues = [s.waiting]
    for q in (getattr(s, "skipped_waiting", None), frame.f_locals.get("step_skipped_waiting")):
        if q is not None and all(q is not x for x in queues):
            queues.append(q)
    return queues


def _queued_tokens(s, waiting: list, request) -> int:
    """Prompt tokens the requests of scheduler ``s`` other than ``request`` have still to compute:
    a running one's uncomputed rest; a waiting one's prompt less its prefix-cache hit (looked up
    for the first :data:`LOOKUPS` of them)."""
    n = sum(max(0, r.num_prompt_tokens - r.num_computed_tokens) for r in s.running if r is not request)
    for i, r in enumerate(x for q in waiting for x in q if x is not request):
        hit = _cache_hit(s, r) if i < LOOKUPS and r.num_computed_tokens == 0 else 0
        n += max(0, r.num_prompt_tokens - max(r.num_computed_tokens, hit))
    return n


def scheduler_loads(request=None, queued_tokens: bool = False) -> dict:
    """``{"waiting": n, "running": n}`` of the vLLM scheduler that is calling the connector (its
    frame is on the stack; read-only, best effort: ``{}`` when it is not found); with
    ``queued_tokens`` also ``"queued_tokens"``, the prompt tokens its requests other than
    ``request`` have still to compute (see :func:`_queued_tokens`)."""
    f = sys._getframe(2)
    for _ in range(6):
        if f is None:
            break
        s = f.f_locals.get("self")
        if s is not None and hasattr(s, "waiting") and hasattr(s, "running"):
            try:
                waiting = _waiting_queues(s, f)
                loads = {"waiting": sum(len(q) for q in waiting), "running": len(s.running)}
            except TypeError:
                return {}
            if queued_tokens:
                try:
                    loads["queued_tokens"] = _queued_tokens(s, waiting, request)
                except (TypeError, AttributeError):
                    pass
            return loads
        f = f.f_back
    return {}
