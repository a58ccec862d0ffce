"""Drop-in for ``mooncake.engine.TransferEngine`` on kvwire.

``from kvwire.mooncake import TransferEngine`` gives the method names, signatures and return
conventions that vLLM's MooncakeConnector and SGLang use (``initialize``, ``get_rpc_port``,
``register_memory``/``batch_register_memory``, ``transfer_sync_write``/``read``,
``batch_transfer_sync_write``/``read``, async submit and status calls, managed buffers...):
``0`` on success and a negative value on failure, the reason logged on the ``kvwire.mooncake``
logger and available from ``last_error()``.

Only the ``P2PHANDSHAKE`` metadata mode exists: a peer is named ``"host:rpc_port"``. Remote
memory is named by the peer's virtual addresses, which kvwire maps to the peer's registered
buffers through an address map each engine publishes in a small read-only region of its own;
anything outside them is refused.
"""

from kvwire._kvwire import TransferEngine


class TransferOpcode:
    """Opcodes of ``TransferEngine.transfer_sync`` (``READ``/``WRITE``)."""

    READ = 0
    WRITE = 1


__all__ = ["TransferEngine", "TransferOpcode"]
