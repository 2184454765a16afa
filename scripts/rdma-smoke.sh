#!/usr/bin/env bash
# RDMA smoke test for a host (or two) with an RDMA NIC: runs `kvpool bench transfer --protocol
# rdma` as a target process and an initiator process, WRITE then READ, and fails unless both ran
# over RDMA with every request done and no fallback to TCP (the engine's fallback flag, which
# moves with kvpool_transfer_fallback_total, stays false).
#
#   scripts/rdma-smoke.sh                      # both processes on this host (NIC loopback)
#   scripts/rdma-smoke.sh --target 10.0.0.1    # on host A: serve on 10.0.0.1:15600, wait
#   scripts/rdma-smoke.sh --initiator 10.0.0.1:15600   # on host B: drive host A's target
#
# Both hosts need the same key: KVPOOL_SMOKE_KEY_FILE=/path/to/key (default: a fresh random
# key, fine for the single-host run). The binary comes from KVPOOL_BIN, else it is built with
# `cargo build --release --features rdma`. Environment: KVPOOL_SMOKE_SECONDS (default 5),
# KVPOOL_SMOKE_BLOCK (default 1MiB), KVPOOL_SMOKE_PROTOCOL (default rdma; `tcp` only checks the
# script's plumbing on a host without a NIC).
set -euo pipefail
cd "$(dirname "$0")/.."

mode=both
addr=""
case "${1:-}" in
  "") ;;
  --target) mode=target; addr="${2:?--target needs the address to listen on}" ;;
  --initiator) mode=initiator; addr="${2:?--initiator needs host:port of the target}" ;;
  -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
  *) echo "unknown argument $1 (see --help)" >&2; exit 2 ;;
esac

protocol="${KVPOOL_SMOKE_PROTOCOL:-rdma}"
seconds="${KVPOOL_SMOKE_SECONDS:-5}"
block="${KVPOOL_SMOKE_BLOCK:-1MiB}"
work="$(mktemp -d)"
target_pid=""
target_tcp=""
cleanup() {
  if [ -n "$target_pid" ]; then kill "$target_pid" 2>/dev/null || true; wait "$target_pid" 2>/dev/null || true; fi
  rm -rf "$work"
}
trap cleanup EXIT

if [ -n "${KVPOOL_BIN:-}" ]; then
  bin="$KVPOOL_BIN"
else
  features=()
  [ "$protocol" = rdma ] && features=(--features rdma)
  cargo build --release --quiet --bin kvpool "${features[@]}"
  bin="${CARGO_TARGET_DIR:-target}/release/kvpool"
fi
[ -x "$bin" ] || { echo "FAIL: no kvpool binary at $bin" >&2; exit 1; }

if [ "$protocol" = rdma ]; then
  if command -v ibv_devinfo >/dev/null 2>&1; then
    ibv_devinfo -l || true
  else
    echo "note: ibv_devinfo not found (Debian package ibverbs-utils); continuing" >&2
  fi
fi

key="${KVPOOL_SMOKE_KEY_FILE:-}"
if [ -z "$key" ]; then
  [ "$mode" = both ] || { echo "set KVPOOL_SMOKE_KEY_FILE to the same key file on both hosts" >&2; exit 2; }
  key="$work/key"
  head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' > "$key"
fi

# Starts the target in the background; sets target_pid and target_tcp (its host:port).
start_target() {
  local listen="$1"
  "$bin" bench transfer --mode target --protocol "$protocol" --listen "$listen" \
    --auth-key-file "$key" --buffer-size 256MiB > "$work/target.out" 2> "$work/target.log" &
  target_pid=$!
  for _ in $(seq 1 300); do
    if grep -q '^kvpool-bench-target ' "$work/target.out" 2>/dev/null; then
      target_tcp="$(sed -n 's/^kvpool-bench-target tcp=\([^ ]*\) .*/\1/p' "$work/target.out")"
      return 0
    fi
    if ! kill -0 "$target_pid" 2>/dev/null; then
      echo "FAIL: the target exited:" >&2; cat "$work/target.log" >&2; return 1
    fi
    sleep 0.1
  done
  echo "FAIL: the target did not start within 30 s" >&2
  cat "$work/target.log" >&2
  return 1
}

# One initiator run; prints its JSON line and checks it.
run_initiator() {
  local target="$1" op="$2" out="$work/initiator-$2.json"
  if ! "$bin" bench transfer --mode initiator --protocol "$protocol" --target-addr "$target" \
      --auth-key-file "$key" --operation "$op" --block-size "$block" --duration "$seconds" \
      --buffer-size 256MiB --no-baselines --json > "$out" 2> "$work/initiator-$op.log"; then
    echo "FAIL: $op initiator failed (no RDMA device, or a build without feature rdma?):" >&2
    sed '/^Stack backtrace:/,$d' "$work/initiator-$op.log" >&2
    return 1
  fi
  python3 - "$out" "$protocol" "$op" <<'PY'
import json, sys
path, protocol, op = sys.argv[1:4]
with open(path) as f:
    r = json.loads(f.read().strip().splitlines()[-1])["transfer"]
problems = []
if r["protocol"] != protocol:
    problems.append(f"route is {r['protocol']}, not {protocol} (fell back at connect)")
if r.get("rdma_fallback"):
    problems.append("slices fell back to TCP during the run (kvpool_transfer_fallback_total > 0)")
if r["requests_failed"]:
    problems.append(f"{r['requests_failed']} requests failed; last: {r.get('last_failure')}")
devices = ",".join(r.get("rdma_devices") or []) or "-"
print(f"{op}: {r['gb_per_s']:.2f} GB/s over {r['protocol']} (devices {devices}), "
      f"p50/p99 batch {r['batch_latency_us_p50']}/{r['batch_latency_us_p99']} us, "
      f"{r['requests_done']} requests")
if problems:
    print("FAIL: " + "; ".join(problems), file=sys.stderr)
    sys.exit(1)
PY
}

case "$mode" in
  target)
    start_target "$addr:15600"
    echo "target serving on $target_tcp (key $key); run on the other host:"
    echo "  KVPOOL_SMOKE_KEY_FILE=<same key> scripts/rdma-smoke.sh --initiator $target_tcp"
    wait "$target_pid"
    ;;
  initiator)
    run_initiator "$addr" write
    run_initiator "$addr" read
    echo "PASS: RDMA WRITE and READ with no fallback to TCP"
    ;;
  both)
    start_target 127.0.0.1:0
    run_initiator "$target_tcp" write
    run_initiator "$target_tcp" read
    echo "PASS: $protocol WRITE and READ between two processes with no fallback to TCP"
    ;;
esac
