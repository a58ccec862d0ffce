"""Test-only parts of kvwire: a stand-in model worker that lets ``vllm serve`` run on a CPU-only
machine with KvwireConnector (or vLLM's MooncakeConnector, or no connector) loaded, exactly as
on GPUs apart from the model.

Nothing here is used by the connector or the engine; production servers never load it.

* :mod:`kvwire.testing.model` — the stand-in model: each token's K/V is a deterministic function
  of (the token ids so far, layer), and each next token is chosen from the K/V *read back from
  the KV cache*, so a decode instance produces the same tokens as a single instance if and only
  if the KV it received is right. Pure functions, also used by tests to compute the expected
  output of a prompt without a server.
* :mod:`kvwire.testing.worker` — ``StandInWorker``, given to ``vllm serve --worker-cls``: drives
  the connector's worker side as vLLM's GPU model runner does (register_kv_caches,
  start_load_kv, per-layer wait_for_layer_load / save_kv_layer, wait_for_save, get_finished,
  stats), over CPU KV tensors allocated in vLLM's own layout.
* :mod:`kvwire.testing.control` — what a test can do to a running worker from outside: a
  per-layer compute time, holding a layer until the test releases it, counting what happened.
* :mod:`kvwire.testing.platform` — a CPU platform for vLLM whose async scheduling can be turned
  on (vLLM's own CPU platform always turns it off), selected through a test-only platform plugin
  (``tests/e2e/plugin``) that is installed into test environments only.
* :mod:`kvwire.testing.servers` — starting and stopping such servers from a test.
* :mod:`kvwire.testing.wait` — polling for a condition with a bound on the wait.
"""
