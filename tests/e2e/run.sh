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
NS_ROCE=llm-roce
IMAGES=(kvpool-operator kvpool-agent kvpool)

log() { printf '\n=== %s\n' "$*"; }
fail() { printf 'FAIL: %s\n' "$*" >&2; dump; exit 1; }
need() { command -v "$1" >/dev/null || { echo "SKIP: $1 is not installed"; exit 0; }; }

dump() {
  kubectl get kvcachepools,prefillpools,decodepools,daemonsets,deployments,services,pods -A -o wide || true
  kubectl -n "$NS" get kvcachepool cache -o yaml || true
  kubectl -n kvpool-system logs deploy/kvpool-operator --tail=200 || true
  for d in ds/cache-agent deploy/cache-master deploy/cache-conductor deploy/synth-prefill \
    deploy/synth-decode; do
    kubectl -n "$NS" logs "$d" --all-containers --tail=50 || true
  done
  kubectl -n "$NS" get events --sort-by=.lastTimestamp || true
}

# apply_e2e FILE...: apply the suite's own manifests with the image tag filled in.
apply_e2e() {
  local f
  for f in "$@"; do
    sed "s/@VERSION@/$VERSION/g" "tests/e2e/pool/$f" | kubectl apply -f -
  done
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

# wait_ge KIND NAME JSONPATH MIN: poll until the field is an integer >= MIN.
wait_ge() {
  local kind=$1 name=$2 path=$3 min=$4 got="" deadline=$((SECONDS + TIMEOUT))
  while ((SECONDS < deadline)); do
    got=$(kubectl -n "$NS" get "$kind" "$name" -o "jsonpath=$path" 2>/dev/null || true)
    if [[ "$got" =~ ^[0-9]+$ ]] && ((got >= min)); then
      echo "ok: $kind/$name $path = $got (>= $min)"
      return 0
    fi
    sleep 2
  done
  fail "$kind/$name $path is '$got', expected a number >= $min after ${TIMEOUT}s"
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
    existing) kubectl delete namespace "$NS" "$NS_ROCE" --wait=false >/dev/null 2>&1 || true ;;
  esac
}

need kubectl
HELM=${HELM:-.tools/bin/helm}
[[ -x "$HELM" ]] || HELM=$(command -v helm) || { echo "SKIP: helm is not installed (scripts/tools.sh)"; exit 0; }
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

# deploy/ is the chart's default, namespace scope: an operator for pools in kvpool-system only.
# The suite creates pools in two namespaces of its own, so it renders the chart with the opt-in
# cluster scope instead (same objects otherwise, see docs/install.md "Permissions").
log "installing CRDs and the operator (the chart with rbac.scope=cluster)"
kubectl apply --server-side -f deploy/namespace.yaml
# No other step (issue 34): the operator creates its root key Secret, kvpool-operator-root-key,
# at its first start, and reads it at every start after.
"$HELM" template kvpool charts/kvpool --namespace kvpool-system --set rbac.scope=cluster \
  | kubectl apply --server-side -f -
kubectl -n kvpool-system rollout status deploy/kvpool-operator --timeout="${TIMEOUT}s"
kubectl -n kvpool-system get secret kvpool-operator-root-key >/dev/null \
  || fail "the operator did not create its root key Secret"
for crd in kvcachepools prefillpools decodepools; do
  kubectl wait --for=condition=Established "crd/$crd.kvpool.dev" --timeout=60s
done

log "the pool's node selector: label every node as a GPU node (kind/k3d have no GPUs)"
kubectl label nodes --all nvidia.com/gpu.present=true --overwrite
nodes=$(kubectl get nodes -o name | wc -l)

kubectl create namespace "$NS" --dry-run=client -o yaml | kubectl apply -f -

log "1. an engine pool whose KVCachePool does not exist yet reports KVCachePoolNotFound"
# The suite's own pools (tests/e2e/pool/): TCP, 256 MiB per node, NUMA policy none, and
# synthetic engines (kind custom, the kvpool CLI image, no GPU) so that everything can run.
apply_e2e prefillpool.yaml
wait_for prefillpool synth-prefill '{.status.conditions[?(@.type=="Ready")].reason}' KVCachePoolNotFound

log "2. the KVCachePool: agent DaemonSet, master, conductor with its own RBAC, config, auth key"
apply_e2e kvcachepool.yaml decodepool.yaml
for obj in daemonset/cache-agent deployment/cache-master service/cache-master \
  deployment/cache-conductor service/cache-conductor serviceaccount/cache-conductor \
  role/cache-conductor rolebinding/cache-conductor configmap/cache-config secret/cache-auth; do
  wait_for "${obj%%/*}" "${obj#*/}" '{.metadata.ownerReferences[0].kind}' KVCachePool
