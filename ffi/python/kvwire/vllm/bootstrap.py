"""P's bootstrap endpoint, as vLLM's MooncakeConnector serves it, so that a router written for
MooncakeConnector drives KvwireConnector unchanged.

``GET /query`` answers ``{"0": {"engine_id": ..., "kvwire_control": "host:port"}}`` (the key is
the data-parallel rank; kvwire runs one scheduler per instance). A router reads ``engine_id``
for ``remote_engine_id``; a KvwireConnector D given ``remote_bootstrap_addr`` reads
``kvwire_control`` to reach P. Served from a daemon thread, one short request at a time per
connection, with a read deadline.
"""

from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

logger = logging.getLogger("kvwire.vllm")


class BootstrapServer:
    def __init__(self, port: int, info, host: str = "0.0.0.0"):
        self.info = info

        class Handler(BaseHTTPRequestHandler):
            timeout = 5

            def do_GET(h):  # noqa: N802 - http.server's name
                if h.path.rstrip("/") != "/query":
                    h.send_error(404)
                    return
                body = json.dumps({"0": info()}).encode()
                h.send_response(200)
                h.send_header("Content-Type", "application/json")
                h.send_header("Content-Length", str(len(body)))
                h.end_headers()
                h.wfile.write(body)

            def log_message(h, *args):
                pass

        try:
            self.server = ThreadingHTTPServer((host, port), Handler)
        except OSError as e:
            logger.warning("kvwire: bootstrap endpoint on port %d not started: %s", port, e)
            self.server = None
            return
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self._t = threading.Thread(target=self.server.serve_forever, name="kvwire-bootstrap", daemon=True)
        self._t.start()

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
