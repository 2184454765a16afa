#!/usr/bin/env bash
# Runs the Python package's tests (crates/python/tests): builds and installs the package into
# .tools/py (scripts/python-env.sh), then pytest. The tests start their own processes on
# 127.0.0.1: real Mooncake (mooncake_master and holders, from PyPI) and kvpool (the workspace's
# target/debug/kvpool, built first).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/python-env.sh
cargo build --quiet --bin kvpool  # a no-op when the tests already built it
exec .tools/py/bin/python -m pytest crates/python/tests -q "$@"
