#!/usr/bin/env bash
# Builds the GPU check's three binaries (release, stripped) and the kvwire wheel on a machine with
# crates.io access and puts them in DIR, for tests/gpu/run.sh on a GPU machine without network:
# PREBUILT=DIR run.sh.
cd "$(dirname "$0")/../.."
. tests/lib/install.sh
DIR=${1:?usage: tests/gpu/build.sh DIR}
install_init gpu-build "bash tests/gpu/build.sh $DIR"
mkdir -p "$DIR"
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$(pwd)/target-gpu}
cargo build --release -p kvwire-bench || die "cargo build --release -p kvwire-bench"
json=$(cargo test --release -p kvwire-transfer --test layer_stream --no-run --message-format=json) \
  || die "cargo test --release -p kvwire-transfer --test layer_stream --no-run"
TEST_BIN=$(printf '%s\n' "$json" | sed -n 's/.*"executable":"\([^"]*layer_stream[^"]*\)".*/\1/p' | tail -n 1 || true)
[ -n "$TEST_BIN" ] && [ -x "$TEST_BIN" ] || die "no layer_stream test binary in cargo's output"
cp "$TEST_BIN" "$DIR/layer_stream"
json=$(cargo test --release -p kvwire-transfer --test cuda_ipc --no-run --message-format=json) \
  || die "cargo test --release -p kvwire-transfer --test cuda_ipc --no-run"
IPC_BIN=$(printf '%s\n' "$json" | sed -n 's/.*"executable":"\([^"]*cuda_ipc-[^"]*\)".*/\1/p' | tail -n 1 || true)
[ -n "$IPC_BIN" ] && [ -x "$IPC_BIN" ] || die "no cuda_ipc test binary in cargo's output"
cp "$IPC_BIN" "$DIR/cuda_ipc"
cp "$CARGO_TARGET_DIR/release/kvwire-bench" "$DIR/kvwire-bench"
strip "$DIR/layer_stream" "$DIR/cuda_ipc" "$DIR/kvwire-bench" 2>/dev/null || echo "strip not found: binaries left with symbols"
PY=${PYTHON:-python3}
rm -f "$DIR"/kvwire-*.whl
"$PY" -m maturin --version >/dev/null 2>&1 || "$PY" -m pip install -q "maturin>=1.9.4,<2" || die "pip install maturin"
(cd ffi && "$PY" -m maturin build --release -q -o "$DIR") || die "maturin build of the kvwire wheel"
ls -l "$DIR"
