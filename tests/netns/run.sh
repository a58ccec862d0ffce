#!/usr/bin/env bash
# TCP across two "hosts" on one machine: two network namespaces joined by a veth pair
# (10.77.0.1 in A, 10.77.0.2 in B; the addresses exist only inside the namespaces).
#
#   1. clean link: `kvwire-bench transfer --serve` in A, the initiator in B with
#      --transport tcp --quick, sizes up to 8 MiB (so single writes are cut into slices
#      striped over the lanes). The bench checks every byte: serial writes, batches, the KV-layer
#      pattern (target-side CRC of each batch, carried by its notification), read-backs
#      (initiator-side CRC), and that every notification arrived.
#   2. a wrong shared secret must be refused (non-zero exit, "authentication" in the error).
#   3. the target is killed (SIGKILL) in the middle of a run: the initiator must exit 1
#      with an error, not hang and not report success.
#   4. the same bench with 1% of packets dropped at random by nftables on A's veth, both
#      directions, with segmentation offloads off so drops hit single MTU-sized packets;
#      the drop counter must be non-zero afterwards.
#
# Needs root, iproute2, nftables, ethtool (installed with apt when missing).
# If namespaces cannot be created: prints "SKIPPED: network namespaces unavailable: ..."
# and exits 0, or 1 when KVWIRE_REQUIRE_NETNS=1.
#
# Env: KVWIRE_BENCH_BIN (the kvwire-bench binary; built with cargo when unset),
#      KVWIRE_NETNS_TIMEOUT (seconds per bench run, default 180).
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$(pwd)
T=${KVWIRE_NETNS_TIMEOUT:-180}
LOG=$(mktemp -d /tmp/kvwire-netns.XXXXXX)
NS_A=kvwA$$
NS_B=kvwB$$
VA=kvwa$$
VB=kvwb$$
IP_A=10.77.0.1
IP_B=10.77.0.2
PORT=7000
SECRET=netns-$$-$RANDOM
SERVER_PID=
INIT_PID=

say() { echo "[netns $(date +%T)] $*"; }

skip() {
  {
    echo "################################################################"
    echo "SKIPPED: network namespaces unavailable: $*"
    echo "################################################################"
  } >&2
  if [ "${KVWIRE_REQUIRE_NETNS:-0}" = 1 ]; then
    echo "KVWIRE_REQUIRE_NETNS=1: failing instead of skipping" >&2
    exit 1
  fi
  exit 0
}

