#!/usr/bin/env bash
# Runs every kvpool test: installs what the tests need, then the whole workspace test suite,
# then the Python package's tests (scripts/python-test.sh: kvpool against real Mooncake). The
# Rust tests find Mooncake in .tools/py (scripts/python-env.sh --tools).
# Tests that need root (network namespaces) or services (etcd, Prometheus) start them on
# 127.0.0.1 themselves.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh
# Mooncake (from PyPI, pinned) for the benches' --vs-mooncake runs among the Rust tests.
scripts/python-env.sh --tools
status=0
if cargo nextest --version >/dev/null 2>&1; then
  # nextest does not run doctests; run them first.
  cargo test --workspace --doc --quiet
  cargo nextest run --workspace --no-fail-fast "$@" || status=$?
else
  cargo test --workspace --no-fail-fast "$@" || status=$?
fi
scripts/python-test.sh || status=$?
exit "$status"
