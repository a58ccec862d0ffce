"""Test-only vLLM platform plugin (see pyproject.toml)."""

import os


def select():
    if os.environ.get("KVWIRE_TEST_CPU_PLATFORM") != "1":
        return None
    return "kvwire.testing.platform.StandInCpuPlatform"
