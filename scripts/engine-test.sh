#!/usr/bin/env bash
# Runs the real-engine tests (tests/engines/<engine>/, docs/testing.md "Real engines"): installs
# the engines and the test models (scripts/engines.sh), builds the kvpool binary, then runs each
# engine's pytest suite with that engine's own Python. The tests start real engine processes
# (vLLM, SGLang) or LMCache's own engine against a real kvpool pool on 127.0.0.1.
#   scripts/engine-test.sh [vllm|sglang|lmcache ...] [-- PYTEST_ARGS...]   (default: all three)
set -euo pipefail
cd "$(dirname "$0")/.."
engines=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do engines+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
[ ${#engines[@]} -gt 0 ] || engines=(vllm sglang lmcache)
scripts/engines.sh "${engines[@]}"
cargo build --quiet --bin kvpool
export KVPOOL_BIN="$PWD/target/debug/kvpool" KVPOOL_TEST_MODELS="$PWD/.tools/models"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
status=0
for e in "${engines[@]}"; do
  echo "engine-test.sh: $e"
  ".tools/$e/bin/python" -m pytest "tests/engines/$e" -q -p no:cacheprovider "$@" || status=$?
done
exit "$status"
