#!/usr/bin/env bash
# Prepares what the GPU device check carries to a machine with no package registry
# (docs/testing.md, "GPU device check"): a release, stripped `kvpool` binary and the kvpool
# wheel built with feature `cuda` (release, stripped, abi3), both in .device-check/ (ignored by
# git; pass it as the device tool's `carry`). Fails when the wheel is over 60 MiB.
# Usage: scripts/device-check/prepare.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
out=.device-check
rm -rf "$out" && mkdir -p "$out"
scripts/python-env.sh --tools >/dev/null  # maturin lives in .tools/py
cargo build --release --locked -p kvpool --bin kvpool
install -m 0755 target/release/kvpool "$out/kvpool"
strip "$out/kvpool"
.tools/py/bin/maturin build --release --locked --strip --features cuda \
  -m crates/python/Cargo.toml --interpreter .tools/py/bin/python --out "$out"
cp scripts/device-check/run.sh scripts/device-check/device_check.py "$out/"
wheel=$(ls "$out"/kvpool-*.whl)
size=$(stat -c %s "$wheel")
echo "prepare: $(basename "$wheel") $((size / 1048576)) MiB, kvpool $(( $(stat -c %s "$out/kvpool") / 1048576 )) MiB"
if (( size > 60 * 1048576 )); then
  echo "prepare: the wheel is over 60 MiB" >&2
  exit 1
fi
