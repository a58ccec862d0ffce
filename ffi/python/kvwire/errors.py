"""kvwire's exceptions, defined once.

:data:`TABLE` lists them: each class's name, the builtin exception it also derives from (or
``None``) and its doc. The classes are made from it here; the native module raises them, each
looked up from this module once; :mod:`kvwire` re-exports them (its ``__all__`` takes the names
from here).

Every class derives from :class:`KvwireError`. Where a builtin means the same thing the class
derives from it too, so code that knows nothing of kvwire catches it: a deadline
(``kvwire.TimeoutError``) is a builtin :class:`TimeoutError`, a dead peer a
:class:`ConnectionError`, an operating-system error an :class:`OSError`, a bad argument a
:class:`ValueError`, a missing feature (no CUDA driver...) a :class:`NotImplementedError`,
refused access or a failed shared-secret proof a :class:`PermissionError`, an access past a
region's end an :class:`IndexError`, a region that does not (or no longer) exist a
:class:`LookupError`. Protocol, version, shutdown, connector, abort, layer-stream and CUDA
errors have no builtin counterpart and derive from :class:`KvwireError` alone.

``errors.pyi``, the classes as type checkers see them, is made from the table too
(``python errors.py > errors.pyi`` in this directory; a test checks that it is current).
"""

import builtins

#: ``(name, builtin base or None, doc)`` of every exception class, base class first.
TABLE = (
    ("KvwireError", None, "Base class of every kvwire error."),
    ("IoError", builtins.OSError, "An operating-system I/O error (socket, mmap...)."),
    ("ProtocolError", None, "A peer broke the wire protocol (malformed frame...)."),
    ("VersionMismatchError", None, "The peers speak different protocol versions."),
    ("AuthError", builtins.PermissionError, "The shared-secret proof failed."),
    ("OutOfBoundsError", builtins.IndexError, "An access outside a region's bounds."),
    ("UnknownRegionError", builtins.LookupError,
     "No such region (never registered, not offered, or an address outside every registered buffer)."),
    ("StaleRegionError", builtins.LookupError, "The region was unregistered."),
    ("AccessDeniedError", builtins.PermissionError, "The region does not allow this access."),
    ("PeerDeadError", builtins.ConnectionError, "The peer died or its connection broke."),
    ("TimeoutError", builtins.TimeoutError, "A deadline passed."),
    ("ShutdownError", None, "The engine was shut down."),
    ("InvalidArgumentError", builtins.ValueError, "An invalid argument."),
    ("UnsupportedError", builtins.NotImplementedError, "Not available here."),
    ("ResourceLimitError", None,
     "A bound of the engine's limits was reached (handshakes, peers, lanes, notification bytes...)."),
    ("FencedError", builtins.ConnectionRefusedError,
     "The peer engine is fenced (Engine.fence): its connections are refused."),
    ("ConnectorError", None, "The P/D connector core refused an event."),
    ("AbortedError", None, "The layer stream was aborted (LayerStream.abort, or its handle was dropped)."),
    ("LayerStreamError", None,
     "A layer stream failed: a layer's readiness (e.g. a CUDA event) or its staging copy failed."),
    ("CudaError", None,
     "A CUDA driver call failed (a missing driver or device raises UnsupportedError instead)."),
)


def _make():
    made = {}
    for name, builtin, doc in TABLE:
        if not made:
            bases = (Exception,)
        else:
            bases = (made["KvwireError"],) + ((builtin,) if builtin is not None else ())
        # Shown as kvwire.<name>, where users meet them.
        made[name] = type(name, bases, {"__doc__": doc, "__module__": "kvwire"})
    return made


globals().update(_make())

__all__ = [name for name, _, _ in TABLE]


def _stub():
    """The text of ``errors.pyi``: the classes of :data:`TABLE` for type checkers."""
    lines = ['"""Made from kvwire.errors.TABLE by ``python errors.py > errors.pyi``: do not edit."""',
             "", "import builtins", "",
             "TABLE: tuple[tuple[str, type[BaseException] | None, str], ...]",
             "__all__ = [" + ", ".join(f'"{name}"' for name in __all__) + "]", ""]
    for name, builtin, doc in TABLE:
        bases = "Exception" if name == "KvwireError" else "KvwireError"
        if builtin is not None:
            bases += f", builtins.{builtin.__name__}"
        lines += ["", f"class {name}({bases}):", f'    """{doc}"""', ""]
    return "\n".join(lines).rstrip() + "\n"


if __name__ == "__main__":
    print(_stub(), end="")
