"""Drop-in for ``mooncake.engine.TransferEngine`` on kvwire.

``from kvwire.mooncake import TransferEngine`` gives the method names, signatures and return
conventions that vLLM's MooncakeConnector and SGLang use (``initialize``, ``get_rpc_port``,
``register_memory``/``batch_register_memory``, ``transfer_sync_write``/``read``,
``batch_transfer_sync_write``/``read``, async submit and status calls, managed buffers...):
``0`` on success and a negative value on failure, the reason logged on the ``kvwire.mooncake``
logger and available from ``last_error()``, which describes the engine's latest call that can
fail (from any thread): every such method clears it when it starts, so it is empty after a
success.

Only the ``P2PHANDSHAKE`` metadata mode exists: a peer is named ``"host:rpc_port"``. Remote
memory is named by the peer's virtual addresses, which kvwire maps to the peer's registered
buffers through an address map each engine publishes in a small read-only region of its own;
anything outside them is refused.

CUDA memory (a GPU KV cache's ``data_ptr()``) registers as a device region: peers on the same
host reach it with CUDA IPC, device to device (protocol ``rdma``, which picks the best transport
per peer, or ``nvlink``/``cuda_ipc`` for CUDA IPC only). ``tcp`` and ``shm`` refuse transfers
that name device memory (``-1``, the reason in ``last_error()``); across hosts, GPU memory needs
GPUDirect RDMA, which kvwire does not have yet.

Code that imports ``mooncake.engine`` itself (vLLM's MooncakeConnector, SGLang) switches to
kvwire without a source change through a two-file shim package::

    python -m kvwire.mooncake shim /opt/kvwire-shim     # writes /opt/kvwire-shim/mooncake/
    export PYTHONPATH=/opt/kvwire-shim:$PYTHONPATH        # before starting vLLM / SGLang

(the environment variable reaches the worker processes vLLM spawns). Within one process,
:func:`install` does the same without a file.
"""

import os
import sys
import types

from kvwire._kvwire import TransferEngine


class TransferOpcode:
    """Opcodes of ``TransferEngine.transfer_sync`` (``READ``/``WRITE``)."""

    READ = 0
    WRITE = 1


_SHIM_INIT = '''"""kvwire shim: ``mooncake.engine`` resolves to ``kvwire.mooncake`` (written by
``python -m kvwire.mooncake shim``). Remove this directory from PYTHONPATH to use Mooncake."""
'''
_SHIM_ENGINE = '''"""``mooncake.engine`` backed by kvwire (see ``kvwire.mooncake``)."""
from kvwire.mooncake import TransferEngine, TransferOpcode  # noqa: F401

__all__ = ["TransferEngine", "TransferOpcode"]
'''


def write_shim(directory):
    """Writes the package ``mooncake`` (``__init__.py`` and ``engine.py``) under ``directory``
    so that ``import mooncake.engine`` gives kvwire's drop-in to any process with
    ``directory`` on ``sys.path``/``PYTHONPATH``. Returns the package path. Refuses to
    overwrite a directory that is not a kvwire shim (e.g. a real Mooncake install)."""
    pkg = os.path.join(os.fspath(directory), "mooncake")
    init = os.path.join(pkg, "__init__.py")
    if os.path.exists(init):
        with open(init, encoding="utf-8") as f:
            if "kvwire shim" not in f.read():
                raise FileExistsError(f"{pkg} exists and is not a kvwire shim")
    os.makedirs(pkg, exist_ok=True)
    for name, text in (("__init__.py", _SHIM_INIT), ("engine.py", _SHIM_ENGINE)):
        with open(os.path.join(pkg, name), "w", encoding="utf-8") as f:
            f.write(text)
    return pkg


def install():
    """Makes ``import mooncake.engine`` in this process resolve to this module's
    ``TransferEngine`` (does not reach processes started later; use :func:`write_shim`)."""
    pkg = types.ModuleType("mooncake")
    pkg.__path__ = []
    pkg.__doc__ = _SHIM_INIT
    eng = types.ModuleType("mooncake.engine")
    eng.TransferEngine = TransferEngine
    eng.TransferOpcode = TransferOpcode
    pkg.engine = eng
    sys.modules["mooncake"] = pkg
    sys.modules["mooncake.engine"] = eng


def _main(argv):
    if len(argv) != 2 or argv[0] != "shim":
        print("usage: python -m kvwire.mooncake shim DIR   (then PYTHONPATH=DIR)", file=sys.stderr)
        return 2
    print(write_shim(argv[1]))
    return 0


__all__ = ["TransferEngine", "TransferOpcode", "install", "write_shim"]

if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
