#!/usr/bin/env bash
# Writes a CycloneDX 1.5 SBOM (JSON) of the Rust code in each image, from Cargo.lock, with
# cargo-cyclonedx (scripts/tools.sh installs the pinned version):
#   OUT/kvpool/kvpool.cdx.json         ghcr.io/kvpool/kvpool: /usr/local/bin/kvpool, default features
#   OUT/kvpool/kvpool-python.cdx.json  ghcr.io/kvpool/kvpool: the extension under /opt/kvpool/python
#   OUT/kvpool-agent/kvpool.cdx.json   ghcr.io/kvpool/kvpool-agent: /usr/local/bin/kvpool, --features rdma
# Each lists every crate the binary or extension is built from, path crates of the workspace
# included, with versions, licences and package URLs; build-script-only dependencies are left out.
# It covers the Rust code only, not the base image's Debian packages (docs/images.md).
#   scripts/sbom.sh [--target TRIPLE] [OUT]   OUT defaults to target/sbom; TRIPLE to the host's
# Timestamps come from the last commit (SOURCE_DATE_EPOCH), so a rerun at the same commit
# writes the same dependency lists.
set -euo pipefail
cd "$(dirname "$0")/.."

usage() {
  echo "usage: $0 [--target TRIPLE] [OUT]" >&2
  exit 2
}

target=()
out=""
while (($#)); do
  case "$1" in
    --target) (($# >= 2)) || usage; target=(--target "$2"); shift 2 ;;
    -*) usage ;;
    *) [ -z "$out" ] || usage; out=$1; shift ;;
  esac
done
out=${out:-target/sbom}

if ! cargo cyclonedx --version >/dev/null 2>&1; then
  echo "sbom.sh: cargo-cyclonedx not found: run scripts/tools.sh" >&2
  exit 1
fi
if [ -z "${SOURCE_DATE_EPOCH:-}" ] && git rev-parse --git-dir >/dev/null 2>&1; then
  SOURCE_DATE_EPOCH=$(git log -1 --format=%ct)
  export SOURCE_DATE_EPOCH
fi

# cargo-cyclonedx writes one file beside every workspace member's Cargo.toml; a name of this
# run's own lets it collect the ones it wants and remove the rest, touching nothing else.
name="kvpool-sbom-$$"
cleanup() { find . -path ./target -prune -o -name "$name.json" -type f -print0 | xargs -0r rm -f; }
trap cleanup EXIT

# Runs cargo-cyclonedx over the workspace with the given features; leaves $name.json files.
generate() {
  cargo cyclonedx --format json --spec-version 1.5 --no-build-deps --quiet \
    --override-filename "$name" ${target[@]+"${target[@]}"} "$@"
}

mkdir -p "$out/kvpool" "$out/kvpool-agent"
generate
mv "$name.json" "$out/kvpool/kvpool.cdx.json"
mv "crates/python/$name.json" "$out/kvpool/kvpool-python.cdx.json"
cleanup
generate --features rdma
mv "$name.json" "$out/kvpool-agent/kvpool.cdx.json"
cleanup
echo "sbom.sh: wrote $out/kvpool/kvpool.cdx.json, $out/kvpool/kvpool-python.cdx.json and" \
  "$out/kvpool-agent/kvpool.cdx.json"
