"""Made from kvwire.errors.TABLE by ``python errors.py > errors.pyi``: do not edit."""

import builtins

TABLE: tuple[tuple[str, type[BaseException] | None, str], ...]
__all__ = ["KvwireError", "IoError", "ProtocolError", "VersionMismatchError", "AuthError", "OutOfBoundsError", "UnknownRegionError", "StaleRegionError", "AccessDeniedError", "PeerDeadError", "TimeoutError", "ShutdownError", "InvalidArgumentError", "UnsupportedError", "ResourceLimitError", "FencedError", "ConnectorError", "AbortedError", "LayerStreamError", "CudaError"]


class KvwireError(Exception):
    """Base class of every kvwire error."""


class IoError(KvwireError, builtins.OSError):
    """An operating-system I/O error (socket, mmap...)."""


class ProtocolError(KvwireError):
    """A peer broke the wire protocol (malformed frame...)."""


class VersionMismatchError(KvwireError):
    """The peers speak different protocol versions."""


class AuthError(KvwireError, builtins.PermissionError):
    """The shared-secret proof failed."""


class OutOfBoundsError(KvwireError, builtins.IndexError):
    """An access outside a region's bounds."""


class UnknownRegionError(KvwireError, builtins.LookupError):
    """No such region (never registered, not offered, or an address outside every registered buffer)."""


class StaleRegionError(KvwireError, builtins.LookupError):
    """The region was unregistered."""


class AccessDeniedError(KvwireError, builtins.PermissionError):
    """The region does not allow this access."""


class PeerDeadError(KvwireError, builtins.ConnectionError):
    """The peer died or its connection broke."""


class TimeoutError(KvwireError, builtins.TimeoutError):
    """A deadline passed."""


class ShutdownError(KvwireError):
    """The engine was shut down."""


class InvalidArgumentError(KvwireError, builtins.ValueError):
    """An invalid argument."""


class UnsupportedError(KvwireError, builtins.NotImplementedError):
    """Not available here."""


class ResourceLimitError(KvwireError):
    """A bound of the engine's limits was reached (handshakes, peers, lanes, notification bytes...)."""


class FencedError(KvwireError, builtins.ConnectionRefusedError):
    """The peer engine is fenced (Engine.fence): its connections are refused."""


class ConnectorError(KvwireError):
    """The P/D connector core refused an event."""


class AbortedError(KvwireError):
    """The layer stream was aborted (LayerStream.abort, or its handle was dropped)."""


class LayerStreamError(KvwireError):
    """A layer stream failed: a layer's readiness (e.g. a CUDA event) or its staging copy failed."""


class CudaError(KvwireError):
    """A CUDA driver call failed (a missing driver or device raises UnsupportedError instead)."""
