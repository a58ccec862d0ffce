#!/usr/bin/env bash
# Python package and vLLM connector tests:   bash tests/python/run.sh
#
# 1. tests/python/setup.sh: maturin, one venv per vLLM version (0.33.0 and 0.18.1, cached under
#    $KVWIRE_PY_CACHE, default ~/.cache/kvwire-py), the kvwire wheel installed into each.
# 2. cargo builds the loopback RDMA device (kvwire-verbs-loopback) for test_vllm_rdma.py.
# 3. pytest in every venv: the engine and the mooncake drop-in across two processes, and the
#    vLLM connector in vLLM's real v1 Scheduler on CPU (over shm, and over rdma on the loopback
#    device).
#
# Env: KVWIRE_VLLM_VERSIONS (default "0.33.0 0.18.1"), KVWIRE_SKIP_VLLM=1 (engine and drop-in
# tests only, in a plain venv; the vLLM tests then skip, loudly).
set -euo pipefail
cd "$(dirname "$0")"
HERE=$(pwd)
CACHE=${KVWIRE_PY_CACHE:-$HOME/.cache/kvwire-py}
bash "$HERE/setup.sh"
# The loopback RDMA device (an in-process software NIC) for test_vllm_rdma.py: the connector over
# the rdma transport on every host.
ROOT=$(cd "$HERE/../.." && pwd)
(cd "$ROOT" && cargo build -q -j "${KVWIRE_JOBS:-2}" -p kvwire-verbs-loopback) \
  || { echo "cargo build -p kvwire-verbs-loopback FAILED" >&2; exit 1; }
export KVWIRE_LOOPBACK_LIB="${CARGO_TARGET_DIR:-$ROOT/target}/debug/libkvwire_verbs_loopback.so"
rc=0
while read -r py; do
  [ -n "$py" ] || continue
  echo "==== pytest with $py ($("$py" -c 'import importlib.metadata as m
try: print("vllm", m.version("vllm"))
except m.PackageNotFoundError: print("no vllm")'))"
  if [ "${KVWIRE_SKIP_VLLM:-0}" = 1 ]; then
    echo "SKIPPED: vLLM connector tests (KVWIRE_SKIP_VLLM=1)" >&2
    req_torch=0
  else
    req_torch=1
  fi
  # Every test file here (a list by hand once left the proxy's and the replayer's tests out).
  KVWIRE_REQUIRE_TORCH=$req_torch "$py" -m pytest -q -p no:cacheprovider test_*.py || rc=1
done <"$CACHE/venvs.txt"
exit $rc
