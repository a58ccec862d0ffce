"""Ports for tests, picked where the kernel never hands one out by itself.

Binding port 0 and closing the socket returns a port from the ephemeral range, and the kernel is
free to give that same port to the next outgoing connection before the test binds it (a CI run
failed with ``Address already in use`` that way). These helpers pick at random below the
ephemeral range (``/proc/sys/net/ipv4/ip_local_port_range``), check that the port binds now, and
never hand the same port out twice in one process.
"""

from __future__ import annotations

import random
import socket

_given: set[int] = set()
_rng = random.Random()


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _binds(port: int) -> bool:
    s = socket.socket()
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
        return True
    except OSError:
        return False
    finally:
        s.close()


def free_port_run(n: int = 1) -> int:
    """A port p with p .. p+n-1 all bindable now, below the ephemeral range and not given before
    in this process (bounded tries; RuntimeError when none is found)."""
    high = min(_ephemeral_low(), 65536) - n
    low = 10000 if high > 12000 else 1024
    for _ in range(500):
        base = _rng.randrange(low, high)
        run = range(base, base + n)
        if any(p in _given for p in run) or not all(_binds(p) for p in run):
            continue
        _given.update(run)
        return base
    raise RuntimeError(f"no run of {n} free ports found below {high + n}")


def free_port() -> int:
    """One port, bindable now, that the kernel will not hand to an outgoing connection."""
    return free_port_run(1)
