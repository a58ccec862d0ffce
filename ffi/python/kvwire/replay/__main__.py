"""``python -m kvwire.replay run|generate``: see :mod:`kvwire.replay`."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import urllib.request
from dataclasses import asdict

from kvwire.replay import report as _report
from kvwire.replay.prompts import PromptBook
from kvwire.replay.trace import TraceError, generate, read_trace


def _pair(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    return int(lo), int(hi or lo)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m kvwire.replay")
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="replay a trace against an OpenAI endpoint")
    r.add_argument("--url", required=True, help="the endpoint (a vLLM server or python -m kvwire.proxy)")
    r.add_argument("--trace", required=True)
    r.add_argument("--out", required=True, help="directory for results.jsonl, report.json, report.md")
    r.add_argument("--model", help="model name (default: the endpoint's first /v1/models entry)")
    r.add_argument("--vocab", type=int, default=1000, help="prompt tokens are drawn below this id")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--time-scale", type=float, default=1.0, help="multiplies every arrival time (0: all at once)")
    r.add_argument("--timeout", type=float, default=600.0, help="seconds between two chunks of an answer")
    r.add_argument("--no-token-ids", action="store_true", help="do not ask for output token ids")
    r.add_argument("--progress", choices=("auto", "on", "off"), default="auto")
    g = sub.add_parser("generate", help="write a trace with agentic statistics")
    g.add_argument("--out", required=True)
    g.add_argument("--sessions", type=int, default=5)
    g.add_argument("--turns", type=_pair, default=(8, 12), metavar="MIN:MAX")
    g.add_argument("--contexts", type=_pair, default=(1000, 50000), metavar="MIN:MAX", help="prompt tokens")
    g.add_argument("--reuse", type=float, default=0.93, help="share of a later turn's prompt that is the previous one")
    g.add_argument("--outputs", type=_pair, default=(16, 256), metavar="MIN:MAX")
    g.add_argument("--session-gap", type=float, default=20.0, help="mean seconds between session starts")
    g.add_argument("--think", type=float, default=15.0, help="mean seconds between a session's turns")
    g.add_argument("--seed", type=int, default=1)
    return ap


class Progress:
    def __init__(self, total: int, on: bool):
        self.total, self.on, self.done, self.errors = total, on, 0, 0

    def __call__(self, r) -> None:
        self.done += 1
        self.errors += bool(r.error)
        if self.on:
            width = 30
            fill = width * self.done // max(1, self.total)
            sys.stderr.write(f"\rreplay [{'#' * fill}{'.' * (width - fill)}] {self.done}/{self.total}"
                             f"  errors {self.errors}")
            if self.done == self.total:
                sys.stderr.write("\n")
            sys.stderr.flush()


def _model(url: str) -> str:
    with urllib.request.urlopen(url.rstrip("/") + "/v1/models", timeout=30) as r:
        data = json.loads(r.read())
    return data["data"][0]["id"]


def run(opts) -> int:
    from kvwire.replay.client import Replayer

    try:
        turns = read_trace(opts.trace)
    except (TraceError, OSError) as e:
        print(f"kvwire.replay: {e}", file=sys.stderr)
        return 2
    try:
        model = opts.model or _model(opts.url)
    except (OSError, ValueError, KeyError, IndexError) as e:
        print(f"kvwire.replay: {opts.url} does not answer /v1/models: {e}", file=sys.stderr)
        return 2
    book = PromptBook(opts.vocab, seed=opts.seed)
    prompts = [book.prompt(t) for t in turns]
    on = opts.progress == "on" or (opts.progress == "auto" and sys.stderr.isatty())
    progress = Progress(len(turns), on)
    rp = Replayer(opts.url, model, time_scale=opts.time_scale, timeout=opts.timeout,
                  token_ids=not opts.no_token_ids, on_done=progress)
    results = asyncio.run(rp.run(turns, prompts))
    os.makedirs(opts.out, exist_ok=True)
    with open(os.path.join(opts.out, "results.jsonl"), "w", encoding="utf-8") as f:
        for r in results:
            f.write(json.dumps(asdict(r), separators=(",", ":")) + "\n")
    rep = _report.summarize(results)
    with open(os.path.join(opts.out, "report.json"), "w", encoding="utf-8") as f:
        json.dump(rep, f, indent=2)
    md = _report.markdown(rep)
    with open(os.path.join(opts.out, "report.md"), "w", encoding="utf-8") as f:
        f.write(md)
    print(md, end="")
    return 1 if rep["overall"]["errors"] else 0


def main(argv=None) -> int:
    opts = parser().parse_args(argv)
    if opts.cmd == "run":
        return run(opts)
    try:
        lines = generate(sessions=opts.sessions, turns=opts.turns, contexts=opts.contexts, reuse=opts.reuse,
                         outputs=opts.outputs, session_gap_s=opts.session_gap, think_s=opts.think, seed=opts.seed)
    except ValueError as e:
        print(f"kvwire.replay: {e}", file=sys.stderr)
        return 2
    with open(opts.out, "w", encoding="utf-8") as f:
        for rec in lines:
            f.write(json.dumps(rec) + "\n")
    print(f"kvwire.replay: {len(lines)} turns of {opts.sessions} sessions in {opts.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
