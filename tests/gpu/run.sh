#!/usr/bin/env bash
# GPU check for layer streams from CUDA memory (issue: layerwise pipelined writes).
#
# Needs an NVIDIA driver (libcuda.so.1) and one GPU; no CUDA toolkit, no PyTorch (device memory
# is allocated with cudarc, loaded at run time).
#
#   1. transfer/tests/layer_stream.rs::cuda_device_kv_streams_layers, with KVWIRE_REQUIRE_GPU=1
#      (fails instead of skipping when no device is found): vLLM-shaped KV tensors, one
#      [2, num_blocks, 16, 4, 128] fp16 tensor per layer, on device 0; each layer "computed" by
#      an async upload on a compute stream and announced with a CUDA event recorded after it;
#      staged through pinned host buffers (cuStreamWaitEvent + cuMemcpyDtoHAsync on a side
#      stream) and streamed to a second process over tcp and over shm; the target hashes its
#      whole region and compares with the expected image.
#   2. kvwire-bench layerwise: whole vs layerwise exposed tail, host and device memory, tcp and
#      shm, every round verified byte for byte.
#
# Usage: tests/gpu/run.sh [OUTDIR]            (builds with cargo, release)
#        PREBUILT=DIR tests/gpu/run.sh [OUTDIR] (uses DIR/layer_stream and DIR/kvwire-bench,
#                                               e.g. built elsewhere by tests/gpu/build.sh)
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-${OUT:-/tmp/kvwire-gpu}}
mkdir -p "$OUT"
export KVWIRE_REQUIRE_GPU=1

echo "== GPU"
(nvidia-smi -L || echo "nvidia-smi not available") 2>&1 | tee "$OUT/nvidia-smi.txt"

if [[ -n "${PREBUILT:-}" ]]; then
  TEST_BIN="$PREBUILT/layer_stream"
  BENCH_BIN="$PREBUILT/kvwire-bench"
else
  export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target-gpu}
  cargo build --release -p kvwire-bench
  TEST_BIN=$(cargo test --release -p kvwire-transfer --test layer_stream --no-run --message-format=json 2>/dev/null \
    | sed -n 's/.*"executable":"\([^"]*layer_stream[^"]*\)".*/\1/p' | tail -n 1)
  BENCH_BIN="$CARGO_TARGET_DIR/release/kvwire-bench"
fi

echo "== 1. device KV -> second process, tcp and shm, bytes verified"
"$TEST_BIN" --exact cuda_device_kv_streams_layers --nocapture --test-threads=1 2>&1 | tee "$OUT/gpu-test.txt"

echo "== 1b. the CPU layer-stream tests on this machine too"
"$TEST_BIN" --test-threads=4 2>&1 | tee "$OUT/layer-tests.txt"

echo "== 2. layerwise bench (host and device memory)"
"$BENCH_BIN" layerwise --json "$OUT/layerwise.json" --layers 32 --layer-bytes 4194304 --rounds 7 2>&1 | tee "$OUT/layerwise.txt"
grep -q "memory = cuda\|cuda/layerwise" "$OUT/layerwise.txt" || { echo "FAIL: no device-memory rows in the bench output"; exit 1; }
echo "== done: results in $OUT"
