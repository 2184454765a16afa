//! The `PrefillPool` and `DecodePool` custom resources: groups of inference engine instances that
//! use a `KVCachePool`, one kind per serving phase. Pure types, no I/O.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{EnvVar, ResourceRequirements};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::defaults;
use super::pod_template::EnginePodTemplate;

/// Declares the spec (and, through `CustomResource`, the resource) of one engine-pool kind.
/// `PrefillPool` and `DecodePool` have the same fields, schema rules and printer columns; they
/// differ only in their names, the documentation, the phase's latency objective (`slo`) and
/// the column that shows it. One declaration keeps the two schemas from drifting apart.
macro_rules! engine_pool_spec {
    (
        $(#[doc = $doc:tt])*
        spec: $spec:ident,
        kind: $kind:tt,
        plural: $plural:tt,
        singular: $singular:tt,
        shortname: $shortname:tt,
        resource_doc: $resource_doc:tt,
        slo_column: ($slo_column:tt, $slo_path:tt, $slo_description:tt),
        pool_ref_doc: $pool_ref_doc:tt,
        slo_doc: $slo_doc:tt,
        slo: $slo:ident $(,)?
    ) => {
        $(#[doc = $doc])*
        // kube repeats keys (type_, priority) across printcolumn(...) groups by design.
        #[allow(clippy::duplicated_attributes)]
        #[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
        #[kube(
            group = "kvpool.dev",
            version = "v1alpha1",
            kind = $kind,
            plural = $plural,
            singular = $singular,
            shortname = $shortname,
            category = "kvpool",
            namespaced,
            status = "EnginePoolStatus",
            derive = "PartialEq",
            validation = Rule::new("self.metadata.name.size() <= 53 && !self.metadata.name.contains('.')").message("metadata.name must be at most 53 characters and contain no dots: it prefixes the names of Services").reason(Reason::FieldValueInvalid),
            doc = $resource_doc,
            selectable = ".spec.kvCachePoolRef.name",
            scale(
                spec_replicas_path = ".spec.replicas",
                status_replicas_path = ".status.replicas",
                label_selector_path = ".status.selector"
            ),
            printcolumn(
                name = "Pool",
                type_ = "string",
                json_path = ".spec.kvCachePoolRef.name",
                description = "The KVCachePool the engines use"
            ),
            printcolumn(
                name = "Engine",
                type_ = "string",
                json_path = ".spec.engine.kind",
                description = "Engine kind"
            ),
            printcolumn(
                name = "Replicas",
                type_ = "integer",
                json_path = ".spec.replicas",
                description = "Desired engine instances"
            ),
            printcolumn(
                name = "Ready",
                type_ = "integer",
                json_path = ".status.readyReplicas",
                description = "Engine instances ready to serve"
            ),
            printcolumn(
                name = $slo_column,
                type_ = "integer",
                json_path = $slo_path,
                description = $slo_description,
                priority = 1
            ),
            printcolumn(
                name = "Status",
                type_ = "string",
                json_path = ".status.conditions[?(@.type==\"Ready\")].reason",
                description = "Reason of the Ready condition"
            ),
            printcolumn(
                name = "Age",
                type_ = "date",
                json_path = ".metadata.creationTimestamp"
            )
        )]
        #[serde(rename_all = "camelCase")]
        #[x_kube(
            validation = Rule::new("self.resources.gpus % self.tensorParallelSize == 0").message("resources.gpus must be a multiple of tensorParallelSize").field_path(".resources.gpus").reason(Reason::FieldValueInvalid),
            validation = Rule::new("!has(self.autoscaling) || (self.replicas >= self.autoscaling.minReplicas && self.replicas <= self.autoscaling.maxReplicas)").message("replicas must lie within autoscaling.minReplicas..autoscaling.maxReplicas").field_path(".replicas").reason(Reason::FieldValueInvalid)
        )]
        pub struct $spec {
            #[doc = $pool_ref_doc]
            #[x_kube(validation = Rule::new("self == oldSelf").message("kvCachePoolRef is immutable; create a new pool instead").reason(Reason::FieldValueForbidden))]
            pub kv_cache_pool_ref: KVCachePoolRef,

            /// Engine instances (each `tensorParallelSize` GPUs wide).
            #[serde(default = "defaults::one")]
            #[schemars(range(min = 0, max = 1024))]
            pub replicas: i32,

            /// What runs in each instance.
            pub engine: EngineSpec,

            /// GPUs, RDMA and other resources of each instance.
            #[serde(default)]
            pub resources: EngineResources,

            /// GPUs one model replica is split over.
            #[serde(default = "defaults::one")]
            #[schemars(range(min = 1, max = 64))]
            pub tensor_parallel_size: i32,

            #[doc = $slo_doc]
            #[serde(default)]
            pub slo: $slo,

            /// Let the operator run between `minReplicas` and `maxReplicas` instances, driven by the
            /// conductor's `signal` (docs/operator.md, "Autoscaling"); `replicas` is then only the
            /// starting count. Absent: the engine Deployment runs `replicas` instances (set it
            /// yourself, or let an HPA or KEDA scale it through the scale subresource).
            #[serde(default, skip_serializing_if = "Option::is_none")]
            pub autoscaling: Option<AutoscalingSpec>,

            /// Labels, annotations and pod-spec fields of the engine pods (volumes and the engine
            /// container's mounts, sidecars, init containers, pull secrets, affinity,
            /// tolerations, ...), merged under the fields the operator owns; a field it had to
            /// override is named by the `TemplateConflict` condition (docs/crds.md, "Engine pod
            /// template").
            #[serde(default, skip_serializing_if = "Option::is_none")]
            pub template: Option<EnginePodTemplate>,
        }
    };
}

