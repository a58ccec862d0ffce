#!/usr/bin/env bash
# CI stage "vm": the RDMA suites on real verbs (rdma_rxe) inside a qemu TCG guest, in ONE boot.
# Builds the test binaries on the host, then tests/vm/run.sh boots the guest once and
# tests/vm/guest_suite.sh runs every binary's test inside it (the verbs self-test, two engines
# forced to rdma on one and on both devices, device regions over rdma with host memory standing
# in for the GPU's), reporting each exit status. This stage
# fails when any of them fails, and says which. Must not skip here: KVWIRE_REQUIRE_VM=1.
#
# (Each test can also boot its own VM: KVWIRE_VM_TESTS=1 cargo test --test rdma_engine_vm.)
set -euo pipefail
cd "$(dirname "$0")/../.."
export KVWIRE_REQUIRE_VM=1
# <label> <cargo test target: an integration test, or "lib" for the crate's unit tests> <test name>
SUITE=(
  "selftest rdma_vm selftest_in_softroce_vm"
  "engine rdma_engine_vm engine_rdma_in_softroce_vm"
  "gpudirect lib mem::nic::vm_tests::device_regions_over_rdma_in_softroce_vm"
)
targets=()
for s in "${SUITE[@]}"; do
  set -- $s
  if [ "$2" = lib ]; then targets+=(--lib); else targets+=(--test "$2"); fi
done
json=$(cargo test -j"${KVWIRE_JOBS:-2}" -p kvwire-transfer "${targets[@]}" --no-run --message-format=json)
entries=()
for s in "${SUITE[@]}"; do
  set -- $s
  exe=$(printf '%s\n' "$json" | python3 -c '
import json, sys
want = sys.argv[1]
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    t = m.get("target") or {}
    if want == "lib":  # the unit-test binary of the library
        hit = "lib" in t.get("kind", []) and (m.get("profile") or {}).get("test")
    else:
        hit = t.get("name") == want and "test" in t.get("kind", [])
    if m.get("reason") == "compiler-artifact" and hit and m.get("executable"):
        print(m["executable"])
' "$2" | tail -n 1)
  [ -n "$exe" ] || { echo "vm stage: no test binary for $2" >&2; exit 1; }
  entries+=("$1=$exe::$3")
done
out=$(mktemp "${TMPDIR:-/tmp}/kvwire-vm-ci.XXXXXX")
trap 'rm -f "$out"' EXIT
set +e
tests/vm/run.sh tests/vm/guest_suite.sh "${entries[@]}" 2>&1 | tee "$out"
rc=${PIPESTATUS[0]}
set -e
echo "== vm stage: one boot, ${#entries[@]} test binaries"
grep -a '^KVWIRE-VM-SUITE ' "$out" || echo "(no per-binary results: the VM itself failed, exit $rc)"
if [ "$rc" != 0 ]; then
  failed=$(grep -a '^KVWIRE-VM-SUITE .* FAIL' "$out" | awk '{print $2}' | tr '\n' ' ')
  echo "vm stage FAILED (exit $rc): ${failed:-the VM did not report results}" >&2
  exit 1
fi
# the guest reported every entry passed: double-check from here
n=$(grep -ac '^KVWIRE-VM-SUITE [a-z0-9_-]* PASS' "$out" || true)
[ "$n" = "${#entries[@]}" ] || { echo "vm stage: $n of ${#entries[@]} passed" >&2; exit 1; }
echo "vm stage passed"
