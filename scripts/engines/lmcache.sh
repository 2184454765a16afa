#!/usr/bin/env bash
# LMCache 0.5.6 from PyPI, in its own environment (scripts/engines/common.sh), with pytest and
# numpy for the tests in tests/engines/lmcache. LMCache pulls PyPI's torch (a CUDA build) and
# CUDA packages; its CUDA extension does not load here, but its CPU storage path (the
# LMCacheEngine with its StorageManager, LocalCPUBackend and RemoteBackend) runs on the CPU.
# Prints the environment's path last.
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/engines/common.sh
LMCACHE_VERSION=0.5.6
dir=$(engine_venv lmcache "$LMCACHE_VERSION")
stamp="$dir/.kvpool-engine-stamp"
if [ ! -f "$stamp" ]; then
  "$dir/bin/python" "${pipq[@]}" "lmcache==$LMCACHE_VERSION" "pytest==$PYTEST_VERSION" numpy
  # Fails here, not in the tests, when the install cannot import on this machine.
  "$dir/bin/python" -c "import lmcache.v1.cache_engine, lmcache.v1.storage_backend.remote_backend" >&2
  touch "$stamp"
fi
echo "$dir"
