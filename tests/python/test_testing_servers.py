"""kvwire.testing.servers: what a stand-in server is started with, checked without starting one."""

from __future__ import annotations

import pytest

pytest.importorskip("numpy", reason="kvwire.testing needs numpy (installed with vLLM)")

from kvwire.testing import ports, servers  # noqa: E402


def test_each_server_gets_its_own_vllm_ports_below_the_ephemeral_range():
    low = ports._ephemeral_low()
    a = servers.Server("a", "/nonexistent/bin/python", 1, "/nonexistent/model")
    b = servers.Server("b", "/nonexistent/bin/python", 2, "/nonexistent/model")
    runs = []
    for s in (a, b):
        base = int(s.env["VLLM_PORT"])
        run = range(base, base + servers.VLLM_PORTS)
        assert run[-1] < low, f"{s.name}: VLLM_PORT run {run} reaches the ephemeral range from {low}"
        runs.append(set(run))
    assert not runs[0] & runs[1], "two servers share vLLM ports"


def test_a_caller_can_still_choose_vllm_port():
    s = servers.Server("c", "/nonexistent/bin/python", 3, "/nonexistent/model", env={"VLLM_PORT": "12345"})
    assert s.env["VLLM_PORT"] == "12345"
