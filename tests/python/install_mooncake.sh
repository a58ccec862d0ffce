#!/usr/bin/env bash
# Installs Mooncake's CPU transfer engine (pinned) into one venv, idempotently:
#   bash tests/python/install_mooncake.sh VENV_DIR
# Probes the installed version (a probe that cannot fail: tests/lib/install.sh), installs the
# pin when it differs or is absent, then checks that `mooncake.engine` imports. Called by
# tests/python/setup.sh for every vLLM venv, and by tests/install_check.sh on a fresh venv on
# every CI run (so the "absent" path runs even when the big venvs already hold Mooncake).
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
"$PYV" -c "from mooncake.engine import TransferEngine" 2>/dev/null \
  || die "$(basename "$VENV"): mooncake.engine does not import after installing $PIN"
