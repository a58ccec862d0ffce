"""The P/D protocol cores (sans-IO state machines of ``kvwire-connector``) and the typed
actions they return from ``poll_actions()``.

* :class:`DCore` — decode side: when to reserve (``eager``, ``lazy``, ``jit``, ``land``), block
  ids to P, layers landing, finished/failed reports, every reservation released exactly once.
* :class:`PCore` — prefill side: layers sent as they are ready (``layerwise``) or after prefill
  (``whole``), P's blocks released exactly once.

Actions (frozen, fields by name, usable in ``match``): :class:`Send`, :class:`MayReserve`,
:class:`MayLand`, :class:`ReleaseBlocks`, :class:`ReleaseLanding`, :class:`ReportFinished`,
:class:`ReportFailed`, :class:`DisconnectPeer`, :class:`Transfer`, :class:`Destination`,
:class:`CancelTransfers`.
"""

from kvwire._kvwire import (  # noqa: F401
    CancelTransfers,
    DCore,
    Destination,
    DisconnectPeer,
    MayLand,
    MayReserve,
    PCore,
    ReleaseBlocks,
    ReleaseLanding,
    ReportFailed,
    ReportFinished,
    Send,
    Transfer,
)

__all__ = ["CancelTransfers", "DCore", "Destination", "DisconnectPeer", "MayLand", "MayReserve", "PCore",
           "ReleaseBlocks", "ReleaseLanding", "ReportFailed", "ReportFinished", "Send", "Transfer"]
