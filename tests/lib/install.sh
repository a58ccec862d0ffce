# Sourced by the install scripts (tests/python/setup.sh, tests/vm/run.sh, tests/gpu/build.sh,
# tests/peers/compare.sh, tests/install_check.sh). Bash only.
#
#   install_init NAME "RETRY COMMAND"   strict mode (errexit, nounset, pipefail, errtrace) and an
#                                       ERR trap: a failing command prints what failed, where,
#                                       and how to retry, instead of ending the script silently
#   log MESSAGE...                      one timestamped line on stderr
#   die MESSAGE...                      log it as a failure (with the retry hint) and exit 1
#   dist_version PYTHON DIST            the installed version of a Python distribution, or
#                                       nothing; never fails (a probe for something absent is
#                                       an answer, not an error)
#   have_file PATH                      true when PATH exists (a probe; never trips errexit)
#
# Every "is it there?" probe in an install script goes through a function that cannot fail
# (dist_version, have_file, command -v in an `if`): under `set -e` and `pipefail`, a probe
# whose pipeline exits non-zero ends the script, which is how a missing package used to stop
# the python stage with no message.

install_init() {
  INSTALL_NAME=$1
  INSTALL_RETRY=$2
  set -Eeuo pipefail
  trap 'install_failed $? "$BASH_COMMAND" "${BASH_SOURCE[0]##*/}:$LINENO"' ERR
}

install_failed() {
  local rc=$1 cmd=$2 where=$3
  trap - ERR
  echo "[$INSTALL_NAME] FAILED (exit $rc) at $where: $cmd" >&2
  echo "[$INSTALL_NAME] retry with: $INSTALL_RETRY" >&2
  exit "$rc"
}

log() { echo "[${INSTALL_NAME:-install} $(date +%T)] $*" >&2; }

die() {
  trap - ERR
  echo "[${INSTALL_NAME:-install}] FAILED: $*" >&2
  echo "[${INSTALL_NAME:-install}] retry with: ${INSTALL_RETRY:-the same command}" >&2
  exit 1
}

dist_version() {
  "$1" - "$2" 2>/dev/null <<'PY' || true
import importlib.metadata as m, sys
try:
    print(m.version(sys.argv[1]))
except m.PackageNotFoundError:
    pass
PY
}

have_file() { [ -e "$1" ]; }
