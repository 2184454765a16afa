#!/usr/bin/env bash
# Builds the kvpool Python package's distributable wheel, as the kvpool image's python stage does
# (docker/kvpool.Dockerfile): abi3 (tagged cp39-abi3: one wheel for every CPython from 3.9 on),
# the extension stripped (crates/python/pyproject.toml), linked through zig against glibc 2.28's
# symbols and tagged manylinux_2_28 (RHEL 8, Debian 10, Ubuntu 20.04 and later), whatever the
# glibc of this machine. Then `auditwheel show` reports the wheel's tags and what it links, and
# the script fails unless the wheel is abi3, manylinux_2_28 and stripped.
#   scripts/python-wheel.sh [--dev] [--out DIR] [more `maturin build` arguments, e.g. --features cuda]
# --dev builds the dev profile instead of release (much faster on a small machine; the same
# tags). Default output: target/wheels. maturin, ziglang and auditwheel, pinned, live in the
# venv .tools/wheel (maturin runs zig as `python3 -m ziglang`, from PATH).
set -euo pipefail
cd "$(dirname "$0")/.."

# The same versions as the kvpool image's build arguments (a test compares them).
MATURIN_VERSION=1.9.6
ZIGLANG_VERSION=0.12.1
AUDITWHEEL_VERSION=6.8.2
POLICY=manylinux_2_28

profile=(--release)
out="$PWD/target/wheels"
extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --dev) profile=(--profile dev) ;;
    --out) out="$(realpath -m "${2:?--out needs a directory}")"; shift ;;
    *) extra+=("$1") ;;
  esac
  shift
done

venv="$PWD/.tools/wheel"
mkdir -p "$PWD/.tools"
[ -f "$PWD/.tools/.gitignore" ] || printf '*\n' >"$PWD/.tools/.gitignore"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
stamp="$venv/.kvpool-wheel-$MATURIN_VERSION-$ZIGLANG_VERSION-$AUDITWHEEL_VERSION"
if [ ! -f "$stamp" ]; then
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
    "maturin==$MATURIN_VERSION" "ziglang==$ZIGLANG_VERSION" "auditwheel==$AUDITWHEEL_VERSION"
  touch "$stamp"
fi

mkdir -p "$out"
fresh="$(mktemp -d)"
trap 'rm -rf "$fresh"' EXIT
(cd crates/python && PATH="$venv/bin:$PATH" "$venv/bin/maturin" build --locked "${profile[@]}" \
  --zig --compatibility "$POLICY" --out "$fresh" ${extra[@]+"${extra[@]}"})
built=("$fresh"/kvpool-*.whl)
[ "${#built[@]}" = 1 ] && [ -f "${built[0]}" ] || { echo "python-wheel.sh: no wheel built" >&2; exit 1; }
wheel="$out/$(basename "${built[0]}")"
mv -f "${built[0]}" "$wheel"

"$venv/bin/auditwheel" show "$wheel"
case "$(basename "$wheel")" in
  *-cp39-abi3-"$POLICY"_x86_64.whl | *-cp39-abi3-"$POLICY"_aarch64.whl) ;;
  *) echo "python-wheel.sh: $wheel is not a cp39-abi3 $POLICY wheel" >&2; exit 1 ;;
esac
"$venv/bin/python" - "$wheel" <<'EOF'
import sys
import zipfile

# A stripped ELF file has no .symtab and no .debug_* sections.
with zipfile.ZipFile(sys.argv[1]) as z:
    name = next(n for n in z.namelist() if n.endswith(".abi3.so"))
    data = z.read(name)
shoff = int.from_bytes(data[0x28:0x30], "little")
shentsize, shnum, shstrndx = (int.from_bytes(data[o:o + 2], "little") for o in (0x3A, 0x3C, 0x3E))
sections = [data[shoff + i * shentsize: shoff + (i + 1) * shentsize] for i in range(shnum)]
strtab = sections[shstrndx]
str_off = int.from_bytes(strtab[0x18:0x20], "little")
names = []
for s in sections:
    start = str_off + int.from_bytes(s[0:4], "little")
    names.append(data[start:data.index(b"\0", start)].decode())
left = [n for n in names if n == ".symtab" or n.startswith(".debug")]
if left:
    sys.exit(f"python-wheel.sh: {name} is not stripped: {left}")
print(f"python-wheel.sh: {sys.argv[1]}: {name} {len(data) / 2**20:.1f} MiB, stripped")
EOF
