#!/usr/bin/env bash
# Installs what the Python tests need, idempotently, on a fresh Debian machine:
#   * maturin and pytest for the build Python (pip --user-less, into the interpreter found first),
#   * one venv per vLLM version under $KVWIRE_PY_CACHE (default ~/.cache/kvwire-py):
#       vllm-0.33.0 (current) and vllm-0.18.1 (the users' version), from PyPI, CPU-usable
#       (the default wheels pull CUDA torch; its CPU path works without a GPU), plus pytest and
#       Mooncake's CPU transfer engine (pinned; for vLLM's MooncakeConnector in kvwire-bench tax),
#   * the kvwire wheel (maturin build --release) installed into every venv.
#
# A venv whose install succeeded carries a marker file and is never reinstalled; a failed or
# interrupted install is removed and redone. Install time and size of each venv are written to
# $KVWIRE_PY_CACHE/vllm-<ver>.install (and printed).
#
# Env: KVWIRE_PY_CACHE, KVWIRE_VLLM_VERSIONS (default "0.33.0 0.18.1"), PYTHON (default python3),
#      KVWIRE_SKIP_VLLM=1 (only maturin + the wheel; a plain venv "$CACHE/plain" is made for it).
# Prints the venv pythons, one per line, to $KVWIRE_PY_CACHE/venvs.txt.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$(pwd)
CACHE=${KVWIRE_PY_CACHE:-$HOME/.cache/kvwire-py}
VERSIONS=${KVWIRE_VLLM_VERSIONS:-"0.33.0 0.18.1"}
PY=${PYTHON:-python3}
mkdir -p "$CACHE"
export PIP_DISABLE_PIP_VERSION_CHECK=1

log() { echo "[setup $(date +%T)] $*"; }

# 0. venv support (Debian's python3 needs python3-venv for ensurepip).
if ! "$PY" -c "import ensurepip, venv" >/dev/null 2>&1; then
  log "apt-get install python3-venv"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq && apt-get install -y -qq --no-install-recommends python3-venv python3-pip
fi

# 1. maturin for the build interpreter.
if ! "$PY" -m maturin --version >/dev/null 2>&1; then
  log "pip install maturin"
  "$PY" -m pip install -q "maturin>=1.9.4,<2"
fi
"$PY" -m maturin --version

# 2. vLLM venvs (in parallel: the downloads dominate).
install_venv() {
  local ver=$1 dir="$CACHE/vllm-$1"
  if [ -f "$dir/.kvwire-ok" ]; then
    return 0
  fi
  rm -rf "$dir"
  local t0=$SECONDS
  "$PY" -m venv "$dir"
  "$dir/bin/python" -m pip install -q --upgrade pip >/dev/null
  if ! "$dir/bin/python" -m pip install "vllm==$ver" pytest >"$CACHE/vllm-$ver.pip.log" 2>&1; then
    log "vllm $ver install FAILED; see $CACHE/vllm-$ver.pip.log"
    tail -20 "$CACHE/vllm-$ver.pip.log"
    return 1
  fi
  local secs=$((SECONDS - t0))
  local size
  size=$(du -sh "$dir" | cut -f1)
  echo "vllm $ver: installed in ${secs} s, venv size ${size}" | tee "$CACHE/vllm-$ver.install"
  touch "$dir/.kvwire-ok"
}

venvs=()
if [ "${KVWIRE_SKIP_VLLM:-0}" = 1 ]; then
  if [ ! -x "$CACHE/plain/bin/python" ]; then
    "$PY" -m venv "$CACHE/plain"
  fi
  "$CACHE/plain/bin/python" -m pip install -q pytest
  venvs+=("$CACHE/plain")
else
  pids=()
  for v in $VERSIONS; do
    if [ -f "$CACHE/vllm-$v/.kvwire-ok" ]; then
      log "vllm $v: cached ($(cat "$CACHE/vllm-$v.install" 2>/dev/null || echo 'no record'))"
    else
      log "vllm $v: installing (several minutes, ~9 GB)"
      install_venv "$v" &
      pids+=($!)
    fi
    venvs+=("$CACHE/vllm-$v")
  done
  for p in "${pids[@]}"; do
    wait "$p"
  done
fi

# 2b. Mooncake's transfer engine (CPU build, pinned) in every vLLM venv: vLLM's own
#     MooncakeConnector imports it, and `kvwire-bench tax` measures that connector next to ours.
#     Idempotent: skipped when the pinned version is already there.
MOONCAKE_PIN=${KVWIRE_MOONCAKE_PIN:-mooncake-transfer-engine-non-cuda==0.3.13.post1}
if [ "${KVWIRE_SKIP_VLLM:-0}" != 1 ]; then
  for d in "${venvs[@]}"; do
    have=$("$d/bin/python" -m pip show mooncake-transfer-engine-non-cuda 2>/dev/null | sed -n 's/^Version: //p')
    if [ "mooncake-transfer-engine-non-cuda==$have" = "$MOONCAKE_PIN" ]; then
      log "$(basename "$d"): $MOONCAKE_PIN present"
    else
      log "$(basename "$d"): pip install $MOONCAKE_PIN"
      "$d/bin/python" -m pip install -q "$MOONCAKE_PIN"
    fi
    "$d/bin/python" -c "from mooncake.engine import TransferEngine" 2>/dev/null \
      || { log "$(basename "$d"): mooncake.engine does not import"; exit 1; }
  done
fi

# 3. The kvwire wheel, into every venv.
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$ROOT/target}
WHEELS="$CACHE/wheels"
rm -rf "$WHEELS"
mkdir -p "$WHEELS"
log "maturin build --release"
(cd ffi && "$PY" -m maturin build --release -q -o "$WHEELS" -j "${KVWIRE_JOBS:-2}" 2>&1 | tail -3)
WHL=$(ls "$WHEELS"/kvwire-*.whl | head -1)
: >"$CACHE/venvs.txt"
for d in "${venvs[@]}"; do
  "$d/bin/python" -m pip install -q --force-reinstall --no-deps "$WHL"
  "$d/bin/python" -c "import kvwire, sys; print('kvwire', kvwire.__version__, 'in', sys.prefix)"
  echo "$d/bin/python" >>"$CACHE/venvs.txt"
done
log "done"
