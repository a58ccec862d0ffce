#!/usr/bin/env bash
# Builds the GPU check's two binaries (release) on a machine with crates.io access and copies
# them to DIR, for tests/gpu/run.sh on a GPU machine without network: PREBUILT=DIR run.sh.
set -euo pipefail
cd "$(dirname "$0")/../.."
DIR=${1:?usage: tests/gpu/build.sh DIR}
mkdir -p "$DIR"
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target-gpu}
cargo build --release -p kvwire-bench
TEST_BIN=$(cargo test --release -p kvwire-transfer --test layer_stream --no-run --message-format=json 2>/dev/null \
  | sed -n 's/.*"executable":"\([^"]*layer_stream[^"]*\)".*/\1/p' | tail -n 1)
cp "$TEST_BIN" "$DIR/layer_stream"
cp "$CARGO_TARGET_DIR/release/kvwire-bench" "$DIR/kvwire-bench"
ls -l "$DIR"
