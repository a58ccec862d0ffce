#!/bin/bash
# tests/vm/bench_rdma.sh — `kvwire-bench transfer --transport rdma` next to perftest's
# ib_write_bw, both in ONE boot of the SoftRoCE guest (tests/vm/run.sh), at 64 KiB and 1 MiB.
# A bench, not a test: TCG makes every figure slow; only the ratios measured in the same VM
# run mean something.
#
#   bash tests/vm/bench_rdma.sh            # on the host: builds kvwire-bench (release), boots
#                                          # the VM and runs itself inside it
#   tests/vm/run.sh tests/vm/bench_rdma.sh <kvwire-bench binary>   # what the host side runs
#
# Inside the guest:
#   1. ib_write_bw rxe1 -> rxe0 (gid index 1, RoCE v2) at each size with 1 and 8 writes in
#      flight (-t 1, -t 8): the counterparts of kvwire's serial phase (one write in flight)
#      and batch phase (batches of 8 writes, one batch in flight);
#   2. `kvwire-bench transfer --serve --transport rdma` on rxe0 (KVWIRE_RDMA_DEVICE=rxe0; the
#      control connection on 127.0.0.1) and the initiator on rxe1, short plan
#      (--quick --sizes 64K,1M): every byte checked by the target and read back;
#   3. one table: kvwire serial / ib_write_bw -t 1 and kvwire batch-8 / ib_write_bw -t 8, for
#      each kvwire completion-path configuration (KVWIRE_BENCH_CONFIGS, "label:VAR=v,VAR=v ...";
#      default: default, signal1, poll200), all measured in this one boot, with the
#      initiator's CPU µs per work request (its CPU seconds per GB times the bytes of one WR:
#      each write here is one WR; in the emulated guest, SoftRoCE's work in the posting
#      thread included, so an upper bound of the posting path's cost, not a hardware figure).
# Knobs: KVWIRE_BW_ITERS_64K (default 500), KVWIRE_BW_ITERS_1M (default 32; larger sizes run
#   proportionally fewer, at least 8), KVWIRE_BENCH_MAX_SECS (per size and phase, default 10),
#   KVWIRE_BENCH_SIZES (write sizes for both benches, default "64K 1M"; K and M suffixes),
#   KVWIRE_BENCH_REGION (the target's region, default 8M: batch phase needs 8 x the largest
#   size), KVWIRE_BENCH_ARGS (more initiator arguments, e.g. "--slice-size 64K").
# The adaptive slice size, A/B in one boot (16 MiB writes cut into 64 KiB slices, fixed or
#   adaptive up to 1 MiB; ib_write_bw at 64 KiB and 16 MiB messages beside them):
#   KVWIRE_BENCH_SIZES="64K 16M" KVWIRE_BENCH_REGION=128M KVWIRE_BENCH_ARGS="--slice-size 64K" \
#   KVWIRE_BENCH_CONFIGS="fixed64k:KVWIRE_RDMA_SLICE_MAX=65536 adaptive:" bash tests/vm/bench_rdma.sh
# Exit status: 0 when both benches ran and kvwire verified every byte; 1 otherwise.
set -u
cd "$(dirname "$0")/../.."
ROOT=$(pwd)

if [ "${KVWIRE_VM_GUEST:-0}" != 1 ]; then
  set -e
  export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$ROOT/target}
  cargo build --release -j"${KVWIRE_JOBS:-2}" -p kvwire-bench --bin kvwire-bench >&2
  exec "$ROOT/tests/vm/run.sh" "$ROOT/tests/vm/bench_rdma.sh" "$CARGO_TARGET_DIR/release/kvwire-bench"
fi

BIN=${1:?usage (inside the VM): bench_rdma.sh <kvwire-bench binary>}
DEV0=${KVWIRE_RXE_DEV0:-rxe0}
DEV1=${KVWIRE_RXE_DEV1:-rxe1}
ITERS_64K=${KVWIRE_BW_ITERS_64K:-500}
ITERS_1M=${KVWIRE_BW_ITERS_1M:-32}
MAX_SECS=${KVWIRE_BENCH_MAX_SECS:-10}
REGION=${KVWIRE_BENCH_REGION:-8M}
read -r -a EXTRA <<< "${KVWIRE_BENCH_ARGS:-}"
bytes_of() { # 64K, 16M, 4096 -> bytes
  case $1 in *K) echo $((${1%K} * 1024)) ;; *M) echo $((${1%M} * 1048576)) ;; *) echo "$1" ;; esac
}
SIZES=()
for s in ${KVWIRE_BENCH_SIZES:-64K 1M}; do SIZES+=("$(bytes_of "$s")"); done
SIZE_LIST=$(IFS=,; echo "${KVWIRE_BENCH_SIZES:-64K 1M}" | tr ' ' ',')
OUT=/tmp/bench_rdma
mkdir -p "$OUT"
rc=0

