"""kvwire: KV-cache transfer engine for prefill/decode disaggregated LLM serving.

* :class:`Engine` — register memory, connect to peers, batch writes/reads with one completion
  per batch (``Batch.wait``/``Batch.poll``), notifications delivered after the bytes landed.
* :mod:`kvwire.mooncake` — ``TransferEngine``, a drop-in for ``mooncake.engine.TransferEngine``.
* :mod:`kvwire.vllm` — ``KvwireConnector``, a vLLM v1 KV connector (load it with
  ``kv_connector_module_path="kvwire.vllm"``).

Errors are raised as subclasses of :class:`KvwireError`. Blocking calls release the GIL.
"""

from kvwire._kvwire import (  # noqa: F401
    AccessDeniedError,
    AuthError,
    Batch,
    BatchStats,
    ConnectorError,
    Engine,
    InvalidArgumentError,
    IoError,
    KvwireError,
    Notification,
    OutOfBoundsError,
    Peer,
    PeerDeadError,
    ProtocolError,
    Region,
    RemoteRegion,
    ShutdownError,
    StaleRegionError,
    TimeoutError,
    UnknownRegionError,
    UnsupportedError,
    VersionMismatchError,
    __version__,
)


def register_tensor(engine, tensor, access="rw"):
    """Registers a contiguous CPU tensor's memory (``data_ptr()``, ``nbytes``) with ``engine``.

    The tensor must stay alive until the returned region is unregistered.
    """
    if getattr(tensor, "device", None) is not None and str(tensor.device) != "cpu":
        raise UnsupportedError(
            f"only CPU tensors can be registered, got device {tensor.device}: kvwire's transports move "
            "host memory (stage a CUDA tensor through pinned host memory, as kvwire.vllm.staging does)")
    if hasattr(tensor, "is_contiguous") and not tensor.is_contiguous():
        raise InvalidArgumentError("tensor must be contiguous")
    nbytes = tensor.numel() * tensor.element_size()
    return engine.register(tensor.data_ptr(), nbytes, access)


__all__ = [
    "AccessDeniedError",
    "AuthError",
    "Batch",
    "BatchStats",
    "ConnectorError",
    "Engine",
    "InvalidArgumentError",
    "IoError",
    "KvwireError",
    "Notification",
    "OutOfBoundsError",
    "Peer",
    "PeerDeadError",
    "ProtocolError",
    "Region",
    "RemoteRegion",
    "ShutdownError",
    "StaleRegionError",
    "TimeoutError",
    "UnknownRegionError",
    "UnsupportedError",
    "VersionMismatchError",
    "register_tensor",
]
