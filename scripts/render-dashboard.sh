#!/usr/bin/env bash
# Renders the pool dashboard (charts/kvpool/files/dashboards/kvpool-pool.json) to a PNG, to look
# at it without a Grafana: tests/observability_live.rs runs `kvpool up` under a real Prometheus
# with load for KVPOOL_DASHBOARD_LOAD_S seconds (default 60) and writes every panel's range
# query results; scripts/render-dashboard.py lays them out on the dashboard's grid.
#   scripts/render-dashboard.sh [OUT.png]      (default docs/dashboards/kvpool-pool.png)
# Needs what the test needs (scripts/deps.sh: prometheus) and matplotlib, which this script
# installs from PyPI into .tools/plot (a venv of its own) the first time.
set -euo pipefail
cd "$(dirname "$0")/.."

MATPLOTLIB_VERSION=3.10.7
out="${1:-docs/dashboards/kvpool-pool.png}"
venv="$PWD/.tools/plot"
mkdir -p .tools
[ -f .tools/.gitignore ] || printf '*\n' >.tools/.gitignore
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
stamp="$venv/.matplotlib-$MATPLOTLIB_VERSION"
if [ ! -f "$stamp" ]; then
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "matplotlib==$MATPLOTLIB_VERSION"
  touch "$stamp"
fi
data="$(mktemp --suffix=.json)"
trap 'rm -f "$data"' EXIT
KVPOOL_DASHBOARD_DATA="$data" cargo nextest run -p kvpool --test observability_live \
  -E 'test(dashboards_rules_and_metrics_reference_hold_against_a_running_pool)' --no-capture
mkdir -p "$(dirname "$out")"
"$venv/bin/python" scripts/render-dashboard.py "$data" "$out"
echo "wrote $out"