echo "== devices"
rdma link show
echo "== guest: $(nproc) vCPUs, $(awk '/MemTotal/ {print $2 / 1024 " MiB"}' /proc/meminfo)"

echo "== perftest ib_write_bw $DEV1 -> $DEV0 (gid index 1, RoCE v2; Gb/s = 1e9 bit/s)"
port=18600
for size in "${SIZES[@]}"; do
  iters=$ITERS_64K
  if [ "$size" -gt 65536 ]; then
    iters=$((ITERS_1M * 1048576 / size)); [ "$iters" -lt 8 ] && iters=8
  fi
  for depth in 1 8; do
    port=$((port + 1))
    timeout 180 ib_write_bw -d "$DEV0" -x 1 -F -p $port -s "$size" -n "$iters" -t $depth --report_gbits \
      > "$OUT/srv.$size.$depth.log" 2>&1 &
    srv=$!
    for _ in $(seq 1 300); do
      ss -ltn 2>/dev/null | grep -q ":$port " && break
      sleep 0.1
    done
    timeout 180 ib_write_bw -d "$DEV1" -x 1 -F -p $port -s "$size" -n "$iters" -t $depth --report_gbits 10.0.0.1 \
      > "$OUT/cli.$size.$depth.log" 2>&1
    crc=$?
    wait $srv; src=$?
    # "#bytes #iterations BW peak[Gb/sec] BW average[Gb/sec] MsgRate[Mpps]"
    line=$(awk -v s="$size" '$1==s && NF>=5 {print; exit}' "$OUT/cli.$size.$depth.log")
    if [ $crc -ne 0 ] || [ $src -ne 0 ] || [ -z "$line" ]; then
      echo "ib_write_bw size=$size depth=$depth failed (client rc=$crc server rc=$src)"
      tail -n 15 "$OUT/cli.$size.$depth.log" "$OUT/srv.$size.$depth.log"
      rc=1
      continue
    fi
    set -- $line
    gbs=$(awk -v g="$4" 'BEGIN{printf "%.4f", g / 8}')
    echo "$gbs" > "$OUT/pt.$size.$depth"
    echo "ib_write_bw size=$size iters=$2 depth=$depth average=$4 Gb/s = $gbs GB/s"
  done
done

