#!/usr/bin/env bash
# Creates .tools/py, the Python venv the Python package's tests and benchmark use, and installs
# the kvpool package into it from crates/python (maturin builds the Rust extension):
#   maturin, pytest, numpy, and mooncake-transfer-engine-non-cuda (real Mooncake: the oracle of
#   the conformance suite and of the transfer engine API's differential suite, its
#   `mooncake.engine`, and the peer of `kvpool bench python` and of
#   crates/python/benches/engine_api.py); pyzmq, msgpack and cbor2
#   (the independent KV-event publisher and block-hash vectors of the conductor's tests); openai
#   (the official client, against the conductor: crates/python/tests/test_openai_client.py); mypy
#   (the package's types: crates/python/tests/test_typing_and_pickle.py). Also creates .tools/router
#   with sglang-router (SGLang's Rust router, the peer of `kvpool bench conductor
#   --vs-sglang-router`), in a venv of its own so that its dependencies stay apart.
# Idempotent: pinned tools already installed are left alone; the package is always rebuilt.
#   scripts/python-env.sh            debug build of the extension (fast to build; the tests)
#   scripts/python-env.sh --release  release build (the benchmark)
#   scripts/python-env.sh --tools    the pinned tools only, no kvpool package (Mooncake for
#                                    `kvpool bench ... --vs-mooncake`, sglang-router for
#                                    `kvpool bench conductor --vs-sglang-router`, and their tests)
# Needs python3 with venv and pip (scripts/deps.sh installs them), and Mooncake's wheel needs
# libibverbs1 and librdmacm1 at run time (scripts/deps.sh installs them with the verbs headers).
set -euo pipefail
cd "$(dirname "$0")/.."

MATURIN_VERSION=1.9.6
PYTEST_VERSION=8.4.2
NUMPY_VERSION=2.2.6
MOONCAKE_VERSION=0.3.13.post1
# KV-event and block-hash tests: an independent vLLM-format publisher and hash vectors.
PYZMQ_VERSION=27.1.0
MSGPACK_VERSION=1.2.4
CBOR2_VERSION=5.7.1
# Chat-template hash vectors: Jinja2 renders the template as transformers does.
JINJA2_VERSION=3.1.6
# The conductor's OpenAI compatibility test: the official client.
OPENAI_VERSION=3.57.0
# The package's types (py.typed, _native.pyi): mypy --strict and stubtest.
MYPY_VERSION=2.4.1
ROUTER_VERSION=0.3.2

profile=dev
tools_only=0
case "${1:-}" in
  --release) profile=release ;;
  --tools) tools_only=1 ;;
  "") ;;
  *) echo "usage: $0 [--release | --tools]" >&2; exit 2 ;;
esac

root="$PWD/.tools"
venv="$root/py"
mkdir -p "$root"
[ -f "$root/.gitignore" ] || printf '*\n' >"$root/.gitignore"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
py="$venv/bin/python"
stamp="$venv/.kvpool-tools-$MATURIN_VERSION-$PYTEST_VERSION-$NUMPY_VERSION-$MOONCAKE_VERSION-$PYZMQ_VERSION-$MSGPACK_VERSION-$CBOR2_VERSION-$JINJA2_VERSION-$OPENAI_VERSION-$MYPY_VERSION"
if [ ! -f "$stamp" ]; then
  "$py" -m pip install --quiet --disable-pip-version-check \
    "maturin==$MATURIN_VERSION" "pytest==$PYTEST_VERSION" "numpy==$NUMPY_VERSION" \
    "mooncake-transfer-engine-non-cuda==$MOONCAKE_VERSION" \
    "pyzmq==$PYZMQ_VERSION" "msgpack==$MSGPACK_VERSION" "cbor2==$CBOR2_VERSION" \
    "jinja2==$JINJA2_VERSION" "openai==$OPENAI_VERSION" "mypy==$MYPY_VERSION"
  touch "$stamp"
fi
router="$root/router"
[ -x "$router/bin/python" ] || python3 -m venv "$router"
if [ ! -f "$router/.kvpool-tools-$ROUTER_VERSION" ]; then
  "$router/bin/python" -m pip install --quiet --disable-pip-version-check \
    "sglang-router==$ROUTER_VERSION"
  touch "$router/.kvpool-tools-$ROUTER_VERSION"
fi
if [ "$tools_only" = 1 ]; then
  echo "python-env.sh: pinned tools in $venv and $router"
  exit 0
fi
if [ -f crates/python/pyproject.toml ]; then
  # maturin's PEP 517 backend takes its build options from MATURIN_PEP517_ARGS.
  PATH="$venv/bin:$PATH" MATURIN_PEP517_ARGS="--profile $profile" "$py" -m pip install --quiet \
    --disable-pip-version-check --no-build-isolation --force-reinstall --no-deps ./crates/python
fi
echo "python-env.sh: $("$py" --version) in $venv (kvpool built with profile $profile)"