done
wait_for deployment cache-conductor '{.spec.template.spec.serviceAccountName}' cache-conductor
wait_for role cache-conductor '{.rules[0].resources[0]}' pods
wait_for rolebinding cache-conductor '{.subjects[0].name}' cache-conductor
sa=system:serviceaccount:$NS:cache-conductor
for verb in list watch; do
  [[ "$(kubectl auth can-i "$verb" pods -n "$NS" --as="$sa")" == yes ]] \
    || fail "the conductor's ServiceAccount cannot $verb pods"
done
[[ "$(kubectl auth can-i delete pods -n "$NS" --as="$sa" || true)" == no ]] \
  || fail "the conductor's ServiceAccount can delete pods (least privilege)"
[[ "$(kubectl auth can-i list pods -n default --as="$sa" || true)" == no ]] \
  || fail "the conductor's ServiceAccount reaches outside its namespace"
grep -q 'numaPolicy: none' <(kubectl -n "$NS" get configmap cache-config -o 'jsonpath={.data.config\.yaml}') \
  || fail "config.yaml does not carry numaPolicy: none"
wait_for kvcachepool cache '{.status.masterEndpoint}' "cache-master.$NS.svc:50051"
wait_for kvcachepool cache '{.status.conductorEndpoint}' "cache-conductor.$NS.svc:8000"
wait_for kvcachepool cache '{.status.observedGeneration}' \
  "$(kubectl -n "$NS" get kvcachepool cache -o 'jsonpath={.metadata.generation}')"

log "3. engine pools reconcile as soon as the pool exists (watch mapping); everything gets Ready"
wait_for deployment synth-prefill '{.metadata.ownerReferences[0].kind}' PrefillPool
wait_for deployment synth-decode '{.metadata.ownerReferences[0].kind}' DecodePool
env=$(kubectl -n "$NS" get deploy synth-prefill -o 'jsonpath={.spec.template.spec.containers[0].env[?(@.name=="KVPOOL_MASTER")].value}')
[[ "$env" == "cache-master.$NS.svc:50051" ]] || fail "KVPOOL_MASTER is '$env'"
limits=$(kubectl -n "$NS" get deploy synth-prefill -o 'jsonpath={.spec.template.spec.containers[0].resources.limits}')
[[ "$limits" != *nvidia.com/gpu* ]] || fail "a gpus: 0 engine requests a GPU: $limits"
wait_for prefillpool synth-prefill '{.status.readyReplicas}' 1
wait_for decodepool synth-decode '{.status.readyReplicas}' 1
wait_for prefillpool synth-prefill '{.status.conditions[?(@.type=="Ready")].status}' True
wait_for decodepool synth-decode '{.status.conditions[?(@.type=="Ready")].status}' True
# The conductor is ready once it has discovered a prefill and a decode engine (pods list/watch
# through its Role), and the pool is Ready once agents, master and conductor are.
wait_for kvcachepool cache '{.status.conditions[?(@.type=="Ready")].status}' True
wait_for kvcachepool cache '{.status.nodesReady}' "$nodes"

log "4. the master's figures reach the status: MasterReachable, nodesRegistered, tier usage"
wait_for kvcachepool cache '{.status.conditions[?(@.type=="MasterReachable")].status}' True
wait_for kvcachepool cache '{.status.nodesRegistered}' "$nodes"
wait_ge kvcachepool cache '{.status.objects}' 0
# The chart's default: every agent joined with its own node's credential from the operator's
# issuer (no Secret in the agent pods, masters bind agents to their nodes).
args=$(kubectl -n "$NS" get deploy cache-master -o 'jsonpath={.spec.template.spec.containers[0].args}')
[[ "$args" != *--shared-agent-credentials* ]] || fail "the master lets agents share credentials"
vols=$(kubectl -n "$NS" get ds cache-agent -o 'jsonpath={.spec.template.spec.volumes[*].secret.secretName}')
[[ -z "$vols" ]] || fail "agent pods mount Secrets: $vols"
issued=$(kubectl get --raw "/api/v1/namespaces/kvpool-system/services/kvpool-operator-metrics:admin/proxy/metrics" \
  | awk '/^kvpool_operator_agent_credentials_total\{outcome="issued"\}/ {print $2}')
[[ "${issued%.*}" -ge "$nodes" ]] 2>/dev/null || fail "the issuer issued '${issued}' credentials for $nodes nodes"
echo "ok: $issued agent credentials issued for $nodes nodes"
[[ -n "$(kubectl -n "$NS" get kvcachepool cache -o 'jsonpath={.status.dram.capacity}')" ]] \
  || fail "no DRAM capacity in the status"