# kvwire configurations, all in this one boot: "default" is what the engine does unless told
# otherwise (one WRITE in 16 and the last WR of each chain signalled, every READ signalled;
# the completion thread sleeps on the channel after a 16-poll burst); "signal1" signals every
# WR; "poll200" adds a 200 µs completion-thread poll window. Configurations run in this order, so
# compare them across several boots before trusting a difference (a serial write of one slice
# is one signalled WR in every configuration: its spread across them is the noise).
CONFIGS=${KVWIRE_BENCH_CONFIGS:-"default: signal1:KVWIRE_RDMA_SIGNAL_EVERY=1 poll200:KVWIRE_RDMA_POLL_US=200"}
port=7300
labels=()
for cfg in $CONFIGS; do
  label=${cfg%%:*}
  envs=${cfg#*:}
  port=$((port + 1))
  # the knobs go to both sides (each side's completion threads)
  envargs=(); [ -n "$envs" ] && IFS=, read -r -a envargs <<< "$envs"
  echo "== kvwire-bench transfer --transport rdma [$label: ${envs:-defaults}]: serve on $DEV0, initiator on $DEV1"
  env "${envargs[@]}" KVWIRE_RDMA_DEVICE=$DEV0 timeout 600 "$BIN" transfer --serve --transport rdma --listen 127.0.0.1:$port \
    --region-size "$REGION" --serve-secs 590 > "$OUT/serve.$label.out" 2> "$OUT/serve.$label.err" &
  serve=$!
  addr=""
  for _ in $(seq 1 600); do
    addr=$(sed -n 's/^KVWIRE_BENCH_READY //p' "$OUT/serve.$label.out" 2>/dev/null | head -n 1)
    [ -n "$addr" ] && break
    kill -0 $serve 2>/dev/null || break
    sleep 0.1
  done
  if [ -z "$addr" ]; then
    echo "the kvwire-bench target did not start:"; cat "$OUT/serve.$label.out" "$OUT/serve.$label.err"
    kill $serve 2>/dev/null
    rc=1
    continue
  fi
  t0=$(date +%s.%N)
  env "${envargs[@]}" KVWIRE_RDMA_DEVICE=$DEV1 timeout 600 "$BIN" transfer --transport rdma --target "$addr" --quick \
    --sizes "$SIZE_LIST" --max-secs "$MAX_SECS" --no-progress "${EXTRA[@]}" --json "$OUT/kvwire_rdma.$label.json"
  brc=$?
  echo "kvwire-bench [$label] exit $brc in $(awk "BEGIN{printf \"%.1f\", $(date +%s.%N) - $t0}") s"
  kill $serve 2>/dev/null
  wait $serve 2>/dev/null
  if [ $brc -ne 0 ]; then
    echo "== target log [$label]"; tail -n 30 "$OUT/serve.$label.err"
    rc=1
  fi
  labels+=("$label")
done

echo "== comparison (same VM run; GB/s = 1e9 B/s)"
python3 - "$OUT" "$(IFS=,; echo "${SIZES[*]}")" "${labels[@]}" <<'EOF' || rc=1
import json, os, sys
out, sizes, labels = sys.argv[1], [int(x) for x in sys.argv[2].split(",")], sys.argv[3:]
def pt(size, depth):
    try:
        return float(open(os.path.join(out, f"pt.{size}.{depth}")).read())
    except (OSError, ValueError):
        return None
ok = bool(labels)
print("| config | size | kvwire serial p50 us | kvwire serial GB/s | ib_write_bw -t 1 GB/s | ratio | kvwire batch-8 GB/s | ib_write_bw -t 8 GB/s | ratio | initiator CPU us/write serial | batch-8 |")
print("|---|---|---|---|---|---|---|---|---|---|---|")
notes = []
for label in labels:
    try:
        d = json.load(open(os.path.join(out, f"kvwire_rdma.{label}.json")))
    except (OSError, ValueError) as e:
        notes.append(f"[{label}] no kvwire result: {e}")
        ok = False
        continue
    notes.append(f"[{label}] kvwire transport={d['transport']} verified={d['verified']} "
          f"(target checked {d['check']['verified_bytes']} bytes, {d['check']['mismatches']} mismatches; "
          f"{d['check']['read_bytes_checked']} bytes read back, {d['check']['read_mismatches']} read mismatches)")
    ok &= bool(d["verified"]) and d["transport"] == "rdma"
    rows = {(r["pattern"], r["size"]): r for r in d["results"]}
    for size in sizes:
        s, b = rows.get(("serial", size)), rows.get(("batch", size))
        p1, p8 = pt(size, 1), pt(size, 8)
        r1 = f"{s['gbps'] / p1:.2f}" if s and p1 else "n/a"
        r8 = f"{b['gbps'] / p8:.2f}" if b and p8 else "n/a"
        f = lambda x, n=4: "n/a" if x is None else f"{x:.{n}f}"
        # CPU s/GB x bytes per write = s per write; x 1e6 for us (a write is one WR when it
        # is no larger than the slice, 1 MiB unless KVWIRE_BENCH_ARGS sets it).
        wr = lambda r: None if not r or r.get("cpu_s_per_gb", {}).get("initiator") is None \
            else r["cpu_s_per_gb"]["initiator"] * size / 1e9 * 1e6
        print(f"| {label} | {size // 1024} KiB | {f(s and s['p50_us'], 1)} | {f(s and s['gbps'])} | {f(p1)} | {r1} "
              f"| {f(b and b['gbps'])} | {f(p8)} | {r8} | {f(wr(s), 1)} | {f(wr(b), 1)} |")
print("\n".join(notes))
sys.exit(0 if ok else 1)
EOF
exit $rc
