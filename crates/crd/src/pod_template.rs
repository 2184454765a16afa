//! The pod template of an engine pool (`spec.template` of a `PrefillPool` or `DecodePool`): the
//! labels, annotations and pod-spec fields a user sets on the engine pods (volumes and the
//! engine container's mounts, sidecars and init containers, pull secrets, scheduling, identity).
//! The operator merges it under the fields it owns (docs/crds.md, "Engine pod template"). And a
//! reference to a key of a Secret. Pure types, no I/O.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    Affinity, Container, LocalObjectReference, PodSecurityContext, Toleration,
    TopologySpreadConstraint, Volume,
};
use kube::KubeSchema;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Name of the engine container in the engine pods: a container of this name in
/// `spec.template.spec.containers` is merged into it instead of added beside it.
pub const ENGINE_CONTAINER: &str = "engine";

/// Pattern of a DNS subdomain (Secret, ServiceAccount and class names).
const DNS_SUBDOMAIN: &str = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$";

/// What the engine pods carry besides what the operator puts there, in the shape of a pod
/// template. The operator's own fields win over it (docs/crds.md, "Engine pod template").
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct EnginePodTemplate {
    /// Labels and annotations of the engine pods.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<EnginePodMetadata>,

    /// Fields of the engine pods' spec (a subset of a core/v1 PodSpec, with its field names).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spec: Option<EnginePodSpec>,
}

/// Labels and annotations added to the engine pods (not to the Deployment).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct EnginePodMetadata {
    /// Labels of the engine pods. The operator's labels (`app.kubernetes.io/*`, `kvpool.dev/*`:
    /// the Deployment's selector among them) win over a label of the same key.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,

    /// Annotations of the engine pods. The operator's annotations (`kvpool.dev/config-hash`
    /// and, for `vllm` and `sglang`, the routing annotations) win over one of the same key.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
}

/// The pod-spec fields an engine pool may set, named as in a core/v1 PodSpec. The operator
/// owns the engine container's image, command, args, resources, security context, its `http`
/// port and readiness probe, the volumes and mounts it injects (`config`, `auth`, `socket`,
/// `kvpool-python` and the TLS ones), the init container `kvpool-python`, the node selector
/// keys of the KVCachePool and the pod's `fsGroup` and seccomp profile.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct EnginePodSpec {
    /// Containers of the engine pods. One named `engine` is merged into the engine container:
    /// its `volumeMounts`, `env`, `envFrom`, extra `ports`, `startupProbe`, `livenessProbe`,
    /// `lifecycle` and the other fields the operator does not set are kept. Any other is a
    /// sidecar, added as written.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[x_kube(merge_strategy = ListMerge::Map(vec!["name".into()]))]
    #[schemars(length(max = 16), transform = strip_nested_descriptions)]
    pub containers: Vec<Container>,

    /// Init containers, run after the operator's `kvpool-python` (restartPolicy `Always` makes
    /// one a native sidecar).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[x_kube(merge_strategy = ListMerge::Map(vec!["name".into()]))]
    #[schemars(length(max = 16), transform = strip_nested_descriptions)]
    pub init_containers: Vec<Container>,

    /// Volumes of the engine pods (a model-cache PersistentVolumeClaim, a dataset, ...), mounted
    /// by the `engine` container's `volumeMounts` or by sidecars. A volume named `shm` replaces
    /// the operator's memory-backed `/dev/shm` (e.g. to give it a `sizeLimit`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[x_kube(merge_strategy = ListMerge::Map(vec!["name".into()]))]
    #[schemars(length(max = 64), transform = strip_nested_descriptions)]
    pub volumes: Vec<Volume>,

    /// Secrets (in the pool's namespace) for pulling the engine's and sidecars' images, after
    /// the KVCachePool's `imagePullSecrets`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[x_kube(merge_strategy = ListMerge::Map(vec!["name".into()]))]
    #[schemars(length(max = 16), transform = strip_nested_descriptions)]
    pub image_pull_secrets: Vec<LocalObjectReference>,

    /// Node labels the engine pods require, besides the KVCachePool's `nodeSelector` (which
    /// wins for a key both name: engines run where the pool's agents run).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub node_selector: BTreeMap<String, String>,

    /// Node, pod and anti-pod affinity of the engine pods.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(transform = strip_nested_descriptions)]
    pub affinity: Option<Affinity>,

    /// Tolerations of the engine pods, after the KVCachePool's.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64), transform = strip_nested_descriptions)]
    pub tolerations: Vec<Toleration>,

    /// How the engine pods spread over zones or nodes (give each a `labelSelector` with the
    /// pool's selector labels, `status.selector`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 8), transform = strip_nested_descriptions)]
    pub topology_spread_constraints: Vec<TopologySpreadConstraint>,

    /// ServiceAccount (in the pool's namespace) the engine pods run as. Its token is mounted
    /// only with `automountServiceAccountToken: true`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253), regex(pattern = DNS_SUBDOMAIN))]
    pub service_account_name: Option<String>,

    /// Mount the ServiceAccount's API token into the engine pods. Default false: engines do not
    /// talk to the API server.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub automount_service_account_token: Option<bool>,

    /// PriorityClass of the engine pods.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253), regex(pattern = DNS_SUBDOMAIN))]
    pub priority_class_name: Option<String>,

    /// RuntimeClass of the engine pods (e.g. `nvidia` where the GPU runtime is not the
    /// default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253), regex(pattern = DNS_SUBDOMAIN))]
    pub runtime_class_name: Option<String>,

    /// Scheduler of the engine pods (e.g. a gang or topology-aware scheduler).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub scheduler_name: Option<String>,

    /// Seconds an engine pod gets to drain after SIGTERM before it is killed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 86_400))]
    pub termination_grace_period_seconds: Option<i64>,

    /// Pod security context (`runAsUser`, `supplementalGroups`, ...). The operator's `fsGroup`
    /// (the group that may read the pool's key) and RuntimeDefault seccomp profile win.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(transform = strip_nested_descriptions)]
    pub security_context: Option<PodSecurityContext>,
}

