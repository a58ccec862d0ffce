"""The users' A/B in one command: ``python -m kvwire.ab`` (``kvwire-bench ab`` runs it).

Starts the servers of each arm, replays the same agentic trace against each
(:mod:`kvwire.replay`, through :mod:`kvwire.proxy` for the P/D arms) and writes ``ab.json`` and
``ab.md`` (``kvwire-bench ab`` adds ``ab.png``). Arms:

* ``single`` — one instance, no connector (the reference: every other arm's outputs are
  compared with its outputs);
* ``kv_both-mooncake`` — one instance with vLLM's MooncakeConnector in ``kv_both`` and no
  transfer (the substrate tax of Mooncake's connector);
* ``kv_both-kvwire`` — the same with KvwireConnector (kvwire's substrate tax);
* ``pd-<policy>-<mode>`` — 1P1D with KvwireConnector, for each reservation policy (eager, lazy,
  jit, land) × send mode (whole, layerwise), chosen per request; one P/D pair serves them all,
  its prefix caches reset between arms.

Each group of servers first serves two warm-up requests (other prompts; their time is in
``warmup``, not in the arms' figures: a fresh P/D pair's first requests pay one-off costs);
before and after them it waits until its servers use no CPU (``warmup.settle_before`` and
``warmup.settle``: start-up work a server still runs once it is ready is nobody's cost).
Per arm: TTFT/TPOT/E2E p50/p90/p99 (client side), and for P/D arms from the connectors'
timelines: decode_sent→first_token p50/p90 and its decomposition (wait for P, reservation wait,
exposed transfer, report delay, promotion delay, first step), the exposed tail after P's last
layer, D block-seconds held waiting for KV, wire bytes, failures; outputs equal to ``single``'s.

* :mod:`kvwire.ab.arms` — the arms and their servers;
* :mod:`kvwire.ab.timelines` — per-arm figures from the connectors' timelines;
* :mod:`kvwire.ab.run` — starting servers, replaying, collecting;
* :mod:`kvwire.ab.report` — ``ab.json`` and ``ab.md``.

On this CPU machine the servers run the stand-in worker of :mod:`kvwire.testing` (a tiny model
whose next token is read from its KV cache); ``--model`` and ``--tensor-parallel-size`` run a
real model on GPUs instead (the same command is the users' A/B on their cluster).
"""