[[ -n "$(kubectl -n "$NS" get kvcachepool cache -o 'jsonpath={.status.dram.used}')" ]] \
  || fail "no DRAM usage in the status"
if command -v curl >/dev/null; then
  # One request through the conductor: prefill on one engine, decode on the other; the KV
  # blocks go into the pool, so the master's object count (and the status) grows.
  kubectl -n "$NS" port-forward svc/cache-conductor 18000:8000 >/dev/null 2>&1 &
  pf=$!
  ok=0
  for _ in $(seq 30); do
    if curl -fsS -m 10 http://127.0.0.1:18000/v1/completions -H 'content-type: application/json' \
      -d "{\"model\":\"kvpool-synthetic\",\"prompt\":\"$(printf 'kvpool e2e %.0s' {1..400})\",\"max_tokens\":4}" \
      >/dev/null; then
      ok=1
      break
    fi
    sleep 2
  done
  kill "$pf" 2>/dev/null || true
  ((ok)) || fail "no completion through the conductor"
  wait_ge kvcachepool cache '{.status.objects}' 1
else
  echo "SKIP (step 4 request): curl is not installed"
fi

log "5. SR-IOV with one resource per rail: every rail's VF resource is requested by the agent"
kubectl create namespace "$NS_ROCE" --dry-run=client -o yaml | kubectl apply -f -
sed "s/^  namespace: llm$/  namespace: $NS_ROCE/" deploy/examples/roce-sriov/kvcachepool.yaml \
  | kubectl apply -f -
NS=$NS_ROCE wait_for daemonset cache-agent '{.metadata.ownerReferences[0].kind}' KVCachePool
for rail in 0 1 2 3 4 5 6 7; do
  NS=$NS_ROCE wait_for daemonset cache-agent \
    "{.spec.template.spec.containers[0].resources.requests.nvidia\.com/roce_vf_rail$rail}" 1
done
nets=$(kubectl -n "$NS_ROCE" get ds cache-agent \
  -o 'jsonpath={.spec.template.metadata.annotations.k8s\.v1\.cni\.cncf\.io/networks}')
[[ "$nets" == *roce-rail-7* ]] || fail "the Multus annotation lacks the rails: '$nets'"
# Both forms at once is refused by the CRD's CEL rule, naming the field.
if out=$(sed -e "s/^  namespace: llm$/  namespace: $NS_ROCE/" -e 's/^  name: cache$/  name: both/' \
  -e 's|^    sriov:$|    sriov:\n      resourceName: nvidia.com/roce_vf|' \
  deploy/examples/roce-sriov/kvcachepool.yaml | kubectl apply -f - 2>&1); then
  fail "a pool with both sriov.resourceName and sriov.resources was accepted"
fi
[[ "$out" == *"set exactly one of resourceName"* ]] || fail "unexpected refusal: $out"
kubectl delete namespace "$NS_ROCE" --wait=false

log "6. the auth key is never overwritten"
key=$(kubectl -n "$NS" get secret cache-auth -o 'jsonpath={.data.key}')
kubectl -n "$NS" annotate kvcachepool cache e2e/touch="$(date +%s)" --overwrite
kubectl -n "$NS" patch kvcachepool cache --type merge -p '{"spec":{"blockSizeTokens":256}}'
wait_for kvcachepool cache '{.status.observedGeneration}' \
  "$(kubectl -n "$NS" get kvcachepool cache -o 'jsonpath={.metadata.generation}')"
[[ "$(kubectl -n "$NS" get secret cache-auth -o 'jsonpath={.data.key}')" == "$key" ]] \
  || fail "the auth key changed"

log "7. drift is repaired: a deleted child comes back"
kubectl -n "$NS" delete service cache-master
wait_for service cache-master '{.metadata.ownerReferences[0].kind}' KVCachePool

log "8. turning the conductor off deletes its children by label"
kubectl -n "$NS" patch kvcachepool cache --type merge -p '{"spec":{"conductor":{"enabled":false}}}'
wait_gone deployment cache-conductor
wait_gone service cache-conductor
wait_gone rolebinding cache-conductor
wait_gone role cache-conductor
wait_gone serviceaccount cache-conductor
wait_for kvcachepool cache '{.status.conductorEndpoint}' ""

log "9. an invalid spec that the schema lets through gets an Event and a condition"
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

log "10. deleting the pool removes every child (owner references, no finalizer)"
kubectl -n "$NS" delete prefillpool synth-prefill
kubectl -n "$NS" delete decodepool synth-decode
kubectl -n "$NS" delete kvcachepool cache "$long"
wait_gone daemonset cache-agent
wait_gone deployment cache-master
wait_gone secret cache-auth
wait_gone deployment synth-prefill
wait_gone deployment synth-decode

log "PASS"
