#!/usr/bin/env bash
# Regenerates the packaging files derived from other sources, so that they can be committed:
#   charts/kvpool/files/crds/*.yaml  copies of crds/*.yaml (which `kvpool operator crd` writes)
#   charts/kvpool/LICENSE            a copy of LICENSE, so that the packaged chart carries it
#   deploy/kvpool.yaml               the chart rendered with deploy/values.yaml
# tests/packaging.rs fails when one is stale; with KVPOOL_BLESS=1 it rewrites them
# itself, like the other drift tests. Needs helm (scripts/tools.sh).
set -euo pipefail
cd "$(dirname "$0")/.."

helm="${HELM:-}"
if [ -z "$helm" ]; then
  if [ -x .tools/bin/helm ]; then helm=.tools/bin/helm
  elif command -v helm >/dev/null 2>&1; then helm=helm
  else echo "generate.sh: helm not found; run scripts/tools.sh" >&2; exit 1
  fi
fi

shopt -s nullglob
rm -f charts/kvpool/files/crds/*.yaml
# Only the CRD files: crds/ also holds a kustomization.yaml.
for file in crds/*.yaml; do
  if grep -qx 'kind: CustomResourceDefinition' "$file"; then
    cp "$file" charts/kvpool/files/crds/
  fi
done

cp LICENSE charts/kvpool/LICENSE

# Keep these arguments in step with DEPLOY_RELEASE, DEPLOY_NAMESPACE, DEPLOY_VALUES and KUBE_VERSION in
# tests/packaging.rs.
"$helm" template kvpool charts/kvpool --namespace kvpool-system --kube-version 1.32.0 \
  --values deploy/values.yaml >deploy/kvpool.yaml.tmp
mv deploy/kvpool.yaml.tmp deploy/kvpool.yaml
echo "generate.sh: wrote charts/kvpool/files/crds/, charts/kvpool/LICENSE and deploy/kvpool.yaml"
