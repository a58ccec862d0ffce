"""Agentic session traces: reading them (with line numbers in every error) and generating them.

One JSON object per line::

    {"session": "s3", "turn": 2, "arrival_s": 41.5, "prompt_tokens": 12034,
     "cached_tokens": 11210, "output_tokens": 180}

``arrival_s`` is seconds from the trace's start; ``cached_tokens`` is how much of the prompt is
the same as the previous turn's prompt of the session (0 on a session's first turn). Turns of a
session are numbered from 0 without gaps and their arrivals do not go back in time.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import asdict, dataclass

FIELDS = ("session", "turn", "arrival_s", "prompt_tokens", "cached_tokens", "output_tokens")


class TraceError(ValueError):
    """A trace line that cannot be used: ``path:line: what``."""


@dataclass(frozen=True)
class Turn:
    session: str
    turn: int
    arrival_s: float
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    line: int = 0


def _int(v, name, where, low):
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise TraceError(f"{where}: {name} must be an integer >= {low}, got {v!r}")
    return v


def parse_line(text: str, where: str) -> Turn:
    try:
        obj = json.loads(text)
    except ValueError as e:
        raise TraceError(f"{where}: not JSON: {e}") from e
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: not a JSON object")
    missing = [f for f in FIELDS if f not in obj]
    if missing:
        raise TraceError(f"{where}: missing {', '.join(missing)}")
    session = obj["session"]
    if not isinstance(session, (str, int)) or isinstance(session, bool):
        raise TraceError(f"{where}: session must be a string or an integer, got {session!r}")
    arrival = obj["arrival_s"]
    if isinstance(arrival, bool) or not isinstance(arrival, (int, float)) or not math.isfinite(arrival) or arrival < 0:
        raise TraceError(f"{where}: arrival_s must be a finite number >= 0, got {arrival!r}")
    prompt = _int(obj["prompt_tokens"], "prompt_tokens", where, 1)
    cached = _int(obj["cached_tokens"], "cached_tokens", where, 0)
    if cached > prompt:
        raise TraceError(f"{where}: cached_tokens {cached} exceed prompt_tokens {prompt}")
    return Turn(str(session), _int(obj["turn"], "turn", where, 0), float(arrival), prompt, cached,
                _int(obj["output_tokens"], "output_tokens", where, 1))


def read_trace(path: str) -> list[Turn]:
    """Every turn of the trace, in arrival order (ties in file order); TraceError on the first
    bad line, naming it."""
    turns: list[Turn] = []
    last: dict[str, Turn] = {}
    with open(path, encoding="utf-8") as f:
        for n, text in enumerate(f, 1):
            if not text.strip():
                continue
            where = f"{path}:{n}"
            t = parse_line(text, where)
            t = Turn(**{**asdict(t), "line": n})
            prev = last.get(t.session)
            want = 0 if prev is None else prev.turn + 1
            if t.turn != want:
                raise TraceError(f"{where}: session {t.session} turn {t.turn}, expected turn {want}")
            if prev is not None and t.arrival_s < prev.arrival_s:
                raise TraceError(f"{where}: session {t.session} turn {t.turn} arrives before its turn {prev.turn}")
            if prev is None and t.cached_tokens:
                raise TraceError(f"{where}: session {t.session} turn 0 has cached_tokens {t.cached_tokens}")
            if prev is not None and t.cached_tokens > prev.prompt_tokens:
                raise TraceError(f"{where}: cached_tokens {t.cached_tokens} exceed the previous turn's prompt "
                                 f"({prev.prompt_tokens} tokens)")
            last[t.session] = t
            turns.append(t)
    if not turns:
        raise TraceError(f"{path}: no turns")
    return sorted(turns, key=lambda t: (t.arrival_s, t.line))


def generate(*, sessions: int, turns: tuple[int, int], contexts: tuple[int, int], reuse: float,
             outputs: tuple[int, int], session_gap_s: float, think_s: float, seed: int) -> list[dict]:
    """A trace of ``sessions`` sessions: each starts at a context drawn log-uniformly from
    ``contexts`` (min, max tokens), and every later turn keeps the whole previous prompt as its
    prefix and adds new tokens so that about ``reuse`` of it is that prefix, until the context
    reaches its maximum (then the oldest tokens drop out and the kept prefix shrinks to fit).
    Sessions start ``session_gap_s`` apart on average (exponential), turns follow ``think_s``
    apart on average after the previous turn's arrival."""
    rng = random.Random(seed)
    lo, hi = contexts
    if not (1 <= lo <= hi) or not (0.0 <= reuse < 1.0) or sessions < 1 or not (1 <= turns[0] <= turns[1]):
        raise ValueError("generate: bad ranges")
    out = []
    start = 0.0
    for s in range(sessions):
        start += rng.expovariate(1.0 / session_gap_s) if s else 0.0
        t = start
        prompt = int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))
        prompt = max(lo, min(hi, prompt))
        cached = 0
        for k in range(rng.randint(*turns)):
            if k:
                t += rng.expovariate(1.0 / think_s)
                grown = int(math.ceil(prompt / reuse)) if reuse > 0 else prompt + 1
                grown = max(prompt + 1, grown)
                if grown > hi:
                    cached = max(0, int(hi * reuse))
                    prompt = hi
                else:
                    cached, prompt = prompt, grown
            out.append({"session": f"s{s}", "turn": k, "arrival_s": round(t, 3), "prompt_tokens": prompt,
                        "cached_tokens": cached, "output_tokens": rng.randint(*outputs)})
    out.sort(key=lambda r: r["arrival_s"])
    return out