engine_pool_spec! {
    /// Desired state of the prefill engines: they compute the KV cache of prompts (reusing cached
    /// prefixes from the pool) and hand it to decode engines through the pool.
    spec: PrefillPoolSpec,
    kind: "PrefillPool",
    plural: "prefillpools",
    singular: "prefillpool",
    shortname: "pfp",
    resource_doc: "A group of prefill engine instances that reads and writes a KVCachePool.",
    slo_column: ("TTFT-SLO", ".spec.slo.ttftMillis", "Time-to-first-token objective, milliseconds"),
    pool_ref_doc: " The KVCachePool (same namespace) the engines read and write. Immutable.",
    slo_doc: " Latency objective of the prefill phase.",
    slo: PrefillSlo,
}

engine_pool_spec! {
    /// Desired state of the decode engines: they take prefilled KV cache from the pool and generate
    /// tokens.
    spec: DecodePoolSpec,
    kind: "DecodePool",
    plural: "decodepools",
    singular: "decodepool",
    shortname: "dcp",
    resource_doc: "A group of decode engine instances that reads a KVCachePool.",
    slo_column: ("TPOT-SLO", ".spec.slo.tpotMillis", "Time-per-output-token objective, milliseconds"),
    pool_ref_doc: " The KVCachePool (same namespace) the engines read. Immutable.",
    slo_doc: " Latency objective of the decode phase.",
    slo: DecodeSlo,
}

/// A KVCachePool in the same namespace.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct KVCachePoolRef {
    /// Name of the KVCachePool.
    #[schemars(
        length(min = 1, max = 253),
        regex(pattern = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
    )]
    pub name: String,
}

/// The inference engine of each instance.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("self.kind == 'custom' || has(self.model)").message("engine.model is required for engine.kind vllm and sglang").field_path(".model").reason(Reason::FieldValueRequired))]
pub struct EngineSpec {
    /// `vllm` and `sglang` get default arguments for disaggregated serving; `custom` runs exactly
    /// `command` and `args`.
    pub kind: EngineKind,

    /// Container image of the engine.
    #[schemars(length(min = 1, max = 1024))]
    pub image: String,

    /// Model to serve (a Hugging Face id or a path inside the container).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 1024))]
    pub model: Option<String>,

    /// Entrypoint override. For `vllm` and `sglang` the operator's default when empty.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub command: Vec<String>,

    /// Arguments appended after the operator's defaults (`vllm`, `sglang`) or used as they are
    /// (`custom`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub args: Vec<String>,

    /// Extra environment of the engine container (names unique, as in a pod).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[x_kube(merge_strategy = ListMerge::Map(vec!["name".into()]))]
    pub env: Vec<EnvVar>,
}

/// Engine implementation.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum EngineKind {
    /// vLLM with the kvpool KV connector.
    Vllm,
    /// SGLang with the kvpool KV connector.
    Sglang,
    /// Any image that follows docs/engine-contract.md.
    Custom,
}

