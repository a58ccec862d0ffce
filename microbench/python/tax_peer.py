"""The destination of the in-flight transfers of ``tax_worker.py``, in its own process (as D
would be): ``tax_peer.py kvwire|mooncake SIZE`` prints one JSON line (where to write), waits for
stdin to close, then prints the sha256 of the destination region and exits."""

import ctypes
import hashlib
import json
import sys


def main():
    kind, size = sys.argv[1], int(sys.argv[2])
    if kind == "kvwire":
        import kvwire

        e = kvwire.Engine(transport="tcp")
        r = e.alloc(size, "wo")
        print(json.dumps({"addr": e.listen_addr}), flush=True)
        sys.stdin.read()
        print(hashlib.sha256(e.local_read(r, 0, size)).hexdigest(), flush=True)
        e.shutdown()
    elif kind == "mooncake":
        from mooncake.engine import TransferEngine

        te = TransferEngine()
        rc = te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
        buf = (ctypes.c_char * size)()
        addr = ctypes.addressof(buf)
        rc2 = te.register_memory(addr, size) if rc == 0 else -1
        print(json.dumps({"rc": rc, "rc_register": rc2, "session": f"127.0.0.1:{te.get_rpc_port()}", "buf": addr}),
              flush=True)
        sys.stdin.read()
        print(hashlib.sha256(ctypes.string_at(addr, size)).hexdigest(), flush=True)
    else:
        sys.exit(f"unknown peer kind {kind}")


if __name__ == "__main__":
    main()
