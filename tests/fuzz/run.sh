#!/usr/bin/env bash
# The fuzz stage: every cargo-fuzz target of transfer/fuzz (the decoders of every control
# message, frame header, error payload and second-stage payload, both sides of the handshake
# and the lane join before authentication, the metrics request parser) for FUZZ_SECS seconds
# each (default 5), from seeds of valid encodings plus the corpus kept in FUZZ_CORPUS.
#
#   bash tests/fuzz/run.sh                 # a few seconds per target (CI)
#   FUZZ_SECS=450 bash tests/fuzz/run.sh   # longer
#
# Needs a nightly toolchain and cargo-fuzz (installed with `cargo install cargo-fuzz` when
# missing); prints "SKIPPED: ..." and succeeds when neither can be had. Fails on any crash
# (the input is left under $FUZZ_CORPUS/../artifacts). Env: CARGO_TARGET_DIR (fuzz builds go
# to $CARGO_TARGET_DIR/fuzz), FUZZ_SECS, FUZZ_CORPUS (default: a temporary directory),
# FUZZ_TARGETS (a subset).
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$(pwd)
SECS=${FUZZ_SECS:-5}
BASE_TARGET=${CARGO_TARGET_DIR:-$ROOT/target}
if ! rustup toolchain list 2>/dev/null | grep -q '^nightly'; then
  if ! rustup toolchain install nightly --profile minimal >/dev/null 2>&1; then
    echo "SKIPPED: no nightly toolchain (cargo fuzz needs one)"; exit 0
  fi
fi
if ! command -v cargo-fuzz >/dev/null 2>&1; then
  echo "installing cargo-fuzz"
  if ! cargo install cargo-fuzz --locked >/dev/null 2>&1; then
    echo "SKIPPED: cargo-fuzz cannot be installed here"; exit 0
  fi
fi
WORK=${FUZZ_CORPUS:-$(mktemp -d /tmp/kvwire-fuzz.XXXXXX)}
mkdir -p "$WORK"
echo "fuzz: $SECS s per target, corpus and artifacts under $WORK"
CARGO_TARGET_DIR=$BASE_TARGET cargo run -q --example fuzz_seeds -p kvwire-transfer -- "$WORK/seeds" \
  || { echo "writing the seeds failed"; exit 1; }
export CARGO_TARGET_DIR=$BASE_TARGET/fuzz
cd "$ROOT/transfer"
TARGETS=${FUZZ_TARGETS:-$(cargo +nightly fuzz list)}
cargo +nightly fuzz build || { echo "building the fuzz targets failed"; exit 1; }
failed=()
for t in $TARGETS; do
  corpus=$WORK/corpus/$t
  mkdir -p "$corpus" "$WORK/artifacts/$t"
  [ -d "$WORK/seeds/$t" ] && cp -n "$WORK/seeds/$t"/* "$corpus"/ 2>/dev/null
  echo "== $t"
  if ! cargo +nightly fuzz run "$t" "$corpus" -- -max_total_time="$SECS" -rss_limit_mb=2048 \
       -max_len=65536 -artifact_prefix="$WORK/artifacts/$t/" -print_final_stats=1 2>"$WORK/$t.log"; then
    failed+=("$t")
    tail -40 "$WORK/$t.log"
  fi
  grep -E '^stat::number_of_executed_units|^Done' "$WORK/$t.log" | tr '\n' ' '; echo
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "FUZZ FAILED: ${failed[*]} (crashing inputs under $WORK/artifacts)"
  exit 1
fi
echo "fuzz: every target ran $SECS s without a crash"