/// Resources of one engine instance.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct EngineResources {
    /// GPUs per instance. Must be a multiple of `tensorParallelSize`.
    #[serde(default = "defaults::one")]
    #[schemars(range(min = 0, max = 64))]
    pub gpus: i32,

    /// Extended resource name of a GPU.
    #[serde(default = "defaults::gpu_resource_name")]
    #[schemars(length(min = 1, max = 253))]
    pub gpu_resource_name: String,

    /// RDMA extended resources per instance (e.g. `rdma/rdma_shared_device_a: 1` or an SR-IOV VF
    /// resource), requested and limited alike.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub rdma: BTreeMap<String, Quantity>,

    /// CPU, memory and any other requests and limits of the engine container.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub container: Option<ResourceRequirements>,
}

impl Default for EngineResources {
    fn default() -> Self {
        Self {
            gpus: defaults::one(),
            gpu_resource_name: defaults::gpu_resource_name(),
            rdma: BTreeMap::new(),
            container: None,
        }
    }
}

/// Latency objective of prefill.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PrefillSlo {
    /// Time to first token, milliseconds.
    #[serde(default = "defaults::ttft_millis")]
    #[schemars(range(min = 1, max = 3_600_000))]
    pub ttft_millis: i32,
}

impl Default for PrefillSlo {
    fn default() -> Self {
        Self {
            ttft_millis: defaults::ttft_millis(),
        }
    }
}

/// Latency objective of decode.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DecodeSlo {
    /// Time per output token, milliseconds.
    #[serde(default = "defaults::tpot_millis")]
    #[schemars(range(min = 1, max = 60_000))]
    pub tpot_millis: i32,
}

impl Default for DecodeSlo {
    fn default() -> Self {
        Self {
            tpot_millis: defaults::tpot_millis(),
        }
    }
}

/// Replica bounds for autoscaling.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("self.minReplicas <= self.maxReplicas").message("autoscaling.minReplicas must not exceed autoscaling.maxReplicas").field_path(".minReplicas").reason(Reason::FieldValueInvalid))]
pub struct AutoscalingSpec {
    /// Fewest instances.
    #[serde(default = "defaults::one")]
    #[schemars(range(min = 0, max = 1024))]
    pub min_replicas: i32,

    /// Most instances.
    #[schemars(range(min = 1, max = 1024))]
    pub max_replicas: i32,

    /// What drives the replica count.
    #[serde(default)]
    pub signal: AutoscalingSignal,
}

/// Load signal for autoscaling, as the pool's conductor measures it for the pool's role over its
/// last window (docs/scheduling.md, "Load signal").
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum AutoscalingSignal {
    /// Share of requests admitted with a predicted latency within the SLO; scale up below 99 %.
    #[default]
    SloAttainment,
    /// Requests waiting per instance; aim for 1.
    QueueDepth,
    /// p90 of the predicted TTFT (prefill) or TPOT (decode) against `slo`; aim for 0.5.
    PredictedLatency,
    /// Share of requests rejected for this phase; scale up above 1 %.
    RejectionRate,
}

/// The operator's last autoscaling decision.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct EngineAutoscalingStatus {
    /// Instances the operator runs (the engine Deployment's replicas).
    pub desired_replicas: i32,
    /// When the operator last changed the count.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_scale_time: Option<k8s_openapi::apimachinery::pkg::apis::meta::v1::Time>,
    /// The signal (`spec.autoscaling.signal`).
    pub signal: AutoscalingSignal,
    /// The signal's value at the last change, as the Event stated it (absent before one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value: Option<String>,
    /// Why the count is what it is: `ScaledUp`, `ScaledDown`, `Bounds` or `Initial`.
    pub reason: String,
}

crate::conditions::status_struct! {
    /// Observed state of a prefill or decode pool, written by the operator only.
    pub struct EnginePoolStatus {
        /// Engine instances that exist.
        #[serde(default)]
        pub replicas: i32,

        /// Engine instances ready to serve.
        #[serde(default)]
        pub ready_replicas: i32,

        /// Label selector of the instances' pods in string form (for the scale subresource).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub selector: Option<String>,

        /// Addresses (`host:port`) that serve this pool: the Service first, then ready instances.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        pub endpoints: Vec<String>,

        /// The last autoscaling decision (only with `spec.autoscaling`).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub autoscaling: Option<EngineAutoscalingStatus>,
    }
}
