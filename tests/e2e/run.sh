#!/usr/bin/env bash
# End-to-end checks of kvpool-operator on a real Kubernetes cluster (kind or k3d). NOT run by CI:
# the build machines have no container engine and no cluster. See docs/testing.md.
#
#   tests/e2e/run.sh                 # create a kind cluster, build and load images, run, delete
#   KVPOOL_E2E_CLUSTER=existing tests/e2e/run.sh   # use the current kubectl context as it is
#
# Environment:
#   KVPOOL_E2E_CLUSTER   kind (default) | k3d | existing
#   KVPOOL_E2E_NAME      cluster name (default kvpool-e2e)
#   KVPOOL_E2E_KEEP=1    keep the cluster (and the test namespace) afterwards
#   KVPOOL_E2E_BUILD=0   do not build images (they must already be in the cluster or a registry)
#   KVPOOL_E2E_TIMEOUT   seconds to wait for each condition (default 300)
set -euo pipefail
cd "$(dirname "$0")/../.."

CLUSTER=${KVPOOL_E2E_CLUSTER:-kind}
NAME=${KVPOOL_E2E_NAME:-kvpool-e2e}
TIMEOUT=${KVPOOL_E2E_TIMEOUT:-300}
VERSION=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -n1)
NS=llm
IMAGES=(kvpool-operator kvpool-agent kvpool)

log() { printf '\n=== %s\n' "$*"; }
fail() { printf 'FAIL: %s\n' "$*" >&2; dump; exit 1; }
need() { command -v "$1" >/dev/null || { echo "SKIP: $1 is not installed"; exit 0; }; }

dump() {
  kubectl get kvcachepools,prefillpools,decodepools,daemonsets,deployments,services,pods -A -o wide || true
  kubectl -n kvpool-system logs deploy/kvpool-operator --tail=200 || true
  kubectl -n "$NS" get events --sort-by=.lastTimestamp || true
}

# wait_for KIND NAME JSONPATH VALUE: poll until the field equals VALUE.
wait_for() {
  local kind=$1 name=$2 path=$3 want=$4 got="" deadline=$((SECONDS + TIMEOUT))
  while ((SECONDS < deadline)); do
    got=$(kubectl -n "$NS" get "$kind" "$name" -o "jsonpath=$path" 2>/dev/null || true)
    [[ "$got" == "$want" ]] && { echo "ok: $kind/$name $path = $want"; return 0; }
    sleep 2
  done
  fail "$kind/$name $path is '$got', expected '$want' after ${TIMEOUT}s"
}

# wait_gone KIND NAME: poll until the object no longer exists.
wait_gone() {
  local deadline=$((SECONDS + TIMEOUT))
  while ((SECONDS < deadline)); do
    kubectl -n "$NS" get "$1" "$2" >/dev/null 2>&1 || { echo "ok: $1/$2 deleted"; return 0; }
    sleep 2
  done
  fail "$1/$2 still exists after ${TIMEOUT}s"
}

cleanup() {
  [[ "${KVPOOL_E2E_KEEP:-0}" == 1 ]] && return
  case "$CLUSTER" in
    kind) kind delete cluster --name "$NAME" >/dev/null 2>&1 || true ;;
    k3d) k3d cluster delete "$NAME" >/dev/null 2>&1 || true ;;
    existing) kubectl delete namespace "$NS" --wait=false >/dev/null 2>&1 || true ;;
  esac
}

need kubectl
case "$CLUSTER" in
  kind) need kind; need docker ;;
  k3d) need k3d; need docker ;;
  existing) ;;
  *) echo "KVPOOL_E2E_CLUSTER must be kind, k3d or existing" >&2; exit 2 ;;
esac
trap cleanup EXIT

if [[ "$CLUSTER" == kind ]]; then
  log "creating kind cluster $NAME"
  kind create cluster --name "$NAME" --wait 120s
elif [[ "$CLUSTER" == k3d ]]; then
  log "creating k3d cluster $NAME"
  k3d cluster create "$NAME" --wait
fi

