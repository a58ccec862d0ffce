#!/bin/bash
# tests/vm/rdma_suite.sh — the RDMA suite that runs INSIDE the SoftRoCE guest (one boot).
#
#   tests/vm/run.sh tests/vm/rdma_suite.sh <path-to-rdma_selftest> [--no-perftest]
#
# 1. perftest's ib_write_bw rxe1 -> rxe0 at 64 KiB and 1 MiB with the same iteration counts
#    and queue depth as the self-test's bandwidth phase, so the two can be compared as a ratio
#    measured in the same VM (TCG makes both slow in absolute terms); it runs first so the
#    self-test's error injection (bad rkeys, dead peer) cannot disturb it;
# 2. kvwire's verbs self-test (transfer/examples/rdma_selftest.rs) between rxe1 -> rxe0,
#    with KVWIRE_REQUIRE_RDMA=1 so a missing device is a failure, not a skip.
# Exit status: the self-test's (perftest failures are reported but only fail the suite when
# KVWIRE_REQUIRE_PERFTEST=1).
set -u
SELFTEST=${1:?usage: rdma_suite.sh <rdma_selftest binary> [--no-perftest]}
shift
ITERS_64K=${KVWIRE_BW_ITERS_64K:-1000}
ITERS_1M=${KVWIRE_BW_ITERS_1M:-64}
DEPTH=128

[ "${KVWIRE_VM_GUEST:-0}" = 1 ] || echo "warning: not inside the kvwire VM (KVWIRE_VM_GUEST unset)" >&2
echo "== devices"
rdma link show
ibv_devinfo -d rxe0 2>/dev/null | grep -E 'hca_id|state|active_mtu|link_layer' || true

perf_rc=0
if [ "${1:-}" != "--no-perftest" ] && command -v ib_write_bw >/dev/null; then
  echo "== perftest ib_write_bw rxe1 -> rxe0 (gid index 1, RoCE v2)"
  port=18515
  # (perftest busy-polls its CQ; its -e events mode is refused for WRITE)
  for spec in "65536 $ITERS_64K poll" "1048576 $ITERS_1M poll"; do
    set -- $spec
    size=$1; iters=$2; mode=$3; port=$((port + 1))
    ev=""; [ "$mode" = event ] && ev="-e"
    timeout 120 ib_write_bw -d rxe0 -x 1 -F -p $port -s "$size" -n "$iters" -t $DEPTH $ev --report_gbits > /tmp/srv.$size.log 2>&1 &
    srv=$!
    # the client must not start before the server listens (TCG under load is slow to get there)
    for _ in $(seq 1 300); do
      ss -ltn 2>/dev/null | grep -q ":$port " && break
      sleep 0.1
    done
    timeout 120 ib_write_bw -d rxe1 -x 1 -F -p $port -s "$size" -n "$iters" -t $DEPTH $ev --report_gbits 10.0.0.1 > /tmp/cli.$size.log 2>&1
    crc=$?
    wait $srv; src=$?
    # result line: "#bytes #iterations BW peak[Gb/sec] BW average[Gb/sec] MsgRate[Mpps]";
    # --report_gbits is 10^9 bit/s, so MB/s (10^6 bytes) = Gb/s * 125
    line=$(awk -v s="$size" '$1==s && NF>=5 {print; exit}' /tmp/cli.$size.log)
    if [ $crc -ne 0 ] || [ $src -ne 0 ] || [ -z "$line" ]; then
      echo "ib_write_bw size=$size failed (client rc=$crc server rc=$src)"; tail -n 15 /tmp/cli.$size.log /tmp/srv.$size.log
      perf_rc=1
      continue
    fi
    set -- $line
    mbs=$(awk -v g="$4" 'BEGIN{printf "%.1f", g * 125}')
    echo "$mbs" > /tmp/pt.$size.$mode
    echo "PERFTEST-BW op=write size=$size iters=$2 depth=$DEPTH wait=$mode Gb/s=$4 MB/s=$mbs (average)"
  done
fi

echo "== kvwire rdma_selftest"
t0=$(date +%s.%N)
KVWIRE_REQUIRE_RDMA=1 "$SELFTEST" ${KVWIRE_SELFTEST_ARGS:-} --dev-a rxe1 --dev-b rxe0 --iters-64k "$ITERS_64K" --iters-1m "$ITERS_1M" \
  | tee /tmp/selftest.log
rc=${PIPESTATUS[0]}
if [ "$rc" != 0 ]; then echo "== rxe counters after failure"; rdma statistic show 2>/dev/null; fi
echo "selftest exit $rc in $(awk "BEGIN{printf \"%.1f\", $(date +%s.%N) - $t0}") s"

echo "== comparison (same VM, same sizes/iterations/depth; MB = 10^6 bytes)"
for size in 65536 1048576; do
  ours=$(grep -o "SELFTEST-BW op=write size=$size .*MB/s=[0-9.]*" /tmp/selftest.log | sed 's/.*MB\/s=//')
  for mode in poll; do
    pt=$(cat /tmp/pt.$size.$mode 2>/dev/null)
    ratio=$(awk -v a="${ours:-0}" -v b="${pt:-0}" 'BEGIN{ if (b > 0) printf "%.2f", a / b; else print "n/a" }')
    echo "size=$size kvwire=${ours:-n/a} MB/s ib_write_bw($mode)=${pt:-n/a} MB/s ratio=$ratio"
  done
done
[ "${KVWIRE_REQUIRE_PERFTEST:-0}" = 1 ] && [ $perf_rc -ne 0 ] && [ $rc -eq 0 ] && rc=1
exit $rc
