"""Shared fixtures: child processes that act as the remote peer (spawned, so each has its own
engine and address space), and byte patterns checked at both ends."""

import hashlib
import multiprocessing as mp
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import kvpeer  # noqa: E402


def pattern(n, seed):
    """Deterministic pseudo-random bytes (sha256 counter mode)."""
    out = bytearray()
    i = 0
    while len(out) < n:
        out += hashlib.sha256(f"{seed}:{i}".encode()).digest()
        i += 1
    return bytes(out[:n])


class Child:
    """A spawned peer process driven over a pipe: ``call(cmd, *args)`` returns its answer."""

    def __init__(self, target, *args):
        ctx = mp.get_context("spawn")
        self.conn, child_conn = ctx.Pipe()
        self.proc = ctx.Process(target=target, args=(child_conn, *args), daemon=True)
        self.proc.start()
        child_conn.close()

    def call(self, *msg, timeout=30.0):
        self.conn.send(msg)
        if not self.conn.poll(timeout):
            raise AssertionError(f"peer did not answer {msg[0]!r} within {timeout} s")
        status, value = self.conn.recv()
        if status == "err":
            raise AssertionError(f"peer failed on {msg[0]!r}: {value}")
        return value

    def kill(self):
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(10)

    def close(self):
        if self.proc.is_alive():
            try:
                self.conn.send(("exit",))
            except (BrokenPipeError, OSError):
                pass
            self.proc.join(10)
        self.kill()


@pytest.fixture
def engine_peer():
    children = []

    def make(**kw):
        c = Child(kvpeer.engine_peer, kw)
        children.append(c)
        return c

    yield make
    for c in children:
        c.close()


@pytest.fixture
def mooncake_peer():
    children = []

    def make(**kw):
        c = Child(kvpeer.mooncake_peer, kw)
        children.append(c)
        return c

    yield make
    for c in children:
        c.close()
