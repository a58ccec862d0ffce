#!/usr/bin/env bash
# CI stage "vm": the RDMA verbs suite on real verbs (rdma_rxe) inside a qemu TCG guest.
# Boots one VM (tests/vm/run.sh installs qemu, fetches and caches the Debian kernel) and runs the
# freshly built rdma_vm test binary inside it. Must not skip here: KVWIRE_REQUIRE_VM=1.
set -euo pipefail
cd "$(dirname "$0")/../.."
export KVWIRE_VM_TESTS=1 KVWIRE_REQUIRE_VM=1
exec cargo test -j"${KVWIRE_JOBS:-2}" -p kvwire-transfer --test rdma_vm -- --nocapture
