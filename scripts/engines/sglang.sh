#!/usr/bin/env bash
# SGLang 0.5.23 for the CPU, with torch 2.14.1, in its own environment
# (scripts/engines/common.sh). Prints the environment's path last.
#
# No PyPI wheel carries SGLang's CPU kernels (`sglang-kernel` and `sgl-kernel` are CUDA builds),
# so SGLang goes in with --no-deps and its requirements without the CUDA-only packages; the
# real-engine tests (tests/engines/sglang/) put a stand-in `sgl_kernel` and a HiCache CPU shim on
# the servers' PYTHONPATH. `ninja` (one of the requirements) ends up in the environment's bin/,
# which the tests put on PATH: SGLang builds a small C++ extension with it at run time.
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/engines/common.sh
SGLANG_VERSION=0.5.23
SGLANG_TORCH=2.14.1
dir=$(engine_venv sglang "$SGLANG_VERSION")
stamp="$dir/.kvpool-engine-stamp"
if [ ! -f "$stamp" ]; then
  # Left out: GPU kernels and CUDA toolkits that have no CPU build (or no use without a GPU).
  # torch itself comes from PyPI (its CUDA build, which runs on the CPU too) at the version the
  # wheel pins; it is pinned again so that nothing else moves it.
  cuda_only='cuda-python|flash-attn-4|flashinfer[-_]python|humming-kernels|nvidia-cutlass-dsl'
  cuda_only+='|nvidia-mathdx|nvshmem4py-cu13|quack-kernels|sgl-deep-ep|sgl-deep-gemm'
  cuda_only+='|sgl-flash-mla|sglang-kernel|sgl-kernel|tilelang'
  install_with_rewritten_requirements "$dir" "sglang==$SGLANG_VERSION" \
    "grep -v -i -E '^($cuda_only)([^a-z0-9_-]|\$)'" \
    "torch==$SGLANG_TORCH" ninja "pytest==$PYTEST_VERSION"
  touch "$stamp"
fi
echo "$dir"
