#!/usr/bin/env bash
# CI stage "vm": the RDMA suites on real verbs (rdma_rxe) inside a qemu TCG guest.
# tests/vm/run.sh installs qemu, fetches and caches the Debian kernel; each test binary below boots
# the guest and runs itself inside it (the verbs self-test, then two engines forced to rdma).
# Must not skip here: KVWIRE_REQUIRE_VM=1.
set -euo pipefail
cd "$(dirname "$0")/../.."
export KVWIRE_VM_TESTS=1 KVWIRE_REQUIRE_VM=1
exec cargo test -j"${KVWIRE_JOBS:-2}" -p kvwire-transfer --test rdma_vm --test rdma_engine_vm -- --nocapture
