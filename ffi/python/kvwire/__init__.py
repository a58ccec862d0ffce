"""kvwire: KV-cache transfer engine for prefill/decode disaggregated LLM serving.

* :class:`Engine` — register memory, connect to peers, batch writes/reads with one completion
  per batch (``Batch.wait``/``Batch.poll``), notifications delivered after the bytes landed.
* :meth:`Engine.layer_stream` — a request's KV cache sent layer by layer (:class:`LayerStream`),
  each layer as soon as it is ready (now, or after a CUDA event/stream), from host memory or
  from CUDA device memory staged through a :class:`CudaStager` (:func:`register_tensor`).
* :mod:`kvwire.mooncake` — ``TransferEngine``, a drop-in for ``mooncake.engine.TransferEngine``.
* :mod:`kvwire.vllm` — ``KvwireConnector``, a vLLM v1 KV connector (load it with
  ``kv_connector_module_path="kvwire.vllm"``).

Errors are raised as subclasses of :class:`KvwireError` (:mod:`kvwire.errors`), each also a
subclass of the builtin of the same meaning where there is one (``kvwire.TimeoutError`` is a
``TimeoutError``, ``kvwire.PeerDeadError`` a ``ConnectionError``...). Blocking calls release the
GIL.
"""

from kvwire import errors as _errors
from kvwire._kvwire import (  # noqa: F401
    Batch,
    BatchStats,
    CudaSource,
    CudaStager,
    Engine,
    LayerStats,
    LayerStream,
    Notification,
    Peer,
    Region,
    RemoteRegion,
    StreamStats,
    __version__,
    rdma_contexts_open,
)

# The exception classes (kvwire.KvwireError and its subclasses), from their one table.
from kvwire.errors import *  # noqa: E402,F401,F403


def register_tensor(engine, tensor, access="rw", pinned=False, ipc=False):
    """Registers a contiguous tensor's memory (``data_ptr()``, ``nbytes``).

    * CPU tensor: registered with ``engine`` (an :class:`Engine`, or a :class:`CudaStager`
      whose engine is used); returns a :class:`Region` with ``access`` for peers. The tensor
      must stay alive until the region is unregistered. ``pinned``: the caller pinned it with
      CUDA (the engine's metrics count it as pinned host memory).
    * CUDA tensor: registered with ``engine`` if it is a :class:`CudaStager` (on the tensor's
      device), else with a new ``CudaStager(engine, device=<the tensor's device>)``; returns a
      :class:`CudaSource` for :meth:`Engine.layer_stream`, which keeps the tensor alive.
      Raises :class:`UnsupportedError` where there is no CUDA driver.
    * CUDA tensor with ``ipc=True``: registered with ``engine`` (an :class:`Engine`) as a device
      region (:meth:`Engine.register_device`); returns a :class:`Region` with ``access`` that
      same-host peers reach with the ``cuda_ipc`` transport (device-to-device copies). The
      tensor must stay alive until the region is unregistered.
    """
    if hasattr(tensor, "is_contiguous") and not tensor.is_contiguous():
        raise _errors.InvalidArgumentError("tensor must be contiguous")
    nbytes = tensor.numel() * tensor.element_size()
    device = getattr(tensor, "device", None)
    kind = getattr(device, "type", None if device is None else str(device))
    if kind == "cuda" and ipc:
        if isinstance(engine, CudaStager):
            engine = engine.engine
        return engine.register_device(tensor.data_ptr(), nbytes, access, tensor.get_device())
    if kind == "cuda":
        index = tensor.get_device()
        if isinstance(engine, CudaStager):
            stager = engine
            if stager.device != index:
                raise _errors.InvalidArgumentError(
                    f"tensor is on cuda:{index} but the stager on cuda:{stager.device}")
        else:
            stager = CudaStager(engine, device=index)
        return stager.register(tensor.data_ptr(), nbytes, keepalive=tensor)
    if kind is not None and kind != "cpu":
        raise _errors.UnsupportedError(
            f"only CPU and CUDA tensors can be registered, got device {device}")
    if isinstance(engine, CudaStager):
        engine = engine.engine
    return engine.register(tensor.data_ptr(), nbytes, access, pinned)


__all__ = [
    "Batch",
    "BatchStats",
    "CudaSource",
    "CudaStager",
    "Engine",
    "LayerStats",
    "LayerStream",
    "Notification",
    "Peer",
    "Region",
    "RemoteRegion",
    "StreamStats",
    "rdma_contexts_open",
    "register_tensor",
    *_errors.__all__,
]
