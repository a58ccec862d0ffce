"""Peer processes for the two-process tests. Each serves commands from a pipe:
``conn.recv()`` gives ``(cmd, *args)``, the answer is ``("ok", value)`` or ``("err", text)``."""

import ctypes
import hashlib
import traceback


def _serve(conn, handlers):
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        cmd, args = msg[0], msg[1:]
        if cmd == "exit":
            conn.send(("ok", None))
            return
        try:
            conn.send(("ok", handlers[cmd](*args)))
        except Exception:  # reported to the test, which fails
            conn.send(("err", traceback.format_exc()))


def engine_peer(conn, kw):
    """A kvwire.Engine with regions allocated on demand."""
    import kvwire

    e = kvwire.Engine(**kw)
    regions = {}

    def alloc(name, n, access="rw"):
        r = e.alloc(n, access)
        regions[name] = r
        return r.id

    def fill(name, data):
        e.local_write(regions[name], 0, data)

    def sha(name, off=0, n=None):
        r = regions[name]
        n = r.len - off if n is None else n
        return hashlib.sha256(e.local_read(r, off, n)).hexdigest()

    def read(name, off, n):
        return e.local_read(regions[name], off, n)

    def unregister(name):
        e.unregister(regions.pop(name))

    def notification(timeout):
        n = e.get_notification(timeout)
        return bytes(n.tag)

    def connect_write(addr, name, dst, off, n):
        """Connects to ``addr`` (every call dials afresh) and writes ``name``'s first ``n`` bytes
        into its region ``dst``; the error's class name on failure."""
        try:
            peer = e.connect(addr)
            e.write(peer, [(regions[name], 0, dst, off, n)]).wait(30.0)
        except kvwire.KvwireError as err:
            return type(err).__name__
        return "ok"

    _serve(
        conn,
        {
            "addr": lambda: e.listen_addr,
            "alloc": alloc,
            "fill": fill,
            "sha": sha,
            "read": read,
            "unregister": unregister,
            "notification": notification,
            "connect_write": connect_write,
        },
    )


def mooncake_peer(conn, kw):
    """A kvwire.mooncake.TransferEngine with buffers registered on demand."""
    from kvwire.mooncake import TransferEngine

    te = TransferEngine()
    rc = te.initialize(kw.get("host", "127.0.0.1"), "P2PHANDSHAKE", kw.get("protocol", "tcp"), "")
    if rc != 0:
        raise RuntimeError(f"initialize returned {rc}: {te.last_error()}")
    keep = {}

    def buffer(name, n, managed=False):
        if managed:
            addr = te.allocate_managed_buffer(n)
            assert addr != 0, te.last_error()
            keep[name] = (addr, n, None)
        else:
            buf = (ctypes.c_char * n)()
            addr = ctypes.addressof(buf)
            assert te.register_memory(addr, n) == 0, te.last_error()
            keep[name] = (addr, n, buf)
        return addr

    def fill(name, data):
        addr, n, _ = keep[name]
        assert te.write_bytes_to_buffer(addr, data, len(data)) == 0, te.last_error()

    def sha(name, off=0, n=None):
        addr, size, _ = keep[name]
        n = size - off if n is None else n
        return hashlib.sha256(te.read_bytes_from_buffer(addr + off, n)).hexdigest()

    def drop(name):
        addr, n, buf = keep.pop(name)
        if buf is None:
            return te.free_managed_buffer(addr, n)
        return te.unregister_memory(addr)

    _serve(
        conn,
        {
            "session": lambda: te.get_local_hostname(),
            "port": lambda: te.get_rpc_port(),
            "buffer": buffer,
            "fill": fill,
            "sha": sha,
            "drop": drop,
        },
    )
