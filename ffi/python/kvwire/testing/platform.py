"""``StandInCpuPlatform``: vLLM's CPU platform, configured as a one-GPU server would be.

Test-only. vLLM's ``CpuPlatform.check_and_update_config`` makes two choices that a GPU server
with tensor parallelism 1 (the users' deployment: one instance per GPU) does not make:

- it turns async scheduling off unconditionally; production GPU servers run with it on (the
  default), and the connector must work both ways. With ``KVWIRE_TEST_ASYNC_SCHEDULING=1`` this
  subclass restores it; with ``=0`` (or unset) it stays off.
- vLLM 0.33 replaces the in-process executor (``uni``, what vLLM picks for one GPU) with the
  multiprocess one, because its OpenMP kernels need their own process. Its worker process then
  spins (``sched_yield``) on the shared-memory queue for a second after every step: on the
  2-core test machine, with several servers up, that spin takes the CPU from the engine-core and
  connector threads of every server and delays them by hundreds of milliseconds, a cost a GPU
  server never pays. The stand-in has no OpenMP work, so this subclass keeps the executor vLLM
  chose before the CPU platform's checks. A server started with
  ``--distributed-executor-backend mp`` keeps its worker in its own process (as at tensor
  parallelism > 1), on both versions.

It is selected through the test-only platform plugin in ``tests/e2e/plugin`` (entry point group
``vllm.platform_plugins``), which returns this class's qualified name when
``KVWIRE_TEST_CPU_PLATFORM=1`` and ``None`` otherwise.
"""

from __future__ import annotations

import os

from vllm.platforms.cpu import CpuPlatform


class StandInCpuPlatform(CpuPlatform):
    @classmethod
    def check_and_update_config(cls, vllm_config) -> None:
        parallel = vllm_config.parallel_config
        chosen = parallel.distributed_executor_backend
        super().check_and_update_config(vllm_config)
        if chosen == "uni":
            parallel.distributed_executor_backend = "uni"
        if os.environ.get("KVWIRE_TEST_ASYNC_SCHEDULING") == "1":
            vllm_config.scheduler_config.async_scheduling = True
