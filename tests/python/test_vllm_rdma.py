"""KvwireConnector over the RDMA transport, on every host: the in-process loopback RDMA device
(crate ``kvwire-verbs-loopback``, loaded in place of libibverbs through ``KVWIRE_IBVERBS_PATH``;
it checks every work request against its registered regions as a NIC does) with one and with two
devices. A kv_both D and a kv_both P in one process (two data engines, four control engines):
every byte of a request lands in D's cache over rdma; each device is opened once per process
whatever the number of engines (device contexts counted by the verbs layer); the control engines
open none; and kvwire's threads grow with the devices by exactly one completion thread each.

Each case runs in a child process (``rdma_connector_child.py``): the verbs library is loaded
once per process, and the other tests of this directory run on shm without it.
``tests/python/run.sh`` builds the device and sets ``KVWIRE_LOOPBACK_LIB``."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm", reason="vLLM not installed in this venv (run tests/python/setup.sh)")

HERE = os.path.dirname(os.path.abspath(__file__))


def loopback_lib() -> str:
    lib = os.environ.get("KVWIRE_LOOPBACK_LIB")
    if not lib:
        pytest.skip("KVWIRE_LOOPBACK_LIB is not set: the loopback RDMA device was not built "
                    "(tests/python/run.sh builds it: cargo build --release -p kvwire-verbs-loopback)")
    if not os.path.isfile(lib):
        pytest.fail(f"KVWIRE_LOOPBACK_LIB={lib!r} does not exist")
    return lib


def run_child(devices: int) -> dict:
    env = {**os.environ, "KVWIRE_IBVERBS_PATH": loopback_lib(), "KVWIRE_LOOPBACK_DEVICES": str(devices),
           "PYTHONPATH": HERE + os.pathsep + os.environ.get("PYTHONPATH", "")}
    for k in ("KVWIRE_RDMA_DEVICE", "KVWIRE_PREFER_RDMA"):
        env.pop(k, None)
    r = subprocess.run([sys.executable, os.path.join(HERE, "rdma_connector_child.py")], env=env,
                       capture_output=True, text=True, timeout=600)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert r.returncode == 0 and lines, r.stdout[-3000:] + r.stderr[-5000:]
    return json.loads(lines[-1][len("RESULT "):])


def test_kv_both_over_rdma_opens_each_device_once_per_process():
    one, two = run_child(1), run_child(2)
    for devices, out in ((1, one), (2, two)):
        assert out["ran"] and out["blocks"] == 3 and out["bytes_ok"], out
        assert out["transports"] == ["rdma"], out
        # Two data engines, four control engines (tcp): each device opened once.
        assert out["contexts"] == devices, out
        cq = {n: k for n, k in out["threads"].items() if n.startswith("rdma-cq-")}
        assert cq == {f"rdma-cq-loop{i}": 1 for i in range(devices)}, out
    # Every other kvwire thread is the same with one device and with two. (`kvwire-conn` is left
    # out: besides the lanes peers opened, it counts handshakes in progress, which come and go.)
    rest = lambda t: {n: k for n, k in t.items() if not n.startswith("rdma-cq-") and n != "kvwire-conn"}  # noqa: E731
    assert rest(one["threads"]) == rest(two["threads"]), (one, two)
    assert sum(rest(two["threads"]).values()) > 0, two
