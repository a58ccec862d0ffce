"""``python -m kvwire.proxy``: see :mod:`kvwire.proxy`."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from kvwire.proxy.backends import BackendError, parse_backend
from kvwire.proxy.params import STYLES, StyleError, check_style
from kvwire.proxy.policy import BUILT_IN, PolicyError, load_policy


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m kvwire.proxy", description=__doc__.split("\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--prefill", action="append", default=[], metavar="URL[,control=H:P][,bootstrap=URL][,engine_id=E]",
                    help="a P backend (repeat for several)")
    ap.add_argument("--decode", action="append", default=[], metavar="URL[,control=H:P]",
                    help="a D backend (repeat for several)")
    ap.add_argument("--style", choices=STYLES, default="kvwire",
                    help="kv_transfer_params style: kvwire (remote_control) or mooncake (remote_bootstrap_addr)")
    ap.add_argument("--policy", default="round_robin", help=f"{', '.join(BUILT_IN)} or module:callable")
    ap.add_argument("--cost", help="cost.json (kvwire-bench calibrate) for --policy pdsep")
    ap.add_argument("--kv-bytes-per-token", type=int, default=0, help="KV bytes a token of the model (pdsep)")
    ap.add_argument("--layers", type=int, default=0, help="layers of the model (pdsep)")
    ap.add_argument("--pdsep-min-tokens", type=int, default=0, help="shorter prompts stay on D (pdsep)")
    ap.add_argument("--pdsep-interference", type=float, default=1.0,
                    help="weight of the stall a local prefill imposes on D's running requests (pdsep)")
    ap.add_argument("--pdsep-quantile", choices=("mean", "p50", "p90"), default="p50")
    ap.add_argument("--records", help="router records: a FILE.jsonl, or a directory that gets router-<pid>.jsonl")
    ap.add_argument("--timeout", type=float, default=300.0,
                    help="seconds a backend may take to answer (for a stream: between two chunks)")
    ap.add_argument("--connect-timeout", type=float, default=5.0)
    ap.add_argument("--health-interval", type=float, default=2.0)
    ap.add_argument("--wait-ready", type=float, default=0.0,
                    help="seconds to wait at start-up for every backend to be healthy (0: check once)")
    ap.add_argument("--max-body", type=int, default=64 << 20, help="largest request body, bytes")
    ap.add_argument("--shutdown-grace", type=float, default=60.0,
                    help="on SIGTERM/SIGINT, seconds the requests in flight get to finish (then they are "
                         "cancelled); each still gets its router record")
    return ap


def main(argv=None) -> int:
    opts = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s %(message)s")
    try:
        prefill = [parse_backend(s, "p") for s in opts.prefill]
        decode = [parse_backend(s, "d") for s in opts.decode]
        if not prefill or not decode:
            raise BackendError("at least one --prefill and one --decode backend are needed")
        check_style(opts.style, prefill, decode)
        policy = load_policy(opts.policy, opts)
    except (BackendError, StyleError, PolicyError) as e:
        print(f"kvwire.proxy: {e}", file=sys.stderr)
        return 2
    return asyncio.run(serve(opts, prefill, decode, policy))


async def serve(opts, prefill, decode, policy) -> int:
    from aiohttp import web

    from kvwire.proxy.records import RecordWriter
    from kvwire.proxy.server import Proxy

    records = RecordWriter(opts.records) if opts.records else None
    proxy = Proxy(opts, prefill, decode, policy, records)
    await proxy.open()
    bad = await proxy.wait_ready(opts.wait_ready)
    if bad:
        for b in bad:
            print(f"kvwire.proxy: {b.role.upper()} backend {b.url} is unreachable: {b.last_error}", file=sys.stderr)
        await proxy.session.close()
        return 2
    runner = web.AppRunner(proxy.app(), handler_cancellation=True, access_log=None,
                           shutdown_timeout=opts.shutdown_grace)
    await runner.setup()
    site = web.TCPSite(runner, opts.host, opts.port)
    await site.start()
    print(f"kvwire.proxy: listening on http://{opts.host}:{opts.port} ({len(prefill)} P, {len(decode)} D, "
          f"style {opts.style}, policy {opts.policy})", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
        proxy.stopping = True
        print("kvwire.proxy: stopping: no new requests; those in flight finish or are cancelled after "
              f"{opts.shutdown_grace} s", flush=True)
    finally:
        await runner.cleanup()  # waits for the handlers in flight (their records are written)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(0)
