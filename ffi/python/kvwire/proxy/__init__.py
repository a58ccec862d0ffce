"""A P/D proxy in front of vLLM servers: ``python -m kvwire.proxy``.

OpenAI ``/v1/completions`` and ``/v1/chat/completions``, streaming and not. Each request gets
a minted transfer id and is sent to a prefill (P) and a decode (D) backend at once: to P with
``max_tokens`` 1, to D as the client asked, each with the ``kv_transfer_params`` of its role in
kvwire's style (``remote_control``) or in vLLM MooncakeConnector's (``remote_bootstrap_addr``),
so the same proxy drives both connectors. D's answer is the client's answer.

* :mod:`kvwire.proxy.backends` — backends, their health and load (from ``/health`` and
  ``/metrics``);
* :mod:`kvwire.proxy.policy` — which P and D: ``round_robin``, ``least_load``, ``pdsep`` (a
  reference gate that keeps short prompts on D, from the router's cost model
  :mod:`kvwire.costs`), or ``module:callable``;
* :mod:`kvwire.proxy.params` — the ``kv_transfer_params`` of each style;
* :mod:`kvwire.proxy.records` — one JSON line per request (``"kind": "router"``, transfer id,
  ``decode_sent_ns``, ``first_token_ns``, ``last_token_ns``, chosen P and D and their loads),
  which ``kvwire-bench calibrate --timeline DIR`` joins with the connectors' timelines;
* :mod:`kvwire.proxy.server` — the HTTP server (aiohttp, which vLLM ships).

A backend that fails or does not answer in time gives the client an OpenAI-style error in
bounded time; a client that goes away mid-stream closes the proxy's connections to P and D, and
vLLM aborts the request on both.
"""
