#!/usr/bin/env bash
# GPU end-to-end check: kvwire inside real vLLM servers, prefill on P, decode on D, one GPU.
#
# Needs an NVIDIA GPU (about 2 x 30 % of its memory by default), a Python with vLLM (0.18.1 or
# 0.33.0) and the kvwire wheel installed (tests/python/setup.sh makes both: pass one of its venv
# pythons as PYTHON). Nothing is downloaded: the model is a tiny Llama config.json written here
# (4 layers, hidden 256, 2 KV heads, vocab 1000) with a word-level tokenizer, its weights random
# through `--load-format dummy` (fixed seed, so every instance has the same weights).
#
#   1. one vLLM instance, no KV connector: greedy completions (token ids) of N prompts;
#   2. P (kv_producer) and D (kv_consumer) instances on the same GPU with the connector under
#      test; each prompt goes to D and to P (max_tokens 1) with one transfer_id, directly from
#      the helper (it is the proxy); D's token ids must equal step 1's for every prompt, and D's
#      /metrics (vllm:prompt_tokens_by_source_total) must show the prompt tokens arriving as
#      external_kv_transfer with at most one token per request computed locally (vLLM recomputes
#      the last one), while P computed them.
#
# Connectors (CONNECTOR=...):
#   kvwire   (default) KvwireConnector via kv_connector_module_path "kvwire.vllm"
#            (P send_mode layerwise, D policy lazy; ROLES=both runs both as kv_both). The KV
#            caches are on the GPU: both workers stage them through pinned host memory
#            (kvwire.vllm.staging; STAGING=auto|always|never|device, the last with no host
#            memory: the caches registered as device regions, P to D by cuda_ipc; STAGING_MB = P's pool in MiB, e.g.
#            0.0625 so that the longer prompts' layers are split and queued). Every instance gets
#            --num-gpu-blocks-override KV_BLOCKS (2048), as D mirrors its whole KV cache in pinned
#            host memory;
#   mooncake vLLM's own MooncakeConnector with mooncake.engine resolved to kvwire.mooncake
#            through the shim package (python -m kvwire.mooncake shim DIR; PYTHONPATH=DIR).
#
# Exit status: 0 only when the check ran and passed; 1 when it ran and failed; 77 with
# "SKIPPED: no GPU" on stderr when there is no usable GPU (never 0 then).
#
# Usage: PYTHON=~/.cache/kvwire-py/vllm-0.18.1/bin/python tests/gpu/e2e_vllm.sh [OUTDIR]
# Env:   PYTHON, CONNECTOR (kvwire|mooncake), ROLES (pd|both), PROMPTS (4), MAX_TOKENS (16),
#        GPU_MEM (0.3, --gpu-memory-utilization of each instance), READY_TIMEOUT (900 s),
#        STAGING (auto), STAGING_MB (256), KV_BLOCKS (2048).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-${OUT:-/tmp/kvwire-gpu-e2e}}
PY=${PYTHON:-python3}
mkdir -p "$OUT"

echo "== GPU"
if ! nvidia-smi -L 2>&1 | tee "$OUT/nvidia-smi.txt" | grep -q "^GPU "; then
  echo "SKIPPED: no GPU (nvidia-smi lists none); the vLLM end-to-end check did not run" >&2
  exit 77
fi
if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "SKIPPED: no GPU usable from $PY (torch.cuda.is_available() is False); the check did not run" >&2
  exit 77
fi

echo "== versions"
"$PY" -c 'import importlib.metadata as m
for p in ("vllm", "torch", "kvwire"):
    print(p, m.version(p))' | tee "$OUT/versions.txt"

SHIM=""
if [[ "${CONNECTOR:-kvwire}" == mooncake ]]; then
  SHIM="$OUT/shim"
  "$PY" -m kvwire.mooncake shim "$SHIM"
fi

echo "== single instance vs P/D (${CONNECTOR:-kvwire}, ${ROLES:-pd}); logs in $OUT"
rc=0
"$PY" tests/gpu/e2e_vllm.py --out "$OUT" --connector "${CONNECTOR:-kvwire}" --roles "${ROLES:-pd}" \
  --prompts "${PROMPTS:-4}" --max-tokens "${MAX_TOKENS:-16}" --mem "${GPU_MEM:-0.3}" \
  --ready-timeout "${READY_TIMEOUT:-900}" --shim-dir "$SHIM" --staging "${STAGING:-auto}" \
  --staging-mb "${STAGING_MB:-256}" --kv-blocks "${KV_BLOCKS:-2048}" 2>&1 | tee "$OUT/e2e.txt" || rc=$?
if [[ $rc -ne 0 ]] || ! grep -q "PASS$" "$OUT/e2e.txt"; then
  echo "FAIL: see $OUT/e2e.txt and $OUT/{single,prefill,decode}.log"
  for f in prefill decode; do
    [[ -f "$OUT/$f.log" ]] && { echo "--- tail $f.log"; tail -n 30 "$OUT/$f.log"; }
  done
  exit 1
fi
echo "== done: PASS, results in $OUT/result.json"
