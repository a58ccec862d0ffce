#!/usr/bin/env bash
# Builds the GPU check's two binaries (release) on a machine with crates.io access and copies
# them to DIR, for tests/gpu/run.sh on a GPU machine without network: PREBUILT=DIR run.sh.
cd "$(dirname "$0")/../.."
. tests/lib/install.sh
DIR=${1:?usage: tests/gpu/build.sh DIR}
install_init gpu-build "bash tests/gpu/build.sh $DIR"
mkdir -p "$DIR"
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target-gpu}
cargo build --release -p kvwire-bench || die "cargo build --release -p kvwire-bench"
json=$(cargo test --release -p kvwire-transfer --test layer_stream --no-run --message-format=json) \
  || die "cargo test --release -p kvwire-transfer --test layer_stream --no-run"
TEST_BIN=$(printf '%s\n' "$json" | sed -n 's/.*"executable":"\([^"]*layer_stream[^"]*\)".*/\1/p' | tail -n 1 || true)
[ -n "$TEST_BIN" ] && [ -x "$TEST_BIN" ] || die "no layer_stream test binary in cargo's output"
cp "$TEST_BIN" "$DIR/layer_stream"
cp "$CARGO_TARGET_DIR/release/kvwire-bench" "$DIR/kvwire-bench"
ls -l "$DIR"
