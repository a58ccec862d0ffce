#!/usr/bin/env bash
# Installs Mooncake's CPU transfer engine (pinned) into one venv, idempotently:
#   bash tests/python/install_mooncake.sh VENV_DIR
# Probes the installed version (a probe that cannot fail: tests/lib/install.sh), installs the
# pin when it differs or is absent, then checks that `mooncake.engine` imports. Called by
# tests/python/setup.sh for every vLLM venv, and by tests/install_check.sh on a fresh venv on
# every CI run (so the "absent" path runs even when the big venvs already hold Mooncake).
# The wheel's libraries link against the system's libibverbs.so.1 even without RDMA hardware:
# it is installed with apt (libibverbs1) when absent. Before, only the VM stage installed it, so
# this script failed on a fresh machine whenever the python stage ran without the VM stage.
# Env: KVWIRE_MOONCAKE_PIN (default mooncake-transfer-engine-non-cuda==0.3.13.post1).
cd "$(dirname "$0")/../.."
. tests/lib/install.sh
VENV=${1:?usage: install_mooncake.sh VENV_DIR}
install_init mooncake "bash tests/python/install_mooncake.sh $VENV"
PIN=${KVWIRE_MOONCAKE_PIN:-mooncake-transfer-engine-non-cuda==0.3.13.post1}
DIST=${PIN%%==*}
PYV=$VENV/bin/python
[ -x "$PYV" ] || die "$PYV is not an executable Python (make the venv first)"
have=$(dist_version "$PYV" "$DIST")
if [ "$DIST==$have" = "$PIN" ]; then
  log "$(basename "$VENV"): $PIN present"
else
  log "$(basename "$VENV"): pip install $PIN (installed: ${have:-none})"
  "$PYV" -m pip install -q "$PIN" || die "pip install $PIN into $VENV"
fi
if ! ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1 '; then
  [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null \
    || die "libibverbs.so.1 is missing (mooncake.engine links it): apt-get install libibverbs1 as root"
  log "apt-get install libibverbs1 (mooncake.engine links libibverbs.so.1)"
  { DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 install -y -qq --no-install-recommends libibverbs1 \
      || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 install -y -qq \
             --no-install-recommends libibverbs1; }; } >&2 || die "apt-get install libibverbs1"
fi
"$PYV" -c "from mooncake.engine import TransferEngine" 2>/dev/null \
  || die "$(basename "$VENV"): mooncake.engine does not import after installing $PIN"
