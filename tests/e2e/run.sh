#!/usr/bin/env bash
# Real vLLM servers on CPU with KvwireConnector:   bash tests/e2e/run.sh
#
# Uses the venvs of tests/python/setup.sh (one per vLLM version, installed when missing) and a
# kvwire-bench binary for calibrate and ab (built here unless KVWIRE_BENCH_BIN names one). Per
# venv: tests/e2e/test_servers.py with async scheduling on (vLLM's default) and off; then
# tests/e2e/test_ab.py (kvwire-bench ab --quick) with the newest vLLM.
# Env: KVWIRE_E2E_ASYNC ("1 0" by default), KVWIRE_VLLM_VERSIONS (see setup.sh).
set -euo pipefail
cd "$(dirname "$0")"
HERE=$(pwd)
ROOT=$(cd ../.. && pwd)
# shellcheck source=../lib/install.sh
. "$ROOT/tests/lib/install.sh"
install_init e2e "bash tests/e2e/run.sh"
CACHE=${KVWIRE_PY_CACHE:-$HOME/.cache/kvwire-py}
bash "$ROOT/tests/python/setup.sh"
if [ -z "${KVWIRE_BENCH_BIN:-}" ]; then
  (cd "$ROOT" && cargo build -q -p kvwire-bench) || die "cargo build -p kvwire-bench"
  KVWIRE_BENCH_BIN="${CARGO_TARGET_DIR:-$ROOT/target}/debug/kvwire-bench"
fi
export KVWIRE_BENCH_BIN
rc=0
n=0
while read -r py; do
  [ -n "$py" ] || continue
  "$py" -c 'import vllm' 2>/dev/null || { echo "SKIPPED: $py has no vLLM (KVWIRE_SKIP_VLLM?)"; continue; }
  for a in ${KVWIRE_E2E_ASYNC:-1 0}; do
    echo "==== e2e with $py ($("$py" -c 'import vllm; print("vllm", vllm.__version__)'), async scheduling $a)"
    KVWIRE_E2E_ASYNC=$a "$py" -m pytest -q -p no:cacheprovider -rs -s "$HERE/test_servers.py" || rc=1
    n=$((n + 1))
  done
done <"$CACHE/venvs.txt"
[ "$n" -gt 0 ] || { echo "e2e: no venv with vLLM ran"; exit 1; }
# kvwire-bench ab --quick (every arm, real servers) once, with the newest vLLM.
py=$(head -n1 "$CACHE/venvs.txt")
echo "==== kvwire-bench ab --quick with $py"
"$py" -m pytest -q -p no:cacheprovider -rs -s "$HERE/test_ab.py" || rc=1
exit $rc
