#!/usr/bin/env bash
# Runs every kvpool test: installs what the tests need, then the whole workspace test suite,
# then the Python package's tests (scripts/python-test.sh: kvpool against real Mooncake), then
# the real-engine tests (scripts/engine-test.sh: vLLM, SGLang and LMCache on a real pool). The
# Rust tests find Mooncake in .tools/py (scripts/python-env.sh --tools). The engines'
# environments install in the background from the start (scripts/engines.sh --envs-only; about
# 20 GB, downloads while the workspace builds).
# Tests that need root (network namespaces) or services (etcd, Prometheus) start them on
# 127.0.0.1 themselves.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh
# Mooncake (from PyPI, pinned) for the benches' --vs-mooncake runs among the Rust tests.
scripts/python-env.sh --tools
mkdir -p target
scripts/engines.sh --envs-only >target/engines-install.log 2>&1 &
engines_install=$!
status=0
if cargo nextest --version >/dev/null 2>&1; then
  # nextest does not run doctests; run them first.
  cargo test --workspace --doc --quiet
  cargo nextest run --workspace --no-fail-fast "$@" || status=$?
else
  cargo test --workspace --no-fail-fast "$@" || status=$?
fi
scripts/python-test.sh || status=$?
if ! wait "$engines_install"; then
  cat target/engines-install.log >&2
  status=1
fi
scripts/engine-test.sh || status=$?
exit "$status"
