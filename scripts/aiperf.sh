#!/usr/bin/env bash
# A bounded aiperf load against `kvpool up` (all on 127.0.0.1): chat completions, streamed,
# with the server's token counts (`--use-server-token-count`, which makes aiperf ask for
# `stream_options.include_usage`). Not part of CI: aiperf's venv is about 1.2 GB.
#   scripts/aiperf.sh [REQUESTS [CONCURRENCY]]     (defaults: 200 requests, 8 at a time)
# Environment: KVPOOL_BIN (default: target/debug/kvpool, built first), AIPERF_VENV (default:
# .tools/aiperf, created with the pinned aiperf), ENDPOINT_TYPE (chat or completions),
# AIPERF_OUT (where aiperf's artifacts are kept; default .tools/aiperf-out).
# aiperf needs a tokenizer to build its prompts and cannot reach a model hub here, so the
# script writes a byte-level one (every byte one token) into the run's directory. The
# summary (aiperf's JSON export) is printed; docs/benchmarks.md records a run.
set -euo pipefail
cd "$(dirname "$0")/.."

AIPERF_VERSION=0.13.0
requests="${1:-200}"
concurrency="${2:-8}"
endpoint_type="${ENDPOINT_TYPE:-chat}"
venv="${AIPERF_VENV:-$PWD/.tools/aiperf}"
out="${AIPERF_OUT:-$PWD/.tools/aiperf-out}"
mkdir -p .tools
[ -f .tools/.gitignore ] || printf '*\n' >.tools/.gitignore
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
if [ ! -f "$venv/.kvpool-aiperf-$AIPERF_VERSION" ]; then
  "$venv/bin/pip" install --quiet --disable-pip-version-check "aiperf==$AIPERF_VERSION"
  touch "$venv/.kvpool-aiperf-$AIPERF_VERSION"
fi
if [ -z "${KVPOOL_BIN:-}" ]; then
  cargo build --quiet --bin kvpool
  KVPOOL_BIN="$PWD/target/debug/kvpool"
  [ -n "${CARGO_TARGET_DIR:-}" ] && KVPOOL_BIN="$CARGO_TARGET_DIR/debug/kvpool"
fi

run="$(mktemp -d)"
up_pid=""
cleanup() {
  if [ -n "$up_pid" ] && kill -0 "$up_pid" 2>/dev/null; then
    kill -TERM "$up_pid"
    wait "$up_pid" || true
  fi
  rm -rf "$run"
}
trap cleanup EXIT

# A byte-level tokenizer: 256 tokens, no merges; decoding gives the bytes back.
"$venv/bin/python" - "$run/tokenizer" <<'PY'
import sys
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=1 << 20).save_pretrained(sys.argv[1])
PY

mkfifo "$run/ready"
"$KVPOOL_BIN" up --json --dir "$run/up" --agents 1 --prefill 2 --decode 1 \
  >"$run/ready" 2>"$run/up.log" &
up_pid=$!
read -r line <"$run/ready" || { echo "kvpool up did not start:"; tail -20 "$run/up.log"; exit 1; }
url="$(printf '%s' "$line" | "$venv/bin/python" -c 'import json,sys; print(json.load(sys.stdin)["conductor"])')"
echo "aiperf.sh: kvpool up ready, conductor at $url"

rm -rf "$out"
timeout 600 "$venv/bin/aiperf" profile \
  --model kvpool-synthetic --url "$url" --endpoint-type "$endpoint_type" --streaming \
  --use-server-token-count --tokenizer "$run/tokenizer" \
  --isl 512 --isl-stddev 0 --osl 32 --osl-stddev 0 --random-seed 7 \
  --request-count "$requests" --concurrency "$concurrency" \
  --no-server-metrics --ui none --artifact-dir "$out" >"$run/aiperf.log" 2>&1 || {
  echo "aiperf failed:"; tail -40 "$run/aiperf.log"; exit 1; }

export_json="$(find "$out" -name 'profile_export_aiperf.json' | head -1)"
"$venv/bin/python" - "$export_json" "$requests" <<'PY'
import json, sys

data = json.load(open(sys.argv[1]))
wanted = int(sys.argv[2])

def stat(name):
    m = data.get(name) or {}
    return {k: m.get(k) for k in ("avg", "p50", "p99", "unit") if k in m}

summary = {name: stat(name) for name in (
    "request_count", "time_to_first_token", "inter_token_latency",
    "request_latency", "output_token_throughput", "output_sequence_length",
    "input_sequence_length", "request_throughput")}
print(json.dumps(summary, indent=1))
count = (data.get("request_count") or {}).get("avg")
osl = (data.get("output_sequence_length") or {}).get("avg")
assert count == wanted, f"{count} of {wanted} requests counted"
assert not data.get("error_summary"), f"errors: {data.get('error_summary')}"
# Server token counts: every response's usage said 32 completion tokens.
assert osl == 32, f"output sequence length {osl}: server token counts missing"
print("aiperf.sh: ok")
PY