if [[ "${KVPOOL_E2E_BUILD:-1}" == 1 && "$CLUSTER" != existing ]]; then
  for image in "${IMAGES[@]}"; do
    dockerfile=docker/${image#kvpool-}.Dockerfile
    log "building ghcr.io/kvpool/$image:$VERSION ($dockerfile)"
    docker build -f "$dockerfile" -t "ghcr.io/kvpool/$image:$VERSION" .
    if [[ "$CLUSTER" == kind ]]; then
      kind load docker-image --name "$NAME" "ghcr.io/kvpool/$image:$VERSION"
    else
      k3d image import -c "$NAME" "ghcr.io/kvpool/$image:$VERSION"
    fi
  done
fi

log "installing CRDs and the operator (kubectl apply -k deploy/)"
kubectl apply --server-side -k deploy/
kubectl -n kvpool-system rollout status deploy/kvpool-operator --timeout="${TIMEOUT}s"
for crd in kvcachepools prefillpools decodepools; do
  kubectl wait --for=condition=Established "crd/$crd.kvpool.dev" --timeout=60s
done

log "the example's node selector: label every node as a GPU node (kind/k3d have no GPUs)"
kubectl label nodes --all nvidia.com/gpu.present=true --overwrite

kubectl create namespace "$NS" --dry-run=client -o yaml | kubectl apply -f -

log "1. an engine pool whose KVCachePool does not exist yet reports KVCachePoolNotFound"
kubectl apply -f deploy/examples/tcp/prefillpool.yaml
wait_for prefillpool qwen-prefill '{.status.conditions[?(@.type=="Ready")].reason}' KVCachePoolNotFound

log "2. the TCP-only KVCachePool: agent DaemonSet, master, conductor, config, auth key"
kubectl apply -k deploy/examples/tcp/
for obj in daemonset/cache-agent deployment/cache-master service/cache-master \
  deployment/cache-conductor service/cache-conductor configmap/cache-config secret/cache-auth; do
  wait_for "${obj%%/*}" "${obj#*/}" '{.metadata.ownerReferences[0].kind}' KVCachePool
done
wait_for kvcachepool cache '{.status.masterEndpoint}' "cache-master.$NS.svc:50051"
wait_for kvcachepool cache '{.status.observedGeneration}' \
  "$(kubectl -n "$NS" get kvcachepool cache -o 'jsonpath={.metadata.generation}')"
wait_for kvcachepool cache '{.status.conditions[?(@.type=="Ready")].status}' True

log "3. the engine pools reconcile as soon as the pool exists (watch mapping)"
wait_for deployment qwen-prefill '{.metadata.ownerReferences[0].kind}' PrefillPool
wait_for deployment qwen-decode '{.metadata.ownerReferences[0].kind}' DecodePool
env=$(kubectl -n "$NS" get deploy qwen-prefill -o 'jsonpath={.spec.template.spec.containers[0].env[?(@.name=="KVPOOL_MASTER_ADDR")].value}')
[[ "$env" == "cache-master.$NS.svc:50051" ]] || fail "KVPOOL_MASTER_ADDR is '$env'"
# No GPUs in kind: the engines stay Pending, and the pool says so.
wait_for prefillpool qwen-prefill '{.status.conditions[?(@.type=="Progressing")].status}' True

log "4. the auth key is never overwritten"
key=$(kubectl -n "$NS" get secret cache-auth -o 'jsonpath={.data.key}')
kubectl -n "$NS" annotate kvcachepool cache e2e/touch="$(date +%s)" --overwrite
kubectl -n "$NS" patch kvcachepool cache --type merge -p '{"spec":{"blockSizeTokens":256}}'
wait_for kvcachepool cache '{.status.observedGeneration}' \
  "$(kubectl -n "$NS" get kvcachepool cache -o 'jsonpath={.metadata.generation}')"
[[ "$(kubectl -n "$NS" get secret cache-auth -o 'jsonpath={.data.key}')" == "$key" ]] \
  || fail "the auth key changed"

log "5. drift is repaired: a deleted child comes back"
kubectl -n "$NS" delete service cache-master
wait_for service cache-master '{.metadata.ownerReferences[0].kind}' KVCachePool

log "6. turning the conductor off deletes its children by label"
kubectl -n "$NS" patch kvcachepool cache --type merge -p '{"spec":{"conductor":{"enabled":false}}}'
wait_gone deployment cache-conductor
wait_gone service cache-conductor
wait_for kvcachepool cache '{.status.conductorEndpoint}' ""

log "7. an invalid spec that the schema lets through gets an Event and a condition"
# 60-character name: valid for the API server, too long for the children's names.
long=pool-$(printf 'x%.0s' {1..55})
cat <<YAML | kubectl apply -f -
apiVersion: kvpool.dev/v1alpha1
kind: KVCachePool
metadata: {name: $long, namespace: $NS}
spec: {transport: {protocol: tcp}}
YAML
wait_for kvcachepool "$long" '{.status.conditions[?(@.type=="Ready")].reason}' InvalidSpec
kubectl -n "$NS" get events.events.k8s.io --field-selector "regarding.name=$long,reason=InvalidSpec" \
  -o name | grep -q . || fail "no InvalidSpec event for $long"
[[ -z "$(kubectl -n "$NS" get deploy,ds -l "kvpool.dev/owner-name=$long" -o name)" ]] \
  || fail "children created for an invalid pool"

log "8. deleting the pool removes every child (owner references, no finalizer)"
kubectl -n "$NS" delete prefillpool qwen-prefill
kubectl -n "$NS" delete decodepool qwen-decode
kubectl -n "$NS" delete kvcachepool cache "$long"
wait_gone daemonset cache-agent
wait_gone deployment cache-master
wait_gone secret cache-auth
wait_gone deployment qwen-prefill

log "PASS"
