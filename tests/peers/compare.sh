#!/usr/bin/env bash
# kvwire next to the peer engines and the physical ceilings, measured in ONE run on this
# host (loopback / shared memory only), then one side-by-side table with the ratios the
# transfer engine's targets are stated in. A bench, not a test: it is not part of
# tests/run.sh. Takes about 5-8 minutes (most of it the peers' run_all.sh).
#
#   bash tests/peers/compare.sh               # setup (idempotent) + one full run + table
#   bash tests/peers/compare.sh --parse DIR   # only print the table for an earlier run dir
#
# What it does:
#   1. copies ../shared/peers (read-only) to a scratch dir ($KVWIRE_PEERS_DIR, default
#      /tmp/kvwire-peers; an existing copy keeps its .venv and binaries);
#   2. runs its setup.sh (apt: iperf3 libibverbs1 librdmacm1 libnuma1 gcc; a venv with the
#      Mooncake TE and NIXL wheels; gcc builds of the C ceilings);
#   3. builds kvwire-bench (release) and runs the peers' run_all.sh with two more entries,
#      `kvwire_tcp` and `kvwire_shm` (kvwire-bench transfer --json), in the same pass;
#   4. prints the side-by-side table (tests/peers/compare.py) and saves it next to the
#      raw results.
cd "$(dirname "$0")/../.."
ROOT=$(pwd)
HERE=$ROOT/tests/peers
. "$ROOT/tests/lib/install.sh"
install_init peers "bash tests/peers/compare.sh   (its scratch copy and venv: ${KVWIRE_PEERS_DIR:-/tmp/kvwire-peers})"
PY=$(command -v python3 || true)
[ -n "$PY" ] || die "python3 not found"

if [ "${1:-}" = "--parse" ]; then
  exec "$PY" "$HERE/compare.py" "${2:?usage: compare.sh --parse RUN_DIR}"
fi

SRC=${KVWIRE_PEERS_SRC:-$ROOT/../shared/peers}
WORK=${KVWIRE_PEERS_DIR:-/tmp/kvwire-peers}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$ROOT/target}
[ -d "$SRC" ] || { echo "peer benches not found at $SRC (set KVWIRE_PEERS_SRC)" >&2; exit 1; }

echo "== copying $SRC -> $WORK"
mkdir -p "$WORK"
cp -r "$SRC"/. "$WORK"/
chmod -R u+w "$WORK"

echo "== peers setup (apt, venv with Mooncake TE + NIXL wheels, gcc builds)"
(cd "$WORK" && bash setup.sh) || die "the peers' setup.sh (apt iperf3 libibverbs1 librdmacm1 libnuma1 gcc; a venv with the Mooncake TE and NIXL wheels; gcc builds) in $WORK"

echo "== building kvwire-bench (release)"
cargo build --release -j"${KVWIRE_JOBS:-2}" -p kvwire-bench --bin kvwire-bench || die "cargo build --release -p kvwire-bench"
BIN=$CARGO_TARGET_DIR/release/kvwire-bench

# run_all.sh plus the two kvwire entries, in the same pass (same load, same minutes)
sed -e "/^stamp done/i stamp kvwire_tcp;      timeout 600 $BIN transfer --transport tcp --no-progress --json \$R/kvwire_tcp.json" \
    -e "/^stamp done/i stamp kvwire_shm;      timeout 600 $BIN transfer --transport shm --no-progress --json \$R/kvwire_shm.json" \
    "$WORK/run_all.sh" > "$WORK/run_all_kvwire.sh"
grep -q kvwire_shm "$WORK/run_all_kvwire.sh" || { echo "could not add kvwire to run_all.sh" >&2; exit 1; }

echo "== run_all (peers + kvwire), $(date +%T)"
(cd "$WORK" && bash run_all_kvwire.sh) || die "run_all_kvwire.sh in $WORK"
RUN=$(ls -td "$WORK"/results/run_* 2>/dev/null | head -n 1 || true)
[ -n "$RUN" ] || die "run_all wrote no results/run_* directory in $WORK"
for f in kvwire_tcp.json kvwire_shm.json; do
  [ -s "$RUN/$f" ] || echo "WARNING: $RUN/$f is missing (kvwire-bench failed; see $RUN/summary.txt)" >&2
done
"$PY" "$HERE/compare.py" "$RUN" | tee "$RUN/compare.md"
echo
echo "raw results: $RUN  (summary.txt, *.json, compare.md)"
