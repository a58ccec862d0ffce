#!/bin/bash
# tests/vm/guest_suite.sh — runs several test binaries inside ONE boot of the SoftRoCE guest.
#
#   tests/vm/run.sh tests/vm/guest_suite.sh <label>=<test binary>::<test name> ...
#
# Each entry runs `<binary> <test name> --exact --nocapture --test-threads=1` (the binary sees
# KVWIRE_VM_GUEST=1 and runs its test body directly), one after the other, each with its own
# time limit (KVWIRE_VM_TEST_TIMEOUT seconds, default 900). An entry passes when it exits 0
# AND libtest reports exactly one test passed (a misspelt name would otherwise "pass" 0 tests).
# Prints one line per entry, `KVWIRE-VM-SUITE <label> PASS|FAIL (...)`, then a summary;
# exit status 0 only when every entry passed, else 1.
set -u
[ $# -ge 1 ] || { echo "usage: $0 <label>=<binary>::<test> ..." >&2; exit 2; }
[ "${KVWIRE_VM_GUEST:-0}" = 1 ] || echo "warning: not inside the kvwire VM (KVWIRE_VM_GUEST unset)" >&2
LIMIT=${KVWIRE_VM_TEST_TIMEOUT:-900}
failed=()
results=()
for entry in "$@"; do
  label=${entry%%=*}
  rest=${entry#*=}
  bin=${rest%%::*}
  name=${rest#*::}
  if [ -z "$label" ] || [ -z "$bin" ] || [ -z "$name" ] || [ "$bin" = "$rest" ]; then
    echo "KVWIRE-VM-SUITE $entry FAIL (malformed entry)"
    failed+=("$entry"); continue
  fi
  log=/tmp/kvwire-suite.$label.log
  echo "== [$label] $bin $name"
  t0=$(date +%s.%N)
  timeout "$LIMIT" "$bin" "$name" --exact --nocapture --test-threads=1 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  secs=$(awk "BEGIN{printf \"%.1f\", $(date +%s.%N) - $t0}")
  if [ "$rc" = 0 ] && grep -q "test result: ok. 1 passed" "$log"; then
    results+=("KVWIRE-VM-SUITE $label PASS (${secs} s)")
  else
    why="exit $rc"
    [ "$rc" = 124 ] && why="timed out after ${LIMIT} s"
    [ "$rc" = 0 ] && why="exit 0 but not exactly one test passed"
    results+=("KVWIRE-VM-SUITE $label FAIL ($why, ${secs} s)")
    failed+=("$label")
    echo "== [$label] rxe counters after the failure"
    rdma statistic show 2>/dev/null | head -n 20
  fi
done
echo "== suite summary"
printf '%s\n' "${results[@]}"
if [ ${#failed[@]} -gt 0 ]; then
  echo "KVWIRE-VM-SUITE FAILED: ${failed[*]}"
  exit 1
fi
echo "KVWIRE-VM-SUITE ALL PASSED (${#results[@]})"
exit 0