/// A key of a Secret in the pool's namespace, mounted as a file.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SecretKeyRef {
    /// Name of the Secret.
    #[schemars(length(min = 1, max = 253), regex(pattern = DNS_SUBDOMAIN))]
    pub name: String,

    /// The key of the Secret whose value is the file.
    #[schemars(length(min = 1, max = 253), regex(pattern = r"^[-._a-zA-Z0-9]+$"))]
    pub key: String,
}

/// Drops the descriptions below a field of a Kubernetes type (its own stays): the core/v1
/// types' documentation would make the engine-pool CRDs too large for client-side
/// `kubectl apply` (`kubectl explain pod.spec` documents them).
pub(crate) fn strip_nested_descriptions(schema: &mut schemars::Schema) {
    fn strip(v: &mut Value) {
        let Some(map) = v.as_object_mut() else { return };
        map.remove("description");
        descend(map);
    }
    fn descend(map: &mut serde_json::Map<String, Value>) {
        for (key, sub) in map.iter_mut() {
            match key.as_str() {
                "properties" | "patternProperties" => {
                    if let Some(props) = sub.as_object_mut() {
                        props.values_mut().for_each(strip);
                    }
                }
                "items" | "additionalProperties" | "not" => strip(sub),
                "allOf" | "anyOf" | "oneOf" => {
                    if let Some(list) = sub.as_array_mut() {
                        list.iter_mut().for_each(strip);
                    }
                }
                _ => {}
            }
        }
    }
    if let Some(map) = schema.as_object_mut() {
        descend(map);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nested_descriptions_go_and_the_fields_own_stays() {
        let mut schema: schemars::Schema = serde_json::from_value(serde_json::json!({
            "description": "the field",
            "type": "array",
            "items": {
                "description": "a volume",
                "type": "object",
                "properties": {
                    "description": {"description": "a property named description", "type": "string"},
                    "emptyDir": {"description": "x", "anyOf": [{"description": "y"}]}
                }
            }
        }))
        .expect("schema");
        strip_nested_descriptions(&mut schema);
        let text = serde_json::to_value(&schema).expect("json");
        assert_eq!(text["description"], "the field");
        assert!(text["items"].get("description").is_none());
        let props = &text["items"]["properties"];
        assert_eq!(props["description"], serde_json::json!({"type": "string"}));
        assert!(props["emptyDir"].get("description").is_none());
        assert!(props["emptyDir"]["anyOf"][0].get("description").is_none());
    }
}
