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
cd "$(dirname "$0")/../.."
ROOT=$(pwd)
. "$ROOT/tests/lib/install.sh"
install_init setup "bash tests/python/setup.sh   (a failed vLLM venv is removed and redone; logs in ${KVWIRE_PY_CACHE:-$HOME/.cache/kvwire-py})"
CACHE=${KVWIRE_PY_CACHE:-$HOME/.cache/kvwire-py}
VERSIONS=${KVWIRE_VLLM_VERSIONS:-"0.33.0 0.18.1"}
PY=${PYTHON:-python3}
mkdir -p "$CACHE"
export PIP_DISABLE_PIP_VERSION_CHECK=1

# 0. venv support (Debian's python3 needs python3-venv for ensurepip).
if ! "$PY" -c "import ensurepip, venv" >/dev/null 2>&1; then
  log "apt-get install python3-venv python3-pip"
  export DEBIAN_FRONTEND=noninteractive
  { apt-get update -qq && apt-get install -y -qq --no-install-recommends python3-venv python3-pip; } \
    || die "apt-get install python3-venv python3-pip (needs root and Debian's package lists)"
fi

# 1. maturin for the build interpreter.
if ! "$PY" -m maturin --version >/dev/null 2>&1; then
  log "pip install maturin"
  "$PY" -m pip install -q "maturin>=1.9.4,<2" || die "pip install maturin into $PY"
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
  "$PY" -m venv "$dir" || { log "vllm $ver: python -m venv $dir FAILED"; return 1; }
  "$dir/bin/python" -m pip install -q --upgrade pip >/dev/null || { log "vllm $ver: pip upgrade FAILED"; return 1; }
  if ! "$dir/bin/python" -m pip install "vllm==$ver" pytest >"$CACHE/vllm-$ver.pip.log" 2>&1; then
    log "vllm $ver install FAILED; see $CACHE/vllm-$ver.pip.log"
    tail -20 "$CACHE/vllm-$ver.pip.log" >&2
    return 1
  fi
  local secs=$((SECONDS - t0)) size
  size=$(du -sh "$dir" 2>/dev/null | cut -f1) || size=unknown
  echo "vllm $ver: installed in ${secs} s, venv size ${size}" | tee "$CACHE/vllm-$ver.install"
  touch "$dir/.kvwire-ok"
}

venvs=()
if [ "${KVWIRE_SKIP_VLLM:-0}" = 1 ]; then
  if [ ! -x "$CACHE/plain/bin/python" ]; then
    log "python -m venv $CACHE/plain"
    "$PY" -m venv "$CACHE/plain" || die "python -m venv $CACHE/plain"
  fi
  "$CACHE/plain/bin/python" -m pip install -q pytest || die "pip install pytest into $CACHE/plain"
  venvs+=("$CACHE/plain")
else
  pids=()
  vers=()
  for v in $VERSIONS; do
    if [ -f "$CACHE/vllm-$v/.kvwire-ok" ]; then
      log "vllm $v: cached ($(cat "$CACHE/vllm-$v.install" 2>/dev/null || echo 'no record'))"
    else
      log "vllm $v: installing (several minutes, ~9 GB)"
      install_venv "$v" &
      pids+=($!)
      vers+=("$v")
    fi
    venvs+=("$CACHE/vllm-$v")
  done
  failed=()
  for i in "${!pids[@]}"; do
    wait "${pids[$i]}" || failed+=("${vers[$i]}")
  done
  [ ${#failed[@]} -eq 0 ] || die "vLLM venv install for version(s) ${failed[*]} (logs: $CACHE/vllm-<ver>.pip.log)"
fi

# 2b. Mooncake's transfer engine (CPU build, pinned) in every vLLM venv: vLLM's own
#     MooncakeConnector imports it, and `kvwire-bench tax` measures that connector next to ours.
#     tests/python/install_mooncake.sh probes, installs when absent and checks the import.
#     Then the test-only vLLM platform plugin of tests/e2e (tests/python/install_plugins.sh).
if [ "${KVWIRE_SKIP_VLLM:-0}" != 1 ]; then
  for d in "${venvs[@]}"; do
    bash "$ROOT/tests/python/install_mooncake.sh" "$d"
    bash "$ROOT/tests/python/install_plugins.sh" "$d"
  done
fi

# 3. The kvwire wheel, into every venv.
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$ROOT/target}
WHEELS="$CACHE/wheels"
rm -rf "$WHEELS"
mkdir -p "$WHEELS"
log "maturin build --release"
(cd ffi && "$PY" -m maturin build --release -q -o "$WHEELS" -j "${KVWIRE_JOBS:-2}" >"$CACHE/maturin.log" 2>&1) \
  || { tail -30 "$CACHE/maturin.log" >&2; die "maturin build of the kvwire wheel (log: $CACHE/maturin.log)"; }
WHL=
for w in "$WHEELS"/kvwire-*.whl; do [ -f "$w" ] && WHL=$w; done
[ -n "$WHL" ] || die "maturin build wrote no kvwire wheel into $WHEELS"
: >"$CACHE/venvs.txt"
for d in "${venvs[@]}"; do
  "$d/bin/python" -m pip install -q --force-reinstall --no-deps "$WHL" || die "pip install $WHL into $d"
  "$d/bin/python" -c "import kvwire, sys; print('kvwire', kvwire.__version__, 'in', sys.prefix)" \
    || die "kvwire does not import in $d"
  echo "$d/bin/python" >>"$CACHE/venvs.txt"
done
log "done"
