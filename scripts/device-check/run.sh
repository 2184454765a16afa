#!/usr/bin/env bash
# The GPU device check (docs/testing.md, "GPU device check"), run on a machine with an NVIDIA
# GPU, its driver and a Python with PyTorch (CUDA), and no package registry. Takes what
# scripts/device-check/prepare.sh put in .device-check/ (the kvpool binary, the cuda wheel and
# these scripts), installs the wheel into a venv that sees the system's torch, starts
# `kvpool up` (a master and two agents with 4 GiB of DRAM each), and runs device_check.py:
# KV-shaped tensors on the GPU put and got through the Python API and through the vLLM
# connector's worker side (BlockIO), in direct, integrity and agent modes, every byte checked,
# GB/s beside torch's own device<->host copies and the host-only path. Results go to
# $OUT/device-check.json (or ./device-check.json) and the log to $OUT/device-check.log.
# Usage: .device-check/run.sh [--device cuda|cpu] [--mib N]
#   --device cpu runs the same flow on host tensors (a machine without a GPU: checks the script).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${OUT:-$PWD}
mkdir -p "$out"
exec > >(tee "$out/device-check.log") 2>&1
py=${PYTHON:-python3}
command -v nvidia-smi >/dev/null && nvidia-smi || echo "device-check: no nvidia-smi"
"$py" -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available())'
venv=$(mktemp -d)/venv
"$py" -m venv --system-site-packages "$venv"
"$venv/bin/pip" install --no-index --no-deps --quiet "$here"/kvpool-*.whl
dir=$(mktemp -d)
"$here/kvpool" up --json --dir "$dir/up" --agents 2 --agent-dram 4GiB --prefill 1 --decode 1 \
  >"$dir/ready.json" 2>"$out/kvpool-up.log" &
up=$!
trap 'kill -TERM $up 2>/dev/null; wait $up 2>/dev/null || true' EXIT
for _ in $(seq 1 300); do
  [[ -s "$dir/ready.json" ]] && break
  kill -0 $up 2>/dev/null || { echo "device-check: kvpool up exited"; tail -30 "$out/kvpool-up.log"; exit 1; }
  sleep 0.2
done
"$venv/bin/python" "$here/device_check.py" --ready "$dir/ready.json" --out "$out/device-check.json" "$@"
