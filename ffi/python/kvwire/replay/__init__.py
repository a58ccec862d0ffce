"""Agentic trace replay against an OpenAI endpoint: ``python -m kvwire.replay``.

* :mod:`kvwire.replay.trace` — the trace format (JSON lines: ``session``, ``turn``,
  ``arrival_s``, ``prompt_tokens``, ``cached_tokens``, ``output_tokens``), read with line
  numbers in every error, and a generator of traces with agentic statistics;
* :mod:`kvwire.replay.prompts` — token-id prompts in which a later turn of a session really
  begins with the earlier turn's prompt (``cached_tokens`` of it), so prefix caches hit as the
  trace says;
* :mod:`kvwire.replay.client` — sends every turn when its arrival time has come and its
  session's previous turn is done, streamed, timing first and last token;
* :mod:`kvwire.replay.report` — TTFT, TPOT and E2E p50/p90/p99 overall and per prompt class
  (<5k, 5–20k, 20–50k, >50k tokens), errors counted and shown.

``python -m kvwire.replay run --url http://127.0.0.1:8000 --trace T.jsonl --out DIR`` writes
``DIR/results.jsonl`` (one line per request, with its output token ids when the server returns
them) and ``DIR/report.json``/``report.md``; ``python -m kvwire.replay generate ...`` writes a
trace. ``kvwire/replay/traces/agentic-small.jsonl`` is a generated one (5 sessions, 1k–50k
contexts, about 93 % of each later turn's prompt a prefix of the turn before).
"""