fail() {
  echo "FAIL: $*" >&2
  for f in "$LOG"/*.log; do
    [ -f "$f" ] || continue
    echo "---- $f (last 30 lines)" >&2
    tail -n 30 "$f" >&2
  done
  exit 1
}

cleanup() {
  for p in $SERVER_PID $INIT_PID; do kill "$p" 2>/dev/null; wait "$p" 2>/dev/null; done
  ip netns del "$NS_A" 2>/dev/null
  ip netns del "$NS_B" 2>/dev/null
  ip link del "$VA" 2>/dev/null
  rm -rf "$LOG"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

[ "$(id -u)" = 0 ] || skip "not running as root"

# ---- tools
missing=()
command -v ip >/dev/null || missing+=(iproute2)
command -v nft >/dev/null || missing+=(nftables)
command -v ethtool >/dev/null || missing+=(ethtool)
if [ ${#missing[@]} -gt 0 ]; then
  say "installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  if ! { apt-get update -qq && apt-get install -y -qq --no-install-recommends "${missing[@]}"; } >"$LOG/apt.log" 2>&1; then
    tail -n 5 "$LOG/apt.log" >&2
  fi
fi
command -v ip >/dev/null || skip "iproute2 (ip) is not installed and could not be installed"

# ---- the bench binary
BIN=${KVWIRE_BENCH_BIN:-}
if [ -z "$BIN" ]; then
  say "building kvwire-bench"
  cargo build -j"${KVWIRE_JOBS:-2}" -p kvwire-bench --bin kvwire-bench >"$LOG/build.log" 2>&1 || fail "cargo build"
  BIN=${CARGO_TARGET_DIR:-$ROOT/target}/debug/kvwire-bench
fi
[ -x "$BIN" ] || fail "kvwire-bench binary not found at $BIN"

# ---- namespaces and the veth pair
err=$(ip netns add "$NS_A" 2>&1) || skip "ip netns add: $err"
err=$(ip netns add "$NS_B" 2>&1) || skip "ip netns add: $err"
err=$(ip link add "$VA" type veth peer name "$VB" 2>&1) || skip "veth: $err"
ip link set "$VA" netns "$NS_A" || fail "moving $VA"
ip link set "$VB" netns "$NS_B" || fail "moving $VB"
ip -n "$NS_A" addr add $IP_A/24 dev "$VA" || fail "address A"
ip -n "$NS_B" addr add $IP_B/24 dev "$VB" || fail "address B"
for ns in "$NS_A" "$NS_B"; do ip -n "$ns" link set lo up || fail "lo up"; done
ip -n "$NS_A" link set "$VA" up || fail "link A up"
ip -n "$NS_B" link set "$VB" up || fail "link B up"
say "namespaces $NS_A ($IP_A) and $NS_B ($IP_B) joined by $VA/$VB"

start_server() { # name [region size]
  local log="$LOG/server_$1.log"
  timeout $((T + 60)) ip netns exec "$NS_A" "$BIN" transfer --serve --listen $IP_A:$PORT \
    --transport tcp --region-size "${2:-64M}" --secret "$SECRET" --serve-secs $((T + 30)) >"$log" 2>&1 &
  SERVER_PID=$!
  for _ in $(seq 1 300); do
    grep -q '^KVWIRE_BENCH_READY' "$log" && return 0
    kill -0 "$SERVER_PID" 2>/dev/null || fail "server ($1) exited before it was ready"
    sleep 0.1
  done
  fail "server ($1) not ready after 30 s"
}

stop_server() {
  kill "$SERVER_PID" 2>/dev/null
  wait "$SERVER_PID" 2>/dev/null
  SERVER_PID=
}

bench() { # name, extra args...
  local name=$1; shift
  local json="$LOG/$name.json"
  say "bench '$name': initiator in $NS_B -> $IP_A:$PORT, tcp"
  local t0=$SECONDS
  timeout "$T" ip netns exec "$NS_B" "$BIN" transfer --target $IP_A:$PORT --transport tcp \
    --quick --sizes 4K,64K,1M,8M --no-progress --json "$json" "$@" >"$LOG/$name.log" 2>&1
  local rc=$?
  cat "$LOG/$name.log"
  [ $rc -eq 0 ] || fail "bench '$name' exited with $rc"
  grep -q '^  "verified": true' "$json" || fail "bench '$name': not verified"
  grep -q '^  "transport": "tcp"' "$json" || fail "bench '$name': transport is not tcp"
  for p in serial batch kv_layer read; do
    grep -q "\"pattern\": \"$p\"" "$json" || fail "bench '$name': no $p results"
  done
  if grep -q '"verified": false' "$json"; then fail "bench '$name': a row did not verify"; fi
  say "bench '$name' verified every byte ($((SECONDS - t0)) s)"
}

# 1. clean link
start_server clean
bench clean --secret "$SECRET"

# 2. wrong secret: refused, with a clear error
timeout "$T" ip netns exec "$NS_B" "$BIN" transfer --target $IP_A:$PORT --transport tcp \
  --quick --no-progress --secret "not-$SECRET" >"$LOG/wrong_secret.log" 2>&1
rc=$?
[ $rc -ne 0 ] || fail "a wrong secret was accepted"
grep -qi "authentication" "$LOG/wrong_secret.log" || fail "wrong secret: no authentication error in the output"
say "wrong secret refused (exit $rc): $(grep -i -m1 authentication "$LOG/wrong_secret.log")"
stop_server

# 3. the target dies in the middle of a run: the initiator must stop with an error (exit 1),
#    not hang and not report success
start_server dies 128M
timeout "$T" ip netns exec "$NS_B" "$BIN" transfer --target $IP_A:$PORT --transport tcp \
  --quick --sizes 16M --max-secs 20 --no-progress --secret "$SECRET" >"$LOG/dies.log" 2>&1 &
INIT_PID=$!
sleep 2
kill -0 "$INIT_PID" 2>/dev/null || fail "the initiator finished before the target could be killed"
victims=$(ip netns pids "$NS_A")
[ -n "$victims" ] || fail "no process in $NS_A to kill"
kill -9 $victims
wait "$INIT_PID"
rc=$?
INIT_PID=
wait "$SERVER_PID" 2>/dev/null
SERVER_PID=
[ $rc -eq 1 ] || fail "initiator after the target died: exit $rc (want 1; 124 = hung)"
say "target killed mid-run: initiator stopped with exit 1: $(grep -m1 'error' "$LOG/dies.log")"

# 4. 1% random loss
if ! command -v nft >/dev/null || ! command -v ethtool >/dev/null; then
  echo "SKIPPED: loss test: nftables/ethtool not installed" >&2
  [ "${KVWIRE_REQUIRE_NETNS:-0}" = 1 ] && exit 1
  exit 0
fi
for pair in "$NS_A $VA" "$NS_B $VB"; do
  set -- $pair
  ip netns exec "$1" ethtool -K "$2" tso off gso off gro off >/dev/null 2>&1 || fail "ethtool -K $2"
done
ip netns exec "$NS_A" nft -f - <<EOF || fail "nft rules"
table inet kvwire_loss {
  chain in  { type filter hook input  priority 0; policy accept; iifname "$VA" numgen random mod 100 < 1 counter drop; }
  chain out { type filter hook output priority 0; policy accept; oifname "$VA" numgen random mod 100 < 1 counter drop; }
}
EOF
say "1% random drop on $VA (both directions), offloads off"
start_server loss
bench loss --secret "$SECRET"
stop_server
dropped=$(ip netns exec "$NS_A" nft list table inet kvwire_loss | grep -o 'packets [0-9]*' | awk '{s+=$2} END {print s+0}')
say "packets dropped by nftables: $dropped"
[ "$dropped" -gt 0 ] || fail "no packet was dropped: the loss test did not test loss"
say "PASS: tcp across namespaces, clean and with 1% loss (every byte verified), wrong secret refused, dead target reported"
