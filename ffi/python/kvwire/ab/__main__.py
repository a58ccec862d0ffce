"""``python -m kvwire.ab``: see :mod:`kvwire.ab`."""

from __future__ import annotations

import argparse
import sys

from kvwire.ab import arms as _arms


def parser() -> argparse.ArgumentParser:
    names = ", ".join(a.name for a in _arms.all_arms())
    ap = argparse.ArgumentParser(prog="python -m kvwire.ab")
    ap.add_argument("--out", default="kvwire-ab", help="directory for ab.json, ab.md and every server's logs")
    ap.add_argument("--quick", action="store_true", help="a 12-request trace (every arm still runs)")
    ap.add_argument("--trace", help="a trace (kvwire.replay format); default: generated (see --quick)")
    ap.add_argument("--arms", nargs="*", help=f"arms to run (single always runs): {names}")
    ap.add_argument("--model", help="a real model (GPUs); default: the CPU stand-in of kvwire.testing")
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    ap.add_argument("--server-args", help="more vllm serve flags for every server (one string)")
    ap.add_argument("--python", help="the interpreter of the venv with vLLM and kvwire (default: this one)")
    ap.add_argument("--block-size", type=int, default=32, help="KV block size (32: what vLLM's CPU attention takes)")
    ap.add_argument("--num-blocks", type=int, default=1024, help="KV blocks per stand-in server")
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--time-scale", type=float, default=1.0)
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--standin-token-us", type=float, default=0.0,
                    help="the stand-in's compute per layer and token, microseconds (a prefill's time grows with "
                         "its tokens, as a real model's does)")
    return ap


def main(argv=None) -> int:
    opts = parser().parse_args(argv)
    from kvwire.ab.report import markdown, write
    from kvwire.ab.run import AbRun
    from kvwire.replay.trace import TraceError

    try:
        ab = AbRun(opts).run()
    except (TraceError, ValueError, OSError) as e:
        print(f"kvwire.ab: {e}", file=sys.stderr)
        return 2
    write(ab, opts.out)
    print(markdown(ab), end="")
    skipped = [r["arm"] for r in ab["arms"] if r["status"] == "SKIPPED"]
    if skipped:
        print(f"kvwire.ab: SKIPPED arms (see ab.md for why): {', '.join(skipped)}", file=sys.stderr)
    bad = [r["arm"] for r in ab["arms"] if r["status"] not in ("ran", "SKIPPED") or (r["status"] == "ran" and (
        r["replay"]["overall"]["errors"] or r["outputs_equal_single"]["equal"] != r["outputs_equal_single"]["of"]))]
    if bad:
        print(f"kvwire.ab: arms with failures or outputs unlike single's: {', '.join(bad)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
