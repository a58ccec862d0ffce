#!/usr/bin/env bash
# Installs the test-only vLLM platform plugin (tests/e2e/plugin) into one venv, idempotently:
#   bash tests/python/install_plugins.sh VENV_DIR
# It selects kvwire.testing.platform.StandInCpuPlatform when KVWIRE_TEST_CPU_PLATFORM=1 (the
# end-to-end servers of tests/e2e) and is inert otherwise. Never part of the kvwire wheel.
cd "$(dirname "$0")/../.."
. tests/lib/install.sh
VENV=${1:?usage: install_plugins.sh VENV_DIR}
install_init plugins "bash tests/python/install_plugins.sh $VENV"
PYV=$VENV/bin/python
[ -x "$PYV" ] || die "$PYV is not an executable Python (make the venv first)"
want=$(sed -n 's/^version = "\(.*\)"/\1/p' tests/e2e/plugin/pyproject.toml)
have=$(dist_version "$PYV" kvwire-test-platform)
sum=$(cat tests/e2e/plugin/* | sha256sum | cut -c1-16)
mark=$VENV/.kvwire-test-platform
if [ "$have" = "$want" ] && [ "$(cat "$mark" 2>/dev/null || true)" = "$sum" ]; then
  log "$(basename "$VENV"): kvwire-test-platform $have present"
else
  log "$(basename "$VENV"): pip install tests/e2e/plugin (installed: ${have:-none})"
  rm -rf "$VENV/.plugin-build"; cp -r tests/e2e/plugin "$VENV/.plugin-build"
  "$PYV" -m pip install -q --no-deps "$VENV/.plugin-build" || die "pip install tests/e2e/plugin into $VENV"
  rm -rf "$VENV/.plugin-build"
  echo "$sum" > "$mark"
fi
KVWIRE_TEST_CPU_PLATFORM=1 "$PYV" -c "
import importlib.metadata as m
eps = [e for e in m.entry_points(group='vllm.platform_plugins') if e.name == 'kvwire_test_cpu']
assert eps, 'entry point missing'
assert eps[0].load()() == 'kvwire.testing.platform.StandInCpuPlatform'
" || die "the kvwire_test_cpu platform plugin is not registered in $VENV"
