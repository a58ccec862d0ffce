#!/usr/bin/env bash
# CI stage "install": the fresh path of every cheap install step, run for real on every CI run,
# even on a machine whose caches are warm. A warm cache hides a missing install step (the python
# stage once failed on a new machine only, because the cached venvs already held Mooncake); here
# each step starts from nothing, in scratch directories that are removed afterwards:
#
#   1. syntax of every shell script under tests/ and .ci/ (bash -n)
#   2. tests/python/setup.sh with KVWIRE_SKIP_VLLM=1 into an empty KVWIRE_PY_CACHE: a new plain
#      venv, pytest, the kvwire wheel; then the engine tests in that venv
#   3. tests/python/install_mooncake.sh into a new venv: the probe must take the "absent" path,
#      install the pin and import it; a second run must take the "present" path
#   4. tests/python/install_plugins.sh into that venv (the test-only vLLM platform plugin)
#   5. the SoftRoCE guest (kernel package download, modules, initramfs) into an empty
#      KVWIRE_VM_CACHE: tests/vm/run.sh --setup-only
#
# What it does not redo: apt packages (probed with `command -v`/file tests that cannot give a
# false "present") and the two vLLM venvs (~9 GB each; their install function is the same code
# path with a version argument, and the fresh-machine run in the README exercised it).
# Env: KVWIRE_INSTALL_CHECK_KEEP=1 keeps the scratch directory.
cd "$(dirname "$0")/.."
ROOT=$(pwd)
. tests/lib/install.sh
install_init install-check "bash tests/install_check.sh"
SCRATCH=$(mktemp -d "${TMPDIR:-/tmp}/kvwire-install-check.XXXXXX")
[ "${KVWIRE_INSTALL_CHECK_KEEP:-0}" = 1 ] || trap 'rm -rf "$SCRATCH"' EXIT
T0=$SECONDS
step() { echo "== install check: $* ($((SECONDS - T0)) s)"; }

step "1. bash -n on every script"
n=0
while IFS= read -r f; do
  bash -n "$f" || die "syntax error in $f"
  n=$((n + 1))
done < <(find tests .ci -type f \( -name '*.sh' -o -path '.ci/run' \) | sort)
echo "$n scripts parse"

step "2. python setup, KVWIRE_SKIP_VLLM=1, empty cache"
KVWIRE_PY_CACHE=$SCRATCH/py KVWIRE_SKIP_VLLM=1 bash tests/python/setup.sh \
  || die "tests/python/setup.sh from an empty cache (KVWIRE_SKIP_VLLM=1)"
PLAIN=$SCRATCH/py/plain/bin/python
[ "$(cat "$SCRATCH/py/venvs.txt")" = "$PLAIN" ] || die "setup.sh did not list $PLAIN in venvs.txt"
(cd tests/python && "$PLAIN" -m pytest -q -p no:cacheprovider test_engine.py) \
  || die "the engine tests in the fresh plain venv"

step "3. Mooncake into a new venv (absent, then present)"
python3 -m venv "$SCRATCH/mc" || die "python3 -m venv"
bash tests/python/install_mooncake.sh "$SCRATCH/mc" 2>&1 | tee "$SCRATCH/mc1.log"
grep -q "pip install" "$SCRATCH/mc1.log" || die "install_mooncake.sh on a new venv did not install (its probe claims Mooncake is there)"
bash tests/python/install_mooncake.sh "$SCRATCH/mc" 2>&1 | tee "$SCRATCH/mc2.log"
grep -q "present" "$SCRATCH/mc2.log" || die "install_mooncake.sh did not see the Mooncake it just installed"

step "4. the test-only vLLM platform plugin into that venv"
bash tests/python/install_plugins.sh "$SCRATCH/mc" 2>&1 | tee "$SCRATCH/pl1.log"
grep -q "pip install" "$SCRATCH/pl1.log" || die "install_plugins.sh on a new venv did not install (its probe claims the plugin is there)"

step "5. SoftRoCE guest into an empty cache"
KVWIRE_VM_CACHE=$SCRATCH/vm bash tests/vm/run.sh --setup-only \
  || die "tests/vm/run.sh --setup-only into an empty KVWIRE_VM_CACHE"

step "done"
