"""``StandInCpuPlatform``: vLLM's CPU platform, with async scheduling left on when asked.

vLLM's ``CpuPlatform.check_and_update_config`` turns async scheduling off unconditionally, but
production GPU servers run with it on (the default), and the connector must work both ways.
With ``KVWIRE_TEST_ASYNC_SCHEDULING=1`` this subclass restores it after the CPU platform's
checks; with ``=0`` (or unset) it behaves exactly as ``CpuPlatform``.

It is selected through the test-only platform plugin in ``tests/e2e/plugin`` (entry point group
``vllm.platform_plugins``), which returns this class's qualified name when
``KVWIRE_TEST_CPU_PLATFORM=1`` and ``None`` otherwise. Test-only.
"""

from __future__ import annotations

import os

from vllm.platforms.cpu import CpuPlatform


class StandInCpuPlatform(CpuPlatform):
    @classmethod
    def check_and_update_config(cls, vllm_config) -> None:
        super().check_and_update_config(vllm_config)
        if os.environ.get("KVWIRE_TEST_ASYNC_SCHEDULING") == "1":
            vllm_config.scheduler_config.async_scheduling = True
