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
#      whole region and compares with the expected image. Then
#      transfer/tests/cuda_ipc.rs: the cuda_ipc transport between two processes (device
#      regions written and read with the copy engines, mixed with host regions, out-of-bounds
#      and tcp-into-device refused; every byte checked by both processes), with its GB/s next
#      to device-to-device copies within one process (lines `FIGURE`); and the driver's dma-buf
#      export of device memory (the first half of GPUDirect RDMA by dma-buf; no NIC needed).
#   2. kvwire-bench layerwise: whole vs layerwise exposed tail, host and device memory, tcp and
#      shm, every round verified byte for byte.
#   3. tests/gpu/test_staging_cuda.py (the kvwire wheel from PREBUILT, torch from the machine):
#      the connector's staging with CUDA KV caches: P's gather copy ordered after the layer's
#      kernels (sent without a synchronize), D's landing copy reported only once complete, D's
#      landing pool copied into the CUDA cache layer by layer after the compute stream's work; and
#      the CUDA tests of tests/python/test_engine_layer.py (a CUDA tensor as a layer-stream
#      source from Python, every byte checked); tests/gpu/test_cuda_ipc.py: the cuda_ipc
#      transport from Python (CUDA tensors of two processes registered as device regions,
#      written, read back and checked at both ends); tests/gpu/test_mooncake_cuda.py: the
#      Mooncake drop-in registering CUDA tensors and moving them between two processes.
#   4. kvwire-bench cuda-ipc: copies into a second process's device memory over CUDA IPC next
#      to device-to-device copies within one process, same bytes and GPU, 64 KiB to 1 GiB
#      chunks, both destinations checksummed against the source.
#
# Every step runs even when one before it failed; summary.json in OUTDIR says which passed, and
# the script fails when any did.
#
# Usage: tests/gpu/run.sh [OUTDIR]            (builds with cargo, release)
#        PREBUILT=DIR tests/gpu/run.sh [OUTDIR] (uses DIR/layer_stream, DIR/cuda_ipc and DIR/kvwire-bench,
#                                               e.g. built elsewhere by tests/gpu/build.sh)
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-${OUT:-/tmp/kvwire-gpu}}
mkdir -p "$OUT"
export KVWIRE_REQUIRE_GPU=1

echo "== GPU"
GPU=$(nvidia-smi -L 2>&1 | head -n 1 || echo "nvidia-smi not available")
echo "$GPU"

if [[ -n "${PREBUILT:-}" ]]; then
  TEST_BIN="$PREBUILT/layer_stream"
  IPC_BIN="$PREBUILT/cuda_ipc"
  BENCH_BIN="$PREBUILT/kvwire-bench"
else
  export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$(pwd)/target-gpu}
  cargo build --release -p kvwire-bench
  TEST_BIN=$(cargo test --release -p kvwire-transfer --test layer_stream --no-run --message-format=json 2>/dev/null \
    | sed -n 's/.*"executable":"\([^"]*layer_stream[^"]*\)".*/\1/p' | tail -n 1)
  IPC_BIN=$(cargo test --release -p kvwire-transfer --test cuda_ipc --no-run --message-format=json 2>/dev/null \
    | sed -n 's/.*"executable":"\([^"]*cuda_ipc-[^"]*\)".*/\1/p' | tail -n 1)
  BENCH_BIN="$CARGO_TARGET_DIR/release/kvwire-bench"
fi

declare -A RC
step() { # step NAME CMD...: runs CMD, its output into $OUT/NAME.txt, its exit status kept
  local name=$1
  shift
  echo "== $name"
  set +e
  "$@" 2>&1 | tee "$OUT/$name.txt"
  RC[$name]=${PIPESTATUS[0]}
  set -e
}

both() { # the layer stream from device memory, the cuda_ipc transport, the dma-buf export; fails if any did
  "$TEST_BIN" --exact cuda_device_kv_streams_layers --nocapture --test-threads=1
  local a=$?
  "$IPC_BIN" --exact cuda_ipc_moves_device_bytes_between_processes --nocapture --test-threads=1
  local b=$?
  "$IPC_BIN" --exact device_memory_exports_as_a_dmabuf --nocapture --test-threads=1
  local c=$?
  return $((a | b | c))
}
step gpu-test both
step layer-tests "$TEST_BIN" --test-threads=4
step layerwise "$BENCH_BIN" layerwise --json "$OUT/layerwise.json" --layers 32 --layer-bytes 4194304 --rounds 7
if [[ ${RC[layerwise]} == 0 ]] && ! grep -q "memory = cuda\|cuda/layerwise" "$OUT/layerwise.txt"; then
  echo "FAIL: no device-memory rows in the layerwise output"
  RC[layerwise]=1
fi
WHEEL=$(ls "${PREBUILT:-$CARGO_TARGET_DIR}"/kvwire-*.whl 2>/dev/null | head -n 1 || true)
if [[ -z "$WHEEL" && -z "${PREBUILT:-}" ]]; then
  (cd ffi && python3 -m maturin build --release -q -o "$CARGO_TARGET_DIR") || true
  WHEEL=$(ls "$CARGO_TARGET_DIR"/kvwire-*.whl 2>/dev/null | head -n 1 || true)
fi
if [[ -n "$WHEEL" ]]; then
  SITE=$(mktemp -d)
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$WHEEL"
  step staging-cuda env PYTHONPATH="$SITE" KVWIRE_REQUIRE_CUDA=1 python3 -m pytest -q -p no:cacheprovider -rs \
    tests/gpu/test_staging_cuda.py tests/gpu/test_cuda_ipc.py tests/gpu/test_mooncake_cuda.py \
    tests/python/test_engine_layer.py \
    -k "cuda or staging or pinned"
else
  echo "FAIL: no kvwire wheel (tests/gpu/build.sh makes one)" | tee "$OUT/staging-cuda.txt"
  RC[staging-cuda]=1
fi
step cuda-ipc "$BENCH_BIN" cuda-ipc --json "$OUT/cuda_ipc.json"

fail=0
{
  echo "{"
  printf '  "gpu": "%s"' "${GPU//\"/}"
  for k in gpu-test layer-tests layerwise staging-cuda cuda-ipc; do
    echo ","
    printf '  "%s": %s' "$k" "${RC[$k]}"
    [[ ${RC[$k]} == 0 ]] || fail=1
  done
  echo
  echo "}"
} >"$OUT/summary.json"
echo "== exit status per step (0: passed):"
cat "$OUT/summary.json"
echo "== results in $OUT"
exit $fail
