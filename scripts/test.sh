#!/usr/bin/env bash
# Runs every kvpool test: installs what the tests need, then the whole workspace test suite.
# Tests that need root (network namespaces) or services (etcd, Prometheus) start them on
# 127.0.0.1 themselves.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh
if cargo nextest --version >/dev/null 2>&1; then
  cargo nextest run --workspace --no-fail-fast "$@"
  # nextest does not run doctests
  cargo test --workspace --doc
else
  cargo test --workspace --no-fail-fast "$@"
fi
